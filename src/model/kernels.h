/*
 * kernels: the model's inner loops, in a portable C version and an AVX2/FMA/F16C
 * version chosen once at model creation (runtime CPU check; the build does not pass
 * -mavx2).
 *
 * Reproducibility contract (what makes paged == dense bit for bit, and a token's
 * result independent of its batch, chunk and thread): every output element is computed
 * by one fixed sequence of operations that depends only on the element's own inputs,
 * never on how the work around it is tiled:
 *   matmul   y[r][c] = fold over k ascending of fma(x[r][k], w[k][c], .) from 0
 *   scores   s_t = scale * tree-sum of 8 lanes, lane j folding d = j, j+8, ... ascending
 *   span_exp per span of ATT_SPAN positions (model.c): m = its max; e_t = exp(s_t - m)
 *            in place; sum over its positions with lane = (pos - span start) mod 8,
 *            then a fixed tree
 *   av       acc[d] = fold over positions ascending of fma(e_t, v_t[d], .), a span's
 *            partial from 0
 * and, in model.c (one C function for every path), a row's spans merged in ascending
 * order: M = max of the spans' m, f = expf(m - M), sum = fold of sum * f, out[d] = fold
 * of partial[d] * f, then out[d] * (1 / sum).
 * A run boundary, a batch of 1 or 8, a tail of 3 tokens: all take the same path per
 * element. The two kernel sets differ from each other (fma vs mul+add, exp
 * polynomial vs libm); a process uses one set for every backend.
 */
#ifndef PKV_MODEL_KERNELS_H
#define PKV_MODEL_KERNELS_H

#include "pagekv/kv.h"

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *name;
    /* y[r][c] = sum_k x[r][k] * w[k][c] for r < rows, c in [c0, c1): c0 and c1 are
     * multiples of 16, w has ldw >= c1 columns. */
    void (*matmul)(const float *x, size_t ldx, uint32_t rows, uint32_t K, const float *w,
                   size_t ldw, uint32_t c0, uint32_t c1, float *y, size_t ldy);
    /* Attention scores for KV heads [h0, h0 + nh) of the runs (in position order and
     * contiguous, from any position: a window of a sequence's runs, each clipped to it,
     * reads as well as the whole list), `group` query heads per KV head. Query head j of KV
     * head h (j < group) of query a is at qa + ((h - h0) * group + j) * hd and writes
     * its scores to oa + ((h - h0) * group + j) * ostride: oa[..][t] = scale * dot(q,
     * k_t) for t < na. Likewise query b (qb, ob, nb) when qb is not NULL (na <= nb).
     * Runs are the outer loop and heads the inner one, so a paged block's K region for
     * those heads is read front to back. */
    void (*scores)(const float *qa, const float *qb, uint32_t na, uint32_t nb,
                   const pkv_kv_run_t *runs, uint32_t nruns, uint32_t h0, uint32_t nh,
                   uint32_t group, uint32_t hd, pkv_dtype_t dt, float scale, float *oa, float *ob,
                   size_t ostride);
    /* s[0..n) <- exp(s[0..n) - m) with *max = m = their max, *sum = their sum (n > 0). */
    void (*span_exp)(float *s, uint32_t n, float *max, float *sum);
    /* For the same heads: aa[..][d] += sum over the runs' t < na ascending of pa[..][t] * v_t[d]
     * (pa rows at pstride, aa rows at hd), and likewise ab with pb over t < nb. */
    void (*av)(const float *pa, const float *pb, uint32_t na, uint32_t nb, const pkv_kv_run_t *runs,
               uint32_t nruns, uint32_t h0, uint32_t nh, uint32_t group, uint32_t hd,
               pkv_dtype_t dt, size_t pstride, float *aa, float *ab);
    /* sum of x[i]^2 in a fixed order. */
    float (*sumsq)(const float *x, uint32_t n);
} model_kernels_t;

/* The portable set. */
const model_kernels_t *model_kernels_portable(void);
/* The AVX2 set when the CPU has AVX2+FMA+F16C and head_dim % 8 == 0, else NULL. */
const model_kernels_t *model_kernels_avx2(uint32_t head_dim);

#endif
