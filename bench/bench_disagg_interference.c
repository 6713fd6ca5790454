/*
 * `pagekv bench disagg --interference`: what disaggregation buys, the decoding streams'
 * inter-token latency while long prompts arrive (docs/design/bench_disagg.md,
 * "Interference mode").
 *
 * Two arms, one after the other, on the same machine and the same total model threads:
 * a unified node (per --prefill-chunk value; the best by goodput is "unified") and a
 * prefill node + a decode node behind `pagekv route` ("disaggregated"). Per arm, fresh
 * processes, a warm-up, then the measured load, from two threads of the load driver:
 *   - the streams (this thread): `streams` conversations in a closed loop, each request a
 *     distinct short prompt generating `stream_tokens` tokens, streamed, temperature 0;
 *     each streamed text event's arrival is kept (support/loadgen.h, text_times);
 *   - the long prompts (a second thread): an open loop at `rate` for `duration` seconds,
 *     distinct prompts whose lengths cycle from the shortest to the longest.
 * When the last long prompt's answer ends, the window closes: no stream starts after it
 * (the driver drains), and only the gaps that ended inside the window count. Both arms
 * send the same bodies, so each request's answers compare bitwise.
 */
#include "bench/bench_disagg.h"
#include "support/bench.h"
#include "support/cli.h"
#include "support/footprint.h"
#include "support/launch.h"
#include "support/loadgen.h"

#include "core/core.h"
#include "prim/prim.h"

#include <curl/curl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BI_STOP_NS         30000000000ull
#define BI_HTTP_MS         600000
#define BI_LONG_MAX_TOKENS 16 /* the long prompts' answers: their TTFT is the figure */
#define BI_WARM_TOKENS     8
#define BI_MAX_CHUNKS      8
#define BI_LENGTHS         5 /* the long prompts' lengths cycle over this many values */
#define BI_BATCH_SPARE     8 /* --max-batch-size = streams + this: long prompts never queue */

typedef struct {
    uint32_t streams, stream_tokens, stream_prompt;
    double rate, duration;                    /* long prompts per second, for this long */
    uint32_t long_min, long_max;              /* their prompt tokens */
    uint32_t chunks[BI_MAX_CHUNKS], n_chunks; /* the unified arm's --prefill-chunk values */
    uint32_t threads;                         /* model threads in all, per arm */
    double slo_ttft_ms, slo_tpot_ms;
    bool quick;
    const char *preset, *json_path;
} bi_opts_t;

typedef struct {
    char bin[4096];
    char logdir[96];
} bi_env_t;

/* The requests, the same bodies for every arm. */
typedef struct {
    lg_req_t *streams, *longs, *warm;
    size_t n_streams, n_longs, n_warm;
    uint32_t ctx; /* --max-context of every node */
    double cpt;
} bi_load_t;

/* One arm: its answers and figures (ms; NAN when not measured). */
typedef struct {
    char name[24];            /* "unified", "disaggregated" */
    uint32_t chunk;           /* unified: its --prefill-chunk; 0: the disaggregated arm */
    bool ran;                 /* every process up and exiting 0, every request answered */
    lg_result_t *sres, *lres; /* streams (bi_load_t.n_streams), long prompts */
    uint64_t s0_ns, w1_ns;    /* the load's start; the window's end (the last long answer) */
    double tpot_p50, tpot_p99, tpot_mean, ttft_p50, ttft_p99, goodput, window_s;
    size_t gaps, answered, good, errors, streams_sent;
    uint32_t requests, identical; /* answered by both compared arms; bitwise equal */
} bi_arm_t;

static volatile sig_atomic_t g_stop;
static void on_signal(int sig)
{
    g_stop = sig;
}

/* ---- requests ----------------------------------------------------------------------------- */
/* The streams' closed loop sends at most this many: one per lane every 0.5 ms per output
 * token over the whole run and a margin (it drains long before). */
static size_t bi_stream_cap(const bi_opts_t *o)
{
    double turn_s = (double)o->stream_tokens * 0.0005;
    double turns = (o->duration + 30.0) / turn_s + 2.0;
    return (size_t)o->streams * (size_t)(turns > 100000 ? 100000 : turns);
}

static int bi_reqs(const bi_opts_t *o, double cpt, lg_req_t **out, size_t n, uint64_t seed0,
                   uint32_t (*tokens)(const bi_opts_t *, size_t), uint32_t max_tokens, double rate)
{
    lg_req_t *r = calloc(n ? n : 1, sizeof(*r));
    if (!r) return -1;
    *out = r;
    for (size_t i = 0; i < n; i++) {
        r[i].path = "/v1/chat/completions";
        r[i].stream = true;
        r[i].at_s = rate > 0 ? ((double)i + 0.5) / rate : 0;
        r[i].body = lg_chat_body(o->preset, tokens(o, i), seed0 + i, max_tokens, cpt);
        if (!r[i].body) return -1;
    }
    return 0;
}

static uint32_t bi_stream_len(const bi_opts_t *o, size_t i)
{
    (void)i;
    return o->stream_prompt;
}

/* Long prompt i's tokens: BI_LENGTHS values from the shortest to the longest, in turn. */
static uint32_t bi_long_len(const bi_opts_t *o, size_t i)
{
    uint32_t span = o->long_max - o->long_min;
    return o->long_min + (uint32_t)((uint64_t)span * (i % BI_LENGTHS) / (BI_LENGTHS - 1));
}

static uint32_t bi_warm_len(const bi_opts_t *o, size_t i)
{
    return i == 0 ? o->long_max : o->stream_prompt;
}

static void bi_reqs_free(lg_req_t *r, size_t n)
{
    for (size_t i = 0; r && i < n; i++) free(r[i].body);
    free(r);
}

static void bi_load_free(bi_load_t *L)
{
    bi_reqs_free(L->streams, L->n_streams);
    bi_reqs_free(L->longs, L->n_longs);
    bi_reqs_free(L->warm, L->n_warm);
}

/* Every arm's requests: distinct seeds per kind, so no two prompts share a prefix. */
static int bi_load_make(const bi_opts_t *o, bi_load_t *L)
{
    memset(L, 0, sizeof(*L));
    L->cpt = pkv_fp_chars_per_token();
    L->n_streams = bi_stream_cap(o);
    L->n_longs = (size_t)llround(o->rate * o->duration);
    if (L->n_longs < 1) L->n_longs = 1;
    L->n_warm = (size_t)o->streams + 1; /* one longest prompt and a short one per stream */
    uint32_t most = o->long_max > o->stream_prompt ? o->long_max : o->stream_prompt;
    uint32_t out = o->stream_tokens > BI_LONG_MAX_TOKENS ? o->stream_tokens : BI_LONG_MAX_TOKENS;
    L->ctx = most + most / 8 + out + 256; /* prompt lengths are approximate; the template */
    if (bi_reqs(o, L->cpt, &L->streams, L->n_streams, 1ull << 40, bi_stream_len, o->stream_tokens,
                0) ||
        bi_reqs(o, L->cpt, &L->longs, L->n_longs, 2ull << 40, bi_long_len, BI_LONG_MAX_TOKENS,
                o->rate) ||
        bi_reqs(o, L->cpt, &L->warm, L->n_warm, 3ull << 40, bi_warm_len, BI_WARM_TOKENS, 0)) {
        fprintf(stderr, "pagekv bench disagg: out of memory for the requests\n");
        return -1;
    }
    return 0;
}

/* ---- processes ---------------------------------------------------------------------------- */
/* Start the arm's processes into p[0..3] (unified: p[0] only); its entrance URL. */
static const char *bi_start(const bi_env_t *e, const bi_opts_t *o, const bi_load_t *L,
                            const bi_arm_t *a, launch_proc_t p[4])
{
    char batch[16], chunk[16], tu[16], tp[16], td[16];
    snprintf(batch, sizeof(batch), "%u", o->streams + BI_BATCH_SPARE);
    snprintf(chunk, sizeof(chunk), "%u", a->chunk);
    snprintf(tu, sizeof(tu), "%u", o->threads);
    snprintf(tp, sizeof(tp), "%u", o->threads - o->threads / 2);
    snprintf(td, sizeof(td), "%u", o->threads / 2);
    if (a->chunk) {
        char *x[] = {"--threads", tu, "--prefill-chunk", chunk, "--max-batch-size", batch, NULL};
        if (launch_serve(e->bin, e->logdir, a->name, o->preset, L->ctx, NULL, x, false, NULL,
                         &p[0]))
            return NULL;
        return p[0].url;
    }
    char *xp[] = {"--threads", tp, "--max-batch-size", batch, NULL};
    char *xd[] = {"--threads", td, "--max-batch-size", batch, NULL};
    if (launch_serve(e->bin, e->logdir, "prefill", o->preset, L->ctx, "prefill", xp, false, NULL,
                     &p[1]) ||
        launch_serve(e->bin, e->logdir, "decode", o->preset, L->ctx, "decode", xd, false, NULL,
                     &p[2]) ||
        launch_route(e->bin, e->logdir, "router", &p[1], &p[2], NULL, &p[3]))
        return NULL;
    return p[3].url;
}

/* Stop every process started; false when one did not exit 0. */
static bool bi_stop(launch_proc_t p[4])
{
    bool ok = true;
    for (int k = 3; k >= 0; k--) {
        if (!p[k].name[0]) continue;
        int ec = launch_stop(&p[k], SIGTERM, pkv_now_ns() + BI_STOP_NS);
        if (ec != 0) {
            fprintf(stderr, "pagekv bench disagg: %s exited %d (log %s)\n", p[k].name, ec,
                    p[k].log);
            ok = false;
        }
    }
    return ok;
}

/* ---- the load ----------------------------------------------------------------------------- */
static bool bi_answered(const lg_result_t *r)
{
    return r->status == 200 && !r->answer.error_code[0] && r->answer.done;
}

/* The long prompts' open loop, on a thread of its own; drains the streams when it ends. */
typedef struct {
    lg_config_t cfg;
    const lg_req_t *reqs;
    size_t n;
    lg_result_t *res;
    double wall;
    uint64_t end_ns;
    atomic_int *drain;
} bi_longs_t;

static void *bi_longs_main(void *arg)
{
    bi_longs_t *x = arg;
    x->wall = lg_run(&x->cfg, x->reqs, x->n, x->res);
    x->end_ns = pkv_now_ns();
    atomic_store(x->drain, 1);
    return NULL;
}

/* Requests sent and not answered, with the first one's excerpt on stderr. */
static size_t bi_errors(const char *arm, const char *what, const lg_result_t *r, size_t n)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (!r[i].status && !r[i].transport[0]) continue; /* never sent (drained) */
        if (bi_answered(&r[i])) continue;
        if (!bad++)
            fprintf(stderr, "  %s: a %s request failed: HTTP %ld %s %.200s\n", arm, what,
                    r[i].status, r[i].transport, r[i].excerpt);
    }
    return bad;
}

/* The warm-up, then the measured load into a; 0 when every request was answered. */
static int bi_drive(const char *url, const bi_opts_t *o, const bi_load_t *L, bi_arm_t *a)
{
    lg_result_t *warm = calloc(L->n_warm, sizeof(*warm));
    a->sres = calloc(L->n_streams, sizeof(*a->sres));
    a->lres = calloc(L->n_longs, sizeof(*a->lres));
    if (!warm || !a->sres || !a->lres) {
        free(warm);
        return -1;
    }
    lg_config_t wc = {.base_url = url,
                      .concurrency = (uint32_t)L->n_warm,
                      .timeout_ms = BI_HTTP_MS,
                      .stop = &g_stop};
    double ww = lg_run(&wc, L->warm, L->n_warm, warm);
    size_t werr = bi_errors(a->name, "warm-up", warm, L->n_warm);
    lg_results_free(warm, L->n_warm);
    free(warm);
    if (ww < 0 || werr || g_stop) return -1;

    atomic_int drain = 0;
    bi_longs_t lx = {.cfg = {.base_url = url, .timeout_ms = BI_HTTP_MS, .stop = &g_stop},
                     .reqs = L->longs,
                     .n = L->n_longs,
                     .res = a->lres,
                     .drain = &drain};
    lg_config_t sc = {.base_url = url,
                      .concurrency = o->streams,
                      .timeout_ms = BI_HTTP_MS,
                      .stop = &g_stop,
                      .drain = &drain,
                      .text_times = true};
    pthread_t th;
    a->s0_ns = pkv_now_ns();
    if (pthread_create(&th, NULL, bi_longs_main, &lx) != 0) return -1;
    pthread_setname_np(th, "pkv-bench-long");
    double sw = lg_run(&sc, L->streams, L->n_streams, a->sres);
    atomic_store(&drain, 1);
    pthread_join(th, NULL);
    a->w1_ns = lx.end_ns;
    for (size_t i = 0; i < L->n_streams; i++)
        if (a->sres[i].status || a->sres[i].transport[0]) a->streams_sent = i + 1;
    size_t unsent = 0; /* long prompts the run never sent (interrupted) */
    for (size_t i = 0; i < L->n_longs; i++)
        unsent += !a->lres[i].status && !a->lres[i].transport[0];
    a->errors = bi_errors(a->name, "stream", a->sres, L->n_streams) +
                bi_errors(a->name, "long prompt", a->lres, L->n_longs) + unsent;
    return sw < 0 || lx.wall < 0 || a->errors || g_stop ? -1 : 0;
}

/* One arm from its processes' start to their stop. */
static void bi_arm_run(const bi_env_t *e, const bi_opts_t *o, const bi_load_t *L, bi_arm_t *a)
{
    launch_proc_t p[4];
    memset(p, 0, sizeof(p));
    if (a->chunk)
        fprintf(stderr, "  %s (--threads %u, --prefill-chunk %u): starting\n", a->name, o->threads,
                a->chunk);
    else
        fprintf(stderr, "  %s (prefill --threads %u, decode --threads %u, router): starting\n",
                a->name, o->threads - o->threads / 2, o->threads / 2);
    const char *url = bi_start(e, o, L, a, p);
    int rc = url ? bi_drive(url, o, L, a) : -1;
    bool stopped = bi_stop(p);
    a->ran = rc == 0 && stopped;
    fprintf(stderr, "  %s: %s, %zu streams sent, %zu long prompts\n", a->name,
            a->ran ? "done" : "FAILED", a->streams_sent, L->n_longs);
}

/* ---- figures ------------------------------------------------------------------------------ */
static double bi_tpot_of(const lg_result_t *r)
{
    long n = r->answer.completion_tokens;
    return n > 1 ? (r->total_s - r->ttft_s) * 1e3 / (double)(n - 1) : 0;
}

/* Whether r meets both objectives (DistServe's per-request TTFT and TPOT). */
static bool bi_good(const bi_opts_t *o, const lg_result_t *r)
{
    return bi_answered(r) && r->ttft_s * 1e3 <= o->slo_ttft_ms && bi_tpot_of(r) <= o->slo_tpot_ms;
}

/* The streams' gaps that ended inside the window, ms (malloc'd; *n of them). */
static double *bi_gaps(const bi_arm_t *a, size_t n_streams, size_t *n)
{
    size_t cap = 0;
    for (size_t i = 0; i < n_streams; i++)
        if (a->sres[i].n_text > 1) cap += a->sres[i].n_text - 1;
    double *g = malloc((cap ? cap : 1) * sizeof(*g));
    *n = 0;
    if (!g) return NULL;
    double w1 = (double)(a->w1_ns - a->s0_ns) / 1e9;
    for (size_t i = 0; i < n_streams; i++) {
        const lg_result_t *r = &a->sres[i];
        for (size_t j = 1; j < r->n_text; j++)
            if (r->start_s + r->text_s[j] <= w1)
                g[(*n)++] = (r->text_s[j] - r->text_s[j - 1]) * 1e3;
    }
    return g;
}

static void bi_figures(const bi_opts_t *o, const bi_load_t *L, bi_arm_t *a)
{
    a->tpot_p50 = a->tpot_p99 = a->tpot_mean = a->ttft_p50 = a->ttft_p99 = a->goodput = NAN;
    if (!a->sres || !a->lres || a->w1_ns <= a->s0_ns) return;
    a->window_s = (double)(a->w1_ns - a->s0_ns) / 1e9;
    double *g = bi_gaps(a, L->n_streams, &a->gaps);
    if (g && a->gaps) {
        double sum = 0;
        for (size_t k = 0; k < a->gaps; k++) sum += g[k];
        a->tpot_mean = sum / (double)a->gaps;
        a->tpot_p50 = lg_quantile(g, a->gaps, 0.50);
        a->tpot_p99 = lg_quantile(g, a->gaps, 0.99);
    }
    free(g);
    double *t = malloc(L->n_longs * sizeof(*t));
    size_t nt = 0;
    for (size_t i = 0; t && i < L->n_longs; i++) {
        const lg_result_t *r = &a->lres[i];
        a->answered += bi_answered(r);
        a->good += bi_good(o, r);
        if (bi_answered(r)) t[nt++] = r->ttft_s * 1e3;
    }
    if (nt) {
        a->ttft_p50 = lg_quantile(t, nt, 0.50);
        a->ttft_p99 = lg_quantile(t, nt, 0.99);
    }
    free(t);
    for (size_t i = 0; i < L->n_streams; i++) {
        const lg_result_t *r = &a->sres[i];
        a->answered += bi_answered(r);
        if (r->start_s + r->total_s <= a->window_s) a->good += bi_good(o, r);
    }
    a->goodput = (double)a->good / a->window_s;
}

/* Requests both arms answered into each arm's requests, and how many are bitwise equal. */
static void bi_compare(const bi_load_t *L, bi_arm_t *a, bi_arm_t *b)
{
    uint32_t n = 0, same = 0;
    for (size_t i = 0; i < L->n_streams + L->n_longs; i++) {
        bool s = i < L->n_streams;
        const lg_result_t *x = s ? &a->sres[i] : &a->lres[i - L->n_streams];
        const lg_result_t *y = s ? &b->sres[i] : &b->lres[i - L->n_streams];
        if (!bi_answered(x) || !bi_answered(y)) continue;
        n++;
        same += cluster_answer_equal(&x->answer, &y->answer);
    }
    a->requests = b->requests = n;
    a->identical = b->identical = same;
}

/* The unified arm to compare: among the arms within 5 % of the best goodput (the same
 * load served as well, up to run-to-run noise), the lowest inter-token p99. */
static size_t bi_best(const bi_arm_t *u, size_t n)
{
    double top = 0;
    for (size_t k = 0; k < n; k++)
        if (u[k].ran && u[k].goodput > top) top = u[k].goodput;
    size_t best = 0;
    bool have = false;
    for (size_t k = 0; k < n; k++) {
        if (!u[k].ran || !(u[k].goodput >= 0.95 * top)) continue;
        if (!have || u[k].tpot_p99 < u[best].tpot_p99) best = k;
        have = true;
    }
    return best;
}

/* ---- report ------------------------------------------------------------------------------- */
static double bi_ratio(const bi_arm_t *u, const bi_arm_t *d)
{
    return u->tpot_p99 > 0 ? d->tpot_p99 / u->tpot_p99 : NAN;
}

static void bi_row(const bi_opts_t *o, const bi_arm_t *a, bool chosen)
{
    char threads[48], chunk[24];
    if (a->chunk) {
        snprintf(threads, sizeof(threads), "%u", o->threads);
        snprintf(chunk, sizeof(chunk), "%u%s", a->chunk, chosen ? " (used)" : "");
    } else {
        snprintf(threads, sizeof(threads), "%u + %u", o->threads - o->threads / 2, o->threads / 2);
        snprintf(chunk, sizeof(chunk), "256 (prefill node)");
    }
    printf(
        "| %s | %s | %s | %.1f | **%.1f** | %.1f | %.0f | %.0f | %.3f | %zu | %zu | %u / %u |%s\n",
        a->name, threads, chunk, a->tpot_p50, a->tpot_p99, a->tpot_mean, a->ttft_p50, a->ttft_p99,
        a->goodput, a->answered, a->gaps, a->identical, a->requests, a->ran ? "" : " FAILED");
}

static void bi_print(const bi_opts_t *o, const bi_load_t *L, const bi_arm_t *u, size_t nu,
                     size_t best, const bi_arm_t *d, const double load[2])
{
    char cpu[200];
    pkv_prim_cpu_model(cpu, sizeof(cpu));
    printf("pagekv bench disagg --interference: %s, %u streams x %u tokens (prompts ~%u tokens) "
           "while %zu long prompts of %u-%u tokens arrive at %.3g/s over %.0f s; load average "
           "(1 min) %.2f at the start, %.2f at the end\nCPU: %s\n\n",
           o->preset, o->streams, o->stream_tokens, o->stream_prompt, L->n_longs, o->long_min,
           o->long_max, o->rate, o->duration, load[0], load[1], cpu);
    printf("| arm | model threads | prefill chunk | tpot p50 ms | tpot p99 ms | tpot mean ms | "
           "long TTFT p50 ms | long TTFT p99 ms | goodput req/s | answered | gaps | identical / "
           "compared |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for (size_t k = 0; k < nu; k++) bi_row(o, &u[k], nu > 1 && k == best);
    bi_row(o, d, false);
    printf("\ntpot: the gap between consecutive streamed text events of the decoding streams "
           "(every gap that ended before the last long answer); goodput: requests per second "
           "of the window meeting TTFT <= %.0f ms and TPOT <= %.0f ms (DistServe's per-request "
           "objectives; TPOT = (total - TTFT) / (tokens - 1))\n",
           o->slo_ttft_ms, o->slo_tpot_ms);
    if (nu > 1)
        printf("unified: --prefill-chunk %u served it best (the lowest tpot p99 among the chunks "
               "within 5 %% of the best goodput)\n",
               u[best].chunk);
    double r = bi_ratio(&u[best], d);
    bool met = r <= 0.5;
    printf("\ntargets\n- %s: disaggregated tpot p99 / unified %.1f / %.1f ms = %.2f %s 0.5\n",
           met ? "met" : "NOT MET", d->tpot_p99, u[best].tpot_p99, r, met ? "<=" : ">");
    bool same = d->identical == d->requests && d->requests > 0;
    printf("- %s: identical answers %u of %u compared\n", same ? "met" : "NOT MET", d->identical,
           d->requests);
}

static json_t *bi_num(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

static json_t *bi_arm_json(const bi_arm_t *a)
{
    json_t *j =
        json_pack("{s:s, s:o, s:o, s:o, s:o, s:o, s:o, s:i, s:i, s:I, s:I, s:I, s:o, s:b}", "name",
                  a->name, "tpot_p50_ms", bi_num(a->tpot_p50), "tpot_p99_ms", bi_num(a->tpot_p99),
                  "tpot_mean_ms", bi_num(a->tpot_mean), "ttft_p50_ms", bi_num(a->ttft_p50),
                  "ttft_p99_ms", bi_num(a->ttft_p99), "goodput_rps", bi_num(a->goodput), "requests",
                  (int)a->requests, "identical", (int)a->identical, "answered",
                  (json_int_t)a->answered, "gaps", (json_int_t)a->gaps, "streams_sent",
                  (json_int_t)a->streams_sent, "window_s", bi_num(a->window_s), "ran", a->ran);
    json_object_set_new(j, "prefill_chunk", a->chunk ? json_integer(a->chunk) : json_null());
    return j;
}

static json_t *bi_json(const bi_opts_t *o, const bi_load_t *L, const bi_arm_t *u, size_t nu,
                       size_t best, const bi_arm_t *d, const double load[2])
{
    char cpu[200];
    pkv_prim_cpu_model(cpu, sizeof(cpu));
    json_t *arms = json_pack("[o, o]", bi_arm_json(&u[best]), bi_arm_json(d));
    json_t *chunks = json_array();
    for (size_t k = 0; k < nu; k++) {
        json_t *c = bi_arm_json(&u[k]);
        json_object_set_new(c, "chosen", json_boolean(k == best));
        json_array_append_new(chunks, c);
    }
    double r = bi_ratio(&u[best], d);
    json_t *targets =
        json_pack("[{s:s, s:o, s:f, s:b}, {s:s, s:i, s:i, s:b}]", "name",
                  "tpot_p99_disaggregated_over_unified", "value", bi_num(r), "target", 0.5, "met",
                  r <= 0.5, "name", "identical_answers", "value", (int)d->identical, "target",
                  (int)d->requests, "met", d->identical == d->requests && d->requests > 0);
    json_t *j = json_pack(
        "{s:s, s:s, s:s, s:{s:i, s:i, s:i}, s:i, s:i, s:i, s:[i, i], s:f, s:f, s:I, s:i, s:{s:f, "
        "s:f}, s:[f, f], s:f}",
        "mode", "interference", "cpu_model", cpu, "preset", o->preset, "threads", "unified",
        (int)o->threads, "prefill", (int)(o->threads - o->threads / 2), "decode",
        (int)(o->threads / 2), "streams", (int)o->streams, "stream_tokens", (int)o->stream_tokens,
        "stream_prompt_tokens", (int)o->stream_prompt, "long_prompt_tokens", (int)o->long_min,
        (int)o->long_max, "prompt_rate_rps", o->rate, "duration_s", o->duration, "long_prompts",
        (json_int_t)L->n_longs, "long_max_tokens", BI_LONG_MAX_TOKENS, "slo", "ttft_ms",
        o->slo_ttft_ms, "tpot_ms", o->slo_tpot_ms, "load_average_1m", load[0], load[1],
        "chars_per_token", L->cpt);
    json_object_set_new(j, "arms", arms);
    json_object_set_new(j, "unified_chunks", chunks);
    json_object_set_new(j, "targets", targets);
    return j;
}

/* ---- options ------------------------------------------------------------------------------ */
static void bi_usage(FILE *f)
{
    fprintf(f, "usage: pagekv bench disagg --interference [--streams N] [--stream-tokens N]\n"
               "         [--stream-prompt-tokens N] [--prompt-rate R] [--prompt-tokens MIN[-MAX]]\n"
               "         [--duration S] [--prefill-chunk LIST] [--threads N] [--slo-ttft-ms MS]\n"
               "         [--slo-tpot-ms MS] [--preset NAME] [--quick] [--json FILE]\n"
               "What disaggregation buys: decoding streams' inter-token latency while long\n"
               "prompts arrive. Two arms, one after the other, the same model threads in all:\n"
               "a unified node (--threads N) and a prefill node (N - N/2 threads) + a decode\n"
               "node (N/2) behind pagekv route. Per arm: tpot p50/p99 (gaps between streamed\n"
               "tokens), the long prompts' TTFT p50/p99, goodput, answers compared bitwise.\n"
               "  --streams N              decoding streams, a closed loop (default 8)\n"
               "  --stream-tokens N        tokens each stream request generates (default 256)\n"
               "  --stream-prompt-tokens N a stream request's prompt (default 64)\n"
               "  --prompt-rate R          long prompts per second (default 0.1)\n"
               "  --prompt-tokens MIN[-MAX]  long prompts' tokens (default 2048-4096)\n"
               "  --duration S             long prompts arrive for S seconds (default 60)\n"
               "  --prefill-chunk LIST     the unified node's chunk(s); several: one arm each,\n"
               "                           the lowest tpot p99 within 5 %% of the best goodput\n"
               "                           is compared (default 256)\n"
               "  --threads N              model threads per arm, >= 2 (default: the CPUs)\n"
               "  --slo-ttft-ms MS         goodput's TTFT objective (default 8000)\n"
               "  --slo-tpot-ms MS         goodput's TPOT objective (default 50)\n"
               "  --preset NAME            model preset (default llama-3.2-1b)\n"
               "  --quick                  a smoke test: 4 streams x 32 tokens, prompts 256-512\n"
               "                           at 2/s for 2 s (its figures mean nothing)\n");
}

static int bi_range_parse(const char *v, bi_opts_t *o)
{
    char buf[64];
    if (strlen(v) >= sizeof(buf)) return -1;
    snprintf(buf, sizeof(buf), "%s", v);
    char *dash = strchr(buf, '-');
    if (dash) *dash = '\0';
    uint64_t lo, hi;
    if (pkv_cli_parse_u64(buf, 16, 131072, &lo)) return -1;
    hi = lo;
    if (dash && pkv_cli_parse_u64(dash + 1, lo, 131072, &hi)) return -1;
    o->long_min = (uint32_t)lo;
    o->long_max = (uint32_t)hi;
    return 0;
}

static int bi_real(const char *cmd, const char *flag, const char *v, double lo, double hi,
                   double *out)
{
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end || !(x >= lo && x <= hi))
        return pkv_cli_usage_error(cmd, "%s wants a number in [%g, %g], got '%s'", flag, lo, hi, v);
    *out = x;
    return 0;
}

/* One option with its value; 0 or 2 (a usage error). */
static int bi_option(const char *cmd, const char *a, const char *v, bi_opts_t *o)
{
    if (!strcmp(a, "--streams")) return pkv_cli_flag_u32(cmd, a, v, 1, 256, &o->streams);
    if (!strcmp(a, "--stream-tokens"))
        return pkv_cli_flag_u32(cmd, a, v, 2, 65536, &o->stream_tokens);
    if (!strcmp(a, "--stream-prompt-tokens"))
        return pkv_cli_flag_u32(cmd, a, v, 1, 65536, &o->stream_prompt);
    if (!strcmp(a, "--threads")) return pkv_cli_flag_u32(cmd, a, v, 2, 64, &o->threads);
    if (!strcmp(a, "--prompt-rate")) return bi_real(cmd, a, v, 0.001, 1000, &o->rate);
    if (!strcmp(a, "--duration")) return bi_real(cmd, a, v, 0.1, 86400, &o->duration);
    if (!strcmp(a, "--slo-ttft-ms")) return bi_real(cmd, a, v, 0, 1e9, &o->slo_ttft_ms);
    if (!strcmp(a, "--slo-tpot-ms")) return bi_real(cmd, a, v, 0, 1e9, &o->slo_tpot_ms);
    if (!strcmp(a, "--prompt-tokens")) {
        if (bi_range_parse(v, o))
            return pkv_cli_usage_error(cmd,
                                       "--prompt-tokens wants MIN or MIN-MAX, 16 <= MIN <= "
                                       "MAX <= 131072, got '%s'",
                                       v);
        return 0;
    }
    if (!strcmp(a, "--prefill-chunk")) {
        if (pkv_cli_parse_u32_list(v, 1, 65536, o->chunks, BI_MAX_CHUNKS, &o->n_chunks))
            return pkv_cli_usage_error(cmd,
                                       "--prefill-chunk wants 1..%d comma-separated token "
                                       "counts in 1..65536, got '%s'",
                                       BI_MAX_CHUNKS, v);
        return 0;
    }
    if (!strcmp(a, "--preset")) {
        o->preset = v;
        return 0;
    }
    if (!strcmp(a, "--json")) {
        o->json_path = v;
        return 0;
    }
    return pkv_cli_usage_error(cmd, "unknown option: %s", a);
}

/* --quick's sizes, where the command line did not set them (set[k]: option k given). */
static void bi_quick(bi_opts_t *o, const bool set[6])
{
    if (!set[0]) o->streams = 4;
    if (!set[1]) o->stream_tokens = 32;
    if (!set[2]) o->stream_prompt = 32;
    if (!set[3]) o->rate = 2;
    if (!set[4]) o->long_min = 256, o->long_max = 512;
    if (!set[5]) o->duration = 2;
}

/* 0, 1 for --help, or 2 after a usage error. */
static int bi_parse(int argc, char **argv, bi_opts_t *o)
{
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    *o = (bi_opts_t){.streams = 8,
                     .stream_tokens = 256,
                     .stream_prompt = 64,
                     .rate = 0.1,
                     .duration = 60,
                     .long_min = 2048,
                     .long_max = 4096,
                     .chunks = {256},
                     .n_chunks = 1,
                     .threads = cpus < 2    ? 2
                                : cpus > 64 ? 64
                                            : (uint32_t)cpus,
                     .slo_ttft_ms = 8000,
                     .slo_tpot_ms = 50,
                     .preset = "llama-3.2-1b"};
    static const char *const sized[6] = {
        "--streams",     "--stream-tokens", "--stream-prompt-tokens",
        "--prompt-rate", "--prompt-tokens", "--duration"};
    bool set[6] = {false};
    const char *cmd = "bench disagg --interference";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--interference")) continue;
        if (!strcmp(a, "--quick")) {
            o->quick = true;
            continue;
        }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bi_usage(stdout);
            return 1;
        }
        if (!v || strncmp(a, "--", 2))
            return pkv_cli_usage_error(cmd, "unknown option or missing value: %s", a);
        int rc = bi_option(cmd, a, v, o);
        if (rc) return rc;
        for (int k = 0; k < 6; k++) set[k] = set[k] || !strcmp(a, sized[k]);
        i++;
    }
    if (o->quick) bi_quick(o, set);
    return 0;
}

/* ---- the run ------------------------------------------------------------------------------ */
/* The 1-minute load average, -1 when unknown. */
static double bi_loadavg(void)
{
    double l;
    return pkv_prim_loadavg(&l) == PKV_OK ? l : -1;
}

static void bi_arms_free(bi_arm_t *arms, size_t n, const bi_load_t *L)
{
    for (size_t k = 0; k < n; k++) {
        if (arms[k].sres) lg_results_free(arms[k].sres, L->n_streams);
        if (arms[k].lres) lg_results_free(arms[k].lres, L->n_longs);
        free(arms[k].sres);
        free(arms[k].lres);
    }
}

int pkv_bench_disagg_interference(int argc, char **argv)
{
    bi_opts_t o;
    int prc = bi_parse(argc, argv, &o);
    if (prc) return prc == 1 ? 0 : prc;
    bi_env_t e;
    snprintf(e.logdir, sizeof(e.logdir), "/tmp/pagekv-bench-interference-XXXXXX");
    if (launch_env_init(e.bin, sizeof(e.bin), e.logdir, on_signal)) return 2;
    bi_load_t L;
    if (bi_load_make(&o, &L)) {
        bi_load_free(&L);
        return 1;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    double load[2] = {bi_loadavg(), -1};
    fprintf(stderr, "pagekv bench disagg --interference: %s, load %.2f, logs in %s\n", o.preset,
            load[0], e.logdir);
    bi_arm_t arms[BI_MAX_CHUNKS + 1];
    memset(arms, 0, sizeof(arms));
    size_t nu = o.n_chunks, na = 0;
    for (size_t k = 0; k < nu && !g_stop; k++, na++) {
        snprintf(arms[k].name, sizeof(arms[k].name), "unified");
        arms[k].chunk = o.chunks[k];
        bi_arm_run(&e, &o, &L, &arms[k]);
    }
    bi_arm_t *d = &arms[nu];
    snprintf(d->name, sizeof(d->name), "disaggregated");
    if (!g_stop) bi_arm_run(&e, &o, &L, d), na++;
    load[1] = bi_loadavg();
    int rc = 0;
    for (size_t k = 0; k < na; k++) rc |= !arms[k].ran;
    if (!g_stop && na == nu + 1) {
        for (size_t k = 0; k <= nu; k++) bi_figures(&o, &L, &arms[k]);
        for (size_t k = 0; k < nu; k++) bi_compare(&L, &arms[k], d);
        size_t best = bi_best(arms, nu);
        bi_compare(&L, &arms[best], d);
        for (size_t k = 0; k <= nu; k++) rc |= arms[k].identical != arms[k].requests;
        rc |= !d->requests;
        bi_print(&o, &L, arms, nu, best, d, load);
        if (o.json_path) {
            json_t *j = bi_json(&o, &L, arms, nu, best, d, load);
            rc |= pkv_bench_write_json(o.json_path, j) != 0;
            json_decref(j);
        }
    }
    bi_arms_free(arms, na, &L);
    bi_load_free(&L);
    curl_global_cleanup();
    if (g_stop) fprintf(stderr, "pagekv bench disagg: interrupted\n");
    fprintf(stderr, "logs: %s\n", e.logdir);
    return g_stop ? 130 : rc ? 1 : 0;
}
