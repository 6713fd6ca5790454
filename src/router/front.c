/*
 * router front: the client side of `pagekv route` (include/pagekv/router.h; design in
 * docs/design/router.md) and the router's lifecycle.
 *
 * Threads. libmicrohttpd runs one event-loop thread for every client connection
 * (MHD_USE_INTERNAL_POLLING_THREAD with epoll, MHD_ALLOW_SUSPEND_RESUME): nothing here
 * blocks. A request for the nodes is handed to the io thread (relay.c) and its
 * connection suspended; the io thread fills the answer in (x->lock) and resumes it. A
 * streamed answer's content reader hands over what is there and suspends the
 * connection again when nothing is.
 *
 * Connections. MHD accepts up to max_connections + an overflow margin; every connection
 * past max_connections is answered 503 with Retry-After (and closed), so a client over
 * the limit gets an answer instead of a dropped connection until the margin is full too.
 *
 * Locking. r->lock guards r->ctr, r->draining, the nodes' up / requests / in_flight and
 * the model; x->lock an exchange's answer fields. Lock order: x->lock, then
 * r->inbox_lock; r->lock is never held with another lock. MHD is called under x->lock
 * only to suspend the connection (MHD_resume_connection is called after unlocking).
 */
#include "pagekv/router.h"

#include "core/core.h"
#include "router/router_int.h"
#include "openai/openai.h"

#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>

#define RT_SSE_BLOCK   16384
#define RT_SNDBUF      (64 * 1024)    /* a client socket's send buffer */
#define RT_OVERFLOW(n) ((n) / 8 + 16) /* connections past the limit answered 503 */
#define CONN_OK        ((void *)1)
#define CONN_OVER      ((void *)2)

const char *pkv_router_policy_name(pkv_router_policy_t p)
{
    switch (p) {
    case PKV_ROUTER_CACHE_AWARE:
        return "cache_aware";
    case PKV_ROUTER_LEAST_LOADED:
        return "least_loaded";
    case PKV_ROUTER_ROUND_ROBIN:
        return "round_robin";
    }
    return NULL;
}

int pkv_router_policy_parse(const char *name, pkv_router_policy_t *out)
{
    for (int p = 0; p <= PKV_ROUTER_ROUND_ROBIN; p++)
        if (name && !strcmp(name, pkv_router_policy_name((pkv_router_policy_t)p))) {
            *out = (pkv_router_policy_t)p;
            return PKV_OK;
        }
    return PKV_ERR_INVALID;
}

/* ---- exchanges ------------------------------------------------------------------------ */

void rt_xchg_unref(rt_xchg_t *x)
{
    if (!x || atomic_fetch_sub(&x->refs, 1) != 1) return;
    json_decref(x->doc);
    free(x->pbody);
    free(x->dbody);
    free(x->body);
    free(x->obuf);
    pthread_mutex_destroy(&x->lock);
    free(x);
}

bool rt_xchg_wake_locked(rt_xchg_t *x)
{
    if (!x->suspended || x->gone) return false;
    x->suspended = false;
    return true;
}

/* The client's X-Request-Id when it is 1..128 printable bytes, else a new one. */
static void request_id(pkv_router_t *r, struct MHD_Connection *c, char out[129])
{
    const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Request-Id");
    size_t n = v ? strlen(v) : 0;
    bool ok = n >= 1 && n <= 128;
    for (size_t i = 0; ok && i < n; i++) ok = v[i] > 0x20 && v[i] < 0x7f;
    if (ok) {
        memcpy(out, v, n + 1);
        return;
    }
    uint64_t k = atomic_fetch_add(&r->next_rid, 1);
    snprintf(out, 129, "pagekv-route-%016llx", (unsigned long long)(k ^ r->rid_salt));
}

/* ---- answers ------------------------------------------------------------------------- */

static enum MHD_Result queue(pkv_router_t *r, rt_xchg_t *x, int status, struct MHD_Response *resp)
{
    if (!resp) return MHD_NO;
    if (x->rid[0]) MHD_add_response_header(resp, "X-Request-Id", x->rid);
    enum MHD_Result ok = MHD_queue_response(x->conn, (unsigned)status, resp);
    MHD_destroy_response(resp);
    pthread_mutex_lock(&r->lock);
    r->ctr.http[x->route][rt_code_index(status)]++;
    pthread_mutex_unlock(&r->lock);
    x->answered = true;
    return ok;
}

/* text is malloc'd and taken. */
static enum MHD_Result answer_text(pkv_router_t *r, rt_xchg_t *x, int status, char *text,
                                   size_t len, const char *type, const char *retry_after)
{
    if (!text) return MHD_NO;
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (retry_after && *retry_after)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, retry_after);
    return queue(r, x, status, resp);
}

static enum MHD_Result answer_error(pkv_router_t *r, rt_xchg_t *x, int status, const char *type,
                                    const char *code, const char *param, const char *msg)
{
    char *text = pkv_openai_error_json(type, code, param, msg);
    PKV_LOGI("router", "%s: %d %s: %s", rt_route_label[x->route], status, code, msg);
    return answer_text(r, x, status, text, text ? strlen(text) : 0, "application/json",
                       status == 503 ? "5" : NULL);
}

static enum MHD_Result answer_busy(pkv_router_t *r, rt_xchg_t *x, rt_rejection_t why,
                                   const char *code, const char *msg, const char *retry_after)
{
    pthread_mutex_lock(&r->lock);
    r->ctr.rejected[why]++;
    pthread_mutex_unlock(&r->lock);
    char *text = pkv_openai_error_json("service_unavailable", code, NULL, msg);
    struct MHD_Response *resp =
        text ? MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE) : NULL;
    if (!resp) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, retry_after);
    if (why == RT_REJ_CONNECTIONS)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    return queue(r, x, 503, resp);
}

/* The streamed answer's reader: what the io thread relayed so far; with nothing there
 * the connection is suspended until the io thread has more (or the end). */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    rt_xchg_t *x = cls;
    (void)pos;
    pthread_mutex_lock(&x->lock);
    if (x->opos < x->olen) {
        size_t n = PKV_MIN(max, x->olen - x->opos);
        memcpy(buf, x->obuf + x->opos, n);
        x->opos += n;
        if (x->opos == x->olen) x->opos = x->olen = 0;
        bool kick = x->io_paused && !x->want_unpause && x->olen - x->opos < RT_SSE_BLOCK;
        if (kick) x->want_unpause = true;
        pthread_mutex_unlock(&x->lock);
        if (kick) rt_io_push(x->r, x);
        return (ssize_t)n;
    }
    if (x->done) {
        pthread_mutex_unlock(&x->lock);
        return MHD_CONTENT_READER_END_OF_STREAM;
    }
    x->suspended = true;
    MHD_suspend_connection(x->conn);
    pthread_mutex_unlock(&x->lock);
    return 0;
}

/* Called again after the io thread resumed the connection: queue the answer it left. */
static enum MHD_Result answer_resumed(pkv_router_t *r, rt_xchg_t *x)
{
    pthread_mutex_lock(&x->lock);
    if (!x->ready) { /* not yet: wait for the io thread */
        x->suspended = true;
        MHD_suspend_connection(x->conn);
        pthread_mutex_unlock(&x->lock);
        return MHD_YES;
    }
    int status = x->status;
    char ra[8];
    memcpy(ra, x->retry_after, sizeof(ra));
    if (!x->streamed) {
        char *text = x->obuf;
        size_t len = x->olen;
        x->obuf = NULL;
        x->olen = x->opos = x->ocap = 0;
        pthread_mutex_unlock(&x->lock);
        if (!text) text = strdup("");
        return answer_text(r, x, status, text, len, "application/json", ra);
    }
    pthread_mutex_unlock(&x->lock);
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, RT_SSE_BLOCK, stream_read, x, NULL);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    return queue(r, x, status, resp);
}

/* Hand the request to the io thread and suspend its connection. */
static enum MHD_Result submit(pkv_router_t *r, rt_xchg_t *x)
{
    pthread_mutex_lock(&r->lock);
    bool draining = r->draining;
    if (!draining) r->ctr.in_flight++;
    pthread_mutex_unlock(&r->lock);
    if (draining)
        return answer_busy(r, x, RT_REJ_SHUTTING_DOWN, "shutting_down",
                           "the router is shutting down", "5");
    atomic_fetch_add(&x->refs, 1); /* the io thread's */
    x->submitted = true;
    pthread_mutex_lock(&x->lock);
    if (!rt_io_push(r, x)) {
        pthread_mutex_unlock(&x->lock);
        x->submitted = false;
        atomic_fetch_sub(&x->refs, 1);
        pthread_mutex_lock(&r->lock);
        if (--r->ctr.in_flight == 0) pthread_cond_broadcast(&r->idle_cv);
        pthread_mutex_unlock(&r->lock);
        return answer_busy(r, x, RT_REJ_SHUTTING_DOWN, "shutting_down",
                           "the router is shutting down", "5");
    }
    x->suspended = true;
    MHD_suspend_connection(x->conn);
    pthread_mutex_unlock(&x->lock);
    return MHD_YES;
}

/* ---- routing -------------------------------------------------------------------------- */

static const struct {
    const char *path;
    rt_route_t route;
    const char *allow;
} routes[] = {
    {"/v1/completions", RT_ROUTE_COMPLETIONS, "POST"},
    {"/v1/chat/completions", RT_ROUTE_CHAT, "POST"},
    {"/v1/models", RT_ROUTE_MODELS, "GET, HEAD"},
    {"/health", RT_ROUTE_HEALTH, "GET, HEAD"},
    {"/metrics", RT_ROUTE_METRICS, "GET, HEAD"},
};

static bool method_allowed(const char *allow, const char *method)
{
    if (!strcmp(method, "POST")) return !strcmp(allow, "POST");
    if (!strcmp(method, "GET") || !strcmp(method, "HEAD")) return strcmp(allow, "POST") != 0;
    return false;
}

/* The first call: route, method (405), path (404), Content-Length (413), as serve. */
static enum MHD_Result on_first_call(pkv_router_t *r, rt_xchg_t *x, const char *url,
                                     const char *method)
{
    x->route = RT_ROUTE_OTHER;
    const char *allow = NULL;
    for (size_t i = 0; i < PKV_ARRAY_LEN(routes); i++)
        if (!strcmp(url, routes[i].path)) x->route = routes[i].route, allow = routes[i].allow;
    if (!allow && !strncmp(url, "/v1/models/", 11) && url[11])
        x->route = RT_ROUTE_MODEL, allow = "GET, HEAD";
    char msg[320];
    if (!allow) {
        snprintf(msg, sizeof(msg), "no such endpoint: %.100s", url);
        return answer_error(r, x, 404, "not_found_error", "not_found", NULL, msg);
    }
    if (!method_allowed(allow, method)) {
        snprintf(msg, sizeof(msg), "method %.16s is not allowed on %s (allowed: %s)", method, url,
                 allow);
        char *text =
            pkv_openai_error_json("invalid_request_error", "method_not_allowed", NULL, msg);
        struct MHD_Response *resp =
            text ? MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE)
                 : NULL;
        if (!resp) {
            free(text);
            return MHD_NO;
        }
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
        return queue(r, x, 405, resp);
    }
    if (x->route == RT_ROUTE_MODEL || x->route == RT_ROUTE_MODELS)
        snprintf(x->path, sizeof(x->path), "%.150s", url);
    const char *cl =
        MHD_lookup_connection_value(x->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        char *end;
        errno = 0;
        unsigned long long n = strtoull(cl, &end, 10);
        if (!errno && end != cl && n > r->max_body) {
            snprintf(msg, sizeof(msg),
                     "the request body (%llu bytes) is over the limit (%llu bytes)", n,
                     (unsigned long long)r->max_body);
            return answer_error(r, x, 413, "invalid_request_error", "body_too_large", NULL, msg);
        }
    }
    return MHD_YES;
}

static enum MHD_Result body_append(pkv_router_t *r, rt_xchg_t *x, const char *p, size_t n)
{
    if (x->too_large || x->len + n > r->max_body) {
        x->too_large = true;
        return MHD_YES;
    }
    if (x->len + n + 1 > x->cap) {
        size_t cap = PKV_MAX(x->len + n + 1, x->cap * 2);
        cap = PKV_MIN(cap, r->max_body + 1);
        char *nb = realloc(x->body, cap);
        if (!nb) return MHD_NO;
        x->body = nb;
        x->cap = cap;
    }
    memcpy(x->body + x->len, p, n);
    x->len += n;
    x->body[x->len] = 0;
    return MHD_YES;
}

/* The last call (the body is in): answer here or hand to the io thread. */
static enum MHD_Result on_last_call(pkv_router_t *r, rt_xchg_t *x)
{
    if (x->too_large) {
        char msg[160];
        snprintf(msg, sizeof(msg), "the request body is over the limit (%llu bytes)",
                 (unsigned long long)r->max_body);
        return answer_error(r, x, 413, "invalid_request_error", "body_too_large", NULL, msg);
    }
    if (x->route == RT_ROUTE_HEALTH) {
        int status = 503;
        char *text = rt_health_render(r, &status);
        return answer_text(r, x, status, text, text ? strlen(text) : 0, "application/json", NULL);
    }
    if (x->route == RT_ROUTE_METRICS) {
        size_t len = 0;
        char *text = rt_metrics_render(r, &len);
        return answer_text(r, x, 200, text, len, "text/plain; version=0.0.4; charset=utf-8", NULL);
    }
    return submit(r, x);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls)
{
    pkv_router_t *r = cls;
    rt_xchg_t *x = *con_cls;
    (void)version;
    if (!x) {
        x = calloc(1, sizeof(*x));
        if (!x) return MHD_NO;
        if (pthread_mutex_init(&x->lock, NULL)) {
            free(x);
            return MHD_NO;
        }
        atomic_init(&x->refs, 1);
        x->r = r;
        x->conn = c;
        x->t_arrival = pkv_now_ns();
        *con_cls = x;
        request_id(r, c, x->rid);
        /* X-Pagekv-Timings goes to the nodes as given (they check it: a bad value is their
         * 400); anything longer than any valid value is dropped here. */
        const char *tv = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Pagekv-Timings");
        if (tv && strlen(tv) < sizeof(x->timings))
            snprintf(x->timings, sizeof(x->timings), "%s", tv);
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        if (ci && ci->socket_context == CONN_OVER) {
            x->route = RT_ROUTE_OTHER;
            char msg[160];
            snprintf(msg, sizeof(msg), "the router serves at most %u connections; retry later",
                     r->max_connections);
            return answer_busy(r, x, RT_REJ_CONNECTIONS, "too_many_connections", msg, "1");
        }
        return on_first_call(r, x, url, method);
    }
    if (x->answered) {
        *upload_size = 0;
        return MHD_YES;
    }
    if (x->submitted) return answer_resumed(r, x);
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        return body_append(r, x, upload, n);
    }
    return on_last_call(r, x);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    pkv_router_t *r = cls;
    rt_xchg_t *x = *con_cls;
    (void)c;
    (void)toe;
    if (!x) return;
    *con_cls = NULL;
    pthread_mutex_lock(&x->lock);
    x->gone = true;
    x->suspended = false;
    pthread_mutex_unlock(&x->lock);
    if (x->submitted) {
        rt_io_push(r, x); /* the io thread drops what it still does for it */
        pthread_mutex_lock(&r->lock);
        if (--r->ctr.in_flight == 0) pthread_cond_broadcast(&r->idle_cv);
        pthread_mutex_unlock(&r->lock);
    }
    rt_xchg_unref(x);
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode code)
{
    pkv_router_t *r = cls;
    pthread_mutex_lock(&r->lock);
    bool started = code == MHD_CONNECTION_NOTIFY_STARTED;
    if (started) {
        uint64_t n = ++r->ctr.connections;
        if (n > r->ctr.connections_peak) r->ctr.connections_peak = n;
        *socket_context = n > r->max_connections ? CONN_OVER : CONN_OK;
    } else if (r->ctr.connections) {
        r->ctr.connections--;
    }
    pthread_mutex_unlock(&r->lock);
    const union MHD_ConnectionInfo *ci =
        started ? MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD) : NULL;
    if (ci) {
        /* A slow client holds at most this much in the kernel (Linux doubles it) beside the
         * stream_buffer the router keeps for it; autotuning would let it grow to tcp_wmem. */
        int sndbuf = RT_SNDBUF;
        setsockopt(ci->connect_fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
    }
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    char line[512];
    (void)cls;
    vsnprintf(line, sizeof(line), fmt, ap);
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = 0;
    PKV_LOGI("router", "libmicrohttpd: %s", line);
}

/* ---- lifecycle ------------------------------------------------------------------------ */

static int start_http(pkv_router_t *r)
{
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *ai = NULL;
    char port[8];
    snprintf(port, sizeof(port), "%u", r->port);
    int gai = getaddrinfo(r->host, port, &hints, &ai);
    if (gai) {
        PKV_LOGE("router", "cannot resolve --host '%s': %s", r->host, gai_strerror(gai));
        return PKV_ERR_INVALID;
    }
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME |
                     MHD_USE_ITC | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    unsigned limit = r->max_connections + RT_OVERFLOW(r->max_connections);
    r->mhd = MHD_start_daemon(flags, r->port, NULL, NULL, on_request, r, MHD_OPTION_EXTERNAL_LOGGER,
                              on_mhd_log, r, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                              MHD_OPTION_CONNECTION_LIMIT, limit, MHD_OPTION_LISTEN_BACKLOG_SIZE,
                              (unsigned)4096, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)120,
                              MHD_OPTION_NOTIFY_COMPLETED, on_completed, r,
                              MHD_OPTION_NOTIFY_CONNECTION, on_connection, r, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!r->mhd) {
        PKV_LOGE("router", "cannot listen on %s:%u (address in use or not local?)", r->host,
                 r->port);
        return PKV_ERR_IO;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(r->mhd, MHD_DAEMON_INFO_BIND_PORT);
    if (di) r->port = di->port;
    return PKV_OK;
}

/* "http://HOST:PORT" (a trailing '/' dropped): a malloc'd copy, or NULL (logged). */
static char *node_url(const char *u)
{
    size_t n = u ? strlen(u) : 0;
    while (n && u[n - 1] == '/') n--;
    bool ok = n > 7 && n < 256 && !strncmp(u, "http://", 7);
    for (size_t i = 0; ok && i < n; i++) ok = u[i] > 0x20 && u[i] < 0x7f;
    if (!ok) {
        PKV_LOGE("router", "node URL '%.100s' is not http://HOST:PORT", u ? u : "(null)");
        return NULL;
    }
    char *s = strndup(u, n);
    return s;
}

static int init_nodes(pkv_router_t *r, const pkv_router_config_t *cfg)
{
    const char *const *urls[RT_ROLES] = {cfg->prefill, cfg->decode};
    uint32_t counts[RT_ROLES] = {cfg->n_prefill, cfg->n_decode};
    for (int role = 0; role < RT_ROLES; role++) {
        if (!counts[role] || counts[role] > PKV_ROUTER_MAX_NODES || !urls[role]) {
            PKV_LOGE("router", "%u %s nodes: 1..%u wanted", counts[role], rt_role_label[role],
                     PKV_ROUTER_MAX_NODES);
            return PKV_ERR_INVALID;
        }
        for (uint32_t i = 0; i < counts[role]; i++) {
            rt_node_t *n = &r->nodes[role][i];
            if (!(n->url = node_url(urls[role][i]))) return PKV_ERR_INVALID;
            n->role = (rt_role_t)role;
            n->index = i;
            r->n_nodes[role]++;
        }
    }
    return PKV_OK;
}

static void free_router(pkv_router_t *r)
{
    for (int role = 0; role < RT_ROLES; role++)
        for (uint32_t i = 0; i < r->n_nodes[role]; i++) free(r->nodes[role][i].url);
    pthread_mutex_destroy(&r->inbox_lock);
    pthread_cond_destroy(&r->idle_cv);
    pthread_mutex_destroy(&r->lock);
    free(r->host);
    free(r);
}

int pkv_router_create(const pkv_router_config_t *cfg, pkv_router_t **out)
{
    if (!cfg || !out || cfg->policy > PKV_ROUTER_ROUND_ROBIN) return PKV_ERR_INVALID;
    pkv_router_t *r = calloc(1, sizeof(*r));
    if (!r) return PKV_ERR_NOMEM;
    int rc = PKV_ERR_NOMEM;
    if (pthread_mutex_init(&r->lock, NULL)) goto fail_lock;
    if (pkv_cond_init_monotonic(&r->idle_cv)) goto fail_cv;
    if (pthread_mutex_init(&r->inbox_lock, NULL)) goto fail_inbox;
    r->policy = cfg->policy;
    r->port = cfg->port;
    r->max_connections = cfg->max_connections ? cfg->max_connections : 4096;
    r->max_body = cfg->max_body_bytes ? cfg->max_body_bytes : 4ull << 20;
    r->request_timeout_ms = cfg->request_timeout_ms ? cfg->request_timeout_ms : 60000;
    r->node_timeout_ms = cfg->node_timeout_ms ? cfg->node_timeout_ms : 30000;
    r->lookup_timeout_ms = cfg->lookup_timeout_ms ? cfg->lookup_timeout_ms : 1000;
    r->health_interval_ms = cfg->health_interval_ms ? cfg->health_interval_ms : 1000;
    r->node_max_in_flight = cfg->node_max_in_flight ? cfg->node_max_in_flight : 128;
    r->stream_buffer = cfg->stream_buffer_bytes ? cfg->stream_buffer_bytes : RT_OBUF_CAP;
    atomic_init(&r->stopping, false);
    atomic_init(&r->next_rid, 1);
    if (getrandom(&r->rid_salt, sizeof(r->rid_salt), 0) != sizeof(r->rid_salt))
        r->rid_salt = pkv_now_ns();
    if (!(r->host = strdup(cfg->host ? cfg->host : "127.0.0.1"))) goto fail_nodes;
    if ((rc = init_nodes(r, cfg))) goto fail_nodes;
    if ((rc = rt_layouts_check(r))) goto fail_nodes;
    if ((rc = rt_io_start(r))) goto fail_nodes;
    if ((rc = start_http(r))) goto fail_http;
    *out = r;
    return PKV_OK;

fail_http:
    rt_io_stop(r);
fail_nodes:
    for (int role = 0; role < RT_ROLES; role++)
        for (uint32_t i = 0; i < PKV_ROUTER_MAX_NODES; i++) free(r->nodes[role][i].url);
    r->n_nodes[0] = r->n_nodes[1] = 0;
    free(r->host);
    r->host = NULL;
    pthread_mutex_destroy(&r->inbox_lock);
fail_inbox:
    pthread_cond_destroy(&r->idle_cv);
fail_cv:
    pthread_mutex_destroy(&r->lock);
fail_lock:
    free(r);
    return rc;
}

uint16_t pkv_router_port(const pkv_router_t *r)
{
    return r->port;
}

void pkv_router_quiesce(pkv_router_t *r)
{
    pthread_mutex_lock(&r->lock);
    r->draining = true;
    pthread_mutex_unlock(&r->lock);
}

int pkv_router_wait_idle(pkv_router_t *r, uint64_t deadline_ns)
{
    int rc = PKV_OK;
    pthread_mutex_lock(&r->lock);
    while (r->ctr.in_flight) {
        if (pkv_now_ns() >= deadline_ns) {
            rc = PKV_ERR_TIMEOUT;
            break;
        }
        struct timespec ts = pkv_deadline_to_monotonic(deadline_ns);
        pthread_cond_timedwait(&r->idle_cv, &r->lock, &ts);
    }
    pthread_mutex_unlock(&r->lock);
    return rc;
}

void pkv_router_destroy(pkv_router_t *r)
{
    if (!r) return;
    pkv_router_quiesce(r);
    atomic_store(&r->stopping, true);
    rt_io_stop(r); /* every exchange answered or ended, every suspended connection resumed */
    MHD_stop_daemon(r->mhd);
    free_router(r);
}
