/*
 * `pagekv bench disagg --latency` as a real subprocess on the tiny model: it runs, its
 * tables and --json carry every figure, and bad options run nothing. No timing is asserted
 * (the figures are what the bench is for, not what a test checks).
 */
#include "support/srvtest.h"
#include "support/testutil.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* Run `pagekv bench disagg ARGS`: its exit code, stdout and stderr together in out. */
static int run_bench(const char *args, char *out, size_t cap)
{
    char cmd[4096];
    snprintf(cmd, sizeof(cmd), "bench disagg %s", args);
    return ts_pagekv_run(cmd, out, cap);
}

static double jnum(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    ck_assert_msg(json_is_number(v), "%s: not a number", k);
    return json_number_value(v);
}

/* Two rounds of 64 tokens: exit 0, both issues' tables and the target line; the JSON has
 * the medians and every round, bytes pulled, and fewer blocks pulled with a prefix hit. */
START_TEST(latency_runs_and_reports)
{
    char path[] = "/tmp/pagekv-test-latency-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    char args[256];
    snprintf(args, sizeof(args), "--latency --runs 2 --sizes 64 --preset tiny --json %s", path);
    static char out[1 << 16];
    int rc = run_bench(args, out, sizeof(out));
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, out);
    static const char *const lines[] = {"### issue 22: the decode leg minus", "| 64 | ",
                                        "### issue 22: bytes moved", "### issue 27: TTFT",
                                        "target (issue 27): added TTFT <= the KV's wire time"};
    for (size_t i = 0; i < sizeof(lines) / sizeof(lines[0]); i++)
        ck_assert_msg(strstr(out, lines[i]), "no '%s' in\n%s", lines[i], out);
    json_error_t je;
    json_t *doc = json_load_file(path, 0, &je);
    unlink(path);
    ck_assert_msg(doc, "--json: %s", je.text);
    ck_assert_str_eq(json_string_value(json_object_get(doc, "mode")), "latency");
    json_t *sz = json_array_get(json_object_get(doc, "sizes"), 0);
    ck_assert_int_eq((int)jnum(sz, "size"), 64);
    ck_assert_int_eq((int)jnum(sz, "runs"), 2);
    ck_assert_int_eq((int)json_array_size(json_object_get(sz, "rounds")), 2);
    json_t *a = json_object_get(sz, "issue22"), *b = json_object_get(sz, "issue27");
    ck_assert(jnum(a, "bytes_pulled") > 0);
    ck_assert(jnum(a, "blocks_pulled") > jnum(a, "prefix_hit_blocks_pulled"));
    ck_assert(jnum(a, "prefix_hit_blocks_adopted") > 0);
    ck_assert(jnum(b, "bytes_received") > 0);
    ck_assert(jnum(b, "wire_ms") >= 0 && jnum(b, "router_ttft_ms") > 0);
    ck_assert(json_is_boolean(json_object_get(b, "target_met")));
    json_decref(doc);
}
END_TEST

START_TEST(latency_bad_options_exit_2)
{
    static const char *const bad[] = {"--latency --runs 0", "--latency --sizes 8",
                                      "--latency --sizes 64,x", "--latency --bogus 1",
                                      "--latency --runs"};
    static char out[1 << 14];
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc = run_bench(bad[i], out, sizeof(out));
        ck_assert_msg(rc == 2, "%s: exit %d\n%s", bad[i], rc, out);
        ck_assert_msg(strstr(out, "bench disagg --latency: "), "%s: %s", bad[i], out);
    }
    ck_assert_int_eq(run_bench("--latency --help", out, sizeof(out)), 0);
    ck_assert_ptr_nonnull(strstr(out, "usage: pagekv bench disagg --latency"));
}
END_TEST

static Suite *bench_disagg_suite(void)
{
    Suite *s = suite_create("bench_disagg");
    TCase *lat = tcase_create("latency");
    tcase_set_timeout(lat, 60);
    tcase_add_test(lat, latency_runs_and_reports);
    tcase_add_test(lat, latency_bad_options_exit_2);
    suite_add_tcase(s, lat);
    return s;
}

PKV_TEST_MAIN(bench_disagg_suite)
