/*
 * dense: the honest baseline behind the same sequence interface as the paged pool.
 *
 * Each sequence owns one contiguous buffer laid out [layer][K|V][kv_head][capacity][dim]
 * and grown in 256-token steps by realloc (then each head row moves to its new offset:
 * the copy-on-grow every dense KV cache pays). Prefix reuse is by copying: full blocks
 * are keyed exactly like the pool's (chained SHA-256), the key -> (buffer, block) map
 * covers live and finished buffers, and a new sequence copies the longest matching
 * prefix into its own buffer. Finished buffers with keyed blocks stay cached (LRU) until
 * the budget needs their memory or the cache is reset.
 *
 * Locking: one mutex guards the key table, the LRU list, buffer membership and the
 * counters. Buffers are malloc'ed and freed outside it; the prefix copy runs under it
 * (the source may otherwise be evicted) — acceptable for a baseline.
 */
#include "kv/kv_int.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define DENSE_STEP 256u
#define DENSE_HTAB 4096u

typedef struct dense_buf dense_buf_t;

typedef struct dense_key {
    pkv_kv_key_t key;
    dense_buf_t *buf;
    uint32_t block;
    struct dense_key *next; /* hash chain */
} dense_key_t;

struct dense_buf {
    uint8_t *data;
    uint32_t cap;       /* tokens */
    dense_key_t **keys; /* keys of this buffer that are in the table */
    uint32_t n_keys, keys_cap;
    bool cached;
    dense_buf_t *lru_prev, *lru_next;
};

typedef struct dense_seq {
    struct pkv_seq base;
    dense_buf_t *buf;
} dense_seq_t;

typedef struct {
    struct pkv_kv base;
    uint64_t budget;
    bool prefix_cache;
    pthread_mutex_t lock; /* guards everything below */
    dense_key_t *htab[DENSE_HTAB];
    dense_buf_t *lru_head, *lru_tail; /* cached buffers, head = oldest */
    uint64_t committed, peak, cached_bytes;
    uint64_t n_seqs, live_tokens, n_cached_bufs;
    uint64_t q_count, q_tokens, hit_tokens, evictions, copies, rej_nofit, rej_nospace;
} dense_t;

static const kv_ops_t dense_ops;

static inline dense_t *dense_of(const pkv_kv_t *kv)
{
    return (dense_t *)kv;
}

static inline size_t buf_bytes(const dense_t *d, uint32_t cap)
{
    return (size_t)cap * d->base.token_bytes;
}

static uint32_t step_up(uint32_t n)
{
    return PKV_ALIGN_UP(PKV_MAX(n, 1u), DENSE_STEP);
}

static dense_key_t *key_find(dense_t *d, const pkv_kv_key_t *key)
{
    for (dense_key_t *e = d->htab[kv_key_hash(key) % DENSE_HTAB]; e; e = e->next)
        if (kv_key_eq(&e->key, key)) return e;
    return NULL;
}

static void key_unlink(dense_t *d, dense_key_t *e)
{
    dense_key_t **link = &d->htab[kv_key_hash(&e->key) % DENSE_HTAB];
    while (*link != e) link = &(*link)->next;
    *link = e->next;
}

static void lru_remove(dense_t *d, dense_buf_t *b)
{
    if (b->lru_prev)
        b->lru_prev->lru_next = b->lru_next;
    else
        d->lru_head = b->lru_next;
    if (b->lru_next)
        b->lru_next->lru_prev = b->lru_prev;
    else
        d->lru_tail = b->lru_prev;
    b->lru_prev = b->lru_next = NULL;
}

static void lru_push(dense_t *d, dense_buf_t *b)
{
    b->lru_next = NULL;
    b->lru_prev = d->lru_tail;
    if (d->lru_tail)
        d->lru_tail->lru_next = b;
    else
        d->lru_head = b;
    d->lru_tail = b;
}

/* Detach a buffer from the table (and the LRU if cached). Lock held. The caller frees
 * it with buf_free after unlocking. */
static void buf_detach(dense_t *d, dense_buf_t *b)
{
    for (uint32_t i = 0; i < b->n_keys; i++) key_unlink(d, b->keys[i]);
    if (b->cached) {
        lru_remove(d, b);
        d->cached_bytes -= buf_bytes(d, b->cap);
        d->n_cached_bufs--;
    }
    d->committed -= buf_bytes(d, b->cap);
}

static void buf_free(dense_buf_t *b)
{
    if (!b) return;
    for (uint32_t i = 0; i < b->n_keys; i++) free(b->keys[i]);
    free(b->keys);
    free(b->data);
    free(b);
}

/* Make room for `need` more bytes by evicting cached buffers (not `keep`). Lock held.
 * Evicted buffers are chained on *evicted (via lru_next) for freeing after unlock. */
static int dense_make_room(dense_t *d, uint64_t need, const dense_buf_t *keep,
                           dense_buf_t **evicted)
{
    if (!d->budget) return PKV_OK;
    uint64_t keep_bytes = keep && keep->cached ? buf_bytes(d, keep->cap) : 0;
    if (d->committed - (d->cached_bytes - keep_bytes) + need > d->budget) {
        d->rej_nospace++;
        return PKV_ERR_NOSPACE;
    }
    for (dense_buf_t *b = d->lru_head, *next; b && d->committed + need > d->budget; b = next) {
        next = b->lru_next;
        if (b == keep) continue;
        buf_detach(d, b);
        d->evictions++;
        b->lru_next = *evicted;
        *evicted = b;
    }
    return PKV_OK;
}

static void free_evicted(dense_buf_t *list)
{
    while (list) {
        dense_buf_t *next = list->lru_next;
        buf_free(list);
        list = next;
    }
}

static void dense_note(dense_t *d, uint64_t add)
{
    d->committed += add;
    if (d->committed > d->peak) d->peak = d->committed;
}

static int dense_nofit(dense_t *d, uint64_t bytes)
{
    d->rej_nofit++;
    PKV_LOGW("dense", "request can never fit: needs %llu blocks (%llu bytes), budget %llu bytes",
             (unsigned long long)PKV_DIV_UP(bytes, d->base.block_bytes), (unsigned long long)bytes,
             (unsigned long long)d->budget);
    return PKV_ERR_NOFIT;
}

/* Copy positions [0, n) of every row from src to dst (row strides differ). */
static void rows_copy(const dense_t *d, uint8_t *dst, uint32_t dst_cap, const uint8_t *src,
                      uint32_t src_cap, uint32_t n)
{
    const pkv_geometry_t *g = &d->base.geo;
    size_t rows = 2ull * g->layers * g->kv_heads, tok = d->base.row_bytes;
    for (size_t r = 0; r < rows; r++)
        memcpy(dst + r * dst_cap * tok, src + r * src_cap * tok, n * tok);
}

static int dense_seq_create(pkv_kv_t *kv, const pkv_seq_params_t *prm, pkv_seq_t **out,
                            uint32_t *n_cached)
{
    dense_t *d = dense_of(kv);
    uint32_t T = kv->geo.block_tokens;
    uint32_t cap = step_up(PKV_MAX(prm->reserve_tokens, prm->n_tokens));
    uint64_t bytes = buf_bytes(d, cap);
    int rc;
    if (d->budget && bytes > d->budget) {
        pthread_mutex_lock(&d->lock);
        rc = dense_nofit(d, bytes);
        pthread_mutex_unlock(&d->lock);
        return rc;
    }
    uint32_t nk = d->prefix_cache ? (prm->n_tokens - 1) / T : 0;
    pkv_kv_key_t *keys = nk ? kv_malloc((size_t)nk * sizeof(*keys)) : NULL;
    dense_seq_t *s = kv_calloc(1, sizeof(*s));
    dense_buf_t *b = kv_calloc(1, sizeof(*b));
    dense_buf_t *evicted = NULL;
    rc = PKV_ERR_NOMEM;
    if ((nk && !keys) || !s || !b || !(b->data = kv_malloc(bytes))) goto fail;
    if ((rc = kv_seq_base_init(&s->base, kv, prm->salt))) goto fail;
    b->cap = cap;
    nk = nk ? pkv_kv_prefix_keys(kv, prm->salt, prm->tokens, prm->n_tokens, keys) : 0;

    pthread_mutex_lock(&d->lock);
    uint32_t hits = 0;
    dense_key_t *src = NULL;
    for (dense_key_t *e; hits < nk && (e = key_find(d, &keys[hits])); hits++) src = e;
    rc = dense_make_room(d, bytes, src ? src->buf : NULL, &evicted);
    if (rc) {
        pthread_mutex_unlock(&d->lock);
        goto fail;
    }
    if (hits) {
        PKV_ASSERT(src->block == hits - 1);
        rows_copy(d, b->data, cap, src->buf->data, src->buf->cap, hits * T);
        if (src->buf->cached) {
            lru_remove(d, src->buf);
            lru_push(d, src->buf);
        }
        s->base.last_key = keys[hits - 1];
    }
    dense_note(d, bytes);
    d->n_seqs++;
    d->live_tokens += hits * T;
    d->q_count++;
    d->q_tokens += prm->n_tokens;
    d->hit_tokens += (uint64_t)hits * T;
    pthread_mutex_unlock(&d->lock);
    free_evicted(evicted);
    free(keys);
    s->buf = b;
    s->base.length = hits * T;
    s->base.capacity = cap;
    *out = &s->base;
    if (n_cached) *n_cached = hits * T;
    return PKV_OK;
fail:
    free_evicted(evicted);
    if (s) kv_seq_base_fini(&s->base);
    free(s);
    buf_free(b);
    free(keys);
    return rc;
}

static uint32_t dense_prefix_match(pkv_kv_t *kv, const pkv_kv_key_t *keys, uint32_t n)
{
    dense_t *d = dense_of(kv);
    if (!d->prefix_cache) return 0;
    pthread_mutex_lock(&d->lock);
    uint32_t hits = 0;
    while (hits < n && key_find(d, &keys[hits])) hits++;
    pthread_mutex_unlock(&d->lock);
    return hits;
}

static void dense_seq_free(pkv_seq_t *seq)
{
    dense_seq_t *s = (dense_seq_t *)seq;
    dense_t *d = dense_of(seq->kv);
    dense_buf_t *b = s->buf, *drop = NULL;
    pthread_mutex_lock(&d->lock);
    d->n_seqs--;
    d->live_tokens -= seq->length;
    if (d->prefix_cache && b->n_keys) {
        b->cached = true;
        lru_push(d, b);
        d->cached_bytes += buf_bytes(d, b->cap);
        d->n_cached_bufs++;
    } else {
        buf_detach(d, b);
        drop = b;
    }
    pthread_mutex_unlock(&d->lock);
    buf_free(drop);
    kv_seq_base_fini(&s->base);
    free(s);
}

static int dense_seq_reserve(pkv_seq_t *seq, uint32_t n_tokens)
{
    dense_seq_t *s = (dense_seq_t *)seq;
    dense_t *d = dense_of(seq->kv);
    dense_buf_t *b = s->buf, *evicted = NULL;
    uint32_t old = b->cap, cap = step_up(n_tokens);
    uint64_t add = buf_bytes(d, cap) - buf_bytes(d, old);
    int rc;
    pthread_mutex_lock(&d->lock);
    if (d->budget && buf_bytes(d, cap) > d->budget) {
        rc = dense_nofit(d, buf_bytes(d, cap));
    } else {
        rc = dense_make_room(d, add, NULL, &evicted);
        if (!rc) dense_note(d, add); /* counted before the realloc: never above budget */
    }
    pthread_mutex_unlock(&d->lock);
    free_evicted(evicted);
    if (rc) return rc;
    uint8_t *data = kv_realloc(b->data, buf_bytes(d, cap));
    if (!data) {
        pthread_mutex_lock(&d->lock);
        d->committed -= add;
        pthread_mutex_unlock(&d->lock);
        return PKV_ERR_NOMEM;
    }
    /* Spread the rows out, last first, so no row overwrites one not yet moved. */
    const pkv_geometry_t *g = &seq->kv->geo;
    size_t rows = 2ull * g->layers * g->kv_heads, tok = seq->kv->row_bytes;
    for (size_t r = rows; r-- > 1;) memmove(data + r * cap * tok, data + r * old * tok, old * tok);
    b->data = data;
    b->cap = cap;
    seq->capacity = cap;
    return PKV_OK;
}

static void dense_publish(struct pkv_seq *seq, uint32_t block, const pkv_kv_key_t *key,
                          const pkv_kv_key_t *parent, void *arg)
{
    dense_seq_t *s = (dense_seq_t *)seq;
    dense_t *d = arg;
    dense_buf_t *b = s->buf;
    if (!d->prefix_cache) return;
    if (b->n_keys == b->keys_cap) {
        uint32_t cap = b->keys_cap ? b->keys_cap * 2 : 16;
        dense_key_t **k = kv_realloc(b->keys, cap * sizeof(*k));
        if (!k) return; /* the block just stays unshared */
        b->keys = k;
        b->keys_cap = cap;
    }
    dense_key_t *e = kv_malloc(sizeof(*e));
    if (!e) return;
    e->key = *key;
    e->buf = b;
    e->block = block;
    pthread_mutex_lock(&d->lock);
    if (key_find(d, key)) {
        pthread_mutex_unlock(&d->lock);
        free(e);
        return;
    }
    dense_key_t **head = &d->htab[kv_key_hash(key) % DENSE_HTAB];
    e->next = *head;
    *head = e;
    b->keys[b->n_keys++] = e;
    pthread_mutex_unlock(&d->lock);
}

static int dense_seq_append(pkv_seq_t *seq, const int32_t *tokens, uint32_t n)
{
    dense_t *d = dense_of(seq->kv);
    kv_seq_base_append(seq, tokens, n, dense_publish, d);
    pthread_mutex_lock(&d->lock);
    d->live_tokens += n;
    pthread_mutex_unlock(&d->lock);
    return PKV_OK;
}

static int dense_seq_fork(pkv_seq_t *parent, pkv_seq_t **out)
{
    dense_seq_t *ps = (dense_seq_t *)parent;
    dense_t *d = dense_of(parent->kv);
    uint32_t cap = ps->buf->cap;
    dense_seq_t *s = kv_calloc(1, sizeof(*s));
    dense_buf_t *b = kv_calloc(1, sizeof(*b)), *evicted = NULL;
    int rc = PKV_ERR_NOMEM;
    if (!s || !b || !(b->data = kv_malloc(buf_bytes(d, cap)))) goto fail;
    if ((rc = kv_seq_base_init(&s->base, parent->kv, parent->salt))) goto fail;
    kv_seq_base_copy(&s->base, parent);
    b->cap = cap;
    pthread_mutex_lock(&d->lock);
    rc = dense_make_room(d, buf_bytes(d, cap), NULL, &evicted);
    if (!rc) {
        dense_note(d, buf_bytes(d, cap));
        d->n_seqs++;
        d->live_tokens += parent->length;
        d->copies++;
    }
    pthread_mutex_unlock(&d->lock);
    free_evicted(evicted);
    if (rc) goto fail;
    memcpy(b->data, ps->buf->data, buf_bytes(d, cap));
    s->buf = b;
    *out = &s->base;
    return PKV_OK;
fail:
    if (s) kv_seq_base_fini(&s->base);
    free(s);
    buf_free(b);
    return rc;
}

static void dense_seq_slot(const pkv_seq_t *seq, uint32_t pos, uint32_t layer, void **k, void **v,
                           size_t *head_stride)
{
    const dense_buf_t *b = ((const dense_seq_t *)seq)->buf;
    const pkv_geometry_t *g = &seq->kv->geo;
    size_t row = seq->kv->row_bytes, H = g->kv_heads, cap = b->cap;
    uint8_t *base = b->data + (((size_t)layer * 2 * H) * cap + pos) * row;
    *k = base;
    *v = base + H * cap * row;
    *head_stride = cap * row;
}

static uint32_t dense_seq_runs(const pkv_seq_t *seq, uint32_t layer, uint32_t begin, uint32_t end,
                               pkv_kv_run_t *out, uint32_t max, uint32_t *next)
{
    void *k, *v;
    size_t hs;
    dense_seq_slot(seq, begin, layer, &k, &v, &hs);
    out[0] =
        (pkv_kv_run_t){.k = k, .v = v, .pos = begin, .n_tokens = end - begin, .head_stride = hs};
    if (next) *next = end;
    return 1;
}

static void dense_reset_cache(pkv_kv_t *kv)
{
    dense_t *d = dense_of(kv);
    dense_buf_t *evicted = NULL;
    pthread_mutex_lock(&d->lock);
    while (d->lru_head) {
        dense_buf_t *b = d->lru_head;
        buf_detach(d, b);
        d->evictions++;
        b->lru_next = evicted;
        evicted = b;
    }
    pthread_mutex_unlock(&d->lock);
    free_evicted(evicted);
}

static void dense_stats(pkv_kv_t *kv, pkv_kv_stats_t *o)
{
    dense_t *d = dense_of(kv);
    pthread_mutex_lock(&d->lock);
    o->committed_bytes = d->committed;
    o->peak_committed_bytes = d->peak;
    o->budget_bytes = d->budget;
    o->block_bytes = kv->block_bytes;
    o->token_bytes = kv->token_bytes;
    o->blocks_capacity = d->budget ? d->budget / kv->block_bytes : 0;
    o->blocks_cached = d->cached_bytes / kv->block_bytes;
    o->blocks_live = (d->committed - d->cached_bytes) / kv->block_bytes;
    o->live_tokens = d->live_tokens;
    o->sequences = d->n_seqs;
    o->prefix_queries = d->q_count;
    o->prefix_query_tokens = d->q_tokens;
    o->prefix_hit_tokens = d->hit_tokens;
    o->evictions = d->evictions;
    o->cow_copies = d->copies;
    o->rejected_nofit = d->rej_nofit;
    o->rejected_nospace = d->rej_nospace;
    pthread_mutex_unlock(&d->lock);
}

static int dense_validate(pkv_kv_t *kv)
{
    dense_t *d = dense_of(kv);
    int rc = PKV_OK;
    pthread_mutex_lock(&d->lock);
    uint64_t cached = 0, n = 0;
    for (dense_buf_t *b = d->lru_head; b; b = b->lru_next, n++) {
        cached += buf_bytes(d, b->cap);
        for (uint32_t i = 0; i < b->n_keys; i++)
            if (key_find(d, &b->keys[i]->key) != b->keys[i] || b->keys[i]->buf != b)
                rc = PKV_ERR_CORRUPT;
    }
    if (cached != d->cached_bytes || n != d->n_cached_bufs || d->committed < cached ||
        (d->budget && d->committed > d->budget))
        rc = PKV_ERR_CORRUPT;
    if (rc) PKV_LOGE("dense", "validate: cache accounting drift");
    pthread_mutex_unlock(&d->lock);
    return rc;
}

static void dense_destroy(pkv_kv_t *kv)
{
    dense_t *d = dense_of(kv);
    PKV_ASSERT(d->n_seqs == 0);
    dense_reset_cache(kv);
    pthread_mutex_destroy(&d->lock);
    free(d);
}

int kv_dense_create(const pkv_kv_config_t *cfg, pkv_kv_t **out)
{
    dense_t *d = kv_calloc(1, sizeof(*d));
    if (!d) return PKV_ERR_NOMEM;
    kv_base_init(&d->base, cfg, &dense_ops);
    d->budget = cfg->budget_bytes;
    d->prefix_cache = !cfg->no_prefix_cache;
    if (pthread_mutex_init(&d->lock, NULL) != 0) {
        free(d);
        return PKV_ERR_NOMEM;
    }
    *out = &d->base;
    return PKV_OK;
}

static const kv_ops_t dense_ops = {
    .destroy = dense_destroy,
    .seq_create = dense_seq_create,
    .seq_free = dense_seq_free,
    .seq_reserve = dense_seq_reserve,
    .seq_append = dense_seq_append,
    .seq_fork = dense_seq_fork,
    .seq_slot = dense_seq_slot,
    .seq_runs = dense_seq_runs,
    .reset_cache = dense_reset_cache,
    .prefix_match = dense_prefix_match,
    .stats = dense_stats,
    .validate = dense_validate,
    /* no block access: pkv_seq_blocks and pkv_kv_pin answer PKV_ERR_UNSUPPORTED */
};
