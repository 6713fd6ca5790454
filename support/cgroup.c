#include "support/cgroup.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define CG_ROOT "/sys/fs/cgroup/memory"

/* This process's memory cgroup path ("" for the root). */
static void own_path(char *own, size_t n)
{
    char buf[4096];
    own[0] = 0;
    FILE *f = fopen("/proc/self/cgroup", "r");
    if (!f) return;
    while (fgets(buf, sizeof(buf), f)) {
        char *c1 = strchr(buf, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (c2 && strstr(c1, ":memory:") == c1) {
            snprintf(own, n, "%s", c2 + 1);
            own[strcspn(own, "\n")] = 0;
        }
    }
    fclose(f);
}

int cgroup_v1_make(const char *tag, char *dir, size_t n, char *why, size_t wn)
{
    static atomic_uint seq;
    struct stat sb;
    if (stat(CG_ROOT "/memory.limit_in_bytes", &sb)) {
        snprintf(why, wn, "no cgroup v1 memory controller at " CG_ROOT);
        return -1;
    }
    char own[1024], parent[1100];
    own_path(own, sizeof(own));
    snprintf(parent, sizeof(parent), CG_ROOT "%s", own);
    if (stat(parent, &sb)) snprintf(parent, sizeof(parent), CG_ROOT);
    snprintf(dir, n, "%s/%s-%d-%u", parent, tag, (int)getpid(), atomic_fetch_add(&seq, 1));
    if (mkdir(dir, 0755)) {
        snprintf(why, wn, "mkdir %s: %s", dir, strerror(errno));
        return -1;
    }
    return 0;
}

static int put(const char *dir, const char *file, const char *text)
{
    char path[1400];
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t k = write(fd, text, strlen(text));
    close(fd);
    return k == (ssize_t)strlen(text) ? 0 : -1;
}

int cgroup_v1_adopt(const char *dir, pid_t pid)
{
    char p[24];
    snprintf(p, sizeof(p), "%d", (int)pid);
    put(dir, "memory.move_charge_at_immigrate", "3");
    return put(dir, "cgroup.procs", p);
}

int cgroup_v1_read(const char *dir, uint64_t *usage, uint64_t *cache)
{
    char path[1400], line[256];
    unsigned long long u = 0, c = 0;
    snprintf(path, sizeof(path), "%s/memory.usage_in_bytes", dir);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int ok = fscanf(f, "%llu", &u) == 1;
    fclose(f);
    snprintf(path, sizeof(path), "%s/memory.stat", dir);
    if (!ok || !(f = fopen(path, "r"))) return -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "cache %llu", &c) == 1) break;
    fclose(f);
    *usage = u;
    *cache = c;
    return 0;
}

void cgroup_v1_remove(const char *dir)
{
    for (int i = 0; i < 100 && rmdir(dir) != 0 && errno == EBUSY; i++)
        nanosleep(&(struct timespec){0, 10000000}, NULL);
}
