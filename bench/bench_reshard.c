/*
 * `pagekv bench reshard`: prefill and decode nodes of different tensor parallelism, per-plan
 * staging against the field's host mirror, through `pagekv route` (docs/design/reshard.md,
 * "Benchmark").
 *
 * Per pair P -> D, both designs at once: each a fresh `pagekv serve --role prefill --tp P`,
 * `--role decode --tp D` (each a 2 GiB KV pool) and `pagekv route`; waves of concurrent
 * streamed chat requests over a mix of prompt lengths, each wave sent to one design and then
 * to the other, each request with X-Pagekv-Timings so the decode leg's transfer phases come
 * back in the answer; a sampler thread per design reads each node's VmLck and VmRSS from
 * /proc and its per-rank staging from /v1/cache/stats every 100 ms. A unified TP=1 node
 * answers the first requests of every pair for parity. The planner
 * (src/plan) predicts each design's host staging per node from the same geometry and load.
 */
#include "bench/bench_disagg.h"
#include "support/bench.h"
#include "support/cli.h"
#include "support/cluster.h"
#include "support/filler.h"
#include "support/footprint.h"
#include "support/http.h"
#include "support/launch.h"
#include "support/loadgen.h"
#include "tools/commands.h"

#include "pagekv/kv.h"
#include "pagekv/model.h"

#include "core/core.h"
#include "plan/plan.h"
#include "prim/prim.h"

#include <curl/curl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BR_MIB       (1024.0 * 1024.0)
#define BR_MAX_PAIRS 16
#define BR_PARITY    4
#define BR_CONTEXT   4096
#define BR_PAGE_TOK  64 /* a staging page: 64 tokens of one rank's heads */
#define BR_MAX_WAVES 64 /* --waves */
/* A wave's requests arrive this far apart, in a fixed order: the prefill engine admits in
 * arrival order, so both designs see the same schedule (all at once, the order would be
 * whichever connection the kernel delivered first, and a request's TTFT with it). */
#define BR_STAGGER_S 0.02

static const uint32_t br_mix[] = {256, 512, 1024, 2048};
enum { BR_PER_PLAN, BR_MIRROR, BR_ND };
static const char *const br_design_names[BR_ND] = {"per_plan", "mirror"};

static volatile sig_atomic_t br_stop;
static void on_signal(int sig)
{
    (void)sig;
    br_stop = 1;
}

typedef struct {
    uint32_t p[BR_MAX_PAIRS], d[BR_MAX_PAIRS], n_pairs;
    bool design[BR_ND];
    uint32_t waves, concurrency; /* a wave: `concurrency` requests at once */
    const char *preset, *json_path, *pool;
} br_opts_t;

typedef struct {
    char bin[4096], logdir[64];
    double cpt;
    uint32_t kv_heads;
    uint64_t token_bytes; /* all heads */
} br_env_t;

/* What the sampler keeps of one node. */
typedef struct {
    const launch_proc_t *proc;
    double lck_peak, res_peak, fly_peak;
    double rank_pin_peak[PKV_KV_MAX_TP];
    uint32_t tp;
    /* from the stages' own high-water marks at the end (exact, not sampled): the worst
     * rank's resident peak / pages-in-use peak */
    double res_over_fly;
} br_node_t;

typedef struct {
    br_node_t node[2]; /* prefill, decode */
    pthread_mutex_t lock;
    pthread_t th;
    atomic_int stop;
} br_sampler_t;

static void br_sample_node(br_sampler_t *s, br_node_t *n)
{
    pkv_prim_mem_t m;
    bool mem = n->proc->pid > 0 && pkv_prim_mem_read(n->proc->pid, &m) == PKV_OK;
    json_t *st = http_get_json(n->proc->url, "/v1/cache/stats", 2000);
    json_t *kvt = json_object_get(st, "kv_transfer");
    long long page = cluster_json_int(kvt, "staging.page_bytes");
    long long held = cluster_json_int(kvt, "staging.pages_held_by_transfers");
    long long res = cluster_json_int(kvt, "staging.resident_bytes");
    json_t *ranks = json_object_get(kvt, "ranks");
    pthread_mutex_lock(&s->lock);
    if (mem) n->lck_peak = PKV_MAX(n->lck_peak, (double)m.locked_bytes);
    if (res > 0) n->res_peak = PKV_MAX(n->res_peak, (double)res);
    if (page > 0 && held > 0) n->fly_peak = PKV_MAX(n->fly_peak, (double)(page * held));
    n->tp = (uint32_t)json_array_size(ranks);
    for (size_t r = 0; r < json_array_size(ranks) && r < PKV_KV_MAX_TP; r++) {
        json_t *rk = json_array_get(ranks, r);
        long long pin = cluster_json_int(rk, "staging.pinned_bytes");
        if (pin > 0) n->rank_pin_peak[r] = PKV_MAX(n->rank_pin_peak[r], (double)pin);
    }
    pthread_mutex_unlock(&s->lock);
    json_decref(st);
}

/* The stages' peaks once the load is over. */
static void br_node_peaks(br_node_t *n)
{
    json_t *st = http_get_json(n->proc->url, "/v1/cache/stats", 5000);
    json_t *kvt = json_object_get(st, "kv_transfer");
    long long page = cluster_json_int(kvt, "staging.page_bytes");
    json_t *ranks = json_object_get(kvt, "ranks");
    n->res_over_fly = 0;
    for (size_t r = 0; page > 0 && r < json_array_size(ranks); r++) {
        json_t *rk = json_array_get(ranks, r);
        double used = (double)cluster_json_int(rk, "staging.pages_peak_used") * (double)page;
        double res = (double)cluster_json_int(rk, "staging.resident_peak_bytes");
        if (used > 0) n->res_over_fly = PKV_MAX(n->res_over_fly, res / used);
    }
    json_decref(st);
}

static void *br_sampler_main(void *arg)
{
    br_sampler_t *s = arg;
    while (!atomic_load(&s->stop)) {
        for (int k = 0; k < 2; k++) br_sample_node(s, &s->node[k]);
        usleep(100000);
    }
    for (int k = 0; k < 2; k++) br_sample_node(s, &s->node[k]);
    return NULL;
}

/* ---- the load -------------------------------------------------------------------------- */

/* The transfer phases (handshake + staging wait + wire + commit) a streamed answer's
 * pagekv_timings carry in its last chunk, in ms; 0 when absent. */
static double br_transfer_ms(const char *body)
{
    const char *line = body ? strstr(body, "\"pagekv_timings\"") : NULL;
    while (line && line > body && line[-1] != '\n') line--;
    if (!line || strncmp(line, "data: ", 6)) return 0;
    const char *end = strchr(line, '\n');
    json_t *ev = json_loadb(line + 6, end ? (size_t)(end - line - 6) : strlen(line + 6), 0, NULL);
    json_t *ph = json_object_get(json_object_get(ev, "pagekv_timings"), "phases_seconds");
    static const char *const names[] = {"handshake", "staging_wait", "wire", "commit"};
    double sum = 0;
    for (size_t i = 0; i < 4; i++) {
        json_t *v = json_object_get(ph, names[i]);
        if (json_is_number(v)) sum += json_number_value(v);
    }
    json_decref(ev);
    return sum * 1e3;
}

/* Streamed chat requests at temperature 0 over the mix's prompt lengths in turn. */
static void br_reqs_make(const br_opts_t *o, const br_env_t *e, lg_req_t *reqs, uint32_t n,
                         uint64_t seed0)
{
    for (uint32_t i = 0; i < n; i++) {
        char *text = pkv_filler_alloc((size_t)(br_mix[i % 4] * e->cpt), seed0 + i, 1);
        json_t *body =
            json_pack("{s:s, s:[{s:s, s:s}], s:i, s:f, s:b, s:{s:b}}", "model", o->preset,
                      "messages", "role", "user", "content", text ? text : "", "max_tokens", 8,
                      "temperature", 0.0, "stream", 1, "stream_options", "include_usage", 1);
        reqs[i] = (lg_req_t){.path = "/v1/chat/completions",
                             .body = json_dumps(body, JSON_COMPACT),
                             .stream = true,
                             .at_s = (i % o->concurrency) * BR_STAGGER_S};
        json_decref(body);
        free(text);
    }
}

/* Median over the answered requests of the TTFT, or of the transfer time where there is one. */
static double br_p50(const lg_result_t *q, uint32_t n, bool transfer)
{
    double *v = malloc((n ? n : 1) * sizeof(*v)), m = 0;
    uint32_t k = 0;
    for (uint32_t i = 0; v && i < n; i++) {
        if (q[i].status != 200) continue;
        double x = transfer ? br_transfer_ms(q[i].body) : q[i].ttft_s * 1e3;
        if (!transfer || x > 0) v[k++] = x;
    }
    if (k) m = pkv_bench_median(v, k);
    free(v);
    return m;
}

/* ---- one pair: both designs side by side -------------------------------------------- */

typedef struct {
    uint32_t p, d;
    int design;
    bool ok;
    br_node_t node[2];
    uint64_t bytes_moved;
    double transfer_p50, ttft_p50;
    uint32_t requests, parity_n, parity_same, failed;
    double plan_bytes[2]; /* the planner's host staging per node for this design */
    double plan_tail[2];  /* per-transfer tail of the same load */
    double plan_peak[2];  /* the planner's peak: the mirror, or per-plan's tail */
    double ttft_paired;   /* per_plan: median over prompts of its TTFT / the mirror's */
    uint64_t pulls_peak;  /* the decode node's pulls in flight at their peak (exact) */
    uint64_t staging_transfers_peak[2]; /* per node: transfers holding staging at once */
    pkv_bd_mix_t mix;  /* the prompts served, by real token count, for the planner */
    json_t *phases;    /* {"prefill", "decode"}: each node's mean ms per phase over the load */
    json_t *waves_doc; /* [each wave's {"ttft_ms_p50", "transfer_ms_p50"}] */
} br_result_t;

/* One design's processes and measurements while its pair runs. */
typedef struct {
    br_result_t *r;
    launch_proc_t pre, dec, rt;
    br_sampler_t s;
    bool sampling;
    lg_result_t *res; /* every request of every wave */
    uint64_t b0;
    json_t *ph0[2];
} br_set_t;

static int br_node_start(const br_opts_t *o, const br_env_t *e, const char *name, const char *role,
                         uint32_t tp, int design, launch_proc_t *p)
{
    char tps[16], page[32];
    snprintf(tps, sizeof(tps), "%u", tp);
    /* a page is 64 tokens of one rank's heads (4 KiB multiple) */
    uint64_t heads = tp <= e->kv_heads ? e->kv_heads / tp : 1;
    uint64_t pb = PKV_ALIGN_UP(e->token_bytes / e->kv_heads * heads * BR_PAGE_TOK, 4096);
    snprintf(page, sizeof(page), "%llu", (unsigned long long)pb);
    char *extra[] = {"--tp",
                     tps,
                     "--kv-cache-budget",
                     (char *)o->pool,
                     "--kv-dtype",
                     "bf16",
                     "--staging-page-bytes",
                     page,
                     "--staging",
                     design == BR_MIRROR ? "mirror" : "per_transfer",
                     "--prefix-cache-max-bytes",
                     "64M",
                     "--max-connections",
                     "256",
                     NULL};
    return launch_serve(e->bin, e->logdir, name, o->preset, BR_CONTEXT, role, extra, false, NULL,
                        p);
}

/* A counter of a node's kv_transfer stats (0 when absent). */
static uint64_t br_node_stat(const launch_proc_t *node, const char *path)
{
    json_t *st = http_get_json(node->url, "/v1/cache/stats", 5000);
    long long b = cluster_json_int(st, path);
    json_decref(st);
    return b > 0 ? (uint64_t)b : 0;
}

/* The planner's figure for this design, per node (host = the node's ranks). */
static void br_plan(const br_opts_t *o, br_result_t *r)
{
    pkv_plan_input_t in;
    memset(&in, 0, sizeof(in));
    if (pkv_plan_preset(o->preset, &in)) return;
    in.prefill_tp = r->p;
    in.decode_tp = r->d;
    in.page_tokens = BR_PAGE_TOK;
    in.context = BR_CONTEXT;
    in.concurrency = o->concurrency;
    pkv_bd_mix_plan(&r->mix, BR_CONTEXT, &in); /* every prompt served, by real token count */
    /* the lengths come mixed in one stream: at an instant a long transfer is the more
       likely to be in flight (its pull lasts longer), so the draw weighs each by its pages
       (disagg's phases each send one length: there the mix stays one of transfers) */
    in.mix_of_requests = true;
    in.in_flight_set = true;
    uint64_t pool = 0;
    pkv_cli_parse_bytes(o->pool, &pool);
    pkv_plan_t pl;
    for (int k = 0; k < 2; k++) {
        uint32_t tp = k ? r->d : r->p;
        /* the transfers in flight at once: the node's stages' exact high-water of transfers
           holding pages, where a stage counts each read: a decode rank reads each transfer
           from every prefill rank whose heads it needs (P / D of them when P > D), a prefill
           rank serves every decode rank that needs its heads (D / P when D > P) */
        uint64_t reads = k ? (r->p > r->d ? r->p / r->d : 1) : (r->d > r->p ? r->d / r->p : 1);
        in.in_flight = PKV_MAX(r->staging_transfers_peak[k] / reads, 1);
        in.device_pool_bytes = pool / tp;
        if (pkv_plan_compute(&in, &pl)) return;
        const pkv_plan_side_t *sd = k ? &pl.decode : &pl.prefill;
        r->plan_bytes[k] =
            (double)(r->design == BR_MIRROR ? sd->host.mirror_bytes : sd->host.per_plan_bytes);
        r->plan_tail[k] = (double)sd->host.per_transfer_tail_bytes;
        /* a run's peak is a maximum over its transfers: the tail at the peak count (the
           longest transfer when one is in flight), not the mean */
        r->plan_peak[k] = r->design == BR_MIRROR ? r->plan_bytes[k] : r->plan_tail[k];
    }
}

static int br_set_start(const br_opts_t *o, const br_env_t *e, br_set_t *st)
{
    br_result_t *r = st->r;
    char pn[32], dn[32], rn[32];
    snprintf(pn, sizeof(pn), "prefill-%u-%u-%s", r->p, r->d, br_design_names[r->design]);
    snprintf(dn, sizeof(dn), "decode-%u-%u-%s", r->p, r->d, br_design_names[r->design]);
    snprintf(rn, sizeof(rn), "router-%u-%u-%s", r->p, r->d, br_design_names[r->design]);
    fprintf(stderr, "pagekv bench reshard: %u -> %u %s: starting\n", r->p, r->d,
            br_design_names[r->design]);
    if (br_node_start(o, e, pn, "prefill", r->p, r->design, &st->pre) ||
        br_node_start(o, e, dn, "decode", r->d, r->design, &st->dec) ||
        launch_route(e->bin, e->logdir, rn, &st->pre, &st->dec, NULL, &st->rt))
        return -1;
    st->res = calloc((size_t)o->waves * o->concurrency, sizeof(*st->res));
    return st->res ? 0 : -1;
}

static void br_set_begin(br_set_t *st)
{
    st->s = (br_sampler_t){.node = {{.proc = &st->pre}, {.proc = &st->dec}}};
    pthread_mutex_init(&st->s.lock, NULL);
    pthread_create(&st->s.th, NULL, br_sampler_main, &st->s);
    st->sampling = true;
    st->b0 = br_node_stat(&st->dec, "kv_transfer.transfers.bytes_received");
    st->ph0[0] = cluster_phase_sums(st->pre.url);
    st->ph0[1] = cluster_phase_sums(st->dec.url);
}

static void br_set_sampler_join(br_set_t *st)
{
    if (!st->sampling) return;
    atomic_store(&st->s.stop, 1);
    pthread_join(st->s.th, NULL);
    pthread_mutex_destroy(&st->s.lock);
    st->sampling = false;
}

/* After the last wave: the nodes' counters, peaks and phase means, the requests' figures. */
static void br_set_end(const br_opts_t *o, br_set_t *st)
{
    br_result_t *r = st->r;
    uint32_t n = o->waves * o->concurrency;
    json_t *ph1[2] = {cluster_phase_sums(st->pre.url), cluster_phase_sums(st->dec.url)};
    if (st->ph0[0] && st->ph0[1] && ph1[0] && ph1[1]) {
        r->phases = json_pack("{s:o, s:o}", "prefill", cluster_phase_means(st->ph0[0], ph1[0]),
                              "decode", cluster_phase_means(st->ph0[1], ph1[1]));
        char *txt = json_dumps(r->phases, JSON_COMPACT | JSON_REAL_PRECISION(4));
        fprintf(stderr, "    %u -> %u %s phases, mean ms: %s\n", r->p, r->d,
                br_design_names[r->design], txt ? txt : "");
        free(txt);
    }
    for (int k = 0; k < 2; k++) json_decref(st->ph0[k]), json_decref(ph1[k]);
    r->bytes_moved = br_node_stat(&st->dec, "kv_transfer.transfers.bytes_received") - st->b0;
    r->pulls_peak = br_node_stat(&st->dec, "kv_transfer.pulls.inflight_peak");
    r->staging_transfers_peak[0] = br_node_stat(&st->pre, "kv_transfer.staging.transfers_peak");
    r->staging_transfers_peak[1] = br_node_stat(&st->dec, "kv_transfer.staging.transfers_peak");
    br_set_sampler_join(st);
    memcpy(r->node, st->s.node, sizeof(r->node));
    for (int k = 0; k < 2; k++) br_node_peaks(&r->node[k]);
    r->requests = n;
    for (uint32_t i = 0; i < n; i++) {
        if (st->res[i].status == 200) {
            pkv_bd_mix_add(&r->mix, st->res[i].answer.prompt_tokens);
            continue;
        }
        if (!r->failed++) /* the first failure's reason, once per design */
            fprintf(stderr, "    %s request %u failed: status %ld %s%s\n",
                    br_design_names[r->design], i, st->res[i].status, st->res[i].transport,
                    st->res[i].excerpt);
    }
    r->ttft_p50 = br_p50(st->res, n, false);
    r->transfer_p50 = br_p50(st->res, n, true);
}

static void br_set_stop(const br_opts_t *o, br_set_t *st)
{
    br_set_sampler_join(st);
    if (st->res) lg_results_free(st->res, (size_t)o->waves * o->concurrency);
    free(st->res);
    launch_stop(&st->rt, SIGTERM, pkv_deadline_after_ns(30000000000ull));
    launch_stop(&st->dec, SIGTERM, pkv_deadline_after_ns(30000000000ull));
    launch_stop(&st->pre, SIGTERM, pkv_deadline_after_ns(30000000000ull));
}

/* One pair: every design's nodes up at once, then waves of `concurrency` requests, each
 * wave's prompts sent to one design and then the same prompts to the other, the order
 * alternating (per_plan, mirror, then mirror, per_plan, ...), so the machine's drift falls
 * on both designs alike; the other design's nodes idle while a wave runs. */
static void br_pair(const br_opts_t *o, const br_env_t *e, const launch_proc_t *uni,
                    br_result_t *out[BR_ND])
{
    br_set_t set[BR_ND];
    memset(set, 0, sizeof(set));
    uint32_t n = o->waves * o->concurrency, p = 0, d = 0;
    lg_req_t *reqs = calloc(n, sizeof(*reqs));
    bool up = reqs != NULL;
    for (int k = 0; k < BR_ND; k++) {
        set[k].r = out[k];
        if (out[k]) p = out[k]->p, d = out[k]->d;
        if (up && out[k] && br_set_start(o, e, &set[k])) up = false;
    }
    if (!up) goto out;
    br_reqs_make(o, e, reqs, n, 1000 * (uint64_t)(p * 100 + d));
    static const char *const hdr[] = {"X-Pagekv-Timings: 1", NULL};
    for (int k = 0; k < BR_ND; k++)
        if (out[k]) br_set_begin(&set[k]);
    for (uint32_t w = 0; w < o->waves && !br_stop; w++)
        for (int k = 0; k < BR_ND && !br_stop; k++) {
            int dz = w % 2 ? BR_ND - 1 - k : k;
            if (!out[dz]) continue;
            lg_config_t lc = {.base_url = set[dz].rt.url,
                              .concurrency = 0, /* open loop: at_s */
                              .timeout_ms = 120000,
                              .headers = hdr,
                              .stop = &br_stop,
                              .keep_body = true};
            lg_result_t *q = set[dz].res + (size_t)w * o->concurrency;
            lg_run(&lc, reqs + (size_t)w * o->concurrency, o->concurrency, q);
            if (!out[dz]->waves_doc) out[dz]->waves_doc = json_array();
            json_array_append_new(out[dz]->waves_doc,
                                  json_pack("{s:f, s:f}", "ttft_ms_p50",
                                            br_p50(q, o->concurrency, false), "transfer_ms_p50",
                                            br_p50(q, o->concurrency, true)));
        }
    for (int k = 0; k < BR_ND; k++)
        if (out[k]) br_set_end(o, &set[k]);
    if (out[BR_PER_PLAN] && out[BR_MIRROR]) { /* the same prompt, the same place in its wave */
        double *v = malloc(n * sizeof(*v));
        uint32_t m = 0;
        for (uint32_t i = 0; v && i < n; i++) {
            const lg_result_t *a = &set[BR_PER_PLAN].res[i], *b = &set[BR_MIRROR].res[i];
            if (a->status == 200 && b->status == 200 && b->ttft_s > 0)
                v[m++] = a->ttft_s / b->ttft_s;
        }
        out[BR_PER_PLAN]->ttft_paired = m ? pkv_bench_median(v, m) : 0;
        free(v);
    }
    /* parity: the first requests again on the unified TP=1 node */
    lg_config_t uc = {
        .base_url = uni->url, .concurrency = 1, .timeout_ms = 120000, .stop = &br_stop};
    uint32_t np = PKV_MIN(BR_PARITY, n);
    lg_result_t ures[BR_PARITY];
    lg_run(&uc, reqs, np, ures);
    for (int k = 0; k < BR_ND; k++) {
        if (!out[k]) continue;
        for (uint32_t i = 0; i < np; i++) {
            if (ures[i].status != 200) continue;
            out[k]->parity_n++;
            out[k]->parity_same += set[k].res[i].status == 200 &&
                                   cluster_answer_equal(&set[k].res[i].answer, &ures[i].answer);
        }
        out[k]->ok = !br_stop;
    }
    lg_results_free(ures, np);
out:
    for (int k = 0; k < BR_ND; k++)
        if (out[k]) br_set_stop(o, &set[k]);
    for (uint32_t i = 0; reqs && i < n; i++) free(reqs[i].body);
    free(reqs);
}

/* ---- options and output ------------------------------------------------------------------ */

static void br_usage(FILE *f)
{
    fprintf(f,
            "usage: pagekv bench reshard [options]\n"
            "  --pairs P:D,...     prefill -> decode TP pairs (default "
            "2:2,8:8,1:2,2:1,4:2,2:4,8:1,1:8)\n"
            "  --designs LIST      per_plan,mirror (default both)\n"
            "  --waves N           waves of requests per pair (default 6); each wave's prompts go\n"
            "                      to both designs, alternating which goes first\n"
            "  --concurrency N     requests per wave, sent at once (default 6)\n"
            "  --pool BYTES        each node's KV pool (default 2G: the mirror pins it whole)\n"
            "  --preset NAME       model preset (default llama-3.2-1b)\n"
            "  --quick             pairs 1:2,2:1, 2 waves of 4 (a smoke test)\n"
            "  --json FILE         write the figures as JSON\n");
}

static int br_parse_pairs(const char *v, br_opts_t *o)
{
    o->n_pairs = 0;
    const char *s = v;
    while (*s) {
        char *end;
        unsigned long p = strtoul(s, &end, 10);
        if (end == s || *end != ':') return -1;
        s = end + 1;
        unsigned long d = strtoul(s, &end, 10);
        if (end == s || (*end && *end != ',') || !p || !d || p > PKV_KV_MAX_TP ||
            d > PKV_KV_MAX_TP || o->n_pairs == BR_MAX_PAIRS)
            return -1;
        o->p[o->n_pairs] = (uint32_t)p;
        o->d[o->n_pairs++] = (uint32_t)d;
        s = *end ? end + 1 : end;
    }
    return o->n_pairs ? 0 : -1;
}

static int br_parse(int argc, char **argv, br_opts_t *o)
{
    *o = (br_opts_t){.waves = 6, .concurrency = 6, .preset = "llama-3.2-1b", .pool = "2G"};
    br_parse_pairs("2:2,8:8,1:2,2:1,4:2,2:4,8:1,1:8", o);
    o->design[BR_PER_PLAN] = o->design[BR_MIRROR] = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t x;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            br_usage(stdout);
            return 1;
        } else if (!strcmp(a, "--quick")) {
            br_parse_pairs("1:2,2:1", o);
            o->waves = 2;
            o->concurrency = 4;
            continue;
        }
        if (!v) {
            fprintf(stderr, "pagekv bench reshard: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--pairs")) {
            if (br_parse_pairs(v, o)) {
                fprintf(stderr, "pagekv bench reshard: --pairs wants P:D,... (1..64), got '%s'\n",
                        v);
                return 2;
            }
        } else if (!strcmp(a, "--designs")) {
            o->design[BR_PER_PLAN] = strstr(v, "per_plan") != NULL;
            o->design[BR_MIRROR] = strstr(v, "mirror") != NULL;
            if (!o->design[BR_PER_PLAN] && !o->design[BR_MIRROR]) {
                fprintf(stderr, "pagekv bench reshard: --designs wants per_plan,mirror\n");
                return 2;
            }
        } else if (!strcmp(a, "--waves") && !pkv_cli_parse_u64(v, 1, BR_MAX_WAVES, &x)) {
            o->waves = (uint32_t)x;
        } else if (!strcmp(a, "--concurrency") && !pkv_cli_parse_u64(v, 1, 64, &x)) {
            o->concurrency = (uint32_t)x;
        } else if (!strcmp(a, "--pool") && !pkv_cli_parse_bytes(v, &x) && x >= (64u << 20)) {
            o->pool = v;
        } else if (!strcmp(a, "--preset")) {
            o->preset = v;
        } else if (!strcmp(a, "--json")) {
            o->json_path = v;
        } else {
            fprintf(stderr, "pagekv bench reshard: bad option %s %s\n", a, v);
            br_usage(stderr);
            return 2;
        }
    }
    return 0;
}

static json_t *br_json(const br_opts_t *o, const br_result_t *res, uint32_t n)
{
    json_t *pairs = json_array();
    for (uint32_t i = 0; i < n; i++) {
        const br_result_t *r = &res[i];
        json_t *pr[2];
        for (int k = 0; k < 2; k++) {
            pr[k] = json_array();
            for (uint32_t q = 0; q < r->node[k].tp; q++)
                json_array_append_new(pr[k], json_integer((json_int_t)r->node[k].rank_pin_peak[q]));
        }
        json_t *pj = json_pack(
            "{s:i, s:i, s:s, s:b, s:{s:I, s:I}, s:{s:o, s:o}, s:{s:I, s:I}, s:{s:I, s:I}, s:I, "
            "s:f, s:f, s:{s:i, s:i}, s:i, s:i}",
            "p", (int)r->p, "d", (int)r->d, "design", br_design_names[r->design], "ok", r->ok,
            "pinned_peak_bytes", "prefill", (json_int_t)r->node[0].lck_peak, "decode",
            (json_int_t)r->node[1].lck_peak, "pinned_peak_bytes_per_rank", "prefill", pr[0],
            "decode", pr[1], "resident_peak_bytes", "prefill", (json_int_t)r->node[0].res_peak,
            "decode", (json_int_t)r->node[1].res_peak, "inflight_peak_bytes", "prefill",
            (json_int_t)r->node[0].fly_peak, "decode", (json_int_t)r->node[1].fly_peak,
            "bytes_moved", (json_int_t)r->bytes_moved, "transfer_ms_p50", r->transfer_p50,
            "ttft_ms_p50", r->ttft_p50, "parity", "requests", (int)r->parity_n, "identical",
            (int)r->parity_same, "requests", (int)r->requests, "failed", (int)r->failed);
        json_object_set_new(pj, "planned_bytes",
                            json_pack("{s:I, s:I}", "prefill", (json_int_t)r->plan_bytes[0],
                                      "decode", (json_int_t)r->plan_bytes[1]));
        json_object_set_new(pj, "planned_tail_bytes",
                            json_pack("{s:I, s:I}", "prefill", (json_int_t)r->plan_tail[0],
                                      "decode", (json_int_t)r->plan_tail[1]));
        json_object_set_new(pj, "planned_peak_bytes",
                            json_pack("{s:I, s:I}", "prefill", (json_int_t)r->plan_peak[0],
                                      "decode", (json_int_t)r->plan_peak[1]));
        if (r->design == BR_PER_PLAN)
            json_object_set_new(pj, "ttft_paired_over_mirror", json_real(r->ttft_paired));
        json_object_set_new(pj, "transfers_inflight_peak", json_integer((json_int_t)r->pulls_peak));
        json_object_set_new(pj, "staging_transfers_peak",
                            json_pack("{s:I, s:I}", "prefill",
                                      (json_int_t)r->staging_transfers_peak[0], "decode",
                                      (json_int_t)r->staging_transfers_peak[1]));
        json_object_set_new(pj, "resident_over_inuse_rank_max",
                            json_pack("{s:f, s:f}", "prefill", r->node[0].res_over_fly, "decode",
                                      r->node[1].res_over_fly));
        if (r->waves_doc) json_object_set(pj, "waves", r->waves_doc);
        if (r->phases) json_object_set(pj, "phase_means_ms", r->phases);
        json_array_append_new(pairs, pj);
    }
    return json_pack("{s:s, s:s, s:i, s:i, s:o}", "preset", o->preset, "pool", o->pool, "waves",
                     (int)o->waves, "concurrency", (int)o->concurrency, "pairs", pairs);
}

static void br_table(const br_result_t *res, uint32_t n)
{
    printf("\n| P -> D | design | pinned MiB (OS) prefill / decode | resident peak / in-flight "
           "peak MiB, decode | transfers holding staging, peak, prefill / decode | planned MiB "
           "prefill / decode (per-plan: "
           "mean, tail) | moved MiB | transfer p50 ms | TTFT p50 ms | failed | parity "
           "|\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (uint32_t i = 0; i < n; i++) {
        const br_result_t *r = &res[i];
        char tail[48] = "";
        if (r->design == BR_PER_PLAN)
            snprintf(tail, sizeof(tail), " (tail %.1f / %.1f)", r->plan_tail[0] / BR_MIB,
                     r->plan_tail[1] / BR_MIB);
        printf("| %u -> %u | %s | %.1f / %.1f | %.1f / %.1f | %llu / %llu | %.1f / %.1f%s | %.1f | "
               "%.1f | "
               "%.1f | %u | %u/%u |\n",
               r->p, r->d, br_design_names[r->design], r->node[0].lck_peak / BR_MIB,
               r->node[1].lck_peak / BR_MIB, r->node[1].res_peak / BR_MIB,
               r->node[1].fly_peak / BR_MIB, (unsigned long long)r->staging_transfers_peak[0],
               (unsigned long long)r->staging_transfers_peak[1], r->plan_bytes[0] / BR_MIB,
               r->plan_bytes[1] / BR_MIB, tail, (double)r->bytes_moved / BR_MIB, r->transfer_p50,
               r->ttft_p50, r->failed, r->parity_same, r->parity_n);
    }
    /* per pair: the ratios the targets name */
    printf("\n| P -> D | mirror / per-plan pins (decode) | TTFT per-plan / mirror (medians) | "
           "TTFT per-plan / mirror, paired: median over prompts (the target) | "
           "per-plan resident / in-use peak, worst rank, prefill / decode | "
           "planner / pinned, per-plan (tail), prefill / decode | "
           "planner / pinned, mirror, prefill / decode |\n"
           "|---|---:|---:|---:|---:|---:|---:|\n");
    for (uint32_t i = 0; i < n; i++) {
        if (res[i].design != BR_PER_PLAN) continue;
        for (uint32_t j = 0; j < n; j++) {
            const br_result_t *a = &res[i], *b = &res[j];
            if (b->design != BR_MIRROR || b->p != a->p || b->d != a->d) continue;
            double pins = a->node[1].lck_peak > 0 ? b->node[1].lck_peak / a->node[1].lck_peak : 0;
            double tt = b->ttft_p50 > 0 ? a->ttft_p50 / b->ttft_p50 : 0;
            double q[4];
            for (int k = 0; k < 2; k++) {
                q[k] = a->node[k].lck_peak > 0 ? a->plan_peak[k] / a->node[k].lck_peak : 0;
                q[2 + k] = b->node[k].lck_peak > 0 ? b->plan_peak[k] / b->node[k].lck_peak : 0;
            }
            printf("| %u -> %u | %.1fx | %.3f | %.3f | %.3f / %.3f | %.3f / %.3f | %.3f / %.3f "
                   "|\n",
                   a->p, a->d, pins, tt, a->ttft_paired, a->node[0].res_over_fly,
                   a->node[1].res_over_fly, q[0], q[1], q[2], q[3]);
        }
    }
}

int pkv_bench_reshard(int argc, char **argv)
{
    br_opts_t o;
    int prc = br_parse(argc, argv, &o);
    if (prc) return prc == 1 ? 0 : prc;
    br_env_t e;
    pkv_model_config_t mc;
    if (pkv_model_preset(o.preset, &mc)) {
        fprintf(stderr, "pagekv bench reshard: unknown preset '%s'\n", o.preset);
        return 2;
    }
    e.kv_heads = mc.n_kv_heads;
    e.token_bytes = 2ull * mc.n_layers * mc.n_kv_heads * mc.head_dim * 2; /* bf16 */
    for (uint32_t i = 0; i < o.n_pairs; i++) {
        char why[128];
        if (pkv_kv_tp_check(e.kv_heads, o.p[i], why, sizeof(why)) ||
            pkv_kv_tp_check(e.kv_heads, o.d[i], why, sizeof(why))) {
            fprintf(stderr, "pagekv bench reshard: pair %u:%u: %s\n", o.p[i], o.d[i], why);
            return 2;
        }
    }
    e.cpt = pkv_fp_chars_per_token();
    snprintf(e.logdir, sizeof(e.logdir), "/tmp/pagekv-bench-reshard-XXXXXX");
    if (launch_env_init(e.bin, sizeof(e.bin), e.logdir, on_signal)) return 2;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    fprintf(stderr,
            "pagekv bench reshard: %s, pool %s per node, %u waves of %u requests per pair, prompts "
            "256/512/1024/2048 tokens, logs in %s\n",
            o.preset, o.pool, o.waves, o.concurrency, e.logdir);
    launch_proc_t uni = {0};
    char *ux[] = {"--kv-dtype", "bf16", NULL};
    if (launch_serve(e.bin, e.logdir, "unified", o.preset, BR_CONTEXT, NULL, ux, false, NULL, &uni))
        return 1;
    br_result_t res[BR_MAX_PAIRS * BR_ND];
    uint32_t n = 0;
    for (uint32_t i = 0; i < o.n_pairs && !br_stop; i++) {
        br_result_t *at[BR_ND] = {0};
        for (int d = 0; d < BR_ND; d++) {
            if (!o.design[d]) continue;
            at[d] = &res[n++];
            *at[d] = (br_result_t){.p = o.p[i], .d = o.d[i], .design = d};
        }
        br_pair(&o, &e, &uni, at);
        for (int d = 0; d < BR_ND; d++)
            if (at[d]) br_plan(&o, at[d]);
    }
    launch_stop(&uni, SIGTERM, pkv_deadline_after_ns(30000000000ull));
    br_table(res, n);
    int rc = br_stop ? 130 : 0;
    for (uint32_t i = 0; i < n; i++)
        if (!res[i].ok || res[i].failed || res[i].parity_same != res[i].parity_n) rc = rc ? rc : 1;
    if (o.json_path) {
        json_t *doc = br_json(&o, res, n);
        if (pkv_bench_write_json(o.json_path, doc)) rc = rc ? rc : 1;
        json_decref(doc);
    }
    for (uint32_t i = 0; i < n; i++) json_decref(res[i].waves_doc), json_decref(res[i].phases);
    curl_global_cleanup();
    return rc;
}
