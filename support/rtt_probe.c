/*
 * The CPU round-trip probe (see rtt_probe.h): two pinned threads bounce a counter between
 * two cache lines.
 */
#include "support/rtt_probe.h"

#include "support/bench.h"

#include "core/core.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

enum { RTT_BATCHES = 9, RTT_ROUNDS = 2000 };
typedef struct {
    _Alignas(64) atomic_ulong ping;
    _Alignas(64) atomic_ulong pong;
    _Alignas(64) atomic_bool quit;
    atomic_bool unpinned; /* a thread could not be pinned: the figure would mean nothing */
    int cpu[2];
    double batch_ns[RTT_BATCHES];
    int batches; /* completed */
} rtt_t;
_Static_assert(sizeof(rtt_t) % 64 == 0, "aligned_alloc wants a multiple of the alignment");

static void pin_self(rtt_t *t, int cpu)
{
    cpu_set_t cs;
    CPU_ZERO(&cs);
    CPU_SET(cpu, &cs);
    if (pthread_setaffinity_np(pthread_self(), sizeof(cs), &cs)) atomic_store(&t->unpinned, true);
}

static void *rtt_echo(void *arg)
{
    rtt_t *t = arg;
    pin_self(t, t->cpu[1]);
    unsigned long seen = 0;
    while (!atomic_load_explicit(&t->quit, memory_order_relaxed)) {
        unsigned long v = atomic_load_explicit(&t->ping, memory_order_acquire);
        if (v != seen) atomic_store_explicit(&t->pong, seen = v, memory_order_release);
    }
    return NULL;
}

/* Batches of RTT_ROUNDS round trips; gives up (keeping the batches done) after 200 ms. */
static void *rtt_send(void *arg)
{
    rtt_t *t = arg;
    pin_self(t, t->cpu[0]);
    uint64_t give_up = pkv_now_ns() + 200000000ull;
    unsigned long seq = 0;
    bool late = false;
    for (int b = 0; b < RTT_BATCHES && !late; b++) {
        uint64_t t0 = pkv_now_ns();
        for (int i = 0; i < RTT_ROUNDS && !late; i++) {
            atomic_store_explicit(&t->ping, ++seq, memory_order_release);
            for (uint32_t spin = 0; atomic_load_explicit(&t->pong, memory_order_acquire) != seq;)
                if (++spin % 4096 == 0 && (late = pkv_now_ns() > give_up)) break;
        }
        if (!late) t->batch_ns[t->batches++] = (double)(pkv_now_ns() - t0) / RTT_ROUNDS;
    }
    atomic_store(&t->quit, true);
    return NULL;
}

double pkv_rtt_probe_ns(void)
{
    cpu_set_t cs;
    rtt_t *t = aligned_alloc(64, sizeof(*t));
    if (!t || sched_getaffinity(0, sizeof(cs), &cs)) {
        free(t);
        return 0;
    }
    memset(t, 0, sizeof(*t));
    int n = 0;
    for (int c = 0; c < CPU_SETSIZE && n < 2; c++)
        if (CPU_ISSET(c, &cs)) t->cpu[n++] = c;
    pthread_t th[2];
    bool ok = n == 2 && pthread_create(&th[0], NULL, rtt_echo, t) == 0;
    if (ok && pthread_create(&th[1], NULL, rtt_send, t) != 0) {
        atomic_store(&t->quit, true);
        pthread_join(th[0], NULL);
        ok = false;
    } else if (ok) {
        pthread_join(th[1], NULL);
        pthread_join(th[0], NULL);
    }
    /* The median batch: one preemption of a thread spoils a batch, not the figure. */
    double ns = ok && !atomic_load(&t->unpinned) && t->batches
                    ? pkv_bench_median(t->batch_ns, (size_t)t->batches)
                    : 0;
    free(t);
    return ns;
}
