/*
 * The GPU tests' cases (gpu_cases.h). The first two need no device: how a build or a
 * machine without one says so. The rest open device 0 and skip, saying why, without one.
 */
#include "tests/support/gpu_cases.h"

#include "gpu/gpu.h"

#include "core/core.h"
#include "pagekv/kv.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CASE_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            snprintf(why, cap, "%s:%d: %s", __FILE__, __LINE__, #cond);                            \
            rc = GPU_CASE_FAIL;                                                                    \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

/* Device 0, or GPU_CASE_SKIP with why. */
static int open_or_skip(pkv_gpu_t **g, char *why, size_t cap)
{
    return pkv_gpu_open(NULL, 0, g, why, cap) ? GPU_CASE_SKIP : GPU_CASE_PASS;
}

/* A driver that cannot be loaded, or CUDA's stub library: PKV_ERR_UNSUPPORTED, and the
 * reason begins "no CUDA device". */
static int no_device_says_why(char *why, size_t cap)
{
    int rc = GPU_CASE_PASS;
    pkv_gpu_t *g = NULL;
    char w[320];
    CASE_CHECK(pkv_gpu_open("/nonexistent/libcuda.so.1", 0, &g, w, sizeof(w)) ==
               PKV_ERR_UNSUPPORTED);
    CASE_CHECK(g == NULL && !strncmp(w, "no CUDA device", 14));
    const char *stub = "/usr/local/cuda/lib64/stubs/libcuda.so";
    if (pkv_gpu_built() && access(stub, R_OK) == 0) {
        CASE_CHECK(pkv_gpu_open(stub, 0, &g, w, sizeof(w)) == PKV_ERR_UNSUPPORTED);
        CASE_CHECK(g == NULL && !strncmp(w, "no CUDA device", 14) && strstr(w, "stub"));
    }
out:
    return rc;
}

/* A device that is not there (ordinal past the count) is refused the same way. */
static int no_such_device(char *why, size_t cap)
{
    pkv_gpu_t *g = NULL;
    int rc = open_or_skip(&g, why, cap);
    if (rc) return rc;
    pkv_gpu_close(g);
    char w[320];
    g = NULL;
    CASE_CHECK(pkv_gpu_open(NULL, 4096, &g, w, sizeof(w)) == PKV_ERR_UNSUPPORTED && !g);
out:
    return rc;
}

/* Commit, write, read back; a granule's address never moves (decommit and commit again);
 * wrong commits and decommits are refused and change nothing. */
static int arena_maps_in_place(char *why, size_t cap)
{
    pkv_gpu_t *g = NULL;
    pkv_gpu_arena_t *a = NULL;
    uint8_t *buf = NULL;
    int rc = open_or_skip(&g, why, cap);
    if (rc) return rc;
    pkv_gpu_arena_config_t c = {.n_granules = 8, .spare_min = 2, .spare_max = 4};
    CASE_CHECK(pkv_gpu_arena_create(g, &c, &a) == PKV_OK);
    pkv_gpu_arena_stats_t st;
    pkv_gpu_arena_stats(a, &st);
    uint64_t gb = st.granule_bytes, base = pkv_gpu_arena_base(a);
    CASE_CHECK(gb >= (2u << 20) && st.reserved_bytes == 8 * gb && base != 0);
    CASE_CHECK((buf = malloc(gb)) != NULL);
    for (uint32_t i = 0; i < 8; i++) CASE_CHECK(pkv_gpu_arena_commit(a, i) == PKV_OK);
    CASE_CHECK(pkv_gpu_arena_commit(a, 3) == PKV_ERR_INVALID); /* already mapped */
    CASE_CHECK(pkv_gpu_arena_commit(a, 8) == PKV_ERR_INVALID); /* out of range */
    for (uint32_t i = 0; i < 8; i++) {
        memset(buf, (int)(0x10 + i), gb);
        CASE_CHECK(pkv_gpu_copy_from_host(g, base + i * gb, buf, gb) == PKV_OK);
    }
    for (uint32_t i = 0; i < 8; i++) {
        CASE_CHECK(pkv_gpu_copy_to_host(g, buf, base + i * gb, gb) == PKV_OK);
        CASE_CHECK(buf[0] == 0x10 + i && buf[gb - 1] == 0x10 + i);
    }
    CASE_CHECK(pkv_gpu_arena_decommit(a, 5) == PKV_OK);
    CASE_CHECK(!pkv_gpu_arena_mapped(a, 5));
    CASE_CHECK(pkv_gpu_arena_decommit(a, 5) == PKV_ERR_INVALID); /* not mapped */
    CASE_CHECK(pkv_gpu_arena_commit(a, 5) == PKV_OK);
    CASE_CHECK(pkv_gpu_arena_base(a) == base); /* the address did not move */
    CASE_CHECK(pkv_gpu_memset(g, base + 5 * gb, 0x77, gb) == PKV_OK);
    CASE_CHECK(pkv_gpu_copy_to_host(g, buf, base + 5 * gb, gb) == PKV_OK);
    CASE_CHECK(buf[0] == 0x77 && buf[gb / 2] == 0x77);
    CASE_CHECK(pkv_gpu_copy_to_host(g, buf, base + 4 * gb, gb) == PKV_OK);
    CASE_CHECK(buf[0] == 0x14); /* its neighbour untouched */
    pkv_gpu_arena_stats(a, &st);
    CASE_CHECK(st.mapped_bytes == 8 * gb && st.commits == 9 && st.decommits == 1);
out:
    pkv_gpu_arena_destroy(a);
    free(buf);
    pkv_gpu_close(g);
    return rc;
}

/* The spare set: a decommitted handle is kept up to spare_max, released beyond; a trim
 * releases them all; the refill thread brings it back to spare_min. */
static int arena_spares_bounded(char *why, size_t cap)
{
    pkv_gpu_t *g = NULL;
    pkv_gpu_arena_t *a = NULL;
    int rc = open_or_skip(&g, why, cap);
    if (rc) return rc;
    pkv_gpu_arena_config_t c = {.n_granules = 16, .spare_min = 3, .spare_max = 5};
    CASE_CHECK(pkv_gpu_arena_create(g, &c, &a) == PKV_OK);
    CASE_CHECK(pkv_gpu_arena_fill_spares(a) == PKV_OK);
    pkv_gpu_arena_stats_t st;
    pkv_gpu_arena_stats(a, &st);
    uint64_t gb = st.granule_bytes;
    CASE_CHECK(st.spare_bytes >= 3 * gb && st.spare_bytes <= 5 * gb);
    for (uint32_t i = 0; i < 16; i++) CASE_CHECK(pkv_gpu_arena_commit(a, i) == PKV_OK);
    pkv_gpu_arena_stats(a, &st);
    CASE_CHECK(st.spare_hits >= 3 && st.created_bytes == st.mapped_bytes + st.spare_bytes);
    for (uint32_t i = 0; i < 16; i++) CASE_CHECK(pkv_gpu_arena_decommit(a, i) == PKV_OK);
    pkv_gpu_arena_stats(a, &st);
    CASE_CHECK(st.mapped_bytes == 0 && st.spare_bytes <= 6 * gb); /* spare_max + a refill */
    CASE_CHECK(st.created_bytes == st.spare_bytes);
    pkv_gpu_arena_trim(a);
    pkv_gpu_arena_stats(a, &st);
    CASE_CHECK(st.spare_bytes == 0 && st.created_bytes == 0);
out:
    pkv_gpu_arena_destroy(a);
    pkv_gpu_close(g);
    return rc;
}

/* The driver's used delta since free0 against st's created bytes: within 2 %, at least
 * one granule of slack; false with why (when: the moment) otherwise. */
static bool driver_agrees(pkv_gpu_t *g, uint64_t free0, const pkv_gpu_arena_stats_t *st, char *why,
                          size_t cap, const char *when)
{
    double gap = pkv_gpu_driver_gap(g, free0, st);
    if (gap <= 1.0) return true;
    snprintf(why, cap,
             "%s: the driver and the counters (%.1f MiB created) differ by %.2f x "
             "the allowance",
             when, st->created_bytes / 1048576.0, gap);
    return false;
}

/* The arena's created bytes equal cuMemGetInfo's used delta within 2 % (one granule of
 * slack), committed, decommitted with spares kept, and trimmed. */
static int arena_counters_match_driver(char *why, size_t cap)
{
    pkv_gpu_t *g = NULL;
    pkv_gpu_arena_t *a = NULL;
    int rc = open_or_skip(&g, why, cap);
    if (rc) return rc;
    pkv_gpu_arena_config_t c = {.n_granules = 64, .spare_min = 0, .spare_max = 64};
    CASE_CHECK(pkv_gpu_arena_create(g, &c, &a) == PKV_OK);
    uint64_t free0, total;
    CASE_CHECK(pkv_gpu_mem_info(g, &free0, &total) == PKV_OK);
    static const char *const when[3] = {"committed", "decommitted", "trimmed"};
    for (int phase = 0; phase < 3; phase++) {
        for (uint32_t i = 0; i < 64; i++) {
            if (phase == 0) CASE_CHECK(pkv_gpu_arena_commit(a, i) == PKV_OK);
            if (phase == 1) CASE_CHECK(pkv_gpu_arena_decommit(a, i) == PKV_OK);
        }
        if (phase == 2) pkv_gpu_arena_trim(a);
        pkv_gpu_arena_stats_t st;
        pkv_gpu_arena_stats(a, &st);
        if (!driver_agrees(g, free0, &st, why, cap, when[phase])) {
            rc = GPU_CASE_FAIL;
            goto out;
        }
    }
out:
    pkv_gpu_arena_destroy(a);
    pkv_gpu_close(g);
    return rc;
}

/* ---- paged decode attention ---------------------------------------------------------- */
const char *gpu_cases_fatbin = "build/gpu/pagekv-kernels.fatbin";

static float rng_unit(uint64_t *s)
{
    return (float)((pkv_splitmix64(s) >> 40) * (1.0 / 16777216.0)) * 2.f - 1.f;
}

/* Device 0 and the kernels, or GPU_CASE_SKIP with why (no device, no fatbin). */
static int open_with_kernels(pkv_gpu_t **g, pkv_gpu_attn_t **at, char *why, size_t cap)
{
    int rc = open_or_skip(g, why, cap);
    if (rc) return rc;
    if (access(gpu_cases_fatbin, R_OK)) {
        snprintf(why, cap, "no kernels at %s (make GPU=1, or scripts/gpu-check.sh)",
                 gpu_cases_fatbin);
        rc = GPU_CASE_SKIP;
    } else if (pkv_gpu_attn_load(*g, gpu_cases_fatbin, at) != PKV_OK) {
        snprintf(why, cap, "the kernels at %s do not load", gpu_cases_fatbin);
        rc = GPU_CASE_FAIL;
    }
    if (rc) pkv_gpu_close(*g);
    return rc;
}

/* The double-precision attention of one query row over n positions: K and V rows of token
 * t at kv[0] / kv[1] + elem(t) (uint16 bf16 elements), scale applied to q. */
static void ref_row(const float *q, uint32_t hd, double scale, const uint16_t *k, const uint16_t *v,
                    size_t (*elem)(const void *, uint32_t), const void *ctx, uint32_t n, double *sc,
                    double *out)
{
    double mx = -1e300, sum = 0;
    for (uint32_t t = 0; t < n; t++) {
        const uint16_t *kr = k + elem(ctx, t);
        double d = 0;
        for (uint32_t i = 0; i < hd; i++) d += (double)q[i] * scale * pkv_bf16_to_f32(kr[i]);
        sc[t] = d;
        mx = d > mx ? d : mx;
    }
    for (uint32_t t = 0; t < n; t++) sum += (sc[t] = exp(sc[t] - mx));
    for (uint32_t i = 0; i < hd; i++) {
        double acc = 0;
        for (uint32_t t = 0; t < n; t++) acc += sc[t] * pkv_bf16_to_f32(v[elem(ctx, t) + i]);
        out[i] = acc / sum;
    }
}

/* Whether y is within 2e-4 of the row's largest |ref| (+1e-6) everywhere, NaN never. */
static bool row_close(const double *ref, const float *y, uint32_t hd, double *err, double *big)
{
    *err = 0, *big = 0;
    for (uint32_t i = 0; i < hd; i++) {
        double e = y[i] != y[i] ? INFINITY : fabs(ref[i] - y[i]);
        *err = e > *err ? e : *err;
        *big = fabs(ref[i]) > *big ? fabs(ref[i]) : *big;
    }
    return *err <= 2e-4 * *big + 1e-6;
}

/* The element offset of token t's row in a block layout: table, block elements, head. */
typedef struct {
    const uint32_t *table;
    size_t block_el, head_off;
    uint32_t bt, hd;
} row_at_t;

static size_t row_elem(const void *ctx, uint32_t t)
{
    const row_at_t *r = ctx;
    return r->table[t / r->bt] * r->block_el + r->head_off + (size_t)(t % r->bt) * r->hd;
}

typedef struct {
    uint32_t hd, G, kvh, bt, n_seq, lens[4];
} dec_geo_t;

/* Device memory for one check: a bump allocator over a committed arena. */
typedef struct {
    pkv_gpu_arena_t *a;
    uint64_t base, used, cap;
} bump_t;

static uint64_t bump(bump_t *b, uint64_t bytes)
{
    uint64_t at = b->used;
    b->used += (bytes + 255) & ~255ull;
    return b->used <= b->cap ? b->base + at : 0;
}

/* One geometry: K/V of n_seq sequences placed in blocks twice, shuffled (paged) and in
 * order (contiguous), the unused tail of each last block NaN; the output of both against a
 * double-precision reference, and paged == contiguous bitwise. */
static int decode_one(pkv_gpu_t *g, pkv_gpu_attn_t *at, const dec_geo_t *ge, char *why, size_t cap)
{
    int rc = GPU_CASE_PASS;
    uint32_t hd = ge->hd, G = ge->G, kvh = ge->kvh, bt = ge->bt, ns = ge->n_seq, maxb = 0, nb = 0;
    for (uint32_t s = 0; s < ns; s++) {
        uint32_t b = (ge->lens[s] + bt - 1) / bt;
        maxb = b > maxb ? b : maxb;
        nb += b;
    }
    uint64_t piece = (uint64_t)bt * hd * 2, bstride = piece * kvh, pool = bstride * nb;
    uint32_t nq = kvh * G, max_len = 0;
    for (uint32_t s = 0; s < ns; s++) max_len = ge->lens[s] > max_len ? ge->lens[s] : max_len;
    uint16_t *kp = malloc(pool), *vp = malloc(pool), *kc = malloc(pool), *vc = malloc(pool);
    uint32_t *tp = calloc((size_t)ns * maxb, 4), *tc = calloc((size_t)ns * maxb, 4);
    uint32_t *perm = malloc(nb * 4);
    float *q = malloc((size_t)ns * nq * hd * 4), *o1 = malloc((size_t)ns * nq * hd * 4),
          *o2 = malloc((size_t)ns * nq * hd * 4);
    double *ref = malloc((size_t)ns * nq * hd * 8), *sc = malloc((size_t)max_len * 8);
    pkv_gpu_arena_t *a = NULL;
    CASE_CHECK(kp && vp && kc && vc && tp && tc && perm && q && o1 && o2 && ref && sc);
    uint64_t seed = 0x5eed + hd * 31 + G;
    for (uint32_t i = 0; i < nb; i++) perm[i] = i;
    pkv_shuffle_u32(perm, nb, &seed); /* the paged placement */
    for (size_t i = 0; i < pool / 2; i++) kp[i] = vp[i] = kc[i] = vc[i] = 0x7fc0; /* NaN */
    uint32_t blk = 0;
    for (uint32_t s = 0; s < ns; s++) {
        for (uint32_t b = 0; b < (ge->lens[s] + bt - 1) / bt; b++, blk++) {
            tc[s * maxb + b] = blk;
            tp[s * maxb + b] = perm[blk];
        }
        for (uint32_t t = 0; t < ge->lens[s]; t++)
            for (uint32_t h = 0; h < kvh; h++)
                for (uint32_t d = 0; d < hd; d++) {
                    uint16_t kv = pkv_f32_to_bf16(rng_unit(&seed)),
                             vv = pkv_f32_to_bf16(rng_unit(&seed));
                    size_t in = ((size_t)h * bt + t % bt) * hd + d;
                    size_t ci = tc[s * maxb + t / bt] * (bstride / 2) + in;
                    size_t pi = tp[s * maxb + t / bt] * (bstride / 2) + in;
                    kc[ci] = kp[pi] = kv;
                    vc[ci] = vp[pi] = vv;
                }
    }
    for (size_t i = 0; i < (size_t)ns * nq * hd; i++) q[i] = rng_unit(&seed);
    float scale = 1.0f / sqrtf((float)hd);
    for (uint32_t s = 0; s < ns; s++) /* the reference, from the contiguous copy */
        for (uint32_t qh = 0; qh < nq; qh++) {
            row_at_t at_ = {tc + (size_t)s * maxb, bstride / 2, (size_t)(qh / G) * bt * hd, bt, hd};
            ref_row(q + ((size_t)s * nq + qh) * hd, hd, scale, kc, vc, row_elem, &at_, ge->lens[s],
                    sc, ref + ((size_t)s * nq + qh) * hd);
        }
    uint32_t lens[4];
    memcpy(lens, ge->lens, sizeof(lens));
    uint32_t splits[2] = {1, pkv_gpu_decode_splits(at, ns, kvh, max_len)};
    uint64_t part_bytes = (uint64_t)ns * nq * (splits[1] > 1 ? splits[1] : 1) * (hd + 2) * 4;
    uint64_t need = 4 * pool + 2 * (uint64_t)ns * maxb * 4 + 16 + 2 * (uint64_t)ns * nq * hd * 4 +
                    part_bytes + 16 * 256;
    pkv_gpu_arena_config_t c = {.n_granules = (uint32_t)(need / (2u << 20)) + 2};
    CASE_CHECK(pkv_gpu_arena_create(g, &c, &a) == PKV_OK);
    for (uint32_t i = 0; i < c.n_granules; i++) CASE_CHECK(pkv_gpu_arena_commit(a, i) == PKV_OK);
    pkv_gpu_arena_stats_t st;
    pkv_gpu_arena_stats(a, &st);
    bump_t bm = {a, pkv_gpu_arena_base(a), 0, st.reserved_bytes};
    uint64_t dkp = bump(&bm, pool), dvp = bump(&bm, pool), dkc = bump(&bm, pool),
             dvc = bump(&bm, pool), dtp = bump(&bm, (uint64_t)ns * maxb * 4),
             dtc = bump(&bm, (uint64_t)ns * maxb * 4), dl = bump(&bm, 16),
             dq = bump(&bm, (uint64_t)ns * nq * hd * 4),
             dout = bump(&bm, (uint64_t)ns * nq * hd * 4), dpart = bump(&bm, part_bytes);
    CASE_CHECK(dpart != 0);
    CASE_CHECK(pkv_gpu_copy_from_host(g, dkp, kp, pool) == PKV_OK &&
               pkv_gpu_copy_from_host(g, dvp, vp, pool) == PKV_OK &&
               pkv_gpu_copy_from_host(g, dkc, kc, pool) == PKV_OK &&
               pkv_gpu_copy_from_host(g, dvc, vc, pool) == PKV_OK &&
               pkv_gpu_copy_from_host(g, dtp, tp, (uint64_t)ns * maxb * 4) == PKV_OK &&
               pkv_gpu_copy_from_host(g, dtc, tc, (uint64_t)ns * maxb * 4) == PKV_OK &&
               pkv_gpu_copy_from_host(g, dl, lens, 16) == PKV_OK &&
               pkv_gpu_copy_from_host(g, dq, q, (uint64_t)ns * nq * hd * 4) == PKV_OK);
    for (int si = 0; si < 2; si++) {
        for (int paged = 0; paged < 2; paged++) {
            pkv_gpu_decode_t p = {.q = dq,
                                  .out = dout,
                                  .part = dpart,
                                  .k_base = paged ? dkp : dkc,
                                  .v_base = paged ? dvp : dvc,
                                  .block_stride = bstride,
                                  .head_stride = piece,
                                  .table = paged ? dtp : dtc,
                                  .lens = dl,
                                  .max_blocks = maxb,
                                  .n_seq = ns,
                                  .block_tokens = bt,
                                  .kv_heads = kvh,
                                  .group = G,
                                  .head_dim = hd,
                                  .scale = scale,
                                  .n_split = splits[si]};
            CASE_CHECK(pkv_gpu_decode_attn(at, &p) == PKV_OK && pkv_gpu_sync(g) == PKV_OK);
            CASE_CHECK(pkv_gpu_copy_to_host(g, paged ? o2 : o1, dout, (uint64_t)ns * nq * hd * 4) ==
                       PKV_OK);
        }
        if (memcmp(o1, o2, (size_t)ns * nq * hd * 4)) {
            snprintf(why, cap, "hd %u G %u splits %u: paged and contiguous differ", hd, G,
                     splits[si]);
            rc = GPU_CASE_FAIL;
            goto out;
        }
        for (size_t r = 0; r < (size_t)ns * nq; r++) {
            double err, big;
            if (!row_close(ref + r * hd, o1 + r * hd, hd, &err, &big)) {
                snprintf(why, cap, "hd %u G %u splits %u row %zu: error %.3g against max %.3g", hd,
                         G, splits[si], r, err, big);
                rc = GPU_CASE_FAIL;
                goto out;
            }
        }
    }
out:
    pkv_gpu_arena_destroy(a);
    free(kp), free(vp), free(kc), free(vc), free(tp), free(tc), free(perm);
    free(q), free(o1), free(o2), free(ref), free(sc);
    return rc;
}

/* Paged decode attention (kernels.cu) against a double-precision reference on random bf16
 * K/V, head dims 64 and 128, groups 1, 2, 4 and 8, lengths that end mid-block (1, 17, 300,
 * 1000), NaN past each length, without and with a split; paged == contiguous bitwise. */
static int decode_attention_matches_reference(char *why, size_t cap)
{
    pkv_gpu_t *g = NULL;
    pkv_gpu_attn_t *at = NULL;
    int rc = open_with_kernels(&g, &at, why, cap);
    if (rc) return rc;
    static const dec_geo_t geos[] = {
        {64, 4, 2, 16, 4, {1, 17, 300, 1000}},
        {128, 2, 2, 16, 4, {1, 17, 300, 1000}},
        {64, 1, 3, 16, 4, {5, 16, 33, 700}},
        {128, 8, 1, 16, 4, {2, 31, 257, 999}},
    };
    for (size_t i = 0; i < sizeof(geos) / sizeof(geos[0]) && rc == GPU_CASE_PASS; i++)
        rc = decode_one(g, at, &geos[i], why, cap);
    pkv_gpu_attn_unload(at);
    pkv_gpu_close(g);
    return rc;
}

/* The KV write kernel: a 50-token sequence written in two chunks (20 from position 0, 30
 * from 20) through a shuffled block table equals the host's bf16 rounding at every
 * position, and nothing past the sequence or outside its blocks changes. */
static int kv_write_matches_host_rounding(char *why, size_t cap)
{
    pkv_gpu_t *g = NULL;
    pkv_gpu_attn_t *at = NULL;
    pkv_gpu_arena_t *a = NULL;
    float *src = NULL;
    uint16_t *pool = NULL;
    int rc = open_with_kernels(&g, &at, why, cap);
    if (rc) return rc;
    const uint32_t hd = 64, kvh = 2, bt = 16, n = 50, nb = 6; /* 4 blocks used of 6 */
    const uint32_t table[4] = {5, 0, 3, 2};
    uint64_t piece = (uint64_t)bt * hd * 2, bstride = piece * kvh, bytes = bstride * nb;
    size_t nel = (size_t)n * kvh * hd;
    CASE_CHECK((src = malloc(nel * 2 * sizeof(float))) && (pool = malloc(bytes)));
    uint64_t seed = 99;
    for (size_t i = 0; i < 2 * nel; i++) src[i] = rng_unit(&seed) * 3.f;
    pkv_gpu_arena_config_t c = {.n_granules = 2};
    CASE_CHECK(pkv_gpu_arena_create(g, &c, &a) == PKV_OK);
    for (uint32_t i = 0; i < 2; i++) CASE_CHECK(pkv_gpu_arena_commit(a, i) == PKV_OK);
    uint64_t base = pkv_gpu_arena_base(a), kb = base, vb = kb + bytes, tb = vb + bytes,
             sb = tb + 256;
    CASE_CHECK(pkv_gpu_memset(g, kb, 0xab, 2 * bytes) == PKV_OK);
    CASE_CHECK(pkv_gpu_copy_from_host(g, tb, table, sizeof(table)) == PKV_OK);
    CASE_CHECK(pkv_gpu_copy_from_host(g, sb, src, nel * 2 * sizeof(float)) == PKV_OK);
    const uint32_t chunks[2][2] = {{0, 20}, {20, 30}};
    for (int ch = 0; ch < 2; ch++) {
        uint64_t at_el = (uint64_t)chunks[ch][0] * kvh * hd * sizeof(float);
        pkv_gpu_kv_write_t w = {.k = sb + at_el,
                                .v = sb + nel * sizeof(float) + at_el,
                                .k_base = kb,
                                .v_base = vb,
                                .block_stride = bstride,
                                .head_stride = piece,
                                .table = tb,
                                .p0 = chunks[ch][0],
                                .n_tokens = chunks[ch][1],
                                .block_tokens = bt,
                                .kv_heads = kvh,
                                .head_dim = hd};
        CASE_CHECK(pkv_gpu_kv_write(at, &w) == PKV_OK);
    }
    CASE_CHECK(pkv_gpu_sync(g) == PKV_OK);
    for (int kv = 0; kv < 2; kv++) {
        CASE_CHECK(pkv_gpu_copy_to_host(g, pool, kv ? vb : kb, bytes) == PKV_OK);
        for (uint32_t b = 0; b < nb; b++)
            for (uint32_t h = 0; h < kvh; h++)
                for (uint32_t t = 0; t < bt; t++)
                    for (uint32_t d = 0; d < hd; d++) {
                        uint32_t slot = 0, pos = 0;
                        for (; slot < 4 && table[slot] != b; slot++) {
                        }
                        pos = slot * bt + t;
                        uint16_t got = pool[b * (bstride / 2) + (h * bt + t) * hd + d];
                        uint16_t want = 0xabab;
                        if (slot < 4 && pos < n)
                            want = pkv_f32_to_bf16(
                                src[(size_t)kv * nel + ((size_t)pos * kvh + h) * hd + d]);
                        if (got != want) {
                            snprintf(why, cap,
                                     "%s block %u head %u slot %u dim %u: 0x%04x, want 0x%04x",
                                     kv ? "V" : "K", b, h, t, d, got, want);
                            rc = GPU_CASE_FAIL;
                            goto out;
                        }
                    }
    }
out:
    pkv_gpu_arena_destroy(a);
    pkv_gpu_attn_unload(at);
    free(src);
    free(pool);
    pkv_gpu_close(g);
    return rc;
}

/* Prefill attention for a chunk (40 queries at positions 260..299 of a 300-token sequence
 * in shuffled blocks, head dim 64, group 4): each row equals decoding that position alone,
 * bitwise, and the first and last rows the double-precision reference. */
static int prefill_rows_equal_decode(char *why, size_t cap)
{
    pkv_gpu_t *g = NULL;
    pkv_gpu_attn_t *at = NULL;
    pkv_gpu_arena_t *a = NULL;
    int rc = open_with_kernels(&g, &at, why, cap);
    if (rc) return rc;
    enum { HD = 64, G = 4, KVH = 2, BT = 16, N = 300, P0 = 260, C = 40, NB = 19, NQ = KVH * G };
    static uint16_t kv[2][NB * KVH * BT * HD];
    static float q[C * NQ * HD], op[C * NQ * HD], od[NQ * HD];
    uint32_t table[NB], lens[C];
    uint64_t seed = 77;
    for (uint32_t i = 0; i < NB; i++) table[i] = i;
    pkv_shuffle_u32(table, NB, &seed);
    for (int k = 0; k < 2; k++)
        for (size_t i = 0; i < sizeof(kv[k]) / 2; i++) kv[k][i] = pkv_f32_to_bf16(rng_unit(&seed));
    for (size_t i = 0; i < sizeof(q) / 4; i++) q[i] = rng_unit(&seed);
    for (uint32_t i = 0; i < C; i++) lens[i] = P0 + i + 1;
    uint64_t piece = (uint64_t)BT * HD * 2, bstride = piece * KVH, bytes = sizeof(kv[0]);
    pkv_gpu_arena_config_t c = {.n_granules = 2};
    CASE_CHECK(pkv_gpu_arena_create(g, &c, &a) == PKV_OK);
    for (uint32_t i = 0; i < 2; i++) CASE_CHECK(pkv_gpu_arena_commit(a, i) == PKV_OK);
    uint64_t kb = pkv_gpu_arena_base(a), vb = kb + bytes, tb = vb + bytes, lb = tb + 256,
             qb = lb + 256, ob = qb + sizeof(q), pb = ob + sizeof(q);
    uint32_t splits = pkv_gpu_decode_splits(at, 1, KVH, N);
    CASE_CHECK(pb + (uint64_t)C * NQ * splits * (HD + 2) * 4 <= kb + 2 * (2u << 20));
    CASE_CHECK(pkv_gpu_copy_from_host(g, kb, kv[0], bytes) == PKV_OK &&
               pkv_gpu_copy_from_host(g, vb, kv[1], bytes) == PKV_OK &&
               pkv_gpu_copy_from_host(g, tb, table, sizeof(table)) == PKV_OK &&
               pkv_gpu_copy_from_host(g, lb, lens, sizeof(lens)) == PKV_OK &&
               pkv_gpu_copy_from_host(g, qb, q, sizeof(q)) == PKV_OK);
    pkv_gpu_decode_t p = {.q = qb,
                          .out = ob,
                          .part = pb,
                          .k_base = kb,
                          .v_base = vb,
                          .block_stride = bstride,
                          .head_stride = piece,
                          .table = tb,
                          .lens = lb,
                          .max_blocks = NB,
                          .n_seq = C,
                          .block_tokens = BT,
                          .kv_heads = KVH,
                          .group = G,
                          .head_dim = HD,
                          .scale = 0.125f,
                          .n_split = splits};
    CASE_CHECK(pkv_gpu_prefill_attn(at, &p) == PKV_OK && pkv_gpu_sync(g) == PKV_OK);
    CASE_CHECK(pkv_gpu_copy_to_host(g, op, ob, sizeof(op)) == PKV_OK);
    for (uint32_t i = 0; i < C; i++) {
        pkv_gpu_decode_t d = p;
        d.q = qb + (uint64_t)i * NQ * HD * 4, d.lens = lb + i * 4ull, d.n_seq = 1;
        CASE_CHECK(pkv_gpu_decode_attn(at, &d) == PKV_OK && pkv_gpu_sync(g) == PKV_OK);
        CASE_CHECK(pkv_gpu_copy_to_host(g, od, ob, sizeof(od)) == PKV_OK);
        if (memcmp(od, op + (size_t)i * NQ * HD, sizeof(od))) {
            snprintf(why, cap, "prefill row %u differs from decoding position %u", i, P0 + i);
            rc = GPU_CASE_FAIL;
            goto out;
        }
    }
    static double sc[N], ref[HD];
    for (uint32_t i = 0; i < C; i += C - 1) /* rows 0 and C - 1 against the reference */
        for (uint32_t qh = 0; qh < NQ; qh++) {
            row_at_t at_ = {table, bstride / 2, (size_t)(qh / G) * BT * HD, BT, HD};
            ref_row(q + ((size_t)i * NQ + qh) * HD, HD, 0.125, kv[0], kv[1], row_elem, &at_,
                    P0 + i + 1, sc, ref);
            double err, big;
            if (!row_close(ref, op + ((size_t)i * NQ + qh) * HD, HD, &err, &big)) {
                snprintf(why, cap, "prefill row %u head %u: error %.3g against %.3g", i, qh, err,
                         big);
                rc = GPU_CASE_FAIL;
                goto out;
            }
        }
out:
    pkv_gpu_arena_destroy(a);
    pkv_gpu_attn_unload(at);
    pkv_gpu_close(g);
    return rc;
}

/* Staging: 200 pieces of 16 KiB scattered over a device pool, gathered by the kernel
 * straight into a registered host buffer (checked in host memory), then the pool's pieces
 * wiped and scattered back from it (checked on the device): bytes equal both ways. */
static int stage_round_trip(char *why, size_t cap)
{
    pkv_gpu_t *g = NULL;
    pkv_gpu_attn_t *at = NULL;
    pkv_gpu_arena_t *a = NULL;
    uint8_t *host = NULL, *pool = NULL, *back = NULL;
    uint64_t *off = NULL, hva = 0;
    bool registered = false;
    int rc = open_with_kernels(&g, &at, why, cap);
    if (rc) return rc;
    const uint32_t n = 200, piece = 16384, slots = 256;
    uint64_t pool_bytes = (uint64_t)slots * piece;
    CASE_CHECK(posix_memalign((void **)&host, 4096, (size_t)n * piece) == 0);
    CASE_CHECK((pool = malloc(pool_bytes)) && (back = malloc(pool_bytes)) &&
               (off = malloc(n * sizeof(*off))));
    uint64_t seed = 5;
    for (uint64_t i = 0; i < pool_bytes; i++) pool[i] = (uint8_t)pkv_splitmix64(&seed);
    uint32_t *perm = (uint32_t *)back; /* scratch until the read-back */
    for (uint32_t i = 0; i < slots; i++) perm[i] = i;
    pkv_shuffle_u32(perm, slots, &seed);
    for (uint32_t i = 0; i < n; i++) off[i] = (uint64_t)perm[i] * piece;
    pkv_gpu_arena_config_t c = {.n_granules = (uint32_t)(pool_bytes / (2u << 20)) + 2};
    CASE_CHECK(pkv_gpu_arena_create(g, &c, &a) == PKV_OK);
    for (uint32_t i = 0; i < c.n_granules; i++) CASE_CHECK(pkv_gpu_arena_commit(a, i) == PKV_OK);
    uint64_t dpool = pkv_gpu_arena_base(a), doff = dpool + pool_bytes;
    CASE_CHECK(pkv_gpu_copy_from_host(g, dpool, pool, pool_bytes) == PKV_OK);
    CASE_CHECK(pkv_gpu_copy_from_host(g, doff, off, n * sizeof(*off)) == PKV_OK);
    memset(host, 0, (size_t)n * piece);
    CASE_CHECK(pkv_gpu_host_register(g, host, (uint64_t)n * piece, &hva) == PKV_OK);
    registered = true;
    CASE_CHECK(pkv_gpu_stage_gather(at, dpool, hva, doff, n, piece) == PKV_OK);
    CASE_CHECK(pkv_gpu_sync(g) == PKV_OK);
    for (uint32_t i = 0; i < n; i++)
        if (memcmp(host + (size_t)i * piece, pool + off[i], piece)) {
            snprintf(why, cap, "gather: piece %u differs", i);
            rc = GPU_CASE_FAIL;
            goto out;
        }
    for (uint32_t i = 0; i < n; i++)
        CASE_CHECK(pkv_gpu_memset(g, dpool + off[i], 0, piece) == PKV_OK);
    CASE_CHECK(pkv_gpu_stage_scatter(at, dpool, hva, doff, n, piece) == PKV_OK);
    CASE_CHECK(pkv_gpu_sync(g) == PKV_OK);
    CASE_CHECK(pkv_gpu_copy_to_host(g, back, dpool, pool_bytes) == PKV_OK);
    CASE_CHECK(memcmp(back, pool, pool_bytes) == 0); /* every piece back, the rest untouched */
out:
    if (registered) pkv_gpu_host_unregister(g, host);
    pkv_gpu_arena_destroy(a);
    pkv_gpu_attn_unload(at);
    free(host), free(pool), free(back), free(off);
    pkv_gpu_close(g);
    return rc;
}

/* ---- the pool on the device ------------------------------------------------------------ */

/* pkv_gpu_pool_view against the pool's own block addresses (no device: a host pool has the
 * same layout): every block, layer, K|V and head of every rank, at llama-3.2-1b's geometry
 * in bf16 (4 blocks a 2 MiB granule) at tp 1 and 2, with 32 KiB granules (a block a
 * granule's half), and at qwen3-0.6b's (a block larger than 2 MiB: one a granule). */
static int pool_view_addresses_every_block(char *why, size_t cap)
{
    int rc = GPU_CASE_PASS;
    pkv_kv_t *kv = NULL;
    const struct {
        pkv_geometry_t geo;
        uint32_t tp;
        uint64_t granule, budget;
    } cases[] = {
        {{16, 8, 64, 16, PKV_DTYPE_BF16}, 1, 0, 64u << 20},
        {{16, 8, 64, 16, PKV_DTYPE_BF16}, 2, 0, 64u << 20},
        {{2, 2, 64, 16, PKV_DTYPE_BF16}, 1, 32768, 1u << 20},
        {{28, 8, 128, 16, PKV_DTYPE_BF16}, 1, 0, 64u << 20},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        pkv_kv_config_t cfg = {.geo = cases[c].geo,
                               .tp = cases[c].tp,
                               .granule_bytes = cases[c].granule,
                               .budget_bytes = cases[c].budget};
        CASE_CHECK(pkv_kv_create(&cfg, &kv) == PKV_OK);
        pkv_kv_stats_t st;
        pkv_kv_stats(kv, &st);
        for (uint32_t r = 0; r < cases[c].tp; r++) {
            pkv_kv_rank_t rk;
            CASE_CHECK(pkv_kv_rank(kv, r, &rk) == PKV_OK);
            for (uint32_t l = 0; l < cfg.geo.layers; l++) {
                pkv_gpu_pool_view_t v;
                CASE_CHECK(pkv_gpu_pool_view(kv, r, l, &v) == PKV_OK);
                CASE_CHECK(v.kv_heads == rk.head_n && v.block_stride == 16u * 2 * cfg.geo.head_dim);
                for (uint32_t b = 0; b < st.blocks_capacity; b++)
                    for (uint32_t w = 0; w < 2; w++)
                        for (uint32_t h = 0; h < rk.head_n; h++) {
                            uintptr_t want = (uintptr_t)pkv_kv_block_head_rank(kv, r, b, l, w,
                                                                               rk.head_lo + h),
                                      got = (uintptr_t)((w ? v.v_base : v.k_base) +
                                                        pkv_gpu_pool_index(&v, b) * v.block_stride +
                                                        h * v.head_stride);
                            if (got != want) {
                                snprintf(why, cap,
                                         "case %zu rank %u layer %u block %u %s head %u: view "
                                         "%#lx, pool %#lx",
                                         c, r, l, b, w ? "V" : "K", h, (unsigned long)got,
                                         (unsigned long)want);
                                rc = GPU_CASE_FAIL;
                                goto out;
                            }
                        }
            }
        }
        pkv_kv_destroy(kv);
        kv = NULL;
    }
    pkv_kv_config_t dense = {
        .geo = cases[0].geo, .backend = PKV_BACKEND_DENSE, .budget_bytes = 64u << 20};
    CASE_CHECK(pkv_kv_create(&dense, &kv) == PKV_OK);
    pkv_gpu_pool_view_t v;
    CASE_CHECK(pkv_gpu_pool_view(kv, 0, 0, &v) == PKV_ERR_UNSUPPORTED);
out:
    pkv_kv_destroy(kv);
    return rc;
}

/* The pool on the device (kv_storage.c), llama-3.2-1b's KV geometry in bf16: the pool's
 * committed bytes equal the storage's mapped bytes, and the driver's used delta its created
 * bytes; K/V of a 300-token sequence written by the KV write kernel into the pool's own
 * blocks (pkv_gpu_pool_view) land where the pool says (one piece read back) and the decode
 * kernel over them gives the double reference's rows; a fork's shared partial block is
 * copied on the device (copy-on-write through the storage); freed, reset and trimmed, the
 * driver holds only the retained granule; destroyed, nothing. */
static int pool_on_device(char *why, size_t cap)
{
    pkv_gpu_t *g = NULL;
    pkv_gpu_attn_t *at = NULL;
    pkv_gpu_arena_t *scratch = NULL;
    pkv_gpu_kv_storage_t *ks = NULL;
    pkv_kv_t *kv = NULL;
    pkv_seq_t *a = NULL, *b = NULL;
    const uint32_t n = 300, L = 16, kvh = 8, hd = 64, bt = 16, layer = 5, nb = (n + bt - 1) / bt;
    size_t nel = (size_t)n * kvh * hd;
    float *src = malloc(nel * 2 * sizeof(float)), q[8 * 64], out[8 * 64];
    uint16_t *kh = calloc((size_t)nb * bt * kvh * hd, 2),
             *vh = calloc((size_t)nb * bt * kvh * hd, 2);
    uint16_t *p1 = malloc(bt * hd * 2), *p2 = malloc(bt * hd * 2);
    int32_t *tok = malloc(n * sizeof(int32_t));
    uint32_t table[32], ident[32], lens[1] = {n};
    double ref[64], sc[300];
    int rc = open_with_kernels(&g, &at, why, cap);
    if (rc) goto out_free;
    CASE_CHECK(src && kh && vh && p1 && p2 && tok);
    pkv_gpu_arena_config_t sp = {.spare_min = 2, .spare_max = 8};
    CASE_CHECK(pkv_gpu_kv_storage_create(g, &sp, &ks) == PKV_OK);
    uint64_t free0, total;
    CASE_CHECK(pkv_gpu_mem_info(g, &free0, &total) == PKV_OK);
    pkv_kv_config_t cfg = {.geo = {L, kvh, hd, bt, PKV_DTYPE_BF16},
                           .storage = pkv_gpu_kv_storage(ks),
                           .reserve_bytes = 1ull << 30};
    CASE_CHECK(pkv_kv_create(&cfg, &kv) == PKV_OK);
    for (uint32_t i = 0; i < n; i++) tok[i] = (int32_t)i;
    pkv_seq_params_t prm = {.tokens = tok, .n_tokens = n, .reserve_tokens = n};
    CASE_CHECK(pkv_seq_create(kv, &prm, &a, NULL) == PKV_OK);
    const uint32_t *ids;
    uint32_t nids;
    pkv_seq_blocks(a, &ids, &nids);
    CASE_CHECK(nids == nb);
    pkv_gpu_pool_view_t v;
    CASE_CHECK(pkv_gpu_pool_view(kv, 0, layer, &v) == PKV_OK);
    for (uint32_t i = 0; i < nb; i++) table[i] = pkv_gpu_pool_index(&v, ids[i]), ident[i] = i;
    uint64_t seed = 2024;
    for (size_t i = 0; i < 2 * nel; i++) src[i] = rng_unit(&seed);
    for (uint32_t i = 0; i < kvh * hd; i++) q[i] = rng_unit(&seed);
    for (uint32_t t = 0; t < n; t++) /* the host's bf16, [block][head][token][dim] */
        for (uint32_t h = 0; h < kvh; h++)
            for (uint32_t d = 0; d < hd; d++) {
                size_t o = (((size_t)(t / bt) * kvh + h) * bt + t % bt) * hd + d;
                kh[o] = pkv_f32_to_bf16(src[((size_t)t * kvh + h) * hd + d]);
                vh[o] = pkv_f32_to_bf16(src[nel + ((size_t)t * kvh + h) * hd + d]);
            }
    pkv_gpu_arena_config_t c = {.n_granules = 4};
    CASE_CHECK(pkv_gpu_arena_create(g, &c, &scratch) == PKV_OK);
    for (uint32_t i = 0; i < c.n_granules; i++)
        CASE_CHECK(pkv_gpu_arena_commit(scratch, i) == PKV_OK);
    pkv_gpu_arena_stats_t sst;
    pkv_gpu_arena_stats(scratch, &sst);
    bump_t bm = {scratch, pkv_gpu_arena_base(scratch), 0, sst.reserved_bytes};
    uint32_t splits = pkv_gpu_decode_splits(at, 1, kvh, n);
    uint64_t dsrc = bump(&bm, nel * 2 * 4), dtab = bump(&bm, sizeof(table)), dlen = bump(&bm, 16),
             dq = bump(&bm, sizeof(q)), dout = bump(&bm, sizeof(out)),
             dpart = bump(&bm, (uint64_t)kvh * splits * (hd + 2) * 4);
    CASE_CHECK(dpart != 0);
    CASE_CHECK(pkv_gpu_copy_from_host(g, dsrc, src, nel * 2 * 4) == PKV_OK &&
               pkv_gpu_copy_from_host(g, dtab, table, sizeof(table)) == PKV_OK &&
               pkv_gpu_copy_from_host(g, dlen, lens, sizeof(lens)) == PKV_OK &&
               pkv_gpu_copy_from_host(g, dq, q, sizeof(q)) == PKV_OK);
    pkv_gpu_kv_write_t w = {.k = dsrc,
                            .v = dsrc + nel * 4,
                            .k_base = v.k_base,
                            .v_base = v.v_base,
                            .block_stride = v.block_stride,
                            .head_stride = v.head_stride,
                            .table = dtab,
                            .p0 = 0,
                            .n_tokens = n,
                            .block_tokens = bt,
                            .kv_heads = kvh,
                            .head_dim = hd};
    CASE_CHECK(pkv_gpu_kv_write(at, &w) == PKV_OK && pkv_gpu_sync(g) == PKV_OK);
    CASE_CHECK(pkv_seq_append(a, tok, n) == PKV_OK);
    /* one piece where the pool says it is: block 3's, head 2's K of the layer */
    CASE_CHECK(pkv_gpu_copy_to_host(g, p1, (uintptr_t)pkv_kv_block_head(kv, ids[3], layer, 0, 2),
                                    (uint64_t)bt * hd * 2) == PKV_OK);
    CASE_CHECK(memcmp(p1, kh + ((size_t)3 * kvh + 2) * bt * hd, (size_t)bt * hd * 2) == 0);
    pkv_gpu_decode_t p = {.q = dq,
                          .out = dout,
                          .part = dpart,
                          .k_base = v.k_base,
                          .v_base = v.v_base,
                          .block_stride = v.block_stride,
                          .head_stride = v.head_stride,
                          .table = dtab,
                          .lens = dlen,
                          .max_blocks = nb,
                          .n_seq = 1,
                          .block_tokens = bt,
                          .kv_heads = kvh,
                          .group = 1,
                          .head_dim = hd,
                          .scale = 0.125f,
                          .n_split = splits};
    CASE_CHECK(pkv_gpu_decode_attn(at, &p) == PKV_OK && pkv_gpu_sync(g) == PKV_OK);
    CASE_CHECK(pkv_gpu_copy_to_host(g, out, dout, sizeof(out)) == PKV_OK);
    for (uint32_t h = 0; h < kvh; h++) {
        row_at_t ra = {ident, (size_t)kvh * bt * hd, (size_t)h * bt * hd, bt, hd};
        double err, big;
        ref_row(q + h * hd, hd, 0.125, kh, vh, row_elem, &ra, n, sc, ref);
        if (!row_close(ref, out + h * hd, hd, &err, &big)) {
            snprintf(why, cap, "decode over the pool, head %u: error %.3g against max %.3g", h, err,
                     big);
            rc = GPU_CASE_FAIL;
            goto out;
        }
    }
    /* copy-on-write on the device: b shares a's partial block until it reserves past it */
    CASE_CHECK(pkv_seq_fork(a, &b) == PKV_OK && pkv_seq_reserve(b, n + 1) == PKV_OK);
    const uint32_t *bids;
    uint32_t nbids;
    pkv_seq_blocks(b, &bids, &nbids);
    CASE_CHECK(bids[nb - 1] != ids[nb - 1] && bids[0] == ids[0]);
    CASE_CHECK(
        pkv_gpu_copy_to_host(g, p1, (uintptr_t)pkv_kv_block_head(kv, ids[nb - 1], layer, 1, 7),
                             (uint64_t)bt * hd * 2) == PKV_OK &&
        pkv_gpu_copy_to_host(g, p2, (uintptr_t)pkv_kv_block_head(kv, bids[nb - 1], layer, 1, 7),
                             (uint64_t)bt * hd * 2) == PKV_OK);
    CASE_CHECK(memcmp(p1, p2, (size_t)bt * hd * 2) == 0);
    pkv_kv_stats_t st;
    pkv_kv_stats(kv, &st);
    pkv_gpu_arena_stats_t ast;
    pkv_gpu_kv_storage_stats(ks, &ast);
    CASE_CHECK(st.cow_copies == 1 && st.committed_bytes == ast.mapped_bytes && ast.mapped_bytes);
    if (!driver_agrees(g, free0 - sst.reserved_bytes, &ast, why, cap, "two sequences")) {
        rc = GPU_CASE_FAIL;
        goto out;
    }
    pkv_seq_free(a), pkv_seq_free(b);
    a = b = NULL;
    pkv_kv_reset_cache(kv);
    pkv_gpu_kv_storage_trim(ks);
    pkv_kv_stats(kv, &st);
    pkv_gpu_kv_storage_stats(ks, &ast);
    CASE_CHECK(st.committed_bytes <= st.granule_bytes && st.committed_bytes == ast.mapped_bytes);
    if (!driver_agrees(g, free0 - sst.reserved_bytes, &ast, why, cap, "freed and trimmed")) {
        rc = GPU_CASE_FAIL;
        goto out;
    }
    pkv_kv_destroy(kv);
    kv = NULL;
    pkv_gpu_kv_storage_stats(ks, &ast);
    if (!driver_agrees(g, free0 - sst.reserved_bytes, &ast, why, cap, "destroyed"))
        rc = GPU_CASE_FAIL;
out:
    pkv_seq_free(a);
    pkv_seq_free(b);
    pkv_kv_destroy(kv);
    pkv_gpu_kv_storage_destroy(ks);
    pkv_gpu_arena_destroy(scratch);
    pkv_gpu_attn_unload(at);
    pkv_gpu_close(g);
out_free:
    free(src), free(kh), free(vh), free(p1), free(p2), free(tok);
    return rc;
}

/* no_device_says_why last: it loads CUDA's stub (whose soname is libcuda.so.1 too) and,
 * though a failed open unloads it, the device cases run before it. */
const gpu_case_t gpu_cases[] = {
    {"no_such_device", no_such_device},
    {"arena_maps_in_place", arena_maps_in_place},
    {"arena_spares_bounded", arena_spares_bounded},
    {"arena_counters_match_driver", arena_counters_match_driver},
    {"decode_attention_matches_reference", decode_attention_matches_reference},
    {"kv_write_matches_host_rounding", kv_write_matches_host_rounding},
    {"prefill_rows_equal_decode", prefill_rows_equal_decode},
    {"stage_round_trip", stage_round_trip},
    {"pool_view_addresses_every_block", pool_view_addresses_every_block},
    {"pool_on_device", pool_on_device},
    {"no_device_says_why", no_device_says_why},
};
const size_t gpu_n_cases = sizeof(gpu_cases) / sizeof(gpu_cases[0]);
