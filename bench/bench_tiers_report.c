/*
 * pagekv bench tiers: the targets (each met or not with its cause), the
 * Markdown tables, the JSON (--json) and the SVG of TTFT per round (--svg).
 */
#include "bench_tiers.h"

#include "core/core.h"
#include "support/bench.h"
#include "support/footprint.h"
#include "support/loadgen.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BT_MIB (1024.0 * 1024.0)

static double bt_mib(uint64_t b)
{
    return (double)b / BT_MIB;
}

/* The arm if it ran to its end, else NULL. */
static const bt_arm_t *bt_ok(const bt_part_t *p, int k)
{
    return p && p->arm[k].ran && p->arm[k].ok ? &p->arm[k] : NULL;
}

/* The median TTFT (ms) of an arm's requests in rounds [from, to) (0-based). */
static double bt_p50(const bt_work_t *w, const bt_arm_t *a, uint32_t from, uint32_t to)
{
    size_t n = (size_t)(to - from) * w->users;
    double *v = malloc((n ? n : 1) * sizeof(double));
    if (!v) return NAN;
    memcpy(v, a->ttft_ms + (size_t)from * w->users, n * sizeof(double));
    double q = lg_quantile(v, n, 0.5);
    free(v);
    return q;
}

/* Sums of rounds [from, to). */
static bt_round_t bt_sum(const bt_arm_t *a, uint32_t from, uint32_t to)
{
    bt_round_t s = {0};
    for (uint32_t r = from; r < to; r++) {
        const bt_round_t *x = &a->round[r];
        s.requests += x->requests;
        s.prompt_tokens += x->prompt_tokens;
        s.cached_memory += x->cached_memory;
        s.cached_disk += x->cached_disk;
        s.loaded_bytes += x->loaded_bytes;
        s.load_s += x->load_s;
        s.decide_load += x->decide_load;
        s.decide_recompute += x->decide_recompute;
    }
    return s;
}

/* Why a disk arm's TTFT over rounds [from, to) is what it is: where its prompts came from. */
static void bt_cause(const bt_arm_t *a, uint32_t from, uint32_t to, char *out, size_t cap)
{
    bt_round_t s = bt_sum(a, from, to);
    uint64_t computed = s.prompt_tokens - PKV_MIN(s.prompt_tokens, s.cached_memory + s.cached_disk);
    int n = snprintf(out, cap,
                     "%s: of %llu prompt tokens %llu from memory, %llu from disk, %llu computed; "
                     "%.1f MiB loaded in %.2f s; decisions %llu load / %llu recompute",
                     bt_arm_names[a->kind], (unsigned long long)s.prompt_tokens,
                     (unsigned long long)s.cached_memory, (unsigned long long)s.cached_disk,
                     (unsigned long long)computed, bt_mib(s.loaded_bytes), s.load_s,
                     (unsigned long long)s.decide_load, (unsigned long long)s.decide_recompute);
    if (n > 0 && (size_t)n < cap && a->dropped_evicted)
        n += snprintf(out + n, cap - (size_t)n, "; %llu writes dropped (left memory first)",
                      (unsigned long long)a->dropped_evicted);
    if (n > 0 && (size_t)n < cap && !s.cached_disk && s.cached_memory)
        snprintf(out + n, cap - (size_t)n,
                 "; nothing left memory: the working set fits the KV budget");
}

static void bt_target_ttft(const bt_part_t *mr, bt_target_t *t)
{
    *t = (bt_target_t){.name = "rounds >= 2: disk arm TTFT p50 <= 0.2 x the recompute arm's",
                       .met = -1,
                       .target = "<= 0.2"};
    const bt_arm_t *d = bt_ok(mr, BT_DISK), *c = bt_ok(mr, BT_RECOMPUTE);
    if (!d || !c) return;
    double pd = bt_p50(&mr->w, d, 1, mr->w.rounds), pc = bt_p50(&mr->w, c, 1, mr->w.rounds);
    t->value = pc > 0 ? pd / pc : NAN;
    t->met = t->value <= 0.2;
    int n = snprintf(t->detail, sizeof(t->detail), "disk %.0f ms / recompute %.0f ms", pd, pc);
    if (!t->met && n > 0) {
        snprintf(t->detail + n, sizeof(t->detail) - (size_t)n, "; not met: ");
        size_t k = strlen(t->detail);
        bt_cause(d, 1, mr->w.rounds, t->detail + k, sizeof(t->detail) - k);
    }
}

static void bt_target_restart(const bt_part_t *mr, bt_target_t *t)
{
    *t = (bt_target_t){.name = "the restart cohort's first round after the restart within 1.25 x "
                               "the disk arm's same round (TTFT p50)",
                       .met = -1,
                       .target = "<= 1.25"};
    const bt_arm_t *d = bt_ok(mr, BT_DISK), *s = bt_ok(mr, BT_RESTART);
    if (!d || !s) return;
    uint32_t r = mr->w.restart_round - 1;
    double ps = s->round[r].ttft_p50_ms, pd = d->round[r].ttft_p50_ms;
    t->value = pd > 0 ? ps / pd : NAN;
    t->met = t->value <= 1.25;
    int n = snprintf(t->detail, sizeof(t->detail),
                     "round %u: restart %.0f ms / disk %.0f ms; %llu blocks queued at the kill",
                     r + 1, ps, pd, (unsigned long long)s->kill_queued);
    if (!t->met && n > 0) {
        snprintf(t->detail + n, sizeof(t->detail) - (size_t)n, "; not met: ");
        size_t k = strlen(t->detail);
        bt_cause(s, r, r + 1, t->detail + k, sizeof(t->detail) - k);
    }
}

/* Calls f on every arm of both workloads that ran to its end. */
#define BT_EACH_ARM(mr, tile, a)                                                                   \
    for (int bt_p_ = 0; bt_p_ < 2; bt_p_++)                                                        \
        for (int bt_k_ = 0; bt_k_ < BT_ARMS; bt_k_++)                                              \
            for (const bt_arm_t *a = bt_ok(bt_p_ ? (tile) : (mr), bt_k_); a; a = NULL)

static void bt_target_identical(const bt_part_t *mr, const bt_part_t *tile, bt_target_t *t)
{
    *t = (bt_target_t){.name = "every answer in every arm bitwise equal to the reference pass's",
                       .met = -1,
                       .target = "== 0 differing"};
    uint64_t req = 0, same = 0;
    size_t off = 0;
    BT_EACH_ARM(mr, tile, a)
    {
        if (a->kind == BT_REF) continue;
        req += a->requests;
        same += a->identical;
        if (a->identical != a->requests && off < sizeof(t->detail))
            off +=
                (size_t)snprintf(t->detail + off, sizeof(t->detail) - off, "%s%s %s: %u of %u; ",
                                 off ? "" : "not met: differing: ", bt_p_ ? "tile" : "multiround",
                                 bt_arm_names[a->kind], a->requests - a->identical, a->requests);
    }
    if (!req) return;
    t->value = (double)(req - same);
    t->met = req == same;
    if (t->met) snprintf(t->detail, sizeof(t->detail), "%llu answers", (unsigned long long)req);
}

static void bt_target_disk(const bt_part_t *mr, const bt_part_t *tile, bt_target_t *t)
{
    *t = (bt_target_t){.name = "disk bytes <= --kv-disk-bytes at every sample",
                       .met = -1,
                       .target = "<= 1 (peak / cap)"};
    uint64_t samples = 0, over = 0, peak = 0, cap = 0, metric = 0;
    BT_EACH_ARM(mr, tile, a)
    {
        if (!a->disk_cap) continue;
        samples += a->disk_samples;
        over += a->disk_over;
        peak = PKV_MAX(peak, a->disk_peak);
        metric = PKV_MAX(metric, a->tier_bytes_max);
        cap = a->disk_cap;
    }
    if (!samples) return;
    t->value = (double)peak / (double)cap;
    t->met = over == 0 && metric <= cap;
    snprintf(t->detail, sizeof(t->detail),
             "%sdirectory peak %.1f MiB of %.1f MiB over %llu samples (%llu above the cap); "
             "pagekv_kv_tier_bytes at most %.1f MiB",
             t->met ? "" : "not met: ", bt_mib(peak), bt_mib(cap), (unsigned long long)samples,
             (unsigned long long)over, bt_mib(metric));
}

static void bt_target_rss(const bt_part_t *mr, const bt_part_t *tile, bt_target_t *t)
{
    static char name[160];
    *t = (bt_target_t){.name = name, .met = -1};
    uint64_t budget = 0, worst = 0;
    const char *where = "";
    BT_EACH_ARM(mr, tile, a)
    {
        if (!a->budget || !a->rss_idle) continue;
        budget = a->budget;
        uint64_t over = a->rss_peak > a->rss_idle ? a->rss_peak - a->rss_idle : 0;
        if (over >= worst) worst = over, where = bt_arm_names[a->kind];
    }
    snprintf(name, sizeof(name),
             "the server's RSS above its idle RSS within its KV budget + 64 MiB");
    if (!budget) return;
    double bound = bt_mib(budget) + 64;
    snprintf(t->target, sizeof(t->target), "<= %.0f MiB", bound);
    t->value = bt_mib(worst);
    t->met = t->value <= bound;
    snprintf(t->detail, sizeof(t->detail),
             "%slargest: %.1f MiB above idle (%s arm), budget %.0f MiB",
             t->met ? "" : "not met: ", t->value, where, bt_mib(budget));
}

static void bt_target_counts(const bt_part_t *mr, const bt_part_t *tile, bt_target_t *t)
{
    uint64_t corrupt = 0, past = 0, timeouts = 0;
    int arms = 0;
    BT_EACH_ARM(mr, tile, a)
    {
        if (!a->disk_cap) continue;
        arms++;
        corrupt += a->corrupt;
        past += a->past_deadline;
        timeouts += a->load_timeouts;
    }
    t[0] = (bt_target_t){.name = "0 corrupt records in a clean run", .met = -1, .target = "== 0"};
    t[1] = (bt_target_t){
        .name = "0 requests waiting on the disk past their deadline", .met = -1, .target = "== 0"};
    if (!arms) return;
    t[0].value = (double)corrupt;
    t[0].met = corrupt == 0;
    snprintf(t[0].detail, sizeof(t[0].detail), "%spagekv_kv_tier_corrupt_total over %d arms",
             corrupt ? "not met: " : "", arms);
    t[1].value = (double)past;
    t[1].met = past == 0;
    snprintf(t[1].detail, sizeof(t[1].detail),
             "%sloads above %d ms (pagekv_kv_tier_load_seconds); %llu loads reached the deadline "
             "(the rest recomputed)",
             past ? "not met: " : "", BT_LOAD_MS, (unsigned long long)timeouts);
}

void bt_targets(const bt_env_t *e, const bt_part_t *mr, const bt_part_t *tile, bt_target_t *t)
{
    (void)e;
    bt_target_ttft(mr, &t[BT_T_TTFT]);
    bt_target_restart(mr, &t[BT_T_RESTART]);
    bt_target_identical(mr, tile, &t[BT_T_IDENTICAL]);
    bt_target_disk(mr, tile, &t[BT_T_DISK]);
    bt_target_rss(mr, tile, &t[BT_T_RSS]);
    bt_target_counts(mr, tile, &t[BT_T_CORRUPT]);
}

/* ---- Markdown ---------------------------------------------------------------------------- */

static double bt_read_rate(const bt_round_t *r)
{
    return r->load_s > 0 ? bt_mib(r->loaded_bytes) / r->load_s : 0;
}

static void bt_print_part(const bt_part_t *p)
{
    const bt_work_t *w = &p->w;
    printf("\n### %s (%u %s x %u rounds; restart_round %u)\n\n", w->name, w->users,
           w->grows ? "users" : "documents", w->rounds, w->restart_round);
    printf("| arm | round | TTFT p50 ms | TTFT max ms | cached memory | cached disk | loaded MiB "
           "| read MiB/s | load / recompute | RSS peak MiB | disk MiB | identical |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int k = 0; k < BT_ARMS; k++) {
        const bt_arm_t *a = bt_ok(p, k);
        for (uint32_t r = 0; a && r < w->rounds; r++) {
            const bt_round_t *x = &a->round[r];
            bool rs = k == BT_RESTART && r + 1 == w->restart_round;
            printf("| %s | %u%s | %.0f | %.0f | %llu | %llu | %.1f | %.0f | %llu / %llu | %.1f | "
                   "%.1f | %u/%u |\n",
                   bt_arm_names[k], r + 1, rs ? " (restart)" : "", x->ttft_p50_ms, x->ttft_max_ms,
                   (unsigned long long)x->cached_memory, (unsigned long long)x->cached_disk,
                   bt_mib(x->loaded_bytes), bt_read_rate(x), (unsigned long long)x->decide_load,
                   (unsigned long long)x->decide_recompute, bt_mib(x->rss_peak),
                   bt_mib(x->disk_peak), x->identical, x->requests);
        }
    }
    printf("\n| arm | requests | identical | RSS idle MiB | RSS peak MiB | cgroup peak MiB (page "
           "cache) | disk peak MiB | cap MiB | corrupt | load timeouts | writes dropped (evicted) "
           "| wall s |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int k = 0; k < BT_ARMS; k++) {
        const bt_arm_t *a = &p->arm[k];
        if (!a->ran) continue;
        if (!a->ok) {
            printf("| %s | FAILED: %s |||||||||\n", bt_arm_names[k], a->error);
            continue;
        }
        printf("| %s | %u | %u | %.1f | %.1f | %.1f (%.1f) | %.1f | %.0f | %llu | %llu | %llu | "
               "%.1f |\n",
               bt_arm_names[k], a->requests, a->identical, bt_mib(a->rss_idle), bt_mib(a->rss_peak),
               bt_mib(a->cg_peak), bt_mib(a->cg_cache_peak), bt_mib(a->disk_peak),
               bt_mib(a->disk_cap), (unsigned long long)a->corrupt,
               (unsigned long long)a->load_timeouts, (unsigned long long)a->dropped_evicted,
               a->wall_s);
    }
}

void bt_print_report(const bt_env_t *e, const bt_part_t *mr, const bt_part_t *tile,
                     const bt_target_t *t)
{
    const bt_opts_t *o = e->o;
    printf("## pagekv bench tiers (%s preset; %u users x %u rounds: system %u, history %u, "
           "question %u tokens, %u-%u out; KV budget %.0f MiB; disk cap %.0f MiB)\n",
           o->preset, o->users, o->rounds, o->system_tokens, o->history_tokens, o->question_tokens,
           o->out_min, o->out_max, bt_mib(e->budget), bt_mib(o->disk_bytes));
    bt_print_part(mr);
    if (tile) bt_print_part(tile);
    printf("\n### targets\n\n");
    for (int i = 0; i < BT_N_TARGETS; i++)
        printf("- %s: %s: %.3g (target %s)%s%s\n", t[i].name,
               t[i].met < 0 ? "not measured"
               : t[i].met   ? "met"
                            : "NOT MET",
               t[i].value, t[i].target, t[i].detail[0] ? "; " : "", t[i].detail);
}

/* ---- JSON -------------------------------------------------------------------------------- */

static json_t *bt_round_json(uint32_t r, const bt_round_t *x)
{
    return json_pack(
        "{s:I, s:I, s:I, s:f, s:f, s:I, s:I, s:I, s:I, s:f, s:f, s:{s:I, s:I}, "
        "s:I, s:I, s:I, s:I, s:I}",
        "round", (json_int_t)r + 1, "requests", (json_int_t)x->requests, "identical",
        (json_int_t)x->identical, "ttft_p50_ms", x->ttft_p50_ms, "ttft_max_ms", x->ttft_max_ms,
        "prompt_tokens", (json_int_t)x->prompt_tokens, "cached_tokens_memory",
        (json_int_t)x->cached_memory, "cached_tokens_disk", (json_int_t)x->cached_disk,
        "loaded_bytes", (json_int_t)x->loaded_bytes, "load_seconds", x->load_s, "read_bytes_per_s",
        x->load_s > 0 ? (double)x->loaded_bytes / x->load_s : 0.0, "load_decisions", "load",
        (json_int_t)x->decide_load, "recompute", (json_int_t)x->decide_recompute, "rss_peak_bytes",
        (json_int_t)x->rss_peak, "rss_end_bytes", (json_int_t)x->rss_end, "disk_bytes_peak",
        (json_int_t)x->disk_peak, "disk_bytes_end", (json_int_t)x->disk_end, "cgroup_bytes_peak",
        (json_int_t)x->cg_peak);
}

static json_t *bt_arm_json(const bt_work_t *w, const bt_arm_t *a)
{
    json_t *o = json_pack(
        "{s:s, s:b, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f}", "name",
        bt_arm_names[a->kind], "ok", a->ok, "requests", (json_int_t)a->requests, "identical",
        (json_int_t)a->identical, "rss_idle_bytes", (json_int_t)a->rss_idle, "rss_peak_bytes",
        (json_int_t)a->rss_peak, "disk_bytes_peak", (json_int_t)a->disk_peak, "disk_bytes_cap",
        (json_int_t)a->disk_cap, "corrupt", (json_int_t)a->corrupt, "load_timeouts",
        (json_int_t)a->load_timeouts, "loads_past_deadline", (json_int_t)a->past_deadline,
        "dropped_writes_evicted", (json_int_t)a->dropped_evicted, "kv_budget_bytes",
        (json_int_t)a->budget, "wall_s", a->wall_s);
    if (o) {
        json_object_set_new(o, "cgroup_bytes_peak", json_integer((json_int_t)a->cg_peak));
        json_object_set_new(o, "cgroup_cache_bytes_peak",
                            json_integer((json_int_t)a->cg_cache_peak));
    }
    if (!o) return NULL;
    if (!a->ok) json_object_set_new(o, "error", json_string(a->error));
    if (a->kind == BT_RESTART)
        json_object_set_new(o, "queued_at_kill", json_integer((json_int_t)a->kill_queued));
    json_t *rs = json_array();
    for (uint32_t r = 0; a->ok && r < w->rounds; r++)
        json_array_append_new(rs, bt_round_json(r, &a->round[r]));
    json_object_set_new(o, "rounds", rs);
    return o;
}

/* {arms: [recompute, disk, restart], reference, restart_round, users, rounds}. */
static json_t *bt_part_json(const bt_part_t *p)
{
    json_t *arms = json_array();
    for (int k = BT_RECOMPUTE; k < BT_ARMS; k++)
        if (p->arm[k].ran) json_array_append_new(arms, bt_arm_json(&p->w, &p->arm[k]));
    json_t *o = json_pack("{s:o, s:I, s:I, s:I}", "arms", arms, "restart_round",
                          (json_int_t)p->w.restart_round, "users", (json_int_t)p->w.users, "rounds",
                          (json_int_t)p->w.rounds);
    if (o && p->arm[BT_REF].ran)
        json_object_set_new(o, "reference", bt_arm_json(&p->w, &p->arm[BT_REF]));
    return o;
}

int bt_write_json(const bt_env_t *e, const bt_part_t *mr, const bt_part_t *tile,
                  const bt_target_t *t, double wall_s)
{
    const bt_opts_t *o = e->o;
    json_t *root = bt_part_json(mr), *ta = json_array();
    if (!root || !ta) return json_decref(root), json_decref(ta), -1;
    for (int i = 0; i < BT_N_TARGETS; i++)
        json_array_append_new(
            ta,
            json_pack("{s:s, s:o, s:s, s:o, s:s}", "name", t[i].name, "value",
                      t[i].met < 0 || !isfinite(t[i].value) ? json_null() : json_real(t[i].value),
                      "target", t[i].target, "met",
                      t[i].met < 0 ? json_null() : json_boolean(t[i].met), "detail", t[i].detail));
    json_object_set_new(root, "targets", ta);
    json_object_set_new(root, "tile", tile ? bt_part_json(tile) : json_null());
    json_object_set_new(
        root, "config",
        json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f}",
                  "preset", o->preset, "users", (json_int_t)o->users, "rounds",
                  (json_int_t)o->rounds, "system_tokens", (json_int_t)o->system_tokens,
                  "history_tokens", (json_int_t)o->history_tokens, "question_tokens",
                  (json_int_t)o->question_tokens, "out_tokens_min", (json_int_t)o->out_min,
                  "out_tokens_max", (json_int_t)o->out_max, "docs", (json_int_t)o->docs,
                  "doc_tokens", (json_int_t)o->doc_tokens, "kv_budget_bytes", (json_int_t)e->budget,
                  "kv_disk_bytes", (json_int_t)o->disk_bytes, "max_context",
                  (json_int_t)e->max_context, "load_deadline_ms", (json_int_t)BT_LOAD_MS,
                  "chars_per_token", e->cpt));
    json_object_set_new(root, "wall_s", json_real(wall_s));
    int rc = pkv_bench_write_json(o->json_path, root);
    json_decref(root);
    return rc;
}

/* ---- SVG --------------------------------------------------------------------------------- */

int bt_write_svg(const bt_env_t *e, const bt_part_t *mr)
{
    static const char *const color[BT_ARMS] = {"#777777", "#d03a1f", "#1f5fbf", "#2a9d3a"};
    pkv_fp_series_t s[2 * BT_ARMS];
    char label[2 * BT_ARMS][48];
    double x[BT_MAX_ROUNDS], y[2 * BT_ARMS][BT_MAX_ROUNDS];
    size_t ns = 0;
    for (uint32_t r = 0; r < mr->w.rounds; r++) x[r] = r + 1;
    for (int k = 0; k < BT_ARMS; k++) {
        const bt_arm_t *a = bt_ok(mr, k);
        for (int m = 0; a && m < 2; m++, ns++) {
            for (uint32_t r = 0; r < mr->w.rounds; r++)
                y[ns][r] = m ? a->round[r].ttft_max_ms : a->round[r].ttft_p50_ms;
            snprintf(label[ns], sizeof(label[ns]), "%s TTFT %s", bt_arm_names[k],
                     m ? "max" : "p50");
            s[ns] = (pkv_fp_series_t){label[ns], color[k], m == 1, x, y[ns], mr->w.rounds};
        }
    }
    pkv_fp_mark_t mark = {(double)mr->w.restart_round - 0.5, "restart", "#2a9d3a"};
    char title[160];
    snprintf(title, sizeof(title),
             "pagekv bench tiers: TTFT per round (%s, %u users, budget %.0f MiB)", e->o->preset,
             mr->w.users, bt_mib(e->budget));
    FILE *f = fopen(e->o->svg_path, "w");
    int rc = f ? pkv_fp_svg_plot(f, title, "round", "TTFT (ms)", s, ns, &mark, 1) : -1;
    if (f && fclose(f)) rc = -1;
    if (rc) fprintf(stderr, "pagekv bench tiers: cannot write %s\n", e->o->svg_path);
    return rc;
}
