/*
 * Test support: every tests/test_*.c is its own Check binary.
 *   PKV_TEST_MAIN(make_suite) defines main(): runs the suite (forking each test with
 *   Check's timeout), prints Check's summary line, exits non-zero on failure.
 * Seeds: tests that draw random numbers take PKV_TEST_SEED from the environment
 * when set, and print the seed they used on failure.
 * Skips: Check has no skip status. A test that cannot run here (no root, no `ip`, no
 *   node/npm, no cgroup v1 memory controller, a sanitizer it cannot run under) calls
 *   PKV_TEST_SKIP("why %s", ...) and returns: Check counts it passed, and
 *   scripts/run-tests.sh moves it to the skipped count (see the runner's header).
 */
#ifndef PKV_TESTUTIL_H
#define PKV_TESTUTIL_H

#include "core/core.h"

#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/types.h>

#define PKV_TEST_MAIN(make_suite)                                                                  \
    int main(void)                                                                                 \
    {                                                                                              \
        SRunner *sr = srunner_create(make_suite());                                                \
        srunner_run_all(sr, CK_NORMAL);                                                            \
        int failed = srunner_ntests_failed(sr);                                                    \
        srunner_free(sr);                                                                          \
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;                                               \
    }

/* An assertion for hot loops: Check's ck_assert_* records every passing call (a write
 * per call in fork mode), which dominates tight property loops. */
#define PKV_CHECK(cond)                                                                            \
    do {                                                                                           \
        if (!(cond)) ck_abort_msg("%s:%d: check failed: %s", __FILE__, __LINE__, #cond);           \
    } while (0)
#define PKV_CHECK_EQ(a, b)                                                                         \
    do {                                                                                           \
        long long pkv_a_ = (long long)(a), pkv_b_ = (long long)(b);                                \
        if (pkv_a_ != pkv_b_)                                                                      \
            ck_abort_msg("%s:%d: %s == %s failed: %lld != %lld", __FILE__, __LINE__, #a, #b,       \
                         pkv_a_, pkv_b_);                                                          \
    } while (0)

/* A small seeded generator (no hidden global state): splitmix64. */
static inline uint64_t pkv_test_rand(uint64_t *state)
{
    return pkv_splitmix64(state);
}
static inline uint32_t pkv_test_below(uint64_t *state, uint32_t n)
{
    return n ? (uint32_t)(pkv_test_rand(state) % n) : 0;
}
/* The seed for this run: PKV_TEST_SEED or `fallback`. */
uint64_t pkv_test_seed(uint64_t fallback);
/* mkstemp(tmpl), asserted, and the descriptor closed: tmpl then names an empty file of
 * this test's (a command's --json or log target). */
void pkv_test_tmpfile(char *tmpl);
/* Report the running test as skipped: writes one line "SKIP <test>: <why>" to stderr
 * and, when the runner names a file in PKV_TEST_SKIP_FILE, appends it there too (one
 * write, so forked tests and parallel binaries do not interleave). The caller then
 * returns from the test; call it at most once per test. `test` is the test's name (a
 * trailing "_fn", which START_TEST's function carries, is dropped). */
void pkv_test_skip(const char *test, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define PKV_TEST_SKIP(...) pkv_test_skip(__func__, __VA_ARGS__)
/* VmRSS of this process in bytes. */
uint64_t pkv_test_rss(void);
/* Remove the directory tree at path (files, links, directories; nothing outside it). */
void pkv_test_rm_tree(const char *path);

/* TCP connections to local port `port` in the network namespace of process `pid` (its
 * /proc/PID/net/tcp and tcp6) that the server side has not done with (established,
 * close-wait, last-ack); *unread (optional) gets the bytes they hold unread. The same
 * whether or not the process runs: a stopped server's queued requests show here. */
uint32_t pkv_test_tcp_conns(pid_t pid, uint16_t port, uint64_t *unread);

/* Fault sweep: run step(arg) with the k-th hit of `site` failing, for k = 0, 1, ...,
 * until a run reaches no more hits. Each run that failed must return `want_rc`, and
 * then after_fail(arg) (optional) checks that it left nothing behind; the last run
 * must return PKV_OK. Returns how many runs failed. Leaves every site disarmed. */
uint32_t pkv_test_fault_sweep(pkv_fault_site_t site, int (*step)(void *arg), void *arg, int want_rc,
                              void (*after_fail)(void *arg));

/* Fuzz corpus replay: calls fn(name, data, len, arg) for every file of the corpus
 * directory (getenv(env) when set, else `dir`, relative to the repository root), in
 * directory order, skipping names that start with '.'. Fails the test when the directory
 * is missing or a file cannot be read or holds PKV_TEST_CORPUS_MAX bytes or more.
 * Returns the number of files replayed; the caller asserts it is not zero. */
#define PKV_TEST_CORPUS_MAX (1u << 16)
typedef void (*pkv_test_corpus_fn)(const char *name, const uint8_t *data, size_t len, void *arg);
uint32_t pkv_test_corpus_each(const char *env, const char *dir, pkv_test_corpus_fn fn, void *arg);
/* The same for a fuzz target whose property returns the parser's status (aborting on a
 * broken property): the files named ok-* must be accepted (PKV_OK), those named bad-*
 * refused; other names (inputs a fuzzer added) only have to pass the properties. Fails
 * the test with fewer than min_files files. Returns how many inputs were accepted. */
uint32_t pkv_test_corpus_status(const char *env, const char *dir,
                                int (*target)(const uint8_t *data, size_t len), uint32_t min_files);

#endif
