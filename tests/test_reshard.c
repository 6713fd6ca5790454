/*
 * Resharding between prefill and decode nodes of different tensor parallelism, as real
 * processes through `pagekv route`: for each P -> D pair (bf16; int8 and fp8 on tiny) the
 * answer equals a unified TP=1 node's of the same KV dtype bitwise, and every decode rank's
 * KV (and every prefill rank's) equals the matching head slice of the unified node's KV
 * (POST /v1/cache/digest: SHA-256 per head). Faults: a
 * prefill rank that dies mid-pull, one decode rank's pull rejected, an incompatible layout.
 * Bad --tp values exit 2.
 */
#include "pagekv/server.h"

#include "core/core.h"
#include "support/cluster.h"
#include "support/filler.h"
#include "support/http.h"
#include "support/launch.h"
#include "tests/support/srvtest.h"
#include "tests/support/testutil.h"

#include <check.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char BIN[4096];
static char LOGDIR[64];

static void setup(void)
{
    ts_pagekv_path(BIN, sizeof(BIN));
    snprintf(LOGDIR, sizeof(LOGDIR), "/tmp/pkv-reshard-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(LOGDIR));
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", LOGDIR);
    if (system(cmd)) {
    }
}

/* `pagekv serve --role ROLE --preset PRESET --tp TP --kv-dtype DTYPE` plus extra arguments
 * (NULL-terminated, may be NULL) and environment entries (may be NULL). */
static void serve_dt(launch_proc_t *p, const char *name, const char *role, const char *preset,
                     unsigned tp, const char *dtype, const char *const *extra, char *const *env)
{
    char tps[16];
    snprintf(tps, sizeof(tps), "%u", tp);
    char *argv[48] = {BIN, "serve", "--port", "0", "--threads", "1", "--preset", (char *)preset,
                      "--tp", tps, "--role", (char *)role, "--kv-dtype", (char *)dtype,
                      /* the tiny preset's automatic cap (a quarter of 8 MiB) is below one
                         granule of a replicated pool (tp x the rank's share): the digests
                         need the prompt's blocks to stay cached */
                      "--prefix-cache-max-bytes", "64M"};
    int n = 16;
    for (; extra && *extra; extra++) argv[n++] = (char *)*extra;
    argv[n] = NULL;
    char err[4096];
    int rc = launch_start(p, name, argv, env, LOGDIR, pkv_deadline_after_ns(60000000000ull), err,
                          sizeof(err));
    ck_assert_msg(rc == 0, "%s: %s", name, err);
}

/* serve_dt with bf16 KV. */
static void serve(launch_proc_t *p, const char *name, const char *role, const char *preset,
                  unsigned tp, const char *const *extra, char *const *env)
{
    serve_dt(p, name, role, preset, tp, "bf16", extra, env);
}

static void route(launch_proc_t *rt, const launch_proc_t *pre, const launch_proc_t *dec)
{
    char *argv[] = {BIN,        "route",          "--port", "0", "--prefill", (char *)pre->url,
                    "--decode", (char *)dec->url, NULL};
    char err[4096];
    int rc = launch_start(rt, "router", argv, NULL, LOGDIR, pkv_deadline_after_ns(30000000000ull),
                          err, sizeof(err));
    ck_assert_msg(rc == 0, "router: %s", err);
}

static void stop(launch_proc_t *p)
{
    int rc = launch_stop(p, SIGTERM, pkv_deadline_after_ns(30000000000ull));
    if (rc != 0) {
        char tail[4096];
        launch_log_tail(p, tail, sizeof(tail));
        ck_abort_msg("%s exited %d\n%s", p->name, rc, tail);
    }
}

/* A chat request at temperature 0 over `chars` characters of filler. */
static json_t *chat(const char *preset, size_t chars, uint64_t seed, int max_tokens)
{
    char *text = pkv_filler_alloc(chars, seed, 1);
    ck_assert_ptr_nonnull(text);
    json_t *req = json_pack("{s:s, s:[{s:s, s:s}], s:i, s:f}", "model", preset, "messages", "role",
                            "user", "content", text, "max_tokens", max_tokens, "temperature", 0.0);
    free(text);
    return req;
}

/* POST body to url + path; returns the reply (status checked by the caller). */
static http_reply_t post(const char *url, const char *path, const json_t *body)
{
    http_reply_t r;
    int rc = http_call(url, path, body, NULL, 60000, NULL, &r);
    ck_assert_msg(rc == 0, "POST %s%s: %s", url, path, r.error);
    return r;
}

static void answer(const char *url, const json_t *req, cluster_answer_t *a)
{
    http_reply_t r = post(url, "/v1/chat/completions", req);
    ck_assert_msg(r.status == 200, "%s: %ld %s", url, r.status, r.body ? r.body : "");
    ck_assert_int_eq(cluster_answer_parse(r.body, false, a), 0);
    http_reply_free(&r);
}

static json_t *post_json(const char *url, const char *path, const json_t *body, long want)
{
    http_reply_t r = post(url, path, body);
    ck_assert_msg(r.status == want, "%s%s: %ld (want %ld) %s", url, path, r.status, want,
                  r.body ? r.body : "");
    json_t *doc = json_loads(r.body ? r.body : "", 0, NULL);
    ck_assert_ptr_nonnull(doc);
    http_reply_free(&r);
    return doc;
}

/* The node's per-head digests of the prompt's cached KV: heads[h] from the rank(s) holding
 * h (replicas must agree). Returns the blocks digested. */
static long digests(const char *url, const json_t *req, unsigned kv_heads, char heads[][65])
{
    json_t *d = post_json(url, "/v1/cache/digest", req, 200);
    long blocks = cluster_json_int(d, "blocks");
    bool seen[64] = {0};
    json_t *ranks = json_object_get(d, "ranks");
    for (size_t r = 0; r < json_array_size(ranks); r++) {
        json_t *rk = json_array_get(ranks, r);
        long lo = cluster_json_int(rk, "head_lo"), n = cluster_json_int(rk, "head_n");
        json_t *hs = json_object_get(rk, "heads");
        ck_assert_int_eq((long)json_array_size(hs), n);
        for (long i = 0; i < n; i++) {
            const char *hx = json_string_value(json_array_get(hs, (size_t)i));
            ck_assert_ptr_nonnull(hx);
            unsigned h = (unsigned)(lo + i);
            ck_assert_uint_lt(h, kv_heads);
            if (seen[h])
                ck_assert_msg(!strcmp(heads[h], hx), "%s: replicas of head %u differ (rank %zu)",
                              url, h, r);
            snprintf(heads[h], 65, "%s", hx);
            seen[h] = true;
        }
    }
    for (unsigned h = 0; h < kv_heads; h++)
        ck_assert_msg(seen[h], "%s: no rank holds head %u", url, h);
    json_decref(d);
    return blocks;
}

static json_t *kv_stats(const launch_proc_t *p)
{
    json_t *doc = http_get_json(p->url, "/v1/cache/stats", 10000);
    ck_assert_ptr_nonnull(doc);
    json_t *kvt = json_incref(json_object_get(doc, "kv_transfer"));
    json_decref(doc);
    ck_assert_ptr_nonnull(kvt);
    return kvt;
}

/* Nothing staged, pinned or in flight on any rank of the node (polled: a transfer's last
 * references go a moment after its outcome). */
static void nothing_held(const launch_proc_t *p, bool pins_too)
{
    uint64_t deadline = pkv_deadline_after_ns(5000000000ull);
    for (;;) {
        json_t *k = kv_stats(p);
        bool ok = cluster_json_int(k, "staging.pages_used") == 0 &&
                  cluster_json_int(k, "transfers.active") == 0 &&
                  (!pins_too || cluster_json_int(k, "leases.pinned_blocks") == 0);
        json_t *ranks = json_object_get(k, "ranks");
        for (size_t r = 0; r < json_array_size(ranks); r++)
            ok = ok && cluster_json_int(json_array_get(ranks, r), "staging.pages_used") == 0;
        char *dump = json_dumps(k, JSON_COMPACT);
        json_decref(k);
        if (ok) {
            free(dump);
            return;
        }
        ck_assert_msg(pkv_now_ns() < deadline, "%s still holds: %s", p->name, dump);
        free(dump);
        usleep(20000);
    }
}

/* ---- pairs ---------------------------------------------------------------------------- */

static const struct {
    const char *preset;
    unsigned kv_heads, p, d;
} PAIRS[] = {
    {"llama-3.2-1b", 8, 2, 2},
    {"llama-3.2-1b", 8, 8, 8},
    {"llama-3.2-1b", 8, 1, 2},
    {"llama-3.2-1b", 8, 2, 1},
    {"llama-3.2-1b", 8, 4, 2},
    {"llama-3.2-1b", 8, 2, 4},
    {"llama-3.2-1b", 8, 8, 1},
    {"llama-3.2-1b", 8, 1, 8},
    /* tiny has 2 KV heads: decode ranks above that hold replicas; prefill replicas too */
    {"tiny", 2, 1, 4},
    {"tiny", 2, 4, 2},
};

/* The answer through the router equals the unified TP=1 node's (same KV dtype), and the
 * decode node's and the prefill node's per-head KV digests equal the unified node's. Two
 * prompts: one that ends inside a block, one long enough for several granules. */
static void pair_check(const char *preset, const char *dtype, unsigned P, unsigned D, unsigned H)
{
    launch_proc_t uni, pre, dec, rt;
    /* equality, not deadlines, is the point here: a pull under a sanitizer on two busy
     * vCPUs can pass the default 10 s (it did once, 503 timeout) */
    static const char *const slow[] = {"--kv-transfer-timeout-ms", "60000", NULL};
    serve_dt(&uni, "unified", "unified", preset, 1, dtype, NULL, NULL);
    serve_dt(&pre, "prefill", "prefill", preset, P, dtype, NULL, NULL);
    serve_dt(&dec, "decode", "decode", preset, D, dtype, slow, NULL);
    route(&rt, &pre, &dec);
    static const size_t chars[] = {301, 2900};
    for (int q = 0; q < 2; q++) {
        json_t *req = chat(preset, chars[q], 7 + (uint64_t)q, 8);
        cluster_answer_t a, u;
        answer(rt.url, req, &a);
        answer(uni.url, req, &u);
        ck_assert_msg(cluster_answer_equal(&a, &u), "%s %s %u->%u prompt %d: '%s' vs unified '%s'",
                      preset, dtype, P, D, q, a.text, u.text);
        char hu[64][65], hd[64][65], hp[64][65];
        long bu = digests(uni.url, req, H, hu);
        long bd = digests(dec.url, req, H, hd);
        long bp = digests(pre.url, req, H, hp);
        ck_assert_msg(bu > 0 && bd == bu && bp == bu,
                      "blocks digested: unified %ld decode %ld "
                      "prefill %ld",
                      bu, bd, bp);
        for (unsigned h = 0; h < H; h++) {
            ck_assert_msg(!strcmp(hd[h], hu[h]), "%s %s %u->%u: decode head %u KV differs", preset,
                          dtype, P, D, h);
            ck_assert_msg(!strcmp(hp[h], hu[h]), "%s %s %u->%u: prefill head %u KV differs", preset,
                          dtype, P, D, h);
        }
        cluster_answer_free(&a);
        cluster_answer_free(&u);
        json_decref(req);
    }
    json_t *k = kv_stats(&dec);
    ck_assert_int_eq(cluster_json_int(k, "tp"), D);
    ck_assert_int_eq(cluster_json_int(k, "pulls.ok"), 2);
    ck_assert_int_eq(cluster_json_int(k, "pulls.failed"), 0);
    json_decref(k);
    nothing_held(&dec, true);
    nothing_held(&pre, true); /* every rank's registration acknowledged: pins returned */
    stop(&rt);
    stop(&dec);
    stop(&pre);
    stop(&uni);
}

START_TEST(pair_equals_unified)
{
    pair_check(PAIRS[_i].preset, "bf16", PAIRS[_i].p, PAIRS[_i].d, PAIRS[_i].kv_heads);
}
END_TEST

/* The scaled formats (rows of head_dim one-byte codes and an f32 scale) through the router:
 * int8 and fp8 at TP 1 -> 1, and int8 resharded 1 -> 2 (each decode rank reads its head's
 * slice of the rows, scales included). tiny: 2 KV heads of 16. */
static const struct {
    const char *dtype;
    unsigned p, d;
} SCALED_PAIRS[] = {{"int8", 1, 1}, {"fp8", 1, 1}, {"int8", 1, 2}};

START_TEST(scaled_pair_equals_unified)
{
    pair_check("tiny", SCALED_PAIRS[_i].dtype, SCALED_PAIRS[_i].p, SCALED_PAIRS[_i].d, 2);
}
END_TEST

/* ---- faults --------------------------------------------------------------------------- */

/* The prefill leg's kv_transfer_params for req (new reference). */
static json_t *prefill_leg(const char *url, const json_t *req)
{
    json_t *body = json_deep_copy(req);
    json_object_set_new(body, "kv_transfer_params", json_pack("{s:b}", "do_remote_decode", 1));
    json_t *doc = post_json(url, "/v1/chat/completions", body, 200);
    json_t *kt = json_incref(json_object_get(doc, "kv_transfer_params"));
    ck_assert_ptr_nonnull(kt);
    json_decref(doc);
    json_decref(body);
    return kt;
}

/* The decode leg with kt: its reply. */
static http_reply_t decode_leg(const launch_proc_t *dec, const json_t *req, json_t *kt)
{
    json_t *body = json_deep_copy(req);
    json_object_set(body, "kv_transfer_params", kt);
    http_reply_t r = post(dec->url, "/v1/chat/completions", body);
    json_decref(body);
    return r;
}

static void error_code_is(const http_reply_t *r, long status, const char *codes)
{
    json_t *doc = json_loads(r->body ? r->body : "", 0, NULL);
    const char *code = json_string_value(json_object_get(json_object_get(doc, "error"), "code"));
    ck_assert_msg(r->status == status && code && strstr(codes, code), "want %ld %s, got %ld %s",
                  status, codes, r->status, r->body ? r->body : "");
    json_decref(doc);
}

/* A prefill rank dies mid-pull (fault site PKV_FAULT_XFER_HANG: the first of its agents to
 * send a layer stops, no more messages, no heartbeats): the request ends typed, within the
 * transfer deadline + 1 s, on every decode rank, and the decode node holds nothing
 * afterwards. The prefill node runs in this process, so the site is armed here. */
START_TEST(prefill_rank_dies_mid_pull)
{
    launch_proc_t dec;
    pkv_server_config_t cfg = {.threads = 1,
                               .preset = "llama-3.2-1b",
                               .tp = 2,
                               .role = PKV_SERVER_ROLE_PREFILL,
                               .kv_dtype = PKV_DTYPE_BF16};
    pkv_server_t *pre = NULL;
    ck_assert_int_eq(pkv_server_create(&cfg, &pre), PKV_OK);
    char pre_url[64];
    snprintf(pre_url, sizeof(pre_url), "http://127.0.0.1:%u", pkv_server_port(pre));
    const char *dx[] = {"--kv-transfer-timeout-ms", "4000", NULL};
    serve(&dec, "decode", "decode", "llama-3.2-1b", 2, dx, NULL);
    json_t *req = chat("llama-3.2-1b", 2900, 3, 4);
    json_t *kt = prefill_leg(pre_url, req);
    pkv_fault_arm(PKV_FAULT_XFER_HANG, 0, 1);
    uint64_t t0 = pkv_now_ns();
    http_reply_t r = decode_leg(&dec, req, kt);
    double s = (double)(pkv_now_ns() - t0) / 1e9;
    error_code_is(&r, 503, "peer_lost timeout");
    ck_assert_msg(s < 4.0 + 1.0, "the failed pull took %.2f s (deadline 4 s)", s);
    ck_assert_uint_eq(pkv_fault_fired(PKV_FAULT_XFER_HANG), 1);
    http_reply_free(&r);
    json_t *k = kv_stats(&dec);
    ck_assert_int_eq(cluster_json_int(k, "pulls.failed"), 1);
    json_decref(k);
    nothing_held(&dec, true);
    json_decref(kt);
    json_decref(req);
    stop(&dec);
    pkv_server_destroy(pre);
}
END_TEST

/* One decode rank's pull presents a wrong token: the whole request fails (400 rejected),
 * no rank keeps partial KV (the next request with the right params pulls and answers as
 * the unified node does), nothing is held. */
START_TEST(one_rank_rejected_fails_the_request)
{
    launch_proc_t pre, dec, uni;
    serve(&uni, "unified", "unified", "llama-3.2-1b", 1, NULL, NULL);
    serve(&pre, "prefill", "prefill", "llama-3.2-1b", 2, NULL, NULL);
    serve(&dec, "decode", "decode", "llama-3.2-1b", 2, NULL, NULL);
    json_t *req = chat("llama-3.2-1b", 2900, 5, 6);
    json_t *kt = prefill_leg(pre.url, req);
    json_t *bad = json_deep_copy(kt);
    json_t *r1 = json_array_get(json_object_get(bad, "pagekv_ranks"), 1);
    ck_assert_ptr_nonnull(r1);
    json_object_set_new(r1, "pagekv_token", json_string("00112233445566778899aabbccddeeff"));
    http_reply_t r = decode_leg(&dec, req, bad);
    error_code_is(&r, 400, "rejected");
    http_reply_free(&r);
    nothing_held(&dec, true);
    json_t *k = kv_stats(&dec);
    ck_assert_int_eq(cluster_json_int(k, "pulls.failed"), 1);
    ck_assert_int_eq(cluster_json_int(k, "pulls.ok"), 0);
    json_decref(k);
    /* A fresh prefill leg: the pull succeeds and the answer is the unified node's. */
    json_t *kt2 = prefill_leg(pre.url, req);
    r = decode_leg(&dec, req, kt2);
    ck_assert_msg(r.status == 200, "%ld %s", r.status, r.body ? r.body : "");
    cluster_answer_t a, u;
    ck_assert_int_eq(cluster_answer_parse(r.body, false, &a), 0);
    answer(uni.url, req, &u);
    ck_assert(cluster_answer_equal(&a, &u));
    cluster_answer_free(&a);
    cluster_answer_free(&u);
    http_reply_free(&r);
    json_decref(kt2);
    json_decref(bad);
    json_decref(kt);
    json_decref(req);
    stop(&dec);
    stop(&pre);
    stop(&uni);
}
END_TEST

/* Nodes of different models (another weight seed): refused at the handshake, before any
 * READ reaches the producer: 400 incompatible_layout, no serve started. */
START_TEST(incompatible_layout_refused_at_handshake)
{
    launch_proc_t pre, dec;
    const char *px[] = {"--seed", "2", NULL};
    serve(&pre, "prefill", "prefill", "llama-3.2-1b", 2, px, NULL);
    serve(&dec, "decode", "decode", "llama-3.2-1b", 2, NULL, NULL);
    json_t *req = chat("llama-3.2-1b", 301, 9, 4);
    json_t *kt = prefill_leg(pre.url, req);
    http_reply_t r = decode_leg(&dec, req, kt);
    error_code_is(&r, 400, "incompatible_layout");
    http_reply_free(&r);
    json_t *k = kv_stats(&pre);
    ck_assert_int_eq(cluster_json_int(k, "transfers.serves_started"), 0);
    json_decref(k);
    nothing_held(&dec, true);
    json_decref(kt);
    json_decref(req);
    stop(&dec);
    stop(&pre);
}
END_TEST

/* Bad --tp values exit 2 with a message naming the flag. */
START_TEST(bad_tp_exits_2)
{
    static const char *const bad[] = {"--tp 0",
                                      "--tp 3",
                                      "--tp 5",
                                      "--tp 12",
                                      "--tp 65",
                                      "--tp x",
                                      "--preset tiny --tp 3",
                                      "--tp 2 --kv-backend dense"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char cmd[256], out[8192];
        snprintf(cmd, sizeof(cmd), "serve --port 0 %s%s",
                 strstr(bad[i], "--preset") ? "" : "--preset llama-3.2-1b ", bad[i]);
        int rc = ts_pagekv_run(cmd, out, sizeof(out));
        ck_assert_msg(rc == 2 && strstr(out, "--tp"), "pagekv %s: exit %d\n%s", cmd, rc, out);
    }
}
END_TEST

static Suite *reshard_suite(void)
{
    Suite *s = suite_create("reshard");
    TCase *tc = tcase_create("pairs");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 240);
    tcase_add_loop_test(tc, pair_equals_unified, 0, (int)(sizeof(PAIRS) / sizeof(PAIRS[0])));
    tcase_add_loop_test(tc, scaled_pair_equals_unified, 0,
                        (int)(sizeof(SCALED_PAIRS) / sizeof(SCALED_PAIRS[0])));
    suite_add_tcase(s, tc);
    TCase *f = tcase_create("faults");
    tcase_add_checked_fixture(f, setup, teardown);
    tcase_set_timeout(f, 120);
    tcase_add_test(f, prefill_rank_dies_mid_pull);
    tcase_add_test(f, one_rank_rejected_fails_the_request);
    tcase_add_test(f, incompatible_layout_refused_at_handshake);
    tcase_add_test(f, bad_tp_exits_2);
    suite_add_tcase(s, f);
    return s;
}

PKV_TEST_MAIN(reshard_suite)
