/* disagg: prefill and decode nodes on the built-in model (see disagg/disagg.h). */
#include "disagg/disagg.h"

#include "core/core.h"
#include "engine/engine.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DG_STAGE_DESTROY_NS 2000000000ull /* staging returned by the agent's close */
#define DG_UNREGISTER_NS    1000000000ull /* an unregistration's callback */
#define DG_IDLE_NS          2000000000ull /* a lease's transfers going idle before its free */

struct pkv_disagg_node {
    pkv_model_t *model;
    pkv_kv_t *kv;
    pkv_stage_t *stage;
    pkv_xfer_agent_t *agent;
    float *logits; /* (vocab) prefill's scratch */
    pkv_dtype_t dtype;
};

struct pkv_disagg_lease {
    pkv_disagg_node_t *node;
    uint64_t request_id;
    pkv_seq_t *seq;
    pkv_xfer_handle_t *h;
    int32_t first;
    uint64_t prefill_ns;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* monotonic */
    int end;           /* PKV_DISAGG_LEASE_OPEN until the registration's callback */
};

/* ---- nodes ------------------------------------------------------------------------------ */
static int dg_model(const pkv_disagg_node_config_t *c, pkv_model_t **out)
{
    pkv_model_config_t mc;
    int rc = pkv_model_preset(c->preset ? c->preset : PKV_DISAGG_DEFAULT_PRESET, &mc);
    if (rc) return rc;
    mc.vocab_size = (uint32_t)c->vocab;
    return pkv_model_create_builtin(&mc, c->weights_seed ? c->weights_seed : 1, NULL, out);
}

static int dg_kv(const pkv_model_t *m, pkv_dtype_t dtype, pkv_kv_t **out)
{
    pkv_kv_config_t kc = {.backend = PKV_BACKEND_PAGED, .hugepages = true};
    pkv_model_geometry(m, dtype, 16, &kc.geo);
    return pkv_kv_create(&kc, out);
}

/* Staging for one transfer of `tokens` positions in whole blocks (plus slack for a run's
 * rounding). */
static int dg_stage(const pkv_disagg_node_config_t *c, pkv_kv_t *kv, pkv_stage_t **out)
{
    uint32_t bt = pkv_kv_geometry(kv)->block_tokens;
    uint64_t bytes = (uint64_t)PKV_DIV_UP(c->stage_tokens, bt) * pkv_kv_block_bytes(kv);
    pkv_stage_config_t sc;
    pkv_stage_config_default(&sc);
    sc.pool_pages = (uint32_t)PKV_DIV_UP(bytes, sc.page_bytes) + 2;
    sc.shared = c->shared_stage;
    sc.name = c->stage_name ? c->stage_name : "pkv-disagg";
    return pkv_stage_create(&sc, out);
}

int pkv_disagg_node_create(const pkv_disagg_node_config_t *c, pkv_disagg_node_t **out)
{
    if (!c || !out || c->vocab <= 0) return PKV_ERR_INVALID;
    pkv_disagg_node_t *n = calloc(1, sizeof(*n));
    if (!n) return PKV_ERR_NOMEM;
    n->dtype = c->dtype;
    n->logits = malloc(sizeof(float) * (size_t)c->vocab);
    int rc = n->logits ? PKV_OK : PKV_ERR_NOMEM;
    if (!rc) rc = dg_model(c, &n->model);
    if (!rc) rc = dg_kv(n->model, c->dtype, &n->kv);
    if (!rc) rc = dg_stage(c, n->kv, &n->stage);
    if (!rc) {
        pkv_xfer_config_t xc = {.kv = n->kv, .stage = n->stage, .no_shared = c->no_shared};
        rc = pkv_xfer_agent_create(&xc, &n->agent);
    }
    if (rc) {
        pkv_disagg_node_destroy(n);
        return rc;
    }
    *out = n;
    return PKV_OK;
}

void pkv_disagg_node_destroy(pkv_disagg_node_t *n)
{
    if (!n) return;
    pkv_xfer_agent_destroy(n->agent);
    size_t leaked = 0;
    if (n->stage) pkv_stage_destroy(n->stage, pkv_deadline_after_ns(DG_STAGE_DESTROY_NS), &leaked);
    if (n->kv) pkv_kv_destroy(n->kv);
    pkv_model_destroy(n->model);
    free(n->logits);
    free(n);
}

pkv_model_t *pkv_disagg_node_model(const pkv_disagg_node_t *n)
{
    return n->model;
}
pkv_kv_t *pkv_disagg_node_kv(const pkv_disagg_node_t *n)
{
    return n->kv;
}
pkv_stage_t *pkv_disagg_node_stage(const pkv_disagg_node_t *n)
{
    return n->stage;
}
pkv_xfer_agent_t *pkv_disagg_node_agent(const pkv_disagg_node_t *n)
{
    return n->agent;
}

int pkv_disagg_pool_create(const pkv_disagg_node_t *n, pkv_kv_t **out)
{
    return dg_kv(n->model, n->dtype, out);
}

/* ---- compute and compare ---------------------------------------------------------------- */
int pkv_disagg_seq_create(pkv_kv_t *kv, const int32_t *ids, uint32_t n, uint32_t extra,
                          pkv_seq_t **out)
{
    pkv_seq_params_t sp = {.tokens = ids, .n_tokens = n, .reserve_tokens = n + extra};
    uint32_t cached;
    return pkv_seq_create(kv, &sp, out, &cached);
}

int pkv_disagg_forward(pkv_model_t *m, pkv_kv_t *kv, pkv_seq_t *seq, const int32_t *ids, uint32_t n,
                       float *logits, int32_t *next)
{
    pkv_model_item_t it = {.seq = seq, .tokens = ids, .n_tokens = n, .logits = logits};
    int rc = pkv_model_forward(m, kv, &it, 1);
    if (rc == PKV_OK) *next = pkv_engine_sample_argmax(logits, pkv_model_config(m)->vocab_size);
    return rc;
}

int pkv_disagg_generate(pkv_model_t *m, pkv_kv_t *kv, pkv_seq_t *seq, const pkv_tok_t *tok,
                        int32_t first, uint32_t max, float *logits, int32_t *out)
{
    uint32_t k = 0;
    out[k++] = first;
    while (k < max && !pkv_tok_is_stop(tok, out[k - 1])) {
        int rc = pkv_disagg_forward(m, kv, seq, &out[k - 1], 1, logits, &out[k]);
        if (rc) return rc;
        k++;
    }
    return (int)k;
}

bool pkv_disagg_kv_equal(pkv_kv_t *a, const pkv_seq_t *sa, pkv_kv_t *b, const pkv_seq_t *sb,
                         uint32_t n)
{
    const pkv_geometry_t *g = pkv_kv_geometry(a);
    const uint32_t *ia, *ib;
    uint32_t na, nb, need = PKV_DIV_UP(n, g->block_tokens);
    if (pkv_seq_blocks(sa, &ia, &na) || pkv_seq_blocks(sb, &ib, &nb) || na < need || nb < need)
        return false;
    size_t tok_bytes = (size_t)g->head_dim * pkv_dtype_size(g->dtype);
    for (uint32_t k = 0; k < need; k++) {
        uint32_t toks = PKV_MIN(g->block_tokens, n - k * g->block_tokens);
        for (uint32_t l = 0; l < g->layers; l++)
            for (uint32_t w = 0; w < 2; w++)
                for (uint32_t hd = 0; hd < g->kv_heads; hd++) {
                    const void *x = pkv_kv_block_head(a, ia[k], l, w, hd);
                    const void *y = pkv_kv_block_head(b, ib[k], l, w, hd);
                    if (!x || !y || memcmp(x, y, toks * tok_bytes)) return false;
                }
    }
    return true;
}

/* ---- prefill ---------------------------------------------------------------------------- */
static void dg_sent(void *arg, uint64_t request_id, int outcome)
{
    pkv_disagg_lease_t *l = arg;
    (void)request_id;
    pthread_mutex_lock(&l->mu);
    l->end = outcome;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

static void dg_lease_release(pkv_disagg_lease_t *l)
{
    pkv_xfer_handle_free(l->h);
    if (l->seq) pkv_seq_free(l->seq);
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

int pkv_disagg_prefill(pkv_disagg_node_t *node, uint64_t request_id, const int32_t *ids, uint32_t n,
                       uint64_t lease_ns, pkv_disagg_lease_t **out)
{
    if (!node || !ids || !n || !out) return PKV_ERR_INVALID;
    pkv_disagg_lease_t *l = calloc(1, sizeof(*l));
    if (!l) return PKV_ERR_NOMEM;
    l->node = node;
    l->request_id = request_id;
    l->end = PKV_DISAGG_LEASE_OPEN;
    if (pthread_mutex_init(&l->mu, NULL)) {
        free(l);
        return PKV_ERR_NOMEM;
    }
    if (pkv_cond_init_monotonic(&l->cv)) {
        pthread_mutex_destroy(&l->mu);
        free(l);
        return PKV_ERR_NOMEM;
    }
    int rc = pkv_disagg_seq_create(node->kv, ids, n, 0, &l->seq);
    if (!rc) {
        uint64_t t0 = pkv_now_ns();
        rc = pkv_disagg_forward(node->model, node->kv, l->seq, ids, n, node->logits, &l->first);
        l->prefill_ns = pkv_now_ns() - t0;
    }
    const uint32_t *blocks = NULL;
    uint32_t nb = 0;
    if (!rc) rc = pkv_seq_blocks(l->seq, &blocks, &nb);
    if (!rc)
        rc = pkv_xfer_register(node->agent, request_id, blocks, nb, pkv_now_ns() + lease_ns,
                               dg_sent, l, &l->h);
    if (rc) {
        dg_lease_release(l); /* never registered: no callback refers to it */
        return rc;
    }
    *out = l;
    return PKV_OK;
}

const pkv_xfer_handle_t *pkv_disagg_lease_handle(const pkv_disagg_lease_t *l)
{
    return l->h;
}
int32_t pkv_disagg_lease_first(const pkv_disagg_lease_t *l)
{
    return l->first;
}
uint64_t pkv_disagg_lease_prefill_ns(const pkv_disagg_lease_t *l)
{
    return l->prefill_ns;
}

int pkv_disagg_lease_wait(pkv_disagg_lease_t *l, uint64_t deadline_ns)
{
    pthread_mutex_lock(&l->mu);
    while (l->end == PKV_DISAGG_LEASE_OPEN && pkv_now_ns() < deadline_ns) {
        struct timespec ts = pkv_deadline_to_monotonic(deadline_ns);
        pthread_cond_timedwait(&l->cv, &l->mu, &ts);
    }
    int end = l->end;
    pthread_mutex_unlock(&l->mu);
    return end;
}

int pkv_disagg_lease_end(pkv_disagg_lease_t *l, uint64_t grace_deadline_ns)
{
    /* Unregistering one that ended meanwhile is NOTFOUND: either way its callback says
     * how it ended. */
    int end = pkv_disagg_lease_wait(l, grace_deadline_ns);
    if (end == PKV_DISAGG_LEASE_OPEN) {
        pkv_xfer_unregister(l->node->agent, l->request_id);
        end = pkv_disagg_lease_wait(l, pkv_now_ns() + DG_UNREGISTER_NS);
    }
    return end;
}

void pkv_disagg_lease_free(pkv_disagg_lease_t *l)
{
    if (!l) return;
    if (pkv_disagg_lease_end(l, 0) == PKV_DISAGG_LEASE_OPEN)
        return; /* its callback never came: it may still run, so the lease stays (leaked) */
    pkv_xfer_wait_idle(l->node->agent, pkv_now_ns() + DG_IDLE_NS);
    dg_lease_release(l);
}

/* ---- decode ----------------------------------------------------------------------------- */
int pkv_disagg_pull(pkv_disagg_node_t *node, const pkv_xfer_handle_t *h, pkv_seq_t *seq,
                    const int32_t *ids, uint32_t n, uint64_t deadline_ns, pkv_disagg_pull_t *r)
{
    const uint32_t *dst = NULL;
    uint32_t nd = 0;
    if (!node || !h || !seq || !r || pkv_seq_blocks(seq, &dst, &nd)) return PKV_ERR_INVALID;
    /* The handle must cover exactly the prompt's positions, which the caller goes on from. */
    if (nd < h->n_blocks || h->n_blocks != PKV_DIV_UP(n, pkv_kv_geometry(node->kv)->block_tokens))
        return PKV_ERR_INVALID;
    pkv_disagg_pull_t res = {.bytes = (uint64_t)h->n_blocks * pkv_kv_block_bytes(node->kv)};
    pkv_stage_stats_t before, after;
    pkv_stage_stats(node->stage, &before);
    pkv_xfer_read_t *rd = NULL;
    uint64_t t0 = pkv_now_ns();
    int rc = pkv_xfer_read(node->agent, h, dst, h->n_blocks, deadline_ns, NULL, NULL, &rd);
    if (rc == PKV_OK && pkv_xfer_read_wait(rd, deadline_ns + 1000000000ull, &res.outcome))
        res.outcome = PKV_ERR_TIMEOUT; /* cannot happen: every read ends by its deadline */
    if (rc != PKV_OK) res.outcome = rc;
    res.transfer_ns = pkv_now_ns() - t0;
    pkv_xfer_read_free(rd);
    /* Which way the payload went: through our own staging (UCX), or not at all (the
     * producer's arena, mapped; the agent falls back to UCX where it cannot map it). */
    pkv_stage_stats(node->stage, &after);
    res.shared_arena = res.outcome == PKV_OK && after.acquires == before.acquires;
    *r = res;
    return res.outcome == PKV_OK ? pkv_seq_append(seq, ids, n) : PKV_OK;
}
