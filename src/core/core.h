/*
 * core: internal helpers shared by every module (not installed).
 */
#ifndef PKV_CORE_CORE_H
#define PKV_CORE_CORE_H

#include "pagekv/pagekv.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#define PKV_MIN(a, b)      ((a) < (b) ? (a) : (b))
#define PKV_MAX(a, b)      ((a) > (b) ? (a) : (b))
#define PKV_DIV_UP(a, b)   (((a) + (b)-1) / (b))
#define PKV_ALIGN_UP(a, b) (PKV_DIV_UP(a, b) * (b))
#define PKV_ARRAY_LEN(a)   (sizeof(a) / sizeof((a)[0]))

/* splitmix64: the next value of a seeded pseudo-random stream (weights, sampling, test
 * and benchmark data; never secrets). */
static inline uint64_t pkv_splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Broken invariant: print where and abort. Never used for bad input. */
#define PKV_ASSERT(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) pkv__panic(__FILE__, __LINE__, #cond);                                        \
    } while (0)
_Noreturn void pkv__panic(const char *file, int line, const char *what);

#define PKV_LOGE(mod, ...) pkv_log(PKV_LOG_ERROR, mod, __VA_ARGS__)
#define PKV_LOGW(mod, ...) pkv_log(PKV_LOG_WARN, mod, __VA_ARGS__)
#define PKV_LOGI(mod, ...) pkv_log(PKV_LOG_INFO, mod, __VA_ARGS__)
#define PKV_LOGD(mod, ...) pkv_log(PKV_LOG_DEBUG, mod, __VA_ARGS__)

/* Condition variables in pagekv wait on CLOCK_MONOTONIC deadlines. */
int pkv__cond_init_monotonic(pthread_cond_t *cond);
struct timespec pkv__deadline_to_monotonic(uint64_t deadline_ns);
struct timespec pkv__deadline_to_realtime(uint64_t deadline_ns);

/* ---- fault simulation ---------------------------------------------------------------
 * A step that can fail in the field (an allocation of bookkeeping, committing memory,
 * pinning it, creating a thread) asks pkv_fault_hit(site) first; when a test armed that
 * site, the step fails the way the real one would and the caller's error path runs.
 * Commit and pin are simulated inside prim (every module's commits go through it);
 * allocation and thread sites sit in the modules at the calls they guard.
 * The table is process-wide and meant for tests only: Check forks each test, so a
 * test arms sites in its own process. Arming, hitting and reading are atomic; a site
 * nobody armed costs one relaxed load. */
typedef enum {
    PKV_FAULT_ALLOC,  /* malloc / calloc / realloc of a module's bookkeeping */
    PKV_FAULT_COMMIT, /* pkv_prim_commit / pkv_prim_shared_commit */
    PKV_FAULT_MLOCK,  /* pkv_prim_lock */
    PKV_FAULT_THREAD, /* pthread_create */
    PKV_FAULT_SITES
} pkv_fault_site_t;

/* The next `skip` hits of site pass, the `count` after them fail (count 0: disarm). */
void pkv_fault_arm(pkv_fault_site_t site, uint32_t skip, uint32_t count);
void pkv_fault_disarm_all(void);
/* True: the caller must fail this step as if the OS had refused it. */
bool pkv_fault_hit(pkv_fault_site_t site);
/* How many hits of site failed since the last arm. */
uint64_t pkv_fault_fired(pkv_fault_site_t site);

#endif
