/*
 * openai: the request schema (src/openai/) without a socket. Every refusal a client can
 * get for a bad body (JSON, fields, types, values, the model, the context) with its status,
 * code and error document, through what the server runs (pkv_openai_request_parse, then
 * pkv_openai_request_prompt) and what a front runs (pkv_openai_request_check: the same
 * status and the same error document for what it decides, no refusal for what only the
 * prompt step can decide); and the request fuzz corpus replayed. That the server answers
 * these documents over HTTP and changes nothing: test_server's errors_change_nothing.
 */
#include "tests/support/testutil.h"

#include "openai/openai.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>

/* The fuzz target's properties: their checks abort on a violation. */
#include "tests/fuzz/props.h"

#define MAX_CONTEXT 256u

typedef struct {
    bool chat;
    const char *body;
    long status;
    const char *code; /* error.code */
} bad_body_t;

/* The refusal of body by the server's steps into *err: false when both steps accept it. */
static bool server_refuses(const pkv_tok_t *tok, const bad_body_t *c, pkv_openai_error_t *err,
                           bool *at_parse)
{
    pkv_openai_limits_t lim = {.max_context = MAX_CONTEXT};
    pkv_openai_request_t r;
    memset(err, 0, sizeof(*err));
    *at_parse = true;
    if (pkv_openai_request_parse(c->chat ? PKV_OPENAI_CHAT : PKV_OPENAI_COMPLETIONS, c->body,
                                 strlen(c->body), "tiny", &lim, &r, err) != PKV_OK)
        return true;
    *at_parse = false;
    int32_t *ids = NULL;
    uint32_t n = 0, mt = 0;
    int rc = pkv_openai_request_prompt(&r, tok, &lim, 16, &ids, &n, &mt, err);
    free(ids);
    pkv_openai_request_free(&r);
    return rc != PKV_OK;
}

/* Every bad body: refused with its status and code, an error document with a message and
 * a type, and the front's check agreeing with the parser. */
START_TEST(bad_bodies_refused_with_their_documents)
{
    static char long_prompt[2048];
    char *lp = long_prompt;
    lp += sprintf(lp, "{\"model\":\"tiny\",\"prompt\":\"");
    for (int i = 0; i < 200; i++) lp += sprintf(lp, "word%d ", i);
    sprintf(lp, "\",\"max_tokens\":4}");

    const bad_body_t cases[] = {
        {false, "{", 400, "invalid_json"},
        {false, "", 400, "invalid_json"},
        {false, "[1,2]", 400, "invalid_json"},
        {false, "{\"model\":\"tiny\",\"prompt\":\"a\",\"prompt\":\"b\"}", 400, "invalid_json"},
        {false, "{\"model\":\"tiny\",\"prompt\":\"\xff\"}", 400, "invalid_json"},
        {false, "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":\"5\"}", 400, "invalid_type"},
        {false, "{\"model\":\"tiny\",\"prompt\":\"x\",\"temperature\":\"hot\"}", 400,
         "invalid_type"},
        {false, "{\"model\":\"tiny\",\"prompt\":\"x\",\"stream\":1}", 400, "invalid_type"},
        {false, "{\"model\":\"tiny\",\"prompt\":7}", 400, "invalid_type"},
        {true, "{\"model\":\"tiny\",\"messages\":\"hi\"}", 400, "invalid_type"},
        {false, "{\"prompt\":\"x\"}", 400, "missing_field"},
        {false, "{\"model\":\"tiny\"}", 400, "missing_field"},
        {true, "{\"model\":\"tiny\"}", 400, "missing_field"},
        {true, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\"}]}", 400, "missing_field"},
        {false, "{\"model\":\"tiny\",\"prompt\":\"x\",\"bogus\":1}", 400, "unknown_parameter"},
        {false, "{\"model\":\"gpt-4o\",\"prompt\":\"x\"}", 404, "model_not_found"},
        {false, "{\"model\":\"tiny\",\"prompt\":\"\"}", 400, "invalid_value"},
        {false, "{\"model\":\"tiny\",\"prompt\":[]}", 400, "invalid_value"},
        {true, "{\"model\":\"tiny\",\"messages\":[]}", 400, "invalid_value"},
        {false, "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":-1}", 400, "invalid_value"},
        {false, "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":0}", 400, "invalid_value"},
        {false, "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":1000000000000}", 400,
         "invalid_value"},
        {false, "{\"model\":\"tiny\",\"prompt\":\"x\",\"max_tokens\":255}", 400,
         "context_length_exceeded"},
        {false, long_prompt, 400, "context_length_exceeded"},
        {false, "{\"model\":\"tiny\",\"prompt\":\"x\",\"n\":3}", 400, "unsupported_parameter"},
        {true, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", 400,
         "invalid_value"},
        {false, "{\"model\":\"tiny\",\"prompt\":[5,99999]}", 400, "invalid_value"},
    };
    pkv_tok_t *tok = NULL;
    ck_assert_int_eq(pkv_tok_create_builtin(&tok), PKV_OK);
    for (size_t i = 0; i < PKV_ARRAY_LEN(cases); i++) {
        const bad_body_t *c = &cases[i];
        pkv_openai_error_t err;
        bool at_parse;
        ck_assert_msg(server_refuses(tok, c, &err, &at_parse), "case %zu accepted", i);
        ck_assert_msg(err.status == c->status && !strcmp(err.code, c->code),
                      "case %zu: %d %s, want %ld %s (%s)", i, err.status, err.code, c->status,
                      c->code, err.message);
        json_t *doc = pkv_openai_error_doc(&err);
        ck_assert_ptr_nonnull(doc);
        ck_assert_str_eq(json_string_value(json_object_get(json_object_get(doc, "error"), "code")),
                         c->code);
        const char *msg =
            json_string_value(json_object_get(json_object_get(doc, "error"), "message"));
        const char *type =
            json_string_value(json_object_get(json_object_get(doc, "error"), "type"));
        ck_assert_msg(msg && msg[0] && type && type[0], "case %zu: no message or type", i);
        if (!strcmp(c->code, "context_length_exceeded")) ck_assert_ptr_nonnull(strstr(msg, "256"));
        /* The front's check: the same refusal for what it decides (before tokenizing). */
        pkv_openai_shape_t shape;
        int status = 0;
        char *ejson = NULL;
        int rc = pkv_openai_request_check(c->chat, c->body, strlen(c->body), "tiny", MAX_CONTEXT,
                                          &shape, &status, &ejson);
        if (at_parse) {
            ck_assert_msg(rc == PKV_ERR_INVALID && status == c->status,
                          "case %zu: the check says %d, status %d", i, rc, status);
            json_t *front = json_loads(ejson, 0, NULL);
            ck_assert_msg(json_equal(front, doc), "case %zu: documents differ: %s", i, ejson);
            json_decref(front);
        } else {
            ck_assert_msg(rc == PKV_OK, "case %zu: the check refuses what parses", i);
        }
        free(ejson);
        json_decref(doc);
    }
    pkv_tok_destroy(tok);
}
END_TEST

/* ---- the request fuzz corpus ------------------------------------------------------------- */

typedef struct {
    int ok, bad;
} corpus_tally_t;

static void replay_request(const char *name, const uint8_t *buf, size_t n, void *arg)
{
    corpus_tally_t *t = arg;
    pkv_fuzz_request(buf, n); /* aborts on a broken property */
    ck_assert_uint_ge(n, 1);
    pkv_fuzz_quiet_logs(true);
    int outcome = pkv_fuzz_request_one(buf[0] & 1, (const char *)buf + 1, n - 1);
    pkv_fuzz_quiet_logs(false);
    if (!strncmp(name, "ok-", 3)) {
        ck_assert_msg(outcome == 2, "%s should be accepted (outcome %d)", name, outcome);
        t->ok++;
    } else if (!strncmp(name, "bad-", 4)) {
        ck_assert_msg(outcome < 2, "%s should be refused", name);
        t->bad++;
    }
}

START_TEST(fuzz_corpus_replays)
{
    corpus_tally_t t = {0, 0};
    uint32_t files =
        pkv_test_corpus_each("PKV_REQUEST_CORPUS", "tests/fuzz/corpus/request", replay_request, &t);
    ck_assert_uint_ge(files, (uint32_t)(t.ok + t.bad));
    ck_assert_int_ge(t.ok, 10);
    ck_assert_int_ge(t.bad, 50);
}
END_TEST

static Suite *openai_suite(void)
{
    Suite *s = suite_create("openai");
    TCase *tc = tcase_create("schema");
    tcase_add_test(tc, bad_bodies_refused_with_their_documents);
    tcase_add_test(tc, fuzz_corpus_replays);
    suite_add_tcase(s, tc);
    return s;
}

PKV_TEST_MAIN(openai_suite)
