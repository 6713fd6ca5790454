/*
 * pagekv bench footprint: the server's memory over real HTTP workloads, paged against
 * dense (SPEC "Why it exists", 1; docs/design/footprint.md).
 *
 * For every (repeat, scenario, backend) the tool starts a fresh `pagekv serve` (this
 * binary, /proc/self/exe, or --server-bin) on an ephemeral loopback port, waits until it
 * answers /health, and measures the process from the outside:
 *   - VmRSS from /proc/PID/status every 100 ms (thread "fp-rss"), and VmHWM reset at the
 *     start of each phase and read at its end, so a spike between two samples still
 *     counts in the phase's peak;
 *   - /proc/PID/smaps_rollup once at the end of each phase (where the memory is);
 *   - the KV cache's own counters from GET /v1/cache/stats every 250 ms (thread
 *     "fp-stats") and once at the end.
 * Phases: load (exec to /health), settle_load (5 s idle), scenario, settle (8 s idle).
 * The scenarios are chat completions at temperature 0 with ignore_eos (so every request
 * generates exactly max_tokens on both backends) against the llama-3.2-1b preset, f16 KV,
 * --max-batch-size 8; see fp_scenario_names and docs/design/footprint.md.
 *
 * Paged and dense runs of one scenario follow each other, so they see the same machine;
 * --repeat N reports medians with min-max, and ratios taken per repeat.
 */
#include "support/cli.h"
#include "support/bench.h"
#include "footprint.h"

#include "core/core.h"
#include "pagekv/kv.h"
#include "pagekv/tokenizer.h"
#include "prim/prim.h"

#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define FP_NS       1000000000ull
#define FP_MIB      (1024.0 * 1024.0)
#define FP_MAX_PASS 64

enum { SC_IDLE, SC_BURST, SC_SEQSHARE, SC_MULTITURN, SC_CHURN, SC_DISTINCT, SC_N };
static const char *const fp_scenario_names[SC_N] = {
    "idle", "shared_prefix_burst", "seqshare", "multiturn", "churn", "distinct_burst"};

enum { PH_LOAD, PH_SETTLE_LOAD, PH_SCENARIO, PH_SETTLE, PH_N };
static const char *const fp_phase_names[PH_N] = {"load", "settle_load", "scenario", "settle"};

typedef struct {
    bool scenario[SC_N];
    bool backend[2]; /* indexed by pkv_backend_t */
    uint32_t repeat;
    const char *json_path, *svg_dir, *server_bin;
    double settle_load_s, settle_s, idle_s;
    uint32_t prefix_tokens; /* shared_prefix_burst's system prompt, in tokens */
    uint64_t churn_budget;  /* --kv-cache-budget for churn; 0: none */
    double request_timeout_s;
    bool keep_logs;
    const char *pass[FP_MAX_PASS]; /* server flags after `--` */
    int n_pass;
} fp_opts_t;

/* ---- one run's record ------------------------------------------------------------------ */

typedef struct {
    uint64_t begin_ns, end_ns;
    pkv_fp_window_t w;
    uint64_t hwm_bytes; /* VmHWM at the end after a reset at the start; 0: unavailable */
    bool hwm_reset;     /* the reset at the start worked */
    bool have_smaps;
    pkv_prim_smaps_t smaps;
    pkv_prim_mem_t mem; /* /proc/PID/status at the end */
} fp_phase_t;

typedef struct {
    uint64_t t_ns;
    uint64_t committed;
    uint64_t live_blocks;
} fp_kv_sample_t;

typedef struct {
    int scenario;
    pkv_backend_t backend;
    uint32_t repeat;
    bool ok;
    char error[600];
    char log_path[96];
    char server_cmd[1024];
    uint64_t start_ns, ready_ns;
    fp_phase_t ph[PH_N];
    pkv_fp_sample_t *samples;
    size_t n_samples;
    fp_kv_sample_t *kv;
    size_t n_kv;
    pkv_fp_req_t *reqs;
    double *req_wall_s;
    size_t n_reqs, cap_reqs;
    /* summary */
    uint64_t peak_bytes, last_bytes, settled_bytes, baseline_bytes;
    uint64_t prompt_tokens, completion_tokens, cached_tokens;
    double wall_s;
    json_t *stats, *stats_after_reset; /* the server's /v1/cache/stats objects */
    uint64_t kv_committed_peak, kv_committed_polled_max, kv_live_polled_max_bytes, kv_min;
    /* OS against the counters, at the end of settle: anonymous memory grown since the end
     * of settle_load (smaps_rollup) and the KV cache's committed bytes then. */
    int64_t anon_growth;
    uint64_t kv_committed_end;
    uint64_t block_bytes, token_bytes, granule_bytes, storage_ranges, budget;
    uint32_t block_tokens;
    bool ranges_assumed; /* the server did not report storage_ranges */
    bool have_reset;
    uint64_t committed_after_reset;
    int exit_status; /* the server's wait status after SIGTERM; -1: killed by us */
    char exit_text[48];
} fp_run_t;

/* ---- the server's counters -------------------------------------------------------------- */

/* Find a non-negative number by any of `names` ("a" or "a.b" for a field of an object);
 * false when none is there (JSON null counts as absent). */
static bool fp_stat(json_t *o, const char *const *names, uint64_t *out)
{
    for (const char *const *n = names; *n; n++) {
        json_t *v = o;
        const char *p = *n, *dot;
        while (v && (dot = strchr(p, '.'))) {
            char key[64];
            snprintf(key, sizeof(key), "%.*s", (int)(dot - p), p);
            v = json_object_get(v, key);
            p = dot + 1;
        }
        v = json_object_get(v, p);
        if (json_is_integer(v) && json_integer_value(v) >= 0) {
            *out = (uint64_t)json_integer_value(v);
            return true;
        }
        if (json_is_real(v) && json_real_value(v) >= 0) {
            *out = (uint64_t)json_real_value(v);
            return true;
        }
    }
    return false;
}

/* /v1/cache/stats field names (src/server/metrics.c). */
static const char *const K_COMMITTED[] = {"committed_bytes", NULL};
static const char *const K_PEAK[] = {"peak_committed_bytes", NULL};
static const char *const K_BLOCK_BYTES[] = {"block_bytes", NULL};
static const char *const K_TOKEN_BYTES[] = {"token_bytes", NULL};
static const char *const K_BLOCK_TOKENS[] = {"block_tokens", NULL};
static const char *const K_GRANULE[] = {"granule_bytes", NULL};
static const char *const K_RANGES[] = {"storage_ranges", NULL};
static const char *const K_BUDGET[] = {"budget_bytes", NULL};
static const char *const K_LIVE[] = {"blocks.live", "blocks_live", NULL};

/* ---- HTTP ------------------------------------------------------------------------------- */

typedef struct {
    char *p;
    size_t len, cap;
    bool oom;
} fp_buf_t;

static size_t fp_buf_write(char *data, size_t size, size_t nmemb, void *arg)
{
    fp_buf_t *b = arg;
    size_t n = size * nmemb;
    if (b->len + n + 1 > b->cap) {
        size_t cap = PKV_MAX(b->cap * 2, b->len + n + 1 + 4096);
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return 0;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = '\0';
    return n;
}

/* One HTTP exchange on its own easy handle. */
typedef struct {
    CURL *h;
    struct curl_slist *hdr;
    char url[128];
    char *body; /* owned; NULL for GET */
    fp_buf_t resp;
    long status;
    CURLcode cc;
    char errbuf[CURL_ERROR_SIZE];
    uint64_t t0, t1;
    /* chat results */
    uint32_t prompt, completion, cached;
    char *content; /* the assistant's reply (owned) */
} fp_call_t;

static int fp_call_init(fp_call_t *c, int port, const char *method, const char *path, char *body,
                        double timeout_s)
{
    memset(c, 0, sizeof(*c));
    c->body = body;
    snprintf(c->url, sizeof(c->url), "http://127.0.0.1:%d%s", port, path);
    if (!(c->h = curl_easy_init())) return PKV_ERR_NOMEM;
    curl_easy_setopt(c->h, CURLOPT_URL, c->url);
    curl_easy_setopt(c->h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c->h, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c->h, CURLOPT_WRITEFUNCTION, fp_buf_write);
    curl_easy_setopt(c->h, CURLOPT_WRITEDATA, &c->resp);
    curl_easy_setopt(c->h, CURLOPT_ERRORBUFFER, c->errbuf);
    curl_easy_setopt(c->h, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000));
    curl_easy_setopt(c->h, CURLOPT_CONNECTTIMEOUT_MS, 5000L);
    if (!strcmp(method, "POST")) {
        c->hdr = curl_slist_append(NULL, "Content-Type: application/json");
        curl_easy_setopt(c->h, CURLOPT_HTTPHEADER, c->hdr);
        curl_easy_setopt(c->h, CURLOPT_POSTFIELDS, body ? body : "");
        curl_easy_setopt(c->h, CURLOPT_POSTFIELDSIZE, (long)(body ? strlen(body) : 0));
    }
    return PKV_OK;
}

static void fp_call_fini(fp_call_t *c)
{
    if (c->h) curl_easy_cleanup(c->h);
    curl_slist_free_all(c->hdr);
    free(c->body);
    free(c->resp.p);
    free(c->content);
    memset(c, 0, sizeof(*c));
}

/* A blocking exchange; the response JSON in *out (caller decrefs). */
static int fp_http_json(int port, const char *method, const char *path, double timeout_s,
                        json_t **out, char *err, size_t errlen)
{
    fp_call_t c;
    int rc = fp_call_init(&c, port, method, path, NULL, timeout_s);
    if (rc) {
        snprintf(err, errlen, "curl_easy_init failed");
        return rc;
    }
    c.cc = curl_easy_perform(c.h);
    curl_easy_getinfo(c.h, CURLINFO_RESPONSE_CODE, &c.status);
    json_t *j = NULL;
    if (c.cc != CURLE_OK) {
        snprintf(err, errlen, "%s %s: %s", method, path,
                 c.errbuf[0] ? c.errbuf : curl_easy_strerror(c.cc));
        rc = PKV_ERR_IO;
    } else if (c.status != 200) {
        snprintf(err, errlen, "%s %s: HTTP %ld: %.300s", method, path, c.status,
                 c.resp.p ? c.resp.p : "");
        rc = PKV_ERR_PROTO;
    } else if (!(j = json_loadb(c.resp.p ? c.resp.p : "", c.resp.len, 0, NULL))) {
        snprintf(err, errlen, "%s %s: the response is not JSON", method, path);
        rc = PKV_ERR_PROTO;
    }
    fp_call_fini(&c);
    if (!rc) *out = j;
    return rc;
}

/* ---- the server process ----------------------------------------------------------------- */

typedef struct {
    pid_t pid;
    int pidfd; /* -1 where pidfd_open is missing */
    int port;
} fp_server_t;

static int fp_pidfd_open(pid_t pid)
{
#ifdef SYS_pidfd_open
    return (int)syscall(SYS_pidfd_open, pid, 0);
#else
    (void)pid;
    return -1;
#endif
}

/* Wait up to timeout_ms for the child to exit; true (and *status) when it has. */
static bool fp_server_wait(fp_server_t *s, int timeout_ms, int *status)
{
    uint64_t deadline = pkv_deadline_after_ns((uint64_t)timeout_ms * 1000000ull);
    for (;;) {
        pid_t r = waitpid(s->pid, status, WNOHANG);
        if (r == s->pid) return true;
        if (r < 0 && errno != EINTR) return true; /* not our child any more */
        uint64_t now = pkv_now_ns();
        if (now >= deadline) return false;
        int ms = (int)PKV_MIN((deadline - now) / 1000000ull + 1, 50ull);
        if (s->pidfd >= 0) {
            struct pollfd p = {.fd = s->pidfd, .events = POLLIN};
            (void)poll(&p, 1, (int)PKV_MIN((deadline - now) / 1000000ull + 1, 1000ull));
        } else {
            struct timespec ts = {0, ms * 1000000L};
            nanosleep(&ts, NULL);
        }
    }
}

/* The port from the server's log: the first "127.0.0.1:N" or "port N". */
static int fp_parse_port(const char *log)
{
    for (const char *p = log; (p = strstr(p, "127.0.0.1:")); p++) {
        long v = strtol(p + 10, NULL, 10);
        if (v > 0 && v < 65536) return (int)v;
    }
    for (const char *p = log; (p = strstr(p, "port ")); p++) {
        long v = strtol(p + 5, NULL, 10);
        if (v > 0 && v < 65536) return (int)v;
    }
    return 0;
}

static void fp_log_tail(const char *path, char *out, size_t cap)
{
    out[0] = '\0';
    FILE *f = fopen(path, "r");
    if (!f) return;
    if (fseek(f, 0, SEEK_END) == 0) {
        long sz = ftell(f);
        fseek(f, sz > (long)cap - 1 ? sz - ((long)cap - 1) : 0, SEEK_SET);
    }
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = '\0';
    fclose(f);
}

static int fp_read_file(const char *path, char *buf, size_t cap)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, cap - 1);
    close(fd);
    buf[n > 0 ? n : 0] = '\0';
    return 0;
}

/* fork + exec the server with stdout/stderr to run->log_path; wait for its port and
 * for /health. On failure the child is gone and run->error says why. */
static int fp_server_spawn(const fp_opts_t *o, fp_run_t *run, const char *const *argv,
                           fp_server_t *out)
{
    snprintf(run->log_path, sizeof(run->log_path), "/tmp/pagekv-footprint-%d-XXXXXX",
             (int)getpid());
    int lfd = mkstemp(run->log_path);
    if (lfd < 0) {
        snprintf(run->error, sizeof(run->error), "mkstemp: %s", strerror(errno));
        return PKV_ERR_IO;
    }
    (void)fcntl(lfd, F_SETFD, FD_CLOEXEC);
    int nullfd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    pid_t parent = getpid();
    run->start_ns = pkv_now_ns();
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(run->error, sizeof(run->error), "fork: %s", strerror(errno));
        close(lfd);
        if (nullfd >= 0) close(nullfd);
        return PKV_ERR_IO;
    }
    if (pid == 0) {
        /* Only async-signal-safe calls from here to exec. */
        (void)prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent) _exit(127);
        if (nullfd >= 0) dup2(nullfd, 0);
        dup2(lfd, 1);
        dup2(lfd, 2);
        execv(o->server_bin, (char *const *)argv);
        _exit(127);
    }
    close(lfd);
    if (nullfd >= 0) close(nullfd);
    *out = (fp_server_t){.pid = pid, .pidfd = fp_pidfd_open(pid), .port = 0};
    return PKV_OK;
}

/* Wait for the port line in the log, then for /health. On failure the server is gone
 * (killed if it was still there) and run->error says why. */
static int fp_server_wait_ready(fp_run_t *run, fp_server_t *srv)
{
    fp_server_t s = *srv;
    uint64_t deadline = pkv_deadline_after_ns(300 * FP_NS);
    char *log = malloc(65536);
    int status = 0;
    bool exited = false;
    while (log && !s.port && pkv_now_ns() < deadline) {
        if ((exited = fp_server_wait(&s, 50, &status))) break;
        if (fp_read_file(run->log_path, log, 65536) == 0) s.port = fp_parse_port(log);
    }
    free(log);
    while (s.port && !exited && pkv_now_ns() < deadline) {
        json_t *j = NULL;
        char err[256];
        if (fp_http_json(s.port, "GET", "/health", 2.0, &j, err, sizeof(err)) == 0) {
            json_decref(j);
            run->ready_ns = pkv_now_ns();
            *srv = s;
            return PKV_OK;
        }
        exited = fp_server_wait(&s, 100, &status);
    }
    char tail[400];
    fp_log_tail(run->log_path, tail, sizeof(tail));
    if (exited)
        snprintf(run->error, sizeof(run->error),
                 "the server %s %d before it was ready; log %s ends: %s",
                 WIFSIGNALED(status) ? "was killed by signal" : "exited with status",
                 WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status), run->log_path, tail);
    else
        snprintf(run->error, sizeof(run->error),
                 "the server was not ready within 300 s "
                 "(port %d); log %s ends: %s",
                 s.port, run->log_path, tail);
    if (!exited) {
        kill(s.pid, SIGKILL);
        fp_server_wait(&s, 10000, &status);
    }
    if (s.pidfd >= 0) close(s.pidfd);
    srv->pidfd = -1;
    return PKV_ERR_IO;
}

static void fp_exit_text(int status, char *out, size_t cap)
{
    if (status < 0)
        snprintf(out, cap, "SIGKILL after 30 s");
    else if (WIFEXITED(status))
        snprintf(out, cap, "exit %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(out, cap, "signal %d", WTERMSIG(status));
    else
        snprintf(out, cap, "wait status %d", status);
}

/* SIGTERM (the server drains and exits), SIGKILL after 30 s. Returns the wait status, or
 * -1 when it had to be killed. */
static int fp_server_stop(fp_server_t *s)
{
    int status = 0, ret;
    kill(s->pid, SIGTERM);
    if (fp_server_wait(s, 30000, &status)) {
        ret = status;
    } else {
        kill(s->pid, SIGKILL);
        fp_server_wait(s, 10000, &status);
        ret = -1;
    }
    if (s->pidfd >= 0) close(s->pidfd);
    s->pidfd = -1;
    return ret;
}

/* ---- samplers ----------------------------------------------------------------------------- */

/* Two threads share one control block: "fp-rss" reads /proc/PID/status every 100 ms;
 * "fp-stats" (started once the server is ready) reads /v1/cache/stats every 250 ms.
 * Each appends to its own arrays, which only it touches until joined. */
typedef struct {
    pid_t pid;
    int port;
    pthread_mutex_t lock; /* guards stop, last_rss, last_committed */
    pthread_cond_t cond;
    bool stop;
    uint64_t last_rss, last_committed;
    /* fp-rss's own until joined */
    pkv_fp_sample_t *s;
    size_t n, cap;
    /* fp-stats's own until joined */
    fp_kv_sample_t *k;
    size_t nk, capk;
    pthread_t rss_thread, stats_thread;
    bool rss_started, stats_started;
} fp_sampler_t;

/* Sleep on the condvar until `deadline` or stop; true when stopping. */
static bool fp_sampler_wait(fp_sampler_t *sp, uint64_t deadline)
{
    struct timespec ts = pkv__deadline_to_monotonic(deadline);
    pthread_mutex_lock(&sp->lock);
    while (!sp->stop && pkv_now_ns() < deadline)
        if (pthread_cond_timedwait(&sp->cond, &sp->lock, &ts) == ETIMEDOUT) break;
    bool stop = sp->stop;
    pthread_mutex_unlock(&sp->lock);
    return stop;
}

static void *fp_rss_main(void *arg)
{
    fp_sampler_t *sp = arg;
    pthread_setname_np(pthread_self(), "fp-rss");
    uint64_t next = pkv_now_ns();
    do {
        pkv_prim_mem_t m;
        uint64_t t = pkv_now_ns();
        if (pkv_prim_mem_read(sp->pid, &m) == PKV_OK && m.rss_bytes) {
            if (sp->n == sp->cap) {
                size_t cap = sp->cap ? sp->cap * 2 : 1024;
                pkv_fp_sample_t *p = realloc(sp->s, cap * sizeof(*p));
                if (p) sp->s = p, sp->cap = cap;
            }
            if (sp->n < sp->cap) sp->s[sp->n++] = (pkv_fp_sample_t){t, m.rss_bytes};
            pthread_mutex_lock(&sp->lock);
            sp->last_rss = m.rss_bytes;
            pthread_mutex_unlock(&sp->lock);
        }
        next += FP_NS / 10;
        if (next < pkv_now_ns()) next = pkv_now_ns(); /* descheduled: no burst of catch-up */
    } while (!fp_sampler_wait(sp, next));
    return NULL;
}

static void *fp_stats_main(void *arg)
{
    fp_sampler_t *sp = arg;
    pthread_setname_np(pthread_self(), "fp-stats");
    uint64_t next = pkv_now_ns();
    do {
        json_t *j = NULL;
        char err[256];
        uint64_t t = pkv_now_ns();
        if (fp_http_json(sp->port, "GET", "/v1/cache/stats", 2.0, &j, err, sizeof(err)) == 0) {
            fp_kv_sample_t k = {.t_ns = t};
            bool have = fp_stat(j, K_COMMITTED, &k.committed);
            fp_stat(j, K_LIVE, &k.live_blocks);
            json_decref(j);
            if (have && sp->nk == sp->capk) {
                size_t cap = sp->capk ? sp->capk * 2 : 512;
                fp_kv_sample_t *p = realloc(sp->k, cap * sizeof(*p));
                if (p) sp->k = p, sp->capk = cap;
            }
            if (have && sp->nk < sp->capk) sp->k[sp->nk++] = k;
            if (have) {
                pthread_mutex_lock(&sp->lock);
                sp->last_committed = k.committed;
                pthread_mutex_unlock(&sp->lock);
            }
        }
        next += FP_NS / 4;
        if (next < pkv_now_ns()) next = pkv_now_ns();
    } while (!fp_sampler_wait(sp, next));
    return NULL;
}

static int fp_sampler_init(fp_sampler_t *sp, pid_t pid)
{
    memset(sp, 0, sizeof(*sp));
    sp->pid = pid;
    if (pthread_mutex_init(&sp->lock, NULL)) return PKV_ERR_NOMEM;
    if (pkv__cond_init_monotonic(&sp->cond)) {
        pthread_mutex_destroy(&sp->lock);
        return PKV_ERR_NOMEM;
    }
    if (pthread_create(&sp->rss_thread, NULL, fp_rss_main, sp)) {
        pthread_cond_destroy(&sp->cond);
        pthread_mutex_destroy(&sp->lock);
        return PKV_ERR_NOMEM;
    }
    sp->rss_started = true;
    return PKV_OK;
}

static int fp_sampler_start_stats(fp_sampler_t *sp, int port)
{
    sp->port = port;
    if (pthread_create(&sp->stats_thread, NULL, fp_stats_main, sp)) return PKV_ERR_NOMEM;
    sp->stats_started = true;
    return PKV_OK;
}

/* Stop and join both threads; the arrays move to the run. */
static void fp_sampler_fini(fp_sampler_t *sp, fp_run_t *run)
{
    pthread_mutex_lock(&sp->lock);
    sp->stop = true;
    pthread_cond_broadcast(&sp->cond);
    pthread_mutex_unlock(&sp->lock);
    if (sp->rss_started) pthread_join(sp->rss_thread, NULL);
    if (sp->stats_started) pthread_join(sp->stats_thread, NULL);
    pthread_cond_destroy(&sp->cond);
    pthread_mutex_destroy(&sp->lock);
    run->samples = sp->s;
    run->n_samples = sp->n;
    run->kv = sp->k;
    run->n_kv = sp->nk;
}

static void fp_sampler_last(fp_sampler_t *sp, uint64_t *rss, uint64_t *committed)
{
    pthread_mutex_lock(&sp->lock);
    *rss = sp->last_rss;
    *committed = sp->last_committed;
    pthread_mutex_unlock(&sp->lock);
}

/* ---- a run in progress --------------------------------------------------------------------- */

typedef struct {
    const fp_opts_t *o;
    fp_run_t *run;
    fp_sampler_t *sp;
    fp_server_t *srv;
    char model[128];
    const char *phase;
    uint64_t phase_t0;
    unsigned index, total;
    bool progress;
    uint64_t last_progress_ns;
    uint32_t done_reqs, total_reqs;
    double chars_per_token;
} fp_ctx_t;

static void fp_progress(fp_ctx_t *c, bool force)
{
    if (!c->progress) return;
    uint64_t now = pkv_now_ns();
    if (!force && now - c->last_progress_ns < FP_NS / 2) return;
    c->last_progress_ns = now;
    uint64_t rss, committed;
    fp_sampler_last(c->sp, &rss, &committed);
    char reqs[32] = "";
    if (c->total_reqs) snprintf(reqs, sizeof(reqs), " req %u/%u", c->done_reqs, c->total_reqs);
    fprintf(stderr, "\r\033[K[%u/%u] %s %s: %s %.0f s%s, rss %.0f MiB, kv %.0f MiB", c->index,
            c->total, fp_scenario_names[c->run->scenario], pkv_backend_name(c->run->backend),
            c->phase, (double)(now - c->phase_t0) / FP_NS, reqs, (double)rss / FP_MIB,
            (double)committed / FP_MIB);
    fflush(stderr);
}

/* Idle for `s` seconds, updating the progress line. */
static void fp_idle(fp_ctx_t *c, double s)
{
    uint64_t deadline = pkv_now_ns() + (uint64_t)(s * (double)FP_NS);
    for (;;) {
        uint64_t now = pkv_now_ns();
        if (now >= deadline) break;
        uint64_t step = PKV_MIN(deadline - now, FP_NS / 4);
        struct timespec ts = {(time_t)(step / FP_NS), (long)(step % FP_NS)};
        nanosleep(&ts, NULL);
        fp_progress(c, false);
    }
}

static void fp_phase_begin(fp_ctx_t *c, int ph, const char *label)
{
    fp_phase_t *p = &c->run->ph[ph];
    p->begin_ns = pkv_now_ns();
    p->hwm_reset = pkv_prim_hwm_reset_pid(c->srv->pid) == PKV_OK;
    c->phase = label;
    c->phase_t0 = p->begin_ns;
    fp_progress(c, true);
}

static void fp_phase_end(fp_ctx_t *c, int ph)
{
    fp_phase_t *p = &c->run->ph[ph];
    p->end_ns = pkv_now_ns();
    pkv_prim_mem_t m;
    if (pkv_prim_mem_read(c->srv->pid, &m) == PKV_OK) {
        p->mem = m;
        p->hwm_bytes = p->hwm_reset ? m.hwm_bytes : 0;
    }
    p->have_smaps = pkv_prim_smaps_rollup(c->srv->pid, &p->smaps) == PKV_OK;
}

/* ---- requests ------------------------------------------------------------------------------- */

static char *fp_filler_alloc(size_t n, uint64_t seed)
{
    char *s = malloc(n + 1);
    if (s) pkv_fp_filler(s, n, seed);
    return s;
}

/* The body of a chat completion: messages as given (json array, borrowed). */
static char *fp_chat_body(const char *model, json_t *messages, uint32_t max_tokens)
{
    json_t *o = json_pack("{s:s, s:O, s:i, s:f, s:b, s:b}", "model", model, "messages", messages,
                          "max_tokens", (json_int_t)max_tokens, "temperature", 0.0, "stream", 0,
                          "ignore_eos", 1);
    if (!o) return NULL;
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

static json_t *fp_msgs(const char *system, const char *user)
{
    json_t *a = json_array();
    if (!a) return NULL;
    if (system)
        json_array_append_new(a, json_pack("{s:s, s:s}", "role", "system", "content", system));
    if (user) json_array_append_new(a, json_pack("{s:s, s:s}", "role", "user", "content", user));
    return a;
}

static int fp_record(fp_ctx_t *c, const fp_call_t *call, uint32_t group, bool shared)
{
    fp_run_t *r = c->run;
    if (r->n_reqs == r->cap_reqs) {
        size_t cap = r->cap_reqs ? r->cap_reqs * 2 : 64;
        pkv_fp_req_t *q = realloc(r->reqs, cap * sizeof(*q));
        if (!q) return PKV_ERR_NOMEM;
        r->reqs = q;
        double *w = realloc(r->req_wall_s, cap * sizeof(*w));
        if (!w) return PKV_ERR_NOMEM;
        r->req_wall_s = w;
        r->cap_reqs = cap;
    }
    r->reqs[r->n_reqs] = (pkv_fp_req_t){.prompt_tokens = call->prompt,
                                        .completion_tokens = call->completion,
                                        .cached_tokens = call->cached,
                                        .group = group,
                                        .shared_prefix = shared};
    r->req_wall_s[r->n_reqs] = (double)(call->t1 - call->t0) / FP_NS;
    r->n_reqs++;
    return PKV_OK;
}

/* Parse a chat completion response into call->prompt/completion/cached/content. */
static int fp_parse_chat(fp_ctx_t *c, fp_call_t *call)
{
    json_error_t je;
    json_t *j = json_loadb(call->resp.p ? call->resp.p : "", call->resp.len, 0, &je);
    json_t *usage = json_object_get(j, "usage");
    json_t *choice = json_array_get(json_object_get(j, "choices"), 0);
    json_t *content = json_object_get(json_object_get(choice, "message"), "content");
    json_t *pt = json_object_get(usage, "prompt_tokens");
    json_t *ct = json_object_get(usage, "completion_tokens");
    json_t *cached =
        json_object_get(json_object_get(usage, "prompt_tokens_details"), "cached_tokens");
    if (!j || !json_is_integer(pt) || !json_is_integer(ct) || !json_is_string(content)) {
        snprintf(c->run->error, sizeof(c->run->error),
                 "chat completion: unexpected response (%s): %.300s",
                 j ? "missing usage or choices[0].message.content" : je.text,
                 call->resp.p ? call->resp.p : "");
        json_decref(j);
        return PKV_ERR_PROTO;
    }
    call->prompt = (uint32_t)json_integer_value(pt);
    call->completion = (uint32_t)json_integer_value(ct);
    call->cached = json_is_integer(cached) ? (uint32_t)json_integer_value(cached) : 0;
    call->content = strdup(json_string_value(content));
    json_decref(j);
    return call->content ? PKV_OK : PKV_ERR_NOMEM;
}

/* Send n chat bodies at once (curl multi) and wait for all; records each in `group`
 * (or group + i when sequential callers pass n = 1). Takes ownership of bodies[]. On
 * success replies[i] (optional) receives the assistant's text (caller frees). */
static int fp_chat_group(fp_ctx_t *c, char **bodies, size_t n, uint32_t group, bool shared,
                         char **replies)
{
    fp_call_t *calls = calloc(n, sizeof(*calls));
    CURLM *m = curl_multi_init();
    int rc = PKV_OK;
    size_t inited = 0;
    if (!calls || !m) rc = PKV_ERR_NOMEM;
    for (size_t i = 0; i < n; i++) {
        if (rc || !bodies[i]) {
            free(bodies[i]);
            if (!rc) rc = PKV_ERR_NOMEM;
            continue;
        }
        rc = fp_call_init(&calls[i], c->srv->port, "POST", "/v1/chat/completions", bodies[i],
                          c->o->request_timeout_s);
        inited = i + 1;
        if (rc) continue;
        calls[i].t0 = pkv_now_ns();
        curl_multi_add_handle(m, calls[i].h);
    }
    if (rc) {
        snprintf(c->run->error, sizeof(c->run->error), "out of memory building requests");
        goto out;
    }
    int running = (int)n;
    while (running > 0) {
        if (curl_multi_perform(m, &running) != CURLM_OK) break;
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(m, &left))) {
            if (msg->msg != CURLMSG_DONE) continue;
            for (size_t i = 0; i < n; i++)
                if (calls[i].h == msg->easy_handle) {
                    calls[i].cc = msg->data.result;
                    calls[i].t1 = pkv_now_ns();
                    curl_easy_getinfo(calls[i].h, CURLINFO_RESPONSE_CODE, &calls[i].status);
                    c->done_reqs++;
                }
        }
        fp_progress(c, false);
        if (running > 0) curl_multi_poll(m, NULL, 0, 250, NULL);
    }
    for (size_t i = 0; i < n && !rc; i++) {
        fp_call_t *k = &calls[i];
        if (k->cc != CURLE_OK || k->status != 200) {
            snprintf(c->run->error, sizeof(c->run->error), "chat completion %zu: %s%ld: %.300s", i,
                     k->cc != CURLE_OK ? (k->errbuf[0] ? k->errbuf : curl_easy_strerror(k->cc))
                                       : "HTTP ",
                     k->status, k->resp.p ? k->resp.p : "");
            rc = PKV_ERR_IO;
            break;
        }
        if ((rc = fp_parse_chat(c, k))) break;
        if ((rc = fp_record(c, k, group, shared))) break;
        if (replies) {
            replies[i] = k->content;
            k->content = NULL;
        }
    }
out:
    for (size_t i = 0; i < inited; i++) {
        if (calls[i].h) curl_multi_remove_handle(m, calls[i].h);
        fp_call_fini(&calls[i]);
    }
    if (m) curl_multi_cleanup(m);
    free(calls);
    return rc;
}

static int fp_chat_one(fp_ctx_t *c, json_t *msgs, uint32_t max_tokens, uint32_t group, char **reply)
{
    char *body = fp_chat_body(c->model, msgs, max_tokens);
    return fp_chat_group(c, &body, 1, group, false, reply);
}

/* ---- scenarios ----------------------------------------------------------------------------- */

static char *fp_question(unsigned i)
{
    char *q = malloc(160);
    if (q)
        snprintf(q, 160,
                 "Question %u: according to the notes, what does sentence %u say about system "
                 "%u? Answer briefly.",
                 i, 101 + 7 * i, 1000 + 37 * i);
    return q;
}

/* shared_prefix_burst (concurrent) and seqshare (one after another): a warm-up request,
 * then 8 requests sharing its ~prefix_tokens system prompt. */
static int fp_sc_shared(fp_ctx_t *c, bool concurrent)
{
    size_t chars = (size_t)((double)c->o->prefix_tokens * c->chars_per_token);
    char *system = fp_filler_alloc(chars, 1);
    char *bodies[8] = {0};
    int rc = PKV_ERR_NOMEM;
    if (!system) goto out;
    c->total_reqs = 9;
    char *q0 = fp_question(0);
    json_t *warm = q0 ? fp_msgs(system, q0) : NULL;
    free(q0);
    if (!warm) goto out;
    rc = fp_chat_one(c, warm, 8, 0, NULL);
    json_decref(warm);
    if (rc) goto out;
    for (unsigned i = 0; i < 8; i++) {
        char *q = fp_question(i + 1);
        json_t *msgs = q ? fp_msgs(system, q) : NULL;
        bodies[i] = msgs ? fp_chat_body(c->model, msgs, 128) : NULL;
        json_decref(msgs);
        free(q);
    }
    if (concurrent) {
        rc = fp_chat_group(c, bodies, 8, 1, true, NULL);
    } else {
        rc = PKV_OK;
        for (unsigned i = 0; i < 8; i++) {
            if (!rc)
                rc =
                    bodies[i] ? fp_chat_group(c, &bodies[i], 1, 1 + i, false, NULL) : PKV_ERR_NOMEM;
            else
                free(bodies[i]);
        }
    }
out:
    free(system);
    return rc;
}

static int fp_sc_multiturn(fp_ctx_t *c)
{
    json_t *msgs = json_array();
    int rc = msgs ? PKV_OK : PKV_ERR_NOMEM;
    c->total_reqs = 8;
    for (unsigned t = 0; t < 8 && !rc; t++) {
        char *user = fp_filler_alloc(1000, 100 + t), *reply = NULL;
        if (!user ||
            json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", user))) {
            free(user);
            rc = PKV_ERR_NOMEM;
            break;
        }
        free(user);
        rc = fp_chat_one(c, msgs, 128, t, &reply);
        if (!rc && json_array_append_new(
                       msgs, json_pack("{s:s, s:s}", "role", "assistant", "content", reply)))
            rc = PKV_ERR_NOMEM;
        free(reply);
    }
    json_decref(msgs);
    return rc;
}

static int fp_sc_churn(fp_ctx_t *c)
{
    int rc = PKV_OK;
    c->total_reqs = 32;
    for (unsigned i = 0; i < 32 && !rc; i++) {
        char *user = fp_filler_alloc(2000, 1000 + i);
        json_t *msgs = user ? fp_msgs(NULL, user) : NULL;
        free(user);
        if (!msgs) return PKV_ERR_NOMEM;
        rc = fp_chat_one(c, msgs, 32, i, NULL);
        json_decref(msgs);
    }
    return rc;
}

static int fp_sc_distinct(fp_ctx_t *c)
{
    char *bodies[8] = {0};
    c->total_reqs = 8;
    for (unsigned i = 0; i < 8; i++) {
        char *system = fp_filler_alloc(16000, 2000 + i), *q = fp_question(i + 1);
        json_t *msgs = system && q ? fp_msgs(system, q) : NULL;
        bodies[i] = msgs ? fp_chat_body(c->model, msgs, 32) : NULL;
        json_decref(msgs);
        free(system);
        free(q);
    }
    return fp_chat_group(c, bodies, 8, 0, false, NULL);
}

static int fp_scenario_run(fp_ctx_t *c)
{
    switch (c->run->scenario) {
    case SC_IDLE:
        fp_idle(c, c->o->idle_s);
        return PKV_OK;
    case SC_BURST:
        return fp_sc_shared(c, true);
    case SC_SEQSHARE:
        return fp_sc_shared(c, false);
    case SC_MULTITURN:
        return fp_sc_multiturn(c);
    case SC_CHURN:
        return fp_sc_churn(c);
    case SC_DISTINCT:
        return fp_sc_distinct(c);
    }
    return PKV_ERR_INVALID;
}

/* ---- one run -------------------------------------------------------------------------------- */

static bool fp_pass_has(const fp_opts_t *o, const char *flag)
{
    size_t n = strlen(flag);
    for (int i = 0; i < o->n_pass; i++)
        if (!strncmp(o->pass[i], flag, n) && (o->pass[i][n] == '\0' || o->pass[i][n] == '='))
            return true;
    return false;
}

static void fp_run_summarize(fp_run_t *r)
{
    fp_phase_t *sc = &r->ph[PH_SCENARIO], *st = &r->ph[PH_SETTLE];
    r->baseline_bytes = r->ph[PH_SETTLE_LOAD].w.last_bytes;
    r->peak_bytes =
        PKV_MAX(PKV_MAX(sc->w.peak_bytes, st->w.peak_bytes), PKV_MAX(sc->hwm_bytes, st->hwm_bytes));
    r->last_bytes = sc->w.last_bytes;
    r->settled_bytes = st->w.last_bytes;
    r->wall_s = (double)(sc->end_ns - sc->begin_ns) / FP_NS;
    for (size_t i = 0; i < r->n_reqs; i++) {
        r->prompt_tokens += r->reqs[i].prompt_tokens;
        r->completion_tokens += r->reqs[i].completion_tokens;
        r->cached_tokens += r->reqs[i].cached_tokens;
    }
    for (size_t i = 0; i < r->n_kv; i++)
        r->kv_committed_polled_max = PKV_MAX(r->kv_committed_polled_max, r->kv[i].committed);
    if (r->ph[PH_SETTLE_LOAD].have_smaps && st->have_smaps)
        r->anon_growth = (int64_t)st->smaps.anonymous_bytes -
                         (int64_t)r->ph[PH_SETTLE_LOAD].smaps.anonymous_bytes;
    if (r->stats) {
        fp_stat(r->stats, K_COMMITTED, &r->kv_committed_end);
        fp_stat(r->stats, K_PEAK, &r->kv_committed_peak);
        fp_stat(r->stats, K_BLOCK_BYTES, &r->block_bytes);
        fp_stat(r->stats, K_TOKEN_BYTES, &r->token_bytes);
        fp_stat(r->stats, K_GRANULE, &r->granule_bytes);
        /* The pool reserves one range (docs/design/pool.md); older servers do not say. */
        r->ranges_assumed = !fp_stat(r->stats, K_RANGES, &r->storage_ranges);
        if (r->ranges_assumed) r->storage_ranges = r->backend == PKV_BACKEND_PAGED ? 1 : 0;
        fp_stat(r->stats, K_BUDGET, &r->budget);
        uint64_t bt = 0;
        if (!fp_stat(r->stats, K_BLOCK_TOKENS, &bt) && r->token_bytes)
            bt = r->block_bytes / r->token_bytes;
        r->block_tokens = (uint32_t)bt;
    }
    for (size_t i = 0; i < r->n_kv; i++)
        r->kv_live_polled_max_bytes =
            PKV_MAX(r->kv_live_polled_max_bytes, r->kv[i].live_blocks * r->block_bytes);
    if (r->block_tokens && r->token_bytes)
        r->kv_min = pkv_fp_kv_min_bytes(r->reqs, r->n_reqs, r->block_tokens, r->token_bytes);
}

static void fp_run_one(const fp_opts_t *o, fp_run_t *r, unsigned index, unsigned total,
                       double chars_per_token)
{
    char budget[32];
    const char *argv[FP_MAX_PASS + 24];
    int a = 0;
    argv[a++] = "pagekv";
    argv[a++] = "serve";
    argv[a++] = "--port";
    argv[a++] = "0";
    if (!fp_pass_has(o, "--preset")) argv[a++] = "--preset", argv[a++] = "llama-3.2-1b";
    argv[a++] = "--kv-backend";
    argv[a++] = pkv_backend_name(r->backend);
    if (!fp_pass_has(o, "--max-batch-size")) argv[a++] = "--max-batch-size", argv[a++] = "8";
    if (!fp_pass_has(o, "--kv-dtype")) argv[a++] = "--kv-dtype", argv[a++] = "f16";
    if (r->scenario == SC_CHURN && o->churn_budget && !fp_pass_has(o, "--kv-cache-budget")) {
        snprintf(budget, sizeof(budget), "%llu", (unsigned long long)o->churn_budget);
        argv[a++] = "--kv-cache-budget";
        argv[a++] = budget;
    }
    for (int i = 0; i < o->n_pass; i++) argv[a++] = o->pass[i];
    argv[a] = NULL;
    size_t off = 0;
    for (int i = 0; i < a && off < sizeof(r->server_cmd); i++)
        off += (size_t)snprintf(r->server_cmd + off, sizeof(r->server_cmd) - off, "%s%s",
                                i ? " " : "", argv[i]);

    fp_server_t srv;
    if (fp_server_spawn(o, r, argv, &srv)) return;
    fp_sampler_t sp;
    fp_ctx_t c = {.o = o,
                  .run = r,
                  .sp = &sp,
                  .srv = &srv,
                  .index = index,
                  .total = total,
                  .progress = pkv_cli_progress_enabled(),
                  .chars_per_token = chars_per_token};
    if (fp_sampler_init(&sp, srv.pid)) {
        snprintf(r->error, sizeof(r->error), "cannot start the sampler thread");
        r->exit_status = fp_server_stop(&srv);
        return;
    }
    if (c.progress)
        fprintf(stderr, "\r\033[K[%u/%u] %s %s: starting the server", index, total,
                fp_scenario_names[r->scenario], pkv_backend_name(r->backend));
    if (fp_server_wait_ready(r, &srv)) {
        fp_sampler_fini(&sp, r);
        if (c.progress) fprintf(stderr, "\r\033[K");
        return;
    }
    /* The load phase: fork to ready. */
    r->ph[PH_LOAD].begin_ns = r->start_ns;
    r->ph[PH_LOAD].end_ns = r->ready_ns;
    int rc = PKV_OK;
    json_t *models = NULL;
    if (fp_http_json(srv.port, "GET", "/v1/models", 10.0, &models, r->error, sizeof(r->error)))
        rc = PKV_ERR_IO;
    json_t *id = json_object_get(json_array_get(json_object_get(models, "data"), 0), "id");
    if (!rc && !json_is_string(id)) {
        snprintf(r->error, sizeof(r->error), "GET /v1/models: no data[0].id");
        rc = PKV_ERR_PROTO;
    }
    if (!rc) snprintf(c.model, sizeof(c.model), "%s", json_string_value(id));
    json_decref(models);
    if (!rc && fp_sampler_start_stats(&sp, srv.port)) {
        snprintf(r->error, sizeof(r->error), "cannot start the stats thread");
        rc = PKV_ERR_NOMEM;
    }
    if (!rc) {
        fp_phase_begin(&c, PH_SETTLE_LOAD, "settle_load");
        fp_idle(&c, o->settle_load_s);
        fp_phase_end(&c, PH_SETTLE_LOAD);
        fp_phase_begin(&c, PH_SCENARIO, "scenario");
        rc = fp_scenario_run(&c);
        fp_phase_end(&c, PH_SCENARIO);
    }
    if (!rc) {
        c.total_reqs = 0;
        fp_phase_begin(&c, PH_SETTLE, "settle");
        fp_idle(&c, o->settle_s);
        fp_phase_end(&c, PH_SETTLE);
        rc = fp_http_json(srv.port, "GET", "/v1/cache/stats", 10.0, &r->stats, r->error,
                          sizeof(r->error));
    }
    if (!rc && r->scenario == SC_CHURN) {
        json_t *j = NULL;
        rc =
            fp_http_json(srv.port, "POST", "/v1/cache/reset", 30.0, &j, r->error, sizeof(r->error));
        json_decref(j);
        if (!rc)
            rc = fp_http_json(srv.port, "GET", "/v1/cache/stats", 10.0, &r->stats_after_reset,
                              r->error, sizeof(r->error));
        if (!rc) {
            r->have_reset = fp_stat(r->stats_after_reset, K_COMMITTED, &r->committed_after_reset);
            if (!r->have_reset) {
                snprintf(r->error, sizeof(r->error),
                         "/v1/cache/stats has no committed bytes field");
                rc = PKV_ERR_PROTO;
            }
        }
    }
    fp_sampler_fini(&sp, r);
    r->exit_status = fp_server_stop(&srv);
    if (c.progress) fprintf(stderr, "\r\033[K");
    fp_exit_text(r->exit_status, r->exit_text, sizeof(r->exit_text));
    if (r->exit_status != 0)
        fprintf(stderr,
                "pagekv bench footprint: %s %s: the server did not exit cleanly after "
                "SIGTERM (%s); log %s\n",
                fp_scenario_names[r->scenario], pkv_backend_name(r->backend), r->exit_text,
                r->log_path);
    for (int p = 0; p < PH_N; p++)
        r->ph[p].w = pkv_fp_window(r->samples, r->n_samples, r->ph[p].begin_ns,
                                   p == PH_LOAD ? r->ready_ns : r->ph[p].end_ns);
    r->ok = rc == PKV_OK;
    if (r->ok) fp_run_summarize(r);
    if (r->ok && r->exit_status == 0 && !o->keep_logs) unlink(r->log_path);
}

static void fp_run_free(fp_run_t *r)
{
    free(r->samples);
    free(r->kv);
    free(r->reqs);
    free(r->req_wall_s);
    json_decref(r->stats);
    json_decref(r->stats_after_reset);
}

/* ---- reporting ------------------------------------------------------------------------------ */

static double mib(uint64_t b)
{
    return (double)b / FP_MIB;
}

typedef struct {
    double med, min, max;
    size_t n;
} fp_stat_t;

static fp_stat_t fp_stats_of(const double *v, size_t n)
{
    fp_stat_t s = {0, 0, 0, n};
    if (!n) return s;
    s.med = pkv_bench_median(v, n);
    s.min = s.max = v[0];
    for (size_t i = 1; i < n; i++) s.min = fmin(s.min, v[i]), s.max = fmax(s.max, v[i]);
    return s;
}

/* The runs of (scenario, backend), in repeat order. */
static size_t fp_select(fp_run_t *runs, size_t n, int sc, pkv_backend_t b, fp_run_t **out)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (runs[i].scenario == sc && runs[i].backend == b && runs[i].ok) out[k++] = &runs[i];
    return k;
}

typedef double (*fp_field_fn)(const fp_run_t *r);
static double f_peak(const fp_run_t *r)
{
    return mib(r->peak_bytes);
}
static double f_last(const fp_run_t *r)
{
    return mib(r->last_bytes);
}
static double f_settled(const fp_run_t *r)
{
    return mib(r->settled_bytes);
}
static double f_base(const fp_run_t *r)
{
    return mib(r->baseline_bytes);
}
static double f_kvpeak(const fp_run_t *r)
{
    return mib(r->kv_committed_peak);
}
static double f_kvmin(const fp_run_t *r)
{
    return mib(r->kv_min);
}
static double f_wall(const fp_run_t *r)
{
    return r->wall_s;
}
static double f_anon(const fp_run_t *r)
{
    return (double)r->anon_growth / FP_MIB;
}
static double f_kvend(const fp_run_t *r)
{
    return mib(r->kv_committed_end);
}
static double f_anon_minus_kv(const fp_run_t *r)
{
    return ((double)r->anon_growth - (double)r->kv_committed_end) / FP_MIB;
}
static double f_cached(const fp_run_t *r)
{
    return (double)r->cached_tokens;
}

static fp_stat_t fp_field(fp_run_t **sel, size_t n, fp_field_fn f)
{
    double v[256];
    n = PKV_MIN(n, PKV_ARRAY_LEN(v));
    for (size_t i = 0; i < n; i++) v[i] = f(sel[i]);
    return fp_stats_of(v, n);
}

/* "median" or "median (min-max)" with `prec` decimals (a sign when `sign`). */
static void fp_cell(char *buf, size_t cap, fp_stat_t s, int prec, bool sign)
{
    if (!s.n) {
        snprintf(buf, cap, "-");
        return;
    }
    if (s.n == 1) {
        snprintf(buf, cap, sign ? "%+.*f" : "%.*f", prec, s.med);
        return;
    }
    if (sign)
        snprintf(buf, cap, "%+.*f (%+.*f..%+.*f)", prec, s.med, prec, s.min, prec, s.max);
    else
        snprintf(buf, cap, "%.*f (%.*f-%.*f)", prec, s.med, prec, s.min, prec, s.max);
}

/* Per-repeat ratio paged/dense of a field, paired by repeat index. */
static fp_stat_t fp_ratio(fp_run_t *runs, size_t n, int sc, uint32_t repeats, fp_field_fn f,
                          bool diff)
{
    double v[256];
    size_t k = 0;
    for (uint32_t rep = 0; rep < repeats && k < PKV_ARRAY_LEN(v); rep++) {
        const fp_run_t *p = NULL, *d = NULL;
        for (size_t i = 0; i < n; i++) {
            if (runs[i].scenario != sc || runs[i].repeat != rep || !runs[i].ok) continue;
            if (runs[i].backend == PKV_BACKEND_PAGED)
                p = &runs[i];
            else
                d = &runs[i];
        }
        if (!p || !d) continue;
        if (diff)
            v[k++] = f(p) - f(d);
        else if (f(d) > 0)
            v[k++] = f(p) / f(d);
    }
    return fp_stats_of(v, k);
}

typedef struct {
    const char *name;
    int state; /* 1 met, 0 missed, -1 not measured */
    char detail[400];
} fp_target_t;

static int fp_targets(const fp_opts_t *o, fp_run_t *runs, size_t n, fp_target_t *t)
{
    int k = 0;
    fp_run_t *sel[256];
    /* 1. burst ratio */
    fp_stat_t r = fp_ratio(runs, n, SC_BURST, o->repeat, f_peak, false);
    t[k] = (fp_target_t){"shared_prefix_burst: paged peak <= 0.3 x dense peak", -1, ""};
    if (r.n) {
        t[k].state = r.med <= 0.3;
        snprintf(t[k].detail, sizeof(t[k].detail),
                 "paged/dense peak %.3f (median of %zu; %.3f-%.3f)", r.med, r.n, r.min, r.max);
    }
    k++;
    /* 2. every scenario */
    t[k] = (fp_target_t){"every scenario: paged peak <= dense peak (median ratio)", -1, ""};
    size_t off = 0;
    int measured = 0, met = 1;
    for (int sc = 0; sc < SC_N; sc++) {
        fp_stat_t q = fp_ratio(runs, n, sc, o->repeat, f_peak, false);
        fp_stat_t dq = fp_ratio(runs, n, sc, o->repeat, f_peak, true);
        if (!q.n) continue;
        measured++;
        if (q.med > 1.0) met = 0;
        off += (size_t)snprintf(t[k].detail + off,
                                sizeof(t[k].detail) - PKV_MIN(off, sizeof(t[k].detail)),
                                "%s%s %.3f (%+.2f MiB)%s", off ? ", " : "", fp_scenario_names[sc],
                                q.med, dq.med, q.med > 1.0 ? " MISSED" : "");
        if (off >= sizeof(t[k].detail)) off = sizeof(t[k].detail);
    }
    if (measured) t[k].state = met;
    k++;
    /* 3. burst committed vs kv_min */
    t[k] = (fp_target_t){"shared_prefix_burst: kv_committed_peak <= 1.05 x kv_min + one granule "
                         "per storage range",
                         -1, ""};
    size_t ns = fp_select(runs, n, SC_BURST, PKV_BACKEND_PAGED, sel);
    if (ns && sel[0]->kv_min) {
        double worst = 0;
        int ok = 1;
        for (size_t i = 0; i < ns; i++) {
            double bound = 1.05 * (double)sel[i]->kv_min +
                           (double)(sel[i]->granule_bytes * sel[i]->storage_ranges);
            if ((double)sel[i]->kv_committed_peak > bound) ok = 0;
            worst = fmax(worst, (double)sel[i]->kv_committed_peak / bound);
        }
        t[k].state = ok;
        snprintf(t[k].detail, sizeof(t[k].detail),
                 "committed peak %.1f MiB, kv_min %.1f MiB, bound %.1f MiB (repeat 1); worst "
                 "committed/bound %.3f over %zu",
                 mib(sel[0]->kv_committed_peak), mib(sel[0]->kv_min),
                 (1.05 * (double)sel[0]->kv_min +
                  (double)(sel[0]->granule_bytes * sel[0]->storage_ranges)) /
                     FP_MIB,
                 worst, ns);
    }
    k++;
    /* 4. idle */
    t[k] = (fp_target_t){"idle: paged peak <= dense peak + 2 MiB", -1, ""};
    fp_stat_t d = fp_ratio(runs, n, SC_IDLE, o->repeat, f_peak, true);
    if (d.n) {
        t[k].state = d.med <= 2.0;
        snprintf(t[k].detail, sizeof(t[k].detail),
                 "paged - dense peak %+.2f MiB (median of %zu; %+.2f..%+.2f)", d.med, d.n, d.min,
                 d.max);
    }
    k++;
    /* 5. churn budget and reset */
    t[k] = (fp_target_t){"churn with --kv-cache-budget: committed <= budget; after "
                         "/v1/cache/reset <= one granule per storage range",
                         -1, ""};
    off = 0;
    measured = 0;
    met = 1;
    for (int b = 0; b < 2; b++) {
        ns = fp_select(runs, n, SC_CHURN, (pkv_backend_t)b, sel);
        for (size_t i = 0; i < ns; i++) {
            fp_run_t *x = sel[i];
            if (!x->budget || !x->have_reset) continue;
            measured++;
            uint64_t seen = PKV_MAX(x->kv_committed_peak, x->kv_committed_polled_max);
            uint64_t after_bound = x->granule_bytes * x->storage_ranges;
            if (seen > x->budget || x->committed_after_reset > after_bound) met = 0;
            if (i == 0 && off < sizeof(t[k].detail))
                off += (size_t)snprintf(
                    t[k].detail + off, sizeof(t[k].detail) - off,
                    "%s%s: peak %.1f MiB of budget %.1f MiB, after reset %.2f MiB (bound %.2f)",
                    off ? "; " : "", pkv_backend_name((pkv_backend_t)b), mib(seen), mib(x->budget),
                    mib(x->committed_after_reset), mib(after_bound));
        }
    }
    if (measured)
        t[k].state = met;
    else if (fp_select(runs, n, SC_CHURN, PKV_BACKEND_PAGED, sel) ||
             fp_select(runs, n, SC_CHURN, PKV_BACKEND_DENSE, sel))
        snprintf(t[k].detail, sizeof(t[k].detail),
                 "churn ran without a budget (--churn-budget 0, or the server reported none)");
    k++;
    return k;
}

static void fp_print_report(const fp_opts_t *o, fp_run_t *runs, size_t n, fp_target_t *t, int nt)
{
    printf("## pagekv bench footprint (%u repeat%s; median, (min-max) when repeated)\n\n",
           o->repeat, o->repeat > 1 ? "s" : "");
    printf("| scenario | backend | peak MiB | last MiB | settled MiB | baseline MiB | KV "
           "committed peak MiB | kv_min MiB | cached tokens | wall s |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n");
    fp_run_t *sel[256];
    for (int sc = 0; sc < SC_N; sc++) {
        for (int b = 0; b < 2; b++) {
            if (!o->scenario[sc] || !o->backend[b]) continue;
            size_t ns = fp_select(runs, n, sc, (pkv_backend_t)b, sel);
            char c[8][64];
            fp_cell(c[0], 64, fp_field(sel, ns, f_peak), 1, false);
            fp_cell(c[1], 64, fp_field(sel, ns, f_last), 1, false);
            fp_cell(c[2], 64, fp_field(sel, ns, f_settled), 1, false);
            fp_cell(c[3], 64, fp_field(sel, ns, f_base), 1, false);
            fp_cell(c[4], 64, fp_field(sel, ns, f_kvpeak), 1, false);
            fp_cell(c[5], 64, fp_field(sel, ns, f_kvmin), 1, false);
            fp_cell(c[6], 64, fp_field(sel, ns, f_cached), 0, false);
            fp_cell(c[7], 64, fp_field(sel, ns, f_wall), 1, false);
            printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", fp_scenario_names[sc],
                   pkv_backend_name((pkv_backend_t)b), c[0], c[1], c[2], c[3], c[4], c[5], c[6],
                   c[7]);
        }
    }
    if (o->backend[0] && o->backend[1]) {
        printf("\n| scenario | paged/dense peak | paged - dense peak MiB |\n|---|---|---|\n");
        for (int sc = 0; sc < SC_N; sc++) {
            if (!o->scenario[sc]) continue;
            char a[64], b[64];
            fp_cell(a, 64, fp_ratio(runs, n, sc, o->repeat, f_peak, false), 3, false);
            fp_cell(b, 64, fp_ratio(runs, n, sc, o->repeat, f_peak, true), 1, true);
            printf("| %s | %s | %s |\n", fp_scenario_names[sc], a, b);
        }
    }
    printf("\nThe OS against the KV cache's own counters, at the end of settle: anonymous memory "
           "grown since the end of settle_load (smaps_rollup) and the server's committed_bytes.\n\n"
           "| scenario | backend | anon growth MiB | KV committed MiB | difference MiB |\n"
           "|---|---|---|---|---|\n");
    for (int sc = 0; sc < SC_N; sc++) {
        for (int b = 0; b < 2; b++) {
            if (!o->scenario[sc] || !o->backend[b]) continue;
            size_t ns = fp_select(runs, n, sc, (pkv_backend_t)b, sel);
            char c[3][64];
            fp_cell(c[0], 64, fp_field(sel, ns, f_anon), 1, false);
            fp_cell(c[1], 64, fp_field(sel, ns, f_kvend), 1, false);
            fp_cell(c[2], 64, fp_field(sel, ns, f_anon_minus_kv), 1, true);
            printf("| %s | %s | %s | %s | %s |\n", fp_scenario_names[sc],
                   pkv_backend_name((pkv_backend_t)b), c[0], c[1], c[2]);
        }
    }
    printf("\n### targets\n\n");
    for (int i = 0; i < nt; i++)
        printf("- %s %s: %s\n",
               t[i].state == 1   ? "MET"
               : t[i].state == 0 ? "MISSED"
                                 : "NOT MEASURED",
               t[i].name,
               t[i].detail[0] ? t[i].detail
                              : "(not run: ratios need the scenario on both backends)");
    int failed = 0;
    for (size_t i = 0; i < n; i++) failed += !runs[i].ok;
    if (failed) printf("\n%d run%s failed (see stderr).\n", failed, failed > 1 ? "s" : "");
}

static json_t *fp_phase_json(const fp_phase_t *p, uint64_t ready_ns)
{
    json_t *o =
        json_pack("{s:f, s:f, s:I, s:I, s:I, s:I, s:I, s:I}", "begin_s",
                  ((double)p->begin_ns - (double)ready_ns) / FP_NS, "duration_s",
                  (double)(p->end_ns - p->begin_ns) / FP_NS, "peak_bytes",
                  (json_int_t)PKV_MAX(p->w.peak_bytes, p->hwm_bytes), "sampled_peak_bytes",
                  (json_int_t)p->w.peak_bytes, "hwm_bytes", (json_int_t)p->hwm_bytes, "last_bytes",
                  (json_int_t)p->w.last_bytes, "samples", (json_int_t)p->w.n_samples,
                  "rss_anon_bytes", (json_int_t)p->mem.rss_anon_bytes);
    if (o && p->have_smaps)
        json_object_set_new(o, "smaps_rollup",
                            json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "rss_bytes",
                                      (json_int_t)p->smaps.rss_bytes, "pss_bytes",
                                      (json_int_t)p->smaps.pss_bytes, "pss_anon_bytes",
                                      (json_int_t)p->smaps.pss_anon_bytes, "pss_file_bytes",
                                      (json_int_t)p->smaps.pss_file_bytes, "anonymous_bytes",
                                      (json_int_t)p->smaps.anonymous_bytes, "anon_huge_bytes",
                                      (json_int_t)p->smaps.anon_huge_bytes, "private_dirty_bytes",
                                      (json_int_t)p->smaps.private_dirty_bytes, "swap_bytes",
                                      (json_int_t)p->smaps.swap_bytes));
    return o;
}

static json_t *fp_run_json(const fp_run_t *r)
{
    json_t *o =
        json_pack("{s:s, s:s, s:I, s:b}", "scenario", fp_scenario_names[r->scenario], "backend",
                  pkv_backend_name(r->backend), "repeat", (json_int_t)r->repeat, "ok", r->ok);
    if (!o) return NULL;
    json_object_set_new(o, "server_command", json_string(r->server_cmd));
    if (!r->ok) {
        json_object_set_new(o, "error", json_string(r->error));
        json_object_set_new(o, "server_log", json_string(r->log_path));
        return o;
    }
    json_t *x = json_pack(
        "{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}",
        "peak_bytes", (json_int_t)r->peak_bytes, "last_bytes", (json_int_t)r->last_bytes,
        "settled_bytes", (json_int_t)r->settled_bytes, "baseline_bytes",
        (json_int_t)r->baseline_bytes, "cached_tokens", (json_int_t)r->cached_tokens,
        "prompt_tokens", (json_int_t)r->prompt_tokens, "completion_tokens",
        (json_int_t)r->completion_tokens, "wall_s", r->wall_s, "kv_committed_peak_bytes",
        (json_int_t)r->kv_committed_peak, "kv_committed_polled_max_bytes",
        (json_int_t)r->kv_committed_polled_max, "kv_live_polled_max_bytes",
        (json_int_t)r->kv_live_polled_max_bytes, "kv_min_bytes", (json_int_t)r->kv_min,
        "kv_block_bytes", (json_int_t)r->block_bytes, "kv_token_bytes", (json_int_t)r->token_bytes,
        "kv_granule_bytes", (json_int_t)r->granule_bytes, "kv_storage_ranges",
        (json_int_t)r->storage_ranges, "kv_budget_bytes", (json_int_t)r->budget);
    json_object_update(o, x);
    json_decref(x);
    json_object_set_new(o, "kv_storage_ranges_assumed", json_boolean(r->ranges_assumed));
    json_object_set_new(o, "anon_growth_bytes", json_integer((json_int_t)r->anon_growth));
    json_object_set_new(o, "kv_committed_end_bytes", json_integer((json_int_t)r->kv_committed_end));
    json_object_set_new(o, "server_exit", json_string(r->exit_text));
    json_object_set_new(o, "load_s", json_real((double)(r->ready_ns - r->start_ns) / FP_NS));
    if (r->have_reset)
        json_object_set_new(o, "committed_after_reset_bytes",
                            json_integer((json_int_t)r->committed_after_reset));
    json_t *ph = json_object();
    for (int p = 0; p < PH_N; p++)
        json_object_set_new(ph, fp_phase_names[p], fp_phase_json(&r->ph[p], r->ready_ns));
    json_object_set_new(o, "phases", ph);
    json_t *reqs = json_array();
    for (size_t i = 0; i < r->n_reqs; i++)
        json_array_append_new(reqs,
                              json_pack("{s:I, s:I, s:I, s:I, s:b, s:f}", "prompt_tokens",
                                        (json_int_t)r->reqs[i].prompt_tokens, "completion_tokens",
                                        (json_int_t)r->reqs[i].completion_tokens, "cached_tokens",
                                        (json_int_t)r->reqs[i].cached_tokens, "group",
                                        (json_int_t)r->reqs[i].group, "shared_prefix",
                                        r->reqs[i].shared_prefix, "wall_s", r->req_wall_s[i]));
    json_object_set_new(o, "requests", reqs);
    json_t *rss = json_array(), *kv = json_array();
    for (size_t i = 0; i < r->n_samples; i++)
        json_array_append_new(
            rss, json_pack("[f, I]", ((double)r->samples[i].t_ns - (double)r->ready_ns) / FP_NS,
                           (json_int_t)r->samples[i].bytes));
    for (size_t i = 0; i < r->n_kv; i++)
        json_array_append_new(kv, json_pack("[f, I]",
                                            ((double)r->kv[i].t_ns - (double)r->ready_ns) / FP_NS,
                                            (json_int_t)r->kv[i].committed));
    json_object_set_new(o, "rss_samples", rss);
    json_object_set_new(o, "kv_committed_samples", kv);
    if (r->stats) json_object_set(o, "server_stats", r->stats);
    if (r->stats_after_reset) json_object_set(o, "server_stats_after_reset", r->stats_after_reset);
    return o;
}

static int fp_write_json(const fp_opts_t *o, fp_run_t *runs, size_t n, fp_target_t *t, int nt,
                         double cpt)
{
    json_t *root = json_object(), *ra = json_array(), *ta = json_array(), *pass = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(ra, fp_run_json(&runs[i]));
    for (int i = 0; i < nt; i++)
        json_array_append_new(ta, json_pack("{s:s, s:o, s:s}", "target", t[i].name, "met",
                                            t[i].state < 0 ? json_null() : json_boolean(t[i].state),
                                            "detail", t[i].detail));
    for (int i = 0; i < o->n_pass; i++) json_array_append_new(pass, json_string(o->pass[i]));
    const char *arena = getenv("MALLOC_ARENA_MAX");
    json_object_set_new(root, "config",
                        json_pack("{s:I, s:f, s:f, s:f, s:I, s:f, s:I, s:o, s:s*}", "repeat",
                                  (json_int_t)o->repeat, "settle_load_s", o->settle_load_s,
                                  "settle_s", o->settle_s, "idle_s", o->idle_s, "prefix_tokens",
                                  (json_int_t)o->prefix_tokens, "filler_chars_per_token", cpt,
                                  "churn_budget_bytes", (json_int_t)o->churn_budget, "server_flags",
                                  pass, "MALLOC_ARENA_MAX", arena));
    json_object_set_new(root, "runs", ra);
    json_object_set_new(root, "targets", ta);
    int rc = pkv_bench_write_json(o->json_path, root);
    json_decref(root);
    return rc;
}

static int fp_write_svgs(const fp_opts_t *o, fp_run_t *runs, size_t n)
{
    static const char *const color[2] = {"#1f5fbf", "#d03a1f"};
    if (mkdir(o->svg_dir, 0755) && errno != EEXIST) {
        fprintf(stderr, "pagekv bench footprint: cannot create %s: %s\n", o->svg_dir,
                strerror(errno));
        return -1;
    }
    int ret = 0;
    for (int sc = 0; sc < SC_N; sc++) {
        if (!o->scenario[sc]) continue;
        pkv_fp_series_t s[4];
        pkv_fp_mark_t m[5];
        double *bufs[8] = {0};
        char labels[4][48], mlabels[5][48];
        size_t ns = 0, nm = 0;
        bool oom = false;
        for (int b = 0; b < 2; b++) {
            fp_run_t *r = NULL;
            for (size_t i = 0; i < n && !r; i++)
                if (runs[i].scenario == sc && runs[i].backend == (pkv_backend_t)b && runs[i].ok &&
                    runs[i].repeat == 0)
                    r = &runs[i];
            if (!r) continue;
            double *x = bufs[4 * b] = malloc((r->n_samples + 1) * sizeof(double));
            double *y = bufs[4 * b + 1] = malloc((r->n_samples + 1) * sizeof(double));
            double *kx = bufs[4 * b + 2] = malloc((r->n_kv + 1) * sizeof(double));
            double *ky = bufs[4 * b + 3] = malloc((r->n_kv + 1) * sizeof(double));
            if (!x || !y || !kx || !ky) {
                oom = true;
                break;
            }
            const char *bn = pkv_backend_name((pkv_backend_t)b);
            size_t k = 0;
            for (size_t i = 0; i < r->n_samples; i++) {
                if (r->samples[i].t_ns < r->ready_ns) continue;
                x[k] = (double)(r->samples[i].t_ns - r->ready_ns) / FP_NS;
                y[k++] = mib(r->samples[i].bytes);
            }
            snprintf(labels[ns], sizeof(labels[ns]), "%s VmRSS", bn);
            s[ns] = (pkv_fp_series_t){labels[ns], color[b], false, x, y, k};
            ns++;
            k = 0;
            for (size_t i = 0; i < r->n_kv; i++) {
                if (r->kv[i].t_ns < r->ready_ns) continue;
                kx[k] = (double)(r->kv[i].t_ns - r->ready_ns) / FP_NS;
                ky[k++] = mib(r->kv[i].committed);
            }
            snprintf(labels[ns], sizeof(labels[ns]), "%s KV committed", bn);
            s[ns] = (pkv_fp_series_t){labels[ns], color[b], true, kx, ky, k};
            ns++;
            if (nm == 0) {
                snprintf(mlabels[nm], sizeof(mlabels[nm]), "scenario starts");
                m[nm] = (pkv_fp_mark_t){(double)(r->ph[PH_SCENARIO].begin_ns - r->ready_ns) / FP_NS,
                                        mlabels[nm], "#555555"};
                nm++;
            }
            snprintf(mlabels[nm], sizeof(mlabels[nm]), "%s: scenario ends", bn);
            m[nm] = (pkv_fp_mark_t){(double)(r->ph[PH_SCENARIO].end_ns - r->ready_ns) / FP_NS,
                                    mlabels[nm], color[b]};
            nm++;
        }
        if (oom) {
            fprintf(stderr, "pagekv bench footprint: out of memory plotting %s\n",
                    fp_scenario_names[sc]);
            ret = -1;
        } else if (ns) {
            char path[4096], title[160];
            snprintf(path, sizeof(path), "%s/footprint-%s.svg", o->svg_dir, fp_scenario_names[sc]);
            snprintf(title, sizeof(title),
                     "pagekv serve memory: %s (llama-3.2-1b preset, f16 KV, repeat 1)",
                     fp_scenario_names[sc]);
            FILE *f = fopen(path, "w");
            int wrc = f ? pkv_fp_svg_write(f, title, s, ns, m, nm) : -1;
            if (f && fclose(f)) wrc = -1;
            if (wrc) {
                fprintf(stderr, "pagekv bench footprint: cannot write %s\n", path);
                ret = -1;
            } else {
                fprintf(stderr, "wrote %s\n", path);
            }
        }
        for (int i = 0; i < 8; i++) free(bufs[i]);
    }
    return ret;
}

/* ---- options -------------------------------------------------------------------------------- */

static void fp_usage(FILE *f)
{
    fprintf(f, "usage: pagekv bench footprint [options] [-- server flags]\n"
               "  --scenario a,b,..   of: idle, shared_prefix_burst, seqshare, multiturn, churn,\n"
               "                      distinct_burst, all (default all)\n"
               "  --backend B         paged | dense | all (default all)\n"
               "  --repeat N          runs of each (scenario, backend); medians (default 1)\n"
               "  --json FILE         every run, its phases, samples and the server's counters\n"
               "  --svg DIR           DIR/footprint-<scenario>.svg: memory over time\n"
               "  --settle-load S     idle seconds after the model loads (default 5)\n"
               "  --settle S          idle seconds after the scenario (default 8)\n"
               "  --idle S            the idle scenario's length (default 20)\n"
               "  --prefix-tokens N   shared system prompt length in tokens (default 3700)\n"
               "  --churn-budget B    --kv-cache-budget for churn (default 64M; 0: none)\n"
               "  --request-timeout S per HTTP request (default 1800)\n"
               "  --server-bin PATH   the pagekv binary to serve (default this one)\n"
               "  --keep-logs         keep every server log (failed runs' logs are always kept)\n"
               "Server flags after `--` are passed to every `pagekv serve` (they override the\n"
               "defaults --preset llama-3.2-1b --max-batch-size 8 --kv-dtype f16).\n");
}

static int fp_parse_seconds(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v < 0 || v > 86400) return -1;
    *out = v;
    return 0;
}

static int fp_parse_opts(int argc, char **argv, fp_opts_t *o)
{
    const char *cmd = "bench footprint";
    *o = (fp_opts_t){.repeat = 1,
                     .server_bin = "/proc/self/exe",
                     .settle_load_s = 5,
                     .settle_s = 8,
                     .idle_s = 20,
                     .prefix_tokens = 3700,
                     .churn_budget = 64ull << 20,
                     .request_timeout_s = 1800};
    bool any_sc = false;
    o->backend[0] = o->backend[1] = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t u;
        if (!strcmp(a, "--")) {
            for (i++; i < argc; i++) {
                if (o->n_pass == FP_MAX_PASS)
                    return pkv_cli_usage_error(cmd, "too many server flags (at most %d)",
                                               FP_MAX_PASS);
                o->pass[o->n_pass++] = argv[i];
            }
            break;
        } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fp_usage(stdout);
            return 1;
        } else if (!strcmp(a, "--keep-logs")) {
            o->keep_logs = true;
            continue;
        }
        if (!v) return pkv_cli_usage_error(cmd, "unknown option or missing value: '%s'", a);
        i++;
        if (!strcmp(a, "--scenario")) {
            char *copy = strdup(v), *save = NULL;
            if (!copy) return 2;
            for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                int found = -1;
                for (int s = 0; s < SC_N; s++)
                    if (!strcmp(t, fp_scenario_names[s])) found = s;
                if (!strcmp(t, "all")) {
                    for (int s = 0; s < SC_N; s++) o->scenario[s] = true;
                } else if (found < 0) {
                    int rc = pkv_cli_usage_error(cmd, "unknown scenario '%s'", t);
                    free(copy);
                    return rc;
                } else {
                    o->scenario[found] = true;
                }
                any_sc = true;
            }
            free(copy);
        } else if (!strcmp(a, "--backend")) {
            pkv_backend_t b;
            if (!strcmp(v, "all"))
                o->backend[0] = o->backend[1] = true;
            else if (pkv_backend_parse(v, &b) == PKV_OK) {
                o->backend[0] = o->backend[1] = false;
                o->backend[b] = true;
            } else
                return pkv_cli_usage_error(cmd, "--backend: '%s' is not paged, dense or all", v);
        } else if (!strcmp(a, "--repeat")) {
            if (pkv_cli_parse_u64(v, 1, 50, &u))
                return pkv_cli_usage_error(cmd, "--repeat: '%s' is not in [1, 50]", v);
            o->repeat = (uint32_t)u;
        } else if (!strcmp(a, "--json")) {
            o->json_path = v;
        } else if (!strcmp(a, "--svg")) {
            o->svg_dir = v;
        } else if (!strcmp(a, "--server-bin")) {
            o->server_bin = v;
        } else if (!strcmp(a, "--settle-load") || !strcmp(a, "--settle") || !strcmp(a, "--idle") ||
                   !strcmp(a, "--request-timeout")) {
            double s;
            if (fp_parse_seconds(v, &s))
                return pkv_cli_usage_error(cmd, "%s: bad seconds '%s'", a, v);
            if (!strcmp(a, "--settle-load"))
                o->settle_load_s = s;
            else if (!strcmp(a, "--settle"))
                o->settle_s = s;
            else if (!strcmp(a, "--idle"))
                o->idle_s = s;
            else if (s > 0)
                o->request_timeout_s = s;
            else
                return pkv_cli_usage_error(cmd, "--request-timeout must be > 0");
        } else if (!strcmp(a, "--prefix-tokens")) {
            if (pkv_cli_parse_u64(v, 16, 30000, &u))
                return pkv_cli_usage_error(cmd, "--prefix-tokens: '%s' is not in [16, 30000]", v);
            o->prefix_tokens = (uint32_t)u;
        } else if (!strcmp(a, "--churn-budget")) {
            if (pkv_cli_parse_bytes(v, &o->churn_budget))
                return pkv_cli_usage_error(cmd, "--churn-budget: bad size '%s'", v);
        } else {
            return pkv_cli_usage_error(cmd, "unknown option '%s' (try --help)", a);
        }
    }
    if (!any_sc)
        for (int s = 0; s < SC_N; s++) o->scenario[s] = true;
    if (access(o->server_bin, X_OK))
        return pkv_cli_usage_error(cmd, "--server-bin: '%s' is not executable", o->server_bin);
    return 0;
}

/* Characters per token of this filler under the builtin tokenizer (what the server's
 * built-in model uses), to size the shared system prompt. */
static double fp_chars_per_token(void)
{
    pkv_tok_t *tok = NULL;
    char *s = fp_filler_alloc(16000, 1);
    int32_t *ids = NULL;
    size_t n = 0;
    double cpt = 4.0;
    if (s && pkv_tok_create_builtin(&tok) == PKV_OK &&
        pkv_tok_encode_alloc(tok, s, 16000, false, &ids, &n) == PKV_OK && n)
        cpt = 16000.0 / (double)n;
    free(ids);
    free(s);
    pkv_tok_destroy(tok);
    return cpt;
}

int pkv_bench_footprint(int argc, char **argv)
{
    fp_opts_t o;
    int prc = fp_parse_opts(argc, argv, &o);
    if (prc) return prc == 1 ? 0 : prc;
    if (curl_global_init(CURL_GLOBAL_DEFAULT)) {
        fprintf(stderr, "pagekv bench footprint: curl_global_init failed\n");
        return 1;
    }
    double cpt = fp_chars_per_token();
    size_t total = 0;
    for (int sc = 0; sc < SC_N; sc++)
        for (int b = 0; b < 2; b++) total += o.scenario[sc] && o.backend[b];
    total *= o.repeat;
    fp_run_t *runs = calloc(total ? total : 1, sizeof(*runs));
    if (!runs) {
        curl_global_cleanup();
        return 1;
    }
    size_t n = 0;
    int failed = 0;
    for (uint32_t rep = 0; rep < o.repeat; rep++)
        for (int sc = 0; sc < SC_N; sc++)
            for (int b = 0; b < 2; b++) {
                if (!o.scenario[sc] || !o.backend[b]) continue;
                fp_run_t *r = &runs[n++];
                r->scenario = sc;
                r->backend = (pkv_backend_t)b;
                r->repeat = rep;
                fp_run_one(&o, r, (unsigned)n, (unsigned)total, cpt);
                if (r->ok)
                    fprintf(stderr,
                            "[%zu/%zu] %s %s: peak %.1f MiB, settled %.1f MiB, KV committed "
                            "peak %.1f MiB, %.1f s\n",
                            n, total, fp_scenario_names[sc], pkv_backend_name(r->backend),
                            mib(r->peak_bytes), mib(r->settled_bytes), mib(r->kv_committed_peak),
                            r->wall_s);
                else
                    fprintf(stderr, "[%zu/%zu] %s %s: FAILED: %s\n", n, total,
                            fp_scenario_names[sc], pkv_backend_name(r->backend), r->error),
                        failed++;
            }
    fp_target_t t[8];
    int nt = fp_targets(&o, runs, n, t);
    fp_print_report(&o, runs, n, t, nt);
    int rc = failed ? 1 : 0;
    if (o.json_path && fp_write_json(&o, runs, n, t, nt, cpt)) rc = 1;
    if (o.svg_dir && fp_write_svgs(&o, runs, n)) rc = 1;
    for (size_t i = 0; i < n; i++) fp_run_free(&runs[i]);
    free(runs);
    curl_global_cleanup();
    return rc;
}
