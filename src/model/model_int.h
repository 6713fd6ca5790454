/*
 * Private to src/model/ and its tests; internals prefixed model_ / MODEL_; no module interface.
 *
 * model internals shared by model.c (forward pass, built-in weights) and llama2c.c
 * (checkpoint loader).
 *
 * Weight layout: every matrix is stored input-major, w[k][c] with ld (padded to a
 * multiple of 16) columns, so a matmul folds over k with 8-wide vectors along c and
 * every output keeps one fixed operation order (see kernels.h). Padding columns are 0.
 */
#ifndef PKV_MODEL_INT_H
#define PKV_MODEL_INT_H

#include "pagekv/model.h"

#include "model/kernels.h"
#include "model/tpool.h"

typedef struct {
    float *rms_att; /* (dim) */
    float *wqkv;    /* (dim, ld_qkv): columns q[n_heads*hd] | k[kv_heads*hd] | v[kv_heads*hd] */
    float *wo;      /* (qdim, ld_d) */
    float *rms_ffn; /* (dim) */
    float *w13;     /* (dim, ld_h2): columns w1[hidden] | w3[hidden] */
    float *w2;      /* (hidden, ld_d) */
} model_layer_t;

struct pkv_model {
    pkv_model_config_t cfg;
    const model_kernels_t *kern;
    model_tpool_t *pool;
    uint32_t threads;
    pkv_model_runtime_t rt; /* as given (threads and chunk resolved below) */
    uint32_t chunk;         /* rows per pass */
    uint32_t qdim, kvdim;
    uint32_t ld_d, ld_qkv, ld_q, ld_h2, ld_v;

    float *weights; /* one allocation holding every tensor below */
    size_t weights_floats;
    float *emb; /* (vocab, dim) row per token */
    model_layer_t *layers;
    float *rms_final; /* (dim) */
    float *wcls;      /* (dim, ld_v) */

    /* Scratch for one pass of up to `chunk` rows (owned by the forward caller). */
    float *x;              /* (chunk, ld_d) residual stream */
    float *xb;             /* (chunk, ld_d) normed input */
    float *qkv;            /* (chunk, ld_qkv) */
    float *att;            /* (chunk, ld_q) attention output */
    float *tmp;            /* (chunk, ld_d) */
    float *h13;            /* (chunk, ld_h2) */
    float *hid;            /* (chunk, hidden) */
    float *rope;           /* (chunk, head_dim): cos, sin per pair */
    float *lrows;          /* (LOGIT_ROWS, ld_d) */
    float *lout;           /* (LOGIT_ROWS, ld_v) */
    float *scores;         /* (threads, 2 BLOCK_PAIRS_LONG, n_heads, max_seq_len) */
    float *att_aux;        /* per thread: spans' partials, maxima, sums (att_task) */
    size_t att_aux_floats; /* per thread */
    uint32_t max_spans;    /* spans of max_seq_len positions (ATT_SPAN) */
    /* A decode pass split by span (dec_task): per row, its first task and first span. */
    uint32_t *dtask0, *dspan0; /* (chunk + 1) */
    float *dpart, *dstat;      /* per span of a row: partials (qdim), max + sum (n_heads) */
    size_t dspans_cap;
    struct pkv_model_row *rows;   /* (chunk) */
    struct pkv_model_seg *segs;   /* (chunk) */
    struct pkv_model_pair *pairs; /* (chunk) */
    uint32_t *blocks;             /* (chunk + 1): block b is pairs [blocks[b], blocks[b + 1]) */
    pkv_kv_run_t *runs;           /* per segment: kv_groups x nruns (group-major) */
    size_t runs_cap;
    /* The cache of the current forward: its ranks, and the head groups attention reads,
     * each from one rank (the first holding the group's heads): min(tp, kv_heads). */
    uint32_t kv_tp, kv_groups;
};

/* Allocate a model for cfg (weights zeroed, scratch ready, kernels and threads chosen).
 * cfg is validated; PKV_ERR_INVALID with a logged reason. */
int model_alloc(const pkv_model_config_t *cfg, const pkv_model_runtime_t *rt, pkv_model_t **out);

#endif
