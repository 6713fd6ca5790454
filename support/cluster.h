/*
 * What `pagekv demo`, the disaggregation benches and the tests read from the answers of a
 * cluster of pagekv nodes (support/: compiled once into build/libpkvsupport.a; the nodes
 * are started with support/launch.h and asked with support/http.h):
 * cluster_answer_parse reads an OpenAI completion or chat completion, streamed (SSE) or
 * not, into the figures a parity check compares; cluster_json_int reads a stats field;
 * cluster_phase_* read a node's transfer phase times from /metrics; cluster_metrics_scrape
 * reads named series from it.
 */
#ifndef PKV_SUPPORT_CLUSTER_H
#define PKV_SUPPORT_CLUSTER_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* What a parity check compares between two answers. */
typedef struct {
    char *text; /* concatenated choices[0] text / message content / deltas
                   (NUL-terminated; may hold NULs: text_len is its length) */
    size_t text_len;
    char finish[24];    /* finish_reason, "" if none */
    long prompt_tokens; /* usage, -1 if absent */
    long completion_tokens;
    long cached_tokens, cached_tokens_disk; /* usage.prompt_tokens_details, -1 if absent */
    char error_code[32]; /* error.code of an error body or an SSE error event, "" if none */
    bool done;           /* a stream ended with data: [DONE] (non-streamed: true) */
} cluster_answer_t;

/* Parse an answer body (stream: SSE events). 0, or -1 for a body that is neither. */
int cluster_answer_parse(const char *body, bool stream, cluster_answer_t *out);
void cluster_answer_free(cluster_answer_t *a);
/* One streamed event's data (the JSON after "data: ", n bytes): true when it carries
 * output text (a non-empty choices[0] text or delta content), as cluster_answer_parse
 * reads it. */
bool cluster_event_has_text(const char *data, size_t n);
/* Text, finish reason and token counts equal. */
bool cluster_answer_equal(const cluster_answer_t *a, const cluster_answer_t *b);

/* A dotted path into a JSON object ("kv_transfer.leases.sent"): its integer value, or
 * -1 when absent or not an integer. */
long long cluster_json_int(const json_t *doc, const char *path);

/* A node's pagekv_kv_transfer_phase_seconds{phase} sums and counts from /metrics, as
 * {"phase": [sum_s, count], ...}; NULL when unreadable. */
json_t *cluster_phase_sums(const char *url);
/* Mean ms per phase between two cluster_phase_sums readings (phases counted between). */
json_t *cluster_phase_means(const json_t *before, const json_t *after);

/* The values of the named series (exact name and labels, as in
 * "pagekv_kv_tier_bytes{tier=\"disk\"}") in one scrape of url's /metrics: out[k] for
 * names[k], 0 for a series that is absent. 0, or -1 when the scrape failed. */
int cluster_metrics_scrape(const char *url, const char *const *names, int n, double *out);

#endif
