/*
 * router: `pagekv route` as a child process in front of `pagekv serve --role prefill|decode`
 * children, driven over real HTTP (libcurl), answers compared with a unified node in this
 * process. Parity (completions and chat, streamed and not, greedy and seeded, 8 at once),
 * X-Request-Id in both nodes' logs, round robin over two and two nodes, cache_aware to
 * the prefill node holding the prefix (and /v1/cache/lookup itself, per tenant), killed
 * and stopped nodes skipped, a lost producer re-running both legs, no node of a role
 * (503), a decode node killed mid-stream (an error event ends the stream), SIGTERM
 * draining, bad input answered as serve answers it with no node called, 1,000 concurrent
 * streams (count and the router's VmRSS), the connection limit's 503, a slow client's
 * paused stream, the OpenAI Node SDK's calls (when node and npm are there), and the
 * lookup's count (pkv_kv_prefix_match) against what admission adopts.
 */
#include "tests/fuzz/props.h"
#include "tests/support/srvtest.h"
#include "tests/support/testutil.h"

#include "kv/kv.h"
#include "pagekv/kv.h"
#include "pagekv/server.h"

#include <curl/curl.h>
#include <dirent.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define SEC 1000000000ull

/* ---- HTTP client ------------------------------------------------------------------------ */

typedef struct {
    long status;
    char *body;
    size_t len;
    char headers[8192];
    size_t hlen;
    CURLcode cc;
} resp_t;

static bool buf_append(char **buf, size_t *len, const char *p, size_t k)
{
    char *nb = realloc(*buf, *len + k + 1);
    if (!nb) return false;
    *buf = nb;
    memcpy(nb + *len, p, k);
    *len += k;
    nb[*len] = 0;
    return true;
}

static size_t on_body(char *p, size_t sz, size_t n, void *arg)
{
    resp_t *r = arg;
    return buf_append(&r->body, &r->len, p, sz * n) ? sz * n : 0;
}

static size_t on_header(char *p, size_t sz, size_t n, void *arg)
{
    resp_t *r = arg;
    size_t k = sz * n;
    if (r->hlen + k < sizeof(r->headers)) {
        memcpy(r->headers + r->hlen, p, k);
        r->hlen += k;
        r->headers[r->hlen] = 0;
    }
    return k;
}

static void resp_free(resp_t *r)
{
    free(r->body);
    memset(r, 0, sizeof(*r));
}

/* One request (body NULL: none; xrid NULL: no X-Request-Id). */
static CURLcode http(uint16_t port, const char *method, const char *path, const char *body,
                     size_t body_len, const char *xrid, resp_t *r)
{
    memset(r, 0, sizeof(*r));
    CURL *c = curl_easy_init();
    PKV_CHECK(c != NULL);
    char url[256];
    snprintf(url, sizeof(url), "http://127.0.0.1:%u%s", port, path);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 60L);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, 10L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, r);
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    h = curl_slist_append(h, "Expect:");
    char xh[200];
    if (xrid) {
        snprintf(xh, sizeof(xh), "X-Request-Id: %s", xrid);
        h = curl_slist_append(h, xh);
    }
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    if (body) {
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)body_len);
    }
    r->cc = curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    return r->cc;
}

static json_t *jp(json_t *doc, const char *path)
{
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", path);
    json_t *v = doc;
    for (char *save = NULL, *t = strtok_r(buf, ".", &save); t && v; t = strtok_r(NULL, ".", &save))
        v = json_is_array(v) ? json_array_get(v, strtoul(t, NULL, 10)) : json_object_get(v, t);
    return v;
}

static long long ji(json_t *doc, const char *path)
{
    json_t *v = jp(doc, path);
    ck_assert_msg(json_is_integer(v), "%s is not an integer", path);
    return json_integer_value(v);
}

/* The value of a Prometheus sample line "NAME{LABELS} V" (exact prefix), -1 if absent. */
static long long metric(uint16_t port, const char *sample)
{
    resp_t r;
    if (http(port, "GET", "/metrics", NULL, 0, NULL, &r) != CURLE_OK || r.status != 200) {
        resp_free(&r);
        return -1;
    }
    long long v = -1;
    size_t n = strlen(sample);
    for (const char *p = r.body; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncmp(p, sample, n) && p[n] == ' ') {
            v = atoll(p + n + 1);
            break;
        }
    resp_free(&r);
    return v;
}

/* ---- answers ------------------------------------------------------------------------------- */

typedef struct {
    long status;
    char text[65536];
    char finish[16];
    long long prompt, completion;
    bool done;        /* streamed: [DONE] came */
    bool error_event; /* streamed: an error event came */
    int events;
    char xrid[160]; /* the answer's X-Request-Id header */
    char body[1024];
} answer_t;

static void sse_take(const char *body, size_t len, bool chat, answer_t *a)
{
    size_t i = 0;
    while (i < len) {
        const char *end = strstr(body + i, "\n\n");
        ck_assert_msg(end != NULL, "unterminated SSE event at %zu: %.80s", i, body + i);
        size_t elen = (size_t)(end - (body + i));
        ck_assert_msg(elen > 6 && !strncmp(body + i, "data: ", 6), "bad SSE line: %.60s", body + i);
        ck_assert_msg(!a->done, "event after [DONE]");
        if (elen == 12 && !strncmp(body + i + 6, "[DONE]", 6)) {
            a->done = true;
        } else {
            json_t *ev = json_loadb(body + i + 6, elen - 6, 0, NULL);
            ck_assert_msg(ev != NULL, "event is not JSON: %.*s", (int)elen, body + i);
            a->events++;
            if (json_object_get(ev, "error")) a->error_event = true;
            json_t *ch = jp(ev, "choices.0");
            json_t *t = ch ? (chat ? jp(ch, "delta.content") : json_object_get(ch, "text")) : NULL;
            if (json_is_string(t)) {
                size_t k = strlen(a->text);
                snprintf(a->text + k, sizeof(a->text) - k, "%s", json_string_value(t));
            }
            json_t *f = ch ? json_object_get(ch, "finish_reason") : NULL;
            if (json_is_string(f))
                snprintf(a->finish, sizeof(a->finish), "%s", json_string_value(f));
            json_t *u = json_object_get(ev, "usage");
            if (json_is_object(u)) {
                a->prompt = ji(u, "prompt_tokens");
                a->completion = ji(u, "completion_tokens");
            }
            json_decref(ev);
        }
        i += elen + 2;
    }
}

static void header_value(const char *headers, const char *name, char *out, size_t n)
{
    out[0] = 0;
    size_t k = strlen(name);
    for (const char *p = headers; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncasecmp(p, name, k) && p[k] == ':') {
            const char *v = p + k + 1;
            while (*v == ' ') v++;
            size_t m = strcspn(v, "\r\n");
            snprintf(out, n, "%.*s", (int)PKV_MIN(m, n - 1), v);
            return;
        }
}

/* POST req to path on port and take its answer apart. */
static void ask(uint16_t port, const char *path, json_t *req, const char *xrid, answer_t *a)
{
    memset(a, 0, sizeof(*a));
    bool chat = strstr(path, "chat") != NULL;
    bool stream = json_is_true(json_object_get(req, "stream"));
    char *body = json_dumps(req, JSON_COMPACT);
    resp_t r;
    CURLcode cc = http(port, "POST", path, body, strlen(body), xrid, &r);
    free(body);
    ck_assert_msg(cc == CURLE_OK, "curl: %s", curl_easy_strerror(cc));
    a->status = r.status;
    header_value(r.headers, "X-Request-Id", a->xrid, sizeof(a->xrid));
    snprintf(a->body, sizeof(a->body), "%s", r.body ? r.body : "");
    if (stream && r.status == 200) {
        sse_take(r.body ? r.body : "", r.len, chat, a);
    } else if (r.status == 200) {
        json_t *doc = json_loadb(r.body, r.len, 0, NULL);
        ck_assert_ptr_nonnull(doc);
        json_t *t = jp(doc, chat ? "choices.0.message.content" : "choices.0.text");
        snprintf(a->text, sizeof(a->text), "%s", json_string_value(t));
        snprintf(a->finish, sizeof(a->finish), "%s",
                 json_string_value(jp(doc, "choices.0.finish_reason")));
        a->prompt = ji(doc, "usage.prompt_tokens");
        a->completion = ji(doc, "usage.completion_tokens");
        json_decref(doc);
    }
    resp_free(&r);
}

static void same_answer(const answer_t *got, const answer_t *want, const char *what)
{
    ck_assert_msg(got->status == 200, "%s: status %ld: %s", what, got->status, got->body);
    ck_assert_msg(!strcmp(got->text, want->text), "%s: text differs:\n%s\n%s", what, got->text,
                  want->text);
    ck_assert_str_eq(got->finish, want->finish);
    ck_assert_int_eq(got->prompt, want->prompt);
    ck_assert_int_eq(got->completion, want->completion);
    ck_assert_int_eq(got->done, want->done);
    ck_assert(!got->error_event);
}

/* ---- processes ------------------------------------------------------------------------------ */

/* A child process whose stdout and stderr go to a file (read back as its log). */
typedef struct {
    pid_t pid;
    uint16_t port;
    char log_path[64];
} proc_t;

static char *proc_log(const proc_t *p)
{
    FILE *f = fopen(p->log_path, "r");
    ck_assert_ptr_nonnull(f);
    char *buf = NULL;
    size_t len = 0, cap = 0;
    char chunk[65536];
    size_t k;
    while ((k = fread(chunk, 1, sizeof(chunk), f)) > 0) {
        if (len + k + 1 > cap) {
            cap = (len + k + 1) * 2;
            buf = realloc(buf, cap);
            ck_assert_ptr_nonnull(buf);
        }
        memcpy(buf + len, chunk, k);
        len += k;
    }
    fclose(f);
    if (!buf) buf = calloc(1, 1);
    buf[len] = 0;
    return buf;
}

static int count_in(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

static int log_count(const proc_t *p, const char *needle)
{
    char *log = proc_log(p);
    int n = count_in(log, needle);
    free(log);
    return n;
}

/* Start argv (NULL-terminated) and wait for `ready` in its log; the port follows it. */
static void proc_start(proc_t *p, char *const argv[], const char *ready)
{
    memset(p, 0, sizeof(*p));
    snprintf(p->log_path, sizeof(p->log_path), "/tmp/pkv-test-router-XXXXXX");
    int fd = mkstemp(p->log_path);
    ck_assert_int_ge(fd, 0);
    pid_t parent = getpid();
    p->pid = fork();
    ck_assert_int_ge(p->pid, 0);
    if (p->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(99);
        setenv("PKV_LOG", "info", 1);
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
        execv(argv[0], argv);
        _exit(98);
    }
    close(fd);
    uint64_t deadline = pkv_deadline_after_ns(30 * SEC);
    for (;;) {
        char *log = proc_log(p);
        const char *at = strstr(log, ready);
        if (at) p->port = (uint16_t)atoi(at + strlen(ready));
        int status;
        bool dead = waitpid(p->pid, &status, WNOHANG) == p->pid;
        if (at || dead || pkv_now_ns() > deadline) {
            ck_assert_msg(at, "%s did not start; log:\n%s", argv[1], log);
            free(log);
            return;
        }
        free(log);
        usleep(20000);
    }
}

/* SIGTERM and wait: the exit status. */
static int proc_stop(proc_t *p, int timeout_s)
{
    if (!p->pid) return 0;
    kill(p->pid, SIGCONT);
    kill(p->pid, SIGTERM);
    uint64_t deadline = pkv_deadline_after_ns((uint64_t)timeout_s * SEC);
    int status = 0;
    while (waitpid(p->pid, &status, WNOHANG) != p->pid) {
        if (pkv_now_ns() > deadline) {
            kill(p->pid, SIGKILL);
            waitpid(p->pid, &status, 0);
            ck_abort_msg("pid %d did not exit within %d s", (int)p->pid, timeout_s);
        }
        usleep(10000);
    }
    p->pid = 0;
    unlink(p->log_path);
    return status;
}

static void proc_kill(proc_t *p)
{
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    p->pid = 0;
    unlink(p->log_path);
}

static char BIN[4096];

/* SIGSTOP pid and wait until every thread of it is stopped (a thread already running
 * when the signal came may still answer a request it was serving). */
static void stop_process(pid_t pid)
{
    kill(pid, SIGSTOP);
    uint64_t deadline = pkv_deadline_after_ns(10 * SEC);
    for (;;) {
        char path[64];
        snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
        DIR *dir = opendir(path);
        ck_assert_ptr_nonnull(dir);
        bool all = true;
        for (struct dirent *e; (e = readdir(dir));) {
            if (e->d_name[0] == '.') continue;
            char sp[400], buf[512];
            snprintf(sp, sizeof(sp), "%s/%s/stat", path, e->d_name);
            FILE *f = fopen(sp, "r");
            if (!f) continue;
            size_t k = fread(buf, 1, sizeof(buf) - 1, f);
            fclose(f);
            buf[k] = 0;
            const char *rp = strrchr(buf, ')');
            if (rp && rp[1] == ' ' && rp[2] != 'T' && rp[2] != 't') all = false;
        }
        closedir(dir);
        if (all) return;
        ck_assert_msg(pkv_now_ns() < deadline, "pid %d did not stop", (int)pid);
        usleep(1000);
    }
}

/* A `pagekv serve --role ROLE` child; extra: more arguments (NULL-terminated) or NULL. */
static void node_start(proc_t *p, const char *role, const char *const *extra)
{
    char *argv[40] = {BIN, "serve", "--port", "0", "--threads", "1", "--role", (char *)role};
    int n = 8;
    for (; extra && *extra; extra++) argv[n++] = (char *)*extra;
    argv[n] = NULL;
    proc_start(p, argv, "pagekv serve: listening on 127.0.0.1:");
}

/* A `pagekv route` child over the nodes; extra arguments as above. */
static void router_start(proc_t *rt, const proc_t *pre, int np, const proc_t *dec, int nd,
                         const char *const *extra)
{
    static char urls[16][64];
    char *argv[64] = {BIN, "route", "--port", "0"};
    int n = 4, u = 0;
    for (int i = 0; i < np + nd; i++, u++) {
        const proc_t *node = i < np ? &pre[i] : &dec[i - np];
        snprintf(urls[u], sizeof(urls[u]), "http://127.0.0.1:%u", node->port);
        argv[n++] = i < np ? "--prefill" : "--decode";
        argv[n++] = urls[u];
    }
    for (; extra && *extra; extra++) argv[n++] = (char *)*extra;
    argv[n] = NULL;
    proc_start(rt, argv, "pagekv route: listening on http://127.0.0.1:");
}

/* Wait for the router's /health to answer `want`. */
static void health_is(uint16_t port, long want)
{
    if (getenv("PKV_TEST_DEBUG")) fprintf(stderr, "health_is port %u\n", port);
    uint64_t deadline = pkv_deadline_after_ns(15 * SEC);
    for (;;) {
        resp_t r;
        http(port, "GET", "/health", NULL, 0, NULL, &r);
        long st = r.status;
        resp_free(&r);
        if (st == want) return;
        if (pkv_now_ns() >= deadline && getenv("PKV_TEST_DEBUG")) sleep(600);
        ck_assert_msg(pkv_now_ns() < deadline, "/health stayed %ld (want %ld)", st, want);
        usleep(20000);
    }
}

static pkv_server_t *unified(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
    pkv_server_config_t cfg = {.threads = 1, .kv_dtype = PKV_DTYPE_F16};
    pkv_server_t *s = NULL;
    ck_assert_int_eq(pkv_server_create(&cfg, &s), PKV_OK);
    return s;
}

static json_t *completion_req(const char *prompt, int max_tokens, bool stream, int seed)
{
    json_t *r = json_pack("{s:s, s:s, s:i, s:b}", "model", "tiny", "prompt", prompt, "max_tokens",
                          max_tokens, "stream", (int)stream);
    if (seed >= 0) {
        json_object_set_new(r, "temperature", json_real(0.9));
        json_object_set_new(r, "seed", json_integer(seed));
    } else {
        json_object_set_new(r, "temperature", json_real(0));
    }
    return r;
}

static json_t *chat_req(const char *content, int max_tokens, bool stream, int seed)
{
    json_t *r =
        json_pack("{s:s, s:[{s:s, s:s}], s:i, s:b}", "model", "tiny", "messages", "role", "user",
                  "content", content, "max_tokens", max_tokens, "stream", (int)stream);
    if (seed >= 0) {
        json_object_set_new(r, "temperature", json_real(0.9));
        json_object_set_new(r, "seed", json_integer(seed));
    } else {
        json_object_set_new(r, "temperature", json_real(0));
    }
    return r;
}

static void setup(void)
{
    ts_pagekv_path(BIN, sizeof(BIN));
    curl_global_init(CURL_GLOBAL_DEFAULT);
}

/* ---- parity ------------------------------------------------------------------------------- */

typedef struct {
    uint16_t router, unified;
    json_t *req;
    const char *path;
    char xrid[64];
} par_case_t;

static void *par_main(void *arg)
{
    par_case_t *c = arg;
    answer_t *got = malloc(sizeof(*got)), *want = malloc(sizeof(*want));
    ask(c->unified, c->path, c->req, NULL, want);
    ask(c->router, c->path, c->req, c->xrid, got);
    same_answer(got, want, c->path);
    ck_assert_str_eq(got->xrid, c->xrid);
    free(got);
    free(want);
    return NULL;
}

/* Completions and chat, streamed and not, greedy and seeded, one by one and 8 at once:
 * every answer equals the unified node's; X-Request-Id reaches both nodes' logs (the
 * client's, or one the router made up and answers with). */
START_TEST(answers_equal_unified)
{
    proc_t p, d, rt;
    node_start(&p, "prefill", NULL);
    node_start(&d, "decode", NULL);
    router_start(&rt, &p, 1, &d, 1, NULL);
    pkv_server_t *u = unified();
    health_is(rt.port, 200);
    par_case_t cases[8];
    pthread_t th[8];
    for (int i = 0; i < 8; i++) {
        char text[128];
        snprintf(text, sizeof(text), "Case %d: the router sends two legs and relays one answer", i);
        bool chat = i & 1, stream = i & 2;
        int seed = i & 4 ? 11 + i : -1;
        cases[i] = (par_case_t){.router = rt.port, .unified = pkv_server_port(u)};
        cases[i].req =
            chat ? chat_req(text, 12, stream, seed) : completion_req(text, 12, stream, seed);
        cases[i].path = chat ? "/v1/chat/completions" : "/v1/completions";
        snprintf(cases[i].xrid, sizeof(cases[i].xrid), "parity-%d", i);
    }
    for (int i = 0; i < 8; i++) par_main(&cases[i]); /* one at a time */
    for (int i = 0; i < 8; i++) snprintf(cases[i].xrid, sizeof(cases[i].xrid), "conc-%d", i);
    for (int i = 0; i < 8; i++) pthread_create(&th[i], NULL, par_main, &cases[i]);
    for (int i = 0; i < 8; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 8; i++) {
        char line[80];
        snprintf(line, sizeof(line), "(prefill leg), X-Request-Id %s\n", cases[i].xrid);
        ck_assert_int_eq(log_count(&p, line), 1);
        snprintf(line, sizeof(line), "(decode leg), X-Request-Id %s\n", cases[i].xrid);
        ck_assert_int_eq(log_count(&d, line), 1);
        json_decref(cases[i].req);
    }
    /* No X-Request-Id: the router makes one, answers with it and sends it to both legs. */
    json_t *req = completion_req("No request id given", 4, false, -1);
    answer_t *a = malloc(sizeof(*a));
    ask(rt.port, "/v1/completions", req, NULL, a);
    ck_assert_int_eq(a->status, 200);
    ck_assert_uint_gt(strlen(a->xrid), 0);
    char line[200];
    snprintf(line, sizeof(line), "X-Request-Id %s\n", a->xrid);
    ck_assert_int_eq(log_count(&p, line), 1);
    ck_assert_int_eq(log_count(&d, line), 1);
    free(a);
    json_decref(req);
    /* /v1/models comes from the nodes. */
    resp_t r;
    http(rt.port, "GET", "/v1/models", NULL, 0, NULL, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strstr(r.body, "\"id\":\"tiny\""));
    resp_free(&r);
    http(rt.port, "GET", "/v1/models/tiny", NULL, 0, NULL, &r);
    ck_assert_int_eq(r.status, 200);
    resp_free(&r);
    ck_assert_int_eq(metric(rt.port, "pagekv_router_leg_seconds_count{role=\"prefill\"}"), 17);
    ck_assert_int_eq(metric(rt.port, "pagekv_router_leg_seconds_count{role=\"decode\"}"), 17);
    pkv_server_destroy(u);
    int st = proc_stop(&rt, 30);
    ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    proc_stop(&d, 30);
    proc_stop(&p, 30);
}
END_TEST

/* ---- routing ------------------------------------------------------------------------------- */

START_TEST(round_robin_spreads)
{
    proc_t p[2], d[2], rt;
    for (int i = 0; i < 2; i++) node_start(&p[i], "prefill", NULL);
    for (int i = 0; i < 2; i++) node_start(&d[i], "decode", NULL);
    const char *extra[] = {"--policy", "round_robin", NULL};
    router_start(&rt, p, 2, d, 2, extra);
    health_is(rt.port, 200);
    for (int i = 0; i < 8; i++) {
        json_t *req = completion_req("Round and round", 3, i & 1, -1);
        answer_t *a = malloc(sizeof(*a));
        ask(rt.port, "/v1/completions", req, NULL, a);
        ck_assert_int_eq(a->status, 200);
        free(a);
        json_decref(req);
    }
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(log_count(&p[i], "(prefill leg)"), 4);
        ck_assert_int_eq(log_count(&d[i], "(decode leg)"), 4);
    }
    proc_stop(&rt, 30);
    for (int i = 0; i < 2; i++) proc_stop(&p[i], 30), proc_stop(&d[i], 30);
}
END_TEST

static const char *LONG_PREFIX =
    "You are the assistant of a long shared system prompt, long enough to fill several KV "
    "blocks of sixteen tokens each, so that a prefill node that served it once holds its "
    "prefix and a cache-aware router sends the next request with it there. ";

/* /v1/cache/lookup itself (per tenant), then cache_aware sending a request whose prefix
 * one of two prefill nodes holds to that node. */
START_TEST(cache_aware_finds_the_prefix)
{
    proc_t p[2], d, rt;
    for (int i = 0; i < 2; i++) node_start(&p[i], "prefill", NULL);
    node_start(&d, "decode", NULL);
    router_start(&rt, p, 2, &d, 1, NULL);
    health_is(rt.port, 200);
    char prompt[1024];
    snprintf(prompt, sizeof(prompt), "%sQuestion one.", LONG_PREFIX);
    /* Warm p[1] directly (a plain request on a prefill node is served as any). */
    json_t *req = completion_req(prompt, 2, false, -1);
    answer_t *a = malloc(sizeof(*a));
    ask(p[1].port, "/v1/completions", req, NULL, a);
    ck_assert_int_eq(a->status, 200);
    /* The lookup: p[1] holds whole blocks of it, p[0] nothing, another tenant nothing. */
    char *body = json_dumps(req, JSON_COMPACT);
    resp_t r;
    http(p[1].port, "POST", "/v1/cache/lookup", body, strlen(body), NULL, &r);
    ck_assert_int_eq(r.status, 200);
    json_t *doc = json_loads(r.body, 0, NULL);
    long long matched = ji(doc, "matched_tokens"), prompt_tokens = ji(doc, "prompt_tokens");
    ck_assert_int_eq(prompt_tokens, a->prompt);
    ck_assert_int_eq(matched, (prompt_tokens - 1) / 16 * 16);
    ck_assert_int_gt(matched, 32);
    json_decref(doc);
    resp_free(&r);
    free(body);
    http(p[0].port, "POST", "/v1/cache/lookup", "{\"model\":\"tiny\",\"prompt\":\"abc\"}", 31, NULL,
         &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strstr(r.body, "\"matched_tokens\":0"));
    resp_free(&r);
    json_t *other = json_deep_copy(req);
    json_object_set_new(other, "cache_salt", json_string("tenant-b"));
    body = json_dumps(other, JSON_COMPACT);
    http(p[1].port, "POST", "/v1/cache/lookup", body, strlen(body), NULL, &r);
    ck_assert_ptr_nonnull(strstr(r.body, "\"matched_tokens\":0"));
    resp_free(&r);
    free(body);
    json_decref(other);
    http(p[1].port, "POST", "/v1/cache/lookup", "{\"model\":\"tiny\"}", 16, NULL, &r);
    ck_assert_int_eq(r.status, 400);
    resp_free(&r);
    json_decref(req);
    /* Through the router: every request with the prefix goes to p[1]. */
    for (int i = 0; i < 3; i++) {
        snprintf(prompt, sizeof(prompt), "%sQuestion %d, streamed or not.", LONG_PREFIX, i + 2);
        req = completion_req(prompt, 4, i > 0, i == 2 ? 5 : -1);
        ask(rt.port, "/v1/completions", req, NULL, a);
        ck_assert_msg(a->status == 200, "%s", a->body);
        json_decref(req);
    }
    ck_assert_int_eq(log_count(&p[1], "(prefill leg)"), 3);
    ck_assert_int_eq(log_count(&p[0], "(prefill leg)"), 0);
    ck_assert_int_ge(metric(rt.port, "pagekv_router_lookups_total"), 6);
    /* The holder stopped: its lookup gets no answer within --lookup-timeout-ms (or its
     * probe marked it down first), the other node serves the request. */
    stop_process(p[1].pid);
    snprintf(prompt, sizeof(prompt), "%sQuestion five, holder stopped.", LONG_PREFIX);
    req = completion_req(prompt, 4, true, -1);
    uint64_t t0 = pkv_now_ns();
    ask(rt.port, "/v1/completions", req, NULL, a);
    ck_assert_msg(a->status == 200 && a->done, "%ld %s", a->status, a->body);
    if (pkv_now_ns() - t0 >= 10 * SEC && getenv("PKV_TEST_DEBUG")) {
        char *log = proc_log(&rt);
        fprintf(stderr, "p0 %u p1 %u router log:\n%s\n", p[0].port, p[1].port, log);
        free(log);
    }
    ck_assert_uint_lt(pkv_now_ns() - t0, 10 * SEC);
    ck_assert_int_eq(log_count(&p[0], "(prefill leg)"), 1);
    json_decref(req);
    kill(p[1].pid, SIGCONT);
    free(a);
    proc_stop(&rt, 30);
    proc_stop(&d, 30);
    for (int i = 0; i < 2; i++) proc_stop(&p[i], 30);
}
END_TEST

/* ---- failures ------------------------------------------------------------------------------ */

static void ask_ok_within(uint16_t port, uint64_t bound_ns, const char *what)
{
    json_t *req = completion_req("Skip the node that is gone", 3, true, -1);
    answer_t *a = malloc(sizeof(*a));
    uint64_t t0 = pkv_now_ns();
    ask(port, "/v1/completions", req, NULL, a);
    uint64_t took = pkv_now_ns() - t0;
    ck_assert_msg(a->status == 200 && a->done, "%s: %ld %s", what, a->status, a->body);
    ck_assert_msg(took < bound_ns, "%s: took %.1f s", what, (double)took / 1e9);
    free(a);
    json_decref(req);
}

/* A killed prefill node, a stopped decode node: skipped within the deadline; a producer
 * nobody can reach (peer_lost): both legs again elsewhere; no decode node left: 503. */
START_TEST(dead_and_stopped_nodes_skipped)
{
    proc_t p[3], d[2], rt;
    for (int i = 0; i < 2; i++) node_start(&p[i], "prefill", NULL);
    /* p[2] advertises an address where nothing listens: its decode legs fail peer_lost. */
    const char *bad[] = {"--kv-advertise", "127.0.0.2", NULL};
    node_start(&p[2], "prefill", bad);
    const char *fast[] = {"--kv-transfer-timeout-ms", "2000", NULL};
    for (int i = 0; i < 2; i++) node_start(&d[i], "decode", fast);
    const char *extra[] = {"--policy",
                           "round_robin",
                           "--node-timeout-ms",
                           "1500",
                           "--request-timeout-ms",
                           "8000",
                           "--health-interval-ms",
                           "200",
                           NULL};
    router_start(&rt, p, 3, d, 2, extra);
    health_is(rt.port, 200);
    /* Three requests: one of them starts on p[2], is lost and runs again on another. */
    for (int i = 0; i < 3; i++) ask_ok_within(rt.port, 8 * SEC, "peer lost");
    ck_assert_int_ge(metric(rt.port, "pagekv_router_retries_total{cause=\"peer_lost\"}"), 1);
    /* A killed prefill node (before the router noticed) and a stopped decode node. */
    proc_kill(&p[0]);
    for (int i = 0; i < 3; i++) ask_ok_within(rt.port, 8 * SEC, "prefill killed");
    stop_process(d[1].pid);
    for (int i = 0; i < 3; i++) ask_ok_within(rt.port, 8 * SEC, "decode stopped");
    ck_assert_int_ge(
        metric(rt.port, "pagekv_router_errors_total{role=\"decode\",cause=\"timeout\"}") +
            metric(rt.port, "pagekv_router_errors_total{role=\"prefill\",cause=\"connect\"}"),
        1);
    /* No decode node left: 503 with the reason, and /health 503. */
    proc_kill(&d[0]);
    proc_kill(&d[1]);
    json_t *req = completion_req("Nobody decodes", 3, false, -1);
    answer_t *a = malloc(sizeof(*a));
    uint64_t t0 = pkv_now_ns();
    ask(rt.port, "/v1/completions", req, NULL, a);
    ck_assert_msg(a->status == 503, "%ld %s", a->status, a->body);
    ck_assert_ptr_nonnull(strstr(a->body, "\"code\":\"no_node_available\""));
    ck_assert_ptr_nonnull(strstr(a->body, "decode"));
    ck_assert_uint_lt(pkv_now_ns() - t0, 9 * SEC);
    free(a);
    json_decref(req);
    health_is(rt.port, 503);
    proc_stop(&rt, 30);
    proc_stop(&p[1], 30);
    proc_stop(&p[2], 30);
}
END_TEST

typedef struct streamer streamer_t;
static void *streamer_main(void *arg);
struct streamer {
    uint16_t port;
    pid_t kill_pid; /* killed (SIGKILL) after the first events, when set */
    int kill_after;
    char *body;
    size_t len;
    atomic_int events;
    CURLcode cc;
    long status;
};

static size_t streamer_write(char *p, size_t sz, size_t n, void *arg)
{
    streamer_t *s = arg;
    size_t k = sz * n;
    buf_append(&s->body, &s->len, p, k);
    int ev = count_in(s->body, "\n\n");
    atomic_store(&s->events, ev);
    if (s->kill_pid && ev >= s->kill_after) {
        kill(s->kill_pid, SIGKILL);
        s->kill_pid = 0;
    }
    return k;
}

static void *streamer_main(void *arg)
{
    streamer_t *s = arg;
    CURL *c = curl_easy_init();
    char url[128];
    snprintf(url, sizeof(url), "http://127.0.0.1:%u/v1/completions", s->port);
    const char *body = "{\"model\":\"tiny\",\"prompt\":\"A long story\",\"max_tokens\":400,"
                       "\"ignore_eos\":true,\"temperature\":0,\"stream\":true}";
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 60L);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, streamer_write);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, s);
    s->cc = curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &s->status);
    curl_easy_cleanup(c);
    if (getenv("PKV_TEST_DEBUG"))
        fprintf(stderr, "streamer: cc %d status %ld %.200s\n", s->cc, s->status, s->body);
    return NULL;
}

/* A prefill node killed while it holds a prefill leg (SIGSTOPped first, so the leg is
 * surely in it): the leg is run again on the other prefill node; the client sees only a
 * whole answer. */
START_TEST(prefill_killed_mid_request)
{
    proc_t p[2], d, rt;
    for (int i = 0; i < 2; i++) node_start(&p[i], "prefill", NULL);
    node_start(&d, "decode", NULL);
    const char *extra[] = {"--policy", "round_robin", NULL};
    router_start(&rt, p, 2, &d, 1, extra);
    health_is(rt.port, 200);
    char sample[160];
    snprintf(sample, sizeof(sample),
             "pagekv_router_node_in_flight{role=\"prefill\",node=\"http://127.0.0.1:%u\"}",
             p[0].port);
    stop_process(p[0].pid);
    streamer_t s[2] = {{.port = rt.port}, {.port = rt.port}};
    pthread_t th[2];
    int started = 0;
    uint64_t deadline = pkv_deadline_after_ns(20 * SEC);
    while (metric(rt.port, sample) < 1) {
        ck_assert(pkv_now_ns() < deadline);
        if (started < 2 && (started == 0 || atomic_load(&s[started - 1].events) > 0 ||
                            metric(rt.port, "pagekv_router_in_flight") == started)) {
            pthread_create(&th[started], NULL, streamer_main, &s[started]);
            started++;
        }
        usleep(20000);
    }
    proc_kill(&p[0]);
    for (int i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(s[i].cc, CURLE_OK);
        ck_assert_int_eq(s[i].status, 200);
        answer_t *a = calloc(1, sizeof(*a));
        sse_take(s[i].body, s[i].len, false, a);
        ck_assert(a->done && !a->error_event);
        ck_assert_str_eq(a->finish, "length");
        free(a);
        free(s[i].body);
    }
    ck_assert_int_ge(metric(rt.port, "pagekv_router_retries_total{cause=\"connect\"}") +
                         metric(rt.port, "pagekv_router_retries_total{cause=\"broken\"}"),
                     1);
    proc_stop(&rt, 30);
    proc_stop(&d, 30);
    proc_stop(&p[1], 30);
}
END_TEST

/* A decode node killed mid-stream: the client's stream ends with an error event (no
 * silence, no retry, nothing repeated). */
START_TEST(decode_killed_mid_stream)
{
    proc_t p, d[2], rt;
    node_start(&p, "prefill", NULL);
    for (int i = 0; i < 2; i++) node_start(&d[i], "decode", NULL);
    const char *extra[] = {"--policy", "round_robin", NULL};
    router_start(&rt, &p, 1, d, 2, extra);
    health_is(rt.port, 200);
    streamer_t s = {.port = rt.port, .kill_pid = d[0].pid, .kill_after = 3};
    pthread_t th;
    pthread_create(&th, NULL, streamer_main, &s);
    pthread_join(th, NULL);
    waitpid(d[0].pid, NULL, 0);
    unlink(d[0].log_path);
    d[0].pid = 0;
    ck_assert_int_eq(s.cc, CURLE_OK);
    ck_assert_int_eq(s.status, 200);
    answer_t *a = calloc(1, sizeof(*a));
    sse_take(s.body, s.len, false, a);
    ck_assert(a->error_event);
    ck_assert(!a->done);
    ck_assert_int_ge(a->events, 4);
    ck_assert_ptr_nonnull(strstr(s.body, "\"code\":\"upstream_lost\""));
    ck_assert_int_eq(metric(rt.port, "pagekv_router_stream_errors_total"), 1);
    ck_assert_int_eq(log_count(&d[1], "(decode leg)"), 0); /* not retried */
    free(a);
    free(s.body);
    proc_stop(&rt, 30);
    proc_stop(&d[1], 30);
    proc_stop(&p, 30);
}
END_TEST

/* SIGTERM of the router: the stream in flight finishes whole, a new request gets 503,
 * the router exits 0. */
START_TEST(sigterm_drains)
{
    proc_t p, d, rt;
    node_start(&p, "prefill", NULL);
    node_start(&d, "decode", NULL);
    router_start(&rt, &p, 1, &d, 1, NULL);
    health_is(rt.port, 200);
    streamer_t s = {.port = rt.port};
    pthread_t th;
    pthread_create(&th, NULL, streamer_main, &s);
    uint64_t deadline = pkv_deadline_after_ns(20 * SEC);
    while (atomic_load(&s.events) < 2) {
        ck_assert(pkv_now_ns() < deadline);
        usleep(1000);
    }
    stop_process(d.pid); /* hold the stream in flight */
    kill(rt.pid, SIGTERM);
    health_is(rt.port, 503); /* draining */
    json_t *req = completion_req("Too late", 3, false, -1);
    answer_t *a = malloc(sizeof(*a));
    ask(rt.port, "/v1/completions", req, NULL, a);
    ck_assert_int_eq(a->status, 503);
    ck_assert_ptr_nonnull(strstr(a->body, "shutting_down"));
    resp_t r;
    http(rt.port, "GET", "/health", NULL, 0, NULL, &r);
    ck_assert_int_eq(r.status, 503);
    resp_free(&r);
    kill(d.pid, SIGCONT);
    pthread_join(th, NULL);
    ck_assert_int_eq(s.cc, CURLE_OK);
    memset(a, 0, sizeof(*a));
    sse_take(s.body, s.len, false, a);
    ck_assert(a->done && !a->error_event);
    ck_assert_str_eq(a->finish, "length");
    int status = 0;
    deadline = pkv_deadline_after_ns(20 * SEC);
    while (waitpid(rt.pid, &status, WNOHANG) != rt.pid) {
        ck_assert_msg(pkv_now_ns() < deadline, "the router did not exit");
        usleep(10000);
    }
    ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    rt.pid = 0;
    free(a);
    free(s.body);
    json_decref(req);
    proc_stop(&d, 30);
    proc_stop(&p, 30);
}
END_TEST

/* A client that stops reading: the router pauses the node's transfer once its buffer for
 * the client is full (bounded memory) and resumes it when the client reads again; the
 * answer arrives whole and equal to a unified node's. */
typedef struct {
    CURL *c;
    char *body;
    size_t len;
    atomic_bool hold;
    bool paused;
} slow_t;

static size_t slow_write(char *p, size_t sz, size_t n, void *arg)
{
    slow_t *s = arg;
    if (atomic_load(&s->hold) && s->len > 0) {
        s->paused = true;
        return CURL_WRITEFUNC_PAUSE;
    }
    buf_append(&s->body, &s->len, p, sz * n);
    return sz * n;
}

static int slow_progress(void *arg, curl_off_t a, curl_off_t b, curl_off_t c, curl_off_t d)
{
    slow_t *s = arg;
    if (s->paused && !atomic_load(&s->hold)) {
        s->paused = false;
        curl_easy_pause(s->c, CURLPAUSE_CONT);
    }
    return 0;
}

static int small_rcvbuf(void *arg, curl_socket_t fd, curlsocktype purpose)
{
    int v = 4096;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &v, sizeof(v));
    return CURL_SOCKOPT_OK;
}

static void *slow_main(void *arg)
{
    slow_t *s = arg;
    curl_easy_perform(s->c);
    return NULL;
}

START_TEST(slow_client_pauses_the_node)
{
    proc_t p, d, rt;
    node_start(&p, "prefill", NULL);
    node_start(&d, "decode", NULL);
    /* a small stream buffer: a loaded machine coalesces tokens into fewer, larger events,
       so the stream's bytes must exceed the buffer with room to spare */
    static const char *const small_buf[] = {"--stream-buffer-bytes", "16K", NULL};
    router_start(&rt, &p, 1, &d, 1, small_buf);
    pkv_server_t *u = unified();
    health_is(rt.port, 200);
    json_t *req = completion_req("A client that reads slowly", 3000, true, -1);
    json_object_set_new(req, "ignore_eos", json_true());
    char *body = json_dumps(req, JSON_COMPACT);
    slow_t s = {.c = curl_easy_init()};
    atomic_init(&s.hold, true);
    char url[128];
    snprintf(url, sizeof(url), "http://127.0.0.1:%u/v1/completions", rt.port);
    curl_easy_setopt(s.c, CURLOPT_URL, url);
    curl_easy_setopt(s.c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(s.c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(s.c, CURLOPT_TIMEOUT, 90L);
    curl_easy_setopt(s.c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(s.c, CURLOPT_WRITEFUNCTION, slow_write);
    curl_easy_setopt(s.c, CURLOPT_WRITEDATA, &s);
    curl_easy_setopt(s.c, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(s.c, CURLOPT_XFERINFOFUNCTION, slow_progress);
    curl_easy_setopt(s.c, CURLOPT_XFERINFODATA, &s);
    curl_easy_setopt(s.c, CURLOPT_SOCKOPTFUNCTION, small_rcvbuf);
    curl_easy_setopt(s.c, CURLOPT_BUFFERSIZE, 1024L);
    pthread_t th;
    pthread_create(&th, NULL, slow_main, &s);
    uint64_t deadline = pkv_deadline_after_ns(60 * SEC);
    while (metric(rt.port, "pagekv_router_stream_pauses_total") < 1) {
        ck_assert_msg(pkv_now_ns() < deadline, "the router never paused the node's transfer");
        usleep(50000);
    }
    atomic_store(&s.hold, false);
    pthread_join(th, NULL);
    long status = 0;
    curl_easy_getinfo(s.c, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(s.c);
    ck_assert_int_eq(status, 200);
    answer_t *got = calloc(1, sizeof(*got)), *want = malloc(sizeof(*want));
    sse_take(s.body, s.len, false, got);
    ask(pkv_server_port(u), "/v1/completions", req, NULL, want);
    ck_assert(got->done && !got->error_event);
    ck_assert_int_eq(got->completion, 0); /* no usage chunk asked for */
    ck_assert_str_eq(got->finish, want->finish);
    ck_assert_msg(!strcmp(got->text, want->text), "the relayed text differs");
    free(got);
    free(want);
    free(s.body);
    free(body);
    json_decref(req);
    pkv_server_destroy(u);
    proc_stop(&rt, 30);
    proc_stop(&d, 30);
    proc_stop(&p, 30);
}
END_TEST

/* ---- bad input ------------------------------------------------------------------------------ */

/* Bad input: the same status and error document as serve's, and no node called. */
START_TEST(bad_input_as_serve_no_node_called)
{
    proc_t p, d, rt;
    node_start(&p, "prefill", NULL);
    node_start(&d, "decode", NULL);
    const char *extra[] = {"--max-body-bytes", "4K", NULL};
    router_start(&rt, &p, 1, &d, 1, extra);
    pkv_server_config_t cfg = {.threads = 1, .kv_dtype = PKV_DTYPE_F16, .max_body_bytes = 4096};
    pkv_server_t *u = NULL;
    ck_assert_int_eq(pkv_server_create(&cfg, &u), PKV_OK);
    uint16_t up = pkv_server_port(u);
    health_is(rt.port, 200);
    /* a first good request: the router has learnt the model */
    json_t *req = completion_req("warm", 2, false, -1);
    answer_t *a = malloc(sizeof(*a));
    ask(rt.port, "/v1/completions", req, NULL, a);
    ck_assert_int_eq(a->status, 200);
    free(a);
    json_decref(req);
    int p_before = log_count(&p, "X-Request-Id"), d_before = log_count(&d, "X-Request-Id");
    char big[6000];
    memset(big, 'a', sizeof(big));
    snprintf(big, sizeof(big), "{\"model\":\"tiny\",\"prompt\":\"%5000d\"}", 1);
    const struct {
        const char *method, *path, *body;
    } cases[] = {
        {"POST", "/v1/completions", "{not json"},
        {"POST", "/v1/completions", ""},
        {"POST", "/v1/completions", "[1,2]"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\",\"prompt\":\"x\",\"bogus\":1}"},
        {"POST", "/v1/completions", "{\"model\":\"other\",\"prompt\":\"x\"}"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\"}"},
        {"POST", "/v1/completions", "{\"prompt\":\"x\"}"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":0}"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":99999}"},
        {"POST", "/v1/completions",
         "{\"model\":\"tiny\",\"prompt\":\"x\",\"temperature\":\"hot\"}"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\",\"prompt\":[\"a\",\"b\"]}"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\",\"prompt\":\"x\",\"n\":2}"},
        {"POST", "/v1/completions",
         "{\"model\":\"tiny\",\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}"},
        {"POST", "/v1/chat/completions", "{\"model\":\"tiny\",\"messages\":[{\"role\":\"x\"}]}"},
        {"POST", "/v1/chat/completions", "{\"model\":\"tiny\",\"messages\":\"hi\"}"},
        {"POST", "/v1/chat/completions", "{\"model\":\"tiny\"}"},
        {"GET", "/v1/completions", NULL},
        {"DELETE", "/v1/models", NULL},
        {"GET", "/v2/nothing", NULL},
        {"POST", "/v1/completions", big},
    };
    for (size_t i = 0; i < PKV_ARRAY_LEN(cases); i++) {
        resp_t want, got;
        size_t len = cases[i].body ? strlen(cases[i].body) : 0;
        http(up, cases[i].method, cases[i].path, cases[i].body, len, NULL, &want);
        http(rt.port, cases[i].method, cases[i].path, cases[i].body, len, NULL, &got);
        ck_assert_msg(got.status == want.status && got.status >= 400,
                      "case %zu: %ld vs serve's %ld: %s", i, got.status, want.status, got.body);
        ck_assert_msg(!strcmp(got.body ? got.body : "", want.body ? want.body : ""),
                      "case %zu:\n%s\n%s", i, got.body, want.body);
        resp_free(&want);
        resp_free(&got);
    }
    /* kv_transfer_params are the router's to set: 400 as on a unified node. */
    resp_t got;
    const char *kvt = "{\"model\":\"tiny\",\"prompt\":\"x\",\"kv_transfer_params\":{"
                      "\"do_remote_decode\":true}}";
    http(rt.port, "POST", "/v1/completions", kvt, strlen(kvt), NULL, &got);
    ck_assert_int_eq(got.status, 400);
    ck_assert_ptr_nonnull(strstr(got.body, "\"code\":\"unsupported_parameter\""));
    ck_assert_ptr_nonnull(strstr(got.body, "\"param\":\"kv_transfer_params\""));
    resp_free(&got);
    ck_assert_int_eq(log_count(&p, "X-Request-Id"), p_before);
    ck_assert_int_eq(log_count(&d, "X-Request-Id"), d_before);
    ck_assert_int_ge(metric(rt.port, "pagekv_router_rejected_total{reason=\"invalid_request\"}"),
                     15);
    pkv_server_destroy(u);
    proc_stop(&rt, 30);
    proc_stop(&d, 30);
    proc_stop(&p, 30);
}
END_TEST

START_TEST(cli_rejects_bad_flags)
{
    const char *cases[][6] = {
        {"route", "--decode", "http://127.0.0.1:1", NULL},
        {"route", "--prefill", "http://127.0.0.1:1", NULL},
        {"route", "--prefill", "127.0.0.1:1", "--decode", "http://127.0.0.1:2", NULL},
        {"route", "--prefill", "http://a:1", "--decode", "http://b:2", "--policy"},
        {"route", "--prefill", "http://a:1", "--decode", "http://b:2", "--port"},
        {"route", "--bogus", "1", NULL},
        {"route", "--prefill", "http://a:1", "--decode", "http://b:2", "--stream-buffer-bytes"},
    };
    const char *tails[][2] = {{NULL, NULL},    {NULL, NULL}, {NULL, NULL}, {"random", NULL},
                              {"70000", NULL}, {NULL, NULL}, {"1K", NULL}};
    for (size_t i = 0; i < PKV_ARRAY_LEN(cases); i++) {
        char *argv[10] = {BIN};
        int n = 1;
        for (int k = 0; k < 6 && cases[i][k]; k++) argv[n++] = (char *)cases[i][k];
        if (tails[i][0]) argv[n++] = (char *)tails[i][0];
        argv[n] = NULL;
        pid_t pid = fork();
        if (pid == 0) {
            int null = open("/dev/null", O_WRONLY);
            dup2(null, 2);
            execv(BIN, argv);
            _exit(98);
        }
        int st;
        waitpid(pid, &st, 0);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 2, "case %zu: status %d", i, st);
    }
}
END_TEST

/* ---- many clients -----------------------------------------------------------------------------
 */

typedef struct {
    char *body;
    size_t len;
    long status;
} load_conn_t;

static size_t load_write(char *p, size_t sz, size_t n, void *arg)
{
    load_conn_t *c = arg;
    return buf_append(&c->body, &c->len, p, sz * n) ? sz * n : 0;
}

static uint64_t vm_kb(pid_t pid, const char *field)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    uint64_t v = 0;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof(line), f))
        if (!strncmp(line, field, n)) v = strtoull(line + n + 1, NULL, 10);
    if (f) fclose(f);
    return v;
}

/* Open n streaming requests at once (the prefill node stopped so they all stay open),
 * wait until the router holds them all, then let them run: returns how many completed
 * with [DONE]; *rss_kb the router's VmRSS with all of them open. */
static int load_run(uint16_t port, pid_t router, pid_t prefill, int n, uint64_t *rss_kb,
                    uint64_t *open_peak)
{
    CURLM *m = curl_multi_init();
    load_conn_t *conns = calloc((size_t)n, sizeof(*conns));
    CURL **easy = calloc((size_t)n, sizeof(*easy));
    char url[128];
    snprintf(url, sizeof(url), "http://127.0.0.1:%u/v1/completions", port);
    const char *body = "{\"model\":\"tiny\",\"prompt\":\"one of a thousand\",\"max_tokens\":4,"
                       "\"temperature\":0,\"stream\":true}";
    stop_process(prefill);
    for (int i = 0; i < n; i++) {
        CURL *c = easy[i] = curl_easy_init();
        curl_easy_setopt(c, CURLOPT_URL, url);
        curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
        curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(c, CURLOPT_TIMEOUT, 100L);
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, load_write);
        curl_easy_setopt(c, CURLOPT_WRITEDATA, &conns[i]);
        curl_easy_setopt(c, CURLOPT_FORBID_REUSE, 1L);
        curl_multi_add_handle(m, c);
    }
    int running = n;
    bool resumed = false;
    uint64_t deadline = pkv_deadline_after_ns(100 * SEC);
    uint64_t last_check = 0;
    while (running && pkv_now_ns() < deadline) {
        curl_multi_perform(m, &running);
        curl_multi_poll(m, NULL, 0, 20, NULL);
        if (!resumed && pkv_now_ns() - last_check > SEC / 5) {
            last_check = pkv_now_ns();
            long long open = metric(port, "pagekv_router_connections"); /* + this one */
            if (open >= n + 1) {
                *rss_kb = vm_kb(router, "VmRSS:");
                *open_peak = (uint64_t)open - 1;
                kill(prefill, SIGCONT);
                resumed = true;
            }
        }
    }
    kill(prefill, SIGCONT);
    CURLMsg *msg;
    int q, completed = 0;
    while ((msg = curl_multi_info_read(m, &q)))
        if (msg->msg == CURLMSG_DONE) {
            for (int i = 0; i < n; i++)
                if (easy[i] == msg->easy_handle) {
                    curl_easy_getinfo(easy[i], CURLINFO_RESPONSE_CODE, &conns[i].status);
                    if (msg->data.result == CURLE_OK && conns[i].status == 200 && conns[i].body &&
                        strstr(conns[i].body, "data: [DONE]\n\n") &&
                        !strstr(conns[i].body, "\"error\""))
                        completed++;
                }
        }
    for (int i = 0; i < n; i++) {
        curl_multi_remove_handle(m, easy[i]);
        curl_easy_cleanup(easy[i]);
        free(conns[i].body);
    }
    free(conns);
    free(easy);
    curl_multi_cleanup(m);
    ck_assert_msg(resumed, "the router never held all %d connections at once", n);
    return completed;
}

/* 1,000 concurrent streaming connections through the router: all complete; the router's
 * VmRSS with all of them open is printed (a figure, not asserted). */
START_TEST(thousand_concurrent_streams)
{
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
    ck_assert_msg(rl.rlim_cur >= 2500, "RLIMIT_NOFILE hard limit %llu is too low",
                  (unsigned long long)rl.rlim_max);
    proc_t p, d, rt;
    const char *nodes[] = {"--max-batch-size", "64", "--max-connections", "512", NULL};
    node_start(&p, "prefill", nodes);
    node_start(&d, "decode", nodes);
    const char *extra[] = {"--policy", "round_robin",          "--node-timeout-ms",
                           "90000",    "--request-timeout-ms", "95000",
                           NULL};
    router_start(&rt, &p, 1, &d, 1, extra);
    health_is(rt.port, 200);
    uint64_t rss0 = vm_kb(rt.pid, "VmRSS:");
    uint64_t rss = 0, peak_open = 0;
    int n = 1000;
    int done = load_run(rt.port, rt.pid, p.pid, n, &rss, &peak_open);
    uint64_t hwm = vm_kb(rt.pid, "VmHWM:");
    int threads = (int)vm_kb(rt.pid, "Threads:");
    fprintf(stderr,
            "router load: %d of %d streams completed; %llu connections open at once; router "
            "VmRSS %llu KiB idle, %llu KiB with all open, VmHWM %llu KiB; %d threads\n",
            done, n, (unsigned long long)peak_open, (unsigned long long)rss0,
            (unsigned long long)rss, (unsigned long long)hwm, threads);
    ck_assert_int_eq(done, n);
    ck_assert_int_le(threads, 8); /* no thread per connection */
    proc_stop(&rt, 30);
    proc_stop(&d, 30);
    proc_stop(&p, 30);
}
END_TEST

/* Beyond --max-connections: 503 with Retry-After, not a dropped connection. */
START_TEST(over_the_connection_limit_503)
{
    proc_t p, d, rt;
    node_start(&p, "prefill", NULL);
    node_start(&d, "decode", NULL);
    const char *extra[] = {"--max-connections", "4", NULL};
    router_start(&rt, &p, 1, &d, 1, extra);
    health_is(rt.port, 200);
    /* the router counts a connection until it has seen it close: until it closed them all */
    uint64_t deadline = pkv_deadline_after_ns(10 * SEC);
    while (pkv_test_tcp_conns(rt.pid, rt.port, NULL) > 0) {
        ck_assert_msg(pkv_now_ns() < deadline, "the router kept a connection open");
        usleep(2000);
    }
    if (getenv("PKV_TEST_DEBUG"))
        fprintf(stderr, "connections before: %lld\n", metric(rt.port, "pagekv_router_connections"));
    stop_process(p.pid);
    streamer_t s[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        s[i] = (streamer_t){.port = rt.port};
        pthread_create(&th[i], NULL, streamer_main, &s[i]);
    }
    /* Once the four streams hold their connections (connected first: a probe that came
     * before them would take one's place; the router accepts in arrival order), a fifth
     * connection is over. */
    deadline = pkv_deadline_after_ns(10 * SEC);
    while (pkv_test_tcp_conns(rt.pid, rt.port, NULL) < 4) {
        ck_assert_msg(pkv_now_ns() < deadline, "the four streams never connected");
        usleep(2000);
    }
    deadline = pkv_deadline_after_ns(20 * SEC);
    resp_t r;
    for (;;) {
        http(rt.port, "GET", "/health", NULL, 0, NULL, &r);
        ck_assert_int_eq(r.cc, CURLE_OK);
        if (getenv("PKV_TEST_DEBUG")) fprintf(stderr, "health: %ld %s\n", r.status, r.body);
        if (r.status == 503 && strstr(r.body, "too_many_connections")) break;
        ck_assert(pkv_now_ns() < deadline);
        resp_free(&r);
        usleep(20000);
    }
    char ra[16];
    header_value(r.headers, "Retry-After", ra, sizeof(ra));
    ck_assert_str_eq(ra, "1");
    resp_free(&r);
    kill(p.pid, SIGCONT);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(s[i].status, 200);
        ck_assert_ptr_nonnull(strstr(s[i].body, "data: [DONE]"));
        free(s[i].body);
    }
    deadline = pkv_deadline_after_ns(10 * SEC);
    while (metric(rt.port, "pagekv_router_rejected_total{reason=\"too_many_connections\"}") < 1) {
        ck_assert(pkv_now_ns() < deadline);
        usleep(20000);
    }
    proc_stop(&rt, 30);
    proc_stop(&d, 30);
    proc_stop(&p, 30);
}
END_TEST

/* PKV_TEST_ONLY=name runs one test (while working on it). */
#define ADD(tc, t)                                                                                 \
    do {                                                                                           \
        const char *only_ = getenv("PKV_TEST_ONLY");                                               \
        if (!only_ || !strcmp(only_, #t)) tcase_add_test(tc, t);                                   \
    } while (0)

/* ---- the lookup's count ---------------------------------------------------------------------- */

/* pkv_kv_prefix_match (what /v1/cache/lookup answers) is what admission then adopts, per
 * salt, on both backends, and changes nothing (no query counted, no reference taken). */
START_TEST(prefix_match_is_what_admission_adopts)
{
    for (int backend = 0; backend < 2; backend++) {
        pkv_kv_config_t cfg = {.geo = {.layers = 2,
                                       .kv_heads = 2,
                                       .head_dim = 8,
                                       .block_tokens = 4,
                                       .dtype = PKV_DTYPE_F32},
                               .backend = backend ? PKV_BACKEND_DENSE : PKV_BACKEND_PAGED,
                               .budget_bytes = 8u << 20};
        pkv_kv_t *kv = NULL;
        ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
        int32_t toks[30];
        for (int i = 0; i < 30; i++) toks[i] = 100 + i;
        uint32_t matched = 99;
        ck_assert_int_eq(pkv_kv_prefix_match(kv, 7, toks, 30, &matched), PKV_OK);
        ck_assert_uint_eq(matched, 0);
        /* a sequence of the first 22 tokens, written and freed: 5 full blocks cached */
        pkv_seq_params_t sp = {.salt = 7, .tokens = toks, .n_tokens = 22};
        pkv_seq_t *seq;
        uint32_t cached;
        ck_assert_int_eq(pkv_seq_create(kv, &sp, &seq, &cached), PKV_OK);
        ck_assert_int_eq(pkv_seq_append(seq, toks, 22), PKV_OK);
        pkv_seq_free(seq);
        pkv_kv_stats_t before, after;
        pkv_kv_stats(kv, &before);
        ck_assert_int_eq(pkv_kv_prefix_match(kv, 7, toks, 30, &matched), PKV_OK);
        ck_assert_uint_eq(matched, 20);
        ck_assert_int_eq(pkv_kv_prefix_match(kv, 7, toks, 21, &matched), PKV_OK);
        ck_assert_uint_eq(matched, 20); /* whole blocks, at most n - 1 */
        ck_assert_int_eq(pkv_kv_prefix_match(kv, 7, toks, 20, &matched), PKV_OK);
        ck_assert_uint_eq(matched, 16);
        ck_assert_int_eq(pkv_kv_prefix_match(kv, 8, toks, 30, &matched), PKV_OK);
        ck_assert_uint_eq(matched, 0); /* another tenant's salt */
        pkv_kv_stats(kv, &after);
        ck_assert_uint_eq(after.prefix_queries, before.prefix_queries);
        ck_assert_uint_eq(after.prefix_hit_tokens, before.prefix_hit_tokens);
        ck_assert_int_eq(pkv_kv_prefix_match(kv, 7, toks, 30, &matched), PKV_OK);
        sp.n_tokens = 30;
        ck_assert_int_eq(pkv_seq_create(kv, &sp, &seq, &cached), PKV_OK);
        ck_assert_uint_eq(cached, matched);
        pkv_seq_free(seq);
        ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
        pkv_kv_destroy(kv);
    }
}
END_TEST

/* ---- the OpenAI SDK -------------------------------------------------------------------------- */

/* The SDK's usual calls (tests/sdk/openai_check.cjs) through the router. Needs node, npm
 * and the `openai` package, installed once into BUILD/sdk; skipped, with a message, when
 * any is missing or cannot be installed (no network). */
START_TEST(openai_sdk_through_router)
{
    if (system("command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1")) {
        PKV_TEST_SKIP("node or npm is not installed");
        return;
    }
    char sdk[4200], cmd[9000];
    snprintf(sdk, sizeof(sdk), "%s", BIN);
    *strrchr(sdk, '/') = 0;
    snprintf(sdk + strlen(sdk), sizeof(sdk) - strlen(sdk), "/sdk");
    snprintf(cmd, sizeof(cmd), "%s/node_modules/openai/package.json", sdk);
    if (access(cmd, R_OK)) {
        snprintf(cmd, sizeof(cmd),
                 "mkdir -p '%s' && timeout 90 npm install --prefix '%s' --no-audit --no-fund "
                 "--silent openai@4 >/dev/null 2>&1",
                 sdk, sdk);
        if (system(cmd)) {
            PKV_TEST_SKIP("`npm install openai@4` failed (no registry?)");
            return;
        }
    }
    proc_t p, d, rt;
    node_start(&p, "prefill", NULL);
    node_start(&d, "decode", NULL);
    router_start(&rt, &p, 1, &d, 1, NULL);
    health_is(rt.port, 200);
    snprintf(cmd, sizeof(cmd),
             "NODE_PATH='%s/node_modules' timeout 60 node '%s/tests/sdk/openai_check.cjs' "
             "http://127.0.0.1:%u",
             sdk, PKV_TEST_SRCDIR, rt.port);
    ck_assert_int_eq(system(cmd), 0);
    ck_assert_int_ge(log_count(&d, "(decode leg)"), 4);
    proc_stop(&rt, 30);
    proc_stop(&d, 30);
    proc_stop(&p, 30);
}
END_TEST

/* ---- the SSE framing's fuzz corpus ------------------------------------------------------- */

/* tests/fuzz/corpus/sse replayed through the framing's fuzz properties: every stream
 * passes them, and the complete ones are relayed whole. */
static void replay_sse(const char *name, const uint8_t *buf, size_t n, void *arg)
{
    size_t relayed = pkv_fuzz_sse(buf, n); /* aborts on a broken property */
    if (!strcmp(name, "stream-complete")) ck_assert_uint_eq(relayed, n - 1);
    *(size_t *)arg += relayed;
}

START_TEST(sse_fuzz_corpus_replays)
{
    size_t relayed = 0;
    uint32_t files =
        pkv_test_corpus_each("PKV_SSE_CORPUS", "tests/fuzz/corpus/sse", replay_sse, &relayed);
    ck_assert_uint_ge(files, 5);
    ck_assert_uint_gt(relayed, 0);
}
END_TEST

static Suite *router_suite(void)
{
    Suite *s = suite_create("router");
    TCase *tc = tcase_create("router");
    tcase_add_checked_fixture(tc, setup, NULL);
    tcase_set_timeout(tc, 120);
    ADD(tc, cli_rejects_bad_flags);
    ADD(tc, prefix_match_is_what_admission_adopts);
    ADD(tc, answers_equal_unified);
    ADD(tc, round_robin_spreads);
    ADD(tc, cache_aware_finds_the_prefix);
    ADD(tc, dead_and_stopped_nodes_skipped);
    ADD(tc, prefill_killed_mid_request);
    ADD(tc, decode_killed_mid_stream);
    ADD(tc, sigterm_drains);
    ADD(tc, slow_client_pauses_the_node);
    ADD(tc, bad_input_as_serve_no_node_called);
    ADD(tc, over_the_connection_limit_503);
    ADD(tc, thousand_concurrent_streams);
    ADD(tc, openai_sdk_through_router);
    ADD(tc, sse_fuzz_corpus_replays);
    suite_add_tcase(s, tc);
    return s;
}

PKV_TEST_MAIN(router_suite)
