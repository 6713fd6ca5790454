/*
 * router: `pagekv route` as a child process in front of `pagekv serve --role prefill|decode`
 * children, driven over real HTTP (libcurl), answers compared with a unified node in this
 * process. Parity (completions and chat, streamed and not, greedy and seeded, 8 at once),
 * X-Request-Id in both nodes' logs, round robin over two and two nodes, cache_aware to
 * the prefill node holding the prefix (and /v1/cache/lookup itself, per tenant), killed
 * and stopped nodes skipped, a lost producer re-running both legs, no node of a role
 * (503), a decode node killed mid-stream (an error event ends the stream), SIGTERM
 * draining, bad input answered as serve answers it with no node called, 1,000 concurrent
 * streams (count and the router's VmRSS), the connection limit's 503, a slow client's
 * paused stream, the OpenAI Node SDK's calls (when node and npm are there), the
 * lookup's count (pkv_kv_prefix_match) against what admission adopts, and nodes of
 * different KV formats refused at the router's start.
 */
#include "tests/fuzz/props.h"
#include "tests/support/srvtest.h"
#include "tests/support/testutil.h"

#include "support/http.h"

#include "kv/kv.h"
#include "pagekv/kv.h"
#include "pagekv/server.h"

#include <curl/curl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#define SEC 1000000000ull

/* ---- HTTP ------------------------------------------------------------------------------- */

/* One request to this host's port through srvtest's client (body NULL: none; xrid NULL:
 * no X-Request-Id), within 60 s. */
static CURLcode http(uint16_t port, const char *method, const char *path, const char *body,
                     const char *xrid, ts_resp_t *r)
{
    char xh[200];
    if (xrid) snprintf(xh, sizeof(xh), "X-Request-Id: %s", xrid);
    return ts_http("127.0.0.1", port, method, path, body, xrid ? xh : NULL, 60, r);
}

/* The value of a Prometheus sample line "NAME{LABELS} V" (exact prefix), -1 if absent. */
static long long metric(uint16_t port, const char *sample)
{
    ts_resp_t r;
    if (http(port, "GET", "/metrics", NULL, NULL, &r) != CURLE_OK || r.status != 200) {
        ts_resp_free(&r);
        return -1;
    }
    long long v = -1;
    size_t n = strlen(sample);
    for (const char *p = r.body; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncmp(p, sample, n) && p[n] == ' ') {
            v = atoll(p + n + 1);
            break;
        }
    ts_resp_free(&r);
    return v;
}

/* ---- answers ------------------------------------------------------------------------------- */

typedef struct {
    long status;
    char text[65536];
    char finish[16];
    long long prompt, completion;
    bool done;        /* streamed: [DONE] came */
    bool error_event; /* streamed: an error event came */
    int events;
    char xrid[160]; /* the answer's X-Request-Id header */
    char body[1024];
} answer_t;

static void sse_take(const char *body, size_t len, bool chat, answer_t *a)
{
    size_t i = 0;
    while (i < len) {
        const char *end = strstr(body + i, "\n\n");
        ck_assert_msg(end != NULL, "unterminated SSE event at %zu: %.80s", i, body + i);
        size_t elen = (size_t)(end - (body + i));
        ck_assert_msg(elen > 6 && !strncmp(body + i, "data: ", 6), "bad SSE line: %.60s", body + i);
        ck_assert_msg(!a->done, "event after [DONE]");
        if (elen == 12 && !strncmp(body + i + 6, "[DONE]", 6)) {
            a->done = true;
        } else {
            json_t *ev = json_loadb(body + i + 6, elen - 6, 0, NULL);
            ck_assert_msg(ev != NULL, "event is not JSON: %.*s", (int)elen, body + i);
            a->events++;
            if (json_object_get(ev, "error")) a->error_event = true;
            json_t *ch = ts_jp(ev, "choices.0");
            json_t *t =
                ch ? (chat ? ts_jp(ch, "delta.content") : json_object_get(ch, "text")) : NULL;
            if (json_is_string(t)) {
                size_t k = strlen(a->text);
                snprintf(a->text + k, sizeof(a->text) - k, "%s", json_string_value(t));
            }
            json_t *f = ch ? json_object_get(ch, "finish_reason") : NULL;
            if (json_is_string(f))
                snprintf(a->finish, sizeof(a->finish), "%s", json_string_value(f));
            json_t *u = json_object_get(ev, "usage");
            if (json_is_object(u)) {
                a->prompt = ts_ji(u, "prompt_tokens");
                a->completion = ts_ji(u, "completion_tokens");
            }
            json_decref(ev);
        }
        i += elen + 2;
    }
}

static void header_value(const char *headers, const char *name, char *out, size_t n)
{
    out[0] = 0;
    size_t k = strlen(name);
    for (const char *p = headers; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncasecmp(p, name, k) && p[k] == ':') {
            const char *v = p + k + 1;
            while (*v == ' ') v++;
            size_t m = strcspn(v, "\r\n");
            snprintf(out, n, "%.*s", (int)PKV_MIN(m, n - 1), v);
            return;
        }
}

/* POST req to path on port and take its answer apart. */
static void ask(uint16_t port, const char *path, json_t *req, const char *xrid, answer_t *a)
{
    memset(a, 0, sizeof(*a));
    bool chat = strstr(path, "chat") != NULL;
    bool stream = json_is_true(json_object_get(req, "stream"));
    char *body = json_dumps(req, JSON_COMPACT);
    ts_resp_t r;
    CURLcode cc = http(port, "POST", path, body, xrid, &r);
    free(body);
    ck_assert_msg(cc == CURLE_OK, "curl: %s", curl_easy_strerror(cc));
    a->status = r.status;
    header_value(r.headers, "X-Request-Id", a->xrid, sizeof(a->xrid));
    snprintf(a->body, sizeof(a->body), "%s", r.body ? r.body : "");
    if (stream && r.status == 200) {
        sse_take(r.body ? r.body : "", r.len, chat, a);
    } else if (r.status == 200) {
        json_t *doc = json_loadb(r.body, r.len, 0, NULL);
        ck_assert_ptr_nonnull(doc);
        json_t *t = ts_jp(doc, chat ? "choices.0.message.content" : "choices.0.text");
        snprintf(a->text, sizeof(a->text), "%s", json_string_value(t));
        snprintf(a->finish, sizeof(a->finish), "%s",
                 json_string_value(ts_jp(doc, "choices.0.finish_reason")));
        a->prompt = ts_ji(doc, "usage.prompt_tokens");
        a->completion = ts_ji(doc, "usage.completion_tokens");
        json_decref(doc);
    }
    ts_resp_free(&r);
}

static void same_answer(const answer_t *got, const answer_t *want, const char *what)
{
    ck_assert_msg(got->status == 200, "%s: status %ld: %s", what, got->status, got->body);
    ck_assert_msg(!strcmp(got->text, want->text), "%s: text differs:\n%s\n%s", what, got->text,
                  want->text);
    ck_assert_str_eq(got->finish, want->finish);
    ck_assert_int_eq(got->prompt, want->prompt);
    ck_assert_int_eq(got->completion, want->completion);
    ck_assert_int_eq(got->done, want->done);
    ck_assert(!got->error_event);
}

/* ---- processes (srvtest's, over support/launch.h) -------------------------------------------- */

static int count_in(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

static int log_count(const launch_proc_t *p, const char *needle)
{
    char *log = ts_proc_log(p);
    int n = count_in(log, needle);
    free(log);
    return n;
}

static char BIN[4096];
static char *const LOG_INFO[] = {"PKV_LOG=info", NULL};

/* A `pagekv serve --role ROLE` child; extra: more arguments (NULL-terminated) or NULL. */
static void node_start(launch_proc_t *p, const char *role, const char *const *extra)
{
    char *argv[40] = {BIN, "serve", "--port", "0", "--threads", "1", "--role", (char *)role};
    int n = 8;
    for (; extra && *extra; extra++) argv[n++] = (char *)*extra;
    argv[n] = NULL;
    ts_proc_start(p, argv, LOG_INFO, "pagekv serve: listening on ", false);
}

/* A `pagekv route` child over the nodes; extra arguments as above. */
static void router_start(launch_proc_t *rt, const launch_proc_t *pre, int np,
                         const launch_proc_t *dec, int nd, const char *const *extra)
{
    char *argv[64] = {BIN, "route", "--port", "0"};
    int n = 4;
    for (int i = 0; i < np + nd; i++) {
        const launch_proc_t *node = i < np ? &pre[i] : &dec[i - np];
        argv[n++] = i < np ? "--prefill" : "--decode";
        argv[n++] = (char *)node->url;
    }
    for (; extra && *extra; extra++) argv[n++] = (char *)*extra;
    argv[n] = NULL;
    ts_proc_start(rt, argv, LOG_INFO, "pagekv route: listening on ", false);
}

/* Wait for the router's /health to answer `want`. */
static void health_is(uint16_t port, long want)
{
    if (getenv("PKV_TEST_DEBUG")) fprintf(stderr, "health_is port %u\n", port);
    uint64_t deadline = pkv_deadline_after_ns(15 * SEC);
    for (;;) {
        ts_resp_t r;
        http(port, "GET", "/health", NULL, NULL, &r);
        long st = r.status;
        ts_resp_free(&r);
        if (st == want) return;
        if (pkv_now_ns() >= deadline && getenv("PKV_TEST_DEBUG")) sleep(600);
        ck_assert_msg(pkv_now_ns() < deadline, "/health stayed %ld (want %ld)", st, want);
        usleep(20000);
    }
}

static pkv_server_t *unified(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
    pkv_server_config_t cfg = {.threads = 1, .kv_dtype = PKV_DTYPE_F16};
    pkv_server_t *s = NULL;
    ck_assert_int_eq(pkv_server_create(&cfg, &s), PKV_OK);
    return s;
}

static json_t *completion_req(const char *prompt, int max_tokens, bool stream, int seed)
{
    json_t *r = json_pack("{s:s, s:s, s:i, s:b}", "model", "tiny", "prompt", prompt, "max_tokens",
                          max_tokens, "stream", (int)stream);
    if (seed >= 0) {
        json_object_set_new(r, "temperature", json_real(0.9));
        json_object_set_new(r, "seed", json_integer(seed));
    } else {
        json_object_set_new(r, "temperature", json_real(0));
    }
    return r;
}

static json_t *chat_req(const char *content, int max_tokens, bool stream, int seed)
{
    json_t *r =
        json_pack("{s:s, s:[{s:s, s:s}], s:i, s:b}", "model", "tiny", "messages", "role", "user",
                  "content", content, "max_tokens", max_tokens, "stream", (int)stream);
    if (seed >= 0) {
        json_object_set_new(r, "temperature", json_real(0.9));
        json_object_set_new(r, "seed", json_integer(seed));
    } else {
        json_object_set_new(r, "temperature", json_real(0));
    }
    return r;
}

static void setup(void)
{
    ts_pagekv_path(BIN, sizeof(BIN));
    curl_global_init(CURL_GLOBAL_DEFAULT);
}

/* ---- parity ------------------------------------------------------------------------------- */

typedef struct {
    uint16_t router, unified;
    json_t *req;
    const char *path;
    char xrid[64];
} par_case_t;

static void *par_main(void *arg)
{
    par_case_t *c = arg;
    answer_t *got = malloc(sizeof(*got)), *want = malloc(sizeof(*want));
    ask(c->unified, c->path, c->req, NULL, want);
    ask(c->router, c->path, c->req, c->xrid, got);
    same_answer(got, want, c->path);
    ck_assert_str_eq(got->xrid, c->xrid);
    free(got);
    free(want);
    return NULL;
}

/* Completions and chat, streamed and not, greedy and seeded, one by one and 8 at once:
 * every answer equals the unified node's; X-Request-Id reaches both nodes' logs (the
 * client's, or one the router made up and answers with). */
START_TEST(answers_equal_unified)
{
    launch_proc_t p, d, rt;
    node_start(&p, "prefill", NULL);
    node_start(&d, "decode", NULL);
    router_start(&rt, &p, 1, &d, 1, NULL);
    pkv_server_t *u = unified();
    health_is(rt.port, 200);
    par_case_t cases[8];
    pthread_t th[8];
    for (int i = 0; i < 8; i++) {
        char text[128];
        snprintf(text, sizeof(text), "Case %d: the router sends two legs and relays one answer", i);
        bool chat = i & 1, stream = i & 2;
        int seed = i & 4 ? 11 + i : -1;
        cases[i] = (par_case_t){.router = rt.port, .unified = pkv_server_port(u)};
        cases[i].req =
            chat ? chat_req(text, 12, stream, seed) : completion_req(text, 12, stream, seed);
        cases[i].path = chat ? "/v1/chat/completions" : "/v1/completions";
        snprintf(cases[i].xrid, sizeof(cases[i].xrid), "parity-%d", i);
    }
    for (int i = 0; i < 8; i++) par_main(&cases[i]); /* one at a time */
    for (int i = 0; i < 8; i++) snprintf(cases[i].xrid, sizeof(cases[i].xrid), "conc-%d", i);
    for (int i = 0; i < 8; i++) pthread_create(&th[i], NULL, par_main, &cases[i]);
    for (int i = 0; i < 8; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 8; i++) {
        char line[80];
        snprintf(line, sizeof(line), "(prefill leg), X-Request-Id %s\n", cases[i].xrid);
        ck_assert_int_eq(log_count(&p, line), 1);
        snprintf(line, sizeof(line), "(decode leg), X-Request-Id %s\n", cases[i].xrid);
        ck_assert_int_eq(log_count(&d, line), 1);
        json_decref(cases[i].req);
    }
    /* No X-Request-Id: the router makes one, answers with it and sends it to both legs. */
    json_t *req = completion_req("No request id given", 4, false, -1);
    answer_t *a = malloc(sizeof(*a));
    ask(rt.port, "/v1/completions", req, NULL, a);
    ck_assert_int_eq(a->status, 200);
    ck_assert_uint_gt(strlen(a->xrid), 0);
    char line[200];
    snprintf(line, sizeof(line), "X-Request-Id %s\n", a->xrid);
    ck_assert_int_eq(log_count(&p, line), 1);
    ck_assert_int_eq(log_count(&d, line), 1);
    free(a);
    json_decref(req);
    /* /v1/models comes from the nodes. */
    ts_resp_t r;
    http(rt.port, "GET", "/v1/models", NULL, NULL, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strstr(r.body, "\"id\":\"tiny\""));
    ts_resp_free(&r);
    http(rt.port, "GET", "/v1/models/tiny", NULL, NULL, &r);
    ck_assert_int_eq(r.status, 200);
    ts_resp_free(&r);
    ck_assert_int_eq(metric(rt.port, "pagekv_router_leg_seconds_count{role=\"prefill\"}"), 17);
    ck_assert_int_eq(metric(rt.port, "pagekv_router_leg_seconds_count{role=\"decode\"}"), 17);
    pkv_server_destroy(u);
    ck_assert_int_eq(ts_proc_stop(&rt, 30), 0);
    ts_proc_stop(&d, 30);
    ts_proc_stop(&p, 30);
}
END_TEST

/* ---- routing ------------------------------------------------------------------------------- */

START_TEST(round_robin_spreads)
{
    launch_proc_t p[2], d[2], rt;
    for (int i = 0; i < 2; i++) node_start(&p[i], "prefill", NULL);
    for (int i = 0; i < 2; i++) node_start(&d[i], "decode", NULL);
    const char *extra[] = {"--policy", "round_robin", NULL};
    router_start(&rt, p, 2, d, 2, extra);
    health_is(rt.port, 200);
    for (int i = 0; i < 8; i++) {
        json_t *req = completion_req("Round and round", 3, i & 1, -1);
        answer_t *a = malloc(sizeof(*a));
        ask(rt.port, "/v1/completions", req, NULL, a);
        ck_assert_int_eq(a->status, 200);
        free(a);
        json_decref(req);
    }
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(log_count(&p[i], "(prefill leg)"), 4);
        ck_assert_int_eq(log_count(&d[i], "(decode leg)"), 4);
    }
    ts_proc_stop(&rt, 30);
    for (int i = 0; i < 2; i++) ts_proc_stop(&p[i], 30), ts_proc_stop(&d[i], 30);
}
END_TEST

static const char *LONG_PREFIX =
    "You are the assistant of a long shared system prompt, long enough to fill several KV "
    "blocks of sixteen tokens each, so that a prefill node that served it once holds its "
    "prefix and a cache-aware router sends the next request with it there. ";

/* /v1/cache/lookup itself (per tenant), then cache_aware sending a request whose prefix
 * one of two prefill nodes holds to that node. */
START_TEST(cache_aware_finds_the_prefix)
{
    launch_proc_t p[2], d, rt;
    for (int i = 0; i < 2; i++) node_start(&p[i], "prefill", NULL);
    node_start(&d, "decode", NULL);
    router_start(&rt, p, 2, &d, 1, NULL);
    health_is(rt.port, 200);
    char prompt[1024];
    snprintf(prompt, sizeof(prompt), "%sQuestion one.", LONG_PREFIX);
    /* Warm p[1] directly (a plain request on a prefill node is served as any). */
    json_t *req = completion_req(prompt, 2, false, -1);
    answer_t *a = malloc(sizeof(*a));
    ask(p[1].port, "/v1/completions", req, NULL, a);
    ck_assert_int_eq(a->status, 200);
    /* The lookup: p[1] holds whole blocks of it, p[0] nothing, another tenant nothing. */
    char *body = json_dumps(req, JSON_COMPACT);
    ts_resp_t r;
    http(p[1].port, "POST", "/v1/cache/lookup", body, NULL, &r);
    ck_assert_int_eq(r.status, 200);
    json_t *doc = json_loads(r.body, 0, NULL);
    long long matched = ts_ji(doc, "matched_tokens"), prompt_tokens = ts_ji(doc, "prompt_tokens");
    ck_assert_int_eq(prompt_tokens, a->prompt);
    ck_assert_int_eq(matched, (prompt_tokens - 1) / 16 * 16);
    ck_assert_int_gt(matched, 32);
    json_decref(doc);
    ts_resp_free(&r);
    free(body);
    http(p[0].port, "POST", "/v1/cache/lookup", "{\"model\":\"tiny\",\"prompt\":\"abc\"}", NULL,
         &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strstr(r.body, "\"matched_tokens\":0"));
    ts_resp_free(&r);
    json_t *other = json_deep_copy(req);
    json_object_set_new(other, "cache_salt", json_string("tenant-b"));
    body = json_dumps(other, JSON_COMPACT);
    http(p[1].port, "POST", "/v1/cache/lookup", body, NULL, &r);
    ck_assert_ptr_nonnull(strstr(r.body, "\"matched_tokens\":0"));
    ts_resp_free(&r);
    free(body);
    json_decref(other);
    http(p[1].port, "POST", "/v1/cache/lookup", "{\"model\":\"tiny\"}", NULL, &r);
    ck_assert_int_eq(r.status, 400);
    ts_resp_free(&r);
    json_decref(req);
    /* Through the router: every request with the prefix goes to p[1]. */
    for (int i = 0; i < 3; i++) {
        snprintf(prompt, sizeof(prompt), "%sQuestion %d, streamed or not.", LONG_PREFIX, i + 2);
        req = completion_req(prompt, 4, i > 0, i == 2 ? 5 : -1);
        ask(rt.port, "/v1/completions", req, NULL, a);
        ck_assert_msg(a->status == 200, "%s", a->body);
        json_decref(req);
    }
    ck_assert_int_eq(log_count(&p[1], "(prefill leg)"), 3);
    ck_assert_int_eq(log_count(&p[0], "(prefill leg)"), 0);
    ck_assert_int_ge(metric(rt.port, "pagekv_router_lookups_total"), 6);
    /* The holder stopped: its lookup gets no answer within --lookup-timeout-ms (or its
     * probe marked it down first), the other node serves the request. */
    ts_proc_freeze(p[1].pid);
    snprintf(prompt, sizeof(prompt), "%sQuestion five, holder stopped.", LONG_PREFIX);
    req = completion_req(prompt, 4, true, -1);
    uint64_t t0 = pkv_now_ns();
    ask(rt.port, "/v1/completions", req, NULL, a);
    ck_assert_msg(a->status == 200 && a->done, "%ld %s", a->status, a->body);
    if (pkv_now_ns() - t0 >= 10 * SEC && getenv("PKV_TEST_DEBUG")) {
        char *log = ts_proc_log(&rt);
        fprintf(stderr, "p0 %u p1 %u router log:\n%s\n", p[0].port, p[1].port, log);
        free(log);
    }
    ck_assert_uint_lt(pkv_now_ns() - t0, 10 * SEC);
    ck_assert_int_eq(log_count(&p[0], "(prefill leg)"), 1);
    json_decref(req);
    kill(p[1].pid, SIGCONT);
    free(a);
    ts_proc_stop(&rt, 30);
    ts_proc_stop(&d, 30);
    for (int i = 0; i < 2; i++) ts_proc_stop(&p[i], 30);
}
END_TEST

/* ---- failures ------------------------------------------------------------------------------ */

/* The lookup's two counts on a node for body: tokens in memory and on disk. */
static void lookup_counts(uint16_t port, const char *body, long long *mem, long long *disk)
{
    ts_resp_t r;
    http(port, "POST", "/v1/cache/lookup", body, NULL, &r);
    ck_assert_msg(r.status == 200, "%ld %s", r.status, r.body);
    json_t *doc = json_loads(r.body, 0, NULL);
    *mem = ts_ji(doc, "matched_tokens");
    *disk = ts_ji(doc, "disk_matched_tokens");
    json_decref(doc);
    ts_resp_free(&r);
}

/* Wait (10 s at most) until a node's disk tier has written everything queued. */
static void tier_written(uint16_t port)
{
    uint64_t end = pkv_now_ns() + 10 * SEC;
    while (metric(port, "pagekv_kv_tier_queued_blocks") != 0 ||
           metric(port, "pagekv_kv_tier_blocks{tier=\"disk\"}") < 2) {
        ck_assert_msg(pkv_now_ns() < end, "the disk tier did not write the prefix");
        usleep(20000);
    }
}

/* cache_aware with disk tiers: of two prefill nodes holding a prefix, one in memory and the
 * other only on disk (its memory reset after the write), the lookup reports the disk holder's
 * tokens as disk_matched_tokens and the router sends the request to the memory holder; then
 * the two swap (the disk holder loads it back, the other drops its memory). */
START_TEST(cache_aware_prefers_memory_to_disk)
{
    char dirs[2][64];
    launch_proc_t p[2], d, rt;
    for (int i = 0; i < 2; i++) {
        snprintf(dirs[i], sizeof(dirs[i]), "/tmp/pkv-test-router-XXXXXX");
        ck_assert_ptr_nonnull(mkdtemp(dirs[i]));
        const char *extra[] = {"--kv-disk-dir", dirs[i], "--kv-disk-bytes", "64M", NULL};
        node_start(&p[i], "prefill", extra);
    }
    node_start(&d, "decode", NULL);
    router_start(&rt, p, 2, &d, 1, NULL);
    health_is(rt.port, 200);
    char prompt[1024];
    snprintf(prompt, sizeof(prompt), "%sQuestion one.", LONG_PREFIX);
    json_t *req = completion_req(prompt, 2, false, -1);
    char *body = json_dumps(req, JSON_COMPACT);
    answer_t *a = malloc(sizeof(*a));
    for (int i = 0; i < 2; i++) {
        ask(p[i].port, "/v1/completions", req, NULL, a);
        ck_assert_int_eq(a->status, 200);
        tier_written(p[i].port);
    }
    int legs[2] = {0, 0};
    for (int round = 0; round < 2; round++) {
        int mem = round == 0 ? 1 : 0, dsk = 1 - mem;
        if (round == 1) { /* the disk holder of round 0 loads the prefix back into memory */
            ask(p[mem].port, "/v1/completions", req, NULL, a);
            ck_assert_int_eq(a->status, 200);
        }
        ts_resp_t r;
        http(p[dsk].port, "POST", "/v1/cache/reset", "{}", NULL, &r);
        ck_assert_msg(r.status == 200, "%ld %s", r.status, r.body);
        ts_resp_free(&r);
        long long mm, md, dm, dd;
        lookup_counts(p[mem].port, body, &mm, &md);
        lookup_counts(p[dsk].port, body, &dm, &dd);
        ck_assert_int_gt(mm, 32);
        ck_assert_int_eq(md, 0);
        ck_assert_int_eq(dm, 0);
        ck_assert_int_eq(dd, mm);
        for (int i = 0; i < 2; i++) {
            char q[1024];
            snprintf(q, sizeof(q), "%sQuestion %d of round %d.", LONG_PREFIX, i + 2, round);
            json_t *qr = completion_req(q, 2, i == 1, -1);
            ask(rt.port, "/v1/completions", qr, NULL, a);
            ck_assert_msg(a->status == 200, "%s", a->body);
            json_decref(qr);
        }
        legs[mem] += 2;
        ck_assert_int_eq(log_count(&p[mem], "(prefill leg)"), legs[mem]);
        ck_assert_int_eq(log_count(&p[dsk], "(prefill leg)"), legs[dsk]);
    }
    free(a);
    free(body);
    json_decref(req);
    ts_proc_stop(&rt, 30);
    ts_proc_stop(&d, 30);
    for (int i = 0; i < 2; i++) {
        ts_proc_stop(&p[i], 30);
        pkv_test_rm_tree(dirs[i]);
    }
}
END_TEST

static void ask_ok_within(uint16_t port, uint64_t bound_ns, const char *what)
{
    json_t *req = completion_req("Skip the node that is gone", 3, true, -1);
    answer_t *a = malloc(sizeof(*a));
    uint64_t t0 = pkv_now_ns();
    ask(port, "/v1/completions", req, NULL, a);
    uint64_t took = pkv_now_ns() - t0;
    ck_assert_msg(a->status == 200 && a->done, "%s: %ld %s", what, a->status, a->body);
    ck_assert_msg(took < bound_ns, "%s: took %.1f s", what, (double)took / 1e9);
    free(a);
    json_decref(req);
}

/* A killed prefill node, a stopped decode node: skipped within the deadline; a producer
 * nobody can reach (peer_lost): both legs again elsewhere; no decode node left: 503. */
START_TEST(dead_and_stopped_nodes_skipped)
{
    launch_proc_t p[3], d[2], rt;
    for (int i = 0; i < 2; i++) node_start(&p[i], "prefill", NULL);
    /* p[2] advertises an address where nothing listens: its decode legs fail peer_lost. */
    const char *bad[] = {"--kv-advertise", "127.0.0.2", NULL};
    node_start(&p[2], "prefill", bad);
    const char *fast[] = {"--kv-transfer-timeout-ms", "2000", NULL};
    for (int i = 0; i < 2; i++) node_start(&d[i], "decode", fast);
    const char *extra[] = {"--policy",
                           "round_robin",
                           "--node-timeout-ms",
                           "1500",
                           "--request-timeout-ms",
                           "8000",
                           "--health-interval-ms",
                           "200",
                           NULL};
    router_start(&rt, p, 3, d, 2, extra);
    health_is(rt.port, 200);
    /* Three requests: one of them starts on p[2], is lost and runs again on another. */
    for (int i = 0; i < 3; i++) ask_ok_within(rt.port, 8 * SEC, "peer lost");
    ck_assert_int_ge(metric(rt.port, "pagekv_router_retries_total{cause=\"peer_lost\"}"), 1);
    /* A killed prefill node (before the router noticed) and a stopped decode node. */
    ts_proc_kill(&p[0]);
    for (int i = 0; i < 3; i++) ask_ok_within(rt.port, 8 * SEC, "prefill killed");
    ts_proc_freeze(d[1].pid);
    for (int i = 0; i < 3; i++) ask_ok_within(rt.port, 8 * SEC, "decode stopped");
    ck_assert_int_ge(
        metric(rt.port, "pagekv_router_errors_total{role=\"decode\",cause=\"timeout\"}") +
            metric(rt.port, "pagekv_router_errors_total{role=\"prefill\",cause=\"connect\"}"),
        1);
    /* No decode node left: 503 with the reason, and /health 503. */
    ts_proc_kill(&d[0]);
    ts_proc_kill(&d[1]);
    json_t *req = completion_req("Nobody decodes", 3, false, -1);
    answer_t *a = malloc(sizeof(*a));
    uint64_t t0 = pkv_now_ns();
    ask(rt.port, "/v1/completions", req, NULL, a);
    ck_assert_msg(a->status == 503, "%ld %s", a->status, a->body);
    ck_assert_ptr_nonnull(strstr(a->body, "\"code\":\"no_node_available\""));
    ck_assert_ptr_nonnull(strstr(a->body, "decode"));
    ck_assert_uint_lt(pkv_now_ns() - t0, 9 * SEC);
    free(a);
    json_decref(req);
    health_is(rt.port, 503);
    ts_proc_stop(&rt, 30);
    ts_proc_stop(&p[1], 30);
    ts_proc_stop(&p[2], 30);
}
END_TEST

/* A streaming client (one completion of 400 tokens) on its own thread. */
typedef struct {
    uint16_t port;
    pid_t kill_pid; /* killed (SIGKILL) after the first events, when set */
    int kill_after;
    char *body; /* the whole answer once it ended (malloc'd) */
    size_t len;
    atomic_int events;
    CURLcode cc;
    long status;
} streamer_t;

static bool streamer_body(void *arg, const char *body, size_t len, size_t added)
{
    streamer_t *s = arg;
    int ev = count_in(body, "\n\n");
    atomic_store(&s->events, ev);
    if (s->kill_pid && ev >= s->kill_after) {
        kill(s->kill_pid, SIGKILL);
        s->kill_pid = 0;
    }
    return true;
}

static void *streamer_main(void *arg)
{
    streamer_t *s = arg;
    ts_resp_t r;
    s->cc = ts_http_watch("127.0.0.1", s->port, "/v1/completions",
                          "{\"model\":\"tiny\",\"prompt\":\"A long story\",\"max_tokens\":400,"
                          "\"ignore_eos\":true,\"temperature\":0,\"stream\":true}",
                          60, streamer_body, s, &r);
    s->status = r.status;
    s->body = r.body; /* kept: the caller frees it */
    s->len = r.len;
    r.body = NULL;
    ts_resp_free(&r);
    if (getenv("PKV_TEST_DEBUG"))
        fprintf(stderr, "streamer: cc %d status %ld %.200s\n", s->cc, s->status, s->body);
    return NULL;
}

/* A prefill node killed while it holds a prefill leg (SIGSTOPped first, so the leg is
 * surely in it): the leg is run again on the other prefill node; the client sees only a
 * whole answer. */
START_TEST(prefill_killed_mid_request)
{
    launch_proc_t p[2], d, rt;
    for (int i = 0; i < 2; i++) node_start(&p[i], "prefill", NULL);
    node_start(&d, "decode", NULL);
    const char *extra[] = {"--policy", "round_robin", NULL};
    router_start(&rt, p, 2, &d, 1, extra);
    health_is(rt.port, 200);
    char sample[160];
    snprintf(sample, sizeof(sample),
             "pagekv_router_node_in_flight{role=\"prefill\",node=\"http://127.0.0.1:%u\"}",
             p[0].port);
    ts_proc_freeze(p[0].pid);
    streamer_t s[2] = {{.port = rt.port}, {.port = rt.port}};
    pthread_t th[2];
    int started = 0;
    uint64_t deadline = pkv_deadline_after_ns(20 * SEC);
    while (metric(rt.port, sample) < 1) {
        ck_assert(pkv_now_ns() < deadline);
        if (started < 2 && (started == 0 || atomic_load(&s[started - 1].events) > 0 ||
                            metric(rt.port, "pagekv_router_in_flight") == started)) {
            pthread_create(&th[started], NULL, streamer_main, &s[started]);
            started++;
        }
        usleep(20000);
    }
    ts_proc_kill(&p[0]);
    for (int i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(s[i].cc, CURLE_OK);
        ck_assert_int_eq(s[i].status, 200);
        answer_t *a = calloc(1, sizeof(*a));
        sse_take(s[i].body, s[i].len, false, a);
        ck_assert(a->done && !a->error_event);
        ck_assert_str_eq(a->finish, "length");
        free(a);
        free(s[i].body);
    }
    ck_assert_int_ge(metric(rt.port, "pagekv_router_retries_total{cause=\"connect\"}") +
                         metric(rt.port, "pagekv_router_retries_total{cause=\"broken\"}"),
                     1);
    ts_proc_stop(&rt, 30);
    ts_proc_stop(&d, 30);
    ts_proc_stop(&p[1], 30);
}
END_TEST

/* A decode node killed mid-stream: the client's stream ends with an error event (no
 * silence, no retry, nothing repeated). */
START_TEST(decode_killed_mid_stream)
{
    launch_proc_t p, d[2], rt;
    node_start(&p, "prefill", NULL);
    for (int i = 0; i < 2; i++) node_start(&d[i], "decode", NULL);
    const char *extra[] = {"--policy", "round_robin", NULL};
    router_start(&rt, &p, 1, d, 2, extra);
    health_is(rt.port, 200);
    streamer_t s = {.port = rt.port, .kill_pid = d[0].pid, .kill_after = 3};
    pthread_t th;
    pthread_create(&th, NULL, streamer_main, &s);
    pthread_join(th, NULL);
    ts_proc_kill(&d[0]); /* killed by the streamer: reaped */
    ck_assert_int_eq(s.cc, CURLE_OK);
    ck_assert_int_eq(s.status, 200);
    answer_t *a = calloc(1, sizeof(*a));
    sse_take(s.body, s.len, false, a);
    ck_assert(a->error_event);
    ck_assert(!a->done);
    ck_assert_int_ge(a->events, 4);
    ck_assert_ptr_nonnull(strstr(s.body, "\"code\":\"upstream_lost\""));
    ck_assert_int_eq(metric(rt.port, "pagekv_router_stream_errors_total"), 1);
    ck_assert_int_eq(log_count(&d[1], "(decode leg)"), 0); /* not retried */
    free(a);
    free(s.body);
    ts_proc_stop(&rt, 30);
    ts_proc_stop(&d[1], 30);
    ts_proc_stop(&p, 30);
}
END_TEST

/* SIGTERM of the router: the stream in flight finishes whole, a new request gets 503,
 * the router exits 0. */
START_TEST(sigterm_drains)
{
    launch_proc_t p, d, rt;
    node_start(&p, "prefill", NULL);
    node_start(&d, "decode", NULL);
    router_start(&rt, &p, 1, &d, 1, NULL);
    health_is(rt.port, 200);
    streamer_t s = {.port = rt.port};
    pthread_t th;
    pthread_create(&th, NULL, streamer_main, &s);
    uint64_t deadline = pkv_deadline_after_ns(20 * SEC);
    while (atomic_load(&s.events) < 2) {
        ck_assert(pkv_now_ns() < deadline);
        usleep(1000);
    }
    ts_proc_freeze(d.pid); /* hold the stream in flight */
    kill(rt.pid, SIGTERM);
    health_is(rt.port, 503); /* draining */
    json_t *req = completion_req("Too late", 3, false, -1);
    answer_t *a = malloc(sizeof(*a));
    ask(rt.port, "/v1/completions", req, NULL, a);
    ck_assert_int_eq(a->status, 503);
    ck_assert_ptr_nonnull(strstr(a->body, "shutting_down"));
    ts_resp_t r;
    http(rt.port, "GET", "/health", NULL, NULL, &r);
    ck_assert_int_eq(r.status, 503);
    ts_resp_free(&r);
    kill(d.pid, SIGCONT);
    pthread_join(th, NULL);
    ck_assert_int_eq(s.cc, CURLE_OK);
    memset(a, 0, sizeof(*a));
    sse_take(s.body, s.len, false, a);
    ck_assert(a->done && !a->error_event);
    ck_assert_str_eq(a->finish, "length");
    ck_assert_int_eq(ts_proc_wait(&rt, 20, NULL), 0);
    free(a);
    free(s.body);
    json_decref(req);
    ts_proc_stop(&d, 30);
    ts_proc_stop(&p, 30);
}
END_TEST

/* A client that stops reading: the router pauses the node's transfer once its buffer for
 * the client is full (bounded memory) and resumes it when the client reads again; the
 * answer arrives whole and equal to a unified node's. */
typedef struct {
    http_request_t rq;
    http_reply_t rep;
    atomic_bool hold;
} slow_t;

/* Stops reading (blocks the client's only thread) while hold is set, once the first bytes
 * came: the socket's small receive buffer fills and the router's send blocks. */
static bool slow_body(void *arg, const char *body, size_t len, size_t added)
{
    slow_t *s = arg;
    while (atomic_load(&s->hold)) usleep(10000);
    return true;
}

static void *slow_main(void *arg)
{
    slow_t *s = arg;
    http_send(&s->rq, &s->rep);
    return NULL;
}

START_TEST(slow_client_pauses_the_node)
{
    launch_proc_t p, d, rt;
    node_start(&p, "prefill", NULL);
    node_start(&d, "decode", NULL);
    /* a small stream buffer: a loaded machine coalesces tokens into fewer, larger events,
       so the stream's bytes must exceed the buffer with room to spare */
    static const char *const small_buf[] = {"--stream-buffer-bytes", "16K", NULL};
    router_start(&rt, &p, 1, &d, 1, small_buf);
    pkv_server_t *u = unified();
    health_is(rt.port, 200);
    json_t *req = completion_req("A client that reads slowly", 3000, true, -1);
    json_object_set_new(req, "ignore_eos", json_true());
    char *body = json_dumps(req, JSON_COMPACT);
    char base[64];
    snprintf(base, sizeof(base), "http://127.0.0.1:%u", rt.port);
    slow_t s = {.rq = {.base_url = base,
                       .path = "/v1/completions",
                       .body = body,
                       .timeout_ms = 90000,
                       .recv_buffer_bytes = 4096,
                       .on_body_arg = &s}};
    s.rq.on_body = slow_body;
    atomic_init(&s.hold, true);
    pthread_t th;
    pthread_create(&th, NULL, slow_main, &s);
    uint64_t deadline = pkv_deadline_after_ns(60 * SEC);
    while (metric(rt.port, "pagekv_router_stream_pauses_total") < 1) {
        ck_assert_msg(pkv_now_ns() < deadline, "the router never paused the node's transfer");
        usleep(50000);
    }
    atomic_store(&s.hold, false);
    pthread_join(th, NULL);
    ck_assert_int_eq(s.rep.curl_code, CURLE_OK);
    ck_assert_int_eq(s.rep.status, 200);
    answer_t *got = calloc(1, sizeof(*got)), *want = malloc(sizeof(*want));
    sse_take(s.rep.body, s.rep.len, false, got);
    ask(pkv_server_port(u), "/v1/completions", req, NULL, want);
    ck_assert(got->done && !got->error_event);
    ck_assert_int_eq(got->completion, 0); /* no usage chunk asked for */
    ck_assert_str_eq(got->finish, want->finish);
    ck_assert_msg(!strcmp(got->text, want->text), "the relayed text differs");
    free(got);
    free(want);
    http_reply_free(&s.rep);
    free(body);
    json_decref(req);
    pkv_server_destroy(u);
    ts_proc_stop(&rt, 30);
    ts_proc_stop(&d, 30);
    ts_proc_stop(&p, 30);
}
END_TEST

/* ---- bad input ------------------------------------------------------------------------------ */

/* Bad input: the same status and error document as serve's, and no node called. */
START_TEST(bad_input_as_serve_no_node_called)
{
    launch_proc_t p, d, rt;
    node_start(&p, "prefill", NULL);
    node_start(&d, "decode", NULL);
    const char *extra[] = {"--max-body-bytes", "4K", NULL};
    router_start(&rt, &p, 1, &d, 1, extra);
    pkv_server_config_t cfg = {.threads = 1, .kv_dtype = PKV_DTYPE_F16, .max_body_bytes = 4096};
    pkv_server_t *u = NULL;
    ck_assert_int_eq(pkv_server_create(&cfg, &u), PKV_OK);
    uint16_t up = pkv_server_port(u);
    health_is(rt.port, 200);
    /* a first good request: the router has learnt the model */
    json_t *req = completion_req("warm", 2, false, -1);
    answer_t *a = malloc(sizeof(*a));
    ask(rt.port, "/v1/completions", req, NULL, a);
    ck_assert_int_eq(a->status, 200);
    free(a);
    json_decref(req);
    int p_before = log_count(&p, "X-Request-Id"), d_before = log_count(&d, "X-Request-Id");
    char big[6000];
    memset(big, 'a', sizeof(big));
    snprintf(big, sizeof(big), "{\"model\":\"tiny\",\"prompt\":\"%5000d\"}", 1);
    const struct {
        const char *method, *path, *body;
    } cases[] = {
        {"POST", "/v1/completions", "{not json"},
        {"POST", "/v1/completions", ""},
        {"POST", "/v1/completions", "[1,2]"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\",\"prompt\":\"x\",\"bogus\":1}"},
        {"POST", "/v1/completions", "{\"model\":\"other\",\"prompt\":\"x\"}"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\"}"},
        {"POST", "/v1/completions", "{\"prompt\":\"x\"}"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":0}"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":99999}"},
        {"POST", "/v1/completions",
         "{\"model\":\"tiny\",\"prompt\":\"x\",\"temperature\":\"hot\"}"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\",\"prompt\":[\"a\",\"b\"]}"},
        {"POST", "/v1/completions", "{\"model\":\"tiny\",\"prompt\":\"x\",\"n\":2}"},
        {"POST", "/v1/completions",
         "{\"model\":\"tiny\",\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}"},
        {"POST", "/v1/chat/completions", "{\"model\":\"tiny\",\"messages\":[{\"role\":\"x\"}]}"},
        {"POST", "/v1/chat/completions", "{\"model\":\"tiny\",\"messages\":\"hi\"}"},
        {"POST", "/v1/chat/completions", "{\"model\":\"tiny\"}"},
        {"GET", "/v1/completions", NULL},
        {"DELETE", "/v1/models", NULL},
        {"GET", "/v2/nothing", NULL},
        {"POST", "/v1/completions", big},
    };
    for (size_t i = 0; i < PKV_ARRAY_LEN(cases); i++) {
        ts_resp_t want, got;
        http(up, cases[i].method, cases[i].path, cases[i].body, NULL, &want);
        http(rt.port, cases[i].method, cases[i].path, cases[i].body, NULL, &got);
        ck_assert_msg(got.status == want.status && got.status >= 400,
                      "case %zu: %ld vs serve's %ld: %s", i, got.status, want.status, got.body);
        ck_assert_msg(!strcmp(got.body ? got.body : "", want.body ? want.body : ""),
                      "case %zu:\n%s\n%s", i, got.body, want.body);
        ts_resp_free(&want);
        ts_resp_free(&got);
    }
    /* kv_transfer_params are the router's to set: 400 as on a unified node. */
    ts_resp_t got;
    const char *kvt = "{\"model\":\"tiny\",\"prompt\":\"x\",\"kv_transfer_params\":{"
                      "\"do_remote_decode\":true}}";
    http(rt.port, "POST", "/v1/completions", kvt, NULL, &got);
    ck_assert_int_eq(got.status, 400);
    ck_assert_ptr_nonnull(strstr(got.body, "\"code\":\"unsupported_parameter\""));
    ck_assert_ptr_nonnull(strstr(got.body, "\"param\":\"kv_transfer_params\""));
    ts_resp_free(&got);
    ck_assert_int_eq(log_count(&p, "X-Request-Id"), p_before);
    ck_assert_int_eq(log_count(&d, "X-Request-Id"), d_before);
    ck_assert_int_ge(metric(rt.port, "pagekv_router_rejected_total{reason=\"invalid_request\"}"),
                     15);
    pkv_server_destroy(u);
    ts_proc_stop(&rt, 30);
    ts_proc_stop(&d, 30);
    ts_proc_stop(&p, 30);
}
END_TEST

START_TEST(cli_rejects_bad_flags)
{
    const char *cases[][6] = {
        {"route", "--decode", "http://127.0.0.1:1", NULL},
        {"route", "--prefill", "http://127.0.0.1:1", NULL},
        {"route", "--prefill", "127.0.0.1:1", "--decode", "http://127.0.0.1:2", NULL},
        {"route", "--prefill", "http://a:1", "--decode", "http://b:2", "--policy"},
        {"route", "--prefill", "http://a:1", "--decode", "http://b:2", "--port"},
        {"route", "--bogus", "1", NULL},
        {"route", "--prefill", "http://a:1", "--decode", "http://b:2", "--stream-buffer-bytes"},
    };
    const char *tails[][2] = {{NULL, NULL},    {NULL, NULL}, {NULL, NULL}, {"random", NULL},
                              {"70000", NULL}, {NULL, NULL}, {"1K", NULL}};
    for (size_t i = 0; i < PKV_ARRAY_LEN(cases); i++) {
        char *argv[10] = {BIN};
        int n = 1;
        for (int k = 0; k < 6 && cases[i][k]; k++) argv[n++] = (char *)cases[i][k];
        if (tails[i][0]) argv[n++] = (char *)tails[i][0];
        argv[n] = NULL;
        int code = ts_proc_run(argv, 30, NULL);
        ck_assert_msg(code == 2, "case %zu: exit code %d", i, code);
    }
}
END_TEST

/* ---- the nodes' KV formats ------------------------------------------------------------------ */

/* `pagekv route` over pre and dec[0..nd) run to its end: its exit code, its log in *log. */
static int route_run(const launch_proc_t *pre, const launch_proc_t *const *dec, int nd,
                     const char *extra_decode, char **log)
{
    char *argv[16] = {BIN, "route", "--port", "0", "--prefill", (char *)pre->url};
    int n = 6;
    for (int i = 0; i < nd; i++) argv[n++] = "--decode", argv[n++] = (char *)dec[i]->url;
    if (extra_decode) argv[n++] = "--decode", argv[n++] = (char *)extra_decode;
    argv[n] = NULL;
    return ts_proc_run(argv, 10, log);
}

/* At start the router asks every node's /health for its KV format: a prefill node and a
 * decode node of different --kv-dtype are refused (exit 1, a message naming both nodes and
 * both dtypes, never listening), also when another decode node matches; nodes of one
 * format start it and answer; a node that does not answer at start is not checked. */
START_TEST(kv_formats_must_match_at_start)
{
    launch_proc_t p, d8, d16, rt;
    const char *bf16[] = {"--kv-dtype", "bf16", NULL}, *int8[] = {"--kv-dtype", "int8", NULL};
    node_start(&p, "prefill", bf16);
    node_start(&d8, "decode", int8);
    node_start(&d16, "decode", bf16);
    const launch_proc_t *mixed[][2] = {{&d8, NULL}, {&d16, &d8}};
    for (int k = 0; k < 2; k++) {
        char *log = NULL;
        int code = route_run(&p, mixed[k], k + 1, NULL, &log);
        ck_assert_msg(code == 1, "case %d: exit %d\n%s", k, code, ts_tail(log));
        ck_assert_msg(strstr(log, "different formats") && strstr(log, "dtype bf16") &&
                          strstr(log, "dtype int8") && strstr(log, p.url) && strstr(log, d8.url),
                      "case %d: %s", k, ts_tail(log));
        ck_assert_ptr_null(strstr(log, "listening on"));
        free(log);
    }
    ck_assert_int_eq(log_count(&p, "X-Request-Id"), 0); /* nothing was sent to a node */
    /* One format, and a decode node nobody answers for (not checked): it starts. */
    char nobody[64];
    snprintf(nobody, sizeof(nobody), "http://127.0.0.1:%u", 1u);
    char *argv[] = {BIN,        "route",         "--port",   "0",    "--prefill", (char *)p.url,
                    "--decode", (char *)d16.url, "--decode", nobody, NULL};
    ts_proc_start(&rt, argv, LOG_INFO, "pagekv route: listening on ", false);
    char *log = ts_proc_log(&rt);
    ck_assert_msg(strstr(log, "did not describe its KV layout"), "%s", ts_tail(log));
    free(log);
    json_t *req = completion_req("One format for both nodes", 4, false, -1);
    answer_t *a = malloc(sizeof(*a));
    ask(rt.port, "/v1/completions", req, NULL, a);
    ck_assert_msg(a->status == 200, "%ld %s", a->status, a->body);
    free(a);
    json_decref(req);
    ts_proc_stop(&rt, 30);
    ts_proc_stop(&d16, 30);
    ts_proc_stop(&d8, 30);
    ts_proc_stop(&p, 30);
}
END_TEST

/* ---- many clients -----------------------------------------------------------------------------
 */

static uint64_t vm_kb(pid_t pid, const char *field)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    uint64_t v = 0;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof(line), f))
        if (!strncmp(line, field, n)) v = strtoull(line + n + 1, NULL, 10);
    if (f) fclose(f);
    return v;
}

/* A load run in progress: once the router holds all n connections (checked on the batch's
 * tick), its VmRSS is taken and the prefill node resumed. */
typedef struct {
    uint16_t port;
    pid_t router, prefill;
    int n;
    bool resumed;
    uint64_t rss_kb, open_peak, last_check;
} load_t;

static void load_tick(void *arg, size_t done)
{
    load_t *l = arg;
    if (l->resumed || pkv_now_ns() - l->last_check <= SEC / 5) return;
    l->last_check = pkv_now_ns();
    long long open = metric(l->port, "pagekv_router_connections"); /* + this one */
    if (open >= l->n + 1) {
        l->rss_kb = vm_kb(l->router, "VmRSS:");
        l->open_peak = (uint64_t)open - 1;
        kill(l->prefill, SIGCONT);
        l->resumed = true;
    }
}

/* Open n streaming requests at once (the prefill node stopped so they all stay open),
 * wait until the router holds them all, then let them run: returns how many completed
 * with [DONE]; *rss_kb the router's VmRSS with all of them open. */
static int load_run(uint16_t port, pid_t router, pid_t prefill, int n, uint64_t *rss_kb,
                    uint64_t *open_peak)
{
    char base[64];
    snprintf(base, sizeof(base), "http://127.0.0.1:%u", port);
    http_request_t *reqs = calloc((size_t)n, sizeof(*reqs));
    http_reply_t *reps = calloc((size_t)n, sizeof(*reps));
    ck_assert(reqs && reps);
    for (int i = 0; i < n; i++)
        reqs[i] = (http_request_t){
            .base_url = base,
            .path = "/v1/completions",
            .body = "{\"model\":\"tiny\",\"prompt\":\"one of a thousand\",\"max_tokens\":4,"
                    "\"temperature\":0,\"stream\":true}",
            .timeout_ms = 100000};
    load_t l = {.port = port, .router = router, .prefill = prefill, .n = n};
    http_batch_t batch = {.concurrency = (uint32_t)n, .tick = load_tick, .tick_arg = &l};
    ts_proc_freeze(prefill);
    http_batch_run(&batch, reqs, (size_t)n, reps);
    kill(prefill, SIGCONT);
    int completed = 0;
    for (int i = 0; i < n; i++)
        if (reps[i].curl_code == CURLE_OK && reps[i].status == 200 && reps[i].body &&
            strstr(reps[i].body, "data: [DONE]\n\n") && !strstr(reps[i].body, "\"error\""))
            completed++;
    http_replies_free(reps, (size_t)n);
    free(reps);
    free(reqs);
    ck_assert_msg(l.resumed, "the router never held all %d connections at once", n);
    *rss_kb = l.rss_kb;
    *open_peak = l.open_peak;
    return completed;
}

/* 1,000 concurrent streaming connections through the router: all complete; the router's
 * VmRSS with all of them open is printed (a figure, not asserted). */
START_TEST(thousand_concurrent_streams)
{
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
    ck_assert_msg(rl.rlim_cur >= 2500, "RLIMIT_NOFILE hard limit %llu is too low",
                  (unsigned long long)rl.rlim_max);
    launch_proc_t p, d, rt;
    const char *nodes[] = {"--max-batch-size", "64", "--max-connections", "512", NULL};
    node_start(&p, "prefill", nodes);
    node_start(&d, "decode", nodes);
    const char *extra[] = {"--policy", "round_robin",          "--node-timeout-ms",
                           "90000",    "--request-timeout-ms", "95000",
                           NULL};
    router_start(&rt, &p, 1, &d, 1, extra);
    health_is(rt.port, 200);
    uint64_t rss0 = vm_kb(rt.pid, "VmRSS:");
    uint64_t rss = 0, peak_open = 0;
    int n = 1000;
    int done = load_run(rt.port, rt.pid, p.pid, n, &rss, &peak_open);
    uint64_t hwm = vm_kb(rt.pid, "VmHWM:");
    int threads = (int)vm_kb(rt.pid, "Threads:");
    fprintf(stderr,
            "router load: %d of %d streams completed; %llu connections open at once; router "
            "VmRSS %llu KiB idle, %llu KiB with all open, VmHWM %llu KiB; %d threads\n",
            done, n, (unsigned long long)peak_open, (unsigned long long)rss0,
            (unsigned long long)rss, (unsigned long long)hwm, threads);
    ck_assert_int_eq(done, n);
    ck_assert_int_le(threads, 8); /* no thread per connection */
    ts_proc_stop(&rt, 30);
    ts_proc_stop(&d, 30);
    ts_proc_stop(&p, 30);
}
END_TEST

/* Beyond --max-connections: 503 with Retry-After, not a dropped connection. */
START_TEST(over_the_connection_limit_503)
{
    launch_proc_t p, d, rt;
    node_start(&p, "prefill", NULL);
    node_start(&d, "decode", NULL);
    const char *extra[] = {"--max-connections", "4", NULL};
    router_start(&rt, &p, 1, &d, 1, extra);
    health_is(rt.port, 200);
    /* the router counts a connection until it has seen it close: until it closed them all */
    uint64_t deadline = pkv_deadline_after_ns(10 * SEC);
    while (pkv_test_tcp_conns(rt.pid, rt.port, NULL) > 0) {
        ck_assert_msg(pkv_now_ns() < deadline, "the router kept a connection open");
        usleep(2000);
    }
    if (getenv("PKV_TEST_DEBUG"))
        fprintf(stderr, "connections before: %lld\n", metric(rt.port, "pagekv_router_connections"));
    ts_proc_freeze(p.pid);
    streamer_t s[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        s[i] = (streamer_t){.port = rt.port};
        pthread_create(&th[i], NULL, streamer_main, &s[i]);
    }
    /* Once the four streams hold their connections (connected first: a probe that came
     * before them would take one's place; the router accepts in arrival order), a fifth
     * connection is over. */
    deadline = pkv_deadline_after_ns(10 * SEC);
    while (pkv_test_tcp_conns(rt.pid, rt.port, NULL) < 4) {
        ck_assert_msg(pkv_now_ns() < deadline, "the four streams never connected");
        usleep(2000);
    }
    deadline = pkv_deadline_after_ns(20 * SEC);
    ts_resp_t r;
    for (;;) {
        http(rt.port, "GET", "/health", NULL, NULL, &r);
        ck_assert_int_eq(r.cc, CURLE_OK);
        if (getenv("PKV_TEST_DEBUG")) fprintf(stderr, "health: %ld %s\n", r.status, r.body);
        if (r.status == 503 && strstr(r.body, "too_many_connections")) break;
        ck_assert(pkv_now_ns() < deadline);
        ts_resp_free(&r);
        usleep(20000);
    }
    char ra[16];
    header_value(r.headers, "Retry-After", ra, sizeof(ra));
    ck_assert_str_eq(ra, "1");
    ts_resp_free(&r);
    kill(p.pid, SIGCONT);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(s[i].status, 200);
        ck_assert_ptr_nonnull(strstr(s[i].body, "data: [DONE]"));
        free(s[i].body);
    }
    deadline = pkv_deadline_after_ns(10 * SEC);
    while (metric(rt.port, "pagekv_router_rejected_total{reason=\"too_many_connections\"}") < 1) {
        ck_assert(pkv_now_ns() < deadline);
        usleep(20000);
    }
    ts_proc_stop(&rt, 30);
    ts_proc_stop(&d, 30);
    ts_proc_stop(&p, 30);
}
END_TEST

/* PKV_TEST_ONLY=name runs one test (while working on it). */
#define ADD(tc, t)                                                                                 \
    do {                                                                                           \
        const char *only_ = getenv("PKV_TEST_ONLY");                                               \
        if (!only_ || !strcmp(only_, #t)) tcase_add_test(tc, t);                                   \
    } while (0)

/* ---- the lookup's count ---------------------------------------------------------------------- */

/* pkv_kv_prefix_match (what /v1/cache/lookup answers) is what admission then adopts, per
 * salt, on both backends, and changes nothing (no query counted, no reference taken). */
START_TEST(prefix_match_is_what_admission_adopts)
{
    for (int backend = 0; backend < 2; backend++) {
        pkv_kv_config_t cfg = {.geo = {.layers = 2,
                                       .kv_heads = 2,
                                       .head_dim = 8,
                                       .block_tokens = 4,
                                       .dtype = PKV_DTYPE_F32},
                               .backend = backend ? PKV_BACKEND_DENSE : PKV_BACKEND_PAGED,
                               .budget_bytes = 8u << 20};
        pkv_kv_t *kv = NULL;
        ck_assert_int_eq(pkv_kv_create(&cfg, &kv), PKV_OK);
        int32_t toks[30];
        for (int i = 0; i < 30; i++) toks[i] = 100 + i;
        uint32_t matched = 99;
        ck_assert_int_eq(pkv_kv_prefix_match(kv, 7, toks, 30, &matched), PKV_OK);
        ck_assert_uint_eq(matched, 0);
        /* a sequence of the first 22 tokens, written and freed: 5 full blocks cached */
        pkv_seq_params_t sp = {.salt = 7, .tokens = toks, .n_tokens = 22};
        pkv_seq_t *seq;
        uint32_t cached;
        ck_assert_int_eq(pkv_seq_create(kv, &sp, &seq, &cached), PKV_OK);
        ck_assert_int_eq(pkv_seq_append(seq, toks, 22), PKV_OK);
        pkv_seq_free(seq);
        pkv_kv_stats_t before, after;
        pkv_kv_stats(kv, &before);
        ck_assert_int_eq(pkv_kv_prefix_match(kv, 7, toks, 30, &matched), PKV_OK);
        ck_assert_uint_eq(matched, 20);
        ck_assert_int_eq(pkv_kv_prefix_match(kv, 7, toks, 21, &matched), PKV_OK);
        ck_assert_uint_eq(matched, 20); /* whole blocks, at most n - 1 */
        ck_assert_int_eq(pkv_kv_prefix_match(kv, 7, toks, 20, &matched), PKV_OK);
        ck_assert_uint_eq(matched, 16);
        ck_assert_int_eq(pkv_kv_prefix_match(kv, 8, toks, 30, &matched), PKV_OK);
        ck_assert_uint_eq(matched, 0); /* another tenant's salt */
        pkv_kv_stats(kv, &after);
        ck_assert_uint_eq(after.prefix_queries, before.prefix_queries);
        ck_assert_uint_eq(after.prefix_hit_tokens, before.prefix_hit_tokens);
        ck_assert_int_eq(pkv_kv_prefix_match(kv, 7, toks, 30, &matched), PKV_OK);
        sp.n_tokens = 30;
        ck_assert_int_eq(pkv_seq_create(kv, &sp, &seq, &cached), PKV_OK);
        ck_assert_uint_eq(cached, matched);
        pkv_seq_free(seq);
        ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
        pkv_kv_destroy(kv);
    }
}
END_TEST

/* ---- the OpenAI SDK -------------------------------------------------------------------------- */

/* The SDK's usual calls (tests/sdk/openai_check.cjs) through the router. Needs node, npm
 * and the `openai` package, installed once into BUILD/sdk; skipped, with a message, when
 * any is missing or cannot be installed (no network). */
START_TEST(openai_sdk_through_router)
{
    if (system("command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1")) {
        PKV_TEST_SKIP("node or npm is not installed");
        return;
    }
    char sdk[4200], cmd[9000];
    snprintf(sdk, sizeof(sdk), "%s", BIN);
    *strrchr(sdk, '/') = 0;
    snprintf(sdk + strlen(sdk), sizeof(sdk) - strlen(sdk), "/sdk");
    snprintf(cmd, sizeof(cmd), "%s/node_modules/openai/package.json", sdk);
    if (access(cmd, R_OK)) {
        snprintf(cmd, sizeof(cmd),
                 "mkdir -p '%s' && timeout 90 npm install --prefix '%s' --no-audit --no-fund "
                 "--silent openai@4 >/dev/null 2>&1",
                 sdk, sdk);
        if (system(cmd)) {
            PKV_TEST_SKIP("`npm install openai@4` failed (no registry?)");
            return;
        }
    }
    launch_proc_t p, d, rt;
    node_start(&p, "prefill", NULL);
    node_start(&d, "decode", NULL);
    router_start(&rt, &p, 1, &d, 1, NULL);
    health_is(rt.port, 200);
    snprintf(cmd, sizeof(cmd),
             "NODE_PATH='%s/node_modules' timeout 60 node '%s/tests/sdk/openai_check.cjs' "
             "http://127.0.0.1:%u",
             sdk, PKV_TEST_SRCDIR, rt.port);
    ck_assert_int_eq(system(cmd), 0);
    ck_assert_int_ge(log_count(&d, "(decode leg)"), 4);
    ts_proc_stop(&rt, 30);
    ts_proc_stop(&d, 30);
    ts_proc_stop(&p, 30);
}
END_TEST

/* ---- the SSE framing's fuzz corpus ------------------------------------------------------- */

/* tests/fuzz/corpus/sse replayed through the framing's fuzz properties: every stream
 * passes them, and the complete ones are relayed whole. */
static void replay_sse(const char *name, const uint8_t *buf, size_t n, void *arg)
{
    size_t relayed = pkv_fuzz_sse(buf, n); /* aborts on a broken property */
    if (!strcmp(name, "stream-complete")) ck_assert_uint_eq(relayed, n - 1);
    *(size_t *)arg += relayed;
}

START_TEST(sse_fuzz_corpus_replays)
{
    size_t relayed = 0;
    uint32_t files =
        pkv_test_corpus_each("PKV_SSE_CORPUS", "tests/fuzz/corpus/sse", replay_sse, &relayed);
    ck_assert_uint_ge(files, 5);
    ck_assert_uint_gt(relayed, 0);
}
END_TEST

static Suite *router_suite(void)
{
    Suite *s = suite_create("router");
    TCase *tc = tcase_create("router");
    tcase_add_checked_fixture(tc, setup, NULL);
    tcase_set_timeout(tc, 120);
    ADD(tc, cli_rejects_bad_flags);
    ADD(tc, kv_formats_must_match_at_start);
    ADD(tc, prefix_match_is_what_admission_adopts);
    ADD(tc, answers_equal_unified);
    ADD(tc, round_robin_spreads);
    ADD(tc, cache_aware_finds_the_prefix);
    ADD(tc, cache_aware_prefers_memory_to_disk);
    ADD(tc, dead_and_stopped_nodes_skipped);
    ADD(tc, prefill_killed_mid_request);
    ADD(tc, decode_killed_mid_stream);
    ADD(tc, sigterm_drains);
    ADD(tc, slow_client_pauses_the_node);
    ADD(tc, bad_input_as_serve_no_node_called);
    ADD(tc, over_the_connection_limit_503);
    ADD(tc, thousand_concurrent_streams);
    ADD(tc, openai_sdk_through_router);
    ADD(tc, sse_fuzz_corpus_replays);
    suite_add_tcase(s, tc);
    return s;
}

PKV_TEST_MAIN(router_suite)
