/*
 * prim: the only module that talks to the OS about memory (mmap, madvise, mlock,
 * memfd) and reads the process's own accounting from /proc. Every other module goes
 * through these calls, so the OS surface is one small file.
 */
#ifndef PKV_PRIM_PRIM_H
#define PKV_PRIM_PRIM_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#define PKV_PRIM_PAGE 4096u
#define PKV_PRIM_HUGE (2u << 20)

/* The commit unit a paged pool takes by default for blocks of block_bytes: 2 MiB, the
 * huge page, when blocks fill it (every plain dtype at the usual geometries); else the
 * multiple of 2 MiB up to 8 MiB that wastes least, the first under 4 %. A scaled KV row
 * is head_dim + 4 bytes, so a block is (D + 4) / D of a power of two: at D = 64 7 blocks
 * leave 7 % of 2 MiB idle, 15 fill 4 MiB to 0.4 %. */
static inline uint64_t pkv_prim_granule_for(uint64_t block_bytes)
{
    uint64_t best = PKV_PRIM_HUGE;
    double best_waste = 1.0;
    for (uint64_t g = PKV_PRIM_HUGE; g <= 4ull * PKV_PRIM_HUGE; g += PKV_PRIM_HUGE) {
        if (g < block_bytes) continue;
        double waste = (double)(g % block_bytes) / (double)g;
        if (waste < best_waste) best = g, best_waste = waste;
        if (waste < 0.04) break;
    }
    return best;
}

/* A range's bytes per granule holding `used` bytes of blocks: whole 4 KiB pages, or whole
 * 2 MiB pages when that wastes under 1/64 (a 4 MiB granule of 15 quantized blocks is
 * still two huge pages; a TP rank's 1 MiB half of a 2 MiB granule stays 1 MiB). */
static inline uint64_t pkv_prim_granule_stride(uint64_t used)
{
    uint64_t huge = (used + PKV_PRIM_HUGE - 1) / PKV_PRIM_HUGE * PKV_PRIM_HUGE;
    return huge - used < huge / 64 ? huge
                                   : (used + PKV_PRIM_PAGE - 1) / PKV_PRIM_PAGE * PKV_PRIM_PAGE;
}

/* Reserve `size` bytes of address space (no RSS, no commit charge), aligned to
 * `align` (a power of two >= 4 KiB). Reads or writes before commit are a bug.
 * Returns PKV_OK and *out, or PKV_ERR_NOMEM. */
int pkv_prim_reserve(size_t size, size_t align, void **out);
/* Release a reservation made by pkv_prim_reserve (whole range). */
void pkv_prim_release(void *addr, size_t size);
/* Make [addr, addr+size) readable, writable and resident, prefaulted
 * (MADV_POPULATE_WRITE; touching each page where the kernel lacks it). On failure
 * nothing stays committed. `huge`: ask for transparent huge pages first. */
int pkv_prim_commit(void *addr, size_t size, bool huge);
/* Return [addr, addr+size) to the OS at once (RSS drops) and make it inaccessible. */
int pkv_prim_decommit(void *addr, size_t size);
/* Pin / unpin resident pages (mlock). PKV_ERR_IO where the OS refuses. */
int pkv_prim_lock(void *addr, size_t size);
void pkv_prim_unlock(void *addr, size_t size);

/* A memfd of `size` bytes (sparse) mapped MAP_SHARED, address-space only.
 * *fd_out stays open for sharing with a peer; close with pkv_prim_shared_close. */
int pkv_prim_shared_create(const char *name, size_t size, int *fd_out, void **addr_out);
int pkv_prim_shared_map(int fd, size_t size, void **addr_out);
void pkv_prim_shared_close(int fd, void *addr, size_t size);
/* Punch pages of a memfd-backed range out (returns their memory). */
int pkv_prim_shared_decommit(int fd, void *addr, size_t offset, size_t size);
/* Make [offset, offset+size) of a memfd mapped at `addr` resident, prefaulted in this
 * mapping (MADV_POPULATE_WRITE; fallocate and touch where the kernel lacks it). On
 * failure the range is punched out again. PKV_ERR_NOMEM when the memory is not there. */
int pkv_prim_shared_commit(int fd, void *addr, size_t offset, size_t size);

/* Return the C heap's free memory to the OS (malloc_trim: every arena's top and the free
 * pages inside). For a process going idle: it walks every arena under its lock. */
void pkv_prim_heap_trim(void);

/* The process's memory as the OS reports it. */
typedef struct {
    uint64_t rss_bytes; /* VmRSS */
    uint64_t hwm_bytes; /* VmHWM */
    uint64_t rss_anon_bytes;
    uint64_t rss_shmem_bytes;
    uint64_t locked_bytes; /* VmLck: mlocked */
} pkv_prim_mem_t;
/* Read /proc/<pid>/status (pid 0: self). */
int pkv_prim_mem_read(int pid, pkv_prim_mem_t *out);
/* Pss and Rss from /proc/<pid>/smaps_rollup (slow: ~14 ms at 4 GiB). */
int pkv_prim_smaps_read(int pid, uint64_t *rss_bytes, uint64_t *pss_bytes);
/* Reset VmHWM to the current RSS (writes 5 to /proc/self/clear_refs). */
int pkv_prim_hwm_reset(void);
/* The same for another process (pid 0: self); needs the right to write its clear_refs. */
int pkv_prim_hwm_reset_pid(int pid);

/* /proc/<pid>/smaps_rollup, the fields that say where resident memory is. */
typedef struct {
    uint64_t rss_bytes, pss_bytes;
    uint64_t pss_anon_bytes, pss_file_bytes; /* 0 where the kernel lacks the field */
    uint64_t anonymous_bytes, anon_huge_bytes;
    uint64_t private_dirty_bytes, swap_bytes;
} pkv_prim_smaps_t;
/* Read /proc/<pid>/smaps_rollup (pid 0: self). *out is written only on success. */
int pkv_prim_smaps_rollup(int pid, pkv_prim_smaps_t *out);

/* The machine's 1-minute load average (the first field of /proc/loadavg). PKV_ERR_IO when
 * it cannot be read; *out is written only on success. */
int pkv_prim_loadavg(double *out);

/* The machine's CPU time so far, from the first line of /proc/stat, in clock ticks: all of
 * it (every field) and of it the time a hypervisor ran something else (steal). PKV_ERR_IO
 * when it cannot be read; the outputs are written only on success. */
int pkv_prim_cpu_ticks(uint64_t *total, uint64_t *steal);

/* The CPU's name with its family and model from /proc/cpuinfo, as "AMD EPYC (family 26,
 * model 2)", into buf (always terminated; "unknown" when it cannot be read). */
void pkv_prim_cpu_model(char *buf, size_t n);

/* Whether the CPU says "AuthenticAMD" (CPUID leaf 0); false off x86-64. The decode
 * kernels prefetch into L1 there and into L2 elsewhere (docs/design/model.md, "Speed"). */
bool pkv_prim_cpu_amd(void);

/* ---- transparent huge pages (hugepage.c) -------------------------------------------- */

typedef enum {
    PKV_PRIM_THP_UNKNOWN = 0, /* the file is missing or unreadable */
    PKV_PRIM_THP_ALWAYS,
    PKV_PRIM_THP_MADVISE, /* huge pages where a mapping asks (MADV_HUGEPAGE) */
    PKV_PRIM_THP_NEVER,
} pkv_prim_thp_mode_t;
const char *pkv_prim_thp_mode_name(pkv_prim_thp_mode_t m);
/* The kernel's THP mode, from ROOT/sys/kernel/mm/transparent_hugepage/enabled (root NULL
 * or "/": the real file; tests point it at a fake). PKV_ERR_IO when it cannot be read or
 * names no mode, PKV_ERR_INVALID for a root too long; *out is written only on success. */
int pkv_prim_thp_mode(const char *root, pkv_prim_thp_mode_t *out);

/* What the kernel holds for the mappings of this process that overlap a range. */
typedef struct {
    uint64_t resident_bytes; /* Rss */
    uint64_t huge_bytes;     /* AnonHugePages: resident in transparent huge pages */
    uint32_t mappings;       /* mappings (VMAs) overlapping the range */
} pkv_prim_range_pages_t;
/* Sum /proc/self/smaps over the mappings that overlap [addr, addr + size). A mapping that
 * reaches past the range (the kernel merged it with a neighbour of the same kind) counts
 * whole. Slow (reads every mapping's entry): for stats, not for hot paths. PKV_ERR_IO when
 * smaps cannot be read; *out is written only on success. */
int pkv_prim_range_pages(const void *addr, size_t size, pkv_prim_range_pages_t *out);
/* Whether the kernel gives this process a transparent huge page now: one 2 MiB-aligned
 * page committed as pkv_prim_commit(huge) does, measured in smaps, then released. A
 * measured answer (the mode may allow it and the kernel still find no free huge page).
 * PKV_OK with *got, or PKV_ERR_NOMEM / PKV_ERR_IO (nothing left mapped). */
int pkv_prim_huge_probe(bool *got);

/* ---- the memory left to this process (memroom.c; the server's memory watcher) ------- */

typedef struct {
    bool present;         /* read, and it has a limit */
    uint64_t limit_bytes; /* the cgroup's limit, or MemTotal */
    uint64_t usage_bytes; /* the cgroup's usage less its inactive file pages (which the
                             kernel reclaims first), or MemTotal - MemAvailable */
} pkv_prim_room_src_t;

typedef struct {
    uint32_t cgroup_version;     /* 1 or 2: where `cgroup` was read; 0: no limited cgroup */
    pkv_prim_room_src_t cgroup;  /* of this process's memory cgroup and its ancestors, the
                                    limited one with the least room (limit - usage) */
    pkv_prim_room_src_t machine; /* /proc/meminfo */
    bool have_psi;
    double psi_some_avg10; /* /proc/pressure/memory: % of the last 10 s in which some task
                              stalled on memory */
} pkv_prim_room_t;

/* Read the sources above. cgroup v2: `0::PATH` of /proc/self/cgroup, memory.max and
 * memory.current (less memory.stat inactive_file) under /sys/fs/cgroup (or its unified/
 * mount); v1: the `memory` line, memory.limit_in_bytes and memory.usage_in_bytes (less
 * total_inactive_file) under /sys/fs/cgroup/memory; PATH and each ancestor up to the
 * mount's root (a container sees its own cgroup as the root). `root`: NULL or "/" for the
 * real files, else a directory standing for "/" (tests point it at fake files). A source
 * that cannot be read is absent; always PKV_OK except PKV_ERR_INVALID for a root too long. */
int pkv_prim_room_read(const char *root, pkv_prim_room_t *out);

/* ---- this boot and other processes' memfds (the transfer engine) ------------------- */

/* This boot's id (/proc/sys/kernel/random/boot_id, 32 hex digits) as 16 bytes.
 * PKV_ERR_IO when it cannot be read or is malformed; *out is written only on success. */
int pkv_prim_boot_id(uint8_t out[16]);
/* Map the first `size` bytes of another process's memfd, reached through
 * /proc/<pid>/fd/<fd>, MAP_SHARED read-write, checking that the file there is inode
 * `ino` and at least `size` bytes long. PKV_OK with *fd_out (kept open) and *addr_out
 * (close both with pkv_prim_shared_close); PKV_ERR_IO otherwise, nothing left open. */
int pkv_prim_shared_map_pid(uint32_t pid, int fd, uint64_t ino, size_t size, int *fd_out,
                            void **addr_out);

#endif
