/*
 * pagekv bench footprint: the server process. fork + exec `pagekv serve` with its output
 * in a log file, find its port in the log, wait for /health, and stop it with SIGTERM
 * (SIGKILL after 30 s); waits use a pidfd where the kernel has pidfd_open.
 */
#include "footprint.h"

#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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
int fp_server_spawn(const fp_opts_t *o, fp_run_t *run, const char *const *argv, fp_server_t *out)
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
int fp_server_wait_ready(fp_run_t *run, fp_server_t *srv)
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

void fp_exit_text(int status, char *out, size_t cap)
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
int fp_server_stop(fp_server_t *s)
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
