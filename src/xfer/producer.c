/*
 * xfer producer: registrations (pkv_xfer_register) and the serve state machine that
 * answers a consumer's READ (progress thread).
 *
 *   READ --checks--> SEATING --staging seated--> SENDING --all chunks left--> WAIT_ACK
 *        --ACK--> DONE(ok): the registration counts as sent and ends
 *   any state --deadline | FAIL | peer lost | unregister | shutdown--> DONE(...)
 *
 * Checks before anything is allocated: the request is registered and live, the token
 * matches (constant time), the READ's digest of the handle's block ids is the
 * registration's (so ids a partial read or a release does not name are checked too), the
 * read index is one of the registration's reads_total (all READs agreeing on it) not being
 * served or acknowledged, the geometry equals ours and our rank holds the READ's heads
 * (else FAIL why LAYOUT), the planned blocks are registered blocks in registration order
 * (all of them, or a partial read's subset). A refusal is FAIL rejected. A READ with
 * RELEASE (no blocks) that passes them counts as one read, answered ACK: the token-only
 * release of a consumer that needs none of the blocks.
 * A registration may be read by several reads (reads_total: decode ranks that each need a
 * head slice), at once, from different consumers; it ends sent when every one of them was
 * acknowledged, and keeps its pins until then (or until its lease or unregister ends it).
 * SEATING   staging for the whole transfer on a seat thread, until the consumer's
 *           deadline (its remaining budget from READ, measured on our clock).
 * SENDING   one copy job stages layer after layer (pool -> staging, MACed under the keys
 *           of the token and the READ's nonce); as each layer is staged its chunks are
 *           posted as tag sends, at most max_inflight at a time, followed by the layer's
 *           DATA (its MAC) — copy and send overlap. A small read is one stream: its last
 *           chunk carries every layer's MAC (a trailer), no DATA; through the shared arena
 *           one DATA announces every layer.
 * WAIT_ACK  every send completed locally, which only means the bytes left this process.
 * Only ACK makes the request sent. On failure the serve stops posting, tells the
 * consumer (FAIL) unless the consumer told us, and quiesces once the copy job has
 * returned and every send has completed (sends to a lost peer complete when its
 * endpoint is force-closed); the registration becomes readable again unless it ended.
 */
#include "xfer/sum.h"
#include "xfer/xfer_int.h"

#include <endian.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static bool token_equal(const uint8_t *x, const uint8_t *y)
{
    volatile uint8_t d = 0;
    for (int i = 0; i < PKV_XFER_TOKEN_BYTES; i++) d |= x[i] ^ y[i];
    return d == 0;
}

/* Fault site PKV_FAULT_XFER_HANG: the progress thread stops until destroy begins. */
static void hang_until_destroy(pkv_xfer_agent_t *a)
{
    PKV_LOGW("xfer", "fault site: the agent at %s stops (PKV_FAULT_XFER_HANG)", a->addr);
    for (bool stop = false; !stop;) {
        nanosleep(&(struct timespec){0, 10000000}, NULL);
        pthread_mutex_lock(&a->lock);
        stop = a->stopping;
        pthread_mutex_unlock(&a->lock);
    }
}

static void fault(pkv_xfer_agent_t *a, pkv_xfer_fault_point_t pt, uint32_t layer)
{
    if (pt == PKV_XFER_FAULT_SERVE_LAYER_SENT && pkv_fault_hit(PKV_FAULT_XFER_HANG))
        hang_until_destroy(a);
    if (a->faults.fn) a->faults.fn(a->faults.arg, pt, layer);
}

/* ---- registrations --------------------------------------------------------------------- */
/* The table [L]: Fibonacci hashing spreads sequential request ids over the chains. */
static xf_reg_t **reg_chain(pkv_xfer_agent_t *a, uint64_t request_id)
{
    return &a->reg_tab[(request_id * 0x9e3779b97f4a7c15ull) >> (64 - a->reg_bits)];
}

static xf_reg_t *reg_find(pkv_xfer_agent_t *a, uint64_t request_id)
{
    if (!a->reg_tab) return NULL;
    xf_reg_t *r = *reg_chain(a, request_id);
    while (r && r->request_id != request_id) r = r->hnext;
    return r;
}

/* The table size a new registration needs: the current one while there is room. */
static uint32_t reg_bits_wanted(const pkv_xfer_agent_t *a)
{
    if (!a->reg_tab) return 6;
    return a->reg_count >= (1u << a->reg_bits) ? a->reg_bits + 1 : a->reg_bits;
}

/* Move every registration into `tab` (1 << bits chains) and the lease heap into `heap`
 * (as many slots); the old arrays go to *old_tab / *old_heap, for the caller to free once
 * it dropped the lock. */
static void reg_grow(pkv_xfer_agent_t *a, xf_reg_t **tab, xf_reg_t **heap, uint32_t bits,
                     xf_reg_t ***old_tab, xf_reg_t ***old_heap)
{
    xf_reg_t **old = a->reg_tab;
    uint32_t old_n = old ? 1u << a->reg_bits : 0;
    a->reg_tab = tab;
    a->reg_bits = bits;
    for (uint32_t i = 0; i < old_n; i++)
        for (xf_reg_t *x = old[i], *nx; x; x = nx) {
            nx = x->hnext;
            xf_reg_t **c = reg_chain(a, x->request_id);
            x->hnext = *c;
            *c = x;
        }
    if (a->reg_heap_n) memcpy(heap, a->reg_heap, sizeof(*heap) * a->reg_heap_n);
    *old_tab = old;
    *old_heap = a->reg_heap;
    a->reg_heap = heap;
}

/* The lease heap [L]: heap_at is 1 + the slot, kept current as entries move. */
static void heap_set(pkv_xfer_agent_t *a, uint32_t i, xf_reg_t *r)
{
    a->reg_heap[i] = r;
    r->heap_at = i + 1;
}

static void heap_fix(pkv_xfer_agent_t *a, uint32_t i)
{
    xf_reg_t **h = a->reg_heap, *r = h[i];
    while (i && h[(i - 1) / 2]->expiry_ns > r->expiry_ns) { /* up */
        heap_set(a, i, h[(i - 1) / 2]);
        i = (i - 1) / 2;
    }
    for (;;) { /* down */
        uint32_t c = 2 * i + 1;
        if (c >= a->reg_heap_n) break;
        if (c + 1 < a->reg_heap_n && h[c + 1]->expiry_ns < h[c]->expiry_ns) c++;
        if (h[c]->expiry_ns >= r->expiry_ns) break;
        heap_set(a, i, h[c]);
        i = c;
    }
    heap_set(a, i, r);
}

/* A registration with a lease joins the heap (room: the heap has as many slots as the
 * table has chains, and the table never holds more than that). */
static void heap_add(pkv_xfer_agent_t *a, xf_reg_t *r)
{
    if (r->heap_at || !r->in_tab || r->expiry_ns == PKV_DEADLINE_NEVER) return;
    PKV_ASSERT(a->reg_heap_n < (1u << a->reg_bits));
    heap_set(a, a->reg_heap_n++, r);
    heap_fix(a, a->reg_heap_n - 1);
}

static void heap_del(pkv_xfer_agent_t *a, xf_reg_t *r)
{
    if (!r->heap_at) return;
    uint32_t i = r->heap_at - 1;
    r->heap_at = 0;
    xf_reg_t *last = a->reg_heap[--a->reg_heap_n];
    if (last == r) return;
    heap_set(a, i, last);
    heap_fix(a, i);
}

static void reg_insert(pkv_xfer_agent_t *a, xf_reg_t *r)
{
    xf_reg_t **c = reg_chain(a, r->request_id);
    r->hnext = *c;
    *c = r;
    a->reg_count++;
    r->in_tab = true;
    heap_add(a, r);
}

/* Out of the table, the lease heap and the unregister list [L]. */
static void reg_remove(pkv_xfer_agent_t *a, xf_reg_t *r)
{
    heap_del(a, r);
    if (r->unregister_req && r->in_tab) /* on the unregister list until removed */
        for (xf_reg_t **pp = &a->reg_unreg; *pp; pp = &(*pp)->unext)
            if (*pp == r) {
                *pp = r->unext;
                break;
            }
    r->in_tab = false;
    for (xf_reg_t **pp = reg_chain(a, r->request_id); *pp; pp = &(*pp)->hnext)
        if (*pp == r) {
            *pp = r->hnext;
            a->reg_count--;
            return;
        }
}

static void reg_free(pkv_xfer_agent_t *a, xf_reg_t *r)
{
    pkv_kv_unpin(a->kv, r->blocks, r->n);
    XF_STAT_SUB(a, pinned_blocks, r->n);
    free(r->blocks);
    free(r->busy); /* done shares its allocation */
    free(r);
}

static bool bit_get(const uint64_t *m, uint32_t i)
{
    return m[i / 64] >> (i % 64) & 1;
}

static void bit_put(uint64_t *m, uint32_t i, bool on)
{
    if (on)
        m[i / 64] |= 1ull << (i % 64);
    else
        m[i / 64] &= ~(1ull << (i % 64));
}

/* The handle a consumer reads registration `r` with (and our shared arena, where a
 * consumer on this host and boot may map it). */
static void handle_fill(const pkv_xfer_agent_t *a, const xf_reg_t *r, pkv_xfer_handle_t *h)
{
    memset(h, 0, sizeof(*h));
    h->request_id = r->request_id;
    memcpy(h->token, r->token, sizeof(h->token));
    snprintf(h->addr, sizeof(h->addr), "%s", a->addr);
    h->geo = a->geo;
    if (a->arena_fd >= 0 && a->have_boot_id && a->arena_bytes <= XF_WIRE_MAX_ARENA) {
        /* Offer our shared staging arena to a consumer on this host. */
        h->local.present = true;
        h->local.pid = (uint32_t)getpid();
        h->local.fd = a->arena_fd;
        h->local.arena_bytes = a->arena_bytes;
        h->local.ino = a->arena_ino;
        memcpy(h->local.boot_id, a->boot_id, sizeof(h->local.boot_id));
    }
    h->n_blocks = r->n;
    memcpy(h->blocks, r->blocks, sizeof(uint32_t) * r->n);
}

int pkv_xfer_register(pkv_xfer_agent_t *a, uint64_t request_id, const uint32_t *blocks, uint32_t n,
                      uint64_t expiry_ns, pkv_xfer_sent_fn fn, void *arg, pkv_xfer_handle_t **out)
{
    if (!a || !blocks || !out || !n || n > XF_WIRE_MAX_BLOCKS) return PKV_ERR_INVALID;
    int rc = PKV_ERR_NOMEM;
    xf_reg_t *r = calloc(1, sizeof(*r));
    pkv_xfer_handle_t *h = malloc(sizeof(*h) + sizeof(uint32_t) * n);
    if (!r || !h) goto fail;
    r->blocks = malloc(sizeof(uint32_t) * n);
    if (!r->blocks) goto fail;
    memcpy(r->blocks, blocks, sizeof(uint32_t) * n);
    r->n = n;
    r->request_id = request_id;
    r->expiry_ns = expiry_ns;
    r->registered_ns = pkv_now_ns();
    r->fn = fn;
    r->arg = arg;
    if ((rc = xf_random(r->token, sizeof(r->token)))) goto fail;
    if ((rc = xf_wire_blocks_digest(blocks, n, r->digest))) goto fail;

    handle_fill(a, r, h);

    rc = pkv_kv_pin(a->kv, blocks, n);
    if (rc) goto fail;
    /* Nothing allocates under agent->lock: a bigger table is allocated outside it and
     * installed if the table still needs it (another register may have grown it). */
    xf_reg_t **tab = NULL, **heap = NULL, **old_tab = NULL, **old_heap = NULL;
    uint32_t tab_bits = 0;
    bool no_mem = false;
    pthread_mutex_lock(&a->lock);
    for (;;) { /* every pass re-checks under the lock: the lock was dropped to allocate */
        rc = a->stopping ? PKV_ERR_SHUTDOWN : reg_find(a, request_id) ? PKV_ERR_BUSY : PKV_OK;
        uint32_t want = reg_bits_wanted(a);
        if (rc || (a->reg_tab && want == a->reg_bits)) break;
        if (tab && heap && tab_bits == want) {
            reg_grow(a, tab, heap, want, &old_tab, &old_heap);
            tab = heap = NULL;
            break;
        }
        if (no_mem) { /* the lease heap has one slot per chain: a full table takes no more */
            rc = PKV_ERR_NOMEM;
            break;
        }
        pthread_mutex_unlock(&a->lock);
        free(tab);
        free(heap);
        tab_bits = want;
        tab = calloc((size_t)1 << want, sizeof(*tab));
        heap = malloc(sizeof(*heap) << want);
        no_mem = !tab || !heap;
        pthread_mutex_lock(&a->lock);
    }
    if (!rc) reg_insert(a, r);
    pthread_mutex_unlock(&a->lock);
    free(tab);
    free(heap);
    free(old_tab);
    free(old_heap);
    if (rc) {
        pkv_kv_unpin(a->kv, blocks, n);
        goto fail;
    }
    XF_STAT_ADD(a, pinned_blocks, n);
    XF_STAT_ADD(a, registered, 1);
    XF_STAT_ADD(a, registrations, 1);
    xf_wake(a); /* the loop watches the expiry */
    *out = h;
    return PKV_OK;
fail:
    if (r) free(r->blocks);
    free(r);
    free(h);
    return rc;
}

int pkv_xfer_unregister(pkv_xfer_agent_t *a, uint64_t request_id)
{
    if (!a) return PKV_ERR_INVALID;
    int rc = PKV_ERR_NOTFOUND;
    pthread_mutex_lock(&a->lock);
    xf_reg_t *r = reg_find(a, request_id);
    if (r && !r->unregister_req) {
        r->unregister_req = true;
        r->unext = a->reg_unreg;
        a->reg_unreg = r;
        rc = PKV_OK;
    }
    pthread_mutex_unlock(&a->lock);
    if (rc == PKV_OK) xf_wake(a);
    return rc;
}

static void serve_finish(pkv_xfer_agent_t *a, xf_serve_t *s, int outcome, bool tell,
                         const char *why);
static void serve_settle(pkv_xfer_agent_t *a, xf_serve_t *s);
static xf_reg_t *unlink_reg(pkv_xfer_agent_t *a, xf_reg_t *r);

/* End a registration already removed from the table. */
static void reg_end(pkv_xfer_agent_t *a, xf_reg_t *r, int outcome)
{
    r->ended = true;
    r->end_outcome = outcome;
    XF_STAT_SUB(a, registrations, 1);
    if (outcome == PKV_ERR_TIMEOUT) XF_STAT_ADD(a, expired, 1);
    if (!r->n_serving) {
        /* Nothing copies from its blocks: the pins go back before the callback, so a
         * caller that hears "ended" sees them returned. */
        pkv_xfer_sent_fn fn = r->fn;
        void *arg = r->arg;
        uint64_t id = r->request_id;
        reg_free(a, r);
        if (fn) fn(arg, id, outcome);
        return;
    }
    /* Transfers serving it still copy: its pins go back when the last of them quiesces. */
    if (r->fn) r->fn(r->arg, r->request_id, outcome);
    for (xf_serve_t *s = a->serves; s; s = s->next)
        if (s->reg == r && !s->state_done) {
            serve_finish(
                a, s, outcome == PKV_ERR_SHUTDOWN ? PKV_ERR_SHUTDOWN : PKV_ERR_CANCELLED, true,
                outcome == PKV_ERR_SHUTDOWN ? "producer shutting down" : "request withdrawn");
            s->end_settle = true;
        }
    /* Settled apart from the walk above: the last one's settle frees r. */
    for (xf_serve_t *s = a->serves, *next; s; s = next) {
        next = s->next;
        if (!s->end_settle) continue;
        s->end_settle = false;
        serve_settle(a, s);
    }
}

/* Every read of r was acknowledged (the last one now): it ends sent, and the sent
 * callback may ask for the timings of the last acknowledged serve that moved bytes. */
static void reg_end_sent(pkv_xfer_agent_t *a, xf_reg_t *r)
{
    XF_STAT_ADD(a, sent, 1);
    if (!r->bytes_done) XF_STAT_ADD(a, released, 1);
    a->acked.valid = r->have_timings; /* for pkv_xfer_sent_timings inside the callback */
    a->acked.request_id = r->request_id;
    a->acked.t = r->t;
    reg_end(a, unlink_reg(a, r), PKV_OK);
    a->acked.valid = false;
}

static xf_reg_t *unlink_reg(pkv_xfer_agent_t *a, xf_reg_t *r)
{
    pthread_mutex_lock(&a->lock);
    reg_remove(a, r);
    pthread_mutex_unlock(&a->lock);
    return r;
}

void xf_regs_tick(pkv_xfer_agent_t *a, uint64_t now)
{
    if (xf_since(now, a->last_timer_ns) < 1000000ull) return; /* at most every ms */
    a->last_timer_ns = now;
    xf_reg_t *ending = NULL;
    pthread_mutex_lock(&a->lock);
    while (a->reg_unreg) {
        xf_reg_t *r = a->reg_unreg;
        reg_remove(a, r); /* takes it off the list too */
        r->end_outcome = PKV_ERR_CANCELLED;
        r->hnext = ending;
        ending = r;
    }
    while (a->reg_heap_n && now >= a->reg_heap[0]->expiry_ns) {
        xf_reg_t *r = a->reg_heap[0];
        heap_del(a, r);
        /* A lease that runs out while transfers serve it waits for them (serve_quiesce
         * puts it back in the heap when the last ends). */
        if (r->n_serving) continue;
        reg_remove(a, r);
        r->end_outcome = PKV_ERR_TIMEOUT;
        r->hnext = ending;
        ending = r;
    }
    pthread_mutex_unlock(&a->lock);
    while (ending) {
        xf_reg_t *r = ending;
        ending = r->hnext;
        reg_end(a, r, r->end_outcome);
    }
}

void xf_regs_shutdown(pkv_xfer_agent_t *a)
{
    xf_reg_t *all = NULL;
    pthread_mutex_lock(&a->lock);
    uint32_t n = a->reg_tab ? 1u << a->reg_bits : 0;
    for (uint32_t i = 0; i < n; i++)
        while (a->reg_tab[i]) {
            xf_reg_t *r = a->reg_tab[i];
            a->reg_tab[i] = r->hnext;
            r->heap_at = 0;
            r->in_tab = false;
            r->hnext = all;
            all = r;
        }
    a->reg_count = 0;
    a->reg_heap_n = 0;
    a->reg_unreg = NULL;
    pthread_mutex_unlock(&a->lock);
    while (all) {
        xf_reg_t *r = all;
        all = r->hnext;
        reg_end(a, r, PKV_ERR_SHUTDOWN);
    }
}

/* ---- serves ---------------------------------------------------------------------------- */
static void serve_free(xf_serve_t *s)
{
    if (s->chunks)
        for (uint32_t c = 0; c < s->v.n_chunks; c++) free(s->chunks[c].iov);
    xf_view_fini(&s->v);
    free(s->chunks);
    free(s->layer_mac);
    free(s->ev_layer);
    free(s);
}

static bool serve_quiesce(pkv_xfer_agent_t *a, xf_serve_t *s)
{
    if (!s->state_done || s->seat_pending || s->jobs_pending || s->sends_inflight) return false;
    if (s->v.grant) {
        int rc = pkv_stage_release(a->stage, s->v.stage_id);
        if (rc && rc != PKV_ERR_CANCELLED && !(rc == PKV_ERR_NOTFOUND && s->stage_cancelled))
            PKV_LOGW(XF_MOD, "serve %llu: stage release: %s", (unsigned long long)s->xfer_id,
                     pkv_status_str(rc));
        XF_STAT_SUB(a, staging_pages_held, s->v.pages);
    }
    xf_reg_t *r = s->reg;
    if (r->busy) bit_put(r->busy, s->read_index, false); /* readable again unless done */
    r->n_serving--;
    if (r->ended) {
        if (!r->n_serving) reg_free(a, r);
    } else if (!r->n_serving) {
        pthread_mutex_lock(&a->lock); /* its lease may have run out meanwhile */
        heap_add(a, r);
        pthread_mutex_unlock(&a->lock);
    }
    s->peer->refs--;
    for (xf_serve_t **pp = &a->serves; *pp; pp = &(*pp)->next)
        if (*pp == s) {
            *pp = s->next;
            break;
        }
    return true;
}

/* The last thing a handler does with a serve: frees it once quiesced. */
static void serve_settle(pkv_xfer_agent_t *a, xf_serve_t *s)
{
    if (s->zombie || s->posting || !serve_quiesce(a, s)) return;
    xf_busy_add(a, -1);
    serve_free(s);
}

static void serve_finish(pkv_xfer_agent_t *a, xf_serve_t *s, int outcome, bool tell,
                         const char *why)
{
    if (s->state_done) return;
    s->state_done = true;
    s->state = XF_SERVE_DONE;
    s->outcome = outcome;
    s->done_ns = pkv_now_ns(); /* the write-off clock below counts from it */
    atomic_store(&s->v.abort, true);
    if (outcome == PKV_OK && pkv_log_get_level() >= PKV_LOG_DEBUG)
        PKV_LOGD(XF_MOD,
                 "serve %llu ok: seated +%.2f ms, layer 0 staged +%.2f, last staged +%.2f, "
                 "all left +%.2f, ACK +%.2f",
                 (unsigned long long)s->xfer_id, (s->t_seated - s->t_start) / 1e6,
                 (s->t_first_ready - s->t_start) / 1e6, (s->t_last_ready - s->t_start) / 1e6,
                 (s->t_all_sent - s->t_start) / 1e6, (s->done_ns - s->t_start) / 1e6);
    if (outcome != PKV_OK) {
        XF_STAT_ADD(a, serves_failed, 1);
        PKV_LOGI(XF_MOD, "serve of request %llu to peer %u (xfer %llu) ends %s: %s",
                 (unsigned long long)s->request_id, s->peer->id, (unsigned long long)s->xfer_id,
                 pkv_status_str(outcome), why);
    }
    if (tell && s->peer->state == XF_PEER_ACTIVE)
        xf_send_fail(a, s->peer, s->xfer_id, s->request_id,
                     xf_wire_reason_valid(outcome) ? outcome : PKV_ERR_CANCELLED, why);
    if (s->seat_pending) {
        pkv_stage_cancel(a->stage, s->v.stage_id);
        s->stage_cancelled = true;
    }
}

static void reject_why(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_read_t *r, int reason,
                       uint16_t code, const char *why)
{
    XF_STAT_ADD(a, rejected, 1);
    PKV_LOGI(XF_MOD, "READ for request %llu from peer %u refused (%s): %s",
             (unsigned long long)r->request_id, p->id, pkv_status_str(reason), why);
    xf_send_fail_why(a, p, r->xfer_id, r->request_id, reason, code, why);
}

static void reject(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_read_t *r, int reason,
                   const char *why)
{
    reject_why(a, p, r, reason, 0, why);
}

static bool digest_equal(const uint8_t *x, const uint8_t *y)
{
    uint8_t d = 0;
    for (unsigned i = 0; i < XF_WIRE_DIGEST_BYTES; i++) d |= x[i] ^ y[i];
    return d == 0;
}

static bool geo_equal(const pkv_geometry_t *x, const pkv_geometry_t *y)
{
    return x->layers == y->layers && x->kv_heads == y->kv_heads && x->head_dim == y->head_dim &&
           x->block_tokens == y->block_tokens && x->dtype == y->dtype;
}

/* The registration a READ names, if it may be read now: not shutting down, not a transfer
 * id this peer already has served, a live registration with the right token, its lease
 * not over, and the handle's block ids the registration's. NULL: refused (the peer was
 * told why). */
static xf_reg_t *admit_registration(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_read_t *r,
                                    uint64_t now)
{
    if (a->stop_started) {
        xf_send_fail(a, p, r->xfer_id, r->request_id, PKV_ERR_SHUTDOWN, "producer shutting down");
        return NULL;
    }
    for (xf_serve_t *s = a->serves; s; s = s->next)
        if (s->peer == p && s->xfer_id == r->xfer_id) {
            reject(a, p, r, PKV_ERR_REJECTED, "duplicate transfer id");
            return NULL;
        }
    pthread_mutex_lock(&a->lock);
    xf_reg_t *reg = reg_find(a, r->request_id);
    if (reg && reg->unregister_req) reg = NULL;
    pthread_mutex_unlock(&a->lock);
    /* reg stays valid: only this thread unlinks and frees registrations. */
    if (!reg) {
        reject(a, p, r, PKV_ERR_REJECTED, "unknown request");
        return NULL;
    }
    if (!token_equal(reg->token, r->token)) {
        reject(a, p, r, PKV_ERR_REJECTED, "bad token");
        return NULL;
    }
    if (now >= reg->expiry_ns) {
        reject(a, p, r, PKV_ERR_REJECTED, "lease expired");
        return NULL;
    }
    /* The handle's whole block list, not only the plan's: a release or a partial read
     * names some of them or none, and every id the consumer was given must be ours. */
    if (!digest_equal(reg->digest, r->digest)) {
        reject_why(a, p, r, PKV_ERR_REJECTED, XF_WIRE_WHY_BLOCKS,
                   "the handle's block ids are not the registration's");
        return NULL;
    }
    return reg;
}

/* Its reads: all READs agree on how many; an index is read once (again only after its
 * serve failed). The first READ admitted fixes the count. false: refused. */
static bool admit_read_index(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_read_t *r,
                             const xf_reg_t *reg)
{
    if (reg->reads_total && reg->reads_total != r->reads_total) {
        char why[96];
        snprintf(why, sizeof(why), "reads_total %u, but the request is read by %u reads",
                 r->reads_total, reg->reads_total);
        reject(a, p, r, PKV_ERR_REJECTED, why);
        return false;
    }
    if (reg->reads_total &&
        (bit_get(reg->busy, r->read_index) || bit_get(reg->done, r->read_index))) {
        reject(a, p, r, PKV_ERR_REJECTED,
               bit_get(reg->done, r->read_index) ? "read index already acknowledged"
                                                 : "request busy with another read of this index");
        return false;
    }
    return true;
}

/* What this agent can serve: its geometry, heads its rank holds, a shared arena when the
 * READ asks for one, and time left. false: refused. */
static bool admit_layout(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_read_t *r)
{
    if (!geo_equal(&r->geo, &a->geo)) {
        reject_why(a, p, r, PKV_ERR_REJECTED, XF_WIRE_WHY_LAYOUT, "geometry differs");
        return false;
    }
    if (!(r->flags & XF_WIRE_READ_RELEASE) &&
        (r->head_lo < a->head_lo ||
         (uint64_t)r->head_lo + r->head_n > (uint64_t)a->head_lo + a->head_n)) {
        char why[96];
        snprintf(why, sizeof(why), "heads [%u, %u) not all held by rank %u ([%u, %u))", r->head_lo,
                 r->head_lo + r->head_n, a->rank, a->head_lo, a->head_lo + a->head_n);
        reject_why(a, p, r, PKV_ERR_REJECTED, XF_WIRE_WHY_LAYOUT, why);
        return false;
    }
    if ((r->flags & XF_WIRE_READ_SHARED) && a->arena_fd < 0) {
        reject(a, p, r, PKV_ERR_REJECTED, "no shared staging arena here");
        return false;
    }
    if (r->budget_ns == 0) {
        reject(a, p, r, PKV_ERR_TIMEOUT, "no time left");
        return false;
    }
    return true;
}

/* The plan must name registered blocks in registration order, each once: all of them, or
 * the subset a partial read needs (an ACK ends the registration as sent either way: the
 * consumer said it holds the rest). Registered blocks are distinct, so a walk that only
 * moves forward finds a subsequence or nothing. */
static bool plan_within(const xf_reg_t *reg, const xf_wire_read_t *r)
{
    bool within = r->n_blocks <= reg->n;
    for (uint32_t i = 0, k = 0; within && i < r->n_runs; i++) {
        uint32_t first, count;
        xf_wire_read_run(r, i, &first, &count);
        for (uint32_t j = 0; within && j < count; j++) {
            while (k < reg->n && reg->blocks[k] != first + j) k++;
            within = k++ < reg->n;
        }
    }
    return within;
}

/* A READ this agent may serve: not shutting down, a live registration with the right
 * token, time left, not already serving, the same geometry and exactly its blocks.
 * NULL: refused (the peer was told why). */
static xf_reg_t *serve_admit(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_read_t *r,
                             uint64_t now)
{
    xf_reg_t *reg = admit_registration(a, p, r, now);
    if (!reg || !admit_read_index(a, p, r, reg) || !admit_layout(a, p, r)) return NULL;
    if (!plan_within(reg, r)) {
        reject(a, p, r, PKV_ERR_REJECTED, "plan names blocks the request did not register");
        return NULL;
    }
    if (!reg->reads_total) {
        size_t words = PKV_DIV_UP((size_t)r->reads_total, 64);
        reg->busy = calloc(2 * words, sizeof(uint64_t));
        if (!reg->busy) {
            reject(a, p, r, PKV_ERR_NOFIT, "out of memory");
            return NULL;
        }
        reg->done = reg->busy + words;
        reg->reads_total = r->reads_total;
    }
    return reg;
}

/* A token-only release passed the checks: it counts as one of the registration's reads
 * (0 bytes moved); the last one ends it as sent, its pins returned now; the consumer
 * hears ACK. */
static void serve_release(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_read_t *r, xf_reg_t *reg)
{
    xf_wire_ack_t k = {.xfer_id = r->xfer_id, .request_id = r->request_id, .bytes = 0};
    uint8_t buf[64];
    size_t len;
    bit_put(reg->done, r->read_index, true);
    if (++reg->n_done == reg->reads_total) reg_end_sent(a, reg);
    if (xf_wire_encode_ack(&k, buf, sizeof(buf), &len) == PKV_OK) xf_ctl_send(a, p, buf, len);
}

/* The serve and its tables for registration `reg`; NULL: refused as out of limits or
 * memory (the peer was told). */
/* The READ's plan as a block list (the registration's blocks or a subset of them). */
static uint32_t *plan_blocks(const xf_wire_read_t *r)
{
    uint32_t *b = malloc(sizeof(uint32_t) * r->n_blocks), n = 0;
    for (uint32_t i = 0; b && i < r->n_runs; i++) {
        uint32_t first, count;
        xf_wire_read_run(r, i, &first, &count);
        for (uint32_t j = 0; j < count; j++) b[n++] = first + j;
    }
    return b;
}

/* The serve and its tables for registration `reg`; NULL: refused as out of limits or
 * memory (the peer was told). */
static xf_serve_t *serve_make(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_read_t *r,
                              xf_reg_t *reg)
{
    xf_serve_t *s = calloc(1, sizeof(*s));
    uint32_t *plan = s ? plan_blocks(r) : NULL;
    int rc = plan ? xf_view_init(&s->v, a, r->n_blocks, plan, r->chunk_bytes,
                                 r->flags & XF_WIRE_READ_WHOLE, r->head_lo, r->head_n)
                  : PKV_ERR_NOMEM;
    free(plan);
    if (rc) {
        free(s);
        reject(a, p, r, PKV_ERR_NOFIT,
               rc == PKV_ERR_NOFIT ? "exceeds transfer limits" : "out of memory");
        return NULL;
    }
    uint32_t L = s->v.layers;
    s->layer_mac = calloc(L, XF_MAC_TAG_BYTES);
    s->v.trailer = s->layer_mac;
    s->v.keys = malloc((size_t)L * XF_MAC_KEY_BYTES);
    s->ev_layer = calloc(L, sizeof(xf_event_t));
    s->chunks = calloc(s->v.n_chunks, sizeof(xf_chunk_t));
    if (!s->layer_mac || !s->v.keys || !s->ev_layer || !s->chunks) {
        serve_free(s);
        reject(a, p, r, PKV_ERR_NOFIT, "out of memory");
        return NULL;
    }
    if (xf_mac_keys(a->mac, reg->token, r->nonce, r->request_id, r->n_blocks, L, r->head_lo,
                    r->head_n, s->v.keys)) {
        serve_free(s);
        reject(a, p, r, PKV_ERR_NOFIT, "cannot derive the transfer's MAC keys");
        return NULL;
    }
    return s;
}

void xf_serve_on_read(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_read_t *r)
{
    uint64_t now = pkv_now_ns();
    xf_reg_t *reg = serve_admit(a, p, r, now);
    if (!reg) return;
    if (r->flags & XF_WIRE_READ_RELEASE) {
        serve_release(a, p, r, reg);
        return;
    }
    xf_serve_t *s = serve_make(a, p, r, reg);
    if (!s) return;
    s->agent = a;
    s->peer = p;
    s->reg = reg;
    s->xfer_id = r->xfer_id;
    s->request_id = r->request_id;
    s->read_index = r->read_index;
    memcpy(s->nonce, r->nonce, sizeof(s->nonce));
    s->deadline_ns = now + r->budget_ns;
    s->shared = r->flags & XF_WIRE_READ_SHARED;
    s->v.stage_nt = s->v.stage_nt || s->shared; /* the peer reads it on another core */
    s->t_start = a->now_ns;                     /* debug times all on the loop's clock */
    s->v.stage_id = (1ull << 62) | (a->next_serve_id++ & ((1ull << 62) - 1));
    for (uint32_t c = 0; c < s->v.n_chunks; c++) {
        s->chunks[c].owner = s;
        s->chunks[c].is_serve = true;
        s->chunks[c].index = c;
    }
    s->state = XF_SERVE_SEATING;
    s->seat_pending = true;
    reg->n_serving++;
    bit_put(reg->busy, s->read_index, true);
    p->refs++;
    s->next = a->serves;
    a->serves = s;
    xf_busy_add(a, 1);
    XF_STAT_ADD(a, serves_started, 1);
    s->job_seat = (xf_job_t){.kind = XF_JOB_SEAT, .is_serve = true, .owner = s};
    s->ev_seated = (xf_event_t){.kind = XF_EV_SEATED, .is_serve = true, .owner = s};
    fault(a, PKV_XFER_FAULT_SERVE_READ, 0);
    if (xf_seat_inline(a, s->v.stage_id, p->id, s->v.pages, &s->ev_seated))
        xf_serve_event(a, s, &s->ev_seated);
    else
        xf_job_post(a, &s->job_seat, true);
}

/* Seat thread. */
void xf_serve_seat(pkv_xfer_agent_t *a, xf_serve_t *s)
{
    pkv_stage_grant_t *g = NULL;
    /* abortable: a serve that ends while this thread is on its way into the stage cancels
     * an id the stage does not know yet; the acquire then sees `abort` instead. */
    int rc = pkv_stage_acquire_abortable(a->stage, s->v.stage_id, s->peer->id, s->v.pages,
                                         s->deadline_ns, &s->v.abort, &g);
    s->ev_seated.status = rc;
    s->ev_seated.grant = rc == PKV_OK ? g : NULL;
    xf_event_post(a, &s->ev_seated);
}

/* Fault injection (forge_mac): layer l's staged bytes, changed, MACed again the way a
 * party without the token would (keys from another token, the right ids and nonce). */
static void forge_layer(pkv_xfer_agent_t *a, xf_serve_t *s, xf_mac_t *m, uint32_t l)
{
    uint8_t wrong[PKV_XFER_TOKEN_BYTES];
    memcpy(wrong, s->reg->token, sizeof(wrong));
    wrong[0] ^= 1;
    uint8_t *keys = malloc((size_t)s->v.layers * XF_MAC_KEY_BYTES);
    (void)a;
    if (!keys) return;
    if (xf_mac_keys(m, wrong, s->nonce, s->request_id, s->v.n_blocks, s->v.layers, s->v.head_lo,
                    s->v.head_n, keys) == PKV_OK) {
        /* Flip a staged byte (the bytes the peer sends), MAC what is staged. */
        pkv_xfer_sum_fence();
        xf_view_corrupt(&s->v, l);
        xf_view_mac_staged(&s->v, m, keys, l, s->layer_mac + XF_MAC_TAG_BYTES * l);
    }
    free(keys);
}

/* Copy layer l pool -> staging; its MAC into layer_mac. */
static void stage_layer(pkv_xfer_agent_t *a, xf_mac_t *m, xf_serve_t *s, uint32_t l)
{
    xf_view_copy_layer(&s->v, a, m, l, true, s->layer_mac + XF_MAC_TAG_BYTES * l);
    if (a->faults.corrupt_layer == (int32_t)l && a->faults.forge_mac) {
        forge_layer(a, s, m, l);
    } else if (a->faults.corrupt_layer == (int32_t)l) {
        pkv_xfer_sum_fence(); /* the flipped byte lands after the layer's streaming stores */
        xf_view_corrupt(&s->v, l);
    }
    fault(a, PKV_XFER_FAULT_SERVE_COPIED, l);
}

/* Copy worker: stage every layer in order, announcing each as it is ready. */
void xf_serve_job(pkv_xfer_agent_t *a, xf_mac_t *m, xf_serve_t *s)
{
    for (uint32_t l = 0; l < s->v.layers; l++) {
        if (atomic_load(&s->v.abort)) break;
        stage_layer(a, m, s, l);
        pkv_xfer_sum_fence(); /* its streaming stores land before the loop is told */
        xf_event_t *ev = &s->ev_layer[l];
        ev->kind = XF_EV_LAYER_READY;
        ev->is_serve = true;
        ev->owner = s;
        ev->layer = l;
        xf_event_post(a, ev);
    }
    s->ev_job_done = (xf_event_t){.kind = XF_EV_JOB_DONE, .is_serve = true, .owner = s};
    xf_event_post(a, &s->ev_job_done);
}

/* Encode and send one DATA (arena pieces with SHARED, MACs with LAYERS); a failure
 * ends the serve. PKV_OK or the error. */
static int send_data(pkv_xfer_agent_t *a, xf_serve_t *s, const xf_wire_data_t *d,
                     const uint64_t *pieces, uint32_t n_pieces, const uint8_t *macs,
                     uint32_t n_macs)
{
    size_t cap = xf_wire_data_bytes(n_pieces, n_macs), len;
    uint8_t stack[128], *buf = cap <= sizeof(stack) ? stack : malloc(cap);
    int rc = buf ? xf_wire_encode_data(d, pieces, n_pieces, macs, n_macs, buf, cap, &len)
                 : PKV_ERR_NOMEM;
    if (rc == PKV_OK) rc = xf_ctl_send(a, s->peer, buf, len);
    if (buf != stack) free(buf);
    if (rc)
        serve_finish(a, s, rc == PKV_ERR_PEER_LOST ? PKV_ERR_PEER_LOST : PKV_ERR_NOFIT,
                     rc != PKV_ERR_PEER_LOST, "cannot announce a staged layer");
    return rc;
}

/* DATA for layer l once its last chunk is posted (a whole stream has none: its
 * MACs are the payload's trailer). */
static void send_data_header(pkv_xfer_agent_t *a, xf_serve_t *s, uint32_t l)
{
    xf_wire_data_t d = {.xfer_id = s->xfer_id, .layer = l, .bytes = s->v.layer_total};
    memcpy(d.mac, s->layer_mac + XF_MAC_TAG_BYTES * l, XF_MAC_TAG_BYTES);
    send_data(a, s, &d, NULL, 0, NULL, 0);
}

/* Every chunk completed and every DATA went out: wait for the ACK. Not while pump() is
 * posting (a send that completes at once runs send_done inside ucp_tag_send_nbx, before
 * the DATA that follows it); pump() checks again when it is done. */
static void all_sent(pkv_xfer_agent_t *a, xf_serve_t *s)
{
    bool out = s->shared ? s->layers_sent == s->v.layers : s->chunks_sent == s->v.n_chunks;
    if (s->state_done || s->state != XF_SERVE_SENDING || s->posting || !out) return;
    s->state = XF_SERVE_WAIT_ACK;
    s->t_all_sent = a->now_ns;
    fault(a, PKV_XFER_FAULT_SERVE_ALL_SENT, 0);
}

static void send_done(void *request, ucs_status_t status, void *user_data)
{
    xf_chunk_t *ch = user_data;
    xf_serve_t *s = ch->owner;
    pkv_xfer_agent_t *a = s->agent;
    ch->req = NULL;
    ch->done = true;
    s->sends_inflight--;
    ucp_request_free(request);
    if (s->state_done) {
        /* late completion after the serve ended */
    } else if (status != UCS_OK) {
        char why[96];
        snprintf(why, sizeof(why), "payload send failed: %s", ucs_status_string(status));
        if (s->peer->err == UCS_OK) s->peer->err = status;
        serve_finish(a, s, PKV_ERR_PEER_LOST, false, why);
    } else {
        s->chunks_sent++;
        all_sent(a, s);
    }
    /* more sends are posted by the loop (pump) rather than from inside this callback */
    s->pump_needed = true;
    serve_settle(a, s);
}

/* Shared arena: announce each staged layer with its arena pieces (a whole stream: every
 * layer in one DATA once all are staged); no payload moves. */
static void pump_shared(pkv_xfer_agent_t *a, xf_serve_t *s)
{
    bool all = s->v.whole;
    while (!s->state_done && s->layers_sent < s->layers_ready &&
           (!all || s->layers_ready == s->v.layers)) {
        uint32_t l = s->layers_sent, n_layers = all ? s->v.layers : 1;
        uint32_t cap = s->v.grant->nruns;
        uint64_t *pieces = malloc(sizeof(uint64_t) * 2 * cap);
        uint32_t n = pieces ? xf_view_arena_pieces(&s->v, (uint64_t)l * s->v.layer_total,
                                                   n_layers * s->v.layer_total, pieces, cap)
                            : 0;
        xf_wire_data_t d = {.xfer_id = s->xfer_id,
                            .layer = l,
                            .flags = XF_WIRE_DATA_SHARED | (all ? XF_WIRE_DATA_LAYERS : 0),
                            .bytes = s->v.layer_total};
        if (!all) memcpy(d.mac, s->layer_mac + XF_MAC_TAG_BYTES * l, XF_MAC_TAG_BYTES);
        /* n == 0 (no memory, or more pieces than runs) fails to encode: nofit */
        int rc = send_data(a, s, &d, pieces, n, all ? s->layer_mac : NULL, all ? n_layers : 0);
        free(pieces);
        if (rc) return;
        s->layers_sent += n_layers;
        for (uint32_t k = l; k < l + n_layers; k++) fault(a, PKV_XFER_FAULT_SERVE_LAYER_SENT, k);
        all_sent(a, s);
    }
}

/* Post payload sends for staged bytes, at most max_inflight outstanding; after the last
 * chunk of a layer its DATA (a whole stream: its last chunk carries the checksums, once
 * every layer is staged). */
static void pump(pkv_xfer_agent_t *a, xf_serve_t *s)
{
    s->pump_needed = false;
    if (s->shared) {
        pump_shared(a, s);
        return;
    }
    uint64_t staged = (uint64_t)s->layers_ready * s->v.layer_total +
                      (s->layers_ready == s->v.layers ? s->v.trailer_bytes : 0);
    /* A send that completes at once runs send_done inside ucp_tag_send_nbx (NO_IMM_CMPL):
     * `posting` keeps it from settling s under us (every caller of pump() settles after
     * it) and from declaring all sent before the DATA below went out. */
    s->posting = true;
    while (!s->state_done && s->next_chunk < s->v.n_chunks &&
           s->sends_inflight < a->cfg.max_inflight) {
        uint32_t c = s->next_chunk;
        xf_chunk_t *ch = &s->chunks[c];
        uint64_t off, len;
        void *buf;
        size_t count;
        ucp_datatype_t dt;
        xf_chunk_span(&s->v, c, &off, &len);
        if (off + len > staged) break; /* not staged yet */
        if (xf_chunk_buffer(&s->v, ch, off, len, &buf, &count, &dt)) {
            serve_finish(a, s, PKV_ERR_NOFIT, true, "out of memory posting sends");
            break;
        }
        ucp_request_param_t prm = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                            UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            .cb = {.send = send_done},
            .datatype = dt,
            .user_data = ch,
        };
        ch->done = false;
        s->sends_inflight++; /* before posting: send_done may run inside the call */
        void *req =
            ucp_tag_send_nbx(s->peer->ep, buf, count, xf_wire_data_tag(s->xfer_id, c), &prm);
        if (UCS_PTR_IS_ERR(req)) {
            s->sends_inflight--;
            char why[96];
            snprintf(why, sizeof(why), "posting a payload send: %s",
                     ucs_status_string(UCS_PTR_STATUS(req)));
            if (s->peer->err == UCS_OK) s->peer->err = UCS_PTR_STATUS(req);
            serve_finish(a, s, PKV_ERR_PEER_LOST, false, why);
            break;
        }
        s->next_chunk++;
        if (!ch->done) ch->req = req; /* else send_done already ran and freed it */
        /* Layers whose every byte is now posted (the hook may stop us here: a layer's DATA
         * has then not gone, so the consumer cannot complete it; a whole stream's checksums
         * went with its last chunk). */
        bool layer_end = s->v.whole ? s->next_chunk == s->v.n_chunks
                                    : s->next_chunk % s->v.chunks_per_layer == 0;
        if (!layer_end) continue;
        uint32_t last = s->v.whole ? s->v.layers - 1 : s->next_chunk / s->v.chunks_per_layer - 1;
        for (uint32_t l = s->v.whole ? 0 : last; l <= last; l++)
            fault(a, PKV_XFER_FAULT_SERVE_LAYER_SENT, l);
        if (!s->v.whole) send_data_header(a, s, last);
    }
    s->posting = false;
    all_sent(a, s);
}

static int seat_reason(int rc)
{
    switch (rc) {
    case PKV_ERR_NOFIT:
    case PKV_ERR_TIMEOUT:
    case PKV_ERR_SHUTDOWN:
    case PKV_ERR_CANCELLED:
        return rc;
    default:
        return PKV_ERR_NOFIT;
    }
}

/* Layer l is staged, its MAC in layer_mac (layers are staged in order): send what can go. */
static void layer_ready(pkv_xfer_agent_t *a, xf_serve_t *s, uint32_t l)
{
    s->t_last_ready = a->now_ns;
    if (!l) s->t_first_ready = s->t_last_ready;
    s->layers_ready = l + 1;
    pump(a, s);
}

void xf_serve_event(pkv_xfer_agent_t *a, xf_serve_t *s, xf_event_t *ev)
{
    switch (ev->kind) {
    case XF_EV_SEATED:
        s->seat_pending = false;
        s->t_seated = a->now_ns;
        if (ev->status == PKV_OK) {
            XF_STAT_ADD(a, staging_pages_held, s->v.pages);
            if (xf_view_set_grant(&s->v, ev->grant)) {
                s->v.grant = ev->grant;
                serve_finish(a, s, PKV_ERR_NOFIT, true, "staging grant smaller than asked");
            } else if (!s->state_done && xf_small(a, s->v.layer_total * s->v.layers)) {
                /* Small: stage every layer here, fence once, then let them go out. */
                s->state = XF_SERVE_SENDING;
                for (uint32_t l = 0; l < s->v.layers; l++) stage_layer(a, a->mac, s, l);
                pkv_xfer_sum_fence();
                for (uint32_t l = 0; l < s->v.layers && !s->state_done; l++) layer_ready(a, s, l);
            } else if (!s->state_done) {
                s->state = XF_SERVE_SENDING;
                s->jobs_pending++;
                s->job_produce = (xf_job_t){.kind = XF_JOB_PRODUCE, .is_serve = true, .owner = s};
                xf_job_post(a, &s->job_produce, false);
            }
        } else if (!s->state_done) {
            char why[96];
            snprintf(why, sizeof(why), "producer staging for %u pages: %s", s->v.pages,
                     pkv_status_str(ev->status));
            serve_finish(a, s, seat_reason(ev->status), true, why);
        }
        break;
    case XF_EV_LAYER_READY:
        layer_ready(a, s, ev->layer);
        break;
    case XF_EV_JOB_DONE:
        s->jobs_pending--;
        break;
    default:
        PKV_ASSERT(!"unexpected serve event");
    }
    serve_settle(a, s);
}

static xf_serve_t *find_serve(pkv_xfer_agent_t *a, xf_peer_t *p, uint64_t xfer_id)
{
    for (xf_serve_t *s = a->serves; s; s = s->next)
        if (s->peer == p && s->xfer_id == xfer_id) return s;
    return NULL;
}

void xf_serve_on_ack(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_ack_t *k)
{
    xf_serve_t *s = find_serve(a, p, k->xfer_id);
    if (!s || s->state_done) return;
    uint64_t total = s->v.layer_total * s->v.layers;
    bool all_out = s->shared ? s->layers_sent == s->v.layers : s->next_chunk == s->v.n_chunks;
    if (k->request_id != s->request_id || k->bytes != total || !all_out) {
        XF_STAT_ADD(a, proto_errors, 1);
        serve_finish(a, s, PKV_ERR_REJECTED, true, "ACK does not match the transfer");
        serve_settle(a, s);
        return;
    }
    /* One of the registration's reads is done; the last one makes the request sent (the
     * only place it becomes sent but a release). */
    s->acked = true;
    serve_finish(a, s, PKV_OK, false, "acknowledged");
    XF_STAT_ADD(a, bytes_sent, total);
    xf_reg_t *r = s->reg;
    if (!r->ended) {
        bit_put(r->done, s->read_index, true);
        r->bytes_done += total;
        r->have_timings = true;
        r->t = (pkv_xfer_serve_timings_t){.registered_ns = r->registered_ns,
                                          .accepted_ns = s->t_start,
                                          .seated_ns = s->t_seated,
                                          .staged_ns = s->t_last_ready,
                                          .sent_ns = s->t_all_sent,
                                          .acked_ns = s->done_ns};
        if (++r->n_done == r->reads_total) reg_end_sent(a, r);
    }
    serve_settle(a, s);
}

int pkv_xfer_sent_timings(pkv_xfer_agent_t *a, uint64_t request_id, pkv_xfer_serve_timings_t *out)
{
    if (!a || !out || !pthread_equal(pthread_self(), a->progress_thread) || !a->acked.valid ||
        a->acked.request_id != request_id)
        return PKV_ERR_NOTFOUND;
    *out = a->acked.t;
    return PKV_OK;
}

void xf_serve_on_fail(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_fail_t *f)
{
    xf_serve_t *s = find_serve(a, p, f->xfer_id);
    if (!s || s->state_done) return;
    char why[XF_WIRE_MAX_TEXT + 32];
    snprintf(why, sizeof(why), "consumer: %s (%s)", pkv_status_str(f->reason), f->text);
    serve_finish(a, s, f->reason, false, why);
    serve_settle(a, s);
}

/* A FAIL of another wire version that we could not decode names this serve: it ends
 * (the consumer already knows why). */
void xf_serve_on_foreign(pkv_xfer_agent_t *a, xf_peer_t *p, uint64_t xfer_id, const char *why)
{
    xf_serve_t *s = find_serve(a, p, xfer_id);
    if (!s || s->state_done) return;
    serve_finish(a, s, PKV_ERR_REJECTED, false, why);
    serve_settle(a, s);
}

static bool serve_tick(pkv_xfer_agent_t *a, void *t, uint64_t now)
{
    xf_serve_t *s = t;
    if (!s->state_done) {
        if (now >= s->deadline_ns)
            serve_finish(a, s, PKV_ERR_TIMEOUT, true, "deadline passed");
        else if (s->pump_needed)
            pump(a, s);
    } else if (xf_xfer_stuck(a, &xf_side_serves, s->peer, s->xfer_id, s->sends_inflight, s->done_ns,
                             now, &s->zombie)) {
        return false;
    }
    serve_settle(a, s);
    return true;
}

static void *serve_head(pkv_xfer_agent_t *a)
{
    return a->serves;
}

static void *serve_next(void *t)
{
    return ((xf_serve_t *)t)->next;
}

static xf_peer_t *serve_peer(void *t)
{
    return ((xf_serve_t *)t)->peer;
}

static bool serve_ended(void *t)
{
    return ((xf_serve_t *)t)->state_done;
}

static void serve_end(pkv_xfer_agent_t *a, void *t, int outcome, bool tell, const char *why)
{
    serve_finish(a, t, outcome, tell, why);
    serve_settle(a, t);
}

static bool serve_moving(void *t)
{
    const xf_serve_t *s = t;
    return s->state == XF_SERVE_SENDING || s->state == XF_SERVE_WAIT_ACK;
}

const xf_side_t xf_side_serves = {
    .name = "serve",
    .payload_ops = "sends",
    .lost_why = "consumer lost",
    .shutdown_why = "producer shutting down",
    .stuck_why = "payload sends stuck after the transfer ended",
    .kept = " (staging kept)",
    .head = serve_head,
    .next = serve_next,
    .peer = serve_peer,
    .ended = serve_ended,
    .end = serve_end,
    .moving = serve_moving,
    .tick = serve_tick,
};
