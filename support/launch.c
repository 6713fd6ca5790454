/*
 * The launcher of `pagekv serve` / `pagekv route` children (support/launch.h).
 *
 * A child's output goes to a file, never to a pipe: waiting for it to listen polls the
 * file. Between fork and exec the child makes only async-signal-safe calls, except the
 * environment entries (putenv) and the cgroup join, which only touch the child's copy.
 */
#include "support/launch.h"

#include "core/core.h"
#include "prim/prim.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
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

char *launch_log_read(const launch_proc_t *p)
{
    FILE *f = fopen(p->log, "rb");
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

void launch_log_tail(const launch_proc_t *p, char *out, size_t cap)
{
    if (cap == 0) return;
    out[0] = '\0';
    char *log = launch_log_read(p);
    if (!log) return;
    size_t len = strlen(log);
    size_t from = len > cap - 1 ? len - (cap - 1) : 0;
    const char *nl = from ? strchr(log + from, '\n') : NULL;
    snprintf(out, cap, "%s", nl ? nl + 1 : log + from);
    free(log);
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

/* Fill port, url and kv_address from the log; true once the listening line (and with
 * want_agent the agent's) is there. */
static bool log_listening(launch_proc_t *p, bool want_agent)
{
    char *log = launch_log_read(p);
    if (!log) return false;
    bool ok = false;
    const char *l = strstr(log, p->ready);
    if (l) {
        char addr[LAUNCH_ADDR_MAX];
        uint16_t port = parse_addr(l + strlen(p->ready), addr, sizeof(addr));
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
    return ok && (!want_agent || p->kv_address[0]);
}

bool launch_reap(launch_proc_t *p)
{
    if (p->reaped) return true;
    if (p->pid <= 0) return false;
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

/* The child's side of launch_spawn, up to exec. */
static _Noreturn void launch_child(const launch_spec_t *s, pid_t parent, int logfd)
{
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, s->death_signal ? s->death_signal : SIGKILL);
    if (getppid() != parent) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    int nullfd = open("/dev/null", O_RDONLY);
    if (nullfd >= 0) dup2(nullfd, STDIN_FILENO);
    dup2(logfd, STDOUT_FILENO);
    dup2(logfd, STDERR_FILENO);
    if (s->cgroup_procs) {
        int fd = open(s->cgroup_procs, O_WRONLY);
        if (fd < 0 || dprintf(fd, "%d\n", (int)getpid()) < 0 || close(fd) != 0) _exit(97);
    }
    for (size_t i = 0; s->env && s->env[i]; i++) putenv(s->env[i]);
    execv(s->argv[0], s->argv);
    dprintf(STDERR_FILENO, "exec %s: %s\n", s->argv[0], strerror(errno));
    _exit(127);
}

int launch_spawn(launch_proc_t *p, const launch_spec_t *s, char *err, size_t errcap)
{
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "%s", s->name);
    snprintf(p->log, sizeof(p->log), "%s", s->log_path);
    snprintf(p->ready, sizeof(p->ready), "%s", s->ready ? s->ready : ": listening on ");
    int fd = open(p->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(err, errcap, "%s: cannot create %s: %s", s->name, p->log, strerror(errno));
        return -1;
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        close(fd);
        snprintf(err, errcap, "%s: fork: %s", s->name, strerror(errno));
        return -1;
    }
    if (pid == 0) launch_child(s, parent, fd);
    close(fd);
    p->pid = pid;
    return 0;
}

int launch_wait_listening(launch_proc_t *p, bool want_agent, uint64_t deadline_ns, char *err,
                          size_t errcap)
{
    char tail[512];
    for (;;) {
        if (log_listening(p, want_agent)) return 0;
        if (launch_reap(p)) {
            launch_log_tail(p, tail, sizeof(tail));
            snprintf(err, errcap, "%s exited before listening (status %d): %s", p->name, p->wstatus,
                     tail);
            p->pid = 0;
            return -1;
        }
        if (pkv_now_ns() > deadline_ns) break;
        sleep_ns(POLL_NS);
    }
    launch_log_tail(p, tail, sizeof(tail));
    snprintf(err, errcap, "%s did not listen in time: %s", p->name, tail);
    launch_stop(p, SIGKILL, pkv_now_ns());
    return -1;
}

int launch_start(launch_proc_t *p, const char *name, char *const argv[], char *const env[],
                 const char *logdir, uint64_t deadline_ns, char *err, size_t errcap)
{
    char log[256];
    snprintf(log, sizeof(log), "%s/%s.log", logdir, name);
    launch_spec_t s = {.name = name, .argv = argv, .env = env, .log_path = log};
    if (launch_spawn(p, &s, err, errcap) != 0) return -1;
    return launch_wait_listening(p, false, deadline_ns, err, errcap);
}

int launch_exit_code(int wstatus)
{
    if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
    if (WIFSIGNALED(wstatus)) return 128 + WTERMSIG(wstatus);
    return -1;
}

int launch_stop(launch_proc_t *p, int sig, uint64_t deadline_ns)
{
    if (p->pid <= 0) return p->reaped ? launch_exit_code(p->wstatus) : -1;
    if (!launch_reap(p) && sig) {
        kill(p->pid, sig);
        if (sig != SIGKILL && sig != SIGCONT) kill(p->pid, SIGCONT); /* a stopped child too */
    }
    while (!launch_reap(p) && pkv_now_ns() < deadline_ns) sleep_ns(POLL_NS / 4);
    if (!p->reaped) {
        p->killed = true;
        kill(-p->pid, SIGKILL);
        kill(p->pid, SIGKILL);
        int st;
        if (waitpid(p->pid, &st, 0) == p->pid) p->wstatus = st;
        p->reaped = true;
    }
    kill(-p->pid, SIGKILL); /* anything it left in its group */
    p->pid = 0;
    return launch_exit_code(p->wstatus);
}

uint64_t launch_rss(const launch_proc_t *p)
{
    pkv_prim_mem_t m;
    if (p->pid <= 0 || pkv_prim_mem_read(p->pid, &m) != PKV_OK) return 0;
    return m.rss_bytes;
}

int launch_env_init(char *bin, size_t bin_cap, char *logdir, void (*on_signal)(int))
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
