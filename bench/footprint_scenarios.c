/*
 * pagekv bench footprint: the chat requests (a batch of the HTTP client, support/http.h,
 * for a concurrent group) and the scenarios (docs/design/footprint.md has the table).
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

/* A chat completion's figures and reply. */
typedef struct {
    uint32_t prompt, completion, cached;
    char *content; /* the assistant's reply (owned) */
} fp_chat_t;

static int fp_record(fp_ctx_t *c, const fp_chat_t *chat, double wall_s, uint32_t group, bool shared)
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
    r->reqs[r->n_reqs] = (pkv_fp_req_t){.prompt_tokens = chat->prompt,
                                        .completion_tokens = chat->completion,
                                        .cached_tokens = chat->cached,
                                        .group = group,
                                        .shared_prefix = shared};
    r->req_wall_s[r->n_reqs] = wall_s;
    r->n_reqs++;
    return PKV_OK;
}

/* Parse a chat completion response into *chat. */
static int fp_parse_chat(fp_ctx_t *c, const http_reply_t *rep, fp_chat_t *chat)
{
    json_error_t je;
    json_t *j = json_loadb(rep->body, rep->len, 0, &je);
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
                 j ? "missing usage or choices[0].message.content" : je.text, rep->body);
        json_decref(j);
        return PKV_ERR_PROTO;
    }
    chat->prompt = (uint32_t)json_integer_value(pt);
    chat->completion = (uint32_t)json_integer_value(ct);
    chat->cached = json_is_integer(cached) ? (uint32_t)json_integer_value(cached) : 0;
    chat->content = strdup(json_string_value(content));
    json_decref(j);
    return chat->content ? PKV_OK : PKV_ERR_NOMEM;
}

/* A batch of requests to the server, the progress line kept while it runs. */
typedef struct {
    fp_ctx_t *c;
    uint32_t done0; /* c->done_reqs before the batch */
} fp_batch_t;

static void fp_batch_tick(void *arg, size_t done)
{
    fp_batch_t *t = arg;
    t->c->done_reqs = t->done0 + (uint32_t)done;
    fp_progress(t->c, false);
}

/* Send the n bodies (POST /v1/chat/completions) at once and wait for all. */
static void fp_batch_run(fp_ctx_t *c, char *const *bodies, size_t n, bool hang_up,
                         http_request_t *rq, http_reply_t *rep)
{
    char base[32];
    snprintf(base, sizeof(base), "http://127.0.0.1:%u", c->srv->port);
    for (size_t i = 0; i < n; i++)
        rq[i] = (http_request_t){.base_url = base,
                                 .path = "/v1/chat/completions",
                                 .body = bodies[i],
                                 .timeout_ms = (uint32_t)(c->o->request_timeout_s * 1000),
                                 .connect_timeout_ms = 5000,
                                 .hang_up = hang_up};
    fp_batch_t t = {.c = c, .done0 = c->done_reqs};
    http_batch_t b = {.concurrency = (uint32_t)n, .tick = fp_batch_tick, .tick_arg = &t};
    http_batch_run(&b, rq, n, rep);
    c->done_reqs = t.done0 + (uint32_t)n;
    fp_progress(c, false);
}

/* Check, parse and record the n replies of a chat group. */
static int fp_chat_take(fp_ctx_t *c, const http_reply_t *rep, size_t n, uint32_t group, bool shared,
                        char **replies)
{
    for (size_t i = 0; i < n; i++) {
        const http_reply_t *k = &rep[i];
        if (k->error[0] || k->status != 200) {
            snprintf(c->run->error, sizeof(c->run->error), "chat completion %zu: %s%ld: %.300s", i,
                     k->error[0] ? k->error : "HTTP ", k->status, k->body ? k->body : "");
            return PKV_ERR_IO;
        }
        fp_chat_t chat = {0};
        int rc = fp_parse_chat(c, k, &chat);
        if (!rc) rc = fp_record(c, &chat, (double)(k->end_ns - k->start_ns) / FP_NS, group, shared);
        if (!rc && replies) {
            replies[i] = chat.content;
            chat.content = NULL;
        }
        free(chat.content);
        if (rc) return rc;
    }
    return PKV_OK;
}

/* Send n chat bodies at once and wait for all; records each in `group` (or group + i when
 * sequential callers pass n = 1). Takes ownership of bodies[]. On success replies[i]
 * (optional) receives the assistant's text (caller frees). */
static int fp_chat_group(fp_ctx_t *c, char **bodies, size_t n, uint32_t group, bool shared,
                         char **replies)
{
    http_request_t *rq = calloc(n, sizeof(*rq));
    http_reply_t *rep = calloc(n, sizeof(*rep));
    int rc = rq && rep ? PKV_OK : PKV_ERR_NOMEM;
    for (size_t i = 0; i < n; i++)
        if (!bodies[i]) rc = PKV_ERR_NOMEM;
    if (rc) {
        snprintf(c->run->error, sizeof(c->run->error), "out of memory building requests");
    } else {
        fp_batch_run(c, bodies, n, false, rq, rep);
        rc = fp_chat_take(c, rep, n, group, shared, replies);
        http_replies_free(rep, n);
    }
    for (size_t i = 0; i < n; i++) free(bodies[i]);
    free(rep);
    free(rq);
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

/* N concurrent streaming chat requests, each with its own ~1300-char prompt (filler seeds
 * seed0..) and room for 256 tokens; each client hangs up as soon as its stream starts. */
static int fp_hangup_group(fp_ctx_t *c, size_t N, uint64_t seed0)
{
    char **bodies = calloc(N, sizeof(*bodies));
    http_request_t *rq = calloc(N, sizeof(*rq));
    http_reply_t *rep = calloc(N, sizeof(*rep));
    int rc = bodies && rq && rep ? PKV_OK : PKV_ERR_NOMEM;
    for (size_t i = 0; i < N && !rc; i++) {
        char *user = pkv_fp_filler_alloc(1300, seed0 + i);
        json_t *msgs = user ? fp_msgs(NULL, user) : NULL;
        json_t *o =
            msgs ? json_pack("{s:s, s:O, s:i, s:f, s:b, s:b}", "model", c->model, "messages", msgs,
                             "max_tokens", 256, "temperature", 0.0, "stream", 1, "ignore_eos", 1)
                 : NULL;
        bodies[i] = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        json_decref(msgs);
        free(user);
        if (!bodies[i]) rc = PKV_ERR_NOMEM;
    }
    bool ran = !rc;
    if (ran) fp_batch_run(c, bodies, N, true, rq, rep);
    for (size_t i = 0; ran && i < N; i++) {
        if (rep[i].got_data && rep[i].status == 200) {
            c->run->hangups++;
        } else if (!rc) {
            snprintf(c->run->error, sizeof(c->run->error),
                     "hangups: stream %zu never started (HTTP %ld)", i, rep[i].status);
            rc = PKV_ERR_IO;
        }
    }
    if (rc == PKV_ERR_NOMEM)
        snprintf(c->run->error, sizeof(c->run->error), "out of memory building requests");
    http_replies_free(rep, rep ? N : 0);
    for (size_t i = 0; bodies && i < N; i++) free(bodies[i]);
    free(bodies);
    free(rep);
    free(rq);
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
