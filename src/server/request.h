/*
 * server request parsing: an HTTP body (JSON) -> a generation request, and the request's
 * prompt -> token ids within the server's limits.
 *
 * Both steps are pure functions of their inputs (no server state, no I/O, no globals),
 * so they can be fuzzed (tests/fuzz/fuzz_request.c) and tested without a socket. Every
 * refusal fills a srv_error_t with the HTTP status and the OpenAI-style error
 * fields; nothing is allocated on failure.
 *
 * Strictness: unknown top-level fields are refused (as OpenAI does: "unrecognized
 * request argument"); fields that are part of the OpenAI surface but not implemented
 * (n > 1, logprobs, penalties, tools, ...) are accepted only at their no-op values;
 * every known field is type-checked and range-checked.
 */
#ifndef PKV_SERVER_REQUEST_H
#define PKV_SERVER_REQUEST_H

#include "pagekv/engine.h"
#include "pagekv/tokenizer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    SRV_REQ_COMPLETIONS = 0, /* POST /v1/completions */
    SRV_REQ_CHAT = 1,        /* POST /v1/chat/completions */
} srv_req_kind_t;

/* An error for the client: {"error": {"message", "type", "param", "code"}} with status.
 * type / code / param point to static strings. */
typedef struct {
    int status;        /* HTTP status: 400, 404, 405, 413, 429, 500, 503 */
    const char *type;  /* "invalid_request_error", "not_found_error", ... */
    const char *code;  /* "invalid_json", "missing_field", ... */
    const char *param; /* the offending field, or NULL */
    char message[320];
} srv_error_t;

void srv_error_set(srv_error_t *err, int status, const char *type, const char *code,
                   const char *param, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

#define SRV_REQ_MAX_MESSAGES   4096u
#define SRV_REQ_MAX_PROMPT_IDS (1u << 20)

/* kv_transfer_params (the field's disaggregation protocol; docs/design/server.md). */
typedef enum {
    SRV_KVT_NONE = 0,    /* absent, null, or neither flag set */
    SRV_KVT_PREFILL = 1, /* do_remote_decode: this is a prefill leg (remote_* must be null) */
    SRV_KVT_DECODE = 2,  /* do_remote_prefill: a decode leg (remote_* name the producer) */
} srv_kvt_mode_t;

/* A parsed request. String pointers point into the parsed JSON document, which the
 * request owns (freed by srv_request_free). */
typedef struct {
    srv_req_kind_t kind;
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
    uint64_t salt; /* SHA-256 of cache_salt (first 8 bytes); 0 when absent */
    srv_kvt_mode_t kvt;
    const void *kvt_params; /* json_t * (in doc): the kv_transfer_params object, or NULL */

    void *doc; /* json_t *: the parsed body */
} srv_request_t;

typedef struct {
    uint32_t max_context; /* prompt + max_tokens must fit; max_tokens above it is refused */
} srv_limits_t;

/* Parse `len` bytes of body for endpoint `kind`. PKV_OK with *out filled (free it with
 * srv_request_free), or PKV_ERR_INVALID with *err filled (status 400 or 404 for an
 * unknown model when `model_name` is not NULL and differs). */
int srv_request_parse(srv_req_kind_t kind, const char *body, size_t len, const char *model_name,
                      const srv_limits_t *lim, srv_request_t *out, srv_error_t *err);
void srv_request_free(srv_request_t *r);
/* POST /v1/cache/lookup's body: a completions request (it has "prompt") or a chat request
 * (it has "messages"), parsed as srv_request_parse does for that endpoint. */
int srv_request_parse_lookup(const char *body, size_t len, const char *model_name,
                             const srv_limits_t *lim, srv_request_t *out, srv_error_t *err);

/* The prompt as token ids (malloc'd into *ids_out, caller frees) and the effective
 * max_tokens: text prompts get BOS; chat goes through the tokenizer's chat template.
 * Refuses (PKV_ERR_INVALID, *err filled) an empty prompt, ids out of the vocabulary,
 * and prompt + max_tokens beyond max_context (context_length_exceeded, with the
 * numbers). Without max_tokens: completions get min(default_max_tokens, room left),
 * chat gets the room left. */
int srv_request_prompt(const srv_request_t *r, const pkv_tok_t *tok, const srv_limits_t *lim,
                       uint32_t default_max_tokens, int32_t **ids_out, uint32_t *n_out,
                       uint32_t *max_tokens_out, srv_error_t *err);

#endif
