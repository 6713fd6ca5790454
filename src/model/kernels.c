/*
 * kernels: portable and AVX2/FMA/F16C inner loops (see kernels.h for the contract that
 * keeps every output element's arithmetic independent of tiling).
 */
#include "model/kernels.h"

#include "core/core.h"
#include "prim/prim.h"

#include <math.h>
#include <string.h>

#define PKV_KMIN(a, b) ((a) < (b) ? (a) : (b))

/* ---- rows to f32 (the scalar conversions are core's) ------------------------------
 * The same switch as pkv_dtype_to_f32, kept here so that it inlines into the portable
 * attention loops (one call per K/V row otherwise). */

static inline void row_to_f32(const void *src, pkv_dtype_t dt, uint32_t n, float *dst)
{
    switch (dt) { /* fp8: the codes' values; the row scale is applied by the caller */
    case PKV_DTYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        break;
    case PKV_DTYPE_F16:
        for (uint32_t i = 0; i < n; i++) dst[i] = pkv_f16_to_f32(((const uint16_t *)src)[i]);
        break;
    case PKV_DTYPE_BF16:
        for (uint32_t i = 0; i < n; i++) dst[i] = pkv_bf16_to_f32(((const uint16_t *)src)[i]);
        break;
    case PKV_DTYPE_INT8: { /* codes times their group's scale (scale word after the codes) */
        float f[8];
        pkv_i8_scales((const uint8_t *)src + n, f);
        for (uint32_t i = 0; i < n; i++) dst[i] = (float)((const int8_t *)src)[i] * f[i & 7];
        break;
    }
    case PKV_DTYPE_FP8:
        for (uint32_t i = 0; i < n; i++) dst[i] = pkv_fp8_to_f32(((const uint8_t *)src)[i]);
        break;
    }
}

/* Bytes of one value and of one row (values, then a scaled dtype's 4-byte scale). */
static inline size_t dt_size(pkv_dtype_t dt)
{
    return dt == PKV_DTYPE_F32 ? 4 : dt == PKV_DTYPE_F16 || dt == PKV_DTYPE_BF16 ? 2 : 1;
}
static inline bool dt_scaled(pkv_dtype_t dt)
{
    return dt == PKV_DTYPE_INT8 || dt == PKV_DTYPE_FP8;
}
static inline size_t row_size(pkv_dtype_t dt, uint32_t hd)
{
    return (size_t)hd * dt_size(dt) + (dt_scaled(dt) ? sizeof(float) : 0);
}
/* The f32 scale of an fp8 row whose values start at row (hd values of one byte); int8
 * rows scale per lane group (pkv_i8_group_scale), and the caller sees 1 here. */
static inline float row_scale(const char *row, uint32_t hd, pkv_dtype_t dt)
{
    float s = 1.0f;
    if (dt == PKV_DTYPE_FP8) memcpy(&s, row + hd, sizeof(s));
    return s;
}

/* ---- portable set ---------------------------------------------------------------- */

static void matmul_portable(const float *x, size_t ldx, uint32_t rows, uint32_t K, const float *w,
                            size_t ldw, uint32_t c0, uint32_t c1, float *y, size_t ldy)
{
    for (uint32_t r = 0; r < rows; r++) {
        float *yr = y + r * ldy;
        const float *xr = x + r * ldx;
        for (uint32_t c = c0; c < c1; c++) yr[c] = 0.0f;
        for (uint32_t k = 0; k < K; k++) {
            float xv = xr[k];
            const float *wr = w + k * ldw;
            for (uint32_t c = c0; c < c1; c++) yr[c] = yr[c] + xv * wr[c];
        }
    }
}

static float dot_portable(const float *q, const float *k, uint32_t hd)
{
    float dot = 0.0f;
    for (uint32_t d = 0; d < hd; d++) dot = dot + q[d] * k[d];
    return dot;
}

static void scores_portable(const float *qa, const float *qb, uint32_t na, uint32_t nb,
                            const pkv_kv_run_t *runs, uint32_t nruns, uint32_t h0, uint32_t nh,
                            uint32_t group, uint32_t hd, pkv_dtype_t dt, float scale, float *oa,
                            float *ob, size_t ostride)
{
    float kt[1024];
    size_t rb = row_size(dt, hd);
    uint32_t n = qb ? nb : na;
    for (uint32_t i = 0; i < nruns && runs[i].pos < n; i++) {
        uint32_t p1 = runs[i].pos + runs[i].n_tokens < n ? runs[i].pos + runs[i].n_tokens : n;
        for (uint32_t h = 0; h < nh; h++) {
            const char *base = (const char *)runs[i].k + (size_t)(h0 + h) * runs[i].head_stride;
            for (uint32_t p = runs[i].pos; p < p1; p++) {
                const char *row = base + (size_t)(p - runs[i].pos) * rb;
                row_to_f32(row, dt, hd, kt);
                float rs = row_scale(row, hd, dt); /* x * 1 is x */
                for (uint32_t j = 0; j < group; j++) {
                    size_t qi = (size_t)h * group + j;
                    if (p < na)
                        oa[qi * ostride + p] = dot_portable(qa + qi * hd, kt, hd) * rs * scale;
                    if (qb && p < nb)
                        ob[qi * ostride + p] = dot_portable(qb + qi * hd, kt, hd) * rs * scale;
                }
            }
        }
    }
}

static void span_exp_portable(float *s, uint32_t n, float *max, float *sum)
{
    float m = -INFINITY;
    for (uint32_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
    float t = 0.0f;
    for (uint32_t i = 0; i < n; i++) {
        s[i] = expf(s[i] - m);
        t = t + s[i];
    }
    *max = m;
    *sum = t;
}

static void av_portable(const float *pa, const float *pb, uint32_t na, uint32_t nb,
                        const pkv_kv_run_t *runs, uint32_t nruns, uint32_t h0, uint32_t nh,
                        uint32_t group, uint32_t hd, pkv_dtype_t dt, size_t pstride, float *aa,
                        float *ab)
{
    float vt[1024];
    size_t rb = row_size(dt, hd);
    uint32_t n = pb ? nb : na;
    for (uint32_t i = 0; i < nruns && runs[i].pos < n; i++) {
        uint32_t p1 = runs[i].pos + runs[i].n_tokens < n ? runs[i].pos + runs[i].n_tokens : n;
        for (uint32_t h = 0; h < nh; h++) {
            const char *base = (const char *)runs[i].v + (size_t)(h0 + h) * runs[i].head_stride;
            for (uint32_t p = runs[i].pos; p < p1; p++) {
                const char *row = base + (size_t)(p - runs[i].pos) * rb;
                row_to_f32(row, dt, hd, vt);
                float rs = row_scale(row, hd, dt);
                for (uint32_t j = 0; j < group; j++) {
                    size_t qi = (size_t)h * group + j;
                    if (p < na) {
                        float pt = pa[qi * pstride + p] * rs, *acc = aa + qi * hd;
                        for (uint32_t d = 0; d < hd; d++) acc[d] = acc[d] + pt * vt[d];
                    }
                    if (pb && p < nb) {
                        float pt = pb[qi * pstride + p] * rs, *acc = ab + qi * hd;
                        for (uint32_t d = 0; d < hd; d++) acc[d] = acc[d] + pt * vt[d];
                    }
                }
            }
        }
    }
}

static float sumsq_portable(const float *x, uint32_t n)
{
    float s = 0.0f;
    for (uint32_t i = 0; i < n; i++) s = s + x[i] * x[i];
    return s;
}

static const model_kernels_t kernels_portable = {
    .name = "portable",
    .matmul = matmul_portable,
    .scores = scores_portable,
    .span_exp = span_exp_portable,
    .av = av_portable,
    .sumsq = sumsq_portable,
};

const model_kernels_t *model_kernels_portable(void)
{
    return &kernels_portable;
}

/* ---- AVX2 / FMA / F16C set --------------------------------------------------------- */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define AVX2_FN     __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

AVX2_INLINE __m256 ld_f32(const void *p)
{
    return _mm256_loadu_ps((const float *)p);
}
AVX2_INLINE __m256 ld_f16(const void *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
AVX2_INLINE __m256 ld_bf16(const void *p)
{
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
AVX2_INLINE __m256 ld_i8(const void *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* e4m3 codes as f16 bits: sign to bit 15, exponent and mantissa to bits 7-13. Both normal
 * and subnormal codes then read as the code's value times 2^-8 (exactly), which the row
 * scale undoes (rscale). Sign-extended to 16 bits and shifted by 7, a code lands its
 * exponent and mantissa in place and its sign in bits 14 and 15; the mask clears bit 14
 * (three operations before the conversion). */
AVX2_INLINE __m256 ld_fp8(const void *p)
{
    __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16((short)0xbf80)));
}
AVX2_INLINE __m256 ld_dt(const void *p, pkv_dtype_t dt)
{
    switch (dt) {
    case PKV_DTYPE_F32:
        return ld_f32(p);
    case PKV_DTYPE_F16:
        return ld_f16(p);
    case PKV_DTYPE_INT8:
        return ld_i8(p);
    case PKV_DTYPE_FP8:
        return ld_fp8(p);
    default:
        return ld_bf16(p);
    }
}
/* The factor an fp8 row's ld_dt values take: its scale times 2^8 (see ld_fp8); plain
 * dtypes take none and int8 rows take their group scales (i8_scales). */
AVX2_INLINE float rscale(const char *row, uint32_t hd)
{
    return row_scale(row, hd, PKV_DTYPE_FP8) * 256.0f;
}
/* An int8 row's 8 group scales (sw: its scale word): lane j is group j, the dims d with
 * d mod 8 = j, i.e. lane j of every 8-dim vector of the row. The word broadcast, the step
 * table permuted by each lane's 3-bit field shifted down (permutevar reads an index's low
 * 3 bits), then E (the low byte, sign-extended into bits 23-31) added to the exponents:
 * the same bits as pkv_i8_group_scale, in six vector operations. */
AVX2_INLINE __m256 i8_scales(const char *sw)
{
    int32_t w;
    memcpy(&w, sw, sizeof(w)); /* little-endian: the word's byte order */
    __m256i v = _mm256_set1_epi32(w);
    __m256i k = _mm256_srlv_epi32(v, _mm256_setr_epi32(8, 11, 14, 17, 20, 23, 26, 29));
    __m256 t = _mm256_permutevar8x32_ps(_mm256_loadu_ps(pkv_i8_steps()), k);
    __m256i e = _mm256_srai_epi32(_mm256_slli_epi32(v, 24), 1);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(t), e));
}
/* A V row's weight: p_t, times the row's factor for a scaled dtype (sp: the row's values
 * from dim d0, a multiple of 8, so its scale is at sp + soff, soff = hd - d0): for int8 a
 * vector, lane j's dims being group j's. */
AVX2_INLINE __m256 pweight(const float *p, const char *sp, size_t soff, pkv_dtype_t dt)
{
    if (dt == PKV_DTYPE_INT8) return _mm256_mul_ps(_mm256_broadcast_ss(p), i8_scales(sp + soff));
    if (!dt_scaled(dt)) return _mm256_broadcast_ss(p);
    return _mm256_set1_ps(*p * rscale(sp + soff, 0));
}

/* r[i] = ((a_i0 + a_i1) + (a_i2 + a_i3)) + ((a_i4 + a_i5) + (a_i6 + a_i7)) for each of
 * the 8 vectors: a fixed tree per vector, whatever the other vectors hold. */
AVX2_INLINE __m256 reduce8(const __m256 a[8])
{
    __m256 h01 = _mm256_hadd_ps(a[0], a[1]);
    __m256 h23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 h45 = _mm256_hadd_ps(a[4], a[5]);
    __m256 h67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 h0123 = _mm256_hadd_ps(h01, h23);
    __m256 h4567 = _mm256_hadd_ps(h45, h67);
    __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20);
    __m256 hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
    return _mm256_add_ps(lo, hi);
}

/* The same tree for one vector. */
AVX2_INLINE float reduce1(__m256 a)
{
    __m256 h = _mm256_hadd_ps(a, a);
    h = _mm256_hadd_ps(h, h);
    __m128 lo = _mm256_castps256_ps128(h);
    __m128 hi = _mm256_extractf128_ps(h, 1);
    return _mm_cvtss_f32(_mm_add_ss(lo, hi));
}

AVX2_INLINE __m256i tail_mask(uint32_t n) /* lanes < n set, n in [0, 8] */
{
    static const int32_t m[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256((const __m256i *)(m + 8 - n));
}

/* Cephes-style expf: range reduction by ln 2, degree-5 polynomial, 2^n by exponent
 * arithmetic. Max relative error ~2 ulp on [-87, 88]; used for softmax only. */
AVX2_INLINE __m256 exp256(__m256 x)
{
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447504f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    __m256 x2 = _mm256_mul_ps(x, x);
    y = _mm256_fmadd_ps(y, x2, x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i n = _mm256_cvttps_epi32(fx);
    n = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

/* R rows x 16 columns, k ascending. */
AVX2_INLINE void mm_tile(const float *x, size_t ldx, uint32_t K, const float *w, size_t ldw,
                         float *y, size_t ldy, const int R)
{
    __m256 a[4][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (uint32_t k = 0; k < K; k++) {
        __m256 w0 = _mm256_loadu_ps(w + k * ldw);
        __m256 w1 = _mm256_loadu_ps(w + k * ldw + 8);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            a[r][0] = _mm256_fmadd_ps(xb, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xb, w1, a[r][1]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(y + r * ldy, a[r][0]);
        _mm256_storeu_ps(y + r * ldy + 8, a[r][1]);
    }
}

AVX2_FN static void matmul_avx2(const float *x, size_t ldx, uint32_t rows, uint32_t K,
                                const float *w, size_t ldw, uint32_t c0, uint32_t c1, float *y,
                                size_t ldy)
{
    uint32_t r = 0;
    for (; r + 4 <= rows; r += 4)
        for (uint32_t c = c0; c < c1; c += 16)
            mm_tile(x + r * ldx, ldx, K, w + c, ldw, y + r * ldy + c, ldy, 4);
    uint32_t left = rows - r;
    for (uint32_t c = c0; c < c1 && left; c += 16) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy + c;
        switch (left) {
        case 3:
            mm_tile(xr, ldx, K, w + c, ldw, yr, ldy, 3);
            break;
        case 2:
            mm_tile(xr, ldx, K, w + c, ldw, yr, ldy, 2);
            break;
        default:
            mm_tile(xr, ldx, K, w + c, ldw, yr, ldy, 1);
            break;
        }
    }
}

/* Prime the next run's region for heads from h0: its first 1 KiB, for the two-row
 * (prefill) reads, which have no prefetch stream. A paged block holds a layer's heads
 * back to back, so the hardware prefetcher then streams the rest; without this every
 * run starts with exposed misses. (Prefetching whole runs fills the miss buffers and
 * stalls; measured slower.) The one-row (decode) reads do not use it: their stream
 * (pf_ahead) reaches the next run anyway, and these extra prefetches cost paged decode
 * at 16k ~1.5 % (they wait on fill buffers the stream needs). */
#define PREFETCH_LINES 16
AVX2_INLINE void prefetch_run_start(const void *base, size_t head_stride, uint32_t h0)
{
    const char *p = (const char *)base + (size_t)h0 * head_stride;
    for (int l = 0; l < PREFETCH_LINES; l++) _mm_prefetch(p + 64 * l, _MM_HINT_T0);
}

/* A decode piece read as one stream: the piece (one run's tokens of one head), then the
 * same head's piece in the next run. The hardware prefetcher follows a piece but
 * restarts cold at every jump to the next one: in a paged pool that is every 64 tokens
 * (a granule's slots of one head, 8 KiB in bf16 at head dim 64). pf_ahead keeps lines
 * PF_AHEAD bytes ahead of the reads, across the jump. Where they go depends on the CPU
 * (model_kernels_avx2 picks): into L2 (prefetcht1) on Intel, where prefetcht0 made
 * decode at 16k ~0.8x as fast with either backend (measured on a Xeon VM; likely a t0
 * prefetch holding one of the few L1 miss buffers the loads then wait for); into L1
 * (prefetcht0) on AMD, where bare reads of paged pieces ran ~2x as fast with t0 as with
 * t1 (AMD EPYC family 26; docs/design/model.md, "Speed"). Prefetches change no value. */
#define PF_AHEAD 4096
typedef struct {
    const char *cur, *next; /* next: NULL at the end of the head's reads */
    size_t len;             /* bytes of cur that are read */
    bool t0;                /* prefetcht0, else prefetcht1 */
} pf_stream_t;

AVX2_INLINE void pf_line(const char *p, bool t0)
{
    if (t0)
        _mm_prefetch(p, _MM_HINT_T0);
    else
        _mm_prefetch(p, _MM_HINT_T1);
}

/* Prefetch the `lines` cache lines at offset off + PF_AHEAD of the stream. They nearly
 * always lie in one piece, so the address is found once per call; the walk line by line
 * is for a span that crosses the end of the piece. */
AVX2_INLINE void pf_ahead(const pf_stream_t *ps, size_t off, int lines)
{
    size_t o = off + PF_AHEAD, span = 64 * (size_t)lines;
    const char *p;
    if (o + span <= ps->len) {
        p = ps->cur + o;
    } else if (o >= ps->len) {
        if (!ps->next) return;
        p = ps->next + (o - ps->len);
    } else {
        for (int l = 0; l < lines; l++, o += 64) {
            p = o < ps->len ? ps->cur + o : ps->next ? ps->next + (o - ps->len) : NULL;
            if (p) pf_line(p, ps->t0);
        }
        return;
    }
    for (int l = 0; l < lines; l++) pf_line(p + 64 * l, ps->t0);
}

/* bf16 rows (head dims a multiple of 16) are read 16 values per load: as 32-bit lanes, a
 * lane's low half is the even value and its high half the odd one, so a shift and a mask
 * make them f32 (one load and two integer operations per 16 values, against a load, a
 * widen and a shift per 8). The other operand is split to match: a query's 16 dims as
 * their 8 even then 8 odd (split_q), so a score sums its products in a fixed order per
 * head dim (not the 8-dim order of f16 / f32); the V accumulators are held split and
 * restored to dim order on the way out (av1_run), where each dim sums the same products
 * in the same order as with ld_bf16. */
AVX2_INLINE void ld_bf16x16(const void *p, __m256 *even, __m256 *odd)
{
    __m256i w = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
}
/* dims [0, 16) in order (lo: 0-7, hi: 8-15) -> even dims, odd dims; and back. */
AVX2_INLINE void split16(__m256 lo, __m256 hi, __m256 *even, __m256 *odd)
{
    *even = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xd8));
    *odd = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xdd)), 0xd8));
}
AVX2_INLINE void join16(__m256 even, __m256 odd, __m256 *lo, __m256 *hi)
{
    __m256 a = _mm256_unpacklo_ps(even, odd), b = _mm256_unpackhi_ps(even, odd);
    *lo = _mm256_permute2f128_ps(a, b, 0x20);
    *hi = _mm256_permute2f128_ps(a, b, 0x31);
}

/* A query for bf16 keys read split (ld_bf16x16): each 16 dims as their even dims, then
 * their odd ones. EO_MAX_Q: floats of a task's queries split at once on the stack (at
 * least 1024, the largest head, for the one-head-at-a-time case). */
#define EO_MAX_Q 2048
AVX2_INLINE const float *split_q(const float *q, size_t n, float *out)
{
    for (size_t d = 0; d < n; d += 16) {
        __m256 e, o;
        split16(_mm256_loadu_ps(q + d), _mm256_loadu_ps(q + d + 8), &e, &o);
        _mm256_storeu_ps(out + d, e);
        _mm256_storeu_ps(out + d + 8, o);
    }
    return out;
}

/* One query against up to 8 tokens: lanes of missing tokens read token 0, dropped. */
AVX2_INLINE void s_1x8(const float *q, const char *k, uint32_t nt, uint32_t hd, size_t es,
                       pkv_dtype_t dt, bool eo, __m256 scale, float *out)
{
    size_t ts = row_size(dt, hd);
    const char *k0 = k, *k1 = k + (nt > 1) * ts, *k2 = k + (nt > 2) * 2 * ts;
    const char *k3 = k + (nt > 3) * 3 * ts, *k4 = k + (nt > 4) * 4 * ts;
    const char *k5 = k + (nt > 5) * 5 * ts, *k6 = k + (nt > 6) * 6 * ts;
    const char *k7 = k + (nt > 7) * 7 * ts;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (uint32_t d = 0; eo && d < hd; d += 16) {
        __m256 qe = _mm256_loadu_ps(q + d), qo = _mm256_loadu_ps(q + d + 8), e, o;
        size_t b = d * 2;
#define EO_FMA(kx, ax)                                                                             \
    ld_bf16x16(kx + b, &e, &o);                                                                    \
    ax = _mm256_fmadd_ps(qo, o, _mm256_fmadd_ps(qe, e, ax))
        EO_FMA(k0, a0);
        EO_FMA(k1, a1);
        EO_FMA(k2, a2);
        EO_FMA(k3, a3);
        EO_FMA(k4, a4);
        EO_FMA(k5, a5);
        EO_FMA(k6, a6);
        EO_FMA(k7, a7);
#undef EO_FMA
    }
    for (uint32_t d = 0; !eo && d < hd; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        size_t o = d * es;
        a0 = _mm256_fmadd_ps(qv, ld_dt(k0 + o, dt), a0);
        a1 = _mm256_fmadd_ps(qv, ld_dt(k1 + o, dt), a1);
        a2 = _mm256_fmadd_ps(qv, ld_dt(k2 + o, dt), a2);
        a3 = _mm256_fmadd_ps(qv, ld_dt(k3 + o, dt), a3);
        a4 = _mm256_fmadd_ps(qv, ld_dt(k4 + o, dt), a4);
        a5 = _mm256_fmadd_ps(qv, ld_dt(k5 + o, dt), a5);
        a6 = _mm256_fmadd_ps(qv, ld_dt(k6 + o, dt), a6);
        a7 = _mm256_fmadd_ps(qv, ld_dt(k7 + o, dt), a7);
    }
    if (dt == PKV_DTYPE_INT8) { /* lane j summed group j's dims: its scale, then the tree */
        a0 = _mm256_mul_ps(a0, i8_scales(k0 + hd));
        a1 = _mm256_mul_ps(a1, i8_scales(k1 + hd));
        a2 = _mm256_mul_ps(a2, i8_scales(k2 + hd));
        a3 = _mm256_mul_ps(a3, i8_scales(k3 + hd));
        a4 = _mm256_mul_ps(a4, i8_scales(k4 + hd));
        a5 = _mm256_mul_ps(a5, i8_scales(k5 + hd));
        a6 = _mm256_mul_ps(a6, i8_scales(k6 + hd));
        a7 = _mm256_mul_ps(a7, i8_scales(k7 + hd));
    }
    __m256 a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    __m256 s = reduce8(a);
    if (dt == PKV_DTYPE_FP8)
        s = _mm256_mul_ps(s, _mm256_set_ps(rscale(k7, hd), rscale(k6, hd), rscale(k5, hd),
                                           rscale(k4, hd), rscale(k3, hd), rscale(k2, hd),
                                           rscale(k1, hd), rscale(k0, hd)));
    s = _mm256_mul_ps(s, scale);
    if (nt == 8)
        _mm256_storeu_ps(out, s);
    else
        _mm256_maskstore_ps(out, tail_mask(nt), s);
}

/* Two queries against up to 4 tokens (each K load feeds both). */
AVX2_INLINE void s_2x4(const float *qa, const float *qb, const char *k, uint32_t nt, uint32_t hd,
                       size_t es, pkv_dtype_t dt, bool eo, __m256 scale, float *oa, float *ob)
{
    size_t ts = row_size(dt, hd);
    const char *k0 = k, *k1 = k + (nt > 1) * ts, *k2 = k + (nt > 2) * 2 * ts;
    const char *k3 = k + (nt > 3) * 3 * ts;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (uint32_t d = 0; eo && d < hd; d += 16) {
        __m256 qae = _mm256_loadu_ps(qa + d), qao = _mm256_loadu_ps(qa + d + 8);
        __m256 qbe = _mm256_loadu_ps(qb + d), qbo = _mm256_loadu_ps(qb + d + 8), e, o;
        size_t b = d * 2;
#define EO_FMA2(kx, ax, bx)                                                                        \
    ld_bf16x16(kx + b, &e, &o);                                                                    \
    ax = _mm256_fmadd_ps(qao, o, _mm256_fmadd_ps(qae, e, ax));                                     \
    bx = _mm256_fmadd_ps(qbo, o, _mm256_fmadd_ps(qbe, e, bx))
        EO_FMA2(k0, a0, b0);
        EO_FMA2(k1, a1, b1);
        EO_FMA2(k2, a2, b2);
        EO_FMA2(k3, a3, b3);
#undef EO_FMA2
    }
    for (uint32_t d = 0; !eo && d < hd; d += 8) {
        __m256 qav = _mm256_loadu_ps(qa + d), qbv = _mm256_loadu_ps(qb + d);
        size_t o = d * es;
        __m256 kv = ld_dt(k0 + o, dt);
        a0 = _mm256_fmadd_ps(qav, kv, a0);
        b0 = _mm256_fmadd_ps(qbv, kv, b0);
        kv = ld_dt(k1 + o, dt);
        a1 = _mm256_fmadd_ps(qav, kv, a1);
        b1 = _mm256_fmadd_ps(qbv, kv, b1);
        kv = ld_dt(k2 + o, dt);
        a2 = _mm256_fmadd_ps(qav, kv, a2);
        b2 = _mm256_fmadd_ps(qbv, kv, b2);
        kv = ld_dt(k3 + o, dt);
        a3 = _mm256_fmadd_ps(qav, kv, a3);
        b3 = _mm256_fmadd_ps(qbv, kv, b3);
    }
    if (dt == PKV_DTYPE_INT8) { /* as s_1x8 */
        __m256 f0 = i8_scales(k0 + hd), f1 = i8_scales(k1 + hd), f2 = i8_scales(k2 + hd);
        __m256 f3 = i8_scales(k3 + hd);
        a0 = _mm256_mul_ps(a0, f0), b0 = _mm256_mul_ps(b0, f0);
        a1 = _mm256_mul_ps(a1, f1), b1 = _mm256_mul_ps(b1, f1);
        a2 = _mm256_mul_ps(a2, f2), b2 = _mm256_mul_ps(b2, f2);
        a3 = _mm256_mul_ps(a3, f3), b3 = _mm256_mul_ps(b3, f3);
    }
    __m256 a[8] = {a0, a1, a2, a3, b0, b1, b2, b3};
    __m256 s = reduce8(a);
    if (dt == PKV_DTYPE_FP8) {
        float r0 = rscale(k0, hd), r1 = rscale(k1, hd), r2 = rscale(k2, hd);
        float r3 = rscale(k3, hd);
        s = _mm256_mul_ps(s, _mm256_set_ps(r3, r2, r1, r0, r3, r2, r1, r0));
    }
    s = _mm256_mul_ps(s, scale);
    __m128 sa = _mm256_castps256_ps128(s), sb = _mm256_extractf128_ps(s, 1);
    if (nt == 4) {
        _mm_storeu_ps(oa, sa);
        _mm_storeu_ps(ob, sb);
    } else {
        __m128i mask = _mm256_castsi256_si128(tail_mask(nt));
        _mm_maskstore_ps(oa, mask, sa);
        _mm_maskstore_ps(ob, mask, sb);
    }
}

/* ---- decode: one query row, two heads' pieces in flight ---------------------------
 * A paged pool holds a head's tokens of one granule as one piece (64 tokens, 8 KiB in
 * bf16 at head dim 64) and the next piece of the same head in another granule. Read one
 * piece at a time, every jump to the next granule restarts the hardware prefetcher cold;
 * read two at once, in two granules, the two restarts overlap (on an AMD EPYC, family
 * 26, bare reads of 16 KiB pieces reach ~1.7x the rate of one stream, about what a
 * contiguous buffer gives; docs/design/model.md, "Speed"). So a decode task walks its
 * heads in pairs, skewed by one run: at step s head A reads run s and head B run s - 1.
 * Each head still folds its runs in ascending order (V) and every score is its own
 * (K), so no value changes. */
typedef struct {
    const char *base; /* the piece's first row, NULL: no piece at this step */
    uint32_t p0, n;   /* first position, tokens */
    pf_stream_t ps;   /* the piece, then the same head's piece in the next run */
} dpiece_t;

AVX2_INLINE dpiece_t dpiece(const pkv_kv_run_t *runs, uint32_t nr, int64_t i, uint32_t h,
                            uint32_t n, size_t ts, int which, const bool t0)
{
    dpiece_t d = {.ps.t0 = t0};
    if (i < 0 || i >= nr) return d;
    const pkv_kv_run_t *r = &runs[i];
    const char *b = which ? (const char *)r->v : (const char *)r->k;
    uint32_t p1 = r->pos + r->n_tokens < n ? r->pos + r->n_tokens : n;
    d.base = b + (size_t)h * r->head_stride;
    d.p0 = r->pos;
    d.n = p1 - r->pos;
    d.ps.cur = d.base;
    d.ps.len = (size_t)d.n * ts;
    if (i + 1 < nr)
        d.ps.next = (const char *)(which ? runs[i + 1].v : runs[i + 1].k) +
                    (size_t)h * runs[i + 1].head_stride;
    return d;
}

/* The runs a decode row of n positions reads. */
AVX2_INLINE uint32_t runs_below(const pkv_kv_run_t *runs, uint32_t nruns, uint32_t n)
{
    uint32_t nr = 0;
    while (nr < nruns && runs[nr].pos < n) nr++;
    return nr;
}

/* Scores of 8 tokens from token t of piece d for the group's queries of its head. */
AVX2_INLINE void s1_chunk(const dpiece_t *d, uint32_t t, const float *q, uint32_t group,
                          uint32_t hd, size_t ts, size_t es, pkv_dtype_t dt, bool eo, bool split,
                          __m256 sc, float *o, size_t ostride, int lines)
{
    pf_ahead(&d->ps, (size_t)t * ts, lines);
    uint32_t nt = d->n - t < 8 ? d->n - t : 8;
    float qp[EO_MAX_Q];
    for (uint32_t j = 0; j < group; j++) {
        const float *qj = q + (size_t)j * hd;
        if (split) qj = split_q(qj, hd, qp);
        s_1x8(qj, d->base + t * ts, nt, hd, es, dt, eo, sc, o + j * ostride + d->p0 + t);
    }
}

/* One row's scores, heads in skewed pairs. bf16 keys read split need split queries: a
 * pair's at once where they fit on the stack, else each query per chunk (the same
 * values). */
AVX2_INLINE void scores1_dt(const float *q, uint32_t n, const pkv_kv_run_t *runs, uint32_t nruns,
                            uint32_t h0, uint32_t nh, uint32_t group, uint32_t hd, pkv_dtype_t dt,
                            bool eo, __m256 sc, float *o, size_t ostride, const bool t0)
{
    size_t es = dt_size(dt), ts = row_size(dt, hd), qs = (size_t)group * hd;
    int lines = (int)(8 * ts / 64);
    uint32_t nr = runs_below(runs, nruns, n);
    float qp[EO_MAX_Q];
    for (uint32_t h = 0; h < nh; h += 2) {
        bool two = h + 1 < nh, each = eo && (1 + two) * qs > EO_MAX_Q;
        const float *qa = q + h * qs, *qb = qa + qs;
        if (eo && !each) {
            qa = split_q(qa, (1 + two) * qs, qp);
            qb = qa + qs;
        }
        float *oa = o + (size_t)h * group * ostride, *ob = oa + (size_t)group * ostride;
        for (int64_t s = 0; s < (int64_t)nr + two; s++) {
            dpiece_t a = dpiece(runs, nr, s, h0 + h, n, ts, 0, t0);
            dpiece_t b = two ? dpiece(runs, nr, s - 1, h0 + h + 1, n, ts, 0, t0) : (dpiece_t){0};
            uint32_t m = a.n > b.n ? a.n : b.n;
            for (uint32_t t = 0; t < m; t += 8) {
                if (t < a.n)
                    s1_chunk(&a, t, qa, group, hd, ts, es, dt, eo, each, sc, oa, ostride, lines);
                if (t < b.n)
                    s1_chunk(&b, t, qb, group, hd, ts, es, dt, eo, each, sc, ob, ostride, lines);
            }
        }
    }
}

AVX2_INLINE void scores_dt(const float *qa, const float *qb, uint32_t na, uint32_t nb,
                           const pkv_kv_run_t *runs, uint32_t nruns, uint32_t h0, uint32_t nh,
                           uint32_t group, uint32_t hd, pkv_dtype_t dt, float scale, float *oa,
                           float *ob, size_t ostride, const bool t0)
{
    size_t es = dt_size(dt), ts = row_size(dt, hd);
    __m256 sc = _mm256_set1_ps(scale);
    uint32_t n = nb;
    /* bf16 keys are read split (ld_bf16x16), so the queries are split to match: all at
     * once where they fit on the stack, else one head at a time (the same values). */
    size_t nq = (size_t)nh * group * hd;
    bool eo = dt == PKV_DTYPE_BF16 && hd % 16 == 0 && hd <= EO_MAX_Q, whole = eo && nq <= EO_MAX_Q;
    if (!qb) {
        scores1_dt(qa, na, runs, nruns, h0, nh, group, hd, dt, eo, sc, oa, ostride, t0);
        return;
    }
    float qpa[EO_MAX_Q], qpb[EO_MAX_Q];
    if (whole) {
        qa = split_q(qa, nq, qpa);
        qb = split_q(qb, nq, qpb);
    }
    for (uint32_t i = 0; i < nruns && runs[i].pos < n; i++) {
        uint32_t p0 = runs[i].pos;
        uint32_t p1 = p0 + runs[i].n_tokens < n ? p0 + runs[i].n_tokens : n;
        if (i + 1 < nruns) prefetch_run_start(runs[i + 1].k, runs[i + 1].head_stride, h0);
        for (uint32_t h = 0; h < nh; h++) {
            const char *base = (const char *)runs[i].k + (size_t)(h0 + h) * runs[i].head_stride;
            for (uint32_t j = 0; j < group; j++) {
                size_t qi = (size_t)h * group + j;
                const float *q1 = qa + qi * hd, *q2 = qb + qi * hd;
                if (eo && !whole) {
                    q1 = split_q(q1, hd, qpa);
                    q2 = split_q(q2, hd, qpb);
                }
                float *o1 = oa + qi * ostride, *o2 = ob + qi * ostride;
                uint32_t e = p1 < na ? p1 : na;
                for (uint32_t t = p0; t < e; t += 4)
                    s_2x4(q1, q2, base + (t - p0) * ts, e - t < 4 ? e - t : 4, hd, es, dt, eo, sc,
                          o1 + t, o2 + t);
                for (uint32_t t = e > p0 ? e : p0; t < p1; t += 8)
                    s_1x8(q2, base + (t - p0) * ts, p1 - t < 8 ? p1 - t : 8, hd, es, dt, eo, sc,
                          o2 + t);
            }
        }
    }
}

AVX2_FN static void span_exp_avx2(float *s, uint32_t n, float *max, float *total)
{
    uint32_t n8 = n & ~7u;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (uint32_t i = 0; i < n8; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
    float m = -INFINITY;
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    for (uint32_t i = n8; i < n; i++) m = s[i] > m ? s[i] : m;
    __m256 mb = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (uint32_t i = 0; i < n8; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), mb));
        _mm256_storeu_ps(s + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (n8 < n) {
        __m256i mask = tail_mask(n - n8);
        __m256 e = exp256(_mm256_sub_ps(_mm256_maskload_ps(s + n8, mask), mb));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(mask));
        _mm256_maskstore_ps(s + n8, mask, e);
        sum = _mm256_add_ps(sum, e);
    }
    *max = m;
    *total = reduce1(sum);
}

/* V accumulators of dims [0, 8 NV) in registers: bf16 (eo) in 16-dim chunks (ld_bf16x16),
 * a[2c] holding chunk c's even dims and a[2c + 1] its odd ones, else in dim order. */
AVX2_INLINE void acc_load(const float *acc, __m256 *a, bool eo, const int NV)
{
#pragma GCC unroll 8
    for (int j = 0; j < NV; j++) {
        if (eo && j % 2 == 0)
            split16(_mm256_loadu_ps(acc + 8 * j), _mm256_loadu_ps(acc + 8 * j + 8), &a[j],
                    &a[j + 1]);
        else if (!eo)
            a[j] = _mm256_loadu_ps(acc + 8 * j);
    }
}
AVX2_INLINE void acc_store(float *acc, const __m256 *a, bool eo, const int NV)
{
#pragma GCC unroll 8
    for (int j = 0; j < NV; j++) {
        if (eo && j % 2 == 0) {
            __m256 lo, hi;
            join16(a[j], a[j + 1], &lo, &hi);
            _mm256_storeu_ps(acc + 8 * j, lo);
            _mm256_storeu_ps(acc + 8 * j + 8, hi);
        } else if (!eo) {
            _mm256_storeu_ps(acc + 8 * j, a[j]);
        }
    }
}
/* a += pv * the row's dims [0, 8 NV). */
AVX2_INLINE void acc_fma(__m256 *a, __m256 pv, const char *row, size_t es, pkv_dtype_t dt, bool eo,
                         const int NV)
{
#pragma GCC unroll 8
    for (int j = 0; j < NV; j++) {
        if (eo && j % 2 == 0) {
            __m256 ve, vo;
            ld_bf16x16(row + 8 * j * es, &ve, &vo);
            a[j] = _mm256_fmadd_ps(pv, ve, a[j]);
            a[j + 1] = _mm256_fmadd_ps(pv, vo, a[j + 1]);
        } else if (!eo) {
            a[j] = _mm256_fmadd_ps(pv, ld_dt(row + 8 * j * es, dt), a[j]);
        }
    }
}

/* One query over the tokens [0, n) of one run (base: its first row for this head),
 * dims [d0, d0 + 8 NV): the accumulators round-trip through memory between runs, which
 * changes no bit. */
AVX2_INLINE void av1_run(const float *p, uint32_t p0, uint32_t n, const char *base, size_t ts,
                         size_t soff, size_t es, pkv_dtype_t dt, float *acc, const int NV,
                         const pf_stream_t *ps)
{
    const bool eo = dt == PKV_DTYPE_BF16 && NV % 2 == 0;
    __m256 a[8];
    acc_load(acc, a, eo, NV);
    int lines = (int)(ts / 64);
    for (uint32_t t = 0; t < n; t++) {
        if (ps) pf_ahead(ps, t * ts, lines);
        acc_fma(a, pweight(p + p0 + t, base + t * ts, soff, dt), base + t * ts, es, dt, eo, NV);
    }
    acc_store(acc, a, eo, NV);
}

/* Two queries: tokens [0, e) feed both, [e, n) only b. */
AVX2_INLINE void av2_run(const float *pa, const float *pb, uint32_t p0, uint32_t e, uint32_t n,
                         const char *base, size_t ts, size_t soff, size_t es, pkv_dtype_t dt,
                         float *aa, float *ab, const int NV)
{
    __m256 a[4], b[4];
#pragma GCC unroll 4
    for (int j = 0; j < NV; j++) {
        a[j] = _mm256_loadu_ps(aa + 8 * j);
        b[j] = _mm256_loadu_ps(ab + 8 * j);
    }
    uint32_t t = 0;
    for (; t < e; t++) {
        const char *vt = base + t * ts;
        __m256 pva = pweight(pa + p0 + t, vt, soff, dt), pvb = pweight(pb + p0 + t, vt, soff, dt);
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) {
            __m256 v = ld_dt(vt + 8 * j * es, dt);
            a[j] = _mm256_fmadd_ps(pva, v, a[j]);
            b[j] = _mm256_fmadd_ps(pvb, v, b[j]);
        }
    }
    for (; t < n; t++) {
        const char *vt = base + t * ts;
        __m256 pvb = pweight(pb + p0 + t, vt, soff, dt);
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) b[j] = _mm256_fmadd_ps(pvb, ld_dt(vt + 8 * j * es, dt), b[j]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NV; j++) {
        _mm256_storeu_ps(aa + 8 * j, a[j]);
        _mm256_storeu_ps(ab + 8 * j, b[j]);
    }
}

/* Two heads' pieces at once (see scores1_dt): dims [d0, d0 + 8 NV) of head A over
 * piece a and of head B over piece b, token by token, then the longer piece's tail alone.
 * The accumulators round-trip through memory between calls, which changes no bit; the
 * streams are carried where `stream` is set (the first dims of the first query). */
AVX2_INLINE void av1_pair(const dpiece_t *a, const float *pa, float *acc_a, const dpiece_t *b,
                          const float *pb, float *acc_b, uint32_t d0, uint32_t hd, size_t ts,
                          size_t es, pkv_dtype_t dt, bool stream, const int NV)
{
    const bool eo = dt == PKV_DTYPE_BF16 && NV % 2 == 0;
    __m256 x[4], y[4];
    acc_load(acc_a, x, eo, NV);
    acc_load(acc_b, y, eo, NV);
    const char *va = a->base + d0 * es, *vb = b->base + d0 * es;
    const float *qa = pa + a->p0, *qb = pb + b->p0;
    size_t soff = hd - d0;
    int lines = (int)(ts / 64);
    uint32_t both = a->n < b->n ? a->n : b->n;
    for (uint32_t t = 0; t < both; t++) {
        if (stream) {
            pf_ahead(&a->ps, t * ts, lines);
            pf_ahead(&b->ps, t * ts, lines);
        }
        acc_fma(x, pweight(qa + t, va + t * ts, soff, dt), va + t * ts, es, dt, eo, NV);
        acc_fma(y, pweight(qb + t, vb + t * ts, soff, dt), vb + t * ts, es, dt, eo, NV);
    }
    acc_store(acc_a, x, eo, NV);
    acc_store(acc_b, y, eo, NV);
    if (a->n > both)
        av1_run(pa, a->p0 + both, a->n - both, a->base + both * ts + d0 * es, ts, soff, es, dt,
                acc_a, NV, NULL);
    if (b->n > both)
        av1_run(pb, b->p0 + both, b->n - both, b->base + both * ts + d0 * es, ts, soff, es, dt,
                acc_b, NV, NULL);
}

/* All dims of one piece for one query (the first dims carry the stream). */
AVX2_INLINE void av1_piece(const dpiece_t *d, const float *p, float *acc, uint32_t hd, size_t ts,
                           size_t es, pkv_dtype_t dt, bool stream)
{
    const pf_stream_t *pp = stream ? &d->ps : NULL;
    uint32_t k = 0;
    for (; k + 64 <= hd; k += 64, pp = NULL)
        av1_run(p, d->p0, d->n, d->base + k * es, ts, hd - k, es, dt, acc + k, 8, pp);
    for (; k + 16 <= hd; k += 16, pp = NULL)
        av1_run(p, d->p0, d->n, d->base + k * es, ts, hd - k, es, dt, acc + k, 2, pp);
    for (; k < hd; k += 8, pp = NULL)
        av1_run(p, d->p0, d->n, d->base + k * es, ts, hd - k, es, dt, acc + k, 1, pp);
}

/* One row's V, heads in skewed pairs (as scores1_dt). */
AVX2_INLINE void av1_dt(const float *p, uint32_t n, const pkv_kv_run_t *runs, uint32_t nruns,
                        uint32_t h0, uint32_t nh, uint32_t group, uint32_t hd, pkv_dtype_t dt,
                        size_t pstride, float *acc, const bool t0)
{
    size_t es = dt_size(dt), ts = row_size(dt, hd);
    uint32_t nr = runs_below(runs, nruns, n);
    for (uint32_t h = 0; h < nh; h += 2) {
        bool two = h + 1 < nh;
        for (int64_t s = 0; s < (int64_t)nr + two; s++) {
            dpiece_t a = dpiece(runs, nr, s, h0 + h, n, ts, 1, t0);
            dpiece_t b = two ? dpiece(runs, nr, s - 1, h0 + h + 1, n, ts, 1, t0) : (dpiece_t){0};
            for (uint32_t j = 0; j < group; j++) {
                size_t qa = (size_t)h * group + j, qb = qa + group;
                const float *pa = p + qa * pstride, *pb = p + qb * pstride;
                float *aa = acc + qa * hd, *ab = acc + qb * hd;
                /* int8 and fp8 read a piece whole (a row's scale work once per token, as
                 * in av1_run with 8 vectors), still in the skewed order: the same bits */
                if (!a.base || !b.base || (dt_scaled(dt) && hd % 64 == 0)) {
                    if (a.base) av1_piece(&a, pa, aa, hd, ts, es, dt, j == 0);
                    if (b.base) av1_piece(&b, pb, ab, hd, ts, es, dt, j == 0);
                    continue;
                }
                uint32_t d = 0;
                for (; d + 32 <= hd; d += 32)
                    av1_pair(&a, pa, aa + d, &b, pb, ab + d, d, hd, ts, es, dt, j == 0 && d == 0,
                             4);
                for (; d + 16 <= hd; d += 16)
                    av1_pair(&a, pa, aa + d, &b, pb, ab + d, d, hd, ts, es, dt, j == 0 && d == 0,
                             2);
                for (; d < hd; d += 8)
                    av1_pair(&a, pa, aa + d, &b, pb, ab + d, d, hd, ts, es, dt, j == 0 && d == 0,
                             1);
            }
        }
    }
}

AVX2_INLINE void av_dt(const float *pa, const float *pb, uint32_t na, uint32_t nb,
                       const pkv_kv_run_t *runs, uint32_t nruns, uint32_t h0, uint32_t nh,
                       uint32_t group, uint32_t hd, pkv_dtype_t dt, size_t pstride, float *aa,
                       float *ab, const bool t0)
{
    size_t es = dt_size(dt), ts = row_size(dt, hd);
    if (!pb) {
        av1_dt(pa, na, runs, nruns, h0, nh, group, hd, dt, pstride, aa, t0);
        return;
    }
    for (uint32_t i = 0; i < nruns && runs[i].pos < nb; i++) {
        uint32_t p0 = runs[i].pos;
        uint32_t p1 = p0 + runs[i].n_tokens < nb ? p0 + runs[i].n_tokens : nb;
        if (i + 1 < nruns) prefetch_run_start(runs[i + 1].v, runs[i + 1].head_stride, h0);
        for (uint32_t h = 0; h < nh; h++) {
            const char *base = (const char *)runs[i].v + (size_t)(h0 + h) * runs[i].head_stride;
            for (uint32_t j = 0; j < group; j++) {
                size_t qi = (size_t)h * group + j;
                const float *p1a = pa + qi * pstride, *p1b = pb + qi * pstride;
                float *acc_a = aa + qi * hd, *acc_b = ab + qi * hd;
                uint32_t e = p1 < na ? p1 : na;
                uint32_t ne = e > p0 ? e - p0 : 0, nn = p1 - p0;
                uint32_t d = 0;
                for (; d + 32 <= hd; d += 32)
                    av2_run(p1a, p1b, p0, ne, nn, base + d * es, ts, hd - d, es, dt, acc_a + d,
                            acc_b + d, 4);
                for (; d < hd; d += 8)
                    av2_run(p1a, p1b, p0, ne, nn, base + d * es, ts, hd - d, es, dt, acc_a + d,
                            acc_b + d, 1);
            }
        }
    }
}

/* One instance per dtype (dt a constant in each), prefetch target T0. */
#define DT_CASES(call)                                                                             \
    switch (dt) {                                                                                  \
    case PKV_DTYPE_F32:                                                                            \
        call(PKV_DTYPE_F32);                                                                       \
        break;                                                                                     \
    case PKV_DTYPE_F16:                                                                            \
        call(PKV_DTYPE_F16);                                                                       \
        break;                                                                                     \
    case PKV_DTYPE_BF16:                                                                           \
        call(PKV_DTYPE_BF16);                                                                      \
        break;                                                                                     \
    case PKV_DTYPE_INT8:                                                                           \
        call(PKV_DTYPE_INT8);                                                                      \
        break;                                                                                     \
    case PKV_DTYPE_FP8:                                                                            \
        call(PKV_DTYPE_FP8);                                                                       \
        break;                                                                                     \
    }
#define ATT_KERNELS(suffix, T0)                                                                    \
    AVX2_FN static void scores_##suffix(                                                           \
        const float *qa, const float *qb, uint32_t na, uint32_t nb, const pkv_kv_run_t *runs,      \
        uint32_t nruns, uint32_t h0, uint32_t nh, uint32_t group, uint32_t hd, pkv_dtype_t dt,     \
        float scale, float *oa, float *ob, size_t ostride)                                         \
    {                                                                                              \
        const bool t0 = T0;                                                                        \
        DT_CASES(SCORES_CALL)                                                                      \
    }                                                                                              \
    AVX2_FN static void av_##suffix(const float *pa, const float *pb, uint32_t na, uint32_t nb,    \
                                    const pkv_kv_run_t *runs, uint32_t nruns, uint32_t h0,         \
                                    uint32_t nh, uint32_t group, uint32_t hd, pkv_dtype_t dt,      \
                                    size_t pstride, float *aa, float *ab)                          \
    {                                                                                              \
        const bool t0 = T0;                                                                        \
        DT_CASES(AV_CALL)                                                                          \
    }
#define SCORES_CALL(D)                                                                             \
    scores_dt(qa, qb, na, nb, runs, nruns, h0, nh, group, hd, D, scale, oa, ob, ostride, t0)
#define AV_CALL(D) av_dt(pa, pb, na, nb, runs, nruns, h0, nh, group, hd, D, pstride, aa, ab, t0)
ATT_KERNELS(avx2_l2, false) /* decode streams prefetched into L2 (Intel) */
ATT_KERNELS(avx2_l1, true)  /* into L1 (AMD) */

AVX2_FN static float sumsq_avx2(const float *x, uint32_t n)
{
    __m256 a = _mm256_setzero_ps();
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        a = _mm256_fmadd_ps(v, v, a);
    }
    if (i < n) {
        __m256 v = _mm256_maskload_ps(x + i, tail_mask(n - i));
        a = _mm256_fmadd_ps(v, v, a);
    }
    return reduce1(a);
}

static const model_kernels_t kernels_avx2[2] = {
    {.name = "avx2",
     .matmul = matmul_avx2,
     .scores = scores_avx2_l2,
     .span_exp = span_exp_avx2,
     .av = av_avx2_l2,
     .sumsq = sumsq_avx2},
    {.name = "avx2 (decode prefetch to L1)",
     .matmul = matmul_avx2,
     .scores = scores_avx2_l1,
     .span_exp = span_exp_avx2,
     .av = av_avx2_l1,
     .sumsq = sumsq_avx2},
};

const model_kernels_t *model_kernels_avx2(uint32_t head_dim)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return NULL;
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!(c & (1u << 29))) return NULL; /* F16C */
    if (head_dim % 8) return NULL;
    return &kernels_avx2[pkv_prim_cpu_amd()];
}
#else
const model_kernels_t *model_kernels_avx2(uint32_t head_dim)
{
    (void)head_dim;
    return NULL;
}
#endif
