/*
 * prim: transparent huge pages, asked for and measured. See prim.h.
 *
 * Asking (MADV_HUGEPAGE before the populate of pkv_prim_commit) is not getting: the
 * kernel may be set to `never`, or find no free 2 MiB page and fall back to 4 KiB pages
 * without a word. So what is reported is measured: the AnonHugePages the kernel lists in
 * /proc/self/smaps for the mappings of a range, and a probe that commits one aligned
 * huge page on its own mapping and reads its smaps entry back.
 */
#include "prim/prim.h"

#include "core/core.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

const char *pkv_prim_thp_mode_name(pkv_prim_thp_mode_t m)
{
    switch (m) {
    case PKV_PRIM_THP_ALWAYS:
        return "always";
    case PKV_PRIM_THP_MADVISE:
        return "madvise";
    case PKV_PRIM_THP_NEVER:
        return "never";
    case PKV_PRIM_THP_UNKNOWN:
        break;
    }
    return "unknown";
}

int pkv_prim_thp_mode(const char *root, pkv_prim_thp_mode_t *out)
{
    char path[1024], buf[256];
    const char *r = root && strcmp(root, "/") ? root : "";
    if ((size_t)snprintf(path, sizeof(path), "%s/sys/kernel/mm/transparent_hugepage/enabled", r) >=
        sizeof(path))
        return PKV_ERR_INVALID;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return PKV_ERR_IO;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0) return PKV_ERR_IO;
    buf[n] = 0;
    /* "always [madvise] never": the bracketed word is the mode. */
    static const struct {
        const char *word;
        pkv_prim_thp_mode_t mode;
    } modes[] = {{"[always]", PKV_PRIM_THP_ALWAYS},
                 {"[madvise]", PKV_PRIM_THP_MADVISE},
                 {"[never]", PKV_PRIM_THP_NEVER}};
    for (size_t i = 0; i < PKV_ARRAY_LEN(modes); i++)
        if (strstr(buf, modes[i].word)) {
            *out = modes[i].mode;
            return PKV_OK;
        }
    return PKV_ERR_IO;
}

/* The value in KiB after `key` at p (a line of smaps), in bytes. */
static uint64_t smaps_kib(const char *p, size_t key_len)
{
    p += key_len;
    while (*p == ' ' || *p == '\t') p++;
    uint64_t v = 0;
    while (*p >= '0' && *p <= '9') v = v * 10 + (uint64_t)(*p++ - '0');
    return v * 1024;
}

int pkv_prim_range_pages(const void *addr, size_t size, pkv_prim_range_pages_t *out)
{
    FILE *f = fopen("/proc/self/smaps", "re");
    if (!f) return PKV_ERR_IO;
    uintptr_t lo = (uintptr_t)addr, hi = lo + size;
    pkv_prim_range_pages_t r = {0};
    bool in = false, line_start = true;
    char line[512];
    while (fgets(line, sizeof(line), f)) {
        /* A line longer than the buffer (a mapping's long path) comes in pieces: only a
         * piece that starts a line is looked at. */
        bool starts = line_start;
        line_start = strchr(line, '\n') != NULL;
        if (!starts) continue;
        unsigned long long a, b;
        if (sscanf(line, "%llx-%llx", &a, &b) == 2) {
            /* A mapping's header line ("start-end perms ..."; no field line has a '-'
             * after a hex prefix): count the ones that overlap the range. */
            in = a < hi && b > lo;
            if (in) r.mappings++;
            continue;
        }
        if (!in) continue;
        if (!strncmp(line, "Rss:", 4))
            r.resident_bytes += smaps_kib(line, 4);
        else if (!strncmp(line, "AnonHugePages:", 14))
            r.huge_bytes += smaps_kib(line, 14);
    }
    bool err = ferror(f);
    fclose(f);
    if (err) return PKV_ERR_IO;
    *out = r;
    return PKV_OK;
}

int pkv_prim_huge_probe(bool *got)
{
    void *p;
    int rc = pkv_prim_reserve(PKV_PRIM_HUGE, PKV_PRIM_HUGE, &p);
    if (rc) return rc;
    pkv_prim_range_pages_t pg = {0};
    rc = PKV_ERR_NOMEM;
    if (mprotect(p, PKV_PRIM_HUGE, PROT_READ | PROT_WRITE) == 0) {
        (void)madvise(p, PKV_PRIM_HUGE, MADV_HUGEPAGE);
        if (madvise(p, PKV_PRIM_HUGE, MADV_POPULATE_WRITE) != 0) ((volatile char *)p)[0] = 1;
        rc = pkv_prim_range_pages(p, PKV_PRIM_HUGE, &pg);
    }
    pkv_prim_release(p, PKV_PRIM_HUGE);
    if (rc) return rc;
    *got = pg.huge_bytes >= PKV_PRIM_HUGE;
    return PKV_OK;
}
