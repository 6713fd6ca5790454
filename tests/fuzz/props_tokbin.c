/* The llama2.c tokenizer loader's fuzz properties (see tests/fuzz/props.h,
 * fuzz_tokbin.c).
 *
 * Input: one byte of mode, then (mode & 1) the file, its vocabulary size the number of
 * entries a reference walk of it finds (so most inputs reach the table building), or
 * two bytes of vocabulary size (little-endian, signed) and then the file. A reference
 * reading of the format (src/tokenizer/llama2c.c's header comment) says what
 * pkv_tok_load_llama2c_mem must return: PKV_OK, PKV_ERR_INVALID (vocabulary size) or
 * PKV_ERR_CORRUPT (the file). A loaded tokenizer is checked against the file: every
 * id's piece is the file's bytes; decoding gives the piece, its byte for a <0xXX> piece,
 * nothing for ids 0..2; encode/decode round-trips whatever its byte pieces cover. */
#include "props.h"

#include "pagekv/tokenizer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) abort();                                                                      \
    } while (0)

typedef struct {
    size_t off; /* the entry's offset: f32 score, i32 len, len bytes */
    int32_t len;
} tokbin_entry_t;

static int32_t rd_i32(const uint8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Walks at most `want` entries (or all the file holds when want < 0) into e (capacity
 * cap); returns how many are well formed, and sets *end to where the last one ends. */
static int32_t tokbin_walk(const uint8_t *d, size_t n, int32_t want, tokbin_entry_t *e, size_t cap,
                           size_t *end)
{
    *end = 4;
    if (n < 4) return 0;
    int32_t max_len = rd_i32(d), k = 0;
    if (max_len < 1 || max_len > 4096) return 0;
    for (size_t off = 4; want < 0 || k < want; k++) {
        if (n - off < 8) break;
        float score;
        memcpy(&score, d + off, 4);
        int32_t l = rd_i32(d + off + 4);
        if (!isfinite(score) || l < 0 || l > max_len || n - off - 8 < (size_t)l) break;
        if ((size_t)k < cap) e[k] = (tokbin_entry_t){off, l};
        off += 8 + (size_t)l;
        *end = off;
    }
    return k;
}

/* What the loader must answer for vocabulary size `vocab`. */
static int tokbin_expect(const uint8_t *d, size_t n, int32_t vocab, tokbin_entry_t *e)
{
    if (vocab < 3 || vocab > (1 << 22)) return PKV_ERR_INVALID;
    size_t end;
    int32_t k = tokbin_walk(d, n, vocab, e, (size_t)vocab, &end);
    return k == vocab && end == n ? PKV_OK : PKV_ERR_CORRUPT;
}

static int byte_piece(const uint8_t *p, int32_t l)
{
    static const char hex[] = "0123456789abcdef0123456789ABCDEF";
    if (l != 6 || memcmp(p, "<0x", 3) || p[5] != '>') return -1;
    const char *hi = p[3] ? strchr(hex, p[3]) : NULL, *lo = p[4] ? strchr(hex, p[4]) : NULL;
    if (!hi || !lo) return -1;
    return (int)((hi - hex) % 16 * 16 + (lo - hex) % 16);
}

static void check_vocab(const pkv_tok_t *tok, const uint8_t *d, const tokbin_entry_t *e,
                        int32_t vocab, bool *bytes_covered)
{
    FUZZ_CHECK(pkv_tok_kind(tok) == PKV_TOK_KIND_LLAMA2C && pkv_tok_vocab_size(tok) == vocab);
    bool have[256] = {false};
    for (int32_t id = 0; id < vocab; id++) {
        const uint8_t *piece = d + e[id].off + 8;
        const char *b;
        size_t l;
        FUZZ_CHECK(pkv_tok_piece(tok, id, &b, &l) == PKV_OK);
        FUZZ_CHECK(l == (size_t)e[id].len && !memcmp(b, piece, l));
        FUZZ_CHECK(pkv_tok_decode_token(tok, 0, id, &b, &l) == PKV_OK); /* prev 0: not BOS */
        int bv = id < 3 ? -1 : byte_piece(piece, e[id].len);
        if (id < 3)
            FUZZ_CHECK(l == 0);
        else if (bv >= 0)
            FUZZ_CHECK(l == 1 && (uint8_t)b[0] == bv);
        else
            FUZZ_CHECK(l == (size_t)e[id].len && !memcmp(b, piece, l));
        if (bv >= 0) have[bv] = true;
    }
    FUZZ_CHECK(pkv_tok_decode_token(tok, 0, vocab, &(const char *){0}, &(size_t){0}) ==
               PKV_ERR_INVALID);
    *bytes_covered = true;
    for (int i = 0; i < 256; i++) *bytes_covered = *bytes_covered && have[i];
}

static void check_round_trip(const pkv_tok_t *tok, bool exact)
{
    static const uint8_t text[] = "hello world \xc3\xa9\xff\x00 <s> <0x41> 12345\n";
    size_t len = sizeof(text) - 1;
    int32_t *ids = NULL;
    size_t n = 0;
    FUZZ_CHECK(pkv_tok_encode_alloc(tok, (const char *)text, len, true, &ids, &n) == PKV_OK);
    FUZZ_CHECK(n >= 1 && n <= pkv_tok_max_tokens(tok, len) && ids[0] == pkv_tok_bos(tok));
    for (size_t i = 1; i < n; i++)
        FUZZ_CHECK(ids[i] >= 0 && ids[i] < pkv_tok_vocab_size(tok) &&
                   (ids[i] == 0 || !pkv_tok_is_special(tok, ids[i])));
    char *back = NULL;
    size_t blen = 0;
    FUZZ_CHECK(pkv_tok_decode(tok, ids, n, &back, &blen) == PKV_OK);
    if (exact) FUZZ_CHECK(blen == len && !memcmp(back, text, len));
    free(back);
    free(ids);
}

int pkv_fuzz_tokbin(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    const uint8_t *d = data + 1;
    size_t n = size - 1, end;
    int32_t vocab;
    if (data[0] & 1) {
        vocab = tokbin_walk(d, n, -1, NULL, 0, &end);
    } else {
        if (n < 2) return 0;
        vocab = (int16_t)(d[0] | d[1] << 8);
        d += 2, n -= 2;
    }
    tokbin_entry_t *e = vocab > 0 ? calloc((size_t)vocab, sizeof(*e)) : NULL;
    FUZZ_CHECK(vocab <= 0 || e);
    int want = tokbin_expect(d, n, vocab, e);
    pkv_tok_t *tok = NULL;
    pkv_fuzz_quiet_logs(true);
    int rc = pkv_tok_load_llama2c_mem(d, n, vocab, &tok);
    pkv_fuzz_quiet_logs(false);
    FUZZ_CHECK(rc == want && (rc == PKV_OK) == (tok != NULL));
    if (tok) {
        bool covered;
        check_vocab(tok, d, e, vocab, &covered);
        check_round_trip(tok, covered);
    }
    pkv_tok_destroy(tok);
    free(e);
    return rc;
}
