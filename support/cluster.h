/*
 * Real pagekv processes and an HTTP client for them, shared by `pagekv demo`, the
 * disaggregation bench and tests (support/: compiled once into build/libpkvsupport.a).
 *
 * cluster_proc_*: a `pagekv serve` or `pagekv route` child, exec'd from a binary path,
 * its stdout and stderr in a log file of its own; start returns once its listening line
 * ("... listening on [http://]HOST:PORT") is in the log, with the HTTP port and, for a
 * serving role, the transfer agent's address ("transfer agent on HOST:PORT"). Each child
 * is in a process group of its own and gets SIGKILL when the thread that started it
 * exits (PR_SET_PDEATHSIG): start and stop children from one thread that outlives them.
 *
 * cluster_http_*: one request with libcurl's easy interface (a total timeout, an abort
 * flag), the whole body kept; cluster_answer_parse reads an OpenAI completion or chat
 * completion, streamed (SSE) or not, into the figures a parity check compares.
 */
#ifndef PKV_SUPPORT_CLUSTER_H
#define PKV_SUPPORT_CLUSTER_H

#include <jansson.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define CLUSTER_NAME_MAX 32
#define CLUSTER_ADDR_MAX 64

typedef struct {
    char name[CLUSTER_NAME_MAX];       /* for reports: "prefill", "decode", "router", ... */
    char log[256];                     /* its stdout + stderr */
    pid_t pid;                         /* 0 once reaped */
    uint16_t port;                     /* HTTP port from its listening line */
    char url[CLUSTER_ADDR_MAX + 8];    /* "http://HOST:PORT" as it listens (a wildcard
                                          host: 127.0.0.1) */
    char kv_address[CLUSTER_ADDR_MAX]; /* transfer agent "HOST:PORT", "" without one */
    int wstatus;                       /* waitpid status once reaped */
    bool reaped;
} cluster_proc_t;

/* For a command that starts children: bin = this executable (/proc/self/exe, bin_cap
 * bytes), logdir = a new directory from its template ("/tmp/NAME-XXXXXX", edited in
 * place), SIGINT and SIGTERM to on_signal, SIGPIPE ignored. 0, or -1 with a message on
 * stderr. */
int cluster_env_init(char *bin, size_t bin_cap, char *logdir, void (*on_signal)(int));

/* Fork and exec argv[0] (argv NULL-terminated) with extra environment entries env
 * ("K=V", NULL-terminated, may be NULL) and its output in LOGDIR/NAME.log; wait up to
 * deadline_ns for its listening line. 0 on success; -1 with a message in err (the log's
 * last lines included) when it could not start, exited or did not listen in time (the
 * child is then killed and reaped). */
int cluster_proc_start(cluster_proc_t *p, const char *name, char *const argv[], char *const env[],
                       const char *logdir, uint64_t deadline_ns, char *err, size_t errcap);
/* Send sig (0: none) and reap by deadline_ns, then SIGKILL and reap. Returns the exit
 * code (0..255), 128 + the signal for a child that died of one, -1 if never started. */
int cluster_proc_stop(cluster_proc_t *p, int sig, uint64_t deadline_ns);
/* Resident set (VmRSS) of a live child in bytes, 0 when unknown. */
uint64_t cluster_proc_rss(const cluster_proc_t *p);
/* Copy the last lines of the child's log (at most cap - 1 bytes) into out. */
void cluster_proc_log_tail(const cluster_proc_t *p, char *out, size_t cap);

typedef struct {
    long status; /* HTTP status, 0 when no answer came (see error) */
    char *body;  /* the whole body, NUL-terminated (free with cluster_http_reply_free) */
    size_t len;
    double seconds;      /* total time */
    double ttfb_seconds; /* time to the first body byte */
    char error[128];     /* transport error, "" when an answer came */
} cluster_http_reply_t;

/* POST body (serialized compactly; NULL: GET) to base_url + path with the headers
 * ("Name: value", NULL-terminated, may be NULL), within timeout_ms. abort_flag (may be
 * NULL) ends the request early when it becomes nonzero. Returns 0 when an HTTP answer
 * came (any status), -1 otherwise (out->error says why). */
int cluster_http(const char *base_url, const char *path, const json_t *body,
                 const char *const headers[], uint32_t timeout_ms,
                 const volatile sig_atomic_t *abort_flag, cluster_http_reply_t *out);
void cluster_http_reply_free(cluster_http_reply_t *r);
/* POST body (NULL: GET) to base_url + path and parse the answer as JSON: NULL unless 200
 * and valid JSON. */
json_t *cluster_http_json(const char *base_url, const char *path, const json_t *body,
                          uint32_t timeout_ms);
/* cluster_http_json's GET. */
json_t *cluster_http_get_json(const char *base_url, const char *path, uint32_t timeout_ms);

/* What a parity check compares between two answers. */
typedef struct {
    char *text; /* concatenated choices[0] text / message content / deltas
                   (NUL-terminated; may hold NULs: text_len is its length) */
    size_t text_len;
    char finish[24];    /* finish_reason, "" if none */
    long prompt_tokens; /* usage, -1 if absent */
    long completion_tokens;
    char error_code[32]; /* error.code of an error body or an SSE error event, "" if none */
    bool done;           /* a stream ended with data: [DONE] (non-streamed: true) */
} cluster_answer_t;

/* Parse an answer body (stream: SSE events). 0, or -1 for a body that is neither. */
int cluster_answer_parse(const char *body, bool stream, cluster_answer_t *out);
void cluster_answer_free(cluster_answer_t *a);
/* Text, finish reason and token counts equal. */
bool cluster_answer_equal(const cluster_answer_t *a, const cluster_answer_t *b);

/* A dotted path into a JSON object ("kv_transfer.leases.sent"): its integer value, or
 * -1 when absent or not an integer. */
long long cluster_json_int(const json_t *doc, const char *path);

/* A node's pagekv_kv_transfer_phase_seconds{phase} sums and counts from /metrics, as
 * {"phase": [sum_s, count], ...}; NULL when unreadable. */
json_t *cluster_phase_sums(const char *url);
/* Mean ms per phase between two cluster_phase_sums readings (phases counted between). */
json_t *cluster_phase_means(const json_t *before, const json_t *after);

#endif
