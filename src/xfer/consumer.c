/*
 * xfer consumer: pkv_xfer_read and its state machine (progress thread).
 *
 *   QUEUED --admit--> SEATING --staging seated--> READING --all layers stored--> DONE(ok)
 *      any state --deadline | cancel | peer lost | FAIL | corrupt | shutdown--> DONE(...)
 *
 * SEATING   connect to the producer (or reuse the endpoint), take this transfer's
 *           staging pages on a seat thread, waiting at most until the deadline.
 * READING   every chunk's tag receive is posted into staging, then READ (token, nonce,
 *           plan, head range, the time left) goes to the producer — only once its HELLO
 *           came, its layout is compatible with ours and its rank holds the read's heads
 *           (else rejected, why LAYOUT) and, when the read names the producer's identity,
 *           that matched. A layer whose chunks have
 *           all arrived and whose MAC has (its DATA; for a small read, one stream, the
 *           trailer in the last chunk) is copied staging -> pool, MACed on the way; a
 *           mismatch ends the read corrupt. When every layer is stored the consumer sends
 *           ACK and the read ends ok. A token-only release (no blocks) skips staging and
 *           receives: READ RELEASE, and the producer's ACK ends it ok.
 * DONE      the outcome is delivered at once (condvar + callback); local failures send
 *           FAIL to the producer. Posted receives are cancelled, a waiting seat is
 *           cancelled in the stage, running copies see `abort`. The read quiesces when no
 *           seat, copy or receive refers to it: staging is released, pins dropped, the
 *           agent's reference dropped. For ok, that happens before delivery.
 */
#include "xfer/sum.h"
#include "xfer/xfer_int.h"

#include <endian.h>
#include <stdio.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

enum { LF_HEADER = 1, LF_QUEUED = 2, LF_STORED = 4 };

static void send_read(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd);
static void post_recvs(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd);
static pkv_xfer_read_t *find_read(pkv_xfer_agent_t *a, xf_peer_t *p, uint64_t xfer_id);

static void read_free_mem(pkv_xfer_read_t *rd)
{
    if (rd->chunks)
        for (uint32_t c = 0; c < rd->v.n_chunks; c++) free(rd->chunks[c].iov);
    if (rd->layer_pieces)
        for (uint32_t l = 0; l < rd->v.layers; l++) free(rd->layer_pieces[l]);
    free(rd->layer_pieces);
    free(rd->layer_npieces);
    xf_view_fini(&rd->v);
    free(rd->chunks);
    free(rd->src_blocks);
    free(rd->layer_chunks);
    free(rd->layer_flags);
    free(rd->layer_mac);
    free(rd->ev_layer);
    free(rd->job_layer);
    pthread_cond_destroy(&rd->cv);
    pthread_mutex_destroy(&rd->mu);
    free(rd);
}

void xf_read_unref(pkv_xfer_read_t *rd)
{
    if (atomic_fetch_sub(&rd->refs, 1) == 1) read_free_mem(rd);
}

/* ---- API ---------------------------------------------------------------------------------- */
static bool geo_equal(const pkv_geometry_t *x, const pkv_geometry_t *y)
{
    return x->layers == y->layers && x->kv_heads == y->kv_heads && x->head_dim == y->head_dim &&
           x->block_tokens == y->block_tokens && x->dtype == y->dtype;
}

/* A handle this agent can read from: a host:port address, the pool's geometry, and
 * the agent not stopping. */
static int read_check(pkv_xfer_agent_t *a, const pkv_xfer_handle_t *h)
{
    if (!xf_wire_addr_valid(h->addr)) {
        PKV_LOGW(XF_MOD, "read: handle address '%.*s' is not host:port", PKV_XFER_ADDR_MAX - 1,
                 h->addr);
        return PKV_ERR_INVALID;
    }
    if (!geo_equal(&h->geo, &a->geo)) {
        PKV_LOGW(XF_MOD,
                 "read: request %llu geometry (%u layers, %u heads, %u dim, %u tokens) "
                 "differs from the local pool's",
                 (unsigned long long)h->request_id, h->geo.layers, h->geo.kv_heads, h->geo.head_dim,
                 h->geo.block_tokens);
        return PKV_ERR_INVALID;
    }
    pthread_mutex_lock(&a->lock);
    bool stopping = a->stopping;
    pthread_mutex_unlock(&a->lock);
    return stopping ? PKV_ERR_SHUTDOWN : PKV_OK;
}

/* The read's per-layer and per-chunk tables (read_free_mem frees them, all or some). */
static int read_tables(pkv_xfer_read_t *rd, uint32_t n)
{
    uint32_t L = rd->v.layers;
    rd->src_blocks = malloc(sizeof(uint32_t) * (n ? n : 1));
    rd->layer_chunks = calloc(L, sizeof(uint32_t));
    rd->layer_flags = calloc(L, 1);
    rd->layer_mac = calloc(L, XF_MAC_TAG_BYTES);
    rd->v.trailer = rd->layer_mac; /* a whole stream's MACs are received into it */
    rd->v.keys = malloc((size_t)L * XF_MAC_KEY_BYTES);
    rd->ev_layer = calloc(L, sizeof(xf_event_t));
    rd->job_layer = calloc(L, sizeof(xf_job_t));
    rd->chunks = calloc(rd->v.n_chunks ? rd->v.n_chunks : 1, sizeof(xf_chunk_t));
    rd->layer_pieces = calloc(L, sizeof(uint64_t *));
    rd->layer_npieces = calloc(L, sizeof(uint32_t));
    if (!rd->src_blocks || !rd->layer_chunks || !rd->layer_flags || !rd->layer_mac || !rd->v.keys ||
        !rd->ev_layer || !rd->job_layer || !rd->chunks || !rd->layer_pieces || !rd->layer_npieces)
        return PKV_ERR_NOMEM;
    return PKV_OK;
}

/* Options that pkv_xfer_read_ex accepts: indices strictly increasing within the handle,
 * a printable identity that fits HELLO, heads our rank holds, a read count and index. */
static int opts_check(const pkv_xfer_agent_t *a, const pkv_xfer_handle_t *h,
                      const pkv_xfer_read_opts_t *o, const uint32_t *dst, uint32_t n)
{
    if (n && !dst) return PKV_ERR_INVALID;
    if (o && o->head_n &&
        (o->head_lo < a->head_lo || (uint64_t)o->head_lo + o->head_n > a->head_lo + a->head_n)) {
        PKV_LOGW(XF_MOD, "read: heads [%u, %u) are not all held by this agent's rank %u ([%u, %u))",
                 o->head_lo, o->head_lo + o->head_n, a->rank, a->head_lo, a->head_lo + a->head_n);
        return PKV_ERR_INVALID;
    }
    if (o && (o->reads_total > PKV_XFER_MAX_READS || o->read_index >= PKV_MAX(o->reads_total, 1)))
        return PKV_ERR_INVALID;
    if (!o || !o->idx) {
        if (n && n != h->n_blocks) return PKV_ERR_INVALID;
    } else {
        for (uint32_t i = 0; i < n; i++)
            if (o->idx[i] >= h->n_blocks || (i && o->idx[i] <= o->idx[i - 1]))
                return PKV_ERR_INVALID;
    }
    if (o && o->identity && !xf_wire_text_ok(o->identity, XF_WIRE_MAX_IDENTITY))
        return PKV_ERR_INVALID;
    return PKV_OK;
}

int pkv_xfer_read(pkv_xfer_agent_t *a, const pkv_xfer_handle_t *h, const uint32_t *dst, uint32_t n,
                  uint64_t deadline_ns, pkv_xfer_done_fn fn, void *arg, pkv_xfer_read_t **out)
{
    if (!n) return PKV_ERR_INVALID; /* a token-only release is pkv_xfer_read_ex's */
    return pkv_xfer_read_ex(a, h, NULL, dst, n, deadline_ns, fn, arg, out);
}

/* The view of a read: its blocks, heads, chunks and staging pages; a release has none. */
static int read_view(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd, const pkv_xfer_handle_t *h,
                     const pkv_xfer_read_opts_t *o, const uint32_t *dst, uint32_t n)
{
    if (!n) {
        memset(&rd->v, 0, sizeof(rd->v));
        rd->v.layers = a->geo.layers;
        rd->v.chunk_bytes = a->cfg.chunk_bytes;
        atomic_init(&rd->v.abort, false);
        rd->release = true;
        return PKV_OK;
    }
    uint32_t head_lo = o && o->head_n ? o->head_lo : a->head_lo;
    uint32_t head_n = o && o->head_n ? o->head_n : a->head_n;
    /* bounded: slice bytes < 2^47 / layers, n <= 2^20 blocks (the view checks the limits) */
    bool small = xf_small(a, (uint64_t)n * xf_wire_slice_bytes(&a->geo, head_n) * a->geo.layers);
    uint32_t chunk =
        small ? PKV_MIN(a->cfg.chunk_bytes, PKV_XFER_WHOLE_CHUNK_BYTES) : a->cfg.chunk_bytes;
    int rc = xf_view_init(&rd->v, a, n, dst, chunk, small, head_lo, head_n);
    if (rc == PKV_ERR_NOFIT) {
        PKV_LOGW(XF_MOD, "read: request %llu (%u blocks) exceeds the transfer limits",
                 (unsigned long long)h->request_id, n);
        rc = PKV_ERR_INVALID;
    }
    return rc;
}

/* The read's fields from the handle and the options: the shared-arena choice, the
 * identity to check, which of the registration's reads this is, the source blocks, the
 * token and the handle's block digest. PKV_OK or the digest's error. */
static int read_from_handle(const pkv_xfer_agent_t *a, pkv_xfer_read_t *rd,
                            const pkv_xfer_handle_t *h, const pkv_xfer_read_opts_t *opts,
                            uint32_t n)
{
    /* Same host and boot: we may copy straight from the producer's shared arena. */
    rd->want_shared = n && h->local.present && !a->cfg.no_shared && a->have_boot_id &&
                      !memcmp(h->local.boot_id, a->boot_id, sizeof(a->boot_id));
    if (opts && opts->identity) {
        rd->check_identity = true;
        snprintf(rd->identity, sizeof(rd->identity), "%s", opts->identity);
    }
    rd->reads_total = opts && opts->reads_total ? opts->reads_total : 1;
    rd->read_index = opts ? opts->read_index : 0;
    rd->local_pid = h->local.pid;
    rd->local_fd = h->local.fd;
    rd->local_ino = h->local.ino;
    rd->local_bytes = h->local.arena_bytes;
    for (uint32_t i = 0; i < n; i++)
        rd->src_blocks[i] = h->blocks[opts && opts->idx ? opts->idx[i] : i];
    rd->request_id = h->request_id;
    memcpy(rd->token, h->token, sizeof(rd->token));
    int rc = xf_wire_blocks_digest(h->blocks, h->n_blocks, rd->digest);
    if (rc) return rc;
    snprintf(rd->addr, sizeof(rd->addr), "%s", h->addr);
    return PKV_OK;
}

/* Hand the built read to the agent (its destination blocks pinned): PKV_OK and *out, or
 * PKV_ERR_SHUTDOWN with the pins returned. */
static int read_enqueue(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd, const uint32_t *dst, uint32_t n,
                        pkv_xfer_read_t **out)
{
    pthread_mutex_lock(&a->lock);
    if (a->stopping) {
        pthread_mutex_unlock(&a->lock);
        if (n) pkv_kv_unpin(a->kv, dst, n);
        return PKV_ERR_SHUTDOWN;
    }
    rd->agent = a;
    rd->next_new = NULL;
    *out = rd; /* before the agent can see it: the callback may run before we return */
    *a->new_reads_tail = rd;
    a->new_reads_tail = &rd->next_new;
    a->busy++;
    XF_STAT_ADD(a, active_transfers, 1);
    pthread_mutex_unlock(&a->lock);
    XF_STAT_ADD(a, reads_started, 1);
    XF_STAT_ADD(a, pinned_blocks, n);
    xf_wake(a);
    return PKV_OK;
}

int pkv_xfer_read_ex(pkv_xfer_agent_t *a, const pkv_xfer_handle_t *h,
                     const pkv_xfer_read_opts_t *opts, const uint32_t *dst, uint32_t n,
                     uint64_t deadline_ns, pkv_xfer_done_fn fn, void *arg, pkv_xfer_read_t **out)
{
    if (!a || !h || !out || !deadline_ns || opts_check(a, h, opts, dst, n)) return PKV_ERR_INVALID;
    int rc = read_check(a, h);
    if (rc) return rc;

    rc = PKV_ERR_NOMEM;
    pkv_xfer_read_t *rd = calloc(1, sizeof(*rd));
    if (!rd) return PKV_ERR_NOMEM;
    if (pthread_mutex_init(&rd->mu, NULL)) goto fail_rd;
    if (pkv_cond_init_monotonic(&rd->cv)) goto fail_mu;
    rc = read_view(a, rd, h, opts, dst, n);
    if (rc) goto fail_cv;
    rc = PKV_ERR_NOMEM;
    if (read_tables(rd, n)) goto fail_mem;
    rc = read_from_handle(a, rd, h, opts, n);
    if (rc) goto fail_mem;
    rd->deadline_ns = deadline_ns;
    rd->fn = fn;
    rd->arg = arg;
    atomic_init(&rd->refs, 2); /* caller + agent */
    atomic_init(&rd->cancel_req, false);
    atomic_init(&rd->done, false);
    for (uint32_t c = 0; c < rd->v.n_chunks; c++) {
        rd->chunks[c].owner = rd;
        rd->chunks[c].index = c;
    }
    rc = n ? pkv_kv_pin(a->kv, dst, n) : PKV_OK;
    if (rc) {
        PKV_LOGW(XF_MOD, "read: request %llu: destination blocks not live (%s)",
                 (unsigned long long)h->request_id, pkv_status_str(rc));
        goto fail_mem;
    }
    rc = read_enqueue(a, rd, dst, n, out);
    if (rc) goto fail_mem;
    return PKV_OK;

fail_mem:
    read_free_mem(rd); /* the arrays are calloc'd or NULL: safe on a half-built read */
    return rc;
fail_cv:
    pthread_cond_destroy(&rd->cv);
fail_mu:
    pthread_mutex_destroy(&rd->mu);
fail_rd:
    free(rd);
    return rc;
}

int pkv_xfer_read_wait(pkv_xfer_read_t *rd, uint64_t wait_deadline_ns, int *outcome)
{
    if (!rd || !outcome) return PKV_ERR_INVALID;
    /* Poll briefly before sleeping (XF_WAIT_SPIN_NS): the outcome often comes sooner
     * than a sleeping thread can be woken. */
    uint64_t spin_end = PKV_MIN(pkv_now_ns() + XF_WAIT_SPIN_NS, wait_deadline_ns);
    while (!atomic_load_explicit(&rd->done, memory_order_acquire) && pkv_now_ns() < spin_end)
        sched_yield();
    pthread_mutex_lock(&rd->mu);
    while (!atomic_load(&rd->done) && wait_deadline_ns && pkv_now_ns() < wait_deadline_ns) {
        /* Recomputed each time: PKV_DEADLINE_NEVER maps to "an hour from now". */
        struct timespec ts = pkv_deadline_to_monotonic(wait_deadline_ns);
        pthread_cond_timedwait(&rd->cv, &rd->mu, &ts);
    }
    bool done = atomic_load(&rd->done);
    int oc = rd->outcome;
    pthread_mutex_unlock(&rd->mu);
    if (!done) return PKV_ERR_TIMEOUT;
    *outcome = oc;
    return PKV_OK;
}

pkv_xfer_why_t pkv_xfer_read_why(const pkv_xfer_read_t *rd)
{
    if (!rd) return PKV_XFER_WHY_NONE;
    pthread_mutex_t *mu = (pthread_mutex_t *)&rd->mu;
    pthread_mutex_lock(mu);
    pkv_xfer_why_t w = atomic_load(&rd->done) ? rd->why : PKV_XFER_WHY_NONE;
    pthread_mutex_unlock(mu);
    return w;
}

int pkv_xfer_read_timings(const pkv_xfer_read_t *rd, pkv_xfer_read_timings_t *out)
{
    if (!rd || !out) return PKV_ERR_INVALID;
    /* The [P] stamps are final before `done` is published (release). */
    if (!atomic_load_explicit(&rd->done, memory_order_acquire)) return PKV_ERR_BUSY;
    *out = (pkv_xfer_read_timings_t){.started_ns = rd->t_start,
                                     .connected_ns = rd->t_connected,
                                     .seated_ns = rd->t_seated,
                                     .requested_ns = rd->t_requested,
                                     .first_ns = rd->t_first,
                                     .last_ns = rd->t_last,
                                     .done_ns = rd->done_ns};
    return PKV_OK;
}

uint64_t pkv_xfer_read_bytes(const pkv_xfer_read_t *rd)
{
    if (!rd) return 0;
    pthread_mutex_t *mu = (pthread_mutex_t *)&rd->mu;
    pthread_mutex_lock(mu);
    uint64_t b = rd->bytes;
    pthread_mutex_unlock(mu);
    return b;
}

void pkv_xfer_cancel(pkv_xfer_read_t *rd)
{
    if (!rd) return;
    atomic_store(&rd->cancel_req, true);
    /* The agent may be gone (destroyed): then the read already has its outcome. The wake
     * happens under rd->mu: settle() clears rd->agent under it before the agent can go. */
    pthread_mutex_lock(&rd->mu);
    pkv_xfer_agent_t *a = atomic_load(&rd->done) ? NULL : rd->agent;
    if (a) xf_wake(a);
    pthread_mutex_unlock(&rd->mu);
}

void pkv_xfer_read_free(pkv_xfer_read_t *rd)
{
    if (!rd) return;
    pkv_xfer_cancel(rd);
    xf_read_unref(rd);
}

/* ---- state machine (progress thread) ------------------------------------------------------ */
/* The callback runs first, then waiters see the outcome: once pkv_xfer_read_wait
 * returns, the callback has returned too. */
static void deliver(pkv_xfer_read_t *rd, int outcome, uint64_t bytes)
{
    if (rd->fn) rd->fn(rd->arg, rd, outcome);
    pthread_mutex_lock(&rd->mu);
    rd->outcome = outcome;
    rd->bytes = bytes;
    atomic_store_explicit(&rd->done, true, memory_order_release); /* after outcome, bytes */
    pthread_cond_broadcast(&rd->cv);
    pthread_mutex_unlock(&rd->mu);
}

/* Return staging and pins once nothing refers to the read (idempotent). */
static bool quiesce(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd)
{
    if (rd->quiesced) return true;
    if (!rd->finished || rd->seat_pending || rd->jobs_pending || rd->recvs_inflight) return false;
    rd->quiesced = true;
    if (rd->v.grant) {
        /* After our own stage cancel raced a successful acquire, the stage has
         * already taken the pages back: CANCELLED or NOTFOUND are expected then. */
        int rc = pkv_stage_release(a->stage, rd->v.stage_id);
        if (rc && rc != PKV_ERR_CANCELLED && !(rc == PKV_ERR_NOTFOUND && rd->stage_cancelled))
            PKV_LOGW(XF_MOD, "read %llu: stage release: %s", (unsigned long long)rd->xfer_id,
                     pkv_status_str(rc));
        XF_STAT_SUB(a, staging_pages_held, rd->v.pages);
        pkv_stage_grant_free(rd->v.grant);
        rd->v.grant = NULL;
    }
    if (rd->v.n_blocks) pkv_kv_unpin(a->kv, rd->v.blocks, rd->v.n_blocks);
    XF_STAT_SUB(a, pinned_blocks, rd->v.n_blocks);
    if (rd->peer) rd->peer->refs--;
    rd->peer = NULL;
    for (pkv_xfer_read_t **pp = &a->reads; *pp; pp = &(*pp)->next)
        if (*pp == rd) {
            *pp = rd->next;
            break;
        }
    return true;
}

/* The last thing any handler does with a read: once it is finished and quiesced, the
 * agent lets go of it (which may free it). Never touch rd after calling this. */
static void settle(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd)
{
    if (!rd->finished || rd->released || rd->cancelling || !quiesce(a, rd)) return;
    rd->released = true;
    pthread_mutex_lock(&rd->mu);
    rd->agent = NULL;
    pthread_mutex_unlock(&rd->mu);
    xf_busy_add(a, -1);
    xf_read_unref(rd);
}

static int fail_reason(int outcome)
{
    return xf_wire_reason_valid(outcome) ? outcome : PKV_ERR_CANCELLED;
}

/* Decide the read's outcome (once). `tell` sends FAIL to the producer. The caller still
 * owns rd afterwards and must end with settle(). */
static void finish(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd, int outcome, bool tell,
                   const char *why)
{
    if (rd->finished) return;
    /* Layers stored here (a small read) end with streaming stores still draining, whatever
     * the outcome: they land before the outcome is told and the destination pins drop. */
    pkv_xfer_sum_fence();
    rd->finished = true;
    rd->state = XF_READ_DONE;
    rd->done_ns = pkv_now_ns(); /* the write-off clock in the tick counts from it */
    /* A READ posted before the endpoint was up left when it came up (or never). */
    if (rd->peer && rd->peer->established)
        rd->t_connected = PKV_MAX(rd->t_start, rd->peer->established_ns);
    rd->t_requested =
        rd->t_connected && rd->t_requested ? PKV_MAX(rd->t_requested, rd->t_connected) : 0;
    atomic_store(&rd->v.abort, true);
    if (outcome == PKV_OK && pkv_log_get_level() >= PKV_LOG_DEBUG) {
        if (rd->shared)
            PKV_LOGD(XF_MOD, "read %llu ok (shared arena): %llu bytes stored +%.2f ms",
                     (unsigned long long)rd->xfer_id,
                     (unsigned long long)(rd->v.layer_total * rd->v.layers),
                     (rd->done_ns - rd->t_start) / 1e6);
        else
            PKV_LOGD(XF_MOD,
                     "read %llu ok: %llu bytes; seated +%.2f ms, first chunk +%.2f, last chunk "
                     "+%.2f, stored +%.2f",
                     (unsigned long long)rd->xfer_id,
                     (unsigned long long)(rd->v.layer_total * rd->v.layers),
                     (rd->t_seated - rd->t_start) / 1e6, (rd->t_first - rd->t_start) / 1e6,
                     (rd->t_last - rd->t_start) / 1e6, (rd->done_ns - rd->t_start) / 1e6);
    }
    if (outcome != PKV_OK)
        PKV_LOGI(XF_MOD, "read %llu (request %llu from %s) ends %s: %s",
                 (unsigned long long)rd->xfer_id, (unsigned long long)rd->request_id, rd->addr,
                 pkv_status_str(outcome), why);
    if (tell && rd->read_sent && rd->peer && rd->peer->state == XF_PEER_ACTIVE)
        xf_send_fail(a, rd->peer, rd->xfer_id, rd->request_id, fail_reason(outcome), why);
    if (rd->seat_pending) {
        pkv_stage_cancel(a->stage, rd->v.stage_id);
        rd->stage_cancelled = true;
    }
    rd->cancel_recvs = rd->recvs_inflight > 0;
    int idx = pkv_xfer_outcome_index(outcome);
    XF_STAT_ADD(a, reads_done[idx < 0 ? 5 : idx], 1);
    uint64_t bytes = outcome == PKV_OK ? rd->v.layer_total * rd->v.layers : 0;
    if (outcome == PKV_OK) XF_STAT_ADD(a, bytes_received, bytes);
    quiesce(a, rd); /* for ok: staging and pins are back before the caller hears */
    deliver(rd, outcome, bytes);
}

/* Cancel every posted receive. A cancelled receive's callback may run inside
 * ucp_request_cancel; `cancelling` keeps it from letting go of rd mid-loop. Ends with
 * settle(): the caller must not touch rd afterwards. */
static void cancel_recvs(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd)
{
    rd->cancel_recvs = false;
    rd->cancelling = true;
    for (uint32_t c = 0; c < rd->v.n_chunks; c++) {
        void *req = rd->chunks[c].req;
        if (req) ucp_request_cancel(a->worker, req); /* completes with UCS_ERR_CANCELED */
    }
    rd->cancelling = false;
    settle(a, rd);
}

void xf_reads_admit(pkv_xfer_agent_t *a, pkv_xfer_read_t *list)
{
    while (list) {
        pkv_xfer_read_t *rd = list;
        list = rd->next_new;
        rd->next = a->reads;
        a->reads = rd;
        rd->xfer_id = xf_next_read_id(a);
        rd->v.stage_id = rd->xfer_id;
        rd->state = XF_READ_QUEUED;
        rd->t_start = a->now_ns;
        rd->peer = xf_peer_connect(a, rd->addr);
        if (!rd->peer) {
            finish(a, rd, PKV_ERR_PEER_LOST, false, "cannot create an endpoint to the producer");
            settle(a, rd);
            continue;
        }
        rd->peer->refs++;
        if (atomic_load(&rd->cancel_req)) {
            finish(a, rd, PKV_ERR_CANCELLED, false, "cancelled");
            settle(a, rd);
            continue;
        }
        /* This read's nonce (unique: the agent's random prefix and a counter) and with it
         * the layers' MAC keys, which only a holder of the token can derive too. */
        uint64_t ctr = atomic_fetch_add(&a->nonce_ctr, 1);
        for (int i = 0; i < 8; i++) {
            rd->nonce[i] = (uint8_t)(a->nonce_prefix >> (8 * i));
            rd->nonce[8 + i] = (uint8_t)(ctr >> (8 * i));
        }
        if (rd->release) { /* nothing to seat or receive */
            send_read(a, rd);
            settle(a, rd);
            continue;
        }
        if (xf_mac_keys(a->mac, rd->token, rd->nonce, rd->request_id, rd->v.n_blocks, rd->v.layers,
                        rd->v.head_lo, rd->v.head_n, rd->v.keys)) {
            finish(a, rd, PKV_ERR_NOFIT, false, "cannot derive the transfer's MAC keys");
            settle(a, rd);
            continue;
        }
        if (rd->want_shared)
            rd->arena = xf_peer_map_arena(rd->peer, rd->local_pid, rd->local_fd, rd->local_ino,
                                          rd->local_bytes);
        if (rd->arena) {
            /* No staging of our own: the producer's arena is the staging. */
            rd->shared = true;
            send_read(a, rd);
            settle(a, rd);
            continue;
        }
        rd->state = XF_READ_SEATING;
        rd->seat_pending = true;
        rd->job_seat.kind = XF_JOB_SEAT;
        rd->job_seat.is_serve = false;
        rd->job_seat.owner = rd;
        rd->ev_seated.kind = XF_EV_SEATED;
        rd->ev_seated.owner = rd;
        if (xf_seat_inline(a, rd->v.stage_id, rd->peer->id, rd->v.pages, &rd->ev_seated))
            xf_read_event(a, rd, &rd->ev_seated);
        else
            xf_job_post(a, &rd->job_seat, true);
    }
}

/* Seat thread. */
void xf_read_seat(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd)
{
    pkv_stage_grant_t *g = NULL;
    /* abortable: see xf_serve_seat (a cancel that came before the acquire parked). */
    int rc = pkv_stage_acquire_abortable(a->stage, rd->v.stage_id, rd->peer ? rd->peer->id : 0,
                                         rd->v.pages, rd->deadline_ns, &rd->v.abort, &g);
    rd->ev_seated.status = rc;
    rd->ev_seated.grant = rc == PKV_OK ? g : NULL;
    xf_event_post(a, &rd->ev_seated);
}

/* Store layer l (staging or the producer's arena -> pool) and check it against the
 * MAC its DATA or the stream's trailer carried: PKV_OK or PKV_ERR_CORRUPT. */
static int store_layer(pkv_xfer_agent_t *a, xf_mac_t *m, pkv_xfer_read_t *rd, uint32_t l)
{
    uint32_t k = rd->v.whole ? 0 : l; /* a whole stream's pieces are all in [0] */
    uint8_t tag[XF_MAC_TAG_BYTES];
    bool ok = rd->shared ? xf_view_copy_layer_from(&rd->v, a, m, l, rd->arena, rd->layer_pieces[k],
                                                   rd->layer_npieces[k],
                                                   (uint64_t)(l - k) * rd->v.layer_total, tag)
                         : xf_view_copy_layer(&rd->v, a, m, l, false, tag);
    return ok && xf_mac_equal(tag, rd->layer_mac + XF_MAC_TAG_BYTES * l) ? PKV_OK : PKV_ERR_CORRUPT;
}

/* Copy worker: store layer l. */
void xf_read_job(pkv_xfer_agent_t *a, xf_mac_t *m, pkv_xfer_read_t *rd, uint32_t l)
{
    xf_event_t *ev = &rd->ev_layer[l];
    ev->status = atomic_load(&rd->v.abort) ? PKV_ERR_CANCELLED : store_layer(a, m, rd, l);
    pkv_xfer_sum_fence(); /* the layer's streaming stores land before the loop is told */
    xf_event_post(a, ev);
}

static void layer_stored(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd, uint32_t l, int status);

/* Layer l has its MAC (DATA or trailer) and every chunk: store it, here for a small transfer,
 * else on a copy worker. The caller ends with settle(). */
static void maybe_verify(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd, uint32_t l)
{
    uint8_t f = rd->layer_flags[l];
    if (rd->finished || !(f & LF_HEADER) || (f & LF_QUEUED) ||
        rd->layer_chunks[l] != rd->v.chunks_per_layer)
        return;
    rd->layer_flags[l] |= LF_QUEUED;
    if (xf_small(a, rd->v.layer_total * rd->v.layers)) {
        layer_stored(a, rd, l, store_layer(a, a->mac, rd, l));
        return;
    }
    xf_event_t *ev = &rd->ev_layer[l];
    ev->kind = XF_EV_VERIFIED;
    ev->owner = rd;
    ev->layer = l;
    xf_job_t *job = &rd->job_layer[l];
    job->kind = XF_JOB_VERIFY;
    job->owner = rd;
    job->layer = l;
    rd->jobs_pending++;
    xf_job_post(a, job, false);
}

static void fault(pkv_xfer_agent_t *a, pkv_xfer_fault_point_t pt, uint32_t layer)
{
    if (a->faults.fn) a->faults.fn(a->faults.arg, pt, layer);
}

static void recv_done(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info,
                      void *user_data)
{
    xf_chunk_t *ch = user_data;
    pkv_xfer_read_t *rd = ch->owner;
    pkv_xfer_agent_t *a = rd->agent;
    ch->req = NULL;
    ch->done = true;
    rd->recvs_inflight--;
    ucp_request_free(request);
    if (rd->finished) {
        /* cancelled by us, or completed after the read ended: nothing to do */
    } else if (status == UCS_OK) {
        uint64_t off, len;
        rd->t_last = a->now_ns;
        if (!rd->t_first) rd->t_first = rd->t_last;
        xf_chunk_span(&rd->v, ch->index, &off, &len);
        uint32_t l = ch->index / rd->v.chunks_per_layer;
        if (info->length != len) {
            finish(a, rd, PKV_ERR_CORRUPT, true, "payload chunk of the wrong length");
        } else if (rd->v.whole) {
            /* Chunks cross layers: every layer is in when every chunk is, and with the
             * last byte the trailer, every layer's MAC. */
            if (++rd->chunks_in == rd->v.n_chunks)
                for (l = 0; l < rd->v.layers && !rd->finished; l++) {
                    rd->layer_chunks[l] = 1;
                    rd->layer_flags[l] |= LF_HEADER;
                    fault(a, PKV_XFER_FAULT_READ_LAYER_RECEIVED, l);
                    maybe_verify(a, rd, l);
                }
        } else if (++rd->layer_chunks[l] == rd->v.chunks_per_layer) {
            fault(a, PKV_XFER_FAULT_READ_LAYER_RECEIVED, l);
            maybe_verify(a, rd, l);
        }
    } else if (status == UCS_ERR_MESSAGE_TRUNCATED) {
        finish(a, rd, PKV_ERR_CORRUPT, true, "payload chunk larger than planned");
    } else {
        char why[96];
        snprintf(why, sizeof(why), "payload receive failed: %s", ucs_status_string(status));
        finish(a, rd, PKV_ERR_PEER_LOST, false, why);
    }
    settle(a, rd);
}

/* Post every chunk's receive, then send READ. A receive can complete inside its post (a
 * matching message already waiting, even a bad one that ends the read): `cancelling`
 * keeps that completion's settle() from letting go of rd, and posting stops once the
 * read has finished. The caller settles. */
static void start_reading(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd)
{
    rd->cancelling = true;
    post_recvs(a, rd);
    rd->cancelling = false;
    if (!rd->finished) send_read(a, rd);
}

static void post_recvs(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd)
{
    xf_view_t *v = &rd->v;
    for (uint32_t c = 0; c < v->n_chunks && !rd->finished; c++) {
        xf_chunk_t *ch = &rd->chunks[c];
        uint64_t off, len;
        void *buf;
        size_t count;
        ucp_datatype_t dt;
        xf_chunk_span(v, c, &off, &len);
        if (xf_chunk_buffer(v, ch, off, len, &buf, &count, &dt)) {
            finish(a, rd, PKV_ERR_NOFIT, false, "out of memory posting receives");
            return;
        }
        ucp_request_param_t prm = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                            UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            .cb = {.recv = recv_done},
            .datatype = dt,
            .user_data = ch,
        };
        /* Counted before posting: a receive that completes at once runs recv_done inside
         * the call (NO_IMM_CMPL) and still returns the (then freed) request. */
        ch->done = false;
        rd->recvs_inflight++;
        void *req = ucp_tag_recv_nbx(a->worker, buf, count, xf_wire_data_tag(rd->xfer_id, c),
                                     UINT64_MAX, &prm);
        if (UCS_PTR_IS_ERR(req)) {
            rd->recvs_inflight--;
            char why[96];
            snprintf(why, sizeof(why), "posting a receive: %s",
                     ucs_status_string(UCS_PTR_STATUS(req)));
            finish(a, rd, PKV_ERR_NOFIT, false, why);
            return;
        }
        if (!req)
            rd->recvs_inflight--; /* completed without its callback (not with NO_IMM_CMPL) */
        else if (!ch->done)
            ch->req = req;
    }
}

/* The producer's identity is the one the read expects (or it expects none); false: the
 * read ended rejected. Before it matched, no READ (with the token) goes to the peer. */
static bool identity_ok(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd)
{
    if (!rd->check_identity || !strcmp(rd->peer->identity, rd->identity)) return true;
    char why[2 * XF_WIRE_MAX_IDENTITY + 64];
    snprintf(why, sizeof(why), "the producer presents identity '%s', not '%s'", rd->peer->identity,
             rd->identity);
    rd->why = PKV_XFER_WHY_IDENTITY;
    finish(a, rd, PKV_ERR_REJECTED, false, why);
    return false;
}

/* The producer's layout (its HELLO) is compatible with ours and its rank holds the read's
 * heads; false: the read ended rejected, why LAYOUT, and no READ (with the token) left. */
static bool layout_ok(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd)
{
    const xf_peer_t *p = rd->peer;
    char why[256];
    if (p->layout_bad) {
        snprintf(why, sizeof(why), "the producer's layout is incompatible: %s", p->layout_why);
    } else if (!rd->release && (rd->v.head_lo < p->layout.head_lo ||
                                (uint64_t)rd->v.head_lo + rd->v.head_n >
                                    (uint64_t)p->layout.head_lo + p->layout.head_n)) {
        snprintf(why, sizeof(why),
                 "the producer's rank %u of %u holds heads [%u, %u), not all of [%u, %u)",
                 p->layout.rank, p->layout.tp, p->layout.head_lo,
                 p->layout.head_lo + p->layout.head_n, rd->v.head_lo, rd->v.head_lo + rd->v.head_n);
    } else {
        return true;
    }
    rd->why = PKV_XFER_WHY_LAYOUT;
    finish(a, rd, PKV_ERR_REJECTED, false, why);
    return false;
}

/* Send READ with the time left; the read is READING from then on (READ waits for the
 * producer's HELLO: its layout, and its identity when the read checks it). */
static void send_read(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd)
{
    xf_view_t *v = &rd->v;
    uint64_t now = pkv_now_ns();
    if (now >= rd->deadline_ns) {
        finish(a, rd, PKV_ERR_TIMEOUT, false, "deadline passed while seating staging");
        return;
    }
    rd->state = XF_READ_READING;
    if (!rd->peer->hello_seen) {
        if (rd->peer->foreign_version) { /* no HELLO will come */
            char why[64];
            snprintf(why, sizeof(why), "wire version %u (this agent speaks %u)",
                     rd->peer->foreign_version, XF_WIRE_VERSION);
            finish(a, rd, PKV_ERR_REJECTED, false, why);
            return;
        }
        rd->read_deferred = true; /* xf_reads_on_hello comes back */
        return;
    }
    if (!identity_ok(a, rd) || !layout_ok(a, rd)) return;
    xf_wire_read_t r;
    memset(&r, 0, sizeof(r));
    r.xfer_id = rd->xfer_id;
    r.request_id = rd->request_id;
    memcpy(r.token, rd->token, sizeof(r.token));
    memcpy(r.nonce, rd->nonce, sizeof(r.nonce));
    memcpy(r.digest, rd->digest, sizeof(r.digest));
    r.budget_ns = PKV_MIN(rd->deadline_ns - now, XF_WIRE_MAX_BUDGET_NS);
    r.geo = a->geo;
    r.chunk_bytes = v->chunk_bytes;
    r.flags = rd->release
                  ? XF_WIRE_READ_RELEASE
                  : (rd->shared ? XF_WIRE_READ_SHARED : 0) | (v->whole ? XF_WIRE_READ_WHOLE : 0);
    r.head_lo = rd->release ? 0 : v->head_lo;
    r.head_n = rd->release ? 0 : v->head_n;
    r.reads_total = (uint16_t)rd->reads_total;
    r.read_index = (uint16_t)rd->read_index;
    uint32_t runs = xf_wire_count_runs(rd->src_blocks, v->n_blocks);
    size_t cap = xf_wire_read_bytes(runs), len;
    uint8_t *buf = malloc(cap);
    int rc =
        buf ? xf_wire_encode_read(&r, rd->src_blocks, v->n_blocks, buf, cap, &len) : PKV_ERR_NOMEM;
    if (rc == PKV_OK) rc = xf_ctl_send(a, rd->peer, buf, len);
    free(buf);
    if (rc == PKV_ERR_PEER_LOST) {
        finish(a, rd, PKV_ERR_PEER_LOST, false, "producer endpoint failed");
        return;
    }
    if (rc) {
        finish(a, rd, PKV_ERR_REJECTED, false, "the plan does not fit a READ message");
        return;
    }
    rd->read_sent = true;
    rd->t_requested = now;
}

void xf_reads_on_hello(pkv_xfer_agent_t *a, xf_peer_t *p)
{
    for (pkv_xfer_read_t *rd = a->reads, *next; rd; rd = next) {
        next = rd->next; /* settle may unlink rd */
        if (rd->peer != p || !rd->read_deferred || rd->finished) continue;
        rd->read_deferred = false;
        send_read(a, rd);
        settle(a, rd);
    }
}

void xf_reads_no_hello(pkv_xfer_agent_t *a, xf_peer_t *p, const char *why)
{
    for (pkv_xfer_read_t *rd = a->reads, *next; rd; rd = next) {
        next = rd->next; /* settle may unlink rd */
        if (rd->peer != p || !rd->read_deferred || rd->finished) continue;
        rd->read_deferred = false;
        finish(a, rd, PKV_ERR_REJECTED, false, why);
        settle(a, rd);
    }
}

/* The producer accepted a token-only release. */
void xf_read_on_ack(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_ack_t *k)
{
    pkv_xfer_read_t *rd = find_read(a, p, k->xfer_id);
    if (!rd || rd->finished) return;
    if (!rd->release || !rd->read_sent || k->request_id != rd->request_id || k->bytes) {
        XF_STAT_ADD(a, proto_errors, 1);
        finish(a, rd, PKV_ERR_REJECTED, true, "ACK for a read that is not a release");
    } else {
        finish(a, rd, PKV_OK, false, "released");
    }
    settle(a, rd);
}

static int seat_outcome(int rc)
{
    switch (rc) {
    case PKV_ERR_NOFIT:
    case PKV_ERR_TIMEOUT:
    case PKV_ERR_SHUTDOWN:
    case PKV_ERR_CANCELLED:
        return rc;
    default:
        return PKV_ERR_NOFIT; /* NOMEM, BUSY, INVALID: staging cannot seat it */
    }
}

/* Layer l was stored (status PKV_OK) or failed its checksum; the last one stored sends
 * ACK and ends the read ok. */
static void layer_stored(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd, uint32_t l, int status)
{
    if (rd->finished) return;
    if (status == PKV_ERR_CORRUPT) {
        char why[64];
        snprintf(why, sizeof(why), "layer %u checksum mismatch", l);
        finish(a, rd, PKV_ERR_CORRUPT, true, why);
        return;
    }
    rd->layer_flags[l] |= LF_STORED;
    if (++rd->layers_verified == rd->v.layers) {
        xf_wire_ack_t k = {.xfer_id = rd->xfer_id,
                           .request_id = rd->request_id,
                           .bytes = rd->v.layer_total * rd->v.layers};
        uint8_t buf[64];
        size_t len;
        if (xf_wire_encode_ack(&k, buf, sizeof(buf), &len) == PKV_OK)
            xf_ctl_send(a, rd->peer, buf, len);
        finish(a, rd, PKV_OK, false, "ok");
    }
}

void xf_read_event(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd, xf_event_t *ev)
{
    switch (ev->kind) {
    case XF_EV_SEATED:
        rd->seat_pending = false;
        rd->t_seated = a->now_ns;
        if (ev->status == PKV_OK) {
            XF_STAT_ADD(a, staging_pages_held, rd->v.pages);
            if (xf_view_set_grant(&rd->v, ev->grant)) {
                rd->v.grant = ev->grant; /* keep it reachable for release */
                finish(a, rd, PKV_ERR_NOFIT, true, "staging grant smaller than asked");
            } else if (!rd->finished) {
                start_reading(a, rd);
            }
        } else if (!rd->finished) {
            char why[96];
            snprintf(why, sizeof(why), "consumer staging for %u pages: %s", rd->v.pages,
                     pkv_status_str(ev->status));
            finish(a, rd, seat_outcome(ev->status), false, why);
        }
        break;
    case XF_EV_VERIFIED:
        rd->jobs_pending--;
        layer_stored(a, rd, ev->layer, ev->status);
        break;
    default:
        PKV_ASSERT(!"unexpected read event");
    }
    settle(a, rd);
}

static pkv_xfer_read_t *find_read(pkv_xfer_agent_t *a, xf_peer_t *p, uint64_t xfer_id)
{
    for (pkv_xfer_read_t *rd = a->reads; rd; rd = rd->next)
        if (rd->xfer_id == xfer_id && rd->peer == p) return rd;
    return NULL;
}

/* A shared DATA's pieces, each inside the arena we mapped: a copy the read keeps, or NULL
 * (out of memory or outside: both end the read). */
static uint64_t *arena_pieces(const pkv_xfer_read_t *rd, const xf_wire_data_t *d)
{
    uint64_t *pc = malloc(16 * (size_t)d->n_pieces);
    for (uint32_t i = 0; pc && i < d->n_pieces; i++) {
        xf_wire_data_piece(d, i, &pc[2 * i], &pc[2 * i + 1]);
        if (pc[2 * i] + pc[2 * i + 1] > rd->local_bytes) {
            free(pc);
            return NULL;
        }
    }
    return pc;
}

void xf_read_on_data(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_data_t *d)
{
    pkv_xfer_read_t *rd = find_read(a, p, d->xfer_id);
    if (!rd || rd->finished) return; /* late message for an ended read */
    bool shared_msg = d->flags & XF_WIRE_DATA_SHARED;
    bool all_msg = d->flags & XF_WIRE_DATA_LAYERS; /* whole stream: every layer at once */
    /* Shared: one DATA (LAYERS) for a whole stream, else one a layer. Through UCX: one a
     * layer, none for a whole stream (its checksums are the payload's trailer). */
    const char *bad = NULL;
    if (rd->v.whole && !rd->shared)
        bad = "DATA for a small read (its checksums come in its payload)";
    else if (rd->state != XF_READ_READING || !rd->read_sent || rd->release ||
             d->layer >= rd->v.layers || d->bytes != rd->v.layer_total ||
             (rd->layer_flags[d->layer] & LF_HEADER) || shared_msg != rd->shared ||
             all_msg != rd->v.whole || (all_msg && (d->layer != 0 || d->n_macs != rd->v.layers)))
        bad = "DATA message does not match the plan";
    if (bad) {
        XF_STAT_ADD(a, proto_errors, 1);
        finish(a, rd, PKV_ERR_CORRUPT, true, bad);
        settle(a, rd);
        return;
    }
    if (shared_msg) {
        uint64_t *pc = arena_pieces(rd, d);
        if (!pc) {
            XF_STAT_ADD(a, proto_errors, 1);
            finish(a, rd, PKV_ERR_CORRUPT, true, "shared DATA outside the producer's arena");
            settle(a, rd);
            return;
        }
        rd->layer_pieces[d->layer] = pc;
        rd->layer_npieces[d->layer] = d->n_pieces;
    }
    uint32_t first = d->layer, end = all_msg ? rd->v.layers : d->layer + 1;
    for (uint32_t l = first; l < end; l++) {
        rd->layer_flags[l] |= LF_HEADER;
        memcpy(rd->layer_mac + XF_MAC_TAG_BYTES * l, all_msg ? xf_wire_data_mac(d, l) : d->mac,
               XF_MAC_TAG_BYTES);
        if (!shared_msg) continue;
        rd->layer_chunks[l] = rd->v.chunks_per_layer; /* no payload messages */
        rd->t_last = a->now_ns;
        if (!rd->t_first) rd->t_first = rd->t_last;
        fault(a, PKV_XFER_FAULT_READ_LAYER_RECEIVED, l);
    }
    for (uint32_t l = first; l < end && !rd->finished; l++) maybe_verify(a, rd, l);
    settle(a, rd);
}

void xf_read_on_fail(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_fail_t *f)
{
    pkv_xfer_read_t *rd = find_read(a, p, f->xfer_id);
    if (!rd || rd->finished) return;
    int outcome = f->reason;
    if (outcome == PKV_ERR_SHUTDOWN) outcome = PKV_ERR_PEER_LOST; /* the producer went away */
    if (outcome == PKV_ERR_CANCELLED) outcome = PKV_ERR_REJECTED; /* it withdrew the request */
    char why[XF_WIRE_MAX_TEXT + 32];
    snprintf(why, sizeof(why), "producer: %s (%s)", pkv_status_str(f->reason), f->text);
    if (outcome == PKV_ERR_REJECTED && f->why == XF_WIRE_WHY_BLOCKS) rd->why = PKV_XFER_WHY_BLOCKS;
    if (outcome == PKV_ERR_REJECTED && f->why == XF_WIRE_WHY_LAYOUT) rd->why = PKV_XFER_WHY_LAYOUT;
    finish(a, rd, outcome, false, why);
    settle(a, rd);
}

/* A DATA of another wire version for this read: it ends rejected, and the FAIL (a layout
 * every version decodes) lets the producer go. */
void xf_read_on_foreign(pkv_xfer_agent_t *a, xf_peer_t *p, uint64_t xfer_id, const char *why)
{
    pkv_xfer_read_t *rd = find_read(a, p, xfer_id);
    if (!rd || rd->finished) return;
    finish(a, rd, PKV_ERR_REJECTED, true, why);
    settle(a, rd);
}

static bool read_tick(pkv_xfer_agent_t *a, void *t, uint64_t now)
{
    pkv_xfer_read_t *rd = t;
    if (!rd->finished) {
        if (atomic_load(&rd->cancel_req))
            finish(a, rd, PKV_ERR_CANCELLED, true, "cancelled");
        else if (now >= rd->deadline_ns)
            finish(a, rd, PKV_ERR_TIMEOUT, true, "deadline passed");
        settle(a, rd);
        return true;
    }
    if (rd->cancel_recvs) {
        cancel_recvs(a, rd);
        return true;
    }
    if (rd->zombie) return true;
    if (!rd->slow_logged && xf_since(now, rd->done_ns) > XF_CLOSE_WAIT_NS) {
        rd->slow_logged = true;
        PKV_LOGD(XF_MOD, "read %llu ended %.0f ms ago, still waiting: seat %d jobs %u recvs %u",
                 (unsigned long long)rd->xfer_id, xf_since(now, rd->done_ns) / 1e6,
                 rd->seat_pending, rd->jobs_pending, rd->recvs_inflight);
    }
    return !xf_xfer_stuck(a, &xf_side_reads, rd->peer, rd->xfer_id, rd->recvs_inflight, rd->done_ns,
                          now, &rd->zombie);
}

static void *read_head(pkv_xfer_agent_t *a)
{
    return a->reads;
}

static void *read_next(void *t)
{
    return ((pkv_xfer_read_t *)t)->next;
}

static xf_peer_t *read_peer(void *t)
{
    return ((pkv_xfer_read_t *)t)->peer;
}

static bool read_ended(void *t)
{
    return ((pkv_xfer_read_t *)t)->finished;
}

static void read_end(pkv_xfer_agent_t *a, void *t, int outcome, bool tell, const char *why)
{
    finish(a, t, outcome, tell, why);
    settle(a, t);
}

static bool read_moving(void *t)
{
    return ((pkv_xfer_read_t *)t)->state == XF_READ_READING;
}

const xf_side_t xf_side_reads = {
    .name = "read",
    .payload_ops = "receives",
    .lost_why = "producer lost",
    .shutdown_why = "consumer agent shutting down",
    .stuck_why = "payload receives stuck after the read ended",
    .kept = "",
    .head = read_head,
    .next = read_next,
    .peer = read_peer,
    .ended = read_ended,
    .end = read_end,
    .moving = read_moving,
    .tick = read_tick,
};
