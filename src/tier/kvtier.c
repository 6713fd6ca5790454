/*
 * kvtier: the disk tier joined to a paged KV pool (kvtier.h; docs/design/tier.md).
 *
 * A load is a job shared by its requester and the loader thread (two references, the last
 * one frees it). The loader reads and verifies one record at a time into a bounce buffer,
 * scatters it into the job's next pool block, then counts it done under kt->lock. At its
 * deadline the requester takes the blocks done so far (`taken`) and leaves; the loader
 * stops at its next block and frees the blocks past `taken`. A job that ends on its own
 * (all read, or a bad record) leaves every block to the requester.
 */
#include "tier/kvtier.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define EWMA_ALPHA 0.25

const double pkv_kvtier_hist_bounds[PKV_KVTIER_HIST_BUCKETS] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5};

typedef struct job {
    pkv_kv_key_t *keys; /* [n], the job's own copy */
    uint32_t *ids;      /* [n] pool blocks, allocated by the requester */
    uint32_t n, done, taken;
    bool abandoned, finished, failed;
    int refs;
    struct job *next;
} job_t;

struct pkv_kvtier {
    pkv_kv_t *kv;
    pkv_tier_t *tier;
    uint64_t record_bytes, max_bytes;
    uint32_t block_tokens;
    uint64_t load_ns;
    pthread_t loader;
    bool loader_started;
    void *buf; /* the loader's bounce buffer [record_bytes] */

    pthread_mutex_t lock; /* guards everything below */
    pthread_cond_t cv;    /* monotonic: a job queued, a block done, a job finished */
    job_t *head, *tail;
    bool stop;
    double block_s, token_s; /* the estimates (0: none yet) */
    uint64_t hit_mem, hit_disk, dec_load, dec_recompute, timeouts, failures;
    pkv_hist_t hist;
};

/* ---- the layout digest --------------------------------------------------------------------- */

void pkv_kvtier_layout(const pkv_kv_t *kv, const char *model_identity,
                       uint8_t out[PKV_TIER_HASH_BYTES])
{
    const pkv_geometry_t *g = pkv_kv_geometry(kv);
    char s[512];
    int n = snprintf(s, sizeof(s),
                     "pagekv kv block layout 1 (canonical [layer][k,v][head][token][dim])\n"
                     "model %s\nlayers %u kv_heads %u head_dim %u dtype %s block_tokens %u tp %u\n",
                     model_identity ? model_identity : "", g->layers, g->kv_heads, g->head_dim,
                     /* int8 rows carry lane-group scales (format 2): records of the
                        earlier per-row f32 scale read as another layout */
                     g->dtype == PKV_DTYPE_INT8 ? "int8 format 2" : pkv_dtype_name(g->dtype),
                     g->block_tokens, pkv_kv_tp(kv));
    SHA256((const unsigned char *)s, (size_t)PKV_MIN(n, (int)sizeof(s) - 1), out);
}

int pkv_kvtier_file_hash(const char *path, char hex[33])
{
    int fd = open(path, O_RDONLY | O_CLOEXEC), rc = PKV_ERR_IO;
    XXH3_state_t *st = XXH3_createState();
    enum { CHUNK = 1 << 20 };
    uint8_t *buf = malloc(CHUNK);
    if (fd < 0 || !st || !buf || XXH3_128bits_reset(st) != XXH_OK) goto out;
    ssize_t r;
    while ((r = read(fd, buf, CHUNK)) > 0)
        if (XXH3_128bits_update(st, buf, (size_t)r) != XXH_OK) goto out;
    if (r < 0) goto out;
    XXH128_hash_t h = XXH3_128bits_digest(st);
    snprintf(hex, 33, "%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
    rc = PKV_OK;
out:
    free(buf);
    XXH3_freeState(st);
    if (fd >= 0) close(fd);
    return rc;
}

/* ---- the writer's side: the pool's hooks ------------------------------------------------------
 */

static void on_full(void *arg, const pkv_kv_key_t *key, const pkv_kv_key_t *parent, uint64_t salt)
{
    pkv_kvtier_t *kt = arg;
    (void)pkv_tier_put(kt->tier, key->b, parent->b, salt); /* a full queue counts a drop */
}

/* The writer's source: the block, copied out under a pin; NOTFOUND once it left memory. */
static int source(void *arg, const uint8_t key[PKV_TIER_HASH_BYTES], void *buf, uint64_t len)
{
    pkv_kvtier_t *kt = arg;
    pkv_kv_key_t k;
    uint32_t id;
    memcpy(k.b, key, sizeof(k.b));
    if (len != kt->record_bytes || pkv_kv_key_pin(kt->kv, &k, &id)) return PKV_ERR_NOTFOUND;
    pkv_kv_block_read(kt->kv, id, buf);
    pkv_kv_unpin(kt->kv, &id, 1);
    return PKV_OK;
}

/* ---- the loader --------------------------------------------------------------------------------
 */

static void ewma(double *est, double sample)
{
    *est = *est > 0 ? *est + EWMA_ALPHA * (sample - *est) : sample;
}

/* Drop one reference to j (lock held); the last frees it. */
static void job_unref(job_t *j)
{
    if (--j->refs) return;
    free(j->keys);
    free(j->ids);
    free(j);
}

/* Read the job's records into its blocks, one at a time, until done, abandoned or a bad
 * record. Loader thread, no lock held on entry or exit. */
static void load_job(pkv_kvtier_t *kt, job_t *j, void *buf)
{
    uint32_t i = 0;
    for (;; i++) {
        pthread_mutex_lock(&kt->lock);
        bool go = i < j->n && !j->abandoned;
        pthread_mutex_unlock(&kt->lock);
        if (!go) break;
        uint64_t t0 = pkv_now_ns();
        int rc = pkv_tier_load(kt->tier, j->keys[i].b, buf);
        if (!rc) pkv_kv_block_write(kt->kv, j->ids[i], buf);
        double s = (double)(pkv_now_ns() - t0) / 1e9;
        pthread_mutex_lock(&kt->lock);
        ewma(&kt->block_s, s); /* a slow or failed read teaches too */
        if (!rc && !j->abandoned) j->done++;
        if (rc) j->failed = true, kt->failures++;
        pthread_cond_broadcast(&kt->cv);
        pthread_mutex_unlock(&kt->lock);
        if (rc) break;
    }
    pthread_mutex_lock(&kt->lock);
    j->finished = true;
    uint32_t lo = j->abandoned ? j->taken : j->n; /* abandoned: the rest is the loader's */
    pthread_cond_broadcast(&kt->cv);
    pthread_mutex_unlock(&kt->lock);
    if (lo < j->n) pkv_kv_blocks_free(kt->kv, j->ids + lo, j->n - lo);
    pthread_mutex_lock(&kt->lock);
    job_unref(j);
    pthread_mutex_unlock(&kt->lock);
}

static void *loader_main(void *arg)
{
    pkv_kvtier_t *kt = arg;
    pthread_setname_np(pthread_self(), "pkv-tier-loader");
    pthread_mutex_lock(&kt->lock);
    for (;;) {
        while (!kt->stop && !kt->head) pthread_cond_wait(&kt->cv, &kt->lock);
        job_t *j = kt->head;
        if (!j) break; /* stopping with nothing queued */
        kt->head = j->next;
        if (!kt->head) kt->tail = NULL;
        pthread_mutex_unlock(&kt->lock);
        load_job(kt, j, kt->buf);
        pthread_mutex_lock(&kt->lock);
    }
    pthread_mutex_unlock(&kt->lock);
    return NULL;
}

/* ---- open / close
 * -------------------------------------------------------------------------------- */

int pkv_kvtier_open(pkv_kv_t *kv, const pkv_kvtier_config_t *cfg, pkv_kvtier_t **out)
{
    if (!kv || !cfg || !cfg->dir || !out) return PKV_ERR_INVALID;
    pkv_kv_key_t probe = {{0}};
    uint32_t id;
    if (pkv_kv_backend(kv) != PKV_BACKEND_PAGED ||
        pkv_kv_key_pin(kv, &probe, &id) == PKV_ERR_UNSUPPORTED)
        return PKV_ERR_UNSUPPORTED;
    if (mkdir(cfg->dir, 0700) && errno != EEXIST) {
        PKV_LOGE("tier", "cannot create %s: %s", cfg->dir, strerror(errno));
        return PKV_ERR_IO;
    }
    pkv_kvtier_t *kt = calloc(1, sizeof(*kt));
    if (!kt) return PKV_ERR_NOMEM;
    const pkv_geometry_t *g = pkv_kv_geometry(kv);
    kt->kv = kv;
    kt->block_tokens = g->block_tokens;
    kt->record_bytes = pkv_geometry_token_bytes(g) * g->block_tokens;
    kt->max_bytes = cfg->max_bytes;
    kt->load_ns = (uint64_t)(cfg->load_ms ? cfg->load_ms : 1000) * 1000000ull;
    pthread_mutex_init(&kt->lock, NULL);
    int rc = PKV_ERR_NOMEM;
    if (!(kt->buf = malloc(kt->record_bytes))) goto fail_lock;
    if ((rc = pkv_cond_init_monotonic(&kt->cv))) goto fail_lock;
    pkv_tier_config_t tc = {.dir = cfg->dir,
                            .max_bytes = cfg->max_bytes,
                            .min_free_bytes = cfg->min_free_bytes,
                            .record_bytes = kt->record_bytes,
                            .source = source,
                            .source_arg = kt};
    memcpy(tc.layout, cfg->layout, PKV_TIER_HASH_BYTES);
    if ((rc = pkv_tier_open(&tc, &kt->tier))) goto fail_cv;
    if (pthread_create(&kt->loader, NULL, loader_main, kt)) {
        rc = PKV_ERR_NOMEM;
        goto fail_tier;
    }
    kt->loader_started = true;
    pkv_kv_on_full(kv, on_full, kt);
    *out = kt;
    return PKV_OK;
fail_tier:
    pkv_tier_close(kt->tier);
fail_cv:
    pthread_cond_destroy(&kt->cv);
fail_lock:
    pthread_mutex_destroy(&kt->lock);
    free(kt->buf);
    free(kt);
    return rc;
}

void pkv_kvtier_close(pkv_kvtier_t *kt)
{
    if (!kt) return;
    pkv_kv_on_full(kt->kv, NULL, NULL);
    pthread_mutex_lock(&kt->lock);
    kt->stop = true;
    pthread_cond_broadcast(&kt->cv);
    pthread_mutex_unlock(&kt->lock);
    if (kt->loader_started) pthread_join(kt->loader, NULL);
    pkv_tier_close(kt->tier);
    pthread_cond_destroy(&kt->cv);
    pthread_mutex_destroy(&kt->lock);
    free(kt->buf);
    free(kt);
}

/* ---- reading for a request
 * ------------------------------------------------------------------------ */

/* Whether loading n blocks is predicted faster than computing their tokens. Lock held. */
static bool load_pays(const pkv_kvtier_t *kt, uint32_t n)
{
    if (kt->block_s <= 0 || kt->token_s <= 0) return true; /* unmeasured: see tier.md */
    return kt->block_s * n < kt->token_s * n * kt->block_tokens;
}

/* Load keys[0..n) into fresh blocks within the deadline; the blocks read and verified go
 * to ids (pinned; their number returned). */
static uint32_t load(pkv_kvtier_t *kt, const pkv_kv_key_t *keys, uint32_t n, uint32_t *ids)
{
    job_t *j = calloc(1, sizeof(*j));
    uint32_t *jid = j ? malloc(n * sizeof(*jid)) : NULL;
    pkv_kv_key_t *jk = jid ? malloc(n * sizeof(*jk)) : NULL;
    if (!jk || pkv_kv_blocks_alloc(kt->kv, n, jid)) {
        free(jk);
        free(jid);
        free(j);
        return 0; /* no memory for the blocks: they are recomputed */
    }
    memcpy(jk, keys, n * sizeof(*jk));
    *j = (job_t){.keys = jk, .ids = jid, .n = n, .refs = 2};
    uint64_t t0 = pkv_now_ns(), deadline = t0 + kt->load_ns;
    struct timespec ts = pkv_deadline_to_monotonic(deadline);
    pthread_mutex_lock(&kt->lock);
    if (kt->tail)
        kt->tail->next = j;
    else
        kt->head = j;
    kt->tail = j;
    pthread_cond_broadcast(&kt->cv);
    while (!j->finished && pkv_now_ns() < deadline) pthread_cond_timedwait(&kt->cv, &kt->lock, &ts);
    uint32_t got = j->done;
    if (!j->finished) {
        j->abandoned = true;
        j->taken = got;
        kt->timeouts++;
    }
    bool finished = j->finished;
    pkv_hist_add(&kt->hist, pkv_kvtier_hist_bounds, PKV_KVTIER_HIST_BUCKETS,
                 (double)(pkv_now_ns() - t0) / 1e9);
    pthread_mutex_unlock(&kt->lock);
    memcpy(ids, jid, got * sizeof(*ids));
    if (finished && got < n) pkv_kv_blocks_free(kt->kv, jid + got, n - got);
    pthread_mutex_lock(&kt->lock);
    job_unref(j);
    pthread_mutex_unlock(&kt->lock);
    return got;
}

/* The prompt's prefix keys (malloc'd, *nk of them). */
static pkv_kv_key_t *prompt_keys(pkv_kvtier_t *kt, uint64_t salt, const int32_t *tokens, uint32_t n,
                                 uint32_t *nk)
{
    uint32_t max = n ? (n - 1) / kt->block_tokens : 0;
    pkv_kv_key_t *keys = malloc((max ? max : 1) * sizeof(*keys));
    *nk = keys ? pkv_kv_prefix_keys(kt->kv, salt, tokens, n, keys) : 0;
    return keys;
}

void pkv_kvtier_prepare(pkv_kvtier_t *kt, uint64_t salt, const int32_t *tokens, uint32_t n,
                        pkv_kvtier_lease_t *out)
{
    *out = (pkv_kvtier_lease_t){0};
    uint32_t nk;
    pkv_kv_key_t *keys = prompt_keys(kt, salt, tokens, n, &nk);
    if (!keys || !nk || !(out->ids = malloc(nk * sizeof(*out->ids)))) {
        free(keys);
        return;
    }
    uint32_t m = 0;
    while (m < nk && !pkv_kv_key_pin(kt->kv, &keys[m], &out->ids[m])) m++;
    out->mem_blocks = m;
    uint32_t d =
        m < nk ? pkv_tier_match(kt->tier, (const uint8_t(*)[PKV_TIER_HASH_BYTES]) & keys[m], nk - m)
               : 0;
    pthread_mutex_lock(&kt->lock);
    kt->hit_mem += m;
    bool go = d && load_pays(kt, d);
    if (d) go ? kt->dec_load++ : kt->dec_recompute++;
    pthread_mutex_unlock(&kt->lock);
    if (go) {
        uint32_t got = load(kt, &keys[m], d, out->ids + m);
        pkv_kv_blocks_publish(kt->kv, out->ids + m, &keys[m], got, salt);
        out->disk_blocks = got;
        pthread_mutex_lock(&kt->lock);
        kt->hit_disk += got;
        pthread_mutex_unlock(&kt->lock);
    }
    free(keys);
}

void pkv_kvtier_release(pkv_kvtier_t *kt, pkv_kvtier_lease_t *l)
{
    if (l->ids) pkv_kv_unpin(kt->kv, l->ids, l->mem_blocks + l->disk_blocks);
    free(l->ids);
    *l = (pkv_kvtier_lease_t){0};
}

void pkv_kvtier_lookup(pkv_kvtier_t *kt, uint64_t salt, const int32_t *tokens, uint32_t n,
                       uint32_t *mem_tokens, uint32_t *disk_tokens)
{
    *mem_tokens = *disk_tokens = 0;
    if (pkv_kv_prefix_match(kt->kv, salt, tokens, n, mem_tokens)) return;
    uint32_t nk, m = *mem_tokens / kt->block_tokens;
    pkv_kv_key_t *keys = prompt_keys(kt, salt, tokens, n, &nk);
    if (keys && m < nk)
        *disk_tokens =
            kt->block_tokens *
            pkv_tier_match(kt->tier, (const uint8_t(*)[PKV_TIER_HASH_BYTES]) & keys[m], nk - m);
    free(keys);
}

void pkv_kvtier_note_prefill(pkv_kvtier_t *kt, uint64_t tokens, uint64_t ns)
{
    if (!tokens) return;
    pthread_mutex_lock(&kt->lock);
    ewma(&kt->token_s, (double)ns / 1e9 / (double)tokens);
    pthread_mutex_unlock(&kt->lock);
}

/* ---- admin and accounting
 * ------------------------------------------------------------------------------ */

int pkv_kvtier_drop_disk(pkv_kvtier_t *kt)
{
    return pkv_tier_drop_all(kt->tier);
}

int pkv_kvtier_purge_disk(pkv_kvtier_t *kt, uint64_t salt)
{
    return pkv_tier_drop_tenant(kt->tier, salt);
}

void pkv_kvtier_stats(pkv_kvtier_t *kt, pkv_kvtier_stats_t *out)
{
    memset(out, 0, sizeof(*out));
    pkv_tier_stats(kt->tier, &out->disk);
    out->capacity_bytes = kt->max_bytes;
    pthread_mutex_lock(&kt->lock);
    out->hit_blocks_memory = kt->hit_mem;
    out->hit_blocks_disk = kt->hit_disk;
    out->decisions_load = kt->dec_load;
    out->decisions_recompute = kt->dec_recompute;
    out->load_timeouts = kt->timeouts;
    out->load_failures = kt->failures;
    out->block_load_s = kt->block_s;
    out->prefill_token_s = kt->token_s;
    out->read_bytes_per_s = kt->block_s > 0 ? (double)kt->record_bytes / kt->block_s : 0;
    out->load_seconds = kt->hist;
    pthread_mutex_unlock(&kt->lock);
}
