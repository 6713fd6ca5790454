/*
 * Disaggregated prefill -> decode on the built-in model, through the transfer engine
 * (`pagekv demo`; tests/test_xfer.c runs it too).
 *
 * pkv_disagg_run() forks a prefill process and plays decode itself. Neither process has
 * touched UCX or started a thread before the fork. Prefill computes the prompt's KV in
 * its pool and the first token, registers the prompt's blocks and sends the handle to
 * decode through a pipe. Decode pulls the blocks into its own pool (pkv_xfer_read),
 * continues the sequence from them and generates greedily. To show that nothing was lost
 * or bent on the way, decode also runs the same prompt itself in a second pool (the
 * unified run) and compares the transferred KV byte for byte, the first token and every
 * generated token. After the read, prefill reports its accounting (registration ended
 * sent, pins and staging returned) back through the pipe.
 */
#ifndef PKV_BENCH_DISAGG_H
#define PKV_BENCH_DISAGG_H

#include "pagekv/kv.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

typedef struct {
    const char *preset;    /* built-in model preset; NULL -> "llama-3.2-1b" */
    const char *prompt;    /* NULL -> a built-in paragraph */
    uint32_t max_tokens;   /* tokens generated after the prompt; 0 -> 32 */
    uint64_t weights_seed; /* built-in weights; 0 -> 1 */
    pkv_dtype_t dtype;     /* KV element type (both pools) */
    bool tcp;              /* UCX_TLS=tcp in both processes; the payload goes through UCX */
    bool no_shared;        /* payload through UCX even on one host (no shared arena) */
    uint64_t deadline_ms;  /* the transfer's deadline; 0 -> 10000 */
    FILE *out;             /* the report; NULL -> none */
} pkv_disagg_opts_t;

typedef struct {
    int outcome;            /* the read's typed outcome (PKV_OK, PKV_ERR_*) */
    const char *path;       /* how the payload moved */
    uint32_t prompt_tokens; /* KV positions transferred */
    uint32_t blocks;        /* blocks transferred */
    uint64_t kv_bytes;      /* their bytes (whole blocks) */
    uint64_t prefill_ns;    /* prefill's forward pass over the prompt */
    uint64_t transfer_ns;   /* pkv_xfer_read() to its outcome */
    bool kv_identical;      /* every transferred position == the unified run's, bitwise */
    bool first_identical;   /* prefill's first token == the unified run's */
    bool tokens_identical;  /* the generated tokens == the unified run's */
    uint32_t generated;     /* tokens generated (first included) */
    /* prefill's accounting, reported after the read */
    bool producer_reported;
    int producer_end; /* how the registration ended: PKV_OK = sent (acknowledged) */
    uint64_t producer_sent, producer_bytes_sent, producer_pinned, producer_staging_held;
    uint64_t producer_rss;
    bool producer_exit_ok; /* the prefill process exited 0 after its report */
    bool shared_arena;     /* the payload came through the producer's mapped arena */
    /* decode's, after the read was freed */
    uint64_t consumer_pinned, consumer_staging_held, consumer_bytes_received;
    uint64_t consumer_pool_committed, consumer_rss;
} pkv_disagg_result_t;

/* Run it. 0: the run completed and every check held; 1: a check failed (r says which;
 * a prefill process that died during the read shows as the read's outcome); 2: it could
 * not run (bad options, a setup failure, no handle from prefill), with a message on
 * stderr. */
int pkv_disagg_run(const pkv_disagg_opts_t *o, pkv_disagg_result_t *r);

#endif
