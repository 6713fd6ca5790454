/*
 * KV formats across disaggregated nodes (docs/design/disagg.md, "KV formats"): prefill,
 * decode and unified servers in this process, driven over real HTTP as the field's proxies
 * drive them. int8 and fp8 (scaled rows: head_dim codes and an f32 scale) move between a
 * prefill and a decode node bit for bit: every answer (completions and chat, streamed and
 * not, greedy and seeded) equals a unified node's of the same dtype, and so do the decode
 * node's per-head KV digests; each pulled block is exactly one block of the format. Nodes
 * of two formats (bf16 and int8, each side either) refuse each other with 400
 * incompatible_layout naming both dtypes, whether the params say so or the handshake finds
 * it, and nothing is generated, served or held. An int8 pull moves (head_dim + 4) / (2 *
 * head_dim) of bf16's bytes for the same prompt. /health describes the node's KV format
 * (what `pagekv route` compares at start: tests/test_router.c).
 */
#include "tests/support/srvtest.h"
#include "tests/support/testutil.h"

#include "pagekv/kv.h"
#include "pagekv/model.h"
#include "pagekv/server.h"

#include <curl/curl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define HOST "127.0.0.1"

/* ---- nodes ------------------------------------------------------------------------------ */

static pkv_server_t *node(pkv_server_role_t role, const char *preset, pkv_dtype_t dt)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
    pkv_server_config_t c = {.threads = 1,
                             .preset = preset,
                             .kv_dtype = dt,
                             .role = role,
                             .max_context = 1024,
                             /* no cap on cached blocks: the digests read them after the
                                answers (the automatic cap, a quarter of a small budget,
                                is below one granule) */
                             .cache_max_mode = PKV_SERVER_BUDGET_NONE,
                             .kv_transfer_timeout_ms = 5000};
    pkv_server_t *s = NULL;
    ck_assert_int_eq(pkv_server_create(&c, &s), PKV_OK);
    return s;
}

static uint16_t port_of(pkv_server_t *s)
{
    return pkv_server_port(s);
}

/* /v1/cache/stats' kv_transfer (new reference). */
static json_t *kv_stats(uint16_t port)
{
    json_t *st = ts_get_json(HOST, port, "/v1/cache/stats");
    json_t *kv = json_incref(ts_jp(st, "kv_transfer"));
    ck_assert_ptr_nonnull(kv);
    json_decref(st);
    return kv;
}

static long long requests_submitted(uint16_t port)
{
    json_t *st = ts_get_json(HOST, port, "/v1/cache/stats");
    long long n = ts_ji(st, "requests.submitted");
    json_decref(st);
    return n;
}

/* ---- legs ------------------------------------------------------------------------------- */

/* One answer: text, finish reason and token counts (streamed or not), or the error. */
typedef struct {
    long status;
    char text[8192];
    char finish[16];
    long long prompt, completion;
    json_t *doc; /* non-streamed: the whole answer */
} leg_t;

/* A streamed answer's text, finish reason and usage. */
static void sse_take(const char *body, bool chat, leg_t *out)
{
    size_t tl = 0;
    bool done = false;
    for (const char *ev = body; ev && (ev = strstr(ev, "data: "));) {
        ev += 6;
        const char *end = strstr(ev, "\n\n");
        ck_assert_ptr_nonnull(end);
        if (!strncmp(ev, "[DONE]", 6)) {
            done = true;
            break;
        }
        json_t *doc = json_loadb(ev, (size_t)(end - ev), 0, NULL);
        ck_assert_msg(doc != NULL, "bad event: %.80s", ev);
        json_t *t = ts_jp(doc, chat ? "choices.0.delta.content" : "choices.0.text");
        if (json_is_string(t) && tl + json_string_length(t) < sizeof(out->text)) {
            memcpy(out->text + tl, json_string_value(t), json_string_length(t));
            tl += json_string_length(t);
        }
        json_t *f = ts_jp(doc, "choices.0.finish_reason");
        if (json_is_string(f))
            snprintf(out->finish, sizeof(out->finish), "%s", json_string_value(f));
        if (json_is_object(json_object_get(doc, "usage"))) {
            out->prompt = ts_ji(doc, "usage.prompt_tokens");
            out->completion = ts_ji(doc, "usage.completion_tokens");
        }
        json_decref(doc);
        ev = end;
    }
    out->text[tl] = 0;
    ck_assert_msg(done, "the stream did not end with [DONE]");
}

/* POST req to path on port (header: one more request header, or NULL). */
static void leg_post(uint16_t port, const char *path, const json_t *req, const char *header,
                     leg_t *out)
{
    memset(out, 0, sizeof(*out));
    bool chat = strstr(path, "chat") != NULL;
    char *body = json_dumps(req, 0);
    ts_resp_t r;
    ck_assert_int_eq(ts_http(HOST, port, "POST", path, body, header, 60, &r), CURLE_OK);
    free(body);
    out->status = r.status;
    if (json_is_true(json_object_get(req, "stream")) && r.status == 200) {
        sse_take(r.body ? r.body : "", chat, out);
    } else {
        out->doc = json_loadb(r.body ? r.body : "", r.len, 0, NULL);
        ck_assert_msg(out->doc != NULL, "not JSON: %.300s", r.body ? r.body : "");
        if (r.status == 200) {
            json_t *t = ts_jp(out->doc, chat ? "choices.0.message.content" : "choices.0.text");
            snprintf(out->text, sizeof(out->text), "%s", json_string_value(t));
            snprintf(out->finish, sizeof(out->finish), "%s",
                     ts_js(out->doc, "choices.0.finish_reason"));
            out->prompt = ts_ji(out->doc, "usage.prompt_tokens");
            out->completion = ts_ji(out->doc, "usage.completion_tokens");
        }
    }
    ts_resp_free(&r);
}

/* The prefill leg of req on port, as a proxy makes it: its kv_transfer_params. */
static json_t *prefill_leg(uint16_t port, const char *path, const json_t *req)
{
    json_t *pre = json_deep_copy(req);
    json_object_set_new(pre, "max_tokens", json_integer(1));
    json_object_set_new(pre, "stream", json_false());
    json_object_del(pre, "stream_options");
    json_object_set_new(pre, "kv_transfer_params",
                        json_pack("{s:b, s:b}", "do_remote_decode", 1, "do_remote_prefill", 0));
    leg_t p;
    leg_post(port, path, pre, NULL, &p);
    json_decref(pre);
    ck_assert_msg(p.status == 200, "prefill leg: %ld", p.status);
    json_t *kt = json_incref(ts_jp(p.doc, "kv_transfer_params"));
    ck_assert_ptr_nonnull(kt);
    json_decref(p.doc);
    return kt;
}

/* The decode leg of req with kt on port. */
static void decode_leg(uint16_t port, const char *path, const json_t *req, json_t *kt,
                       const char *header, leg_t *out)
{
    json_t *dec = json_deep_copy(req);
    json_object_set(dec, "kv_transfer_params", kt);
    leg_post(port, path, dec, header, out);
    json_decref(dec);
}

/* A prompt of several blocks: the decode leg pulls whole blocks, not only a token. */
#define SPANS_BLOCKS                                                                               \
    " - and this prompt goes on for several blocks of sixteen tokens, so that the decode "         \
    "leg pulls whole blocks of KV from the prefill node instead of releasing its lease with "      \
    "the token alone"

static json_t *completion(const char *prompt, bool stream, int seed)
{
    char text[1024];
    snprintf(text, sizeof(text), "%s%s", prompt, SPANS_BLOCKS);
    json_t *r = json_pack("{s:s, s:s, s:i, s:b}", "model", "tiny", "prompt", text, "max_tokens", 10,
                          "stream", (int)stream);
    json_object_set_new(r, "temperature", json_real(seed < 0 ? 0.0 : 0.9));
    if (seed >= 0) json_object_set_new(r, "seed", json_integer(seed));
    if (stream) json_object_set_new(r, "stream_options", json_pack("{s:b}", "include_usage", 1));
    return r;
}

static json_t *chat(const char *content, bool stream, int seed)
{
    char text[1024];
    snprintf(text, sizeof(text), "%s%s", content, SPANS_BLOCKS);
    json_t *r = json_pack("{s:s, s:[{s:s, s:s}], s:i, s:b}", "model", "tiny", "messages", "role",
                          "user", "content", text, "max_tokens", 10, "stream", (int)stream);
    json_object_set_new(r, "temperature", json_real(seed < 0 ? 0.0 : 0.7));
    if (seed >= 0) json_object_set_new(r, "seed", json_integer(seed));
    if (stream) json_object_set_new(r, "stream_options", json_pack("{s:b}", "include_usage", 1));
    return r;
}

/* The per-head KV digests (/v1/cache/digest) of req's prompt on port: the "ranks" array as
 * compact JSON (malloc'd), and the blocks digested. */
static char *digests(uint16_t port, const json_t *req, long long *blocks)
{
    json_t *q = json_deep_copy(req);
    json_object_del(q, "max_tokens");
    json_object_del(q, "stream");
    json_object_del(q, "stream_options");
    json_object_del(q, "temperature");
    json_object_del(q, "seed");
    char *body = json_dumps(q, 0);
    json_decref(q);
    ts_resp_t r;
    ck_assert_int_eq(ts_http(HOST, port, "POST", "/v1/cache/digest", body, NULL, 30, &r), CURLE_OK);
    free(body);
    ck_assert_msg(r.status == 200, "digest: %ld %s", r.status, r.body ? r.body : "");
    json_t *doc = json_loadb(r.body, r.len, 0, NULL);
    ck_assert_ptr_nonnull(doc);
    *blocks = ts_ji(doc, "blocks");
    char *s = json_dumps(ts_jp(doc, "ranks"), JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(doc);
    ts_resp_free(&r);
    return s;
}

/* Bytes of one KV block of the preset's geometry in dtype dt (16 tokens a block). */
static long long block_bytes(const char *preset, pkv_dtype_t dt)
{
    pkv_model_config_t mc;
    ck_assert_int_eq(pkv_model_preset(preset, &mc), PKV_OK);
    return 2ll * mc.n_layers * mc.n_kv_heads * 16 * (long long)pkv_dtype_row_bytes(dt, mc.head_dim);
}

/* ---- int8 and fp8 through a prefill and a decode node ----------------------------------- */

static const pkv_dtype_t SCALED[] = {PKV_DTYPE_INT8, PKV_DTYPE_FP8};

/* Every answer of the pair equals the unified node's of the same dtype; the decode node's
 * KV of each prompt equals the unified node's bitwise (per-head digests); each pulled block
 * is one block of the format; /health names the format. */
START_TEST(scaled_pair_equals_unified)
{
    pkv_dtype_t dt = SCALED[_i];
    pkv_server_t *pre = node(PKV_SERVER_ROLE_PREFILL, "tiny", dt);
    pkv_server_t *dec = node(PKV_SERVER_ROLE_DECODE, "tiny", dt);
    pkv_server_t *uni = node(PKV_SERVER_ROLE_UNIFIED, "tiny", dt);
    json_t *reqs[] = {
        completion("Greedy: the quick brown fox jumps over the lazy dog", false, -1),
        completion("Greedy and streamed: a small boat crossed the bay at dawn", true, -1),
        completion("Seeded: once upon a time a fox lived in a quiet wood", false, 11),
        chat("Tell me about paged attention in one line", false, -1),
        chat("Stream me a seeded chat answer about caches and pages", true, 3),
    };
    const char *paths[] = {"/v1/completions", "/v1/completions", "/v1/completions",
                           "/v1/chat/completions", "/v1/chat/completions"};
    for (size_t i = 0; i < PKV_ARRAY_LEN(reqs); i++) {
        leg_t u, d;
        leg_post(port_of(uni), paths[i], reqs[i], NULL, &u);
        ck_assert_int_eq(u.status, 200);
        json_t *kt = prefill_leg(port_of(pre), paths[i], reqs[i]);
        ck_assert_str_eq(ts_js(kt, "pagekv_geometry.dtype"), pkv_dtype_name(dt));
        decode_leg(port_of(dec), paths[i], reqs[i], kt, NULL, &d);
        json_decref(kt);
        ck_assert_msg(d.status == 200, "%s request %zu: decode leg %ld", pkv_dtype_name(dt), i,
                      d.status);
        ck_assert_msg(!strcmp(d.text, u.text), "%s request %zu: '%s' vs unified '%s'",
                      pkv_dtype_name(dt), i, d.text, u.text);
        ck_assert_str_eq(d.finish, u.finish);
        ck_assert_int_eq(d.prompt, u.prompt);
        ck_assert_int_eq(d.completion, u.completion);
        long long bd, bu;
        char *hd = digests(port_of(dec), reqs[i], &bd), *hu = digests(port_of(uni), reqs[i], &bu);
        ck_assert_int_gt(bu, 1);
        ck_assert_int_eq(bd, bu);
        ck_assert_msg(!strcmp(hd, hu), "%s request %zu: the decode node's KV differs:\n%s\n%s",
                      pkv_dtype_name(dt), i, hd, hu);
        free(hd);
        free(hu);
        json_decref(u.doc);
        json_decref(d.doc);
    }
    json_t *k = kv_stats(port_of(dec)), *p = kv_stats(port_of(pre));
    ck_assert_int_eq(ts_ji(k, "pulls.ok"), (long long)PKV_ARRAY_LEN(reqs));
    ck_assert_int_eq(ts_ji(k, "pulls.failed"), 0);
    long long pulled = ts_ji(k, "pulls.blocks_pulled"), got = ts_ji(k, "transfers.bytes_received");
    ck_assert_int_gt(pulled, 0);
    ck_assert_int_eq(got, ts_ji(p, "transfers.bytes_sent"));
    ck_assert_int_eq(got, pulled * block_bytes("tiny", dt));
    json_decref(k);
    json_decref(p);
    json_t *h = ts_get_json(HOST, port_of(dec), "/health");
    ck_assert_str_eq(ts_js(h, "kv_layout.dtype"), pkv_dtype_name(dt));
    ck_assert_int_eq(ts_ji(h, "kv_layout.layers"), 2);
    ck_assert_int_eq(ts_ji(h, "kv_layout.kv_heads"), 2);
    ck_assert_int_eq(ts_ji(h, "kv_layout.head_dim"), 16);
    ck_assert_int_eq(ts_ji(h, "kv_layout.block_tokens"), 16);
    ck_assert_int_eq(ts_ji(h, "kv_layout.tp"), 1);
    json_decref(h);
    h = ts_get_json(HOST, port_of(uni), "/health");
    ck_assert_ptr_null(ts_jp(h, "kv_layout")); /* a unified node answers as before */
    json_decref(h);
    for (size_t i = 0; i < PKV_ARRAY_LEN(reqs); i++) json_decref(reqs[i]);
    pkv_server_destroy(uni);
    pkv_server_destroy(dec);
    pkv_server_destroy(pre);
}
END_TEST

/* ---- two formats refuse each other ------------------------------------------------------ */

static const struct {
    pkv_dtype_t prefill, decode;
} MIXED[] = {{PKV_DTYPE_BF16, PKV_DTYPE_INT8}, {PKV_DTYPE_INT8, PKV_DTYPE_BF16}};

/* d is a 400 incompatible_layout on param whose message names both dtypes. */
static void refused(const leg_t *d, const char *param, const char *a, const char *b)
{
    ck_assert_msg(d->status == 400, "status %ld", d->status);
    ck_assert_str_eq(ts_js(d->doc, "error.type"), "invalid_request_error");
    ck_assert_str_eq(ts_js(d->doc, "error.code"), "incompatible_layout");
    ck_assert_str_eq(ts_js(d->doc, "error.param"), param);
    const char *msg = ts_js(d->doc, "error.message");
    ck_assert_msg(strstr(msg, a) && strstr(msg, b), "'%s' names not both %s and %s", msg, a, b);
}

/* A decode node of one format given a prefill node of the other's params: 400
 * incompatible_layout naming both dtypes, before anything is asked of the producer. The
 * same params with the geometry's dtype forged to the decode node's pass that check and
 * meet the handshake: the producer's HELLO says its format, the read ends before READ (and
 * its token) leaves, 400 incompatible_layout naming both. Nothing is generated or served,
 * the decode node holds nothing, the registration stays; the decode node still serves. */
START_TEST(two_formats_refuse_each_other)
{
    pkv_dtype_t pd = MIXED[_i].prefill, dd = MIXED[_i].decode;
    const char *pn = pkv_dtype_name(pd), *dn = pkv_dtype_name(dd);
    pkv_server_t *pre = node(PKV_SERVER_ROLE_PREFILL, "tiny", pd);
    pkv_server_t *dec = node(PKV_SERVER_ROLE_DECODE, "tiny", dd);
    json_t *req = completion("Two formats", false, -1);
    const char *path = "/v1/completions";
    json_t *kt = prefill_leg(port_of(pre), path, req);
    ck_assert_str_eq(ts_js(kt, "pagekv_geometry.dtype"), pn);
    leg_t d;
    decode_leg(port_of(dec), path, req, kt, NULL, &d);
    refused(&d, "kv_transfer_params.pagekv_geometry", pn, dn);
    json_decref(d.doc);

    json_t *forged = json_deep_copy(kt);
    json_object_set_new(ts_jp(forged, "pagekv_geometry"), "dtype", json_string(dn));
    decode_leg(port_of(dec), path, req, forged, NULL, &d);
    json_decref(forged);
    refused(&d, "kv_transfer_params", pn, dn);
    char want[64];
    snprintf(want, sizeof(want), "KV dtype %s there, %s here", pn, dn);
    ck_assert_msg(strstr(ts_js(d.doc, "error.message"), want), "'%s' lacks '%s'",
                  ts_js(d.doc, "error.message"), want);
    json_decref(d.doc);

    ck_assert_int_eq(requests_submitted(port_of(dec)), 0); /* nothing generated */
    json_t *k = kv_stats(port_of(dec));
    ck_assert_int_eq(ts_ji(k, "pulls.failed"), 1); /* the handshake's; the first never pulled */
    ck_assert_int_eq(ts_ji(k, "pulls.ok"), 0);
    ck_assert_int_eq(ts_ji(k, "transfers.bytes_received"), 0);
    ck_assert_int_eq(ts_ji(k, "transfers.active"), 0);
    ck_assert_int_eq(ts_ji(k, "staging.pages_used"), 0);
    json_decref(k);
    json_t *st = ts_get_json(HOST, port_of(dec), "/v1/cache/stats");
    ck_assert_int_eq(ts_ji(st, "blocks.live"), 0);
    ck_assert_int_eq(ts_ji(st, "blocks.cached"), 0);
    json_decref(st);
    json_t *p = kv_stats(port_of(pre));
    ck_assert_int_eq(ts_ji(p, "transfers.serves_started"), 0); /* no READ reached it */
    ck_assert_int_eq(ts_ji(p, "transfers.bytes_sent"), 0);
    ck_assert_int_eq(ts_ji(p, "leases.live"), 1); /* until its lease ends */
    json_decref(p);
    /* The decode node computes a request of its own. */
    leg_post(port_of(dec), path, req, NULL, &d);
    ck_assert_int_eq(d.status, 200);
    json_decref(d.doc);
    json_decref(kt);
    json_decref(req);
    pkv_server_destroy(dec);
    pkv_server_destroy(pre);
}
END_TEST

/* ---- bytes on the wire ------------------------------------------------------------------ */

/* The bytes the decode leg of one prompt pulls (X-Pagekv-Timings' kv_pulled_bytes, which
 * both nodes' byte counters must match) through a fresh pair of dtype dt; *blocks: pulled. */
static long long pulled_bytes(const char *preset, pkv_dtype_t dt, long long *blocks)
{
    pkv_server_t *pre = node(PKV_SERVER_ROLE_PREFILL, preset, dt);
    pkv_server_t *dec = node(PKV_SERVER_ROLE_DECODE, preset, dt);
    json_t *req = json_pack("{s:s, s:s, s:i, s:f}", "model", preset, "prompt",
                            "The same prompt for both formats: the decode leg pulls its "
                            "blocks, and the bytes that cross the wire are the blocks' bytes in "
                            "the node's KV format, no more",
                            "max_tokens", 2, "temperature", 0.0);
    json_t *kt = prefill_leg(port_of(pre), "/v1/completions", req);
    leg_t d;
    decode_leg(port_of(dec), "/v1/completions", req, kt, "X-Pagekv-Timings: 1", &d);
    ck_assert_int_eq(d.status, 200);
    long long bytes = ts_ji(d.doc, "pagekv_timings.kv_pulled_bytes");
    *blocks = ts_ji(d.doc, "pagekv_timings.kv_pulled_blocks");
    /* The decode leg takes the prefill leg's first token and computes no prompt position:
     * every position came by the pull, the last block partial (this prompt does not end a
     * block). */
    long long np = ts_ji(d.doc, "usage.prompt_tokens");
    ck_assert_int_ne(np % 16, 0);
    ck_assert_int_eq(ts_ji(d.doc, "usage.prompt_tokens_details.cached_tokens"), np);
    ck_assert_int_eq(*blocks, (np + 15) / 16);
    json_t *k = kv_stats(port_of(dec)), *p = kv_stats(port_of(pre));
    ck_assert_int_eq(ts_ji(k, "transfers.bytes_received"), bytes);
    ck_assert_int_eq(ts_ji(p, "transfers.bytes_sent"), bytes);
    json_decref(k);
    json_decref(p);
    json_decref(d.doc);
    json_decref(kt);
    json_decref(req);
    pkv_server_destroy(dec);
    pkv_server_destroy(pre);
    return bytes;
}

/* The same prompt through an int8 pair and a bf16 pair of llama-3.2-1b's geometry (head
 * dim 64): the same blocks move, int8's bytes are (64 + 4) / 128 = 0.53 of bf16's. */
START_TEST(int8_moves_about_half_of_bf16)
{
    const char *preset = "llama-3.2-1b";
    pkv_model_config_t mc;
    ck_assert_int_eq(pkv_model_preset(preset, &mc), PKV_OK);
    double want = (double)pkv_dtype_row_bytes(PKV_DTYPE_INT8, mc.head_dim) /
                  (double)pkv_dtype_row_bytes(PKV_DTYPE_BF16, mc.head_dim);
    long long nb16, nb8;
    long long b16 = pulled_bytes(preset, PKV_DTYPE_BF16, &nb16);
    long long b8 = pulled_bytes(preset, PKV_DTYPE_INT8, &nb8);
    ck_assert_int_gt(nb16, 1);
    ck_assert_int_eq(nb8, nb16);
    ck_assert_int_eq(b16, nb16 * block_bytes(preset, PKV_DTYPE_BF16));
    ck_assert_int_eq(b8, nb8 * block_bytes(preset, PKV_DTYPE_INT8));
    double ratio = (double)b8 / (double)b16;
    fprintf(stderr, "int8 pulled %lld bytes, bf16 %lld (%lld blocks): ratio %.4f (rows %.4f)\n", b8,
            b16, nb16, ratio, want);
    ck_assert_msg(ratio >= 0.5 && ratio <= 0.56, "int8 / bf16 bytes %.4f", ratio);
    ck_assert_msg(ratio > want - 1e-9 && ratio < want + 1e-9, "ratio %.6f, rows say %.6f", ratio,
                  want);
}
END_TEST

static Suite *kv_formats_suite(void)
{
    Suite *s = suite_create("kv_formats");
    TCase *tc = tcase_create("kv_formats");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, scaled_pair_equals_unified, 0, (int)PKV_ARRAY_LEN(SCALED));
    tcase_add_loop_test(tc, two_formats_refuse_each_other, 0, (int)PKV_ARRAY_LEN(MIXED));
    tcase_add_test(tc, int8_moves_about_half_of_bf16);
    suite_add_tcase(s, tc);
    return s;
}

PKV_TEST_MAIN(kv_formats_suite)
