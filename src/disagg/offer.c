/*
 * disagg: the prefill leg (docs/design/disagg.md, "The prefill leg"). A prefill leg's
 * blocks are registered with every rank's agent under pagekv's own request id and a lease;
 * the agent holds their pins until a decode leg acknowledges a read, the lease expires, or
 * the agent is destroyed, and then returns them (full blocks stay in the prefix cache).
 * The lease counters and the serve phases are counted by the agent's callback (its
 * progress thread) under n->lock.
 */
#include "disagg/disagg_int.h"

#include <openssl/sha.h>
#include <stdlib.h>
#include <string.h>

/* The agent's callback when a registration ends (its progress thread; quick). */
static void dg_lease_ended(void *arg, uint64_t request_id, int outcome)
{
    dg_rank_t *k = arg;
    pkv_disagg_node_t *n = k->node;
    /* A request registers once per rank; its lease counts once, as rank 0's ended. */
    if (k->index != 0) return;
    pkv_xfer_serve_timings_t t;
    bool timed = outcome == PKV_OK && !pkv_xfer_sent_timings(k->agent, request_id, &t);
    pthread_mutex_lock(&n->lock);
    if (timed) { /* the prefill node's phases of the decode leg's pull */
        dg_observe_locked(n, NULL, PKV_DISAGG_PHASE_LEASE_WAIT, t.registered_ns, t.accepted_ns);
        dg_observe_locked(n, NULL, PKV_DISAGG_PHASE_STAGING_WAIT, t.accepted_ns, t.seated_ns);
        dg_observe_locked(n, NULL, PKV_DISAGG_PHASE_WIRE, t.seated_ns, t.acked_ns);
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
/* 63 bits of SHA-256(buf), little-endian, never 0: a positive JSON integer. */
static uint64_t id63(const uint8_t *buf, size_t len)
{
    uint8_t d[SHA256_DIGEST_LENGTH];
    SHA256(buf, len, d);
    uint64_t id = 0;
    for (int i = 0; i < 8; i++) id |= (uint64_t)d[i] << (8 * i);
    id &= (uint64_t)INT64_MAX;
    return id ? id : 1;
}

uint64_t dg_bound_id(uint64_t serial, const int32_t *ids, uint32_t n)
{
    uint8_t buf[8 + SHA256_DIGEST_LENGTH];
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(serial >> (8 * i));
    SHA256((const unsigned char *)ids, (size_t)n * sizeof(int32_t), buf + 8);
    return id63(buf, sizeof(buf));
}

/* The check that binds a prefill leg's first token to its registration and sampling: 63
 * bits of SHA-256("pagekv-first", request_id, token, and for a sampled (temperature > 0)
 * token the temperature's and top_p's bits and the seed), never 0. A decode leg computes
 * it from its own sampling: equal, the token is what its engine would have sampled. */
uint64_t dg_first_check(uint64_t request_id, int32_t token, const pkv_disagg_sampling_t *smp)
{
    bool sampled = smp->temperature > 0.0f;
    uint32_t tb = 0, pb = 0;
    if (sampled) {
        memcpy(&tb, &smp->temperature, 4);
        memcpy(&pb, &smp->top_p, 4);
    }
    uint64_t words[4] = {request_id, (uint32_t)token, (uint64_t)tb << 32 | pb,
                         sampled ? smp->seed : 0};
    uint8_t buf[12 + sizeof(words)];
    memcpy(buf, "pagekv-first", 12);
    for (size_t w = 0; w < 4; w++)
        for (int i = 0; i < 8; i++) buf[12 + 8 * w + i] = (uint8_t)(words[w] >> (8 * i));
    return id63(buf, sizeof(buf));
}

/* The response's kv_transfer_params for a request registered on every rank (h[r]: rank
 * r's handle): the field's keys (rank 0's address), then pagekv's; with TP > 1 also
 * pagekv_tp and pagekv_ranks, each rank's address, token and heads. */
static json_t *offer_doc(const pkv_disagg_node_t *n, pkv_xfer_handle_t *const *h, uint64_t serial,
                         uint32_t n_prompt, int32_t first, const pkv_disagg_sampling_t *smp)
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
    pkv_hex_encode(h0->token, PKV_XFER_TOKEN_BYTES, token);
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
    if (doc && first >= 0 &&
        json_object_set_new(doc, "pagekv_first",
                            json_pack("{s:i, s:I, s:I}", "token", (int)first, "seed",
                                      (json_int_t)smp->seed, "check",
                                      (json_int_t)dg_first_check(h0->request_id, first, smp)))) {
        json_decref(doc);
        return NULL;
    }
    if (!doc || n->tp == 1) return doc;
    json_t *ranks = json_array();
    for (uint32_t r = 0; ranks && r < n->tp; r++) {
        pkv_hex_encode(h[r]->token, PKV_XFER_TOKEN_BYTES, token);
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

int pkv_disagg_node_offer(pkv_disagg_node_t *n, uint64_t serial, const uint32_t *blocks,
                          uint32_t nb, const int32_t *ids, uint32_t n_prompt, int32_t first_token,
                          const pkv_disagg_sampling_t *smp, json_t **params)
{
    pkv_xfer_handle_t *h[PKV_KV_MAX_TP] = {0};
    uint64_t request_id = dg_bound_id(serial, ids, n_prompt);
    uint64_t expiry = pkv_deadline_after_ns((uint64_t)n->lease_ms * 1000000ull);
    int rc = PKV_OK;
    uint32_t done = 0;
    for (; done < n->tp && !rc; done++)
        rc = pkv_xfer_register(n->rank[done].agent, request_id, blocks, nb, expiry, dg_lease_ended,
                               &n->rank[done], &h[done]);
    if (rc) done--; /* the one that failed registered nothing */
    json_t *doc = rc ? NULL : offer_doc(n, h, serial, n_prompt, first_token, smp);
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
