/*
 * pagekv server: an OpenAI-compatible HTTP/1.1 server over the engine (`pagekv serve`).
 *
 * One pkv_server_t owns the whole stack: the model (a built-in preset or a llama2.c
 * checkpoint), its tokenizer, the KV cache (paged or dense, under a byte budget), the
 * continuous-batching engine, and the HTTP daemon (libmicrohttpd, one thread per
 * connection, connections capped).
 *
 * Endpoints
 *   POST /v1/completions, POST /v1/chat/completions   (non-streaming, or server-sent
 *        events with "stream": true: `data: {...}` chunks, then `data: [DONE]`)
 *   GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text),
 *        /v1/cache/stats (JSON)
 *   POST /v1/cache/reset (drop every cached prefix block)
 * Errors are {"error": {"message", "type", "param", "code"}} with the fitting status;
 * a refused request changes nothing in the server's state.
 *
 * Lifecycle: pkv_server_create listens at once; pkv_server_quiesce stops accepting
 * (new connections are refused, new requests on open connections get 503) and
 * pkv_server_wait_idle waits for the requests in flight; pkv_server_destroy cancels
 * whatever is still running and frees everything.
 *
 * Thread safety: every function may be called from any thread; quiesce, wait_idle and
 * destroy are for the owner (destroy last, once).
 */
#ifndef PAGEKV_SERVER_H
#define PAGEKV_SERVER_H

#include "pagekv/export.h"

#include "pagekv/kv.h"
#include "pagekv/stage.h"

#ifdef __cplusplus
extern "C" {
#endif

/* pkv_server_config_t.staging_warm_ms: no staging warm floor. */
#define PKV_SERVER_STAGING_WARM_NONE UINT32_MAX

typedef struct pkv_server pkv_server_t;

typedef enum {
    PKV_SERVER_BUDGET_AUTO = 0, /* max_batch_size x max_context tokens of KV, at most half
                                   the machine's memory */
    PKV_SERVER_BUDGET_NONE = 1, /* no cap */
    PKV_SERVER_BUDGET_BYTES = 2 /* budget_bytes */
} pkv_server_budget_t;

/* A node's part in disaggregated serving (docs/design/server.md, "Roles"). */
typedef enum {
    PKV_SERVER_ROLE_UNIFIED = 0, /* prefill and decode here; no transfer agent */
    PKV_SERVER_ROLE_PREFILL = 1, /* computes prompts and hands their KV to decode nodes */
    PKV_SERVER_ROLE_DECODE = 2,  /* pulls a prompt's KV from a prefill node and decodes */
} pkv_server_role_t;
/* "unified" / "prefill" / "decode"; parse: PKV_ERR_INVALID for another name. */
PKV_API const char *pkv_server_role_name(pkv_server_role_t role);
PKV_API int pkv_server_role_parse(const char *name, pkv_server_role_t *out);

typedef struct {
    /* HTTP */
    const char *host;         /* NULL -> "127.0.0.1" (numeric IPv4/IPv6 or a name) */
    uint16_t port;            /* 0 -> an ephemeral port (pkv_server_port tells which) */
    uint32_t max_connections; /* 0 -> 256 */
    uint64_t max_body_bytes;  /* request bodies above it get 413; 0 -> 4 MiB */
    uint32_t retry_after_s;   /* Retry-After on 429; 0 -> 1 */
    /* model: a preset, or a llama2.c checkpoint with its tokenizer */
    const char *preset;         /* NULL -> "tiny" (used when model_path is NULL) */
    const char *model_path;     /* llama2.c checkpoint */
    const char *tokenizer_path; /* llama2.c tokenizer.bin (required with model_path) */
    const char *served_name;    /* the "model" requests must name; NULL -> the preset
                                   name or the checkpoint's file name */
    uint64_t weight_seed;       /* built-in weights; 0 -> 1 */
    uint32_t threads;           /* model threads; 0 -> online CPUs, at most 8 */
    /* KV cache */
    pkv_backend_t backend;
    pkv_dtype_t kv_dtype;
    uint32_t block_tokens; /* 0 -> 16 */
    pkv_server_budget_t budget_mode;
    uint64_t budget_bytes; /* with PKV_SERVER_BUDGET_BYTES */
    bool no_prefix_cache;
    uint32_t tp;       /* tensor-parallel ranks of the KV (pkv_kv_tp_check against the model's KV
                          heads); 0 -> 1. Prefill and decode nodes run one transfer agent and
                          staging per rank (rank r on kv_listen_port + r when a port is given) */
    bool no_hugepages; /* paged: do not ask for transparent huge pages (by default the pool
                          asks where the kernel's THP mode is `always` or `madvise`) */
    /* engine */
    uint32_t max_batch_size;     /* 0 -> 8 */
    uint32_t max_queue;          /* requests waiting beyond the batch; 0 -> 256 */
    uint32_t max_context;        /* prompt + completion tokens; 0 -> the model's length */
    uint32_t prefill_chunk;      /* 0 -> the engine's default */
    uint32_t default_max_tokens; /* /v1/completions without max_tokens; 0 -> 16 */
    /* roles: prefill and decode start a transfer agent (the fields below); unified
       ignores them */
    pkv_server_role_t role;
    const char *kv_listen_host;      /* the agent's address; NULL -> "127.0.0.1" */
    uint16_t kv_listen_port;         /* 0 -> a free port */
    const char *kv_advertise;        /* remote_host put in responses; NULL -> the bound host */
    pkv_stage_mode_t staging_mode;   /* per_transfer (default) or fixed slots */
    uint32_t staging_pages;          /* per_transfer: arena pages; fixed: pages per slot;
                                        0 -> one max-context transfer (+2 pages) */
    uint32_t staging_slots;          /* fixed: slots; 0 -> 4 */
    uint64_t staging_page_bytes;     /* staging page size, a multiple of 4096; 0 -> 64 KiB */
    uint32_t staging_peer_cap;       /* pages one peer may hold; 0 = no cap */
    uint32_t staging_idle_ms;        /* per_transfer: a free staging page goes back to the
                                        OS after this long free; 0 -> 5000 */
    uint32_t staging_warm_ms;        /* per_transfer: as many pages as the largest transfer
                                        of the last this-many ms stay committed past the
                                        idle release (docs/design/stage.md, warm floor);
                                        0 -> 30000; PKV_SERVER_STAGING_WARM_NONE: none */
    bool staging_shared;             /* memfd arena same-host peers may map */
    bool staging_mirror;             /* the field's host mirror (to compare): each rank's
                                        staging is its share of the whole device pool,
                                        pinned at start and never returned */
    uint32_t kv_lease_ms;            /* prefill: blocks pinned for their decode leg; 0 -> 30000 */
    uint32_t kv_transfer_timeout_ms; /* decode: one pull's deadline; 0 -> 10000 */
    bool kv_load_recompute;          /* decode: a failed pull (not the client's fault) is
                                        answered by computing the prompt; false: an error */
    /* the prefix cache yields memory (docs/design/server.md, "Cache policy and memory
       pressure"; paged backend) */
    pkv_server_budget_t cache_max_mode; /* AUTO: a quarter of the KV budget (an eighth of
                                           the machine's memory with no budget); NONE: no
                                           cap; BYTES: cache_max_bytes */
    uint64_t cache_max_bytes;           /* committed bytes only cached blocks may hold */
    uint32_t cache_idle_ms;             /* cached blocks unused this long are evicted by a
                                           timer; 0 -> 300000 (5 min); PKV_SERVER_NEVER: no
                                           time-to-live */
    bool no_memory_watch;               /* do not watch the memory left to the process */
    uint64_t kv_warm_max_bytes;         /* the pool's warm floor at most (empty granules of
                                           the largest recent admission, kept committed; a
                                           decode node, or any node given a value, also has
                                           the memory watcher refill it): 0 -> auto: a
                                           quarter of the KV budget, at most 256 MiB;
                                           UINT64_MAX: none. Lapses once no admission came
                                           for the cache's idle time, at most 30 s; none
                                           without a watcher thread */
    uint64_t memory_reserve_bytes;      /* memory the cache leaves to the machine; 0 -> a
                                           tenth of the limit watched, within [32M, 1G] */
    uint32_t memory_poll_ms;            /* the watcher's period; 0 -> 250 */
    const char *memory_root;            /* tests: a directory standing for "/" for the
                                           memory readings (prim); NULL: the real files */
    /* the disk tier (docs/design/tier.md; paged backend with the prefix cache): cached
       blocks are written to segment files in kv_disk_dir and loaded back instead of
       recomputed; off when kv_disk_dir is NULL */
    const char *kv_disk_dir;   /* created 0700 when missing; one live server per directory */
    uint64_t kv_disk_bytes;    /* the directory's cap; 0 -> 1 GiB */
    uint64_t kv_disk_min_free; /* writes stop while the filesystem has less free; 0 -> 1 GiB
                                  or 5 % of the filesystem, the smaller; UINT64_MAX: none */
    uint32_t kv_disk_load_ms;  /* a load's deadline, then the rest is recomputed; 0 -> 1000 */
} pkv_server_config_t;
#define PKV_SERVER_NEVER UINT32_MAX

/* Build the stack and start listening. Errors: PKV_ERR_INVALID (bad configuration,
 * logged), PKV_ERR_IO (files, or the address cannot be bound), PKV_ERR_CORRUPT (bad
 * checkpoint), PKV_ERR_NOFIT (budget below one block), PKV_ERR_BUSY (another live server
 * owns kv_disk_dir), PKV_ERR_NOMEM. */
PKV_API int pkv_server_create(const pkv_server_config_t *cfg, pkv_server_t **out);
/* Cancel what is still in flight, stop the daemon (its threads joined), free
 * everything. NULL is a no-op. */
PKV_API void pkv_server_destroy(pkv_server_t *s);

/* The bound port. */
PKV_API uint16_t pkv_server_port(const pkv_server_t *s);

typedef struct {
    const char *model_name; /* served name */
    const char *kernels;    /* "avx2" / "portable" */
    pkv_backend_t backend;
    uint32_t max_context;
    uint32_t max_batch_size;
    uint64_t budget_bytes; /* 0 = none */
    uint64_t token_bytes;  /* KV bytes per token */
    uint32_t block_tokens;
    pkv_server_role_t role;
    const char *kv_address; /* the transfer agent's bound "host:port"; NULL when unified */
    bool hugepages;         /* the paged pool asks for transparent huge pages on commit */
    const char *thp_mode;   /* the kernel's THP mode: "always", "madvise", "never", "unknown" */
    bool huge_probe;        /* measured at startup: a 2 MiB page committed as the pool
                               commits one was a huge page (false when not asked) */
    bool huge_granules;     /* paged: the pool's granules are whole 2 MiB pages, so huge
                               pages can back them (pkv_kv_stats_t.huge_granules) */
} pkv_server_info_t;
PKV_API void pkv_server_info(const pkv_server_t *s, pkv_server_info_t *out);

/* Stop accepting: the listening socket is closed, /health answers 503, new generation
 * requests get 503; requests in flight continue. Idempotent. */
PKV_API void pkv_server_quiesce(pkv_server_t *s);
/* Wait until no generation request is in flight (each response fully sent or its
 * client gone) or the deadline: PKV_OK / PKV_ERR_TIMEOUT. */
PKV_API int pkv_server_wait_idle(pkv_server_t *s, uint64_t deadline_ns);

#ifdef __cplusplus
}
#endif
#endif
