/*
 * pagekv transfer engine: moves a request's KV blocks from the pool of a
 * producer process (prefill) into the pool of a consumer process (decode) over UCX,
 * through host staging, within one absolute deadline per transfer.
 *
 * Roles (one agent can play both):
 *   Producer  pkv_xfer_register() pins a request's blocks under a lease with an expiry,
 *             draws a random 128-bit token and returns a handle (request id, producer
 *             address, geometry, block ids, token) that travels to the consumer as bytes
 *             (pkv_xfer_handle_encode / _decode). The registration ends when a consumer
 *             acknowledges a complete transfer ("sent"), when the lease expires, on
 *             pkv_xfer_unregister(), or at agent destroy; its callback says which.
 *   Consumer  pkv_xfer_read(handle, destination blocks, deadline) pulls the blocks into
 *             the local pool (pkv_xfer_read_ex: only some of them, none at all — a
 *             token-only release — and/or only from a producer presenting an expected
 *             identity) and completes with exactly one typed outcome:
 *               PKV_OK             every layer arrived, its MAC matched, bytes stored
 *               PKV_ERR_TIMEOUT    the deadline passed (locally or at the producer)
 *               PKV_ERR_PEER_LOST  the producer died, went silent (~1 s) or shut down
 *               PKV_ERR_NOFIT      staging on either side can never hold the transfer
 *               PKV_ERR_REJECTED   unknown request, wrong token, block ids (the handle's,
 *                                  all of them) not the registration's,
 *                                  geometry mismatch, request busy, a bad message, or
 *                                  the producer is not the expected identity
 *                                  (pkv_xfer_read_why tells which are ours to name)
 *               PKV_ERR_CANCELLED  pkv_xfer_cancel()
 *               PKV_ERR_CORRUPT    a layer's MAC did not match (damaged or forged bytes:
 *                                  the MAC is keyed by the registration's token)
 *               PKV_ERR_SHUTDOWN   this agent was destroyed while the read ran
 *             Only an acknowledgement from the consumer makes the producer count a
 *             request as sent; the consumer acknowledges only after every layer has
 *             been verified and stored.
 *
 * Threads: an agent runs one progress thread (the only caller of UCX) and fixed pools of
 * copy and staging-seat workers, all named and joined by pkv_xfer_agent_destroy.
 * Callbacks run on the progress thread with no pagekv lock held: they must return
 * quickly and must not call pkv_xfer_agent_destroy or wait on a read.
 *
 * Every function may be called from any thread, except that pkv_xfer_agent_destroy must
 * not run concurrently with other calls on the same agent.
 */
#ifndef PAGEKV_XFER_H
#define PAGEKV_XFER_H

#include "pagekv/export.h"

#include "pagekv/kv.h"
#include "pagekv/pagekv.h"
#include "pagekv/stage.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PKV_XFER_TOKEN_BYTES  16
#define PKV_XFER_ADDR_MAX     64   /* "host:port" plus NUL */
#define PKV_XFER_IDENTITY_MAX 63   /* an agent identity's printable ASCII characters */
#define PKV_XFER_MODEL_ID_MAX 63   /* a layout's model id: printable ASCII characters */
#define PKV_XFER_MAX_READS    1024 /* reads one registration may be read by (reads_total) */

typedef struct pkv_xfer_agent pkv_xfer_agent_t;
typedef struct pkv_xfer_read pkv_xfer_read_t;

typedef struct {
    pkv_kv_t *kv;             /* the paged pool transfers read from / write to; not owned */
    pkv_stage_t *stage;       /* host staging; not owned; must outlive the agent */
    const char *listen_host;  /* NULL -> "127.0.0.1" (loopback unless told otherwise) */
    uint16_t listen_port;     /* 0 -> any free port (see pkv_xfer_agent_address) */
    uint32_t workers;         /* copy workers; 0 -> 2 */
    uint32_t seat_workers;    /* threads that wait for staging; 0 -> 2 */
    uint64_t heartbeat_ns;    /* 0 -> 250 ms */
    uint64_t peer_timeout_ns; /* a peer silent this long is lost; 0 -> 1 s */
    uint32_t chunk_bytes;     /* payload message size; 0 -> 60 KiB (one UCX segment) */
    uint32_t max_inflight;    /* payload sends in flight per transfer; 0 -> 8 */
    bool no_shared;           /* consumer: never map a same-host producer's staging arena
                                 (always move the payload through UCX) */
    bool no_inline_copy;      /* copy every transfer on the copy workers, also small ones
                                 (tests whose fault hooks sleep inside a copy) */
    const char *identity;     /* presented to every consumer that connects (HELLO), so a
                                 read can check it reached the producer it meant; printable
                                 ASCII, at most PKV_XFER_IDENTITY_MAX; NULL: "" (copied) */
    /* Tensor parallelism: the pool rank (< pkv_kv_tp(kv)) whose storage range this agent
     * registers, serves from and writes into; a node with TP=N runs one agent a rank. */
    uint32_t rank;
    const char *model_id; /* in the layout both sides exchange (HELLO): two agents whose
                             model ids are both set and differ are refused at the
                             handshake; printable ASCII, at most PKV_XFER_MODEL_ID_MAX;
                             NULL: "" (copied) */
} pkv_xfer_config_t;

/* An agent's layout: what its HELLO tells every peer when they connect. */
typedef struct {
    char model_id[PKV_XFER_MODEL_ID_MAX + 1];
    pkv_geometry_t geo;       /* the model's: kv_heads counts every rank's heads */
    uint32_t tp, rank;        /* the pool's TP degree and this agent's rank */
    uint32_t head_lo, head_n; /* the KV heads the rank holds (global ids) */
    uint32_t wire;            /* wire version */
} pkv_xfer_layout_t;

/* This agent's layout. PKV_OK, or PKV_ERR_INVALID for NULL arguments. */
PKV_API int pkv_xfer_agent_layout(const pkv_xfer_agent_t *agent, pkv_xfer_layout_t *out);

/* Connect to the agent at "host:port" (or reuse the endpoint), wait for its HELLO by
 * deadline_ns and fill *peer (may be NULL) with its layout. PKV_OK when it is compatible
 * with ours (model id when both set, layers, kv_heads, head_dim, block_tokens, dtype);
 * PKV_ERR_REJECTED when not (the reason logged; *peer filled), or when the peer speaks
 * another wire version (*peer zero but `wire`); PKV_ERR_TIMEOUT; PKV_ERR_PEER_LOST
 * (cannot connect, lost); PKV_ERR_INVALID (bad address); PKV_ERR_SHUTDOWN. Blocks the
 * caller; nothing is sent but our HELLO. */
PKV_API int pkv_xfer_probe(pkv_xfer_agent_t *agent, const char *addr, uint64_t deadline_ns,
                           pkv_xfer_layout_t *peer);

/* Create an agent: UCX context, worker, listener, progress thread and workers. Bad config
 * is PKV_ERR_INVALID; a UCX failure PKV_ERR_IO (logged). On success *out owns it all. */
PKV_API int pkv_xfer_agent_create(const pkv_xfer_config_t *cfg, pkv_xfer_agent_t **out);

/* End every transfer (reads complete with PKV_ERR_SHUTDOWN, peers get FAIL shutdown),
 * unpin every registration (callback with PKV_ERR_SHUTDOWN), return all staging, close
 * the endpoints within a bounded time, join every thread, free everything. Reads not yet
 * freed stay valid for pkv_xfer_read_wait / _free. NULL is a no-op. */
PKV_API void pkv_xfer_agent_destroy(pkv_xfer_agent_t *agent);

/* The address peers use to reach this agent: "host:port". Valid for the agent's life. */
PKV_API const char *pkv_xfer_agent_address(const pkv_xfer_agent_t *agent);

/* Liveness of the agent's progress thread (a health check): true while the agent is not
 * being destroyed and its progress loop began a round within max_age_ns (an idle loop
 * wakes at least every 50 ms; a loop stuck in UCX, a copy or a callback stops beating).
 * *age_ns (may be NULL): the time since that round began. */
PKV_API bool pkv_xfer_agent_alive(pkv_xfer_agent_t *agent, uint64_t max_age_ns, uint64_t *age_ns);

/* ---- handles --------------------------------------------------------------------------- */
typedef struct {
    uint64_t request_id;
    uint8_t token[PKV_XFER_TOKEN_BYTES];
    char addr[PKV_XFER_ADDR_MAX]; /* producer "host:port" */
    pkv_geometry_t geo;           /* producer pool geometry (block_tokens resolved) */
    struct {                      /* same-host shared staging, offered when the producer's
                                     stage is a memfd arena (stage config `shared`) */
        bool present;
        uint32_t pid;         /* producer process */
        int32_t fd;           /* the arena's memfd in that process */
        uint64_t arena_bytes; /* its size */
        uint64_t ino;         /* its inode: a consumer checks it before mapping */
        uint8_t boot_id[16];  /* the kernel's boot id: same host, same boot */
    } local;
    uint32_t n_blocks;
    uint32_t blocks[]; /* (n_blocks) producer block ids, in sequence order */
} pkv_xfer_handle_t;

/* Bytes pkv_xfer_handle_encode needs (0 for an invalid handle). */
PKV_API size_t pkv_xfer_handle_bytes(const pkv_xfer_handle_t *h);
/* PKV_OK and *len; PKV_ERR_NOSPACE when cap is short; PKV_ERR_INVALID for a bad handle. */
PKV_API int pkv_xfer_handle_encode(const pkv_xfer_handle_t *h, void *buf, size_t cap, size_t *len);
/* Parse bytes (every field bounds-checked). PKV_OK and a new *out (free with
 * pkv_xfer_handle_free), PKV_ERR_PROTO for malformed input, PKV_ERR_NOMEM. */
PKV_API int pkv_xfer_handle_decode(const void *buf, size_t len, pkv_xfer_handle_t **out);
PKV_API void pkv_xfer_handle_free(pkv_xfer_handle_t *h);

/* ---- producer -------------------------------------------------------------------------- */
/* Called once when a registration ends: PKV_OK = sent (every one of its reads_total reads
 * acknowledged, a release counting as one), PKV_ERR_TIMEOUT =
 * lease expired, PKV_ERR_CANCELLED = unregistered, PKV_ERR_SHUTDOWN = agent destroyed.
 * Its pins are already returned when no transfer was serving it; otherwise they return
 * once that transfer's copies finish (pkv_xfer_wait_idle). */
typedef void (*pkv_xfer_sent_fn)(void *arg, uint64_t request_id, int outcome);

/* Register blocks[0..n) of the pool under request_id until expiry_ns (absolute). Pins
 * the blocks (PKV_ERR_NOTFOUND when one is not live or cached, nothing pinned),
 * PKV_ERR_BUSY when request_id is registered, PKV_ERR_INVALID for bad arguments,
 * PKV_ERR_UNSUPPORTED on a dense pool. On PKV_OK *out is a new handle (free with
 * pkv_xfer_handle_free; it does not end the registration). fn may be NULL. */
PKV_API int pkv_xfer_register(pkv_xfer_agent_t *agent, uint64_t request_id, const uint32_t *blocks,
                              uint32_t n, uint64_t expiry_ns, pkv_xfer_sent_fn fn, void *arg,
                              pkv_xfer_handle_t **out);
/* End a registration now (a transfer serving it is failed with FAIL cancelled; the
 * pins drop when its copies finish). PKV_ERR_NOTFOUND when not registered. */
PKV_API int pkv_xfer_unregister(pkv_xfer_agent_t *agent, uint64_t request_id);

/* When the serve a consumer acknowledged did its steps (clock and 0 as in
 * pkv_xfer_read_timings_t). */
typedef struct {
    uint64_t registered_ns; /* pkv_xfer_register */
    uint64_t accepted_ns;   /* its READ was accepted */
    uint64_t seated_ns;     /* staging granted */
    uint64_t staged_ns;     /* the last layer was staged */
    uint64_t sent_ns;       /* every payload message had left */
    uint64_t acked_ns;      /* the ACK arrived */
} pkv_xfer_serve_timings_t;
/* Only inside the pkv_xfer_sent_fn callback of request_id with outcome PKV_OK (on the
 * progress thread): the timings of the serve that was acknowledged. PKV_ERR_NOTFOUND
 * anywhere else. */
PKV_API int pkv_xfer_sent_timings(pkv_xfer_agent_t *agent, uint64_t request_id,
                                  pkv_xfer_serve_timings_t *out);

/* ---- consumer -------------------------------------------------------------------------- */
/* Called exactly once with the read's outcome (see the list at the top), before
 * pkv_xfer_read_wait can return it, on the agent's progress thread. It must not wait
 * on any read. It may start the next read with pkv_xfer_read (which answers
 * PKV_ERR_SHUTDOWN once the agent is being destroyed): that spares a thread wake-up
 * per read. */
typedef void (*pkv_xfer_done_fn)(void *arg, pkv_xfer_read_t *rd, int outcome);

/* Start pulling h's blocks into dst[0..n) (n == h->n_blocks; dst blocks must be live in
 * this agent's pool and are pinned until the read ends), finishing by deadline_ns.
 * Checks done here return at once with nothing started: PKV_ERR_INVALID (bad handle,
 * n mismatch, geometry differs from the local pool), PKV_ERR_NOTFOUND (a dst block is
 * not live), PKV_ERR_SHUTDOWN. On PKV_OK *out is the read (free with pkv_xfer_read_free;
 * stored before fn can run) and fn (may be NULL) will be called once with the outcome. */
PKV_API int pkv_xfer_read(pkv_xfer_agent_t *agent, const pkv_xfer_handle_t *h, const uint32_t *dst,
                          uint32_t n, uint64_t deadline_ns, pkv_xfer_done_fn fn, void *arg,
                          pkv_xfer_read_t **out);

typedef struct {
    /* NULL: every block of the handle, in order (n == h->n_blocks). Else n strictly
     * increasing indices into h->blocks: only h->blocks[idx[i]] is pulled, into dst[i], and
     * only those bytes move. n == 0 (idx may then be NULL, dst too) is a token-only
     * release: nothing moves, the producer checks the token and returns its pins at once.
     * Either way an acknowledged read counts as one of the registration's reads_total
     * (below): the caller must not come back for the rest. */
    const uint32_t *idx;
    /* NULL: not checked. Else the identity the producer must present (its config's
     * `identity`): READ, and with it the token, goes out only after its HELLO matched; a
     * mismatch ends the read rejected with pkv_xfer_read_why() == PKV_XFER_WHY_IDENTITY. */
    const char *identity;
    /* The KV heads to move: [head_lo, head_lo + head_n) (global ids). head_n 0: every head
     * this agent's rank holds (TP=1: every head, today's read). The stream is exactly the
     * slice (the producer gathers it out of its rank's pieces, we scatter it into ours),
     * staged on both sides as the slice's bytes only. The range must be held by this
     * agent's rank (else PKV_ERR_INVALID here) and by the producer's (else the read ends
     * rejected, pkv_xfer_read_why PKV_XFER_WHY_LAYOUT, before READ leaves). */
    uint32_t head_lo, head_n;
    /* A registration read by several reads (decode ranks that each need a slice, from
     * different agents, maybe at once): every read says how many (reads_total, 0 -> 1, at
     * most PKV_XFER_MAX_READS, all the same) and which it is (read_index < reads_total,
     * each once). The registration ends sent when all reads_total were acknowledged (a
     * release counts as one); until then its pins stay. */
    uint32_t reads_total, read_index;
} pkv_xfer_read_opts_t;

/* pkv_xfer_read with options (opts NULL: pkv_xfer_read). Also PKV_ERR_INVALID for
 * indices out of order or range, an identity that is not printable / too long, a head
 * range outside this agent's rank, reads_total above PKV_XFER_MAX_READS or read_index not
 * below it. */
PKV_API int pkv_xfer_read_ex(pkv_xfer_agent_t *agent, const pkv_xfer_handle_t *h,
                             const pkv_xfer_read_opts_t *opts, const uint32_t *dst, uint32_t n,
                             uint64_t deadline_ns, pkv_xfer_done_fn fn, void *arg,
                             pkv_xfer_read_t **out);

/* Why a read that ended rejected was refused, where the consumer can tell (valid once it
 * has an outcome): PKV_XFER_WHY_IDENTITY when the producer presented another identity;
 * PKV_XFER_WHY_BLOCKS when the handle's block ids (all of them, also those the read does
 * not name: the read carries a digest of the whole list) are not the registration's;
 * PKV_XFER_WHY_LAYOUT when the layouts are incompatible or the producer's rank does not
 * hold the read's heads; PKV_XFER_WHY_NONE otherwise (the producer's other refusals travel as text
 * in its log). */
typedef enum {
    PKV_XFER_WHY_NONE = 0,
    PKV_XFER_WHY_IDENTITY = 1,
    PKV_XFER_WHY_BLOCKS = 2,
    PKV_XFER_WHY_LAYOUT = 3 /* the producer's layout is incompatible with ours (refused at
                               the handshake, before READ left), or its rank does not hold
                               the read's head range */
} pkv_xfer_why_t;
PKV_API pkv_xfer_why_t pkv_xfer_read_why(const pkv_xfer_read_t *rd);
/* Wait until the read has an outcome or wait_deadline_ns passes (0: just poll).
 * PKV_OK with *outcome set, or PKV_ERR_TIMEOUT when it is still running. The caller polls
 * (yielding the CPU) for up to 50 us before it sleeps. */
PKV_API int pkv_xfer_read_wait(pkv_xfer_read_t *rd, uint64_t wait_deadline_ns, int *outcome);
/* Ask the read to end with PKV_ERR_CANCELLED (a no-op once it has an outcome). */
PKV_API void pkv_xfer_cancel(pkv_xfer_read_t *rd);
/* Drop the caller's reference (cancelling a running read). Staging and pins are returned
 * by the agent as soon as no copy or UCX operation touches them. NULL is a no-op. */
PKV_API void pkv_xfer_read_free(pkv_xfer_read_t *rd);
/* Payload bytes the read stored (valid once it has an outcome). */
PKV_API uint64_t pkv_xfer_read_bytes(const pkv_xfer_read_t *rd);

/* When a read's steps happened: absolute monotonic ns (pkv_now_ns's clock, CLOCK_MONOTONIC),
 * 0 for a step that did not happen. The read sends READ once it is connected and seated
 * (both start when the agent takes it), so started <= connected, seated <= requested. */
typedef struct {
    uint64_t started_ns;   /* the agent took the read: connecting and seating begin */
    uint64_t connected_ns; /* the endpoint to the producer could carry messages (the read's
                              start when the endpoint was already up) */
    uint64_t seated_ns;    /* staging granted (0: none needed, the producer's shared arena) */
    uint64_t requested_ns; /* READ left for the producer */
    uint64_t first_ns;     /* the first payload arrived (a chunk, or a shared-arena DATA) */
    uint64_t last_ns;      /* the last payload arrived */
    uint64_t done_ns;      /* the outcome was decided; ok: every layer stored, ACK sent */
} pkv_xfer_read_timings_t;
/* The read's timings, once it has an outcome (PKV_ERR_BUSY before). */
PKV_API int pkv_xfer_read_timings(const pkv_xfer_read_t *rd, pkv_xfer_read_timings_t *out);

/* ---- accounting ------------------------------------------------------------------------ */
typedef struct {
    /* consumer */
    uint64_t reads_started;
    uint64_t reads_done[8];  /* by outcome: ok, timeout, peer_lost, nofit, rejected,
                                cancelled, corrupt, shutdown (pkv_xfer_outcome_index) */
    uint64_t bytes_received; /* verified and stored */
    /* producer */
    uint64_t registered;     /* registrations made */
    uint64_t registrations;  /* live now */
    uint64_t pinned_blocks;  /* pins held now (registrations plus running reads' dst) */
    uint64_t serves_started; /* READs accepted */
    uint64_t serves_failed;  /* accepted READs that ended without ACK */
    uint64_t sent;           /* registrations acknowledged by a consumer (token-only
                                releases included) */
    uint64_t bytes_sent;     /* payload bytes of acknowledged transfers (what moved) */
    uint64_t rejected;       /* READs refused (unknown request, token, blocks, ...) */
    uint64_t expired;        /* registrations whose lease ran out */
    /* both */
    uint64_t active_transfers;   /* reads and serves not yet fully quiesced */
    uint64_t staging_pages_held; /* pages held by this agent's transfers now */
    uint64_t peers;              /* live peers */
    uint64_t peers_lost;
    uint64_t proto_errors;  /* messages that failed to decode (malformed, wrong side) */
    uint64_t stale_dropped; /* payload messages for ended transfers, discarded */
    uint64_t written_off;   /* UCX operations abandoned after a forced close */
    uint64_t foreign_msgs;  /* messages of another wire version (heartbeats included) */
    /* producer, after the fields above (their layout is kept) */
    uint64_t released; /* of `sent`: token-only releases (0 bytes moved) */
} pkv_xfer_stats_t;

PKV_API int pkv_xfer_outcome_index(int outcome); /* 0..7 for an outcome, -1 otherwise */
PKV_API void pkv_xfer_stats(pkv_xfer_agent_t *agent, pkv_xfer_stats_t *out);

/* Wait until no transfer holds staging, pins of a read, or UCX operations (registrations
 * keep their pins). PKV_OK, or PKV_ERR_TIMEOUT at deadline_ns. */
PKV_API int pkv_xfer_wait_idle(pkv_xfer_agent_t *agent, uint64_t deadline_ns);

#ifdef __cplusplus
}
#endif
#endif
