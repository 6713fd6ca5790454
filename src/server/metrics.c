/*
 * server metrics: the Prometheus text exposition of /metrics and the /v1/cache/stats
 * document, rendered from one snapshot of the server's, the engine's and the KV cache's
 * counters. Names: `pagekv_` prefix, counters end in `_total`, sizes in `_bytes`, times
 * in `_seconds`; every family has HELP and TYPE lines.
 */
#include "server/server_int.h"

#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const srv_route_label[SRV_ROUTE_COUNT] = {"/v1/completions",
                                                      "/v1/chat/completions",
                                                      "/v1/models",
                                                      "/v1/models/{id}",
                                                      "/health",
                                                      "/metrics",
                                                      "/v1/cache/stats",
                                                      "/v1/cache/reset",
                                                      "/v1/cache/lookup",
                                                      "/v1/cache/digest",
                                                      "/v1/cache/purge",
                                                      "/v1/kv_transfer/peaks/reset",
                                                      "other"};

const int srv_codes[SRV_N_CODES] = {200, 400, 404, 405, 413, 429, 500, 503, 0};

int srv_code_index(int status)
{
    for (int i = 0; i < SRV_N_CODES - 1; i++)
        if (srv_codes[i] == status) return i;
    return SRV_N_CODES - 1; /* anything else */
}

const char *const srv_rejection_label[SRV_REJ_COUNT] = {
    "invalid_request", "model_not_found", "context_length", "kv_budget",
    "queue_full",      "body_too_large",  "shutting_down"};

const double srv_hist_bounds[SRV_HIST_BUCKETS] = {0.005, 0.01, 0.025, 0.05, 0.1,  0.25, 0.5,
                                                  1.0,   2.5,  5.0,   10.0, 30.0, 60.0, 300.0};

void srv_hist_add(pkv_hist_t *h, double seconds)
{
    pkv_hist_add(h, srv_hist_bounds, SRV_HIST_BUCKETS, seconds);
}

void srv_metric_family(FILE *f, const char *name, const char *type, const char *help)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

void srv_metric_one(FILE *f, const char *name, const char *type, const char *help, uint64_t v)
{
    srv_metric_family(f, name, type, help);
    fprintf(f, "%s %llu\n", name, (unsigned long long)v);
}

/* A counter family's two samples, label=a and label=b. */
static void two_samples(FILE *f, const char *name, const char *label, const char *a, uint64_t va,
                        const char *b, uint64_t vb)
{
    fprintf(f, "%s{%s=\"%s\"} %llu\n", name, label, a, (unsigned long long)va);
    fprintf(f, "%s{%s=\"%s\"} %llu\n", name, label, b, (unsigned long long)vb);
}

static void hist(FILE *f, const char *name, const char *help, const pkv_hist_t *h)
{
    srv_metric_family(f, name, "histogram", help);
    pkv_hist_write_prom(f, name, "", h, srv_hist_bounds, SRV_HIST_BUCKETS);
}

/* The HTTP layer's own families. */
static void render_http(FILE *f, const srv_counters_t *c)
{
    srv_metric_family(f, "pagekv_http_requests_total", "counter",
                      "HTTP requests answered, by route and status code.");
    for (int r = 0; r < SRV_ROUTE_COUNT; r++)
        for (int k = 0; k < SRV_N_CODES; k++) {
            if (!c->http[r][k] && !(k == 0 && r <= SRV_ROUTE_CHAT)) continue;
            if (srv_codes[k])
                fprintf(f, "pagekv_http_requests_total{route=\"%s\",code=\"%d\"} %llu\n",
                        srv_route_label[r], srv_codes[k], (unsigned long long)c->http[r][k]);
            else
                fprintf(f, "pagekv_http_requests_total{route=\"%s\",code=\"other\"} %llu\n",
                        srv_route_label[r], (unsigned long long)c->http[r][k]);
        }
    srv_metric_family(f, "pagekv_requests_rejected_total", "counter",
                      "Generation requests refused before reaching the engine, by reason.");
    for (int r = 0; r < SRV_REJ_COUNT; r++)
        fprintf(f, "pagekv_requests_rejected_total{reason=\"%s\"} %llu\n", srv_rejection_label[r],
                (unsigned long long)c->rejected[r]);
    srv_metric_one(
        f, "pagekv_client_disconnects_total", "counter",
        "Generation requests whose client went away before the response ended (request cancelled).",
        c->disconnects);
    srv_metric_one(f, "pagekv_stream_responses_total", "counter",
                   "Streamed (server-sent events) responses started.", c->streams);
    srv_metric_one(f, "pagekv_requests_in_flight", "gauge",
                   "Generation requests being served by the HTTP layer.", c->in_flight);
    srv_metric_one(f, "pagekv_cache_resets_total", "counter", "POST /v1/cache/reset calls.",
                   c->cache_resets);
    hist(f, "pagekv_time_to_first_token_seconds",
         "Time from submission to the first generated token.", &c->ttft);
    hist(f, "pagekv_request_duration_seconds", "Time from submission to the last generated token.",
         &c->e2e);
}

static void render_engine(FILE *f, const pkv_engine_stats_t *es)
{
    srv_metric_one(f, "pagekv_requests_running", "gauge", "Requests in the running batch.",
                   es->running);
    srv_metric_one(f, "pagekv_requests_queued", "gauge", "Requests waiting for admission.",
                   es->queued);
    srv_metric_one(f, "pagekv_requests_submitted_total", "counter",
                   "Requests accepted by the engine.", es->submitted);
    srv_metric_one(f, "pagekv_engine_queue_full_total", "counter",
                   "Submissions refused because the queue was full.", es->rejected_busy);
    srv_metric_family(f, "pagekv_requests_finished_total", "counter",
                      "Requests finished, by reason.");
    fprintf(f, "pagekv_requests_finished_total{reason=\"stop\"} %llu\n",
            (unsigned long long)es->finished_stop);
    fprintf(f, "pagekv_requests_finished_total{reason=\"length\"} %llu\n",
            (unsigned long long)es->finished_length);
    fprintf(f, "pagekv_requests_finished_total{reason=\"cancelled\"} %llu\n",
            (unsigned long long)es->finished_cancelled);
    fprintf(f, "pagekv_requests_finished_total{reason=\"error\"} %llu\n",
            (unsigned long long)es->finished_error);
    srv_metric_one(f, "pagekv_preemptions_total", "counter",
                   "Running requests preempted by recompute.", es->preemptions);
    srv_metric_one(f, "pagekv_prompt_tokens_total", "counter",
                   "Prompt tokens of admitted requests.", es->prompt_tokens);
    srv_metric_one(f, "pagekv_prompt_cached_tokens_total", "counter",
                   "Prompt tokens adopted from the prefix cache at admission.", es->cached_tokens);
    srv_metric_one(f, "pagekv_recompute_tokens_total", "counter",
                   "Tokens re-prefilled after preemption.", es->recompute_tokens);
    srv_metric_one(f, "pagekv_generation_tokens_total", "counter", "Tokens generated.",
                   es->generated_tokens);
    srv_metric_one(f, "pagekv_engine_steps_total", "counter", "Engine steps (forward passes).",
                   es->steps);
    srv_metric_family(f, "pagekv_engine_forward_seconds_total", "counter",
                      "Time spent in the model's forward pass.");
    fprintf(f, "pagekv_engine_forward_seconds_total %.9g\n", (double)es->forward_ns / 1e9);
}

static void render_kv(FILE *f, const pkv_kv_stats_t *ks)
{
    srv_metric_one(f, "pagekv_kv_committed_bytes", "gauge", "KV memory held from the OS.",
                   ks->committed_bytes);
    srv_metric_one(f, "pagekv_kv_peak_committed_bytes", "gauge",
                   "Peak of pagekv_kv_committed_bytes.", ks->peak_committed_bytes);
    srv_metric_one(f, "pagekv_kv_reserved_bytes", "gauge",
                   "Address space reserved for the paged pool.", ks->reserved_bytes);
    srv_metric_one(f, "pagekv_kv_budget_bytes", "gauge", "Cap on committed KV memory (0: none).",
                   ks->budget_bytes);
    srv_metric_one(f, "pagekv_kv_block_bytes", "gauge", "Bytes of one KV block.", ks->block_bytes);
    srv_metric_one(f, "pagekv_kv_warm_bytes", "gauge",
                   "The warm floor: empty KV memory kept committed for the next admission.",
                   ks->warm_bytes);
    srv_metric_one(f, "pagekv_kv_empty_bytes", "gauge",
                   "Committed KV memory in granules without a used block.", ks->empty_bytes);
    srv_metric_family(f, "pagekv_kv_commit_seconds_total", "counter",
                      "Time spent committing KV memory from the OS.");
    fprintf(f, "pagekv_kv_commit_seconds_total %.9g\n", (double)ks->commit_ns / 1e9);
    srv_metric_one(f, "pagekv_kv_token_bytes", "gauge", "KV bytes of one token in every layer.",
                   ks->token_bytes);
    srv_metric_one(f, "pagekv_kv_blocks_capacity", "gauge",
                   "Blocks the budget or reservation allows.", ks->blocks_capacity);
    srv_metric_family(f, "pagekv_kv_blocks", "gauge", "KV blocks by state.");
    fprintf(f, "pagekv_kv_blocks{state=\"live\"} %llu\n", (unsigned long long)ks->blocks_live);
    fprintf(f, "pagekv_kv_blocks{state=\"cached\"} %llu\n", (unsigned long long)ks->blocks_cached);
    fprintf(f, "pagekv_kv_blocks{state=\"free\"} %llu\n", (unsigned long long)ks->blocks_free);
    srv_metric_one(f, "pagekv_kv_sequences", "gauge", "Live sequences.", ks->sequences);
    srv_metric_one(f, "pagekv_kv_live_tokens", "gauge", "Positions held by live sequences.",
                   ks->live_tokens);
    srv_metric_one(f, "pagekv_kv_prefix_queries_total", "counter",
                   "Admissions that looked up the prefix cache.", ks->prefix_queries);
    srv_metric_one(f, "pagekv_kv_prefix_query_tokens_total", "counter",
                   "Prompt tokens looked up in the prefix cache.", ks->prefix_query_tokens);
    srv_metric_one(f, "pagekv_kv_prefix_hit_tokens_total", "counter",
                   "Prompt tokens adopted from the prefix cache.", ks->prefix_hit_tokens);
    srv_metric_one(f, "pagekv_kv_evictions_total", "counter", "Cached blocks evicted.",
                   ks->evictions);
    srv_metric_one(f, "pagekv_kv_cow_copies_total", "counter", "Copy-on-write block copies.",
                   ks->cow_copies);
    srv_metric_one(f, "pagekv_kv_granule_commits_total", "counter", "Granules committed.",
                   ks->commits);
    srv_metric_one(f, "pagekv_kv_granule_decommits_total", "counter",
                   "Granules returned to the OS.", ks->decommits);
    srv_metric_family(
        f, "pagekv_kv_admission_rejections_total", "counter",
        "Sequence admissions refused by the KV cache, by reason (nospace is retried later).");
    fprintf(f, "pagekv_kv_admission_rejections_total{reason=\"nofit\"} %llu\n",
            (unsigned long long)ks->rejected_nofit);
    fprintf(f, "pagekv_kv_admission_rejections_total{reason=\"nospace\"} %llu\n",
            (unsigned long long)ks->rejected_nospace);
}

static const char *const outcome_label[8] = {"ok",       "timeout",   "peer_lost", "nofit",
                                             "rejected", "cancelled", "corrupt",   "shutdown"};

/* Transfers by outcome, pulls, blocks, the phase histograms and the agent's liveness. */
static void render_kvt_flow(FILE *f, const pkv_disagg_snapshot_t *k)
{
    const pkv_xfer_stats_t *x = &k->xs;
    srv_metric_family(f, "pagekv_kv_transfer_reads_total", "counter",
                      "Reads of a prompt's KV from a producer (this node consuming), by outcome.");
    for (int i = 0; i < 8; i++)
        fprintf(f, "pagekv_kv_transfer_reads_total{outcome=\"%s\"} %llu\n", outcome_label[i],
                (unsigned long long)x->reads_done[i]);
    srv_metric_family(
        f, "pagekv_kv_transfer_serves_total", "counter",
        "Reads served to consumers (this node producing): acknowledged (sent), accepted and "
        "ended without ACK (failed), refused at once (refused).");
    fprintf(f, "pagekv_kv_transfer_serves_total{outcome=\"sent\"} %llu\n",
            (unsigned long long)x->sent);
    fprintf(f, "pagekv_kv_transfer_serves_total{outcome=\"failed\"} %llu\n",
            (unsigned long long)x->serves_failed);
    fprintf(f, "pagekv_kv_transfer_serves_total{outcome=\"refused\"} %llu\n",
            (unsigned long long)x->rejected);
    srv_metric_family(
        f, "pagekv_kv_pulls_total", "counter",
        "Decode legs: pulled the blocks the local prefix cache lacked (ok), needed none "
        "(released: the token alone went to the producer), failed, failed and computed here "
        "(recomputed), and requests without params computed here (local).");
    const struct {
        const char *what;
        uint64_t v;
    } pulls[] = {{"ok", k->pulls.ok},
                 {"released", k->pulls.released},
                 {"failed", k->pulls.failed},
                 {"recomputed", k->pulls.recomputed},
                 {"local", k->pulls.local}};
    for (size_t i = 0; i < PKV_ARRAY_LEN(pulls); i++)
        fprintf(f, "pagekv_kv_pulls_total{outcome=\"%s\"} %llu\n", pulls[i].what,
                (unsigned long long)pulls[i].v);
    srv_metric_family(
        f, "pagekv_kv_pull_blocks_total", "counter",
        "Prompt blocks of decode legs: read from the producer, or already held by the local "
        "prefix cache.");
    two_samples(f, "pagekv_kv_pull_blocks_total", "source", "pulled", k->pulls.blocks_pulled,
                "adopted", k->pulls.blocks_adopted);
    srv_metric_family(f, "pagekv_kv_pull_first_token_total", "counter",
                      "Decode legs given the prefill node's first token: taken by the pull (the "
                      "engine emits it), or ignored (it did not match the leg's sampling; the "
                      "leg computes it).");
    two_samples(f, "pagekv_kv_pull_first_token_total", "taken", "used", k->pulls.first_used,
                "ignored", k->pulls.first_ignored);
    srv_metric_one(f, "pagekv_kv_pulls_inflight", "gauge",
                   "Decode legs' reads from a producer started and not yet ended.",
                   k->pulls.inflight);
    srv_metric_one(
        f, "pagekv_kv_pulls_inflight_peak", "gauge",
        "High-water of pagekv_kv_pulls_inflight since the node started or the last peaks reset.",
        k->pulls.inflight_peak);
    srv_metric_family(
        f, "pagekv_kv_transfer_phase_seconds", "histogram",
        "Phases of disaggregated requests on the node where each happens (prefill: "
        "prefill_queue, prefill_compute, lease_wait, staging_wait, wire; decode: handshake, "
        "staging_wait, wire, commit, decode).");
    for (int p = 0; p < PKV_DISAGG_PHASE_COUNT; p++) {
        char label[48];
        snprintf(label, sizeof(label), "phase=\"%s\"", pkv_disagg_phase_label[p]);
        pkv_hist_write_prom(f, "pagekv_kv_transfer_phase_seconds", label, &k->phases[p],
                            pkv_disagg_phase_bounds, PKV_DISAGG_PHASE_BUCKETS);
    }
    srv_metric_one(f, "pagekv_kv_agent_up", "gauge",
                   "1 while the transfer agent serves and its progress thread beats.",
                   k->agent_alive);
    srv_metric_family(f, "pagekv_kv_agent_progress_age_seconds", "gauge",
                      "Time since the transfer agent's progress loop last began a round.");
    fprintf(f, "pagekv_kv_agent_progress_age_seconds %.6f\n", (double)k->agent_age_ns / 1e9);
}

/* Prefill and decode roles: the transfer agent's leases, transfers and staging. */
static void render_kvt(FILE *f, const pkv_disagg_snapshot_t *k)
{
    const pkv_xfer_stats_t *x = &k->xs;
    srv_metric_family(f, "pagekv_kv_leases_total", "counter",
                      "Prefill legs' block registrations: offered, and ended by outcome.");
    const struct {
        const char *what;
        uint64_t v;
    } leases[] = {{"offered", k->leases.offered},
                  {"sent", k->leases.sent},
                  {"expired", k->leases.expired},
                  {"cancelled", k->leases.cancelled},
                  {"shutdown", k->leases.shutdown}};
    for (size_t i = 0; i < PKV_ARRAY_LEN(leases); i++)
        fprintf(f, "pagekv_kv_leases_total{outcome=\"%s\"} %llu\n", leases[i].what,
                (unsigned long long)leases[i].v);
    srv_metric_one(f, "pagekv_kv_leases_live", "gauge",
                   "Registrations waiting for their decode leg.", x->registrations);
    srv_metric_one(f, "pagekv_kv_transfer_pinned_blocks", "gauge",
                   "KV blocks pinned by the transfer agent (leases and running reads).",
                   x->pinned_blocks);
    srv_metric_one(f, "pagekv_kv_transfer_sent_bytes_total", "counter",
                   "Payload bytes of acknowledged transfers served.", x->bytes_sent);
    srv_metric_one(f, "pagekv_kv_transfer_received_bytes_total", "counter",
                   "Payload bytes pulled, verified and stored.", x->bytes_received);
    srv_metric_one(f, "pagekv_kv_staging_pages_held", "gauge", "Staging pages held by transfers.",
                   x->staging_pages_held);
    srv_metric_one(f, "pagekv_kv_staging_peak_pages", "gauge", "Peak of staging pages in use.",
                   k->ss.pages_peak_used);
    srv_metric_one(f, "pagekv_kv_staging_resident_bytes", "gauge", "Staging memory committed.",
                   k->ss.resident_bytes);
    srv_metric_one(f, "pagekv_kv_staging_pinned_bytes", "gauge", "Staging memory locked in RAM.",
                   k->ss.pinned_bytes);
    srv_metric_one(f, "pagekv_kv_staging_waits_total", "counter",
                   "Staging acquires that had to wait for pages (staging exhausted for a while).",
                   k->ss.waits);
    srv_metric_one(f, "pagekv_kv_staging_resident_pages", "gauge", "Staging pages committed.",
                   k->ss.page_bytes ? k->ss.resident_bytes / k->ss.page_bytes : 0);
    srv_metric_one(f, "pagekv_kv_staging_warm_floor_pages", "gauge",
                   "Staging pages kept committed past the idle release for the next transfer.",
                   k->ss.warm_floor_pages);
    render_kvt_flow(f, k);
}

static void render_hugepages(FILE *f, const srv_snapshot_t *snap)
{
    srv_metric_one(f, "pagekv_kv_hugepages_requested", "gauge",
                   "1 when the paged pool asks for transparent huge pages on commit.", snap->huge);
    srv_metric_one(f, "pagekv_kv_hugepages_probe", "gauge",
                   "1 when a 2 MiB page committed at startup as the pool commits was a huge page.",
                   snap->huge_probe);
    if (!snap->pages_ok) return;
    srv_metric_one(f, "pagekv_kv_pool_resident_bytes", "gauge",
                   "Resident bytes of the paged pool's range (smaps Rss).",
                   snap->pool_resident_bytes);
    srv_metric_one(f, "pagekv_kv_pool_hugepage_bytes", "gauge",
                   "Resident bytes of the paged pool's range in transparent huge pages (smaps "
                   "AnonHugePages).",
                   snap->pool_huge_bytes);
}

char *srv_metrics_render(const srv_snapshot_t *snap, size_t *len)
{
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (!f) return NULL;
    render_http(f, &snap->ctr);
    render_engine(f, &snap->es);
    render_kv(f, &snap->ks);
    srv_cache_policy_render(f, &snap->ks, &snap->mw);
    if (snap->has_kv) render_kvt(f, &snap->kv);
    if (snap->has_tier) srv_tier_render(f, &snap->tier);
    render_hugepages(f, snap);
    if (snap->rss_bytes)
        srv_metric_one(f, "pagekv_process_resident_memory_bytes", "gauge",
                       "VmRSS of the server process.", snap->rss_bytes);
    if (snap->rss_bytes && snap->has_kv)
        srv_metric_one(f, "pagekv_process_locked_memory_bytes", "gauge",
                       "VmLck of the server process (compare pagekv_kv_staging_pinned_bytes).",
                       snap->locked_bytes);
    if (fclose(f)) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

/* The "hugepages" section: what was asked, what the kernel allows, and what it gave (the
 * startup probe, and the pool's range in smaps, read at most SRV_PAGES_MAX_AGE_NS ago:
 * null when not read). */
static json_t *hugepages_json(const srv_snapshot_t *snap)
{
    bool ok = snap->pages_ok;
    return json_pack(
        "{s:b, s:s, s:b, s:b, s:o, s:o, s:o}", "requested", snap->huge, "thp_mode", snap->thp_mode,
        "probe_huge", snap->huge_probe, "granules_fit", snap->ks.huge_granules,
        "pool_resident_bytes",
        ok ? json_integer((json_int_t)snap->pool_resident_bytes) : json_null(), "pool_huge_bytes",
        ok ? json_integer((json_int_t)snap->pool_huge_bytes) : json_null(), "pool_read_age_ms",
        ok ? json_integer((json_int_t)(snap->pages_age_ns / 1000000)) : json_null());
}

json_t *srv_cache_stats_json(const srv_snapshot_t *snap)
{
    const srv_counters_t *c = &snap->ctr;
    const pkv_engine_stats_t *es = &snap->es;
    const pkv_kv_stats_t *ks = &snap->ks;
    json_t *rej = json_object();
    for (int r = 0; r < SRV_REJ_COUNT; r++)
        json_object_set_new(rej, srv_rejection_label[r], json_integer((json_int_t)c->rejected[r]));
    json_object_set_new(rej, "kv_admission_nofit", json_integer((json_int_t)ks->rejected_nofit));
    json_object_set_new(rej, "kv_admission_nospace",
                        json_integer((json_int_t)ks->rejected_nospace));
    double rate = ks->prefix_query_tokens
                      ? (double)ks->prefix_hit_tokens / (double)ks->prefix_query_tokens
                      : 0.0;
    json_t *doc = json_pack(
        "{s:s, s:i, s:I, s:I, s:I, s:i, s:o, s:I, s:I, s:I, s:{s:I, s:I, s:I, s:I}, s:I, s:I,"
        " s:{s:I, s:I, s:I, s:f}, s:I, s:I, s:I, s:I, s:I, s:o,"
        " s:{s:I, s:I, s:I, s:I}}",
        "backend", pkv_backend_name(snap->backend), "block_tokens", (int)snap->block_tokens,
        "block_bytes", (json_int_t)ks->block_bytes, "token_bytes", (json_int_t)ks->token_bytes,
        "granule_bytes", (json_int_t)ks->granule_bytes, "storage_ranges", (int)ks->storage_ranges,
        "budget_bytes", ks->budget_bytes ? json_integer((json_int_t)ks->budget_bytes) : json_null(),
        "committed_bytes", (json_int_t)ks->committed_bytes, "peak_committed_bytes",
        (json_int_t)ks->peak_committed_bytes, "reserved_bytes", (json_int_t)ks->reserved_bytes,
        "blocks", "capacity", (json_int_t)ks->blocks_capacity, "live", (json_int_t)ks->blocks_live,
        "cached", (json_int_t)ks->blocks_cached, "free", (json_int_t)ks->blocks_free, "sequences",
        (json_int_t)ks->sequences, "live_tokens", (json_int_t)ks->live_tokens, "prefix_cache",
        "queries", (json_int_t)ks->prefix_queries, "query_tokens",
        (json_int_t)ks->prefix_query_tokens, "hit_tokens", (json_int_t)ks->prefix_hit_tokens,
        "hit_rate", rate, "evictions", (json_int_t)ks->evictions, "cow_copies",
        (json_int_t)ks->cow_copies, "granule_commits", (json_int_t)ks->commits, "granule_decommits",
        (json_int_t)ks->decommits, "cache_resets", (json_int_t)c->cache_resets, "rejections", rej,
        "requests", "in_flight", (json_int_t)c->in_flight, "running", (json_int_t)es->running,
        "queued", (json_int_t)es->queued, "submitted", (json_int_t)es->submitted);
    if (doc) srv_cache_policy_json(doc, ks, &snap->mw);
    if (doc) json_object_set_new(doc, "hugepages", hugepages_json(snap));
    if (doc)
        json_object_set_new(
            doc, "warm",
            json_pack("{s:I, s:b, s:I, s:I, s:I, s:f}", "max_bytes", (json_int_t)ks->warm_max_bytes,
                      "refill", snap->mw.warm_refill, "bytes", (json_int_t)ks->warm_bytes,
                      "empty_bytes", (json_int_t)ks->empty_bytes, "refilled_granules",
                      (json_int_t)ks->warm_refills, "commit_seconds", (double)ks->commit_ns / 1e9));
    if (doc)
        json_object_set_new(doc, "disk", snap->has_tier ? srv_tier_json(&snap->tier) : json_null());
    return doc;
}

json_t *srv_timings_json(const pkv_disagg_timings_t *t, pkv_server_role_t role)
{
    json_t *ph = json_object();
    for (int p = 0; ph && p < PKV_DISAGG_PHASE_COUNT; p++)
        if (t->have & (1u << p))
            json_object_set_new(ph, pkv_disagg_phase_label[p], json_real((double)t->ns[p] / 1e9));
    json_t *doc =
        json_pack("{s:s, s:o*}", "role", pkv_server_role_name(role), "phases_seconds", ph);
    if (doc && t->at[PKV_DISAGG_MARK_PULL_END]) { /* each moment: ms since the one before */
        json_t *leg = json_object();
        uint64_t prev = t->at[PKV_DISAGG_MARK_HEADERS];
        for (int m = PKV_DISAGG_MARK_HEADERS + 1; leg && prev && m < PKV_DISAGG_MARK_COUNT; m++) {
            if (!t->at[m]) continue;
            uint64_t d = t->at[m] > prev ? t->at[m] - prev : 0; /* clocks of two threads */
            json_object_set_new(leg, pkv_disagg_mark_label[m], json_real((double)d / 1e6));
            prev = t->at[m] > prev ? t->at[m] : prev;
        }
        json_object_set_new(doc, "decode_leg_ms", leg);
    }
    if (doc && t->pulled) {
        json_object_set_new(doc, "kv_pulled_bytes", json_integer((json_int_t)t->pulled_bytes));
        json_object_set_new(doc, "kv_pulled_blocks", json_integer((json_int_t)t->pulled_blocks));
        json_object_set_new(doc, "kv_adopted_blocks", json_integer((json_int_t)t->adopted_blocks));
    }
    return doc;
}

/* The kv_transfer_params section of /v1/cache/stats. */
json_t *srv_kv_stats_json(const pkv_disagg_snapshot_t *k)
{
    const pkv_xfer_stats_t *x = &k->xs;
    const pkv_stage_stats_t *s = &k->ss;
    json_t *doc = json_pack(
        "{s:s, s:s, s:s, s:i, s:s, s:i, s:i,"
        " s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I},"
        " s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I},"
        " s:{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I}}",
        "role", pkv_server_role_name(k->role), "address", k->address, "remote_host", k->advertise,
        "remote_port", (int)k->port, "engine_id", k->engine_id, "lease_ms", (int)k->lease_ms,
        "transfer_timeout_ms", (int)k->transfer_timeout_ms, "leases", "offered",
        (json_int_t)k->leases.offered, "live", (json_int_t)x->registrations, "sent",
        (json_int_t)k->leases.sent, "expired", (json_int_t)k->leases.expired, "cancelled",
        (json_int_t)k->leases.cancelled, "shutdown", (json_int_t)k->leases.shutdown,
        "pinned_blocks", (json_int_t)x->pinned_blocks, "transfers", "reads_started",
        (json_int_t)x->reads_started, "reads_ok", (json_int_t)x->reads_done[0], "bytes_received",
        (json_int_t)x->bytes_received, "serves_started", (json_int_t)x->serves_started,
        "serves_failed", (json_int_t)x->serves_failed, "bytes_sent", (json_int_t)x->bytes_sent,
        "rejected", (json_int_t)x->rejected, "released", (json_int_t)x->released, "peers",
        (json_int_t)x->peers, "staging", "mode", pkv_stage_mode_name(s->mode), "page_bytes",
        (json_int_t)s->page_bytes, "pages_total", (json_int_t)s->pages_total, "pages_used",
        (json_int_t)s->pages_used, "pages_peak_used", (json_int_t)s->pages_peak_used,
        "resident_bytes", (json_int_t)s->resident_bytes, "pinned_bytes",
        (json_int_t)s->pinned_bytes, "pages_held_by_transfers", (json_int_t)x->staging_pages_held);
    if (!doc) return NULL;
    /* transfers holding staging pages at once, high-water (fixed slots and the mirror: their
       commit at start took every slot once) */
    json_t *stg = json_object_get(doc, "staging");
    json_object_set_new(stg, "transfers_peak", json_integer((json_int_t)s->transfers_peak));
    /* how long a free page stays committed; null: never returned */
    json_object_set_new(stg, "idle_release_ms",
                        k->staging_idle_ms < 0 ? json_null() : json_integer(k->staging_idle_ms));
    /* the warm floor: its life (null: none) and the pages it keeps now */
    json_object_set_new(stg, "warm_ms",
                        k->staging_warm_ms < 0 ? json_null() : json_integer(k->staging_warm_ms));
    json_object_set_new(stg, "warm_floor_pages", json_integer((json_int_t)s->warm_floor_pages));
    json_object_set_new(
        doc, "pulls",
        json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "ok", (json_int_t)k->pulls.ok, "released",
                  (json_int_t)k->pulls.released, "failed", (json_int_t)k->pulls.failed,
                  "recomputed", (json_int_t)k->pulls.recomputed, "local",
                  (json_int_t)k->pulls.local, "blocks_pulled", (json_int_t)k->pulls.blocks_pulled,
                  "blocks_adopted", (json_int_t)k->pulls.blocks_adopted));
    json_t *pl = json_object_get(doc, "pulls");
    json_object_set_new(pl, "first_token",
                        json_pack("{s:I, s:I}", "used", (json_int_t)k->pulls.first_used, "ignored",
                                  (json_int_t)k->pulls.first_ignored));
    json_object_set_new(pl, "inflight", json_integer((json_int_t)k->pulls.inflight));
    json_object_set_new(pl, "inflight_peak", json_integer((json_int_t)k->pulls.inflight_peak));
    /* Reads by outcome (consumer), serves acknowledged and failed (producer). */
    static const char *const outcome[8] = {"ok",       "timeout",   "peer_lost", "nofit",
                                           "rejected", "cancelled", "corrupt",   "shutdown"};
    json_t *t = json_object_get(doc, "transfers"), *by = json_object();
    for (int i = 0; i < 8; i++)
        json_object_set_new(by, outcome[i], json_integer((json_int_t)x->reads_done[i]));
    json_object_set_new(t, "reads_by_outcome", by);
    json_object_set_new(t, "sent", json_integer((json_int_t)x->sent));
    json_object_set_new(t, "active", json_integer((json_int_t)x->active_transfers));
    json_object_set_new(t, "peers_lost", json_integer((json_int_t)x->peers_lost));
    json_t *st = json_object_get(doc, "staging");
    json_object_set_new(st, "waits", json_integer((json_int_t)s->waits));
    json_object_set_new(
        st, "pages_resident",
        json_integer(s->page_bytes ? (json_int_t)(s->resident_bytes / s->page_bytes) : 0));
    json_t *ranks = json_array();
    for (uint32_t r = 0; ranks && r < k->tp; r++) {
        const pkv_disagg_rank_snapshot_t *q = &k->ranks[r];
        json_array_append_new(
            ranks,
            json_pack("{s:i, s:s, s:i, s:i, s:i, s:{s:I, s:I, s:I, s:i, s:i}, s:{s:I, "
                      "s:I, s:I}}",
                      "rank", (int)r, "address", q->address, "remote_port", (int)q->port, "head_lo",
                      (int)q->head_lo, "head_n", (int)q->head_n, "staging", "pinned_bytes",
                      (json_int_t)q->pinned_bytes, "resident_bytes", (json_int_t)q->resident_bytes,
                      "resident_peak_bytes", (json_int_t)q->resident_peak_bytes, "pages_used",
                      (int)q->pages_used, "pages_peak_used", (int)q->pages_peak_used, "transfers",
                      "bytes_sent", (json_int_t)q->bytes_sent, "bytes_received",
                      (json_int_t)q->bytes_received, "active", (json_int_t)q->active_transfers));
    }
    json_object_set_new(doc, "tp", json_integer((json_int_t)k->tp));
    if (ranks) json_object_set_new(doc, "ranks", ranks);
    json_object_set_new(doc, "agent",
                        json_pack("{s:b, s:I}", "alive", k->agent_alive, "progress_age_us",
                                  (json_int_t)(k->agent_age_ns / 1000)));
    return doc;
}
