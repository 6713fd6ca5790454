/*
 * Private to src/stage/ and its tests; internals prefixed stage_ / STAGE_; interface: stage.h.
 *
 * stage_alloc: the page allocator behind the staging arena (stage_alloc.c).
 *
 * A plain data structure with no lock of its own: the stage's mutex guards every call.
 * It knows which pages are free, used or being returned to the OS ("off"), which are
 * committed ("warm"), and when each free page was last freed; it never calls the OS.
 *
 * Per-transfer mode: free pages form maximal extents (boundary tags: the length at the
 * first page, the start at the last page), kept in 32 size-class bins by floor(log2
 * length). A request is served by one extent when any extent is large enough (the
 * candidates: a short scan of the request's own class and the head of each larger one)
 * whose carve takes no cold page; else by the largest warm pieces (up to STAGE_WARM_RUNS
 * of them and the request: nothing is committed while committed pages sit free in
 * pieces) and the rest from one fitting extent, else from the largest extents first.
 * Runs that touch are merged; a grant has at most `need` runs. Freed extents go to
 * the head of their bin and extents coming back cold from the OS to the tail; when an
 * extent is split, the piece taken is the end that is warm.
 *
 * Fixed-slot mode: a stack of free slots; freed (warm) slots are pushed on top, slots
 * coming back cold go to the bottom.
 *
 * Used spans also keep their length at their first page, so pages tile as
 * [free extent | used span | off piece]... and a scan can hop from one to the next.
 */
#ifndef PKV_STAGE_INT_H
#define PKV_STAGE_INT_H

#include "pagekv/stage.h"

#include <stdbool.h>
#include <stdint.h>

#define STAGE_NONE UINT32_MAX
#define STAGE_BINS 32
/* Most warm pieces one grant takes before committing cold pages (stage_alloc_take). */
#define STAGE_WARM_RUNS 8

enum { STAGE_PAGE_FREE = 0, STAGE_PAGE_USED = 1, STAGE_PAGE_OFF = 2 };
enum { STAGE_COLD = 0, STAGE_WARM = 1, STAGE_WARM_PINNED = 2 };

typedef struct {
    uint32_t page;
    uint32_t count;
} stage_span_t;

typedef struct {
    pkv_stage_mode_t mode;
    uint32_t npages;
    uint32_t slot_pages; /* fixed: pages per slot */
    uint32_t nslots;     /* fixed */
    uint32_t free_pages;
    uint8_t *state;     /* (npages) STAGE_PAGE_* */
    uint8_t *warm;      /* (npages) STAGE_COLD / WARM / WARM_PINNED */
    uint64_t *freed_at; /* (npages) monotonic ns when the page was last freed */
    uint32_t *len;      /* (npages) at the first page of a free extent / used span */
    uint32_t *start_of; /* (npages) at the last page of a free extent: its first page */
    uint32_t *bin_next; /* (npages) at a free extent's first page: bin links */
    uint32_t *bin_prev;
    uint32_t bin_head[STAGE_BINS];
    uint32_t bin_tail[STAGE_BINS];
    uint32_t bin_mask;   /* bit b: bin b non-empty */
    uint32_t *slot_free; /* (nslots) fixed: free slot stack, top at [nfree_slots - 1] */
    uint32_t nfree_slots;
} stage_alloc_t;

/* Allocates the tables (outside any lock). All pages start free and cold. */
int stage_alloc_init(stage_alloc_t *a, pkv_stage_mode_t mode, uint32_t npages, uint32_t slot_pages);
void stage_alloc_fini(stage_alloc_t *a);

/* Pages a request of `asked` pages occupies (fixed mode: a whole slot). */
uint32_t stage_alloc_need(const stage_alloc_t *a, uint32_t asked);
/* Whether a request occupying `need` pages can be served now. */
bool stage_alloc_fits(const stage_alloc_t *a, uint32_t need);
/* Serve `need` pages (stage_alloc_fits must hold) into out[0..n), n <= cap returned.
 * cap >= need always suffices (cap >= 1 in fixed mode). Marks the pages used. */
uint32_t stage_alloc_take(stage_alloc_t *a, uint32_t need, stage_span_t *out, uint32_t cap);
/* Give a span from stage_alloc_take back (exactly as taken), freed at `now`. */
void stage_alloc_give(stage_alloc_t *a, uint32_t page, uint32_t count, uint64_t now);

/* Idle release, step 1: take out the warm free pages freed at or before `cutoff` (marked
 * off, no longer free), at most `most` of them (the highest-addressed; fixed: whole slots,
 * in stack order), as spans into out (cap >= npages); returns the spans' count. Sets
 * *next_freed to the earliest freed_at after cutoff of the warm free pages left
 * (UINT64_MAX: none): an idle page kept for `most` does not set it. */
uint32_t stage_alloc_collect_idle(stage_alloc_t *a, uint64_t cutoff, uint32_t most,
                                  stage_span_t *out, uint32_t cap, uint64_t *next_freed);
/* Step 2: a collected span comes back cold and free. */
void stage_alloc_return_cold(stage_alloc_t *a, uint32_t page, uint32_t count);

/* Debug validator: every invariant of the structure (O(npages)); aborts on a break. */
void stage_alloc_check(const stage_alloc_t *a);

#endif
