/*
 * kv: the KV module's interface for other pagekv modules, benchmarks and tools (not
 * installed). The public face is include/pagekv/kv.h; this adds what the allocator
 * benchmark and transfer code need beyond it.
 */
#ifndef PKV_KV_KV_H
#define PKV_KV_KV_H

#include "pagekv/kv.h"

/* A block's prefix key: SHA-256 chained over the token ids of the prefix. */
#define PKV_KV_KEY_BYTES 32
typedef struct {
    uint8_t b[PKV_KV_KEY_BYTES];
} pkv_kv_key_t;

/* Keys of the prompt's adoptable blocks (at most (n_tokens - 1) / block_tokens, into
 * keys[]): the keys admission looks up. Returns their number. */
uint32_t pkv_kv_prefix_keys(const pkv_kv_t *kv, uint64_t salt, const int32_t *tokens,
                            uint32_t n_tokens, pkv_kv_key_t *keys);

/* How many tokens of the prompt tokens[0..n_tokens) admission under `salt` would adopt
 * from the prefix cache now (whole blocks, at most n_tokens - 1), into *matched. Changes
 * nothing: no references, no LRU order, no query counters. PKV_OK, or PKV_ERR_NOMEM. */
int pkv_kv_prefix_match(pkv_kv_t *kv, uint64_t salt, const int32_t *tokens, uint32_t n_tokens,
                        uint32_t *matched);

/* Paged only (PKV_ERR_UNSUPPORTED on dense): the blocks pkv_kv_prefix_match counts, pinned
 * so that they stay while the caller reads them: *ids (n_ids of them, malloc'd; NULL when
 * none) in prefix order. Unpin with pkv_kv_unpin, then free. PKV_OK or PKV_ERR_NOMEM. */
int pkv_kv_prefix_pin(pkv_kv_t *kv, uint64_t salt, const int32_t *tokens, uint32_t n_tokens,
                      uint32_t **ids, uint32_t *n_ids);

/* Paged only (PKV_ERR_UNSUPPORTED on dense): allocate n blocks outside any sequence
 * (ref 1 each), all or nothing: used by the allocator benchmark and by transfer code that
 * seats raw blocks. */
int pkv_kv_blocks_alloc(pkv_kv_t *kv, uint32_t n, uint32_t *ids);
/* Drop the reference taken by pkv_kv_blocks_alloc (same as pkv_kv_unpin). */
void pkv_kv_blocks_free(pkv_kv_t *kv, const uint32_t *ids, uint32_t n);

/* Paged only (PKV_ERR_UNSUPPORTED on dense, whose buffers are the C heap's): what the
 * kernel holds for the pool's reserved ranges (every rank's), measured in /proc/self/smaps
 * (pkv_prim_range_pages): resident bytes and the part of them in transparent huge pages.
 * Slow (reads every mapping's entry; no lock held): for stats endpoints and benchmarks.
 * PKV_OK with the outputs, PKV_ERR_IO when smaps cannot be read. */
int pkv_kv_pages(const pkv_kv_t *kv, uint64_t *resident_bytes, uint64_t *huge_bytes);

/* ---- a lower tier's hooks (paged only: PKV_ERR_UNSUPPORTED / no-ops on dense) --------
 * A block's bytes leave and enter the pool in one canonical order whatever the ranks:
 * [layer][K, V][KV head][token][dim] (pkv_kv_block_bytes of them, kv->block_bytes). */

/* Called (outside the pool's lock, on the appending thread) each time a block becomes a
 * prefix-cache block: its key, its parent's key and the salt it was computed under. Set
 * once, before any sequence exists; must not block. */
typedef void (*pkv_kv_full_fn)(void *arg, const pkv_kv_key_t *key, const pkv_kv_key_t *parent,
                               uint64_t salt);
void pkv_kv_on_full(pkv_kv_t *kv, pkv_kv_full_fn fn, void *arg);

/* ---- the warm floor's owner (paged; pkv_kv_config_t.warm_max_bytes) ---------------------
 * Called (outside the pool's lock, on the allocating thread) when an allocation leaves the
 * warm floor short of committed empty granules: the owner should call pkv_kv_warm_refill
 * soon, off the allocating path, to commit them again. Set once, before any sequence exists
 * (NULL to clear, after the last); must not block. */
void pkv_kv_on_warm_low(pkv_kv_t *kv, void (*fn)(void *arg), void *arg);
/* Commit the warm floor's missing empty granules, at most max (0: all of them; the pool's
 * lock is not held while the OS commits them): the granules committed. pkv_kv_trim returns
 * a lapsed floor. */
uint32_t pkv_kv_warm_refill(pkv_kv_t *kv, uint32_t max);
/* The OS time (ns) seq's allocations spent committing granules, since it was created:
 * what a request waited for memory (0 when the warm floor or free blocks served it). */
uint64_t pkv_seq_commit_ns(const pkv_seq_t *seq);
/* Pin the live or cached block whose prefix key is key: *id (unpin with pkv_kv_unpin).
 * PKV_ERR_NOTFOUND when no block has it. */
int pkv_kv_key_pin(pkv_kv_t *kv, const pkv_kv_key_t *key, uint32_t *id);
/* Copy block id (pinned by the caller) out to / in from buf, in the canonical order. */
void pkv_kv_block_read(const pkv_kv_t *kv, uint32_t id, void *buf);
void pkv_kv_block_write(pkv_kv_t *kv, uint32_t id, const void *buf);
/* Give blocks ids[0..n) (from pkv_kv_blocks_alloc, written) the prefix keys keys[] under
 * salt: they become prefix-cache blocks (cached once unpinned). A key some block already
 * has is skipped (that block is unchanged; this one stays unkeyed and frees on unpin).
 * Returns how many were keyed. */
uint32_t pkv_kv_blocks_publish(pkv_kv_t *kv, const uint32_t *ids, const pkv_kv_key_t *keys,
                               uint32_t n, uint64_t salt);
/* Forget every prefix-cache block computed under salt: cached ones are evicted, live ones
 * lose their key (no later admission adopts them; they free when released). Returns the
 * blocks forgotten. */
uint64_t pkv_kv_purge_salt(pkv_kv_t *kv, uint64_t salt);

#endif
