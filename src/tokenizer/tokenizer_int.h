/*
 * Private to src/tokenizer/ and its tests; internals prefixed tok_ / TOK_; interface: tokenizer.h.
 *
 * tokenizer internals (not installed): the pkv_tok struct shared by the builtin BPE
 * (bpe.c), the llama2.c loader (llama2c.c) and the common code (tokenizer.c), and the
 * generated merge table (bpe_merges.c). The pre-tokenizer and pair hash the offline
 * trainer reuses are in the module interface, tokenizer/tokenizer.h.
 */
#ifndef PKV_TOKENIZER_INT_H
#define PKV_TOKENIZER_INT_H

#include "pagekv/tokenizer.h"
#include "tokenizer/tokenizer.h"

#include <stddef.h>
#include <stdint.h>

#define TOK_LOG "tok"

/* ---- builtin BPE layout --------------------------------------------------------- */
/* ids 0..255: bytes; 256 .. 256+merge_count-1: merges in rank order; then specials. */
enum {
    TOK_BPE_SPECIAL_BOS = 0,
    TOK_BPE_SPECIAL_EOS,
    TOK_BPE_SPECIAL_SYSTEM,
    TOK_BPE_SPECIAL_USER,
    TOK_BPE_SPECIAL_ASSISTANT,
    TOK_BPE_SPECIAL_END,
    TOK_BPE_SPECIAL_COUNT,
};

/* The generated merge table (bpe_merges.c): merge r makes id 256 + r from the pair
 * (left, right); both are ids < 256 + r. */
extern const uint32_t tok_bpe_merge_count;
extern const uint16_t tok_bpe_merges[][2];

/* ---- the tokenizer -------------------------------------------------------------- */
struct pkv_tok {
    pkv_tok_kind_t kind;
    int32_t vocab_size;
    int32_t bos, eos;
    uint8_t *special; /* (vocab_size) 1 for special ids */

    /* Per id, two byte ranges into `arena`: what decode emits, and the display piece. */
    char *arena;
    uint32_t *dec_off, *dec_len;     /* (vocab_size) */
    uint32_t *piece_off, *piece_len; /* (vocab_size) */

    /* builtin: open-addressing map pair_key(left, right) -> merged id (rank = id-256). */
    uint64_t *pair_keys; /* (pair_cap) key + 1; 0 = empty slot */
    int32_t *pair_ids;   /* (pair_cap) */
    uint32_t pair_mask;

    /* llama2c */
    float *scores;      /* (vocab_size) */
    int32_t *str_slots; /* (str_mask + 1) id + 1 of a matchable piece; 0 = empty */
    uint32_t str_mask;
    int32_t byte_id[256]; /* <0xXX> piece per byte, -1 when absent */
    int32_t space_id;     /* the " " piece (dummy prefix), -1 when absent */
    uint32_t max_token_length;
};

/* Allocation helpers used by both kinds (tokenizer.c). */
int tok_alloc_tables(struct pkv_tok *t, int32_t vocab_size, size_t arena_bytes);

/* Kind-specific encode of `len` bytes, appending to out[*n .. cap). */
int tok_bpe_encode(const struct pkv_tok *t, const uint8_t *s, size_t len, int32_t *out, size_t cap,
                   size_t *n);
int tok_llama2c_encode(const struct pkv_tok *t, const uint8_t *s, size_t len, int32_t *out,
                       size_t cap, size_t *n);

#endif
