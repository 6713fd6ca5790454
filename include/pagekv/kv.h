/*
 * pagekv KV cache: sequences of K/V positions stored either in the paged pool
 * (PKV_BACKEND_PAGED, the product) or in one contiguous buffer per sequence
 * (PKV_BACKEND_DENSE, the honest baseline). Both sit behind one sequence interface.
 *
 * Memory layout of one position range ("run"): for layer l and KV head h, the row of K
 * of token t (head_dim values of the cache dtype, then for a scaled dtype its f32 scale:
 * pkv_dtype_row_bytes bytes) is at  run.k + h * run.head_stride + t * row_bytes  (bytes),
 * V likewise from run.v. Paged: a run is one block or several adjacent ones (head_stride =
 * the granule's slots of one head); dense: a run is the whole sequence (head_stride =
 * capacity * row_bytes).
 *
 * Writing protocol: pkv_seq_reserve() makes positions [length, n) writable (allocating
 * blocks and copying a shared partial block first: copy-on-write); the caller writes
 * K/V through pkv_seq_slot(); pkv_seq_append() then records the token ids of positions
 * [length, length + n): from then on their K/V is complete and, once a block is full,
 * immutable and shareable through the prefix cache.
 *
 * Thread safety: a pkv_kv_t may be used from several threads. Calls that change
 * bookkeeping (create/free/reserve/append/fork/pin/unpin/reset/stats) take the cache's
 * mutex and may run concurrently. A sequence is owned by one thread at a time: calls on
 * the same pkv_seq_t must not run concurrently. K/V bytes are not guarded: a block is
 * written only by the sequence that owns it exclusively (refcount 1) before its
 * positions are appended; appended full blocks are read-only. A transfer worker may pin
 * blocks (pkv_kv_pin) and read them while the engine runs: a pinned block is never
 * freed, evicted or reused until unpinned.
 */
#ifndef PAGEKV_KV_H
#define PAGEKV_KV_H

#include "pagekv/export.h"

#include "pagekv/pagekv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The KV cache's formats. f32, f16, bf16: plain values. int8 and fp8 (OCP FP8 e4m3) are
 * scaled: every row (one token's one KV head) is head_dim one-byte codes followed by its
 * own f32 scale, value = code * scale, the scale computed when the row is written from
 * the row's largest magnitude (int8: amax / 127; fp8: amax / 448). See
 * docs/design/pool.md, "Quantized KV". */
typedef enum {
    PKV_DTYPE_F32 = 0,
    PKV_DTYPE_F16 = 1,
    PKV_DTYPE_BF16 = 2,
    PKV_DTYPE_INT8 = 3,
    PKV_DTYPE_FP8 = 4,
} pkv_dtype_t;
#define PKV_DTYPE_COUNT 5
/* Bytes of one value (1 for int8 and fp8). */
PKV_API size_t pkv_dtype_size(pkv_dtype_t dt);
/* Whether rows carry a scale (int8, fp8). */
PKV_API bool pkv_dtype_scaled(pkv_dtype_t dt);
/* Whether keys of this dtype are stored rotated: int8 at a power-of-two head_dim. Its
 * writers store each K row times the normalized Walsh-Hadamard matrix (pkv_hadamard) and
 * its readers rotate their queries alike: q.k is unchanged (an orthogonal rotation) while
 * a few outlier channels spread over every dim instead of setting the row's scale alone.
 * V rows are never rotated. (fp8 keeps its own per-value exponent, which outlier channels
 * do not hurt; rotated, it measured worse: docs/design/pool.md, "Quantized KV".) */
PKV_API bool pkv_dtype_rotates_keys(pkv_dtype_t dt, uint32_t head_dim);
/* x <- x H / sqrt(n) in place, n a power of two (the normalized Walsh-Hadamard transform,
 * its own inverse): the rotation of pkv_dtype_rotates_keys. */
PKV_API void pkv_hadamard(float *x, uint32_t n);
/* Bytes of one row of head_dim values: head_dim * size, + 4 (the f32 scale) when scaled. */
PKV_API size_t pkv_dtype_row_bytes(pkv_dtype_t dt, uint32_t head_dim);
PKV_API const char *pkv_dtype_name(pkv_dtype_t dt);
/* "f32", "f16", "bf16", "int8", "fp8" (also "fp8_e4m3"). */
PKV_API int pkv_dtype_parse(const char *s, pkv_dtype_t *out);
/* Encode one row of n f32 values into pkv_dtype_row_bytes(dt, n) bytes at dst (round to
 * nearest even; int8 codes in [-127, 127]; fp8 saturates at +-448 and never writes a NaN
 * code; a NaN input is stored as 0), and decode one such row back to f32 (exact for the
 * stored codes). The one quantizer: every writer of KV (dense, paged, a prefill node, a
 * benchmark) calls it, so equal inputs give equal bytes everywhere. */
PKV_API void pkv_dtype_from_f32(pkv_dtype_t dt, void *dst, const float *src, size_t n);
PKV_API void pkv_dtype_to_f32(pkv_dtype_t dt, float *dst, const void *src, size_t n);

typedef struct {
    uint32_t layers;
    uint32_t kv_heads;
    uint32_t head_dim;
    uint32_t block_tokens; /* 0 -> 16 */
    pkv_dtype_t dtype;
} pkv_geometry_t;

/* K+V bytes of one token in every layer. */
PKV_API size_t pkv_geometry_token_bytes(const pkv_geometry_t *g);

typedef enum { PKV_BACKEND_PAGED = 0, PKV_BACKEND_DENSE = 1 } pkv_backend_t;
PKV_API const char *pkv_backend_name(pkv_backend_t b);
PKV_API int pkv_backend_parse(const char *s, pkv_backend_t *out);

/* Where a paged pool's bytes live (docs/design/pool.md, "Storage"). NULL in
 * pkv_kv_config_t: host memory (address space reserved once, granules committed and
 * given back with the OS). Another backend (the GPU's device memory, src/gpu) hands out
 * addresses the pool only computes with: the pool itself reads and writes block bytes
 * only through `copy` (a shared partial block copied before it is written). Each call
 * but `stride` may block; the pool never makes one under its lock. The backend outlives
 * the pool. */
typedef struct pkv_kv_storage {
    const char *name; /* "host", "cuda", ... (logs, stats) */
    /* A range's bytes per granule holding `used` bytes of blocks: a multiple of the
     * backend's own unit (the host's 4 KiB page, a device's mapping granularity). A pure
     * function: the pool's validation calls it under the pool's lock. */
    size_t (*stride)(void *ctx, size_t used);
    /* `bytes` (a multiple of stride) of addresses, none of it usable before commit. */
    int (*reserve)(void *ctx, size_t bytes, void **addr);
    /* A whole range, every granule of it decommitted first. */
    void (*release)(void *ctx, void *addr, size_t bytes);
    /* One granule's part of a range, [addr, addr + bytes): usable after PKV_OK; on an
     * error (PKV_ERR_NOMEM: no room) nothing stays committed. `huge`: the pool asks for
     * huge pages (a backend without them ignores it). */
    int (*commit)(void *ctx, void *addr, size_t bytes, bool huge);
    /* Give it back at once; no reader may use it after (a device backend waits for the
     * work it launched first). */
    void (*decommit)(void *ctx, void *addr, size_t bytes);
    /* Copy between committed bytes of the storage; an error leaves dst unspecified. */
    int (*copy)(void *ctx, void *dst, const void *src, size_t bytes);
    void *ctx;
} pkv_kv_storage_t;

typedef struct {
    pkv_geometry_t geo;
    pkv_backend_t backend;
    /* Paged only: NULL -> host memory. The dense baseline (malloc) refuses another one. */
    const pkv_kv_storage_t *storage;
    uint64_t budget_bytes;    /* cap on committed KV bytes; 0 = none */
    uint64_t reserve_bytes;   /* address space to reserve when no budget; 0 -> 64 GiB */
    uint32_t retain_granules; /* empty granules kept committed (hysteresis); default 1 */
    uint64_t granule_bytes;   /* paged commit unit, multiple of 4 KiB; 0 -> 2 MiB, or for
                                 blocks that do not fill it the multiple of 2 MiB up to 8 MiB
                                 that wastes least (a quantized dtype at head dim 64: 4 MiB) */
    bool no_prefix_cache;     /* disable prefix caching */
    bool hugepages;           /* paged: ask for THP on commit */
    /* Prefix-cache policy (paged; the dense baseline ignores it). Cached blocks are full,
     * unreferenced prompt blocks kept for later requests; live blocks are never touched.
     * cache_max_bytes caps the committed memory that stays committed only because of
     * cached blocks (granules holding cached blocks and no live one; pkv_kv_stats'
     * cache_bytes): beyond it whole granules are emptied, the sparsest among the coldest
     * first, and returned to the OS. 0 = no cap. */
    uint64_t cache_max_bytes;
    /* Cached blocks not used for this long are evicted by pkv_kv_trim. 0 = never. */
    uint32_t cache_idle_ms;
    /* The warm floor (paged; 0 = none): empty granules kept committed so an allocation
     * does not wait for the OS, as many as the largest single allocation (admission or
     * reserve) of the last warm_idle_ms (0 -> 30 s) spans, at most warm_max_bytes.
     * pkv_kv_trim commits again what allocations took from it, and lets it go once no
     * allocation asked for that much within warm_idle_ms. */
    uint64_t warm_max_bytes;
    uint32_t warm_idle_ms;
    /* Tensor-parallel ranks (paged only; dense: 0 or 1); 0 -> 1. See "tensor parallelism". */
    uint32_t tp;
} pkv_kv_config_t;

typedef struct pkv_kv pkv_kv_t;
typedef struct pkv_seq pkv_seq_t;

/* Create a KV cache. On success *out owns everything; free with pkv_kv_destroy. */
PKV_API int pkv_kv_create(const pkv_kv_config_t *cfg, pkv_kv_t **out);
/* Frees the cache. Every sequence must have been freed (aborts otherwise: a caller bug). */
PKV_API void pkv_kv_destroy(pkv_kv_t *kv);
PKV_API const pkv_geometry_t *pkv_kv_geometry(const pkv_kv_t *kv);
PKV_API pkv_backend_t pkv_kv_backend(const pkv_kv_t *kv);

typedef struct {
    uint64_t salt;           /* per-tenant prefix-cache salt */
    const int32_t *tokens;   /* the prompt */
    uint32_t n_tokens;       /* >= 1 */
    uint32_t reserve_tokens; /* capacity to reserve at admission: >= n_tokens, or 0 = n_tokens */
} pkv_seq_params_t;

/* Admission: adopt the longest cached prefix of the prompt (whole blocks, never the whole
 * prompt: at least one token is left to compute) and reserve capacity for
 * reserve_tokens positions, or fail with no side effect:
 *   PKV_ERR_NOFIT   the request can never fit the budget (message logged with numbers),
 *   PKV_ERR_NOSPACE not enough free + evictable memory now.
 * On success *out is the sequence, with length = *n_cached (adopted tokens). */
PKV_API int pkv_seq_create(pkv_kv_t *kv, const pkv_seq_params_t *p, pkv_seq_t **out,
                           uint32_t *n_cached);
/* Free a sequence: its full, hashed blocks become cached (evictable); the rest free. */
PKV_API void pkv_seq_free(pkv_seq_t *seq);
/* Ensure capacity for n_tokens positions; copy-on-write of a shared partial block. No side
 * effect on failure (NOSPACE / NOFIT / NOMEM). */
PKV_API int pkv_seq_reserve(pkv_seq_t *seq, uint32_t n_tokens);
/* Record tokens for positions [length, length + n): their K/V has been written. Requires
 * length + n <= capacity. Full blocks get their prefix key and become shareable. */
PKV_API int pkv_seq_append(pkv_seq_t *seq, const int32_t *tokens, uint32_t n);
/* Child shares every block of the parent (a partial last block is copied on first write). */
PKV_API int pkv_seq_fork(pkv_seq_t *parent, pkv_seq_t **out);
PKV_API uint32_t pkv_seq_length(const pkv_seq_t *seq);
PKV_API uint32_t pkv_seq_capacity(const pkv_seq_t *seq);

/* Where K/V of position pos (< capacity) in layer sits: *k and *v point at head 0's row;
 * head h's row is at + h * *head_stride bytes. Write only positions >= length. */
PKV_API void pkv_seq_slot(const pkv_seq_t *seq, uint32_t pos, uint32_t layer, void **k, void **v,
                          size_t *head_stride);

typedef struct {
    const void *k, *v;  /* head 0, first token of the run */
    uint32_t pos;       /* first position */
    uint32_t n_tokens;  /* positions in the run */
    size_t head_stride; /* bytes between heads */
} pkv_kv_run_t;
/* Fill out[] with the runs covering positions [begin, end) of layer, in order; end may
 * reach capacity, so a forward pass can read K/V it wrote but has not appended yet. Returns
 * the number of runs written (at most max); *next is the position after the last run. */
PKV_API uint32_t pkv_seq_runs(const pkv_seq_t *seq, uint32_t layer, uint32_t begin, uint32_t end,
                              pkv_kv_run_t *out, uint32_t max, uint32_t *next);

/* ---- paged-only: block access for transfers (PKV_ERR_UNSUPPORTED on dense) -------- */
/* The block ids of a sequence's table (valid until the sequence changes). */
PKV_API int pkv_seq_blocks(const pkv_seq_t *seq, const uint32_t **ids, uint32_t *n);
/* One block's K/V over every KV head, one copy of each (what a TP=1 pool stores per
 * block); a TP pool that replicates heads stores pkv_kv_stats_t.block_bytes per block. */
PKV_API size_t pkv_kv_block_bytes(const pkv_kv_t *kv);
/* A block's K (which = 0) or V (which = 1) of one layer and KV head: block_tokens rows
 * (pkv_dtype_row_bytes each), block_bytes / (2 * layers * kv_heads) bytes. Within a commit granule
 * the pieces of one (layer, k|v, head) of every block lie side by side in slot order:
 * blocks b and b + 1 of one granule have adjacent pieces. NULL when out of range. */
PKV_API void *pkv_kv_block_head(const pkv_kv_t *kv, uint32_t block, uint32_t layer, uint32_t which,
                                uint32_t head);
/* Take / drop an extra reference on live or cached blocks (a transfer's lease). Pin
 * fails with PKV_ERR_NOTFOUND, pinning nothing, if any id is free or out of range. */
PKV_API int pkv_kv_pin(pkv_kv_t *kv, const uint32_t *ids, uint32_t n);
PKV_API void pkv_kv_unpin(pkv_kv_t *kv, const uint32_t *ids, uint32_t n);

/* ---- tensor parallelism: ranks ------------------------------------------------------ */
/* A pool created with tp = N holds its KV as N ranks, each in its own storage range and
 * holding the KV heads of its shard; one bookkeeping (block ids, prefix cache, refcounts)
 * serves every rank, as one scheduler serves every rank of a real TP group. A block id
 * names the block on every rank; reserve, COW, pins and eviction act on every rank's part.
 * Each rank's range is laid out as a TP=1 pool over the rank's heads only
 * ([layer][k|v][local head][slot][token][dim] per granule); blocks per granule come from
 * the TP=1 block size, so the same calls give the same block ids whatever the tp. The
 * dense baseline has one rank (tp > 1: PKV_ERR_UNSUPPORTED at create). The budget is the
 * node's total over all ranks. */
#define PKV_KV_MAX_TP 64
/* Check a TP degree against a head count: PKV_OK, or PKV_ERR_INVALID with why filled
 * (cap bytes; may be NULL): tp == 0, tp > PKV_KV_MAX_TP, tp <= kv_heads and kv_heads % tp,
 * tp > kv_heads and tp % kv_heads. */
PKV_API int pkv_kv_tp_check(uint32_t kv_heads, uint32_t tp, char *why, size_t cap);
/* The heads rank r of tp holds (global indices): tp <= kv_heads: [r*kv_heads/tp, +kv_heads/tp);
 * tp > kv_heads: the one head r*kv_heads/tp (replicated on tp/kv_heads ranks). tp must pass
 * pkv_kv_tp_check and rank < tp. */
PKV_API void pkv_kv_tp_heads(uint32_t kv_heads, uint32_t tp, uint32_t rank, uint32_t *head_lo,
                             uint32_t *head_n);
typedef struct {
    uint32_t head_lo, head_n; /* the KV heads the rank holds (global indices) */
    void *base;               /* its storage range (NULL: dense) */
    size_t bytes;             /* the range's reserved bytes */
    uint64_t committed_bytes; /* held from the OS now in this range */
} pkv_kv_rank_t;
PKV_API uint32_t pkv_kv_tp(const pkv_kv_t *kv); /* 1 for dense */
/* PKV_ERR_INVALID for rank >= tp. */
PKV_API int pkv_kv_rank(const pkv_kv_t *kv, uint32_t rank, pkv_kv_rank_t *out);
/* A block's piece for (layer, K|V, head) in rank's range; head is GLOBAL and must be one the
 * rank holds (NULL otherwise, or out of range). pkv_kv_block_head(kv, ...) is the first
 * rank that holds head. */
PKV_API void *pkv_kv_block_head_rank(const pkv_kv_t *kv, uint32_t rank, uint32_t block,
                                     uint32_t layer, uint32_t which, uint32_t head);
/* As pkv_seq_slot / pkv_seq_runs, in rank's range: *k / run.k point at the rank's first head
 * (head_lo); held head h is at + (h - head_lo) * head_stride bytes. Every rank has the
 * same runs (positions and lengths); pkv_seq_slot / pkv_seq_runs are rank 0's. */
PKV_API void pkv_seq_slot_rank(const pkv_seq_t *seq, uint32_t rank, uint32_t pos, uint32_t layer,
                               void **k, void **v, size_t *head_stride);
PKV_API uint32_t pkv_seq_runs_rank(const pkv_seq_t *seq, uint32_t rank, uint32_t layer,
                                   uint32_t begin, uint32_t end, pkv_kv_run_t *out, uint32_t max,
                                   uint32_t *next);

/* ---- cache control and accounting --------------------------------------------------- */
/* Drop every cached (unreferenced) block and return empty granules to the OS. */
PKV_API void pkv_kv_reset_cache(pkv_kv_t *kv);
/* The idle time-to-live, applied at now_ns (monotonic, as pkv_now_ns): evict the cached
 * blocks released at or before now_ns - cache_idle_ms and return the granules that empty
 * to the OS (beyond retain_granules and the warm floor). The warm floor too: lapsed (no
 * allocation as large within warm_idle_ms) its empty granules go back; otherwise the
 * granules allocations took from it are committed again, on the caller's thread. The pool
 * owns no thread: a caller that wants idle blocks to go without new requests calls this
 * from a timer (`pagekv serve`'s memory watcher does). *next_ns (optional) is when the
 * oldest remaining cached block or the floor expires, UINT64_MAX when nothing will.
 * Returns the blocks evicted. Dense: 0, *next_ns = UINT64_MAX. */
PKV_API uint64_t pkv_kv_trim(pkv_kv_t *kv, uint64_t now_ns, uint64_t *next_ns);
/* Memory pressure: hold the cache's committed bytes (cache_bytes) at or below
 * limit_bytes from now on: whole granules are emptied at once (the sparsest among the
 * coldest first) and again whenever released blocks would go beyond it, counted as
 * pressure evictions, until the next call; PKV_KV_NO_LIMIT lifts it (cache_max_bytes
 * still applies). Dense: no effect. */
#define PKV_KV_NO_LIMIT UINT64_MAX
PKV_API void pkv_kv_cache_pressure(pkv_kv_t *kv, uint64_t limit_bytes);

typedef struct {
    uint64_t committed_bytes; /* KV memory held from the OS now */
    uint64_t peak_committed_bytes;
    uint64_t reserved_bytes; /* address space reserved (paged) */
    uint64_t budget_bytes;   /* 0 = none */
    uint64_t granule_bytes;  /* paged: commit unit; dense: 0 */
    uint32_t storage_ranges; /* separately reserved ranges (paged: one per rank) */
    bool huge_granules;      /* paged: every range's granule is a multiple of 2 MiB, so 2 MiB
                                pages can back it (false: 4 KiB pages whatever is asked) */
    uint32_t tp;             /* tensor-parallel ranks (1: dense or a plain pool) */
    /* One block / one position over every rank. With tp > kv_heads each replica of a head
     * costs its bytes: this is tp / kv_heads times pkv_kv_block_bytes. committed_bytes,
     * peak, reserved, granule and cache bytes are totals over all ranks too. */
    uint64_t block_bytes;
    uint64_t token_bytes;
    uint64_t blocks_capacity; /* blocks the budget / reservation allows */
    uint64_t blocks_live;     /* refcount > 0 */
    uint64_t blocks_cached;   /* refcount 0, hashed, evictable */
    uint64_t blocks_free;     /* committed, unused */
    uint64_t live_tokens;     /* positions held by live sequences (sum of lengths) */
    uint64_t sequences;
    uint64_t prefix_queries;      /* admissions that looked up the cache */
    uint64_t prefix_query_tokens; /* prompt tokens looked up */
    uint64_t prefix_hit_tokens;   /* tokens adopted from the cache */
    uint64_t evictions;           /* cached blocks dropped */
    uint64_t cow_copies;
    uint64_t commits, decommits; /* granules */
    uint64_t rejected_nofit, rejected_nospace;
    /* prefix-cache policy (paged; 0 on dense) */
    uint64_t cache_bytes;          /* committed bytes held only by cached blocks */
    uint64_t cache_max_bytes;      /* the cap (0: none) */
    uint64_t cache_pressure_limit; /* pkv_kv_cache_pressure's limit (PKV_KV_NO_LIMIT: none) */
    uint64_t cache_idle_ms;        /* the time-to-live (0: none) */
    /* evictions by cause (they sum to evictions): budget (room for an allocation), cap,
     * idle (pkv_kv_trim), pressure (pkv_kv_cache_pressure), reset (pkv_kv_reset_cache) */
    uint64_t evictions_budget, evictions_cap, evictions_idle, evictions_pressure;
    uint64_t evictions_reset;
    /* the warm floor (paged; 0 on dense) */
    uint64_t empty_bytes;    /* committed granules without a used block (the floor's) */
    uint64_t warm_bytes;     /* the floor now: empty bytes kept and refilled */
    uint64_t warm_max_bytes; /* the configured bound, whole granules */
    uint64_t warm_refills;   /* granules pkv_kv_trim committed to refill it */
    uint64_t commit_ns;      /* OS time spent committing granules, every caller's */
} pkv_kv_stats_t;
PKV_API void pkv_kv_stats(pkv_kv_t *kv, pkv_kv_stats_t *out);

/* Check every invariant (expensive); PKV_OK or PKV_ERR_CORRUPT with a logged reason. */
PKV_API int pkv_kv_validate(pkv_kv_t *kv);

#ifdef __cplusplus
}
#endif
#endif
