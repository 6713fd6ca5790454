/*
 * disagg: prefill/decode disaggregation, the module's interface for the server (not
 * installed; design in docs/design/disagg.md). A prefill or decode node owns, for each
 * tensor-parallel rank of its pool, a host staging and a transfer agent. A prefill leg
 * registers the prompt's blocks under a lease and answers with kv_transfer_params; a
 * decode leg checks those params against its own pool and prompt, plans which local rank
 * reads which heads from which producer rank (resharding when the two sides' TP differ),
 * pulls every read by one deadline into a new sequence, all or nothing, and hands the
 * sequence to the engine to adopt as a prefix hit. Each phase of a transfer is measured.
 *
 * Threads: every function may be called from any HTTP thread; the agents' callbacks run on
 * their progress threads, a decode node's pulls on its pull worker (pull.c). The node's
 * counters and histograms are under its lock (node.c).
 */
#ifndef PKV_DISAGG_DISAGG_H
#define PKV_DISAGG_DISAGG_H

#include "pagekv/kv.h"
#include "pagekv/server.h"
#include "pagekv/stage.h"
#include "pagekv/xfer.h"

#include "core/core.h"
#include "openai/openai.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

/* The phases of a disaggregated request, each measured on the node where it happens
 * (docs/design/disagg.md, "Observability"). */
typedef enum {
    PKV_DISAGG_PHASE_PREFILL_QUEUE = 0, /* prefill: submission -> admission */
    PKV_DISAGG_PHASE_PREFILL_COMPUTE,   /* prefill: admission -> the first token */
    PKV_DISAGG_PHASE_LEASE_WAIT,        /* prefill: registered -> the decode leg's READ accepted */
    PKV_DISAGG_PHASE_KV_ALLOC,  /* decode: the prompt's admission to the pool, its commit aside */
    PKV_DISAGG_PHASE_KV_COMMIT, /* decode: that admission's wait for the OS to commit granules
                                   (0 when free blocks or the warm floor served it) */
    PKV_DISAGG_PHASE_HANDSHAKE, /* decode: pull started -> endpoint to the producer up */
    PKV_DISAGG_PHASE_STAGING_WAIT, /* both: waiting for this node's staging pages */
    PKV_DISAGG_PHASE_WIRE,         /* decode: READ sent -> last payload in; prefill: staged,
                               sent and acknowledged (seated -> ACK) */
    PKV_DISAGG_PHASE_COMMIT,       /* decode: last payload -> every layer stored and recorded */
    PKV_DISAGG_PHASE_DECODE,       /* decode: the leg's submission -> its last token */
    PKV_DISAGG_PHASE_COUNT
} pkv_disagg_phase_t;
extern const char *const pkv_disagg_phase_label[PKV_DISAGG_PHASE_COUNT];
/* Transfer phases are sub-millisecond to seconds: finer buckets than a request's. */
#define PKV_DISAGG_PHASE_BUCKETS 18
extern const double pkv_disagg_phase_bounds[PKV_DISAGG_PHASE_BUCKETS];

/* The moments of a decode leg on its node (monotonic ns; 0: not reached), for the
 * X-Pagekv-Timings breakdown of its time to first byte (`decode_leg_ms`): libmicrohttpd
 * handed over the request's headers, then its whole body, the handler asked for the pull, the pull
 * worker began it and ended it, the connection resumed with it, the submission, the engine admitted
 * it (a given first token is emitted there), the handler saw the first output, its first bytes were
 * handed to libmicrohttpd (a stream that outlives its first output only: the timings ride its last
 * chunk). */
typedef enum {
    PKV_DISAGG_MARK_HEADERS = 0,
    PKV_DISAGG_MARK_ARRIVAL,
    PKV_DISAGG_MARK_PULL_ASKED,
    PKV_DISAGG_MARK_PULL_BEGIN,
    PKV_DISAGG_MARK_PULL_END,
    PKV_DISAGG_MARK_RESUMED,
    PKV_DISAGG_MARK_SUBMITTED,
    PKV_DISAGG_MARK_ADMITTED,
    PKV_DISAGG_MARK_SEEN,
    PKV_DISAGG_MARK_FIRST_WRITE,
    PKV_DISAGG_MARK_COUNT
} pkv_disagg_mark_t;
extern const char *const pkv_disagg_mark_label[PKV_DISAGG_MARK_COUNT];

/* One request's phases on this node, for the X-Pagekv-Timings opt-in. */
typedef struct {
    uint64_t ns[PKV_DISAGG_PHASE_COUNT];
    uint32_t have;                      /* bit per phase measured */
    uint64_t at[PKV_DISAGG_MARK_COUNT]; /* a decode leg's moments */
    bool pulled;                        /* a decode leg that pulled: the figures below */
    uint64_t pulled_bytes;
    uint32_t pulled_blocks, adopted_blocks;
} pkv_disagg_timings_t;

/* ---- the node: the transfer agent and staging of each rank of a prefill or decode node */
typedef struct pkv_disagg_node pkv_disagg_node_t;

/* Leases (prefill legs' registrations) by how they ended. */
typedef struct {
    uint64_t offered;   /* registered under a lease */
    uint64_t sent;      /* a decode leg read and acknowledged them */
    uint64_t expired;   /* no decode leg within the lease: the pins returned */
    uint64_t cancelled; /* unregistered */
    uint64_t shutdown;  /* ended by the agent's destroy */
} pkv_disagg_lease_counts_t;

/* Decode legs' pulls. */
typedef struct {
    uint64_t ok;             /* legs that pulled the blocks the local prefix cache lacked */
    uint64_t released;       /* legs that needed none: a token-only release */
    uint64_t failed;         /* the read (or the sequence for it) failed */
    uint64_t recomputed;     /* of those, computed here instead (--kv-load-failure recompute) */
    uint64_t local;          /* requests without kv_transfer_params, computed here */
    uint64_t blocks_pulled;  /* of ok legs: blocks read from the producer */
    uint64_t blocks_adopted; /* of ok and released legs: blocks the local prefix cache held */
    uint64_t first_used;     /* of ok legs: the pull took the prefill node's first token */
    uint64_t first_ignored;  /* legs whose pagekv_first did not match their sampling */
    uint64_t inflight;       /* reads of decode legs started and not yet ended */
    uint64_t inflight_peak;  /* high-water of inflight in the peaks' window */
} pkv_disagg_pull_counts_t;

/* One tensor-parallel rank of a node in a snapshot. */
typedef struct {
    const char *address; /* its agent's bound "host:port" */
    uint16_t port;       /* its remote_port */
    uint32_t head_lo, head_n;
    uint64_t pinned_bytes, resident_bytes, resident_peak_bytes; /* its staging */
    uint32_t pages_used, pages_peak_used;
    uint64_t bytes_sent, bytes_received, active_transfers; /* its agent */
} pkv_disagg_rank_snapshot_t;

typedef struct {
    pkv_server_role_t role;
    uint32_t tp;           /* ranks; xs and ss sum them */
    const char *address;   /* rank 0's agent's bound "host:port" (valid for the node's life) */
    const char *advertise; /* remote_host */
    uint16_t port;         /* remote_port */
    const char *engine_id; /* remote_engine_id */
    uint32_t lease_ms, transfer_timeout_ms;
    int64_t staging_idle_ms; /* -1: never returned */
    int64_t staging_warm_ms; /* the warm floor's life; -1: none */
    pkv_xfer_stats_t xs;
    pkv_stage_stats_t ss;
    pkv_disagg_lease_counts_t leases;
    pkv_disagg_pull_counts_t pulls;
    pkv_hist_t phases[PKV_DISAGG_PHASE_COUNT];
    uint64_t agent_age_ns; /* since the oldest rank's progress loop last began a round */
    bool agent_alive;      /* every rank's */
    pkv_disagg_rank_snapshot_t ranks[PKV_KV_MAX_TP]; /* [tp] (last: filled only up to tp) */
} pkv_disagg_snapshot_t;

/* Create the staging and the agent of each tensor-parallel rank of a prefill or decode node
 * over the paged pool kv (model_id: the layout descriptor's model, checked at handshakes).
 * PKV_ERR_INVALID (logged) for a dense pool or a bad staging configuration; the agent's
 * PKV_ERR_IO when its address cannot be bound. */
int pkv_disagg_node_create(const pkv_server_config_t *cfg, pkv_kv_t *kv, uint32_t max_context,
                           const char *model_id, pkv_disagg_node_t **out);
/* Destroy the agent (its registrations end, their pins return), then the staging. */
void pkv_disagg_node_destroy(pkv_disagg_node_t *n);
const char *pkv_disagg_node_address(const pkv_disagg_node_t *n);
/* A progress loop that has not begun a round for this long is stuck (/health 503). */
#define PKV_DISAGG_AGENT_STALL_NS 2000000000ull
/* Whether the agent can serve (for /health): it runs, is not shutting down, and its
 * progress thread beat within PKV_DISAGG_AGENT_STALL_NS. *age_ns: since that beat. */
bool pkv_disagg_node_healthy(pkv_disagg_node_t *n, uint64_t *age_ns);
/* Count phase ph of one request, [from_ns, to_ns), in the node's histogram and (t not
 * NULL) in the request's timings. */
void pkv_disagg_node_observe(pkv_disagg_node_t *n, pkv_disagg_timings_t *t, pkv_disagg_phase_t ph,
                             uint64_t from_ns, uint64_t to_ns);
void pkv_disagg_node_snapshot(pkv_disagg_node_t *n, pkv_disagg_snapshot_t *out);
/* A request's sampling as the first-token handoff binds it (docs/design/disagg.md, "The
 * first token"). A prefill leg's seed is the one it sampled with; a decode leg's is the
 * client's when has_seed. */
typedef struct {
    float temperature, top_p;
    bool has_seed;
    uint64_t seed;
    uint32_t vocab; /* decode leg: the model's; a first token at or past it is malformed */
} pkv_disagg_sampling_t;

/* What a decode leg takes with its sequence: given, the prefill leg's first token, which
 * the engine emits (pkv_request_params_t.first_given) with `seed` as the request's seed;
 * otherwise the engine computes the last prompt position. */
typedef struct {
    bool given;
    int32_t token;
    uint64_t seed;
} pkv_disagg_first_t;

/* Prefill leg: register blocks[0..nb) (the prompt ids[0..n_prompt), in sequence order)
 * until now + the lease under an id bound to pagekv's own request serial and the prompt
 * (never the client's X-Request-Id), and build the response's kv_transfer_params (new
 * reference), with first_token (>= 0; -1: none) bound to the registration and smp as
 * pagekv_first. PKV_OK, or the agent's error (nothing registered). */
int pkv_disagg_node_offer(pkv_disagg_node_t *n, uint64_t serial, const uint32_t *blocks,
                          uint32_t nb, const int32_t *ids, uint32_t n_prompt, int32_t first_token,
                          const pkv_disagg_sampling_t *smp, json_t **params);
/* ---- a decode leg's pull, which holds no caller thread while it runs
 * The handle `params` (a kv_transfer_params object) describe is checked against this node
 * and the prompt ids[0..n_prompt) on the caller's thread; the rest runs on the node's pull
 * worker ("pkv-pull") and the agents' progress threads: a new sequence of the pool (salt:
 * the request's) for the prompt, adopting what the prefix cache holds, the plan's reads by
 * the transfer deadline, all or nothing. done(arg) is called exactly once when the pull
 * has ended (unless it was abandoned first), on the pull worker, with no lock held; it
 * must not block and must not call back into the pull (it wakes the caller, who takes the
 * result). A pull always ends by its deadline + 1 s. */
typedef struct pkv_disagg_pull pkv_disagg_pull_t;
typedef void (*pkv_disagg_pull_done_fn)(void *arg);
/* PKV_OK with *out (the pull is queued), or *err: 400 for params that are wrong, 503
 * shutting_down when the node is being destroyed, 500 out of memory. ids are copied. A
 * pagekv_first that matches smp (the request's sampling) makes the pull read every prompt
 * position and the take hand over the first token; one that does not is ignored. */
int pkv_disagg_pull_start(pkv_disagg_node_t *n, const json_t *params, const int32_t *ids,
                          uint32_t n_prompt, uint64_t salt, const pkv_disagg_sampling_t *smp,
                          pkv_disagg_pull_done_fn done, void *arg, pkv_disagg_pull_t **out,
                          pkv_openai_error_t *err);
/* Whether the pull has ended (never blocks). */
bool pkv_disagg_pull_ended(pkv_disagg_pull_t *pl);
/* The result of a pull that has ended, and the pull freed. PKV_OK with *out (the caller
 * frees it once the request is admitted; NULL when the pull failed and --kv-load-failure
 * recompute says to compute the prompt here) and *first (whether the engine emits the
 * prefill leg's token; never NULL), or *err: 400 for params the producer
 * refused, 503/502 for transfer failures. A pull that succeeded put its phases (kv_alloc,
 * kv_commit, handshake, staging wait, wire, commit) in the node's histograms; they and its
 * figures are added to *t (may be NULL). */
int pkv_disagg_pull_take(pkv_disagg_pull_t *pl, pkv_seq_t **out, pkv_disagg_first_t *first,
                         pkv_disagg_timings_t *t, pkv_openai_error_t *err);
/* The caller gives up on a pull (its client went away, the server stops) instead of taking
 * it: its reads are cancelled and what it holds returns (the pull is freed once they have
 * ended). A done call already under way may still run: its arg must outlive the node's
 * pulls (the server's wakers do). NULL is a no-op. */
void pkv_disagg_pull_abandon(pkv_disagg_pull_t *pl);
/* A decode node computes a request that came without kv_transfer_params (counted). */
void pkv_disagg_node_count_local(pkv_disagg_node_t *n);
/* POST /v1/kv_transfer/peaks/reset: the high-water marks of the window that ends now
 * (since the node started or the previous reset) as {window_ms, staging: {page_bytes,
 * pages_peak_used, transfers_peak, resident_peak_bytes} (summed over ranks as
 * /v1/cache/stats sums them), pulls: {inflight_peak}}, and a new window starting from the
 * values now (new reference; NULL on no memory). /v1/cache/stats reports the open window's. */
json_t *pkv_disagg_node_peaks_reset(pkv_disagg_node_t *n);

#endif
