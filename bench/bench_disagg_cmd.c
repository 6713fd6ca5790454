/*
 * `pagekv bench disagg`: the load mode, with `--latency` the latency mode, with
 * `--interference` the interference mode (bench/bench_disagg.h).
 */
#include "bench/bench_disagg.h"
#include "support/cli.h"
#include "tools/commands.h"

#include <string.h>

int pkv_bench_disagg(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--latency")) return pkv_bench_disagg_latency(argc, argv);
        if (!strcmp(argv[i], "--interference")) return pkv_bench_disagg_interference(argc, argv);
    }
    return pkv_bench_disagg_load(argc, argv);
}
