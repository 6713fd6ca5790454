/*
 * pagekv bench footprint: one run. Start the server, sample it through the phases
 * (load, settle_load, scenario, settle), read its counters, stop it and summarize.
 */
#include "footprint.h"

#include "core/core.h"
#include "support/cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static bool fp_pass_has(const fp_opts_t *o, const char *flag)
{
    size_t n = strlen(flag);
    for (int i = 0; i < o->n_pass; i++)
        if (!strncmp(o->pass[i], flag, n) && (o->pass[i][n] == '\0' || o->pass[i][n] == '='))
            return true;
    return false;
}

/* churn_then_idle, hangups: KV committed at the scenario's end, and how long after it the
 * committed bytes came down to one granule per range and RSS to baseline x (1 + tol). */
static void fp_run_return_times(fp_run_t *r)
{
    uint64_t end = r->ph[PH_SCENARIO].end_ns;
    uint64_t kv_bound = r->granule_bytes * r->storage_ranges;
    uint64_t before = r->before_bytes ? r->before_bytes : r->baseline_bytes;
    double rss_bound = (double)before * (1.0 + fp_return_tolerance(r->scenario));
    r->return_kv_s = r->return_rss_s = -1;
    for (size_t i = 0; i < r->n_kv; i++) {
        if (r->kv[i].t_ns <= end) r->kv_scenario_end = r->kv[i].committed;
        if (r->kv[i].t_ns > end && r->return_kv_s < 0 && r->kv[i].committed <= kv_bound)
            r->return_kv_s = (double)(r->kv[i].t_ns - end) / FP_NS;
    }
    for (size_t i = 0; i < r->n_samples; i++)
        if (r->samples[i].t_ns > end && r->return_rss_s < 0 &&
            (double)r->samples[i].bytes <= rss_bound)
            r->return_rss_s = (double)(r->samples[i].t_ns - end) / FP_NS;
}

static void fp_run_summarize(fp_run_t *r)
{
    fp_phase_t *sc = &r->ph[PH_SCENARIO], *st = &r->ph[PH_SETTLE];
    r->baseline_bytes = r->ph[PH_SETTLE_LOAD].w.last_bytes;
    r->peak_bytes =
        PKV_MAX(PKV_MAX(sc->w.peak_bytes, st->w.peak_bytes), PKV_MAX(sc->hwm_bytes, st->hwm_bytes));
    r->last_bytes = sc->w.last_bytes;
    r->settled_bytes = st->w.last_bytes;
    r->wall_s = (double)(sc->end_ns - sc->begin_ns) / FP_NS;
    for (size_t i = 0; i < r->n_reqs; i++) {
        r->prompt_tokens += r->reqs[i].prompt_tokens;
        r->completion_tokens += r->reqs[i].completion_tokens;
        r->cached_tokens += r->reqs[i].cached_tokens;
    }
    for (size_t i = 0; i < r->n_kv; i++)
        r->kv_committed_polled_max = PKV_MAX(r->kv_committed_polled_max, r->kv[i].committed);
    if (r->ph[PH_SETTLE_LOAD].have_smaps && st->have_smaps)
        r->anon_growth = (int64_t)st->smaps.anonymous_bytes -
                         (int64_t)r->ph[PH_SETTLE_LOAD].smaps.anonymous_bytes;
    if (r->stats) {
        fp_stat(r->stats, K_COMMITTED, &r->kv_committed_end);
        fp_stat(r->stats, K_PEAK, &r->kv_committed_peak);
        fp_stat(r->stats, K_BLOCK_BYTES, &r->block_bytes);
        fp_stat(r->stats, K_TOKEN_BYTES, &r->token_bytes);
        fp_stat(r->stats, K_GRANULE, &r->granule_bytes);
        /* The pool reserves one range (docs/design/pool.md); older servers do not say. */
        r->ranges_assumed = !fp_stat(r->stats, K_RANGES, &r->storage_ranges);
        if (r->ranges_assumed) r->storage_ranges = r->backend == PKV_BACKEND_PAGED ? 1 : 0;
        fp_stat(r->stats, K_BUDGET, &r->budget);
        uint64_t bt = 0;
        if (!fp_stat(r->stats, K_BLOCK_TOKENS, &bt) && r->token_bytes)
            bt = r->block_bytes / r->token_bytes;
        r->block_tokens = (uint32_t)bt;
    }
    for (size_t i = 0; i < r->n_kv; i++)
        r->kv_live_polled_max_bytes =
            PKV_MAX(r->kv_live_polled_max_bytes, r->kv[i].live_blocks * r->block_bytes);
    if (r->block_tokens && r->token_bytes)
        r->kv_min = pkv_fp_kv_min_bytes(r->reqs, r->n_reqs, r->block_tokens, r->token_bytes);
    if (fp_scenario_idles(r->scenario)) fp_run_return_times(r);
}

/* The server's argv (NULL-terminated; `budget` holds the churn budget's digits) and its
 * command line in r->server_cmd. */
static void fp_server_argv(const fp_opts_t *o, fp_run_t *r, const char **argv, char budget[32],
                           char idle[32])
{
    int a = 0;
    argv[a++] = "pagekv";
    argv[a++] = "serve";
    argv[a++] = "--port";
    argv[a++] = "0";
    if (!fp_pass_has(o, "--preset")) argv[a++] = "--preset", argv[a++] = o->preset;
    argv[a++] = "--kv-backend";
    argv[a++] = pkv_backend_name(r->backend);
    if (!fp_pass_has(o, "--max-batch-size")) argv[a++] = "--max-batch-size", argv[a++] = "8";
    if (!fp_pass_has(o, "--kv-dtype")) argv[a++] = "--kv-dtype", argv[a++] = "f16";
    if (r->scenario == SC_CHURN && o->churn_budget && !fp_pass_has(o, "--kv-cache-budget")) {
        snprintf(budget, 32, "%llu", (unsigned long long)o->churn_budget);
        argv[a++] = "--kv-cache-budget";
        argv[a++] = budget;
    }
    if (fp_scenario_idles(r->scenario) && !fp_pass_has(o, "--prefix-cache-idle-s")) {
        snprintf(idle, 32, "%g", o->cache_idle_s);
        argv[a++] = "--prefix-cache-idle-s";
        argv[a++] = idle;
    }
    for (int i = 0; i < o->n_pass; i++) argv[a++] = o->pass[i];
    argv[a] = NULL;
    size_t off = 0;
    for (int i = 0; i < a && off < sizeof(r->server_cmd); i++)
        off += (size_t)snprintf(r->server_cmd + off, sizeof(r->server_cmd) - off, "%s%s",
                                i ? " " : "", argv[i]);
}

/* The served model's id (GET /v1/models) into c->model, then the stats sampler. */
static int fp_run_connect(fp_ctx_t *c)
{
    fp_run_t *r = c->run;
    int rc = PKV_OK;
    json_t *models = NULL;
    if (fp_http_json(c->srv->port, "GET", "/v1/models", 10.0, &models, r->error, sizeof(r->error)))
        rc = PKV_ERR_IO;
    json_t *id = json_object_get(json_array_get(json_object_get(models, "data"), 0), "id");
    if (!rc && !json_is_string(id)) {
        snprintf(r->error, sizeof(r->error), "GET /v1/models: no data[0].id");
        rc = PKV_ERR_PROTO;
    }
    if (!rc) snprintf(c->model, sizeof(c->model), "%s", json_string_value(id));
    json_decref(models);
    if (!rc && fp_sampler_start_stats(c->sp, c->srv->port)) {
        snprintf(r->error, sizeof(r->error), "cannot start the stats thread");
        rc = PKV_ERR_NOMEM;
    }
    return rc;
}

/* settle_load, the scenario and settle, then the server's counters. */
static int fp_run_phases(fp_ctx_t *c)
{
    fp_run_t *r = c->run;
    fp_phase_begin(c, PH_SETTLE_LOAD, "settle_load");
    fp_idle(c, c->o->settle_load_s);
    fp_phase_end(c, PH_SETTLE_LOAD);
    fp_phase_begin(c, PH_SCENARIO, "scenario");
    int rc = fp_scenario_run(c);
    fp_phase_end(c, PH_SCENARIO);
    if (rc) return rc;
    c->total_reqs = 0;
    fp_phase_begin(c, PH_SETTLE, "settle");
    fp_idle(c, c->o->settle_s + (fp_scenario_idles(r->scenario) ? c->o->cache_idle_s : 0));
    fp_phase_end(c, PH_SETTLE);
    return fp_http_json(c->srv->port, "GET", "/v1/cache/stats", 10.0, &r->stats, r->error,
                        sizeof(r->error));
}

/* churn only: POST /v1/cache/reset and read the committed bytes after it. */
static int fp_run_reset(fp_ctx_t *c)
{
    fp_run_t *r = c->run;
    int port = c->srv->port;
    json_t *j = NULL;
    int rc = fp_http_json(port, "POST", "/v1/cache/reset", 30.0, &j, r->error, sizeof(r->error));
    json_decref(j);
    if (!rc)
        rc = fp_http_json(port, "GET", "/v1/cache/stats", 10.0, &r->stats_after_reset, r->error,
                          sizeof(r->error));
    if (!rc) {
        r->have_reset = fp_stat(r->stats_after_reset, K_COMMITTED, &r->committed_after_reset);
        if (!r->have_reset) {
            snprintf(r->error, sizeof(r->error), "/v1/cache/stats has no committed bytes field");
            rc = PKV_ERR_PROTO;
        }
    }
    return rc;
}

/* Stop the samplers and the server, then the phase windows and the summary. */
static void fp_run_finish(fp_ctx_t *c, int rc)
{
    fp_run_t *r = c->run;
    fp_sampler_fini(c->sp, r);
    r->exit_status = fp_server_stop(c->srv);
    if (c->progress) fprintf(stderr, "\r\033[K");
    fp_exit_text(r->exit_status, r->exit_text, sizeof(r->exit_text));
    if (r->exit_status != 0)
        fprintf(stderr,
                "pagekv bench footprint: %s %s: the server did not exit cleanly after "
                "SIGTERM (%s); log %s\n",
                fp_scenario_names[r->scenario], pkv_backend_name(r->backend), r->exit_text,
                r->log_path);
    for (int p = 0; p < PH_N; p++)
        r->ph[p].w = pkv_fp_window(r->samples, r->n_samples, r->ph[p].begin_ns,
                                   p == PH_LOAD ? r->ready_ns : r->ph[p].end_ns);
    r->ok = rc == PKV_OK;
    if (r->ok) fp_run_summarize(r);
    if (r->ok && r->exit_status == 0 && !c->o->keep_logs) unlink(r->log_path);
}

void fp_run_one(const fp_opts_t *o, fp_run_t *r, unsigned index, unsigned total,
                double chars_per_token)
{
    char budget[32], idle[32];
    const char *argv[FP_MAX_PASS + 24];
    fp_server_argv(o, r, argv, budget, idle);
    launch_proc_t srv;
    if (fp_server_spawn(o, r, argv, &srv)) return;
    fp_sampler_t sp;
    fp_ctx_t c = {.o = o,
                  .run = r,
                  .sp = &sp,
                  .srv = &srv,
                  .index = index,
                  .total = total,
                  .progress = pkv_cli_progress_enabled(),
                  .chars_per_token = chars_per_token};
    if (fp_sampler_init(&sp, srv.pid)) {
        snprintf(r->error, sizeof(r->error), "cannot start the sampler thread");
        r->exit_status = fp_server_stop(&srv);
        return;
    }
    if (c.progress)
        fprintf(stderr, "\r\033[K[%u/%u] %s %s: starting the server", index, total,
                fp_scenario_names[r->scenario], pkv_backend_name(r->backend));
    if (fp_server_wait_ready(r, &srv)) {
        fp_sampler_fini(&sp, r);
        if (c.progress) fprintf(stderr, "\r\033[K");
        return;
    }
    /* The load phase: fork to ready. */
    r->ph[PH_LOAD].begin_ns = r->start_ns;
    r->ph[PH_LOAD].end_ns = r->ready_ns;
    int rc = fp_run_connect(&c);
    if (!rc) rc = fp_run_phases(&c);
    if (!rc && r->scenario == SC_CHURN) rc = fp_run_reset(&c);
    fp_run_finish(&c, rc);
}

void fp_run_free(fp_run_t *r)
{
    free(r->samples);
    free(r->kv);
    free(r->reqs);
    free(r->req_wall_s);
    json_decref(r->stats);
    json_decref(r->stats_after_reset);
}
