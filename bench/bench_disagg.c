/*
 * `pagekv bench disagg`: the field's validation load through real prefill and decode
 * servers and the router, per staging design (docs/design/bench_disagg.md).
 *
 * Per design: fresh `pagekv serve --role prefill`, `--role decode` and `pagekv route`
 * processes, every design up at once; phases parity-before, burst, medium, long, [paced],
 * parity-after, each run design after design, driven by the curl-multi load driver
 * (support/loadgen.h); while a design's phase runs a sampler thread reads its nodes'
 * VmLck / VmRSS from /proc and staging figures from /v1/cache/stats every 100 ms.
 * A unified server runs the same phases first as the baseline and gives the parity
 * answers and the paced phase's rate.
 */
#include "bench/bench_disagg.h"
#include "support/bench.h"
#include "support/cli.h"
#include "support/cluster.h"
#include "support/footprint.h"
#include "support/http.h"
#include "support/launch.h"
#include "support/loadgen.h"
#include "support/netns.h"
#include "tools/commands.h"

#include "core/core.h"
#include "prim/prim.h"

#include <curl/curl.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define BD_MIB          (1024.0 * 1024.0)
#define BD_STOP_NS      30000000000ull
#define BD_SAMPLE_NS    100000000ull
#define BD_PARITY       8
#define BD_SLOTS        64 /* the field's slots and concurrency */
#define BD_PAGE_TOKENS  64 /* staging page = 64 tokens of llama-3.2-1b (2 MiB) */
#define BD_PACED_SLICES 6u /* the paced phase in 6 slices, the designs taking turns */

#define BD_STAGING_WARM_MS "1000" /* --staging-warm-ms of the per-transfer designs */

enum { BD_PARITY_BEFORE, BD_BURST, BD_MEDIUM, BD_LONG, BD_PACED, BD_PARITY_AFTER, BD_NPH };
static const char *const bd_phase_names[BD_NPH] = {"parity_before", "burst", "medium",
                                                   "long",          "paced", "parity_after"};

enum { D_FIXED, D_FIXED_REPEAT, D_PER_TRANSFER, D_PER_TRANSFER_EIGHTH, D_FIXED_SMALL, BD_ND };

/* Fixed slots: committed and pinned at start, never returned. */
static bool bd_fixed(int d)
{
    return d == D_FIXED || d == D_FIXED_REPEAT || d == D_FIXED_SMALL;
}
static const char *const bd_design_names[BD_ND] = {"fixed", "fixed_repeat", "per_transfer",
                                                   "per_transfer_eighth", "fixed_small"};

typedef struct {
    double scale;
    bool quick, tcp, keep_logs;
    bool design[BD_ND];
    const char *preset, *json_path, *svg_dir;
    double paced_rps; /* 0: from the unified baseline */
    uint32_t paced_n;
} bd_opts_t;

/* The load's sizes after --scale. */
typedef struct {
    uint32_t n[BD_NPH], conc[BD_NPH];
    uint32_t len[BD_NPH]; /* prompt tokens (paced: cycles over mix[]) */
    uint32_t mix[4];
    uint32_t context;    /* the longest context, tokens */
    uint32_t ctx_pages;  /* staging pages of one longest context */
    uint64_t page_bytes; /* a staging page: BD_PAGE_TOKENS tokens of KV */
    double cpt;          /* filler characters per token */
} bd_load_t;

typedef struct {
    double t;                              /* seconds since the design's start */
    double lck[2], rss[2], res[2], fly[2]; /* prefill, decode: bytes */
    double anon[2], shm[2];                /* RssAnon, RssShmem (RssFile: the rest) */
    double com[2];                         /* the KV pool's committed bytes */
    double act[2];                         /* the agent's active transfers (a count) */
} bd_sample_t;

/* What a paced phase's RSS drift is made of, per node: the windows' means, last - first. */
enum { BD_G_RSS, BD_G_STAGING, BD_G_POOL, BD_G_ANON, BD_G_SHMEM, BD_G_FILE, BD_NG };
static const char *const bd_growth_names[BD_NG] = {
    "rss", "staging_resident", "pool_committed", "anon", "shmem", "file"};

typedef struct {
    uint32_t requests, ok;
    double wall_s, req_s, ttft_mean, ttft_p50, ttft_p99, tpot; /* ms */
    double t0, t1;                                             /* within the design's timeline */
} bd_phase_t;

typedef struct {
    const char *name;
    bool ran, ok;
    uint32_t pool_pages, slots;
    uint64_t page_bytes;
    double pinned_peak[2], resident_peak[2], inflight_peak[2], pinned_counter_peak[2];
    long long failed_reads, recomputes, router_retries, transfers;
    uint32_t client_errors;
    json_t *reasons;         /* error code -> count, from what clients saw */
    json_t *failure_samples; /* the first few failures: phase, status, body excerpt */
    bd_phase_t ph[BD_NPH];
    bool have_paced;
    json_t *paced_phases;   /* per node: the transfer phases' mean ms over the paced phase */
    double paced_rss_drift; /* max over the two nodes */
    double paced_rss_drift_less_staging; /* the same of RSS - staging resident */
    double paced_unaccounted_drift;      /* of RSS - staging resident - KV pool committed */
    double drift[2], drift_less[2], drift_unacc[2]; /* per node */
    double growth[2][BD_NG];                        /* per node, bytes (last window - first) */
    double first_rss[2];                            /* the first window's mean RSS */
    /* transfers in flight at once: decode the exact high-water of its reads
       (pulls.inflight_peak), prefill the sampler's largest transfers.active */
    double inflight_transfers_peak[2];
    /* transfers holding staging pages at once: each stage's exact high-water */
    double staging_transfers_peak[2];
    pkv_bd_mix_t mix[BD_NPH]; /* per phase: the prompts served (usage.prompt_tokens) */
    /* per phase, prefill / decode: the stage's peak pages in use x page bytes and peak
       count of transfers holding pages, the decode node's peak of pulls in flight (each
       node's high-water marks are read and restarted at every phase's end) */
    double ph_pages_peak[BD_NPH][2], ph_transfers_peak[BD_NPH][2], ph_pulls_peak[BD_NPH];
    bool staging_idle_zero;
    uint32_t parity_requests, parity_identical;
    bd_sample_t *samples;
    size_t ns, cap;
} bd_run_t;

static volatile sig_atomic_t g_stop;
static void on_signal(int sig)
{
    g_stop = sig;
}

/* ---- prompts ---------------------------------------------------------------------------- */
/* Requests [first, first + n) of one phase (bodies malloc'd; free with bd_reqs_free). */
static lg_req_t *bd_reqs(const bd_opts_t *o, const bd_load_t *L, int ph, double rate,
                         uint32_t first, uint32_t n)
{
    lg_req_t *r = calloc(n ? n : 1, sizeof(*r));
    if (!r) return NULL;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = first + k;
        uint32_t len = ph == BD_PACED ? L->mix[i % 4] : L->len[ph];
        /* parity prompts are the same in both parity phases; the others are distinct */
        uint64_t seed = ph == BD_PARITY_BEFORE || ph == BD_PARITY_AFTER
                            ? 1000 + i
                            : ((uint64_t)ph << 32) + i + 1;
        uint64_t st = seed;
        uint32_t max_tokens = 16 + (uint32_t)(pkv_splitmix64(&st) % 17); /* 16..32 */
        r[k].path = "/v1/chat/completions";
        r[k].body = lg_chat_body(o->preset, len, seed, max_tokens, L->cpt);
        r[k].stream = true;
        r[k].at_s = ph == BD_PACED && rate > 0 ? (double)k / rate : 0;
        if (!r[k].body) {
            for (uint32_t j = 0; j < k; j++) free(r[j].body);
            free(r);
            return NULL;
        }
    }
    return r;
}

static void bd_reqs_free(lg_req_t *r, uint32_t n)
{
    for (uint32_t i = 0; r && i < n; i++) free(r[i].body);
    free(r);
}

/* ---- the sampler thread ------------------------------------------------------------------ */
typedef struct {
    bd_run_t *run;
    const launch_proc_t *node[2]; /* prefill, decode; NULL: none (unified) */
    uint64_t t0_ns;
    pthread_mutex_t lock; /* guards run->samples / ns / cap */
    pthread_t th;
    atomic_int stop; /* set by the main thread, read by the sampler */
} bd_sampler_t;

static void bd_sample_once(bd_sampler_t *s)
{
    bd_sample_t x = {.t = (double)(pkv_now_ns() - s->t0_ns) / 1e9};
    for (int k = 0; k < 2; k++) {
        const launch_proc_t *p = s->node[k];
        if (!p) continue;
        pkv_prim_mem_t m;
        json_t *st = http_get_json(p->url, "/v1/cache/stats", 2000);
        /* read right after the node's counters, so RSS - staging is of one instant */
        if (p->pid > 0 && pkv_prim_mem_read(p->pid, &m) == PKV_OK) {
            x.lck[k] = (double)m.locked_bytes;
            x.rss[k] = (double)m.rss_bytes;
            x.anon[k] = (double)m.rss_anon_bytes;
            x.shm[k] = (double)m.rss_shmem_bytes;
        }
        long long com = cluster_json_int(st, "committed_bytes");
        long long act = cluster_json_int(st, "kv_transfer.transfers.active");
        x.com[k] = com > 0 ? (double)com : 0;
        x.act[k] = act > 0 ? (double)act : 0;
        long long page = cluster_json_int(st, "kv_transfer.staging.page_bytes");
        long long held = cluster_json_int(st, "kv_transfer.staging.pages_held_by_transfers");
        long long res = cluster_json_int(st, "kv_transfer.staging.resident_bytes");
        long long pin = cluster_json_int(st, "kv_transfer.staging.pinned_bytes");
        json_decref(st);
        x.res[k] = res > 0 ? (double)res : 0;
        x.fly[k] = page > 0 && held > 0 ? (double)(page * held) : 0;
        pthread_mutex_lock(&s->lock);
        if (pin > 0 && (double)pin > s->run->pinned_counter_peak[k])
            s->run->pinned_counter_peak[k] = (double)pin;
        pthread_mutex_unlock(&s->lock);
    }
    pthread_mutex_lock(&s->lock);
    bd_run_t *r = s->run;
    if (r->ns == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 1024;
        bd_sample_t *nb = realloc(r->samples, cap * sizeof(*nb));
        if (nb) r->samples = nb, r->cap = cap;
    }
    if (r->ns < r->cap) r->samples[r->ns++] = x;
    pthread_mutex_unlock(&s->lock);
}

static void *bd_sampler_main(void *arg)
{
    bd_sampler_t *s = arg;
    while (!atomic_load(&s->stop)) {
        uint64_t next = pkv_now_ns() + BD_SAMPLE_NS;
        bd_sample_once(s);
        while (!atomic_load(&s->stop) && pkv_now_ns() < next) {
            struct timespec ts = {0, 10000000};
            nanosleep(&ts, NULL);
        }
    }
    return NULL;
}

/* ---- running phases ---------------------------------------------------------------------- */
static double bd_t(const bd_sampler_t *s)
{
    return (double)(pkv_now_ns() - s->t0_ns) / 1e9;
}

/* A phase's results so far (a phase may run in slices, bd_phase_slice). */
typedef struct {
    double *ttft; /* ms, one per answered request */
    uint32_t requests, ok, tpot_n;
    double wall, tsum, tpot_sum, t0; /* t0: when its first slice began */
} bd_acc_t;

/* Requests [first, first + n) of phase phn against url, into acc; counts client errors and
 * their reasons into run. answers: if non-NULL, the parity answers to compare with, or
 * (fill) to fill. */
static void bd_phase_slice(const bd_opts_t *o, const bd_load_t *L, int phn, uint32_t first,
                           uint32_t n, const char *url, double rate, bd_sampler_t *smp,
                           bd_run_t *run, cluster_answer_t *answers, bool fill, bd_acc_t *acc)
{
    lg_req_t *reqs = bd_reqs(o, L, phn, rate, first, n);
    lg_result_t *res = calloc(n ? n : 1, sizeof(*res));
    double *grown = realloc(acc->ttft, sizeof(double) * ((size_t)acc->ok + n + 1));
    if (grown) acc->ttft = grown;
    if (!reqs || !res || !grown) {
        fprintf(stderr, "pagekv bench disagg: out of memory\n");
        goto out;
    }
    lg_config_t lc = {.base_url = url,
                      .concurrency = phn == BD_PACED ? 0 : L->conc[phn],
                      .timeout_ms = 600000,
                      .stop = &g_stop};
    if (!acc->requests) acc->t0 = smp ? bd_t(smp) : 0;
    double wall = lg_run(&lc, reqs, n, res);
    run->ph[phn].t0 = acc->t0;
    run->ph[phn].t1 = smp ? bd_t(smp) : acc->wall + wall;
    acc->requests += n;
    acc->wall += wall;
    for (uint32_t k = 0; k < n; k++) {
        lg_result_t *x = &res[k];
        uint32_t i = first + k;
        bool good = x->status == 200 && !x->answer.error_code[0] && x->answer.done;
        if (!good) {
            run->client_errors++;
            if (answers && !fill) run->parity_requests++; /* asked, never identical */
            const char *why = x->transport[0]           ? "transport"
                              : x->answer.error_code[0] ? x->answer.error_code
                                                        : "http_error";
            json_t *c = json_object_get(run->reasons, why);
            json_object_set_new(run->reasons, why, json_integer(c ? json_integer_value(c) + 1 : 1));
            if (json_array_size(run->failure_samples) < 4) {
                char line[400];
                snprintf(line, sizeof(line), "%s: HTTP %ld %s%s", bd_phase_names[phn], x->status,
                         x->transport, x->excerpt);
                json_array_append_new(run->failure_samples, json_string(line));
                fprintf(stderr, "    failed: %s\n", line);
            }
            continue;
        }
        acc->ttft[acc->ok++] = x->ttft_s * 1e3;
        acc->tsum += x->ttft_s * 1e3;
        pkv_bd_mix_add(&run->mix[phn], x->answer.prompt_tokens);
        if (x->answer.completion_tokens > 1) {
            acc->tpot_sum +=
                (x->total_s - x->ttft_s) * 1e3 / (double)(x->answer.completion_tokens - 1);
            acc->tpot_n++;
        }
        if (answers && fill) {
            answers[i] = x->answer;
            x->answer.text = NULL; /* moved */
        } else if (answers) {
            run->parity_requests++;
            run->parity_identical += cluster_answer_equal(&answers[i], &x->answer);
        }
    }
out:
    if (res) lg_results_free(res, n);
    free(res);
    bd_reqs_free(reqs, n);
}

/* The phase's figures from everything acc gathered (acc freed). */
static void bd_phase_end(bd_run_t *run, int phn, bd_acc_t *acc)
{
    bd_phase_t *ph = &run->ph[phn];
    ph->requests = acc->requests;
    ph->ok = acc->ok;
    ph->wall_s = acc->wall;
    ph->req_s = acc->wall > 0 ? (double)acc->ok / acc->wall : 0;
    ph->ttft_mean = acc->ok ? acc->tsum / acc->ok : 0;
    ph->ttft_p50 = lg_quantile(acc->ttft, acc->ok, 0.50);
    ph->ttft_p99 = lg_quantile(acc->ttft, acc->ok, 0.99);
    ph->tpot = acc->tpot_n ? acc->tpot_sum / acc->tpot_n : 0;
    fprintf(
        stderr, "  %-14s %4u/%-4u ok  %6.2f req/s  TTFT p50 %7.1f p99 %7.1f ms  TPOT %5.1f ms\n",
        bd_phase_names[phn], ph->ok, ph->requests, ph->req_s, ph->ttft_p50, ph->ttft_p99, ph->tpot);
    free(acc->ttft);
    memset(acc, 0, sizeof(*acc));
}

/* One whole phase against url (bd_phase_slice of all its requests, then bd_phase_end). */
static void bd_phase_run(const bd_opts_t *o, const bd_load_t *L, int phn, const char *url,
                         double rate, bd_sampler_t *smp, bd_run_t *run, cluster_answer_t *answers,
                         bool fill)
{
    bd_acc_t acc = {0};
    bd_phase_slice(o, L, phn, 0, L->n[phn], url, rate, smp, run, answers, fill, &acc);
    bd_phase_end(run, phn, &acc);
}

/* ---- processes --------------------------------------------------------------------------- */
typedef struct {
    char bin[4096];
    char logdir[96];
    bool net_up;      /* --tcp: the nodes' namespaces exist */
    netns_pair_t net; /* prefill in net.ns[0], decode in net.ns[1] */
} bd_env_t;

/* A node of this bench: its load's queue and connections, a small prefix cache, and with a
 * role the design's staging. */
static int bd_serve(const bd_env_t *e, const bd_opts_t *o, const bd_load_t *L, const char *name,
                    const char *role, int design, launch_proc_t *p)
{
    char page[32], pages[16], slots[16];
    snprintf(page, sizeof(page), "%llu", (unsigned long long)L->page_bytes);
    /* distinct prompts only: a small prefix cache, so RSS settles within the phases (the
       paced phase's drift measures leaks, not a cache filling up to its default cap) */
    char *argv[24] = {"--max-queue-depth",        "4096", "--max-connections", "1024",
                      "--prefix-cache-max-bytes", "64M"};
    int n = 6;
    if (role) {
        bool fixed = design == D_FIXED || design == D_FIXED_REPEAT || design == D_FIXED_SMALL;
        uint32_t pool = design == D_PER_TRANSFER          ? BD_SLOTS * L->ctx_pages / 8
                        : design == D_PER_TRANSFER_EIGHTH ? BD_SLOTS * L->ctx_pages / 64
                                                          : L->ctx_pages;
        if (pool < L->ctx_pages && !fixed) pool = L->ctx_pages; /* one longest transfer fits */
        snprintf(pages, sizeof(pages), "%u", pool);
        snprintf(slots, sizeof(slots), "%u", design == D_FIXED_SMALL ? 4 : BD_SLOTS);
        argv[n++] = "--staging";
        argv[n++] = fixed ? "fixed" : "per_transfer";
        argv[n++] = "--staging-pages";
        argv[n++] = pages;
        argv[n++] = "--staging-page-bytes";
        argv[n++] = page;
        if (!fixed) {
            /* a short warm floor, so that the idle check below ends in seconds (the
               serving default, 30 s, would keep one transfer's pages for up to a minute) */
            argv[n++] = "--staging-warm-ms";
            argv[n++] = BD_STAGING_WARM_MS;
        }
        if (fixed) {
            argv[n++] = "--staging-slots";
            argv[n++] = slots;
        }
    }
    argv[n] = NULL;
    /* --tcp: prefill and decode in the two namespaces, their HTTP on the links to this
       one (the router and the load driver stay here), their agents on the link between */
    int k = role && !strcmp(role, "decode");
    launch_place_t at = {e->net.ip_bin, e->net.ns[k], e->net.root_ip[k], e->net.ip[k],
                         e->net.dev[k]};
    return launch_serve(e->bin, e->logdir, name, o->preset, L->context, role, argv, o->tcp,
                        role && e->net_up ? &at : NULL, p);
}

static int bd_route(const bd_env_t *e, const char *name, const launch_proc_t *pre,
                    const launch_proc_t *dec, launch_proc_t *p)
{
    char *extra[] = {"--max-connections", "1024", NULL};
    return launch_route(e->bin, e->logdir, name, pre, dec, extra, p);
}

/* Sum of every sample line of a Prometheus text whose name contains `part`. */
static long long bd_metric_sum(const char *url, const char *part)
{
    http_reply_t r;
    if (http_call(url, "/metrics", NULL, NULL, 5000, NULL, &r) != 0) return -1;
    long long sum = 0;
    for (const char *l = r.body; l && *l;) {
        size_t n = strcspn(l, "\n");
        const char *sp = memchr(l, ' ', n);
        if (l[0] != '#' && sp && memmem(l, (size_t)(sp - l), part, strlen(part)))
            sum += (long long)strtod(sp + 1, NULL);
        l += n + (l[n] == '\n');
    }
    http_reply_free(&r);
    return sum;
}

/* Whether both nodes' staging resident bytes reach zero within their idle period, two
 * lives of their warm floor (docs/design/stage.md) and a second, polled every 250 ms. */
static bool bd_staging_idle(const char *pre_url, const char *dec_url)
{
    json_t *ks = http_get_json(pre_url, "/v1/cache/stats", 5000);
    long long idle_ms = cluster_json_int(ks, "kv_transfer.staging.idle_release_ms");
    long long warm_ms = cluster_json_int(ks, "kv_transfer.staging.warm_ms");
    json_decref(ks);
    if (idle_ms < 0) return false;
    if (warm_ms < 0) warm_ms = 0; /* null: no floor */
    uint64_t until = pkv_now_ns() + (uint64_t)(idle_ms + 2 * warm_ms + 1000) * 1000000ull;
    for (;;) {
        bool zero = true;
        for (int k = 0; k < 2; k++) {
            ks = http_get_json(k ? dec_url : pre_url, "/v1/cache/stats", 5000);
            zero &= cluster_json_int(ks, "kv_transfer.staging.resident_bytes") == 0;
            json_decref(ks);
        }
        if (zero) return true;
        if (pkv_now_ns() > until) return false;
        struct timespec ts = {0, 250000000};
        nanosleep(&ts, NULL);
    }
}

/* ---- one design --------------------------------------------------------------------------- */
static void bd_peaks(bd_run_t *r)
{
    for (size_t i = 0; i < r->ns; i++)
        for (int k = 0; k < 2; k++) {
            const bd_sample_t *s = &r->samples[i];
            if (s->lck[k] > r->pinned_peak[k]) r->pinned_peak[k] = s->lck[k];
            if (s->res[k] > r->resident_peak[k]) r->resident_peak[k] = s->res[k];
        }
}

/* Each node's RSS drift between the paced phase's first and last window (60 s, or a fifth
 * of a shorter phase), the same of RSS minus the node's staging resident bytes (read at the
 * same instant), the same of RSS minus staging and the KV pool's committed bytes (what no
 * counter of the library accounts for: a leak shows there; the pool's bytes follow the
 * prefix cache, whole 2 MiB granules at a time), and what the change is made of: staging,
 * the KV pool's committed bytes, and RssAnon / RssShmem / RssFile. Drift = |last - first|
 * / first of the windows' means. */
static void bd_drift(bd_run_t *r)
{
    const bd_phase_t *p = &r->ph[BD_PACED];
    double len = p->t1 - p->t0, w = len >= 300 ? 60 : len / 5;
    for (int k = 0; k < 2; k++) {
        double a[BD_NG] = {0}, b[BD_NG] = {0};
        int na = 0, nb = 0;
        for (size_t i = 0; i < r->ns; i++) {
            const bd_sample_t *x = &r->samples[i];
            double v[BD_NG] = {x->rss[k],  x->res[k], x->com[k],
                               x->anon[k], x->shm[k], x->rss[k] - x->anon[k] - x->shm[k]};
            bool in_a = x->t >= p->t0 && x->t<p->t0 + w, in_b = x->t> p->t1 - w && x->t <= p->t1;
            for (int g = 0; g < BD_NG; g++) {
                if (in_a) a[g] += v[g];
                if (in_b) b[g] += v[g];
            }
            na += in_a, nb += in_b;
        }
        if (!na || !nb || a[BD_G_RSS] <= 0) continue;
        for (int g = 0; g < BD_NG; g++) r->growth[k][g] = b[g] / nb - a[g] / na;
        double rss0 = a[BD_G_RSS] / na, less0 = rss0 - a[BD_G_STAGING] / na;
        r->first_rss[k] = rss0;
        r->drift[k] = fabs(r->growth[k][BD_G_RSS]) / rss0;
        r->drift_less[k] =
            less0 > 0 ? fabs(r->growth[k][BD_G_RSS] - r->growth[k][BD_G_STAGING]) / less0 : 0;
        double un0 = less0 - a[BD_G_POOL] / na,
               ung = r->growth[k][BD_G_RSS] - r->growth[k][BD_G_STAGING] - r->growth[k][BD_G_POOL];
        r->drift_unacc[k] = un0 > 0 ? fabs(ung) / un0 : 0;
        r->paced_unaccounted_drift = fmax(r->paced_unaccounted_drift, r->drift_unacc[k]);
        r->paced_rss_drift = fmax(r->paced_rss_drift, r->drift[k]);
        r->paced_rss_drift_less_staging = fmax(r->paced_rss_drift_less_staging, r->drift_less[k]);
    }
}

/* The nodes' high-water marks of the window that ends now (node k: prefill 0, decode 1),
 * restarted for the next one; into phase ph's figures (ph < 0: dropped). */
static void bd_peaks_window(const launch_proc_t *node[2], int ph, bd_run_t *run)
{
    json_t *empty = json_object();
    for (int k = 0; k < 2; k++) {
        json_t *w = http_json(node[k]->url, "/v1/kv_transfer/peaks/reset", empty, 5000);
        long long pages = cluster_json_int(w, "staging.pages_peak_used");
        long long page = cluster_json_int(w, "staging.page_bytes");
        long long tp = cluster_json_int(w, "staging.transfers_peak");
        long long fly = cluster_json_int(w, "pulls.inflight_peak");
        if (!w)
            fprintf(stderr, "  peaks reset: no answer from the %s node\n",
                    k ? "decode" : "prefill");
        json_decref(w);
        if (ph < 0) continue;
        /* the largest of a phase's windows (the paced phase runs in slices) */
        if (pages > 0 && page > 0)
            run->ph_pages_peak[ph][k] = fmax(run->ph_pages_peak[ph][k], (double)(pages * page));
        if (tp > 0) run->ph_transfers_peak[ph][k] = fmax(run->ph_transfers_peak[ph][k], (double)tp);
        if (k && fly > 0) run->ph_pulls_peak[ph] = fmax(run->ph_pulls_peak[ph], (double)fly);
    }
    json_decref(empty);
}

/* The paced phase's mean ms per transfer phase on each node, from the sums before it
 * (ps0, ds0) and now, into run->paced_phases. */
static void bd_paced_phases(bd_run_t *run, const json_t *ps0, const json_t *ds0,
                            const char *pre_url, const char *dec_url)
{
    json_t *ps1 = cluster_phase_sums(pre_url), *ds1 = cluster_phase_sums(dec_url);
    if (ps0 && ps1 && ds0 && ds1) {
        run->paced_phases = json_pack("{s:o, s:o}", "prefill", cluster_phase_means(ps0, ps1),
                                      "decode", cluster_phase_means(ds0, ds1));
        char *txt = json_dumps(run->paced_phases, JSON_COMPACT | JSON_REAL_PRECISION(4));
        fprintf(stderr, "    paced phases, mean ms: %s\n", txt ? txt : "");
        free(txt);
    }
    json_decref(ps1);
    json_decref(ds1);
}

/* A design's figures once its phases ran: peaks, drift, in-flight peaks and the nodes' and
 * the router's counters. */
static void bd_run_counters(bd_run_t *run, const char *pre_url, const char *dec_url,
                            const char *rt_url)
{
    bd_peaks(run);
    if (run->have_paced && run->ns) bd_drift(run);
    for (size_t i = 0; i < run->ns; i++)
        run->inflight_transfers_peak[0] =
            fmax(run->inflight_transfers_peak[0], run->samples[i].act[0]);
    json_t *ds = http_get_json(dec_url, "/v1/cache/stats", 5000);
    json_t *ps = http_get_json(pre_url, "/v1/cache/stats", 5000);
    /* in flight: the stages' own peaks of pages held (exact; a 100 ms sampler misses
       transfers of a few ms), the largest phase's */
    for (int ph = 0; ph < BD_NPH; ph++) {
        for (int k = 0; k < 2; k++) {
            run->inflight_peak[k] = fmax(run->inflight_peak[k], run->ph_pages_peak[ph][k]);
            run->staging_transfers_peak[k] =
                fmax(run->staging_transfers_peak[k], run->ph_transfers_peak[ph][k]);
        }
        run->inflight_transfers_peak[1] =
            fmax(run->inflight_transfers_peak[1], run->ph_pulls_peak[ph]);
    }
    run->failed_reads = cluster_json_int(ds, "kv_transfer.pulls.failed");
    run->recomputes = cluster_json_int(ds, "kv_transfer.pulls.recomputed");
    run->transfers = cluster_json_int(ps, "kv_transfer.leases.sent");
    json_decref(ds);
    json_decref(ps);
    run->router_retries = bd_metric_sum(rt_url, "retries_total");
}

/* A design's processes while its phases run: every design is up at once and each phase
 * runs design after design (bd_designs_run), so the minutes a VM drifts over fall between
 * phases rather than between designs. */
typedef struct {
    launch_proc_t pre, dec, rt;
    bool up;
    uint64_t t0_ns;    /* the design's timeline (samples, phase windows) starts here */
    bd_acc_t acc;      /* the running phase's results over its slices */
    json_t *ps0, *ds0; /* the paced phase: the nodes' transfer phase sums before it */
} bd_live_t;

/* Start design d's prefill, decode and router; false when one did not come up. */
static bool bd_design_start(const bd_env_t *e, const bd_opts_t *o, const bd_load_t *L, int d,
                            bd_run_t *run, bd_live_t *lv)
{
    run->name = bd_design_names[d];
    run->reasons = json_object();
    run->failure_samples = json_array();
    /* the paced phase in the two designs the field compared; fixed_repeat measures the
       closed phases' run-to-run spread (an open loop's req/s is its offered rate) */
    run->have_paced = (d == D_FIXED || d == D_PER_TRANSFER);
    run->slots = d == D_FIXED_SMALL ? 4 : BD_SLOTS;
    char np[48], nd[48], nr[48];
    snprintf(np, sizeof(np), "%s-prefill", run->name);
    snprintf(nd, sizeof(nd), "%s-decode", run->name);
    snprintf(nr, sizeof(nr), "%s-router", run->name);
    fprintf(stderr, "design %s: starting\n", run->name);
    if (bd_serve(e, o, L, np, "prefill", d, &lv->pre) ||
        bd_serve(e, o, L, nd, "decode", d, &lv->dec) ||
        bd_route(e, nr, &lv->pre, &lv->dec, &lv->rt))
        return false;
    lv->up = true;
    json_t *st = http_get_json(lv->pre.url, "/v1/cache/stats", 5000);
    run->page_bytes = (uint64_t)cluster_json_int(st, "kv_transfer.staging.page_bytes");
    run->pool_pages = (uint32_t)cluster_json_int(st, "kv_transfer.staging.pages_total");
    json_decref(st);
    const launch_proc_t *nodes[2] = {&lv->pre, &lv->dec};
    bd_peaks_window(nodes, -1, run); /* startup's window: nothing moved yet */
    lv->t0_ns = pkv_now_ns();
    return true;
}

/* Slice `slice` of `slices` of phase ph of design d (the paced phase runs in slices that
 * alternate between the designs; the others in one), its nodes sampled while it runs (the
 * other designs idle meanwhile). */
static void bd_design_phase(const bd_opts_t *o, const bd_load_t *L, int d, int ph, uint32_t slice,
                            uint32_t slices, double rate, cluster_answer_t *parity, bd_run_t *run,
                            bd_live_t *lv)
{
    if (ph == BD_PACED && !run->have_paced) return;
    bool first = slice == 0, last = slice + 1 == slices;
    fprintf(stderr, "design %s:", run->name);
    if (slices > 1) fprintf(stderr, " %s slice %u of %u", bd_phase_names[ph], slice + 1, slices);
    fprintf(stderr, "\n");
    const launch_proc_t *nodes[2] = {&lv->pre, &lv->dec};
    bd_sampler_t smp = {.run = run, .node = {&lv->pre, &lv->dec}, .t0_ns = lv->t0_ns};
    pthread_mutex_init(&smp.lock, NULL);
    bool sampling = pthread_create(&smp.th, NULL, bd_sampler_main, &smp) == 0;
    if (sampling) pthread_setname_np(smp.th, "pkv-bd-sample");
    bool par = ph == BD_PARITY_BEFORE || ph == BD_PARITY_AFTER;
    if (ph == BD_PACED && first) {
        lv->ps0 = cluster_phase_sums(lv->pre.url);
        lv->ds0 = cluster_phase_sums(lv->dec.url);
    }
    uint32_t n = L->n[ph], lo = n * slice / slices, hi = n * (slice + 1) / slices;
    bd_phase_slice(o, L, ph, lo, hi - lo, lv->rt.url, rate, &smp, run, par ? parity : NULL, false,
                   &lv->acc);
    bd_peaks_window(nodes, ph, run);
    if (last) bd_phase_end(run, ph, &lv->acc);
    if (ph == BD_PACED && last) {
        bd_paced_phases(run, lv->ps0, lv->ds0, lv->pre.url, lv->dec.url);
        json_decref(lv->ps0);
        json_decref(lv->ds0);
        lv->ps0 = lv->ds0 = NULL;
        /* idle: per-transfer staging goes back to the OS within the nodes' idle period
         * (kv_transfer.staging.idle_release_ms), two lives of the warm floor and a second
         * of slack */
        run->staging_idle_zero = !bd_fixed(d) && bd_staging_idle(lv->pre.url, lv->dec.url);
    }
    if (sampling) {
        atomic_store(&smp.stop, 1);
        pthread_join(smp.th, NULL);
    }
    pthread_mutex_destroy(&smp.lock);
}

/* Design d's counters once every phase ran, then its processes stop. */
static void bd_design_stop(const bd_env_t *e, bd_run_t *run, bd_live_t *lv)
{
    if (lv->up) {
        bd_run_counters(run, lv->pre.url, lv->dec.url, lv->rt.url);
        run->ran = !g_stop;
    } else {
        run->client_errors++;
    }
    int c1 = launch_stop(&lv->rt, SIGTERM, pkv_now_ns() + BD_STOP_NS);
    int c2 = launch_stop(&lv->dec, SIGTERM, pkv_now_ns() + BD_STOP_NS);
    int c3 = launch_stop(&lv->pre, SIGTERM, pkv_now_ns() + BD_STOP_NS);
    run->ok = lv->up && run->ran && c1 == 0 && c2 == 0 && c3 == 0;
    if (lv->up && (c1 || c2 || c3))
        fprintf(stderr, "  %s exits: router %d, decode %d, prefill %d (logs in %s)\n", run->name,
                c1, c2, c3, e->logdir);
}

/* Every chosen design up at once, then phase by phase each design in `order`: fixed,
 * per_transfer, fixed_repeat, ... (the control right before and after the design it is
 * compared with, within minutes of it), then all stop. */
static void bd_designs_run(const bd_env_t *e, const bd_opts_t *o, const bd_load_t *L, double rate,
                           cluster_answer_t *parity, bd_run_t *runs)
{
    static const int order[BD_ND] = {D_FIXED, D_PER_TRANSFER, D_FIXED_REPEAT, D_PER_TRANSFER_EIGHTH,
                                     D_FIXED_SMALL};
    bd_live_t live[BD_ND];
    memset(live, 0, sizeof(live));
    bool all_up = true;
    for (int i = 0; i < BD_ND && all_up && !g_stop; i++)
        if (o->design[order[i]])
            all_up = bd_design_start(e, o, L, order[i], &runs[order[i]], &live[order[i]]);
    for (int ph = 0; ph < BD_NPH && all_up && !g_stop; ph++) {
        /* the open loop in slices, taking turns: one long phase per design would put
           minutes between the two designs it compares */
        uint32_t slices = ph == BD_PACED ? PKV_MAX(1u, PKV_MIN(BD_PACED_SLICES, L->n[ph])) : 1;
        for (uint32_t sl = 0; sl < slices && !g_stop; sl++)
            for (int i = 0; i < BD_ND && !g_stop; i++)
                if (o->design[order[i]])
                    bd_design_phase(o, L, order[i], ph, sl, slices, rate, parity, &runs[order[i]],
                                    &live[order[i]]);
    }
    for (int i = 0; i < BD_ND; i++) {
        bd_live_t *lv = &live[order[i]];
        free(lv->acc.ttft);
        json_decref(lv->ps0);
        json_decref(lv->ds0);
        if (runs[order[i]].name) bd_design_stop(e, &runs[order[i]], lv);
    }
}

/* ---- options and sizes --------------------------------------------------------------------- */
static void bd_usage(FILE *f)
{
    fprintf(f,
            "usage: pagekv bench disagg [--scale F] [--quick] [--designs LIST] [--paced-rps R]\n"
            "                           [--paced-transfers N] [--preset NAME] [--json FILE]\n"
            "                           [--svg DIR] [--tcp] [--keep-logs]\n"
            "       pagekv bench disagg --latency [--runs N] [--sizes LIST] [--preset NAME]\n"
            "                           [--json FILE]   (one request at a time; --latency --help)\n"
            "The field's validation load (parity, burst, medium, long, paced, parity) through\n"
            "pagekv route and real prefill/decode servers, per staging design:\n"
            "  fixed, fixed_repeat  64 slots x the longest context, pinned at start\n"
            "  per_transfer         1/8 of fixed's pages, allocated per transfer\n"
            "  per_transfer_eighth  1/64 of fixed's pages\n"
            "  fixed_small          4 slots\n"
            "and a unified server on the same phases as the baseline. Every design is up at\n"
            "once; each phase runs design after design in the order fixed, per_transfer,\n"
            "fixed_repeat, per_transfer_eighth, fixed_small (the paced phase in 6 slices,\n"
            "fixed and per_transfer taking turns).\n"
            "  --scale F            prompt lengths and the longest context (8192) times F\n"
            "                       (default 0.125)\n"
            "  --quick              a smoke test: scale 1/32, few requests, paced 60 transfers\n"
            "  --designs LIST       comma-separated subset (default: all)\n"
            "  --paced-rps R        the paced phase's arrival rate (default: 0.6 x the\n"
            "                       unified server's closed-loop rate on the mix)\n"
            "  --paced-transfers N  requests in the paced phase (default 1800)\n"
            "  --tcp                prefill and decode nodes in two network namespaces joined\n"
            "                       by a veth pair, UCX_TLS=tcp (needs root and iproute2;\n"
            "                       exit 2 where they cannot be made); the router and the\n"
            "                       load stay here, on a veth to each namespace\n");
}

static int bd_parse(int argc, char **argv, bd_opts_t *o)
{
    *o = (bd_opts_t){.scale = 0.125, .preset = "llama-3.2-1b", .paced_n = 1800};
    bool any = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t n;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bd_usage(stdout);
            return 1;
        } else if (!strcmp(a, "--quick")) {
            o->quick = true;
        } else if (!strcmp(a, "--tcp")) {
            o->tcp = true;
        } else if (!strcmp(a, "--keep-logs")) {
            o->keep_logs = true;
        } else if (!v) {
            return pkv_cli_usage_error("bench disagg", "unknown option or missing value: %s", a);
        } else if (!strcmp(a, "--scale")) {
            char *end;
            o->scale = strtod(v, &end);
            if (*end || !(o->scale > 0) || o->scale > 1)
                return pkv_cli_usage_error("bench disagg", "--scale: a number in (0, 1], got '%s'",
                                           v);
            i++;
        } else if (!strcmp(a, "--paced-rps")) {
            char *end;
            o->paced_rps = strtod(v, &end);
            if (*end || !(o->paced_rps > 0) || o->paced_rps > 1000)
                return pkv_cli_usage_error("bench disagg", "--paced-rps: (0, 1000], got '%s'", v);
            i++;
        } else if (!strcmp(a, "--paced-transfers")) {
            if (pkv_cli_parse_u64(v, 1, 100000, &n))
                return pkv_cli_usage_error("bench disagg", "--paced-transfers: 1..100000, got '%s'",
                                           v);
            o->paced_n = (uint32_t)n;
            i++;
        } else if (!strcmp(a, "--designs")) {
            char buf[256];
            snprintf(buf, sizeof(buf), "%s", v);
            for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
                int k = 0;
                while (k < BD_ND && strcmp(t, bd_design_names[k])) k++;
                if (k == BD_ND)
                    return pkv_cli_usage_error("bench disagg", "--designs: unknown design '%s'", t);
                o->design[k] = any = true;
            }
            i++;
        } else if (!strcmp(a, "--preset")) {
            o->preset = argv[++i];
        } else if (!strcmp(a, "--json")) {
            o->json_path = argv[++i];
        } else if (!strcmp(a, "--svg")) {
            o->svg_dir = argv[++i];
        } else {
            return pkv_cli_usage_error("bench disagg", "unknown option: %s", a);
        }
    }
    if (!any)
        for (int k = 0; k < BD_ND; k++) o->design[k] = true;
    if (o->quick) {
        o->scale = 1.0 / 32;
        if (o->paced_n == 1800) o->paced_n = 60;
    }
    return 0;
}

static uint32_t bd_scaled(uint32_t tokens, double f)
{
    double v = (double)tokens * f;
    return v < 8 ? 8 : (uint32_t)v;
}

static void bd_sizes(const bd_opts_t *o, bd_load_t *L)
{
    static const uint32_t n_full[BD_NPH] = {BD_PARITY, 96, 64, 32, 0, BD_PARITY};
    static const uint32_t n_quick[BD_NPH] = {4, 16, 8, 4, 0, 4};
    static const uint32_t conc[BD_NPH] = {4, 32, 64, 32, 0, 4};
    for (int p = 0; p < BD_NPH; p++) {
        L->n[p] = o->quick ? n_quick[p] : n_full[p];
        L->conc[p] = conc[p];
    }
    L->n[BD_PACED] = o->paced_n;
    L->len[BD_PARITY_BEFORE] = L->len[BD_PARITY_AFTER] = bd_scaled(512, o->scale);
    L->len[BD_BURST] = bd_scaled(128, o->scale);
    L->len[BD_MEDIUM] = bd_scaled(512, o->scale);
    L->len[BD_LONG] = bd_scaled(4096, o->scale);
    static const uint32_t mix[4] = {128, 512, 2048, 4096};
    for (int i = 0; i < 4; i++) L->mix[i] = bd_scaled(mix[i], o->scale);
    L->context = bd_scaled(8192, o->scale);
    L->ctx_pages = (L->context + BD_PAGE_TOKENS - 1) / BD_PAGE_TOKENS;
    L->cpt = pkv_fp_chars_per_token();
}

/* ---- report ------------------------------------------------------------------------------ */
static json_t *bd_pair(const double v[2])
{
    return json_pack("{s:I, s:I}", "prefill", (json_int_t)v[0], "decode", (json_int_t)v[1]);
}

static json_t *bd_phases_json(const bd_run_t *r)
{
    json_t *a = json_array();
    for (int p = 0; p < BD_NPH; p++) {
        const bd_phase_t *x = &r->ph[p];
        if (!x->requests) continue;
        json_array_append_new(
            a, json_pack("{s:s, s:i, s:i, s:f, s:f, s:f, s:f, s:f, s:o, s:o}", "name",
                         bd_phase_names[p], "requests", (int)x->requests, "ok", (int)x->ok, "req_s",
                         x->req_s, "ttft_mean_ms", x->ttft_mean, "ttft_p50_ms", x->ttft_p50,
                         "ttft_p99_ms", x->ttft_p99, "tpot_ms", x->tpot, "staging_pages_peak_bytes",
                         bd_pair(r->ph_pages_peak[p]), "staging_transfers_peak",
                         bd_pair(r->ph_transfers_peak[p])));
    }
    return a;
}

static json_t *bd_json(const bd_opts_t *o, const bd_load_t *L, double rate, const bd_run_t *u,
                       const bd_run_t *runs)
{
    json_t *ds = json_array();
    for (int d = 0; d < BD_ND; d++) {
        const bd_run_t *r = &runs[d];
        if (!r->name) continue;
        json_t *j = json_pack(
            "{s:s, s:b, s:i, s:I, s:o, s:o, s:o, s:o, s:I, s:i, s:I, s:I, s:O, s:I, s:o,"
            " s:{s:i, s:i}}",
            "name", r->name, "ok", r->ok, "pool_pages", (int)r->pool_pages, "page_bytes",
            (json_int_t)r->page_bytes, "pinned_peak_bytes", bd_pair(r->pinned_peak),
            "pinned_counter_peak_bytes", bd_pair(r->pinned_counter_peak), "resident_peak_bytes",
            bd_pair(r->resident_peak), "inflight_peak_bytes", bd_pair(r->inflight_peak),
            "failed_reads", (json_int_t)r->failed_reads, "client_errors", (int)r->client_errors,
            "router_retries", (json_int_t)r->router_retries, "recomputes",
            (json_int_t)r->recomputes, "failure_reasons", r->reasons, "transfers",
            (json_int_t)r->transfers, "phases", bd_phases_json(r), "parity", "requests",
            (int)r->parity_requests, "identical", (int)r->parity_identical);
        json_object_set(j, "failure_samples", r->failure_samples);
        if (r->paced_phases) json_object_set(j, "paced_phase_means_ms", r->paced_phases);
        json_object_set_new(j, "inflight_transfers_peak", bd_pair(r->inflight_transfers_peak));
        json_object_set_new(j, "staging_transfers_peak", bd_pair(r->staging_transfers_peak));
        json_object_set_new(j, "inflight_transfers_peak_source",
                            json_pack("{s:s, s:s}", "prefill",
                                      "sampled every 100 ms (transfers.active): a lower bound",
                                      "decode", "pulls.inflight_peak: exact high-water"));
        if (r->have_paced) {
            json_object_set_new(j, "paced_rss_drift", json_real(r->paced_rss_drift));
            json_object_set_new(j, "paced_rss_drift_less_staging",
                                json_real(r->paced_rss_drift_less_staging));
            json_object_set_new(j, "paced_unaccounted_drift",
                                json_real(r->paced_unaccounted_drift));
            json_t *pd = json_object();
            for (int k = 0; k < 2; k++) {
                json_t *g = json_object();
                for (int x = 0; x < BD_NG; x++)
                    json_object_set_new(g, bd_growth_names[x],
                                        json_integer((json_int_t)r->growth[k][x]));
                json_object_set_new(pd, k ? "decode" : "prefill",
                                    json_pack("{s:f, s:f, s:f, s:I, s:o}", "rss_drift", r->drift[k],
                                              "rss_less_staging_drift", r->drift_less[k],
                                              "unaccounted_drift", r->drift_unacc[k],
                                              "first_window_rss_bytes", (json_int_t)r->first_rss[k],
                                              "growth_bytes", g));
            }
            json_object_set_new(j, "paced_drift", pd);
            /* fixed slots stay committed by design: null */
            json_object_set_new(j, "staging_idle_zero",
                                bd_fixed(d) ? json_null() : json_boolean(r->staging_idle_zero));
        }
        json_array_append_new(ds, j);
    }
    return json_pack("{s:f, s:b, s:s, s:i, s:f, s:[i,i,i,i], s:o, s:{s:o}}", "scale", o->scale,
                     "quick", o->quick, "preset", o->preset, "context_tokens", (int)L->context,
                     "paced_rps", rate, "mix_tokens", (int)L->mix[0], (int)L->mix[1],
                     (int)L->mix[2], (int)L->mix[3], "designs", ds, "unified", "phases",
                     bd_phases_json(u));
}

static void bd_table(const bd_run_t *u, const bd_run_t *runs)
{
    printf("\n| design | staging pages | pinned peak MiB (OS VmLck) prefill / decode | resident "
           "peak MiB | in-flight peak MiB | failed reads | client errors | retries | recomputes | "
           "transfers | parity |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int d = 0; d < BD_ND; d++) {
        const bd_run_t *r = &runs[d];
        if (!r->name) continue;
        printf("| %s | %u | %.0f / %.0f | %.0f / %.0f | %.0f / %.0f | %lld | %u | %lld | %lld | "
               "%lld | %u/%u |\n",
               r->name, r->pool_pages, r->pinned_peak[0] / BD_MIB, r->pinned_peak[1] / BD_MIB,
               r->resident_peak[0] / BD_MIB, r->resident_peak[1] / BD_MIB,
               r->inflight_peak[0] / BD_MIB, r->inflight_peak[1] / BD_MIB, r->failed_reads,
               r->client_errors, r->router_retries, r->recomputes, r->transfers,
               r->parity_identical, r->parity_requests);
    }
    printf("\n| design | burst req/s | medium req/s | long req/s | paced req/s | TTFT p50 / p99 "
           "ms: burst | medium | long | paced | TPOT ms (long) |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n");
    for (int d = -1; d < BD_ND; d++) {
        const bd_run_t *r = d < 0 ? u : &runs[d];
        if (!r->name) continue;
        printf("| %s |", r->name);
        for (int p = BD_BURST; p <= BD_PACED; p++)
            if (r->ph[p].requests)
                printf(" %.2f |", r->ph[p].req_s);
            else
                printf(" - |");
        for (int p = BD_BURST; p <= BD_PACED; p++)
            if (r->ph[p].requests)
                printf(" %.0f / %.0f |", r->ph[p].ttft_p50, r->ph[p].ttft_p99);
            else
                printf(" - |");
        printf(" %.1f |\n", r->ph[BD_LONG].tpot);
    }
}

/* Per node: transfers in flight at their peak, and the paced phase's RSS drift with what it
 * is made of. */
static void bd_table_nodes(const bd_run_t *runs)
{
    printf(
        "\n| design | node | transfers in flight, peak | paced RSS drift | RSS - staging drift | "
        "RSS - staging - KV pool drift | paced growth MiB (last 60 s - first 60 s): RSS | staging "
        "| KV pool committed | anon "
        "| shmem | file |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int d = 0; d < BD_ND; d++) {
        const bd_run_t *r = &runs[d];
        if (!r->name) continue;
        for (int k = 0; k < 2; k++) {
            printf("| %s | %s | %.0f%s |", r->name, k ? "decode" : "prefill",
                   r->inflight_transfers_peak[k], k ? "" : " (sampled)");
            if (!r->have_paced || !r->first_rss[k]) {
                printf(" - | - | - | - | - | - | - | - | - |\n");
                continue;
            }
            printf(" %.2f %% | %.2f %% | %.2f %% |", 100 * r->drift[k], 100 * r->drift_less[k],
                   100 * r->drift_unacc[k]);
            for (int g = 0; g < BD_NG; g++) printf(" %+.1f |", r->growth[k][g] / BD_MIB);
            printf("\n");
        }
    }
}

/* The planner check's input from the designs that ran (bench_disagg_plan.c). */
static json_t *bd_plan(const bd_opts_t *o, const bd_load_t *L, const bd_run_t *runs)
{
    pkv_bd_plan_design_t pd[BD_ND];
    size_t n = 0;
    for (int d = 0; d < BD_ND; d++) {
        const bd_run_t *r = &runs[d];
        if (!r->name || !r->ran) continue;
        pkv_bd_plan_design_t *x = &pd[n++];
        memset(x, 0, sizeof(*x));
        x->design = r->name;
        x->fixed = bd_fixed(d);
        x->slots = r->slots;
        x->pool_pages = r->pool_pages;
        x->page_bytes = r->page_bytes;
        x->context = L->context;
        /* per phase: every prompt the design's nodes served in it, by its real token
           count; in flight per node: its stage's exact peak of transfers holding pages */
        _Static_assert(BD_NPH == PKV_BD_PLAN_PHASES, "one planner phase per load phase");
        for (int p = 0; p < BD_NPH; p++) {
            pkv_bd_plan_phase_t *ph = &x->phase[p];
            ph->name = bd_phase_names[p];
            ph->mixed = p == BD_PACED;
            ph->mix = r->mix[p];
            for (int k = 0; k < 2; k++) {
                ph->in_flight[k] = (uint64_t)r->ph_transfers_peak[p][k];
                ph->inflight_peak[k] = r->ph_pages_peak[p][k];
            }
        }
        for (int k = 0; k < 2; k++) {
            x->pinned_peak[k] = r->pinned_peak[k];
            x->inflight_peak[k] = r->inflight_peak[k];
        }
    }
    return n ? pkv_bd_plan_check(o->preset, pd, n, stdout) : NULL;
}

/* The targets, each printed with its verdict; the count that failed. */
static int bd_targets(const bd_run_t *runs)
{
    int bad = 0;
    const bd_run_t *f = &runs[D_FIXED], *fr = &runs[D_FIXED_REPEAT], *pt = &runs[D_PER_TRANSFER];
#define BD_T(cond, ...)                                                                            \
    do {                                                                                           \
        bool ok_ = (cond);                                                                         \
        bad += !ok_;                                                                               \
        printf("- %s: ", ok_ ? "met" : "NOT MET");                                                 \
        printf(__VA_ARGS__);                                                                       \
        printf("\n");                                                                              \
    } while (0)
    printf("\ntargets:\n");
    for (int d = 0; d < BD_ND; d++) {
        const bd_run_t *r = &runs[d];
        if (!r->name) continue;
        BD_T(r->parity_requests && r->parity_identical == r->parity_requests,
             "%s parity %u/%u identical", r->name, r->parity_identical, r->parity_requests);
    }
    if (pt->name) {
        BD_T(pt->failed_reads == 0 && pt->client_errors == 0 && pt->router_retries <= 0 &&
                 pt->recomputes <= 0,
             "per_transfer: %lld failed reads, %u client errors, %lld retries, %lld recomputes",
             pt->failed_reads, pt->client_errors, pt->router_retries, pt->recomputes);
        if (f->name)
            for (int k = 0; k < 2; k++)
                BD_T(pt->pinned_peak[k] * 8 <= f->pinned_peak[k] * 1.0001,
                     "per_transfer pinned %s %.0f MiB <= 1/8 of fixed's %.0f MiB",
                     k ? "decode" : "prefill", pt->pinned_peak[k] / BD_MIB,
                     f->pinned_peak[k] / BD_MIB);
        if (f->name)
            for (int p = BD_BURST; p <= BD_PACED; p++) {
                if (!pt->ph[p].requests || !f->ph[p].requests) continue;
                /* the spread where fixed ran twice (the closed phases), else fixed alone */
                bool two = fr->name && fr->ph[p].requests;
                double lo = two ? fmin(f->ph[p].req_s, fr->ph[p].req_s) : f->ph[p].req_s,
                       hi = two ? fmax(f->ph[p].req_s, fr->ph[p].req_s) : f->ph[p].req_s;
                double mid = (lo + hi) / 2, tol = fmax(hi - lo, 0.2 * mid) / 2;
                double x = pt->ph[p].req_s;
                /* two-sided as the target states it; the direction says which way it missed */
                BD_T(fabs(x - mid) <= tol,
                     "per_transfer %s req/s %.2f within fixed's spread or 10%% (%.2f..%.2f)%s",
                     bd_phase_names[p], x, mid - tol, mid + tol,
                     x > mid + tol   ? " (above it: faster than fixed)"
                     : x < mid - tol ? " (below it: slower than fixed)"
                                     : "");
                /* fixed's p99 at per_transfer's time: the mean of the runs before and after it */
                double ref = two ? (f->ph[p].ttft_p99 + fr->ph[p].ttft_p99) / 2 : f->ph[p].ttft_p99;
                BD_T(pt->ph[p].ttft_p99 <= 1.1 * ref,
                     "per_transfer %s p99 TTFT %.0f ms <= 1.1 x fixed's %.0f ms%s",
                     bd_phase_names[p], pt->ph[p].ttft_p99, ref,
                     two ? " (the mean of fixed and fixed_repeat, run before and after it)" : "");
            }
        BD_T(pt->transfers >= 1800 || !pt->have_paced,
             "per_transfer moved %lld transfers (>= 1800)", pt->transfers);
    }
    for (int d = D_PER_TRANSFER; d <= D_PER_TRANSFER_EIGHTH; d++) {
        const bd_run_t *r = &runs[d];
        if (!r->name) continue;
        for (int k = 0; k < 2; k++)
            BD_T(r->resident_peak[k] <= 1.1 * r->inflight_peak[k],
                 "%s %s resident peak %.0f MiB <= 1.1 x in-flight peak %.0f MiB", r->name,
                 k ? "decode" : "prefill", r->resident_peak[k] / BD_MIB,
                 r->inflight_peak[k] / BD_MIB);
    }
    if (runs[D_PER_TRANSFER_EIGHTH].name)
        BD_T(runs[D_PER_TRANSFER_EIGHTH].failed_reads == 0,
             "per_transfer_eighth: %lld failed reads", runs[D_PER_TRANSFER_EIGHTH].failed_reads);
    for (int d = 0; d < BD_ND; d++) {
        const bd_run_t *r = &runs[d];
        if (!r->name || !r->have_paced || !r->ph[BD_PACED].requests) continue;
        /* leaks: what no counter accounts for (the KV pool follows its capped cache) */
        BD_T(r->paced_unaccounted_drift < 0.01,
             "%s paced drift of RSS - staging - KV pool %.2f%% < 1%% (RSS %.2f%%)", r->name,
             100 * r->paced_unaccounted_drift, 100 * r->paced_rss_drift);
        if (!bd_fixed(d)) BD_T(r->staging_idle_zero, "%s staging back to zero when idle", r->name);
    }
    return bad;
#undef BD_T
}

static void bd_svg(const char *dir, const bd_run_t *runs)
{
    static const char *const colors[BD_ND] = {"#1f77b4", "#aec7e8", "#d62728", "#ff9896",
                                              "#2ca02c"};
    mkdir(dir, 0755);
    for (int k = 0; k < 2; k++) {
        pkv_fp_series_t s[2 * BD_ND];
        double *owned[3 * BD_ND];
        size_t ns = 0, no = 0;
        for (int d = 0; d < BD_ND; d++) {
            const bd_run_t *r = &runs[d];
            if (!r->name || !r->ns) continue;
            double *x = malloc(r->ns * sizeof(double)), *yr = malloc(r->ns * sizeof(double)),
                   *yf = malloc(r->ns * sizeof(double));
            owned[no++] = x, owned[no++] = yr, owned[no++] = yf;
            if (!x || !yr || !yf) continue;
            for (size_t i = 0; i < r->ns; i++) {
                x[i] = r->samples[i].t;
                yr[i] = r->samples[i].res[k] / BD_MIB;
                yf[i] = r->samples[i].fly[k] / BD_MIB;
            }
            s[ns++] = (pkv_fp_series_t){r->name, colors[d], false, x, yr, r->ns};
            s[ns++] = (pkv_fp_series_t){"in flight", colors[d], true, x, yf, r->ns};
        }
        char path[512];
        snprintf(path, sizeof(path), "%s/disagg_staging_%s.svg", dir, k ? "decode" : "prefill");
        FILE *f = fopen(path, "w");
        if (f) {
            pkv_fp_svg_write(f,
                             k ? "decode node: staging resident (solid), in flight (dashed), MiB"
                               : "prefill node: staging resident (solid), in flight (dashed), MiB",
                             s, ns, NULL, 0);
            fclose(f);
            fprintf(stderr, "wrote %s\n", path);
        }
        for (size_t i = 0; i < no; i++) free(owned[i]);
    }
}

/* The log directory, signals and (--tcp) the nodes' namespaces. 0, or 2 (said on stderr). */
static int bd_env_setup(const bd_opts_t *o, bd_env_t *e)
{
    *e = (bd_env_t){.net_up = false};
    snprintf(e->logdir, sizeof(e->logdir), "/tmp/pagekv-bench-disagg-XXXXXX");
    if (launch_env_init(e->bin, sizeof(e->bin), e->logdir, on_signal)) return 2;
    if (!o->tcp) return 0;
    char err[512];
    if (netns_pair_create(&e->net, true, err, sizeof(err)) != 0) {
        netns_pair_destroy(&e->net);
        fprintf(stderr, "pagekv bench disagg: --tcp: cannot make the network namespaces: %s\n",
                err);
        return 2;
    }
    e->net_up = true;
    fprintf(stderr,
            "pagekv bench disagg: --tcp: prefill in %s (HTTP %s, KV %s), decode in %s (HTTP "
            "%s, KV %s), UCX_TLS=tcp; router and load here\n",
            e->net.ns[0], e->net.root_ip[0], e->net.ip[0], e->net.ns[1], e->net.root_ip[1],
            e->net.ip[1]);
    return 0;
}

/* The staging page from the unified node's token bytes into L->page_bytes; 0, or 2 when
 * it reports none or fixed staging would pin more than half of the memory available. */
static int bd_page_bytes(const bd_opts_t *o, bd_load_t *L, const launch_proc_t *un)
{
    json_t *ust = http_get_json(un->url, "/v1/cache/stats", 5000);
    long long token_bytes = cluster_json_int(ust, "token_bytes");
    json_decref(ust);
    if (token_bytes <= 0) {
        fprintf(stderr, "pagekv bench disagg: the unified node reports no token_bytes\n");
        return 2;
    }
    L->page_bytes = (uint64_t)token_bytes * BD_PAGE_TOKENS;
    /* fixed pins 64 slots of the longest context on each node */
    uint64_t fixed_pin = 2ull * BD_SLOTS * L->ctx_pages * L->page_bytes, avail = 0;
    pkv_prim_room_t room;
    if (pkv_prim_room_read(NULL, &room) == PKV_OK) {
        const pkv_prim_room_src_t *src = room.cgroup_version ? &room.cgroup : &room.machine;
        if (src->present && src->limit_bytes > src->usage_bytes)
            avail = src->limit_bytes - src->usage_bytes;
    }
    if (avail && fixed_pin > avail / 2 && (o->design[D_FIXED] || o->design[D_FIXED_REPEAT])) {
        fprintf(stderr,
                "pagekv bench disagg: scale %g: fixed staging would pin %.1f GiB on the two nodes "
                "(64 slots x %u pages x %.1f MiB each), more than half of the %.1f GiB available\n",
                o->scale, (double)fixed_pin / (1 << 30), L->ctx_pages,
                (double)L->page_bytes / BD_MIB, (double)avail / (1 << 30));
        return 2;
    }
    return 0;
}

/* The paced phase's rate: 0.6 x the unified server's closed-loop rate on the mix at
 * 16-way. */
static double bd_paced_rate(const bd_opts_t *o, const bd_load_t *L, const char *url)
{
    bd_load_t C = *L;
    C.n[BD_PACED] = o->quick ? 16 : 48;
    C.conc[BD_PACED] = 16;
    lg_req_t *reqs = bd_reqs(o, &C, BD_PACED, 0, 0, C.n[BD_PACED]);
    lg_result_t *res = calloc(C.n[BD_PACED], sizeof(*res));
    lg_config_t lc = {.base_url = url, .concurrency = 16, .timeout_ms = 600000, .stop = &g_stop};
    double wall = reqs && res ? lg_run(&lc, reqs, C.n[BD_PACED], res) : -1;
    double rate = wall > 0 ? 0.6 * C.n[BD_PACED] / wall : 1.0;
    if (res) lg_results_free(res, C.n[BD_PACED]);
    free(res);
    bd_reqs_free(reqs, C.n[BD_PACED]);
    fprintf(stderr,
            "  paced rate: %.2f req/s (0.6 x the unified server's closed-loop rate on the mix)\n",
            rate);
    return rate;
}

/* The unified baseline: its phases into u, the parity answers, L->page_bytes and (unless
 * --paced-rps gave it) the paced rate. 0, or 2 (said on stderr). */
static int bd_unified(const bd_env_t *e, const bd_opts_t *o, bd_load_t *L, bd_run_t *u,
                      cluster_answer_t *parity, double *rate)
{
    launch_proc_t un = {0};
    int rc = bd_serve(e, o, L, "unified", NULL, 0, &un) != 0 ? 2 : bd_page_bytes(o, L, &un);
    if (!rc) {
        fprintf(stderr, "unified:\n");
        bd_phase_run(o, L, BD_PARITY_BEFORE, un.url, 0, NULL, u, parity, true);
        for (int ph = BD_BURST; ph <= BD_LONG && !g_stop; ph++)
            bd_phase_run(o, L, ph, un.url, 0, NULL, u, NULL, false);
        if (!*rate && !g_stop) *rate = bd_paced_rate(o, L, un.url);
    }
    if (!rc && !g_stop) {
        /* unified moves no transfer: a third of the requests is its TTFT at the rate */
        bd_load_t U = *L;
        U.n[BD_PACED] = PKV_MAX(L->n[BD_PACED] / 3, 1);
        bd_phase_run(o, &U, BD_PACED, un.url, *rate, NULL, u, NULL, false);
    }
    launch_stop(&un, SIGTERM, pkv_now_ns() + BD_STOP_NS);
    return rc;
}

/* The tables, plan check, targets, --json and --svg of the runs; 1 when a run did not
 * hold (a process not up or not exiting 0, parity) or --json could not be written. */
static int bd_report(const bd_opts_t *o, const bd_load_t *L, double rate, const bd_run_t *u,
                     const bd_run_t *runs)
{
    int rc = 0;
    printf("pagekv bench disagg: %s, scale %g, context %u tokens, paced %.2f req/s x %u%s\n",
           o->preset, o->scale, L->context, rate, L->n[BD_PACED], o->quick ? " (quick)" : "");
    bd_table(u, runs);
    bd_table_nodes(runs);
    json_t *plan = bd_plan(o, L, runs);
    int bad = bd_targets(runs);
    if (o->json_path) {
        json_t *j = bd_json(o, L, rate, u, runs);
        json_object_set_new(j, "plan", plan ? plan : json_array());
        plan = NULL;
        if (pkv_bench_write_json(o->json_path, j) != 0) rc = 1;
        json_decref(j);
    }
    json_decref(plan);
    if (o->svg_dir) bd_svg(o->svg_dir, runs);
    /* the exit code says whether the runs held (every process up and exiting 0, parity);
       the targets are figures, printed above */
    for (int d = 0; d < BD_ND; d++)
        if (runs[d].name && (!runs[d].ok || runs[d].parity_identical != runs[d].parity_requests))
            rc = 1;
    printf("\n%d target%s not met%s\n", bad, bad == 1 ? "" : "s",
           o->quick ? " (--quick: a smoke test; the targets are for the full run)" : "");
    return rc;
}

int pkv_bench_disagg_load(int argc, char **argv)
{
    bd_opts_t o;
    int prc = bd_parse(argc, argv, &o);
    if (prc) return prc == 1 ? 0 : prc;
    bd_load_t L;
    bd_sizes(&o, &L);
    bd_env_t e;
    if ((prc = bd_env_setup(&o, &e)) != 0) return prc;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    fprintf(stderr,
            "pagekv bench disagg: %s, scale %g (context %u tokens = %u staging pages; prompts "
            "burst %u, medium %u, long %u, mix %u/%u/%u/%u tokens), logs in %s\n",
            o.preset, o.scale, L.context, L.ctx_pages, L.len[BD_BURST], L.len[BD_MEDIUM],
            L.len[BD_LONG], L.mix[0], L.mix[1], L.mix[2], L.mix[3], e.logdir);

    bd_run_t u = {.name = "unified", .reasons = json_object(), .failure_samples = json_array()};
    bd_run_t runs[BD_ND];
    memset(runs, 0, sizeof(runs));
    cluster_answer_t parity[BD_PARITY + 4];
    memset(parity, 0, sizeof(parity));
    double rate = o.paced_rps;
    int rc = bd_unified(&e, &o, &L, &u, parity, &rate);
    if (!rc && !g_stop) bd_designs_run(&e, &o, &L, rate, parity, runs);
    if (!rc && g_stop) {
        fprintf(stderr, "pagekv bench disagg: interrupted\n");
        rc = 130;
    }
    if (!rc) rc = bd_report(&o, &L, rate, &u, runs);
    for (size_t i = 0; i < sizeof(parity) / sizeof(parity[0]); i++) cluster_answer_free(&parity[i]);
    json_decref(u.reasons);
    json_decref(u.failure_samples);
    for (int d = 0; d < BD_ND; d++) {
        json_decref(runs[d].reasons);
        json_decref(runs[d].failure_samples);
        json_decref(runs[d].paced_phases);
        free(runs[d].samples);
    }
    curl_global_cleanup();
    if (e.net_up) netns_pair_destroy(&e.net); /* every node has been stopped */
    fprintf(stderr, "logs: %s\n", e.logdir);
    return rc;
}
