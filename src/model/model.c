/*
 * model: the forward pass of a llama-architecture decoder over a pkv_kv_t, and the
 * built-in models (presets with real KV geometry, seeded weights).
 *
 * A forward call is cut into passes of at most `chunk` rows (a row is one token of one
 * sequence). A pass runs every layer for its rows: RMSNorm, fused QKV matmul, RoPE,
 * K/V written into the cache through pkv_seq_slot (in the cache dtype), attention over
 * the runs pkv_seq_runs returns (paged: one per block; dense: one), output projection,
 * RMSNorm, fused W1|W3 matmul, SwiGLU, W2 matmul. Rows of one sequence in a later
 * pass see the K/V an earlier pass wrote, so splitting into passes is the same as
 * chunked prefill. Token ids are appended only at the end, after every layer's K/V of
 * every new position is written.
 *
 * Over a tensor-parallel cache (tp ranks, each holding a shard of the KV heads): K/V of
 * head g is written into every rank that holds g, and head g's attention reads the first
 * rank holding it (pkv_seq_runs_rank). The per-head arithmetic is the same as at tp = 1,
 * so tokens and logits do not depend on tp.
 *
 * Why results never depend on batching, runs, chunking or threads: each output element
 * has one fixed arithmetic path (kernels.h), each parallel task writes disjoint
 * outputs, attention scores of a query go to a scratch array indexed by position, the
 * softmax runs over fixed spans of positions, V is folded in position order within a span,
 * and the spans are merged in order by one function.
 */
#include "model/model_int.h"

#include "core/core.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LOGIT_ROWS 16u
/* Below this many multiply-adds a parallel loop runs on the calling thread: waking a
 * worker costs more than it saves (and results do not depend on it). Low enough that at
 * batch 1 the QKV, output and W1|W3 matrix-vector products run on the pool: they read
 * ~1.4 MiB of weights per layer, faster on two threads than on one (docs/design/model.md,
 * "Speed"). */
#define PARALLEL_MIN_MACS (1u << 16)
#define MM_ROW_BLOCK      32u
#define MM_COL_BLOCK      64u
/* Attention: row pairs per task, and the K (or V) bytes of a task's heads per window
 * (att_task), in at most WINDOW_RUNS runs. A segment whose K/V of one layer reaches
 * LONG_KV_BYTES (about half a server's L3: the layer no longer stays in cache between the
 * blocks that read it) takes BLOCK_PAIRS_LONG pairs a block, so a prefill chunk reads it
 * from memory 4x less often (16k-token prefill, paged: docs/design/model.md, "Speed");
 * shorter ones keep BLOCK_PAIRS, and with it the scores scratch they touch. */
#define BLOCK_PAIRS      4u
#define BLOCK_PAIRS_LONG 16u
#define LONG_KV_BYTES    ((size_t)16 << 20)
#define WINDOW_BYTES     ((size_t)256 << 10)
#define WINDOW_RUNS      64u
/* Positions per softmax span (kernels.h): a row's attention is computed span by span and
 * the spans merged in order, so a decode row's spans can run as tasks of their own. */
#define ATT_SPAN 2048u

struct pkv_model_row {
    uint32_t seg;
    uint32_t pos;
    int32_t token;
};

struct pkv_model_pair {
    uint32_t row;
    bool two; /* row + 1 (same segment, next position) too */
};

struct pkv_model_seg {
    pkv_seq_t *seq;
    uint32_t item;
    uint32_t pos0; /* position of the segment's first row */
    uint32_t n;    /* rows */
    uint32_t row0;
    uint32_t run0, nruns; /* into m->runs for the current layer */
    bool logits;          /* the item's last token is this segment's last row */
};

/* ---- presets ------------------------------------------------------------------------ */

typedef struct {
    const char *name;
    pkv_model_config_t cfg;
} preset_t;

/* Only the KV geometry (layers, kv_heads, head_dim) follows the real model; query heads
 * equal KV heads and the residual / MLP widths are small, so compute stays cheap while
 * the KV bytes per token are the real model's. */
static const preset_t presets[] = {
    {"tiny",
     {.dim = 32,
      .hidden_dim = 64,
      .n_layers = 2,
      .n_heads = 4,
      .n_kv_heads = 2,
      .head_dim = 16,
      .max_seq_len = 4096,
      .rope_theta = 10000.0f,
      .norm_eps = 1e-5f}},
    {"llama-3.2-1b",
     {.dim = 128,
      .hidden_dim = 256,
      .n_layers = 16,
      .n_heads = 8,
      .n_kv_heads = 8,
      .head_dim = 64,
      .max_seq_len = 32768,
      .rope_theta = 500000.0f,
      .norm_eps = 1e-5f}},
    {"qwen3-0.6b",
     {.dim = 128,
      .hidden_dim = 256,
      .n_layers = 28,
      .n_heads = 8,
      .n_kv_heads = 8,
      .head_dim = 128,
      .max_seq_len = 32768,
      .rope_theta = 1000000.0f,
      .norm_eps = 1e-6f}},
};

const char *const *pkv_model_preset_names(void)
{
    static const char *const names[] = {"tiny", "llama-3.2-1b", "qwen3-0.6b", NULL};
    return names;
}

int pkv_model_preset(const char *name, pkv_model_config_t *out)
{
    if (!out) return PKV_ERR_INVALID;
    if (!name) name = "tiny";
    for (size_t i = 0; i < PKV_ARRAY_LEN(presets); i++) {
        if (!strcmp(presets[i].name, name)) {
            *out = presets[i].cfg;
            return PKV_OK;
        }
    }
    return PKV_ERR_NOTFOUND;
}

/* ---- allocation ---------------------------------------------------------------------- */

static uint32_t pad16(uint32_t n)
{
    return (n + 15u) & ~15u;
}

static int config_check(const pkv_model_config_t *c)
{
    const char *why = NULL;
    if (!c->dim || c->dim > 65536)
        why = "dim must be in [1, 65536]";
    else if (!c->hidden_dim || c->hidden_dim > 262144)
        why = "hidden_dim must be in [1, 262144]";
    else if (!c->n_layers || c->n_layers > 1024)
        why = "n_layers must be in [1, 1024]";
    else if (!c->n_kv_heads || c->n_kv_heads > 1024)
        why = "n_kv_heads must be in [1, 1024]";
    else if (!c->n_heads || c->n_heads % c->n_kv_heads)
        why = "n_heads must be a positive multiple of n_kv_heads";
    else if (c->n_heads > 1024)
        why = "n_heads must be at most 1024";
    else if (!c->head_dim || c->head_dim % 2 || c->head_dim > 1024)
        why = "head_dim must be even and in [2, 1024]";
    else if (!c->vocab_size || c->vocab_size > (1u << 22))
        why = "vocab_size must be in [1, 4M]";
    else if (!c->max_seq_len || c->max_seq_len > (1u << 22))
        why = "max_seq_len must be in [1, 4M]";
    else if (!(c->rope_theta > 1.0f) || !isfinite(c->rope_theta))
        why = "rope_theta must be > 1";
    else if (!(c->norm_eps > 0.0f) || !(c->norm_eps < 1.0f))
        why = "norm_eps must be in (0, 1)";
    else if ((uint64_t)c->n_heads * c->head_dim > 65536)
        why = "n_heads * head_dim too large";
    else if (!(c->k_outlier_gain >= 0.0f && c->k_outlier_gain <= 1000.0f) ||
             !(c->q_gain >= 0.0f && c->q_gain <= 1000.0f))
        why = "k_outlier_gain and q_gain must be in [0, 1000]";
    if (why) {
        PKV_LOGE("model", "bad model config: %s", why);
        return PKV_ERR_INVALID;
    }
    return PKV_OK;
}

static void *alloc_floats(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, (n ? n : 1) * sizeof(float))) return NULL;
    memset(p, 0, (n ? n : 1) * sizeof(float));
    return p;
}

void pkv_model_destroy(pkv_model_t *m)
{
    if (!m) return;
    model_tpool_destroy(m->pool);
    free(m->runs);
    free(m->pairs);
    free(m->blocks);
    free(m->segs);
    free(m->rows);
    free(m->scores);
    free(m->att_aux);
    free(m->dtask0);
    free(m->dspan0);
    free(m->dpart);
    free(m->dstat);
    free(m->lout);
    free(m->lrows);
    free(m->rope);
    free(m->hid);
    free(m->h13);
    free(m->tmp);
    free(m->att);
    free(m->qkv);
    free(m->xb);
    free(m->x);
    free(m->layers);
    free(m->weights);
    free(m);
}

int model_alloc(const pkv_model_config_t *cfg, const pkv_model_runtime_t *rt, pkv_model_t **out)
{
    int rc = config_check(cfg);
    if (rc) return rc;
    pkv_model_runtime_t r = rt ? *rt : (pkv_model_runtime_t){0};
    if (r.threads > 64 || r.chunk_tokens > 65536) {
        PKV_LOGE("model", "bad runtime: threads %u (max 64), chunk_tokens %u (max 65536)",
                 r.threads, r.chunk_tokens);
        return PKV_ERR_INVALID;
    }
    pkv_model_t *m = calloc(1, sizeof(*m));
    if (!m) return PKV_ERR_NOMEM;
    m->cfg = *cfg;
    const pkv_model_config_t *c = &m->cfg;
    m->kern = r.portable ? NULL : model_kernels_avx2(c->head_dim);
    if (!m->kern) m->kern = model_kernels_portable();
    if (!r.threads) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        r.threads = n < 1 ? 1 : n > 8 ? 8 : (uint32_t)n;
    }
    m->threads = r.threads;
    m->chunk = r.chunk_tokens ? r.chunk_tokens : 128;
    m->rt = r;
    m->qdim = c->n_heads * c->head_dim;
    m->kvdim = c->n_kv_heads * c->head_dim;
    m->ld_d = pad16(c->dim);
    m->ld_qkv = pad16(m->qdim + 2 * m->kvdim);
    m->ld_q = pad16(m->qdim);
    m->ld_h2 = pad16(2 * c->hidden_dim);
    m->ld_v = pad16(c->vocab_size);

    size_t D = c->dim, H = c->hidden_dim, L = c->n_layers;
    size_t per_layer =
        D + D * m->ld_qkv + (size_t)m->qdim * m->ld_d + D + D * m->ld_h2 + H * m->ld_d;
    m->weights_floats = (size_t)c->vocab_size * D + L * per_layer + D + D * m->ld_v;
    rc = PKV_ERR_NOMEM;
    if (!(m->weights = alloc_floats(m->weights_floats))) goto fail;
    if (!(m->layers = calloc(L, sizeof(*m->layers)))) goto fail;
    float *p = m->weights;
    m->emb = p, p += (size_t)c->vocab_size * D;
    for (size_t l = 0; l < L; l++) {
        model_layer_t *ly = &m->layers[l];
        ly->rms_att = p, p += D;
        ly->wqkv = p, p += D * m->ld_qkv;
        ly->wo = p, p += (size_t)m->qdim * m->ld_d;
        ly->rms_ffn = p, p += D;
        ly->w13 = p, p += D * m->ld_h2;
        ly->w2 = p, p += H * m->ld_d;
    }
    m->rms_final = p, p += D;
    m->wcls = p, p += D * m->ld_v;
    PKV_ASSERT((size_t)(p - m->weights) == m->weights_floats);

    size_t C = m->chunk;
    m->max_spans = PKV_DIV_UP(c->max_seq_len, ATT_SPAN);
    /* att_task's per thread: partials (rows x qdim), then span maxima and sums (rows x
     * n_heads x max_spans each), then 1 / sum (rows x n_heads) */
    m->att_aux_floats = (size_t)2 * BLOCK_PAIRS_LONG *
                        (m->qdim + (size_t)c->n_heads * (2 * (size_t)m->max_spans + 1));
    if (!(m->x = alloc_floats(C * m->ld_d)) || !(m->xb = alloc_floats(C * m->ld_d)) ||
        !(m->qkv = alloc_floats(C * m->ld_qkv)) || !(m->att = alloc_floats(C * m->ld_q)) ||
        !(m->tmp = alloc_floats(C * m->ld_d)) || !(m->h13 = alloc_floats(C * m->ld_h2)) ||
        !(m->hid = alloc_floats(C * H)) || !(m->rope = alloc_floats(C * c->head_dim)) ||
        !(m->lrows = alloc_floats(LOGIT_ROWS * m->ld_d)) ||
        !(m->lout = alloc_floats(LOGIT_ROWS * (size_t)m->ld_v)) ||
        !(m->scores =
              calloc((size_t)m->threads * 2 * BLOCK_PAIRS_LONG * c->n_heads * c->max_seq_len,
                     sizeof(float))) ||
        !(m->att_aux = calloc((size_t)m->threads * m->att_aux_floats, sizeof(float))) ||
        !(m->dtask0 = calloc(C + 1, sizeof(*m->dtask0))) ||
        !(m->dspan0 = calloc(C + 1, sizeof(*m->dspan0))) ||
        !(m->rows = calloc(C, sizeof(*m->rows))) || !(m->segs = calloc(C, sizeof(*m->segs))) ||
        !(m->pairs = calloc(C, sizeof(*m->pairs))) ||
        !(m->blocks = calloc(C + 1, sizeof(*m->blocks))))
        goto fail;
    /* Touched now (a model's memory at rest): the scores planes a 4-pair block uses, and the
     * spans' scratch; the 16-pair blocks' further planes only when a long prompt uses them. */
    size_t plane = (size_t)c->n_heads * c->max_seq_len;
    for (uint32_t t = 0; t < m->threads; t++)
        memset(m->scores + (size_t)t * 2 * BLOCK_PAIRS_LONG * plane, 0,
               2 * BLOCK_PAIRS * plane * sizeof(float));
    memset(m->att_aux, 0, (size_t)m->threads * m->att_aux_floats * sizeof(float));
    if ((rc = model_tpool_create(m->threads, "pkv-model", &m->pool))) goto fail;
    *out = m;
    return PKV_OK;
fail:
    pkv_model_destroy(m);
    return rc;
}

/* ---- built-in weights -------------------------------------------------------------------- */

/* rows x cols of uniform(-scale, scale) into a matrix with leading dimension ld; the
 * stream depends only on (seed, tensor id), so tensors are independent of each other. */
static void fill_uniform(float *w, size_t rows, size_t cols, size_t ld, uint64_t seed,
                         uint64_t tensor, float scale)
{
    uint64_t s = seed ^ (tensor * 0xd1b54a32d192ed03ull);
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < cols; c++) {
            float u = (float)(pkv_splitmix64(&s) >> 40) * (1.0f / 16777216.0f); /* [0, 1) */
            w[r * ld + c] = (2.0f * u - 1.0f) * scale;
        }
}

/* The config's measurement knobs on a layer's QKV columns (pkv_model_config_t). */
static void synthetic_gains(pkv_model_t *m, float *wqkv)
{
    const pkv_model_config_t *c = &m->cfg;
    float qg = c->q_gain, kg = c->k_outlier_gain;
    for (size_t r = 0; r < c->dim; r++) {
        float *w = wqkv + r * m->ld_qkv;
        for (uint32_t i = 0; qg != 0.0f && qg != 1.0f && i < m->qdim; i++) w[i] *= qg;
        for (uint32_t h = 0; kg != 0.0f && kg != 1.0f && h < c->n_kv_heads; h++) {
            float *k = w + m->qdim + (size_t)h * c->head_dim;
            k[c->head_dim - 2] *= kg;
            k[c->head_dim - 1] *= kg;
        }
    }
}

int pkv_model_create_builtin(const pkv_model_config_t *cfg, uint64_t seed,
                             const pkv_model_runtime_t *rt, pkv_model_t **out)
{
    if (!cfg || !out) return PKV_ERR_INVALID;
    pkv_model_t *m;
    int rc = model_alloc(cfg, rt, &m);
    if (rc) return rc;
    const pkv_model_config_t *c = &m->cfg;
    size_t D = c->dim, H = c->hidden_dim;
    /* uniform(-a, a) has variance a^2 / 3: a = sqrt(3 / fan_in) keeps unit variance. */
    float s_d = sqrtf(3.0f / (float)D), s_q = sqrtf(3.0f / (float)m->qdim);
    float s_h = sqrtf(3.0f / (float)H);
    float depth = 1.0f / sqrtf(2.0f * (float)c->n_layers);
    uint64_t t = 1;
    fill_uniform(m->emb, c->vocab_size, D, D, seed, t++, 1.0f);
    for (uint32_t l = 0; l < c->n_layers; l++) {
        model_layer_t *ly = &m->layers[l];
        for (size_t i = 0; i < D; i++) ly->rms_att[i] = ly->rms_ffn[i] = 1.0f;
        fill_uniform(ly->wqkv, D, m->qdim + 2 * m->kvdim, m->ld_qkv, seed, t++, s_d);
        synthetic_gains(m, ly->wqkv);
        fill_uniform(ly->wo, m->qdim, D, m->ld_d, seed, t++, s_q * depth);
        fill_uniform(ly->w13, D, 2 * H, m->ld_h2, seed, t++, s_d);
        fill_uniform(ly->w2, H, D, m->ld_d, seed, t++, s_h * depth);
    }
    for (size_t i = 0; i < D; i++) m->rms_final[i] = 1.0f;
    /* A classifier gain of 4 gives peaked, varied next-token distributions. */
    fill_uniform(m->wcls, D, c->vocab_size, m->ld_v, seed, t++, 4.0f * s_d);
    *out = m;
    return PKV_OK;
}

const pkv_model_config_t *pkv_model_config(const pkv_model_t *m)
{
    return &m->cfg;
}

const char *pkv_model_kernels(const pkv_model_t *m)
{
    return m->kern->name;
}

uint32_t pkv_model_threads(const pkv_model_t *m)
{
    return m->threads;
}

void pkv_model_geometry(const pkv_model_t *m, pkv_dtype_t dtype, uint32_t block_tokens,
                        pkv_geometry_t *out)
{
    *out = (pkv_geometry_t){.layers = m->cfg.n_layers,
                            .kv_heads = m->cfg.n_kv_heads,
                            .head_dim = m->cfg.head_dim,
                            .block_tokens = block_tokens,
                            .dtype = dtype};
}

/* ---- forward --------------------------------------------------------------------------- */

typedef struct {
    const model_kernels_t *k;
    const float *x;
    size_t ldx;
    uint32_t rows, K;
    const float *w;
    size_t ldw;
    uint32_t cols; /* multiple of 16 */
    float *y;
    size_t ldy;
    uint32_t n_cb;
} mm_job_t;

static void mm_task(void *arg, uint32_t task, uint32_t thread)
{
    (void)thread;
    const mm_job_t *j = arg;
    uint32_t r0 = (task / j->n_cb) * MM_ROW_BLOCK;
    uint32_t c0 = (task % j->n_cb) * MM_COL_BLOCK;
    uint32_t rows = PKV_MIN(MM_ROW_BLOCK, j->rows - r0);
    uint32_t c1 = PKV_MIN(c0 + MM_COL_BLOCK, j->cols);
    j->k->matmul(j->x + r0 * j->ldx, j->ldx, rows, j->K, j->w, j->ldw, c0, c1, j->y + r0 * j->ldy,
                 j->ldy);
}

static void matmul(pkv_model_t *m, const float *x, size_t ldx, uint32_t rows, uint32_t K,
                   const float *w, size_t ldw, float *y, size_t ldy)
{
    mm_job_t j = {.k = m->kern,
                  .x = x,
                  .ldx = ldx,
                  .rows = rows,
                  .K = K,
                  .w = w,
                  .ldw = ldw,
                  .cols = (uint32_t)ldw,
                  .y = y,
                  .ldy = ldy};
    j.n_cb = PKV_DIV_UP(j.cols, MM_COL_BLOCK);
    uint32_t n_rb = PKV_DIV_UP(rows, MM_ROW_BLOCK);
    if ((uint64_t)rows * K * ldw < PARALLEL_MIN_MACS) {
        for (uint32_t t = 0; t < n_rb * j.n_cb; t++) mm_task(&j, t, 0);
        return;
    }
    model_tpool_run(m->pool, mm_task, &j, n_rb * j.n_cb);
}

static void rmsnorm(const pkv_model_t *m, const float *x, const float *w, float *o)
{
    uint32_t n = m->cfg.dim;
    float ss = m->kern->sumsq(x, n) / (float)n + m->cfg.norm_eps;
    float inv = 1.0f / sqrtf(ss);
    for (uint32_t i = 0; i < n; i++) o[i] = w[i] * (inv * x[i]);
}

/* Rotate adjacent pairs (llama2.c's convention) of n_heads vectors of head_dim. */
static void rope_apply(float *v, uint32_t n_heads, uint32_t hd, const float *cs)
{
    for (uint32_t h = 0; h < n_heads; h++) {
        float *q = v + h * hd;
        for (uint32_t i = 0; i < hd; i += 2) {
            float c = cs[i], s = cs[i + 1];
            float a = q[i], b = q[i + 1];
            q[i] = a * c - b * s;
            q[i + 1] = a * s + b * c;
        }
    }
}

typedef struct {
    pkv_model_t *m;
    pkv_dtype_t dt;
    size_t rb; /* bytes of one K/V row (pkv_dtype_row_bytes) */
    float scale;
    uint64_t macs;           /* per layer (the parallel-loop threshold) */
    uint32_t splits;         /* head groups per block */
    uint32_t dec_rows;       /* a decode pass by span (dec_task): its rows; else 0 */
    uint32_t heads_per_task; /* KV heads per group */
} att_job_t;

/* The runs of [w0, *w1) from runs[*at] on (*at: advanced to the first reaching w0), each
 * clipped to the window, at most WINDOW_RUNS; where they run out, *w1 is cut back to the
 * end of the last. */
static uint32_t window_runs(const pkv_kv_run_t *runs, uint32_t nruns, uint32_t *at, uint32_t w0,
                            uint32_t *w1, size_t ts, pkv_kv_run_t *out)
{
    uint32_t i = *at, got = 0;
    while (i < nruns && runs[i].pos + runs[i].n_tokens <= w0) i++;
    *at = i;
    for (; i < nruns && runs[i].pos < *w1 && got < WINDOW_RUNS; i++) {
        const pkv_kv_run_t *r = &runs[i];
        uint32_t p0 = r->pos > w0 ? r->pos : w0, e = r->pos + r->n_tokens;
        size_t skip = (size_t)(p0 - r->pos) * ts;
        out[got++] = (pkv_kv_run_t){.k = (const char *)r->k + skip,
                                    .v = (const char *)r->v + skip,
                                    .pos = p0,
                                    .n_tokens = (e < *w1 ? e : *w1) - p0,
                                    .head_stride = r->head_stride};
    }
    if (got == WINDOW_RUNS && i < nruns && runs[i].pos < *w1) *w1 = runs[i].pos;
    return got;
}

/* ---- attention ------------------------------------------------------------------------ */

/* The spans of one query head merged (kernels.h): w[c] holds span c's maximum and becomes
 * its weight expf(w[c] - M); returns 1 / (the fold of sum[c] * w[c]). One function for
 * every path, so a row's result does not depend on how its spans were computed. */
static float span_weights(float *w, const float *sum, size_t sum_stride, uint32_t nsp)
{
    float M = -INFINITY, t = 0.0f;
    for (uint32_t c = 0; c < nsp; c++) M = w[c] > M ? w[c] : M;
    for (uint32_t c = 0; c < nsp; c++) {
        w[c] = expf(w[c] - M);
        t = t + sum[c * sum_stride] * w[c];
    }
    return 1.0f / t;
}

/* acc[d] = acc[d] + part[d] * f (a span's partial folded in), and out[d] * inv. */
static void span_fold(float *acc, const float *part, float f, uint32_t n)
{
    for (uint32_t d = 0; d < n; d++) acc[d] = acc[d] + part[d] * f;
}
static void span_scale(float *out, float inv, uint32_t n)
{
    for (uint32_t d = 0; d < n; d++) out[d] = out[d] * inv;
}

/* One row slot of att_task's per-thread scratch: its spans' partials, maxima (then
 * weights), sums and 1 / sum per query head. */
typedef struct {
    float *part; /* nq x hd */
    float *w;    /* nq x max_spans */
    float *sum;  /* nq x max_spans */
    float *inv;  /* nq */
} span_slot_t;

static span_slot_t span_slot(const pkv_model_t *m, uint32_t thread, uint32_t slot)
{
    uint32_t H = m->cfg.n_heads, R = 2 * BLOCK_PAIRS_LONG;
    float *base = m->att_aux + (size_t)thread * m->att_aux_floats;
    float *w0 = base + (size_t)R * m->qdim;
    size_t ws = (size_t)H * m->max_spans;
    return (span_slot_t){.part = base + (size_t)slot * m->qdim,
                         .w = w0 + slot * ws,
                         .sum = w0 + (R + slot) * ws,
                         .inv = w0 + 2 * R * ws + (size_t)slot * H};
}

/* After a row's scores (s: query q at s + q S): each span's exp, maximum and sum, and
 * the row's span weights and 1 / sum per query head. */
static void row_spans(const pkv_model_t *m, float *s, uint32_t nq, uint32_t n,
                      const span_slot_t *sl)
{
    uint32_t S = m->cfg.max_seq_len, nsp = PKV_DIV_UP(n, ATT_SPAN);
    for (uint32_t q = 0; q < nq; q++) {
        float *w = sl->w + (size_t)q * m->max_spans, *sum = sl->sum + (size_t)q * m->max_spans;
        for (uint32_t c = 0; c < nsp; c++) {
            uint32_t p0 = c * ATT_SPAN, len = PKV_MIN(ATT_SPAN, n - p0);
            m->kern->span_exp(s + (size_t)q * S + p0, len, &w[c], &sum[c]);
        }
        sl->inv[q] = span_weights(w, sum, 1, nsp);
    }
}

/* Span c of a row done: its partials folded into out (weighted), then zeroed. */
static void row_fold(const pkv_model_t *m, const span_slot_t *sl, uint32_t nq, uint32_t c,
                     float *out)
{
    uint32_t hd = m->cfg.head_dim;
    for (uint32_t q = 0; q < nq; q++)
        span_fold(out + (size_t)q * hd, sl->part + (size_t)q * hd,
                  sl->w[(size_t)q * m->max_spans + c], hd);
    memset(sl->part, 0, (size_t)nq * hd * sizeof(float));
}

/* A task is a block of up to BLOCK_PAIRS (or _LONG) row pairs of one segment (a pair:
 * one or two rows at adjacent positions, which share each K/V load) and a group of KV
 * heads with their query heads. A block walks the positions in windows of about
 * WINDOW_BYTES of its heads' K (then V), every pair reading a window while it is in L2:
 * at long context the pairs of a prefill chunk read K/V from memory once per block rather
 * than once each. Whole groups of heads per task let a paged block's K (then V) region of
 * one layer be read front to back. The windows change no value: scores are per position,
 * the spans' exps run once all are in, and V folds a span's windows in ascending order
 * into partials that round-trip through memory, folded into the output at the span's
 * end (kernels.h). */
static void att_task(void *arg, uint32_t task, uint32_t thread)
{
    const att_job_t *j = arg;
    pkv_model_t *m = j->m;
    const pkv_model_config_t *c = &m->cfg;
    uint32_t hd = c->head_dim, group = c->n_heads / c->n_kv_heads, S = c->max_seq_len;
    uint32_t blk = task / j->splits, h0 = (task % j->splits) * j->heads_per_task;
    uint32_t nh = j->heads_per_task, nq = nh * group;
    uint32_t pr0 = m->blocks[blk], np = m->blocks[blk + 1] - pr0;
    const struct pkv_model_seg *seg = &m->segs[m->rows[m->pairs[pr0].row].seg];
    /* The task's heads lie in one group (splits is a multiple of kv_groups): read the
     * group's rank, whose runs point at its first head. */
    uint32_t per_group = c->n_kv_heads / m->kv_groups, grp = h0 / per_group;
    const pkv_kv_run_t *runs = m->runs + seg->run0 + (size_t)grp * seg->nruns;
    uint32_t kh0 = h0 - grp * per_group; /* the rank-local head of h0 */
    size_t plane = (size_t)c->n_heads * S;
    float *scr = m->scores + (size_t)thread * 2 * BLOCK_PAIRS_LONG * plane;
    uint32_t na[BLOCK_PAIRS_LONG], nb[BLOCK_PAIRS_LONG], end = 0;
    const float *qa[BLOCK_PAIRS_LONG], *qb[BLOCK_PAIRS_LONG];
    float *oa[BLOCK_PAIRS_LONG], *ob[BLOCK_PAIRS_LONG];
    span_slot_t sa_[BLOCK_PAIRS_LONG], sb_[BLOCK_PAIRS_LONG];
    for (uint32_t k = 0; k < np; k++) {
        const struct pkv_model_pair *pr = &m->pairs[pr0 + k];
        uint32_t ra = pr->row;
        na[k] = m->rows[ra].pos + 1;
        nb[k] = pr->two ? na[k] + 1 : 0;
        end = pr->two ? nb[k] : na[k];
        qa[k] = m->qkv + (size_t)ra * m->ld_qkv + (size_t)h0 * group * hd;
        qb[k] = pr->two ? qa[k] + m->ld_qkv : NULL;
        oa[k] = m->att + (size_t)ra * m->ld_q + (size_t)h0 * group * hd;
        ob[k] = oa[k] + m->ld_q;
        sa_[k] = span_slot(m, thread, 2 * k);
        sb_[k] = span_slot(m, thread, 2 * k + 1);
    }
    /* A lone pair (decode) reads everything once anyway: one window a span. */
    size_t wt = WINDOW_BYTES / ((size_t)nh * j->rb);
    if (wt < 16) wt = 16;
    if (np == 1 || wt >= end) wt = end;
    pkv_kv_run_t win[WINDOW_RUNS];
    for (int pass = 0; pass < 2; pass++) { /* scores, then V */
        uint32_t at = 0;
        for (uint32_t w0 = 0; w0 < end;) {
            uint32_t span_end = (w0 / ATT_SPAN + 1) * ATT_SPAN;
            uint32_t w1 = PKV_MIN(end - w0 > wt ? w0 + (uint32_t)wt : end, span_end);
            uint32_t nw = seg->nruns;
            const pkv_kv_run_t *wr = runs;
            if (w1 - w0 < end) {
                nw = window_runs(runs, seg->nruns, &at, w0, &w1, j->rb, win);
                wr = win;
            }
            for (uint32_t k = 0; k < np; k++) {
                float *sa = scr + 2 * k * plane, *sb = sa + plane;
                bool two = qb[k] != NULL;
                if (w0 >= (two ? nb[k] : na[k])) continue;
                if (pass == 0)
                    m->kern->scores(qa[k], qb[k], na[k], nb[k], wr, nw, kh0, nh, group, hd, j->dt,
                                    j->scale, sa, sb, S);
                else
                    m->kern->av(sa, two ? sb : NULL, na[k], nb[k], wr, nw, kh0, nh, group, hd,
                                j->dt, S, sa_[k].part, two ? sb_[k].part : NULL);
            }
            w0 = w1;
            for (uint32_t k = 0; pass == 1 && (w0 == span_end || w0 == end) && k < np; k++) {
                uint32_t sp = (w0 - 1) / ATT_SPAN; /* the span just finished */
                if (sp * ATT_SPAN < na[k]) row_fold(m, &sa_[k], nq, sp, oa[k]);
                if (qb[k] && sp * ATT_SPAN < nb[k]) row_fold(m, &sb_[k], nq, sp, ob[k]);
            }
        }
        for (uint32_t k = 0; pass == 0 && k < np; k++) {
            float *sa = scr + 2 * k * plane, *sb = sa + plane;
            row_spans(m, sa, nq, na[k], &sa_[k]);
            memset(oa[k], 0, (size_t)nq * hd * sizeof(float));
            memset(sa_[k].part, 0, (size_t)nq * hd * sizeof(float));
            if (!qb[k]) continue;
            row_spans(m, sb, nq, nb[k], &sb_[k]);
            memset(ob[k], 0, (size_t)nq * hd * sizeof(float));
            memset(sb_[k].part, 0, (size_t)nq * hd * sizeof(float));
        }
    }
    for (uint32_t k = 0; k < np; k++) {
        for (uint32_t q = 0; q < nq; q++) {
            span_scale(oa[k] + (size_t)q * hd, sa_[k].inv[q], hd);
            if (qb[k]) span_scale(ob[k] + (size_t)q * hd, sb_[k].inv[q], hd);
        }
    }
}

/* A decode pass whose rows reach past one span runs a task per (row, head group, span)
 * (dec_task), each over all of the group's heads: the threads read different spans, and
 * a task sweeps every head of a paged run. m->dtask0[r]: the first task of row r;
 * m->dspan0[r]: its first span in dpart / dstat. */
static void dec_task(void *arg, uint32_t task, uint32_t thread)
{
    const att_job_t *j = arg;
    pkv_model_t *m = j->m;
    const pkv_model_config_t *c = &m->cfg;
    uint32_t lo = 0, hi = j->dec_rows; /* the row: the last with dtask0 <= task */
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (m->dtask0[mid] <= task)
            lo = mid;
        else
            hi = mid;
    }
    uint32_t r = lo, t = task - m->dtask0[r], n = m->rows[r].pos + 1;
    uint32_t nsp = PKV_DIV_UP(n, ATT_SPAN), grp = t / nsp, sp = t % nsp;
    uint32_t hd = c->head_dim, group = c->n_heads / c->n_kv_heads, S = c->max_seq_len;
    uint32_t nh = c->n_kv_heads / m->kv_groups, nq = nh * group;
    const struct pkv_model_seg *seg = &m->segs[m->rows[r].seg];
    const pkv_kv_run_t *runs = m->runs + seg->run0 + (size_t)grp * seg->nruns;
    const float *q = m->qkv + (size_t)r * m->ld_qkv + (size_t)grp * nq * hd;
    float *s = m->scores + (size_t)thread * 2 * BLOCK_PAIRS_LONG * c->n_heads * S;
    size_t at_span = m->dspan0[r] + sp;
    float *part = m->dpart + at_span * m->qdim + (size_t)grp * nq * hd;
    float *st = m->dstat + at_span * 2 * c->n_heads + (size_t)grp * nq;
    uint32_t p0 = sp * ATT_SPAN, p1 = PKV_MIN(n, p0 + ATT_SPAN);
    pkv_kv_run_t win[WINDOW_RUNS];
    for (int pass = 0; pass < 2; pass++) { /* scores, then V */
        uint32_t at = 0;
        for (uint32_t w0 = p0; w0 < p1;) {
            uint32_t w1 = p1, nw = window_runs(runs, seg->nruns, &at, w0, &w1, j->rb, win);
            if (pass == 0)
                m->kern->scores(q, NULL, p1, 0, win, nw, 0, nh, group, hd, j->dt, j->scale, s, NULL,
                                S);
            else
                m->kern->av(s, NULL, p1, 0, win, nw, 0, nh, group, hd, j->dt, S, part, NULL);
            w0 = w1;
        }
        for (uint32_t i = 0; pass == 0 && i < nq; i++)
            m->kern->span_exp(s + (size_t)i * S + p0, p1 - p0, &st[i], &st[c->n_heads + i]);
        if (pass == 0) memset(part, 0, (size_t)nq * hd * sizeof(float));
    }
}

/* The spans of dec_task's rows merged into their attention outputs, as att_task does. */
static void dec_merge(pkv_model_t *m, uint32_t rows)
{
    const pkv_model_config_t *c = &m->cfg;
    uint32_t H = c->n_heads, hd = c->head_dim;
    float *w = span_slot(m, 0, 0).w; /* no task runs now */
    for (uint32_t r = 0; r < rows; r++) {
        uint32_t nsp = m->dspan0[r + 1] - m->dspan0[r];
        const float *st = m->dstat + (size_t)m->dspan0[r] * 2 * H;
        float *out = m->att + (size_t)r * m->ld_q;
        memset(out, 0, (size_t)m->qdim * sizeof(float));
        for (uint32_t q = 0; q < H; q++) {
            for (uint32_t sp = 0; sp < nsp; sp++) w[sp] = st[(size_t)sp * 2 * H + q];
            float inv = span_weights(w, st + H + q, 2 * (size_t)H, nsp);
            for (uint32_t sp = 0; sp < nsp; sp++)
                span_fold(out + (size_t)q * hd,
                          m->dpart + ((size_t)m->dspan0[r] + sp) * m->qdim + (size_t)q * hd, w[sp],
                          hd);
            span_scale(out + (size_t)q * hd, inv, hd);
        }
    }
}

/* Lay out dec_task's tasks and spans for a decode pass of `rows` rows (one per segment). */
static int dec_plan(pkv_model_t *m, uint32_t rows, uint32_t *ntasks)
{
    uint32_t t = 0, sp = 0;
    for (uint32_t r = 0; r < rows; r++) {
        uint32_t nsp = PKV_DIV_UP(m->rows[r].pos + 1, ATT_SPAN);
        m->dtask0[r] = t;
        m->dspan0[r] = sp;
        t += nsp * m->kv_groups;
        sp += nsp;
    }
    m->dtask0[rows] = t;
    m->dspan0[rows] = sp;
    if (sp > m->dspans_cap) {
        float *p = realloc(m->dpart, (size_t)sp * m->qdim * sizeof(float));
        if (!p) return PKV_ERR_NOMEM;
        m->dpart = p;
        p = realloc(m->dstat, (size_t)sp * 2 * m->cfg.n_heads * sizeof(float));
        if (!p) return PKV_ERR_NOMEM;
        m->dstat = p;
        m->dspans_cap = sp;
    }
    *ntasks = t;
    return PKV_OK;
}

/* Append the runs of [0, end) of one segment in `rank` at m->runs + *used. */
static int collect_seg_runs(pkv_model_t *m, const struct pkv_model_seg *sg, uint32_t rank,
                            uint32_t layer, size_t *usedp)
{
    size_t used = *usedp;
    uint32_t end = sg->pos0 + sg->n, at = 0;
    while (at < end) {
        if (used == m->runs_cap) {
            size_t cap = m->runs_cap ? m->runs_cap * 2 : 256;
            pkv_kv_run_t *nr = realloc(m->runs, cap * sizeof(*nr));
            if (!nr) return PKV_ERR_NOMEM;
            m->runs = nr;
            m->runs_cap = cap;
        }
        uint32_t next = at;
        uint32_t got = pkv_seq_runs_rank(sg->seq, rank, layer, at, end, m->runs + used,
                                         (uint32_t)(m->runs_cap - used), &next);
        for (uint32_t i = 0; i < got; i++) {
            const pkv_kv_run_t *rn = &m->runs[used + i];
            PKV_ASSERT(rn->pos == at && rn->n_tokens > 0);
            at += rn->n_tokens;
        }
        PKV_ASSERT(got > 0 && next == at);
        used += got;
    }
    *usedp = used;
    return PKV_OK;
}

/* The rank attention reads head group grp from: the first holding its heads. */
static uint32_t group_rank(const pkv_model_t *m, uint32_t grp)
{
    uint32_t H = m->cfg.n_kv_heads;
    return m->kv_tp <= H ? grp : grp * (m->kv_tp / H);
}

/* Runs covering [0, end) of every segment for `layer`, appended to m->runs: per segment,
 * one list per head group (every rank has the same positions and lengths). */
static int collect_runs(pkv_model_t *m, uint32_t nseg, uint32_t layer)
{
    size_t used = 0;
    for (uint32_t s = 0; s < nseg; s++) {
        struct pkv_model_seg *sg = &m->segs[s];
        sg->run0 = (uint32_t)used;
        for (uint32_t grp = 0; grp < m->kv_groups; grp++) {
            size_t first = used;
            int rc = collect_seg_runs(m, sg, group_rank(m, grp), layer, &used);
            if (rc) return rc;
            if (grp == 0) sg->nruns = (uint32_t)(used - first);
            PKV_ASSERT(used - first == sg->nruns);
        }
    }
    return PKV_OK;
}

/* K/V of rows [r0, r1) of this pass into their slots of layer `layer`, converted to dt
 * (every rank holding a head gets it). */
static void write_kv_rows(pkv_model_t *m, uint32_t r0, uint32_t r1, uint32_t layer, pkv_dtype_t dt)
{
    const pkv_model_config_t *c = &m->cfg;
    uint32_t hd = c->head_dim;
    for (uint32_t r = r0; r < r1; r++) {
        const float *k = m->qkv + (size_t)r * m->ld_qkv + m->qdim;
        const float *v = k + m->kvdim;
        void *kp, *vp;
        size_t stride;
        pkv_seq_t *seq = m->segs[m->rows[r].seg].seq;
        if (m->kv_tp == 1) {
            pkv_seq_slot(seq, m->rows[r].pos, layer, &kp, &vp, &stride);
            for (uint32_t g = 0; g < c->n_kv_heads; g++) {
                pkv_dtype_from_f32(dt, (char *)kp + (size_t)g * stride, k + (size_t)g * hd, hd);
                pkv_dtype_from_f32(dt, (char *)vp + (size_t)g * stride, v + (size_t)g * hd, hd);
            }
            continue;
        }
        for (uint32_t rank = 0; rank < m->kv_tp; rank++) { /* every rank holding each head */
            uint32_t lo, n;
            pkv_kv_tp_heads(c->n_kv_heads, m->kv_tp, rank, &lo, &n);
            pkv_seq_slot_rank(seq, rank, m->rows[r].pos, layer, &kp, &vp, &stride);
            for (uint32_t h = 0; h < n; h++) {
                size_t g = lo + h;
                pkv_dtype_from_f32(dt, (char *)kp + (size_t)h * stride, k + g * hd, hd);
                pkv_dtype_from_f32(dt, (char *)vp + (size_t)h * stride, v + g * hd, hd);
            }
        }
    }
}

enum { WKV_ROWS = 16 }; /* rows per write task */
typedef struct {
    pkv_model_t *m;
    uint32_t rows, layer;
    pkv_dtype_t dt;
} wkv_job_t;

static void wkv_task(void *arg, uint32_t task, uint32_t thread)
{
    (void)thread;
    const wkv_job_t *j = arg;
    uint32_t r0 = task * WKV_ROWS;
    write_kv_rows(j->m, r0, PKV_MIN(j->rows, r0 + WKV_ROWS), j->layer, j->dt);
}

/* A prefill pass's rows are written in parallel (each row its own slots: disjoint outputs,
 * and a row's bytes depend on its values alone); the conversion of a quantized dtype
 * costs ~0.3 us a row, which one thread would add to every prefilled token. */
static void write_kv(pkv_model_t *m, uint32_t rows, uint32_t layer, pkv_dtype_t dt)
{
    wkv_job_t j = {.m = m, .rows = rows, .layer = layer, .dt = dt};
    uint32_t n = PKV_DIV_UP(rows, WKV_ROWS);
    if (n < 2) {
        write_kv_rows(m, 0, rows, layer, dt);
        return;
    }
    model_tpool_run(m->pool, wkv_task, &j, n);
}

/* A pass's attention tasks: its row pairs in blocks and the head split (att_task), or,
 * for a decode pass with a row past one span, tasks by span (dec_task; aj->dec_rows set). */
static int att_plan(pkv_model_t *m, uint32_t nseg, uint32_t rows, att_job_t *aj, uint32_t *ntasks)
{
    const pkv_model_config_t *c = &m->cfg;
    uint32_t npairs = 0, nblocks = 0;
    /* Split heads into groups only as far as needed to give every thread work, and at least
     * into the groups the ranks hold (a task reads one rank). */
    aj->splits = m->kv_groups;
    aj->macs = 0; /* per layer: positions read x query dims x 2 (scores, V) */
    for (uint32_t r = 0; r < rows; r++) aj->macs += (uint64_t)(m->rows[r].pos + 1) * m->qdim * 2;
    size_t layer_token_bytes = (size_t)c->n_kv_heads * aj->rb * 2;
    for (uint32_t sg = 0; sg < nseg; sg++) {
        const struct pkv_model_seg *g = &m->segs[sg];
        uint32_t bp = (size_t)(g->pos0 + g->n) * layer_token_bytes >= LONG_KV_BYTES
                          ? BLOCK_PAIRS_LONG
                          : BLOCK_PAIRS;
        for (uint32_t r = 0; r < g->n; r += 2) {
            m->pairs[npairs].row = g->row0 + r;
            m->pairs[npairs].two = r + 1 < g->n;
            if (r % (2 * bp) == 0) m->blocks[nblocks++] = npairs;
            npairs++;
        }
    }
    m->blocks[nblocks] = npairs;
    while (nblocks * aj->splits < 2 * m->threads && c->n_kv_heads % (aj->splits * 2) == 0)
        aj->splits *= 2;
    aj->heads_per_task = c->n_kv_heads / aj->splits;
    *ntasks = nblocks * aj->splits;
    bool past = false; /* a decode pass (a row per segment) with a row past one span */
    for (uint32_t r = 0; rows == nseg && r < rows && !past; r++)
        past = m->rows[r].pos + 1 > ATT_SPAN;
    if (!past) return PKV_OK;
    aj->dec_rows = rows;
    return dec_plan(m, rows, ntasks);
}

/* One layer's attention: the planned tasks, inline when small. */
static void attention(pkv_model_t *m, att_job_t *aj, uint32_t ntasks)
{
    void (*fn)(void *, uint32_t, uint32_t) = aj->dec_rows ? dec_task : att_task;
    if (aj->macs < PARALLEL_MIN_MACS)
        for (uint32_t t = 0; t < ntasks; t++) fn(aj, t, 0);
    else
        model_tpool_run(m->pool, fn, aj, ntasks);
    if (aj->dec_rows) dec_merge(m, aj->dec_rows);
}

/* Logits for segments that end their item, LOGIT_ROWS at a time. */
static void pass_logits(pkv_model_t *m, const pkv_model_item_t *items, uint32_t nseg)
{
    const pkv_model_config_t *c = &m->cfg;
    uint32_t D = c->dim;
    uint32_t s = 0;
    while (s < nseg) {
        uint32_t segs_of[LOGIT_ROWS], nl = 0;
        for (; s < nseg && nl < LOGIT_ROWS; s++) {
            const struct pkv_model_seg *sg = &m->segs[s];
            if (!sg->logits) continue;
            uint32_t r = sg->row0 + sg->n - 1;
            rmsnorm(m, m->x + (size_t)r * m->ld_d, m->rms_final, m->lrows + (size_t)nl * m->ld_d);
            segs_of[nl++] = s;
        }
        if (!nl) break;
        matmul(m, m->lrows, m->ld_d, nl, D, m->wcls, m->ld_v, m->lout, m->ld_v);
        for (uint32_t i = 0; i < nl; i++)
            memcpy(items[m->segs[segs_of[i]].item].logits, m->lout + (size_t)i * m->ld_v,
                   c->vocab_size * sizeof(float));
    }
}

static int run_pass(pkv_model_t *m, const pkv_model_item_t *items, uint32_t nseg, uint32_t rows,
                    pkv_dtype_t dt)
{
    const pkv_model_config_t *c = &m->cfg;
    uint32_t D = c->dim, H = c->hidden_dim, hd = c->head_dim;
    size_t rb = pkv_dtype_row_bytes(dt, hd);
    bool rotate = pkv_dtype_rotates_keys(dt, hd);
    for (uint32_t r = 0; r < rows; r++) {
        memcpy(m->x + (size_t)r * m->ld_d, m->emb + (size_t)m->rows[r].token * D,
               D * sizeof(float));
        float *cs = m->rope + (size_t)r * hd;
        for (uint32_t i = 0; i < hd; i += 2) {
            float freq = 1.0f / powf(c->rope_theta, (float)i / (float)hd);
            float val = (float)m->rows[r].pos * freq;
            cs[i] = cosf(val);
            cs[i + 1] = sinf(val);
        }
    }
    att_job_t aj = {.m = m, .dt = dt, .rb = rb, .scale = 1.0f / sqrtf((float)hd)};
    uint32_t ntasks = 0;
    int rc = att_plan(m, nseg, rows, &aj, &ntasks);
    if (rc) return rc;
    for (uint32_t l = 0; l < c->n_layers; l++) {
        const model_layer_t *ly = &m->layers[l];
        for (uint32_t r = 0; r < rows; r++)
            rmsnorm(m, m->x + (size_t)r * m->ld_d, ly->rms_att, m->xb + (size_t)r * m->ld_d);
        matmul(m, m->xb, m->ld_d, rows, D, ly->wqkv, m->ld_qkv, m->qkv, m->ld_qkv);
        for (uint32_t r = 0; r < rows; r++) {
            float *q = m->qkv + (size_t)r * m->ld_qkv;
            rope_apply(q, c->n_heads, hd, m->rope + (size_t)r * hd);
            rope_apply(q + m->qdim, c->n_kv_heads, hd, m->rope + (size_t)r * hd);
            for (uint32_t h = 0; rotate && h < c->n_heads + c->n_kv_heads; h++)
                pkv_hadamard(q + (size_t)h * hd, hd); /* the queries, then the keys */
        }
        write_kv(m, rows, l, dt);
        if ((rc = collect_runs(m, nseg, l))) return rc;
        attention(m, &aj, ntasks);
        for (uint32_t r = 0; m->rt.att_probe && r < rows; r++)
            m->rt.att_probe(m->rt.att_probe_arg, l, m->rows[r].pos, m->qkv + (size_t)r * m->ld_qkv,
                            m->att + (size_t)r * m->ld_q, m->qdim);
        matmul(m, m->att, m->ld_q, rows, m->qdim, ly->wo, m->ld_d, m->tmp, m->ld_d);
        for (uint32_t r = 0; r < rows; r++) {
            float *x = m->x + (size_t)r * m->ld_d;
            const float *t = m->tmp + (size_t)r * m->ld_d;
            for (uint32_t i = 0; i < D; i++) x[i] = x[i] + t[i];
            rmsnorm(m, x, ly->rms_ffn, m->xb + (size_t)r * m->ld_d);
        }
        matmul(m, m->xb, m->ld_d, rows, D, ly->w13, m->ld_h2, m->h13, m->ld_h2);
        for (uint32_t r = 0; r < rows; r++) {
            const float *a = m->h13 + (size_t)r * m->ld_h2;
            float *h = m->hid + (size_t)r * H;
            for (uint32_t i = 0; i < H; i++) h[i] = a[i] / (1.0f + expf(-a[i])) * a[H + i];
        }
        matmul(m, m->hid, H, rows, H, ly->w2, m->ld_d, m->tmp, m->ld_d);
        for (uint32_t r = 0; r < rows; r++) {
            float *x = m->x + (size_t)r * m->ld_d;
            const float *t = m->tmp + (size_t)r * m->ld_d;
            for (uint32_t i = 0; i < D; i++) x[i] = x[i] + t[i];
        }
    }
    pass_logits(m, items, nseg);
    return PKV_OK;
}

int pkv_model_forward(pkv_model_t *m, pkv_kv_t *kv, const pkv_model_item_t *items, uint32_t n_items)
{
    if (!m || !kv || !items || !n_items) return PKV_ERR_INVALID;
    const pkv_model_config_t *c = &m->cfg;
    const pkv_geometry_t *g = pkv_kv_geometry(kv);
    if (g->layers != c->n_layers || g->kv_heads != c->n_kv_heads || g->head_dim != c->head_dim) {
        PKV_LOGE("model",
                 "KV geometry %u layers x %u heads x %u dim does not match the model's %u x %u "
                 "x %u",
                 g->layers, g->kv_heads, g->head_dim, c->n_layers, c->n_kv_heads, c->head_dim);
        return PKV_ERR_INVALID;
    }
    for (uint32_t i = 0; i < n_items; i++) {
        const pkv_model_item_t *it = &items[i];
        if (!it->seq || !it->tokens || !it->n_tokens) {
            PKV_LOGE("model", "forward item %u: no sequence or no tokens", i);
            return PKV_ERR_INVALID;
        }
        uint64_t end = (uint64_t)pkv_seq_length(it->seq) + it->n_tokens;
        if (end > pkv_seq_capacity(it->seq) || end > c->max_seq_len) {
            PKV_LOGE("model",
                     "forward item %u: positions up to %llu exceed capacity %u or the model's "
                     "max_seq_len %u",
                     i, (unsigned long long)end, pkv_seq_capacity(it->seq), c->max_seq_len);
            return PKV_ERR_INVALID;
        }
        for (uint32_t t = 0; t < it->n_tokens; t++) {
            if (it->tokens[t] < 0 || (uint32_t)it->tokens[t] >= c->vocab_size) {
                PKV_LOGE("model", "forward item %u: token %d out of range [0, %u)", i,
                         it->tokens[t], c->vocab_size);
                return PKV_ERR_INVALID;
            }
        }
        for (uint32_t j = 0; j < i; j++) {
            if (items[j].seq == it->seq) {
                PKV_LOGE("model", "forward items %u and %u share a sequence", j, i);
                return PKV_ERR_INVALID;
            }
        }
    }
    m->kv_tp = pkv_kv_tp(kv);
    m->kv_groups = PKV_MIN(m->kv_tp, c->n_kv_heads);
    uint32_t it = 0, off = 0;
    while (it < n_items) {
        uint32_t rows = 0, nseg = 0;
        while (it < n_items && rows < m->chunk) {
            const pkv_model_item_t *item = &items[it];
            uint32_t take = PKV_MIN(item->n_tokens - off, m->chunk - rows);
            struct pkv_model_seg *sg = &m->segs[nseg];
            sg->seq = item->seq;
            sg->item = it;
            sg->pos0 = pkv_seq_length(item->seq) + off;
            sg->n = take;
            sg->row0 = rows;
            sg->logits = item->logits && off + take == item->n_tokens;
            for (uint32_t t = 0; t < take; t++) {
                m->rows[rows + t] = (struct pkv_model_row){
                    .seg = nseg, .pos = sg->pos0 + t, .token = item->tokens[off + t]};
            }
            rows += take;
            nseg++;
            off += take;
            if (off == item->n_tokens) it++, off = 0;
        }
        int rc = run_pass(m, items, nseg, rows, g->dtype);
        if (rc) return rc;
    }
    for (uint32_t i = 0; i < n_items; i++) {
        int rc = pkv_seq_append(items[i].seq, items[i].tokens, items[i].n_tokens);
        if (rc) {
            PKV_LOGE("model", "forward item %u: append failed: %s", i, pkv_status_str(rc));
            return rc;
        }
    }
    return PKV_OK;
}
