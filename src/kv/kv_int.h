/*
 * Private to src/kv/ and its tests; internals prefixed kv_ / KV_; interface: kv/kv.h.
 *
 * kv: internals shared by the files of the KV module: the front (kv.c: argument checks,
 * dispatch, dtype and geometry helpers, prefix keys, the token side of a sequence) and
 * its two backends, the paged pool (pool.c) and the dense baseline (dense.c). A backend
 * embeds `struct pkv_kv` / `struct pkv_seq` first in its own objects and fills in an ops
 * table; kv.c validates arguments and reaches a backend only through that table.
 */
#ifndef PKV_KV_KV_INT_H
#define PKV_KV_KV_INT_H

#include "kv/kv.h"

#include "core/core.h"

#include <stdlib.h>

/* A backend. Every entry is required except the paged-only block access (seq_blocks to
 * blocks_alloc) and the rank entries: a backend without them leaves them NULL and kv.c
 * answers PKV_ERR_UNSUPPORTED (NULL from pkv_kv_block_head; unpin does nothing). The rank
 * entries are only reached for tp > 1 (kv.c serves rank 0 of a tp = 1 cache through the
 * plain entries), with rank < tp checked. */
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
    /* prefix-cache policy: optional (NULL: no cache policy, as dense) */
    uint64_t (*trim)(pkv_kv_t *kv, uint64_t now_ns, uint64_t *next_ns);
    uint32_t (*warm_refill)(pkv_kv_t *kv, uint32_t max);
    void (*cache_pressure)(pkv_kv_t *kv, uint64_t limit_bytes);
    /* How many of keys[0..n) lead the prompt in the prefix cache (0 when it is off). */
    uint32_t (*prefix_match)(pkv_kv_t *kv, const pkv_kv_key_t *keys, uint32_t n);
    /* Paged: as prefix_match, the hits' block ids into ids[], each pinned. */
    uint32_t (*prefix_pin)(pkv_kv_t *kv, const pkv_kv_key_t *keys, uint32_t n, uint32_t *ids);
    void (*stats)(pkv_kv_t *kv, pkv_kv_stats_t *out);
    int (*validate)(pkv_kv_t *kv);
    /* paged-only block access (arguments checked by kv.c except the block ids) */
    void (*seq_blocks)(const pkv_seq_t *seq, const uint32_t **ids, uint32_t *n);
    void *(*block_head)(const pkv_kv_t *kv, uint32_t block, uint32_t layer, uint32_t which,
                        uint32_t head);
    int (*pin)(pkv_kv_t *kv, const uint32_t *ids, uint32_t n);
    void (*unpin)(pkv_kv_t *kv, const uint32_t *ids, uint32_t n);
    int (*blocks_alloc)(pkv_kv_t *kv, uint32_t n, uint32_t *ids);
    /* tensor-parallel ranks (head checked by kv.c to be one the rank holds) */
    void *(*block_head_rank)(const pkv_kv_t *kv, uint32_t rank, uint32_t block, uint32_t layer,
                             uint32_t which, uint32_t head);
    void (*seq_slot_rank)(const pkv_seq_t *seq, uint32_t rank, uint32_t pos, uint32_t layer,
                          void **k, void **v, size_t *head_stride);
    uint32_t (*seq_runs_rank)(const pkv_seq_t *seq, uint32_t rank, uint32_t layer, uint32_t begin,
                              uint32_t end, pkv_kv_run_t *out, uint32_t max, uint32_t *next);
    void (*rank)(const pkv_kv_t *kv, uint32_t rank, pkv_kv_rank_t *out);
    /* a lower tier's (kv/tier.c) */
    int (*key_pin)(pkv_kv_t *kv, const pkv_kv_key_t *key, uint32_t *id);
    uint32_t (*blocks_publish)(pkv_kv_t *kv, const uint32_t *ids, const pkv_kv_key_t *keys,
                               uint32_t n, uint64_t salt);
    uint64_t (*purge_salt)(pkv_kv_t *kv, uint64_t salt);
} kv_ops_t;

struct pkv_kv {
    const kv_ops_t *ops;
    pkv_geometry_t geo; /* block_tokens filled in */
    pkv_backend_t backend;
    size_t row_bytes;       /* one token's one head: pkv_dtype_row_bytes */
    size_t token_bytes;     /* K+V, all layers, one position */
    size_t block_bytes;     /* token_bytes * block_tokens */
    uint32_t tp;            /* tensor-parallel ranks (1: dense, or a plain pool) */
    pkv_kv_full_fn on_full; /* set once before use (pkv_kv_on_full) */
    void *on_full_arg;
    void (*on_warm_low)(void *arg); /* set once before use (pkv_kv_on_warm_low) */
    void *on_warm_low_arg;
};

/* The part of a sequence every backend keeps. Owned by one thread at a time. */
struct pkv_seq {
    pkv_kv_t *kv;
    uint32_t length;   /* positions whose K/V is written and tokens appended */
    uint32_t capacity; /* positions writable without allocating */
    uint64_t salt;
    pkv_kv_key_t last_key; /* key of the last full block (or the root key) */
    int32_t *tail;         /* tokens of the current partial block [block_tokens] */
    uint64_t commit_ns;    /* OS time its allocations spent committing granules */
};

/* Fill in the common part of a backend's cache object from a checked config. */
void kv_base_init(struct pkv_kv *kv, const pkv_kv_config_t *cfg, const kv_ops_t *ops);

/* The module's bookkeeping allocations: each can be failed by a test through the
 * PKV_FAULT_ALLOC site (core.h), exactly as if the allocator returned NULL. */
static inline void *kv_malloc(size_t n)
{
    return pkv_fault_hit(PKV_FAULT_ALLOC) ? NULL : malloc(n);
}
static inline void *kv_calloc(size_t n, size_t size)
{
    return pkv_fault_hit(PKV_FAULT_ALLOC) ? NULL : calloc(n, size);
}
static inline void *kv_realloc(void *p, size_t n)
{
    return pkv_fault_hit(PKV_FAULT_ALLOC) ? NULL : realloc(p, n);
}

/* Prefix keys: root = SHA-256("pagekv-root" || salt);
 * next = SHA-256(parent || token ids as little-endian int32). */
void kv_prefix_root(uint64_t salt, pkv_kv_key_t *out);
void kv_prefix_next(const pkv_kv_key_t *parent, const int32_t *tokens, uint32_t n,
                    pkv_kv_key_t *out);
static inline uint64_t kv_key_hash(const pkv_kv_key_t *k)
{
    uint64_t h;
    __builtin_memcpy(&h, k->b, sizeof(h));
    return h;
}
static inline int kv_key_eq(const pkv_kv_key_t *a, const pkv_kv_key_t *b)
{
    return __builtin_memcmp(a->b, b->b, PKV_KV_KEY_BYTES) == 0;
}

/* Common sequence bookkeeping: init (allocates tail), fini, and the token side of
 * append: writes tokens to the tail; calls `full(seq, block_index, key, parent, arg)` for each
 * block that fills. */
int kv_seq_base_init(struct pkv_seq *s, pkv_kv_t *kv, uint64_t salt);
void kv_seq_base_fini(struct pkv_seq *s);
/* Copy the token side of src into dst (initialized by kv_seq_base_init). */
void kv_seq_base_copy(struct pkv_seq *dst, const struct pkv_seq *src);
typedef void (*kv_seq_full_fn)(struct pkv_seq *s, uint32_t block, const pkv_kv_key_t *key,
                               const pkv_kv_key_t *parent, void *arg);
void kv_seq_base_append(struct pkv_seq *s, const int32_t *tokens, uint32_t n, kv_seq_full_fn full,
                        void *arg);

/* Backends: create from a config kv.c has checked. */
int kv_pool_create(const pkv_kv_config_t *cfg, pkv_kv_t **out);
int kv_dense_create(const pkv_kv_config_t *cfg, pkv_kv_t **out);

#endif
