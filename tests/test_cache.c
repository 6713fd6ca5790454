/*
 * The prefix cache yields memory: the pool's cache policy (a cap on the committed bytes
 * only cached blocks hold, emptied in whole granules, sparsest of the coldest first; the
 * idle time-to-live of pkv_kv_trim; the pressure limit; live blocks never touched; a
 * seeded property run with the validator after every step), prim's reading of the memory
 * left (cgroup v2, v1 with a limited ancestor, PSI, MemAvailable, from fake trees), and
 * the server: the idle timer with no new request, the cap and its figures in
 * /v1/cache/stats and /metrics, pressure from injected readings, the CLI's flags, and a
 * `pagekv serve` inside a real v1 memory cgroup with a limit (skipped with a message where
 * none can be made, e.g. a v2-only host), whose cached blocks
 * go before the limit is reached.
 */
#include "tests/support/srvtest.h"
#include "support/cgroup.h"
#include "tests/support/testutil.h"

#include "kv/kv.h"
#include "pagekv/server.h"
#include "prim/prim.h"

#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <dirent.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- pool ------------------------------------------------------------------------------- */

/* 1 layer x 1 head x 16 dims f32: 128 B a token, 2 KiB a block of 16; 8 KiB granules hold
 * 4 blocks, so tests place blocks by hand. */
#define GRAN 8192u
#define BPG  4u

static pkv_kv_t *small_pool(uint64_t cap, uint32_t idle_ms)
{
    pkv_kv_config_t c = {
        .geo = {.layers = 1, .kv_heads = 1, .head_dim = 16, .dtype = PKV_DTYPE_F32},
        .reserve_bytes = 1u << 20,
        .granule_bytes = GRAN,
        .cache_max_bytes = cap,
        .cache_idle_ms = idle_ms};
    pkv_kv_t *kv = NULL;
    ck_assert_int_eq(pkv_kv_create(&c, &kv), PKV_OK);
    return kv;
}

/* A sequence of its own tokens (base + i) reserving 4 blocks, with n_append positions
 * written (a pattern from base) and appended. */
static pkv_seq_t *seq_make(pkv_kv_t *kv, int32_t base, uint32_t n_append)
{
    int32_t tok[64];
    for (uint32_t i = 0; i < 64; i++) tok[i] = base + (int32_t)i;
    pkv_seq_params_t sp = {.tokens = tok, .n_tokens = n_append, .reserve_tokens = 64};
    pkv_seq_t *s = NULL;
    uint32_t cached = 0;
    ck_assert_int_eq(pkv_seq_create(kv, &sp, &s, &cached), PKV_OK);
    ck_assert_uint_eq(cached, 0);
    for (uint32_t p = 0; p < n_append; p++) {
        void *k, *v;
        size_t hs;
        pkv_seq_slot(s, p, 0, &k, &v, &hs);
        for (uint32_t d = 0; d < 16; d++) ((float *)k)[d] = (float)(base * 1000 + (int32_t)p);
    }
    ck_assert_int_eq(pkv_seq_append(s, tok, n_append), PKV_OK);
    return s;
}

static bool seq_intact(const pkv_seq_t *s, int32_t base)
{
    for (uint32_t p = 0; p < pkv_seq_length(s); p++) {
        void *k, *v;
        size_t hs;
        pkv_seq_slot(s, p, 0, &k, &v, &hs);
        if (((float *)k)[0] != (float)(base * 1000 + (int32_t)p)) return false;
    }
    return true;
}

/* The one granule a sequence's blocks sit in (all of them, asserted). */
static uint32_t seq_granule(const pkv_seq_t *s)
{
    const uint32_t *ids;
    uint32_t n;
    ck_assert_int_eq(pkv_seq_blocks(s, &ids, &n), PKV_OK);
    for (uint32_t i = 1; i < n; i++) ck_assert_uint_eq(ids[i] / BPG, ids[0] / BPG);
    return ids[0] / BPG;
}

static pkv_kv_stats_t stats(pkv_kv_t *kv)
{
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    return st;
}

/* How many tokens of the prompt of seq_make(base, n) the cache gives back. */
static uint32_t hit_tokens(pkv_kv_t *kv, int32_t base, uint32_t n)
{
    int32_t tok[64];
    for (uint32_t i = 0; i < n; i++) tok[i] = base + (int32_t)i;
    pkv_seq_params_t sp = {.tokens = tok, .n_tokens = n};
    pkv_seq_t *s = NULL;
    uint32_t cached = 0;
    ck_assert_int_eq(pkv_seq_create(kv, &sp, &s, &cached), PKV_OK);
    pkv_seq_free(s);
    return cached;
}

START_TEST(cap_returns_whole_granules_sparsest_first)
{
    pkv_kv_t *kv = small_pool(GRAN, 0);      /* one cache-only granule allowed */
    pkv_seq_t *live = seq_make(kv, 100, 64); /* 4 full blocks, live throughout */
    pkv_seq_t *s1 = seq_make(kv, 200, 64);   /* 4 full blocks */
    pkv_seq_t *s2 = seq_make(kv, 300, 17);   /* 1 full, 3 unhashed */
    pkv_seq_t *s3 = seq_make(kv, 400, 40);   /* 2 full, 2 unhashed */
    uint32_t g[4] = {seq_granule(live), seq_granule(s1), seq_granule(s2), seq_granule(s3)};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < i; j++) ck_assert_uint_ne(g[i], g[j]);
    pkv_kv_stats_t st = stats(kv);
    ck_assert_uint_eq(st.committed_bytes, 4 * GRAN);
    ck_assert_uint_eq(st.cache_bytes, 0);

    pkv_seq_free(s1); /* g1 cache-only: 4 cached, 8 KiB = the cap */
    st = stats(kv);
    ck_assert_uint_eq(st.blocks_cached, 4);
    ck_assert_uint_eq(st.cache_bytes, GRAN);
    ck_assert_uint_eq(st.evictions, 0);

    /* s2's granule (1 cached block) is the sparsest among the coldest: it goes, although
     * s1's blocks are older; the granule is the one empty granule kept (retain 1). */
    pkv_seq_free(s2);
    st = stats(kv);
    ck_assert_uint_eq(st.blocks_cached, 4);
    ck_assert_uint_eq(st.evictions_cap, 1);
    ck_assert_uint_eq(st.cache_bytes, GRAN);
    ck_assert_uint_eq(st.committed_bytes, 4 * GRAN);

    /* s3's granule (2) against s1's (4): s3's goes, and is returned to the OS. */
    pkv_seq_free(s3);
    st = stats(kv);
    ck_assert_uint_eq(st.blocks_cached, 4);
    ck_assert_uint_eq(st.evictions_cap, 3);
    ck_assert_uint_eq(st.evictions, 3);
    ck_assert_uint_eq(st.cache_bytes, GRAN);
    ck_assert_uint_eq(st.committed_bytes, 3 * GRAN);
    ck_assert_uint_eq(st.decommits, 1);
    ck_assert_uint_le(st.cache_bytes, st.cache_max_bytes);

    /* Live blocks untouched; the kept cache still answers. */
    ck_assert_uint_eq(st.blocks_live, 4);
    ck_assert(seq_intact(live, 100));
    ck_assert_uint_eq(hit_tokens(kv, 200, 64), 48);
    ck_assert_uint_eq(hit_tokens(kv, 400, 33), 0);
    pkv_seq_free(live);
    st = stats(kv);
    ck_assert_uint_le(st.cache_bytes, GRAN);
    pkv_kv_destroy(kv);
}
END_TEST

/* The cap counts committed memory, not blocks: cached blocks that share a granule with a
 * live one cost nothing and stay; once the granule holds only cached blocks it counts. */
START_TEST(cap_counts_committed_granules_not_blocks)
{
    pkv_kv_t *kv = small_pool(1, 0); /* no cache-only granule allowed */
    int32_t tok[64];
    for (int i = 0; i < 64; i++) tok[i] = 500 + i;
    pkv_seq_params_t sp = {.tokens = tok, .n_tokens = 32};
    pkv_seq_t *a = NULL, *b = NULL;
    ck_assert_int_eq(pkv_seq_create(kv, &sp, &a, NULL), PKV_OK);
    ck_assert_int_eq(pkv_seq_append(a, tok, 32), PKV_OK);
    sp.tokens = tok + 32;
    ck_assert_int_eq(pkv_seq_create(kv, &sp, &b, NULL), PKV_OK);
    ck_assert_int_eq(pkv_seq_append(b, tok + 32, 32), PKV_OK);
    ck_assert_uint_eq(seq_granule(a), seq_granule(b));
    pkv_seq_free(a);
    pkv_kv_stats_t st = stats(kv);
    ck_assert_uint_eq(st.blocks_cached, 2);
    ck_assert_uint_eq(st.cache_bytes, 0);
    ck_assert_uint_eq(st.evictions, 0);
    pkv_seq_free(b); /* now the granule is held by cached blocks only: over the cap */
    st = stats(kv);
    ck_assert_uint_eq(st.blocks_cached, 0);
    ck_assert_uint_eq(st.evictions_cap, 4);
    ck_assert_uint_eq(st.cache_bytes, 0);
    ck_assert_uint_le(st.committed_bytes, GRAN); /* the one empty granule kept */
    pkv_kv_destroy(kv);
}
END_TEST

START_TEST(idle_blocks_go_at_trim_not_at_the_next_request)
{
    pkv_kv_t *kv = small_pool(0, 1000);
    pkv_seq_t *live = seq_make(kv, 100, 64);
    pkv_seq_t *s1 = seq_make(kv, 200, 64), *s2 = seq_make(kv, 300, 64);
    uint64_t t0 = pkv_now_ns();
    pkv_seq_free(s1);
    uint64_t t1 = pkv_now_ns();
    usleep(20000);
    uint64_t t2 = pkv_now_ns();
    pkv_seq_free(s2);
    uint64_t next = 0;
    ck_assert_uint_eq(pkv_kv_trim(kv, pkv_now_ns(), &next), 0);
    ck_assert_uint_ge(next, t0 + 1000000000ull); /* s1's release + 1 s */
    ck_assert_uint_le(next, t1 + 1000000000ull);
    pkv_kv_stats_t st = stats(kv);
    ck_assert_uint_eq(st.blocks_cached, 8);
    ck_assert_uint_eq(st.cache_idle_ms, 1000);

    /* At t2 + 1 s only s1's blocks are past their time. */
    ck_assert_uint_eq(pkv_kv_trim(kv, t2 + 1000000000ull - 1, &next), 4);
    st = stats(kv);
    ck_assert_uint_eq(st.blocks_cached, 4);
    ck_assert_uint_eq(st.evictions_idle, 4);
    ck_assert_uint_ge(next, t2 + 1000000000ull);
    ck_assert_uint_eq(hit_tokens(kv, 300, 64), 48); /* a hit refreshes s2's blocks */

    /* Long after: the rest goes, and the granules with it (one empty granule kept). */
    ck_assert_uint_eq(pkv_kv_trim(kv, pkv_now_ns() + 2000000000ull, &next), 4);
    st = stats(kv);
    ck_assert_uint_eq(st.blocks_cached, 0);
    ck_assert_uint_eq(next, UINT64_MAX);
    ck_assert_uint_eq(st.committed_bytes, 2 * GRAN); /* the live granule + the kept one */
    ck_assert_uint_eq(st.blocks_live, 4);
    ck_assert(seq_intact(live, 100));
    pkv_seq_free(live);
    pkv_kv_destroy(kv);

    /* No TTL: trim evicts nothing and says nothing expires. */
    kv = small_pool(0, 0);
    pkv_seq_free(seq_make(kv, 200, 64));
    ck_assert_uint_eq(pkv_kv_trim(kv, UINT64_MAX - 1, &next), 0);
    ck_assert_uint_eq(next, UINT64_MAX);
    ck_assert_uint_eq(stats(kv).blocks_cached, 4);
    pkv_kv_destroy(kv);
}
END_TEST

/* ---- the warm floor --------------------------------------------------------------------- */

static pkv_kv_t *warm_pool(uint64_t warm_max, bool prefix_cache)
{
    pkv_kv_config_t c = {
        .geo = {.layers = 1, .kv_heads = 1, .head_dim = 16, .dtype = PKV_DTYPE_F32},
        .reserve_bytes = 1u << 20,
        .granule_bytes = GRAN,
        .no_prefix_cache = !prefix_cache,
        .warm_max_bytes = warm_max,
        .warm_idle_ms = 1000};
    pkv_kv_t *kv = NULL;
    ck_assert_int_eq(pkv_kv_create(&c, &kv), PKV_OK);
    return kv;
}

/* A sequence of n_tokens tokens of its own (base + i), all appended: n_tokens / 64 granules. */
static pkv_seq_t *seq_tokens(pkv_kv_t *kv, int32_t base, uint32_t n_tokens)
{
    int32_t tok[1024];
    ck_assert_uint_le(n_tokens, 1024);
    for (uint32_t i = 0; i < n_tokens; i++) tok[i] = base + (int32_t)i;
    pkv_seq_params_t sp = {.tokens = tok, .n_tokens = n_tokens};
    pkv_seq_t *s = NULL;
    ck_assert_int_eq(pkv_seq_create(kv, &sp, &s, NULL), PKV_OK);
    ck_assert_int_eq(pkv_seq_append(s, tok, n_tokens), PKV_OK);
    return s;
}

static void count_kick(void *arg)
{
    ++*(int *)arg;
}

/* The floor keeps the granules of the largest recent allocation committed when they empty,
 * so the next allocation as large commits nothing (pkv_seq_commit_ns 0); an allocation that
 * takes from it kicks its owner, whose trim commits the floor again; it is bounded by
 * warm_max_bytes; a pressure limit on the cache returns it at once and no refill commits
 * it while the limit holds; once a warm_idle_ms passed without an allocation, a trim returns
 * it (down to retain_granules), and so does a cache reset at once. */
START_TEST(warm_floor_serves_allocations_and_lapses)
{
    int kicks = 0;
    pkv_kv_t *kv = warm_pool(4 * GRAN, false);
    pkv_kv_on_warm_low(kv, count_kick, &kicks);
    pkv_seq_t *s1 = seq_tokens(kv, 1000, 192); /* 12 blocks: 3 granules */
    ck_assert_uint_gt(pkv_seq_commit_ns(s1), 0);
    pkv_kv_stats_t st = stats(kv);
    ck_assert_uint_eq(st.commits, 3);
    ck_assert_uint_eq(st.warm_bytes, 3 * GRAN);
    ck_assert_uint_eq(st.warm_max_bytes, 4 * GRAN);
    ck_assert_uint_eq(st.commit_ns, pkv_seq_commit_ns(s1));
    pkv_seq_free(s1);
    st = stats(kv);
    ck_assert_uint_eq(st.committed_bytes, 3 * GRAN); /* kept: the floor, not retain's 1 */
    ck_assert_uint_eq(st.empty_bytes, 3 * GRAN);

    int k0 = kicks;
    pkv_seq_t *s2 = seq_tokens(kv, 2000, 192);
    ck_assert_uint_eq(pkv_seq_commit_ns(s2), 0); /* served by the floor */
    ck_assert_uint_eq(stats(kv).commits, 3);
    ck_assert_int_eq(kicks, k0 + 1);
    uint64_t next = 0, now = pkv_now_ns();
    ck_assert_uint_eq(pkv_kv_trim(kv, now, &next), 0); /* a trim commits nothing... */
    ck_assert_uint_le(next, now + 1000000000ull);
    ck_assert_uint_eq(stats(kv).warm_refills, 0);
    ck_assert_uint_eq(pkv_kv_warm_refill(kv, 1), 1); /* ...the owner's refill does, */
    ck_assert_uint_eq(stats(kv).empty_bytes, 1 * GRAN);
    ck_assert_uint_eq(pkv_kv_warm_refill(kv, 0), 2); /* in steps or all at once */
    ck_assert_uint_eq(pkv_kv_warm_refill(kv, 0), 0);
    st = stats(kv);
    ck_assert_uint_eq(st.warm_refills, 3);
    ck_assert_uint_eq(st.committed_bytes, 6 * GRAN);
    ck_assert_uint_eq(st.empty_bytes, 3 * GRAN);
    pkv_seq_free(s2); /* six empty: three beyond the floor go back at once */
    ck_assert_uint_eq(stats(kv).committed_bytes, 3 * GRAN);

    /* Bounded: a 6-granule allocation sets a floor of warm_max's 4. */
    pkv_seq_t *s3 = seq_tokens(kv, 3000, 384);
    ck_assert_uint_eq(stats(kv).warm_bytes, 4 * GRAN);
    pkv_seq_free(s3);
    ck_assert_uint_eq(stats(kv).committed_bytes, 4 * GRAN);

    /* Small allocations (a decode step's block) keep the floor while it is recent... */
    pkv_seq_free(seq_tokens(kv, 4000, 16));
    ck_assert_uint_eq(stats(kv).warm_bytes, 4 * GRAN);
    /* Memory pressure takes it back at once; nothing refills it while the limit holds... */
    pkv_kv_cache_pressure(kv, 0);
    st = stats(kv);
    ck_assert_uint_eq(st.warm_bytes, 0);
    ck_assert_uint_eq(st.committed_bytes, 1 * GRAN); /* retain_granules */
    pkv_seq_free(seq_tokens(kv, 4100, 16));
    ck_assert_uint_eq(pkv_kv_warm_refill(kv, 0), 0);
    ck_assert_uint_eq(stats(kv).committed_bytes, 1 * GRAN);
    pkv_kv_cache_pressure(kv, PKV_KV_NO_LIMIT); /* ...and it is back once it lifts */
    ck_assert_uint_eq(stats(kv).warm_bytes, 4 * GRAN);
    ck_assert_uint_eq(pkv_kv_warm_refill(kv, 0), 3);
    /* A warm_idle_ms without an allocation: a trim returns it. */
    ck_assert_uint_eq(pkv_kv_trim(kv, pkv_now_ns() + 1000000000ull, &next), 0);
    st = stats(kv);
    ck_assert_uint_eq(st.warm_bytes, 0);
    ck_assert_uint_eq(st.committed_bytes, 1 * GRAN); /* retain_granules */
    ck_assert_uint_eq(next, UINT64_MAX);
    pkv_kv_on_warm_low(kv, NULL, NULL);
    pkv_kv_destroy(kv);

    /* With the prefix cache the blocks stay cached, their granules full: the refill after
     * the kick commits fresh empty ones, which serve the next prompt. */
    kv = warm_pool(4 * GRAN, true);
    pkv_kv_on_warm_low(kv, count_kick, &kicks);
    pkv_seq_free(seq_tokens(kv, 1000, 193));
    ck_assert_uint_eq(stats(kv).blocks_cached, 12);
    pkv_kv_warm_refill(kv, 0);
    st = stats(kv);
    /* 13 blocks: a floor of 4 granules, one of them the request's fourth (its partial
     * block was freed, not cached), three committed by the refill */
    ck_assert_uint_eq(st.empty_bytes, 4 * GRAN);
    ck_assert_uint_eq(st.warm_refills, 3);
    ck_assert_uint_eq(st.committed_bytes, 7 * GRAN);
    pkv_seq_t *s4 = seq_tokens(kv, 5000, 190);
    ck_assert_uint_eq(pkv_seq_commit_ns(s4), 0);
    ck_assert_uint_eq(stats(kv).blocks_cached, 12); /* nothing evicted for it */
    pkv_seq_free(s4);
    pkv_kv_reset_cache(kv); /* a reset gives everything back, the floor too */
    st = stats(kv);
    ck_assert_uint_eq(st.warm_bytes, 0);
    ck_assert_uint_eq(st.committed_bytes, 1 * GRAN);
    pkv_kv_on_warm_low(kv, NULL, NULL);
    pkv_kv_destroy(kv);

    /* No floor (the default): an emptied granule beyond retain goes back, trim commits
     * nothing. */
    kv = warm_pool(0, false);
    pkv_seq_free(seq_tokens(kv, 1000, 192));
    pkv_kv_trim(kv, pkv_now_ns(), NULL);
    ck_assert_uint_eq(pkv_kv_warm_refill(kv, 0), 0);
    st = stats(kv);
    ck_assert_uint_eq(st.committed_bytes, 1 * GRAN);
    ck_assert_uint_eq(st.warm_bytes + st.warm_refills, 0);
    pkv_kv_destroy(kv);
}
END_TEST

START_TEST(pressure_limit_holds_until_lifted)
{
    pkv_kv_t *kv = small_pool(0, 0);
    pkv_seq_t *live = seq_make(kv, 100, 64);
    for (int i = 0; i < 3; i++) pkv_seq_free(seq_make(kv, 200 + 100 * i, 64));
    pkv_kv_stats_t st = stats(kv);
    ck_assert_uint_eq(st.cache_bytes, 3 * GRAN);
    ck_assert_uint_eq(st.cache_pressure_limit, PKV_KV_NO_LIMIT);

    pkv_kv_cache_pressure(kv, GRAN);
    st = stats(kv);
    ck_assert_uint_eq(st.cache_bytes, GRAN);
    ck_assert_uint_eq(st.evictions_pressure, 8);
    ck_assert_uint_eq(st.cache_pressure_limit, GRAN);
    ck_assert_uint_eq(st.committed_bytes, 3 * GRAN); /* live, cache, one empty kept */
    pkv_seq_free(seq_make(kv, 600, 64));             /* released under the limit */
    st = stats(kv);
    ck_assert_uint_eq(st.cache_bytes, GRAN);
    ck_assert_uint_eq(st.evictions_pressure, 12);

    pkv_kv_cache_pressure(kv, 0);
    st = stats(kv);
    ck_assert_uint_eq(st.cache_bytes, 0);
    ck_assert_uint_eq(st.blocks_cached, 0);

    pkv_kv_cache_pressure(kv, PKV_KV_NO_LIMIT);
    pkv_seq_free(seq_make(kv, 700, 64));
    pkv_seq_free(seq_make(kv, 800, 64));
    st = stats(kv);
    ck_assert_uint_eq(st.cache_bytes, 2 * GRAN);
    ck_assert_uint_eq(st.evictions_pressure, 16);
    ck_assert_uint_eq(st.evictions, st.evictions_pressure + st.evictions_cap + st.evictions_idle +
                                        st.evictions_budget + st.evictions_reset);
    ck_assert(seq_intact(live, 100));
    pkv_seq_free(live);
    pkv_kv_destroy(kv);
}
END_TEST

/* Seeded random sequences of create (prompts sharing prefixes) / append / free / trim /
 * pressure / reset on a small budget, the validator after every step: the cache stays
 * within the cap and the limit, and live sequences keep their K/V. */
START_TEST(policy_property_run)
{
    uint64_t seed = pkv_test_seed(0xcafe0026), rng = seed;
    pkv_kv_config_t c = {
        .geo = {.layers = 1, .kv_heads = 1, .head_dim = 16, .dtype = PKV_DTYPE_F32},
        .budget_bytes = 24 * GRAN,
        .granule_bytes = GRAN,
        .cache_max_bytes = 6 * GRAN,
        .cache_idle_ms = 50,
        .warm_max_bytes = 3 * GRAN,
        .warm_idle_ms = 80};
    pkv_kv_t *kv = NULL;
    ck_assert_int_eq(pkv_kv_create(&c, &kv), PKV_OK);
    enum { MAXS = 8 };
    pkv_seq_t *seqs[MAXS] = {0};
    int32_t bases[MAXS] = {0};
    uint64_t now = pkv_now_ns();
    for (int step = 0; step < 600; step++) {
        uint32_t op = pkv_test_below(&rng, 10), i = pkv_test_below(&rng, MAXS);
        if (op < 4 && !seqs[i]) {
            int32_t tok[64];
            int32_t base = (int32_t)(1000 * (1 + pkv_test_below(&rng, 4)));
            uint32_t n = 1 + pkv_test_below(&rng, 64);
            for (uint32_t k = 0; k < n; k++) tok[k] = base + (int32_t)k; /* shared prefixes */
            pkv_seq_params_t sp = {.tokens = tok, .n_tokens = n, .reserve_tokens = 64};
            uint32_t cached = 0;
            int rc = pkv_seq_create(kv, &sp, &seqs[i], &cached);
            ck_assert_msg(rc == PKV_OK || rc == PKV_ERR_NOSPACE, "seed %llu step %d rc %d",
                          (unsigned long long)seed, step, rc);
            if (rc == PKV_OK) {
                for (uint32_t p = cached; p < n; p++) {
                    void *k, *v;
                    size_t hs;
                    pkv_seq_slot(seqs[i], p, 0, &k, &v, &hs);
                    ((float *)k)[0] = (float)(base * 1000 + (int32_t)p);
                }
                ck_assert_int_eq(pkv_seq_append(seqs[i], tok + cached, n - cached), PKV_OK);
                bases[i] = base;
            }
        } else if (op < 7 && seqs[i]) {
            ck_assert_msg(seq_intact(seqs[i], bases[i]), "seed %llu step %d: live K/V changed",
                          (unsigned long long)seed, step);
            pkv_seq_free(seqs[i]);
            seqs[i] = NULL;
        } else if (op == 7) {
            now += pkv_test_below(&rng, 40) * 1000000ull;
            pkv_kv_trim(kv, now, NULL);
            pkv_kv_warm_refill(kv, 0);
        } else if (op == 8) {
            uint32_t k = pkv_test_below(&rng, 4);
            pkv_kv_cache_pressure(kv, k == 3 ? PKV_KV_NO_LIMIT : k * GRAN);
        } else if (pkv_test_below(&rng, 8) == 0) {
            pkv_kv_reset_cache(kv);
        }
        pkv_kv_stats_t st;
        pkv_kv_stats(kv, &st);
        ck_assert_msg(pkv_kv_validate(kv) == PKV_OK, "seed %llu step %d", (unsigned long long)seed,
                      step);
        ck_assert_msg(st.cache_bytes <= PKV_MIN(st.cache_max_bytes, st.cache_pressure_limit),
                      "seed %llu step %d: cache %llu", (unsigned long long)seed, step,
                      (unsigned long long)st.cache_bytes);
    }
    for (int i = 0; i < MAXS; i++) pkv_seq_free(seqs[i]);
    pkv_kv_destroy(kv);
}
END_TEST

/* ---- prim: the memory left, from fake trees ------------------------------------------------ */

static void put(const char *root, const char *path, const char *text)
{
    char full[1024], dir[1024];
    snprintf(full, sizeof(full), "%s%s", root, path);
    snprintf(dir, sizeof(dir), "%s", full);
    for (char *p = dir + strlen(root) + 1; (p = strchr(p, '/')); p++) {
        *p = 0;
        mkdir(dir, 0755);
        *p = '/';
    }
    FILE *f = fopen(full, "w");
    ck_assert_msg(f != NULL, "cannot write %s", full);
    fputs(text, f);
    fclose(f);
}

static void fake_root(char *dir, size_t n)
{
    snprintf(dir, n, "/tmp/pkv-room-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
}

#define MIB (1ull << 20)

START_TEST(room_reads_v2_v1_psi_and_meminfo)
{
    char root[64];
    fake_root(root, sizeof(root));
    pkv_prim_room_t r;
    /* Nothing there: every source absent. */
    ck_assert_int_eq(pkv_prim_room_read(root, &r), PKV_OK);
    ck_assert(!r.cgroup.present && !r.machine.present && !r.have_psi && !r.cgroup_version);

    put(root, "/proc/meminfo",
        "MemTotal:       1048576 kB\nMemFree: 1 kB\nMemAvailable:    262144 kB\n");
    put(root, "/proc/pressure/memory",
        "some avg10=12.50 avg60=3.00 avg300=1.00 total=5\nfull avg10=1.00 avg60=0 avg300=0 "
        "total=1\n");
    put(root, "/proc/self/cgroup", "0::/svc/app\n");
    put(root, "/sys/fs/cgroup/svc/app/memory.max", "max\n");
    put(root, "/sys/fs/cgroup/svc/app/memory.current", "300000000\n");
    put(root, "/sys/fs/cgroup/svc/memory.max", "536870912\n");
    put(root, "/sys/fs/cgroup/svc/memory.current", "400000000\n");
    put(root, "/sys/fs/cgroup/svc/memory.stat", "anon 1\nfile 2\ninactive_file 100000000\n");
    ck_assert_int_eq(pkv_prim_room_read(root, &r), PKV_OK);
    ck_assert_uint_eq(r.cgroup_version, 2);
    ck_assert(r.cgroup.present);
    ck_assert_uint_eq(r.cgroup.limit_bytes, 512 * MIB); /* the limited ancestor */
    ck_assert_uint_eq(r.cgroup.usage_bytes, 300000000); /* less its inactive file pages */
    ck_assert(r.machine.present);
    ck_assert_uint_eq(r.machine.limit_bytes, 1024 * MIB);
    ck_assert_uint_eq(r.machine.usage_bytes, 768 * MIB);
    ck_assert(r.have_psi);
    ck_assert(r.psi_some_avg10 > 12.49 && r.psi_some_avg10 < 12.51);
    pkv_test_rm_tree(root);

    /* v1: the memory controller's line; the tighter of the cgroup and an ancestor. */
    fake_root(root, sizeof(root));
    put(root, "/proc/self/cgroup", "5:cpu,cpuacct:/x\n4:memory:/a/b\n0::/\n");
    put(root, "/sys/fs/cgroup/memory/a/b/memory.limit_in_bytes", "9223372036854771712\n");
    put(root, "/sys/fs/cgroup/memory/a/b/memory.usage_in_bytes", "1000\n");
    put(root, "/sys/fs/cgroup/memory/a/memory.limit_in_bytes", "209715200\n");
    put(root, "/sys/fs/cgroup/memory/a/memory.usage_in_bytes", "104857600\n");
    put(root, "/sys/fs/cgroup/memory/a/memory.stat", "cache 5\ntotal_inactive_file 4194304\n");
    put(root, "/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    put(root, "/sys/fs/cgroup/memory/memory.usage_in_bytes", "5\n");
    ck_assert_int_eq(pkv_prim_room_read(root, &r), PKV_OK);
    ck_assert_uint_eq(r.cgroup_version, 1);
    ck_assert_uint_eq(r.cgroup.limit_bytes, 200 * MIB);
    ck_assert_uint_eq(r.cgroup.usage_bytes, 96 * MIB);
    ck_assert(!r.machine.present && !r.have_psi);
    pkv_test_rm_tree(root);

    /* A container: its cgroup path is not under the mount; the mount's root is its own. */
    fake_root(root, sizeof(root));
    put(root, "/proc/self/cgroup", "4:memory:/docker/abc\n");
    put(root, "/sys/fs/cgroup/memory/memory.limit_in_bytes", "104857600\n");
    put(root, "/sys/fs/cgroup/memory/memory.usage_in_bytes", "52428800\n");
    ck_assert_int_eq(pkv_prim_room_read(root, &r), PKV_OK);
    ck_assert_uint_eq(r.cgroup_version, 1);
    ck_assert_uint_eq(r.cgroup.limit_bytes, 100 * MIB);
    pkv_test_rm_tree(root);

    /* The real files of this machine read without error. */
    ck_assert_int_eq(pkv_prim_room_read(NULL, &r), PKV_OK);
    ck_assert(r.machine.present);
}
END_TEST

/* ---- server ------------------------------------------------------------------------------ */

typedef ts_resp_t resp_t;

static resp_t http(uint16_t port, const char *method, const char *path, const char *body)
{
    resp_t r;
    CURLcode cc = ts_http("127.0.0.1", port, method, path, body, NULL, 120, &r);
    ck_assert_msg(cc == CURLE_OK, "%s %s: %s", method, path, curl_easy_strerror(cc));
    return r;
}

static json_t *cache_stats(uint16_t port)
{
    resp_t r = http(port, "GET", "/v1/cache/stats", NULL);
    ck_assert_int_eq(r.status, 200);
    json_t *doc = json_loads(r.body, 0, NULL);
    ck_assert_ptr_nonnull(doc);
    ts_resp_free(&r);
    return doc;
}

static long long jint(json_t *doc, const char *a, const char *b)
{
    json_t *v = json_object_get(doc, a);
    if (b) v = json_object_get(v, b);
    ck_assert_msg(json_is_integer(v), "%s.%s is not an integer", a, b ? b : "");
    return json_integer_value(v);
}

static long long jev(json_t *doc, const char *cause)
{
    json_t *v =
        json_object_get(json_object_get(json_object_get(doc, "prefix_cache"), "evictions"), cause);
    ck_assert(json_is_integer(v));
    return json_integer_value(v);
}

/* A completion of n token ids of its own (seed) with max_tokens 1. */
static void complete_ids(uint16_t port, const char *model, uint32_t seed, uint32_t n)
{
    json_t *ids = json_array();
    uint64_t st = seed;
    for (uint32_t i = 0; i < n; i++)
        json_array_append_new(ids, json_integer(10 + (json_int_t)pkv_test_below(&st, 200)));
    json_t *req = json_pack("{s:s, s:o, s:i, s:i}", "model", model, "prompt", ids, "max_tokens", 1,
                            "temperature", 0);
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    resp_t r = http(port, "POST", "/v1/completions", body);
    ck_assert_msg(r.status == 200, "status %ld: %s", r.status, r.body ? r.body : "");
    ts_resp_free(&r);
    free(body);
}

static pkv_server_config_t llama_config(void)
{
    return (pkv_server_config_t){.threads = 1,
                                 .preset = "llama-3.2-1b",
                                 .max_context = 1024,
                                 .kv_dtype = PKV_DTYPE_F16,
                                 .cache_idle_ms = PKV_SERVER_NEVER,
                                 .cache_max_mode = PKV_SERVER_BUDGET_NONE,
                                 .no_memory_watch = true,
                                 .memory_poll_ms = 50};
}

static pkv_server_t *start(const pkv_server_config_t *cfg)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
    pkv_server_t *s = NULL;
    ck_assert_int_eq(pkv_server_create(cfg, &s), PKV_OK);
    return s;
}

/* Poll /v1/cache/stats until cond(doc) or the deadline; returns the last document. */
static json_t *wait_stats(uint16_t port, bool (*cond)(json_t *), double seconds)
{
    uint64_t deadline = pkv_deadline_after_ns((uint64_t)(seconds * 1e9));
    for (;;) {
        json_t *doc = cache_stats(port);
        if (cond(doc) || pkv_now_ns() > deadline) return doc;
        json_decref(doc);
        usleep(50000);
    }
}

static bool nothing_cached(json_t *d)
{
    return jint(d, "blocks", "cached") == 0;
}

START_TEST(server_idle_timer_without_requests)
{
    pkv_server_config_t cfg = llama_config();
    cfg.cache_idle_ms = 1500;
    pkv_server_t *s = start(&cfg);
    uint16_t port = pkv_server_port(s);
    for (uint32_t i = 0; i < 3; i++) complete_ids(port, "llama-3.2-1b", 1 + i, 150);
    /* No generation request from here on: only the timer can evict. */
    json_t *d = wait_stats(port, nothing_cached, 30);
    ck_assert_int_eq(jint(d, "blocks", "cached"), 0);
    ck_assert_int_ge(jev(d, "idle"), 3 * 9);
    ck_assert_int_eq(jev(d, "cap") + jev(d, "pressure") + jev(d, "budget"), 0);
    ck_assert_int_le(jint(d, "committed_bytes", NULL), jint(d, "granule_bytes", NULL));
    ck_assert_int_eq(jint(d, "prefix_cache", "bytes"), 0);
    json_t *idle = json_object_get(json_object_get(d, "prefix_cache"), "idle_s");
    ck_assert(json_is_real(idle) && json_real_value(idle) == 1.5);
    json_decref(d);
    pkv_server_destroy(s);
}
END_TEST

static long long jwarm(json_t *d, const char *key)
{
    return jint(d, "warm", key);
}

static bool warm_refilled(json_t *d)
{
    return jwarm(d, "bytes") > 0 && jwarm(d, "empty_bytes") >= jwarm(d, "bytes");
}

static bool warm_lapsed(json_t *d)
{
    return jwarm(d, "bytes") == 0 && jint(d, "blocks", "cached") == 0 &&
           jint(d, "committed_bytes", NULL) <= jint(d, "granule_bytes", NULL);
}

/* The scheduling policy (SCHED_*) of this process's thread named name; -1 when none is. */
static int thread_policy(const char *name)
{
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    int policy = -1;
    while (d && policy < 0 && (e = readdir(d))) {
        char path[64], buf[1024] = {0};
        snprintf(path, sizeof(path), "/proc/self/task/%.16s/comm", e->d_name);
        FILE *f = fopen(path, "r");
        bool match = f && fgets(buf, sizeof(buf), f) && !strncmp(buf, name, strlen(name)) &&
                     buf[strlen(name)] == '\n';
        if (f) fclose(f);
        if (!match) continue;
        snprintf(path, sizeof(path), "/proc/self/task/%.16s/stat", e->d_name);
        if (!(f = fopen(path, "r"))) continue;
        if (fgets(buf, sizeof(buf), f)) {
            char *p = strrchr(buf, ')'); /* fields after the name: state is field 3 */
            for (int field = 2; p && field < 41; field++) p = strchr(p + 1, ' ');
            if (p) policy = atoi(p + 1);
        }
        fclose(f);
    }
    if (d) closedir(d);
    return policy;
}

/* The warm floor in a server: after an admission of 10 blocks (3 granules) the watcher,
 * kicked, commits the floor again once the request has ended (the blocks stay cached), and
 * once the cache's idle time passes both go: one granule stays. A unified node's auto keeps
 * a floor but does not refill it (no pkv-warm thread). */
START_TEST(server_warm_floor_refilled_then_returned)
{
    pkv_server_config_t cfg = llama_config();
    /* The floor lapses this long after the admission that set it, and it is refilled only
     * once the request has ended: long enough for a slow (sanitizer) build's request. */
    cfg.cache_idle_ms = 6000;
    pkv_server_t *s = start(&cfg);
    json_t *d = cache_stats(pkv_server_port(s));
    ck_assert_int_eq(jwarm(d, "max_bytes"), 64 * MIB); /* auto, a quarter of the budget: */
    ck_assert(json_is_false(json_object_get(json_object_get(d, "warm"), "refill")));
    ck_assert_int_eq(thread_policy("pkv-warm"), -1); /* on a unified node kept, not refilled */
    json_decref(d);
    pkv_server_destroy(s);

    cfg.kv_warm_max_bytes = 64 * MIB;
    s = start(&cfg);
    /* Not idle priority: a commit holds the address space's lock and the pool's mutex, and a
     * thread that holds them while waiting for a core stalls every thread that needs them. */
    ck_assert_int_eq(thread_policy("pkv-warm"), SCHED_OTHER);
    uint16_t port = pkv_server_port(s);
    complete_ids(port, "llama-3.2-1b", 7, 150);
    d = wait_stats(port, warm_refilled, 10);
    ck_assert_int_eq(jwarm(d, "max_bytes"), 64 * MIB);
    ck_assert(json_is_true(json_object_get(json_object_get(d, "warm"), "refill")));
    ck_assert_int_eq(jwarm(d, "bytes"), 3 * 2 * MIB);
    ck_assert_int_eq(jwarm(d, "empty_bytes"), 3 * 2 * MIB);
    ck_assert_int_ge(jwarm(d, "refilled_granules"), 2);
    ck_assert_int_gt(jint(d, "blocks", "cached"), 0);
    json_decref(d);
    resp_t m = http(port, "GET", "/metrics", NULL);
    ck_assert_ptr_nonnull(strstr(m.body, "\npagekv_kv_warm_bytes 6291456\n"));
    ck_assert_ptr_nonnull(strstr(m.body, "\n# TYPE pagekv_kv_commit_seconds_total counter\n"));
    ts_resp_free(&m);
    d = wait_stats(port, warm_lapsed, 30);
    ck_assert_msg(warm_lapsed(d), "warm %lld, committed %lld", jwarm(d, "bytes"),
                  jint(d, "committed_bytes", NULL));
    json_decref(d);
    pkv_server_destroy(s);
}
END_TEST

START_TEST(server_cap_and_its_figures)
{
    pkv_server_config_t cfg = llama_config();
    cfg.cache_max_mode = PKV_SERVER_BUDGET_BYTES;
    cfg.cache_max_bytes = 2 * MIB; /* one granule */
    cfg.cache_idle_ms = 600000;    /* the watcher's trims: the warm floor lives on them */
    pkv_server_t *s = start(&cfg);
    uint16_t port = pkv_server_port(s);
    for (uint32_t i = 0; i < 4; i++) {
        complete_ids(port, "llama-3.2-1b", 10 + i, 150);
        json_t *d = cache_stats(port);
        ck_assert_int_le(jint(d, "prefix_cache", "bytes"), 2 * MIB);
        ck_assert_int_eq(jint(d, "prefix_cache", "max_bytes"), 2 * MIB);
        json_decref(d);
    }
    json_t *d = cache_stats(port);
    long long cap_ev = jev(d, "cap");
    ck_assert_int_gt(cap_ev, 0);
    ck_assert_int_gt(jint(d, "blocks", "cached"), 0);
    /* the cache and the warm floor: the empty granules of the largest recent admission */
    long long warm = jwarm(d, "bytes");
    ck_assert_int_ge(warm, 2 * 2 * MIB);
    ck_assert_int_le(jint(d, "committed_bytes", NULL), 2 * MIB + warm);
    /* At the cap each request's end evicts a prompt's blocks: their granules stay, empty,
     * for the next admission, which commits nothing. */
    long long commits = jint(d, "granule_commits", NULL);
    json_decref(d);
    complete_ids(port, "llama-3.2-1b", 20, 150);
    d = cache_stats(port);
    ck_assert_int_eq(jint(d, "granule_commits", NULL), commits);
    ck_assert_int_gt(jev(d, "cap"), cap_ev);
    cap_ev = jev(d, "cap");
    ck_assert_int_eq(jint(d, "evictions", NULL), cap_ev + jev(d, "idle") + jev(d, "pressure") +
                                                     jev(d, "budget") + jev(d, "reset"));
    json_decref(d);
    resp_t m = http(port, "GET", "/metrics", NULL);
    ck_assert_int_eq(m.status, 200);
    char want[160];
    snprintf(want, sizeof(want), "\npagekv_kv_cache_evictions_total{cause=\"cap\"} %lld\n", cap_ev);
    ck_assert_msg(strstr(m.body, want), "no '%s' in /metrics", want);
    ck_assert_ptr_nonnull(strstr(m.body, "\npagekv_kv_cache_max_bytes 2097152\n"));
    ck_assert_ptr_nonnull(strstr(m.body, "\n# TYPE pagekv_kv_cache_bytes gauge\n"));
    ck_assert_ptr_nonnull(strstr(m.body, "pagekv_kv_cache_evictions_total{cause=\"idle\"} 0\n"));
    ck_assert_ptr_null(strstr(m.body, "pagekv_memory_room_bytes")); /* the watch is off */
    ts_resp_free(&m);
    pkv_server_destroy(s);
}
END_TEST

static bool under_pressure(json_t *d)
{
    return json_is_true(json_object_get(json_object_get(d, "memory"), "pressure")) &&
           jint(d, "prefix_cache", "bytes") == 0;
}

static bool pressure_over(json_t *d)
{
    return json_is_false(json_object_get(json_object_get(d, "memory"), "pressure"));
}

/* The paths no cgroup on this machine reaches (v2, PSI), from injected readings. */
START_TEST(server_pressure_from_injected_readings)
{
    char root[64];
    fake_root(root, sizeof(root));
    put(root, "/proc/meminfo", "MemTotal: 67108864 kB\nMemAvailable: 60000000 kB\n");
    put(root, "/proc/pressure/memory", "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n");
    put(root, "/proc/self/cgroup", "0::/svc\n");
    put(root, "/sys/fs/cgroup/svc/memory.max", "1073741824\n");
    put(root, "/sys/fs/cgroup/svc/memory.current", "104857600\n");
    pkv_server_config_t cfg = llama_config();
    cfg.no_memory_watch = false;
    cfg.memory_root = root;
    cfg.memory_reserve_bytes = 64 * MIB;
    pkv_server_t *s = start(&cfg);
    uint16_t port = pkv_server_port(s);
    for (uint32_t i = 0; i < 3; i++) complete_ids(port, "llama-3.2-1b", 20 + i, 150);
    json_t *d = cache_stats(port);
    ck_assert_int_ge(jint(d, "prefix_cache", "bytes"), 3 * 2 * MIB);
    json_t *mem = json_object_get(d, "memory");
    ck_assert_str_eq(json_string_value(json_object_get(mem, "source")), "cgroup_v2");
    ck_assert_int_eq(jint(mem, "limit_bytes", NULL), 1024 * MIB);
    ck_assert(json_is_false(json_object_get(mem, "pressure")));
    json_decref(d);

    /* 16 MiB left of the cgroup's 1 GiB, below the 64 MiB reserve: the cache goes. */
    put(root, "/sys/fs/cgroup/svc/memory.current", "1056964608\n");
    d = wait_stats(port, under_pressure, 20);
    ck_assert_msg(under_pressure(d), "the cache was not dropped");
    ck_assert_int_gt(jev(d, "pressure"), 0);
    ck_assert_int_eq(jint(json_object_get(d, "memory"), "pressure_episodes", NULL), 1);
    ck_assert_int_eq(jint(d, "prefix_cache", "pressure_limit_bytes"), 0);
    json_decref(d);
    /* Released blocks go at once while it lasts (the pool holds the limit between polls). */
    complete_ids(port, "llama-3.2-1b", 30, 150);
    d = cache_stats(port);
    ck_assert_int_eq(jint(d, "prefix_cache", "bytes"), 0);
    json_decref(d);

    /* Room again: the episode ends (one), the cache grows again. */
    put(root, "/sys/fs/cgroup/svc/memory.current", "104857600\n");
    json_decref(wait_stats(port, pressure_over, 20));
    complete_ids(port, "llama-3.2-1b", 31, 150);
    d = cache_stats(port);
    ck_assert_int_gt(jint(d, "prefix_cache", "bytes"), 0);
    ck_assert_int_eq(jint(json_object_get(d, "memory"), "pressure_episodes", NULL), 1);
    json_decref(d);

    /* PSI: the machine stalls on memory (no cgroup limit now): everything cached goes. */
    put(root, "/sys/fs/cgroup/svc/memory.max", "max\n");
    put(root, "/proc/pressure/memory", "some avg10=42.00 avg60=10.00 avg300=2.00 total=9\n");
    d = wait_stats(port, under_pressure, 20);
    ck_assert_msg(under_pressure(d), "PSI did not drop the cache");
    mem = json_object_get(d, "memory");
    ck_assert_str_eq(json_string_value(json_object_get(mem, "source")), "meminfo");
    ck_assert_int_eq(jint(mem, "pressure_episodes", NULL), 2);
    json_decref(d);
    put(root, "/proc/pressure/memory", "some avg10=1.00 avg60=10.00 avg300=2.00 total=9\n");
    json_decref(wait_stats(port, pressure_over, 20));

    /* MemAvailable alone below the reserve. */
    put(root, "/proc/meminfo", "MemTotal: 67108864 kB\nMemAvailable: 16384 kB\n");
    complete_ids(port, "llama-3.2-1b", 32, 150);
    d = wait_stats(port, under_pressure, 20);
    ck_assert_msg(under_pressure(d), "MemAvailable did not drop the cache");
    ck_assert_int_eq(jint(json_object_get(d, "memory"), "pressure_episodes", NULL), 3);
    json_decref(d);
    resp_t m = http(port, "GET", "/metrics", NULL);
    ck_assert_ptr_nonnull(strstr(m.body, "\npagekv_memory_pressure 1\n"));
    ck_assert_ptr_nonnull(strstr(m.body, "\npagekv_memory_pressure_episodes_total 3\n"));
    ts_resp_free(&m);
    pkv_server_destroy(s);
    pkv_test_rm_tree(root);
}
END_TEST

/* ---- the CLI and a real memory cgroup -------------------------------------------------------- */

/* A `pagekv` child (support/launch.h) and what it logged, once reaped. */
typedef struct {
    launch_proc_t p;
    pid_t pid;
    char log[32768];
} child_t;

/* Start argv (its output in a file of its own); the child first joins `procs` (a cgroup's
 * cgroup.procs) when given. */
static void child_start(child_t *c, char *const argv[], const char *procs)
{
    memset(c, 0, sizeof(*c));
    char log[] = "/tmp/pkv-test-cache-XXXXXX";
    pkv_test_tmpfile(log);
    launch_spec_t spec = {.name = "pagekv", .argv = argv, .log_path = log, .cgroup_procs = procs};
    char err[512];
    ck_assert_msg(launch_spawn(&c->p, &spec, err, sizeof(err)) == 0, "%s", err);
    c->pid = c->p.pid;
}

/* Reap it within timeout_s (SIGKILL after): its exit code (launch_stop's); its log in
 * c->log. */
static int child_wait(child_t *c, int timeout_s)
{
    int code = launch_stop(&c->p, 0, pkv_deadline_after_ns((uint64_t)timeout_s * 1000000000ull));
    char *log = launch_log_read(&c->p);
    snprintf(c->log, sizeof(c->log), "%s", log ? log : "");
    free(log);
    unlink(c->p.log);
    return code;
}

/* The port it listens on, within 60 s; 0 if it never came. */
static uint16_t child_port(child_t *c)
{
    char err[1024];
    if (launch_wait_listening(&c->p, false, pkv_deadline_after_ns(60000000000ull), err,
                              sizeof(err)) != 0) {
        fprintf(stderr, "%s\n", err);
        return 0;
    }
    return c->p.port;
}

START_TEST(cli_rejects_bad_cache_flags)
{
    char bin[4096];
    ts_pagekv_path(bin, sizeof(bin));
    const char *cases[][2] = {{"--prefix-cache-max-bytes", "0"},
                              {"--prefix-cache-max-bytes", "lots"},
                              {"--prefix-cache-idle-s", "-1"},
                              {"--prefix-cache-idle-s", "1x"},
                              {"--prefix-cache-idle-s", "0.0001"},
                              {"--memory-reserve", "0"},
                              {"--memory-reserve", "12Q"},
                              {"--kv-warm-max", "0"},
                              {"--kv-warm-max", "some"}};
    for (size_t i = 0; i < PKV_ARRAY_LEN(cases); i++) {
        char *argv[] = {bin, "serve", (char *)cases[i][0], (char *)cases[i][1], NULL};
        child_t c;
        child_start(&c, argv, NULL);
        int code = child_wait(&c, 30);
        ck_assert_msg(code == 2, "%s %s: exit code %d: %s", cases[i][0], cases[i][1], code, c.log);
        ck_assert_msg(strstr(c.log, cases[i][0]), "the message does not name %s: %s", cases[i][0],
                      c.log);
    }
}
END_TEST

static bool read_u64(const char *path, uint64_t *out)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    unsigned long long v;
    bool ok = fscanf(f, "%llu", &v) == 1;
    fclose(f);
    if (ok) *out = v;
    return ok;
}

static bool write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f) return false;
    bool ok = fputs(text, f) >= 0;
    return fclose(f) == 0 && ok;
}

static bool cache_dropped_under_pressure(json_t *d)
{
    return jev(d, "pressure") > 0;
}

/* Until the server's memory watcher has read a limit of at most `limit` (10 s at most). */
static void watcher_sees_limit(uint16_t port, uint64_t limit)
{
    uint64_t deadline = pkv_deadline_after_ns(10000000000ull);
    for (;;) {
        json_t *d = cache_stats(port);
        json_t *v = json_object_get(json_object_get(d, "memory"), "limit_bytes");
        bool seen = json_is_integer(v) && json_integer_value(v) > 0 &&
                    (uint64_t)json_integer_value(v) <= limit;
        json_decref(d);
        if (seen) return;
        ck_assert_msg(pkv_now_ns() < deadline, "the watcher never read the %llu-byte limit",
                      (unsigned long long)limit);
        usleep(20000);
    }
}

START_TEST(server_in_a_real_memory_cgroup)
{
#if defined(__SANITIZE_THREAD__)
    /* TSan's shadow memory (several times the application's) fills any limit sized for
     * the server itself: the kernel kills it before the cache matters. */
    PKV_TEST_SKIP("under ThreadSanitizer (its shadow memory fills the limit)");
    return;
#endif
    char cg[1600], why[1800], path[1700];
    if (cgroup_v1_make("pkv-test", cg, sizeof(cg), why, sizeof(why))) {
        PKV_TEST_SKIP("%s", why);
        return;
    }
    char bin[4096];
    ts_pagekv_path(bin, sizeof(bin));
    /* f32 KV: 64 KiB a token, so each 400-token prompt caches ~25 MiB. */
    char *argv[] = {bin,
                    "serve",
                    "--port",
                    "0",
                    "--preset",
                    "llama-3.2-1b",
                    "--kv-dtype",
                    "f32",
                    "--max-context",
                    "1024",
                    "--threads",
                    "1",
                    "--prefix-cache-max-bytes",
                    "none",
                    "--prefix-cache-idle-s",
                    "0",
                    "--memory-reserve",
                    "48M",
                    NULL};
    snprintf(path, sizeof(path), "%s/cgroup.procs", cg);
    child_t c;
    child_start(&c, argv, path);
    uint16_t port = child_port(&c);
    uint64_t usage0 = 0, limit = 0, failcnt = 1, max_usage = 0;
    long long pressure_ev = -1, episodes = -1, cached_after = -1;
    const char *source = "?";
    char source_buf[32] = "";
    bool limit_set = false;
    if (port) {
        snprintf(path, sizeof(path), "%s/memory.usage_in_bytes", cg);
        read_u64(path, &usage0);
        limit = usage0 + 200 * MIB; /* 200 MiB for KV beyond what the idle server holds */
        char text[32];
        snprintf(text, sizeof(text), "%llu\n", (unsigned long long)limit);
        snprintf(path, sizeof(path), "%s/memory.limit_in_bytes", cg);
        limit_set = write_text(path, text);
        if (limit_set) watcher_sees_limit(port, limit);
        for (uint32_t i = 0; limit_set && i < 16; i++)
            complete_ids(port, "llama-3.2-1b", 100 + i, 400);
        json_t *d = wait_stats(port, cache_dropped_under_pressure, 5);
        pressure_ev = jev(d, "pressure");
        episodes = jint(json_object_get(d, "memory"), "pressure_episodes", NULL);
        cached_after = jint(d, "blocks", "cached");
        snprintf(source_buf, sizeof(source_buf), "%s",
                 json_string_value(json_object_get(json_object_get(d, "memory"), "source")));
        source = source_buf;
        json_decref(d);
        snprintf(path, sizeof(path), "%s/memory.failcnt", cg);
        read_u64(path, &failcnt);
        snprintf(path, sizeof(path), "%s/memory.max_usage_in_bytes", cg);
        read_u64(path, &max_usage);
        kill(c.pid, SIGTERM);
    }
    int code = child_wait(&c, 60);
    cgroup_v1_remove(cg); /* empty once the server is gone */
    fprintf(stderr,
            "server_in_a_real_memory_cgroup: idle %.1f MiB, limit %.1f MiB, max usage %.1f MiB, "
            "failcnt %llu, pressure evictions %lld, episodes %lld, cached at the end %lld\n",
            (double)usage0 / MIB, (double)limit / MIB, (double)max_usage / MIB,
            (unsigned long long)failcnt, pressure_ev, episodes, cached_after);
    ck_assert_msg(port, "the server did not start: %s", c.log);
    ck_assert_msg(limit_set, "cannot set memory.limit_in_bytes in %s", cg);
    ck_assert_msg(code == 0, "server exit code %d: %s", code, c.log);
    ck_assert_str_eq(source, "cgroup_v1");
    ck_assert_msg(pressure_ev > 0, "no pressure evictions; log: %s", c.log);
    ck_assert_int_ge(episodes, 1);
    ck_assert_int_gt(cached_after, 0); /* the cache was held, not abandoned */
    /* The limit was never reached: the kernel never had to reclaim for this cgroup. */
    ck_assert_msg(failcnt == 0 && max_usage < limit,
                  "failcnt %llu, max usage %llu of limit %llu (idle %llu)",
                  (unsigned long long)failcnt, (unsigned long long)max_usage,
                  (unsigned long long)limit, (unsigned long long)usage0);
    ck_assert_ptr_nonnull(strstr(c.log, "memory pressure (cgroup_v1"));
    struct stat sb;
    ck_assert_msg(stat(cg, &sb) != 0, "cgroup %s left behind", cg);
}
END_TEST

static Suite *cache_suite(void)
{
    Suite *s = suite_create("cache");
    TCase *pool = tcase_create("pool");
    tcase_set_timeout(pool, 60);
    tcase_add_test(pool, cap_returns_whole_granules_sparsest_first);
    tcase_add_test(pool, cap_counts_committed_granules_not_blocks);
    tcase_add_test(pool, idle_blocks_go_at_trim_not_at_the_next_request);
    tcase_add_test(pool, pressure_limit_holds_until_lifted);
    tcase_add_test(pool, warm_floor_serves_allocations_and_lapses);
    tcase_add_test(pool, policy_property_run);
    tcase_add_test(pool, room_reads_v2_v1_psi_and_meminfo);
    suite_add_tcase(s, pool);
    TCase *srv = tcase_create("server");
    tcase_set_timeout(srv, 240);
    tcase_add_test(srv, server_idle_timer_without_requests);
    tcase_add_test(srv, server_cap_and_its_figures);
    tcase_add_test(srv, server_warm_floor_refilled_then_returned);
    tcase_add_test(srv, server_pressure_from_injected_readings);
    tcase_add_test(srv, cli_rejects_bad_cache_flags);
    tcase_add_test(srv, server_in_a_real_memory_cgroup);
    suite_add_tcase(s, srv);
    return s;
}

PKV_TEST_MAIN(cache_suite)
