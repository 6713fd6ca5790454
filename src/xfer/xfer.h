/*
 * xfer's module interface: what other parts of pagekv (support code, benchmarks, tests)
 * may use beyond the public header: the copy + checksum loops (xfer/sum.h), the payload
 * MAC with its copy loops (xfer/mac.h), the chunk and staging-store thresholds the engine
 * chose, and fault injection. Not installed.
 */
#ifndef PKV_XFER_XFER_H
#define PKV_XFER_XFER_H

#include "pagekv/xfer.h"
#include "xfer/mac.h"
#include "xfer/sum.h"

/* Payload chunks are at most this by default (config chunk_bytes 0; a small transfer's
 * never more): one UCX segment (tcp and shm segments are 64 KiB, agent.c ucx_config), so
 * UCX sends each eagerly as one message; a bigger chunk costs a rendezvous round trip. */
#define PKV_XFER_WHOLE_CHUNK_BYTES (60u << 10)
/* Staging copies store around the cache for layers of at least this many bytes (half a
 * core's L2: such a layer has left the cache before UCX reads it); staging in a shared
 * arena always does (the consumer reads it on another core). Pool copies always do. */
#define PKV_XFER_STAGE_NT_BYTES (256u << 10)

typedef enum {
    PKV_XFER_FAULT_SERVE_READ,          /* progress thread: producer accepted a READ */
    PKV_XFER_FAULT_SERVE_COPIED,        /* producer staged a layer: on a copy worker, or on the
                                           progress thread for a small transfer (a hook that
                                           sleeps needs no_inline_copy) */
    PKV_XFER_FAULT_SERVE_LAYER_SENT,    /* progress thread: a layer's payload is posted and
                                           its DATA not yet (shared arena: its DATA sent; a
                                           whole stream: its last chunk, checksums in it) */
    PKV_XFER_FAULT_SERVE_ALL_SENT,      /* progress thread: all chunks left; waiting for ACK */
    PKV_XFER_FAULT_READ_LAYER_RECEIVED, /* progress thread: consumer has a layer's chunks */
} pkv_xfer_fault_point_t;

typedef struct {
    /* Called at each point (layer = the layer concerned, 0 where none) with no lock
     * held. A test may sleep, raise a signal, or record; it must not call back into
     * the agent. NULL: no hook. */
    void (*fn)(void *arg, pkv_xfer_fault_point_t point, uint32_t layer);
    void *arg;
    int32_t corrupt_layer;      /* >= 0: the producer flips a staged byte of this layer after
                                   checksumming it (the consumer must report corrupt); -1 none */
    bool forge_mac;             /* with corrupt_layer: the producer also recomputes that layer's
                                   MAC over the changed bytes, with keys from a wrong token (the
                                   right ids and nonce): what a peer without the token can send;
                                   the consumer must still report corrupt */
    uint8_t wire_version;       /* != 0: every control message goes out stamped with this wire
                                   version, as an agent of that version would send it */
    bool malformed_read;        /* READs go out with an unknown flag bit: our version, but a
                                   message the producer cannot decode */
    uint32_t heads_lo, heads_n; /* heads_n != 0: the agent acts as if its rank held only
                                   heads [heads_lo, heads_lo + heads_n) (its checks, its
                                   HELLO): a TP=1 pool stands in for a rank of a TP pool */
    bool hello_all_heads;       /* with heads_n: its HELLO still claims every head (a
                                   producer whose HELLO is wrong: only its READ check is left) */
} pkv_xfer_faults_t;

/* Install fault hooks. Call before the agent's first transfer. */
void pkv_xfer_set_faults(pkv_xfer_agent_t *agent, const pkv_xfer_faults_t *faults);

#endif
