/*
 * server roles: the transfer agent and host staging of a prefill or decode node
 * (docs/design/server.md, "Roles"). The node owns both; the pool is the server's. A
 * prefill leg's blocks are registered with the agent under pagekv's own request id and
 * a lease; the agent holds their pins until a decode leg acknowledges a read, the lease
 * expires, or the agent is destroyed, and then returns them (full blocks stay in the
 * prefix cache). The lease counters are updated by the agent's callback (its progress
 * thread) under n->lock, as are the phase histograms (the callback's serve phases, the
 * handlers' pull and engine phases).
 */
#include "server/server_int.h"

#include "core/core.h"
#include "server/request.h"
#include "xfer/xfer.h"

#include <openssl/sha.h>
#include <pthread.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <time.h>
#include <sys/random.h>

#define KVN_FIXED_SLOTS 4
/* Per-transfer staging's default hysteresis: longer than the gap between transfers of a
 * steady load (a page freed and taken again stays committed and pinned), short enough
 * that an idle node holds no staging within seconds. */
#define KVN_STAGE_IDLE_MS    5000
#define KVN_STAGE_DESTROY_NS 2000000000ull /* staging returned by the agent's close */

/* One tensor-parallel rank of the node: its staging and its agent, which registers, serves
 * from and writes into the pool rank's storage range. */
typedef struct {
    struct srv_kvnode *node;
    uint32_t index, head_lo, head_n;
    pkv_stage_t *stage;
    pkv_xfer_agent_t *agent;
    char host[PKV_XFER_ADDR_MAX]; /* remote_host */
    uint16_t port;                /* the agent's bound port */
} kvn_rank_t;

struct srv_kvnode {
    pkv_server_role_t role;
    pkv_kv_t *kv;
    uint32_t tp;        /* ranks: the pool's */
    kvn_rank_t *rank;   /* [tp] */
    char engine_id[40]; /* "pagekv-" + 16 random bytes in hex, presented by every rank */
    uint32_t lease_ms, transfer_timeout_ms;
    int64_t staging_idle_ms; /* -1: staging never returned (fixed slots, the mirror) */
    bool recompute;          /* --kv-load-failure recompute */
    atomic_bool stopping;
    /* Test hook (PKV_TEST_RANK_FAULT=hang:R): rank R's agent stops for good once it has
     * sent a layer, as a rank that died would (no messages, no heartbeats), until destroy. */
    uint32_t hang_rank; /* UINT32_MAX: none */
    pthread_mutex_t hang_mu;
    pthread_cond_t hang_cv;
    bool hang_release;
    pthread_mutex_t lock;    /* guards leases, pulls, phases, peaks_since_ns */
    uint64_t peaks_since_ns; /* the high-water marks' window began (creation or a reset) */
    srv_lease_counts_t leases;
    srv_pull_counts_t pulls;
    srv_hist_t phases[SRV_PHASE_COUNT];
};

static void hex(const uint8_t *b, size_t n, char *out)
{
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) out[2 * i] = d[b[i] >> 4], out[2 * i + 1] = d[b[i] & 15];
    out[2 * n] = 0;
}

/* How long a free staging page stays committed: -1, never (fixed slots, the mirror). */
static int64_t kvn_stage_idle_ms(const pkv_server_config_t *cfg)
{
    if (cfg->staging_mode == PKV_STAGE_FIXED_SLOTS || cfg->staging_mirror) return -1;
    return cfg->staging_idle_ms ? (int64_t)cfg->staging_idle_ms : KVN_STAGE_IDLE_MS;
}

/* The staging: per_transfer, or fixed slots committed (and pinned) at once and never
 * returned to the OS, as the field's carve-outs are. */
static int kvn_stage(const pkv_server_config_t *cfg, pkv_kv_t *kv, uint32_t max_context,
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
    int64_t idle_ms = kvn_stage_idle_ms(cfg);
    sc.idle_release_ns = idle_ms < 0 ? PKV_DEADLINE_NEVER : (uint64_t)idle_ms * 1000000ull;
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
        sc.slots = cfg->staging_slots ? cfg->staging_slots : KVN_FIXED_SLOTS;
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
        PKV_LOGE("server", "committing the %s staging failed: %s",
                 cfg->staging_mirror ? "mirror" : "fixed slots", pkv_status_str(rc));
        pkv_stage_destroy(*out, pkv_deadline_after_ns(KVN_STAGE_DESTROY_NS), NULL);
        *out = NULL;
    }
    return rc;
}

/* remote_host and the port from the agent's "host:port" (or --kv-advertise). */
static void kvn_address(kvn_rank_t *n, const char *advertise)
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

static void lease_ended(void *arg, uint64_t request_id, int outcome);

static void hang_hook(void *arg, pkv_xfer_fault_point_t point, uint32_t layer)
{
    (void)layer;
    srv_kvnode_t *n = arg;
    if (point != PKV_XFER_FAULT_SERVE_LAYER_SENT) return;
    PKV_LOGW("server", "test hook: rank %u's agent stops (PKV_TEST_RANK_FAULT)", n->hang_rank);
    pthread_mutex_lock(&n->hang_mu);
    while (!n->hang_release) pthread_cond_wait(&n->hang_cv, &n->hang_mu);
    pthread_mutex_unlock(&n->hang_mu);
}

/* PKV_TEST_RANK_FAULT=hang:R (tests only): the rank whose agent hangs, or UINT32_MAX. */
static uint32_t hang_rank_of_env(uint32_t tp)
{
    const char *e = getenv("PKV_TEST_RANK_FAULT");
    if (!e || strncmp(e, "hang:", 5)) return UINT32_MAX;
    char *end;
    unsigned long r = strtoul(e + 5, &end, 10);
    return *end || r >= tp ? UINT32_MAX : (uint32_t)r;
}

/* Rank r's staging and agent; rank r listens on port + r when a port is given. */
static int kvn_rank_start(srv_kvnode_t *n, const pkv_server_config_t *cfg, uint32_t max_context,
                          const char *model_id, uint32_t r)
{
    kvn_rank_t *k = &n->rank[r];
    pkv_kv_rank_t info;
    int rc = pkv_kv_rank(n->kv, r, &info);
    if (rc) return rc;
    k->node = n;
    k->index = r;
    k->head_lo = info.head_lo;
    k->head_n = info.head_n;
    if ((rc = kvn_stage(cfg, n->kv, max_context, &info, &k->stage))) return rc;
    uint32_t port = cfg->kv_listen_port ? cfg->kv_listen_port + r : 0;
    if (port > 65535) {
        PKV_LOGE("server", "--kv-listen port %u + rank %u is above 65535", cfg->kv_listen_port, r);
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
        PKV_LOGE("server", "the transfer agent of rank %u cannot start on %s:%u: %s", r,
                 cfg->kv_listen_host ? cfg->kv_listen_host : "127.0.0.1", port, pkv_status_str(rc));
        return rc;
    }
    kvn_address(k, cfg->kv_advertise);
    if (r == n->hang_rank) {
        pkv_xfer_faults_t f = {.fn = hang_hook, .arg = n, .corrupt_layer = -1};
        pkv_xfer_set_faults(k->agent, &f);
    }
    return PKV_OK;
}

int srv_kvnode_create(const pkv_server_config_t *cfg, pkv_kv_t *kv, uint32_t max_context,
                      const char *model_id, srv_kvnode_t **out)
{
    if (pkv_kv_backend(kv) != PKV_BACKEND_PAGED) {
        PKV_LOGE("server", "--role %s needs the paged KV backend", pkv_server_role_name(cfg->role));
        return PKV_ERR_INVALID;
    }
    srv_kvnode_t *n = calloc(1, sizeof(*n));
    if (!n) return PKV_ERR_NOMEM;
    n->tp = pkv_kv_tp(kv);
    if (!(n->rank = calloc(n->tp, sizeof(*n->rank))) || pthread_mutex_init(&n->lock, NULL)) {
        free(n->rank);
        free(n);
        return PKV_ERR_NOMEM;
    }
    n->peaks_since_ns = pkv_now_ns();
    pthread_mutex_init(&n->hang_mu, NULL);
    pthread_cond_init(&n->hang_cv, NULL);
    n->hang_rank = hang_rank_of_env(n->tp);
    n->role = cfg->role;
    n->kv = kv;
    n->lease_ms = cfg->kv_lease_ms ? cfg->kv_lease_ms : 30000;
    n->transfer_timeout_ms = cfg->kv_transfer_timeout_ms ? cfg->kv_transfer_timeout_ms : 10000;
    n->staging_idle_ms = kvn_stage_idle_ms(cfg);
    n->recompute = cfg->kv_load_recompute;
    atomic_init(&n->stopping, false);
    uint8_t rnd[16];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd)) {
        uint64_t x = pkv_now_ns();
        for (size_t i = 0; i < sizeof(rnd); i++) rnd[i] = (uint8_t)pkv_splitmix64(&x);
    }
    memcpy(n->engine_id, "pagekv-", 7);
    hex(rnd, sizeof(rnd), n->engine_id + 7);
    int rc = PKV_OK;
    for (uint32_t r = 0; r < n->tp && !rc; r++)
        rc = kvn_rank_start(n, cfg, max_context, model_id, r);
    if (rc) {
        srv_kvnode_destroy(n);
        return rc;
    }
    *out = n;
    return PKV_OK;
}

void srv_kvnode_destroy(srv_kvnode_t *n)
{
    if (!n) return;
    atomic_store(&n->stopping, true);
    pthread_mutex_lock(&n->hang_mu);
    n->hang_release = true;
    pthread_cond_broadcast(&n->hang_cv);
    pthread_mutex_unlock(&n->hang_mu);
    for (uint32_t r = 0; r < n->tp; r++) pkv_xfer_agent_destroy(n->rank[r].agent);
    for (uint32_t r = 0; r < n->tp; r++)
        if (n->rank[r].stage)
            pkv_stage_destroy(n->rank[r].stage, pkv_deadline_after_ns(KVN_STAGE_DESTROY_NS), NULL);
    pthread_mutex_destroy(&n->lock);
    pthread_mutex_destroy(&n->hang_mu);
    pthread_cond_destroy(&n->hang_cv);
    free(n->rank);
    free(n);
}

const char *srv_kvnode_address(const srv_kvnode_t *n)
{
    return pkv_xfer_agent_address(n->rank[0].agent);
}

/* Every rank's agent must be alive; *age_ns is the oldest beat. */
bool srv_kvnode_healthy(srv_kvnode_t *n, uint64_t *age_ns)
{
    *age_ns = 0;
    bool ok = !atomic_load(&n->stopping);
    for (uint32_t r = 0; r < n->tp; r++) {
        uint64_t age = 0;
        ok = n->rank[r].agent && pkv_xfer_agent_alive(n->rank[r].agent, SRV_AGENT_STALL_NS, &age) &&
             ok;
        *age_ns = PKV_MAX(*age_ns, age);
    }
    return ok;
}

/* Under n->lock. */
static void observe_locked(srv_kvnode_t *n, srv_timings_t *t, srv_phase_t ph, uint64_t from_ns,
                           uint64_t to_ns)
{
    uint64_t d = to_ns > from_ns ? to_ns - from_ns : 0;
    srv_hist_add_in(&n->phases[ph], srv_phase_bounds, SRV_PHASE_BUCKETS, (double)d / 1e9);
    if (t) {
        t->ns[ph] = d;
        t->have |= 1u << ph;
    }
}

void srv_kvnode_observe(srv_kvnode_t *n, srv_timings_t *t, srv_phase_t ph, uint64_t from_ns,
                        uint64_t to_ns)
{
    pthread_mutex_lock(&n->lock);
    observe_locked(n, t, ph, from_ns, to_ns);
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
    sum->waits += s->waits;
    /* every rank stages its slice of each transfer: the ranks' largest */
    sum->transfers_peak = PKV_MAX(sum->transfers_peak, s->transfers_peak);
}

void srv_kvnode_snapshot(srv_kvnode_t *n, srv_kv_snapshot_t *out)
{
    memset(out, 0, offsetof(srv_kv_snapshot_t, ranks));
    out->role = n->role;
    out->tp = n->tp;
    out->address = pkv_xfer_agent_address(n->rank[0].agent);
    out->advertise = n->rank[0].host;
    out->port = n->rank[0].port;
    out->engine_id = n->engine_id;
    out->lease_ms = n->lease_ms;
    out->transfer_timeout_ms = n->transfer_timeout_ms;
    out->staging_idle_ms = n->staging_idle_ms;
    for (uint32_t r = 0; r < n->tp; r++) {
        const kvn_rank_t *k = &n->rank[r];
        pkv_xfer_stats_t xs;
        pkv_stage_stats_t ss;
        pkv_xfer_stats(k->agent, &xs);
        pkv_stage_stats(k->stage, &ss);
        xs_add(&out->xs, &xs);
        ss_add(&out->ss, &ss);
        out->ranks[r] = (srv_kv_rank_snapshot_t){.address = pkv_xfer_agent_address(k->agent),
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
    out->agent_alive = srv_kvnode_healthy(n, &out->agent_age_ns);
    pthread_mutex_lock(&n->lock);
    out->leases = n->leases;
    out->pulls = n->pulls;
    memcpy(out->phases, n->phases, sizeof(out->phases));
    pthread_mutex_unlock(&n->lock);
}

json_t *srv_kvnode_peaks_reset(srv_kvnode_t *n)
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

/* The agent's callback when a registration ends (its progress thread; quick). */
static void lease_ended(void *arg, uint64_t request_id, int outcome)
{
    kvn_rank_t *k = arg;
    srv_kvnode_t *n = k->node;
    /* A request registers once per rank; its lease counts once, as rank 0's ended. */
    if (k->index != 0) return;
    pkv_xfer_serve_timings_t t;
    bool timed = outcome == PKV_OK && !pkv_xfer_sent_timings(k->agent, request_id, &t);
    pthread_mutex_lock(&n->lock);
    if (timed) { /* the prefill node's phases of the decode leg's pull */
        observe_locked(n, NULL, SRV_PHASE_LEASE_WAIT, t.registered_ns, t.accepted_ns);
        observe_locked(n, NULL, SRV_PHASE_STAGING_WAIT, t.accepted_ns, t.seated_ns);
        observe_locked(n, NULL, SRV_PHASE_WIRE, t.seated_ns, t.acked_ns);
    }
    if (outcome == PKV_OK)
        n->leases.sent++;
    else if (outcome == PKV_ERR_TIMEOUT)
        n->leases.expired++;
    else if (outcome == PKV_ERR_CANCELLED)
        n->leases.cancelled++;
    else
        n->leases.shutdown++;
    pthread_mutex_unlock(&n->lock);
}

/* The id a prefill leg's blocks are registered under: 63 bits of
 * SHA-256(serial, SHA-256(the prompt's ids)), serial being the server's own request
 * counter. The producer serves only that id (with its token) and a decode leg recomputes
 * it from its own prompt, so KV computed for one prompt is never taken for another: a
 * client would need a 63-bit second preimage within the lease. */
static uint64_t bound_id(uint64_t serial, const int32_t *ids, uint32_t n)
{
    uint8_t buf[8 + SHA256_DIGEST_LENGTH], d[SHA256_DIGEST_LENGTH];
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(serial >> (8 * i));
    SHA256((const unsigned char *)ids, (size_t)n * sizeof(int32_t), buf + 8);
    SHA256(buf, sizeof(buf), d);
    uint64_t id = 0;
    for (int i = 0; i < 8; i++) id |= (uint64_t)d[i] << (8 * i);
    id &= (uint64_t)INT64_MAX;
    return id ? id : 1;
}

/* The response's kv_transfer_params for a request registered on every rank (h[r]: rank
 * r's handle): the field's keys (rank 0's address), then pagekv's; with TP > 1 also
 * pagekv_tp and pagekv_ranks, each rank's address, token and heads. */
static json_t *offer_doc(const srv_kvnode_t *n, pkv_xfer_handle_t *const *h, uint64_t serial,
                         uint32_t n_prompt)
{
    const pkv_xfer_handle_t *h0 = h[0];
    json_t *ids = json_array();
    for (uint32_t i = 0; ids && i < h0->n_blocks; i++)
        if (json_array_append_new(ids, json_integer((json_int_t)h0->blocks[i]))) {
            json_decref(ids);
            return NULL;
        }
    if (!ids) return NULL;
    char token[2 * PKV_XFER_TOKEN_BYTES + 1];
    hex(h0->token, PKV_XFER_TOKEN_BYTES, token);
    json_t *doc = json_pack(
        "{s:b, s:b, s:s, s:o, s:s, s:i, s:I, s:I, s:s, s:i,"
        " s:{s:i, s:i, s:i, s:i, s:s}}",
        "do_remote_prefill", 1, "do_remote_decode", 0, "remote_engine_id", n->engine_id,
        "remote_block_ids", ids, "remote_host", n->rank[0].host, "remote_port",
        (int)n->rank[0].port, "pagekv_request_id", (json_int_t)h0->request_id, "pagekv_serial",
        (json_int_t)serial, "pagekv_token", token, "pagekv_prompt_tokens", (int)n_prompt,
        "pagekv_geometry", "layers", (int)h0->geo.layers, "kv_heads", (int)h0->geo.kv_heads,
        "head_dim", (int)h0->geo.head_dim, "block_tokens", (int)h0->geo.block_tokens, "dtype",
        pkv_dtype_name(h0->geo.dtype));
    if (!doc || n->tp == 1) return doc;
    json_t *ranks = json_array();
    for (uint32_t r = 0; ranks && r < n->tp; r++) {
        hex(h[r]->token, PKV_XFER_TOKEN_BYTES, token);
        if (json_array_append_new(ranks, json_pack("{s:s, s:i, s:s, s:i, s:i}", "remote_host",
                                                   n->rank[r].host, "remote_port",
                                                   (int)n->rank[r].port, "pagekv_token", token,
                                                   "head_lo", (int)n->rank[r].head_lo, "head_n",
                                                   (int)n->rank[r].head_n))) {
            json_decref(ranks);
            ranks = NULL;
        }
    }
    if (!ranks || json_object_set_new(doc, "pagekv_tp", json_integer((json_int_t)n->tp)) ||
        json_object_set_new(doc, "pagekv_ranks", ranks)) {
        json_decref(doc);
        return NULL;
    }
    return doc;
}

int srv_kvnode_offer(srv_kvnode_t *n, uint64_t serial, const uint32_t *blocks, uint32_t nb,
                     const int32_t *ids, uint32_t n_prompt, json_t **params)
{
    pkv_xfer_handle_t *h[PKV_KV_MAX_TP] = {0};
    uint64_t request_id = bound_id(serial, ids, n_prompt);
    uint64_t expiry = pkv_deadline_after_ns((uint64_t)n->lease_ms * 1000000ull);
    int rc = PKV_OK;
    uint32_t done = 0;
    for (; done < n->tp && !rc; done++)
        rc = pkv_xfer_register(n->rank[done].agent, request_id, blocks, nb, expiry, lease_ended,
                               &n->rank[done], &h[done]);
    if (rc) done--; /* the one that failed registered nothing */
    json_t *doc = rc ? NULL : offer_doc(n, h, serial, n_prompt);
    if (!rc && !doc) rc = PKV_ERR_NOMEM;
    for (uint32_t r = 0; r < n->tp; r++) pkv_xfer_handle_free(h[r]);
    if (rc) {
        for (uint32_t r = 0; r < done; r++) pkv_xfer_unregister(n->rank[r].agent, request_id);
        return rc;
    }
    pthread_mutex_lock(&n->lock);
    n->leases.offered++;
    pthread_mutex_unlock(&n->lock);
    *params = doc;
    return PKV_OK;
}

json_t *srv_kv_stats_json(const srv_kv_snapshot_t *k)
{
    const pkv_xfer_stats_t *x = &k->xs;
    const pkv_stage_stats_t *s = &k->ss;
    json_t *doc = json_pack(
        "{s:s, s:s, s:s, s:i, s:s, s:i, s:i,"
        " s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I},"
        " s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I},"
        " s:{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I}}",
        "role", pkv_server_role_name(k->role), "address", k->address, "remote_host", k->advertise,
        "remote_port", (int)k->port, "engine_id", k->engine_id, "lease_ms", (int)k->lease_ms,
        "transfer_timeout_ms", (int)k->transfer_timeout_ms, "leases", "offered",
        (json_int_t)k->leases.offered, "live", (json_int_t)x->registrations, "sent",
        (json_int_t)k->leases.sent, "expired", (json_int_t)k->leases.expired, "cancelled",
        (json_int_t)k->leases.cancelled, "shutdown", (json_int_t)k->leases.shutdown,
        "pinned_blocks", (json_int_t)x->pinned_blocks, "transfers", "reads_started",
        (json_int_t)x->reads_started, "reads_ok", (json_int_t)x->reads_done[0], "bytes_received",
        (json_int_t)x->bytes_received, "serves_started", (json_int_t)x->serves_started,
        "serves_failed", (json_int_t)x->serves_failed, "bytes_sent", (json_int_t)x->bytes_sent,
        "rejected", (json_int_t)x->rejected, "released", (json_int_t)x->released, "peers",
        (json_int_t)x->peers, "staging", "mode", pkv_stage_mode_name(s->mode), "page_bytes",
        (json_int_t)s->page_bytes, "pages_total", (json_int_t)s->pages_total, "pages_used",
        (json_int_t)s->pages_used, "pages_peak_used", (json_int_t)s->pages_peak_used,
        "resident_bytes", (json_int_t)s->resident_bytes, "pinned_bytes",
        (json_int_t)s->pinned_bytes, "pages_held_by_transfers", (json_int_t)x->staging_pages_held);
    if (!doc) return NULL;
    /* transfers holding staging pages at once, high-water (fixed slots and the mirror: their
       commit at start took every slot once) */
    json_t *stg = json_object_get(doc, "staging");
    json_object_set_new(stg, "transfers_peak", json_integer((json_int_t)s->transfers_peak));
    /* how long a free page stays committed; null: never returned */
    json_object_set_new(stg, "idle_release_ms",
                        k->staging_idle_ms < 0 ? json_null() : json_integer(k->staging_idle_ms));
    json_object_set_new(
        doc, "pulls",
        json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "ok", (json_int_t)k->pulls.ok, "released",
                  (json_int_t)k->pulls.released, "failed", (json_int_t)k->pulls.failed,
                  "recomputed", (json_int_t)k->pulls.recomputed, "local",
                  (json_int_t)k->pulls.local, "blocks_pulled", (json_int_t)k->pulls.blocks_pulled,
                  "blocks_adopted", (json_int_t)k->pulls.blocks_adopted));
    json_t *pl = json_object_get(doc, "pulls");
    json_object_set_new(pl, "inflight", json_integer((json_int_t)k->pulls.inflight));
    json_object_set_new(pl, "inflight_peak", json_integer((json_int_t)k->pulls.inflight_peak));
    /* Reads by outcome (consumer), serves acknowledged and failed (producer). */
    static const char *const outcome[8] = {"ok",       "timeout",   "peer_lost", "nofit",
                                           "rejected", "cancelled", "corrupt",   "shutdown"};
    json_t *t = json_object_get(doc, "transfers"), *by = json_object();
    for (int i = 0; i < 8; i++)
        json_object_set_new(by, outcome[i], json_integer((json_int_t)x->reads_done[i]));
    json_object_set_new(t, "reads_by_outcome", by);
    json_object_set_new(t, "sent", json_integer((json_int_t)x->sent));
    json_object_set_new(t, "active", json_integer((json_int_t)x->active_transfers));
    json_object_set_new(t, "peers_lost", json_integer((json_int_t)x->peers_lost));
    json_t *st = json_object_get(doc, "staging");
    json_object_set_new(st, "waits", json_integer((json_int_t)s->waits));
    json_object_set_new(
        st, "pages_resident",
        json_integer(s->page_bytes ? (json_int_t)(s->resident_bytes / s->page_bytes) : 0));
    json_t *ranks = json_array();
    for (uint32_t r = 0; ranks && r < k->tp; r++) {
        const srv_kv_rank_snapshot_t *q = &k->ranks[r];
        json_array_append_new(
            ranks,
            json_pack("{s:i, s:s, s:i, s:i, s:i, s:{s:I, s:I, s:I, s:i, s:i}, s:{s:I, "
                      "s:I, s:I}}",
                      "rank", (int)r, "address", q->address, "remote_port", (int)q->port, "head_lo",
                      (int)q->head_lo, "head_n", (int)q->head_n, "staging", "pinned_bytes",
                      (json_int_t)q->pinned_bytes, "resident_bytes", (json_int_t)q->resident_bytes,
                      "resident_peak_bytes", (json_int_t)q->resident_peak_bytes, "pages_used",
                      (int)q->pages_used, "pages_peak_used", (int)q->pages_peak_used, "transfers",
                      "bytes_sent", (json_int_t)q->bytes_sent, "bytes_received",
                      (json_int_t)q->bytes_received, "active", (json_int_t)q->active_transfers));
    }
    json_object_set_new(doc, "tp", json_integer((json_int_t)k->tp));
    if (ranks) json_object_set_new(doc, "ranks", ranks);
    json_object_set_new(doc, "agent",
                        json_pack("{s:b, s:I}", "alive", k->agent_alive, "progress_age_us",
                                  (json_int_t)(k->agent_age_ns / 1000)));
    return doc;
}

/* ---- the decode leg ----------------------------------------------------------------------- */

#define KVT_P(k) "kv_transfer_params." k

static int kvt_bad(srv_error_t *err, const char *code, const char *param, const char *why)
{
    srv_error_set(err, 400, "invalid_request_error", code, param, "'%s' %s", param, why);
    return PKV_ERR_INVALID;
}

/* An integer member in [lo, hi]. */
static int kvt_int(const json_t *o, const char *key, const char *param, json_int_t lo,
                   json_int_t hi, json_int_t *out, srv_error_t *err)
{
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return kvt_bad(err, "missing_field", param, "is required");
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return kvt_bad(err, "invalid_value", param, "is not this node's value or is out of range");
    *out = json_integer_value(v);
    return PKV_OK;
}

static int unhex(const char *s, uint8_t *out, size_t n)
{
    if (!s || strlen(s) != 2 * n) return PKV_ERR_INVALID;
    for (size_t i = 0; i < 2 * n; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return PKV_ERR_INVALID;
        out[i / 2] = (uint8_t)(i % 2 ? out[i / 2] | d : d << 4);
    }
    return PKV_OK;
}

/* The producer's geometry must be this pool's. */
static int kvt_geometry(const srv_kvnode_t *n, const json_t *o, srv_error_t *err)
{
    const pkv_geometry_t *g = pkv_kv_geometry(n->kv);
    json_t *v = json_object_get(o, "pagekv_geometry");
    const char *p = KVT_P("pagekv_geometry");
    if (!json_is_object(v)) return kvt_bad(err, "missing_field", p, "is required (an object)");
    json_int_t layers, heads, dim, bt;
    const char *dt = json_string_value(json_object_get(v, "dtype"));
    pkv_dtype_t dtype;
    if (kvt_int(v, "layers", p, g->layers, g->layers, &layers, err) ||
        kvt_int(v, "kv_heads", p, g->kv_heads, g->kv_heads, &heads, err) ||
        kvt_int(v, "head_dim", p, g->head_dim, g->head_dim, &dim, err) ||
        kvt_int(v, "block_tokens", p, g->block_tokens, g->block_tokens, &bt, err))
        return kvt_bad(err, "invalid_value", p, "differs from this node's KV geometry");
    if (!dt || pkv_dtype_parse(dt, &dtype) || dtype != g->dtype)
        return kvt_bad(err, "invalid_value", p, "differs from this node's KV dtype");
    return PKV_OK;
}

/* The handle a decode leg's kv_transfer_params describe for the producer's rank 0 (the
 * field's keys; checked against this node and the prompt). *out: free with
 * pkv_xfer_handle_free. */
static int kvt_handle(const srv_kvnode_t *n, const json_t *o, const int32_t *prompt,
                      uint32_t n_prompt, pkv_xfer_handle_t **out, srv_error_t *err)
{
    json_int_t port, rid, serial, np;
    const char *host = json_string_value(json_object_get(o, "remote_host"));
    json_t *ids = json_object_get(o, "remote_block_ids");
    const char *token = json_string_value(json_object_get(o, "pagekv_token"));
    uint32_t bt = pkv_kv_geometry(n->kv)->block_tokens, nb = PKV_DIV_UP(n_prompt, bt);
    if (!host || !*host || strlen(host) > 47)
        return kvt_bad(err, "missing_field", KVT_P("remote_host"), "is required (a host)");
    if (kvt_int(o, "remote_port", KVT_P("remote_port"), 1, 65535, &port, err) ||
        kvt_int(o, "pagekv_request_id", KVT_P("pagekv_request_id"), 1, INT64_MAX, &rid, err) ||
        kvt_int(o, "pagekv_serial", KVT_P("pagekv_serial"), 1, INT64_MAX, &serial, err) ||
        kvt_int(o, "pagekv_prompt_tokens", KVT_P("pagekv_prompt_tokens"), n_prompt, n_prompt, &np,
                err) ||
        kvt_geometry(n, o, err))
        return PKV_ERR_INVALID;
    if ((uint64_t)rid != bound_id((uint64_t)serial, prompt, n_prompt))
        return kvt_bad(err, "invalid_value", KVT_P("pagekv_request_id"),
                       "does not belong to this prompt (the KV was computed for another)");
    if (!json_is_array(ids) || json_array_size(ids) != nb)
        return kvt_bad(err, "invalid_value", KVT_P("remote_block_ids"),
                       "must list the prompt's blocks (ceil(prompt tokens / block tokens))");
    pkv_xfer_handle_t *h = calloc(1, sizeof(*h) + nb * sizeof(uint32_t));
    if (!h) return PKV_ERR_NOMEM;
    if (unhex(token, h->token, sizeof(h->token))) {
        free(h);
        return kvt_bad(err, "invalid_value", KVT_P("pagekv_token"), "must be 32 hex digits");
    }
    for (uint32_t i = 0; i < nb; i++) {
        json_t *v = json_array_get(ids, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) > (json_int_t)UINT32_MAX) {
            free(h);
            return kvt_bad(err, "invalid_value", KVT_P("remote_block_ids"),
                           "must hold block ids (integers >= 0)");
        }
        h->blocks[i] = (uint32_t)json_integer_value(v);
    }
    h->n_blocks = nb;
    h->request_id = (uint64_t)rid;
    h->geo = *pkv_kv_geometry(n->kv);
    snprintf(h->addr, sizeof(h->addr), "%s:%u", host, (unsigned)port);
    *out = h;
    return PKV_OK;
}

/* The producer's ranks: pagekv_tp (absent: 1) and, with TP > 1, pagekv_ranks, each rank's
 * address, token and heads (which must be the heads TP P gives that rank). hs[p] is
 * rank p's handle (hs[0] = h0, taken over; the caller frees all *P of them). */
static int kvt_ranks(const srv_kvnode_t *n, const json_t *o, pkv_xfer_handle_t *h0,
                     pkv_xfer_handle_t **hs, uint32_t *P, srv_error_t *err)
{
    hs[0] = h0;
    *P = 1;
    json_t *tpv = json_object_get(o, "pagekv_tp");
    if (!tpv || json_is_null(tpv)) return PKV_OK;
    uint32_t kvh = pkv_kv_geometry(n->kv)->kv_heads;
    char why[128];
    json_int_t tp;
    if (kvt_int(o, "pagekv_tp", KVT_P("pagekv_tp"), 1, PKV_KV_MAX_TP, &tp, err))
        return PKV_ERR_INVALID;
    if (pkv_kv_tp_check(kvh, (uint32_t)tp, why, sizeof(why)))
        return kvt_bad(err, "invalid_value", KVT_P("pagekv_tp"), why);
    json_t *ranks = json_object_get(o, "pagekv_ranks");
    if (tp == 1 && (!ranks || json_is_null(ranks))) return PKV_OK;
    if (!json_is_array(ranks) || json_array_size(ranks) != (size_t)tp)
        return kvt_bad(err, "invalid_value", KVT_P("pagekv_ranks"),
                       "must list pagekv_tp ranks (remote_host, remote_port, pagekv_token, "
                       "head_lo, head_n)");
    size_t hb = sizeof(*h0) + h0->n_blocks * sizeof(uint32_t);
    for (uint32_t p = 0; p < (uint32_t)tp; p++) {
        json_t *r = json_array_get(ranks, p);
        const char *host = json_string_value(json_object_get(r, "remote_host"));
        const char *token = json_string_value(json_object_get(r, "pagekv_token"));
        json_int_t port, lo, hn;
        uint32_t want_lo, want_n;
        pkv_kv_tp_heads(kvh, (uint32_t)tp, p, &want_lo, &want_n);
        if (!json_is_object(r) || !host || !*host || strlen(host) > 47)
            return kvt_bad(err, "invalid_value", KVT_P("pagekv_ranks"),
                           "must hold objects with remote_host (a host)");
        if (kvt_int(r, "remote_port", KVT_P("pagekv_ranks.remote_port"), 1, 65535, &port, err) ||
            kvt_int(r, "head_lo", KVT_P("pagekv_ranks.head_lo"), want_lo, want_lo, &lo, err) ||
            kvt_int(r, "head_n", KVT_P("pagekv_ranks.head_n"), want_n, want_n, &hn, err))
            return PKV_ERR_INVALID;
        if (p > 0) {
            if (!(hs[p] = malloc(hb))) return PKV_ERR_NOMEM;
            memcpy(hs[p], h0, hb);
            *P = p + 1;
        }
        if (unhex(token, hs[p]->token, sizeof(hs[p]->token)))
            return kvt_bad(err, "invalid_value", KVT_P("pagekv_ranks.pagekv_token"),
                           "must be 32 hex digits");
        snprintf(hs[p]->addr, sizeof(hs[p]->addr), "%s:%u", host, (unsigned)port);
    }
    *P = (uint32_t)tp;
    return PKV_OK;
}

/* ---- the transfer plan: which decode rank reads which heads from which prefill rank ---- */

typedef struct {
    uint32_t d, p;            /* decode rank (local agent), prefill rank (handle) */
    uint32_t head_lo, head_n; /* head_n 0: a token-only release of p's registration */
    uint16_t index, total;    /* the read's index among p's reads, and their count */
} kvn_read_t;

/* For each local rank d, the prefill ranks holding its heads (a replicated head is read from
 * replica d mod replicas, spreading the load), as runs of consecutive heads on one prefill
 * rank; a prefill rank no decode rank reads from gets a release. want == 0 (nothing to
 * pull): one release per prefill rank. Returns the reads in out[] (cap: D * kv_heads + P). */
static uint32_t kvn_plan(const srv_kvnode_t *n, uint32_t P, bool pull, kvn_read_t *out)
{
    uint32_t kvh = pkv_kv_geometry(n->kv)->kv_heads, m = 0;
    uint16_t count[PKV_KV_MAX_TP] = {0};
    for (uint32_t d = 0; pull && d < n->tp; d++) {
        const kvn_rank_t *k = &n->rank[d];
        for (uint32_t h = k->head_lo; h < k->head_lo + k->head_n; h++) {
            uint32_t p = P <= kvh ? h / (kvh / P) : h * (P / kvh) + d % (P / kvh);
            if (m && out[m - 1].d == d && out[m - 1].p == p &&
                out[m - 1].head_lo + out[m - 1].head_n == h) {
                out[m - 1].head_n++;
                continue;
            }
            out[m++] = (kvn_read_t){.d = d, .p = p, .head_lo = h, .head_n = 1, .index = count[p]++};
        }
    }
    for (uint32_t p = 0; p < P; p++)
        if (!count[p]) out[m++] = (kvn_read_t){.d = p % n->tp, .p = p, .index = count[p]++};
    for (uint32_t i = 0; i < m; i++) out[i].total = count[out[i].p];
    return m;
}

/* A read's outcome as the client's error (transfer failures are not the client's, but
 * for `rejected`: forged or stale params). */
static void pull_error(int outcome, pkv_xfer_why_t why, srv_error_t *err)
{
    const char *p = "kv_transfer_params";
    if (outcome == PKV_ERR_REJECTED && why == PKV_XFER_WHY_IDENTITY)
        srv_error_set(err, 400, "invalid_request_error", "invalid_value", KVT_P("remote_engine_id"),
                      "'%s' is not the engine the producer at remote_host:remote_port presents",
                      KVT_P("remote_engine_id"));
    else if (outcome == PKV_ERR_REJECTED && why == PKV_XFER_WHY_BLOCKS)
        srv_error_set(err, 400, "invalid_request_error", "rejected", KVT_P("remote_block_ids"),
                      "'%s' are not the blocks the prefill node registered for this request",
                      KVT_P("remote_block_ids"));
    else if (outcome == PKV_ERR_REJECTED && why == PKV_XFER_WHY_LAYOUT)
        srv_error_set(err, 400, "invalid_request_error", "incompatible_layout", p,
                      "the prefill node's KV layout (model, geometry or the heads of its ranks) "
                      "does not match this node's");
    else if (outcome == PKV_ERR_REJECTED)
        srv_error_set(err, 400, "invalid_request_error", "rejected", p,
                      "the prefill node refused the transfer (unknown request, wrong token, "
                      "expired lease)");
    else if (outcome == PKV_ERR_CORRUPT)
        srv_error_set(err, 502, "server_error", "corrupt", p, "the transferred KV was corrupt");
    else if (outcome == PKV_ERR_NOFIT || outcome == PKV_ERR_NOSPACE)
        srv_error_set(err, 503, "service_unavailable", "nofit", p, "no room for the transfer: %s",
                      pkv_status_str(outcome));
    else
        srv_error_set(err, 503, "service_unavailable",
                      outcome == PKV_ERR_TIMEOUT     ? "timeout"
                      : outcome == PKV_ERR_PEER_LOST ? "peer_lost"
                                                     : "transfer_failed",
                      p, "pulling the prompt's KV failed: %s", pkv_status_str(outcome));
}

/* The decode node's phases of a pull that succeeded: from the call (t0) to the positions
 * recorded (t_end), cut at the read's steps. */
static void pull_phases(srv_kvnode_t *n, const pkv_xfer_read_timings_t *rt, uint64_t t0,
                        uint64_t t_end, srv_timings_t *t)
{
    pthread_mutex_lock(&n->lock);
    observe_locked(n, t, SRV_PHASE_HANDSHAKE, t0, rt->connected_ns);
    observe_locked(n, t, SRV_PHASE_STAGING_WAIT, rt->connected_ns, rt->requested_ns);
    observe_locked(n, t, SRV_PHASE_WIRE, rt->requested_ns, rt->last_ns);
    observe_locked(n, t, SRV_PHASE_COMMIT, rt->last_ns, t_end);
    pthread_mutex_unlock(&n->lock);
}

/* Decode legs' pulls in flight (delta +1 as one starts, -1 as it ends) and their peak. */
static void pull_inflight(srv_kvnode_t *n, int delta)
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
} kvn_pull_t;

static void pull_done(void *arg, pkv_xfer_read_t *rd, int outcome)
{
    (void)rd;
    kvn_pull_t *pl = arg;
    pthread_mutex_lock(&pl->mu);
    pl->left--;
    pl->failed |= outcome != PKV_OK;
    pthread_cond_signal(&pl->cv);
    pthread_mutex_unlock(&pl->mu);
}

/* Wait until every read has an outcome, or one failed, or the deadline (+1 s of slack for
 * an outcome to arrive). */
static void pull_wait(kvn_pull_t *pl, uint64_t until_ns)
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
 * id, the block list or the layout. A pull that moved blocks counts its phases (and fills
 * t) from its slowest read. */
static int pull_into(srv_kvnode_t *n, pkv_xfer_handle_t *const *hs, uint32_t P,
                     const char *engine_id, pkv_seq_t *seq, const int32_t *ids, uint32_t cached,
                     uint32_t want, pkv_xfer_why_t *why, srv_timings_t *t)
{
    const uint32_t *dst;
    uint32_t nd, bt = hs[0]->geo.block_tokens, have = cached / bt;
    int rc = pkv_seq_blocks(seq, &dst, &nd);
    if (rc || nd < want || have > want || hs[0]->n_blocks < want) return rc ? rc : PKV_ERR_INVALID;
    uint32_t n_pull = want - have, kvh = hs[0]->geo.kv_heads;
    uint32_t *idx = malloc(sizeof(uint32_t) * (n_pull ? n_pull : 1));
    kvn_read_t *plan = malloc(sizeof(*plan) * ((size_t)n->tp * kvh + P));
    pkv_xfer_read_t **rd = calloc((size_t)n->tp * kvh + P, sizeof(*rd));
    kvn_pull_t pl = {.left = 0};
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
    uint32_t m = kvn_plan(n, P, n_pull > 0, plan), started = 0;
    uint64_t t0 = pkv_now_ns();
    uint64_t deadline = t0 + (uint64_t)n->transfer_timeout_ms * 1000000ull;
    pl.left = m;
    pull_inflight(n, +1);
    for (; started < m && !rc; started++) {
        const kvn_read_t *r = &plan[started];
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
    if (pl.failed || pl.left) /* all or nothing: end the others now */
        for (uint32_t i = 0; i < started; i++) pkv_xfer_cancel(rd[i]);
    for (uint32_t i = 0; i < started; i++) {
        int oc = PKV_ERR_TIMEOUT;
        if (pkv_xfer_read_wait(rd[i], deadline + 1000000000ull, &oc)) {
            pkv_xfer_cancel(rd[i]);
            oc = PKV_ERR_TIMEOUT;
        }
        outcome = worse(outcome, oc);
        if (oc == PKV_ERR_REJECTED && *why == PKV_XFER_WHY_NONE) *why = pkv_xfer_read_why(rd[i]);
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

/* remote_engine_id: required, what an agent can present (printable, <= 63 characters). */
static const char *kvt_engine_id(const json_t *o, srv_error_t *err)
{
    const char *id = json_string_value(json_object_get(o, "remote_engine_id"));
    size_t len = id ? strlen(id) : 0;
    if (!id || !len) {
        kvt_bad(err, "missing_field", KVT_P("remote_engine_id"), "is required (the producer's)");
        return NULL;
    }
    for (size_t i = 0; i < len; i++)
        if (len > PKV_XFER_IDENTITY_MAX || id[i] < 0x20 || id[i] > 0x7e) {
            kvt_bad(err, "invalid_value", KVT_P("remote_engine_id"),
                    "is not an engine id (printable, at most 63 characters)");
            return NULL;
        }
    return id;
}

static void count_pull(srv_kvnode_t *n, int outcome, uint32_t pulled, uint32_t adopted)
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

int srv_kvnode_pull(srv_kvnode_t *n, const json_t *params, const int32_t *ids, uint32_t n_prompt,
                    uint64_t salt, pkv_seq_t **out, srv_timings_t *t, srv_error_t *err)
{
    pkv_xfer_handle_t *h = NULL, *hs[PKV_KV_MAX_TP] = {0};
    uint32_t P = 0;
    const char *engine_id = kvt_engine_id(params, err);
    if (!engine_id) return PKV_ERR_INVALID;
    int rc = kvt_handle(n, params, ids, n_prompt, &h, err);
    if (!rc) {
        rc = kvt_ranks(n, params, h, hs, &P, err);
        P = PKV_MAX(P, 1);
    }
    if (rc == PKV_ERR_NOMEM)
        srv_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
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
    rc = pkv_seq_create(n->kv, &sp, &seq, &cached);
    uint32_t have = PKV_MIN(cached / bt, want);
    int outcome = rc ? rc : pull_into(n, hs, P, engine_id, seq, ids, have * bt, want, &why, t);
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
        pull_error(outcome, why, err);
        return outcome;
    }
    *out = seq;
    return PKV_OK;
}

void srv_kvnode_count_local(srv_kvnode_t *n)
{
    pthread_mutex_lock(&n->lock);
    n->pulls.local++;
    pthread_mutex_unlock(&n->lock);
}
