/*
 * server: the module's interface for other pagekv modules (not installed). The public
 * face is include/pagekv/server.h; this adds the request checks `pagekv serve` applies
 * before it tokenizes, so that a front (the router) refuses bad input with the very same
 * errors without a model, a tokenizer or a server.
 */
#ifndef PKV_SERVER_SERVER_H
#define PKV_SERVER_SERVER_H

#include "pagekv/server.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* What a front needs to know of a request that passed the checks. */
typedef struct {
    bool stream;                 /* "stream": true */
    bool has_kv_transfer_params; /* a non-null "kv_transfer_params" */
} pkv_server_req_shape_t;

/* Check `len` bytes of body for POST /v1/completions (chat false) or
 * /v1/chat/completions as `pagekv serve` does before tokenizing: JSON, fields, types,
 * ranges (max_tokens against max_context), and the model against model_name (NULL: any).
 * PKV_OK with *shape; PKV_ERR_INVALID with *status (400 or 404) and *error_json (the
 * error document serve answers with, malloc'd NUL-terminated, the caller frees);
 * PKV_ERR_NOMEM. Pure: no state, thread-safe. */
int pkv_server_request_check(bool chat, const char *body, size_t len, const char *model_name,
                             uint32_t max_context, pkv_server_req_shape_t *shape, int *status,
                             char **error_json);

/* An error document as serve sends it: {"error": {"message", "type", "param", "code"}}
 * (param null when NULL), compact, malloc'd NUL-terminated; NULL when out of memory. */
char *pkv_server_error_json(const char *type, const char *code, const char *param,
                            const char *message);

#endif
