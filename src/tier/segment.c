/*
 * tier: the on-disk format (docs/design/tier.md, "Records" and "Segments"). One parser
 * reads a segment from a file or from memory (the fuzz target) through a pread-like
 * source: first its footer and index, and when they are not valid, its records one by one,
 * each checked in full, to the first that is not (a torn tail). Every length and offset
 * read from the bytes is checked against the source's size before it is used.
 */
#include "tier/tier.h"

#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define REC_MAGIC  0x52564b50u /* "PKVR" little-endian */
#define FOOT_MAGIC 0x46564b50u /* "PKVF" */
#define SUM_OFF    128u        /* the record's checksum: the last 16 header bytes */
#define FOOT_SUM   64u         /* the footer's checksum: its last 16 bytes */

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8);
}
static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}
static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* XXH3-128 of a[0..na) then b[0..nb), as 16 little-endian bytes (low half first). The
 * streaming state is the library's to allocate (its layout is not part of its ABI); when it
 * cannot, the sum is all ones, which no check accepts for data it was not made over. */
static void sum128(const void *a, size_t na, const void *b, size_t nb, uint8_t out[16])
{
    XXH3_state_t *st = XXH3_createState();
    if (!st || XXH3_128bits_reset(st) != XXH_OK || XXH3_128bits_update(st, a, na) != XXH_OK ||
        (nb && XXH3_128bits_update(st, b, nb) != XXH_OK)) {
        XXH3_freeState(st);
        memset(out, 0xff, 16);
        return;
    }
    XXH128_hash_t h = XXH3_128bits_digest(st);
    XXH3_freeState(st);
    put64(out, h.low64);
    put64(out + 8, h.high64);
}

/* ---- records ------------------------------------------------------------------------- */

void pkv_tier_record_header(const pkv_tier_record_t *r, const void *payload,
                            uint8_t out[PKV_TIER_HEADER_BYTES])
{
    memset(out, 0, PKV_TIER_HEADER_BYTES);
    put32(out, REC_MAGIC);
    put16(out + 4, PKV_TIER_FORMAT);
    put16(out + 6, PKV_TIER_HEADER_BYTES);
    put64(out + 8, r->payload_len);
    memcpy(out + 16, r->layout, PKV_TIER_HASH_BYTES);
    memcpy(out + 48, r->key, PKV_TIER_HASH_BYTES);
    memcpy(out + 80, r->parent, PKV_TIER_HASH_BYTES);
    put64(out + 112, r->tenant); /* 120..128: zero */
    sum128(out, SUM_OFF, payload, (size_t)r->payload_len, out + SUM_OFF);
}

int pkv_tier_record_parse(const uint8_t hdr[PKV_TIER_HEADER_BYTES], uint64_t max_payload,
                          pkv_tier_record_t *out)
{
    uint64_t len = get64(hdr + 8);
    if (get32(hdr) != REC_MAGIC || get16(hdr + 4) != PKV_TIER_FORMAT ||
        get16(hdr + 6) != PKV_TIER_HEADER_BYTES || len > max_payload || len > PKV_TIER_MAX_PAYLOAD)
        return PKV_ERR_CORRUPT;
    memcpy(out->layout, hdr + 16, PKV_TIER_HASH_BYTES);
    memcpy(out->key, hdr + 48, PKV_TIER_HASH_BYTES);
    memcpy(out->parent, hdr + 80, PKV_TIER_HASH_BYTES);
    out->tenant = get64(hdr + 112);
    out->payload_len = len;
    return PKV_OK;
}

int pkv_tier_record_check(const uint8_t hdr[PKV_TIER_HEADER_BYTES], const void *payload,
                          uint64_t payload_len, pkv_tier_record_t *out)
{
    pkv_tier_record_t r;
    uint8_t sum[16];
    if (pkv_tier_record_parse(hdr, payload_len, &r) || r.payload_len != payload_len)
        return PKV_ERR_CORRUPT;
    sum128(hdr, SUM_OFF, payload, (size_t)payload_len, sum);
    if (memcmp(sum, hdr + SUM_OFF, sizeof(sum))) return PKV_ERR_CORRUPT;
    *out = r;
    return PKV_OK;
}

void pkv_tier_seg_name(uint64_t seq, char name[PKV_TIER_SEG_NAME_MAX])
{
    snprintf(name, PKV_TIER_SEG_NAME_MAX, PKV_TIER_SEG_PREFIX "%016" PRIx64 PKV_TIER_SEG_SUFFIX,
             seq);
}

bool pkv_tier_seg_seq(const char *name, uint64_t *seq)
{
    size_t np = strlen(PKV_TIER_SEG_PREFIX), ns = strlen(PKV_TIER_SEG_SUFFIX);
    if (strlen(name) != np + 16 + ns || strncmp(name, PKV_TIER_SEG_PREFIX, np) ||
        strcmp(name + np + 16, PKV_TIER_SEG_SUFFIX))
        return false;
    uint64_t v = 0;
    for (size_t i = np; i < np + 16; i++) {
        char c = name[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return false;
        v = v << 4 | (uint64_t)d;
    }
    *seq = v;
    return true;
}

/* ---- the index and the footer --------------------------------------------------------- */

/* The index and footer for entries e[0..n) that end at index_off, into a new buffer of
 * n * ENTRY + FOOTER bytes (*len). NULL on no memory. */
static uint8_t *seal_bytes(const pkv_tier_entry_t *e, uint32_t n, uint64_t index_off,
                           const uint8_t layout[PKV_TIER_HASH_BYTES], size_t *len)
{
    size_t ni = (size_t)n * PKV_TIER_ENTRY_BYTES;
    uint8_t *b = calloc(1, ni + PKV_TIER_FOOTER_BYTES);
    if (!b) return NULL;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *p = b + (size_t)i * PKV_TIER_ENTRY_BYTES;
        memcpy(p, e[i].key, PKV_TIER_HASH_BYTES);
        put64(p + 32, e[i].offset);
        put32(p + 40, e[i].payload_len);
        put64(p + 48, e[i].tenant);
    }
    uint8_t *f = b + ni;
    put32(f, FOOT_MAGIC);
    put16(f + 4, PKV_TIER_FORMAT);
    put32(f + 8, n);
    put64(f + 16, index_off);
    memcpy(f + 24, layout, PKV_TIER_HASH_BYTES);
    sum128(b, ni + FOOT_SUM, NULL, 0, f + FOOT_SUM);
    *len = ni + PKV_TIER_FOOTER_BYTES;
    return b;
}

/* ---- sources: a file or memory --------------------------------------------------------- */

typedef struct {
    int fd;              /* >= 0: a file */
    const uint8_t *data; /* else memory */
    uint64_t len;
} src_t;

/* Exactly n bytes at off: PKV_ERR_CORRUPT past the end, PKV_ERR_IO on a read error. */
static int src_read(const src_t *s, uint64_t off, void *buf, size_t n)
{
    if (off > s->len || n > s->len - off) return PKV_ERR_CORRUPT;
    if (s->fd < 0) {
        memcpy(buf, s->data + off, n);
        return PKV_OK;
    }
    for (size_t done = 0; done < n;) {
        ssize_t r = pread(s->fd, (uint8_t *)buf + done, n - done, (off_t)(off + done));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return PKV_ERR_IO;
        if (r == 0) return PKV_ERR_CORRUPT; /* the file shrank under us */
        done += (size_t)r;
    }
    return PKV_OK;
}

static int entries_push(pkv_tier_seg_info_t *in, uint32_t *cap, const pkv_tier_entry_t *e)
{
    if (in->n == *cap) {
        uint32_t nc = *cap ? *cap * 2 : 64;
        pkv_tier_entry_t *ne = realloc(in->entries, nc * sizeof(*ne));
        if (!ne) return PKV_ERR_NOMEM;
        in->entries = ne;
        *cap = nc;
    }
    in->entries[in->n++] = *e;
    return PKV_OK;
}

/* The footer and index, when both are valid and describe records back to back from
 * offset 0 to the index. PKV_ERR_CORRUPT otherwise (the caller scans). */
static int read_sealed(const src_t *s, pkv_tier_seg_info_t *in)
{
    uint8_t f[PKV_TIER_FOOTER_BYTES];
    if (s->len < PKV_TIER_FOOTER_BYTES) return PKV_ERR_CORRUPT;
    int rc = src_read(s, s->len - PKV_TIER_FOOTER_BYTES, f, sizeof(f));
    if (rc) return rc;
    uint32_t n = get32(f + 8);
    uint64_t ioff = get64(f + 16), ni = (uint64_t)n * PKV_TIER_ENTRY_BYTES;
    if (get32(f) != FOOT_MAGIC || get16(f + 4) != PKV_TIER_FORMAT || ioff > s->len ||
        s->len - ioff != ni + PKV_TIER_FOOTER_BYTES)
        return PKV_ERR_CORRUPT;
    uint8_t *b = malloc((size_t)ni + PKV_TIER_FOOTER_BYTES);
    if (!b) return PKV_ERR_NOMEM;
    uint8_t sum[16];
    if ((rc = src_read(s, ioff, b, (size_t)ni + PKV_TIER_FOOTER_BYTES))) goto out;
    sum128(b, (size_t)ni + FOOT_SUM, NULL, 0, sum);
    rc = PKV_ERR_CORRUPT;
    if (memcmp(sum, b + ni + FOOT_SUM, sizeof(sum))) goto out;
    if (!(in->entries = malloc((n ? n : 1) * sizeof(*in->entries)))) {
        rc = PKV_ERR_NOMEM;
        goto out;
    }
    uint64_t at = 0;
    for (uint32_t i = 0; i < n; i++, in->n++) {
        pkv_tier_entry_t *e = &in->entries[i];
        const uint8_t *p = b + (size_t)i * PKV_TIER_ENTRY_BYTES;
        memcpy(e->key, p, PKV_TIER_HASH_BYTES);
        e->offset = get64(p + 32);
        e->payload_len = get32(p + 40);
        e->tenant = get64(p + 48);
        if (e->offset != at || ioff - at < PKV_TIER_HEADER_BYTES + (uint64_t)e->payload_len)
            goto out; /* not back to back, or past the index */
        at += PKV_TIER_HEADER_BYTES + (uint64_t)e->payload_len;
    }
    if (at != ioff) goto out;
    memcpy(in->layout, b + ni + 24, PKV_TIER_HASH_BYTES);
    in->sealed = true;
    rc = PKV_OK;
out:
    if (rc) {
        free(in->entries);
        in->entries = NULL;
        in->n = 0;
    }
    free(b);
    return rc;
}

/* Records one by one from offset 0, each checked in full, all of the first one's layout;
 * *end: where the last good one ends. A bad record or bytes after the last good one count
 * once in in->corrupt. */
static int scan(const src_t *s, pkv_tier_seg_info_t *in, uint64_t *end)
{
    uint32_t cap = 0;
    uint64_t off = 0;
    void *buf = NULL;
    size_t buf_cap = 0;
    int rc = PKV_OK;
    while (s->len - off >= PKV_TIER_HEADER_BYTES) {
        uint8_t h[PKV_TIER_HEADER_BYTES];
        pkv_tier_record_t r;
        if ((rc = src_read(s, off, h, sizeof(h)))) break;
        if (pkv_tier_record_parse(h, s->len - off - PKV_TIER_HEADER_BYTES, &r)) break;
        if (r.payload_len > buf_cap) {
            void *nb = realloc(buf, (size_t)r.payload_len);
            if (!nb) {
                rc = PKV_ERR_NOMEM;
                break;
            }
            buf = nb, buf_cap = (size_t)r.payload_len;
        }
        if ((rc = src_read(s, off + PKV_TIER_HEADER_BYTES, buf, (size_t)r.payload_len))) break;
        if (pkv_tier_record_check(h, buf, r.payload_len, &r)) break;
        if (in->n && memcmp(r.layout, in->layout, PKV_TIER_HASH_BYTES)) break;
        memcpy(in->layout, r.layout, PKV_TIER_HASH_BYTES);
        pkv_tier_entry_t e = {
            .offset = off, .payload_len = (uint32_t)r.payload_len, .tenant = r.tenant};
        memcpy(e.key, r.key, PKV_TIER_HASH_BYTES);
        if ((rc = entries_push(in, &cap, &e))) break;
        off += PKV_TIER_HEADER_BYTES + r.payload_len;
    }
    free(buf);
    if (rc == PKV_ERR_CORRUPT) rc = PKV_OK; /* a short file: a torn tail */
    if (!rc && off < s->len) in->corrupt++;
    *end = off;
    return rc;
}

static int parse(const src_t *s, pkv_tier_seg_info_t *in, uint64_t *good_end)
{
    int rc = read_sealed(s, in);
    if (rc == PKV_OK) {
        *good_end = s->len;
        return PKV_OK;
    }
    if (rc != PKV_ERR_CORRUPT) return rc;
    /* No valid footer: the segment open at a crash, or a damaged index (its bytes then
     * follow the last record and count as damage). The scan decides what is kept. */
    return scan(s, in, good_end);
}

int pkv_tier_seg_parse(const uint8_t *data, uint64_t len, pkv_tier_seg_info_t *out)
{
    src_t s = {.fd = -1, .data = data, .len = len};
    pkv_tier_seg_info_t in = {0};
    uint64_t end;
    int rc = parse(&s, &in, &end);
    if (rc) {
        free(in.entries);
        return rc;
    }
    in.bytes = len;
    *out = in;
    return PKV_OK;
}

void pkv_tier_seg_info_fini(pkv_tier_seg_info_t *info)
{
    if (!info) return;
    free(info->entries);
    info->entries = NULL;
    info->n = 0;
}

/* ---- writing ----------------------------------------------------------------------------- */

struct pkv_tier_seg {
    int fd;
    uint64_t seq, size;
    uint8_t layout[PKV_TIER_HASH_BYTES];
    pkv_tier_entry_t *entries;
    uint32_t n, cap;
    bool sealed, broken; /* broken: a write failed, the size is unknown */
};

static int write_all(int fd, const void *buf, size_t n, uint64_t off)
{
    for (size_t done = 0; done < n;) {
        ssize_t w = pwrite(fd, (const uint8_t *)buf + done, n - done, (off_t)(off + done));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return PKV_ERR_IO;
        done += (size_t)w;
    }
    return PKV_OK;
}

int pkv_tier_seg_create(int dirfd, uint64_t seq, const uint8_t layout[PKV_TIER_HASH_BYTES],
                        pkv_tier_seg_t **out)
{
    char name[PKV_TIER_SEG_NAME_MAX];
    pkv_tier_seg_name(seq, name);
    pkv_tier_seg_t *s = calloc(1, sizeof(*s));
    if (!s) return PKV_ERR_NOMEM;
    s->fd = openat(dirfd, name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (s->fd < 0 || fsync(s->fd) || fsync(dirfd)) {
        PKV_LOGE("tier", "cannot create segment %s: %s", name, strerror(errno));
        if (s->fd >= 0) {
            close(s->fd);
            unlinkat(dirfd, name, 0);
        }
        free(s);
        return PKV_ERR_IO;
    }
    s->seq = seq;
    memcpy(s->layout, layout, PKV_TIER_HASH_BYTES);
    *out = s;
    return PKV_OK;
}

int pkv_tier_seg_append(pkv_tier_seg_t *s, const pkv_tier_record_t *r, const void *payload,
                        pkv_tier_entry_t *e)
{
    if (s->sealed || s->broken || memcmp(r->layout, s->layout, PKV_TIER_HASH_BYTES) ||
        r->payload_len > UINT32_MAX)
        return PKV_ERR_INVALID;
    if (s->n == s->cap) {
        uint32_t nc = s->cap ? s->cap * 2 : 64;
        pkv_tier_entry_t *ne = realloc(s->entries, nc * sizeof(*ne));
        if (!ne) return PKV_ERR_NOMEM;
        s->entries = ne;
        s->cap = nc;
    }
    uint8_t h[PKV_TIER_HEADER_BYTES];
    pkv_tier_record_header(r, payload, h);
    if (write_all(s->fd, h, sizeof(h), s->size) ||
        write_all(s->fd, payload, (size_t)r->payload_len, s->size + sizeof(h))) {
        s->broken = true;
        return PKV_ERR_IO;
    }
    pkv_tier_entry_t x = {
        .offset = s->size, .payload_len = (uint32_t)r->payload_len, .tenant = r->tenant};
    memcpy(x.key, r->key, PKV_TIER_HASH_BYTES);
    s->entries[s->n++] = x;
    s->size += sizeof(h) + r->payload_len;
    *e = x;
    return PKV_OK;
}

int pkv_tier_seg_sync(pkv_tier_seg_t *s)
{
    if (fdatasync(s->fd)) return PKV_ERR_IO;
    /* Durable now: the page cache need not keep it (the server's memory, its cgroup's,
     * stays the pool's; a load reads it back from the disk). */
    posix_fadvise(s->fd, 0, (off_t)s->size, POSIX_FADV_DONTNEED);
    return PKV_OK;
}

/* Append the index and footer of entries e[0..n) at off to fd, and sync. */
static int seal_at(int fd, const pkv_tier_entry_t *e, uint32_t n, uint64_t off,
                   const uint8_t layout[PKV_TIER_HASH_BYTES], uint64_t *size)
{
    size_t len;
    uint8_t *b = seal_bytes(e, n, off, layout, &len);
    if (!b) return PKV_ERR_NOMEM;
    int rc = write_all(fd, b, len, off);
    free(b);
    if (!rc && fdatasync(fd)) rc = PKV_ERR_IO;
    if (!rc) *size = off + len;
    return rc;
}

int pkv_tier_seg_seal(pkv_tier_seg_t *s)
{
    if (s->sealed || s->broken) return PKV_ERR_INVALID;
    int rc = seal_at(s->fd, s->entries, s->n, s->size, s->layout, &s->size);
    if (rc == PKV_ERR_IO) s->broken = true;
    if (!rc) s->sealed = true;
    return rc;
}

uint64_t pkv_tier_seg_bytes(const pkv_tier_seg_t *s)
{
    return s->size;
}

uint64_t pkv_tier_seg_seal_bytes(const pkv_tier_seg_t *s)
{
    return s->sealed ? 0 : (uint64_t)s->n * PKV_TIER_ENTRY_BYTES + PKV_TIER_FOOTER_BYTES;
}

void pkv_tier_seg_close(pkv_tier_seg_t *s)
{
    if (!s) return;
    close(s->fd);
    free(s->entries);
    free(s);
}

/* ---- opening a segment file -------------------------------------------------------------- */

int pkv_tier_seg_open(int dirfd, const char *name, bool repair, pkv_tier_seg_info_t *out)
{
    uint64_t seq;
    if (!pkv_tier_seg_seq(name, &seq)) return PKV_ERR_INVALID;
    int fd = openat(dirfd, name, (repair ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st)) {
        PKV_LOGE("tier", "cannot open segment %s: %s", name, strerror(errno));
        if (fd >= 0) close(fd);
        return PKV_ERR_IO;
    }
    src_t s = {.fd = fd, .len = (uint64_t)st.st_size};
    pkv_tier_seg_info_t in = {.seq = seq};
    uint64_t end = 0;
    int rc = parse(&s, &in, &end);
    in.bytes = s.len;
    if (!rc && repair && !in.sealed) {
        /* Keep what checked out, then seal it: the next open reads the index. */
        if (ftruncate(fd, (off_t)end) ||
            seal_at(fd, in.entries, in.n, end, in.layout, &in.bytes) != PKV_OK) {
            PKV_LOGE("tier", "cannot repair segment %s: %s", name, strerror(errno));
            rc = PKV_ERR_IO;
        } else {
            in.repaired = true;
        }
    }
    close(fd);
    if (rc) {
        free(in.entries);
        return rc;
    }
    *out = in;
    return PKV_OK;
}

int pkv_tier_record_read(int fd, const pkv_tier_entry_t *e,
                         const uint8_t layout[PKV_TIER_HASH_BYTES],
                         const uint8_t key[PKV_TIER_HASH_BYTES], void *payload)
{
    struct stat st;
    if (fstat(fd, &st)) return PKV_ERR_IO;
    src_t s = {.fd = fd, .len = (uint64_t)st.st_size};
    uint8_t h[PKV_TIER_HEADER_BYTES];
    pkv_tier_record_t r;
    int rc = src_read(&s, e->offset, h, sizeof(h));
    if (!rc) rc = src_read(&s, e->offset + sizeof(h), payload, e->payload_len);
    /* The block now lives in the pool: no second copy in the page cache (the range widened
     * to whole pages: the page a record shares with its neighbour goes too). */
    uint64_t lo = e->offset & ~4095ull,
             hi = (e->offset + sizeof(h) + e->payload_len + 4095) & ~4095ull;
    posix_fadvise(fd, (off_t)lo, (off_t)(hi - lo), POSIX_FADV_DONTNEED);
    if (rc) return rc;
    if (pkv_tier_record_check(h, payload, e->payload_len, &r) ||
        memcmp(r.key, key, PKV_TIER_HASH_BYTES) || memcmp(r.layout, layout, PKV_TIER_HASH_BYTES))
        return PKV_ERR_CORRUPT;
    return PKV_OK;
}
