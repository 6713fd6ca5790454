/*
 * The builtin byte-level BPE: pre-tokenizer, table construction, and encode.
 *
 * Encode is the standard merge-rank BPE. Text is first cut into pieces (GPT-2 style,
 * pkv_tokenizer_piece_len) so merges stay local to a word; within a piece every byte
 * starts as its own symbol in a doubly linked list, and a min-heap keyed by
 * (merge rank, position) yields the next merge: the lowest-rank adjacent pair,
 * leftmost on ties. Entries are validated lazily when popped (the pair at that
 * position must still have that rank), so a piece of m bytes costs O(m log m).
 * The merged id of a pair is unique, so one hash lookup both validates and merges.
 *
 * Round trip: ids 0..255 are the bytes and every merge is the concatenation of its
 * pair, so the pieces of any encoding concatenate back to the input; specials sit
 * above the merges and no pair ever maps to them (unforgeable).
 */
#include "tokenizer/tokenizer_int.h"

#include "core/core.h"

#include <stdlib.h>
#include <string.h>

/* ---- pre-tokenizer ---------------------------------------------------------------- */
/* Longest run of digits kept in one piece (numbers are cut left to right). */
#define PKV_BPE_DIGIT_RUN 3

static inline bool is_ws(uint8_t c)
{
    return c == ' ' || c == '\n' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}
static inline bool is_letter(uint8_t c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80;
}
static inline bool is_digit(uint8_t c)
{
    return c >= '0' && c <= '9';
}
static inline uint8_t lower(uint8_t c)
{
    return (c >= 'A' && c <= 'Z') ? (uint8_t)(c + 32) : c;
}

size_t pkv_tokenizer_piece_len(const uint8_t *s, size_t n, size_t i)
{
    uint8_t c = s[i];
    if (c == '\'' && i + 1 < n) {
        uint8_t a = lower(s[i + 1]);
        uint8_t b = i + 2 < n ? lower(s[i + 2]) : 0;
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
        if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    }
    size_t j = i;
    if (c == ' ' && i + 1 < n && !is_ws(s[i + 1])) j = i + 1;
    if (is_ws(s[j])) {
        /* a whitespace run; its last space is left for the word that follows */
        size_t k = j;
        while (k < n && is_ws(s[k])) k++;
        if (k < n && k - j >= 2 && s[k - 1] == ' ') k--;
        return k - i;
    }
    size_t k = j + 1;
    if (is_letter(s[j])) {
        while (k < n && is_letter(s[k])) k++;
    } else if (is_digit(s[j])) {
        while (k < n && k - j < PKV_BPE_DIGIT_RUN && is_digit(s[k])) k++;
    } else {
        while (k < n && !is_ws(s[k]) && !is_letter(s[k]) && !is_digit(s[k])) k++;
    }
    return k - i;
}

/* ---- tables ----------------------------------------------------------------------- */
static const char *const special_names[TOK_BPE_SPECIAL_COUNT] = {
    "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
};

static int32_t pair_lookup(const struct pkv_tok *t, uint32_t a, uint32_t b)
{
    uint64_t key = pkv_tokenizer_pair_key(a, b) + 1;
    uint32_t h = (uint32_t)pkv_tokenizer_mix64(key) & t->pair_mask;
    for (;;) {
        uint64_t k = t->pair_keys[h];
        if (k == key) return t->pair_ids[h];
        if (k == 0) return -1;
        h = (h + 1) & t->pair_mask;
    }
}

/* Merge (a, b) -> id into the pair table. */
static void builtin_pair_insert(struct pkv_tok *t, uint32_t a, uint32_t b, uint32_t id)
{
    uint64_t key = pkv_tokenizer_pair_key(a, b) + 1;
    uint32_t h = (uint32_t)pkv_tokenizer_mix64(key) & t->pair_mask;
    while (t->pair_keys[h] != 0) {
        /* a pair merged twice would make the table ambiguous: generator bug */
        PKV_ASSERT(t->pair_keys[h] != key);
        h = (h + 1) & t->pair_mask;
    }
    t->pair_keys[h] = key;
    t->pair_ids[h] = (int32_t)id;
}

/* The pieces into the arena: the 256 bytes, each merge's (its parts' bytes, lens[id] of
 * them, and its pair), then the specials (never decoded). */
static void builtin_fill(struct pkv_tok *t, const uint32_t *lens, uint32_t merges)
{
    size_t off = 0;
    for (int32_t i = 0; i < 256; i++) {
        t->arena[off] = (char)i;
        t->dec_off[i] = t->piece_off[i] = (uint32_t)off;
        t->dec_len[i] = t->piece_len[i] = 1;
        off++;
    }
    for (uint32_t r = 0; r < merges; r++) {
        uint32_t a = tok_bpe_merges[r][0], b = tok_bpe_merges[r][1], id = 256 + r;
        memcpy(t->arena + off, t->arena + t->dec_off[a], t->dec_len[a]);
        memcpy(t->arena + off + t->dec_len[a], t->arena + t->dec_off[b], t->dec_len[b]);
        t->dec_off[id] = t->piece_off[id] = (uint32_t)off;
        t->dec_len[id] = t->piece_len[id] = lens[id];
        off += lens[id];
        builtin_pair_insert(t, a, b, id);
    }
    for (int i = 0; i < TOK_BPE_SPECIAL_COUNT; i++) {
        int32_t id = (int32_t)(256 + merges) + i;
        size_t l = strlen(special_names[i]);
        memcpy(t->arena + off, special_names[i], l);
        t->piece_off[id] = (uint32_t)off;
        t->piece_len[id] = (uint32_t)l;
        t->dec_off[id] = (uint32_t)off;
        t->dec_len[id] = 0;
        t->special[id] = 1;
        off += l;
    }
}

int pkv_tok_create_builtin(pkv_tok_t **out)
{
    if (!out) return PKV_ERR_INVALID;
    uint32_t merges = tok_bpe_merge_count;
    int32_t vocab = (int32_t)(256 + merges + TOK_BPE_SPECIAL_COUNT);
    struct pkv_tok *t = calloc(1, sizeof(*t));
    if (!t) return PKV_ERR_NOMEM;
    t->kind = PKV_TOK_KIND_BUILTIN;

    /* arena: each merged piece is at most the sum of its parts; measure first */
    int rc = PKV_ERR_NOMEM;
    uint32_t *lens = malloc(sizeof(uint32_t) * (size_t)vocab);
    if (!lens) goto fail_lens;
    size_t arena = 0;
    for (int32_t i = 0; i < 256; i++) lens[i] = 1, arena += 1;
    for (uint32_t r = 0; r < merges; r++) {
        uint32_t a = tok_bpe_merges[r][0], b = tok_bpe_merges[r][1];
        PKV_ASSERT(a < 256 + r && b < 256 + r);
        lens[256 + r] = lens[a] + lens[b];
        arena += lens[256 + r];
    }
    for (int i = 0; i < TOK_BPE_SPECIAL_COUNT; i++) arena += strlen(special_names[i]);

    rc = tok_alloc_tables(t, vocab, arena);
    if (rc) goto fail_tables;
    uint32_t cap = 1;
    while (cap < merges * 2 + 2) cap <<= 1;
    t->pair_keys = calloc(cap, sizeof(uint64_t));
    t->pair_ids = malloc(sizeof(int32_t) * cap);
    if (!t->pair_keys || !t->pair_ids) {
        rc = PKV_ERR_NOMEM;
        goto fail_pairs;
    }
    t->pair_mask = cap - 1;
    builtin_fill(t, lens, merges);
    t->bos = (int32_t)(256 + merges) + TOK_BPE_SPECIAL_BOS;
    t->eos = (int32_t)(256 + merges) + TOK_BPE_SPECIAL_EOS;
    t->space_id = -1;
    free(lens);
    *out = t;
    return PKV_OK;

fail_pairs:
fail_tables:
    free(lens);
fail_lens:
    pkv_tok_destroy(t);
    return rc;
}

/* ---- encode ----------------------------------------------------------------------- */
/* Scratch for one piece: symbols (id, prev, next) and a binary min-heap of
 * (rank << 32 | position) keys. Grown on demand to the longest piece seen. */
struct bpe_scratch {
    size_t cap;
    int32_t *sym;
    int32_t *next, *prev;
    uint64_t *heap;
    size_t heap_n;
};

static int scratch_reserve(struct bpe_scratch *sc, size_t m)
{
    if (m <= sc->cap) return PKV_OK;
    size_t cap = sc->cap ? sc->cap : 64;
    while (cap < m) cap *= 2;
    int32_t *sym = realloc(sc->sym, sizeof(int32_t) * cap);
    if (sym) sc->sym = sym;
    int32_t *next = realloc(sc->next, sizeof(int32_t) * cap);
    if (next) sc->next = next;
    int32_t *prev = realloc(sc->prev, sizeof(int32_t) * cap);
    if (prev) sc->prev = prev;
    /* each merge pushes at most two entries after the initial m - 1 */
    uint64_t *heap = realloc(sc->heap, sizeof(uint64_t) * cap * 3);
    if (heap) sc->heap = heap;
    if (!sym || !next || !prev || !heap) return PKV_ERR_NOMEM;
    sc->cap = cap;
    return PKV_OK;
}

static void heap_push(struct bpe_scratch *sc, uint64_t key)
{
    size_t i = sc->heap_n++;
    uint64_t *h = sc->heap;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p] <= key) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = key;
}

static uint64_t heap_pop(struct bpe_scratch *sc)
{
    uint64_t *h = sc->heap;
    uint64_t top = h[0];
    uint64_t last = h[--sc->heap_n];
    size_t n = sc->heap_n, i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && h[c + 1] < h[c]) c++;
        if (h[c] >= last) break;
        h[i] = h[c];
        i = c;
    }
    if (n) h[i] = last;
    return top;
}

static void push_pair(const struct pkv_tok *t, struct bpe_scratch *sc, int32_t pos)
{
    int32_t nx = sc->next[pos];
    if (nx < 0) return;
    int32_t id = pair_lookup(t, (uint32_t)sc->sym[pos], (uint32_t)sc->sym[nx]);
    if (id < 0) return;
    heap_push(sc, ((uint64_t)(uint32_t)(id - 256) << 32) | (uint32_t)pos);
}

/* Encode one piece of m >= 2 bytes, appending its ids. */
static int encode_piece(const struct pkv_tok *t, struct bpe_scratch *sc, const uint8_t *s, size_t m,
                        int32_t *out, size_t cap, size_t *n)
{
    int rc = scratch_reserve(sc, m);
    if (rc) return rc;
    for (size_t i = 0; i < m; i++) {
        sc->sym[i] = s[i];
        sc->prev[i] = (int32_t)i - 1;
        sc->next[i] = i + 1 < m ? (int32_t)i + 1 : -1;
    }
    sc->heap_n = 0;
    for (size_t i = 0; i + 1 < m; i++) push_pair(t, sc, (int32_t)i);
    while (sc->heap_n) {
        uint64_t e = heap_pop(sc);
        int32_t pos = (int32_t)(uint32_t)e;
        int32_t id = (int32_t)(e >> 32) + 256;
        int32_t nx = sc->next[pos];
        /* stale: the left symbol was merged away (sym -1) or the pair changed */
        if (sc->sym[pos] < 0 || nx < 0 ||
            pair_lookup(t, (uint32_t)sc->sym[pos], (uint32_t)sc->sym[nx]) != id)
            continue;
        sc->sym[pos] = id;
        sc->sym[nx] = -1;
        int32_t nn = sc->next[nx];
        sc->next[pos] = nn;
        if (nn >= 0) sc->prev[nn] = pos;
        if (sc->prev[pos] >= 0) push_pair(t, sc, sc->prev[pos]);
        push_pair(t, sc, pos);
    }
    for (int32_t i = 0; i >= 0; i = sc->next[i]) {
        if (*n >= cap) return PKV_ERR_NOSPACE;
        out[(*n)++] = sc->sym[i];
    }
    return PKV_OK;
}

int tok_bpe_encode(const struct pkv_tok *t, const uint8_t *s, size_t len, int32_t *out, size_t cap,
                   size_t *n)
{
    struct bpe_scratch sc = {0};
    int rc = PKV_OK;
    size_t i = 0;
    while (i < len) {
        size_t m = pkv_tokenizer_piece_len(s, len, i);
        if (m == 1) {
            if (*n >= cap) {
                rc = PKV_ERR_NOSPACE;
                break;
            }
            out[(*n)++] = s[i];
        } else if (m > INT32_MAX / 4) {
            rc = PKV_ERR_NOFIT; /* positions are int32 (a 512 MiB word is not text) */
            break;
        } else {
            rc = encode_piece(t, &sc, s + i, m, out, cap, n);
            if (rc) break;
        }
        i += m;
    }
    free(sc.sym);
    free(sc.next);
    free(sc.prev);
    free(sc.heap);
    return rc;
}
