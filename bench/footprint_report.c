/*
 * pagekv bench footprint: the report. Medians with min-max over repeats, per-repeat
 * paged/dense ratios, the targets, the Markdown tables, the JSON and the SVG plots.
 */
#include "footprint.h"

#include "core/core.h"
#include "support/bench.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef struct {
    double med, min, max;
    size_t n;
} fp_stat_t;

static fp_stat_t fp_stats_of(const double *v, size_t n)
{
    fp_stat_t s = {0, 0, 0, n};
    if (!n) return s;
    s.med = pkv_bench_median(v, n);
    s.min = s.max = v[0];
    for (size_t i = 1; i < n; i++) s.min = fmin(s.min, v[i]), s.max = fmax(s.max, v[i]);
    return s;
}

/* The runs of (scenario, backend), in repeat order. */
static size_t fp_select(fp_run_t *runs, size_t n, int sc, pkv_backend_t b, fp_run_t **out)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (runs[i].scenario == sc && runs[i].backend == b && runs[i].ok) out[k++] = &runs[i];
    return k;
}

typedef double (*fp_field_fn)(const fp_run_t *r);
static double f_peak(const fp_run_t *r)
{
    return fp_mib(r->peak_bytes);
}
static double f_last(const fp_run_t *r)
{
    return fp_mib(r->last_bytes);
}
static double f_settled(const fp_run_t *r)
{
    return fp_mib(r->settled_bytes);
}
static double f_base(const fp_run_t *r)
{
    return fp_mib(r->baseline_bytes);
}
static double f_kvpeak(const fp_run_t *r)
{
    return fp_mib(r->kv_committed_peak);
}
static double f_kvmin(const fp_run_t *r)
{
    return fp_mib(r->kv_min);
}
static double f_wall(const fp_run_t *r)
{
    return r->wall_s;
}
static double f_anon(const fp_run_t *r)
{
    return (double)r->anon_growth / FP_MIB;
}
static double f_kvend(const fp_run_t *r)
{
    return fp_mib(r->kv_committed_end);
}
static double f_anon_minus_kv(const fp_run_t *r)
{
    return ((double)r->anon_growth - (double)r->kv_committed_end) / FP_MIB;
}
static double f_cached(const fp_run_t *r)
{
    return (double)r->cached_tokens;
}

static fp_stat_t fp_field(fp_run_t **sel, size_t n, fp_field_fn f)
{
    double v[256];
    n = PKV_MIN(n, PKV_ARRAY_LEN(v));
    for (size_t i = 0; i < n; i++) v[i] = f(sel[i]);
    return fp_stats_of(v, n);
}

/* "median" or "median (min-max)" with `prec` decimals (a sign when `sign`). */
static void fp_cell(char *buf, size_t cap, fp_stat_t s, int prec, bool sign)
{
    if (!s.n) {
        snprintf(buf, cap, "-");
        return;
    }
    if (s.n == 1) {
        snprintf(buf, cap, sign ? "%+.*f" : "%.*f", prec, s.med);
        return;
    }
    if (sign)
        snprintf(buf, cap, "%+.*f (%+.*f..%+.*f)", prec, s.med, prec, s.min, prec, s.max);
    else
        snprintf(buf, cap, "%.*f (%.*f-%.*f)", prec, s.med, prec, s.min, prec, s.max);
}

/* Per-repeat ratio paged/dense of a field, paired by repeat index. */
static fp_stat_t fp_ratio(fp_run_t *runs, size_t n, int sc, uint32_t repeats, fp_field_fn f,
                          bool diff)
{
    double v[256];
    size_t k = 0;
    for (uint32_t rep = 0; rep < repeats && k < PKV_ARRAY_LEN(v); rep++) {
        const fp_run_t *p = NULL, *d = NULL;
        for (size_t i = 0; i < n; i++) {
            if (runs[i].scenario != sc || runs[i].repeat != rep || !runs[i].ok) continue;
            if (runs[i].backend == PKV_BACKEND_PAGED)
                p = &runs[i];
            else
                d = &runs[i];
        }
        if (!p || !d) continue;
        if (diff)
            v[k++] = f(p) - f(d);
        else if (f(d) > 0)
            v[k++] = f(p) / f(d);
    }
    return fp_stats_of(v, k);
}

/* 1. shared_prefix_burst ratio. */
static void fp_target_burst_ratio(const fp_opts_t *o, fp_run_t *runs, size_t n, fp_target_t *t)
{
    fp_stat_t r = fp_ratio(runs, n, SC_BURST, o->repeat, f_peak, false);
    *t = (fp_target_t){"shared_prefix_burst: paged peak <= 0.3 x dense peak", -1, ""};
    if (r.n) {
        t->state = r.med <= 0.3;
        snprintf(t->detail, sizeof(t->detail), "paged/dense peak %.3f (median of %zu; %.3f-%.3f)",
                 r.med, r.n, r.min, r.max);
    }
}

/* 2. every scenario: paged peak <= dense peak. */
static void fp_target_every(const fp_opts_t *o, fp_run_t *runs, size_t n, fp_target_t *t)
{
    *t = (fp_target_t){"every scenario: paged peak <= dense peak (median ratio)", -1, ""};
    size_t off = 0;
    int measured = 0, met = 1;
    for (int sc = 0; sc < SC_N; sc++) {
        fp_stat_t q = fp_ratio(runs, n, sc, o->repeat, f_peak, false);
        fp_stat_t dq = fp_ratio(runs, n, sc, o->repeat, f_peak, true);
        if (!q.n) continue;
        measured++;
        if (q.med > 1.0) met = 0;
        off +=
            (size_t)snprintf(t->detail + off, sizeof(t->detail) - PKV_MIN(off, sizeof(t->detail)),
                             "%s%s %.3f (%+.2f MiB)%s", off ? ", " : "", fp_scenario_names[sc],
                             q.med, dq.med, q.med > 1.0 ? " MISSED" : "");
        if (off >= sizeof(t->detail)) off = sizeof(t->detail);
    }
    if (measured) t->state = met;
}

/* A paged run's committed-bytes bound: 1.05 x kv_min + one granule per storage range. */
static double fp_committed_bound(const fp_run_t *r)
{
    return 1.05 * (double)r->kv_min + (double)(r->granule_bytes * r->storage_ranges);
}

/* 3. shared_prefix_burst committed against kv_min. */
static void fp_target_burst_committed(fp_run_t *runs, size_t n, fp_target_t *t)
{
    fp_run_t *sel[256];
    *t = (fp_target_t){"shared_prefix_burst: kv_committed_peak <= 1.05 x kv_min + one granule "
                       "per storage range",
                       -1, ""};
    size_t ns = fp_select(runs, n, SC_BURST, PKV_BACKEND_PAGED, sel);
    if (!ns || !sel[0]->kv_min) return;
    double worst = 0;
    int ok = 1;
    for (size_t i = 0; i < ns; i++) {
        double bound = fp_committed_bound(sel[i]);
        if ((double)sel[i]->kv_committed_peak > bound) ok = 0;
        worst = fmax(worst, (double)sel[i]->kv_committed_peak / bound);
    }
    t->state = ok;
    snprintf(t->detail, sizeof(t->detail),
             "committed peak %.1f MiB, kv_min %.1f MiB, bound %.1f MiB (repeat 1); worst "
             "committed/bound %.3f over %zu",
             fp_mib(sel[0]->kv_committed_peak), fp_mib(sel[0]->kv_min),
             fp_committed_bound(sel[0]) / FP_MIB, worst, ns);
}

/* 4. idle: paged peak <= dense peak + 2 MiB. */
static void fp_target_idle(const fp_opts_t *o, fp_run_t *runs, size_t n, fp_target_t *t)
{
    *t = (fp_target_t){"idle: paged peak <= dense peak + 2 MiB", -1, ""};
    fp_stat_t d = fp_ratio(runs, n, SC_IDLE, o->repeat, f_peak, true);
    if (d.n) {
        t->state = d.med <= 2.0;
        snprintf(t->detail, sizeof(t->detail),
                 "paged - dense peak %+.2f MiB (median of %zu; %+.2f..%+.2f)", d.med, d.n, d.min,
                 d.max);
    }
}

/* 5. churn: committed within the budget, and back to one granule per range after reset. */
static void fp_target_churn(fp_run_t *runs, size_t n, fp_target_t *t)
{
    fp_run_t *sel[256];
    *t = (fp_target_t){"churn with --kv-cache-budget: committed <= budget; after "
                       "/v1/cache/reset <= one granule per storage range",
                       -1, ""};
    size_t off = 0;
    int measured = 0, met = 1;
    for (int b = 0; b < 2; b++) {
        size_t ns = fp_select(runs, n, SC_CHURN, (pkv_backend_t)b, sel);
        for (size_t i = 0; i < ns; i++) {
            fp_run_t *x = sel[i];
            if (!x->budget || !x->have_reset) continue;
            measured++;
            uint64_t seen = PKV_MAX(x->kv_committed_peak, x->kv_committed_polled_max);
            uint64_t after_bound = x->granule_bytes * x->storage_ranges;
            if (seen > x->budget || x->committed_after_reset > after_bound) met = 0;
            if (i == 0 && off < sizeof(t->detail))
                off += (size_t)snprintf(
                    t->detail + off, sizeof(t->detail) - off,
                    "%s%s: peak %.1f MiB of budget %.1f MiB, after reset %.2f MiB (bound %.2f)",
                    off ? "; " : "", pkv_backend_name((pkv_backend_t)b), fp_mib(seen),
                    fp_mib(x->budget), fp_mib(x->committed_after_reset), fp_mib(after_bound));
        }
    }
    if (measured)
        t->state = met;
    else if (fp_select(runs, n, SC_CHURN, PKV_BACKEND_PAGED, sel) ||
             fp_select(runs, n, SC_CHURN, PKV_BACKEND_DENSE, sel))
        snprintf(t->detail, sizeof(t->detail),
                 "churn ran without a budget (--churn-budget 0, or the server reported none)");
}

/* The level churn_then_idle and hangups come back to: after the warm-up and the idle
 * period (baseline when the run has none). */
static uint64_t fp_before(const fp_run_t *r)
{
    return r->before_bytes ? r->before_bytes : r->baseline_bytes;
}

/* 6, 7. churn_then_idle and hangups (paged): after the idle period the cache has given its
 * memory back: RSS within the tolerance of the idle level before the scenario (and, for
 * churn_then_idle, KV committed <= one granule per storage range), every repeat. */
static void fp_target_return(fp_run_t *runs, size_t n, int sc, fp_target_t *t)
{
    fp_run_t *sel[256];
    static char names[2][160];
    char *name = names[sc == SC_HANGUPS];
    snprintf(name, sizeof(names[0]),
             "%s (paged): after the idle period RSS <= %.2f x the idle level before it%s",
             fp_scenario_names[sc], 1.0 + fp_return_tolerance(sc),
             sc == SC_CHURN_IDLE ? ", KV committed <= one granule per storage range" : "");
    *t = (fp_target_t){name, -1, ""};
    size_t ns = fp_select(runs, n, sc, PKV_BACKEND_PAGED, sel);
    if (!ns) return;
    int ok = 1;
    for (size_t i = 0; i < ns; i++) {
        fp_run_t *x = sel[i];
        double bound = (double)fp_before(x) * (1.0 + fp_return_tolerance(sc));
        if ((double)x->settled_bytes > bound) ok = 0;
        if (sc == SC_CHURN_IDLE && x->kv_committed_end > x->granule_bytes * x->storage_ranges)
            ok = 0;
    }
    t->state = ok;
    fp_run_t *x = sel[0];
    snprintf(t->detail, sizeof(t->detail),
             "RSS %.1f MiB before, %.1f MiB peak, %.1f MiB after (%.3f x); KV committed %.1f MiB "
             "at the scenario's end, %.2f MiB after; back in %.1f s (KV) / %.1f s (RSS) (repeat 1 "
             "of %zu)",
             fp_mib(fp_before(x)), fp_mib(x->peak_bytes), fp_mib(x->settled_bytes),
             fp_before(x) ? (double)x->settled_bytes / (double)fp_before(x) : 0.0,
             fp_mib(x->kv_scenario_end), fp_mib(x->kv_committed_end), x->return_kv_s,
             x->return_rss_s, ns);
}

int fp_targets(const fp_opts_t *o, fp_run_t *runs, size_t n, fp_target_t *t)
{
    fp_target_burst_ratio(o, runs, n, &t[0]);
    fp_target_every(o, runs, n, &t[1]);
    fp_target_burst_committed(runs, n, &t[2]);
    fp_target_idle(o, runs, n, &t[3]);
    fp_target_churn(runs, n, &t[4]);
    fp_target_return(runs, n, SC_CHURN_IDLE, &t[5]);
    fp_target_return(runs, n, SC_HANGUPS, &t[6]);
    return FP_N_TARGETS;
}

void fp_print_report(const fp_opts_t *o, fp_run_t *runs, size_t n, fp_target_t *t, int nt)
{
    printf("## pagekv bench footprint (%s preset, %u-token shared prefix, %u repeat%s; median, "
           "(min-max) when repeated)\n\n",
           o->preset, o->prefix_tokens, o->repeat, o->repeat > 1 ? "s" : "");
    printf("| scenario | backend | peak MiB | last MiB | settled MiB | baseline MiB | KV "
           "committed peak MiB | kv_min MiB | cached tokens | wall s |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n");
    fp_run_t *sel[256];
    for (int sc = 0; sc < SC_N; sc++) {
        for (int b = 0; b < 2; b++) {
            if (!o->scenario[sc] || !o->backend[b]) continue;
            size_t ns = fp_select(runs, n, sc, (pkv_backend_t)b, sel);
            char c[8][64];
            fp_cell(c[0], 64, fp_field(sel, ns, f_peak), 1, false);
            fp_cell(c[1], 64, fp_field(sel, ns, f_last), 1, false);
            fp_cell(c[2], 64, fp_field(sel, ns, f_settled), 1, false);
            fp_cell(c[3], 64, fp_field(sel, ns, f_base), 1, false);
            fp_cell(c[4], 64, fp_field(sel, ns, f_kvpeak), 1, false);
            fp_cell(c[5], 64, fp_field(sel, ns, f_kvmin), 1, false);
            fp_cell(c[6], 64, fp_field(sel, ns, f_cached), 0, false);
            fp_cell(c[7], 64, fp_field(sel, ns, f_wall), 1, false);
            printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", fp_scenario_names[sc],
                   pkv_backend_name((pkv_backend_t)b), c[0], c[1], c[2], c[3], c[4], c[5], c[6],
                   c[7]);
        }
    }
    if (o->backend[0] && o->backend[1]) {
        printf("\n| scenario | paged/dense peak | paged - dense peak MiB |\n|---|---|---|\n");
        for (int sc = 0; sc < SC_N; sc++) {
            if (!o->scenario[sc]) continue;
            char a[64], b[64];
            fp_cell(a, 64, fp_ratio(runs, n, sc, o->repeat, f_peak, false), 3, false);
            fp_cell(b, 64, fp_ratio(runs, n, sc, o->repeat, f_peak, true), 1, true);
            printf("| %s | %s | %s |\n", fp_scenario_names[sc], a, b);
        }
    }
    printf("\nThe OS against the KV cache's own counters, at the end of settle: anonymous memory "
           "grown since the end of settle_load (smaps_rollup) and the server's committed_bytes.\n\n"
           "| scenario | backend | anon growth MiB | KV committed MiB | difference MiB |\n"
           "|---|---|---|---|---|\n");
    for (int sc = 0; sc < SC_N; sc++) {
        for (int b = 0; b < 2; b++) {
            if (!o->scenario[sc] || !o->backend[b]) continue;
            size_t ns = fp_select(runs, n, sc, (pkv_backend_t)b, sel);
            char c[3][64];
            fp_cell(c[0], 64, fp_field(sel, ns, f_anon), 1, false);
            fp_cell(c[1], 64, fp_field(sel, ns, f_kvend), 1, false);
            fp_cell(c[2], 64, fp_field(sel, ns, f_anon_minus_kv), 1, true);
            printf("| %s | %s | %s | %s | %s |\n", fp_scenario_names[sc],
                   pkv_backend_name((pkv_backend_t)b), c[0], c[1], c[2]);
        }
    }
    bool any_idle = false;
    for (int sc = 0; sc < SC_N; sc++) any_idle |= o->scenario[sc] && fp_scenario_idles(sc);
    if (any_idle) {
        printf("\nThe prefix cache gives memory back (server run with --prefix-cache-idle-s %g; "
               "settle lasts %g s): RSS before (after a warm-up request and the idle period, "
               "just before the load), peak and after (end of settle); KV committed at the "
               "scenario's end and after; seconds from the "
               "scenario's end until KV committed <= one granule per range and RSS <= before x "
               "1.05 (churn_then_idle) / 1.10 (hangups); -1: not within settle.\n\n"
               "| scenario | backend | RSS before MiB | peak MiB | RSS after MiB | KV at end MiB "
               "| KV after MiB | KV back s | RSS back s |\n|---|---|---|---|---|---|---|---|---|\n",
               o->cache_idle_s, o->settle_s + o->cache_idle_s);
        for (size_t i = 0; i < n; i++) {
            fp_run_t *x = &runs[i];
            if (!x->ok || !fp_scenario_idles(x->scenario)) continue;
            printf("| %s | %s | %.1f | %.1f | %.1f | %.1f | %.2f | %.1f | %.1f |\n",
                   fp_scenario_names[x->scenario], pkv_backend_name(x->backend),
                   fp_mib(fp_before(x)), fp_mib(x->peak_bytes), fp_mib(x->settled_bytes),
                   fp_mib(x->kv_scenario_end), fp_mib(x->kv_committed_end), x->return_kv_s,
                   x->return_rss_s);
        }
    }
    printf("\n### targets\n\n");
    for (int i = 0; i < nt; i++)
        printf("- %s %s: %s\n",
               t[i].state == 1   ? "MET"
               : t[i].state == 0 ? "MISSED"
                                 : "NOT MEASURED",
               t[i].name,
               t[i].detail[0] ? t[i].detail
                              : "(not run: ratios need the scenario on both backends)");
    int failed = 0;
    for (size_t i = 0; i < n; i++) failed += !runs[i].ok;
    if (failed) printf("\n%d run%s failed (see stderr).\n", failed, failed > 1 ? "s" : "");
}

static json_t *fp_phase_json(const fp_phase_t *p, uint64_t ready_ns)
{
    json_t *o =
        json_pack("{s:f, s:f, s:I, s:I, s:I, s:I, s:I, s:I}", "begin_s",
                  ((double)p->begin_ns - (double)ready_ns) / FP_NS, "duration_s",
                  (double)(p->end_ns - p->begin_ns) / FP_NS, "peak_bytes",
                  (json_int_t)PKV_MAX(p->w.peak_bytes, p->hwm_bytes), "sampled_peak_bytes",
                  (json_int_t)p->w.peak_bytes, "hwm_bytes", (json_int_t)p->hwm_bytes, "last_bytes",
                  (json_int_t)p->w.last_bytes, "samples", (json_int_t)p->w.n_samples,
                  "rss_anon_bytes", (json_int_t)p->mem.rss_anon_bytes);
    if (o && p->have_smaps)
        json_object_set_new(o, "smaps_rollup",
                            json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "rss_bytes",
                                      (json_int_t)p->smaps.rss_bytes, "pss_bytes",
                                      (json_int_t)p->smaps.pss_bytes, "pss_anon_bytes",
                                      (json_int_t)p->smaps.pss_anon_bytes, "pss_file_bytes",
                                      (json_int_t)p->smaps.pss_file_bytes, "anonymous_bytes",
                                      (json_int_t)p->smaps.anonymous_bytes, "anon_huge_bytes",
                                      (json_int_t)p->smaps.anon_huge_bytes, "private_dirty_bytes",
                                      (json_int_t)p->smaps.private_dirty_bytes, "swap_bytes",
                                      (json_int_t)p->smaps.swap_bytes));
    return o;
}

static json_t *fp_run_json(const fp_run_t *r)
{
    json_t *o =
        json_pack("{s:s, s:s, s:I, s:b}", "scenario", fp_scenario_names[r->scenario], "backend",
                  pkv_backend_name(r->backend), "repeat", (json_int_t)r->repeat, "ok", r->ok);
    if (!o) return NULL;
    json_object_set_new(o, "server_command", json_string(r->server_cmd));
    if (!r->ok) {
        json_object_set_new(o, "error", json_string(r->error));
        json_object_set_new(o, "server_log", json_string(r->log_path));
        return o;
    }
    json_t *x = json_pack(
        "{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}",
        "peak_bytes", (json_int_t)r->peak_bytes, "last_bytes", (json_int_t)r->last_bytes,
        "settled_bytes", (json_int_t)r->settled_bytes, "baseline_bytes",
        (json_int_t)r->baseline_bytes, "cached_tokens", (json_int_t)r->cached_tokens,
        "prompt_tokens", (json_int_t)r->prompt_tokens, "completion_tokens",
        (json_int_t)r->completion_tokens, "wall_s", r->wall_s, "kv_committed_peak_bytes",
        (json_int_t)r->kv_committed_peak, "kv_committed_polled_max_bytes",
        (json_int_t)r->kv_committed_polled_max, "kv_live_polled_max_bytes",
        (json_int_t)r->kv_live_polled_max_bytes, "kv_min_bytes", (json_int_t)r->kv_min,
        "kv_block_bytes", (json_int_t)r->block_bytes, "kv_token_bytes", (json_int_t)r->token_bytes,
        "kv_granule_bytes", (json_int_t)r->granule_bytes, "kv_storage_ranges",
        (json_int_t)r->storage_ranges, "kv_budget_bytes", (json_int_t)r->budget);
    json_object_update(o, x);
    json_decref(x);
    json_object_set_new(o, "kv_storage_ranges_assumed", json_boolean(r->ranges_assumed));
    json_object_set_new(o, "anon_growth_bytes", json_integer((json_int_t)r->anon_growth));
    json_object_set_new(o, "kv_committed_end_bytes", json_integer((json_int_t)r->kv_committed_end));
    json_object_set_new(o, "server_exit", json_string(r->exit_text));
    json_object_set_new(o, "load_s", json_real((double)(r->ready_ns - r->start_ns) / FP_NS));
    if (fp_scenario_idles(r->scenario))
        json_object_set_new(
            o, "cache_return",
            json_pack("{s:I, s:I, s:f, s:f, s:I}", "before_bytes", (json_int_t)r->before_bytes,
                      "kv_committed_scenario_end_bytes", (json_int_t)r->kv_scenario_end,
                      "kv_back_s", r->return_kv_s, "rss_back_s", r->return_rss_s, "hangups",
                      (json_int_t)r->hangups));
    if (r->have_reset)
        json_object_set_new(o, "committed_after_reset_bytes",
                            json_integer((json_int_t)r->committed_after_reset));
    json_t *ph = json_object();
    for (int p = 0; p < PH_N; p++)
        json_object_set_new(ph, fp_phase_names[p], fp_phase_json(&r->ph[p], r->ready_ns));
    json_object_set_new(o, "phases", ph);
    json_t *reqs = json_array();
    for (size_t i = 0; i < r->n_reqs; i++)
        json_array_append_new(reqs,
                              json_pack("{s:I, s:I, s:I, s:I, s:b, s:f}", "prompt_tokens",
                                        (json_int_t)r->reqs[i].prompt_tokens, "completion_tokens",
                                        (json_int_t)r->reqs[i].completion_tokens, "cached_tokens",
                                        (json_int_t)r->reqs[i].cached_tokens, "group",
                                        (json_int_t)r->reqs[i].group, "shared_prefix",
                                        r->reqs[i].shared_prefix, "wall_s", r->req_wall_s[i]));
    json_object_set_new(o, "requests", reqs);
    json_t *rss = json_array(), *kv = json_array();
    for (size_t i = 0; i < r->n_samples; i++)
        json_array_append_new(
            rss, json_pack("[f, I]", ((double)r->samples[i].t_ns - (double)r->ready_ns) / FP_NS,
                           (json_int_t)r->samples[i].bytes));
    for (size_t i = 0; i < r->n_kv; i++)
        json_array_append_new(kv, json_pack("[f, I]",
                                            ((double)r->kv[i].t_ns - (double)r->ready_ns) / FP_NS,
                                            (json_int_t)r->kv[i].committed));
    json_object_set_new(o, "rss_samples", rss);
    json_object_set_new(o, "kv_committed_samples", kv);
    if (r->stats) json_object_set(o, "server_stats", r->stats);
    if (r->stats_after_reset) json_object_set(o, "server_stats_after_reset", r->stats_after_reset);
    return o;
}

int fp_write_json(const fp_opts_t *o, fp_run_t *runs, size_t n, fp_target_t *t, int nt, double cpt)
{
    json_t *root = json_object(), *ra = json_array(), *ta = json_array(), *pass = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(ra, fp_run_json(&runs[i]));
    for (int i = 0; i < nt; i++)
        json_array_append_new(ta, json_pack("{s:s, s:o, s:s}", "target", t[i].name, "met",
                                            t[i].state < 0 ? json_null() : json_boolean(t[i].state),
                                            "detail", t[i].detail));
    for (int i = 0; i < o->n_pass; i++) json_array_append_new(pass, json_string(o->pass[i]));
    const char *arena = getenv("MALLOC_ARENA_MAX");
    json_object_set_new(
        root, "config",
        json_pack("{s:s, s:I, s:f, s:f, s:f, s:f, s:I, s:f, s:I, s:o, s:s*}", "preset", o->preset,
                  "repeat", (json_int_t)o->repeat, "cache_idle_s", o->cache_idle_s, "settle_load_s",
                  o->settle_load_s, "settle_s", o->settle_s, "idle_s", o->idle_s, "prefix_tokens",
                  (json_int_t)o->prefix_tokens, "filler_chars_per_token", cpt, "churn_budget_bytes",
                  (json_int_t)o->churn_budget, "server_flags", pass, "MALLOC_ARENA_MAX", arena));
    json_object_set_new(root, "runs", ra);
    json_object_set_new(root, "targets", ta);
    int rc = pkv_bench_write_json(o->json_path, root);
    json_decref(root);
    return rc;
}

/* One scenario's plot: VmRSS and KV committed of each backend's first repeat, with the
 * scenario's start and each backend's end marked. */
typedef struct {
    pkv_fp_series_t s[4];
    pkv_fp_mark_t m[5];
    double *bufs[8];
    char labels[4][48], mlabels[5][48];
    size_t ns, nm;
} fp_plot_t;

static const char *const fp_backend_color[2] = {"#1f5fbf", "#d03a1f"};

/* Seconds since ready and MiB of the samples taken after ready; returns the count. */
static size_t fp_plot_rss(const fp_run_t *r, double *x, double *y)
{
    size_t k = 0;
    for (size_t i = 0; i < r->n_samples; i++) {
        if (r->samples[i].t_ns < r->ready_ns) continue;
        x[k] = (double)(r->samples[i].t_ns - r->ready_ns) / FP_NS;
        y[k++] = fp_mib(r->samples[i].bytes);
    }
    return k;
}

static size_t fp_plot_kv(const fp_run_t *r, double *x, double *y)
{
    size_t k = 0;
    for (size_t i = 0; i < r->n_kv; i++) {
        if (r->kv[i].t_ns < r->ready_ns) continue;
        x[k] = (double)(r->kv[i].t_ns - r->ready_ns) / FP_NS;
        y[k++] = fp_mib(r->kv[i].committed);
    }
    return k;
}

/* Add backend b's run r to the plot; -1 when out of memory. */
static int fp_plot_add(fp_plot_t *pl, const fp_run_t *r, int b)
{
    double *x = pl->bufs[4 * b] = malloc((r->n_samples + 1) * sizeof(double));
    double *y = pl->bufs[4 * b + 1] = malloc((r->n_samples + 1) * sizeof(double));
    double *kx = pl->bufs[4 * b + 2] = malloc((r->n_kv + 1) * sizeof(double));
    double *ky = pl->bufs[4 * b + 3] = malloc((r->n_kv + 1) * sizeof(double));
    if (!x || !y || !kx || !ky) return -1;
    const char *bn = pkv_backend_name((pkv_backend_t)b), *color = fp_backend_color[b];
    size_t ns = pl->ns, nm = pl->nm;
    snprintf(pl->labels[ns], sizeof(pl->labels[ns]), "%s VmRSS", bn);
    pl->s[ns] = (pkv_fp_series_t){pl->labels[ns], color, false, x, y, fp_plot_rss(r, x, y)};
    ns++;
    snprintf(pl->labels[ns], sizeof(pl->labels[ns]), "%s KV committed", bn);
    pl->s[ns] = (pkv_fp_series_t){pl->labels[ns], color, true, kx, ky, fp_plot_kv(r, kx, ky)};
    ns++;
    if (nm == 0) {
        snprintf(pl->mlabels[nm], sizeof(pl->mlabels[nm]), "scenario starts");
        pl->m[nm] = (pkv_fp_mark_t){(double)(r->ph[PH_SCENARIO].begin_ns - r->ready_ns) / FP_NS,
                                    pl->mlabels[nm], "#555555"};
        nm++;
    }
    snprintf(pl->mlabels[nm], sizeof(pl->mlabels[nm]), "%s: scenario ends", bn);
    pl->m[nm] = (pkv_fp_mark_t){(double)(r->ph[PH_SCENARIO].end_ns - r->ready_ns) / FP_NS,
                                pl->mlabels[nm], color};
    nm++;
    pl->ns = ns;
    pl->nm = nm;
    return 0;
}

/* Write DIR/footprint-<scenario>.svg; 0 or -1 with a message. */
static int fp_plot_write(const fp_opts_t *o, int sc, const fp_plot_t *pl)
{
    char path[4096], title[160];
    snprintf(path, sizeof(path), "%s/footprint-%s.svg", o->svg_dir, fp_scenario_names[sc]);
    snprintf(title, sizeof(title), "pagekv serve memory: %s (%s preset, f16 KV, repeat 1)",
             fp_scenario_names[sc], o->preset);
    FILE *f = fopen(path, "w");
    int wrc = f ? pkv_fp_svg_write(f, title, pl->s, pl->ns, pl->m, pl->nm) : -1;
    if (f && fclose(f)) wrc = -1;
    if (wrc) {
        fprintf(stderr, "pagekv bench footprint: cannot write %s\n", path);
        return -1;
    }
    fprintf(stderr, "wrote %s\n", path);
    return 0;
}

int fp_write_svgs(const fp_opts_t *o, fp_run_t *runs, size_t n)
{
    if (mkdir(o->svg_dir, 0755) && errno != EEXIST) {
        fprintf(stderr, "pagekv bench footprint: cannot create %s: %s\n", o->svg_dir,
                strerror(errno));
        return -1;
    }
    int ret = 0;
    for (int sc = 0; sc < SC_N; sc++) {
        if (!o->scenario[sc]) continue;
        fp_plot_t pl = {0};
        bool oom = false;
        for (int b = 0; b < 2 && !oom; b++) {
            fp_run_t *r = NULL;
            for (size_t i = 0; i < n && !r; i++)
                if (runs[i].scenario == sc && runs[i].backend == (pkv_backend_t)b && runs[i].ok &&
                    runs[i].repeat == 0)
                    r = &runs[i];
            if (r) oom = fp_plot_add(&pl, r, b) != 0;
        }
        if (oom) {
            fprintf(stderr, "pagekv bench footprint: out of memory plotting %s\n",
                    fp_scenario_names[sc]);
            ret = -1;
        } else if (pl.ns && fp_plot_write(o, sc, &pl)) {
            ret = -1;
        }
        for (int i = 0; i < 8; i++) free(pl.bufs[i]);
    }
    return ret;
}
