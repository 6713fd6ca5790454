/*
 * pagekv — KV-cache memory for LLM serving.
 *
 * The small shared pieces every module uses: one status type, logging with levels
 * and a pluggable sink, absolute monotonic deadlines. Module APIs live in their own
 * headers (kv.h: the KV cache with its paged and dense backends).
 *
 * Conventions: functions return PKV_OK (0) or a negative pkv_status_t; output
 * parameters are written only on success; _create/_destroy allocate, destroy(NULL) is
 * a no-op; deadlines are absolute CLOCK_MONOTONIC nanoseconds.
 */
#ifndef PAGEKV_PAGEKV_H
#define PAGEKV_PAGEKV_H

#include "pagekv/export.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PKV_VERSION_MAJOR  0
#define PKV_VERSION_MINOR  1
#define PKV_VERSION_PATCH  0
#define PKV_VERSION_STRING "0.1.0"

typedef enum {
    PKV_OK = 0,
    PKV_ERR_INVALID = -1,   /* bad argument or input */
    PKV_ERR_NOMEM = -2,     /* the OS refused memory */
    PKV_ERR_NOSPACE = -3,   /* not enough free capacity now; may succeed later */
    PKV_ERR_NOFIT = -4,     /* can never fit: larger than the budget / arena / cap */
    PKV_ERR_TIMEOUT = -5,   /* the deadline passed */
    PKV_ERR_SHUTDOWN = -6,  /* the object is shutting down */
    PKV_ERR_CANCELLED = -7, /* cancelled by the caller */
    PKV_ERR_NOTFOUND = -8,  /* no such id / key */
    PKV_ERR_BUSY = -9,      /* in use; try again */
    PKV_ERR_IO = -10,       /* an OS or I/O call failed */
    PKV_ERR_PEER_LOST = -11,
    PKV_ERR_REJECTED = -12,
    PKV_ERR_CORRUPT = -13,
    PKV_ERR_PROTO = -14, /* malformed or unsupported message */
    PKV_ERR_UNSUPPORTED = -15,
} pkv_status_t;

/* A static, human-readable name for a status ("ok", "nofit", ...). Never NULL. */
PKV_API const char *pkv_status_str(int status);

PKV_API const char *pkv_version(void);

/* ---- logging ---------------------------------------------------------------------- */
typedef enum {
    PKV_LOG_ERROR = 0,
    PKV_LOG_WARN = 1,
    PKV_LOG_INFO = 2,
    PKV_LOG_DEBUG = 3,
} pkv_log_level_t;

/* A sink receives one formatted line (no trailing newline). It may be called from any
 * thread, concurrently; it must not call back into pagekv. */
typedef void (*pkv_log_sink_fn)(void *arg, pkv_log_level_t level, const char *module,
                                const char *line);

/* Install a sink (NULL restores the default: stderr). Returns nothing; thread-safe. */
PKV_API void pkv_log_set_sink(pkv_log_sink_fn fn, void *arg);
/* Messages above this level are dropped before formatting. Default: PKV_LOG_WARN,
 * or the value of PKV_LOG=error|warn|info|debug at first use. */
PKV_API void pkv_log_set_level(pkv_log_level_t level);
PKV_API pkv_log_level_t pkv_log_get_level(void);
PKV_API void pkv_log(pkv_log_level_t level, const char *module, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- time ------------------------------------------------------------------------- */
/* CLOCK_MONOTONIC in nanoseconds. */
PKV_API uint64_t pkv_now_ns(void);
/* An absolute deadline `timeout_ns` from now (saturating). */
PKV_API uint64_t pkv_deadline_after_ns(uint64_t timeout_ns);
#define PKV_DEADLINE_NEVER UINT64_MAX

#ifdef __cplusplus
}
#endif
#endif
