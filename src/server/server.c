/*
 * server: the assembly of `pagekv serve` (behaviour in include/pagekv/server.h; design in
 * docs/design/server.md): the model and its tokenizer, the KV pool (budget, cache policy,
 * huge-page policy), the engine, the node's transfer agents for the prefill and decode
 * roles, and the HTTP daemon over them (http.c); the server's lifecycle: create, quiesce,
 * wait idle, destroy.
 */
#include "pagekv/server.h"

#include "pagekv/engine.h"
#include "pagekv/model.h"
#include "pagekv/tokenizer.h"

#include "core/core.h"
#include "kv/kv.h"
#include "prim/prim.h"
#include "server/server_int.h"

#include <microhttpd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

static int detok(void *arg, int32_t prev, int32_t id, const char **bytes, size_t *len)
{
    return pkv_tok_decode_token(arg, prev, id, bytes, len);
}

/* ---- lifecycle ----------------------------------------------------------------------- */

/* The model and its tokenizer: a llama2.c pair, or a built-in preset. */
static int load_model(pkv_server_t *s, const pkv_server_config_t *cfg)
{
    pkv_model_runtime_t rt = {.threads = cfg->threads};
    int rc;
    const char *preset = cfg->preset ? cfg->preset : "tiny";
    if (cfg->model_path || cfg->tokenizer_path) {
        if (!cfg->model_path || !cfg->tokenizer_path) {
            PKV_LOGE("server", "a llama2.c model needs both --model and --tokenizer");
            return PKV_ERR_INVALID;
        }
        if ((rc = pkv_model_load_llama2c(cfg->model_path, &rt, &s->model))) return rc;
        const pkv_model_config_t *mc = pkv_model_config(s->model);
        if ((rc = pkv_tok_load_llama2c(cfg->tokenizer_path, (int32_t)mc->vocab_size, &s->tok)))
            return rc;
    } else {
        pkv_model_config_t mc;
        if (pkv_model_preset(preset, &mc)) {
            PKV_LOGE("server", "unknown preset '%s'", preset);
            return PKV_ERR_INVALID;
        }
        if ((rc = pkv_tok_create_builtin(&s->tok))) return rc;
        mc.vocab_size = (uint32_t)pkv_tok_vocab_size(s->tok);
        if (cfg->max_context) {
            if (cfg->max_context > mc.max_seq_len) {
                PKV_LOGE("server", "--max-context %u is above the preset's length (%u)",
                         cfg->max_context, mc.max_seq_len);
                return PKV_ERR_INVALID;
            }
            mc.max_seq_len = cfg->max_context;
        }
        if ((rc = pkv_model_create_builtin(&mc, cfg->weight_seed ? cfg->weight_seed : 1, &rt,
                                           &s->model)))
            return rc;
    }
    return PKV_OK;
}

/* The KV budget the configuration asks for (auto: max_batch x max_context tokens, at most
 * half the machine's memory, at least 4 MiB). PKV_ERR_INVALID for a budget of 0 bytes. */
static int kv_budget(const pkv_server_t *s, const pkv_server_config_t *cfg, uint64_t *out)
{
    switch (cfg->budget_mode) {
    case PKV_SERVER_BUDGET_NONE:
        *out = 0;
        return PKV_OK;
    case PKV_SERVER_BUDGET_BYTES:
        if (!cfg->budget_bytes) {
            PKV_LOGE("server", "a KV budget of 0 bytes (use 'none' for no cap)");
            return PKV_ERR_INVALID;
        }
        *out = cfg->budget_bytes;
        return PKV_OK;
    default: {
        uint64_t want = (uint64_t)s->max_batch * s->max_context * s->token_bytes;
        long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        uint64_t half = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz / 2 : want;
        *out = PKV_MAX(PKV_MIN(want, half), 4ull << 20);
        return PKV_OK;
    }
    }
}

/* Huge pages for the paged pool, as `pagekv generate` and the benchmarks use, wherever the
 * kernel's THP mode allows them (always or madvise) unless --no-hugepages: attention reads
 * KV in long runs (fewer TLB misses; paged decode is ~25 % slower on 4 KiB pages); RSS is
 * the same (a commit populates its whole granule either way). Asking is not getting: a
 * probe commits one 2 MiB page the way the pool does and reads back what the kernel gave
 * (logged; /v1/cache/stats and /metrics then show the pool's own huge bytes). */
static void hugepage_policy(pkv_server_t *s, const pkv_server_config_t *cfg)
{
    if (pkv_prim_thp_mode(NULL, &s->thp)) s->thp = PKV_PRIM_THP_UNKNOWN;
    s->huge = cfg->backend == PKV_BACKEND_PAGED && !cfg->no_hugepages &&
              (s->thp == PKV_PRIM_THP_ALWAYS || s->thp == PKV_PRIM_THP_MADVISE);
    s->huge_probe = false;
    if (s->huge && pkv_prim_huge_probe(&s->huge_probe)) s->huge_probe = false;
    const char *why = cfg->backend != PKV_BACKEND_PAGED ? "dense backend"
                      : cfg->no_hugepages               ? "--no-hugepages"
                      : !s->huge                        ? "the kernel's THP mode"
                      : s->huge_probe                   ? "a 2 MiB probe got a huge page"
                                      : "a 2 MiB probe got 4 KiB pages (none free?)";
    PKV_LOGI("server", "huge pages for the KV pool: %s (THP %s; %s)", s->huge ? "asked" : "off",
             pkv_prim_thp_mode_name(s->thp), why);
}

/* The free-space watermark: the flag, or 1 GiB or 5 % of the filesystem, the smaller. */
static uint64_t tier_min_free(const pkv_server_config_t *cfg)
{
    struct statvfs v;
    if (cfg->kv_disk_min_free == UINT64_MAX) return 0;
    if (cfg->kv_disk_min_free) return cfg->kv_disk_min_free;
    uint64_t fs = statvfs(cfg->kv_disk_dir, &v) ? 0 : (uint64_t)v.f_blocks * v.f_frsize;
    return fs ? PKV_MIN(1ull << 30, fs / 20) : 1ull << 30;
}

/* The disk tier over the pool: its layout digest names the model (a preset and its seed,
 * or the checkpoint's content), the kernels that compute K/V, and the KV's geometry. */
static int open_tier(pkv_server_t *s, const pkv_server_config_t *cfg)
{
    char id[256], hex[33];
    const char *kernels = pkv_model_kernels(s->model);
    if (cfg->model_path) {
        if (pkv_kvtier_file_hash(cfg->model_path, hex)) {
            PKV_LOGE("server", "cannot read %s for the disk tier's layout", cfg->model_path);
            return PKV_ERR_IO;
        }
        snprintf(id, sizeof(id), "llama2c xxh3-128 %s kernels %s", hex, kernels);
    } else {
        snprintf(id, sizeof(id), "preset %.32s seed %llu kernels %s",
                 cfg->preset ? cfg->preset : "tiny",
                 (unsigned long long)(cfg->weight_seed ? cfg->weight_seed : 1), kernels);
    }
    pkv_kvtier_config_t tc = {.dir = cfg->kv_disk_dir,
                              .max_bytes = cfg->kv_disk_bytes ? cfg->kv_disk_bytes : 1ull << 30,
                              .min_free_bytes = tier_min_free(cfg),
                              .load_ms = cfg->kv_disk_load_ms};
    pkv_kvtier_layout(s->kv, id, tc.layout);
    int rc = pkv_kvtier_open(s->kv, &tc, &s->tier);
    if (rc == PKV_ERR_BUSY)
        PKV_LOGE("server", "the disk tier %s is in use by another live server", cfg->kv_disk_dir);
    else if (rc)
        PKV_LOGE("server", "opening the disk tier %s failed: %s", cfg->kv_disk_dir,
                 pkv_status_str(rc));
    else
        PKV_LOGI("server", "disk tier: %s, at most %llu bytes", cfg->kv_disk_dir,
                 (unsigned long long)tc.max_bytes);
    return rc;
}

/* The warm floor's refill waits while this says the node is busy: a generation request in
 * flight (from its arrival to its last byte: a decode leg's pull, admission and decode
 * included), or one queued or running in the engine. */
static bool node_busy(void *arg)
{
    pkv_server_t *s = arg;
    pthread_mutex_lock(&s->lock);
    bool busy = s->ctr.in_flight > 0;
    pthread_mutex_unlock(&s->lock);
    pkv_engine_stats_t es;
    pkv_engine_stats(s->engine, &es);
    return busy || es.queued || es.running;
}

static int build_stack(pkv_server_t *s, const pkv_server_config_t *cfg)
{
    int rc = load_model(s, cfg);
    if (rc) return rc;
    const pkv_model_config_t *mc = pkv_model_config(s->model);
    s->max_context = cfg->max_context ? cfg->max_context : mc->max_seq_len;
    if (s->max_context > mc->max_seq_len || s->max_context < 2) {
        PKV_LOGE("server", "--max-context %u must be in [2, %u] (the model's length)",
                 s->max_context, mc->max_seq_len);
        return PKV_ERR_INVALID;
    }
    if (pkv_tok_vocab_size(s->tok) != (int32_t)mc->vocab_size) {
        PKV_LOGE("server", "tokenizer vocabulary (%d) differs from the model's (%u)",
                 pkv_tok_vocab_size(s->tok), mc->vocab_size);
        return PKV_ERR_INVALID;
    }
    s->max_batch = cfg->max_batch_size ? cfg->max_batch_size : 8;
    s->block_tokens = cfg->block_tokens ? cfg->block_tokens : 16;
    hugepage_policy(s, cfg);
    pkv_kv_config_t kc = {.backend = cfg->backend,
                          .no_prefix_cache = cfg->no_prefix_cache,
                          .hugepages = s->huge,
                          .tp = cfg->tp ? cfg->tp : 1};
    pkv_model_geometry(s->model, cfg->kv_dtype, s->block_tokens, &kc.geo);
    char why[128];
    if (pkv_kv_tp_check(kc.geo.kv_heads, kc.tp, why, sizeof(why))) {
        PKV_LOGE("server", "--tp: %s", why);
        return PKV_ERR_INVALID;
    }
    s->token_bytes = pkv_geometry_token_bytes(&kc.geo);
    if ((rc = kv_budget(s, cfg, &kc.budget_bytes))) return rc;
    if ((rc = srv_cache_policy(cfg, kc.budget_bytes, &kc))) return rc;
    s->backend = cfg->backend;
    if ((rc = pkv_kv_create(&kc, &s->kv))) {
        PKV_LOGE("server", "creating the KV cache failed: %s", pkv_status_str(rc));
        return rc;
    }
    pkv_kv_stats_t ks;
    pkv_kv_stats(s->kv, &ks);
    s->budget_bytes = ks.budget_bytes;
    s->huge_granules = ks.huge_granules;
    /* Every id that ends a turn ends a generation: EOS, and the builtin's <|end|>. */
    int32_t eos[PKV_ENGINE_MAX_EOS];
    uint32_t n_eos = 0;
    for (int32_t id = 0; id < pkv_tok_vocab_size(s->tok) && n_eos < PKV_ENGINE_MAX_EOS; id++)
        if (pkv_tok_is_stop(s->tok, id)) eos[n_eos++] = id;
    pkv_engine_config_t ec = {.model = s->model,
                              .kv = s->kv,
                              .max_batch_size = s->max_batch,
                              .max_queue = cfg->max_queue,
                              .prefill_chunk = cfg->prefill_chunk,
                              .eos_ids = eos,
                              .n_eos_ids = n_eos,
                              .detok = detok,
                              .detok_arg = s->tok};
    if (cfg->kv_disk_dir && (rc = open_tier(s, cfg))) return rc;
    if ((rc = pkv_engine_create(&ec, &s->engine))) {
        PKV_LOGE("server", "creating the engine failed: %s", pkv_status_str(rc));
        return rc;
    }
    if ((rc = srv_memwatch_create(cfg, s->kv, node_busy, s, &s->mw))) {
        PKV_LOGE("server", "starting the memory watcher failed: %s", pkv_status_str(rc));
        return rc;
    }
    if (s->mw) pkv_kv_on_warm_low(s->kv, srv_memwatch_kick, s->mw);
    return PKV_OK;
}

static void free_stack(pkv_server_t *s)
{
    if (s->kv) pkv_kv_on_warm_low(s->kv, NULL, NULL);
    srv_memwatch_destroy(s->mw); /* before the pool it trims */
    pkv_engine_destroy(s->engine);
    pkv_kvtier_close(s->tier); /* after the engine (its hooks), before the pool (its pins) */
    pkv_kv_destroy(s->kv);
    pkv_model_destroy(s->model);
    pkv_tok_destroy(s->tok);
}

/* The model a node's KV belongs to, for the transfer agents' layout descriptor (a peer
 * whose KV is another model's is refused at the handshake): the preset and the weight seed,
 * or the checkpoint's file name (printable, at most 63 characters). */
static const char *model_id(const pkv_server_config_t *cfg, char *buf, size_t cap)
{
    if (cfg->model_path) {
        const char *base = strrchr(cfg->model_path, '/');
        base = base ? base + 1 : cfg->model_path;
        size_t j = 0;
        for (; base[j] && j + 1 < cap && j < 63; j++)
            buf[j] = base[j] >= 0x20 && base[j] <= 0x7e ? base[j] : '?';
        buf[j] = 0;
    } else {
        snprintf(buf, cap, "%.32s:seed%llu", cfg->preset ? cfg->preset : "tiny",
                 (unsigned long long)(cfg->weight_seed ? cfg->weight_seed : 1));
    }
    return buf;
}

int pkv_server_create(const pkv_server_config_t *cfg, pkv_server_t **out)
{
    if (!cfg || !out) return PKV_ERR_INVALID;
    pkv_server_t *s = calloc(1, sizeof(*s));
    if (!s) return PKV_ERR_NOMEM;
    int rc = PKV_ERR_NOMEM;
    s->quiesced_fd = MHD_INVALID_SOCKET;
    s->max_body = cfg->max_body_bytes ? cfg->max_body_bytes : 4ull << 20;
    s->retry_after_s = cfg->retry_after_s ? cfg->retry_after_s : 1;
    s->default_max_tokens = cfg->default_max_tokens ? cfg->default_max_tokens : 16;
    s->created = time(NULL);
    s->rng = (uint64_t)pkv_now_ns() ^ ((uint64_t)getpid() << 32);
    atomic_init(&s->stopping, false);
    if (pthread_mutex_init(&s->lock, NULL)) goto fail_lock;
    if (pthread_mutex_init(&s->pages_mu, NULL)) goto fail_pages;
    if (pkv_cond_init_monotonic(&s->idle_cv)) goto fail_cv;
    if (!(s->host = strdup(cfg->host ? cfg->host : "127.0.0.1"))) goto fail_host;
    if ((rc = build_stack(s, cfg))) goto fail_stack;
    char mid[64];
    const char *name = cfg->served_name;
    if (!name && cfg->model_path) {
        name = strrchr(cfg->model_path, '/');
        name = name ? name + 1 : cfg->model_path;
    }
    if (!name) name = cfg->preset ? cfg->preset : "tiny";
    if (!*name || strlen(name) > 200) {
        PKV_LOGE("server", "the served model name must be 1..200 bytes");
        rc = PKV_ERR_INVALID;
        goto fail_stack;
    }
    rc = PKV_ERR_NOMEM;
    if (!(s->served_name = strdup(name))) goto fail_stack;
    s->role = cfg->role;
    if (s->role != PKV_SERVER_ROLE_UNIFIED &&
        (rc = pkv_disagg_node_create(cfg, s->kv, s->max_context, model_id(cfg, mid, sizeof(mid)),
                                     &s->kvn)))
        goto fail_kv;
    if ((rc = srv_http_start(s, cfg))) goto fail_http;
    *out = s;
    return PKV_OK;

fail_http:
    pkv_disagg_node_destroy(s->kvn);
fail_kv:
    free(s->served_name);
fail_stack:
    free_stack(s);
    free(s->host);
fail_host:
    pthread_cond_destroy(&s->idle_cv);
fail_cv:
    pthread_mutex_destroy(&s->pages_mu);
fail_pages:
    pthread_mutex_destroy(&s->lock);
fail_lock:
    free(s);
    return rc;
}

void pkv_server_quiesce(pkv_server_t *s)
{
    pthread_mutex_lock(&s->lock);
    bool first = !s->draining;
    s->draining = true;
    pthread_mutex_unlock(&s->lock);
    if (!first) return;
    s->quiesced_fd = MHD_quiesce_daemon(s->mhd);
    /* MHD stops polling the socket but it stays open until after MHD_stop_daemon, and the
     * kernel would keep completing handshakes into its backlog: connections that then
     * hang. shutdown() stops the listening (new connections are refused) while the
     * descriptor stays valid for any MHD thread still holding it. */
    if (s->quiesced_fd != MHD_INVALID_SOCKET) shutdown(s->quiesced_fd, SHUT_RDWR);
}

int pkv_server_wait_idle(pkv_server_t *s, uint64_t deadline_ns)
{
    int rc = PKV_OK;
    pthread_mutex_lock(&s->lock);
    while (s->ctr.in_flight) {
        if (pkv_now_ns() >= deadline_ns) {
            rc = PKV_ERR_TIMEOUT;
            break;
        }
        struct timespec ts = pkv_deadline_to_monotonic(deadline_ns);
        pthread_cond_timedwait(&s->idle_cv, &s->lock, &ts);
    }
    pthread_mutex_unlock(&s->lock);
    return rc;
}

void pkv_server_destroy(pkv_server_t *s)
{
    if (!s) return;
    atomic_store(&s->stopping, true); /* no connection parks any more */
    srv_http_unpark_all(s);           /* libmicrohttpd must not stop with one parked */
    MHD_stop_daemon(s->mhd);          /* joins its threads; every request completed */
    if (s->quiesced_fd != MHD_INVALID_SOCKET) close(s->quiesced_fd);
    pkv_disagg_node_destroy(s->kvn); /* registrations end: their pins return before the pool goes */
    free_stack(s);
    srv_http_free(s); /* no wake can come now: the engine and the pull worker are gone */
    free(s->served_name);
    free(s->host);
    pthread_cond_destroy(&s->idle_cv);
    pthread_mutex_destroy(&s->pages_mu);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

uint16_t pkv_server_port(const pkv_server_t *s)
{
    return s->port;
}

void pkv_server_info(const pkv_server_t *s, pkv_server_info_t *out)
{
    out->model_name = s->served_name;
    out->kernels = pkv_model_kernels(s->model);
    out->backend = s->backend;
    out->max_context = s->max_context;
    out->max_batch_size = s->max_batch;
    out->budget_bytes = s->budget_bytes;
    out->token_bytes = s->token_bytes;
    out->block_tokens = s->block_tokens;
    out->role = s->role;
    out->kv_address = s->kvn ? pkv_disagg_node_address(s->kvn) : NULL;
    out->hugepages = s->huge;
    out->thp_mode = pkv_prim_thp_mode_name(s->thp);
    out->huge_probe = s->huge_probe;
    out->huge_granules = s->huge_granules;
}

const char *pkv_server_role_name(pkv_server_role_t role)
{
    switch (role) {
    case PKV_SERVER_ROLE_UNIFIED:
        return "unified";
    case PKV_SERVER_ROLE_PREFILL:
        return "prefill";
    case PKV_SERVER_ROLE_DECODE:
        return "decode";
    }
    return "unknown";
}

int pkv_server_role_parse(const char *name, pkv_server_role_t *out)
{
    for (int r = PKV_SERVER_ROLE_UNIFIED; r <= PKV_SERVER_ROLE_DECODE; r++)
        if (name && !strcmp(name, pkv_server_role_name((pkv_server_role_t)r))) {
            *out = (pkv_server_role_t)r;
            return PKV_OK;
        }
    return PKV_ERR_INVALID;
}
