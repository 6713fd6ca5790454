/*
 * `pagekv bench reshard`: prefill and decode nodes of different tensor parallelism, per-plan
 * staging against the field's host mirror, through `pagekv route` (docs/design/bench_reshard.md).
 *
 * Per pair P -> D and design: fresh `pagekv serve --role prefill --tp P`, `--role decode
 * --tp D` (each a 2 GiB KV pool) and `pagekv route`; a closed loop of concurrent streamed
 * chat requests over a mix of prompt lengths, each with X-Pagekv-Timings so the decode
 * leg's transfer phases come back in the answer; a sampler thread reads each node's VmLck
 * and VmRSS from /proc and its per-rank staging from /v1/cache/stats every 100 ms. A
 * unified TP=1 node answers the first requests of every run for parity. The planner
 * (src/plan) predicts each design's host staging per node from the same geometry and load.
 */
#include "bench/bench_disagg.h"
#include "support/bench.h"
#include "support/cli.h"
#include "support/cluster.h"
#include "support/filler.h"
#include "support/footprint.h"
#include "support/loadgen.h"

#include "pagekv/kv.h"
#include "pagekv/model.h"

#include "core/core.h"
#include "plan/plan.h"
#include "prim/prim.h"

#include <curl/curl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BR_MIB       (1024.0 * 1024.0)
#define BR_MAX_PAIRS 16
#define BR_MAX_REQ   512
#define BR_PARITY    4
#define BR_CONTEXT   4096
#define BR_PAGE_TOK  64 /* a staging page: 64 tokens of one rank's heads */
#define BR_MAX_REP   9  /* --repeats */

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
    uint32_t requests, concurrency, repeats;
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
    const cluster_proc_t *proc;
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
    volatile int stop;
} br_sampler_t;

static void br_sample_node(br_sampler_t *s, br_node_t *n)
{
    pkv_prim_mem_t m;
    bool mem = n->proc->pid > 0 && pkv_prim_mem_read(n->proc->pid, &m) == PKV_OK;
    json_t *st = cluster_http_get_json(n->proc->url, "/v1/cache/stats", 2000);
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
    json_t *st = cluster_http_get_json(n->proc->url, "/v1/cache/stats", 5000);
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
    while (!s->stop) {
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
static void br_reqs_make(const br_opts_t *o, const br_env_t *e, lg_req_t *reqs, uint64_t seed0)
{
    for (uint32_t i = 0; i < o->requests; i++) {
        char *text = pkv_filler_alloc((size_t)(br_mix[i % 4] * e->cpt), seed0 + i, 1);
        json_t *body =
            json_pack("{s:s, s:[{s:s, s:s}], s:i, s:f, s:b, s:{s:b}}", "model", o->preset,
                      "messages", "role", "user", "content", text ? text : "", "max_tokens", 8,
                      "temperature", 0.0, "stream", 1, "stream_options", "include_usage", 1);
        reqs[i] = (lg_req_t){
            .path = "/v1/chat/completions", .body = json_dumps(body, JSON_COMPACT), .stream = true};
        json_decref(body);
        free(text);
    }
}

/* Median over the answered requests of the TTFT, or of the transfer time where there is one. */
static double br_p50(const lg_result_t *q, uint32_t n, bool transfer)
{
    double v[BR_MAX_REQ];
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (q[i].status != 200) continue;
        double x = transfer ? br_transfer_ms(q[i].body) : q[i].ttft_s * 1e3;
        if (!transfer || x > 0) v[k++] = x;
    }
    return k ? pkv_bench_median(v, k) : 0;
}

/* ---- one pair and design ----------------------------------------------------------------- */

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
    uint64_t pulls_peak;  /* the decode node's pulls in flight at their peak (exact) */
    uint64_t staging_transfers_peak[2]; /* per node: transfers holding staging at once */
    pkv_bd_mix_t mix; /* the prompts served, by real token count, for the planner */
    json_t *phases;   /* one run: {"prefill", "decode"}, each node's mean ms per phase */
    json_t *runs_doc; /* merged: [the runs' {"ttft_ms_p50", "transfer_ms_p50", "phase_means_ms"}] */
    uint32_t runs;    /* merged: the repeats */
    double ttft_run[BR_MAX_REP], transfer_run[BR_MAX_REP];
} br_result_t;

/* Fold one run into the pair and design's figures: peaks are the runs' highest, counts
 * add up, TTFT and transfer p50 are the median of the runs' (br_merge_done). */
static void br_merge(br_result_t *m, br_result_t *run)
{
    m->ok = (m->runs ? m->ok : true) && run->ok;
    for (int k = 0; k < 2; k++) {
        br_node_t *a = &m->node[k];
        const br_node_t *b = &run->node[k];
        a->lck_peak = PKV_MAX(a->lck_peak, b->lck_peak);
        a->res_peak = PKV_MAX(a->res_peak, b->res_peak);
        a->fly_peak = PKV_MAX(a->fly_peak, b->fly_peak);
        a->res_over_fly = PKV_MAX(a->res_over_fly, b->res_over_fly);
        a->tp = b->tp;
        for (uint32_t q = 0; q < PKV_KV_MAX_TP; q++)
            a->rank_pin_peak[q] = PKV_MAX(a->rank_pin_peak[q], b->rank_pin_peak[q]);
        m->staging_transfers_peak[k] =
            PKV_MAX(m->staging_transfers_peak[k], run->staging_transfers_peak[k]);
    }
    m->bytes_moved += run->bytes_moved;
    m->requests += run->requests;
    m->parity_n += run->parity_n;
    m->parity_same += run->parity_same;
    m->failed += run->failed;
    m->pulls_peak = PKV_MAX(m->pulls_peak, run->pulls_peak);
    for (uint32_t i = 0; i < run->mix.n; i++)
        for (uint32_t w = 0; w < run->mix.weight[i]; w++)
            pkv_bd_mix_add(&m->mix, run->mix.tokens[i]);
    if (!m->runs_doc) m->runs_doc = json_array();
    json_t *one =
        json_pack("{s:f, s:f}", "ttft_ms_p50", run->ttft_p50, "transfer_ms_p50", run->transfer_p50);
    if (run->phases) json_object_set_new(one, "phase_means_ms", run->phases);
    json_array_append_new(m->runs_doc, one);
    run->phases = NULL;
    m->ttft_run[m->runs] = run->ttft_p50;
    m->transfer_run[m->runs++] = run->transfer_p50;
}

static void br_merge_done(br_result_t *m)
{
    m->ttft_p50 = m->runs ? pkv_bench_median(m->ttft_run, m->runs) : 0;
    m->transfer_p50 = m->runs ? pkv_bench_median(m->transfer_run, m->runs) : 0;
    m->bytes_moved = m->runs ? m->bytes_moved / m->runs : 0;
}

static int br_node_start(const br_opts_t *o, const br_env_t *e, const char *name, const char *role,
                         uint32_t tp, int design, cluster_proc_t *p)
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
    return pkv_bench_disagg_serve(e->bin, e->logdir, name, o->preset, BR_CONTEXT, role, extra,
                                  false, NULL, p);
}

/* A counter of a node's kv_transfer stats (0 when absent). */
static uint64_t br_node_stat(const cluster_proc_t *node, const char *path)
{
    json_t *st = cluster_http_get_json(node->url, "/v1/cache/stats", 5000);
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
    }
}

static void br_one(const br_opts_t *o, const br_env_t *e, const cluster_proc_t *uni, br_result_t *r)
{
    cluster_proc_t pre = {0}, dec = {0}, rt = {0};
    char pn[32], dn[32];
    snprintf(pn, sizeof(pn), "prefill-%u-%u-%s", r->p, r->d, br_design_names[r->design]);
    snprintf(dn, sizeof(dn), "decode-%u-%u-%s", r->p, r->d, br_design_names[r->design]);
    fprintf(stderr, "pagekv bench reshard: %u -> %u %s: starting\n", r->p, r->d,
            br_design_names[r->design]);
    if (br_node_start(o, e, pn, "prefill", r->p, r->design, &pre) ||
        br_node_start(o, e, dn, "decode", r->d, r->design, &dec) ||
        pkv_bench_disagg_route(e->bin, e->logdir, &pre, &dec, NULL, &rt))
        goto out;
    lg_req_t *reqs = calloc(o->requests, sizeof(*reqs));
    lg_result_t *res = calloc(o->requests, sizeof(*res));
    if (!reqs || !res) {
        free(reqs);
        free(res);
        goto out;
    }
    br_reqs_make(o, e, reqs, 1000 * (uint64_t)(r->p * 100 + r->d) + (uint64_t)r->design);
    br_sampler_t s = {.node = {{.proc = &pre}, {.proc = &dec}}};
    pthread_mutex_init(&s.lock, NULL);
    pthread_create(&s.th, NULL, br_sampler_main, &s);
    uint64_t b0 = br_node_stat(&dec, "kv_transfer.transfers.bytes_received");
    json_t *ph0[2] = {cluster_phase_sums(pre.url), cluster_phase_sums(dec.url)};
    static const char *const hdr[] = {"X-Pagekv-Timings: 1", NULL};
    lg_config_t lc = {.base_url = rt.url,
                      .concurrency = o->concurrency,
                      .timeout_ms = 120000,
                      .headers = hdr,
                      .stop = &br_stop,
                      .keep_body = true};
    lg_run(&lc, reqs, o->requests, res);
    json_t *ph1[2] = {cluster_phase_sums(pre.url), cluster_phase_sums(dec.url)};
    if (ph0[0] && ph0[1] && ph1[0] && ph1[1]) {
        r->phases = json_pack("{s:o, s:o}", "prefill", cluster_phase_means(ph0[0], ph1[0]),
                              "decode", cluster_phase_means(ph0[1], ph1[1]));
        char *txt = json_dumps(r->phases, JSON_COMPACT | JSON_REAL_PRECISION(4));
        fprintf(stderr, "    phases, mean ms: %s\n", txt ? txt : "");
        free(txt);
    }
    for (int k = 0; k < 2; k++) json_decref(ph0[k]), json_decref(ph1[k]);
    r->bytes_moved = br_node_stat(&dec, "kv_transfer.transfers.bytes_received") - b0;
    r->pulls_peak = br_node_stat(&dec, "kv_transfer.pulls.inflight_peak");
    r->staging_transfers_peak[0] = br_node_stat(&pre, "kv_transfer.staging.transfers_peak");
    r->staging_transfers_peak[1] = br_node_stat(&dec, "kv_transfer.staging.transfers_peak");
    for (uint32_t i = 0; i < o->requests; i++)
        if (res[i].status == 200) pkv_bd_mix_add(&r->mix, res[i].answer.prompt_tokens);
    s.stop = 1;
    pthread_join(s.th, NULL);
    pthread_mutex_destroy(&s.lock);
    memcpy(r->node, s.node, sizeof(r->node));
    for (int k = 0; k < 2; k++) br_node_peaks(&r->node[k]);
    r->requests = o->requests;
    for (uint32_t i = 0; i < o->requests; i++) {
        if (res[i].status == 200) continue;
        if (!r->failed++) /* the first failure's reason, once per run */
            fprintf(stderr, "    request %u failed: status %ld %s%s\n", i, res[i].status,
                    res[i].transport, res[i].excerpt);
    }
    r->ttft_p50 = br_p50(res, o->requests, false);
    r->transfer_p50 = br_p50(res, o->requests, true);
    /* parity: the first requests again on the unified TP=1 node */
    lg_config_t uc = {
        .base_url = uni->url, .concurrency = 1, .timeout_ms = 120000, .stop = &br_stop};
    uint32_t np = PKV_MIN(BR_PARITY, o->requests);
    lg_result_t ures[BR_PARITY];
    lg_run(&uc, reqs, np, ures);
    for (uint32_t i = 0; i < np; i++) {
        if (ures[i].status != 200) continue;
        r->parity_n++;
        r->parity_same +=
            res[i].status == 200 && cluster_answer_equal(&res[i].answer, &ures[i].answer);
    }
    lg_results_free(ures, np);
    lg_results_free(res, o->requests);
    for (uint32_t i = 0; i < o->requests; i++) free(reqs[i].body);
    free(reqs);
    free(res);
    r->ok = !br_stop;
out:
    cluster_proc_stop(&rt, SIGTERM, pkv_deadline_after_ns(30000000000ull));
    cluster_proc_stop(&dec, SIGTERM, pkv_deadline_after_ns(30000000000ull));
    cluster_proc_stop(&pre, SIGTERM, pkv_deadline_after_ns(30000000000ull));
}

/* ---- options and output ------------------------------------------------------------------ */

static void br_usage(FILE *f)
{
    fprintf(f, "usage: pagekv bench reshard [options]\n"
               "  --pairs P:D,...     prefill -> decode TP pairs (default "
               "2:2,8:8,1:2,2:1,4:2,2:4,8:1,1:8)\n"
               "  --designs LIST      per_plan,mirror (default both)\n"
               "  --requests N        requests per run (default 24)\n"
               "  --repeats N         runs per pair and design, interleaved (default 2: per_plan,\n"
               "                      mirror, then mirror, per_plan; TTFT = the runs' median)\n"
               "  --concurrency N     requests in flight (default 6)\n"
               "  --pool BYTES        each node's KV pool (default 2G: the mirror pins it whole)\n"
               "  --preset NAME       model preset (default llama-3.2-1b)\n"
               "  --quick             pairs 1:2,2:1, 8 requests, concurrency 4 (a smoke test)\n"
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
    *o = (br_opts_t){
        .requests = 24, .concurrency = 6, .repeats = 2, .preset = "llama-3.2-1b", .pool = "2G"};
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
            o->requests = 8;
            o->concurrency = 4;
            o->repeats = 1;
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
        } else if (!strcmp(a, "--requests") && !pkv_cli_parse_u64(v, 1, BR_MAX_REQ, &x)) {
            o->requests = (uint32_t)x;
        } else if (!strcmp(a, "--repeats") && !pkv_cli_parse_u64(v, 1, BR_MAX_REP, &x)) {
            o->repeats = (uint32_t)x;
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
        json_object_set_new(pj, "transfers_inflight_peak", json_integer((json_int_t)r->pulls_peak));
        json_object_set_new(pj, "staging_transfers_peak",
                            json_pack("{s:I, s:I}", "prefill",
                                      (json_int_t)r->staging_transfers_peak[0], "decode",
                                      (json_int_t)r->staging_transfers_peak[1]));
        json_object_set_new(pj, "resident_over_inuse_rank_max",
                            json_pack("{s:f, s:f}", "prefill", r->node[0].res_over_fly, "decode",
                                      r->node[1].res_over_fly));
        json_object_set_new(pj, "repeats", json_integer((json_int_t)r->runs));
        if (r->runs_doc) json_object_set(pj, "runs", r->runs_doc);
        json_array_append_new(pairs, pj);
    }
    return json_pack("{s:s, s:s, s:i, s:i, s:o}", "preset", o->preset, "pool", o->pool, "requests",
                     (int)o->requests, "concurrency", (int)o->concurrency, "pairs", pairs);
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
    printf("\n| P -> D | mirror / per-plan pins (decode) | TTFT per-plan / mirror | per-plan "
           "resident / in-use peak, worst rank, prefill / decode |\n|---|---:|---:|---:|\n");
    for (uint32_t i = 0; i < n; i++) {
        if (res[i].design != BR_PER_PLAN) continue;
        for (uint32_t j = 0; j < n; j++) {
            if (res[j].design != BR_MIRROR || res[j].p != res[i].p || res[j].d != res[i].d)
                continue;
            double pins =
                res[i].node[1].lck_peak > 0 ? res[j].node[1].lck_peak / res[i].node[1].lck_peak : 0;
            double tt = res[j].ttft_p50 > 0 ? res[i].ttft_p50 / res[j].ttft_p50 : 0;
            printf("| %u -> %u | %.1fx | %.3f | %.3f / %.3f |\n", res[i].p, res[i].d, pins, tt,
                   res[i].node[0].res_over_fly, res[i].node[1].res_over_fly);
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
    if (cluster_env_init(e.bin, sizeof(e.bin), e.logdir, on_signal)) return 2;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    fprintf(stderr,
            "pagekv bench reshard: %s, pool %s per node, %u requests x %u in flight, prompts "
            "256/512/1024/2048 tokens, %u run(s) per pair and design, logs in %s\n",
            o.preset, o.pool, o.requests, o.concurrency, o.repeats, e.logdir);
    cluster_proc_t uni = {0};
    char *ux[] = {"--kv-dtype", "bf16", NULL};
    if (pkv_bench_disagg_serve(e.bin, e.logdir, "unified", o.preset, BR_CONTEXT, NULL, ux, false,
                               NULL, &uni))
        return 1;
    br_result_t res[BR_MAX_PAIRS * BR_ND];
    uint32_t n = 0;
    for (uint32_t i = 0; i < o.n_pairs && !br_stop; i++) {
        uint32_t at[BR_ND];
        for (int d = 0; d < BR_ND; d++) {
            if (!o.design[d]) continue;
            at[d] = n;
            res[n++] = (br_result_t){.p = o.p[i], .d = o.d[i], .design = d};
        }
        /* interleaved, so drift on a shared machine falls on both designs alike */
        for (uint32_t rep = 0; rep < o.repeats && !br_stop; rep++)
            for (int k = 0; k < BR_ND && !br_stop; k++) {
                int d = rep % 2 ? BR_ND - 1 - k : k;
                if (!o.design[d]) continue;
                br_result_t run = {.p = o.p[i], .d = o.d[i], .design = d};
                br_one(&o, &e, &uni, &run);
                br_merge(&res[at[d]], &run);
            }
        for (int d = 0; d < BR_ND; d++)
            if (o.design[d]) {
                br_merge_done(&res[at[d]]);
                br_plan(&o, &res[at[d]]);
            }
    }
    cluster_proc_stop(&uni, SIGTERM, pkv_deadline_after_ns(30000000000ull));
    br_table(res, n);
    int rc = br_stop ? 130 : 0;
    for (uint32_t i = 0; i < n; i++)
        if (!res[i].ok || res[i].failed || res[i].parity_same != res[i].parity_n) rc = rc ? rc : 1;
    if (o.json_path) {
        json_t *doc = br_json(&o, res, n);
        if (pkv_bench_write_json(o.json_path, doc)) rc = rc ? rc : 1;
        json_decref(doc);
    }
    for (uint32_t i = 0; i < n; i++) json_decref(res[i].runs_doc);
    curl_global_cleanup();
    return rc;
}
