/*
 * disagg: the node (docs/design/disagg.md): the host staging and the transfer agent of each
 * tensor-parallel rank of a prefill or decode node, their health, the node's counters,
 * phase histograms and high-water marks. The node owns the staging and the agents; the
 * pool is the server's.
 */
#include "disagg/disagg_int.h"

#include "xfer/xfer.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#define DG_FIXED_SLOTS 4
/* Per-transfer staging's default hysteresis: longer than the gap between transfers of a
 * steady load (a page freed and taken again stays committed and pinned), short enough
 * that an idle node holds no staging within seconds. */
#define DG_STAGE_IDLE_MS 5000
/* The staging's warm floor lives as long as the pool's (POOL_WARM_LIFE_MS): the largest
 * transfer of the last 30 s keeps its pages, so a request after a quiet spell does not
 * commit and first-touch them again (docs/design/stage.md). */
#define DG_STAGE_WARM_MS    30000
#define DG_STAGE_DESTROY_NS 2000000000ull /* staging returned by the agent's close */

const double pkv_disagg_phase_bounds[PKV_DISAGG_PHASE_BUCKETS] = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1,    0.25,    0.5,    1.0,   2.5,    5.0,   10.0, 30.0,  60.0};

const char *const pkv_disagg_phase_label[PKV_DISAGG_PHASE_COUNT] = {
    "prefill_queue", "prefill_compute", "lease_wait", "kv_alloc", "kv_commit",
    "handshake",     "staging_wait",    "wire",       "commit",   "decode"};

const char *const pkv_disagg_mark_label[PKV_DISAGG_MARK_COUNT] = {
    "headers", "arrival",   "pull_asked", "pull_begin", "pull_end",
    "resumed", "submitted", "admitted",   "seen",       "first_write"};

/* How long a free staging page stays committed: -1, never (fixed slots, the mirror). */
static int64_t stage_idle_ms(const pkv_server_config_t *cfg)
{
    if (cfg->staging_mode == PKV_STAGE_FIXED_SLOTS || cfg->staging_mirror) return -1;
    return cfg->staging_idle_ms ? (int64_t)cfg->staging_idle_ms : DG_STAGE_IDLE_MS;
}

/* The staging's warm floor life: -1, none (none asked, or nothing is ever returned). */
static int64_t stage_warm_ms(const pkv_server_config_t *cfg)
{
    if (stage_idle_ms(cfg) < 0 || cfg->staging_warm_ms == PKV_SERVER_STAGING_WARM_NONE) return -1;
    return cfg->staging_warm_ms ? (int64_t)cfg->staging_warm_ms : DG_STAGE_WARM_MS;
}

/* The staging: per_transfer, or fixed slots committed (and pinned) at once and never
 * returned to the OS, as the field's carve-outs are. */
static int rank_stage(const pkv_server_config_t *cfg, pkv_kv_t *kv, uint32_t max_context,
                      const pkv_kv_rank_t *rank, pkv_stage_t **out)
{
    uint32_t head_n = rank->head_n;
    pkv_stage_config_t sc;
    pkv_stage_config_default(&sc);
    if (cfg->staging_page_bytes) sc.page_bytes = (size_t)cfg->staging_page_bytes;
    const pkv_geometry_t *geo = pkv_kv_geometry(kv);
    pkv_geometry_t rg = *geo; /* one rank's share of a block: its heads */
    rg.kv_heads = head_n;
    uint64_t one = (uint64_t)PKV_DIV_UP(max_context, geo->block_tokens) *
                   pkv_geometry_token_bytes(&rg) * geo->block_tokens;
    uint64_t pages = cfg->staging_pages ? cfg->staging_pages : PKV_DIV_UP(one, sc.page_bytes) + 2;
    if (pages > UINT32_MAX) pages = UINT32_MAX;
    sc.mode = cfg->staging_mode;
    sc.peer_cap_pages = cfg->staging_peer_cap;
    int64_t idle_ms = stage_idle_ms(cfg);
    sc.idle_release_ns = idle_ms < 0 ? PKV_DEADLINE_NEVER : (uint64_t)idle_ms * 1000000ull;
    int64_t warm_ms = stage_warm_ms(cfg);
    sc.warm_life_ns = warm_ms < 0 ? 0 : (uint64_t)warm_ms * 1000000ull;
    sc.shared = cfg->staging_shared;
    sc.name = cfg->role == PKV_SERVER_ROLE_PREFILL ? "pkv-prefill" : "pkv-decode";
    if (cfg->staging_mirror) {
        /* The field's host mirror: the rank's whole device pool in host memory, committed
         * and pinned at start and never returned; transfers take their pages from it. */
        pages = PKV_DIV_UP(rank->bytes, sc.page_bytes);
        if (pages > UINT32_MAX) pages = UINT32_MAX;
        sc.mode = PKV_STAGE_PER_TRANSFER;
    }
    if (sc.mode == PKV_STAGE_FIXED_SLOTS) {
        sc.slots = cfg->staging_slots ? cfg->staging_slots : DG_FIXED_SLOTS;
        sc.slot_pages = (uint32_t)pages;
        sc.pool_pages = 0;
    } else {
        sc.pool_pages = (uint32_t)pages;
    }
    int rc = pkv_stage_create(&sc, out);
    bool whole = sc.mode == PKV_STAGE_FIXED_SLOTS || cfg->staging_mirror;
    if (rc || !whole) return rc;
    /* Commit every slot (the mirror: the whole arena) now: take each once, then give them
     * back (they stay resident). */
    uint32_t takes = cfg->staging_mirror ? 1 : sc.slots;
    uint32_t take_pages = cfg->staging_mirror ? sc.pool_pages : sc.slot_pages;
    for (uint32_t i = 0; i < takes && !rc; i++) {
        pkv_stage_grant_t *g = NULL;
        rc = pkv_stage_try_acquire(*out, i + 1, 0, take_pages, &g);
        pkv_stage_grant_free(g);
    }
    for (uint32_t i = 0; i < takes; i++) pkv_stage_release(*out, i + 1);
    if (rc) {
        PKV_LOGE("disagg", "committing the %s staging failed: %s",
                 cfg->staging_mirror ? "mirror" : "fixed slots", pkv_status_str(rc));
        pkv_stage_destroy(*out, pkv_deadline_after_ns(DG_STAGE_DESTROY_NS), NULL);
        *out = NULL;
    }
    return rc;
}

/* remote_host and the port from the agent's "host:port" (or --kv-advertise). */
static void rank_address(dg_rank_t *n, const char *advertise)
{
    const char *addr = pkv_xfer_agent_address(n->agent);
    const char *colon = strrchr(addr, ':');
    n->port = colon ? (uint16_t)atoi(colon + 1) : 0;
    if (advertise) {
        snprintf(n->host, sizeof(n->host), "%s", advertise);
        return;
    }
    size_t len = colon ? (size_t)(colon - addr) : strlen(addr);
    if (len >= 2 && addr[0] == '[' && addr[len - 1] == ']') addr++, len -= 2;
    snprintf(n->host, sizeof(n->host), "%.*s", (int)len, addr);
}

/* Rank r's staging and agent; rank r listens on port + r when a port is given. */
static int rank_start(pkv_disagg_node_t *n, const pkv_server_config_t *cfg, uint32_t max_context,
                      const char *model_id, uint32_t r)
{
    dg_rank_t *k = &n->rank[r];
    pkv_kv_rank_t info;
    int rc = pkv_kv_rank(n->kv, r, &info);
    if (rc) return rc;
    k->node = n;
    k->index = r;
    k->head_lo = info.head_lo;
    k->head_n = info.head_n;
    if ((rc = rank_stage(cfg, n->kv, max_context, &info, &k->stage))) return rc;
    uint32_t port = cfg->kv_listen_port ? cfg->kv_listen_port + r : 0;
    if (port > 65535) {
        PKV_LOGE("disagg", "--kv-listen port %u + rank %u is above 65535", cfg->kv_listen_port, r);
        return PKV_ERR_INVALID;
    }
    pkv_xfer_config_t xc = {.kv = n->kv,
                            .stage = k->stage,
                            .rank = r,
                            .model_id = model_id,
                            .listen_host = cfg->kv_listen_host,
                            .listen_port = (uint16_t)port,
                            .identity = n->engine_id}; /* presented to decode nodes */
    rc = pkv_xfer_agent_create(&xc, &k->agent);
    if (rc) {
        PKV_LOGE("disagg", "the transfer agent of rank %u cannot start on %s:%u: %s", r,
                 cfg->kv_listen_host ? cfg->kv_listen_host : "127.0.0.1", port, pkv_status_str(rc));
        return rc;
    }
    rank_address(k, cfg->kv_advertise);
    return PKV_OK;
}

int pkv_disagg_node_create(const pkv_server_config_t *cfg, pkv_kv_t *kv, uint32_t max_context,
                           const char *model_id, pkv_disagg_node_t **out)
{
    if (pkv_kv_backend(kv) != PKV_BACKEND_PAGED) {
        PKV_LOGE("disagg", "--role %s needs the paged KV backend", pkv_server_role_name(cfg->role));
        return PKV_ERR_INVALID;
    }
    pkv_disagg_node_t *n = calloc(1, sizeof(*n));
    if (!n) return PKV_ERR_NOMEM;
    n->tp = pkv_kv_tp(kv);
    if (!(n->rank = calloc(n->tp, sizeof(*n->rank))) || pthread_mutex_init(&n->lock, NULL)) {
        free(n->rank);
        free(n);
        return PKV_ERR_NOMEM;
    }
    n->peaks_since_ns = pkv_now_ns();
    n->role = cfg->role;
    n->kv = kv;
    n->lease_ms = cfg->kv_lease_ms ? cfg->kv_lease_ms : 30000;
    n->transfer_timeout_ms = cfg->kv_transfer_timeout_ms ? cfg->kv_transfer_timeout_ms : 10000;
    n->staging_idle_ms = stage_idle_ms(cfg);
    n->staging_warm_ms = stage_warm_ms(cfg);
    n->recompute = cfg->kv_load_recompute;
    atomic_init(&n->stopping, false);
    uint8_t rnd[16];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd)) {
        uint64_t x = pkv_now_ns();
        for (size_t i = 0; i < sizeof(rnd); i++) rnd[i] = (uint8_t)pkv_splitmix64(&x);
    }
    memcpy(n->engine_id, "pagekv-", 7);
    pkv_hex_encode(rnd, sizeof(rnd), n->engine_id + 7);
    int rc = dg_pulls_start(n);
    for (uint32_t r = 0; r < n->tp && !rc; r++) rc = rank_start(n, cfg, max_context, model_id, r);
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
    atomic_store(&n->stopping, true);
    dg_pulls_stop(n); /* every pull in flight ends (cancelled) while the agents still run */
    for (uint32_t r = 0; r < n->tp; r++) pkv_xfer_agent_destroy(n->rank[r].agent);
    for (uint32_t r = 0; r < n->tp; r++)
        if (n->rank[r].stage)
            pkv_stage_destroy(n->rank[r].stage, pkv_deadline_after_ns(DG_STAGE_DESTROY_NS), NULL);
    pthread_mutex_destroy(&n->lock);
    free(n->rank);
    free(n);
}

const char *pkv_disagg_node_address(const pkv_disagg_node_t *n)
{
    return pkv_xfer_agent_address(n->rank[0].agent);
}

/* Every rank's agent must be alive; *age_ns is the oldest beat. */
bool pkv_disagg_node_healthy(pkv_disagg_node_t *n, uint64_t *age_ns)
{
    *age_ns = 0;
    bool ok = !atomic_load(&n->stopping);
    for (uint32_t r = 0; r < n->tp; r++) {
        uint64_t age = 0;
        ok = n->rank[r].agent &&
             pkv_xfer_agent_alive(n->rank[r].agent, PKV_DISAGG_AGENT_STALL_NS, &age) && ok;
        *age_ns = PKV_MAX(*age_ns, age);
    }
    return ok;
}

/* Under n->lock. */
void dg_observe_locked(pkv_disagg_node_t *n, pkv_disagg_timings_t *t, pkv_disagg_phase_t ph,
                       uint64_t from_ns, uint64_t to_ns)
{
    uint64_t d = to_ns > from_ns ? to_ns - from_ns : 0;
    pkv_hist_add(&n->phases[ph], pkv_disagg_phase_bounds, PKV_DISAGG_PHASE_BUCKETS,
                 (double)d / 1e9);
    if (t) {
        t->ns[ph] = d;
        t->have |= 1u << ph;
    }
}

void pkv_disagg_node_observe(pkv_disagg_node_t *n, pkv_disagg_timings_t *t, pkv_disagg_phase_t ph,
                             uint64_t from_ns, uint64_t to_ns)
{
    pthread_mutex_lock(&n->lock);
    dg_observe_locked(n, t, ph, from_ns, to_ns);
    pthread_mutex_unlock(&n->lock);
}

/* The node's totals: every counter of the agents' stats summed (all uint64_t). */
static void xs_add(pkv_xfer_stats_t *sum, const pkv_xfer_stats_t *x)
{
    _Static_assert(sizeof(pkv_xfer_stats_t) % sizeof(uint64_t) == 0, "all uint64_t");
    uint64_t *a = (uint64_t *)sum;
    const uint64_t *b = (const uint64_t *)x;
    for (size_t i = 0; i < sizeof(*x) / sizeof(uint64_t); i++) a[i] += b[i];
}

/* The staging figures the node reports, summed over ranks (peaks: the sum of each rank's). */
static void ss_add(pkv_stage_stats_t *sum, const pkv_stage_stats_t *s)
{
    sum->mode = s->mode;
    sum->page_bytes = s->page_bytes;
    sum->pages_total += s->pages_total;
    sum->pages_free += s->pages_free;
    sum->pages_used += s->pages_used;
    sum->pages_peak_used += s->pages_peak_used;
    sum->resident_bytes += s->resident_bytes;
    sum->resident_peak_bytes += s->resident_peak_bytes;
    sum->pinned_bytes += s->pinned_bytes;
    sum->warm_floor_pages += s->warm_floor_pages;
    sum->waits += s->waits;
    /* every rank stages its slice of each transfer: the ranks' largest */
    sum->transfers_peak = PKV_MAX(sum->transfers_peak, s->transfers_peak);
}

void pkv_disagg_node_snapshot(pkv_disagg_node_t *n, pkv_disagg_snapshot_t *out)
{
    memset(out, 0, offsetof(pkv_disagg_snapshot_t, ranks));
    out->role = n->role;
    out->tp = n->tp;
    out->address = pkv_xfer_agent_address(n->rank[0].agent);
    out->advertise = n->rank[0].host;
    out->port = n->rank[0].port;
    out->engine_id = n->engine_id;
    out->lease_ms = n->lease_ms;
    out->transfer_timeout_ms = n->transfer_timeout_ms;
    out->staging_idle_ms = n->staging_idle_ms;
    out->staging_warm_ms = n->staging_warm_ms;
    for (uint32_t r = 0; r < n->tp; r++) {
        const dg_rank_t *k = &n->rank[r];
        pkv_xfer_stats_t xs;
        pkv_stage_stats_t ss;
        pkv_xfer_stats(k->agent, &xs);
        pkv_stage_stats(k->stage, &ss);
        xs_add(&out->xs, &xs);
        ss_add(&out->ss, &ss);
        out->ranks[r] = (pkv_disagg_rank_snapshot_t){.address = pkv_xfer_agent_address(k->agent),
                                                     .port = k->port,
                                                     .head_lo = k->head_lo,
                                                     .head_n = k->head_n,
                                                     .pinned_bytes = ss.pinned_bytes,
                                                     .resident_bytes = ss.resident_bytes,
                                                     .resident_peak_bytes = ss.resident_peak_bytes,
                                                     .pages_used = ss.pages_used,
                                                     .pages_peak_used = ss.pages_peak_used,
                                                     .bytes_sent = xs.bytes_sent,
                                                     .bytes_received = xs.bytes_received,
                                                     .active_transfers = xs.active_transfers};
    }
    out->agent_alive = pkv_disagg_node_healthy(n, &out->agent_age_ns);
    pthread_mutex_lock(&n->lock);
    out->leases = n->leases;
    out->pulls = n->pulls;
    memcpy(out->phases, n->phases, sizeof(out->phases));
    pthread_mutex_unlock(&n->lock);
}

json_t *pkv_disagg_node_peaks_reset(pkv_disagg_node_t *n)
{
    pkv_stage_stats_t sum;
    memset(&sum, 0, sizeof(sum));
    for (uint32_t r = 0; r < n->tp; r++) {
        pkv_stage_stats_t ss;
        pkv_stage_peaks_reset(n->rank[r].stage, &ss);
        ss_add(&sum, &ss);
    }
    uint64_t now = pkv_now_ns();
    pthread_mutex_lock(&n->lock);
    uint64_t fly = n->pulls.inflight_peak, since = n->peaks_since_ns;
    n->pulls.inflight_peak = n->pulls.inflight;
    n->peaks_since_ns = now;
    pthread_mutex_unlock(&n->lock);
    return json_pack("{s:I, s:{s:I, s:I, s:I, s:I}, s:{s:I}}", "window_ms",
                     (json_int_t)((now - since) / 1000000), "staging", "page_bytes",
                     (json_int_t)sum.page_bytes, "pages_peak_used", (json_int_t)sum.pages_peak_used,
                     "transfers_peak", (json_int_t)sum.transfers_peak, "resident_peak_bytes",
                     (json_int_t)sum.resident_peak_bytes, "pulls", "inflight_peak",
                     (json_int_t)fly);
}
