/*
 * pagekv bench pool: the KV pool's own costs on llama-3.2-1b's KV geometry
 * (16 layers, 8 KV heads, head dim 64, f16, 16-token blocks: 512 KiB blocks).
 *
 *   alloc_free_ns_median      one block allocated and freed (pool lock, densest-granule
 *                             pick, free-list push), median of batches of 1000 pairs
 *   prefix_hash_ns_per_token  chained SHA-256 prefix keys over a 4096-token prompt
 *   commit_s_per_gib          admitting a 1 GiB prompt into a fresh pool (granule commit
 *                             with MADV_POPULATE_WRITE)
 *   growth_peak_over_final    one 32k-token sequence grown token by token:
 *                             (peak VmRSS - final VmRSS) / final VmRSS, paged and dense
 *   committed_after_reset_bytes  after freeing everything and resetting the prefix cache
 */
#include "support/cli.h"
#include "support/bench.h"
#include "tools/commands.h"

#include "kv/kv.h"
#include "prim/prim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const pkv_geometry_t llama = {
    .layers = 16, .kv_heads = 8, .head_dim = 64, .block_tokens = 16, .dtype = PKV_DTYPE_F16};

static int make_kv(pkv_backend_t b, uint64_t budget, pkv_kv_t **kv)
{
    pkv_kv_config_t cfg = {.geo = llama, .backend = b, .budget_bytes = budget};
    int rc = pkv_kv_create(&cfg, kv);
    if (rc) fprintf(stderr, "pagekv bench pool: kv create: %s\n", pkv_status_str(rc));
    return rc;
}

static double bench_alloc_free(int rounds)
{
    pkv_kv_t *kv;
    if (make_kv(PKV_BACKEND_PAGED, 0, &kv)) return -1;
    double *v = malloc((size_t)rounds * sizeof(double));
    uint32_t warm[64];
    pkv_kv_blocks_alloc(kv, 64, warm); /* some committed, partly used granules */
    pkv_kv_blocks_free(kv, warm, 32);
    for (int r = 0; r < rounds; r++) {
        uint64_t t0 = pkv_now_ns();
        for (int i = 0; i < 1000; i++) {
            uint32_t id;
            if (pkv_kv_blocks_alloc(kv, 1, &id) == 0) pkv_kv_blocks_free(kv, &id, 1);
        }
        v[r] = (double)(pkv_now_ns() - t0) / 1000.0;
    }
    pkv_kv_blocks_free(kv, warm + 32, 32);
    double m = pkv_bench_median(v, (size_t)rounds);
    free(v);
    pkv_kv_destroy(kv);
    return m;
}

static double bench_prefix_hash(int rounds)
{
    pkv_kv_t *kv;
    if (make_kv(PKV_BACKEND_PAGED, 0, &kv)) return -1;
    enum { N = 4096 };
    int32_t *tok = malloc(N * sizeof(int32_t));
    pkv_kv_key_t *keys = malloc(N / 16 * sizeof(pkv_kv_key_t));
    for (int i = 0; i < N; i++) tok[i] = i * 7 + 3;
    double *v = malloc((size_t)rounds * sizeof(double));
    for (int r = 0; r < rounds; r++) {
        uint64_t t0 = pkv_now_ns();
        uint32_t nb = pkv_kv_prefix_keys(kv, 42, tok, N, keys);
        v[r] = (double)(pkv_now_ns() - t0) / (nb * 16.0);
    }
    double m = pkv_bench_median(v, (size_t)rounds);
    free(v);
    free(keys);
    free(tok);
    pkv_kv_destroy(kv);
    return m;
}

static double bench_commit(int rounds)
{
    enum { N = 32768 }; /* 32768 tokens x 32 KiB = 1 GiB */
    int32_t *tok = calloc(N, sizeof(int32_t));
    double *v = malloc((size_t)rounds * sizeof(double));
    for (int r = 0; r < rounds; r++) {
        pkv_kv_t *kv;
        if (make_kv(PKV_BACKEND_PAGED, 0, &kv)) return -1;
        pkv_seq_t *s;
        pkv_seq_params_t p = {.tokens = tok, .n_tokens = N};
        uint64_t t0 = pkv_now_ns();
        int rc = pkv_seq_create(kv, &p, &s, NULL);
        double secs = (double)(pkv_now_ns() - t0) / 1e9;
        pkv_kv_stats_t st;
        pkv_kv_stats(kv, &st);
        v[r] = rc ? -1 : secs / ((double)st.committed_bytes / (1ull << 30));
        if (!rc) pkv_seq_free(s);
        pkv_kv_destroy(kv);
    }
    double m = pkv_bench_median(v, (size_t)rounds);
    free(v);
    free(tok);
    return m;
}

typedef struct {
    double peak_over_final;
    uint64_t peak_rss, final_rss, committed_peak, committed_after_reset, granule;
    uint32_t ranges;
} growth_t;

/* Grow one sequence token by token to 32k positions, writing each position's K/V. */
static int bench_growth(pkv_backend_t b, growth_t *g)
{
    enum { N = 32768 };
    pkv_kv_t *kv;
    if (make_kv(b, 0, &kv)) return -1;
    int32_t t = 1;
    pkv_seq_params_t p = {.tokens = &t, .n_tokens = 1};
    pkv_seq_t *s;
    if (pkv_seq_create(kv, &p, &s, NULL)) return -1;
    pkv_prim_hwm_reset();
    const pkv_geometry_t *geo = pkv_kv_geometry(kv);
    size_t row = pkv_dtype_row_bytes(geo->dtype, geo->head_dim);
    for (uint32_t pos = 0; pos < N; pos++) {
        if (pkv_seq_reserve(s, pos + 1)) return -1;
        for (uint32_t l = 0; l < geo->layers; l++) {
            void *k, *v;
            size_t hs;
            pkv_seq_slot(s, pos, l, &k, &v, &hs);
            for (uint32_t h = 0; h < geo->kv_heads; h++) {
                memset((char *)k + h * hs, (int)(pos + l), row);
                memset((char *)v + h * hs, (int)(pos + h), row);
            }
        }
        int32_t tok = (int32_t)pos;
        pkv_seq_append(s, &tok, 1);
    }
    g->peak_rss = pkv_bench_hwm();
    g->final_rss = pkv_bench_rss();
    g->peak_over_final = (double)(g->peak_rss - g->final_rss) / (double)g->final_rss;
    pkv_seq_free(s);
    pkv_kv_reset_cache(kv);
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    g->committed_peak = st.peak_committed_bytes;
    g->committed_after_reset = st.committed_bytes;
    g->granule = st.granule_bytes;
    g->ranges = st.storage_ranges;
    pkv_kv_destroy(kv);
    return 0;
}

int pkv_bench_pool(int argc, char **argv)
{
    const char *json = NULL;
    uint64_t rounds = 101;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json") && i + 1 < argc)
            json = argv[++i];
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
            if (pkv_cli_parse_u64(argv[++i], 3, 100000, &rounds))
                return pkv_cli_usage_error("bench pool", "--rounds takes 3..100000");
        } else if (!strcmp(argv[i], "--help")) {
            printf("usage: pagekv bench pool [--json FILE] [--rounds N]\n");
            return 0;
        } else {
            return pkv_cli_usage_error("bench pool", "unknown option '%s'", argv[i]);
        }
    }
    int r = (int)rounds;
    if (pkv_cli_progress_enabled()) fprintf(stderr, "bench pool: alloc/free...\r");
    double af = bench_alloc_free(r);
    if (pkv_cli_progress_enabled()) fprintf(stderr, "bench pool: prefix hashing...\r");
    double ph = bench_prefix_hash(r);
    if (pkv_cli_progress_enabled()) fprintf(stderr, "bench pool: commit...          \r");
    double cs = bench_commit(5);
    if (pkv_cli_progress_enabled()) fprintf(stderr, "bench pool: growth (paged)...  \r");
    growth_t gp, gd;
    if (bench_growth(PKV_BACKEND_PAGED, &gp)) return 1;
    if (pkv_cli_progress_enabled()) fprintf(stderr, "bench pool: growth (dense)...  \r");
    if (bench_growth(PKV_BACKEND_DENSE, &gd)) return 1;
    if (pkv_cli_progress_enabled()) fprintf(stderr, "%40s\r", "");

    printf("## pagekv bench pool (llama-3.2-1b KV: 16 layers, 8 KV heads, head dim 64, f16, "
           "16-token blocks)\n\n");
    printf("| metric | value | target |\n|---|---|---|\n");
    printf("| alloc_free_ns_median (%d batches of 1000) | %.1f | <= 50 |\n", r, af);
    printf("| prefix_hash_ns_per_token (SHA-256 chain, median of %d) | %.2f | <= 20 |\n", r, ph);
    printf("| commit_s_per_gib (median of 5) | %.3f | |\n", cs);
    printf("| growth_peak_over_final, paged (32k tokens) | %.4f | <= 0.01 |\n", gp.peak_over_final);
    printf("| growth_peak_over_final, dense (32k tokens) | %.4f | |\n", gd.peak_over_final);
    printf("| peak / final VmRSS, paged (MiB) | %.1f / %.1f | |\n", gp.peak_rss / 1048576.0,
           gp.final_rss / 1048576.0);
    printf("| peak / final VmRSS, dense (MiB) | %.1f / %.1f | |\n", gd.peak_rss / 1048576.0,
           gd.final_rss / 1048576.0);
    printf("| committed_after_reset_bytes | %llu | <= %llu (one granule per range) |\n",
           (unsigned long long)gp.committed_after_reset,
           (unsigned long long)gp.granule * gp.ranges);
    printf("| granule_bytes | %llu | |\n", (unsigned long long)gp.granule);
    printf("| storage_ranges | %u | |\n", gp.ranges);
    if (json) {
        json_t *o = json_pack(
            "{s:f, s:f, s:f, s:f, s:f, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "alloc_free_ns_median",
            af, "prefix_hash_ns_per_token", ph, "commit_s_per_gib", cs, "growth_peak_over_final",
            gp.peak_over_final, "growth_peak_over_final_dense", gd.peak_over_final,
            "committed_after_reset_bytes", (json_int_t)gp.committed_after_reset, "granule_bytes",
            (json_int_t)gp.granule, "storage_ranges", (json_int_t)gp.ranges,
            "growth_peak_rss_bytes", (json_int_t)gp.peak_rss, "growth_final_rss_bytes",
            (json_int_t)gp.final_rss, "growth_peak_rss_bytes_dense", (json_int_t)gd.peak_rss,
            "growth_final_rss_bytes_dense", (json_int_t)gd.final_rss);
        int rc = o ? pkv_bench_write_json(json, o) : -1;
        json_decref(o);
        if (rc) return 1;
    }
    return 0;
}
