/*
 * core: internal helpers shared by every module (not installed).
 */
#ifndef PKV_CORE_CORE_H
#define PKV_CORE_CORE_H

#include "pagekv/pagekv.h"

#include <pthread.h>
#include <stdio.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#define PKV_MIN(a, b)      ((a) < (b) ? (a) : (b))
#define PKV_MAX(a, b)      ((a) > (b) ? (a) : (b))
#define PKV_DIV_UP(a, b)   (((a) + (b)-1) / (b))
#define PKV_ALIGN_UP(a, b) (PKV_DIV_UP(a, b) * (b))
#define PKV_ARRAY_LEN(a)   (sizeof(a) / sizeof((a)[0]))

/* splitmix64: the next value of a seeded pseudo-random stream (weights, sampling, test
 * and benchmark data; never secrets). */
static inline uint64_t pkv_splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A seeded Fisher-Yates shuffle of a[0..n) (test and benchmark placements). */
static inline void pkv_shuffle_u32(uint32_t *a, uint32_t n, uint64_t *state)
{
    for (uint32_t i = n; i > 1; i--) {
        uint32_t j = (uint32_t)(pkv_splitmix64(state) % i), t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

/* ---- f16 / bf16 <-> f32, one value (the KV cache's dtypes and the model's kernels) ----
 * To f32 is exact; from f32 rounds to nearest even (overflow to inf, NaN stays NaN). */
static inline float pkv_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;
    if (e == 0) {
        if (m == 0) {
            x = sign;
        } else { /* subnormal: normalize */
            e = 127 - 15 + 1;
            while (!(m & 0x400u)) m <<= 1, e--;
            x = sign | (e << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) {
        x = sign | 0x7f800000u | (m << 13);
    } else {
        x = sign | ((e + 127 - 15) << 23) | (m << 13);
    }
    float f;
    __builtin_memcpy(&f, &x, 4);
    return f;
}

static inline float pkv_bf16_to_f32(uint16_t b)
{
    uint32_t x = (uint32_t)b << 16;
    float f;
    __builtin_memcpy(&f, &x, 4);
    return f;
}

static inline uint16_t pkv_f32_to_f16(float f)
{
    uint32_t x;
    __builtin_memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, e = (x >> 23) & 0xffu, m = x & 0x7fffffu;
    if (e == 0xff) return (uint16_t)(sign | 0x7c00u | (m ? 0x200u : 0)); /* inf / nan */
    int32_t he = (int32_t)e - 127 + 15;
    if (he >= 31) return (uint16_t)(sign | 0x7c00u); /* overflow */
    if (he <= 0) {                                   /* subnormal */
        if (he < -10) return (uint16_t)sign;
        m |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - he);
        uint32_t hm = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (hm & 1))) hm++;
        return (uint16_t)(sign | hm);
    }
    uint32_t hm = m >> 13, rem = m & 0x1fffu;
    uint32_t h = sign | ((uint32_t)he << 10) | hm;
    if (rem > 0x1000u || (rem == 0x1000u && (hm & 1))) h++; /* may carry into exponent: ok */
    return (uint16_t)h;
}

static inline uint16_t pkv_f32_to_bf16(float f)
{
    uint32_t x;
    __builtin_memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet nan */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* ---- fp8 e4m3 (OCP FP8, "E4M3": bias 7, no infinities, S.1111.111 is NaN) <-> f32 ----
 * To f32 is exact: code e.m = (1 + m/8) * 2^(e-7), e = 0: m * 2^-9; 0x7f / 0xff: NaN.
 * From f32 rounds to nearest even and saturates at +-448 (0x7e); NaN gives +0: the
 * encoder never writes a NaN code. */
static inline float pkv_fp8_to_f32(uint8_t c)
{
    uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
    float v;
    if (e == 15 && m == 7) return __builtin_nanf("");
    if (e == 0)
        v = (float)m * 0x1p-9f;
    else
        v = (float)(8 + m) * 0x1p-3f * __builtin_ldexpf(1.0f, (int)e - 7);
    return c & 0x80 ? -v : v;
}

static inline uint8_t pkv_f32_to_fp8(float f)
{
    uint32_t x;
    __builtin_memcpy(&x, &f, 4);
    uint8_t sign = (uint8_t)((x >> 24) & 0x80u);
    uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return 0;                       /* NaN */
    if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7e); /* >= 448 (and inf): saturate */
    uint32_t code;
    if (a < 0x3c800000u) { /* below 2^-6: subnormal steps of 2^-9 (8 of them reach 2^-6) */
        float af;
        __builtin_memcpy(&af, &a, 4);
        code = (uint32_t)__builtin_rintf(af * 0x1p9f); /* exact scaling, then RNE */
    } else {
        uint32_t e = (a >> 23) - 127 + 7, m = a & 0x7fffffu;
        uint32_t q = m >> 20, rem = m & 0xfffffu;
        code = (e << 3) + q;
        if (rem > 0x80000u || (rem == 0x80000u && (q & 1))) code++; /* may carry: ok */
        if (code > 0x7e) code = 0x7e;
    }
    return (uint8_t)(sign | code);
}

/* ---- int8 KV rows ---------------------------------------------------------------------
 * head_dim int8 codes in [-127, 127], then a 4-byte scale word, byte 0 first: w = b0 |
 * b1 << 8 | b2 << 16 | b3 << 24. Bits 0-7: the row exponent E (two's complement, in
 * [-124, 121]); bits 8 + 3j to 10 + 3j: the step k_j of lane group j (j = 0..7). Dim d is
 * in group d mod 8, whose scale is 2^E * 2^(-k_j / 5): always a normal f32, and the
 * table's value times 2^E is exact (an exponent shift), so every path computes the same
 * scale. See docs/design/pool.md, "Quantized KV". */
static inline const float *pkv_i8_steps(void)
{
    static const float t[8] = {0x1p+0f,        0x1.bdb8cep-1f, 0x1.8406p-1f,   0x1.51cb46p-1f,
                               0x1.261118p-1f, 0x1p-1f,        0x1.bdb8cep-2f, 0x1.8406p-2f};
    return t;
}
static inline uint32_t pkv_i8_word(const uint8_t *w)
{
    return (uint32_t)w[0] | (uint32_t)w[1] << 8 | (uint32_t)w[2] << 16 | (uint32_t)w[3] << 24;
}
static inline float pkv_i8_group_scale(uint32_t w, unsigned j)
{
    return __builtin_ldexpf(pkv_i8_steps()[(w >> (8 + 3 * j)) & 7u], (int8_t)(w & 0xffu));
}
/* The 8 group scales of the row whose scale word is at sw. */
static inline void pkv_i8_scales(const uint8_t *sw, float f[8])
{
    uint32_t w = pkv_i8_word(sw);
    for (unsigned j = 0; j < 8; j++) f[j] = pkv_i8_group_scale(w, j);
}

/* Broken invariant: print where and abort. Never used for bad input. */
#define PKV_ASSERT(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) pkv_panic(__FILE__, __LINE__, #cond);                                         \
    } while (0)
_Noreturn void pkv_panic(const char *file, int line, const char *what);

#define PKV_LOGE(mod, ...) pkv_log(PKV_LOG_ERROR, mod, __VA_ARGS__)
#define PKV_LOGW(mod, ...) pkv_log(PKV_LOG_WARN, mod, __VA_ARGS__)
#define PKV_LOGI(mod, ...) pkv_log(PKV_LOG_INFO, mod, __VA_ARGS__)
#define PKV_LOGD(mod, ...) pkv_log(PKV_LOG_DEBUG, mod, __VA_ARGS__)

/* Condition variables in pagekv wait on CLOCK_MONOTONIC deadlines. */
int pkv_cond_init_monotonic(pthread_cond_t *cond);
struct timespec pkv_deadline_to_monotonic(uint64_t deadline_ns);
struct timespec pkv_deadline_to_realtime(uint64_t deadline_ns);

/* Lowercase hex of b[0..n) into out (2n digits and a NUL: 2n + 1 bytes). */
void pkv_hex_encode(const uint8_t *b, size_t n, char *out);

/* ---- a recent maximum (the warm floors' size) -----------------------------------------
 * The largest value noted in the last one to two `life` ns, while notes keep coming:
 * windows of `life` ns start at the first note after the previous window ended, and the
 * value is the largest of the current window and the one before it, until `life` ns pass
 * without a note, which drop it to 0. A demand that goes on keeps it (a smaller value does
 * not reset it); a quiet spell of one life ends it. Not synchronized: the owner's lock
 * guards it. Zero-initialized: nothing noted. */
typedef struct {
    uint32_t cur, prev; /* the largest of the current window, of the one before */
    uint64_t t;         /* the current window's start */
    uint64_t last;      /* the last note */
} pkv_recent_max_t;
void pkv_recent_max_note(pkv_recent_max_t *r, uint32_t v, uint64_t now_ns, uint64_t life_ns);
/* The value at now_ns (0 when life_ns is 0); *change_ns: when it next falls (UINT64_MAX
 * when it is 0). */
uint32_t pkv_recent_max_get(const pkv_recent_max_t *r, uint64_t now_ns, uint64_t life_ns,
                            uint64_t *change_ns);

/* ---- histograms --------------------------------------------------------------------
 * A latency histogram over caller-given ascending bounds (seconds), as Prometheus exposes
 * it. Not synchronized: the owner's lock guards it. */
#define PKV_HIST_MAX_BUCKETS 18
typedef struct {
    uint64_t bucket[PKV_HIST_MAX_BUCKETS + 1]; /* per bucket (not cumulative); then +Inf */
    uint64_t count;
    double sum;
} pkv_hist_t;
/* Count `seconds` in h over bounds[0..n) (n <= PKV_HIST_MAX_BUCKETS). */
void pkv_hist_add(pkv_hist_t *h, const double *bounds, int n, double seconds);
/* h's samples in Prometheus text (NAME_bucket{LABELS,le=...} cumulative, then +Inf,
 * NAME_sum and NAME_count), over the bounds it was counted with. labels: "" or
 * `key="value"[,...]` (no trailing comma). The family's HELP and TYPE are the caller's. */
void pkv_hist_write_prom(FILE *f, const char *name, const char *labels, const pkv_hist_t *h,
                         const double *bounds, int n);

/* ---- fault simulation ---------------------------------------------------------------
 * A step that can fail in the field (an allocation of bookkeeping, committing memory,
 * pinning it, creating a thread) asks pkv_fault_hit(site) first; when a test armed that
 * site, the step fails the way the real one would and the caller's error path runs.
 * Commit and pin are simulated inside prim (every module's commits go through it);
 * allocation and thread sites sit in the modules at the calls they guard.
 * The table is process-wide and meant for tests only: Check forks each test, so a
 * test arms sites in its own process. Arming, hitting and reading are atomic; a site
 * nobody armed costs one relaxed load. */
typedef enum {
    PKV_FAULT_ALLOC,           /* malloc / calloc / realloc of a module's bookkeeping */
    PKV_FAULT_COMMIT,          /* pkv_prim_commit / pkv_prim_shared_commit */
    PKV_FAULT_MLOCK,           /* pkv_prim_lock */
    PKV_FAULT_THREAD,          /* pthread_create */
    PKV_FAULT_XFER_STALL,      /* not a failure: each hit holds xfer's progress loop 100 ms */
    PKV_FAULT_XFER_HANG,       /* not a failure: the producer whose progress loop hits it, once a
                                  layer is sent, stops for good (no messages, no heartbeats) until
                                  its agent is destroyed, as a rank that died would */
    PKV_FAULT_TIER_READ_SLOW,  /* not a failure: each hit holds a disk-tier record read 250 ms */
    PKV_FAULT_TIER_READ_IO,    /* a disk-tier record read fails as EIO would */
    PKV_FAULT_TIER_WRITE_FULL, /* a disk-tier append fails as ENOSPC would (a full disk) */
    PKV_FAULT_SITES
} pkv_fault_site_t;

/* The next `skip` hits of site pass, the `count` after them fail (count 0: disarm). */
void pkv_fault_arm(pkv_fault_site_t site, uint32_t skip, uint32_t count);
void pkv_fault_disarm_all(void);
/* True: the caller must fail this step as if the OS had refused it. */
bool pkv_fault_hit(pkv_fault_site_t site);
/* How many hits of site failed since the last arm. */
uint64_t pkv_fault_fired(pkv_fault_site_t site);

#endif
