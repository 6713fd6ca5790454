/* Test support: HTTP client and `pagekv serve` children (srvtest.h). */
#include "srvtest.h"

#include "testutil.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/select.h>
#include <sys/wait.h>
#include <unistd.h>

static size_t on_body(char *p, size_t sz, size_t n, void *arg)
{
    ts_resp_t *r = arg;
    size_t k = sz * n;
    char *nb = realloc(r->body, r->len + k + 1);
    if (!nb) return 0;
    memcpy(nb + r->len, p, k);
    r->body = nb;
    r->len += k;
    nb[r->len] = 0;
    return k;
}

CURLcode ts_http(const char *host, uint16_t port, const char *method, const char *path,
                 const char *body, const char *extra_header, long timeout_s, ts_resp_t *r)
{
    memset(r, 0, sizeof(*r));
    CURL *c = curl_easy_init();
    PKV_CHECK(c != NULL);
    char url[256];
    snprintf(url, sizeof(url), "http://%s:%u%s", host, port, path);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, timeout_s);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, 10L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, r);
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    h = curl_slist_append(h, "Expect:");
    if (extra_header) h = curl_slist_append(h, extra_header);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    if (body) {
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)strlen(body));
    }
    r->cc = curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    return r->cc;
}

void ts_resp_free(ts_resp_t *r)
{
    free(r->body);
    memset(r, 0, sizeof(*r));
}

json_t *ts_get_json(const char *host, uint16_t port, const char *path)
{
    ts_resp_t r;
    ck_assert_int_eq(ts_http(host, port, "GET", path, NULL, NULL, 30, &r), CURLE_OK);
    ck_assert_int_eq(r.status, 200);
    json_t *doc = json_loadb(r.body ? r.body : "", r.len, JSON_ALLOW_NUL, NULL);
    ck_assert_ptr_nonnull(doc);
    ts_resp_free(&r);
    return doc;
}

json_t *ts_jp(json_t *doc, const char *path)
{
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", path);
    json_t *v = doc;
    for (char *save = NULL, *t = strtok_r(buf, ".", &save); t && v; t = strtok_r(NULL, ".", &save))
        v = json_is_array(v) ? json_array_get(v, strtoul(t, NULL, 10)) : json_object_get(v, t);
    return v;
}

long long ts_ji(json_t *doc, const char *path)
{
    json_t *v = ts_jp(doc, path);
    ck_assert_msg(json_is_integer(v), "%s is not an integer", path);
    return json_integer_value(v);
}

const char *ts_js(json_t *doc, const char *path)
{
    json_t *v = ts_jp(doc, path);
    ck_assert_msg(json_is_string(v), "%s is not a string", path);
    return json_string_value(v);
}

void ts_pagekv_path(char *out, size_t n)
{
    char self[2048];
    ssize_t k = readlink("/proc/self/exe", self, sizeof(self) - 1);
    ck_assert_int_gt(k, 0);
    self[k] = 0;
    *strrchr(self, '/') = 0; /* BUILD/tests */
    *strrchr(self, '/') = 0; /* BUILD */
    snprintf(out, n, "%s/pagekv", self);
    ck_assert_msg(access(out, X_OK) == 0, "%s not built", out);
}

int ts_pagekv_run(const char *args, char *out, size_t cap)
{
    char bin[2048], cmd[4096];
    ts_pagekv_path(bin, sizeof(bin));
    snprintf(cmd, sizeof(cmd), "exec '%s' %s 2>&1", bin, args);
    FILE *f = popen(cmd, "r");
    ck_assert_ptr_nonnull(f);
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = 0;
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

pid_t ts_pagekv_spawn(const char *args, char *log)
{
    char bin[2048], cmd[4096];
    ts_pagekv_path(bin, sizeof(bin));
    snprintf(cmd, sizeof(cmd), "exec '%s' %s", bin, args);
    int fd = mkstemp(log);
    ck_assert_int_ge(fd, 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    close(fd);
    return pid;
}

void ts_read_file(const char *path, char *out, size_t cap)
{
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(out, 1, cap - 1, f) : 0;
    if (f) fclose(f);
    out[n] = 0;
}

void ts_node_read(ts_node_t *c, int timeout_ms)
{
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    fd_set fds;
    FD_ZERO(&fds);
    FD_SET(c->err_fd, &fds);
    if (c->log_len + 1 >= sizeof(c->log)) { /* keep the tail */
        memmove(c->log, c->log + sizeof(c->log) / 2, c->log_len - sizeof(c->log) / 2);
        c->log_len -= sizeof(c->log) / 2;
    }
    if (select(c->err_fd + 1, &fds, NULL, NULL, &tv) <= 0) return;
    ssize_t k = read(c->err_fd, c->log + c->log_len, sizeof(c->log) - 1 - c->log_len);
    if (k > 0) c->log_len += (size_t)k;
    c->log[c->log_len] = 0;
}

void ts_node_start(ts_node_t *c, const char *netns, const char *host, bool tcp_only, bool agent,
                   const char *const args[])
{
    char bin[4096];
    ts_pagekv_path(bin, sizeof(bin));
    memset(c, 0, sizeof(*c));
    snprintf(c->host, sizeof(c->host), "%s", host);
    const char *argv[64];
    int n = 0;
    if (netns) {
        argv[n++] = "/usr/sbin/ip";
        argv[n++] = "netns";
        argv[n++] = "exec";
        argv[n++] = netns;
    }
    argv[n++] = bin;
    argv[n++] = "serve";
    argv[n++] = "--host";
    argv[n++] = host;
    argv[n++] = "--port";
    argv[n++] = "0";
    for (int i = 0; args && args[i]; i++) {
        ck_assert_int_lt(n, 62);
        argv[n++] = args[i];
    }
    argv[n] = NULL;
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    pid_t parent = getpid();
    c->pid = fork();
    ck_assert_int_ge(c->pid, 0);
    if (c->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a failed test */
        if (getppid() != parent) _exit(99);
        if (tcp_only) setenv("UCX_TLS", "tcp", 1);
        dup2(fds[1], 1); /* UCX logs to stdout */
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        execv(argv[0], (char *const *)argv);
        _exit(98);
    }
    close(fds[1]);
    c->err_fd = fds[0];
    char want[96];
    snprintf(want, sizeof(want), "listening on %s:", host);
    uint64_t deadline = pkv_deadline_after_ns(30ull * 1000000000);
    const char *at, *kv = NULL;
    while (!(at = strstr(c->log, want)) ||
           (agent && !(kv = strstr(c->log, "transfer agent on ")))) {
        ck_assert_msg(pkv_now_ns() < deadline, "no listening line; log:\n%s", c->log);
        ck_assert_msg(waitpid(c->pid, &c->status, WNOHANG) == 0, "pagekv serve exited: %s", c->log);
        ts_node_read(c, 50);
    }
    c->port = (uint16_t)atoi(at + strlen(want));
    if (agent) {
        kv += strlen("transfer agent on ");
        size_t len = strcspn(kv, "\n");
        ck_assert_uint_lt(len, sizeof(c->agent));
        memcpy(c->agent, kv, len);
        c->agent[len] = 0;
    }
}

int ts_node_wait(ts_node_t *c, int timeout_s)
{
    if (c->reaped) return c->status;
    uint64_t deadline = pkv_deadline_after_ns((uint64_t)timeout_s * 1000000000ull);
    for (;;) {
        pid_t w = waitpid(c->pid, &c->status, WNOHANG);
        if (w == c->pid) break;
        ts_node_read(c, 10);
        if (pkv_now_ns() > deadline) {
            kill(c->pid, SIGKILL);
            waitpid(c->pid, &c->status, 0);
            c->reaped = true;
            ck_abort_msg("pagekv serve did not exit within %d s; log:\n%s", timeout_s, c->log);
        }
    }
    c->reaped = true;
    for (;;) {
        if (c->log_len + 1 >= sizeof(c->log)) break;
        ssize_t k = read(c->err_fd, c->log + c->log_len, sizeof(c->log) - 1 - c->log_len);
        if (k <= 0) break;
        c->log_len += (size_t)k;
    }
    c->log[c->log_len] = 0;
    close(c->err_fd);
    return c->status;
}

void ts_node_stop(ts_node_t *c)
{
    kill(c->pid, SIGCONT); /* a stopped child must see its SIGTERM */
    kill(c->pid, SIGTERM);
    int status = ts_node_wait(c, 30);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "exit status %d; log:\n%s", status,
                  c->log);
}

void ts_node_kill(ts_node_t *c)
{
    kill(c->pid, SIGKILL);
    int status = ts_node_wait(c, 30);
    ck_assert_msg(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "status %d", status);
}
