/*
 * server generation output: turns the engine's reads of one request into the text and
 * figures a response carries, the same way for streamed and non-streamed responses.
 *
 * Two jobs the engine does not do:
 *   - Stop ids beyond EOS. The engine ends a request on one eos id; the tokenizer may
 *     have more ids that end a turn (pkv_tok_is_stop: the builtin's <|end|>). When one
 *     is generated, the completion ends there: the text is cut at the bytes of the
 *     tokens before it (the engine's text is the concatenation of pkv_tok_decode_token
 *     pieces, so the cut point is exact), completion_tokens counts up to and including
 *     the stop id, finish_reason is "stop", and the caller cancels the engine request
 *     (tokens the engine produced after it are dropped).
 *   - Valid UTF-8 for JSON. A byte-level model can emit any bytes; each maximal invalid
 *     subsequence becomes U+FFFD. The engine never splits a possibly-valid sequence
 *     between reads (it holds an incomplete one back until the finish), so sanitizing
 *     piece by piece gives the same text as sanitizing the whole: streamed and
 *     non-streamed responses agree byte for byte.
 *
 * Pure: no I/O, no locks; the tokenizer is immutable.
 */
#ifndef PKV_SERVER_GEN_H
#define PKV_SERVER_GEN_H

#include "pagekv/engine.h"
#include "pagekv/tokenizer.h"

typedef struct {
    const pkv_tok_t *tok;
    bool stop_ids;        /* end at tokenizer stop ids other than eos_id */
    int32_t eos_id;       /* the engine's own stop id */
    int32_t prev;         /* last token seen (the last prompt token at first) */
    uint32_t n_tokens;    /* generated tokens seen (up to a stop id) */
    uint64_t token_bytes; /* text bytes of those tokens */
    uint64_t raw;         /* engine text bytes received */
    bool stopped;         /* a stop id ended the completion */
    uint64_t stop_bytes;  /* text bytes before it */
    uint32_t stop_tokens; /* tokens up to and including it */
    bool finished;
    pkv_finish_t finish; /* the engine's */
    int status;
    uint32_t prompt_tokens, cached_tokens, completion_tokens, preemptions;
} pkv_server_gen_t;

void pkv_server_gen_init(pkv_server_gen_t *g, const pkv_tok_t *tok, int32_t eos_id,
                         int32_t last_prompt_id, bool stop_ids);
/* Take one read: *text / *len is the part of o->text to pass on (raw bytes; sanitize
 * before putting it in JSON). Returns true exactly once, when a stop id has just ended
 * the completion: the caller should cancel the engine request. */
bool pkv_server_gen_feed(pkv_server_gen_t *g, const pkv_request_output_t *o, const char **text,
                         size_t *len);
/* After the finishing read: "stop" or "length", or NULL when the request ended otherwise
 * (cancelled or failed: see g->finish and g->status). */
const char *pkv_server_gen_finish_reason(const pkv_server_gen_t *g);

/* Bytes pkv_server_utf8_sanitize may write for `len` input bytes. */
#define PKV_SERVER_UTF8_MAX(len) ((len)*3)
/* Copy `len` bytes to `out` (room for PKV_SERVER_UTF8_MAX(len)), replacing each maximal
 * invalid subpart (Unicode 15, 3.9) with U+FFFD. Returns the bytes written. */
size_t pkv_server_utf8_sanitize(const char *in, size_t len, char *out);

#endif
