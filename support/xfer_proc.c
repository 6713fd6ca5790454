/*
 * The child processes and pipes of the two-process harnesses (see xfer_proc.h).
 */
#include "support/xfer_proc.h"

#include "core/core.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

int xh_write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

int xh_read_all(int fd, void *p, size_t n, uint64_t deadline_ns)
{
    uint8_t *b = p;
    while (n) {
        uint64_t now = pkv_now_ns();
        if (now >= deadline_ns) return -2;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int ms = (int)PKV_MIN((deadline_ns - now) / 1000000 + 1, 1000);
        int pr = poll(&pfd, 1, ms);
        if (pr < 0 && errno != EINTR) return -1;
        if (pr <= 0) continue;
        ssize_t r = read(fd, b, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        b += r;
        n -= (size_t)r;
    }
    return 0;
}

void xh_child_detach(pid_t parent)
{
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(3);
}

void xh_reap(pid_t pid, int *wstatus, uint64_t deadline_ns)
{
    if (pid <= 0) return;
    for (;;) {
        int st;
        pid_t w = waitpid(pid, &st, WNOHANG | WUNTRACED);
        if (w == pid && !WIFSTOPPED(st)) {
            *wstatus = st;
            return;
        }
        if (w < 0 && errno == ECHILD) return; /* not ours, or already reaped: *wstatus stays */
        if (w == pid && WIFSTOPPED(st)) kill(pid, SIGKILL);
        if (pkv_now_ns() > deadline_ns) {
            kill(pid, SIGKILL);
            deadline_ns = UINT64_MAX;
        }
        usleep(2000);
    }
}
