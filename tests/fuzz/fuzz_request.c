/*
 * Fuzz target for the server's request parser: an HTTP body -> pkv_server_request_t
 * (pkv_server_request_parse), then the prompt step with the builtin tokenizer
 * (pkv_server_request_prompt). The first input byte picks the endpoint (even:
 * /v1/completions, odd: /v1/chat/completions; the corpus uses 'p' and 'm'); the rest is
 * the body. Any broken property aborts (a crash for libFuzzer); refusals are expected.
 *
 *   libFuzzer:  clang -g -O1 -fsanitize=fuzzer,address,undefined -Iinclude -Isrc -D_GNU_SOURCE \
 *                 tests/fuzz/fuzz_request.c src/server/request.c src/tokenizer/[a-z]*.c \
 *                 src/core/core.c -o /tmp/fuzz_request -ljansson -lcrypto -lm -pthread
 *               /tmp/fuzz_request -max_total_time=60 tests/fuzz/corpus/request
 *   replay:     cc -DPKV_FUZZ_REPLAY_MAIN -g -fsanitize=address,undefined -Iinclude -Isrc \
 *                 -D_GNU_SOURCE tests/fuzz/fuzz_request.c src/server/request.c \
 *                 src/tokenizer/[a-z]*.c src/core/core.c -o /tmp/fuzz_request_replay \
 *                 -ljansson -lcrypto -lm -pthread
 *               /tmp/fuzz_request_replay tests/fuzz/corpus/request   (files or directories)
 * The suite replays the corpus too (tests/test_server.c): files named ok-* must be
 * accepted by both steps, bad-* refused by one of them.
 */
#include "server/request.h"

#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_MAX_CONTEXT 4096u

static void fuzz_quiet(void *arg, pkv_log_level_t level, const char *module, const char *line)
{
    (void)arg, (void)level, (void)module, (void)line;
}

static const pkv_tok_t *fuzz_tok(void)
{
    static pkv_tok_t *tok;
    if (!tok && pkv_tok_create_builtin(&tok) != PKV_OK) abort();
    return tok;
}

/* An error must be a well-formed client error that can always be sent as JSON. */
static void check_error(const pkv_server_error_t *err)
{
    if (err->status != 400 && err->status != 404) abort();
    if (!err->type || !err->code || !err->message[0]) abort();
    for (const char *p = err->message; *p; p++)
        if ((unsigned char)*p < 0x20 || (unsigned char)*p >= 0x7f) abort();
    json_t *s = json_string(err->message);
    if (!s) abort();
    json_decref(s);
}

/* Outcome: 0 refused by the parser, 1 refused by the prompt step, 2 accepted by both. */
static int fuzz_request_one(pkv_sreq_kind_t kind, const char *body, size_t len)
{
    pkv_server_limits_t lim = {.max_context = FUZZ_MAX_CONTEXT};
    pkv_server_request_t r;
    pkv_server_error_t err;
    memset(&err, 0, sizeof(err));
    if (pkv_server_request_parse(kind, body, len, "tiny", &lim, &r, &err) != PKV_OK) {
        check_error(&err);
        return 0;
    }
    /* What the parser promises. */
    if (r.kind != kind || !r.model || strcmp(r.model, "tiny")) abort();
    if (kind == PKV_SREQ_COMPLETIONS && !!r.prompt_text == !!r.prompt_ids) abort();
    if (kind == PKV_SREQ_COMPLETIONS && r.prompt_text && !r.prompt_len) abort();
    if (kind == PKV_SREQ_COMPLETIONS && r.prompt_ids && !r.n_prompt_ids) abort();
    if (kind == PKV_SREQ_CHAT && (!r.msgs || !r.n_msgs)) abort();
    for (size_t i = 0; kind == PKV_SREQ_CHAT && i < r.n_msgs; i++)
        if ((unsigned)r.msgs[i].role > PKV_CHAT_ASSISTANT ||
            (!r.msgs[i].content && r.msgs[i].content_len))
            abort();
    if (r.has_max_tokens && (r.max_tokens < 1 || r.max_tokens > FUZZ_MAX_CONTEXT)) abort();
    if (!(r.temperature >= 0.0f && r.temperature <= 2.0f)) abort();
    if (!(r.top_p > 0.0f && r.top_p <= 1.0f)) abort();
    if (r.n_stop > PKV_ENGINE_MAX_STOP) abort();
    for (uint32_t i = 0; i < r.n_stop; i++) {
        size_t l = strlen(r.stop[i]);
        if (l < 1 || l >= PKV_ENGINE_MAX_STOP_LEN) abort();
    }
    if (r.include_usage && !r.stream) abort();

    int32_t *ids = NULL;
    uint32_t n = 0, mt = 0;
    int outcome = 1;
    if (pkv_server_request_prompt(&r, fuzz_tok(), &lim, 16, &ids, &n, &mt, &err) == PKV_OK) {
        if (n < 1 || mt < 1 || (uint64_t)n + mt > FUZZ_MAX_CONTEXT) abort();
        for (uint32_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= pkv_tok_vocab_size(fuzz_tok())) abort();
        free(ids);
        outcome = 2;
    } else {
        if (err.status == 500) abort(); /* only allocation failures may say 500 */
        check_error(&err);
    }
    pkv_server_request_free(&r);
    return outcome;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    pkv_log_set_sink(fuzz_quiet, NULL);
    fuzz_request_one(data[0] & 1 ? PKV_SREQ_CHAT : PKV_SREQ_COMPLETIONS, (const char *)data + 1,
                     size - 1);
    pkv_log_set_sink(NULL, NULL);
    return 0;
}

#ifdef PKV_FUZZ_REPLAY_MAIN
#include "replay_main.h"
#endif
