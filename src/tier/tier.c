/*
 * tier: one directory of segments, the index of the records in it, and the writer thread
 * (docs/design/tier.md). The lock (t->lock) guards the index, the segment list, the queue
 * and the counters; the writer appends, syncs and unlinks outside it, and the source is
 * called outside it. A record enters the index only once synced; a load holds a reference
 * on its segment, so eviction may unlink a segment a load is reading (the open file stays
 * readable until the last reference closes it).
 *
 * Capacity is exact: bytes (every file in the directory) + reserved (what sealing the open
 * segment will add) never exceed max_bytes. Before each append the writer makes room for
 * the record, its index entry and (for a new segment) the footer, evicting whole segments
 * oldest first (sequence order, which survives a restart).
 */
#include "tier/tier.h"

#include "core/core.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#define SYNC_EVERY_BYTES (8ull << 20)

const char *const pkv_tier_drop_name[PKV_TIER_DROP_COUNT] = {"queue_full", "evicted",  "no_room",
                                                             "disk_full",  "io_error", "read_only"};

typedef struct seg {
    uint64_t seq, bytes;
    int fd;                    /* read-only, for loads */
    pkv_tier_entry_t *entries; /* [n]; the first n_synced are in the index */
    uint32_t n, cap, n_synced;
    uint32_t refs; /* the list's (1 while listed) and each load's */
    struct seg *next;
} seg_t;

typedef struct {
    uint8_t key[PKV_TIER_HASH_BYTES];
    seg_t *seg; /* NULL: queued, not loadable yet */
    uint64_t offset;
    bool used;
} slot_t;

typedef struct {
    uint8_t key[PKV_TIER_HASH_BYTES], parent[PKV_TIER_HASH_BYTES];
    uint64_t tenant;
} job_t;

struct pkv_tier {
    pkv_tier_config_t cfg;
    char *dir;
    int dirfd;
    pthread_t writer;
    bool writer_started;

    pthread_mutex_t drop_mu; /* one drop request at a time (callers of drop_all/_tenant) */
    pthread_mutex_t lock;    /* guards everything below */
    pthread_cond_t work_cv, idle_cv;
    bool stop, busy; /* busy: the writer holds a job */
    uint32_t drop_req, drop_done;
    bool drop_one; /* the pending drop is one tenant's (drop_tenant), not everything */
    uint64_t drop_tenant;
    slot_t *slots; /* open addressing by the key's first 8 bytes; a power of two */
    uint32_t nslots, nused;
    seg_t *segs, *active; /* segs in sequence order; active: the open one (the last) */
    pkv_tier_seg_t *w;    /* the writer's handle of active */
    uint64_t next_seq, unsynced;
    job_t *queue; /* ring [queue_max] */
    uint32_t qhead, qlen;
    pkv_tier_stats_t st;
};

/* ---- the index --------------------------------------------------------------------------- */

static uint32_t slot_home(const pkv_tier_t *t, const uint8_t *key)
{
    uint64_t h;
    memcpy(&h, key, sizeof(h));
    return (uint32_t)(h & (t->nslots - 1));
}

static slot_t *slot_find(pkv_tier_t *t, const uint8_t *key)
{
    for (uint32_t i = slot_home(t, key);; i = (i + 1) & (t->nslots - 1)) {
        slot_t *s = &t->slots[i];
        if (!s->used) return NULL;
        if (!memcmp(s->key, key, PKV_TIER_HASH_BYTES)) return s;
    }
}

static int index_grow(pkv_tier_t *t)
{
    uint32_t n = t->nslots ? t->nslots * 2 : 1024;
    slot_t *old = t->slots, *ns = calloc(n, sizeof(*ns));
    if (!ns) return PKV_ERR_NOMEM;
    uint32_t on = t->nslots;
    t->slots = ns, t->nslots = n;
    for (uint32_t i = 0; i < on; i++) {
        if (!old[i].used) continue;
        uint32_t j = slot_home(t, old[i].key);
        while (ns[j].used) j = (j + 1) & (n - 1);
        ns[j] = old[i];
    }
    free(old);
    return PKV_OK;
}

/* Insert key (absent) with seg/offset; NULL on no memory. */
static slot_t *slot_insert(pkv_tier_t *t, const uint8_t *key, seg_t *seg, uint64_t offset)
{
    if ((t->nused + 1) * 2 > t->nslots && index_grow(t)) return NULL;
    uint32_t i = slot_home(t, key);
    while (t->slots[i].used) i = (i + 1) & (t->nslots - 1);
    slot_t *s = &t->slots[i];
    memcpy(s->key, key, PKV_TIER_HASH_BYTES);
    s->seg = seg, s->offset = offset, s->used = true;
    t->nused++;
    return s;
}

/* Remove s, shifting back the run after it (linear probing without tombstones). */
static void slot_remove(pkv_tier_t *t, slot_t *s)
{
    uint32_t m = t->nslots - 1, i = (uint32_t)(s - t->slots), j = i;
    if (s->seg) t->st.records--;
    t->slots[i].used = false;
    t->nused--;
    for (;;) {
        j = (j + 1) & m;
        if (!t->slots[j].used) return;
        uint32_t h = slot_home(t, t->slots[j].key);
        /* j stays if its home lies cyclically in (i, j] */
        if (i <= j ? (i < h && h <= j) : (i < h || h <= j)) continue;
        t->slots[i] = t->slots[j];
        t->slots[j].used = false;
        i = j;
    }
}

/* ---- segments ------------------------------------------------------------------------------ */

static void seg_unref(seg_t *g)
{
    if (--g->refs) return;
    if (g->fd >= 0) close(g->fd);
    free(g->entries);
    free(g);
}

static int seg_push(seg_t *g, const pkv_tier_entry_t *e)
{
    if (g->n == g->cap) {
        uint32_t nc = g->cap ? g->cap * 2 : 64;
        pkv_tier_entry_t *ne = realloc(g->entries, nc * sizeof(*ne));
        if (!ne) return PKV_ERR_NOMEM;
        g->entries = ne, g->cap = nc;
    }
    g->entries[g->n++] = *e;
    return PKV_OK;
}

/* Take g off the list and its records out of the index; the caller unlinks its file (after
 * unlocking) and drops the list's reference. Under t->lock. */
static void seg_detach(pkv_tier_t *t, seg_t *g)
{
    seg_t **pp = &t->segs;
    while (*pp != g) pp = &(*pp)->next;
    *pp = g->next;
    for (uint32_t i = 0; i < g->n_synced; i++) {
        slot_t *s = slot_find(t, g->entries[i].key);
        if (s && s->seg == g) slot_remove(t, s);
    }
    t->st.bytes -= g->bytes;
    t->st.segments--;
}

static void seg_unlink(pkv_tier_t *t, seg_t *g)
{
    char name[PKV_TIER_SEG_NAME_MAX];
    pkv_tier_seg_name(g->seq, name);
    if (unlinkat(t->dirfd, name, 0))
        PKV_LOGW("tier", "cannot remove segment %s: %s", name, strerror(errno));
    seg_unref(g);
}

/* ---- the writer ------------------------------------------------------------------------- */

/* Seal the open segment (its records stay loadable). Writer thread, no lock held. */
static void seal_active(pkv_tier_t *t)
{
    if (!t->w) return;
    int rc = pkv_tier_seg_sync(t->w);
    if (!rc) rc = pkv_tier_seg_seal(t->w);
    seg_t *g = t->active; /* the writer's own: set and cleared only on its thread */
    struct stat st;       /* the file's true size: a failed write may have left part of a record */
    uint64_t now = fstat(g->fd, &st) ? pkv_tier_seg_bytes(t->w) : (uint64_t)st.st_size;
    pthread_mutex_lock(&t->lock);
    t->st.bytes = t->st.bytes - g->bytes + now;
    g->bytes = now;
    t->st.reserved = 0;
    t->active = NULL;
    pthread_mutex_unlock(&t->lock);
    if (rc)
        PKV_LOGE("tier", "sealing segment %llu failed: %s", (unsigned long long)g->seq,
                 pkv_status_str(rc));
    pkv_tier_seg_close(t->w);
    t->w = NULL;
}

/* Publish what the open segment wrote since the last sync. Under t->lock. */
static void publish_locked(pkv_tier_t *t, seg_t *g)
{
    for (; g->n_synced < g->n; g->n_synced++) {
        slot_t *s = slot_find(t, g->entries[g->n_synced].key);
        if (!s || s->seg) continue; /* dropped meanwhile, or already on disk */
        s->seg = g, s->offset = g->entries[g->n_synced].offset;
        t->st.records++;
    }
}

static int sync_active(pkv_tier_t *t)
{
    pthread_mutex_lock(&t->lock);
    bool need = t->w && t->unsynced;
    pthread_mutex_unlock(&t->lock);
    if (!need) return PKV_OK;
    int rc = pkv_tier_seg_sync(t->w);
    pthread_mutex_lock(&t->lock);
    if (!rc) publish_locked(t, t->active);
    t->unsynced = 0;
    pthread_mutex_unlock(&t->lock);
    return rc;
}

/* Free space on the directory's filesystem is under the watermark. */
static bool disk_low(pkv_tier_t *t)
{
    struct statvfs v;
    if (!t->cfg.min_free_bytes || fstatvfs(t->dirfd, &v)) return false;
    return (uint64_t)v.f_bavail * v.f_frsize < t->cfg.min_free_bytes;
}

/* Room for `need` more bytes: evict the oldest sealed segments, or seal the open one when
 * it is the only one left. Writer thread, no lock held. PKV_OK or PKV_ERR_NOFIT. */
static int make_room(pkv_tier_t *t, uint64_t need)
{
    for (;;) {
        pthread_mutex_lock(&t->lock);
        if (t->st.bytes + t->st.reserved + need <= t->cfg.max_bytes) {
            pthread_mutex_unlock(&t->lock);
            return PKV_OK;
        }
        seg_t *g = t->segs;
        if (g && g != t->active) {
            seg_detach(t, g);
            t->st.evicted_segments++;
            pthread_mutex_unlock(&t->lock);
            seg_unlink(t, g);
            continue;
        }
        bool can_seal = g && g == t->active;
        pthread_mutex_unlock(&t->lock);
        if (!can_seal) return PKV_ERR_NOFIT;
        seal_active(t);
    }
}

/* A segment's read descriptor for loads. FADV_RANDOM: no readahead, so the page cache holds
 * only the pages a load asked for, in base pages that the DONTNEED after each record read
 * drops (readahead brings large folios that straddle records, which a record's DONTNEED
 * cannot drop: measured, the whole segment stayed cached after its loads). */
static int open_for_loads(int dirfd, const char *name)
{
    int fd = openat(dirfd, name, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
    return fd;
}

static int open_active(pkv_tier_t *t)
{
    seg_t *g = calloc(1, sizeof(*g));
    if (!g) return PKV_ERR_NOMEM;
    char name[PKV_TIER_SEG_NAME_MAX];
    pkv_tier_seg_name(t->next_seq, name);
    int rc = pkv_tier_seg_create(t->dirfd, t->next_seq, t->cfg.layout, &t->w);
    if (!rc && (g->fd = open_for_loads(t->dirfd, name)) < 0) {
        pkv_tier_seg_close(t->w);
        t->w = NULL;
        unlinkat(t->dirfd, name, 0);
        rc = PKV_ERR_IO;
    }
    if (rc) {
        free(g);
        return rc;
    }
    g->seq = t->next_seq++;
    g->refs = 1;
    pthread_mutex_lock(&t->lock);
    seg_t **pp = &t->segs;
    while (*pp) pp = &(*pp)->next;
    *pp = g;
    t->active = g;
    t->st.segments++;
    t->st.reserved = PKV_TIER_FOOTER_BYTES;
    pthread_mutex_unlock(&t->lock);
    return PKV_OK;
}

/* Drop the queued key (its slot goes) and count why. */
static void drop_job(pkv_tier_t *t, const job_t *j, pkv_tier_drop_t why)
{
    pthread_mutex_lock(&t->lock);
    slot_t *s = slot_find(t, j->key);
    if (s && !s->seg) slot_remove(t, s);
    t->st.dropped[why]++;
    pthread_mutex_unlock(&t->lock);
}

/* Write one queued block. Writer thread, no lock held; buf holds record_bytes. */
static void write_one(pkv_tier_t *t, const job_t *j, void *buf)
{
    uint64_t len = t->cfg.record_bytes;
    /* The footer too, always: making room may seal the open segment. */
    uint64_t need = PKV_TIER_HEADER_BYTES + len + PKV_TIER_ENTRY_BYTES + PKV_TIER_FOOTER_BYTES;
    if (disk_low(t)) return drop_job(t, j, PKV_TIER_DROP_DISK_FULL);
    if (make_room(t, need)) return drop_job(t, j, PKV_TIER_DROP_NO_ROOM);
    if (t->cfg.source(t->cfg.source_arg, j->key, buf, len))
        return drop_job(t, j, PKV_TIER_DROP_EVICTED);
    if (!t->w && open_active(t)) return drop_job(t, j, PKV_TIER_DROP_IO);
    pkv_tier_record_t r = {.payload_len = len};
    memcpy(r.layout, t->cfg.layout, PKV_TIER_HASH_BYTES);
    memcpy(r.key, j->key, PKV_TIER_HASH_BYTES);
    memcpy(r.parent, j->parent, PKV_TIER_HASH_BYTES);
    r.tenant = j->tenant;
    pkv_tier_entry_t e;
    if (pkv_fault_hit(PKV_FAULT_TIER_WRITE_FULL)) return drop_job(t, j, PKV_TIER_DROP_DISK_FULL);
    int rc = pkv_tier_seg_append(t->w, &r, buf, &e);
    pthread_mutex_lock(&t->lock);
    seg_t *g = t->active;
    uint64_t now = pkv_tier_seg_bytes(t->w);
    t->st.bytes = t->st.bytes - g->bytes + now;
    g->bytes = now;
    if (!rc) rc = seg_push(g, &e);
    if (!rc) {
        t->st.reserved = pkv_tier_seg_seal_bytes(t->w);
        t->st.written_records++;
        t->st.written_bytes += PKV_TIER_HEADER_BYTES + len;
        t->unsynced += PKV_TIER_HEADER_BYTES + len;
    }
    bool sync_now = t->unsynced >= SYNC_EVERY_BYTES || now >= t->cfg.segment_bytes;
    pthread_mutex_unlock(&t->lock);
    if (rc) {
        PKV_LOGE("tier", "writing segment %llu failed: %s", (unsigned long long)g->seq,
                 pkv_status_str(rc));
        drop_job(t, j, PKV_TIER_DROP_IO);
        seal_active(t); /* what was synced stays loadable; a broken segment takes no more */
        return;
    }
    if (sync_now) sync_active(t);
    if (now >= t->cfg.segment_bytes) seal_active(t);
}

/* Whether segment g holds a record (synced or not) of the tenant. Under t->lock. */
static bool seg_has_tenant(const seg_t *g, uint64_t tenant)
{
    for (uint32_t i = 0; i < g->n; i++)
        if (g->entries[i].tenant == tenant) return true;
    return false;
}

/* Take the tenant's queued keys off the queue (they are never written). Under t->lock. */
static void queue_drop_tenant(pkv_tier_t *t, uint64_t tenant)
{
    uint32_t kept = 0, q = t->cfg.queue_max;
    for (uint32_t i = 0; i < t->qlen; i++) {
        job_t j = t->queue[(t->qhead + i) % q];
        if (j.tenant == tenant) {
            slot_t *s = slot_find(t, j.key);
            if (s && !s->seg) slot_remove(t, s);
            continue;
        }
        t->queue[(t->qhead + kept++) % q] = j;
    }
    t->qlen = kept;
}

/* The disk part of a reset (one: every segment, the open one included) or of a tenant's
 * purge (every segment holding one of its records: the other records in them go too, a
 * cache may forget; the files are gone, so nothing of the tenant's comes back after a
 * restart). Writer thread. */
static void drop_segments(pkv_tier_t *t, bool one, uint64_t tenant)
{
    pthread_mutex_lock(&t->lock);
    if (one) queue_drop_tenant(t, tenant);
    bool active = t->active && (!one || seg_has_tenant(t->active, tenant));
    pthread_mutex_unlock(&t->lock);
    if (active) {
        pkv_tier_seg_close(t->w);
        t->w = NULL;
    }
    pthread_mutex_lock(&t->lock);
    seg_t *all = NULL, **tail = &all, *g = t->segs;
    while (g) {
        seg_t *next = g->next;
        if (g == t->active ? active : !one || seg_has_tenant(g, tenant)) {
            seg_detach(t, g);
            g->next = NULL;
            *tail = g, tail = &g->next;
        }
        g = next;
    }
    if (active) {
        t->active = NULL;
        t->st.reserved = 0;
        t->unsynced = 0;
    }
    pthread_mutex_unlock(&t->lock);
    while (all) {
        seg_t *d = all;
        all = d->next;
        seg_unlink(t, d);
    }
}

static void *writer_main(void *arg)
{
    pkv_tier_t *t = arg;
    pthread_setname_np(pthread_self(), "pkv-tier-writer");
    void *buf = malloc(t->cfg.record_bytes ? t->cfg.record_bytes : 1);
    pthread_mutex_lock(&t->lock);
    while (!t->stop) {
        if (t->drop_req != t->drop_done) {
            uint32_t req = t->drop_req;
            bool one = t->drop_one;
            uint64_t tenant = t->drop_tenant;
            pthread_mutex_unlock(&t->lock);
            drop_segments(t, one, tenant);
            pthread_mutex_lock(&t->lock);
            t->drop_done = req;
            pthread_cond_broadcast(&t->idle_cv);
            continue;
        }
        if (!t->qlen) {
            if (t->unsynced) {
                pthread_mutex_unlock(&t->lock);
                sync_active(t);
                pthread_mutex_lock(&t->lock);
                continue;
            }
            pthread_cond_broadcast(&t->idle_cv);
            pthread_cond_wait(&t->work_cv, &t->lock);
            continue;
        }
        job_t j = t->queue[t->qhead];
        t->qhead = (t->qhead + 1) % t->cfg.queue_max;
        t->qlen--;
        t->busy = true;
        pthread_mutex_unlock(&t->lock);
        if (buf)
            write_one(t, &j, buf);
        else
            drop_job(t, &j, PKV_TIER_DROP_IO);
        pthread_mutex_lock(&t->lock);
        t->busy = false;
    }
    pthread_mutex_unlock(&t->lock);
    free(buf);
    sync_active(t);
    seal_active(t);
    return NULL;
}

/* ---- opening: the directory's segments ------------------------------------------------- */

/* Add segment `name` (its records to the index) or count it as foreign. Only this layout's
 * unsealed segment (the one a crash left open) is repaired: another layout's is left as it
 * is, its owner repairs it. */
static int load_segment(pkv_tier_t *t, const char *name, uint64_t seq)
{
    pkv_tier_seg_info_t in;
    int rc = pkv_tier_seg_open(t->dirfd, name, false, &in);
    if (!rc && !in.sealed && t->st.writable &&
        (!in.n || !memcmp(in.layout, t->cfg.layout, PKV_TIER_HASH_BYTES))) {
        pkv_tier_seg_info_fini(&in);
        rc = pkv_tier_seg_open(t->dirfd, name, true, &in);
    }
    if (rc == PKV_ERR_NOMEM) return rc;
    t->next_seq = PKV_MAX(t->next_seq, seq + 1);
    if (rc) { /* unreadable (logged): its bytes still count */
        struct stat st;
        t->st.bytes += fstatat(t->dirfd, name, &st, 0) ? 0 : (uint64_t)st.st_size;
        return PKV_OK;
    }
    t->st.bytes += in.bytes; /* after any repair */
    if (in.n && memcmp(in.layout, t->cfg.layout, PKV_TIER_HASH_BYTES)) {
        PKV_LOGW("tier", "segment %s holds another model's or layout's KV: left alone", name);
        t->st.foreign++;
        pkv_tier_seg_info_fini(&in);
        return PKV_OK;
    }
    t->st.corrupt += in.corrupt;
    seg_t *g = calloc(1, sizeof(*g));
    if (!g) {
        pkv_tier_seg_info_fini(&in);
        return PKV_ERR_NOMEM;
    }
    g->seq = seq, g->refs = 1, g->bytes = in.bytes;
    g->entries = in.entries, g->n = g->cap = g->n_synced = in.n;
    g->fd = open_for_loads(t->dirfd, name);
    seg_t **pp = &t->segs;
    while (*pp && (*pp)->seq < seq) pp = &(*pp)->next;
    g->next = *pp, *pp = g;
    t->st.segments++;
    for (uint32_t i = 0; i < g->n; i++) {
        if (g->entries[i].payload_len != t->cfg.record_bytes) { /* the layout says otherwise */
            t->st.corrupt++;
            continue;
        }
        /* Written twice (an earlier copy was quarantined, then the block written again): the
         * newest copy wins, the largest sequence and the last in its segment, in whatever
         * order the directory lists the segments. */
        slot_t *s = slot_find(t, g->entries[i].key);
        if (s && (s->seg == g || s->seg->seq < seq)) {
            s->seg = g, s->offset = g->entries[i].offset;
            continue;
        }
        if (s) continue;
        if (!slot_insert(t, g->entries[i].key, g, g->entries[i].offset)) return PKV_ERR_NOMEM;
        t->st.records++;
    }
    return PKV_OK;
}

/* Every file's bytes count; segments are read in; empty ones removed. */
static int scan_dir(pkv_tier_t *t)
{
    int fd = dup(t->dirfd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0) close(fd);
        return PKV_ERR_IO;
    }
    int rc = PKV_OK;
    struct dirent *de;
    while (!rc && (de = readdir(d))) {
        struct stat st;
        uint64_t seq;
        if (de->d_name[0] == '.' && (!de->d_name[1] || !strcmp(de->d_name, ".."))) continue;
        if (fstatat(t->dirfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW)) continue;
        bool seg = S_ISREG(st.st_mode) && pkv_tier_seg_seq(de->d_name, &seq);
        if (!seg) PKV_LOGW("tier", "%s/%s is not the tier's: left alone", t->dir, de->d_name);
        if (seg)
            rc = load_segment(t, de->d_name, seq);
        else if (S_ISREG(st.st_mode))
            t->st.bytes += (uint64_t)st.st_size;
    }
    closedir(d);
    return rc;
}

/* Segments whose records all went (or never were): removed. Then over the cap: the oldest
 * go until the directory fits. */
static void tidy(pkv_tier_t *t)
{
    for (seg_t **pp = &t->segs; *pp;) {
        seg_t *g = *pp;
        bool empty = g->n == 0 && t->st.writable;
        bool over = t->st.bytes > t->cfg.max_bytes && t->st.writable;
        if (!empty && !over) {
            pp = &g->next;
            continue;
        }
        seg_detach(t, g);
        if (over) t->st.evicted_segments++;
        seg_unlink(t, g);
    }
}

static int config_check(const pkv_tier_config_t *c, pkv_tier_config_t *out)
{
    if (!c->dir || !c->source || !c->max_bytes || !c->record_bytes || c->record_bytes > UINT32_MAX)
        return PKV_ERR_INVALID;
    *out = *c;
    if (!out->segment_bytes) /* an eighth of the cap: eviction gives up an eighth at a time */
        out->segment_bytes = PKV_MAX(PKV_MIN(c->max_bytes / 8, 256ull << 20), 1);
    if (!out->queue_max) out->queue_max = 4096;
    return PKV_OK;
}

int pkv_tier_open(const pkv_tier_config_t *cfg, pkv_tier_t **out)
{
    pkv_tier_t *t = calloc(1, sizeof(*t));
    if (!t) return PKV_ERR_NOMEM;
    int rc = config_check(cfg, &t->cfg);
    if (rc) goto fail_free;
    rc = PKV_ERR_NOMEM;
    if (!(t->dir = strdup(cfg->dir)) || !(t->queue = calloc(t->cfg.queue_max, sizeof(*t->queue))) ||
        index_grow(t))
        goto fail_free;
    t->dirfd = open(cfg->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (t->dirfd < 0) {
        PKV_LOGE("tier", "cannot open --kv-disk-dir %s: %s", cfg->dir, strerror(errno));
        rc = PKV_ERR_IO;
        goto fail_free;
    }
    if (flock(t->dirfd, LOCK_EX | LOCK_NB)) {
        PKV_LOGE("tier", "%s is in use by another pagekv server", cfg->dir);
        rc = PKV_ERR_BUSY;
        goto fail_close;
    }
    t->st.writable = faccessat(t->dirfd, ".", W_OK, AT_EACCESS) == 0;
    t->next_seq = 1;
    if ((rc = scan_dir(t))) goto fail_segs;
    tidy(t);
    pthread_mutex_init(&t->lock, NULL);
    pthread_mutex_init(&t->drop_mu, NULL);
    pkv_cond_init_monotonic(&t->work_cv);
    pkv_cond_init_monotonic(&t->idle_cv);
    if (t->st.writable) {
        if (pkv_fault_hit(PKV_FAULT_THREAD) || pthread_create(&t->writer, NULL, writer_main, t)) {
            rc = PKV_ERR_NOMEM;
            goto fail_sync;
        }
        t->writer_started = true;
    }
    *out = t;
    return PKV_OK;
fail_sync:
    pthread_cond_destroy(&t->idle_cv);
    pthread_cond_destroy(&t->work_cv);
    pthread_mutex_destroy(&t->lock);
    pthread_mutex_destroy(&t->drop_mu);
fail_segs:
    while (t->segs) {
        seg_t *g = t->segs;
        t->segs = g->next;
        seg_unref(g);
    }
fail_close:
    close(t->dirfd);
fail_free:
    free(t->slots);
    free(t->queue);
    free(t->dir);
    free(t);
    return rc;
}

void pkv_tier_close(pkv_tier_t *t)
{
    if (!t) return;
    pthread_mutex_lock(&t->lock);
    t->stop = true;
    pthread_cond_broadcast(&t->work_cv);
    pthread_mutex_unlock(&t->lock);
    if (t->writer_started) pthread_join(t->writer, NULL);
    while (t->segs) {
        seg_t *g = t->segs;
        t->segs = g->next;
        seg_unref(g);
    }
    close(t->dirfd); /* the lock goes with it */
    pthread_cond_destroy(&t->idle_cv);
    pthread_cond_destroy(&t->work_cv);
    pthread_mutex_destroy(&t->lock);
    pthread_mutex_destroy(&t->drop_mu);
    free(t->slots);
    free(t->queue);
    free(t->dir);
    free(t);
}

/* ---- using it ----------------------------------------------------------------------------- */

int pkv_tier_put(pkv_tier_t *t, const uint8_t key[PKV_TIER_HASH_BYTES],
                 const uint8_t parent[PKV_TIER_HASH_BYTES], uint64_t tenant)
{
    int rc = PKV_OK;
    pthread_mutex_lock(&t->lock);
    if (slot_find(t, key)) goto out; /* on disk or queued */
    pkv_tier_drop_t why = !t->st.writable ? PKV_TIER_DROP_READ_ONLY : PKV_TIER_DROP_QUEUE_FULL;
    if (!t->st.writable || t->qlen == t->cfg.queue_max || !slot_insert(t, key, NULL, 0)) {
        t->st.dropped[why]++;
        rc = PKV_ERR_BUSY;
        goto out;
    }
    job_t *j = &t->queue[(t->qhead + t->qlen++) % t->cfg.queue_max];
    memcpy(j->key, key, PKV_TIER_HASH_BYTES);
    memcpy(j->parent, parent, PKV_TIER_HASH_BYTES);
    j->tenant = tenant;
    pthread_cond_signal(&t->work_cv);
out:
    pthread_mutex_unlock(&t->lock);
    return rc;
}

uint32_t pkv_tier_match(pkv_tier_t *t, const uint8_t (*keys)[PKV_TIER_HASH_BYTES], uint32_t n)
{
    uint32_t i = 0;
    pthread_mutex_lock(&t->lock);
    for (; i < n; i++) {
        slot_t *s = slot_find(t, keys[i]);
        if (!s || !s->seg) break;
    }
    pthread_mutex_unlock(&t->lock);
    return i;
}

int pkv_tier_load(pkv_tier_t *t, const uint8_t key[PKV_TIER_HASH_BYTES], void *buf)
{
    pthread_mutex_lock(&t->lock);
    slot_t *s = slot_find(t, key);
    if (!s || !s->seg) {
        pthread_mutex_unlock(&t->lock);
        return PKV_ERR_NOTFOUND;
    }
    seg_t *g = s->seg;
    pkv_tier_entry_t e = {.offset = s->offset, .payload_len = (uint32_t)t->cfg.record_bytes};
    memcpy(e.key, key, PKV_TIER_HASH_BYTES);
    g->refs++;
    pthread_mutex_unlock(&t->lock);
    while (pkv_fault_hit(PKV_FAULT_TIER_READ_SLOW))
        nanosleep(&(struct timespec){.tv_nsec = 250000000}, NULL);
    int rc = g->fd < 0 || pkv_fault_hit(PKV_FAULT_TIER_READ_IO)
                 ? PKV_ERR_IO
                 : pkv_tier_record_read(g->fd, &e, t->cfg.layout, key, buf);
    pthread_mutex_lock(&t->lock);
    if (rc == PKV_ERR_CORRUPT || rc == PKV_ERR_IO) { /* quarantined: never read again */
        s = slot_find(t, key);
        if (s && s->seg == g && s->offset == e.offset) slot_remove(t, s);
        if (rc == PKV_ERR_CORRUPT) t->st.corrupt++;
        PKV_LOGW("tier", "a record of segment %llu %s: quarantined", (unsigned long long)g->seq,
                 rc == PKV_ERR_CORRUPT ? "failed its check" : "could not be read");
    } else if (!rc) {
        t->st.loaded_records++;
        t->st.loaded_bytes += PKV_TIER_HEADER_BYTES + e.payload_len;
    }
    seg_unref(g);
    pthread_mutex_unlock(&t->lock);
    return rc;
}

int pkv_tier_flush(pkv_tier_t *t, uint64_t deadline_ns)
{
    int rc = PKV_OK;
    pthread_mutex_lock(&t->lock);
    while (t->writer_started && (t->qlen || t->busy || t->unsynced)) {
        struct timespec ts = pkv_deadline_to_monotonic(deadline_ns);
        if (pthread_cond_timedwait(&t->idle_cv, &t->lock, &ts) == ETIMEDOUT) {
            rc = PKV_ERR_TIMEOUT;
            break;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return rc;
}

static int drop_request(pkv_tier_t *t, bool one, uint64_t tenant)
{
    pthread_mutex_lock(&t->drop_mu);
    pthread_mutex_lock(&t->lock);
    if (!t->writer_started) {
        pthread_mutex_unlock(&t->lock);
        pthread_mutex_unlock(&t->drop_mu);
        return PKV_ERR_UNSUPPORTED; /* read-only: nothing can be removed */
    }
    t->drop_one = one, t->drop_tenant = tenant;
    uint32_t req = ++t->drop_req;
    pthread_cond_signal(&t->work_cv);
    while ((int32_t)(t->drop_done - req) < 0) pthread_cond_wait(&t->idle_cv, &t->lock);
    pthread_mutex_unlock(&t->lock);
    pthread_mutex_unlock(&t->drop_mu);
    return PKV_OK;
}

int pkv_tier_drop_all(pkv_tier_t *t)
{
    return drop_request(t, false, 0);
}

int pkv_tier_drop_tenant(pkv_tier_t *t, uint64_t tenant)
{
    return drop_request(t, true, tenant);
}

void pkv_tier_stats(pkv_tier_t *t, pkv_tier_stats_t *out)
{
    pthread_mutex_lock(&t->lock);
    *out = t->st;
    out->queued = t->qlen;
    pthread_mutex_unlock(&t->lock);
}
