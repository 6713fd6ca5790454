/*
 * tpool: fork-join pool (see tpool.h).
 *
 * Protocol. The owner publishes a job (fn, arg, n_tasks, next = 0, active = workers)
 * and then bumps `gen` (seq_cst). Workers notice the new generation either while
 * spinning briefly after their last job or on the `wake` condvar, take tasks from
 * `next` until it runs past n_tasks, and decrement `active`; the worker that brings it
 * to zero signals `done`. The owner takes tasks too and then waits for active == 0, so
 * no worker can still be looking at a job when the next one is published.
 *
 * Lost wake-ups: a worker about to sleep increments `sleeping` and re-checks `gen`
 * under `lock`; the owner stores `gen` and then reads `sleeping` (both seq_cst), and
 * broadcasts under `lock` when anyone sleeps. At least one side sees the other.
 *
 * lock guards: the condvar waits (no data of its own; gen/stop/active are atomics so
 * that spinning needs no lock).
 */
#include "model/tpool.h"

#include "core/core.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TPOOL_PAUSE() _mm_pause()
#else
#define TPOOL_PAUSE() ((void)0)
#endif

/* Spin iterations (each a pause, ~20 ns on Zen 3) before a worker sleeps or the owner
 * blocks: long enough to bridge the serial gaps between the parallel loops of one
 * forward pass (tens of microseconds), short enough not to burn a shared core. */
#define TPOOL_SPIN 2000

struct model_tpool {
    uint32_t n_workers;
    pthread_t *threads;
    char name[16];
    pthread_mutex_t lock;
    pthread_cond_t wake; /* workers: a new generation or stop */
    pthread_cond_t done; /* owner: active reached 0 */
    _Atomic uint64_t gen;
    _Atomic bool stop;
    _Atomic uint32_t sleeping;
    _Atomic uint32_t active;
    _Atomic uint32_t next;
    /* The current job: written by the owner before gen is bumped, read-only after. */
    model_tpool_fn fn;
    void *arg;
    uint32_t n_tasks;
    pid_t pid; /* creator: a forked child has no workers and runs tasks inline */
};

struct worker_start {
    model_tpool_t *pool;
    uint32_t index;
};

static void take_tasks(model_tpool_t *p, uint32_t thread)
{
    for (;;) {
        uint32_t i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n_tasks) break;
        p->fn(p->arg, i, thread);
    }
}

static void *worker_main(void *argp)
{
    struct worker_start *ws = argp;
    model_tpool_t *p = ws->pool;
    uint32_t ws_index = ws->index;
    char tname[16];
    snprintf(tname, sizeof(tname), "%.10s-%u", p->name, ws->index);
    pthread_setname_np(pthread_self(), tname);
    free(ws);

    uint64_t seen = 0;
    for (;;) {
        uint64_t g = atomic_load(&p->gen);
        for (int s = 0; g == seen && s < TPOOL_SPIN && !atomic_load(&p->stop); s++) {
            TPOOL_PAUSE();
            g = atomic_load(&p->gen);
        }
        if (g == seen) {
            pthread_mutex_lock(&p->lock);
            atomic_fetch_add(&p->sleeping, 1);
            while ((g = atomic_load(&p->gen)) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->wake, &p->lock);
            atomic_fetch_sub(&p->sleeping, 1);
            pthread_mutex_unlock(&p->lock);
        }
        if (g == seen && atomic_load(&p->stop)) break;
        seen = g;
        take_tasks(p, ws_index);
        if (atomic_fetch_sub(&p->active, 1) == 1) {
            pthread_mutex_lock(&p->lock);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->lock);
        }
    }
    return NULL;
}

/* Tell the started workers to exit and join them. */
static void stop_workers(model_tpool_t *p)
{
    atomic_store(&p->stop, true);
    pthread_mutex_lock(&p->lock);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (uint32_t i = 0; i < p->n_workers; i++) pthread_join(p->threads[i], NULL);
}

int model_tpool_create(uint32_t n_threads, const char *name, model_tpool_t **out)
{
    if (!out || n_threads > 256) return PKV_ERR_INVALID;
    model_tpool_t *p = calloc(1, sizeof(*p));
    if (!p) return PKV_ERR_NOMEM;
    snprintf(p->name, sizeof(p->name), "%s", name ? name : "pkv-pool");
    p->pid = getpid();
    uint32_t nw = n_threads > 1 ? n_threads - 1 : 0;
    int rc = PKV_ERR_NOMEM;
    if (nw && !(p->threads = calloc(nw, sizeof(pthread_t)))) goto fail_alloc;
    if (pthread_mutex_init(&p->lock, NULL)) goto fail_mutex;
    if (pthread_cond_init(&p->wake, NULL)) goto fail_wake;
    if (pthread_cond_init(&p->done, NULL)) goto fail_done;
    for (uint32_t i = 0; i < nw; i++) {
        struct worker_start *ws = malloc(sizeof(*ws));
        if (!ws) goto fail_threads;
        ws->pool = p;
        ws->index = i + 1;
        if (pthread_create(&p->threads[i], NULL, worker_main, ws)) {
            free(ws);
            rc = PKV_ERR_IO;
            goto fail_threads;
        }
        p->n_workers++;
    }
    *out = p;
    return PKV_OK;

fail_threads:
    stop_workers(p);
    pthread_cond_destroy(&p->done);
fail_done:
    pthread_cond_destroy(&p->wake);
fail_wake:
    pthread_mutex_destroy(&p->lock);
fail_mutex:
    free(p->threads);
fail_alloc:
    free(p);
    return rc;
}

void model_tpool_destroy(model_tpool_t *p)
{
    if (!p) return;
    if (getpid() != p->pid) p->n_workers = 0; /* forked child: the threads are not ours */
    stop_workers(p);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->lock);
    free(p->threads);
    free(p);
}

uint32_t model_tpool_threads(const model_tpool_t *p)
{
    return p->n_workers + 1;
}

void model_tpool_run(model_tpool_t *p, model_tpool_fn fn, void *arg, uint32_t n_tasks)
{
    if (n_tasks == 0) return;
    if (p->n_workers == 0 || n_tasks == 1 || getpid() != p->pid) {
        for (uint32_t i = 0; i < n_tasks; i++) fn(arg, i, 0);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    p->n_tasks = n_tasks;
    atomic_store(&p->next, 0);
    atomic_store(&p->active, p->n_workers);
    atomic_fetch_add(&p->gen, 1);
    if (atomic_load(&p->sleeping) > 0) {
        pthread_mutex_lock(&p->lock);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->lock);
    }
    take_tasks(p, 0);
    for (int s = 0; atomic_load(&p->active) != 0 && s < TPOOL_SPIN; s++) TPOOL_PAUSE();
    if (atomic_load(&p->active) != 0) {
        pthread_mutex_lock(&p->lock);
        while (atomic_load(&p->active) != 0) pthread_cond_wait(&p->done, &p->lock);
        pthread_mutex_unlock(&p->lock);
    }
}
