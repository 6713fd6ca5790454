/*
 * disagg: a decode leg's kv_transfer_params (docs/design/disagg.md, "kv_transfer_params"):
 * the producer's handle, its ranks and its engine id, each checked against this node's
 * pool and the request's prompt before anything is pulled. Every refusal is a 400 with the
 * offending key.
 */
#include "disagg/disagg_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int kvt_bad(pkv_openai_error_t *err, const char *code, const char *param, const char *why)
{
    pkv_openai_error_set(err, 400, "invalid_request_error", code, param, "'%s' %s", param, why);
    return PKV_ERR_INVALID;
}

/* An integer member in [lo, hi]. */
static int kvt_int(const json_t *o, const char *key, const char *param, json_int_t lo,
                   json_int_t hi, json_int_t *out, pkv_openai_error_t *err)
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

/* The producer's geometry must be this pool's. Another KV dtype is a node of another KV
 * format, not a malformed field: 400 incompatible_layout naming both dtypes, as the
 * handshake would refuse it (pull.c), before anything is asked of the producer. */
static int kvt_geometry(const pkv_disagg_node_t *n, const json_t *o, pkv_openai_error_t *err)
{
    const pkv_geometry_t *g = pkv_kv_geometry(n->kv);
    json_t *v = json_object_get(o, "pagekv_geometry");
    const char *p = DG_KVT_P("pagekv_geometry");
    if (!json_is_object(v)) return kvt_bad(err, "missing_field", p, "is required (an object)");
    json_int_t layers, heads, dim, bt;
    const char *dt = json_string_value(json_object_get(v, "dtype"));
    pkv_dtype_t dtype;
    if (kvt_int(v, "layers", p, g->layers, g->layers, &layers, err) ||
        kvt_int(v, "kv_heads", p, g->kv_heads, g->kv_heads, &heads, err) ||
        kvt_int(v, "head_dim", p, g->head_dim, g->head_dim, &dim, err) ||
        kvt_int(v, "block_tokens", p, g->block_tokens, g->block_tokens, &bt, err))
        return kvt_bad(err, "invalid_value", p, "differs from this node's KV geometry");
    if (!dt || pkv_dtype_parse(dt, &dtype))
        return kvt_bad(err, "invalid_value", p, "differs from this node's KV dtype");
    if (dtype != g->dtype) {
        pkv_openai_error_set(err, 400, "invalid_request_error", "incompatible_layout", p,
                             "the prefill node's KV dtype is %s, this node's is %s: nodes of "
                             "different KV formats cannot share KV",
                             pkv_dtype_name(dtype), pkv_dtype_name(g->dtype));
        return PKV_ERR_INVALID;
    }
    return PKV_OK;
}

/* The handle a decode leg's kv_transfer_params describe for the producer's rank 0 (the
 * field's keys; checked against this node and the prompt). *out: free with
 * pkv_xfer_handle_free. */
int dg_params_handle(const pkv_disagg_node_t *n, const json_t *o, const int32_t *prompt,
                     uint32_t n_prompt, pkv_xfer_handle_t **out, pkv_openai_error_t *err)
{
    json_int_t port, rid, serial, np;
    const char *host = json_string_value(json_object_get(o, "remote_host"));
    json_t *ids = json_object_get(o, "remote_block_ids");
    const char *token = json_string_value(json_object_get(o, "pagekv_token"));
    uint32_t bt = pkv_kv_geometry(n->kv)->block_tokens, nb = PKV_DIV_UP(n_prompt, bt);
    if (!host || !*host || strlen(host) > 47)
        return kvt_bad(err, "missing_field", DG_KVT_P("remote_host"), "is required (a host)");
    if (kvt_int(o, "remote_port", DG_KVT_P("remote_port"), 1, 65535, &port, err) ||
        kvt_int(o, "pagekv_request_id", DG_KVT_P("pagekv_request_id"), 1, INT64_MAX, &rid, err) ||
        kvt_int(o, "pagekv_serial", DG_KVT_P("pagekv_serial"), 1, INT64_MAX, &serial, err) ||
        kvt_int(o, "pagekv_prompt_tokens", DG_KVT_P("pagekv_prompt_tokens"), n_prompt, n_prompt,
                &np, err) ||
        kvt_geometry(n, o, err))
        return PKV_ERR_INVALID;
    if ((uint64_t)rid != dg_bound_id((uint64_t)serial, prompt, n_prompt))
        return kvt_bad(err, "invalid_value", DG_KVT_P("pagekv_request_id"),
                       "does not belong to this prompt (the KV was computed for another)");
    if (!json_is_array(ids) || json_array_size(ids) != nb)
        return kvt_bad(err, "invalid_value", DG_KVT_P("remote_block_ids"),
                       "must list the prompt's blocks (ceil(prompt tokens / block tokens))");
    pkv_xfer_handle_t *h = calloc(1, sizeof(*h) + nb * sizeof(uint32_t));
    if (!h) return PKV_ERR_NOMEM;
    if (unhex(token, h->token, sizeof(h->token))) {
        free(h);
        return kvt_bad(err, "invalid_value", DG_KVT_P("pagekv_token"), "must be 32 hex digits");
    }
    for (uint32_t i = 0; i < nb; i++) {
        json_t *v = json_array_get(ids, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) > (json_int_t)UINT32_MAX) {
            free(h);
            return kvt_bad(err, "invalid_value", DG_KVT_P("remote_block_ids"),
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
int dg_params_ranks(const pkv_disagg_node_t *n, const json_t *o, pkv_xfer_handle_t *h0,
                    pkv_xfer_handle_t **hs, uint32_t *P, pkv_openai_error_t *err)
{
    hs[0] = h0;
    *P = 1;
    json_t *tpv = json_object_get(o, "pagekv_tp");
    if (!tpv || json_is_null(tpv)) return PKV_OK;
    uint32_t kvh = pkv_kv_geometry(n->kv)->kv_heads;
    char why[128];
    json_int_t tp;
    if (kvt_int(o, "pagekv_tp", DG_KVT_P("pagekv_tp"), 1, PKV_KV_MAX_TP, &tp, err))
        return PKV_ERR_INVALID;
    if (pkv_kv_tp_check(kvh, (uint32_t)tp, why, sizeof(why)))
        return kvt_bad(err, "invalid_value", DG_KVT_P("pagekv_tp"), why);
    json_t *ranks = json_object_get(o, "pagekv_ranks");
    if (tp == 1 && (!ranks || json_is_null(ranks))) return PKV_OK;
    if (!json_is_array(ranks) || json_array_size(ranks) != (size_t)tp)
        return kvt_bad(err, "invalid_value", DG_KVT_P("pagekv_ranks"),
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
            return kvt_bad(err, "invalid_value", DG_KVT_P("pagekv_ranks"),
                           "must hold objects with remote_host (a host)");
        if (kvt_int(r, "remote_port", DG_KVT_P("pagekv_ranks.remote_port"), 1, 65535, &port, err) ||
            kvt_int(r, "head_lo", DG_KVT_P("pagekv_ranks.head_lo"), want_lo, want_lo, &lo, err) ||
            kvt_int(r, "head_n", DG_KVT_P("pagekv_ranks.head_n"), want_n, want_n, &hn, err))
            return PKV_ERR_INVALID;
        if (p > 0) {
            if (!(hs[p] = malloc(hb))) return PKV_ERR_NOMEM;
            memcpy(hs[p], h0, hb);
            *P = p + 1;
        }
        if (unhex(token, hs[p]->token, sizeof(hs[p]->token)))
            return kvt_bad(err, "invalid_value", DG_KVT_P("pagekv_ranks.pagekv_token"),
                           "must be 32 hex digits");
        snprintf(hs[p]->addr, sizeof(hs[p]->addr), "%s:%u", host, (unsigned)port);
    }
    *P = (uint32_t)tp;
    return PKV_OK;
}

int dg_params_first(const json_t *o, uint64_t request_id, const pkv_disagg_sampling_t *smp,
                    pkv_disagg_first_t *out, bool *ignored, pkv_openai_error_t *err)
{
    *out = (pkv_disagg_first_t){.seed = smp->seed};
    *ignored = false;
    json_t *f = json_object_get(o, "pagekv_first");
    if (!f || json_is_null(f)) return PKV_OK;
    const char *p = DG_KVT_P("pagekv_first");
    json_t *seed = json_object_get(f, "seed");
    json_int_t token, check;
    if (!json_is_object(f) || !json_is_integer(seed))
        return kvt_bad(err, "invalid_value", p, "must be an object {token, seed, check}");
    if (kvt_int(f, "token", p, 0, (json_int_t)smp->vocab - 1, &token, err) ||
        kvt_int(f, "check", p, 1, INT64_MAX, &check, err))
        return PKV_ERR_INVALID;
    pkv_disagg_sampling_t mine = *smp;
    if (!mine.has_seed) mine.seed = (uint64_t)json_integer_value(seed);
    if ((uint64_t)check != dg_first_check(request_id, (int32_t)token, &mine)) {
        *ignored = true;
        return PKV_OK;
    }
    *out = (pkv_disagg_first_t){.given = true, .token = (int32_t)token, .seed = mine.seed};
    return PKV_OK;
}

/* remote_engine_id: required, what an agent can present (printable, <= 63 characters). */
const char *dg_params_engine_id(const json_t *o, pkv_openai_error_t *err)
{
    const char *id = json_string_value(json_object_get(o, "remote_engine_id"));
    size_t len = id ? strlen(id) : 0;
    if (!id || !len) {
        kvt_bad(err, "missing_field", DG_KVT_P("remote_engine_id"), "is required (the producer's)");
        return NULL;
    }
    for (size_t i = 0; i < len; i++)
        if (len > PKV_XFER_IDENTITY_MAX || id[i] < 0x20 || id[i] > 0x7e) {
            kvt_bad(err, "invalid_value", DG_KVT_P("remote_engine_id"),
                    "is not an engine id (printable, at most 63 characters)");
            return NULL;
        }
    return id;
}
