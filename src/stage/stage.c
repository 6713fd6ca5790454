/*
 * stage: host staging arena. See include/pagekv/stage.h for the API and
 * docs/design/stage.md for the design note.
 *
 * Threading invariant. One mutex, st->lock, guards all bookkeeping: the allocator
 * (stage_alloc_t), the transfer records and their hash, the peer table, the waiter
 * queue, the run chains and every counter. Nothing under it calls the OS, allocates,
 * or logs:
 *   - grants are malloc'ed before the lock is taken (sized for the worst case);
 *   - pages a grant needs committed are marked warm under the lock, then committed by
 *     the acquiring thread after unlocking, while an internal lease keeps the transfer
 *     from being freed under it;
 *   - idle pages are taken out of the free set ("off") under the lock, returned to the
 *     OS by the reclaim thread without it, then put back cold under it again;
 *   - failure lines are formatted from values copied out under the lock.
 * Each parked acquire waits on its own condition variable (CLOCK_MONOTONIC, the
 * transfer's absolute deadline). Whoever frees pages runs the admission pass
 * (stage_serve) under the lock: it allocates for waiters in FIFO order and signals each
 * one it served, so a woken waiter finds its pages already granted. Waiters never poll.
 */
#include "pagekv/stage.h"

#include "core/core.h"
#include "prim/prim.h"
#include "stage/stage.h"
#include "stage/stage_int.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STAGE_LOG "stage"

enum {
    XFER_FREE = 0, /* record slot unused */
    XFER_HOLD,     /* owned by a live transfer */
    XFER_RELEASED, /* released, waiting for its leases to end */
    XFER_CANCELLED /* cancelled, waiting for its leases to end */
};

typedef struct {
    uint64_t id;
    uint32_t peer;
    uint32_t asked; /* pages asked */
    uint32_t pages; /* pages owned (fixed mode: a slot) */
    uint32_t nruns;
    uint32_t first_run; /* first page of the first run; run_next chains the rest */
    uint32_t leases;    /* open copies, plus one while acquire commits fresh pages */
    uint8_t state;      /* XFER_* */
    uint32_t next_free; /* free-list link while XFER_FREE */
} stage_xfer_t;

typedef struct stage_waiter {
    struct stage_waiter *next, *prev;
    uint64_t id;
    uint32_t peer;
    uint32_t asked;
    uint32_t need;
    int status;   /* 1 while parked; then PKV_OK or the failure */
    bool capped;  /* last admission pass passed it over for its peer's cap */
    uint32_t rec; /* record index once served */
    pkv_stage_grant_t *grant;
    uint32_t runs_cap;
    pthread_cond_t cond;
} stage_waiter_t;

typedef struct {
    uint32_t peer;
    uint32_t held; /* 0: slot empty */
} stage_peer_t;

struct pkv_stage {
    /* Immutable after create. */
    pkv_stage_config_t cfg;
    char name[32];
    size_t page_bytes;
    uint32_t npages;
    uint32_t req_max;  /* most pages one request can ever be seated with */
    uint32_t max_live; /* most transfer records live at once */
    uint32_t runs_cap; /* most runs one grant can have */
    char *base;
    size_t arena_bytes;
    int memfd;
    bool has_reclaimer;
    pthread_t reclaimer;

    pthread_mutex_t lock; /* guards everything below */
    stage_alloc_t alloc;
    uint32_t *run_next;  /* (npages) at a run's first page: the transfer's next run */
    uint8_t *fresh;      /* (npages) granted cold: the owner commits it outside the lock */
    stage_xfer_t *xfers; /* (max_live) */
    uint32_t xfer_free;  /* free-list head */
    uint32_t *xfer_hash; /* (hash_cap) record index + 1; 0 empty; linear probing */
    uint32_t hash_cap;
    stage_peer_t *peers; /* (hash_cap) linear probing on peer id, held > 0 */
    stage_waiter_t *wait_head, *wait_tail;
    uint32_t nwaiting;
    stage_span_t *spans;    /* (runs_cap) stage_grant's scratch */
    stage_span_t *reclaim;  /* (npages) reclaimer's scratch (used outside the lock too) */
    uint32_t parked;        /* threads inside a parked acquire (destroy waits for them) */
    uint32_t returning;     /* pages the reclaim thread has taken off to return to the OS */
    pkv_recent_max_t floor; /* the warm floor (cfg.warm_life_ns): transfers' pages */
    pthread_cond_t reclaim_cond;
    bool reclaim_idle; /* reclaimer sleeps with nothing warm and free to watch */
    bool stopping;     /* reclaimer must exit */
    bool shutdown;
    bool draining; /* destroy waits on drain_cond */
    pthread_cond_t drain_cond;
    pkv_stage_stats_t stats; /* counters (the gauges are filled in by pkv_stage_stats) */
};

const char *pkv_stage_mode_name(pkv_stage_mode_t mode)
{
    switch (mode) {
    case PKV_STAGE_PER_TRANSFER:
        return "per_transfer";
    case PKV_STAGE_FIXED_SLOTS:
        return "fixed_slots";
    default:
        return "unknown";
    }
}

void pkv_stage_config_default(pkv_stage_config_t *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->page_bytes = 64 * 1024;
    cfg->pool_pages = 1024;
    cfg->mode = PKV_STAGE_PER_TRANSFER;
    cfg->idle_release_ns = 1000000000ull;
    cfg->pin = true;
}

/* ---- small tables ------------------------------------------------------------------ */

static uint32_t hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (uint32_t)x;
}

/* Index of the hash slot holding transfer `id`, or of the empty slot ending its probe. */
static uint32_t xfer_slot(const pkv_stage_t *st, uint64_t id)
{
    uint32_t mask = st->hash_cap - 1, i = hash_u64(id) & mask;
    while (st->xfer_hash[i] && st->xfers[st->xfer_hash[i] - 1].id != id) i = (i + 1) & mask;
    return i;
}

static stage_xfer_t *xfer_find(const pkv_stage_t *st, uint64_t id)
{
    uint32_t h = st->xfer_hash[xfer_slot(st, id)];
    return h ? &st->xfers[h - 1] : NULL;
}

static void xfer_hash_remove(pkv_stage_t *st, uint64_t id)
{
    uint32_t mask = st->hash_cap - 1, i = xfer_slot(st, id);
    PKV_ASSERT(st->xfer_hash[i]);
    /* Backward-shift deletion keeps every probe chain unbroken. */
    for (uint32_t j = (i + 1) & mask; st->xfer_hash[j]; j = (j + 1) & mask) {
        uint32_t home = hash_u64(st->xfers[st->xfer_hash[j] - 1].id) & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            st->xfer_hash[i] = st->xfer_hash[j];
            i = j;
        }
    }
    st->xfer_hash[i] = 0;
}

static uint32_t peer_slot(const pkv_stage_t *st, uint32_t peer)
{
    uint32_t mask = st->hash_cap - 1, i = hash_u64(peer) & mask;
    while (st->peers[i].held && st->peers[i].peer != peer) i = (i + 1) & mask;
    return i;
}

static uint32_t peer_held(const pkv_stage_t *st, uint32_t peer)
{
    return st->peers[peer_slot(st, peer)].held;
}

static void peer_add(pkv_stage_t *st, uint32_t peer, uint32_t pages)
{
    stage_peer_t *p = &st->peers[peer_slot(st, peer)];
    p->peer = peer;
    p->held += pages;
}

static void peer_sub(pkv_stage_t *st, uint32_t peer, uint32_t pages)
{
    uint32_t mask = st->hash_cap - 1, i = peer_slot(st, peer);
    PKV_ASSERT(st->peers[i].held >= pages);
    st->peers[i].held -= pages;
    if (st->peers[i].held) return;
    for (uint32_t j = (i + 1) & mask; st->peers[j].held; j = (j + 1) & mask) {
        uint32_t home = hash_u64(st->peers[j].peer) & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            st->peers[i] = st->peers[j];
            st->peers[j].held = 0;
            i = j;
        }
    }
}

/* ---- granting and freeing (under st->lock) ------------------------------------------ */

static void wait_hist_add(pkv_stage_t *st, uint64_t wait_ns)
{
    uint64_t us = wait_ns / 1000;
    unsigned b = us < 2 ? 0 : 63u - (unsigned)__builtin_clzll(us);
    if (b >= PKV_STAGE_WAIT_BUCKETS) b = PKV_STAGE_WAIT_BUCKETS - 1;
    st->stats.waits++;
    st->stats.wait_hist[b]++;
    st->stats.wait_ns_total += wait_ns;
    st->stats.wait_ns_max = PKV_MAX(st->stats.wait_ns_max, wait_ns);
}

/* The warm floor: the largest transfer of the last one to two warm_life_ns. */
static void stage_floor_note(pkv_stage_t *st, uint32_t need)
{
    pkv_recent_max_note(&st->floor, need, pkv_now_ns(), st->cfg.warm_life_ns);
}

/* The floor at now; *end_ns (optional): when it next falls (UINT64_MAX: it is 0). */
static uint32_t stage_floor(const pkv_stage_t *st, uint64_t now, uint64_t *end_ns)
{
    return pkv_recent_max_get(&st->floor, now, st->cfg.warm_life_ns, end_ns);
}

/* Seat a transfer: take its pages, make its record, fill `grant`. The allocator must
 * fit the request. Returns the record index; *fresh_out counts pages to commit. */
static uint32_t stage_grant(pkv_stage_t *st, uint64_t id, uint32_t peer, uint32_t asked,
                            pkv_stage_grant_t *grant, uint32_t *fresh_out)
{
    uint32_t need = stage_alloc_need(&st->alloc, asked);
    PKV_ASSERT(st->xfer_free != STAGE_NONE);
    uint32_t ri = st->xfer_free;
    stage_xfer_t *x = &st->xfers[ri];
    st->xfer_free = x->next_free;

    stage_span_t *spans = st->spans;
    uint32_t n = stage_alloc_take(&st->alloc, need, spans, st->runs_cap);
    uint32_t fresh = 0;
    for (uint32_t r = 0; r < n; r++) {
        uint32_t s = spans[r].page, c = spans[r].count;
        st->run_next[s] = r + 1 < n ? spans[r + 1].page : STAGE_NONE;
        for (uint32_t p = s; p < s + c; p++)
            if (st->alloc.warm[p] == STAGE_COLD) {
                st->alloc.warm[p] = STAGE_WARM;
                st->fresh[p] = 1;
                fresh++;
            }
    }
    x->id = id;
    x->peer = peer;
    x->asked = asked;
    x->pages = need;
    x->nruns = n;
    x->first_run = spans[0].page;
    x->leases = fresh ? 1 : 0; /* the acquire's own lease while it commits */
    x->state = XFER_HOLD;
    st->xfer_hash[xfer_slot(st, id)] = ri + 1;
    peer_add(st, peer, need);

    grant->transfer_id = id;
    grant->peer = peer;
    grant->pages_asked = asked;
    grant->pages = need;
    grant->nruns = n;
    grant->page_bytes = st->page_bytes;
    for (uint32_t r = 0; r < n; r++) {
        grant->runs[r].page = spans[r].page;
        grant->runs[r].count = spans[r].count;
        grant->runs[r].offset = (uint64_t)spans[r].page * st->page_bytes;
        grant->runs[r].addr = st->base + (size_t)spans[r].page * st->page_bytes;
    }

    pkv_stage_stats_t *k = &st->stats;
    k->acquires++;
    k->transfers_live++;
    k->transfers_peak = PKV_MAX(k->transfers_peak, k->transfers_live);
    k->pages_asked_inflight += asked;
    k->pages_asked_peak = PKV_MAX(k->pages_asked_peak, k->pages_asked_inflight);
    uint32_t used = st->npages - st->alloc.free_pages;
    k->pages_peak_used = PKV_MAX(k->pages_peak_used, used);
    k->resident_bytes += (uint64_t)fresh * st->page_bytes;
    k->resident_peak_bytes = PKV_MAX(k->resident_peak_bytes, k->resident_bytes);
    stage_floor_note(st, need);
    *fresh_out = fresh;
    return ri;
}

static void reclaim_kick(pkv_stage_t *st)
{
    if (st->reclaim_idle) {
        st->reclaim_idle = false;
        pthread_cond_signal(&st->reclaim_cond);
    }
}

static void waiter_unlink(pkv_stage_t *st, stage_waiter_t *w)
{
    if (w->prev)
        w->prev->next = w->next;
    else
        st->wait_head = w->next;
    if (w->next)
        w->next->prev = w->prev;
    else
        st->wait_tail = w->prev;
    st->nwaiting--;
}

/* Serve parked acquires in arrival order. A waiter whose peer is at its cap is passed
 * over (it cannot be served whatever frees up elsewhere); the first other waiter that
 * does not fit stops the pass: it holds the head of the line. */
static void stage_serve(pkv_stage_t *st)
{
    for (stage_waiter_t *w = st->wait_head, *next; w; w = next) {
        next = w->next;
        uint32_t cap = st->cfg.peer_cap_pages;
        if (cap && peer_held(st, w->peer) + w->need > cap) {
            w->capped = true;
            continue;
        }
        w->capped = false;
        if (!stage_alloc_fits(&st->alloc, w->need)) break;
        uint32_t fresh;
        w->rec = stage_grant(st, w->id, w->peer, w->asked, w->grant, &fresh);
        /* The waiter's own lease until its acquire returns (and commits any fresh pages):
         * a cancel in between must not free pages the waiter is about to hand out. */
        st->xfers[w->rec].leases = 1;
        w->status = PKV_OK;
        waiter_unlink(st, w);
        pthread_cond_signal(&w->cond);
    }
}

/* Return a transfer's pages and its record; admit waiters that now fit. */
static void stage_free_xfer(pkv_stage_t *st, stage_xfer_t *x)
{
    uint64_t now = pkv_now_ns();
    for (uint32_t s = x->first_run, r = 0; r < x->nruns; r++) {
        uint32_t next = st->run_next[s];
        stage_alloc_give(&st->alloc, s, st->alloc.len[s], now);
        s = next;
    }
    peer_sub(st, x->peer, x->pages);
    xfer_hash_remove(st, x->id);
    st->stats.pages_asked_inflight -= x->asked;
    st->stats.transfers_live--;
    x->state = XFER_FREE;
    x->next_free = st->xfer_free;
    st->xfer_free = (uint32_t)(x - st->xfers);
    stage_serve(st);
    reclaim_kick(st);
    if (st->draining) pthread_cond_broadcast(&st->drain_cond);
}

static stage_waiter_t *waiter_find(const pkv_stage_t *st, uint64_t id)
{
    for (stage_waiter_t *w = st->wait_head; w; w = w->next)
        if (w->id == id) return w;
    return NULL;
}

/* ---- OS side (never under the lock) ------------------------------------------------ */

static int stage_os_commit(pkv_stage_t *st, uint32_t page, uint32_t count)
{
    size_t off = (size_t)page * st->page_bytes, len = (size_t)count * st->page_bytes;
    if (st->memfd >= 0) return pkv_prim_shared_commit(st->memfd, st->base, off, len);
    return pkv_prim_commit(st->base + off, len, false);
}

static void stage_os_decommit(pkv_stage_t *st, uint32_t page, uint32_t count, bool pinned)
{
    size_t off = (size_t)page * st->page_bytes, len = (size_t)count * st->page_bytes;
    if (pinned) pkv_prim_unlock(st->base + off, len);
    int rc = st->memfd >= 0 ? pkv_prim_shared_decommit(st->memfd, st->base, off, len)
                            : pkv_prim_decommit(st->base + off, len);
    if (rc)
        PKV_LOGW(STAGE_LOG, "%s: returning pages %u+%u to the OS failed: %s", st->name, page, count,
                 pkv_status_str(rc));
}

/* Commit the fresh pages of grant `g` (owned by this thread, under its internal lease).
 * Marks pinned pages in *pinned_out via st->fresh (2 = committed and pinned, 1 = not
 * pinned). Returns PKV_OK or PKV_ERR_NOMEM (having decommitted what it committed). */
static int stage_commit_fresh(pkv_stage_t *st, const pkv_stage_grant_t *g)
{
    for (uint32_t r = 0; r < g->nruns; r++) {
        uint32_t end = g->runs[r].page + g->runs[r].count;
        for (uint32_t p = g->runs[r].page; p < end;) {
            if (!st->fresh[p]) {
                p++;
                continue;
            }
            uint32_t q = p;
            while (q < end && st->fresh[q]) q++;
            int rc = stage_os_commit(st, p, q - p);
            if (rc) return rc;
            uint8_t mark = 1;
            if (st->cfg.pin) {
                size_t off = (size_t)p * st->page_bytes;
                if (pkv_prim_lock(st->base + off, (size_t)(q - p) * st->page_bytes) == PKV_OK)
                    mark = 2;
            }
            memset(st->fresh + p, mark + 1, q - p); /* 2: committed, 3: committed+pinned */
            p = q;
        }
    }
    return PKV_OK;
}

/* After stage_commit_fresh (lock held): settle the fresh marks into warm state and
 * counters. On failure (`ok` false) every page of the grant that was fresh is
 * returned to the OS by the caller first and goes back cold here. */
static void stage_settle_fresh(pkv_stage_t *st, const pkv_stage_grant_t *g, bool ok)
{
    for (uint32_t r = 0; r < g->nruns; r++)
        for (uint32_t p = g->runs[r].page; p < g->runs[r].page + g->runs[r].count; p++) {
            uint8_t f = st->fresh[p];
            if (!f) continue;
            st->fresh[p] = 0;
            if (!ok) {
                st->alloc.warm[p] = STAGE_COLD;
                st->stats.resident_bytes -= st->page_bytes;
                continue;
            }
            st->stats.committed_pages++;
            if (f == 3) {
                st->alloc.warm[p] = STAGE_WARM_PINNED;
                st->stats.pinned_bytes += st->page_bytes;
            } else if (st->cfg.pin) {
                st->stats.pin_failed_pages++;
            }
        }
}

static void stage_uncommit_grant(pkv_stage_t *st, const pkv_stage_grant_t *g)
{
    for (uint32_t r = 0; r < g->nruns; r++) {
        uint32_t end = g->runs[r].page + g->runs[r].count;
        for (uint32_t p = g->runs[r].page; p < end;) {
            if (st->fresh[p] < 2) {
                p++;
                continue;
            }
            uint32_t q = p;
            while (q < end && st->fresh[q] >= 2) q++;
            stage_os_decommit(st, p, q - p, st->fresh[p] == 3);
            p = q;
        }
    }
}

/* ---- reclaim thread ---------------------------------------------------------------- */

static void *stage_reclaim_main(void *arg)
{
    pkv_stage_t *st = arg;
    uint64_t idle = st->cfg.idle_release_ns;
    pthread_mutex_lock(&st->lock);
    while (!st->stopping) {
        uint64_t now = pkv_now_ns(), next, floor_end;
        uint64_t cutoff = now > idle ? now - idle : 0;
        /* the floor stays: only resident pages beyond it go back */
        uint32_t floor = stage_floor(st, now, &floor_end);
        uint32_t resident = (uint32_t)(st->stats.resident_bytes / st->page_bytes);
        uint32_t most = resident > floor ? resident - floor : 0;
        uint32_t n =
            stage_alloc_collect_idle(&st->alloc, cutoff, most, st->reclaim, st->npages, &next);
        for (uint32_t i = 0; i < n; i++) st->returning += st->reclaim[i].count;
        if (n) {
            /* The off pages belong to this thread until they come back cold. */
            const stage_span_t *spans = st->reclaim;
            const uint8_t *warm = st->alloc.warm;
            pthread_mutex_unlock(&st->lock);
            for (uint32_t i = 0; i < n; i++) {
                uint32_t p = spans[i].page, end = p + spans[i].count;
                /* Split by pinned state so munlock only covers locked pages. */
                for (uint32_t q = p; q < end;) {
                    uint32_t r = q + 1;
                    while (r < end && warm[r] == warm[q]) r++;
                    stage_os_decommit(st, q, r - q, warm[q] == STAGE_WARM_PINNED);
                    q = r;
                }
            }
            pthread_mutex_lock(&st->lock);
            for (uint32_t i = 0; i < n; i++) {
                uint32_t p = spans[i].page, c = spans[i].count;
                for (uint32_t q = p; q < p + c; q++)
                    if (warm[q] == STAGE_WARM_PINNED) st->stats.pinned_bytes -= st->page_bytes;
                stage_alloc_return_cold(&st->alloc, p, c);
                st->returning -= c;
                st->stats.resident_bytes -= (uint64_t)c * st->page_bytes;
                st->stats.released_pages += c;
            }
            stage_serve(st);
            continue;
        }
        if (next == UINT64_MAX) {
            /* Nothing warm is free but what the floor keeps: sleep until a release kicks
             * us, or until the floor lapses and frees what it kept. */
            st->reclaim_idle = true;
            if (floor_end == UINT64_MAX) {
                while (st->reclaim_idle && !st->stopping)
                    pthread_cond_wait(&st->reclaim_cond, &st->lock);
            } else {
                struct timespec ts = pkv_deadline_to_monotonic(floor_end);
                pthread_cond_timedwait(&st->reclaim_cond, &st->lock, &ts);
                st->reclaim_idle = false;
            }
        } else {
            uint64_t wake = next + idle < next ? PKV_DEADLINE_NEVER : next + idle;
            wake = PKV_MIN(wake, floor_end); /* the floor's lapse frees what it kept */
            struct timespec ts = pkv_deadline_to_monotonic(wake);
            pthread_cond_timedwait(&st->reclaim_cond, &st->lock, &ts);
        }
    }
    pthread_mutex_unlock(&st->lock);
    return NULL;
}

/* ---- create / destroy -------------------------------------------------------------- */

#define STAGE_WARM_LIFE_MAX (86400ull * 1000000000ull) /* a day */

static int stage_config_check(const pkv_stage_config_t *c, uint32_t *npages)
{
    if (c->page_bytes == 0 || c->page_bytes % PKV_PRIM_PAGE) {
        PKV_LOGE(STAGE_LOG, "create: page_bytes %zu is not a positive multiple of %u",
                 c->page_bytes, PKV_PRIM_PAGE);
        return PKV_ERR_INVALID;
    }
    uint64_t n;
    if (c->mode == PKV_STAGE_FIXED_SLOTS) {
        n = (uint64_t)c->slots * c->slot_pages;
        if (c->slots == 0 || c->slot_pages == 0 || (c->pool_pages && c->pool_pages != n)) {
            PKV_LOGE(STAGE_LOG,
                     "create: fixed slots need slots > 0 and slot_pages > 0 (pool_pages 0 or "
                     "slots*slot_pages); got %u x %u, pool_pages %u",
                     c->slots, c->slot_pages, c->pool_pages);
            return PKV_ERR_INVALID;
        }
    } else if (c->mode == PKV_STAGE_PER_TRANSFER) {
        n = c->pool_pages;
        if (n == 0) {
            PKV_LOGE(STAGE_LOG, "create: pool_pages must be > 0");
            return PKV_ERR_INVALID;
        }
    } else {
        PKV_LOGE(STAGE_LOG, "create: unknown mode %d", (int)c->mode);
        return PKV_ERR_INVALID;
    }
    if (c->warm_life_ns > STAGE_WARM_LIFE_MAX) {
        PKV_LOGE(STAGE_LOG, "create: warm_life_ns %" PRIu64 " is above a day", c->warm_life_ns);
        return PKV_ERR_INVALID;
    }
    if (n > (1u << 30) || n * c->page_bytes > (1ull << 46)) {
        PKV_LOGE(STAGE_LOG, "create: arena of %" PRIu64 " pages x %zu bytes is too large", n,
                 c->page_bytes);
        return PKV_ERR_INVALID;
    }
    *npages = (uint32_t)n;
    return PKV_OK;
}

/* calloc for the stage's bookkeeping, failing where a test armed PKV_FAULT_ALLOC. */
static void *stage_calloc(size_t n, size_t size)
{
    return pkv_fault_hit(PKV_FAULT_ALLOC) ? NULL : calloc(n, size);
}

static void stage_tables_free(pkv_stage_t *st)
{
    free(st->spans);
    free(st->reclaim);
    free(st->peers);
    free(st->xfer_hash);
    free(st->xfers);
    free(st->fresh);
    free(st->run_next);
    stage_alloc_fini(&st->alloc);
}

/* The allocator and the tables (all or none; PKV_ERR_NOMEM). */
static int stage_tables_alloc(pkv_stage_t *st, bool fixed)
{
    uint32_t npages = st->npages;
    if (stage_alloc_init(&st->alloc, st->cfg.mode, npages, fixed ? st->cfg.slot_pages : 0))
        return PKV_ERR_NOMEM;
    st->run_next = stage_calloc(npages, sizeof(uint32_t));
    st->fresh = stage_calloc(npages, 1);
    st->xfers = stage_calloc(st->max_live, sizeof(stage_xfer_t));
    st->xfer_hash = stage_calloc(st->hash_cap, sizeof(uint32_t));
    st->peers = stage_calloc(st->hash_cap, sizeof(stage_peer_t));
    st->reclaim = stage_calloc(npages, sizeof(stage_span_t));
    st->spans = stage_calloc(st->runs_cap, sizeof(stage_span_t));
    if (!st->run_next || !st->fresh || !st->xfers || !st->xfer_hash || !st->peers || !st->reclaim ||
        !st->spans) {
        stage_tables_free(st);
        return PKV_ERR_NOMEM;
    }
    for (uint32_t i = 0; i < st->max_live; i++)
        st->xfers[i].next_free = i + 1 < st->max_live ? i + 1 : STAGE_NONE;
    st->xfer_free = 0;
    return PKV_OK;
}

/* Reserve the arena (a memfd mapping when shared); logs why it could not. */
static int stage_arena_open(pkv_stage_t *st)
{
    int rc;
    if (st->cfg.shared) {
        rc = pkv_prim_shared_create(st->name, st->arena_bytes, &st->memfd, (void **)&st->base);
        if (rc)
            PKV_LOGE(STAGE_LOG, "create: memfd arena of %zu bytes: %s", st->arena_bytes,
                     pkv_status_str(rc));
    } else {
        rc = pkv_prim_reserve(st->arena_bytes, PKV_PRIM_PAGE, (void **)&st->base);
        if (rc)
            PKV_LOGE(STAGE_LOG, "create: reserving %zu bytes: %s", st->arena_bytes,
                     pkv_status_str(rc));
    }
    return rc;
}

static void stage_arena_close(pkv_stage_t *st)
{
    if (st->memfd >= 0)
        pkv_prim_shared_close(st->memfd, st->base, st->arena_bytes);
    else
        pkv_prim_release(st->base, st->arena_bytes);
}

/* The lock, the condition variables and the reclaim thread (all or none). */
static int stage_sync_open(pkv_stage_t *st)
{
    if (pthread_mutex_init(&st->lock, NULL)) return PKV_ERR_NOMEM;
    if (pkv_cond_init_monotonic(&st->reclaim_cond)) goto fail_mutex;
    if (pkv_cond_init_monotonic(&st->drain_cond)) goto fail_reclaim_cond;
    if (st->cfg.idle_release_ns != PKV_DEADLINE_NEVER) {
        if (pkv_fault_hit(PKV_FAULT_THREAD) ||
            pthread_create(&st->reclaimer, NULL, stage_reclaim_main, st))
            goto fail_drain_cond;
        pthread_setname_np(st->reclaimer, "pkv-stage-idle");
        st->has_reclaimer = true;
    }
    return PKV_OK;

fail_drain_cond:
    pthread_cond_destroy(&st->drain_cond);
fail_reclaim_cond:
    pthread_cond_destroy(&st->reclaim_cond);
fail_mutex:
    pthread_mutex_destroy(&st->lock);
    return PKV_ERR_NOMEM;
}

int pkv_stage_create(const pkv_stage_config_t *cfg, pkv_stage_t **out)
{
    uint32_t npages;
    int rc;
    if (!cfg || !out) {
        PKV_LOGE(STAGE_LOG, "create: NULL argument");
        return PKV_ERR_INVALID;
    }
    if ((rc = stage_config_check(cfg, &npages))) return rc;
    pkv_stage_t *st = stage_calloc(1, sizeof(*st));
    if (!st) return PKV_ERR_NOMEM;
    st->cfg = *cfg;
    snprintf(st->name, sizeof(st->name), "%s", cfg->name ? cfg->name : "pkv-stage");
    st->cfg.name = st->name;
    st->page_bytes = cfg->page_bytes;
    st->npages = npages;
    st->memfd = -1;
    bool fixed = cfg->mode == PKV_STAGE_FIXED_SLOTS;
    st->req_max = fixed ? cfg->slot_pages : npages;
    st->max_live = fixed ? cfg->slots : npages;
    /* stage_alloc_take's scratch: before its runs are merged, warm pieces cut from one
       extent and the cold pages between them are separate runs, each at least a page,
       so half the arena is not a bound */
    st->runs_cap = fixed ? 1 : npages;
    st->hash_cap = 16;
    while (st->hash_cap < 2 * st->max_live) st->hash_cap *= 2;
    st->arena_bytes = (size_t)npages * st->page_bytes;
    st->stats.mode = cfg->mode;
    st->stats.page_bytes = st->page_bytes;
    st->stats.pages_total = npages;

    if ((rc = stage_tables_alloc(st, fixed))) goto fail_st;
    if ((rc = stage_arena_open(st))) goto fail_tables;
    if ((rc = stage_sync_open(st))) goto fail_arena;
    *out = st;
    return PKV_OK;

fail_arena:
    stage_arena_close(st);
fail_tables:
    stage_tables_free(st);
fail_st:
    free(st);
    return rc;
}

void pkv_stage_shutdown(pkv_stage_t *st)
{
    if (!st) return;
    pthread_mutex_lock(&st->lock);
    st->shutdown = true;
    for (stage_waiter_t *w = st->wait_head, *next; w; w = next) {
        next = w->next;
        w->status = PKV_ERR_SHUTDOWN;
        waiter_unlink(st, w);
        pthread_cond_signal(&w->cond);
    }
    pthread_mutex_unlock(&st->lock);
}

int pkv_stage_destroy(pkv_stage_t *st, uint64_t drain_deadline_ns, size_t *leaked)
{
    if (!st) {
        if (leaked) *leaked = 0;
        return PKV_OK;
    }
    pkv_stage_shutdown(st);
    pthread_mutex_lock(&st->lock);
    st->draining = true;
    while (st->stats.transfers_live > 0 && pkv_now_ns() < drain_deadline_ns) {
        struct timespec ts = pkv_deadline_to_monotonic(drain_deadline_ns);
        pthread_cond_timedwait(&st->drain_cond, &st->lock, &ts);
    }
    /* Threads still inside acquire were woken by shutdown; they only need the lock. */
    while (st->parked > 0) pthread_cond_wait(&st->drain_cond, &st->lock);
    size_t nleak = 0, copying = 0;
    struct stage_leak {
        uint64_t id;
        uint32_t peer, pages, leases, state;
    } shown[32];
    for (uint32_t i = 0; i < st->max_live; i++) {
        stage_xfer_t *x = &st->xfers[i];
        if (x->state == XFER_FREE) continue;
        if (nleak < PKV_ARRAY_LEN(shown))
            shown[nleak] = (struct stage_leak){x->id, x->peer, x->pages, x->leases, x->state};
        nleak++;
        if (x->leases) copying++;
    }
    st->draining = copying > 0;
    pthread_mutex_unlock(&st->lock);

    for (size_t i = 0; i < PKV_MIN(nleak, PKV_ARRAY_LEN(shown)); i++)
        PKV_LOGE(STAGE_LOG,
                 "%s: destroy: transfer %" PRIu64 " leaked (peer %u, %u pages, %u "
                 "copies open, %s)",
                 st->name, shown[i].id, shown[i].peer, shown[i].pages, shown[i].leases,
                 shown[i].state == XFER_HOLD ? "never released" : "released");
    if (nleak > PKV_ARRAY_LEN(shown))
        PKV_LOGE(STAGE_LOG, "%s: destroy: %zu more transfers leaked", st->name,
                 nleak - PKV_ARRAY_LEN(shown));
    if (leaked) *leaked = nleak;
    if (copying) {
        PKV_LOGE(STAGE_LOG,
                 "%s: destroy: %zu transfers still have copies running; the arena "
                 "stays mapped and the stage valid",
                 st->name, copying);
        return PKV_ERR_BUSY;
    }

    if (st->has_reclaimer) {
        pthread_mutex_lock(&st->lock);
        st->stopping = true;
        pthread_cond_signal(&st->reclaim_cond);
        pthread_mutex_unlock(&st->lock);
        pthread_join(st->reclaimer, NULL);
    }
    if (st->cfg.pin && st->stats.pinned_bytes) pkv_prim_unlock(st->base, st->arena_bytes);
    stage_arena_close(st);
    pthread_cond_destroy(&st->drain_cond);
    pthread_cond_destroy(&st->reclaim_cond);
    pthread_mutex_destroy(&st->lock);
    stage_tables_free(st);
    free(st);
    return PKV_OK;
}

/* ---- acquire ----------------------------------------------------------------------- */

void pkv_stage_grant_free(pkv_stage_grant_t *grant)
{
    free(grant);
}

/* Park `w` at the tail of the line and wait until it is served, cancelled, shut down or
 * its deadline passes (lock held throughout, except inside the condition wait). */
static int stage_park(pkv_stage_t *st, stage_waiter_t *w, uint64_t deadline_ns, bool *blocked)
{
    w->status = 1;
    w->prev = st->wait_tail;
    w->next = NULL;
    if (st->wait_tail)
        st->wait_tail->next = w;
    else
        st->wait_head = w;
    st->wait_tail = w;
    st->nwaiting++;
    /* Everyone ahead may be passed over for their peer's cap: try at once. */
    stage_serve(st);
    if (w->status != 1) return w->status;
    *blocked = true;
    st->parked++;
    while (w->status == 1) {
        if (pkv_now_ns() >= deadline_ns) {
            waiter_unlink(st, w);
            w->status = PKV_ERR_TIMEOUT;
            st->stats.timeouts++;
            stage_serve(st); /* we may have held the head of the line */
            break;
        }
        /* Recomputed each time: PKV_DEADLINE_NEVER maps to "an hour from now". */
        struct timespec ts = pkv_deadline_to_monotonic(deadline_ns);
        pthread_cond_timedwait(&w->cond, &st->lock, &ts);
    }
    st->parked--;
    if (st->draining) pthread_cond_broadcast(&st->drain_cond);
    return w->status;
}

/* One acquire: what it asked, what it decided, and the figures its failure line gives
 * (copied out under the lock: after unlocking, a failed acquire must not touch the
 * stage, which destroy may free once we are no longer parked). */
typedef enum {
    ASK_ARGS,   /* the arguments were refused */
    ASK_SETUP,  /* the grant or the waiter's condition could not be made */
    ASK_DECIDE, /* refused, timed out, cancelled or shut down under the lock */
    ASK_COMMIT  /* granted, then the commit failed or a cancel came first */
} stage_ask_phase_t;

typedef struct {
    uint64_t id, t0;
    uint32_t peer, pages, need, cap, npages, req_max;
    bool fixed, too_big, nofit;
    stage_ask_phase_t phase;
    bool silent;   /* try_acquire's BUSY: nothing counted, nothing logged */
    bool blocked;  /* it parked */
    bool via_park; /* granted to it as a waiter (it holds a waiter's lease) */
    bool capped;   /* timed out passed over for its peer's cap */
    uint32_t rec, fresh;
    uint32_t free_at_park, free_now, held_now;
} stage_ask_t;

/* The one failure line of an acquire (level and wording by outcome); returns rc. */
static int stage_acquire_fail(const stage_ask_t *q, int rc)
{
    char why[192];
    int level = PKV_LOG_ERROR;
    double ms = (double)(pkv_now_ns() - q->t0) / 1e6;
    if (q->phase == ASK_ARGS) {
        snprintf(why, sizeof(why), "invalid argument%s", q->pages == 0 ? " (0 pages)" : "");
    } else if (q->phase == ASK_SETUP) {
        snprintf(why, sizeof(why), "out of memory");
    } else if (q->phase == ASK_COMMIT && rc == PKV_ERR_NOMEM) {
        snprintf(why, sizeof(why), "nomem (the OS refused to commit %u pages; pages free %u of %u)",
                 q->fresh, q->free_now, q->npages);
    } else if (q->phase == ASK_COMMIT) {
        level = PKV_LOG_WARN;
        snprintf(why, sizeof(why), "cancelled before the acquire returned (pages free %u of %u)",
                 q->free_now, q->npages);
    } else if (rc == PKV_ERR_NOFIT && q->too_big) {
        snprintf(why, sizeof(why), "nofit (larger than %s of %u pages; pages free %u of %u)",
                 q->fixed ? "a slot" : "the arena", q->req_max, q->free_now, q->npages);
    } else if (rc == PKV_ERR_NOFIT) {
        snprintf(why, sizeof(why),
                 "nofit (needs %u pages, over the per-peer cap of %u; peer holds %u; pages "
                 "free %u of %u)",
                 q->need, q->cap, q->held_now, q->free_now, q->npages);
    } else if (rc == PKV_ERR_TIMEOUT && q->capped) {
        snprintf(why, sizeof(why),
                 "timeout after %.1f ms (peer holds %u of its cap %u; pages free %u of %u)", ms,
                 q->held_now, q->cap, q->free_now, q->npages);
    } else if (rc == PKV_ERR_TIMEOUT) {
        snprintf(why, sizeof(why), "timeout after %.1f ms (pages free %u of %u; needs %u)", ms,
                 q->free_now, q->npages, q->need);
    } else if (rc == PKV_ERR_BUSY) {
        snprintf(why, sizeof(why), "busy (the transfer id is already live; pages free %u of %u)",
                 q->free_now, q->npages);
    } else {
        level = PKV_LOG_WARN;
        snprintf(why, sizeof(why), "%s after %.1f ms (pages free %u of %u)", pkv_status_str(rc), ms,
                 q->free_now, q->npages);
    }
    pkv_log(level, STAGE_LOG, "acquire transfer=%" PRIu64 " peer=%u pages=%u: %s", q->id, q->peer,
            q->pages, why);
    return rc;
}

/* Decide under the lock: refuse, grant at once, or park until served. `try_only`: grant
 * only what can be granted at once (no one waiting ahead, fits now, under the cap);
 * anything else is a silent PKV_ERR_BUSY with nothing counted and nothing changed. */
static int stage_decide(pkv_stage_t *st, stage_ask_t *q, stage_waiter_t *w, pkv_stage_grant_t *g,
                        uint64_t deadline_ns, bool try_only, const atomic_bool *abort)
{
    const bool live = xfer_find(st, q->id) || waiter_find(st, q->id);
    /* Nobody queued ahead, under the peer's cap, and the pages are free now. */
    const bool at_once = !st->wait_head && !(q->cap && peer_held(st, q->peer) + q->need > q->cap) &&
                         stage_alloc_fits(&st->alloc, q->need);
    if (try_only && (q->nofit || st->shutdown || live || !at_once)) {
        q->silent = true;
        return PKV_ERR_BUSY;
    }
    if (q->nofit) {
        st->stats.nofit++;
        return PKV_ERR_NOFIT;
    }
    if (st->shutdown) {
        st->stats.shutdowns++;
        return PKV_ERR_SHUTDOWN;
    }
    if (live) return PKV_ERR_BUSY;
    if (abort && atomic_load(abort)) {
        /* The caller's cancel ran before we took the lock and found nothing to cancel. */
        st->stats.cancelled++;
        return PKV_ERR_CANCELLED;
    }
    if (at_once) {
        q->rec = stage_grant(st, q->id, q->peer, q->pages, g, &q->fresh);
        return PKV_OK;
    }
    q->free_at_park = st->alloc.free_pages;
    int rc = stage_park(st, w, deadline_ns, &q->blocked);
    q->capped = w->capped;
    if (rc == PKV_OK) {
        q->rec = w->rec;
        q->via_park = true;
        for (uint32_t r = 0; r < g->nruns; r++)
            for (uint32_t p = 0; p < g->runs[r].count; p++)
                q->fresh += st->fresh[g->runs[r].page + p] ? 1 : 0;
    } else if (rc == PKV_ERR_SHUTDOWN) {
        st->stats.shutdowns++;
    } else if (rc == PKV_ERR_CANCELLED) {
        st->stats.cancelled++;
    }
    if (q->blocked) wait_hist_add(st, pkv_now_ns() - q->t0);
    return rc;
}

/* After a grant, outside the lock: commit its fresh pages (the internal lease keeps them
 * ours), then drop that lease. PKV_ERR_NOMEM: the OS refused the commit, the grant is
 * undone; PKV_ERR_CANCELLED: a cancel came before we returned. */
static int stage_commit_grant(pkv_stage_t *st, stage_ask_t *q, const pkv_stage_grant_t *g)
{
    if (!q->fresh && !q->via_park) return PKV_OK;
    int crc = q->fresh ? stage_commit_fresh(st, g) : PKV_OK;
    if (crc) stage_uncommit_grant(st, g);
    pthread_mutex_lock(&st->lock);
    if (q->fresh) stage_settle_fresh(st, g, crc == PKV_OK);
    stage_xfer_t *x = &st->xfers[q->rec];
    PKV_ASSERT(x->id == q->id && x->leases > 0);
    bool cancelled = x->state != XFER_HOLD;
    if (crc) x->state = XFER_CANCELLED;
    if (--x->leases == 0 && x->state != XFER_HOLD) stage_free_xfer(st, x);
    q->free_now = st->alloc.free_pages;
    pthread_mutex_unlock(&st->lock);
    q->phase = ASK_COMMIT;
    if (crc) return PKV_ERR_NOMEM;
    return cancelled ? PKV_ERR_CANCELLED : PKV_OK;
}

/* acquire, acquire_abortable and try_acquire: check, make the grant and the waiter's
 * condition (outside the lock), decide (under it), commit (outside it again). */
static int stage_acquire(pkv_stage_t *st, uint64_t transfer_id, uint32_t peer, uint32_t pages,
                         uint64_t deadline_ns, bool try_only, const atomic_bool *abort,
                         pkv_stage_grant_t **out)
{
    stage_ask_t q = {.id = transfer_id, .peer = peer, .pages = pages, .rec = STAGE_NONE};
    if (!st || !out || pages == 0) return stage_acquire_fail(&q, PKV_ERR_INVALID);
    q.t0 = pkv_now_ns();
    q.cap = st->cfg.peer_cap_pages;
    q.npages = st->npages;
    q.req_max = st->req_max;
    q.fixed = st->cfg.mode == PKV_STAGE_FIXED_SLOTS;
    q.too_big = pages > q.req_max;
    q.need = q.too_big ? pages : stage_alloc_need(&st->alloc, pages);
    q.nofit = q.too_big || (q.cap && q.need > q.cap);
    q.phase = ASK_SETUP;
    pkv_stage_grant_t *g = NULL;
    stage_waiter_t w = {.id = transfer_id, .peer = peer, .asked = pages, .need = q.need};
    if (!q.nofit) {
        uint32_t runs = PKV_MIN(q.need, st->runs_cap);
        g = pkv_fault_hit(PKV_FAULT_ALLOC)
                ? NULL
                : malloc(sizeof(*g) + (size_t)runs * sizeof(pkv_stage_run_t));
        if (!g || pkv_cond_init_monotonic(&w.cond)) {
            free(g);
            return stage_acquire_fail(&q, PKV_ERR_NOMEM);
        }
        w.grant = g;
    }

    q.phase = ASK_DECIDE;
    pthread_mutex_lock(&st->lock);
    int rc = stage_decide(st, &q, &w, g, deadline_ns, try_only, abort);
    q.free_now = st->alloc.free_pages;
    q.held_now = rc != PKV_OK ? peer_held(st, peer) : 0;
    pthread_mutex_unlock(&st->lock);
    if (!q.nofit) pthread_cond_destroy(&w.cond);

    if (rc == PKV_OK) {
        g->wait_ns = q.blocked ? pkv_now_ns() - q.t0 : 0;
        if (q.blocked)
            PKV_LOGD(STAGE_LOG,
                     "acquire transfer=%" PRIu64 " peer=%u pages=%u: waited %.2f ms (pages free "
                     "%u of %u when it parked, %u committed fresh)",
                     transfer_id, peer, pages, (double)g->wait_ns / 1e6, q.free_at_park, q.npages,
                     q.fresh);
        rc = stage_commit_grant(st, &q, g);
        if (rc == PKV_OK) {
            *out = g;
            return PKV_OK;
        }
    }
    free(g);
    return q.silent ? rc : stage_acquire_fail(&q, rc);
}

int pkv_stage_acquire(pkv_stage_t *st, uint64_t transfer_id, uint32_t peer, uint32_t pages,
                      uint64_t deadline_ns, pkv_stage_grant_t **out)
{
    return stage_acquire(st, transfer_id, peer, pages, deadline_ns, false, NULL, out);
}

int pkv_stage_acquire_abortable(pkv_stage_t *st, uint64_t transfer_id, uint32_t peer,
                                uint32_t pages, uint64_t deadline_ns, const atomic_bool *abort,
                                pkv_stage_grant_t **out)
{
    return stage_acquire(st, transfer_id, peer, pages, deadline_ns, false, abort, out);
}

int pkv_stage_try_acquire(pkv_stage_t *st, uint64_t transfer_id, uint32_t peer, uint32_t pages,
                          pkv_stage_grant_t **out)
{
    return stage_acquire(st, transfer_id, peer, pages, PKV_DEADLINE_NEVER, true, NULL, out);
}

/* ---- release, cancel, leases -------------------------------------------------------- */

int pkv_stage_release(pkv_stage_t *st, uint64_t transfer_id)
{
    if (!st) return PKV_ERR_INVALID;
    pthread_mutex_lock(&st->lock);
    stage_xfer_t *x = xfer_find(st, transfer_id);
    int rc = PKV_OK;
    if (!x) {
        rc = PKV_ERR_NOTFOUND;
    } else if (x->state == XFER_CANCELLED) {
        rc = PKV_ERR_CANCELLED;
    } else if (x->state != XFER_HOLD) {
        rc = PKV_ERR_NOTFOUND;
    } else {
        st->stats.releases++;
        if (x->leases) {
            x->state = XFER_RELEASED;
            st->stats.deferred_releases++;
        } else {
            stage_free_xfer(st, x);
        }
    }
    pthread_mutex_unlock(&st->lock);
    return rc;
}

int pkv_stage_cancel(pkv_stage_t *st, uint64_t transfer_id)
{
    if (!st) return PKV_ERR_INVALID;
    pthread_mutex_lock(&st->lock);
    int rc = PKV_OK;
    stage_waiter_t *w = waiter_find(st, transfer_id);
    stage_xfer_t *x;
    if (w) {
        waiter_unlink(st, w);
        w->status = PKV_ERR_CANCELLED;
        pthread_cond_signal(&w->cond);
        stage_serve(st); /* it may have held the head of the line */
    } else if ((x = xfer_find(st, transfer_id)) && x->state == XFER_HOLD) {
        st->stats.releases++;
        if (x->leases) {
            x->state = XFER_CANCELLED;
            st->stats.deferred_releases++;
        } else {
            stage_free_xfer(st, x);
        }
    } else {
        rc = PKV_ERR_NOTFOUND;
    }
    pthread_mutex_unlock(&st->lock);
    return rc;
}

int pkv_stage_lease_begin(pkv_stage_t *st, uint64_t transfer_id)
{
    if (!st) return PKV_ERR_INVALID;
    pthread_mutex_lock(&st->lock);
    int rc = PKV_OK;
    stage_xfer_t *x = xfer_find(st, transfer_id);
    if (st->shutdown)
        rc = PKV_ERR_SHUTDOWN;
    else if (!x)
        rc = PKV_ERR_NOTFOUND;
    else if (x->state != XFER_HOLD)
        rc = PKV_ERR_CANCELLED;
    else
        x->leases++;
    pthread_mutex_unlock(&st->lock);
    return rc;
}

int pkv_stage_lease_end(pkv_stage_t *st, uint64_t transfer_id)
{
    if (!st) return PKV_ERR_INVALID;
    pthread_mutex_lock(&st->lock);
    int rc = PKV_OK;
    stage_xfer_t *x = xfer_find(st, transfer_id);
    if (!x || x->leases == 0) {
        rc = PKV_ERR_NOTFOUND;
    } else if (--x->leases == 0 && x->state != XFER_HOLD) {
        stage_free_xfer(st, x);
    }
    pthread_mutex_unlock(&st->lock);
    return rc;
}

/* ---- lookups and counters ---------------------------------------------------------- */

void *pkv_stage_page_addr(const pkv_stage_t *st, uint32_t page)
{
    if (!st || page >= st->npages) return NULL;
    return st->base + (size_t)page * st->page_bytes;
}

size_t pkv_stage_page_bytes(const pkv_stage_t *st)
{
    return st ? st->page_bytes : 0;
}

uint32_t pkv_stage_pool_pages(const pkv_stage_t *st)
{
    return st ? st->npages : 0;
}

int pkv_stage_memfd(const pkv_stage_t *st)
{
    return st ? st->memfd : -1;
}

/* The stats now; the caller holds st->lock. */
static void stats_locked(const pkv_stage_t *st, pkv_stage_stats_t *out)
{
    *out = st->stats;
    out->pages_free = st->alloc.free_pages;
    out->pages_returning = st->returning;
    out->pages_used = st->npages - st->alloc.free_pages - st->returning;
    out->waiting = st->nwaiting;
    out->warm_floor_pages = stage_floor(st, pkv_now_ns(), NULL);
}

int pkv_stage_stats(pkv_stage_t *st, pkv_stage_stats_t *out)
{
    if (!st || !out) return PKV_ERR_INVALID;
    pthread_mutex_lock(&st->lock);
    stats_locked(st, out);
    pthread_mutex_unlock(&st->lock);
    return PKV_OK;
}

int pkv_stage_peaks_reset(pkv_stage_t *st, pkv_stage_stats_t *out)
{
    if (!st || !out) return PKV_ERR_INVALID;
    pthread_mutex_lock(&st->lock);
    stats_locked(st, out);
    pkv_stage_stats_t *k = &st->stats;
    /* the acquire path's measure of pages in use (returning pages count until freed) */
    k->pages_peak_used = st->npages - st->alloc.free_pages;
    k->pages_asked_peak = k->pages_asked_inflight;
    k->resident_peak_bytes = k->resident_bytes;
    k->transfers_peak = k->transfers_live;
    pthread_mutex_unlock(&st->lock);
    return PKV_OK;
}

int pkv_stage_peer_stats(pkv_stage_t *st, uint32_t peer, pkv_stage_peer_stats_t *out)
{
    if (!st || !out) return PKV_ERR_INVALID;
    pthread_mutex_lock(&st->lock);
    pkv_stage_peer_stats_t s = {.peer = peer, .held_pages = peer_held(st, peer)};
    for (stage_waiter_t *w = st->wait_head; w; w = w->next) s.waiting += w->peer == peer;
    pthread_mutex_unlock(&st->lock);
    *out = s;
    return PKV_OK;
}

int pkv_stage_peers(pkv_stage_t *st, pkv_stage_peer_stats_t *out, size_t cap, size_t *n)
{
    if (!st || !n || (cap && !out)) return PKV_ERR_INVALID;
    size_t k = 0, total = 0;
    pthread_mutex_lock(&st->lock);
    for (uint32_t i = 0; i < st->hash_cap; i++) {
        if (!st->peers[i].held) continue;
        if (k < cap) {
            out[k] = (pkv_stage_peer_stats_t){.peer = st->peers[i].peer,
                                              .held_pages = st->peers[i].held};
            for (stage_waiter_t *w = st->wait_head; w; w = w->next)
                out[k].waiting += w->peer == out[k].peer;
            k++;
        }
        total++;
    }
    /* Peers with waiters but nothing held. */
    for (stage_waiter_t *w = st->wait_head; w; w = w->next) {
        if (peer_held(st, w->peer)) continue;
        bool seen = false;
        for (stage_waiter_t *v = st->wait_head; v != w; v = v->next)
            if (v->peer == w->peer) seen = true;
        if (seen) continue;
        if (k < cap) {
            out[k] = (pkv_stage_peer_stats_t){.peer = w->peer};
            for (stage_waiter_t *v = w; v; v = v->next) out[k].waiting += v->peer == w->peer;
            k++;
        }
        total++;
    }
    pthread_mutex_unlock(&st->lock);
    *n = k;
    return total > k ? PKV_ERR_NOSPACE : PKV_OK;
}
