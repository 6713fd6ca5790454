/*
 * server: a real HTTP client (libcurl) against servers the tests start on ephemeral
 * ports, in-process through include/pagekv/server.h, and as a child `pagekv serve`
 * process for the CLI and SIGTERM. Completions, chat, streaming (the same text streamed
 * and not at temperature 0, paged and dense alike), 8 concurrent requests, prefix hits
 * in cached_tokens, every rejection reason and the HTTP layer's refusals (and that
 * nothing changed; the request schema's every refusal: test_openai), queue full (429 with
 * Retry-After), a prompt that can never fit the KV budget, a client disconnecting
 * mid-stream, /metrics through a strict Prometheus parser, SIGTERM drain; plus the
 * output assembler (finish reasons, UTF-8).
 */
#include "tests/support/srvtest.h"
#include "tests/support/testutil.h"
#include "support/http.h"

#include "pagekv/server.h"
#include "pagekv/xfer.h"
#include "prim/prim.h"
#include "server/gen.h"
#include "openai/openai.h"

#include <curl/curl.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- HTTP ------------------------------------------------------------------------------- */

/* One more request header for every request (NULL: none). */
static const char *http_extra_header;

/* One request to this host's port through srvtest's client (body NULL: none), within
 * 60 s, with http_extra_header. Returns the curl code (the status is in r). */
static CURLcode http(uint16_t port, const char *method, const char *path, const char *body,
                     ts_resp_t *r)
{
    return ts_http("127.0.0.1", port, method, path, body, http_extra_header, 60, r);
}

static json_t *post_json(uint16_t port, const char *path, const char *body, long *status)
{
    ts_resp_t r;
    ck_assert_int_eq(http(port, "POST", path, body, &r), CURLE_OK);
    *status = r.status;
    json_error_t je;
    json_t *doc = json_loadb(r.body ? r.body : "", r.len, JSON_ALLOW_NUL, &je);
    ck_assert_msg(doc != NULL, "response is not JSON (%s): %.300s", je.text, r.body ? r.body : "");
    ts_resp_free(&r);
    return doc;
}

/* ---- servers ------------------------------------------------------------------------------ */

static pkv_server_config_t base_config(void)
{
    pkv_server_config_t c = {.threads = 1, .kv_dtype = PKV_DTYPE_F16};
    return c;
}

static pkv_server_t *start(pkv_server_config_t cfg)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
    pkv_server_t *s = NULL;
    ck_assert_int_eq(pkv_server_create(&cfg, &s), PKV_OK);
    ck_assert_uint_gt(pkv_server_port(s), 0);
    return s;
}

/* ---- SSE ---------------------------------------------------------------------------------- */

typedef struct {
    json_t *events[4096];
    int n;
    bool done;        /* data: [DONE] came last */
    char text[65536]; /* concatenated text / delta.content */
    size_t text_len;
    const char *finish;
    json_t *usage;
} sse_t;

static void sse_parse(const char *body, size_t len, bool chat, sse_t *out)
{
    memset(out, 0, sizeof(*out));
    size_t i = 0;
    while (i < len) {
        const char *end = strstr(body + i, "\n\n");
        ck_assert_msg(end != NULL, "unterminated SSE event at %zu", i);
        size_t elen = (size_t)(end - (body + i));
        ck_assert_msg(elen > 6 && !strncmp(body + i, "data: ", 6), "bad SSE line: %.60s", body + i);
        ck_assert_msg(!out->done, "event after [DONE]");
        if (elen == 12 && !strncmp(body + i + 6, "[DONE]", 6)) {
            out->done = true;
        } else {
            json_t *ev = json_loadb(body + i + 6, elen - 6, JSON_ALLOW_NUL, NULL);
            ck_assert_msg(ev != NULL, "event is not JSON: %.*s", (int)elen, body + i);
            ck_assert_int_lt(out->n, 4096);
            out->events[out->n++] = ev;
            ck_assert_msg(!json_object_get(ev, "error"), "error event: %.*s", (int)elen, body + i);
            json_t *ch = ts_jp(ev, "choices.0");
            if (ch) {
                json_t *t = chat ? ts_jp(ch, "delta.content") : json_object_get(ch, "text");
                if (json_is_string(t)) {
                    size_t tl = json_string_length(t);
                    ck_assert_uint_lt(out->text_len + tl, sizeof(out->text));
                    memcpy(out->text + out->text_len, json_string_value(t), tl);
                    out->text_len += tl;
                }
                json_t *f = json_object_get(ch, "finish_reason");
                if (json_is_string(f)) {
                    ck_assert_msg(!out->finish, "two finish reasons");
                    out->finish = json_string_value(f);
                }
            }
            if (json_object_get(ev, "usage")) out->usage = json_object_get(ev, "usage");
        }
        i += elen + 2;
    }
}

static void sse_free(sse_t *s)
{
    for (int i = 0; i < s->n; i++) json_decref(s->events[i]);
}

/* ---- checks shared by tests ----------------------------------------------------------------- */

static void check_usage(json_t *usage, long long completion)
{
    ck_assert_ptr_nonnull(usage);
    long long p = ts_ji(usage, "prompt_tokens"), c = ts_ji(usage, "completion_tokens");
    ck_assert_int_gt(p, 0);
    if (completion >= 0) ck_assert_int_eq(c, completion);
    ck_assert_int_eq(ts_ji(usage, "total_tokens"), p + c);
    ck_assert_int_ge(ts_ji(usage, "prompt_tokens_details.cached_tokens"), 0);
    ck_assert_int_le(ts_ji(usage, "prompt_tokens_details.cached_tokens"), p);
}

/* A completion's text (malloc'd) at temperature 0. */
static char *complete(uint16_t port, const char *prompt, int max_tokens, json_t **doc_out)
{
    char body[8192];
    json_t *req = json_pack("{s:s, s:s, s:i, s:i}", "model", "tiny", "prompt", prompt, "max_tokens",
                            max_tokens, "temperature", 0);
    char *b = json_dumps(req, 0);
    snprintf(body, sizeof(body), "%s", b);
    free(b);
    json_decref(req);
    long st;
    json_t *doc = post_json(port, "/v1/completions", body, &st);
    ck_assert_msg(st == 200, "status %ld", st);
    char *text = strdup(ts_js(doc, "choices.0.text"));
    if (doc_out)
        *doc_out = doc;
    else
        json_decref(doc);
    return text;
}

static void wait_quiet(uint16_t port);

/* ---- tests ----------------------------------------------------------------------------------- */

START_TEST(completions_and_chat)
{
    pkv_server_t *s = start(base_config());
    uint16_t port = pkv_server_port(s);
    long st;
    json_t *d =
        post_json(port, "/v1/completions",
                  "{\"model\":\"tiny\",\"prompt\":\"The quick brown fox\",\"max_tokens\":12,"
                  "\"temperature\":0,\"ignore_eos\":true}",
                  &st);
    ck_assert_int_eq(st, 200);
    ck_assert_str_eq(ts_js(d, "object"), "text_completion");
    ck_assert_str_eq(ts_js(d, "model"), "tiny");
    ck_assert(!strncmp(ts_js(d, "id"), "cmpl-", 5));
    ck_assert_str_eq(ts_js(d, "choices.0.finish_reason"), "length");
    ck_assert_int_eq(ts_ji(d, "choices.0.index"), 0);
    check_usage(ts_jp(d, "usage"), 12);
    char *first = strdup(ts_js(d, "choices.0.text"));
    ck_assert_uint_gt(strlen(first), 0);
    json_decref(d);
    /* Deterministic at temperature 0. */
    char *again = complete(port, "The quick brown fox", 12, NULL);
    ck_assert_str_eq(again, first);
    free(again);
    free(first);

    d = post_json(
        port, "/v1/chat/completions",
        "{\"model\":\"tiny\",\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
        "{\"role\":\"user\",\"content\":\"Hello there\"}],\"max_tokens\":9,\"temperature\":0}",
        &st);
    ck_assert_int_eq(st, 200);
    ck_assert_str_eq(ts_js(d, "object"), "chat.completion");
    ck_assert(!strncmp(ts_js(d, "id"), "chatcmpl-", 9));
    ck_assert_str_eq(ts_js(d, "choices.0.message.role"), "assistant");
    const char *fr = ts_js(d, "choices.0.finish_reason");
    ck_assert(!strcmp(fr, "length") || !strcmp(fr, "stop"));
    check_usage(ts_jp(d, "usage"), -1);
    ck_assert_int_le(ts_ji(d, "usage.completion_tokens"), 9);
    char *chat_text = strdup(ts_js(d, "choices.0.message.content"));
    long long chat_prompt = ts_ji(d, "usage.prompt_tokens");
    json_decref(d);
    /* Content as text parts renders the same prompt and text. */
    d = post_json(
        port, "/v1/chat/completions",
        "{\"model\":\"tiny\",\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hello \"},"
        "{\"type\":\"text\",\"text\":\"there\"}]}],\"max_tokens\":9,\"temperature\":0}",
        &st);
    ck_assert_int_eq(st, 200);
    ck_assert_int_eq(ts_ji(d, "usage.prompt_tokens"), chat_prompt);
    ck_assert_str_eq(ts_js(d, "choices.0.message.content"), chat_text);
    json_decref(d);
    free(chat_text);

    /* Token-id prompts: the ids of the text prompt give the same completion. */
    pkv_tok_t *tok;
    ck_assert_int_eq(pkv_tok_create_builtin(&tok), PKV_OK);
    int32_t *ids;
    size_t n;
    ck_assert_int_eq(pkv_tok_encode_alloc(tok, "The quick brown fox", 19, true, &ids, &n), PKV_OK);
    json_t *arr = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(arr, json_integer(ids[i]));
    json_t *req = json_pack("{s:s, s:o, s:i, s:i, s:b}", "model", "tiny", "prompt", arr,
                            "max_tokens", 12, "temperature", 0, "ignore_eos", 1);
    char *body = json_dumps(req, 0);
    d = post_json(port, "/v1/completions", body, &st);
    ck_assert_int_eq(st, 200);
    char *by_text = complete(port, "The quick brown fox", 12, NULL);
    ck_assert_str_eq(ts_js(d, "choices.0.text"), by_text);
    free(by_text);
    json_decref(d);
    free(body);
    json_decref(req);
    free(ids);
    pkv_tok_destroy(tok);

    /* models, health */
    d = ts_get_json("127.0.0.1", port, "/v1/models");
    ck_assert_str_eq(ts_js(d, "object"), "list");
    ck_assert_str_eq(ts_js(d, "data.0.id"), "tiny");
    ck_assert_int_eq(ts_ji(d, "data.0.max_model_len"), 4096);
    json_decref(d);
    d = ts_get_json("127.0.0.1", port, "/v1/models/tiny");
    ck_assert_str_eq(ts_js(d, "id"), "tiny");
    json_decref(d);
    d = ts_get_json("127.0.0.1", port, "/health");
    ck_assert_str_eq(ts_js(d, "status"), "ok");
    json_decref(d);
    ts_resp_t r;
    ck_assert_int_eq(http(port, "HEAD", "/health", NULL, &r), CURLE_OK);
    ck_assert_int_eq(r.status, 200);
    ts_resp_free(&r);
    pkv_server_destroy(s);
}
END_TEST

static void stream_vs_plain(pkv_server_t *s, bool chat, const char *what)
{
    uint16_t port = pkv_server_port(s);
    json_t *req = chat ? json_pack("{s:s, s:[{s:s, s:s}], s:i, s:i, s:b}", "model", "tiny",
                                   "messages", "role", "user", "content", what, "max_tokens", 40,
                                   "temperature", 0, "ignore_eos", 1)
                       : json_pack("{s:s, s:s, s:i, s:i, s:b}", "model", "tiny", "prompt", what,
                                   "max_tokens", 40, "temperature", 0, "ignore_eos", 1);
    const char *path = chat ? "/v1/chat/completions" : "/v1/completions";
    char *plain = json_dumps(req, 0);
    json_object_set_new(req, "stream", json_true());
    json_object_set_new(req, "stream_options", json_pack("{s:b}", "include_usage", 1));
    char *streamed = json_dumps(req, 0);
    json_decref(req);
    long st;
    json_t *d = post_json(port, path, plain, &st);
    ck_assert_int_eq(st, 200);
    const char *text = ts_js(d, chat ? "choices.0.message.content" : "choices.0.text");
    size_t text_len =
        json_string_length(ts_jp(d, chat ? "choices.0.message.content" : "choices.0.text"));

    ts_resp_t r;
    ck_assert_int_eq(http(port, "POST", path, streamed, &r), CURLE_OK);
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strcasestr(r.headers, "content-type: text/event-stream"));
    sse_t sse;
    sse_parse(r.body, r.len, chat, &sse);
    ck_assert(sse.done);
    ck_assert_int_ge(sse.n, 3);
    ck_assert_str_eq(sse.finish, "length");
    ck_assert_uint_eq(sse.text_len, text_len);
    ck_assert_msg(!memcmp(sse.text, text, sse.text_len), "streamed text differs:\n%s\n%.*s", text,
                  (int)sse.text_len, sse.text);
    check_usage(sse.usage, 40);
    ck_assert_int_eq(ts_ji(sse.usage, "prompt_tokens"), ts_ji(d, "usage.prompt_tokens"));
    for (int i = 0; i < sse.n; i++) {
        ck_assert_str_eq(ts_js(sse.events[i], "object"),
                         chat ? "chat.completion.chunk" : "text_completion");
        ck_assert_str_eq(ts_js(sse.events[i], "id"), ts_js(sse.events[0], "id"));
    }
    if (chat) ck_assert_str_eq(ts_js(sse.events[0], "choices.0.delta.role"), "assistant");
    sse_free(&sse);
    ts_resp_free(&r);
    json_decref(d);
    free(plain);
    free(streamed);
}

START_TEST(streaming_matches_non_streaming)
{
    pkv_server_t *s = start(base_config());
    stream_vs_plain(s, false, "Streaming and plain responses carry the same text");
    stream_vs_plain(s, true, "Tell me about KV caches");
    pkv_server_destroy(s);
}
END_TEST

/* POST /v1/cache/digest: a bad body is 400 (as the lookup's); on a paged node, one
 * digest per KV head of the rank, over the prompt's cached whole blocks, stable across
 * calls; on a dense node 400 unsupported. */
static void digest_checks(uint16_t port, bool paged)
{
    const char *prompt =
        "A digest names the bytes of every KV head over the blocks of a prompt that "
        "the prefix cache holds, so that two nodes can be compared exactly.";
    free(complete(port, prompt, 2, NULL));
    ts_resp_t r;
    const char *bad = "{\"model\": \"tiny\"}";
    ck_assert_int_eq(http(port, "POST", "/v1/cache/digest", bad, &r), CURLE_OK);
    ck_assert_int_eq(r.status, 400);
    ts_resp_free(&r);
    char body[512];
    snprintf(body, sizeof(body), "{\"model\": \"tiny\", \"prompt\": \"%s\"}", prompt);
    char *first = NULL;
    for (int k = 0; k < 2; k++) {
        ck_assert_int_eq(http(port, "POST", "/v1/cache/digest", body, &r), CURLE_OK);
        if (!paged) {
            ck_assert_int_eq(r.status, 400);
            ck_assert_ptr_nonnull(strstr(r.body, "\"unsupported\""));
            ts_resp_free(&r);
            return;
        }
        ck_assert_int_eq(r.status, 200);
        json_t *d = json_loads(r.body, 0, NULL);
        ck_assert_int_eq(ts_ji(d, "tp"), 1);
        ck_assert_int_gt(ts_ji(d, "blocks"), 0);
        ck_assert_int_eq(json_array_size(ts_jp(d, "ranks.0.heads")), 2); /* tiny: 2 KV heads */
        ck_assert_uint_eq(strlen(ts_js(d, "ranks.0.heads.0")), 64);
        if (!first)
            first = strdup(ts_js(d, "ranks.0.heads.1"));
        else
            ck_assert_str_eq(first, ts_js(d, "ranks.0.heads.1"));
        json_decref(d);
        ts_resp_free(&r);
    }
    free(first);
}

START_TEST(dense_backend_same_text)
{
    pkv_server_config_t cfg = base_config();
    pkv_server_t *paged = start(cfg);
    char *a = complete(pkv_server_port(paged), "Paged and dense give the same tokens", 30, NULL);
    digest_checks(pkv_server_port(paged), true);
    pkv_server_destroy(paged);
    cfg.backend = PKV_BACKEND_DENSE;
    pkv_server_t *dense = start(cfg);
    char *b = complete(pkv_server_port(dense), "Paged and dense give the same tokens", 30, NULL);
    ck_assert_str_eq(a, b);
    stream_vs_plain(dense, false, "Dense streaming");
    digest_checks(pkv_server_port(dense), false);
    json_t *st = ts_get_json("127.0.0.1", pkv_server_port(dense), "/v1/cache/stats");
    ck_assert_str_eq(ts_js(st, "backend"), "dense");
    json_decref(st);
    pkv_server_destroy(dense);
    free(a);
    free(b);
}
END_TEST

/* The paged pool asks for huge pages where the kernel's mode allows and reports what it got:
 * the startup probe, whether its granules are whole 2 MiB pages (none where not), and the
 * pool's range in smaps (AnonHugePages within its Rss, whole 2 MiB pages); --no-hugepages
 * asks for none; dense has no pool range. */
static void check_hugepages(pkv_server_config_t cfg, pkv_prim_thp_mode_t mode)
{
    pkv_server_t *s = start(cfg);
    uint16_t port = pkv_server_port(s);
    bool paged = cfg.backend == PKV_BACKEND_PAGED;
    bool want =
        paged && !cfg.no_hugepages && (mode == PKV_PRIM_THP_ALWAYS || mode == PKV_PRIM_THP_MADVISE);
    pkv_server_info_t info;
    pkv_server_info(s, &info);
    ck_assert_int_eq(info.hugepages, want);
    ck_assert_str_eq(info.thp_mode, pkv_prim_thp_mode_name(mode));
    if (!want) ck_assert(!info.huge_probe);
    free(complete(port, "Huge pages are asked for, and then measured.", 4, NULL));
    json_t *st = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
    ck_assert_int_eq(json_is_true(ts_jp(st, "hugepages.requested")), want);
    ck_assert_int_eq(json_is_true(ts_jp(st, "hugepages.probe_huge")), info.huge_probe);
    ck_assert_int_eq(json_is_true(ts_jp(st, "hugepages.granules_fit")), info.huge_granules);
    ck_assert_str_eq(ts_js(st, "hugepages.thp_mode"), info.thp_mode);
    ts_resp_t r;
    ck_assert_int_eq(http(port, "GET", "/metrics", NULL, &r), CURLE_OK);
    char line[96];
    snprintf(line, sizeof(line), "\npagekv_kv_hugepages_requested %d\n", want);
    ck_assert_ptr_nonnull(strstr(r.body, line));
    if (paged) {
        long long res = ts_ji(st, "hugepages.pool_resident_bytes");
        long long hp = ts_ji(st, "hugepages.pool_huge_bytes");
        ck_assert_int_eq(res, ts_ji(st, "committed_bytes"));
        ck_assert_int_gt(res, 0);
        long long age = ts_ji(st, "hugepages.pool_read_age_ms");
        ck_assert(age >= 0 && age <= 5000); /* read at most SRV_PAGES_MAX_AGE_NS ago */
        ck_assert(hp >= 0 && hp <= res && hp % PKV_PRIM_HUGE == 0);
        if ((!want && mode != PKV_PRIM_THP_ALWAYS) || !info.huge_granules) ck_assert_int_eq(hp, 0);
        snprintf(line, sizeof(line), "\npagekv_kv_pool_hugepage_bytes %lld\n", hp);
        ck_assert_ptr_nonnull(strstr(r.body, line));
    } else {
        ck_assert(json_is_null(ts_jp(st, "hugepages.pool_huge_bytes")));
        ck_assert_ptr_null(strstr(r.body, "pagekv_kv_pool_hugepage_bytes"));
    }
    ts_resp_free(&r);
    json_decref(st);
    pkv_server_destroy(s);
}

START_TEST(hugepages_asked_and_measured)
{
    pkv_prim_thp_mode_t mode = PKV_PRIM_THP_UNKNOWN;
    (void)pkv_prim_thp_mode(NULL, &mode);
    pkv_server_config_t cfg = base_config();
    check_hugepages(cfg, mode);
    cfg.no_hugepages = true;
    check_hugepages(cfg, mode);
    cfg = base_config();
    cfg.backend = PKV_BACKEND_DENSE;
    check_hugepages(cfg, mode);
}
END_TEST

typedef struct {
    uint16_t port;
    int i;
    char *text;
    long status;
} conc_t;

static void *conc_main(void *arg)
{
    conc_t *c = arg;
    char body[512];
    snprintf(body, sizeof(body),
             "{\"model\":\"tiny\",\"prompt\":\"Concurrent request number %d asks for text\","
             "\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true}",
             c->i, 20 + c->i);
    ts_resp_t r;
    if (http(c->port, "POST", "/v1/completions", body, &r) == CURLE_OK) {
        c->status = r.status;
        json_t *d = json_loadb(r.body, r.len, JSON_ALLOW_NUL, NULL);
        json_t *t = ts_jp(d, "choices.0.text");
        long long ct = json_integer_value(ts_jp(d, "usage.completion_tokens"));
        if (json_is_string(t) && ct == 20 + c->i) c->text = strdup(json_string_value(t));
        json_decref(d);
    }
    ts_resp_free(&r);
    return NULL;
}

START_TEST(eight_concurrent_requests)
{
    pkv_server_t *s = start(base_config());
    uint16_t port = pkv_server_port(s);
    conc_t c[8];
    pthread_t th[8];
    for (int i = 0; i < 8; i++) {
        c[i] = (conc_t){.port = port, .i = i};
        ck_assert_int_eq(pthread_create(&th[i], NULL, conc_main, &c[i]), 0);
    }
    for (int i = 0; i < 8; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 8; i++) {
        ck_assert_int_eq(c[i].status, 200);
        ck_assert_ptr_nonnull(c[i].text);
    }
    /* Batching does not change results: each prompt alone gives the same text. */
    for (int i = 0; i < 8; i += 3) {
        conc_t one = {.port = port, .i = i};
        conc_main(&one);
        ck_assert_str_eq(one.text, c[i].text);
        free(one.text);
    }
    wait_quiet(port);
    json_t *st = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
    ck_assert_int_eq(ts_ji(st, "requests.submitted"), 11);
    ck_assert_int_eq(ts_ji(st, "sequences"), 0);
    ck_assert_int_eq(ts_ji(st, "requests.in_flight"), 0);
    json_decref(st);
    for (int i = 0; i < 8; i++) free(c[i].text);
    pkv_server_destroy(s);
}
END_TEST

START_TEST(prefix_hit_reported)
{
    pkv_server_t *s = start(base_config());
    uint16_t port = pkv_server_port(s);
    char prompt[4096] = "";
    for (int i = 0; i < 40; i++)
        strcat(prompt, "The shared system prompt repeats itself for a while. ");
    json_t *d1, *d2, *d3;
    char *t1 = complete(port, prompt, 8, &d1);
    char *t2 = complete(port, prompt, 8, &d2);
    long long n = ts_ji(d1, "usage.prompt_tokens");
    ck_assert_int_gt(n, 200);
    ck_assert_int_eq(ts_ji(d1, "usage.prompt_tokens_details.cached_tokens"), 0);
    /* Every whole block but the one holding the last prompt token is adopted. */
    ck_assert_int_eq(ts_ji(d2, "usage.prompt_tokens_details.cached_tokens"), (n - 1) / 16 * 16);
    ck_assert_str_eq(t1, t2); /* same tokens with or without the cache */
    json_t *st = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
    ck_assert_int_eq(ts_ji(st, "prefix_cache.hit_tokens"), (n - 1) / 16 * 16);
    ck_assert_int_gt(ts_ji(st, "blocks.cached"), 0);
    json_decref(st);
    /* After a reset the prefix is gone. */
    long code;
    json_t *rd = post_json(port, "/v1/cache/reset", "", &code);
    ck_assert_int_eq(code, 200);
    ck_assert_int_gt(ts_ji(rd, "dropped_blocks"), 0);
    json_decref(rd);
    st = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
    ck_assert_int_eq(ts_ji(st, "blocks.cached"), 0);
    ck_assert_int_eq(ts_ji(st, "cache_resets"), 1);
    json_decref(st);
    char *t3 = complete(port, prompt, 8, &d3);
    ck_assert_int_eq(ts_ji(d3, "usage.prompt_tokens_details.cached_tokens"), 0);
    ck_assert_str_eq(t3, t1);
    /* A different cache_salt does not share the prefix. */
    json_t *req = json_pack("{s:s, s:s, s:i, s:i, s:s}", "model", "tiny", "prompt", prompt,
                            "max_tokens", 4, "temperature", 0, "cache_salt", "tenant-b");
    char *body = json_dumps(req, 0);
    json_t *d4 = post_json(port, "/v1/completions", body, &code);
    ck_assert_int_eq(code, 200);
    ck_assert_int_eq(ts_ji(d4, "usage.prompt_tokens_details.cached_tokens"), 0);
    json_decref(d4);
    free(body);
    json_decref(req);
    free(t1);
    free(t2);
    free(t3);
    json_decref(d1);
    json_decref(d2);
    json_decref(d3);
    pkv_server_destroy(s);
}
END_TEST

/* Wait until the HTTP layer has finished with every request: the completion of a
 * response is reported to the server after its last byte went out, so a client can
 * see the response a moment before in_flight drops. */
static void wait_quiet(uint16_t port)
{
    uint64_t deadline = pkv_deadline_after_ns(10ull * 1000000000);
    for (;;) {
        json_t *st = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
        bool quiet = ts_ji(st, "requests.in_flight") == 0 && ts_ji(st, "requests.running") == 0 &&
                     ts_ji(st, "sequences") == 0;
        json_decref(st);
        if (quiet) return;
        ck_assert_msg(pkv_now_ns() < deadline, "requests still in flight after 10 s");
        usleep(2000);
    }
}

/* The parts of /v1/cache/stats a refused request must not change. */
static void state_of(uint16_t port, long long out[12])
{
    wait_quiet(port);
    json_t *st = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
    static const char *keys[] = {"committed_bytes",
                                 "blocks.live",
                                 "blocks.cached",
                                 "blocks.free",
                                 "sequences",
                                 "live_tokens",
                                 "prefix_cache.queries",
                                 "prefix_cache.query_tokens",
                                 "evictions",
                                 "requests.submitted",
                                 "requests.running",
                                 "requests.in_flight"};
    for (int i = 0; i < 12; i++) out[i] = ts_ji(st, keys[i]);
    json_decref(st);
}

typedef struct {
    const char *method, *path, *body;
    long status;
    const char *code; /* error.code, or NULL for a non-JSON check */
    const char *rejection;
} bad_case_t;

START_TEST(errors_change_nothing)
{
    pkv_server_config_t cfg = base_config();
    cfg.max_context = 256;
    cfg.max_body_bytes = 64 * 1024;
    pkv_server_t *s = start(cfg);
    uint16_t port = pkv_server_port(s);
    /* Some state first, so that "unchanged" means something. */
    free(complete(port, "Warm up the cache with a prompt that fills a block or two of KV.", 4,
                  NULL));

    static char long_prompt[2048], huge[100 * 1024];
    char *lp = long_prompt;
    lp += sprintf(lp, "{\"model\":\"tiny\",\"prompt\":\"");
    for (int i = 0; i < 200; i++) lp += sprintf(lp, "word%d ", i);
    sprintf(lp, "\",\"max_tokens\":4}");
    memset(huge, 'a', sizeof(huge) - 1);
    memcpy(huge, "{\"model\":\"tiny\",\"prompt\":\"", 26);
    memcpy(huge + sizeof(huge) - 3, "\"}", 3);

    /* One request body per rejection reason the server counts (the schema's every
     * refusal, with its error document: test_openai), and the HTTP layer's own refusals. */
    const bad_case_t cases[] = {
        {"POST", "/v1/completions", "{", 400, "invalid_json", "invalid_request"},
        {"POST", "/v1/chat/completions", "{\"model\":\"tiny\",\"messages\":\"hi\"}", 400,
         "invalid_type", "invalid_request"},
        {"POST", "/v1/completions", "{\"model\":\"gpt-4o\",\"prompt\":\"x\"}", 404,
         "model_not_found", "model_not_found"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":255}", 400,
         "context_length_exceeded", "context_length"},
        {"POST", "/v1/completions", long_prompt, 400, "context_length_exceeded", "context_length"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\",\"prompt\":[5,99999]}", 400,
         "invalid_value", "invalid_request"},
        {"POST", "/v1/completions", huge, 413, "body_too_large", "body_too_large"},
        {"GET", "/v1/completions", NULL, 405, "method_not_allowed", NULL},
        {"PUT", "/v1/chat/completions", "{}", 405, "method_not_allowed", NULL},
        {"DELETE", "/v1/models", NULL, 405, "method_not_allowed", NULL},
        {"GET", "/v1/cache/reset", NULL, 405, "method_not_allowed", NULL},
        {"POST", "/v1/cache/reset", "{\"all\":true}", 400, "invalid_json", "invalid_request"},
        {"GET", "/v1/kv_transfer/peaks/reset", NULL, 405, "method_not_allowed", NULL},
        {"POST", "/v1/kv_transfer/peaks/reset", "[1]", 400, "invalid_json", "invalid_request"},
        {"POST", "/v1/kv_transfer/peaks/reset", "{}", 404, "not_a_kv_node", NULL},
        {"GET", "/v2/completions", NULL, 404, "not_found", NULL},
        {"POST", "/", "{}", 404, "not_found", NULL},
        {"GET", "/v1/models/gpt-4o", NULL, 404, "model_not_found", NULL},
    };
    long long before[12], after[12];
    state_of(port, before);
    json_t *st0 = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
    long long rej_expect[8] = {0};
    static const char *rej_names[] = {"invalid_request", "model_not_found", "context_length",
                                      "kv_budget",       "queue_full",      "body_too_large",
                                      "shutting_down"};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const bad_case_t *c = &cases[i];
        ts_resp_t r;
        ck_assert_int_eq(http(port, c->method, c->path, c->body, &r), CURLE_OK);
        ck_assert_msg(r.status == c->status, "case %zu (%s %s): status %ld, want %ld: %s", i,
                      c->method, c->path, r.status, c->status, r.body ? r.body : "");
        json_t *d = json_loadb(r.body ? r.body : "", r.len, JSON_ALLOW_NUL, NULL);
        ck_assert_msg(d != NULL, "case %zu: error body is not JSON", i);
        ck_assert_str_eq(ts_js(d, "error.code"), c->code);
        ck_assert_uint_gt(strlen(ts_js(d, "error.message")), 0);
        ck_assert_uint_gt(strlen(ts_js(d, "error.type")), 0);
        if (c->status == 405) ck_assert_ptr_nonnull(strcasestr(r.headers, "\nAllow: "));
        if (!strcmp(c->code, "context_length_exceeded"))
            ck_assert_ptr_nonnull(strstr(ts_js(d, "error.message"), "256"));
        json_decref(d);
        ts_resp_free(&r);
        for (int k = 0; c->rejection && k < 7; k++)
            if (!strcmp(rej_names[k], c->rejection)) rej_expect[k]++;
    }
    state_of(port, after);
    for (int i = 0; i < 12; i++) ck_assert_int_eq(after[i], before[i]);
    json_t *st1 = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
    for (int k = 0; k < 7; k++) {
        char key[64];
        snprintf(key, sizeof(key), "rejections.%s", rej_names[k]);
        ck_assert_msg(ts_ji(st1, key) - ts_ji(st0, key) == rej_expect[k], "%s: %lld, want %lld",
                      key, ts_ji(st1, key) - ts_ji(st0, key), rej_expect[k]);
    }
    json_decref(st0);
    json_decref(st1);
    /* Still serving. */
    free(complete(port, "Still fine after all that", 4, NULL));
    pkv_server_destroy(s);
}
END_TEST

START_TEST(prompt_never_fits_budget)
{
    pkv_server_config_t cfg = base_config();
    cfg.backend = PKV_BACKEND_DENSE;
    cfg.budget_mode = PKV_SERVER_BUDGET_BYTES;
    cfg.budget_bytes = 64 * 1024; /* 256 tokens of tiny f16 KV */
    pkv_server_t *s = start(cfg);
    uint16_t port = pkv_server_port(s);
    char body[8192], *p = body;
    p += sprintf(p, "{\"model\":\"tiny\",\"prompt\":\"");
    for (int i = 0; i < 200; i++) p += sprintf(p, "budget%d ", i);
    sprintf(p, "\",\"max_tokens\":8}");
    long long before[12], after[12];
    state_of(port, before);
    long st;
    json_t *d = post_json(port, "/v1/completions", body, &st);
    ck_assert_int_eq(st, 400);
    ck_assert_str_eq(ts_js(d, "error.code"), "kv_budget_exceeded");
    const char *msg = ts_js(d, "error.message");
    ck_assert_ptr_nonnull(strstr(msg, "65536"));     /* the budget */
    ck_assert_ptr_nonnull(strstr(msg, "positions")); /* what the request needs */
    json_decref(d);
    state_of(port, after);
    for (int i = 0; i < 12; i++) ck_assert_int_eq(after[i], before[i]);
    json_t *sd = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
    ck_assert_int_eq(ts_ji(sd, "rejections.kv_budget"), 1);
    ck_assert_int_eq(ts_ji(sd, "budget_bytes"), 65536);
    json_decref(sd);
    free(complete(port, "A short prompt fits", 8, NULL));
    pkv_server_destroy(s);
}
END_TEST

/* A streaming client that stops reading (and closes) after `stop_after` events, or
 * reads to the end when 0. */
typedef struct {
    uint16_t port;
    const char *body;
    atomic_int stop_after;
    atomic_int events;
    long status;
    CURLcode cc;
    char *all;
    size_t len;
} streamer_t;

/* Counts event ends in the new bytes only (one may straddle the previous piece). */
static bool streamer_body(void *arg, const char *all, size_t len, size_t added)
{
    streamer_t *st = arg;
    size_t from = len - added > 0 ? len - added - 1 : 0;
    int ev = atomic_load(&st->events);
    for (size_t i = from; i + 1 < len; i++)
        if (all[i] == '\n' && all[i + 1] == '\n') ev++;
    atomic_store(&st->events, ev);
    int stop = atomic_load(&st->stop_after);
    return !(stop && ev >= stop); /* false: hang up (the client closes the socket) */
}

static void *streamer_main(void *arg)
{
    streamer_t *st = arg;
    ts_resp_t r;
    st->cc = ts_http_watch("127.0.0.1", st->port, "/v1/completions", st->body, 120, streamer_body,
                           st, &r);
    st->status = r.status;
    st->all = r.body; /* kept: the caller frees it */
    st->len = r.len;
    r.body = NULL;
    ts_resp_free(&r);
    return NULL;
}

static long long metric(uint16_t port, const char *sample)
{
    ts_resp_t r;
    ck_assert_int_eq(http(port, "GET", "/metrics", NULL, &r), CURLE_OK);
    ck_assert_int_eq(r.status, 200);
    long long v = -1;
    size_t sl = strlen(sample);
    for (char *line = r.body; line && *line;) {
        char *nl = strchr(line, '\n');
        if (!strncmp(line, sample, sl) && line[sl] == ' ') v = atoll(line + sl + 1);
        line = nl ? nl + 1 : NULL;
    }
    ts_resp_free(&r);
    ck_assert_msg(v >= 0, "metric %s missing", sample);
    return v;
}

START_TEST(disconnect_mid_stream_frees_sequence)
{
    pkv_server_t *s = start(base_config());
    uint16_t port = pkv_server_port(s);
    streamer_t st = {.port = port,
                     .body = "{\"model\":\"tiny\",\"prompt\":\"Go on and on\",\"max_tokens\":4000,"
                             "\"ignore_eos\":true,\"stream\":true}",
                     .stop_after = 3};
    streamer_main(&st);
    ck_assert_int_eq(st.cc, CURLE_WRITE_ERROR); /* we hung up */
    ck_assert_int_eq(st.status, 200);
    /* The sequence is freed at once: no live sequence, nothing running, within a bound
     * that is generous for a loaded machine yet far below generating 4000 tokens. */
    uint64_t deadline = pkv_deadline_after_ns(5ull * 1000000000);
    for (;;) {
        json_t *cs = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
        bool freed = ts_ji(cs, "sequences") == 0 && ts_ji(cs, "requests.running") == 0 &&
                     ts_ji(cs, "requests.in_flight") == 0;
        json_decref(cs);
        if (freed) break;
        ck_assert_msg(pkv_now_ns() < deadline, "the sequence was not freed within 5 s");
        usleep(10 * 1000);
    }
    ck_assert_int_eq(metric(port, "pagekv_requests_finished_total{reason=\"cancelled\"}"), 1);
    ck_assert_int_eq(metric(port, "pagekv_requests_finished_total{reason=\"length\"}"), 0);
    ck_assert_int_eq(metric(port, "pagekv_client_disconnects_total"), 1);
    ck_assert_int_lt(metric(port, "pagekv_generation_tokens_total"), 4000);
    free(st.all);
    /* The same for a non-streaming request whose client gives up. */
    char base[64];
    snprintf(base, sizeof(base), "http://127.0.0.1:%u", port);
    http_request_t rq = {.base_url = base,
                         .path = "/v1/completions",
                         .body = "{\"model\":\"tiny\",\"prompt\":\"Wait for "
                                 "it\",\"max_tokens\":4000,\"ignore_eos\":true}",
                         .timeout_ms = 300};
    http_reply_t rep;
    http_send(&rq, &rep);
    CURLcode cc = (CURLcode)rep.curl_code;
    http_reply_free(&rep);
    if (cc == CURLE_OPERATION_TIMEDOUT) {
        deadline = pkv_deadline_after_ns(5ull * 1000000000);
        while (metric(port, "pagekv_requests_finished_total{reason=\"cancelled\"}") < 2) {
            ck_assert_msg(pkv_now_ns() < deadline, "the abandoned request was not cancelled");
            usleep(10 * 1000);
        }
        ck_assert_int_eq(metric(port, "pagekv_client_disconnects_total"), 2);
    } /* else: 4000 tokens came back within 300 ms; nothing to observe */
    pkv_server_destroy(s);
}
END_TEST

START_TEST(queue_full_gets_429)
{
    pkv_server_config_t cfg = base_config();
    cfg.max_batch_size = 1;
    cfg.max_queue = 1;
    cfg.retry_after_s = 3;
    pkv_server_t *s = start(cfg);
    uint16_t port = pkv_server_port(s);
    /* A: running (the only batch slot); B: queued (the only queue slot); C: refused. */
    streamer_t a = {.port = port,
                    .body = "{\"model\":\"tiny\",\"prompt\":\"Hold the slot\",\"max_tokens\":4000,"
                            "\"ignore_eos\":true,\"stream\":true}",
                    .stop_after = 0};
    pthread_t ta, tb;
    ck_assert_int_eq(pthread_create(&ta, NULL, streamer_main, &a), 0);
    while (atomic_load(&a.events) < 1) usleep(1000);
    streamer_t b = {
        .port = port,
        .body = "{\"model\":\"tiny\",\"prompt\":\"Wait in line\",\"max_tokens\":2,\"stream\":true}",
        .stop_after = 0};
    ck_assert_int_eq(pthread_create(&tb, NULL, streamer_main, &b), 0);
    for (;;) {
        json_t *cs = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
        long long q = ts_ji(cs, "requests.queued");
        json_decref(cs);
        if (q == 1) break;
        usleep(1000);
    }
    ts_resp_t r;
    const char *body = "{\"model\":\"tiny\",\"prompt\":\"No room\",\"max_tokens\":2}";
    ck_assert_int_eq(http(port, "POST", "/v1/completions", body, &r), CURLE_OK);
    ck_assert_int_eq(r.status, 429);
    ck_assert_ptr_nonnull(strcasestr(r.headers, "\nRetry-After: 3"));
    json_t *d = json_loadb(r.body, r.len, JSON_ALLOW_NUL, NULL);
    ck_assert_str_eq(ts_js(d, "error.code"), "queue_full");
    json_decref(d);
    ts_resp_free(&r);
    /* Free the slot by hanging up A: B then runs to completion. */
    atomic_store(&a.stop_after, atomic_load(&a.events) + 1);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    ck_assert_int_eq(b.status, 200);
    sse_t sse;
    sse_parse(b.all, b.len, false, &sse);
    ck_assert(sse.done);
    sse_free(&sse);
    json_t *cs = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
    ck_assert_int_eq(ts_ji(cs, "rejections.queue_full"), 1);
    ck_assert_int_eq(ts_ji(cs, "requests.submitted"), 2);
    json_decref(cs);
    free(a.all);
    free(b.all);
    pkv_server_destroy(s);
}
END_TEST

/* A small llama2.c checkpoint and tokenizer.bin written here: the server runs real
 * checkpoint files through --model / --tokenizer. */
static void write_llama2c(const char *model_path, const char *tok_path)
{
    enum { D = 32, H = 64, L = 2, HEADS = 4, KVH = 2, V = 300, SEQ = 128 };
    size_t hs = D / HEADS, kvd = KVH * hs;
    size_t n = (size_t)V * D + (size_t)L * (D + D * D + 2 * kvd * D + D * D + D + 3 * D * H) + D +
               (size_t)SEQ * hs;
    float *w = malloc(n * sizeof(float));
    ck_assert_ptr_nonnull(w);
    uint64_t rng = 77;
    for (size_t i = 0; i < n; i++) w[i] = (float)((int)(pkv_test_rand(&rng) % 2001) - 1000) * 3e-4f;
    FILE *f = fopen(model_path, "wb");
    ck_assert_ptr_nonnull(f);
    int32_t h[7] = {D, H, L, HEADS, KVH, V, SEQ}; /* positive vocab: shared classifier */
    ck_assert_uint_eq(fwrite(h, sizeof(h), 1, f), 1);
    ck_assert_uint_eq(fwrite(w, sizeof(float), n, f), n);
    fclose(f);
    free(w);
    /* <unk> <s> </s>, 256 byte pieces, then text pieces */
    f = fopen(tok_path, "wb");
    ck_assert_ptr_nonnull(f);
    int32_t maxlen = 16;
    fwrite(&maxlen, sizeof(maxlen), 1, f);
    for (int id = 0; id < V; id++) {
        char piece[16];
        static const char *words[] = {" the", " a", "he", "llo",  " hello",
                                      "in",   "st", " [", "INST", "]"};
        if (id == 0)
            snprintf(piece, sizeof(piece), "<unk>");
        else if (id == 1)
            snprintf(piece, sizeof(piece), "<s>");
        else if (id == 2)
            snprintf(piece, sizeof(piece), "</s>");
        else if (id < 259)
            snprintf(piece, sizeof(piece), "<0x%02X>", id - 3);
        else if (id < 269)
            snprintf(piece, sizeof(piece), "%s", words[id - 259]);
        else
            snprintf(piece, sizeof(piece), "w%d", id);
        float score = id < 259 ? 0.0f : -(float)id;
        int32_t len = (int32_t)strlen(piece);
        fwrite(&score, sizeof(score), 1, f);
        fwrite(&len, sizeof(len), 1, f);
        fwrite(piece, 1, (size_t)len, f);
    }
    fclose(f);
}

START_TEST(llama2c_checkpoint_serves)
{
    char model[128], tok[128];
    snprintf(model, sizeof(model), "/tmp/pkv_test_server_%d_model.bin", (int)getpid());
    snprintf(tok, sizeof(tok), "/tmp/pkv_test_server_%d_tok.bin", (int)getpid());
    write_llama2c(model, tok);
    pkv_server_config_t cfg = base_config();
    cfg.model_path = model;
    cfg.tokenizer_path = tok;
    cfg.served_name = "story";
    pkv_server_t *s = start(cfg);
    unlink(model);
    unlink(tok);
    uint16_t port = pkv_server_port(s);
    json_t *m = ts_get_json("127.0.0.1", port, "/v1/models");
    ck_assert_str_eq(ts_js(m, "data.0.id"), "story");
    ck_assert_int_eq(ts_ji(m, "data.0.max_model_len"), 128);
    json_decref(m);
    long st;
    json_t *d = post_json(
        port, "/v1/completions",
        "{\"model\":\"story\",\"prompt\":\"hello the\",\"max_tokens\":10,\"temperature\":0}", &st);
    ck_assert_int_eq(st, 200);
    check_usage(ts_jp(d, "usage"), -1);
    json_decref(d);
    d = post_json(port, "/v1/chat/completions",
                  "{\"model\":\"story\",\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}],"
                  "\"max_tokens\":5,\"temperature\":0}",
                  &st);
    ck_assert_int_eq(st, 200);
    ck_assert_ptr_nonnull(ts_jp(d, "choices.0.message.content"));
    json_decref(d);
    d = post_json(port, "/v1/completions",
                  "{\"model\":\"story\",\"prompt\":\"hello\",\"max_tokens\":127}", &st);
    ck_assert_int_eq(st, 400);
    ck_assert_str_eq(ts_js(d, "error.code"), "context_length_exceeded");
    json_decref(d);
    pkv_server_destroy(s);
    /* Bad combinations are refused at creation. */
    pkv_server_config_t bad = base_config();
    bad.model_path = "/nonexistent/model.bin";
    pkv_server_t *none = NULL;
    ck_assert_int_eq(pkv_server_create(&bad, &none), PKV_ERR_INVALID); /* no tokenizer */
    bad.tokenizer_path = "/nonexistent/tok.bin";
    ck_assert_int_eq(pkv_server_create(&bad, &none), PKV_ERR_IO);
    bad = base_config();
    bad.preset = "gpt-5";
    ck_assert_int_eq(pkv_server_create(&bad, &none), PKV_ERR_INVALID);
    bad = base_config();
    bad.max_context = 5000; /* above tiny's 4096 */
    ck_assert_int_eq(pkv_server_create(&bad, &none), PKV_ERR_INVALID);
    ck_assert_ptr_null(none);
}
END_TEST

/* ---- a strict Prometheus text-format parser ----------------------------------------------- */

typedef struct {
    char name[128];
    char type[16];
    bool help;
    bool closed;
} prom_family_t;

static bool prom_name_ok(const char *s, size_t n)
{
    if (!n) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
        if (!alpha && !(i && c >= '0' && c <= '9')) return false;
    }
    return true;
}

static bool ends_with(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

/* Parses the exposition; fails the test on any violation. Returns the sample count. */
static int prom_check(const char *text)
{
    prom_family_t fam[128];
    int nf = 0, cur = -1, samples = 0;
    char seen[512][192];
    int nseen = 0;
    double last_bucket = -1, bucket_le = -INFINITY;
    const char *p = text;
    ck_assert_msg(*p, "empty exposition");
    while (*p) {
        const char *nl = strchr(p, '\n');
        ck_assert_msg(nl != NULL, "last line lacks a newline");
        size_t len = (size_t)(nl - p);
        char line[512];
        ck_assert_uint_lt(len, sizeof(line));
        memcpy(line, p, len);
        line[len] = 0;
        p = nl + 1;
        ck_assert_msg(len > 0 && line[len - 1] != ' ', "empty line or trailing space: '%s'", line);
        if (line[0] == '#') {
            char kw[8], name[160];
            int off = 0;
            ck_assert_msg(sscanf(line, "# %7s %159s %n", kw, name, &off) == 2 && off > 0,
                          "bad comment line: %s", line);
            ck_assert_msg(prom_name_ok(name, strlen(name)), "bad name in: %s", line);
            int f = -1;
            for (int i = 0; i < nf; i++)
                if (!strcmp(fam[i].name, name)) f = i;
            if (f < 0) {
                ck_assert_int_lt(nf, 128);
                f = nf++;
                memset(&fam[f], 0, sizeof(fam[f]));
                snprintf(fam[f].name, sizeof(fam[f].name), "%s", name);
                if (cur >= 0) fam[cur].closed = true;
                cur = f;
            }
            ck_assert_msg(f == cur && !fam[f].closed, "family %s resumes after another", name);
            if (!strcmp(kw, "HELP")) {
                ck_assert_msg(!fam[f].help, "second HELP for %s", name);
                ck_assert_msg(line[off] != 0, "empty HELP for %s", name);
                fam[f].help = true;
            } else if (!strcmp(kw, "TYPE")) {
                ck_assert_msg(!fam[f].type[0], "second TYPE for %s", name);
                const char *t = line + off;
                ck_assert_msg(!strcmp(t, "counter") || !strcmp(t, "gauge") ||
                                  !strcmp(t, "histogram") || !strcmp(t, "summary") ||
                                  !strcmp(t, "untyped"),
                              "bad type: %s", line);
                snprintf(fam[f].type, sizeof(fam[f].type), "%s", t);
            } else {
                ck_abort_msg("unknown comment: %s", line);
            }
            continue;
        }
        /* sample: name{labels} value */
        size_t nlen = strcspn(line, "{ ");
        ck_assert_msg(prom_name_ok(line, nlen), "bad sample name: %s", line);
        char name[160];
        snprintf(name, sizeof(name), "%.*s", (int)nlen, line);
        ck_assert_msg(cur >= 0 && fam[cur].type[0] && fam[cur].help, "sample before HELP/TYPE: %s",
                      line);
        const prom_family_t *F = &fam[cur];
        char suffix[32] = "";
        if (!strcmp(F->type, "histogram")) {
            size_t fl = strlen(F->name);
            ck_assert_msg(!strncmp(name, F->name, fl), "sample %s outside family %s", name,
                          F->name);
            snprintf(suffix, sizeof(suffix), "%s", name + fl);
            ck_assert_msg(!strcmp(suffix, "_bucket") || !strcmp(suffix, "_sum") ||
                              !strcmp(suffix, "_count"),
                          "bad histogram sample %s", name);
        } else {
            ck_assert_msg(!strcmp(name, F->name), "sample %s outside family %s", name, F->name);
        }
        const char *q = line + nlen;
        char le[32] = "";
        if (*q == '{') {
            q++;
            bool first = true;
            while (*q != '}') {
                if (!first) {
                    ck_assert_msg(*q == ',', "expected ',' in labels: %s", line);
                    q++;
                }
                first = false;
                size_t ln = strcspn(q, "=");
                ck_assert_msg(prom_name_ok(q, ln) && q[ln] == '=' && q[ln + 1] == '"',
                              "bad label in: %s", line);
                bool is_le = ln == 2 && !strncmp(q, "le", 2);
                q += ln + 2;
                char val[32];
                size_t vn = 0;
                while (*q && *q != '"') {
                    if (*q == '\\') {
                        q++;
                        ck_assert_msg(*q == '\\' || *q == '"' || *q == 'n', "bad escape: %s", line);
                    }
                    ck_assert_msg(*q, "unterminated label value: %s", line);
                    if (vn < sizeof(val) - 1) val[vn++] = *q;
                    q++;
                }
                val[vn] = 0;
                ck_assert_msg(*q == '"', "unterminated label value: %s", line);
                q++;
                if (is_le) snprintf(le, sizeof(le), "%s", val);
            }
            q++;
        }
        ck_assert_msg(*q == ' ', "expected a space before the value: %s", line);
        q++;
        char *end;
        double v;
        if (!strcmp(q, "+Inf"))
            v = INFINITY;
        else if (!strcmp(q, "-Inf"))
            v = -INFINITY;
        else if (!strcmp(q, "NaN"))
            v = NAN;
        else {
            v = strtod(q, &end);
            ck_assert_msg(end != q && *end == 0, "bad value (or a timestamp): %s", line);
        }
        ck_assert_msg(!(v < 0) || strcmp(F->type, "counter"), "negative counter: %s", line);
        /* no duplicate series */
        char series[192];
        snprintf(series, sizeof(series), "%.*s", (int)(q - line - 1), line);
        for (int i = 0; i < nseen; i++)
            ck_assert_msg(strcmp(seen[i], series), "duplicate series %s", series);
        ck_assert_int_lt(nseen, 512);
        snprintf(seen[nseen++], sizeof(seen[0]), "%s", series);
        if (!strcmp(suffix, "_bucket")) {
            ck_assert_msg(le[0], "bucket without le: %s", line);
            double bound = !strcmp(le, "+Inf") ? INFINITY : strtod(le, NULL);
            ck_assert_msg(bound > bucket_le || last_bucket < 0, "le not ascending: %s", line);
            ck_assert_msg(v >= last_bucket, "buckets not cumulative: %s", line);
            bucket_le = bound;
            last_bucket = v;
        } else if (!strcmp(suffix, "_count")) {
            ck_assert_msg(isinf(bucket_le) && v == last_bucket,
                          "_count differs from the +Inf bucket: %s", line);
            last_bucket = -1;
            bucket_le = -INFINITY;
        }
        samples++;
    }
    /* naming: pagekv_ prefix, counters _total, sizes _bytes */
    for (int i = 0; i < nf; i++) {
        ck_assert_msg(!strncmp(fam[i].name, "pagekv_", 7), "%s lacks the pagekv_ prefix",
                      fam[i].name);
        ck_assert_msg(fam[i].type[0] && fam[i].help, "%s lacks HELP or TYPE", fam[i].name);
        if (!strcmp(fam[i].type, "counter"))
            ck_assert_msg(ends_with(fam[i].name, "_total"), "counter %s lacks _total", fam[i].name);
        else
            ck_assert_msg(!ends_with(fam[i].name, "_total"), "non-counter %s ends in _total",
                          fam[i].name);
        if (strstr(fam[i].name, "_bytes"))
            ck_assert_msg(ends_with(fam[i].name, "_bytes") ||
                              ends_with(fam[i].name, "_bytes_total"),
                          "%s: _bytes is not the unit suffix", fam[i].name);
    }
    return samples;
}

START_TEST(metrics_parse_as_prometheus)
{
    /* The parser itself rejects what it should (checked in forked children before the
     * server's threads exist: a fork of a threaded process can inherit a held allocator
     * lock, which hung this test under ASan). */
    static const char *const broken[] = {
        "pagekv_x_total 1\n", /* no TYPE */
        "# HELP pagekv_x_total h\n# TYPE pagekv_x_total counter\npagekv_x_total one\n",
        "# HELP pagekv_x h\n# TYPE pagekv_x counter\npagekv_x 1\n", /* counter w/o _total */
        "# HELP pagekv_x_total h\n# TYPE pagekv_x_total counter\npagekv_x_total{a=\"1\" 1\n",
        "# HELP pagekv_x_total h\n# TYPE pagekv_x_total counter\npagekv_x_total 1",
    };
    for (size_t i = 0; i < sizeof(broken) / sizeof(broken[0]); i++) {
        pid_t pid = fork();
        if (pid == 0) {
            prom_check(broken[i]); /* a failing check ends the child with an error */
            _exit(0);
        }
        int status;
        waitpid(pid, &status, 0);
        ck_assert_msg(!(WIFEXITED(status) && WEXITSTATUS(status) == 0),
                      "parser accepted broken input %zu", i);
    }
    pkv_server_t *s = start(base_config());
    uint16_t port = pkv_server_port(s);
    free(complete(port, "Some traffic before scraping", 6, NULL));
    stream_vs_plain(s, false, "and a stream");
    ts_resp_t r;
    ck_assert_int_eq(http(port, "GET", "/nope", NULL, &r), CURLE_OK);
    ts_resp_free(&r);
    ck_assert_int_eq(http(port, "GET", "/metrics", NULL, &r), CURLE_OK);
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strcasestr(r.headers, "content-type: text/plain; version=0.0.4"));
    int n = prom_check(r.body);
    ck_assert_int_gt(n, 40);
    ck_assert_ptr_nonnull(strstr(r.body, "pagekv_kv_committed_bytes "));
    ck_assert_ptr_nonnull(strstr(r.body, "pagekv_requests_finished_total{reason=\"length\"} 3\n"));
    ck_assert_ptr_nonnull(
        strstr(r.body, "pagekv_http_requests_total{route=\"other\",code=\"404\"} 1\n"));
    ck_assert_ptr_nonnull(strstr(r.body, "pagekv_time_to_first_token_seconds_count 3\n"));
    ts_resp_free(&r);
    /* The process's RSS (read through prim), and /metrics and /v1/cache/stats rendering the
     * same snapshot fields (the server is idle, so two scrapes agree). */
    ck_assert_int_gt(metric(port, "pagekv_process_resident_memory_bytes"), 0);
    json_t *cs = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
    ck_assert_int_eq(ts_ji(cs, "committed_bytes"), metric(port, "pagekv_kv_committed_bytes"));
    ck_assert_int_eq(ts_ji(cs, "blocks.cached"),
                     metric(port, "pagekv_kv_blocks{state=\"cached\"}"));
    ck_assert_int_eq(ts_ji(cs, "prefix_cache.hit_tokens"),
                     metric(port, "pagekv_kv_prefix_hit_tokens_total"));
    ck_assert_int_eq(ts_ji(cs, "requests.submitted"),
                     metric(port, "pagekv_requests_submitted_total"));
    json_decref(cs);
    pkv_server_destroy(s);
}
END_TEST

/* ---- the CLI as a child process ------------------------------------------------------------- */

START_TEST(cli_rejects_bad_flags)
{
    char bin[4096];
    ts_pagekv_path(bin, sizeof(bin));
    char *const cases[][4] = {
        {bin, "serve", "--kv-cache-budget", "12X"},
        {bin, "serve", "--kv-backend", "sparse"},
        {bin, "serve", "--port", "70000"},
        {bin, "serve", "--bogus", "1"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char *argv[5] = {cases[i][0], cases[i][1], cases[i][2], cases[i][3], NULL};
        char *log;
        int code = ts_proc_run(argv, 30, &log);
        ck_assert_msg(code == 2, "case %zu: exit code %d, log %s", i, code, log);
        ck_assert_ptr_nonnull(strstr(log, "pagekv serve: "));
        free(log);
    }
}
END_TEST

START_TEST(sigterm_drains_in_flight)
{
    char bin[4096];
    ts_pagekv_path(bin, sizeof(bin));
    curl_global_init(CURL_GLOBAL_DEFAULT);
    char *argv[] = {bin, "serve", "--port", "0", "--threads", "1", NULL};
    launch_proc_t c;
    ts_proc_start(&c, argv, NULL, "pagekv serve: listening on ", false);

    /* `pagekv serve` with no model files answers. */
    json_t *h = ts_get_json("127.0.0.1", c.port, "/health");
    ck_assert_str_eq(ts_js(h, "status"), "ok");
    json_decref(h);

    streamer_t st = {.port = c.port,
                     .body =
                         "{\"model\":\"tiny\",\"prompt\":\"Finish me before you go\","
                         "\"temperature\":0,\"max_tokens\":500,\"ignore_eos\":true,\"stream\":true,"
                         "\"stream_options\":{\"include_usage\":true}}",
                     .stop_after = 0};
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, streamer_main, &st), 0);
    while (atomic_load(&st.events) < 2) usleep(1000);
    ck_assert_int_eq(kill(c.pid, SIGTERM), 0);
    /* Draining: new connections are refused (the listening socket is closed). */
    uint64_t deadline = pkv_deadline_after_ns(10ull * 1000000000);
    for (;;) {
        ts_resp_t r;
        CURLcode cc = http(c.port, "GET", "/health", NULL, &r);
        ts_resp_free(&r);
        if (cc == CURLE_COULDNT_CONNECT) break;
        ck_assert_msg(pkv_now_ns() < deadline, "still accepting 10 s after SIGTERM");
        usleep(5000);
    }
    int events_at_refusal = atomic_load(&st.events);
    pthread_join(th, NULL);
    /* Refused while the stream was still going (500 tokens outlast the signal). */
    ck_assert_int_lt(events_at_refusal, atomic_load(&st.events));
    /* The in-flight stream ran to its end. */
    ck_assert_int_eq(st.cc, CURLE_OK);
    ck_assert_int_eq(st.status, 200);
    sse_t sse;
    sse_parse(st.all, st.len, false, &sse);
    ck_assert(sse.done);
    ck_assert_str_eq(sse.finish, "length");
    ck_assert_int_eq(ts_ji(sse.usage, "completion_tokens"), 500);
    sse_free(&sse);
    free(st.all);
    char *log;
    int code = ts_proc_wait(&c, 60, &log);
    ck_assert_msg(code == 0, "exit code %d; log:\n%s", code, log);
    ck_assert_ptr_nonnull(strstr(log, "draining"));
    ck_assert_ptr_nonnull(strstr(log, "stopped"));
    ck_assert_msg(!strstr(log, "Sanitizer") && !strstr(log, "runtime error"),
                  "sanitizer report:\n%s", log);
    ck_assert_ptr_null(strstr(log, "cancelling"));
    free(log);
}
END_TEST

/* ---- pure pieces: output assembly, UTF-8 ----------------------------------------------------- */

START_TEST(gen_finish_and_figures)
{
    srv_gen_t g;
    srv_gen_init(&g);
    const char *t;
    size_t l;
    pkv_request_output_t o1 = {.text = "abc", .text_len = 3, .n_tokens = 2};
    srv_gen_feed(&g, &o1, &t, &l);
    ck_assert(t == o1.text && l == 3);
    ck_assert_ptr_null(srv_gen_finish_reason(&g)); /* not finished yet */
    pkv_request_output_t o2 = {.text = "d",
                               .text_len = 1,
                               .finished = true,
                               .finish = PKV_FINISH_STOP,
                               .prompt_tokens = 7,
                               .cached_tokens = 4,
                               .completion_tokens = 3};
    srv_gen_feed(&g, &o2, &t, &l);
    ck_assert_str_eq(srv_gen_finish_reason(&g), "stop");
    ck_assert_uint_eq(g.prompt_tokens, 7);
    ck_assert_uint_eq(g.cached_tokens, 4);
    ck_assert_uint_eq(g.completion_tokens, 3);
    o2.finish = PKV_FINISH_LENGTH;
    srv_gen_feed(&g, &o2, &t, &l);
    ck_assert_str_eq(srv_gen_finish_reason(&g), "length");
    o2.finish = PKV_FINISH_CANCELLED;
    srv_gen_feed(&g, &o2, &t, &l);
    ck_assert_ptr_null(srv_gen_finish_reason(&g)); /* an error, not a finish reason */
    o2.finish = PKV_FINISH_ERROR;
    srv_gen_feed(&g, &o2, &t, &l);
    ck_assert_ptr_null(srv_gen_finish_reason(&g));
}
END_TEST

/* The engine's rule for where a text piece may end (engine.c safe_text_end, UTF-8 part). */
static size_t engine_safe_end(const unsigned char *s, size_t from, size_t end)
{
    for (size_t back = 1; back <= 4 && end - from >= back; back++) {
        unsigned char c = s[end - back];
        if ((c & 0xc0) == 0x80) continue;
        size_t need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
        if (need > back) end -= back;
        break;
    }
    return end;
}

START_TEST(utf8_sanitize_piecewise_equals_whole)
{
    char out[64];
    static const struct {
        const char *in;
        size_t len;
        const char *want;
    } cases[] = {
        {"abc", 3, "abc"},
        {"caf\xc3\xa9", 5, "caf\xc3\xa9"},
        {"\xff", 1, "\xef\xbf\xbd"},
        {"\xc3", 1, "\xef\xbf\xbd"},
        {"\xe2\x82", 2, "\xef\xbf\xbd"}, /* truncated 3-byte: one U+FFFD */
        {"\xe0\x80\x80", 3, "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* overlong */
        {"\xed\xa0\x80", 3, "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* surrogate */
        {"\xf0\x9f\x98\x80!", 5, "\xf0\x9f\x98\x80!"},
        {"\xf4\x90\x80\x80", 4, "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"},
        {"a\x00b", 3, "a\x00b"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t n = srv_utf8_sanitize(cases[i].in, cases[i].len, out);
        size_t wl = i == 9 ? 3 : strlen(cases[i].want);
        ck_assert_msg(n == wl && !memcmp(out, cases[i].want, n), "case %zu", i);
    }
    /* Random byte soup cut where the engine may cut: piecewise == whole, always valid. */
    uint64_t seed = pkv_test_seed(0x5eed), rng = seed;
    for (int iter = 0; iter < 2000; iter++) {
        unsigned char s[48];
        size_t len = pkv_test_below(&rng, sizeof(s)) + 1;
        for (size_t i = 0; i < len; i++) {
            uint32_t k = pkv_test_below(&rng, 4);
            s[i] = (unsigned char)(k == 0   ? pkv_test_below(&rng, 128)
                                   : k == 1 ? 0x80 + pkv_test_below(&rng, 64)
                                            : 0xc0 + pkv_test_below(&rng, 64));
        }
        char whole[3 * 48], pieces[3 * 48];
        size_t wn = srv_utf8_sanitize((const char *)s, len, whole), pn = 0, from = 0;
        while (from < len) {
            size_t end = from + 1 + pkv_test_below(&rng, (uint32_t)(len - from));
            size_t safe = end == len ? len : engine_safe_end(s, from, end);
            if (safe == from) safe = end == len ? len : from; /* nothing publishable yet */
            if (safe == from) continue;
            pn += srv_utf8_sanitize((const char *)s + from, safe - from, pieces + pn);
            from = safe;
        }
        ck_assert_msg(wn == pn && !memcmp(whole, pieces, wn), "seed %llu iter %d",
                      (unsigned long long)seed, iter);
        json_t *j = json_stringn(whole, wn);
        ck_assert_msg(j != NULL, "not valid UTF-8 after sanitizing (seed %llu)",
                      (unsigned long long)seed);
        json_decref(j);
    }
}
END_TEST

/* ---- roles (prefill / decode nodes with a transfer agent) ---------------------------------- */

START_TEST(roles_cli_rejects_bad_values)
{
    char bin[4096];
    ts_pagekv_path(bin, sizeof(bin));
    /* Each case: arguments after `serve`, and the message's words. */
    static const struct {
        const char *args[6];
        const char *says;
    } cases[] = {
        {{"--role", "router"}, "--role wants unified, prefill or decode"},
        {{"--role", "prefill", "--kv-listen", "127.0.0.1"}, "--kv-listen wants HOST:PORT"},
        {{"--role", "prefill", "--kv-listen", "127.0.0.1:70000"}, "--kv-listen wants HOST:PORT"},
        {{"--role", "prefill", "--kv-listen", ":5000"}, "--kv-listen wants HOST:PORT"},
        {{"--role", "decode", "--kv-advertise", "bad host!"}, "--kv-advertise wants"},
        {{"--role", "decode", "--kv-advertise", ""}, "--kv-advertise wants"},
        {{"--role", "prefill", "--staging", "slots"},
         "--staging wants per_transfer, fixed or mirror"},
        {{"--role", "prefill", "--staging-pages", "0"}, "--staging-pages wants an integer"},
        {{"--role", "prefill", "--staging-pages", "many"}, "--staging-pages wants an integer"},
        {{"--role", "prefill", "--staging", "fixed", "--staging-slots", "0"},
         "--staging-slots wants an integer"},
        {{"--role", "prefill", "--staging-slots", "2"}, "--staging-slots needs --staging fixed"},
        {{"--role", "prefill", "--staging-peer-cap", "-1"}, "--staging-peer-cap wants an integer"},
        {{"--role", "prefill", "--staging-idle-ms", "0"}, "--staging-idle-ms wants an integer"},
        {{"--role", "prefill", "--staging", "mirror", "--staging-idle-ms", "100"},
         "--staging-idle-ms and --staging-warm-ms need --staging per_transfer"},
        {{"--role", "prefill", "--staging-warm-ms", "0"}, "--staging-warm-ms wants an integer"},
        {{"--role", "decode", "--staging-warm-ms", "soon"}, "--staging-warm-ms wants an integer"},
        {{"--role", "prefill", "--staging", "fixed", "--staging-warm-ms", "none"},
         "--staging-idle-ms and --staging-warm-ms need --staging per_transfer"},
        {{"--role", "prefill", "--kv-lease-ms", "0"}, "--kv-lease-ms wants an integer"},
        {{"--role", "prefill", "--kv-lease-ms", "10s"}, "--kv-lease-ms wants an integer"},
        {{"--role", "decode", "--kv-transfer-timeout-ms", "0"},
         "--kv-transfer-timeout-ms wants an integer"},
        {{"--kv-listen", "127.0.0.1:0"}, "--kv-listen needs --role prefill or decode"},
        {{"--staging-shared"}, "--staging-shared needs --role prefill or decode"},
        {{"--role", "unified", "--kv-lease-ms", "5"},
         "--kv-lease-ms needs --role prefill or decode"},
        {{"--role", "prefill", "--kv-backend", "dense"}, "--role prefill needs --kv-backend paged"},
        {{"--role", "decode", "--kv-listen"}, "missing value: --kv-listen"},
        {{"--role", "decode", "--kv-load-failure", "retry"},
         "--kv-load-failure wants fail or recompute"},
        {{"--kv-load-failure", "recompute"}, "--kv-load-failure needs --role prefill or decode"},
    };
    for (size_t i = 0; i < PKV_ARRAY_LEN(cases); i++) {
        char *argv[9] = {bin, "serve"};
        int n = 2;
        for (int k = 0; k < 6 && cases[i].args[k]; k++) argv[n++] = (char *)cases[i].args[k];
        char *log;
        int code = ts_proc_run(argv, 30, &log);
        ck_assert_msg(code == 2, "case %zu: exit code %d, log %s", i, code, log);
        ck_assert_msg(strstr(log, cases[i].says), "case %zu: log lacks '%s': %s", i, cases[i].says,
                      log);
        free(log);
    }
}
END_TEST

/* A loopback TCP port nothing listens on (bound once, then closed). */
static uint16_t free_port(void)
{
    int probe = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    ck_assert_int_eq(bind(probe, (struct sockaddr *)&sa, sizeof(sa)), 0);
    ck_assert_int_eq(getsockname(probe, (struct sockaddr *)&sa, &sl), 0);
    close(probe);
    return ntohs(sa.sin_port);
}

/* A `pagekv serve` child: its HTTP port and (roles with an agent) the agent's address,
 * both from its log. */
static void role_child(launch_proc_t *c, char *const argv[], char *agent, size_t agent_cap)
{
    ts_proc_start(c, argv, NULL, "pagekv serve: listening on ", agent != NULL);
    if (agent) {
        ck_assert_uint_lt(strlen(c->kv_address), agent_cap);
        snprintf(agent, agent_cap, "%s", c->kv_address);
    }
}

static void role_child_stop(launch_proc_t *c)
{
    ck_assert_int_eq(ts_proc_stop(c, 30), 0);
}

/* /health per role, the agent's address printed and reported, --kv-listen, --kv-advertise,
 * fixed staging committed at start. */
START_TEST(roles_health_and_agent_address)
{
    char bin[4096];
    ts_pagekv_path(bin, sizeof(bin));
    curl_global_init(CURL_GLOBAL_DEFAULT);
    launch_proc_t u, p, d;
    char *uargv[] = {bin, "serve", "--port", "0", "--threads", "1", NULL};
    role_child(&u, uargv, NULL, 0);
    json_t *h = ts_get_json("127.0.0.1", u.port, "/health");
    ck_assert_str_eq(ts_js(h, "status"), "ok");
    ck_assert_ptr_null(ts_jp(h, "role")); /* unified answers as before */
    json_decref(h);
    json_t *st = ts_get_json("127.0.0.1", u.port, "/v1/cache/stats");
    ck_assert_ptr_null(ts_jp(st, "kv_transfer"));
    json_decref(st);
    role_child_stop(&u);

    char pagent[PKV_XFER_ADDR_MAX], dagent[PKV_XFER_ADDR_MAX];
    char *pargv[] = {
        bin,         "serve", "--port",          "0", "--threads",       "1", "--role", "prefill",
        "--staging", "fixed", "--staging-slots", "2", "--staging-pages", "3", NULL};
    role_child(&p, pargv, pagent, sizeof(pagent));
    ck_assert_ptr_nonnull(strstr(pagent, "127.0.0.1:"));
    h = ts_get_json("127.0.0.1", p.port, "/health");
    ck_assert_str_eq(ts_js(h, "status"), "ok");
    ck_assert_str_eq(ts_js(h, "role"), "prefill");
    ck_assert_str_eq(ts_js(h, "kv_agent"), "ok");
    ck_assert_str_eq(ts_js(h, "kv_address"), pagent);
    json_decref(h);
    st = ts_get_json("127.0.0.1", p.port, "/v1/cache/stats");
    ck_assert_str_eq(ts_js(st, "kv_transfer.address"), pagent);
    ck_assert_str_eq(ts_js(st, "kv_transfer.remote_host"), "127.0.0.1");
    ck_assert_int_eq(ts_ji(st, "kv_transfer.remote_port"), atoi(strrchr(pagent, ':') + 1));
    ck_assert_int_eq(ts_ji(st, "kv_transfer.lease_ms"), 30000);
    ck_assert_str_eq(ts_js(st, "kv_transfer.staging.mode"), "fixed_slots");
    ck_assert_int_eq(ts_ji(st, "kv_transfer.staging.pages_total"), 6);
    /* fixed: the whole carve-out committed at start */
    ck_assert_int_eq(ts_ji(st, "kv_transfer.staging.resident_bytes"),
                     6 * ts_ji(st, "kv_transfer.staging.page_bytes"));
    ck_assert(json_is_null(ts_jp(st, "kv_transfer.staging.idle_release_ms"))); /* never returned */
    ck_assert(json_is_null(ts_jp(st, "kv_transfer.staging.warm_ms")));         /* no floor */
    json_decref(st);

    /* A decode node on a chosen port, advertising another host. */
    char listen[32], want[48];
    snprintf(listen, sizeof(listen), "127.0.0.1:%u", free_port());
    char *dargv[] = {bin,
                     "serve",
                     "--port",
                     "0",
                     "--threads",
                     "1",
                     "--role",
                     "decode",
                     "--kv-listen",
                     listen,
                     "--kv-advertise",
                     "decode-7.example",
                     "--kv-transfer-timeout-ms",
                     "2500",
                     "--staging-idle-ms",
                     "750",
                     NULL};
    role_child(&d, dargv, dagent, sizeof(dagent));
    snprintf(want, sizeof(want), "%s", listen);
    ck_assert_str_eq(dagent, want);
    h = ts_get_json("127.0.0.1", d.port, "/health");
    ck_assert_str_eq(ts_js(h, "role"), "decode");
    json_decref(h);
    st = ts_get_json("127.0.0.1", d.port, "/v1/cache/stats");
    ck_assert_str_eq(ts_js(st, "kv_transfer.address"), listen);
    ck_assert_str_eq(ts_js(st, "kv_transfer.remote_host"), "decode-7.example");
    ck_assert_int_eq(ts_ji(st, "kv_transfer.transfer_timeout_ms"), 2500);
    ck_assert_str_eq(ts_js(st, "kv_transfer.staging.mode"), "per_transfer");
    ck_assert_int_eq(ts_ji(st, "kv_transfer.staging.idle_release_ms"), 750);
    ck_assert_int_eq(ts_ji(st, "kv_transfer.staging.warm_ms"), 30000); /* the default floor */
    ck_assert_int_eq(ts_ji(st, "kv_transfer.staging.warm_floor_pages"), 0);
    json_decref(st);
    role_child_stop(&d);
    role_child_stop(&p);
}
END_TEST

/* libcurl's body callback into a fixed buffer (the one exchange below that needs an easy
 * handle of its own: two requests on one kept-alive connection). */
static size_t keep_body(char *p, size_t sz, size_t n, void *arg)
{
    char *buf = arg;
    size_t have = strlen(buf), k = PKV_MIN(sz * n, 4095 - have);
    memcpy(buf + have, p, k);
    buf[have + k] = 0;
    return sz * n;
}

/* /health of a role with an agent is 503 while the node drains. */
START_TEST(roles_health_503_while_draining)
{
    pkv_server_config_t cfg = base_config();
    cfg.role = PKV_SERVER_ROLE_PREFILL;
    pkv_server_t *s = start(cfg);
    uint16_t port = pkv_server_port(s);
    pkv_server_info_t info;
    pkv_server_info(s, &info);
    ck_assert_int_eq(info.role, PKV_SERVER_ROLE_PREFILL);
    ck_assert_ptr_nonnull(info.kv_address);
    json_t *h = ts_get_json("127.0.0.1", port, "/health");
    ck_assert_str_eq(ts_js(h, "kv_agent"), "ok");
    json_decref(h);
    /* The listening socket closes on quiesce; an open connection still gets the answer. */
    CURL *c = curl_easy_init();
    char url[64];
    snprintf(url, sizeof(url), "http://127.0.0.1:%u/health", port);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, keep_body);
    char body[4096] = "";
    curl_easy_setopt(c, CURLOPT_WRITEDATA, body);
    ck_assert_int_eq(curl_easy_perform(c), CURLE_OK); /* keep-alive connection */
    body[0] = 0;
    pkv_server_quiesce(s);
    ck_assert_int_eq(curl_easy_perform(c), CURLE_OK);
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    ck_assert_int_eq(status, 503);
    ck_assert_ptr_nonnull(strstr(body, "\"draining\""));
    ck_assert_ptr_nonnull(strstr(body, "\"prefill\""));
    curl_easy_cleanup(c);
    pkv_server_destroy(s);
}
END_TEST

#define PREFILL_LEG                                                                                \
    "\"kv_transfer_params\": {\"do_remote_decode\": true, \"do_remote_prefill\": false, "          \
    "\"remote_engine_id\": null, \"remote_block_ids\": null, \"remote_host\": null, "              \
    "\"remote_port\": null}"

/* 40 token ids: 2 full blocks of 16 and a partial one. */
#define PROMPT40                                                                                   \
    "[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,"  \
    "34,35,36,37,38,39,40]"

static json_t *kv_stats(uint16_t port)
{
    json_t *st = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
    json_t *kv = json_incref(ts_jp(st, "kv_transfer"));
    ck_assert_ptr_nonnull(kv);
    json_decref(st);
    return kv;
}

/* The prefill leg's answer: a normal completion plus kv_transfer_params naming the
 * producer, its blocks in order and pagekv's handle fields; the blocks stay pinned under
 * the lease and, with no decode leg, return as ordinary prefix-cache blocks (counted). */
START_TEST(prefill_leg_answer_and_lease_expiry)
{
    pkv_server_config_t cfg = base_config();
    cfg.role = PKV_SERVER_ROLE_PREFILL;
    cfg.kv_lease_ms = 400;
    pkv_server_t *s = start(cfg);
    uint16_t port = pkv_server_port(s);
    pkv_server_info_t info;
    pkv_server_info(s, &info);
    json_t *kv0 = kv_stats(port);
    long status;
    /* Proxies send one X-Request-Id to both legs, some a constant: two legs with the same
     * one are two registrations. */
    http_extra_header = "X-Request-Id: same-for-everyone";
    json_t *docs[2];
    for (int i = 0; i < 2; i++) {
        docs[i] = post_json(port, "/v1/completions",
                            "{\"model\": \"tiny\", \"prompt\": " PROMPT40 ", \"max_tokens\": 1, "
                            "\"stream\": false, " PREFILL_LEG "}",
                            &status);
        ck_assert_int_eq(status, 200);
    }
    http_extra_header = NULL;
    json_t *doc = docs[0];
    ck_assert_str_eq(ts_js(doc, "object"), "text_completion");
    ck_assert_int_eq(ts_ji(doc, "usage.prompt_tokens"), 40);
    ck_assert_int_eq(ts_ji(doc, "usage.completion_tokens"), 1);
    ck_assert_str_eq(ts_js(doc, "choices.0.finish_reason"), "length");
    json_t *kt = ts_jp(doc, "kv_transfer_params");
    ck_assert(json_is_true(ts_jp(kt, "do_remote_prefill")));
    ck_assert(json_is_false(ts_jp(kt, "do_remote_decode")));
    ck_assert_str_eq(ts_js(kt, "remote_engine_id"), ts_js(kv0, "engine_id"));
    ck_assert_str_eq(ts_js(kt, "remote_host"), "127.0.0.1");
    ck_assert_int_eq(ts_ji(kt, "remote_port"), atoi(strrchr(info.kv_address, ':') + 1));
    json_t *ids = ts_jp(kt, "remote_block_ids");
    ck_assert_uint_eq(json_array_size(ids), 3);
    for (size_t i = 0; i < 3; i++) ck_assert(json_is_integer(json_array_get(ids, i)));
    ck_assert_int_eq(ts_ji(kt, "pagekv_prompt_tokens"), 40);
    ck_assert_uint_eq(strlen(ts_js(kt, "pagekv_token")), 2 * PKV_XFER_TOKEN_BYTES);
    ck_assert_int_eq(ts_ji(kt, "pagekv_geometry.block_tokens"), 16);
    ck_assert_str_eq(ts_js(kt, "pagekv_geometry.dtype"), "f16");
    ck_assert_int_ne(ts_ji(kt, "pagekv_request_id"),
                     ts_ji(docs[1], "kv_transfer_params.pagekv_request_id"));
    /* The second leg adopted the first one's full blocks: the same ids first. */
    json_t *ids1 = ts_jp(docs[1], "kv_transfer_params.remote_block_ids");
    for (size_t i = 0; i < 2; i++)
        ck_assert_int_eq(json_integer_value(json_array_get(ids, i)),
                         json_integer_value(json_array_get(ids1, i)));

    json_t *kv = kv_stats(port);
    ck_assert_int_eq(ts_ji(kv, "leases.offered"), 2);
    ck_assert_int_eq(ts_ji(kv, "leases.live"), 2);
    ck_assert_int_ge(ts_ji(kv, "leases.pinned_blocks"), 4);
    json_decref(kv);
    json_t *st = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
    ck_assert_int_eq(ts_ji(st, "sequences"), 0);
    ck_assert_int_ge(ts_ji(st, "blocks.live"), 4); /* pinned by the leases */
    json_decref(st);

    /* No decode leg: the leases expire and the blocks return. */
    uint64_t deadline = pkv_deadline_after_ns(10ull * 1000000000);
    for (;;) {
        kv = kv_stats(port);
        bool ended = ts_ji(kv, "leases.expired") == 2;
        if (ended) break;
        json_decref(kv);
        ck_assert_msg(pkv_now_ns() < deadline, "the leases did not expire");
        usleep(20000);
    }
    ck_assert_int_eq(ts_ji(kv, "leases.live"), 0);
    ck_assert_int_eq(ts_ji(kv, "leases.pinned_blocks"), 0);
    json_decref(kv);
    st = ts_get_json("127.0.0.1", port, "/v1/cache/stats");
    ck_assert_int_eq(ts_ji(st, "blocks.live"), 0);
    ck_assert_int_eq(ts_ji(st, "blocks.cached"), 2); /* the full blocks, now prefix cache */
    json_decref(st);
    ck_assert_int_eq(metric(port, "pagekv_kv_leases_total{outcome=\"expired\"}"), 2);
    ck_assert_int_eq(metric(port, "pagekv_kv_leases_live"), 0);
    ck_assert_int_eq(metric(port, "pagekv_kv_transfer_pinned_blocks"), 0);
    ts_resp_t mr;
    ck_assert_int_eq(http(port, "GET", "/metrics", NULL, &mr), CURLE_OK);
    ck_assert_int_gt(prom_check(mr.body), 40); /* the roles' families parse too */
    ts_resp_free(&mr);
    /* Ordinary prefix-cache blocks: a plain request adopts them. */
    doc = post_json(port, "/v1/completions",
                    "{\"model\": \"tiny\", \"prompt\": " PROMPT40 ", \"max_tokens\": 1}", &status);
    ck_assert_int_eq(status, 200);
    ck_assert_int_eq(ts_ji(doc, "usage.prompt_tokens_details.cached_tokens"), 32);
    ck_assert_ptr_null(ts_jp(doc, "kv_transfer_params"));
    json_decref(doc);

    /* Chat takes a prefill leg too. */
    doc = post_json(port, "/v1/chat/completions",
                    "{\"model\": \"tiny\", \"messages\": [{\"role\": \"user\", \"content\": "
                    "\"hello there\"}], \"max_tokens\": 1, " PREFILL_LEG "}",
                    &status);
    ck_assert_int_eq(status, 200);
    ck_assert_str_eq(ts_js(doc, "object"), "chat.completion");
    ck_assert(json_is_true(ts_jp(doc, "kv_transfer_params.do_remote_prefill")));
    json_decref(doc);
    json_decref(docs[0]);
    json_decref(docs[1]);
    json_decref(kv0);
    pkv_server_destroy(s);
}
END_TEST

typedef struct {
    const char *body;
    const char *code, *param;
} kvt_case_t;

static void kvt_refusals(uint16_t port, const char *path, const kvt_case_t *cases, size_t n)
{
    long long before[12], after[12];
    state_of(port, before);
    for (size_t i = 0; i < n; i++) {
        long status;
        json_t *doc = post_json(port, path, cases[i].body, &status);
        ck_assert_msg(status == 400, "case %zu: status %ld", i, status);
        ck_assert_msg(!strcmp(ts_js(doc, "error.code"), cases[i].code), "case %zu: code %s", i,
                      ts_js(doc, "error.code"));
        ck_assert_msg(!strcmp(ts_js(doc, "error.param"), cases[i].param), "case %zu: param %s", i,
                      ts_js(doc, "error.param"));
        json_decref(doc);
    }
    state_of(port, after);
    ck_assert_mem_eq(before, after, sizeof(before));
}

#define LEG_BODY(extra) "{\"model\": \"tiny\", \"prompt\": \"hi\", \"max_tokens\": 1, " extra "}"

/* Bad kv_transfer_params, or params the node's role cannot take: 400 naming the field,
 * nothing registered, nothing else changed. */
START_TEST(kv_transfer_params_refused_by_role_and_shape)
{
    static const kvt_case_t prefill_cases[] = {
        {LEG_BODY("\"kv_transfer_params\": \"x\""), "invalid_type", "kv_transfer_params"},
        {LEG_BODY("\"kv_transfer_params\": {\"do_remote_decode\": \"yes\"}"), "invalid_type",
         "kv_transfer_params.do_remote_decode"},
        {LEG_BODY("\"kv_transfer_params\": {\"do_remote_decode\": true, \"remote_port\": \"80\"}"),
         "invalid_type", "kv_transfer_params.remote_port"},
        {LEG_BODY("\"kv_transfer_params\": {\"do_remote_decode\": true, \"remote_block_ids\": 3}"),
         "invalid_type", "kv_transfer_params.remote_block_ids"},
        {LEG_BODY("\"kv_transfer_params\": {\"do_remote_decode\": true, \"do_remote_prefill\": "
                  "true}"),
         "invalid_value", "kv_transfer_params"},
        {LEG_BODY(
             "\"kv_transfer_params\": {\"do_remote_decode\": true, \"remote_block_ids\": [1]}"),
         "invalid_value", "kv_transfer_params"},
        {LEG_BODY(
             "\"kv_transfer_params\": {\"do_remote_prefill\": true, \"remote_block_ids\": [0]}"),
         "invalid_value", "kv_transfer_params"},
        {LEG_BODY("\"stream\": true, " PREFILL_LEG), "invalid_value", "stream"},
        {LEG_BODY("\"n\": 2, " PREFILL_LEG), "unsupported_parameter", "n"},
        {"{\"model\": \"tiny\", \"prompt\": [\"a\", \"b\"], \"max_tokens\": 1, " PREFILL_LEG "}",
         "unsupported_parameter", "prompt"},
    };
    static const kvt_case_t unified_cases[] = {
        {LEG_BODY(PREFILL_LEG), "unsupported_parameter", "kv_transfer_params"},
        {LEG_BODY("\"kv_transfer_params\": {\"do_remote_prefill\": true}"), "unsupported_parameter",
         "kv_transfer_params"},
    };
    static const kvt_case_t decode_cases[] = {
        {LEG_BODY(PREFILL_LEG), "invalid_value", "kv_transfer_params"},
    };
    pkv_server_config_t cfg = base_config();
    cfg.role = PKV_SERVER_ROLE_PREFILL;
    pkv_server_t *s = start(cfg);
    uint16_t port = pkv_server_port(s);
    long status;
    json_t *doc = post_json(port, "/v1/completions", LEG_BODY(PREFILL_LEG), &status);
    ck_assert_int_eq(status, 200); /* some state first */
    json_decref(doc);
    json_t *kv0 = kv_stats(port);
    kvt_refusals(port, "/v1/completions", prefill_cases, PKV_ARRAY_LEN(prefill_cases));
    json_t *kv1 = kv_stats(port);
    ck_assert_int_eq(ts_ji(kv1, "leases.offered"), ts_ji(kv0, "leases.offered"));
    ck_assert_int_eq(ts_ji(kv1, "leases.live"), ts_ji(kv0, "leases.live"));
    ck_assert_int_eq(ts_ji(kv1, "leases.pinned_blocks"), ts_ji(kv0, "leases.pinned_blocks"));
    json_decref(kv0);
    json_decref(kv1);
    pkv_server_destroy(s);

    s = start(base_config());
    kvt_refusals(pkv_server_port(s), "/v1/completions", unified_cases,
                 PKV_ARRAY_LEN(unified_cases));
    pkv_server_destroy(s);

    cfg.role = PKV_SERVER_ROLE_DECODE;
    s = start(cfg);
    kvt_refusals(pkv_server_port(s), "/v1/completions", decode_cases, PKV_ARRAY_LEN(decode_cases));
    /* A decode node given no params computes the prompt itself. */
    doc = post_json(pkv_server_port(s), "/v1/completions", LEG_BODY("\"seed\": 1"), &status);
    ck_assert_int_eq(status, 200);
    json_decref(doc);
    pkv_server_destroy(s);
}
END_TEST

/* ---- the decode leg ------------------------------------------------------------------------- */

/* One leg's answer: text, finish reason and token counts, streamed or not. */
typedef struct {
    long status;
    char text[8192];
    char finish[16];
    long long prompt, completion, cached;
    json_t *doc; /* non-streamed: the response */
} leg_t;

static void leg_post(uint16_t port, const char *path, json_t *req, leg_t *out)
{
    memset(out, 0, sizeof(*out));
    bool chat = strstr(path, "chat") != NULL;
    bool stream = json_is_true(json_object_get(req, "stream"));
    char *body = json_dumps(req, 0);
    ts_resp_t r;
    ck_assert_int_eq(http(port, "POST", path, body, &r), CURLE_OK);
    free(body);
    out->status = r.status;
    json_t *usage = NULL;
    if (stream && r.status == 200) {
        sse_t *e = malloc(sizeof(*e));
        ck_assert_ptr_nonnull(e);
        sse_parse(r.body, r.len, chat, e);
        ck_assert(e->done);
        snprintf(out->text, sizeof(out->text), "%.*s", (int)e->text_len, e->text);
        snprintf(out->finish, sizeof(out->finish), "%s", e->finish ? e->finish : "");
        usage = json_incref(e->usage);
        sse_free(e);
        free(e);
    } else {
        out->doc = json_loadb(r.body ? r.body : "", r.len, JSON_ALLOW_NUL, NULL);
        ck_assert_ptr_nonnull(out->doc);
        if (r.status == 200) {
            json_t *t = ts_jp(out->doc, chat ? "choices.0.message.content" : "choices.0.text");
            snprintf(out->text, sizeof(out->text), "%s", json_string_value(t));
            snprintf(out->finish, sizeof(out->finish), "%s",
                     ts_js(out->doc, "choices.0.finish_reason"));
            usage = json_incref(ts_jp(out->doc, "usage"));
        }
    }
    ts_resp_free(&r);
    if (usage) {
        out->prompt = ts_ji(usage, "prompt_tokens");
        out->completion = ts_ji(usage, "completion_tokens");
        out->cached = ts_ji(usage, "prompt_tokens_details.cached_tokens");
        json_decref(usage);
    }
}

/* The prefill leg of req (as the field's proxies make it) on port: its kv_transfer_params. */
static json_t *prefill_leg(uint16_t port, const char *path, json_t *req)
{
    json_t *pre = json_deep_copy(req);
    json_object_set_new(pre, "max_tokens", json_integer(1));
    json_object_set_new(pre, "stream", json_false());
    json_object_del(pre, "stream_options");
    json_object_set_new(pre, "kv_transfer_params",
                        json_pack("{s:b, s:b, s:n, s:n, s:n, s:n}", "do_remote_decode", 1,
                                  "do_remote_prefill", 0, "remote_engine_id", "remote_block_ids",
                                  "remote_host", "remote_port"));
    leg_t p;
    leg_post(port, path, pre, &p);
    json_decref(pre);
    ck_assert_int_eq(p.status, 200);
    json_t *kt = json_incref(ts_jp(p.doc, "kv_transfer_params"));
    ck_assert_ptr_nonnull(kt);
    json_decref(p.doc);
    return kt;
}

/* The decode leg of req with kt on port (nothing else changed in the body). */
static void decode_leg(uint16_t port, const char *path, json_t *req, json_t *kt, leg_t *out)
{
    json_t *dec = json_deep_copy(req);
    json_object_set(dec, "kv_transfer_params", kt);
    leg_post(port, path, dec, out);
    json_decref(dec);
}

/* Both legs driven as a proxy does, and the answer compared with the unified node's. */
/* The answer of req through the prefill and decode nodes equals the unified node's. first:
 * the decode leg takes the prefill leg's first token (pagekv_first) and computes no prompt
 * position; otherwise pagekv_first is dropped from the params and the decode leg computes
 * the last prompt position only. Returns the prompt's token count. */
static long long disagg_equals_unified(const uint16_t ports[3], const char *path, json_t *req,
                                       bool first)
{
    leg_t u, d;
    leg_post(ports[2], path, req, &u);
    ck_assert_int_eq(u.status, 200);
    json_t *kt = prefill_leg(ports[0], path, req);
    ck_assert(json_is_integer(ts_jp(kt, "pagekv_first.token")));
    ck_assert_int_gt(ts_ji(kt, "pagekv_first.check"), 0);
    if (!first) json_object_del(kt, "pagekv_first");
    decode_leg(ports[1], path, req, kt, &d);
    json_decref(kt);
    ck_assert_msg(d.status == 200, "decode leg: %ld %s", d.status,
                  d.doc ? json_dumps(d.doc, 0) : "");
    ck_assert_str_eq(d.text, u.text);
    ck_assert_str_eq(d.finish, u.finish);
    ck_assert_int_eq(d.prompt, u.prompt);
    ck_assert_int_eq(d.completion, u.completion);
    if (d.prompt > 0) /* 0: a stream without usage */
        ck_assert_int_eq(d.cached, first ? d.prompt : d.prompt - 1);
    json_decref(u.doc);
    json_decref(d.doc);
    return d.prompt;
}

/* Three nodes in this process: prefill, decode, unified (ports[0..2]). */
static void three_nodes(pkv_server_t *s[3], uint16_t ports[3], uint32_t timeout_ms, bool recompute)
{
    pkv_server_role_t roles[3] = {PKV_SERVER_ROLE_PREFILL, PKV_SERVER_ROLE_DECODE,
                                  PKV_SERVER_ROLE_UNIFIED};
    for (int i = 0; i < 3; i++) {
        pkv_server_config_t cfg = base_config();
        cfg.role = roles[i];
        cfg.kv_transfer_timeout_ms = timeout_ms;
        cfg.kv_load_recompute = recompute;
        s[i] = start(cfg);
        ports[i] = pkv_server_port(s[i]);
    }
}

/* Every leg's counts settled: the prefill node's leases all sent, no pins left. */
static void leases_settle(uint16_t port, long long sent)
{
    uint64_t deadline = pkv_deadline_after_ns(10ull * 1000000000);
    for (;;) {
        json_t *kv = kv_stats(port);
        bool done = ts_ji(kv, "leases.sent") == sent && ts_ji(kv, "leases.pinned_blocks") == 0 &&
                    ts_ji(kv, "leases.live") == 0;
        json_decref(kv);
        if (done) return;
        ck_assert_msg(pkv_now_ns() < deadline, "leases did not settle at %lld sent", sent);
        usleep(10000);
    }
}

/* The decode leg's pull counts and both nodes' byte counters. */
typedef struct {
    long long ok, released, pulled, adopted, received, sent, first_used, first_ignored;
} pull_counts_t;

static void pull_counts(const uint16_t ports[3], pull_counts_t *c)
{
    json_t *d = kv_stats(ports[1]), *p = kv_stats(ports[0]);
    c->ok = ts_ji(d, "pulls.ok");
    c->released = ts_ji(d, "pulls.released");
    c->pulled = ts_ji(d, "pulls.blocks_pulled");
    c->adopted = ts_ji(d, "pulls.blocks_adopted");
    c->first_used = ts_ji(d, "pulls.first_token.used");
    c->first_ignored = ts_ji(d, "pulls.first_token.ignored");
    ck_assert_int_eq(c->first_used,
                     metric(ports[1], "pagekv_kv_pull_first_token_total{taken=\"used\"}"));
    ck_assert_int_eq(c->first_ignored,
                     metric(ports[1], "pagekv_kv_pull_first_token_total{taken=\"ignored\"}"));
    c->received = ts_ji(d, "transfers.bytes_received");
    c->sent = ts_ji(p, "transfers.bytes_sent");
    ck_assert_int_eq(c->pulled, metric(ports[1], "pagekv_kv_pull_blocks_total{source=\"pulled\"}"));
    ck_assert_int_eq(c->adopted,
                     metric(ports[1], "pagekv_kv_pull_blocks_total{source=\"adopted\"}"));
    json_decref(d);
    json_decref(p);
}

/* The decode leg pulls the prompt's KV and decodes: completions and chat, streamed and
 * not, greedy and seeded, each equal to a unified node's answer. Decode-side prefix hits:
 * a prompt that extends a cached one pulls only its new blocks (the bytes of exactly
 * those, counted on both nodes); a prompt the decode node holds whole moves at most the
 * partial block of its last positions (a token-only release where they end a block), and
 * the prefill node's pins are back when the answer is. */
START_TEST(decode_leg_equals_unified)
{
    pkv_server_t *s[3];
    uint16_t ports[3];
    three_nodes(s, ports, 5000, false);
    const char *text = "The quick brown fox jumps over the lazy dog and keeps running far away";
    json_t *reqs[] = {
        json_pack("{s:s, s:s, s:i, s:f}", "model", "tiny", "prompt", text, "max_tokens", 12,
                  "temperature", 0.0),
        json_pack("{s:s, s:s, s:i, s:f, s:b, s:{s:b}}", "model", "tiny", "prompt", text,
                  "max_tokens", 12, "temperature", 0.0, "stream", 1, "stream_options",
                  "include_usage", 1),
        json_pack("{s:s, s:s, s:i, s:f, s:i}", "model", "tiny", "prompt",
                  "Seeded: once upon a time a small fox lived in a quiet wood near the hills, "
                  "far from the sea",
                  "max_tokens", 10, "temperature", 0.9, "seed", 11),
        json_pack("{s:s, s:s, s:i, s:f, s:i, s:b, s:{s:b}}", "model", "tiny", "prompt",
                  "Seeded and streamed: once upon a time there was an old mill by a river "
                  "that turned all day",
                  "max_tokens", 10, "temperature", 0.9, "seed", 5, "stream", 1, "stream_options",
                  "include_usage", 1),
        json_pack("{s:s, s:[{s:s, s:s}], s:i, s:f}", "model", "tiny", "messages", "role", "user",
                  "content",
                  "Tell me about paged attention in one line, as if to a friend who writes "
                  "operating systems",
                  "max_tokens", 12, "temperature", 0.0),
        json_pack("{s:s, s:[{s:s, s:s}], s:i, s:f, s:i, s:b, s:{s:b}}", "model", "tiny", "messages",
                  "role", "user", "content",
                  "Stream me a seeded chat answer please, about caches, pages and the "
                  "blocks they hold",
                  "max_tokens", 12, "temperature", 0.7, "seed", 3, "stream", 1, "stream_options",
                  "include_usage", 1),
    };
    const char *paths[] = {"/v1/completions", "/v1/completions",      "/v1/completions",
                           "/v1/completions", "/v1/chat/completions", "/v1/chat/completions"};
    for (size_t i = 0; i < PKV_ARRAY_LEN(reqs); i++)
        disagg_equals_unified(ports, paths[i], reqs[i], true);
    pull_counts_t a, b;
    pull_counts(ports, &a);
    /* With the first token every leg pulls at least the block of the last prompt position
     * (the local cache never holds it): no token-only release. The second request's prompt
     * was cached: its whole blocks adopted here, only the block of its last positions
     * pulled. */
    ck_assert_int_eq(a.ok, 6);
    ck_assert_int_eq(a.released, 0);
    ck_assert_int_eq(a.first_used, 6);
    ck_assert_int_eq(a.first_ignored, 0);
    ck_assert_int_ge(a.adopted, 1);
    ck_assert_int_gt(a.pulled, 0);
    ck_assert_int_eq(a.received, a.sent); /* what moved, counted alike on both nodes */
    ck_assert_int_eq(a.received % a.pulled, 0);
    long long block_bytes = a.received / a.pulled;
    ck_assert_int_eq(block_bytes, metric(ports[1], "pagekv_kv_block_bytes"));
    /* A prompt that extends the first one: its cached blocks are adopted, only the new
     * ones move. */
    json_t *longer = json_deep_copy(reqs[0]);
    json_object_set_new(longer, "prompt",
                        json_string("The quick brown fox jumps over the lazy dog and keeps "
                                    "running far away, past the river and the old mill, until "
                                    "the evening comes and the stars are out"));
    disagg_equals_unified(ports, paths[0], longer, true);
    pull_counts(ports, &b);
    ck_assert_int_eq(b.ok, a.ok + 1);
    ck_assert_int_gt(b.adopted, a.adopted);
    ck_assert_int_gt(b.pulled, a.pulled);
    ck_assert_int_eq(b.received - a.received, (b.pulled - a.pulled) * block_bytes);
    ck_assert_int_eq(b.sent - a.sent, b.received - a.received);
    json_decref(longer);
    /* A prompt held whole, without the first token: the first request again moves at most
     * the partial block of its last positions (nothing, a token-only release, where they
     * end a block); the producer's pins are back at once (not at the lease's end). With
     * the first token it moves exactly the block of its last position. */
    leases_settle(ports[0], 7);
    long long n = disagg_equals_unified(ports, paths[0], reqs[0], false);
    long long moved = (n - 1) % 16 != 0;
    pull_counts(ports, &a);
    ck_assert_int_eq(a.released, b.released + !moved);
    ck_assert_int_eq(a.pulled, b.pulled + moved);
    ck_assert_int_eq(a.received, b.received + moved * block_bytes);
    ck_assert_int_eq(a.sent, b.sent + moved * block_bytes);
    ck_assert_int_eq(a.first_used, b.first_used);
    leases_settle(ports[0], 8);
    disagg_equals_unified(ports, paths[0], reqs[0], true);
    pull_counts(ports, &b);
    ck_assert_int_eq(b.pulled, a.pulled + 1);
    ck_assert_int_eq(b.released, a.released);
    ck_assert_int_eq(b.received, a.received + block_bytes);
    ck_assert_int_eq(b.first_used, a.first_used + 1);
    a = b;
    /* A first token that does not match the decode leg's sampling (another seed; a token
     * changed in transit) is ignored: the leg computes its last prompt position, and the
     * answer is the unified node's for the leg's own request. */
    for (int k = 0; k < 2; k++) {
        json_t *kt = prefill_leg(ports[0], paths[2], reqs[2]);
        json_t *dreq = json_deep_copy(reqs[2]);
        if (k == 0)
            json_object_set_new(dreq, "seed", json_integer(12));
        else
            json_object_set_new(json_object_get(kt, "pagekv_first"), "token",
                                json_integer((ts_ji(kt, "pagekv_first.token") + 1) % 32));
        leg_t u, d;
        leg_post(ports[2], paths[2], dreq, &u);
        decode_leg(ports[1], paths[2], dreq, kt, &d);
        ck_assert_int_eq(d.status, 200);
        ck_assert_str_eq(d.text, u.text);
        ck_assert_int_eq(d.cached, d.prompt - 1);
        json_decref(u.doc);
        json_decref(d.doc);
        json_decref(dreq);
        json_decref(kt);
    }
    pull_counts(ports, &b);
    ck_assert_int_eq(b.first_ignored, a.first_ignored + 2);
    ck_assert_int_eq(b.first_used, a.first_used);
    json_t *pk = kv_stats(ports[0]);
    ck_assert_int_eq(ts_ji(pk, "leases.sent"), 11);
    ck_assert_int_eq(ts_ji(pk, "leases.live") + ts_ji(pk, "leases.pinned_blocks"), 0);
    ck_assert_int_eq(ts_ji(pk, "transfers.released"), b.released); /* one for each */
    json_decref(pk);
    json_t *kv = kv_stats(ports[1]);
    ck_assert_int_eq(ts_ji(kv, "pulls.failed"), 0);
    ck_assert_int_eq(ts_ji(kv, "leases.pinned_blocks"), 0);
    /* one leg at a time: never two reads in flight, none left */
    ck_assert_int_eq(ts_ji(kv, "pulls.inflight"), 0);
    ck_assert_int_eq(ts_ji(kv, "pulls.inflight_peak"), 1);
    ck_assert_int_eq(metric(ports[1], "pagekv_kv_pulls_inflight_peak"), 1);
    ck_assert_int_eq(metric(ports[1], "pagekv_kv_pulls_inflight"), 0);
    json_decref(kv);
    leases_settle(ports[0], 11);
    /* Forged params are refused when nothing would move too: a wrong token (the producer
     * refuses the release), another engine id (no release is sent) and block ids that are
     * not the registration's (none is pulled: the release carries their digest), each 400
     * naming what is wrong, nothing submitted; the genuine params then release the lease. */
    json_t *kt = prefill_leg(ports[0], paths[0], reqs[0]);
    json_object_del(kt, "pagekv_first"); /* the held prompt's release, as above */
    json_t *st = ts_get_json("127.0.0.1", ports[1], "/v1/cache/stats");
    long long submitted = ts_ji(st, "requests.submitted");
    json_decref(st);
    const struct {
        const char *key, *value, *code, *param;
    } forged[] = {
        {"pagekv_token", "00000000000000000000000000000000", "rejected", "kv_transfer_params"},
        {"remote_engine_id", "pagekv-0123456789abcdef0123456789abcdef", "invalid_value",
         "kv_transfer_params.remote_engine_id"},
        {"pagekv_first", "not an object", "invalid_value", "kv_transfer_params.pagekv_first"},
    };
    for (size_t i = 0; i < PKV_ARRAY_LEN(forged); i++) {
        json_t *bad = json_deep_copy(kt);
        json_object_set_new(bad, forged[i].key, json_string(forged[i].value));
        leg_t d;
        decode_leg(ports[1], paths[0], reqs[0], bad, &d);
        json_decref(bad);
        ck_assert_int_eq(d.status, 400);
        ck_assert_str_eq(ts_js(d.doc, "error.code"), forged[i].code);
        ck_assert_str_eq(ts_js(d.doc, "error.param"), forged[i].param);
        json_decref(d.doc);
    }
    { /* a first token outside the vocabulary: malformed, whatever its check says */
        json_t *bad = json_deep_copy(kt);
        json_object_set_new(bad, "pagekv_first",
                            json_pack("{s:i, s:i, s:i}", "token", 1 << 30, "seed", 1, "check", 1));
        leg_t d;
        decode_leg(ports[1], paths[0], reqs[0], bad, &d);
        json_decref(bad);
        ck_assert_int_eq(d.status, 400);
        ck_assert_str_eq(ts_js(d.doc, "error.param"), "kv_transfer_params.pagekv_first");
        json_decref(d.doc);
    }
    /* A block id that is not the registration's, though the release names none: the
     * READ's digest of the whole list is refused (400 naming remote_block_ids). */
    for (size_t k = 0; k < json_array_size(ts_jp(kt, "remote_block_ids")); k++) {
        json_t *bad = json_deep_copy(kt), *ids = ts_jp(bad, "remote_block_ids");
        json_array_set_new(ids, k, json_integer(json_integer_value(json_array_get(ids, k)) + 1000));
        leg_t d;
        decode_leg(ports[1], paths[0], reqs[0], bad, &d);
        json_decref(bad);
        ck_assert_int_eq(d.status, 400);
        ck_assert_str_eq(ts_js(d.doc, "error.code"), "rejected");
        ck_assert_str_eq(ts_js(d.doc, "error.param"), "kv_transfer_params.remote_block_ids");
        json_decref(d.doc);
    }
    st = ts_get_json("127.0.0.1", ports[1], "/v1/cache/stats");
    ck_assert_int_eq(ts_ji(st, "requests.submitted"), submitted); /* nothing generated */
    json_decref(st);
    pk = kv_stats(ports[0]);
    ck_assert_int_eq(ts_ji(pk, "leases.live"), 1); /* the registration stays */
    json_decref(pk);
    leg_t d;
    decode_leg(ports[1], paths[0], reqs[0], kt, &d);
    ck_assert_int_eq(d.status, 200);
    json_decref(d.doc);
    json_decref(kt);
    leases_settle(ports[0], 12);
    wait_quiet(ports[1]);
    for (size_t i = 0; i < PKV_ARRAY_LEN(reqs); i++) json_decref(reqs[i]);
    for (int i = 0; i < 3; i++) pkv_server_destroy(s[i]);
}
END_TEST

/* A decode node's disk tier is its own cache: a prompt whose blocks it wrote after an
 * earlier decode leg, then dropped from memory, is loaded from its disk before the pull;
 * the pull adopts those blocks and moves only the rest, and the answer equals the unified
 * node's. */
START_TEST(decode_leg_adopts_its_disk_tier)
{
    char dir[] = "/dev/shm/pkv-test-server-XXXXXX", kvdir[64];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(kvdir, sizeof(kvdir), "%s/kv", dir);
    pkv_server_role_t roles[3] = {PKV_SERVER_ROLE_PREFILL, PKV_SERVER_ROLE_DECODE,
                                  PKV_SERVER_ROLE_UNIFIED};
    pkv_server_t *s[3];
    uint16_t ports[3];
    for (int i = 0; i < 3; i++) {
        pkv_server_config_t cfg = base_config();
        cfg.role = roles[i];
        cfg.kv_transfer_timeout_ms = 5000;
        if (i == 1) cfg.kv_disk_dir = kvdir, cfg.kv_disk_bytes = 64ull << 20;
        s[i] = start(cfg);
        ports[i] = pkv_server_port(s[i]);
    }
    const char *text = "A decode node keeps what it pulled on its own disk: the blocks of this "
                       "prompt, sixteen tokens each, come back from the files after its memory "
                       "was reset, and only the new ones move over the wire";
    json_t *req = json_pack("{s:s, s:s, s:i, s:f}", "model", "tiny", "prompt", text, "max_tokens",
                            8, "temperature", 0.0);
    disagg_equals_unified(ports, "/v1/completions", req, true);
    uint64_t deadline = pkv_deadline_after_ns(10ull * 1000000000);
    while (metric(ports[1], "pagekv_kv_tier_queued_blocks") != 0 ||
           metric(ports[1], "pagekv_kv_tier_blocks{tier=\"disk\"}") < 2) {
        ck_assert_msg(pkv_now_ns() < deadline, "the decode node's tier wrote nothing");
        usleep(10000);
    }
    wait_quiet(ports[1]);
    ts_resp_t r;
    http(ports[1], "POST", "/v1/cache/reset", "{}", &r);
    ck_assert_int_eq(r.status, 200);
    ts_resp_free(&r);
    pull_counts_t a, b;
    pull_counts(ports, &a);
    long long disk0 = metric(ports[1], "pagekv_kv_tier_hit_blocks_total{tier=\"disk\"}");
    char longer[512];
    snprintf(longer, sizeof(longer), "%s, and then some more words that no node has seen yet",
             text);
    json_object_set_new(req, "prompt", json_string(longer));
    disagg_equals_unified(ports, "/v1/completions", req, true);
    pull_counts(ports, &b);
    long long disk = metric(ports[1], "pagekv_kv_tier_hit_blocks_total{tier=\"disk\"}") - disk0;
    ck_assert_int_ge(disk, 2);
    ck_assert_int_eq(b.adopted - a.adopted, disk); /* what the disk gave, the pull adopted */
    ck_assert_int_gt(b.pulled, a.pulled);          /* and it read only the rest */
    ck_assert_int_eq(b.received - a.received,
                     (b.pulled - a.pulled) * metric(ports[1], "pagekv_kv_block_bytes"));
    ck_assert_int_eq(metric(ports[1], "pagekv_kv_tier_corrupt_total{tier=\"disk\"}"), 0);
    leases_settle(ports[0], 2);
    wait_quiet(ports[1]);
    json_decref(req);
    for (int i = 0; i < 3; i++) pkv_server_destroy(s[i]);
    pkv_test_rm_tree(dir);
}
END_TEST

/* A decode leg whose params are wrong or forged gets a 4xx naming the field and pulls
 * nothing from wrong KV; an unreachable producer is 503 peer_lost within the deadline;
 * the genuine params still work afterwards (the registration survived). */
START_TEST(decode_leg_bad_params)
{
    pkv_server_t *s[3];
    uint16_t ports[3];
    three_nodes(s, ports, 2000, false);
    json_t *req =
        json_pack("{s:s, s:s, s:i, s:f}", "model", "tiny", "prompt",
                  "The quick brown fox jumps over the lazy dog and keeps running far away",
                  "max_tokens", 8, "temperature", 0.0);
    const char *path = "/v1/completions";
    json_t *kt = prefill_leg(ports[0], path, req);
    ck_assert_uint_eq(json_array_size(ts_jp(kt, "remote_block_ids")), 2); /* as the cases assume */
    static const struct {
        const char *key;
        const char *json; /* the new value; NULL: removed */
        long status;
        const char *code, *param;
    } cases[] = {
        {"pagekv_token", "\"00000000000000000000000000000000\"", 400, "rejected",
         "kv_transfer_params"},
        {"pagekv_token", "\"xyz\"", 400, "invalid_value", "kv_transfer_params.pagekv_token"},
        {"pagekv_request_id", "987654", 400, "invalid_value",
         "kv_transfer_params.pagekv_request_id"},
        {"pagekv_serial", "99", 400, "invalid_value", "kv_transfer_params.pagekv_request_id"},
        {"pagekv_serial", NULL, 400, "missing_field", "kv_transfer_params.pagekv_serial"},
        {"pagekv_prompt_tokens", "3", 400, "invalid_value",
         "kv_transfer_params.pagekv_prompt_tokens"},
        {"pagekv_geometry",
         "{\"layers\": 99, \"kv_heads\": 2, \"head_dim\": 16, "
         "\"block_tokens\": 16, \"dtype\": \"f16\"}",
         400, "invalid_value", "kv_transfer_params.pagekv_geometry"},
        {"remote_block_ids", "[0]", 400, "invalid_value", "kv_transfer_params.remote_block_ids"},
        {"remote_block_ids", "[7, 9]", 400, "rejected", "kv_transfer_params.remote_block_ids"},
        {"remote_port", NULL, 400, "missing_field", "kv_transfer_params.remote_port"},
        {"remote_host", NULL, 400, "missing_field", "kv_transfer_params.remote_host"},
        {"remote_engine_id", "\"pagekv-00000000000000000000000000000000\"", 400, "invalid_value",
         "kv_transfer_params.remote_engine_id"},
        {"remote_engine_id", NULL, 400, "missing_field", "kv_transfer_params.remote_engine_id"},
    };
    for (size_t i = 0; i < PKV_ARRAY_LEN(cases); i++) {
        json_t *bad = json_deep_copy(kt);
        if (cases[i].json)
            ck_assert_int_eq(json_object_set_new(bad, cases[i].key,
                                                 json_loads(cases[i].json, JSON_DECODE_ANY, NULL)),
                             0);
        else
            json_object_del(bad, cases[i].key);
        leg_t d;
        decode_leg(ports[1], path, req, bad, &d);
        json_decref(bad);
        ck_assert_msg(d.status == cases[i].status, "case %zu: %ld", i, d.status);
        ck_assert_msg(!strcmp(ts_js(d.doc, "error.code"), cases[i].code), "case %zu: %s", i,
                      ts_js(d.doc, "error.code"));
        ck_assert_msg(!strcmp(ts_js(d.doc, "error.param"), cases[i].param), "case %zu: %s", i,
                      ts_js(d.doc, "error.param"));
        json_decref(d.doc);
    }
    /* The last block is never pulled (the engine computes the last prompt token): a forged
     * id there is refused all the same, by the READ's digest of the whole list. */
    {
        json_t *bad = json_deep_copy(kt), *ids = ts_jp(bad, "remote_block_ids");
        json_array_set_new(ids, 1, json_integer(json_integer_value(json_array_get(ids, 1)) + 1000));
        leg_t d;
        decode_leg(ports[1], path, req, bad, &d);
        json_decref(bad);
        ck_assert_int_eq(d.status, 400);
        ck_assert_str_eq(ts_js(d.doc, "error.code"), "rejected");
        ck_assert_str_eq(ts_js(d.doc, "error.param"), "kv_transfer_params.remote_block_ids");
        json_decref(d.doc);
        json_t *pk = kv_stats(ports[0]);
        ck_assert_int_eq(ts_ji(pk, "leases.live"), 1); /* the registration stays */
        json_decref(pk);
    }
    /* The KV under another prompt of the same length: refused before any read. */
    json_t *other = json_deep_copy(req), *other_ids = json_array();
    for (long long i = 0; i < ts_ji(kt, "pagekv_prompt_tokens"); i++)
        json_array_append_new(other_ids, json_integer(5 + i));
    json_object_set_new(other, "prompt", other_ids);
    leg_t d;
    decode_leg(ports[1], path, other, kt, &d);
    json_decref(other);
    ck_assert_int_eq(d.status, 400);
    ck_assert_str_eq(ts_js(d.doc, "error.param"), "kv_transfer_params.pagekv_request_id");
    json_decref(d.doc);
    /* Nobody listens at the producer's address: peer_lost, within the deadline + 1 s. */
    json_t *lost = json_deep_copy(kt);
    json_object_set_new(lost, "remote_port", json_integer(free_port()));
    uint64_t t0 = pkv_now_ns();
    decode_leg(ports[1], path, req, lost, &d);
    json_decref(lost);
    ck_assert_int_eq(d.status, 503);
    ck_assert_str_eq(ts_js(d.doc, "error.code"), "peer_lost");
    ck_assert_uint_lt(pkv_now_ns() - t0, 3000000000ull);
    json_decref(d.doc);
    json_t *dkv = kv_stats(ports[1]);
    ck_assert_int_eq(ts_ji(dkv, "pulls.ok"), 0);
    json_decref(dkv);
    json_t *st = ts_get_json("127.0.0.1", ports[1], "/v1/cache/stats");
    ck_assert_int_eq(ts_ji(st, "requests.submitted"), 0); /* nothing generated from wrong KV */
    ck_assert_int_eq(ts_ji(st, "blocks.cached"), 0);
    json_decref(st);
    /* The genuine params still pull and decode. */
    decode_leg(ports[1], path, req, kt, &d);
    ck_assert_int_eq(d.status, 200);
    json_decref(d.doc);
    leases_settle(ports[0], 1);
    json_decref(kt);
    json_decref(req);
    for (int i = 0; i < 3; i++) pkv_server_destroy(s[i]);
}
END_TEST

/* The pair as two `pagekv serve` processes (prefill with fixed staging, decode with a
 * transfer deadline), driven as a proxy does: answers equal an in-process unified
 * node's; both processes end 0 on SIGTERM with nothing pinned. */
START_TEST(disagg_across_processes)
{
    char bin[4096];
    ts_pagekv_path(bin, sizeof(bin));
    curl_global_init(CURL_GLOBAL_DEFAULT);
    launch_proc_t p, d;
    char pagent[PKV_XFER_ADDR_MAX], dagent[PKV_XFER_ADDR_MAX];
    char *pargv[] = {bin,      "serve",   "--port",    "0",     "--threads", "1",
                     "--role", "prefill", "--staging", "fixed", NULL};
    char *dargv[] = {bin,      "serve",     "--port",
                     "0",      "--threads", "1",
                     "--role", "decode",    "--kv-transfer-timeout-ms",
                     "3000",   NULL};
    role_child(&p, pargv, pagent, sizeof(pagent));
    role_child(&d, dargv, dagent, sizeof(dagent));
    pkv_server_t *u = start(base_config());
    uint16_t ports[3] = {p.port, d.port, pkv_server_port(u)};
    json_t *reqs[] = {
        json_pack("{s:s, s:s, s:i, s:f}", "model", "tiny", "prompt",
                  "Two processes, one answer: the prompt's KV crosses a socket from the prefill "
                  "node to the decode node, block by block, and the decode node goes on",
                  "max_tokens", 10, "temperature", 0.0),
        json_pack("{s:s, s:[{s:s, s:s}], s:i, s:f, s:i, s:b}", "model", "tiny", "messages", "role",
                  "user", "content",
                  "Stream the decode leg from the other process, whose pool got the prompt's "
                  "blocks over the transfer agent a moment ago",
                  "max_tokens", 10, "temperature", 0.8, "seed", 21, "stream", 1),
    };
    const char *paths[] = {"/v1/completions", "/v1/chat/completions"};
    for (size_t i = 0; i < PKV_ARRAY_LEN(reqs); i++) {
        disagg_equals_unified(ports, paths[i], reqs[i], i == 0);
        json_decref(reqs[i]);
    }
    leases_settle(p.port, 2);
    json_t *kv = kv_stats(d.port);
    ck_assert_int_eq(ts_ji(kv, "pulls.ok"), 2);
    ck_assert_int_gt(ts_ji(kv, "transfers.bytes_received"), 0);
    json_decref(kv);
    pkv_server_destroy(u);
    role_child_stop(&d);
    role_child_stop(&p);
}
END_TEST

/* --kv-load-failure recompute: a producer nobody can reach is answered by computing the
 * prompt here (equal to the unified answer, counted); a forged token is still the
 * client's 400; a request without params is computed here and counted. */
START_TEST(decode_leg_recompute_policy)
{
    pkv_server_t *s[3];
    uint16_t ports[3];
    three_nodes(s, ports, 1500, true);
    json_t *req = json_pack("{s:s, s:s, s:i, s:f}", "model", "tiny", "prompt",
                            "Recompute when the producer is gone, and say so in the counters",
                            "max_tokens", 8, "temperature", 0.0);
    const char *path = "/v1/completions";
    json_t *kt = prefill_leg(ports[0], path, req);
    leg_t u, d;
    leg_post(ports[2], path, req, &u);
    json_t *lost = json_deep_copy(kt);
    json_object_set_new(lost, "remote_port", json_integer(free_port()));
    decode_leg(ports[1], path, req, lost, &d);
    json_decref(lost);
    ck_assert_int_eq(d.status, 200);
    ck_assert_str_eq(d.text, u.text);
    ck_assert_str_eq(d.finish, u.finish);
    json_decref(d.doc);
    json_t *forged = json_deep_copy(kt);
    json_object_set_new(forged, "pagekv_token", json_string("00000000000000000000000000000000"));
    decode_leg(ports[1], path, req, forged, &d);
    json_decref(forged);
    ck_assert_int_eq(d.status, 400);
    ck_assert_str_eq(ts_js(d.doc, "error.code"), "rejected");
    json_decref(d.doc);
    leg_post(ports[1], path, req, &d); /* no params: computed here */
    ck_assert_int_eq(d.status, 200);
    ck_assert_str_eq(d.text, u.text);
    json_decref(d.doc);
    json_t *kv = kv_stats(ports[1]);
    ck_assert_int_eq(ts_ji(kv, "pulls.recomputed"), 1);
    ck_assert_int_eq(ts_ji(kv, "pulls.failed"), 2);
    ck_assert_int_eq(ts_ji(kv, "pulls.local"), 1);
    json_decref(kv);
    json_decref(u.doc);
    json_decref(kt);
    json_decref(req);
    for (int i = 0; i < 3; i++) pkv_server_destroy(s[i]);
}
END_TEST

/* ---- observability ----------------------------------------------------------------------------
 */

#define N_PHASES 10
static const char *const phase_names[N_PHASES] = {
    "prefill_queue", "prefill_compute", "lease_wait", "kv_alloc", "kv_commit",
    "handshake",     "staging_wait",    "wire",       "commit",   "decode"};

static long long phase_count(uint16_t port, const char *phase)
{
    char sample[96];
    snprintf(sample, sizeof(sample), "pagekv_kv_transfer_phase_seconds_count{phase=\"%s\"}", phase);
    return metric(port, sample);
}

/* One disaggregated request moves each phase's count by exactly one on the node where the
 * phase happens (and by none on the other); with X-Pagekv-Timings both legs' answers carry
 * their own phases; a bad header value is a 400. */
START_TEST(phases_move_by_one)
{
    pkv_server_t *s[3];
    uint16_t ports[3];
    three_nodes(s, ports, 5000, false);
    static const bool on_node[2][N_PHASES] = {{1, 1, 1, 0, 0, 0, 1, 1, 0, 0},
                                              {0, 0, 0, 1, 1, 1, 1, 1, 1, 1}};
    long long before[2][N_PHASES];
    for (int n = 0; n < 2; n++)
        for (int p = 0; p < N_PHASES; p++) before[n][p] = phase_count(ports[n], phase_names[p]);
    json_t *req = json_pack("{s:s, s:s, s:i, s:f}", "model", "tiny", "prompt",
                            "Every phase of one request, counted once where it happens: the "
                            "prompt spans several blocks, so the decode leg pulls the ones its "
                            "own prefix cache lacks and the producer serves them",
                            "max_tokens", 6, "temperature", 0.0);
    const char *path = "/v1/completions";
    json_t *pre = json_deep_copy(req);
    json_object_set_new(pre, "max_tokens", json_integer(1));
    json_object_set_new(pre, "kv_transfer_params",
                        json_pack("{s:b, s:b}", "do_remote_decode", 1, "do_remote_prefill", 0));
    http_extra_header = "X-Pagekv-Timings: 1";
    leg_t p, d;
    leg_post(ports[0], path, pre, &p);
    ck_assert_int_eq(p.status, 200);
    json_t *kt = ts_jp(p.doc, "kv_transfer_params");
    decode_leg(ports[1], path, req, kt, &d);
    http_extra_header = NULL;
    ck_assert_int_eq(d.status, 200);
    leases_settle(ports[0], 1);
    for (int n = 0; n < 2; n++)
        for (int k = 0; k < N_PHASES; k++)
            ck_assert_msg(phase_count(ports[n], phase_names[k]) - before[n][k] == on_node[n][k],
                          "node %d phase %s moved by %lld", n, phase_names[k],
                          phase_count(ports[n], phase_names[k]) - before[n][k]);
    /* Each answer's own phases: the prefill leg's engine phases, the decode leg's pull and
     * decode, with what the pull moved. */
    ck_assert_str_eq(ts_js(p.doc, "pagekv_timings.role"), "prefill");
    for (int k = 0; k < N_PHASES; k++) {
        char key[64];
        snprintf(key, sizeof(key), "pagekv_timings.phases_seconds.%s", phase_names[k]);
        bool pre_has = k <= 1, dec_has = on_node[1][k];
        ck_assert_msg((ts_jp(p.doc, key) != NULL) == pre_has, "prefill leg: %s", key);
        ck_assert_msg((ts_jp(d.doc, key) != NULL) == dec_has, "decode leg: %s", key);
        if (dec_has) ck_assert(json_real_value(ts_jp(d.doc, key)) >= 0);
    }
    /* the blocks of every prompt position (the leg took the prefill leg's first token) */
    long long n_prompt = ts_ji(kt, "pagekv_prompt_tokens");
    long long bt = ts_ji(kt, "pagekv_geometry.block_tokens");
    ck_assert_int_eq(ts_ji(d.doc, "pagekv_timings.kv_pulled_blocks"), (n_prompt + bt - 1) / bt);
    ck_assert_int_ge(ts_ji(d.doc, "pagekv_timings.kv_pulled_blocks"), 1);
    ck_assert_int_gt(ts_ji(d.doc, "pagekv_timings.kv_pulled_bytes"), 0);
    /* No timings unless asked. */
    leg_t plain;
    leg_post(ports[2], path, req, &plain);
    ck_assert_ptr_null(ts_jp(plain.doc, "pagekv_timings"));
    json_decref(plain.doc);
    /* Streamed: the last chunk carries them. */
    json_t *sreq = json_deep_copy(req);
    json_object_set_new(sreq, "stream", json_true());
    char *body = json_dumps(sreq, 0);
    http_extra_header = "X-Pagekv-Timings: true";
    ts_resp_t r;
    ck_assert_int_eq(http(ports[2], "POST", path, body, &r), CURLE_OK);
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strstr(r.body, "\"pagekv_timings\""));
    ts_resp_free(&r);
    http_extra_header = "X-Pagekv-Timings: maybe";
    ck_assert_int_eq(http(ports[2], "POST", path, body, &r), CURLE_OK);
    http_extra_header = NULL;
    ck_assert_int_eq(r.status, 400);
    ck_assert_ptr_nonnull(strstr(r.body, "X-Pagekv-Timings"));
    ts_resp_free(&r);
    free(body);
    json_decref(sreq);
    ck_assert_int_eq(http(ports[1], "GET", "/metrics", NULL, &r), CURLE_OK);
    ck_assert_int_gt(prom_check(r.body), 40); /* the phase histograms parse */
    ts_resp_free(&r);
    /* The unified node has no transfer families. */
    ck_assert_int_eq(http(ports[2], "GET", "/metrics", NULL, &r), CURLE_OK);
    ck_assert_ptr_null(strstr(r.body, "pagekv_kv_transfer_phase_seconds"));
    ts_resp_free(&r);
    json_decref(p.doc);
    json_decref(d.doc);
    json_decref(pre);
    json_decref(req);
    for (int i = 0; i < 3; i++) pkv_server_destroy(s[i]);
}
END_TEST

/* /health is 503 while the agent's progress thread is stuck (a fault site holds its loop
 * 4 s) and 200 again once it runs. */
START_TEST(health_503_while_agent_stalls)
{
    pkv_server_config_t cfg = base_config();
    cfg.role = PKV_SERVER_ROLE_DECODE;
    pkv_server_t *s = start(cfg);
    uint16_t port = pkv_server_port(s);
    ts_resp_t r;
    ck_assert_int_eq(http(port, "GET", "/health", NULL, &r), CURLE_OK);
    ck_assert_int_eq(r.status, 200);
    ts_resp_free(&r);
    ck_assert_int_eq(metric(port, "pagekv_kv_agent_up"), 1);
    pkv_fault_arm(PKV_FAULT_XFER_STALL, 0, 40);
    uint64_t t0 = pkv_now_ns();
    bool seen_503 = false;
    while (pkv_now_ns() - t0 < 10000000000ull) {
        ck_assert_int_eq(http(port, "GET", "/health", NULL, &r), CURLE_OK);
        bool down = r.status == 503;
        if (down) {
            ck_assert_ptr_nonnull(strstr(r.body, "\"kv_agent\":\"down\""));
            seen_503 = true;
        }
        ts_resp_free(&r);
        if (down) {
            /* The held loop is one episode: a metric read between two 503s was read while
             * the agent was down (one after the episode ended proves nothing). */
            long long up = metric(port, "pagekv_kv_agent_up");
            ck_assert_int_eq(http(port, "GET", "/health", NULL, &r), CURLE_OK);
            bool still = r.status == 503;
            ts_resp_free(&r);
            if (still && up != 0) ck_abort_msg("agent_up while 503");
        }
        if (seen_503 && !down) break;
        usleep(50000);
    }
    ck_assert_msg(seen_503, "/health never went 503 while the progress loop was held");
    ck_assert_int_eq(pkv_fault_fired(PKV_FAULT_XFER_STALL), 40);
    ck_assert_int_eq(http(port, "GET", "/health", NULL, &r), CURLE_OK);
    ck_assert_int_eq(r.status, 200); /* back */
    ts_resp_free(&r);
    pkv_fault_disarm_all();
    pkv_server_destroy(s);
}
END_TEST

static Suite *server_suite(void)
{
    Suite *s = suite_create("server");
    TCase *tc = tcase_create("http");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, completions_and_chat);
    tcase_add_test(tc, streaming_matches_non_streaming);
    tcase_add_test(tc, dense_backend_same_text);
    tcase_add_test(tc, hugepages_asked_and_measured);
    tcase_add_test(tc, eight_concurrent_requests);
    tcase_add_test(tc, prefix_hit_reported);
    tcase_add_test(tc, errors_change_nothing);
    tcase_add_test(tc, prompt_never_fits_budget);
    tcase_add_test(tc, disconnect_mid_stream_frees_sequence);
    tcase_add_test(tc, queue_full_gets_429);
    tcase_add_test(tc, metrics_parse_as_prometheus);
    tcase_add_test(tc, llama2c_checkpoint_serves);
    tcase_add_test(tc, cli_rejects_bad_flags);
    tcase_add_test(tc, sigterm_drains_in_flight);
    suite_add_tcase(s, tc);
    TCase *roles = tcase_create("roles");
    tcase_set_timeout(roles, 120);
    tcase_add_test(roles, roles_cli_rejects_bad_values);
    tcase_add_test(roles, roles_health_and_agent_address);
    tcase_add_test(roles, roles_health_503_while_draining);
    tcase_add_test(roles, prefill_leg_answer_and_lease_expiry);
    tcase_add_test(roles, kv_transfer_params_refused_by_role_and_shape);
    tcase_add_test(roles, decode_leg_equals_unified);
    tcase_add_test(roles, decode_leg_adopts_its_disk_tier);
    tcase_add_test(roles, decode_leg_bad_params);
    tcase_add_test(roles, disagg_across_processes);
    tcase_add_test(roles, decode_leg_recompute_policy);
    tcase_add_test(roles, phases_move_by_one);
    tcase_add_test(roles, health_503_while_agent_stalls);
    suite_add_tcase(s, roles);
    TCase *pure = tcase_create("pure");
    tcase_add_test(pure, gen_finish_and_figures);
    tcase_add_test(pure, utf8_sanitize_piecewise_equals_whole);
    suite_add_tcase(s, pure);
    return s;
}

PKV_TEST_MAIN(server_suite)
