/*
 * pagekv model: a llama-architecture decoder (RMSNorm, RoPE, grouped-query attention,
 * SwiGLU MLP) in f32 whose K/V live in a pkv_kv_t, paged or dense. Attention reads K/V
 * straight through pkv_seq_runs (no gather into a contiguous copy); the dense backend
 * runs the same kernel over its single run.
 *
 * Two ways to get weights:
 *   - built-in (pkv_model_create_builtin): a preset gives the KV geometry of a real
 *     model ("llama-3.2-1b": 16 layers, 8 KV heads, head dim 64; "qwen3-0.6b": 28, 8,
 *     128) with a small hidden size so compute stays cheap, and weights generated
 *     deterministically from a seed; "tiny" is a small default for tests.
 *   - llama2.c checkpoints (pkv_model_load_llama2c): karpathy/llama2.c's legacy
 *     "version 0" format, validated field by field.
 *
 * Reproducibility: the logits of a token depend only on the token ids of its sequence
 * up to it, never on the backend, block size, batch composition, prefill chunking,
 * thread count or prefix adoption: within one process, paged and dense are bitwise
 * identical. (The SIMD and portable kernel sets differ from each other; a process
 * picks one at model creation.)
 *
 * Thread safety: weights are immutable; pkv_model_forward uses the model's scratch and
 * thread pool, so calls on one model must not overlap (the engine serializes them).
 */
#ifndef PAGEKV_MODEL_H
#define PAGEKV_MODEL_H

#include "pagekv/export.h"

#include "pagekv/kv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    uint32_t dim;        /* residual width */
    uint32_t hidden_dim; /* SwiGLU width */
    uint32_t n_layers;
    uint32_t n_heads; /* query heads; a multiple of n_kv_heads */
    uint32_t n_kv_heads;
    uint32_t head_dim;
    uint32_t vocab_size;
    uint32_t max_seq_len; /* positions the model accepts */
    float rope_theta;
    float norm_eps;
    /* Built-in weights only (0 = 1 = none): scale the last two dims of every K head (one
     * RoPE pair) by k_outlier_gain, as real models' keys carry a few outlier channels; and
     * the queries by q_gain, which sharpens attention. Measurement knobs for quantized KV
     * (`pagekv bench kvquant`); a checkpoint's weights are never changed. */
    float k_outlier_gain;
    float q_gain;
} pkv_model_config_t;

/* Names of the built-in presets, NULL-terminated ("tiny" first: the default). */
PKV_API const char *const *pkv_model_preset_names(void);
/* The configuration of a preset (vocab_size left 0: the caller supplies it).
 * PKV_ERR_NOTFOUND for an unknown name. NULL name -> "tiny". */
PKV_API int pkv_model_preset(const char *name, pkv_model_config_t *out);

typedef struct {
    uint32_t threads;      /* 0 -> online CPUs, at most 8 */
    uint32_t chunk_tokens; /* tokens computed together per pass; 0 -> 128 */
    bool portable;         /* force the portable kernels (no AVX2) */
    /* Measurement hook (NULL: none): after each layer's attention, called once per row
     * computed with the layer, the row's position, its queries q (after RoPE, and rotated
     * where the KV dtype rotates keys: pkv_dtype_rotates_keys) and its attention output
     * att (n = query heads x head dim floats each, before the output projection), on the
     * calling thread. */
    void (*att_probe)(void *arg, uint32_t layer, uint32_t pos, const float *q, const float *att,
                      uint32_t n);
    void *att_probe_arg;
} pkv_model_runtime_t;

typedef struct pkv_model pkv_model_t;

/* A model with weights generated from `seed` for configuration `cfg` (typically from
 * pkv_model_preset with vocab_size filled in). rt may be NULL. */
PKV_API int pkv_model_create_builtin(const pkv_model_config_t *cfg, uint64_t seed,
                                     const pkv_model_runtime_t *rt, pkv_model_t **out);
/* Load a llama2.c checkpoint (legacy version 0: 7 int32 header fields dim, hidden_dim,
 * n_layers, n_heads, n_kv_heads, vocab_size (negative: unshared classifier), seq_len,
 * then f32 weights). The file size must match the header exactly; header fields are
 * validated and weights must be finite. PKV_ERR_IO (cannot read), PKV_ERR_CORRUPT
 * (inconsistent or truncated), with a logged message naming the field or sizes. */
PKV_API int pkv_model_load_llama2c(const char *path, const pkv_model_runtime_t *rt,
                                   pkv_model_t **out);
PKV_API void pkv_model_destroy(pkv_model_t *m);

PKV_API const pkv_model_config_t *pkv_model_config(const pkv_model_t *m);
/* "avx2" or "portable". */
PKV_API const char *pkv_model_kernels(const pkv_model_t *m);
PKV_API uint32_t pkv_model_threads(const pkv_model_t *m);
/* The KV geometry this model needs, for pkv_kv_create. */
PKV_API void pkv_model_geometry(const pkv_model_t *m, pkv_dtype_t dtype, uint32_t block_tokens,
                                pkv_geometry_t *out);

/* One sequence's share of a forward pass. */
typedef struct {
    pkv_seq_t *seq;        /* computes positions [length, length + n_tokens) */
    const int32_t *tokens; /* n_tokens ids */
    uint32_t n_tokens;     /* >= 1 */
    float *logits;         /* NULL, or vocab_size floats: logits after the last token */
} pkv_model_item_t;

/* Run the model over every item: K/V of the new positions is written into each
 * sequence (its capacity must already cover length + n_tokens: pkv_seq_reserve) and
 * then appended (pkv_seq_append), and logits are filled where asked. All sequences
 * belong to `kv`, whose geometry must match the model; a sequence appears at most
 * once. Bad input (ids out of range, short capacity, too long, geometry mismatch) is
 * PKV_ERR_INVALID before anything is written. */
PKV_API int pkv_model_forward(pkv_model_t *m, pkv_kv_t *kv, const pkv_model_item_t *items,
                              uint32_t n_items);

#ifdef __cplusplus
}
#endif
#endif
