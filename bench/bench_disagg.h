/*
 * `pagekv bench disagg`: its two modes, and the planner check of the load mode
 * (bench_disagg_plan.c). Both modes start their nodes with support/launch.h and size
 * prompts with pkv_fp_chars_per_token (support/footprint.h).
 */
#ifndef PKV_BENCH_DISAGG_H
#define PKV_BENCH_DISAGG_H

#include "plan/plan.h"

#include <jansson.h>
#include <stdio.h>

#include <stdbool.h>
#include <stdint.h>

/* The modes of `pagekv bench disagg` (argv[0] "disagg"; bench_disagg_cmd.c picks one):
 * the load mode (bench_disagg.c), with `--latency` the latency mode
 * (bench_disagg_latency.c; docs/design/bench_disagg.md, "Latency mode"), with
 * `--interference` the interference mode. Exit code 0, 1 (a run did not hold), 2 (bad
 * options), 130 (interrupted). */
int pkv_bench_disagg_load(int argc, char **argv);
int pkv_bench_disagg_latency(int argc, char **argv);
/* `--interference` (bench_disagg_interference.c; docs/design/bench_disagg.md,
 * "Interference mode"): decoding streams' inter-token latency while long prompts arrive, a
 * unified node against prefill + decode nodes behind the router. */
int pkv_bench_disagg_interference(int argc, char **argv);

/* One design's figures for the planner check (bench_disagg_plan.c). */
#define PKV_BD_PLAN_MIX 64
/* The nodes' pool block (pagekv serve's --block-tokens default): a decode leg pulls the
 * whole blocks before the prompt's last token. */
#define PKV_BD_BLOCK_TOKENS 16
/* The prompts the nodes served, by token count (each the shortest count that pulls as
 * many blocks), weighted by how many. */
typedef struct {
    uint32_t tokens[PKV_BD_PLAN_MIX], weight[PKV_BD_PLAN_MIX];
    uint32_t n;
} pkv_bd_mix_t;

/* The load's phases as the planner check sees them: each one's own mix and peaks (the
 * nodes' high-water marks are read and restarted at every phase's end). */
#define PKV_BD_PLAN_PHASES 6
typedef struct {
    const char *name;
    bool mixed;              /* its prompts' lengths arrive interleaved (the paced phase) */
    pkv_bd_mix_t mix;        /* n == 0: the phase did not run */
    uint64_t in_flight[2];   /* prefill, decode: the stage's peak of transfers holding pages */
    double inflight_peak[2]; /* the stage's peak pages in use x page bytes */
} pkv_bd_plan_phase_t;

typedef struct {
    const char *design;
    bool fixed;          /* fixed slots (else per-transfer staging) */
    uint32_t slots;      /* fixed: the slots */
    uint32_t pool_pages; /* the staging's pages (per-transfer: the arena) */
    uint64_t page_bytes;
    uint32_t context;        /* the longest context, tokens */
    double pinned_peak[2];   /* prefill, decode: VmLck peak over the run, bytes */
    double inflight_peak[2]; /* the stage's peak pages in use over the run x page bytes */
    pkv_bd_plan_phase_t phase[PKV_BD_PLAN_PHASES];
} pkv_bd_plan_design_t;

/* Count a served prompt of n tokens (usage.prompt_tokens; <= 0: not counted) into the
 * mix, as the shortest count that pulls as many whole PKV_BD_BLOCK_TOKENS blocks (a full
 * mix adds it to the entry nearest above, else the longest). */
void pkv_bd_mix_add(pkv_bd_mix_t *mix, long n);

/* The planner's load from the mix: its entries (each at most `context` tokens) and pulls
 * of whole PKV_BD_BLOCK_TOKENS blocks (the mix as one of transfers in flight; a caller
 * whose prompts arrive mixed sets in->mix_of_requests). */
void pkv_bd_mix_plan(const pkv_bd_mix_t *mix, uint64_t context, pkv_plan_input_t *in);

/* The planner (src/plan, preset's geometry, 64-token pages) against each design's
 * measured peaks: prints the "planner vs measured" table to out and returns the JSON rows
 * [{design, node, phase, figure, in_flight, predicted_bytes, measured_bytes, ratio,
 * within_10pct, note}] (new reference; NULL when the planner refused the geometry, said
 * on stderr). Fixed designs: one row per node, slots x the longest context vs the pinned
 * peak. Per-transfer designs: per phase, the mean of its mix's transfers at the phase's
 * peak count (and the tail, for a mixed phase) vs the phase's peak pages in use; then
 * "run": the largest phase prediction vs the run's pinned peak (the OS). */
json_t *pkv_bd_plan_check(const char *preset, const pkv_bd_plan_design_t *d, size_t n, FILE *out);

#endif
