/*
 * xfer views: how a transfer's bytes are laid out in the stream, in staging and in the
 * pool, and the copy plans between them.
 *
 * Stream order (identical on both sides): layer-major; within a layer K then V, within
 * each the view's heads [head_lo, head_lo + head_n) in order, within each head that
 * head's piece (block_tokens x head_dim values) of every block in plan order. A layer is
 * n_blocks * layer_bytes long, layer_bytes = 2 * head_n * piece: a head slice's bytes
 * only. The pieces come from (and go to) the agent's pool rank by global head id
 * (pkv_kv_block_head_rank), so the producer's staging copy gathers a slice out of its
 * rank's pieces and the consumer's scatters it into its own, with no extra pass. A layer is
 * n_blocks * layer_bytes long and is cut into chunks of chunk_bytes (the last shorter);
 * chunk c of the transfer is chunk (c % chunks_per_layer) of layer (c / chunks_per_layer).
 * A whole-stream view (small transfers, READ flag WHOLE) cuts the stream itself into
 * chunks, across layers; its layers become storable together, when every chunk is in.
 * Its payload messages carry a trailer after the stream's last byte: every layer's
 * 16-byte MAC, so no DATA message is needed (the trailer lives in the owner's layer_mac,
 * not in staging).
 *
 * MACs (xfer/mac.h) are computed in the copies (xf_mac_copy, xf_mac_copy_in), in steps of
 * XF_MAC_STEP bytes so the bytes are still in the L1 cache when the MAC reads them: the
 * producer MACs what it read from its pool right after copying it; the consumer MACs its
 * staging right after copying each step out (nothing writes its staging once the receives
 * completed), and copies from a producer's shared arena (which other processes can map)
 * through an L1 bounce buffer: the bytes it MACs are exactly the bytes it stores.
 *
 * Staging is the grant's runs walked in order; a stream range may cross runs, so copies
 * and payload buffers are split (payload buffers become a UCX iov).
 *
 * Copy plans coalesce: consecutive plan blocks whose layer slices are adjacent in the
 * pool (that is, adjacent blocks when the pool has one layer) and adjacent in staging
 * are copied as one segment.
 */
#include "xfer/xfer_int.h"

#include "xfer/sum.h"

#include <stdlib.h>
#include <string.h>

int xf_view_init(xf_view_t *v, pkv_xfer_agent_t *a, uint32_t n_blocks, const uint32_t *blocks,
                 uint32_t chunk_bytes, bool whole, uint32_t head_lo, uint32_t head_n)
{
    memset(v, 0, sizeof(*v));
    if (!n_blocks || n_blocks > XF_WIRE_MAX_BLOCKS || !head_n ||
        (uint64_t)head_lo + head_n > a->geo.kv_heads)
        return PKV_ERR_INVALID;
    uint64_t lb = xf_wire_slice_bytes(&a->geo, head_n);
    uint64_t layer_total = lb * n_blocks; /* lb < 2^47 / layers, n < 2^20: checked below */
    if (layer_total / n_blocks != lb || layer_total > XF_WIRE_MAX_BYTES / a->geo.layers)
        return PKV_ERR_NOFIT;
    uint64_t total = layer_total * a->geo.layers;
    uint64_t cpl = PKV_DIV_UP(layer_total, chunk_bytes);
    uint32_t trailer = whole ? XF_MAC_TAG_BYTES * a->geo.layers : 0;
    uint64_t n_chunks = whole ? PKV_DIV_UP(total + trailer, chunk_bytes) : cpl * a->geo.layers;
    uint64_t pages = PKV_DIV_UP(total, a->page_bytes);
    if (cpl * a->geo.layers >= (1ull << XF_WIRE_CHUNK_BITS) ||
        n_chunks >= (1ull << XF_WIRE_CHUNK_BITS) || pages > UINT32_MAX)
        return PKV_ERR_NOFIT;
    v->blocks = malloc(sizeof(uint32_t) * n_blocks);
    if (!v->blocks) return PKV_ERR_NOMEM;
    memcpy(v->blocks, blocks, sizeof(uint32_t) * n_blocks);
    v->n_blocks = n_blocks;
    v->layers = a->geo.layers;
    v->head_lo = head_lo;
    v->head_n = head_n;
    v->rank = a->rank;
    v->layer_bytes = lb;
    v->layer_total = layer_total;
    v->chunk_bytes = chunk_bytes;
    v->whole = whole;
    v->trailer_bytes = trailer;
    v->stage_nt = v->layer_total >= PKV_XFER_STAGE_NT_BYTES;
    v->chunks_per_layer = whole ? 1 : (uint32_t)cpl;
    v->n_chunks = (uint32_t)n_chunks;
    v->pages = (uint32_t)pages;
    atomic_init(&v->abort, false);
    return PKV_OK;
}

void xf_view_fini(xf_view_t *v)
{
    free(v->blocks);
    free(v->run_off);
    free(v->keys);
    pkv_stage_grant_free(v->grant);
    v->keys = NULL;
    v->blocks = NULL;
    v->run_off = NULL;
    v->grant = NULL;
}

int xf_view_set_grant(xf_view_t *v, pkv_stage_grant_t *g)
{
    uint64_t *off = malloc(sizeof(uint64_t) * ((size_t)g->nruns + 1));
    if (!off) return PKV_ERR_NOMEM;
    off[0] = 0;
    for (uint32_t r = 0; r < g->nruns; r++)
        off[r + 1] = off[r] + (uint64_t)g->runs[r].count * g->page_bytes;
    if (off[g->nruns] < v->layer_total * v->layers) {
        free(off);
        return PKV_ERR_NOFIT; /* the stage gave fewer pages than asked: a stage bug */
    }
    v->grant = g;
    v->run_off = off;
    return PKV_OK;
}

/* The staging run that holds stream offset `off` (run r covers [run_off[r], run_off[r+1])). */
static uint32_t run_of(const xf_view_t *v, uint64_t off)
{
    uint32_t lo = 0, hi = v->grant->nruns;
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (v->run_off[mid] <= off)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* Address of stream offset `off` in staging and the contiguous bytes from there. */
static uint8_t *stage_at(const xf_view_t *v, uint64_t off, uint64_t *contig)
{
    uint32_t lo = run_of(v, off);
    *contig = v->run_off[lo + 1] - off;
    return (uint8_t *)v->grant->runs[lo].addr + (off - v->run_off[lo]);
}

void xf_chunk_span(const xf_view_t *v, uint32_t c, uint64_t *off, uint64_t *len)
{
    if (v->whole) {
        *off = (uint64_t)c * v->chunk_bytes;
        *len =
            PKV_MIN((uint64_t)v->chunk_bytes, v->layer_total * v->layers + v->trailer_bytes - *off);
        return;
    }
    uint32_t l = c / v->chunks_per_layer, j = c % v->chunks_per_layer;
    uint64_t in_layer = (uint64_t)j * v->chunk_bytes;
    *off = (uint64_t)l * v->layer_total + in_layer;
    *len = PKV_MIN((uint64_t)v->chunk_bytes, v->layer_total - in_layer);
}

/* The pieces of stream range [off, off + len): staging, then the trailer past the stream's
 * end. With out == NULL only counts them. */
static uint32_t chunk_pieces(const xf_view_t *v, uint64_t off, uint64_t len, ucp_dt_iov_t *out)
{
    uint64_t stream = v->layer_total * v->layers, contig;
    uint32_t n = 0;
    for (; len && off < stream; n++) {
        uint8_t *q = stage_at(v, off, &contig);
        uint64_t k = PKV_MIN(PKV_MIN(contig, len), stream - off);
        if (out) out[n] = (ucp_dt_iov_t){.buffer = q, .length = k};
        off += k;
        len -= k;
    }
    if (len) { /* off >= stream and the range ends inside the trailer (xf_chunk_span) */
        PKV_ASSERT(v->trailer && off + len <= stream + v->trailer_bytes);
        if (out)
            out[n] =
                (ucp_dt_iov_t){.buffer = (uint8_t *)v->trailer + (off - stream), .length = len};
        n++;
    }
    return n;
}

int xf_chunk_buffer(const xf_view_t *v, xf_chunk_t *ch, uint64_t off, uint64_t len, void **buf,
                    size_t *count, ucp_datatype_t *dt)
{
    ucp_dt_iov_t one;
    uint32_t n = chunk_pieces(v, off, len, NULL);
    if (n == 1) {
        chunk_pieces(v, off, len, &one);
        *buf = one.buffer;
        *count = one.length;
        *dt = ucp_dt_make_contig(1);
        return PKV_OK;
    }
    free(ch->iov);
    ch->iov = calloc(n, sizeof(ucp_dt_iov_t));
    if (!ch->iov) return PKV_ERR_NOMEM;
    ch->iovcnt = n;
    chunk_pieces(v, off, len, ch->iov);
    *buf = ch->iov;
    *count = n;
    *dt = ucp_dt_make_iov();
    return PKV_OK;
}

/* Copy pool <-> staging for stream range [off, off+len) starting at pool address `pool`,
 * MACing the bytes in stream order (stores around the cache: pool copies, v->stage_nt).
 * Either way the MAC reads the source right after the copy did: our staging once the
 * receives completed (nothing writes it then), or our pool. */
static void seg_copy(const xf_view_t *v, uint64_t off, uint8_t *pool, uint64_t len, bool to_stage,
                     xf_mac_t *m)
{
    while (len) {
        uint64_t contig;
        uint8_t *st = stage_at(v, off, &contig);
        uint64_t k = PKV_MIN(contig, len);
        if (to_stage)
            xf_mac_copy(m, st, pool, k, v->stage_nt);
        else
            xf_mac_copy(m, pool, st, k, true);
        off += k;
        pool += k;
        len -= k;
    }
}

/* Blocks [i, j) whose (layer l, which, head h) pieces are adjacent in the rank's range,
 * from i. h is global: every view's heads are held by its rank (checked when the read or
 * the serve was admitted). */
static uint32_t coalesce(const xf_view_t *v, pkv_xfer_agent_t *a, uint32_t l, uint32_t which,
                         uint32_t h, uint32_t i, uint64_t piece, uint8_t **start)
{
    *start = pkv_kv_block_head_rank(a->kv, v->rank, v->blocks[i], l, which, h);
    PKV_ASSERT(*start);
    uint32_t j = i + 1;
    while (j < v->n_blocks &&
           (uint8_t *)pkv_kv_block_head_rank(a->kv, v->rank, v->blocks[j], l, which, h) ==
               *start + (uint64_t)(j - i) * piece)
        j++;
    return j;
}

/* Copy one layer between the pool and staging following the coalesced plan. The layer's
 * stream: for K then V, for each KV head, that head's piece of every block in plan order.
 * *tag: the layer's MAC over the stream bytes. Streaming stores: the caller fences
 * (pkv_xfer_sum_fence) before it tells anyone the bytes are there, once for every layer
 * it copied in a row (64 KiB reads of 32 layers: +18 % over a fence per layer). */
bool xf_view_copy_layer(const xf_view_t *v, pkv_xfer_agent_t *a, xf_mac_t *m, uint32_t l,
                        bool to_stage, uint8_t tag[XF_MAC_TAG_BYTES])
{
    xf_mac_begin(m, v->keys + (size_t)XF_MAC_KEY_BYTES * l);
    uint64_t piece = v->layer_bytes / (2 * (uint64_t)v->head_n);
    uint64_t off = (uint64_t)l * v->layer_total;
    for (uint32_t which = 0; which < 2; which++)
        for (uint32_t h = v->head_lo; h < v->head_lo + v->head_n; h++)
            for (uint32_t i = 0, j; i < v->n_blocks; i = j) {
                uint8_t *start;
                j = coalesce(v, a, l, which, h, i, piece, &start);
                seg_copy(v, off, start, (uint64_t)(j - i) * piece, to_stage, m);
                off += (uint64_t)(j - i) * piece;
            }
    return xf_mac_end(m, tag);
}

/* Flip one staged byte of layer l (fault injection). */
void xf_view_corrupt(const xf_view_t *v, uint32_t l)
{
    uint64_t contig;
    uint8_t *p = stage_at(v, (uint64_t)l * v->layer_total + v->layer_total / 2, &contig);
    *p ^= 0x5a;
}

void xf_view_mac_staged(const xf_view_t *v, xf_mac_t *m, const uint8_t *keys, uint32_t l,
                        uint8_t tag[XF_MAC_TAG_BYTES])
{
    xf_mac_begin(m, keys + (size_t)XF_MAC_KEY_BYTES * l);
    for (uint64_t off = (uint64_t)l * v->layer_total, left = v->layer_total; left;) {
        uint64_t contig;
        const uint8_t *st = stage_at(v, off, &contig);
        uint64_t k = PKV_MIN(contig, left);
        xf_mac_update(m, st, k);
        off += k;
        left -= k;
    }
    xf_mac_end(m, tag);
}

uint32_t xf_view_arena_pieces(const xf_view_t *v, uint64_t off, uint64_t len, uint64_t *out,
                              uint32_t cap)
{
    uint32_t n = 0;
    while (len) {
        uint32_t lo = run_of(v, off);
        uint64_t k = PKV_MIN(v->run_off[lo + 1] - off, len);
        uint64_t at = v->grant->runs[lo].offset + (off - v->run_off[lo]);
        if (n && out[2 * (n - 1)] + out[2 * (n - 1) + 1] == at) {
            out[2 * (n - 1) + 1] += k; /* adjacent runs in the arena: one piece */
        } else {
            if (n == cap) return 0;
            out[2 * n] = at;
            out[2 * n + 1] = k;
            n++;
        }
        off += k;
        len -= k;
    }
    return n;
}

bool xf_view_copy_layer_from(const xf_view_t *v, pkv_xfer_agent_t *a, xf_mac_t *m, uint32_t l,
                             const uint8_t *arena, const uint64_t *pieces, uint32_t n,
                             uint64_t skip, uint8_t tag[XF_MAC_TAG_BYTES])
{
    xf_mac_begin(m, v->keys + (size_t)XF_MAC_KEY_BYTES * l);
    uint64_t piece = v->layer_bytes / (2 * (uint64_t)v->head_n);
    uint32_t p = 0;     /* current piece */
    uint64_t in = 0;    /* bytes of it already consumed */
    for (; skip; p++) { /* the pieces of the layers before this one */
        PKV_ASSERT(p < n);
        if (pieces[2 * p + 1] > skip) {
            in = skip;
            break;
        }
        skip -= pieces[2 * p + 1];
    }
    for (uint32_t which = 0; which < 2; which++)
        for (uint32_t h = v->head_lo; h < v->head_lo + v->head_n; h++)
            for (uint32_t i = 0, j; i < v->n_blocks; i = j) {
                uint8_t *dst;
                j = coalesce(v, a, l, which, h, i, piece, &dst);
                uint64_t len = (uint64_t)(j - i) * piece;
                while (len) {
                    PKV_ASSERT(p < n); /* the pieces were checked to cover the layer */
                    uint64_t k = PKV_MIN(pieces[2 * p + 1] - in, len);
                    /* what is MACed is what is stored, whatever the arena's owner does */
                    xf_mac_copy_in(m, dst, arena + pieces[2 * p] + in, k);
                    dst += k;
                    len -= k;
                    in += k;
                    if (in == pieces[2 * p + 1]) p++, in = 0;
                }
            }
    return xf_mac_end(m, tag);
}
