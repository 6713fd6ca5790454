/*
 * server internals shared by server.c and metrics.c: the server's own counters and the
 * renderers of /metrics and /v1/cache/stats.
 */
#ifndef PKV_SERVER_INT_H
#define PKV_SERVER_INT_H

#include "pagekv/engine.h"
#include "pagekv/kv.h"

#include <jansson.h>

typedef enum {
    PKV_ROUTE_COMPLETIONS = 0,
    PKV_ROUTE_CHAT,
    PKV_ROUTE_MODELS,
    PKV_ROUTE_MODEL,
    PKV_ROUTE_HEALTH,
    PKV_ROUTE_METRICS,
    PKV_ROUTE_CACHE_STATS,
    PKV_ROUTE_CACHE_RESET,
    PKV_ROUTE_OTHER,
    PKV_ROUTE_COUNT
} pkv_server_route_t;
extern const char *const pkv_server_route_label[PKV_ROUTE_COUNT];

/* The statuses the server answers with (metrics labels). */
#define PKV_SERVER_N_CODES 9
extern const int pkv_server_codes[PKV_SERVER_N_CODES];
int pkv_server_code_index(int status);

typedef enum {
    PKV_REJ_INVALID = 0,    /* malformed or out-of-range request (400) */
    PKV_REJ_MODEL,          /* unknown model (404) */
    PKV_REJ_CONTEXT,        /* prompt + max_tokens beyond the context (400) */
    PKV_REJ_KV_BUDGET,      /* can never fit the KV budget (400) */
    PKV_REJ_QUEUE_FULL,     /* 429 */
    PKV_REJ_BODY_TOO_LARGE, /* 413 */
    PKV_REJ_SHUTTING_DOWN,  /* 503 */
    PKV_REJ_COUNT
} pkv_server_rejection_t;
extern const char *const pkv_server_rejection_label[PKV_REJ_COUNT];

#define PKV_SERVER_HIST_BUCKETS 14
extern const double pkv_server_hist_bounds[PKV_SERVER_HIST_BUCKETS]; /* seconds, ascending */
typedef struct {
    uint64_t bucket[PKV_SERVER_HIST_BUCKETS + 1]; /* per bucket (not cumulative); last: +Inf */
    uint64_t count;
    double sum;
} pkv_server_hist_t;
void pkv_server_hist_add(pkv_server_hist_t *h, double seconds);

typedef struct {
    uint64_t http[PKV_ROUTE_COUNT][PKV_SERVER_N_CODES];
    uint64_t rejected[PKV_REJ_COUNT];
    uint64_t disconnects; /* generation requests whose client went away first */
    uint64_t in_flight;   /* generation requests being served */
    uint64_t streams;     /* streamed responses started */
    uint64_t cache_resets;
    pkv_server_hist_t ttft; /* submit -> first token read */
    pkv_server_hist_t e2e;  /* submit -> finished */
} pkv_server_counters_t;

/* One snapshot of the server's, the engine's and the KV cache's counters: what /metrics
 * and /v1/cache/stats render (server.c takes it, metrics.c renders it). */
typedef struct {
    pkv_server_counters_t ctr;
    pkv_engine_stats_t es;
    pkv_kv_stats_t ks;
    uint64_t rss_bytes; /* the process's VmRSS (0: unknown, omitted from /metrics) */
    pkv_backend_t backend;
    uint32_t block_tokens;
} pkv_server_snapshot_t;

/* Prometheus text exposition (malloc'd, NUL-terminated; *len without the NUL). NULL on
 * allocation failure. */
char *pkv_server_metrics_render(const pkv_server_snapshot_t *snap, size_t *len);
/* The /v1/cache/stats document (new reference; NULL on allocation failure). */
json_t *pkv_server_cache_stats_json(const pkv_server_snapshot_t *snap);

#endif
