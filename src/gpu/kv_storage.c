/*
 * gpu/kv_storage: a paged pool's storage in a device's memory (gpu.h, docs/design/gpu.md
 * "The pool on the device"). Each range the pool reserves is an arena (arena.c): addresses
 * reserved once, granules mapped on commit from the arena's spare set, unmapped on decommit
 * after the context's launched work has finished. The pool computes with the device
 * addresses and never dereferences them; its one byte operation, the copy-on-write of a
 * shared partial block, is a device-to-device copy here.
 */
#include "gpu/gpu.h"

#include "core/core.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define KS_MAX_RANGES PKV_KV_MAX_TP

struct pkv_gpu_kv_storage {
    pkv_gpu_t *g;
    pkv_gpu_arena_config_t spares;
    uint64_t gb;        /* the device granule: every stride is whole ones */
    pthread_mutex_t mu; /* the ranges' table (no driver call is made under it) */
    pkv_gpu_arena_t *arena[KS_MAX_RANGES];
    uint64_t base[KS_MAX_RANGES], bytes[KS_MAX_RANGES];
    pkv_kv_storage_t ops;
};

/* The arena holding [va, va + bytes), and va's granule in it; NULL when none does. */
static pkv_gpu_arena_t *ks_find(pkv_gpu_kv_storage_t *s, uint64_t va, size_t bytes, uint32_t *i0)
{
    pkv_gpu_arena_t *a = NULL;
    pthread_mutex_lock(&s->mu);
    for (uint32_t r = 0; r < KS_MAX_RANGES && !a; r++)
        if (s->arena[r] && va >= s->base[r] && va + bytes <= s->base[r] + s->bytes[r] &&
            (va - s->base[r]) % s->gb == 0) {
            a = s->arena[r];
            *i0 = (uint32_t)((va - s->base[r]) / s->gb);
        }
    pthread_mutex_unlock(&s->mu);
    return a;
}

static size_t ks_stride(void *ctx, size_t used)
{
    pkv_gpu_kv_storage_t *s = ctx;
    return (used + s->gb - 1) / s->gb * s->gb;
}

static int ks_reserve(void *ctx, size_t bytes, void **addr)
{
    pkv_gpu_kv_storage_t *s = ctx;
    if (!bytes || bytes % s->gb || bytes / s->gb > UINT32_MAX) return PKV_ERR_INVALID;
    pkv_gpu_arena_config_t c = s->spares;
    c.n_granules = (uint32_t)(bytes / s->gb);
    pkv_gpu_arena_t *a = NULL;
    int rc = pkv_gpu_arena_create(s->g, &c, &a);
    if (rc) return rc;
    pthread_mutex_lock(&s->mu);
    uint32_t r = 0;
    while (r < KS_MAX_RANGES && s->arena[r]) r++;
    if (r < KS_MAX_RANGES) {
        s->arena[r] = a;
        s->base[r] = pkv_gpu_arena_base(a);
        s->bytes[r] = bytes;
        *addr = (void *)(uintptr_t)s->base[r];
    }
    pthread_mutex_unlock(&s->mu);
    if (r == KS_MAX_RANGES) { /* a pool has at most PKV_KV_MAX_TP ranges: several pools */
        pkv_gpu_arena_destroy(a);
        return PKV_ERR_NOMEM;
    }
    return PKV_OK;
}

static void ks_release(void *ctx, void *addr, size_t bytes)
{
    pkv_gpu_kv_storage_t *s = ctx;
    pkv_gpu_arena_t *a = NULL;
    pthread_mutex_lock(&s->mu);
    for (uint32_t r = 0; r < KS_MAX_RANGES; r++)
        if (s->arena[r] && s->base[r] == (uintptr_t)addr && s->bytes[r] == bytes) {
            a = s->arena[r];
            s->arena[r] = NULL;
            break;
        }
    pthread_mutex_unlock(&s->mu);
    PKV_ASSERT(a); /* the pool releases what it reserved, whole */
    pkv_gpu_arena_destroy(a);
}

static int ks_commit(void *ctx, void *addr, size_t bytes, bool huge)
{
    pkv_gpu_kv_storage_t *s = ctx;
    (void)huge; /* device granules are always large */
    uint32_t i0 = 0, n = (uint32_t)(bytes / s->gb);
    pkv_gpu_arena_t *a = ks_find(s, (uintptr_t)addr, bytes, &i0);
    if (!a || bytes % s->gb) return PKV_ERR_INVALID;
    for (uint32_t k = 0; k < n; k++) {
        int rc = pkv_gpu_arena_commit(a, i0 + k);
        if (rc == PKV_OK) continue;
        while (k-- > 0) pkv_gpu_arena_decommit(a, i0 + k);
        return rc;
    }
    return PKV_OK;
}

static void ks_decommit(void *ctx, void *addr, size_t bytes)
{
    pkv_gpu_kv_storage_t *s = ctx;
    uint32_t i0 = 0;
    pkv_gpu_arena_t *a = ks_find(s, (uintptr_t)addr, bytes, &i0);
    PKV_ASSERT(a && bytes % s->gb == 0);
    for (uint32_t k = 0; k < bytes / s->gb; k++) {
        int rc = pkv_gpu_arena_decommit(a, i0 + k);
        if (rc) /* the arena keeps it mapped and counted: its next commit is refused */
            PKV_LOGE("gpu", "decommit of granule %u at %#llx failed (%s): it stays mapped", i0 + k,
                     (unsigned long long)(uintptr_t)addr, pkv_status_str(rc));
    }
}

static int ks_copy(void *ctx, void *dst, const void *src, size_t bytes)
{
    pkv_gpu_kv_storage_t *s = ctx;
    return pkv_gpu_copy_device(s->g, (uintptr_t)dst, (uintptr_t)src, bytes);
}

int pkv_gpu_kv_storage_create(pkv_gpu_t *g, const pkv_gpu_arena_config_t *spares,
                              pkv_gpu_kv_storage_t **out)
{
    if (!g || !spares || !out || spares->spare_min > spares->spare_max) return PKV_ERR_INVALID;
    pkv_gpu_info_t in;
    pkv_gpu_info(g, &in);
    uint64_t gb = pkv_gpu_granule(&in);
    if (!gb) return PKV_ERR_UNSUPPORTED;
    pkv_gpu_kv_storage_t *s = calloc(1, sizeof(*s));
    if (!s) return PKV_ERR_NOMEM;
    s->g = g;
    s->spares = *spares;
    s->gb = gb;
    pthread_mutex_init(&s->mu, NULL);
    s->ops = (pkv_kv_storage_t){.name = "cuda",
                                .stride = ks_stride,
                                .reserve = ks_reserve,
                                .release = ks_release,
                                .commit = ks_commit,
                                .decommit = ks_decommit,
                                .copy = ks_copy,
                                .ctx = s};
    *out = s;
    return PKV_OK;
}

void pkv_gpu_kv_storage_destroy(pkv_gpu_kv_storage_t *s)
{
    if (!s) return;
    for (uint32_t r = 0; r < KS_MAX_RANGES; r++) PKV_ASSERT(!s->arena[r]);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

const pkv_kv_storage_t *pkv_gpu_kv_storage(const pkv_gpu_kv_storage_t *s)
{
    return &s->ops;
}

void pkv_gpu_kv_storage_stats(pkv_gpu_kv_storage_t *s, pkv_gpu_arena_stats_t *out)
{
    *out = (pkv_gpu_arena_stats_t){.granule_bytes = s->gb};
    pthread_mutex_lock(&s->mu);
    for (uint32_t r = 0; r < KS_MAX_RANGES; r++) {
        if (!s->arena[r]) continue;
        pkv_gpu_arena_stats_t a;
        pkv_gpu_arena_stats(s->arena[r], &a);
        out->reserved_bytes += a.reserved_bytes;
        out->created_bytes += a.created_bytes;
        out->mapped_bytes += a.mapped_bytes;
        out->spare_bytes += a.spare_bytes;
        out->commits += a.commits;
        out->decommits += a.decommits;
        out->spare_hits += a.spare_hits;
        out->spare_misses += a.spare_misses;
        out->create_failures += a.create_failures;
        out->refills += a.refills;
    }
    pthread_mutex_unlock(&s->mu);
}

void pkv_gpu_kv_storage_trim(pkv_gpu_kv_storage_t *s)
{
    pkv_gpu_arena_t *a[KS_MAX_RANGES];
    pthread_mutex_lock(&s->mu);
    memcpy(a, s->arena, sizeof(a));
    pthread_mutex_unlock(&s->mu);
    for (uint32_t r = 0; r < KS_MAX_RANGES; r++) /* the driver outside the lock */
        if (a[r]) pkv_gpu_arena_trim(a[r]);
}

double pkv_gpu_driver_gap(pkv_gpu_t *g, uint64_t free0, const pkv_gpu_arena_stats_t *st)
{
    uint64_t free1, total;
    if (pkv_gpu_mem_info(g, &free1, &total)) return NAN;
    double used = (double)free0 - (double)free1, want = (double)st->created_bytes;
    double allow = want * 0.02 > (double)st->granule_bytes ? want * 0.02 : st->granule_bytes;
    return fabs(used - want) / allow;
}

int pkv_gpu_pool_view(const pkv_kv_t *kv, uint32_t rank, uint32_t layer, pkv_gpu_pool_view_t *out)
{
    pkv_kv_rank_t rk;
    const pkv_geometry_t *g = pkv_kv_geometry(kv);
    if (pkv_kv_backend(kv) != PKV_BACKEND_PAGED || pkv_kv_rank(kv, rank, &rk) || layer >= g->layers)
        return PKV_ERR_UNSUPPORTED;
    pkv_kv_stats_t st;
    pkv_kv_stats((pkv_kv_t *)kv, &st);
    uint64_t piece = (uint64_t)g->block_tokens * pkv_dtype_row_bytes(g->dtype, g->head_dim);
    uintptr_t k0 = (uintptr_t)pkv_kv_block_head_rank(kv, rank, 0, layer, 0, rk.head_lo);
    uintptr_t v0 = (uintptr_t)pkv_kv_block_head_rank(kv, rank, 0, layer, 1, rk.head_lo);
    uintptr_t h1 = rk.head_n > 1
                       ? (uintptr_t)pkv_kv_block_head_rank(kv, rank, 0, layer, 0, rk.head_lo + 1)
                       : k0;
    /* Blocks of a granule are a piece apart; the first that is not opens the next. */
    uint32_t cap = (uint32_t)PKV_MIN(st.blocks_capacity, UINT32_MAX), bpg = 1;
    while (bpg < cap && (uintptr_t)pkv_kv_block_head_rank(kv, rank, bpg, layer, 0, rk.head_lo) ==
                            k0 + bpg * piece)
        bpg++;
    uint64_t gstride =
        bpg < cap ? (uintptr_t)pkv_kv_block_head_rank(kv, rank, bpg, layer, 0, rk.head_lo) - k0
                  : (uint64_t)bpg * piece;
    if (!k0 || gstride % piece || (uint64_t)PKV_DIV_UP(cap, bpg) * (gstride / piece) > UINT32_MAX)
        return PKV_ERR_UNSUPPORTED;
    *out = (pkv_gpu_pool_view_t){.k_base = k0,
                                 .v_base = v0,
                                 .block_stride = piece,
                                 .head_stride = h1 - k0,
                                 .bpg = bpg,
                                 .per_granule = (uint32_t)(gstride / piece),
                                 .kv_heads = rk.head_n};
    return PKV_OK;
}
