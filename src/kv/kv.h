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

#endif
