/*
 * What the two modes of `pagekv bench disagg` share: the load mode (bench_disagg.c) hands
 * `--latency` to the latency mode (bench_disagg_latency.c); both size prompts with
 * pkv_fp_chars_per_token (support/footprint.h).
 */
#ifndef PKV_BENCH_DISAGG_H
#define PKV_BENCH_DISAGG_H

#include "support/cluster.h"

#include <stdbool.h>
#include <stdint.h>

/* `pagekv bench disagg --latency ...` (docs/design/bench_disagg.md, "Latency mode"):
 * argv[0] is "disagg". Exit code as the load mode's: 0, 1 (a run did not hold), 2 (bad
 * options), 130 (interrupted). */
int pkv_bench_disagg_latency(int argc, char **argv);

/* Start a node: `BIN serve --port 0 --preset PRESET --max-context CTX --kv-cache-budget
 * none`, with a role `--role ROLE --kv-lease-ms 600000 --kv-transfer-timeout-ms 60000`,
 * then `extra` (NULL-terminated, may be NULL); its log LOGDIR/NAME.log; UCX_TLS=tcp when
 * tcp. 0, or -1 with the reason on stderr. */
int pkv_bench_disagg_serve(const char *bin, const char *logdir, const char *name,
                           const char *preset, uint32_t ctx, const char *role, char *const extra[],
                           bool tcp, cluster_proc_t *p);
/* Start `BIN route --port 0 --prefill PRE --decode DEC` then `extra`; 0 or -1 as above. */
int pkv_bench_disagg_route(const char *bin, const char *logdir, const cluster_proc_t *pre,
                           const cluster_proc_t *dec, char *const extra[], cluster_proc_t *p);

#endif
