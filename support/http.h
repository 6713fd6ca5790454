/*
 * The one HTTP client of the benchmarks, `pagekv demo` and the tests (support/: compiled
 * once into build/libpkvsupport.a), on libcurl: http_send runs one request to its end
 * (the easy interface); http_batch_run runs many at once from one thread (the multi
 * interface), either up to `concurrency` in flight (closed loop: the next starts when one
 * ends) or each at its own time offset (open loop: arrivals never wait for answers).
 * The whole body is kept, with the times a benchmark reports. No proxy is ever used.
 */
#ifndef PKV_SUPPORT_HTTP_H
#define PKV_SUPPORT_HTTP_H

#include <jansson.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *base_url;                    /* "http://HOST:PORT" */
    const char *path;                        /* "/v1/chat/completions", ... */
    const char *method;                      /* NULL: POST with a body, else GET; "HEAD" asks
                                                for no body; any other is sent as named */
    const char *body;                        /* NULL: none; a body (and any POST) is sent with
                                                Content-Type: application/json */
    size_t body_len;                         /* 0: strlen(body) */
    const char *const *headers;              /* extra "Name: value", NULL-terminated; may be NULL */
    uint32_t timeout_ms;                     /* the whole exchange; 0: none */
    uint32_t connect_timeout_ms;             /* 0: libcurl's */
    const volatile sig_atomic_t *abort_flag; /* ends it early once nonzero; may be NULL */
    bool hang_up;                            /* end it at the first body bytes (a client
                                                that goes away: got_data says they came) */
    bool keep_headers;                       /* keep the response headers in out->headers */
    int recv_buffer_bytes;                   /* the socket's SO_RCVBUF (a client that reads
                                                slowly fills it soon); 0: the system's */
    /* Called on the sending thread after each piece of body is kept: body[0..len) so far,
     * the last `added` bytes new. Returning false ends the exchange there (a client that
     * goes away: CURLE_WRITE_ERROR). May be NULL. */
    bool (*on_body)(void *arg, const char *body, size_t len, size_t added);
    void *on_body_arg;
} http_request_t;

typedef struct {
    long status;   /* HTTP status; 0 when no answer came */
    int curl_code; /* libcurl's CURLcode, 0 (CURLE_OK) when the exchange completed */
    char *body;    /* the whole body, NUL-terminated; NULL when none (http_reply_free) */
    char *headers; /* the response headers as received, NUL-terminated, when the request
                      asked to keep them; else NULL (http_reply_free) */
    size_t len;
    double seconds;                           /* libcurl's total time */
    double ttfb_seconds;                      /* libcurl's time to the first response byte */
    uint64_t start_ns, first_byte_ns, end_ns; /* monotonic: sent (0: never sent), first body
                                                 byte (0: none), ended */
    bool got_data;                            /* some body bytes came */
    char error[256];                          /* transport error, "" when the exchange completed */
} http_reply_t;

/* One request to its end. 0 when it completed (any status), -1 otherwise (out->error says
 * why; out->status is what came before the failure, if anything). out is set either way:
 * free it with http_reply_free. */
int http_send(const http_request_t *rq, http_reply_t *out);
void http_reply_free(http_reply_t *r);

typedef struct {
    uint32_t concurrency; /* in flight at once; 0: open loop, each at its at_s */
    const double *at_s;   /* open loop: request i is sent at_s[i] seconds after the start */
    const volatile sig_atomic_t *stop;    /* ends the run early: requests not sent keep
                                             start_ns 0; those in flight are aborted */
    const atomic_int *drain;              /* once nonzero (any thread may set it): nothing
                                             more is sent (start_ns stays 0), those in
                                             flight run to their end; may be NULL */
    void (*tick)(void *arg, size_t done); /* about every 50 ms (done: requests ended so far);
                                             may be NULL */
    void *tick_arg;
} http_batch_t;

/* Run reqs[0..n), replies[i] for reqs[i] (each set, free with http_replies_free). Returns
 * the wall time in seconds, or a negative value when the run could not start or a request
 * could not be sent. */
double http_batch_run(const http_batch_t *b, const http_request_t *reqs, size_t n,
                      http_reply_t *replies);
void http_replies_free(http_reply_t *r, size_t n);

/* POST body (serialized compactly; NULL: GET) to base_url + path with the headers (may be
 * NULL), within timeout_ms; abort_flag may be NULL. Returns 0 when an HTTP answer came
 * (any status), -1 otherwise (out->error says why, out->status is 0 and out->body NULL). */
int http_call(const char *base_url, const char *path, const json_t *body,
              const char *const headers[], uint32_t timeout_ms,
              const volatile sig_atomic_t *abort_flag, http_reply_t *out);
/* POST body (NULL: GET) to base_url + path and parse the answer: NULL unless 200 and
 * valid JSON (new reference). */
json_t *http_json(const char *base_url, const char *path, const json_t *body, uint32_t timeout_ms);
/* http_json's GET. */
json_t *http_get_json(const char *base_url, const char *path, uint32_t timeout_ms);

#endif
