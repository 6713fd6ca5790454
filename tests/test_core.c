/* core: status names, deadlines, log sink and levels; prim's load average and huge pages;
 * the benchmarks' median interval. */
#include "support/bench.h"
#include "tests/support/testutil.h"

#include "core/core.h"
#include "prim/prim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

START_TEST(status_names)
{
    ck_assert_str_eq(pkv_status_str(PKV_OK), "ok");
    ck_assert_str_eq(pkv_status_str(PKV_ERR_NOFIT), "nofit");
    ck_assert_str_eq(pkv_status_str(PKV_ERR_PEER_LOST), "peer_lost");
    ck_assert_str_eq(pkv_status_str(-999), "unknown");
}
END_TEST

START_TEST(deadlines_are_monotonic_and_saturate)
{
    uint64_t a = pkv_now_ns();
    uint64_t d = pkv_deadline_after_ns(1000000);
    ck_assert_uint_ge(d, a + 1000000);
    ck_assert_uint_eq(pkv_deadline_after_ns(UINT64_MAX), PKV_DEADLINE_NEVER);
    ck_assert_uint_ge(pkv_now_ns(), a);
}
END_TEST

struct captured {
    int n;
    char last[256];
    pkv_log_level_t level;
};
static void capture_sink(void *arg, pkv_log_level_t level, const char *module, const char *line)
{
    struct captured *c = arg;
    c->n++;
    c->level = level;
    snprintf(c->last, sizeof(c->last), "%s|%s", module, line);
}

START_TEST(log_sink_and_level)
{
    struct captured c = {0};
    pkv_log_set_sink(capture_sink, &c);
    pkv_log_set_level(PKV_LOG_WARN);
    pkv_log(PKV_LOG_INFO, "test", "dropped %d", 1);
    ck_assert_int_eq(c.n, 0);
    pkv_log(PKV_LOG_ERROR, "test", "kept %d", 2);
    ck_assert_int_eq(c.n, 1);
    ck_assert_str_eq(c.last, "test|kept 2");
    ck_assert_int_eq(c.level, PKV_LOG_ERROR);
    pkv_log_set_sink(NULL, NULL);
}
END_TEST

START_TEST(fault_sites_skip_then_fail_then_pass)
{
    /* Unarmed: nothing fails. */
    for (int i = 0; i < 10; i++) ck_assert(!pkv_fault_hit(PKV_FAULT_ALLOC));
    /* Two hits pass, three fail, then it passes again; other sites are untouched. */
    pkv_fault_arm(PKV_FAULT_ALLOC, 2, 3);
    int pattern[8];
    for (int i = 0; i < 8; i++) pattern[i] = pkv_fault_hit(PKV_FAULT_ALLOC);
    const int want[8] = {0, 0, 1, 1, 1, 0, 0, 0};
    for (int i = 0; i < 8; i++) ck_assert_int_eq(pattern[i], want[i]);
    ck_assert_uint_eq(pkv_fault_fired(PKV_FAULT_ALLOC), 3);
    ck_assert(!pkv_fault_hit(PKV_FAULT_COMMIT));
    /* prim's commit and pin are sites: a simulated failure is the real one's status. */
    void *p = NULL;
    ck_assert_int_eq(pkv_prim_reserve(1u << 21, 1u << 21, &p), PKV_OK);
    pkv_fault_arm(PKV_FAULT_COMMIT, 0, 1);
    ck_assert_int_eq(pkv_prim_commit(p, 1u << 21, false), PKV_ERR_NOMEM);
    ck_assert_int_eq(pkv_prim_commit(p, 1u << 21, false), PKV_OK);
    pkv_fault_arm(PKV_FAULT_MLOCK, 0, 1);
    ck_assert_int_eq(pkv_prim_lock(p, 4096), PKV_ERR_IO);
    pkv_prim_release(p, 1u << 21);
    /* Arming with count 0 disarms; so does disarm_all. */
    pkv_fault_arm(PKV_FAULT_THREAD, 0, 5);
    pkv_fault_disarm_all();
    ck_assert(!pkv_fault_hit(PKV_FAULT_THREAD));
    ck_assert_uint_eq(pkv_fault_fired(PKV_FAULT_THREAD), 0);
}
END_TEST

START_TEST(prim_reads_the_load_average)
{
    double l = -1;
    ck_assert_int_eq(pkv_prim_loadavg(&l), PKV_OK);
    ck_assert(l >= 0 && l < 1e6);
    /* The CPU's name: family and model where /proc/cpuinfo has them, cut to the buffer. */
    char cpu[200], small[8];
    pkv_prim_cpu_model(cpu, sizeof(cpu));
    ck_assert(strlen(cpu) > 0 && strcmp(cpu, "unknown"));
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[256];
    bool fam = false;
    while (f && fgets(line, sizeof(line), f) && !fam) fam = !strncmp(line, "cpu family", 10);
    if (f) fclose(f);
    if (fam) ck_assert_ptr_nonnull(strstr(cpu, "(family "));
    pkv_prim_cpu_model(small, sizeof(small));
    ck_assert_uint_eq(strlen(small), 7);
    ck_assert(!strncmp(small, cpu, 7));
}
END_TEST

/* ROOT/sys/kernel/mm/transparent_hugepage/enabled holding `text`. */
static void put_thp(const char *root, const char *text)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/sys/kernel/mm/transparent_hugepage", root);
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "mkdir -p %s", path);
    ck_assert_int_eq(system(cmd), 0);
    strcat(path, "/enabled");
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

START_TEST(prim_reads_the_thp_mode)
{
    char root[] = "/tmp/pkv-thp-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(root));
    pkv_prim_thp_mode_t m = PKV_PRIM_THP_UNKNOWN;
    ck_assert_int_eq(pkv_prim_thp_mode(root, &m), PKV_ERR_IO); /* missing */
    put_thp(root, "always [madvise] never\n");
    ck_assert_int_eq(pkv_prim_thp_mode(root, &m), PKV_OK);
    ck_assert_int_eq(m, PKV_PRIM_THP_MADVISE);
    put_thp(root, "[always] madvise never\n");
    ck_assert_int_eq(pkv_prim_thp_mode(root, &m), PKV_OK);
    ck_assert_int_eq(m, PKV_PRIM_THP_ALWAYS);
    put_thp(root, "always madvise [never]\n");
    ck_assert_int_eq(pkv_prim_thp_mode(root, &m), PKV_OK);
    ck_assert_int_eq(m, PKV_PRIM_THP_NEVER);
    ck_assert_str_eq(pkv_prim_thp_mode_name(m), "never");
    put_thp(root, "always madvise never\n"); /* no mode bracketed: *out untouched */
    ck_assert_int_eq(pkv_prim_thp_mode(root, &m), PKV_ERR_IO);
    ck_assert_int_eq(m, PKV_PRIM_THP_NEVER);
    char longroot[1100];
    memset(longroot, 'a', sizeof(longroot) - 1);
    longroot[sizeof(longroot) - 1] = 0;
    ck_assert_int_eq(pkv_prim_thp_mode(longroot, &m), PKV_ERR_INVALID);
    ck_assert_str_eq(pkv_prim_thp_mode_name(PKV_PRIM_THP_UNKNOWN), "unknown");
    char cmd[64];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", root);
    ck_assert_int_eq(system(cmd), 0);
    /* The real file reads on Linux with THP built in (not asserted: it may be absent). */
    if (pkv_prim_thp_mode(NULL, &m) == PKV_OK) ck_assert(m != PKV_PRIM_THP_UNKNOWN);
}
END_TEST

/* smaps of a range: what commit asked for shows as resident; huge pages only where asked
 * (or where the kernel gives them to everything), whole 2 MiB pages. */
START_TEST(prim_measures_huge_pages_of_a_range)
{
    pkv_prim_thp_mode_t mode = PKV_PRIM_THP_UNKNOWN;
    (void)pkv_prim_thp_mode(NULL, &mode);
    const size_t H = PKV_PRIM_HUGE;
    void *p;
    ck_assert_int_eq(pkv_prim_reserve(4 * H, H, &p), PKV_OK);
    pkv_prim_range_pages_t pg;
    ck_assert_int_eq(pkv_prim_range_pages(p, 4 * H, &pg), PKV_OK);
    ck_assert_uint_eq(pg.resident_bytes, 0);
    ck_assert_uint_eq(pg.huge_bytes, 0);
    ck_assert_uint_ge(pg.mappings, 1);
    ck_assert_int_eq(pkv_prim_commit(p, H, false), PKV_OK);
    ck_assert_int_eq(pkv_prim_commit((char *)p + 2 * H, H, true), PKV_OK);
    ck_assert_int_eq(pkv_prim_range_pages(p, 4 * H, &pg), PKV_OK);
    ck_assert_uint_eq(pg.resident_bytes, 2 * H);
    ck_assert_uint_le(pg.huge_bytes, pg.resident_bytes);
    ck_assert_uint_eq(pg.huge_bytes % H, 0);
    if (mode != PKV_PRIM_THP_ALWAYS) ck_assert_uint_le(pg.huge_bytes, H); /* only the asked one */
    if (mode == PKV_PRIM_THP_NEVER) ck_assert_uint_eq(pg.huge_bytes, 0);
    /* The first granule alone: never asked. */
    pkv_prim_range_pages_t first;
    ck_assert_int_eq(pkv_prim_range_pages(p, H, &first), PKV_OK);
    ck_assert_uint_eq(first.resident_bytes, H);
    if (mode != PKV_PRIM_THP_ALWAYS) ck_assert_uint_eq(first.huge_bytes, 0);
    ck_assert_int_eq(pkv_prim_decommit(p, H), PKV_OK);
    ck_assert_int_eq(pkv_prim_decommit((char *)p + 2 * H, H), PKV_OK);
    ck_assert_int_eq(pkv_prim_range_pages(p, 4 * H, &pg), PKV_OK);
    ck_assert_uint_eq(pg.resident_bytes, 0);
    ck_assert_uint_eq(pg.huge_bytes, 0);
    pkv_prim_release(p, 4 * H);
    /* The probe answers and leaves nothing mapped; never a huge page under `never`. */
    bool got = true;
    ck_assert_int_eq(pkv_prim_huge_probe(&got), PKV_OK);
    if (mode == PKV_PRIM_THP_NEVER) ck_assert(!got);
}
END_TEST

/* The median's 95 % interval: order statistics 7 and 18 of 24 (coverage 1 - 2 P(B <= 6)),
 * 1 and 6 of 6, none under 6; the input order does not matter. */
/* The warm floors' size: the largest value of the current window and the one before;
 * a smaller value does not reset it; a life without a note drops it; *change_ns says when. */
START_TEST(recent_max_follows_the_largest_of_one_to_two_windows)
{
    const uint64_t L = 1000, t0 = 5000; /* ns: the arithmetic only */
    pkv_recent_max_t r = {0};
    uint64_t ch;
    ck_assert_uint_eq(pkv_recent_max_get(&r, t0, L, &ch), 0);
    ck_assert_uint_eq(ch, UINT64_MAX);
    pkv_recent_max_note(&r, 30, t0, L); /* window 1 starts at t0 */
    pkv_recent_max_note(&r, 10, t0 + 500, L);
    ck_assert_uint_eq(pkv_recent_max_get(&r, t0 + 999, L, &ch), 30);
    ck_assert_uint_eq(ch, t0 + L);
    ck_assert_uint_eq(pkv_recent_max_get(&r, t0 + 1400, L, &ch), 30); /* no note since */
    ck_assert_uint_eq(ch, t0 + 500 + L);                              /* a life after it */
    pkv_recent_max_note(&r, 5, t0 + 1400, L); /* window 2: 30 is the one before's */
    pkv_recent_max_note(&r, 6, t0 + 1900, L);
    ck_assert_uint_eq(pkv_recent_max_get(&r, t0 + 2399, L, &ch), 30);
    ck_assert_uint_eq(ch, t0 + 1400 + L);
    ck_assert_uint_eq(pkv_recent_max_get(&r, t0 + 2400, L, &ch), 6); /* window 2's own */
    ck_assert_uint_eq(ch, t0 + 1900 + L);
    ck_assert_uint_eq(pkv_recent_max_get(&r, t0 + 2899, L, NULL), 6);
    ck_assert_uint_eq(pkv_recent_max_get(&r, t0 + 2900, L, &ch), 0); /* a life without a note */
    ck_assert_uint_eq(ch, UINT64_MAX);
    pkv_recent_max_note(&r, 9, t0 + 3000, L); /* after the quiet: nothing carried */
    ck_assert_uint_eq(pkv_recent_max_get(&r, t0 + 3000, L, NULL), 9);
    pkv_recent_max_note(&r, 4, t0 + 3900, L);
    pkv_recent_max_note(&r, 3, t0 + 4800, L); /* window 4 begins within a life of a note */
    ck_assert_uint_eq(pkv_recent_max_get(&r, t0 + 4800, L, NULL), 9); /* 9 carried */
    ck_assert_uint_eq(pkv_recent_max_get(&r, t0 + 5799, L, NULL), 9);
    ck_assert_uint_eq(pkv_recent_max_get(&r, t0 + 5800, L, NULL), 0);
    ck_assert_uint_eq(pkv_recent_max_get(&r, t0 + 4800, 0, &ch), 0); /* no life: none */
    ck_assert_uint_eq(ch, UINT64_MAX);
}
END_TEST

START_TEST(bench_median_ci_takes_the_binomial_order_statistics)
{
    double v[24], lo = -1, hi = -1, cover = -1;
    for (int i = 0; i < 24; i++) v[i] = (double)((i * 7) % 24 + 1); /* 1..24, shuffled */
    ck_assert_int_eq(pkv_bench_median_ci(v, 24, &lo, &hi, &cover), 0);
    ck_assert_double_eq(lo, 7);
    ck_assert_double_eq(hi, 18);
    double p = 0, t = 1.0 / (1 << 24); /* P(B <= 6), B ~ Bin(24, 1/2) */
    for (int k = 0; k <= 6; k++) {
        p += t;
        t = t * (24 - k) / (k + 1);
    }
    ck_assert_double_eq_tol(cover, 1 - 2 * p, 1e-12);
    ck_assert(cover >= 0.95 && cover < 0.98);
    ck_assert_int_eq(pkv_bench_median_ci(v, 6, &lo, &hi, &cover), 0); /* 1 8 15 22 5 12 */
    ck_assert_double_eq(lo, 1);
    ck_assert_double_eq(hi, 22);
    ck_assert_double_eq_tol(cover, 1 - 2.0 / 64, 1e-12);
    lo = hi = cover = -7;
    ck_assert_int_eq(pkv_bench_median_ci(v, 5, &lo, &hi, &cover), -1);
    ck_assert(lo == -7 && hi == -7 && cover == -7);
}
END_TEST

static Suite *core_suite(void)
{
    Suite *s = suite_create("core");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, status_names);
    tcase_add_test(tc, deadlines_are_monotonic_and_saturate);
    tcase_add_test(tc, log_sink_and_level);
    tcase_add_test(tc, fault_sites_skip_then_fail_then_pass);
    tcase_add_test(tc, prim_reads_the_load_average);
    tcase_add_test(tc, prim_reads_the_thp_mode);
    tcase_add_test(tc, prim_measures_huge_pages_of_a_range);
    tcase_add_test(tc, bench_median_ci_takes_the_binomial_order_statistics);
    tcase_add_test(tc, recent_max_follows_the_largest_of_one_to_two_windows);
    suite_add_tcase(s, tc);
    return s;
}
PKV_TEST_MAIN(core_suite)
