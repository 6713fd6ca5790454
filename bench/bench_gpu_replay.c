/*
 * bench gpu: the footprint replay (bench_gpu.h). The footprint bench drives a server with
 * chat requests; here the same demand is replayed on the pool directly (the model does not
 * run on the device), token for token: what the pool commits depends only on which
 * sequences hold which prompt blocks when.
 * - shared_prefix_burst: a warm-up request of a 3700-token shared prefix and a 30-token
 *   question generating 8 tokens, then 8 requests of the same prefix and their own
 *   questions at once, each generating 128 tokens. Target (the footprint bench's): KV
 *   committed at the peak <= 1.05 x the live blocks' bytes + one granule per range.
 * - churn: 32 requests one after another, each a 500-token prompt of its own generating 32,
 *   under a 64 MiB budget (the footprint bench's 2048 tokens), with a 1 s idle time-to-live;
 *   then the idle time passes (pkv_kv_trim) and the storage's spares are trimmed. Targets:
 *   committed <= the budget throughout; after the idle time <= one granule per range.
 */
#include "bench/bench_gpu.h"

#include "core/core.h"
#include "pagekv/kv.h"

#include <math.h>
#include <stdlib.h>

#define RP_PREFIX   3700u
#define RP_QUESTION 30u

static const pkv_geometry_t rp_geo = {16, 8, 64, 16, PKV_DTYPE_BF16}; /* llama-3.2-1b */

static double mib(uint64_t b)
{
    return (double)b / 1048576.0;
}

/* The driver against the storage's created bytes (pkv_gpu_driver_gap), worst kept in
 * *worst (a failed read counts as the worst). */
static void rp_driver(pkv_gpu_t *g, pkv_gpu_kv_storage_t *ks, uint64_t free0, double *worst)
{
    if (!g || !ks) return;
    pkv_gpu_arena_stats_t st;
    pkv_gpu_kv_storage_stats(ks, &st);
    double gap = pkv_gpu_driver_gap(g, free0, &st);
    if (!(gap <= *worst)) *worst = isnan(gap) ? INFINITY : gap;
}

/* A request: create (adopting what the cache holds), reserve for the prompt and its
 * generation, record the prompt's positions. */
static int rp_admit(pkv_kv_t *kv, const int32_t *tok, uint32_t n, uint32_t gen, pkv_seq_t **s)
{
    pkv_seq_params_t p = {.tokens = tok, .n_tokens = n, .reserve_tokens = n + gen};
    uint32_t cached = 0;
    int rc = pkv_seq_create(kv, &p, s, &cached);
    if (!rc) rc = pkv_seq_append(*s, tok + cached, n - cached);
    return rc;
}

/* Generate: one token a step for each sequence, interleaved (a decode batch). */
static int rp_decode(pkv_seq_t **s, uint32_t n, uint32_t steps)
{
    int rc = PKV_OK;
    for (uint32_t t = 0; t < steps && !rc; t++)
        for (uint32_t i = 0; i < n && !rc; i++) {
            int32_t id = (int32_t)(900000 + i * 1000 + t);
            rc = pkv_seq_append(s[i], &id, 1);
        }
    return rc;
}

static int rp_burst(pkv_gpu_t *g, pkv_gpu_kv_storage_t *ks, uint64_t free0, bg_replay_t *r)
{
    pkv_kv_config_t cfg = {.geo = rp_geo,
                           .storage = ks ? pkv_gpu_kv_storage(ks) : NULL,
                           .reserve_bytes = 4ull << 30,
                           .hugepages = !ks};
    pkv_kv_t *kv = NULL;
    pkv_seq_t *s[9] = {0};
    int32_t *tok = malloc((RP_PREFIX + RP_QUESTION) * sizeof(int32_t));
    int rc = tok ? pkv_kv_create(&cfg, &kv) : PKV_ERR_NOMEM;
    for (uint32_t i = 0; i < RP_PREFIX && !rc; i++) tok[i] = (int32_t)(1 + i);
    for (uint32_t q = 0; q < 9 && !rc; q++) {
        for (uint32_t j = 0; j < RP_QUESTION; j++)
            tok[RP_PREFIX + j] = (int32_t)(500000 + q * 100 + j);
        rc = rp_admit(kv, tok, RP_PREFIX + RP_QUESTION, q ? 128 : 8, &s[q]);
        if (!rc && q == 0) { /* the warm-up runs alone and ends */
            rc = rp_decode(&s[0], 1, 8);
            pkv_seq_free(s[0]);
            s[0] = NULL;
        }
    }
    if (!rc) rc = rp_decode(s + 1, 8, 128);
    if (!rc) {
        pkv_kv_stats_t st;
        pkv_kv_stats(kv, &st);
        r->kv_min_mib = mib(st.blocks_live * st.block_bytes);
        r->committed_peak_mib = mib(st.peak_committed_bytes);
        r->bound_mib = 1.05 * r->kv_min_mib + mib(st.granule_bytes);
        r->burst_met = r->committed_peak_mib <= r->bound_mib;
        rp_driver(g, ks, free0, &r->worst_driver);
    }
    for (uint32_t i = 0; i < 9; i++) pkv_seq_free(s[i]);
    pkv_kv_destroy(kv);
    free(tok);
    return rc;
}

static int rp_churn(pkv_gpu_t *g, pkv_gpu_kv_storage_t *ks, uint64_t free0, bg_replay_t *r)
{
    const uint32_t n = 500;
    pkv_kv_config_t cfg = {.geo = rp_geo,
                           .storage = ks ? pkv_gpu_kv_storage(ks) : NULL,
                           .budget_bytes = 64ull << 20,
                           .cache_idle_ms = 1000,
                           .hugepages = !ks};
    pkv_kv_t *kv = NULL;
    int32_t tok[500];
    int rc = pkv_kv_create(&cfg, &kv);
    uint64_t peak = 0;
    for (uint32_t q = 0; q < 32 && !rc; q++) {
        pkv_seq_t *s = NULL;
        for (uint32_t j = 0; j < n; j++) tok[j] = (int32_t)(1000000 + q * 1000 + j);
        rc = rp_admit(kv, tok, n, 32, &s);
        if (!rc) rc = rp_decode(&s, 1, 32);
        pkv_seq_free(s);
    }
    if (!rc) {
        pkv_kv_stats_t st;
        pkv_kv_stats(kv, &st);
        peak = st.peak_committed_bytes;
        rp_driver(g, ks, free0, &r->worst_driver);
        pkv_kv_trim(kv, pkv_now_ns() + 2000000000ull, NULL); /* the idle time has passed */
        if (ks) pkv_gpu_kv_storage_trim(ks);
        pkv_kv_stats(kv, &st);
        r->budget_mib = mib(st.budget_bytes);
        r->churn_peak_mib = mib(peak);
        r->idle_mib = mib(st.committed_bytes);
        r->granule_mib = mib(st.granule_bytes);
        r->idle_met = st.committed_bytes <= st.granule_bytes;
        rp_driver(g, ks, free0, &r->worst_driver);
    }
    pkv_kv_destroy(kv);
    return rc;
}

int bg_replay(pkv_gpu_t *g, pkv_gpu_kv_storage_t *ks, FILE *json, bg_replay_t *out)
{
    *out = (bg_replay_t){.worst_driver = g && ks ? 0 : -1};
    uint64_t free0 = 0, total;
    if (g && ks && pkv_gpu_mem_info(g, &free0, &total)) return PKV_ERR_IO;
    int rc = rp_burst(g, ks, free0, out);
    if (!rc) rc = rp_churn(g, ks, free0, out);
    if (rc) {
        printf("footprint replay: failed (%s)\n", pkv_status_str(rc));
        return rc;
    }
    printf("\nfootprint replay on the %s pool (llama-3.2-1b KV, bf16):\n"
           "- shared_prefix_burst: committed peak %.1f MiB, live blocks %.1f MiB, bound (1.05 x "
           "+ a granule) %.1f MiB: %s\n"
           "- churn: committed peak %.1f MiB (the pool holds its %.1f MiB budget); after the "
           "idle time %.1f MiB (a granule: %.1f MiB): %s\n",
           ks ? "device" : "host", out->committed_peak_mib, out->kv_min_mib, out->bound_mib,
           out->burst_met ? "met" : "NOT met", out->churn_peak_mib, out->budget_mib, out->idle_mib,
           out->granule_mib, out->idle_met ? "met" : "NOT met");
    if (out->worst_driver >= 0)
        printf("- the driver's used memory against the storage's counters: worst %.2f x the "
               "allowance (2 %% or a granule)\n",
               out->worst_driver);
    if (json)
        fprintf(json,
                "\n  \"replay\": {\"kv_min_mib\": %.2f, \"committed_peak_mib\": %.2f, "
                "\"bound_mib\": %.2f, \"budget_mib\": %.2f, \"churn_peak_mib\": %.2f, "
                "\"idle_mib\": %.2f, \"granule_mib\": %.2f, \"worst_driver\": %.4f},",
                out->kv_min_mib, out->committed_peak_mib, out->bound_mib, out->budget_mib,
                out->churn_peak_mib, out->idle_mib, out->granule_mib, out->worst_driver);
    return PKV_OK;
}
