/*
 * tokenizer's module interface: what other parts of pagekv (the offline BPE trainer,
 * tools/tokenizer.c) may use beyond include/pagekv/tokenizer.h: the pre-tokenizer and the
 * pair hash the builtin BPE's encoder uses, so the trainer cuts and counts exactly as the
 * encoder will merge. Not installed.
 */
#ifndef PKV_TOKENIZER_TOKENIZER_H
#define PKV_TOKENIZER_TOKENIZER_H

#include "pagekv/tokenizer.h"

#include <stddef.h>
#include <stdint.h>

/* The pre-tokenizer: the length (>= 1) of the piece that starts at s[i], i < n.
 * GPT-2 style: contractions, an optional leading space joined to a run of letters
 * (bytes >= 0x80 count as letters), of digits, or of other non-space bytes, and runs
 * of whitespace (whose last space joins the next word). Merges never cross pieces. */
size_t pkv_tokenizer_piece_len(const uint8_t *s, size_t n, size_t i);

/* A hash of a pair of ids, shared by the encoder and the trainer. */
static inline uint64_t pkv_tokenizer_pair_key(uint32_t a, uint32_t b)
{
    return ((uint64_t)a << 32) | b;
}
static inline uint64_t pkv_tokenizer_mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

#endif
