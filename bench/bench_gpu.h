/*
 * bench gpu's parts in files of their own (bench_gpu.c runs them).
 */
#ifndef PKV_BENCH_GPU_H
#define PKV_BENCH_GPU_H

#include "gpu/gpu.h"

#include <stdbool.h>
#include <stdio.h>

/* The footprint replay (bench_gpu_replay.c): the footprint bench's shared_prefix_burst and
 * churn demand, replayed as sequences on a pool of llama-3.2-1b's KV geometry (bf16) whose
 * storage is ks (NULL: host memory). With g, each checkpoint also compares the driver's
 * used delta with the storage's created bytes. */
typedef struct {
    double kv_min_mib, committed_peak_mib, bound_mib; /* burst: target peak <= bound */
    double budget_mib, churn_peak_mib;                /* churn (the pool holds its budget) */
    double idle_mib, granule_mib;                     /* after the idle time: <= a granule */
    double worst_driver; /* pkv_gpu_driver_gap at the checkpoints (<= 1: agree); -1: no g */
    bool burst_met, idle_met;
} bg_replay_t;
int bg_replay(pkv_gpu_t *g, pkv_gpu_kv_storage_t *ks, FILE *json, bg_replay_t *out);

#endif
