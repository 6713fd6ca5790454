/*
 * HTTP load driver (support/loadgen.h): a batch of the HTTP client (support/http.h), its
 * replies read as answers.
 */
#include "support/loadgen.h"

#include "core/core.h"
#include "support/footprint.h"
#include "support/http.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double secs(uint64_t a, uint64_t b)
{
    return b > a ? (double)(b - a) / 1e9 : 0.0;
}

char *lg_chat_body(const char *model, uint32_t tokens, uint64_t seed, uint32_t max_tokens,
                   double chars_per_token)
{
    size_t chars = (size_t)((double)tokens * chars_per_token);
    if (chars < 8) chars = 8;
    char *text = pkv_fp_filler_alloc(chars, seed);
    if (!text) return NULL;
    json_t *b = json_pack("{s:s, s:[{s:s, s:s}], s:i, s:f, s:b, s:b}", "model", model, "messages",
                          "role", "user", "content", text, "max_tokens", (int)max_tokens,
                          "temperature", 0.0, "stream", 1, "ignore_eos", 1);
    if (b) json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
    free(text);
    char *s = b ? json_dumps(b, JSON_COMPACT) : NULL;
    json_decref(b);
    return s;
}

/* When each event of one streamed body ended ("\n\n" came), from the HTTP client's body
 * callback on the driving thread. */
typedef struct {
    uint64_t *ns; /* ns[k]: event k's end came (monotonic) */
    size_t n, cap;
    size_t scanned; /* the body before it is searched */
    bool oom;       /* a time could not be kept: no times for this answer */
} lg_events_t;

static bool lg_on_body(void *arg, const char *body, size_t len, size_t added)
{
    lg_events_t *e = arg;
    uint64_t now = pkv_now_ns();
    (void)added;
    for (size_t i = e->scanned; i + 1 < len && !e->oom; i++) {
        if (body[i] != '\n' || body[i + 1] != '\n') continue;
        if (e->n == e->cap) {
            size_t c = e->cap ? 2 * e->cap : 256;
            uint64_t *nn = realloc(e->ns, c * sizeof(*nn));
            if (!nn) {
                e->oom = true;
                break;
            }
            e->ns = nn;
            e->cap = c;
        }
        e->ns[e->n++] = now;
        e->scanned = ++i + 1;
    }
    if (len && e->scanned < len - 1) e->scanned = len - 1; /* a lone '\n' may pair later */
    return true;
}

/* The times of body's events that carry text, from start_ns (seconds), into res. */
static void lg_text_times(const lg_events_t *e, const char *body, uint64_t start_ns,
                          lg_result_t *res)
{
    if (e->oom || !e->n || !body || !(res->text_s = malloc(e->n * sizeof(double)))) return;
    size_t k = 0;
    for (const char *ev = body; *ev && k < e->n; k++) {
        const char *end = strstr(ev, "\n\n");
        if (!end) break;
        if (!strncmp(ev, "data: ", 6) && cluster_event_has_text(ev + 6, (size_t)(end - ev) - 6))
            res->text_s[res->n_text++] = secs(start_ns, e->ns[k]);
        ev = end + 2;
    }
}

/* reqs[i]'s result from its reply (whose body moves to the result or is freed). */
static void lg_result(const lg_req_t *r, http_reply_t *rep, uint64_t run0, bool keep_body,
                      const lg_events_t *ev, lg_result_t *res)
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
    if (ev && r->stream && res->status == 200) lg_text_times(ev, rep->body, rep->start_ns, res);
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
    lg_events_t *ev = cfg->text_times ? calloc(n ? n : 1, sizeof(*ev)) : NULL;
    double wall = -1.0;
    if (!rq || !rep || !at || (cfg->text_times && !ev)) goto out;
    for (size_t i = 0; i < n; i++) {
        rq[i] = (http_request_t){.base_url = cfg->base_url,
                                 .path = reqs[i].path,
                                 .body = reqs[i].body,
                                 .headers = cfg->headers,
                                 .timeout_ms = cfg->timeout_ms,
                                 .on_body = ev ? lg_on_body : NULL,
                                 .on_body_arg = ev ? &ev[i] : NULL};
        at[i] = reqs[i].at_s;
    }
    http_batch_t b = {.concurrency = cfg->concurrency,
                      .at_s = at,
                      .stop = cfg->stop,
                      .drain = cfg->drain,
                      .tick = cfg->tick,
                      .tick_arg = cfg->tick_arg};
    uint64_t run0 = pkv_now_ns();
    wall = http_batch_run(&b, rq, n, rep);
    for (size_t i = 0; i < n; i++)
        lg_result(&reqs[i], &rep[i], run0, cfg->keep_body, ev ? &ev[i] : NULL, &results[i]);
    http_replies_free(rep, n);
out:
    for (size_t i = 0; ev && i < n; i++) free(ev[i].ns);
    free(ev);
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
        free(results[i].text_s);
        results[i].body = NULL;
        results[i].text_s = NULL;
        results[i].n_text = 0;
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
