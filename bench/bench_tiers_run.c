/*
 * pagekv bench tiers: the workloads and one arm's run.
 *
 * Prompts are filler text (support/footprint.h) sized in tokens with the builtin tokenizer's
 * characters per token. A multi-round request is a chat: the shared system prompt, then the
 * user's history (its first message: the user's own context and question 1; then each
 * earlier round's answer and the next question), so round r's prompt extends round r-1's.
 * The answers in the history are the reference pass's in every arm: every arm sends the
 * same bytes, and an arm's answer is compared with the reference's for the same prompt. A
 * tile request is one user message: a document and a question about it.
 *
 * Requests go one at a time (users take turns), streamed with include_usage: the TTFT is the
 * first event (the server sends it once the first token exists). Around each round the bench
 * scrapes /metrics (the tier's counters: deltas per round); a sampler thread ("bt-sampler")
 * reads the server's VmRSS and the tier directory's file sizes every 100 ms, and once more at
 * each round's start and end.
 */
#include "bench_tiers.h"

#include "core/core.h"
#include "pagekv/kv.h"
#include "pagekv/model.h"
#include "prim/prim.h"
#include "support/cgroup.h"
#include "support/cluster.h"
#include "support/footprint.h"
#include "support/launch.h"
#include "support/loadgen.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

const char *const bt_arm_names[BT_ARMS] = {"reference", "recompute", "disk", "restart"};

#define BT_NS           1000000000ull
#define BT_SAMPLE_NS    100000000ull /* the sampler's period */
#define BT_DRAIN_NS     (30 * BT_NS) /* restart: the writer's queue drains before the kill */
#define BT_OVERHEAD_TOK 64           /* the chat template and separators, in tokens */

/* ---- sizes ------------------------------------------------------------------------------- */

uint64_t bt_token_bytes(const char *preset)
{
    pkv_model_config_t mc;
    if (pkv_model_preset(preset, &mc)) return 0;
    pkv_geometry_t g = {mc.n_layers, mc.n_kv_heads, mc.head_dim, 0, PKV_DTYPE_F16};
    return pkv_geometry_token_bytes(&g);
}

uint32_t bt_longest_tokens(const bt_opts_t *o)
{
    uint32_t mr = o->system_tokens + o->history_tokens +
                  o->rounds * (o->question_tokens + o->out_max + BT_OVERHEAD_TOK);
    uint32_t tile = o->docs ? o->doc_tokens + o->question_tokens + o->out_max + BT_OVERHEAD_TOK : 0;
    return PKV_MAX(mr, tile);
}

uint64_t bt_working_set_bytes(const bt_opts_t *o)
{
    uint64_t per_round = o->question_tokens + (o->out_min + o->out_max) / 2 + BT_OVERHEAD_TOK;
    uint64_t tokens =
        o->system_tokens + (uint64_t)o->users * (o->history_tokens + o->rounds * per_round);
    return tokens * bt_token_bytes(o->preset);
}

uint64_t bt_budget_default(const bt_opts_t *o)
{
    uint64_t bytes = bt_token_bytes(o->preset) * bt_longest_tokens(o) * 5 / 4;
    return (bytes + BT_GRANULE - 1) / BT_GRANULE * BT_GRANULE;
}

/* ---- workloads --------------------------------------------------------------------------- */

static char *bt_filler(const bt_env_t *e, uint32_t tokens, uint64_t seed)
{
    size_t chars = (size_t)((double)tokens * e->cpt);
    return pkv_fp_filler_alloc(chars < 8 ? 8 : chars, seed);
}

/* The arrays of a workload of users x rounds, questions and answer lengths filled. */
static int bt_work_alloc(const bt_env_t *e, bt_work_t *w, uint64_t seed)
{
    size_t n = (size_t)w->users * w->rounds;
    w->context = calloc(w->users, sizeof(char *));
    w->question = calloc(n, sizeof(char *));
    w->answer = calloc(n, sizeof(char *));
    w->max_tokens = calloc(n, sizeof(uint32_t));
    if (!w->context || !w->question || !w->answer || !w->max_tokens) return -1;
    uint32_t span = e->o->out_max - e->o->out_min + 1;
    for (size_t i = 0; i < n; i++) {
        uint64_t st = seed + i;
        w->max_tokens[i] = e->o->out_min + (uint32_t)(pkv_splitmix64(&st) % span);
        if (!(w->question[i] = bt_filler(e, e->o->question_tokens, seed + 4096 + i))) return -1;
    }
    w->restart_round = w->rounds / 2 + 1;
    return 0;
}

int bt_work_multiround(const bt_env_t *e, bt_work_t *w)
{
    *w = (bt_work_t){.name = "multiround", .users = e->o->users, .rounds = e->o->rounds};
    w->grows = true;
    if (bt_work_alloc(e, w, 1u << 20)) return -1;
    if (!(w->system = bt_filler(e, e->o->system_tokens, 1))) return -1;
    for (uint32_t u = 0; u < w->users; u++)
        if (!(w->context[u] = bt_filler(e, e->o->history_tokens, 100 + u))) return -1;
    return 0;
}

int bt_work_tile(const bt_env_t *e, bt_work_t *w)
{
    *w = (bt_work_t){.name = "tile", .users = e->o->docs, .rounds = 2};
    if (bt_work_alloc(e, w, 2u << 20)) return -1;
    for (uint32_t u = 0; u < w->users; u++)
        if (!(w->context[u] = bt_filler(e, e->o->doc_tokens, 500 + u))) return -1;
    return 0;
}

void bt_work_free(bt_work_t *w)
{
    size_t n = (size_t)w->users * w->rounds;
    for (uint32_t u = 0; w->context && u < w->users; u++) free(w->context[u]);
    for (size_t i = 0; i < n; i++) {
        if (w->question) free(w->question[i]);
        if (w->answer) free(w->answer[i]);
    }
    free(w->context);
    free(w->question);
    free(w->answer);
    free(w->max_tokens);
    free(w->system);
    memset(w, 0, sizeof(*w));
}

static int bt_msg(json_t *msgs, const char *role, const char *text)
{
    return json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", role, "content", text));
}

/* User u's request in round r (0-based), JSON text (caller frees); NULL out of memory. */
static char *bt_body(const bt_env_t *e, const bt_work_t *w, uint32_t u, uint32_t r)
{
    json_t *msgs = json_array();
    size_t first = w->grows ? u : (size_t)r * w->users + u;
    size_t len = strlen(w->context[u]) + strlen(w->question[first]) + 3;
    char *opening = malloc(len);
    int bad = !msgs || !opening;
    if (!bad) snprintf(opening, len, "%s\n\n%s", w->context[u], w->question[first]);
    if (!bad && w->system) bad |= bt_msg(msgs, "system", w->system);
    if (!bad) bad |= bt_msg(msgs, "user", opening);
    for (uint32_t k = 0; !bad && w->grows && k < r; k++) {
        bad |= !w->answer[(size_t)k * w->users + u];
        if (!bad) bad |= bt_msg(msgs, "assistant", w->answer[(size_t)k * w->users + u]);
        if (!bad) bad |= bt_msg(msgs, "user", w->question[(size_t)(k + 1) * w->users + u]);
    }
    free(opening);
    json_t *b = bad ? NULL
                    : json_pack("{s:s, s:O, s:i, s:f, s:b, s:b, s:{s:b}}", "model", e->o->preset,
                                "messages", msgs, "max_tokens",
                                (int)w->max_tokens[(size_t)r * w->users + u], "temperature", 0.0,
                                "stream", 1, "ignore_eos", 1, "stream_options", "include_usage", 1);
    json_decref(msgs);
    char *s = b ? json_dumps(b, JSON_COMPACT) : NULL;
    json_decref(b);
    return s;
}

/* ---- the sampler ------------------------------------------------------------------------- */

/* The sum of the sizes of the files in dir; 0 when it does not exist. */
static uint64_t bt_dir_bytes(const char *dir)
{
    DIR *d = dir ? opendir(dir) : NULL;
    if (!d) return 0;
    uint64_t sum = 0;
    struct stat st;
    for (struct dirent *de; (de = readdir(d));)
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..") &&
            fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0)
            sum += (uint64_t)st.st_size;
    closedir(d);
    return sum;
}

typedef struct {
    pthread_mutex_t lock; /* guards every field below but th */
    bool stop;
    pid_t pid;         /* the server's, 0 between servers */
    const char *dir;   /* the tier's directory, NULL: none */
    const char *cg;    /* the server's memory cgroup, NULL: none */
    bt_round_t *round; /* the round in progress, NULL between rounds */
    bt_arm_t *arm;
    pthread_t th;
} bt_sampler_t;

static void bt_sample(bt_sampler_t *sp)
{
    pthread_mutex_lock(&sp->lock);
    pid_t pid = sp->pid;
    const char *dir = sp->dir;
    pthread_mutex_unlock(&sp->lock);
    pkv_prim_mem_t m;
    uint64_t rss = pid > 0 && pkv_prim_mem_read(pid, &m) == PKV_OK ? m.rss_bytes : 0;
    uint64_t disk = bt_dir_bytes(dir), cg = 0, cache = 0;
    pthread_mutex_lock(&sp->lock);
    bool in_cg = sp->cg && cgroup_v1_read(sp->cg, &cg, &cache) == 0;
    bt_arm_t *a = sp->arm;
    if (sp->pid == pid && rss) { /* not a server replaced meanwhile */
        a->rss_peak = PKV_MAX(a->rss_peak, rss);
        if (sp->round) sp->round->rss_peak = PKV_MAX(sp->round->rss_peak, rss);
        if (sp->round) sp->round->rss_end = rss;
    }
    if (in_cg) {
        a->cg_peak = PKV_MAX(a->cg_peak, cg);
        a->cg_cache_peak = PKV_MAX(a->cg_cache_peak, cache);
        if (sp->round) sp->round->cg_peak = PKV_MAX(sp->round->cg_peak, cg);
    }
    if (dir) {
        a->disk_samples++;
        a->disk_over += disk > a->disk_cap;
        a->disk_peak = PKV_MAX(a->disk_peak, disk);
        if (sp->round) sp->round->disk_peak = PKV_MAX(sp->round->disk_peak, disk);
        if (sp->round) sp->round->disk_end = disk;
    }
    pthread_mutex_unlock(&sp->lock);
}

static void *bt_sampler_main(void *arg)
{
    bt_sampler_t *sp = arg;
    pthread_setname_np(pthread_self(), "bt-sampler");
    for (;;) {
        pthread_mutex_lock(&sp->lock);
        bool stop = sp->stop;
        pthread_mutex_unlock(&sp->lock);
        if (stop) break;
        bt_sample(sp);
        struct timespec ts = {0, (long)BT_SAMPLE_NS};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* Point the sampler at a server (pid 0: none) and a round (NULL: none), with a sample just
 * before (the last of the previous round) and just after (the first of the next). */
static void bt_sampler_set(bt_sampler_t *sp, pid_t pid, bt_round_t *round)
{
    bt_sample(sp);
    pthread_mutex_lock(&sp->lock);
    sp->pid = pid;
    sp->round = round;
    pthread_mutex_unlock(&sp->lock);
    bt_sample(sp);
}

/* ---- servers and /metrics ---------------------------------------------------------------- */

enum {
    M_LOADED,
    M_LOAD_SUM,
    M_LOAD_COUNT,
    M_LOAD_IN_TIME, /* loads that ended within the deadline (the bucket le=BT_LOAD_MS) */
    M_DEC_LOAD,
    M_DEC_RECOMPUTE,
    M_CORRUPT,
    M_TIMEOUTS,
    M_QUEUED,
    M_TIER_BYTES,
    M_DROP_EVICTED,
    M_N
};
static const char *const bt_series[M_N] = {
    "pagekv_kv_tier_loaded_bytes_total{tier=\"disk\"}",
    "pagekv_kv_tier_load_seconds_sum",
    "pagekv_kv_tier_load_seconds_count",
    "pagekv_kv_tier_load_seconds_bucket{le=\"1\"}", /* BT_LOAD_MS */
    "pagekv_kv_tier_load_decisions_total{decision=\"load\"}",
    "pagekv_kv_tier_load_decisions_total{decision=\"recompute\"}",
    "pagekv_kv_tier_corrupt_total{tier=\"disk\"}",
    "pagekv_kv_tier_load_timeouts_total",
    "pagekv_kv_tier_queued_blocks",
    "pagekv_kv_tier_bytes{tier=\"disk\"}",
    "pagekv_kv_tier_dropped_writes_total{cause=\"evicted\"}",
};
_Static_assert(BT_LOAD_MS == 1000, "bt_series reads the load_seconds bucket le=\"1\"");

/* One arm in progress. */
typedef struct {
    const bt_env_t *e;
    bt_work_t *w;
    bt_arm_t *a;
    launch_proc_t srv;
    bt_sampler_t sp;
    char disk_dir[128]; /* "" without a tier */
    char cg[1400];      /* the server's memory cgroup, "" without one */
    int servers;        /* started so far */
} bt_run_t;

static int bt_scrape(bt_run_t *x, double *m)
{
    if (cluster_metrics_scrape(x->srv.url, bt_series, M_N, m) == 0) return 0;
    snprintf(x->a->error, sizeof(x->a->error), "%s: /metrics unreadable", x->srv.name);
    return -1;
}

/* The server's end-of-life counters into the arm (a restart's first server, and the last). */
static int bt_server_account(bt_run_t *x)
{
    double m[M_N];
    if (bt_scrape(x, m)) return -1;
    x->a->corrupt += (uint64_t)m[M_CORRUPT];
    x->a->load_timeouts += (uint64_t)m[M_TIMEOUTS];
    x->a->past_deadline += (uint64_t)(m[M_LOAD_COUNT] - m[M_LOAD_IN_TIME]);
    x->a->dropped_evicted += (uint64_t)m[M_DROP_EVICTED];
    return 0;
}

/* Start the arm's (next) server and point the sampler at it. 0, or -1 with a->error. */
static int bt_server_start(bt_run_t *x)
{
    const bt_env_t *e = x->e;
    char budget[32], cap[32], load_ms[16], name[64];
    snprintf(budget, sizeof(budget), "%llu", (unsigned long long)x->a->budget);
    snprintf(cap, sizeof(cap), "%llu", (unsigned long long)e->o->disk_bytes);
    snprintf(load_ms, sizeof(load_ms), "%d", BT_LOAD_MS);
    snprintf(name, sizeof(name), "%s-%s-%d", x->w->name, bt_arm_names[x->a->kind], ++x->servers);
    char *extra[16] = {"--kv-cache-budget",
                       x->a->budget ? budget : "none",
                       "--prefix-cache-max-bytes",
                       "none",
                       "--prefix-cache-idle-s",
                       "0",
                       NULL};
    if (x->disk_dir[0]) {
        char *tier[] = {"--kv-disk-dir", x->disk_dir, "--kv-disk-bytes", cap, "--kv-disk-load-ms",
                        load_ms,         NULL};
        memcpy(extra + 6, tier, sizeof(tier));
    }
    if (launch_serve(e->bin, e->dir, name, e->o->preset, e->max_context, NULL, extra, false, NULL,
                     &x->srv) != 0) {
        snprintf(x->a->error, sizeof(x->a->error), "%s did not start (log %s/%s.log)", name, e->dir,
                 name);
        return -1;
    }
    struct timespec ts = {0, 300000000}; /* settle: the idle RSS after the model's load */
    nanosleep(&ts, NULL);
    if (x->servers == 1) x->a->rss_idle = launch_rss(&x->srv);
    char why[1600];
    if (cgroup_v1_make("pkv-bench-tiers", x->cg, sizeof(x->cg), why, sizeof(why)) != 0) {
        x->cg[0] = 0;
        if (x->servers == 1)
            fprintf(stderr, "bench tiers: %s has no memory cgroup of its own (%s)\n", name, why);
    } else if (cgroup_v1_adopt(x->cg, x->srv.pid) != 0) {
        fprintf(stderr, "bench tiers: cannot move %s into %s\n", name, x->cg);
        cgroup_v1_remove(x->cg);
        x->cg[0] = 0;
    }
    pthread_mutex_lock(&x->sp.lock);
    x->sp.cg = x->cg[0] ? x->cg : NULL;
    pthread_mutex_unlock(&x->sp.lock);
    bt_sampler_set(&x->sp, x->srv.pid, NULL);
    return 0;
}

/* Stop the server (sig, then SIGKILL at the deadline) and remove its cgroup. */
static void bt_server_stop(bt_run_t *x, int sig, uint64_t deadline_ns)
{
    bt_sampler_set(&x->sp, 0, NULL);
    pthread_mutex_lock(&x->sp.lock);
    x->sp.cg = NULL;
    pthread_mutex_unlock(&x->sp.lock);
    launch_stop(&x->srv, sig, deadline_ns);
    if (x->cg[0]) cgroup_v1_remove(x->cg);
    x->cg[0] = 0;
}

/* Restart: wait (bounded) for the writer's queue to drain, then SIGKILL and start anew. */
static int bt_server_restart(bt_run_t *x)
{
    double m[M_N];
    uint64_t end = pkv_now_ns() + BT_DRAIN_NS;
    for (;;) {
        if (bt_scrape(x, m)) return -1;
        if (m[M_QUEUED] <= 0 || pkv_now_ns() >= end) break;
        struct timespec ts = {0, 20000000};
        nanosleep(&ts, NULL);
    }
    x->a->kill_queued = (uint64_t)m[M_QUEUED];
    if (bt_server_account(x)) return -1;
    bt_server_stop(x, SIGKILL, pkv_now_ns() + 10 * BT_NS);
    return bt_server_start(x);
}

/* ---- rounds ------------------------------------------------------------------------------ */

/* Round r's requests, one at a time. results[u] for user u. 0, or -1 with a->error. */
static int bt_round_send(bt_run_t *x, uint32_t r, lg_result_t *res)
{
    bt_work_t *w = x->w;
    lg_req_t req[BT_MAX_USERS];
    int rc = 0;
    for (uint32_t u = 0; u < w->users; u++) {
        req[u] = (lg_req_t){.path = "/v1/chat/completions", .stream = true};
        if (!(req[u].body = bt_body(x->e, w, u, r))) rc = -1;
    }
    lg_config_t cfg = {.base_url = x->srv.url,
                       .concurrency = 1,
                       .stop = x->e->stop,
                       .timeout_ms = (uint32_t)(x->e->o->request_timeout_s * 1000)};
    if (!rc && lg_run(&cfg, req, w->users, res) < 0) rc = -1;
    for (uint32_t u = 0; u < w->users; u++) free(req[u].body);
    for (uint32_t u = 0; !rc && u < w->users; u++) {
        const lg_result_t *g = &res[u];
        if (g->status != 200 || g->answer.error_code[0] || !g->answer.done) {
            snprintf(x->a->error, sizeof(x->a->error),
                     "round %u user %u: HTTP %ld %.90s %.120s (log %.200s)", r + 1, u + 1,
                     g->status, g->transport, g->excerpt, x->srv.log);
            rc = -1;
        }
    }
    if (rc && !x->a->error[0]) snprintf(x->a->error, sizeof(x->a->error), "out of memory");
    return rc;
}

/* Round r's client figures, the answers checked (the reference keeps its own). */
static int bt_round_answers(bt_run_t *x, uint32_t r, const lg_result_t *res)
{
    bt_work_t *w = x->w;
    bt_round_t *rd = &x->a->round[r];
    double ttft[BT_MAX_USERS];
    for (uint32_t u = 0; u < w->users; u++) {
        const cluster_answer_t *an = &res[u].answer;
        size_t i = (size_t)r * w->users + u;
        ttft[u] = x->a->ttft_ms[i] = res[u].ttft_s * 1e3;
        rd->ttft_max_ms = PKV_MAX(rd->ttft_max_ms, ttft[u]);
        rd->prompt_tokens += (uint64_t)PKV_MAX(an->prompt_tokens, 0);
        uint64_t cached = (uint64_t)PKV_MAX(an->cached_tokens, 0);
        uint64_t disk = (uint64_t)PKV_MAX(an->cached_tokens_disk, 0);
        rd->cached_disk += disk;
        rd->cached_memory += cached - PKV_MIN(disk, cached);
        rd->requests++;
        if (x->a->kind == BT_REF && !(w->answer[i] = strndup(an->text, an->text_len))) return -1;
        bool same = strlen(w->answer[i]) == an->text_len &&
                    memcmp(w->answer[i], an->text, an->text_len) == 0 &&
                    an->completion_tokens == (long)w->max_tokens[i];
        rd->identical += same;
    }
    rd->ttft_p50_ms = lg_quantile(ttft, w->users, 0.5);
    x->a->requests += rd->requests;
    x->a->identical += rd->identical;
    return 0;
}

/* One round: metrics before, the requests, metrics after. 0, or -1 with a->error. */
static int bt_round_run(bt_run_t *x, uint32_t r)
{
    bt_round_t *rd = &x->a->round[r];
    double m0[M_N], m1[M_N];
    lg_result_t res[BT_MAX_USERS];
    memset(res, 0, sizeof(res));
    if (bt_scrape(x, m0)) return -1;
    bt_sampler_set(&x->sp, x->srv.pid, rd);
    int rc = bt_round_send(x, r, res);
    bt_sampler_set(&x->sp, x->srv.pid, NULL);
    if (!rc) rc = bt_round_answers(x, r, res);
    lg_results_free(res, x->w->users);
    if (rc || bt_scrape(x, m1)) return -1;
    rd->loaded_bytes = (uint64_t)(m1[M_LOADED] - m0[M_LOADED]);
    rd->load_s = m1[M_LOAD_SUM] - m0[M_LOAD_SUM];
    rd->decide_load = (uint64_t)(m1[M_DEC_LOAD] - m0[M_DEC_LOAD]);
    rd->decide_recompute = (uint64_t)(m1[M_DEC_RECOMPUTE] - m0[M_DEC_RECOMPUTE]);
    x->a->tier_bytes_max = PKV_MAX(x->a->tier_bytes_max, (uint64_t)m1[M_TIER_BYTES]);
    return 0;
}

static void bt_progress(const bt_run_t *x, uint32_t r)
{
    const bt_round_t *rd = &x->a->round[r];
    fprintf(stderr, "  %s %s round %u: TTFT p50 %.0f ms, max %.0f ms, cached %llu + %llu disk\n",
            x->w->name, bt_arm_names[x->a->kind], r + 1, rd->ttft_p50_ms, rd->ttft_max_ms,
            (unsigned long long)rd->cached_memory, (unsigned long long)rd->cached_disk);
}

static int bt_rounds(bt_run_t *x)
{
    for (uint32_t r = 0; r < x->w->rounds; r++) {
        if (*x->e->stop) {
            snprintf(x->a->error, sizeof(x->a->error), "interrupted");
            return -1;
        }
        if (x->a->kind == BT_RESTART && r + 1 == x->w->restart_round && bt_server_restart(x))
            return -1;
        if (bt_round_run(x, r)) return -1;
        bt_progress(x, r);
    }
    return bt_server_account(x);
}

void bt_arm_run(const bt_env_t *e, bt_work_t *w, int kind, bt_arm_t *a)
{
    memset(a, 0, sizeof(*a));
    a->kind = kind;
    a->ran = true;
    a->budget = kind == BT_REF ? 0 : e->budget;
    a->disk_cap = kind >= BT_DISK ? e->o->disk_bytes : 0;
    bt_run_t x = {.e = e, .w = w, .a = a};
    if (kind >= BT_DISK)
        snprintf(x.disk_dir, sizeof(x.disk_dir), "%s/%s-%s", e->dir, w->name, bt_arm_names[kind]);
    a->ttft_ms = calloc((size_t)w->users * w->rounds, sizeof(double));
    x.sp.arm = a;
    x.sp.dir = x.disk_dir[0] ? x.disk_dir : NULL;
    if (!a->ttft_ms || pthread_mutex_init(&x.sp.lock, NULL)) {
        snprintf(a->error, sizeof(a->error), "out of memory");
        return;
    }
    uint64_t t0 = pkv_now_ns();
    bool sampling = pthread_create(&x.sp.th, NULL, bt_sampler_main, &x.sp) == 0;
    int rc = sampling ? bt_server_start(&x) : -1;
    if (!sampling) snprintf(a->error, sizeof(a->error), "cannot start the sampler thread");
    if (!rc) rc = bt_rounds(&x);
    if (x.srv.pid > 0) bt_server_stop(&x, SIGTERM, pkv_now_ns() + 30 * BT_NS);
    if (sampling) {
        pthread_mutex_lock(&x.sp.lock);
        x.sp.stop = true;
        pthread_mutex_unlock(&x.sp.lock);
        pthread_join(x.sp.th, NULL);
    }
    pthread_mutex_destroy(&x.sp.lock);
    a->wall_s = (double)(pkv_now_ns() - t0) / BT_NS;
    a->ok = rc == 0;
}

void bt_arm_free(bt_arm_t *a)
{
    free(a->ttft_ms);
    a->ttft_ms = NULL;
}

/* ---- the temporary directory ------------------------------------------------------------- */

/* Remove the files directly in dir whose name ends with `suffix` ("" any), then dir itself
 * when `rmdir_too`. */
static void bt_dir_clear(const char *dir, const char *suffix, bool rmdir_too)
{
    DIR *d = opendir(dir);
    if (!d) return;
    size_t sl = strlen(suffix);
    for (struct dirent *de; (de = readdir(d));) {
        size_t nl = strlen(de->d_name);
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..") || nl < sl ||
            strcmp(de->d_name + nl - sl, suffix))
            continue;
        unlinkat(dirfd(d), de->d_name, 0);
    }
    closedir(d);
    if (rmdir_too) rmdir(dir);
}

void bt_env_cleanup(const bt_env_t *e, bool keep_logs)
{
    static const char *const works[] = {"multiround", "tile"};
    for (int wi = 0; wi < 2; wi++)
        for (int k = BT_DISK; k < BT_ARMS; k++) {
            char d[192];
            snprintf(d, sizeof(d), "%s/%s-%s", e->dir, works[wi], bt_arm_names[k]);
            bt_dir_clear(d, "", true);
        }
    if (keep_logs) {
        fprintf(stderr, "server logs kept in %s\n", e->dir);
        return;
    }
    bt_dir_clear(e->dir, ".log", true);
}
