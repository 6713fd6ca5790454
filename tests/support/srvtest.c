/* Test support: thin test wrappers over the HTTP client (support/http.h) and the launcher
 * (support/launch.h) (srvtest.h). */
#include "tests/support/srvtest.h"

#include "tests/support/testutil.h"

#include "support/http.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

CURLcode ts_http(const char *host, uint16_t port, const char *method, const char *path,
                 const char *body, const char *extra_header, long timeout_s, ts_resp_t *r)
{
    char base[128];
    snprintf(base, sizeof(base), "http://%s:%u", host, port);
    const char *headers[] = {"Expect:", extra_header, NULL};
    http_request_t rq = {.base_url = base,
                         .path = path,
                         .method = method,
                         .body = body,
                         .headers = headers,
                         .timeout_ms = (uint32_t)timeout_s * 1000u,
                         .connect_timeout_ms = 10000};
    http_reply_t rep;
    http_send(&rq, &rep);
    *r = (ts_resp_t){
        .status = rep.status, .cc = (CURLcode)rep.curl_code, .body = rep.body, .len = rep.len};
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

/* What the child logged so far into c->log (its tail, when longer). */
static void node_log_load(ts_node_t *c)
{
    char *log = launch_log_read(&c->proc);
    if (!log) return;
    size_t len = strlen(log), from = len >= sizeof(c->log) ? len - (sizeof(c->log) - 1) : 0;
    c->log_len = len - from;
    memcpy(c->log, log + from, c->log_len + 1);
    free(log);
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
    char log[] = "/tmp/pkv-test-node-XXXXXX";
    int fd = mkstemp(log);
    ck_assert_int_ge(fd, 0);
    close(fd);
    char *env[] = {tcp_only ? "UCX_TLS=tcp" : NULL, NULL};
    launch_spec_t spec = {
        .name = "pagekv serve", .argv = (char *const *)argv, .env = env, .log_path = log};
    char err[1024];
    ck_assert_msg(launch_spawn(&c->proc, &spec, err, sizeof(err)) == 0, "%s", err);
    c->pid = c->proc.pid;
    int rc = launch_wait_listening(&c->proc, agent, pkv_deadline_after_ns(30ull * 1000000000), err,
                                   sizeof(err));
    node_log_load(c);
    if (rc != 0) unlink(log);
    ck_assert_msg(rc == 0, "%s; log:\n%s", err, c->log);
    c->port = c->proc.port;
    snprintf(c->agent, sizeof(c->agent), "%s", c->proc.kv_address);
}

int ts_node_wait(ts_node_t *c, int timeout_s)
{
    if (c->reaped) return c->status;
    uint64_t deadline = pkv_deadline_after_ns((uint64_t)timeout_s * 1000000000ull);
    launch_stop(&c->proc, 0, deadline);
    c->status = c->proc.wstatus;
    c->reaped = true;
    node_log_load(c);
    unlink(c->proc.log);
    ck_assert_msg(!c->proc.killed, "pagekv serve did not exit within %d s; log:\n%s", timeout_s,
                  c->log);
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
