/*
 * xfer wire format, version 5 (internal to src/xfer).
 *
 * Every control message is one UCX active message whose payload is:
 *
 *   header (12 bytes, little-endian)
 *     u32 magic    0x58564B50 ("PKVX")
 *     u8  version  5; another version is not decoded (see below)
 *     u8  type     READ | DATA | ACK | FAIL | HEARTBEAT | CLOSE | HELLO
 *     u16 flags    0
 *     u32 body_len exactly the bytes that follow
 *   body (per type, see wire.c and docs/design/xfer.md)
 *
 * Frozen in every version, so that agents of different versions end each other's
 * transfers with a FAIL instead of leaving them to the deadline: the header; a READ,
 * DATA or ACK body's leading u64 xfer_id; the whole FAIL and CLOSE messages. A FAIL or
 * CLOSE of any version decodes (so shutdown's CLOSE handshake works across versions);
 * another version's READ or DATA is known by xf_wire_peek_foreign and answered
 * (the READ by a FAIL rejected, the DATA by ending the read rejected).
 *
 * The decoder validates every length, count, id and enumerated value against the
 * limits below before anything is used, never reads past `len`, never allocates,
 * and sets *out only on success. The payload bytes of a transfer travel as UCX tag
 * messages (tag layout below); their per-layer MAC (xfer/mac.h: Poly1305 under keys
 * derived from the registration's token and the READ's nonce) is in a DATA message, or,
 * for a whole-stream read (XF_WIRE_READ_WHOLE without SHARED), in the stream's trailer.
 *
 * Version 5: READ names a head range (a slice of the KV heads: the stream is the slice's
 * bytes) and which of a registration's reads_total reads it is; HELLO is sent by both
 * sides and carries a layout descriptor (model id, geometry, tp, rank, the heads held,
 * wire version); FAIL why LAYOUT. Version 4: per-layer 16-byte MACs instead of v3's u64 checksums
 * (DATA, the LAYERS list and the trailer); READ carries the consumer's nonce, may name any
 * subsequence of the registered blocks, or none (RELEASE: token-only release, answered by an ACK
 * from the producer), and a digest of the handle's whole block list (checked against the
 * registration's, so ids the plan does not name are checked too; a mismatch is FAIL with
 * why BLOCKS in the u16 that v1-v3 keep 0); HELLO: the accepting side presents its identity before
 * anything else. Version 3: a whole-stream read's checksums in a trailer (v2 sent a DATA with
 * LAYERS).
 */
#ifndef PKV_XFER_WIRE_H
#define PKV_XFER_WIRE_H

#include "pagekv/kv.h"
#include "pagekv/xfer.h"

#include <stddef.h>
#include <stdint.h>

#define XF_WIRE_MAGIC        0x58564B50u
#define XF_WIRE_VERSION      5
#define XF_WIRE_HEADER_BYTES 12u

enum {
    XF_WIRE_READ = 1,
    XF_WIRE_DATA = 2,
    XF_WIRE_ACK = 3,
    XF_WIRE_FAIL = 4,
    XF_WIRE_HEARTBEAT = 5,
    XF_WIRE_CLOSE = 6,
    XF_WIRE_HELLO = 7,
};
/* CLOSE flags: this is the answer to a CLOSE request. */
#define XF_WIRE_CLOSE_REPLY 1u

/* Limits every decoded message is checked against. */
#define XF_WIRE_MAX_MSG          (1u << 20) /* whole control message */
#define XF_WIRE_MAX_RUNS         65536u     /* block runs in one READ */
#define XF_WIRE_MAX_BLOCKS       (1u << 20) /* blocks in one READ / handle */
#define XF_WIRE_MAX_LAYERS       4096u
#define XF_WIRE_MAX_HEADS        4096u
#define XF_WIRE_MAX_HEAD_DIM     65536u
#define XF_WIRE_MAX_BLOCK_TOKENS 65536u
#define XF_WIRE_MIN_CHUNK        4096u
#define XF_WIRE_MAX_CHUNK        (64u << 20)
#define XF_WIRE_MAX_BYTES        (1ull << 40) /* bytes in one transfer */
#define XF_WIRE_MAX_BUDGET_NS    (24ull * 3600 * 1000000000ull)
#define XF_WIRE_MAX_TEXT         128u                  /* FAIL reason text */
#define XF_WIRE_MAX_IDENTITY     PKV_XFER_IDENTITY_MAX /* HELLO identity text */
#define XF_WIRE_MAX_MODEL_ID     PKV_XFER_MODEL_ID_MAX /* HELLO layout: model id text */
#define XF_WIRE_MAX_READS        PKV_XFER_MAX_READS    /* reads of one registration */
#define XF_WIRE_MAX_TP           PKV_KV_MAX_TP         /* HELLO layout: ranks */
#define XF_WIRE_MAC_BYTES        16u                   /* one layer's Poly1305 tag */
#define XF_WIRE_NONCE_BYTES      16u
#define XF_WIRE_DIGEST_BYTES     16u          /* a READ's digest of the handle's block ids */
#define XF_WIRE_MAX_PIECES       32768u       /* arena pieces in one shared DATA */
#define XF_WIRE_MAX_ARENA        (1ull << 44) /* a shared staging arena's bytes */
#define XF_WIRE_XFER_ID_BITS     38
#define XF_WIRE_CHUNK_BITS       24

/* Tag of payload chunk `chunk` of transfer `xfer_id` (the consumer's id). The two top
 * bits mark a pagekv data tag; every data tag of the worker matches XF_WIRE_TAG_KIND_MASK. */
#define XF_WIRE_TAG_KIND      (2ull << 62)
#define XF_WIRE_TAG_KIND_MASK (3ull << 62)
static inline uint64_t xf_wire_data_tag(uint64_t xfer_id, uint32_t chunk)
{
    return XF_WIRE_TAG_KIND | (xfer_id << XF_WIRE_CHUNK_BITS) | (uint64_t)chunk;
}

typedef struct {
    uint64_t xfer_id;    /* consumer's transfer id, 1 .. 2^38-1 */
    uint64_t request_id; /* producer's registration */
    uint8_t token[PKV_XFER_TOKEN_BYTES];
    uint8_t nonce[XF_WIRE_NONCE_BYTES];   /* the consumer's, fresh per read: MAC keys */
    uint8_t digest[XF_WIRE_DIGEST_BYTES]; /* the handle's whole block list (xf_wire_blocks_digest),
                                             also of blocks the plan does not name */
    uint64_t budget_ns;                   /* time left before the consumer's deadline when sent */
    pkv_geometry_t geo;   /* the consumer's pool geometry, every rank's heads (must equal the
                             producer's) */
    uint32_t chunk_bytes; /* payload chunk size (tag message size) */
    uint32_t flags;       /* XF_WIRE_READ_SHARED | _WHOLE | _RELEASE */
    uint32_t head_lo;     /* the KV heads the stream carries: [head_lo, head_lo + head_n) of */
    uint32_t head_n;      /* geo.kv_heads (global ids); RELEASE: both 0, else head_n >= 1 */
    uint16_t reads_total; /* the registration is read by this many reads (>= 1) ... */
    uint16_t read_index;  /* ... of which this is one (< reads_total) */
    uint32_t n_runs;      /* block runs in the plan (0 only with RELEASE) */
    uint32_t n_blocks;    /* sum of run counts (set by the decoder) */
    const uint8_t *runs;  /* n_runs x {u32 first, u32 count}, little-endian (decoder: into buf) */
} xf_wire_read_t;

/* READ flags: the consumer has mapped the producer's shared staging arena (same host):
 * send DATA with arena offsets instead of payload messages. */
#define XF_WIRE_READ_SHARED 1u
/* READ flags: whole stream (a small transfer): every layer is announced at once, with
 * every layer's checksum. Payload through UCX: the stream is followed by a trailer of
 * `layers` x u64 checksum (little-endian), and chunk c is bytes [c * chunk_bytes,
 * (c + 1) * chunk_bytes) of stream + trailer, whatever the layers; no DATA. With SHARED:
 * one DATA (SHARED | LAYERS) carries the arena pieces of the whole stream and the
 * checksums, sent once every layer is staged. */
#define XF_WIRE_READ_WHOLE 2u
/* READ flags: token-only release: no blocks (n_runs 0, neither SHARED nor WHOLE); the
 * producer checks the token, ends the registration as sent with 0 bytes and answers ACK
 * (bytes 0), or FAIL. */
#define XF_WIRE_READ_RELEASE 4u
/* DATA flags: the layer's bytes (with LAYERS: the bytes of its layers, in stream order)
 * are in the producer's shared arena at `pieces`. */
#define XF_WIRE_DATA_SHARED 1u
/* DATA flags: the message covers layers [layer, layer + n_macs), their MACs in `macs`;
 * `mac` is all zero. Only with SHARED (a whole-stream read). */
#define XF_WIRE_DATA_LAYERS 2u

typedef struct {
    uint64_t xfer_id;
    uint32_t layer;
    uint32_t flags;                 /* XF_WIRE_DATA_SHARED | XF_WIRE_DATA_LAYERS */
    uint64_t bytes;                 /* payload bytes of one layer */
    uint8_t mac[XF_WIRE_MAC_BYTES]; /* the layer's tag over its bytes in stream order */
    uint32_t n_pieces;              /* shared: pieces covering the layer(s) in stream order */
    const uint8_t *pieces;          /* n_pieces x {u64 offset, u64 length} (decoder: into buf) */
    uint32_t n_macs;                /* layers: how many layers, from `layer` */
    const uint8_t *macs;            /* n_macs x 16-byte tag (decoder: into buf) */
} xf_wire_data_t;

/* Consumer -> producer: the read is stored. Producer -> consumer: a token-only release
 * (READ RELEASE) was accepted (bytes 0). */
typedef struct {
    uint64_t xfer_id;
    uint64_t request_id;
    uint64_t bytes; /* bytes the consumer verified and stored */
} xf_wire_ack_t;

/* FAIL why: what a refusal was about, where the consumer can name it (0: not said; v1-v3
 * send 0 in this field). Sent only in answer to a READ of this version. */
#define XF_WIRE_WHY_BLOCKS 1u /* the READ's digest is not the registration's block ids */
#define XF_WIRE_WHY_LAYOUT 2u /* geometry, or heads this producer rank does not hold (v5) */
#define XF_WIRE_WHY_MAX    2u

typedef struct {
    uint64_t xfer_id;
    uint64_t request_id;
    int32_t reason; /* an outcome status: timeout, nofit, rejected, cancelled, corrupt, ... */
    uint16_t why;   /* 0 or XF_WIRE_WHY_* */
    char text[XF_WIRE_MAX_TEXT + 1]; /* printable ASCII, NUL-terminated */
} xf_wire_fail_t;

typedef struct {
    uint64_t agent_id;
    uint64_t seq;
} xf_wire_heartbeat_t;

/* An agent about to close the connection sends CLOSE and waits (bounded) for the reply:
 * messages travel in order, so the reply proves the peer processed everything before it
 * (the last ACKs and FAILs) — a local send completion only means our kernel has it. */
typedef struct {
    uint64_t agent_id;
    uint32_t flags; /* XF_WIRE_CLOSE_REPLY */
} xf_wire_close_t;

/* Each side's first message: who it is (pkv_xfer_config_t identity; empty when it has
 * none) and its layout (model id, geometry, tp, rank, the heads its rank holds, wire
 * version). A consumer sends READ only after the producer's HELLO came, its layout is
 * compatible and, when the read names one, its identity matched. */
typedef struct {
    uint64_t agent_id;
    char identity[XF_WIRE_MAX_IDENTITY + 1]; /* printable ASCII, NUL-terminated */
    pkv_xfer_layout_t layout; /* model_id printable (<= 63), geometry checked, 1 <= tp <= 64,
                                 rank < tp, 1 <= head_n, head_lo + head_n <= kv_heads,
                                 wire == XF_WIRE_VERSION */
} xf_wire_hello_t;

typedef struct {
    uint8_t type;
    union {
        xf_wire_read_t read;
        xf_wire_data_t data;
        xf_wire_ack_t ack;
        xf_wire_fail_t fail;
        xf_wire_heartbeat_t hb;
        xf_wire_close_t close;
        xf_wire_hello_t hello;
    } u;
} xf_wire_msg_t;

/* Decode one message. PKV_OK and *out, or PKV_ERR_PROTO (nothing written). A READ's
 * `runs` points into buf: buf must outlive the use of out->u.read. */
int xf_wire_decode(const void *buf, size_t len, xf_wire_msg_t *out);
/* Another version's message: what every version keeps (see the top of this file). */
typedef struct {
    uint8_t version, type;
    uint64_t xfer_id; /* READ, DATA, ACK, FAIL: the leading xfer_id if in range, else 0 */
} xf_wire_foreign_t;
/* PKV_OK and *out when buf has our magic, header flags 0, a version other than ours and
 * a body of exactly body_len bytes; PKV_ERR_PROTO otherwise (nothing written). A FAIL or
 * CLOSE of another version is both peeked and decoded. */
int xf_wire_peek_foreign(const void *buf, size_t len, xf_wire_foreign_t *out);
/* The same for any version, ours included: what a message that failed to decode still
 * says (its type and the transfer it names), so it can be answered. */
int xf_wire_peek(const void *buf, size_t len, xf_wire_foreign_t *out);
/* Run i (< n_runs) of a decoded or to-be-encoded READ. */
void xf_wire_read_run(const xf_wire_read_t *r, uint32_t i, uint32_t *first, uint32_t *count);
/* Piece i (< n_pieces) of a decoded shared DATA. */
void xf_wire_data_piece(const xf_wire_data_t *d, uint32_t i, uint64_t *offset, uint64_t *length);
/* MAC i (< n_macs) of a decoded DATA with XF_WIRE_DATA_LAYERS: layer `layer + i`. */
const uint8_t *xf_wire_data_mac(const xf_wire_data_t *d, uint32_t i);
/* Is reason an outcome a FAIL may carry? */
bool xf_wire_reason_valid(int32_t reason);

/* Geometry checks shared by READ and handles: PKV_OK or PKV_ERR_PROTO. On success
 * *layer_bytes is the bytes of one block's slice of one layer (K and V, all heads). */
int xf_wire_check_geometry(const pkv_geometry_t *g, uint64_t *layer_bytes);
/* One block's slice of one layer restricted to head_n heads (K and V): for a geometry that
 * passed xf_wire_check_geometry and head_n <= kv_heads, no overflow. */
uint64_t xf_wire_slice_bytes(const pkv_geometry_t *g, uint32_t head_n);

/* s (NULL: "") is printable ASCII of at most max characters: an identity or a model id an
 * agent may present. Reads at most max + 1 bytes of s. */
bool xf_wire_text_ok(const char *s, size_t max);

/* Is a layout one HELLO may carry (the decoder's checks)? */
bool xf_wire_layout_valid(const pkv_xfer_layout_t *l);

/* Is addr a "host:port" we would accept in a handle? */
bool xf_wire_addr_valid(const char *addr);

/* The digest a READ carries of a handle's block ids (the registration's): the first
 * XF_WIRE_DIGEST_BYTES bytes of SHA-256 over u32 n, then blocks[0..n), little-endian.
 * PKV_OK, or PKV_ERR_NOMEM when OpenSSL cannot make a context (out untouched). */
int xf_wire_blocks_digest(const uint32_t *blocks, uint32_t n, uint8_t *out);

/* Number of runs of consecutive ids in blocks[0..n). */
uint32_t xf_wire_count_runs(const uint32_t *blocks, uint32_t n);

/* Encoders: write the message into buf (cap bytes). PKV_OK and *len, PKV_ERR_NOSPACE when
 * cap is too small, PKV_ERR_INVALID when a field is out of the limits above (so nothing
 * we send fails our own decoder). encode_read takes the plan as a block list and
 * coalesces it into runs (n 0 only with XF_WIRE_READ_RELEASE); r->runs / r->n_runs /
 * r->n_blocks are ignored. */
size_t xf_wire_read_bytes(uint32_t n_runs);
int xf_wire_encode_read(const xf_wire_read_t *r, const uint32_t *blocks, uint32_t n, void *buf,
                        size_t cap, size_t *len);
/* The trailers: n_pieces x {offset, length} (XF_WIRE_DATA_SHARED, else NULL / 0), then
 * n_macs 16-byte tags (XF_WIRE_DATA_LAYERS, else NULL / 0); d->pieces / d->macs and their
 * counts are ignored. */
size_t xf_wire_data_bytes(uint32_t n_pieces, uint32_t n_macs);
int xf_wire_encode_data(const xf_wire_data_t *d, const uint64_t *pieces, uint32_t n_pieces,
                        const uint8_t *macs, uint32_t n_macs, void *buf, size_t cap, size_t *len);
int xf_wire_encode_ack(const xf_wire_ack_t *a, void *buf, size_t cap, size_t *len);
int xf_wire_encode_fail(const xf_wire_fail_t *f, void *buf, size_t cap, size_t *len);
int xf_wire_encode_heartbeat(const xf_wire_heartbeat_t *h, void *buf, size_t cap, size_t *len);
int xf_wire_encode_close(const xf_wire_close_t *c, void *buf, size_t cap, size_t *len);
int xf_wire_encode_hello(const xf_wire_hello_t *h, void *buf, size_t cap, size_t *len);

#endif
