/*
 * pagekv bench footprint: the HTTP client (one curl easy handle per exchange) and the
 * fields of the server's /v1/cache/stats.
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

static size_t fp_buf_write(char *data, size_t size, size_t nmemb, void *arg)
{
    fp_buf_t *b = arg;
    size_t n = size * nmemb;
    if (b->len + n + 1 > b->cap) {
        size_t cap = PKV_MAX(b->cap * 2, b->len + n + 1 + 4096);
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return 0;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = '\0';
    return n;
}

int fp_call_init(fp_call_t *c, int port, const char *method, const char *path, char *body,
                 double timeout_s)
{
    memset(c, 0, sizeof(*c));
    c->body = body;
    snprintf(c->url, sizeof(c->url), "http://127.0.0.1:%d%s", port, path);
    if (!(c->h = curl_easy_init())) return PKV_ERR_NOMEM;
    curl_easy_setopt(c->h, CURLOPT_URL, c->url);
    curl_easy_setopt(c->h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c->h, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c->h, CURLOPT_WRITEFUNCTION, fp_buf_write);
    curl_easy_setopt(c->h, CURLOPT_WRITEDATA, &c->resp);
    curl_easy_setopt(c->h, CURLOPT_ERRORBUFFER, c->errbuf);
    curl_easy_setopt(c->h, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000));
    curl_easy_setopt(c->h, CURLOPT_CONNECTTIMEOUT_MS, 5000L);
    if (!strcmp(method, "POST")) {
        c->hdr = curl_slist_append(NULL, "Content-Type: application/json");
        curl_easy_setopt(c->h, CURLOPT_HTTPHEADER, c->hdr);
        curl_easy_setopt(c->h, CURLOPT_POSTFIELDS, body ? body : "");
        curl_easy_setopt(c->h, CURLOPT_POSTFIELDSIZE, (long)(body ? strlen(body) : 0));
    }
    return PKV_OK;
}

void fp_call_fini(fp_call_t *c)
{
    if (c->h) curl_easy_cleanup(c->h);
    curl_slist_free_all(c->hdr);
    free(c->body);
    free(c->resp.p);
    free(c->content);
    memset(c, 0, sizeof(*c));
}

int fp_http_json(int port, const char *method, const char *path, double timeout_s, json_t **out,
                 char *err, size_t errlen)
{
    fp_call_t c;
    int rc = fp_call_init(&c, port, method, path, NULL, timeout_s);
    if (rc) {
        snprintf(err, errlen, "curl_easy_init failed");
        return rc;
    }
    c.cc = curl_easy_perform(c.h);
    curl_easy_getinfo(c.h, CURLINFO_RESPONSE_CODE, &c.status);
    json_t *j = NULL;
    if (c.cc != CURLE_OK) {
        snprintf(err, errlen, "%s %s: %s", method, path,
                 c.errbuf[0] ? c.errbuf : curl_easy_strerror(c.cc));
        rc = PKV_ERR_IO;
    } else if (c.status != 200) {
        snprintf(err, errlen, "%s %s: HTTP %ld: %.300s", method, path, c.status,
                 c.resp.p ? c.resp.p : "");
        rc = PKV_ERR_PROTO;
    } else if (!(j = json_loadb(c.resp.p ? c.resp.p : "", c.resp.len, 0, NULL))) {
        snprintf(err, errlen, "%s %s: the response is not JSON", method, path);
        rc = PKV_ERR_PROTO;
    }
    fp_call_fini(&c);
    if (!rc) *out = j;
    return rc;
}
