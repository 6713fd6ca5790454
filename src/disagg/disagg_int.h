/*
 * disagg: the module's own internals (prefixed dg_ / DG_), shared by its files: node.c
 * (the ranks' staging and agents), offer.c (the prefill leg), params.c (a decode leg's
 * kv_transfer_params), reshard.c (the transfer plan) and pull.c (the decode leg's pull).
 *
 * Locking: n->lock guards leases, pulls, phases and peaks_since_ns; the agents' callbacks
 * (their progress threads) and the HTTP threads take it briefly; nothing blocks under it.
 * n->pq_mu guards the decode legs' pulls in flight (pq_head and every pull's state,
 * pull.c); taken briefly by the HTTP threads, the agents' read callbacks and the pull
 * worker; never held with n->lock nor across a call into an agent or the pool.
 */
#ifndef PKV_DISAGG_INT_H
#define PKV_DISAGG_INT_H

#include "disagg/disagg.h"

#include <pthread.h>
#include <stdatomic.h>

/* One tensor-parallel rank of the node: its staging and its agent, which registers, serves
 * from and writes into the pool rank's storage range. */
typedef struct {
    struct pkv_disagg_node *node;
    uint32_t index, head_lo, head_n;
    pkv_stage_t *stage;
    pkv_xfer_agent_t *agent;
    char host[PKV_XFER_ADDR_MAX]; /* remote_host */
    uint16_t port;                /* the agent's bound port */
} dg_rank_t;

struct pkv_disagg_node {
    pkv_server_role_t role;
    pkv_kv_t *kv;
    uint32_t tp;        /* ranks: the pool's */
    dg_rank_t *rank;    /* [tp] */
    char engine_id[40]; /* "pagekv-" + 16 random bytes in hex, presented by every rank */
    uint32_t lease_ms, transfer_timeout_ms;
    int64_t staging_idle_ms; /* -1: staging never returned (fixed slots, the mirror) */
    int64_t staging_warm_ms; /* the staging's warm floor life; -1: none */
    bool recompute;          /* --kv-load-failure recompute */
    atomic_bool stopping;
    pthread_mutex_t lock;    /* guards leases, pulls, phases, peaks_since_ns */
    uint64_t peaks_since_ns; /* the high-water marks' window began (creation or a reset) */
    pkv_disagg_lease_counts_t leases;
    pkv_disagg_pull_counts_t pulls;
    pkv_hist_t phases[PKV_DISAGG_PHASE_COUNT];
    /* Decode legs' pulls (pull.c): the worker "pkv-pull" starts each, ends it when its
     * reads' outcomes are in (or at its deadline + 1 s) and calls its done callback. */
    pthread_mutex_t pq_mu;           /* guards pq_head, pq_stop and every pull in flight */
    pthread_cond_t pq_cv;            /* the worker's wake-up: a pull queued, an outcome, the stop */
    struct pkv_disagg_pull *pq_head; /* pulls not yet ended, newest first */
    bool pq_stop;
    bool pq_ready;   /* pq_mu and pq_cv initialized */
    bool pq_running; /* the worker was started (decode role) */
    pthread_t pq_thread;
};

/* The field's key path of a kv_transfer_params member, for error messages. */
#define DG_KVT_P(k) "kv_transfer_params." k

/* Count phase ph, [from_ns, to_ns), in n's histogram and (t not NULL) in t. Under n->lock. */
void dg_observe_locked(pkv_disagg_node_t *n, pkv_disagg_timings_t *t, pkv_disagg_phase_t ph,
                       uint64_t from_ns, uint64_t to_ns);

/* pull.c: the decode legs' pull worker, started by a decode node's create and stopped by
 * its destroy before the agents go (every pull in flight ends, cancelled). */
int dg_pulls_start(pkv_disagg_node_t *n);
void dg_pulls_stop(pkv_disagg_node_t *n);

/* offer.c: the id a prefill leg's blocks are registered under (see there). */
uint64_t dg_bound_id(uint64_t serial, const int32_t *ids, uint32_t n);
/* offer.c: the check binding a prefill leg's first token to its registration and sampling. */
uint64_t dg_first_check(uint64_t request_id, int32_t token, const pkv_disagg_sampling_t *smp);

/* params.c: a decode leg's kv_transfer_params, checked against the node and the prompt. */
/* remote_engine_id: what an agent can present, or NULL with *err. */
const char *dg_params_engine_id(const json_t *o, pkv_openai_error_t *err);
/* The handle for the producer's rank 0 (free with pkv_xfer_handle_free), or *err. */
int dg_params_handle(const pkv_disagg_node_t *n, const json_t *o, const int32_t *prompt,
                     uint32_t n_prompt, pkv_xfer_handle_t **out, pkv_openai_error_t *err);
/* pagekv_first (optional): *out->given when it is there and its check matches the request's
 * sampling smp and the registration request_id (*ignored when there and not matching), or
 * *err for one that is malformed. */
int dg_params_first(const json_t *o, uint64_t request_id, const pkv_disagg_sampling_t *smp,
                    pkv_disagg_first_t *out, bool *ignored, pkv_openai_error_t *err);
/* The producer's ranks: hs[0..*P) (hs[0] = h0, taken over; the caller frees all of them). */
int dg_params_ranks(const pkv_disagg_node_t *n, const json_t *o, pkv_xfer_handle_t *h0,
                    pkv_xfer_handle_t **hs, uint32_t *P, pkv_openai_error_t *err);

/* reshard.c: the transfer plan. One read: decode rank d reads heads [head_lo, head_lo +
 * head_n) from prefill rank p (head_n 0: a token-only release of p's registration). */
typedef struct {
    uint32_t d, p;
    uint32_t head_lo, head_n;
    uint16_t index, total; /* the read's index among p's reads, and their count */
} dg_read_t;
/* The reads of a pull from P prefill ranks into n's ranks (pull false: releases only), in
 * out[] (room for n->tp * kv_heads + P); returns their count. */
uint32_t dg_plan(const pkv_disagg_node_t *n, uint32_t P, bool pull, dg_read_t *out);

#endif
