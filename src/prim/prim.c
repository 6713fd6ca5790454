/*
 * prim: OS memory primitives. See prim.h.
 *
 * Reservations are PROT_NONE | MAP_NORESERVE: they cost no RSS and no commit charge.
 * Commit flips a range to read/write and prefaults it with MADV_POPULATE_WRITE (a fault
 * costs ~15 us per 4 KiB page on this class of machine; populate is ~20x cheaper).
 * Decommit is MADV_DONTNEED (RSS drops at once) and back to PROT_NONE, so a stray
 * access to uncommitted KV memory faults instead of silently committing it.
 */
#include "prim/prim.h"

#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

int pkv_prim_reserve(size_t size, size_t align, void **out)
{
    if (size == 0 || (align & (align - 1)) || align < PKV_PRIM_PAGE) return PKV_ERR_INVALID;
    size_t span = size + align - PKV_PRIM_PAGE;
    void *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return PKV_ERR_NOMEM;
    uintptr_t a = ((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1);
    size_t head = a - (uintptr_t)p, tail = span - head - size;
    if (head) munmap(p, head);
    if (tail) munmap((char *)a + size, tail);
    *out = (void *)a;
    return PKV_OK;
}

void pkv_prim_release(void *addr, size_t size)
{
    if (addr) munmap(addr, size);
}

static void prim_touch(void *addr, size_t size)
{
    volatile char *p = addr;
    for (size_t off = 0; off < size; off += PKV_PRIM_PAGE) p[off] = 0;
}

int pkv_prim_commit(void *addr, size_t size, bool huge)
{
    if (pkv_fault_hit(PKV_FAULT_COMMIT)) return PKV_ERR_NOMEM;
    if (mprotect(addr, size, PROT_READ | PROT_WRITE) != 0) return PKV_ERR_NOMEM;
    if (huge) (void)madvise(addr, size, MADV_HUGEPAGE);
    if (madvise(addr, size, MADV_POPULATE_WRITE) != 0) {
        if (errno != EINVAL) { /* ENOMEM etc: the memory is not there */
            madvise(addr, size, MADV_DONTNEED);
            mprotect(addr, size, PROT_NONE);
            return PKV_ERR_NOMEM;
        }
        prim_touch(addr, size); /* kernel older than 5.14 */
    }
    return PKV_OK;
}

int pkv_prim_decommit(void *addr, size_t size)
{
    if (madvise(addr, size, MADV_DONTNEED) != 0) return PKV_ERR_IO;
    if (mprotect(addr, size, PROT_NONE) != 0) return PKV_ERR_IO;
    return PKV_OK;
}

int pkv_prim_lock(void *addr, size_t size)
{
    if (pkv_fault_hit(PKV_FAULT_MLOCK)) return PKV_ERR_IO;
    return mlock(addr, size) == 0 ? PKV_OK : PKV_ERR_IO;
}

void pkv_prim_unlock(void *addr, size_t size)
{
    munlock(addr, size);
}

int pkv_prim_shared_create(const char *name, size_t size, int *fd_out, void **addr_out)
{
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0) return PKV_ERR_IO;
    if (ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        return PKV_ERR_NOMEM;
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (p == MAP_FAILED) {
        close(fd);
        return PKV_ERR_NOMEM;
    }
    *fd_out = fd;
    *addr_out = p;
    return PKV_OK;
}

int pkv_prim_shared_map(int fd, size_t size, void **addr_out)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (p == MAP_FAILED) return PKV_ERR_NOMEM;
    *addr_out = p;
    return PKV_OK;
}

void pkv_prim_shared_close(int fd, void *addr, size_t size)
{
    if (addr) munmap(addr, size);
    if (fd >= 0) close(fd);
}

int pkv_prim_shared_decommit(int fd, void *addr, size_t offset, size_t size)
{
    (void)addr;
    if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)offset, (off_t)size) != 0)
        return PKV_ERR_IO;
    return PKV_OK;
}

int pkv_prim_shared_commit(int fd, void *addr, size_t offset, size_t size)
{
    char *p = (char *)addr + offset;
    if (pkv_fault_hit(PKV_FAULT_COMMIT)) return PKV_ERR_NOMEM;
    if (madvise(p, size, MADV_POPULATE_WRITE) == 0) return PKV_OK;
    if (errno == EINVAL) { /* kernel older than 5.14: allocate, then fault in */
        if (fallocate(fd, 0, (off_t)offset, (off_t)size) == 0) {
            prim_touch(p, size);
            return PKV_OK;
        }
    }
    (void)fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)offset, (off_t)size);
    return PKV_ERR_NOMEM;
}

void pkv_prim_heap_trim(void)
{
    malloc_trim(0);
}

static int prim_open_proc(int pid, const char *what)
{
    char path[64];
    if (pid == 0)
        snprintf(path, sizeof(path), "/proc/self/%s", what);
    else
        snprintf(path, sizeof(path), "/proc/%d/%s", pid, what);
    return open(path, O_RDONLY | O_CLOEXEC);
}

static uint64_t prim_field_kib(const char *buf, const char *key)
{
    const char *p = strstr(buf, key);
    if (!p) return 0;
    p += strlen(key);
    while (*p == ' ' || *p == '\t') p++;
    uint64_t v = 0;
    while (*p >= '0' && *p <= '9') v = v * 10 + (uint64_t)(*p++ - '0');
    return v * 1024;
}

static int prim_read_proc(int pid, const char *what, char *buf, size_t cap)
{
    int fd = prim_open_proc(pid, what);
    if (fd < 0) return PKV_ERR_IO;
    size_t len = 0;
    ssize_t n;
    while (len + 1 < cap && (n = read(fd, buf + len, cap - 1 - len)) > 0) len += (size_t)n;
    close(fd);
    buf[len] = 0;
    return len ? PKV_OK : PKV_ERR_IO;
}

int pkv_prim_mem_read(int pid, pkv_prim_mem_t *out)
{
    char buf[4096];
    int rc = prim_read_proc(pid, "status", buf, sizeof(buf));
    if (rc) return rc;
    out->rss_bytes = prim_field_kib(buf, "\nVmRSS:");
    out->hwm_bytes = prim_field_kib(buf, "\nVmHWM:");
    out->rss_anon_bytes = prim_field_kib(buf, "\nRssAnon:");
    out->rss_shmem_bytes = prim_field_kib(buf, "\nRssShmem:");
    out->locked_bytes = prim_field_kib(buf, "\nVmLck:");
    return PKV_OK;
}

int pkv_prim_smaps_read(int pid, uint64_t *rss_bytes, uint64_t *pss_bytes)
{
    char buf[4096];
    int rc = prim_read_proc(pid, "smaps_rollup", buf, sizeof(buf));
    if (rc) return rc;
    *rss_bytes = prim_field_kib(buf, "\nRss:");
    *pss_bytes = prim_field_kib(buf, "\nPss:");
    return PKV_OK;
}

int pkv_prim_hwm_reset(void)
{
    return pkv_prim_hwm_reset_pid(0);
}

int pkv_prim_hwm_reset_pid(int pid)
{
    char path[64];
    if (pid == 0)
        snprintf(path, sizeof(path), "/proc/self/clear_refs");
    else
        snprintf(path, sizeof(path), "/proc/%d/clear_refs", pid);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return PKV_ERR_IO;
    ssize_t n = write(fd, "5", 1);
    close(fd);
    return n == 1 ? PKV_OK : PKV_ERR_IO;
}

int pkv_prim_smaps_rollup(int pid, pkv_prim_smaps_t *out)
{
    char buf[4096];
    int rc = prim_read_proc(pid, "smaps_rollup", buf, sizeof(buf));
    if (rc) return rc;
    pkv_prim_smaps_t m = {
        .rss_bytes = prim_field_kib(buf, "\nRss:"),
        .pss_bytes = prim_field_kib(buf, "\nPss:"),
        .pss_anon_bytes = prim_field_kib(buf, "\nPss_Anon:"),
        .pss_file_bytes = prim_field_kib(buf, "\nPss_File:"),
        .anonymous_bytes = prim_field_kib(buf, "\nAnonymous:"),
        .anon_huge_bytes = prim_field_kib(buf, "\nAnonHugePages:"),
        .private_dirty_bytes = prim_field_kib(buf, "\nPrivate_Dirty:"),
        .swap_bytes = prim_field_kib(buf, "\nSwap:"),
    };
    *out = m;
    return PKV_OK;
}

/* ---- this boot and other processes' memfds (the transfer engine) ------------------- */

int pkv_prim_loadavg(double *out)
{
    FILE *f = fopen("/proc/loadavg", "re");
    if (!f) return PKV_ERR_IO;
    double l;
    int ok = fscanf(f, "%lf", &l) == 1;
    fclose(f);
    if (!ok) return PKV_ERR_IO;
    *out = l;
    return PKV_OK;
}

int pkv_prim_cpu_ticks(uint64_t *total, uint64_t *steal)
{
    FILE *f = fopen("/proc/stat", "re");
    if (!f) return PKV_ERR_IO;
    unsigned long long v[8] = {0};
    int n = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
                   &v[4], &v[5], &v[6], &v[7]);
    fclose(f);
    if (n != 8) return PKV_ERR_IO;
    uint64_t sum = 0;
    for (int i = 0; i < 8; i++) sum += v[i];
    *total = sum;
    *steal = v[7];
    return PKV_OK;
}

void pkv_prim_cpu_model(char *buf, size_t n)
{
    char name[128] = "", line[256];
    int family = -1, model = -1;
    FILE *f = fopen("/proc/cpuinfo", "re");
    while (f && fgets(line, sizeof(line), f) && strcmp(line, "\n")) { /* the first CPU */
        char *v = strchr(line, ':');
        if (!v) continue;
        v += strspn(v + 1, " \t") + 1;
        v[strcspn(v, "\n")] = 0;
        if (!strncmp(line, "model name", 10))
            snprintf(name, sizeof(name), "%s", v);
        else if (!strncmp(line, "cpu family", 10))
            family = atoi(v);
        else if (!strncmp(line, "model\t", 6))
            model = atoi(v);
    }
    if (f) fclose(f);
    if (!n) return;
    if (!name[0])
        snprintf(buf, n, "unknown");
    else if (family < 0 || model < 0)
        snprintf(buf, n, "%s", name);
    else
        snprintf(buf, n, "%s (family %d, model %d)", name, family, model);
}

bool pkv_prim_cpu_amd(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
    (void)a;
    return b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;
#else
    return false;
#endif
}

int pkv_prim_boot_id(uint8_t out[16])
{
    char txt[64] = {0};
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return PKV_ERR_IO;
    ssize_t n = read(fd, txt, sizeof(txt) - 1);
    close(fd);
    if (n <= 0) return PKV_ERR_IO;
    uint8_t id[16] = {0};
    int nib = 0;
    for (ssize_t i = 0; i < n && nib < 32; i++) {
        char ch = txt[i];
        int v = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
        if (v < 0) continue;
        id[nib / 2] |= (uint8_t)(nib % 2 ? v : v << 4);
        nib++;
    }
    if (nib != 32) return PKV_ERR_IO;
    memcpy(out, id, sizeof(id));
    return PKV_OK;
}

int pkv_prim_shared_map_pid(uint32_t pid, int fd, uint64_t ino, size_t size, int *fd_out,
                            void **addr_out)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%u/fd/%d", pid, fd);
    int mfd = open(path, O_RDWR | O_CLOEXEC);
    if (mfd < 0) return PKV_ERR_IO;
    struct stat sb;
    void *base = NULL;
    if (fstat(mfd, &sb) || (uint64_t)sb.st_ino != ino || (uint64_t)sb.st_size < size ||
        pkv_prim_shared_map(mfd, size, &base)) {
        close(mfd);
        return PKV_ERR_IO;
    }
    *fd_out = mfd;
    *addr_out = base;
    return PKV_OK;
}
