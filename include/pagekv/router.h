/*
 * pagekv router: an OpenAI-compatible HTTP front for prefill and decode nodes
 * (`pagekv serve --role prefill|decode`), the command `pagekv route`. Design:
 * docs/design/router.md.
 *
 * For POST /v1/completions and /v1/chat/completions the router sends the prefill leg
 * (the request with max_tokens 1, stream false and the field's kv_transfer_params
 * do_remote_decode) to a prefill node, then the original request with the prefill
 * node's kv_transfer_params to a decode node, and relays the decode node's answer
 * (streamed or not). A node that is down or fails before any output reached the client
 * is replaced by another of its role within the request's deadline; output already sent
 * is never repeated. One event-loop thread serves every client connection (libmicrohttpd,
 * suspended connections) and one thread every node transfer (libcurl multi).
 */
#ifndef PAGEKV_ROUTER_H
#define PAGEKV_ROUTER_H

#include "pagekv/export.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pkv_router pkv_router_t;

typedef enum {
    PKV_ROUTER_CACHE_AWARE = 0,  /* ask every prefill node how much of the prompt it holds */
    PKV_ROUTER_LEAST_LOADED = 1, /* the node with the fewest of this router's requests */
    PKV_ROUTER_ROUND_ROBIN = 2,  /* each role's nodes in turn */
} pkv_router_policy_t;

/* "cache_aware", "least_loaded", "round_robin" (NULL for an unknown value). */
PKV_API const char *pkv_router_policy_name(pkv_router_policy_t p);
/* PKV_OK, or PKV_ERR_INVALID for any other name. */
PKV_API int pkv_router_policy_parse(const char *name, pkv_router_policy_t *out);

#define PKV_ROUTER_MAX_NODES 64 /* per role */

typedef struct {
    const char *host; /* listen address (default 127.0.0.1) */
    uint16_t port;    /* 0: a free port (pkv_router_port tells which) */
    /* Node base URLs, "http://HOST:PORT" (a trailing '/' is dropped); 1..64 per role.
     * The strings are copied. */
    const char *const *prefill;
    uint32_t n_prefill;
    const char *const *decode;
    uint32_t n_decode;
    pkv_router_policy_t policy;
    uint32_t max_connections;     /* client connections served; beyond: 503 (0 -> 4096) */
    uint64_t max_body_bytes;      /* request body limit (0 -> 4 MiB, as serve) */
    uint32_t request_timeout_ms;  /* a request's deadline for its first output, retries
                                     included (0 -> 60000) */
    uint32_t node_timeout_ms;     /* one attempt: connect, first byte, or any silence of a
                                     node mid-answer (0 -> 30000) */
    uint32_t lookup_timeout_ms;   /* cache lookups and health probes (0 -> 1000) */
    uint32_t health_interval_ms;  /* probe every node's /health this often (0 -> 1000) */
    uint32_t node_max_in_flight;  /* legs one node serves at once; more wait here (0 -> 128) */
    uint64_t stream_buffer_bytes; /* a stream's bytes waiting for a slow client before the
                                     node's transfer is paused (0 -> 256 KiB) */
} pkv_router_config_t;

/* Validate the config, bind, start the event loops. PKV_OK with *out; PKV_ERR_INVALID
 * (logged) for a bad config or URL; PKV_ERR_IO when the address cannot be bound;
 * PKV_ERR_NOMEM. Destroy with pkv_router_destroy. */
PKV_API int pkv_router_create(const pkv_router_config_t *cfg, pkv_router_t **out);
/* The bound port. */
PKV_API uint16_t pkv_router_port(const pkv_router_t *r);
/* Start draining: /health 503, every new request 503 (with Retry-After), requests in
 * flight go on. Idempotent. */
PKV_API void pkv_router_quiesce(pkv_router_t *r);
/* Wait until no request is in flight or deadline_ns (absolute, monotonic): PKV_OK or
 * PKV_ERR_TIMEOUT. */
PKV_API int pkv_router_wait_idle(pkv_router_t *r, uint64_t deadline_ns);
/* Stop: what is still in flight ends (streams with an error event), every connection
 * closes, both threads are joined. NULL is a no-op. */
PKV_API void pkv_router_destroy(pkv_router_t *r);

#ifdef __cplusplus
}
#endif

#endif
