/*
 * An HTTP load driver for the serving benchmarks (support/: build/libpkvsupport.a).
 *
 * One thread, the HTTP client's batch (support/http.h): up to `concurrency` requests in flight
 * (closed loop: the next starts when one ends), or each request sent at its own time offset (open
 * loop: arrivals never wait for answers). Per request it records the status, the time to the first
 * body byte (for a streamed answer: the first event, which the servers send once the first token
 * exists: the TTFT), the total time, and the answer as cluster_answer_parse reads it; on
 * request, when each streamed event that carries text came (the inter-token gaps).
 */
#ifndef PKV_SUPPORT_LOADGEN_H
#define PKV_SUPPORT_LOADGEN_H

#include "support/cluster.h"

#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *path; /* "/v1/chat/completions", ... */
    char *body;       /* JSON text, owned by the caller */
    bool stream;
    double at_s; /* open loop: seconds after the start it is sent; ignored closed */
} lg_req_t;

typedef struct {
    long status;            /* HTTP status, 0 when no answer came */
    double start_s;         /* when it was sent, seconds after the run's start */
    double ttft_s, total_s; /* first body byte, end; from start_s */
    cluster_answer_t
        answer; /* text, finish, usage, error code (parse failures: error_code "unreadable") */
    char transport[96]; /* curl's error, "" when an answer came */
    char excerpt[256];  /* the body's start when it is not a good answer, else "" */
    char *body;         /* the whole body when the run asked for it (keep_body), else NULL */
    double *text_s;     /* text_times: when each streamed event carrying output text came
                           (cluster_event_has_text), seconds from start_s, in order; several
                           tokens sent in one event are one entry; NULL otherwise */
    size_t n_text;
} lg_result_t;

typedef struct {
    const char *base_url;
    uint32_t concurrency;                 /* closed loop: in flight at once; 0: open loop (at_s) */
    uint32_t timeout_ms;                  /* per request */
    const char *const *headers;           /* extra headers, NULL-terminated, may be NULL */
    const volatile sig_atomic_t *stop;    /* ends the run early (results not sent: status 0) */
    const atomic_int *drain;              /* once nonzero (any thread may set it): nothing more
                                             is sent (results not sent: status 0), those in
                                             flight run to their end; may be NULL */
    bool keep_body;                       /* keep each answer's whole body in its result */
    bool text_times;                      /* record each answer's text events (text_s) */
    void (*tick)(void *arg, size_t done); /* about every 50 ms from the driving thread (done:
                                             requests ended so far); may be NULL */
    void *tick_arg;
} lg_config_t;

/* A streamed chat completion body (JSON text, malloc'd; NULL when out of memory): one user
 * message of filler for about `tokens` prompt tokens (tokens x chars_per_token characters,
 * at least 8, from its own seed: two seeds share no prefix beyond the chat template),
 * max_tokens, temperature 0, ignore_eos, stream_options.include_usage. */
char *lg_chat_body(const char *model, uint32_t tokens, uint64_t seed, uint32_t max_tokens,
                   double chars_per_token);

/* Run every request; results[i] for reqs[i] (free with lg_results_free). Returns the
 * wall time in seconds, or a negative value when the driver could not start. */
double lg_run(const lg_config_t *cfg, const lg_req_t *reqs, size_t n, lg_result_t *results);
void lg_results_free(lg_result_t *results, size_t n);

/* The q-quantile (0..1) of v[0..n) (sorted in place), linear interpolation; 0 if n == 0. */
double lg_quantile(double *v, size_t n, double q);

#endif
