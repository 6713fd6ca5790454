/*
 * server: the HTTP layer over the engine (behaviour in server.h; design in
 * docs/design/server.md).
 *
 * Threads. libmicrohttpd runs one listening thread and one thread per connection
 * (MHD_USE_THREAD_PER_CONNECTION, connections capped). A connection's thread runs the
 * access handler and, for a streamed response, the content reader; both may block, but
 * only in pkv_request_read with a short deadline (WAIT_SLICE_NS) in a loop that checks,
 * between slices, whether the client is gone (poll: POLLRDHUP/POLLHUP/POLLERR on the
 * connection's socket) and whether the server is being destroyed. A gone client's
 * request is cancelled at once (pkv_request_release), so its sequence is freed at the
 * engine's next step; the engine bounds every request by max_tokens, so no thread
 * waits forever.
 *
 * Request flow (POST /v1/completions, /v1/chat/completions):
 *   1. first call: route, method (405), path (404), Content-Length (413);
 *   2. body chunks accumulate up to max_body_bytes (more: 413 at the end);
 *   3. last call: parse (request.c; pure), tokenize and check the context, check the KV
 *      budget (400 with the numbers), count the request in flight, submit (429 with
 *      Retry-After when the queue is full, 503 when draining);
 *   4. wait for the first output: an admission failure still gets a proper status;
 *   5. non-streaming: read to the end and answer once; streaming: answer 200 with a
 *      callback response whose reader turns each engine read into SSE events.
 * Refusals happen before submission, so a refused request changes nothing but the
 * rejection counters.
 *
 * Locking. s->lock guards s->ctr (every counter and histogram), s->draining, s->next_id
 * and s->rng; s->idle_cv signals ctr.in_flight reaching 0. s->stopping is atomic (read
 * by waiting threads between slices). Nothing blocks, allocates from the OS or calls
 * into the engine or MHD under s->lock.
 */
#include "pagekv/server.h"

#include "pagekv/engine.h"
#include "pagekv/model.h"
#include "pagekv/tokenizer.h"

#include "core/core.h"
#include "kv/kv.h"
#include "prim/prim.h"
#include "server/gen.h"
#include "server/request.h"
#include "server/server_int.h"

#include <errno.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <openssl/sha.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define WAIT_SLICE_NS (100ull * 1000 * 1000)
#define SSE_BLOCK     16384

struct pkv_server {
    char *host, *served_name;
    pkv_tok_t *tok;
    pkv_model_t *model;
    pkv_kv_t *kv;
    pkv_engine_t *engine;
    pkv_server_role_t role;
    srv_kvnode_t *kvn;  /* prefill and decode roles: the transfer agent (kvnode.c) */
    srv_memwatch_t *mw; /* the cache policy's timer and memory watcher (memwatch.c) */
    struct MHD_Daemon *mhd;
    MHD_socket quiesced_fd; /* the listening socket after quiesce: closed after stop */
    uint16_t port;
    uint32_t max_context, max_batch, block_tokens, default_max_tokens, retry_after_s;
    uint64_t max_body, budget_bytes, token_bytes;
    pkv_backend_t backend;
    bool huge, huge_probe;   /* the pool asks for THP; the startup probe got a huge page */
    bool huge_granules;      /* paged: 2 MiB pages can back the pool's granules */
    pkv_prim_thp_mode_t thp; /* the kernel's THP mode at startup */
    time_t created;
    atomic_bool stopping;

    pthread_mutex_t lock; /* guards: ctr, draining, next_id, rng (see the top comment) */
    pthread_cond_t idle_cv;
    /* The pool's range in /proc/self/smaps (pkv_kv_pages), read at most every
     * SRV_PAGES_MAX_AGE_NS: the kernel builds the whole file, walking every mapping's page
     * tables (~60 ms with 2 GiB of 4 KiB staging pages), so stats polled every 100 ms
     * must not read it each time. pages_mu is held across the read. */
    pthread_mutex_t pages_mu;
    uint64_t pages_at_ns; /* when last read; 0: never */
    bool pages_ok;
    uint64_t pool_resident_bytes, pool_huge_bytes;
    srv_counters_t ctr;
    bool draining;
    uint64_t next_id;
    uint64_t rng;
};

/* One HTTP request (MHD's con_cls): created on the first call, freed when MHD reports
 * the request completed. */
typedef struct {
    srv_route_t route;
    char *body;
    size_t len, cap;
    bool too_large;
    bool in_flight; /* counted in ctr.in_flight: released in the completed callback */
    bool answered;
} http_req_t;

/* A streamed response (the content reader's state), owned by the MHD response. */
typedef struct {
    pkv_server_t *s;
    pkv_request_t *req;
    srv_gen_t gen;
    srv_req_kind_t kind;
    bool include_usage;
    char id[48];
    time_t created;
    MHD_socket fd;
    uint64_t t_submit;
    bool first_seen;
    char *buf; /* SSE bytes not yet handed to MHD */
    size_t len, pos, cap;
    bool done;         /* [DONE] queued */
    bool decode_leg;   /* a decode leg that pulled: its decode phase is counted */
    bool want_timings; /* X-Pagekv-Timings: the last chunk carries pagekv_timings */
    srv_timings_t tm;
    uint64_t admitted_ns, first_ns;
} stream_t;

/* ---- small helpers --------------------------------------------------------------------- */

static int detok(void *arg, int32_t prev, int32_t id, const char **bytes, size_t *len)
{
    return pkv_tok_decode_token(arg, prev, id, bytes, len);
}

/* The peer closed or reset its end. A pipelined next request makes the socket readable
 * but not RDHUP; a client that half-closes after sending is treated as gone. */
static bool client_gone(MHD_socket fd)
{
    if (fd == MHD_INVALID_SOCKET) return false;
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

static MHD_socket conn_fd(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : MHD_INVALID_SOCKET;
}

/* Make *buf hold at least `need` bytes: the capacity at least doubles, with `slack` bytes
 * beyond the need, and stays within `limit` (0: none; the caller keeps need <= limit). */
static bool buf_grow(char **buf, size_t *cap, size_t need, size_t slack, size_t limit)
{
    if (need <= *cap) return true;
    size_t c = PKV_MAX(*cap * 2, need + slack);
    if (limit && c > limit) c = limit;
    char *nb = realloc(*buf, c);
    if (!nb) return false;
    *buf = nb;
    *cap = c;
    return true;
}

static void count_rejection(pkv_server_t *s, srv_rejection_t why)
{
    pthread_mutex_lock(&s->lock);
    s->ctr.rejected[why]++;
    pthread_mutex_unlock(&s->lock);
}

static void in_flight_done(pkv_server_t *s)
{
    pthread_mutex_lock(&s->lock);
    PKV_ASSERT(s->ctr.in_flight > 0);
    if (--s->ctr.in_flight == 0) pthread_cond_broadcast(&s->idle_cv);
    pthread_mutex_unlock(&s->lock);
}

/* ---- responses ------------------------------------------------------------------------- */

static enum MHD_Result queue(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr, int status,
                             struct MHD_Response *resp)
{
    if (!resp) return MHD_NO;
    enum MHD_Result ok = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    pthread_mutex_lock(&s->lock);
    s->ctr.http[hr->route][srv_code_index(status)]++;
    pthread_mutex_unlock(&s->lock);
    hr->answered = true;
    return ok;
}

static struct MHD_Response *text_response(char *text, size_t len, const char *type)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return NULL;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    return r;
}

/* Answer with a JSON document (the reference is consumed). */
static enum MHD_Result answer_json(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                   int status, json_t *doc)
{
    char *text = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    if (!text) return MHD_NO;
    size_t len = strlen(text);
    /* A trailing newline is friendlier to curl users; JSON parsers ignore it. */
    char *nl = realloc(text, len + 2);
    if (!nl) {
        free(text);
        return MHD_NO;
    }
    nl[len] = '\n';
    nl[len + 1] = 0;
    return queue(s, c, hr, status, text_response(nl, len + 1, "application/json"));
}

static json_t *error_doc(const srv_error_t *err)
{
    return json_pack("{s:{s:s, s:s, s:s?, s:s}}", "error", "message", err->message, "type",
                     err->type, "param", err->param, "code", err->code);
}

/* The error document as a response (NULL on allocation failure). */
static struct MHD_Response *error_response(const srv_error_t *err)
{
    json_t *doc = error_doc(err);
    char *text = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    return text ? text_response(text, strlen(text), "application/json") : NULL;
}

static enum MHD_Result answer_error(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                    const srv_error_t *err)
{
    PKV_LOGI("server", "%s: %d %s: %s", srv_route_label[hr->route], err->status, err->code,
             err->message);
    struct MHD_Response *r = error_response(err);
    if (r && err->status == 429) {
        char ra[16];
        snprintf(ra, sizeof(ra), "%u", s->retry_after_s);
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, ra);
    }
    if (r && err->status == 503) MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, "5");
    return queue(s, c, hr, err->status, r);
}

static enum MHD_Result answer_errorf(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                     int status, const char *type, const char *code,
                                     const char *msg)
{
    srv_error_t err;
    srv_error_set(&err, status, type, code, NULL, "%s", msg);
    return answer_error(s, c, hr, &err);
}

/* ---- routing ----------------------------------------------------------------------- */

static const struct {
    const char *path;
    srv_route_t route;
    const char *allow; /* methods */
} routes[] = {
    {"/v1/completions", SRV_ROUTE_COMPLETIONS, "POST"},
    {"/v1/chat/completions", SRV_ROUTE_CHAT, "POST"},
    {"/v1/models", SRV_ROUTE_MODELS, "GET, HEAD"},
    {"/health", SRV_ROUTE_HEALTH, "GET, HEAD"},
    {"/metrics", SRV_ROUTE_METRICS, "GET, HEAD"},
    {"/v1/cache/stats", SRV_ROUTE_CACHE_STATS, "GET, HEAD"},
    {"/v1/cache/reset", SRV_ROUTE_CACHE_RESET, "POST"},
    {"/v1/cache/lookup", SRV_ROUTE_CACHE_LOOKUP, "POST"},
    {"/v1/cache/digest", SRV_ROUTE_CACHE_DIGEST, "POST"},
    {"/v1/kv_transfer/peaks/reset", SRV_ROUTE_PEAKS_RESET, "POST"},
};

static bool method_allowed(const char *allow, const char *method)
{
    if (!strcmp(method, "POST")) return !strcmp(allow, "POST");
    if (!strcmp(method, "GET") || !strcmp(method, "HEAD")) return strcmp(allow, "POST") != 0;
    return false;
}

/* ---- simple endpoints -------------------------------------------------------------------- */

static json_t *model_doc(pkv_server_t *s)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:i}", "id", s->served_name, "object", "model",
                     "created", (json_int_t)s->created, "owned_by", "pagekv", "max_model_len",
                     (int)s->max_context);
}

/* The pool's pages from smaps, read again when the last reading is older than
 * SRV_PAGES_MAX_AGE_NS. */
static void pool_pages(pkv_server_t *s, srv_snapshot_t *out)
{
    pthread_mutex_lock(&s->pages_mu);
    uint64_t now = pkv_now_ns();
    if (!s->pages_at_ns || now - s->pages_at_ns >= SRV_PAGES_MAX_AGE_NS) {
        s->pages_ok = pkv_kv_pages(s->kv, &s->pool_resident_bytes, &s->pool_huge_bytes) == PKV_OK;
        s->pages_at_ns = now = pkv_now_ns();
    }
    out->pages_ok = s->pages_ok;
    out->pool_resident_bytes = s->pool_resident_bytes;
    out->pool_huge_bytes = s->pool_huge_bytes;
    out->pages_age_ns = now - s->pages_at_ns;
    pthread_mutex_unlock(&s->pages_mu);
}

/* One snapshot of what /metrics and /v1/cache/stats render. */
static void snapshot(pkv_server_t *s, srv_snapshot_t *out)
{
    pkv_engine_stats(s->engine, &out->es);
    pkv_kv_stats(s->kv, &out->ks);
    pthread_mutex_lock(&s->lock);
    out->ctr = s->ctr;
    pthread_mutex_unlock(&s->lock);
    pkv_prim_mem_t mem;
    bool mem_ok = pkv_prim_mem_read(0, &mem) == PKV_OK;
    out->rss_bytes = mem_ok ? mem.rss_bytes : 0;
    out->locked_bytes = mem_ok ? mem.locked_bytes : 0;
    out->backend = s->backend;
    out->block_tokens = s->block_tokens;
    out->huge = s->huge;
    out->thp_mode = pkv_prim_thp_mode_name(s->thp);
    out->huge_probe = s->huge_probe;
    pool_pages(s, out);
    out->has_kv = s->kvn != NULL;
    if (s->kvn) srv_kvnode_snapshot(s->kvn, &out->kv);
    srv_memwatch_stats(s->mw, &out->mw);
}

/* An empty body or an empty JSON object: endpoints that take no parameters. */
static bool body_empty(const http_req_t *hr)
{
    if (!hr->len) return true;
    json_t *doc = json_loadb(hr->body, hr->len, 0, NULL);
    bool empty = json_is_object(doc) && json_object_size(doc) == 0;
    json_decref(doc);
    return empty;
}

static enum MHD_Result handle_peaks_reset(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr)
{
    if (!body_empty(hr)) {
        count_rejection(s, SRV_REJ_INVALID);
        return answer_errorf(s, c, hr, 400, "invalid_request_error", "invalid_json",
                             "/v1/kv_transfer/peaks/reset takes no parameters (empty body or {})");
    }
    if (!s->kvn)
        return answer_errorf(s, c, hr, 404, "not_found_error", "not_a_kv_node",
                             "/v1/kv_transfer/peaks/reset is for prefill and decode nodes "
                             "(this server runs unified)");
    json_t *doc = srv_kvnode_peaks_reset(s->kvn);
    if (!doc) return MHD_NO;
    return answer_json(s, c, hr, 200, doc);
}

static enum MHD_Result handle_cache_reset(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr)
{
    if (!body_empty(hr)) {
        count_rejection(s, SRV_REJ_INVALID);
        return answer_errorf(s, c, hr, 400, "invalid_request_error", "invalid_json",
                             "/v1/cache/reset takes no parameters (empty body or {})");
    }
    pkv_kv_stats_t before, after;
    pkv_kv_stats(s->kv, &before);
    pkv_kv_reset_cache(s->kv);
    pkv_kv_stats(s->kv, &after);
    pthread_mutex_lock(&s->lock);
    s->ctr.cache_resets++;
    pthread_mutex_unlock(&s->lock);
    uint64_t dropped =
        before.blocks_cached > after.blocks_cached ? before.blocks_cached - after.blocks_cached : 0;
    return answer_json(s, c, hr, 200,
                       json_pack("{s:b, s:I, s:I, s:I}", "reset", 1, "dropped_blocks",
                                 (json_int_t)dropped, "committed_bytes_before",
                                 (json_int_t)before.committed_bytes, "committed_bytes_after",
                                 (json_int_t)after.committed_bytes));
}

/* The prompt of a /v1/cache/lookup or /v1/cache/digest body: true with *r (free with
 * srv_request_free) and *ids / *n (free ids), or false with *ret the error answered. */
static bool cache_prompt(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                         srv_request_t *r, int32_t **ids, uint32_t *n, enum MHD_Result *ret)
{
    srv_limits_t lim = {.max_context = s->max_context};
    srv_error_t err;
    uint32_t mt = 0;
    *ids = NULL;
    *n = 0;
    if (srv_request_parse_lookup(hr->body, hr->len, s->served_name, &lim, r, &err)) {
        *ret = answer_error(s, c, hr, &err);
        return false;
    }
    if (srv_request_prompt(r, s->tok, &lim, s->default_max_tokens, ids, n, &mt, &err)) {
        *ret = answer_error(s, c, hr, &err);
        free(*ids);
        srv_request_free(r);
        return false;
    }
    return true;
}

/* POST /v1/cache/lookup: how many of the prompt's tokens this node's prefix cache holds
 * under the request's salt (the router's cache_aware policy asks; it changes nothing). */
static enum MHD_Result handle_cache_lookup(pkv_server_t *s, struct MHD_Connection *c,
                                           http_req_t *hr)
{
    srv_request_t r;
    int32_t *ids;
    uint32_t n, matched = 0;
    enum MHD_Result ret;
    if (!cache_prompt(s, c, hr, &r, &ids, &n, &ret)) return ret;
    if (pkv_kv_prefix_match(s->kv, r.salt, ids, n, &matched))
        ret = answer_errorf(s, c, hr, 500, "server_error", "out_of_memory", "out of memory");
    else
        ret = answer_json(
            s, c, hr, 200,
            json_pack("{s:i, s:i}", "matched_tokens", (int)matched, "prompt_tokens", (int)n));
    free(ids);
    srv_request_free(&r);
    return ret;
}

/* The SHA-256 of head h's K/V on rank r over blocks ids[0..n): for each block, each layer,
 * its K piece then its V piece. */
static void head_digest(pkv_kv_t *kv, uint32_t r, uint32_t h, const uint32_t *ids, uint32_t n,
                        char hexout[65])
{
    const pkv_geometry_t *g = pkv_kv_geometry(kv);
    size_t piece = (size_t)g->block_tokens * g->head_dim * pkv_dtype_size(g->dtype);
    uint8_t d[SHA256_DIGEST_LENGTH] = {0};
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL)) {
        for (uint32_t b = 0; b < n; b++)
            for (uint32_t l = 0; l < g->layers; l++)
                for (uint32_t w = 0; w < 2; w++)
                    EVP_DigestUpdate(ctx, pkv_kv_block_head_rank(kv, r, ids[b], l, w, h), piece);
        EVP_DigestFinal_ex(ctx, d, NULL);
    }
    EVP_MD_CTX_free(ctx);
    static const char x[] = "0123456789abcdef";
    for (int i = 0; i < SHA256_DIGEST_LENGTH; i++)
        hexout[2 * i] = x[d[i] >> 4], hexout[2 * i + 1] = x[d[i] & 15];
    hexout[64] = 0;
}

/* POST /v1/cache/digest (the lookup's body): the SHA-256 of each KV head's bytes over the
 * blocks of the prompt this node's prefix cache holds, per tensor-parallel rank, so two
 * nodes (or a node's ranks and a TP=1 node) can be shown to hold the same KV. It pins the
 * blocks while it reads them and changes nothing else. */
static enum MHD_Result handle_cache_digest(pkv_server_t *s, struct MHD_Connection *c,
                                           http_req_t *hr)
{
    srv_request_t r;
    int32_t *ids;
    uint32_t n, nb = 0, *blocks = NULL;
    enum MHD_Result ret;
    int rc;
    if (!cache_prompt(s, c, hr, &r, &ids, &n, &ret)) return ret;
    if ((rc = pkv_kv_prefix_pin(s->kv, r.salt, ids, n, &blocks, &nb))) {
        ret = rc == PKV_ERR_UNSUPPORTED
                  ? answer_errorf(s, c, hr, 400, "invalid_request_error", "unsupported",
                                  "/v1/cache/digest needs the paged KV backend")
                  : answer_errorf(s, c, hr, 500, "server_error", "out_of_memory", "out of memory");
    } else {
        uint32_t tp = pkv_kv_tp(s->kv);
        json_t *ranks = json_array();
        for (uint32_t k = 0; ranks && k < tp; k++) {
            pkv_kv_rank_t info;
            pkv_kv_rank(s->kv, k, &info);
            json_t *heads = json_array();
            for (uint32_t h = info.head_lo; heads && h < info.head_lo + info.head_n; h++) {
                char hx[65];
                head_digest(s->kv, k, h, blocks, nb, hx);
                json_array_append_new(heads, json_string(hx));
            }
            json_array_append_new(ranks, json_pack("{s:i, s:i, s:i, s:o*}", "rank", (int)k,
                                                   "head_lo", (int)info.head_lo, "head_n",
                                                   (int)info.head_n, "heads", heads));
        }
        if (nb) pkv_kv_unpin(s->kv, blocks, nb);
        uint32_t bt = pkv_kv_geometry(s->kv)->block_tokens;
        ret = answer_json(s, c, hr, 200,
                          json_pack("{s:i, s:i, s:i, s:i, s:o*}", "matched_tokens", (int)(nb * bt),
                                    "prompt_tokens", (int)n, "blocks", (int)nb, "tp", (int)tp,
                                    "ranks", ranks));
    }
    free(blocks);
    free(ids);
    srv_request_free(&r);
    return ret;
}

/* The client's X-Request-Id for the log: printable ASCII, at most 128 bytes ("-" when
 * absent; other bytes become '?'). */
static void request_id_of(struct MHD_Connection *c, char out[129])
{
    const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Request-Id");
    size_t n = 0;
    for (; v && v[n] && n < 128; n++) out[n] = v[n] > 0x20 && v[n] < 0x7f ? v[n] : '?';
    if (!n) out[n++] = '-';
    out[n] = 0;
}

static enum MHD_Result handle_simple(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                     const char *url)
{
    switch (hr->route) {
    case SRV_ROUTE_MODELS:
        return answer_json(s, c, hr, 200,
                           json_pack("{s:s, s:[o]}", "object", "list", "data", model_doc(s)));
    case SRV_ROUTE_MODEL: {
        const char *id = url + strlen("/v1/models/");
        if (strcmp(id, s->served_name)) {
            srv_error_t err;
            srv_error_set(&err, 404, "invalid_request_error", "model_not_found", "model",
                          "the model '%.100s' does not exist", id);
            return answer_error(s, c, hr, &err);
        }
        return answer_json(s, c, hr, 200, model_doc(s));
    }
    case SRV_ROUTE_HEALTH: {
        pthread_mutex_lock(&s->lock);
        bool draining = s->draining;
        pthread_mutex_unlock(&s->lock);
        if (!s->kvn)
            return answer_json(s, c, hr, draining ? 503 : 200,
                               json_pack("{s:s}", "status", draining ? "draining" : "ok"));
        uint64_t age = 0;
        bool agent_ok = srv_kvnode_healthy(s->kvn, &age);
        const char *status = draining ? "draining" : agent_ok ? "ok" : "kv_agent_down";
        return answer_json(s, c, hr, draining || !agent_ok ? 503 : 200,
                           json_pack("{s:s, s:s, s:s, s:s, s:I}", "status", status, "role",
                                     pkv_server_role_name(s->role), "kv_agent",
                                     agent_ok ? "ok" : "down", "kv_address",
                                     srv_kvnode_address(s->kvn), "kv_agent_progress_age_ms",
                                     (json_int_t)(age / 1000000)));
    }
    case SRV_ROUTE_METRICS: {
        srv_snapshot_t snap;
        snapshot(s, &snap);
        size_t len = 0;
        char *text = srv_metrics_render(&snap, &len);
        if (!text) return MHD_NO;
        return queue(s, c, hr, 200,
                     text_response(text, len, "text/plain; version=0.0.4; charset=utf-8"));
    }
    case SRV_ROUTE_CACHE_STATS: {
        srv_snapshot_t snap;
        snapshot(s, &snap);
        json_t *doc = srv_cache_stats_json(&snap);
        json_t *kvt = doc && snap.has_kv ? srv_kv_stats_json(&snap.kv) : NULL;
        if (kvt) {
            json_object_set_new(json_object_get(kvt, "staging"), "process_locked_bytes",
                                json_integer((json_int_t)snap.locked_bytes));
            json_object_set_new(doc, "kv_transfer", kvt);
        }
        return answer_json(s, c, hr, 200, doc);
    }
    case SRV_ROUTE_CACHE_RESET:
        return handle_cache_reset(s, c, hr);
    case SRV_ROUTE_CACHE_LOOKUP:
        return handle_cache_lookup(s, c, hr);
    case SRV_ROUTE_CACHE_DIGEST:
        return handle_cache_digest(s, c, hr);
    case SRV_ROUTE_PEAKS_RESET:
        return handle_peaks_reset(s, c, hr);
    default:
        return answer_errorf(s, c, hr, 500, "server_error", "internal_error", "unrouted request");
    }
}

/* ---- generation ----------------------------------------------------------------------- */

static json_t *usage_doc(const srv_gen_t *g)
{
    return json_pack("{s:i, s:i, s:i, s:{s:i}}", "prompt_tokens", (int)g->prompt_tokens,
                     "completion_tokens", (int)g->completion_tokens, "total_tokens",
                     (int)(g->prompt_tokens + g->completion_tokens), "prompt_tokens_details",
                     "cached_tokens", (int)g->cached_tokens);
}

/* The error a request that ended without stop/length reports. */
static void gen_error(pkv_server_t *s, const srv_gen_t *g, uint32_t n_prompt, uint32_t max_tokens,
                      srv_error_t *err)
{
    if (g->status == PKV_ERR_NOFIT || g->status == PKV_ERR_NOSPACE) {
        pkv_kv_stats_t ks;
        pkv_kv_stats(s->kv, &ks);
        srv_error_set(err, 400, "invalid_request_error", "kv_budget_exceeded", NULL,
                      "the request (%u prompt + %u completion tokens) can never fit the KV "
                      "cache budget: %llu bytes per token, budget %llu bytes (%llu blocks of "
                      "%llu bytes)",
                      n_prompt, max_tokens, (unsigned long long)ks.token_bytes,
                      (unsigned long long)ks.budget_bytes, (unsigned long long)ks.blocks_capacity,
                      (unsigned long long)ks.block_bytes);
    } else if (g->status == PKV_ERR_SHUTDOWN || atomic_load(&s->stopping)) {
        srv_error_set(err, 503, "service_unavailable", "shutting_down", NULL,
                      "the server is shutting down");
    } else {
        srv_error_set(err, 500, "server_error", "internal_error", NULL, "generation failed: %s",
                      pkv_status_str(g->status));
    }
}

/* Can a request of `positions` KV positions ever fit the budget? */
static bool kv_fits(pkv_server_t *s, uint32_t n_prompt, uint32_t max_tokens, srv_error_t *err)
{
    if (!s->budget_bytes) return true;
    pkv_kv_stats_t ks;
    pkv_kv_stats(s->kv, &ks);
    uint64_t positions =
        (uint64_t)n_prompt + max_tokens - 1; /* the last token's K/V is never written */
    uint64_t blocks = PKV_DIV_UP(positions, s->block_tokens);
    bool fits = s->backend == PKV_BACKEND_PAGED ? blocks <= ks.blocks_capacity
                                                : positions * ks.token_bytes <= ks.budget_bytes;
    if (!fits)
        srv_error_set(err, 400, "invalid_request_error", "kv_budget_exceeded", NULL,
                      "the request can never fit the KV cache budget: %u prompt + %u "
                      "completion tokens need %llu positions = %llu blocks of %u tokens "
                      "(%llu bytes); the budget is %llu bytes (%llu blocks)",
                      n_prompt, max_tokens, (unsigned long long)positions,
                      (unsigned long long)blocks, s->block_tokens,
                      (unsigned long long)(s->backend == PKV_BACKEND_PAGED
                                               ? blocks * ks.block_bytes
                                               : positions * ks.token_bytes),
                      (unsigned long long)ks.budget_bytes, (unsigned long long)ks.blocks_capacity);
    return fits;
}

/* Wait for the next output, watching the client and the server. PKV_OK with *o;
 * PKV_ERR_CANCELLED (client gone) or PKV_ERR_SHUTDOWN (server destroyed). */
static int wait_output(pkv_server_t *s, pkv_request_t *req, MHD_socket fd, pkv_request_output_t *o)
{
    for (;;) {
        if (atomic_load(&s->stopping)) return PKV_ERR_SHUTDOWN;
        if (client_gone(fd)) return PKV_ERR_CANCELLED;
        int rc = pkv_request_read(req, pkv_deadline_after_ns(WAIT_SLICE_NS), o);
        if (rc != PKV_ERR_TIMEOUT) return rc;
    }
}

static void note_first(pkv_server_t *s, uint64_t t_submit, bool *seen,
                       const pkv_request_output_t *o)
{
    if (*seen || (!o->n_tokens && !o->finished)) return;
    *seen = true;
    if (!o->n_tokens) return;
    pthread_mutex_lock(&s->lock);
    srv_hist_add(&s->ctr.ttft, (double)(pkv_now_ns() - t_submit) / 1e9);
    pthread_mutex_unlock(&s->lock);
}

static void note_end(pkv_server_t *s, uint64_t t_submit)
{
    pthread_mutex_lock(&s->lock);
    srv_hist_add(&s->ctr.e2e, (double)(pkv_now_ns() - t_submit) / 1e9);
    pthread_mutex_unlock(&s->lock);
}

static json_t *sanitized_string(const char *text, size_t len)
{
    char *clean = malloc(SRV_UTF8_MAX(len) + 1);
    if (!clean) return NULL;
    size_t n = srv_utf8_sanitize(text, len, clean);
    json_t *j = json_stringn(clean, n);
    free(clean);
    return j;
}

static json_t *completion_doc(pkv_server_t *s, srv_req_kind_t kind, const char *id, time_t created,
                              json_t *text, const char *finish, json_t *usage)
{
    json_t *choice;
    if (kind == SRV_REQ_CHAT)
        choice = json_pack("{s:i, s:{s:s, s:o}, s:n, s:s}", "index", 0, "message", "role",
                           "assistant", "content", text, "logprobs", "finish_reason", finish);
    else
        choice = json_pack("{s:i, s:o, s:n, s:s}", "index", 0, "text", text, "logprobs",
                           "finish_reason", finish);
    return json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o}", "id", id, "object",
                     kind == SRV_REQ_CHAT ? "chat.completion" : "text_completion", "created",
                     (json_int_t)created, "model", s->served_name, "choices", choice, "usage",
                     usage);
}

/* ---- per-request phases ------------------------------------------------------------- */

/* Phase ph of one request: in the node's histograms when `counted` (a leg on a node with
 * an agent), and in *tm for the X-Pagekv-Timings opt-in either way. */
static void phase(pkv_server_t *s, srv_timings_t *tm, bool counted, srv_phase_t ph, uint64_t from,
                  uint64_t to)
{
    if (counted && s->kvn) {
        srv_kvnode_observe(s->kvn, tm, ph, from, to);
        return;
    }
    tm->ns[ph] = to > from ? to - from : 0;
    tm->have |= 1u << ph;
}

/* Which legs a finished request was, for its engine phases. */
typedef enum { LEG_NONE, LEG_PREFILL, LEG_DECODE } leg_t;

/* The engine phases of a finished request: a prefill leg's queue and compute, a decode
 * leg's decode; other requests' all three, in their timings only. */
static void engine_phases(pkv_server_t *s, srv_timings_t *tm, leg_t leg, uint64_t t_submit,
                          uint64_t admitted, uint64_t first, uint64_t end)
{
    if (leg != LEG_DECODE && admitted) {
        phase(s, tm, leg == LEG_PREFILL, SRV_PHASE_PREFILL_QUEUE, t_submit, admitted);
        if (first) phase(s, tm, leg == LEG_PREFILL, SRV_PHASE_PREFILL_COMPUTE, admitted, first);
    }
    if (leg != LEG_PREFILL) phase(s, tm, leg == LEG_DECODE, SRV_PHASE_DECODE, t_submit, end);
}

/* Track an output's admission and first-output times. */
static void note_times(const pkv_request_output_t *o, uint64_t *admitted, uint64_t *first)
{
    if (o->admitted_ns) *admitted = o->admitted_ns;
    if (!*first && (o->n_tokens || o->finished)) *first = pkv_now_ns();
}

/* ---- streaming ----------------------------------------------------------------------- */

static int sse_append(stream_t *st, const char *data, size_t n)
{
    if (!buf_grow(&st->buf, &st->cap, st->len + n, 1024, 0)) return PKV_ERR_NOMEM;
    memcpy(st->buf + st->len, data, n);
    st->len += n;
    return PKV_OK;
}

/* Queue `data: <doc>\n\n` (the reference is consumed). */
static int sse_event(stream_t *st, json_t *doc)
{
    char *text = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    if (!text) return PKV_ERR_NOMEM;
    int rc = sse_append(st, "data: ", 6);
    if (!rc) rc = sse_append(st, text, strlen(text));
    if (!rc) rc = sse_append(st, "\n\n", 2);
    free(text);
    return rc;
}

static json_t *chunk_doc(stream_t *st, json_t *delta_or_text, const char *finish)
{
    json_t *choice;
    if (st->kind == SRV_REQ_CHAT)
        choice = json_pack("{s:i, s:o, s:n, s:s?}", "index", 0, "delta", delta_or_text, "logprobs",
                           "finish_reason", finish);
    else
        choice = json_pack("{s:i, s:o, s:n, s:s?}", "index", 0, "text", delta_or_text, "logprobs",
                           "finish_reason", finish);
    return json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", st->id, "object",
                     st->kind == SRV_REQ_CHAT ? "chat.completion.chunk" : "text_completion",
                     "created", (json_int_t)st->created, "model", st->s->served_name, "choices",
                     choice);
}

/* Turn one engine read into events. */
static int stream_take(stream_t *st, const pkv_request_output_t *o)
{
    const char *text;
    size_t len;
    srv_gen_feed(&st->gen, o, &text, &len);
    note_first(st->s, st->t_submit, &st->first_seen, o);
    note_times(o, &st->admitted_ns, &st->first_ns);
    int rc = PKV_OK;
    if (len) {
        json_t *piece = sanitized_string(text, len);
        if (!piece) return PKV_ERR_NOMEM;
        json_t *body = st->kind == SRV_REQ_CHAT ? json_pack("{s:o}", "content", piece) : piece;
        if ((rc = sse_event(st, chunk_doc(st, body, NULL)))) return rc;
    }
    if (!o->finished) return PKV_OK;
    note_end(st->s, st->t_submit);
    const char *finish = srv_gen_finish_reason(&st->gen);
    if (finish) {
        engine_phases(st->s, &st->tm, st->decode_leg ? LEG_DECODE : LEG_NONE, st->t_submit,
                      st->admitted_ns, st->first_ns, pkv_now_ns());
        json_t *empty = st->kind == SRV_REQ_CHAT ? json_object() : json_string("");
        json_t *last = chunk_doc(st, empty, finish);
        if (last && st->want_timings)
            json_object_set_new(last, "pagekv_timings", srv_timings_json(&st->tm, st->s->role));
        if ((rc = sse_event(st, last))) return rc;
        if (st->include_usage) {
            json_t *doc =
                json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", st->id, "object",
                          st->kind == SRV_REQ_CHAT ? "chat.completion.chunk" : "text_completion",
                          "created", (json_int_t)st->created, "model", st->s->served_name,
                          "choices", "usage", usage_doc(&st->gen));
            if ((rc = sse_event(st, doc))) return rc;
        }
    } else {
        srv_error_t err;
        gen_error(st->s, &st->gen, st->gen.prompt_tokens, 0, &err);
        if ((rc = sse_event(st, error_doc(&err)))) return rc;
    }
    st->done = true;
    return sse_append(st, "data: [DONE]\n\n", 14);
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    stream_t *st = cls;
    (void)pos;
    for (;;) {
        if (st->pos < st->len) {
            size_t n = PKV_MIN(max, st->len - st->pos);
            memcpy(buf, st->buf + st->pos, n);
            st->pos += n;
            if (st->pos == st->len) st->pos = st->len = 0;
            return (ssize_t)n;
        }
        if (st->done) return MHD_CONTENT_READER_END_OF_STREAM;
        pkv_request_output_t o;
        int rc = wait_output(st->s, st->req, st->fd, &o);
        if (rc) {
            /* Client gone or server going away: cancel now, not when MHD frees us. */
            pkv_request_cancel(st->req);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (stream_take(st, &o)) {
            pkv_request_cancel(st->req);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
    }
}

static void stream_free(void *cls)
{
    stream_t *st = cls;
    pkv_request_release(st->req); /* cancels an unfinished request */
    free(st->buf);
    free(st);
}

/* ---- the generation handler ------------------------------------------------------------- */

/* A submitted generation request, from its submission to the start of its answer. */
typedef struct {
    pkv_request_t *req; /* owned: the answer releases it or hands it to the stream */
    srv_req_kind_t kind;
    uint32_t n_prompt, max_tokens;
    uint64_t t_submit;
    char id[48];
    time_t created;
    MHD_socket fd;
    srv_gen_t gen;
    bool first_seen;
    uint64_t rid;       /* pagekv's own request id (never the client's X-Request-Id) */
    uint64_t seed;      /* the request's sampling seed */
    const int32_t *ids; /* the prompt (n_prompt) */
    bool prefill_leg;   /* kv_transfer_params do_remote_decode on a prefill node */
    bool decode_leg;    /* a decode leg whose pull succeeded (not recomputed) */
    bool want_timings;  /* X-Pagekv-Timings: the answer carries pagekv_timings */
    srv_timings_t tm;   /* this request's phases on this node */
    uint64_t admitted_ns, first_ns;
} gen_run_t;

/* Take an id and a seed and count the request in flight; false when draining. */
static bool gen_admit(pkv_server_t *s, const srv_request_t *r, uint64_t *id, uint64_t *seed)
{
    pthread_mutex_lock(&s->lock);
    bool draining = s->draining;
    *id = ++s->next_id;
    *seed = r->has_seed ? r->seed : pkv_splitmix64(&s->rng);
    if (!draining) s->ctr.in_flight++;
    pthread_mutex_unlock(&s->lock);
    return !draining;
}

/* The answer to a submission the engine refused (the refusal counted). */
static void submit_error(pkv_server_t *s, int rc, const gen_run_t *run, srv_error_t *err)
{
    if (rc == PKV_ERR_BUSY) {
        count_rejection(s, SRV_REJ_QUEUE_FULL);
        srv_error_set(err, 429, "rate_limit_error", "queue_full", NULL,
                      "the request queue is full; retry later");
    } else if (rc == PKV_ERR_SHUTDOWN) {
        count_rejection(s, SRV_REJ_SHUTTING_DOWN);
        srv_error_set(err, 503, "service_unavailable", "shutting_down", NULL,
                      "the server is shutting down");
    } else if (rc == PKV_ERR_NOFIT) {
        count_rejection(s, SRV_REJ_KV_BUDGET);
        srv_gen_t g = {.status = rc};
        gen_error(s, &g, run->n_prompt, run->max_tokens, err);
    } else if (rc == PKV_ERR_INVALID) {
        count_rejection(s, SRV_REJ_INVALID);
        srv_error_set(err, 400, "invalid_request_error", "invalid_value", NULL,
                      "the engine refused the request's parameters");
    } else {
        srv_error_set(err, 500, "server_error", "internal_error", NULL,
                      "submitting the request failed: %s", pkv_status_str(rc));
    }
}

/* Check the KV budget and count the request in flight (run->rid and run->seed taken):
 * from here on drain waits for it, a decode leg's pull included. PKV_OK, or *err (the
 * refusal counted). */
static int gen_enter(pkv_server_t *s, http_req_t *hr, const srv_request_t *r, gen_run_t *run,
                     srv_error_t *err)
{
    if (!kv_fits(s, run->n_prompt, run->max_tokens, err)) {
        count_rejection(s, SRV_REJ_KV_BUDGET);
        return PKV_ERR_NOFIT;
    }
    if (!gen_admit(s, r, &run->rid, &run->seed)) {
        count_rejection(s, SRV_REJ_SHUTTING_DOWN);
        srv_error_set(err, 503, "service_unavailable", "shutting_down", NULL,
                      "the server is shutting down");
        return PKV_ERR_SHUTDOWN;
    }
    hr->in_flight = true;
    return PKV_OK;
}

/* Submit a request gen_enter counted. PKV_OK with run->req, run->id and run->created;
 * otherwise *err (the refusal counted). */
static int gen_submit(pkv_server_t *s, const srv_request_t *r, const int32_t *ids, gen_run_t *run,
                      srv_error_t *err)
{
    uint64_t id = run->rid, seed = run->seed;
    run->ids = ids;
    pkv_request_params_t p = {.keep_blocks = run->prefill_leg,
                              .prompt = ids,
                              .n_prompt = run->n_prompt,
                              .max_tokens = run->max_tokens,
                              .temperature = r->temperature,
                              .top_p = r->top_p,
                              .seed = seed,
                              .priority = r->priority,
                              .salt = r->salt,
                              .stop = r->stop,
                              .n_stop = r->n_stop,
                              .ignore_eos = r->ignore_eos};
    run->t_submit = pkv_now_ns();
    int rc = pkv_engine_submit(s->engine, &p, &run->req);
    if (rc) {
        submit_error(s, rc, run, err);
        return rc;
    }
    snprintf(run->id, sizeof(run->id), "%s-%016llx",
             run->kind == SRV_REQ_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)(id ^ ((uint64_t)s->created << 32)));
    run->created = time(NULL);
    return PKV_OK;
}

/* Read to the end from *o on, appending the text to *acc. PKV_OK; PKV_ERR_NOMEM; or
 * wait_output's error (client gone, server destroyed). */
static int gen_collect(pkv_server_t *s, gen_run_t *run, pkv_request_output_t *o, char **acc,
                       size_t *acc_len)
{
    size_t acc_cap = 0;
    for (;;) {
        const char *text;
        size_t len;
        srv_gen_feed(&run->gen, o, &text, &len);
        note_first(s, run->t_submit, &run->first_seen, o);
        note_times(o, &run->admitted_ns, &run->first_ns);
        if (!buf_grow(acc, &acc_cap, *acc_len + len, 256, 0)) return PKV_ERR_NOMEM;
        if (len) memcpy(*acc + *acc_len, text, len);
        *acc_len += len;
        if (o->finished) return PKV_OK;
        int rc = wait_output(s, run->req, run->fd, o);
        if (rc) return rc;
    }
}

/* A finished prefill leg: its prompt blocks (kept pinned by the engine until the release)
 * registered with the agent under a lease; *kvt the response's kv_transfer_params. */
static int prefill_offer(pkv_server_t *s, gen_run_t *run, json_t **kvt)
{
    const uint32_t *blocks;
    uint32_t nb;
    int rc = pkv_request_kept_blocks(run->req, &blocks, &nb);
    if (rc) return rc;
    return srv_kvnode_offer(s->kvn, run->rid, blocks, nb, run->ids, run->n_prompt, kvt);
}

/* Non-streaming: read to the end and answer once. Releases run->req. */
static enum MHD_Result answer_whole(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                    gen_run_t *run, pkv_request_output_t *o)
{
    char *acc = NULL;
    size_t acc_len = 0;
    int rc = gen_collect(s, run, o, &acc, &acc_len);
    const char *finish = rc ? NULL : srv_gen_finish_reason(&run->gen);
    json_t *kvt = NULL;
    int offer_rc = finish && run->prefill_leg ? prefill_offer(s, run, &kvt) : PKV_OK;
    pkv_request_release(run->req); /* a gone client's request is cancelled at once */
    if (rc) {
        free(acc);
        if (rc != PKV_ERR_NOMEM) return MHD_NO; /* MHD closes the connection */
        return answer_errorf(s, c, hr, 500, "server_error", "out_of_memory", "out of memory");
    }
    note_end(s, run->t_submit);
    if (!finish) {
        free(acc);
        srv_error_t err;
        gen_error(s, &run->gen, run->n_prompt, run->max_tokens, &err);
        return answer_error(s, c, hr, &err);
    }
    json_t *jt = offer_rc ? NULL : sanitized_string(acc ? acc : "", acc_len);
    free(acc);
    if (offer_rc) {
        char msg[160];
        snprintf(msg, sizeof(msg), "the prompt's blocks could not be registered for transfer: %s",
                 pkv_status_str(offer_rc));
        return answer_errorf(s, c, hr, 500, "server_error", "internal_error", msg);
    }
    if (!jt) {
        json_decref(kvt);
        return MHD_NO;
    }
    json_t *doc =
        completion_doc(s, run->kind, run->id, run->created, jt, finish, usage_doc(&run->gen));
    if (doc && kvt) json_object_set_new(doc, "kv_transfer_params", kvt);
    engine_phases(s, &run->tm,
                  run->prefill_leg  ? LEG_PREFILL
                  : run->decode_leg ? LEG_DECODE
                                    : LEG_NONE,
                  run->t_submit, run->admitted_ns, run->first_ns, pkv_now_ns());
    if (doc && run->want_timings)
        json_object_set_new(doc, "pagekv_timings", srv_timings_json(&run->tm, s->role));
    return answer_json(s, c, hr, 200, doc);
}

/* Streaming: answer 200 with a callback response that turns engine reads into SSE
 * events; an admission failure before any output is still a plain error. Takes run->req. */
static enum MHD_Result answer_stream(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                     gen_run_t *run, const pkv_request_output_t *o,
                                     bool include_usage)
{
    if (o->finished && !o->n_tokens && o->finish != PKV_FINISH_STOP &&
        o->finish != PKV_FINISH_LENGTH) {
        const char *text;
        size_t len;
        srv_gen_feed(&run->gen, o, &text, &len);
        pkv_request_release(run->req);
        srv_error_t err;
        gen_error(s, &run->gen, run->n_prompt, run->max_tokens, &err);
        return answer_error(s, c, hr, &err);
    }
    stream_t *st = calloc(1, sizeof(*st));
    if (!st) {
        pkv_request_release(run->req);
        return MHD_NO;
    }
    st->s = s;
    st->req = run->req;
    st->gen = run->gen;
    st->kind = run->kind;
    st->include_usage = include_usage;
    memcpy(st->id, run->id, sizeof(st->id));
    st->created = run->created;
    st->fd = run->fd;
    st->t_submit = run->t_submit;
    st->first_seen = run->first_seen;
    st->decode_leg = run->decode_leg;
    st->want_timings = run->want_timings;
    st->tm = run->tm;
    st->admitted_ns = run->admitted_ns;
    st->first_ns = run->first_ns;
    int rc = PKV_OK;
    if (run->kind == SRV_REQ_CHAT)
        rc = sse_event(
            st, chunk_doc(st, json_pack("{s:s, s:s}", "role", "assistant", "content", ""), NULL));
    if (!rc) rc = stream_take(st, o);
    struct MHD_Response *resp = rc ? NULL
                                   : MHD_create_response_from_callback(
                                         MHD_SIZE_UNKNOWN, SSE_BLOCK, stream_read, st, stream_free);
    if (!resp) {
        stream_free(st);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    pthread_mutex_lock(&s->lock);
    s->ctr.streams++;
    pthread_mutex_unlock(&s->lock);
    return queue(s, c, hr, 200, resp);
}

/* kv_transfer_params this node's role cannot take (400, *err filled): any on a unified
 * node; a decode leg on a prefill node; a prefill leg on a decode node or streamed. */
static bool kv_role_refuses(const pkv_server_t *s, const srv_request_t *r, srv_error_t *err)
{
    const char *p = "kv_transfer_params", *type = "invalid_request_error";
    if (r->kvt == SRV_KVT_NONE) return false;
    if (s->role == PKV_SERVER_ROLE_UNIFIED)
        srv_error_set(err, 400, type, "unsupported_parameter", p,
                      "'kv_transfer_params' needs a node started with --role prefill or decode "
                      "(this node is unified)");
    else if (r->kvt == SRV_KVT_DECODE && s->role == PKV_SERVER_ROLE_PREFILL)
        srv_error_set(err, 400, type, "invalid_value", p,
                      "do_remote_prefill: this is a prefill node; send the decode leg to a "
                      "decode node");
    else if (r->kvt == SRV_KVT_DECODE)
        return false; /* a decode leg on a decode node */
    else if (s->role == PKV_SERVER_ROLE_DECODE)
        srv_error_set(err, 400, type, "invalid_value", p,
                      "do_remote_decode: this is a decode node; send the prefill leg to a "
                      "prefill node");
    else if (r->stream)
        srv_error_set(err, 400, type, "invalid_value", "stream",
                      "a prefill leg (do_remote_decode) is answered once: 'stream' must be false");
    else
        return false;
    return true;
}

/* The X-Pagekv-Timings request header: "1"/"true" asks for the request's own phases in
 * the answer (pagekv_timings), "0"/"false" or none does not; anything else is a 400. */
static int want_timings(struct MHD_Connection *c, bool *on, srv_error_t *err)
{
    const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Pagekv-Timings");
    *on = v && (!strcmp(v, "1") || !strcasecmp(v, "true"));
    if (!v || *on || !strcmp(v, "0") || !strcasecmp(v, "false")) return PKV_OK;
    srv_error_set(err, 400, "invalid_request_error", "invalid_value", "X-Pagekv-Timings",
                  "the X-Pagekv-Timings header must be 1, true, 0 or false");
    return PKV_ERR_INVALID;
}

/* POST /v1/completions and /v1/chat/completions (the flow in the top comment). */
static enum MHD_Result handle_generate(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr)
{
    srv_req_kind_t kind = hr->route == SRV_ROUTE_CHAT ? SRV_REQ_CHAT : SRV_REQ_COMPLETIONS;
    srv_limits_t lim = {.max_context = s->max_context};
    srv_request_t r;
    srv_error_t err;
    if (srv_request_parse(kind, hr->body, hr->len, s->served_name, &lim, &r, &err)) {
        count_rejection(s, err.status == 404 ? SRV_REJ_MODEL : SRV_REJ_INVALID);
        return answer_error(s, c, hr, &err);
    }
    if (kv_role_refuses(s, &r, &err)) {
        count_rejection(s, SRV_REJ_INVALID);
        srv_request_free(&r);
        return answer_error(s, c, hr, &err);
    }
    gen_run_t run = {.kind = kind, .prefill_leg = r.kvt == SRV_KVT_PREFILL};
    if (want_timings(c, &run.want_timings, &err)) {
        count_rejection(s, SRV_REJ_INVALID);
        srv_request_free(&r);
        return answer_error(s, c, hr, &err);
    }
    int32_t *ids = NULL;
    pkv_seq_t *pulled = NULL; /* a decode leg's pulled prompt, until the request is admitted */
    enum MHD_Result ret;
    if (srv_request_prompt(&r, s->tok, &lim, s->default_max_tokens, &ids, &run.n_prompt,
                           &run.max_tokens, &err)) {
        count_rejection(s, !strcmp(err.code, "context_length_exceeded") ? SRV_REJ_CONTEXT
                                                                        : SRV_REJ_INVALID);
        ret = answer_error(s, c, hr, &err);
    } else if (gen_enter(s, hr, &r, &run, &err)) {
        ret = answer_error(s, c, hr, &err);
    } else if (r.kvt == SRV_KVT_DECODE && srv_kvnode_pull(s->kvn, r.kvt_params, ids, run.n_prompt,
                                                          r.salt, &pulled, &run.tm, &err)) {
        if (err.status == 400) count_rejection(s, SRV_REJ_INVALID); /* else: pulls.failed */
        ret = answer_error(s, c, hr, &err);
    } else if (gen_submit(s, &r, ids, &run, &err)) {
        ret = answer_error(s, c, hr, &err);
    } else {
        if (s->role == PKV_SERVER_ROLE_DECODE && r.kvt == SRV_KVT_NONE)
            srv_kvnode_count_local(s->kvn); /* a router's fallback: computed here */
        run.decode_leg = pulled != NULL;
        char xrid[129];
        request_id_of(c, xrid);
        PKV_LOGI("server", "%s: request %llu (%s), X-Request-Id %s", srv_route_label[hr->route],
                 (unsigned long long)run.rid,
                 r.kvt == SRV_KVT_PREFILL  ? "prefill leg"
                 : r.kvt == SRV_KVT_DECODE ? "decode leg"
                                           : "whole",
                 xrid);
        run.fd = conn_fd(c);
        srv_gen_init(&run.gen);
        /* The first output (or the finish): admission errors still get a status. */
        pkv_request_output_t o;
        int wrc = wait_output(s, run.req, run.fd, &o);
        pkv_seq_free(pulled); /* admitted: the engine adopted what it pulled */
        pulled = NULL;
        if (wrc) {
            /* The client went away (or the server is being destroyed): cancel at once. */
            pkv_request_release(run.req);
            ret = MHD_NO; /* MHD closes the connection */
        } else {
            ret = r.stream ? answer_stream(s, c, hr, &run, &o, r.include_usage)
                           : answer_whole(s, c, hr, &run, &o);
        }
    }
    pkv_seq_free(pulled);
    free(ids);
    srv_request_free(&r);
    return ret;
}

/* ---- MHD callbacks --------------------------------------------------------------------- */

/* The first call for a request: route, method (405), path (404), Content-Length (413). */
static enum MHD_Result on_first_call(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                     const char *url, const char *method)
{
    hr->route = SRV_ROUTE_OTHER;
    const char *allow = NULL;
    for (size_t i = 0; i < PKV_ARRAY_LEN(routes); i++)
        if (!strcmp(url, routes[i].path)) hr->route = routes[i].route, allow = routes[i].allow;
    if (!allow && !strncmp(url, "/v1/models/", 11) && url[11])
        hr->route = SRV_ROUTE_MODEL, allow = "GET, HEAD";
    if (!allow) {
        char msg[160];
        snprintf(msg, sizeof(msg), "no such endpoint: %.100s", url);
        return answer_errorf(s, c, hr, 404, "not_found_error", "not_found", msg);
    }
    if (!method_allowed(allow, method)) {
        srv_error_t err;
        srv_error_set(&err, 405, "invalid_request_error", "method_not_allowed", NULL,
                      "method %.16s is not allowed on %s (allowed: %s)", method, url, allow);
        struct MHD_Response *r = error_response(&err);
        if (r) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
        return queue(s, c, hr, 405, r);
    }
    const char *cl =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        char *end;
        errno = 0;
        unsigned long long n = strtoull(cl, &end, 10);
        if (!errno && end != cl && n > s->max_body) {
            if (hr->route <= SRV_ROUTE_CHAT) count_rejection(s, SRV_REJ_BODY_TOO_LARGE);
            char msg[160];
            snprintf(msg, sizeof(msg),
                     "the request body (%llu bytes) is over the limit (%llu bytes)", n,
                     (unsigned long long)s->max_body);
            return answer_errorf(s, c, hr, 413, "invalid_request_error", "body_too_large", msg);
        }
    }
    return MHD_YES;
}

/* One body chunk: kept up to max_body_bytes; beyond it the request is marked too large. */
static enum MHD_Result body_append(pkv_server_t *s, http_req_t *hr, const char *upload, size_t n)
{
    if (hr->too_large || hr->len + n > s->max_body) {
        hr->too_large = true;
        return MHD_YES;
    }
    if (!buf_grow(&hr->body, &hr->cap, hr->len + n + 1, 0, s->max_body + 1)) return MHD_NO;
    memcpy(hr->body + hr->len, upload, n);
    hr->len += n;
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls)
{
    pkv_server_t *s = cls;
    http_req_t *hr = *con_cls;
    if (!hr) {
        hr = calloc(1, sizeof(*hr));
        if (!hr) return MHD_NO;
        *con_cls = hr;
        return on_first_call(s, c, hr, url, method);
    }
    if (hr->answered) {
        *upload_size = 0; /* answered early: discard whatever body follows */
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        return body_append(s, hr, upload, n);
    }
    (void)version;
    if (hr->too_large) {
        if (hr->route <= SRV_ROUTE_CHAT) count_rejection(s, SRV_REJ_BODY_TOO_LARGE);
        char msg[160];
        snprintf(msg, sizeof(msg), "the request body is over the limit (%llu bytes)",
                 (unsigned long long)s->max_body);
        return answer_errorf(s, c, hr, 413, "invalid_request_error", "body_too_large", msg);
    }
    if (hr->route == SRV_ROUTE_COMPLETIONS || hr->route == SRV_ROUTE_CHAT)
        return handle_generate(s, c, hr);
    return handle_simple(s, c, hr, url);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    pkv_server_t *s = cls;
    http_req_t *hr = *con_cls;
    (void)c;
    if (!hr) return;
    *con_cls = NULL;
    if (hr->in_flight) {
        if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK &&
            toe != MHD_REQUEST_TERMINATED_DAEMON_SHUTDOWN) {
            pthread_mutex_lock(&s->lock);
            s->ctr.disconnects++;
            pthread_mutex_unlock(&s->lock);
        }
        in_flight_done(s);
    }
    free(hr->body);
    free(hr);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    char line[512];
    vsnprintf(line, sizeof(line), fmt, ap);
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = 0;
    PKV_LOGI("server", "libmicrohttpd: %s", line);
}

/* ---- lifecycle ----------------------------------------------------------------------- */

/* The model and its tokenizer: a llama2.c pair, or a built-in preset. */
static int load_model(pkv_server_t *s, const pkv_server_config_t *cfg)
{
    pkv_model_runtime_t rt = {.threads = cfg->threads};
    int rc;
    const char *preset = cfg->preset ? cfg->preset : "tiny";
    if (cfg->model_path || cfg->tokenizer_path) {
        if (!cfg->model_path || !cfg->tokenizer_path) {
            PKV_LOGE("server", "a llama2.c model needs both --model and --tokenizer");
            return PKV_ERR_INVALID;
        }
        if ((rc = pkv_model_load_llama2c(cfg->model_path, &rt, &s->model))) return rc;
        const pkv_model_config_t *mc = pkv_model_config(s->model);
        if ((rc = pkv_tok_load_llama2c(cfg->tokenizer_path, (int32_t)mc->vocab_size, &s->tok)))
            return rc;
    } else {
        pkv_model_config_t mc;
        if (pkv_model_preset(preset, &mc)) {
            PKV_LOGE("server", "unknown preset '%s'", preset);
            return PKV_ERR_INVALID;
        }
        if ((rc = pkv_tok_create_builtin(&s->tok))) return rc;
        mc.vocab_size = (uint32_t)pkv_tok_vocab_size(s->tok);
        if (cfg->max_context) {
            if (cfg->max_context > mc.max_seq_len) {
                PKV_LOGE("server", "--max-context %u is above the preset's length (%u)",
                         cfg->max_context, mc.max_seq_len);
                return PKV_ERR_INVALID;
            }
            mc.max_seq_len = cfg->max_context;
        }
        if ((rc = pkv_model_create_builtin(&mc, cfg->weight_seed ? cfg->weight_seed : 1, &rt,
                                           &s->model)))
            return rc;
    }
    return PKV_OK;
}

/* The KV budget the configuration asks for (auto: max_batch x max_context tokens, at most
 * half the machine's memory, at least 4 MiB). PKV_ERR_INVALID for a budget of 0 bytes. */
static int kv_budget(const pkv_server_t *s, const pkv_server_config_t *cfg, uint64_t *out)
{
    switch (cfg->budget_mode) {
    case PKV_SERVER_BUDGET_NONE:
        *out = 0;
        return PKV_OK;
    case PKV_SERVER_BUDGET_BYTES:
        if (!cfg->budget_bytes) {
            PKV_LOGE("server", "a KV budget of 0 bytes (use 'none' for no cap)");
            return PKV_ERR_INVALID;
        }
        *out = cfg->budget_bytes;
        return PKV_OK;
    default: {
        uint64_t want = (uint64_t)s->max_batch * s->max_context * s->token_bytes;
        long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        uint64_t half = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz / 2 : want;
        *out = PKV_MAX(PKV_MIN(want, half), 4ull << 20);
        return PKV_OK;
    }
    }
}

/* Huge pages for the paged pool, as `pagekv generate` and the benchmarks use, wherever the
 * kernel's THP mode allows them (always or madvise) unless --no-hugepages: attention reads
 * KV in long runs (fewer TLB misses; paged decode is ~25 % slower on 4 KiB pages); RSS is
 * the same (a commit populates its whole granule either way). Asking is not getting: a
 * probe commits one 2 MiB page the way the pool does and reads back what the kernel gave
 * (logged; /v1/cache/stats and /metrics then show the pool's own huge bytes). */
static void hugepage_policy(pkv_server_t *s, const pkv_server_config_t *cfg)
{
    if (pkv_prim_thp_mode(NULL, &s->thp)) s->thp = PKV_PRIM_THP_UNKNOWN;
    s->huge = cfg->backend == PKV_BACKEND_PAGED && !cfg->no_hugepages &&
              (s->thp == PKV_PRIM_THP_ALWAYS || s->thp == PKV_PRIM_THP_MADVISE);
    s->huge_probe = false;
    if (s->huge && pkv_prim_huge_probe(&s->huge_probe)) s->huge_probe = false;
    const char *why = cfg->backend != PKV_BACKEND_PAGED ? "dense backend"
                      : cfg->no_hugepages               ? "--no-hugepages"
                      : !s->huge                        ? "the kernel's THP mode"
                      : s->huge_probe                   ? "a 2 MiB probe got a huge page"
                                      : "a 2 MiB probe got 4 KiB pages (none free?)";
    PKV_LOGI("server", "huge pages for the KV pool: %s (THP %s; %s)", s->huge ? "asked" : "off",
             pkv_prim_thp_mode_name(s->thp), why);
}

static int build_stack(pkv_server_t *s, const pkv_server_config_t *cfg)
{
    int rc = load_model(s, cfg);
    if (rc) return rc;
    const pkv_model_config_t *mc = pkv_model_config(s->model);
    s->max_context = cfg->max_context ? cfg->max_context : mc->max_seq_len;
    if (s->max_context > mc->max_seq_len || s->max_context < 2) {
        PKV_LOGE("server", "--max-context %u must be in [2, %u] (the model's length)",
                 s->max_context, mc->max_seq_len);
        return PKV_ERR_INVALID;
    }
    if (pkv_tok_vocab_size(s->tok) != (int32_t)mc->vocab_size) {
        PKV_LOGE("server", "tokenizer vocabulary (%d) differs from the model's (%u)",
                 pkv_tok_vocab_size(s->tok), mc->vocab_size);
        return PKV_ERR_INVALID;
    }
    s->max_batch = cfg->max_batch_size ? cfg->max_batch_size : 8;
    s->block_tokens = cfg->block_tokens ? cfg->block_tokens : 16;
    hugepage_policy(s, cfg);
    pkv_kv_config_t kc = {.backend = cfg->backend,
                          .no_prefix_cache = cfg->no_prefix_cache,
                          .hugepages = s->huge,
                          .tp = cfg->tp ? cfg->tp : 1};
    pkv_model_geometry(s->model, cfg->kv_dtype, s->block_tokens, &kc.geo);
    char why[128];
    if (pkv_kv_tp_check(kc.geo.kv_heads, kc.tp, why, sizeof(why))) {
        PKV_LOGE("server", "--tp: %s", why);
        return PKV_ERR_INVALID;
    }
    s->token_bytes = pkv_geometry_token_bytes(&kc.geo);
    if ((rc = kv_budget(s, cfg, &kc.budget_bytes))) return rc;
    if ((rc = srv_cache_policy(cfg, kc.budget_bytes, &kc))) return rc;
    s->backend = cfg->backend;
    if ((rc = pkv_kv_create(&kc, &s->kv))) {
        PKV_LOGE("server", "creating the KV cache failed: %s", pkv_status_str(rc));
        return rc;
    }
    pkv_kv_stats_t ks;
    pkv_kv_stats(s->kv, &ks);
    s->budget_bytes = ks.budget_bytes;
    s->huge_granules = ks.huge_granules;
    /* Every id that ends a turn ends a generation: EOS, and the builtin's <|end|>. */
    int32_t eos[PKV_ENGINE_MAX_EOS];
    uint32_t n_eos = 0;
    for (int32_t id = 0; id < pkv_tok_vocab_size(s->tok) && n_eos < PKV_ENGINE_MAX_EOS; id++)
        if (pkv_tok_is_stop(s->tok, id)) eos[n_eos++] = id;
    pkv_engine_config_t ec = {.model = s->model,
                              .kv = s->kv,
                              .max_batch_size = s->max_batch,
                              .max_queue = cfg->max_queue,
                              .prefill_chunk = cfg->prefill_chunk,
                              .eos_ids = eos,
                              .n_eos_ids = n_eos,
                              .detok = detok,
                              .detok_arg = s->tok};
    if ((rc = pkv_engine_create(&ec, &s->engine))) {
        PKV_LOGE("server", "creating the engine failed: %s", pkv_status_str(rc));
        return rc;
    }
    if ((rc = srv_memwatch_create(cfg, s->kv, &s->mw))) {
        PKV_LOGE("server", "starting the memory watcher failed: %s", pkv_status_str(rc));
        return rc;
    }
    return PKV_OK;
}

static int start_http(pkv_server_t *s, const pkv_server_config_t *cfg)
{
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *ai = NULL;
    char port[8];
    snprintf(port, sizeof(port), "%u", cfg->port);
    int gai = getaddrinfo(s->host, port, &hints, &ai);
    if (gai) {
        PKV_LOGE("server", "cannot resolve --host '%s': %s", s->host, gai_strerror(gai));
        return PKV_ERR_INVALID;
    }
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
                     MHD_USE_POLL | MHD_USE_ITC | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    s->mhd = MHD_start_daemon(
        flags, cfg->port, NULL, NULL, on_request, s, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)(cfg->max_connections ? cfg->max_connections : 256),
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)120, MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
        MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, s, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!s->mhd) {
        PKV_LOGE("server", "cannot listen on %s:%u (address in use or not local?)", s->host,
                 cfg->port);
        return PKV_ERR_IO;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->mhd, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : cfg->port;
    return PKV_OK;
}

static void free_stack(pkv_server_t *s)
{
    srv_memwatch_destroy(s->mw); /* before the pool it trims */
    pkv_engine_destroy(s->engine);
    pkv_kv_destroy(s->kv);
    pkv_model_destroy(s->model);
    pkv_tok_destroy(s->tok);
}

/* The model a node's KV belongs to, for the transfer agents' layout descriptor (a peer
 * whose KV is another model's is refused at the handshake): the preset and the weight seed,
 * or the checkpoint's file name (printable, at most 63 characters). */
static const char *model_id(const pkv_server_config_t *cfg, char *buf, size_t cap)
{
    if (cfg->model_path) {
        const char *base = strrchr(cfg->model_path, '/');
        base = base ? base + 1 : cfg->model_path;
        size_t j = 0;
        for (; base[j] && j + 1 < cap && j < 63; j++)
            buf[j] = base[j] >= 0x20 && base[j] <= 0x7e ? base[j] : '?';
        buf[j] = 0;
    } else {
        snprintf(buf, cap, "%.32s:seed%llu", cfg->preset ? cfg->preset : "tiny",
                 (unsigned long long)(cfg->weight_seed ? cfg->weight_seed : 1));
    }
    return buf;
}

int pkv_server_create(const pkv_server_config_t *cfg, pkv_server_t **out)
{
    if (!cfg || !out) return PKV_ERR_INVALID;
    pkv_server_t *s = calloc(1, sizeof(*s));
    if (!s) return PKV_ERR_NOMEM;
    int rc = PKV_ERR_NOMEM;
    s->quiesced_fd = MHD_INVALID_SOCKET;
    s->max_body = cfg->max_body_bytes ? cfg->max_body_bytes : 4ull << 20;
    s->retry_after_s = cfg->retry_after_s ? cfg->retry_after_s : 1;
    s->default_max_tokens = cfg->default_max_tokens ? cfg->default_max_tokens : 16;
    s->created = time(NULL);
    s->rng = (uint64_t)pkv_now_ns() ^ ((uint64_t)getpid() << 32);
    atomic_init(&s->stopping, false);
    if (pthread_mutex_init(&s->lock, NULL)) goto fail_lock;
    if (pthread_mutex_init(&s->pages_mu, NULL)) goto fail_pages;
    if (pkv_cond_init_monotonic(&s->idle_cv)) goto fail_cv;
    if (!(s->host = strdup(cfg->host ? cfg->host : "127.0.0.1"))) goto fail_host;
    if ((rc = build_stack(s, cfg))) goto fail_stack;
    char mid[64];
    const char *name = cfg->served_name;
    if (!name && cfg->model_path) {
        name = strrchr(cfg->model_path, '/');
        name = name ? name + 1 : cfg->model_path;
    }
    if (!name) name = cfg->preset ? cfg->preset : "tiny";
    if (!*name || strlen(name) > 200) {
        PKV_LOGE("server", "the served model name must be 1..200 bytes");
        rc = PKV_ERR_INVALID;
        goto fail_stack;
    }
    rc = PKV_ERR_NOMEM;
    if (!(s->served_name = strdup(name))) goto fail_stack;
    s->role = cfg->role;
    if (s->role != PKV_SERVER_ROLE_UNIFIED &&
        (rc = srv_kvnode_create(cfg, s->kv, s->max_context, model_id(cfg, mid, sizeof(mid)),
                                &s->kvn)))
        goto fail_kv;
    if ((rc = start_http(s, cfg))) goto fail_http;
    *out = s;
    return PKV_OK;

fail_http:
    srv_kvnode_destroy(s->kvn);
fail_kv:
    free(s->served_name);
fail_stack:
    free_stack(s);
    free(s->host);
fail_host:
    pthread_cond_destroy(&s->idle_cv);
fail_cv:
    pthread_mutex_destroy(&s->pages_mu);
fail_pages:
    pthread_mutex_destroy(&s->lock);
fail_lock:
    free(s);
    return rc;
}

void pkv_server_quiesce(pkv_server_t *s)
{
    pthread_mutex_lock(&s->lock);
    bool first = !s->draining;
    s->draining = true;
    pthread_mutex_unlock(&s->lock);
    if (!first) return;
    s->quiesced_fd = MHD_quiesce_daemon(s->mhd);
    /* MHD stops polling the socket but it stays open until after MHD_stop_daemon, and the
     * kernel would keep completing handshakes into its backlog: connections that then
     * hang. shutdown() stops the listening (new connections are refused) while the
     * descriptor stays valid for any MHD thread still holding it. */
    if (s->quiesced_fd != MHD_INVALID_SOCKET) shutdown(s->quiesced_fd, SHUT_RDWR);
}

int pkv_server_wait_idle(pkv_server_t *s, uint64_t deadline_ns)
{
    int rc = PKV_OK;
    pthread_mutex_lock(&s->lock);
    while (s->ctr.in_flight) {
        if (pkv_now_ns() >= deadline_ns) {
            rc = PKV_ERR_TIMEOUT;
            break;
        }
        struct timespec ts = pkv_deadline_to_monotonic(deadline_ns);
        pthread_cond_timedwait(&s->idle_cv, &s->lock, &ts);
    }
    pthread_mutex_unlock(&s->lock);
    return rc;
}

void pkv_server_destroy(pkv_server_t *s)
{
    if (!s) return;
    atomic_store(&s->stopping, true); /* waiting handlers give up within one slice */
    MHD_stop_daemon(s->mhd);          /* joins every connection thread */
    if (s->quiesced_fd != MHD_INVALID_SOCKET) close(s->quiesced_fd);
    srv_kvnode_destroy(s->kvn); /* registrations end: their pins return before the pool goes */
    free_stack(s);
    free(s->served_name);
    free(s->host);
    pthread_cond_destroy(&s->idle_cv);
    pthread_mutex_destroy(&s->pages_mu);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

uint16_t pkv_server_port(const pkv_server_t *s)
{
    return s->port;
}

void pkv_server_info(const pkv_server_t *s, pkv_server_info_t *out)
{
    out->model_name = s->served_name;
    out->kernels = pkv_model_kernels(s->model);
    out->backend = s->backend;
    out->max_context = s->max_context;
    out->max_batch_size = s->max_batch;
    out->budget_bytes = s->budget_bytes;
    out->token_bytes = s->token_bytes;
    out->block_tokens = s->block_tokens;
    out->role = s->role;
    out->kv_address = s->kvn ? srv_kvnode_address(s->kvn) : NULL;
    out->hugepages = s->huge;
    out->thp_mode = pkv_prim_thp_mode_name(s->thp);
    out->huge_probe = s->huge_probe;
    out->huge_granules = s->huge_granules;
}

const char *pkv_server_role_name(pkv_server_role_t role)
{
    switch (role) {
    case PKV_SERVER_ROLE_UNIFIED:
        return "unified";
    case PKV_SERVER_ROLE_PREFILL:
        return "prefill";
    case PKV_SERVER_ROLE_DECODE:
        return "decode";
    }
    return "unknown";
}

int pkv_server_role_parse(const char *name, pkv_server_role_t *out)
{
    for (int r = PKV_SERVER_ROLE_UNIFIED; r <= PKV_SERVER_ROLE_DECODE; r++)
        if (name && !strcmp(name, pkv_server_role_name((pkv_server_role_t)r))) {
            *out = (pkv_server_role_t)r;
            return PKV_OK;
        }
    return PKV_ERR_INVALID;
}
