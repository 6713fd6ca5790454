/*
 * pagekv bench footprint: the chat requests (curl multi for a concurrent group) and the
 * scenarios (docs/design/footprint.md has the table).
 */
#include "footprint.h"

#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The body of a chat completion: messages as given (json array, borrowed). */
static char *fp_chat_body(const char *model, json_t *messages, uint32_t max_tokens)
{
    json_t *o = json_pack("{s:s, s:O, s:i, s:f, s:b, s:b}", "model", model, "messages", messages,
                          "max_tokens", (json_int_t)max_tokens, "temperature", 0.0, "stream", 0,
                          "ignore_eos", 1);
    if (!o) return NULL;
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

static json_t *fp_msgs(const char *system, const char *user)
{
    json_t *a = json_array();
    if (!a) return NULL;
    if (system)
        json_array_append_new(a, json_pack("{s:s, s:s}", "role", "system", "content", system));
    if (user) json_array_append_new(a, json_pack("{s:s, s:s}", "role", "user", "content", user));
    return a;
}

static int fp_record(fp_ctx_t *c, const fp_call_t *call, uint32_t group, bool shared)
{
    fp_run_t *r = c->run;
    if (r->n_reqs == r->cap_reqs) {
        size_t cap = r->cap_reqs ? r->cap_reqs * 2 : 64;
        pkv_fp_req_t *q = realloc(r->reqs, cap * sizeof(*q));
        if (!q) return PKV_ERR_NOMEM;
        r->reqs = q;
        double *w = realloc(r->req_wall_s, cap * sizeof(*w));
        if (!w) return PKV_ERR_NOMEM;
        r->req_wall_s = w;
        r->cap_reqs = cap;
    }
    r->reqs[r->n_reqs] = (pkv_fp_req_t){.prompt_tokens = call->prompt,
                                        .completion_tokens = call->completion,
                                        .cached_tokens = call->cached,
                                        .group = group,
                                        .shared_prefix = shared};
    r->req_wall_s[r->n_reqs] = (double)(call->t1 - call->t0) / FP_NS;
    r->n_reqs++;
    return PKV_OK;
}

/* Parse a chat completion response into call->prompt/completion/cached/content. */
static int fp_parse_chat(fp_ctx_t *c, fp_call_t *call)
{
    json_error_t je;
    json_t *j = json_loadb(call->resp.p ? call->resp.p : "", call->resp.len, 0, &je);
    json_t *usage = json_object_get(j, "usage");
    json_t *choice = json_array_get(json_object_get(j, "choices"), 0);
    json_t *content = json_object_get(json_object_get(choice, "message"), "content");
    json_t *pt = json_object_get(usage, "prompt_tokens");
    json_t *ct = json_object_get(usage, "completion_tokens");
    json_t *cached =
        json_object_get(json_object_get(usage, "prompt_tokens_details"), "cached_tokens");
    if (!j || !json_is_integer(pt) || !json_is_integer(ct) || !json_is_string(content)) {
        snprintf(c->run->error, sizeof(c->run->error),
                 "chat completion: unexpected response (%s): %.300s",
                 j ? "missing usage or choices[0].message.content" : je.text,
                 call->resp.p ? call->resp.p : "");
        json_decref(j);
        return PKV_ERR_PROTO;
    }
    call->prompt = (uint32_t)json_integer_value(pt);
    call->completion = (uint32_t)json_integer_value(ct);
    call->cached = json_is_integer(cached) ? (uint32_t)json_integer_value(cached) : 0;
    call->content = strdup(json_string_value(content));
    json_decref(j);
    return call->content ? PKV_OK : PKV_ERR_NOMEM;
}

/* Send n chat bodies at once (curl multi) and wait for all; records each in `group`
 * (or group + i when sequential callers pass n = 1). Takes ownership of bodies[]. On
 * success replies[i] (optional) receives the assistant's text (caller frees). */
static int fp_chat_group(fp_ctx_t *c, char **bodies, size_t n, uint32_t group, bool shared,
                         char **replies)
{
    fp_call_t *calls = calloc(n, sizeof(*calls));
    CURLM *m = curl_multi_init();
    int rc = PKV_OK;
    size_t inited = 0;
    if (!calls || !m) rc = PKV_ERR_NOMEM;
    for (size_t i = 0; i < n; i++) {
        if (rc || !bodies[i]) {
            free(bodies[i]);
            if (!rc) rc = PKV_ERR_NOMEM;
            continue;
        }
        rc = fp_call_init(&calls[i], c->srv->port, "POST", "/v1/chat/completions", bodies[i],
                          c->o->request_timeout_s);
        inited = i + 1;
        if (rc) continue;
        calls[i].t0 = pkv_now_ns();
        curl_multi_add_handle(m, calls[i].h);
    }
    if (rc) {
        snprintf(c->run->error, sizeof(c->run->error), "out of memory building requests");
        goto out;
    }
    int running = (int)n;
    while (running > 0) {
        if (curl_multi_perform(m, &running) != CURLM_OK) break;
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(m, &left))) {
            if (msg->msg != CURLMSG_DONE) continue;
            for (size_t i = 0; i < n; i++)
                if (calls[i].h == msg->easy_handle) {
                    calls[i].cc = msg->data.result;
                    calls[i].t1 = pkv_now_ns();
                    curl_easy_getinfo(calls[i].h, CURLINFO_RESPONSE_CODE, &calls[i].status);
                    c->done_reqs++;
                }
        }
        fp_progress(c, false);
        if (running > 0) curl_multi_poll(m, NULL, 0, 250, NULL);
    }
    for (size_t i = 0; i < n && !rc; i++) {
        fp_call_t *k = &calls[i];
        if (k->cc != CURLE_OK || k->status != 200) {
            snprintf(c->run->error, sizeof(c->run->error), "chat completion %zu: %s%ld: %.300s", i,
                     k->cc != CURLE_OK ? (k->errbuf[0] ? k->errbuf : curl_easy_strerror(k->cc))
                                       : "HTTP ",
                     k->status, k->resp.p ? k->resp.p : "");
            rc = PKV_ERR_IO;
            break;
        }
        if ((rc = fp_parse_chat(c, k))) break;
        if ((rc = fp_record(c, k, group, shared))) break;
        if (replies) {
            replies[i] = k->content;
            k->content = NULL;
        }
    }
out:
    for (size_t i = 0; i < inited; i++) {
        if (calls[i].h) curl_multi_remove_handle(m, calls[i].h);
        fp_call_fini(&calls[i]);
    }
    if (m) curl_multi_cleanup(m);
    free(calls);
    return rc;
}

static int fp_chat_one(fp_ctx_t *c, json_t *msgs, uint32_t max_tokens, uint32_t group, char **reply)
{
    char *body = fp_chat_body(c->model, msgs, max_tokens);
    return fp_chat_group(c, &body, 1, group, false, reply);
}

/* ---- scenarios ----------------------------------------------------------------------------- */

static char *fp_question(unsigned i)
{
    char *q = malloc(160);
    if (q)
        snprintf(q, 160,
                 "Question %u: according to the notes, what does sentence %u say about system "
                 "%u? Answer briefly.",
                 i, 101 + 7 * i, 1000 + 37 * i);
    return q;
}

/* shared_prefix_burst (concurrent) and seqshare (one after another): a warm-up request,
 * then 8 requests sharing its ~prefix_tokens system prompt. */
static int fp_sc_shared(fp_ctx_t *c, bool concurrent)
{
    size_t chars = (size_t)((double)c->o->prefix_tokens * c->chars_per_token);
    char *system = pkv_fp_filler_alloc(chars, 1);
    char *bodies[8] = {0};
    int rc = PKV_ERR_NOMEM;
    if (!system) goto out;
    c->total_reqs = 9;
    char *q0 = fp_question(0);
    json_t *warm = q0 ? fp_msgs(system, q0) : NULL;
    free(q0);
    if (!warm) goto out;
    rc = fp_chat_one(c, warm, 8, 0, NULL);
    json_decref(warm);
    if (rc) goto out;
    for (unsigned i = 0; i < 8; i++) {
        char *q = fp_question(i + 1);
        json_t *msgs = q ? fp_msgs(system, q) : NULL;
        bodies[i] = msgs ? fp_chat_body(c->model, msgs, 128) : NULL;
        json_decref(msgs);
        free(q);
    }
    if (concurrent) {
        rc = fp_chat_group(c, bodies, 8, 1, true, NULL);
    } else {
        rc = PKV_OK;
        for (unsigned i = 0; i < 8; i++) {
            if (!rc)
                rc =
                    bodies[i] ? fp_chat_group(c, &bodies[i], 1, 1 + i, false, NULL) : PKV_ERR_NOMEM;
            else
                free(bodies[i]);
        }
    }
out:
    free(system);
    return rc;
}

static int fp_sc_multiturn(fp_ctx_t *c)
{
    json_t *msgs = json_array();
    int rc = msgs ? PKV_OK : PKV_ERR_NOMEM;
    c->total_reqs = 8;
    for (unsigned t = 0; t < 8 && !rc; t++) {
        char *user = pkv_fp_filler_alloc(1000, 100 + t), *reply = NULL;
        if (!user ||
            json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", user))) {
            free(user);
            rc = PKV_ERR_NOMEM;
            break;
        }
        free(user);
        rc = fp_chat_one(c, msgs, 128, t, &reply);
        if (!rc && json_array_append_new(
                       msgs, json_pack("{s:s, s:s}", "role", "assistant", "content", reply)))
            rc = PKV_ERR_NOMEM;
        free(reply);
    }
    json_decref(msgs);
    return rc;
}

/* One churn request: 2000 chars of filler of its own (seed), max_tokens 32. */
static int fp_churn_one(fp_ctx_t *c, uint64_t seed, uint32_t group)
{
    char *user = pkv_fp_filler_alloc(2000, seed);
    json_t *msgs = user ? fp_msgs(NULL, user) : NULL;
    free(user);
    if (!msgs) return PKV_ERR_NOMEM;
    int rc = fp_chat_one(c, msgs, 32, group, NULL);
    json_decref(msgs);
    return rc;
}

/* churn_then_idle, hangups: the level to come back to is the server's RSS after it has
 * served once (code paths and buffers touched) and the idle period has emptied its cache:
 * run `warm`, wait the idle period, read VmRSS into run->before_bytes. */
static int fp_before_level(fp_ctx_t *c, int (*warm)(fp_ctx_t *c))
{
    int rc = warm(c);
    if (rc) return rc;
    fp_idle(c, c->o->cache_idle_s + 1.5);
    pkv_prim_mem_t m;
    if (pkv_prim_mem_read(c->srv->pid, &m)) {
        snprintf(c->run->error, sizeof(c->run->error), "cannot read the server's VmRSS");
        return PKV_ERR_IO;
    }
    c->run->before_bytes = m.rss_bytes;
    return PKV_OK;
}

static int fp_churn_warm(fp_ctx_t *c)
{
    int rc = fp_churn_one(c, 999, 0);
    c->run->n_reqs = 0; /* the warm-up is not part of the load's figures */
    return rc;
}

static int fp_sc_churn(fp_ctx_t *c)
{
    int rc = c->run->scenario == SC_CHURN_IDLE ? fp_before_level(c, fp_churn_warm) : PKV_OK;
    c->total_reqs = 32;
    for (unsigned i = 0; i < 32 && !rc; i++) rc = fp_churn_one(c, 1000 + i, i);
    return rc;
}

static int fp_sc_distinct(fp_ctx_t *c)
{
    char *bodies[8] = {0};
    c->total_reqs = 8;
    for (unsigned i = 0; i < 8; i++) {
        char *system = pkv_fp_filler_alloc(16000, 2000 + i), *q = fp_question(i + 1);
        json_t *msgs = system && q ? fp_msgs(system, q) : NULL;
        bodies[i] = msgs ? fp_chat_body(c->model, msgs, 32) : NULL;
        json_decref(msgs);
        free(system);
        free(q);
    }
    return fp_chat_group(c, bodies, 8, 0, false, NULL);
}

/* hangups: one streaming request whose client cuts the connection at its first bytes. */
typedef struct {
    fp_call_t call;
    bool got_data;
} fp_hangup_t;

static size_t fp_hangup_write(char *data, size_t size, size_t nmemb, void *arg)
{
    (void)data;
    fp_hangup_t *h = arg;
    h->got_data = size * nmemb > 0;
    return 0; /* abort the transfer: the client is gone */
}

/* N concurrent streaming chat requests, each with its own ~1300-char prompt (filler seeds
 * seed0..) and room for 256 tokens; each client hangs up as soon as its stream starts. */
static int fp_hangup_group(fp_ctx_t *c, size_t N, uint64_t seed0)
{
    fp_hangup_t *h = calloc(N, sizeof(*h));
    CURLM *m = curl_multi_init();
    int rc = h && m ? PKV_OK : PKV_ERR_NOMEM;
    size_t inited = 0;
    for (size_t i = 0; i < N && !rc; i++) {
        char *user = pkv_fp_filler_alloc(1300, seed0 + i);
        json_t *msgs = user ? fp_msgs(NULL, user) : NULL;
        json_t *o =
            msgs ? json_pack("{s:s, s:O, s:i, s:f, s:b, s:b}", "model", c->model, "messages", msgs,
                             "max_tokens", 256, "temperature", 0.0, "stream", 1, "ignore_eos", 1)
                 : NULL;
        char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        json_decref(msgs);
        free(user);
        if (!body || fp_call_init(&h[i].call, c->srv->port, "POST", "/v1/chat/completions", body,
                                  c->o->request_timeout_s)) {
            if (!h[i].call.h) free(body);
            rc = PKV_ERR_NOMEM;
            break;
        }
        inited = i + 1;
        curl_easy_setopt(h[i].call.h, CURLOPT_WRITEFUNCTION, fp_hangup_write);
        curl_easy_setopt(h[i].call.h, CURLOPT_WRITEDATA, &h[i]);
        curl_multi_add_handle(m, h[i].call.h);
    }
    int running = rc ? 0 : (int)N;
    while (running > 0) {
        if (curl_multi_perform(m, &running) != CURLM_OK) break;
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(m, &left)))
            if (msg->msg == CURLMSG_DONE) c->done_reqs++;
        fp_progress(c, false);
        if (running > 0) curl_multi_poll(m, NULL, 0, 250, NULL);
    }
    for (size_t i = 0; i < inited; i++) {
        long status = 0;
        curl_easy_getinfo(h[i].call.h, CURLINFO_RESPONSE_CODE, &status);
        if (h[i].got_data && status == 200)
            c->run->hangups++;
        else if (!rc) {
            snprintf(c->run->error, sizeof(c->run->error),
                     "hangups: stream %zu never started (HTTP %ld)", i, status);
            rc = PKV_ERR_IO;
        }
        curl_multi_remove_handle(m, h[i].call.h);
        fp_call_fini(&h[i].call);
    }
    if (rc == PKV_ERR_NOMEM)
        snprintf(c->run->error, sizeof(c->run->error), "out of memory building requests");
    if (m) curl_multi_cleanup(m);
    free(h);
    return rc;
}

static int fp_hangup_warm(fp_ctx_t *c)
{
    int rc = fp_hangup_group(c, 1, 2999);
    c->run->hangups = 0;
    return rc;
}

/* hangups: the first report's case, 40 clients hanging up early, after a warm-up. */
static int fp_sc_hangups(fp_ctx_t *c)
{
    int rc = fp_before_level(c, fp_hangup_warm);
    c->total_reqs = 40;
    c->done_reqs = 0;
    return rc ? rc : fp_hangup_group(c, 40, 3000);
}

int fp_scenario_run(fp_ctx_t *c)
{
    switch (c->run->scenario) {
    case SC_IDLE:
        fp_idle(c, c->o->idle_s);
        return PKV_OK;
    case SC_BURST:
        return fp_sc_shared(c, true);
    case SC_SEQSHARE:
        return fp_sc_shared(c, false);
    case SC_MULTITURN:
        return fp_sc_multiturn(c);
    case SC_CHURN:
    case SC_CHURN_IDLE:
        return fp_sc_churn(c);
    case SC_HANGUPS:
        return fp_sc_hangups(c);
    case SC_DISTINCT:
        return fp_sc_distinct(c);
    }
    return PKV_ERR_INVALID;
}
