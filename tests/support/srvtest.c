/* Test support: thin test wrappers over the HTTP client (support/http.h) and the launcher
 * (support/launch.h) (srvtest.h). */
#include "tests/support/srvtest.h"

#include "tests/support/testutil.h"

#include "support/http.h"

#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* The request to http://host:port (timeout_s; connect within 10 s) into r. */
static CURLcode send_to(const char *host, uint16_t port, http_request_t *rq, long timeout_s,
                        ts_resp_t *r)
{
    char base[128];
    snprintf(base, sizeof(base), "http://%s:%u", host, port);
    rq->base_url = base;
    rq->timeout_ms = (uint32_t)timeout_s * 1000u;
    rq->connect_timeout_ms = 10000;
    rq->keep_headers = true;
    http_reply_t rep;
    http_send(rq, &rep);
    *r = (ts_resp_t){.status = rep.status,
                     .cc = (CURLcode)rep.curl_code,
                     .body = rep.body,
                     .len = rep.len,
                     .headers = rep.headers ? rep.headers : calloc(1, 1)};
    ck_assert_ptr_nonnull(r->headers);
    return r->cc;
}

CURLcode ts_http(const char *host, uint16_t port, const char *method, const char *path,
                 const char *body, const char *extra_header, long timeout_s, ts_resp_t *r)
{
    const char *headers[] = {"Expect:", extra_header, NULL};
    http_request_t rq = {.path = path, .method = method, .body = body, .headers = headers};
    return send_to(host, port, &rq, timeout_s, r);
}

CURLcode ts_http_watch(const char *host, uint16_t port, const char *path, const char *body,
                       long timeout_s, bool (*on_body)(void *, const char *, size_t, size_t),
                       void *arg, ts_resp_t *r)
{
    http_request_t rq = {.path = path, .body = body, .on_body = on_body, .on_body_arg = arg};
    return send_to(host, port, &rq, timeout_s, r);
}

void ts_resp_free(ts_resp_t *r)
{
    free(r->body);
    free(r->headers);
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

/* argv for `sh -c "exec BUILD/pagekv ARGS"` in cmd (the shell splits the words). */
static void pagekv_sh_argv(const char *args, char *cmd, size_t cap, char *argv[4])
{
    char bin[2048];
    ts_pagekv_path(bin, sizeof(bin));
    snprintf(cmd, cap, "exec '%s' %s", bin, args);
    argv[0] = "/bin/sh";
    argv[1] = "-c";
    argv[2] = cmd;
    argv[3] = NULL;
}

int ts_pagekv_run(const char *args, char *out, size_t cap)
{
    char cmd[4096], *argv[4], *log;
    pagekv_sh_argv(args, cmd, sizeof(cmd), argv);
    /* the test's own timeout ends a command that hangs first */
    int code = ts_proc_run(argv, 3600, &log);
    snprintf(out, cap, "%s", log);
    free(log);
    return code;
}

pid_t ts_pagekv_spawn(const char *args, char *log)
{
    char cmd[4096], *argv[4];
    pagekv_sh_argv(args, cmd, sizeof(cmd), argv);
    int fd = mkstemp(log);
    ck_assert_int_ge(fd, 0);
    close(fd);
    launch_spec_t spec = {.name = "pagekv", .argv = argv, .log_path = log};
    launch_proc_t p;
    char err[1024];
    ck_assert_msg(launch_spawn(&p, &spec, err, sizeof(err)) == 0, "%s", err);
    return p.pid;
}

void ts_read_file(const char *path, char *out, size_t cap)
{
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(out, 1, cap - 1, f) : 0;
    if (f) fclose(f);
    out[n] = 0;
}

/* ---- child processes ---- */

void ts_proc_spawn(launch_proc_t *p, char *const argv[], char *const env[], const char *ready)
{
    char log[] = "/tmp/pkv-test-proc-XXXXXX";
    int fd = mkstemp(log);
    ck_assert_int_ge(fd, 0);
    close(fd);
    const char *name = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
    launch_spec_t spec = {.name = name, .argv = argv, .env = env, .log_path = log, .ready = ready};
    char err[1024];
    ck_assert_msg(launch_spawn(p, &spec, err, sizeof(err)) == 0, "%s", err);
}

void ts_proc_start(launch_proc_t *p, char *const argv[], char *const env[], const char *ready,
                   bool want_agent)
{
    ts_proc_spawn(p, argv, env, ready);
    char err[1024];
    int rc = launch_wait_listening(p, want_agent, pkv_deadline_after_ns(30ull * 1000000000), err,
                                   sizeof(err));
    if (rc == 0) return;
    char *log = launch_log_read(p);
    unlink(p->log);
    ck_abort_msg("%s; log:\n%s", err, log ? log : "(none)");
}

int ts_proc_wait(launch_proc_t *p, int timeout_s, char **log)
{
    launch_stop(p, 0, pkv_deadline_after_ns((uint64_t)timeout_s * 1000000000ull));
    char *text = launch_log_read(p);
    unlink(p->log);
    ck_assert_msg(!p->killed, "%s did not exit within %d s; log:\n%s", p->name, timeout_s,
                  text ? text : "(none)");
    if (log)
        *log = text ? text : calloc(1, 1);
    else
        free(text);
    return launch_exit_code(p->wstatus);
}

int ts_proc_run(char *const argv[], int timeout_s, char **log)
{
    launch_proc_t p;
    ts_proc_spawn(&p, argv, NULL, NULL);
    return ts_proc_wait(&p, timeout_s, log);
}

int ts_proc_stop(launch_proc_t *p, int timeout_s)
{
    if (p->pid > 0) {
        kill(p->pid, SIGCONT); /* a stopped child must see its SIGTERM */
        kill(p->pid, SIGTERM);
    }
    return ts_proc_wait(p, timeout_s, NULL);
}

void ts_proc_kill(launch_proc_t *p)
{
    launch_stop(p, SIGKILL, pkv_deadline_after_ns(30ull * 1000000000));
    unlink(p->log);
}

char *ts_proc_log(const launch_proc_t *p)
{
    char *log = launch_log_read(p);
    ck_assert_msg(log != NULL, "cannot read %s", p->log);
    return log;
}

/* True when every thread of pid is stopped (state T or t in /proc/PID/task/TID/stat). */
static bool proc_all_stopped(pid_t pid)
{
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
    return all;
}

void ts_proc_freeze(pid_t pid)
{
    kill(pid, SIGSTOP);
    uint64_t deadline = pkv_deadline_after_ns(10ull * 1000000000);
    while (!proc_all_stopped(pid)) {
        ck_assert_msg(pkv_now_ns() < deadline, "pid %d did not stop", (int)pid);
        usleep(1000);
    }
}

/* ---- nodes ---- */

/* log (may be NULL) into c->log (its tail, when longer); frees it. */
static void node_log_take(ts_node_t *c, char *log)
{
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
    char *env[] = {tcp_only ? "UCX_TLS=tcp" : NULL, NULL};
    ts_proc_start(&c->proc, (char *const *)argv, env, "pagekv serve: listening on ", agent);
    c->pid = c->proc.pid;
    node_log_take(c, launch_log_read(&c->proc));
    c->port = c->proc.port;
    snprintf(c->agent, sizeof(c->agent), "%s", c->proc.kv_address);
}

int ts_node_wait(ts_node_t *c, int timeout_s)
{
    if (c->reaped) return c->status;
    char *log = NULL;
    ts_proc_wait(&c->proc, timeout_s, &log);
    c->status = c->proc.wstatus;
    c->reaped = true;
    node_log_take(c, log);
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

double ts_jnum(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    ck_assert_msg(json_is_number(v), "%s: not a number", key);
    return json_number_value(v);
}

const char *ts_tail(const char *s)
{
    size_t n = strlen(s);
    return n > 3000 ? s + n - 3000 : s;
}

void ts_has_lines(const char *out, const char *const *lines, size_t n)
{
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(strstr(out, lines[i]), "no '%s' in\n%s", lines[i], ts_tail(out));
}

json_t *ts_json_take(const char *path)
{
    json_error_t je;
    json_t *doc = json_load_file(path, 0, &je);
    unlink(path);
    ck_assert_msg(doc, "%s: %s", path, je.text);
    return doc;
}
