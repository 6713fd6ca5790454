/*
 * What the two modes of `pagekv bench disagg` share: the load mode (bench_disagg.c) hands
 * `--latency` to the latency mode (bench_disagg_latency.c); both size prompts with
 * pkv_fp_chars_per_token (support/footprint.h).
 */
#ifndef PKV_BENCH_DISAGG_H
#define PKV_BENCH_DISAGG_H

/* `pagekv bench disagg --latency ...` (docs/design/bench_disagg.md, "Latency mode"):
 * argv[0] is "disagg". Exit code as the load mode's: 0, 1 (a run did not hold), 2 (bad
 * options), 130 (interrupted). */
int pkv_bench_disagg_latency(int argc, char **argv);

#endif
