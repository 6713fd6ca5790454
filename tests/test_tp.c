/*
 * Tensor-parallel ranks: the TP degree check and head split; a paged pool with tp ranks
 * (distinct storage ranges, addressable and isolated rank pieces, per-rank commit
 * accounting that adds up and agrees with VmRSS, copy-on-write of every rank's part, the
 * bookkeeping giving the same block ids as tp = 1); and the model over the shards: logits
 * and greedy tokens bitwise equal to tp = 1, each rank's K/V equal to the matching head
 * slice of the tp = 1 pool. The seeded property run at tp 2/4/8 is in test_pool.c.
 */
#include "tests/support/testutil.h"

#include "pagekv/model.h"

#include <stdio.h>
#include <string.h>

/* ---- the degree check and the head split --------------------------------------------- */

START_TEST(tp_check_accepts_divisors_and_multiples)
{
    char why[128];
    static const uint32_t good8[] = {1, 2, 4, 8, 16, 32, 64};
    for (size_t i = 0; i < PKV_ARRAY_LEN(good8); i++)
        ck_assert_int_eq(pkv_kv_tp_check(8, good8[i], why, sizeof(why)), PKV_OK);
    static const uint32_t bad8[] = {0, 3, 5, 6, 7, 12, 20, 65, 128, UINT32_MAX};
    for (size_t i = 0; i < PKV_ARRAY_LEN(bad8); i++) {
        why[0] = 0;
        ck_assert_int_eq(pkv_kv_tp_check(8, bad8[i], why, sizeof(why)), PKV_ERR_INVALID);
        ck_assert_msg(strlen(why) > 0 && strstr(why, "KV heads"), "tp %u: no reason", bad8[i]);
        ck_assert_int_eq(pkv_kv_tp_check(8, bad8[i], NULL, 0), PKV_ERR_INVALID);
    }
    static const uint32_t good2[] = {1, 2, 4, 8, 64};
    for (size_t i = 0; i < PKV_ARRAY_LEN(good2); i++)
        ck_assert_int_eq(pkv_kv_tp_check(2, good2[i], NULL, 0), PKV_OK);
    static const uint32_t bad2[] = {0, 3, 5, 7, 66};
    for (size_t i = 0; i < PKV_ARRAY_LEN(bad2); i++)
        ck_assert_int_eq(pkv_kv_tp_check(2, bad2[i], why, sizeof(why)), PKV_ERR_INVALID);
    /* A short buffer is cut, never overrun. */
    char tiny[8];
    memset(tiny, 'x', sizeof(tiny));
    ck_assert_int_eq(pkv_kv_tp_check(8, 3, tiny, sizeof(tiny)), PKV_ERR_INVALID);
    ck_assert_uint_eq(strlen(tiny), sizeof(tiny) - 1);
}
END_TEST

START_TEST(tp_heads_split_and_replicate)
{
    uint32_t lo, n;
    /* 8 heads over 2, 4, 8 ranks: contiguous equal shards covering every head once. */
    for (uint32_t tp = 1; tp <= 8; tp *= 2) {
        for (uint32_t r = 0; r < tp; r++) {
            pkv_kv_tp_heads(8, tp, r, &lo, &n);
            ck_assert_uint_eq(n, 8 / tp);
            ck_assert_uint_eq(lo, r * (8 / tp));
        }
    }
    /* tiny's 2 heads over 4 ranks: one head each, each head on two ranks. */
    static const uint32_t want[4] = {0, 0, 1, 1};
    for (uint32_t r = 0; r < 4; r++) {
        pkv_kv_tp_heads(2, 4, r, &lo, &n);
        ck_assert_uint_eq(n, 1);
        ck_assert_uint_eq(lo, want[r]);
    }
    pkv_kv_tp_heads(8, 16, 15, &lo, &n);
    ck_assert_uint_eq(lo, 7);
    ck_assert_uint_eq(n, 1);
}
END_TEST

/* ---- the pool ------------------------------------------------------------------------- */

static const pkv_geometry_t llama_geo = {
    .layers = 16, .kv_heads = 8, .head_dim = 64, .block_tokens = 16, .dtype = PKV_DTYPE_F16};

static pkv_kv_t *tp_pool(const pkv_geometry_t *g, uint32_t tp, uint64_t budget)
{
    pkv_kv_config_t cfg = {
        .geo = *g, .backend = PKV_BACKEND_PAGED, .budget_bytes = budget, .tp = tp};
    pkv_kv_t *kv = NULL;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    return kv;
}

static int32_t *iota_tokens(uint32_t n, int32_t base)
{
    int32_t *t = malloc(n * sizeof(int32_t));
    ck_assert_ptr_nonnull(t);
    for (uint32_t i = 0; i < n; i++) t[i] = base + (int32_t)i;
    return t;
}

static pkv_seq_t *seq_of(pkv_kv_t *kv, const int32_t *tok, uint32_t n, uint32_t reserve)
{
    pkv_seq_params_t p = {.tokens = tok, .n_tokens = n, .reserve_tokens = reserve};
    pkv_seq_t *s = NULL;
    ck_assert_int_eq(pkv_seq_create(kv, &p, &s, NULL), PKV_OK);
    return s;
}

/* pkv_kv_stats_t.huge_granules: 2 MiB pages can back a granule only where every range's
 * granule is a multiple of 2 MiB (512 KiB blocks, four to a granule, one range); not with
 * two ranks (1 MiB each), nor with 1.75 MiB blocks (qwen3-0.6b's bf16 geometry). */
START_TEST(huge_granules_says_when_2mib_pages_fit)
{
    pkv_geometry_t qwen = {
        .layers = 28, .kv_heads = 8, .head_dim = 128, .block_tokens = 16, .dtype = PKV_DTYPE_BF16};
    struct {
        pkv_geometry_t geo;
        uint32_t tp;
        bool fits;
    } cases[] = {{llama_geo, 1, true}, {llama_geo, 2, false}, {qwen, 1, false}};
    for (unsigned i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        pkv_kv_config_t cfg = {.geo = cases[i].geo,
                               .backend = PKV_BACKEND_PAGED,
                               .tp = cases[i].tp,
                               .budget_bytes = 64 << 20,
                               .hugepages = true};
        pkv_kv_t *kv = NULL;
        ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
        pkv_kv_stats_t st;
        pkv_kv_stats(kv, &st);
        ck_assert_msg(st.huge_granules == cases[i].fits, "case %u: granule %llu over %u ranges", i,
                      (unsigned long long)st.granule_bytes, st.storage_ranges);
        pkv_kv_destroy(kv);
    }
}
END_TEST

START_TEST(create_checks_tp)
{
    pkv_kv_config_t cfg = {.geo = llama_geo, .backend = PKV_BACKEND_PAGED, .tp = 3};
    pkv_kv_t *kv = NULL;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_ERR_INVALID);
    cfg.tp = 65;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_ERR_INVALID);
    cfg.tp = 2;
    cfg.backend = PKV_BACKEND_DENSE;
    cfg.budget_bytes = 64 << 20;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_ERR_UNSUPPORTED);
    cfg.tp = 1; /* dense: one rank, no range of its own */
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    ck_assert_uint_eq(pkv_kv_tp(kv), 1);
    pkv_kv_rank_t rk;
    ck_assert_int_eq(pkv_kv_rank(kv, 0, &rk), PKV_OK);
    ck_assert_uint_eq(rk.head_n, 8);
    ck_assert_ptr_null(rk.base);
    ck_assert_int_eq(pkv_kv_rank(kv, 1, &rk), PKV_ERR_INVALID);
    pkv_kv_destroy(kv);
    cfg.backend = PKV_BACKEND_PAGED;
    cfg.tp = 0; /* 0 -> 1 */
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
    ck_assert_uint_eq(pkv_kv_tp(kv), 1);
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    ck_assert_uint_eq(st.tp, 1);
    ck_assert_uint_eq(st.storage_ranges, 1);
    pkv_kv_destroy(kv);
    /* A budget below one granule over every rank cannot fit. */
    cfg.tp = 8;
    cfg.budget_bytes = 1 << 20;
    ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_ERR_NOFIT);
}
END_TEST

/* Every rank's range is its own; pieces are where they should be, for held heads only;
 * pkv_kv_block_head is the first holder; writes to one rank never show in another; the
 * ranks' committed bytes add up. */
static void ranks_isolated(const pkv_geometry_t *g, uint32_t tp)
{
    pkv_kv_t *kv = tp_pool(g, tp, 256ull << 20);
    ck_assert_uint_eq(pkv_kv_tp(kv), tp);
    int32_t *tok = iota_tokens(200, 7);
    pkv_seq_t *s = seq_of(kv, tok, 200, 200);
    const uint32_t *ids;
    uint32_t nb;
    ck_assert_int_eq(pkv_seq_blocks(s, &ids, &nb), PKV_OK);
    size_t row = pkv_dtype_row_bytes(g->dtype, g->head_dim), piece = g->block_tokens * row;
    pkv_kv_rank_t rk[PKV_KV_MAX_TP];
    uint64_t committed = 0;
    for (uint32_t r = 0; r < tp; r++) {
        ck_assert_int_eq(pkv_kv_rank(kv, r, &rk[r]), PKV_OK);
        uint32_t lo, n;
        pkv_kv_tp_heads(g->kv_heads, tp, r, &lo, &n);
        ck_assert_uint_eq(rk[r].head_lo, lo);
        ck_assert_uint_eq(rk[r].head_n, n);
        ck_assert_ptr_nonnull(rk[r].base);
        for (uint32_t q = 0; q < r; q++)
            ck_assert((uint8_t *)rk[r].base + rk[r].bytes <= (uint8_t *)rk[q].base ||
                      (uint8_t *)rk[q].base + rk[q].bytes <= (uint8_t *)rk[r].base);
        committed += rk[r].committed_bytes;
    }
    ck_assert_int_eq(pkv_kv_rank(kv, tp, &rk[0]), PKV_ERR_INVALID);
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    ck_assert_uint_eq(st.tp, tp);
    ck_assert_uint_eq(st.storage_ranges, tp);
    ck_assert_uint_eq(committed, st.committed_bytes);
    ck_assert_uint_gt(committed, 0);
    uint32_t copies = tp > g->kv_heads ? tp / g->kv_heads : 1;
    ck_assert_uint_eq(st.block_bytes, pkv_kv_block_bytes(kv) * copies);
    /* Each rank's pieces: in its range, NULL for heads it does not hold; tag them r + 1. */
    for (uint32_t r = 0; r < tp; r++) {
        uint8_t *lo_b = rk[r].base, *hi_b = lo_b + rk[r].bytes;
        for (uint32_t b = 0; b < nb; b++)
            for (uint32_t l = 0; l < g->layers; l++)
                for (uint32_t w = 0; w < 2; w++)
                    for (uint32_t h = 0; h < g->kv_heads; h++) {
                        uint8_t *p = pkv_kv_block_head_rank(kv, r, ids[b], l, w, h);
                        bool held = h >= rk[r].head_lo && h < rk[r].head_lo + rk[r].head_n;
                        if (!held) {
                            PKV_CHECK(p == NULL);
                            continue;
                        }
                        PKV_CHECK(p && p >= lo_b && p + piece <= hi_b);
                        memset(p, (int)(r + 1), piece);
                    }
    }
    /* Read back: every rank sees only its own tag; block_head is the first holder. */
    for (uint32_t r = 0; r < tp; r++)
        for (uint32_t b = 0; b < nb; b++)
            for (uint32_t l = 0; l < g->layers; l++)
                for (uint32_t w = 0; w < 2; w++)
                    for (uint32_t h = rk[r].head_lo; h < rk[r].head_lo + rk[r].head_n; h++) {
                        const uint8_t *p = pkv_kv_block_head_rank(kv, r, ids[b], l, w, h);
                        for (size_t i = 0; i < piece; i++) PKV_CHECK(p[i] == r + 1);
                        uint32_t first = tp <= g->kv_heads ? r : h * (tp / g->kv_heads);
                        PKV_CHECK(pkv_kv_block_head(kv, ids[b], l, w, h) ==
                                  pkv_kv_block_head_rank(kv, first, ids[b], l, w, h));
                    }
    /* Slots and runs of rank r point into rank r at its first head. */
    for (uint32_t r = 0; r < tp; r++) {
        void *k, *v;
        size_t hs;
        uint32_t L = g->layers - 1;
        pkv_seq_slot_rank(s, r, 37, L, &k, &v, &hs);
        uint8_t *pk = pkv_kv_block_head_rank(kv, r, ids[37 / g->block_tokens], L, 0, rk[r].head_lo);
        ck_assert_ptr_eq(k, pk + (37 % g->block_tokens) * row);
        pkv_kv_run_t run0[32], run[32];
        uint32_t n0 = pkv_seq_runs(s, L, 0, 200, run0, 32, NULL);
        uint32_t n = pkv_seq_runs_rank(s, r, L, 0, 200, run, 32, NULL);
        ck_assert_uint_eq(n, n0);
        for (uint32_t i = 0; i < n; i++) {
            ck_assert_uint_eq(run[i].pos, run0[i].pos);
            ck_assert_uint_eq(run[i].n_tokens, run0[i].n_tokens);
            ck_assert_uint_eq(run[i].head_stride, run0[i].head_stride);
            if (r == 0) ck_assert_ptr_eq(run[i].k, run0[i].k);
        }
    }
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    pkv_seq_free(s);
    free(tok);
    pkv_kv_destroy(kv);
}

START_TEST(ranks_have_their_own_ranges)
{
    for (uint32_t tp = 1; tp <= 8; tp *= 2) ranks_isolated(&llama_geo, tp);
    ranks_isolated(&llama_geo, 16); /* each head on two ranks */
    pkv_geometry_t tiny = {
        .layers = 2, .kv_heads = 2, .head_dim = 16, .block_tokens = 16, .dtype = PKV_DTYPE_BF16};
    ranks_isolated(&tiny, 4);
}
END_TEST

/* The same calls give the same block ids whatever the tp (one bookkeeping). */
START_TEST(same_block_ids_any_tp)
{
    int32_t *tok = iota_tokens(300, 1);
    pkv_kv_t *ref = tp_pool(&llama_geo, 1, 0);
    pkv_seq_t *a = seq_of(ref, tok, 300, 333), *b = seq_of(ref, tok, 150, 0);
    const uint32_t *ia, *ib;
    uint32_t na, nb;
    ck_assert_int_eq(pkv_seq_blocks(a, &ia, &na), PKV_OK);
    ck_assert_int_eq(pkv_seq_blocks(b, &ib, &nb), PKV_OK);
    for (uint32_t tp = 2; tp <= 8; tp *= 2) {
        pkv_kv_t *kv = tp_pool(&llama_geo, tp, 0);
        pkv_seq_t *x = seq_of(kv, tok, 300, 333), *y = seq_of(kv, tok, 150, 0);
        const uint32_t *ix, *iy;
        uint32_t nx, ny;
        ck_assert_int_eq(pkv_seq_blocks(x, &ix, &nx), PKV_OK);
        ck_assert_int_eq(pkv_seq_blocks(y, &iy, &ny), PKV_OK);
        ck_assert_uint_eq(nx, na);
        ck_assert_uint_eq(ny, nb);
        ck_assert(!memcmp(ix, ia, na * sizeof(uint32_t)));
        ck_assert(!memcmp(iy, ib, nb * sizeof(uint32_t)));
        pkv_kv_stats_t s1, st;
        pkv_kv_stats(ref, &s1);
        pkv_kv_stats(kv, &st);
        ck_assert_uint_eq(st.committed_bytes, s1.committed_bytes); /* 8 heads split: no copies */
        ck_assert_uint_eq(st.granule_bytes, s1.granule_bytes);
        pkv_seq_free(x);
        pkv_seq_free(y);
        pkv_kv_destroy(kv);
    }
    pkv_seq_free(a);
    pkv_seq_free(b);
    pkv_kv_destroy(ref);
    free(tok);
}
END_TEST

static double rel_diff(int64_t a, int64_t b)
{
    int64_t d = a - b;
    return (double)(d < 0 ? -d : d) / (double)(b < 0 ? -b : b);
}

/* The ranks' committed bytes are what the OS holds (VmRSS), growing and shrinking. */
static void rss_agrees(uint32_t tp)
{
    pkv_kv_t *kv = tp_pool(&llama_geo, tp, 1ull << 30);
    int32_t *tok = iota_tokens(2048, 0);
    pkv_seq_t *seqs[4];
    uint64_t rss0 = pkv_test_rss();
    pkv_kv_stats_t s0, s1, s2;
    pkv_kv_stats(kv, &s0);
    for (int i = 0; i < 4; i++) { /* 4 x 2048 tokens x 32 KiB = 256 MiB */
        tok[0] = i;
        seqs[i] = seq_of(kv, tok, 2048, 0);
    }
    uint64_t rss1 = pkv_test_rss();
    pkv_kv_stats(kv, &s1);
    int64_t dc = (int64_t)(s1.committed_bytes - s0.committed_bytes), dr = (int64_t)(rss1 - rss0);
    printf("tp %u growth: committed +%lld, VmRSS +%lld (%.3f%%)\n", tp, (long long)dc,
           (long long)dr, 100 * rel_diff(dr, dc));
    ck_assert_int_ge(dc, 256ll << 20);
    ck_assert(rel_diff(dr, dc) <= 0.02);
    uint64_t sum = 0;
    for (uint32_t r = 0; r < tp; r++) {
        pkv_kv_rank_t rk;
        ck_assert_int_eq(pkv_kv_rank(kv, r, &rk), PKV_OK);
        ck_assert_uint_eq(rk.committed_bytes, s1.committed_bytes / tp); /* equal shards */
        sum += rk.committed_bytes;
    }
    ck_assert_uint_eq(sum, s1.committed_bytes);
    for (int i = 0; i < 4; i++) pkv_seq_free(seqs[i]);
    pkv_kv_reset_cache(kv);
    uint64_t rss2 = pkv_test_rss();
    pkv_kv_stats(kv, &s2);
    dc = (int64_t)(s1.committed_bytes - s2.committed_bytes);
    dr = (int64_t)(rss1 - rss2);
    printf("tp %u shrink: committed -%lld, VmRSS -%lld (%.3f%%)\n", tp, (long long)dc,
           (long long)dr, 100 * rel_diff(dr, dc));
    ck_assert(rel_diff(dr, dc) <= 0.02);
    ck_assert_uint_le(s2.committed_bytes, s2.granule_bytes);
    free(tok);
    pkv_kv_destroy(kv);
}

START_TEST(committed_bytes_agree_with_vmrss)
{
    rss_agrees(4);
    rss_agrees(8);
}
END_TEST

/* A fork's shared partial block is copied on write in every rank. */
static void cow_all_ranks(const pkv_geometry_t *g, uint32_t tp)
{
    pkv_kv_t *kv = tp_pool(g, tp, 64ull << 20);
    size_t row = pkv_dtype_row_bytes(g->dtype, g->head_dim), piece = g->block_tokens * row;
    int32_t *tok = iota_tokens(40, 3);
    pkv_seq_t *p = seq_of(kv, tok, 40, 0); /* blocks 0, 1 full; block 2 holds 8 of 16 */
    const uint32_t *ids;
    uint32_t nb;
    ck_assert_int_eq(pkv_seq_blocks(p, &ids, &nb), PKV_OK);
    uint32_t old = ids[2];
    uint64_t fill = 0x1234;
    for (uint32_t r = 0; r < tp; r++) {
        pkv_kv_rank_t rk;
        ck_assert_int_eq(pkv_kv_rank(kv, r, &rk), PKV_OK);
        for (uint32_t l = 0; l < g->layers; l++)
            for (uint32_t w = 0; w < 2; w++)
                for (uint32_t h = rk.head_lo; h < rk.head_lo + rk.head_n; h++) {
                    uint8_t *pc = pkv_kv_block_head_rank(kv, r, old, l, w, h);
                    for (size_t i = 0; i < piece; i++) pc[i] = (uint8_t)pkv_test_rand(&fill);
                }
    }
    ck_assert_int_eq(pkv_seq_append(p, tok, 40), PKV_OK);
    pkv_seq_t *c;
    ck_assert_int_eq(pkv_seq_fork(p, &c), PKV_OK);
    ck_assert_int_eq(pkv_seq_reserve(c, 41), PKV_OK); /* copies the shared partial block */
    const uint32_t *cids;
    uint32_t cnb;
    ck_assert_int_eq(pkv_seq_blocks(c, &cids, &cnb), PKV_OK);
    ck_assert_uint_ne(cids[2], old);
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    ck_assert_uint_eq(st.cow_copies, 1);
    for (uint32_t r = 0; r < tp; r++) {
        pkv_kv_rank_t rk;
        ck_assert_int_eq(pkv_kv_rank(kv, r, &rk), PKV_OK);
        for (uint32_t l = 0; l < g->layers; l++)
            for (uint32_t w = 0; w < 2; w++)
                for (uint32_t h = rk.head_lo; h < rk.head_lo + rk.head_n; h++)
                    PKV_CHECK(!memcmp(pkv_kv_block_head_rank(kv, r, cids[2], l, w, h),
                                      pkv_kv_block_head_rank(kv, r, old, l, w, h), piece));
    }
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    pkv_seq_free(c);
    pkv_seq_free(p);
    free(tok);
    pkv_kv_destroy(kv);
}

START_TEST(cow_copies_every_rank)
{
    cow_all_ranks(&llama_geo, 4);
    cow_all_ranks(&llama_geo, 16);
}
END_TEST

/* ---- the model over the shards ------------------------------------------------------ */

#define DECODE_STEPS 4

typedef struct {
    pkv_kv_t *kv;
    pkv_seq_t *seq;
    float *logits;              /* (1 + DECODE_STEPS) x vocab: after the prompt, each step */
    int32_t toks[DECODE_STEPS]; /* greedy tokens */
} tp_run_t;

static int32_t argmax(const float *x, uint32_t n)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return (int32_t)best;
}

/* Prefill the prompt over a pool of tp ranks, then DECODE_STEPS greedy steps. */
static void tp_run(pkv_model_t *m, uint32_t tp, const int32_t *prompt, uint32_t n, tp_run_t *out)
{
    const pkv_model_config_t *c = pkv_model_config(m);
    pkv_geometry_t g;
    pkv_model_geometry(m, PKV_DTYPE_BF16, 16, &g);
    out->kv = tp_pool(&g, tp, 0);
    out->seq = seq_of(out->kv, prompt, n, n + DECODE_STEPS);
    out->logits = malloc((size_t)(1 + DECODE_STEPS) * c->vocab_size * sizeof(float));
    ck_assert_ptr_nonnull(out->logits);
    pkv_model_item_t it = {.seq = out->seq, .tokens = prompt, .n_tokens = n, .logits = out->logits};
    ck_assert_int_eq(pkv_model_forward(m, out->kv, &it, 1), PKV_OK);
    for (uint32_t s = 0; s < DECODE_STEPS; s++) {
        const float *last = out->logits + (size_t)s * c->vocab_size;
        out->toks[s] = argmax(last, c->vocab_size);
        it = (pkv_model_item_t){.seq = out->seq,
                                .tokens = &out->toks[s],
                                .n_tokens = 1,
                                .logits = out->logits + (size_t)(s + 1) * c->vocab_size};
        ck_assert_int_eq(pkv_model_forward(m, out->kv, &it, 1), PKV_OK);
    }
}

static void tp_run_free(tp_run_t *r)
{
    pkv_seq_free(r->seq);
    pkv_kv_destroy(r->kv);
    free(r->logits);
}

/* Every block, layer, K|V and held head of every rank equals the tp = 1 pool's piece. */
static void kv_slices_equal(const tp_run_t *ref, const tp_run_t *got, uint32_t tp)
{
    const pkv_geometry_t *g = pkv_kv_geometry(got->kv);
    size_t piece = (size_t)g->block_tokens * pkv_dtype_row_bytes(g->dtype, g->head_dim);
    const uint32_t *ia, *ib;
    uint32_t na, nb;
    ck_assert_int_eq(pkv_seq_blocks(ref->seq, &ia, &na), PKV_OK);
    ck_assert_int_eq(pkv_seq_blocks(got->seq, &ib, &nb), PKV_OK);
    ck_assert_uint_eq(na, nb);
    ck_assert(!memcmp(ia, ib, na * sizeof(uint32_t))); /* same ids whatever the tp */
    uint64_t compared = 0;
    for (uint32_t r = 0; r < tp; r++) {
        pkv_kv_rank_t rk;
        ck_assert_int_eq(pkv_kv_rank(got->kv, r, &rk), PKV_OK);
        for (uint32_t b = 0; b < nb; b++)
            for (uint32_t l = 0; l < g->layers; l++)
                for (uint32_t w = 0; w < 2; w++)
                    for (uint32_t h = rk.head_lo; h < rk.head_lo + rk.head_n; h++) {
                        const void *x = pkv_kv_block_head(ref->kv, ia[b], l, w, h);
                        const void *y = pkv_kv_block_head_rank(got->kv, r, ib[b], l, w, h);
                        if (!x || !y || memcmp(x, y, piece))
                            ck_abort_msg("tp %u rank %u block %u layer %u %s head %u differs", tp,
                                         r, b, l, w ? "V" : "K", h);
                        compared++;
                    }
    }
    uint32_t copies = tp > g->kv_heads ? tp / g->kv_heads : 1;
    ck_assert_uint_eq(compared, (uint64_t)nb * g->layers * 2 * g->kv_heads * copies);
}

static void model_parity(const char *preset, const uint32_t *tps, uint32_t ntp, uint32_t n_prompt,
                         uint32_t threads, bool portable)
{
    pkv_model_config_t c;
    ck_assert_int_eq(pkv_model_preset(preset, &c), PKV_OK);
    c.vocab_size = 512;
    pkv_model_runtime_t rt = {.threads = threads, .chunk_tokens = 24, .portable = portable};
    pkv_model_t *m;
    ck_assert_int_eq(pkv_model_create_builtin(&c, 11, &rt, &m), PKV_OK);
    uint64_t rs = pkv_test_seed(0x7b);
    int32_t *prompt = malloc(n_prompt * sizeof(int32_t));
    for (uint32_t i = 0; i < n_prompt; i++) prompt[i] = (int32_t)pkv_test_below(&rs, 512);
    tp_run_t ref, got;
    tp_run(m, 1, prompt, n_prompt, &ref);
    size_t bytes = (size_t)(1 + DECODE_STEPS) * c.vocab_size * sizeof(float);
    for (uint32_t i = 0; i < ntp; i++) {
        tp_run(m, tps[i], prompt, n_prompt, &got);
        ck_assert_msg(!memcmp(ref.logits, got.logits, bytes), "%s tp %u: logits differ", preset,
                      tps[i]);
        ck_assert_msg(!memcmp(ref.toks, got.toks, sizeof(ref.toks)), "%s tp %u: tokens differ",
                      preset, tps[i]);
        kv_slices_equal(&ref, &got, tps[i]);
        ck_assert_int_eq(pkv_kv_validate(got.kv), PKV_OK);
        printf("%s tp %u: %u prompt tokens + %u greedy steps bitwise equal to tp 1 (%s, %u "
               "threads)\n",
               preset, tps[i], n_prompt, DECODE_STEPS, pkv_model_kernels(m), threads);
        tp_run_free(&got);
    }
    tp_run_free(&ref);
    free(prompt);
    pkv_model_destroy(m);
}

START_TEST(model_llama_tp_equals_tp1)
{
    static const uint32_t tps[] = {1, 2, 4, 8};
    model_parity("llama-3.2-1b", tps, PKV_ARRAY_LEN(tps), 40, 2, false);
}
END_TEST

START_TEST(model_tiny_tp_equals_tp1)
{
    static const uint32_t tps[] = {1, 2, 4}; /* 4: each of the 2 heads on two ranks */
    model_parity("tiny", tps, PKV_ARRAY_LEN(tps), 70, 1, false);
    model_parity("tiny", tps, PKV_ARRAY_LEN(tps), 70, 3, false);
    model_parity("tiny", tps, PKV_ARRAY_LEN(tps), 70, 2, true);
}
END_TEST

static Suite *tp_suite(void)
{
    Suite *s = suite_create("tp");
    TCase *tc = tcase_create("degree");
    tcase_add_test(tc, tp_check_accepts_divisors_and_multiples);
    tcase_add_test(tc, tp_heads_split_and_replicate);
    suite_add_tcase(s, tc);
    tc = tcase_create("pool");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, create_checks_tp);
    tcase_add_test(tc, huge_granules_says_when_2mib_pages_fit);
    tcase_add_test(tc, ranks_have_their_own_ranges);
    tcase_add_test(tc, same_block_ids_any_tp);
    tcase_add_test(tc, committed_bytes_agree_with_vmrss);
    tcase_add_test(tc, cow_copies_every_rank);
    suite_add_tcase(s, tc);
    tc = tcase_create("model");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, model_llama_tp_equals_tp1);
    tcase_add_test(tc, model_tiny_tp_equals_tp1);
    suite_add_tcase(s, tc);
    return s;
}

PKV_TEST_MAIN(tp_suite)
