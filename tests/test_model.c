/*
 * model: the forward pass against a plain reference implementation (llama2.c's run.c
 * written out naively, contiguous f32 KV), on a small llama2.c checkpoint this test
 * writes itself; the loader's validation of truncated and corrupt files; the built-in
 * presets; forward input validation; bitwise invariance to backend, block size,
 * chunking, batch composition and thread count.
 */
#include "tests/fuzz/props.h"
#include "tests/support/testutil.h"

#include "pagekv/model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* Sanitizer builds run 5-20x slower: the heaviest loops cover fewer combinations there
 * (every code path still runs). */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SANITIZED 1
#else
#define SANITIZED 0
#endif

/* ---- a small llama2.c checkpoint --------------------------------------------------- */

typedef struct {
    int32_t dim, hidden, layers, heads, kv_heads, vocab, seq;
    bool shared;
} ck_cfg_t;

typedef struct {
    ck_cfg_t c;
    int32_t hs, kvd;
    float *all; /* every float of the file after the header, in file order */
    size_t n;
    float *emb, *rms_att, *wq, *wk, *wv, *wo, *rms_ffn, *w1, *w2, *w3, *rms_final, *wcls;
} ck_t;

static float urand(uint64_t *s)
{
    return (float)(pkv_test_rand(s) >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
}

static void ck_build(ck_t *k, ck_cfg_t c, uint64_t seed)
{
    memset(k, 0, sizeof(*k));
    k->c = c;
    k->hs = c.dim / c.heads;
    k->kvd = c.kv_heads * k->hs;
    size_t D = c.dim, H = c.hidden, V = c.vocab, L = c.layers, kvd = k->kvd;
    k->n = V * D + L * (D + D * D + 2 * kvd * D + D * D + D + 3 * D * H) + D +
           (size_t)c.seq * k->hs + (c.shared ? 0 : V * D);
    k->all = malloc(k->n * sizeof(float));
    ck_assert_ptr_nonnull(k->all);
    float *p = k->all;
    k->emb = p, p += V * D;
    k->rms_att = p, p += L * D;
    k->wq = p, p += L * D * D;
    k->wk = p, p += L * kvd * D;
    k->wv = p, p += L * kvd * D;
    k->wo = p, p += L * D * D;
    k->rms_ffn = p, p += L * D;
    k->w1 = p, p += L * H * D;
    k->w2 = p, p += L * D * H;
    k->w3 = p, p += L * H * D;
    k->rms_final = p, p += D;
    float *freq = p;
    p += (size_t)c.seq * k->hs;
    k->wcls = c.shared ? k->emb : p;
    uint64_t s = seed;
    for (size_t i = 0; i < k->n; i++) k->all[i] = urand(&s) * 0.3f;
    for (size_t i = 0; i < L * D; i++) k->rms_att[i] = 1.0f + 0.2f * urand(&s);
    for (size_t i = 0; i < L * D; i++) k->rms_ffn[i] = 1.0f + 0.2f * urand(&s);
    for (size_t i = 0; i < D; i++) k->rms_final[i] = 1.0f + 0.2f * urand(&s);
    for (size_t i = 0; i < (size_t)c.seq * k->hs; i++) freq[i] = 0.0f;
}

static void ck_write(const ck_t *k, const char *path)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    int32_t h[7] = {k->c.dim,   k->c.hidden,   k->c.layers,
                    k->c.heads, k->c.kv_heads, k->c.shared ? k->c.vocab : -k->c.vocab,
                    k->c.seq};
    ck_assert_uint_eq(fwrite(h, sizeof(h), 1, f), 1);
    ck_assert_uint_eq(fwrite(k->all, sizeof(float), k->n, f), k->n);
    fclose(f);
}

static void ck_free(ck_t *k)
{
    free(k->all);
}

static void tmp_path(char *buf, size_t n, const char *tag)
{
    snprintf(buf, n, "/tmp/pkv_test_model_%d_%s.bin", (int)getpid(), tag);
}

/* ---- the reference: llama2.c's forward, one token at a time ---------------------------- */

typedef struct {
    const ck_t *k;
    pkv_dtype_t dt;
    float *kc, *vc; /* (layers, seq, kvd) */
} ref_t;

static void ref_matmul(float *o, const float *x, const float *w, int n, int d)
{
    for (int i = 0; i < d; i++) {
        double v = 0;
        for (int j = 0; j < n; j++) v += (double)w[(size_t)i * n + j] * x[j];
        o[i] = (float)v;
    }
}

static void ref_rmsnorm(float *o, const float *x, const float *w, int n)
{
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float inv = (float)(1.0 / sqrt(ss / n + 1e-5));
    for (int i = 0; i < n; i++) o[i] = w[i] * (inv * x[i]);
}

/* K/V as the cache holds them: each head's row through the dtype and back; keys of a
 * dtype that stores them rotated go through it rotated and come back unrotated (the
 * normalized Hadamard transform is its own inverse), as the model's q.k sees them. */
static void ref_round(pkv_dtype_t dt, float *v, int n, int hs, bool key)
{
    uint8_t tmp[4 * 256 + 4];
    bool rot = key && pkv_dtype_rotates_keys(dt, (uint32_t)hs);
    if (dt == PKV_DTYPE_F32) return;
    for (int h = 0; h < n; h += hs) {
        if (rot) pkv_hadamard(v + h, (uint32_t)hs);
        pkv_dtype_from_f32(dt, tmp, v + h, (size_t)hs);
        pkv_dtype_to_f32(dt, v + h, tmp, (size_t)hs);
        if (rot) pkv_hadamard(v + h, (uint32_t)hs);
    }
}

static void ref_forward(ref_t *r, int token, int pos, float *logits)
{
    const ck_t *k = r->k;
    int D = k->c.dim, H = k->c.hidden, hs = k->hs, kvd = k->kvd, nh = k->c.heads;
    int grp = k->c.heads / k->c.kv_heads, S = k->c.seq;
    float x[256], xb[256], xb2[256], q[256], hb[512], hb2[512], att[512];
    memcpy(x, k->emb + (size_t)token * D, D * sizeof(float));
    for (int l = 0; l < k->c.layers; l++) {
        ref_rmsnorm(xb, x, k->rms_att + l * D, D);
        float *kr = r->kc + ((size_t)l * S + pos) * kvd, *vr = r->vc + ((size_t)l * S + pos) * kvd;
        ref_matmul(q, xb, k->wq + (size_t)l * D * D, D, D);
        ref_matmul(kr, xb, k->wk + (size_t)l * kvd * D, D, kvd);
        ref_matmul(vr, xb, k->wv + (size_t)l * kvd * D, D, kvd);
        for (int i = 0; i < D; i += 2) {
            int hd = i % hs;
            double freq = 1.0 / pow(10000.0, hd / (double)hs);
            double val = pos * freq, fcr = cos(val), fci = sin(val);
            for (int v = 0; v < (i < kvd ? 2 : 1); v++) {
                float *vec = v == 0 ? q : kr;
                float v0 = vec[i], v1 = vec[i + 1];
                vec[i] = (float)(v0 * fcr - v1 * fci);
                vec[i + 1] = (float)(v0 * fci + v1 * fcr);
            }
        }
        ref_round(r->dt, kr, kvd, hs, true);
        ref_round(r->dt, vr, kvd, hs, false);
        for (int h = 0; h < nh; h++) {
            const float *qh = q + h * hs;
            double mx = -1e30;
            for (int t = 0; t <= pos; t++) {
                const float *kt = r->kc + ((size_t)l * S + t) * kvd + (h / grp) * hs;
                double s = 0;
                for (int i = 0; i < hs; i++) s += (double)qh[i] * kt[i];
                att[t] = (float)(s / sqrt((double)hs));
                if (att[t] > mx) mx = att[t];
            }
            double sum = 0;
            for (int t = 0; t <= pos; t++) sum += exp(att[t] - mx);
            for (int i = 0; i < hs; i++) {
                double acc = 0;
                for (int t = 0; t <= pos; t++)
                    acc += exp(att[t] - mx) / sum *
                           r->vc[((size_t)l * S + t) * kvd + (h / grp) * hs + i];
                xb[h * hs + i] = (float)acc;
            }
        }
        ref_matmul(xb2, xb, k->wo + (size_t)l * D * D, D, D);
        for (int i = 0; i < D; i++) x[i] += xb2[i];
        ref_rmsnorm(xb, x, k->rms_ffn + l * D, D);
        ref_matmul(hb, xb, k->w1 + (size_t)l * H * D, D, H);
        ref_matmul(hb2, xb, k->w3 + (size_t)l * H * D, D, H);
        for (int i = 0; i < H; i++) hb[i] = (float)(hb[i] / (1.0 + exp(-hb[i])) * hb2[i]);
        ref_matmul(xb2, hb, k->w2 + (size_t)l * D * H, H, D);
        for (int i = 0; i < D; i++) x[i] += xb2[i];
    }
    ref_rmsnorm(xb, x, k->rms_final, D);
    ref_matmul(logits, xb, k->wcls, D, k->c.vocab);
}

/* ---- helpers --------------------------------------------------------------------------- */

static pkv_kv_t *make_kv(const pkv_model_t *m, pkv_backend_t be, pkv_dtype_t dt, uint32_t bt)
{
    pkv_kv_config_t kc = {.backend = be};
    pkv_model_geometry(m, dt, bt, &kc.geo);
    pkv_kv_t *kv = NULL;
    ck_assert_int_eq(pkv_kv_create(&kc, &kv), PKV_OK);
    return kv;
}

static pkv_seq_t *make_seq(pkv_kv_t *kv, const int32_t *toks, uint32_t n, uint32_t reserve)
{
    pkv_seq_params_t sp = {.tokens = toks, .n_tokens = n, .reserve_tokens = reserve};
    pkv_seq_t *s = NULL;
    uint32_t cached = 99;
    ck_assert_int_eq(pkv_seq_create(kv, &sp, &s, &cached), PKV_OK);
    ck_assert_uint_eq(cached, 0);
    return s;
}

static const ck_cfg_t small_cfg = {.dim = 64,
                                   .hidden = 96,
                                   .layers = 2,
                                   .heads = 4,
                                   .kv_heads = 2,
                                   .vocab = 97,
                                   .seq = 64,
                                   .shared = false};

/* Run the checkpoint model over `n` tokens in chunks of `step` and compare every set of
 * logits against the reference. */
static void check_against_reference(const ck_t *k, const char *path, bool portable,
                                    pkv_backend_t be, pkv_dtype_t dt, uint32_t step, double tol)
{
    pkv_model_runtime_t rt = {.portable = portable, .threads = 2};
    pkv_model_t *m = NULL;
    ck_assert_int_eq(pkv_model_load_llama2c(path, &rt, &m), PKV_OK);
    const pkv_model_config_t *c = pkv_model_config(m);
    ck_assert_uint_eq(c->vocab_size, (uint32_t)k->c.vocab);
    ck_assert_uint_eq(c->head_dim, (uint32_t)k->hs);
    if (portable) ck_assert_str_eq(pkv_model_kernels(m), "portable");
    pkv_kv_t *kv = make_kv(m, be, dt, 4);
    uint32_t n = 40;
    int32_t toks[40];
    uint64_t s = 7;
    for (uint32_t i = 0; i < n; i++) toks[i] = (int32_t)pkv_test_below(&s, (uint32_t)k->c.vocab);
    pkv_seq_t *seq = make_seq(kv, toks, 1, n);
    ref_t r = {.k = k, .dt = dt};
    r.kc = calloc((size_t)k->c.layers * k->c.seq * k->kvd, sizeof(float));
    r.vc = calloc((size_t)k->c.layers * k->c.seq * k->kvd, sizeof(float));
    float *ref = malloc(k->c.vocab * sizeof(float)), *got = malloc(k->c.vocab * sizeof(float));
    double worst = 0;
    for (uint32_t i = 0; i < n; i += step) {
        uint32_t cnt = n - i < step ? n - i : step;
        pkv_model_item_t it = {.seq = seq, .tokens = toks + i, .n_tokens = cnt, .logits = got};
        ck_assert_int_eq(pkv_model_forward(m, kv, &it, 1), PKV_OK);
        ck_assert_uint_eq(pkv_seq_length(seq), i + cnt);
        for (uint32_t j = i; j < i + cnt; j++) ref_forward(&r, toks[j], (int)j, ref);
        for (int v = 0; v < k->c.vocab; v++) {
            double d = fabs((double)got[v] - ref[v]) / (1.0 + fabs(ref[v]));
            if (d > worst) worst = d;
        }
    }
    if (worst > tol)
        ck_abort_msg("kernels %s backend %s dtype %s step %u: worst relative error %g > %g",
                     pkv_model_kernels(m), pkv_backend_name(be), pkv_dtype_name(dt), step, worst,
                     tol);
    free(ref);
    free(got);
    free(r.kc);
    free(r.vc);
    pkv_seq_free(seq);
    pkv_kv_destroy(kv);
    pkv_model_destroy(m);
}

START_TEST(llama2c_matches_reference)
{
    char path[128];
    tmp_path(path, sizeof(path), "ref");
    for (int shared = 0; shared < 2; shared++) {
        ck_t k;
        ck_cfg_t c = small_cfg;
        c.shared = shared;
        ck_build(&k, c, 1234 + shared);
        ck_write(&k, path);
        for (int portable = 0; portable < 2; portable++) {
            check_against_reference(&k, path, portable, PKV_BACKEND_PAGED, PKV_DTYPE_F32, 1, 2e-4);
            check_against_reference(&k, path, portable, PKV_BACKEND_DENSE, PKV_DTYPE_F32, 7, 2e-4);
            check_against_reference(&k, path, portable, PKV_BACKEND_PAGED, PKV_DTYPE_F16, 5, 2e-3);
            check_against_reference(&k, path, portable, PKV_BACKEND_DENSE, PKV_DTYPE_BF16, 40,
                                    3e-2);
            /* the reference stores K/V through the same quantizer, so only the order of
             * the float operations differs (worst ~5e-6, unless a value lands on the
             * other side of a rounding step: fp8's steps are coarse): a scale applied
             * to the wrong dims or rows shows far above these */
            check_against_reference(&k, path, portable, PKV_BACKEND_PAGED, PKV_DTYPE_INT8, 9, 1e-3);
            check_against_reference(&k, path, portable, PKV_BACKEND_DENSE, PKV_DTYPE_FP8, 11, 2e-2);
        }
        ck_free(&k);
    }
    unlink(path);
}
END_TEST

/* Odd head size (not a multiple of 8): the model falls back to the portable kernels. */
START_TEST(llama2c_odd_head_size)
{
    char path[128];
    tmp_path(path, sizeof(path), "odd");
    ck_t k;
    ck_cfg_t c = {.dim = 36,
                  .hidden = 40,
                  .layers = 1,
                  .heads = 3,
                  .kv_heads = 1,
                  .vocab = 50,
                  .seq = 48,
                  .shared = true};
    ck_build(&k, c, 99);
    ck_write(&k, path);
    check_against_reference(&k, path, false, PKV_BACKEND_PAGED, PKV_DTYPE_F32, 3, 2e-4);
    /* int8 at a head dim of 12: lane groups of 2 and 1 values, a partial last 8 */
    check_against_reference(&k, path, false, PKV_BACKEND_PAGED, PKV_DTYPE_INT8, 3, 1e-3);
    ck_free(&k);
    unlink(path);
}
END_TEST

/* Head dim 64 (the presets' geometry): int8's lane groups of 8 values, one per AVX2 lane,
 * and fp8, against the reference in both kernel sets. */
START_TEST(llama2c_matches_reference_head_dim_64)
{
    char path[128];
    tmp_path(path, sizeof(path), "hd64");
    ck_t k;
    ck_cfg_t c = small_cfg;
    c.dim = 128;
    c.heads = 2;
    c.kv_heads = 1;
    ck_build(&k, c, 4321);
    ck_write(&k, path);
    for (int portable = 0; portable < 2; portable++) {
        check_against_reference(&k, path, portable, PKV_BACKEND_PAGED, PKV_DTYPE_INT8, 7, 1e-3);
        check_against_reference(&k, path, portable, PKV_BACKEND_DENSE, PKV_DTYPE_INT8, 1, 1e-3);
        /* fp8's steps are 1/16 of a value: where the model's f32 K and the reference's
         * f64 K round to neighbouring codes the logits differ by ~4e-3 (seen here) */
        check_against_reference(&k, path, portable, PKV_BACKEND_PAGED, PKV_DTYPE_FP8, 5, 2e-2);
    }
    ck_free(&k);
    unlink(path);
}
END_TEST

static int load_status(const char *path)
{
    pkv_model_t *m = NULL;
    int rc = pkv_model_load_llama2c(path, NULL, &m);
    if (rc == PKV_OK)
        pkv_model_destroy(m);
    else
        ck_assert_ptr_null(m);
    return rc;
}

static void write_bytes(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    if (n) ck_assert_uint_eq(fwrite(data, 1, n, f), n);
    fclose(f);
}

START_TEST(llama2c_rejects_bad_files)
{
    pkv_log_set_level(PKV_LOG_ERROR);
    char path[128];
    tmp_path(path, sizeof(path), "bad");
    ck_t k;
    ck_build(&k, small_cfg, 5);
    ck_write(&k, path);
    ck_assert_int_eq(load_status(path), PKV_OK);
    size_t total = 28 + k.n * 4;
    unsigned char *buf = malloc(total + 8);
    FILE *f = fopen(path, "rb");
    ck_assert_uint_eq(fread(buf, 1, total, f), total);
    fclose(f);

    /* Missing file, a directory. */
    ck_assert_int_eq(load_status("/nonexistent/pkv/model.bin"), PKV_ERR_IO);
    ck_assert_int_eq(load_status("/tmp"), PKV_ERR_IO);
    /* Empty, header only, truncated by one byte, one float short, trailing bytes. */
    write_bytes(path, buf, 0);
    ck_assert_int_eq(load_status(path), PKV_ERR_CORRUPT);
    write_bytes(path, buf, 27);
    ck_assert_int_eq(load_status(path), PKV_ERR_CORRUPT);
    write_bytes(path, buf, 28);
    ck_assert_int_eq(load_status(path), PKV_ERR_CORRUPT);
    write_bytes(path, buf, total - 1);
    ck_assert_int_eq(load_status(path), PKV_ERR_CORRUPT);
    write_bytes(path, buf, total - 4);
    ck_assert_int_eq(load_status(path), PKV_ERR_CORRUPT);
    memset(buf + total, 0, 8);
    write_bytes(path, buf, total + 4);
    ck_assert_int_eq(load_status(path), PKV_ERR_CORRUPT);
    /* Header fields out of range or inconsistent. */
    struct {
        int field;
        int32_t value;
    } bad[] = {{0, 0}, {0, -64}, {1, 0},  {2, 0},       {2, 100000},
               {3, 0}, {3, 5},   {4, 0},  {4, 8},       {4, 3},
               {5, 0}, {6, 0},   {6, -1}, {0, 1 << 30}, {5, INT32_MIN + 1}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        unsigned char *b = malloc(total);
        memcpy(b, buf, total);
        memcpy(b + 4 * bad[i].field, &bad[i].value, 4);
        write_bytes(path, b, total);
        ck_assert_msg(load_status(path) == PKV_ERR_CORRUPT, "field %d = %d accepted", bad[i].field,
                      bad[i].value);
        free(b);
    }
    /* A consistent header for a different shape than the data: size mismatch. */
    {
        unsigned char *b = malloc(total);
        memcpy(b, buf, total);
        int32_t dim = 32;
        memcpy(b, &dim, 4);
        write_bytes(path, b, total);
        ck_assert_int_eq(load_status(path), PKV_ERR_CORRUPT);
        free(b);
    }
    /* Non-finite weights. */
    float bads[2] = {NAN, INFINITY};
    for (int i = 0; i < 2; i++) {
        unsigned char *b = malloc(total);
        memcpy(b, buf, total);
        memcpy(b + total - 4 * (1 + i * 100), &bads[i], 4);
        write_bytes(path, b, total);
        ck_assert_int_eq(load_status(path), PKV_ERR_CORRUPT);
        free(b);
    }
    /* The intact file still loads. */
    write_bytes(path, buf, total);
    ck_assert_int_eq(load_status(path), PKV_OK);
    free(buf);
    ck_free(&k);
    unlink(path);
}
END_TEST

/* ---- built-in models ------------------------------------------------------------------ */

START_TEST(builtin_presets)
{
    const char *const *names = pkv_model_preset_names();
    ck_assert_str_eq(names[0], "tiny");
    pkv_model_config_t c;
    ck_assert_int_eq(pkv_model_preset("llama-3.2-1b", &c), PKV_OK);
    ck_assert_uint_eq(c.n_layers, 16);
    ck_assert_uint_eq(c.n_kv_heads, 8);
    ck_assert_uint_eq(c.head_dim, 64);
    ck_assert_int_eq(pkv_model_preset("qwen3-0.6b", &c), PKV_OK);
    ck_assert_uint_eq(c.n_layers, 28);
    ck_assert_uint_eq(c.n_kv_heads, 8);
    ck_assert_uint_eq(c.head_dim, 128);
    ck_assert_int_eq(pkv_model_preset("gpt-9", &c), PKV_ERR_NOTFOUND);
    ck_assert_int_eq(pkv_model_preset(NULL, &c), PKV_OK);
    ck_assert_uint_eq(c.n_layers, 2);
    /* vocab_size must be supplied. */
    pkv_model_t *m = NULL;
    ck_assert_int_eq(pkv_model_create_builtin(&c, 1, NULL, &m), PKV_ERR_INVALID);
    ck_assert_ptr_null(m);
    c.vocab_size = 300;
    c.n_heads = 3; /* not a multiple of kv heads */
    ck_assert_int_eq(pkv_model_create_builtin(&c, 1, NULL, &m), PKV_ERR_INVALID);
    ck_assert_ptr_null(m);
}
END_TEST

static void tiny_logits(uint64_t seed, const int32_t *toks, uint32_t n, float *out)
{
    pkv_model_config_t c;
    ck_assert_int_eq(pkv_model_preset("tiny", &c), PKV_OK);
    c.vocab_size = 300;
    pkv_model_t *m = NULL;
    ck_assert_int_eq(pkv_model_create_builtin(&c, seed, NULL, &m), PKV_OK);
    pkv_kv_t *kv = make_kv(m, PKV_BACKEND_PAGED, PKV_DTYPE_F32, 16);
    pkv_seq_t *s = make_seq(kv, toks, n, n);
    pkv_model_item_t it = {.seq = s, .tokens = toks, .n_tokens = n, .logits = out};
    ck_assert_int_eq(pkv_model_forward(m, kv, &it, 1), PKV_OK);
    pkv_seq_free(s);
    pkv_kv_destroy(kv);
    pkv_model_destroy(m);
}

START_TEST(builtin_is_deterministic)
{
    int32_t toks[12] = {1, 5, 9, 200, 3, 3, 77, 12, 0, 299, 8, 4};
    float a[300], b[300], c[300];
    tiny_logits(42, toks, 12, a);
    tiny_logits(42, toks, 12, b);
    tiny_logits(43, toks, 12, c);
    ck_assert_mem_eq(a, b, sizeof(a));
    ck_assert(memcmp(a, c, sizeof(a)) != 0);
    for (int i = 0; i < 300; i++) ck_assert(isfinite(a[i]));
}
END_TEST

START_TEST(forward_rejects_bad_input)
{
    pkv_log_set_level(PKV_LOG_ERROR);
    pkv_model_config_t c;
    ck_assert_int_eq(pkv_model_preset("tiny", &c), PKV_OK);
    c.vocab_size = 100;
    c.max_seq_len = 64;
    pkv_model_t *m = NULL;
    ck_assert_int_eq(pkv_model_create_builtin(&c, 1, NULL, &m), PKV_OK);
    pkv_kv_t *kv = make_kv(m, PKV_BACKEND_PAGED, PKV_DTYPE_F32, 16);
    int32_t toks[80] = {0};
    pkv_seq_t *s = make_seq(kv, toks, 8, 8);
    float logits[100];
    pkv_model_item_t it = {.seq = s, .tokens = toks, .n_tokens = 8, .logits = logits};
    /* token out of range */
    toks[3] = 100;
    ck_assert_int_eq(pkv_model_forward(m, kv, &it, 1), PKV_ERR_INVALID);
    toks[3] = -1;
    ck_assert_int_eq(pkv_model_forward(m, kv, &it, 1), PKV_ERR_INVALID);
    toks[3] = 0;
    ck_assert_uint_eq(pkv_seq_length(s), 0);
    /* beyond capacity */
    it.n_tokens = pkv_seq_capacity(s) + 1;
    ck_assert_int_eq(pkv_model_forward(m, kv, &it, 1), PKV_ERR_INVALID);
    /* zero tokens, no items, NULL seq */
    it.n_tokens = 0;
    ck_assert_int_eq(pkv_model_forward(m, kv, &it, 1), PKV_ERR_INVALID);
    ck_assert_int_eq(pkv_model_forward(m, kv, &it, 0), PKV_ERR_INVALID);
    it.n_tokens = 8;
    /* the same sequence twice */
    pkv_model_item_t two[2] = {it, it};
    ck_assert_int_eq(pkv_model_forward(m, kv, two, 2), PKV_ERR_INVALID);
    ck_assert_uint_eq(pkv_seq_length(s), 0);
    /* beyond max_seq_len */
    ck_assert_int_eq(pkv_seq_reserve(s, 80), PKV_OK);
    it.n_tokens = 65;
    ck_assert_int_eq(pkv_model_forward(m, kv, &it, 1), PKV_ERR_INVALID);
    ck_assert_uint_eq(pkv_seq_length(s), 0);
    /* geometry mismatch */
    pkv_kv_config_t kc = {.backend = PKV_BACKEND_DENSE};
    pkv_model_geometry(m, PKV_DTYPE_F32, 16, &kc.geo);
    kc.geo.head_dim = 32;
    pkv_kv_t *other = NULL;
    ck_assert_int_eq(pkv_kv_create(&kc, &other), PKV_OK);
    it.n_tokens = 8;
    ck_assert_int_eq(pkv_model_forward(m, other, &it, 1), PKV_ERR_INVALID);
    pkv_kv_destroy(other);
    /* and a good call still works */
    ck_assert_int_eq(pkv_model_forward(m, kv, &it, 1), PKV_OK);
    ck_assert_uint_eq(pkv_seq_length(s), 8);
    pkv_seq_free(s);
    pkv_kv_destroy(kv);
    pkv_model_destroy(m);
}
END_TEST

/* ---- bitwise invariance ------------------------------------------------------------------ */

/* Prefill `n` tokens of one sequence, in the given chunk schedule, with `m` on a fresh
 * cache; the logits after each chunk go to out (one vocab row per chunk). */
static void run_schedule(pkv_model_t *m, pkv_backend_t be, pkv_dtype_t dt, uint32_t bt,
                         const int32_t *toks, const uint32_t *chunks, uint32_t nchunks, float *out)
{
    uint32_t V = pkv_model_config(m)->vocab_size, n = 0;
    for (uint32_t i = 0; i < nchunks; i++) n += chunks[i];
    pkv_kv_t *kv = make_kv(m, be, dt, bt);
    pkv_seq_t *s = make_seq(kv, toks, 1, 0);
    uint32_t at = 0;
    for (uint32_t i = 0; i < nchunks; i++) {
        ck_assert_int_eq(pkv_seq_reserve(s, at + chunks[i]), PKV_OK);
        pkv_model_item_t it = {
            .seq = s, .tokens = toks + at, .n_tokens = chunks[i], .logits = out + (size_t)i * V};
        ck_assert_int_eq(pkv_model_forward(m, kv, &it, 1), PKV_OK);
        at += chunks[i];
    }
    ck_assert_uint_eq(pkv_seq_length(s), n);
    pkv_seq_free(s);
    pkv_kv_destroy(kv);
}

START_TEST(invariant_to_backend_blocks_chunks_threads)
{
    uint64_t seed = pkv_test_seed(0x5eed);
    uint64_t rs = seed;
    pkv_model_config_t c;
    ck_assert_int_eq(pkv_model_preset("tiny", &c), PKV_OK);
    c.vocab_size = 128;
    for (int portable = 0; portable < 2; portable++) {
        pkv_model_t *ms[3];
        for (uint32_t t = 0; t < 3; t++) {
            pkv_model_runtime_t rt = {
                .portable = portable, .threads = t + 1, .chunk_tokens = t == 2 ? 5 : 0};
            ck_assert_int_eq(pkv_model_create_builtin(&c, 77, &rt, &ms[t]), PKV_OK);
        }
        for (int dt = SANITIZED ? 2 : 0; dt < 3; dt++) { /* sanitized: bf16 only */
            int32_t toks[100];
            for (int i = 0; i < 100; i++) toks[i] = (int32_t)pkv_test_below(&rs, 128);
            /* Every schedule ends at the same positions (the decode tail), so the logits
             * of the last 4 chunks must agree exactly. */
            uint32_t sched[4][8] = {{96, 1, 1, 1, 1},
                                    {1, 17, 40, 19, 20, 1, 1, 1},
                                    {60, 36, 1, 1, 1, 1},
                                    {3, 3, 3, 87, 1, 1, 1, 1}};
            uint32_t nch[4] = {5, 8, 6, 8};
            float ref[5 * 128], got[8 * 128];
            run_schedule(ms[1], PKV_BACKEND_DENSE, dt, 16, toks, sched[0], nch[0], ref);
            for (int sc = 0; sc < 4; sc += SANITIZED ? 3 : 1) {
                for (uint32_t mi = 0; mi < 3; mi++) {
                    for (int be = 0; be < 2; be++) {
                        if (mi == 1 && be == 1 && sc == 0) continue; /* the reference run */
                        uint32_t bt = be == 0 ? (sc % 2 ? 1 : 16) : 16;
                        run_schedule(ms[mi], be, dt, bt, toks, sched[sc], nch[sc], got);
                        ck_assert_msg(
                            !memcmp(ref + 128, got + (nch[sc] - 4) * 128, 4 * 128 * sizeof(float)),
                            "seed %llu: logits differ (portable %d dtype %d schedule "
                            "%d threads %u backend %d)",
                            (unsigned long long)seed, portable, dt, sc, mi + 1, be);
                    }
                }
            }
        }
        for (uint32_t t = 0; t < 3; t++) pkv_model_destroy(ms[t]);
    }
}
END_TEST

/* A prefill chunk's attention walks its positions in windows shared by a block of row
 * pairs (model.c, att_task); a chunk of two rows is one pair and reads without windows.
 * Both give the same bits, on both backends, in every dtype, with runs cut at any block
 * size (block_tokens 1 gives runs of one token where the pool cannot place them side by
 * side). Geometry: llama-3.2-1b's attention (8 KV heads of 64 dims) on 2 layers, where a
 * window is 128 (f32) or 256 (f16, bf16) positions. */
START_TEST(invariant_to_attention_windows)
{
    uint64_t seed = pkv_test_seed(0x3d0f);
    uint64_t rs = seed;
    pkv_model_config_t c;
    ck_assert_int_eq(pkv_model_preset("llama-3.2-1b", &c), PKV_OK);
    c.vocab_size = 128;
    c.n_layers = 2;
    enum { N = SANITIZED ? 300 : 700 };
    int32_t toks[N];
    for (int i = 0; i < N; i++) toks[i] = (int32_t)pkv_test_below(&rs, 128);
    uint32_t sched[5] = {N - 4, 1, 1, 1, 1};
    pkv_model_t *wide, *pairs;
    pkv_model_runtime_t rw = {.threads = 2}, rp = {.threads = 2, .chunk_tokens = 2};
    ck_assert_int_eq(pkv_model_create_builtin(&c, 9, &rw, &wide), PKV_OK);
    ck_assert_int_eq(pkv_model_create_builtin(&c, 9, &rp, &pairs), PKV_OK);
    static float ref[5 * 128], got[5 * 128];
    for (int dt = 0; dt < PKV_DTYPE_COUNT; dt++) {
        run_schedule(pairs, PKV_BACKEND_DENSE, dt, 16, toks, sched, 5, ref);
        for (int be = 0; be < 2; be++) {
            for (uint32_t bt = 1; bt <= 16; bt += 15) {
                if (be == PKV_BACKEND_DENSE && bt == 1) continue;
                run_schedule(wide, be, dt, bt, toks, sched, 5, got);
                ck_assert_msg(!memcmp(ref, got, sizeof(got)),
                              "seed %llu: windowed logits differ (dtype %d backend %d block %u)",
                              (unsigned long long)seed, dt, be, bt);
            }
        }
    }
    pkv_model_destroy(wide);
    pkv_model_destroy(pairs);
}
END_TEST

/* A segment whose K/V of one layer reaches 16 MiB is attended in blocks of 16 row pairs
 * (model.c, BLOCK_PAIRS_LONG), shorter ones in blocks of 4: the logits of a prefill that
 * crosses that size equal, bit for bit, those of the same tokens two rows at a time. 64 KV
 * heads of 64 dims make a layer's K/V 32 KiB a token in f32 (long from 512 positions) and
 * 16 KiB in bf16 (from 1024). */
START_TEST(invariant_to_long_blocks)
{
    uint64_t seed = pkv_test_seed(0x10b1);
    uint64_t rs = seed;
    pkv_model_config_t c;
    ck_assert_int_eq(pkv_model_preset("llama-3.2-1b", &c), PKV_OK);
    c.vocab_size = 128;
    c.n_layers = 2;
    c.n_heads = c.n_kv_heads = 64;
    enum { N = SANITIZED ? 600 : 1100 };
    static int32_t toks[N];
    for (int i = 0; i < N; i++) toks[i] = (int32_t)pkv_test_below(&rs, 128);
    uint32_t sched[3] = {N - 2, 1, 1};
    pkv_model_t *wide, *pairs;
    pkv_model_runtime_t rw = {.threads = 2}, rp = {.threads = 2, .chunk_tokens = 2};
    ck_assert_int_eq(pkv_model_create_builtin(&c, 9, &rw, &wide), PKV_OK);
    ck_assert_int_eq(pkv_model_create_builtin(&c, 9, &rp, &pairs), PKV_OK);
    static float ref[3 * 128], got[3 * 128];
    pkv_dtype_t dts[2] = {PKV_DTYPE_F32, PKV_DTYPE_BF16};
    for (int d = 0; d < (SANITIZED ? 1 : 2); d++) {
        run_schedule(pairs, PKV_BACKEND_DENSE, dts[d], 16, toks, sched, 3, ref);
        for (int be = 0; be < 2; be++) {
            run_schedule(wide, be, dts[d], 16, toks, sched, 3, got);
            ck_assert_msg(!memcmp(ref, got, sizeof(got)),
                          "seed %llu: logits differ with long blocks (dtype %d backend %d)",
                          (unsigned long long)seed, dts[d], be);
        }
    }
    pkv_model_destroy(wide);
    pkv_model_destroy(pairs);
}
END_TEST

/* A decode pass whose rows reach past one softmax span (2048 positions, model.c ATT_SPAN)
 * runs a task per (row, span) and merges the spans after; a prefill block computes the same
 * spans in its windows. The same tokens give the same logits bit for bit either way: the
 * last three tokens decoded one at a time (span tasks) against the three in one pass
 * (blocks), on both backends and 1 or 2 threads, and a batch of a long and a short sequence
 * (span tasks for both) against each alone (the short one alone takes the block path). */
START_TEST(invariant_to_decode_spans)
{
    uint64_t seed = pkv_test_seed(0xdec5);
    uint64_t rs = seed;
    pkv_model_config_t c;
    ck_assert_int_eq(pkv_model_preset("tiny", &c), PKV_OK);
    c.vocab_size = 64;
    enum { N = 2600, SHORT = 300 };
    static int32_t toks[N], toks2[SHORT];
    for (int i = 0; i < N; i++) toks[i] = (int32_t)pkv_test_below(&rs, 64);
    for (int i = 0; i < SHORT; i++) toks2[i] = (int32_t)pkv_test_below(&rs, 64);
    pkv_model_t *one, *two;
    pkv_model_runtime_t r1 = {.threads = 1}, r2 = {.threads = 2};
    ck_assert_int_eq(pkv_model_create_builtin(&c, 5, &r1, &one), PKV_OK);
    ck_assert_int_eq(pkv_model_create_builtin(&c, 5, &r2, &two), PKV_OK);
    /* ref: the last three tokens in one pass of three rows (a pair and a lone row: blocks) */
    uint32_t sched[4] = {N - 3, 1, 1, 1}, sched_ref[2] = {N - 3, 3};
    static float ref[2 * 64], got[4 * 64];
    run_schedule(two, PKV_BACKEND_DENSE, PKV_DTYPE_BF16, 16, toks, sched_ref, 2, ref);
    for (int be = 0; be < 2; be++) {
        pkv_model_t *ms[2] = {one, two};
        for (int t = 0; t < 2; t++) {
            run_schedule(ms[t], be, PKV_DTYPE_BF16, 16, toks, sched, 4, got);
            ck_assert_msg(!memcmp(ref + 64, got + 3 * 64, 64 * sizeof(float)),
                          "seed %llu: decode past a span differs (backend %d, %d threads)",
                          (unsigned long long)seed, be, t + 1);
        }
    }
    /* One batch: the long sequence's last token and the short one's. */
    uint32_t sched2[2] = {SHORT - 1, 1};
    float alone_short[2 * 64];
    run_schedule(two, PKV_BACKEND_PAGED, PKV_DTYPE_BF16, 16, toks2, sched2, 2, alone_short);
    pkv_kv_t *kv = make_kv(two, PKV_BACKEND_PAGED, PKV_DTYPE_BF16, 16);
    pkv_seq_t *a = make_seq(kv, toks, 1, N), *b = make_seq(kv, toks2, 1, SHORT);
    pkv_model_item_t pre[2] = {{.seq = a, .tokens = toks, .n_tokens = N - 1},
                               {.seq = b, .tokens = toks2, .n_tokens = SHORT - 1}};
    ck_assert_int_eq(pkv_model_forward(two, kv, pre, 2), PKV_OK);
    float la[64], lb[64];
    pkv_model_item_t step[2] = {
        {.seq = a, .tokens = toks + N - 1, .n_tokens = 1, .logits = la},
        {.seq = b, .tokens = toks2 + SHORT - 1, .n_tokens = 1, .logits = lb}};
    ck_assert_int_eq(pkv_model_forward(two, kv, step, 2), PKV_OK);
    ck_assert_msg(!memcmp(la, ref + 64, sizeof(la)), "seed %llu: the long row in a batch differs",
                  (unsigned long long)seed);
    ck_assert_msg(!memcmp(lb, alone_short + 64, sizeof(lb)),
                  "seed %llu: the short row in a batch differs", (unsigned long long)seed);
    pkv_seq_free(a);
    pkv_seq_free(b);
    pkv_kv_destroy(kv);
    pkv_model_destroy(one);
    pkv_model_destroy(two);
}
END_TEST

/* Several sequences in one forward call give each the logits it gets alone. Geometry 1:
 * 32 queries per KV head of 64 dims, so a task's queries (2048 floats for one head, 4096
 * for two) are split for the bf16 kernels all at once alone and one head at a time in a
 * batch (kernels.c, EO_MAX_Q). */
START_TEST(invariant_to_batch_composition)
{
    uint64_t seed = pkv_test_seed(0xba7c);
    uint64_t rs = seed;
    pkv_model_config_t c;
    ck_assert_int_eq(pkv_model_preset("tiny", &c), PKV_OK);
    c.vocab_size = 64;
    if (_i % 2 == 1) {
        c.n_heads = 64;
        c.head_dim = 64;
    }
    pkv_dtype_t dt = _i < 2 ? PKV_DTYPE_BF16 : _i == 2 ? PKV_DTYPE_INT8 : PKV_DTYPE_FP8;
    pkv_model_runtime_t rt = {.chunk_tokens = 24};
    pkv_model_t *m = NULL;
    ck_assert_int_eq(pkv_model_create_builtin(&c, 3, &rt, &m), PKV_OK);
    enum { NS = 6, LEN = 40 };
    int32_t toks[NS][LEN];
    float alone[NS][64];
    for (int s = 0; s < NS; s++) {
        for (int i = 0; i < LEN; i++) toks[s][i] = (int32_t)pkv_test_below(&rs, 64);
        /* The last token alone: one query row, heads split across the threads. */
        uint32_t ch[2] = {LEN - 1, 1};
        float rows[2][64];
        run_schedule(m, PKV_BACKEND_PAGED, dt, 16, toks[s], ch, 2, rows[0]);
        memcpy(alone[s], rows[1], sizeof(alone[s]));
    }
    for (int be = 0; be < 2; be++) {
        pkv_kv_t *kv = make_kv(m, be, dt, 4);
        pkv_seq_t *seqs[NS];
        uint32_t done[NS] = {0};
        for (int s = 0; s < NS; s++) seqs[s] = make_seq(kv, toks[s], 1, LEN);
        float got[NS][64];
        for (int round = 0; round < 200; round++) {
            pkv_model_item_t items[NS];
            uint32_t n = 0;
            for (int s = 0; s < NS; s++) {
                if (done[s] == LEN || pkv_test_below(&rs, 3) == 0) continue;
                uint32_t take = 1 + pkv_test_below(&rs, LEN - done[s]);
                items[n++] = (pkv_model_item_t){.seq = seqs[s],
                                                .tokens = toks[s] + done[s],
                                                .n_tokens = take,
                                                .logits = done[s] + take == LEN ? got[s] : NULL};
                done[s] += take;
            }
            if (n) ck_assert_int_eq(pkv_model_forward(m, kv, items, n), PKV_OK);
        }
        for (int s = 0; s < NS; s++) {
            ck_assert_uint_eq(done[s], LEN);
            ck_assert_msg(!memcmp(alone[s], got[s], sizeof(got[s])),
                          "seed %llu backend %d seq %d differs", (unsigned long long)seed, be, s);
            pkv_seq_free(seqs[s]);
        }
        pkv_kv_destroy(kv);
    }
    pkv_model_destroy(m);
}
END_TEST

/* The shapes of `pagekv bench model`'s long and mixed cases, short: paged and dense give
 * the same logits bit for bit at every step. A small granule (16 KiB) makes the paged reads
 * jump between granules every few blocks, as a long context does in 2 MiB granules. */
typedef struct {
    uint32_t n, prefix, lens[8];
} shape_t;

/* Prefill the shape on one backend (sequence 0 alone, the others adopting the prefix from
 * the cache, then together), then `steps` batched decode steps; logits of the last prefill
 * and of every step into out[(step + 1) * n + i]. */
static void run_shape(pkv_model_t *m, pkv_backend_t be, pkv_dtype_t dt, const shape_t *sh,
                      uint32_t steps, uint64_t seed, float *out)
{
    uint32_t V = pkv_model_config(m)->vocab_size;
    pkv_kv_config_t kc = {.backend = be, .granule_bytes = 16384, .hugepages = true};
    pkv_model_geometry(m, dt, 16, &kc.geo);
    pkv_kv_t *kv = NULL;
    ck_assert_int_eq(pkv_kv_create(&kc, &kv), PKV_OK);
    pkv_seq_t *seq[8];
    int32_t toks[8][1600];
    pkv_model_item_t it[8];
    for (uint32_t i = 0; i < sh->n; i++) {
        uint64_t ps = seed, os = seed + 1 + i;
        for (uint32_t j = 0; j < sh->lens[i]; j++)
            toks[i][j] = (int32_t)(pkv_splitmix64(j < sh->prefix ? &ps : &os) % V);
        pkv_seq_params_t sp = {
            .tokens = toks[i], .n_tokens = sh->lens[i], .reserve_tokens = sh->lens[i] + steps};
        uint32_t cached = 99;
        ck_assert_int_eq(pkv_seq_create(kv, &sp, &seq[i], &cached), PKV_OK);
        ck_assert_uint_eq(cached, (i ? sh->prefix / 16 * 16 : 0));
        it[i] = (pkv_model_item_t){.seq = seq[i],
                                   .tokens = toks[i] + cached,
                                   .n_tokens = sh->lens[i] - cached,
                                   .logits = out + (size_t)i * V};
        if (i == 0) ck_assert_int_eq(pkv_model_forward(m, kv, it, 1), PKV_OK);
    }
    if (sh->n > 1) ck_assert_int_eq(pkv_model_forward(m, kv, it + 1, sh->n - 1), PKV_OK);
    int32_t next[8];
    for (uint32_t s = 0; s < steps; s++) {
        for (uint32_t i = 0; i < sh->n; i++) {
            next[i] = (int32_t)((s * 31 + i * 7) % V);
            ck_assert_int_eq(pkv_seq_reserve(seq[i], pkv_seq_length(seq[i]) + 1), PKV_OK);
            it[i] = (pkv_model_item_t){.seq = seq[i],
                                       .tokens = &next[i],
                                       .n_tokens = 1,
                                       .logits = out + ((size_t)(s + 1) * sh->n + i) * V};
        }
        ck_assert_int_eq(pkv_model_forward(m, kv, it, sh->n), PKV_OK);
    }
    for (uint32_t i = 0; i < sh->n; i++) pkv_seq_free(seq[i]);
    pkv_kv_destroy(kv);
}

START_TEST(paged_equals_dense_long_and_mixed)
{
    uint64_t seed = pkv_test_seed(0x10c4);
    const shape_t shapes[2] = {{1, 0, {SANITIZED ? 600 : 1500}},
                               {8, 48, {64, 80, 100, 130, 150, 200, 260, 300}}};
    enum { STEPS = 6 };
    for (int preset = 0; preset < 2; preset++) {
        pkv_model_config_t c;
        /* tiny: 2 query heads per KV head, head dim 16; llama-3.2-1b's attention shape
         * (head dim 64, 8 KV heads) on 2 layers. */
        ck_assert_int_eq(pkv_model_preset(preset ? "llama-3.2-1b" : "tiny", &c), PKV_OK);
        c.vocab_size = 128;
        c.n_layers = 2;
        pkv_model_runtime_t rt = {.threads = 2};
        pkv_model_t *m = NULL;
        ck_assert_int_eq(pkv_model_create_builtin(&c, 5, &rt, &m), PKV_OK);
        /* bf16 on both; the scaled dtypes on llama's shape (head dim 64: the AVX2 paths) */
        for (int sd = 0; sd < (preset ? 6 : 2); sd++) {
            int sh = sd % 2;
            pkv_dtype_t dt = sd < 2 ? PKV_DTYPE_BF16 : sd < 4 ? PKV_DTYPE_INT8 : PKV_DTYPE_FP8;
            size_t nf = (size_t)(STEPS + 1) * shapes[sh].n * c.vocab_size;
            float *a = calloc(nf, sizeof(float)), *b = calloc(nf, sizeof(float));
            ck_assert(a && b);
            run_shape(m, PKV_BACKEND_PAGED, dt, &shapes[sh], STEPS, seed, a);
            run_shape(m, PKV_BACKEND_DENSE, dt, &shapes[sh], STEPS, seed, b);
            ck_assert_msg(!memcmp(a, b, nf * sizeof(float)),
                          "seed %llu: paged and dense logits differ (preset %d, shape %d, %s)",
                          (unsigned long long)seed, preset, sh, pkv_dtype_name(dt));
            free(a);
            free(b);
        }
        pkv_model_destroy(m);
    }
}
END_TEST

/* The checkpoint fuzz corpus (tests/fuzz/corpus/checkpoint) replayed through the fuzz
 * target's properties: every input passes them, ok-* files load, bad-* files do not. */
START_TEST(llama2c_fuzz_corpus_replays)
{
    uint32_t loaded = pkv_test_corpus_status(
        "PKV_CHECKPOINT_CORPUS", "tests/fuzz/corpus/checkpoint", pkv_fuzz_checkpoint, 10);
    ck_assert_uint_ge(loaded, 4);
}
END_TEST

static TCase *tcase(Suite *s, const char *name)
{
    TCase *tc = tcase_create(name);
    tcase_set_timeout(tc, SANITIZED ? 300 : 120); /* TSan: ~100 s for the invariance case */
    suite_add_tcase(s, tc);
    return tc;
}

static Suite *model_suite(void)
{
    Suite *s = suite_create("model");
    TCase *tc = tcase(s, "llama2c");
    tcase_add_test(tc, llama2c_matches_reference);
    tcase_add_test(tc, llama2c_odd_head_size);
    tcase_add_test(tc, llama2c_matches_reference_head_dim_64);
    tcase_add_test(tc, llama2c_rejects_bad_files);
    tcase_add_test(tc, llama2c_fuzz_corpus_replays);
    tc = tcase(s, "builtin");
    tcase_add_test(tc, builtin_presets);
    tcase_add_test(tc, builtin_is_deterministic);
    tcase_add_test(tc, forward_rejects_bad_input);
    tc = tcase(s, "invariance");
    tcase_add_test(tc, invariant_to_backend_blocks_chunks_threads);
    tc = tcase(s, "batch");
    tcase_add_loop_test(tc, invariant_to_batch_composition, 0, 4);
    tcase_add_test(tc, paged_equals_dense_long_and_mixed);
    tcase_add_test(tc, invariant_to_attention_windows);
    tcase_add_test(tc, invariant_to_long_blocks);
    tcase_add_test(tc, invariant_to_decode_spans);
    return s;
}

PKV_TEST_MAIN(model_suite)
