/*
 * server: the request checks for other modules (server/server.h) over request.c's
 * parser, and the error document in serve's shape.
 */
#include "server/server.h"

#include "core/core.h"
#include "server/request.h"

#include <jansson.h>
#include <stdlib.h>

char *pkv_server_error_json(const char *type, const char *code, const char *param,
                            const char *message)
{
    /* The same document server.c's error_doc builds. */
    json_t *doc = json_pack("{s:{s:s, s:s, s:s?, s:s}}", "error", "message", message, "type", type,
                            "param", param, "code", code);
    char *text = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    return text;
}

int pkv_server_request_check(bool chat, const char *body, size_t len, const char *model_name,
                             uint32_t max_context, pkv_server_req_shape_t *shape, int *status,
                             char **error_json)
{
    srv_limits_t lim = {.max_context = max_context};
    srv_request_t r;
    srv_error_t err;
    if (srv_request_parse(chat ? SRV_REQ_CHAT : SRV_REQ_COMPLETIONS, body, len, model_name, &lim,
                          &r, &err)) {
        char *text = pkv_server_error_json(err.type, err.code, err.param, err.message);
        if (!text) return PKV_ERR_NOMEM;
        *status = err.status;
        *error_json = text;
        return PKV_ERR_INVALID;
    }
    shape->stream = r.stream;
    shape->has_kv_transfer_params = r.kvt_params != NULL;
    srv_request_free(&r);
    return PKV_OK;
}
