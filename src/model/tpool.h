/*
 * tpool: a small fork-join thread pool for the model's parallel loops.
 *
 * model_tpool_run(pool, fn, arg, n) runs fn(arg, i) for every i in [0, n) on the pool's
 * workers and the calling thread, and returns when all have finished. Tasks are handed
 * out through an atomic counter, so which thread runs which task varies; callers make
 * every task write disjoint outputs with a fixed arithmetic order, so results never
 * depend on the thread count or on scheduling.
 *
 * One run at a time: model_tpool_run is called from one thread (the pool's owner).
 * Workers are named "<name>-<i>" and joined by model_tpool_destroy. In a forked child
 * (which has no copies of the workers) tasks run on the calling thread.
 */
#ifndef PKV_MODEL_TPOOL_H
#define PKV_MODEL_TPOOL_H

#include <stdint.h>

typedef struct model_tpool model_tpool_t;
/* `thread` is 0 for the caller and 1..n-1 for workers: an index into per-thread scratch. */
typedef void (*model_tpool_fn)(void *arg, uint32_t task, uint32_t thread);

/* n_threads counts the caller: n_threads - 1 workers are started (0 or 1: none). */
int model_tpool_create(uint32_t n_threads, const char *name, model_tpool_t **out);
void model_tpool_destroy(model_tpool_t *pool);
uint32_t model_tpool_threads(const model_tpool_t *pool);
void model_tpool_run(model_tpool_t *pool, model_tpool_fn fn, void *arg, uint32_t n_tasks);

#endif
