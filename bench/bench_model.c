/*
 * pagekv bench model: prefill and decode speed of the built-in model over the paged and
 * the dense KV backend, side by side in one process.
 *
 *   cells: backend x context {512, 4096} x batch {1, 8}
 *     prefill tok/s   batch 1: one sequence prefilled from empty, median of --runs;
 *                     batch 8: eight sequences prefilled in one batched forward call
 *                     (measured once: it builds the contexts the decode cells use)
 *     decode tok/s    --decode-steps steps of one token per sequence over the prefilled
 *                     contexts (attention reads every position each step), median of
 *                     --decode-pairs pairs; in each pair the two backends run back to
 *                     back over contexts built once, which one goes first alternates
 *                     (this VM's speed drifts by tens of percent over minutes: only
 *                     close pairs compare like with like)
 *   decode_paged_over_dense_4096  median over pairs of (paged / dense) batch-8 decode
 *                                 speed at context 4096; target >= 0.95
 *   prefill_3700_llama_s          seconds to prefill a 3700-token prompt on the
 *                                 llama-3.2-1b preset, paged, median of --runs;
 *                                 target <= 10 (2 cores)
 *
 * --fast-fill builds the batch-8 decode contexts by prefilling one sequence and copying
 * its K/V bytes into the other seven (their own memory), skipping the batch-8 prefill
 * cell: a quicker way to repeat the decode comparison.
 *
 * The prefix cache is disabled (no_prefix_cache): every sequence computes and reads its
 * own K/V. Tokens are seeded random ids. The paged pool asks for transparent huge pages
 * on commit (its 2 MiB granules are huge-page aligned; --no-hugepages turns that off);
 * the dense baseline uses malloc/realloc as it does in the library (with THP in
 * "madvise" mode it gets 4 KiB pages unless GLIBC_TUNABLES=glibc.malloc.hugetlb=1).
 * Blocks hold 16 tokens (the pool's default; --block-tokens).
 */
#include "support/cli.h"
#include "support/bench.h"

#include "core/core.h"

#include "pagekv/model.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#define MAX_B     8
#define MAX_CTX   4
#define MAX_PAIRS 48

typedef struct {
    pkv_kv_t *kv;
    pkv_seq_t *seq[MAX_B];
    uint32_t n;
} ctx_state_t;

typedef struct {
    double prefill1[16], prefill8, decode1[MAX_PAIRS], decode8[MAX_PAIRS];
} cell_t;

/* CPU seconds of the whole process (every thread), from the OS. */
static double cpu_secs(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec * 1e-6;
}

static double secs(uint64_t t0)
{
    return (double)(pkv_now_ns() - t0) / 1e9;
}

static void progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void progress(const char *fmt, ...)
{
    if (!pkv_cli_progress_enabled()) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "\r%70s\r", "");
    vfprintf(stderr, fmt, ap);
    va_end(ap);
}

static bool use_thp = true;
static uint32_t block_tokens = 16;

static int make_kv(pkv_model_t *m, pkv_backend_t be, pkv_dtype_t dt, pkv_kv_t **out)
{
    pkv_kv_config_t kc = {.backend = be, .no_prefix_cache = true, .hugepages = use_thp};
    pkv_model_geometry(m, dt, block_tokens, &kc.geo);
    return pkv_kv_create(&kc, out);
}

/* Prefill n sequences of `len` tokens in one forward call; seconds, or < 0. */
static double prefill(pkv_model_t *m, pkv_kv_t *kv, uint32_t n, uint32_t len, uint32_t extra,
                      uint64_t seed, pkv_seq_t **seqs)
{
    uint32_t V = pkv_model_config(m)->vocab_size;
    int32_t *toks = malloc((size_t)n * len * sizeof(int32_t));
    float *logits = malloc((size_t)n * V * sizeof(float));
    pkv_model_item_t items[MAX_B];
    double t = -1;
    uint32_t made = 0;
    if (!toks || !logits) goto out;
    for (uint32_t i = 0; i < n; i++) {
        for (uint32_t j = 0; j < len; j++)
            toks[(size_t)i * len + j] = (int32_t)(pkv_splitmix64(&seed) % V);
        pkv_seq_params_t sp = {
            .tokens = toks + (size_t)i * len, .n_tokens = len, .reserve_tokens = len + extra};
        uint32_t cached;
        if (pkv_seq_create(kv, &sp, &seqs[i], &cached)) goto out;
        made++;
        items[i] = (pkv_model_item_t){.seq = seqs[i],
                                      .tokens = toks + (size_t)i * len,
                                      .n_tokens = len,
                                      .logits = logits + (size_t)i * V};
    }
    uint64_t t0 = pkv_now_ns();
    if (pkv_model_forward(m, kv, items, n) == PKV_OK) t = secs(t0);
out:
    if (t < 0)
        for (uint32_t i = 0; i < made; i++) pkv_seq_free(seqs[i]);
    free(toks);
    free(logits);
    return t;
}

/* --fast-fill: seqs[1..n) get the K/V bytes of seqs[0] (their own memory) and its
 * token ids, so decode reads n distinct contexts without n prefills. */
static int copy_contexts(pkv_model_t *m, pkv_kv_t *kv, pkv_seq_t **seqs, uint32_t n, uint32_t len,
                         uint32_t extra, uint64_t seed)
{
    const pkv_model_config_t *c = pkv_model_config(m);
    size_t es = pkv_dtype_size(pkv_kv_geometry(kv)->dtype), row = (size_t)c->head_dim * es;
    uint32_t V = c->vocab_size;
    int32_t *toks = malloc((size_t)len * sizeof(int32_t));
    if (!toks) return -1;
    for (uint32_t j = 0; j < len; j++) toks[j] = (int32_t)(pkv_splitmix64(&seed) % V);
    for (uint32_t i = 1; i < n; i++) {
        pkv_seq_params_t sp = {.tokens = toks, .n_tokens = len, .reserve_tokens = len + extra};
        uint32_t cached;
        if (pkv_seq_create(kv, &sp, &seqs[i], &cached)) {
            while (--i > 0) pkv_seq_free(seqs[i]);
            free(toks);
            return -1;
        }
        for (uint32_t p = 0; p < len; p++)
            for (uint32_t l = 0; l < c->n_layers; l++) {
                void *sk, *sv, *dk, *dv;
                size_t ss, ds;
                pkv_seq_slot(seqs[0], p, l, &sk, &sv, &ss);
                pkv_seq_slot(seqs[i], p, l, &dk, &dv, &ds);
                for (uint32_t h = 0; h < c->n_kv_heads; h++) {
                    memcpy((char *)dk + h * ds * es, (char *)sk + h * ss * es, row);
                    memcpy((char *)dv + h * ds * es, (char *)sv + h * ss * es, row);
                }
            }
        pkv_seq_append(seqs[i], toks, len);
    }
    free(toks);
    return 0;
}

/* `steps` decode steps over n sequences (greedy); seconds, or < 0. */
static double decode(pkv_model_t *m, pkv_kv_t *kv, pkv_seq_t **seqs, uint32_t n, uint32_t steps)
{
    uint32_t V = pkv_model_config(m)->vocab_size;
    float *logits = malloc((size_t)n * V * sizeof(float));
    int32_t next[MAX_B];
    pkv_model_item_t items[MAX_B];
    if (!logits) return -1;
    for (uint32_t i = 0; i < n; i++) next[i] = (int32_t)(i * 7 % V);
    double t = -1;
    uint64_t t0 = pkv_now_ns();
    for (uint32_t s = 0; s < steps; s++) {
        for (uint32_t i = 0; i < n; i++) {
            if (pkv_seq_reserve(seqs[i], pkv_seq_length(seqs[i]) + 1)) goto out;
            items[i] = (pkv_model_item_t){.seq = seqs[i],
                                          .tokens = &next[i],
                                          .n_tokens = 1,
                                          .logits = logits + (size_t)i * V};
        }
        if (pkv_model_forward(m, kv, items, n)) goto out;
        for (uint32_t i = 0; i < n; i++) {
            const float *l = logits + (size_t)i * V;
            uint32_t best = 0;
            for (uint32_t v = 1; v < V; v++)
                if (l[v] > l[best]) best = v;
            next[i] = (int32_t)best;
        }
    }
    t = secs(t0);
out:
    free(logits);
    return t;
}

static int parse_list(const char *s, uint32_t *out, uint32_t max, uint32_t lo, uint32_t hi)
{
    uint32_t n = 0;
    char buf[128];
    snprintf(buf, sizeof(buf), "%s", s);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        uint64_t v;
        if (n == max || pkv_cli_parse_u64(tok, lo, hi, &v)) return -1;
        out[n++] = (uint32_t)v;
    }
    return n ? (int)n : -1;
}

static double loadavg1(void)
{
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1) l = -1;
        fclose(f);
    }
    return l;
}

int pkv_bench_model(int argc, char **argv)
{
    const char *json = NULL, *preset = "llama-3.2-1b";
    uint64_t runs = 3, steps = 16, threads = 0, pairs = 9;
    pkv_dtype_t dt = PKV_DTYPE_BF16;
    uint32_t ctxs[MAX_CTX] = {512, 4096};
    int n_ctx = 2;
    bool do8 = true, fast_fill = false;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--json") && v)
            json = argv[++i];
        else if (!strcmp(argv[i], "--preset") && v)
            preset = argv[++i];
        else if (!strcmp(argv[i], "--runs") && v) {
            if (pkv_cli_parse_u64(argv[++i], 1, 16, &runs))
                return pkv_cli_usage_error("bench model", "--runs: 1..16");
        } else if (!strcmp(argv[i], "--decode-pairs") && v) {
            if (pkv_cli_parse_u64(argv[++i], 1, MAX_PAIRS, &pairs))
                return pkv_cli_usage_error("bench model", "--decode-pairs: 1..48");
        } else if (!strcmp(argv[i], "--decode-steps") && v) {
            if (pkv_cli_parse_u64(argv[++i], 1, 4096, &steps))
                return pkv_cli_usage_error("bench model", "--decode-steps: 1..4096");
        } else if (!strcmp(argv[i], "--threads") && v) {
            if (pkv_cli_parse_u64(argv[++i], 1, 64, &threads))
                return pkv_cli_usage_error("bench model", "--threads: 1..64");
        } else if (!strcmp(argv[i], "--dtype") && v) {
            if (pkv_dtype_parse(argv[++i], &dt))
                return pkv_cli_usage_error("bench model", "--dtype: f32, f16 or bf16");
        } else if (!strcmp(argv[i], "--contexts") && v) {
            if ((n_ctx = parse_list(argv[++i], ctxs, MAX_CTX, 16, 32000)) < 0)
                return pkv_cli_usage_error("bench model", "--contexts: e.g. 512,4096");
        } else if (!strcmp(argv[i], "--no-batch8")) {
            do8 = false;
        } else if (!strcmp(argv[i], "--fast-fill")) {
            fast_fill = true;
        } else if (!strcmp(argv[i], "--no-hugepages")) {
            use_thp = false;
        } else if (!strcmp(argv[i], "--block-tokens") && v) {
            uint64_t bt;
            if (pkv_cli_parse_u64(argv[++i], 1, 4096, &bt))
                return pkv_cli_usage_error("bench model", "--block-tokens: 1..4096");
            block_tokens = (uint32_t)bt;
        } else {
            printf("usage: pagekv bench model [--json FILE] [--preset NAME] [--runs N]\n"
                   "         [--decode-pairs N] [--decode-steps N] [--threads N] [--dtype bf16] "
                   "[--contexts 512,4096] [--no-batch8]\n"
                   "         [--block-tokens N] [--no-hugepages] [--fast-fill]\n");
            return strcmp(argv[i], "--help") ? 2 : 0;
        }
    }
    pkv_model_config_t mc, lc;
    if (pkv_model_preset(preset, &mc))
        return pkv_cli_usage_error("bench model", "unknown preset '%s'", preset);
    mc.vocab_size = lc.vocab_size = 16384; /* the built-in tokenizer's vocabulary */
    pkv_model_preset("llama-3.2-1b", &lc);
    lc.vocab_size = 16384;
    pkv_model_runtime_t rt = {.threads = (uint32_t)threads};
    pkv_model_t *m = NULL, *llama = NULL;
    int rc = 1;
    if (pkv_model_create_builtin(&mc, 1, &rt, &m)) goto out;
    llama = strcmp(preset, "llama-3.2-1b") ? NULL : m;
    if (!llama && pkv_model_create_builtin(&lc, 1, &rt, &llama)) goto out;

    static cell_t cells[2][MAX_CTX];
    double ratio4096[MAX_PAIRS] = {0}, ratio_ctx[MAX_CTX][MAX_PAIRS];
    double p3700[2][16], p3700cpu[2][16];
    double load0 = loadavg1();
    uint32_t B = do8 ? 8 : 1;
    for (int c = 0; c < n_ctx; c++) {
        ctx_state_t st[2] = {0};
        uint32_t C = ctxs[c];
        /* Contexts for decode: batch-8 prefill, once per backend. */
        for (int be = 0; be < 2; be++) {
            progress("bench model: %s prefill %u x %u tokens...", pkv_backend_name(be), B, C);
            if (make_kv(m, be, dt, &st[be].kv)) goto fail_ctx;
            uint32_t extra = (uint32_t)(2 * pairs * steps + 4);
            double t = prefill(m, st[be].kv, fast_fill ? 1 : B, C, extra, 7, st[be].seq);
            if (t < 0) goto fail_ctx;
            st[be].n = 1;
            if (fast_fill && B > 1 && copy_contexts(m, st[be].kv, st[be].seq, B, C, extra, 8))
                goto fail_ctx;
            st[be].n = B;
            cells[be][c].prefill8 = do8 && !fast_fill ? (double)B * C / t : 0;
        }
        for (uint64_t r = 0; r < pairs; r++) {
            for (int k = 0; k < 2; k++) {
                int be = (int)(r & 1) ^ k; /* odd pairs: dense first */
                progress("bench model: %s decode at %u, pair %u...", pkv_backend_name(be), C,
                         (unsigned)r + 1);
                double t8 = do8 ? decode(m, st[be].kv, st[be].seq, 8, (uint32_t)steps) : 1;
                double t1 = decode(m, st[be].kv, st[be].seq, 1, (uint32_t)steps);
                if (t8 < 0 || t1 < 0) goto fail_ctx;
                cells[be][c].decode8[r] = do8 ? 8.0 * steps / t8 : 0;
                cells[be][c].decode1[r] = (double)steps / t1;
            }
            ratio_ctx[c][r] = do8 ? cells[0][c].decode8[r] / cells[1][c].decode8[r]
                                  : cells[0][c].decode1[r] / cells[1][c].decode1[r];
            if (C == 4096) ratio4096[r] = ratio_ctx[c][r];
        }
        for (int be = 0; be < 2; be++) {
            for (uint32_t i = 0; i < st[be].n; i++) pkv_seq_free(st[be].seq[i]);
            pkv_kv_destroy(st[be].kv);
            st[be] = (ctx_state_t){0};
        }
        /* Batch-1 prefill from empty, alternating backends. */
        for (uint64_t r = 0; r < runs; r++) {
            for (int be = 0; be < 2; be++) {
                progress("bench model: %s prefill %u tokens, run %u...", pkv_backend_name(be), C,
                         (unsigned)r + 1);
                pkv_kv_t *kv;
                pkv_seq_t *s;
                if (make_kv(m, be, dt, &kv)) goto fail;
                double t = prefill(m, kv, 1, C, 0, 100 + r, &s);
                if (t < 0) {
                    pkv_kv_destroy(kv);
                    goto fail;
                }
                pkv_seq_free(s);
                pkv_kv_destroy(kv);
                cells[be][c].prefill1[r] = C / t;
            }
        }
        continue;
    fail_ctx:
        for (int be = 0; be < 2; be++) {
            for (uint32_t i = 0; i < st[be].n; i++) pkv_seq_free(st[be].seq[i]);
            pkv_kv_destroy(st[be].kv);
        }
        goto fail;
    }
    for (uint64_t r = 0; r < runs; r++) {
        for (int be = 0; be < 2; be++) {
            progress("bench model: %s prefill 3700 (llama-3.2-1b), run %u...", pkv_backend_name(be),
                     (unsigned)r + 1);
            pkv_kv_t *kv;
            pkv_seq_t *s;
            if (make_kv(llama, be, dt, &kv)) goto fail;
            double c0 = cpu_secs();
            double t = prefill(llama, kv, 1, 3700, 0, 200 + r, &s);
            p3700cpu[be][r] = cpu_secs() - c0;
            if (t < 0) {
                pkv_kv_destroy(kv);
                goto fail;
            }
            pkv_seq_free(s);
            pkv_kv_destroy(kv);
            p3700[be][r] = t;
        }
    }
    if (pkv_cli_progress_enabled()) fprintf(stderr, "\r%70s\r", "");

    double load1 = loadavg1();
    const pkv_model_config_t *c0 = pkv_model_config(m);
    printf("pagekv bench model: preset %s (%u layers, %u KV heads x %u, %u query heads, dim %u, "
           "hidden %u, vocab %u), KV %s, kernels %s, %u threads, %llu runs, %llu decode steps; "
           "load average %.2f -> %.2f\n\n",
           preset, c0->n_layers, c0->n_kv_heads, c0->head_dim, c0->n_heads, c0->dim, c0->hidden_dim,
           c0->vocab_size, pkv_dtype_name(dt), pkv_model_kernels(m), pkv_model_threads(m),
           (unsigned long long)runs, (unsigned long long)steps, load0, load1);
    printf("| backend | context | batch | prefill tok/s | decode tok/s |\n|---|---|---|---|---|\n");
    json_t *jcells = json_array();
    for (int c = 0; c < n_ctx; c++) {
        for (int b = 0; b < (do8 ? 2 : 1); b++) {
            for (int be = 0; be < 2; be++) {
                cell_t *cl = &cells[be][c];
                double pf = b ? cl->prefill8 : pkv_bench_median(cl->prefill1, runs);
                double dc = pkv_bench_median(b ? cl->decode8 : cl->decode1, pairs);
                if (b && fast_fill)
                    printf("| %s | %u | 8 | - (--fast-fill) | %.1f |\n", pkv_backend_name(be),
                           ctxs[c], dc);
                else
                    printf("| %s | %u | %d | %.0f%s | %.1f |\n", pkv_backend_name(be), ctxs[c],
                           b ? 8 : 1, pf, b ? " (1 run)" : "", dc);
                json_array_append_new(jcells, json_pack("{s:s, s:i, s:i, s:f, s:f}", "backend",
                                                        pkv_backend_name(be), "context",
                                                        (int)ctxs[c], "batch", b ? 8 : 1,
                                                        "prefill_tok_s", pf, "decode_tok_s", dc));
            }
        }
    }
    double r4096 = 0;
    bool have4096 = false;
    for (int c = 0; c < n_ctx; c++) have4096 |= ctxs[c] == 4096;
    if (have4096) r4096 = pkv_bench_median(ratio4096, pairs);
    double p_paged = pkv_bench_median(p3700[0], runs), p_dense = pkv_bench_median(p3700[1], runs);
    printf("\n| metric | value | target |\n|---|---|---|\n");
    if (have4096)
        printf("| decode_paged_over_dense_4096 (batch %u, median of %llu pairs) | %.3f | >= "
               "0.95 |\n",
               B, (unsigned long long)pairs, r4096);
    for (int c = 0; c < n_ctx; c++)
        if (ctxs[c] != 4096)
            printf("| decode_paged_over_dense_%u (batch %u) | %.3f | |\n", ctxs[c], B,
                   pkv_bench_median(ratio_ctx[c], pairs));
    printf("| prefill_3700_llama_s (paged, median of %llu) | %.2f | <= 10 |\n",
           (unsigned long long)runs, p_paged);
    printf("| prefill_3700_llama_s, dense | %.2f | |\n", p_dense);
    double pc_paged = pkv_bench_median(p3700cpu[0], runs),
           pc_dense = pkv_bench_median(p3700cpu[1], runs);
    printf("| prefill_3700 CPU seconds (all threads; OS accounting), paged / dense | %.2f / %.2f "
           "| |\n",
           pc_paged, pc_dense);
    if (json) {
        json_t *o = json_pack(
            "{s:s, s:s, s:s, s:i, s:i, s:i, s:o, s:f, s:f, s:f, s:f}", "bench", "model", "preset",
            preset, "dtype", pkv_dtype_name(dt), "threads", (int)pkv_model_threads(m), "runs",
            (int)runs, "decode_steps", (int)steps, "cells", jcells, "prefill_3700_llama_s", p_paged,
            "prefill_3700_llama_s_dense", p_dense, "loadavg_before", load0, "loadavg_after", load1);
        if (have4096) {
            json_object_set_new(o, "decode_paged_over_dense_4096", json_real(r4096));
            json_t *pr = json_array();
            for (uint64_t r = 0; r < pairs; r++) json_array_append_new(pr, json_real(ratio4096[r]));
            json_object_set_new(o, "decode_paged_over_dense_4096_pairs", pr);
        }
        json_object_set_new(o, "decode_pairs", json_integer((json_int_t)pairs));
        json_object_set_new(o, "kernels", json_string(pkv_model_kernels(m)));
        json_object_set_new(o, "block_tokens", json_integer(block_tokens));
        json_object_set_new(o, "prefill_3700_llama_cpu_s", json_real(pc_paged));
        json_object_set_new(o, "prefill_3700_llama_cpu_s_dense", json_real(pc_dense));
        json_object_set_new(o, "paged_hugepages", json_boolean(use_thp));
        rc = pkv_bench_write_json(json, o) ? 1 : 0;
        json_decref(o);
    } else {
        json_decref(jcells);
        rc = 0;
    }
    goto out;
fail:
    fprintf(stderr, "pagekv bench model: failed (out of memory?)\n");
out:
    if (llama != m) pkv_model_destroy(llama);
    pkv_model_destroy(m);
    return rc;
}
