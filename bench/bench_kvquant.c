/*
 * pagekv bench kvquant: what the quantized KV formats (int8, fp8) cost in accuracy against
 * a bf16 KV cache, and what they give in decode speed. See docs/design/bench_kvquant.md.
 *
 * Error: the built-in model (--preset, --layers of it) with the same weights and tokens is
 * run once per KV dtype (f32, bf16, int8, fp8) and per variant:
 *   flat      the built-in weights as they are
 *   outliers  K's last RoPE pair of every head x20 (real models' keys carry such channels)
 *   sharp     queries x4, so the softmax concentrates
 For each context (--contexts, default 512,4096,16384):
 *   attention: with an f32 cache the prompt is prefilled and, in every layer, the queries
 *              of its last --probe-rows positions and every position's K and V are kept;
 *              then each layer's attention for those rows is computed (in double) from K/V
 *              as each dtype stores them (its one quantizer; int8's keys rotated as the
 *              model rotates them, pkv_dtype_rotates_keys) and from the f32 values. Each
 *              layer sees the same inputs, so the figure is the format's alone (the
 *              end-to-end effect, compounding over layers, is the KL below).
 *   attn_rel_err   ||a_dt - a_f32|| / ||a_f32|| over the probed rows, the worst layer
 *   floor_multiple attn_rel_err / bf16's (bf16's own is the rounding floor)
 *   top_weight     mean over the probed rows and heads of the largest attention weight
 *                  (f32): how concentrated the variant's attention is
 *   logits:    the model is run with a cache of each dtype (bf16, int8, fp8): the prompt
 *              prefilled, then --steps tokens decoded teacher-forced (the same forced ids
 *              for every dtype), each step's logits kept.
 *   kl_mean/p99    KL(p_bf16 || p_dt) of the next-token distributions over the steps
 *   top1_agree     share of the steps where bf16's top choice is clear (log p1 - log p2 >=
 *                  TOP1_MARGIN) on which dt picks the same token
 * Decode: paged int8 (and fp8) against paged bf16 on llama-3.2-1b (16 layers) at 512 x 8,
 * 4096 x 8 and 16384 x 1 contexts filled with a fixed K/V pattern (bench model's
 * --fast-fill), --decode-pairs pairs of --decode-steps-step bursts, which dtype goes first
 * alternating; over_bf16 = bf16 seconds / dt seconds (median, > 1: faster).
 */
#include "bench/bench_model.h"
#include "support/bench.h"
#include "support/cli.h"
#include "tools/commands.h"

#include "core/core.h"
#include "prim/prim.h"

#include "pagekv/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CTX     4
#define MAX_LAYERS  64
#define TOP1_MARGIN 0.5 /* nats between bf16's top two choices for a "clear" step */
#define KQ_PAIRS    32

enum { DT_F32, DT_BF16, DT_INT8, DT_FP8, N_DT };
static const pkv_dtype_t dts[N_DT] = {PKV_DTYPE_F32, PKV_DTYPE_BF16, PKV_DTYPE_INT8, PKV_DTYPE_FP8};

typedef struct {
    const char *name;
    float k_outlier_gain, q_gain;
    double att_target; /* int8's attn_rel_err target */
} variant_t;
static const variant_t variants[] = {
    {"flat", 1.0f, 1.0f, 0.015}, {"outliers", 20.0f, 1.0f, 0.03}, {"sharp", 1.0f, 4.0f, 0.03}};
#define N_VAR (sizeof(variants) / sizeof(variants[0]))

typedef struct {
    const char *json, *preset;
    uint32_t layers, steps, probe_rows, ctxs[MAX_CTX], n_ctx;
    uint64_t pairs, decode_steps;
    bool no_error, no_decode;
} kq_opts_t;

/* One dtype's run at one context: step logits; the f32 run also keeps the probed rows'
 * queries and every position's K and V per layer. */
typedef struct {
    uint32_t p0, rows, qdim, layers, kvdim, ctx;
    float *q;      /* [layers][rows][qdim] (f32 run) */
    float *k, *v;  /* [layers][ctx][kvdim] (f32 run) */
    float *logits; /* [steps][V] */
} kq_run_t;

typedef struct {
    const char *variant;
    pkv_dtype_t dt;
    uint32_t ctx;
    double attn_rel_err, floor_multiple, top_weight, kl_mean, kl_p99, top1_agree;
    uint32_t top1_clear;
} kq_case_t;

static void kq_probe(void *arg, uint32_t layer, uint32_t pos, const float *q, const float *att,
                     uint32_t n)
{
    (void)att;
    kq_run_t *r = arg;
    if (!r->q || pos < r->p0 || pos >= r->p0 + r->rows || layer >= r->layers) return;
    memcpy(r->q + ((size_t)layer * r->rows + (pos - r->p0)) * r->qdim, q, n * sizeof(float));
}

/* The f32 cache's K and V of positions [0, ctx) of every layer into r->k, r->v. */
static void kq_extract(pkv_seq_t *seq, const pkv_geometry_t *g, kq_run_t *r)
{
    for (uint32_t l = 0; l < g->layers; l++) {
        uint32_t pos = 0;
        while (pos < r->ctx) {
            pkv_kv_run_t run[64];
            uint32_t n = pkv_seq_runs(seq, l, pos, r->ctx, run, 64, &pos);
            for (uint32_t i = 0; i < n; i++)
                for (uint32_t t = 0; t < run[i].n_tokens; t++)
                    for (uint32_t h = 0; h < g->kv_heads; h++) {
                        size_t off = h * run[i].head_stride + (size_t)t * g->head_dim * 4;
                        size_t at = ((size_t)l * r->ctx + run[i].pos + t) * r->kvdim +
                                    (size_t)h * g->head_dim;
                        memcpy(r->k + at, (const char *)run[i].k + off, g->head_dim * 4);
                        memcpy(r->v + at, (const char *)run[i].v + off, g->head_dim * 4);
                    }
        }
    }
}

/* Prefill toks[0..ctx) and decode toks[ctx..ctx + steps) one at a time, keeping logits. */
static int kq_run(pkv_model_t *m, pkv_dtype_t dt, const int32_t *toks, uint32_t ctx, uint32_t steps,
                  kq_run_t *r)
{
    const pkv_model_config_t *c = pkv_model_config(m);
    pkv_kv_config_t kc = {.no_prefix_cache = true, .hugepages = true};
    pkv_model_geometry(m, dt, 16, &kc.geo);
    pkv_kv_t *kv = NULL;
    pkv_seq_t *seq = NULL;
    int rc = -1;
    if (pkv_kv_create(&kc, &kv)) return -1;
    pkv_seq_params_t sp = {.tokens = toks, .n_tokens = ctx, .reserve_tokens = ctx + steps};
    if (pkv_seq_create(kv, &sp, &seq, NULL)) goto out;
    float *tail = malloc((size_t)c->vocab_size * sizeof(float));
    if (!tail) goto out;
    pkv_model_item_t it = {.seq = seq, .tokens = toks, .n_tokens = ctx, .logits = tail};
    if (pkv_model_forward(m, kv, &it, 1)) goto out_tail;
    if (r->k) kq_extract(seq, &kc.geo, r);
    for (uint32_t s = 0; s < steps; s++) {
        it = (pkv_model_item_t){.seq = seq,
                                .tokens = toks + ctx + s,
                                .n_tokens = 1,
                                .logits = r->logits + (size_t)s * c->vocab_size};
        if (pkv_model_forward(m, kv, &it, 1)) goto out_tail;
    }
    rc = 0;
out_tail:
    free(tail);
out:
    if (seq) pkv_seq_free(seq);
    pkv_kv_destroy(kv);
    return rc;
}

/* A row of K or V as dtype dt stores it (rotated first for keys where dt rotates them). */
static void as_stored(pkv_dtype_t dt, bool key, const float *x, uint32_t hd, float *out)
{
    uint8_t buf[4 * 1024 + 4];
    memcpy(out, x, hd * sizeof(float));
    if (key && pkv_dtype_rotates_keys(dt, hd)) pkv_hadamard(out, hd);
    pkv_dtype_from_f32(dt, buf, out, hd);
    pkv_dtype_to_f32(dt, out, buf, hd);
}

/* Attention of query q (hd) over positions [0, n) of one KV head (rows at stride kvdim):
 * out = softmax(q.k / sqrt(hd)) V, in double; the largest weight returned. */
static double attend(const float *q, const float *k, const float *v, uint32_t n, size_t kvdim,
                     uint32_t hd, double *w, double *out)
{
    double mx = -INFINITY, sum = 0, inv = 1.0 / sqrt((double)hd);
    for (uint32_t t = 0; t < n; t++) {
        double d = 0;
        for (uint32_t i = 0; i < hd; i++) d += (double)q[i] * k[t * kvdim + i];
        w[t] = d * inv;
        mx = w[t] > mx ? w[t] : mx;
    }
    for (uint32_t t = 0; t < n; t++) sum += (w[t] = exp(w[t] - mx));
    for (uint32_t i = 0; i < hd; i++) out[i] = 0;
    for (uint32_t t = 0; t < n; t++) {
        double p = w[t] / sum;
        for (uint32_t i = 0; i < hd; i++) out[i] += p * v[t * kvdim + i];
    }
    return 1.0 / sum; /* the largest weight: exp(0) / sum */
}

/* The worst layer's relative error of attention over K/V stored as dt against f32 (the
 * f32 run's queries, K and V); *top_weight: the f32 attention's mean largest weight. */
static double attn_err(const kq_run_t *r, const pkv_model_config_t *c, pkv_dtype_t dt,
                       double *top_weight)
{
    uint32_t hd = c->head_dim, group = c->n_heads / c->n_kv_heads, n = r->p0 + r->rows;
    size_t lkv = (size_t)r->ctx * r->kvdim;
    float *ks = malloc(lkv * sizeof(float)), *vs = malloc(lkv * sizeof(float));
    double *w = malloc((size_t)n * sizeof(double)), worst = 0, tops = 0;
    float qr[1024];
    double a[1024], b[1024];
    if (!ks || !vs || !w) {
        free(ks), free(vs), free(w);
        return -1; /* out of memory */
    }
    for (uint32_t l = 0; l < r->layers; l++) {
        const float *k = r->k + l * lkv, *v = r->v + l * lkv;
        for (size_t t = 0; t < (size_t)n * c->n_kv_heads; t++) {
            as_stored(dt, true, k + t * hd, hd, ks + t * hd);
            as_stored(dt, false, v + t * hd, hd, vs + t * hd);
        }
        double num = 0, den = 0;
        for (uint32_t row = 0; row < r->rows; row++) {
            const float *q = r->q + ((size_t)l * r->rows + row) * r->qdim;
            uint32_t np = r->p0 + row + 1;
            for (uint32_t h = 0; h < c->n_heads; h++) {
                size_t kh = (size_t)(h / group) * hd;
                tops += attend(q + (size_t)h * hd, k + kh, v + kh, np, r->kvdim, hd, w, a);
                memcpy(qr, q + (size_t)h * hd, hd * sizeof(float));
                if (pkv_dtype_rotates_keys(dt, hd)) pkv_hadamard(qr, hd);
                attend(qr, ks + kh, vs + kh, np, r->kvdim, hd, w, b);
                for (uint32_t i = 0; i < hd; i++) {
                    num += (a[i] - b[i]) * (a[i] - b[i]);
                    den += a[i] * a[i];
                }
            }
        }
        double e = den > 0 ? sqrt(num / den) : 0;
        worst = e > worst ? e : worst;
    }
    *top_weight = tops / ((double)r->layers * r->rows * c->n_heads);
    free(ks), free(vs), free(w);
    return worst;
}

static void log_softmax(const float *l, uint32_t V, double *out)
{
    double mx = -INFINITY, sum = 0;
    for (uint32_t v = 0; v < V; v++) mx = l[v] > mx ? l[v] : mx;
    for (uint32_t v = 0; v < V; v++) sum += exp((double)l[v] - mx);
    double lse = mx + log(sum);
    for (uint32_t v = 0; v < V; v++) out[v] = (double)l[v] - lse;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* KL(bf16 || dt) per step, its mean and p99, and top-1 agreement on clear steps. */
static int logit_stats(const kq_run_t *dt, const kq_run_t *bf, uint32_t steps, uint32_t V,
                       kq_case_t *out)
{
    double *lp = malloc((size_t)V * sizeof(double)), *lq = malloc((size_t)V * sizeof(double));
    double *kl = malloc((size_t)steps * sizeof(double));
    if (!lp || !lq || !kl) {
        free(lp), free(lq), free(kl);
        return -1;
    }
    uint32_t clear = 0, agree = 0;
    double sum = 0;
    for (uint32_t s = 0; s < steps; s++) {
        log_softmax(bf->logits + (size_t)s * V, V, lp);
        log_softmax(dt->logits + (size_t)s * V, V, lq);
        double k = 0;
        uint32_t b1 = 0, b2 = 1, d1 = 0;
        for (uint32_t v = 0; v < V; v++) {
            k += exp(lp[v]) * (lp[v] - lq[v]);
            if (lq[v] > lq[d1]) d1 = v;
        }
        if (lp[b2] > lp[b1]) b1 = 1, b2 = 0;
        for (uint32_t v = 2; v < V; v++) {
            if (lp[v] > lp[b1])
                b2 = b1, b1 = v;
            else if (lp[v] > lp[b2])
                b2 = v;
        }
        kl[s] = k > 0 ? k : 0;
        sum += kl[s];
        if (lp[b1] - lp[b2] >= TOP1_MARGIN) {
            clear++;
            agree += d1 == b1;
        }
    }
    qsort(kl, steps, sizeof(double), cmp_double);
    out->kl_mean = steps ? sum / steps : 0;
    out->kl_p99 = steps ? kl[(size_t)ceil(0.99 * steps) - 1] : 0;
    out->top1_clear = clear;
    out->top1_agree = clear ? (double)agree / clear : 1.0;
    free(lp), free(lq), free(kl);
    return 0;
}

static void run_free(kq_run_t *r)
{
    free(r->q);
    free(r->k);
    free(r->v);
    free(r->logits);
    memset(r, 0, sizeof(*r));
}

/* Every dtype at one (variant, context); appends N_DT - 1 cases (all but f32). */
static int error_cell(const kq_opts_t *o, const variant_t *v, uint32_t ctx, kq_case_t *cases,
                      size_t *nc)
{
    pkv_model_config_t mc;
    pkv_model_preset(o->preset, &mc);
    mc.vocab_size = 4096;
    mc.n_layers = o->layers;
    mc.k_outlier_gain = v->k_outlier_gain;
    mc.q_gain = v->q_gain;
    if (mc.max_seq_len < ctx + o->steps) mc.max_seq_len = ctx + o->steps;
    kq_run_t runs[N_DT] = {0};
    int32_t *toks = malloc((size_t)(ctx + o->steps) * sizeof(int32_t));
    pkv_model_t *m = NULL;
    int rc = -1;
    if (!toks) return -1;
    uint64_t seed = 0x6b7651 + ctx;
    for (uint32_t i = 0; i < ctx + o->steps; i++)
        toks[i] = (int32_t)(pkv_splitmix64(&seed) % mc.vocab_size);
    uint32_t rows = o->probe_rows < ctx ? o->probe_rows : ctx;
    for (int d = 0; d < N_DT; d++) {
        kq_run_t *r = &runs[d];
        *r = (kq_run_t){.p0 = ctx - rows,
                        .rows = rows,
                        .qdim = mc.n_heads * mc.head_dim,
                        .kvdim = mc.n_kv_heads * mc.head_dim,
                        .layers = mc.n_layers,
                        .ctx = ctx};
        bool ref = d == DT_F32;
        if (ref) {
            r->q = calloc((size_t)r->layers * rows * r->qdim, sizeof(float));
            r->k = calloc((size_t)r->layers * ctx * r->kvdim, sizeof(float));
            r->v = calloc((size_t)r->layers * ctx * r->kvdim, sizeof(float));
            if (!r->q || !r->k || !r->v) goto out;
        } else if (!(r->logits = calloc((size_t)o->steps * mc.vocab_size, sizeof(float)))) {
            goto out;
        }
        pkv_model_runtime_t rt = {.att_probe = kq_probe, .att_probe_arg = r};
        if (pkv_model_create_builtin(&mc, 1, &rt, &m)) goto out;
        if (pkv_cli_progress_enabled())
            fprintf(stderr, "\rbench kvquant: %s, context %u, %s...          ", v->name, ctx,
                    pkv_dtype_name(dts[d]));
        int e = kq_run(m, dts[d], toks, ctx, ref ? 0 : o->steps, r);
        pkv_model_destroy(m);
        m = NULL;
        if (e) goto out;
    }
    double tw, floor = attn_err(&runs[DT_F32], &mc, PKV_DTYPE_BF16, &tw);
    if (floor < 0) goto out;
    for (int d = DT_BF16; d < N_DT; d++) {
        kq_case_t *k = &cases[(*nc)++];
        *k = (kq_case_t){.variant = v->name, .dt = dts[d], .ctx = ctx, .top_weight = tw};
        k->attn_rel_err = d == DT_BF16 ? floor : attn_err(&runs[DT_F32], &mc, dts[d], &tw);
        if (k->attn_rel_err < 0) goto out;
        k->floor_multiple = floor > 0 ? k->attn_rel_err / floor : 0;
        if (logit_stats(&runs[d], &runs[DT_BF16], o->steps, mc.vocab_size, k)) goto out;
    }
    rc = 0;
out:
    for (int d = 0; d < N_DT; d++) run_free(&runs[d]);
    free(toks);
    return rc;
}

/* ---- decode speed ---------------------------------------------------------------------- */

typedef struct {
    const char *name;
    uint32_t n, ctx;
} dcase_t;
static const dcase_t dcases[] = {{"512x8", 8, 512}, {"4096x8", 8, 4096}, {"16384x1", 1, 16384}};
#define N_DCASE (sizeof(dcases) / sizeof(dcases[0]))

typedef struct {
    pkv_kv_t *kv;
    pkv_seq_t *seq[8];
    uint32_t n;
} dctx_t;

static void dctx_free(dctx_t *d)
{
    for (uint32_t i = 0; i < d->n; i++) pkv_seq_free(d->seq[i]);
    if (d->kv) pkv_kv_destroy(d->kv);
    memset(d, 0, sizeof(*d));
}

static int dctx_build(pkv_model_t *m, pkv_dtype_t dt, const dcase_t *c, uint32_t extra, dctx_t *d)
{
    pkv_kv_config_t kc = {.no_prefix_cache = true, .hugepages = true};
    pkv_model_geometry(m, dt, 16, &kc.geo);
    if (pkv_kv_create(&kc, &d->kv)) return -1;
    int32_t *toks = malloc((size_t)c->ctx * sizeof(int32_t));
    if (!toks) return -1;
    for (uint32_t i = 0; i < c->n; i++) {
        uint64_t s = 77 + i;
        for (uint32_t j = 0; j < c->ctx; j++)
            toks[j] = (int32_t)(pkv_splitmix64(&s) % pkv_model_config(m)->vocab_size);
        pkv_seq_params_t sp = {.tokens = toks, .n_tokens = 1, .reserve_tokens = c->ctx + extra};
        if (pkv_seq_create(d->kv, &sp, &d->seq[i], NULL)) break;
        d->n++;
        pkv_bm_fill_positions(m, dt, d->seq[i], toks, 0, c->ctx, 3000 + i);
    }
    free(toks);
    return d->n == c->n ? 0 : -1;
}

typedef struct {
    double ratio[N_DT][KQ_PAIRS]; /* bf16 seconds / dt seconds per pair (int8, fp8) */
    double med[N_DT], lo[N_DT], hi[N_DT];
} dres_t;

static int decode_case(pkv_model_t *m, const kq_opts_t *o, const dcase_t *c, dres_t *r)
{
    static const int arms[3] = {DT_BF16, DT_INT8, DT_FP8};
    dctx_t d[3] = {0};
    int rc = 0;
    uint32_t extra = (uint32_t)(3 * o->pairs * o->decode_steps + 4);
    for (int a = 0; a < 3 && !rc; a++) rc = dctx_build(m, dts[arms[a]], c, extra, &d[a]);
    for (uint64_t p = 0; p < o->pairs && !rc; p++) {
        double t[3], cpu;
        for (int k = 0; k < 3 && !rc; k++) {
            int a = (int)((k + p) % 3); /* each arm takes each turn */
            if (pkv_cli_progress_enabled())
                fprintf(stderr, "\rbench kvquant: decode %s %s, pair %u...          ", c->name,
                        pkv_dtype_name(dts[arms[a]]), (unsigned)p + 1);
            t[a] = pkv_bm_decode(m, d[a].kv, d[a].seq, c->n, (uint32_t)o->decode_steps, &cpu);
            if (t[a] < 0) rc = -1;
        }
        if (!rc)
            for (int a = 1; a < 3; a++) r->ratio[arms[a]][p] = t[0] / t[a];
    }
    for (int a = 1; a < 3 && !rc; a++) {
        int dt = arms[a];
        double cover;
        r->med[dt] = pkv_bench_median(r->ratio[dt], o->pairs);
        r->lo[dt] = r->hi[dt] = r->med[dt];
        pkv_bench_median_ci(r->ratio[dt], o->pairs, &r->lo[dt], &r->hi[dt], &cover);
    }
    for (int a = 0; a < 3; a++) dctx_free(&d[a]);
    return rc;
}

/* ---- report ---------------------------------------------------------------------------- */

static json_t *target(json_t *arr, const char *name, double value, double tgt, bool at_most)
{
    bool met = at_most ? value <= tgt : value >= tgt;
    json_array_append_new(arr, json_pack("{s:s, s:f, s:f, s:b}", "name", name, "value", value,
                                         "target", tgt, "met", met));
    printf("| %s | %.4g | %s %.4g | %s |\n", name, value, at_most ? "<=" : ">=", tgt,
           met ? "met" : "**not met**");
    return arr;
}

static void error_report(const kq_opts_t *o, const kq_case_t *cs, size_t n, json_t *root,
                         json_t *tg)
{
    printf("\n## Error against a bf16 KV cache (%s, %u layers, %u teacher-forced steps)\n\n"
           "| dtype | variant | context | top weight | attn rel err | x bf16 floor | KL mean | "
           "KL p99 | top-1 agree (clear steps) |\n|---|---|---|---|---|---|---|---|---|\n",
           o->preset, o->layers, o->steps);
    json_t *arr = json_array();
    for (size_t i = 0; i < n; i++) {
        const kq_case_t *k = &cs[i];
        printf("| %s | %s | %u | %.3f | %.4f | %.2f | %.2e | %.2e | %.3f (%u) |\n",
               pkv_dtype_name(k->dt), k->variant, k->ctx, k->top_weight, k->attn_rel_err,
               k->floor_multiple, k->kl_mean, k->kl_p99, k->top1_agree, k->top1_clear);
        json_array_append_new(arr, json_pack("{s:s, s:s, s:i, s:f, s:f, s:f, s:f, s:f, s:f, s:i}",
                                             "dtype", pkv_dtype_name(k->dt), "variant", k->variant,
                                             "context", (int)k->ctx, "top_weight", k->top_weight,
                                             "attn_rel_err", k->attn_rel_err, "floor_multiple",
                                             k->floor_multiple, "kl_mean", k->kl_mean, "kl_p99",
                                             k->kl_p99, "top1_agree", k->top1_agree,
                                             "top1_clear_steps", (int)k->top1_clear));
    }
    json_object_set_new(root, "cases", arr);
    /* int8's targets: the worst over the contexts, per variant */
    printf("\n| target | value | target | |\n|---|---|---|---|\n");
    double kl = 0;
    for (size_t v = 0; v < N_VAR; v++) {
        double err = 0, fm = 0;
        for (size_t i = 0; i < n; i++) {
            if (cs[i].dt != PKV_DTYPE_INT8 || strcmp(cs[i].variant, variants[v].name)) continue;
            err = fmax(err, cs[i].attn_rel_err);
            fm = fmax(fm, cs[i].floor_multiple);
            kl = fmax(kl, cs[i].kl_mean);
        }
        char name[96];
        snprintf(name, sizeof(name), "int8_attn_rel_err_%s", variants[v].name);
        target(tg, name, err, variants[v].att_target, true);
        if (v == 0) target(tg, "int8_floor_multiple_flat", fm, 5.0, true);
    }
    target(tg, "int8_kl_mean", kl, 1e-3, true);
}

static void decode_report(const kq_opts_t *o, dres_t *dr, json_t *root, json_t *tg)
{
    printf("\n## Decode: paged int8 and fp8 / paged bf16 (llama-3.2-1b, %u pairs of %u steps)\n\n"
           "| case | dtype | over bf16 (median) | 95 %% interval |\n|---|---|---|---|\n",
           (unsigned)o->pairs, (unsigned)o->decode_steps);
    json_t *arr = json_array();
    static const double tgt[N_DCASE] = {0.9, 1.0, 1.0};
    for (size_t c = 0; c < N_DCASE; c++) {
        for (int dt = DT_INT8; dt <= DT_FP8; dt++) {
            printf("| %s | %s | %.3f | %.3f-%.3f |\n", dcases[c].name, pkv_dtype_name(dts[dt]),
                   dr[c].med[dt], dr[c].lo[dt], dr[c].hi[dt]);
            json_t *pairs = json_array();
            for (uint64_t p = 0; p < o->pairs; p++)
                json_array_append_new(pairs, json_real(dr[c].ratio[dt][p]));
            json_array_append_new(arr, json_pack("{s:s, s:s, s:f, s:f, s:f, s:o}", "case",
                                                 dcases[c].name, "dtype", pkv_dtype_name(dts[dt]),
                                                 "over_bf16", dr[c].med[dt], "lo", dr[c].lo[dt],
                                                 "hi", dr[c].hi[dt], "pairs", pairs));
        }
    }
    json_object_set_new(root, "decode", arr);
    printf("\n| target | value | target | |\n|---|---|---|---|\n");
    for (size_t c = 0; c < N_DCASE; c++) {
        char name[64];
        snprintf(name, sizeof(name), "int8_decode_%s", dcases[c].name);
        target(tg, name, dr[c].med[DT_INT8], tgt[c], false);
    }
}

/* -1: parsed, run; otherwise the exit code (usage printed). */
static int parse_opts(int argc, char **argv, kq_opts_t *o)
{
    *o = (kq_opts_t){.preset = "llama-3.2-1b",
                     .layers = 4,
                     .steps = 256,
                     .probe_rows = 32,
                     .ctxs = {512, 4096, 16384},
                     .n_ctx = 3,
                     .pairs = 7,
                     .decode_steps = 8};
    const char *cmd = "bench kvquant";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t x;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: pagekv bench kvquant [--preset NAME] [--layers N] [--contexts "
                   "A,B,..] [--steps N]\n"
                   "         [--probe-rows N] [--decode-pairs N] [--decode-steps N] "
                   "[--no-error] [--no-decode] [--json FILE]\n"
                   "Error of int8 and fp8 KV against bf16 (flat, outliers, sharp variants), and\n"
                   "paged int8 / fp8 decode speed over paged bf16. Defaults: llama-3.2-1b, 4 "
                   "layers,\ncontexts 512,4096,16384, 256 steps, 7 decode pairs of 8 steps.\n");
            return 0;
        } else if (!strcmp(a, "--no-error")) {
            o->no_error = true;
            continue;
        } else if (!strcmp(a, "--no-decode")) {
            o->no_decode = true;
            continue;
        } else if (!v) {
            return pkv_cli_usage_error(cmd, "unknown flag or missing value: %s", a);
        } else if (!strcmp(a, "--json")) {
            o->json = v;
        } else if (!strcmp(a, "--preset")) {
            pkv_model_config_t c;
            if (pkv_model_preset(v, &c)) return pkv_cli_usage_error(cmd, "unknown preset '%s'", v);
            o->preset = v;
        } else if (!strcmp(a, "--layers")) {
            if (pkv_cli_flag_u32(cmd, a, v, 1, MAX_LAYERS, &o->layers)) return 2;
        } else if (!strcmp(a, "--steps")) {
            if (pkv_cli_flag_u32(cmd, a, v, 1, 4096, &o->steps)) return 2;
        } else if (!strcmp(a, "--probe-rows")) {
            if (pkv_cli_flag_u32(cmd, a, v, 1, 512, &o->probe_rows)) return 2;
        } else if (!strcmp(a, "--decode-pairs")) {
            if (pkv_cli_parse_u64(v, 1, KQ_PAIRS, &o->pairs))
                return pkv_cli_usage_error(cmd, "--decode-pairs: 1..%d, not '%s'", KQ_PAIRS, v);
        } else if (!strcmp(a, "--decode-steps")) {
            if (pkv_cli_parse_u64(v, 1, 1024, &o->decode_steps))
                return pkv_cli_usage_error(cmd, "--decode-steps: 1..1024, not '%s'", v);
        } else if (!strcmp(a, "--contexts")) {
            char buf[128];
            snprintf(buf, sizeof(buf), "%s", v);
            o->n_ctx = 0;
            for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
                if (o->n_ctx == MAX_CTX || pkv_cli_parse_u64(t, 16, 65536, &x))
                    return pkv_cli_usage_error(
                        cmd, "--contexts: up to %d counts in [16, 65536], not '%s'", MAX_CTX, v);
                o->ctxs[o->n_ctx++] = (uint32_t)x;
            }
            if (!o->n_ctx) return pkv_cli_usage_error(cmd, "--contexts: empty");
        } else {
            return pkv_cli_usage_error(cmd, "unknown flag: %s", a);
        }
        i++;
    }
    return -1;
}

int pkv_bench_kvquant(int argc, char **argv)
{
    kq_opts_t o;
    int prc = parse_opts(argc, argv, &o);
    if (prc >= 0) return prc;
    char cpu[200];
    pkv_prim_cpu_model(cpu, sizeof(cpu));
    printf("# pagekv bench kvquant\n\nCPU: %s\n", cpu);
    json_t *root = json_pack("{s:s, s:s, s:i, s:i}", "cpu_model", cpu, "preset", o.preset, "layers",
                             (int)o.layers, "steps", (int)o.steps);
    json_t *tg = json_array();
    int rc = 0;
    size_t nc = 0;
    kq_case_t *cs = calloc(N_VAR * MAX_CTX * N_DT, sizeof(*cs));
    dres_t *dr = calloc(N_DCASE, sizeof(*dr));
    if (!cs || !dr) rc = -1;
    for (size_t v = 0; !o.no_error && v < N_VAR && !rc; v++)
        for (uint32_t c = 0; c < o.n_ctx && !rc; c++)
            rc = error_cell(&o, &variants[v], o.ctxs[c], cs, &nc);
    if (!rc && !o.no_error) error_report(&o, cs, nc, root, tg);
    if (!rc && !o.no_decode) {
        pkv_model_config_t lc;
        pkv_model_preset("llama-3.2-1b", &lc);
        lc.vocab_size = 16384;
        lc.max_seq_len = 16384 + 1024;
        pkv_model_t *m = NULL;
        rc = pkv_model_create_builtin(&lc, 1, NULL, &m) ? -1 : 0;
        for (size_t c = 0; c < N_DCASE && !rc; c++) rc = decode_case(m, &o, &dcases[c], &dr[c]);
        pkv_model_destroy(m);
        if (!rc) decode_report(&o, dr, root, tg);
    }
    if (pkv_cli_progress_enabled()) fprintf(stderr, "\r%60s\r", "");
    json_object_set_new(root, "targets", tg);
    if (!rc && o.json && pkv_bench_write_json(o.json, root)) rc = 1;
    json_decref(root);
    free(cs);
    free(dr);
    if (rc < 0) {
        fprintf(stderr, "pagekv bench kvquant: failed (out of memory?)\n");
        rc = 1;
    }
    return rc;
}
