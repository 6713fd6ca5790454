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
 * cell, and the long and mixed cases' contexts by writing a fixed pseudo-random K/V
 * pattern instead of prefilling (the prefix still adopted from the cache): a quicker way
 * to repeat the decode comparison.
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
#include "tools/commands.h"
#include "bench/bench_model.h"

#include "core/core.h"
#include "kv/kv.h"
#include "prim/prim.h"

#include "pagekv/model.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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
/* --null: the second side ("dense" in the tables) is a second paged pool, so the pairs
 * compare two identical backends and show what the instrument reads at parity. */
static bool null_pairs = false;
static uint32_t block_tokens = 16;

static int make_kv_cache(pkv_model_t *m, pkv_backend_t be, pkv_dtype_t dt, bool prefix_cache,
                         pkv_kv_t **out)
{
    pkv_kv_config_t kc = {.backend = null_pairs ? PKV_BACKEND_PAGED : be,
                          .no_prefix_cache = !prefix_cache,
                          .hugepages = use_thp};
    pkv_model_geometry(m, dt, block_tokens, &kc.geo);
    return pkv_kv_create(&kc, out);
}

static int make_kv(pkv_model_t *m, pkv_backend_t be, pkv_dtype_t dt, pkv_kv_t **out)
{
    return make_kv_cache(m, be, dt, false, out);
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
    size_t row = pkv_dtype_row_bytes(pkv_kv_geometry(kv)->dtype, c->head_dim);
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
                    memcpy((char *)dk + h * ds, (char *)sk + h * ss, row);
                    memcpy((char *)dv + h * ds, (char *)sv + h * ss, row);
                }
            }
        pkv_seq_append(seqs[i], toks, len);
    }
    free(toks);
    return 0;
}

/* `steps` decode steps over n sequences (greedy); seconds, or < 0. */
double pkv_bm_decode(pkv_model_t *m, pkv_kv_t *kv, pkv_seq_t **seqs, uint32_t n, uint32_t steps,
                     double *cpu)
{
    uint32_t V = pkv_model_config(m)->vocab_size;
    float *logits = malloc((size_t)n * V * sizeof(float));
    int32_t next[MAX_B];
    pkv_model_item_t items[MAX_B];
    if (!logits) return -1;
    for (uint32_t i = 0; i < n; i++) next[i] = (int32_t)(i * 7 % V);
    double t = -1, c0 = cpu_secs();
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
    *cpu = cpu_secs() - c0;
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
    double l;
    return pkv_prim_loadavg(&l) == PKV_OK ? l : -1;
}

typedef struct {
    const char *json, *preset;
    uint64_t runs, steps, threads, pairs;
    pkv_dtype_t dt;
    uint32_t ctxs[MAX_CTX];
    int n_ctx;
    bool do8, fast_fill;
    unsigned cases;        /* CASES_GRID | CASES_LONG | CASES_MIXED */
    uint32_t long_context; /* the long case's context */
    uint32_t mixed_prefix; /* the mixed case's shared prefix */
} opts_t;

#define CASES_GRID  1u
#define CASES_LONG  2u
#define CASES_MIXED 4u

/* A case: n sequences of lens[i] tokens (prompt length, the prefix included); the first
 * `prefix` tokens are the same for all and, after the first sequence is prefilled, adopted
 * from the prefix cache by the others (whole blocks); the rest of each prompt is its own. */
typedef struct {
    const char *name;
    uint32_t n, prefix;
    uint32_t lens[MAX_B];
} mcase_t;

enum { CASE_LONG, CASE_MIXED, N_CASES };

typedef struct {
    double ratio[MAX_PAIRS];             /* paged / dense decode speed, one per pair */
    double cpu_ratio[MAX_PAIRS];         /* dense / paged CPU seconds, one per pair */
    double tok_s[2][MAX_PAIRS];          /* decode tok/s per backend and pair */
    double prefill_s[2];                 /* seconds to build the contexts, per backend */
    uint32_t adopted[2];                 /* prompt tokens adopted from the prefix cache */
    uint64_t tokens;                     /* context tokens over all sequences */
    bool pages_ok;                       /* the paged pool's range was read from smaps */
    uint64_t resident_bytes, huge_bytes; /* of it, after the prefill */
} mcase_res_t;

/* The bare reads' layouts (the bound; see bare_stream). */
enum { BARE_DENSE, BARE_HUGE, BARE_PIECES, BARE_PIECES2, N_BARE };
static const char *const bare_names[N_BARE] = {
    "contiguous on 4 KiB pages (dense's layout)", "contiguous on 2 MiB pages",
    "pieces one per 2 MiB granule, one at a time",
    "the same pieces two granules at once (a decode task's walk; the threads side by side in each "
    "granule)"};
static const char *const bare_keys[N_BARE] = {"bare_stream_gbs", "bare_huge_gbs", "bare_pieces_gbs",
                                              "bare_pieces2_gbs"};
#define BARE_GRANULE ((size_t)2 << 20)
/* The piece sizes the sweep reads (one piece per 2 MiB granule, as BARE_PIECES): what a
 * contiguous run per granule is worth on this CPU. */
static const size_t bare_piece_kib[5] = {8, 16, 32, 64, 128};

/* Everything measured. */
typedef struct {
    cell_t cells[2][MAX_CTX];
    double ratio4096[MAX_PAIRS], ratio_ctx[MAX_CTX][MAX_PAIRS];
    double cpu_ratio_ctx[MAX_CTX][MAX_PAIRS]; /* dense / paged CPU seconds per pair */
    double p3700[2][16], p3700cpu[2][16];
    double load0, load1;
    char cpu[200]; /* pkv_prim_cpu_model */
    double steal;  /* the machine's CPU time a hypervisor took over the run, share; -1 unread */
    size_t stream_bytes;       /* K/V one long decode step reads, which the bare streams read */
    size_t stream_piece;       /* BARE_PIECES' piece */
    double stream_gbs[N_BARE]; /* GB/s of each BARE_ layout; 0 not run */
    double piece_gbs[5];       /* BARE_PIECES by piece size (bare_piece_kib); 0 not run */
    uint32_t stream_threads;   /* the model's */
    mcase_t mcases[N_CASES];
    mcase_res_t mres[N_CASES];
} results_t;

/* The figures derived from the results for the metrics table and the JSON. */
typedef struct {
    bool have4096;
    double r4096, p_paged, p_dense, pc_paged, pc_dense;
} summary_t;

/* "grid,long,mixed" (any of them) into a CASES_ mask; 0 or -1. */
static int parse_cases(const char *s, unsigned *out)
{
    unsigned m = 0;
    char buf[64];
    snprintf(buf, sizeof(buf), "%s", s);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        if (!strcmp(tok, "grid"))
            m |= CASES_GRID;
        else if (!strcmp(tok, "long"))
            m |= CASES_LONG;
        else if (!strcmp(tok, "mixed"))
            m |= CASES_MIXED;
        else
            return -1;
    }
    if (!m) return -1;
    *out = m;
    return 0;
}

/* -1: parsed, run; otherwise the exit code (usage printed). */
static int parse_opts(int argc, char **argv, opts_t *o)
{
    *o = (opts_t){.preset = "llama-3.2-1b",
                  .runs = 3,
                  .steps = 16,
                  .pairs = 9,
                  .dt = PKV_DTYPE_BF16,
                  .ctxs = {512, 4096},
                  .n_ctx = 2,
                  .do8 = true,
                  .cases = CASES_GRID | CASES_LONG | CASES_MIXED,
                  .long_context = 16384,
                  .mixed_prefix = 192};
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--json") && v)
            o->json = argv[++i];
        else if (!strcmp(argv[i], "--preset") && v)
            o->preset = argv[++i];
        else if (!strcmp(argv[i], "--runs") && v) {
            if (pkv_cli_parse_u64(argv[++i], 1, 16, &o->runs))
                return pkv_cli_usage_error("bench model", "--runs: 1..16");
        } else if (!strcmp(argv[i], "--decode-pairs") && v) {
            if (pkv_cli_parse_u64(argv[++i], 1, MAX_PAIRS, &o->pairs))
                return pkv_cli_usage_error("bench model", "--decode-pairs: 1..48");
        } else if (!strcmp(argv[i], "--decode-steps") && v) {
            if (pkv_cli_parse_u64(argv[++i], 1, 4096, &o->steps))
                return pkv_cli_usage_error("bench model", "--decode-steps: 1..4096");
        } else if (!strcmp(argv[i], "--threads") && v) {
            if (pkv_cli_parse_u64(argv[++i], 1, 64, &o->threads))
                return pkv_cli_usage_error("bench model", "--threads: 1..64");
        } else if (!strcmp(argv[i], "--dtype") && v) {
            if (pkv_dtype_parse(argv[++i], &o->dt))
                return pkv_cli_usage_error("bench model", "--dtype: f32, f16, bf16, int8 or fp8");
        } else if (!strcmp(argv[i], "--contexts") && v) {
            if ((o->n_ctx = parse_list(argv[++i], o->ctxs, MAX_CTX, 16, 32000)) < 0)
                return pkv_cli_usage_error("bench model", "--contexts: e.g. 512,4096");
        } else if (!strcmp(argv[i], "--cases") && v) {
            if (parse_cases(argv[++i], &o->cases))
                return pkv_cli_usage_error("bench model", "--cases: grid,long,mixed");
        } else if (!strcmp(argv[i], "--long-context") && v) {
            uint64_t n;
            if (pkv_cli_parse_u64(argv[++i], 16, 30000, &n))
                return pkv_cli_usage_error("bench model", "--long-context: 16..30000");
            o->long_context = (uint32_t)n;
        } else if (!strcmp(argv[i], "--mixed-prefix") && v) {
            uint64_t n;
            if (pkv_cli_parse_u64(argv[++i], 0, 255, &n))
                return pkv_cli_usage_error("bench model", "--mixed-prefix: 0..255");
            o->mixed_prefix = (uint32_t)n;
        } else if (!strcmp(argv[i], "--no-batch8")) {
            o->do8 = false;
        } else if (!strcmp(argv[i], "--null")) {
            null_pairs = true;
        } else if (!strcmp(argv[i], "--fast-fill")) {
            o->fast_fill = true;
        } else if (!strcmp(argv[i], "--no-hugepages")) {
            use_thp = false;
        } else if (!strcmp(argv[i], "--block-tokens") && v) {
            uint64_t bt;
            if (pkv_cli_parse_u64(argv[++i], 1, 4096, &bt))
                return pkv_cli_usage_error("bench model", "--block-tokens: 1..4096");
            block_tokens = (uint32_t)bt;
        } else {
            printf("usage: pagekv bench model [--json FILE] [--preset NAME] [--runs N]\n"
                   "         [--decode-pairs N] [--decode-steps N] [--threads N] [--dtype "
                   "bf16|int8|fp8] "
                   "[--contexts 512,4096] [--no-batch8]\n"
                   "         [--block-tokens N] [--no-hugepages] [--fast-fill] [--null]\n"
                   "         [--cases grid,long,mixed] [--long-context N] [--mixed-prefix N]\n");
            return strcmp(argv[i], "--help") ? 2 : 0;
        }
    }
    return -1;
}

static void free_contexts(ctx_state_t st[2])
{
    for (int be = 0; be < 2; be++) {
        for (uint32_t i = 0; i < st[be].n; i++) pkv_seq_free(st[be].seq[i]);
        pkv_kv_destroy(st[be].kv);
        st[be] = (ctx_state_t){0};
    }
}

/* Contexts for decode at context c: batch-B prefill (or one and copies), once per
 * backend. 0, or -1 (st holds what was built; the caller frees it). */
static int build_contexts(pkv_model_t *m, const opts_t *o, int c, ctx_state_t st[2], results_t *res)
{
    uint32_t B = o->do8 ? 8 : 1, C = o->ctxs[c];
    for (int be = 0; be < 2; be++) {
        progress("bench model: %s prefill %u x %u tokens...", pkv_backend_name(be), B, C);
        if (make_kv(m, be, o->dt, &st[be].kv)) return -1;
        uint32_t extra = (uint32_t)(2 * o->pairs * o->steps + 4);
        double t = prefill(m, st[be].kv, o->fast_fill ? 1 : B, C, extra, 7, st[be].seq);
        if (t < 0) return -1;
        st[be].n = 1;
        if (o->fast_fill && B > 1 && copy_contexts(m, st[be].kv, st[be].seq, B, C, extra, 8))
            return -1;
        st[be].n = B;
        res->cells[be][c].prefill8 = o->do8 && !o->fast_fill ? (double)B * C / t : 0;
    }
    return 0;
}

/* --decode-pairs pairs of decode runs at context c, which backend goes first alternating. */
static int decode_pairs(pkv_model_t *m, const opts_t *o, int c, ctx_state_t st[2], results_t *res)
{
    uint32_t C = o->ctxs[c], steps = (uint32_t)o->steps;
    for (uint64_t r = 0; r < o->pairs; r++) {
        double cpu[2];
        for (int k = 0; k < 2; k++) {
            int be = (int)(r & 1) ^ k; /* odd pairs: dense first */
            progress("bench model: %s decode at %u, pair %u...", pkv_backend_name(be), C,
                     (unsigned)r + 1);
            double c8 = 1, c1;
            double t8 = o->do8 ? pkv_bm_decode(m, st[be].kv, st[be].seq, 8, steps, &c8) : 1;
            double t1 = pkv_bm_decode(m, st[be].kv, st[be].seq, 1, steps, &c1);
            if (t8 < 0 || t1 < 0) return -1;
            cpu[be] = o->do8 ? c8 : c1;
            res->cells[be][c].decode8[r] = o->do8 ? 8.0 * steps / t8 : 0;
            res->cells[be][c].decode1[r] = (double)steps / t1;
        }
        cell_t *p = &res->cells[0][c], *d = &res->cells[1][c];
        res->ratio_ctx[c][r] =
            o->do8 ? p->decode8[r] / d->decode8[r] : p->decode1[r] / d->decode1[r];
        res->cpu_ratio_ctx[c][r] = cpu[1] / cpu[0];
        if (C == 4096) res->ratio4096[r] = res->ratio_ctx[c][r];
    }
    return 0;
}

/* One sequence of `len` tokens prefilled from empty on its own KV cache; seconds, or < 0.
 * *cpu (optional) gets the process's CPU seconds over it. */
static double prefill_fresh(pkv_model_t *m, pkv_backend_t be, pkv_dtype_t dt, uint32_t len,
                            uint64_t seed, double *cpu)
{
    pkv_kv_t *kv;
    pkv_seq_t *s;
    if (make_kv(m, be, dt, &kv)) return -1;
    double c0 = cpu_secs();
    double t = prefill(m, kv, 1, len, 0, seed, &s);
    if (cpu) *cpu = cpu_secs() - c0;
    if (t >= 0) pkv_seq_free(s);
    pkv_kv_destroy(kv);
    return t;
}

/* Decode at context c, then --runs batch-1 prefills from empty, alternating backends. */
static int bench_context(pkv_model_t *m, const opts_t *o, int c, results_t *res)
{
    ctx_state_t st[2] = {0};
    int rc = build_contexts(m, o, c, st, res);
    if (!rc) rc = decode_pairs(m, o, c, st, res);
    free_contexts(st);
    uint32_t C = o->ctxs[c];
    for (uint64_t r = 0; r < o->runs && !rc; r++) {
        for (int be = 0; be < 2; be++) {
            progress("bench model: %s prefill %u tokens, run %u...", pkv_backend_name(be), C,
                     (unsigned)r + 1);
            double t = prefill_fresh(m, be, o->dt, C, 100 + r, NULL);
            if (t < 0) return -1;
            res->cells[be][c].prefill1[r] = C / t;
        }
    }
    return rc;
}

/* ---- the cases beyond the grid: one long context, mixed lengths over a shared prefix --- */

/* Prompt of sequence i: the shared prefix (seed 1000) then its own tokens (seed 2000 + i). */
static void case_tokens(const mcase_t *c, uint32_t i, uint32_t V, int32_t *out)
{
    uint64_t ps = 1000, os = 2000 + i;
    for (uint32_t j = 0; j < c->lens[i]; j++)
        out[j] = (int32_t)(pkv_splitmix64(j < c->prefix ? &ps : &os) % V);
}

/* --fast-fill: positions [from, to) of seq get K/V values of a fixed pseudo-random pattern
 * (the same on both backends, in [-1, 1)) written in place of a prefill, and their tokens
 * appended; decode then reads them as it reads computed ones. */
void pkv_bm_fill_positions(pkv_model_t *m, pkv_dtype_t dt, pkv_seq_t *seq, const int32_t *toks,
                           uint32_t from, uint32_t to, uint64_t seed)
{
    const pkv_model_config_t *c = pkv_model_config(m);
    float row[512];
    for (uint32_t p = from; p < to; p++)
        for (uint32_t l = 0; l < c->n_layers; l++) {
            void *k, *v;
            size_t hs;
            pkv_seq_slot(seq, p, l, &k, &v, &hs);
            for (uint32_t h = 0; h < c->n_kv_heads; h++)
                for (int kv = 0; kv < 2; kv++) {
                    for (uint32_t d = 0; d < c->head_dim && d < 512; d++)
                        row[d] = (float)(pkv_splitmix64(&seed) >> 40) / (float)(1 << 23) - 1.0f;
                    pkv_dtype_from_f32(dt, (char *)(kv ? v : k) + h * hs, row, c->head_dim);
                }
        }
    pkv_seq_append(seq, toks + from, to - from);
}

/* The case's contexts on one backend: sequence 0 prefilled alone (its full blocks enter
 * the prefix cache), then the others admitted (adopting the prefix) and their remaining
 * tokens prefilled in one batched forward call. 0, or -1 (st holds what was built). */
static int case_build(pkv_model_t *m, const opts_t *o, const mcase_t *c, pkv_backend_t be,
                      ctx_state_t *st, mcase_res_t *res)
{
    uint32_t V = pkv_model_config(m)->vocab_size, extra = (uint32_t)(2 * o->pairs * o->steps + 4);
    if (make_kv_cache(m, be, o->dt, c->prefix > 0, &st->kv)) return -1;
    int32_t *toks[MAX_B] = {0};
    float *logits = malloc((size_t)c->n * V * sizeof(float));
    pkv_model_item_t items[MAX_B];
    int rc = logits ? 0 : -1;
    uint64_t t0 = pkv_now_ns();
    for (uint32_t i = 0; i < c->n && !rc; i++) {
        progress("bench model: %s %s, sequence %u of %u (%u tokens)...", c->name,
                 pkv_backend_name(be), i + 1, c->n, c->lens[i]);
        if (!(toks[i] = malloc((size_t)c->lens[i] * sizeof(int32_t)))) {
            rc = -1;
            break;
        }
        case_tokens(c, i, V, toks[i]);
        pkv_seq_params_t sp = {
            .tokens = toks[i], .n_tokens = c->lens[i], .reserve_tokens = c->lens[i] + extra};
        uint32_t cached = 0;
        if (pkv_seq_create(st->kv, &sp, &st->seq[i], &cached)) {
            rc = -1;
            break;
        }
        st->n = i + 1;
        res->adopted[be] += cached;
        items[i] = (pkv_model_item_t){.seq = st->seq[i],
                                      .tokens = toks[i] + cached,
                                      .n_tokens = c->lens[i] - cached,
                                      .logits = logits + (size_t)i * V};
        if (o->fast_fill) {
            pkv_bm_fill_positions(m, o->dt, st->seq[i], toks[i], cached, c->lens[i], 3000 + i);
            continue;
        }
        /* The first alone (it fills the cache), the rest together. */
        if ((i == 0 || i + 1 == c->n) &&
            pkv_model_forward(m, st->kv, items + (i ? 1 : 0), i ? c->n - 1 : 1))
            rc = -1;
    }
    res->prefill_s[be] = secs(t0);
    for (uint32_t i = 0; i < c->n; i++) free(toks[i]);
    free(logits);
    if (!rc && be == PKV_BACKEND_PAGED)
        res->pages_ok = pkv_kv_pages(st->kv, &res->resident_bytes, &res->huge_bytes) == PKV_OK;
    return rc;
}

/* Prefill once per backend, then --decode-pairs pairs of decode bursts (--decode-steps
 * steps of every sequence) on the same contexts, which backend goes first alternating. */
static int bench_case(pkv_model_t *m, const opts_t *o, const mcase_t *c, mcase_res_t *res)
{
    ctx_state_t st[2] = {0};
    int rc = 0;
    for (uint32_t i = 0; i < c->n; i++) res->tokens += c->lens[i];
    for (int be = 0; be < 2 && !rc; be++) rc = case_build(m, o, c, be, &st[be], res);
    for (uint64_t r = 0; r < o->pairs && !rc; r++) {
        double t[2], cpu[2];
        for (int k = 0; k < 2 && !rc; k++) {
            int be = (int)(r & 1) ^ k; /* odd pairs: dense first */
            progress("bench model: %s %s decode, pair %u...", c->name, pkv_backend_name(be),
                     (unsigned)r + 1);
            t[be] = pkv_bm_decode(m, st[be].kv, st[be].seq, c->n, (uint32_t)o->steps, &cpu[be]);
            if (t[be] < 0) rc = -1;
        }
        if (rc) break;
        for (int be = 0; be < 2; be++) res->tok_s[be][r] = (double)c->n * o->steps / t[be];
        res->ratio[r] = t[1] / t[0];
        res->cpu_ratio[r] = cpu[1] / cpu[0];
    }
    free_contexts(st);
    return rc;
}

/* --runs prefills of 3700 tokens on the llama-3.2-1b preset, per backend. */
static int bench_prefill3700(pkv_model_t *llama, const opts_t *o, results_t *res)
{
    for (uint64_t r = 0; r < o->runs; r++) {
        for (int be = 0; be < 2; be++) {
            progress("bench model: %s prefill 3700 (llama-3.2-1b), run %u...", pkv_backend_name(be),
                     (unsigned)r + 1);
            double t = prefill_fresh(llama, be, o->dt, 3700, 200 + r, &res->p3700cpu[be][r]);
            if (t < 0) return -1;
            res->p3700[be][r] = t;
        }
    }
    return 0;
}

/* The cells table; returns the cells as JSON. */
static json_t *print_cells(const opts_t *o, const results_t *res)
{
    printf("| backend | context | batch | prefill tok/s | decode tok/s |\n|---|---|---|---|---|\n");
    json_t *jcells = json_array();
    for (int c = 0; c < o->n_ctx; c++) {
        for (int b = 0; b < (o->do8 ? 2 : 1); b++) {
            for (int be = 0; be < 2; be++) {
                const cell_t *cl = &res->cells[be][c];
                double pf = b ? cl->prefill8 : pkv_bench_median(cl->prefill1, o->runs);
                double dc = pkv_bench_median(b ? cl->decode8 : cl->decode1, o->pairs);
                if (b && o->fast_fill)
                    printf("| %s | %u | 8 | - (--fast-fill) | %.1f |\n", pkv_backend_name(be),
                           o->ctxs[c], dc);
                else
                    printf("| %s | %u | %d | %.0f%s | %.1f |\n", pkv_backend_name(be), o->ctxs[c],
                           b ? 8 : 1, pf, b ? " (1 run)" : "", dc);
                json_array_append_new(jcells, json_pack("{s:s, s:i, s:i, s:f, s:f}", "backend",
                                                        pkv_backend_name(be), "context",
                                                        (int)o->ctxs[c], "batch", b ? 8 : 1,
                                                        "prefill_tok_s", pf, "decode_tok_s", dc));
            }
        }
    }
    return jcells;
}

static summary_t summarize(const opts_t *o, const results_t *res)
{
    summary_t s = {0};
    for (int c = 0; (o->cases & CASES_GRID) && c < o->n_ctx; c++) s.have4096 |= o->ctxs[c] == 4096;
    if (s.have4096) s.r4096 = pkv_bench_median(res->ratio4096, o->pairs);
    s.p_paged = pkv_bench_median(res->p3700[0], o->runs);
    s.p_dense = pkv_bench_median(res->p3700[1], o->runs);
    s.pc_paged = pkv_bench_median(res->p3700cpu[0], o->runs);
    s.pc_dense = pkv_bench_median(res->p3700cpu[1], o->runs);
    return s;
}

static void print_metrics(const opts_t *o, const results_t *res, const summary_t *s)
{
    uint32_t B = o->do8 ? 8 : 1;
    printf("\n| metric | value | target |\n|---|---|---|\n");
    if (s->have4096)
        printf("| decode_paged_over_dense_4096 (batch %u, median of %llu pairs) | %.3f | >= "
               "0.95 |\n",
               B, (unsigned long long)o->pairs, s->r4096);
    for (int c = 0; c < o->n_ctx; c++)
        if (o->ctxs[c] != 4096)
            printf("| decode_paged_over_dense_%u (batch %u) | %.3f | |\n", o->ctxs[c], B,
                   pkv_bench_median(res->ratio_ctx[c], o->pairs));
    printf("| prefill_3700_llama_s (paged, median of %llu) | %.2f | <= 10 |\n",
           (unsigned long long)o->runs, s->p_paged);
    printf("| prefill_3700_llama_s, dense | %.2f | |\n", s->p_dense);
    printf("| prefill_3700 CPU seconds (all threads; OS accounting), paged / dense | %.2f / %.2f "
           "| |\n",
           s->pc_paged, s->pc_dense);
}

/* --json FILE (takes jcells and jcases); 0 or 1. */
static int write_json(pkv_model_t *m, const opts_t *o, const results_t *res, const summary_t *s,
                      json_t *jcells, json_t *jcases)
{
    json_t *j =
        json_pack("{s:s, s:s, s:s, s:i, s:i, s:i, s:o, s:f, s:f, s:f, s:f}", "bench", "model",
                  "preset", o->preset, "dtype", pkv_dtype_name(o->dt), "threads",
                  (int)pkv_model_threads(m), "runs", (int)o->runs, "decode_steps", (int)o->steps,
                  "cells", jcells, "prefill_3700_llama_s", s->p_paged, "prefill_3700_llama_s_dense",
                  s->p_dense, "loadavg_before", res->load0, "loadavg_after", res->load1);
    json_object_set_new(j, "steal_share", json_real(res->steal));
    for (int k = 0; k < N_BARE; k++)
        if (res->stream_gbs[k] > 0)
            json_object_set_new(j, bare_keys[k], json_real(res->stream_gbs[k]));
    json_t *bp = json_array();
    for (int k = 0; k < 5; k++)
        if (res->piece_gbs[k] > 0)
            json_array_append_new(bp, json_pack("{s:I, s:f}", "piece_bytes",
                                                (json_int_t)(bare_piece_kib[k] << 10), "gbs",
                                                res->piece_gbs[k]));
    json_object_set_new(j, "bare_pieces_by_size", bp);
    if (s->have4096) {
        json_object_set_new(j, "decode_paged_over_dense_4096", json_real(s->r4096));
        json_t *pr = json_array();
        for (uint64_t r = 0; r < o->pairs; r++)
            json_array_append_new(pr, json_real(res->ratio4096[r]));
        json_object_set_new(j, "decode_paged_over_dense_4096_pairs", pr);
    }
    json_object_set_new(j, "decode_pairs", json_integer((json_int_t)o->pairs));
    json_object_set_new(j, "kernels", json_string(pkv_model_kernels(m)));
    json_object_set_new(j, "cpu_model", json_string(res->cpu));
    json_object_set_new(j, "block_tokens", json_integer(block_tokens));
    json_object_set_new(j, "prefill_3700_llama_cpu_s", json_real(s->pc_paged));
    json_object_set_new(j, "prefill_3700_llama_cpu_s_dense", json_real(s->pc_dense));
    json_object_set_new(j, "paged_hugepages", json_boolean(use_thp));
    json_object_set_new(j, "null_pairs", json_boolean(null_pairs));
    json_object_set_new(j, "cases", jcases);
    int rc = pkv_bench_write_json(o->json, j) ? 1 : 0;
    json_decref(j);
    return rc;
}

static void print_header(pkv_model_t *m, const opts_t *o, const results_t *res)
{
    const pkv_model_config_t *c0 = pkv_model_config(m);
    printf(
        "pagekv bench model on %s: preset %s (%u layers, %u KV heads x %u, %u query heads, dim %u, "
        "hidden %u, vocab %u), KV %s, kernels %s, %u threads, %llu runs, %llu decode steps; "
        "load average %.2f -> %.2f; steal %.0f %% of the machine's CPU time (/proc/stat)\n\n",
        res->cpu, o->preset, c0->n_layers, c0->n_kv_heads, c0->head_dim, c0->n_heads, c0->dim,
        c0->hidden_dim, c0->vocab_size, pkv_dtype_name(o->dt), pkv_model_kernels(m),
        pkv_model_threads(m), (unsigned long long)o->runs, (unsigned long long)o->steps, res->load0,
        res->load1, res->steal * 100);
    if (null_pairs)
        printf("--null: both sides are paged pools (the second is labelled dense below); the "
               "paged/dense figures are what this instrument reads at parity\n\n");
}

/* Measure, then report; the exit code. */
/* The long and mixed cases of this run into res->mcases; 0, or 1 when the model's
 * length cannot hold one (said on stderr). */
static int set_cases(pkv_model_t *m, const opts_t *o, results_t *res)
{
    res->mcases[CASE_LONG] = (mcase_t){"long", 1, 0, {o->long_context}};
    res->mcases[CASE_MIXED] = (mcase_t){
        "mixed8_prefix", 8, o->mixed_prefix, {256, 512, 1024, 2048, 3072, 4096, 6144, 8192}};
    uint32_t S = pkv_model_config(m)->max_seq_len, extra = (uint32_t)(2 * o->pairs * o->steps + 4);
    for (int k = 0; k < N_CASES; k++) {
        const mcase_t *c = &res->mcases[k];
        if (!(o->cases & (CASES_LONG << k))) continue;
        for (uint32_t i = 0; i < c->n; i++)
            if (c->lens[i] + extra > S) {
                fprintf(stderr,
                        "pagekv bench model: case %s needs %u positions; preset %s holds %u\n",
                        c->name, c->lens[i] + extra, o->preset, S);
                return 1;
            }
    }
    return 0;
}

static void ratio_range(const double *v, size_t n, double *lo, double *hi)
{
    *lo = n ? v[0] : 0;
    *hi = *lo;
    for (size_t i = 1; i < n; i++) {
        *lo = v[i] < *lo ? v[i] : *lo;
        *hi = v[i] > *hi ? v[i] : *hi;
    }
}

static json_t *pairs_json(const double *v, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(a, json_real(v[i]));
    return a;
}

/* One row of the paged/dense table and its JSON. */
static json_t *case_row(const opts_t *o, const char *name, uint32_t nseq, uint64_t tokens,
                        const double *ratio, const double *cpu, const double *paged,
                        const double *dense)
{
    double lo, hi, med = pkv_bench_median(ratio, o->pairs);
    double clo, chi, cmed = pkv_bench_median(cpu, o->pairs);
    ratio_range(ratio, o->pairs, &lo, &hi);
    ratio_range(cpu, o->pairs, &clo, &chi);
    double tp = pkv_bench_median(paged, o->pairs), td = pkv_bench_median(dense, o->pairs);
    /* The CPU median's 95 % interval says whether the pairs tell the backends apart. */
    double cilo = 0, cihi = 0, cover = 0;
    bool ci = pkv_bench_median_ci(cpu, o->pairs, &cilo, &cihi, &cover) == 0;
    char cis[48] = "- (under 6 pairs)";
    const char *verdict = "-";
    if (ci) {
        snprintf(cis, sizeof(cis), "%.3f - %.3f", cilo, cihi);
        verdict = cilo > 1 ? "paged faster" : cihi < 1 ? "paged slower" : "not told apart";
    }
    printf("| %s | %u | %llu | %.1f | %.1f | **%.3f** | %.3f | %.3f | **%.3f** | %s | %s | %.3f | "
           "%.3f | %llu |\n",
           name, nseq, (unsigned long long)tokens, tp, td, med, lo, hi, cmed, cis, verdict, clo,
           chi, (unsigned long long)o->pairs);
    json_t *row =
        json_pack("{s:s, s:i, s:I, s:f, s:f, s:f, s:f, s:f, s:i, s:o}", "case", name, "sequences",
                  (int)nseq, "context_tokens", (json_int_t)tokens, "paged_decode_tok_s", tp,
                  "dense_decode_tok_s", td, "ratio_median", med, "ratio_min", lo, "ratio_max", hi,
                  "pairs", (int)o->pairs, "ratios", pairs_json(ratio, o->pairs));
    json_object_set_new(row, "cpu_ratio_median", json_real(cmed));
    json_object_set_new(row, "cpu_ratios", pairs_json(cpu, o->pairs));
    if (ci) {
        json_object_set_new(row, "cpu_ratio_ci_lo", json_real(cilo));
        json_object_set_new(row, "cpu_ratio_ci_hi", json_real(cihi));
        json_object_set_new(row, "cpu_ratio_ci_cover", json_real(cover));
    }
    return row;
}

/* The paged/dense table over every case measured; returns it as JSON. */
static json_t *print_cases(const opts_t *o, const results_t *res)
{
    printf("\npaged / dense decode speed by case (median of pairs; each pair: one burst of %llu "
           "steps per backend on the same prefilled contexts; wall: tokens per second, CPU: "
           "dense / paged CPU seconds of the process, which leave out steal; 95 %% CI: the "
           "distribution-free interval of the CPU median, order statistics of the pairs):\n\n"
           "| case | sequences | context tokens | paged tok/s | dense tok/s | paged/dense wall "
           "| min | max | paged/dense CPU | 95 %% CI | CPU says | min | max | pairs |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
           (unsigned long long)o->steps);
    json_t *a = json_array();
    uint32_t B = o->do8 ? 8 : 1;
    for (int c = 0; (o->cases & CASES_GRID) && c < o->n_ctx; c++) {
        char name[32];
        snprintf(name, sizeof(name), "ctx%u_b%u", o->ctxs[c], B);
        const cell_t *p = &res->cells[0][c], *d = &res->cells[1][c];
        json_array_append_new(a, case_row(o, name, B, (uint64_t)B * o->ctxs[c], res->ratio_ctx[c],
                                          res->cpu_ratio_ctx[c], B > 1 ? p->decode8 : p->decode1,
                                          B > 1 ? d->decode8 : d->decode1));
    }
    for (int k = 0; k < N_CASES; k++) {
        if (!(o->cases & (CASES_LONG << k))) continue;
        const mcase_t *c = &res->mcases[k];
        const mcase_res_t *r = &res->mres[k];
        char name[48];
        snprintf(name, sizeof(name), k == CASE_LONG ? "%s_%u" : "%s", c->name, c->lens[0]);
        json_t *row =
            case_row(o, name, c->n, r->tokens, r->ratio, r->cpu_ratio, r->tok_s[0], r->tok_s[1]);
        json_object_set_new(row, "prefix_tokens", json_integer(c->prefix));
        json_object_set_new(row, "adopted_tokens_paged", json_integer(r->adopted[0]));
        json_object_set_new(row, "adopted_tokens_dense", json_integer(r->adopted[1]));
        json_object_set_new(row, "prefill_s_paged", json_real(r->prefill_s[0]));
        json_object_set_new(row, "prefill_s_dense", json_real(r->prefill_s[1]));
        if (r->pages_ok) {
            json_object_set_new(row, "paged_resident_bytes",
                                json_integer((json_int_t)r->resident_bytes));
            json_object_set_new(row, "paged_huge_bytes", json_integer((json_int_t)r->huge_bytes));
        }
        json_array_append_new(a, row);
    }
    for (int k = 0; k < N_CASES; k++) {
        if (!(o->cases & (CASES_LONG << k))) continue;
        const mcase_t *c = &res->mcases[k];
        const mcase_res_t *r = &res->mres[k];
        printf("\n%s: prefill %.1f s paged, %.1f s dense; prefix %u tokens, adopted %u (paged) / "
               "%u (dense) tokens",
               c->name, r->prefill_s[0], r->prefill_s[1], c->prefix, r->adopted[0], r->adopted[1]);
        if (r->pages_ok)
            printf("; paged pool %.0f MiB resident, %.0f MiB of it in huge pages (smaps)",
                   (double)r->resident_bytes / (1 << 20), (double)r->huge_bytes / (1 << 20));
        printf("\n");
        if (k == CASE_LONG && res->stream_gbs[BARE_DENSE] > 0) {
            double step = (double)res->stream_bytes;
            printf("long: one decode step reads %.0f MiB of K/V: paged %.1f GB/s, dense %.1f GB/s "
                   "(whole steps, median); bare %u-thread reads of the same bytes (once, 4 KiB "
                   "prefetch ahead into %s as the kernels, no arithmetic):",
                   step / (1 << 20), pkv_bench_median(r->tok_s[0], o->pairs) * step / 1e9,
                   pkv_bench_median(r->tok_s[1], o->pairs) * step / 1e9, res->stream_threads,
                   pkv_prim_cpu_amd() ? "L1" : "L2");
            for (int b = 0; b < N_BARE; b++)
                printf("%s %s %.1f GB/s", b ? ";" : "", bare_names[b], res->stream_gbs[b]);
            printf(" (%zu KiB pieces)\nlong: the same bare reads by piece size (one piece a "
                   "2 MiB granule):",
                   res->stream_piece >> 10);
            for (int p = 0; p < 5; p++)
                if (res->piece_gbs[p] > 0)
                    printf("%s %zu KiB %.1f GB/s", p ? ";" : "", bare_piece_kib[p],
                           res->piece_gbs[p]);
            printf("\n");
        }
    }
    return a;
}

/* ---- the bound: bare reads of as many bytes as one long decode step reads ---- */

/* The same bytes in four layouts, each read once by the model's threads with the decode
 * stream's prefetch (4 KiB ahead, across jumps, into L1 on AMD and L2 elsewhere, as the
 * kernels): contiguous on 4 KiB pages (the dense buffer's), contiguous on 2 MiB pages,
 * pieces one per 2 MiB granule (the paged pool's reads in the long case: a task's heads
 * of one granule's tokens, then the next granule) read one at a time, and the same
 * pieces read as a decode task walks them: a task's two heads skewed by one granule,
 * so that the first half of piece k and the second half of piece k - 1 are read line by
 * line together. The threads read side by side in each granule, as tasks split by heads
 * do (the long case's decode tasks split by span read different granules). What each
 * layout can deliver on this machine, with no arithmetic. */

typedef struct {
    const char *base;
    size_t piece;   /* bytes read in one go (whole lines) */
    size_t npieces; /* read by this thread */
    size_t ngran;   /* granules the pieces are spread over; 1: one contiguous share */
    uint32_t t, threads;
    bool two, t0; /* BARE_PIECES2; prefetcht0 (else t1) */
    uint64_t sum;
} stream_part_t;

/* Piece k of thread t: in granule k % ngran, slot (k / ngran) * threads + t of it. */
static const char *piece_at(const stream_part_t *a, size_t k)
{
    return a->base + k % a->ngran * BARE_GRANULE + (k / a->ngran * a->threads + a->t) * a->piece;
}

/* One stream's line at offset o of [p, p + len), prefetching 4 KiB ahead (into next). */
static inline uint64_t stream_line(const char *p, const char *next, size_t len, size_t o, bool t0)
{
    size_t f = o + 4096;
    const char *q = f < len ? p + f : next ? next + (f - len) : NULL;
    if (q && t0)
        __builtin_prefetch(q, 0, 3);
    else if (q)
        __builtin_prefetch(q, 0, 2);
    const uint64_t *l = (const uint64_t *)(p + o);
    return (l[0] ^ l[1]) + (l[2] ^ l[3]) + (l[4] ^ l[5]) + (l[6] ^ l[7]);
}

static void *stream_part(void *arg)
{
    stream_part_t *a = arg;
    uint64_t s = 0;
    size_t half = a->piece / 2;
    for (size_t k = 0; !a->two && k < a->npieces; k++) {
        const char *p = piece_at(a, k), *next = k + 1 < a->npieces ? piece_at(a, k + 1) : NULL;
        for (size_t o = 0; o < a->piece; o += 64) s += stream_line(p, next, a->piece, o, a->t0);
    }
    for (size_t k = 0; a->two && k <= a->npieces; k++) { /* step k: A in piece k, B in k - 1 */
        const char *pa = k < a->npieces ? piece_at(a, k) : NULL;
        const char *pb = k ? piece_at(a, k - 1) + half : NULL;
        const char *na = k + 1 < a->npieces ? piece_at(a, k + 1) : NULL;
        const char *nb = k < a->npieces ? piece_at(a, k) + half : NULL;
        for (size_t o = 0; o < half; o += 64) {
            if (pa) s += stream_line(pa, na, half, o, a->t0);
            if (pb) s += stream_line(pb, nb, half, o, a->t0);
        }
    }
    a->sum = s;
    return NULL;
}

/* GB/s of `threads` threads reading about `bytes` once in layout `kind` (BARE_PIECES:
 * pieces of `piece` bytes), the median of 5 passes over a buffer of its own, touched
 * first; 0 when it cannot run. */
static double bare_stream(size_t bytes, uint32_t threads, int kind, size_t piece)
{
    enum { PASSES = 5, MAX_T = 64 };
    if (threads > MAX_T) threads = MAX_T;
    stream_part_t a = {.piece = bytes / threads & ~(size_t)63,
                       .npieces = 1,
                       .ngran = 1,
                       .threads = threads,
                       .two = kind == BARE_PIECES2,
                       .t0 = pkv_prim_cpu_amd()};
    bool pieces = kind == BARE_PIECES || kind == BARE_PIECES2;
    if (pieces) {
        if (piece < 128 || piece % 128 || piece * threads > BARE_GRANULE) return 0;
        a.piece = piece;
        a.ngran = bytes / BARE_GRANULE ? bytes / BARE_GRANULE : 1;
        a.npieces = a.ngran * (BARE_GRANULE / (piece * threads));
    }
    size_t len = pieces ? a.ngran * BARE_GRANULE : a.piece * threads;
    size_t map = len + BARE_GRANULE; /* room to start on a 2 MiB boundary */
    char *m = mmap(NULL, map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return 0;
    char *buf = (char *)(((uintptr_t)m + BARE_GRANULE - 1) & ~(uintptr_t)(BARE_GRANULE - 1));
    madvise(buf, len, kind == BARE_DENSE ? MADV_NOHUGEPAGE : MADV_HUGEPAGE);
    memset(buf, 1, len);
    a.base = buf;
    double gbs[PASSES];
    int done = 0;
    for (; done < PASSES; done++) {
        stream_part_t part[MAX_T];
        pthread_t th[MAX_T];
        uint32_t started = 0;
        uint64_t t0 = pkv_now_ns();
        for (; started < threads; started++) {
            part[started] = a;
            part[started].t = started;
            if (pthread_create(&th[started], NULL, stream_part, &part[started])) break;
        }
        for (uint32_t i = 0; i < started; i++) pthread_join(th[i], NULL);
        if (started < threads) break;
        gbs[done] = (double)(a.npieces * a.piece * threads) / secs(t0) / 1e9;
    }
    munmap(m, map);
    return done == PASSES ? pkv_bench_median(gbs, PASSES) : 0;
}

/* The paged long case's piece: the heads of one attention task (at batch 1 the model
 * splits a layer's KV heads into 2 x threads tasks where they divide) times one granule's
 * tokens of one head. */
static size_t paged_piece(const pkv_geometry_t *g, uint32_t threads)
{
    size_t head_tok = pkv_dtype_row_bytes(g->dtype, g->head_dim);
    size_t block = pkv_geometry_token_bytes(g) * block_tokens;
    size_t blocks = BARE_GRANULE / block ? BARE_GRANULE / block : 1;
    uint32_t splits = 1;
    while (splits < 2 * threads && g->kv_heads % (splits * 2) == 0) splits *= 2;
    return (size_t)(g->kv_heads / splits) * blocks * block_tokens * head_tok;
}

/* Measure, then report; the exit code (-1: a run failed). */
static int run_bench(pkv_model_t *m, pkv_model_t *llama, const opts_t *o)
{
    static results_t res;
    memset(&res, 0, sizeof(res));
    if (set_cases(m, o, &res)) return 1;
    res.load0 = loadavg1();
    pkv_prim_cpu_model(res.cpu, sizeof(res.cpu));
    uint64_t tot0, st0, tot1, st1;
    int ticks = pkv_prim_cpu_ticks(&tot0, &st0);
    bool grid = o->cases & CASES_GRID;
    for (int c = 0; grid && c < o->n_ctx; c++)
        if (bench_context(m, o, c, &res)) return -1;
    for (int k = 0; k < N_CASES; k++)
        if ((o->cases & (CASES_LONG << k)) && bench_case(m, o, &res.mcases[k], &res.mres[k]))
            return -1;
    if (grid && bench_prefill3700(llama, o, &res)) return -1;
    if (o->cases & CASES_LONG) {
        pkv_geometry_t g;
        pkv_model_geometry(m, o->dt, block_tokens, &g);
        res.stream_bytes = pkv_geometry_token_bytes(&g) * res.mcases[CASE_LONG].lens[0];
        res.stream_threads = pkv_model_threads(m);
        res.stream_piece = paged_piece(&g, res.stream_threads);
        for (int k = 0; k < N_BARE; k++) {
            progress("bench model: bare reads, layout %d of %d...", k + 1, N_BARE);
            res.stream_gbs[k] =
                bare_stream(res.stream_bytes, res.stream_threads, k, res.stream_piece);
        }
        for (int k = 0; k < 5; k++)
            res.piece_gbs[k] = bare_stream(res.stream_bytes, res.stream_threads, BARE_PIECES,
                                           bare_piece_kib[k] << 10);
    }
    if (pkv_cli_progress_enabled()) fprintf(stderr, "\r%70s\r", "");
    res.load1 = loadavg1();
    res.steal = !ticks && !pkv_prim_cpu_ticks(&tot1, &st1) && tot1 > tot0
                    ? (double)(st1 - st0) / (double)(tot1 - tot0)
                    : -1;
    print_header(m, o, &res);
    json_t *jcells = grid ? print_cells(o, &res) : json_array();
    summary_t s = summarize(o, &res);
    if (grid) print_metrics(o, &res, &s);
    json_t *jcases = print_cases(o, &res);
    if (o->json) return write_json(m, o, &res, &s, jcells, jcases);
    json_decref(jcells);
    json_decref(jcases);
    return 0;
}

int pkv_bench_model(int argc, char **argv)
{
    opts_t o;
    int prc = parse_opts(argc, argv, &o);
    if (prc >= 0) return prc;
    pkv_model_config_t mc, lc;
    if (pkv_model_preset(o.preset, &mc))
        return pkv_cli_usage_error("bench model", "unknown preset '%s'", o.preset);
    mc.vocab_size = lc.vocab_size = 16384; /* the built-in tokenizer's vocabulary */
    pkv_model_preset("llama-3.2-1b", &lc);
    lc.vocab_size = 16384;
    pkv_model_runtime_t rt = {.threads = (uint32_t)o.threads};
    pkv_model_t *m = NULL, *llama = NULL;
    int rc = 1;
    if (pkv_model_create_builtin(&mc, 1, &rt, &m)) goto out;
    llama = strcmp(o.preset, "llama-3.2-1b") ? NULL : m;
    if (!llama && pkv_model_create_builtin(&lc, 1, &rt, &llama)) goto out;
    rc = run_bench(m, llama, &o);
    if (rc < 0) {
        fprintf(stderr, "pagekv bench model: failed (out of memory?)\n");
        rc = 1;
    }
out:
    if (llama != m) pkv_model_destroy(llama);
    pkv_model_destroy(m);
    return rc;
}
