/*
 * router metrics: /metrics (Prometheus text 0.0.4, `pagekv_router_` series) and the
 * /health document, both from one copy of the counters taken under r->lock.
 */
#include "core/core.h"
#include "prim/prim.h"
#include "router/router_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const rt_role_label[RT_ROLES] = {"prefill", "decode"};
const char *const rt_route_label[RT_ROUTE_COUNT] = {"/v1/completions",
                                                    "/v1/chat/completions",
                                                    "/v1/models",
                                                    "/v1/models/{id}",
                                                    "/health",
                                                    "/metrics",
                                                    "other"};
const char *const rt_cause_label[RT_CAUSE_COUNT] = {"connect", "timeout", "http_5xx", "peer_lost",
                                                    "broken"};
const char *const rt_rejection_label[RT_REJ_COUNT] = {"invalid_request", "too_many_connections",
                                                      "shutting_down", "no_node"};
const int rt_codes[RT_N_CODES] = {200, 400, 404, 405, 413, 429, 500, 502, 503, 0};

int rt_code_index(int status)
{
    for (int i = 0; i < RT_N_CODES - 1; i++)
        if (rt_codes[i] == status) return i;
    return RT_N_CODES - 1;
}

const double rt_hist_bounds[RT_HIST_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                0.25,  0.5,    1.0,   2.5,  5.0,   10.0, 60.0};

typedef struct {
    rt_counters_t ctr;
    bool draining;
    struct {
        bool up;
        uint64_t requests, in_flight;
    } node[RT_ROLES][PKV_ROUTER_MAX_NODES];
} rt_snap_t;

static void snap_take(pkv_router_t *r, rt_snap_t *s)
{
    pthread_mutex_lock(&r->lock);
    s->ctr = r->ctr;
    s->draining = r->draining;
    for (int role = 0; role < RT_ROLES; role++)
        for (uint32_t i = 0; i < r->n_nodes[role]; i++) {
            s->node[role][i].up = r->nodes[role][i].up;
            s->node[role][i].requests = r->nodes[role][i].requests;
            s->node[role][i].in_flight = r->nodes[role][i].in_flight;
        }
    pthread_mutex_unlock(&r->lock);
}

static void family(FILE *f, const char *name, const char *type, const char *help)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void hist_lines(FILE *f, const char *name, const char *labels, const pkv_hist_t *h)
{
    pkv_hist_write_prom(f, name, labels, h, rt_hist_bounds, RT_HIST_BUCKETS);
}

static void render_requests(FILE *f, const rt_snap_t *s)
{
    const rt_counters_t *c = &s->ctr;
    family(f, "pagekv_router_http_requests_total", "counter",
           "Client requests answered, by route and status code.");
    for (int rt = 0; rt < RT_ROUTE_COUNT; rt++)
        for (int k = 0; k < RT_N_CODES; k++) {
            if (!c->http[rt][k] && !(k == 0 && rt <= RT_ROUTE_CHAT)) continue;
            if (rt_codes[k])
                fprintf(f, "pagekv_router_http_requests_total{route=\"%s\",code=\"%d\"} %llu\n",
                        rt_route_label[rt], rt_codes[k], (unsigned long long)c->http[rt][k]);
            else
                fprintf(f, "pagekv_router_http_requests_total{route=\"%s\",code=\"other\"} %llu\n",
                        rt_route_label[rt], (unsigned long long)c->http[rt][k]);
        }
    family(f, "pagekv_router_rejected_total", "counter",
           "Requests the router answered itself with an error, by reason.");
    for (int i = 0; i < RT_REJ_COUNT; i++)
        fprintf(f, "pagekv_router_rejected_total{reason=\"%s\"} %llu\n", rt_rejection_label[i],
                (unsigned long long)c->rejected[i]);
    family(f, "pagekv_router_in_flight", "gauge", "Client requests being served by the nodes.");
    fprintf(f, "pagekv_router_in_flight %llu\n", (unsigned long long)c->in_flight);
    family(f, "pagekv_router_connections", "gauge", "Open client connections.");
    fprintf(f, "pagekv_router_connections %llu\n", (unsigned long long)c->connections);
    family(f, "pagekv_router_connections_peak", "gauge", "Most client connections open at once.");
    fprintf(f, "pagekv_router_connections_peak %llu\n", (unsigned long long)c->connections_peak);
    family(f, "pagekv_router_stream_errors_total", "counter",
           "Streams that a node's failure ended with an error event.");
    fprintf(f, "pagekv_router_stream_errors_total %llu\n", (unsigned long long)c->stream_errors);
    family(f, "pagekv_router_stream_pauses_total", "counter",
           "Node transfers paused because a slow client had not read what was relayed.");
    fprintf(f, "pagekv_router_stream_pauses_total %llu\n", (unsigned long long)c->stream_pauses);
}

static void render_nodes(FILE *f, pkv_router_t *r, const rt_snap_t *s)
{
    const rt_counters_t *c = &s->ctr;
    family(f, "pagekv_router_errors_total", "counter",
           "Failed attempts on nodes, by role and cause.");
    for (int role = 0; role < RT_ROLES; role++)
        for (int k = 0; k < RT_CAUSE_COUNT; k++)
            fprintf(f, "pagekv_router_errors_total{role=\"%s\",cause=\"%s\"} %llu\n",
                    rt_role_label[role], rt_cause_label[k], (unsigned long long)c->errors[role][k]);
    family(f, "pagekv_router_retries_total", "counter",
           "Attempts made again on another node (or both legs again), by the failure's cause.");
    for (int k = 0; k < RT_CAUSE_COUNT; k++)
        fprintf(f, "pagekv_router_retries_total{cause=\"%s\"} %llu\n", rt_cause_label[k],
                (unsigned long long)c->retries[k]);
    family(f, "pagekv_router_leg_seconds", "histogram",
           "A successful leg: sent to its node -> the end of the node's answer.");
    for (int role = 0; role < RT_ROLES; role++) {
        char lab[32];
        snprintf(lab, sizeof(lab), "role=\"%s\"", rt_role_label[role]);
        hist_lines(f, "pagekv_router_leg_seconds", lab, &c->leg[role]);
    }
    family(f, "pagekv_router_lookup_seconds", "histogram",
           "cache_aware: one /v1/cache/lookup of a prefill node.");
    hist_lines(f, "pagekv_router_lookup_seconds", "", &c->lookup);
    family(f, "pagekv_router_lookups_total", "counter", "Cache lookups sent to prefill nodes.");
    fprintf(f, "pagekv_router_lookups_total %llu\n", (unsigned long long)c->lookups);
    family(f, "pagekv_router_lookup_failures_total", "counter",
           "Cache lookups that got no answer or not 200.");
    fprintf(f, "pagekv_router_lookup_failures_total %llu\n",
            (unsigned long long)c->lookup_failures);
    family(f, "pagekv_router_time_to_first_byte_seconds", "histogram",
           "A request's arrival -> its answer (or first event) ready for the client.");
    hist_lines(f, "pagekv_router_time_to_first_byte_seconds", "", &c->ttft);
    family(f, "pagekv_router_request_duration_seconds", "histogram",
           "A request's arrival -> the end of its answer from the nodes.");
    hist_lines(f, "pagekv_router_request_duration_seconds", "", &c->e2e);
    const char *names[3] = {"pagekv_router_node_up", "pagekv_router_node_requests_total",
                            "pagekv_router_node_in_flight"};
    const char *types[3] = {"gauge", "counter", "gauge"};
    const char *helps[3] = {"1 when the node's last /health answered 200.",
                            "Legs sent to the node (prefill or decode legs, /v1/models).",
                            "The router's legs running on or waiting for the node."};
    for (int k = 0; k < 3; k++) {
        family(f, names[k], types[k], helps[k]);
        for (int role = 0; role < RT_ROLES; role++)
            for (uint32_t i = 0; i < r->n_nodes[role]; i++) {
                uint64_t v = k == 0   ? s->node[role][i].up
                             : k == 1 ? s->node[role][i].requests
                                      : s->node[role][i].in_flight;
                fprintf(f, "%s{role=\"%s\",node=\"%s\"} %llu\n", names[k], rt_role_label[role],
                        r->nodes[role][i].url, (unsigned long long)v);
            }
    }
}

char *rt_metrics_render(pkv_router_t *r, size_t *len)
{
    rt_snap_t *s = malloc(sizeof(*s));
    if (!s) return NULL;
    snap_take(r, s);
    char *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    if (!f) {
        free(s);
        return NULL;
    }
    render_requests(f, s);
    render_nodes(f, r, s);
    pkv_prim_mem_t mem;
    if (pkv_prim_mem_read(0, &mem) == PKV_OK) {
        family(f, "pagekv_router_resident_memory_bytes", "gauge", "The router's VmRSS.");
        fprintf(f, "pagekv_router_resident_memory_bytes %llu\n", (unsigned long long)mem.rss_bytes);
    }
    bool bad = ferror(f) != 0;
    if (fclose(f) || bad) {
        free(text);
        text = NULL;
    }
    free(s);
    if (text) *len = n;
    return text;
}

char *rt_health_render(pkv_router_t *r, int *status)
{
    rt_snap_t *s = malloc(sizeof(*s));
    if (!s) return NULL;
    snap_take(r, s);
    json_t *doc = json_object();
    bool each = true;
    for (int role = 0; role < RT_ROLES; role++) {
        json_t *a = json_array();
        bool any = false;
        for (uint32_t i = 0; i < r->n_nodes[role]; i++) {
            any |= s->node[role][i].up;
            json_array_append_new(a, json_pack("{s:s, s:b}", "url", r->nodes[role][i].url, "up",
                                               (int)s->node[role][i].up));
        }
        each &= any;
        json_object_set_new(doc, rt_role_label[role], a);
    }
    bool ok = each && !s->draining;
    json_object_set_new(doc, "status",
                        json_string(s->draining ? "draining"
                                    : ok        ? "ok"
                                                : "no_node_of_a_role"));
    *status = ok ? 200 : 503;
    char *text = json_dumps(doc, JSON_COMPACT);
    json_decref(doc);
    free(s);
    return text;
}
