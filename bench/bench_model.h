/*
 * bench model's pieces another bench shares (`bench kvquant`'s decode cases).
 */
#ifndef PKV_BENCH_BENCH_MODEL_H
#define PKV_BENCH_BENCH_MODEL_H

#include "pagekv/model.h"

/* `steps` greedy decode steps of one token for each of seqs[0..n) (n <= 8) in one forward
 * call per step; wall seconds (CPU seconds of the process in *cpu), or < 0 on an error. */
double pkv_bm_decode(pkv_model_t *m, pkv_kv_t *kv, pkv_seq_t **seqs, uint32_t n, uint32_t steps,
                     double *cpu);
/* Positions [from, to) of seq get K/V of a fixed pseudo-random pattern (values in [-1, 1),
 * through the dtype's one quantizer) in place of a prefill, and their tokens appended. */
void pkv_bm_fill_positions(pkv_model_t *m, pkv_dtype_t dt, pkv_seq_t *seq, const int32_t *toks,
                           uint32_t from, uint32_t to, uint64_t seed);

#endif
