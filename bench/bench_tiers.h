/*
 * `pagekv bench tiers` (docs/design/bench_tiers.md): the field's multi-round QA workload and
 * its long-document "tile" order against fresh `pagekv serve` processes, a reference pass
 * with ample KV and no tier, then three arms on one small KV budget: recompute (no tier),
 * disk (the tier) and restart (the tier, the server SIGKILLed after round R/2 and replaced
 * on the same directory).
 *   bench_tiers.c         options and the main loop
 *   bench_tiers_run.c     the workloads, the servers, one arm's rounds, the sampler
 *   bench_tiers_report.c  the targets, the Markdown, the JSON and the SVG
 * Processes: support/launch.h; HTTP and answers: support/loadgen.h, support/cluster.h.
 */
#ifndef PKV_BENCH_TIERS_H
#define PKV_BENCH_TIERS_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define BT_MAX_USERS  64
#define BT_MAX_ROUNDS 32
#define BT_LOAD_MS    1000 /* the servers' --kv-disk-load-ms: the deadline the targets use */
#define BT_GRANULE    (2ull << 20) /* the pool's granule: a budget is whole granules */

enum { BT_REF, BT_RECOMPUTE, BT_DISK, BT_RESTART, BT_ARMS };
extern const char *const bt_arm_names[BT_ARMS]; /* "reference", "recompute", "disk", "restart" */

typedef struct {
    const char *preset, *json_path, *svg_path, *server_bin;
    uint32_t users, rounds;
    uint32_t system_tokens, history_tokens, question_tokens; /* multi-round prompt parts */
    uint32_t out_min, out_max;                               /* tokens out (ignore_eos) */
    uint32_t docs, doc_tokens;                               /* tile; docs 0: no tile */
    uint64_t kv_budget;  /* the arms' --kv-cache-budget; 0: derived (bt_budget_default) */
    uint64_t disk_bytes; /* the disk arms' --kv-disk-bytes */
    double request_timeout_s;
    bool keep_logs;
} bt_opts_t;

/* One workload: `users` conversations (multi-round) or documents (tile), each asked `rounds`
 * times, users taking turns (round 1: users 1..U, round 2: users 1..U, ...). */
typedef struct {
    const char *name; /* "multiround", "tile" */
    uint32_t users, rounds;
    char *system;           /* the shared system prompt; NULL: none */
    char **context;         /* [users]: the history's start, or the document */
    char **question;        /* [rounds * users], index r * users + u */
    uint32_t *max_tokens;   /* [rounds * users] */
    bool grows;             /* past questions and answers join the history */
    char **answer;          /* [rounds * users]: the reference pass's answers, which every
                               arm's history carries (so every arm sends the same prompts) */
    uint32_t restart_round; /* rounds / 2 + 1: the first round after the restart */
} bt_work_t;

/* One round of one arm: client figures (TTFT, usage), /metrics deltas, samples. */
typedef struct {
    uint32_t requests, identical;
    double ttft_p50_ms, ttft_max_ms;
    uint64_t prompt_tokens, cached_memory, cached_disk;
    uint64_t loaded_bytes; /* pagekv_kv_tier_loaded_bytes_total delta */
    double load_s;         /* pagekv_kv_tier_load_seconds_sum delta */
    uint64_t decide_load, decide_recompute;
    uint64_t rss_peak, rss_end;   /* VmRSS sampled over the round */
    uint64_t disk_peak, disk_end; /* the directory's file sizes, sampled */
    uint64_t cg_peak;             /* the server's memory cgroup's usage, sampled (0: none) */
} bt_round_t;

typedef struct {
    int kind; /* BT_REF .. BT_RESTART */
    bool ran, ok;
    char error[600];
    bt_round_t round[BT_MAX_ROUNDS];
    double *ttft_ms; /* [rounds * users] */
    uint32_t requests, identical;
    uint64_t rss_idle; /* VmRSS of the ready server before its first request (the first) */
    uint64_t rss_peak; /* every sample of every server of the arm */
    uint64_t cg_peak, cg_cache_peak; /* its memory cgroup's usage and page cache (0: none) */
    uint64_t disk_peak, disk_cap, disk_samples, disk_over; /* samples above the cap */
    uint64_t tier_bytes_max;         /* pagekv_kv_tier_bytes at the round ends, largest */
    uint64_t corrupt, load_timeouts; /* summed over the arm's servers */
    uint64_t past_deadline;          /* loads in load_seconds above BT_LOAD_MS */
    uint64_t dropped_evicted;        /* writes dropped because the block left first */
    uint64_t kill_queued;            /* restart: blocks still queued at the SIGKILL */
    uint64_t budget;                 /* its --kv-cache-budget, 0: none */
    double wall_s;
} bt_arm_t;

typedef struct {
    bt_work_t w;
    bt_arm_t arm[BT_ARMS];
} bt_part_t;

/* What every arm shares. */
typedef struct {
    const bt_opts_t *o;
    char bin[4096];  /* the pagekv binary the servers run */
    char dir[64];    /* the temporary directory: logs and the disk tiers' directories */
    double cpt;      /* filler characters per token */
    uint64_t budget; /* the arms' --kv-cache-budget */
    uint32_t max_context;
    const volatile sig_atomic_t *stop; /* SIGINT / SIGTERM seen */
} bt_env_t;

/* ---- bench_tiers_run.c ------------------------------------------------------------------ */
/* The KV bytes one token of the preset takes (f16, the servers' default dtype); 0 unknown. */
uint64_t bt_token_bytes(const char *preset);
/* The multi-round workload's KV at its end (every user's whole history), an estimate. */
uint64_t bt_working_set_bytes(const bt_opts_t *o);
/* The arms' default budget: 1.25 x the longest request's tokens, whole granules. */
uint64_t bt_budget_default(const bt_opts_t *o);
/* The longest request in tokens (prompt and answer), an estimate from the options. */
uint32_t bt_longest_tokens(const bt_opts_t *o);
/* Build the multi-round or the tile workload (answers empty). 0, or -1 out of memory. */
int bt_work_multiround(const bt_env_t *e, bt_work_t *w);
int bt_work_tile(const bt_env_t *e, bt_work_t *w);
void bt_work_free(bt_work_t *w);
/* Run one arm of a workload (the reference first: it fills w->answer). a->ok says how. */
void bt_arm_run(const bt_env_t *e, bt_work_t *w, int kind, bt_arm_t *a);
void bt_arm_free(bt_arm_t *a);
/* Remove the temporary directory: the tiers' directories always, the logs unless kept. */
void bt_env_cleanup(const bt_env_t *e, bool keep_logs);

/* ---- bench_tiers_report.c --------------------------------------------------------------- */
enum {
    BT_T_TTFT,      /* rounds >= 2: disk p50 <= 0.2 x recompute p50 */
    BT_T_RESTART,   /* restart_round: restart p50 <= 1.25 x disk p50 */
    BT_T_IDENTICAL, /* every answer equal to the reference's */
    BT_T_DISK,      /* directory bytes <= --kv-disk-bytes at every sample */
    BT_T_RSS,       /* RSS above idle <= budget + 64 MiB */
    BT_T_CORRUPT,   /* 0 corrupt records */
    BT_T_DEADLINE,  /* 0 requests waiting on the disk past their deadline */
    BT_N_TARGETS
};

typedef struct {
    const char *name;
    double value;
    char target[48]; /* "<= 0.2", "== 0", ... */
    int met;         /* 1 met, 0 missed, -1 not measured */
    char detail[400];
} bt_target_t;

void bt_targets(const bt_env_t *e, const bt_part_t *mr, const bt_part_t *tile, bt_target_t *t);
void bt_print_report(const bt_env_t *e, const bt_part_t *mr, const bt_part_t *tile,
                     const bt_target_t *t);
/* --json and --svg: 0, or -1 with a message on stderr. */
int bt_write_json(const bt_env_t *e, const bt_part_t *mr, const bt_part_t *tile,
                  const bt_target_t *t, double wall_s);
int bt_write_svg(const bt_env_t *e, const bt_part_t *mr);

#endif
