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

#include <openssl/sha.h>
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
    bool recompute; /* --kv-load-failure recompute */
    atomic_bool stopping;
    pthread_mutex_t lock; /* guards leases, pulls, phases */
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

/* The staging: per_transfer, or fixed slots committed (and pinned) at once and never
 * returned to the OS, as the field's carve-outs are. */
static int kvn_stage(const pkv_server_config_t *cfg, pkv_kv_t *kv, uint32_t max_context,
                     pkv_stage_t **out)
{
    pkv_stage_config_t sc;
    pkv_stage_config_default(&sc);
    if (cfg->staging_page_bytes) sc.page_bytes = (size_t)cfg->staging_page_bytes;
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
    n->recompute = cfg->kv_load_recompute;
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
                                .listen_port = cfg->kv_listen_port,
                                .identity = n->engine_id}; /* presented to decode nodes */
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

bool srv_kvnode_healthy(srv_kvnode_t *n, uint64_t *age_ns)
{
    *age_ns = 0;
    return n->agent && !atomic_load(&n->stopping) &&
           pkv_xfer_agent_alive(n->agent, SRV_AGENT_STALL_NS, age_ns);
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
    out->agent_alive = srv_kvnode_healthy(n, &out->agent_age_ns);
    pthread_mutex_lock(&n->lock);
    out->leases = n->leases;
    out->pulls = n->pulls;
    memcpy(out->phases, n->phases, sizeof(out->phases));
    pthread_mutex_unlock(&n->lock);
}

/* The agent's callback when a registration ends (its progress thread; quick). */
static void lease_ended(void *arg, uint64_t request_id, int outcome)
{
    srv_kvnode_t *n = arg;
    pkv_xfer_serve_timings_t t;
    bool timed = outcome == PKV_OK && !pkv_xfer_sent_timings(n->agent, request_id, &t);
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

/* The response's kv_transfer_params for a registration (the field's keys, then
 * pagekv's handle fields). */
static json_t *offer_doc(const srv_kvnode_t *n, const pkv_xfer_handle_t *h, uint64_t serial,
                         uint32_t n_prompt)
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
    return json_pack("{s:b, s:b, s:s, s:o, s:s, s:i, s:I, s:I, s:s, s:i,"
                     " s:{s:i, s:i, s:i, s:i, s:s}}",
                     "do_remote_prefill", 1, "do_remote_decode", 0, "remote_engine_id",
                     n->engine_id, "remote_block_ids", ids, "remote_host", n->host, "remote_port",
                     (int)n->port, "pagekv_request_id", (json_int_t)h->request_id, "pagekv_serial",
                     (json_int_t)serial, "pagekv_token", token, "pagekv_prompt_tokens",
                     (int)n_prompt, "pagekv_geometry", "layers", (int)h->geo.layers, "kv_heads",
                     (int)h->geo.kv_heads, "head_dim", (int)h->geo.head_dim, "block_tokens",
                     (int)h->geo.block_tokens, "dtype", pkv_dtype_name(h->geo.dtype));
}

int srv_kvnode_offer(srv_kvnode_t *n, uint64_t serial, const uint32_t *blocks, uint32_t nb,
                     const int32_t *ids, uint32_t n_prompt, json_t **params)
{
    pkv_xfer_handle_t *h = NULL;
    uint64_t request_id = bound_id(serial, ids, n_prompt);
    uint64_t expiry = pkv_deadline_after_ns((uint64_t)n->lease_ms * 1000000ull);
    int rc = pkv_xfer_register(n->agent, request_id, blocks, nb, expiry, lease_ended, n, &h);
    if (rc) return rc;
    json_t *doc = offer_doc(n, h, serial, n_prompt);
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

/* The handle a decode leg's kv_transfer_params describe (checked against this node and
 * the prompt). *out: free with pkv_xfer_handle_free. */
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

/* Reads of decode legs in flight (delta +1 as one starts, -1 as it ends) and their peak. */
static void pull_inflight(srv_kvnode_t *n, int delta)
{
    pthread_mutex_lock(&n->lock);
    if (delta > 0 && ++n->pulls.inflight > n->pulls.inflight_peak)
        n->pulls.inflight_peak = n->pulls.inflight;
    if (delta < 0) n->pulls.inflight--;
    pthread_mutex_unlock(&n->lock);
}

/* Read the handle's blocks [have, want) into seq's blocks [have, want), from a producer
 * that must present `engine_id`, by the transfer deadline (have == want: a token-only
 * release, nothing moves); on ok the positions up to want whole blocks are recorded as
 * written (the first `cached` already were: adopted). Returns the read's outcome; *why
 * says whether a refusal was the engine id. A pull that moved blocks counts its phases
 * (and fills t). */
static int pull_into(srv_kvnode_t *n, const pkv_xfer_handle_t *h, const char *engine_id,
                     pkv_seq_t *seq, const int32_t *ids, uint32_t cached, uint32_t want,
                     pkv_xfer_why_t *why, srv_timings_t *t)
{
    const uint32_t *dst;
    uint32_t nd, bt = h->geo.block_tokens, have = cached / bt;
    int rc = pkv_seq_blocks(seq, &dst, &nd);
    if (rc || nd < want || have > want || h->n_blocks < want) return rc ? rc : PKV_ERR_INVALID;
    uint32_t n_pull = want - have, *idx = malloc(sizeof(uint32_t) * (n_pull ? n_pull : 1));
    if (!idx) return PKV_ERR_NOMEM;
    for (uint32_t i = 0; i < n_pull; i++) idx[i] = have + i;
    pkv_xfer_read_opts_t o = {.idx = idx, .identity = engine_id};
    uint64_t t0 = pkv_now_ns();
    uint64_t deadline = t0 + (uint64_t)n->transfer_timeout_ms * 1000000ull;
    pkv_xfer_read_t *rd = NULL;
    pull_inflight(n, +1);
    rc = pkv_xfer_read_ex(n->agent, h, &o, n_pull ? dst + have : NULL, n_pull, deadline, NULL, NULL,
                          &rd);
    free(idx);
    if (rc) {
        pull_inflight(n, -1);
        return rc;
    }
    int outcome = PKV_ERR_TIMEOUT;
    /* The read ends by its deadline; a second of slack for its outcome to arrive. */
    if (pkv_xfer_read_wait(rd, deadline + 1000000000ull, &outcome)) {
        pkv_xfer_cancel(rd);
        outcome = PKV_ERR_TIMEOUT;
    }
    pull_inflight(n, -1);
    *why = pkv_xfer_read_why(rd);
    pkv_xfer_read_timings_t rt;
    bool timed = outcome == PKV_OK && n_pull && !pkv_xfer_read_timings(rd, &rt);
    uint64_t bytes = pkv_xfer_read_bytes(rd);
    pkv_xfer_read_free(rd);
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
    pkv_xfer_handle_t *h = NULL;
    const char *engine_id = kvt_engine_id(params, err);
    if (!engine_id) return PKV_ERR_INVALID;
    int rc = kvt_handle(n, params, ids, n_prompt, &h, err);
    if (rc == PKV_ERR_NOMEM)
        srv_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
    if (rc) return rc;
    /* What this node's prefix cache holds is adopted; of the whole blocks the engine will
     * adopt at admission (all but the last prompt token's: it computes at least that one)
     * only those the cache lacks are pulled; when it lacks none, the token alone goes to
     * the producer, which returns its pins at once. */
    pkv_seq_params_t sp = {.salt = salt, .tokens = ids, .n_tokens = n_prompt};
    pkv_seq_t *seq = NULL;
    uint32_t cached = 0, bt = h->geo.block_tokens, want = (n_prompt - 1) / bt;
    pkv_xfer_why_t why = PKV_XFER_WHY_NONE;
    rc = pkv_seq_create(n->kv, &sp, &seq, &cached);
    uint32_t have = PKV_MIN(cached / bt, want);
    int outcome = rc ? rc : pull_into(n, h, engine_id, seq, ids, have * bt, want, &why, t);
    pkv_xfer_handle_free(h);
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
