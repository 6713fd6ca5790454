/*
 * pagekv serve: the OpenAI-compatible HTTP server (include/pagekv/server.h).
 *
 * Signals: SIGTERM and SIGINT are blocked in every thread and taken by the main thread
 * with sigwait. The first one drains: the server stops accepting (the listening socket
 * closes, new requests on open connections get 503) and waits up to --drain-timeout for
 * the requests in flight to finish, then everything is torn down and the process exits
 * 0. A second signal during the drain cancels what is left at once.
 */
#include "support/cli.h"
#include "tools/commands.h"

#include "pagekv/model.h"
#include "pagekv/server.h"

#include <ctype.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: pagekv serve [options]\n"
        "\n"
        "An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions,\n"
        "/v1/models, /health, /metrics, /v1/cache/stats, /v1/cache/reset).\n"
        "With no options it serves the built-in 'tiny' model on 127.0.0.1:8000.\n"
        "\n"
        "HTTP:\n"
        "  --host ADDR               address to listen on (default 127.0.0.1)\n"
        "  --port N                  port (default 8000; 0 = pick a free one)\n"
        "  --max-connections N       concurrent connections (default 256)\n"
        "  --max-body-bytes BYTES    request body limit, K/M/G suffixes (default 4M)\n"
        "  --drain-timeout SECONDS   on SIGTERM, wait this long for requests (default 30)\n"
        "model:\n"
        "  --preset NAME             built-in model: tiny (default), llama-3.2-1b, qwen3-0.6b\n"
        "  --model FILE              llama2.c checkpoint (needs --tokenizer)\n"
        "  --tokenizer FILE          llama2.c tokenizer.bin\n"
        "  --served-model-name NAME  the name requests use (default: preset or file name)\n"
        "  --seed N                  built-in weights seed (default 1)\n"
        "  --threads N               model threads (default: CPUs, at most 8)\n"
        "KV cache:\n"
        "  --kv-backend paged|dense  (default paged)\n"
        "  --kv-dtype f32|f16|bf16|int8|fp8   (default f16; int8 and fp8 carry a scale per row)\n"
        "  --kv-cache-budget BYTES|auto|none   cap on KV memory, K/M/G suffixes (default\n"
        "                            auto: max-batch-size x max-context tokens)\n"
        "  --block-tokens N          tokens per KV block (default 16)\n"
        "  --tp N                    tensor-parallel ranks of the KV: each holds its shard of\n"
        "                            the KV heads in its own range, with its own transfer\n"
        "                            agent (rank r on the --kv-listen port + r); N divides\n"
        "                            the KV heads or is a multiple of them, <= 64 (default 1)\n"
        "  --no-prefix-cache         disable automatic prefix caching\n"
        "  --no-hugepages            do not ask for transparent huge pages for the paged\n"
        "                            pool (default: asked where THP is always/madvise)\n"
        "  --prefix-cache-max-bytes BYTES|auto|none   committed memory only cached\n"
        "                            prefix blocks may hold (default auto: a quarter of\n"
        "                            the KV budget)\n"
        "  --prefix-cache-idle-s S   cached blocks unused S seconds are evicted by a\n"
        "                            timer (default 300; 0 = never)\n"
        "  --memory-reserve BYTES    memory the cache leaves to the machine (default: a\n"
        "                            tenth of the cgroup limit or RAM, 32M..1G)\n"
        "  --no-memory-watch         do not drop cached blocks under memory pressure\n"
        "  --kv-warm-max BYTES|auto|none   empty KV memory kept committed for the next\n"
        "                            admission: the largest recent one's, at most BYTES\n"
        "                            (default auto: a quarter of the KV budget, at most\n"
        "                            256M); a decode node, or any given BYTES, also\n"
        "                            refills it in the background\n"
        "disk tier (cached blocks spill to files and load back; paged backend):\n"
        "  --kv-disk-dir DIR         the tier's directory (created 0700; off without it)\n"
        "  --kv-disk-bytes BYTES     the directory's cap, K/M/G suffixes (default 1G)\n"
        "  --kv-disk-min-free BYTES  writes stop while the filesystem has less free\n"
        "                            (default 1G or 5 %% of it, the smaller; 0 = none)\n"
        "  --kv-disk-load-ms N       a load's deadline; past it the rest is recomputed\n"
        "                            (default 1000)\n"
        "engine:\n"
        "  --max-batch-size N        sequences running at once (default 8)\n"
        "  --max-queue-depth N       requests waiting; beyond it 429 (default 256)\n"
        "  --max-context N           prompt + completion tokens (default: the model's)\n"
        "  --prefill-chunk N         prompt tokens per sequence per step (default 256)\n"
        "  --default-max-tokens N    /v1/completions without max_tokens (default 16)\n"
        "roles (disaggregated serving; docs/design/server.md):\n"
        "  --role unified|prefill|decode  (default unified: no transfer agent)\n"
        "prefill and decode roles only:\n"
        "  --kv-listen HOST:PORT     transfer agent address (default 127.0.0.1, a free\n"
        "                            port; the bound one is printed, /v1/cache/stats)\n"
        "  --kv-advertise HOST       remote_host for decode nodes (default: bound host)\n"
        "  --staging per_transfer|fixed|mirror   host staging (default per_transfer; mirror:\n"
        "                            each rank's share of the whole KV pool, pinned at start)\n"
        "  --staging-pages N         arena pages (fixed: pages per slot; default one\n"
        "                            max-context transfer + 2)\n"
        "  --staging-slots N         fixed: slots, committed and pinned at start (4)\n"
        "  --staging-page-bytes BYTES   staging page size, K/M suffixes (default 64K)\n"
        "  --staging-peer-cap N      most staging pages one peer holds (default: none)\n"
        "  --staging-shared          a memfd arena same-host peers may map\n"
        "  --staging-idle-ms N       per_transfer: a free page goes back to the OS after\n"
        "                            N ms free (default 5000)\n"
        "  --staging-warm-ms N|none  per_transfer: the pages of the largest transfer of\n"
        "                            the last N ms stay committed past the idle release\n"
        "                            (default 30000)\n"
        "  --kv-lease-ms N           prefill: pins wait for a decode leg (default 30000)\n"
        "  --kv-transfer-timeout-ms N   decode: a pull's deadline (default 10000)\n"
        "  --kv-load-failure fail|recompute   decode: a failed pull is an error (default)\n"
        "                            or the prompt is computed here\n");
}

/* --kv-listen's host (split from its port) outlives parse_args. */
static char kv_listen_host[256];

/* HOST:PORT (an IPv6 host in brackets). 0, or the exit code of a usage error. */
static int parse_listen(const char *v, pkv_server_config_t *cfg)
{
    const char *colon = strrchr(v, ':');
    uint64_t port;
    size_t len = colon ? (size_t)(colon - v) : 0;
    if (len >= 2 && v[0] == '[' && v[len - 1] == ']') v++, len -= 2;
    if (!colon || !len || len >= sizeof(kv_listen_host) ||
        pkv_cli_parse_u64(colon + 1, 0, 65535, &port))
        return pkv_cli_usage_error("serve", "--kv-listen wants HOST:PORT (port 0..65535), got '%s'",
                                   v);
    memcpy(kv_listen_host, v, len);
    kv_listen_host[len] = 0;
    cfg->kv_listen_host = kv_listen_host;
    cfg->kv_listen_port = (uint16_t)port;
    return 0;
}

/* A host name or address peers can put in "host:port": 1..47 of [A-Za-z0-9.:-]. */
static bool advertise_ok(const char *v)
{
    size_t n = strlen(v);
    if (!n || n > 47) return false;
    for (size_t i = 0; i < n; i++)
        if (!(isalnum((unsigned char)v[i]) || v[i] == '.' || v[i] == ':' || v[i] == '-'))
            return false;
    return true;
}

#define PROCEED   (-1) /* parse_args: run the server (otherwise: the exit code) */
#define NOT_KV    (-2) /* set_kv_option: not one of the roles' options */
#define NOT_CACHE (-3) /* set_cache_option: not one of the cache policy's options */

/* The prefix cache policy's options that take a value: 0, a usage error's exit code, or
 * NOT_CACHE. */
static int set_cache_option(const char *a, const char *v, pkv_server_config_t *cfg)
{
    const char *cmd = "serve";
    if (!strcmp(a, "--prefix-cache-max-bytes")) {
        if (!strcmp(v, "auto"))
            cfg->cache_max_mode = PKV_SERVER_BUDGET_AUTO;
        else if (!strcmp(v, "none"))
            cfg->cache_max_mode = PKV_SERVER_BUDGET_NONE;
        else if (!pkv_cli_parse_bytes(v, &cfg->cache_max_bytes) && cfg->cache_max_bytes > 0)
            cfg->cache_max_mode = PKV_SERVER_BUDGET_BYTES;
        else
            return pkv_cli_usage_error(
                cmd, "--prefix-cache-max-bytes wants BYTES > 0 (K/M/G), auto or none, got '%s'", v);
    } else if (!strcmp(a, "--kv-warm-max")) {
        if (!strcmp(v, "auto"))
            cfg->kv_warm_max_bytes = 0;
        else if (!strcmp(v, "none"))
            cfg->kv_warm_max_bytes = UINT64_MAX;
        else if (pkv_cli_parse_bytes(v, &cfg->kv_warm_max_bytes) || !cfg->kv_warm_max_bytes ||
                 cfg->kv_warm_max_bytes == UINT64_MAX)
            return pkv_cli_usage_error(
                cmd, "--kv-warm-max wants BYTES > 0 (K/M/G), auto or none, got '%s'", v);
    } else if (!strcmp(a, "--prefix-cache-idle-s")) {
        char *end;
        errno = 0;
        double sec = strtod(v, &end);
        if (errno || end == v || *end || !(sec >= 0 && sec <= 30 * 86400.0) ||
            (sec > 0 && sec < 0.001))
            return pkv_cli_usage_error(
                cmd, "--prefix-cache-idle-s wants seconds in [0.001, 2592000], or 0, got '%s'", v);
        cfg->cache_idle_ms = sec == 0 ? PKV_SERVER_NEVER : (uint32_t)(sec * 1000 + 0.5);
    } else if (!strcmp(a, "--kv-disk-dir")) {
        if (!*v) return pkv_cli_usage_error(cmd, "--kv-disk-dir wants a directory");
        cfg->kv_disk_dir = v;
    } else if (!strcmp(a, "--kv-disk-bytes")) {
        if (pkv_cli_parse_bytes(v, &cfg->kv_disk_bytes) || cfg->kv_disk_bytes < (1u << 20))
            return pkv_cli_usage_error(cmd, "--kv-disk-bytes wants BYTES >= 1M (K/M/G), got '%s'",
                                       v);
    } else if (!strcmp(a, "--kv-disk-min-free")) {
        if (pkv_cli_parse_bytes(v, &cfg->kv_disk_min_free))
            return pkv_cli_usage_error(cmd, "--kv-disk-min-free wants BYTES (K/M/G), got '%s'", v);
        if (!cfg->kv_disk_min_free) cfg->kv_disk_min_free = UINT64_MAX;
    } else if (!strcmp(a, "--kv-disk-load-ms")) {
        uint64_t ms;
        if (pkv_cli_parse_u64(v, 1, 600000, &ms))
            return pkv_cli_usage_error(cmd, "--kv-disk-load-ms wants 1..600000, got '%s'", v);
        cfg->kv_disk_load_ms = (uint32_t)ms;
    } else if (!strcmp(a, "--memory-reserve")) {
        if (pkv_cli_parse_bytes(v, &cfg->memory_reserve_bytes) || !cfg->memory_reserve_bytes)
            return pkv_cli_usage_error(cmd, "--memory-reserve wants BYTES > 0 (K/M/G), got '%s'",
                                       v);
    } else
        return NOT_CACHE;
    return 0;
}

/* The roles' options that take a value: 0, a usage error's exit code, or NOT_KV. */
static int set_kv_option(const char *a, const char *v, pkv_server_config_t *cfg)
{
    const char *cmd = "serve";
    if (!strcmp(a, "--role")) {
        if (pkv_server_role_parse(v, &cfg->role))
            return pkv_cli_usage_error(cmd, "--role wants unified, prefill or decode, got '%s'", v);
    } else if (!strcmp(a, "--kv-listen"))
        return parse_listen(v, cfg);
    else if (!strcmp(a, "--kv-advertise")) {
        if (!advertise_ok(v))
            return pkv_cli_usage_error(cmd,
                                       "--kv-advertise wants a host name or address (1..47 of A-Z "
                                       "a-z 0-9 . : -), got '%s'",
                                       v);
        cfg->kv_advertise = v;
    } else if (!strcmp(a, "--staging")) {
        if (!strcmp(v, "per_transfer"))
            cfg->staging_mode = PKV_STAGE_PER_TRANSFER;
        else if (!strcmp(v, "fixed"))
            cfg->staging_mode = PKV_STAGE_FIXED_SLOTS;
        else if (!strcmp(v, "mirror"))
            cfg->staging_mirror = true;
        else
            return pkv_cli_usage_error(
                cmd, "--staging wants per_transfer, fixed or mirror, got '%s'", v);
        cfg->staging_mirror = !strcmp(v, "mirror");
    } else if (!strcmp(a, "--staging-pages"))
        return pkv_cli_flag_u32(cmd, a, v, 1, 1u << 24, &cfg->staging_pages);
    else if (!strcmp(a, "--staging-page-bytes")) {
        uint64_t b;
        if (pkv_cli_parse_bytes(v, &b) || b < 4096 || b > (64u << 20) || b % 4096)
            return pkv_cli_usage_error(cmd,
                                       "--staging-page-bytes wants a multiple of 4096 in 4K..64M, "
                                       "got '%s'",
                                       v);
        cfg->staging_page_bytes = b;
    } else if (!strcmp(a, "--staging-slots"))
        return pkv_cli_flag_u32(cmd, a, v, 1, 4096, &cfg->staging_slots);
    else if (!strcmp(a, "--staging-peer-cap"))
        return pkv_cli_flag_u32(cmd, a, v, 1, 1u << 24, &cfg->staging_peer_cap);
    else if (!strcmp(a, "--staging-idle-ms"))
        return pkv_cli_flag_u32(cmd, a, v, 1, 3600000, &cfg->staging_idle_ms);
    else if (!strcmp(a, "--staging-warm-ms")) {
        if (v && !strcmp(v, "none")) {
            cfg->staging_warm_ms = PKV_SERVER_STAGING_WARM_NONE;
            return 0;
        }
        return pkv_cli_flag_u32(cmd, a, v, 1, 3600000, &cfg->staging_warm_ms);
    } else if (!strcmp(a, "--kv-lease-ms"))
        return pkv_cli_flag_u32(cmd, a, v, 1, 3600000, &cfg->kv_lease_ms);
    else if (!strcmp(a, "--kv-transfer-timeout-ms"))
        return pkv_cli_flag_u32(cmd, a, v, 1, 3600000, &cfg->kv_transfer_timeout_ms);
    else if (!strcmp(a, "--kv-load-failure")) {
        if (strcmp(v, "fail") && strcmp(v, "recompute"))
            return pkv_cli_usage_error(cmd, "--kv-load-failure wants fail or recompute, got '%s'",
                                       v);
        cfg->kv_load_recompute = !strcmp(v, "recompute");
    } else
        return NOT_KV;
    return 0;
}

/* Options that only a role with a transfer agent takes, or that contradict each other. */
static int check_kv_options(const pkv_server_config_t *cfg, const char *kv_flag)
{
    const char *cmd = "serve";
    if (cfg->role == PKV_SERVER_ROLE_UNIFIED && kv_flag)
        return pkv_cli_usage_error(cmd, "%s needs --role prefill or decode", kv_flag);
    if (cfg->role != PKV_SERVER_ROLE_UNIFIED && cfg->backend != PKV_BACKEND_PAGED)
        return pkv_cli_usage_error(cmd, "--role %s needs --kv-backend paged",
                                   pkv_server_role_name(cfg->role));
    if (cfg->staging_slots && cfg->staging_mode != PKV_STAGE_FIXED_SLOTS)
        return pkv_cli_usage_error(cmd, "--staging-slots needs --staging fixed");
    if (!cfg->kv_disk_dir && (cfg->kv_disk_bytes || cfg->kv_disk_min_free || cfg->kv_disk_load_ms))
        return pkv_cli_usage_error(cmd,
                                   "--kv-disk-bytes, -min-free and -load-ms need --kv-disk-dir");
    if (cfg->kv_disk_dir && (cfg->backend != PKV_BACKEND_PAGED || cfg->no_prefix_cache))
        return pkv_cli_usage_error(cmd, "--kv-disk-dir needs --kv-backend paged and the prefix "
                                        "cache");
    if ((cfg->staging_idle_ms || cfg->staging_warm_ms) &&
        (cfg->staging_mode != PKV_STAGE_PER_TRANSFER || cfg->staging_mirror))
        return pkv_cli_usage_error(cmd, "--staging-idle-ms and --staging-warm-ms need --staging "
                                        "per_transfer");
    pkv_model_config_t mc;
    char why[128];
    if (cfg->tp > 1 && cfg->backend != PKV_BACKEND_PAGED)
        return pkv_cli_usage_error(cmd, "--tp needs --kv-backend paged");
    if (cfg->tp && !cfg->model_path && !pkv_model_preset(cfg->preset, &mc) &&
        pkv_kv_tp_check(mc.n_kv_heads, cfg->tp, why, sizeof(why)))
        return pkv_cli_usage_error(cmd, "--tp: %s of the %s preset", why,
                                   cfg->preset ? cfg->preset : "tiny");
    return 0;
}

/* One option that takes a value. 0, or the exit code of a usage error. */
static int set_option(const char *a, const char *v, pkv_server_config_t *cfg, uint32_t *port,
                      uint32_t *drain_s)
{
    const char *cmd = "serve";
    int bad = 0;
    if (!strcmp(a, "--host"))
        cfg->host = v;
    else if (!strcmp(a, "--port"))
        bad = pkv_cli_flag_u32(cmd, a, v, 0, 65535, port);
    else if (!strcmp(a, "--max-connections"))
        bad = pkv_cli_flag_u32(cmd, a, v, 1, 65536, &cfg->max_connections);
    else if (!strcmp(a, "--max-body-bytes")) {
        if (pkv_cli_parse_bytes(v, &cfg->max_body_bytes) || cfg->max_body_bytes < 64)
            return pkv_cli_usage_error(cmd, "--max-body-bytes wants a size >= 64 bytes, got '%s'",
                                       v);
    } else if (!strcmp(a, "--drain-timeout"))
        bad = pkv_cli_flag_u32(cmd, a, v, 0, 86400, drain_s);
    else if (!strcmp(a, "--preset"))
        cfg->preset = v;
    else if (!strcmp(a, "--model"))
        cfg->model_path = v;
    else if (!strcmp(a, "--tokenizer"))
        cfg->tokenizer_path = v;
    else if (!strcmp(a, "--served-model-name"))
        cfg->served_name = v;
    else if (!strcmp(a, "--seed")) {
        if (pkv_cli_parse_u64(v, 0, UINT64_MAX, &cfg->weight_seed))
            return pkv_cli_usage_error(cmd, "--seed wants an integer, got '%s'", v);
    } else if (!strcmp(a, "--threads"))
        bad = pkv_cli_flag_u32(cmd, a, v, 1, 256, &cfg->threads);
    else if (!strcmp(a, "--kv-backend")) {
        if (pkv_backend_parse(v, &cfg->backend))
            return pkv_cli_usage_error(cmd, "--kv-backend wants paged or dense, got '%s'", v);
    } else if (!strcmp(a, "--kv-dtype")) {
        if (pkv_dtype_parse(v, &cfg->kv_dtype))
            return pkv_cli_usage_error(cmd,
                                       "--kv-dtype wants f32, f16, bf16, int8 or fp8, got '%s'", v);
    } else if (!strcmp(a, "--kv-cache-budget")) {
        if (!strcmp(v, "auto"))
            cfg->budget_mode = PKV_SERVER_BUDGET_AUTO;
        else if (!strcmp(v, "none"))
            cfg->budget_mode = PKV_SERVER_BUDGET_NONE;
        else if (!pkv_cli_parse_bytes(v, &cfg->budget_bytes) && cfg->budget_bytes > 0)
            cfg->budget_mode = PKV_SERVER_BUDGET_BYTES;
        else
            return pkv_cli_usage_error(
                cmd, "--kv-cache-budget wants BYTES (K/M/G), auto or none, got '%s'", v);
    } else if (!strcmp(a, "--tp"))
        return pkv_cli_flag_u32(cmd, a, v, 1, PKV_KV_MAX_TP, &cfg->tp);
    else if (!strcmp(a, "--block-tokens"))
        bad = pkv_cli_flag_u32(cmd, a, v, 1, 4096, &cfg->block_tokens);
    else if (!strcmp(a, "--max-batch-size"))
        bad = pkv_cli_flag_u32(cmd, a, v, 1, 1024, &cfg->max_batch_size);
    else if (!strcmp(a, "--max-queue-depth"))
        bad = pkv_cli_flag_u32(cmd, a, v, 1, 1u << 20, &cfg->max_queue);
    else if (!strcmp(a, "--max-context"))
        bad = pkv_cli_flag_u32(cmd, a, v, 2, 1u << 22, &cfg->max_context);
    else if (!strcmp(a, "--prefill-chunk"))
        bad = pkv_cli_flag_u32(cmd, a, v, 1, 1u << 20, &cfg->prefill_chunk);
    else if (!strcmp(a, "--default-max-tokens"))
        bad = pkv_cli_flag_u32(cmd, a, v, 1, 1u << 22, &cfg->default_max_tokens);
    else
        return pkv_cli_usage_error(cmd, "unknown option %s (see pagekv serve --help)", a);
    return bad;
}

/* PROCEED with *cfg and *drain_s filled, or the exit code (0 after --help, 2 for a usage
 * error). */
static int parse_args(int argc, char **argv, pkv_server_config_t *cfg, uint32_t *drain_s)
{
    const char *cmd = "serve";
    uint32_t port = 8000;
    const char *kv_flag = NULL; /* the first roles-only option given */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--no-hugepages")) {
            cfg->no_hugepages = true;
            continue;
        }
        if (!strcmp(a, "--no-prefix-cache")) {
            cfg->no_prefix_cache = true;
            continue;
        }
        if (!strcmp(a, "--no-memory-watch")) {
            cfg->no_memory_watch = true;
            continue;
        }
        if (!strcmp(a, "--staging-shared")) {
            cfg->staging_shared = true;
            kv_flag = kv_flag ? kv_flag : a;
            continue;
        }
        if (i + 1 >= argc)
            return pkv_cli_usage_error(cmd, "unknown option or missing value: %s", a);
        int bad = set_cache_option(a, argv[i + 1], cfg);
        if (bad != NOT_CACHE) {
            i++;
            if (bad) return bad;
            continue;
        }
        bad = set_kv_option(a, argv[i + 1], cfg);
        if (bad == NOT_KV)
            bad = set_option(a, argv[i + 1], cfg, &port, drain_s);
        else if (strcmp(a, "--role"))
            kv_flag = kv_flag ? kv_flag : a;
        i++;
        if (bad) return bad;
    }
    cfg->port = (uint16_t)port;
    int bad = check_kv_options(cfg, kv_flag);
    return bad ? bad : PROCEED;
}

/* The listening line on stderr. */
static void print_listening(pkv_server_t *srv, const pkv_server_config_t *cfg)
{
    pkv_server_info_t info;
    pkv_server_info(srv, &info);
    const char *host = cfg->host ? cfg->host : "127.0.0.1";
    bool v6 = strchr(host, ':') != NULL;
    fprintf(stderr,
            "pagekv serve: listening on %s%s%s:%u (model %s, %s kernels, %s KV, budget %llu bytes, "
            "%llu bytes/token, context %u, batch %u)\n",
            v6 ? "[" : "", host, v6 ? "]" : "", pkv_server_port(srv), info.model_name, info.kernels,
            pkv_backend_name(info.backend), (unsigned long long)info.budget_bytes,
            (unsigned long long)info.token_bytes, info.max_context, info.max_batch_size);
    if (info.backend == PKV_BACKEND_PAGED)
        fprintf(stderr, "pagekv serve: KV huge pages %s (THP %s%s%s)\n",
                !info.hugepages                         ? "off"
                : info.huge_probe && info.huge_granules ? "on"
                                                        : "asked, not given",
                info.thp_mode,
                !info.hugepages   ? ""
                : info.huge_probe ? "; a 2 MiB probe got a huge page"
                                  : "; a 2 MiB probe got 4 KiB pages",
                info.hugepages && !info.huge_granules
                    ? "; the pool's granules are not whole 2 MiB pages"
                    : "");
    if (info.kv_address)
        fprintf(stderr, "pagekv serve: role %s, transfer agent on %s\n",
                pkv_server_role_name(info.role), info.kv_address);
    fflush(stderr);
}

/* After the first signal: stop accepting and wait up to drain_s for the requests in flight
 * (a second signal cuts the wait short); what is left is cancelled by the destroy. */
static void drain(pkv_server_t *srv, const sigset_t *sigs, int sig, uint32_t drain_s)
{
    fprintf(stderr, "pagekv serve: %s: draining (up to %u s)\n",
            sig == SIGINT ? "SIGINT" : "SIGTERM", drain_s);
    pkv_server_quiesce(srv);
    uint64_t deadline = pkv_deadline_after_ns((uint64_t)drain_s * 1000000000ull);
    bool drained = false, forced = false;
    while (!drained && !forced) {
        uint64_t slice = pkv_deadline_after_ns(100ull * 1000 * 1000);
        drained = pkv_server_wait_idle(srv, slice < deadline ? slice : deadline) == PKV_OK;
        if (drained) break;
        if (pkv_now_ns() >= deadline) break;
        struct timespec zero = {0, 0};
        if (sigtimedwait(sigs, NULL, &zero) >= 0) forced = true;
    }
    if (!drained)
        fprintf(stderr, "pagekv serve: %s: cancelling the requests still in flight\n",
                forced ? "second signal" : "drain timeout");
}

int pkv_cmd_serve(int argc, char **argv)
{
    pkv_server_config_t cfg = {.port = 8000, .kv_dtype = PKV_DTYPE_F16};
    uint32_t drain_s = 30;
    int rc = parse_args(argc, argv, &cfg, &drain_s);
    if (rc != PROCEED) return rc;

    /* Before any thread exists, so that every thread inherits the mask. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    pkv_server_t *srv = NULL;
    rc = pkv_server_create(&cfg, &srv);
    if (rc) {
        fprintf(stderr, "pagekv serve: cannot start: %s\n", pkv_status_str(rc));
        return 1;
    }
    print_listening(srv, &cfg);
    int sig = 0;
    while (sigwait(&sigs, &sig) != 0) {
    }
    drain(srv, &sigs, sig, drain_s);
    pkv_server_destroy(srv);
    fprintf(stderr, "pagekv serve: stopped\n");
    return 0;
}
