/*
 * Two network namespaces joined by a veth pair (support/netns.h).
 *
 * Every change goes through `ip` (iproute2), one command per fork and exec, its stderr
 * kept for the error message. The guard is forked before anything else is made, with its
 * cleanup commands built beforehand, so after the fork it only reads, forks, execs and
 * waits.
 */
#include "support/netns.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define NS_ARGV_MAX 24

static const char *ns_ip_bin(void)
{
    static const char *const where[] = {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"};
    for (size_t i = 0; i < sizeof(where) / sizeof(where[0]); i++)
        if (access(where[i], X_OK) == 0) return where[i];
    return NULL;
}

/* Fork, exec argv (argv[0] a path), wait; its stderr (at most cap - 1 bytes) into out when
 * out is not NULL. The exit code, or -1. Async-signal-safe when out is NULL. */
static int ns_exec(char *const argv[], char *out, size_t cap)
{
    int fds[2] = {-1, -1};
    if (out && pipe2(fds, O_CLOEXEC) != 0) return -1;
    pid_t pid = fork();
    if (pid < 0) {
        if (out) close(fds[0]), close(fds[1]);
        return -1;
    }
    if (pid == 0) {
        int dn = open("/dev/null", O_RDWR);
        if (dn >= 0) dup2(dn, STDOUT_FILENO), dup2(dn, STDIN_FILENO);
        dup2(out ? fds[1] : dn, STDERR_FILENO);
        execv(argv[0], argv);
        _exit(127);
    }
    size_t len = 0;
    if (out) {
        close(fds[1]);
        for (;;) {
            ssize_t n = cap > len + 1 ? read(fds[0], out + len, cap - len - 1) : 0;
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            len += (size_t)n;
        }
        close(fds[0]);
        out[len] = '\0';
        while (len && (out[len - 1] == '\n' || out[len - 1] == ' ')) out[--len] = '\0';
    }
    int st;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* `ip` with the blank-separated words of fmt (names and addresses only: no quoting).
 * 0, or -1 with "ip WORDS: its stderr" in err (err may be NULL). */
static int ns_ip(const netns_pair_t *np, char *err, size_t errcap, const char *fmt, ...)
{
    char line[512], *argv[NS_ARGV_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    char words[512];
    snprintf(words, sizeof(words), "%s", line);
    int n = 0;
    argv[n++] = (char *)np->ip_bin;
    for (char *save = NULL, *w = strtok_r(words, " ", &save); w && n < NS_ARGV_MAX - 1;
         w = strtok_r(NULL, " ", &save))
        argv[n++] = w;
    argv[n] = NULL;
    char why[256] = "";
    int rc = ns_exec(argv, why, sizeof(why));
    if (rc == 0) return 0;
    if (err) snprintf(err, errcap, "ip %s: %s", line, why[0] ? why : "failed");
    return -1;
}

/* The guard: wait for EOF on rfd (the creator ended or destroyed the pair), then delete
 * both namespaces and the root-side veths (the commands in del, NULL-terminated). */
static _Noreturn void ns_guard(int rfd, char *const *const del[])
{
    setsid();
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    for (int fd = 3; fd < 1024; fd++)
        if (fd != rfd) close(fd);
    char c;
    for (;;) {
        ssize_t n = read(rfd, &c, 1);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
    }
    for (size_t i = 0; del[i]; i++) ns_exec(del[i], NULL, 0);
    _exit(0);
}

static void ns_names(netns_pair_t *np, bool root_links)
{
    int id = (int)getpid() % 100000;
    int o1 = (id / 250) % 250 + 1, o2 = id % 250 + 1;
    snprintf(np->ns[0], sizeof(np->ns[0]), "pkv-a-%d", id);
    snprintf(np->ns[1], sizeof(np->ns[1]), "pkv-b-%d", id);
    snprintf(np->ip[0], sizeof(np->ip[0]), "10.%d.%d.1", o1, o2);
    snprintf(np->ip[1], sizeof(np->ip[1]), "10.%d.%d.2", o1, o2);
    snprintf(np->veth[0], sizeof(np->veth[0]), "pkva%d", id);
    snprintf(np->dev[0], sizeof(np->dev[0]), "pkva%d", id);
    snprintf(np->dev[1], sizeof(np->dev[1]), "pkvb%d", id);
    if (root_links) {
        snprintf(np->root_ip[0], sizeof(np->root_ip[0]), "10.%d.%d.6", o1, o2);
        snprintf(np->root_ip[1], sizeof(np->root_ip[1]), "10.%d.%d.10", o1, o2);
        snprintf(np->veth[1], sizeof(np->veth[1]), "pkvra%d", id);
        snprintf(np->veth[2], sizeof(np->veth[2]), "pkvrb%d", id);
    }
}

/* Make the namespaces, the link and (root_links) the two links here. */
static int ns_build(netns_pair_t *np, bool root_links, char *err, size_t cap)
{
    const char *a = np->ns[0], *b = np->ns[1];
    int id = (int)getpid() % 100000;
    if (ns_ip(np, err, cap, "netns add %s", a) || ns_ip(np, err, cap, "netns add %s", b) ||
        /* made here, then moved: ends made inside the fresh namespaces (each ifindex 2 there)
           did not connect over UCX's tcp transport (peer_lost; the cause not pinned down) */
        ns_ip(np, err, cap, "link add pkva%d type veth peer name pkvb%d", id, id) ||
        ns_ip(np, err, cap, "link set pkva%d netns %s", id, a) ||
        ns_ip(np, err, cap, "link set pkvb%d netns %s", id, b) ||
        ns_ip(np, err, cap, "-n %s addr add %s/30 dev pkva%d", a, np->ip[0], id) ||
        ns_ip(np, err, cap, "-n %s addr add %s/30 dev pkvb%d", b, np->ip[1], id) ||
        ns_ip(np, err, cap, "-n %s link set pkva%d up", a, id) ||
        ns_ip(np, err, cap, "-n %s link set pkvb%d up", b, id) ||
        ns_ip(np, err, cap, "-n %s link set lo up", a) ||
        ns_ip(np, err, cap, "-n %s link set lo up", b))
        return -1;
    for (int k = 0; root_links && k < 2; k++) {
        const char *ns = np->ns[k], *here = np->veth[1 + k];
        char there[NETNS_NAME_MAX], mine[NETNS_IP_MAX];
        snprintf(there, sizeof(there), "pkvx%c%d", k ? 'b' : 'a', id);
        /* this end: the address one below the namespace's (.5 / .9) */
        snprintf(mine, sizeof(mine), "%s", np->root_ip[k]);
        char *dot = strrchr(mine, '.');
        snprintf(dot + 1, sizeof(mine) - (size_t)(dot + 1 - mine), "%d", atoi(dot + 1) - 1);
        if (ns_ip(np, err, cap, "link add %s type veth peer name %s", here, there) ||
            ns_ip(np, err, cap, "link set %s netns %s", there, ns) ||
            ns_ip(np, err, cap, "addr add %s/30 dev %s", mine, here) ||
            ns_ip(np, err, cap, "link set %s up", here) ||
            ns_ip(np, err, cap, "-n %s addr add %s/30 dev %s", ns, np->root_ip[k], there) ||
            ns_ip(np, err, cap, "-n %s link set %s up", ns, there))
            return -1;
    }
    return 0;
}

int netns_pair_create(netns_pair_t *np, bool root_links, char *err, size_t errcap)
{
    memset(np, 0, sizeof(*np));
    np->home_fd = np->guard_fd = -1;
    const char *bin = ns_ip_bin();
    if (!bin) {
        snprintf(err, errcap, "no `ip` binary (iproute2) in /usr/sbin, /sbin, /usr/bin, /bin");
        return -1;
    }
    snprintf(np->ip_bin, sizeof(np->ip_bin), "%s", bin);
    if (geteuid() != 0) {
        snprintf(err, errcap, "network namespaces need root (euid %d)", (int)geteuid());
        return -1;
    }
    ns_names(np, root_links);
    np->home_fd = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    int fds[2];
    if (np->home_fd < 0 || pipe2(fds, O_CLOEXEC) != 0) {
        snprintf(err, errcap, "/proc/self/ns/net or pipe: %s", strerror(errno));
        netns_pair_destroy(np);
        return -1;
    }
    char *d0[] = {np->ip_bin, "netns", "del", np->ns[0], NULL};
    char *d1[] = {np->ip_bin, "netns", "del", np->ns[1], NULL};
    char *d2[] = {np->ip_bin, "link", "del", np->veth[0], NULL};
    char *d3[] = {np->ip_bin, "link", "del", np->veth[1], NULL};
    char *d4[] = {np->ip_bin, "link", "del", np->veth[2], NULL};
    char *const *const del[] = {d0, d1, d2, root_links ? d3 : NULL, root_links ? d4 : NULL, NULL};
    np->guard = fork();
    if (np->guard < 0) {
        snprintf(err, errcap, "fork: %s", strerror(errno));
        close(fds[0]), close(fds[1]);
        np->guard = 0;
        netns_pair_destroy(np);
        return -1;
    }
    if (np->guard == 0) ns_guard(fds[0], del);
    close(fds[0]);
    np->guard_fd = fds[1];
    if (ns_build(np, root_links, err, errcap) != 0) {
        netns_pair_destroy(np);
        return -1;
    }
    return 0;
}

void netns_pair_destroy(netns_pair_t *np)
{
    if (np->ns[0][0]) {
        /* the namespaces take the veths with them; a half-made one may still be here */
        ns_ip(np, NULL, 0, "netns del %s", np->ns[0]);
        ns_ip(np, NULL, 0, "netns del %s", np->ns[1]);
        for (int k = 0; k < 3; k++)
            if (np->veth[k][0]) ns_ip(np, NULL, 0, "link del %s", np->veth[k]);
        np->ns[0][0] = np->ns[1][0] = '\0';
    }
    if (np->guard_fd >= 0) close(np->guard_fd);
    np->guard_fd = -1;
    if (np->guard > 0)
        while (waitpid(np->guard, NULL, 0) < 0 && errno == EINTR) {
        }
    np->guard = 0;
    if (np->home_fd >= 0) close(np->home_fd);
    np->home_fd = -1;
}

int netns_pair_enter(const netns_pair_t *np, const char *name)
{
    if (!name) return setns(np->home_fd, CLONE_NEWNET);
    char path[128];
    snprintf(path, sizeof(path), "/var/run/netns/%s", name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int rc = setns(fd, CLONE_NEWNET);
    int e = errno;
    close(fd);
    errno = e;
    return rc;
}
