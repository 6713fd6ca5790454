/*
 * The GPU tests (docs/design/gpu.md): each case runs in tests/test_gpu.c (Check, the
 * suite here: skipped without a device) and in tests/gpu/main.c (alone, built and run on a
 * GPU machine by scripts/gpu-check.sh, where Check is not installed). A case returns
 * GPU_CASE_PASS, GPU_CASE_FAIL or GPU_CASE_SKIP with why.
 */
#ifndef PKV_TEST_GPU_CASES_H
#define PKV_TEST_GPU_CASES_H

#include <stddef.h>

enum { GPU_CASE_PASS = 0, GPU_CASE_FAIL = 1, GPU_CASE_SKIP = 2 };

typedef struct {
    const char *name;
    int (*run)(char *why, size_t cap);
} gpu_case_t;

extern const gpu_case_t gpu_cases[];
extern const size_t gpu_n_cases;
/* The kernels' fatbin the attention case loads (default build/gpu/pagekv-kernels.fatbin). */
extern const char *gpu_cases_fatbin;

#endif
