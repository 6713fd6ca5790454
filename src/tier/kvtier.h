/*
 * kvtier: the disk tier joined to a paged KV pool (docs/design/tier.md, "The pool and the
 * tier"). It owns a pkv_tier_t (the directory, its index, its writer) and a loader thread.
 *
 * Writing: every block that becomes a prefix-cache block is queued for the writer at once
 * (pkv_kv_on_full); the writer copies it out of the pool under a pin. Reading: before a
 * request is admitted, pkv_kvtier_prepare pins the prompt's cached prefix in memory and,
 * when the estimate says a load beats recomputing, has the loader read the blocks that
 * continue it from disk into freshly allocated pool blocks, each verified (checksum, key,
 * layout) before it is keyed; the caller waits at most the load deadline. What the lease
 * holds is then adopted by the request's admission like any cached prefix.
 *
 * Locking: kt->lock guards the estimates, the counters and the load jobs' states; no I/O,
 * pool call or tier call runs under it.
 */
#ifndef PKV_TIER_KVTIER_H
#define PKV_TIER_KVTIER_H

#include "core/core.h"
#include "kv/kv.h"
#include "tier/tier.h"

typedef struct pkv_kvtier pkv_kvtier_t;

typedef struct {
    const char *dir;                     /* created (0700) when missing */
    uint64_t max_bytes;                  /* the directory's cap */
    uint64_t min_free_bytes;             /* writes stop under this much free space */
    uint32_t load_ms;                    /* a load's deadline (0: 1000) */
    uint8_t layout[PKV_TIER_HASH_BYTES]; /* what the pool's bytes mean (pkv_kvtier_layout) */
} pkv_kvtier_config_t;

/* The layout digest of this pool's blocks: SHA-256 over the model's identity (a caller's
 * string: preset and seed, or a checkpoint's content hash, and the kernels that compute
 * K/V) and everything that changes a block's bytes (geometry, dtype, block tokens, ranks,
 * the canonical block order's version). */
void pkv_kvtier_layout(const pkv_kv_t *kv, const char *model_identity,
                       uint8_t out[PKV_TIER_HASH_BYTES]);

/* A file's content as 32 hex digits of XXH3-128 (a checkpoint's part of the model identity):
 * PKV_OK or PKV_ERR_IO. */
int pkv_kvtier_file_hash(const char *path, char hex[33]);

/* Open the tier on cfg->dir for the paged kv (its blocks' writes start now; set before
 * any sequence exists). PKV_ERR_BUSY: another live server holds the directory;
 * PKV_ERR_UNSUPPORTED: kv is dense or has no prefix cache; PKV_ERR_IO; PKV_ERR_INVALID. */
int pkv_kvtier_open(pkv_kv_t *kv, const pkv_kvtier_config_t *cfg, pkv_kvtier_t **out);
/* Stop the loader and the writer (a load still running is waited for). NULL: no-op. */
void pkv_kvtier_close(pkv_kvtier_t *kt);

/* What a request's admission adopts: its prompt's prefix blocks, pinned (memory hits
 * first, then the blocks loaded from disk), in prefix order. */
typedef struct {
    uint32_t *ids; /* [mem_blocks + disk_blocks], malloc'd */
    uint32_t mem_blocks, disk_blocks;
} pkv_kvtier_lease_t;

/* Pin the cached prefix of tokens[0..n) under salt and load from disk what continues it,
 * when predicted faster than recomputing it, within the load deadline (a load that misses
 * it keeps the blocks read by then; the rest is recomputed). A record that fails its check,
 * a short read or an I/O error ends the load there. Never fails: on any error the lease
 * holds what could be pinned (possibly nothing). Release with pkv_kvtier_release once the
 * request was admitted (or dropped). */
void pkv_kvtier_prepare(pkv_kvtier_t *kt, uint64_t salt, const int32_t *tokens, uint32_t n,
                        pkv_kvtier_lease_t *out);
void pkv_kvtier_release(pkv_kvtier_t *kt, pkv_kvtier_lease_t *l);

/* How many prompt tokens memory, and then the disk, hold (whole blocks, changes nothing). */
void pkv_kvtier_lookup(pkv_kvtier_t *kt, uint64_t salt, const int32_t *tokens, uint32_t n,
                       uint32_t *mem_tokens, uint32_t *disk_tokens);

/* The engine computed `tokens` prompt tokens in `ns`: the recompute estimate learns. */
void pkv_kvtier_note_prefill(pkv_kvtier_t *kt, uint64_t tokens, uint64_t ns);

/* Drop every record on disk / every segment holding one of the tenant's (salt's) records
 * (pkv_tier_drop_all / pkv_tier_drop_tenant). */
int pkv_kvtier_drop_disk(pkv_kvtier_t *kt);
int pkv_kvtier_purge_disk(pkv_kvtier_t *kt, uint64_t salt);

#define PKV_KVTIER_HIST_BUCKETS 12
extern const double pkv_kvtier_hist_bounds[PKV_KVTIER_HIST_BUCKETS]; /* seconds */

typedef struct {
    pkv_tier_stats_t disk;
    uint64_t capacity_bytes;
    uint64_t hit_blocks_memory, hit_blocks_disk; /* blocks pinned / loaded for requests */
    uint64_t decisions_load, decisions_recompute;
    uint64_t load_timeouts; /* loads that missed their deadline */
    uint64_t load_failures; /* loads ended early by a bad record or an I/O error */
    double block_load_s;    /* the estimate of one block's load (0: none yet) */
    double prefill_token_s; /* the estimate of one token's prefill (0: none yet) */
    double read_bytes_per_s;
    pkv_hist_t load_seconds; /* over pkv_kvtier_hist_bounds */
} pkv_kvtier_stats_t;
void pkv_kvtier_stats(pkv_kvtier_t *kt, pkv_kvtier_stats_t *out);

#endif
