#include "support/bench.h"
#include "support/report.h"

#include "prim/prim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* A sorted copy of v (the caller frees it), or NULL. */
static double *sorted_copy(const double *v, size_t n)
{
    double *c = malloc(n * sizeof(double));
    if (!c) return NULL;
    memcpy(c, v, n * sizeof(double));
    qsort(c, n, sizeof(double), cmp_double);
    return c;
}

double pkv_bench_median(const double *v, size_t n)
{
    if (n == 0) return 0;
    double *c = sorted_copy(v, n);
    if (!c) return v[0];
    double m = n % 2 ? c[n / 2] : (c[n / 2 - 1] + c[n / 2]) / 2;
    free(c);
    return m;
}

int pkv_bench_median_ci(const double *v, size_t n, double *lo, double *hi, double *cover)
{
    /* cdf = P(B <= j - 1) for B ~ Bin(n, 1/2), grown while the next term keeps it <= 2.5 % */
    double term = 1, cdf;
    for (size_t i = 0; i < n; i++) term /= 2;
    cdf = term;                 /* P(B <= 0) */
    if (cdf > 0.025) return -1; /* n < 6 */
    size_t j = 1;
    for (;;) {
        double next = term * (double)(n - j + 1) / (double)j; /* P(B = j) */
        if (cdf + next > 0.025) break;
        term = next;
        cdf += next;
        j++;
    }
    double *c = sorted_copy(v, n);
    if (!c) return -1;
    *lo = c[j - 1];
    *hi = c[n - j];
    *cover = 1 - 2 * cdf;
    free(c);
    return 0;
}

int pkv_bench_write_json(const char *path, json_t *obj)
{
    return pkv_report_write_json("bench", path, obj);
}

uint64_t pkv_bench_rss(void)
{
    pkv_prim_mem_t m;
    return pkv_prim_mem_read(0, &m) == 0 ? m.rss_bytes : 0;
}

uint64_t pkv_bench_hwm(void)
{
    pkv_prim_mem_t m;
    return pkv_prim_mem_read(0, &m) == 0 ? m.hwm_bytes : 0;
}
