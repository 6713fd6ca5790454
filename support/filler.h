/*
 * Deterministic filler text for the benchmarks and the tests: numbered sentences of
 * common English words ("Sentence N: the ADJ NOUN of system M VERB OBJECT. "), with the
 * words and M drawn from a splitmix64 stream. The serving benchmarks' prompts and the
 * tokenizer's chars/token figures are measured on this text.
 */
#ifndef PKV_SUPPORT_FILLER_H
#define PKV_SUPPORT_FILLER_H

#include <stddef.h>
#include <stdint.h>

/* Write exactly n characters of filler to buf (n + 1 bytes; NUL added), sentences
 * numbered from `first`, words drawn from the stream seeded by `seed`. Printable ASCII
 * only. The same arguments always give the same bytes, and the first k bytes of a longer
 * filler equal the filler of k characters. */
void pkv_filler_write(char *buf, size_t n, uint64_t seed, uint64_t first);

/* The same into a new buffer of n + 1 bytes (caller frees); NULL when out of memory. */
char *pkv_filler_alloc(size_t n, uint64_t seed, uint64_t first);

#endif
