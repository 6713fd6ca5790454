/*
 * xfer wire format v5: encoders and the bounds-checked decoder for control messages,
 * and the KV handle's byte form (public: pkv_xfer_handle_encode / _decode).
 *
 * Decoding rule: a cursor over [buf, buf + len) hands out fields only after checking
 * that they fit; every count is checked against its limit before it is multiplied, and
 * every derived size is computed with overflow checks. Anything unexpected (bad magic,
 * unknown version or type, non-zero reserved bits, a length that does not match the
 * body exactly, an out-of-range value) is PKV_ERR_PROTO with nothing written.
 *
 * Bodies (all little-endian):
 *   READ      u64 xfer_id, u64 request_id, u8 token[16], u8 nonce[16], u8 digest[16]
 *             (the handle's block ids: xf_wire_blocks_digest), u64 budget_ns,
 *             u32 layers, u32 kv_heads, u32 head_dim, u32 block_tokens, u32 dtype,
 *             u32 chunk_bytes, u32 flags (SHARED, WHOLE, RELEASE), u32 head_lo,
 *             u32 head_n, u16 reads_total, u16 read_index, u32 reserved (0), u32 n_runs,
 *             n_runs x {u32 first_block, u32 count} (n_runs 0 and heads 0, 0 exactly
 *             with RELEASE)
 *   DATA      u64 xfer_id, u32 layer, u32 flags (SHARED, LAYERS only with SHARED),
 *             u64 bytes (one layer's),
 *             u8 mac[16] (zero with LAYERS),
 *             if SHARED: u32 n_pieces, u32 reserved (0), n_pieces x {u64 offset, u64 length}
 *                        (they add up to bytes, with LAYERS to n * bytes)
 *             if LAYERS: u32 n, u32 reserved (0), n x u8 mac[16] (layers layer..+n-1)
 *   ACK       u64 xfer_id, u64 request_id, u64 bytes
 *   FAIL      u64 xfer_id, u64 request_id, i32 reason, u16 text_len, u16 why (0 through
 *             v3; 0 or XF_WIRE_WHY_*: BLOCKS from v4, LAYOUT from v5),
 *             text_len bytes of printable ASCII
 *   HEARTBEAT u64 agent_id, u64 seq
 *   CLOSE     u64 agent_id, u32 flags (REPLY), u32 reserved (0)
 *   HELLO     u64 agent_id, u16 id_len, u16 model_len, u32 reserved (0), u32 layers,
 *             u32 kv_heads, u32 head_dim, u32 block_tokens, u32 dtype, u32 tp, u32 rank,
 *             u32 head_lo, u32 head_n, u32 wire, id_len bytes of printable ASCII
 *             (<= XF_WIRE_MAX_IDENTITY), model_len bytes of printable ASCII
 *             (<= XF_WIRE_MAX_MODEL_ID)
 * A flag bit this version does not know is malformed, so a peer that adds one must also
 * change XF_WIRE_VERSION or be rejected. The header, READ / DATA / ACK's leading xfer_id
 * and the whole FAIL and CLOSE stay as they are in every version (wire.h): a FAIL or CLOSE
 * of any version decodes here with this layout.
 *
 * Handle (PKVH v1): u32 magic "PKVH", u8 version 1, u8 addr_len, u16 flags (LOCAL),
 *   u64 request_id, u8 token[16], u32 layers, kv_heads, head_dim, block_tokens, dtype,
 *   u32 n_blocks, if LOCAL: {u32 pid, u32 fd, u64 arena_bytes, u64 ino, u8 boot_id[16]},
 *   addr_len bytes of address, n_blocks x u32 block id.
 */
#include "xfer/wire.h"

#include "core/core.h"

#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>

#define READ_FIXED_BYTES   120u
#define DATA_BYTES         40u
#define HELLO_FIXED_BYTES  56u
#define DATA_PIECES_HDR    8u
#define HANDLE_LOCAL       1u
#define HANDLE_LOCAL_BYTES 40u
#define ACK_BYTES          24u
#define FAIL_FIXED_BYTES   24u
#define HB_BYTES           16u
#define CLOSE_BYTES        16u
#define HANDLE_MAGIC       0x48564B50u /* bytes "PKVH" */
#define HANDLE_VERSION     1
#define HANDLE_FIXED_BYTES 56u

/* ---- little-endian cursors ----------------------------------------------------------- */
typedef struct {
    const uint8_t *p;
    size_t left;
} rcur_t;

static bool get_bytes(rcur_t *c, void *dst, size_t n)
{
    if (c->left < n) return false;
    memcpy(dst, c->p, n);
    c->p += n;
    c->left -= n;
    return true;
}
static bool get_u8(rcur_t *c, uint8_t *v)
{
    return get_bytes(c, v, 1);
}
static bool get_u16(rcur_t *c, uint16_t *v)
{
    uint8_t b[2];
    if (!get_bytes(c, b, 2)) return false;
    *v = (uint16_t)(b[0] | (b[1] << 8));
    return true;
}
static bool get_u32(rcur_t *c, uint32_t *v)
{
    uint8_t b[4];
    if (!get_bytes(c, b, 4)) return false;
    *v = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    return true;
}
static bool get_u64(rcur_t *c, uint64_t *v)
{
    uint32_t lo, hi;
    if (!get_u32(c, &lo) || !get_u32(c, &hi)) return false;
    *v = (uint64_t)hi << 32 | lo;
    return true;
}

static uint32_t le32(const uint8_t *b)
{
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

typedef struct {
    uint8_t *p;
    size_t left;
} wcur_t;

static void put_bytes(wcur_t *c, const void *src, size_t n)
{
    PKV_ASSERT(c->left >= n); /* callers size the buffer first */
    memcpy(c->p, src, n);
    c->p += n;
    c->left -= n;
}
static void put_u8(wcur_t *c, uint8_t v)
{
    put_bytes(c, &v, 1);
}
static void put_u16(wcur_t *c, uint16_t v)
{
    uint8_t b[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
    put_bytes(c, b, 2);
}
static void put_u32(wcur_t *c, uint32_t v)
{
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    put_bytes(c, b, 4);
}
static void put_u64(wcur_t *c, uint64_t v)
{
    put_u32(c, (uint32_t)v);
    put_u32(c, (uint32_t)(v >> 32));
}

static void put_header(wcur_t *c, uint8_t type, uint32_t body_len)
{
    put_u32(c, XF_WIRE_MAGIC);
    put_u8(c, XF_WIRE_VERSION);
    put_u8(c, type);
    put_u16(c, 0);
    put_u32(c, body_len);
}

/* ---- shared checks -------------------------------------------------------------------- */
/* A KV dtype on the wire: its pkv_dtype_t, and for int8 its row format's revision in bits
 * 8-15 (format 2: eight lane-group scales, docs/design/pool.md "Quantized KV"). An agent of
 * int8 format 1 sent a plain 3: the two refuse each other's messages (PKV_ERR_PROTO) rather
 * than read each other's rows with the wrong scales. */
#define WIRE_INT8_FORMAT 2u
static uint32_t dtype_to_wire(pkv_dtype_t dt)
{
    return dt == PKV_DTYPE_INT8 ? (uint32_t)dt | WIRE_INT8_FORMAT << 8 : (uint32_t)dt;
}

static int dtype_from_wire(uint32_t w, pkv_dtype_t *dt)
{
    uint32_t base = w & 0xff;
    if (base > PKV_DTYPE_FP8 || w != dtype_to_wire((pkv_dtype_t)base)) return PKV_ERR_PROTO;
    *dt = (pkv_dtype_t)base;
    return PKV_OK;
}

/* Bytes of one row (one token's one head) of a wire dtype: its values, then a scaled
 * dtype's f32 scale (kept here so the decoder depends on nothing else). */
static uint64_t row_bytes(const pkv_geometry_t *g)
{
    uint64_t d = g->head_dim;
    return g->dtype == PKV_DTYPE_F32 ? 4 * d : g->dtype <= PKV_DTYPE_BF16 ? 2 * d : d + 4;
}

int xf_wire_check_geometry(const pkv_geometry_t *g, uint64_t *layer_bytes)
{
    if (g->layers < 1 || g->layers > XF_WIRE_MAX_LAYERS) return PKV_ERR_PROTO;
    if (g->kv_heads < 1 || g->kv_heads > XF_WIRE_MAX_HEADS) return PKV_ERR_PROTO;
    if (g->head_dim < 1 || g->head_dim > XF_WIRE_MAX_HEAD_DIM) return PKV_ERR_PROTO;
    if (g->block_tokens < 1 || g->block_tokens > XF_WIRE_MAX_BLOCK_TOKENS) return PKV_ERR_PROTO;
    if ((unsigned)g->dtype > PKV_DTYPE_FP8) return PKV_ERR_PROTO;
    /* 2 * 2^12 * 2^16 * (2^16 * 4) = 2^47: no overflow in 64 bits. */
    uint64_t lb = 2ull * g->kv_heads * g->block_tokens * row_bytes(g);
    uint64_t block;
    if (__builtin_mul_overflow(lb, (uint64_t)g->layers, &block) || block > XF_WIRE_MAX_BYTES)
        return PKV_ERR_PROTO;
    *layer_bytes = lb;
    return PKV_OK;
}

uint64_t xf_wire_slice_bytes(const pkv_geometry_t *g, uint32_t head_n)
{
    return 2ull * head_n * g->block_tokens * row_bytes(g);
}

bool xf_wire_reason_valid(int32_t reason)
{
    switch (reason) {
    case PKV_ERR_TIMEOUT:
    case PKV_ERR_PEER_LOST:
    case PKV_ERR_NOFIT:
    case PKV_ERR_REJECTED:
    case PKV_ERR_CANCELLED:
    case PKV_ERR_CORRUPT:
    case PKV_ERR_SHUTDOWN:
        return true;
    default:
        return false;
    }
}

int xf_wire_blocks_digest(const uint32_t *blocks, uint32_t n, uint8_t *out)
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    uint8_t le[4 * 256], md[EVP_MAX_MD_SIZE];
    unsigned md_len = 0;
    int ok = ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL);
    for (uint32_t i = 0; ok && i <= n;) { /* n itself first, then the ids, 256 at a time */
        uint32_t k = 0;
        for (; k < 256 && i <= n; k++, i++) {
            uint32_t v = i ? blocks[i - 1] : n;
            for (int j = 0; j < 4; j++) le[4 * k + j] = (uint8_t)(v >> (8 * j));
        }
        ok = EVP_DigestUpdate(ctx, le, 4 * (size_t)k);
    }
    ok = ok && EVP_DigestFinal_ex(ctx, md, &md_len) && md_len >= XF_WIRE_DIGEST_BYTES;
    EVP_MD_CTX_free(ctx);
    if (!ok) return PKV_ERR_NOMEM;
    memcpy(out, md, XF_WIRE_DIGEST_BYTES);
    return PKV_OK;
}

uint32_t xf_wire_count_runs(const uint32_t *blocks, uint32_t n)
{
    uint32_t runs = 0;
    for (uint32_t i = 0; i < n; i++)
        if (i == 0 || blocks[i] != blocks[i - 1] + 1 || blocks[i - 1] == UINT32_MAX) runs++;
    return runs;
}

static uint64_t le64(const uint8_t *b)
{
    return (uint64_t)le32(b) | (uint64_t)le32(b + 4) << 32;
}

void xf_wire_data_piece(const xf_wire_data_t *d, uint32_t i, uint64_t *offset, uint64_t *length)
{
    PKV_ASSERT(i < d->n_pieces);
    *offset = le64(d->pieces + 16 * (size_t)i);
    *length = le64(d->pieces + 16 * (size_t)i + 8);
}

const uint8_t *xf_wire_data_mac(const xf_wire_data_t *d, uint32_t i)
{
    PKV_ASSERT(i < d->n_macs);
    return d->macs + XF_WIRE_MAC_BYTES * (size_t)i;
}

void xf_wire_read_run(const xf_wire_read_t *r, uint32_t i, uint32_t *first, uint32_t *count)
{
    PKV_ASSERT(i < r->n_runs);
    *first = le32(r->runs + 8 * (size_t)i);
    *count = le32(r->runs + 8 * (size_t)i + 4);
}

/* Bytes of a READ transfer: layers * n_blocks * the head slice's layer bytes, bounded;
 * chunk count bounded. */
static int check_read_sizes(const pkv_geometry_t *g, uint32_t head_n, uint32_t n_blocks,
                            uint32_t chunk_bytes)
{
    uint64_t lb, per_layer;
    if (xf_wire_check_geometry(g, &lb) || head_n < 1 || head_n > g->kv_heads) return PKV_ERR_PROTO;
    lb = xf_wire_slice_bytes(g, head_n);
    if (n_blocks < 1 || n_blocks > XF_WIRE_MAX_BLOCKS) return PKV_ERR_PROTO;
    if (chunk_bytes < XF_WIRE_MIN_CHUNK || chunk_bytes > XF_WIRE_MAX_CHUNK) return PKV_ERR_PROTO;
    if (__builtin_mul_overflow(lb, (uint64_t)n_blocks, &per_layer)) return PKV_ERR_PROTO;
    if (per_layer > XF_WIRE_MAX_BYTES / g->layers) return PKV_ERR_PROTO;
    uint64_t chunks = PKV_DIV_UP(per_layer, chunk_bytes) * g->layers;
    if (chunks >= (1ull << XF_WIRE_CHUNK_BITS)) return PKV_ERR_PROTO;
    return PKV_OK;
}

static bool printable(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] < 0x20 || s[i] > 0x7e) return false;
    return true;
}

bool xf_wire_text_ok(const char *s, size_t max)
{
    size_t n = s ? strnlen(s, max + 1) : 0;
    return n <= max && printable(s, n);
}

bool xf_wire_layout_valid(const pkv_xfer_layout_t *l)
{
    uint64_t lb;
    size_t ml = strnlen(l->model_id, sizeof(l->model_id));
    return ml <= XF_WIRE_MAX_MODEL_ID && printable(l->model_id, ml) &&
           !xf_wire_check_geometry(&l->geo, &lb) && l->tp >= 1 && l->tp <= XF_WIRE_MAX_TP &&
           l->rank < l->tp && l->head_n >= 1 &&
           (uint64_t)l->head_lo + l->head_n <= l->geo.kv_heads && l->wire == XF_WIRE_VERSION;
}

/* A READ's head range and read count: a release names no heads, a read names a range
 * within the geometry's heads; 1 <= reads_total <= the limit, read_index below it. */
static bool read_heads_valid(const xf_wire_read_t *r, bool release)
{
    if (r->reads_total < 1 || r->reads_total > XF_WIRE_MAX_READS || r->read_index >= r->reads_total)
        return false;
    if (release) return r->head_lo == 0 && r->head_n == 0;
    return r->head_n >= 1 && (uint64_t)r->head_lo + r->head_n <= r->geo.kv_heads;
}

/* ---- decode --------------------------------------------------------------------------- */
#define READ_FLAGS (XF_WIRE_READ_SHARED | XF_WIRE_READ_WHOLE | XF_WIRE_READ_RELEASE)

static int decode_read(rcur_t *c, xf_wire_read_t *r)
{
    uint32_t dtype, reserved;
    if (!get_u64(c, &r->xfer_id) || !get_u64(c, &r->request_id) ||
        !get_bytes(c, r->token, sizeof(r->token)) || !get_bytes(c, r->nonce, sizeof(r->nonce)) ||
        !get_bytes(c, r->digest, sizeof(r->digest)) || !get_u64(c, &r->budget_ns) ||
        !get_u32(c, &r->geo.layers) || !get_u32(c, &r->geo.kv_heads) ||
        !get_u32(c, &r->geo.head_dim) || !get_u32(c, &r->geo.block_tokens) || !get_u32(c, &dtype) ||
        !get_u32(c, &r->chunk_bytes) || !get_u32(c, &r->flags) || !get_u32(c, &r->head_lo) ||
        !get_u32(c, &r->head_n) || !get_u16(c, &r->reads_total) || !get_u16(c, &r->read_index) ||
        !get_u32(c, &reserved) || !get_u32(c, &r->n_runs))
        return PKV_ERR_PROTO;
    if ((r->flags & ~READ_FLAGS) || reserved) return PKV_ERR_PROTO;
    bool release = r->flags & XF_WIRE_READ_RELEASE;
    if (release && (r->flags != XF_WIRE_READ_RELEASE || r->n_runs)) return PKV_ERR_PROTO;
    if (r->xfer_id == 0 || r->xfer_id >= (1ull << XF_WIRE_XFER_ID_BITS)) return PKV_ERR_PROTO;
    if (r->budget_ns > XF_WIRE_MAX_BUDGET_NS) return PKV_ERR_PROTO;
    if (dtype_from_wire(dtype, &r->geo.dtype)) return PKV_ERR_PROTO;
    if (!read_heads_valid(r, release)) return PKV_ERR_PROTO;
    if (release) { /* no plan: the geometry and the chunk size are still checked */
        uint64_t lb;
        if (c->left || xf_wire_check_geometry(&r->geo, &lb) || r->chunk_bytes < XF_WIRE_MIN_CHUNK ||
            r->chunk_bytes > XF_WIRE_MAX_CHUNK)
            return PKV_ERR_PROTO;
        r->runs = c->p;
        r->n_blocks = 0;
        return PKV_OK;
    }
    if (r->n_runs < 1 || r->n_runs > XF_WIRE_MAX_RUNS) return PKV_ERR_PROTO;
    if (c->left != 8 * (size_t)r->n_runs) return PKV_ERR_PROTO;
    r->runs = c->p;
    uint64_t total = 0;
    for (uint32_t i = 0; i < r->n_runs; i++) {
        uint32_t first, count;
        xf_wire_read_run(r, i, &first, &count);
        if (count < 1 || (uint64_t)first + count - 1 > UINT32_MAX) return PKV_ERR_PROTO;
        total += count;
        if (total > XF_WIRE_MAX_BLOCKS) return PKV_ERR_PROTO;
    }
    r->n_blocks = (uint32_t)total;
    c->left = 0;
    return check_read_sizes(&r->geo, r->head_n, r->n_blocks, r->chunk_bytes);
}

/* DATA with SHARED: the arena pieces, each in range, covering every layer the message
 * announces (with LAYERS n_macs of them). */
static bool data_pieces_valid(const xf_wire_data_t *d, bool layers)
{
    uint64_t sum = 0;
    for (uint32_t i = 0; i < d->n_pieces; i++) {
        uint64_t off, plen;
        xf_wire_data_piece(d, i, &off, &plen);
        if (plen < 1 || off >= XF_WIRE_MAX_ARENA || plen > XF_WIRE_MAX_ARENA - off) return false;
        sum += plen; /* each < 2^44, at most 2^15 of them: no overflow */
    }
    /* the pieces cover every layer the message announces (< 2^40 * 2^12 bytes) */
    return sum == d->bytes * (layers ? d->n_macs : 1);
}

static int decode_data(rcur_t *c, xf_wire_data_t *d)
{
    if (c->left < DATA_BYTES) return PKV_ERR_PROTO;
    get_u64(c, &d->xfer_id);
    get_u32(c, &d->layer);
    get_u32(c, &d->flags);
    get_u64(c, &d->bytes);
    get_bytes(c, d->mac, sizeof(d->mac));
    if ((d->flags & ~(XF_WIRE_DATA_SHARED | XF_WIRE_DATA_LAYERS)) || d->xfer_id == 0 ||
        d->xfer_id >= (1ull << XF_WIRE_XFER_ID_BITS) || d->layer >= XF_WIRE_MAX_LAYERS ||
        d->bytes > XF_WIRE_MAX_BYTES)
        return PKV_ERR_PROTO;
    bool shared = d->flags & XF_WIRE_DATA_SHARED, layers = d->flags & XF_WIRE_DATA_LAYERS;
    uint32_t reserved;
    if (layers && !shared) return PKV_ERR_PROTO; /* v3: a trailer carries those sums */
    if (shared) {
        if (!get_u32(c, &d->n_pieces) || !get_u32(c, &reserved) || reserved || d->n_pieces < 1 ||
            d->n_pieces > XF_WIRE_MAX_PIECES || c->left < 16 * (size_t)d->n_pieces)
            return PKV_ERR_PROTO;
        d->pieces = c->p;
        c->p += 16 * (size_t)d->n_pieces;
        c->left -= 16 * (size_t)d->n_pieces;
    }
    if (layers) {
        static const uint8_t zero[XF_WIRE_MAC_BYTES];
        if (!get_u32(c, &d->n_macs) || !get_u32(c, &reserved) || reserved ||
            memcmp(d->mac, zero, sizeof(zero)) || d->n_macs < 1 ||
            d->n_macs > XF_WIRE_MAX_LAYERS - d->layer ||
            c->left != XF_WIRE_MAC_BYTES * (size_t)d->n_macs)
            return PKV_ERR_PROTO;
        d->macs = c->p;
        c->left = 0;
    }
    if (c->left) return PKV_ERR_PROTO;
    if (shared && !data_pieces_valid(d, layers)) return PKV_ERR_PROTO;
    return PKV_OK;
}

static int decode_ack(rcur_t *c, xf_wire_ack_t *a)
{
    if (c->left != ACK_BYTES) return PKV_ERR_PROTO;
    get_u64(c, &a->xfer_id);
    get_u64(c, &a->request_id);
    get_u64(c, &a->bytes);
    if (a->xfer_id == 0 || a->xfer_id >= (1ull << XF_WIRE_XFER_ID_BITS) ||
        a->bytes > XF_WIRE_MAX_BYTES)
        return PKV_ERR_PROTO;
    return PKV_OK;
}

static int decode_fail(rcur_t *c, xf_wire_fail_t *f)
{
    uint32_t reason;
    uint16_t text_len;
    if (c->left < FAIL_FIXED_BYTES) return PKV_ERR_PROTO;
    get_u64(c, &f->xfer_id);
    get_u64(c, &f->request_id);
    get_u32(c, &reason);
    get_u16(c, &text_len);
    get_u16(c, &f->why);
    f->reason = (int32_t)reason;
    if (f->why > XF_WIRE_WHY_MAX || text_len > XF_WIRE_MAX_TEXT || c->left != text_len)
        return PKV_ERR_PROTO;
    if (f->xfer_id >= (1ull << XF_WIRE_XFER_ID_BITS)) return PKV_ERR_PROTO;
    if (!xf_wire_reason_valid(f->reason)) return PKV_ERR_PROTO;
    get_bytes(c, f->text, text_len);
    f->text[text_len] = '\0';
    if (!printable(f->text, text_len)) return PKV_ERR_PROTO;
    return PKV_OK;
}

static int decode_heartbeat(rcur_t *c, xf_wire_heartbeat_t *hb)
{
    if (c->left != HB_BYTES) return PKV_ERR_PROTO;
    get_u64(c, &hb->agent_id);
    get_u64(c, &hb->seq);
    return PKV_OK;
}

static int decode_close(rcur_t *c, xf_wire_close_t *cl)
{
    uint32_t reserved;
    if (c->left != CLOSE_BYTES) return PKV_ERR_PROTO;
    get_u64(c, &cl->agent_id);
    get_u32(c, &cl->flags);
    get_u32(c, &reserved);
    if (reserved || (cl->flags & ~XF_WIRE_CLOSE_REPLY)) return PKV_ERR_PROTO;
    return PKV_OK;
}

static int decode_hello(rcur_t *c, xf_wire_hello_t *h)
{
    pkv_xfer_layout_t *l = &h->layout;
    uint16_t id_len, model_len;
    uint32_t r32, dtype;
    if (c->left < HELLO_FIXED_BYTES) return PKV_ERR_PROTO;
    get_u64(c, &h->agent_id);
    get_u16(c, &id_len);
    get_u16(c, &model_len);
    get_u32(c, &r32);
    get_u32(c, &l->geo.layers);
    get_u32(c, &l->geo.kv_heads);
    get_u32(c, &l->geo.head_dim);
    get_u32(c, &l->geo.block_tokens);
    get_u32(c, &dtype);
    get_u32(c, &l->tp);
    get_u32(c, &l->rank);
    get_u32(c, &l->head_lo);
    get_u32(c, &l->head_n);
    get_u32(c, &l->wire);
    if (r32 || id_len > XF_WIRE_MAX_IDENTITY || model_len > XF_WIRE_MAX_MODEL_ID ||
        dtype_from_wire(dtype, &l->geo.dtype) || c->left != (size_t)id_len + model_len)
        return PKV_ERR_PROTO;
    get_bytes(c, h->identity, id_len);
    h->identity[id_len] = '\0';
    get_bytes(c, l->model_id, model_len);
    l->model_id[model_len] = '\0';
    if (!printable(h->identity, id_len) || !xf_wire_layout_valid(l)) return PKV_ERR_PROTO;
    return PKV_OK;
}

/* The body after a checked header: one decoder per type, each checking its own lengths
 * before it reads. */
static int decode_body(rcur_t *c, xf_wire_msg_t *m)
{
    switch (m->type) {
    case XF_WIRE_READ:
        return decode_read(c, &m->u.read);
    case XF_WIRE_DATA:
        return decode_data(c, &m->u.data);
    case XF_WIRE_ACK:
        return decode_ack(c, &m->u.ack);
    case XF_WIRE_FAIL:
        return decode_fail(c, &m->u.fail);
    case XF_WIRE_HEARTBEAT:
        return decode_heartbeat(c, &m->u.hb);
    case XF_WIRE_CLOSE:
        return decode_close(c, &m->u.close);
    case XF_WIRE_HELLO:
        return decode_hello(c, &m->u.hello);
    default:
        return PKV_ERR_PROTO;
    }
}

int xf_wire_decode(const void *buf, size_t len, xf_wire_msg_t *out)
{
    if (!buf || len < XF_WIRE_HEADER_BYTES || len > XF_WIRE_MAX_MSG || !out) return PKV_ERR_PROTO;
    rcur_t c = {buf, len};
    uint32_t magic = 0, body_len = 0;
    uint8_t version = 0, type = 0;
    uint16_t flags = 0;
    if (!get_u32(&c, &magic) || !get_u8(&c, &version) || !get_u8(&c, &type) ||
        !get_u16(&c, &flags) || !get_u32(&c, &body_len))
        return PKV_ERR_PROTO;
    if (magic != XF_WIRE_MAGIC || version == 0 || flags != 0) return PKV_ERR_PROTO;
    if (version != XF_WIRE_VERSION && type != XF_WIRE_FAIL && type != XF_WIRE_CLOSE)
        return PKV_ERR_PROTO;
    if (body_len != c.left) return PKV_ERR_PROTO;

    xf_wire_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = type;
    if (decode_body(&c, &m)) return PKV_ERR_PROTO;
    *out = m;
    return PKV_OK;
}

int xf_wire_peek_foreign(const void *buf, size_t len, xf_wire_foreign_t *out)
{
    xf_wire_foreign_t f;
    if (xf_wire_peek(buf, len, &f) || f.version == XF_WIRE_VERSION) return PKV_ERR_PROTO;
    *out = f;
    return PKV_OK;
}

int xf_wire_peek(const void *buf, size_t len, xf_wire_foreign_t *out)
{
    if (!buf || len < XF_WIRE_HEADER_BYTES || len > XF_WIRE_MAX_MSG || !out) return PKV_ERR_PROTO;
    rcur_t c = {buf, len};
    uint32_t magic = 0, body_len = 0;
    uint16_t flags = 0;
    xf_wire_foreign_t f = {0, 0, 0};
    get_u32(&c, &magic);
    get_u8(&c, &f.version);
    get_u8(&c, &f.type);
    get_u16(&c, &flags);
    get_u32(&c, &body_len);
    if (magic != XF_WIRE_MAGIC || f.version == 0 || flags || body_len != c.left)
        return PKV_ERR_PROTO;
    uint64_t id = 0;
    if ((f.type == XF_WIRE_READ || f.type == XF_WIRE_DATA || f.type == XF_WIRE_ACK ||
         f.type == XF_WIRE_FAIL) &&
        get_u64(&c, &id) && id < (1ull << XF_WIRE_XFER_ID_BITS))
        f.xfer_id = id;
    *out = f;
    return PKV_OK;
}

/* ---- encode --------------------------------------------------------------------------- */
size_t xf_wire_read_bytes(uint32_t n_runs)
{
    return XF_WIRE_HEADER_BYTES + READ_FIXED_BYTES + 8 * (size_t)n_runs;
}

int xf_wire_encode_read(const xf_wire_read_t *r, const uint32_t *blocks, uint32_t n, void *buf,
                        size_t cap, size_t *len)
{
    if (!r || (!blocks && n) || !buf || !len) return PKV_ERR_INVALID;
    uint32_t n_runs = xf_wire_count_runs(blocks, n);
    bool release = r->flags & XF_WIRE_READ_RELEASE;
    uint64_t lb;
    if (r->xfer_id == 0 || r->xfer_id >= (1ull << XF_WIRE_XFER_ID_BITS) ||
        (r->flags & ~READ_FLAGS) || r->budget_ns > XF_WIRE_MAX_BUDGET_NS ||
        n_runs > XF_WIRE_MAX_RUNS || (unsigned)r->geo.dtype > PKV_DTYPE_FP8 ||
        !read_heads_valid(r, release))
        return PKV_ERR_INVALID;
    if (release ? r->flags != XF_WIRE_READ_RELEASE || n || xf_wire_check_geometry(&r->geo, &lb) ||
                      r->chunk_bytes < XF_WIRE_MIN_CHUNK || r->chunk_bytes > XF_WIRE_MAX_CHUNK
                : n_runs < 1 || check_read_sizes(&r->geo, r->head_n, n, r->chunk_bytes))
        return PKV_ERR_INVALID;
    size_t need = xf_wire_read_bytes(n_runs);
    if (need > XF_WIRE_MAX_MSG) return PKV_ERR_INVALID;
    if (cap < need) return PKV_ERR_NOSPACE;
    wcur_t c = {buf, cap};
    put_header(&c, XF_WIRE_READ, (uint32_t)(need - XF_WIRE_HEADER_BYTES));
    put_u64(&c, r->xfer_id);
    put_u64(&c, r->request_id);
    put_bytes(&c, r->token, sizeof(r->token));
    put_bytes(&c, r->nonce, sizeof(r->nonce));
    put_bytes(&c, r->digest, sizeof(r->digest));
    put_u64(&c, r->budget_ns);
    put_u32(&c, r->geo.layers);
    put_u32(&c, r->geo.kv_heads);
    put_u32(&c, r->geo.head_dim);
    put_u32(&c, r->geo.block_tokens);
    put_u32(&c, dtype_to_wire(r->geo.dtype));
    put_u32(&c, r->chunk_bytes);
    put_u32(&c, r->flags);
    put_u32(&c, r->head_lo);
    put_u32(&c, r->head_n);
    put_u16(&c, r->reads_total);
    put_u16(&c, r->read_index);
    put_u32(&c, 0);
    put_u32(&c, n_runs);
    for (uint32_t i = 0; i < n;) {
        uint32_t j = i + 1;
        while (j < n && blocks[j - 1] != UINT32_MAX && blocks[j] == blocks[j - 1] + 1) j++;
        put_u32(&c, blocks[i]);
        put_u32(&c, j - i);
        i = j;
    }
    *len = need;
    return PKV_OK;
}

size_t xf_wire_data_bytes(uint32_t n_pieces, uint32_t n_macs)
{
    return XF_WIRE_HEADER_BYTES + DATA_BYTES +
           (n_pieces ? DATA_PIECES_HDR + 16 * (size_t)n_pieces : 0) +
           (n_macs ? DATA_PIECES_HDR + XF_WIRE_MAC_BYTES * (size_t)n_macs : 0);
}

int xf_wire_encode_data(const xf_wire_data_t *d, const uint64_t *pieces, uint32_t n_pieces,
                        const uint8_t *macs, uint32_t n_macs, void *buf, size_t cap, size_t *len)
{
    static const uint8_t zero[XF_WIRE_MAC_BYTES];
    if (!d || !buf || !len) return PKV_ERR_INVALID;
    bool shared = d->flags & XF_WIRE_DATA_SHARED, layers = d->flags & XF_WIRE_DATA_LAYERS;
    if ((d->flags & ~(XF_WIRE_DATA_SHARED | XF_WIRE_DATA_LAYERS)) || d->xfer_id == 0 ||
        d->xfer_id >= (1ull << XF_WIRE_XFER_ID_BITS) || d->layer >= XF_WIRE_MAX_LAYERS ||
        d->bytes > XF_WIRE_MAX_BYTES || shared != (n_pieces > 0) || layers != (n_macs > 0) ||
        (layers && !shared) || (n_pieces && !pieces) || (n_macs && !macs) ||
        n_pieces > XF_WIRE_MAX_PIECES ||
        (layers && (memcmp(d->mac, zero, sizeof(zero)) || n_macs > XF_WIRE_MAX_LAYERS - d->layer)))
        return PKV_ERR_INVALID;
    uint64_t sum = 0;
    for (uint32_t i = 0; i < n_pieces; i++) {
        uint64_t off = pieces[2 * i], l = pieces[2 * i + 1];
        if (l < 1 || off >= XF_WIRE_MAX_ARENA || l > XF_WIRE_MAX_ARENA - off)
            return PKV_ERR_INVALID;
        sum += l;
    }
    if (shared && sum != d->bytes * (layers ? n_macs : 1)) return PKV_ERR_INVALID;
    size_t need = xf_wire_data_bytes(n_pieces, n_macs);
    if (need > XF_WIRE_MAX_MSG) return PKV_ERR_INVALID;
    if (cap < need) return PKV_ERR_NOSPACE;
    wcur_t c = {buf, cap};
    put_header(&c, XF_WIRE_DATA, (uint32_t)(need - XF_WIRE_HEADER_BYTES));
    put_u64(&c, d->xfer_id);
    put_u32(&c, d->layer);
    put_u32(&c, d->flags);
    put_u64(&c, d->bytes);
    put_bytes(&c, d->mac, sizeof(d->mac));
    if (n_pieces) {
        put_u32(&c, n_pieces);
        put_u32(&c, 0);
        for (uint32_t i = 0; i < 2 * n_pieces; i++) put_u64(&c, pieces[i]);
    }
    if (n_macs) {
        put_u32(&c, n_macs);
        put_u32(&c, 0);
        put_bytes(&c, macs, XF_WIRE_MAC_BYTES * (size_t)n_macs);
    }
    *len = need;
    return PKV_OK;
}

int xf_wire_encode_ack(const xf_wire_ack_t *a, void *buf, size_t cap, size_t *len)
{
    if (!a || !buf || !len) return PKV_ERR_INVALID;
    if (a->xfer_id == 0 || a->xfer_id >= (1ull << XF_WIRE_XFER_ID_BITS) ||
        a->bytes > XF_WIRE_MAX_BYTES)
        return PKV_ERR_INVALID;
    if (cap < XF_WIRE_HEADER_BYTES + ACK_BYTES) return PKV_ERR_NOSPACE;
    wcur_t c = {buf, cap};
    put_header(&c, XF_WIRE_ACK, ACK_BYTES);
    put_u64(&c, a->xfer_id);
    put_u64(&c, a->request_id);
    put_u64(&c, a->bytes);
    *len = XF_WIRE_HEADER_BYTES + ACK_BYTES;
    return PKV_OK;
}

int xf_wire_encode_fail(const xf_wire_fail_t *f, void *buf, size_t cap, size_t *len)
{
    if (!f || !buf || !len) return PKV_ERR_INVALID;
    size_t tl = strnlen(f->text, XF_WIRE_MAX_TEXT + 1);
    if (tl > XF_WIRE_MAX_TEXT || !printable(f->text, tl) ||
        f->xfer_id >= (1ull << XF_WIRE_XFER_ID_BITS) || !xf_wire_reason_valid(f->reason) ||
        f->why > XF_WIRE_WHY_MAX)
        return PKV_ERR_INVALID;
    size_t need = XF_WIRE_HEADER_BYTES + FAIL_FIXED_BYTES + tl;
    if (cap < need) return PKV_ERR_NOSPACE;
    wcur_t c = {buf, cap};
    put_header(&c, XF_WIRE_FAIL, (uint32_t)(FAIL_FIXED_BYTES + tl));
    put_u64(&c, f->xfer_id);
    put_u64(&c, f->request_id);
    put_u32(&c, (uint32_t)f->reason);
    put_u16(&c, (uint16_t)tl);
    put_u16(&c, f->why);
    put_bytes(&c, f->text, tl);
    *len = need;
    return PKV_OK;
}

int xf_wire_encode_heartbeat(const xf_wire_heartbeat_t *h, void *buf, size_t cap, size_t *len)
{
    if (!h || !buf || !len) return PKV_ERR_INVALID;
    if (cap < XF_WIRE_HEADER_BYTES + HB_BYTES) return PKV_ERR_NOSPACE;
    wcur_t c = {buf, cap};
    put_header(&c, XF_WIRE_HEARTBEAT, HB_BYTES);
    put_u64(&c, h->agent_id);
    put_u64(&c, h->seq);
    *len = XF_WIRE_HEADER_BYTES + HB_BYTES;
    return PKV_OK;
}

int xf_wire_encode_close(const xf_wire_close_t *cl, void *buf, size_t cap, size_t *len)
{
    if (!cl || !buf || !len || (cl->flags & ~XF_WIRE_CLOSE_REPLY)) return PKV_ERR_INVALID;
    if (cap < XF_WIRE_HEADER_BYTES + CLOSE_BYTES) return PKV_ERR_NOSPACE;
    wcur_t c = {buf, cap};
    put_header(&c, XF_WIRE_CLOSE, CLOSE_BYTES);
    put_u64(&c, cl->agent_id);
    put_u32(&c, cl->flags);
    put_u32(&c, 0);
    *len = XF_WIRE_HEADER_BYTES + CLOSE_BYTES;
    return PKV_OK;
}

int xf_wire_encode_hello(const xf_wire_hello_t *h, void *buf, size_t cap, size_t *len)
{
    if (!h || !buf || !len) return PKV_ERR_INVALID;
    const pkv_xfer_layout_t *l = &h->layout;
    size_t il = strnlen(h->identity, XF_WIRE_MAX_IDENTITY + 1);
    size_t ml = strnlen(l->model_id, sizeof(l->model_id));
    if (il > XF_WIRE_MAX_IDENTITY || !printable(h->identity, il) ||
        (unsigned)l->geo.dtype > PKV_DTYPE_FP8 || !xf_wire_layout_valid(l))
        return PKV_ERR_INVALID;
    size_t need = XF_WIRE_HEADER_BYTES + HELLO_FIXED_BYTES + il + ml;
    if (cap < need) return PKV_ERR_NOSPACE;
    wcur_t c = {buf, cap};
    put_header(&c, XF_WIRE_HELLO, (uint32_t)(HELLO_FIXED_BYTES + il + ml));
    put_u64(&c, h->agent_id);
    put_u16(&c, (uint16_t)il);
    put_u16(&c, (uint16_t)ml);
    put_u32(&c, 0);
    put_u32(&c, l->geo.layers);
    put_u32(&c, l->geo.kv_heads);
    put_u32(&c, l->geo.head_dim);
    put_u32(&c, l->geo.block_tokens);
    put_u32(&c, dtype_to_wire(l->geo.dtype));
    put_u32(&c, l->tp);
    put_u32(&c, l->rank);
    put_u32(&c, l->head_lo);
    put_u32(&c, l->head_n);
    put_u32(&c, l->wire);
    put_bytes(&c, h->identity, il);
    put_bytes(&c, l->model_id, ml);
    *len = need;
    return PKV_OK;
}

/* ---- handles (public) ----------------------------------------------------------------- */
/* An address is "host:port": host of [0-9A-Za-z.-] or a bracketed IPv6 literal. */
static bool addr_valid(const char *a, size_t n)
{
    if (n < 3 || n >= PKV_XFER_ADDR_MAX) return false;
    const char *colon = memrchr(a, ':', n);
    if (!colon || colon == a) return false;
    size_t hl = (size_t)(colon - a), pl = n - hl - 1;
    if (pl < 1 || pl > 5) return false;
    unsigned port = 0;
    for (size_t i = 0; i < pl; i++) {
        char ch = colon[1 + i];
        if (ch < '0' || ch > '9') return false;
        port = port * 10 + (unsigned)(ch - '0');
    }
    if (port < 1 || port > 65535) return false;
    if (a[0] == '[') {
        if (hl < 3 || a[hl - 1] != ']') return false;
        for (size_t i = 1; i + 1 < hl; i++) {
            char ch = a[i];
            if (!((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') ||
                  (ch >= 'A' && ch <= 'F') || ch == ':' || ch == '.'))
                return false;
        }
        return true;
    }
    for (size_t i = 0; i < hl; i++) {
        char ch = a[i];
        if (!((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
              ch == '.' || ch == '-'))
            return false;
    }
    return true;
}

bool xf_wire_addr_valid(const char *addr)
{
    return addr && addr_valid(addr, strnlen(addr, PKV_XFER_ADDR_MAX));
}

static bool local_valid(const pkv_xfer_handle_t *h)
{
    return h->local.pid >= 1 && h->local.pid < (1u << 30) && h->local.fd >= 0 &&
           h->local.arena_bytes >= 4096 && h->local.arena_bytes <= XF_WIRE_MAX_ARENA;
}

static size_t handle_bytes(const pkv_xfer_handle_t *h, size_t al)
{
    return HANDLE_FIXED_BYTES + (h->local.present ? HANDLE_LOCAL_BYTES : 0) + al +
           4 * (size_t)h->n_blocks;
}

static int handle_check(const pkv_xfer_handle_t *h, size_t *addr_len)
{
    uint64_t lb;
    size_t al = strnlen(h->addr, PKV_XFER_ADDR_MAX);
    if (al >= PKV_XFER_ADDR_MAX || !addr_valid(h->addr, al)) return PKV_ERR_INVALID;
    if (h->n_blocks < 1 || h->n_blocks > XF_WIRE_MAX_BLOCKS) return PKV_ERR_INVALID;
    if (xf_wire_check_geometry(&h->geo, &lb)) return PKV_ERR_INVALID;
    if (h->local.present && !local_valid(h)) return PKV_ERR_INVALID;
    *addr_len = al;
    return PKV_OK;
}

size_t pkv_xfer_handle_bytes(const pkv_xfer_handle_t *h)
{
    size_t al;
    if (!h || handle_check(h, &al)) return 0;
    return handle_bytes(h, al);
}

int pkv_xfer_handle_encode(const pkv_xfer_handle_t *h, void *buf, size_t cap, size_t *len)
{
    size_t al;
    if (!h || !buf || !len || handle_check(h, &al)) return PKV_ERR_INVALID;
    size_t need = handle_bytes(h, al);
    if (cap < need) return PKV_ERR_NOSPACE;
    wcur_t c = {buf, cap};
    put_u32(&c, HANDLE_MAGIC);
    put_u8(&c, HANDLE_VERSION);
    put_u8(&c, (uint8_t)al);
    put_u16(&c, h->local.present ? HANDLE_LOCAL : 0);
    put_u64(&c, h->request_id);
    put_bytes(&c, h->token, PKV_XFER_TOKEN_BYTES);
    put_u32(&c, h->geo.layers);
    put_u32(&c, h->geo.kv_heads);
    put_u32(&c, h->geo.head_dim);
    put_u32(&c, h->geo.block_tokens);
    put_u32(&c, dtype_to_wire(h->geo.dtype));
    put_u32(&c, h->n_blocks);
    if (h->local.present) {
        put_u32(&c, h->local.pid);
        put_u32(&c, (uint32_t)h->local.fd);
        put_u64(&c, h->local.arena_bytes);
        put_u64(&c, h->local.ino);
        put_bytes(&c, h->local.boot_id, sizeof(h->local.boot_id));
    }
    put_bytes(&c, h->addr, al);
    for (uint32_t i = 0; i < h->n_blocks; i++) put_u32(&c, h->blocks[i]);
    *len = need;
    return PKV_OK;
}

int pkv_xfer_handle_decode(const void *buf, size_t len, pkv_xfer_handle_t **out)
{
    if (!buf || !out) return PKV_ERR_INVALID;
    rcur_t c = {buf, len};
    uint32_t magic, dtype, n;
    uint8_t version, al;
    uint16_t flags;
    pkv_xfer_handle_t tmp;
    memset(&tmp, 0, sizeof(tmp));
    if (!get_u32(&c, &magic) || !get_u8(&c, &version) || !get_u8(&c, &al) || !get_u16(&c, &flags) ||
        !get_u64(&c, &tmp.request_id) || !get_bytes(&c, tmp.token, PKV_XFER_TOKEN_BYTES) ||
        !get_u32(&c, &tmp.geo.layers) || !get_u32(&c, &tmp.geo.kv_heads) ||
        !get_u32(&c, &tmp.geo.head_dim) || !get_u32(&c, &tmp.geo.block_tokens) ||
        !get_u32(&c, &dtype) || !get_u32(&c, &n))
        return PKV_ERR_PROTO;
    if (magic != HANDLE_MAGIC || version != HANDLE_VERSION || (flags & ~HANDLE_LOCAL))
        return PKV_ERR_PROTO;
    if (flags & HANDLE_LOCAL) {
        uint32_t fd;
        tmp.local.present = true;
        if (!get_u32(&c, &tmp.local.pid) || !get_u32(&c, &fd) ||
            !get_u64(&c, &tmp.local.arena_bytes) || !get_u64(&c, &tmp.local.ino) ||
            !get_bytes(&c, tmp.local.boot_id, sizeof(tmp.local.boot_id)))
            return PKV_ERR_PROTO;
        tmp.local.fd = (int32_t)fd;
        if (!local_valid(&tmp)) return PKV_ERR_PROTO;
    }
    if (al >= PKV_XFER_ADDR_MAX || dtype_from_wire(dtype, &tmp.geo.dtype)) return PKV_ERR_PROTO;
    if (n < 1 || n > XF_WIRE_MAX_BLOCKS) return PKV_ERR_PROTO;
    if (c.left != al + 4 * (size_t)n) return PKV_ERR_PROTO;
    tmp.n_blocks = n;
    uint64_t lb;
    if (xf_wire_check_geometry(&tmp.geo, &lb)) return PKV_ERR_PROTO;
    get_bytes(&c, tmp.addr, al);
    tmp.addr[al] = '\0';
    if (!addr_valid(tmp.addr, al)) return PKV_ERR_PROTO;
    pkv_xfer_handle_t *h = malloc(sizeof(*h) + 4 * (size_t)n);
    if (!h) return PKV_ERR_NOMEM;
    *h = tmp;
    for (uint32_t i = 0; i < n; i++) get_u32(&c, &h->blocks[i]);
    *out = h;
    return PKV_OK;
}

void pkv_xfer_handle_free(pkv_xfer_handle_t *h)
{
    free(h);
}
