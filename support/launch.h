/*
 * The one launcher of `pagekv serve` and `pagekv route` child processes, for `pagekv demo`,
 * the benchmarks and the tests (support/: compiled once into build/libpkvsupport.a).
 *
 * launch_spawn: fork and exec a binary path with extra environment entries, stdin on
 * /dev/null, stdout and stderr in a log file of its own (never a pipe this process must keep
 * draining: a server that logs while nobody reads would block on a full pipe). Each child is
 * in a process group of its own and gets a signal (SIGKILL unless asked otherwise) when the
 * thread that started it exits (PR_SET_PDEATHSIG): start and stop children from one thread
 * that outlives them.
 * launch_wait_listening: polls the log for the listening line ("pagekv NAME: listening on
 * [http://]HOST:PORT", or the readiness prefix the spec names, such as "pagekv route:
 * listening on ") and, when asked, the transfer agent's ("transfer agent on HOST:PORT").
 * launch_stop: a signal, reaped by a deadline, SIGKILL after it. launch_serve / launch_route
 * (launch_node.c): the node command lines the disaggregation benchmarks and the resharding bench
 * and test share.
 */
#ifndef PKV_SUPPORT_LAUNCH_H
#define PKV_SUPPORT_LAUNCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define LAUNCH_NAME_MAX  32
#define LAUNCH_ADDR_MAX  64
#define LAUNCH_READY_MAX 64

typedef struct {
    char name[LAUNCH_NAME_MAX];       /* for reports: "prefill", "decode", "router", ... */
    char log[256];                    /* its stdout + stderr */
    char ready[LAUNCH_READY_MAX];     /* the text before HOST:PORT in its listening line */
    pid_t pid;                        /* 0 once stopped (launch_stop) */
    uint16_t port;                    /* HTTP port from its listening line */
    char url[LAUNCH_ADDR_MAX + 8];    /* "http://HOST:PORT" as it listens (a wildcard
                                         host: 127.0.0.1) */
    char kv_address[LAUNCH_ADDR_MAX]; /* transfer agent "HOST:PORT", "" without one */
    int wstatus;                      /* waitpid status once reaped */
    bool reaped;
    bool killed; /* launch_stop had to SIGKILL it after its deadline */
} launch_proc_t;

typedef struct {
    const char *name;         /* for messages and reports */
    char *const *argv;        /* argv[0] a path; NULL-terminated */
    char *const *env;         /* extra "K=V" entries, NULL-terminated; may be NULL */
    const char *log_path;     /* created (truncated) for the child's stdout and stderr */
    const char *cgroup_procs; /* a cgroup's cgroup.procs the child joins before exec (exit
                                 97 when it cannot); NULL: none */
    int death_signal;         /* sent to the child when its starting thread exits; 0: SIGKILL */
    const char *ready;        /* the text before HOST:PORT in the listening line (one a
                                 debug log line cannot also hold, such as "pagekv serve:
                                 listening on "); NULL: ": listening on " (the CLI's
                                 "pagekv NAME: listening on ", never the agent's log line) */
} launch_spec_t;

/* Fork and exec s->argv. 0, or -1 with a message in err (p is then not started). */
int launch_spawn(launch_proc_t *p, const launch_spec_t *s, char *err, size_t errcap);
/* Wait until the log shows the listening line (fills port and url) and, with want_agent,
 * the transfer agent's (kv_address), by deadline_ns (monotonic). 0; or -1 with a message
 * in err (the log's last lines included) when the child exited first (it is reaped) or did
 * not listen in time (it is then killed and reaped). */
int launch_wait_listening(launch_proc_t *p, bool want_agent, uint64_t deadline_ns, char *err,
                          size_t errcap);
/* launch_spawn with the log LOGDIR/NAME.log, then launch_wait_listening. */
int launch_start(launch_proc_t *p, const char *name, char *const argv[], char *const env[],
                 const char *logdir, uint64_t deadline_ns, char *err, size_t errcap);
/* Reap without blocking; true once it has exited (p->wstatus). */
bool launch_reap(launch_proc_t *p);
/* Send sig (0: none; a stopped child gets SIGCONT too) and reap by deadline_ns, then
 * SIGKILL (the child and its group) and reap. Returns the exit code (0..255), 128 + the
 * signal for a child that died of one, -1 if never started. */
int launch_stop(launch_proc_t *p, int sig, uint64_t deadline_ns);
/* 0..255 for an exit, 128 + N for signal N, -1 otherwise. */
int launch_exit_code(int wstatus);
/* Resident set (VmRSS) of a live child in bytes, 0 when unknown. */
uint64_t launch_rss(const launch_proc_t *p);
/* The whole log (NUL-terminated, malloc'd: the caller frees), NULL if unreadable. */
char *launch_log_read(const launch_proc_t *p);
/* Copy the last lines of the child's log (at most cap - 1 bytes) into out. */
void launch_log_tail(const launch_proc_t *p, char *out, size_t cap);

/* For a command that starts children: bin = this executable (/proc/self/exe, bin_cap
 * bytes), logdir = a new directory from its template ("/tmp/NAME-XXXXXX", edited in
 * place), SIGINT and SIGTERM to on_signal, SIGPIPE ignored. 0, or -1 with a message on
 * stderr. */
int launch_env_init(char *bin, size_t bin_cap, char *logdir, void (*on_signal)(int));

/* ---- nodes (launch_node.c) ------------------------------------------------------------- */

/* Where a node runs: inside network namespace `netns` (through `IP_BIN netns exec`), its
 * HTTP on `host`, its transfer agent on `kv_host` (port 0 each), UCX on interface
 * `kv_dev` only (UCX_NET_DEVICES: a namespace with a second link would otherwise
 * advertise that one's address too, which the peer cannot reach). */
typedef struct {
    const char *ip_bin, *netns, *host, *kv_host, *kv_dev;
} launch_place_t;

/* Start a node: `BIN serve --port 0 --preset PRESET --max-context CTX --kv-cache-budget
 * none`, with a role `--role ROLE --kv-lease-ms 600000 --kv-transfer-timeout-ms 60000`,
 * then `extra` (NULL-terminated, may be NULL); its log LOGDIR/NAME.log; UCX_TLS=tcp when
 * tcp; in a namespace when `at` is not NULL (else here, on 127.0.0.1); up to 120 s to
 * listen. 0, or -1 with the reason on stderr. */
int launch_serve(const char *bin, const char *logdir, const char *name, const char *preset,
                 uint32_t ctx, const char *role, char *const extra[], bool tcp,
                 const launch_place_t *at, launch_proc_t *p);
/* Start `BIN route --port 0 --prefill PRE --decode DEC` then `extra`, its log
 * LOGDIR/NAME.log; 0 or -1 as above. */
int launch_route(const char *bin, const char *logdir, const char *name, const launch_proc_t *pre,
                 const launch_proc_t *dec, char *const extra[], launch_proc_t *p);

#endif
