/*
 * router relay: the node side of `pagekv route`, one thread ("pkv-route-io") running a
 * libcurl multi handle for every transfer to the nodes (design: docs/design/router.md).
 *
 * An exchange's path: the body checked as serve checks it (openai/openai.h) -> the
 * prefill node chosen (cache_aware: a /v1/cache/lookup to every candidate, the most
 * matched tokens wins, ties and misses to the least loaded) -> the prefill leg -> a
 * decode node -> the decode leg, whose answer is relayed: whole, or as SSE events, only
 * complete ones, so that an error event can always close a stream cleanly.
 *
 * Failures before any byte reached the client are retried on another node of the role,
 * within the request's deadline: a decode node that could not be reached gets the same
 * kv_transfer_params on another decode node; a decode leg that failed once it had been
 * sent (the pull may have consumed the registration), or whose producer was lost, runs
 * both legs again (peer_lost, timeout and corrupt excluding that prefill node). A stream
 * that breaks after its first event ends with an error event; nothing is sent twice.
 *
 * Bounds. Every transfer has node_timeout_ms of silence at most (swept here, so paused
 * streams are exempt); lookups and probes lookup_timeout_ms in all; an exchange not yet
 * answered its deadline. A node runs at most node_max_in_flight legs; more wait in its
 * FIFO (a router's own queue, counted as the node's load). A slow client's stream pauses
 * its node transfer once stream_buffer bytes (--stream-buffer-bytes) wait for it.
 *
 * Everything here is io-thread state except what router_int.h puts under a lock.
 */
#include "core/core.h"
#include "router/router_int.h"
#include "openai/openai.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RT_BODY_MAX (64ull << 20) /* a node's whole answer */
#define RT_POLL_MS  50
#define NS_PER_MS   1000000ull

static void lookup_decide(pkv_router_t *r, rt_xchg_t *x);
static void pick_prefill(pkv_router_t *r, rt_xchg_t *x);
static void pick_decode(pkv_router_t *r, rt_xchg_t *x);
static void pass_start(pkv_router_t *r, rt_xchg_t *x);

/* ---- the inbox ------------------------------------------------------------------------- */

bool rt_io_push(pkv_router_t *r, rt_xchg_t *x)
{
    pthread_mutex_lock(&r->inbox_lock);
    bool open = !r->io_closed;
    if (open && !x->in_inbox) {
        atomic_fetch_add(&x->refs, 1); /* the inbox's */
        x->in_inbox = true;
        x->inbox_next = NULL;
        if (r->inbox_tail)
            r->inbox_tail->inbox_next = x;
        else
            r->inbox_head = x;
        r->inbox_tail = x;
        curl_multi_wakeup(r->multi);
    }
    pthread_mutex_unlock(&r->inbox_lock);
    return open;
}

static rt_xchg_t *inbox_pop(pkv_router_t *r)
{
    pthread_mutex_lock(&r->inbox_lock);
    rt_xchg_t *x = r->inbox_head;
    if (x) {
        r->inbox_head = x->inbox_next;
        if (!r->inbox_head) r->inbox_tail = NULL;
        x->in_inbox = false;
    }
    pthread_mutex_unlock(&r->inbox_lock);
    return x;
}

/* ---- small helpers ---------------------------------------------------------------------- */

static bool buf_put(char **buf, size_t *len, size_t *cap, const char *p, size_t n, size_t limit)
{
    if (*len + n + 1 > limit) return false;
    if (*len + n + 1 > *cap) {
        size_t c = PKV_MAX(*len + n + 1, *cap ? *cap * 2 : 1024);
        char *nb = realloc(*buf, c);
        if (!nb) return false;
        *buf = nb;
        *cap = c;
    }
    memcpy(*buf + *len, p, n);
    *len += n;
    (*buf)[*len] = 0;
    return true;
}

static void count(pkv_router_t *r, uint64_t *ctr)
{
    pthread_mutex_lock(&r->lock);
    (*ctr)++;
    pthread_mutex_unlock(&r->lock);
}

static void hist(pkv_router_t *r, pkv_hist_t *h, uint64_t t0)
{
    double s = (double)(pkv_now_ns() - t0) / 1e9;
    pthread_mutex_lock(&r->lock);
    pkv_hist_add(h, rt_hist_bounds, RT_HIST_BUCKETS, s);
    pthread_mutex_unlock(&r->lock);
}

static void node_mark(pkv_router_t *r, rt_node_t *n, bool up)
{
    pthread_mutex_lock(&r->lock);
    n->up = up;
    pthread_mutex_unlock(&r->lock);
}

static bool node_up(pkv_router_t *r, const rt_node_t *n)
{
    pthread_mutex_lock(&r->lock);
    bool up = n->up;
    pthread_mutex_unlock(&r->lock);
    return up;
}

static void node_load_changed(pkv_router_t *r, rt_node_t *n)
{
    pthread_mutex_lock(&r->lock);
    n->in_flight = n->active + n->waiting;
    pthread_mutex_unlock(&r->lock);
}

static void reason_add(rt_xchg_t *x, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void reason_add(rt_xchg_t *x, const char *fmt, ...)
{
    size_t n = strlen(x->reason);
    if (n + 8 >= sizeof(x->reason)) return;
    if (n) n += (size_t)snprintf(x->reason + n, sizeof(x->reason) - n, "; ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(x->reason + n, sizeof(x->reason) - n, fmt, ap);
    va_end(ap);
}

/* ---- legs -------------------------------------------------------------------------------- */

static bool leg_counts(const rt_leg_t *l)
{
    return l->kind == RT_LEG_PREFILL || l->kind == RT_LEG_DECODE || l->kind == RT_LEG_PASS;
}

static size_t on_header(char *p, size_t sz, size_t n, void *arg)
{
    rt_leg_t *l = arg;
    (void)p;
    l->t_last = pkv_now_ns();
    return sz * n;
}

size_t rt_sse_complete_end(const char *buf, size_t len, size_t old)
{
    size_t end = 0;
    for (size_t i = old ? old - 1 : 0; i + 1 < len; i++)
        if (buf[i] == '\n' && buf[i + 1] == '\n') end = i + 2;
    return end;
}

/* The stream's complete SSE events (up to the last blank line) go to the client. */
static size_t relay_stream(rt_leg_t *l, const char *p, size_t k)
{
    rt_xchg_t *x = l->x;
    pkv_router_t *r = x->r;
    pthread_mutex_lock(&x->lock);
    bool gone = x->gone, full = x->olen - x->opos >= r->stream_buffer;
    if (full && !gone) x->io_paused = true;
    pthread_mutex_unlock(&x->lock);
    if (gone) return 0;
    if (full) {
        l->paused = true;
        count(r, &r->ctr.stream_pauses);
        return CURL_WRITEFUNC_PAUSE;
    }
    size_t old = l->len;
    if (!buf_put(&l->buf, &l->len, &l->cap, p, k, RT_BODY_MAX)) return 0;
    size_t end = rt_sse_complete_end(l->buf, l->len, old);
    if (!end) return k;
    pthread_mutex_lock(&x->lock);
    bool ok = buf_put(&x->obuf, &x->olen, &x->ocap, l->buf, end, RT_BODY_MAX);
    bool first = ok && !l->committed;
    if (first) {
        x->status = 200;
        x->streamed = true;
        x->ready = true;
        l->committed = true;
    }
    bool wake = ok && rt_xchg_wake_locked(x);
    pthread_mutex_unlock(&x->lock);
    if (wake) MHD_resume_connection(x->conn);
    if (!ok) return 0;
    if (first) hist(r, &r->ctr.ttft, x->t_arrival);
    memmove(l->buf, l->buf + end, l->len - end);
    l->len -= end;
    return k;
}

static size_t on_write(char *p, size_t sz, size_t n, void *arg)
{
    rt_leg_t *l = arg;
    size_t k = sz * n;
    l->t_last = pkv_now_ns();
    if (!l->status) curl_easy_getinfo(l->easy, CURLINFO_RESPONSE_CODE, &l->status);
    if (l->kind == RT_LEG_DECODE && l->x->stream && l->status == 200) return relay_stream(l, p, k);
    return buf_put(&l->buf, &l->len, &l->cap, p, k, RT_BODY_MAX) ? k : 0;
}

static rt_leg_t *leg_new(pkv_router_t *r, rt_leg_kind_t kind, rt_xchg_t *x, rt_node_t *node,
                         const char *path, const char *body, size_t body_len)
{
    rt_leg_t *l = calloc(1, sizeof(*l));
    if (!l) return NULL;
    l->kind = kind;
    l->x = x;
    l->node = node;
    l->req_body = body;
    if (!(l->easy = curl_easy_init())) {
        free(l);
        return NULL;
    }
    char url[512];
    snprintf(url, sizeof(url), "%s%s", node->url, path);
    CURL *e = l->easy;
    bool short_one = kind == RT_LEG_LOOKUP || kind == RT_LEG_PROBE || kind == RT_LEG_MODELS;
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_PRIVATE, l);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, l->err);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, l);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, l);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS,
                     (long)(short_one ? r->lookup_timeout_ms : r->node_timeout_ms));
    if (short_one) curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)r->lookup_timeout_ms);
    struct curl_slist *h = curl_slist_append(NULL, "Expect:");
    if (body) h = curl_slist_append(h, "Content-Type: application/json");
    if (x) {
        char hv[160];
        snprintf(hv, sizeof(hv), "X-Request-Id: %s", x->rid);
        h = curl_slist_append(h, hv);
        if (x->timings[0]) {
            snprintf(hv, sizeof(hv), "X-Pagekv-Timings: %s", x->timings);
            h = curl_slist_append(h, hv);
        }
    }
    l->hdrs = h;
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
    if (body) {
        curl_easy_setopt(e, CURLOPT_POST, 1L);
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)body_len);
    }
    if (x) {
        l->xnext = x->legs;
        x->legs = l;
    }
    return l;
}

static void leg_run(pkv_router_t *r, rt_leg_t *l)
{
    l->running = true;
    l->t_start = l->t_last = pkv_now_ns();
    l->aprev = NULL;
    l->anext = r->active;
    if (r->active) r->active->aprev = l;
    r->active = l;
    if (leg_counts(l)) l->node->active++;
    curl_multi_add_handle(r->multi, l->easy);
}

/* Start l now, or queue it behind its node's cap. */
static void leg_start(pkv_router_t *r, rt_leg_t *l)
{
    rt_node_t *n = l->node;
    if (leg_counts(l)) {
        pthread_mutex_lock(&r->lock);
        n->requests++;
        pthread_mutex_unlock(&r->lock);
    }
    if (leg_counts(l) && n->active >= r->node_max_in_flight) {
        l->queued = true;
        l->wnext = NULL;
        if (n->wait_tail)
            n->wait_tail->wnext = l;
        else
            n->wait_head = l;
        n->wait_tail = l;
        n->waiting++;
    } else {
        leg_run(r, l);
    }
    node_load_changed(r, n);
}

/* Stop and free l (wherever it is); the node's next waiting leg starts. */
static void leg_end(pkv_router_t *r, rt_leg_t *l)
{
    rt_node_t *n = l->node;
    if (l->running) {
        curl_multi_remove_handle(r->multi, l->easy);
        if (l->aprev)
            l->aprev->anext = l->anext;
        else
            r->active = l->anext;
        if (l->anext) l->anext->aprev = l->aprev;
        if (leg_counts(l)) n->active--;
    } else if (l->queued) {
        rt_leg_t **pp = &n->wait_head, *prev = NULL;
        while (*pp && *pp != l) prev = *pp, pp = &(*pp)->wnext;
        if (*pp) {
            *pp = l->wnext;
            if (n->wait_tail == l) n->wait_tail = prev;
            n->waiting--;
        }
    }
    if (l->x) {
        rt_leg_t **pp = &l->x->legs;
        while (*pp && *pp != l) pp = &(*pp)->xnext;
        if (*pp) *pp = l->xnext;
    }
    if (leg_counts(l) && n->wait_head && n->active < r->node_max_in_flight) {
        rt_leg_t *w = n->wait_head;
        n->wait_head = w->wnext;
        if (!n->wait_head) n->wait_tail = NULL;
        n->waiting--;
        w->queued = false;
        leg_run(r, w);
    }
    node_load_changed(r, n);
    curl_easy_cleanup(l->easy);
    curl_slist_free_all(l->hdrs);
    free(l->buf);
    free(l);
}

/* ---- finishing an exchange ---------------------------------------------------------------- */

/* The io thread is done with x: its legs end, its reference drops. */
static void xchg_release(pkv_router_t *r, rt_xchg_t *x)
{
    x->io_live = false;
    while (x->legs) leg_end(r, x->legs);
    if (x->live_prev)
        x->live_prev->live_next = x->live_next;
    else if (r->live == x)
        r->live = x->live_next;
    if (x->live_next) x->live_next->live_prev = x->live_prev;
    x->live_prev = x->live_next = NULL;
    hist(r, &r->ctr.e2e, x->t_arrival);
    rt_xchg_unref(x);
}

/* Answer x once with status and body (malloc'd, taken) and release it. */
static void finish(pkv_router_t *r, rt_xchg_t *x, int status, char *body, size_t len,
                   const char *retry_after)
{
    pthread_mutex_lock(&x->lock);
    bool wake = false;
    if (!x->ready) {
        x->status = status;
        x->ready = true;
        free(x->obuf);
        x->obuf = body;
        x->olen = body ? len : 0;
        x->opos = 0;
        x->ocap = x->olen;
        body = NULL;
        snprintf(x->retry_after, sizeof(x->retry_after), "%s", retry_after ? retry_after : "");
    }
    x->done = true;
    wake = rt_xchg_wake_locked(x);
    pthread_mutex_unlock(&x->lock);
    free(body);
    if (wake) MHD_resume_connection(x->conn);
    if (status != 200 || !x->stream) hist(r, &r->ctr.ttft, x->t_arrival);
    xchg_release(r, x);
}

static void finish_error(pkv_router_t *r, rt_xchg_t *x, int status, const char *type,
                         const char *code, const char *param, const char *msg)
{
    PKV_LOGI("router", "%s %s: %d %s: %s", rt_route_label[x->route], x->rid, status, code, msg);
    char *text = pkv_openai_error_json(type, code, param, msg);
    finish(r, x, status, text, text ? strlen(text) : 0, status == 503 ? "5" : NULL);
}

static void fail_no_node(pkv_router_t *r, rt_xchg_t *x, const char *role)
{
    char msg[320];
    snprintf(msg, sizeof(msg), "no %s node could serve the request: %.250s", role,
             x->reason[0] ? x->reason : "none is up");
    count(r, &r->ctr.rejected[RT_REJ_NO_NODE]);
    finish_error(r, x, 503, "service_unavailable", "no_node_available", NULL, msg);
}

static void fail_deadline(pkv_router_t *r, rt_xchg_t *x)
{
    char msg[320];
    snprintf(msg, sizeof(msg), "no answer within the request's deadline (%u ms): %.230s",
             r->request_timeout_ms, x->reason[0] ? x->reason : "the nodes are busy");
    count(r, &r->ctr.rejected[RT_REJ_NO_NODE]);
    finish_error(r, x, 503, "service_unavailable", "timeout", NULL, msg);
}

/* A node's own answer, relayed as it is. */
static void finish_relay(pkv_router_t *r, rt_xchg_t *x, rt_leg_t *l)
{
    char *body = l->buf;
    size_t len = l->len;
    l->buf = NULL;
    l->len = l->cap = 0;
    if (l->status >= 400 && l->status < 500) count(r, &r->ctr.rejected[RT_REJ_INVALID]);
    finish(r, x, (int)l->status, body, len, l->status == 429 ? "1" : NULL);
}

/* A committed stream broke: an error event closes it (the output so far stands). */
static void stream_broken(pkv_router_t *r, rt_xchg_t *x, rt_leg_t *l, const char *what)
{
    char msg[320];
    snprintf(msg, sizeof(msg), "the decode node %s failed mid-stream (%.200s)", l->node->url, what);
    PKV_LOGW("router", "%s: %s", x->rid, msg);
    char *err = pkv_openai_error_json("server_error", "upstream_lost", NULL, msg);
    pthread_mutex_lock(&x->lock);
    if (err) {
        buf_put(&x->obuf, &x->olen, &x->ocap, "data: ", 6, RT_BODY_MAX + 4096);
        buf_put(&x->obuf, &x->olen, &x->ocap, err, strlen(err), RT_BODY_MAX + 4096);
        buf_put(&x->obuf, &x->olen, &x->ocap, "\n\n", 2, RT_BODY_MAX + 4096);
    }
    x->done = true;
    bool wake = rt_xchg_wake_locked(x);
    pthread_mutex_unlock(&x->lock);
    free(err);
    if (wake) MHD_resume_connection(x->conn);
    count(r, &r->ctr.stream_errors);
    xchg_release(r, x);
}

/* ---- choosing a node --------------------------------------------------------------------- */

static uint32_t load_of(const rt_node_t *n)
{
    return n->active + n->waiting;
}

/* The node of `role` to try among the candidates (bit i: node i), or NULL. matched (or
 * NULL): lookup scores (lookup_score); the highest wins, ties and misses the least loaded.
 * Nodes that are up come first. */
static rt_node_t *choose(pkv_router_t *r, rt_role_t role, uint64_t cands, const int64_t *matched)
{
    uint32_t N = r->n_nodes[role];
    uint64_t up = 0;
    for (uint32_t i = 0; i < N; i++)
        if ((cands >> i & 1) && node_up(r, &r->nodes[role][i])) up |= 1ull << i;
    if (up) cands = up;
    if (!cands) return NULL;
    if (matched) {
        int64_t best = 0;
        for (uint32_t i = 0; i < N; i++)
            if ((cands >> i & 1) && matched[i] > best) best = matched[i];
        if (best > 0) {
            uint64_t top = 0;
            for (uint32_t i = 0; i < N; i++)
                if ((cands >> i & 1) && matched[i] == best) top |= 1ull << i;
            cands = top;
        }
    }
    uint32_t start = r->rr[role]++ % N, pick = UINT32_MAX;
    for (uint32_t k = 0; k < N; k++) {
        uint32_t i = (start + k) % N;
        if (!(cands >> i & 1)) continue;
        if (r->policy == PKV_ROUTER_ROUND_ROBIN && !matched) {
            pick = i;
            break;
        }
        if (pick == UINT32_MAX || load_of(&r->nodes[role][i]) < load_of(&r->nodes[role][pick]))
            pick = i;
    }
    return &r->nodes[role][pick];
}

static uint64_t untried(pkv_router_t *r, rt_xchg_t *x, rt_role_t role)
{
    uint32_t N = r->n_nodes[role];
    uint64_t all = N == 64 ? ~0ull : (1ull << N) - 1;
    return all & ~x->tried[role];
}

/* An attempt of x on node n failed for `cause` (counted; n is not tried again). */
static void attempt_failed(pkv_router_t *r, rt_xchg_t *x, rt_node_t *n, rt_cause_t cause,
                           const char *detail)
{
    x->tried[n->role] |= 1ull << n->index;
    reason_add(x, "%s %s: %s", rt_role_label[n->role], n->url, detail);
    pthread_mutex_lock(&r->lock);
    r->ctr.errors[n->role][cause]++;
    if (cause == RT_CAUSE_CONNECT) n->up = false;
    pthread_mutex_unlock(&r->lock);
    PKV_LOGI("router", "%s: %s %s failed (%s): %s", x->rid, rt_role_label[n->role], n->url,
             rt_cause_label[cause], detail);
}

static void retry_count(pkv_router_t *r, rt_cause_t cause)
{
    count(r, &r->ctr.retries[cause]);
}

static bool main_leg(pkv_router_t *r, rt_xchg_t *x, rt_leg_kind_t kind, rt_node_t *n,
                     const char *body)
{
    const char *path = x->route == RT_ROUTE_CHAT ? "/v1/chat/completions" : "/v1/completions";
    rt_leg_t *l = leg_new(r, kind, x, n, path, body, strlen(body));
    if (!l) return false;
    x->attempts++;
    leg_start(r, l);
    return true;
}

static void pick_prefill(pkv_router_t *r, rt_xchg_t *x)
{
    if (pkv_now_ns() >= x->deadline) {
        fail_deadline(r, x);
        return;
    }
    uint64_t cands = untried(r, x, RT_PREFILL);
    if (!cands) {
        fail_no_node(r, x, "prefill");
        return;
    }
    if (r->policy == PKV_ROUTER_CACHE_AWARE && (cands & (cands - 1))) {
        uint64_t up = 0;
        for (uint32_t i = 0; i < r->n_nodes[RT_PREFILL]; i++)
            if ((cands >> i & 1) && node_up(r, &r->nodes[RT_PREFILL][i])) up |= 1ull << i;
        if (up) cands = up;
        for (uint32_t i = 0; i < r->n_nodes[RT_PREFILL]; i++) {
            x->matched[i] = -1;
            if (!(cands >> i & 1)) continue;
            rt_leg_t *l = leg_new(r, RT_LEG_LOOKUP, x, &r->nodes[RT_PREFILL][i], "/v1/cache/lookup",
                                  x->body, x->len);
            if (!l) continue;
            x->lookups_pending++;
            leg_start(r, l);
        }
        if (x->lookups_pending) return;
    }
    rt_node_t *n = choose(r, RT_PREFILL, cands, NULL);
    if (!main_leg(r, x, RT_LEG_PREFILL, n, x->pbody))
        finish_error(r, x, 500, "server_error", "out_of_memory", NULL, "out of memory");
}

static void lookup_decide(pkv_router_t *r, rt_xchg_t *x)
{
    uint64_t cands = untried(r, x, RT_PREFILL), answered = 0;
    if (!cands) {
        fail_no_node(r, x, "prefill");
        return;
    }
    for (uint32_t i = 0; i < r->n_nodes[RT_PREFILL]; i++)
        if ((cands >> i & 1) && x->matched[i] >= 0) answered |= 1ull << i;
    if (answered) cands = answered; /* the nodes that just answered come first */
    rt_node_t *n = choose(r, RT_PREFILL, cands, x->matched);
    if (pkv_log_get_level() >= PKV_LOG_INFO) {
        char m[256] = "";
        for (uint32_t i = 0, k = 0; i < r->n_nodes[RT_PREFILL] && k + 16 < sizeof(m); i++)
            k += (size_t)snprintf(m + k, sizeof(m) - k, "%s%lld", i ? "," : "",
                                  x->matched[i] < 0 ? -1 : (long long)(x->matched[i] >> 20));
        PKV_LOGI("router", "%s: lookups matched [%s]: prefill leg to %s", x->rid, m, n->url);
    }
    if (!main_leg(r, x, RT_LEG_PREFILL, n, x->pbody))
        finish_error(r, x, 500, "server_error", "out_of_memory", NULL, "out of memory");
}

static void pick_decode(pkv_router_t *r, rt_xchg_t *x)
{
    if (pkv_now_ns() >= x->deadline) {
        fail_deadline(r, x);
        return;
    }
    uint64_t cands = untried(r, x, RT_DECODE);
    if (!cands) {
        fail_no_node(r, x, "decode");
        return;
    }
    rt_node_t *n = choose(r, RT_DECODE, cands, NULL);
    if (!main_leg(r, x, RT_LEG_DECODE, n, x->dbody))
        finish_error(r, x, 500, "server_error", "out_of_memory", NULL, "out of memory");
}

/* ---- beginning an exchange -------------------------------------------------------------- */

/* The prefill leg's body: the client's with max_tokens 1, stream false, no stream_options,
 * and kv_transfer_params asking for a remote decode (the field's convention). */
static char *prefill_body(const json_t *doc)
{
    json_t *p = json_copy((json_t *)doc);
    if (!p) return NULL;
    json_object_set_new(p, "max_tokens", json_integer(1));
    json_t *mct = json_object_get(p, "max_completion_tokens");
    if (mct && !json_is_null(mct)) json_object_set_new(p, "max_completion_tokens", json_integer(1));
    json_object_set_new(p, "stream", json_false());
    json_object_del(p, "stream_options");
    json_object_set_new(p, "kv_transfer_params",
                        json_pack("{s:b, s:b, s:n, s:n, s:n, s:n}", "do_remote_decode", 1,
                                  "do_remote_prefill", 0, "remote_engine_id", "remote_block_ids",
                                  "remote_host", "remote_port"));
    char *text = json_dumps(p, JSON_COMPACT);
    json_decref(p);
    return text;
}

static void gen_begin(pkv_router_t *r, rt_xchg_t *x)
{
    char model[128];
    pthread_mutex_lock(&r->lock);
    memcpy(model, r->model, sizeof(model));
    uint32_t max_ctx = r->max_context;
    pthread_mutex_unlock(&r->lock);
    pkv_openai_shape_t shape;
    int status = 0;
    char *ej = NULL;
    int rc = pkv_openai_request_check(x->route == RT_ROUTE_CHAT, x->body, x->len, model, max_ctx,
                                      &shape, &status, &ej);
    if (rc == PKV_ERR_INVALID) {
        count(r, &r->ctr.rejected[RT_REJ_INVALID]);
        {
            finish(r, x, status, ej, strlen(ej), NULL);
            return;
        }
    }
    if (rc) {
        finish_error(r, x, 500, "server_error", "out_of_memory", NULL, "out of memory");
        return;
    }
    if (shape.has_kv_transfer_params) {
        count(r, &r->ctr.rejected[RT_REJ_INVALID]);
        {
            finish_error(r, x, 400, "invalid_request_error", "unsupported_parameter",
                         "kv_transfer_params",
                         "'kv_transfer_params' is set by the router for its nodes; send the "
                         "request without it");
            return;
        }
    }
    x->stream = shape.stream;
    x->doc = json_loadb(x->body, x->len, JSON_ALLOW_NUL, NULL);
    x->pbody = x->doc ? prefill_body(x->doc) : NULL;
    if (!x->pbody) {
        finish_error(r, x, 500, "server_error", "out_of_memory", NULL, "out of memory");
        return;
    }
    pick_prefill(r, x);
}

static void models_wanted(pkv_router_t *r)
{
    uint64_t now = pkv_now_ns();
    for (int role = 0; role < RT_ROLES; role++)
        for (uint32_t i = 0; i < r->n_nodes[role]; i++)
            if (!r->nodes[role][i].probing) r->nodes[role][i].next_probe_ns = now;
}

static void xchg_link(pkv_router_t *r, rt_xchg_t *x)
{
    x->io_started = x->io_live = true;
    x->live_prev = NULL;
    x->live_next = r->live;
    if (r->live) r->live->live_prev = x;
    r->live = x;
    x->deadline = x->t_arrival + (uint64_t)r->request_timeout_ms * NS_PER_MS;
}

static void xchg_begin(pkv_router_t *r, rt_xchg_t *x)
{
    xchg_link(r, x);
    if (x->route == RT_ROUTE_MODELS || x->route == RT_ROUTE_MODEL) {
        pass_start(r, x);
        return;
    }
    pthread_mutex_lock(&r->lock);
    bool known = r->model[0] != 0;
    pthread_mutex_unlock(&r->lock);
    if (known) {
        gen_begin(r, x);
        return;
    }
    x->waiting_model = true; /* parsed once a node told the model (or the deadline) */
    models_wanted(r);
}

/* ---- answers from nodes -------------------------------------------------------------------- */

static rt_cause_t cause_of(CURLcode cc, const rt_leg_t *l, char *detail, size_t n)
{
    if (cc == CURLE_OK) {
        snprintf(detail, n, "HTTP %ld", l->status);
        return RT_CAUSE_HTTP_5XX;
    }
    snprintf(detail, n, "%s", l->err[0] ? l->err : curl_easy_strerror(cc));
    switch (cc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
        return RT_CAUSE_CONNECT;
    case CURLE_OPERATION_TIMEDOUT:
        return RT_CAUSE_TIMEOUT;
    case CURLE_GOT_NOTHING:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
        return l->status ? RT_CAUSE_BROKEN : RT_CAUSE_CONNECT;
    default:
        return RT_CAUSE_BROKEN;
    }
}

/* The "error.code" of a node's JSON error answer ("" when none). */
static void error_code(const rt_leg_t *l, char *out, size_t n)
{
    out[0] = 0;
    json_t *doc = l->buf ? json_loadb(l->buf, l->len, 0, NULL) : NULL;
    const char *c = json_string_value(json_object_get(json_object_get(doc, "error"), "code"));
    if (c) snprintf(out, n, "%s", c);
    json_decref(doc);
}

/* A node's /v1/cache/lookup answer as one score: the tokens it holds in either tier first,
 * then, among equal totals, those in memory (a memory hit beats a disk hit of equal length).
 * -1: no usable answer. */
static int64_t lookup_score(json_t *doc)
{
    json_t *m = json_object_get(doc, "matched_tokens"),
           *d = json_object_get(doc, "disk_matched_tokens");
    if (!json_is_integer(m) || json_integer_value(m) < 0 || json_integer_value(m) > INT32_MAX)
        return -1;
    int64_t mem = json_integer_value(m), disk = 0;
    if (json_is_integer(d) && json_integer_value(d) >= 0 && json_integer_value(d) <= INT32_MAX)
        disk = json_integer_value(d);
    return (mem + disk) << 20 | PKV_MIN(mem, (int64_t)0xfffff);
}

static void lookup_done(pkv_router_t *r, rt_leg_t *l, CURLcode cc)
{
    rt_xchg_t *x = l->x;
    rt_node_t *n = l->node;
    hist(r, &r->ctr.lookup, l->t_start);
    pthread_mutex_lock(&r->lock);
    r->ctr.lookups++;
    if (cc != CURLE_OK || l->status != 200) r->ctr.lookup_failures++;
    pthread_mutex_unlock(&r->lock);
    if (cc == CURLE_OK && l->status == 200) {
        json_t *doc = json_loadb(l->buf ? l->buf : "", l->len, 0, NULL);
        x->matched[n->index] = lookup_score(doc);
        json_decref(doc);
    } else if (cc != CURLE_OK) {
        char detail[CURL_ERROR_SIZE + 16];
        rt_cause_t cause = cause_of(cc, l, detail, sizeof(detail));
        attempt_failed(r, x, n, cause, detail);
    }
    leg_end(r, l);
    if (--x->lookups_pending == 0) lookup_decide(r, x);
}

static void prefill_done(pkv_router_t *r, rt_leg_t *l, CURLcode cc)
{
    rt_xchg_t *x = l->x;
    rt_node_t *n = l->node;
    char detail[CURL_ERROR_SIZE + 16];
    if (cc == CURLE_OK && l->status == 200) {
        json_t *doc = json_loadb(l->buf ? l->buf : "", l->len, 0, NULL);
        json_t *kvt = json_object_get(doc, "kv_transfer_params");
        json_t *d = json_is_object(kvt) ? json_copy(x->doc) : NULL;
        if (d) json_object_set(d, "kv_transfer_params", kvt);
        free(x->dbody);
        x->dbody = d ? json_dumps(d, JSON_COMPACT) : NULL;
        json_decref(d);
        json_decref(doc);
        if (x->dbody) {
            hist(r, &r->ctr.leg[RT_PREFILL], l->t_start);
            node_mark(r, n, true);
            x->pnode = n;
            leg_end(r, l);
            {
                pick_decode(r, x);
                return;
            }
        }
        snprintf(detail, sizeof(detail), "no kv_transfer_params in its answer");
        attempt_failed(r, x, n, RT_CAUSE_BROKEN, detail);
        leg_end(r, l);
        retry_count(r, RT_CAUSE_BROKEN);
        {
            pick_prefill(r, x);
            return;
        }
    }
    if (cc == CURLE_OK && l->status < 500 && l->status != 429) { /* the client's fault */
        finish_relay(r, x, l);
        return;
    }
    rt_cause_t cause = cause_of(cc, l, detail, sizeof(detail));
    attempt_failed(r, x, n, cause, detail);
    leg_end(r, l);
    retry_count(r, cause);
    pick_prefill(r, x);
}

/* A decode leg that failed before any byte reached the client: the same params on
 * another decode node when the node was never reached, or both legs again. */
static void decode_retry(pkv_router_t *r, rt_xchg_t *x, rt_leg_t *l, CURLcode cc)
{
    rt_node_t *n = l->node;
    char detail[CURL_ERROR_SIZE + 64], code[48];
    rt_cause_t cause = cause_of(cc, l, detail, sizeof(detail));
    error_code(l, code, sizeof(code));
    bool producer = cc == CURLE_OK && (!strcmp(code, "peer_lost") || !strcmp(code, "timeout") ||
                                       !strcmp(code, "corrupt"));
    bool same_params = cc == CURLE_OK ? !producer : cause == RT_CAUSE_CONNECT;
    if (producer) {
        cause = !strcmp(code, "peer_lost") ? RT_CAUSE_PEER_LOST : RT_CAUSE_HTTP_5XX;
        size_t k = strlen(detail);
        snprintf(detail + k, sizeof(detail) - k, " %s from prefill %s", code,
                 x->pnode ? x->pnode->url : "?");
        pthread_mutex_lock(&r->lock);
        r->ctr.errors[RT_DECODE][cause]++;
        pthread_mutex_unlock(&r->lock);
        x->tried[RT_PREFILL] |= 1ull << x->pnode->index; /* the producer failed, not n */
        reason_add(x, "decode %s: %s", n->url, detail);
        PKV_LOGI("router", "%s: decode %s: %s", x->rid, n->url, detail);
    } else {
        if (code[0]) {
            size_t k = strlen(detail);
            snprintf(detail + k, sizeof(detail) - k, " %s", code);
        }
        attempt_failed(r, x, n, cause, detail);
    }
    leg_end(r, l);
    retry_count(r, cause);
    if (same_params) {
        pick_decode(r, x);
        return;
    }
    free(x->dbody);
    x->dbody = NULL;
    pick_prefill(r, x);
}

static void decode_done(pkv_router_t *r, rt_leg_t *l, CURLcode cc)
{
    rt_xchg_t *x = l->x;
    pthread_mutex_lock(&x->lock);
    bool gone = x->gone;
    pthread_mutex_unlock(&x->lock);
    if (gone) {
        xchg_release(r, x);
        return;
    } /* the client left: nothing to tell it */
    if (l->committed) {
        if (cc != CURLE_OK) {
            char detail[CURL_ERROR_SIZE + 16];
            rt_cause_t cause = cause_of(cc, l, detail, sizeof(detail));
            count(r, &r->ctr.errors[RT_DECODE][cause]);
            {
                stream_broken(r, x, l, detail);
                return;
            }
        }
        hist(r, &r->ctr.leg[RT_DECODE], l->t_start);
        pthread_mutex_lock(&x->lock); /* a last event without its blank line: as it came */
        if (l->len) buf_put(&x->obuf, &x->olen, &x->ocap, l->buf, l->len, RT_BODY_MAX + 4096);
        pthread_mutex_unlock(&x->lock);
        {
            finish(r, x, 200, NULL, 0, NULL);
            return;
        }
    }
    if (cc == CURLE_OK && l->status < 500 && l->status != 429) {
        if (l->status == 200) {
            hist(r, &r->ctr.leg[RT_DECODE], l->t_start);
            node_mark(r, l->node, true);
            if (x->stream) { /* a 200 stream that never ended an event: as it came */
                pthread_mutex_lock(&x->lock);
                x->streamed = true;
                pthread_mutex_unlock(&x->lock);
            }
        }
        {
            finish_relay(r, x, l);
            return;
        }
    }
    decode_retry(r, x, l, cc);
}

static void pass_start(pkv_router_t *r, rt_xchg_t *x)
{
    if (pkv_now_ns() >= x->deadline) {
        fail_deadline(r, x);
        return;
    }
    for (int pass = 0; pass < 2; pass++)
        for (int role = RT_DECODE; role >= RT_PREFILL; role--)
            for (uint32_t i = 0; i < r->n_nodes[role]; i++) {
                rt_node_t *n = &r->nodes[role][i];
                if ((x->tried[role] >> i & 1) || (pass == 0 && !node_up(r, n))) continue;
                rt_leg_t *l = leg_new(r, RT_LEG_PASS, x, n, x->path, NULL, 0);
                if (!l) {
                    finish_error(r, x, 500, "server_error", "out_of_memory", NULL, "out of memory");
                    return;
                }
                x->attempts++;
                {
                    leg_start(r, l);
                    return;
                }
            }
    fail_no_node(r, x, "");
}

static void pass_done(pkv_router_t *r, rt_leg_t *l, CURLcode cc)
{
    rt_xchg_t *x = l->x;
    if (cc == CURLE_OK && l->status < 500) {
        finish_relay(r, x, l);
        return;
    }
    char detail[CURL_ERROR_SIZE + 16];
    rt_cause_t cause = cause_of(cc, l, detail, sizeof(detail));
    attempt_failed(r, x, l->node, cause, detail);
    leg_end(r, l);
    retry_count(r, cause);
    pass_start(r, x);
}

/* ---- probes ------------------------------------------------------------------------------- */

static void models_done(pkv_router_t *r, rt_leg_t *l, CURLcode cc)
{
    json_t *doc = cc == CURLE_OK && l->status == 200
                      ? json_loadb(l->buf ? l->buf : "", l->len, 0, NULL)
                      : NULL;
    json_t *m = json_array_get(json_object_get(doc, "data"), 0);
    const char *id = json_string_value(json_object_get(m, "id"));
    json_t *ctx = json_object_get(m, "max_model_len");
    bool got =
        id && strlen(id) < sizeof(r->model) && json_is_integer(ctx) && json_integer_value(ctx) > 0;
    if (got) {
        pthread_mutex_lock(&r->lock);
        if (!r->model[0]) {
            snprintf(r->model, sizeof(r->model), "%s", id);
            r->max_context = (uint32_t)json_integer_value(ctx);
        }
        pthread_mutex_unlock(&r->lock);
    }
    json_decref(doc);
    leg_end(r, l);
    if (!got) return;
    for (rt_xchg_t *x = r->live, *next; x; x = next) {
        next = x->live_next;
        if (!x->waiting_model) continue;
        x->waiting_model = false;
        gen_begin(r, x);
    }
}

static void probe_done(pkv_router_t *r, rt_leg_t *l, CURLcode cc)
{
    rt_node_t *n = l->node;
    bool up = cc == CURLE_OK && l->status == 200;
    node_mark(r, n, up);
    n->probing = false;
    leg_end(r, l);
    pthread_mutex_lock(&r->lock);
    bool need_model = !r->model[0];
    pthread_mutex_unlock(&r->lock);
    if (up && need_model) {
        rt_leg_t *m = leg_new(r, RT_LEG_MODELS, NULL, n, "/v1/models", NULL, 0);
        if (m) leg_start(r, m);
    }
}

static void probes(pkv_router_t *r, uint64_t now)
{
    for (int role = 0; role < RT_ROLES; role++)
        for (uint32_t i = 0; i < r->n_nodes[role]; i++) {
            rt_node_t *n = &r->nodes[role][i];
            if (n->probing || now < n->next_probe_ns) continue;
            n->next_probe_ns = now + (uint64_t)r->health_interval_ms * NS_PER_MS;
            rt_leg_t *l = leg_new(r, RT_LEG_PROBE, NULL, n, "/health", NULL, 0);
            if (!l) continue;
            n->probing = true;
            leg_start(r, l);
        }
}

/* ---- the loop ----------------------------------------------------------------------------- */

static void leg_done(pkv_router_t *r, rt_leg_t *l, CURLcode cc)
{
    curl_easy_getinfo(l->easy, CURLINFO_RESPONSE_CODE, &l->status);
    switch (l->kind) {
    case RT_LEG_PROBE:
        probe_done(r, l, cc);
        break;
    case RT_LEG_MODELS:
        models_done(r, l, cc);
        break;
    case RT_LEG_LOOKUP:
        lookup_done(r, l, cc);
        break;
    case RT_LEG_PREFILL:
        prefill_done(r, l, cc);
        break;
    case RT_LEG_DECODE:
        decode_done(r, l, cc);
        break;
    case RT_LEG_PASS:
        pass_done(r, l, cc);
        break;
    }
}

/* News from the client side: gone (drop its legs), or its stream drained (unpause). */
static void xchg_news(pkv_router_t *r, rt_xchg_t *x)
{
    if (!x->io_started) xchg_begin(r, x);
    if (!x->io_live) return;
    pthread_mutex_lock(&x->lock);
    bool gone = x->gone, unpause = x->want_unpause;
    x->want_unpause = false;
    if (unpause) x->io_paused = false;
    pthread_mutex_unlock(&x->lock);
    if (gone) {
        xchg_release(r, x);
        return;
    }
    if (unpause)
        for (rt_leg_t *l = x->legs; l; l = l->xnext)
            if (l->paused) {
                l->paused = false;
                l->t_last = pkv_now_ns();
                curl_easy_pause(l->easy, CURLPAUSE_CONT);
                break;
            }
}

/* Node silence, and deadlines of exchanges not yet answered. */
static void sweep(pkv_router_t *r, uint64_t now)
{
    uint64_t silence = (uint64_t)r->node_timeout_ms * NS_PER_MS;
    for (rt_leg_t *l = r->active, *next; l; l = next) {
        next = l->anext;
        /* A non-streamed decode answer comes in one piece at its end: its bound is the
         * request's deadline, not the node's silence. */
        bool whole = l->kind == RT_LEG_DECODE && !l->x->stream;
        if (!leg_counts(l) || whole || l->paused || now - l->t_last < silence) continue;
        snprintf(l->err, sizeof(l->err), "no byte for %u ms", r->node_timeout_ms);
        leg_done(r, l, CURLE_OPERATION_TIMEDOUT);
        next = r->active; /* the list may have changed: restart (rare) */
        now = pkv_now_ns();
    }
    for (rt_xchg_t *x = r->live, *next; x; x = next) {
        next = x->live_next;
        if (now < x->deadline) continue;
        bool committed = false;
        for (rt_leg_t *l = x->legs; l; l = l->xnext) committed |= l->committed;
        if (committed) continue;
        if (x->waiting_model) reason_add(x, "no node answered /v1/models");
        fail_deadline(r, x);
        next = r->live;
    }
}

/* Shutdown: every exchange still here ends (503, or an error event for a stream). */
static void end_all(pkv_router_t *r)
{
    pthread_mutex_lock(&r->inbox_lock);
    r->io_closed = true;
    pthread_mutex_unlock(&r->inbox_lock);
    for (rt_xchg_t *x; (x = inbox_pop(r));) {
        if (!x->io_started) xchg_link(r, x); /* answered 503 below */
        rt_xchg_unref(x);
    }
    while (r->live) {
        rt_xchg_t *x = r->live;
        rt_leg_t *c = NULL;
        for (rt_leg_t *l = x->legs; l; l = l->xnext)
            if (l->committed) c = l;
        if (c)
            stream_broken(r, x, c, "the router is shutting down");
        else
            finish_error(r, x, 503, "service_unavailable", "shutting_down", NULL,
                         "the router is shutting down");
    }
    while (r->active) leg_end(r, r->active);
    for (int role = 0; role < RT_ROLES; role++)
        for (uint32_t i = 0; i < r->n_nodes[role]; i++)
            while (r->nodes[role][i].wait_head) leg_end(r, r->nodes[role][i].wait_head);
}

static void *io_main(void *arg)
{
    pkv_router_t *r = arg;
    pthread_setname_np(pthread_self(), "pkv-route-io");
    while (!atomic_load(&r->stopping)) {
        for (rt_xchg_t *x; (x = inbox_pop(r));) {
            xchg_news(r, x);
            rt_xchg_unref(x);
        }
        uint64_t now = pkv_now_ns();
        probes(r, now);
        sweep(r, now);
        int running = 0;
        curl_multi_perform(r->multi, &running);
        CURLMsg *m;
        int q;
        while ((m = curl_multi_info_read(r->multi, &q))) {
            if (m->msg != CURLMSG_DONE) continue;
            rt_leg_t *l = NULL;
            CURLcode cc = m->data.result;
            curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&l);
            if (l) leg_done(r, l, cc);
        }
        curl_multi_poll(r->multi, NULL, 0, RT_POLL_MS, NULL);
    }
    end_all(r);
    return NULL;
}

int rt_io_start(pkv_router_t *r)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (!(r->multi = curl_multi_init())) return PKV_ERR_NOMEM;
    /* Idle keep-alive connections to the nodes each hold a node thread: keep few. */
    curl_multi_setopt(r->multi, CURLMOPT_MAXCONNECTS, 64L);
    if (pthread_create(&r->io_thread, NULL, io_main, r)) {
        curl_multi_cleanup(r->multi);
        r->multi = NULL;
        return PKV_ERR_NOMEM;
    }
    r->io_started = true;
    return PKV_OK;
}

void rt_io_stop(pkv_router_t *r)
{
    if (!r->io_started) return;
    atomic_store(&r->stopping, true);
    pthread_mutex_lock(&r->inbox_lock);
    curl_multi_wakeup(r->multi);
    pthread_mutex_unlock(&r->inbox_lock);
    pthread_join(r->io_thread, NULL);
    r->io_started = false;
    curl_multi_cleanup(r->multi);
    r->multi = NULL;
}
