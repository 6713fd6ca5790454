/*
 * router layouts: at start, `pagekv route` asks every node for its KV format (the
 * "kv_layout" of its /health: layers, kv_heads, head_dim, block_tokens, dtype; docs/design/
 * router.md, "Nodes' KV formats") and refuses to pair a prefill node and a decode node
 * whose formats differ: a decode node can never take such a prefill node's KV, so every
 * request through the pair would fail. TP may differ (resharding).
 *
 * Runs on the creating thread before the io thread and the listener start: one libcurl
 * multi handle asks every node at once, bounded by lookup_timeout_ms in all. A node that
 * does not answer, or whose /health carries no kv_layout (another server), is not checked.
 */
#include "core/core.h"
#include "router/router_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RT_HEALTH_MAX (64u * 1024) /* a /health document larger than this is not one */

/* One node's answer. */
typedef struct {
    const rt_node_t *node;
    CURL *easy;
    char *buf;
    size_t len;
    bool described; /* its kv_layout was read */
    uint32_t layers, kv_heads, head_dim, block_tokens;
    char dtype[16];
} rt_layout_t;

static size_t on_body(char *p, size_t sz, size_t n, void *arg)
{
    rt_layout_t *l = arg;
    size_t k = sz * n;
    if (l->len + k > RT_HEALTH_MAX) return 0; /* ends the transfer: not described */
    char *b = realloc(l->buf, l->len + k + 1);
    if (!b) return 0;
    memcpy(b + l->len, p, k);
    l->buf = b;
    l->len += k;
    b[l->len] = 0;
    return k;
}

static bool member_u32(const json_t *o, const char *key, uint32_t *out)
{
    json_t *v = json_object_get(o, key);
    if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > UINT32_MAX)
        return false;
    *out = (uint32_t)json_integer_value(v);
    return true;
}

/* The body's kv_layout (whatever the status: a draining node still describes itself). */
static void layout_parse(rt_layout_t *l)
{
    json_t *doc = l->buf ? json_loadb(l->buf, l->len, 0, NULL) : NULL;
    json_t *k = json_object_get(doc, "kv_layout");
    const char *dt = json_string_value(json_object_get(k, "dtype"));
    l->described = json_is_object(k) && member_u32(k, "layers", &l->layers) &&
                   member_u32(k, "kv_heads", &l->kv_heads) &&
                   member_u32(k, "head_dim", &l->head_dim) &&
                   member_u32(k, "block_tokens", &l->block_tokens) && dt && *dt &&
                   strlen(dt) < sizeof(l->dtype);
    if (l->described) snprintf(l->dtype, sizeof(l->dtype), "%s", dt);
    json_decref(doc);
}

static bool layout_equal(const rt_layout_t *a, const rt_layout_t *b)
{
    return a->layers == b->layers && a->kv_heads == b->kv_heads && a->head_dim == b->head_dim &&
           a->block_tokens == b->block_tokens && !strcmp(a->dtype, b->dtype);
}

static void layout_str(const rt_layout_t *l, char *out, size_t cap)
{
    snprintf(out, cap, "dtype %s, layers %u, kv_heads %u, head_dim %u, block_tokens %u", l->dtype,
             l->layers, l->kv_heads, l->head_dim, l->block_tokens);
}

/* Ask every node's /health at once, within lookup_timeout_ms in all. */
static void layouts_fetch(const pkv_router_t *r, rt_layout_t *ls, uint32_t n)
{
    CURLM *m = curl_multi_init();
    if (!m) return;
    for (uint32_t i = 0; i < n; i++) {
        char url[512];
        snprintf(url, sizeof(url), "%s/health", ls[i].node->url);
        CURL *e = curl_easy_init();
        if (!e) continue;
        curl_easy_setopt(e, CURLOPT_URL, url);
        curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(e, CURLOPT_NOPROXY, "*");
        curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
        curl_easy_setopt(e, CURLOPT_WRITEDATA, &ls[i]);
        curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, (long)r->lookup_timeout_ms);
        curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)r->lookup_timeout_ms);
        if (curl_multi_add_handle(m, e) != CURLM_OK) {
            curl_easy_cleanup(e);
            continue;
        }
        ls[i].easy = e;
    }
    uint64_t deadline = pkv_deadline_after_ns((uint64_t)r->lookup_timeout_ms * 1000000ull);
    for (int running = 1; running && pkv_now_ns() < deadline;) {
        if (curl_multi_perform(m, &running) != CURLM_OK) break;
        if (running) curl_multi_poll(m, NULL, 0, 50, NULL);
    }
    CURLMsg *msg;
    int q;
    while ((msg = curl_multi_info_read(m, &q)))
        if (msg->msg == CURLMSG_DONE && msg->data.result == CURLE_OK)
            for (uint32_t i = 0; i < n; i++)
                if (ls[i].easy == msg->easy_handle) layout_parse(&ls[i]);
    for (uint32_t i = 0; i < n; i++) {
        if (!ls[i].easy) continue;
        curl_multi_remove_handle(m, ls[i].easy);
        curl_easy_cleanup(ls[i].easy);
    }
    curl_multi_cleanup(m);
}

int rt_layouts_check(pkv_router_t *r)
{
    uint32_t np = r->n_nodes[RT_PREFILL], n = np + r->n_nodes[RT_DECODE];
    rt_layout_t *ls = calloc(n, sizeof(*ls));
    if (!ls) return PKV_ERR_NOMEM;
    for (uint32_t i = 0; i < n; i++)
        ls[i].node = i < np ? &r->nodes[RT_PREFILL][i] : &r->nodes[RT_DECODE][i - np];
    curl_global_init(CURL_GLOBAL_DEFAULT);
    layouts_fetch(r, ls, n);
    int rc = PKV_OK;
    for (uint32_t i = 0; i < n; i++)
        if (!ls[i].described)
            PKV_LOGI("router", "%s node %s did not describe its KV layout at start: not checked",
                     rt_role_label[ls[i].node->role], ls[i].node->url);
    for (uint32_t p = 0; p < np && !rc; p++)
        for (uint32_t d = np; d < n && !rc; d++) {
            if (!ls[p].described || !ls[d].described || layout_equal(&ls[p], &ls[d])) continue;
            char a[160], b[160];
            layout_str(&ls[p], a, sizeof(a));
            layout_str(&ls[d], b, sizeof(b));
            PKV_LOGE("router",
                     "prefill node %s and decode node %s hold KV of different formats (%s; %s): "
                     "the decode node cannot take the prefill node's KV; serve every node with "
                     "the same --kv-dtype and model",
                     ls[p].node->url, ls[d].node->url, a, b);
            rc = PKV_ERR_INVALID;
        }
    for (uint32_t i = 0; i < n; i++) free(ls[i].buf);
    free(ls);
    return rc;
}
