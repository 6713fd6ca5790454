/*
 * disagg: the decode leg's pull (docs/design/disagg.md, "The decode leg"): what this node's
 * prefix cache holds is adopted; the rest is read from the producer's ranks by the plan's
 * reads, at once, by one deadline, all or nothing, into a new sequence the engine then
 * adopts as a prefix hit. A failure reaches the client typed (or, by policy, the prompt is
 * computed here), never as an answer over wrong KV.
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

/* The reads of one pull: each one's outcome arrives on its agent's progress thread. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t left; /* reads without an outcome */
    bool failed;   /* one ended other than ok */
} dg_pull_t;

static void pull_done(void *arg, pkv_xfer_read_t *rd, int outcome)
{
    (void)rd;
    dg_pull_t *pl = arg;
    pthread_mutex_lock(&pl->mu);
    pl->left--;
    pl->failed |= outcome != PKV_OK;
    pthread_cond_signal(&pl->cv);
    pthread_mutex_unlock(&pl->mu);
}

/* Wait until every read has an outcome, or one failed, or the deadline (+1 s of slack for
 * an outcome to arrive). */
static void pull_wait(dg_pull_t *pl, uint64_t until_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(until_ns / 1000000000ull),
                          .tv_nsec = (long)(until_ns % 1000000000ull)};
    pthread_mutex_lock(&pl->mu);
    while (pl->left && !pl->failed)
        if (pthread_cond_timedwait(&pl->cv, &pl->mu, &ts) == ETIMEDOUT) break;
    pthread_mutex_unlock(&pl->mu);
}

/* Rank the outcomes of a failed pull: the one that caused it, not the cancels it caused. */
static int worse(int a, int b)
{
    if (a == PKV_OK || (a == PKV_ERR_CANCELLED && b != PKV_OK)) return b;
    return a;
}

/* Read the producer's blocks [have, want) into seq's blocks [have, want) on every local
 * rank, by one deadline: the plan's reads run at once, each local rank pulling the heads it
 * holds from the prefill ranks that hold them (have == want: a token-only release per
 * prefill rank, nothing moves). All or nothing: when one read fails the others are
 * cancelled and the pull fails (the caller frees seq: every page and pin returns). On ok
 * the positions up to want whole blocks are recorded as written (the first `cached`
 * already were: adopted). Returns the outcome; *why says whether a refusal was the engine
 * id, the block list or the layout, and *refused is the read it ended. A pull that moved
 * blocks counts its phases (and fills t) from its slowest read. */
static int pull_into(pkv_disagg_node_t *n, pkv_xfer_handle_t *const *hs, uint32_t P,
                     const char *engine_id, pkv_seq_t *seq, const int32_t *ids, uint32_t cached,
                     uint32_t want, pkv_xfer_why_t *why, dg_read_t *refused,
                     pkv_disagg_timings_t *t)
{
    const uint32_t *dst;
    uint32_t nd, bt = hs[0]->geo.block_tokens, have = cached / bt;
    int rc = pkv_seq_blocks(seq, &dst, &nd);
    if (rc || nd < want || have > want || hs[0]->n_blocks < want) return rc ? rc : PKV_ERR_INVALID;
    uint32_t n_pull = want - have, kvh = hs[0]->geo.kv_heads;
    uint32_t *idx = malloc(sizeof(uint32_t) * (n_pull ? n_pull : 1));
    dg_read_t *plan = malloc(sizeof(*plan) * ((size_t)n->tp * kvh + P));
    pkv_xfer_read_t **rd = calloc((size_t)n->tp * kvh + P, sizeof(*rd));
    dg_pull_t pl = {.left = 0};
    if (!idx || !plan || !rd || pthread_mutex_init(&pl.mu, NULL)) {
        free(idx), free(plan), free(rd);
        return PKV_ERR_NOMEM;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&pl.cv, &ca);
    pthread_condattr_destroy(&ca);
    for (uint32_t i = 0; i < n_pull; i++) idx[i] = have + i;
    uint32_t m = dg_plan(n, P, n_pull > 0, plan), started = 0;
    uint64_t t0 = pkv_now_ns();
    uint64_t deadline = t0 + (uint64_t)n->transfer_timeout_ms * 1000000ull;
    pl.left = m;
    pull_inflight(n, +1);
    for (; started < m && !rc; started++) {
        const dg_read_t *r = &plan[started];
        bool moves = r->head_n > 0;
        pkv_xfer_read_opts_t o = {.idx = idx,
                                  .identity = engine_id,
                                  .head_lo = r->head_lo,
                                  .head_n = r->head_n,
                                  .reads_total = r->total,
                                  .read_index = r->index};
        rc = pkv_xfer_read_ex(n->rank[r->d].agent, hs[r->p], &o, moves ? dst + have : NULL,
                              moves ? n_pull : 0, deadline, pull_done, &pl, &rd[started]);
    }
    free(idx);
    if (rc) { /* the one that failed to start has no outcome coming */
        started--;
        pthread_mutex_lock(&pl.mu);
        pl.left -= m - started;
        pl.failed = true;
        pthread_mutex_unlock(&pl.mu);
    }
    pull_wait(&pl, deadline + 1000000000ull);
    int outcome = rc;
    uint64_t bytes = 0, last = 0;
    pkv_xfer_read_timings_t rt = {0};
    bool timed = true;
    pthread_mutex_lock(&pl.mu); /* outcomes may still be arriving on the agents' threads */
    bool cancel_all = pl.failed || pl.left;
    pthread_mutex_unlock(&pl.mu);
    if (cancel_all) /* all or nothing: end the others now */
        for (uint32_t i = 0; i < started; i++) pkv_xfer_cancel(rd[i]);
    for (uint32_t i = 0; i < started; i++) {
        int oc = PKV_ERR_TIMEOUT;
        if (pkv_xfer_read_wait(rd[i], deadline + 1000000000ull, &oc)) {
            pkv_xfer_cancel(rd[i]);
            oc = PKV_ERR_TIMEOUT;
        }
        outcome = worse(outcome, oc);
        if (oc == PKV_ERR_REJECTED && *why == PKV_XFER_WHY_NONE) {
            *why = pkv_xfer_read_why(rd[i]);
            *refused = plan[i];
        }
        pkv_xfer_read_timings_t ri;
        if (oc == PKV_OK && plan[i].head_n && !pkv_xfer_read_timings(rd[i], &ri)) {
            if (ri.last_ns >= last) last = ri.last_ns, rt = ri;
        } else if (plan[i].head_n) {
            timed = false;
        }
        bytes += pkv_xfer_read_bytes(rd[i]);
        pkv_xfer_read_free(rd[i]);
    }
    pull_inflight(n, -1);
    free(plan);
    free(rd);
    pthread_cond_destroy(&pl.cv);
    pthread_mutex_destroy(&pl.mu);
    timed = timed && outcome == PKV_OK && n_pull && last;
    if (outcome == PKV_OK && n_pull)
        outcome = pkv_seq_append(seq, ids + cached, want * bt - cached);
    if (outcome == PKV_OK && timed) pull_phases(n, &rt, t0, pkv_now_ns(), t);
    if (outcome == PKV_OK && t) {
        t->pulled = n_pull > 0;
        t->pulled_bytes = bytes;
        t->pulled_blocks = n_pull;
    }
    return outcome;
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

static void count_pull(pkv_disagg_node_t *n, int outcome, uint32_t pulled, uint32_t adopted)
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
    }
    pthread_mutex_unlock(&n->lock);
}

int pkv_disagg_node_pull(pkv_disagg_node_t *n, const json_t *params, const int32_t *ids,
                         uint32_t n_prompt, uint64_t salt, pkv_seq_t **out, pkv_disagg_timings_t *t,
                         pkv_openai_error_t *err)
{
    pkv_xfer_handle_t *h = NULL, *hs[PKV_KV_MAX_TP] = {0};
    uint32_t P = 0;
    const char *engine_id = dg_params_engine_id(params, err);
    if (!engine_id) return PKV_ERR_INVALID;
    int rc = dg_params_handle(n, params, ids, n_prompt, &h, err);
    if (!rc) {
        rc = dg_params_ranks(n, params, h, hs, &P, err);
        P = PKV_MAX(P, 1);
    }
    if (rc == PKV_ERR_NOMEM)
        pkv_openai_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
    if (rc) {
        for (uint32_t p = 0; p < P; p++) pkv_xfer_handle_free(hs[p]);
        return rc;
    }
    /* What this node's prefix cache holds is adopted; of the whole blocks the engine will
     * adopt at admission (all but the last prompt token's: it computes at least that one)
     * only those the cache lacks are pulled; when it lacks none, the token alone goes to
     * the producer, which returns its pins at once. */
    pkv_seq_params_t sp = {.salt = salt, .tokens = ids, .n_tokens = n_prompt};
    pkv_seq_t *seq = NULL;
    uint32_t cached = 0, bt = hs[0]->geo.block_tokens, want = (n_prompt - 1) / bt;
    pkv_xfer_why_t why = PKV_XFER_WHY_NONE;
    dg_read_t refused = {0};
    char layout[192] = "";
    uint64_t until = pkv_deadline_after_ns(((uint64_t)n->transfer_timeout_ms + 1000) * 1000000ull);
    uint64_t t_alloc = pkv_now_ns();
    rc = pkv_seq_create(n->kv, &sp, &seq, &cached);
    if (!rc) { /* the histograms always, t when asked */
        uint64_t took = pkv_now_ns() - t_alloc, commit = pkv_seq_commit_ns(seq);
        pthread_mutex_lock(&n->lock);
        dg_observe_locked(n, t, PKV_DISAGG_PHASE_KV_ALLOC, commit, PKV_MAX(took, commit));
        dg_observe_locked(n, t, PKV_DISAGG_PHASE_KV_COMMIT, 0, commit);
        pthread_mutex_unlock(&n->lock);
    }
    uint32_t have = PKV_MIN(cached / bt, want);
    int outcome =
        rc ? rc : pull_into(n, hs, P, engine_id, seq, ids, have * bt, want, &why, &refused, t);
    if (outcome == PKV_ERR_REJECTED && why == PKV_XFER_WHY_LAYOUT && refused.p < P)
        layout_difference(n, refused.d, hs[refused.p]->addr, until, layout, sizeof(layout));
    for (uint32_t p = 0; p < P; p++) pkv_xfer_handle_free(hs[p]);
    if (outcome == PKV_OK && t) t->adopted_blocks = have;
    count_pull(n, outcome, want - have, have);
    if (outcome) {
        pkv_seq_free(seq);
        /* --kv-load-failure recompute: a failure that is not the client's (the producer's
         * refusal is) is answered by computing the prompt here. */
        if (n->recompute && outcome != PKV_ERR_REJECTED) {
            pthread_mutex_lock(&n->lock);
            n->pulls.recomputed++;
            pthread_mutex_unlock(&n->lock);
            *out = NULL;
            return PKV_OK;
        }
        pull_error(outcome, why, layout, err);
        return outcome;
    }
    *out = seq;
    return PKV_OK;
}

void pkv_disagg_node_count_local(pkv_disagg_node_t *n)
{
    pthread_mutex_lock(&n->lock);
    n->pulls.local++;
    pthread_mutex_unlock(&n->lock);
}
