/*
 * server: the HTTP layer (design in docs/design/server.md): libmicrohttpd's callbacks, the
 * routing table, the answers every handler uses, and the simple GET endpoints (models,
 * health, /metrics, /v1/cache/stats).
 *
 * Threads. libmicrohttpd runs SRV_HTTP_THREADS event-loop threads (an internal thread pool,
 * epoll, MHD_ALLOW_SUSPEND_RESUME), each serving its share of the connections: no handler
 * blocks. A generation request that waits (a decode leg's pull, the engine's next output)
 * parks its connection (MHD_suspend_connection) and is resumed through its waker by what
 * it waits for (below); the thread serves the other connections meanwhile. So the threads
 * are as many with 256 legs pulling as with none.
 *
 * Wakers. A waker's mu is taken by the event-loop threads (park, from the handler or the
 * content reader of its connection), the engine's run loop and the decode node's pull
 * worker (wake); MHD_suspend_connection and MHD_resume_connection are called under it, so
 * a wake never resumes a connection that is not parked or already completed. Order:
 * waker mu, then libmicrohttpd's own locks; nothing else is taken under it.
 *
 * Request flow: the first call routes and checks the method (405), the path (404) and
 * Content-Length (413); body chunks accumulate up to max_body_bytes (more: 413 at the
 * end); the last call hands the request to its handler.
 */
#include "core/core.h"
#include "kv/kv.h"
#include "server/server_int.h"

#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool srv_buf_grow(char **buf, size_t *cap, size_t need, size_t slack, size_t limit)
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

void srv_count_rejection(pkv_server_t *s, srv_rejection_t why)
{
    pthread_mutex_lock(&s->lock);
    s->ctr.rejected[why]++;
    pthread_mutex_unlock(&s->lock);
}

void srv_in_flight_done(pkv_server_t *s)
{
    pthread_mutex_lock(&s->lock);
    PKV_ASSERT(s->ctr.in_flight > 0);
    if (--s->ctr.in_flight == 0) pthread_cond_broadcast(&s->idle_cv);
    pthread_mutex_unlock(&s->lock);
}

/* ---- responses ------------------------------------------------------------------------- */

enum MHD_Result srv_queue(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr, int status,
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

struct MHD_Response *srv_text_response(char *text, size_t len, const char *type)
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
enum MHD_Result srv_answer_json(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
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
    return srv_queue(s, c, hr, status, srv_text_response(nl, len + 1, "application/json"));
}

/* The error document as a response (NULL on allocation failure). */
struct MHD_Response *srv_error_response(const pkv_openai_error_t *err)
{
    char *text = pkv_openai_error_json(err->type, err->code, err->param, err->message);
    return text ? srv_text_response(text, strlen(text), "application/json") : NULL;
}

enum MHD_Result srv_answer_error(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                 const pkv_openai_error_t *err)
{
    PKV_LOGI("server", "%s: %d %s: %s", srv_route_label[hr->route], err->status, err->code,
             err->message);
    struct MHD_Response *r = srv_error_response(err);
    if (r && err->status == 429) {
        char ra[16];
        snprintf(ra, sizeof(ra), "%u", s->retry_after_s);
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, ra);
    }
    if (r && err->status == 503) MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, "5");
    return srv_queue(s, c, hr, err->status, r);
}

enum MHD_Result srv_answer_errorf(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                  int status, const char *type, const char *code, const char *msg)
{
    pkv_openai_error_t err;
    pkv_openai_error_set(&err, status, type, code, NULL, "%s", msg);
    return srv_answer_error(s, c, hr, &err);
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
    {"/v1/cache/purge", SRV_ROUTE_CACHE_PURGE, "POST"},
    {"/v1/kv_transfer/peaks/reset", SRV_ROUTE_PEAKS_RESET, "POST"},
};

static bool method_allowed(const char *allow, const char *method)
{
    if (!strcmp(method, "POST")) return !strcmp(allow, "POST");
    if (!strcmp(method, "GET") || !strcmp(method, "HEAD")) return strcmp(allow, "POST") != 0;
    return false;
}

static json_t *model_doc(pkv_server_t *s)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:i}", "id", s->served_name, "object", "model",
                     "created", (json_int_t)s->created, "owned_by", "pagekv", "max_model_len",
                     (int)s->max_context);
}

/* A prefill or decode node's KV format, in /health: what a router compares before it
 * pairs nodes (kv_transfer_params' pagekv_geometry, plus the node's TP degree, which may
 * differ between a pair: resharding). */
static json_t *kv_layout_doc(pkv_server_t *s)
{
    const pkv_geometry_t *g = pkv_kv_geometry(s->kv);
    return json_pack("{s:i, s:i, s:i, s:i, s:s, s:i}", "layers", (int)g->layers, "kv_heads",
                     (int)g->kv_heads, "head_dim", (int)g->head_dim, "block_tokens",
                     (int)g->block_tokens, "dtype", pkv_dtype_name(g->dtype), "tp",
                     (int)pkv_kv_tp(s->kv));
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
    if (s->kvn) pkv_disagg_node_snapshot(s->kvn, &out->kv);
    srv_memwatch_stats(s->mw, &out->mw);
    out->has_tier = s->tier != NULL;
    if (s->tier) pkv_kvtier_stats(s->tier, &out->tier);
}

/* An empty body or an empty JSON object: endpoints that take no parameters. */
bool srv_body_empty(const http_req_t *hr)
{
    if (!hr->len) return true;
    json_t *doc = json_loadb(hr->body, hr->len, 0, NULL);
    bool empty = json_is_object(doc) && json_object_size(doc) == 0;
    json_decref(doc);
    return empty;
}

static enum MHD_Result handle_simple(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                     const char *url)
{
    switch (hr->route) {
    case SRV_ROUTE_MODELS:
        return srv_answer_json(s, c, hr, 200,
                               json_pack("{s:s, s:[o]}", "object", "list", "data", model_doc(s)));
    case SRV_ROUTE_MODEL: {
        const char *id = url + strlen("/v1/models/");
        if (strcmp(id, s->served_name)) {
            pkv_openai_error_t err;
            pkv_openai_error_set(&err, 404, "invalid_request_error", "model_not_found", "model",
                                 "the model '%.100s' does not exist", id);
            return srv_answer_error(s, c, hr, &err);
        }
        return srv_answer_json(s, c, hr, 200, model_doc(s));
    }
    case SRV_ROUTE_HEALTH: {
        pthread_mutex_lock(&s->lock);
        bool draining = s->draining;
        pthread_mutex_unlock(&s->lock);
        if (!s->kvn)
            return srv_answer_json(s, c, hr, draining ? 503 : 200,
                                   json_pack("{s:s}", "status", draining ? "draining" : "ok"));
        uint64_t age = 0;
        bool agent_ok = pkv_disagg_node_healthy(s->kvn, &age);
        const char *status = draining ? "draining" : agent_ok ? "ok" : "kv_agent_down";
        return srv_answer_json(
            s, c, hr, draining || !agent_ok ? 503 : 200,
            json_pack("{s:s, s:s, s:s, s:s, s:I, s:o}", "status", status, "role",
                      pkv_server_role_name(s->role), "kv_agent", agent_ok ? "ok" : "down",
                      "kv_address", pkv_disagg_node_address(s->kvn), "kv_agent_progress_age_ms",
                      (json_int_t)(age / 1000000), "kv_layout", kv_layout_doc(s)));
    }
    case SRV_ROUTE_METRICS: {
        srv_snapshot_t snap;
        snapshot(s, &snap);
        size_t len = 0;
        char *text = srv_metrics_render(&snap, &len);
        if (!text) return MHD_NO;
        return srv_queue(s, c, hr, 200,
                         srv_text_response(text, len, "text/plain; version=0.0.4; charset=utf-8"));
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
        return srv_answer_json(s, c, hr, 200, doc);
    }
    case SRV_ROUTE_CACHE_RESET:
        return srv_handle_cache_reset(s, c, hr);
    case SRV_ROUTE_CACHE_LOOKUP:
        return srv_handle_cache_lookup(s, c, hr);
    case SRV_ROUTE_CACHE_DIGEST:
        return srv_handle_cache_digest(s, c, hr);
    case SRV_ROUTE_CACHE_PURGE:
        return srv_handle_cache_purge(s, c, hr);
    case SRV_ROUTE_PEAKS_RESET:
        return srv_handle_peaks_reset(s, c, hr);
    default:
        return srv_answer_errorf(s, c, hr, 500, "server_error", "internal_error",
                                 "unrouted request");
    }
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
        return srv_answer_errorf(s, c, hr, 404, "not_found_error", "not_found", msg);
    }
    if (!method_allowed(allow, method)) {
        pkv_openai_error_t err;
        pkv_openai_error_set(&err, 405, "invalid_request_error", "method_not_allowed", NULL,
                             "method %.16s is not allowed on %s (allowed: %s)", method, url, allow);
        struct MHD_Response *r = srv_error_response(&err);
        if (r) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
        return srv_queue(s, c, hr, 405, r);
    }
    const char *cl =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        char *end;
        errno = 0;
        unsigned long long n = strtoull(cl, &end, 10);
        if (!errno && end != cl && n > s->max_body) {
            if (hr->route <= SRV_ROUTE_CHAT) srv_count_rejection(s, SRV_REJ_BODY_TOO_LARGE);
            char msg[160];
            snprintf(msg, sizeof(msg),
                     "the request body (%llu bytes) is over the limit (%llu bytes)", n,
                     (unsigned long long)s->max_body);
            return srv_answer_errorf(s, c, hr, 413, "invalid_request_error", "body_too_large", msg);
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
    if (!srv_buf_grow(&hr->body, &hr->cap, hr->len + n + 1, 0, s->max_body + 1)) return MHD_NO;
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
        hr->t_headers = pkv_now_ns();
        *con_cls = hr;
        return on_first_call(s, c, hr, url, method);
    }
    if (hr->answered) {
        *upload_size = 0; /* answered early: discard whatever body follows */
        return MHD_YES;
    }
    if (hr->gen) return srv_generate_resume(s, c, hr); /* resumed from its park */
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        return body_append(s, hr, upload, n);
    }
    (void)version;
    if (hr->too_large) {
        if (hr->route <= SRV_ROUTE_CHAT) srv_count_rejection(s, SRV_REJ_BODY_TOO_LARGE);
        char msg[160];
        snprintf(msg, sizeof(msg), "the request body is over the limit (%llu bytes)",
                 (unsigned long long)s->max_body);
        return srv_answer_errorf(s, c, hr, 413, "invalid_request_error", "body_too_large", msg);
    }
    if (hr->route == SRV_ROUTE_COMPLETIONS || hr->route == SRV_ROUTE_CHAT)
        return srv_handle_generate(s, c, hr);
    return handle_simple(s, c, hr, url);
}

/* ---- wakers ---------------------------------------------------------------------------- */

srv_waker_t *srv_waker_take(pkv_server_t *s, struct MHD_Connection *c)
{
    pthread_mutex_lock(&s->wakers_mu);
    srv_waker_t *w = s->wakers_free;
    if (w) s->wakers_free = w->next_free;
    pthread_mutex_unlock(&s->wakers_mu);
    if (!w) return NULL;
    pthread_mutex_lock(&w->mu);
    w->conn = c;
    w->parked = w->woken = false;
    pthread_mutex_unlock(&w->mu);
    return w;
}

void srv_waker_give(pkv_server_t *s, srv_waker_t *w)
{
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    PKV_ASSERT(!w->parked);
    w->conn = NULL;
    pthread_mutex_unlock(&w->mu);
    pthread_mutex_lock(&s->wakers_mu);
    w->next_free = s->wakers_free;
    s->wakers_free = w;
    pthread_mutex_unlock(&s->wakers_mu);
}

bool srv_waker_park(srv_waker_t *w)
{
    pthread_mutex_lock(&w->mu);
    bool park = !w->woken && !atomic_load(&w->s->stopping);
    w->woken = false;
    if (park) {
        w->parked = true;
        MHD_suspend_connection(w->conn);
    }
    pthread_mutex_unlock(&w->mu);
    return park;
}

void srv_waker_wake(void *arg)
{
    srv_waker_t *w = arg;
    pthread_mutex_lock(&w->mu);
    if (w->parked) {
        w->parked = false;
        MHD_resume_connection(w->conn);
    } else if (w->conn) {
        w->woken = true;
    }
    pthread_mutex_unlock(&w->mu);
}

void srv_http_unpark_all(pkv_server_t *s)
{
    for (uint32_t i = 0; i < s->n_wakers; i++) srv_waker_wake(&s->wakers[i]);
}

static int wakers_init(pkv_server_t *s, uint32_t n)
{
    s->wakers = calloc(n, sizeof(*s->wakers));
    if (!s->wakers || pthread_mutex_init(&s->wakers_mu, NULL)) {
        free(s->wakers);
        s->wakers = NULL;
        return PKV_ERR_NOMEM;
    }
    for (uint32_t i = 0; i < n; i++) {
        srv_waker_t *w = &s->wakers[i];
        w->s = s;
        if (pthread_mutex_init(&w->mu, NULL)) {
            s->n_wakers = i;
            srv_http_free(s);
            return PKV_ERR_NOMEM;
        }
        w->next_free = i + 1 < n ? &s->wakers[i + 1] : NULL;
    }
    s->n_wakers = n;
    s->wakers_free = &s->wakers[0];
    return PKV_OK;
}

void srv_http_free(pkv_server_t *s)
{
    if (!s->wakers) return;
    for (uint32_t i = 0; i < s->n_wakers; i++) pthread_mutex_destroy(&s->wakers[i].mu);
    pthread_mutex_destroy(&s->wakers_mu);
    free(s->wakers);
    s->wakers = NULL;
    s->n_wakers = 0;
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    pkv_server_t *s = cls;
    http_req_t *hr = *con_cls;
    (void)c;
    if (!hr) return;
    *con_cls = NULL;
    srv_generate_free(s, hr); /* a pull abandoned, a request released, its waker back */
    if (hr->in_flight) {
        if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK &&
            toe != MHD_REQUEST_TERMINATED_DAEMON_SHUTDOWN) {
            pthread_mutex_lock(&s->lock);
            s->ctr.disconnects++;
            pthread_mutex_unlock(&s->lock);
        }
        srv_in_flight_done(s);
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

int srv_http_start(pkv_server_t *s, const pkv_server_config_t *cfg)
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
    unsigned limit = cfg->max_connections ? cfg->max_connections : 256;
    if (wakers_init(s, limit)) {
        freeaddrinfo(ai);
        return PKV_ERR_NOMEM;
    }
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME |
                     MHD_USE_ITC | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    s->mhd = MHD_start_daemon(flags, cfg->port, NULL, NULL, on_request, s, MHD_OPTION_SOCK_ADDR,
                              ai->ai_addr, MHD_OPTION_THREAD_POOL_SIZE, (unsigned)SRV_HTTP_THREADS,
                              MHD_OPTION_CONNECTION_LIMIT, limit, MHD_OPTION_LISTEN_BACKLOG_SIZE,
                              (unsigned)1024, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)120,
                              MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                              MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, s, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!s->mhd) {
        srv_http_free(s);
        PKV_LOGE("server", "cannot listen on %s:%u (address in use or not local?)", s->host,
                 cfg->port);
        return PKV_ERR_IO;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->mhd, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : cfg->port;
    return PKV_OK;
}
