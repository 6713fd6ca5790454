/*
 * `pagekv bench kvquant` as a real subprocess on the tiny model, one layer, one short context,
 * error part only (the decode part runs llama-3.2-1b up to 16k tokens: a benchmark, not a
 * test): the report's table and targets, the JSON's schema (cases for bf16, int8 and fp8 in
 * the three variants, targets), the bf16 rows being the floor (multiple 1, KL 0), int8's error
 * above that floor and below fp8's; bad options run nothing (exit 2 with the reason);
 * `pagekv bench` lists it. No timing is asserted.
 */
#include "tests/support/srvtest.h"
#include "tests/support/testutil.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int run_bench(const char *args, char *out, size_t cap)
{
    char cmd[4096];
    snprintf(cmd, sizeof(cmd), "bench kvquant %s", args);
    return ts_pagekv_run(cmd, out, cap);
}

static json_t *find_case(json_t *cases, const char *dtype, const char *variant)
{
    for (size_t i = 0; i < json_array_size(cases); i++) {
        json_t *c = json_array_get(cases, i);
        if (!strcmp(json_string_value(json_object_get(c, "dtype")), dtype) &&
            !strcmp(json_string_value(json_object_get(c, "variant")), variant))
            return c;
    }
    ck_abort_msg("no case %s/%s", dtype, variant);
    return NULL;
}

START_TEST(tiny_error_part)
{
    char path[] = "/tmp/pagekv-test-kvquant-XXXXXX";
    pkv_test_tmpfile(path);
    char args[256];
    snprintf(args, sizeof(args),
             "--preset tiny --layers 1 --contexts 64 --steps 8 --probe-rows 4 --no-decode "
             "--json %s",
             path);
    static char out[1 << 16];
    int rc = run_bench(args, out, sizeof(out));
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, ts_tail(out));
    static const char *const lines[] = {"# pagekv bench kvquant", "CPU: ",
                                        "## Error against a bf16 KV cache (tiny, 1 layers, 8 "
                                        "teacher-forced steps)",
                                        "| int8_kl_mean | "};
    ts_has_lines(out, lines, sizeof(lines) / sizeof(lines[0]));
    ck_assert_msg(!strstr(out, "## Decode"), "--no-decode ran the decode part");
    json_t *doc = ts_json_take(path);
    ck_assert_str_eq(json_string_value(json_object_get(doc, "preset")), "tiny");
    json_t *cases = json_object_get(doc, "cases");
    ck_assert_int_eq((int)json_array_size(cases), 9);
    static const char *const variants[] = {"flat", "outliers", "sharp"};
    static const char *const keys[] = {"attn_rel_err", "floor_multiple", "kl_mean", "kl_p99",
                                       "top1_agree"};
    for (size_t v = 0; v < 3; v++) {
        json_t *b = find_case(cases, "bf16", variants[v]);
        json_t *i8 = find_case(cases, "int8", variants[v]);
        json_t *f8 = find_case(cases, "fp8", variants[v]);
        json_t *all[] = {b, i8, f8};
        for (size_t k = 0; k < 3; k++) {
            ck_assert_int_eq((int)ts_jnum(all[k], "context"), 64);
            for (size_t j = 0; j < sizeof(keys) / sizeof(keys[0]); j++)
                ck_assert(ts_jnum(all[k], keys[j]) >= 0);
            ck_assert(ts_jnum(all[k], "top1_agree") <= 1);
        }
        /* bf16 is the floor: its own multiple, no divergence from itself */
        ck_assert(ts_jnum(b, "floor_multiple") == 1.0 && ts_jnum(b, "kl_mean") == 0.0);
        ck_assert(ts_jnum(b, "attn_rel_err") > 0);
        /* 8 bits lose more than 16; e4m3's 3 mantissa bits more than int8's 7 */
        ck_assert_msg(ts_jnum(i8, "attn_rel_err") > ts_jnum(b, "attn_rel_err") &&
                          ts_jnum(f8, "attn_rel_err") > ts_jnum(i8, "attn_rel_err"),
                      "%s: bf16 %g int8 %g fp8 %g", variants[v], ts_jnum(b, "attn_rel_err"),
                      ts_jnum(i8, "attn_rel_err"), ts_jnum(f8, "attn_rel_err"));
        ck_assert(ts_jnum(i8, "kl_mean") > 0 && ts_jnum(f8, "kl_mean") > ts_jnum(i8, "kl_mean"));
    }
    json_t *t = json_object_get(doc, "targets");
    ck_assert_int_eq((int)json_array_size(t), 5);
    for (size_t i = 0; i < 5; i++) {
        json_t *x = json_array_get(t, i);
        ck_assert(json_is_string(json_object_get(x, "name")));
        ck_assert(json_is_number(json_object_get(x, "value")));
        ck_assert(json_is_number(json_object_get(x, "target")));
        ck_assert(json_is_boolean(json_object_get(x, "met")));
    }
    ck_assert_ptr_null(json_object_get(doc, "decode"));
    json_decref(doc);
}
END_TEST

START_TEST(bad_options_exit_2)
{
    static const char *const bad[][2] = {
        {"--preset nope", "unknown preset"},    {"--layers 0", "--layers"},
        {"--contexts 8", "--contexts"},         {"--contexts 64,x", "--contexts"},
        {"--decode-pairs 0", "--decode-pairs"}, {"--decode-steps 5000", "--decode-steps"},
        {"--bogus 1", "unknown flag"},          {"--steps", "missing value"},
    };
    static char out[1 << 14];
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc = run_bench(bad[i][0], out, sizeof(out));
        ck_assert_msg(rc == 2, "%s: exit %d\n%s", bad[i][0], rc, ts_tail(out));
        ck_assert_msg(strstr(out, "bench kvquant") && strstr(out, bad[i][1]), "%s: %s", bad[i][0],
                      ts_tail(out));
        ck_assert_msg(!strstr(out, "## Error"), "%s ran: %s", bad[i][0], ts_tail(out));
    }
    ck_assert_int_eq(run_bench("--help", out, sizeof(out)), 0);
    ck_assert_ptr_nonnull(strstr(out, "usage: pagekv bench kvquant"));
    ts_pagekv_run("bench", out, sizeof(out));
    ck_assert_msg(strstr(out, "  kvquant "), "`pagekv bench` does not list kvquant:\n%s", out);
}
END_TEST

static Suite *bench_kvquant_suite(void)
{
    Suite *s = suite_create("bench_kvquant");
    TCase *tc = tcase_create("tiny");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, tiny_error_part);
    tcase_add_test(tc, bad_options_exit_2);
    suite_add_tcase(s, tc);
    return s;
}

PKV_TEST_MAIN(bench_kvquant_suite)
