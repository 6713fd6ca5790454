/*
 * `pagekv bench tiers` as a real subprocess on the tiny model, a few seconds end to end: the
 * report and its targets, the JSON's schema (arms, rounds, restart_round, the tile object,
 * one target entry per target), every answer identical to the reference's, the restarted
 * server serving its first round from disk, the temporary directory gone; bad options run
 * nothing (exit 2 with the reason); `pagekv bench` lists it. No timing is asserted.
 */
#include "tests/support/srvtest.h"
#include "tests/support/testutil.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int run_bench(const char *args, char *out, size_t cap)
{
    char cmd[4096];
    snprintf(cmd, sizeof(cmd), "bench tiers %s", args);
    return ts_pagekv_run(cmd, out, cap);
}

/* One round's keys, and its figures consistent. */
static void check_round(json_t *rd, int round, int users)
{
    ck_assert_int_eq((int)ts_jnum(rd, "round"), round);
    ck_assert_int_eq((int)ts_jnum(rd, "requests"), users);
    static const char *const keys[] = {"ttft_p50_ms",        "ttft_max_ms",  "cached_tokens_memory",
                                       "cached_tokens_disk", "loaded_bytes", "rss_peak_bytes",
                                       "disk_bytes_peak"};
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
        ck_assert(ts_jnum(rd, keys[i]) >= 0);
    ck_assert(ts_jnum(rd, "ttft_max_ms") >= ts_jnum(rd, "ttft_p50_ms"));
    ck_assert(ts_jnum(rd, "ttft_p50_ms") > 0);
    json_t *d = json_object_get(rd, "load_decisions");
    ck_assert(ts_jnum(d, "load") >= 0 && ts_jnum(d, "recompute") >= 0);
}

/* A workload's object: its three arms in order, each answer identical, restart_round. */
static void check_part(json_t *p, int users, int rounds)
{
    static const char *const names[] = {"recompute", "disk", "restart"};
    json_t *arms = json_object_get(p, "arms");
    ck_assert_int_eq((int)json_array_size(arms), 3);
    ck_assert_int_eq((int)ts_jnum(p, "restart_round"), rounds / 2 + 1);
    for (int k = 0; k < 3; k++) {
        json_t *a = json_array_get(arms, (size_t)k);
        ck_assert_str_eq(json_string_value(json_object_get(a, "name")), names[k]);
        ck_assert_int_eq((int)ts_jnum(a, "requests"), users * rounds);
        ck_assert_int_eq((int)ts_jnum(a, "identical"), users * rounds);
        ck_assert(ts_jnum(a, "rss_peak_bytes") > 0);
        ck_assert_int_eq((int)ts_jnum(a, "corrupt"), 0);
        ck_assert(ts_jnum(a, "disk_bytes_peak") <= ts_jnum(a, "disk_bytes_cap"));
        ck_assert(k == 0 ? ts_jnum(a, "disk_bytes_cap") == 0 : ts_jnum(a, "disk_bytes_peak") > 0);
        json_t *rs = json_object_get(a, "rounds");
        ck_assert_int_eq((int)json_array_size(rs), rounds);
        for (int r = 0; r < rounds; r++) check_round(json_array_get(rs, (size_t)r), r + 1, users);
    }
    /* the restarted server's memory is empty: its first round comes from disk */
    json_t *rr =
        json_array_get(json_object_get(json_array_get(arms, 2), "rounds"), (size_t)(rounds / 2));
    ck_assert(ts_jnum(rr, "cached_tokens_disk") > 0 && ts_jnum(rr, "loaded_bytes") > 0);
    json_t *ref = json_object_get(p, "reference");
    ck_assert_int_eq((int)ts_jnum(ref, "identical"), users * rounds);
}

static void check_targets(json_t *t)
{
    ck_assert_int_eq((int)json_array_size(t), 7);
    for (size_t i = 0; i < 7; i++) {
        json_t *x = json_array_get(t, i);
        ck_assert(json_is_string(json_object_get(x, "name")));
        ck_assert(json_is_string(json_object_get(x, "target")));
        json_t *v = json_object_get(x, "value"), *m = json_object_get(x, "met");
        ck_assert(json_is_number(v) || json_is_null(v));
        ck_assert(json_is_boolean(m));
    }
    /* every answer identical; bytes under the cap; no corruption, no load past its deadline */
    static const size_t always[] = {2, 3, 5, 6};
    for (size_t i = 0; i < 4; i++)
        ck_assert_msg(json_is_true(json_object_get(json_array_get(t, always[i]), "met")),
                      "target %zu not met", always[i]);
}

START_TEST(tiny_runs_and_reports)
{
    char path[] = "/tmp/pagekv-test-tiers-XXXXXX", svg[64];
    pkv_test_tmpfile(path);
    snprintf(svg, sizeof(svg), "%s.svg", path);
    char args[512];
    snprintf(args, sizeof(args),
             "--preset tiny --users 2 --rounds 3 --system-tokens 64 --history-tokens 96 "
             "--question-tokens 16 --docs 2 --doc-tokens 128 --json %s --svg %s",
             path, svg);
    static char out[1 << 17];
    int rc = run_bench(args, out, sizeof(out));
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, ts_tail(out));
    static const char *const lines[] = {"### multiround (2 users x 3 rounds; restart_round 2)",
                                        "### tile (2 documents x 2 rounds; restart_round 2)",
                                        "| restart | 2 (restart) |", "### targets",
                                        "bitwise equal to the reference pass's: met"};
    ts_has_lines(out, lines, sizeof(lines) / sizeof(lines[0]));
    json_t *doc = ts_json_take(path);
    check_part(doc, 2, 3);
    check_part(json_object_get(doc, "tile"), 2, 2);
    check_targets(json_object_get(doc, "targets"));
    json_decref(doc);
    char text[256];
    ts_read_file(svg, text, sizeof(text));
    unlink(svg);
    ck_assert_msg(!strncmp(text, "<?xml", 5), "svg: %s", text);
    const char *dir = strstr(out, "temporary directory ");
    ck_assert_ptr_nonnull(dir);
    char d[128];
    ck_assert_int_eq(sscanf(dir + 20, "%127s", d), 1);
    struct stat st;
    ck_assert_msg(stat(d, &st) != 0, "%s left behind", d);
}
END_TEST

START_TEST(bad_options_exit_2)
{
    static const char *const bad[][2] = {
        {"--users 0", "--users"},
        {"--rounds 1", "--rounds"},
        {"--out-tokens 32-16", "--out-tokens"},
        {"--kv-disk-bytes 1K", "--kv-disk-bytes"},
        {"--preset nope", "unknown preset"},
        {"--preset tiny --docs 0 --kv-budget 64K", "holds less than the longest request"},
        {"--preset tiny --doc-tokens 30000", "does not fit"},
        {"--bogus 1", "unknown option"},
        {"--users", "missing value"},
    };
    static char out[1 << 14];
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc = run_bench(bad[i][0], out, sizeof(out));
        ck_assert_msg(rc == 2, "%s: exit %d\n%s", bad[i][0], rc, ts_tail(out));
        ck_assert_msg(strstr(out, "pagekv bench tiers: ") && strstr(out, bad[i][1]), "%s: %s",
                      bad[i][0], ts_tail(out));
        ck_assert_msg(!strstr(out, "starting"), "%s ran: %s", bad[i][0], ts_tail(out));
    }
    ck_assert_int_eq(run_bench("--help", out, sizeof(out)), 0);
    ck_assert_ptr_nonnull(strstr(out, "usage: pagekv bench tiers"));
    ts_pagekv_run("bench", out, sizeof(out));
    ck_assert_msg(strstr(out, "  tiers "), "`pagekv bench` does not list tiers:\n%s", out);
}
END_TEST

static Suite *bench_tiers_suite(void)
{
    Suite *s = suite_create("bench_tiers");
    TCase *tc = tcase_create("tiny");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, tiny_runs_and_reports);
    tcase_add_test(tc, bad_options_exit_2);
    suite_add_tcase(s, tc);
    return s;
}

PKV_TEST_MAIN(bench_tiers_suite)
