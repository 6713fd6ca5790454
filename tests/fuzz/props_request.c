/* The server request parser's fuzz properties (see tests/fuzz/props.h, fuzz_request.c). */
#include "props.h"

#include "openai/openai.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_MAX_CONTEXT 4096u

static const pkv_tok_t *fuzz_tok(void)
{
    static pkv_tok_t *tok;
    if (!tok && pkv_tok_create_builtin(&tok) != PKV_OK) abort();
    return tok;
}

/* An error must be a well-formed client error that can always be sent as JSON. */
static void check_error(const pkv_openai_error_t *err)
{
    if (err->status != 400 && err->status != 404) abort();
    if (!err->type || !err->code || !err->message[0]) abort();
    for (const char *p = err->message; *p; p++)
        if ((unsigned char)*p < 0x20 || (unsigned char)*p >= 0x7f) abort();
    json_t *s = json_string(err->message);
    if (!s) abort();
    json_decref(s);
}

int pkv_fuzz_request_one(bool chat, const char *body, size_t len)
{
    pkv_openai_kind_t kind = chat ? PKV_OPENAI_CHAT : PKV_OPENAI_COMPLETIONS;
    pkv_openai_limits_t lim = {.max_context = FUZZ_MAX_CONTEXT};
    pkv_openai_request_t r;
    pkv_openai_error_t err;
    memset(&err, 0, sizeof(err));
    if (pkv_openai_request_parse(kind, body, len, "tiny", &lim, &r, &err) != PKV_OK) {
        check_error(&err);
        return 0;
    }
    /* What the parser promises. */
    if (r.kind != kind || !r.model || strcmp(r.model, "tiny")) abort();
    if (kind == PKV_OPENAI_COMPLETIONS && !!r.prompt_text == !!r.prompt_ids) abort();
    if (kind == PKV_OPENAI_COMPLETIONS && r.prompt_text && !r.prompt_len) abort();
    if (kind == PKV_OPENAI_COMPLETIONS && r.prompt_ids && !r.n_prompt_ids) abort();
    if (kind == PKV_OPENAI_CHAT && (!r.msgs || !r.n_msgs)) abort();
    for (size_t i = 0; kind == PKV_OPENAI_CHAT && i < r.n_msgs; i++)
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
    if (pkv_openai_request_prompt(&r, fuzz_tok(), &lim, 16, &ids, &n, &mt, &err) == PKV_OK) {
        if (n < 1 || mt < 1 || (uint64_t)n + mt > FUZZ_MAX_CONTEXT) abort();
        for (uint32_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= pkv_tok_vocab_size(fuzz_tok())) abort();
        free(ids);
        outcome = 2;
    } else {
        if (err.status == 500) abort(); /* only allocation failures may say 500 */
        check_error(&err);
    }
    pkv_openai_request_free(&r);
    return outcome;
}

void pkv_fuzz_request(const uint8_t *data, size_t size)
{
    if (size < 1) return;
    pkv_fuzz_quiet_logs(true);
    pkv_fuzz_request_one(data[0] & 1, (const char *)data + 1, size - 1);
    pkv_fuzz_quiet_logs(false);
}
