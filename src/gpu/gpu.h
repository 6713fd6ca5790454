/*
 * gpu: an NVIDIA device through CUDA's driver API, loaded at run time, and a device granule
 * arena on its virtual memory API (docs/design/gpu.md). This header includes no CUDA header:
 * a plain build (`make`, no CUDA anywhere) compiles gpu_none.c, whose pkv_gpu_open says
 * why there is no device; `make GPU=1` compiles driver.c and arena.c against cuda.h, and
 * the binary finds libcuda.so.1 when it runs (none there: no device, said why).
 *
 * Device addresses are uint64_t (CUdeviceptr); physical handles are uint64_t
 * (CUmemGenericAllocationHandle). Every call returns PKV_OK or a pkv status; a driver
 * error is logged with its name.
 */
#ifndef PKV_GPU_GPU_H
#define PKV_GPU_GPU_H

#include "pagekv/kv.h"
#include "pagekv/pagekv.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct pkv_gpu pkv_gpu_t;

typedef struct {
    char name[128];         /* cuDeviceGetName */
    int ordinal;            /* the device's index */
    int driver_version;     /* cuDriverGetVersion: 1000 * major + 10 * minor */
    int cc_major, cc_minor; /* compute capability */
    int sm_count;           /* multiprocessors */
    uint64_t total_bytes;   /* cuDeviceTotalMem */
    uint64_t granule_min;   /* cuMemGetAllocationGranularity, MINIMUM */
    uint64_t granule_rec;   /* ... RECOMMENDED */
    char driver_path[256];  /* the library loaded */
} pkv_gpu_info_t;

/* Whether this build has the GPU part (make GPU=1). */
bool pkv_gpu_built(void);
/* Load the driver (driver: a path, or NULL for "libcuda.so.1"), initialize it and retain
 * device `ordinal`'s primary context, current on the calling thread. PKV_ERR_UNSUPPORTED
 * with why (NUL-terminated, cap bytes) when there is no device to use: a build without
 * GPU=1, no driver library, CUDA's stub library, cuInit failing, no such device. Other
 * threads that call into g make the context current themselves (every call does). */
int pkv_gpu_open(const char *driver, int ordinal, pkv_gpu_t **out, char *why, size_t cap);
/* Release the context and unload the driver. NULL is a no-op. */
void pkv_gpu_close(pkv_gpu_t *g);
void pkv_gpu_info(const pkv_gpu_t *g, pkv_gpu_info_t *out);
/* cuMemGetInfo: device-wide free and total bytes. */
int pkv_gpu_mem_info(pkv_gpu_t *g, uint64_t *free_bytes, uint64_t *total_bytes);
/* Wait for every piece of work launched in the context (cuCtxSynchronize). */
int pkv_gpu_sync(pkv_gpu_t *g);
/* Copies and fills of device memory (synchronous): for tests and checks. */
int pkv_gpu_memset(pkv_gpu_t *g, uint64_t va, uint8_t value, uint64_t bytes);
int pkv_gpu_copy_to_host(pkv_gpu_t *g, void *dst, uint64_t va, uint64_t bytes);
int pkv_gpu_copy_from_host(pkv_gpu_t *g, uint64_t va, const void *src, uint64_t bytes);

int pkv_gpu_copy_device(pkv_gpu_t *g, uint64_t dst, uint64_t src, uint64_t bytes);
/* Pin host memory [p, p + bytes) for DMA and map it for the device (cuMemHostRegister,
 * DEVICEMAP): *va is the address kernels write and read it at. Register a staging arena
 * once, never per transfer (registering runs at ~1-2 GB/s). */
int pkv_gpu_host_register(pkv_gpu_t *g, void *p, uint64_t bytes, uint64_t *va);
int pkv_gpu_host_unregister(pkv_gpu_t *g, void *p);
/* Kernels: a module file (cubin or fatbin: build/gpu/pagekv-kernels.fatbin), a function of
 * it, a launch on the default stream (asynchronous; pkv_gpu_sync waits). */
int pkv_gpu_module_load(pkv_gpu_t *g, const char *path, void **module);
void pkv_gpu_module_unload(pkv_gpu_t *g, void *module);
int pkv_gpu_function(pkv_gpu_t *g, void *module, const char *name, void **fn);
int pkv_gpu_launch(pkv_gpu_t *g, void *fn, const uint32_t grid[3], const uint32_t block[3],
                   void **args);

/* ---- the virtual memory API, one call each (the arena below is made of them) ------------
 * Physical memory of `bytes` (a multiple of the granule) on the device: PKV_ERR_NOMEM when
 * the device has no room (CUDA_ERROR_OUT_OF_MEMORY), never a crash. */
int pkv_gpu_phys_create(pkv_gpu_t *g, uint64_t bytes, uint64_t *handle);
int pkv_gpu_phys_release(pkv_gpu_t *g, uint64_t handle);
int pkv_gpu_va_reserve(pkv_gpu_t *g, uint64_t bytes, uint64_t *va);
int pkv_gpu_va_free(pkv_gpu_t *g, uint64_t va, uint64_t bytes);
/* Map a handle at va (offset 0, its whole size); the mapping has no access until set. */
int pkv_gpu_map(pkv_gpu_t *g, uint64_t va, uint64_t bytes, uint64_t handle);
/* Read and write access for this device over [va, va + bytes) (one or several mappings). */
int pkv_gpu_set_access(pkv_gpu_t *g, uint64_t va, uint64_t bytes);
int pkv_gpu_unmap(pkv_gpu_t *g, uint64_t va, uint64_t bytes);

/* ---- a device granule arena ---------------------------------------------------------------
 * One virtual range of n_granules granules (the device's recommended granularity, at least
 * 2 MiB), reserved once: a granule's address never moves. commit maps a physical handle
 * there with access; decommit unmaps it after the context's work has completed (so no
 * launched kernel can still read it) and keeps the handle as a spare or releases it.
 * Handles are created ahead of need: a spare set between spare_min and spare_max,
 * refilled by the arena's thread ("pkv-gpu-spare") when it falls under spare_min, so the
 * hot path of a commit is map + set access; with no spare at hand a commit creates one
 * itself (counted). Thread-safe: one mutex; driver calls run outside it but for the spare
 * set's own bookkeeping. */
typedef struct pkv_gpu_arena pkv_gpu_arena_t;

typedef struct {
    uint32_t n_granules; /* the range; >= 1 */
    uint32_t spare_min;  /* the refill thread keeps at least this many (0: no thread) */
    uint32_t spare_max;  /* a decommitted handle above this many spares is released */
} pkv_gpu_arena_config_t;

typedef struct {
    uint64_t granule_bytes;
    uint64_t reserved_bytes; /* the virtual range */
    uint64_t created_bytes;  /* physical memory held: mapped + spare */
    uint64_t mapped_bytes;
    uint64_t spare_bytes;
    uint64_t commits, decommits;
    uint64_t spare_hits;      /* commits that took a spare */
    uint64_t spare_misses;    /* commits that created their handle */
    uint64_t create_failures; /* cuMemCreate refused (the device is full) */
    uint64_t refills;         /* handles the refill thread created */
} pkv_gpu_arena_stats_t;

/* The arena's granule on a device: its recommended mapping granularity, at least 2 MiB
 * and a multiple of the minimum (0: no device). */
uint64_t pkv_gpu_granule(const pkv_gpu_info_t *in);
int pkv_gpu_arena_create(pkv_gpu_t *g, const pkv_gpu_arena_config_t *cfg, pkv_gpu_arena_t **out);
/* Unmap and release everything, free the range, stop the thread. NULL is a no-op. */
void pkv_gpu_arena_destroy(pkv_gpu_arena_t *a);
uint64_t pkv_gpu_arena_base(const pkv_gpu_arena_t *a);
/* PKV_ERR_NOMEM: no spare and the device is full (nothing changed); PKV_ERR_INVALID: out of
 * range or already mapped. */
int pkv_gpu_arena_commit(pkv_gpu_arena_t *a, uint32_t granule);
int pkv_gpu_arena_decommit(pkv_gpu_arena_t *a, uint32_t granule);
bool pkv_gpu_arena_mapped(pkv_gpu_arena_t *a, uint32_t granule);
/* Block until the spare set holds spare_min handles or creation fails (tests, benches). */
int pkv_gpu_arena_fill_spares(pkv_gpu_arena_t *a);
/* Release every spare handle (memory back to the device); the refill thread makes no new
 * one until the next commit or fill_spares. */
void pkv_gpu_arena_trim(pkv_gpu_arena_t *a);
void pkv_gpu_arena_stats(pkv_gpu_arena_t *a, pkv_gpu_arena_stats_t *out);

/* ---- a paged pool's storage in device memory (kv_storage.c) ------------------------------
 * pkv_kv_storage_t (include/pagekv/kv.h, docs/design/pool.md "Storage") over arenas: each
 * range a pool reserves is an arena of device granules (its spare set and refill thread
 * as configured), a commit maps the granules of [addr, addr + bytes), a decommit waits
 * for the context's work and unmaps them (spares kept as the arena's config says), copy is
 * a device-to-device copy. A pool's block addresses are then device addresses, which the
 * pool never dereferences; strides are whole device granules. One storage can serve
 * several pools; it must outlive them. */
typedef struct pkv_gpu_kv_storage pkv_gpu_kv_storage_t;
/* spares: spare_min / spare_max of each range's arena (n_granules is ignored). */
int pkv_gpu_kv_storage_create(pkv_gpu_t *g, const pkv_gpu_arena_config_t *spares,
                              pkv_gpu_kv_storage_t **out);
/* Every range must have been released (its pools destroyed). NULL is a no-op. */
void pkv_gpu_kv_storage_destroy(pkv_gpu_kv_storage_t *s);
const pkv_kv_storage_t *pkv_gpu_kv_storage(const pkv_gpu_kv_storage_t *s);
/* The ranges' arena counters summed (granule_bytes: the device granule). */
void pkv_gpu_kv_storage_stats(pkv_gpu_kv_storage_t *s, pkv_gpu_arena_stats_t *out);
/* Release every range's spare handles (pkv_gpu_arena_trim). Not concurrent with a pool's
 * destroy on this storage (its ranges' release). */
void pkv_gpu_kv_storage_trim(pkv_gpu_kv_storage_t *s);

/* The driver's used bytes since free0 (cuMemGetInfo's free then) against counters st:
 * |used - created| over the allowance, 2 % of created or one granule, whichever is more
 * (<= 1: they agree); NAN when the driver cannot say. */
double pkv_gpu_driver_gap(pkv_gpu_t *g, uint64_t free0, const pkv_gpu_arena_stats_t *st);

/* How the kernels below address a paged pool's blocks (one rank, one layer): the pool puts
 * a granule's blocks side by side per (layer, K|V, head) (docs/design/pool.md), so token t
 * of head h (rank-local) in block b lies at k_base + pkv_gpu_pool_index(v, b) *
 * block_stride + h * head_stride + (t % block_tokens) * row bytes (V: v_base): the
 * kernels' table holds indices, not block ids. Derived from the pool's own block
 * addresses (pkv_kv_block_head_rank); PKV_ERR_UNSUPPORTED for a dense cache or a layout
 * whose granule stride is not whole pieces. */
typedef struct {
    uint64_t k_base, v_base; /* block 0's piece of the rank's first head, K and V */
    uint64_t block_stride;   /* one piece: block_tokens rows of one head */
    uint64_t head_stride;    /* between the rank's heads */
    uint32_t bpg;            /* blocks per granule */
    uint32_t per_granule;    /* indices per granule: its stride in pieces */
    uint32_t kv_heads;       /* the rank's heads */
} pkv_gpu_pool_view_t;
int pkv_gpu_pool_view(const pkv_kv_t *kv, uint32_t rank, uint32_t layer, pkv_gpu_pool_view_t *out);
static inline uint32_t pkv_gpu_pool_index(const pkv_gpu_pool_view_t *v, uint32_t block)
{
    return block / v->bpg * v->per_granule + block % v->bpg;
}

/* ---- attention kernels (src/gpu/kernels.cu) ------------------------------------------------
 * Paged decode attention, bf16 K/V: one query token per sequence, G query heads per KV
 * head served from one read of K and V, online softmax in fp32, the sequence split across
 * CTAs when there are few sequences x KV heads for the SMs, the splits merged in order. */
typedef struct pkv_gpu_attn pkv_gpu_attn_t;
int pkv_gpu_attn_load(pkv_gpu_t *g, const char *fatbin, pkv_gpu_attn_t **out);
void pkv_gpu_attn_unload(pkv_gpu_attn_t *a);

typedef struct {
    uint64_t q;    /* device: float [n_seq][kv_heads * group][head_dim] */
    uint64_t out;  /* device: float, the same shape */
    uint64_t part; /* device scratch: float [n_seq * kv_heads * group][n_split][head_dim + 2] */
    /* Token t of sequence s, KV head h lies at k_base + table[s * max_blocks + t / block_tokens]
     * * block_stride + h * head_stride + (t % block_tokens) * head_dim * 2 (V: v_base). */
    uint64_t k_base, v_base, block_stride, head_stride;
    uint64_t table; /* device: uint32 [n_seq][max_blocks] */
    uint64_t lens;  /* device: uint32 [n_seq], each >= 1 */
    uint32_t max_blocks, n_seq, block_tokens, kv_heads, group, head_dim;
    float scale;
    uint32_t n_split; /* >= 1: pkv_gpu_decode_splits */
} pkv_gpu_decode_t;

/* Splits for n_seq x kv_heads CTAs to give each SM ~8 CTAs, at least 128 tokens each. */
uint32_t pkv_gpu_decode_splits(const pkv_gpu_attn_t *a, uint32_t n_seq, uint32_t kv_heads,
                               uint32_t max_len);
/* Launch (asynchronous): PKV_ERR_INVALID for a head_dim other than 64 / 128, a group other
 * than 1, 2, 4, 8, or n_split 0. */
int pkv_gpu_decode_attn(pkv_gpu_attn_t *a, const pkv_gpu_decode_t *p);

/* Prefill attention for a chunk of one sequence (asynchronous): query rows i = 0..n_seq-1
 * at positions p0 + i, each attending causally to positions [0, p0 + i] through the one
 * block table `table`. It runs the decode kernel with one row per query (lens[i] = p0 + i +
 * 1, filled by the caller; max_blocks 0: every row reads the same table): correct and
 * bitwise equal to decoding each position, but K/V is read once per query row (no tiling
 * over queries yet). The fields are pkv_gpu_decode_t's; max_blocks is ignored. */
int pkv_gpu_prefill_attn(pkv_gpu_attn_t *a, const pkv_gpu_decode_t *p);

/* KV write (asynchronous): n_tokens of one sequence from position p0, float K and V
 * [n_tokens][kv_heads][head_dim] on the device, into its blocks (table: that sequence's
 * uint32 block ids) as bf16 rounded to nearest even, the decode kernel's addressing. */
typedef struct {
    uint64_t k, v; /* device: float sources */
    uint64_t k_base, v_base, block_stride, head_stride;
    uint64_t table; /* device: uint32 block ids of the sequence */
    uint32_t p0, n_tokens, block_tokens, kv_heads, head_dim;
} pkv_gpu_kv_write_t;
int pkv_gpu_kv_write(pkv_gpu_attn_t *a, const pkv_gpu_kv_write_t *p);

/* Staging (asynchronous): n pieces of piece_bytes (a multiple of 16) each, piece i at
 * pool + off[i] (off: device uint64 offsets), gathered into buf in order, or scattered from
 * it; buf is typically a registered host arena's device address (pkv_gpu_host_register). */
int pkv_gpu_stage_gather(pkv_gpu_attn_t *a, uint64_t pool, uint64_t buf, uint64_t off, uint32_t n,
                         uint32_t piece_bytes);
int pkv_gpu_stage_scatter(pkv_gpu_attn_t *a, uint64_t pool, uint64_t buf, uint64_t off, uint32_t n,
                          uint32_t piece_bytes);

#endif
