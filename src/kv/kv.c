/*
 * kv: the KV cache front. Validates arguments, then dispatches through the backend's ops
 * table to the paged pool (pool.c) or the dense baseline (dense.c). Also holds what both
 * share: dtype conversion, geometry arithmetic, prefix keys and the token side of a
 * sequence.
 */
#define OPENSSL_API_COMPAT 0x10101000L /* SHA256_Init: ~100 ns a block vs ~150 via EVP */
#include "kv/kv_int.h"

#include "prim/prim.h"

#include <float.h>
#include <math.h>
#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t pkv_dtype_size(pkv_dtype_t dt)
{
    return dt == PKV_DTYPE_F32 ? 4 : dt == PKV_DTYPE_F16 || dt == PKV_DTYPE_BF16 ? 2 : 1;
}

bool pkv_dtype_scaled(pkv_dtype_t dt)
{
    return dt == PKV_DTYPE_INT8 || dt == PKV_DTYPE_FP8;
}

bool pkv_dtype_rotates_keys(pkv_dtype_t dt, uint32_t head_dim)
{
    return dt == PKV_DTYPE_INT8 && head_dim && (head_dim & (head_dim - 1)) == 0;
}

void pkv_hadamard(float *x, uint32_t n)
{
    for (uint32_t len = 1; len < n; len <<= 1)
        for (uint32_t i = 0; i < n; i += 2 * len)
            for (uint32_t j = i; j < i + len; j++) {
                float a = x[j], b = x[j + len];
                x[j] = a + b;
                x[j + len] = a - b;
            }
    float norm = 1.0f / sqrtf((float)n);
    for (uint32_t i = 0; i < n; i++) x[i] *= norm;
}

size_t pkv_dtype_row_bytes(pkv_dtype_t dt, uint32_t head_dim)
{
    return (size_t)head_dim * pkv_dtype_size(dt) + (pkv_dtype_scaled(dt) ? sizeof(float) : 0);
}

static const struct {
    const char *name;
    pkv_dtype_t dt;
} dtype_names[] = {{"f32", PKV_DTYPE_F32},   {"f16", PKV_DTYPE_F16}, {"bf16", PKV_DTYPE_BF16},
                   {"int8", PKV_DTYPE_INT8}, {"fp8", PKV_DTYPE_FP8}, {"fp8_e4m3", PKV_DTYPE_FP8}};

const char *pkv_dtype_name(pkv_dtype_t dt)
{
    for (size_t i = 0; i < PKV_ARRAY_LEN(dtype_names); i++)
        if (dtype_names[i].dt == dt) return dtype_names[i].name;
    return "?";
}

int pkv_dtype_parse(const char *s, pkv_dtype_t *out)
{
    for (size_t i = 0; s && i < PKV_ARRAY_LEN(dtype_names); i++)
        if (!strcmp(s, dtype_names[i].name)) return *out = dtype_names[i].dt, PKV_OK;
    return PKV_ERR_INVALID;
}

const char *pkv_backend_name(pkv_backend_t b)
{
    return b == PKV_BACKEND_DENSE ? "dense" : "paged";
}

int pkv_backend_parse(const char *s, pkv_backend_t *out)
{
    if (s && !strcmp(s, "paged")) return *out = PKV_BACKEND_PAGED, PKV_OK;
    if (s && !strcmp(s, "dense")) return *out = PKV_BACKEND_DENSE, PKV_OK;
    return PKV_ERR_INVALID;
}

/* An fp8 row: the codes, then the f32 scale (max |x| over the row's finite values / 448;
 * 0 for a row of zeros, whose codes are then all 0). */
static void fp8_from_f32(uint8_t *dst, const float *src, size_t n)
{
    float amax = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float a = fabsf(src[i]);
        if (a > amax && a <= FLT_MAX) amax = a;
    }
    float scale = amax / 448.0f, inv = amax > 0.0f ? 448.0f / amax : 0.0f;
    for (size_t i = 0; i < n; i++) {
        float y = src[i] * inv; /* inf stays inf (saturates); NaN (also inf * 0) -> 0 */
        dst[i] = pkv_f32_to_fp8(isnan(y) ? 0.0f : y);
    }
    memcpy(dst + n, &scale, sizeof(scale));
}

/* The int8 encoder works on lanes (GCC vector types: per-lane IEEE operations, so the
 * result is the scalar definition's on any target): lane j of every 8 values of a row is
 * lane group j, held as two vectors of 4 (lanes 0-3, 4-7). */
typedef float i8v_f __attribute__((vector_size(16)));
typedef int32_t i8v_i __attribute__((vector_size(16)));

static inline i8v_f i8v_sel(i8v_i m, i8v_f a, i8v_f b) /* m ? a : b, per lane */
{
    return (i8v_f)(((i8v_i)a & m) | ((i8v_i)b & ~m));
}

/* Values [c, c + 4) of a row of n (zeros past its end). */
static inline i8v_f i8v_load(const float *src, size_t c, size_t n)
{
    i8v_f x = {0};
    if (c + 4 <= n)
        memcpy(&x, src + c, sizeof(x));
    else
        for (size_t i = c; i < n; i++) x[i - c] = src[i];
    return x;
}

/* Codes: y = x times the reciprocal of its group's scale, clamped to +-127, rounded to
 * nearest even (adding 1.5 * 2^23: exact for |y| <= 127, as rint in the default rounding
 * mode); NaN gives 0. */
static inline i8v_f i8v_code(i8v_f x, i8v_f inv)
{
    const i8v_f top = {127, 127, 127, 127}, zero = {0};
    const i8v_f rnd = {0x1.8p23f, 0x1.8p23f, 0x1.8p23f, 0x1.8p23f};
    i8v_f y = x * inv;
    y = i8v_sel(y > top, top, y);
    y = i8v_sel(y < -top, -top, y);
    y = i8v_sel(y == y, y, zero);
    return (y + rnd) - rnd;
}

/* Lanes [4h, 4h + 4) of v (8 floats). */
static inline i8v_f i8v_half(const float *v, int h)
{
    i8v_f x;
    memcpy(&x, v + 4 * h, sizeof(x));
    return x;
}

/* An int8 row (the scale word: src/core/core.h). E is the least exponent with 2^E * 127 >=
 * the row's largest finite |x|. Each lane group's step: the largest k (smallest scale)
 * whose 127 * scale still covers the group's largest finite |x|, or one or two steps
 * coarser where that stores the group with less squared error (which scale rounds 8 given
 * values best is luck: the best of three is ~10 % below the first); a group holding an
 * infinity takes k = 0 (it saturates at 127 * 2^E). Codes: i8v_code. Lane vectors
 * throughout (two of 4 lanes: h = 0, 1); scalars only where a lane's step picks its scale
 * from the table. */
static void int8_from_f32(uint8_t *dst, const float *src, size_t n)
{
    const i8v_f big = {FLT_MAX, FLT_MAX, FLT_MAX, FLT_MAX}, zero = {0};
    const i8v_i absm = {INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX}, none = {0};
    i8v_f g[2] = {{0}, {0}};
    i8v_i inf[2] = {{0}, {0}};
    for (size_t c = 0; c < n; c += 8)
        for (int h = 0; h < 2; h++) {
            i8v_f a = (i8v_f)((i8v_i)i8v_load(src, c + 4 * h, n) & absm);
            inf[h] |= a > big; /* NaN compares false */
            g[h] = i8v_sel((a <= big) & (a > g[h]), a, g[h]);
        }
    float amax = 0.0f, sc[8], inv[8];
    for (int j = 0; j < 8; j++) amax = g[j / 4][j % 4] > amax ? g[j / 4][j % 4] : amax;
    int e = -124;
    if (amax > 0.0f) {
        int x;
        float m = frexpf(amax / 127.0f, &x); /* amax / 127 = m * 2^x, m in [0.5, 1) */
        e = m == 0.5f ? x - 1 : x;
        e = e < -124 ? -124 : e > 121 ? 121 : e;
    }
    float p2 = ldexpf(1.0f, e); /* a step times 2^E is exact: every scale is normal */
    for (int k = 0; k < 8; k++) sc[k] = pkv_i8_steps()[k] * p2, inv[k] = 1.0f / sc[k];
    /* kc: how many of steps 1..7 cover the group (the scales fall with k); 0 with an
     * infinity. Then the SSE of steps kc, kc - 1, kc - 2 (where >= 0), the best kept. */
    i8v_i kc[2] = {{0}, {0}}, kb[2];
    for (int k = 1; k < 8; k++)
        for (int h = 0; h < 2; h++) {
            i8v_f cover = {127.0f * sc[k], 127.0f * sc[k], 127.0f * sc[k], 127.0f * sc[k]};
            kc[h] -= (cover >= g[h]) & ~inf[h];
        }
    i8v_f best[2] = {{0}, {0}};
    kb[0] = kc[0], kb[1] = kc[1];
    for (int t = 0; t < 3; t++) {
        float li[8], ls[8];
        for (int j = 0; j < 8; j++) {
            int k = kc[j / 4][j % 4] - t;
            li[j] = inv[k < 0 ? 0 : k], ls[j] = sc[k < 0 ? 0 : k];
        }
        for (int h = 0; h < 2; h++) {
            i8v_f l = i8v_half(li, h), s = i8v_half(ls, h), err = {0};
            for (size_t c = 4 * (size_t)h; c < n; c += 8) { /* non-finite values left out */
                i8v_f x = i8v_load(src, c, n);
                x = i8v_sel((i8v_f)((i8v_i)x & absm) <= big, x, zero);
                i8v_f d = x - i8v_code(x, l) * s;
                err += d * d;
            }
            i8v_i tv = {t, t, t, t}, take = t == 0 ? ~none : (kc[h] >= tv) & (err < best[h]);
            best[h] = i8v_sel(take, err, best[h]);
            kb[h] = (kb[h] & ~take) | ((kc[h] - tv) & take);
        }
    }
    uint32_t w = (uint8_t)(int8_t)e;
    float li[8];
    for (int j = 0; j < 8; j++) {
        w |= (uint32_t)kb[j / 4][j % 4] << (8 + 3 * j);
        li[j] = inv[kb[j / 4][j % 4]];
    }
    for (size_t c = 0; c < n; c += 4) {
        i8v_i q = __builtin_convertvector(
            i8v_code(i8v_load(src, c, n), i8v_half(li, (int)(c / 4 % 2))), i8v_i);
        if (c + 4 <= n) {
            typedef int8_t i8v_b __attribute__((vector_size(4)));
            i8v_b b = __builtin_convertvector(q, i8v_b);
            memcpy(dst + c, &b, 4);
        } else {
            for (size_t j = 0; c + j < n; j++) dst[c + j] = (uint8_t)(int8_t)q[j];
        }
    }
    for (int b = 0; b < 4; b++) dst[n + b] = (uint8_t)(w >> (8 * b));
}

void pkv_dtype_from_f32(pkv_dtype_t dt, void *dst, const float *src, size_t n)
{
    uint16_t *d16 = dst;
    switch (dt) {
    case PKV_DTYPE_F32:
        memcpy(dst, src, n * 4);
        break;
    case PKV_DTYPE_F16:
        for (size_t i = 0; i < n; i++) d16[i] = pkv_f32_to_f16(src[i]);
        break;
    case PKV_DTYPE_BF16:
        for (size_t i = 0; i < n; i++) d16[i] = pkv_f32_to_bf16(src[i]);
        break;
    case PKV_DTYPE_INT8:
        int8_from_f32(dst, src, n);
        break;
    case PKV_DTYPE_FP8:
        fp8_from_f32(dst, src, n);
        break;
    }
}

void pkv_dtype_to_f32(pkv_dtype_t dt, float *dst, const void *src, size_t n)
{
    const uint16_t *s16 = src;
    const uint8_t *s8 = src;
    float scale, f[8];
    switch (dt) {
    case PKV_DTYPE_F32:
        memcpy(dst, src, n * 4);
        break;
    case PKV_DTYPE_F16:
        for (size_t i = 0; i < n; i++) dst[i] = pkv_f16_to_f32(s16[i]);
        break;
    case PKV_DTYPE_BF16:
        for (size_t i = 0; i < n; i++) dst[i] = pkv_bf16_to_f32(s16[i]);
        break;
    case PKV_DTYPE_INT8:
        pkv_i8_scales(s8 + n, f);
        for (size_t i = 0; i < n; i++) dst[i] = (float)(int8_t)s8[i] * f[i & 7];
        break;
    case PKV_DTYPE_FP8:
        memcpy(&scale, s8 + n, sizeof(scale));
        for (size_t i = 0; i < n; i++) dst[i] = pkv_fp8_to_f32(s8[i]) * scale;
        break;
    }
}

size_t pkv_geometry_token_bytes(const pkv_geometry_t *g)
{
    return 2ull * g->layers * g->kv_heads * pkv_dtype_row_bytes(g->dtype, g->head_dim);
}

void kv_base_init(struct pkv_kv *kv, const pkv_kv_config_t *cfg, const kv_ops_t *ops)
{
    kv->ops = ops;
    kv->geo = cfg->geo;
    kv->geo.block_tokens = cfg->geo.block_tokens ? cfg->geo.block_tokens : 16;
    kv->backend = cfg->backend;
    kv->row_bytes = pkv_dtype_row_bytes(cfg->geo.dtype, cfg->geo.head_dim);
    kv->token_bytes = pkv_geometry_token_bytes(&kv->geo);
    kv->block_bytes = kv->token_bytes * kv->geo.block_tokens;
    kv->tp = cfg->tp ? cfg->tp : 1;
    /* OpenSSL fetches SHA-256's provider at its first use (~2.5 ms and ~2 MiB of libcrypto
     * faulted in, measured on an AMD EPYC VM): pay it here, not in a server's first request. */
    pkv_kv_key_t root;
    kv_prefix_root(0, &root);
}

/* ---- prefix keys --------------------------------------------------------------------- */

void kv_prefix_root(uint64_t salt, pkv_kv_key_t *out)
{
    uint8_t buf[11 + 8];
    memcpy(buf, "pagekv-root", 11);
    for (int i = 0; i < 8; i++) buf[11 + i] = (uint8_t)(salt >> (8 * i));
    SHA256(buf, sizeof(buf), out->b);
}

void kv_prefix_next(const pkv_kv_key_t *parent, const int32_t *tokens, uint32_t n,
                    pkv_kv_key_t *out)
{
    SHA256_CTX c;
    SHA256_Init(&c);
    SHA256_Update(&c, parent->b, PKV_KV_KEY_BYTES);
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    SHA256_Update(&c, tokens, (size_t)n * 4);
#else
    for (uint32_t i = 0; i < n; i++) {
        uint8_t le[4] = {(uint8_t)tokens[i], (uint8_t)(tokens[i] >> 8), (uint8_t)(tokens[i] >> 16),
                         (uint8_t)((uint32_t)tokens[i] >> 24)};
        SHA256_Update(&c, le, 4);
    }
#endif
    SHA256_Final(out->b, &c);
}

uint32_t pkv_kv_prefix_keys(const pkv_kv_t *kv, uint64_t salt, const int32_t *tokens,
                            uint32_t n_tokens, pkv_kv_key_t *keys)
{
    uint32_t T = kv->geo.block_tokens, nb = n_tokens ? (n_tokens - 1) / T : 0;
    pkv_kv_key_t parent;
    kv_prefix_root(salt, &parent);
    for (uint32_t b = 0; b < nb; b++) {
        kv_prefix_next(&parent, tokens + (size_t)b * T, T, &keys[b]);
        parent = keys[b];
    }
    return nb;
}

int kv_seq_base_init(struct pkv_seq *s, pkv_kv_t *kv, uint64_t salt)
{
    s->tail = kv_calloc(kv->geo.block_tokens, sizeof(int32_t));
    if (!s->tail) return PKV_ERR_NOMEM;
    s->kv = kv;
    s->length = s->capacity = 0;
    s->salt = salt;
    kv_prefix_root(salt, &s->last_key);
    return PKV_OK;
}

void kv_seq_base_fini(struct pkv_seq *s)
{
    free(s->tail);
    s->tail = NULL;
}

void kv_seq_base_copy(struct pkv_seq *dst, const struct pkv_seq *src)
{
    dst->salt = src->salt;
    dst->length = src->length;
    dst->capacity = src->capacity;
    dst->last_key = src->last_key;
    memcpy(dst->tail, src->tail, src->kv->geo.block_tokens * sizeof(int32_t));
}

void kv_seq_base_append(struct pkv_seq *s, const int32_t *tokens, uint32_t n, kv_seq_full_fn full,
                        void *arg)
{
    uint32_t T = s->kv->geo.block_tokens;
    for (uint32_t i = 0; i < n; i++) {
        s->tail[s->length % T] = tokens[i];
        s->length++;
        if (s->length % T == 0) {
            pkv_kv_key_t key, parent = s->last_key;
            kv_prefix_next(&parent, s->tail, T, &key);
            s->last_key = key;
            if (full) full(s, s->length / T - 1, &key, &parent, arg);
        }
    }
}

/* ---- dispatch ---------------------------------------------------------------------- */

int pkv_kv_create(const pkv_kv_config_t *cfg, pkv_kv_t **out)
{
    if (!cfg || !out) return PKV_ERR_INVALID;
    const pkv_geometry_t *g = &cfg->geo;
    uint32_t T = g->block_tokens ? g->block_tokens : 16;
    if (!g->layers || !g->kv_heads || !g->head_dim || g->layers > 1024 || g->kv_heads > 1024 ||
        g->head_dim > 4096 || T > 4096 || (unsigned)g->dtype >= PKV_DTYPE_COUNT) {
        PKV_LOGE("kv", "invalid geometry: layers %u kv_heads %u head_dim %u block_tokens %u",
                 g->layers, g->kv_heads, g->head_dim, T);
        return PKV_ERR_INVALID;
    }
    char why[128];
    if (cfg->tp > 1 && pkv_kv_tp_check(g->kv_heads, cfg->tp, why, sizeof(why))) {
        PKV_LOGE("kv", "%s", why);
        return PKV_ERR_INVALID;
    }
    if (cfg->tp > 1 && cfg->backend == PKV_BACKEND_DENSE) {
        PKV_LOGE("kv", "tp %u: the dense baseline has no tensor-parallel ranks (paged only)",
                 cfg->tp);
        return PKV_ERR_UNSUPPORTED;
    }
    const pkv_kv_storage_t *st = cfg->storage;
    if (st && cfg->backend == PKV_BACKEND_DENSE) {
        PKV_LOGE("kv", "storage %s: the dense baseline lives in host memory (paged only)",
                 st->name ? st->name : "(unnamed)");
        return PKV_ERR_UNSUPPORTED;
    }
    if (st && (!st->stride || !st->reserve || !st->release || !st->commit || !st->decommit ||
               !st->copy)) {
        PKV_LOGE("kv", "storage %s: every operation must be given",
                 st->name ? st->name : "(unnamed)");
        return PKV_ERR_INVALID;
    }
    if (cfg->backend == PKV_BACKEND_PAGED) return kv_pool_create(cfg, out);
    if (cfg->backend == PKV_BACKEND_DENSE) return kv_dense_create(cfg, out);
    return PKV_ERR_INVALID;
}

void pkv_kv_destroy(pkv_kv_t *kv)
{
    if (kv) kv->ops->destroy(kv);
}

const pkv_geometry_t *pkv_kv_geometry(const pkv_kv_t *kv)
{
    return &kv->geo;
}

pkv_backend_t pkv_kv_backend(const pkv_kv_t *kv)
{
    return kv->backend;
}

size_t pkv_kv_block_bytes(const pkv_kv_t *kv)
{
    return kv->block_bytes;
}

int pkv_seq_create(pkv_kv_t *kv, const pkv_seq_params_t *p, pkv_seq_t **out, uint32_t *n_cached)
{
    if (!kv || !p || !out || !p->tokens || p->n_tokens == 0) return PKV_ERR_INVALID;
    if (p->reserve_tokens && p->reserve_tokens < p->n_tokens) return PKV_ERR_INVALID;
    return kv->ops->seq_create(kv, p, out, n_cached);
}

void pkv_seq_free(pkv_seq_t *seq)
{
    if (seq) seq->kv->ops->seq_free(seq);
}

int pkv_seq_reserve(pkv_seq_t *seq, uint32_t n_tokens)
{
    if (!seq) return PKV_ERR_INVALID;
    if (n_tokens <= seq->capacity) return PKV_OK;
    return seq->kv->ops->seq_reserve(seq, n_tokens);
}

int pkv_seq_append(pkv_seq_t *seq, const int32_t *tokens, uint32_t n)
{
    if (!seq || (n && !tokens)) return PKV_ERR_INVALID;
    if (n > seq->capacity - seq->length) return PKV_ERR_INVALID;
    return n ? seq->kv->ops->seq_append(seq, tokens, n) : PKV_OK;
}

int pkv_seq_fork(pkv_seq_t *parent, pkv_seq_t **out)
{
    if (!parent || !out) return PKV_ERR_INVALID;
    return parent->kv->ops->seq_fork(parent, out);
}

uint32_t pkv_seq_length(const pkv_seq_t *seq)
{
    return seq->length;
}

uint32_t pkv_seq_capacity(const pkv_seq_t *seq)
{
    return seq->capacity;
}

void pkv_seq_slot(const pkv_seq_t *seq, uint32_t pos, uint32_t layer, void **k, void **v,
                  size_t *head_stride)
{
    PKV_ASSERT(pos < seq->capacity && layer < seq->kv->geo.layers);
    seq->kv->ops->seq_slot(seq, pos, layer, k, v, head_stride);
}

uint32_t pkv_seq_runs(const pkv_seq_t *seq, uint32_t layer, uint32_t begin, uint32_t end,
                      pkv_kv_run_t *out, uint32_t max, uint32_t *next)
{
    PKV_ASSERT(begin <= end && end <= seq->capacity && layer < seq->kv->geo.layers);
    if (begin == end || max == 0) {
        if (next) *next = begin;
        return 0;
    }
    return seq->kv->ops->seq_runs(seq, layer, begin, end, out, max, next);
}

/* ---- tensor parallelism ------------------------------------------------------------- */

int pkv_kv_tp_check(uint32_t kv_heads, uint32_t tp, char *why, size_t cap)
{
    const char *w = NULL;
    if (tp == 0)
        w = "must be at least 1";
    else if (tp > PKV_KV_MAX_TP)
        w = "is above the cap of 64 ranks";
    else if (!kv_heads)
        w = "needs at least one KV head";
    else if (tp <= kv_heads && kv_heads % tp)
        w = "does not divide the KV heads";
    else if (tp > kv_heads && tp % kv_heads)
        w = "is above the KV heads and not a multiple of them (heads cannot be replicated evenly)";
    if (!w) return PKV_OK;
    if (why && cap) snprintf(why, cap, "tp %u %s (%u KV heads)", tp, w, kv_heads);
    return PKV_ERR_INVALID;
}

void pkv_kv_tp_heads(uint32_t kv_heads, uint32_t tp, uint32_t rank, uint32_t *head_lo,
                     uint32_t *head_n)
{
    PKV_ASSERT(pkv_kv_tp_check(kv_heads, tp, NULL, 0) == PKV_OK && rank < tp);
    if (tp <= kv_heads) {
        *head_n = kv_heads / tp;
        *head_lo = rank * *head_n;
    } else {
        *head_n = 1;
        *head_lo = (uint32_t)((uint64_t)rank * kv_heads / tp);
    }
}

uint32_t pkv_kv_tp(const pkv_kv_t *kv)
{
    return kv->tp;
}

int pkv_kv_rank(const pkv_kv_t *kv, uint32_t rank, pkv_kv_rank_t *out)
{
    if (!kv || !out || rank >= kv->tp) return PKV_ERR_INVALID;
    if (kv->ops->rank) {
        kv->ops->rank(kv, rank, out);
        return PKV_OK;
    }
    pkv_kv_stats_t st; /* dense: one rank, no storage range of its own */
    pkv_kv_stats((pkv_kv_t *)kv, &st);
    *out = (pkv_kv_rank_t){.head_lo = 0,
                           .head_n = kv->geo.kv_heads,
                           .base = NULL,
                           .bytes = st.reserved_bytes,
                           .committed_bytes = st.committed_bytes};
    return PKV_OK;
}

void *pkv_kv_block_head_rank(const pkv_kv_t *kv, uint32_t rank, uint32_t block, uint32_t layer,
                             uint32_t which, uint32_t head)
{
    if (!kv || rank >= kv->tp) return NULL;
    if (kv->tp == 1) return pkv_kv_block_head(kv, block, layer, which, head);
    uint32_t lo, n;
    pkv_kv_tp_heads(kv->geo.kv_heads, kv->tp, rank, &lo, &n);
    if (!kv->ops->block_head_rank || layer >= kv->geo.layers || which > 1 || head < lo ||
        head >= lo + n)
        return NULL;
    return kv->ops->block_head_rank(kv, rank, block, layer, which, head);
}

void pkv_seq_slot_rank(const pkv_seq_t *seq, uint32_t rank, uint32_t pos, uint32_t layer, void **k,
                       void **v, size_t *head_stride)
{
    PKV_ASSERT(rank < seq->kv->tp);
    if (rank == 0) {
        pkv_seq_slot(seq, pos, layer, k, v, head_stride);
        return;
    }
    PKV_ASSERT(pos < seq->capacity && layer < seq->kv->geo.layers);
    seq->kv->ops->seq_slot_rank(seq, rank, pos, layer, k, v, head_stride);
}

uint32_t pkv_seq_runs_rank(const pkv_seq_t *seq, uint32_t rank, uint32_t layer, uint32_t begin,
                           uint32_t end, pkv_kv_run_t *out, uint32_t max, uint32_t *next)
{
    PKV_ASSERT(rank < seq->kv->tp);
    if (rank == 0) return pkv_seq_runs(seq, layer, begin, end, out, max, next);
    PKV_ASSERT(begin <= end && end <= seq->capacity && layer < seq->kv->geo.layers);
    if (begin == end || max == 0) {
        if (next) *next = begin;
        return 0;
    }
    return seq->kv->ops->seq_runs_rank(seq, rank, layer, begin, end, out, max, next);
}

/* ---- paged-only block access: backends without it leave the ops NULL ---------------- */

int pkv_seq_blocks(const pkv_seq_t *seq, const uint32_t **ids, uint32_t *n)
{
    if (!seq || !seq->kv->ops->seq_blocks) return PKV_ERR_UNSUPPORTED;
    seq->kv->ops->seq_blocks(seq, ids, n);
    return PKV_OK;
}

void *pkv_kv_block_head(const pkv_kv_t *kv, uint32_t block, uint32_t layer, uint32_t which,
                        uint32_t head)
{
    if (!kv->ops->block_head || layer >= kv->geo.layers || which > 1 || head >= kv->geo.kv_heads)
        return NULL;
    return kv->ops->block_head(kv, block, layer, which, head);
}

int pkv_kv_pin(pkv_kv_t *kv, const uint32_t *ids, uint32_t n)
{
    if (!kv || !kv->ops->pin) return PKV_ERR_UNSUPPORTED;
    return kv->ops->pin(kv, ids, n);
}

void pkv_kv_unpin(pkv_kv_t *kv, const uint32_t *ids, uint32_t n)
{
    if (kv && kv->ops->unpin) kv->ops->unpin(kv, ids, n);
}

int pkv_kv_blocks_alloc(pkv_kv_t *kv, uint32_t n, uint32_t *ids)
{
    if (!kv || !kv->ops->blocks_alloc) return PKV_ERR_UNSUPPORTED;
    return kv->ops->blocks_alloc(kv, n, ids);
}

void pkv_kv_blocks_free(pkv_kv_t *kv, const uint32_t *ids, uint32_t n)
{
    pkv_kv_unpin(kv, ids, n);
}

int pkv_kv_pages(const pkv_kv_t *kv, uint64_t *resident_bytes, uint64_t *huge_bytes)
{
    if (!kv || !kv->ops->rank) return PKV_ERR_UNSUPPORTED;
    uint64_t res = 0, huge = 0;
    for (uint32_t r = 0; r < kv->tp; r++) { /* every rank's range */
        pkv_kv_rank_t rk;
        pkv_prim_range_pages_t pg;
        kv->ops->rank(kv, r, &rk);
        int rc = pkv_prim_range_pages(rk.base, rk.bytes, &pg);
        if (rc) return rc;
        res += pg.resident_bytes;
        huge += pg.huge_bytes;
    }
    if (resident_bytes) *resident_bytes = res;
    if (huge_bytes) *huge_bytes = huge;
    return PKV_OK;
}

/* ---- cache control, stats, validation --------------------------------------------- */

void pkv_kv_reset_cache(pkv_kv_t *kv)
{
    kv->ops->reset_cache(kv);
}

uint64_t pkv_kv_trim(pkv_kv_t *kv, uint64_t now_ns, uint64_t *next_ns)
{
    if (next_ns) *next_ns = UINT64_MAX;
    return kv->ops->trim ? kv->ops->trim(kv, now_ns, next_ns) : 0;
}

uint32_t pkv_kv_warm_refill(pkv_kv_t *kv, uint32_t max)
{
    return kv->ops->warm_refill ? kv->ops->warm_refill(kv, max) : 0;
}

void pkv_kv_cache_pressure(pkv_kv_t *kv, uint64_t limit_bytes)
{
    if (kv->ops->cache_pressure) kv->ops->cache_pressure(kv, limit_bytes);
}

int pkv_kv_prefix_match(pkv_kv_t *kv, uint64_t salt, const int32_t *tokens, uint32_t n_tokens,
                        uint32_t *matched)
{
    uint32_t T = kv->geo.block_tokens, nk = n_tokens ? (n_tokens - 1) / T : 0;
    if (!nk) {
        *matched = 0;
        return PKV_OK;
    }
    pkv_kv_key_t *keys = kv_malloc((size_t)nk * sizeof(*keys));
    if (!keys) return PKV_ERR_NOMEM;
    nk = pkv_kv_prefix_keys(kv, salt, tokens, n_tokens, keys);
    uint32_t hits = kv->ops->prefix_match(kv, keys, nk);
    free(keys);
    *matched = hits * T;
    return PKV_OK;
}

int pkv_kv_prefix_pin(pkv_kv_t *kv, uint64_t salt, const int32_t *tokens, uint32_t n_tokens,
                      uint32_t **ids, uint32_t *n_ids)
{
    *ids = NULL;
    *n_ids = 0;
    if (!kv->ops->prefix_pin) return PKV_ERR_UNSUPPORTED;
    uint32_t T = kv->geo.block_tokens, nk = n_tokens ? (n_tokens - 1) / T : 0;
    if (!nk) return PKV_OK;
    pkv_kv_key_t *keys = kv_malloc((size_t)nk * sizeof(*keys));
    uint32_t *out = kv_malloc((size_t)nk * sizeof(*out));
    if (!keys || !out) {
        free(keys);
        free(out);
        return PKV_ERR_NOMEM;
    }
    nk = pkv_kv_prefix_keys(kv, salt, tokens, n_tokens, keys);
    uint32_t hits = kv->ops->prefix_pin(kv, keys, nk, out);
    free(keys);
    if (!hits) {
        free(out);
        return PKV_OK;
    }
    *ids = out;
    *n_ids = hits;
    return PKV_OK;
}

void pkv_kv_stats(pkv_kv_t *kv, pkv_kv_stats_t *out)
{
    memset(out, 0, sizeof(*out));
    out->cache_pressure_limit = PKV_KV_NO_LIMIT;
    kv->ops->stats(kv, out);
}

int pkv_kv_validate(pkv_kv_t *kv)
{
    return kv->ops->validate(kv);
}

/* ---- a lower tier's hooks ---------------------------------------------------------------- */

void pkv_kv_on_full(pkv_kv_t *kv, pkv_kv_full_fn fn, void *arg)
{
    kv->on_full = fn;
    kv->on_full_arg = arg;
}

void pkv_kv_on_warm_low(pkv_kv_t *kv, void (*fn)(void *arg), void *arg)
{
    kv->on_warm_low = fn;
    kv->on_warm_low_arg = arg;
}

uint64_t pkv_seq_commit_ns(const pkv_seq_t *seq)
{
    return seq->commit_ns;
}

int pkv_kv_key_pin(pkv_kv_t *kv, const pkv_kv_key_t *key, uint32_t *id)
{
    return kv->ops->key_pin ? kv->ops->key_pin(kv, key, id) : PKV_ERR_UNSUPPORTED;
}

/* Each (layer, K|V, head) piece of a block: block_tokens rows, contiguous in the pool (its
 * rank's range) and in the canonical buffer. */
static size_t piece_bytes(const pkv_kv_t *kv)
{
    return (size_t)kv->geo.block_tokens * kv->row_bytes;
}

void pkv_kv_block_read(const pkv_kv_t *kv, uint32_t id, void *buf)
{
    size_t pb = piece_bytes(kv);
    uint8_t *o = buf;
    for (uint32_t l = 0; l < kv->geo.layers; l++)
        for (uint32_t w = 0; w < 2; w++)
            for (uint32_t h = 0; h < kv->geo.kv_heads; h++, o += pb)
                memcpy(o, kv->ops->block_head(kv, id, l, w, h), pb);
}

void pkv_kv_block_write(pkv_kv_t *kv, uint32_t id, const void *buf)
{
    size_t pb = piece_bytes(kv);
    uint32_t H = kv->geo.kv_heads;
    for (uint32_t r = 0; r < kv->tp; r++) { /* every copy of a replicated head */
        uint32_t lo, n;
        pkv_kv_tp_heads(H, kv->tp, r, &lo, &n);
        for (uint32_t l = 0; l < kv->geo.layers; l++)
            for (uint32_t w = 0; w < 2; w++)
                for (uint32_t h = lo; h < lo + n; h++)
                    memcpy(kv->ops->block_head_rank(kv, r, id, l, w, h),
                           (const uint8_t *)buf + ((size_t)(l * 2 + w) * H + h) * pb, pb);
    }
}

uint32_t pkv_kv_blocks_publish(pkv_kv_t *kv, const uint32_t *ids, const pkv_kv_key_t *keys,
                               uint32_t n, uint64_t salt)
{
    return kv->ops->blocks_publish ? kv->ops->blocks_publish(kv, ids, keys, n, salt) : 0;
}

uint64_t pkv_kv_purge_salt(pkv_kv_t *kv, uint64_t salt)
{
    return kv->ops->purge_salt ? kv->ops->purge_salt(kv, salt) : 0;
}
