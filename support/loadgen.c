/*
 * HTTP load driver (support/loadgen.h): a batch of the HTTP client (support/http.h), its
 * replies read as answers.
 */
#include "support/loadgen.h"

#include "core/core.h"
#include "support/http.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double secs(uint64_t a, uint64_t b)
{
    return b > a ? (double)(b - a) / 1e9 : 0.0;
}

/* reqs[i]'s result from its reply (whose body moves to the result or is freed). */
static void lg_result(const lg_req_t *r, http_reply_t *rep, uint64_t run0, bool keep_body,
                      lg_result_t *res)
{
    res->answer = (cluster_answer_t){.prompt_tokens = -1, .completion_tokens = -1};
    if (!rep->start_ns) return; /* never sent */
    res->start_s = secs(run0, rep->start_ns);
    res->total_s = secs(rep->start_ns, rep->end_ns);
    res->ttft_s = rep->first_byte_ns ? secs(rep->start_ns, rep->first_byte_ns) : res->total_s;
    if (rep->error[0]) {
        snprintf(res->transport, sizeof(res->transport), "%s", rep->error);
        return;
    }
    res->status = rep->status;
    if (cluster_answer_parse(rep->body, r->stream && res->status == 200, &res->answer) != 0) {
        res->answer = (cluster_answer_t){.prompt_tokens = -1, .completion_tokens = -1};
        snprintf(res->answer.error_code, sizeof(res->answer.error_code), "unreadable");
    }
    if (res->status != 200 || res->answer.error_code[0] || !res->answer.done)
        snprintf(res->excerpt, sizeof(res->excerpt), "%s", rep->body);
    if (keep_body) {
        res->body = rep->body;
        rep->body = NULL;
    }
}

double lg_run(const lg_config_t *cfg, const lg_req_t *reqs, size_t n, lg_result_t *results)
{
    memset(results, 0, n * sizeof(*results));
    http_request_t *rq = calloc(n ? n : 1, sizeof(*rq));
    http_reply_t *rep = calloc(n ? n : 1, sizeof(*rep));
    double *at = calloc(n ? n : 1, sizeof(*at));
    double wall = -1.0;
    if (!rq || !rep || !at) goto out;
    for (size_t i = 0; i < n; i++) {
        rq[i] = (http_request_t){.base_url = cfg->base_url,
                                 .path = reqs[i].path,
                                 .body = reqs[i].body,
                                 .headers = cfg->headers,
                                 .timeout_ms = cfg->timeout_ms};
        at[i] = reqs[i].at_s;
    }
    http_batch_t b = {.concurrency = cfg->concurrency,
                      .at_s = at,
                      .stop = cfg->stop,
                      .tick = cfg->tick,
                      .tick_arg = cfg->tick_arg};
    uint64_t run0 = pkv_now_ns();
    wall = http_batch_run(&b, rq, n, rep);
    for (size_t i = 0; i < n; i++) lg_result(&reqs[i], &rep[i], run0, cfg->keep_body, &results[i]);
    http_replies_free(rep, n);
out:
    free(at);
    free(rep);
    free(rq);
    return wall;
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
