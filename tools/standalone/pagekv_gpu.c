/*
 * pagekv-gpu: `pagekv bench gpu` alone, for a GPU machine that has the driver, cc and
 * nothing of Debian's: scripts/gpu-check.sh builds it there from src/core, src/gpu and
 * bench/bench_gpu.c (make GPU=1 builds it here as build/gpu/pagekv-gpu).
 */
#include "tools/commands.h"

int main(int argc, char **argv)
{
    return pkv_bench_gpu(argc, argv);
}
