/*
 * xfer agent: owns the UCX context, worker and listener, the progress thread, the
 * copy and seat worker pools, and the queues between them.
 *
 * The progress loop (one thread, "pkv-xfer-prog") runs for the agent's whole life:
 *   1. take new reads and worker events from the locked queues,
 *   2. drive UCX (ucp_worker_progress) — error callbacks, keepalives, completions and
 *      active messages only happen here, so the loop never stops, idle included,
 *   3. timers: heartbeats and peer liveness, transfer deadlines, cancels, lease expiry,
 *   4. drain stale payload messages, then sleep on the worker's event fd and our wake
 *      eventfd (armed with ucp_worker_arm) unless data is moving.
 * Shutdown (destroy) is also driven by this loop: fail every transfer with shutdown, wait
 * (bounded) for them to quiesce, close every endpoint, wait (bounded) for every request,
 * and only then let destroy free the worker — UCX asserts if a worker is destroyed with
 * requests pending, so if some never complete the worker is deliberately leaked and
 * logged instead.
 */
#include "xfer/xfer_int.h"

#include "prim/prim.h"
#include "xfer/sum.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#define SHUTDOWN_QUIESCE_NS 2000000000ull /* wait for transfers to quiesce */
#define SHUTDOWN_CTL_NS     300000000ull  /* let FAIL messages leave */
#define SHUTDOWN_CLOSE_NS   2000000000ull /* wait for closes and requests */
#define SHUTDOWN_FLUSH_NS   500000000ull  /* wait for CLOSE replies */

int xf_random(void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n) {
        ssize_t r = getrandom(p, n, 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            return PKV_ERR_IO;
        }
        p += r;
        n -= (size_t)r;
    }
    return PKV_OK;
}

/* A read's id, which is also its payload messages' tag. Tag matching spans the whole
 * worker, not one endpoint, so ids must not be guessable by another peer: a 4-round
 * Feistel permutation of a counter over XF_WIRE_XFER_ID_BITS (two 19-bit halves) with
 * random round keys. Ids never repeat within 2^38 reads; 0 is never used. */
uint64_t xf_next_read_id(pkv_xfer_agent_t *a)
{
    enum { HALF = XF_WIRE_XFER_ID_BITS / 2 };
    const uint64_t mask = (1ull << HALF) - 1;
    for (;;) {
        uint64_t x = a->read_ctr++ & ((1ull << XF_WIRE_XFER_ID_BITS) - 1);
        uint64_t l = x >> HALF, r = x & mask;
        for (int i = 0; i < 4; i++) {
            uint64_t f = r ^ a->read_key[i]; /* splitmix64's finalizer as the round function */
            f = (f ^ (f >> 30)) * 0xbf58476d1ce4e5b9ull;
            f = (f ^ (f >> 27)) * 0x94d049bb133111ebull;
            f ^= f >> 31;
            uint64_t t = l ^ (f & mask);
            l = r;
            r = t;
        }
        uint64_t id = l << HALF | r;
        if (id) return id;
    }
}

/* ---- queues ------------------------------------------------------------------------- */
/* Post a wake. Only the caller that turns wake_posted on writes the eventfd: while it is
 * on, the loop has not taken the queues yet, and that earlier write wakes it (or the loop
 * sees the flag before it sleeps). Saves a syscall per read when reads come in bursts
 * (interleaved pairs, 64 KiB: +6 %). */
void xf_wake(pkv_xfer_agent_t *a)
{
    if (atomic_exchange_explicit(&a->wake_posted, true, memory_order_acq_rel)) return;
    uint64_t one = 1;
    ssize_t r = write(a->wake_fd, &one, sizeof(one));
    (void)r; /* EAGAIN: the counter is already non-zero, the loop will wake */
}

void xf_event_post(pkv_xfer_agent_t *a, xf_event_t *ev)
{
    ev->next = NULL;
    pthread_mutex_lock(&a->lock);
    *a->events_tail = ev;
    a->events_tail = &ev->next;
    pthread_mutex_unlock(&a->lock);
    xf_wake(a);
}

void xf_job_post(pkv_xfer_agent_t *a, xf_job_t *job, bool seat)
{
    job->next = NULL;
    pthread_mutex_lock(&a->lock);
    if (seat) {
        *a->seats_tail = job;
        a->seats_tail = &job->next;
        pthread_cond_signal(&a->seat_cond);
    } else {
        *a->jobs_tail = job;
        a->jobs_tail = &job->next;
        pthread_cond_signal(&a->job_cond);
    }
    pthread_mutex_unlock(&a->lock);
}

bool xf_seat_inline(pkv_xfer_agent_t *a, uint64_t stage_id, uint32_t peer, uint32_t pages,
                    xf_event_t *ev)
{
    pkv_stage_grant_t *g;
    if ((uint64_t)pages * a->page_bytes > XF_INLINE_SEAT_BYTES ||
        pkv_stage_try_acquire(a->stage, stage_id, peer, pages, &g) != PKV_OK)
        return false;
    ev->status = PKV_OK;
    ev->grant = g;
    return true;
}

bool xf_small(const pkv_xfer_agent_t *a, uint64_t bytes)
{
    return !a->cfg.no_inline_copy && bytes <= XF_INLINE_COPY_BYTES;
}

bool xf_layout_compatible(const pkv_xfer_layout_t *x, const pkv_xfer_layout_t *y, char *why,
                          size_t cap)
{
    const pkv_geometry_t *g = &x->geo, *h = &y->geo;
    if (x->model_id[0] && y->model_id[0] && strcmp(x->model_id, y->model_id))
        snprintf(why, cap, "model id '%s' here, '%s' there", x->model_id, y->model_id);
    else if (g->layers != h->layers)
        snprintf(why, cap, "layers %u here, %u there", g->layers, h->layers);
    else if (g->kv_heads != h->kv_heads)
        snprintf(why, cap, "kv_heads %u here, %u there", g->kv_heads, h->kv_heads);
    else if (g->head_dim != h->head_dim)
        snprintf(why, cap, "head_dim %u here, %u there", g->head_dim, h->head_dim);
    else if (g->block_tokens != h->block_tokens)
        snprintf(why, cap, "block_tokens %u here, %u there", g->block_tokens, h->block_tokens);
    else if (g->dtype != h->dtype)
        snprintf(why, cap, "dtype %s here, %s there", pkv_dtype_name(g->dtype),
                 pkv_dtype_name(h->dtype));
    else
        return true;
    return false;
}

/* ---- probes ----------------------------------------------------------------------------- */
/* The probe's answer; the caller may free it once `done` is seen (under mu), so nothing
 * touches it after the unlock. */
static void probe_done(xf_probe_t *pr, int rc)
{
    pthread_mutex_lock(&pr->mu);
    pr->rc = rc;
    pr->done = true;
    pthread_cond_broadcast(&pr->cv);
    pthread_mutex_unlock(&pr->mu);
}

/* End probe pr (in a->probes or not yet) with rc; its peer reference goes. */
static void probe_end(pkv_xfer_agent_t *a, xf_probe_t *pr, int rc)
{
    for (xf_probe_t **pp = &a->probes; *pp; pp = &(*pp)->next)
        if (*pp == pr) {
            *pp = pr->next;
            break;
        }
    if (pr->peer) pr->peer->refs--;
    pr->peer = NULL;
    probe_done(pr, rc);
}

/* The peer's HELLO is in (or it speaks another version): the probe's answer. */
static int probe_answer(pkv_xfer_agent_t *a, xf_probe_t *pr, xf_peer_t *p)
{
    if (!p->hello_seen) { /* another wire version */
        memset(&pr->layout, 0, sizeof(pr->layout));
        pr->layout.wire = p->foreign_version;
        return PKV_ERR_REJECTED;
    }
    pr->layout = p->layout;
    (void)a;
    return p->layout_bad ? PKV_ERR_REJECTED : PKV_OK;
}

void xf_probes_admit(pkv_xfer_agent_t *a, xf_probe_t *list)
{
    while (list) {
        xf_probe_t *pr = list;
        list = pr->next;
        pr->next = NULL;
        if (a->stop_started) {
            probe_done(pr, PKV_ERR_SHUTDOWN);
            continue;
        }
        xf_peer_t *p = xf_peer_connect(a, pr->addr);
        if (!p) {
            probe_done(pr, PKV_ERR_PEER_LOST);
            continue;
        }
        if (p->hello_seen || p->foreign_version) {
            probe_done(pr, probe_answer(a, pr, p));
            continue;
        }
        p->refs++;
        pr->peer = p;
        pr->next = a->probes;
        a->probes = pr;
    }
}

void xf_probes_on_peer(pkv_xfer_agent_t *a, xf_peer_t *p, int rc)
{
    for (xf_probe_t *pr = a->probes, *next; pr; pr = next) {
        next = pr->next;
        if (pr->peer != p) continue;
        probe_end(a, pr, rc == PKV_OK ? probe_answer(a, pr, p) : rc);
    }
}

void xf_probes_tick(pkv_xfer_agent_t *a, uint64_t now)
{
    for (xf_probe_t *pr = a->probes, *next; pr; pr = next) {
        next = pr->next;
        if (now >= pr->deadline_ns) probe_end(a, pr, PKV_ERR_TIMEOUT);
    }
}

void xf_probes_shutdown(pkv_xfer_agent_t *a)
{
    while (a->probes) probe_end(a, a->probes, PKV_ERR_SHUTDOWN);
}

int pkv_xfer_probe(pkv_xfer_agent_t *a, const char *addr, uint64_t deadline_ns,
                   pkv_xfer_layout_t *peer)
{
    if (!a || !addr || !deadline_ns || !xf_wire_addr_valid(addr)) return PKV_ERR_INVALID;
    xf_probe_t *pr = calloc(1, sizeof(*pr));
    if (!pr) return PKV_ERR_NOMEM;
    if (pthread_mutex_init(&pr->mu, NULL)) {
        free(pr);
        return PKV_ERR_NOMEM;
    }
    if (pkv_cond_init_monotonic(&pr->cv)) {
        pthread_mutex_destroy(&pr->mu);
        free(pr);
        return PKV_ERR_NOMEM;
    }
    snprintf(pr->addr, sizeof(pr->addr), "%s", addr);
    pr->deadline_ns = deadline_ns;
    int rc = PKV_OK;
    pthread_mutex_lock(&a->lock);
    if (a->stopping) {
        rc = PKV_ERR_SHUTDOWN;
    } else {
        pr->next = a->new_probes;
        a->new_probes = pr;
    }
    pthread_mutex_unlock(&a->lock);
    if (rc == PKV_OK) {
        xf_wake(a);
        /* The loop answers by the deadline (its tick) or at shutdown: wait for it. */
        pthread_mutex_lock(&pr->mu);
        while (!pr->done) {
            struct timespec ts = pkv_deadline_to_monotonic(pkv_deadline_after_ns(100000000ull));
            pthread_cond_timedwait(&pr->cv, &pr->mu, &ts);
        }
        rc = pr->rc;
        pthread_mutex_unlock(&pr->mu);
        if (peer && (rc == PKV_OK || rc == PKV_ERR_REJECTED)) *peer = pr->layout;
    }
    pthread_cond_destroy(&pr->cv);
    pthread_mutex_destroy(&pr->mu);
    free(pr);
    return rc;
}

int pkv_xfer_agent_layout(const pkv_xfer_agent_t *a, pkv_xfer_layout_t *out)
{
    if (!a || !out) return PKV_ERR_INVALID;
    *out = a->layout;
    return PKV_OK;
}

void xf_busy_add(pkv_xfer_agent_t *a, int delta)
{
    pthread_mutex_lock(&a->lock);
    a->busy = (uint64_t)((int64_t)a->busy + delta);
    /* the counter moves with `busy`, so wait_idle and stats never disagree */
    if (delta > 0)
        XF_STAT_ADD(a, active_transfers, (uint64_t)delta);
    else
        XF_STAT_SUB(a, active_transfers, (uint64_t)-delta);
    if (!a->busy) pthread_cond_broadcast(&a->idle_cond);
    pthread_mutex_unlock(&a->lock);
}

/* Worker and seater threads: pop a job, run it, repeat; exit when told and the queue is
 * empty (the progress thread has quiesced every transfer before that). */
static void *thread_main(pkv_xfer_agent_t *a, bool seat, xf_mac_t *mac)
{
    for (;;) {
        pthread_mutex_lock(&a->lock);
        xf_job_t **q = seat ? &a->seats : &a->jobs;
        while (!*q && !a->threads_stop)
            pthread_cond_wait(seat ? &a->seat_cond : &a->job_cond, &a->lock);
        xf_job_t *job = *q;
        if (!job) {
            pthread_mutex_unlock(&a->lock);
            return NULL;
        }
        *q = job->next;
        if (!*q) {
            if (seat)
                a->seats_tail = &a->seats;
            else
                a->jobs_tail = &a->jobs;
        }
        pthread_mutex_unlock(&a->lock);
        switch (job->kind) {
        case XF_JOB_SEAT:
            if (job->is_serve)
                xf_serve_seat(a, job->owner);
            else
                xf_read_seat(a, job->owner);
            break;
        case XF_JOB_PRODUCE:
            xf_serve_job(a, mac, job->owner);
            break;
        case XF_JOB_VERIFY:
            xf_read_job(a, mac, job->owner, job->layer);
            break;
        }
    }
}

void *xf_worker_main(void *arg)
{
    xf_worker_arg_t *w = arg;
    return thread_main(w->a, false, w->mac);
}

void *xf_seater_main(void *arg)
{
    return thread_main(arg, true, NULL);
}

/* ---- the progress loop ------------------------------------------------------------------ */
static void on_conn_request(ucp_conn_request_h req, void *arg)
{
    pkv_xfer_agent_t *a = arg;
    if (a->n_conn_reqs == PKV_ARRAY_LEN(a->conn_reqs) || a->stop_started) {
        ucp_listener_reject(a->listener, req);
        return;
    }
    a->conn_reqs[a->n_conn_reqs++] = req;
}

/* A round of the progress loop (events, then UCX progress) ends once it has run this long,
 * after at least one event and one progress call, so the ticks (heartbeats, deadlines)
 * come at least this often plus one step, however slow the steps: under TSan a producer's
 * LAYER_READY took 100-250 ms, a consumer's progress call (inline copies) 60-150 ms; one
 * round of a dozen of either went past the peer timeout (1 s) without a heartbeat, and
 * the other side dropped the peer as silent. */
static uint64_t round_budget_ns(const pkv_xfer_agent_t *a)
{
    return a->cfg.heartbeat_ns / 4;
}

/* Handle the held events (a->held, oldest first) until the round's budget is spent; what is
 * left waits for the next round, ahead of newer events. */
static void process_events(pkv_xfer_agent_t *a)
{
    while (a->held) {
        xf_event_t *ev = a->held;
        a->held = ev->next; /* before the handler: it may free ev's owner */
        if (!a->held) a->held_tail = &a->held;
        if (ev->is_serve)
            xf_serve_event(a, ev->owner, ev);
        else
            xf_read_event(a, ev->owner, ev);
        if (pkv_now_ns() - a->now_ns > round_budget_ns(a)) break;
    }
}

static bool progress_once(pkv_xfer_agent_t *a)
{
    bool any = false;
    for (int i = 0; i < 256; i++) {
        if (!ucp_worker_progress(a->worker)) break;
        any = true;
        if (pkv_now_ns() - a->now_ns > round_budget_ns(a)) break;
    }
    for (uint32_t i = 0; i < a->n_conn_reqs; i++) xf_peer_accept(a, a->conn_reqs[i]);
    a->n_conn_reqs = 0;
    return any;
}

/* Sleep until UCX or a queue has something, or timeout_ms passes. */
static void wait_events(pkv_xfer_agent_t *a, int timeout_ms)
{
    /* Drain the eventfd, then look at wake_posted: a wake whose write this read consumed
     * set the flag before writing, so it is seen here; a later one leaves the fd readable
     * and epoll returns at once. No wake is lost. */
    uint64_t cnt;
    ssize_t r = read(a->wake_fd, &cnt, sizeof(cnt));
    (void)r;
    if (atomic_load_explicit(&a->wake_posted, memory_order_acquire)) return;
    ucs_status_t s = ucp_worker_arm(a->worker);
    if (s == UCS_ERR_BUSY) return; /* events already pending */
    if (s != UCS_OK) {
        /* Cannot arm: never block on the fd, just nap briefly. */
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
        return;
    }
    struct epoll_event evs[2];
    int n = epoll_wait(a->epfd, evs, 2, timeout_ms);
    (void)n;
}

/* ---- the walks over both sides' transfers ------------------------------------------ */

static const xf_side_t *const xf_sides[] = {&xf_side_reads, &xf_side_serves};

void xf_xfers_tick(pkv_xfer_agent_t *a, uint64_t now)
{
    for (size_t i = 0; i < PKV_ARRAY_LEN(xf_sides); i++) {
        const xf_side_t *side = xf_sides[i];
        for (void *t = side->head(a), *next; t; t = next) {
            next = side->next(t); /* the tick may unlink t */
            if (!side->tick(a, t, now)) break;
        }
    }
}

void xf_xfers_peer_lost(pkv_xfer_agent_t *a, xf_peer_t *p)
{
    for (size_t i = 0; i < PKV_ARRAY_LEN(xf_sides); i++) {
        const xf_side_t *side = xf_sides[i];
        for (void *t = side->head(a), *next; t; t = next) {
            next = side->next(t);
            if (side->peer(t) == p && !side->ended(t))
                side->end(a, t, PKV_ERR_PEER_LOST, false, side->lost_why);
        }
    }
}

void xf_xfers_shutdown(pkv_xfer_agent_t *a)
{
    for (size_t i = 0; i < PKV_ARRAY_LEN(xf_sides); i++) {
        const xf_side_t *side = xf_sides[i];
        for (void *t = side->head(a), *next; t; t = next) {
            next = side->next(t);
            side->end(a, t, PKV_ERR_SHUTDOWN, true, side->shutdown_why);
        }
    }
}

bool xf_xfers_active_data(pkv_xfer_agent_t *a)
{
    for (size_t i = 0; i < PKV_ARRAY_LEN(xf_sides); i++)
        for (void *t = xf_sides[i]->head(a); t; t = xf_sides[i]->next(t))
            if (xf_sides[i]->moving(t)) return true;
    return false;
}

bool xf_xfer_stuck(pkv_xfer_agent_t *a, const xf_side_t *side, xf_peer_t *peer, uint64_t xfer_id,
                   uint32_t inflight, uint64_t done_ns, uint64_t now, bool *zombie)
{
    uint64_t idle = xf_since(now, done_ns);
    if (!inflight || *zombie || idle <= 2 * XF_CLOSE_WAIT_NS) return false;
    if (peer && peer->state == XF_PEER_ACTIVE) {
        /* Force the endpoint closed: this ends every transfer on that peer and may free
         * them (the walk's next too), so the walk stops here; the next tick goes on. */
        xf_peer_fail(a, peer, side->stuck_why);
        return true;
    }
    if (idle > 3 * XF_CLOSE_WAIT_NS) {
        /* Even closing the endpoint left them pending: write them off (keep the staging). */
        PKV_LOGE(XF_MOD, "%s %llu: %u %s never completed; written off%s", side->name,
                 (unsigned long long)xfer_id, inflight, side->payload_ops, side->kept);
        XF_STAT_ADD(a, written_off, inflight);
        *zombie = true;
    }
    return false;
}

static bool shutdown_step(pkv_xfer_agent_t *a, uint64_t now)
{
    if (!a->stop_started) {
        a->stop_started = true;
        a->stop_ns = now;
        if (a->listener) {
            ucp_listener_destroy(a->listener);
            a->listener = NULL;
        }
        /* progress_once() answered every connection request already. */
        xf_xfers_shutdown(a);
        xf_regs_shutdown(a);
        xf_probes_shutdown(a);
    }
    bool quiet = !a->reads && !a->serves;
    if (!a->eps_closing) {
        bool ctl_done = true;
        for (xf_peer_t *p = a->peers; p; p = p->next)
            if (p->ctl_inflight) ctl_done = false;
        bool give_up = xf_since(now, a->stop_ns) > SHUTDOWN_QUIESCE_NS;
        if (!a->flushing &&
            ((quiet && (ctl_done || xf_since(now, a->stop_ns) > SHUTDOWN_CTL_NS)) || give_up)) {
            /* A send that completed locally has only reached our kernel or the shared
             * FIFO, and a forced close can drop it at the receiver: CLOSE handshake first
             * (bounded), so the last ACKs and FAILs are processed, then force-close. */
            xf_peers_say_close(a);
            a->flushing = true;
            a->flush_deadline_ns = now + SHUTDOWN_FLUSH_NS;
        }
        bool answered = a->flushing && xf_peers_close_answered(a);
        if (a->flushing && (answered || now > a->flush_deadline_ns)) {
            if (!answered)
                PKV_LOGW(XF_MOD, "shutdown: a peer did not answer CLOSE within %llu ms; closing",
                         (unsigned long long)(SHUTDOWN_FLUSH_NS / 1000000));
            xf_peer_close_all(a, true);
            a->eps_closing = true;
            a->stop_ns = now; /* the close phase has its own bound */
        }
        return false;
    }
    if (quiet && xf_peers_closed(a) && !a->discards_inflight) return true;
    if (xf_since(now, a->stop_ns) > SHUTDOWN_CLOSE_NS) {
        PKV_LOGE(XF_MOD,
                 "shutdown: UCX requests still pending after %llu ms (%s%s%u discards); "
                 "leaking the UCX worker rather than destroying it under them",
                 (unsigned long long)(SHUTDOWN_CLOSE_NS / 1000000), quiet ? "" : "transfers, ",
                 xf_peers_closed(a) ? "" : "endpoints, ", a->discards_inflight);
        return true;
    }
    return false;
}

static void *progress_main(void *arg)
{
    pkv_xfer_agent_t *a = arg;
    uint32_t idle_spins = 0;
    uint64_t beat_ns = 0; /* the last loop_ns stored: at most one store a millisecond */
    uint64_t last_work_ns = 0;
    bool clean = false, stopping = false;
    for (;;) {
        /* The queues are taken only after a wake: no lock and no syscall per round while
         * the loop polls (interleaved pairs in one process, 64 KiB reads: +4 %). The plain
         * load first keeps the round from writing the flag's cache line when nothing came. */
        pkv_xfer_read_t *nr = NULL;
        xf_probe_t *np = NULL;
        /* Test hook: each armed hit holds the loop 100 ms (a stuck progress thread). */
        while (pkv_fault_hit(PKV_FAULT_XFER_STALL))
            nanosleep(&(struct timespec){0, 100000000}, NULL);
        a->now_ns = pkv_now_ns();
        if (a->now_ns - beat_ns >= 1000000ull) {
            atomic_store_explicit(&a->loop_ns, a->now_ns, memory_order_relaxed);
            beat_ns = a->now_ns;
        }
        if (atomic_load_explicit(&a->wake_posted, memory_order_relaxed) &&
            atomic_exchange_explicit(&a->wake_posted, false, memory_order_acq_rel)) {
            pthread_mutex_lock(&a->lock);
            nr = a->new_reads;
            a->new_reads = NULL;
            a->new_reads_tail = &a->new_reads;
            if (a->events) {
                *a->held_tail = a->events;
                a->held_tail = a->events_tail;
                a->events = NULL;
                a->events_tail = &a->events;
            }
            np = a->new_probes;
            a->new_probes = NULL;
            stopping = a->stopping; /* never goes back to false */
            pthread_mutex_unlock(&a->lock);
        }
        bool worked = nr || a->held || np;
        if (np) xf_probes_admit(a, np);
        if (nr) xf_reads_admit(a, nr);
        process_events(a);
        if (progress_once(a)) worked = true;

        uint64_t now = pkv_now_ns();
        xf_peers_tick(a, now);
        xf_xfers_tick(a, now);
        xf_regs_tick(a, now);
        xf_probes_tick(a, now);
        xf_drain_stale(a);

        if (stopping && !a->held && shutdown_step(a, now)) {
            clean = !a->reads && !a->serves && xf_peers_closed(a) && !a->discards_inflight;
            break;
        }
        if (worked) {
            idle_spins = 0;
            last_work_ns = now;
            continue;
        }
        bool moving = xf_xfers_active_data(a);
        if ((moving && ++idle_spins < 64) || now - last_work_ns < XF_LINGER_NS) {
            sched_yield();
            continue;
        }
        idle_spins = 0;
        wait_events(a, moving ? 1 : (a->reads || a->serves || a->probes || stopping) ? 5 : 50);
    }
    pthread_mutex_lock(&a->lock);
    a->progress_exited = true;
    pthread_mutex_unlock(&a->lock);
    return (void *)(uintptr_t)clean;
}

/* ---- create / destroy ------------------------------------------------------------------- */

/* Tell the copy and seat threads to leave once their queues are empty; join and free them. */
static void threads_stop_join(pkv_xfer_agent_t *a)
{
    pthread_mutex_lock(&a->lock);
    a->threads_stop = true;
    pthread_cond_broadcast(&a->job_cond);
    pthread_cond_broadcast(&a->seat_cond);
    pthread_mutex_unlock(&a->lock);
    for (uint32_t i = 0; i < a->n_workers; i++) pthread_join(a->workers[i], NULL);
    for (uint32_t i = 0; i < a->n_seaters; i++) pthread_join(a->seaters[i], NULL);
    for (uint32_t i = 0; a->wargs && i < a->cfg.workers; i++) xf_mac_destroy(a->wargs[i].mac);
    xf_mac_destroy(a->mac);
    a->mac = NULL;
    free(a->wargs);
    free(a->workers);
    free(a->seaters);
}
static int parse_host(const char *host, uint16_t port, struct sockaddr_storage *ss, socklen_t *len)
{
    memset(ss, 0, sizeof(*ss));
    struct sockaddr_in *in4 = (struct sockaddr_in *)ss;
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)ss;
    if (inet_pton(AF_INET, host, &in4->sin_addr) == 1) {
        in4->sin_family = AF_INET;
        in4->sin_port = htons(port);
        *len = sizeof(*in4);
        return PKV_OK;
    }
    if (inet_pton(AF_INET6, host, &in6->sin6_addr) == 1) {
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons(port);
        *len = sizeof(*in6);
        return PKV_OK;
    }
    return PKV_ERR_INVALID;
}

int xf_sockaddr_parse(const char *addr, struct sockaddr_storage *ss, socklen_t *len);
int xf_sockaddr_parse(const char *addr, struct sockaddr_storage *ss, socklen_t *len)
{
    char host[PKV_XFER_ADDR_MAX];
    if (!xf_wire_addr_valid(addr)) return PKV_ERR_INVALID;
    const char *colon = strrchr(addr, ':');
    size_t hl = (size_t)(colon - addr);
    const char *h = addr;
    if (addr[0] == '[') h++, hl -= 2;
    memcpy(host, h, hl);
    host[hl] = '\0';
    return parse_host(host, (uint16_t)atoi(colon + 1), ss, len);
}

/* UCX settings that make the push path survive peer failures (why each one:
 * docs/design/xfer.md, "UCX settings"); an explicit environment variable always wins.
 * ucp_config_modify hands keys it does not know to every transport's own table
 * (uct_config_modify), where names carry no transport prefix: "ERROR_HANDLING" reaches
 * both shm transports (posix, sysv), "TX_SEG_SIZE" / "RX_SEG_SIZE" reach tcp. */
static bool tls_may_use(const char *tls, const char *const *names)
{
    if (!tls || !*tls || tls[0] == '^' || strstr(tls, "all")) return true;
    for (; *names; names++)
        if (strstr(tls, *names)) return true;
    return false;
}

static void ucx_config(ucp_config_t *uc)
{
    static const char *const any[] = {"", NULL};
    static const char *const tcp[] = {"tcp", NULL};
    static const char *const shm[] = {"shm", "posix", "sysv", "mm", NULL};
    static const struct {
        const char *key, *value, *env; /* env: the variable that overrides it */
        const char *const *tls;        /* only when UCX_TLS may select one of these */
    } defaults[] = {
        {"ZCOPY_THRESH", "inf", "UCX_ZCOPY_THRESH", any},
        {"KEEPALIVE_INTERVAL", "1s", "UCX_KEEPALIVE_INTERVAL", any},
        {"TX_SEG_SIZE", "64k", "UCX_TCP_TX_SEG_SIZE", tcp},
        {"RX_SEG_SIZE", "64k", "UCX_TCP_RX_SEG_SIZE", tcp},
        {"MM_ERROR_HANDLING", "y", "UCX_POSIX_ERROR_HANDLING", shm},
        {"MM_SEG_SIZE", "64k", "UCX_POSIX_SEG_SIZE", shm},
    };
    const char *tls = getenv("UCX_TLS");
    for (size_t i = 0; i < PKV_ARRAY_LEN(defaults); i++) {
        if (getenv(defaults[i].env) || !tls_may_use(tls, defaults[i].tls)) continue;
        ucs_status_t s = ucp_config_modify(uc, defaults[i].key, defaults[i].value);
        if (s != UCS_OK)
            PKV_LOGW(XF_MOD, "UCX setting %s=%s not applied: %s", defaults[i].key,
                     defaults[i].value, ucs_status_string(s));
    }
}

static int ucx_open(pkv_xfer_agent_t *a, const char *host)
{
    ucp_config_t *uc;
    ucs_status_t s = ucp_config_read(NULL, NULL, &uc);
    if (s != UCS_OK) {
        PKV_LOGE(XF_MOD, "ucp_config_read: %s", ucs_status_string(s));
        return PKV_ERR_IO;
    }
    ucx_config(uc);
    ucp_params_t pp = {
        .field_mask = UCP_PARAM_FIELD_FEATURES,
        .features = UCP_FEATURE_TAG | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
    };
    s = ucp_init(&pp, uc, &a->ctx);
    ucp_config_release(uc);
    if (s != UCS_OK) {
        PKV_LOGE(XF_MOD, "ucp_init: %s", ucs_status_string(s));
        return PKV_ERR_IO;
    }
    ucp_worker_params_t wp = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        .thread_mode = UCS_THREAD_MODE_SINGLE,
    };
    s = ucp_worker_create(a->ctx, &wp, &a->worker);
    if (s != UCS_OK) {
        PKV_LOGE(XF_MOD, "ucp_worker_create: %s", ucs_status_string(s));
        return PKV_ERR_IO;
    }
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        .id = XF_AM_CTRL,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = xf_am_ctrl,
        .arg = a,
    };
    s = ucp_worker_set_am_recv_handler(a->worker, &hp);
    if (s != UCS_OK) {
        PKV_LOGE(XF_MOD, "ucp_worker_set_am_recv_handler: %s", ucs_status_string(s));
        return PKV_ERR_IO;
    }
    if (xf_discard_dt_create(a)) return PKV_ERR_IO;
    s = ucp_worker_get_efd(a->worker, &a->ucx_efd);
    if (s != UCS_OK) {
        PKV_LOGE(XF_MOD, "ucp_worker_get_efd: %s", ucs_status_string(s));
        return PKV_ERR_IO;
    }

    struct sockaddr_storage ss;
    socklen_t sl;
    if (parse_host(host, a->cfg.listen_port, &ss, &sl)) {
        PKV_LOGE(XF_MOD, "listen host '%s' is not an IPv4 or IPv6 address", host);
        return PKV_ERR_INVALID;
    }
    ucp_listener_params_t lp = {
        .field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
        .sockaddr = {.addr = (struct sockaddr *)&ss, .addrlen = sl},
        .conn_handler = {.cb = on_conn_request, .arg = a},
    };
    s = ucp_listener_create(a->worker, &lp, &a->listener);
    if (s != UCS_OK) {
        PKV_LOGE(XF_MOD, "listen on %s port %u: %s", host, a->cfg.listen_port,
                 ucs_status_string(s));
        return PKV_ERR_IO;
    }
    ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
    s = ucp_listener_query(a->listener, &la);
    if (s != UCS_OK) {
        PKV_LOGE(XF_MOD, "ucp_listener_query: %s", ucs_status_string(s));
        return PKV_ERR_IO;
    }
    uint16_t port = la.sockaddr.ss_family == AF_INET6
                        ? ntohs(((struct sockaddr_in6 *)&la.sockaddr)->sin6_port)
                        : ntohs(((struct sockaddr_in *)&la.sockaddr)->sin_port);
    if (ss.ss_family == AF_INET6)
        snprintf(a->addr, sizeof(a->addr), "[%s]:%u", host, port);
    else
        snprintf(a->addr, sizeof(a->addr), "%s:%u", host, port);
    return PKV_OK;
}

static void ucx_close(pkv_xfer_agent_t *a, bool clean)
{
    if (a->listener) ucp_listener_destroy(a->listener);
    a->listener = NULL;
    if (!clean) return; /* leaked on purpose: see the file comment */
    xf_peers_free(a);
    if (a->discard_dt) ucp_dt_destroy(a->discard_dt);
    if (a->worker) ucp_worker_destroy(a->worker);
    if (a->ctx) ucp_cleanup(a->ctx);
}

static int config_resolve(const pkv_xfer_config_t *in, pkv_xfer_config_t *c)
{
    *c = *in;
    if (!c->kv || !c->stage) {
        PKV_LOGE(XF_MOD, "config: kv and stage are required");
        return PKV_ERR_INVALID;
    }
    if (!c->workers) c->workers = 2;
    if (!c->seat_workers) c->seat_workers = 2;
    if (!c->heartbeat_ns) c->heartbeat_ns = 250000000ull;
    if (!c->peer_timeout_ns) c->peer_timeout_ns = 1000000000ull;
    if (!c->chunk_bytes) c->chunk_bytes = PKV_XFER_WHOLE_CHUNK_BYTES; /* one eager segment */
    if (!c->max_inflight) c->max_inflight = 8;
    if (!xf_wire_text_ok(c->identity, PKV_XFER_IDENTITY_MAX)) {
        PKV_LOGE(XF_MOD, "config: identity must be printable ASCII of at most %d characters",
                 PKV_XFER_IDENTITY_MAX);
        return PKV_ERR_INVALID;
    }
    if (!xf_wire_text_ok(c->model_id, PKV_XFER_MODEL_ID_MAX)) {
        PKV_LOGE(XF_MOD, "config: model_id must be printable ASCII of at most %d characters",
                 PKV_XFER_MODEL_ID_MAX);
        return PKV_ERR_INVALID;
    }
    if (c->rank >= pkv_kv_tp(c->kv)) {
        PKV_LOGE(XF_MOD, "config: rank %u, but the pool has %u rank(s)", c->rank, pkv_kv_tp(c->kv));
        return PKV_ERR_INVALID;
    }
    if (c->workers > 64 || c->seat_workers > 64 || c->max_inflight > 1024 ||
        c->chunk_bytes < XF_WIRE_MIN_CHUNK || c->chunk_bytes > XF_WIRE_MAX_CHUNK ||
        c->peer_timeout_ns < 2 * c->heartbeat_ns) {
        PKV_LOGE(XF_MOD,
                 "config: out of range (workers %u, seat_workers %u, max_inflight %u, "
                 "chunk_bytes %u, heartbeat %llu ns, peer timeout %llu ns)",
                 c->workers, c->seat_workers, c->max_inflight, c->chunk_bytes,
                 (unsigned long long)c->heartbeat_ns, (unsigned long long)c->peer_timeout_ns);
        return PKV_ERR_INVALID;
    }
    return PKV_OK;
}

static void name_thread(pthread_t t, const char *prefix, unsigned i)
{
    char name[16];
    snprintf(name, sizeof(name), "%s%u", prefix, i);
    pthread_setname_np(t, name);
}

/* The agent's fixed fields: config, geometry, the shared arena's identity, random ids. */
static int agent_identity(pkv_xfer_agent_t *a, const pkv_xfer_config_t *c)
{
    int rc;
    a->cfg = *c;
    a->cfg.listen_host = NULL; /* not kept: the caller owns the string */
    a->cfg.identity = NULL;    /* copied below */
    a->cfg.model_id = NULL;    /* copied into the layout */
    snprintf(a->identity, sizeof(a->identity), "%s", c->identity ? c->identity : "");
    a->kv = c->kv;
    a->stage = c->stage;
    a->geo = *pkv_kv_geometry(c->kv);
    a->page_bytes = pkv_stage_page_bytes(c->stage);
    a->faults.corrupt_layer = -1;
    a->ucx_efd = a->wake_fd = a->epfd = -1;
    atomic_init(&a->wake_posted, false);
    atomic_init(&a->loop_ns, pkv_now_ns());
    a->new_reads_tail = &a->new_reads;
    a->events_tail = &a->events;
    a->held_tail = &a->held;
    a->jobs_tail = &a->jobs;
    a->seats_tail = &a->seats;
    a->next_peer_id = 1;
    a->have_boot_id = pkv_prim_boot_id(a->boot_id) == PKV_OK;
    a->arena_fd = pkv_stage_memfd(c->stage);
    if (a->arena_fd >= 0) {
        struct stat sb;
        a->arena_bytes = (uint64_t)pkv_stage_pool_pages(c->stage) * a->page_bytes;
        if (fstat(a->arena_fd, &sb) == 0)
            a->arena_ino = (uint64_t)sb.st_ino;
        else
            a->arena_fd = -1;
    }
    rc = xf_wire_check_geometry(&a->geo, &a->layer_bytes);
    if (rc || !a->page_bytes) {
        PKV_LOGE(XF_MOD, "config: pool geometry or staging page size out of range");
        return PKV_ERR_INVALID;
    }
    pkv_kv_rank_t rk;
    a->tp = pkv_kv_tp(c->kv);
    a->rank = c->rank;
    if (pkv_kv_rank(c->kv, c->rank, &rk) || !rk.head_n ||
        (uint64_t)rk.head_lo + rk.head_n > a->geo.kv_heads) {
        PKV_LOGE(XF_MOD, "config: the pool's rank %u holds no valid head range", c->rank);
        return PKV_ERR_INVALID;
    }
    a->head_lo = rk.head_lo;
    a->head_n = rk.head_n;
    a->layout = (pkv_xfer_layout_t){.geo = a->geo,
                                    .tp = a->tp,
                                    .rank = a->rank,
                                    .head_lo = a->head_lo,
                                    .head_n = a->head_n,
                                    .wire = XF_WIRE_VERSION};
    snprintf(a->layout.model_id, sizeof(a->layout.model_id), "%s", c->model_id ? c->model_id : "");
    if (!xf_wire_layout_valid(&a->layout)) {
        PKV_LOGE(XF_MOD, "config: the pool's layout (tp %u, rank %u) is out of range", a->tp,
                 a->rank);
        return PKV_ERR_INVALID;
    }
    uint64_t rnd[8];
    if ((rc = xf_random(rnd, sizeof(rnd)))) return rc;
    a->nonce_prefix = rnd[7];
    atomic_init(&a->nonce_ctr, 0);
    a->agent_id = rnd[0];
    a->read_ctr = rnd[1];
    a->next_serve_id = rnd[2] >> 8;
    memcpy(a->read_key, &rnd[3], sizeof(a->read_key));
    return PKV_OK;
}

/* The worker, seat and progress threads (on failure the caller joins those started). */
static int agent_threads_start(pkv_xfer_agent_t *a, const pkv_xfer_config_t *c)
{
    a->workers = calloc(c->workers, sizeof(pthread_t));
    a->wargs = calloc(c->workers, sizeof(*a->wargs));
    a->seaters = calloc(c->seat_workers, sizeof(pthread_t));
    if (!a->workers || !a->wargs || !a->seaters) return PKV_ERR_NOMEM;
    if (!(a->mac = xf_mac_create())) return PKV_ERR_NOMEM;
    for (uint32_t i = 0; i < c->workers; i++) {
        a->wargs[i].a = a;
        if (!(a->wargs[i].mac = xf_mac_create())) return PKV_ERR_NOMEM;
    }
    for (; a->n_workers < c->workers; a->n_workers++) {
        if (pthread_create(&a->workers[a->n_workers], NULL, xf_worker_main,
                           &a->wargs[a->n_workers]))
            return PKV_ERR_NOMEM;
        name_thread(a->workers[a->n_workers], "pkv-xfer-w", a->n_workers);
    }
    for (; a->n_seaters < c->seat_workers; a->n_seaters++) {
        if (pthread_create(&a->seaters[a->n_seaters], NULL, xf_seater_main, a))
            return PKV_ERR_NOMEM;
        name_thread(a->seaters[a->n_seaters], "pkv-xfer-s", a->n_seaters);
    }
    if (pthread_create(&a->progress_thread, NULL, progress_main, a)) return PKV_ERR_NOMEM;
    pthread_setname_np(a->progress_thread, "pkv-xfer-prog");
    return PKV_OK;
}

int pkv_xfer_agent_create(const pkv_xfer_config_t *cfg, pkv_xfer_agent_t **out)
{
    if (!cfg || !out) return PKV_ERR_INVALID;
    pkv_xfer_config_t c;
    int rc = config_resolve(cfg, &c);
    if (rc) return rc;
    if (pkv_kv_backend(c.kv) != PKV_BACKEND_PAGED) {
        PKV_LOGE(XF_MOD, "config: transfers need the paged pool");
        return PKV_ERR_UNSUPPORTED;
    }
    pkv_xfer_agent_t *a = calloc(1, sizeof(*a));
    if (!a) return PKV_ERR_NOMEM;
    if ((rc = agent_identity(a, &c))) goto fail_free;

    if (pthread_mutex_init(&a->lock, NULL)) {
        rc = PKV_ERR_NOMEM;
        goto fail_free;
    }
    if (pkv_cond_init_monotonic(&a->job_cond) || pkv_cond_init_monotonic(&a->seat_cond) ||
        pkv_cond_init_monotonic(&a->idle_cond)) {
        rc = PKV_ERR_NOMEM;
        goto fail_lock;
    }
    a->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    a->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (a->wake_fd < 0 || a->epfd < 0) {
        PKV_LOGE(XF_MOD, "eventfd/epoll: %s", strerror(errno));
        rc = PKV_ERR_IO;
        goto fail_fds;
    }
    rc = ucx_open(a, c.listen_host ? c.listen_host : "127.0.0.1");
    if (rc) goto fail_ucx;
    struct epoll_event e1 = {.events = EPOLLIN, .data.fd = a->wake_fd};
    struct epoll_event e2 = {.events = EPOLLIN, .data.fd = a->ucx_efd};
    if (epoll_ctl(a->epfd, EPOLL_CTL_ADD, a->wake_fd, &e1) ||
        epoll_ctl(a->epfd, EPOLL_CTL_ADD, a->ucx_efd, &e2)) {
        PKV_LOGE(XF_MOD, "epoll_ctl: %s", strerror(errno));
        rc = PKV_ERR_IO;
        goto fail_ucx;
    }

    if ((rc = agent_threads_start(a, &c))) goto fail_threads;
    PKV_LOGI(XF_MOD, "agent %016llx listening on %s", (unsigned long long)a->agent_id, a->addr);
    *out = a;
    return PKV_OK;

fail_threads:
    threads_stop_join(a);
fail_ucx:
    ucx_close(a, true);
fail_fds:
    if (a->wake_fd >= 0) close(a->wake_fd);
    if (a->epfd >= 0) close(a->epfd);
    pthread_cond_destroy(&a->job_cond);
    pthread_cond_destroy(&a->seat_cond);
    pthread_cond_destroy(&a->idle_cond);
fail_lock:
    pthread_mutex_destroy(&a->lock);
fail_free:
    free(a);
    return rc;
}

void pkv_xfer_agent_destroy(pkv_xfer_agent_t *a)
{
    if (!a) return;
    pthread_mutex_lock(&a->lock);
    a->stopping = true;
    pthread_mutex_unlock(&a->lock);
    xf_wake(a);
    void *clean = NULL;
    pthread_join(a->progress_thread, &clean);
    threads_stop_join(a);

    ucx_close(a, clean != NULL);
    close(a->wake_fd);
    close(a->epfd);
    pthread_cond_destroy(&a->job_cond);
    pthread_cond_destroy(&a->seat_cond);
    pthread_cond_destroy(&a->idle_cond);
    pthread_mutex_destroy(&a->lock);
    if (clean) {
        free(a->reg_tab); /* empty: shutdown ended every registration */
        free(a->reg_heap);
        free(a);
    }
}

const char *pkv_xfer_agent_address(const pkv_xfer_agent_t *a)
{
    return a ? a->addr : "";
}

bool pkv_xfer_agent_alive(pkv_xfer_agent_t *a, uint64_t max_age_ns, uint64_t *age_ns)
{
    if (!a) return false;
    uint64_t beat = atomic_load_explicit(&a->loop_ns, memory_order_relaxed);
    uint64_t age = xf_since(pkv_now_ns(), beat);
    pthread_mutex_lock(&a->lock);
    bool down = a->stopping || a->progress_exited;
    pthread_mutex_unlock(&a->lock);
    if (age_ns) *age_ns = age;
    return !down && age <= max_age_ns;
}

void pkv_xfer_set_faults(pkv_xfer_agent_t *a, const pkv_xfer_faults_t *f)
{
    pthread_mutex_lock(&a->lock);
    if (f && f->heads_n && (uint64_t)f->heads_lo + f->heads_n <= a->geo.kv_heads) {
        a->head_lo = f->heads_lo;
        a->head_n = f->heads_n;
        a->layout.head_lo = f->hello_all_heads ? 0 : f->heads_lo;
        a->layout.head_n = f->hello_all_heads ? a->geo.kv_heads : f->heads_n;
    }
    if (f)
        a->faults = *f;
    else {
        memset(&a->faults, 0, sizeof(a->faults));
        a->faults.corrupt_layer = -1;
    }
    pthread_mutex_unlock(&a->lock);
}

/* ---- accounting ------------------------------------------------------------------------- */
int pkv_xfer_outcome_index(int outcome)
{
    switch (outcome) {
    case PKV_OK:
        return 0;
    case PKV_ERR_TIMEOUT:
        return 1;
    case PKV_ERR_PEER_LOST:
        return 2;
    case PKV_ERR_NOFIT:
        return 3;
    case PKV_ERR_REJECTED:
        return 4;
    case PKV_ERR_CANCELLED:
        return 5;
    case PKV_ERR_CORRUPT:
        return 6;
    case PKV_ERR_SHUTDOWN:
        return 7;
    default:
        return -1;
    }
}

#define LD(f) atomic_load_explicit(&a->st.f, memory_order_relaxed)
void pkv_xfer_stats(pkv_xfer_agent_t *a, pkv_xfer_stats_t *out)
{
    if (!a || !out) return;
    pkv_xfer_stats_t s;
    memset(&s, 0, sizeof(s));
    s.reads_started = LD(reads_started);
    for (int i = 0; i < 8; i++) s.reads_done[i] = LD(reads_done[i]);
    s.bytes_received = LD(bytes_received);
    s.registered = LD(registered);
    s.registrations = LD(registrations);
    s.pinned_blocks = LD(pinned_blocks);
    s.serves_started = LD(serves_started);
    s.serves_failed = LD(serves_failed);
    s.sent = LD(sent);
    s.bytes_sent = LD(bytes_sent);
    s.rejected = LD(rejected);
    s.expired = LD(expired);
    s.active_transfers = LD(active_transfers);
    s.staging_pages_held = LD(staging_pages_held);
    s.peers = LD(peers);
    s.peers_lost = LD(peers_lost);
    s.proto_errors = LD(proto_errors);
    s.foreign_msgs = LD(foreign_msgs);
    s.stale_dropped = LD(stale_dropped);
    s.written_off = LD(written_off);
    s.released = LD(released);
    *out = s;
}
#undef LD

int pkv_xfer_wait_idle(pkv_xfer_agent_t *a, uint64_t deadline_ns)
{
    if (!a) return PKV_ERR_INVALID;
    int rc = PKV_OK;
    pthread_mutex_lock(&a->lock);
    while (a->busy) {
        if (pkv_now_ns() >= deadline_ns) {
            rc = PKV_ERR_TIMEOUT;
            break;
        }
        /* Recomputed each time: PKV_DEADLINE_NEVER maps to "an hour from now". */
        struct timespec ts = pkv_deadline_to_monotonic(deadline_ns);
        pthread_cond_timedwait(&a->idle_cond, &a->lock, &ts);
    }
    pthread_mutex_unlock(&a->lock);
    return rc;
}
