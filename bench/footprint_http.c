/*
 * pagekv bench footprint: JSON requests to the server (the HTTP client, support/http.h)
 * and the fields of its /v1/cache/stats.
 */
#include "footprint.h"

#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool fp_stat(json_t *o, const char *const *names, uint64_t *out)
{
    for (const char *const *n = names; *n; n++) {
        json_t *v = o;
        const char *p = *n, *dot;
        while (v && (dot = strchr(p, '.'))) {
            char key[64];
            snprintf(key, sizeof(key), "%.*s", (int)(dot - p), p);
            v = json_object_get(v, key);
            p = dot + 1;
        }
        v = json_object_get(v, p);
        if (json_is_integer(v) && json_integer_value(v) >= 0) {
            *out = (uint64_t)json_integer_value(v);
            return true;
        }
        if (json_is_real(v) && json_real_value(v) >= 0) {
            *out = (uint64_t)json_real_value(v);
            return true;
        }
    }
    return false;
}

/* /v1/cache/stats field names (src/server/metrics.c). */
const char *const K_COMMITTED[] = {"committed_bytes", NULL};
const char *const K_PEAK[] = {"peak_committed_bytes", NULL};
const char *const K_BLOCK_BYTES[] = {"block_bytes", NULL};
const char *const K_TOKEN_BYTES[] = {"token_bytes", NULL};
const char *const K_BLOCK_TOKENS[] = {"block_tokens", NULL};
const char *const K_GRANULE[] = {"granule_bytes", NULL};
const char *const K_RANGES[] = {"storage_ranges", NULL};
const char *const K_BUDGET[] = {"budget_bytes", NULL};
const char *const K_LIVE[] = {"blocks.live", "blocks_live", NULL};

int fp_http_json(int port, const char *method, const char *path, double timeout_s, json_t **out,
                 char *err, size_t errlen)
{
    char base[32];
    snprintf(base, sizeof(base), "http://127.0.0.1:%d", port);
    http_request_t rq = {.base_url = base,
                         .path = path,
                         .method = method,
                         .timeout_ms = (uint32_t)(timeout_s * 1000),
                         .connect_timeout_ms = 5000};
    http_reply_t r;
    int rc = PKV_OK;
    json_t *j = NULL;
    if (http_send(&rq, &r) != 0) {
        snprintf(err, errlen, "%s %s: %s", method, path, r.error);
        rc = PKV_ERR_IO;
    } else if (r.status != 200) {
        snprintf(err, errlen, "%s %s: HTTP %ld: %.300s", method, path, r.status, r.body);
        rc = PKV_ERR_PROTO;
    } else if (!(j = json_loadb(r.body, r.len, 0, NULL))) {
        snprintf(err, errlen, "%s %s: the response is not JSON", method, path);
        rc = PKV_ERR_PROTO;
    }
    http_reply_free(&r);
    if (!rc) *out = j;
    return rc;
}
