/*
 * Real pagekv processes and an HTTP client for them (support/cluster.h).
 *
 * A child's output goes to a file, never to a pipe this process must keep draining: a
 * server that logs while nobody reads would otherwise block on a full pipe. Start polls
 * the file for the listening line.
 */
#include "support/cluster.h"

#include "core/core.h"
#include "prim/prim.h"

#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define POLL_NS 20000000ull /* 20 ms between looks at a child's log */

static void sleep_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* The whole log (NUL-terminated, malloc'd), NULL if unreadable. */
static char *log_read(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t n = fread(buf + len, 1, cap - len - 1, f);
        len += n;
        if (len + 1 < cap) break;
        char *nb = realloc(buf, cap * 2);
        if (!nb) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = nb;
        cap *= 2;
    }
    fclose(f);
    if (buf) buf[len] = '\0';
    return buf;
}

/* "HOST:PORT" or "[V6]:PORT" at s (an "http://" prefix skipped): the port, 0 if none.
 * addr gets the text up to the first blank. */
static uint16_t parse_addr(const char *s, char *addr, size_t cap)
{
    if (strncmp(s, "http://", 7) == 0) s += 7;
    size_t n = strcspn(s, " \t\r\n(");
    if (n == 0 || n >= cap) return 0;
    memcpy(addr, s, n);
    addr[n] = '\0';
    const char *colon = strrchr(addr, ':');
    if (!colon || (strchr(addr, '[') && colon < strchr(addr, ']'))) return 0;
    char *end;
    unsigned long port = strtoul(colon + 1, &end, 10);
    return (port > 0 && port < 65536 && *end == '\0') ? (uint16_t)port : 0;
}

/* Fill port, url and kv_address from the log; true once the listening line is there. */
static bool log_listening(cluster_proc_t *p)
{
    char *log = log_read(p->log);
    if (!log) return false;
    bool ok = false;
    const char *l = strstr(log, "listening on ");
    if (l) {
        char addr[CLUSTER_ADDR_MAX];
        uint16_t port = parse_addr(l + 13, addr, sizeof(addr));
        if (port) {
            p->port = port;
            /* the address it listens on; a wildcard one is reached on loopback */
            bool any = !strncmp(addr, "0.0.0.0:", 8) || !strncmp(addr, "[::]:", 5);
            if (any)
                snprintf(p->url, sizeof(p->url), "http://127.0.0.1:%u", port);
            else
                snprintf(p->url, sizeof(p->url), "http://%s", addr);
            ok = true;
        }
    }
    const char *a = strstr(log, "transfer agent on ");
    if (a) parse_addr(a + 18, p->kv_address, sizeof(p->kv_address));
    free(log);
    return ok;
}

void cluster_proc_log_tail(const cluster_proc_t *p, char *out, size_t cap)
{
    if (cap == 0) return;
    out[0] = '\0';
    char *log = log_read(p->log);
    if (!log) return;
    size_t len = strlen(log);
    size_t from = len > cap - 1 ? len - (cap - 1) : 0;
    const char *nl = from ? strchr(log + from, '\n') : NULL;
    snprintf(out, cap, "%s", nl ? nl + 1 : log + from);
    free(log);
}

/* Reap without blocking; true once it has exited. */
static bool reap(cluster_proc_t *p)
{
    if (p->reaped) return true;
    int st;
    pid_t w = waitpid(p->pid, &st, WNOHANG);
    if (w == p->pid) {
        p->wstatus = st;
        p->reaped = true;
    } else if (w < 0 && errno == ECHILD) {
        p->reaped = true;
    }
    return p->reaped;
}

int cluster_proc_start(cluster_proc_t *p, const char *name, char *const argv[], char *const env[],
                       const char *logdir, uint64_t deadline_ns, char *err, size_t errcap)
{
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "%s", name);
    snprintf(p->log, sizeof(p->log), "%s/%s.log", logdir, name);
    int fd = open(p->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(err, errcap, "%s: cannot create %s: %s", name, p->log, strerror(errno));
        return -1;
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        close(fd);
        snprintf(err, errcap, "%s: fork: %s", name, strerror(errno));
        return -1;
    }
    if (pid == 0) {
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(127);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        for (size_t i = 0; env && env[i]; i++) putenv(env[i]);
        execv(argv[0], argv);
        dprintf(STDERR_FILENO, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(fd);
    p->pid = pid;
    for (;;) {
        if (log_listening(p)) return 0;
        if (reap(p)) {
            char tail[512];
            cluster_proc_log_tail(p, tail, sizeof(tail));
            snprintf(err, errcap, "%s exited before listening (status %d): %s", name, p->wstatus,
                     tail);
            p->pid = 0;
            return -1;
        }
        if (pkv_now_ns() > deadline_ns) break;
        sleep_ns(POLL_NS);
    }
    char tail[512];
    cluster_proc_log_tail(p, tail, sizeof(tail));
    snprintf(err, errcap, "%s did not listen in time: %s", name, tail);
    cluster_proc_stop(p, SIGKILL, pkv_now_ns());
    return -1;
}

static int exit_code(int st)
{
    if (WIFEXITED(st)) return WEXITSTATUS(st);
    if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
    return -1;
}

int cluster_proc_stop(cluster_proc_t *p, int sig, uint64_t deadline_ns)
{
    if (p->pid <= 0) return p->reaped ? exit_code(p->wstatus) : -1;
    if (!reap(p) && sig) {
        kill(p->pid, sig);
        if (sig != SIGKILL && sig != SIGCONT) kill(p->pid, SIGCONT); /* a stopped child too */
    }
    while (!reap(p) && pkv_now_ns() < deadline_ns) sleep_ns(POLL_NS / 4);
    if (!p->reaped) {
        kill(-p->pid, SIGKILL);
        kill(p->pid, SIGKILL);
        int st;
        if (waitpid(p->pid, &st, 0) == p->pid) p->wstatus = st;
        p->reaped = true;
    }
    kill(-p->pid, SIGKILL); /* anything it left in its group */
    p->pid = 0;
    return exit_code(p->wstatus);
}

uint64_t cluster_proc_rss(const cluster_proc_t *p)
{
    pkv_prim_mem_t m;
    if (p->pid <= 0 || pkv_prim_mem_read(p->pid, &m) != PKV_OK) return 0;
    return m.rss_bytes;
}

/* ---- HTTP ------------------------------------------------------------------------------ */
typedef struct {
    cluster_http_reply_t *r;
    size_t cap;
    bool oom;
} body_t;

static size_t on_body(char *data, size_t size, size_t nmemb, void *arg)
{
    body_t *b = arg;
    size_t n = size * nmemb;
    if (b->r->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->r->len + n + 1) cap *= 2;
        char *nb = realloc(b->r->body, cap);
        if (!nb) {
            b->oom = true;
            return 0;
        }
        b->r->body = nb;
        b->cap = cap;
    }
    memcpy(b->r->body + b->r->len, data, n);
    b->r->len += n;
    b->r->body[b->r->len] = '\0';
    return n;
}

static int on_progress(void *arg, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un)
{
    const volatile sig_atomic_t *stop = arg;
    return stop && *stop ? 1 : 0;
}

int cluster_http(const char *base_url, const char *path, const json_t *body,
                 const char *const headers[], uint32_t timeout_ms,
                 const volatile sig_atomic_t *abort_flag, cluster_http_reply_t *out)
{
    memset(out, 0, sizeof(*out));
    CURL *c = curl_easy_init();
    if (!c) {
        snprintf(out->error, sizeof(out->error), "curl_easy_init failed");
        return -1;
    }
    char url[512];
    snprintf(url, sizeof(url), "%s%s", base_url, path);
    char *payload = body ? json_dumps(body, JSON_COMPACT) : NULL;
    struct curl_slist *hl = NULL;
    if (body) hl = curl_slist_append(hl, "Content-Type: application/json");
    for (size_t i = 0; headers && headers[i]; i++) hl = curl_slist_append(hl, headers[i]);
    body_t b = {.r = out};
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    if (abort_flag) {
        curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
        curl_easy_setopt(c, CURLOPT_XFERINFODATA, (void *)abort_flag);
        curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    }
    if (payload) curl_easy_setopt(c, CURLOPT_POSTFIELDS, payload);
    CURLcode rc = curl_easy_perform(c);
    int ret = 0;
    if (rc != CURLE_OK || b.oom) {
        snprintf(out->error, sizeof(out->error), "%s",
                 b.oom ? "out of memory" : curl_easy_strerror(rc));
        ret = -1;
    } else {
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &out->status);
        curl_easy_getinfo(c, CURLINFO_TOTAL_TIME, &out->seconds);
        curl_easy_getinfo(c, CURLINFO_STARTTRANSFER_TIME, &out->ttfb_seconds);
        if (!out->body) out->body = calloc(1, 1);
    }
    curl_slist_free_all(hl);
    free(payload);
    curl_easy_cleanup(c);
    if (ret) {
        free(out->body);
        out->body = NULL;
        out->len = 0;
    }
    return ret;
}

void cluster_http_reply_free(cluster_http_reply_t *r)
{
    if (!r) return;
    free(r->body);
    r->body = NULL;
    r->len = 0;
}

json_t *cluster_http_get_json(const char *base_url, const char *path, uint32_t timeout_ms)
{
    return cluster_http_json(base_url, path, NULL, timeout_ms);
}

json_t *cluster_http_json(const char *base_url, const char *path, const json_t *body,
                          uint32_t timeout_ms)
{
    cluster_http_reply_t r;
    if (cluster_http(base_url, path, body, NULL, timeout_ms, NULL, &r) != 0) return NULL;
    json_t *doc = r.status == 200 ? json_loads(r.body, 0, NULL) : NULL;
    cluster_http_reply_free(&r);
    return doc;
}

/* ---- answers --------------------------------------------------------------------------- */
static int append(char **text, size_t *len, const char *s, size_t n)
{
    char *nt = realloc(*text, *len + n + 1);
    if (!nt) return -1;
    memcpy(nt + *len, s, n + 1);
    *text = nt;
    *len += n;
    return 0;
}

/* One response object (a whole answer or one stream chunk) into a. */
static int answer_take(const json_t *o, cluster_answer_t *a, size_t *len)
{
    const json_t *err = json_object_get(o, "error");
    if (err) {
        const char *code = json_string_value(json_object_get(err, "code"));
        snprintf(a->error_code, sizeof(a->error_code), "%s", code ? code : "error");
    }
    const json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    if (ch) {
        const json_t *t = json_object_get(ch, "text");
        const json_t *msg = json_object_get(ch, "message");
        if (!msg) msg = json_object_get(ch, "delta");
        if (!json_is_string(t) && msg) t = json_object_get(msg, "content");
        if (json_is_string(t) &&
            append(&a->text, len, json_string_value(t), json_string_length(t)) != 0)
            return -1;
        const char *f = json_string_value(json_object_get(ch, "finish_reason"));
        if (f) snprintf(a->finish, sizeof(a->finish), "%s", f);
    }
    const json_t *u = json_object_get(o, "usage");
    if (json_is_object(u)) {
        json_t *pt = json_object_get(u, "prompt_tokens"),
               *ct = json_object_get(u, "completion_tokens");
        if (json_is_integer(pt)) a->prompt_tokens = (long)json_integer_value(pt);
        if (json_is_integer(ct)) a->completion_tokens = (long)json_integer_value(ct);
    }
    return 0;
}

int cluster_answer_parse(const char *body, bool stream, cluster_answer_t *out)
{
    cluster_answer_t a = {.prompt_tokens = -1, .completion_tokens = -1};
    size_t len = 0;
    a.text = calloc(1, 1);
    if (!a.text || !body) goto fail;
    if (!stream) {
        json_t *o = json_loads(body, JSON_ALLOW_NUL, NULL);
        if (!json_is_object(o) || answer_take(o, &a, &len) != 0) {
            json_decref(o);
            goto fail;
        }
        json_decref(o);
        a.done = true;
        a.text_len = len;
        *out = a;
        return 0;
    }
    for (const char *l = body; *l;) {
        size_t n = strcspn(l, "\n");
        if (strncmp(l, "data: ", 6) == 0) {
            const char *d = l + 6;
            size_t dn = n - 6;
            if (dn == 6 && strncmp(d, "[DONE]", 6) == 0) {
                a.done = true;
            } else {
                json_t *o = json_loadb(d, dn, JSON_ALLOW_NUL, NULL);
                int bad = !json_is_object(o) || answer_take(o, &a, &len) != 0;
                json_decref(o);
                if (bad) goto fail;
            }
        }
        l += n;
        if (*l == '\n') l++;
    }
    a.text_len = len;
    *out = a;
    return 0;
fail:
    free(a.text);
    return -1;
}

void cluster_answer_free(cluster_answer_t *a)
{
    if (!a) return;
    free(a->text);
    a->text = NULL;
}

bool cluster_answer_equal(const cluster_answer_t *a, const cluster_answer_t *b)
{
    return a->text && b->text && a->text_len == b->text_len &&
           memcmp(a->text, b->text, a->text_len) == 0 && strcmp(a->finish, b->finish) == 0 &&
           a->prompt_tokens == b->prompt_tokens && a->completion_tokens == b->completion_tokens;
}

long long cluster_json_int(const json_t *doc, const char *path)
{
    char key[64];
    const json_t *cur = doc;
    while (cur && *path) {
        size_t n = strcspn(path, ".");
        if (n >= sizeof(key)) return -1;
        memcpy(key, path, n);
        key[n] = '\0';
        cur = json_object_get(cur, key);
        path += n + (path[n] == '.');
    }
    return json_is_integer(cur) ? (long long)json_integer_value(cur) : -1;
}

int cluster_env_init(char *bin, size_t bin_cap, char *logdir, void (*on_signal)(int))
{
    ssize_t n = readlink("/proc/self/exe", bin, bin_cap - 1);
    if (n <= 0) {
        fprintf(stderr, "cannot find this executable: %s\n", strerror(errno));
        return -1;
    }
    bin[n] = '\0';
    if (!mkdtemp(logdir)) {
        fprintf(stderr, "cannot make a log directory %s: %s\n", logdir, strerror(errno));
        return -1;
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    return 0;
}

/* The node's pagekv_kv_transfer_phase_seconds{phase} sums and counts, as
 * {"phase": [sum_s, count], ...}; NULL when unreadable. */
json_t *cluster_phase_sums(const char *url)
{
    cluster_http_reply_t r;
    if (cluster_http(url, "/metrics", NULL, NULL, 5000, NULL, &r) != 0) return NULL;
    json_t *o = json_object();
    static const char pre[] = "pagekv_kv_transfer_phase_seconds_";
    for (const char *l = r.body; l && *l;) {
        size_t n = strcspn(l, "\n");
        const char *q = strstr(l, "{phase=\"");
        bool sum = !strncmp(l, pre, sizeof(pre) - 1) && !strncmp(l + sizeof(pre) - 1, "sum{", 4);
        bool cnt = !strncmp(l, pre, sizeof(pre) - 1) && !strncmp(l + sizeof(pre) - 1, "count{", 6);
        if ((sum || cnt) && q && q < l + n) {
            char name[32];
            const char *e = strchr(q + 8, '"');
            const char *v = e ? strchr(e, ' ') : NULL;
            if (e && v && v < l + n && (size_t)(e - q - 8) < sizeof(name)) {
                snprintf(name, sizeof(name), "%.*s", (int)(e - q - 8), q + 8);
                json_t *a = json_object_get(o, name);
                if (!a) json_object_set_new(o, name, a = json_pack("[f, f]", 0.0, 0.0));
                json_array_set_new(a, sum ? 0 : 1, json_real(strtod(v + 1, NULL)));
            }
        }
        l += n + (l[n] == '\n');
    }
    cluster_http_reply_free(&r);
    return o;
}

/* Mean ms per phase between two cluster_phase_sums readings. */
json_t *cluster_phase_means(const json_t *before, const json_t *after)
{
    json_t *m = json_object();
    const char *k;
    json_t *a;
    json_object_foreach((json_t *)after, k, a)
    {
        const json_t *b = json_object_get(before, k);
        double ds = json_real_value(json_array_get(a, 0)) - json_real_value(json_array_get(b, 0));
        double dc = json_real_value(json_array_get(a, 1)) - json_real_value(json_array_get(b, 1));
        if (dc > 0) json_object_set_new(m, k, json_real(1e3 * ds / dc));
    }
    return m;
}
