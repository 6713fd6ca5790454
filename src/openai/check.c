/*
 * openai: the checks for fronts (the router) over request.c's parser, and the error
 * document every refusal is answered with.
 */
#include "openai/openai.h"

#include "core/core.h"

#include <jansson.h>
#include <stdlib.h>

static json_t *error_doc(const char *type, const char *code, const char *param, const char *message)
{
    return json_pack("{s:{s:s, s:s, s:s?, s:s}}", "error", "message", message, "type", type,
                     "param", param, "code", code);
}

static char *compact(json_t *doc)
{
    char *text = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    return text;
}

json_t *pkv_openai_error_doc(const pkv_openai_error_t *err)
{
    return error_doc(err->type, err->code, err->param, err->message);
}

char *pkv_openai_error_json(const char *type, const char *code, const char *param,
                            const char *message)
{
    return compact(error_doc(type, code, param, message));
}

int pkv_openai_request_check(bool chat, const char *body, size_t len, const char *model_name,
                             uint32_t max_context, pkv_openai_shape_t *shape, int *status,
                             char **error_json)
{
    pkv_openai_limits_t lim = {.max_context = max_context};
    pkv_openai_request_t r;
    pkv_openai_error_t err;
    if (pkv_openai_request_parse(chat ? PKV_OPENAI_CHAT : PKV_OPENAI_COMPLETIONS, body, len,
                                 model_name, &lim, &r, &err)) {
        char *text = compact(pkv_openai_error_doc(&err));
        if (!text) return PKV_ERR_NOMEM;
        *status = err.status;
        *error_json = text;
        return PKV_ERR_INVALID;
    }
    shape->stream = r.stream;
    shape->has_kv_transfer_params = r.kvt_params != NULL;
    pkv_openai_request_free(&r);
    return PKV_OK;
}
