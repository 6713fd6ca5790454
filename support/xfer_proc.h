/*
 * The child processes and pipes of the two-process harnesses (support/xfer_proc.c): the
 * transfer harness (xfer_harness.c) and the lean pull (lean_pull.c) fork their producers
 * and consumers and talk to them through these.
 */
#ifndef PKV_SUPPORT_XFER_PROC_H
#define PKV_SUPPORT_XFER_PROC_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Pipes between the processes: write all n bytes (0, or -1 on error); read exactly n bytes
 * by deadline_ns (0, -1 on EOF or error, -2 on timeout). */
int xh_write_all(int fd, const void *p, size_t n);
int xh_read_all(int fd, void *p, size_t n, uint64_t deadline_ns);

/* In a child just forked from `parent`: a process group of its own, and death with its
 * parent (exits at once when the parent is already gone). The parent (in another group)
 * keeps the group from being orphaned: when the caller's group is orphaned (run in the
 * background from a shell that left), a child stopped by a fault case would otherwise
 * bring the kernel's SIGHUP + SIGCONT to the whole group, resuming it early and switching
 * UCX to debug logging (UCX_DEBUG_SIGNO). */
void xh_child_detach(pid_t parent);

/* Wait for child `pid` (<= 0: nothing to do) and store its wait status; a child still
 * there at deadline_ns, or stopped, is killed with SIGKILL and then waited for. A pid that
 * is not a child (or was reaped already) returns at once, *wstatus untouched. */
void xh_reap(pid_t pid, int *wstatus, uint64_t deadline_ns);

#endif
