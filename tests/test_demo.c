/*
 * `pagekv demo` (what `make demo` runs) as a real subprocess: a prefill node, a decode
 * node, the router and a unified node, each a process. Its exit code and report, bad
 * options, and that an interrupted demo leaves no process behind.
 */
#include "tests/support/srvtest.h"
#include "tests/support/testutil.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Run `pagekv demo ARGS`: its exit code, stdout and stderr together in out. */
static int run_demo(const char *args, char *out, size_t cap)
{
    char cmd[4096];
    snprintf(cmd, sizeof(cmd), "demo %s", args);
    return ts_pagekv_run(cmd, out, cap);
}

/* The pids the demo printed for its processes ("NAME pid N"). */
static int demo_pids(const char *out, pid_t *pids, int cap)
{
    int n = 0;
    for (const char *p = out; n < cap && (p = strstr(p, " pid ")); p += 5) pids[n++] = atoi(p + 5);
    return n;
}

static bool gone(pid_t pid)
{
    for (int i = 0; i < 200; i++) {
        if (kill(pid, 0) != 0 && errno == ESRCH) return true;
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    return false;
}

/* The demo on the tiny model: exit 0, every answer identical, the accounting held, the
 * restarted unified node served the returning prompt from disk, every process exited 0
 * and is gone. Per-transfer staging through UCX on one host, then fixed
 * staging with the shared arena and UCX over TCP. */
START_TEST(demo_runs_as_processes)
{
    static const char *const args[] = {"", "--staging fixed --staging-shared --tcp"};
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "--preset tiny --max-tokens 12 %s", args[_i]);
    static char out[1 << 16];
    int rc = run_demo(cmd, out, sizeof(out));
    ck_assert_msg(rc == 0, "pagekv demo %s: exit %d\n%s", cmd, rc, out);
    static const char *const lines[] = {"  unified  pid ",
                                        "  prefill  pid ",
                                        "  decode   pid ",
                                        "  router   pid ",
                                        "transfer agent 127.0.0.1:",
                                        "answers identical to the unified node's",
                                        "every lease sent and nothing held",
                                        "every process exited 0",
                                        "prompt tokens served from disk",
                                        "a returning prompt served from disk",
                                        "  result   ok: 5/5"};
    ts_has_lines(out, lines, sizeof(lines) / sizeof(lines[0]));
    ck_assert_msg(!strstr(out, "DIFFERENT") && !strstr(out, "FAILED"), "%s", out);
    pid_t pids[8]; /* the four processes, and the unified node restarted on its disk tier */
    ck_assert_int_eq(demo_pids(out, pids, 8), 5);
    for (int i = 0; i < 5; i++) ck_assert_msg(gone(pids[i]), "pid %d still there", (int)pids[i]);
}
END_TEST

/* Bad options run nothing: exit 2 with the flag named, no process started. */
START_TEST(demo_bad_options_run_nothing)
{
    static char out[1 << 14];
    ck_assert_int_eq(run_demo("--max-tokens 0", out, sizeof(out)), 2);
    ck_assert_ptr_nonnull(strstr(out, "--max-tokens"));
    ck_assert_int_eq(run_demo("--staging mirror", out, sizeof(out)), 2);
    ck_assert_ptr_nonnull(strstr(out, "--staging"));
    ck_assert_int_eq(run_demo("--no-such-flag", out, sizeof(out)), 2);
    ck_assert_ptr_null(strstr(out, " pid "));
    /* a preset no node knows: the first node does not start, nothing is left running */
    ck_assert_int_eq(run_demo("--preset no-such-model", out, sizeof(out)), 2);
    ck_assert_ptr_nonnull(strstr(out, "no-such-model"));
    ck_assert_ptr_null(strstr(out, "result"));
}
END_TEST

/* SIGINT while a request waits on the router: exit 130 and every process it started is
 * gone. The router is stopped (SIGSTOP) once it is up, so the first request hangs until
 * the interrupt; the demo stops a stopped child too. */
START_TEST(demo_interrupted_stops_everything)
{
    char log[] = "/tmp/pkv-demo-int-XXXXXX";
    pid_t pid = ts_pagekv_spawn("demo --preset tiny", log);
    static char out[1 << 16];
    const char *r = NULL;
    for (int i = 0; i < 3000 && !r; i++) {
        ts_read_file(log, out, sizeof(out));
        r = strstr(out, "  router   pid ");
        if (!r) {
            struct timespec ts = {0, 2000000};
            nanosleep(&ts, NULL);
        }
    }
    ck_assert_msg(r, "%s", out);
    kill(atoi(r + 15), SIGSTOP);
    for (int i = 0; i < 1000 && !strstr(out, "requests through the router"); i++) {
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
        ts_read_file(log, out, sizeof(out));
    }
    /* The demo's request is on its way to the stopped router: a connection to its port. */
    const char *port = strstr(r, "http://");
    port = port ? strchr(port + 7, ':') : NULL;
    ck_assert_ptr_nonnull(port);
    for (int i = 0; i < 5000 && !pkv_test_tcp_conns(atoi(r + 15), (uint16_t)atoi(port + 1), NULL);
         i++) {
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGINT);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ts_read_file(log, out, sizeof(out));
    unlink(log);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 130, "status %d:\n%s", st, out);
    ck_assert_ptr_nonnull(strstr(out, "interrupted"));
    pid_t pids[8];
    ck_assert_int_eq(demo_pids(out, pids, 8), 4);
    for (int i = 0; i < 4; i++) ck_assert_msg(gone(pids[i]), "pid %d still there", (int)pids[i]);
}
END_TEST

static Suite *demo_suite(void)
{
    Suite *s = suite_create("demo");
    TCase *run = tcase_create("run");
    tcase_set_timeout(run, 120);
    tcase_add_loop_test(run, demo_runs_as_processes, 0, 2);
    tcase_add_test(run, demo_bad_options_run_nothing);
    tcase_add_test(run, demo_interrupted_stops_everything);
    suite_add_tcase(s, run);
    return s;
}

PKV_TEST_MAIN(demo_suite)
