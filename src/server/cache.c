/*
 * server: the cache admin endpoints (design in docs/design/server.md, "Endpoints"):
 * POST /v1/cache/reset, /v1/cache/lookup (the router's cache-aware question),
 * /v1/cache/digest (a hash of the KV bytes a prompt's cached blocks hold, per rank and
 * head) and /v1/kv_transfer/peaks/reset. None of them computes or changes KV beyond
 * dropping the cache (reset) or pinning blocks while they are read (digest).
 */
#include "kv/kv.h"
#include "server/server_int.h"

#include <openssl/evp.h>
#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum MHD_Result srv_handle_peaks_reset(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr)
{
    if (!srv_body_empty(hr)) {
        srv_count_rejection(s, SRV_REJ_INVALID);
        return srv_answer_errorf(
            s, c, hr, 400, "invalid_request_error", "invalid_json",
            "/v1/kv_transfer/peaks/reset takes no parameters (empty body or {})");
    }
    if (!s->kvn)
        return srv_answer_errorf(s, c, hr, 404, "not_found_error", "not_a_kv_node",
                                 "/v1/kv_transfer/peaks/reset is for prefill and decode nodes "
                                 "(this server runs unified)");
    json_t *doc = pkv_disagg_node_peaks_reset(s->kvn);
    if (!doc) return MHD_NO;
    return srv_answer_json(s, c, hr, 200, doc);
}

/* A cache admin body: empty, or a JSON object with only the given keys (NULL-terminated).
 * NULL with *msg set when it is not; json_object() for an empty body. */
static json_t *admin_body(const http_req_t *hr, const char *const *keys, const char **msg)
{
    if (srv_body_empty(hr)) return json_object();
    json_t *doc = json_loadb(hr->body, hr->len, 0, NULL);
    const char *k;
    json_t *v;
    *msg = "the body must be a JSON object";
    if (!json_is_object(doc)) goto bad;
    json_object_foreach(doc, k, v)
    {
        const char *const *p = keys;
        while (*p && strcmp(*p, k)) p++;
        if (!*p) {
            *msg = "the body has a field this endpoint does not take";
            goto bad;
        }
    }
    return doc;
bad:
    json_decref(doc);
    return NULL;
}

/* POST /v1/cache/reset: drop the memory tier's cached blocks; with {"disk": true} the disk
 * tier's records too. */
enum MHD_Result srv_handle_cache_reset(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr)
{
    static const char *const keys[] = {"disk", NULL};
    const char *msg;
    json_t *body = admin_body(hr, keys, &msg), *disk = body ? json_object_get(body, "disk") : NULL;
    if (!body || (disk && !json_is_boolean(disk))) {
        json_decref(body);
        srv_count_rejection(s, SRV_REJ_INVALID);
        char m[200];
        snprintf(m, sizeof(m),
                 "/v1/cache/reset takes an empty body, {} or {\"disk\": true|false} (%s)",
                 body ? "'disk' must be a boolean" : msg);
        return srv_answer_errorf(s, c, hr, 400, "invalid_request_error", "invalid_json", m);
    }
    bool drop_disk = json_is_true(disk);
    json_decref(body);
    if (drop_disk && !s->tier)
        return srv_answer_errorf(s, c, hr, 400, "invalid_request_error", "no_disk_tier",
                                 "this server has no disk tier (--kv-disk-dir)");
    /* Refused before anything is dropped: a refused reset changes nothing. */
    pkv_kvtier_stats_t tb = {0};
    if (drop_disk) pkv_kvtier_stats(s->tier, &tb);
    if (drop_disk && !tb.disk.writable)
        return srv_answer_errorf(s, c, hr, 409, "invalid_request_error", "read_only",
                                 "the disk tier's directory is read-only: nothing dropped");
    pkv_kv_stats_t before, after;
    pkv_kv_stats(s->kv, &before);
    pkv_kv_reset_cache(s->kv);
    pkv_kv_stats(s->kv, &after);
    if (drop_disk && pkv_kvtier_drop_disk(s->tier)) /* only a read-only tier refuses */
        return srv_answer_errorf(s, c, hr, 500, "server_error", "internal_error",
                                 "dropping the disk tier failed");
    pthread_mutex_lock(&s->lock);
    s->ctr.cache_resets++;
    pthread_mutex_unlock(&s->lock);
    uint64_t dropped =
        before.blocks_cached > after.blocks_cached ? before.blocks_cached - after.blocks_cached : 0;
    json_t *doc =
        json_pack("{s:b, s:I, s:I, s:I}", "reset", 1, "dropped_blocks", (json_int_t)dropped,
                  "committed_bytes_before", (json_int_t)before.committed_bytes,
                  "committed_bytes_after", (json_int_t)after.committed_bytes);
    if (doc && drop_disk)
        json_object_set_new(doc, "disk_dropped_blocks", json_integer((json_int_t)tb.disk.records));
    return srv_answer_json(s, c, hr, 200, doc);
}

/* POST /v1/cache/purge {"cache_salt": "..."}: forget one tenant in both tiers (its cached
 * blocks, the keys of its live ones, every segment on disk holding one of its records). */
enum MHD_Result srv_handle_cache_purge(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr)
{
    static const char *const keys[] = {"cache_salt", NULL};
    const char *msg = "'cache_salt' (a string of 1..1024 bytes) is required";
    json_t *body = admin_body(hr, keys, &msg),
           *v = body ? json_object_get(body, "cache_salt") : NULL;
    size_t len = json_is_string(v) ? json_string_length(v) : 0;
    if (!len || len > 1024) {
        json_decref(body);
        srv_count_rejection(s, SRV_REJ_INVALID);
        char m[160];
        snprintf(m, sizeof(m), "/v1/cache/purge: %s", msg);
        return srv_answer_errorf(s, c, hr, 400, "invalid_request_error", "invalid_value", m);
    }
    uint64_t salt = pkv_openai_salt(json_string_value(v), len);
    json_decref(body);
    uint64_t mem = pkv_kv_purge_salt(s->kv, salt);
    int rc = s->tier ? pkv_kvtier_purge_disk(s->tier, salt) : PKV_OK;
    if (rc)
        return srv_answer_errorf(s, c, hr, 409, "invalid_request_error", "read_only",
                                 "the memory tier was purged; the disk tier's directory is "
                                 "read-only: its records stay");
    return srv_answer_json(s, c, hr, 200,
                           json_pack("{s:b, s:I, s:b}", "purged", 1, "memory_blocks",
                                     (json_int_t)mem, "disk", s->tier != NULL));
}

/* The prompt of a /v1/cache/lookup or /v1/cache/digest body: true with *r (free with
 * pkv_openai_request_free) and *ids / *n (free ids), or false with *ret the error answered. */
static bool cache_prompt(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr,
                         pkv_openai_request_t *r, int32_t **ids, uint32_t *n, enum MHD_Result *ret)
{
    pkv_openai_limits_t lim = {.max_context = s->max_context};
    pkv_openai_error_t err;
    uint32_t mt = 0;
    *ids = NULL;
    *n = 0;
    if (pkv_openai_lookup_parse(hr->body, hr->len, s->served_name, &lim, r, &err)) {
        *ret = srv_answer_error(s, c, hr, &err);
        return false;
    }
    if (pkv_openai_request_prompt(r, s->tok, &lim, s->default_max_tokens, ids, n, &mt, &err)) {
        *ret = srv_answer_error(s, c, hr, &err);
        free(*ids);
        pkv_openai_request_free(r);
        return false;
    }
    return true;
}

/* POST /v1/cache/lookup: how many of the prompt's tokens this node's prefix cache holds
 * under the request's salt (the router's cache_aware policy asks; it changes nothing). */
enum MHD_Result srv_handle_cache_lookup(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr)
{
    pkv_openai_request_t r;
    int32_t *ids;
    uint32_t n, matched = 0, disk = 0;
    enum MHD_Result ret;
    if (!cache_prompt(s, c, hr, &r, &ids, &n, &ret)) return ret;
    int rc = PKV_OK;
    if (s->tier)
        pkv_kvtier_lookup(s->tier, r.salt, ids, n, &matched, &disk);
    else
        rc = pkv_kv_prefix_match(s->kv, r.salt, ids, n, &matched);
    if (rc)
        ret = srv_answer_errorf(s, c, hr, 500, "server_error", "out_of_memory", "out of memory");
    else
        ret = srv_answer_json(s, c, hr, 200,
                              json_pack("{s:i, s:i, s:i}", "matched_tokens", (int)matched,
                                        "disk_matched_tokens", (int)disk, "prompt_tokens", (int)n));
    free(ids);
    pkv_openai_request_free(&r);
    return ret;
}

/* The SHA-256 of head h's K/V on rank r over blocks ids[0..n): for each block, each layer,
 * its K piece then its V piece. */
static void head_digest(pkv_kv_t *kv, uint32_t r, uint32_t h, const uint32_t *ids, uint32_t n,
                        char hexout[65])
{
    const pkv_geometry_t *g = pkv_kv_geometry(kv);
    size_t piece = (size_t)g->block_tokens * pkv_dtype_row_bytes(g->dtype, g->head_dim);
    uint8_t d[SHA256_DIGEST_LENGTH] = {0};
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL)) {
        for (uint32_t b = 0; b < n; b++)
            for (uint32_t l = 0; l < g->layers; l++)
                for (uint32_t w = 0; w < 2; w++)
                    EVP_DigestUpdate(ctx, pkv_kv_block_head_rank(kv, r, ids[b], l, w, h), piece);
        EVP_DigestFinal_ex(ctx, d, NULL);
    }
    EVP_MD_CTX_free(ctx);
    pkv_hex_encode(d, SHA256_DIGEST_LENGTH, hexout);
}

/* POST /v1/cache/digest (the lookup's body): the SHA-256 of each KV head's bytes over the
 * blocks of the prompt this node's prefix cache holds, per tensor-parallel rank, so two
 * nodes (or a node's ranks and a TP=1 node) can be shown to hold the same KV. It pins the
 * blocks while it reads them and changes nothing else. */
enum MHD_Result srv_handle_cache_digest(pkv_server_t *s, struct MHD_Connection *c, http_req_t *hr)
{
    pkv_openai_request_t r;
    int32_t *ids;
    uint32_t n, nb = 0, *blocks = NULL;
    enum MHD_Result ret;
    int rc;
    if (!cache_prompt(s, c, hr, &r, &ids, &n, &ret)) return ret;
    if ((rc = pkv_kv_prefix_pin(s->kv, r.salt, ids, n, &blocks, &nb))) {
        ret = rc == PKV_ERR_UNSUPPORTED
                  ? srv_answer_errorf(s, c, hr, 400, "invalid_request_error", "unsupported",
                                      "/v1/cache/digest needs the paged KV backend")
                  : srv_answer_errorf(s, c, hr, 500, "server_error", "out_of_memory",
                                      "out of memory");
    } else {
        uint32_t tp = pkv_kv_tp(s->kv);
        json_t *ranks = json_array();
        for (uint32_t k = 0; ranks && k < tp; k++) {
            pkv_kv_rank_t info;
            pkv_kv_rank(s->kv, k, &info);
            json_t *heads = json_array();
            for (uint32_t h = info.head_lo; heads && h < info.head_lo + info.head_n; h++) {
                char hx[65];
                head_digest(s->kv, k, h, blocks, nb, hx);
                json_array_append_new(heads, json_string(hx));
            }
            json_array_append_new(ranks, json_pack("{s:i, s:i, s:i, s:o*}", "rank", (int)k,
                                                   "head_lo", (int)info.head_lo, "head_n",
                                                   (int)info.head_n, "heads", heads));
        }
        if (nb) pkv_kv_unpin(s->kv, blocks, nb);
        uint32_t bt = pkv_kv_geometry(s->kv)->block_tokens;
        ret = srv_answer_json(s, c, hr, 200,
                              json_pack("{s:i, s:i, s:i, s:i, s:o*}", "matched_tokens",
                                        (int)(nb * bt), "prompt_tokens", (int)n, "blocks", (int)nb,
                                        "tp", (int)tp, "ranks", ranks));
    }
    free(blocks);
    free(ids);
    pkv_openai_request_free(&r);
    return ret;
}
