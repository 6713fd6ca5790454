/*
 * `pagekv bench disagg --latency`: what disaggregation adds to one request at low load
 * (docs/design/bench_disagg.md, "Latency mode").
 *
 * A unified node, a prefill node, a decode node (per_transfer staging) and `pagekv route`
 * over the two, one request at a time. Per prompt size, N rounds; round i sends
 *   1. prompt A_i to the unified node, streamed (its TTFT and total);
 *   2. A_i as the two legs, driven here: the prefill leg (`do_remote_decode`, max_tokens 1,
 *      not streamed), then the decode leg with the returned params, streamed, with
 *      `X-Pagekv-Timings: 1` (its phases and bytes pulled come in its last chunk);
 *   3. prompt C_i = A_i's text and more as the two legs again: the decode node holds A_i's
 *      blocks, so only the new ones move (bytes with a decode-side prefix hit);
 *   4. once the decode node's warm floor is whole again (its refill runs when the node is
 *      quiet: not beside the measured requests), prompt B_i to the unified node, streamed,
 *      and B_i through the router, streamed, each node's /metrics read before and after
 *      (one request at a time: the deltas of the histogram sums are this request's);
 *   5. once every round of the size has run 1-4, what streaming the KV during the prefill
 *      could save here: G_i's two legs, the decode leg (max_tokens 1) alone with the CPU
 *      both nodes spent on it; D_i's prefill leg (its KV registered), then E_i and F_i as
 *      plain requests to the prefill node (max_tokens 1: the prefill's compute, nothing
 *      registered), one alone and one with D_i's decode leg (max_tokens 1) sent halfway
 *      into it, so the pull's copies on both nodes run while that prefill computes (which
 *      of the two goes alone alternates by round);
 *   6. after step 5 of the size, --quiet-pairs pairs: no request for the nodes' staging
 *      idle period + 2 s, a prompt through the router, 0.5 s, another: what the first
 *      request after a quiet spell pays (staging the idle release returned to the OS).
 * A..F are distinct filler texts (their own seeds), so nothing else is a prefix hit.
 * Interleaving the unified and the disaggregated request of a round compares like with
 * like on a machine whose speed drifts over minutes.
 */
#include "bench/bench_disagg.h"
#include "support/bench.h"
#include "support/cli.h"
#include "support/cluster.h"
#include "support/footprint.h"
#include "support/http.h"
#include "support/launch.h"

#include "core/core.h"
#include "prim/prim.h"

#include <curl/curl.h>
#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BL_STOP_NS       30000000000ull
#define BL_HTTP_MS       600000
#define BL_MAX_TOKENS    8
#define BL_MAX_SIZES     8
#define BL_SETTLE_NS     2000000000ull /* a node's histograms count a finished leg by then */
#define BL_QUIET_MORE_MS 2000          /* step 6's quiet spell: the staging idle period and this */
#define BL_QUIET_GAP_MS  500           /* and the gap before the pair's second request */

typedef struct {
    uint32_t runs, quiet_pairs;
    uint32_t sizes[BL_MAX_SIZES], n_sizes;
    const char *preset, *json_path;
} bl_opts_t;

typedef struct {
    char bin[4096];
    char logdir[96];
} bl_env_t;

/* The decode leg's phases as X-Pagekv-Timings and the phase histograms name them. */
/* The decode leg's phases as X-Pagekv-Timings and the phase histograms name them: the
 * prompt's admission (kv_alloc, kv_commit), the pull (handshake .. commit), the decode. */
enum {
    PH_KV_ALLOC,
    PH_KV_COMMIT,
    PH_HANDSHAKE,
    PH_STAGING_WAIT,
    PH_WIRE,
    PH_COMMIT,
    PH_DECODE,
    BL_NPH
};
static const char *const bl_ph_names[BL_NPH] = {
    "kv_alloc", "kv_commit", "handshake", "staging_wait", "wire", "commit", "decode"};

/* The decode leg's moments on its node (pagekv_timings.decode_leg_ms: each the ms since
 * the one before, from its headers): docs/design/disagg.md, "Observability". */
enum { BL_NMARK = 9 };
static const char *const bl_mark_names[BL_NMARK] = {"arrival",  "pull_asked", "pull_begin",
                                                    "pull_end", "resumed",    "submitted",
                                                    "admitted", "seen",       "first_write"};

/* /metrics series read around a routed request, per process. */
enum { RS_TTFB, RS_E2E, RS_E2E_COUNT, RS_LEG_P, RS_LEG_D, RS_LOOKUP, BL_NRS };
static const char *const bl_router_series[BL_NRS] = {
    "pagekv_router_time_to_first_byte_seconds_sum",
    "pagekv_router_request_duration_seconds_sum",
    "pagekv_router_request_duration_seconds_count",
    "pagekv_router_leg_seconds_sum{role=\"prefill\"}",
    "pagekv_router_leg_seconds_sum{role=\"decode\"}",
    "pagekv_router_lookup_seconds_sum"};
enum { PS_QUEUE, PS_COMPUTE, PS_WIRE_COUNT, BL_NPS };
static const char *const bl_prefill_series[BL_NPS] = {
    "pagekv_kv_transfer_phase_seconds_sum{phase=\"prefill_queue\"}",
    "pagekv_kv_transfer_phase_seconds_sum{phase=\"prefill_compute\"}",
    "pagekv_kv_transfer_phase_seconds_count{phase=\"wire\"}"};
enum { DS_PH0, DS_DECODE_COUNT = BL_NPH, DS_BYTES, BL_NDS };
static const char *const bl_decode_series[BL_NDS] = {
    "pagekv_kv_transfer_phase_seconds_sum{phase=\"kv_alloc\"}",
    "pagekv_kv_transfer_phase_seconds_sum{phase=\"kv_commit\"}",
    "pagekv_kv_transfer_phase_seconds_sum{phase=\"handshake\"}",
    "pagekv_kv_transfer_phase_seconds_sum{phase=\"staging_wait\"}",
    "pagekv_kv_transfer_phase_seconds_sum{phase=\"wire\"}",
    "pagekv_kv_transfer_phase_seconds_sum{phase=\"commit\"}",
    "pagekv_kv_transfer_phase_seconds_sum{phase=\"decode\"}",
    "pagekv_kv_transfer_phase_seconds_count{phase=\"decode\"}",
    "pagekv_kv_transfer_received_bytes_total"};

/* One round's measurements; times in ms, NAN when not measured. */
typedef struct {
    long prompt_tokens;      /* A_i's, from the unified answer's usage */
    double u_ttft, u_total;  /* unified, A_i */
    double p_leg;            /* direct prefill leg, A_i */
    double d_ttfb, d_total;  /* direct decode leg, A_i */
    double d_ph[BL_NPH];     /* its pagekv_timings */
    double d_mark[BL_NMARK]; /* and its moments (decode_leg_ms) */
    long long d_bytes, d_blocks, d_adopted;
    long long x_bytes, x_blocks, x_adopted; /* C_i's decode leg (prefix hit) */
    long x_prompt_tokens;
    double ub_ttft, ub_total;                  /* unified, B_i */
    double ub_queue, ub_compute;               /* its prefill_queue, prefill_compute (timings) */
    double r_ttft, r_total;                    /* through the router, B_i (client side) */
    double rs[BL_NRS], ps[BL_NPS], ds[BL_NDS]; /* metric deltas (seconds -> ms; bytes) */
    double o_alone, o_over;                    /* the prefill alone, with a pull beside it */
    double o_ph[BL_NPH];                       /* that pull's phases */
    double o_end;                              /* its decode leg's end - the prefill's end */
    double o_cpu_p, o_cpu_d, o_ttfb;           /* a decode leg alone: CPU ms per node, TTFB */
} bl_round_t;

static volatile sig_atomic_t g_stop;
static void on_signal(int sig)
{
    g_stop = sig;
}

/* ---- processes ---------------------------------------------------------------------------- */
/* The unified and the prefill node, whose TTFTs the routed figure compares, run with a
 * prefix cache of BL_CACHE_CAP: both reach it within the first rounds and run in the same
 * regime. With the default cap (an eighth of RAM) the prefill node, which also serves
 * step 3's and step 5's prompts, reached it rounds before the unified node, and the
 * difference of their commits entered `added` round by round. */
#define BL_CACHE_CAP "128M"

static int bl_serve(const bl_env_t *e, const bl_opts_t *o, const char *role, uint32_t ctx,
                    launch_proc_t *p)
{
    char *unified[] = {"--prefix-cache-max-bytes", BL_CACHE_CAP, NULL};
    char *prefill[] = {"--staging", "per_transfer", "--prefix-cache-max-bytes", BL_CACHE_CAP, NULL};
    char *decode[] = {"--staging", "per_transfer", NULL};
    char **extra = !role ? unified : !strcmp(role, "prefill") ? prefill : decode;
    return launch_serve(e->bin, e->logdir, role ? role : "unified", o->preset, ctx, role, extra,
                        false, NULL, p);
}

static int bl_route(const bl_env_t *e, const launch_proc_t *pre, const launch_proc_t *dec,
                    launch_proc_t *p)
{
    return launch_route(e->bin, e->logdir, "router", pre, dec, NULL, p);
}

/* ---- requests ----------------------------------------------------------------------------- */
/* A streamed chat request whose content is `chars` characters of filler from seed. */
static json_t *bl_body(const char *model, size_t chars, uint64_t seed)
{
    char *text = pkv_fp_filler_alloc(chars < 8 ? 8 : chars, seed);
    if (!text) return NULL;
    json_t *b =
        json_pack("{s:s, s:[{s:s, s:s}], s:i, s:f, s:b, s:b, s:{s:b}}", "model", model, "messages",
                  "role", "user", "content", text, "max_tokens", BL_MAX_TOKENS, "temperature", 0.0,
                  "stream", 1, "ignore_eos", 1, "stream_options", "include_usage", 1);
    free(text);
    return b;
}

/* POST body; 0 when a 200 came with a complete answer (ans filled when non-NULL). */
static int bl_post(const char *url, const json_t *body, bool timings, http_reply_t *rep,
                   cluster_answer_t *ans)
{
    const char *const hdr[] = {"X-Pagekv-Timings: 1", NULL};
    int rc = http_call(url, "/v1/chat/completions", body, timings ? hdr : NULL, BL_HTTP_MS, &g_stop,
                       rep);
    if (rc != 0 || rep->status != 200) {
        fprintf(stderr, "    %s: %s HTTP %ld %.200s\n", url, rep->error, rep->status,
                rep->body ? rep->body : "");
        return -1;
    }
    bool stream = json_is_true(json_object_get(body, "stream"));
    cluster_answer_t a;
    if (cluster_answer_parse(rep->body, stream, &a) != 0) return -1;
    bool ok = !a.error_code[0] && a.done;
    if (ans && ok)
        *ans = a;
    else
        cluster_answer_free(&a);
    return ok ? 0 : -1;
}

/* A streamed answer's pagekv_timings (a new reference), from the event carrying it. */
static json_t *bl_timings(const char *body)
{
    const char *k = body ? strstr(body, "\"pagekv_timings\"") : NULL;
    if (!k) return NULL;
    const char *line = k;
    while (line > body && line[-1] != '\n') line--;
    if (strncmp(line, "data: ", 6)) return NULL;
    line += 6;
    json_t *doc = json_loadb(line, strcspn(line, "\n"), 0, NULL);
    json_t *t = json_incref(json_object_get(doc, "pagekv_timings"));
    json_decref(doc);
    return t;
}

/* The prefill leg of req on url: its kv_transfer_params (a new reference), leg time. */
static json_t *bl_prefill_leg(const char *url, const json_t *req, double *ms)
{
    json_t *pre = json_deep_copy(req);
    json_object_set_new(pre, "max_tokens", json_integer(1));
    json_object_set_new(pre, "stream", json_false());
    json_object_del(pre, "stream_options");
    json_object_set_new(pre, "kv_transfer_params",
                        json_pack("{s:b, s:b, s:n, s:n, s:n, s:n}", "do_remote_decode", 1,
                                  "do_remote_prefill", 0, "remote_engine_id", "remote_block_ids",
                                  "remote_host", "remote_port"));
    http_reply_t rep;
    json_t *kt = NULL;
    if (bl_post(url, pre, false, &rep, NULL) == 0) {
        json_t *doc = json_loads(rep.body, 0, NULL);
        kt = json_incref(json_object_get(doc, "kv_transfer_params"));
        json_decref(doc);
        *ms = rep.seconds * 1e3;
    }
    http_reply_free(&rep);
    json_decref(pre);
    return kt;
}

/* A decode leg's streamed answer: its pagekv_timings (a new reference) with its phases in ph
 * (ms), or NULL (said) when it carries no phases. */
static json_t *bl_leg_phases(const char *body, double ph[BL_NPH])
{
    json_t *t = bl_timings(body);
    json_t *phs = json_object_get(t, "phases_seconds");
    if (!json_is_object(phs)) {
        fprintf(stderr, "    decode leg: no pagekv_timings phases in its answer\n");
        json_decref(t);
        return NULL;
    }
    for (int k = 0; k < BL_NPH; k++) {
        json_t *v = json_object_get(phs, bl_ph_names[k]);
        ph[k] = json_is_number(v) ? json_number_value(v) * 1e3 : 0;
    }
    return t;
}

/* Both legs of req driven here; the decode leg's figures into the out parameters. */
static int bl_legs(const char *pre_url, const char *dec_url, const json_t *req, double *p_ms,
                   double *ttfb, double *total, double ph[BL_NPH], double mark[BL_NMARK],
                   long long pulled[3])
{
    json_t *kt = bl_prefill_leg(pre_url, req, p_ms);
    if (!kt) return -1;
    json_t *dec = json_deep_copy(req);
    json_object_set_new(dec, "kv_transfer_params", kt);
    http_reply_t rep;
    int rc = bl_post(dec_url, dec, true, &rep, NULL);
    json_t *t = rc == 0 ? bl_leg_phases(rep.body, ph) : NULL;
    if (!t) rc = -1;
    if (rc == 0) {
        *ttfb = rep.ttfb_seconds * 1e3;
        *total = rep.seconds * 1e3;
        json_t *mk = json_object_get(t, "decode_leg_ms");
        for (int k = 0; k < BL_NMARK; k++) {
            json_t *v = json_object_get(mk, bl_mark_names[k]);
            mark[k] = json_is_number(v) ? json_number_value(v) : NAN;
        }
        pulled[0] = cluster_json_int(t, "kv_pulled_bytes");
        pulled[1] = cluster_json_int(t, "kv_pulled_blocks");
        pulled[2] = cluster_json_int(t, "kv_adopted_blocks");
    }
    json_decref(t);
    http_reply_free(&rep);
    json_decref(dec);
    return rc;
}

/* ---- /metrics ----------------------------------------------------------------------------- */
typedef struct {
    double r[BL_NRS], p[BL_NPS], d[BL_NDS];
} bl_scrape_t;

static int bl_scrape_all(const char *rt, const char *pre, const char *dec, bl_scrape_t *s)
{
    return cluster_metrics_scrape(rt, bl_router_series, BL_NRS, s->r) |
           cluster_metrics_scrape(pre, bl_prefill_series, BL_NPS, s->p) |
           cluster_metrics_scrape(dec, bl_decode_series, BL_NDS, s->d);
}

/* After a routed request: scrape until each node counted it (the router its request, the
 * prefill node its serve, the decode node its decode), within BL_SETTLE_NS. */
static int bl_scrape_after(const char *rt, const char *pre, const char *dec,
                           const bl_scrape_t *before, bl_scrape_t *after)
{
    uint64_t end = pkv_now_ns() + BL_SETTLE_NS;
    for (;;) {
        if (bl_scrape_all(rt, pre, dec, after) != 0) return -1;
        if (after->r[RS_E2E_COUNT] > before->r[RS_E2E_COUNT] &&
            after->p[PS_WIRE_COUNT] > before->p[PS_WIRE_COUNT] &&
            after->d[DS_DECODE_COUNT] > before->d[DS_DECODE_COUNT])
            return 0;
        if (pkv_now_ns() >= end) return -1;
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
}

/* ---- one round ---------------------------------------------------------------------------- */
typedef struct {
    const bl_opts_t *o;
    const launch_proc_t *un, *pre, *dec, *rt;
    double cpt;
} bl_ctx_t;

/* The unified node's streamed answer to req (with X-Pagekv-Timings): TTFT, total, prompt
 * tokens, and its prefill_queue and prefill_compute (ms; NAN when its timings lack them). */
static int bl_unified(const bl_ctx_t *c, const json_t *req, double *ttft, double *total,
                      long *prompt_tokens, double *queue, double *compute)
{
    http_reply_t rep;
    cluster_answer_t a;
    int rc = bl_post(c->un->url, req, true, &rep, &a);
    if (rc == 0) {
        *ttft = rep.ttfb_seconds * 1e3;
        *total = rep.seconds * 1e3;
        if (prompt_tokens) *prompt_tokens = a.prompt_tokens;
        cluster_answer_free(&a);
        json_t *t = bl_timings(rep.body);
        json_t *phs = json_object_get(t, "phases_seconds");
        json_t *q = json_object_get(phs, "prefill_queue"),
               *k = json_object_get(phs, "prefill_compute");
        if (queue) *queue = json_is_number(q) ? json_number_value(q) * 1e3 : NAN;
        if (compute) *compute = json_is_number(k) ? json_number_value(k) * 1e3 : NAN;
        json_decref(t);
    }
    http_reply_free(&rep);
    return rc;
}

/* Wait (at most BL_SETTLE_NS) until the decode node's warm floor is whole again: its refill
 * runs once the node is quiet, and the measured requests of step 4 must not run beside it.
 * 0 when it is (or the node has none). */
static int bl_warm_settled(const char *dec_url)
{
    uint64_t end = pkv_now_ns() + BL_SETTLE_NS;
    for (;;) {
        json_t *d = http_get_json(dec_url, "/v1/cache/stats", 2000);
        long long want = cluster_json_int(d, "warm.bytes");
        long long have = cluster_json_int(d, "warm.empty_bytes");
        json_decref(d);
        if (want >= 0 && have >= want) return 0;
        if (pkv_now_ns() >= end) return -1;
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
}

/* B_i through the router, with the metric deltas of its legs. */
static int bl_routed(const bl_ctx_t *c, const json_t *req, bl_round_t *x)
{
    bl_scrape_t b, a;
    if (bl_scrape_all(c->rt->url, c->pre->url, c->dec->url, &b) != 0) return -1;
    http_reply_t rep;
    int rc = bl_post(c->rt->url, req, false, &rep, NULL);
    if (rc == 0) {
        x->r_ttft = rep.ttfb_seconds * 1e3;
        x->r_total = rep.seconds * 1e3;
    }
    http_reply_free(&rep);
    if (rc != 0) return -1;
    if (bl_scrape_after(c->rt->url, c->pre->url, c->dec->url, &b, &a) != 0) {
        fprintf(stderr, "    the nodes' /metrics did not count the routed request\n");
        return -1;
    }
    for (int k = 0; k < BL_NRS; k++) x->rs[k] = (a.r[k] - b.r[k]) * 1e3;
    for (int k = 0; k < BL_NPS; k++) x->ps[k] = (a.p[k] - b.p[k]) * 1e3;
    for (int k = 0; k < BL_NDS; k++) x->ds[k] = (a.d[k] - b.d[k]) * (k == DS_BYTES ? 1 : 1e3);
    return 0;
}

/* ---- step 5: a pull beside a prefill ------------------------------------------------------ */
typedef struct {
    const char *url;
    json_t *body;   /* the decode leg */
    uint64_t at_ns; /* when to send it */
    int rc;
    double ph[BL_NPH]; /* its pull's phases, ms */
    uint64_t end_ns;
} bl_pull_t;

static void *bl_pull_main(void *arg)
{
    bl_pull_t *p = arg;
    uint64_t now = pkv_now_ns();
    if (p->at_ns > now) {
        struct timespec ts = {(time_t)((p->at_ns - now) / 1000000000ull),
                              (long)((p->at_ns - now) % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
    http_reply_t rep;
    p->rc = bl_post(p->url, p->body, true, &rep, NULL);
    p->end_ns = pkv_now_ns();
    json_t *t = p->rc == 0 ? bl_leg_phases(rep.body, p->ph) : NULL;
    if (!t) p->rc = -1;
    json_decref(t);
    http_reply_free(&rep);
    return NULL;
}

/* CPU time of every live thread of pid, ms (a thread that ended is not counted). */
static double bl_cpu_ms(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    if (!d) return NAN;
    unsigned long long ns = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char f[96];
        snprintf(f, sizeof(f), "/proc/%d/task/%.20s/schedstat", (int)pid, e->d_name);
        FILE *fp = fopen(f, "r");
        unsigned long long run = 0;
        if (fp) {
            if (fscanf(fp, "%llu", &run) != 1) run = 0;
            fclose(fp);
        }
        ns += run;
    }
    closedir(d);
    return (double)ns / 1e6;
}

/* A plain max_tokens-1 request to the prefill node: its time, ms (NAN when it failed). When
 * pull is set, that decode leg is sent from a thread half_ms into the prefill. */
static double bl_prefill_timed(const bl_ctx_t *c, const json_t *req, double half_ms,
                               bl_pull_t *pull)
{
    json_t *b = json_deep_copy(req);
    json_object_set_new(b, "max_tokens", json_integer(1));
    json_object_set_new(b, "stream", json_false());
    json_object_del(b, "stream_options");
    pthread_t t;
    bool started = false;
    if (pull) {
        pull->at_ns = pkv_now_ns() + (uint64_t)(half_ms * 1e6);
        started = pthread_create(&t, NULL, bl_pull_main, pull) == 0;
        if (!started) pull->rc = -1;
    }
    http_reply_t rep;
    double ms = bl_post(c->pre->url, b, false, &rep, NULL) == 0 ? rep.seconds * 1e3 : NAN;
    uint64_t end = pkv_now_ns();
    http_reply_free(&rep);
    json_decref(b);
    if (started) {
        pthread_join(t, NULL);
        if (pull->rc != 0) ms = NAN;
        pull->end_ns -= PKV_MIN(pull->end_ns, end);
    }
    return ms;
}

/* req's prefill leg, then req made its decode leg (the leg's params, max_tokens 1): 0, or -1
 * when the prefill leg failed. */
static int bl_one_token_leg(const bl_ctx_t *c, json_t *req)
{
    double p_ms;
    json_t *kt = bl_prefill_leg(c->pre->url, req, &p_ms);
    if (!kt) return -1;
    json_object_set_new(req, "max_tokens", json_integer(1));
    json_object_set_new(req, "kv_transfer_params", kt);
    return 0;
}

/* G's two legs, the decode leg (max_tokens 1) alone: the CPU both nodes spent on it (from
 * its start to its end; ms) and its TTFB. */
static int bl_leg_cpu(const bl_ctx_t *c, json_t *g, bl_round_t *x)
{
    if (bl_one_token_leg(c, g)) return -1;
    double p0 = bl_cpu_ms(c->pre->pid), d0 = bl_cpu_ms(c->dec->pid);
    http_reply_t rep;
    int rc = bl_post(c->dec->url, g, false, &rep, NULL);
    x->o_cpu_p = bl_cpu_ms(c->pre->pid) - p0;
    x->o_cpu_d = bl_cpu_ms(c->dec->pid) - d0;
    x->o_ttfb = rep.ttfb_seconds * 1e3;
    http_reply_free(&rep);
    return rc;
}

/* Step 5 of round i (after every round of steps 1-4 of its size, so that its extra prompts
 * leave those as they were): four texts with seeds of their own; half: half the size's
 * median unified TTFT. */
static int bl_overlap(const bl_ctx_t *c, uint32_t size, uint32_t i, double half, bl_round_t *x)
{
    const char *m = c->o->preset;
    size_t chars = (size_t)((double)size * c->cpt);
    uint64_t seed = ((uint64_t)size << 24) + (1ull << 40) + 4ull * i;
    json_t *d = bl_body(m, chars, seed), *e = bl_body(m, chars, seed + 1);
    json_t *f = bl_body(m, chars, seed + 2), *g = bl_body(m, chars, seed + 3);
    int rc = -1;
    if (!d || !e || !f || !g || bl_leg_cpu(c, g, x) || bl_one_token_leg(c, d)) goto out;
    bl_pull_t pull = {.url = c->dec->url, .body = d, .rc = -1};
    json_t *alone = i % 2 ? f : e, *beside = i % 2 ? e : f;
    x->o_alone = x->o_over = NAN; /* until measured */
    /* even rounds time the prefill alone first, odd ones the one beside the pull; each
     * starts with the decode node's warm floor whole: no refill runs beside it but the one
     * its own decode leg causes */
    for (uint32_t k = 0; k < 2 && !bl_warm_settled(c->dec->url); k++) {
        if ((k + i) % 2)
            x->o_over = bl_prefill_timed(c, beside, half, &pull);
        else
            x->o_alone = bl_prefill_timed(c, alone, half, NULL);
    }
    if (isnan(x->o_alone) || isnan(x->o_over)) goto out;
    memcpy(x->o_ph, pull.ph, sizeof(x->o_ph));
    x->o_end = (double)pull.end_ns / 1e6;
    rc = 0;
out:
    json_decref(d);
    json_decref(e);
    json_decref(f);
    json_decref(g);
    return rc;
}

/* ---- step 6: after a quiet spell ---------------------------------------------------------- */
/* One pair's routed requests: [0] after the quiet spell, [1] BL_QUIET_GAP_MS later (ms). */
enum { BQ_TTFT, BQ_WIRE, BQ_STAGING_WAIT, BQ_N };
static const char *const bl_q_names[BQ_N] = {"router_ttft_ms", "wire_ms", "staging_wait_ms"};
typedef struct {
    double v[2][BQ_N];
} bl_quiet_t;

static void bl_sleep_ms(uint64_t ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (!g_stop && nanosleep(&ts, &ts) != 0) {
    }
}

/* How long step 6 keeps the nodes quiet: the decode node's staging idle period and
 * BL_QUIET_MORE_MS (0 when it cannot be read or staging is never returned). */
static uint64_t bl_quiet_ms(const char *dec_url)
{
    json_t *d = http_get_json(dec_url, "/v1/cache/stats", 2000);
    long long idle = cluster_json_int(d, "kv_transfer.staging.idle_release_ms");
    json_decref(d);
    return idle < 0 ? 0 : (uint64_t)idle + BL_QUIET_MORE_MS;
}

static int bl_quiet_pair(const bl_ctx_t *c, uint32_t size, uint32_t i, uint64_t quiet_ms,
                         bl_quiet_t *q)
{
    size_t chars = (size_t)((double)size * c->cpt);
    uint64_t seed = ((uint64_t)size << 24) + (2ull << 40) + 2ull * i;
    for (int k = 0; k < 2; k++) {
        bl_sleep_ms(k ? BL_QUIET_GAP_MS : quiet_ms);
        json_t *b = bl_body(c->o->preset, chars, seed + (uint64_t)k);
        bl_round_t x;
        memset(&x, 0, sizeof(x));
        int rc = b && !g_stop ? bl_routed(c, b, &x) : -1;
        json_decref(b);
        if (rc) return -1;
        q->v[k][BQ_TTFT] = x.r_ttft;
        q->v[k][BQ_WIRE] = x.ds[DS_PH0 + PH_WIRE];
        q->v[k][BQ_STAGING_WAIT] = x.ds[DS_PH0 + PH_STAGING_WAIT];
    }
    return 0;
}

static int bl_round(const bl_ctx_t *c, uint32_t size, uint32_t i, bl_round_t *x)
{
    const char *m = c->o->preset;
    size_t chars = (size_t)((double)size * c->cpt);
    size_t more = (size_t)((double)(size / 4 < 16 ? 16 : size / 4) * c->cpt);
    uint64_t seed = ((uint64_t)size << 24) + 3ull * i + 1;
    json_t *a = bl_body(m, chars, seed), *b = bl_body(m, chars, seed + 1);
    json_t *px = bl_body(m, chars + more, seed); /* A_i's text, then more */
    double p_ms, ttfb, total, ph[BL_NPH], mark[BL_NMARK];
    long long pulled[3];
    int rc = -1;
    if (!a || !b || !px) goto out;
    if (bl_unified(c, a, &x->u_ttft, &x->u_total, &x->prompt_tokens, NULL, NULL) ||
        bl_legs(c->pre->url, c->dec->url, a, &x->p_leg, &x->d_ttfb, &x->d_total, x->d_ph, x->d_mark,
                pulled))
        goto out;
    x->d_bytes = pulled[0], x->d_blocks = pulled[1], x->d_adopted = pulled[2];
    if (bl_legs(c->pre->url, c->dec->url, px, &p_ms, &ttfb, &total, ph, mark, pulled)) goto out;
    x->x_bytes = pulled[0], x->x_blocks = pulled[1], x->x_adopted = pulled[2];
    if (bl_warm_settled(c->dec->url))
        fprintf(stderr, "    the decode node's warm floor was not whole within 2 s\n");
    if (bl_unified(c, b, &x->ub_ttft, &x->ub_total, NULL, &x->ub_queue, &x->ub_compute) ||
        bl_routed(c, b, x))
        goto out;
    rc = 0;
out:
    json_decref(a);
    json_decref(b);
    json_decref(px);
    return rc;
}

/* ---- figures ------------------------------------------------------------------------------ */
/* The figures of one size: medians over its rounds (ms; bytes). */
enum {
    F_TOKENS,
    F_U_TTFT,
    F_U_DECODE,
    F_D_TOTAL,
    F_A_DIFF,
    F_D_PH0,
    F_D_DECODE_OVER = F_D_PH0 + BL_NPH, /* decode phase - the unified node's decode */
    F_D_TTFB,
    F_D_FIRST,   /* decode leg TTFB; it minus the pull */
    F_D_PREPULL, /* TTFB - pull - the first token after submission */
    F_D_MARK0,   /* the moments on the node */
    F_BYTES = F_D_MARK0 + BL_NMARK,
    F_BLOCKS,
    F_X_BYTES,
    F_X_BLOCKS,
    F_X_ADOPTED,
    F_UB_TTFT,
    F_R_TTFT,
    F_ADDED,
    F_ADDED_SAME, /* added with the two prefills' compute difference taken out */
    F_HOP,
    F_R_OWN,
    F_P_LEG,
    F_P_EXTRA,
    F_P_QUEUE,
    F_P_COMPUTE,
    F_UB_QUEUE, /* the unified node's prefill_queue, prefill_compute of B_i */
    F_UB_COMPUTE,
    F_R_PH0, /* kv_alloc .. commit through the router */
    F_R_PULL = F_R_PH0 + PH_DECODE,
    F_R_DEC_TTFB,
    F_R_FIRST,
    F_R_FIRST_TOKEN, /* decode phase - the unified node's decode of B_i */
    F_R_PREPULL,
    F_R_BYTES,
    F_O_ALONE, /* step 5: the prefill alone, with a pull beside it, their difference */
    F_O_OVER,
    F_O_SLOW,
    F_O_WIRE,  /* the pull's wire beside the prefill */
    F_O_END,   /* its decode leg's end after the prefill's (0: before) */
    F_O_SAVE,  /* the direct decode leg's TTFB (alone) - the prefill's slowdown */
    F_O_CPU_P, /* a decode leg (max_tokens 1) alone: CPU on the prefill node, the decode node */
    F_O_CPU_D,
    F_O_TTFB,     /* its TTFB */
    F_O_SAVE_CPU, /* its TTFB - its CPU on both nodes / the CPUs */
    BL_NF
};
static const char *const bl_f_names[BL_NF] = {"prompt_tokens",
                                              "unified_ttft_ms",
                                              "unified_decode_ms",
                                              "decode_leg_ms",
                                              "decode_leg_minus_unified_decode_ms",
                                              "kv_alloc_ms",
                                              "kv_commit_ms",
                                              "handshake_ms",
                                              "staging_wait_ms",
                                              "wire_ms",
                                              "commit_ms",
                                              "decode_ms",
                                              "decode_minus_unified_decode_ms",
                                              "decode_leg_ttfb_ms",
                                              "decode_leg_ttfb_minus_pull_ms",
                                              "decode_node_before_pull_ms",
                                              "node_arrival_ms",
                                              "node_pull_asked_ms",
                                              "node_pull_begin_ms",
                                              "node_pull_end_ms",
                                              "node_resumed_ms",
                                              "node_submitted_ms",
                                              "node_admitted_ms",
                                              "node_seen_ms",
                                              "node_first_write_ms",
                                              "bytes_pulled",
                                              "blocks_pulled",
                                              "prefix_hit_bytes_pulled",
                                              "prefix_hit_blocks_pulled",
                                              "prefix_hit_blocks_adopted",
                                              "unified_ttft_ms",
                                              "router_ttft_ms",
                                              "added_ms",
                                              "added_same_compute_ms",
                                              "client_hop_ms",
                                              "router_own_ms",
                                              "prefill_leg_ms",
                                              "prefill_leg_minus_unified_ttft_ms",
                                              "prefill_queue_ms",
                                              "prefill_compute_ms",
                                              "unified_queue_ms",
                                              "unified_compute_ms",
                                              "kv_alloc_ms",
                                              "kv_commit_ms",
                                              "handshake_ms",
                                              "staging_wait_ms",
                                              "wire_ms",
                                              "commit_ms",
                                              "pull_ms",
                                              "decode_leg_ttfb_ms",
                                              "decode_leg_ttfb_minus_pull_ms",
                                              "first_token_after_submission_ms",
                                              "decode_node_before_pull_ms",
                                              "bytes_received",
                                              "prefill_alone_ms",
                                              "prefill_with_pull_ms",
                                              "prefill_slowdown_ms",
                                              "wire_beside_prefill_ms",
                                              "pull_end_after_prefill_ms",
                                              "saving_bound_ms",
                                              "leg_cpu_prefill_node_ms",
                                              "leg_cpu_decode_node_ms",
                                              "leg_ttfb_ms",
                                              "saving_bound_cpu_ms"};

static void bl_values(const bl_round_t *x, double f[BL_NF])
{
    double pull = 0;
    for (int k = PH_HANDSHAKE; k <= PH_COMMIT; k++) pull += x->d_ph[k];
    f[F_TOKENS] = (double)x->prompt_tokens;
    f[F_U_TTFT] = x->u_ttft;
    f[F_U_DECODE] = x->u_total - x->u_ttft;
    f[F_D_TOTAL] = x->d_total;
    f[F_A_DIFF] = x->d_total - f[F_U_DECODE];
    for (int k = 0; k < BL_NPH; k++) f[F_D_PH0 + k] = x->d_ph[k];
    f[F_D_DECODE_OVER] = x->d_ph[PH_DECODE] - f[F_U_DECODE];
    f[F_D_TTFB] = x->d_ttfb;
    f[F_D_FIRST] = x->d_ttfb - pull;
    f[F_D_PREPULL] = f[F_D_FIRST] - f[F_D_DECODE_OVER];
    for (int k = 0; k < BL_NMARK; k++) f[F_D_MARK0 + k] = x->d_mark[k];
    f[F_BYTES] = (double)x->d_bytes;
    f[F_BLOCKS] = (double)x->d_blocks;
    f[F_X_BYTES] = (double)x->x_bytes;
    f[F_X_BLOCKS] = (double)x->x_blocks;
    f[F_X_ADOPTED] = (double)x->x_adopted;
    /* through the router: its own time is what its request took outside its legs */
    double own = x->rs[RS_E2E] - x->rs[RS_LEG_P] - x->rs[RS_LEG_D] - x->rs[RS_LOOKUP];
    double rpull = 0;
    for (int k = PH_HANDSHAKE; k <= PH_COMMIT; k++) rpull += x->ds[DS_PH0 + k];
    f[F_UB_TTFT] = x->ub_ttft;
    f[F_R_TTFT] = x->r_ttft;
    f[F_ADDED] = x->r_ttft - x->ub_ttft;
    /* The prefill node's and the unified node's prefill_compute of the same text differ by
     * up to ~10 % from one round to the next on a shared VM (tens of ms at 2048 tokens), far
     * more than the target's margin: TTFT less its own compute, on each path. */
    f[F_ADDED_SAME] = (x->r_ttft - x->ps[PS_COMPUTE]) - (x->ub_ttft - x->ub_compute);
    f[F_HOP] = x->r_ttft - x->rs[RS_TTFB];
    f[F_R_OWN] = own;
    f[F_P_LEG] = x->rs[RS_LEG_P];
    f[F_P_EXTRA] = x->rs[RS_LEG_P] - x->ub_ttft;
    f[F_P_QUEUE] = x->ps[PS_QUEUE];
    f[F_P_COMPUTE] = x->ps[PS_COMPUTE];
    f[F_UB_QUEUE] = x->ub_queue;
    f[F_UB_COMPUTE] = x->ub_compute;
    for (int k = 0; k < PH_DECODE; k++) f[F_R_PH0 + k] = x->ds[DS_PH0 + k];
    f[F_R_PULL] = rpull;
    /* the decode leg's first byte: the router's first byte less what came before the leg */
    f[F_R_DEC_TTFB] = x->rs[RS_TTFB] - own - x->rs[RS_LEG_P] - x->rs[RS_LOOKUP];
    f[F_R_FIRST] = f[F_R_DEC_TTFB] - rpull;
    f[F_R_FIRST_TOKEN] = x->ds[DS_PH0 + PH_DECODE] - (x->ub_total - x->ub_ttft);
    f[F_R_PREPULL] = f[F_R_FIRST] - f[F_R_FIRST_TOKEN];
    f[F_R_BYTES] = x->ds[DS_BYTES];
    f[F_O_ALONE] = x->o_alone;
    f[F_O_OVER] = x->o_over;
    f[F_O_SLOW] = x->o_over - x->o_alone;
    f[F_O_WIRE] = x->o_ph[PH_WIRE];
    f[F_O_END] = x->o_end;
    f[F_O_SAVE] = x->d_ttfb - f[F_O_SLOW];
    f[F_O_CPU_P] = x->o_cpu_p;
    f[F_O_CPU_D] = x->o_cpu_d;
    f[F_O_TTFB] = x->o_ttfb;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    f[F_O_SAVE_CPU] = x->o_ttfb - (x->o_cpu_p + x->o_cpu_d) / (double)(cpus > 0 ? cpus : 1);
}

static void bl_medians(const bl_round_t *x, uint32_t n, double med[BL_NF])
{
    double *col = malloc((n ? n : 1) * sizeof(double));
    double(*all)[BL_NF] = malloc((n ? n : 1) * sizeof(*all));
    for (int k = 0; k < BL_NF; k++) med[k] = NAN;
    if (!col || !all) goto out;
    for (uint32_t i = 0; i < n; i++) bl_values(&x[i], all[i]);
    for (int k = 0; k < BL_NF && n; k++) { /* over the rounds that measured it */
        uint32_t m = 0;
        for (uint32_t i = 0; i < n; i++)
            if (!isnan(all[i][k])) col[m++] = all[i][k];
        med[k] = m ? pkv_bench_median(col, m) : NAN;
    }
out:
    free(col);
    free(all);
}

/* ---- report ------------------------------------------------------------------------------- */
typedef struct {
    uint32_t size, n; /* rounds that completed */
    bl_round_t *rounds;
    double med[BL_NF];
    uint32_t nq; /* step 6's pairs that completed */
    bl_quiet_t *quiet;
    double qmed[2][BQ_N];
    uint64_t quiet_ms;
} bl_size_t;

/* Step 6's medians over its pairs. */
static void bl_quiet_medians(bl_size_t *S)
{
    double col[256];
    for (int k = 0; k < 2; k++)
        for (int f = 0; f < BQ_N; f++) {
            uint32_t m = 0;
            for (uint32_t i = 0; i < S->nq && m < 256; i++) col[m++] = S->quiet[i].v[k][f];
            S->qmed[k][f] = m ? pkv_bench_median(col, m) : NAN;
        }
}

/* Added time beyond the wire, by part (medians, ms), largest first: what limits it. The parts
 * partition added - wire (less the lookups, none with one prefill node): the client hop, the
 * router's own time, the prefill leg beyond the unified TTFT, and the decode leg's TTFB, which
 * is the pull (its wire and the rest) and what the leg spends outside it. The decode node's
 * later decode steps are not in the TTFT, so the "first token" column is not a part. */
static void bl_limits(const double *m, char *out, size_t cap)
{
    typedef struct {
        const char *what;
        double ms;
    } part_t;
    part_t p[] = {
        {"the decode leg outside its pull (TTFB - pull: its HTTP exchange, tokenizing, the "
         "params' check, admission, the first token)",
         m[F_R_FIRST]},
        {"the prefill leg's own round trip (prefill leg - unified TTFT)", m[F_P_EXTRA]},
        {"the pull outside the wire (handshake + staging_wait + commit)",
         m[F_R_PH0 + PH_HANDSHAKE] + m[F_R_PH0 + PH_STAGING_WAIT] + m[F_R_PH0 + PH_COMMIT]},
        {"the router's own time", m[F_R_OWN]},
        {"the client <-> router hop", m[F_HOP]},
    };
    int n = (int)(sizeof(p) / sizeof(p[0]));
    for (int a = 0; a < n; a++)
        for (int b = a + 1; b < n; b++)
            if (p[b].ms > p[a].ms) {
                part_t t = p[a];
                p[a] = p[b];
                p[b] = t;
            }
    snprintf(out, cap, "%s %.2f ms, then %s %.2f ms", p[0].what, p[0].ms, p[1].what, p[1].ms);
}

static bool bl_met(const double *m)
{
    return m[F_ADDED] <= m[F_R_PH0 + PH_WIRE] + 5.0;
}

static void bl_print(const bl_opts_t *o, const bl_size_t *S, uint32_t ns)
{
    printf("\n### decode leg: the decode leg minus a unified node's decode (medians of %u, ms)\n\n",
           o->runs);
    printf("| size | prompt tokens | unified TTFT | unified decode | decode leg | decode leg - "
           "unified decode |");
    for (int k = 0; k < BL_NPH; k++) printf(" %s |", bl_ph_names[k]);
    printf(" first token (decode - unified decode) | decode leg TTFB | TTFB - pull | before the "
           "pull (TTFB - pull - first token) |\n|");
    for (int k = 0; k < 10 + BL_NPH; k++) printf("---|");
    printf("\n");
    for (uint32_t s = 0; s < ns; s++) {
        const double *m = S[s].med;
        printf("| %u | %.0f | %.1f | %.1f | %.1f | **%.1f** |", S[s].size, m[F_TOKENS], m[F_U_TTFT],
               m[F_U_DECODE], m[F_D_TOTAL], m[F_A_DIFF]);
        for (int k = 0; k < BL_NPH; k++) printf(" %.2f |", m[F_D_PH0 + k]);
        printf(" %.1f | %.1f | %.1f | %.1f |\n", m[F_D_DECODE_OVER], m[F_D_TTFB], m[F_D_FIRST],
               m[F_D_PREPULL]);
    }
    printf("\n### decode leg on its node: each moment, ms since the one before (medians of %u; "
           "from its headers to the first bytes handed to libmicrohttpd)\n\n| size |",
           o->runs);
    for (int k = 0; k < BL_NMARK; k++) printf(" %s |", bl_mark_names[k]);
    printf(" sum | decode leg TTFB - sum (connect, headers in, bytes out) |\n|");
    for (int k = 0; k < BL_NMARK + 3; k++) printf("---|");
    printf("\n");
    for (uint32_t s = 0; s < ns; s++) {
        const double *m = S[s].med;
        double sum = 0;
        printf("| %u |", S[s].size);
        for (int k = 0; k < BL_NMARK; k++) {
            printf(" %.2f |", m[F_D_MARK0 + k]);
            sum += m[F_D_MARK0 + k];
        }
        printf(" %.2f | %.2f |\n", sum, m[F_D_TTFB] - sum);
    }
    printf("\n### decode leg: bytes moved per request (medians of %u)\n\n", o->runs);
    printf("| size | no prefix hit: MiB pulled | blocks pulled | with a decode-side prefix hit: "
           "MiB pulled | blocks pulled | blocks adopted |\n");
    printf("|---|---|---|---|---|---|\n");
    for (uint32_t s = 0; s < ns; s++) {
        const double *m = S[s].med;
        printf("| %u | %.3f | %.0f | %.3f | %.0f | %.0f |\n", S[s].size, m[F_BYTES] / 1048576.0,
               m[F_BLOCKS], m[F_X_BYTES] / 1048576.0, m[F_X_BLOCKS], m[F_X_ADOPTED]);
    }
    printf(
        "\n### routed TTFT: TTFT through the router minus a unified node's (medians of %u, ms)\n\n",
        o->runs);
    printf("| size | unified TTFT | router TTFT | added | added, same compute | client hop | "
           "router own | prefill leg | "
           "prefill leg - unified TTFT | prefill_queue | prefill_compute | unified queue | unified "
           "compute |");
    for (int k = 0; k < PH_DECODE; k++) printf(" %s |", bl_ph_names[k]);
    printf(" decode leg TTFB | TTFB - pull | first token | before the pull | MiB received |\n|");
    for (int k = 0; k < 18 + PH_DECODE; k++) printf("---|");
    printf("\n");
    for (uint32_t s = 0; s < ns; s++) {
        const double *m = S[s].med;
        printf("| %u | %.1f | %.1f | **%.1f** | %.1f | %.2f | %.2f | %.1f | %.1f | %.2f | %.1f | "
               "%.2f | %.1f |",
               S[s].size, m[F_UB_TTFT], m[F_R_TTFT], m[F_ADDED], m[F_ADDED_SAME], m[F_HOP],
               m[F_R_OWN], m[F_P_LEG], m[F_P_EXTRA], m[F_P_QUEUE], m[F_P_COMPUTE], m[F_UB_QUEUE],
               m[F_UB_COMPUTE]);
        for (int k = 0; k < PH_DECODE; k++) printf(" %.2f |", m[F_R_PH0 + k]);
        printf(" %.1f | %.1f | %.1f | %.1f | %.3f |\n", m[F_R_DEC_TTFB], m[F_R_FIRST],
               m[F_R_FIRST_TOKEN], m[F_R_PREPULL], m[F_R_BYTES] / 1048576.0);
    }
    printf("\n### streaming the KV during the prefill: what it could save here (medians of %u, "
           "ms)\n\n",
           o->runs);
    printf("| size | prefill alone | prefill with a decode leg beside it | slowdown (per round) | "
           "decode leg TTFB alone | its wire alone | wire beside the prefill | decode leg's end "
           "after the prefill's | saving bound (TTFB alone - slowdown) |\n|---|---|---|---|---|---|"
           "---|---|---|\n");
    for (uint32_t s = 0; s < ns; s++) {
        const double *m = S[s].med;
        printf("| %u | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %.1f | **%.1f** |\n", S[s].size,
               m[F_O_ALONE], m[F_O_OVER], m[F_O_SLOW], m[F_D_TTFB], m[F_D_PH0 + PH_WIRE],
               m[F_O_WIRE], m[F_O_END], m[F_O_SAVE]);
    }
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    printf("\nThe same from CPU time: a decode leg (max_tokens 1) alone, the CPU its work took on "
           "each node (every live thread's run time) against its TTFB; a prefill that holds all "
           "%ld CPUs loses at least that CPU / %ld if the leg runs beside it.\n\n",
           cpus, cpus);
    printf("| size | leg TTFB | CPU, prefill node | CPU, decode node | saving bound (TTFB - CPU / "
           "%ld) |\n|---|---|---|---|---|\n",
           cpus);
    for (uint32_t s = 0; s < ns; s++) {
        const double *m = S[s].med;
        printf("| %u | %.1f | %.1f | %.1f | **%.1f** |\n", S[s].size, m[F_O_TTFB], m[F_O_CPU_P],
               m[F_O_CPU_D], m[F_O_SAVE_CPU]);
    }
    if (o->quiet_pairs) {
        printf("\n### after a quiet spell: the first routed request after the staging idle period "
               "+ %d s without requests, and one %d ms later (medians of the pairs, ms)\n\n",
               BL_QUIET_MORE_MS / 1000, BL_QUIET_GAP_MS);
        printf(
            "| size | pairs | quiet s | router TTFT after quiet | %d ms later | wire after quiet "
            "| %d ms later | staging_wait after quiet | %d ms later |\n|---|---|---|---|---|---|"
            "---|---|---|\n",
            BL_QUIET_GAP_MS, BL_QUIET_GAP_MS, BL_QUIET_GAP_MS);
        for (uint32_t s = 0; s < ns; s++) {
            const double(*q)[BQ_N] = S[s].qmed;
            printf("| %u | %u | %.1f | %.1f | %.1f | **%.2f** | %.2f | %.2f | %.2f |\n", S[s].size,
                   S[s].nq, (double)S[s].quiet_ms / 1e3, q[0][BQ_TTFT], q[1][BQ_TTFT],
                   q[0][BQ_WIRE], q[1][BQ_WIRE], q[0][BQ_STAGING_WAIT], q[1][BQ_STAGING_WAIT]);
        }
    }
    printf("\ntarget (routed TTFT): added TTFT <= the KV's wire time + 5 ms\n");
    for (uint32_t s = 0; s < ns; s++) {
        const double *m = S[s].med;
        bool ok = bl_met(m);
        printf("- %s: %u tokens: added %.1f ms %s wire %.2f ms + 5 ms = %.2f ms (with the "
               "prefills' compute difference taken out: %.1f ms)",
               ok ? "met" : "NOT MET", S[s].size, m[F_ADDED], ok ? "<=" : ">", m[F_R_PH0 + PH_WIRE],
               m[F_R_PH0 + PH_WIRE] + 5.0, m[F_ADDED_SAME]);
        if (!ok) {
            char why[512];
            bl_limits(m, why, sizeof(why));
            printf("; limited by %s", why);
        }
        printf("\n");
    }
}

static json_t *bl_num(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

static json_t *bl_figures_json(const double *v, int from, int to)
{
    json_t *j = json_object();
    for (int k = from; k < to; k++) json_object_set_new(j, bl_f_names[k], bl_num(v[k]));
    return j;
}

static json_t *bl_json(const bl_opts_t *o, double cpt, const double load[2], const bl_size_t *S,
                       uint32_t ns)
{
    char cpu[200];
    pkv_prim_cpu_model(cpu, sizeof(cpu));
    json_t *sizes = json_array(), *targets = json_array();
    for (uint32_t s = 0; s < ns; s++) {
        const double *m = S[s].med;
        json_t *rounds = json_array();
        for (uint32_t i = 0; i < S[s].n; i++) {
            double v[BL_NF];
            bl_values(&S[s].rounds[i], v);
            json_array_append_new(rounds,
                                  json_pack("{s:o, s:o, s:o}", "decode_leg",
                                            bl_figures_json(v, F_TOKENS, F_UB_TTFT), "routed_ttft",
                                            bl_figures_json(v, F_UB_TTFT, F_O_ALONE), "streaming",
                                            bl_figures_json(v, F_O_ALONE, BL_NF)));
        }
        /* every routed figure but the two headline ones, which the size carries itself */
        json_t *phases = bl_figures_json(m, F_UB_TTFT, F_O_ALONE);
        json_object_del(phases, "added_ms");
        json_object_del(phases, "wire_ms");
        json_t *quiet = json_null();
        if (S[s].nq) {
            json_t *side[2];
            for (int k = 0; k < 2; k++) {
                side[k] = json_object();
                for (int f = 0; f < BQ_N; f++)
                    json_object_set_new(side[k], bl_q_names[f], bl_num(S[s].qmed[k][f]));
            }
            quiet = json_pack("{s:I, s:i, s:i, s:o, s:o}", "quiet_ms", (json_int_t)S[s].quiet_ms,
                              "gap_ms", BL_QUIET_GAP_MS, "pairs", (int)S[s].nq, "after_quiet",
                              side[0], "after_gap", side[1]);
        }
        json_array_append_new(sizes,
                              json_pack("{s:i, s:f, s:i, s:o, s:o, s:o, s:o, s:o, s:o, s:o}",
                                        "tokens", (int)S[s].size, "prompt_tokens", m[F_TOKENS],
                                        "runs", (int)S[s].n, "added_ms", bl_num(m[F_ADDED]),
                                        "wire_ms", bl_num(m[F_R_PH0 + PH_WIRE]), "phases", phases,
                                        "decode_leg", bl_figures_json(m, F_TOKENS, F_UB_TTFT),
                                        "streaming", bl_figures_json(m, F_O_ALONE, BL_NF), "rounds",
                                        rounds, "after_quiet", quiet));
        char name[64];
        snprintf(name, sizeof(name), "added_ttft_%u_tokens_ms", S[s].size);
        json_array_append_new(
            targets, json_pack("{s:s, s:o, s:o, s:b}", "name", name, "value", bl_num(m[F_ADDED]),
                               "target", bl_num(m[F_R_PH0 + PH_WIRE] + 5.0), "met", bl_met(m)));
    }
    return json_pack("{s:s, s:s, s:s, s:i, s:i, s:f, s:[f,f], s:s, s:o, s:o}", "mode", "latency",
                     "cpu_model", cpu, "preset", o->preset, "runs", (int)o->runs, "max_tokens",
                     BL_MAX_TOKENS, "chars_per_token", cpt, "load_average_1m", load[0], load[1],
                     "statistic", "median over the rounds", "sizes", sizes, "targets", targets);
}

/* ---- options ------------------------------------------------------------------------------ */
static void bl_usage(FILE *f)
{
    fprintf(f,
            "usage: pagekv bench disagg --latency [--runs N] [--sizes LIST] [--preset NAME]\n"
            "                           [--quiet-pairs N] [--json FILE]\n"
            "What disaggregation adds to one request at low load (one request at a time):\n"
            "a unified node, a prefill node, a decode node (per_transfer staging) and\n"
            "pagekv route; per size N rounds of distinct chat prompts, temperature 0,\n"
            "max_tokens %d, ignore_eos. Prints (and writes to --json) the medians of\n"
            "  decode leg:  the decode leg (driven here, X-Pagekv-Timings) minus the unified\n"
            "               node's decode (its total - its TTFT), by phase; bytes pulled with\n"
            "               and without a decode-side prefix hit\n"
            "  routed TTFT: TTFT through the router minus the unified node's, split into the\n"
            "               router's own time (its /metrics) and the nodes' phases; target:\n"
            "               added <= the KV's wire time + 5 ms\n"
            "  streaming:   a prefill alone and with a decode leg (max_tokens 1) beside it:\n"
            "               what streaming the KV during the prefill could save here\n"
            "  after quiet: the first routed request after the staging idle period + 2 s\n"
            "               without requests, and one 0.5 s later: wire, staging_wait, TTFT\n"
            "  --runs N       rounds per size (default 20)\n"
            "  --sizes LIST   prompt tokens, comma-separated (default 512,2048)\n"
            "  --quiet-pairs N  after-quiet pairs per size (default 3; 0: none)\n"
            "  --preset NAME  model preset (default llama-3.2-1b)\n",
            BL_MAX_TOKENS);
}

/* 0, 1 for --help, or 2 after a usage error. */
static int bl_parse(int argc, char **argv, bl_opts_t *o)
{
    *o = (bl_opts_t){
        .runs = 20, .quiet_pairs = 3, .sizes = {512, 2048}, .n_sizes = 2, .preset = "llama-3.2-1b"};
    const char *cmd = "bench disagg --latency";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t n;
        if (!strcmp(a, "--latency")) continue;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bl_usage(stdout);
            return 1;
        }
        if (!v) return pkv_cli_usage_error(cmd, "unknown option or missing value: %s", a);
        if (!strcmp(a, "--runs")) {
            if (pkv_cli_parse_u64(v, 1, 10000, &n))
                return pkv_cli_usage_error(cmd, "--runs: 1..10000, got '%s'", v);
            o->runs = (uint32_t)n;
        } else if (!strcmp(a, "--quiet-pairs")) {
            if (pkv_cli_parse_u64(v, 0, 100, &n))
                return pkv_cli_usage_error(cmd, "--quiet-pairs: 0..100, got '%s'", v);
            o->quiet_pairs = (uint32_t)n;
        } else if (!strcmp(a, "--sizes")) {
            if (pkv_cli_parse_u32_list(v, 16, 32768, o->sizes, BL_MAX_SIZES, &o->n_sizes))
                return pkv_cli_usage_error(
                    cmd, "--sizes: 1..%d comma-separated token counts in 16..32768, got '%s'",
                    BL_MAX_SIZES, v);
        } else if (!strcmp(a, "--preset")) {
            o->preset = v;
        } else if (!strcmp(a, "--json")) {
            o->json_path = v;
        } else {
            return pkv_cli_usage_error(cmd, "unknown option: %s", a);
        }
        i++;
    }
    return 0;
}

/* ---- the run ------------------------------------------------------------------------------ */
static double bl_loadavg(void)
{
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1) l = -1;
        fclose(f);
    }
    return l;
}

/* Every size's rounds; 0 when every round completed. */
static int bl_measure(const bl_ctx_t *c, bl_size_t *S)
{
    const bl_opts_t *o = c->o;
    for (uint32_t s = 0; s < o->n_sizes && !g_stop; s++) {
        S[s].size = o->sizes[s];
        S[s].rounds = calloc(o->runs, sizeof(bl_round_t));
        if (!S[s].rounds) return -1;
        fprintf(stderr, "  size %u: warm-up", S[s].size);
        bl_round_t warm;
        memset(&warm, 0, sizeof(warm));
        if (bl_round(c, S[s].size, o->runs, &warm) != 0) { /* seeds no counted round uses */
            fprintf(stderr, "\npagekv bench disagg: size %u: the warm-up round failed\n",
                    S[s].size);
            return -1;
        }
        for (uint32_t i = 0; i < o->runs && !g_stop; i++) {
            if (bl_round(c, S[s].size, i, &S[s].rounds[S[s].n]) != 0) {
                fprintf(stderr, "\npagekv bench disagg: size %u round %u failed\n", S[s].size, i);
                return -1;
            }
            S[s].n++;
            fprintf(stderr, " %u", i + 1);
        }
        bl_medians(S[s].rounds, S[s].n, S[s].med);
        fprintf(stderr, "; a pull beside a prefill:");
        for (uint32_t i = 0; i < S[s].n && !g_stop; i++) {
            if (bl_overlap(c, S[s].size, i, S[s].med[F_U_TTFT] / 2, &S[s].rounds[i]) != 0) {
                fprintf(stderr, "\npagekv bench disagg: size %u: step 5 of round %u failed\n",
                        S[s].size, i);
                return -1;
            }
            fprintf(stderr, " %u", i + 1);
        }
        bl_medians(S[s].rounds, S[s].n, S[s].med);
        if (o->quiet_pairs) {
            S[s].quiet_ms = bl_quiet_ms(c->dec->url);
            S[s].quiet = calloc(o->quiet_pairs, sizeof(bl_quiet_t));
            if (!S[s].quiet) return -1;
            fprintf(stderr, "; after %.1f s quiet:", (double)S[s].quiet_ms / 1e3);
        }
        for (uint32_t i = 0; i < o->quiet_pairs && !g_stop; i++) {
            if (bl_quiet_pair(c, S[s].size, i, S[s].quiet_ms, &S[s].quiet[S[s].nq]) != 0) {
                fprintf(stderr, "\npagekv bench disagg: size %u: step 6 pair %u failed\n",
                        S[s].size, i);
                return -1;
            }
            S[s].nq++;
            fprintf(stderr, " %u", i + 1);
        }
        if (S[s].nq) bl_quiet_medians(&S[s]);
        fprintf(stderr, "\n");
    }
    return g_stop ? -1 : 0;
}

static int bl_start(const bl_env_t *e, const bl_opts_t *o, launch_proc_t p[4])
{
    uint32_t max = 0;
    for (uint32_t s = 0; s < o->n_sizes; s++)
        if (o->sizes[s] > max) max = o->sizes[s];
    uint32_t ctx = max + max / 4 + 256; /* the prefix-hit prompts are 1.25 x, plus a template */
    if (bl_serve(e, o, NULL, ctx, &p[0]) || bl_serve(e, o, "prefill", ctx, &p[1]) ||
        bl_serve(e, o, "decode", ctx, &p[2]) || bl_route(e, &p[1], &p[2], &p[3]))
        return -1;
    return 0;
}

int pkv_bench_disagg_latency(int argc, char **argv)
{
    bl_opts_t o;
    int prc = bl_parse(argc, argv, &o);
    if (prc) return prc == 1 ? 0 : prc;
    bl_env_t e;
    snprintf(e.logdir, sizeof(e.logdir), "/tmp/pagekv-bench-latency-XXXXXX");
    if (launch_env_init(e.bin, sizeof(e.bin), e.logdir, on_signal)) return 2;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    launch_proc_t p[4];
    memset(p, 0, sizeof(p));
    bl_size_t S[BL_MAX_SIZES];
    memset(S, 0, sizeof(S));
    double load[2] = {bl_loadavg(), -1};
    double cpt = pkv_fp_chars_per_token();
    fprintf(stderr,
            "pagekv bench disagg --latency: %s, %u rounds per size, load %.2f, logs in %s\n",
            o.preset, o.runs, load[0], e.logdir);
    int rc = 0;
    if (bl_start(&e, &o, p) != 0) {
        rc = 1;
        goto out;
    }
    bl_ctx_t c = {.o = &o, .un = &p[0], .pre = &p[1], .dec = &p[2], .rt = &p[3], .cpt = cpt};
    if (bl_measure(&c, S) != 0) rc = g_stop ? 130 : 1;
    load[1] = bl_loadavg();
    if (rc == 0) {
        char cpu[200];
        pkv_prim_cpu_model(cpu, sizeof(cpu));
        printf("pagekv bench disagg --latency: %s, one request at a time, max_tokens %d, "
               "medians of %u; load average (1 min) %.2f at the start, %.2f at the end\nCPU: %s\n",
               o.preset, BL_MAX_TOKENS, o.runs, load[0], load[1], cpu);
        bl_print(&o, S, o.n_sizes);
        if (o.json_path) {
            json_t *j = bl_json(&o, cpt, load, S, o.n_sizes);
            if (pkv_bench_write_json(o.json_path, j) != 0) rc = 1;
            json_decref(j);
        }
    }
out:
    for (int k = 3; k >= 0; k--) {
        int ec = launch_stop(&p[k], SIGTERM, pkv_now_ns() + BL_STOP_NS);
        if (p[k].name[0] && ec != 0) {
            fprintf(stderr, "pagekv bench disagg: %s exited %d (log %s)\n", p[k].name, ec,
                    p[k].log);
            if (!rc) rc = 1;
        }
    }
    for (uint32_t s = 0; s < BL_MAX_SIZES; s++) {
        free(S[s].rounds);
        free(S[s].quiet);
    }
    curl_global_cleanup();
    if (g_stop) fprintf(stderr, "pagekv bench disagg: interrupted\n");
    fprintf(stderr, "logs: %s\n", e.logdir);
    return rc;
}
