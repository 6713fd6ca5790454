/*
 * plan: the memory planner's arithmetic (`pagekv plan`, docs/design/plan.md). From a KV
 * geometry, the tensor parallelism of each side and a load (longest context,
 * concurrency, a mix of context lengths, transfers in flight, long transfers beside
 * them), the bytes each KV design needs per rank and per host:
 *   - fixed-slot staging (concurrency slots x the pages of the longest context) vs
 *     per-transfer staging (the pages of the transfers in flight: mean and tail),
 *   - resharding through a host mirror of the device pool vs per-plan staging of the
 *     head slices in flight,
 *   - the paged pool's growth peak (live rounded up to the pool's granules: at most live +
 *     one granule per range) vs a copy-on-grow pool (pool x 2, weights not counted).
 * Pages follow the staging's arithmetic (a transfer of B bytes takes ceil(B / page_bytes)
 * pages; a fixed slot is the pages of the longest context), a transfer's bytes the pull's
 * (pull_block_tokens: the whole blocks before the prompt's last token, as pagekv's decode
 * node pulls; 0: every token, as the field's connectors move), granules the pool's
 * (blocks_per_granule = max(1, granule / block), granule stride rounded up to 4 KiB).
 *
 * Pure arithmetic: no printing, no global state. Every product is checked for 64-bit
 * overflow; bad input and overflow are PKV_ERR_INVALID with a one-line reason in
 * pkv_plan_t.err (or the err buffer). The tail computation allocates (PKV_ERR_NOMEM).
 */
#ifndef PKV_PLAN_PLAN_H
#define PKV_PLAN_PLAN_H

#include "pagekv/kv.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PKV_PLAN_MAX_MIX  64
#define PKV_PLAN_MAX_LONG 8
#define PKV_PLAN_ERR_LEN  200
/* The tail of per-transfer staging: the pages in flight exceeded at this fraction of
 * instants when the in-flight transfers are drawn independently from the mix. */
#define PKV_PLAN_TAIL_EXCEED 1e-5

typedef struct {
    uint64_t tokens; /* context length of this share of the mix */
    uint64_t weight; /* relative weight, >= 1 */
} pkv_plan_mix_t;

typedef struct {
    uint64_t tokens; /* context of the long transfer */
    uint64_t count;  /* how many of them are in flight, >= 1 */
} pkv_plan_long_t;

typedef struct {
    /* geometry of the whole model; a token's one KV head is pkv_dtype_row_bytes(dtype,
     * head_dim) bytes: head_dim values, + a 4-byte f32 scale for int8 and fp8 */
    uint32_t layers, kv_heads, head_dim;
    pkv_dtype_t dtype;
    /* deployment */
    uint32_t prefill_tp, decode_tp;
    uint32_t ranks_per_host; /* 0 -> each side's TP */
    uint64_t page_tokens;    /* tokens per staging page and per pool block; 0 -> 64 */
    uint64_t granule_bytes;  /* pool commit unit; 0 -> as the pool picks (pkv_prim_granule_for) */
    /* What a transfer of an n-token context moves: 0 -> all n tokens (the field's
     * connectors; `bench staging`'s transfers); B -> the whole B-token blocks before the
     * context's last token, floor((n - 1) / B) x B tokens (pagekv's decode node computes
     * the last token itself: `pagekv serve --block-tokens`, default 16). */
    uint64_t pull_block_tokens;
    /* load */
    uint64_t context;     /* the longest context, tokens */
    uint64_t concurrency; /* requests at once = fixed slots */
    pkv_plan_mix_t mix[PKV_PLAN_MAX_MIX];
    uint32_t n_mix; /* 0 -> every transfer is `context` long */
    /* false: the mix is of the transfers in flight (the field's table); true: of the
     * requests sent, and a transfer is in flight for a time that grows with its pages,
     * so at an instant the transfers in flight are drawn with weight x pages (the
     * inspection paradox: a long transfer is more likely to be caught in flight) */
    bool mix_of_requests;
    uint64_t in_flight;
    bool in_flight_set; /* false -> in_flight = concurrency */
    pkv_plan_long_t longs[PKV_PLAN_MAX_LONG];
    uint32_t n_long;
    uint64_t device_pool_bytes; /* per rank; 0 -> concurrency x context, whole blocks */
} pkv_plan_input_t;

/* Bytes of one rank, or of one host (a rank's x ranks_per_host). */
typedef struct {
    uint64_t token_bytes;       /* K+V of one token in every layer: layers x 2 x heads x row */
    uint64_t page_bytes;        /* page_tokens tokens */
    uint64_t device_pool_bytes; /* the pool the load fills */
    uint64_t fixed_bytes;       /* fixed-slot staging */
    uint64_t per_transfer_mean_bytes;
    uint64_t per_transfer_tail_bytes;
    uint64_t mirror_bytes;     /* host mirror of the device pool */
    uint64_t per_plan_bytes;   /* head slices in flight (the mean load) */
    uint64_t paged_peak_bytes; /* paged pool growing to the device pool */
    uint64_t copy_grow_bytes;  /* copy-on-grow pool: pool x 2 (+ weights, not counted) */
} pkv_plan_bytes_t;

typedef struct {
    uint32_t tp;
    uint32_t heads_per_rank;
    uint32_t replicas; /* ranks holding each head: tp / kv_heads when tp > kv_heads, else 1 */
    uint32_t ranks_per_host;
    uint64_t slot_pages;         /* pages of the longest context */
    uint64_t fixed_pages;        /* concurrency x slot_pages */
    uint64_t mean_pages;         /* pages in flight, mean (rounded up) */
    uint64_t tail_pages;         /* pages in flight, tail (PKV_PLAN_TAIL_EXCEED) */
    bool tail_exact;             /* exact distribution (else normal approximation) */
    uint64_t block_bytes;        /* pool block = one page of this rank */
    uint64_t blocks_per_granule; /* pool arithmetic */
    uint64_t granule_bytes;      /* granule stride */
    uint64_t pool_blocks;        /* blocks of the device pool */
    pkv_plan_bytes_t rank, host;
} pkv_plan_side_t;

typedef struct {
    pkv_plan_input_t in; /* the input with every default filled in */
    pkv_plan_side_t prefill, decode;
    double mean_pages_exact; /* the decode rank's pages in flight, mean, before rounding */
    /* ratios (per rank and per host alike), decode side */
    double fixed_over_per_transfer, mirror_over_per_plan, copy_grow_over_paged;
    char err[PKV_PLAN_ERR_LEN]; /* the reason when compute failed */
} pkv_plan_t;

/* The input's geometry from a preset: the model presets (pkv_model_preset:
 * "llama-3.2-1b", "qwen3-0.6b", ...) plus the planner's own "gpt-oss-120b" (36 layers,
 * 8 KV heads, head dim 64). dtype is set to bf16. PKV_ERR_NOTFOUND for an unknown name. */
int pkv_plan_preset(const char *name, pkv_plan_input_t *in);

/* Compute the plan. PKV_OK, or PKV_ERR_INVALID (bad input, 64-bit overflow: out->err says
 * which) or PKV_ERR_NOMEM; out->err is always set on failure, the figures only on success. */
int pkv_plan_compute(const pkv_plan_input_t *in, pkv_plan_t *out);

/* The second field report's table: rows at 8k, 128k and 1M context per host. */
#define PKV_PLAN_FIELD_ROWS 3
typedef struct {
    uint64_t context_tokens;
    uint64_t token_bytes_per_rank; /* K+V of one token in every layer, one decode rank */
    uint64_t page_bytes_per_rank;
    uint64_t fixed_host_bytes;
    uint64_t per_transfer_host_bytes;
    uint64_t mirror_host_bytes;
    uint64_t per_plan_host_bytes;
    const char *assumptions; /* static text */
} pkv_plan_field_row_t;

/* The field rows for the geometry and TP of `geo` (its load fields are ignored and
 * replaced by the report's: 64 slots, 64-way concurrency, 64 transfers of
 * 128:55,512:30,4096:10,8192:5 in flight; +1 x 128k at 128k; 64 x 8k + 1 x 1M at 1M; a
 * 56.5 GiB device pool per rank). Errors as pkv_plan_compute, the reason in err. */
int pkv_plan_field(const pkv_plan_input_t *geo, pkv_plan_field_row_t rows[PKV_PLAN_FIELD_ROWS],
                   char *err, size_t err_len);

#endif
