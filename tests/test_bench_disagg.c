/*
 * `pagekv bench disagg` as a real subprocess on the tiny model: `--latency` runs, its
 * tables and --json carry every figure, and bad options run nothing; `--interference
 * --quick` runs both arms with every compared answer identical, and bad options run
 * nothing; the load mode's `--quick --tcp` runs two designs with the nodes in two network
 * namespaces (skipped with the reason where they cannot be made), reports the planner
 * check, the in-flight peaks and the paced drift with and without staging, and leaves no
 * namespace behind, SIGINT included. No timing is asserted (the figures are what the bench is for,
 * not what a test checks).
 */
#include "tests/support/srvtest.h"
#include "tests/support/testutil.h"

#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* Run `pagekv bench disagg ARGS`: its exit code, stdout and stderr together in out. */
static int run_bench(const char *args, char *out, size_t cap)
{
    char cmd[4096];
    snprintf(cmd, sizeof(cmd), "bench disagg %s", args);
    return ts_pagekv_run(cmd, out, cap);
}

/* Two rounds of 64 tokens and one after-quiet pair: exit 0, every measure's table and the
 * target line; the JSON has the medians and every round, bytes pulled, fewer blocks pulled
 * with a prefix hit, and the after-quiet pair's figures. */
START_TEST(latency_runs_and_reports)
{
    char path[] = "/tmp/pagekv-test-latency-XXXXXX";
    pkv_test_tmpfile(path);
    char args[256];
    snprintf(args, sizeof(args),
             "--latency --runs 2 --sizes 64 --preset tiny --quiet-pairs 1 --json %s", path);
    static char out[1 << 16];
    int rc = run_bench(args, out, sizeof(out));
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, ts_tail(out));
    static const char *const lines[] = {"### decode leg: the decode leg minus",
                                        "| 64 | ",
                                        "### decode leg on its node: each moment",
                                        "### decode leg: bytes moved",
                                        "### routed TTFT: TTFT",
                                        "### streaming the KV during the prefill",
                                        "### after a quiet spell: the first routed request",
                                        "target (routed TTFT): added TTFT <= the KV's wire time"};
    ts_has_lines(out, lines, sizeof(lines) / sizeof(lines[0]));
    json_t *doc = ts_json_take(path);
    ck_assert_str_eq(json_string_value(json_object_get(doc, "mode")), "latency");
    ck_assert(json_is_string(json_object_get(doc, "cpu_model")));
    json_t *sz = json_array_get(json_object_get(doc, "sizes"), 0);
    ck_assert_int_eq((int)ts_jnum(sz, "tokens"), 64);
    ck_assert_int_eq((int)ts_jnum(sz, "runs"), 2);
    ck_assert_int_eq((int)json_array_size(json_object_get(sz, "rounds")), 2);
    json_t *a = json_object_get(sz, "decode_leg"), *b = json_object_get(sz, "phases");
    ck_assert(ts_jnum(a, "bytes_pulled") > 0);
    ck_assert(ts_jnum(a, "blocks_pulled") > ts_jnum(a, "prefix_hit_blocks_pulled"));
    ck_assert(ts_jnum(a, "prefix_hit_blocks_adopted") > 0);
    ck_assert(ts_jnum(a, "kv_alloc_ms") >= 0 && ts_jnum(a, "kv_commit_ms") >= 0);
    /* the moments on the node: the pull takes time; none is missing or negative (but the
     * first write, which a stream that ends within its first output does not report) */
    ck_assert(ts_jnum(a, "node_pull_end_ms") > 0 && ts_jnum(a, "node_admitted_ms") >= 0);
    ck_assert(ts_jnum(a, "node_pull_asked_ms") >= 0 && ts_jnum(a, "node_seen_ms") >= 0);
    ck_assert(ts_jnum(a, "node_arrival_ms") >= 0);
    ck_assert(ts_jnum(b, "bytes_received") > 0);
    ck_assert(ts_jnum(b, "router_ttft_ms") > 0 && ts_jnum(b, "kv_alloc_ms") >= 0);
    ck_assert(ts_jnum(b, "kv_commit_ms") >= 0 && ts_jnum(b, "handshake_ms") >= 0);
    /* the unified node's own admission and prefill, from its X-Pagekv-Timings */
    ck_assert(ts_jnum(b, "unified_queue_ms") >= 0 && ts_jnum(b, "unified_compute_ms") > 0);
    ck_assert(ts_jnum(sz, "wire_ms") >= 0);
    /* step 5: both prefills timed, the pull beside one of them measured (a small read's
     * payload can land in one message: its wire phase may be 0), the lone decode leg's
     * TTFB and the CPU it took on the decode node */
    json_t *st = json_object_get(sz, "streaming");
    ck_assert(ts_jnum(st, "prefill_alone_ms") > 0 && ts_jnum(st, "prefill_with_pull_ms") > 0);
    ck_assert(ts_jnum(st, "wire_beside_prefill_ms") >= 0);
    ck_assert(ts_jnum(st, "leg_ttfb_ms") > 0 && ts_jnum(st, "leg_cpu_decode_node_ms") > 0);
    ck_assert(json_is_number(json_object_get(st, "saving_bound_ms")));
    ck_assert(json_is_object(
        json_object_get(json_array_get(json_object_get(sz, "rounds"), 0), "streaming")));
    ck_assert(json_is_number(json_object_get(sz, "added_ms")));
    /* added with the two prefills' compute taken out, per round */
    json_t *r0 = json_object_get(json_array_get(json_object_get(sz, "rounds"), 0), "routed_ttft");
    double same = (ts_jnum(r0, "router_ttft_ms") - ts_jnum(r0, "prefill_compute_ms")) -
                  (ts_jnum(r0, "unified_ttft_ms") - ts_jnum(r0, "unified_compute_ms"));
    ck_assert(fabs(ts_jnum(r0, "added_same_compute_ms") - same) < 1e-6);
    ck_assert(json_is_number(json_object_get(b, "added_same_compute_ms")));
    /* step 6: the serving nodes' 5 s staging idle period + 2 s, one pair, both measured */
    json_t *q = json_object_get(sz, "after_quiet");
    ck_assert_int_eq((int)ts_jnum(q, "quiet_ms"), 7000);
    ck_assert_int_eq((int)ts_jnum(q, "pairs"), 1);
    ck_assert(ts_jnum(json_object_get(q, "after_quiet"), "router_ttft_ms") > 0);
    ck_assert(ts_jnum(json_object_get(q, "after_gap"), "router_ttft_ms") > 0);
    ck_assert(ts_jnum(json_object_get(q, "after_quiet"), "wire_ms") >= 0);
    json_t *t = json_array_get(json_object_get(doc, "targets"), 0);
    ck_assert_str_eq(json_string_value(json_object_get(t, "name")), "added_ttft_64_tokens_ms");
    ck_assert(ts_jnum(t, "value") == ts_jnum(sz, "added_ms"));
    ck_assert(ts_jnum(t, "target") == ts_jnum(sz, "wire_ms") + 5.0);
    ck_assert(json_is_boolean(json_object_get(t, "met")));
    json_decref(doc);
}
END_TEST

/* Each of bad[0..n) (options of `mode`) exits 2 with "bench disagg MODE: " and the
 * reason, running nothing; `MODE --help` exits 0 with the usage. */
static void bad_options_exit_2(const char *mode, const char *const *bad, size_t n)
{
    static char out[1 << 14];
    char args[256], prefix[64];
    snprintf(prefix, sizeof(prefix), "bench disagg %s: ", mode);
    for (size_t i = 0; i < n; i++) {
        snprintf(args, sizeof(args), "%s %s", mode, bad[i]);
        int rc = run_bench(args, out, sizeof(out));
        ck_assert_msg(rc == 2, "%s: exit %d\n%s", args, rc, ts_tail(out));
        ck_assert_msg(strstr(out, prefix), "%s: %s", args, ts_tail(out));
    }
    snprintf(args, sizeof(args), "%s --help", mode);
    ck_assert_int_eq(run_bench(args, out, sizeof(out)), 0);
    snprintf(prefix, sizeof(prefix), "usage: pagekv bench disagg %s", mode);
    ck_assert_ptr_nonnull(strstr(out, prefix));
}

START_TEST(latency_bad_options_exit_2)
{
    static const char *const bad[] = {"--runs 0",          "--sizes 8", "--sizes 64,x",
                                      "--quiet-pairs 101", "--bogus 1", "--runs"};
    bad_options_exit_2("--latency", bad, sizeof(bad) / sizeof(bad[0]));
}
END_TEST

/* --interference --quick on tiny: exit 0, the table with both arms and the CPU, the
 * targets; the JSON's arms [{name, tpot_p50_ms, tpot_p99_ms, ttft_p50_ms, ttft_p99_ms,
 * goodput_rps, requests, identical}] with every compared answer identical, and its targets
 * [{name, value, target, met}]. No figure is checked against a bound. */
START_TEST(interference_runs_and_reports)
{
    char path[] = "/tmp/pagekv-test-interference-XXXXXX";
    pkv_test_tmpfile(path);
    char args[256];
    snprintf(args, sizeof(args), "--interference --quick --threads 2 --preset tiny --json %s",
             path);
    static char out[1 << 16];
    int rc = run_bench(args, out, sizeof(out));
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, ts_tail(out));
    static const char *const lines[] = {"CPU: ",
                                        "| arm | model threads | prefill chunk |",
                                        "| unified | 2 | 256 |",
                                        "| disaggregated | 1 + 1 |",
                                        "disaggregated tpot p99 / unified",
                                        "identical answers"};
    ts_has_lines(out, lines, sizeof(lines) / sizeof(lines[0]));
    json_t *doc = ts_json_take(path);
    ck_assert_str_eq(json_string_value(json_object_get(doc, "mode")), "interference");
    ck_assert(json_is_string(json_object_get(doc, "cpu_model")));
    json_t *arms = json_object_get(doc, "arms");
    ck_assert_int_eq((int)json_array_size(arms), 2);
    static const char *const names[] = {"unified", "disaggregated"};
    static const char *const figs[] = {"tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms",
                                       "goodput_rps"};
    for (size_t k = 0; k < 2; k++) {
        json_t *a = json_array_get(arms, k);
        ck_assert_str_eq(json_string_value(json_object_get(a, "name")), names[k]);
        for (size_t f = 0; f < sizeof(figs) / sizeof(figs[0]); f++)
            ck_assert_msg(ts_jnum(a, figs[f]) >= 0, "%s %s", names[k], figs[f]);
        json_t *n = json_object_get(a, "requests"), *same = json_object_get(a, "identical");
        ck_assert(json_is_integer(n) && json_is_integer(same));
        ck_assert_int_gt((int)json_integer_value(n), 4); /* the 4 long prompts and streams */
        ck_assert_int_eq((int)json_integer_value(same), (int)json_integer_value(n));
    }
    json_t *t = json_object_get(doc, "targets");
    ck_assert_int_eq((int)json_array_size(t), 2);
    for (size_t k = 0; k < 2; k++) {
        json_t *x = json_array_get(t, k);
        ck_assert(json_is_string(json_object_get(x, "name")));
        ck_assert(json_is_number(json_object_get(x, "value")));
        ck_assert(json_is_number(json_object_get(x, "target")));
        ck_assert(json_is_boolean(json_object_get(x, "met")));
    }
    ck_assert(json_is_true(json_object_get(json_array_get(t, 1), "met")));
    json_decref(doc);
}
END_TEST

START_TEST(interference_bad_options_exit_2)
{
    static const char *const bad[] = {"--streams 0",
                                      "--prompt-rate 0",
                                      "--prompt-rate x",
                                      "--prompt-tokens 4096-2048",
                                      "--prefill-chunk 64,0",
                                      "--threads 1",
                                      "--duration -1",
                                      "--bogus 1",
                                      "--duration"};
    bad_options_exit_2("--interference", bad, sizeof(bad) / sizeof(bad[0]));
}
END_TEST

/* The namespace named after `key` in the bench's output ("prefill in NAME (HTTP"), "" if
 * none; true when /var/run/netns/NAME exists. */
static bool netns_left(const char *out, const char *key, char *name, size_t cap)
{
    const char *p = strstr(out, key);
    name[0] = '\0';
    if (!p) return false;
    p += strlen(key);
    size_t n = strcspn(p, " ");
    snprintf(name, cap, "%.*s", (int)n, p);
    char path[128];
    snprintf(path, sizeof(path), "/var/run/netns/%s", name);
    struct stat st;
    return stat(path, &st) == 0;
}

/* The sanitizers' mlock interceptor (sanitizer_common, ASan and TSan alike) returns 0 and
 * locks nothing: VmLck stays 0 under them. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define PKV_MLOCK_IS_REAL 0
#else
#define PKV_MLOCK_IS_REAL 1
#endif

static const char *const quick_tcp_args =
    "--quick --tcp --preset tiny --designs fixed,per_transfer --paced-transfers 24 "
    "--paced-rps 20";

/* Prefill and decode in two namespaces over tcp: exit 0, parity, every new figure in the
 * table and the JSON, the planner's rows, and both namespaces gone at the end. */
START_TEST(quick_tcp_runs_and_cleans_up)
{
    char path[] = "/tmp/pagekv-test-disagg-XXXXXX";
    pkv_test_tmpfile(path);
    char args[512];
    snprintf(args, sizeof(args), "%s --json %s", quick_tcp_args, path);
    static char out[1 << 18];
    int rc = run_bench(args, out, sizeof(out));
    if (rc == 2 && strstr(out, "cannot make the network namespaces")) {
        PKV_TEST_SKIP("%s", strstr(out, "cannot make"));
        unlink(path);
        return;
    }
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, ts_tail(out));
    char a[64], b[64];
    ck_assert_msg(!netns_left(out, "prefill in ", a, sizeof(a)) && a[0], "%s left: %s", a,
                  ts_tail(out));
    ck_assert_msg(!netns_left(out, "decode in ", b, sizeof(b)) && b[0], "%s left", b);
    static const char *const lines[] = {"planner vs measured",
                                        "| fixed | decode | run | fixed |",
                                        "| per_transfer | decode | paced | per_transfer_tail |",
                                        "| per_transfer | decode | run | per_transfer_mean |",
                                        "RSS - staging drift",
                                        "transfers in flight, peak"};
    ts_has_lines(out, lines, sizeof(lines) / sizeof(lines[0]));
    json_t *doc = ts_json_take(path);
    json_t *ds = json_object_get(doc, "designs");
    ck_assert_int_eq((int)json_array_size(ds), 2);
    for (size_t i = 0; i < 2; i++) {
        json_t *d = json_array_get(ds, i);
        json_t *par = json_object_get(d, "parity");
        ck_assert_int_eq((int)ts_jnum(par, "requests"), 8); /* --quick: 4 before, 4 after */
        ck_assert_int_eq((int)ts_jnum(par, "identical"), 8);
        json_t *fly = json_object_get(d, "inflight_transfers_peak");
        ck_assert(ts_jnum(fly, "decode") >= 1); /* exact: every pull counts */
        ck_assert(ts_jnum(fly, "prefill") >= 0);
        ck_assert(ts_jnum(d, "paced_rss_drift") >= 0);
        ck_assert(ts_jnum(d, "paced_rss_drift_less_staging") >= 0);
        ck_assert(ts_jnum(d, "paced_unaccounted_drift") >= 0);
        json_t *g = json_object_get(json_object_get(json_object_get(d, "paced_drift"), "decode"),
                                    "growth_bytes");
        ck_assert(json_is_integer(json_object_get(g, "pool_committed")));
        ck_assert(json_is_integer(json_object_get(g, "staging_resident")));
    }
    json_t *plan = json_object_get(doc, "plan");
    /* fixed: the fixed figure per node; per_transfer, per node: the mean per phase that
       moved KV, the paced phase's tail, and the run's row */
    int fixed_rows = 0, run_rows = 0, tail_rows = 0;
    size_t i;
    json_t *r;
    json_array_foreach(plan, i, r)
    {
        const char *fig = json_string_value(json_object_get(r, "figure"));
        const char *phase = json_string_value(json_object_get(r, "phase"));
        ck_assert_ptr_nonnull(fig);
        ck_assert_ptr_nonnull(phase);
        fixed_rows += !strcmp(fig, "fixed") && !strcmp(phase, "run");
        run_rows += !strcmp(fig, "per_transfer_mean") && !strcmp(phase, "run");
        tail_rows += !strcmp(fig, "per_transfer_tail") && !strcmp(phase, "paced");
        ck_assert(strcmp(fig, "per_transfer_tail") || !strcmp(phase, "paced"));
        ck_assert(ts_jnum(r, "predicted_bytes") > 0);
        ck_assert(ts_jnum(r, "measured_bytes") >= 0);
        ck_assert(json_is_string(json_object_get(r, "design")));
        ck_assert(json_is_string(json_object_get(r, "node")));
        bool within = json_is_true(json_object_get(r, "within_10pct"));
        ck_assert(within || strlen(json_string_value(json_object_get(r, "note"))) > 0);
        /* The fixed rows' measured side is the OS's VmLck: nothing to compare where the
           sanitizer's mlock locks nothing. */
        if (!strcmp(json_string_value(json_object_get(r, "figure")), "fixed") && PKV_MLOCK_IS_REAL)
            ck_assert_msg(within, "fixed slots: planner %f measured %f",
                          ts_jnum(r, "predicted_bytes"), ts_jnum(r, "measured_bytes"));
    }
    ck_assert_int_eq(fixed_rows, 2);
    ck_assert_int_eq(run_rows, 2);
    ck_assert_int_eq(tail_rows, 2);
    json_decref(doc);
}
END_TEST

/* SIGINT while the first design runs: exit 130 and both namespaces gone. */
START_TEST(quick_tcp_sigint_cleans_up)
{
    char log[] = "/tmp/pagekv-test-disagg-log-XXXXXX";
    char args[1024];
    snprintf(args, sizeof(args), "bench disagg %s", quick_tcp_args);
    pid_t pid = ts_pagekv_spawn(args, log);
    static char out[1 << 18];
    for (int t = 0; t < 1200; t++) { /* until the first design starts (or the bench ends) */
        ts_read_file(log, out, sizeof(out));
        if (strstr(out, "design fixed:") || waitpid(pid, NULL, WNOHANG) == pid) break;
        usleep(100000);
    }
    int st = 0;
    if (strstr(out, "cannot make the network namespaces")) {
        waitpid(pid, &st, 0);
        unlink(log);
        PKV_TEST_SKIP("%s", strstr(out, "cannot make"));
        return;
    }
    ck_assert_msg(strstr(out, "design fixed:"), "the first design never started:\n%s",
                  ts_tail(out));
    kill(pid, SIGINT);
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ts_read_file(log, out, sizeof(out));
    unlink(log);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 130, "status %d\n%s", st, ts_tail(out));
    char a[64], b[64];
    ck_assert_msg(!netns_left(out, "prefill in ", a, sizeof(a)) && a[0], "%s left", a);
    ck_assert_msg(!netns_left(out, "decode in ", b, sizeof(b)) && b[0], "%s left", b);
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
    TCase *itf = tcase_create("interference");
    tcase_set_timeout(itf, 120);
    tcase_add_test(itf, interference_runs_and_reports);
    tcase_add_test(itf, interference_bad_options_exit_2);
    suite_add_tcase(s, itf);
    TCase *tcp = tcase_create("tcp");
    tcase_set_timeout(tcp, 300);
    tcase_add_test(tcp, quick_tcp_runs_and_cleans_up);
    tcase_add_test(tcp, quick_tcp_sigint_cleans_up);
    suite_add_tcase(s, tcp);
    return s;
}

PKV_TEST_MAIN(bench_disagg_suite)
