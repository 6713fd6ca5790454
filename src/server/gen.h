/*
 * server generation output: turns the engine's reads of one request into the text and
 * figures a response carries, the same way for streamed and non-streamed responses.
 *
 * Stop ids (EOS and the builtin's <|end|>) are the engine's job (pkv_engine_config_t
 * eos_ids); what is left here is valid UTF-8 for JSON. A byte-level model can emit any
 * bytes; each maximal invalid subsequence becomes U+FFFD. The engine never splits a
 * possibly-valid sequence between reads (it holds an incomplete one back until the
 * finish), so sanitizing piece by piece gives the same text as sanitizing the whole:
 * streamed and non-streamed responses agree byte for byte.
 *
 * Pure: no I/O, no locks.
 */
#ifndef PKV_SERVER_GEN_H
#define PKV_SERVER_GEN_H

#include "pagekv/engine.h"

typedef struct {
    bool finished;
    pkv_finish_t finish; /* the engine's */
    int status;
    uint32_t prompt_tokens, cached_tokens, completion_tokens, preemptions;
    bool tier;            /* the server has a disk tier: usage says what came from it */
    uint32_t disk_tokens; /* prompt tokens loaded from the disk tier for this request */
} srv_gen_t;

void srv_gen_init(srv_gen_t *g);
/* Take one read: *text / *len is the part of o->text to pass on (raw bytes; sanitize
 * before putting it in JSON); the figures are recorded from the finishing read. */
void srv_gen_feed(srv_gen_t *g, const pkv_request_output_t *o, const char **text, size_t *len);
/* After the finishing read: "stop" or "length", or NULL when the request ended otherwise
 * (cancelled or failed: see g->finish and g->status). */
const char *srv_gen_finish_reason(const srv_gen_t *g);

/* Bytes srv_utf8_sanitize may write for `len` input bytes. */
#define SRV_UTF8_MAX(len) ((len)*3)
/* Copy `len` bytes to `out` (room for SRV_UTF8_MAX(len)), replacing each maximal
 * invalid subpart (Unicode 15, 3.9) with U+FFFD. Returns the bytes written. */
size_t srv_utf8_sanitize(const char *in, size_t len, char *out);

#endif
