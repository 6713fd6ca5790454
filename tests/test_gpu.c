/*
 * The GPU part (docs/design/gpu.md): its cases (tests/support/gpu_cases.c) as Check tests.
 * Without a device (any plain build, or no driver) the device cases are reported skipped,
 * never passed; the first case, how a machine without one says so, runs everywhere.
 */
#include "tests/support/gpu_cases.h"
#include "tests/support/testutil.h"

START_TEST(gpu_case)
{
    char why[512] = "";
    int r = gpu_cases[_i].run(why, sizeof(why));
    if (r == GPU_CASE_SKIP) {
        PKV_TEST_SKIP("%s: %s", gpu_cases[_i].name, why);
        return;
    }
    ck_assert_msg(r == GPU_CASE_PASS, "%s: %s", gpu_cases[_i].name, why);
}
END_TEST

static Suite *gpu_suite(void)
{
    Suite *s = suite_create("gpu");
    TCase *tc = tcase_create("gpu");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, gpu_case, 0, (int)gpu_n_cases);
    suite_add_tcase(s, tc);
    return s;
}

PKV_TEST_MAIN(gpu_suite)
