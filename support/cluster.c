/*
 * What the callers of a cluster of pagekv nodes read from their answers
 * (support/cluster.h).
 */
#include "support/cluster.h"

#include "support/http.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- answers --------------------------------------------------------------------------- */
static int append(char **text, size_t *len, const char *s, size_t n)
{
    char *nt = realloc(*text, *len + n + 1);
    if (!nt) return -1;
    memcpy(nt + *len, s, n + 1);
    *text = nt;
    *len += n;
    return 0;
}

/* One response object (a whole answer or one stream chunk) into a. */
static int answer_take(const json_t *o, cluster_answer_t *a, size_t *len)
{
    const json_t *err = json_object_get(o, "error");
    if (err) {
        const char *code = json_string_value(json_object_get(err, "code"));
        snprintf(a->error_code, sizeof(a->error_code), "%s", code ? code : "error");
    }
    const json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    if (ch) {
        const json_t *t = json_object_get(ch, "text");
        const json_t *msg = json_object_get(ch, "message");
        if (!msg) msg = json_object_get(ch, "delta");
        if (!json_is_string(t) && msg) t = json_object_get(msg, "content");
        if (json_is_string(t) &&
            append(&a->text, len, json_string_value(t), json_string_length(t)) != 0)
            return -1;
        const char *f = json_string_value(json_object_get(ch, "finish_reason"));
        if (f) snprintf(a->finish, sizeof(a->finish), "%s", f);
    }
    const json_t *u = json_object_get(o, "usage");
    if (json_is_object(u)) {
        json_t *pt = json_object_get(u, "prompt_tokens"),
               *ct = json_object_get(u, "completion_tokens");
        if (json_is_integer(pt)) a->prompt_tokens = (long)json_integer_value(pt);
        if (json_is_integer(ct)) a->completion_tokens = (long)json_integer_value(ct);
        json_t *d = json_object_get(u, "prompt_tokens_details");
        json_t *c = json_object_get(d, "cached_tokens"),
               *cd = json_object_get(d, "cached_tokens_disk");
        if (json_is_integer(c)) a->cached_tokens = (long)json_integer_value(c);
        if (json_is_integer(cd)) a->cached_tokens_disk = (long)json_integer_value(cd);
    }
    return 0;
}

int cluster_answer_parse(const char *body, bool stream, cluster_answer_t *out)
{
    cluster_answer_t a = {.prompt_tokens = -1,
                          .completion_tokens = -1,
                          .cached_tokens = -1,
                          .cached_tokens_disk = -1};
    size_t len = 0;
    a.text = calloc(1, 1);
    if (!a.text || !body) goto fail;
    if (!stream) {
        json_t *o = json_loads(body, JSON_ALLOW_NUL, NULL);
        if (!json_is_object(o) || answer_take(o, &a, &len) != 0) {
            json_decref(o);
            goto fail;
        }
        json_decref(o);
        a.done = true;
        a.text_len = len;
        *out = a;
        return 0;
    }
    for (const char *l = body; *l;) {
        size_t n = strcspn(l, "\n");
        if (strncmp(l, "data: ", 6) == 0) {
            const char *d = l + 6;
            size_t dn = n - 6;
            if (dn == 6 && strncmp(d, "[DONE]", 6) == 0) {
                a.done = true;
            } else {
                json_t *o = json_loadb(d, dn, JSON_ALLOW_NUL, NULL);
                int bad = !json_is_object(o) || answer_take(o, &a, &len) != 0;
                json_decref(o);
                if (bad) goto fail;
            }
        }
        l += n;
        if (*l == '\n') l++;
    }
    a.text_len = len;
    *out = a;
    return 0;
fail:
    free(a.text);
    return -1;
}

bool cluster_event_has_text(const char *data, size_t n)
{
    cluster_answer_t a = {.text = NULL};
    size_t len = 0;
    json_t *o = json_loadb(data, n, JSON_ALLOW_NUL, NULL);
    bool text = json_is_object(o) && answer_take(o, &a, &len) == 0 && len > 0;
    json_decref(o);
    free(a.text);
    return text;
}

void cluster_answer_free(cluster_answer_t *a)
{
    if (!a) return;
    free(a->text);
    a->text = NULL;
}

bool cluster_answer_equal(const cluster_answer_t *a, const cluster_answer_t *b)
{
    return a->text && b->text && a->text_len == b->text_len &&
           memcmp(a->text, b->text, a->text_len) == 0 && strcmp(a->finish, b->finish) == 0 &&
           a->prompt_tokens == b->prompt_tokens && a->completion_tokens == b->completion_tokens;
}

long long cluster_json_int(const json_t *doc, const char *path)
{
    char key[64];
    const json_t *cur = doc;
    while (cur && *path) {
        size_t n = strcspn(path, ".");
        if (n >= sizeof(key)) return -1;
        memcpy(key, path, n);
        key[n] = '\0';
        cur = json_object_get(cur, key);
        path += n + (path[n] == '.');
    }
    return json_is_integer(cur) ? (long long)json_integer_value(cur) : -1;
}

/* The node's pagekv_kv_transfer_phase_seconds{phase} sums and counts, as
 * {"phase": [sum_s, count], ...}; NULL when unreadable. */
json_t *cluster_phase_sums(const char *url)
{
    http_reply_t r;
    if (http_call(url, "/metrics", NULL, NULL, 5000, NULL, &r) != 0) return NULL;
    json_t *o = json_object();
    static const char pre[] = "pagekv_kv_transfer_phase_seconds_";
    for (const char *l = r.body; l && *l;) {
        size_t n = strcspn(l, "\n");
        const char *q = strstr(l, "{phase=\"");
        bool sum = !strncmp(l, pre, sizeof(pre) - 1) && !strncmp(l + sizeof(pre) - 1, "sum{", 4);
        bool cnt = !strncmp(l, pre, sizeof(pre) - 1) && !strncmp(l + sizeof(pre) - 1, "count{", 6);
        if ((sum || cnt) && q && q < l + n) {
            char name[32];
            const char *e = strchr(q + 8, '"');
            const char *v = e ? strchr(e, ' ') : NULL;
            if (e && v && v < l + n && (size_t)(e - q - 8) < sizeof(name)) {
                snprintf(name, sizeof(name), "%.*s", (int)(e - q - 8), q + 8);
                json_t *a = json_object_get(o, name);
                if (!a) json_object_set_new(o, name, a = json_pack("[f, f]", 0.0, 0.0));
                json_array_set_new(a, sum ? 0 : 1, json_real(strtod(v + 1, NULL)));
            }
        }
        l += n + (l[n] == '\n');
    }
    http_reply_free(&r);
    return o;
}

/* Mean ms per phase between two cluster_phase_sums readings. */
json_t *cluster_phase_means(const json_t *before, const json_t *after)
{
    json_t *m = json_object();
    const char *k;
    json_t *a;
    json_object_foreach((json_t *)after, k, a)
    {
        const json_t *b = json_object_get(before, k);
        double ds = json_real_value(json_array_get(a, 0)) - json_real_value(json_array_get(b, 0));
        double dc = json_real_value(json_array_get(a, 1)) - json_real_value(json_array_get(b, 1));
        if (dc > 0) json_object_set_new(m, k, json_real(1e3 * ds / dc));
    }
    return m;
}

int cluster_metrics_scrape(const char *url, const char *const *names, int n, double *out)
{
    http_reply_t r;
    if (http_call(url, "/metrics", NULL, NULL, 5000, NULL, &r) != 0 || r.status != 200) {
        http_reply_free(&r);
        return -1;
    }
    for (int k = 0; k < n; k++) {
        out[k] = 0;
        size_t nl = strlen(names[k]);
        for (const char *l = r.body; l && *l;) {
            size_t len = strcspn(l, "\n");
            if (len > nl && !strncmp(l, names[k], nl) && l[nl] == ' ') {
                out[k] = strtod(l + nl + 1, NULL);
                break;
            }
            l += len + (l[len] == '\n');
        }
    }
    http_reply_free(&r);
    return 0;
}
