/*
 * disagg's module interface: the building blocks of disaggregated serving on the built-in
 * model (prefill on one node, decode on another, the prompt's KV moved between their pools
 * by the transfer engine). `pagekv demo` (tools/cmd_demo.c) runs them in two processes;
 * tests/test_xfer.c runs them in one. Not installed.
 *
 * A node is one side: a model, its paged KV pool, host staging and a transfer agent.
 *   Prefill  pkv_disagg_prefill() computes a prompt's KV in a new sequence and registers
 *            its blocks under a lease: the lease holds the sequence and the handle (the
 *            bytes a decode node needs) and knows how the registration ended.
 *   Decode   pkv_disagg_pull() reads a handle's blocks into a local sequence by one
 *            deadline and gives the read's typed outcome; on PKV_OK the sequence holds the
 *            prompt's positions as written and generation goes on from them
 *            (pkv_disagg_generate).
 *   Checking pkv_disagg_kv_equal() compares the KV of two sequences bitwise.
 *
 * Nothing here prints or changes process-wide state (signals, environment, forks): the
 * caller owns its process. As the transfer engine requires, a process that forks does so
 * before it creates its first node. Errors are PKV_ERR_*; outputs are set only on success.
 */
#ifndef PKV_DISAGG_DISAGG_H
#define PKV_DISAGG_DISAGG_H

#include "pagekv/kv.h"
#include "pagekv/model.h"
#include "pagekv/stage.h"
#include "pagekv/tokenizer.h"
#include "pagekv/xfer.h"

#include <stdbool.h>
#include <stdint.h>

#define PKV_DISAGG_DEFAULT_PRESET "llama-3.2-1b"
/* pkv_disagg_lease_wait(): the registration has not ended yet. */
#define PKV_DISAGG_LEASE_OPEN 1

typedef struct {
    const char *preset;     /* built-in model preset; NULL -> PKV_DISAGG_DEFAULT_PRESET */
    uint64_t weights_seed;  /* built-in weights; 0 -> 1 */
    int32_t vocab;          /* the tokenizer's vocabulary size (the model's vocab_size) */
    pkv_dtype_t dtype;      /* KV element type */
    uint32_t stage_tokens;  /* staging for one transfer of this many positions (whole blocks) */
    bool shared_stage;      /* staging in a memfd arena consumers on this host may map */
    const char *stage_name; /* the staging arena's name; NULL -> "pkv-disagg" */
    bool no_shared;         /* move payloads through UCX even where an arena could be mapped */
} pkv_disagg_node_config_t;

typedef struct pkv_disagg_node pkv_disagg_node_t;
typedef struct pkv_disagg_lease pkv_disagg_lease_t;

/* Create a node (model, pool, staging, agent). *out is the caller's: pkv_disagg_node_destroy.
 * PKV_ERR_NOTFOUND for an unknown preset. */
int pkv_disagg_node_create(const pkv_disagg_node_config_t *c, pkv_disagg_node_t **out);
/* Destroy the agent (ending every registration still open: PKV_ERR_SHUTDOWN), the staging,
 * the pool and the model. Free the node's leases and sequences first. NULL is a no-op. */
void pkv_disagg_node_destroy(pkv_disagg_node_t *n);

/* The node's parts, owned by the node (valid until pkv_disagg_node_destroy). */
pkv_model_t *pkv_disagg_node_model(const pkv_disagg_node_t *n);
pkv_kv_t *pkv_disagg_node_kv(const pkv_disagg_node_t *n);
pkv_stage_t *pkv_disagg_node_stage(const pkv_disagg_node_t *n);
pkv_xfer_agent_t *pkv_disagg_node_agent(const pkv_disagg_node_t *n);

/* A second pool of the node's geometry (a reference run beside the transferred one). The
 * caller frees it with pkv_kv_destroy. */
int pkv_disagg_pool_create(const pkv_disagg_node_t *n, pkv_kv_t **out);

/* A sequence in kv for the prompt ids[0..n), with room for n + extra positions, nothing
 * computed yet. The caller frees it with pkv_seq_free (before kv). */
int pkv_disagg_seq_create(pkv_kv_t *kv, const int32_t *ids, uint32_t n, uint32_t extra,
                          pkv_seq_t **out);

/* Forward ids[0..n) of seq through the model (logits: scratch of vocab floats); *next =
 * the argmax of the last position's logits. */
int pkv_disagg_forward(pkv_model_t *m, pkv_kv_t *kv, pkv_seq_t *seq, const int32_t *ids, uint32_t n,
                       float *logits, int32_t *next);

/* Greedy generation in seq from `first`: out[0] = first, each next token the argmax of the
 * last one's logits, at most max tokens (out has room for max), ending after a stop token
 * of tok. Returns the count (>= 1) or a PKV_ERR_* (< 0). */
int pkv_disagg_generate(pkv_model_t *m, pkv_kv_t *kv, pkv_seq_t *seq, const pkv_tok_t *tok,
                        int32_t first, uint32_t max, float *logits, int32_t *out);

/* Every position [0, n) of two sequences' blocks (paged pools of one geometry), every
 * layer, K and V, every head, bitwise equal; nothing past n is compared. */
bool pkv_disagg_kv_equal(pkv_kv_t *a, const pkv_seq_t *sa, pkv_kv_t *b, const pkv_seq_t *sb,
                         uint32_t n);

/* ---- prefill --------------------------------------------------------------------------- */
/* Compute the KV of the prompt ids[0..n) in a new sequence of the node's pool and register
 * its blocks under request_id until now + lease_ns. *out (the caller's) holds the sequence
 * and the handle: pkv_disagg_lease_free. */
int pkv_disagg_prefill(pkv_disagg_node_t *node, uint64_t request_id, const int32_t *ids, uint32_t n,
                       uint64_t lease_ns, pkv_disagg_lease_t **out);
/* What prefill produced; valid until pkv_disagg_lease_free. */
const pkv_xfer_handle_t *pkv_disagg_lease_handle(const pkv_disagg_lease_t *l);
int32_t pkv_disagg_lease_first(const pkv_disagg_lease_t *l);       /* the first generated token */
uint64_t pkv_disagg_lease_prefill_ns(const pkv_disagg_lease_t *l); /* the forward pass */
/* How the registration ended, waiting until deadline_ns for it to end: PKV_OK = read and
 * acknowledged (sent), a PKV_ERR_* as pkv_xfer_sent_fn says, or PKV_DISAGG_LEASE_OPEN. */
int pkv_disagg_lease_wait(pkv_disagg_lease_t *l, uint64_t deadline_ns);
/* End it: wait until grace_deadline_ns for it to end by itself (an acknowledgement may be
 * on its way), else unregister it (PKV_ERR_CANCELLED) and wait up to 1 s for that. Returns
 * how it ended, as pkv_disagg_lease_wait. */
int pkv_disagg_lease_end(pkv_disagg_lease_t *l, uint64_t grace_deadline_ns);
/* End the registration if still open (no grace), wait up to 2 s for the agent's transfers
 * to go idle, free the handle, the sequence and the lease. NULL is a no-op. */
void pkv_disagg_lease_free(pkv_disagg_lease_t *l);

/* ---- decode ---------------------------------------------------------------------------- */
typedef struct {
    int outcome;          /* the read's typed outcome (PKV_OK, PKV_ERR_*), as pkv_xfer_read */
    uint64_t transfer_ns; /* the read's start to its outcome (connecting included) */
    uint64_t bytes;       /* the handle's blocks' bytes (whole blocks) */
    bool shared_arena;    /* ok, and the payload came through the producer's mapped arena */
} pkv_disagg_pull_t;

/* Read h's blocks into the first blocks of seq (a sequence of the node's pool created for
 * ids[0..n) with nothing computed) by deadline_ns, h covering exactly positions [0, n).
 * Returns PKV_OK with r->outcome the read's outcome; on outcome PKV_OK positions [0, n) of
 * seq are written (pkv_seq_append) and decoding goes on from them. PKV_ERR_INVALID (r
 * untouched, nothing read) when h does not cover exactly n positions or seq is too small;
 * another PKV_ERR_* when the sequence could not take the tokens after an ok read. */
int pkv_disagg_pull(pkv_disagg_node_t *node, const pkv_xfer_handle_t *h, pkv_seq_t *seq,
                    const int32_t *ids, uint32_t n, uint64_t deadline_ns, pkv_disagg_pull_t *r);

#endif
