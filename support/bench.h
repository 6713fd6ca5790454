/*
 * Shared pieces of the benchmarks: medians, the process's memory from the OS, and
 * writing a jansson object to --json FILE.
 */
#ifndef PKV_SUPPORT_BENCH_H
#define PKV_SUPPORT_BENCH_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

/* Median of n values (sorts a copy). */
double pkv_bench_median(const double *v, size_t n);
/* Write obj to path (pretty, sorted keys); 0 or -1 with a message on stderr. */
int pkv_bench_write_json(const char *path, json_t *obj);
/* VmRSS / VmHWM of this process, bytes. */
uint64_t pkv_bench_rss(void);
uint64_t pkv_bench_hwm(void);

#endif
