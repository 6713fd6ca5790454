/*
 * kv: internals shared by the KV cache front (kv.c) and its backends (pool/, dense/).
 * A backend embeds `struct pkv_kv` / `struct pkv_seq` first in its own objects and
 * fills in an ops table; kv.c validates arguments and dispatches.
 */
#ifndef PKV_KV_KV_INT_H
#define PKV_KV_KV_INT_H

#include "pagekv/kv.h"

#include "core/core.h"

#define PKV_KEY_BYTES 32
typedef struct {
    uint8_t b[PKV_KEY_BYTES];
} pkv_key_t;

typedef struct {
    void (*destroy)(pkv_kv_t *kv);
    int (*seq_create)(pkv_kv_t *kv, const pkv_seq_params_t *p, pkv_seq_t **out, uint32_t *n_cached);
    void (*seq_free)(pkv_seq_t *seq);
    int (*seq_reserve)(pkv_seq_t *seq, uint32_t n_tokens);
    int (*seq_append)(pkv_seq_t *seq, const int32_t *tokens, uint32_t n);
    int (*seq_fork)(pkv_seq_t *parent, pkv_seq_t **out);
    void (*seq_slot)(const pkv_seq_t *seq, uint32_t pos, uint32_t layer, void **k, void **v,
                     size_t *head_stride);
    uint32_t (*seq_runs)(const pkv_seq_t *seq, uint32_t layer, uint32_t begin, uint32_t end,
                         pkv_kv_run_t *out, uint32_t max, uint32_t *next);
    void (*reset_cache)(pkv_kv_t *kv);
    void (*stats)(pkv_kv_t *kv, pkv_kv_stats_t *out);
    int (*validate)(pkv_kv_t *kv);
} pkv_kv_ops_t;

struct pkv_kv {
    const pkv_kv_ops_t *ops;
    pkv_geometry_t geo; /* block_tokens filled in */
    pkv_backend_t backend;
    size_t elem_bytes;  /* dtype size */
    size_t token_bytes; /* K+V, all layers, one position */
    size_t block_bytes; /* token_bytes * block_tokens */
};

/* The part of a sequence every backend keeps. Owned by one thread at a time. */
struct pkv_seq {
    pkv_kv_t *kv;
    uint32_t length;   /* positions whose K/V is written and tokens appended */
    uint32_t capacity; /* positions writable without allocating */
    uint64_t salt;
    pkv_key_t last_key; /* key of the last full block (or the root key) */
    int32_t *tail;      /* tokens of the current partial block [block_tokens] */
};

/* Prefix keys (prefix.c): root = SHA-256("pagekv-root" || salt);
 * next = SHA-256(parent || token ids as little-endian int32). */
void pkv_prefix_root(uint64_t salt, pkv_key_t *out);
void pkv_prefix_next(const pkv_key_t *parent, const int32_t *tokens, uint32_t n, pkv_key_t *out);
static inline uint64_t pkv_key_hash(const pkv_key_t *k)
{
    uint64_t h;
    __builtin_memcpy(&h, k->b, sizeof(h));
    return h;
}
static inline int pkv_key_eq(const pkv_key_t *a, const pkv_key_t *b)
{
    return __builtin_memcmp(a->b, b->b, PKV_KEY_BYTES) == 0;
}

/* Common sequence bookkeeping: init (allocates tail), fini, and the token side of
 * append: writes tokens to the tail; calls `full(seq, block_index, key, arg)` for each
 * block that fills. */
int pkv_seq_base_init(struct pkv_seq *s, pkv_kv_t *kv, uint64_t salt);
void pkv_seq_base_fini(struct pkv_seq *s);
/* Copy the token side of src into dst (initialized by pkv_seq_base_init). */
void pkv_seq_base_copy(struct pkv_seq *dst, const struct pkv_seq *src);
typedef void (*pkv_seq_full_fn)(struct pkv_seq *s, uint32_t block, const pkv_key_t *key, void *arg);
void pkv_seq_base_append(struct pkv_seq *s, const int32_t *tokens, uint32_t n, pkv_seq_full_fn full,
                         void *arg);
/* Keys of the prompt's adoptable blocks: at most (n_tokens - 1) / block_tokens. */
uint32_t pkv_prefix_keys(const pkv_kv_t *kv, uint64_t salt, const int32_t *tokens,
                         uint32_t n_tokens, pkv_key_t *keys);

/* Backends. */
int pkv_pool_create(const pkv_kv_config_t *cfg, pkv_kv_t **out);
int pkv_dense_create(const pkv_kv_config_t *cfg, pkv_kv_t **out);

#endif
