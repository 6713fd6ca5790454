/*
 * Test support for tests that drive `pagekv serve` processes over real HTTP: thin test
 * wrappers over the HTTP client (support/http.h) and the launcher (support/launch.h),
 * JSON member access by path, and nodes (optionally inside a network namespace) whose
 * HTTP port and transfer agent address are read from their log.
 * Prefix ts_. Every helper asserts (Check) on what must not fail; network errors of a
 * request are returned, since fault tests expect them.
 */
#ifndef PKV_TEST_SRVTEST_H
#define PKV_TEST_SRVTEST_H

#include "pagekv/xfer.h"
#include "support/launch.h"

#include <curl/curl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct {
    long status; /* 0 when no answer came */
    CURLcode cc;
    char *body; /* NUL-terminated (malloc'd; NULL when no answer came) */
    size_t len;
    char *headers; /* the response headers, NUL-terminated ("" when none; malloc'd) */
} ts_resp_t;

/* One request to http://host:port/path (body NULL: none; extra_header NULL: none),
 * bounded by timeout_s. Returns the curl code (also in r->cc); free r with ts_resp_free. */
CURLcode ts_http(const char *host, uint16_t port, const char *method, const char *path,
                 const char *body, const char *extra_header, long timeout_s, ts_resp_t *r);
/* ts_http's POST of body to path, with on_body (support/http.h's hook: false hangs up)
 * called on each piece of the answer as it comes. */
CURLcode ts_http_watch(const char *host, uint16_t port, const char *path, const char *body,
                       long timeout_s, bool (*on_body)(void *, const char *, size_t, size_t),
                       void *arg, ts_resp_t *r);
void ts_resp_free(ts_resp_t *r);
/* GET path, asserting 200 and a JSON body (new reference). */
json_t *ts_get_json(const char *host, uint16_t port, const char *path);

/* A member by path "a.b.0.c" (numbers index arrays); NULL when absent. */
json_t *ts_jp(json_t *doc, const char *path);
long long ts_ji(json_t *doc, const char *path); /* asserts an integer */
double ts_jnum(json_t *o, const char *key);     /* o's member key; asserts a number */
/* The end of a long output (its last 3000 bytes): a Check message stays under its 4 KiB. */
const char *ts_tail(const char *s);
/* Assert that out holds each of lines[0..n) (the message: the missing line, out's tail). */
void ts_has_lines(const char *out, const char *const *lines, size_t n);
/* The JSON file at path, loaded and then removed; asserts it parsed. */
json_t *ts_json_take(const char *path);
const char *ts_js(json_t *doc, const char *path); /* asserts a string */

/* ---- child processes: thin test wrappers over support/launch.h ---- */

/* Start argv (argv[0] a path, NULL-terminated) with the extra environment entries env
 * (NULL-terminated, may be NULL), its stdout and stderr in a new /tmp file, without
 * waiting for it. ready: its listening line's text before HOST:PORT (see launch_spec_t;
 * NULL: "listening on "). */
void ts_proc_spawn(launch_proc_t *p, char *const argv[], char *const env[], const char *ready);
/* ts_proc_spawn, then wait (30 s) for the listening line (p->port, p->url) and, with
 * want_agent, the transfer agent's (p->kv_address); asserts, with the log, that it came. */
void ts_proc_start(launch_proc_t *p, char *const argv[], char *const env[], const char *ready,
                   bool want_agent);
/* Reap it within timeout_s (asserting it exited in time, else SIGKILL and fail): its exit
 * code (launch_exit_code: 128 + N for signal N). log: when not NULL, the whole log
 * (malloc'd; the caller frees). The log file is removed. */
int ts_proc_wait(launch_proc_t *p, int timeout_s, char **log);
/* ts_proc_spawn then ts_proc_wait: run argv to its end (a command that is to fail). */
int ts_proc_run(char *const argv[], int timeout_s, char **log);
/* SIGTERM (and SIGCONT, for a stopped child), then ts_proc_wait: its exit code. */
int ts_proc_stop(launch_proc_t *p, int timeout_s);
/* SIGKILL, reap and remove its log. */
void ts_proc_kill(launch_proc_t *p);
/* Its log so far (asserted readable; malloc'd, the caller frees). */
char *ts_proc_log(const launch_proc_t *p);
/* SIGSTOP pid and wait (10 s) until every thread of it is stopped (a thread already
 * running when the signal came may still answer a request it was serving). */
void ts_proc_freeze(pid_t pid);

typedef struct {
    launch_proc_t proc;
    pid_t pid;
    char host[64];
    uint16_t port;                 /* its HTTP port */
    char agent[PKV_XFER_ADDR_MAX]; /* its transfer agent's address ("" for unified) */
    bool reaped;
    int status;      /* wait status once reaped */
    char log[32768]; /* what it logged (the tail): at start and once reaped */
    size_t log_len;
} ts_node_t;

/* BUILD/pagekv next to this test binary (BUILD/tests/). */
void ts_pagekv_path(char *out, size_t n);
/* Run `BUILD/pagekv ARGS` (a shell word list) to its end: its exit code (128 + N when
 * signal N ended it), stdout and stderr together in out (at most cap - 1 bytes,
 * NUL-terminated). */
int ts_pagekv_run(const char *args, char *out, size_t cap);
/* Start `BUILD/pagekv ARGS` (a shell word list) in the background (support/launch.h's
 * launch_spawn: a process group of its own, killed with the test) with its stdout and
 * stderr in a new file made from the template log ("/tmp/NAME-XXXXXX", edited in place):
 * its pid (the pagekv process itself), for the caller to signal and reap. */
pid_t ts_pagekv_spawn(const char *args, char *log);
/* A file's contents (at most cap - 1 bytes, NUL-terminated; "" when it cannot be read). */
void ts_read_file(const char *path, char *out, size_t cap);
/* Start `pagekv serve --host host --port 0 args...` (args NULL-terminated), inside network
 * namespace `netns` through `ip netns exec` when not NULL, with UCX_TLS=tcp when tcp_only,
 * and wait (30 s) until it printed its HTTP port and, if `agent`, its agent address. The
 * child dies with the test (PR_SET_PDEATHSIG). */
void ts_node_start(ts_node_t *c, const char *netns, const char *host, bool tcp_only, bool agent,
                   const char *const args[]);
/* Reap the child within timeout_s (SIGKILL and fail the test after it): its wait status. */
int ts_node_wait(ts_node_t *c, int timeout_s);
/* SIGTERM, then assert it exits 0 within 30 s. */
void ts_node_stop(ts_node_t *c);
/* SIGKILL and reap. */
void ts_node_kill(ts_node_t *c);

#endif
