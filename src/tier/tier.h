/*
 * tier: the disk tier's interface for other pagekv modules (not installed; design in
 * docs/design/tier.md). This part is the on-disk format: immutable records (a block's
 * bytes with their layout digest, chained key, parent key and an XXH3-128 checksum),
 * append-only segments of them, and a segment's sealed index and footer, which startup
 * reads instead of the payloads.
 *
 * Contracts: every function returns PKV_OK or a negative status and sets its outputs only
 * on success. Nothing here keeps global state or takes a lock: a segment being written
 * belongs to one thread (the tier's writer); reading records of sealed or synced
 * segments is safe from any thread (pread). Bytes read from a file are never trusted:
 * lengths and offsets are checked against the file before use, and a payload is handed
 * out only after its checksum, key and layout matched.
 */
#ifndef PKV_TIER_TIER_H
#define PKV_TIER_TIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PKV_TIER_HASH_BYTES   32u /* a key, a parent key, a layout digest: SHA-256 */
#define PKV_TIER_HEADER_BYTES 144u
#define PKV_TIER_ENTRY_BYTES  56u
#define PKV_TIER_FOOTER_BYTES 80u
#define PKV_TIER_MAX_PAYLOAD  (1ull << 32) /* a block of one rank is far below */
#define PKV_TIER_FORMAT       1u
#define PKV_TIER_SEG_PREFIX   "seg-"
#define PKV_TIER_SEG_SUFFIX   ".pkv"
#define PKV_TIER_SEG_NAME_MAX 32u /* "seg-" + 16 hex digits + ".pkv" + NUL */

/* What a record says of itself (its header). */
typedef struct {
    uint8_t layout[PKV_TIER_HASH_BYTES]; /* the layout digest: what the bytes mean */
    uint8_t key[PKV_TIER_HASH_BYTES];    /* the block's chained prefix key */
    uint8_t parent[PKV_TIER_HASH_BYTES]; /* its parent's key */
    uint64_t tenant;                     /* the cache salt it was computed under (purges) */
    uint64_t payload_len;
} pkv_tier_record_t;

/* Where a record lies: its header at `offset`, its payload right after it. */
typedef struct {
    uint8_t key[PKV_TIER_HASH_BYTES];
    uint64_t offset;
    uint32_t payload_len;
    uint64_t tenant;
} pkv_tier_entry_t;

/* The header for record r over payload (r->payload_len bytes), checksum included. */
void pkv_tier_record_header(const pkv_tier_record_t *r, const void *payload,
                            uint8_t out[PKV_TIER_HEADER_BYTES]);
/* A header's fields, checked for what can be checked without the payload (magic,
 * version, header length, payload length <= max_payload). PKV_ERR_CORRUPT otherwise. */
int pkv_tier_record_parse(const uint8_t hdr[PKV_TIER_HEADER_BYTES], uint64_t max_payload,
                          pkv_tier_record_t *out);
/* The whole record: the header parses and its checksum covers header and payload
 * (payload_len bytes, which must be the header's). PKV_ERR_CORRUPT otherwise. */
int pkv_tier_record_check(const uint8_t hdr[PKV_TIER_HEADER_BYTES], const void *payload,
                          uint64_t payload_len, pkv_tier_record_t *out);

/* "seg-<seq as 16 hex digits>.pkv" into name (PKV_TIER_SEG_NAME_MAX bytes). */
void pkv_tier_seg_name(uint64_t seq, char name[PKV_TIER_SEG_NAME_MAX]);
/* The sequence number of a segment's file name; false when name is not a segment's. */
bool pkv_tier_seg_seq(const char *name, uint64_t *seq);

/* ---- writing a segment (one thread) ------------------------------------------------- */

typedef struct pkv_tier_seg pkv_tier_seg_t;

/* Create segment `seq` in the directory dirfd (0600, O_EXCL), synced with its directory
 * entry, for records of one layout. PKV_ERR_IO (errno logged) when it cannot be made. */
int pkv_tier_seg_create(int dirfd, uint64_t seq, const uint8_t layout[PKV_TIER_HASH_BYTES],
                        pkv_tier_seg_t **out);
/* Append one record (r->layout must be the segment's). *e: where it lies. Not durable
 * until pkv_tier_seg_sync. PKV_ERR_IO on a failed or short write (the segment's size is
 * then unknown: the caller seals nothing more and closes it); PKV_ERR_INVALID for a
 * layout that is not the segment's; PKV_ERR_NOMEM. */
int pkv_tier_seg_append(pkv_tier_seg_t *s, const pkv_tier_record_t *r, const void *payload,
                        pkv_tier_entry_t *e);
/* fdatasync: every record appended so far survives a crash. */
int pkv_tier_seg_sync(pkv_tier_seg_t *s);
/* Append the index and the footer and sync: the segment is complete and read-only. */
int pkv_tier_seg_seal(pkv_tier_seg_t *s);
/* The file's size so far (records; plus index and footer once sealed). */
uint64_t pkv_tier_seg_bytes(const pkv_tier_seg_t *s);
/* The bytes sealing would add now (index and footer). */
uint64_t pkv_tier_seg_seal_bytes(const pkv_tier_seg_t *s);
/* Close (without sealing). NULL is a no-op. */
void pkv_tier_seg_close(pkv_tier_seg_t *s);

/* ---- reading segments --------------------------------------------------------------- */

typedef struct {
    uint64_t seq;
    uint64_t bytes;                      /* the file's size after any repair */
    uint8_t layout[PKV_TIER_HASH_BYTES]; /* the segment's (from its footer or first record) */
    bool sealed;                         /* found sealed (false: scanned) */
    bool repaired;                       /* scanned, truncated after its last good record,
                                            and sealed */
    uint32_t corrupt;          /* damage found: a bad footer or index, a record that failed its
                                  check, bytes after the last good record */
    pkv_tier_entry_t *entries; /* [n], in record order; free with pkv_tier_seg_info_fini */
    uint32_t n;
} pkv_tier_seg_info_t;

/* Read the segment `name` in dirfd: from its footer and index when they are valid, else by
 * scanning its records (each checked in full), stopping at the first bad one. With
 * `repair`, a scanned segment is truncated after its last good record and sealed (so the
 * next open reads its index). PKV_OK with *out (even for a segment with no good record);
 * PKV_ERR_INVALID when name is not a segment's; PKV_ERR_IO when it cannot be read;
 * PKV_ERR_NOMEM. */
int pkv_tier_seg_open(int dirfd, const char *name, bool repair, pkv_tier_seg_info_t *out);
void pkv_tier_seg_info_fini(pkv_tier_seg_info_t *info);

/* Read the record e of the open segment file fd into payload (room for e->payload_len)
 * and verify it: its checksum, and that its key and layout are the ones asked for.
 * PKV_ERR_CORRUPT when any check fails (or the file ends early); PKV_ERR_IO on a read
 * error. payload's contents are unspecified unless PKV_OK. */
int pkv_tier_record_read(int fd, const pkv_tier_entry_t *e,
                         const uint8_t layout[PKV_TIER_HASH_BYTES],
                         const uint8_t key[PKV_TIER_HASH_BYTES], void *payload);

/* The parser over a whole segment's bytes in memory (the fuzz target's entry point and
 * the scan's core): the entries found as pkv_tier_seg_open finds them, without repair. */
int pkv_tier_seg_parse(const uint8_t *data, uint64_t len, pkv_tier_seg_info_t *out);

/* ---- the tier: a directory of segments, its index and its writer ----------------------
 * One tier owns one directory (flock on it: a second opener gets PKV_ERR_BUSY). The index
 * maps a block key to the record that holds it; only records that are synced are in it.
 * A writer thread ("pkv-tier-writer") takes queued keys in order, asks the source for the
 * block's bytes (a block that left memory is a dropped write), appends, syncs, publishes.
 * Locking: t->lock guards the index, the segments, the queue and the counters; no I/O and
 * no call to the source happens under it. */

typedef struct pkv_tier pkv_tier_t;

/* The writer asks for a block's bytes: fill buf (len bytes) with the block whose key is
 * key, or return PKV_ERR_NOTFOUND when it has left memory. Called on the writer thread. */
typedef int (*pkv_tier_source_fn)(void *arg, const uint8_t key[PKV_TIER_HASH_BYTES], void *buf,
                                  uint64_t len);

typedef struct {
    const char *dir;                     /* must exist */
    uint64_t max_bytes;                  /* the directory's bytes never exceed it */
    uint64_t segment_bytes;              /* seal a segment past this (0: max_bytes / 8,
                                            at most 256 MiB) */
    uint64_t min_free_bytes;             /* writes stop while the filesystem has less free
                                            (0: none) */
    uint32_t queue_max;                  /* keys waiting to be written (0: 4096) */
    uint64_t record_bytes;               /* every record's payload (one block) */
    uint8_t layout[PKV_TIER_HASH_BYTES]; /* what this server's bytes mean */
    pkv_tier_source_fn source;
    void *source_arg;
} pkv_tier_config_t;

/* Why a write did not happen. */
typedef enum {
    PKV_TIER_DROP_QUEUE_FULL = 0, /* the queue was full when the block was offered */
    PKV_TIER_DROP_EVICTED,        /* the block left memory before the writer got to it */
    PKV_TIER_DROP_NO_ROOM,        /* a record can never fit the cap */
    PKV_TIER_DROP_DISK_FULL,      /* the filesystem's free space is under the watermark */
    PKV_TIER_DROP_IO,             /* a write or sync failed (the segment is closed) */
    PKV_TIER_DROP_READ_ONLY,      /* the directory cannot be written */
    PKV_TIER_DROP_COUNT
} pkv_tier_drop_t;
extern const char *const pkv_tier_drop_name[PKV_TIER_DROP_COUNT];

typedef struct {
    uint64_t bytes;    /* every file in the directory (== what du -b says of them) */
    uint64_t reserved; /* bytes the open segment's seal will add (bytes + reserved <= cap) */
    uint64_t records;  /* loadable (in the index) */
    uint32_t segments; /* this layout's */
    uint32_t foreign;  /* segments of another layout, left alone */
    uint64_t queued;   /* keys waiting */
    uint64_t written_records, written_bytes;
    uint64_t loaded_records, loaded_bytes;
    uint64_t corrupt;          /* damage found at startup or on a load */
    uint64_t evicted_segments; /* removed for room, oldest first */
    uint64_t dropped[PKV_TIER_DROP_COUNT];
    bool writable;
} pkv_tier_stats_t;

/* Open the tier on cfg->dir: take the directory's lock, read every segment (indexes, or a
 * scan and repair of the one a crash left open), remove empty ones, skip another layout's
 * (logged once each, left alone), evict the oldest if the directory is over the cap, and
 * start the writer. A read-only directory opens with writes off (counted as dropped).
 * PKV_ERR_BUSY: another live tier holds the directory; PKV_ERR_INVALID: a bad config;
 * PKV_ERR_IO: the directory cannot be opened. */
int pkv_tier_open(const pkv_tier_config_t *cfg, pkv_tier_t **out);
/* Stop the writer (what is queued is dropped, not counted), seal the open segment, release
 * the lock. NULL is a no-op. */
void pkv_tier_close(pkv_tier_t *t);
/* Queue the block `key` (child of `parent`, computed under the cache salt `tenant`) for writing; a
 * key already on disk or queued is a no-op. Never blocks on I/O. PKV_OK, or PKV_ERR_BUSY (queue
 * full: a dropped write). */
int pkv_tier_put(pkv_tier_t *t, const uint8_t key[PKV_TIER_HASH_BYTES],
                 const uint8_t parent[PKV_TIER_HASH_BYTES], uint64_t tenant);
/* How many of keys[0..n), from the first, are loadable. */
uint32_t pkv_tier_match(pkv_tier_t *t, const uint8_t (*keys)[PKV_TIER_HASH_BYTES], uint32_t n);
/* Read the block `key` into buf (cfg->record_bytes) and verify it (checksum, key, layout).
 * PKV_ERR_NOTFOUND: not on disk; PKV_ERR_CORRUPT: it failed a check (quarantined: never
 * read again, counted as corrupt); PKV_ERR_IO: the read failed (quarantined too: a bad
 * sector is not retried on every request). buf's contents are unspecified unless PKV_OK. */
int pkv_tier_load(pkv_tier_t *t, const uint8_t key[PKV_TIER_HASH_BYTES], void *buf);
/* Wait until every queued key is written and synced (or dropped), or the deadline:
 * PKV_OK / PKV_ERR_TIMEOUT. */
int pkv_tier_flush(pkv_tier_t *t, uint64_t deadline_ns);
/* Remove every segment of this layout (the records on disk and in the index). */
int pkv_tier_drop_all(pkv_tier_t *t);
/* Remove every segment that holds a record of `tenant` (the others' records in them go
 * too), and its queued keys: nothing of the tenant's is loadable now or after a restart.
 * Both: PKV_OK, or PKV_ERR_UNSUPPORTED on a read-only tier. */
int pkv_tier_drop_tenant(pkv_tier_t *t, uint64_t tenant);
void pkv_tier_stats(pkv_tier_t *t, pkv_tier_stats_t *out);

#endif
