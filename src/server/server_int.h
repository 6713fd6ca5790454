/*
 * Private to src/server/ and its tests; internals prefixed srv_ / SRV_; no module interface.
 *
 * server internals shared by its files: the server object and one HTTP request (server.c
 * assembles the stack; http.c routes and answers; completions.c serves the generation
 * endpoints; cache.c the cache admin endpoints; metrics.c renders /metrics and
 * /v1/cache/stats; memwatch.c lets the cache yield memory).
 */
#ifndef PKV_SERVER_INT_H
#define PKV_SERVER_INT_H

#include "pagekv/engine.h"
#include "pagekv/kv.h"
#include "pagekv/server.h"
#include "pagekv/stage.h"
#include "pagekv/xfer.h"
#include "disagg/disagg.h"
#include "openai/openai.h"
#include "tier/kvtier.h"

#include "prim/prim.h"

#include <jansson.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>
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
    SRV_ROUTE_CACHE_PURGE,
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
/* Count `seconds` in h over the default bounds. */
void srv_hist_add(pkv_hist_t *h, double seconds);

typedef struct {
    uint64_t http[SRV_ROUTE_COUNT][SRV_N_CODES];
    uint64_t rejected[SRV_REJ_COUNT];
    uint64_t disconnects; /* generation requests whose client went away first */
    uint64_t in_flight;   /* generation requests being served */
    uint64_t streams;     /* streamed responses started */
    uint64_t cache_resets;
    pkv_hist_t ttft; /* submit -> first token read */
    pkv_hist_t e2e;  /* submit -> finished */
} srv_counters_t;

/* libmicrohttpd's event-loop threads (http.c): a handler never blocks, so a few serve every
 * connection; more than one so that a slow endpoint (/metrics reading smaps, a digest, a
 * disk-tier load) stalls only its share. */
#define SRV_HTTP_THREADS 4

/* The pool's smaps reading (hugepages.pool_*) is reused for this long (http.c). */
#define SRV_PAGES_MAX_AGE_NS 5000000000ull

/* The timings object of a response (new reference; NULL on no memory). */
json_t *srv_timings_json(const pkv_disagg_timings_t *t, pkv_server_role_t role);
/* The kv_transfer_params section of /v1/cache/stats (new reference; NULL on no memory). */
json_t *srv_kv_stats_json(const pkv_disagg_snapshot_t *k);

/* ---- the cache yields memory (memwatch.c) ------------------------------------------- */

/* The pool's prefix-cache policy from the server's configuration: kc->cache_max_bytes
 * (auto: budget / 4, or an eighth of the machine's memory with no budget),
 * kc->cache_idle_ms and the warm floor (kc->warm_max_bytes, kc->warm_idle_ms).
 * PKV_ERR_INVALID (logged) for a cap of 0 bytes. */
int srv_cache_policy(const pkv_server_config_t *cfg, uint64_t budget, pkv_kv_config_t *kc);
/* Whether the watcher refills the warm floor (thread pkv-warm): a decode node, or any node
 * given --kv-warm-max; other nodes only keep what their admissions leave empty. */
bool srv_warm_refills(const pkv_server_config_t *cfg);

/* The watcher: thread "pkv-memwatch" applies the idle time-to-live (pkv_kv_trim) on a timer
 * and, unless cfg->no_memory_watch, reads the memory left (prim) every poll and holds the
 * cache out of the reserve (pkv_kv_cache_pressure); with a warm floor, thread "pkv-warm"
 * refills it when kicked (pkv_kv_warm_refill), in steps, only while busy(busy_arg) says
 * the node is quiet. */
typedef struct srv_memwatch srv_memwatch_t;
typedef struct {
    bool running;       /* a watcher thread runs (a paged pool with a TTL or the watch on) */
    bool warm_refill;   /* pkv-warm runs: the warm floor is refilled, not only kept */
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
int srv_memwatch_create(const pkv_server_config_t *cfg, pkv_kv_t *kv, bool (*busy)(void *arg),
                        void *busy_arg, srv_memwatch_t **out);
/* Stop and join the thread. NULL is a no-op. */
void srv_memwatch_destroy(srv_memwatch_t *w);
/* pkv_kv_on_warm_low's callback (arg: the watcher): wake pkv-warm to refill the warm
 * floor off the allocating thread. Never blocks beyond the watcher's lock. */
void srv_memwatch_kick(void *w);
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
    pkv_disagg_snapshot_t kv;
    srv_memwatch_stats_t mw; /* the cache policy's watcher */
    bool has_tier;           /* the disk tier is on: tier filled */
    pkv_kvtier_stats_t tier;
} srv_snapshot_t;

/* Prometheus text: a family's HELP and TYPE lines; one family with one sample (a
 * histogram's samples: pkv_hist_write_prom in core). */
void srv_metric_family(FILE *f, const char *name, const char *type, const char *help);
void srv_metric_one(FILE *f, const char *name, const char *type, const char *help, uint64_t v);
/* The disk tier's /metrics families and its /v1/cache/stats "disk" object (tier.c). */
void srv_tier_render(FILE *f, const pkv_kvtier_stats_t *t);
json_t *srv_tier_json(const pkv_kvtier_stats_t *t);

/* Prometheus text exposition (malloc'd, NUL-terminated; *len without the NUL). NULL on
 * allocation failure. */
char *srv_metrics_render(const srv_snapshot_t *snap, size_t *len);
/* The /v1/cache/stats document (new reference; NULL on allocation failure). */
json_t *srv_cache_stats_json(const srv_snapshot_t *snap);

/* ---- wakers: how a suspended connection is resumed (http.c) ------------------------------
 * A generation request parks its connection (MHD_suspend_connection) whenever it waits:
 * for its pull, for the engine's next output. What it waits for calls srv_waker_wake (the
 * pull worker, the engine's run loop), which resumes the connection; libmicrohttpd then
 * calls the handler (or the stream's reader) again, which looks and parks again if it must.
 * Wakers live as long as the server (freed after the engine and the transfer agents), so a
 * late wake (a request released, a pull abandoned) finds a waker, never freed memory; at
 * worst it wakes the connection that owns the waker now, which looks and parks again. */
typedef struct srv_waker {
    struct pkv_server *s;
    pthread_mutex_t mu;          /* guards conn, parked, woken, next_free */
    struct MHD_Connection *conn; /* the owner's connection; NULL: free */
    bool parked;                 /* the connection is suspended, waiting for a wake */
    bool woken;                  /* a wake came while it was not parked */
    struct srv_waker *next_free;
} srv_waker_t;
/* Take a free waker for connection c (NULL when none is free: cannot happen while every
 * connection holds at most one). */
srv_waker_t *srv_waker_take(struct pkv_server *s, struct MHD_Connection *c);
/* Give it back (from the request's completion: its connection is not parked). */
void srv_waker_give(struct pkv_server *s, srv_waker_t *w);
/* From an MHD callback of w's connection: park it unless a wake came since it last
 * parked or the server stops. true: parked (return from the callback now); false: look
 * again. */
bool srv_waker_park(srv_waker_t *w);
/* Wake w's connection (any thread; never blocks beyond w->mu). void * for callbacks. */
void srv_waker_wake(void *w);

/* ---- the server object (server.c builds it) --------------------------------------------
 * Locking. s->lock guards s->ctr (every counter and histogram), s->draining, s->next_id
 * and s->rng; s->idle_cv signals ctr.in_flight reaching 0. s->stopping is atomic (read
 * by waiting threads between slices). Nothing blocks, allocates from the OS or calls
 * into the engine or MHD under s->lock. */
struct pkv_server {
    char *host, *served_name;
    pkv_tok_t *tok;
    pkv_model_t *model;
    pkv_kv_t *kv;
    pkv_engine_t *engine;
    pkv_server_role_t role;
    pkv_disagg_node_t *kvn; /* prefill and decode roles: the transfer agents (disagg) */
    srv_memwatch_t *mw;     /* the cache policy's timer and memory watcher (memwatch.c) */
    pkv_kvtier_t *tier;     /* the disk tier (NULL: off) */
    struct MHD_Daemon *mhd;
    MHD_socket quiesced_fd; /* the listening socket after quiesce: closed after stop */
    uint16_t port;
    uint32_t max_context, max_batch, block_tokens, default_max_tokens, retry_after_s;
    uint64_t max_body, budget_bytes, token_bytes;
    pkv_backend_t backend;
    bool huge, huge_probe;   /* the pool asks for THP; the startup probe got a huge page */
    bool huge_granules;      /* paged: 2 MiB pages can back the pool's granules */
    pkv_prim_thp_mode_t thp; /* the kernel's THP mode at startup */
    time_t created;
    atomic_bool stopping;

    pthread_mutex_t lock; /* guards: ctr, draining, next_id, rng (see the top comment) */
    pthread_cond_t idle_cv;
    /* The pool's range in /proc/self/smaps (pkv_kv_pages), read at most every
     * SRV_PAGES_MAX_AGE_NS: the kernel builds the whole file, walking every mapping's page
     * tables (~60 ms with 2 GiB of 4 KiB staging pages), so stats polled every 100 ms
     * must not read it each time. pages_mu is held across the read. */
    pthread_mutex_t pages_mu;
    uint64_t pages_at_ns; /* when last read; 0: never */
    bool pages_ok;
    uint64_t pool_resident_bytes, pool_huge_bytes;
    srv_counters_t ctr;
    bool draining;
    uint64_t next_id;
    uint64_t rng;
    /* Wakers (http.c): one per connection the daemon may hold. wakers_mu guards
     * wakers_free; each waker's own mu the rest. */
    srv_waker_t *wakers; /* [n_wakers] */
    uint32_t n_wakers;
    pthread_mutex_t wakers_mu;
    srv_waker_t *wakers_free;
};

/* One HTTP request (MHD's con_cls): created on the first call, freed when MHD reports
 * the request completed. */
typedef struct {
    srv_route_t route;
    char *body;
    size_t len, cap;
    bool too_large;
    bool in_flight; /* counted in ctr.in_flight: released in the completed callback */
    bool answered;
    uint64_t t_headers;      /* when libmicrohttpd handed over its headers (pkv_now_ns) */
    struct srv_gen_req *gen; /* a generation request under way (completions.c) */
} http_req_t;

/* ---- http.c: answers, shared by the handlers ------------------------------------------ */

/* Make *buf hold at least `need` bytes: the capacity at least doubles, with `slack` bytes
 * beyond the need, and stays within `limit` (0: none; the caller keeps need <= limit). */
bool srv_buf_grow(char **buf, size_t *cap, size_t need, size_t slack, size_t limit);
void srv_count_rejection(pkv_server_t *s, srv_rejection_t why);
/* A generation request stops counting in ctr.in_flight (idle_cv at 0). */
void srv_in_flight_done(pkv_server_t *s);
/* Queue response r (NULL: out of memory, the connection is closed) with status; marks hr
 * answered and counts the status. */
enum MHD_Result srv_queue(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr, int status,
                          struct MHD_Response *r);
/* A response that owns text (malloc'd; freed with the response). */
struct MHD_Response *srv_text_response(char *text, size_t len, const char *type);
/* doc (a new reference, taken; NULL: out of memory) as the JSON answer. */
enum MHD_Result srv_answer_json(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                int status, json_t *doc);
/* The error document as a response (NULL on allocation failure). */
struct MHD_Response *srv_error_response(const pkv_openai_error_t *err);
enum MHD_Result srv_answer_error(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                 const pkv_openai_error_t *err);
enum MHD_Result srv_answer_errorf(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                                  int status, const char *type, const char *code, const char *msg);
/* An empty body or an empty JSON object: endpoints that take no parameters. */
bool srv_body_empty(const http_req_t *hr);
/* Start libmicrohttpd on cfg's host and port (s->port: the bound one), with its wakers. */
int srv_http_start(pkv_server_t *s, const pkv_server_config_t *cfg);
/* Before MHD_stop_daemon (s->stopping set): resume every parked connection; none parks
 * again. */
void srv_http_unpark_all(pkv_server_t *s);
/* Free the wakers: after the engine and the node are destroyed (no wake can come). */
void srv_http_free(pkv_server_t *s);

/* ---- the endpoints -------------------------------------------------------------------- */

/* completions.c: POST /v1/completions and /v1/chat/completions. srv_handle_generate takes
 * the whole request; while it waits (hr->gen set) its connection is parked and
 * srv_generate_resume is called each time libmicrohttpd calls the handler again;
 * srv_generate_free ends what is left of it when the request completes. */
enum MHD_Result srv_handle_generate(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr);
enum MHD_Result srv_generate_resume(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr);
void srv_generate_free(pkv_server_t *s, http_req_t *hr);
/* cache.c: POST /v1/kv_transfer/peaks/reset, /v1/cache/reset, /v1/cache/lookup and
 * /v1/cache/digest. */
enum MHD_Result srv_handle_peaks_reset(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr);
enum MHD_Result srv_handle_cache_reset(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr);
enum MHD_Result srv_handle_cache_lookup(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr);
enum MHD_Result srv_handle_cache_purge(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr);
enum MHD_Result srv_handle_cache_digest(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr);

#endif
