/*
 * The disk tier's file format (src/tier/segment.c): records and segments round-trip byte
 * for byte; a segment found unsealed (a crash) is scanned and keeps every whole record; a
 * torn tail, a flipped byte in a payload, a header or the index, and a truncated index are
 * each found, counted and never served; repair seals a scanned segment so the next open
 * reads its index; the parser survives its fuzz corpus.
 */
#include "tests/fuzz/props.h"

#include "core/core.h"
#include "tests/support/testutil.h"
#include "tier/tier.h"

#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    char dir[64];
    int dirfd;
    uint8_t layout[PKV_TIER_HASH_BYTES];
    uint32_t n;
    pkv_tier_record_t rec[64];
    uint8_t *payload[64];
} fixture_t;

static void hash_fill(uint8_t *out, uint64_t *rng)
{
    for (uint32_t i = 0; i < PKV_TIER_HASH_BYTES; i++) out[i] = (uint8_t)pkv_splitmix64(rng);
}

/* n records of seeded random sizes (0..max_len bytes), chained keys, one layout. */
static void fixture_init(fixture_t *f, uint32_t n, uint32_t max_len, uint64_t seed)
{
    memset(f, 0, sizeof(*f));
    snprintf(f->dir, sizeof(f->dir), "/tmp/pkv-tier-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(f->dir));
    f->dirfd = open(f->dir, O_RDONLY | O_DIRECTORY);
    ck_assert_int_ge(f->dirfd, 0);
    uint64_t rng = seed;
    hash_fill(f->layout, &rng);
    f->n = n;
    for (uint32_t i = 0; i < n; i++) {
        pkv_tier_record_t *r = &f->rec[i];
        memcpy(r->layout, f->layout, sizeof(r->layout));
        hash_fill(r->key, &rng);
        if (i) memcpy(r->parent, f->rec[i - 1].key, sizeof(r->parent));
        r->payload_len = max_len ? pkv_splitmix64(&rng) % (max_len + 1) : 0;
        f->payload[i] = malloc(r->payload_len ? r->payload_len : 1);
        for (uint64_t b = 0; b < r->payload_len; b++)
            f->payload[i][b] = (uint8_t)pkv_splitmix64(&rng);
    }
}

/* Record i's payload becomes len bytes of a pattern. */
static void set_len(fixture_t *f, uint32_t i, uint32_t len)
{
    free(f->payload[i]);
    f->rec[i].payload_len = len;
    f->payload[i] = malloc(len ? len : 1);
    for (uint32_t b = 0; b < len; b++) f->payload[i][b] = (uint8_t)(b * 31 + i);
}

static void fixture_fini(fixture_t *f)
{
    for (uint32_t i = 0; i < f->n; i++) free(f->payload[i]);
    close(f->dirfd);
    char cmd[96];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", f->dir);
    ck_assert_int_eq(system(cmd), 0);
}

/* Segment 1 with every record, synced; sealed when asked. Returns its size. */
static uint64_t write_segment(fixture_t *f, bool seal)
{
    pkv_tier_seg_t *s;
    ck_assert_int_eq(pkv_tier_seg_create(f->dirfd, 1, f->layout, &s), PKV_OK);
    uint64_t expect = 0;
    for (uint32_t i = 0; i < f->n; i++) {
        pkv_tier_entry_t e;
        ck_assert_int_eq(pkv_tier_seg_append(s, &f->rec[i], f->payload[i], &e), PKV_OK);
        ck_assert_uint_eq(e.offset, expect);
        expect += PKV_TIER_HEADER_BYTES + f->rec[i].payload_len;
    }
    ck_assert_uint_eq(pkv_tier_seg_bytes(s), expect);
    ck_assert_int_eq(pkv_tier_seg_sync(s), PKV_OK);
    uint64_t sb = pkv_tier_seg_seal_bytes(s);
    if (seal) {
        ck_assert_int_eq(pkv_tier_seg_seal(s), PKV_OK);
        ck_assert_uint_eq(pkv_tier_seg_bytes(s), expect + sb);
        expect += sb;
    }
    pkv_tier_seg_close(s);
    return expect;
}

static const char *seg1(void)
{
    static char name[PKV_TIER_SEG_NAME_MAX];
    pkv_tier_seg_name(1, name);
    return name;
}

/* Every record of info reads back verified and equal to the fixture's first n. */
static void reads_back(fixture_t *f, const pkv_tier_seg_info_t *in, uint32_t n)
{
    ck_assert_uint_eq(in->n, n);
    int fd = openat(f->dirfd, seg1(), O_RDONLY);
    ck_assert_int_ge(fd, 0);
    for (uint32_t i = 0; i < n; i++) {
        const pkv_tier_entry_t *e = &in->entries[i];
        ck_assert_mem_eq(e->key, f->rec[i].key, PKV_TIER_HASH_BYTES);
        ck_assert_uint_eq(e->payload_len, f->rec[i].payload_len);
        uint8_t *buf = malloc(e->payload_len + 1);
        ck_assert_int_eq(pkv_tier_record_read(fd, e, f->layout, f->rec[i].key, buf), PKV_OK);
        ck_assert_mem_eq(buf, f->payload[i], e->payload_len);
        free(buf);
    }
    close(fd);
}

/* Change one byte of segment 1 at off. */
static void flip(fixture_t *f, uint64_t off)
{
    int fd = openat(f->dirfd, seg1(), O_RDWR);
    uint8_t b;
    ck_assert_int_eq(pread(fd, &b, 1, (off_t)off), 1);
    b ^= 0x40;
    ck_assert_int_eq(pwrite(fd, &b, 1, (off_t)off), 1);
    close(fd);
}

static uint64_t record_off(const fixture_t *f, uint32_t k)
{
    uint64_t off = 0;
    for (uint32_t i = 0; i < k; i++) off += PKV_TIER_HEADER_BYTES + f->rec[i].payload_len;
    return off;
}

START_TEST(sealed_segment_round_trips)
{
    fixture_t f;
    fixture_init(&f, 40, 5000, 11);
    uint64_t size = write_segment(&f, true);
    pkv_tier_seg_info_t in;
    ck_assert_int_eq(pkv_tier_seg_open(f.dirfd, seg1(), false, &in), PKV_OK);
    ck_assert(in.sealed);
    ck_assert_uint_eq(in.corrupt, 0);
    ck_assert_uint_eq(in.bytes, size);
    ck_assert_uint_eq(in.seq, 1);
    ck_assert_mem_eq(in.layout, f.layout, PKV_TIER_HASH_BYTES);
    reads_back(&f, &in, f.n);
    /* The segment file is the owner's only. */
    struct stat st;
    ck_assert_int_eq(fstatat(f.dirfd, seg1(), &st, 0), 0);
    ck_assert_uint_eq(st.st_mode & 0777, 0600);
    /* A wrong key or layout is never handed out. */
    int fd = openat(f.dirfd, seg1(), O_RDONLY);
    uint8_t *buf = malloc(5001), other[PKV_TIER_HASH_BYTES] = {1};
    ck_assert_int_eq(pkv_tier_record_read(fd, &in.entries[3], f.layout, other, buf),
                     PKV_ERR_CORRUPT);
    ck_assert_int_eq(pkv_tier_record_read(fd, &in.entries[3], other, f.rec[3].key, buf),
                     PKV_ERR_CORRUPT);
    free(buf);
    close(fd);
    pkv_tier_seg_info_fini(&in);
    fixture_fini(&f);
}
END_TEST

START_TEST(unsealed_segment_is_scanned_then_repaired)
{
    fixture_t f;
    fixture_init(&f, 30, 3000, 12);
    uint64_t size = write_segment(&f, false);
    pkv_tier_seg_info_t in;
    ck_assert_int_eq(pkv_tier_seg_open(f.dirfd, seg1(), false, &in), PKV_OK);
    ck_assert(!in.sealed && !in.repaired);
    ck_assert_uint_eq(in.corrupt, 0);
    ck_assert_uint_eq(in.bytes, size);
    reads_back(&f, &in, f.n);
    pkv_tier_seg_info_fini(&in);
    /* Repair seals it: the next open reads the index, and finds the same records. */
    ck_assert_int_eq(pkv_tier_seg_open(f.dirfd, seg1(), true, &in), PKV_OK);
    ck_assert(in.repaired);
    pkv_tier_seg_info_fini(&in);
    ck_assert_int_eq(pkv_tier_seg_open(f.dirfd, seg1(), false, &in), PKV_OK);
    ck_assert(in.sealed);
    ck_assert_uint_eq(in.corrupt, 0);
    reads_back(&f, &in, f.n);
    pkv_tier_seg_info_fini(&in);
    fixture_fini(&f);
}
END_TEST

/* A crash mid-record at any point of the last record keeps every record before it. */
START_TEST(torn_tail_keeps_every_whole_record)
{
    fixture_t f;
    fixture_init(&f, 6, 700, 13);
    set_len(&f, 5, 500);
    uint64_t size = write_segment(&f, false), last = record_off(&f, 5);
    for (uint64_t cut = last + 1; cut < size; cut += 37) {
        char path[128];
        snprintf(path, sizeof(path), "%s/%s", f.dir, seg1());
        ck_assert_int_eq(truncate(path, (off_t)cut), 0);
        pkv_tier_seg_info_t in;
        ck_assert_int_eq(pkv_tier_seg_open(f.dirfd, seg1(), false, &in), PKV_OK);
        ck_assert_msg(in.n == 5 && in.corrupt == 1, "cut at %llu: %u records, %u corrupt",
                      (unsigned long long)cut, in.n, in.corrupt);
        reads_back(&f, &in, 5);
        pkv_tier_seg_info_fini(&in);
    }
    /* Repair cuts the torn bytes and seals: nothing corrupt the next time. */
    pkv_tier_seg_info_t in;
    ck_assert_int_eq(pkv_tier_seg_open(f.dirfd, seg1(), true, &in), PKV_OK);
    pkv_tier_seg_info_fini(&in);
    ck_assert_int_eq(pkv_tier_seg_open(f.dirfd, seg1(), false, &in), PKV_OK);
    ck_assert(in.sealed);
    ck_assert_uint_eq(in.corrupt, 0);
    reads_back(&f, &in, 5);
    pkv_tier_seg_info_fini(&in);
    fixture_fini(&f);
}
END_TEST

/* A flipped payload byte: a sealed segment lists the record, but reading it fails; an
 * unsealed one ends its scan there. A flipped header byte: the same. */
START_TEST(flipped_bytes_are_never_served)
{
    for (int sealed = 0; sealed < 2; sealed++)
        for (int where = 0; where < 2; where++) {
            fixture_t f;
            fixture_init(&f, 10, 900, 14 + (uint64_t)(sealed * 2 + where));
            set_len(&f, 4, 800);
            write_segment(&f, sealed);
            uint64_t off = record_off(&f, 4) + (where ? PKV_TIER_HEADER_BYTES + 400 : 60);
            flip(&f, off);
            pkv_tier_seg_info_t in;
            ck_assert_int_eq(pkv_tier_seg_open(f.dirfd, seg1(), false, &in), PKV_OK);
            if (!sealed) {
                ck_assert_uint_eq(in.corrupt, 1);
                reads_back(&f, &in, 4);
            } else {
                ck_assert_uint_eq(in.n, 10);
                int fd = openat(f.dirfd, seg1(), O_RDONLY);
                uint8_t *buf = malloc(1000);
                ck_assert_int_eq(
                    pkv_tier_record_read(fd, &in.entries[4], f.layout, f.rec[4].key, buf),
                    PKV_ERR_CORRUPT);
                ck_assert_int_eq(
                    pkv_tier_record_read(fd, &in.entries[5], f.layout, f.rec[5].key, buf), PKV_OK);
                free(buf);
                close(fd);
            }
            pkv_tier_seg_info_fini(&in);
            fixture_fini(&f);
        }
}
END_TEST

/* A damaged index or footer, or one cut short: the segment is rescanned (the records are
 * all found) and the damage counted. */
START_TEST(damaged_index_is_rescanned)
{
    for (int how = 0; how < 3; how++) {
        fixture_t f;
        fixture_init(&f, 12, 600, 20 + (uint64_t)how);
        uint64_t size = write_segment(&f, true), records = record_off(&f, f.n);
        if (how == 0) flip(&f, records + 5); /* an index entry */
        if (how == 1) flip(&f, size - 20);   /* the footer's checksum */
        if (how == 2) {                      /* the footer cut off */
            char path[128];
            snprintf(path, sizeof(path), "%s/%s", f.dir, seg1());
            ck_assert_int_eq(truncate(path, (off_t)(size - 30)), 0);
        }
        pkv_tier_seg_info_t in;
        ck_assert_int_eq(pkv_tier_seg_open(f.dirfd, seg1(), false, &in), PKV_OK);
        ck_assert(!in.sealed);
        ck_assert_uint_eq(in.corrupt, 1);
        reads_back(&f, &in, f.n);
        pkv_tier_seg_info_fini(&in);
        fixture_fini(&f);
    }
}
END_TEST

START_TEST(names_and_bad_input)
{
    char name[PKV_TIER_SEG_NAME_MAX];
    uint64_t seq = 0;
    pkv_tier_seg_name(0xabc, name);
    ck_assert_str_eq(name, "seg-0000000000000abc.pkv");
    ck_assert(pkv_tier_seg_seq(name, &seq));
    ck_assert_uint_eq(seq, 0xabc);
    const char *bad[] = {"seg-0000000000000abc.pk",  "seg-000000000000abc.pkv",  "LOCK",
                         "seg-0000000000000ABC.pkv", "xseg-000000000000abc.pkv", ""};
    for (size_t i = 0; i < PKV_ARRAY_LEN(bad); i++) ck_assert(!pkv_tier_seg_seq(bad[i], &seq));
    /* An empty or garbage file holds no record; a record of another layout is not appended. */
    pkv_tier_seg_info_t in;
    uint8_t junk[300];
    memset(junk, 0xa5, sizeof(junk));
    ck_assert_int_eq(pkv_tier_seg_parse(junk, 0, &in), PKV_OK);
    ck_assert_uint_eq(in.n + in.corrupt, 0);
    pkv_tier_seg_info_fini(&in);
    ck_assert_int_eq(pkv_tier_seg_parse(junk, sizeof(junk), &in), PKV_OK);
    ck_assert_uint_eq(in.n, 0);
    ck_assert_uint_eq(in.corrupt, 1);
    pkv_tier_seg_info_fini(&in);
    fixture_t f;
    fixture_init(&f, 1, 10, 30);
    pkv_tier_seg_t *s;
    ck_assert_int_eq(pkv_tier_seg_create(f.dirfd, 1, f.layout, &s), PKV_OK);
    ck_assert_int_eq(pkv_tier_seg_create(f.dirfd, 1, f.layout, &s), PKV_ERR_IO); /* exists */
    pkv_tier_record_t r = f.rec[0];
    r.layout[0] ^= 1;
    pkv_tier_entry_t e;
    ck_assert_int_eq(pkv_tier_seg_append(s, &r, f.payload[0], &e), PKV_ERR_INVALID);
    pkv_tier_seg_close(s);
    ck_assert_int_eq(pkv_tier_seg_open(f.dirfd, "LOCK", false, &in), PKV_ERR_INVALID);
    fixture_fini(&f);
}
END_TEST

/* ---- the tier: directory, index, writer, capacity -------------------------------------- */

#define REC 3000u /* a record's payload */

typedef struct {
    uint8_t gone[256]; /* keys whose first byte is listed here "left memory" */
} source_t;

/* The block bytes a key stands for (a function of the key, so any load can be checked). */
static void block_of(const uint8_t *key, uint8_t *buf)
{
    uint64_t x;
    memcpy(&x, key, sizeof(x));
    for (uint32_t i = 0; i < REC; i++) buf[i] = (uint8_t)pkv_splitmix64(&x);
}

static int source(void *arg, const uint8_t *key, void *buf, uint64_t len)
{
    source_t *src = arg;
    ck_assert_uint_eq(len, REC);
    if (src && src->gone[key[0]]) return PKV_ERR_NOTFOUND;
    block_of(key, buf);
    return PKV_OK;
}

static void key_of(uint32_t i, uint8_t *key)
{
    uint64_t x = 0x5eed0000u + i;
    for (uint32_t b = 0; b < PKV_TIER_HASH_BYTES; b++) key[b] = (uint8_t)pkv_splitmix64(&x);
}

static pkv_tier_t *tier_open(const char *dir, uint64_t max, const uint8_t *layout, source_t *src)
{
    pkv_tier_config_t c = {.dir = dir,
                           .max_bytes = max,
                           .segment_bytes = 64u << 10,
                           .record_bytes = REC,
                           .source = source,
                           .source_arg = src};
    memcpy(c.layout, layout, PKV_TIER_HASH_BYTES);
    pkv_tier_t *t = NULL;
    ck_assert_int_eq(pkv_tier_open(&c, &t), PKV_OK);
    return t;
}

/* Keys [lo, hi) of `tenant` queued and written. */
static void put_tenant(pkv_tier_t *t, uint32_t lo, uint32_t hi, uint64_t tenant)
{
    for (uint32_t i = lo; i < hi; i++) {
        uint8_t k[PKV_TIER_HASH_BYTES], p[PKV_TIER_HASH_BYTES] = {0};
        key_of(i, k);
        ck_assert_int_eq(pkv_tier_put(t, k, p, tenant), PKV_OK);
    }
    ck_assert_int_eq(pkv_tier_flush(t, pkv_deadline_after_ns(30000000000ull)), PKV_OK);
}

static void put_range(pkv_tier_t *t, uint32_t lo, uint32_t hi)
{
    put_tenant(t, lo, hi, 0);
}

static bool loads(pkv_tier_t *t, uint32_t i)
{
    uint8_t k[PKV_TIER_HASH_BYTES], want[REC], got[REC];
    key_of(i, k);
    int rc = pkv_tier_load(t, k, got);
    if (rc == PKV_ERR_NOTFOUND) return false;
    ck_assert_int_eq(rc, PKV_OK);
    block_of(k, want);
    ck_assert_mem_eq(got, want, REC);
    return true;
}

/* The sizes of every file in dir, as the OS reports them. */
static uint64_t dir_bytes(const char *dir)
{
    char cmd[160];
    snprintf(cmd, sizeof(cmd), "find %s -type f -printf '%%s\\n' | awk '{s+=$1} END {print s+0}'",
             dir);
    FILE *p = popen(cmd, "r");
    unsigned long long v = 0;
    ck_assert_int_eq(fscanf(p, "%llu", &v), 1);
    pclose(p);
    return v;
}

START_TEST(tier_writes_loads_and_is_warm_after_restart)
{
    fixture_t f;
    fixture_init(&f, 0, 0, 40);
    pkv_tier_t *t = tier_open(f.dir, 64u << 20, f.layout, NULL);
    put_range(t, 0, 100);
    pkv_tier_stats_t st;
    pkv_tier_stats(t, &st);
    ck_assert_uint_eq(st.records, 100);
    ck_assert_uint_eq(st.written_records, 100);
    ck_assert_uint_eq(st.bytes, dir_bytes(f.dir));
    ck_assert_uint_gt(st.segments, 1); /* 64 KiB segments */
    for (uint32_t i = 0; i < 100; i++) ck_assert(loads(t, i));
    ck_assert(!loads(t, 100));
    /* A key on disk is not queued again. */
    uint8_t k[PKV_TIER_HASH_BYTES], p[PKV_TIER_HASH_BYTES] = {0};
    key_of(5, k);
    ck_assert_int_eq(pkv_tier_put(t, k, p, 1), PKV_OK);
    ck_assert_int_eq(pkv_tier_flush(t, pkv_deadline_after_ns(10000000000ull)), PKV_OK);
    pkv_tier_stats(t, &st);
    ck_assert_uint_eq(st.written_records, 100);
    /* A second server on the directory is refused while the first lives. */
    pkv_tier_config_t c = {
        .dir = f.dir, .max_bytes = 1u << 20, .record_bytes = REC, .source = source};
    pkv_tier_t *t2 = NULL;
    ck_assert_int_eq(pkv_tier_open(&c, &t2), PKV_ERR_BUSY);
    pkv_tier_close(t);
    /* Warm after a restart: every record, from the segments' indexes. */
    t = tier_open(f.dir, 64u << 20, f.layout, NULL);
    pkv_tier_stats(t, &st);
    ck_assert_uint_eq(st.records, 100);
    ck_assert_uint_eq(st.corrupt, 0);
    ck_assert_uint_eq(st.bytes, dir_bytes(f.dir));
    uint8_t keys[100][PKV_TIER_HASH_BYTES];
    for (uint32_t i = 0; i < 100; i++) key_of(i, keys[i]);
    ck_assert_uint_eq(pkv_tier_match(t, (const uint8_t(*)[PKV_TIER_HASH_BYTES])keys, 100), 100);
    for (uint32_t i = 0; i < 100; i++) ck_assert(loads(t, i));
    /* drop_all: nothing left but the directory. */
    ck_assert_int_eq(pkv_tier_drop_all(t), PKV_OK);
    pkv_tier_stats(t, &st);
    ck_assert_uint_eq(st.records + st.bytes + st.segments, 0);
    ck_assert_uint_eq(dir_bytes(f.dir), 0);
    ck_assert(!loads(t, 3));
    pkv_tier_close(t);
    fixture_fini(&f);
}
END_TEST

/* A tenant's purge removes every segment holding one of its records, for good. */
START_TEST(tier_purges_a_tenant)
{
    fixture_t f;
    fixture_init(&f, 0, 0, 40);
    pkv_tier_t *t = tier_open(f.dir, 64u << 20, f.layout, NULL);
    put_tenant(t, 0, 60, 7);
    put_tenant(t, 60, 80, 9);
    put_tenant(t, 80, 140, 7);
    pkv_tier_stats_t st;
    pkv_tier_stats(t, &st);
    uint32_t segs = st.segments;
    ck_assert_uint_gt(segs, 4);
    ck_assert_int_eq(pkv_tier_drop_tenant(t, 9), PKV_OK);
    pkv_tier_stats(t, &st);
    ck_assert_uint_lt(st.segments, segs);
    ck_assert_uint_eq(st.bytes, dir_bytes(f.dir));
    for (uint32_t i = 60; i < 80; i++) ck_assert(!loads(t, i));
    ck_assert(loads(t, 0) && loads(t, 139)); /* segments without tenant 9 stay */
    pkv_tier_close(t);
    t = tier_open(f.dir, 64u << 20, f.layout, NULL);
    for (uint32_t i = 60; i < 80; i++) ck_assert(!loads(t, i));
    ck_assert(loads(t, 0) && loads(t, 139));
    pkv_tier_close(t);
    fixture_fini(&f);
}
END_TEST

/* The directory never holds more than the cap; the oldest segments go first. */
START_TEST(tier_capacity_is_exact)
{
    fixture_t f;
    fixture_init(&f, 0, 0, 41);
    uint64_t cap = 300u << 10;
    pkv_tier_t *t = tier_open(f.dir, cap, f.layout, NULL);
    pkv_tier_stats_t st;
    for (uint32_t round = 0; round < 10; round++) {
        put_range(t, round * 40, round * 40 + 40);
        pkv_tier_stats(t, &st);
        uint64_t du = dir_bytes(f.dir);
        ck_assert_uint_eq(st.bytes, du);
        ck_assert_msg(du + st.reserved <= cap, "round %u: %llu + %llu > %llu", round,
                      (unsigned long long)du, (unsigned long long)st.reserved,
                      (unsigned long long)cap);
    }
    ck_assert_uint_gt(st.evicted_segments, 0);
    ck_assert(loads(t, 399));
    ck_assert(!loads(t, 0));
    /* A record larger than the whole cap is never written. */
    pkv_tier_close(t);
    t = tier_open(f.dir, 2000, f.layout, NULL);
    pkv_tier_stats(t, &st);
    ck_assert_uint_le(st.bytes, 2000);
    put_range(t, 1000, 1001);
    pkv_tier_stats(t, &st);
    ck_assert_uint_eq(st.dropped[PKV_TIER_DROP_NO_ROOM], 1);
    pkv_tier_close(t);
    fixture_fini(&f);
}
END_TEST

/* A block that left memory before its write is a dropped write; a damaged record is
 * quarantined on its first load; another layout's segments are left alone. */
START_TEST(tier_drops_quarantines_and_leaves_foreign_alone)
{
    fixture_t f;
    fixture_init(&f, 0, 0, 42);
    source_t src = {{0}};
    for (uint32_t i = 0; i < 256; i += 2) src.gone[i] = 1; /* about half the keys */
    pkv_tier_t *t = tier_open(f.dir, 64u << 20, f.layout, &src);
    put_range(t, 0, 50);
    pkv_tier_stats_t st;
    pkv_tier_stats(t, &st);
    ck_assert_uint_eq(st.records + st.dropped[PKV_TIER_DROP_EVICTED], 50);
    ck_assert_uint_gt(st.dropped[PKV_TIER_DROP_EVICTED], 0);
    uint32_t first = 0;
    uint8_t k[PKV_TIER_HASH_BYTES];
    for (;; first++) {
        key_of(first, k);
        if (!src.gone[k[0]]) break;
    }
    ck_assert(loads(t, first));
    pkv_tier_close(t);
    /* Flip a payload byte of the first record on disk (segment 1, offset 0). */
    flip(&f, PKV_TIER_HEADER_BYTES + 10);
    t = tier_open(f.dir, 64u << 20, f.layout, &src);
    uint8_t buf[REC];
    ck_assert_int_eq(pkv_tier_load(t, k, buf), PKV_ERR_CORRUPT);
    ck_assert_int_eq(pkv_tier_load(t, k, buf), PKV_ERR_NOTFOUND);
    pkv_tier_stats(t, &st);
    ck_assert_uint_eq(st.corrupt, 1);
    uint64_t before = dir_bytes(f.dir);
    pkv_tier_close(t);
    /* Another layout: nothing loads, nothing is removed. */
    uint8_t other[PKV_TIER_HASH_BYTES];
    memset(other, 7, sizeof(other));
    t = tier_open(f.dir, 64u << 20, other, &src);
    pkv_tier_stats(t, &st);
    ck_assert_uint_eq(st.records, 0);
    ck_assert_uint_gt(st.foreign, 0);
    ck_assert_uint_eq(st.bytes, before);
    ck_assert(!loads(t, first + 1));
    pkv_tier_close(t);
    ck_assert_uint_eq(dir_bytes(f.dir), before);
    fixture_fini(&f);
}
END_TEST

/* A crash leaves the open segment unsealed with a torn record: the restart keeps every
 * whole record of it. */
START_TEST(tier_restart_after_a_crash)
{
    fixture_t f;
    fixture_init(&f, 20, 2000, 43);
    for (uint32_t i = 0; i < f.n; i++) set_len(&f, i, 2000); /* one size, as a pool's blocks */
    write_segment(&f, false);
    char path[128];
    snprintf(path, sizeof(path), "%s/%s", f.dir, seg1());
    uint64_t size = dir_bytes(f.dir);
    ck_assert_int_eq(truncate(path, (off_t)(size - 5)), 0);
    pkv_tier_config_t c = {
        .dir = f.dir, .max_bytes = 64u << 20, .record_bytes = 2000, .source = source};
    memcpy(c.layout, f.layout, PKV_TIER_HASH_BYTES);
    pkv_tier_t *t = NULL;
    ck_assert_int_eq(pkv_tier_open(&c, &t), PKV_OK);
    pkv_tier_stats_t st;
    pkv_tier_stats(t, &st);
    ck_assert_uint_eq(st.corrupt, 1);
    ck_assert_uint_eq(st.bytes, dir_bytes(f.dir));
    ck_assert_uint_eq(st.records, 19);
    uint8_t buf[2000];
    for (uint32_t i = 0; i < 19; i++) {
        ck_assert_int_eq(pkv_tier_load(t, f.rec[i].key, buf), PKV_OK);
        ck_assert_mem_eq(buf, f.payload[i], 2000);
    }
    ck_assert_int_eq(pkv_tier_load(t, f.rec[19].key, buf), PKV_ERR_NOTFOUND);
    pkv_tier_close(t);
    fixture_fini(&f);
}
END_TEST

/* One key in several segments (a record quarantined on a load, then written again): startup
 * indexes the newest copy (the largest sequence, the last in its segment), whatever order
 * the directory lists the segments in, so a damaged older copy is not read again after a
 * restart. */
START_TEST(tier_indexes_the_newest_copy_of_a_key)
{
    fixture_t f;
    fixture_init(&f, 1, 0, 44);
    set_len(&f, 0, 2000);
    enum { COPIES = 12 };
    for (uint32_t seq = 1; seq <= COPIES; seq++) {
        pkv_tier_seg_t *s;
        pkv_tier_entry_t e;
        ck_assert_int_eq(pkv_tier_seg_create(f.dirfd, seq, f.layout, &s), PKV_OK);
        for (uint32_t k = 0; k < (seq == COPIES ? 2u : 1u); k++) { /* the last: two copies */
            for (uint32_t b = 0; b < 2000; b++) f.payload[0][b] = (uint8_t)(b * 7 + seq + k);
            ck_assert_int_eq(pkv_tier_seg_append(s, &f.rec[0], f.payload[0], &e), PKV_OK);
        }
        ck_assert_int_eq(pkv_tier_seg_seal(s), PKV_OK);
        pkv_tier_seg_close(s);
    }
    pkv_tier_config_t c = {
        .dir = f.dir, .max_bytes = 64u << 20, .record_bytes = 2000, .source = source};
    memcpy(c.layout, f.layout, PKV_TIER_HASH_BYTES);
    pkv_tier_t *t = NULL;
    ck_assert_int_eq(pkv_tier_open(&c, &t), PKV_OK);
    pkv_tier_stats_t st;
    pkv_tier_stats(t, &st);
    ck_assert_uint_eq(st.records, 1);
    ck_assert_uint_eq(st.segments, COPIES);
    uint8_t buf[2000];
    ck_assert_int_eq(pkv_tier_load(t, f.rec[0].key, buf), PKV_OK);
    ck_assert_mem_eq(buf, f.payload[0], 2000); /* the last one written */
    pkv_tier_close(t);
    fixture_fini(&f);
}
END_TEST

static void replay_tier(const char *name, const uint8_t *data, size_t len, void *arg)
{
    (void)name;
    pkv_fuzz_tier(data, len);
    (*(uint32_t *)arg)++;
}

START_TEST(fuzz_corpus_replays)
{
    uint32_t n = 0;
    pkv_fuzz_quiet_logs(true);
    uint32_t files =
        pkv_test_corpus_each("PKV_TIER_CORPUS", "tests/fuzz/corpus/tier", replay_tier, &n);
    pkv_fuzz_quiet_logs(false);
    ck_assert_uint_ge(files, 4);
    ck_assert_uint_eq(files, n);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("tier");
    TCase *tc = tcase_create("format");
    tcase_add_test(tc, sealed_segment_round_trips);
    tcase_add_test(tc, unsealed_segment_is_scanned_then_repaired);
    tcase_add_test(tc, torn_tail_keeps_every_whole_record);
    tcase_add_test(tc, flipped_bytes_are_never_served);
    tcase_add_test(tc, damaged_index_is_rescanned);
    tcase_add_test(tc, names_and_bad_input);
    tcase_add_test(tc, fuzz_corpus_replays);
    suite_add_tcase(s, tc);
    TCase *tt = tcase_create("tier");
    tcase_set_timeout(tt, 60);
    tcase_add_test(tt, tier_writes_loads_and_is_warm_after_restart);
    tcase_add_test(tt, tier_purges_a_tenant);
    tcase_add_test(tt, tier_capacity_is_exact);
    tcase_add_test(tt, tier_drops_quarantines_and_leaves_foreign_alone);
    tcase_add_test(tt, tier_restart_after_a_crash);
    tcase_add_test(tt, tier_indexes_the_newest_copy_of_a_key);
    suite_add_tcase(s, tt);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
