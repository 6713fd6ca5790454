/*
 * pagekv bench footprint: the server's memory over real HTTP workloads, paged against
 * dense: does paging keep the server's memory near what its sequences hold, where a
 * pool that grows by copying peaks far above it (docs/design/footprint.md).
 *
 * For every (repeat, scenario, backend) the tool starts a fresh `pagekv serve` (this
 * binary, /proc/self/exe, or --server-bin) on an ephemeral loopback port, waits until it
 * answers /health, and measures the process from the outside:
 *   - VmRSS from /proc/PID/status every 100 ms (thread "fp-rss"), and VmHWM reset at the
 *     start of each phase and read at its end, so a spike between two samples still
 *     counts in the phase's peak;
 *   - /proc/PID/smaps_rollup once at the end of each phase (where the memory is);
 *   - the KV cache's own counters from GET /v1/cache/stats every 250 ms (thread
 *     "fp-stats") and once at the end.
 * Phases: load (exec to /health), settle_load (5 s idle), scenario, settle (8 s idle).
 * The scenarios are chat completions at temperature 0 with ignore_eos (so every request
 * generates exactly max_tokens on both backends) against a preset (--preset, default
 * llama-3.2-1b; --prefix-tokens defaults to 4200 for qwen3-0.6b, 3700 otherwise), f16 KV,
 * --max-batch-size 8; see fp_scenario_names and docs/design/footprint.md.
 *
 * Paged and dense runs of one scenario follow each other, so they see the same machine;
 * --repeat N reports medians with min-max, and ratios taken per repeat.
 *
 * This file holds the options and the main loop; footprint.h lists the others.
 */
#include "footprint.h"
#include "support/cli.h"
#include "tools/commands.h"

#include "core/core.h"
#include "pagekv/model.h"

#include <curl/curl.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *const fp_scenario_names[SC_N] = {
    "idle",  "shared_prefix_burst", "seqshare",        "multiturn",
    "churn", "distinct_burst",      "churn_then_idle", "hangups"};
const char *const fp_phase_names[PH_N] = {"load", "settle_load", "scenario", "settle"};

/* ---- options -------------------------------------------------------------------------------- */

static void fp_usage(FILE *f)
{
    fprintf(f, "usage: pagekv bench footprint [options] [-- server flags]\n"
               "  --scenario a,b,..   of: idle, shared_prefix_burst, seqshare, multiturn, churn,\n"
               "                      distinct_burst, churn_then_idle, hangups, all\n"
               "                      (default all)\n"
               "  --backend B         paged | dense | all (default all)\n"
               "  --repeat N          runs of each (scenario, backend); medians (default 1)\n"
               "  --json FILE         every run, its phases, samples and the server's counters\n"
               "  --svg DIR           DIR/footprint-<scenario>.svg: memory over time\n"
               "  --settle-load S     idle seconds after the model loads (default 5)\n"
               "  --settle S          idle seconds after the scenario (default 8)\n"
               "  --idle S            the idle scenario's length (default 20)\n"
               "  --preset NAME       the server's model preset (default llama-3.2-1b)\n"
               "  --prefix-tokens N   shared system prompt length in tokens (default 3700;\n"
               "                      4200 with --preset qwen3-0.6b)\n"
               "  --churn-budget B    --kv-cache-budget for churn (default 64M, 2048 tokens of\n"
               "                      llama-3.2-1b; as many tokens of another preset: 224M\n"
               "                      with qwen3-0.6b; 0: none)\n"
               "  --cache-idle S      --prefix-cache-idle-s for churn_then_idle and hangups,\n"
               "                      whose settle phase lasts this much longer (default 10)\n"
               "  --request-timeout S per HTTP request (default 1800)\n"
               "  --server-bin PATH   the pagekv binary to serve (default this one)\n"
               "  --keep-logs         keep every server log (failed runs' logs are always kept)\n"
               "Server flags after `--` are passed to every `pagekv serve` (they override the\n"
               "bench's --preset and the defaults --max-batch-size 8 --kv-dtype f16).\n");
}

static int fp_parse_seconds(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v < 0 || v > 86400) return -1;
    *out = v;
    return 0;
}

/* --scenario a,b,..: marks them in o->scenario. 0, or the usage error's exit code. */
static int fp_parse_scenarios(const char *cmd, const char *v, fp_opts_t *o)
{
    char *copy = strdup(v), *save = NULL;
    if (!copy) return 2;
    int rc = 0;
    for (char *t = strtok_r(copy, ",", &save); t && !rc; t = strtok_r(NULL, ",", &save)) {
        int found = -1;
        for (int s = 0; s < SC_N; s++)
            if (!strcmp(t, fp_scenario_names[s])) found = s;
        if (!strcmp(t, "all")) {
            for (int s = 0; s < SC_N; s++) o->scenario[s] = true;
        } else if (found < 0) {
            rc = pkv_cli_usage_error(cmd, "unknown scenario '%s'", t);
        } else {
            o->scenario[found] = true;
        }
    }
    free(copy);
    return rc;
}

static int fp_parse_backend(const char *cmd, const char *v, fp_opts_t *o)
{
    pkv_backend_t b;
    if (!strcmp(v, "all")) {
        o->backend[0] = o->backend[1] = true;
    } else if (pkv_backend_parse(v, &b) == PKV_OK) {
        o->backend[0] = o->backend[1] = false;
        o->backend[b] = true;
    } else {
        return pkv_cli_usage_error(cmd, "--backend: '%s' is not paged, dense or all", v);
    }
    return 0;
}

/* --settle-load, --settle, --idle and --request-timeout. */
static int fp_parse_duration(const char *cmd, const char *a, const char *v, fp_opts_t *o)
{
    double s;
    if (fp_parse_seconds(v, &s)) return pkv_cli_usage_error(cmd, "%s: bad seconds '%s'", a, v);
    if (!strcmp(a, "--settle-load"))
        o->settle_load_s = s;
    else if (!strcmp(a, "--cache-idle"))
        o->cache_idle_s = s;
    else if (!strcmp(a, "--settle"))
        o->settle_s = s;
    else if (!strcmp(a, "--idle"))
        o->idle_s = s;
    else if (s > 0)
        o->request_timeout_s = s;
    else
        return pkv_cli_usage_error(cmd, "--request-timeout must be > 0");
    return 0;
}

/* An option `a` with its value `v`. 0, or the usage error's exit code. */
static int fp_parse_valued(const char *cmd, const char *a, const char *v, fp_opts_t *o)
{
    uint64_t u;
    if (!strcmp(a, "--scenario")) return fp_parse_scenarios(cmd, v, o);
    if (!strcmp(a, "--backend")) return fp_parse_backend(cmd, v, o);
    if (!strcmp(a, "--repeat")) {
        if (pkv_cli_parse_u64(v, 1, 50, &u))
            return pkv_cli_usage_error(cmd, "--repeat: '%s' is not in [1, 50]", v);
        o->repeat = (uint32_t)u;
    } else if (!strcmp(a, "--json")) {
        o->json_path = v;
    } else if (!strcmp(a, "--svg")) {
        o->svg_dir = v;
    } else if (!strcmp(a, "--server-bin")) {
        o->server_bin = v;
    } else if (!strcmp(a, "--settle-load") || !strcmp(a, "--settle") || !strcmp(a, "--idle") ||
               !strcmp(a, "--request-timeout") || !strcmp(a, "--cache-idle")) {
        return fp_parse_duration(cmd, a, v, o);
    } else if (!strcmp(a, "--preset")) {
        pkv_model_config_t mc;
        if (pkv_model_preset(v, &mc))
            return pkv_cli_usage_error(cmd, "--preset: unknown preset '%s'", v);
        o->preset = v;
    } else if (!strcmp(a, "--prefix-tokens")) {
        if (pkv_cli_parse_u64(v, 16, 30000, &u))
            return pkv_cli_usage_error(cmd, "--prefix-tokens: '%s' is not in [16, 30000]", v);
        o->prefix_tokens = (uint32_t)u;
    } else if (!strcmp(a, "--churn-budget")) {
        if (pkv_cli_parse_bytes(v, &o->churn_budget))
            return pkv_cli_usage_error(cmd, "--churn-budget: bad size '%s'", v);
    } else {
        return pkv_cli_usage_error(cmd, "unknown option '%s' (try --help)", a);
    }
    return 0;
}

/* KV bytes per token of a preset's layers (f16, the bench's --kv-dtype). */
static uint64_t fp_token_bytes(const char *preset)
{
    pkv_model_config_t mc;
    if (pkv_model_preset(preset, &mc)) return 0;
    pkv_geometry_t g = {mc.n_layers, mc.n_kv_heads, mc.head_dim, 0, PKV_DTYPE_F16};
    return pkv_geometry_token_bytes(&g);
}

/* churn's --kv-cache-budget: 64 MiB for llama-3.2-1b (32 KiB a token: 2048 tokens), the
 * same tokens for another preset (qwen3-0.6b: 112 KiB a token, 224 MiB), whole MiB. */
static uint64_t fp_churn_budget_default(const char *preset)
{
    uint64_t llama = fp_token_bytes("llama-3.2-1b"), mine = fp_token_bytes(preset);
    if (!llama || !mine) return 64ull << 20;
    uint64_t mib = (64ull * mine + llama - 1) / llama;
    return mib << 20;
}

/* 0: run; 1: --help printed; otherwise the usage error's exit code. */
static int fp_parse_opts(int argc, char **argv, fp_opts_t *o)
{
    const char *cmd = "bench footprint";
    *o = (fp_opts_t){.repeat = 1,
                     .server_bin = "/proc/self/exe",
                     .settle_load_s = 5,
                     .settle_s = 8,
                     .idle_s = 20,
                     .preset = "llama-3.2-1b",
                     .churn_budget = UINT64_MAX, /* unset: scaled to the preset below */
                     .cache_idle_s = 10,
                     .request_timeout_s = 1800};
    o->backend[0] = o->backend[1] = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--")) {
            for (i++; i < argc; i++) {
                if (o->n_pass == FP_MAX_PASS)
                    return pkv_cli_usage_error(cmd, "too many server flags (at most %d)",
                                               FP_MAX_PASS);
                o->pass[o->n_pass++] = argv[i];
            }
            break;
        } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fp_usage(stdout);
            return 1;
        } else if (!strcmp(a, "--keep-logs")) {
            o->keep_logs = true;
            continue;
        }
        if (!v) return pkv_cli_usage_error(cmd, "unknown option or missing value: '%s'", a);
        i++;
        int rc = fp_parse_valued(cmd, a, v, o);
        if (rc) return rc;
    }
    if (!o->prefix_tokens) o->prefix_tokens = strcmp(o->preset, "qwen3-0.6b") ? 3700 : 4200;
    if (o->churn_budget == UINT64_MAX) o->churn_budget = fp_churn_budget_default(o->preset);
    bool any_sc = false;
    for (int s = 0; s < SC_N; s++) any_sc |= o->scenario[s];
    if (!any_sc)
        for (int s = 0; s < SC_N; s++) o->scenario[s] = true;
    if (access(o->server_bin, X_OK))
        return pkv_cli_usage_error(cmd, "--server-bin: '%s' is not executable", o->server_bin);
    return 0;
}

int pkv_bench_footprint(int argc, char **argv)
{
    fp_opts_t o;
    int prc = fp_parse_opts(argc, argv, &o);
    if (prc) return prc == 1 ? 0 : prc;
    if (curl_global_init(CURL_GLOBAL_DEFAULT)) {
        fprintf(stderr, "pagekv bench footprint: curl_global_init failed\n");
        return 1;
    }
    double cpt = pkv_fp_chars_per_token();
    size_t total = 0;
    for (int sc = 0; sc < SC_N; sc++)
        for (int b = 0; b < 2; b++) total += o.scenario[sc] && o.backend[b];
    total *= o.repeat;
    fp_run_t *runs = calloc(total ? total : 1, sizeof(*runs));
    if (!runs) {
        curl_global_cleanup();
        return 1;
    }
    size_t n = 0;
    int failed = 0;
    for (uint32_t rep = 0; rep < o.repeat; rep++)
        for (int sc = 0; sc < SC_N; sc++)
            for (int b = 0; b < 2; b++) {
                if (!o.scenario[sc] || !o.backend[b]) continue;
                fp_run_t *r = &runs[n++];
                r->scenario = sc;
                r->backend = (pkv_backend_t)b;
                r->repeat = rep;
                fp_run_one(&o, r, (unsigned)n, (unsigned)total, cpt);
                if (r->ok)
                    fprintf(stderr,
                            "[%zu/%zu] %s %s: peak %.1f MiB, settled %.1f MiB, KV committed "
                            "peak %.1f MiB, %.1f s\n",
                            n, total, fp_scenario_names[sc], pkv_backend_name(r->backend),
                            fp_mib(r->peak_bytes), fp_mib(r->settled_bytes),
                            fp_mib(r->kv_committed_peak), r->wall_s);
                else
                    fprintf(stderr, "[%zu/%zu] %s %s: FAILED: %s\n", n, total,
                            fp_scenario_names[sc], pkv_backend_name(r->backend), r->error),
                        failed++;
            }
    fp_target_t t[FP_N_TARGETS];
    int nt = fp_targets(&o, runs, n, t);
    fp_print_report(&o, runs, n, t, nt);
    int rc = failed ? 1 : 0;
    if (o.json_path && fp_write_json(&o, runs, n, t, nt, cpt)) rc = 1;
    if (o.svg_dir && fp_write_svgs(&o, runs, n)) rc = 1;
    for (size_t i = 0; i < n; i++) fp_run_free(&runs[i]);
    free(runs);
    curl_global_cleanup();
    return rc;
}
