#include "support/bench.h"

#include "prim/prim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double pkv_bench_median(const double *v, size_t n)
{
    if (n == 0) return 0;
    double *c = malloc(n * sizeof(double));
    if (!c) return v[0];
    memcpy(c, v, n * sizeof(double));
    qsort(c, n, sizeof(double), cmp_double);
    double m = n % 2 ? c[n / 2] : (c[n / 2 - 1] + c[n / 2]) / 2;
    free(c);
    return m;
}

int pkv_bench_write_json(const char *path, json_t *obj)
{
    if (json_dump_file(obj, path, JSON_INDENT(2) | JSON_SORT_KEYS) != 0) {
        fprintf(stderr, "pagekv bench: cannot write %s\n", path);
        return -1;
    }
    return 0;
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
