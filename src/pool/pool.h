/*
 * pool: subsystem interface of the paged pool for other pagekv modules and tools
 * (not installed). The public face is include/pagekv/kv.h.
 */
#ifndef PKV_POOL_POOL_H
#define PKV_POOL_POOL_H

#include "pagekv/kv.h"

/* Allocate n blocks outside any sequence (ref 1 each), all or nothing: used by the
 * allocator benchmark and by transfer code that seats raw blocks. */
int pkv_pool_blocks_alloc(pkv_kv_t *kv, uint32_t n, uint32_t *ids);
/* Drop the reference taken by pkv_pool_blocks_alloc (same as pkv_kv_unpin). */
void pkv_pool_blocks_free(pkv_kv_t *kv, const uint32_t *ids, uint32_t n);

#endif
