/*
 * stage_alloc: page allocator of the staging arena. See stage_int.h for the design.
 * No locking here: the caller (stage.c) holds the stage mutex around every call.
 */
#include "stage/stage_int.h"

#include "core/core.h"

#include <stdlib.h>
#include <string.h>

/* How many extents of the request's own size class to look at for a fit. */
#define STAGE_FIT_SCAN 16

static uint32_t bin_of(uint32_t len)
{
    return 31u - (uint32_t)__builtin_clz(len);
}

int stage_alloc_init(stage_alloc_t *a, pkv_stage_mode_t mode, uint32_t npages, uint32_t slot_pages)
{
    memset(a, 0, sizeof(*a));
    if (npages == 0) return PKV_ERR_INVALID;
    if (pkv_fault_hit(PKV_FAULT_ALLOC)) return PKV_ERR_NOMEM; /* as if the tables failed */
    a->mode = mode;
    a->npages = npages;
    a->state = calloc(npages, 1);
    a->warm = calloc(npages, 1);
    a->freed_at = calloc(npages, sizeof(uint64_t));
    a->len = calloc(npages, sizeof(uint32_t));
    a->start_of = calloc(npages, sizeof(uint32_t));
    a->bin_next = calloc(npages, sizeof(uint32_t));
    a->bin_prev = calloc(npages, sizeof(uint32_t));
    if (!a->state || !a->warm || !a->freed_at || !a->len || !a->start_of || !a->bin_next ||
        !a->bin_prev)
        goto fail;
    for (uint32_t b = 0; b < STAGE_BINS; b++) a->bin_head[b] = a->bin_tail[b] = STAGE_NONE;
    if (mode == PKV_STAGE_FIXED_SLOTS) {
        if (slot_pages == 0 || npages % slot_pages) goto fail_invalid;
        a->slot_pages = slot_pages;
        a->nslots = npages / slot_pages;
        a->slot_free = calloc(a->nslots, sizeof(uint32_t));
        if (!a->slot_free) goto fail;
        /* Slot 0 on top: the first transfers land at the start of the arena. */
        for (uint32_t i = 0; i < a->nslots; i++) {
            a->slot_free[i] = a->nslots - 1 - i;
            a->len[i * slot_pages] = slot_pages;
        }
        a->nfree_slots = a->nslots;
    } else {
        a->len[0] = npages;
        a->start_of[npages - 1] = 0;
        a->bin_next[0] = a->bin_prev[0] = STAGE_NONE;
        uint32_t b = bin_of(npages);
        a->bin_head[b] = a->bin_tail[b] = 0;
        a->bin_mask = 1u << b;
    }
    a->free_pages = npages;
    return PKV_OK;

fail_invalid:
    stage_alloc_fini(a);
    return PKV_ERR_INVALID;
fail:
    stage_alloc_fini(a);
    return PKV_ERR_NOMEM;
}

void stage_alloc_fini(stage_alloc_t *a)
{
    free(a->state);
    free(a->warm);
    free(a->freed_at);
    free(a->len);
    free(a->start_of);
    free(a->bin_next);
    free(a->bin_prev);
    free(a->slot_free);
    memset(a, 0, sizeof(*a));
}

/* ---- bins -------------------------------------------------------------------------- */

static void bin_remove(stage_alloc_t *a, uint32_t s)
{
    uint32_t b = bin_of(a->len[s]);
    uint32_t n = a->bin_next[s], p = a->bin_prev[s];
    if (p != STAGE_NONE)
        a->bin_next[p] = n;
    else
        a->bin_head[b] = n;
    if (n != STAGE_NONE)
        a->bin_prev[n] = p;
    else
        a->bin_tail[b] = p;
    if (a->bin_head[b] == STAGE_NONE) a->bin_mask &= ~(1u << b);
}

/* Record [s, s+len) as one free extent and file it: at the head (warm first) or tail. */
static void extent_insert(stage_alloc_t *a, uint32_t s, uint32_t len, bool at_tail)
{
    a->len[s] = len;
    a->start_of[s + len - 1] = s;
    uint32_t b = bin_of(len);
    if (a->bin_head[b] == STAGE_NONE) {
        a->bin_next[s] = a->bin_prev[s] = STAGE_NONE;
        a->bin_head[b] = a->bin_tail[b] = s;
        a->bin_mask |= 1u << b;
    } else if (at_tail) {
        uint32_t t = a->bin_tail[b];
        a->bin_next[t] = s;
        a->bin_prev[s] = t;
        a->bin_next[s] = STAGE_NONE;
        a->bin_tail[b] = s;
    } else {
        uint32_t h = a->bin_head[b];
        a->bin_prev[h] = s;
        a->bin_next[s] = h;
        a->bin_prev[s] = STAGE_NONE;
        a->bin_head[b] = s;
    }
}

/* First page a carve of n pages from free extent s takes: the warm end, so cold pages
 * stay cold as long as possible. */
static uint32_t carve_from(const stage_alloc_t *a, uint32_t s, uint32_t n)
{
    uint32_t len = a->len[s];
    if (n < len && a->warm[s + len - 1] != STAGE_COLD && a->warm[s] == STAGE_COLD)
        return s + len - n;
    return s;
}

/* Cold pages among the n a carve from s would take, counting no further than `stop`. */
static uint32_t carve_cold(const stage_alloc_t *a, uint32_t s, uint32_t n, uint32_t stop)
{
    uint32_t from = carve_from(a, s, n), c = 0;
    for (uint32_t p = from; p < from + n && c < stop; p++) c += a->warm[p] == STAGE_COLD;
    return c;
}

/* A free extent with len >= n, or STAGE_NONE: among a few of the request's own size class
 * and the head of each larger class, the one whose carve takes the fewest cold pages
 * (the first all-warm one ends the search); *cold says how many. */
static uint32_t extent_find_fit(const stage_alloc_t *a, uint32_t n, uint32_t *cold)
{
    uint32_t b = bin_of(n), best = STAGE_NONE, best_cold = UINT32_MAX;
    uint32_t s = a->bin_head[b];
    for (int i = 0; s != STAGE_NONE && i < STAGE_FIT_SCAN && best_cold; i++, s = a->bin_next[s]) {
        if (a->len[s] < n) continue;
        uint32_t c = carve_cold(a, s, n, best_cold);
        if (c < best_cold) best = s, best_cold = c;
    }
    uint32_t above = b + 1 < STAGE_BINS ? a->bin_mask & ~((2u << b) - 1u) : 0;
    for (; above && best_cold; above &= above - 1) {
        s = a->bin_head[__builtin_ctz(above)];
        uint32_t c = carve_cold(a, s, n, best_cold);
        if (c < best_cold) best = s, best_cold = c;
    }
    *cold = best_cold;
    return best;
}

/* The largest free extent (scanning the highest non-empty bin). */
static uint32_t extent_largest(const stage_alloc_t *a)
{
    PKV_ASSERT(a->bin_mask);
    uint32_t b = 31u - (uint32_t)__builtin_clz(a->bin_mask);
    uint32_t best = a->bin_head[b];
    for (uint32_t s = a->bin_next[best]; s != STAGE_NONE; s = a->bin_next[s])
        if (a->len[s] > a->len[best]) best = s;
    return best;
}

static void mark_used(stage_alloc_t *a, uint32_t s, uint32_t n)
{
    memset(a->state + s, STAGE_PAGE_USED, n);
    a->len[s] = n;
    a->free_pages -= n;
}

/* Take the n pages at `from` out of free extent s that holds them (STAGE_NONE: find it);
 * what is left of the extent on either side stays free. */
static void extent_take(stage_alloc_t *a, uint32_t s, uint32_t from, uint32_t n)
{
    if (s == STAGE_NONE)
        for (s = from; s > 0 && a->state[s - 1] == STAGE_PAGE_FREE;) s--; /* maximal */
    uint32_t len = a->len[s];
    PKV_ASSERT(a->state[s] == STAGE_PAGE_FREE && from + n <= s + len);
    bin_remove(a, s);
    if (from > s) extent_insert(a, s, from - s, false);
    if (from + n < s + len) extent_insert(a, from + n, s + len - from - n, false);
    mark_used(a, from, n);
}

/* Take n pages from free extent s (its warm end) as the grant's next run. */
static void carve_into(stage_alloc_t *a, uint32_t s, uint32_t n, stage_span_t *out, uint32_t *nruns)
{
    uint32_t from = carve_from(a, s, n);
    extent_take(a, s, from, n);
    out[(*nruns)++] = (stage_span_t){from, n};
}

static int span_cmp(const void *x, const void *y)
{
    const stage_span_t *a = x, *b = y;
    return a->page < b->page ? -1 : a->page > b->page;
}

/* The grant's runs in page order, runs that touch merged into one (a used span keeps its
 * length at its first page). Returns the runs left. */
static uint32_t runs_merge(stage_alloc_t *a, stage_span_t *out, uint32_t n)
{
    if (n < 2) return n;
    qsort(out, n, sizeof(*out), span_cmp);
    uint32_t m = 0;
    for (uint32_t r = 1; r < n; r++) {
        if (out[m].page + out[m].count == out[r].page) {
            out[m].count += out[r].count;
            a->len[out[m].page] = out[m].count;
        } else {
            out[++m] = out[r];
        }
    }
    return m + 1;
}

/* Take up to need warm free pages from the largest warm pieces, at most STAGE_WARM_RUNS
 * (and cap) of them, largest first, so that nothing is committed while committed pages
 * sit free in pieces no single extent holds. Returns the pages taken (runs in out[0..*n)).
 * O(npages). */
static uint32_t take_warm(stage_alloc_t *a, uint32_t need, stage_span_t *out, uint32_t cap,
                          uint32_t *n)
{
    stage_span_t top[STAGE_WARM_RUNS];
    uint32_t most = PKV_MIN(cap, STAGE_WARM_RUNS);
    uint32_t ntop = 0;
    for (uint32_t p = 0; p < a->npages; p += a->len[p]) {
        if (a->state[p] != STAGE_PAGE_FREE) continue;
        for (uint32_t q = p, end = p + a->len[p]; q < end;) {
            uint32_t r = q;
            while (r < end && a->warm[r] != STAGE_COLD) r++;
            if (r > q && (ntop < most || r - q > top[ntop - 1].count)) {
                uint32_t k = ntop < most ? ntop++ : ntop - 1;
                for (; k > 0 && top[k - 1].count < r - q; k--) top[k] = top[k - 1];
                top[k] = (stage_span_t){q, r - q};
            }
            q = r + 1;
        }
    }
    uint32_t taken = 0;
    *n = 0;
    for (uint32_t k = 0; k < ntop && taken < need; k++) {
        uint32_t m = PKV_MIN(top[k].count, need - taken);
        extent_take(a, STAGE_NONE, top[k].page, m);
        out[(*n)++] = (stage_span_t){top[k].page, m};
        taken += m;
    }
    return taken;
}

uint32_t stage_alloc_need(const stage_alloc_t *a, uint32_t asked)
{
    return a->mode == PKV_STAGE_FIXED_SLOTS ? a->slot_pages : asked;
}

bool stage_alloc_fits(const stage_alloc_t *a, uint32_t need)
{
    if (a->mode == PKV_STAGE_FIXED_SLOTS) return need <= a->slot_pages && a->nfree_slots > 0;
    return need > 0 && need <= a->free_pages;
}

uint32_t stage_alloc_take(stage_alloc_t *a, uint32_t need, stage_span_t *out, uint32_t cap)
{
    PKV_ASSERT(stage_alloc_fits(a, need) && cap >= 1);
    if (a->mode == PKV_STAGE_FIXED_SLOTS) {
        uint32_t slot = a->slot_free[--a->nfree_slots];
        out[0].page = slot * a->slot_pages;
        out[0].count = a->slot_pages;
        mark_used(a, out[0].page, a->slot_pages);
        return 1;
    }
    /* One extent when one fits without committing; else the warm pieces (up to 8), and
     * the rest from one extent committing the fewest, else the largest first. */
    uint32_t cold, s = extent_find_fit(a, need, &cold), n = 0;
    if (s != STAGE_NONE && cold == 0) {
        carve_into(a, s, need, out, &n);
        return 1;
    }
    uint32_t left = need - take_warm(a, need, out, cap, &n);
    while (left) {
        PKV_ASSERT(n < cap);
        s = extent_find_fit(a, left, &cold);
        if (s == STAGE_NONE) s = extent_largest(a);
        uint32_t m = PKV_MIN(a->len[s], left); /* the largest may fit: a class's short scan */
        carve_into(a, s, m, out, &n);
        left -= m;
    }
    return runs_merge(a, out, n);
}

/* Put [s, s+n) back as free, merging with free neighbours. */
static void extent_free(stage_alloc_t *a, uint32_t s, uint32_t n, bool cold)
{
    memset(a->state + s, STAGE_PAGE_FREE, n);
    a->free_pages += n;
    uint32_t start = s, len = n;
    if (s > 0 && a->state[s - 1] == STAGE_PAGE_FREE) {
        uint32_t ls = a->start_of[s - 1];
        bin_remove(a, ls);
        len += a->len[ls];
        start = ls;
    }
    if (s + n < a->npages && a->state[s + n] == STAGE_PAGE_FREE) {
        uint32_t rs = s + n;
        bin_remove(a, rs);
        len += a->len[rs];
    }
    extent_insert(a, start, len, cold);
}

void stage_alloc_give(stage_alloc_t *a, uint32_t page, uint32_t count, uint64_t now)
{
    PKV_ASSERT(page < a->npages && count == a->len[page] && a->state[page] == STAGE_PAGE_USED);
    for (uint32_t p = page; p < page + count; p++) a->freed_at[p] = now;
    if (a->mode == PKV_STAGE_FIXED_SLOTS) {
        memset(a->state + page, STAGE_PAGE_FREE, count);
        a->free_pages += count;
        a->slot_free[a->nfree_slots++] = page / a->slot_pages;
        return;
    }
    extent_free(a, page, count, false);
}

/* A warm free page freed at or before cutoff (the page's state is checked by the caller). */
static bool page_idle(const stage_alloc_t *a, uint32_t q, uint64_t cutoff)
{
    return a->warm[q] != STAGE_COLD && a->freed_at[q] <= cutoff;
}

/* The first page idle release may take: below it, the lowest idle free pages beyond the
 * `most` highest stay. 0 when there are at most `most` of them. */
static uint32_t idle_floor_end(const stage_alloc_t *a, uint64_t cutoff, uint32_t most)
{
    uint32_t idle = 0;
    for (uint32_t p = 0; p < a->npages; p += a->len[p])
        if (a->state[p] == STAGE_PAGE_FREE)
            for (uint32_t q = p; q < p + a->len[p]; q++) idle += page_idle(a, q, cutoff);
    if (idle <= most) return 0;
    uint32_t skip = idle - most;
    for (uint32_t p = 0; p < a->npages; p += a->len[p])
        if (a->state[p] == STAGE_PAGE_FREE)
            for (uint32_t q = p; q < p + a->len[p]; q++)
                if (page_idle(a, q, cutoff) && !--skip) return q + 1;
    PKV_ASSERT(0);
    return a->npages;
}

uint32_t stage_alloc_collect_idle(stage_alloc_t *a, uint64_t cutoff, uint32_t most,
                                  stage_span_t *out, uint32_t cap, uint64_t *next_freed)
{
    uint64_t next = UINT64_MAX;
    uint32_t n = 0;
    PKV_ASSERT(cap >= a->npages);
    if (a->mode == PKV_STAGE_FIXED_SLOTS) {
        uint32_t keep = 0;
        for (uint32_t i = 0; i < a->nfree_slots; i++) {
            uint32_t slot = a->slot_free[i], p = slot * a->slot_pages;
            if (page_idle(a, p, cutoff) && most >= a->slot_pages) {
                most -= a->slot_pages;
                memset(a->state + p, STAGE_PAGE_OFF, a->slot_pages);
                a->free_pages -= a->slot_pages;
                out[n].page = p;
                out[n++].count = a->slot_pages;
                continue;
            }
            if (a->warm[p] != STAGE_COLD && a->freed_at[p] > cutoff)
                next = PKV_MIN(next, a->freed_at[p]);
            a->slot_free[keep++] = slot;
        }
        a->nfree_slots = keep;
        *next_freed = next;
        return n;
    }
    uint32_t lo = idle_floor_end(a, cutoff, most);
    for (uint32_t p = 0; p < a->npages;) {
        uint32_t len = a->len[p];
        PKV_ASSERT(len > 0 && p + len <= a->npages);
        if (a->state[p] != STAGE_PAGE_FREE) {
            p += len;
            continue;
        }
        /* Free extent [p, p+len): split into pieces kept free and pieces taken off. */
        uint32_t end = p + len;
        bool any = false;
        for (uint32_t q = PKV_MAX(p, lo); q < end && !any; q++) any = page_idle(a, q, cutoff);
        if (any) bin_remove(a, p);
        for (uint32_t q = p; q < end;) {
            bool off = q >= lo && page_idle(a, q, cutoff);
            uint32_t r = q + 1;
            while (r < end && (r >= lo && page_idle(a, r, cutoff)) == off) r++;
            if (off) {
                memset(a->state + q, STAGE_PAGE_OFF, r - q);
                a->len[q] = r - q;
                a->free_pages -= r - q;
                out[n].page = q;
                out[n++].count = r - q;
            } else {
                for (uint32_t k = q; k < r; k++)
                    if (a->warm[k] != STAGE_COLD && a->freed_at[k] > cutoff)
                        next = PKV_MIN(next, a->freed_at[k]);
                if (any) extent_insert(a, q, r - q, false);
            }
            q = r;
        }
        p = end;
    }
    *next_freed = next;
    return n;
}

void stage_alloc_return_cold(stage_alloc_t *a, uint32_t page, uint32_t count)
{
    PKV_ASSERT(page < a->npages && count == a->len[page] && a->state[page] == STAGE_PAGE_OFF);
    memset(a->warm + page, STAGE_COLD, count);
    if (a->mode == PKV_STAGE_FIXED_SLOTS) {
        memset(a->state + page, STAGE_PAGE_FREE, count);
        a->free_pages += count;
        /* Cold slots go to the bottom of the stack: warm ones are reused first. */
        memmove(a->slot_free + 1, a->slot_free, a->nfree_slots * sizeof(uint32_t));
        a->slot_free[0] = page / a->slot_pages;
        a->nfree_slots++;
        return;
    }
    extent_free(a, page, count, true);
}

void stage_alloc_check(const stage_alloc_t *a)
{
    uint32_t free_seen = 0;
    if (a->mode == PKV_STAGE_FIXED_SLOTS) {
        for (uint32_t i = 0; i < a->nfree_slots; i++) {
            uint32_t p = a->slot_free[i] * a->slot_pages;
            PKV_ASSERT(a->slot_free[i] < a->nslots);
            for (uint32_t k = 0; k < a->slot_pages; k++)
                PKV_ASSERT(a->state[p + k] == STAGE_PAGE_FREE);
            free_seen += a->slot_pages;
        }
        PKV_ASSERT(free_seen == a->free_pages);
        return;
    }
    uint32_t extents = 0;
    for (uint32_t p = 0; p < a->npages;) {
        uint32_t len = a->len[p];
        PKV_ASSERT(len > 0 && p + len <= a->npages);
        for (uint32_t k = 1; k < len; k++) PKV_ASSERT(a->state[p + k] == a->state[p]);
        if (a->state[p] == STAGE_PAGE_FREE) {
            PKV_ASSERT(a->start_of[p + len - 1] == p);
            /* Maximal: no free neighbour on either side. */
            PKV_ASSERT(p == 0 || a->state[p - 1] != STAGE_PAGE_FREE);
            PKV_ASSERT(p + len == a->npages || a->state[p + len] != STAGE_PAGE_FREE);
            free_seen += len;
            extents++;
        }
        p += len;
    }
    PKV_ASSERT(free_seen == a->free_pages);
    uint32_t binned = 0;
    for (uint32_t b = 0; b < STAGE_BINS; b++) {
        PKV_ASSERT(((a->bin_mask >> b) & 1u) == (a->bin_head[b] != STAGE_NONE));
        uint32_t prev = STAGE_NONE;
        for (uint32_t s = a->bin_head[b]; s != STAGE_NONE; s = a->bin_next[s]) {
            PKV_ASSERT(a->state[s] == STAGE_PAGE_FREE && bin_of(a->len[s]) == b);
            PKV_ASSERT(a->bin_prev[s] == prev);
            prev = s;
            binned++;
        }
        PKV_ASSERT(a->bin_tail[b] == prev);
    }
    PKV_ASSERT(binned == extents);
}
