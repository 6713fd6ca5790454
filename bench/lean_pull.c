/*
 * Lean pull: the reference beside `bench xfer`'s same-host figures. It does exactly the
 * two copies a same-host read through the shared arena does (producer: pool -> staging,
 * consumer: staging -> pool, both fused with the checksum, streaming stores, pieces of
 * the head size) with the same 8 reads in flight, but nothing else: two processes hand
 * reads over through two single-producer rings in shared memory, each busy-polling. No
 * UCX, no progress or caller threads, no wake-ups, no allocation per read. Memory is of
 * the same kind as the engine's: pools committed with transparent huge pages (as the kv
 * pool does; with 4 KiB pages the consumer's copy ran at half the speed), staging in a
 * memfd. What it reaches is what this flow can reach on this machine.
 */
#include "xfer_harness.h"

#include "core/core.h"
#include "prim/prim.h"
#include "xfer/sum.h"

#include <stdio.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

enum { LP_WINDOW = 8, LP_SLOTS = 2 * LP_WINDOW, LP_RING = 64, LP_MAX_LAYERS = 16 };
#define LP_QUIT       UINT32_MAX
#define LP_GIVE_UP_NS (120ull * 1000000000ull)

typedef struct {
    uint32_t slot, read;
    uint64_t sum[LP_MAX_LAYERS];
} lp_entry_t;

typedef struct {
    _Alignas(64) atomic_ulong head;
    _Alignas(64) atomic_ulong tail;
    _Alignas(64) lp_entry_t e[LP_RING];
} lp_ring_t;

typedef struct {
    lp_ring_t req, done; /* consumer -> producer, producer -> consumer */
    atomic_bool ready;   /* the producer filled its pool */
} lp_shared_t;

typedef struct {
    size_t read_bytes, layer_bytes, piece;
    uint32_t layers;
} lp_geo_t;

/* A pool as the kv module makes one: reserved 2 MiB-aligned, committed with huge pages. */
static uint8_t *lp_pool(size_t bytes)
{
    void *p;
    if (pkv_prim_reserve(bytes, 2u << 20, &p)) return NULL;
    if (pkv_prim_commit(p, bytes, true)) {
        pkv_prim_release(p, bytes);
        return NULL;
    }
    return p;
}

/* Single producer, single consumer: the pusher waits while the ring is full. */
static bool lp_push(lp_ring_t *r, const lp_entry_t *e, uint64_t give_up)
{
    unsigned long h = atomic_load_explicit(&r->head, memory_order_relaxed);
    while (h - atomic_load_explicit(&r->tail, memory_order_acquire) >= LP_RING)
        if (pkv_now_ns() > give_up) return false;
    r->e[h % LP_RING] = *e;
    atomic_store_explicit(&r->head, h + 1, memory_order_release);
    return true;
}

static bool lp_pop(lp_ring_t *r, lp_entry_t *e)
{
    unsigned long t = atomic_load_explicit(&r->tail, memory_order_relaxed);
    if (atomic_load_explicit(&r->head, memory_order_acquire) == t) return false;
    *e = r->e[t % LP_RING];
    atomic_store_explicit(&r->tail, t + 1, memory_order_release);
    return true;
}

/* One read's copy, layer by layer in head-sized pieces, each layer fenced and summed. */
static void lp_copy(const lp_geo_t *g, uint8_t *dst, const uint8_t *src, uint64_t *sums)
{
    for (uint32_t l = 0; l < g->layers; l++) {
        pkv_xfer_sum_t s;
        pkv_xfer_sum_init(&s);
        size_t base = l * g->layer_bytes;
        for (size_t o = 0; o < g->layer_bytes; o += g->piece)
            pkv_xfer_sum_copy_nt(&s, dst + base + o, src + base + o, g->piece);
        pkv_xfer_sum_fence();
        sums[l] = pkv_xfer_sum_final(&s);
    }
}

static void lp_producer(lp_shared_t *sh, uint8_t *arena, const lp_geo_t *g, uint32_t reads,
                        pid_t parent)
{
    xh_child_detach(parent);
    uint8_t *pool = lp_pool(g->read_bytes * reads);
    if (!pool) _exit(2);
    for (size_t i = 0; i < g->read_bytes * reads; i += 4096) memset(pool + i, (int)(i >> 12), 4096);
    atomic_store(&sh->ready, true);
    uint64_t give_up = pkv_now_ns() + LP_GIVE_UP_NS, idle = 0;
    for (;;) {
        lp_entry_t e;
        if (!lp_pop(&sh->req, &e)) {
            if (++idle % 65536 == 0 && pkv_now_ns() > give_up) _exit(3);
            continue;
        }
        if (e.slot == LP_QUIT) _exit(0);
        lp_copy(g, arena + (size_t)e.slot * g->read_bytes, pool + (size_t)e.read * g->read_bytes,
                e.sum);
        if (!lp_push(&sh->done, &e, give_up)) _exit(3);
    }
}

/* Is the producer still there? One that ended is reaped here (*pid becomes -1). */
static bool lp_alive(pid_t *pid)
{
    int st;
    if (waitpid(*pid, &st, WNOHANG) == 0) return true;
    *pid = -1;
    return false;
}

double xh_lean_pull_gbps(size_t read_bytes, uint32_t layers, size_t piece, uint32_t warm_reads,
                         uint32_t timed_reads)
{
    lp_geo_t g = {.read_bytes = read_bytes, .layers = layers, .piece = piece};
    uint32_t reads = warm_reads + timed_reads;
    if (!layers || layers > LP_MAX_LAYERS || read_bytes % layers || !piece || !timed_reads)
        return -1;
    g.layer_bytes = read_bytes / layers;
    if (g.layer_bytes % piece || piece % 64) return -1;
    size_t head = PKV_ALIGN_UP(sizeof(lp_shared_t), 4096), map_bytes = head + LP_SLOTS * read_bytes;
    int fd;
    void *map;
    if (pkv_prim_shared_create("pkv-lean-pull", map_bytes, &fd, &map)) return -1;
    lp_shared_t *sh = map;
    memset(sh, 0, sizeof(*sh));
    uint8_t *arena = (uint8_t *)map + head;
    uint8_t *pool = NULL;
    double gbps = -1;
    fflush(NULL);
    pid_t parent = getpid(), pid = fork();
    if (pid == 0) lp_producer(sh, arena, &g, reads, parent);
    if (pid < 0) goto out;
    pool = lp_pool(read_bytes * reads);
    if (!pool) goto out;
    uint64_t give_up = pkv_now_ns() + LP_GIVE_UP_NS;
    while (!atomic_load(&sh->ready))
        if (pkv_now_ns() > give_up || !lp_alive(&pid)) goto out;
    uint32_t free_slot[LP_SLOTS], n_free = LP_SLOTS, issued = 0, done = 0;
    for (uint32_t i = 0; i < LP_SLOTS; i++) free_slot[i] = i;
    uint64_t t0 = pkv_now_ns(), idle = 0;
    bool bad = false;
    while (done < reads && !bad) {
        while (issued < reads && issued - done < LP_WINDOW && n_free) {
            lp_entry_t e = {.slot = free_slot[--n_free], .read = issued++};
            if (!lp_push(&sh->req, &e, give_up)) goto out;
        }
        lp_entry_t e;
        if (!lp_pop(&sh->done, &e)) {
            if (++idle % 65536 == 0 && (pkv_now_ns() > give_up || !lp_alive(&pid))) goto out;
            continue;
        }
        uint64_t mine[LP_MAX_LAYERS];
        lp_copy(&g, pool + (size_t)e.read * read_bytes, arena + (size_t)e.slot * read_bytes, mine);
        bad = memcmp(mine, e.sum, layers * sizeof(uint64_t)) != 0;
        free_slot[n_free++] = e.slot;
        if (++done == warm_reads) t0 = pkv_now_ns();
    }
    if (!bad && done == reads)
        gbps = (double)timed_reads * (double)read_bytes / (double)(pkv_now_ns() - t0);
    lp_entry_t quit = {.slot = LP_QUIT};
    lp_push(&sh->req, &quit, pkv_now_ns() + 1000000000ull);
out:;
    int st;
    xh_reap(pid, &st, pkv_now_ns() + 1000000000ull); /* it exits on QUIT; else killed */
    if (pool) pkv_prim_release(pool, read_bytes * reads);
    pkv_prim_shared_close(fd, map, map_bytes);
    return gbps;
}
