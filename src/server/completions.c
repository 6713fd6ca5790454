/*
 * server: the generation endpoints, POST /v1/completions and /v1/chat/completions (design
 * in docs/design/server.md, "Request flow"), whole and streamed (SSE), on every role.
 *
 * No handler blocks (http.c: a few event-loop threads serve every connection). A request
 * that waits parks its connection and is woken by what it waits for: a decode leg's pull
 * by its end (the node's pull worker), the engine's output by the request's notify (the run
 * loop). Each time it is woken it looks again, and first whether the client is gone (poll:
 * POLLRDHUP/POLLHUP/POLLERR on the connection's socket) or the server is being destroyed:
 * then the request is cancelled at once (pkv_request_release), its pull abandoned, so its
 * sequence is freed at the engine's next step. A parked client's departure is seen at its
 * next wake (a token, the pull's end), not before: libmicrohttpd watches no parked socket.
 *
 * Flow: parse (openai; pure), tokenize and check the context, check the KV budget (400
 * with the numbers), count the request in flight, pull a decode leg's KV (parked), submit
 * (429 with Retry-After when the queue is full, 503 when draining); wait (parked) for the
 * first output (an admission failure still gets a proper status); then collect to the end
 * and answer once, or answer 200 with a callback response whose reader turns each engine
 * read into SSE events and parks the connection when there is none. Refusals
 * happen before submission, so a refused request changes nothing but the rejection
 * counters.
 */

#include "core/core.h"
#include "server/gen.h"
#include "server/server_int.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SSE_BLOCK 16384

/* A streamed response (the content reader's state), owned by the MHD response. */
typedef struct {
    pkv_server_t *s;
    pkv_request_t *req;
    srv_gen_t gen;
    pkv_openai_kind_t kind;
    bool include_usage;
    char id[48];
    time_t created;
    MHD_socket fd;
    srv_waker_t *w; /* its connection's (the request's notify wakes it) */
    uint64_t t_submit;
    bool first_seen;
    char *buf; /* SSE bytes not yet handed to MHD */
    size_t len, pos, cap;
    bool done;         /* [DONE] queued */
    bool decode_leg;   /* a decode leg that pulled: its decode phase is counted */
    bool want_timings; /* X-Pagekv-Timings: the last chunk carries pagekv_timings */
    pkv_disagg_timings_t tm;
    uint64_t admitted_ns, first_ns;
} stream_t;

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

/* ---- generation ----------------------------------------------------------------------- */

static json_t *usage_doc(const srv_gen_t *g)
{
    json_t *u = json_pack("{s:i, s:i, s:i, s:{s:i}}", "prompt_tokens", (int)g->prompt_tokens,
                          "completion_tokens", (int)g->completion_tokens, "total_tokens",
                          (int)(g->prompt_tokens + g->completion_tokens), "prompt_tokens_details",
                          "cached_tokens", (int)g->cached_tokens);
    json_t *d = u ? json_object_get(u, "prompt_tokens_details") : NULL;
    if (d && g->tier) /* of cached_tokens, those the disk tier gave */
        json_object_set_new(d, "cached_tokens_disk",
                            json_integer(PKV_MIN(g->disk_tokens, g->cached_tokens)));
    return u;
}

/* The error a request that ended without stop/length reports. */
static void gen_error(pkv_server_t *s, const srv_gen_t *g, uint32_t n_prompt, uint32_t max_tokens,
                      pkv_openai_error_t *err)
{
    if (g->status == PKV_ERR_NOFIT || g->status == PKV_ERR_NOSPACE) {
        pkv_kv_stats_t ks;
        pkv_kv_stats(s->kv, &ks);
        pkv_openai_error_set(
            err, 400, "invalid_request_error", "kv_budget_exceeded", NULL,
            "the request (%u prompt + %u completion tokens) can never fit the KV "
            "cache budget: %llu bytes per token, budget %llu bytes (%llu blocks of "
            "%llu bytes)",
            n_prompt, max_tokens, (unsigned long long)ks.token_bytes,
            (unsigned long long)ks.budget_bytes, (unsigned long long)ks.blocks_capacity,
            (unsigned long long)ks.block_bytes);
    } else if (g->status == PKV_ERR_SHUTDOWN || atomic_load(&s->stopping)) {
        pkv_openai_error_set(err, 503, "service_unavailable", "shutting_down", NULL,
                             "the server is shutting down");
    } else {
        pkv_openai_error_set(err, 500, "server_error", "internal_error", NULL,
                             "generation failed: %s", pkv_status_str(g->status));
    }
}

/* Can a request of `positions` KV positions ever fit the budget? */
static bool kv_fits(pkv_server_t *s, uint32_t n_prompt, uint32_t max_tokens,
                    pkv_openai_error_t *err)
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
        pkv_openai_error_set(
            err, 400, "invalid_request_error", "kv_budget_exceeded", NULL,
            "the request can never fit the KV cache budget: %u prompt + %u "
            "completion tokens need %llu positions = %llu blocks of %u tokens "
            "(%llu bytes); the budget is %llu bytes (%llu blocks)",
            n_prompt, max_tokens, (unsigned long long)positions, (unsigned long long)blocks,
            s->block_tokens,
            (unsigned long long)(s->backend == PKV_BACKEND_PAGED ? blocks * ks.block_bytes
                                                                 : positions * ks.token_bytes),
            (unsigned long long)ks.budget_bytes, (unsigned long long)ks.blocks_capacity);
    return fits;
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

static json_t *completion_doc(pkv_server_t *s, pkv_openai_kind_t kind, const char *id,
                              time_t created, json_t *text, const char *finish, json_t *usage)
{
    json_t *choice;
    if (kind == PKV_OPENAI_CHAT)
        choice = json_pack("{s:i, s:{s:s, s:o}, s:n, s:s}", "index", 0, "message", "role",
                           "assistant", "content", text, "logprobs", "finish_reason", finish);
    else
        choice = json_pack("{s:i, s:o, s:n, s:s}", "index", 0, "text", text, "logprobs",
                           "finish_reason", finish);
    return json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o}", "id", id, "object",
                     kind == PKV_OPENAI_CHAT ? "chat.completion" : "text_completion", "created",
                     (json_int_t)created, "model", s->served_name, "choices", choice, "usage",
                     usage);
}

/* ---- per-request phases ------------------------------------------------------------- */

/* Phase ph of one request: in the node's histograms when `counted` (a leg on a node with
 * an agent), and in *tm for the X-Pagekv-Timings opt-in either way. */
static void phase(pkv_server_t *s, pkv_disagg_timings_t *tm, bool counted, pkv_disagg_phase_t ph,
                  uint64_t from, uint64_t to)
{
    if (counted && s->kvn) {
        pkv_disagg_node_observe(s->kvn, tm, ph, from, to);
        return;
    }
    tm->ns[ph] = to > from ? to - from : 0;
    tm->have |= 1u << ph;
}

/* Which legs a finished request was, for its engine phases. */
typedef enum { LEG_NONE, LEG_PREFILL, LEG_DECODE } leg_t;

/* The engine phases of a finished request: a prefill leg's queue and compute, a decode
 * leg's decode; other requests' all three, in their timings only. */
static void engine_phases(pkv_server_t *s, pkv_disagg_timings_t *tm, leg_t leg, uint64_t t_submit,
                          uint64_t admitted, uint64_t first, uint64_t end)
{
    if (leg != LEG_DECODE && admitted) {
        phase(s, tm, leg == LEG_PREFILL, PKV_DISAGG_PHASE_PREFILL_QUEUE, t_submit, admitted);
        if (first)
            phase(s, tm, leg == LEG_PREFILL, PKV_DISAGG_PHASE_PREFILL_COMPUTE, admitted, first);
    }
    if (leg != LEG_PREFILL) phase(s, tm, leg == LEG_DECODE, PKV_DISAGG_PHASE_DECODE, t_submit, end);
}

/* A decode leg's engine moments for its decode_leg_ms (the pull's are there already). */
static void leg_marks(pkv_disagg_timings_t *tm, uint64_t admitted, uint64_t first)
{
    if (!tm->at[PKV_DISAGG_MARK_PULL_END]) return;
    tm->at[PKV_DISAGG_MARK_ADMITTED] = admitted;
    tm->at[PKV_DISAGG_MARK_SEEN] = first;
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
    if (!srv_buf_grow(&st->buf, &st->cap, st->len + n, 1024, 0)) return PKV_ERR_NOMEM;
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
    if (st->kind == PKV_OPENAI_CHAT)
        choice = json_pack("{s:i, s:o, s:n, s:s?}", "index", 0, "delta", delta_or_text, "logprobs",
                           "finish_reason", finish);
    else
        choice = json_pack("{s:i, s:o, s:n, s:s?}", "index", 0, "text", delta_or_text, "logprobs",
                           "finish_reason", finish);
    return json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", st->id, "object",
                     st->kind == PKV_OPENAI_CHAT ? "chat.completion.chunk" : "text_completion",
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
        json_t *body = st->kind == PKV_OPENAI_CHAT ? json_pack("{s:o}", "content", piece) : piece;
        if ((rc = sse_event(st, chunk_doc(st, body, NULL)))) return rc;
    }
    if (!o->finished) return PKV_OK;
    note_end(st->s, st->t_submit);
    const char *finish = srv_gen_finish_reason(&st->gen);
    if (finish) {
        engine_phases(st->s, &st->tm, st->decode_leg ? LEG_DECODE : LEG_NONE, st->t_submit,
                      st->admitted_ns, st->first_ns, pkv_now_ns());
        json_t *empty = st->kind == PKV_OPENAI_CHAT ? json_object() : json_string("");
        json_t *last = chunk_doc(st, empty, finish);
        if (last && st->want_timings) {
            leg_marks(&st->tm, st->admitted_ns, st->first_ns);
            json_object_set_new(last, "pagekv_timings", srv_timings_json(&st->tm, st->s->role));
        }
        if ((rc = sse_event(st, last))) return rc;
        if (st->include_usage) {
            json_t *doc =
                json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", st->id, "object",
                          st->kind == PKV_OPENAI_CHAT ? "chat.completion.chunk" : "text_completion",
                          "created", (json_int_t)st->created, "model", st->s->served_name,
                          "choices", "usage", usage_doc(&st->gen));
            if ((rc = sse_event(st, doc))) return rc;
        }
    } else {
        pkv_openai_error_t err;
        gen_error(st->s, &st->gen, st->gen.prompt_tokens, 0, &err);
        if ((rc = sse_event(st, pkv_openai_error_doc(&err)))) return rc;
    }
    st->done = true;
    return sse_append(st, "data: [DONE]\n\n", 14);
}

/* The stream's reader: the events there are; with none, the engine's output not read yet;
 * with none, the connection parks until the request's notify. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    stream_t *st = cls;
    (void)pos;
    for (;;) {
        if (st->pos < st->len) {
            size_t n = PKV_MIN(max, st->len - st->pos);
            memcpy(buf, st->buf + st->pos, n);
            st->pos += n;
            if (!st->tm.at[PKV_DISAGG_MARK_FIRST_WRITE])
                st->tm.at[PKV_DISAGG_MARK_FIRST_WRITE] = pkv_now_ns();
            if (st->pos == st->len) st->pos = st->len = 0;
            return (ssize_t)n;
        }
        if (st->done) return MHD_CONTENT_READER_END_OF_STREAM;
        if (atomic_load(&st->s->stopping) || client_gone(st->fd)) {
            /* Client gone or server going away: cancel now, not when MHD frees us. */
            pkv_request_cancel(st->req);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        pkv_request_output_t o;
        if (pkv_request_read(st->req, 0, &o) == PKV_ERR_TIMEOUT) {
            if (srv_waker_park(st->w)) return 0; /* resumed by the next output */
            continue;
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
    pkv_openai_kind_t kind;
    uint32_t n_prompt, max_tokens;
    uint64_t t_submit;
    char id[48];
    time_t created;
    MHD_socket fd;
    srv_waker_t *w; /* the connection's: the engine's notify and the pull's end wake it */
    srv_gen_t gen;
    bool first_seen;
    uint64_t rid;       /* pagekv's own request id (never the client's X-Request-Id) */
    uint64_t seed;      /* the request's sampling seed */
    const int32_t *ids; /* the prompt (n_prompt) */
    bool has_first;     /* first_token: the first token generated (a prefill leg's offer) */
    int32_t first_token;
    bool prefill_leg;        /* kv_transfer_params do_remote_decode on a prefill node */
    bool decode_leg;         /* a decode leg whose pull succeeded (not recomputed) */
    bool want_timings;       /* X-Pagekv-Timings: the answer carries pagekv_timings */
    pkv_disagg_timings_t tm; /* this request's phases on this node */
    uint64_t admitted_ns, first_ns;
    pkv_kvtier_lease_t lease; /* the disk tier: the prefix pinned until admission */
    uint64_t t_lease;         /* when the lease was prepared (0: no tier) */
} gen_run_t;

/* Take an id and a seed and count the request in flight; false when draining. */
static bool gen_admit(pkv_server_t *s, const pkv_openai_request_t *r, uint64_t *id, uint64_t *seed)
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
static void submit_error(pkv_server_t *s, int rc, const gen_run_t *run, pkv_openai_error_t *err)
{
    if (rc == PKV_ERR_BUSY) {
        srv_count_rejection(s, SRV_REJ_QUEUE_FULL);
        pkv_openai_error_set(err, 429, "rate_limit_error", "queue_full", NULL,
                             "the request queue is full; retry later");
    } else if (rc == PKV_ERR_SHUTDOWN) {
        srv_count_rejection(s, SRV_REJ_SHUTTING_DOWN);
        pkv_openai_error_set(err, 503, "service_unavailable", "shutting_down", NULL,
                             "the server is shutting down");
    } else if (rc == PKV_ERR_NOFIT) {
        srv_count_rejection(s, SRV_REJ_KV_BUDGET);
        srv_gen_t g = {.status = rc};
        gen_error(s, &g, run->n_prompt, run->max_tokens, err);
    } else if (rc == PKV_ERR_INVALID) {
        srv_count_rejection(s, SRV_REJ_INVALID);
        pkv_openai_error_set(err, 400, "invalid_request_error", "invalid_value", NULL,
                             "the engine refused the request's parameters");
    } else {
        pkv_openai_error_set(err, 500, "server_error", "internal_error", NULL,
                             "submitting the request failed: %s", pkv_status_str(rc));
    }
}

/* Check the KV budget and count the request in flight (run->rid and run->seed taken):
 * from here on drain waits for it, a decode leg's pull included. With a disk tier, the
 * prompt's prefix is then pinned in memory and loaded from disk where that pays (a decode
 * leg's pull adopts it and reads only the rest). PKV_OK, or *err (the refusal counted). */
static int gen_enter(pkv_server_t *s, http_req_t *hr, const pkv_openai_request_t *r,
                     const int32_t *ids, gen_run_t *run, pkv_openai_error_t *err)
{
    if (!kv_fits(s, run->n_prompt, run->max_tokens, err)) {
        srv_count_rejection(s, SRV_REJ_KV_BUDGET);
        return PKV_ERR_NOFIT;
    }
    if (!gen_admit(s, r, &run->rid, &run->seed)) {
        srv_count_rejection(s, SRV_REJ_SHUTTING_DOWN);
        pkv_openai_error_set(err, 503, "service_unavailable", "shutting_down", NULL,
                             "the server is shutting down");
        return PKV_ERR_SHUTDOWN;
    }
    hr->in_flight = true;
    if (s->tier) {
        run->t_lease = pkv_now_ns();
        pkv_kvtier_prepare(s->tier, r->salt, ids, run->n_prompt, &run->lease);
    }
    return PKV_OK;
}

/* The request's sampling as the first-token handoff binds it (seed: the one it samples with;
 * has_seed: the client named it). */
static pkv_disagg_sampling_t gen_sampling(const pkv_server_t *s, const pkv_openai_request_t *r,
                                          bool has_seed, uint64_t seed)
{
    return (pkv_disagg_sampling_t){.temperature = r->temperature,
                                   .top_p = r->top_p,
                                   .has_seed = has_seed,
                                   .seed = seed,
                                   .vocab = pkv_model_config(s->model)->vocab_size};
}

/* Submit a request gen_enter counted (seq: a decode leg's pulled prompt, the engine's on
 * PKV_OK; NULL otherwise; first: what came with it). PKV_OK with run->req, run->id and
 * run->created; otherwise *err (the refusal counted). */
static int gen_submit(pkv_server_t *s, const pkv_openai_request_t *r, const int32_t *ids,
                      pkv_seq_t *seq, const pkv_disagg_first_t *first, gen_run_t *run,
                      pkv_openai_error_t *err)
{
    bool given = seq && first && first->given;
    if (given) run->seed = first->seed; /* the prefill leg's, when the client named none */
    uint64_t id = run->rid, seed = run->seed;
    run->ids = ids;
    pkv_request_params_t p = {.keep_blocks = run->prefill_leg,
                              .seq = seq,
                              .first_given = given,
                              .first_token = given ? first->token : 0,
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
                              .ignore_eos = r->ignore_eos,
                              .notify = srv_waker_wake,
                              .notify_arg = run->w};
    /* A load from disk (gen_enter) is part of the time to first token; a decode leg's
     * phases start after its pull. */
    run->t_submit = run->t_lease && r->kvt != PKV_OPENAI_KVT_DECODE ? run->t_lease : pkv_now_ns();
    run->tm.at[PKV_DISAGG_MARK_SUBMITTED] = pkv_now_ns(); /* the engine may admit at once */
    int rc = pkv_engine_submit(s->engine, &p, &run->req);
    if (rc) {
        submit_error(s, rc, run, err);
        return rc;
    }
    snprintf(run->id, sizeof(run->id), "%s-%016llx",
             run->kind == PKV_OPENAI_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)(id ^ ((uint64_t)s->created << 32)));
    run->created = time(NULL);
    return PKV_OK;
}

/* One output of a non-streamed answer: its text appended to *acc. PKV_ERR_NOMEM. */
static int gen_take_whole(pkv_server_t *s, gen_run_t *run, const pkv_request_output_t *o,
                          char **acc, size_t *acc_len, size_t *acc_cap)
{
    const char *text;
    size_t len;
    srv_gen_feed(&run->gen, o, &text, &len);
    if (o->n_tokens && !run->has_first) run->has_first = true, run->first_token = o->tokens[0];
    note_first(s, run->t_submit, &run->first_seen, o);
    note_times(o, &run->admitted_ns, &run->first_ns);
    if (!srv_buf_grow(acc, acc_cap, *acc_len + len, 256, 0)) return PKV_ERR_NOMEM;
    if (len) memcpy(*acc + *acc_len, text, len);
    *acc_len += len;
    return PKV_OK;
}

/* A finished prefill leg: its prompt blocks (kept pinned by the engine until the release)
 * registered with the agent under a lease; *kvt the response's kv_transfer_params, with
 * its first token bound to them and to its sampling. */
static int prefill_offer(pkv_server_t *s, const pkv_openai_request_t *r, gen_run_t *run,
                         json_t **kvt)
{
    const uint32_t *blocks;
    uint32_t nb;
    int rc = pkv_request_kept_blocks(run->req, &blocks, &nb);
    if (rc) return rc;
    pkv_disagg_sampling_t smp = gen_sampling(s, r, true, run->seed);
    return pkv_disagg_node_offer(s->kvn, run->rid, blocks, nb, run->ids, run->n_prompt,
                                 run->has_first ? run->first_token : -1, &smp, kvt);
}

/* Non-streaming: the whole text is in (rc PKV_OK) or could not be kept (PKV_ERR_NOMEM);
 * answer once. Releases run->req; takes acc. */
static enum MHD_Result answer_whole(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                    const pkv_openai_request_t *r, gen_run_t *run, char *acc,
                                    size_t acc_len, int rc)
{
    const char *finish = rc ? NULL : srv_gen_finish_reason(&run->gen);
    json_t *kvt = NULL;
    int offer_rc = finish && run->prefill_leg ? prefill_offer(s, r, run, &kvt) : PKV_OK;
    pkv_request_release(run->req);
    run->req = NULL;
    if (rc) {
        free(acc);
        return srv_answer_errorf(s, c, hr, 500, "server_error", "out_of_memory", "out of memory");
    }
    note_end(s, run->t_submit);
    if (!finish) {
        free(acc);
        pkv_openai_error_t err;
        gen_error(s, &run->gen, run->n_prompt, run->max_tokens, &err);
        return srv_answer_error(s, c, hr, &err);
    }
    json_t *jt = offer_rc ? NULL : sanitized_string(acc ? acc : "", acc_len);
    free(acc);
    if (offer_rc) {
        char msg[160];
        snprintf(msg, sizeof(msg), "the prompt's blocks could not be registered for transfer: %s",
                 pkv_status_str(offer_rc));
        return srv_answer_errorf(s, c, hr, 500, "server_error", "internal_error", msg);
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
    if (doc && run->want_timings) {
        leg_marks(&run->tm, run->admitted_ns, run->first_ns);
        json_object_set_new(doc, "pagekv_timings", srv_timings_json(&run->tm, s->role));
    }
    return srv_answer_json(s, c, hr, 200, doc);
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
        run->req = NULL;
        pkv_openai_error_t err;
        gen_error(s, &run->gen, run->n_prompt, run->max_tokens, &err);
        return srv_answer_error(s, c, hr, &err);
    }
    stream_t *st = calloc(1, sizeof(*st));
    if (!st) {
        pkv_request_release(run->req);
        run->req = NULL;
        return MHD_NO;
    }
    st->s = s;
    st->req = run->req;
    run->req = NULL; /* the stream's now */
    st->gen = run->gen;
    st->kind = run->kind;
    st->include_usage = include_usage;
    memcpy(st->id, run->id, sizeof(st->id));
    st->created = run->created;
    st->fd = run->fd;
    st->w = run->w;
    st->t_submit = run->t_submit;
    st->first_seen = run->first_seen;
    st->decode_leg = run->decode_leg;
    st->want_timings = run->want_timings;
    st->tm = run->tm;
    st->admitted_ns = run->admitted_ns;
    st->first_ns = run->first_ns;
    int rc = PKV_OK;
    if (run->kind == PKV_OPENAI_CHAT)
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
    return srv_queue(s, c, hr, 200, resp);
}

/* kv_transfer_params this node's role cannot take (400, *err filled): any on a unified
 * node; a decode leg on a prefill node; a prefill leg on a decode node or streamed. */
static bool kv_role_refuses(const pkv_server_t *s, const pkv_openai_request_t *r,
                            pkv_openai_error_t *err)
{
    const char *p = "kv_transfer_params", *type = "invalid_request_error";
    if (r->kvt == PKV_OPENAI_KVT_NONE) return false;
    if (s->role == PKV_SERVER_ROLE_UNIFIED)
        pkv_openai_error_set(
            err, 400, type, "unsupported_parameter", p,
            "'kv_transfer_params' needs a node started with --role prefill or decode "
            "(this node is unified)");
    else if (r->kvt == PKV_OPENAI_KVT_DECODE && s->role == PKV_SERVER_ROLE_PREFILL)
        pkv_openai_error_set(err, 400, type, "invalid_value", p,
                             "do_remote_prefill: this is a prefill node; send the decode leg to a "
                             "decode node");
    else if (r->kvt == PKV_OPENAI_KVT_DECODE)
        return false; /* a decode leg on a decode node */
    else if (s->role == PKV_SERVER_ROLE_DECODE)
        pkv_openai_error_set(err, 400, type, "invalid_value", p,
                             "do_remote_decode: this is a decode node; send the prefill leg to a "
                             "prefill node");
    else if (r->stream)
        pkv_openai_error_set(
            err, 400, type, "invalid_value", "stream",
            "a prefill leg (do_remote_decode) is answered once: 'stream' must be false");
    else
        return false;
    return true;
}

/* The X-Pagekv-Timings request header: "1"/"true" asks for the request's own phases in
 * the answer (pagekv_timings), "0"/"false" or none does not; anything else is a 400. */
static int want_timings(struct MHD_Connection *c, bool *on, pkv_openai_error_t *err)
{
    const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Pagekv-Timings");
    *on = v && (!strcmp(v, "1") || !strcasecmp(v, "true"));
    if (!v || *on || !strcmp(v, "0") || !strcasecmp(v, "false")) return PKV_OK;
    pkv_openai_error_set(err, 400, "invalid_request_error", "invalid_value", "X-Pagekv-Timings",
                         "the X-Pagekv-Timings header must be 1, true, 0 or false");
    return PKV_ERR_INVALID;
}

/* The first output: the request was admitted (its lease adopted, released here), and the
 * prompt's computed part teaches the tier's recompute estimate. */
static void tier_admitted(pkv_server_t *s, gen_run_t *run, const pkv_request_output_t *o)
{
    run->gen.tier = true;
    run->gen.disk_tokens = run->lease.disk_blocks * s->block_tokens;
    pkv_kvtier_release(s->tier, &run->lease);
    uint32_t computed = o->prompt_tokens - PKV_MIN(o->cached_tokens, o->prompt_tokens);
    if (o->admitted_ns && computed >= s->block_tokens && !o->preemptions)
        pkv_kvtier_note_prefill(s->tier, computed, pkv_now_ns() - o->admitted_ns);
}

/* ---- a generation request across its parks ------------------------------------------- */

typedef enum {
    GEN_PULLING, /* a decode leg's pull runs (pkv-pull and the agents): nothing submitted */
    GEN_FIRST,   /* submitted: waiting for the first output (admission errors get a status) */
    GEN_WHOLE,   /* non-streamed: collecting the text to the finish */
} gen_stage_t;

/* A generation request from its parse to its answer (http_req_t.gen; freed when the request
 * completes): what every call of the handler after a park needs. */
struct srv_gen_req {
    gen_run_t run; /* run.req: ours until the answer releases it or the stream takes it */
    pkv_openai_request_t r;
    int32_t *ids;
    gen_stage_t stage;
    pkv_disagg_pull_t *pull;  /* GEN_PULLING */
    pkv_seq_t *pulled;        /* a decode leg's pulled prompt, until it is submitted */
    pkv_disagg_first_t first; /* and the prefill leg's first token with it */
    char *acc;                /* GEN_WHOLE: the text so far */
    size_t acc_len, acc_cap;
};
typedef struct srv_gen_req srv_gen_req_t;

/* Let go of what is in flight: the pull (abandoned: its reads cancelled), the request
 * (released: cancelled if unfinished), the pulled sequence, the tier's lease. */
static void gen_drop(pkv_server_t *s, srv_gen_req_t *g)
{
    pkv_disagg_pull_abandon(g->pull);
    g->pull = NULL;
    pkv_request_release(g->run.req);
    g->run.req = NULL;
    pkv_seq_free(g->pulled);
    g->pulled = NULL;
    if (s->tier) pkv_kvtier_release(s->tier, &g->run.lease);
}

void srv_generate_free(pkv_server_t *s, http_req_t *hr)
{
    srv_gen_req_t *g = hr->gen;
    if (!g) return;
    hr->gen = NULL;
    gen_drop(s, g);
    srv_waker_give(s, g->run.w);
    free(g->acc);
    free(g->ids);
    pkv_openai_request_free(&g->r);
    free(g);
}

/* Submit (a decode leg: after its pull; pulled NULL: computed here) and log it. */
static int gen_start(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr, srv_gen_req_t *g,
                     pkv_openai_error_t *err)
{
    int rc = gen_submit(s, &g->r, g->ids, g->pulled, &g->first, &g->run, err);
    if (rc) return rc;
    if (s->role == PKV_SERVER_ROLE_DECODE && g->r.kvt == PKV_OPENAI_KVT_NONE)
        pkv_disagg_node_count_local(s->kvn); /* a router's fallback: computed here */
    g->run.decode_leg = g->pulled != NULL;
    g->pulled = NULL; /* the engine's now: it computes from the pulled prompt's end */
    char xrid[129];
    request_id_of(c, xrid);
    PKV_LOGI("server", "%s: request %llu (%s), X-Request-Id %s", srv_route_label[hr->route],
             (unsigned long long)g->run.rid,
             g->r.kvt == PKV_OPENAI_KVT_PREFILL  ? "prefill leg"
             : g->r.kvt == PKV_OPENAI_KVT_DECODE ? "decode leg"
                                                 : "whole",
             xrid);
    srv_gen_init(&g->run.gen);
    g->stage = GEN_FIRST;
    return PKV_OK;
}

/* One look at what the request waits for, never blocking. true: answered (*ret says how);
 * false: nothing more to do now (park and look again when woken). */
static bool gen_step(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr, srv_gen_req_t *g,
                     enum MHD_Result *ret)
{
    pkv_openai_error_t err;
    pkv_request_output_t o;
    if (g->stage == GEN_PULLING) {
        if (!pkv_disagg_pull_ended(g->pull)) return false;
        g->run.tm.at[PKV_DISAGG_MARK_RESUMED] = pkv_now_ns();
        int rc = pkv_disagg_pull_take(g->pull, &g->pulled, &g->first, &g->run.tm, &err);
        g->pull = NULL;
        if (rc && err.status == 400) srv_count_rejection(s, SRV_REJ_INVALID); /* else: failed */
        if (rc || gen_start(s, c, hr, g, &err)) {
            *ret = srv_answer_error(s, c, hr, &err);
            return true;
        }
    }
    if (g->stage == GEN_FIRST) {
        if (pkv_request_read(g->run.req, 0, &o) == PKV_ERR_TIMEOUT) return false;
        if (s->tier) tier_admitted(s, &g->run, &o);
        if (g->r.stream) {
            *ret = answer_stream(s, c, hr, &g->run, &o, g->r.include_usage);
            return true;
        }
        g->stage = GEN_WHOLE;
    } else if (pkv_request_read(g->run.req, 0, &o) == PKV_ERR_TIMEOUT) {
        return false;
    }
    for (;;) { /* GEN_WHOLE: o is an output not taken yet */
        int rc = gen_take_whole(s, &g->run, &o, &g->acc, &g->acc_len, &g->acc_cap);
        if (rc || o.finished) {
            char *acc = g->acc;
            g->acc = NULL;
            *ret = answer_whole(s, c, hr, &g->r, &g->run, acc, g->acc_len, rc);
            return true;
        }
        if (pkv_request_read(g->run.req, 0, &o) == PKV_ERR_TIMEOUT) return false;
    }
}

/* Look, and park until woken while there is nothing to do. A client that went away (seen
 * whenever the request is woken) or a server being destroyed ends it at once: MHD closes
 * the connection, the request is cancelled. */
static enum MHD_Result gen_continue(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr)
{
    srv_gen_req_t *g = hr->gen;
    for (;;) {
        if (atomic_load(&s->stopping) || client_gone(g->run.fd)) {
            gen_drop(s, g);
            return MHD_NO;
        }
        enum MHD_Result ret;
        if (gen_step(s, c, hr, g, &ret)) return ret;
        if (srv_waker_park(g->run.w)) return MHD_YES;
    }
}

enum MHD_Result srv_generate_resume(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr)
{
    return gen_continue(s, c, hr);
}

/* The checks before anything is counted: the body, the role, the timings header, the
 * prompt. PKV_OK with g->r, g->ids and the run's figures; otherwise *err (counted). */
static int gen_parse(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr, srv_gen_req_t *g,
                     pkv_openai_error_t *err)
{
    pkv_openai_kind_t kind = hr->route == SRV_ROUTE_CHAT ? PKV_OPENAI_CHAT : PKV_OPENAI_COMPLETIONS;
    pkv_openai_limits_t lim = {.max_context = s->max_context};
    if (pkv_openai_request_parse(kind, hr->body, hr->len, s->served_name, &lim, &g->r, err)) {
        srv_count_rejection(s, err->status == 404 ? SRV_REJ_MODEL : SRV_REJ_INVALID);
        return PKV_ERR_INVALID;
    }
    g->run.kind = kind;
    g->run.prefill_leg = g->r.kvt == PKV_OPENAI_KVT_PREFILL;
    if (kv_role_refuses(s, &g->r, err) || want_timings(c, &g->run.want_timings, err)) {
        srv_count_rejection(s, SRV_REJ_INVALID);
        return PKV_ERR_INVALID;
    }
    if (pkv_openai_request_prompt(&g->r, s->tok, &lim, s->default_max_tokens, &g->ids,
                                  &g->run.n_prompt, &g->run.max_tokens, err)) {
        srv_count_rejection(s, !strcmp(err->code, "context_length_exceeded") ? SRV_REJ_CONTEXT
                                                                             : SRV_REJ_INVALID);
        return PKV_ERR_INVALID;
    }
    return PKV_OK;
}

/* POST /v1/completions and /v1/chat/completions (the flow in the top comment). */
enum MHD_Result srv_handle_generate(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr)
{
    pkv_openai_error_t err;
    srv_gen_req_t *g = calloc(1, sizeof(*g));
    srv_waker_t *w = g ? srv_waker_take(s, c) : NULL;
    if (!w) {
        free(g);
        return srv_answer_errorf(s, c, hr, 503, "service_unavailable", "overloaded",
                                 "no room for another request");
    }
    hr->gen = g; /* from here on srv_generate_free (the request's completion) ends it */
    g->run.tm.at[PKV_DISAGG_MARK_HEADERS] = hr->t_headers;
    g->run.tm.at[PKV_DISAGG_MARK_ARRIVAL] = pkv_now_ns();
    g->run.w = w;
    g->run.fd = conn_fd(c);
    if (gen_parse(s, c, hr, g, &err) || gen_enter(s, hr, &g->r, g->ids, &g->run, &err))
        return srv_answer_error(s, c, hr, &err);
    if (g->r.kvt == PKV_OPENAI_KVT_DECODE) {
        /* The pull runs without this thread; its end wakes the connection. */
        g->run.tm.at[PKV_DISAGG_MARK_PULL_ASKED] = pkv_now_ns();
        pkv_disagg_sampling_t smp = gen_sampling(s, &g->r, g->r.has_seed, g->run.seed);
        if (pkv_disagg_pull_start(s->kvn, g->r.kvt_params, g->ids, g->run.n_prompt, g->r.salt, &smp,
                                  srv_waker_wake, w, &g->pull, &err)) {
            if (err.status == 400) srv_count_rejection(s, SRV_REJ_INVALID);
            return srv_answer_error(s, c, hr, &err);
        }
        g->stage = GEN_PULLING;
    } else if (gen_start(s, c, hr, g, &err)) {
        return srv_answer_error(s, c, hr, &err);
    }
    return gen_continue(s, c, hr);
}
