/*
 * HTTP load driver (support/loadgen.h): libcurl multi, one thread.
 */
#include "support/loadgen.h"

#include "core/core.h"

#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    CURL *easy;
    struct curl_slist *hdrs;
    size_t idx;
    uint64_t t0_ns;    /* sent */
    uint64_t first_ns; /* first body byte */
    char *buf;
    size_t len, cap;
    bool oom;
} lg_slot_t;

static size_t lg_on_body(char *data, size_t size, size_t nmemb, void *arg)
{
    lg_slot_t *s = arg;
    size_t n = size * nmemb;
    if (!s->first_ns) s->first_ns = pkv_now_ns();
    if (s->len + n + 1 > s->cap) {
        size_t cap = s->cap ? s->cap : 4096;
        while (cap < s->len + n + 1) cap *= 2;
        char *nb = realloc(s->buf, cap);
        if (!nb) {
            s->oom = true;
            return 0;
        }
        s->buf = nb;
        s->cap = cap;
    }
    memcpy(s->buf + s->len, data, n);
    s->len += n;
    s->buf[s->len] = '\0';
    return n;
}

static double secs(uint64_t a, uint64_t b)
{
    return b > a ? (double)(b - a) / 1e9 : 0.0;
}

static int lg_start(CURLM *m, const lg_config_t *cfg, const lg_req_t *r, size_t idx, lg_slot_t *s,
                    uint64_t run0, lg_result_t *res)
{
    memset(s, 0, sizeof(*s));
    s->idx = idx;
    s->easy = curl_easy_init();
    if (!s->easy) return -1;
    char url[512];
    snprintf(url, sizeof(url), "%s%s", cfg->base_url, r->path);
    s->hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    for (size_t i = 0; cfg->headers && cfg->headers[i]; i++)
        s->hdrs = curl_slist_append(s->hdrs, cfg->headers[i]);
    curl_easy_setopt(s->easy, CURLOPT_URL, url);
    curl_easy_setopt(s->easy, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(s->easy, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(s->easy, CURLOPT_TIMEOUT_MS, (long)cfg->timeout_ms);
    curl_easy_setopt(s->easy, CURLOPT_HTTPHEADER, s->hdrs);
    curl_easy_setopt(s->easy, CURLOPT_POSTFIELDS, r->body);
    curl_easy_setopt(s->easy, CURLOPT_WRITEFUNCTION, lg_on_body);
    curl_easy_setopt(s->easy, CURLOPT_WRITEDATA, s);
    curl_easy_setopt(s->easy, CURLOPT_PRIVATE, s);
    s->t0_ns = pkv_now_ns();
    res->start_s = secs(run0, s->t0_ns);
    return curl_multi_add_handle(m, s->easy) == CURLM_OK ? 0 : -1;
}

static void lg_finish(CURLM *m, lg_slot_t *s, CURLcode rc, const lg_req_t *r, lg_result_t *res,
                      bool keep_body)
{
    uint64_t now = pkv_now_ns();
    res->total_s = secs(s->t0_ns, now);
    res->ttft_s = s->first_ns ? secs(s->t0_ns, s->first_ns) : res->total_s;
    if (rc != CURLE_OK || s->oom) {
        snprintf(res->transport, sizeof(res->transport), "%s",
                 s->oom ? "out of memory" : curl_easy_strerror(rc));
    } else {
        curl_easy_getinfo(s->easy, CURLINFO_RESPONSE_CODE, &res->status);
        if (cluster_answer_parse(s->buf ? s->buf : "", r->stream && res->status == 200,
                                 &res->answer) != 0) {
            res->answer = (cluster_answer_t){.prompt_tokens = -1, .completion_tokens = -1};
            snprintf(res->answer.error_code, sizeof(res->answer.error_code), "unreadable");
        }
        if (res->status != 200 || res->answer.error_code[0] || !res->answer.done)
            snprintf(res->excerpt, sizeof(res->excerpt), "%s", s->buf ? s->buf : "");
        if (keep_body) {
            res->body = s->buf;
            s->buf = NULL;
        }
    }
    curl_multi_remove_handle(m, s->easy);
    curl_easy_cleanup(s->easy);
    curl_slist_free_all(s->hdrs);
    free(s->buf);
    s->easy = NULL;
    s->buf = NULL;
}

double lg_run(const lg_config_t *cfg, const lg_req_t *reqs, size_t n, lg_result_t *results)
{
    memset(results, 0, n * sizeof(*results));
    for (size_t i = 0; i < n; i++)
        results[i].answer = (cluster_answer_t){.prompt_tokens = -1, .completion_tokens = -1};
    CURLM *m = curl_multi_init();
    lg_slot_t *slots = calloc(n ? n : 1, sizeof(*slots));
    if (!m || !slots) {
        curl_multi_cleanup(m);
        free(slots);
        return -1.0;
    }
    curl_multi_setopt(m, CURLMOPT_MAX_TOTAL_CONNECTIONS, 0L);
    uint64_t run0 = pkv_now_ns(), last_tick = run0;
    size_t next = 0, done = 0, inflight = 0;
    bool failed = false;
    while (done < n && !failed) {
        if (cfg->stop && *cfg->stop) break;
        uint64_t now = pkv_now_ns();
        while (next < n) {
            bool go =
                cfg->concurrency ? inflight < cfg->concurrency : reqs[next].at_s <= secs(run0, now);
            if (!go) break;
            if (lg_start(m, cfg, &reqs[next], next, &slots[next], run0, &results[next]) != 0) {
                failed = true;
                break;
            }
            next++;
            inflight++;
        }
        int running;
        curl_multi_perform(m, &running);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(m, &left))) {
            if (msg->msg != CURLMSG_DONE) continue;
            lg_slot_t *s;
            curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&s);
            lg_finish(m, s, msg->data.result, &reqs[s->idx], &results[s->idx], cfg->keep_body);
            done++;
            inflight--;
        }
        /* wait for activity, at most until the next arrival or tick */
        int wait_ms = 50;
        if (!cfg->concurrency && next < n) {
            double dt = reqs[next].at_s - secs(run0, pkv_now_ns());
            int ms = dt <= 0 ? 0 : (int)(dt * 1e3) + 1;
            if (ms < wait_ms) wait_ms = ms;
        }
        curl_multi_poll(m, NULL, 0, wait_ms, NULL);
        now = pkv_now_ns();
        if (cfg->tick && now - last_tick >= 50000000ull) {
            cfg->tick(cfg->tick_arg);
            last_tick = now;
        }
    }
    for (size_t i = 0; i < next; i++)
        if (slots[i].easy)
            lg_finish(m, &slots[i], CURLE_ABORTED_BY_CALLBACK, &reqs[i], &results[i],
                      cfg->keep_body);
    double wall = secs(run0, pkv_now_ns());
    free(slots);
    curl_multi_cleanup(m);
    return failed ? -1.0 : wall;
}

void lg_results_free(lg_result_t *results, size_t n)
{
    for (size_t i = 0; results && i < n; i++) {
        cluster_answer_free(&results[i].answer);
        free(results[i].body);
        results[i].body = NULL;
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double lg_quantile(double *v, size_t n, double q)
{
    if (n == 0) return 0.0;
    qsort(v, n, sizeof(*v), cmp_double);
    double pos = q * (double)(n - 1);
    size_t lo = (size_t)pos;
    if (lo + 1 >= n) return v[n - 1];
    return v[lo] + (pos - (double)lo) * (v[lo + 1] - v[lo]);
}
