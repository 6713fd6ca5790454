/*
 * The HTTP client (support/http.h): one exchange is one libcurl easy handle, run alone
 * (http_send) or on a multi handle with others (http_batch_run).
 */
#include "support/http.h"

#include "core/core.h"

#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#define BATCH_TICK_NS 50000000ull /* the batch's tick, and its longest wait for activity */

/* One exchange in progress. */
typedef struct {
    CURL *easy;
    struct curl_slist *hdrs;
    const http_request_t *rq;
    http_reply_t *out;
    size_t cap, hcap, hlen;
    bool oom;
    char url[512];
    char errbuf[CURL_ERROR_SIZE];
} http_xfer_t;

/* Append n bytes to a NUL-terminated growing buffer: n, or 0 when out of memory. */
static size_t buf_add(http_xfer_t *x, char **buf, size_t *len, size_t *cap, const char *d, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 4096;
        while (c < *len + n + 1) c *= 2;
        char *nb = realloc(*buf, c);
        if (!nb) {
            x->oom = true;
            return 0;
        }
        *buf = nb;
        *cap = c;
    }
    memcpy(*buf + *len, d, n);
    *len += n;
    (*buf)[*len] = '\0';
    return n;
}

static size_t on_body(char *data, size_t size, size_t nmemb, void *arg)
{
    http_xfer_t *x = arg;
    http_reply_t *r = x->out;
    size_t n = size * nmemb;
    if (!r->first_byte_ns) r->first_byte_ns = pkv_now_ns();
    r->got_data = r->got_data || n > 0;
    if (x->rq->hang_up) return 0; /* the client is gone */
    if (buf_add(x, &r->body, &r->len, &x->cap, data, n) != n) return 0;
    if (x->rq->on_body && n && !x->rq->on_body(x->rq->on_body_arg, r->body, r->len, n)) return 0;
    return n;
}

static size_t on_header(char *data, size_t size, size_t nmemb, void *arg)
{
    http_xfer_t *x = arg;
    http_reply_t *r = x->out;
    size_t n = size * nmemb;
    return buf_add(x, &r->headers, &x->hlen, &x->hcap, data, n);
}

static int on_progress(void *arg, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un)
{
    const volatile sig_atomic_t *stop = arg;
    return *stop ? 1 : 0;
}

static int on_socket(void *arg, curl_socket_t fd, curlsocktype purpose)
{
    const http_request_t *rq = arg;
    int v = rq->recv_buffer_bytes;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &v, sizeof(v));
    return CURL_SOCKOPT_OK;
}

static void xfer_options(http_xfer_t *x, const http_request_t *rq)
{
    CURL *c = x->easy;
    curl_easy_setopt(c, CURLOPT_URL, x->url);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, x);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, x->errbuf);
    curl_easy_setopt(c, CURLOPT_PRIVATE, x);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, x->hdrs);
    if (rq->timeout_ms) curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)rq->timeout_ms);
    if (rq->connect_timeout_ms)
        curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, (long)rq->connect_timeout_ms);
    if (rq->abort_flag) {
        curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
        curl_easy_setopt(c, CURLOPT_XFERINFODATA, (void *)rq->abort_flag);
        curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    }
    if (rq->recv_buffer_bytes > 0) {
        curl_easy_setopt(c, CURLOPT_SOCKOPTFUNCTION, on_socket);
        curl_easy_setopt(c, CURLOPT_SOCKOPTDATA, (void *)rq);
    }
    if (rq->keep_headers) {
        curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
        curl_easy_setopt(c, CURLOPT_HEADERDATA, x);
    }
    bool post = rq->method ? !strcmp(rq->method, "POST") : rq->body != NULL;
    if (rq->method && !strcmp(rq->method, "HEAD"))
        curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
    else if (rq->method && strcmp(rq->method, "GET") && !post)
        curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, rq->method);
    if (post || rq->body) {
        const char *b = rq->body ? rq->body : "";
        size_t len = rq->body_len ? rq->body_len : strlen(b);
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, b);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
    }
}

/* Set up x for rq into out (cleared). 0, or -1 with out->error set. */
static int xfer_open(http_xfer_t *x, const http_request_t *rq, http_reply_t *out)
{
    memset(x, 0, sizeof(*x));
    memset(out, 0, sizeof(*out));
    x->rq = rq;
    x->out = out;
    snprintf(x->url, sizeof(x->url), "%s%s", rq->base_url, rq->path ? rq->path : "");
    bool post = rq->method ? !strcmp(rq->method, "POST") : rq->body != NULL;
    if (post || rq->body) x->hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    for (size_t i = 0; rq->headers && rq->headers[i]; i++)
        x->hdrs = curl_slist_append(x->hdrs, rq->headers[i]);
    if (!(x->easy = curl_easy_init())) {
        curl_slist_free_all(x->hdrs);
        x->hdrs = NULL;
        snprintf(out->error, sizeof(out->error), "curl_easy_init failed");
        out->curl_code = CURLE_FAILED_INIT;
        return -1;
    }
    xfer_options(x, rq);
    out->start_ns = pkv_now_ns();
    return 0;
}

/* The exchange ended with rc: fill the reply, release the handle (off m when given). */
static void xfer_close(http_xfer_t *x, CURLM *m, CURLcode rc)
{
    http_reply_t *r = x->out;
    r->end_ns = pkv_now_ns();
    r->curl_code = (int)rc;
    curl_easy_getinfo(x->easy, CURLINFO_RESPONSE_CODE, &r->status);
    curl_easy_getinfo(x->easy, CURLINFO_TOTAL_TIME, &r->seconds);
    curl_easy_getinfo(x->easy, CURLINFO_STARTTRANSFER_TIME, &r->ttfb_seconds);
    if (x->oom)
        snprintf(r->error, sizeof(r->error), "out of memory");
    else if (rc != CURLE_OK)
        snprintf(r->error, sizeof(r->error), "%s",
                 x->errbuf[0] ? x->errbuf : curl_easy_strerror(rc));
    else if (!r->body && !(r->body = calloc(1, 1)))
        snprintf(r->error, sizeof(r->error), "out of memory");
    if (m) curl_multi_remove_handle(m, x->easy);
    curl_easy_cleanup(x->easy);
    curl_slist_free_all(x->hdrs);
    x->easy = NULL;
    x->hdrs = NULL;
}

int http_send(const http_request_t *rq, http_reply_t *out)
{
    http_xfer_t x;
    if (xfer_open(&x, rq, out) != 0) return -1;
    xfer_close(&x, NULL, curl_easy_perform(x.easy));
    return out->error[0] ? -1 : 0;
}

void http_reply_free(http_reply_t *r)
{
    if (!r) return;
    free(r->body);
    free(r->headers);
    r->body = NULL;
    r->headers = NULL;
    r->len = 0;
}

void http_replies_free(http_reply_t *r, size_t n)
{
    for (size_t i = 0; r && i < n; i++) http_reply_free(&r[i]);
}

static double secs(uint64_t a, uint64_t b)
{
    return b > a ? (double)(b - a) / 1e9 : 0.0;
}

/* A batch in progress. */
typedef struct {
    const http_batch_t *b;
    const http_request_t *reqs;
    http_reply_t *replies;
    size_t n, next, done, inflight;
    http_xfer_t *x;
    CURLM *m;
    uint64_t run0;
} batch_t;

/* Send what is due; false when a request could not be sent. */
static bool batch_send(batch_t *t)
{
    uint64_t now = pkv_now_ns();
    if (t->b->drain && atomic_load(t->b->drain)) return true;
    while (t->next < t->n) {
        bool go = t->b->concurrency ? t->inflight < t->b->concurrency
                                    : t->b->at_s[t->next] <= secs(t->run0, now);
        if (!go) break;
        size_t i = t->next;
        if (xfer_open(&t->x[i], &t->reqs[i], &t->replies[i]) != 0) return false;
        if (curl_multi_add_handle(t->m, t->x[i].easy) != CURLM_OK) {
            xfer_close(&t->x[i], NULL, CURLE_FAILED_INIT);
            return false;
        }
        t->next++;
        t->inflight++;
    }
    return true;
}

/* Wait for activity, at most until the next arrival or tick. */
static void batch_wait(batch_t *t)
{
    int wait_ms = (int)(BATCH_TICK_NS / 1000000ull);
    if (!t->b->concurrency && t->next < t->n) {
        double dt = t->b->at_s[t->next] - secs(t->run0, pkv_now_ns());
        int ms = dt <= 0 ? 0 : (int)(dt * 1e3) + 1;
        if (ms < wait_ms) wait_ms = ms;
    }
    curl_multi_poll(t->m, NULL, 0, wait_ms, NULL);
}

/* Every request sent has ended, and none is left to send (or the batch drains). */
static bool batch_over(const batch_t *t)
{
    if (t->done == t->n) return true;
    return t->done == t->next && t->b->drain && atomic_load(t->b->drain);
}

static void batch_loop(batch_t *t, bool *failed)
{
    uint64_t last_tick = t->run0;
    while (!batch_over(t) && !*failed) {
        if (t->b->stop && *t->b->stop) break;
        if (!batch_send(t)) *failed = true;
        int running;
        if (curl_multi_perform(t->m, &running) != CURLM_OK) *failed = true;
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(t->m, &left))) {
            if (msg->msg != CURLMSG_DONE) continue;
            http_xfer_t *x;
            curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&x);
            xfer_close(x, t->m, msg->data.result);
            t->done++;
            t->inflight--;
        }
        if (!batch_over(t) && !*failed) batch_wait(t);
        uint64_t now = pkv_now_ns();
        if (t->b->tick && now - last_tick >= BATCH_TICK_NS) {
            t->b->tick(t->b->tick_arg, t->done);
            last_tick = now;
        }
    }
}

double http_batch_run(const http_batch_t *b, const http_request_t *reqs, size_t n,
                      http_reply_t *replies)
{
    memset(replies, 0, n * sizeof(*replies));
    batch_t t = {.b = b, .reqs = reqs, .replies = replies, .n = n};
    t.m = curl_multi_init();
    t.x = calloc(n ? n : 1, sizeof(*t.x));
    if (!t.m || !t.x) {
        curl_multi_cleanup(t.m);
        free(t.x);
        return -1.0;
    }
    t.run0 = pkv_now_ns();
    bool failed = false;
    batch_loop(&t, &failed);
    for (size_t i = 0; i < t.next; i++)
        if (t.x[i].easy) xfer_close(&t.x[i], t.m, CURLE_ABORTED_BY_CALLBACK);
    double wall = secs(t.run0, pkv_now_ns());
    free(t.x);
    curl_multi_cleanup(t.m);
    return failed ? -1.0 : wall;
}

int http_call(const char *base_url, const char *path, const json_t *body,
              const char *const headers[], uint32_t timeout_ms,
              const volatile sig_atomic_t *abort_flag, http_reply_t *out)
{
    char *payload = body ? json_dumps(body, JSON_COMPACT) : NULL;
    http_request_t rq = {.base_url = base_url,
                         .path = path,
                         .body = payload,
                         .headers = headers,
                         .timeout_ms = timeout_ms,
                         .abort_flag = abort_flag};
    int rc = http_send(&rq, out);
    free(payload);
    if (rc != 0) {
        http_reply_free(out);
        out->status = 0;
    }
    return rc;
}

json_t *http_get_json(const char *base_url, const char *path, uint32_t timeout_ms)
{
    return http_json(base_url, path, NULL, timeout_ms);
}

json_t *http_json(const char *base_url, const char *path, const json_t *body, uint32_t timeout_ms)
{
    http_reply_t r;
    if (http_call(base_url, path, body, NULL, timeout_ms, NULL, &r) != 0) return NULL;
    json_t *doc = r.status == 200 ? json_loads(r.body, 0, NULL) : NULL;
    http_reply_free(&r);
    return doc;
}
