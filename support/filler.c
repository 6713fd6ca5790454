/*
 * Filler text (see filler.h): one generator for the benchmarks and the tests.
 */
#include "support/filler.h"

#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void pkv_filler_write(char *buf, size_t n, uint64_t seed, uint64_t first)
{
    static const char *const adj[] = {"quick",   "careful", "detailed", "brief",       "thorough",
                                      "initial", "final",   "routine",  "independent", "second"};
    static const char *const noun[] = {"analysis", "review",    "report", "study",
                                       "survey",   "audit",     "test",   "measurement",
                                       "summary",  "evaluation"};
    static const char *const verb[] = {"shows",   "suggests", "confirms",     "indicates",
                                       "reveals", "finds",    "demonstrates", "reports"};
    static const char *const obj[] = {
        "a steady increase in load",        "no change in latency",
        "a small drop in throughput",       "higher memory use than expected",
        "that the cache hit rate improved", "a regression in the nightly build",
        "stable results across all runs",   "errors in about 3 percent of requests"};
    uint64_t st = seed;
    unsigned long long num = first;
    size_t len = 0;
    while (len < n) {
        char s[256];
        int k = snprintf(s, sizeof(s), "Sentence %llu: the %s %s of system %u %s %s. ", num++,
                         adj[pkv_splitmix64(&st) % 10], noun[pkv_splitmix64(&st) % 10],
                         (unsigned)(100 + pkv_splitmix64(&st) % 9900),
                         verb[pkv_splitmix64(&st) % 8], obj[pkv_splitmix64(&st) % 8]);
        size_t take = (size_t)k < n - len ? (size_t)k : n - len;
        memcpy(buf + len, s, take);
        len += take;
    }
    buf[n] = '\0';
}

char *pkv_filler_alloc(size_t n, uint64_t seed, uint64_t first)
{
    char *s = malloc(n + 1);
    if (s) pkv_filler_write(s, n, seed, first);
    return s;
}
