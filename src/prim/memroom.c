/*
 * prim: the memory left to this process, read from the kernel's accounting: its memory
 * cgroup's limit and usage (v2 or v1, this cgroup and its ancestors), the machine's
 * MemAvailable and the memory pressure stall figure (PSI). See prim.h. Every path is
 * taken relative to a root that tests point at fake files, so the sources a test
 * machine lacks (v2 on a v1 host, PSI, a limited cgroup) are still exercised.
 */
#include "prim/prim.h"

#include "core/core.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define ROOM_PATH    1024
#define ROOM_NOLIMIT (1ull << 60) /* v1 writes ~2^63 for "no limit" */

typedef struct {
    const char *root; /* "" for the real files */
} room_ctx_t;

/* Read ROOT/path (at most cap - 1 bytes, NUL-terminated). false when missing or empty. */
static bool room_read(const room_ctx_t *c, const char *path, char *buf, size_t cap)
{
    char full[ROOM_PATH + 256];
    if ((size_t)snprintf(full, sizeof(full), "%s%s", c->root, path) >= sizeof(full)) return false;
    int fd = open(full, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    size_t len = 0;
    ssize_t n;
    while (len + 1 < cap && (n = read(fd, buf + len, cap - 1 - len)) > 0) len += (size_t)n;
    close(fd);
    buf[len] = 0;
    return len > 0;
}

/* A file holding one number (or "max": *out = UINT64_MAX). */
static bool room_read_u64(const room_ctx_t *c, const char *path, uint64_t *out)
{
    char buf[64];
    if (!room_read(c, path, buf, sizeof(buf))) return false;
    if (!strncmp(buf, "max", 3)) {
        *out = UINT64_MAX;
        return true;
    }
    char *end;
    unsigned long long v = strtoull(buf, &end, 10);
    if (end == buf) return false;
    *out = v;
    return true;
}

/* The value of "key N" in a memory.stat-style file (0 when absent). */
static uint64_t room_stat_field(const char *buf, const char *key)
{
    size_t k = strlen(key);
    for (const char *p = buf; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncmp(p, key, k) && p[k] == ' ') return strtoull(p + k + 1, NULL, 10);
    return 0;
}

/* One cgroup directory's room: false when it has no limit or cannot be read. */
static bool room_cgroup_dir(const room_ctx_t *c, int version, const char *dir,
                            pkv_prim_room_src_t *out)
{
    char path[ROOM_PATH + 64], stat[8192];
    uint64_t limit, usage;
    const char *f_limit = version == 2 ? "memory.max" : "memory.limit_in_bytes";
    const char *f_usage = version == 2 ? "memory.current" : "memory.usage_in_bytes";
    const char *k_inactive = version == 2 ? "inactive_file" : "total_inactive_file";
    snprintf(path, sizeof(path), "%s/%s", dir, f_limit);
    if (!room_read_u64(c, path, &limit) || limit >= ROOM_NOLIMIT) return false;
    snprintf(path, sizeof(path), "%s/%s", dir, f_usage);
    if (!room_read_u64(c, path, &usage)) return false;
    snprintf(path, sizeof(path), "%s/memory.stat", dir);
    uint64_t inactive =
        room_read(c, path, stat, sizeof(stat)) ? room_stat_field(stat, k_inactive) : 0;
    *out = (pkv_prim_room_src_t){
        .present = true, .limit_bytes = limit, .usage_bytes = usage - PKV_MIN(usage, inactive)};
    return true;
}

static uint64_t room_left(const pkv_prim_room_src_t *s)
{
    return s->limit_bytes - PKV_MIN(s->limit_bytes, s->usage_bytes);
}

/* Walk the cgroup `cg` (a path from /proc/self/cgroup) and its ancestors under `mount`;
 * keep the limited one with the least room in *best. */
static bool room_cgroup_walk(const room_ctx_t *c, int version, const char *mount, const char *cg,
                             pkv_prim_room_src_t *best)
{
    char dir[ROOM_PATH];
    bool found = false;
    if ((size_t)snprintf(dir, sizeof(dir), "%s%s", mount, cg) >= sizeof(dir)) return false;
    size_t base = strlen(mount);
    for (;;) {
        size_t n = strlen(dir);
        while (n > base && dir[n - 1] == '/') dir[--n] = 0;
        pkv_prim_room_src_t s;
        if (room_cgroup_dir(c, version, dir, &s) && (!found || room_left(&s) < room_left(best))) {
            *best = s;
            found = true;
        }
        char *slash = strrchr(dir + base, '/');
        if (n <= base) break;
        if (slash)
            *slash = 0;
        else
            dir[base] = 0;
    }
    return found;
}

/* This process's memory cgroup from /proc/self/cgroup: the v1 line whose controllers
 * include "memory", else the v2 line "0::PATH". */
static void room_cgroup(const room_ctx_t *c, pkv_prim_room_t *out)
{
    char buf[4096], v1[ROOM_PATH] = "", v2[ROOM_PATH] = "";
    bool have_v1 = false, have_v2 = false;
    if (!room_read(c, "/proc/self/cgroup", buf, sizeof(buf))) return;
    for (char *save = NULL, *line = strtok_r(buf, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2 || strlen(c2 + 1) >= ROOM_PATH) continue;
        *c2 = 0;
        const char *ctrls = c1 + 1, *path = c2 + 1;
        if (!strncmp(line, "0", 1) && c1 == line + 1 && !*ctrls) {
            snprintf(v2, sizeof(v2), "%s", path);
            have_v2 = true;
            continue;
        }
        for (const char *t = ctrls; t && *t; t = strchr(t, ','), t = t ? t + 1 : NULL)
            if (!strncmp(t, "memory", 6) && (t[6] == ',' || t[6] == 0)) {
                snprintf(v1, sizeof(v1), "%s", path);
                have_v1 = true;
            }
    }
    pkv_prim_room_src_t s;
    if (have_v1 && room_cgroup_walk(c, 1, "/sys/fs/cgroup/memory", v1, &s)) {
        out->cgroup = s;
        out->cgroup_version = 1;
    }
    if (have_v2 &&
        (room_cgroup_walk(c, 2, "/sys/fs/cgroup", v2, &s) ||
         room_cgroup_walk(c, 2, "/sys/fs/cgroup/unified", v2, &s)) &&
        (!out->cgroup_version || room_left(&s) < room_left(&out->cgroup))) {
        out->cgroup = s;
        out->cgroup_version = 2;
    }
}

static void room_meminfo(const room_ctx_t *c, pkv_prim_room_t *out)
{
    char buf[8192];
    if (!room_read(c, "/proc/meminfo", buf, sizeof(buf))) return;
    const char *t = strstr(buf, "MemTotal:"), *a = strstr(buf, "MemAvailable:");
    if (!t || !a) return;
    uint64_t total = strtoull(t + 9, NULL, 10) * 1024, avail = strtoull(a + 13, NULL, 10) * 1024;
    if (!total) return;
    out->machine = (pkv_prim_room_src_t){
        .present = true, .limit_bytes = total, .usage_bytes = total - PKV_MIN(total, avail)};
}

static void room_psi(const room_ctx_t *c, pkv_prim_room_t *out)
{
    char buf[512];
    if (!room_read(c, "/proc/pressure/memory", buf, sizeof(buf))) return;
    const char *p = strstr(buf, "some avg10=");
    if (!p) return;
    char *end;
    double v = strtod(p + 11, &end);
    if (end == p + 11) return;
    out->have_psi = true;
    out->psi_some_avg10 = v;
}

int pkv_prim_room_read(const char *root, pkv_prim_room_t *out)
{
    if (root && strlen(root) >= 256) return PKV_ERR_INVALID;
    room_ctx_t c = {.root = root && strcmp(root, "/") ? root : ""};
    pkv_prim_room_t r = {0};
    room_cgroup(&c, &r);
    room_meminfo(&c, &r);
    room_psi(&c, &r);
    *out = r;
    return PKV_OK;
}
