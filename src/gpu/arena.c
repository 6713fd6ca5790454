/*
 * gpu: the device granule arena (gpu.h, docs/design/gpu.md). Built on the gpu.h calls
 * alone, so it compiles in every build (without GPU=1 no arena can be made: there is no
 * device). Locking: a->mu guards the granules' states, the spare set, the counters and the
 * refill thread's flags; no driver call is made under it. A granule being committed or
 * decommitted is BUSY, so two callers never map or unmap one granule at once.
 */
#include "gpu/gpu.h"

#include "core/core.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

enum { G_FREE = 0, G_BUSY = 1, G_MAPPED = 2 };

struct pkv_gpu_arena {
    pkv_gpu_t *g;
    pkv_gpu_arena_config_t cfg;
    uint64_t gb;   /* granule bytes */
    uint64_t base; /* the reserved range */
    uint8_t *state;
    uint64_t *handle; /* [n_granules]: the mapped granule's handle */
    uint64_t *spare;  /* [spare_cap] */
    uint32_t n_spare, spare_cap, creating;
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* the refill thread: below spare_min, or stop */
    pthread_cond_t fill_cv; /* fill_spares: a refill ended */
    pthread_t thread;
    bool thread_started, stop, refill_failed;
    bool paused; /* a trim gave the spares back: no refill until the next commit or fill */
    pkv_gpu_arena_stats_t st;
};

/* The refill thread: creates handles while the spare set is under spare_min; after a
 * failed creation (the device is full) it waits for a decommit, a trim or fill_spares. */
static void *refill_main(void *arg)
{
    pkv_gpu_arena_t *a = arg;
    pthread_setname_np(pthread_self(), "pkv-gpu-spare");
    pthread_mutex_lock(&a->mu);
    for (;;) {
        while (!a->stop &&
               (a->refill_failed || a->paused || a->n_spare + a->creating >= a->cfg.spare_min))
            pthread_cond_wait(&a->cv, &a->mu);
        if (a->stop) break;
        a->creating++;
        pthread_mutex_unlock(&a->mu);
        uint64_t h = 0;
        int rc = pkv_gpu_phys_create(a->g, a->gb, &h);
        pthread_mutex_lock(&a->mu);
        a->creating--;
        if (rc == PKV_OK) {
            a->spare[a->n_spare++] = h;
            a->st.created_bytes += a->gb;
            a->st.refills++;
        } else {
            a->st.create_failures++;
            a->refill_failed = true;
        }
        pthread_cond_broadcast(&a->fill_cv);
    }
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

int pkv_gpu_arena_create(pkv_gpu_t *g, const pkv_gpu_arena_config_t *cfg, pkv_gpu_arena_t **out)
{
    if (!g || !cfg || !out || cfg->n_granules == 0 || cfg->spare_min > cfg->spare_max)
        return PKV_ERR_INVALID;
    pkv_gpu_info_t in;
    pkv_gpu_info(g, &in);
    uint64_t gb = pkv_gpu_granule(&in);
    if (!gb) return PKV_ERR_UNSUPPORTED;
    pkv_gpu_arena_t *a = calloc(1, sizeof(*a));
    if (!a) return PKV_ERR_NOMEM;
    a->g = g;
    a->cfg = *cfg;
    a->gb = gb;
    a->spare_cap = cfg->spare_max + 1;
    a->state = calloc(cfg->n_granules, 1);
    a->handle = calloc(cfg->n_granules, sizeof(uint64_t));
    a->spare = calloc(a->spare_cap, sizeof(uint64_t));
    int rc = a->state && a->handle && a->spare ? PKV_OK : PKV_ERR_NOMEM;
    if (!rc) rc = pkv_gpu_va_reserve(g, gb * cfg->n_granules, &a->base);
    if (rc) {
        free(a->state);
        free(a->handle);
        free(a->spare);
        free(a);
        return rc;
    }
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->cv, NULL);
    pthread_cond_init(&a->fill_cv, NULL);
    a->st.granule_bytes = gb;
    a->st.reserved_bytes = gb * cfg->n_granules;
    if (cfg->spare_min && pthread_create(&a->thread, NULL, refill_main, a) == 0)
        a->thread_started = true;
    *out = a;
    return PKV_OK;
}

uint64_t pkv_gpu_granule(const pkv_gpu_info_t *in)
{
    if (!in->granule_min) return 0;
    uint64_t gb = PKV_MAX(in->granule_rec, in->granule_min);
    while (gb < (2u << 20)) gb += in->granule_min; /* at least 2 MiB, a multiple of the minimum */
    return gb;
}

uint64_t pkv_gpu_arena_base(const pkv_gpu_arena_t *a)
{
    return a->base;
}

/* Take a spare (true) or note a miss; wakes the refill thread under spare_min. */
static bool take_spare_locked(pkv_gpu_arena_t *a, uint64_t *h)
{
    bool hit = a->n_spare > 0;
    if (hit) *h = a->spare[--a->n_spare];
    a->paused = false;
    if (a->thread_started && a->n_spare + a->creating < a->cfg.spare_min)
        pthread_cond_signal(&a->cv);
    return hit;
}

/* A handle no granule holds any more: a spare, or released past spare_max. */
static void put_handle(pkv_gpu_arena_t *a, uint64_t h)
{
    pthread_mutex_lock(&a->mu);
    bool keep = a->n_spare < a->cfg.spare_max;
    if (keep) a->spare[a->n_spare++] = h;
    a->refill_failed = false; /* memory came back: the thread may try again */
    if (!keep) a->st.created_bytes -= a->gb;
    if (a->thread_started && a->n_spare + a->creating < a->cfg.spare_min)
        pthread_cond_signal(&a->cv);
    pthread_mutex_unlock(&a->mu);
    if (!keep) pkv_gpu_phys_release(a->g, h);
}

int pkv_gpu_arena_commit(pkv_gpu_arena_t *a, uint32_t i)
{
    uint64_t h = 0;
    pthread_mutex_lock(&a->mu);
    if (i >= a->cfg.n_granules || a->state[i] != G_FREE) {
        pthread_mutex_unlock(&a->mu);
        return PKV_ERR_INVALID;
    }
    a->state[i] = G_BUSY;
    bool hit = take_spare_locked(a, &h);
    if (hit)
        a->st.spare_hits++;
    else
        a->st.spare_misses++;
    pthread_mutex_unlock(&a->mu);
    int rc = PKV_OK;
    bool have = hit;
    if (!hit) {
        rc = pkv_gpu_phys_create(a->g, a->gb, &h);
        have = rc == PKV_OK;
        pthread_mutex_lock(&a->mu);
        if (rc)
            a->st.create_failures++;
        else
            a->st.created_bytes += a->gb;
        pthread_mutex_unlock(&a->mu);
    }
    uint64_t va = a->base + (uint64_t)i * a->gb;
    if (!rc && (rc = pkv_gpu_map(a->g, va, a->gb, h)) == PKV_OK &&
        (rc = pkv_gpu_set_access(a->g, va, a->gb)) != PKV_OK)
        pkv_gpu_unmap(a->g, va, a->gb);
    if (rc && have) put_handle(a, h); /* mapping failed: the handle is a spare again */
    pthread_mutex_lock(&a->mu);
    a->state[i] = rc ? G_FREE : G_MAPPED;
    if (!rc) {
        a->handle[i] = h;
        a->st.mapped_bytes += a->gb;
        a->st.commits++;
    }
    pthread_mutex_unlock(&a->mu);
    return rc;
}

int pkv_gpu_arena_decommit(pkv_gpu_arena_t *a, uint32_t i)
{
    pthread_mutex_lock(&a->mu);
    if (i >= a->cfg.n_granules || a->state[i] != G_MAPPED) {
        pthread_mutex_unlock(&a->mu);
        return PKV_ERR_INVALID;
    }
    a->state[i] = G_BUSY;
    uint64_t h = a->handle[i];
    pthread_mutex_unlock(&a->mu);
    /* No launched kernel may still read it: the context's work completes first. */
    int rc = pkv_gpu_sync(a->g);
    if (!rc) rc = pkv_gpu_unmap(a->g, a->base + (uint64_t)i * a->gb, a->gb);
    pthread_mutex_lock(&a->mu);
    a->state[i] = rc ? G_MAPPED : G_FREE;
    if (!rc) {
        a->handle[i] = 0;
        a->st.mapped_bytes -= a->gb;
        a->st.decommits++;
    }
    pthread_mutex_unlock(&a->mu);
    if (!rc) put_handle(a, h);
    return rc;
}

bool pkv_gpu_arena_mapped(pkv_gpu_arena_t *a, uint32_t i)
{
    pthread_mutex_lock(&a->mu);
    bool m = i < a->cfg.n_granules && a->state[i] == G_MAPPED;
    pthread_mutex_unlock(&a->mu);
    return m;
}

int pkv_gpu_arena_fill_spares(pkv_gpu_arena_t *a)
{
    pthread_mutex_lock(&a->mu);
    a->refill_failed = false;
    a->paused = false;
    pthread_cond_signal(&a->cv);
    while (a->thread_started && !a->refill_failed && a->n_spare < a->cfg.spare_min)
        pthread_cond_wait(&a->fill_cv, &a->mu);
    int rc = a->n_spare >= a->cfg.spare_min ? PKV_OK : PKV_ERR_NOMEM;
    pthread_mutex_unlock(&a->mu);
    return rc;
}

void pkv_gpu_arena_trim(pkv_gpu_arena_t *a)
{
    pthread_mutex_lock(&a->mu);
    a->paused = true;                                           /* the refill thread stops here */
    while (a->creating) pthread_cond_wait(&a->fill_cv, &a->mu); /* one landing is released too */
    pthread_mutex_unlock(&a->mu);
    for (;;) {
        uint64_t h;
        pthread_mutex_lock(&a->mu);
        bool any = a->n_spare > 0;
        if (any) {
            h = a->spare[--a->n_spare];
            a->st.created_bytes -= a->gb;
        }
        pthread_mutex_unlock(&a->mu);
        if (!any) return;
        pkv_gpu_phys_release(a->g, h);
    }
}

void pkv_gpu_arena_stats(pkv_gpu_arena_t *a, pkv_gpu_arena_stats_t *out)
{
    pthread_mutex_lock(&a->mu);
    *out = a->st;
    out->spare_bytes = (uint64_t)a->n_spare * a->gb;
    pthread_mutex_unlock(&a->mu);
}

void pkv_gpu_arena_destroy(pkv_gpu_arena_t *a)
{
    if (!a) return;
    if (a->thread_started) {
        pthread_mutex_lock(&a->mu);
        a->stop = true;
        pthread_cond_signal(&a->cv);
        pthread_mutex_unlock(&a->mu);
        pthread_join(a->thread, NULL);
    }
    pkv_gpu_sync(a->g);
    for (uint32_t i = 0; i < a->cfg.n_granules; i++) {
        if (a->state[i] != G_MAPPED) continue;
        pkv_gpu_unmap(a->g, a->base + (uint64_t)i * a->gb, a->gb);
        pkv_gpu_phys_release(a->g, a->handle[i]);
    }
    for (uint32_t s = 0; s < a->n_spare; s++) pkv_gpu_phys_release(a->g, a->spare[s]);
    pkv_gpu_va_free(a->g, a->base, a->st.reserved_bytes);
    pthread_cond_destroy(&a->fill_cv);
    pthread_cond_destroy(&a->cv);
    pthread_mutex_destroy(&a->mu);
    free(a->spare);
    free(a->handle);
    free(a->state);
    free(a);
}
