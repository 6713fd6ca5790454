/*
 * Private to src/server/ and its tests; internals prefixed srv_ / SRV_; no module interface.
 *
 * server internals shared by server.c and metrics.c: the server's own counters and the
 * renderers of /metrics and /v1/cache/stats.
 */
#ifndef PKV_SERVER_INT_H
#define PKV_SERVER_INT_H

#include "pagekv/engine.h"
#include "pagekv/kv.h"
#include "pagekv/server.h"
#include "pagekv/stage.h"
#include "pagekv/xfer.h"
#include "server/request.h"

#include <jansson.h>
#include <stdio.h>

typedef enum {
    SRV_ROUTE_COMPLETIONS = 0,
    SRV_ROUTE_CHAT,
    SRV_ROUTE_MODELS,
    SRV_ROUTE_MODEL,
    SRV_ROUTE_HEALTH,
    SRV_ROUTE_METRICS,
    SRV_ROUTE_CACHE_STATS,
    SRV_ROUTE_CACHE_RESET,
    SRV_ROUTE_CACHE_LOOKUP,
    SRV_ROUTE_CACHE_DIGEST,
    SRV_ROUTE_PEAKS_RESET,
    SRV_ROUTE_OTHER,
    SRV_ROUTE_COUNT
} srv_route_t;
extern const char *const srv_route_label[SRV_ROUTE_COUNT];

/* The statuses the server answers with (metrics labels). */
#define SRV_N_CODES 9
extern const int srv_codes[SRV_N_CODES];
int srv_code_index(int status);

typedef enum {
    SRV_REJ_INVALID = 0,    /* malformed or out-of-range request (400) */
    SRV_REJ_MODEL,          /* unknown model (404) */
    SRV_REJ_CONTEXT,        /* prompt + max_tokens beyond the context (400) */
    SRV_REJ_KV_BUDGET,      /* can never fit the KV budget (400) */
    SRV_REJ_QUEUE_FULL,     /* 429 */
    SRV_REJ_BODY_TOO_LARGE, /* 413 */
    SRV_REJ_SHUTTING_DOWN,  /* 503 */
    SRV_REJ_COUNT
} srv_rejection_t;
extern const char *const srv_rejection_label[SRV_REJ_COUNT];

#define SRV_HIST_BUCKETS 14
extern const double srv_hist_bounds[SRV_HIST_BUCKETS]; /* seconds, ascending */
/* Transfer phases are sub-millisecond to seconds: finer buckets. */
#define SRV_PHASE_BUCKETS 18
extern const double srv_phase_bounds[SRV_PHASE_BUCKETS];
#define SRV_HIST_MAX_BUCKETS 18
typedef struct {
    uint64_t bucket[SRV_HIST_MAX_BUCKETS + 1]; /* per bucket (not cumulative); then +Inf */
    uint64_t count;
    double sum;
} srv_hist_t;
/* Count `seconds` in h over the default bounds (srv_hist_add) or the given ones. */
void srv_hist_add(srv_hist_t *h, double seconds);
void srv_hist_add_in(srv_hist_t *h, const double *bounds, int n, double seconds);

/* The phases of a disaggregated request, each measured on the node where it happens
 * (docs/design/server.md, "Observability"). */
typedef enum {
    SRV_PHASE_PREFILL_QUEUE = 0, /* prefill: submission -> admission */
    SRV_PHASE_PREFILL_COMPUTE,   /* prefill: admission -> the first token */
    SRV_PHASE_LEASE_WAIT,        /* prefill: registered -> the decode leg's READ accepted */
    SRV_PHASE_HANDSHAKE,         /* decode: pull started -> endpoint to the producer up */
    SRV_PHASE_STAGING_WAIT,      /* both: waiting for this node's staging pages */
    SRV_PHASE_WIRE,              /* decode: READ sent -> last payload in; prefill: staged,
                                    sent and acknowledged (seated -> ACK) */
    SRV_PHASE_COMMIT,            /* decode: last payload -> every layer stored and recorded */
    SRV_PHASE_DECODE,            /* decode: the leg's submission -> its last token */
    SRV_PHASE_COUNT
} srv_phase_t;
extern const char *const srv_phase_label[SRV_PHASE_COUNT];

/* One request's phases on this node, for the X-Pagekv-Timings opt-in. */
typedef struct {
    uint64_t ns[SRV_PHASE_COUNT];
    uint32_t have; /* bit per phase measured */
    bool pulled;   /* a decode leg that pulled: the figures below */
    uint64_t pulled_bytes;
    uint32_t pulled_blocks, adopted_blocks;
} srv_timings_t;
/* The timings object of a response (new reference; NULL on no memory). */
json_t *srv_timings_json(const srv_timings_t *t, pkv_server_role_t role);

typedef struct {
    uint64_t http[SRV_ROUTE_COUNT][SRV_N_CODES];
    uint64_t rejected[SRV_REJ_COUNT];
    uint64_t disconnects; /* generation requests whose client went away first */
    uint64_t in_flight;   /* generation requests being served */
    uint64_t streams;     /* streamed responses started */
    uint64_t cache_resets;
    srv_hist_t ttft; /* submit -> first token read */
    srv_hist_t e2e;  /* submit -> finished */
} srv_counters_t;

/* ---- roles (kvnode.c): the transfer agent and staging of a prefill or decode node ---- */
typedef struct srv_kvnode srv_kvnode_t;

/* Leases (prefill legs' registrations) by how they ended. */
typedef struct {
    uint64_t offered;   /* registered under a lease */
    uint64_t sent;      /* a decode leg read and acknowledged them */
    uint64_t expired;   /* no decode leg within the lease: the pins returned */
    uint64_t cancelled; /* unregistered */
    uint64_t shutdown;  /* ended by the agent's destroy */
} srv_lease_counts_t;

/* Decode legs' pulls. */
typedef struct {
    uint64_t ok;             /* legs that pulled the blocks the local prefix cache lacked */
    uint64_t released;       /* legs that needed none: a token-only release */
    uint64_t failed;         /* the read (or the sequence for it) failed */
    uint64_t recomputed;     /* of those, computed here instead (--kv-load-failure recompute) */
    uint64_t local;          /* requests without kv_transfer_params, computed here */
    uint64_t blocks_pulled;  /* of ok legs: blocks read from the producer */
    uint64_t blocks_adopted; /* of ok and released legs: blocks the local prefix cache held */
    uint64_t inflight;       /* reads of decode legs started and not yet ended */
    uint64_t inflight_peak;  /* high-water of inflight in the peaks' window */
} srv_pull_counts_t;

/* One tensor-parallel rank of a node in a snapshot. */
typedef struct {
    const char *address; /* its agent's bound "host:port" */
    uint16_t port;       /* its remote_port */
    uint32_t head_lo, head_n;
    uint64_t pinned_bytes, resident_bytes, resident_peak_bytes; /* its staging */
    uint32_t pages_used, pages_peak_used;
    uint64_t bytes_sent, bytes_received, active_transfers; /* its agent */
} srv_kv_rank_snapshot_t;

typedef struct {
    pkv_server_role_t role;
    uint32_t tp;           /* ranks; xs and ss sum them */
    const char *address;   /* rank 0's agent's bound "host:port" (valid for the node's life) */
    const char *advertise; /* remote_host */
    uint16_t port;         /* remote_port */
    const char *engine_id; /* remote_engine_id */
    uint32_t lease_ms, transfer_timeout_ms;
    int64_t staging_idle_ms; /* -1: never returned */
    pkv_xfer_stats_t xs;
    pkv_stage_stats_t ss;
    srv_lease_counts_t leases;
    srv_pull_counts_t pulls;
    srv_hist_t phases[SRV_PHASE_COUNT];
    uint64_t agent_age_ns; /* since the oldest rank's progress loop last began a round */
    bool agent_alive;      /* every rank's */
    srv_kv_rank_snapshot_t ranks[PKV_KV_MAX_TP]; /* [tp] (last: filled only up to tp) */
} srv_kv_snapshot_t;

/* Create the staging and the agent of each tensor-parallel rank of a prefill or decode node
 * over the paged pool kv (model_id: the layout descriptor's model, checked at handshakes).
 * PKV_ERR_INVALID (logged) for a dense pool or a bad staging configuration; the agent's
 * PKV_ERR_IO when its address cannot be bound. */
int srv_kvnode_create(const pkv_server_config_t *cfg, pkv_kv_t *kv, uint32_t max_context,
                      const char *model_id, srv_kvnode_t **out);
/* Destroy the agent (its registrations end, their pins return), then the staging. */
void srv_kvnode_destroy(srv_kvnode_t *n);
const char *srv_kvnode_address(const srv_kvnode_t *n);
/* A progress loop that has not begun a round for this long is stuck (/health 503). */
#define SRV_AGENT_STALL_NS 2000000000ull
/* The pool's smaps reading (hugepages.pool_*) is reused for this long (server.c). */
#define SRV_PAGES_MAX_AGE_NS 5000000000ull
/* Whether the agent can serve (for /health): it runs, is not shutting down, and its
 * progress thread beat within SRV_AGENT_STALL_NS. *age_ns: since that beat. */
bool srv_kvnode_healthy(srv_kvnode_t *n, uint64_t *age_ns);
/* Count phase ph of one request, [from_ns, to_ns), in the node's histogram and (t not
 * NULL) in the request's timings. */
void srv_kvnode_observe(srv_kvnode_t *n, srv_timings_t *t, srv_phase_t ph, uint64_t from_ns,
                        uint64_t to_ns);
void srv_kvnode_snapshot(srv_kvnode_t *n, srv_kv_snapshot_t *out);
/* Prefill leg: register blocks[0..nb) (the prompt ids[0..n_prompt), in sequence order)
 * until now + the lease under an id bound to pagekv's own request serial and the prompt
 * (never the client's X-Request-Id), and build the response's kv_transfer_params (new
 * reference). PKV_OK, or the agent's error (nothing registered). */
int srv_kvnode_offer(srv_kvnode_t *n, uint64_t serial, const uint32_t *blocks, uint32_t nb,
                     const int32_t *ids, uint32_t n_prompt, json_t **params);
/* Decode leg: the handle `params` (a kv_transfer_params object) describe, checked against
 * this node and the prompt ids[0..n_prompt), pulled by the transfer deadline into a new
 * sequence of the pool (salt: the request's) whose full blocks the engine then adopts as
 * a prefix hit. PKV_OK with *out (the caller frees it once the request is admitted; NULL
 * when the pull failed and --kv-load-failure recompute says to compute the prompt), or
 * *err: 400 for params that are wrong or that the producer refused, 503/502 for transfer
 * failures. A pull that succeeded puts its phases (handshake, staging wait, wire, commit)
 * in the node's histograms and in *t (may be NULL). */
int srv_kvnode_pull(srv_kvnode_t *n, const json_t *params, const int32_t *ids, uint32_t n_prompt,
                    uint64_t salt, pkv_seq_t **out, srv_timings_t *t, srv_error_t *err);
/* A decode node computes a request that came without kv_transfer_params (counted). */
void srv_kvnode_count_local(srv_kvnode_t *n);
/* POST /v1/kv_transfer/peaks/reset: the high-water marks of the window that ends now
 * (since the node started or the previous reset) as {window_ms, staging: {page_bytes,
 * pages_peak_used, transfers_peak, resident_peak_bytes} (summed over ranks as
 * /v1/cache/stats sums them), pulls: {inflight_peak}}, and a new window starting from the
 * values now (new reference; NULL on no memory). /v1/cache/stats reports the open window's. */
json_t *srv_kvnode_peaks_reset(srv_kvnode_t *n);
/* The kv_transfer_params section of /v1/cache/stats (new reference; NULL on no memory). */
json_t *srv_kv_stats_json(const srv_kv_snapshot_t *k);

/* ---- the cache yields memory (memwatch.c) ------------------------------------------- */

/* The pool's prefix-cache policy from the server's configuration: kc->cache_max_bytes
 * (auto: budget / 4, or an eighth of the machine's memory with no budget) and
 * kc->cache_idle_ms. PKV_ERR_INVALID (logged) for a cap of 0 bytes. */
int srv_cache_policy(const pkv_server_config_t *cfg, uint64_t budget, pkv_kv_config_t *kc);

/* The watcher: thread "pkv-memwatch" applies the idle time-to-live (pkv_kv_trim) on a timer
 * and, unless cfg->no_memory_watch, reads the memory left (prim) every poll and holds the
 * cache out of the reserve (pkv_kv_cache_pressure). */
typedef struct srv_memwatch srv_memwatch_t;
typedef struct {
    bool running;       /* a watcher thread runs (a paged pool with a TTL or the watch on) */
    bool watching;      /* memory readings on */
    const char *source; /* tightest source at the last reading: "cgroup_v2", "cgroup_v1",
                           "meminfo" or "none" */
    uint64_t limit_bytes, usage_bytes, room_bytes, reserve_bytes; /* of that source */
    bool have_psi;
    double psi_some_avg10;
    bool guarding;           /* the cache is held out of the reserve now (an episode) */
    uint64_t episodes;       /* episodes begun (each logged once) */
    uint64_t cache_limit;    /* the pressure limit set (PKV_KV_NO_LIMIT: none) */
    uint64_t readings;       /* memory readings taken */
    uint64_t trim_evictions; /* blocks the timer evicted as idle */
} srv_memwatch_stats_t;
/* Start the watcher over kv (not started for the dense backend, nor when there is neither a
 * TTL nor a watch: *out is then NULL and PKV_OK). PKV_ERR_NOMEM when the thread cannot
 * start. */
int srv_memwatch_create(const pkv_server_config_t *cfg, pkv_kv_t *kv, srv_memwatch_t **out);
/* Stop and join the thread. NULL is a no-op. */
void srv_memwatch_destroy(srv_memwatch_t *w);
/* NULL w: a stats block saying nothing runs. */
void srv_memwatch_stats(srv_memwatch_t *w, srv_memwatch_stats_t *out);
/* The "memory" section of /v1/cache/stats and the cache policy fields of its
 * "prefix_cache" section, added to doc; the /metrics families of both. */
void srv_cache_policy_json(json_t *doc, const pkv_kv_stats_t *ks, const srv_memwatch_stats_t *m);
void srv_cache_policy_render(FILE *f, const pkv_kv_stats_t *ks, const srv_memwatch_stats_t *m);

/* One snapshot of the server's, the engine's and the KV cache's counters: what /metrics
 * and /v1/cache/stats render (server.c takes it, metrics.c renders it). */
typedef struct {
    srv_counters_t ctr;
    pkv_engine_stats_t es;
    pkv_kv_stats_t ks;
    uint64_t rss_bytes;    /* the process's VmRSS (0: unknown, omitted from /metrics) */
    uint64_t locked_bytes; /* its VmLck (mlocked memory), beside the staging's pinned bytes */
    pkv_backend_t backend;
    uint32_t block_tokens;
    bool huge, huge_probe; /* the pool asks for THP; the startup probe got a huge page */
    const char *thp_mode;  /* the kernel's THP mode at startup */
    bool pages_ok;         /* paged: the pool's range read from smaps (pkv_kv_pages) */
    uint64_t pages_age_ns; /* how old that reading is (at most SRV_PAGES_MAX_AGE_NS) */
    uint64_t pool_resident_bytes, pool_huge_bytes; /* of which in huge pages */
    bool has_kv;                                   /* a prefill or decode node: kv filled */
    srv_kv_snapshot_t kv;
    srv_memwatch_stats_t mw; /* the cache policy's watcher */
} srv_snapshot_t;

/* Prometheus text exposition (malloc'd, NUL-terminated; *len without the NUL). NULL on
 * allocation failure. */
char *srv_metrics_render(const srv_snapshot_t *snap, size_t *len);
/* The /v1/cache/stats document (new reference; NULL on allocation failure). */
json_t *srv_cache_stats_json(const srv_snapshot_t *snap);

#endif
