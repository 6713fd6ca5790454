/*
 * The GPU tests' cases (gpu_cases.h). The first two need no device: how a build or a
 * machine without one says so. The rest open device 0 and skip, saying why, without one.
 */
#include "tests/support/gpu_cases.h"

#include "gpu/gpu.h"

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
    uint64_t free0, free1, total;
    CASE_CHECK(pkv_gpu_mem_info(g, &free0, &total) == PKV_OK);
    for (int phase = 0; phase < 3; phase++) {
        for (uint32_t i = 0; i < 64; i++) {
            if (phase == 0) CASE_CHECK(pkv_gpu_arena_commit(a, i) == PKV_OK);
            if (phase == 1) CASE_CHECK(pkv_gpu_arena_decommit(a, i) == PKV_OK);
        }
        if (phase == 2) pkv_gpu_arena_trim(a);
        CASE_CHECK(pkv_gpu_mem_info(g, &free1, &total) == PKV_OK);
        pkv_gpu_arena_stats_t st;
        pkv_gpu_arena_stats(a, &st);
        double used = (double)free0 - (double)free1, want = (double)st.created_bytes;
        double slack = want * 0.02 > (double)st.granule_bytes ? want * 0.02 : st.granule_bytes;
        if (used - want > slack || want - used > slack) {
            snprintf(why, cap, "phase %d: the driver says %.1f MiB used, the arena %.1f MiB",
                     phase, used / 1048576.0, want / 1048576.0);
            rc = GPU_CASE_FAIL;
            goto out;
        }
    }
out:
    pkv_gpu_arena_destroy(a);
    pkv_gpu_close(g);
    return rc;
}

const gpu_case_t gpu_cases[] = {
    {"no_device_says_why", no_device_says_why},
    {"no_such_device", no_such_device},
    {"arena_maps_in_place", arena_maps_in_place},
    {"arena_spares_bounded", arena_spares_bounded},
    {"arena_counters_match_driver", arena_counters_match_driver},
};
const size_t gpu_n_cases = sizeof(gpu_cases) / sizeof(gpu_cases[0]);
