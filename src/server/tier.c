/*
 * server/tier: what the server shows of the disk tier (docs/design/tier.md): its /metrics
 * families and the "disk" object of /v1/cache/stats.
 */
#include "server/server_int.h"

static void labelled(FILE *f, const char *name, const char *type, const char *help,
                     const char *label, uint64_t v)
{
    srv_metric_family(f, name, type, help);
    fprintf(f, "%s{%s} %llu\n", name, label, (unsigned long long)v);
}

void srv_tier_render(FILE *f, const pkv_kvtier_stats_t *t)
{
    const pkv_tier_stats_t *d = &t->disk;
    labelled(f, "pagekv_kv_tier_bytes", "gauge",
             "Bytes of the tier's files (the disk tier: every file in its directory).",
             "tier=\"disk\"", d->bytes);
    labelled(f, "pagekv_kv_tier_capacity_bytes", "gauge", "The tier's cap.", "tier=\"disk\"",
             t->capacity_bytes);
    labelled(f, "pagekv_kv_tier_blocks", "gauge", "Blocks the tier can load.", "tier=\"disk\"",
             d->records);
    srv_metric_family(f, "pagekv_kv_tier_hit_blocks_total", "counter",
                      "Prompt blocks a request adopted, by the tier they came from.");
    fprintf(f, "pagekv_kv_tier_hit_blocks_total{tier=\"memory\"} %llu\n",
            (unsigned long long)t->hit_blocks_memory);
    fprintf(f, "pagekv_kv_tier_hit_blocks_total{tier=\"disk\"} %llu\n",
            (unsigned long long)t->hit_blocks_disk);
    labelled(f, "pagekv_kv_tier_loaded_bytes_total", "counter",
             "Record bytes read back and verified.", "tier=\"disk\"", d->loaded_bytes);
    srv_metric_one(f, "pagekv_kv_tier_written_bytes_total", "counter",
                   "Record bytes written to the disk tier.", d->written_bytes);
    srv_metric_one(f, "pagekv_kv_tier_queued_blocks", "gauge", "Blocks waiting for the writer.",
                   d->queued);
    srv_metric_family(f, "pagekv_kv_tier_dropped_writes_total", "counter",
                      "Blocks not written, by cause.");
    for (int c = 0; c < PKV_TIER_DROP_COUNT; c++)
        fprintf(f, "pagekv_kv_tier_dropped_writes_total{cause=\"%s\"} %llu\n",
                pkv_tier_drop_name[c], (unsigned long long)d->dropped[c]);
    labelled(f, "pagekv_kv_tier_corrupt_total", "counter",
             "Damage found at startup or on a load (records quarantined, segments repaired).",
             "tier=\"disk\"", d->corrupt);
    srv_metric_family(f, "pagekv_kv_tier_load_decisions_total", "counter",
                      "Requests whose prefix continued on disk: loaded, or recomputed because "
                      "loading was predicted slower.");
    fprintf(f, "pagekv_kv_tier_load_decisions_total{decision=\"load\"} %llu\n",
            (unsigned long long)t->decisions_load);
    fprintf(f, "pagekv_kv_tier_load_decisions_total{decision=\"recompute\"} %llu\n",
            (unsigned long long)t->decisions_recompute);
    srv_metric_one(f, "pagekv_kv_tier_load_timeouts_total", "counter",
                   "Loads that missed their deadline (the rest of the prompt was computed).",
                   t->load_timeouts);
    srv_metric_family(f, "pagekv_kv_tier_load_seconds", "histogram",
                      "Time a request waited for its blocks from disk.");
    pkv_hist_write_prom(f, "pagekv_kv_tier_load_seconds", "", &t->load_seconds,
                        pkv_kvtier_hist_bounds, PKV_KVTIER_HIST_BUCKETS);
}

json_t *srv_tier_json(const pkv_kvtier_stats_t *t)
{
    const pkv_tier_stats_t *d = &t->disk;
    json_t *drops = json_object();
    for (int c = 0; drops && c < PKV_TIER_DROP_COUNT; c++)
        json_object_set_new(drops, pkv_tier_drop_name[c], json_integer((json_int_t)d->dropped[c]));
    return json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:o,"
                     " s:{s:I, s:I}, s:I, s:I, s:I, s:f, s:f, s:f, s:b}",
                     "capacity_bytes", (json_int_t)t->capacity_bytes, "bytes", (json_int_t)d->bytes,
                     "reserved_bytes", (json_int_t)d->reserved, "blocks", (json_int_t)d->records,
                     "segments", (json_int_t)d->segments, "foreign_segments",
                     (json_int_t)d->foreign, "queued", (json_int_t)d->queued, "written_blocks",
                     (json_int_t)d->written_records, "written_bytes", (json_int_t)d->written_bytes,
                     "loaded_blocks", (json_int_t)d->loaded_records, "loaded_bytes",
                     (json_int_t)d->loaded_bytes, "hit_blocks", (json_int_t)t->hit_blocks_disk,
                     "memory_hit_blocks", (json_int_t)t->hit_blocks_memory, "corrupt",
                     (json_int_t)d->corrupt, "dropped_writes", drops, "load_decisions", "load",
                     (json_int_t)t->decisions_load, "recompute", (json_int_t)t->decisions_recompute,
                     "evicted_segments", (json_int_t)d->evicted_segments, "load_timeouts",
                     (json_int_t)t->load_timeouts, "load_failures", (json_int_t)t->load_failures,
                     "read_bytes_per_s", t->read_bytes_per_s, "block_load_s", t->block_load_s,
                     "prefill_token_s", t->prefill_token_s, "writable", d->writable);
}
