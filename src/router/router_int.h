/*
 * Private to src/router/ and its tests; internals prefixed rt_ / RT_; interface:
 * include/pagekv/router.h.
 *
 * router internals shared by front.c (the client side: libmicrohttpd, one event-loop
 * thread), relay.c (the node side: libcurl multi on the thread "pkv-route-io"),
 * metrics.c (the /metrics text and /health document) and layout.c (the nodes' KV formats,
 * checked at start).
 *
 * Ownership of an exchange (one client request that goes to nodes): front.c creates it
 * with one reference (the connection's, dropped when MHD reports the request
 * completed); handing it to the io thread adds one (dropped when the io thread is done
 * with it). The io thread publishes the answer into the out fields under x->lock and
 * resumes the connection; the connection's content reader takes the bytes under the
 * same lock and suspends itself while there are none.
 */
#ifndef PKV_ROUTER_ROUTER_INT_H
#define PKV_ROUTER_ROUTER_INT_H

#include "pagekv/pagekv.h"
#include "pagekv/router.h"

#include <curl/curl.h>
#include <jansson.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum { RT_PREFILL = 0, RT_DECODE = 1, RT_ROLES } rt_role_t;
extern const char *const rt_role_label[RT_ROLES];

typedef enum {
    RT_ROUTE_COMPLETIONS = 0,
    RT_ROUTE_CHAT,
    RT_ROUTE_MODELS,
    RT_ROUTE_MODEL,
    RT_ROUTE_HEALTH,
    RT_ROUTE_METRICS,
    RT_ROUTE_OTHER,
    RT_ROUTE_COUNT
} rt_route_t;
extern const char *const rt_route_label[RT_ROUTE_COUNT];

/* Why a node's attempt failed (errors and retries are counted by these). */
typedef enum {
    RT_CAUSE_CONNECT = 0, /* refused, unreachable, reset before an answer */
    RT_CAUSE_TIMEOUT,     /* no byte within node_timeout_ms */
    RT_CAUSE_HTTP_5XX,    /* a 5xx answer (or 429) */
    RT_CAUSE_PEER_LOST,   /* the decode node could not pull from the prefill node */
    RT_CAUSE_BROKEN,      /* the answer broke off or made no sense */
    RT_CAUSE_COUNT
} rt_cause_t;
extern const char *const rt_cause_label[RT_CAUSE_COUNT];

typedef enum {
    RT_REJ_INVALID = 0,   /* the request's own fault (4xx before any node) */
    RT_REJ_CONNECTIONS,   /* beyond max_connections */
    RT_REJ_SHUTTING_DOWN, /* draining */
    RT_REJ_NO_NODE,       /* no node of a role could serve it */
    RT_REJ_COUNT
} rt_rejection_t;
extern const char *const rt_rejection_label[RT_REJ_COUNT];

#define RT_OBUF_CAP (256u * 1024) /* default stream_buffer */
#define RT_N_CODES  10
extern const int rt_codes[RT_N_CODES]; /* the statuses counted; the last slot: others */
int rt_code_index(int status);

#define RT_HIST_BUCKETS 14 /* the router's histograms (pkv_hist_t) count over rt_hist_bounds */
extern const double rt_hist_bounds[RT_HIST_BUCKETS];
_Static_assert(RT_HIST_BUCKETS <= PKV_HIST_MAX_BUCKETS, "rt_hist_bounds fits a pkv_hist_t");

/* Counters, under r->lock. */
typedef struct {
    uint64_t http[RT_ROUTE_COUNT][RT_N_CODES];
    uint64_t rejected[RT_REJ_COUNT];
    uint64_t errors[RT_ROLES][RT_CAUSE_COUNT]; /* failed attempts by role and cause */
    uint64_t retries[RT_CAUSE_COUNT];          /* attempts made again elsewhere, by cause */
    uint64_t stream_errors;                    /* streams ended by an error event */
    uint64_t stream_pauses; /* node transfers paused: stream_buffer bytes waited for a client */
    uint64_t lookups, lookup_failures;
    uint64_t in_flight;   /* client requests handed to the nodes, not yet completed */
    uint64_t connections; /* open client connections */
    uint64_t connections_peak;
    pkv_hist_t leg[RT_ROLES]; /* a successful leg: sent -> its answer's end */
    pkv_hist_t lookup;        /* cache lookups */
    pkv_hist_t ttft;          /* the request's arrival -> its first answer byte ready */
    pkv_hist_t e2e;           /* arrival -> the answer's end */
} rt_counters_t;

typedef struct rt_leg rt_leg_t;
typedef struct rt_xchg rt_xchg_t;

typedef struct {
    char *url; /* base URL, no trailing '/' */
    rt_role_t role;
    uint32_t index;
    /* io thread only */
    uint32_t active;                 /* legs running on it */
    uint32_t waiting;                /* legs queued for a slot */
    rt_leg_t *wait_head, *wait_tail; /* FIFO of legs waiting for a slot */
    bool probing;
    uint64_t next_probe_ns;
    /* r->lock */
    bool up;            /* its last /health answered 200 (or a leg just succeeded) */
    uint64_t requests;  /* legs sent to it */
    uint64_t in_flight; /* active + waiting, mirrored for /metrics */
} rt_node_t;

struct rt_xchg {
    pkv_router_t *r;
    struct MHD_Connection *conn;
    rt_route_t route;
    char *body;
    size_t len, cap;
    bool too_large, submitted, answered;
    char path[160];     /* GET passthrough (/v1/models...) */
    char rid[129];      /* X-Request-Id (the client's, or generated) */
    char timings[8];    /* the client's X-Pagekv-Timings, passed on to every leg ("" none) */
    uint64_t t_arrival; /* monotonic ns */
    atomic_int refs;
    rt_xchg_t *inbox_next; /* r->inbox_lock */
    bool in_inbox;         /* r->inbox_lock */

    /* io thread only */
    bool io_started;
    bool io_live; /* in r->live: the io thread still works on it */
    bool stream;
    json_t *doc; /* the client's body */
    char *pbody; /* the prefill leg's body */
    char *dbody; /* the decode leg's body (with the prefill node's kv_transfer_params) */
    uint64_t deadline;
    uint64_t tried[RT_ROLES]; /* bit per node: attempted for this request */
    rt_node_t *pnode;
    rt_leg_t *legs; /* this exchange's legs (main leg or lookups) */
    uint32_t lookups_pending;
    int64_t matched[PKV_ROUTER_MAX_NODES]; /* lookup scores (relay.c lookup_score; -1: none) */
    char reason[600];                      /* the failures so far, for a 503 */
    rt_xchg_t *live_prev, *live_next;      /* r->live */
    bool waiting_model;
    uint32_t attempts;

    /* x->lock: the answer for the client */
    pthread_mutex_t lock;
    int status;
    bool ready;        /* the status is decided; MHD may queue the answer */
    bool streamed;     /* the answer is a stream (content reader) */
    bool done;         /* no more bytes will come */
    bool suspended;    /* the connection is suspended (resume it on news) */
    bool gone;         /* MHD completed the request: never touch conn again */
    bool want_unpause; /* the reader drained a full buffer: unpause the node's transfer */
    bool io_paused;    /* the io thread paused the node's transfer */
    char retry_after[8];
    char *obuf;
    size_t olen, opos, ocap;
};

/* One HTTP transfer to a node. io thread only. */
typedef enum {
    RT_LEG_LOOKUP,
    RT_LEG_PREFILL,
    RT_LEG_DECODE,
    RT_LEG_PASS,
    RT_LEG_PROBE,
    RT_LEG_MODELS
} rt_leg_kind_t;

struct rt_leg {
    rt_leg_kind_t kind;
    rt_xchg_t *x; /* NULL for probes */
    rt_node_t *node;
    CURL *easy;
    struct curl_slist *hdrs;
    const char *req_body; /* owned by x (pbody / dbody / body) */
    char *buf;            /* answer body (streams: the partial SSE event) */
    size_t len, cap;
    long status;
    uint64_t t_start, t_last;
    bool running;   /* added to the multi handle */
    bool queued;    /* in node's wait FIFO */
    bool committed; /* streaming decode: bytes reached the client */
    bool paused;
    rt_leg_t *xnext;         /* x->legs */
    rt_leg_t *wnext;         /* node's wait FIFO */
    rt_leg_t *anext, *aprev; /* r->active */
    char err[CURL_ERROR_SIZE];
};

struct pkv_router {
    char *host;
    uint16_t port;
    rt_node_t nodes[RT_ROLES][PKV_ROUTER_MAX_NODES];
    uint32_t n_nodes[RT_ROLES];
    pkv_router_policy_t policy;
    uint32_t max_connections, request_timeout_ms, node_timeout_ms, lookup_timeout_ms,
        health_interval_ms, node_max_in_flight;
    uint64_t stream_buffer; /* bytes waiting for a slow client: pause the node beyond */
    uint64_t max_body;
    struct MHD_Daemon *mhd;
    pthread_t io_thread;
    bool io_started;
    atomic_bool stopping;
    atomic_uint_fast64_t next_rid;
    uint64_t rid_salt;

    pthread_mutex_t lock; /* guards: ctr, draining, nodes' up/requests/in_flight, model */
    pthread_cond_t idle_cv;
    rt_counters_t ctr;
    bool draining;
    char model[128]; /* the nodes' served model ("" until a node answered /v1/models) */
    uint32_t max_context;

    pthread_mutex_t inbox_lock; /* guards: inbox, io_closed */
    rt_xchg_t *inbox_head, *inbox_tail;
    bool io_closed;

    /* io thread only */
    CURLM *multi;
    rt_leg_t *active;
    rt_xchg_t *live;
    uint32_t rr[RT_ROLES];
};

/* ---- front.c -> relay.c ---- */
int rt_io_start(pkv_router_t *r);
void rt_io_stop(pkv_router_t *r); /* ends every exchange, joins the thread */
/* Hand x to the io thread (or, when news of it arrive, wake the io thread for it).
 * false once the io thread has closed. */
bool rt_io_push(pkv_router_t *r, rt_xchg_t *x);
void rt_xchg_unref(rt_xchg_t *x);

/* ---- relay.c: the SSE framing of a decode node's stream (fuzzed: tests/fuzz/fuzz_sse.c) ---- */
/* The end of the last complete SSE event in buf[0, len): just past its blank line
 * ("\n\n"), or 0 when none is complete. buf[0, old) held no complete event (it is what
 * an earlier call left), so the scan starts where a boundary can straddle old. */
size_t rt_sse_complete_end(const char *buf, size_t len, size_t old);

/* ---- relay.c -> front.c ---- */
/* x->lock held: the connection may go on (called whenever out fields changed). Returns
 * whether the caller must MHD_resume_connection(x->conn) after unlocking. */
bool rt_xchg_wake_locked(rt_xchg_t *x);

/* ---- layout.c ---- */
/* Before the router starts: ask every node's /health for its KV format (within
 * lookup_timeout_ms) and refuse, PKV_ERR_INVALID (logged, naming both nodes and formats), a
 * prefill node and a decode node that describe different ones; nodes that do not describe
 * one are not checked. PKV_ERR_NOMEM. */
int rt_layouts_check(pkv_router_t *r);

/* ---- metrics.c ---- */
char *rt_metrics_render(pkv_router_t *r, size_t *len);
/* /health: 200 when at least one node of each role is up and the router is not
 * draining. The document (malloc'd) and the status. */
char *rt_health_render(pkv_router_t *r, int *status);

#endif
