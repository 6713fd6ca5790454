/*
 * llama2.c's tokenizer.bin: loader and the sentencepiece-like encode.
 *
 * File layout (little-endian, as llama2.c's export writes it on x86/arm):
 *   int32 max_token_length
 *   vocab_size times: f32 score, int32 len, len bytes of the piece (no NUL)
 * vocab_size is not in the file; it comes from the checkpoint header. Every field is
 * validated against the file size before it is read; the file must end exactly after
 * the last piece (trailing bytes mean the vocab size is wrong).
 *
 * Encode follows llama2.c's encode(): a dummy-prefix " " token when the text is not
 * empty; each UTF-8 code point (a lead byte plus up to three continuation bytes, not
 * validated) becomes its piece, or its <0xXX> byte pieces when absent; then the
 * adjacent pair whose concatenation is a piece with the highest score (leftmost on
 * ties, and only scores above -1e10) is merged, until none is left. llama2.c rescans
 * the whole list per merge (O(n^2)); here a max-heap keyed by (score, position) with
 * lazy validation gives the same merges in O(n log n).
 *
 * Deliberate differences, for exact round trips and unforgeable specials: the pieces
 * of ids 0..2 (<unk>, <s>, </s>) and the <0xXX> byte pieces never match text; when a
 * piece string occurs twice the lowest id wins (llama2.c's bsearch picks either);
 * a byte with no <0xXX> piece encodes as <unk> (llama2.c would emit byte + 3).
 */
#include "tokenizer/tokenizer_int.h"

#include "core/core.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LLAMA2C_MAX_VOCAB (1 << 22)
#define LLAMA2C_MAX_PIECE 4096
#define LLAMA2C_MAX_FILE  ((size_t)1 << 30)
#define LLAMA2C_NO_MERGE  (-1e10f)

static uint64_t str_hash2(const uint8_t *a, size_t al, const uint8_t *b, size_t bl)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < al; i++) h = (h ^ a[i]) * 0x100000001b3ull;
    for (size_t i = 0; i < bl; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return pkv_tokenizer_mix64(h);
}

/* The id of the matchable piece equal to a||b, or -1. */
static int32_t str_lookup2(const struct pkv_tok *t, const uint8_t *a, size_t al, const uint8_t *b,
                           size_t bl)
{
    uint32_t h = (uint32_t)str_hash2(a, al, b, bl) & t->str_mask;
    for (;;) {
        int32_t slot = t->str_slots[h];
        if (slot == 0) return -1;
        int32_t id = slot - 1;
        const uint8_t *p = (const uint8_t *)t->arena + t->piece_off[id];
        if (t->piece_len[id] == al + bl && !memcmp(p, a, al) && (bl == 0 || !memcmp(p + al, b, bl)))
            return id;
        h = (h + 1) & t->str_mask;
    }
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* "<0xAB>" -> 0xAB, else -1 (llama2.c's "<0x%02hhX>"). */
static int byte_piece_value(const char *p, size_t l)
{
    if (l != 6 || p[0] != '<' || p[1] != '0' || p[2] != 'x' || p[5] != '>') return -1;
    int hi = hexval(p[3]), lo = hexval(p[4]);
    if (hi < 0 || lo < 0) return -1;
    return hi * 16 + lo;
}

static int32_t rd_i32(const uint8_t *p)
{
    uint32_t v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    int32_t r;
    memcpy(&r, &v, sizeof(r));
    return r;
}
static float rd_f32(const uint8_t *p)
{
    uint32_t v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &v, sizeof(f));
    return f;
}

/* Pass 1: the header and every entry validated against the file size; the file ends
 * exactly after the last piece. PKV_OK and *max_len, or an error (logged). */
static int llama2c_check(const uint8_t *d, size_t len, int32_t vocab_size, int32_t *max_len)
{
    if (vocab_size < 3 || vocab_size > LLAMA2C_MAX_VOCAB) {
        PKV_LOGE(TOK_LOG, "llama2c tokenizer: vocab size %d outside [3, %d]", (int)vocab_size,
                 LLAMA2C_MAX_VOCAB);
        return PKV_ERR_INVALID;
    }
    if (len < 4) {
        PKV_LOGE(TOK_LOG, "llama2c tokenizer: %zu bytes, too short for the header", len);
        return PKV_ERR_CORRUPT;
    }
    int32_t ml = rd_i32(d);
    if (ml <= 0 || ml > LLAMA2C_MAX_PIECE) {
        PKV_LOGE(TOK_LOG, "llama2c tokenizer: max_token_length %d outside [1, %d]", (int)ml,
                 LLAMA2C_MAX_PIECE);
        return PKV_ERR_CORRUPT;
    }
    size_t off = 4;
    for (int32_t i = 0; i < vocab_size; i++) {
        if (len - off < 8) {
            PKV_LOGE(TOK_LOG,
                     "llama2c tokenizer: truncated at token %d of %d (offset %zu of %zu bytes)",
                     (int)i, (int)vocab_size, off, len);
            return PKV_ERR_CORRUPT;
        }
        float score = rd_f32(d + off);
        int32_t l = rd_i32(d + off + 4);
        if (!isfinite(score)) {
            PKV_LOGE(TOK_LOG, "llama2c tokenizer: token %d has a non-finite score (offset %zu)",
                     (int)i, off);
            return PKV_ERR_CORRUPT;
        }
        if (l < 0 || l > ml) {
            PKV_LOGE(TOK_LOG,
                     "llama2c tokenizer: token %d has length %d outside [0, max_token_length %d] "
                     "(offset %zu)",
                     (int)i, (int)l, (int)ml, off + 4);
            return PKV_ERR_CORRUPT;
        }
        off += 8;
        if (len - off < (size_t)l) {
            PKV_LOGE(TOK_LOG,
                     "llama2c tokenizer: truncated inside token %d of %d (needs %d bytes at "
                     "offset %zu of %zu)",
                     (int)i, (int)vocab_size, (int)l, off, len);
            return PKV_ERR_CORRUPT;
        }
        off += (size_t)l;
    }
    if (off != len) {
        PKV_LOGE(TOK_LOG,
                 "llama2c tokenizer: %zu trailing bytes after %d tokens (wrong vocab size?)",
                 len - off, (int)vocab_size);
        return PKV_ERR_CORRUPT;
    }
    *max_len = ml;
    return PKV_OK;
}

/* Every piece and score from the checked file into the arena; returns the arena bytes
 * used. */
static size_t llama2c_copy_pieces(struct pkv_tok *t, const uint8_t *d, int32_t vocab_size)
{
    size_t aoff = 0, off = 4;
    for (int32_t i = 0; i < vocab_size; i++) {
        t->scores[i] = rd_f32(d + off);
        uint32_t l = (uint32_t)rd_i32(d + off + 4);
        off += 8;
        memcpy(t->arena + aoff, d + off, l);
        off += l;
        t->piece_off[i] = t->dec_off[i] = (uint32_t)aoff;
        t->piece_len[i] = t->dec_len[i] = l;
        aoff += l;
    }
    return aoff;
}

/* Piece i into the string table, unless an equal piece with a lower id is there. */
static void llama2c_index_piece(struct pkv_tok *t, int32_t i)
{
    const char *p = t->arena + t->piece_off[i];
    uint32_t h = (uint32_t)str_hash2((const uint8_t *)p, t->piece_len[i], NULL, 0) & t->str_mask;
    while (t->str_slots[h] != 0) {
        int32_t o = t->str_slots[h] - 1;
        if (t->piece_len[o] == t->piece_len[i] &&
            !memcmp(t->arena + t->piece_off[o], p, t->piece_len[i]))
            return;
        h = (h + 1) & t->str_mask;
    }
    t->str_slots[h] = i + 1;
}

/* Ids 0..2 are specials (decode to nothing); a <0xXX> piece decodes to its byte (stored
 * after the pieces, from aoff) and is never matched; every other non-empty piece goes
 * into the string table. Returns the arena bytes used. */
static size_t llama2c_index_pieces(struct pkv_tok *t, int32_t vocab_size, size_t aoff)
{
    for (int32_t i = 0; i < 3; i++) {
        t->special[i] = 1;
        t->dec_len[i] = 0;
    }
    for (int32_t i = 3; i < vocab_size; i++) {
        int bv = byte_piece_value(t->arena + t->piece_off[i], t->piece_len[i]);
        if (bv >= 0) {
            if (t->byte_id[bv] < 0) t->byte_id[bv] = i;
            t->arena[aoff] = (char)bv;
            t->dec_off[i] = (uint32_t)aoff++;
            t->dec_len[i] = 1;
            continue;
        }
        if (t->piece_len[i] != 0) llama2c_index_piece(t, i);
    }
    return aoff;
}

int pkv_tok_load_llama2c_mem(const void *data, size_t len, int32_t vocab_size, pkv_tok_t **out)
{
    const uint8_t *d = data;
    if ((!d && len) || !out) return PKV_ERR_INVALID;
    int32_t max_len;
    int rc = llama2c_check(d, len, vocab_size, &max_len);
    if (rc) return rc;

    /* pass 2: build the tables. Arena: every piece, plus one byte per byte piece. */
    struct pkv_tok *t = calloc(1, sizeof(*t));
    if (!t) return PKV_ERR_NOMEM;
    rc = tok_alloc_tables(t, vocab_size, len + 256);
    if (rc) goto fail;
    t->kind = PKV_TOK_KIND_LLAMA2C;
    t->bos = 1;
    t->eos = 2;
    t->max_token_length = (uint32_t)max_len;
    t->scores = malloc(sizeof(float) * (size_t)vocab_size);
    uint32_t cap = 1;
    while (cap < (uint32_t)vocab_size * 2) cap <<= 1;
    t->str_slots = calloc(cap, sizeof(int32_t));
    if (!t->scores || !t->str_slots) {
        rc = PKV_ERR_NOMEM;
        goto fail;
    }
    t->str_mask = cap - 1;
    t->space_id = -1;
    size_t aoff = llama2c_copy_pieces(t, d, vocab_size);
    aoff = llama2c_index_pieces(t, vocab_size, aoff);
    PKV_ASSERT(aoff <= len + 256);
    t->space_id = str_lookup2(t, (const uint8_t *)" ", 1, NULL, 0);
    *out = t;
    return PKV_OK;

fail:
    pkv_tok_destroy(t);
    return rc;
}

int pkv_tok_load_llama2c(const char *path, int32_t vocab_size, pkv_tok_t **out)
{
    if (!path || !out) return PKV_ERR_INVALID;
    FILE *f = fopen(path, "rb");
    if (!f) {
        PKV_LOGE(TOK_LOG, "llama2c tokenizer: cannot open %s: %s", path, strerror(errno));
        return PKV_ERR_IO;
    }
    int rc = PKV_OK;
    uint8_t *buf = NULL;
    long size = -1;
    if (fseek(f, 0, SEEK_END) == 0) size = ftell(f);
    if (size < 0 || fseek(f, 0, SEEK_SET) != 0) {
        PKV_LOGE(TOK_LOG, "llama2c tokenizer: cannot size %s: %s", path, strerror(errno));
        rc = PKV_ERR_IO;
        goto done;
    }
    if ((size_t)size > LLAMA2C_MAX_FILE) {
        PKV_LOGE(TOK_LOG, "llama2c tokenizer: %s is %ld bytes, over the %zu limit", path, size,
                 LLAMA2C_MAX_FILE);
        rc = PKV_ERR_CORRUPT;
        goto done;
    }
    buf = malloc((size_t)size ? (size_t)size : 1);
    if (!buf) {
        rc = PKV_ERR_NOMEM;
        goto done;
    }
    if (fread(buf, 1, (size_t)size, f) != (size_t)size) {
        PKV_LOGE(TOK_LOG, "llama2c tokenizer: short read of %s", path);
        rc = PKV_ERR_IO;
        goto done;
    }
    rc = pkv_tok_load_llama2c_mem(buf, (size_t)size, vocab_size, out);
    if (rc && rc != PKV_ERR_NOMEM)
        PKV_LOGE(TOK_LOG, "llama2c tokenizer: %s rejected (%s)", path, pkv_status_str(rc));
done:
    free(buf);
    fclose(f);
    return rc;
}

/* ---- encode ------------------------------------------------------------------------- */
/* Nodes of the symbol list: the byte range [start, start + len) of the text (the
 * dummy prefix is node 0 with its own bytes), the current id, and links. Node order
 * is text order, so the node index is the position used for leftmost tie-breaks. */
struct l2_node {
    int32_t id;
    int32_t prev, next;
    uint32_t len;
    const uint8_t *bytes;
    bool fallback; /* a byte piece or <unk> standing for raw bytes: never merges */
};

struct l2_heap_entry {
    uint64_t key; /* (~ordered(score) << 32) | node: min-heap = highest score, leftmost */
    int32_t id;   /* the merged id when pushed */
};

static uint32_t score_order(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* ascending with f */
}

static void l2_push(struct l2_heap_entry *h, size_t *n, struct l2_heap_entry e)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p].key <= e.key) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = e;
}

static struct l2_heap_entry l2_pop(struct l2_heap_entry *h, size_t *n)
{
    struct l2_heap_entry top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && h[c + 1].key < h[c].key) c++;
        if (h[c].key >= last.key) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = last;
    return top;
}

/* The merge candidate for node i and its successor, pushed when it is a piece. The
 * merged bytes are contiguous in the text, except for the dummy prefix node 0. */
static void l2_candidate(const struct pkv_tok *t, struct l2_node *nodes, int32_t i,
                         struct l2_heap_entry *h, size_t *hn)
{
    int32_t j = nodes[i].next;
    if (j < 0 || nodes[i].fallback || nodes[j].fallback) return;
    int32_t id = str_lookup2(t, nodes[i].bytes, nodes[i].len, nodes[j].bytes, nodes[j].len);
    if (id < 0 || !(t->scores[id] > LLAMA2C_NO_MERGE)) return;
    struct l2_heap_entry e = {((uint64_t)~score_order(t->scores[id]) << 32) | (uint32_t)i, id};
    l2_push(h, hn, e);
}

int tok_llama2c_encode(const struct pkv_tok *t, const uint8_t *s, size_t len, int32_t *out,
                       size_t cap, size_t *n)
{
    if (len == 0) return PKV_OK;
    if (len >= INT32_MAX / 4) return PKV_ERR_NOFIT;
    size_t max_nodes = len + 1;
    struct l2_node *nodes = malloc(sizeof(*nodes) * max_nodes);
    /* initial pairs < nodes, each merge pushes <= 2 */
    struct l2_heap_entry *heap = malloc(sizeof(*heap) * max_nodes * 3);
    /* merged pieces span several nodes' bytes; the dummy prefix breaks contiguity,
     * so node 0's merged bytes live in a side buffer (bounded by max_token_length) */
    uint8_t *head = malloc(t->max_token_length + 1);
    int rc = PKV_OK;
    if (!nodes || !heap || !head) {
        rc = PKV_ERR_NOMEM;
        goto done;
    }
    size_t nn = 0;
    static const uint8_t space = ' ';
    if (t->space_id >= 0) {
        nodes[nn++] = (struct l2_node){t->space_id, -1, -1, 1, &space, false};
    }
    for (size_t i = 0; i < len;) {
        size_t k = 1;
        while (i + k < len && k < 4 && (s[i + k] & 0xC0) == 0x80) k++;
        int32_t id = str_lookup2(t, s + i, k, NULL, 0);
        if (id >= 0) {
            nodes[nn++] = (struct l2_node){id, -1, -1, (uint32_t)k, s + i, false};
        } else {
            for (size_t b = 0; b < k; b++) {
                int32_t bid = t->byte_id[s[i + b]];
                /* no byte piece: <unk> (breaks the round trip; documented) */
                nodes[nn++] = (struct l2_node){bid >= 0 ? bid : 0, -1, -1, 1, s + i + b, true};
            }
        }
        i += k;
    }
    for (size_t i = 0; i < nn; i++) {
        nodes[i].prev = (int32_t)i - 1;
        nodes[i].next = i + 1 < nn ? (int32_t)i + 1 : -1;
    }
    size_t hn = 0;
    for (size_t i = 0; i + 1 < nn; i++) l2_candidate(t, nodes, (int32_t)i, heap, &hn);
    while (hn) {
        struct l2_heap_entry e = l2_pop(heap, &hn);
        int32_t i = (int32_t)(uint32_t)e.key;
        int32_t j = nodes[i].next;
        if (nodes[i].id < 0 || j < 0) continue;
        int32_t id = str_lookup2(t, nodes[i].bytes, nodes[i].len, nodes[j].bytes, nodes[j].len);
        if (id != e.id) continue; /* stale */
        uint32_t ml = nodes[i].len + nodes[j].len;
        if (nodes[i].bytes + nodes[i].len != nodes[j].bytes) {
            /* only the dummy-prefix node is not contiguous with its successor */
            PKV_ASSERT(ml <= t->max_token_length);
            memmove(head, nodes[i].bytes, nodes[i].len);
            memcpy(head + nodes[i].len, nodes[j].bytes, nodes[j].len);
            nodes[i].bytes = head;
        }
        nodes[i].id = id;
        nodes[i].len = ml;
        nodes[j].id = -1;
        int32_t k = nodes[j].next;
        nodes[i].next = k;
        if (k >= 0) nodes[k].prev = i;
        if (nodes[i].prev >= 0) l2_candidate(t, nodes, nodes[i].prev, heap, &hn);
        l2_candidate(t, nodes, i, heap, &hn);
    }
    for (int32_t i = nn ? 0 : -1; i >= 0; i = nodes[i].next) {
        if (*n >= cap) {
            rc = PKV_ERR_NOSPACE;
            goto done;
        }
        out[(*n)++] = nodes[i].id;
    }
done:
    free(head);
    free(heap);
    free(nodes);
    return rc;
}
