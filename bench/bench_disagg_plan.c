/*
 * `pagekv bench disagg`'s "planner vs measured" (the planner's check, docs/design/plan.md,
 * "Predictions against measured runs"): the memory planner (src/plan, called as a library)
 * on each design's geometry and load beside the peaks the design's nodes reached.
 *
 * Per design and node the planner gets the preset's geometry, TP 1 on both sides, 64-token
 * pages, pulls of the whole 16-token blocks before a prompt's last token (the nodes'
 * blocks), the bench's longest context and the design's slots as the concurrency (64 for
 * per-transfer designs). A run's peak is its largest phase's, and the phases load staging
 * differently (one length at 32- or 64-way, or the mix at an offered rate), so the load is
 * planned per phase: its mix (the real token count of every prompt the nodes served in it,
 * weighted by how many; the paced phase's prompts arrive interleaved and are weighed as
 * requests) and, as the transfers in flight, the node's stage's exact peak count of
 * transfers holding pages in that phase (the nodes' high-water marks are read and restarted
 * at each phase's end: POST /v1/kv_transfer/peaks/reset). Rows:
 *   - fixed designs: `fixed` (slots x the longest context) vs the pinned peak (VmLck);
 *   - per-transfer designs, per phase: `per_transfer_mean` (and for the mixed phase
 *     `per_transfer_tail`) vs the phase's peak pages in use; then the run's row: the
 *     largest phase mean vs the run's pinned peak from the OS.
 * (A fixed design's per-transfer need is not measured: its stage counts whole slots.)
 * ratio = predicted / measured; a row off by more than 10 % gets a note saying which of
 * the known causes the figures point at.
 */
#include "bench/bench_disagg.h"

#include "core/core.h"

#include <math.h>
#include <string.h>

#define BDP_MIB (1024.0 * 1024.0)

/* The reason a row misses, from the figures (static text or buf). ph: the phase, NULL for
 * the run's row. */
static const char *bdp_note(const pkv_bd_plan_design_t *d, const pkv_bd_plan_phase_t *ph, int k,
                            const char *figure, double pred, double meas, char *buf, size_t cap)
{
    double arena = (double)d->pool_pages * (double)d->page_bytes;
    if (meas <= 0) return "nothing measured";
    if (!strcmp(figure, "fixed")) {
        snprintf(buf, cap,
                 "VmLck is not the slots' bytes: other locked memory (%.0f MiB more) or slots "
                 "not all pinned",
                 (meas - pred) / BDP_MIB);
    } else if (pred > arena && meas >= 0.98 * arena) {
        snprintf(buf, cap,
                 "the arena (%u pages, %.0f MiB) is below the prediction and caps the peak: the "
                 "transfers beyond it waited for pages",
                 d->pool_pages, arena / BDP_MIB);
    } else if (!ph && meas > 1.05 * d->inflight_peak[k]) {
        snprintf(buf, cap,
                 "pinned (%.0f MiB) beyond the pages in use at their peak (%.0f MiB): freed pages "
                 "stay committed for the node's staging idle period, so resident memory holds an "
                 "earlier phase's pages",
                 meas / BDP_MIB, d->inflight_peak[k] / BDP_MIB);
    } else if (ph && ph->mixed && pred > meas) {
        snprintf(buf, cap,
                 "the %s draws the %llu transfers at the phase's peak count independently from "
                 "the mix; the count's peak and the long prompts' did not coincide",
                 strcmp(figure, "per_transfer_tail") ? "mean" : "tail",
                 (unsigned long long)ph->in_flight[k]);
    } else if (ph && ph->mixed && ph->in_flight[k] == 1) {
        snprintf(buf, cap,
                 "one transfer at a time: the phase's peak is its longest transfer, which is the "
                 "tail, not the mean");
    } else if (ph && ph->mixed) {
        snprintf(buf, cap,
                 "more pages at once than %llu transfers of the mix's mean: long prompts' "
                 "transfers overlapped more than the mix's share of them",
                 (unsigned long long)ph->in_flight[k]);
    } else if (ph) {
        snprintf(buf, cap,
                 "the phase's peak count of transfers (%llu) and its peak of pages came at "
                 "different moments (a transfer's pages are held from its grant to its lease's "
                 "end)",
                 (unsigned long long)ph->in_flight[k]);
    } else {
        snprintf(buf, cap, "the run's peak is not its largest phase's: see the phase rows");
    }
    return buf;
}

static json_t *bdp_row(const pkv_bd_plan_design_t *d, const pkv_bd_plan_phase_t *ph, int k,
                       const char *figure, uint64_t in_flight, double pred, double meas, FILE *out)
{
    double ratio = meas > 0 ? pred / meas : 0;
    bool within = meas > 0 && fabs(ratio - 1) <= 0.10;
    char buf[512];
    const char *note = within ? "" : bdp_note(d, ph, k, figure, pred, meas, buf, sizeof(buf));
    const char *node = k ? "decode" : "prefill", *phase = ph ? ph->name : "run";
    fprintf(out, "| %s | %s | %s | %s | %llu | %.1f | %.1f | %.3f | %s |\n", d->design, node, phase,
            figure, (unsigned long long)in_flight, pred / BDP_MIB, meas / BDP_MIB, ratio,
            within ? "yes" : "NO");
    return json_pack("{s:s, s:s, s:s, s:s, s:I, s:I, s:I, s:f, s:b, s:s}", "design", d->design,
                     "node", node, "phase", phase, "figure", figure, "in_flight",
                     (json_int_t)in_flight, "predicted_bytes", (json_int_t)pred, "measured_bytes",
                     (json_int_t)meas, "ratio", ratio, "within_10pct", within, "note", note);
}

void pkv_bd_mix_add(pkv_bd_mix_t *mix, long n)
{
    if (n <= 0) return;
    uint32_t b = PKV_BD_BLOCK_TOKENS, t = (uint32_t)(n - 1) / b * b + 1, m = 0;
    while (m < mix->n && mix->tokens[m] != t) m++;
    if (m == PKV_BD_PLAN_MIX) { /* full: the nearest entry above t, else the longest */
        uint32_t above = UINT32_MAX, top = 0;
        for (uint32_t i = 0; i < mix->n; i++) {
            if (mix->tokens[i] >= t && (above == UINT32_MAX || mix->tokens[i] < mix->tokens[above]))
                above = i;
            if (mix->tokens[i] > mix->tokens[top]) top = i;
        }
        m = above != UINT32_MAX ? above : top;
    } else if (m == mix->n) {
        mix->tokens[mix->n++] = t;
    }
    mix->weight[m]++;
}

void pkv_bd_mix_plan(const pkv_bd_mix_t *mix, uint64_t context, pkv_plan_input_t *in)
{
    in->pull_block_tokens = PKV_BD_BLOCK_TOKENS;
    in->n_mix = 0;
    for (uint32_t m = 0; m < mix->n && m < PKV_PLAN_MAX_MIX; m++)
        in->mix[in->n_mix++] =
            (pkv_plan_mix_t){.tokens = PKV_MIN(mix->tokens[m], context), .weight = mix->weight[m]};
}

/* The planner's figures for one node of a design under mix (in flight: n); 0 or -1. */
static int bdp_plan(const pkv_plan_input_t *geo, const pkv_bd_plan_design_t *d,
                    const pkv_bd_mix_t *mix, bool mixed, uint64_t n, int k, pkv_plan_bytes_t *out)
{
    pkv_plan_input_t in = *geo;
    in.prefill_tp = in.decode_tp = 1;
    in.page_tokens = 64;
    in.context = d->context;
    in.concurrency = d->fixed ? d->slots : 64;
    pkv_bd_mix_plan(mix, d->context, &in);
    in.mix_of_requests = mixed;
    in.in_flight = n ? n : 1;
    in.in_flight_set = true;
    pkv_plan_t pl;
    if (pkv_plan_compute(&in, &pl) != 0) {
        fprintf(stderr, "pagekv bench disagg: planner (%s): %s\n", d->design, pl.err);
        return -1;
    }
    *out = k ? pl.decode.rank : pl.prefill.rank;
    return 0;
}

json_t *pkv_bd_plan_check(const char *preset, const pkv_bd_plan_design_t *d, size_t n, FILE *out)
{
    pkv_plan_input_t geo;
    memset(&geo, 0, sizeof(geo));
    if (pkv_plan_preset(preset, &geo) != 0) {
        fprintf(stderr, "pagekv bench disagg: the planner has no preset '%s'\n", preset);
        return NULL;
    }
    json_t *rows = json_array();
    fprintf(out,
            "\nplanner vs measured (src/plan: %s, TP 1, 64-token pages, pulls of whole %d-token "
            "blocks; per phase: its mix = the prompts served, by real token count (the paced "
            "phase's weighed as requests), in flight = the node's stage's peak count of "
            "transfers holding pages in that phase, against the phase's peak pages in use; "
            "run: the largest phase prediction against the pinned peak from the OS):\n\n",
            preset, PKV_BD_BLOCK_TOKENS);
    fprintf(out, "| design | node | phase | figure | in flight | planner MiB | measured MiB | "
                 "planner / measured | within 10 %% |\n|---|---|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < n; i++) {
        const pkv_bd_plan_design_t *x = &d[i];
        for (int k = 0; k < 2; k++) {
            pkv_plan_bytes_t b;
            if (x->fixed) {
                /* slots x the longest context: no mix enters (the planner's empty mix) */
                static const pkv_bd_mix_t none;
                if (bdp_plan(&geo, x, &none, false, x->slots, k, &b)) continue;
                if (k == 0 && b.page_bytes != x->page_bytes)
                    fprintf(out, "(%s: the planner's page is %llu bytes, the nodes' %llu)\n",
                            x->design, (unsigned long long)b.page_bytes,
                            (unsigned long long)x->page_bytes);
                json_array_append_new(rows, bdp_row(x, NULL, k, "fixed", x->slots,
                                                    (double)b.fixed_bytes, x->pinned_peak[k], out));
                continue;
            }
            double run_pred = 0;
            uint64_t run_n = 0;
            for (int p = 0; p < PKV_BD_PLAN_PHASES; p++) {
                const pkv_bd_plan_phase_t *ph = &x->phase[p];
                if (!ph->mix.n || !ph->in_flight[k]) continue;
                if (bdp_plan(&geo, x, &ph->mix, ph->mixed, ph->in_flight[k], k, &b)) continue;
                double mean = (double)b.per_transfer_mean_bytes;
                json_array_append_new(rows, bdp_row(x, ph, k, "per_transfer_mean", ph->in_flight[k],
                                                    mean, ph->inflight_peak[k], out));
                if (ph->mixed)
                    json_array_append_new(rows,
                                          bdp_row(x, ph, k, "per_transfer_tail", ph->in_flight[k],
                                                  (double)b.per_transfer_tail_bytes,
                                                  ph->inflight_peak[k], out));
                if (mean > run_pred) run_pred = mean, run_n = ph->in_flight[k];
            }
            if (run_pred > 0)
                json_array_append_new(rows, bdp_row(x, NULL, k, "per_transfer_mean", run_n,
                                                    run_pred, x->pinned_peak[k], out));
        }
    }
    size_t i;
    json_t *r;
    json_array_foreach(rows, i, r)
    {
        if (json_is_true(json_object_get(r, "within_10pct"))) continue;
        fprintf(out, "- %s %s %s %s off by more than 10 %%: %s\n",
                json_string_value(json_object_get(r, "design")),
                json_string_value(json_object_get(r, "node")),
                json_string_value(json_object_get(r, "phase")),
                json_string_value(json_object_get(r, "figure")),
                json_string_value(json_object_get(r, "note")));
    }
    return rows;
}
