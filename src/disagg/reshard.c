/*
 * disagg: the transfer plan (docs/design/disagg.md, "The transfer plan"): which decode
 * rank reads which heads from which prefill rank, when the two sides may run different
 * tensor parallelism. Pure: a function of the two TPs and the heads.
 */
#include "disagg/disagg_int.h"

/* For each local rank d, the prefill ranks holding its heads (a replicated head is read from
 * replica d mod replicas, spreading the load), as runs of consecutive heads on one prefill
 * rank; a prefill rank no decode rank reads from gets a release. want == 0 (nothing to
 * pull): one release per prefill rank. Returns the reads in out[] (cap: D * kv_heads + P). */

/* For each local rank d, the prefill ranks holding its heads (a replicated head is read from
 * replica d mod replicas, spreading the load), as runs of consecutive heads on one prefill
 * rank; a prefill rank no decode rank reads from gets a release. want == 0 (nothing to
 * pull): one release per prefill rank. Returns the reads in out[] (cap: D * kv_heads + P). */
uint32_t dg_plan(const pkv_disagg_node_t *n, uint32_t P, bool pull, dg_read_t *out)
{
    uint32_t kvh = pkv_kv_geometry(n->kv)->kv_heads, m = 0;
    uint16_t count[PKV_KV_MAX_TP] = {0};
    for (uint32_t d = 0; pull && d < n->tp; d++) {
        const dg_rank_t *k = &n->rank[d];
        for (uint32_t h = k->head_lo; h < k->head_lo + k->head_n; h++) {
            uint32_t p = P <= kvh ? h / (kvh / P) : h * (P / kvh) + d % (P / kvh);
            if (m && out[m - 1].d == d && out[m - 1].p == p &&
                out[m - 1].head_lo + out[m - 1].head_n == h) {
                out[m - 1].head_n++;
                continue;
            }
            out[m++] = (dg_read_t){.d = d, .p = p, .head_lo = h, .head_n = 1, .index = count[p]++};
        }
    }
    for (uint32_t p = 0; p < P; p++)
        if (!count[p]) out[m++] = (dg_read_t){.d = p % n->tp, .p = p, .index = count[p]++};
    for (uint32_t i = 0; i < m; i++) out[i].total = count[out[i].p];
    return m;
}
