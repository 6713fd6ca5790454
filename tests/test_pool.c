/*
 * KV cache (paged pool and dense baseline): a seeded property test against a reference
 * model, plus the pool's own properties: counters agree with VmRSS,
 * growth never moves a block, admission beyond the budget fails without side effects,
 * prefix adoption, copy-on-write, pins, reset.
 */
#include "tests/support/testutil.h"

#include "kv/kv_int.h"
#include "prim/prim.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

/* ---- K/V contents as a function of the token prefix (like a real model) ------------ */

static uint64_t mix(uint64_t h, int32_t tok)
{
    uint64_t s = h ^ ((uint64_t)(uint32_t)tok * 0x9e3779b97f4a7c15ull);
    return pkv_test_rand(&s);
}

/* Fill K/V of position pos in every layer/head (of every tensor-parallel rank holding
 * it) with a pattern derived from h and the global head. */
static void fill_pos(pkv_seq_t *s, uint32_t pos, uint64_t h)
{
    const pkv_geometry_t *g = pkv_kv_geometry(s->kv);
    size_t row = pkv_dtype_row_bytes(g->dtype, g->head_dim);
    uint32_t tp = pkv_kv_tp(s->kv);
    for (uint32_t lr = 0; lr < g->layers * tp; lr++) { /* every (layer, rank) */
        uint32_t l = lr / tp, r = lr % tp;
        void *k, *v;
        size_t hs;
        uint32_t lo, n;
        pkv_kv_tp_heads(g->kv_heads, tp, r, &lo, &n);
        pkv_seq_slot_rank(s, r, pos, l, &k, &v, &hs);
        for (uint32_t hd = lo; hd < lo + n; hd++) {
            uint8_t *kp = (uint8_t *)k + (hd - lo) * hs;
            uint8_t *vp = (uint8_t *)v + (hd - lo) * hs;
            uint64_t st = h + l * 131 + hd * 7;
            for (size_t i = 0; i < row; i += 8) {
                uint64_t a = pkv_test_rand(&st), b = ~a;
                memcpy(kp + i, &a, PKV_MIN(8, row - i));
                memcpy(vp + i, &b, PKV_MIN(8, row - i));
            }
        }
    }
}

/* Check K/V of position pos against the pattern, reading through runs (in every rank). */
static int check_pos(const pkv_seq_t *s, uint32_t pos, uint64_t h)
{
    const pkv_geometry_t *g = pkv_kv_geometry(s->kv);
    size_t row = pkv_dtype_row_bytes(g->dtype, g->head_dim);
    uint32_t tp = pkv_kv_tp(s->kv);
    for (uint32_t lr = 0; lr < g->layers * tp; lr++) { /* every (layer, rank) */
        uint32_t l = lr / tp, r = lr % tp;
        pkv_kv_run_t run;
        uint32_t next, lo, n;
        pkv_kv_tp_heads(g->kv_heads, tp, r, &lo, &n);
        PKV_CHECK_EQ(pkv_seq_runs_rank(s, r, l, pos, pos + 1, &run, 1, &next), 1);
        for (uint32_t hd = lo; hd < lo + n; hd++) {
            const uint8_t *kp = (const uint8_t *)run.k + (hd - lo) * run.head_stride;
            const uint8_t *vp = (const uint8_t *)run.v + (hd - lo) * run.head_stride;
            uint64_t st = h + l * 131 + hd * 7;
            for (size_t i = 0; i < row; i += 8) {
                uint64_t a = pkv_test_rand(&st), b = ~a;
                if (memcmp(kp + i, &a, PKV_MIN(8, row - i)) ||
                    memcmp(vp + i, &b, PKV_MIN(8, row - i)))
                    return 0;
            }
        }
    }
    return 1;
}

/* ---- the reference model -------------------------------------------------------------- */

#define MAX_SEQS 24
#define MAX_TOK  400

typedef struct {
    pkv_seq_t *seq;
    uint64_t salt;
    int32_t tok[MAX_TOK];
    uint64_t h[MAX_TOK]; /* prefix hash after each token */
    uint32_t n;
    bool pinned;
    uint32_t pins[MAX_TOK / 16 + 8]; /* the block ids pinned (the table may change since) */
    uint32_t n_pins;
} ref_seq_t;

typedef struct {
    pkv_kv_t *kv;
    ref_seq_t s[MAX_SEQS];
    uint32_t n;
    uint64_t rng;
    uint32_t nospace, nofit, hits, nomem;
    bool shared; /* other threads unpin concurrently: pool-wide stats may move */
    bool faults; /* allocations and commits fail now and then (PKV_ERR_NOMEM expected) */
} model_t;

/* A step may fail with NOMEM only while faults are simulated. */
static bool nomem_ok(model_t *m, int rc)
{
    if (rc != PKV_ERR_NOMEM || !m->faults) return false;
    m->nomem++;
    return true;
}

static uint64_t salt_root(uint64_t salt)
{
    return salt * 0x100000001b3ull + 1;
}

static void ref_push(ref_seq_t *r, int32_t t)
{
    r->h[r->n] = mix(r->n ? r->h[r->n - 1] : salt_root(r->salt), t);
    r->tok[r->n++] = t;
}

static void stats_equal(pkv_kv_t *kv, const pkv_kv_stats_t *a, bool shared)
{
    if (shared) return;
    pkv_kv_stats_t b;
    pkv_kv_stats(kv, &b);
    PKV_CHECK_EQ(a->committed_bytes, b.committed_bytes);
    PKV_CHECK_EQ(a->blocks_live, b.blocks_live);
    PKV_CHECK_EQ(a->blocks_cached, b.blocks_cached);
    PKV_CHECK_EQ(a->blocks_free, b.blocks_free);
    PKV_CHECK_EQ(a->sequences, b.sequences);
    PKV_CHECK_EQ(a->live_tokens, b.live_tokens);
    PKV_CHECK_EQ(a->evictions, b.evictions);
}

static void write_and_append(model_t *m, ref_seq_t *r, uint32_t from)
{
    for (uint32_t p = from; p < r->n; p++) fill_pos(r->seq, p, r->h[p]);
    PKV_CHECK_EQ(pkv_seq_append(r->seq, r->tok + from, r->n - from), PKV_OK);
    (void)m;
}

static void op_create(model_t *m)
{
    if (m->n == MAX_SEQS) return;
    ref_seq_t *r = &m->s[m->n];
    memset(r, 0, sizeof(*r));
    r->salt = pkv_test_below(&m->rng, 2); /* two tenants */
    uint32_t fam = pkv_test_below(&m->rng, 3), shared = pkv_test_below(&m->rng, 120);
    uint32_t tail = 1 + pkv_test_below(&m->rng, 60);
    for (uint32_t i = 0; i < shared; i++)
        ref_push(r, (int32_t)(fam * 1000 + i)); /* shared prefix */
    for (uint32_t i = 0; i < tail; i++) ref_push(r, (int32_t)pkv_test_below(&m->rng, 50000));
    uint32_t reserve = r->n + pkv_test_below(&m->rng, 40);
    pkv_kv_stats_t before;
    pkv_kv_stats(m->kv, &before);
    pkv_seq_params_t prm = {
        .salt = r->salt, .tokens = r->tok, .n_tokens = r->n, .reserve_tokens = reserve};
    uint32_t cached = 0;
    int rc = pkv_seq_create(m->kv, &prm, &r->seq, &cached);
    if (nomem_ok(m, rc)) {
        stats_equal(m->kv, &before, m->shared); /* nothing changed either */
        return;
    }
    if (rc == PKV_ERR_NOSPACE || rc == PKV_ERR_NOFIT) {
        stats_equal(m->kv, &before, m->shared); /* admission failed: nothing changed */
        if (rc == PKV_ERR_NOSPACE)
            m->nospace++;
        else
            m->nofit++;
        return;
    }
    PKV_CHECK_EQ(rc, PKV_OK);
    uint32_t T = pkv_kv_geometry(m->kv)->block_tokens;
    PKV_CHECK_EQ(cached % T, 0);
    PKV_CHECK(cached < r->n); /* never the whole prompt */
    PKV_CHECK_EQ(pkv_seq_length(r->seq), cached);
    PKV_CHECK(pkv_seq_capacity(r->seq) >= reserve);
    if (cached) m->hits++;
    write_and_append(m, r, cached);
    m->n++;
}

static void op_append(model_t *m)
{
    if (!m->n) return;
    ref_seq_t *r = &m->s[pkv_test_below(&m->rng, m->n)];
    uint32_t add = 1 + pkv_test_below(&m->rng, 40);
    if (r->n + add > MAX_TOK) return;
    pkv_kv_stats_t before;
    pkv_kv_stats(m->kv, &before);
    uint32_t len = pkv_seq_length(r->seq), cap = pkv_seq_capacity(r->seq);
    int rc = pkv_seq_reserve(r->seq, r->n + add);
    if (rc == PKV_ERR_NOSPACE || rc == PKV_ERR_NOFIT || nomem_ok(m, rc)) {
        stats_equal(m->kv, &before, m->shared);
        PKV_CHECK_EQ(pkv_seq_length(r->seq), len);
        PKV_CHECK_EQ(pkv_seq_capacity(r->seq), cap);
        if (rc != PKV_ERR_NOMEM) m->nospace++;
        return;
    }
    PKV_CHECK_EQ(rc, PKV_OK);
    uint32_t from = r->n;
    for (uint32_t i = 0; i < add; i++) ref_push(r, (int32_t)pkv_test_below(&m->rng, 50000));
    write_and_append(m, r, from);
}

static void op_fork(model_t *m)
{
    if (!m->n || m->n == MAX_SEQS) return;
    ref_seq_t *p = &m->s[pkv_test_below(&m->rng, m->n)], *c = &m->s[m->n];
    pkv_seq_t *child;
    pkv_kv_stats_t before;
    pkv_kv_stats(m->kv, &before);
    uint32_t cap = pkv_seq_capacity(p->seq);
    int rc = pkv_seq_fork(p->seq, &child);
    if (rc == PKV_ERR_NOSPACE) return; /* dense: a fork copies */
    if (nomem_ok(m, rc)) {
        stats_equal(m->kv, &before, m->shared);
        PKV_CHECK_EQ(pkv_seq_capacity(p->seq), cap);
        return;
    }
    PKV_CHECK_EQ(rc, PKV_OK);
    *c = *p;
    c->seq = child;
    c->pinned = false;
    m->n++;
}

static void op_free(model_t *m)
{
    if (!m->n) return;
    uint32_t i = pkv_test_below(&m->rng, m->n);
    ref_seq_t *r = &m->s[i];
    if (r->pinned) pkv_kv_unpin(m->kv, r->pins, r->n_pins);
    pkv_seq_free(r->seq);
    m->s[i] = m->s[--m->n];
}

static void op_pin(model_t *m)
{
    if (!m->n || pkv_kv_backend(m->kv) != PKV_BACKEND_PAGED) return;
    ref_seq_t *r = &m->s[pkv_test_below(&m->rng, m->n)];
    const uint32_t *ids;
    uint32_t nb;
    PKV_CHECK_EQ(pkv_seq_blocks(r->seq, &ids, &nb), PKV_OK);
    if (r->pinned) {
        pkv_kv_unpin(m->kv, r->pins, r->n_pins);
    } else {
        PKV_CHECK(nb <= PKV_ARRAY_LEN(r->pins));
        memcpy(r->pins, ids, nb * sizeof(uint32_t));
        r->n_pins = nb;
        PKV_CHECK_EQ(pkv_kv_pin(m->kv, ids, nb), PKV_OK);
    }
    r->pinned = !r->pinned;
}

/* a: 20 tokens (ids 0..19, K/V 1000 + position) in capacity `reserve`; *b: its fork (the
 * partial second block shared). */
static void fork_at_20(pkv_kv_t *kv, uint32_t reserve, pkv_seq_t **a, pkv_seq_t **b)
{
    int32_t tok[20];
    for (int i = 0; i < 20; i++) tok[i] = i;
    pkv_seq_params_t p = {.tokens = tok, .n_tokens = 20, .reserve_tokens = reserve};
    ck_assert_int_eq(pkv_seq_create(kv, &p, a, NULL), PKV_OK);
    for (uint32_t i = 0; i < 20; i++) fill_pos(*a, i, 1000 + i);
    ck_assert_int_eq(pkv_seq_append(*a, tok, 20), PKV_OK);
    ck_assert_int_eq(pkv_seq_fork(*a, b), PKV_OK);
}

/* ---- a storage backend the pool must go through for every byte ----------------------
 * Host memory that is inaccessible (PROT_NONE) except between commit and decommit, so a
 * pool that touched a granule it does not hold, or kept using one it gave back, faults;
 * a stride unit of 8 KiB (not the host's), so a pool that laid a range out without asking
 * the backend is caught by validate; commits fail where PKV_FAULT_COMMIT is armed; copies
 * are counted and can be made to fail. */
typedef struct {
    uint64_t committed, reserved, copies, copy_bytes, commits;
    uint32_t fail_copies; /* the next n copies fail */
} guard_t;

static size_t guard_stride(void *ctx, size_t used)
{
    (void)ctx;
    return (used + 8191) / 8192 * 8192;
}

static int guard_reserve(void *ctx, size_t bytes, void **addr)
{
    guard_t *g = ctx;
    void *p = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return PKV_ERR_NOMEM;
    g->reserved += bytes;
    *addr = p;
    return PKV_OK;
}

static void guard_release(void *ctx, void *addr, size_t bytes)
{
    guard_t *g = ctx;
    PKV_CHECK_EQ(munmap(addr, bytes), 0);
    g->reserved -= bytes;
}

static int guard_commit(void *ctx, void *addr, size_t bytes, bool huge)
{
    guard_t *g = ctx;
    (void)huge;
    PKV_CHECK_EQ(bytes % 8192, 0);
    if (pkv_fault_hit(PKV_FAULT_COMMIT)) return PKV_ERR_NOMEM;
    PKV_CHECK_EQ(mprotect(addr, bytes, PROT_READ | PROT_WRITE), 0);
    g->committed += bytes;
    g->commits++;
    return PKV_OK;
}

static void guard_decommit(void *ctx, void *addr, size_t bytes)
{
    guard_t *g = ctx;
    PKV_CHECK_EQ(madvise(addr, bytes, MADV_DONTNEED), 0);
    PKV_CHECK_EQ(mprotect(addr, bytes, PROT_NONE), 0);
    PKV_CHECK(g->committed >= bytes);
    g->committed -= bytes;
}

static int guard_copy(void *ctx, void *dst, const void *src, size_t bytes)
{
    guard_t *g = ctx;
    if (g->fail_copies) {
        g->fail_copies--;
        return PKV_ERR_IO;
    }
    memcpy(dst, src, bytes);
    g->copies++;
    g->copy_bytes += bytes;
    return PKV_OK;
}

static guard_t guard;
static const pkv_kv_storage_t guard_storage = {"guard",       guard_stride, guard_reserve,
                                               guard_release, guard_commit, guard_decommit,
                                               guard_copy,    &guard};
/* Set by a test: the property runs' pools use this storage (NULL: host). */
static const pkv_kv_storage_t *prop_storage;

static void check_all(model_t *m, uint64_t seed)
{
    if (pkv_kv_validate(m->kv) != PKV_OK)
        ck_abort_msg("validate failed (seed %llu)", (unsigned long long)seed);
    pkv_kv_stats_t st;
    pkv_kv_stats(m->kv, &st);
    uint64_t tokens = 0;
    for (uint32_t i = 0; i < m->n; i++) {
        ref_seq_t *r = &m->s[i];
        PKV_CHECK_EQ(pkv_seq_length(r->seq), r->n);
        for (uint32_t p = 0; p < r->n; p++)
            if (!check_pos(r->seq, p, r->h[p]))
                ck_abort_msg("K/V mismatch at seq %u pos %u (seed %llu)", i, p,
                             (unsigned long long)seed);
        tokens += r->n;
    }
    PKV_CHECK_EQ(st.live_tokens, tokens);
    PKV_CHECK_EQ(st.sequences, m->n);
    if (st.budget_bytes) PKV_CHECK(st.committed_bytes <= st.budget_bytes);
    if (prop_storage == &guard_storage) PKV_CHECK_EQ(guard.committed, st.committed_bytes);
}

static const pkv_geometry_t small_geo = {
    .layers = 2, .kv_heads = 2, .head_dim = 64, .block_tokens = 16, .dtype = PKV_DTYPE_F32};

static const pkv_geometry_t prop_geo = {
    .layers = 2, .kv_heads = 2, .head_dim = 16, .block_tokens = 16, .dtype = PKV_DTYPE_F32};

/* With faults: before a step, arm the allocation or the commit site to fail one of the
 * step's next few hits (none in a third of the steps). */
static void arm_random_fault(model_t *m)
{
    uint32_t pick = pkv_test_below(&m->rng, 3), skip = pkv_test_below(&m->rng, 6);
    if (pick < 2) pkv_fault_arm(pick ? PKV_FAULT_COMMIT : PKV_FAULT_ALLOC, skip, 1);
}

static void run_property_tp(pkv_backend_t backend, uint32_t runs, uint32_t steps, bool faults,
                            const pkv_geometry_t *geo, uint32_t tp)
{
    uint64_t base = pkv_test_seed(0x5eed0000 + backend + (faults ? 0x100 : 0) +
                                  (tp > 1 ? tp * 0x1000 + geo->kv_heads : 0));
    uint32_t nospace = 0, hits = 0, nofit = 0, nomem = 0;
    for (uint32_t run = 0; run < runs; run++) {
        uint64_t seed = base + run;
        model_t m = {.rng = seed, .faults = faults};
        /* 8 KiB blocks, 4 per 32 KiB granule; a budget of 16..79 blocks puts pressure on. */
        pkv_kv_config_t cfg = {.geo = *geo,
                               .tp = tp,
                               .backend = backend,
                               .granule_bytes = 32768,
                               .budget_bytes = (4 + pkv_test_below(&m.rng, 16)) * 32768ull,
                               .no_prefix_cache = pkv_test_below(&m.rng, 8) == 0,
                               .storage = backend == PKV_BACKEND_PAGED ? prop_storage : NULL};
        PKV_CHECK_EQ(pkv_kv_create(&cfg, &m.kv), PKV_OK);
        for (uint32_t step = 0; step < steps; step++) {
            uint32_t op = pkv_test_below(&m.rng, 100);
            if (faults) arm_random_fault(&m);
            if (op < 30)
                op_create(&m);
            else if (op < 60)
                op_append(&m);
            else if (op < 70)
                op_fork(&m);
            else if (op < 88)
                op_free(&m);
            else if (op < 95)
                op_pin(&m);
            else
                pkv_kv_reset_cache(m.kv);
            pkv_fault_disarm_all();
            check_all(&m, seed);
        }
        while (m.n) op_free(&m);
        pkv_kv_reset_cache(m.kv);
        pkv_kv_stats_t st;
        pkv_kv_stats(m.kv, &st);
        PKV_CHECK_EQ(st.blocks_live + st.blocks_cached, 0);
        if (backend == PKV_BACKEND_PAGED)
            PKV_CHECK(st.committed_bytes <= st.granule_bytes);
        else
            PKV_CHECK_EQ(st.committed_bytes, 0);
        check_all(&m, seed);
        pkv_kv_destroy(m.kv);
        nospace += m.nospace;
        hits += m.hits;
        nofit += m.nofit;
        nomem += m.nomem;
    }
    /* The generator must actually reach budget pressure and prefix hits (and failures). */
    PKV_CHECK(nospace > 0);
    PKV_CHECK(hits > 0);
    PKV_CHECK(!faults || nomem > 0);
    printf("property %s%s tp %u (%u KV heads): %u runs x %u steps, %u prefix hits, %u nospace, "
           "%u nofit, %u nomem (seed base %llu)\n",
           pkv_backend_name(backend), faults ? " with faults" : "", tp, geo->kv_heads, runs, steps,
           hits, nospace, nofit, nomem, (unsigned long long)base);
}

static void run_property(pkv_backend_t backend, uint32_t runs, uint32_t steps, bool faults)
{
    run_property_tp(backend, runs, steps, faults, &prop_geo, 1);
}

/* 8 KV heads, 8 KiB blocks as prop_geo: tp 2, 4, 8 split the heads; tp 4 over prop_geo's 2
 * heads replicates each on two ranks. A slice of the property run, with and without faults. */
static const pkv_geometry_t prop_geo8 = {
    .layers = 2, .kv_heads = 8, .head_dim = 4, .block_tokens = 16, .dtype = PKV_DTYPE_F32};

START_TEST(property_paged_tp)
{
    for (uint32_t tp = 2; tp <= 8; tp *= 2) {
        run_property_tp(PKV_BACKEND_PAGED, 150, 40, false, &prop_geo8, tp);
        run_property_tp(PKV_BACKEND_PAGED, 60, 40, true, &prop_geo8, tp);
    }
    run_property_tp(PKV_BACKEND_PAGED, 150, 40, false, &prop_geo, 4);
    run_property_tp(PKV_BACKEND_PAGED, 60, 40, true, &prop_geo, 4);
}
END_TEST

/* A storage backend sees every byte the pool holds and touches: the property runs (tp 1
 * and 4, with commit faults) on PROT_NONE-guarded memory, its commits equal to the pool's
 * committed bytes after every step, copy-on-write only through its copy, nothing reserved
 * after destroy; a failed copy fails the reserve and changes nothing. */
START_TEST(storage_backend_gets_every_byte_operation)
{
    prop_storage = &guard_storage;
    run_property_tp(PKV_BACKEND_PAGED, 200, 40, false, &prop_geo, 1);
    run_property_tp(PKV_BACKEND_PAGED, 100, 40, true, &prop_geo, 1);
    run_property_tp(PKV_BACKEND_PAGED, 100, 40, false, &prop_geo8, 4);
    prop_storage = NULL;
    PKV_CHECK_EQ(guard.reserved, 0);
    PKV_CHECK_EQ(guard.committed, 0);
    PKV_CHECK(guard.copies > 0 && guard.commits > 0);

    /* 32 KiB blocks, two a granule: a's two fill the first, b's reserve commits more */
    pkv_kv_config_t cfg = {.geo = small_geo, .storage = &guard_storage, .granule_bytes = 65536};
    pkv_kv_t *kv;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    ck_assert_uint_eq(st.granule_bytes % 8192, 0);
    pkv_seq_t *a, *b;
    fork_at_20(kv, 20, &a, &b);
    const uint32_t *ib;
    uint32_t nb;
    pkv_seq_blocks(b, &ib, &nb);
    uint32_t shared = ib[1];
    pkv_kv_stats(kv, &st);
    uint64_t live = st.blocks_live, copies = guard.copies, committed = st.committed_bytes;
    guard.fail_copies = 1;
    ck_assert_int_eq(pkv_seq_reserve(b, 40), PKV_ERR_IO); /* a new block and the copy */
    pkv_seq_blocks(b, &ib, &nb);
    ck_assert_uint_eq(nb, 2);
    ck_assert_uint_eq(ib[1], shared);
    ck_assert_uint_eq(pkv_seq_capacity(b), 20);
    pkv_kv_stats(kv, &st);
    ck_assert_uint_eq(st.blocks_live, live);
    ck_assert_uint_eq(st.committed_bytes, committed); /* what it committed went back */
    ck_assert_uint_eq(guard.committed, committed);
    ck_assert(st.commits > 1); /* it did commit (a granule for the new blocks) */
    ck_assert_uint_eq(st.cow_copies, 0);
    ck_assert_uint_eq(guard.copies, copies);
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    ck_assert_int_eq(pkv_seq_reserve(b, 40), PKV_OK); /* the storage works again */
    pkv_seq_blocks(b, &ib, &nb);
    ck_assert_uint_ne(ib[1], shared);
    /* one piece per (layer, k|v, head) of the block */
    ck_assert_uint_eq(guard.copies - copies, 2 * small_geo.layers * small_geo.kv_heads);
    for (uint32_t i = 0; i < 20; i++) ck_assert(check_pos(b, i, 1000 + i));
    pkv_seq_free(a);
    pkv_seq_free(b);
    pkv_kv_destroy(kv);
    ck_assert_uint_eq(guard.reserved, 0);
    ck_assert_uint_eq(guard.committed, 0);

    cfg.backend = PKV_BACKEND_DENSE; /* the dense baseline is host memory only */
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_ERR_UNSUPPORTED);
    pkv_kv_storage_t half = guard_storage;
    half.copy = NULL;
    cfg = (pkv_kv_config_t){.geo = small_geo, .storage = &half};
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_ERR_INVALID);
}
END_TEST

START_TEST(property_paged)
{
    run_property(PKV_BACKEND_PAGED, 1000, 40, false);
}
END_TEST

START_TEST(property_dense)
{
    run_property(PKV_BACKEND_DENSE, 300, 40, false);
}
END_TEST

START_TEST(property_paged_with_faults)
{
    run_property(PKV_BACKEND_PAGED, 300, 40, true);
}
END_TEST

START_TEST(property_dense_with_faults)
{
    run_property(PKV_BACKEND_DENSE, 100, 40, true);
}
END_TEST

/* ---- specific properties --------------------------------------------------------------- */

static const pkv_geometry_t llama_geo = {
    .layers = 16, .kv_heads = 8, .head_dim = 64, .block_tokens = 16, .dtype = PKV_DTYPE_F16};

static int32_t *iota_tokens(uint32_t n, int32_t base)
{
    int32_t *t = malloc(n * sizeof(int32_t));
    for (uint32_t i = 0; i < n; i++) t[i] = base + (int32_t)i;
    return t;
}

static double rel_diff(int64_t a, int64_t b)
{
    int64_t d = a - b;
    return (double)(d < 0 ? -d : d) / (double)(b < 0 ? -b : b);
}

START_TEST(counters_agree_with_vmrss)
{
    pkv_kv_config_t cfg = {
        .geo = llama_geo, .backend = PKV_BACKEND_PAGED, .budget_bytes = 2ull << 30};
    pkv_kv_t *kv;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    pkv_seq_t *seqs[8];
    int32_t *tok = iota_tokens(4096, 0);
    uint64_t rss0 = pkv_test_rss();
    pkv_kv_stats_t s0, s1, s2;
    pkv_kv_stats(kv, &s0);
    for (int i = 0; i < 8; i++) { /* 8 x 2048 tokens x 32 KiB = 512 MiB */
        tok[0] = i;               /* distinct prompts: no sharing */
        pkv_seq_params_t p = {.tokens = tok, .n_tokens = 2048};
        ck_assert_int_eq(pkv_seq_create(kv, &p, &seqs[i], NULL), PKV_OK);
    }
    uint64_t rss1 = pkv_test_rss();
    pkv_kv_stats(kv, &s1);
    int64_t dc = (int64_t)(s1.committed_bytes - s0.committed_bytes), dr = (int64_t)(rss1 - rss0);
    printf("growth: committed +%lld, VmRSS +%lld (%.3f%%)\n", (long long)dc, (long long)dr,
           100 * rel_diff(dr, dc));
    ck_assert_int_ge(dc, 512ll << 20);
    ck_assert(rel_diff(dr, dc) <= 0.02);
    for (int i = 0; i < 8; i++) pkv_seq_free(seqs[i]);
    pkv_kv_reset_cache(kv);
    uint64_t rss2 = pkv_test_rss();
    pkv_kv_stats(kv, &s2);
    dc = (int64_t)(s1.committed_bytes - s2.committed_bytes);
    dr = (int64_t)(rss1 - rss2);
    printf("shrink: committed -%lld, VmRSS -%lld (%.3f%%)\n", (long long)dc, (long long)dr,
           100 * rel_diff(dr, dc));
    ck_assert(rel_diff(dr, dc) <= 0.02);
    ck_assert_uint_le(s2.committed_bytes, s2.granule_bytes);
    free(tok);
    pkv_kv_destroy(kv);
}
END_TEST

/* pkv_kv_pages reads the pool's own range: what it commits is resident there, in huge pages
 * only where the pool asks (or the kernel gives them to everything); dense has no range. */
START_TEST(pages_of_the_pool_range_measured)
{
    pkv_prim_thp_mode_t mode = PKV_PRIM_THP_UNKNOWN;
    (void)pkv_prim_thp_mode(NULL, &mode);
    int32_t *tok = iota_tokens(256, 0);
    for (int huge = 0; huge < 2; huge++) {
        pkv_kv_config_t cfg = {.geo = llama_geo, .backend = PKV_BACKEND_PAGED, .hugepages = huge};
        pkv_kv_t *kv;
        ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
        uint64_t res = 1, hp = 1;
        ck_assert_int_eq(pkv_kv_pages(kv, &res, &hp), PKV_OK);
        ck_assert_uint_eq(res, 0);
        ck_assert_uint_eq(hp, 0);
        pkv_seq_params_t p = {.tokens = tok, .n_tokens = 256}; /* 8 MiB: 4 granules */
        pkv_seq_t *s;
        ck_assert_int_eq(pkv_seq_create(kv, &p, &s, NULL), PKV_OK);
        pkv_kv_stats_t st;
        pkv_kv_stats(kv, &st);
        ck_assert_int_eq(pkv_kv_pages(kv, &res, &hp), PKV_OK);
        ck_assert_uint_eq(res, st.committed_bytes);
        ck_assert_uint_le(hp, res);
        ck_assert_uint_eq(hp % PKV_PRIM_HUGE, 0);
        if (!huge && mode != PKV_PRIM_THP_ALWAYS) ck_assert_uint_eq(hp, 0);
        if (mode == PKV_PRIM_THP_NEVER) ck_assert_uint_eq(hp, 0);
        pkv_seq_free(s);
        pkv_kv_destroy(kv);
    }
    pkv_kv_config_t dc = {.geo = llama_geo, .backend = PKV_BACKEND_DENSE};
    pkv_kv_t *dense;
    ck_assert_int_eq(pkv_kv_create(&dc, &dense), PKV_OK);
    uint64_t res = 7;
    ck_assert_int_eq(pkv_kv_pages(dense, &res, NULL), PKV_ERR_UNSUPPORTED);
    ck_assert_uint_eq(res, 7);
    ck_assert_int_eq(pkv_kv_pages(NULL, &res, NULL), PKV_ERR_UNSUPPORTED);
    pkv_kv_destroy(dense);
    free(tok);
}
END_TEST

START_TEST(growth_never_moves_a_block)
{
    pkv_geometry_t g = {
        .layers = 2, .kv_heads = 1, .head_dim = 16, .block_tokens = 16, .dtype = PKV_DTYPE_F16};
    pkv_kv_config_t cfg = {.geo = g, .backend = PKV_BACKEND_PAGED};
    pkv_kv_t *kv;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    enum { N = 32768 };
    int32_t t = 1;
    pkv_seq_params_t p = {.tokens = &t, .n_tokens = 1};
    pkv_seq_t *s;
    ck_assert_int_eq(pkv_seq_create(kv, &p, &s, NULL), PKV_OK);
    void **addr = calloc(N / 16, sizeof(void *));
    uint64_t h = 0;
    for (uint32_t pos = 0; pos < N; pos++) {
        ck_assert_int_eq(pkv_seq_reserve(s, pos + 1), PKV_OK);
        h = mix(h, (int32_t)pos);
        fill_pos(s, pos, h);
        int32_t tok = (int32_t)pos;
        ck_assert_int_eq(pkv_seq_append(s, &tok, 1), PKV_OK);
        pkv_kv_run_t run;
        pkv_seq_runs(s, 0, pos, pos + 1, &run, 1, NULL);
        if (pos % 16 == 0) addr[pos / 16] = (void *)run.k;
        if (pos % 1024 == 1023) /* every earlier block is where it was */
            for (uint32_t b = 0; b <= pos / 16; b++) {
                pkv_seq_runs(s, 0, b * 16, b * 16 + 1, &run, 1, NULL);
                ck_assert_ptr_eq(run.k, addr[b]);
            }
    }
    h = 0;
    for (uint32_t pos = 0; pos < N; pos++) {
        h = mix(h, (int32_t)pos);
        ck_assert(check_pos(s, pos, h));
    }
    free(addr);
    pkv_seq_free(s);
    pkv_kv_destroy(kv);
}
END_TEST

static void admission_beyond_budget(pkv_backend_t backend)
{
    pkv_kv_config_t cfg = {.geo = llama_geo, .backend = backend, .budget_bytes = 128ull << 20};
    pkv_kv_t *kv;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    int32_t *tok = iota_tokens(8192, 0);
    /* 512 KiB blocks: 128 MiB holds 256 blocks (4096 tokens). 8192 can never fit. */
    pkv_kv_stats_t before;
    pkv_kv_stats(kv, &before);
    pkv_seq_t *s = (pkv_seq_t *)0x1;
    pkv_seq_params_t p = {.tokens = tok, .n_tokens = 8192};
    ck_assert_int_eq(pkv_seq_create(kv, &p, &s, NULL), PKV_ERR_NOFIT);
    ck_assert_ptr_eq(s, (pkv_seq_t *)0x1); /* output untouched */
    stats_equal(kv, &before, false);
    /* Fill most of it, then ask for more than is left: NOSPACE, nothing changes. */
    pkv_seq_t *a;
    p.n_tokens = 3000;
    ck_assert_int_eq(pkv_seq_create(kv, &p, &a, NULL), PKV_OK);
    pkv_kv_stats(kv, &before);
    tok[0] = -1;
    p.n_tokens = 2000;
    ck_assert_int_eq(pkv_seq_create(kv, &p, &s, NULL), PKV_ERR_NOSPACE);
    stats_equal(kv, &before, false);
    pkv_seq_t *c;
    p.n_tokens = 1000;
    ck_assert_int_eq(pkv_seq_create(kv, &p, &c, NULL), PKV_OK);
    pkv_kv_stats(kv, &before);
    ck_assert_int_eq(pkv_seq_reserve(a, 3200), PKV_ERR_NOSPACE);
    stats_equal(kv, &before, false);
    ck_assert_uint_ge(pkv_seq_capacity(a), 3000);
    ck_assert_int_eq(pkv_seq_reserve(a, 9000), PKV_ERR_NOFIT);
    stats_equal(kv, &before, false);
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    ck_assert_uint_ge(st.rejected_nofit, 2);
    ck_assert_uint_ge(st.rejected_nospace, 2);
    pkv_seq_free(a);
    pkv_seq_free(c);
    free(tok);
    pkv_kv_destroy(kv);
}

START_TEST(admission_beyond_budget_paged)
{
    admission_beyond_budget(PKV_BACKEND_PAGED);
}
END_TEST

START_TEST(admission_beyond_budget_dense)
{
    admission_beyond_budget(PKV_BACKEND_DENSE);
}
END_TEST

struct logcap {
    char line[512];
};
static void logcap_sink(void *arg, pkv_log_level_t lvl, const char *mod, const char *line)
{
    struct logcap *c = arg;
    snprintf(c->line, sizeof(c->line), "%s", line);
}

START_TEST(nofit_message_has_the_numbers)
{
    struct logcap c = {{0}};
    pkv_log_set_sink(logcap_sink, &c);
    pkv_kv_config_t cfg = {.geo = llama_geo, .budget_bytes = 128ull << 20};
    pkv_kv_t *kv;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    int32_t *tok = iota_tokens(8192, 0);
    pkv_seq_t *s;
    pkv_seq_params_t p = {.tokens = tok, .n_tokens = 8192};
    ck_assert_int_eq(pkv_seq_create(kv, &p, &s, NULL), PKV_ERR_NOFIT);
    ck_assert_ptr_nonnull(strstr(c.line, "needs 512 blocks"));
    ck_assert_ptr_nonnull(strstr(c.line, "budget holds 256 blocks"));
    ck_assert_ptr_nonnull(strstr(c.line, "134217728 bytes"));
    pkv_log_set_sink(NULL, NULL);
    free(tok);
    pkv_kv_destroy(kv);
}
END_TEST

START_TEST(prefix_adoption_and_salt)
{
    pkv_kv_config_t cfg = {.geo = small_geo};
    pkv_kv_t *kv;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    int32_t *tok = iota_tokens(100, 7);
    pkv_seq_t *a, *b, *c, *d;
    uint32_t cached;
    pkv_seq_params_t p = {.salt = 1, .tokens = tok, .n_tokens = 100};
    ck_assert_int_eq(pkv_seq_create(kv, &p, &a, &cached), PKV_OK);
    ck_assert_uint_eq(cached, 0);
    ck_assert_int_eq(pkv_seq_append(a, tok, 100), PKV_OK);
    /* Same tenant, same prompt: 6 full blocks (96 tokens) adopted while a is live. */
    ck_assert_int_eq(pkv_seq_create(kv, &p, &b, &cached), PKV_OK);
    ck_assert_uint_eq(cached, 96);
    pkv_seq_free(a);
    pkv_seq_free(b);
    /* After both finished the blocks are cached, and still adoptable. */
    ck_assert_int_eq(pkv_seq_create(kv, &p, &c, &cached), PKV_OK);
    ck_assert_uint_eq(cached, 96);
    /* A block-aligned prompt never adopts its last block. */
    p.n_tokens = 32;
    ck_assert_int_eq(pkv_seq_create(kv, &p, &d, &cached), PKV_OK);
    ck_assert_uint_eq(cached, 16);
    pkv_seq_free(d);
    /* Another tenant's salt never matches. */
    p.salt = 2;
    p.n_tokens = 100;
    ck_assert_int_eq(pkv_seq_create(kv, &p, &d, &cached), PKV_OK);
    ck_assert_uint_eq(cached, 0);
    pkv_seq_free(d);
    pkv_seq_free(c);
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    ck_assert_uint_eq(st.prefix_hit_tokens, 96 * 2 + 16);
    ck_assert_uint_eq(st.blocks_cached, 6);
    pkv_kv_reset_cache(kv);
    pkv_kv_stats(kv, &st);
    ck_assert_uint_eq(st.blocks_cached, 0);
    ck_assert_uint_le(st.committed_bytes, st.granule_bytes);
    free(tok);
    pkv_kv_destroy(kv);
}
END_TEST

START_TEST(fork_copies_shared_partial_block_on_write)
{
    pkv_kv_config_t cfg = {.geo = small_geo};
    pkv_kv_t *kv;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    pkv_seq_t *a, *b;
    fork_at_20(kv, 40, &a, &b);
    const uint32_t *ia, *ib;
    uint32_t na, nb;
    pkv_seq_blocks(a, &ia, &na);
    pkv_seq_blocks(b, &ib, &nb);
    ck_assert_uint_eq(ia[1], ib[1]); /* the partial block is shared */
    /* Both must reserve before writing position 20: each gets its own copy. */
    ck_assert_uint_eq(pkv_seq_capacity(a), 20);
    ck_assert_int_eq(pkv_seq_reserve(b, 21), PKV_OK);
    pkv_seq_blocks(b, &ib, &nb);
    ck_assert_uint_ne(ia[1], ib[1]);
    fill_pos(b, 20, 77);
    ck_assert_int_eq(pkv_seq_reserve(a, 21), PKV_OK);
    fill_pos(a, 20, 88);
    for (uint32_t i = 0; i < 20; i++) {
        ck_assert(check_pos(a, i, 1000 + i));
        ck_assert(check_pos(b, i, 1000 + i));
    }
    ck_assert(check_pos(b, 20, 77));
    ck_assert(check_pos(a, 20, 88));
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    ck_assert_uint_eq(st.cow_copies, 1); /* a was sole owner by then: no second copy */
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    pkv_seq_free(a);
    pkv_seq_free(b);
    pkv_kv_destroy(kv);
}
END_TEST

START_TEST(pins_keep_blocks_alive)
{
    pkv_kv_config_t cfg = {.geo = small_geo, .no_prefix_cache = true};
    pkv_kv_t *kv;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    int32_t tok[64] = {0};
    pkv_seq_t *a;
    pkv_seq_params_t p = {.tokens = tok, .n_tokens = 64};
    ck_assert_int_eq(pkv_seq_create(kv, &p, &a, NULL), PKV_OK);
    const uint32_t *ids;
    uint32_t n;
    pkv_seq_blocks(a, &ids, &n);
    uint32_t copy[4];
    memcpy(copy, ids, sizeof(copy));
    ck_assert_int_eq(pkv_kv_pin(kv, copy, 4), PKV_OK);
    pkv_seq_free(a);
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    ck_assert_uint_eq(st.blocks_live, 4); /* held by the pin alone */
    uint32_t bad[2] = {copy[0], 999999};
    ck_assert_int_eq(pkv_kv_pin(kv, bad, 2), PKV_ERR_NOTFOUND);
    pkv_kv_unpin(kv, copy, 4);
    pkv_kv_stats(kv, &st);
    ck_assert_uint_eq(st.blocks_live, 0);
    ck_assert_int_eq(pkv_kv_pin(kv, copy, 1), PKV_ERR_NOTFOUND); /* free now */
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    pkv_kv_destroy(kv);
}
END_TEST

START_TEST(dtype_round_trip)
{
    float in[6] = {0.0f, 1.0f, -2.5f, 65504.0f, 1e-7f, 3.14159f}, out[6];
    uint16_t h[6];
    pkv_dtype_from_f32(PKV_DTYPE_F16, h, in, 6);
    pkv_dtype_to_f32(PKV_DTYPE_F16, out, h, 6);
    for (int i = 0; i < 4; i++) ck_assert(out[i] == in[i]);
    ck_assert(out[5] > 3.140f && out[5] < 3.143f);
    pkv_dtype_from_f32(PKV_DTYPE_BF16, h, in, 6);
    pkv_dtype_to_f32(PKV_DTYPE_BF16, out, h, 6);
    ck_assert(out[1] == 1.0f && out[2] == -2.5f);
    ck_assert(out[5] > 3.13f && out[5] < 3.15f);
}
END_TEST

/* fp8 e4m3: all 256 codes decode to the OCP definition, computed here another way (in
 * double, from the spec's fields and its named points), and every finite code encodes
 * back to itself. */
START_TEST(fp8_codes_match_the_definition)
{
    for (int c = 0; c < 256; c++) {
        int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
        float got = pkv_fp8_to_f32((uint8_t)c);
        if (e == 15 && m == 7) {
            ck_assert_msg(isnan(got), "code 0x%02x should be NaN", c);
            continue;
        }
        double want = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
        if (s) want = -want;
        ck_assert_msg((double)got == want, "code 0x%02x: %g, want %g", c, (double)got, want);
        ck_assert_msg(pkv_f32_to_fp8(got) == (uint8_t)c || (c == 0x80 && got == 0.0f),
                      "code 0x%02x does not encode back", c);
    }
    ck_assert(pkv_fp8_to_f32(0x7e) == 448.0f && pkv_fp8_to_f32(0x08) == 0x1p-6f);
    ck_assert(pkv_fp8_to_f32(0x01) == 0x1p-9f && pkv_fp8_to_f32(0xfe) == -448.0f);
}
END_TEST

/* The encoder rounds to the nearest code, ties to even, saturates at +-448 (inf too) and
 * never writes a NaN code (NaN in gives 0). */
START_TEST(fp8_encoder_rounds_saturates_and_never_writes_nan)
{
    uint64_t rs = pkv_test_seed(0xf8e4);
    for (int i = 0; i < 200000; i++) {
        uint32_t bits = (uint32_t)pkv_test_rand(&rs);
        float x;
        memcpy(&x, &bits, 4);
        uint8_t c = pkv_f32_to_fp8(x);
        ck_assert_msg((c & 0x7f) != 0x7f, "NaN code for bits 0x%08x", bits);
        if (isnan(x)) {
            ck_assert_uint_eq(c, 0);
            continue;
        }
        if (fabsf(x) >= 448.0f) {
            ck_assert_uint_eq(c, x > 0 ? 0x7e : 0xfe);
            continue;
        }
        /* the nearest of the finite codes of x's sign, ties to the even code */
        double best = INFINITY;
        int bc = -1;
        for (int k = 0; k < 0x7f; k++) {
            double v = pkv_fp8_to_f32((uint8_t)k), d = fabs(fabs((double)x) - v);
            if (d < best || (d == best && !(k & 1))) best = d, bc = k;
        }
        ck_assert_msg((c & 0x7f) == bc, "bits 0x%08x (%g): code 0x%02x, want 0x%02x", bits,
                      (double)x, c, bc);
    }
    ck_assert_uint_eq(pkv_f32_to_fp8(INFINITY), 0x7e);
    ck_assert_uint_eq(pkv_f32_to_fp8(-INFINITY), 0xfe);
    ck_assert_uint_eq(pkv_f32_to_fp8(NAN), 0);
    ck_assert_uint_eq(pkv_f32_to_fp8(464.0f), 0x7e); /* past the top code's half step */
    ck_assert_uint_eq(pkv_f32_to_fp8(0x1p-10f), 0);  /* tie between 0 and 2^-9: even */
    ck_assert_uint_eq(pkv_f32_to_fp8(3 * 0x1p-10f), 2);
}
END_TEST

/* Scaled rows. fp8: head_dim codes then the f32 scale amax / 448, every value back within
 * half an fp8 ulp times the scale. int8: head_dim codes then the scale word (core.h): 2^E
 * is the least power of two with 127 * 2^E >= amax, each lane group (d mod 8) has the
 * smallest of its 8 scales that covers its largest value or one up to two steps coarser
 * that stores it with less error, and every value comes back within half its group's
 * scale. Both: a row of zeros gives zeros; NaN is stored as 0; an
 * infinity saturates at the row's top (amax for fp8, 127 * 2^E >= amax for int8). */
static void check_int8_row(const uint8_t *row, const float *in, const float *out, int D)
{
    uint32_t w = pkv_i8_word(row + D);
    int e = (int8_t)(w & 0xff);
    float amax = 0, gmax[8] = {0};
    for (int i = 0; i < D; i++)
        if (fabsf(in[i]) <= FLT_MAX) {
            amax = fmaxf(amax, fabsf(in[i]));
            gmax[i & 7] = fmaxf(gmax[i & 7], fabsf(in[i]));
        }
    ck_assert(127.0f * ldexpf(1.0f, e) >= amax * (1 - 1e-6f));
    ck_assert(127.0f * ldexpf(1.0f, e - 1) < amax);
    for (int j = 0; j < 8; j++) {
        unsigned k = (w >> (8 + 3 * j)) & 7;
        float f = pkv_i8_group_scale(w, (unsigned)j);
        ck_assert(f == ldexpf(pkv_i8_steps()[k], e) && f >= 0x1p-126f);
        ck_assert(127.0f * f >= gmax[j] * (1 - 1e-6f));
        /* at most two steps coarser than the finest step that covers the group, and then
         * only where that stores the group with less squared error */
        unsigned kc = k;
        while (kc < 7 && 127.0f * ldexpf(pkv_i8_steps()[kc + 1], e) >= gmax[j]) kc++;
        ck_assert(kc - k <= 2);
        float fc = ldexpf(pkv_i8_steps()[kc], e), ic = 1.0f / fc;
        double got = 0, at_kc = 0;
        for (int i = j; i < D; i += 8) { /* the codes: rint(x * (1 / scale)) */
            double d = (double)rintf(in[i] * ic) * fc - in[i];
            got += ((double)out[i] - in[i]) * ((double)out[i] - in[i]);
            at_kc += d * d;
        }
        ck_assert(kc == k || got < at_kc * (1 + 1e-5));
    }
    for (int i = 0; i < D; i++) {
        float f = pkv_i8_group_scale(w, (unsigned)(i & 7));
        ck_assert_msg(fabs((double)out[i] - in[i]) <= 0.5 * f * 1.0001, "int8: %g -> %g (scale %g)",
                      (double)in[i], (double)out[i], (double)f);
        ck_assert((int8_t)row[i] >= -127);
    }
}

START_TEST(scaled_rows_encode_and_decode)
{
    enum { D = 64 };
    uint64_t rs = pkv_test_seed(0x5ca1);
    uint8_t row[D + 4];
    float in[D], out[D];
    ck_assert_uint_eq(pkv_dtype_row_bytes(PKV_DTYPE_INT8, D), D + 4);
    ck_assert_uint_eq(pkv_dtype_row_bytes(PKV_DTYPE_FP8, D), D + 4);
    ck_assert_uint_eq(pkv_dtype_row_bytes(PKV_DTYPE_BF16, D), 2 * D);
    for (int dt = PKV_DTYPE_INT8; dt <= PKV_DTYPE_FP8; dt++) {
        for (int trial = 0; trial < 200; trial++) {
            float mag = ldexpf(1.0f, (int)pkv_test_below(&rs, 40) - 20), amax = 0;
            for (int i = 0; i < D; i++) {
                /* every 8th trial: lane groups of very different sizes */
                float gm = trial % 8 ? 1.0f : ldexpf(1.0f, -(i & 7));
                in[i] = gm * mag * ((float)(pkv_test_rand(&rs) >> 40) / (float)(1 << 23) - 1.0f);
                amax = fmaxf(amax, fabsf(in[i]));
            }
            pkv_dtype_from_f32(dt, row, in, D);
            pkv_dtype_to_f32(dt, out, row, D);
            if (dt == PKV_DTYPE_INT8) {
                check_int8_row(row, in, out, D);
                continue;
            }
            float sc;
            memcpy(&sc, row + D, 4);
            ck_assert(sc == amax / 448.0f);
            for (int i = 0; i < D; i++) {
                double err = fabs((double)out[i] - in[i]);
                ck_assert_msg(err <= fabs((double)in[i]) / 16 + 0x1p-10 * sc, "fp8: %g -> %g",
                              (double)in[i], (double)out[i]);
            }
        }
        memset(in, 0, sizeof(in));
        pkv_dtype_from_f32(dt, row, in, D);
        pkv_dtype_to_f32(dt, out, row, D);
        for (int i = 0; i < D; i++) ck_assert(out[i] == 0.0f && row[i] == 0);
        in[0] = NAN;
        in[1] = 2.0f;
        in[2] = -INFINITY;
        pkv_dtype_from_f32(dt, row, in, D);
        pkv_dtype_to_f32(dt, out, row, D);
        ck_assert(out[0] == 0.0f);
        if (dt == PKV_DTYPE_FP8) ck_assert(out[1] == 2.0f && out[2] == -2.0f);
        if (dt == PKV_DTYPE_INT8) {
            ck_assert(fabsf(out[1] - 2.0f) <= 0.5f * pkv_i8_group_scale(pkv_i8_word(row + D), 1));
            ck_assert(out[2] == -127.0f * ldexpf(1.0f, (int8_t)row[D]) && out[2] <= -2.0f);
        }
    }
    pkv_dtype_t p;
    ck_assert_int_eq(pkv_dtype_parse("int8", &p), PKV_OK);
    ck_assert_int_eq(p, PKV_DTYPE_INT8);
    ck_assert_int_eq(pkv_dtype_parse("fp8_e4m3", &p), PKV_OK);
    ck_assert_str_eq(pkv_dtype_name(p), "fp8");
    ck_assert_int_eq(pkv_dtype_parse("int4", &p), PKV_ERR_INVALID);
}
END_TEST

/* The key rotation: orthogonal (dot products kept), its own inverse, chosen for int8 at a
 * power-of-two head dim only. */
START_TEST(hadamard_rotation_keeps_dot_products)
{
    uint64_t rs = pkv_test_seed(0x4ada);
    float a[64], b[64], a0[64];
    double d0 = 0, d1 = 0;
    for (int i = 0; i < 64; i++) {
        a[i] = a0[i] = (float)pkv_test_below(&rs, 2001) / 1000.0f - 1.0f;
        b[i] = (float)pkv_test_below(&rs, 2001) / 1000.0f - 1.0f;
        d0 += (double)a[i] * b[i];
    }
    a[3] *= 20.0f, a0[3] *= 20.0f, d0 += (double)a0[3] * b[3] * (19.0 / 20.0);
    pkv_hadamard(a, 64);
    pkv_hadamard(b, 64);
    float amax = 0;
    for (int i = 0; i < 64; i++) d1 += (double)a[i] * b[i], amax = fmaxf(amax, fabsf(a[i]));
    ck_assert_msg(fabs(d0 - d1) < 1e-4, "dot %g -> %g", d0, d1);
    ck_assert(amax < fabsf(a0[3]) / 2); /* the outlier spread over every dim */
    pkv_hadamard(a, 64);
    for (int i = 0; i < 64; i++) ck_assert(fabsf(a[i] - a0[i]) < 1e-5f);
    ck_assert(pkv_dtype_rotates_keys(PKV_DTYPE_INT8, 64));
    ck_assert(!pkv_dtype_rotates_keys(PKV_DTYPE_INT8, 48));
    ck_assert(!pkv_dtype_rotates_keys(PKV_DTYPE_FP8, 64));
    ck_assert(!pkv_dtype_rotates_keys(PKV_DTYPE_BF16, 64));
}
END_TEST

/* A quantized pool's blocks pack its granules: at llama-3.2-1b's geometry a block is 272
 * KiB (17/16 of the int8 values), so the pool takes 4 MiB granules of 15 blocks, two whole
 * huge pages (2 MiB would hold 7 and leave 7 % idle); positions written through slots read
 * back through runs, rows of head_dim + 4 bytes. */
START_TEST(quantized_pool_packs_huge_granules)
{
    pkv_kv_config_t cfg = {.geo = llama_geo, .budget_bytes = 64ull << 20, .hugepages = true};
    cfg.geo.dtype = PKV_DTYPE_INT8;
    pkv_kv_t *kv = NULL;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    ck_assert_uint_eq(st.block_bytes, 2ull * 16 * 8 * 16 * (64 + 4));
    ck_assert_uint_eq(st.granule_bytes, 4u << 20);
    ck_assert(st.huge_granules);
    ck_assert_uint_eq(st.blocks_capacity, 16 * 15);
    int32_t *tok = iota_tokens(100, 1);
    pkv_seq_params_t sp = {.tokens = tok, .n_tokens = 100};
    pkv_seq_t *s;
    ck_assert_int_eq(pkv_seq_create(kv, &sp, &s, NULL), PKV_OK);
    for (uint32_t pos = 0; pos < 100; pos++) fill_pos(s, pos, pos * 3 + 1);
    ck_assert_int_eq(pkv_seq_append(s, tok, 100), PKV_OK);
    for (uint32_t pos = 0; pos < 100; pos++) ck_assert(check_pos(s, pos, pos * 3 + 1));
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    pkv_seq_free(s);
    free(tok);
    pkv_kv_destroy(kv);
}
END_TEST

START_TEST(bad_config_rejected)
{
    pkv_kv_t *kv = NULL;
    pkv_kv_config_t cfg = {.geo = small_geo};
    cfg.geo.layers = 0;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_ERR_INVALID);
    cfg.geo = llama_geo;
    cfg.budget_bytes = 4096; /* less than one granule */
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_ERR_NOFIT);
    ck_assert_ptr_null(kv);
}
END_TEST

/* ---- concurrency: the engine runs while transfer workers hold pins --------------------- */

#include <pthread.h>

typedef struct {
    uint32_t ids[64];
    uint32_t n;
    uint64_t sum; /* checksum of the blocks' bytes when pinned */
} lease_t;

typedef struct {
    pkv_kv_t *kv;
    pthread_mutex_t mu; /* guards q, n, done */
    pthread_cond_t cv;
    lease_t q[64];
    uint32_t n;
    bool done;
    uint64_t served;
} lease_queue_t;

static uint64_t blocks_sum(pkv_kv_t *kv, const uint32_t *ids, uint32_t n)
{
    uint64_t s = 0;
    const pkv_geometry_t *g = pkv_kv_geometry(kv);
    size_t piece = pkv_kv_block_bytes(kv) / (2 * (size_t)g->layers * g->kv_heads);
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t l = 0; l < g->layers; l++)
            for (uint32_t which = 0; which < 2; which++)
                for (uint32_t h = 0; h < g->kv_heads; h++) {
                    const uint64_t *w = pkv_kv_block_head(kv, ids[i], l, which, h);
                    for (size_t j = 0; j < piece / 8; j += 7) s = s * 31 + w[j];
                }
    return s;
}

static void *lease_worker(void *arg)
{
    lease_queue_t *q = arg;
    for (;;) {
        pthread_mutex_lock(&q->mu);
        while (!q->n && !q->done) pthread_cond_wait(&q->cv, &q->mu);
        if (!q->n) {
            pthread_mutex_unlock(&q->mu);
            return NULL;
        }
        lease_t l = q->q[--q->n];
        pthread_mutex_unlock(&q->mu);
        /* The blocks are pinned: their bytes cannot change while we read them. */
        PKV_CHECK(blocks_sum(q->kv, l.ids, l.n) == l.sum);
        pkv_kv_unpin(q->kv, l.ids, l.n);
        __atomic_add_fetch(&q->served, 1, __ATOMIC_RELAXED);
    }
}

START_TEST(pins_from_worker_threads_while_engine_runs)
{
    lease_queue_t q = {.n = 0};
    pkv_kv_config_t cfg = {.geo = prop_geo, .granule_bytes = 32768, .budget_bytes = 40 * 32768};
    ck_assert_int_eq(pkv_kv_create(&cfg, &q.kv), PKV_OK);
    pthread_mutex_init(&q.mu, NULL);
    pthread_cond_init(&q.cv, NULL);
    pthread_t th[2];
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, lease_worker, &q);
    model_t m = {.kv = q.kv, .rng = pkv_test_seed(77), .shared = true};
    for (int step = 0; step < 4000; step++) {
        uint32_t op = pkv_test_below(&m.rng, 100);
        if (op < 35)
            op_create(&m);
        else if (op < 60)
            op_append(&m);
        else if (op < 80)
            op_free(&m);
        else if (m.n) { /* register a transfer: pin the full blocks, hand them to a worker */
            ref_seq_t *r = &m.s[pkv_test_below(&m.rng, m.n)];
            const uint32_t *ids;
            uint32_t nb, full = pkv_seq_length(r->seq) / 16;
            pkv_seq_blocks(r->seq, &ids, &nb);
            lease_t l = {.n = PKV_MIN(full, 64)};
            if (!l.n) continue;
            memcpy(l.ids, ids, l.n * sizeof(uint32_t));
            PKV_CHECK_EQ(pkv_kv_pin(q.kv, l.ids, l.n), PKV_OK);
            l.sum = blocks_sum(q.kv, l.ids, l.n);
            pthread_mutex_lock(&q.mu);
            if (q.n < 64) {
                q.q[q.n++] = l;
                pthread_cond_signal(&q.cv);
                l.n = 0;
            }
            pthread_mutex_unlock(&q.mu);
            if (l.n) pkv_kv_unpin(q.kv, l.ids, l.n);
        }
    }
    pthread_mutex_lock(&q.mu);
    q.done = true;
    pthread_cond_broadcast(&q.cv);
    pthread_mutex_unlock(&q.mu);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    ck_assert_uint_gt(q.served, 100);
    check_all(&m, 77);
    while (m.n) op_free(&m);
    pkv_kv_stats_t st;
    pkv_kv_stats(q.kv, &st);
    ck_assert_uint_eq(st.blocks_live, 0); /* every pin came back */
    ck_assert_int_eq(pkv_kv_validate(q.kv), PKV_OK);
    pkv_kv_destroy(q.kv);
}
END_TEST

/* 8 KiB blocks, 4 per 32 KiB granule: small enough to place every block by hand. */
static pkv_kv_t *granule_pool(uint64_t budget_granules)
{
    pkv_kv_config_t cfg = {
        .geo = prop_geo, .granule_bytes = 32768, .budget_bytes = budget_granules * 32768};
    pkv_kv_t *kv;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    return kv;
}

static uint64_t committed(pkv_kv_t *kv)
{
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    return st.committed_bytes;
}

/* A sequence reserved at once sits in consecutive slots of its granules: its runs span
 * whole granules (one run per granule, not per block), and every position of every head
 * read through a run is the address pkv_seq_slot gives. */
START_TEST(runs_span_consecutive_slots_and_match_slots)
{
    pkv_geometry_t g = {
        .layers = 3, .kv_heads = 2, .head_dim = 16, .block_tokens = 16, .dtype = PKV_DTYPE_F32};
    pkv_kv_config_t cfg = {.geo = g, .granule_bytes = 65536, .no_prefix_cache = true};
    pkv_kv_t *kv;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    /* block = 3 layers x 2 x 2 heads x 16 x 16 x 4 B = 12 KiB: 5 blocks per granule */
    enum { N = 16 * 40 };
    int32_t tok[N];
    for (int i = 0; i < N; i++) tok[i] = i;
    pkv_seq_params_t sp = {.tokens = tok, .n_tokens = N};
    pkv_seq_t *s;
    uint32_t nc;
    ck_assert_int_eq(pkv_seq_create(kv, &sp, &s, &nc), PKV_OK);
    for (uint32_t l = 0; l < g.layers; l++) {
        pkv_kv_run_t runs[64];
        uint32_t next, n = pkv_seq_runs(s, l, 3, N, runs, 64, &next);
        ck_assert_uint_eq(next, N);
        ck_assert_uint_le(n, 40 / 5 + 2); /* per granule, not per block (40 blocks) */
        ck_assert_uint_eq(runs[0].pos, 3);
        for (uint32_t r = 0; r < n; r++) {
            if (r) ck_assert_uint_eq(runs[r].pos, runs[r - 1].pos + runs[r - 1].n_tokens);
            for (uint32_t t = 0; t < runs[r].n_tokens; t++)
                for (uint32_t h = 0; h < g.kv_heads; h++) {
                    void *k, *v;
                    size_t hs;
                    pkv_seq_slot(s, runs[r].pos + t, l, &k, &v, &hs);
                    ck_assert_uint_eq(hs, runs[r].head_stride);
                    size_t off = ((size_t)h * hs + (size_t)t * g.head_dim) * 4;
                    ck_assert_ptr_eq((char *)runs[r].k + off, (char *)k + (size_t)h * hs * 4);
                    ck_assert_ptr_eq((char *)runs[r].v + off, (char *)v + (size_t)h * hs * 4);
                }
        }
    }
    pkv_seq_free(s);
    pkv_kv_destroy(kv);
}
END_TEST

/* A pool of 8 KiB blocks, 4 per granule, no prefix cache: block placement tests. */
static pkv_kv_t *order_pool(void)
{
    pkv_kv_config_t cfg = {.geo = prop_geo,
                           .granule_bytes = 32768,
                           .budget_bytes = 16 * 32768,
                           .no_prefix_cache = true};
    pkv_kv_t *kv;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    return kv;
}

/* Freed blocks go back to their granule's free list last-freed first; a sequence still gets
 * each granule's blocks in address order (one run per granule for attention to stream), and grows
 * into the block after its last one rather than into a denser granule. */
START_TEST(sequences_get_blocks_in_address_order)
{
    pkv_kv_t *kv = order_pool();
    int32_t tok[16 * 8];
    for (int i = 0; i < 16 * 8; i++) tok[i] = i;
    pkv_seq_params_t p8 = {.tokens = tok, .n_tokens = 16 * 8};
    pkv_seq_t *b;
    uint32_t eight[8];
    ck_assert_int_eq(pkv_kv_blocks_alloc(kv, 8, eight), PKV_OK);
    pkv_kv_blocks_free(kv, eight, 8); /* in ascending order (as the LRU evicts a sequence's
                                       * blocks): each free list now descends */
    ck_assert_int_eq(pkv_seq_create(kv, &p8, &b, NULL), PKV_OK);
    const uint32_t *ids;
    uint32_t n;
    ck_assert_int_eq(pkv_seq_blocks(b, &ids, &n), PKV_OK);
    ck_assert_uint_eq(n, 8);
    for (uint32_t i = 1; i < n; i++) /* within a granule, each block after the one before */
        if (ids[i] / 4 == ids[i - 1] / 4) ck_assert_uint_eq(ids[i], ids[i - 1] + 1);
    pkv_kv_run_t runs[8];
    uint32_t next;
    ck_assert_uint_eq(pkv_seq_runs(b, 0, 0, 16 * 8, runs, 8, &next), 2); /* one per granule */
    pkv_seq_free(b);
    pkv_kv_destroy(kv);

    /* Growth: c's granule has the block after c's free, another granule is denser. */
    kv = order_pool();
    pkv_seq_params_t p1 = {.tokens = tok, .n_tokens = 16};
    pkv_seq_t *c;
    ck_assert_int_eq(pkv_seq_create(kv, &p1, &c, NULL), PKV_OK);
    ck_assert_int_eq(pkv_seq_blocks(c, &ids, &n), PKV_OK);
    uint32_t c0 = ids[0], raw[7];
    ck_assert_int_eq(pkv_kv_blocks_alloc(kv, 7, raw), PKV_OK); /* the rest of c's granule, then 4 */
    uint32_t mine[3], k = 0, other[2], o = 0;
    for (int i = 0; i < 7; i++) {
        if (raw[i] / 4 == c0 / 4)
            mine[k++] = raw[i];
        else if (o < 2)
            other[o++] = raw[i];
    }
    ck_assert_uint_eq(k, 3);
    pkv_kv_blocks_free(kv, mine, 3);  /* c's granule: 1 used */
    pkv_kv_blocks_free(kv, other, 2); /* the other: 2 used, the densest */
    ck_assert_int_eq(pkv_seq_reserve(c, 32), PKV_OK);
    ck_assert_int_eq(pkv_seq_blocks(c, &ids, &n), PKV_OK);
    ck_assert_uint_eq(n, 2);
    ck_assert_uint_eq(ids[1], c0 + 1);
    ck_assert_uint_eq(pkv_seq_runs(c, 0, 0, 32, runs, 8, &next), 1);
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    pkv_seq_free(c);
    uint32_t left[5];
    uint32_t nl = 0;
    for (int i = 0; i < 7; i++) {
        bool freed = false;
        for (uint32_t j = 0; j < k; j++) freed |= raw[i] == mine[j];
        for (uint32_t j = 0; j < o; j++) freed |= raw[i] == other[j];
        if (!freed) left[nl++] = raw[i];
    }
    pkv_kv_blocks_free(kv, left, nl);
    pkv_kv_destroy(kv);
}
END_TEST

/* Growth that fills its granule goes on at the first block of an empty granule, not into a
 * denser granule's hole, so the blocks after it extend one run. */
START_TEST(growth_past_a_granule_starts_an_empty_one)
{
    pkv_kv_t *kv = order_pool();
    int32_t tok[16 * 6];
    for (int i = 0; i < 16 * 6; i++) tok[i] = i;
    pkv_seq_params_t p4 = {.tokens = tok, .n_tokens = 16 * 4};
    pkv_seq_t *c;
    ck_assert_int_eq(pkv_seq_create(kv, &p4, &c, NULL), PKV_OK); /* one whole granule */
    const uint32_t *ids;
    uint32_t n, raw[8];
    ck_assert_int_eq(pkv_seq_blocks(c, &ids, &n), PKV_OK);
    ck_assert_uint_eq(ids[3], ids[0] + 3);
    ck_assert_int_eq(pkv_kv_blocks_alloc(kv, 8, raw), PKV_OK); /* two more granules */
    uint32_t g1 = raw[0] / 4, hole = UINT32_MAX, empty[4], ne = 0;
    for (int i = 0; i < 8; i++) {
        if (raw[i] / 4 != g1)
            empty[ne++] = raw[i];
        else if (hole == UINT32_MAX)
            hole = raw[i];
    }
    ck_assert_uint_eq(ne, 4);
    pkv_kv_blocks_free(kv, &hole, 1); /* g1: three used, the densest granule with a hole */
    pkv_kv_blocks_free(kv, empty, 4); /* the other: empty, kept committed (retain 1) */
    ck_assert_int_eq(pkv_seq_reserve(c, 16 * 5), PKV_OK);
    ck_assert_int_eq(pkv_seq_blocks(c, &ids, &n), PKV_OK);
    ck_assert_uint_eq(n, 5);
    ck_assert_uint_ne(ids[4], hole);
    ck_assert_uint_eq(ids[4] % 4, 0); /* an empty granule's first block */
    ck_assert_int_eq(pkv_seq_reserve(c, 16 * 6), PKV_OK);
    ck_assert_int_eq(pkv_seq_blocks(c, &ids, &n), PKV_OK);
    ck_assert_uint_eq(ids[5], ids[4] + 1);
    pkv_kv_run_t runs[8];
    uint32_t next;
    ck_assert_uint_eq(pkv_seq_runs(c, 0, 0, 16 * 6, runs, 8, &next), 2);
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    pkv_seq_free(c);
    uint32_t left[3], nl = 0;
    for (int i = 0; i < 8; i++)
        if (raw[i] / 4 == g1 && raw[i] != hole) left[nl++] = raw[i];
    pkv_kv_blocks_free(kv, left, nl);
    pkv_kv_destroy(kv);
}
END_TEST

START_TEST(allocation_prefers_dense_granules_and_decommits_with_hysteresis)
{
    pkv_kv_t *kv = granule_pool(16);
    uint32_t ids[12];
    ck_assert_int_eq(pkv_kv_blocks_alloc(kv, 12, ids), PKV_OK); /* fills granule by granule */
    for (int i = 0; i < 12; i++) ck_assert_uint_eq(ids[i] / 4, ids[i & ~3] / 4);
    ck_assert(ids[0] / 4 != ids[4] / 4 && ids[4] / 4 != ids[8] / 4 && ids[0] / 4 != ids[8] / 4);
    ck_assert_uint_eq(committed(kv), 3 * 32768);
    /* Leave ids[0]'s granule with 3 used, ids[4]'s with 1, ids[8]'s with 2. */
    uint32_t drop[] = {ids[0], ids[4], ids[5], ids[6], ids[8], ids[9]};
    pkv_kv_blocks_free(kv, drop, 6);
    uint32_t got[4];
    for (int i = 0; i < 4; i++) ck_assert_int_eq(pkv_kv_blocks_alloc(kv, 1, &got[i]), PKV_OK);
    ck_assert_uint_eq(got[0] / 4, ids[0] / 4); /* the densest granule first */
    ck_assert_uint_eq(got[1] / 4, ids[8] / 4);
    ck_assert_uint_eq(got[2] / 4, ids[8] / 4);
    ck_assert_uint_eq(got[3] / 4, ids[4] / 4);   /* the sparse one last */
    ck_assert_uint_eq(committed(kv), 3 * 32768); /* nothing new committed meanwhile */
    /* Empty granule 1: kept committed (one empty granule is retained). */
    uint32_t g1[] = {ids[7], got[3]};
    pkv_kv_blocks_free(kv, g1, 2);
    ck_assert_uint_eq(committed(kv), 3 * 32768);
    /* Empty granule 2 as well: more than one empty granule, so it goes back to the OS. */
    uint32_t g2[] = {ids[10], ids[11], got[1], got[2]};
    pkv_kv_blocks_free(kv, g2, 4);
    ck_assert_uint_eq(committed(kv), 2 * 32768);
    uint32_t g0[] = {ids[1], ids[2], ids[3], got[0]};
    pkv_kv_blocks_free(kv, g0, 4);
    ck_assert_uint_eq(committed(kv), 1 * 32768);
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    pkv_kv_destroy(kv);
}
END_TEST

static pkv_seq_t *seq_full(pkv_kv_t *kv, const int32_t *tok, uint32_t n)
{
    pkv_seq_t *s;
    pkv_seq_params_t p = {.tokens = tok, .n_tokens = n};
    ck_assert_int_eq(pkv_seq_create(kv, &p, &s, NULL), PKV_OK);
    ck_assert_int_eq(pkv_seq_append(s, tok, n), PKV_OK);
    return s;
}

START_TEST(eviction_prefers_sparse_granules)
{
    pkv_kv_t *kv = granule_pool(2);
    int32_t ta[65], tb[49];
    for (int i = 0; i < 65; i++) ta[i] = 1000 + i;
    for (int i = 0; i < 49; i++) tb[i] = 5000 + i;
    uint32_t raw[4];
    ck_assert_int_eq(pkv_kv_blocks_alloc(kv, 4, raw), PKV_OK); /* granule 0 */
    pkv_seq_t *a = seq_full(kv, ta, 64);                       /* granule 1, 4 full blocks */
    pkv_kv_blocks_free(kv, raw + 1, 3);
    pkv_seq_t *b = seq_full(kv, tb, 48); /* 3 blocks into raw's granule, the densest */
    const uint32_t *ib;
    uint32_t nb;
    pkv_seq_blocks(b, &ib, &nb);
    for (uint32_t i = 0; i < nb; i++) ck_assert_uint_eq(ib[i] / 4, raw[0] / 4);
    pkv_seq_free(a); /* a's blocks are the oldest cached ones */
    pkv_seq_free(b);
    pkv_kv_blocks_free(kv, raw, 1); /* granule 0: 3 cached; granule 1: 4 cached */
    /* Two blocks wanted, one free, budget full: one eviction. Pure LRU would take a's
     * last block; the sparse-granule preference takes one of b's (granule 0). */
    uint32_t two[2];
    ck_assert_int_eq(pkv_kv_blocks_alloc(kv, 2, two), PKV_OK);
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    ck_assert_uint_eq(st.evictions, 1);
    pkv_kv_blocks_free(kv, two, 2);
    uint32_t cached;
    pkv_seq_t *s;
    pkv_seq_params_t p = {.tokens = ta, .n_tokens = 65};
    ck_assert_int_eq(pkv_seq_create(kv, &p, &s, &cached), PKV_OK);
    ck_assert_uint_eq(cached, 64); /* a survived whole */
    pkv_seq_free(s);
    p = (pkv_seq_params_t){.tokens = tb, .n_tokens = 49};
    ck_assert_int_eq(pkv_seq_create(kv, &p, &s, &cached), PKV_OK);
    ck_assert_uint_eq(cached, 32); /* b lost its last block (freed last-first: its oldest) */
    pkv_seq_free(s);
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    pkv_kv_destroy(kv);
}
END_TEST

/* ---- fault simulation: each allocation and commit of a step fails in turn ----------- */

typedef struct {
    pkv_kv_t *kv;
    pkv_seq_t *seq;  /* the step's subject (reserve, fork) */
    pkv_seq_t *made; /* what a successful step made (create, fork) */
    int32_t tok[120];
} fx_t;

typedef int (*fx_step_t)(fx_t *f);

/* Run step with the skip-th and every later hit of site failing, for skip = 0, 1, ...,
 * until a run in which nothing failed (the retry that succeeds). Every failed run must
 * return `want`, make nothing, and leave the cache and the subject as they were.
 * Returns the number of failed runs. */
static uint32_t fail_each_hit(fx_t *f, pkv_fault_site_t site, fx_step_t step, int want)
{
    for (uint32_t skip = 0;; skip++) {
        pkv_kv_stats_t before;
        pkv_kv_stats(f->kv, &before);
        uint32_t len = f->seq ? pkv_seq_length(f->seq) : 0;
        uint32_t cap = f->seq ? pkv_seq_capacity(f->seq) : 0;
        pkv_fault_arm(site, skip, UINT32_MAX);
        int rc = step(f);
        bool fired = pkv_fault_fired(site) > 0;
        pkv_fault_disarm_all();
        ck_assert_int_eq(pkv_kv_validate(f->kv), PKV_OK);
        if (!fired) {
            ck_assert_int_eq(rc, PKV_OK);
            return skip;
        }
        ck_assert_int_eq(rc, want);
        ck_assert_ptr_null(f->made);
        stats_equal(f->kv, &before, false);
        if (f->seq) {
            ck_assert_uint_eq(pkv_seq_length(f->seq), len);
            ck_assert_uint_eq(pkv_seq_capacity(f->seq), cap);
        }
    }
}

static int step_create(fx_t *f)
{
    pkv_seq_params_t p = {.tokens = f->tok, .n_tokens = 100, .reserve_tokens = 200};
    return pkv_seq_create(f->kv, &p, &f->made, NULL);
}

static int step_fork(fx_t *f)
{
    return pkv_seq_fork(f->seq, &f->made);
}

static int step_reserve(fx_t *f)
{
    /* 20 blocks: the block table (16) and the dense buffer (256 tokens) grow. Paged: 1
     * block is free, 17 new entries take it and 4 fresh granules whole, so the copy of
     * the shared partial block needs a 5th commit (its failure hands the 4 back). */
    return pkv_seq_reserve(f->seq, 320);
}

/* A cache holding a cached 64-token prefix of f->tok (the next create adopts it) and a
 * live 40-token sequence (a partial last block) as the subject. */
static void fx_init(fx_t *f, pkv_backend_t backend)
{
    memset(f, 0, sizeof(*f));
    for (int i = 0; i < 120; i++) f->tok[i] = 7000 + i;
    pkv_kv_config_t cfg = {
        .geo = prop_geo, .backend = backend, .granule_bytes = 32768, .budget_bytes = 64 * 32768ull};
    ck_assert_int_eq(pkv_kv_create(&cfg, &f->kv), PKV_OK);
    pkv_seq_free(seq_full(f->kv, f->tok, 65));
    int32_t other[40];
    for (int i = 0; i < 40; i++) other[i] = 9000 + i;
    f->seq = seq_full(f->kv, other, 40);
}

static void fx_fini(fx_t *f)
{
    pkv_seq_free(f->seq);
    pkv_kv_reset_cache(f->kv);
    ck_assert_uint_le(committed(f->kv), pkv_kv_backend(f->kv) == PKV_BACKEND_PAGED ? 32768 : 0);
    pkv_kv_destroy(f->kv);
}

static void faults_fail_steps_cleanly(pkv_backend_t backend)
{
    static const struct {
        const char *name;
        fx_step_t step;
    } steps[] = {{"create", step_create}, {"fork", step_fork}, {"reserve", step_reserve}};
    for (size_t i = 0; i < PKV_ARRAY_LEN(steps); i++) {
        for (int site = PKV_FAULT_ALLOC; site <= PKV_FAULT_COMMIT; site++) {
            if (site == PKV_FAULT_COMMIT &&
                (backend == PKV_BACKEND_DENSE || steps[i].step == step_fork))
                continue; /* nothing to commit: dense mallocs, a paged fork shares */
            fx_t f;
            fx_init(&f, backend);
            pkv_seq_t *sibling = NULL;
            if (steps[i].step == step_reserve && backend == PKV_BACKEND_PAGED)
                ck_assert_int_eq(pkv_seq_fork(f.seq, &sibling), PKV_OK); /* reserve copies */
            uint32_t failed =
                fail_each_hit(&f, (pkv_fault_site_t)site, steps[i].step, PKV_ERR_NOMEM);
            printf("fault %s %s %s: %u failing runs, then success\n", pkv_backend_name(backend),
                   steps[i].name, site == PKV_FAULT_ALLOC ? "alloc" : "commit", failed);
            ck_assert_uint_gt(failed, 0); /* the step has sites, and each failed cleanly */
            if (steps[i].step == step_create) {
                uint32_t T = prop_geo.block_tokens;
                ck_assert_uint_eq(pkv_seq_length(f.made), 64 / T * T); /* adopted the prefix */
            }
            pkv_seq_free(f.made);
            pkv_seq_free(sibling);
            fx_fini(&f);
        }
    }
}

START_TEST(faults_fail_steps_cleanly_paged)
{
    faults_fail_steps_cleanly(PKV_BACKEND_PAGED);
}
END_TEST

START_TEST(faults_fail_steps_cleanly_dense)
{
    faults_fail_steps_cleanly(PKV_BACKEND_DENSE);
}
END_TEST

/* Creating a cache: each bookkeeping allocation fails in turn, with nothing returned. */
START_TEST(faults_fail_cache_create)
{
    for (int b = PKV_BACKEND_PAGED; b <= PKV_BACKEND_DENSE; b++) {
        pkv_kv_config_t cfg = {.geo = prop_geo, .backend = (pkv_backend_t)b};
        uint32_t skip = 0;
        for (;; skip++) {
            pkv_kv_t *kv = (pkv_kv_t *)&cfg; /* stays untouched on failure */
            pkv_fault_arm(PKV_FAULT_ALLOC, skip, UINT32_MAX);
            int rc = pkv_kv_create(&cfg, &kv);
            bool fired = pkv_fault_fired(PKV_FAULT_ALLOC) > 0;
            pkv_fault_disarm_all();
            if (!fired) {
                ck_assert_int_eq(rc, PKV_OK);
                pkv_kv_destroy(kv);
                break;
            }
            ck_assert_int_eq(rc, PKV_ERR_NOMEM);
            ck_assert_ptr_eq(kv, (pkv_kv_t *)&cfg);
        }
        ck_assert_uint_ge(skip, b == PKV_BACKEND_PAGED ? 7 : 1); /* object + 6 arrays */
    }
}
END_TEST

/* A granule commit that fails after others succeeded: the granules committed for the
 * failed step go back, committed memory is as before. */
START_TEST(faults_partial_commit_returns_granules)
{
    pkv_kv_t *kv = granule_pool(16);
    int32_t tok[160];
    for (int i = 0; i < 160; i++) tok[i] = i;
    pkv_seq_params_t p = {.tokens = tok, .n_tokens = 160}; /* 10 blocks: 3 granules */
    pkv_seq_t *s = NULL;
    ck_assert_uint_eq(committed(kv), 0);
    pkv_fault_arm(PKV_FAULT_COMMIT, 2, UINT32_MAX); /* two granules commit, the third fails */
    ck_assert_int_eq(pkv_seq_create(kv, &p, &s, NULL), PKV_ERR_NOMEM);
    ck_assert_uint_eq(pkv_fault_fired(PKV_FAULT_COMMIT), 2); /* and once more, alone */
    pkv_fault_disarm_all();
    ck_assert_ptr_null(s);
    ck_assert_uint_eq(committed(kv), 0);
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    ck_assert_int_eq(pkv_seq_create(kv, &p, &s, NULL), PKV_OK);
    ck_assert_uint_eq(committed(kv), 3 * 32768);
    pkv_seq_free(s);
    pkv_kv_destroy(kv);
}
END_TEST

/* Dense: when keying a full block cannot allocate, the append still succeeds and the
 * block just stays unshared. */
START_TEST(faults_dense_publish_leaves_block_unshared)
{
    pkv_kv_config_t cfg = {.geo = prop_geo, .backend = PKV_BACKEND_DENSE};
    pkv_kv_t *kv;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    int32_t tok[33];
    for (int i = 0; i < 33; i++) tok[i] = 100 + i;
    pkv_seq_t *a, *b;
    pkv_seq_params_t p = {.tokens = tok, .n_tokens = 33};
    ck_assert_int_eq(pkv_seq_create(kv, &p, &a, NULL), PKV_OK);
    pkv_fault_arm(PKV_FAULT_ALLOC, 0, UINT32_MAX);
    ck_assert_int_eq(pkv_seq_append(a, tok, 33), PKV_OK);
    ck_assert_uint_eq(pkv_fault_fired(PKV_FAULT_ALLOC), 2); /* both full blocks */
    pkv_fault_disarm_all();
    uint32_t cached = 99;
    ck_assert_int_eq(pkv_seq_create(kv, &p, &b, &cached), PKV_OK);
    ck_assert_uint_eq(cached, 0);
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    pkv_seq_free(b);
    pkv_seq_free(a);
    pkv_kv_destroy(kv);
}
END_TEST

START_TEST(faults_validate_reports_nomem)
{
    pkv_kv_t *kv = granule_pool(4);
    pkv_fault_arm(PKV_FAULT_ALLOC, 0, 1);
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_ERR_NOMEM);
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    pkv_kv_destroy(kv);
}
END_TEST

static Suite *pool_suite(void)
{
    Suite *s = suite_create("pool");
    TCase *tc = tcase_create("property");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, property_paged);
    tcase_add_test(tc, storage_backend_gets_every_byte_operation);
    tcase_add_test(tc, property_dense);
    tcase_add_test(tc, property_paged_with_faults);
    tcase_add_test(tc, property_dense_with_faults);
    tcase_add_test(tc, property_paged_tp);
    tcase_add_test(tc, runs_span_consecutive_slots_and_match_slots);
    suite_add_tcase(s, tc);
    tc = tcase_create("properties");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, counters_agree_with_vmrss);
    tcase_add_test(tc, pages_of_the_pool_range_measured);
    tcase_add_test(tc, growth_never_moves_a_block);
    tcase_add_test(tc, admission_beyond_budget_paged);
    tcase_add_test(tc, admission_beyond_budget_dense);
    tcase_add_test(tc, nofit_message_has_the_numbers);
    tcase_add_test(tc, prefix_adoption_and_salt);
    tcase_add_test(tc, fork_copies_shared_partial_block_on_write);
    tcase_add_test(tc, pins_keep_blocks_alive);
    tcase_add_test(tc, dtype_round_trip);
    tcase_add_test(tc, bad_config_rejected);
    tcase_add_test(tc, fp8_codes_match_the_definition);
    tcase_add_test(tc, fp8_encoder_rounds_saturates_and_never_writes_nan);
    tcase_add_test(tc, scaled_rows_encode_and_decode);
    tcase_add_test(tc, quantized_pool_packs_huge_granules);
    tcase_add_test(tc, hadamard_rotation_keeps_dot_products);
    tcase_add_test(tc, allocation_prefers_dense_granules_and_decommits_with_hysteresis);
    tcase_add_test(tc, sequences_get_blocks_in_address_order);
    tcase_add_test(tc, growth_past_a_granule_starts_an_empty_one);
    tcase_add_test(tc, eviction_prefers_sparse_granules);
    tcase_add_test(tc, pins_from_worker_threads_while_engine_runs);
    suite_add_tcase(s, tc);
    tc = tcase_create("faults");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, faults_fail_steps_cleanly_paged);
    tcase_add_test(tc, faults_fail_steps_cleanly_dense);
    tcase_add_test(tc, faults_fail_cache_create);
    tcase_add_test(tc, faults_partial_commit_returns_granules);
    tcase_add_test(tc, faults_dense_publish_leaves_block_unshared);
    tcase_add_test(tc, faults_validate_reports_nomem);
    suite_add_tcase(s, tc);
    return s;
}
PKV_TEST_MAIN(pool_suite)
