/*
 * openai: the OpenAI request schema both `pagekv serve` and `pagekv route` speak (the
 * module's interface; not installed): an HTTP body (JSON) -> a checked generation request,
 * the request's prompt -> token ids within the server's limits, and the error document
 * every refusal is answered with. The server parses with it before it tokenizes; a front
 * (the router) checks with it, so both refuse bad input with the very same errors, the
 * router without a model, a tokenizer or a server.
 *
 * Every function is pure (no state, no I/O, no globals; thread-safe), so the parser is
 * fuzzed (tests/fuzz/fuzz_request.c) and tested without a socket. Every refusal fills a
 * pkv_openai_error_t with the HTTP status and the OpenAI-style error fields; nothing is
 * allocated on failure.
 *
 * Strictness: unknown top-level fields are refused (as OpenAI does: "unrecognized
 * request argument"); fields that are part of the OpenAI surface but not implemented
 * (n > 1, logprobs, penalties, tools, ...) are accepted only at their no-op values;
 * every known field is type-checked and range-checked.
 */
#ifndef PKV_OPENAI_OPENAI_H
#define PKV_OPENAI_OPENAI_H

#include "pagekv/engine.h"
#include "pagekv/tokenizer.h"

#include <jansson.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    PKV_OPENAI_COMPLETIONS = 0, /* POST /v1/completions */
    PKV_OPENAI_CHAT = 1,        /* POST /v1/chat/completions */
} pkv_openai_kind_t;

/* An error for the client: {"error": {"message", "type", "param", "code"}} with status.
 * type / code / param point to static strings. */
typedef struct {
    int status;        /* HTTP status: 400, 404, 405, 413, 429, 500, 503 */
    const char *type;  /* "invalid_request_error", "not_found_error", ... */
    const char *code;  /* "invalid_json", "missing_field", ... */
    const char *param; /* the offending field, or NULL */
    char message[320];
} pkv_openai_error_t;

void pkv_openai_error_set(pkv_openai_error_t *err, int status, const char *type, const char *code,
                          const char *param, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

#define PKV_OPENAI_MAX_MESSAGES   4096u
#define PKV_OPENAI_MAX_PROMPT_IDS (1u << 20)

/* kv_transfer_params (the field's disaggregation protocol; docs/design/disagg.md). */
typedef enum {
    PKV_OPENAI_KVT_NONE = 0, /* absent, null, or neither flag set */
    PKV_OPENAI_KVT_PREFILL =
        1,                     /* do_remote_decode: this is a prefill leg (remote_* must be null) */
    PKV_OPENAI_KVT_DECODE = 2, /* do_remote_prefill: a decode leg (remote_* name the producer) */
} pkv_openai_kvt_t;

/* A parsed request. String pointers point into the parsed JSON document, which the
 * request owns (freed by pkv_openai_request_free). */
typedef struct {
    pkv_openai_kind_t kind;
    const char *model;

    /* completions: the prompt as text (prompt_text) or as token ids (prompt_ids) */
    const char *prompt_text;
    size_t prompt_len;
    int32_t *prompt_ids; /* malloc'd; NULL when the prompt is text */
    uint32_t n_prompt_ids;

    /* chat */
    pkv_chat_msg_t *msgs; /* malloc'd; contents point into the document or into parts */
    size_t n_msgs;
    char **parts; /* malloc'd joined content of array-form messages (n_msgs entries) */
    bool add_generation_prompt;

    bool has_max_tokens;
    uint32_t max_tokens; /* >= 1 when has_max_tokens */
    float temperature;   /* [0, 2]; default 1 */
    float top_p;         /* (0, 1]; default 1 */
    bool has_seed;
    uint64_t seed;
    const char *stop[PKV_ENGINE_MAX_STOP];
    uint32_t n_stop;
    bool stream;
    bool include_usage; /* stream_options.include_usage */
    bool ignore_eos;
    int32_t priority;
    uint64_t salt; /* pkv_openai_salt of cache_salt; 0 when absent */
    pkv_openai_kvt_t kvt;
    const void *kvt_params; /* json_t * (in doc): the kv_transfer_params object, or NULL */

    void *doc; /* json_t *: the parsed body */
} pkv_openai_request_t;

typedef struct {
    uint32_t max_context; /* prompt + max_tokens must fit; max_tokens above it is refused */
} pkv_openai_limits_t;

/* Parse `len` bytes of body for endpoint `kind`. PKV_OK with *out filled (free it with
 * pkv_openai_request_free), or PKV_ERR_INVALID with *err filled (status 400 or 404 for an
 * unknown model when `model_name` is not NULL and differs). */
int pkv_openai_request_parse(pkv_openai_kind_t kind, const char *body, size_t len,
                             const char *model_name, const pkv_openai_limits_t *lim,
                             pkv_openai_request_t *out, pkv_openai_error_t *err);
void pkv_openai_request_free(pkv_openai_request_t *r);
/* POST /v1/cache/lookup's body: a completions request (it has "prompt") or a chat request
 * (it has "messages"), parsed as pkv_openai_request_parse does for that endpoint. */
int pkv_openai_lookup_parse(const char *body, size_t len, const char *model_name,
                            const pkv_openai_limits_t *lim, pkv_openai_request_t *out,
                            pkv_openai_error_t *err);

/* The prompt as token ids (malloc'd into *ids_out, caller frees) and the effective
 * max_tokens: text prompts get BOS; chat goes through the tokenizer's chat template.
 * Refuses (PKV_ERR_INVALID, *err filled) an empty prompt, ids out of the vocabulary,
 * and prompt + max_tokens beyond max_context (context_length_exceeded, with the
 * numbers). Without max_tokens: completions get min(default_max_tokens, room left),
 * chat gets the room left. */
int pkv_openai_request_prompt(const pkv_openai_request_t *r, const pkv_tok_t *tok,
                              const pkv_openai_limits_t *lim, uint32_t default_max_tokens,
                              int32_t **ids_out, uint32_t *n_out, uint32_t *max_tokens_out,
                              pkv_openai_error_t *err);

/* ---- for fronts: the checks without a parsed request --------------------------------- */

/* What a front needs to know of a request that passed the checks. */
typedef struct {
    bool stream;                 /* "stream": true */
    bool has_kv_transfer_params; /* a non-null "kv_transfer_params" */
} pkv_openai_shape_t;

/* Check `len` bytes of body for POST /v1/completions (chat false) or
 * /v1/chat/completions as `pagekv serve` does before tokenizing: JSON, fields, types,
 * ranges (max_tokens against max_context), and the model against model_name (NULL: any).
 * PKV_OK with *shape; PKV_ERR_INVALID with *status (400 or 404) and *error_json (the
 * error document serve answers with, malloc'd NUL-terminated, the caller frees);
 * PKV_ERR_NOMEM. */
int pkv_openai_request_check(bool chat, const char *body, size_t len, const char *model_name,
                             uint32_t max_context, pkv_openai_shape_t *shape, int *status,
                             char **error_json);

/* The error document: {"error": {"message", "type", "param", "code"}} (param null when
 * NULL). _doc: a new reference (NULL on no memory); _json: compact, malloc'd
 * NUL-terminated (NULL on no memory). */
json_t *pkv_openai_error_doc(const pkv_openai_error_t *err);
char *pkv_openai_error_json(const char *type, const char *code, const char *param,
                            const char *message);

/* The prefix-cache salt of a cache_salt string (len bytes): the first 8 bytes of its
 * SHA-256, never 0 (0 is the request without a cache_salt). */
uint64_t pkv_openai_salt(const char *cache_salt, size_t len);

#endif
