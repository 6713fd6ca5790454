/*
 * pagekv engine: continuous batching of generation requests over one model and one KV
 * cache (paged or dense).
 *
 * A request is submitted from any thread (prompt ids, sampling parameters, priority)
 * into a bounded queue. The engine's run loop (its own thread, "pkv-engine") admits
 * queued requests while fewer than max_batch_size run, creating each sequence with its
 * prompt pre-sized (pkv_seq_create with reserve_tokens) and adopting the longest cached
 * prefix; then, every step, it gives each running sequence its next token (decode) and
 * feeds prompts in chunks (chunked prefill) within a token budget, runs one forward pass
 * over the batch, samples, and publishes new tokens and text.
 *
 * Out of KV memory mid-step: the pool first evicts cached prefixes by itself; when that
 * is not enough the engine preempts a running request by recompute (frees its sequence,
 * puts it back in the queue with the tokens generated so far; it is re-prefilled later,
 * adopting whatever of its own blocks is still cached). Victim order: lowest priority,
 * then fewest generated tokens, then newest. The last running sequence is never
 * preempted.
 *
 * Results never depend on scheduling: a request's tokens (and logits) depend only on its
 * prompt and parameters (the model is batch-invariant and sampling uses the request's
 * own seeded RNG), so the paged and dense backends produce bitwise-identical output
 * whatever the arrival order, batch size, budget, prefix hits or preemptions.
 *
 * Output is read by polling (pkv_request_read blocks up to an absolute deadline); an
 * optional notify callback tells an event loop that output is ready. The engine never
 * calls back while holding a lock, and the callback must not block.
 *
 * Threads and locks: one engine mutex guards the queue, every request's published
 * output and state, and the counters; the run loop does model work without it.
 * Requests hold a reference on the engine's shared core, so a request handle stays valid
 * (finished) after pkv_engine_destroy until it is released.
 */
#ifndef PAGEKV_ENGINE_H
#define PAGEKV_ENGINE_H

#include "pagekv/export.h"

#include "pagekv/kv.h"
#include "pagekv/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pkv_engine pkv_engine_t;
typedef struct pkv_request pkv_request_t;

/* The bytes token `id` contributes after `prev_id` (-1 at the start); the same contract
 * as pkv_tok_decode_token (tokenizer.h). Called from the run loop, never under a lock. */
typedef int (*pkv_engine_detok_fn)(void *arg, int32_t prev_id, int32_t id, const char **bytes,
                                   size_t *len);

#define PKV_ENGINE_MAX_EOS 8

typedef struct {
    pkv_model_t *model;        /* borrowed: used only by the run loop */
    pkv_kv_t *kv;              /* borrowed: geometry must match the model */
    uint32_t max_batch_size;   /* sequences running at once; 0 -> 8 */
    uint32_t max_queue;        /* requests waiting; 0 -> 256; beyond: PKV_ERR_BUSY */
    uint32_t prefill_chunk;    /* prompt tokens per sequence per step; 0 -> 256 */
    uint32_t step_tokens;      /* tokens per step over the batch; 0 -> 512 (>= max_batch_size) */
    uint32_t reserve_ahead;    /* generation positions reserved at admission (capped by
                                  max_tokens); 0 -> none beyond the first */
    const int32_t *eos_ids;    /* ids that end a generation (copied; e.g. EOS and <|end|>) */
    uint32_t n_eos_ids;        /* at most PKV_ENGINE_MAX_EOS */
    pkv_engine_detok_fn detok; /* optional: text output and stop strings need it */
    void *detok_arg;
    bool manual; /* no run thread: the caller drives pkv_engine_step */
} pkv_engine_config_t;

/* Create the engine (and, unless manual, start its run loop). */
PKV_API int pkv_engine_create(const pkv_engine_config_t *cfg, pkv_engine_t **out);
/* Stop the run loop (joined), cancel every queued and running request (finish reason
 * cancelled, status PKV_ERR_SHUTDOWN), free their sequences. Request handles remain
 * valid until released. NULL is a no-op. */
PKV_API void pkv_engine_destroy(pkv_engine_t *e);

#define PKV_ENGINE_MAX_STOP     4
#define PKV_ENGINE_MAX_STOP_LEN 128

typedef struct {
    const int32_t *prompt;   /* copied */
    uint32_t n_prompt;       /* >= 1 */
    uint32_t max_tokens;     /* >= 1; n_prompt + max_tokens <= the model's max_seq_len */
    float temperature;       /* 0: greedy (argmax); else sample */
    float top_p;             /* nucleus: (0, 1]; 0 -> 1 */
    uint64_t seed;           /* the request's RNG seed (sampling only) */
    int32_t priority;        /* higher is admitted first and preempted last */
    uint64_t salt;           /* per-tenant prefix-cache salt */
    const char *const *stop; /* up to PKV_ENGINE_MAX_STOP strings (copied); need detok */
    uint32_t n_stop;
    bool ignore_eos;
    bool want_logits; /* keep each generated token's logits (tests, debugging) */
    /* Paged backend only: on a stop or length finish the blocks holding the prompt's
     * positions (ceil(n_prompt / block_tokens), in sequence order) stay pinned for the
     * caller (pkv_request_kept_blocks) when the sequence is freed; the pins drop with the
     * request's last reference (pkv_request_release), so the KV cache must outlive it.
     * Full blocks are prefix-cache blocks as usual once unpinned. */
    bool keep_blocks;
    /* Optional: a sequence of this engine's KV cache that holds the K/V of the prompt's first
     * pkv_seq_length(seq) tokens (fewer than n_prompt; made with the prompt's tokens and
     * salt, as a disaggregated decode leg's pull makes it, its last block possibly
     * partial). The first admission takes it in place of the prefix cache's match and
     * computes from there (a preempted request recomputes as any other). On PKV_OK the
     * engine owns it, freed with the request whatever its outcome; otherwise the caller
     * still does. */
    pkv_seq_t *seq;
    /* Optional, with seq holding every prompt position (pkv_seq_length(seq) == n_prompt):
     * the first output token, sampled elsewhere from the prompt's last logits with this
     * request's temperature, top_p and seed (a disaggregated prefill node's). The first
     * admission emits it as if the engine had sampled it (the RNG advanced past its draw,
     * EOS, stop strings and max_tokens checked) and computes on from it, so the output is
     * the one the engine would give computing the last prompt position itself. Not with
     * want_logits. */
    bool first_given;
    int32_t first_token;
    /* Called from the run loop after new output or the finish was published, outside
     * every lock. Must not block; may call pkv_request_read/cancel/release. */
    void (*notify)(void *arg);
    void *notify_arg;
} pkv_request_params_t;

/* Queue a request. PKV_ERR_BUSY: the queue is full; PKV_ERR_SHUTDOWN: draining or
 * stopped; PKV_ERR_NOFIT: the prompt alone exceeds the KV budget; PKV_ERR_INVALID: bad
 * parameters (logged). On success *out is the caller's reference (release it). */
PKV_API int pkv_engine_submit(pkv_engine_t *e, const pkv_request_params_t *p, pkv_request_t **out);

typedef enum {
    PKV_FINISH_NONE = 0,
    PKV_FINISH_STOP = 1,      /* EOS or a stop string */
    PKV_FINISH_LENGTH = 2,    /* max_tokens */
    PKV_FINISH_CANCELLED = 3, /* pkv_request_cancel/release or engine shutdown */
    PKV_FINISH_ERROR = 4,     /* see status (e.g. PKV_ERR_NOFIT at admission) */
} pkv_finish_t;
PKV_API const char *pkv_finish_name(pkv_finish_t f); /* "stop", "length", "cancelled", "error" */

typedef struct {
    const int32_t *tokens; /* tokens generated since the previous read */
    uint32_t n_tokens;
    const char *text; /* text since the previous read: never part of a stop string,
                         never a split UTF-8 sequence (until the finish flushes) */
    size_t text_len;
    const float *logits; /* want_logits: n_tokens x vocab_size, else NULL */
    bool finished;       /* set once, on the read that returns the last output */
    pkv_finish_t finish;
    int status; /* PKV_OK, or why for PKV_FINISH_ERROR / CANCELLED */
    uint32_t prompt_tokens;
    uint32_t cached_tokens; /* prompt tokens adopted from the prefix cache at admission */
    uint32_t completion_tokens;
    uint32_t preemptions;
    uint64_t admitted_ns; /* when the request was first admitted (pkv_now_ns's clock,
                             CLOCK_MONOTONIC); 0 while it waits in the queue */
} pkv_request_output_t;

/* Wait until the request has output not read yet (or has finished) or the absolute
 * deadline passes: PKV_OK with *out filled (pointers valid until the request is
 * released), or PKV_ERR_TIMEOUT. After the read that reported finished, further reads
 * return PKV_OK with finished set and nothing new. One reader per request. */
PKV_API int pkv_request_read(pkv_request_t *r, uint64_t deadline_ns, pkv_request_output_t *out);
/* Cancel: a queued request finishes at once; a running one at the end of the current
 * step, its sequence freed then. No-op once finished. */
PKV_API void pkv_request_cancel(pkv_request_t *r);
/* Drop the caller's reference (cancels an unfinished request). NULL is a no-op. */
PKV_API void pkv_request_release(pkv_request_t *r);
/* keep_blocks: the pinned prompt blocks of a request that finished with stop or length
 * (*ids valid until release). PKV_ERR_NOTFOUND when it kept none (not keep_blocks, not
 * finished yet, cancelled or failed). */
PKV_API int pkv_request_kept_blocks(pkv_request_t *r, const uint32_t **ids, uint32_t *n);

typedef struct {
    uint32_t queued;
    uint32_t running;
    uint64_t submitted;
    uint64_t rejected_busy;
    uint64_t finished_stop, finished_length, finished_cancelled, finished_error;
    uint64_t preemptions;
    uint64_t prompt_tokens;    /* of admitted requests (first admission) */
    uint64_t cached_tokens;    /* of those, adopted from the prefix cache */
    uint64_t recompute_tokens; /* tokens re-prefilled after preemption */
    uint64_t generated_tokens;
    uint64_t steps;
    uint64_t forward_ns; /* time in the model's forward pass */
} pkv_engine_stats_t;
PKV_API void pkv_engine_stats(pkv_engine_t *e, pkv_engine_stats_t *out);

/* Manual mode only: run one scheduling step (admission, one forward pass, sampling).
 * *busy (optional) is set to whether requests remain queued or running. */
PKV_API int pkv_engine_step(pkv_engine_t *e, bool *busy);

/* Stop accepting requests (submit returns PKV_ERR_SHUTDOWN) and wait until every queued
 * and running request has finished, or the deadline: PKV_OK / PKV_ERR_TIMEOUT. In manual
 * mode the caller's thread runs the steps. */
PKV_API int pkv_engine_drain(pkv_engine_t *e, uint64_t deadline_ns);

#ifdef __cplusplus
}
#endif
#endif
