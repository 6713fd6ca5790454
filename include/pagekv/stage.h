/*
 * pagekv host staging: an arena of fixed-size pages that a transfer borrows while its
 * bytes are in flight between the KV pool and the network.
 *
 * Model
 *   - The arena holds `pool_pages` pages of `page_bytes` each (the hard cap). Address
 *     space is reserved at create; a page's memory is committed (and mlocked when `pin`)
 *     when a transfer first needs it and returned to the OS after it has stayed free for
 *     `idle_release_ns` (hysteresis), so resident memory follows the bytes in flight.
 *   - Mode PKV_STAGE_PER_TRANSFER (default): a transfer takes exactly the pages it asks
 *     for, in as few contiguous runs as the free space allows.
 *     Mode PKV_STAGE_FIXED_SLOTS: `slots` slots of `slot_pages` pages each; a transfer
 *     takes one whole slot whatever its size (the field's design, kept to compare).
 *   - `shared`: the arena is a memfd; a same-host peer maps pkv_stage_memfd() and finds
 *     run r of a grant at byte offset runs[r].offset.
 *
 * Transfers are named by a caller-chosen 64-bit id, unique among live transfers of one
 * stage (waiting, holding, or released with copies still running).
 *
 * Lifecycle of one transfer
 *   acquire(id, peer, pages, deadline) -> grant      pages owned by `id`
 *   lease_begin(id) ... lease_end(id)                 once per copy touching the pages
 *   release(id)  (or cancel(id) from any thread)      pages return once no copy runs
 * Pages stay owned until release/cancel AND every lease has ended, in either order: a
 * copy still running after a cancel or a timeout elsewhere never sees its pages reused.
 *
 * Failures are typed and each one logs exactly one line (module "stage") naming the
 * transfer id, the pages asked and the pages free (and the peer's holding when the
 * per-peer cap is the reason):
 *   PKV_ERR_NOFIT     at once: larger than the arena, a slot, or the per-peer cap
 *   PKV_ERR_TIMEOUT   the deadline passed before the pages came free
 *   PKV_ERR_SHUTDOWN  pkv_stage_shutdown() ran (before or during the wait)
 *   PKV_ERR_CANCELLED pkv_stage_cancel() named the waiting transfer
 *   PKV_ERR_BUSY      the id is already live
 *   PKV_ERR_NOMEM     the OS refused to commit the pages
 *   PKV_ERR_INVALID   bad arguments
 *
 * Fairness: waiters are served first-come first-served; a waiter that does not fit yet
 * holds the head of the line (later waiters wait behind it), except that a waiter whose
 * own peer is at its cap is passed over, so a stuck peer never delays anyone else.
 * See docs/design/stage.md.
 *
 * Thread safety: every call may run concurrently from any thread, except
 * pkv_stage_destroy (no call may start once it has begun, and none may still be
 * running when it returns PKV_OK).
 */
#ifndef PAGEKV_STAGE_H
#define PAGEKV_STAGE_H

#include "pagekv/export.h"

#include "pagekv/pagekv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pkv_stage pkv_stage_t;

typedef enum {
    PKV_STAGE_PER_TRANSFER = 0, /* exact pages per transfer (default) */
    PKV_STAGE_FIXED_SLOTS = 1,  /* N slots x M pages; a transfer takes a whole slot */
} pkv_stage_mode_t;

PKV_API const char *pkv_stage_mode_name(pkv_stage_mode_t mode);

typedef struct {
    size_t page_bytes;   /* bytes per page; a multiple of 4096 */
    uint32_t pool_pages; /* per_transfer: pages in the arena (the hard cap);
                            fixed_slots: 0 or slots * slot_pages */
    pkv_stage_mode_t mode;
    uint32_t slots;           /* fixed_slots: number of slots */
    uint32_t slot_pages;      /* fixed_slots: pages per slot */
    uint32_t peer_cap_pages;  /* most pages one peer may hold; 0 = no cap */
    uint64_t idle_release_ns; /* a free page is returned to the OS after staying free
                                 this long; 0 = at once; PKV_DEADLINE_NEVER = never */
    uint64_t warm_life_ns;    /* the warm floor: as many pages as the largest transfer
                                 seated in the last warm_life_ns stay committed past
                                 idle_release_ns (the lowest-addressed of the idle ones),
                                 so the first transfer after a quiet spell commits and
                                 first-touches nothing; 0 = no floor;
                                 at most a day */
    bool pin;                 /* mlock committed pages (counted when the OS refuses) */
    bool shared;              /* back the arena with a memfd (pkv_stage_memfd) */
    const char *name;         /* memfd / thread name tag; NULL = "pkv-stage" */
} pkv_stage_config_t;

/* Defaults: per_transfer, 64 KiB pages, 1024 pages, no peer cap, idle release 1 s,
 * no warm floor, pin on, shared off. */
PKV_API void pkv_stage_config_default(pkv_stage_config_t *cfg);

/* Create a stage. On success *out owns the arena and a reclaim thread; free with
 * pkv_stage_destroy. Bad config: PKV_ERR_INVALID with a logged reason, nothing made. */
PKV_API int pkv_stage_create(const pkv_stage_config_t *cfg, pkv_stage_t **out);

/* One contiguous run of pages in a grant. */
typedef struct {
    uint32_t page;   /* first page index in the arena */
    uint32_t count;  /* pages in the run */
    uint64_t offset; /* byte offset in the arena (and in the memfd) = page * page_bytes */
    void *addr;      /* address of the first page in this process */
} pkv_stage_run_t;

/* What acquire hands back. Owned by the caller: free with pkv_stage_grant_free (any
 * time; freeing it does not release the pages). The addresses are valid until the
 * transfer's pages return (release/cancel plus every lease ended). Logical page k of the
 * transfer is the k-th page walking runs[0..nruns) in order. */
typedef struct {
    uint64_t transfer_id;
    uint32_t peer;
    uint32_t pages_asked;
    uint32_t pages; /* pages owned: == pages_asked per_transfer, slot_pages fixed */
    uint32_t nruns;
    size_t page_bytes;
    uint64_t wait_ns;       /* time spent waiting for pages (0 when served at once) */
    pkv_stage_run_t runs[]; /* (nruns) */
} pkv_stage_grant_t;

PKV_API void pkv_stage_grant_free(pkv_stage_grant_t *grant);

/* Take `pages` pages for transfer `transfer_id` on behalf of `peer`, waiting on a
 * condition variable until `deadline_ns` (absolute CLOCK_MONOTONIC; PKV_DEADLINE_NEVER
 * waits until shutdown or cancel). On PKV_OK *out is a new grant. Errors: see above. */
PKV_API int pkv_stage_acquire(pkv_stage_t *st, uint64_t transfer_id, uint32_t peer, uint32_t pages,
                              uint64_t deadline_ns, pkv_stage_grant_t **out);

/* The same, but never waits: grants only when no acquire is parked ahead, the pages are
 * free now and the peer is under its cap. Anything else is PKV_ERR_BUSY with nothing
 * changed, counted or logged (the caller falls back to pkv_stage_acquire, which gives the
 * typed failure and its log line). Pages used for the first time are still committed
 * before it returns. */
PKV_API int pkv_stage_try_acquire(pkv_stage_t *st, uint64_t transfer_id, uint32_t peer,
                                  uint32_t pages, pkv_stage_grant_t **out);

/* The transfer is done with its pages. Returns them at once, or when the last lease
 * ends. PKV_ERR_NOTFOUND: no such holding transfer; PKV_ERR_CANCELLED: it was already
 * cancelled (its pages return when its leases end). */
PKV_API int pkv_stage_release(pkv_stage_t *st, uint64_t transfer_id);

/* Cancel a transfer from any thread: a waiting acquire returns PKV_ERR_CANCELLED; a
 * holding transfer is released as by pkv_stage_release (deferred past its leases).
 * PKV_ERR_NOTFOUND when the id is neither waiting nor holding. */
PKV_API int pkv_stage_cancel(pkv_stage_t *st, uint64_t transfer_id);

/* A copy into or out of the transfer's pages starts / ends. lease_begin fails with
 * PKV_ERR_NOTFOUND (no such transfer), PKV_ERR_CANCELLED (already released or
 * cancelled: start no copy) or PKV_ERR_SHUTDOWN. lease_end: PKV_ERR_NOTFOUND when no
 * lease is open; the last lease_end of a released transfer returns its pages. */
PKV_API int pkv_stage_lease_begin(pkv_stage_t *st, uint64_t transfer_id);
PKV_API int pkv_stage_lease_end(pkv_stage_t *st, uint64_t transfer_id);

/* Address of arena page `page` (NULL when out of range). Memory is only accessible
 * while the page is owned. */
PKV_API void *pkv_stage_page_addr(const pkv_stage_t *st, uint32_t page);
PKV_API size_t pkv_stage_page_bytes(const pkv_stage_t *st);
PKV_API uint32_t pkv_stage_pool_pages(const pkv_stage_t *st);
/* The memfd behind the arena (size pool_pages * page_bytes), or -1 when not shared.
 * The stage keeps ownership; dup() it to hand to a peer. */
PKV_API int pkv_stage_memfd(const pkv_stage_t *st);

/* Wake every waiter at once with PKV_ERR_SHUTDOWN; later acquires and lease_begins fail
 * with it. Holding transfers may still release and end leases. Idempotent. */
PKV_API void pkv_stage_shutdown(pkv_stage_t *st);

/* Shut down, then wait until every transfer has released and every lease ended, up to
 * `drain_deadline_ns`. Each transfer still live at the deadline is logged by id and
 * counted in *leaked (may be NULL).
 *   PKV_OK        everything freed (leaked transfers had no copy running: their
 *                 grants' addresses are now invalid).
 *   PKV_ERR_BUSY  copies were still running at the deadline: nothing was freed and the
 *                 stage stays valid (shut down) so those copies can finish and call
 *                 lease_end; call destroy again later.
 * destroy(NULL) is a no-op returning PKV_OK. */
PKV_API int pkv_stage_destroy(pkv_stage_t *st, uint64_t drain_deadline_ns, size_t *leaked);

#define PKV_STAGE_WAIT_BUCKETS 24 /* bucket i: waits in [2^i, 2^(i+1)) us; 0 also < 1 us */

typedef struct {
    pkv_stage_mode_t mode;
    size_t page_bytes;
    uint32_t pages_total;
    uint32_t pages_free;      /* free now (committed or not) */
    uint32_t pages_used;      /* owned by transfers (incl. released, leases open) */
    uint32_t pages_returning; /* idle pages being returned to the OS right now: neither
                                 free nor used; free again (cold) in a moment */
    uint32_t pages_peak_used;
    uint32_t pages_asked_inflight; /* sum of pages_asked over live transfers */
    uint32_t pages_asked_peak;
    uint64_t resident_bytes; /* committed pages * page_bytes */
    uint64_t resident_peak_bytes;
    uint64_t pinned_bytes;     /* of resident, locked in RAM */
    uint64_t pin_failed_pages; /* pages the OS refused to mlock (pin asked) */
    uint64_t committed_pages;  /* cumulative commits */
    uint64_t released_pages;   /* cumulative returns to the OS */
    uint32_t warm_floor_pages; /* the warm floor now (0 when none or lapsed) */
    uint32_t transfers_live;   /* holding, or released with leases open */
    uint32_t transfers_peak;   /* high-water of transfers_live */
    uint32_t waiting;          /* acquires parked now */
    uint64_t acquires;         /* successful */
    uint64_t releases;
    uint64_t deferred_releases; /* release/cancel that had to wait for leases */
    uint64_t waits;             /* acquires that had to park */
    uint64_t nofit;
    uint64_t timeouts;
    uint64_t cancelled; /* waiting acquires cancelled */
    uint64_t shutdowns; /* acquires failed by shutdown */
    uint64_t wait_ns_total;
    uint64_t wait_ns_max;
    uint64_t wait_hist[PKV_STAGE_WAIT_BUCKETS];
} pkv_stage_stats_t;

PKV_API int pkv_stage_stats(pkv_stage_t *st, pkv_stage_stats_t *out);
/* The stats as pkv_stage_stats gives them, then, in the same hold of the lock, a new window
 * for the high-water marks: pages_peak_used, pages_asked_peak, resident_peak_bytes and
 * transfers_peak restart from the values now (so `out` holds the peaks of the window that
 * ends here: since creation or the previous call). Counters are untouched. */
PKV_API int pkv_stage_peaks_reset(pkv_stage_t *st, pkv_stage_stats_t *out);

typedef struct {
    uint32_t peer;
    uint32_t held_pages;
    uint32_t waiting;
} pkv_stage_peer_stats_t;

/* Pages held (and acquires parked) for `peer`; zeros for an unknown peer. */
PKV_API int pkv_stage_peer_stats(pkv_stage_t *st, uint32_t peer, pkv_stage_peer_stats_t *out);
/* Every peer with pages held or waiters: up to `cap` entries into out, *n the count
 * written, PKV_ERR_NOSPACE (with the first `cap` written) when there are more. */
PKV_API int pkv_stage_peers(pkv_stage_t *st, pkv_stage_peer_stats_t *out, size_t cap, size_t *n);

#ifdef __cplusplus
}
#endif
#endif
