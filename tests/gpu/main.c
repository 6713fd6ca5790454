/*
 * pagekv-gpu-test: the GPU tests' cases (tests/support/gpu_cases.c) without Check, for a
 * GPU machine that has none: scripts/gpu-check.sh builds and runs it there. One line per
 * case (PASS, FAIL or SKIP with why), then "N passed, N failed, N skipped"; exit 1 when a
 * case failed. Usage: pagekv-gpu-test [KERNELS.fatbin].
 */
#include "tests/support/gpu_cases.h"

#include <stdio.h>

int main(int argc, char **argv)
{
    if (argc > 1) gpu_cases_fatbin = argv[1]; /* the kernels (default: build/gpu's) */
    int n[3] = {0};
    for (size_t i = 0; i < gpu_n_cases; i++) {
        char why[512] = "";
        int r = gpu_cases[i].run(why, sizeof(why));
        static const char *const word[3] = {"PASS", "FAIL", "SKIP"};
        printf("%s %s%s%s\n", word[r], gpu_cases[i].name, *why ? ": " : "", why);
        n[r]++;
    }
    printf("%d passed, %d failed, %d skipped\n", n[0], n[1], n[2]);
    return n[1] ? 1 : 0;
}
