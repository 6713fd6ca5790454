/*
 * `pagekv bench disagg`'s "planner vs measured" (issue 24's check, docs/design/plan.md,
 * "Predictions against measured runs"): the memory planner (src/plan, called as a library)
 * on each design's geometry and load beside the peaks the design's nodes reached.
 *
 * Per design and node the planner gets the preset's geometry, TP 1 on both sides, 64-token
 * pages, pulls of the whole 16-token blocks before a prompt's last token (the nodes'
 * blocks), the bench's longest context, the design's slots as the concurrency (64 for
 * per-transfer designs), the load's mix (the real token count of every prompt the nodes
 * served, weighted by how many) and, as the transfers in flight, the node's stage's exact
 * peak count of transfers holding pages. Rows:
 *   - fixed designs: `fixed` (slots x the longest context) vs the pinned peak (VmLck);
 *   - per-transfer designs: `per_transfer_mean` and `per_transfer_tail` vs the pinned peak
 *     (the arena caps it: transfers past the arena wait).
 * (A fixed design's per-transfer need is not measured: its stage counts whole slots.)
 * ratio = predicted / measured; a row off by more than 10 % gets a note saying which of
 * the known causes the figures point at.
 */
#include "bench/bench_disagg.h"

#include "core/core.h"

#include <math.h>
#include <string.h>

#define BDP_MIB (1024.0 * 1024.0)

/* The reason a row misses, from the figures (static text into buf). */
static const char *bdp_note(const pkv_bd_plan_design_t *d, int k, const char *figure, double pred,
                            double meas, char *buf, size_t cap)
{
    double arena = (double)d->pool_pages * (double)d->page_bytes;
    if (meas <= 0) return "nothing measured";
    if (!strcmp(figure, "fixed")) {
        snprintf(buf, cap,
                 "VmLck is not the slots' bytes: other locked memory (%.0f MiB more) or slots "
                 "not all pinned",
                 (meas - pred) / BDP_MIB);
    } else if (!d->fixed && pred > arena && meas >= 0.98 * arena) {
        snprintf(buf, cap,
                 "the arena (%u pages, %.0f MiB) is below the prediction and caps the pinned "
                 "peak: the transfers beyond it waited for pages",
                 d->pool_pages, arena / BDP_MIB);
    } else if (!d->fixed && meas > 1.05 * d->inflight_peak[k]) {
        snprintf(buf, cap,
                 "pinned (%.0f MiB) beyond the pages in use at their peak (%.0f MiB): freed pages "
                 "stay committed for the node's staging idle period, so resident memory holds an "
                 "earlier peak's pages",
                 meas / BDP_MIB, d->inflight_peak[k] / BDP_MIB);
    } else if (pred < meas) {
        snprintf(buf, cap,
                 "more pages at once than %llu transfers of the mix's %s hold: the peak count "
                 "came in a phase of long prompts (the long phase sends only the longest), "
                 "which the whole run's mix weighs by its few requests",
                 (unsigned long long)d->in_flight[k],
                 strcmp(figure, "per_transfer_mean") ? "tail" : "mean");
    } else if (!strcmp(figure, "per_transfer_tail")) {
        snprintf(buf, cap,
                 "the tail draws the %llu transfers in flight independently from the mix, so "
                 "several long ones at once; here one prefill engine finishes prompts a batch "
                 "at a time and a long prompt's prefill takes ~10x its pull, so long transfers "
                 "rarely overlap: the peak count came with short prompts",
                 (unsigned long long)d->in_flight[k]);
    } else {
        snprintf(buf, cap,
                 "fewer pages at the peak than %llu transfers of the mix's mean: the peak count "
                 "of transfers came with short prompts (the burst and medium phases), the pages' "
                 "peak with fewer, longer ones",
                 (unsigned long long)d->in_flight[k]);
    }
    return buf;
}

static json_t *bdp_row(const pkv_bd_plan_design_t *d, int k, const char *figure, double pred,
                       double meas, FILE *out)
{
    double ratio = meas > 0 ? pred / meas : 0;
    bool within = meas > 0 && fabs(ratio - 1) <= 0.10;
    char buf[512];
    const char *note = within ? "" : bdp_note(d, k, figure, pred, meas, buf, sizeof(buf));
    const char *node = k ? "decode" : "prefill";
    fprintf(out, "| %s | %s | %s | %llu | %.1f | %.1f | %.3f | %s |\n", d->design, node, figure,
            (unsigned long long)d->in_flight[k], pred / BDP_MIB, meas / BDP_MIB, ratio,
            within ? "yes" : "NO");
    return json_pack("{s:s, s:s, s:s, s:I, s:I, s:I, s:f, s:b, s:s}", "design", d->design, "node",
                     node, "figure", figure, "in_flight", (json_int_t)d->in_flight[k],
                     "predicted_bytes", (json_int_t)pred, "measured_bytes", (json_int_t)meas,
                     "ratio", ratio, "within_10pct", within, "note", note);
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
            "blocks; mix = the prompts served, by real token count; in flight = the node's "
            "stage's peak count of transfers holding pages):\n\n",
            preset, PKV_BD_BLOCK_TOKENS);
    fprintf(out, "| design | node | figure | in flight | planner MiB | measured MiB | planner / "
                 "measured | within 10 %% |\n|---|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < n; i++) {
        for (int k = 0; k < 2; k++) {
            pkv_plan_input_t in = geo;
            in.prefill_tp = in.decode_tp = 1;
            in.page_tokens = 64;
            in.context = d[i].context;
            in.concurrency = d[i].fixed ? d[i].slots : 64;
            pkv_bd_mix_plan(&d[i].mix, d[i].context, &in);
            in.in_flight = d[i].in_flight[k] ? d[i].in_flight[k] : 1;
            in.in_flight_set = true;
            pkv_plan_t pl;
            if (pkv_plan_compute(&in, &pl) != 0) {
                fprintf(stderr, "pagekv bench disagg: planner (%s): %s\n", d[i].design, pl.err);
                continue;
            }
            if (k == 0 && pl.decode.rank.page_bytes != d[i].page_bytes)
                fprintf(out, "(%s: the planner's page is %llu bytes, the nodes' %llu)\n",
                        d[i].design, (unsigned long long)pl.decode.rank.page_bytes,
                        (unsigned long long)d[i].page_bytes);
            const pkv_plan_bytes_t *b = k ? &pl.decode.rank : &pl.prefill.rank;
            double meas = d[i].pinned_peak[k];
            if (d[i].fixed) {
                json_array_append_new(
                    rows, bdp_row(&d[i], k, "fixed", (double)b->fixed_bytes, meas, out));
            } else {
                json_array_append_new(rows, bdp_row(&d[i], k, "per_transfer_mean",
                                                    (double)b->per_transfer_mean_bytes, meas, out));
                json_array_append_new(rows, bdp_row(&d[i], k, "per_transfer_tail",
                                                    (double)b->per_transfer_tail_bytes, meas, out));
            }
        }
    }
    size_t i;
    json_t *r;
    json_array_foreach(rows, i, r)
    {
        if (json_is_true(json_object_get(r, "within_10pct"))) continue;
        fprintf(out, "- %s %s %s off by more than 10 %%: %s\n",
                json_string_value(json_object_get(r, "design")),
                json_string_value(json_object_get(r, "node")),
                json_string_value(json_object_get(r, "figure")),
                json_string_value(json_object_get(r, "note")));
    }
    return rows;
}
