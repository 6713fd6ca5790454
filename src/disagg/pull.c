/*
 * disagg: the decode leg's pull (docs/design/disagg.md, "The decode leg"): what this node's
 * prefix cache holds is adopted; the rest is read from the producer's ranks by the plan's
 * reads, at once, by one deadline, all or nothing, into a new sequence the engine then
 * adopts as a prefix hit. A failure reaches the client typed (or, by policy, the prompt is
 * computed here), never as an answer over wrong KV.
 *
 * No caller's thread waits on a pull. The HTTP thread checks the params and queues the
 * pull; one worker per decode node ("pkv-pull") creates its sequence, starts its reads,
 * and ends it when their outcomes are in (they arrive on the agents' progress threads) or
 * at its deadline + 1 s, then calls the caller's done callback; the caller takes the
 * result without blocking. So a node's threads are the same with any number of legs
 * pulling. Locking: n->pq_mu (disagg_int.h); the state machine is below.
 */
#include "disagg/disagg_int.h"
#include "kv/kv.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A read's outcome as the client's error (transfer failures are not the client's, but
 * for `rejected`: forged or stale params). layout: what differs between the two nodes'
 * layouts when the handshake refused the producer's ("" when not known). */
static void pull_error(int outcome, pkv_xfer_why_t why, const char *layout, pkv_openai_error_t *err)
{
    const char *p = "kv_transfer_params";
    if (outcome == PKV_ERR_REJECTED && why == PKV_XFER_WHY_IDENTITY)
        pkv_openai_error_set(
            err, 400, "invalid_request_error", "invalid_value", DG_KVT_P("remote_engine_id"),
            "'%s' is not the engine the producer at remote_host:remote_port presents",
            DG_KVT_P("remote_engine_id"));
    else if (outcome == PKV_ERR_REJECTED && why == PKV_XFER_WHY_BLOCKS)
        pkv_openai_error_set(err, 400, "invalid_request_error", "rejected",
                             DG_KVT_P("remote_block_ids"),
                             "'%s' are not the blocks the prefill node registered for this request",
                             DG_KVT_P("remote_block_ids"));
    else if (outcome == PKV_ERR_REJECTED && why == PKV_XFER_WHY_LAYOUT && *layout)
        pkv_openai_error_set(err, 400, "invalid_request_error", "incompatible_layout", p,
                             "the prefill node's KV layout does not match this node's: %s", layout);
    else if (outcome == PKV_ERR_REJECTED && why == PKV_XFER_WHY_LAYOUT)
        pkv_openai_error_set(
            err, 400, "invalid_request_error", "incompatible_layout", p,
            "the prefill node's KV layout (model, geometry or the heads of its ranks) "
            "does not match this node's");
    else if (outcome == PKV_ERR_REJECTED)
        pkv_openai_error_set(err, 400, "invalid_request_error", "rejected", p,
                             "the prefill node refused the transfer (unknown request, wrong token, "
                             "expired lease)");
    else if (outcome == PKV_ERR_CORRUPT)
        pkv_openai_error_set(err, 502, "server_error", "corrupt", p,
                             "the transferred KV was corrupt");
    else if (outcome == PKV_ERR_NOFIT || outcome == PKV_ERR_NOSPACE)
        pkv_openai_error_set(err, 503, "service_unavailable", "nofit", p,
                             "no room for the transfer: %s", pkv_status_str(outcome));
    else
        pkv_openai_error_set(err, 503, "service_unavailable",
                             outcome == PKV_ERR_TIMEOUT     ? "timeout"
                             : outcome == PKV_ERR_PEER_LOST ? "peer_lost"
                                                            : "transfer_failed",
                             p, "pulling the prompt's KV failed: %s", pkv_status_str(outcome));
}

/* The decode node's phases of a pull that succeeded: from the call (t0) to the positions
 * recorded (t_end), cut at the read's steps. */
static void pull_phases(pkv_disagg_node_t *n, const pkv_xfer_read_timings_t *rt, uint64_t t0,
                        uint64_t t_end, pkv_disagg_timings_t *t)
{
    pthread_mutex_lock(&n->lock);
    dg_observe_locked(n, t, PKV_DISAGG_PHASE_HANDSHAKE, t0, rt->connected_ns);
    dg_observe_locked(n, t, PKV_DISAGG_PHASE_STAGING_WAIT, rt->connected_ns, rt->requested_ns);
    dg_observe_locked(n, t, PKV_DISAGG_PHASE_WIRE, rt->requested_ns, rt->last_ns);
    dg_observe_locked(n, t, PKV_DISAGG_PHASE_COMMIT, rt->last_ns, t_end);
    pthread_mutex_unlock(&n->lock);
}

/* Decode legs' pulls in flight (delta +1 as one starts, -1 as it ends) and their peak. */
static void pull_inflight(pkv_disagg_node_t *n, int delta)
{
    pthread_mutex_lock(&n->lock);
    if (delta > 0 && ++n->pulls.inflight > n->pulls.inflight_peak)
        n->pulls.inflight_peak = n->pulls.inflight;
    if (delta < 0) n->pulls.inflight--;
    pthread_mutex_unlock(&n->lock);
}

/* Rank the outcomes of a failed pull: the one that caused it, not the cancels it caused. */
static int worse(int a, int b)
{
    if (a == PKV_OK || (a == PKV_ERR_CANCELLED && b != PKV_OK)) return b;
    return a;
}

/* What differs between local rank d's layout and the producer's at addr, for the client's
 * error when the handshake refused it ("" when the producer cannot be asked again by
 * until_ns or their layouts agree: the read asked for heads its rank does not hold). The
 * producer's HELLO is asked again on the endpoint the refused read used (nothing else is
 * sent to it), so the answer is at hand. */
static void layout_difference(pkv_disagg_node_t *n, uint32_t d, const char *addr, uint64_t until_ns,
                              char *out, size_t cap)
{
    pkv_xfer_layout_t here, there;
    out[0] = 0;
    uint64_t soon = pkv_deadline_after_ns(1000000000ull);
    if (pkv_xfer_agent_layout(n->rank[d].agent, &here)) return;
    int rc = pkv_xfer_probe(n->rank[d].agent, addr, PKV_MIN(soon, until_ns), &there);
    if (rc != PKV_OK && rc != PKV_ERR_REJECTED) return;
    const pkv_geometry_t *g = &here.geo, *h = &there.geo;
    if (there.wire != here.wire)
        snprintf(out, cap, "wire version %u there, %u here", there.wire, here.wire);
    else if (here.model_id[0] && there.model_id[0] && strcmp(here.model_id, there.model_id))
        snprintf(out, cap, "model '%s' there, '%s' here", there.model_id, here.model_id);
    else if (h->layers != g->layers || h->kv_heads != g->kv_heads || h->head_dim != g->head_dim ||
             h->block_tokens != g->block_tokens)
        snprintf(out, cap,
                 "geometry (layers, kv_heads, head_dim, block_tokens) %u, %u, %u, %u there, "
                 "%u, %u, %u, %u here",
                 h->layers, h->kv_heads, h->head_dim, h->block_tokens, g->layers, g->kv_heads,
                 g->head_dim, g->block_tokens);
    else if (h->dtype != g->dtype)
        snprintf(out, cap, "KV dtype %s there, %s here", pkv_dtype_name(h->dtype),
                 pkv_dtype_name(g->dtype));
}

static void count_pull(pkv_disagg_node_t *n, int outcome, uint32_t pulled, uint32_t adopted,
                       bool first_used, bool first_ignored)
{
    pthread_mutex_lock(&n->lock);
    if (outcome != PKV_OK) {
        n->pulls.failed++;
    } else {
        if (pulled)
            n->pulls.ok++;
        else
            n->pulls.released++;
        n->pulls.blocks_pulled += pulled;
        n->pulls.blocks_adopted += adopted;
        n->pulls.first_used += first_used;
    }
    n->pulls.first_ignored += first_ignored;
    pthread_mutex_unlock(&n->lock);
}

/* ---- the pull and its worker --------------------------------------------------------------
 * A pull goes QUEUED (the HTTP thread checked its params and queued it) -> RUNNING (the
 * worker created its sequence and started its reads) -> ENDED (every read has an outcome,
 * or its deadline + 1 s passed: the worker collected the outcomes, recorded or freed the
 * sequence and called done). The reads' outcomes arrive on the agents' progress threads
 * (pull_read_done), which count them and wake the worker. A failure, an abandon or the
 * node's stop cancels the pull's other reads at once (all or nothing); their outcomes then
 * follow within the agents' next rounds. Lifetime: the pull is freed by whichever of
 * take/abandon (the caller's), the worker (abandoned before it ended) or the last read
 * callback comes last; every read callback holds the pull (cb_refs), since a read freed
 * without an outcome (its agent stuck past the deadline + 1 s) still calls back once, at
 * the latest when its agent is destroyed. */
typedef enum { PL_QUEUED, PL_RUNNING, PL_ENDED } pl_state_t;

struct pkv_disagg_pull {
    pkv_disagg_node_t *n;
    struct pkv_disagg_pull *next; /* in n->pq_head until ended */
    /* from the start, read-only after */
    pkv_xfer_handle_t *hs[PKV_KV_MAX_TP]; /* the producer's ranks [P] */
    uint32_t P;
    char engine_id[PKV_XFER_ADDR_MAX];
    int32_t *ids; /* the prompt [n_prompt] */
    uint32_t n_prompt;
    uint64_t salt;
    pkv_disagg_first_t first; /* given: the prefill leg's first token, checked */
    bool first_ignored;       /* a pagekv_first that did not match the request's sampling */
    pkv_disagg_pull_done_fn done;
    void *arg;
    /* the worker's alone, from begin to the end */
    pkv_seq_t *seq;
    uint32_t have, want; /* whole blocks adopted locally; blocks holding the positions the
                            engine takes (the last one possibly partial) */
    dg_read_t *plan;
    pkv_xfer_read_t **rd; /* [m]: the first `started` were started */
    uint32_t m, started;
    uint64_t t0, deadline;
    /* under n->pq_mu */
    pl_state_t state;
    uint32_t left;    /* started reads without an outcome */
    uint32_t cb_refs; /* started reads whose callback has not run */
    bool failed;      /* a read ended other than ok, or one could not start */
    bool cancelled;   /* the reads were asked to end */
    bool abandoned;   /* the caller gave up: no done, no take */
    bool taken;       /* the caller took the result */
    uint64_t until;   /* the deadline + 1 s: ended then whatever is missing */
    /* the result, set by the worker before ENDED */
    int rc;
    pkv_openai_error_t err;
    pkv_disagg_timings_t tm;
};

static void pull_free(pkv_disagg_pull_t *pl)
{
    for (uint32_t p = 0; p < PKV_KV_MAX_TP; p++) pkv_xfer_handle_free(pl->hs[p]);
    free(pl->ids);
    free(pl->plan);
    free(pl->rd);
    free(pl);
}

/* Under n->pq_mu: nothing refers to the pull any more. */
static bool pull_unused_locked(const pkv_disagg_pull_t *pl)
{
    return pl->state == PL_ENDED && (pl->taken || pl->abandoned) && !pl->cb_refs;
}

/* A read's outcome, on its agent's progress thread. */
static void pull_read_done(void *arg, pkv_xfer_read_t *rd, int outcome)
{
    (void)rd;
    pkv_disagg_pull_t *pl = arg;
    pkv_disagg_node_t *n = pl->n;
    pthread_mutex_lock(&n->pq_mu);
    pl->left--;
    pl->cb_refs--;
    pl->failed |= outcome != PKV_OK;
    bool unused = pull_unused_locked(pl);
    pthread_cond_signal(&n->pq_cv);
    pthread_mutex_unlock(&n->pq_mu);
    if (unused) pull_free(pl);
}

/* Prompt positions the engine takes with the sequence: all of them with the prefill leg's
 * first token; otherwise all but the last, which the engine computes (its logits give the
 * first token). */
static uint32_t pull_positions(const pkv_disagg_pull_t *pl)
{
    return pl->first.given ? pl->n_prompt : pl->n_prompt - 1;
}

/* The worker starts a queued pull: its sequence, adopting what this node's prefix cache
 * holds, then its reads. The sequence goes to the engine whole (pkv_request_params_t.seq)
 * holding pull_positions(), so the blocks of those positions the cache lacks are pulled,
 * the last of them partial unless the count is a multiple of the block size (the producer
 * registered it: keep_blocks pins ceil(n_prompt / block_tokens)). When the cache lacks
 * none (only without the first token: the cache never adopts the last prompt position),
 * the token alone goes to the producer (a release), which returns its pins at once. Every
 * local rank pulls the heads it holds from the prefill ranks that hold them, all at once,
 * by one deadline. */
static void pull_begin(pkv_disagg_pull_t *pl, bool stopping)
{
    pkv_disagg_node_t *n = pl->n;
    pl->t0 = pkv_now_ns();
    pl->tm.at[PKV_DISAGG_MARK_PULL_BEGIN] = pl->t0;
    pl->deadline = pl->t0 + (uint64_t)n->transfer_timeout_ms * 1000000ull;
    if (stopping) {
        pl->rc = PKV_ERR_SHUTDOWN;
        return;
    }
    pkv_seq_params_t sp = {.salt = pl->salt, .tokens = pl->ids, .n_tokens = pl->n_prompt};
    uint32_t cached = 0, bt = pl->hs[0]->geo.block_tokens, kvh = pl->hs[0]->geo.kv_heads;
    pl->want = PKV_DIV_UP(pull_positions(pl), bt);
    int rc = pkv_seq_create(n->kv, &sp, &pl->seq, &cached);
    if (rc) {
        pl->rc = rc;
        return;
    }
    uint64_t took = pkv_now_ns() - pl->t0, commit = pkv_seq_commit_ns(pl->seq);
    pthread_mutex_lock(&n->lock);
    dg_observe_locked(n, &pl->tm, PKV_DISAGG_PHASE_KV_ALLOC, commit, PKV_MAX(took, commit));
    dg_observe_locked(n, &pl->tm, PKV_DISAGG_PHASE_KV_COMMIT, 0, commit);
    pthread_mutex_unlock(&n->lock);
    pl->have = PKV_MIN(cached / bt, pl->want);
    const uint32_t *dst;
    uint32_t nd, n_pull = pl->want - pl->have;
    rc = pkv_seq_blocks(pl->seq, &dst, &nd);
    if (rc || nd < pl->want || pl->hs[0]->n_blocks < pl->want) {
        pl->rc = rc ? rc : PKV_ERR_INVALID;
        return;
    }
    uint32_t *idx = malloc(sizeof(uint32_t) * (n_pull ? n_pull : 1));
    pl->plan = malloc(sizeof(*pl->plan) * ((size_t)n->tp * kvh + pl->P));
    pl->rd = calloc((size_t)n->tp * kvh + pl->P, sizeof(*pl->rd));
    if (!idx || !pl->plan || !pl->rd) {
        free(idx);
        pl->rc = PKV_ERR_NOMEM;
        return;
    }
    for (uint32_t i = 0; i < n_pull; i++) idx[i] = pl->have + i;
    uint32_t m = dg_plan(n, pl->P, n_pull > 0, pl->plan);
    pthread_mutex_lock(&n->pq_mu); /* outcomes may come before the last read starts */
    pl->m = m;
    pl->left = pl->cb_refs = m;
    pthread_mutex_unlock(&n->pq_mu);
    pull_inflight(n, +1);
    for (; pl->started < m && !rc; pl->started++) {
        const dg_read_t *r = &pl->plan[pl->started];
        bool moves = r->head_n > 0;
        pkv_xfer_read_opts_t o = {.idx = idx,
                                  .identity = pl->engine_id,
                                  .head_lo = r->head_lo,
                                  .head_n = r->head_n,
                                  .reads_total = r->total,
                                  .read_index = r->index};
        rc = pkv_xfer_read_ex(n->rank[r->d].agent, pl->hs[r->p], &o, moves ? dst + pl->have : NULL,
                              moves ? n_pull : 0, pl->deadline, pull_read_done, pl,
                              &pl->rd[pl->started]);
    }
    free(idx);
    if (rc) { /* the one that failed to start, and those after it, have no outcome coming */
        pl->started--;
        pthread_mutex_lock(&n->pq_mu);
        pl->left -= m - pl->started;
        pl->cb_refs -= m - pl->started;
        pl->failed = true;
        pthread_mutex_unlock(&n->pq_mu);
        pl->rc = rc;
    }
}

/* The worker ends a pull: every read's outcome (a read still without one by the deadline +
 * 1 s is a timeout), the worst of them the pull's; on ok the positions [0, pull_positions)
 * recorded as written (the first `have` blocks' already were: adopted) and the phases
 * counted from the slowest read; otherwise the sequence freed (every page and pin returns)
 * and the client's error, or, by --kv-load-failure recompute, no sequence and ok. */
static void pull_end(pkv_disagg_pull_t *pl, bool all_in)
{
    pkv_disagg_node_t *n = pl->n;
    int outcome = pl->rc;
    pkv_xfer_why_t why = PKV_XFER_WHY_NONE;
    dg_read_t refused = {0};
    uint64_t bytes = 0, last = 0;
    pkv_xfer_read_timings_t rt = {0};
    bool timed = true;
    uint32_t bt = pl->hs[0]->geo.block_tokens, n_pull = pl->want - pl->have;
    /* A read's callback runs just before its outcome can be read: every callback came
     * (all_in), so every outcome is there at once; otherwise the ones without are late. */
    uint64_t settle = pkv_deadline_after_ns(all_in ? 1000000000ull : 1000000ull);
    for (uint32_t i = 0; i < pl->started; i++) {
        int oc = PKV_ERR_TIMEOUT;
        if (pkv_xfer_read_wait(pl->rd[i], settle, &oc)) {
            pkv_xfer_cancel(pl->rd[i]);
            oc = PKV_ERR_TIMEOUT;
        }
        outcome = worse(outcome, oc);
        if (oc == PKV_ERR_REJECTED && why == PKV_XFER_WHY_NONE) {
            why = pkv_xfer_read_why(pl->rd[i]);
            refused = pl->plan[i];
        }
        pkv_xfer_read_timings_t ri;
        if (oc == PKV_OK && pl->plan[i].head_n && !pkv_xfer_read_timings(pl->rd[i], &ri)) {
            if (ri.last_ns >= last) last = ri.last_ns, rt = ri;
        } else if (pl->plan[i].head_n) {
            timed = false;
        }
        bytes += pkv_xfer_read_bytes(pl->rd[i]);
        pkv_xfer_read_free(pl->rd[i]);
    }
    if (pl->m) pull_inflight(n, -1);
    uint32_t cached = pl->have * bt;
    if (outcome == PKV_OK && n_pull)
        outcome = pkv_seq_append(pl->seq, pl->ids + cached, pull_positions(pl) - cached);
    if (outcome == PKV_OK && timed && n_pull && last)
        pull_phases(n, &rt, pl->t0, pkv_now_ns(), &pl->tm);
    if (outcome == PKV_OK) {
        pl->tm.pulled = n_pull > 0;
        pl->tm.pulled_bytes = bytes;
        pl->tm.pulled_blocks = n_pull;
        pl->tm.adopted_blocks = pl->have;
    }
    char layout[192] = "";
    if (outcome == PKV_ERR_REJECTED && why == PKV_XFER_WHY_LAYOUT && refused.p < pl->P)
        layout_difference(n, refused.d, pl->hs[refused.p]->addr, pl->until, layout, sizeof(layout));
    count_pull(n, outcome, n_pull, pl->have, pl->first.given, pl->first_ignored);
    pl->rc = outcome;
    if (outcome == PKV_OK) return;
    pkv_seq_free(pl->seq);
    pl->seq = NULL;
    /* --kv-load-failure recompute: a failure that is not the client's (the producer's
     * refusal is) is answered by computing the prompt here. */
    if (n->recompute && outcome != PKV_ERR_REJECTED && outcome != PKV_ERR_SHUTDOWN) {
        pthread_mutex_lock(&n->lock);
        n->pulls.recomputed++;
        pthread_mutex_unlock(&n->lock);
        pl->rc = PKV_OK;
        return;
    }
    if (outcome == PKV_ERR_SHUTDOWN)
        pkv_openai_error_set(&pl->err, 503, "service_unavailable", "shutting_down", NULL,
                             "the server is shutting down");
    else if (outcome == PKV_ERR_NOMEM)
        pkv_openai_error_set(&pl->err, 500, "server_error", "out_of_memory", NULL, "out of memory");
    else
        pull_error(outcome, why, layout, &pl->err);
}

/* What the worker does next: begin a queued pull, cancel a failed, abandoned or stopped
 * one's reads, or end one whose reads are in (or whose time is up). Under n->pq_mu; NULL
 * with *next (the earliest deadline + 1 s) when there is nothing to do now. */
typedef enum { PL_DO_BEGIN, PL_DO_CANCEL, PL_DO_END } pl_do_t;
static pkv_disagg_pull_t *pull_pick_locked(pkv_disagg_node_t *n, uint64_t now, pl_do_t *what,
                                           uint64_t *next)
{
    *next = PKV_DEADLINE_NEVER;
    for (pkv_disagg_pull_t *pl = n->pq_head; pl; pl = pl->next) {
        if (pl->state == PL_QUEUED) {
            *what = PL_DO_BEGIN;
            return pl;
        }
        if ((pl->failed || pl->abandoned || n->pq_stop) && !pl->cancelled && pl->left) {
            *what = PL_DO_CANCEL;
            return pl;
        }
        if (!pl->left || now >= pl->until) {
            *what = PL_DO_END;
            return pl;
        }
        *next = PKV_MIN(*next, pl->until);
    }
    return NULL;
}

static void pull_unlink_locked(pkv_disagg_node_t *n, pkv_disagg_pull_t *pl)
{
    for (pkv_disagg_pull_t **pp = &n->pq_head; *pp; pp = &(*pp)->next)
        if (*pp == pl) {
            *pp = pl->next;
            return;
        }
}

/* The worker's step on pl (what), with n->pq_mu released around the work. */
static void pull_step(pkv_disagg_node_t *n, pkv_disagg_pull_t *pl, pl_do_t what)
{
    if (what == PL_DO_BEGIN) {
        bool stopping = n->pq_stop || pl->abandoned;
        pthread_mutex_unlock(&n->pq_mu);
        pull_begin(pl, stopping);
        pthread_mutex_lock(&n->pq_mu);
        pl->state = PL_RUNNING;
        pl->until = pl->deadline + 1000000000ull;
        return;
    }
    if (what == PL_DO_CANCEL) {
        pl->cancelled = true;
        if (n->pq_stop) /* cancels end within the agents' next rounds */
            pl->until = PKV_MIN(pl->until, pkv_deadline_after_ns(1000000000ull));
        pthread_mutex_unlock(&n->pq_mu);
        for (uint32_t i = 0; i < pl->started; i++) pkv_xfer_cancel(pl->rd[i]);
        pthread_mutex_lock(&n->pq_mu);
        return;
    }
    bool all_in = !pl->left;
    pthread_mutex_unlock(&n->pq_mu);
    pull_end(pl, all_in);
    pthread_mutex_lock(&n->pq_mu);
    pull_unlink_locked(n, pl);
    pl->state = PL_ENDED;
    bool abandoned = pl->abandoned, unused = pull_unused_locked(pl);
    pkv_seq_t *drop = abandoned ? pl->seq : NULL;
    pkv_disagg_pull_done_fn done = pl->done;
    void *arg = pl->arg;
    pl->tm.at[PKV_DISAGG_MARK_PULL_END] = pkv_now_ns();
    pthread_mutex_unlock(&n->pq_mu);
    pkv_seq_free(drop);
    if (unused) pull_free(pl);
    if (!abandoned) done(arg); /* the caller may take (and free) pl from here on */
    pthread_mutex_lock(&n->pq_mu);
}

static void *pull_worker(void *arg)
{
    pkv_disagg_node_t *n = arg;
    pthread_setname_np(pthread_self(), "pkv-pull");
    pthread_mutex_lock(&n->pq_mu);
    for (;;) {
        pl_do_t what;
        uint64_t next;
        pkv_disagg_pull_t *pl = pull_pick_locked(n, pkv_now_ns(), &what, &next);
        if (pl) {
            pull_step(n, pl, what);
            continue;
        }
        if (n->pq_stop && !n->pq_head) break;
        if (next == PKV_DEADLINE_NEVER) {
            pthread_cond_wait(&n->pq_cv, &n->pq_mu);
        } else {
            struct timespec ts = pkv_deadline_to_monotonic(next);
            pthread_cond_timedwait(&n->pq_cv, &n->pq_mu, &ts);
        }
    }
    pthread_mutex_unlock(&n->pq_mu);
    return NULL;
}

int dg_pulls_start(pkv_disagg_node_t *n)
{
    if (pthread_mutex_init(&n->pq_mu, NULL)) return PKV_ERR_NOMEM;
    if (pkv_cond_init_monotonic(&n->pq_cv)) {
        pthread_mutex_destroy(&n->pq_mu);
        return PKV_ERR_NOMEM;
    }
    n->pq_running = n->role == PKV_SERVER_ROLE_DECODE;
    if (n->pq_running && pthread_create(&n->pq_thread, NULL, pull_worker, n)) {
        n->pq_running = false;
        pthread_cond_destroy(&n->pq_cv);
        pthread_mutex_destroy(&n->pq_mu);
        return PKV_ERR_NOMEM;
    }
    n->pq_ready = true;
    return PKV_OK;
}

void dg_pulls_stop(pkv_disagg_node_t *n)
{
    if (!n->pq_ready) return;
    pthread_mutex_lock(&n->pq_mu);
    n->pq_stop = true;
    pthread_cond_signal(&n->pq_cv);
    pthread_mutex_unlock(&n->pq_mu);
    if (n->pq_running) pthread_join(n->pq_thread, NULL);
    pthread_cond_destroy(&n->pq_cv);
    pthread_mutex_destroy(&n->pq_mu);
    n->pq_ready = false;
}

int pkv_disagg_pull_start(pkv_disagg_node_t *n, const json_t *params, const int32_t *ids,
                          uint32_t n_prompt, uint64_t salt, const pkv_disagg_sampling_t *smp,
                          pkv_disagg_pull_done_fn done, void *arg, pkv_disagg_pull_t **out,
                          pkv_openai_error_t *err)
{
    const char *engine_id = dg_params_engine_id(params, err);
    if (!engine_id) return PKV_ERR_INVALID;
    pkv_disagg_pull_t *pl = calloc(1, sizeof(*pl));
    int32_t *copy = malloc(sizeof(int32_t) * (n_prompt ? n_prompt : 1));
    pkv_xfer_handle_t *h = NULL;
    int rc = pl && copy ? PKV_OK : PKV_ERR_NOMEM;
    if (!rc) rc = dg_params_handle(n, params, ids, n_prompt, &h, err);
    if (!rc) rc = dg_params_ranks(n, params, h, pl->hs, &pl->P, err);
    if (!rc)
        rc = dg_params_first(params, pl->hs[0]->request_id, smp, &pl->first, &pl->first_ignored,
                             err);
    if (rc == PKV_ERR_NOMEM)
        pkv_openai_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
    if (rc) {
        if (pl && !pl->hs[0]) pkv_xfer_handle_free(h); /* not taken over */
        if (pl) pull_free(pl);
        free(copy);
        return rc;
    }
    pl->P = PKV_MAX(pl->P, 1);
    pl->n = n;
    snprintf(pl->engine_id, sizeof(pl->engine_id), "%s", engine_id);
    memcpy(copy, ids, sizeof(int32_t) * n_prompt);
    pl->ids = copy;
    pl->n_prompt = n_prompt;
    pl->salt = salt;
    pl->done = done;
    pl->arg = arg;
    pthread_mutex_lock(&n->pq_mu);
    bool stopping = n->pq_stop || !n->pq_running;
    if (!stopping) {
        pl->next = n->pq_head;
        n->pq_head = pl;
        pthread_cond_signal(&n->pq_cv);
    }
    pthread_mutex_unlock(&n->pq_mu);
    if (stopping) {
        pull_free(pl);
        pkv_openai_error_set(err, 503, "service_unavailable", "shutting_down", NULL,
                             "the server is shutting down");
        return PKV_ERR_SHUTDOWN;
    }
    *out = pl;
    return PKV_OK;
}

bool pkv_disagg_pull_ended(pkv_disagg_pull_t *pl)
{
    pthread_mutex_lock(&pl->n->pq_mu);
    bool ended = pl->state == PL_ENDED;
    pthread_mutex_unlock(&pl->n->pq_mu);
    return ended;
}

/* The pull's phases and figures into the request's timings. */
static void timings_add(pkv_disagg_timings_t *t, const pkv_disagg_timings_t *from)
{
    for (int ph = 0; ph < PKV_DISAGG_PHASE_COUNT; ph++)
        if (from->have & (1u << ph)) t->ns[ph] = from->ns[ph];
    t->have |= from->have;
    for (int m = 0; m < PKV_DISAGG_MARK_COUNT; m++)
        if (from->at[m]) t->at[m] = from->at[m];
    t->pulled = from->pulled;
    t->pulled_bytes = from->pulled_bytes;
    t->pulled_blocks = from->pulled_blocks;
    t->adopted_blocks = from->adopted_blocks;
}

int pkv_disagg_pull_take(pkv_disagg_pull_t *pl, pkv_seq_t **out, pkv_disagg_first_t *first,
                         pkv_disagg_timings_t *t, pkv_openai_error_t *err)
{
    pkv_disagg_node_t *n = pl->n;
    pthread_mutex_lock(&n->pq_mu);
    PKV_ASSERT(pl->state == PL_ENDED && !pl->taken && !pl->abandoned);
    pl->taken = true;
    bool unused = pull_unused_locked(pl);
    pthread_mutex_unlock(&n->pq_mu);
    int rc = pl->rc;
    if (t) timings_add(t, &pl->tm);
    if (rc) {
        *err = pl->err;
    } else {
        *out = pl->seq;
        *first = pl->first;
        first->given &= pl->seq != NULL; /* recomputed here: the engine samples it */
    }
    if (unused) pull_free(pl);
    return rc;
}

void pkv_disagg_pull_abandon(pkv_disagg_pull_t *pl)
{
    if (!pl) return;
    pkv_disagg_node_t *n = pl->n;
    pthread_mutex_lock(&n->pq_mu);
    PKV_ASSERT(!pl->taken && !pl->abandoned);
    pl->abandoned = true;
    bool ended = pl->state == PL_ENDED, unused = pull_unused_locked(pl);
    pkv_seq_t *drop = ended ? pl->seq : NULL;
    if (!ended) pthread_cond_signal(&n->pq_cv); /* its reads cancelled now */
    pthread_mutex_unlock(&n->pq_mu);
    pkv_seq_free(drop);
    if (unused) pull_free(pl);
}

void pkv_disagg_node_count_local(pkv_disagg_node_t *n)
{
    pthread_mutex_lock(&n->lock);
    n->pulls.local++;
    pthread_mutex_unlock(&n->lock);
}
