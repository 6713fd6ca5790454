/*
 * The pure pieces of `pagekv bench footprint` (bench/footprint_*.c), kept in the support
 * library so the suite can check them without starting a server (tests/test_footprint.c):
 * the benchmark's filler text, per-phase peak/last of a memory trace, the workload's
 * minimum KV (kv_min_bytes) and the SVG plot writer.
 */
#ifndef PKV_SUPPORT_FOOTPRINT_H
#define PKV_SUPPORT_FOOTPRINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* ---- filler --------------------------------------------------------------------------- */
/* Write exactly n characters of support/filler.h's filler to buf (n + 1 bytes; NUL
 * added), the sentences numbered from a number derived from seed (so two seeds differ
 * from the first sentence on) and the words drawn from the stream seeded by seed. The
 * same (n, seed) always gives the same bytes; the first k bytes of filler(n, seed) equal
 * filler(k, seed). */
void pkv_fp_filler(char *buf, size_t n, uint64_t seed);
/* The same into a new buffer of n + 1 bytes (caller frees); NULL when out of memory. */
char *pkv_fp_filler_alloc(size_t n, uint64_t seed);
/* The builtin tokenizer's characters per token on 16,000 characters of filler (4.0 if it
 * cannot be measured): how the serving benchmarks size prompts in tokens. */
double pkv_fp_chars_per_token(void);

/* ---- memory trace --------------------------------------------------------------------- */
typedef struct {
    uint64_t t_ns;  /* monotonic time of the sample */
    uint64_t bytes; /* VmRSS */
} pkv_fp_sample_t;

typedef struct {
    uint64_t peak_bytes; /* largest sample in [begin, end) (0 when none) */
    uint64_t last_bytes; /* last sample in [begin, end) (0 when none) */
    uint32_t n_samples;
} pkv_fp_window_t;

/* Peak and last of the samples with begin <= t_ns < end (samples in time order). */
pkv_fp_window_t pkv_fp_window(const pkv_fp_sample_t *s, size_t n, uint64_t begin, uint64_t end);

/* ---- the workload's minimum KV -------------------------------------------------------- */
typedef struct {
    uint32_t prompt_tokens;     /* usage.prompt_tokens */
    uint32_t completion_tokens; /* usage.completion_tokens */
    uint32_t cached_tokens;     /* usage.prompt_tokens_details.cached_tokens */
    uint32_t group;             /* requests with the same group ran concurrently */
    bool shared_prefix;         /* the group's prompts start with the same cached text */
} pkv_fp_req_t;

/* The fewest KV bytes the workload needs at its fullest moment, counting every distinct
 * resident token once. A request holds prompt + completion - 1 positions (the last token
 * sampled is never fed back). In a group of concurrent requests marked shared_prefix, the
 * smallest cached_tokens of the group (whole blocks adopted from one cached chain) is held
 * once and each request holds the rest of its positions rounded up to whole blocks;
 * otherwise each request's positions are rounded up to whole blocks and summed. The
 * result is the largest group's figure times block_tokens * token_bytes per block.
 * Requests are grouped by their group field (any order). */
uint64_t pkv_fp_kv_min_bytes(const pkv_fp_req_t *r, size_t n, uint32_t block_tokens,
                             uint64_t token_bytes);

/* ---- SVG plot ------------------------------------------------------------------------- */
typedef struct {
    const char *label;
    const char *color; /* "#rrggbb" */
    bool dashed;
    const double *x, *y; /* seconds, MiB (pkv_fp_svg_plot: its axes' units) */
    size_t n;
} pkv_fp_series_t;

typedef struct {
    double x;          /* seconds */
    const char *label; /* short; drawn at the top of the line */
    const char *color;
} pkv_fp_mark_t;

/* Write a standalone SVG line plot (x in seconds, y in MiB from 0) of the series with
 * vertical marks. Labels are XML-escaped. Returns 0, or -1 when writing failed. */
int pkv_fp_svg_write(FILE *f, const char *title, const pkv_fp_series_t *s, size_t ns,
                     const pkv_fp_mark_t *m, size_t nm);
/* The same plot with other axis titles (x and y from 0 whatever their unit): pkv_fp_svg_write
 * is this with "seconds since the server was ready" and "VmRSS / KV committed (MiB)". */
int pkv_fp_svg_plot(FILE *f, const char *title, const char *xlabel, const char *ylabel,
                    const pkv_fp_series_t *s, size_t ns, const pkv_fp_mark_t *m, size_t nm);

/* A "nice" axis step (1, 2 or 5 times a power of ten) giving about `ticks` ticks over
 * [0, max]. */
double pkv_fp_nice_step(double max, int ticks);

#endif
