/*
 * Shared pieces of the benchmarks: medians, the process's memory from the OS, and
 * writing a jansson object to --json FILE (through support/report.h).
 */
#ifndef PKV_SUPPORT_BENCH_H
#define PKV_SUPPORT_BENCH_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

/* Median of n values (sorts a copy). */
double pkv_bench_median(const double *v, size_t n);
/* A distribution-free 95 % confidence interval for the median of n values: the order
 * statistics x(j) and x(n + 1 - j) of the sorted values, j the largest with
 * P(Bin(n, 1/2) < j) <= 2.5 %; *cover gets its exact coverage (>= 95 %). 0, or -1 when
 * n < 6 (no such interval; lo, hi and cover untouched). */
int pkv_bench_median_ci(const double *v, size_t n, double *lo, double *hi, double *cover);
/* pkv_report_write_json() for a benchmark: 0, or -1 with "pagekv bench: cannot write PATH". */
int pkv_bench_write_json(const char *path, json_t *obj);
/* VmRSS / VmHWM of this process, bytes. */
uint64_t pkv_bench_rss(void);
uint64_t pkv_bench_hwm(void);

#endif
