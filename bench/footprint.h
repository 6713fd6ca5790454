/*
 * `pagekv bench footprint` (bench/bench_footprint.c: options and the main loop), its
 * shared types and the functions its files give each other:
 *   footprint_http.c      JSON requests (support/http.h) and the server's /v1/cache/stats fields
 *   footprint_server.c    starting, watching and stopping `pagekv serve` (support/launch.h)
 *   footprint_sampler.c   the memory and counter samplers, a run's phases and progress
 *   footprint_scenarios.c chat requests and the scenarios
 *   footprint_run.c       one (scenario, backend, repeat) run from spawn to summary
 *   footprint_report.c    the tables, targets, JSON and SVG plots
 * The pure pieces (filler, trace windows, kv_min, the SVG writer) are in
 * support/footprint.h, where the suite checks them.
 */
#ifndef PKV_BENCH_FOOTPRINT_H
#define PKV_BENCH_FOOTPRINT_H

#include "support/footprint.h"
#include "support/http.h"
#include "support/launch.h"

#include "pagekv/kv.h"
#include "prim/prim.h"

#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define FP_NS       1000000000ull
#define FP_MIB      (1024.0 * 1024.0)
#define FP_MAX_PASS 64

enum {
    SC_IDLE,
    SC_BURST,
    SC_SEQSHARE,
    SC_MULTITURN,
    SC_CHURN,
    SC_DISTINCT,
    SC_CHURN_IDLE, /* churn_then_idle: the cache returns memory after the idle period */
    SC_HANGUPS,    /* 40 streaming clients hang up early */
    SC_N
};
/* The scenarios that run the server with a short prefix-cache idle period and settle for
 * that period too. */
static inline bool fp_scenario_idles(int sc)
{
    return sc == SC_CHURN_IDLE || sc == SC_HANGUPS;
}
extern const char *const fp_scenario_names[SC_N];

enum { PH_LOAD, PH_SETTLE_LOAD, PH_SCENARIO, PH_SETTLE, PH_N };
extern const char *const fp_phase_names[PH_N];

typedef struct {
    bool scenario[SC_N];
    bool backend[2]; /* indexed by pkv_backend_t */
    uint32_t repeat;
    const char *json_path, *svg_dir, *server_bin;
    double settle_load_s, settle_s, idle_s;
    const char *preset;     /* the server's --preset (default llama-3.2-1b) */
    uint32_t prefix_tokens; /* shared_prefix_burst's system prompt, in tokens (default 3700;
                               4200 with qwen3-0.6b: the first report's two cases) */
    uint64_t churn_budget;  /* --kv-cache-budget for churn; 0: none */
    double cache_idle_s;    /* --prefix-cache-idle-s for churn_then_idle and hangups */
    double request_timeout_s;
    bool keep_logs;
    const char *pass[FP_MAX_PASS]; /* server flags after `--` */
    int n_pass;
} fp_opts_t;

static inline double fp_mib(uint64_t b)
{
    return (double)b / FP_MIB;
}

/* ---- one run's record ------------------------------------------------------------------ */

typedef struct {
    uint64_t begin_ns, end_ns;
    pkv_fp_window_t w;
    uint64_t hwm_bytes; /* VmHWM at the end after a reset at the start; 0: unavailable */
    bool hwm_reset;     /* the reset at the start worked */
    bool have_smaps;
    pkv_prim_smaps_t smaps;
    pkv_prim_mem_t mem; /* /proc/PID/status at the end */
} fp_phase_t;

typedef struct {
    uint64_t t_ns;
    uint64_t committed;
    uint64_t live_blocks;
} fp_kv_sample_t;

typedef struct {
    int scenario;
    pkv_backend_t backend;
    uint32_t repeat;
    bool ok;
    char error[600];
    char log_path[96];
    char server_cmd[1024];
    uint64_t start_ns, ready_ns;
    fp_phase_t ph[PH_N];
    pkv_fp_sample_t *samples;
    size_t n_samples;
    fp_kv_sample_t *kv;
    size_t n_kv;
    pkv_fp_req_t *reqs;
    double *req_wall_s;
    size_t n_reqs, cap_reqs;
    /* summary */
    uint64_t peak_bytes, last_bytes, settled_bytes, baseline_bytes;
    uint64_t prompt_tokens, completion_tokens, cached_tokens;
    double wall_s;
    json_t *stats, *stats_after_reset; /* the server's /v1/cache/stats objects */
    uint64_t kv_committed_peak, kv_committed_polled_max, kv_live_polled_max_bytes, kv_min;
    /* OS against the counters, at the end of settle: anonymous memory grown since the end
     * of settle_load (smaps_rollup) and the KV cache's committed bytes then. */
    int64_t anon_growth;
    uint64_t kv_committed_end;
    uint64_t block_bytes, token_bytes, granule_bytes, storage_ranges, budget;
    uint32_t block_tokens;
    bool ranges_assumed; /* the server did not report storage_ranges */
    bool have_reset;
    uint64_t committed_after_reset;
    /* churn_then_idle, hangups: how the cache gave its memory back after the scenario */
    uint64_t before_bytes;    /* VmRSS after a warm-up request and the idle period, just
                                 before the load: the level to come back to */
    uint64_t kv_scenario_end; /* KV committed at the last poll of the scenario */
    double return_kv_s;       /* scenario end -> committed <= one granule per range; -1 never */
    double return_rss_s;      /* scenario end -> RSS within the tolerance of baseline; -1 never */
    uint32_t hangups;         /* streams the client cut */
    int exit_status;          /* fp_server_stop's code: 0 a clean exit after SIGTERM */
    char exit_text[48];
} fp_run_t;

/* ---- HTTP (footprint_http.c) ----------------------------------------------------------- */

/* GET or POST (method) 127.0.0.1:port + path, no body, with the HTTP client
 * (support/http.h): the 200 answer's JSON in *out (caller decrefs); else an error code
 * and the reason in err. */
int fp_http_json(int port, const char *method, const char *path, double timeout_s, json_t **out,
                 char *err, size_t errlen);

/* Find a non-negative number by any of `names` ("a" or "a.b" for a field of an object);
 * false when none is there (JSON null counts as absent). */
bool fp_stat(json_t *o, const char *const *names, uint64_t *out);
/* /v1/cache/stats field names (src/server/metrics.c). */
extern const char *const K_COMMITTED[],
    *const K_PEAK[], *const K_BLOCK_BYTES[], *const K_TOKEN_BYTES[],
                                                 *const K_BLOCK_TOKENS[],
                                                     *const K_GRANULE[], *const K_RANGES[],
                                                                             *const K_BUDGET[],
                                                                                 *const K_LIVE[];

/* ---- the server process (footprint_server.c) ------------------------------------------- */

/* fp_server_stop's code for a server that had to be killed. */
#define FP_SERVER_KILLED (-1)
/* Start the server (argv[0] is replaced by o->server_bin) with stdout/stderr to
 * run->log_path. On failure run->error says why. */
int fp_server_spawn(const fp_opts_t *o, fp_run_t *run, const char *const *argv, launch_proc_t *out);
/* Wait for its listening line, then for /health. On failure the server is gone
 * (killed if it was still there) and run->error says why. */
int fp_server_wait_ready(fp_run_t *run, launch_proc_t *srv);
/* SIGTERM (the server drains and exits), SIGKILL after 30 s. Returns its exit code
 * (launch_stop's), or FP_SERVER_KILLED when it had to be killed. */
int fp_server_stop(launch_proc_t *s);
/* "exit 0", "signal 9", ... for a code from fp_server_stop. */
void fp_exit_text(int code, char *out, size_t cap);

/* ---- samplers and phases (footprint_sampler.c) ----------------------------------------- */

/* Two threads share one control block: "fp-rss" reads the server's VmRSS (prim) every
 * 100 ms; "fp-stats" (started once the server is ready) reads /v1/cache/stats every
 * 250 ms. Each appends to its own arrays, which only it touches until joined. */
typedef struct {
    pid_t pid;
    int port;
    pthread_mutex_t lock; /* guards stop, last_rss, last_committed */
    pthread_cond_t cond;
    bool stop;
    uint64_t last_rss, last_committed;
    /* fp-rss's own until joined */
    pkv_fp_sample_t *s;
    size_t n, cap;
    /* fp-stats's own until joined */
    fp_kv_sample_t *k;
    size_t nk, capk;
    pthread_t rss_thread, stats_thread;
    bool rss_started, stats_started;
} fp_sampler_t;

/* Start fp-rss on pid. */
int fp_sampler_init(fp_sampler_t *sp, pid_t pid);
/* Start fp-stats on the server's port. */
int fp_sampler_start_stats(fp_sampler_t *sp, int port);
/* Stop and join both threads; the arrays move to the run. */
void fp_sampler_fini(fp_sampler_t *sp, fp_run_t *run);

/* A run in progress. */
typedef struct {
    const fp_opts_t *o;
    fp_run_t *run;
    fp_sampler_t *sp;
    launch_proc_t *srv;
    char model[128];
    const char *phase;
    uint64_t phase_t0;
    unsigned index, total;
    bool progress;
    uint64_t last_progress_ns;
    uint32_t done_reqs, total_reqs;
    double chars_per_token;
} fp_ctx_t;

/* The progress line on stderr (at most every 0.5 s unless force). */
void fp_progress(fp_ctx_t *c, bool force);
/* Idle for `s` seconds, updating the progress line. */
void fp_idle(fp_ctx_t *c, double s);
/* A phase's start (VmHWM reset) and end (VmHWM, status and smaps_rollup of the server). */
void fp_phase_begin(fp_ctx_t *c, int ph, const char *label);
void fp_phase_end(fp_ctx_t *c, int ph);

/* ---- scenarios (footprint_scenarios.c) ------------------------------------------------- */

/* Run c->run->scenario against the ready server; its requests go into c->run. */
int fp_scenario_run(fp_ctx_t *c);

/* ---- runs (footprint_run.c) ------------------------------------------------------------ */

/* One run from spawn to summary; r->ok and r->error say how it went. */
void fp_run_one(const fp_opts_t *o, fp_run_t *r, unsigned index, unsigned total,
                double chars_per_token);
void fp_run_free(fp_run_t *r);

/* ---- report (footprint_report.c) ------------------------------------------------------- */

typedef struct {
    const char *name;
    int state; /* 1 met, 0 missed, -1 not measured */
    char detail[400];
} fp_target_t;

enum { FP_N_TARGETS = 7 };
/* RSS after the idle period, relative to baseline: churn_then_idle and hangups. */
static inline double fp_return_tolerance(int sc)
{
    return sc == SC_HANGUPS ? 0.10 : 0.05;
}
/* The targets, from the runs; returns how many (FP_N_TARGETS). */
int fp_targets(const fp_opts_t *o, fp_run_t *runs, size_t n, fp_target_t *t);
/* The Markdown tables and targets on stdout. */
void fp_print_report(const fp_opts_t *o, fp_run_t *runs, size_t n, fp_target_t *t, int nt);
/* --json and --svg; 0, or -1 with a message on stderr. */
int fp_write_json(const fp_opts_t *o, fp_run_t *runs, size_t n, fp_target_t *t, int nt, double cpt);
int fp_write_svgs(const fp_opts_t *o, fp_run_t *runs, size_t n);

#endif
