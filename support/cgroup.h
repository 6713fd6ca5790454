/*
 * A memory cgroup (v1) of its own for a process a benchmark or a test watches: made under
 * this process's own memory cgroup, a process moved into it with its charges, its usage and
 * page cache read, removed at the end. Needs root and the v1 memory controller at
 * /sys/fs/cgroup/memory; each function says when it cannot.
 */
#ifndef PKV_SUPPORT_CGROUP_H
#define PKV_SUPPORT_CGROUP_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Make <own memory cgroup>/<tag>-<pid>-<n> (dir: n bytes). 0, or -1 with the reason in why. */
int cgroup_v1_make(const char *tag, char *dir, size_t n, char *why, size_t wn);
/* Move pid into dir, its charged memory with it (move_charge_at_immigrate). 0 or -1. */
int cgroup_v1_adopt(const char *dir, pid_t pid);
/* memory.usage_in_bytes and memory.stat's "cache" (page cache charged to it). 0 or -1. */
int cgroup_v1_read(const char *dir, uint64_t *usage, uint64_t *cache);
/* Remove dir once its processes are gone (retried up to ~1 s). */
void cgroup_v1_remove(const char *dir);

#endif
