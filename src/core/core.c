/*
 * core: status names, the version, monotonic time, and logging.
 *
 * Logging: a level filter read without a lock (atomic) and a sink swapped under a
 * mutex. The line is formatted on the caller's stack before the sink is called; the
 * sink runs under the sink mutex so that set_sink() never races a running sink.
 */
#include "core/core.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *pkv_status_str(int status)
{
    switch (status) {
    case PKV_OK:
        return "ok";
    case PKV_ERR_INVALID:
        return "invalid";
    case PKV_ERR_NOMEM:
        return "nomem";
    case PKV_ERR_NOSPACE:
        return "nospace";
    case PKV_ERR_NOFIT:
        return "nofit";
    case PKV_ERR_TIMEOUT:
        return "timeout";
    case PKV_ERR_SHUTDOWN:
        return "shutdown";
    case PKV_ERR_CANCELLED:
        return "cancelled";
    case PKV_ERR_NOTFOUND:
        return "notfound";
    case PKV_ERR_BUSY:
        return "busy";
    case PKV_ERR_IO:
        return "io";
    case PKV_ERR_PEER_LOST:
        return "peer_lost";
    case PKV_ERR_REJECTED:
        return "rejected";
    case PKV_ERR_CORRUPT:
        return "corrupt";
    case PKV_ERR_PROTO:
        return "proto";
    case PKV_ERR_UNSUPPORTED:
        return "unsupported";
    default:
        return "unknown";
    }
}

const char *pkv_version(void)
{
    return PKV_VERSION_STRING;
}

uint64_t pkv_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t pkv_deadline_after_ns(uint64_t timeout_ns)
{
    uint64_t now = pkv_now_ns();
    return timeout_ns > UINT64_MAX - now ? PKV_DEADLINE_NEVER : now + timeout_ns;
}

struct timespec pkv_deadline_to_realtime(uint64_t deadline_ns)
{
    /* For APIs that only take CLOCK_REALTIME; prefer condvars set to CLOCK_MONOTONIC. */
    struct timespec ts;
    uint64_t now = pkv_now_ns();
    uint64_t left = deadline_ns > now ? deadline_ns - now : 0;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t ns = (uint64_t)ts.tv_nsec + left % 1000000000ull;
    ts.tv_sec += (time_t)(left / 1000000000ull + ns / 1000000000ull);
    ts.tv_nsec = (long)(ns % 1000000000ull);
    return ts;
}

struct timespec pkv_deadline_to_monotonic(uint64_t deadline_ns)
{
    struct timespec ts;
    if (deadline_ns == PKV_DEADLINE_NEVER) deadline_ns = pkv_now_ns() + 3600ull * 1000000000ull;
    ts.tv_sec = (time_t)(deadline_ns / 1000000000ull);
    ts.tv_nsec = (long)(deadline_ns % 1000000000ull);
    return ts;
}

int pkv_cond_init_monotonic(pthread_cond_t *cond)
{
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) != 0) return PKV_ERR_NOMEM;
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(cond, &attr);
    pthread_condattr_destroy(&attr);
    return rc == 0 ? PKV_OK : PKV_ERR_NOMEM;
}

/* ---- logging ---------------------------------------------------------------------- */

static _Atomic int log_level = -1;                            /* -1: not yet read from PKV_LOG */
static pthread_mutex_t log_mutex = PTHREAD_MUTEX_INITIALIZER; /* guards log_sink, log_arg */
static pkv_log_sink_fn log_sink;
static void *log_arg;

static int log_level_from_env(void)
{
    const char *e = getenv("PKV_LOG");
    if (!e) return PKV_LOG_WARN;
    if (!strcmp(e, "error")) return PKV_LOG_ERROR;
    if (!strcmp(e, "info")) return PKV_LOG_INFO;
    if (!strcmp(e, "debug")) return PKV_LOG_DEBUG;
    return PKV_LOG_WARN;
}

pkv_log_level_t pkv_log_get_level(void)
{
    int l = atomic_load_explicit(&log_level, memory_order_relaxed);
    if (l < 0) {
        l = log_level_from_env();
        int expect = -1;
        atomic_compare_exchange_strong(&log_level, &expect, l);
        l = atomic_load(&log_level);
    }
    return (pkv_log_level_t)l;
}

void pkv_log_set_level(pkv_log_level_t level)
{
    atomic_store(&log_level, (int)level);
}

void pkv_log_set_sink(pkv_log_sink_fn fn, void *arg)
{
    pthread_mutex_lock(&log_mutex);
    log_sink = fn;
    log_arg = arg;
    pthread_mutex_unlock(&log_mutex);
}

void pkv_log(pkv_log_level_t level, const char *module, const char *fmt, ...)
{
    if ((int)level > (int)pkv_log_get_level()) return;
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    static const char *names[] = {"error", "warn", "info", "debug"};
    pthread_mutex_lock(&log_mutex);
    if (log_sink) {
        log_sink(log_arg, level, module, line);
    } else {
        fprintf(stderr, "pagekv %s %s: %s\n", names[level & 3], module, line);
    }
    pthread_mutex_unlock(&log_mutex);
}

_Noreturn void pkv_panic(const char *file, int line, const char *what)
{
    fprintf(stderr, "pagekv: invariant broken at %s:%d: %s\n", file, line, what);
    abort();
}

void pkv_hex_encode(const uint8_t *b, size_t n, char *out)
{
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) out[2 * i] = d[b[i] >> 4], out[2 * i + 1] = d[b[i] & 15];
    out[2 * n] = 0;
}

void pkv_recent_max_note(pkv_recent_max_t *r, uint32_t v, uint64_t now_ns, uint64_t life_ns)
{
    if (!life_ns) return;
    bool live = r->t && now_ns - PKV_MIN(now_ns, r->last) < life_ns;
    if (!live || now_ns - PKV_MIN(now_ns, r->t) >= life_ns) {
        r->prev = live ? r->cur : 0;
        r->cur = 0;
        r->t = now_ns;
    }
    r->cur = PKV_MAX(r->cur, v);
    r->last = PKV_MAX(r->last, now_ns);
}

uint32_t pkv_recent_max_get(const pkv_recent_max_t *r, uint64_t now_ns, uint64_t life_ns,
                            uint64_t *change_ns)
{
    uint64_t age = now_ns - PKV_MIN(now_ns, r->t);
    bool live = life_ns && r->t && now_ns - PKV_MIN(now_ns, r->last) < life_ns;
    uint32_t v = !live ? 0 : age < life_ns ? PKV_MAX(r->cur, r->prev) : r->cur;
    if (change_ns) {
        uint64_t end = r->last + PKV_MIN(life_ns, UINT64_MAX - r->last);
        *change_ns = !v ? UINT64_MAX : age < life_ns ? r->t + life_ns : end;
    }
    return v;
}

void pkv_hist_add(pkv_hist_t *h, const double *bounds, int n, double seconds)
{
    int b = 0;
    while (b < n && seconds > bounds[b]) b++;
    h->bucket[b]++;
    h->count++;
    h->sum += seconds;
}

void pkv_hist_write_prom(FILE *f, const char *name, const char *labels, const pkv_hist_t *h,
                         const double *bounds, int n)
{
    uint64_t cum = 0;
    const char *sep = labels[0] ? "," : "";
    for (int b = 0; b < n; b++) {
        cum += h->bucket[b];
        fprintf(f, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, labels, sep, bounds[b],
                (unsigned long long)cum);
    }
    cum += h->bucket[n];
    fprintf(f, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels, sep, (unsigned long long)cum);
    if (labels[0])
        fprintf(f, "%s_sum{%s} %.9g\n%s_count{%s} %llu\n", name, labels, h->sum, name, labels,
                (unsigned long long)h->count);
    else
        fprintf(f, "%s_sum %.9g\n%s_count %llu\n", name, h->sum, name,
                (unsigned long long)h->count);
}
