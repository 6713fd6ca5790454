/*
 * server roles: the transfer agent and host staging of a prefill or decode node
 * (docs/design/server.md, "Roles"). The node owns both; the pool is the server's. A
 * prefill leg's blocks are registered with the agent under pagekv's own request id and
 * a lease; the agent holds their pins until a decode leg acknowledges a read, the lease
 * expires, or the agent is destroyed, and then returns them (full blocks stay in the
 * prefix cache). The lease counters are updated by the agent's callback (its progress
 * thread) under n->lock.
 */
#include "server/server_int.h"

#include "core/core.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#define KVN_FIXED_SLOTS      4
#define KVN_STAGE_DESTROY_NS 2000000000ull /* staging returned by the agent's close */

struct srv_kvnode {
    pkv_server_role_t role;
    pkv_kv_t *kv;
    pkv_stage_t *stage;
    pkv_xfer_agent_t *agent;
    char host[PKV_XFER_ADDR_MAX]; /* remote_host */
    uint16_t port;                /* the agent's bound port */
    char engine_id[40];           /* "pagekv-" + 16 random bytes in hex */
    uint32_t lease_ms, transfer_timeout_ms;
    atomic_bool stopping;
    pthread_mutex_t lock; /* guards leases */
    srv_lease_counts_t leases;
};

static void hex(const uint8_t *b, size_t n, char *out)
{
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) out[2 * i] = d[b[i] >> 4], out[2 * i + 1] = d[b[i] & 15];
    out[2 * n] = 0;
}

/* The staging: per_transfer, or fixed slots committed (and pinned) at once and never
 * returned to the OS, as the field's carve-outs are. */
static int kvn_stage(const pkv_server_config_t *cfg, pkv_kv_t *kv, uint32_t max_context,
                     pkv_stage_t **out)
{
    pkv_stage_config_t sc;
    pkv_stage_config_default(&sc);
    uint64_t one = (uint64_t)PKV_DIV_UP(max_context, pkv_kv_geometry(kv)->block_tokens) *
                   pkv_kv_block_bytes(kv);
    uint64_t pages = cfg->staging_pages ? cfg->staging_pages : PKV_DIV_UP(one, sc.page_bytes) + 2;
    if (pages > UINT32_MAX) pages = UINT32_MAX;
    sc.mode = cfg->staging_mode;
    sc.peer_cap_pages = cfg->staging_peer_cap;
    sc.shared = cfg->staging_shared;
    sc.name = cfg->role == PKV_SERVER_ROLE_PREFILL ? "pkv-prefill" : "pkv-decode";
    if (sc.mode == PKV_STAGE_FIXED_SLOTS) {
        sc.slots = cfg->staging_slots ? cfg->staging_slots : KVN_FIXED_SLOTS;
        sc.slot_pages = (uint32_t)pages;
        sc.pool_pages = 0;
        sc.idle_release_ns = PKV_DEADLINE_NEVER;
    } else {
        sc.pool_pages = (uint32_t)pages;
    }
    int rc = pkv_stage_create(&sc, out);
    if (rc || sc.mode != PKV_STAGE_FIXED_SLOTS) return rc;
    /* Commit every slot now: take each once, then give them back (they stay resident). */
    for (uint32_t i = 0; i < sc.slots && !rc; i++) {
        pkv_stage_grant_t *g = NULL;
        rc = pkv_stage_try_acquire(*out, i + 1, 0, sc.slot_pages, &g);
        pkv_stage_grant_free(g);
    }
    for (uint32_t i = 0; i < sc.slots; i++) pkv_stage_release(*out, i + 1);
    if (rc) {
        PKV_LOGE("server", "committing the fixed staging slots failed: %s", pkv_status_str(rc));
        pkv_stage_destroy(*out, pkv_deadline_after_ns(KVN_STAGE_DESTROY_NS), NULL);
        *out = NULL;
    }
    return rc;
}

/* remote_host and the port from the agent's "host:port" (or --kv-advertise). */
static void kvn_address(srv_kvnode_t *n, const char *advertise)
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

int srv_kvnode_create(const pkv_server_config_t *cfg, pkv_kv_t *kv, uint32_t max_context,
                      srv_kvnode_t **out)
{
    if (pkv_kv_backend(kv) != PKV_BACKEND_PAGED) {
        PKV_LOGE("server", "--role %s needs the paged KV backend", pkv_server_role_name(cfg->role));
        return PKV_ERR_INVALID;
    }
    srv_kvnode_t *n = calloc(1, sizeof(*n));
    if (!n) return PKV_ERR_NOMEM;
    if (pthread_mutex_init(&n->lock, NULL)) {
        free(n);
        return PKV_ERR_NOMEM;
    }
    n->role = cfg->role;
    n->kv = kv;
    n->lease_ms = cfg->kv_lease_ms ? cfg->kv_lease_ms : 30000;
    n->transfer_timeout_ms = cfg->kv_transfer_timeout_ms ? cfg->kv_transfer_timeout_ms : 10000;
    atomic_init(&n->stopping, false);
    uint8_t rnd[16];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd)) {
        uint64_t x = pkv_now_ns();
        for (size_t i = 0; i < sizeof(rnd); i++) rnd[i] = (uint8_t)pkv_splitmix64(&x);
    }
    memcpy(n->engine_id, "pagekv-", 7);
    hex(rnd, sizeof(rnd), n->engine_id + 7);
    int rc = kvn_stage(cfg, kv, max_context, &n->stage);
    if (!rc) {
        pkv_xfer_config_t xc = {.kv = kv,
                                .stage = n->stage,
                                .listen_host = cfg->kv_listen_host,
                                .listen_port = cfg->kv_listen_port};
        rc = pkv_xfer_agent_create(&xc, &n->agent);
        if (rc)
            PKV_LOGE("server", "the transfer agent cannot start on %s:%u: %s",
                     cfg->kv_listen_host ? cfg->kv_listen_host : "127.0.0.1", cfg->kv_listen_port,
                     pkv_status_str(rc));
    }
    if (rc) {
        srv_kvnode_destroy(n);
        return rc;
    }
    kvn_address(n, cfg->kv_advertise);
    *out = n;
    return PKV_OK;
}

void srv_kvnode_destroy(srv_kvnode_t *n)
{
    if (!n) return;
    atomic_store(&n->stopping, true);
    pkv_xfer_agent_destroy(n->agent);
    if (n->stage) pkv_stage_destroy(n->stage, pkv_deadline_after_ns(KVN_STAGE_DESTROY_NS), NULL);
    pthread_mutex_destroy(&n->lock);
    free(n);
}

const char *srv_kvnode_address(const srv_kvnode_t *n)
{
    return pkv_xfer_agent_address(n->agent);
}

bool srv_kvnode_healthy(srv_kvnode_t *n)
{
    return n->agent && !atomic_load(&n->stopping);
}

void srv_kvnode_snapshot(srv_kvnode_t *n, srv_kv_snapshot_t *out)
{
    memset(out, 0, sizeof(*out));
    out->role = n->role;
    out->address = pkv_xfer_agent_address(n->agent);
    out->advertise = n->host;
    out->port = n->port;
    out->engine_id = n->engine_id;
    out->lease_ms = n->lease_ms;
    out->transfer_timeout_ms = n->transfer_timeout_ms;
    pkv_xfer_stats(n->agent, &out->xs);
    pkv_stage_stats(n->stage, &out->ss);
    pthread_mutex_lock(&n->lock);
    out->leases = n->leases;
    pthread_mutex_unlock(&n->lock);
}

/* The agent's callback when a registration ends (its progress thread; quick). */
static void lease_ended(void *arg, uint64_t request_id, int outcome)
{
    srv_kvnode_t *n = arg;
    pthread_mutex_lock(&n->lock);
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

/* The response's kv_transfer_params for a registration (the field's keys, then
 * pagekv's handle fields). */
static json_t *offer_doc(const srv_kvnode_t *n, const pkv_xfer_handle_t *h, uint32_t n_prompt)
{
    json_t *ids = json_array();
    for (uint32_t i = 0; ids && i < h->n_blocks; i++)
        if (json_array_append_new(ids, json_integer((json_int_t)h->blocks[i]))) {
            json_decref(ids);
            return NULL;
        }
    if (!ids) return NULL;
    char token[2 * PKV_XFER_TOKEN_BYTES + 1];
    hex(h->token, PKV_XFER_TOKEN_BYTES, token);
    return json_pack("{s:b, s:b, s:s, s:o, s:s, s:i, s:I, s:s, s:i, s:{s:i, s:i, s:i, s:i, s:s}}",
                     "do_remote_prefill", 1, "do_remote_decode", 0, "remote_engine_id",
                     n->engine_id, "remote_block_ids", ids, "remote_host", n->host, "remote_port",
                     (int)n->port, "pagekv_request_id", (json_int_t)h->request_id, "pagekv_token",
                     token, "pagekv_prompt_tokens", (int)n_prompt, "pagekv_geometry", "layers",
                     (int)h->geo.layers, "kv_heads", (int)h->geo.kv_heads, "head_dim",
                     (int)h->geo.head_dim, "block_tokens", (int)h->geo.block_tokens, "dtype",
                     pkv_dtype_name(h->geo.dtype));
}

int srv_kvnode_offer(srv_kvnode_t *n, uint64_t request_id, const uint32_t *blocks, uint32_t nb,
                     uint32_t n_prompt, json_t **params)
{
    pkv_xfer_handle_t *h = NULL;
    uint64_t expiry = pkv_deadline_after_ns((uint64_t)n->lease_ms * 1000000ull);
    int rc = pkv_xfer_register(n->agent, request_id, blocks, nb, expiry, lease_ended, n, &h);
    if (rc) return rc;
    json_t *doc = offer_doc(n, h, n_prompt);
    pkv_xfer_handle_free(h);
    if (!doc) {
        pkv_xfer_unregister(n->agent, request_id);
        return PKV_ERR_NOMEM;
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
    return json_pack(
        "{s:s, s:s, s:s, s:i, s:s, s:i, s:i,"
        " s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I},"
        " s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I},"
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
        "rejected", (json_int_t)x->rejected, "peers", (json_int_t)x->peers, "staging", "mode",
        pkv_stage_mode_name(s->mode), "page_bytes", (json_int_t)s->page_bytes, "pages_total",
        (json_int_t)s->pages_total, "pages_used", (json_int_t)s->pages_used, "pages_peak_used",
        (json_int_t)s->pages_peak_used, "resident_bytes", (json_int_t)s->resident_bytes,
        "pinned_bytes", (json_int_t)s->pinned_bytes, "pages_held_by_transfers",
        (json_int_t)x->staging_pages_held);
}
