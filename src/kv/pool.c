/*
 * pool: the paged KV pool. Design, invariants and locking: docs/design/pool.md.
 *
 * In short: one reserved range cut into granules of whole blocks; granules are
 * committed on first need and decommitted (with hysteresis) when all their blocks are
 * free; blocks are refcounted (free / live / cached); full blocks are keyed by a chained
 * SHA-256 prefix key and, once unreferenced, stay cached until evicted (LRU with a
 * preference for sparse granules). The cache yields memory: a byte cap on the granules only
 * cached blocks keep committed, an idle time-to-live applied by pkv_kv_trim, and a
 * pressure limit (pkv_kv_cache_pressure); each empties whole granules. One mutex guards
 * all metadata; no OS call runs under it.
 *
 * Tensor-parallel ranks: a pool with tp = N keeps that one bookkeeping (one block id names
 * the block on every rank) over N reserved ranges, one per rank, each holding the rank's
 * KV heads; granule g is committed and decommitted on every rank together.
 */
#include "kv/kv_int.h"
#include "prim/prim.h"

#include <pthread.h>
#include <string.h>

#define NONE                 UINT32_MAX
#define POOL_MAX_BLOCKS      (16u << 20)
#define POOL_EVICT_WINDOW    16
#define POOL_DEFAULT_RESERVE (64ull << 30)
#define POOL_WARM_LIFE_MS    30000u

enum { BLK_FREE = 0, BLK_LIVE, BLK_CACHED };
enum { GR_UNCOMMITTED = 0, GR_COMMITTING, GR_COMMITTED, GR_DECOMMITTING };
/* Why a cached block was evicted (pkv_kv_stats_t's evictions_*). */
enum { EV_BUDGET = 0, EV_CAP, EV_IDLE, EV_PRESSURE, EV_RESET, EV_N };

typedef struct {
    pkv_kv_key_t key;            /* valid when hashed */
    uint32_t ref;                /* sequences + pins holding it */
    uint32_t next;               /* FREE: next free block in the granule */
    uint32_t lru_prev, lru_next; /* CACHED: LRU list (head = oldest) */
    uint32_t hnext;              /* hashed: hash chain */
    uint64_t t_cached;           /* CACHED: when it became cached (pkv_now_ns) */
    uint64_t salt;               /* hashed: the salt its key was computed under */
    uint8_t state;
    uint8_t hashed; /* full, keyed, in the hash table */
} pool_block_t;

typedef struct {
    uint32_t used;       /* live + cached blocks */
    uint32_t ncached;    /* cached blocks */
    uint32_t nfree;      /* free blocks (COMMITTED only) */
    uint32_t free_head;  /* free list */
    uint32_t prev, next; /* bucket list, or pending-decommit list */
    uint8_t state;
    uint8_t in_bucket; /* in bucket[used]: COMMITTED and nfree > 0 */
} pool_granule_t;

typedef struct pool_seq pool_seq_t;

/* One tensor-parallel rank's storage: granule g of the pool is [addr + g * stride, +stride)
 * here, laid out [layer][k|v][local head][slot][token][dim] over the rank's head_n heads. */
typedef struct {
    uint8_t *addr;    /* the rank's reserved range */
    size_t stride;    /* the rank's bytes of one granule (4 KiB aligned) */
    size_t reserved;  /* n_granules * stride */
    uint32_t head_lo; /* first KV head held (global index) */
    uint32_t head_n;  /* KV heads held */
} pool_rank_t;

typedef struct {
    struct pkv_kv base;
    /* immutable after create */
    uint32_t tp;           /* ranks (1: one range, the plain layout) */
    size_t reserved;       /* bytes reserved over every rank */
    size_t gbytes;         /* bytes of one granule over every rank: the commit accounting */
    size_t blk_bytes;      /* one block over every rank (replicated heads in each copy) */
    uint32_t bpg;          /* blocks per granule (from the TP=1 block size: same ids any tp) */
    size_t piece;          /* one (block, layer, k|v, head): block_tokens rows */
    uint32_t n_granules;   /* granules in the reservation */
    uint32_t max_granules; /* granules the budget allows */
    uint32_t retain;       /* empty granules kept committed */
    bool prefix_cache, huge;
    uint64_t budget;
    uint64_t cache_cap;  /* bytes of cache-only granules allowed; 0: none */
    uint64_t idle_ns;    /* time-to-live of a cached block; 0: none */
    uint32_t warm_max;   /* the warm floor's granules at most; 0: no floor */
    uint64_t warm_life;  /* ns the floor outlives the demand that set it */
    pkv_kv_storage_t st; /* where the bytes live: host memory unless the config names one */

    pthread_mutex_t lock;  /* guards everything below */
    pool_block_t *blk;     /* [n_granules * bpg] */
    pool_granule_t *gr;    /* [n_granules] */
    uint32_t *bucket;      /* [bpg] heads of granule lists by used count */
    uint64_t *bucket_bits; /* non-empty buckets */
    uint32_t n_empty;      /* granules in bucket[0] */
    uint32_t *uncommitted; /* stack of UNCOMMITTED granules, lowest id on top */
    uint32_t n_uncommitted;
    uint32_t committed;     /* granules COMMITTING + COMMITTED + DECOMMITTING */
    uint32_t decommit_head; /* pending decommits (DECOMMITTING), via gr[].next */
    uint32_t *htab;
    uint32_t hmask;
    uint32_t lru_head, lru_tail;
    uint64_t n_live, n_cached, n_free; /* blocks; n_free counts COMMITTED granules only */
    pool_seq_t *seqs;                  /* live sequences (for validate) */
    uint64_t n_seqs, live_tokens;
    uint64_t peak_committed;
    uint64_t q_count, q_tokens, hit_tokens, evictions, cow, commits, decommits;
    uint64_t rej_nofit, rej_nospace;
    uint32_t cache_granules; /* COMMITTED granules with cached blocks and no live one */
    uint64_t pressure_limit; /* bytes of cache-only granules allowed now; PKV_KV_NO_LIMIT */
    uint64_t ev[EV_N];       /* evictions by cause */
    /* The warm floor ("Policies" in docs/design/pool.md): `warm` empty granules kept
     * committed, refilled by pkv_kv_warm_refill, sized by the largest allocation of the last one
     * to two warm_life ns (warm_rm; `warm` is its value at the last note or trim);
     * warm_low: an allocation took from it (kick the owner). */
    uint32_t warm;
    pkv_recent_max_t warm_rm;
    bool warm_low;
    uint64_t warm_refills; /* granules committed by pkv_kv_warm_refill to refill the floor */
    uint64_t commit_ns;    /* time spent in the OS committing granules */

    pool_rank_t rk[PKV_KV_MAX_TP]; /* [tp], immutable after create; rk[0] alone when tp = 1 */
} pool_t;

struct pool_seq {
    struct pkv_seq base;
    uint32_t *blocks; /* block table [cap] */
    uint32_t nb, cap;
    pool_seq_t *prev, *next; /* pool->seqs, guarded by pool->lock */
};

static const kv_ops_t pool_ops;

static inline pool_t *pool_of(const pkv_kv_t *kv)
{
    return (pool_t *)kv;
}

/* Granule layout (per rank) [layer][k|v][head][slot][token][dim]: for one layer and head,
 * the tokens of a granule's blocks lie side by side in slot order, so a sequence whose
 * blocks sit in consecutive slots reads as one run of up to bpg * block_tokens positions
 * (head stride bpg * block_tokens * head_dim), and one layer's K of a granule is
 * contiguous. Returns (block id, layer, k|v, local head lh of rank r)'s block_tokens x
 * head_dim elements. */
static inline uint8_t *rank_head_addr(const pool_t *p, const pool_rank_t *r, uint32_t id,
                                      uint32_t layer, uint32_t kv, uint32_t lh)
{
    return r->addr + (size_t)(id / p->bpg) * r->stride +
           ((((size_t)layer * 2 + kv) * r->head_n + lh) * p->bpg + id % p->bpg) * p->piece;
}

/* Rank 0's piece (rank 0 holds heads from 0: local = global); with tp = 1 every head. */
static inline uint8_t *head_addr(const pool_t *p, uint32_t id, uint32_t layer, uint32_t kv,
                                 uint32_t head)
{
    return rank_head_addr(p, &p->rk[0], id, layer, kv, head);
}

/* The first rank that holds KV head `head` (global). */
static inline uint32_t first_rank(const pool_t *p, uint32_t head)
{
    uint32_t H = p->base.geo.kv_heads;
    return p->tp <= H ? head / (H / p->tp) : head * (p->tp / H);
}

/* ---- granule buckets ---------------------------------------------------------------- */

static void bucket_insert(pool_t *p, uint32_t g)
{
    pool_granule_t *gr = &p->gr[g];
    uint32_t u = gr->used;
    gr->prev = NONE;
    gr->next = p->bucket[u];
    if (gr->next != NONE) p->gr[gr->next].prev = g;
    p->bucket[u] = g;
    p->bucket_bits[u / 64] |= 1ull << (u % 64);
    gr->in_bucket = 1;
    if (u == 0) p->n_empty++;
}

static void bucket_remove(pool_t *p, uint32_t g)
{
    pool_granule_t *gr = &p->gr[g];
    uint32_t u = gr->used;
    if (gr->prev != NONE)
        p->gr[gr->prev].next = gr->next;
    else
        p->bucket[u] = gr->next;
    if (gr->next != NONE) p->gr[gr->next].prev = gr->prev;
    if (p->bucket[u] == NONE) p->bucket_bits[u / 64] &= ~(1ull << (u % 64));
    gr->in_bucket = 0;
    if (u == 0) p->n_empty--;
}

/* The committed granule with a free block and the most used blocks; NONE if none. */
static uint32_t bucket_densest(const pool_t *p)
{
    for (int64_t w = (int64_t)((p->bpg - 1) / 64); w >= 0; w--) {
        uint64_t bits = p->bucket_bits[w];
        if (bits) return p->bucket[(uint32_t)w * 64 + 63 - (uint32_t)__builtin_clzll(bits)];
    }
    return NONE;
}

/* A granule kept committed only by cached blocks: what the cache's byte figures count. */
static inline bool gr_cache_only(const pool_granule_t *gr)
{
    return gr->used && gr->ncached == gr->used;
}

/* After a change to gr's used or ncached counts: keep p->cache_granules current (`was`:
 * gr_cache_only before the change). */
static inline void cache_note(pool_t *p, const pool_granule_t *gr, bool was)
{
    p->cache_granules = p->cache_granules - was + gr_cache_only(gr);
}

/* ---- LRU and hash table ------------------------------------------------------------ */

static void lru_push_mru(pool_t *p, uint32_t id)
{
    pool_block_t *b = &p->blk[id];
    b->t_cached = pkv_now_ns(); /* under the lock: the LRU is in t_cached order */
    b->lru_next = NONE;
    b->lru_prev = p->lru_tail;
    if (p->lru_tail != NONE)
        p->blk[p->lru_tail].lru_next = id;
    else
        p->lru_head = id;
    p->lru_tail = id;
}

static void lru_remove(pool_t *p, uint32_t id)
{
    pool_block_t *b = &p->blk[id];
    if (b->lru_prev != NONE)
        p->blk[b->lru_prev].lru_next = b->lru_next;
    else
        p->lru_head = b->lru_next;
    if (b->lru_next != NONE)
        p->blk[b->lru_next].lru_prev = b->lru_prev;
    else
        p->lru_tail = b->lru_prev;
}

static uint32_t htab_find(const pool_t *p, const pkv_kv_key_t *key)
{
    for (uint32_t id = p->htab[kv_key_hash(key) & p->hmask]; id != NONE; id = p->blk[id].hnext)
        if (kv_key_eq(&p->blk[id].key, key)) return id;
    return NONE;
}

static void htab_insert(pool_t *p, uint32_t id)
{
    uint32_t *head = &p->htab[kv_key_hash(&p->blk[id].key) & p->hmask];
    p->blk[id].hnext = *head;
    *head = id;
    p->blk[id].hashed = 1;
}

static void htab_remove(pool_t *p, uint32_t id)
{
    uint32_t *link = &p->htab[kv_key_hash(&p->blk[id].key) & p->hmask];
    while (*link != id) link = &p->blk[*link].hnext;
    *link = p->blk[id].hnext;
    p->blk[id].hashed = 0;
}

/* ---- block life cycle (all under lock) ---------------------------------------------- */

/* Take free block `id` (NONE: the head of its granule's free list) of committed granule g. */
static uint32_t block_claim(pool_t *p, uint32_t g, uint32_t id)
{
    pool_granule_t *gr = &p->gr[g];
    bool was = gr_cache_only(gr);
    bucket_remove(p, g);
    uint32_t *link = &gr->free_head;
    if (id != NONE)
        while (*link != id)
            link = &p->blk[*link].next; /* id is on the list: the caller saw it free */
    id = *link;
    *link = p->blk[id].next;
    gr->nfree--;
    gr->used++;
    cache_note(p, gr, was);
    if (gr->nfree) bucket_insert(p, g);
    p->n_free--;
    p->n_live++;
    pool_block_t *b = &p->blk[id];
    b->state = BLK_LIVE;
    b->ref = 1;
    b->hashed = 0;
    return id;
}

/* Take a free block from the densest committed granule. Requires n_free > 0. */
static uint32_t block_take(pool_t *p)
{
    uint32_t g = bucket_densest(p);
    PKV_ASSERT(g != NONE);
    return block_claim(p, g, NONE);
}

/* Queue an empty committed granule for decommit (pool_flush_decommits does it). */
static void granule_retire(pool_t *p, uint32_t g)
{
    pool_granule_t *gr = &p->gr[g];
    bucket_remove(p, g);
    gr->state = GR_DECOMMITTING;
    p->n_free -= p->bpg;
    gr->next = p->decommit_head;
    p->decommit_head = g;
}

/* The warm floor now: none while a pressure limit holds the cache (the memory is wanted
 * elsewhere, and an empty granule goes back before a cached block does). */
static inline uint32_t warm_now(const pool_t *p)
{
    return p->pressure_limit == PKV_KV_NO_LIMIT ? p->warm : 0;
}

/* Empty granules kept committed: retain_granules, or the warm floor when larger. */
static inline uint32_t pool_keep_empty(const pool_t *p)
{
    return PKV_MAX(p->retain, warm_now(p));
}

/* Queue for decommit the empty granules beyond pool_keep_empty (after the floor fell, a
 * reset or a pressure limit), sparsest bucket first. */
static void pool_retire_beyond_keep(pool_t *p)
{
    while (p->n_empty > pool_keep_empty(p)) granule_retire(p, p->bucket[0]);
}

/* Return a block (ref 0, not cached) to its granule; queue the granule for decommit
 * when it empties and more empty granules than pool_keep_empty exist (unless `keep`). */
static void block_put(pool_t *p, uint32_t id, bool keep)
{
    uint32_t g = id / p->bpg;
    pool_granule_t *gr = &p->gr[g];
    pool_block_t *b = &p->blk[id];
    bool was = gr_cache_only(gr);
    b->state = BLK_FREE;
    b->next = gr->free_head;
    gr->free_head = id;
    if (gr->in_bucket) bucket_remove(p, g);
    gr->used--;
    cache_note(p, gr, was);
    gr->nfree++;
    bucket_insert(p, g);
    p->n_free++;
    if (gr->used == 0 && !keep && p->n_empty > pool_keep_empty(p)) granule_retire(p, g);
}

/* Drop one reference; at zero the block becomes cached (hashed, cache on) or free
 * (its granule kept committed when `keep`, see block_put). */
static void block_drop(pool_t *p, uint32_t id, bool keep)
{
    pool_block_t *b = &p->blk[id];
    PKV_ASSERT(b->state == BLK_LIVE && b->ref > 0);
    if (--b->ref) return;
    p->n_live--;
    if (b->hashed) {
        pool_granule_t *gr = &p->gr[id / p->bpg];
        bool was = gr_cache_only(gr);
        b->state = BLK_CACHED;
        gr->ncached++;
        cache_note(p, gr, was);
        p->n_cached++;
        lru_push_mru(p, id);
    } else {
        block_put(p, id, keep);
    }
}

static void block_unref(pool_t *p, uint32_t id)
{
    block_drop(p, id, false);
}

static void block_ref(pool_t *p, uint32_t id)
{
    pool_block_t *b = &p->blk[id];
    if (b->state == BLK_CACHED) {
        pool_granule_t *gr = &p->gr[id / p->bpg];
        bool was = gr_cache_only(gr);
        lru_remove(p, id);
        b->state = BLK_LIVE;
        gr->ncached--;
        cache_note(p, gr, was);
        p->n_cached--;
        p->n_live++;
    }
    b->ref++;
}

/* Evict cached block id (counted under `cause`); its granule is kept when `keep` (see
 * block_put). */
static void evict_block(pool_t *p, uint32_t id, bool keep, int cause)
{
    pool_granule_t *gr = &p->gr[id / p->bpg];
    bool was = gr_cache_only(gr);
    lru_remove(p, id);
    htab_remove(p, id);
    gr->ncached--;
    cache_note(p, gr, was);
    p->n_cached--;
    p->evictions++;
    p->ev[cause]++;
    block_put(p, id, keep);
}

/* Evict one cached block: among the POOL_EVICT_WINDOW oldest, the one in the sparsest
 * granule, so that whole granules empty out. */
static void evict_one(pool_t *p, bool keep, int cause)
{
    uint32_t best = p->lru_head, id = p->lru_head;
    for (int i = 0; i < POOL_EVICT_WINDOW && id != NONE; i++, id = p->blk[id].lru_next)
        if (p->gr[id / p->bpg].used < p->gr[best / p->bpg].used) best = id;
    PKV_ASSERT(best != NONE);
    evict_block(p, best, keep, cause);
}

/* The cache-only granule to empty next: among the granules of the POOL_EVICT_WINDOW
 * oldest cached blocks that sit in cache-only granules, the one with the fewest blocks
 * (the coldest memory, and the least cache lost per granule returned). NONE if none. */
static uint32_t cache_victim(const pool_t *p)
{
    uint32_t best = NONE;
    int seen = 0;
    for (uint32_t id = p->lru_head; id != NONE && seen < POOL_EVICT_WINDOW;
         id = p->blk[id].lru_next) {
        uint32_t g = id / p->bpg;
        if (!gr_cache_only(&p->gr[g])) continue;
        seen++;
        if (best == NONE || p->gr[g].used < p->gr[best].used) best = g;
    }
    return best;
}

/* The bytes of cache-only granules allowed now, and the cause evictions beyond it count
 * under: the pressure limit when it is the lower, else the cap. */
static uint64_t cache_allowed(const pool_t *p, int *cause)
{
    uint64_t cap = p->cache_cap ? p->cache_cap : PKV_KV_NO_LIMIT;
    *cause = p->pressure_limit < cap ? EV_PRESSURE : EV_CAP;
    return PKV_MIN(cap, p->pressure_limit);
}

/* Empty cache-only granules (every cached block of each, so the granule goes back to the
 * OS) until the cache's committed bytes are within cache_allowed. Lock held; the
 * decommits are queued (pool_flush_decommits). */
static void cache_enforce(pool_t *p)
{
    int cause;
    uint64_t allowed = cache_allowed(p, &cause);
    while ((uint64_t)p->cache_granules * p->gbytes > allowed) {
        uint32_t g = cache_victim(p);
        PKV_ASSERT(g != NONE); /* a cache-only granule holds a cached block in the LRU */
        for (uint32_t j = 0; j < p->bpg; j++)
            if (p->blk[g * p->bpg + j].state == BLK_CACHED)
                evict_block(p, g * p->bpg + j, false, cause);
    }
}

/* ---- commit / decommit (OS calls outside the lock) --------------------------------- */

static void pool_note_peak(pool_t *p)
{
    uint64_t c = (uint64_t)p->committed * p->gbytes;
    if (c > p->peak_committed) p->peak_committed = c;
}

/* Granule g's part in every rank (tp OS calls; never under the lock). */
static void granule_decommit(const pool_t *p, uint32_t g)
{
    for (uint32_t r = 0; r < p->tp; r++)
        p->st.decommit(p->st.ctx, p->rk[r].addr + (size_t)g * p->rk[r].stride, p->rk[r].stride);
}

/* Commit granule g's part in every rank, all or nothing: when one rank's commit fails the
 * ranks already committed are decommitted again. Never under the lock. */
static int granule_commit(const pool_t *p, uint32_t g)
{
    for (uint32_t r = 0; r < p->tp; r++) {
        const pool_rank_t *rk = &p->rk[r];
        int rc = p->st.commit(p->st.ctx, rk->addr + (size_t)g * rk->stride, rk->stride, p->huge);
        if (rc == PKV_OK) continue;
        while (r-- > 0)
            p->st.decommit(p->st.ctx, p->rk[r].addr + (size_t)g * p->rk[r].stride, p->rk[r].stride);
        return rc;
    }
    return PKV_OK;
}

/* Decommit queued granules. Called with the lock held; drops and retakes it. */
static void pool_flush_decommits(pool_t *p)
{
    while (p->decommit_head != NONE) {
        uint32_t head = p->decommit_head;
        p->decommit_head = NONE;
        pthread_mutex_unlock(&p->lock);
        for (uint32_t g = head; g != NONE; g = p->gr[g].next) granule_decommit(p, g);
        pthread_mutex_lock(&p->lock);
        for (uint32_t g = head, next; g != NONE; g = next) {
            next = p->gr[g].next;
            p->gr[g].state = GR_UNCOMMITTED;
            p->uncommitted[p->n_uncommitted++] = g;
            p->committed--;
            p->decommits++;
        }
    }
}

/* Commit up to `want` granules. Lock held; dropped around the OS calls, whose time is
 * added to p->commit_ns and to *ns (optional). Returns the number committed (0 when the
 * OS refused all). */
static uint32_t pool_commit(pool_t *p, uint32_t want, uint64_t *ns)
{
    uint32_t ids[64], n = 0, ok = 0;
    want = PKV_MIN(want, (uint32_t)PKV_ARRAY_LEN(ids));
    while (n < want && p->n_uncommitted && p->committed < p->max_granules) {
        ids[n] = p->uncommitted[--p->n_uncommitted];
        p->gr[ids[n]].state = GR_COMMITTING;
        p->committed++;
        n++;
    }
    pool_note_peak(p);
    pthread_mutex_unlock(&p->lock);
    int rc[64];
    uint64_t t0 = pkv_now_ns();
    for (uint32_t i = 0; i < n; i++) rc[i] = granule_commit(p, ids[i]);
    uint64_t dt = pkv_now_ns() - t0;
    pthread_mutex_lock(&p->lock);
    p->commit_ns += dt;
    if (ns) *ns += dt;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t g = ids[i];
        pool_granule_t *gr = &p->gr[g];
        if (rc[i] != PKV_OK) {
            gr->state = GR_UNCOMMITTED;
            p->uncommitted[p->n_uncommitted++] = g;
            p->committed--;
            continue;
        }
        gr->state = GR_COMMITTED;
        gr->used = 0;
        gr->ncached = 0;
        gr->nfree = p->bpg;
        gr->free_head = NONE;
        for (uint32_t j = p->bpg; j-- > 0;) {
            uint32_t id = g * p->bpg + j;
            p->blk[id].state = BLK_FREE;
            p->blk[id].next = gr->free_head;
            gr->free_head = id;
        }
        p->n_free += p->bpg;
        bucket_insert(p, g);
        p->commits++;
        ok++;
    }
    return ok;
}

/* Blocks obtainable now without touching live data: free + committable + evictable. */
static uint64_t pool_available(const pool_t *p, uint64_t cached_excluded)
{
    uint64_t committable =
        PKV_MIN((uint64_t)p->n_uncommitted,
                (uint64_t)(p->max_granules - PKV_MIN(p->committed, p->max_granules)));
    return p->n_free + committable * p->bpg + (p->n_cached - cached_excluded);
}

/* Undo the n granule commits of a failed step, whose granules are empty again: hand n
 * empty granules back to the OS, so the step leaves committed memory as it found it.
 * Lock held (dropped around the decommits). */
static void pool_return_fresh(pool_t *p, uint64_t n)
{
    for (; n && p->n_empty; n--) granule_retire(p, p->bucket[0]);
    pool_flush_decommits(p);
}

/* After blocks were released: hold the cache within its cap and pressure limit, then
 * decommit what emptied. Lock held (dropped around the decommits). */
static void pool_settle(pool_t *p)
{
    cache_enforce(p);
    pool_flush_decommits(p);
}

/* An allocation of n blocks at now: the warm floor is the granules of the largest
 * allocation of the last one to two warm_life ns (pkv_recent_max_t), at most warm_max. */
static void warm_note(pool_t *p, uint32_t n)
{
    if (!p->warm_max) return;
    uint64_t now = pkv_now_ns();
    uint32_t g = (uint32_t)PKV_MIN(PKV_DIV_UP(n, p->bpg), p->warm_max);
    pkv_recent_max_note(&p->warm_rm, g, now, p->warm_life);
    p->warm = pkv_recent_max_get(&p->warm_rm, now, p->warm_life, NULL);
}

/* Whether the floor lacks granules that pkv_kv_trim could commit. */
static bool warm_short(const pool_t *p)
{
    return p->n_empty < warm_now(p) && p->n_uncommitted && p->committed < p->max_granules;
}

/* Drop the lock; then, when an allocation left the warm floor short, kick its owner
 * (pkv_kv_on_warm_low), outside the lock. */
static void pool_unlock(pool_t *p)
{
    bool kick = p->warm_low && p->base.on_warm_low;
    p->warm_low = false;
    pthread_mutex_unlock(&p->lock);
    if (kick) p->base.on_warm_low(p->base.on_warm_low_arg);
}

/* Take n free blocks (n <= n_free) in address order where the pool allows: first the blocks
 * right after `after` (the block before ids[0] in its sequence; NONE: none) while they are
 * free in its granule, then (growth of fewer than a granule's blocks) an empty granule's
 * from its first, else the densest granules' free blocks, granule by granule as taken,
 * each granule's ascending. Attention reads a sequence by runs of consecutive blocks, and
 * every run's start restarts the hardware prefetcher: blocks taken from a free list (last
 * freed first) in descending order made every block its own run and a 2k-token decode step
 * ~1.8x as slow. (The granules stay in the order taken: the sparsest last, where a
 * sequence's partial block is, so that freeing it empties that granule.) */
static void take_ordered(pool_t *p, uint32_t n, uint32_t *ids, uint32_t after)
{
    uint32_t i = 0;
    /* id + 1 in id's granule, which holds a live block: committed, so BLK_FREE is free */
    for (uint32_t id = after;
         i < n && id != NONE && (id + 1) % p->bpg && p->blk[id + 1].state == BLK_FREE;)
        ids[i++] = id = block_claim(p, (id + 1) / p->bpg, id + 1);
    /* Growth that cannot go on where the sequence ends starts an empty granule at its first
     * block, so that the growth after it extends the run (a hole in a denser granule would
     * make each of its blocks a run of its own); new sequences still fill the holes. */
    if (after != NONE && i < n && n - i < p->bpg && p->n_empty) {
        uint32_t g = p->bucket[0];
        for (uint32_t k = 0; i < n; k++) ids[i++] = block_claim(p, g, g * p->bpg + k);
    }
    for (uint32_t j = i; j < n; j++) {
        uint32_t id = block_take(p), k = j; /* insertion into its granule's group */
        while (k > i && ids[k - 1] / p->bpg == id / p->bpg && ids[k - 1] > id)
            ids[k] = ids[k - 1], k--;
        ids[k] = id;
    }
}

/* Allocate n blocks into ids[], all or nothing, in address order where the pool allows
 * (take_ordered; `after`: the block before ids[0] in its sequence, or NONE). Lock held (may
 * be dropped to commit; the OS time is added to *commit_ns, optional). Prefers free
 * committed blocks (the warm floor among them), then new granules, then eviction. On
 * failure the granules it committed go back. Sets warm_low when it leaves the floor short. */
static int pool_alloc(pool_t *p, uint32_t n, uint32_t *ids, uint32_t after, uint64_t *commit_ns)
{
    uint64_t commits0 = p->commits;
    int rc;
    warm_note(p, n);
    for (;;) {
        if (p->n_free >= n) {
            take_ordered(p, n, ids, after);
            p->warm_low |= warm_short(p);
            return PKV_OK;
        }
        uint64_t deficit = n - p->n_free;
        if (p->n_uncommitted && p->committed < p->max_granules) {
            if (pool_commit(p, (uint32_t)PKV_MIN(PKV_DIV_UP(deficit, p->bpg), 64), commit_ns) ==
                0) {
                rc = PKV_ERR_NOMEM;
                break;
            }
            continue;
        }
        if (p->n_cached < deficit) {
            rc = PKV_ERR_NOSPACE;
            break;
        }
        while (p->n_free < n) evict_one(p, true, EV_BUDGET);
    }
    pool_return_fresh(p, p->commits - commits0);
    return rc;
}

/* ---- sequences --------------------------------------------------------------------- */

static int seq_grow_table(pool_seq_t *s, uint32_t nb)
{
    if (nb <= s->cap) return PKV_OK;
    uint32_t cap = PKV_MAX(nb, s->cap ? s->cap * 2 : 16);
    uint32_t *t = kv_realloc(s->blocks, (size_t)cap * sizeof(uint32_t));
    if (!t) return PKV_ERR_NOMEM;
    s->blocks = t;
    s->cap = cap;
    return PKV_OK;
}

static void seq_link(pool_t *p, pool_seq_t *s)
{
    s->prev = NULL;
    s->next = p->seqs;
    if (p->seqs) p->seqs->prev = s;
    p->seqs = s;
    p->n_seqs++;
}

static void seq_unlink(pool_t *p, pool_seq_t *s)
{
    if (s->prev)
        s->prev->next = s->next;
    else
        p->seqs = s->next;
    if (s->next) s->next->prev = s->prev;
    p->n_seqs--;
}

static pool_seq_t *seq_alloc(pool_t *p, uint64_t salt, uint32_t nb)
{
    pool_seq_t *s = kv_calloc(1, sizeof(*s));
    if (!s) return NULL;
    if (kv_seq_base_init(&s->base, &p->base, salt) || seq_grow_table(s, PKV_MAX(nb, 1))) {
        kv_seq_base_fini(&s->base);
        free(s);
        return NULL;
    }
    return s;
}

static void seq_dealloc(pool_seq_t *s)
{
    kv_seq_base_fini(&s->base);
    free(s->blocks);
    free(s);
}

static int pool_nofit(pool_t *p, uint64_t blocks_needed)
{
    p->rej_nofit++;
    PKV_LOGW("pool",
             "request can never fit: needs %llu blocks (%llu bytes), budget holds %llu blocks "
             "(%llu bytes)",
             (unsigned long long)blocks_needed, (unsigned long long)(blocks_needed * p->blk_bytes),
             (unsigned long long)p->max_granules * p->bpg, (unsigned long long)p->budget);
    return PKV_ERR_NOFIT;
}

static int pool_seq_create(pkv_kv_t *kv, const pkv_seq_params_t *prm, pkv_seq_t **out,
                           uint32_t *n_cached)
{
    pool_t *p = pool_of(kv);
    uint32_t T = kv->geo.block_tokens;
    uint32_t reserve = PKV_MAX(prm->reserve_tokens, prm->n_tokens);
    uint32_t nb_total = PKV_DIV_UP(reserve, T);
    uint64_t max_blocks = (uint64_t)p->max_granules * p->bpg;
    int rc;
    if (nb_total > max_blocks) {
        pthread_mutex_lock(&p->lock);
        rc = pool_nofit(p, nb_total);
        pthread_mutex_unlock(&p->lock);
        return rc;
    }
    uint32_t nk = p->prefix_cache ? (prm->n_tokens - 1) / T : 0;
    pkv_kv_key_t *keys = nk ? kv_malloc((size_t)nk * sizeof(*keys)) : NULL;
    pool_seq_t *s = seq_alloc(p, prm->salt, nb_total);
    if ((nk && !keys) || !s) {
        rc = PKV_ERR_NOMEM;
        goto fail;
    }
    nk =
        nk ? pkv_kv_prefix_keys(kv, prm->salt, prm->tokens, prm->n_tokens, keys) : 0; /* unlocked */

    pthread_mutex_lock(&p->lock);
    uint32_t hits = 0, cached_hits = 0;
    for (; hits < nk; hits++) {
        uint32_t id = htab_find(p, &keys[hits]);
        if (id == NONE) break;
        s->blocks[hits] = id;
        cached_hits += p->blk[id].state == BLK_CACHED;
    }
    uint32_t need = nb_total - hits;
    if (need > pool_available(p, cached_hits)) {
        p->rej_nospace++;
        pthread_mutex_unlock(&p->lock);
        rc = PKV_ERR_NOSPACE;
        goto fail;
    }
    for (uint32_t i = 0; i < hits; i++) block_ref(p, s->blocks[i]);
    rc = pool_alloc(p, need, s->blocks + hits, hits ? s->blocks[hits - 1] : NONE,
                    &s->base.commit_ns);
    if (rc) {
        for (uint32_t i = 0; i < hits; i++) block_unref(p, s->blocks[i]);
        if (rc == PKV_ERR_NOSPACE) p->rej_nospace++;
        pool_settle(p);
        pthread_mutex_unlock(&p->lock);
        goto fail;
    }
    s->nb = nb_total;
    s->base.length = hits * T;
    s->base.capacity = nb_total * T;
    if (hits) s->base.last_key = keys[hits - 1];
    seq_link(p, s);
    p->live_tokens += s->base.length;
    p->q_count++;
    p->q_tokens += prm->n_tokens;
    p->hit_tokens += (uint64_t)hits * T;
    pool_unlock(p);
    free(keys);
    *out = &s->base;
    if (n_cached) *n_cached = hits * T;
    return PKV_OK;
fail:
    if (s) seq_dealloc(s);
    free(keys);
    return rc;
}

static uint32_t pool_prefix_match(pkv_kv_t *kv, const pkv_kv_key_t *keys, uint32_t n)
{
    pool_t *p = pool_of(kv);
    if (!p->prefix_cache) return 0;
    pthread_mutex_lock(&p->lock);
    uint32_t hits = 0;
    while (hits < n && htab_find(p, &keys[hits]) != NONE) hits++;
    pthread_mutex_unlock(&p->lock);
    return hits;
}

/* As pool_prefix_match, and the hits' ids into ids[], each pinned (a reference). */
static uint32_t pool_prefix_pin(pkv_kv_t *kv, const pkv_kv_key_t *keys, uint32_t n, uint32_t *ids)
{
    pool_t *p = pool_of(kv);
    if (!p->prefix_cache) return 0;
    pthread_mutex_lock(&p->lock);
    uint32_t hits = 0;
    while (hits < n && (ids[hits] = htab_find(p, &keys[hits])) != NONE) hits++;
    for (uint32_t i = 0; i < hits; i++) block_ref(p, ids[i]);
    pthread_mutex_unlock(&p->lock);
    return hits;
}

static void pool_seq_free(pkv_seq_t *seq)
{
    pool_seq_t *s = (pool_seq_t *)seq;
    pool_t *p = pool_of(seq->kv);
    pthread_mutex_lock(&p->lock);
    /* Last block first: the LRU then evicts a sequence's tail before its head. */
    for (uint32_t i = s->nb; i-- > 0;) block_unref(p, s->blocks[i]);
    p->live_tokens -= seq->length;
    seq_unlink(p, s);
    pool_settle(p);
    pthread_mutex_unlock(&p->lock);
    seq_dealloc(s);
}

/* Undo a reserve's allocation (lock held): its new table entries blocks[from, to) and the
 * copy's block `extra` (NONE: none) go back, and as many empty granules as it committed. */
static void reserve_undo(pool_t *p, const uint32_t *blocks, uint32_t from, uint32_t to,
                         uint32_t extra, uint64_t commits)
{
    if (extra != NONE) block_drop(p, extra, true);
    for (uint32_t i = from; i < to; i++) block_drop(p, blocks[i], true);
    pool_return_fresh(p, commits);
}

/* Block src's bytes into block dst, every rank's part (replicas included), through the
 * storage: the pool's only access to block bytes. Unlocked (the caller holds both). */
static int block_copy(const pool_t *p, uint32_t dst, uint32_t src)
{
    const pkv_geometry_t *g = &p->base.geo;
    for (uint32_t r = 0; r < p->tp; r++)
        for (uint32_t l = 0; l < g->layers; l++)
            for (uint32_t kv = 0; kv < 2; kv++)
                for (uint32_t h = 0; h < p->rk[r].head_n; h++) {
                    int rc = p->st.copy(p->st.ctx, rank_head_addr(p, &p->rk[r], dst, l, kv, h),
                                        rank_head_addr(p, &p->rk[r], src, l, kv, h), p->piece);
                    if (rc) return rc;
                }
    return PKV_OK;
}

static int pool_seq_reserve(pkv_seq_t *seq, uint32_t n_tokens)
{
    pool_seq_t *s = (pool_seq_t *)seq;
    pool_t *p = pool_of(seq->kv);
    uint32_t T = seq->kv->geo.block_tokens;
    uint32_t nb = PKV_MAX(PKV_DIV_UP(n_tokens, T), s->nb);
    uint32_t partial = seq->length % T ? seq->length / T : NONE; /* block index being filled */
    int rc = seq_grow_table(s, nb);
    if (rc) return rc;
    if (nb > (uint64_t)p->max_granules * p->bpg) {
        pthread_mutex_lock(&p->lock);
        rc = pool_nofit(p, nb);
        pthread_mutex_unlock(&p->lock);
        return rc;
    }
    pthread_mutex_lock(&p->lock);
    bool cow = partial != NONE && partial < s->nb && p->blk[s->blocks[partial]].ref > 1;
    uint32_t need = nb - s->nb + (cow ? 1 : 0), fresh[1];
    if (need > pool_available(p, 0)) {
        p->rej_nospace++;
        pthread_mutex_unlock(&p->lock);
        return PKV_ERR_NOSPACE;
    }
    /* New table entries first, the COW copy's block last (into fresh[0]). */
    uint64_t commits0 = p->commits;
    rc = pool_alloc(p, nb - s->nb, s->blocks + s->nb, s->nb ? s->blocks[s->nb - 1] : NONE,
                    &seq->commit_ns);
    if (rc == PKV_OK && cow) {
        uint64_t entry_commits = p->commits - commits0;
        rc = pool_alloc(p, 1, fresh, NONE, &seq->commit_ns);
        if (rc) reserve_undo(p, s->blocks, s->nb, nb, NONE, entry_commits);
    }
    if (rc) {
        if (rc == PKV_ERR_NOSPACE) p->rej_nospace++;
        pthread_mutex_unlock(&p->lock);
        return rc;
    }
    uint64_t commits = p->commits - commits0; /* this reserve's, before others' can add */
    pool_unlock(p);
    if (cow) {
        /* We hold a reference on the shared block: no sharer writes it (each copies
         * first, as we do), so the copy runs unlocked. */
        uint32_t old = s->blocks[partial];
        rc = block_copy(p, fresh[0], old);
        pthread_mutex_lock(&p->lock);
        if (rc) { /* the storage failed: the sequence and the pool as they were */
            reserve_undo(p, s->blocks, s->nb, nb, fresh[0], commits);
            pthread_mutex_unlock(&p->lock);
            return rc;
        }
        s->blocks[partial] = fresh[0];
        block_unref(p, old);
        p->cow++;
        pool_settle(p);
        pthread_mutex_unlock(&p->lock);
    }
    s->nb = nb;
    seq->capacity = nb * T;
    return PKV_OK;
}

/* Key block id under salt (lock held): false when it is keyed already or another block
 * has the key. */
static bool block_key(pool_t *p, uint32_t id, const pkv_kv_key_t *key, uint64_t salt)
{
    if (p->blk[id].hashed || htab_find(p, key) != NONE) return false;
    p->blk[id].key = *key;
    p->blk[id].salt = salt;
    htab_insert(p, id);
    return true;
}

static void pool_publish(struct pkv_seq *seq, uint32_t block, const pkv_kv_key_t *key,
                         const pkv_kv_key_t *parent, void *arg)
{
    pool_seq_t *s = (pool_seq_t *)seq;
    pool_t *p = arg;
    if (!p->prefix_cache) return;
    pthread_mutex_lock(&p->lock);
    bool keyed = block_key(p, s->blocks[block], key, seq->salt);
    pthread_mutex_unlock(&p->lock);
    if (keyed && p->base.on_full) p->base.on_full(p->base.on_full_arg, key, parent, seq->salt);
}

static int pool_seq_append(pkv_seq_t *seq, const int32_t *tokens, uint32_t n)
{
    pool_t *p = pool_of(seq->kv);
    kv_seq_base_append(seq, tokens, n, pool_publish, p);
    pthread_mutex_lock(&p->lock);
    p->live_tokens += n;
    pthread_mutex_unlock(&p->lock);
    return PKV_OK;
}

static int pool_seq_fork(pkv_seq_t *parent, pkv_seq_t **out)
{
    pool_seq_t *ps = (pool_seq_t *)parent;
    pool_t *p = pool_of(parent->kv);
    uint32_t T = parent->kv->geo.block_tokens;
    uint32_t nb = PKV_DIV_UP(parent->length, T);
    pool_seq_t *c = seq_alloc(p, parent->salt, nb);
    if (!c) return PKV_ERR_NOMEM;
    kv_seq_base_copy(&c->base, parent);
    memcpy(c->blocks, ps->blocks, (size_t)nb * sizeof(uint32_t));
    c->nb = nb;
    /* A shared partial block must be copied before either side writes it. */
    c->base.capacity = parent->length;
    if (parent->length % T) parent->capacity = parent->length;
    pthread_mutex_lock(&p->lock);
    for (uint32_t i = 0; i < nb; i++) block_ref(p, c->blocks[i]);
    seq_link(p, c);
    p->live_tokens += parent->length;
    pthread_mutex_unlock(&p->lock);
    *out = &c->base;
    return PKV_OK;
}

/* Position pos of layer in rank r: K and V of the rank's first head. */
static inline void slot_in(const pkv_seq_t *seq, const pool_rank_t *r, uint32_t pos, uint32_t layer,
                           void **k, void **v, size_t *head_stride)
{
    const pool_seq_t *s = (const pool_seq_t *)seq;
    const pool_t *p = pool_of(seq->kv);
    const pkv_geometry_t *g = &seq->kv->geo;
    size_t T = g->block_tokens;
    uint32_t id = s->blocks[pos / T];
    size_t row = (size_t)(pos % T) * seq->kv->row_bytes;
    *k = rank_head_addr(p, r, id, layer, 0, 0) + row;
    *v = rank_head_addr(p, r, id, layer, 1, 0) + row;
    *head_stride = (size_t)p->bpg * p->piece;
}

static void pool_seq_slot(const pkv_seq_t *seq, uint32_t pos, uint32_t layer, void **k, void **v,
                          size_t *head_stride)
{
    slot_in(seq, &pool_of(seq->kv)->rk[0], pos, layer, k, v, head_stride);
}

static void pool_seq_slot_rank(const pkv_seq_t *seq, uint32_t rank, uint32_t pos, uint32_t layer,
                               void **k, void **v, size_t *head_stride)
{
    slot_in(seq, &pool_of(seq->kv)->rk[rank], pos, layer, k, v, head_stride);
}

/* The runs of [begin, end) in rank r: the same positions and lengths in every rank. */
static inline uint32_t runs_in(const pkv_seq_t *seq, const pool_rank_t *r, uint32_t layer,
                               uint32_t begin, uint32_t end, pkv_kv_run_t *out, uint32_t max,
                               uint32_t *next)
{
    const pool_seq_t *s = (const pool_seq_t *)seq;
    const pool_t *p = pool_of(seq->kv);
    uint32_t T = seq->kv->geo.block_tokens, n = 0, pos = begin;
    while (pos < end && n < max) {
        /* One run across blocks that follow each other in consecutive slots of a granule:
         * their tokens are contiguous per head. */
        uint32_t b = pos / T, e = b + 1;
        while (e * T < end && s->blocks[e] == s->blocks[e - 1] + 1 && s->blocks[e] % p->bpg) e++;
        uint32_t stop = PKV_MIN(end, e * T);
        void *k, *v;
        size_t hs;
        slot_in(seq, r, pos, layer, &k, &v, &hs);
        out[n++] =
            (pkv_kv_run_t){.k = k, .v = v, .pos = pos, .n_tokens = stop - pos, .head_stride = hs};
        pos = stop;
    }
    if (next) *next = pos;
    return n;
}

static uint32_t pool_seq_runs(const pkv_seq_t *seq, uint32_t layer, uint32_t begin, uint32_t end,
                              pkv_kv_run_t *out, uint32_t max, uint32_t *next)
{
    return runs_in(seq, &pool_of(seq->kv)->rk[0], layer, begin, end, out, max, next);
}

static uint32_t pool_seq_runs_rank(const pkv_seq_t *seq, uint32_t rank, uint32_t layer,
                                   uint32_t begin, uint32_t end, pkv_kv_run_t *out, uint32_t max,
                                   uint32_t *next)
{
    return runs_in(seq, &pool_of(seq->kv)->rk[rank], layer, begin, end, out, max, next);
}

/* ---- block access for transfers ----------------------------------------------------- */

static void pool_seq_blocks(const pkv_seq_t *seq, const uint32_t **ids, uint32_t *n)
{
    const pool_seq_t *s = (const pool_seq_t *)seq;
    *ids = s->blocks;
    *n = s->nb;
}

static void *pool_block_head(const pkv_kv_t *kv, uint32_t block, uint32_t layer, uint32_t which,
                             uint32_t head)
{
    const pool_t *p = pool_of(kv);
    if (block >= p->n_granules * p->bpg) return NULL;
    const pool_rank_t *r = &p->rk[first_rank(p, head)];
    return rank_head_addr(p, r, block, layer, which, head - r->head_lo);
}

/* kv.c has checked that rank holds head. */
static void *pool_block_head_rank(const pkv_kv_t *kv, uint32_t rank, uint32_t block, uint32_t layer,
                                  uint32_t which, uint32_t head)
{
    const pool_t *p = pool_of(kv);
    if (block >= p->n_granules * p->bpg) return NULL;
    const pool_rank_t *r = &p->rk[rank];
    return rank_head_addr(p, r, block, layer, which, head - r->head_lo);
}

static void pool_rank(const pkv_kv_t *kv, uint32_t rank, pkv_kv_rank_t *out)
{
    pool_t *p = pool_of(kv);
    const pool_rank_t *r = &p->rk[rank];
    pthread_mutex_lock(&p->lock);
    uint64_t committed = (uint64_t)p->committed * r->stride;
    pthread_mutex_unlock(&p->lock);
    *out = (pkv_kv_rank_t){.head_lo = r->head_lo,
                           .head_n = r->head_n,
                           .base = r->addr,
                           .bytes = r->reserved,
                           .committed_bytes = committed};
}

static int pool_pin(pkv_kv_t *kv, const uint32_t *ids, uint32_t n)
{
    pool_t *p = pool_of(kv);
    pthread_mutex_lock(&p->lock);
    for (uint32_t i = 0; i < n; i++) {
        if (ids[i] >= p->n_granules * p->bpg || p->blk[ids[i]].state == BLK_FREE) {
            pthread_mutex_unlock(&p->lock);
            return PKV_ERR_NOTFOUND;
        }
    }
    for (uint32_t i = 0; i < n; i++) block_ref(p, ids[i]);
    pthread_mutex_unlock(&p->lock);
    return PKV_OK;
}

static void pool_unpin(pkv_kv_t *kv, const uint32_t *ids, uint32_t n)
{
    pool_t *p = pool_of(kv);
    pthread_mutex_lock(&p->lock);
    for (uint32_t i = 0; i < n; i++) block_unref(p, ids[i]);
    pool_settle(p);
    pthread_mutex_unlock(&p->lock);
}

static int pool_blocks_alloc(pkv_kv_t *kv, uint32_t n, uint32_t *ids)
{
    pool_t *p = pool_of(kv);
    pthread_mutex_lock(&p->lock);
    int rc = n > pool_available(p, 0) ? PKV_ERR_NOSPACE : pool_alloc(p, n, ids, NONE, NULL);
    pool_unlock(p);
    return rc;
}

/* ---- cache control, stats, validation --------------------------------------------- */

static int pool_key_pin(pkv_kv_t *kv, const pkv_kv_key_t *key, uint32_t *id)
{
    pool_t *p = pool_of(kv);
    pthread_mutex_lock(&p->lock);
    uint32_t b = htab_find(p, key);
    if (b != NONE) block_ref(p, b);
    pthread_mutex_unlock(&p->lock);
    if (b == NONE) return PKV_ERR_NOTFOUND;
    *id = b;
    return PKV_OK;
}

static uint32_t pool_blocks_publish(pkv_kv_t *kv, const uint32_t *ids, const pkv_kv_key_t *keys,
                                    uint32_t n, uint64_t salt)
{
    pool_t *p = pool_of(kv);
    uint32_t keyed = 0;
    if (!p->prefix_cache) return 0;
    pthread_mutex_lock(&p->lock);
    for (uint32_t i = 0; i < n; i++) {
        PKV_ASSERT(ids[i] < p->n_granules * p->bpg && p->blk[ids[i]].state == BLK_LIVE);
        keyed += block_key(p, ids[i], &keys[i], salt);
    }
    pthread_mutex_unlock(&p->lock);
    return keyed;
}

static uint64_t pool_purge_salt(pkv_kv_t *kv, uint64_t salt)
{
    pool_t *p = pool_of(kv);
    uint64_t n = 0;
    pthread_mutex_lock(&p->lock);
    for (uint32_t id = 0; id < p->n_granules * p->bpg; id++) {
        pool_block_t *b = &p->blk[id];
        if (!b->hashed || b->salt != salt) continue;
        n++;
        if (b->state == BLK_CACHED) {
            evict_block(p, id, false, EV_RESET);
        } else {
            htab_remove(p, id);
        }
    }
    pool_settle(p);
    pthread_mutex_unlock(&p->lock);
    return n;
}

static void pool_reset_cache(pkv_kv_t *kv)
{
    pool_t *p = pool_of(kv);
    pthread_mutex_lock(&p->lock);
    while (p->n_cached) evict_one(p, false, EV_RESET);
    /* A reset gives everything back: the warm floor too, until the next allocation. */
    p->warm_rm = (pkv_recent_max_t){0};
    p->warm = 0;
    pool_retire_beyond_keep(p);
    pool_flush_decommits(p);
    pthread_mutex_unlock(&p->lock);
}

static uint64_t pool_trim(pkv_kv_t *kv, uint64_t now_ns, uint64_t *next_ns)
{
    pool_t *p = pool_of(kv);
    uint64_t n = 0;
    pthread_mutex_lock(&p->lock);
    /* The LRU is in release order, so the expired blocks are its head. */
    while (p->idle_ns && p->lru_head != NONE &&
           p->blk[p->lru_head].t_cached <= now_ns - PKV_MIN(now_ns, p->idle_ns)) {
        evict_block(p, p->lru_head, false, EV_IDLE);
        n++;
    }
    /* The warm floor, fallen or lapsed, goes back with the empty granules beyond retain
     * (what allocations took from a live floor pool_warm_refill commits again). */
    uint64_t warm_change;
    p->warm = pkv_recent_max_get(&p->warm_rm, now_ns, p->warm_life, &warm_change);
    pool_retire_beyond_keep(p);
    pool_settle(p);
    uint64_t next =
        p->idle_ns && p->lru_head != NONE ? p->blk[p->lru_head].t_cached + p->idle_ns : UINT64_MAX;
    next = PKV_MIN(next, warm_change);
    if (next_ns) *next_ns = next;
    pthread_mutex_unlock(&p->lock);
    return n;
}

/* Commit again the empty granules allocations took from the warm floor (at most max; 0: all),
 * off their path (the lock is dropped around each commit). */
static uint32_t pool_warm_refill(pkv_kv_t *kv, uint32_t max)
{
    pool_t *p = pool_of(kv);
    uint32_t n = 0;
    if (!max) max = UINT32_MAX;
    pthread_mutex_lock(&p->lock);
    while (warm_short(p) && n < max) {
        uint32_t got =
            pool_commit(p, PKV_MIN(PKV_MIN(warm_now(p) - p->n_empty, 64), max - n), NULL);
        if (!got) break;
        p->warm_refills += got;
        n += got;
    }
    pthread_mutex_unlock(&p->lock);
    return n;
}

static void pool_cache_pressure(pkv_kv_t *kv, uint64_t limit_bytes)
{
    pool_t *p = pool_of(kv);
    pthread_mutex_lock(&p->lock);
    p->pressure_limit = limit_bytes;
    pool_retire_beyond_keep(p);
    pool_settle(p);
    pthread_mutex_unlock(&p->lock);
}

/* Whether 2 MiB pages can back a granule: each rank's granule must be a multiple of them
 * (its ranges are reserved 2 MiB-aligned). */
static bool pool_huge_granules(const pool_t *p)
{
    for (uint32_t r = 0; r < p->tp; r++)
        if (p->rk[r].stride % PKV_PRIM_HUGE) return false;
    return true;
}

static void pool_stats(pkv_kv_t *kv, pkv_kv_stats_t *o)
{
    pool_t *p = pool_of(kv);
    pthread_mutex_lock(&p->lock);
    o->committed_bytes = (uint64_t)p->committed * p->gbytes;
    o->peak_committed_bytes = p->peak_committed;
    o->reserved_bytes = p->reserved;
    o->budget_bytes = p->budget;
    o->granule_bytes = p->gbytes;
    o->storage_ranges = p->tp;
    o->huge_granules = pool_huge_granules(p);
    o->tp = p->tp;
    o->block_bytes = p->blk_bytes;
    o->token_bytes = p->blk_bytes / kv->geo.block_tokens;
    o->blocks_capacity = (uint64_t)p->max_granules * p->bpg;
    o->blocks_live = p->n_live;
    o->blocks_cached = p->n_cached;
    o->blocks_free = p->n_free;
    o->live_tokens = p->live_tokens;
    o->sequences = p->n_seqs;
    o->prefix_queries = p->q_count;
    o->prefix_query_tokens = p->q_tokens;
    o->prefix_hit_tokens = p->hit_tokens;
    o->evictions = p->evictions;
    o->cow_copies = p->cow;
    o->commits = p->commits;
    o->decommits = p->decommits;
    o->rejected_nofit = p->rej_nofit;
    o->rejected_nospace = p->rej_nospace;
    o->cache_bytes = (uint64_t)p->cache_granules * p->gbytes;
    o->cache_max_bytes = p->cache_cap;
    o->cache_pressure_limit = p->pressure_limit;
    o->cache_idle_ms = p->idle_ns / 1000000;
    o->evictions_budget = p->ev[EV_BUDGET];
    o->evictions_cap = p->ev[EV_CAP];
    o->evictions_idle = p->ev[EV_IDLE];
    o->evictions_pressure = p->ev[EV_PRESSURE];
    o->evictions_reset = p->ev[EV_RESET];
    o->empty_bytes = (uint64_t)p->n_empty * p->gbytes;
    o->warm_bytes = (uint64_t)warm_now(p) * p->gbytes;
    o->warm_max_bytes = (uint64_t)p->warm_max * p->gbytes;
    o->warm_refills = p->warm_refills;
    o->commit_ns = p->commit_ns;
    pthread_mutex_unlock(&p->lock);
}

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            PKV_LOGE("pool", "validate: " __VA_ARGS__);                                            \
            rc = PKV_ERR_CORRUPT;                                                                  \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

/* The ranks: each holds the heads pkv_kv_tp_heads gives it, laid out over exactly its
 * stride, in a range of its own (no two overlap); the strides add up to the granule bytes
 * the accounting counts and every head is held by some rank. */
static int validate_ranks(const pool_t *p)
{
    int rc = PKV_OK;
    const pkv_geometry_t *g = &p->base.geo;
    size_t gbytes = 0, blk = 0, reserved = 0;
    uint64_t heads_seen[PKV_DIV_UP(1024, 64)] = {0};
    for (uint32_t r = 0; r < p->tp; r++) {
        const pool_rank_t *rk = &p->rk[r];
        uint32_t lo, n;
        pkv_kv_tp_heads(g->kv_heads, p->tp, r, &lo, &n);
        size_t share = p->piece * 2 * g->layers * n;
        CHECK(rk->head_lo == lo && rk->head_n == n, "rank %u holds heads [%u, +%u), not [%u, +%u)",
              r, rk->head_lo, rk->head_n, lo, n);
        CHECK(rk->stride == p->st.stride(p->st.ctx, (size_t)p->bpg * share) &&
                  rk->reserved == (size_t)p->n_granules * rk->stride,
              "rank %u stride %zu / reserved %zu inconsistent", r, rk->stride, rk->reserved);
        for (uint32_t q = 0; q < r; q++)
            CHECK(rk->addr + rk->reserved <= p->rk[q].addr ||
                      p->rk[q].addr + p->rk[q].reserved <= rk->addr,
                  "ranks %u and %u overlap", q, r);
        for (uint32_t h = lo; h < lo + n; h++) heads_seen[h / 64] |= 1ull << (h % 64);
        gbytes += rk->stride;
        blk += share;
        reserved += rk->reserved;
    }
    for (uint32_t h = 0; h < g->kv_heads; h++)
        CHECK(heads_seen[h / 64] >> (h % 64) & 1, "KV head %u held by no rank", h);
    CHECK(gbytes == p->gbytes && blk == p->blk_bytes && reserved == p->reserved,
          "rank totals drift: granule %zu/%zu block %zu/%zu reserved %zu/%zu", gbytes, p->gbytes,
          blk, p->blk_bytes, reserved, p->reserved);
out:
    return rc;
}

static int pool_validate(pkv_kv_t *kv)
{
    pool_t *p = pool_of(kv);
    uint32_t nblk = p->n_granules * p->bpg;
    uint32_t *seq_refs = kv_calloc(nblk, sizeof(uint32_t));
    if (!seq_refs) return PKV_ERR_NOMEM;
    int rc = PKV_OK;
    pthread_mutex_lock(&p->lock);
    uint64_t live = 0, cached = 0, free_ = 0, committed = 0, empty = 0, lru = 0, hashed = 0;
    uint64_t cache_only = 0;
    uint64_t seqs = 0, tokens = 0;
    rc = validate_ranks(p);
    if (rc) goto out;
    for (pool_seq_t *s = p->seqs; s; s = s->next, seqs++) {
        uint32_t T = kv->geo.block_tokens;
        CHECK(s->base.length <= s->base.capacity && s->base.capacity <= s->nb * T,
              "seq length %u capacity %u blocks %u", s->base.length, s->base.capacity, s->nb);
        for (uint32_t i = 0; i < s->nb; i++) {
            CHECK(s->blocks[i] < nblk, "seq block id %u out of range", s->blocks[i]);
            seq_refs[s->blocks[i]]++;
        }
        /* Writable positions lie in blocks owned alone. */
        for (uint32_t b = s->base.length / T;
             s->base.capacity > s->base.length && b < PKV_DIV_UP(s->base.capacity, T); b++)
            CHECK(!p->blk[s->blocks[b]].hashed, "writable block %u is hashed", s->blocks[b]);
        tokens += s->base.length;
    }
    CHECK(seqs == p->n_seqs && tokens == p->live_tokens, "sequence count/tokens drift");
    for (pool_seq_t *s = p->seqs; s; s = s->next) /* no other sequence can see them */
        for (uint32_t b = s->base.length / kv->geo.block_tokens;
             s->base.capacity > s->base.length &&
             b < PKV_DIV_UP(s->base.capacity, kv->geo.block_tokens);
             b++)
            CHECK(seq_refs[s->blocks[b]] == 1, "writable block %u shared by %u sequences",
                  s->blocks[b], seq_refs[s->blocks[b]]);
    for (uint32_t g = 0; g < p->n_granules; g++) {
        pool_granule_t *gr = &p->gr[g];
        if (gr->state != GR_COMMITTED) {
            CHECK(gr->state == GR_UNCOMMITTED || gr->state == GR_DECOMMITTING ||
                      gr->state == GR_COMMITTING,
                  "granule %u bad state", g);
            if (gr->state != GR_UNCOMMITTED) committed++;
            continue;
        }
        committed++;
        uint32_t used = 0, nfree = 0, ncached = 0;
        for (uint32_t j = 0; j < p->bpg; j++) {
            uint32_t id = g * p->bpg + j;
            pool_block_t *b = &p->blk[id];
            if (b->state == BLK_FREE) {
                nfree++;
                CHECK(seq_refs[id] == 0, "free block %u in a sequence", id);
                continue;
            }
            used++;
            if (b->state == BLK_LIVE) {
                live++;
                CHECK(b->ref >= seq_refs[id] && b->ref > 0, "block %u ref %u < seq refs %u", id,
                      b->ref, seq_refs[id]);
            } else {
                CHECK(b->state == BLK_CACHED && b->ref == 0 && b->hashed && seq_refs[id] == 0,
                      "cached block %u inconsistent", id);
                cached++;
                ncached++;
            }
            if (b->hashed) {
                hashed++;
                CHECK(htab_find(p, &b->key) == id, "hashed block %u not found by its key", id);
            }
        }
        uint32_t walk = 0;
        for (uint32_t id = gr->free_head; id != NONE; id = p->blk[id].next, walk++)
            CHECK(walk < p->bpg && id / p->bpg == g && p->blk[id].state == BLK_FREE,
                  "granule %u free list corrupt", g);
        CHECK(used == gr->used && nfree == gr->nfree && walk == nfree && used + nfree == p->bpg,
              "granule %u counts used %u/%u free %u/%u", g, used, gr->used, nfree, gr->nfree);
        CHECK(gr->in_bucket == (nfree > 0), "granule %u bucket membership", g);
        CHECK(ncached == gr->ncached, "granule %u cached count %u/%u", g, ncached, gr->ncached);
        cache_only += gr_cache_only(gr);
        free_ += nfree;
        empty += used == 0;
    }
    int cause;
    CHECK(cache_only == p->cache_granules, "cache-only granules %llu/%u",
          (unsigned long long)cache_only, p->cache_granules);
    CHECK(cache_only * p->gbytes <= cache_allowed(p, &cause),
          "cache holds %llu bytes, allowed %llu", (unsigned long long)(cache_only * p->gbytes),
          (unsigned long long)cache_allowed(p, &cause));
    for (uint32_t id = p->lru_head, prev = NONE; id != NONE; prev = id, id = p->blk[id].lru_next) {
        CHECK(p->blk[id].state == BLK_CACHED && p->blk[id].lru_prev == prev, "LRU list corrupt");
        CHECK(prev == NONE || p->blk[prev].t_cached <= p->blk[id].t_cached, "LRU out of order");
        CHECK(++lru <= cached, "LRU longer than cached count");
    }
    uint64_t in_table = 0;
    for (uint32_t h = 0; h <= p->hmask; h++)
        for (uint32_t id = p->htab[h]; id != NONE; id = p->blk[id].hnext) in_table++;
    CHECK(live == p->n_live && cached == p->n_cached && free_ == p->n_free && lru == cached,
          "block counts live %llu/%llu cached %llu/%llu free %llu/%llu", (unsigned long long)live,
          (unsigned long long)p->n_live, (unsigned long long)cached,
          (unsigned long long)p->n_cached, (unsigned long long)free_,
          (unsigned long long)p->n_free);
    CHECK(in_table == hashed, "hash table holds %llu, hashed %llu", (unsigned long long)in_table,
          (unsigned long long)hashed);
    CHECK(committed == p->committed && committed <= p->max_granules, "committed granules drift");
    CHECK(empty == p->n_empty, "empty granule count drift");
    CHECK(committed + p->n_uncommitted == p->n_granules, "granule stack drift");
out:
    pthread_mutex_unlock(&p->lock);
    free(seq_refs);
    return rc;
}

/* ---- create / destroy -------------------------------------------------------------- */

/* Free the metadata arrays and the pool object (the range and lock are the caller's). */
static void pool_free(pool_t *p)
{
    free(p->blk);
    free(p->gr);
    free(p->bucket);
    free(p->bucket_bits);
    free(p->uncommitted);
    free(p->htab);
    free(p);
}

/* Release the first n ranks' ranges. */
static void pool_release_ranks(pool_t *p, uint32_t n)
{
    for (uint32_t r = 0; r < n; r++) p->st.release(p->st.ctx, p->rk[r].addr, p->rk[r].reserved);
}

static void pool_destroy(pkv_kv_t *kv)
{
    pool_t *p = pool_of(kv);
    PKV_ASSERT(p->n_seqs == 0);
    for (uint32_t g = 0; g < p->n_granules; g++) /* a backend releases empty ranges only */
        if (p->gr[g].state != GR_UNCOMMITTED) granule_decommit(p, g);
    pool_release_ranks(p, p->tp);
    pthread_mutex_destroy(&p->lock);
    pool_free(p);
}

/* The ranks' heads and strides, and the totals over them. */
static void pool_layout_ranks(pool_t *p)
{
    const pkv_geometry_t *g = &p->base.geo;
    p->gbytes = p->blk_bytes = 0;
    for (uint32_t r = 0; r < p->tp; r++) {
        pool_rank_t *rk = &p->rk[r];
        pkv_kv_tp_heads(g->kv_heads, p->tp, r, &rk->head_lo, &rk->head_n);
        size_t share = p->piece * 2 * g->layers * rk->head_n; /* the rank's part of a block */
        rk->stride = p->st.stride(p->st.ctx, (size_t)p->bpg * share);
        p->gbytes += rk->stride;
        p->blk_bytes += share;
    }
}

/* ---- host storage: the OS primitives ------------------------------------------------- */

static size_t host_stride(void *ctx, size_t used)
{
    (void)ctx;
    return pkv_prim_granule_stride(used);
}

static int host_reserve(void *ctx, size_t bytes, void **addr)
{
    (void)ctx;
    return pkv_prim_reserve(bytes, PKV_PRIM_HUGE, addr);
}

static void host_release(void *ctx, void *addr, size_t bytes)
{
    (void)ctx;
    pkv_prim_release(addr, bytes);
}

static int host_commit(void *ctx, void *addr, size_t bytes, bool huge)
{
    (void)ctx;
    return pkv_prim_commit(addr, bytes, huge);
}

static void host_decommit(void *ctx, void *addr, size_t bytes)
{
    (void)ctx;
    pkv_prim_decommit(addr, bytes);
}

static int host_copy(void *ctx, void *dst, const void *src, size_t bytes)
{
    (void)ctx;
    memcpy(dst, src, bytes);
    return PKV_OK;
}

static const pkv_kv_storage_t host_storage = {
    "host", host_stride, host_reserve, host_release, host_commit, host_decommit, host_copy, NULL};

int kv_pool_create(const pkv_kv_config_t *cfg, pkv_kv_t **out)
{
    pool_t *p = kv_calloc(1, sizeof(*p));
    if (!p) return PKV_ERR_NOMEM;
    int rc = PKV_ERR_NOMEM;
    kv_base_init(&p->base, cfg, &pool_ops);
    p->st = cfg->storage ? *cfg->storage : host_storage;
    size_t bb = p->base.block_bytes;
    uint64_t gran = cfg->granule_bytes ? cfg->granule_bytes : pkv_prim_granule_for(bb);
    if (gran % PKV_PRIM_PAGE) {
        PKV_LOGE("pool", "granule_bytes %llu is not a multiple of 4 KiB", (unsigned long long)gran);
        free(p);
        return PKV_ERR_INVALID;
    }
    p->bpg = (uint32_t)PKV_MAX(1, gran / bb);
    p->piece = (size_t)p->base.geo.block_tokens * p->base.row_bytes;
    p->tp = p->base.tp;
    pool_layout_ranks(p);
    p->budget = cfg->budget_bytes;
    uint64_t span = cfg->budget_bytes
                        ? cfg->budget_bytes
                        : (cfg->reserve_bytes ? cfg->reserve_bytes : POOL_DEFAULT_RESERVE);
    uint64_t ng = span / p->gbytes;
    ng = PKV_MIN(ng, POOL_MAX_BLOCKS / p->bpg);
    if (ng == 0) {
        PKV_LOGE("pool", "budget %llu bytes is smaller than one granule (%zu bytes over %u ranks)",
                 (unsigned long long)span, p->gbytes, p->tp);
        free(p);
        return cfg->budget_bytes ? PKV_ERR_NOFIT : PKV_ERR_INVALID;
    }
    p->n_granules = p->max_granules = (uint32_t)ng;
    p->reserved = (size_t)ng * p->gbytes;
    for (uint32_t r = 0; r < p->tp; r++) p->rk[r].reserved = (size_t)ng * p->rk[r].stride;
    p->retain = cfg->retain_granules ? cfg->retain_granules : 1;
    p->prefix_cache = !cfg->no_prefix_cache;
    p->huge = cfg->hugepages;
    if (p->huge && !cfg->storage && !pool_huge_granules(p))
        PKV_LOGW("pool",
                 "huge pages asked, but a granule is %zu bytes per range (not a multiple of 2 "
                 "MiB): the kernel backs it with 4 KiB pages",
                 p->rk[0].stride);
    p->cache_cap = cfg->cache_max_bytes;
    p->idle_ns = (uint64_t)cfg->cache_idle_ms * 1000000;
    p->warm_max = (uint32_t)PKV_MIN(cfg->warm_max_bytes / p->gbytes, p->max_granules);
    p->warm_life = (uint64_t)(cfg->warm_idle_ms ? cfg->warm_idle_ms : POOL_WARM_LIFE_MS) * 1000000;
    p->pressure_limit = PKV_KV_NO_LIMIT;
    uint32_t nblk = p->n_granules * p->bpg, hsize = 64;
    while (hsize < nblk / 2) hsize <<= 1;
    p->blk = kv_calloc(nblk, sizeof(*p->blk));
    p->gr = kv_calloc(p->n_granules, sizeof(*p->gr));
    p->bucket = kv_malloc((size_t)p->bpg * sizeof(uint32_t));
    p->bucket_bits = kv_calloc(PKV_DIV_UP(p->bpg, 64), sizeof(uint64_t));
    p->uncommitted = kv_malloc((size_t)p->n_granules * sizeof(uint32_t));
    p->htab = kv_malloc((size_t)hsize * sizeof(uint32_t));
    if (!p->blk || !p->gr || !p->bucket || !p->bucket_bits || !p->uncommitted || !p->htab)
        goto fail;
    p->hmask = hsize - 1;
    memset(p->htab, 0xff, (size_t)hsize * sizeof(uint32_t));
    memset(p->bucket, 0xff, (size_t)p->bpg * sizeof(uint32_t));
    for (uint32_t g = 0; g < p->n_granules; g++) p->uncommitted[g] = p->n_granules - 1 - g;
    p->n_uncommitted = p->n_granules;
    p->lru_head = p->lru_tail = p->decommit_head = NONE;
    uint32_t ranks = 0;
    for (; ranks < p->tp; ranks++) {
        rc = p->st.reserve(p->st.ctx, p->rk[ranks].reserved, (void **)&p->rk[ranks].addr);
        if (rc) goto fail_reserve;
    }
    if (pthread_mutex_init(&p->lock, NULL) != 0) {
        rc = PKV_ERR_NOMEM;
        goto fail_reserve;
    }
    *out = &p->base;
    return PKV_OK;
fail_reserve:
    pool_release_ranks(p, ranks);
fail:
    pool_free(p);
    return rc;
}

static const kv_ops_t pool_ops = {
    .destroy = pool_destroy,
    .seq_create = pool_seq_create,
    .seq_free = pool_seq_free,
    .seq_reserve = pool_seq_reserve,
    .seq_append = pool_seq_append,
    .seq_fork = pool_seq_fork,
    .seq_slot = pool_seq_slot,
    .seq_runs = pool_seq_runs,
    .reset_cache = pool_reset_cache,
    .trim = pool_trim,
    .warm_refill = pool_warm_refill,
    .cache_pressure = pool_cache_pressure,
    .prefix_match = pool_prefix_match,
    .prefix_pin = pool_prefix_pin,
    .stats = pool_stats,
    .validate = pool_validate,
    .seq_blocks = pool_seq_blocks,
    .block_head = pool_block_head,
    .block_head_rank = pool_block_head_rank,
    .seq_slot_rank = pool_seq_slot_rank,
    .seq_runs_rank = pool_seq_runs_rank,
    .rank = pool_rank,
    .pin = pool_pin,
    .unpin = pool_unpin,
    .blocks_alloc = pool_blocks_alloc,
    .key_pin = pool_key_pin,
    .blocks_publish = pool_blocks_publish,
    .purge_salt = pool_purge_salt,
};
