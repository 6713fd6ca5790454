/*
 * openai: request parsing (see openai.h). JSON through jansson; every field of the body
 * is looked up in one table per endpoint so that unknown fields are refused and known
 * ones are checked in one place.
 */
#include "openai/openai.h"

#include "core/core.h"

#include <jansson.h>
#include <math.h>
#include <openssl/sha.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BAD_TYPE    "invalid_type"
#define BAD_VALUE   "invalid_value"
#define UNSUPPORTED "unsupported_parameter"
#define REQ_ERR     "invalid_request_error"

void pkv_openai_error_set(pkv_openai_error_t *err, int status, const char *type, const char *code,
                          const char *param, const char *fmt, ...)
{
    if (!err) return;
    err->status = status;
    err->type = type;
    err->code = code;
    err->param = param;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
    /* Messages may quote client input (a field or model name): keep them printable
     * ASCII so they are always valid JSON strings and safe in logs. */
    for (char *p = err->message; *p; p++)
        if ((unsigned char)*p < 0x20 || (unsigned char)*p >= 0x7f) *p = '?';
}

static int bad(pkv_openai_error_t *err, const char *code, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int bad(pkv_openai_error_t *err, const char *code, const char *param, const char *fmt, ...)
{
    char msg[sizeof(err->message)];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    pkv_openai_error_set(err, 400, REQ_ERR, code, param, "%s", msg);
    return PKV_ERR_INVALID;
}

/* ---- field checkers: each returns PKV_OK or fills err ------------------------------ */

typedef struct field field_t;
typedef int (*field_fn)(const field_t *f, json_t *v, pkv_openai_request_t *r,
                        const pkv_openai_limits_t *lim, pkv_openai_error_t *err);
struct field {
    const char *name;
    field_fn check;
};

static int want_bool(const field_t *f, json_t *v, bool *out, pkv_openai_error_t *err)
{
    if (!json_is_boolean(v)) return bad(err, BAD_TYPE, f->name, "'%s' must be a boolean", f->name);
    *out = json_is_true(v);
    return PKV_OK;
}

static int want_number(const field_t *f, json_t *v, double lo, double hi, double *out,
                       pkv_openai_error_t *err)
{
    if (!json_is_number(v)) return bad(err, BAD_TYPE, f->name, "'%s' must be a number", f->name);
    double d = json_number_value(v);
    if (!isfinite(d) || d < lo || d > hi)
        return bad(err, BAD_VALUE, f->name, "'%s' must be in [%g, %g]", f->name, lo, hi);
    *out = d;
    return PKV_OK;
}

static int f_string_ignored(const field_t *f, json_t *v, pkv_openai_request_t *r,
                            const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_string(v)) return bad(err, BAD_TYPE, f->name, "'%s' must be a string", f->name);
    return PKV_OK;
}

static int f_object_ignored(const field_t *f, json_t *v, pkv_openai_request_t *r,
                            const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_object(v)) return bad(err, BAD_TYPE, f->name, "'%s' must be an object", f->name);
    return PKV_OK;
}

static int f_bool_ignored(const field_t *f, json_t *v, pkv_openai_request_t *r,
                          const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    bool b = false;
    return want_bool(f, v, &b, err);
}

static int f_model(const field_t *f, json_t *v, pkv_openai_request_t *r,
                   const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_string(v)) return bad(err, BAD_TYPE, f->name, "'model' must be a string");
    r->model = json_string_value(v);
    return PKV_OK;
}

static int f_max_tokens(const field_t *f, json_t *v, pkv_openai_request_t *r,
                        const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_integer(v)) return bad(err, BAD_TYPE, f->name, "'%s' must be an integer", f->name);
    json_int_t n = json_integer_value(v);
    if (n < 1)
        return bad(err, BAD_VALUE, f->name, "'%s' must be >= 1 (got %lld)", f->name, (long long)n);
    if ((uint64_t)n > lim->max_context)
        return bad(err, BAD_VALUE, f->name, "'%s' is %lld, above the context length (%u tokens)",
                   f->name, (long long)n, lim->max_context);
    r->has_max_tokens = true;
    r->max_tokens = (uint32_t)n;
    return PKV_OK;
}

static int f_temperature(const field_t *f, json_t *v, pkv_openai_request_t *r,
                         const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    double d = 0;
    int rc = want_number(f, v, 0.0, 2.0, &d, err);
    if (!rc) r->temperature = (float)d;
    return rc;
}

static int f_top_p(const field_t *f, json_t *v, pkv_openai_request_t *r,
                   const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    double d = 0;
    int rc = want_number(f, v, 0.0, 1.0, &d, err);
    if (rc) return rc;
    if (d <= 0.0) return bad(err, BAD_VALUE, f->name, "'top_p' must be in (0, 1]");
    r->top_p = (float)d;
    return PKV_OK;
}

static int f_seed(const field_t *f, json_t *v, pkv_openai_request_t *r,
                  const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_integer(v)) return bad(err, BAD_TYPE, f->name, "'seed' must be an integer");
    r->has_seed = true;
    r->seed = (uint64_t)json_integer_value(v);
    return PKV_OK;
}

static int stop_one(json_t *s, pkv_openai_request_t *r, pkv_openai_error_t *err)
{
    if (!json_is_string(s))
        return bad(err, BAD_TYPE, "stop", "'stop' must be a string or an array of strings");
    size_t len = json_string_length(s);
    const char *str = json_string_value(s);
    if (len == 0 || len >= PKV_ENGINE_MAX_STOP_LEN)
        return bad(err, BAD_VALUE, "stop", "stop strings must be 1..%d bytes",
                   PKV_ENGINE_MAX_STOP_LEN - 1);
    if (memchr(str, 0, len)) return bad(err, BAD_VALUE, "stop", "stop strings cannot contain NUL");
    r->stop[r->n_stop++] = str;
    return PKV_OK;
}

static int f_stop(const field_t *f, json_t *v, pkv_openai_request_t *r,
                  const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (json_is_string(v)) return stop_one(v, r, err);
    if (!json_is_array(v))
        return bad(err, BAD_TYPE, "stop", "'stop' must be a string or an array of strings");
    if (json_array_size(v) > PKV_ENGINE_MAX_STOP)
        return bad(err, BAD_VALUE, "stop", "at most %d stop strings", PKV_ENGINE_MAX_STOP);
    size_t i;
    json_t *s;
    json_array_foreach(v, i, s)
    {
        int rc = stop_one(s, r, err);
        if (rc) return rc;
    }
    return PKV_OK;
}

static int f_stream(const field_t *f, json_t *v, pkv_openai_request_t *r,
                    const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    return want_bool(f, v, &r->stream, err);
}

static int f_stream_options(const field_t *f, json_t *v, pkv_openai_request_t *r,
                            const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_object(v))
        return bad(err, BAD_TYPE, f->name, "'stream_options' must be an object");
    const char *key;
    json_t *x;
    json_object_foreach(v, key, x)
    {
        static const field_t inc = {"stream_options.include_usage", NULL};
        static const field_t cont = {"stream_options.continuous_usage_stats", NULL};
        if (!strcmp(key, "include_usage")) {
            if (!json_is_null(x) && want_bool(&inc, x, &r->include_usage, err))
                return PKV_ERR_INVALID;
        } else if (!strcmp(key, "continuous_usage_stats")) {
            bool b = false;
            if (!json_is_null(x) && want_bool(&cont, x, &b, err)) return PKV_ERR_INVALID;
            if (b)
                return bad(err, UNSUPPORTED, cont.name,
                           "'stream_options.continuous_usage_stats' is not supported");
        } else {
            return bad(err, "unknown_parameter", "stream_options",
                       "unrecognized field 'stream_options.%.64s'", key);
        }
    }
    return PKV_OK;
}

/* Accepted only at their no-op values. */
static int f_n(const field_t *f, json_t *v, pkv_openai_request_t *r, const pkv_openai_limits_t *lim,
               pkv_openai_error_t *err)
{
    if (!json_is_integer(v)) return bad(err, BAD_TYPE, f->name, "'%s' must be an integer", f->name);
    if (json_integer_value(v) != 1)
        return bad(err, UNSUPPORTED, f->name, "only '%s': 1 is supported", f->name);
    return PKV_OK;
}

static int f_logprobs(const field_t *f, json_t *v, pkv_openai_request_t *r,
                      const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_boolean(v) && !json_is_integer(v))
        return bad(err, BAD_TYPE, f->name, "'%s' must be a boolean or an integer", f->name);
    if (json_is_true(v) || json_is_integer(v))
        return bad(err, UNSUPPORTED, f->name, "'%s' is not supported", f->name);
    return PKV_OK;
}

static int f_top_logprobs(const field_t *f, json_t *v, pkv_openai_request_t *r,
                          const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_integer(v))
        return bad(err, BAD_TYPE, f->name, "'top_logprobs' must be an integer");
    if (json_integer_value(v) != 0)
        return bad(err, UNSUPPORTED, f->name, "'top_logprobs' is not supported");
    return PKV_OK;
}

static int f_false_only(const field_t *f, json_t *v, pkv_openai_request_t *r,
                        const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    bool b = false;
    if (want_bool(f, v, &b, err)) return PKV_ERR_INVALID;
    if (b) return bad(err, UNSUPPORTED, f->name, "'%s' is not supported", f->name);
    return PKV_OK;
}

static int f_penalty(const field_t *f, json_t *v, pkv_openai_request_t *r,
                     const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    double d = 0;
    if (want_number(f, v, -2.0, 2.0, &d, err)) return PKV_ERR_INVALID;
    if (d != 0.0)
        return bad(err, UNSUPPORTED, f->name, "'%s' other than 0 is not supported", f->name);
    return PKV_OK;
}

static int f_empty_object(const field_t *f, json_t *v, pkv_openai_request_t *r,
                          const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_object(v)) return bad(err, BAD_TYPE, f->name, "'%s' must be an object", f->name);
    if (json_object_size(v))
        return bad(err, UNSUPPORTED, f->name, "'%s' is not supported", f->name);
    return PKV_OK;
}

static int f_empty_array(const field_t *f, json_t *v, pkv_openai_request_t *r,
                         const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_array(v)) return bad(err, BAD_TYPE, f->name, "'%s' must be an array", f->name);
    if (json_array_size(v)) return bad(err, UNSUPPORTED, f->name, "'%s' is not supported", f->name);
    return PKV_OK;
}

static int f_choice_none(const field_t *f, json_t *v, pkv_openai_request_t *r,
                         const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_string(v))
        return bad(err, UNSUPPORTED, f->name,
                   "'%s' other than \"none\" or \"auto\" is not supported", f->name);
    const char *s = json_string_value(v);
    if (strcmp(s, "none") && strcmp(s, "auto"))
        return bad(err, UNSUPPORTED, f->name,
                   "'%s' other than \"none\" or \"auto\" is not supported", f->name);
    return PKV_OK;
}

static int f_suffix(const field_t *f, json_t *v, pkv_openai_request_t *r,
                    const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_string(v)) return bad(err, BAD_TYPE, f->name, "'suffix' must be a string");
    if (json_string_length(v)) return bad(err, UNSUPPORTED, f->name, "'suffix' is not supported");
    return PKV_OK;
}

static int f_response_format(const field_t *f, json_t *v, pkv_openai_request_t *r,
                             const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_object(v))
        return bad(err, BAD_TYPE, f->name, "'response_format' must be an object");
    json_t *t = json_object_get(v, "type");
    if (!json_is_string(t) || strcmp(json_string_value(t), "text") || json_object_size(v) != 1)
        return bad(err, UNSUPPORTED, f->name,
                   "only 'response_format': {\"type\": \"text\"} is supported");
    return PKV_OK;
}

static int f_ignore_eos(const field_t *f, json_t *v, pkv_openai_request_t *r,
                        const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    return want_bool(f, v, &r->ignore_eos, err);
}

static int f_priority(const field_t *f, json_t *v, pkv_openai_request_t *r,
                      const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_integer(v)) return bad(err, BAD_TYPE, f->name, "'priority' must be an integer");
    json_int_t p = json_integer_value(v);
    if (p < -1000000 || p > 1000000)
        return bad(err, BAD_VALUE, f->name, "'priority' must be in [-1000000, 1000000]");
    r->priority = (int32_t)p;
    return PKV_OK;
}

static int f_cache_salt(const field_t *f, json_t *v, pkv_openai_request_t *r,
                        const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_string(v)) return bad(err, BAD_TYPE, f->name, "'cache_salt' must be a string");
    size_t len = json_string_length(v);
    if (len == 0 || len > 1024)
        return bad(err, BAD_VALUE, f->name, "'cache_salt' must be 1..1024 bytes");
    r->salt = pkv_openai_salt(json_string_value(v), len);
    return PKV_OK;
}

uint64_t pkv_openai_salt(const char *cache_salt, size_t len)
{
    /* The salt enters the prefix keys (SHA-256 chains): derive it with SHA-256 too so
     * that no tenant can pick a string that collides with another tenant's salt. */
    unsigned char md[SHA256_DIGEST_LENGTH];
    SHA256((const unsigned char *)cache_salt, len, md);
    uint64_t s = 0;
    for (int i = 0; i < 8; i++) s = s << 8 | md[i];
    return s ? s : 1;
}

static int f_add_generation_prompt(const field_t *f, json_t *v, pkv_openai_request_t *r,
                                   const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    return want_bool(f, v, &r->add_generation_prompt, err);
}

static int f_prompt(const field_t *f, json_t *v, pkv_openai_request_t *r,
                    const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    static const char *types = "'prompt' must be a string, an array of token ids, or an array "
                               "holding one string or one array of token ids";
    if (json_is_array(v) && json_array_size(v) >= 1 && !json_is_integer(json_array_get(v, 0))) {
        if (json_array_size(v) > 1)
            return bad(err, UNSUPPORTED, "prompt",
                       "batched prompts (%zu) are not supported; send one prompt per request",
                       json_array_size(v));
        v = json_array_get(v, 0); /* [ "text" ] or [ [ids] ] */
        if (json_is_array(v) && json_array_size(v) >= 1 && !json_is_integer(json_array_get(v, 0)))
            return bad(err, BAD_TYPE, "prompt", "%s", types);
    }
    if (json_is_string(v)) {
        r->prompt_text = json_string_value(v);
        r->prompt_len = json_string_length(v);
        if (!r->prompt_len) return bad(err, BAD_VALUE, "prompt", "the prompt is empty");
        return PKV_OK;
    }
    if (!json_is_array(v)) return bad(err, BAD_TYPE, "prompt", "%s", types);
    size_t n = json_array_size(v);
    if (n == 0) return bad(err, BAD_VALUE, "prompt", "the prompt is empty");
    if (n > PKV_OPENAI_MAX_PROMPT_IDS)
        return bad(err, BAD_VALUE, "prompt", "the prompt has %zu token ids (at most %u)", n,
                   PKV_OPENAI_MAX_PROMPT_IDS);
    int32_t *ids = malloc(n * sizeof(*ids));
    if (!ids) {
        pkv_openai_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
        return PKV_ERR_NOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(v, i);
        if (!json_is_integer(x)) {
            free(ids);
            return bad(err, BAD_TYPE, "prompt", "prompt token %zu is not an integer", i);
        }
        json_int_t id = json_integer_value(x);
        if (id < 0 || id > INT32_MAX) {
            free(ids);
            return bad(err, BAD_VALUE, "prompt", "prompt token %zu (%lld) is out of range", i,
                       (long long)id);
        }
        ids[i] = (int32_t)id;
    }
    r->prompt_ids = ids;
    r->n_prompt_ids = (uint32_t)n;
    return PKV_OK;
}

/* content: a string, null (assistant only), or an array of {"type": "text", "text": s}
 * parts (joined). */
static int message_content(size_t i, json_t *c, pkv_chat_role_t role, pkv_openai_request_t *r,
                           pkv_openai_error_t *err)
{
    pkv_chat_msg_t *m = &r->msgs[i];
    if (json_is_string(c)) {
        m->content = json_string_value(c);
        m->content_len = json_string_length(c);
        return PKV_OK;
    }
    if (!c || json_is_null(c)) {
        if (role != PKV_CHAT_ASSISTANT)
            return bad(err, "missing_field", "messages", "messages[%zu] has no 'content'", i);
        m->content = "";
        m->content_len = 0;
        return PKV_OK;
    }
    if (!json_is_array(c))
        return bad(err, BAD_TYPE, "messages",
                   "messages[%zu].content must be a string or an array of text parts", i);
    size_t total = 0, j;
    json_t *part;
    json_array_foreach(c, j, part)
    {
        json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(type))
            return bad(err, BAD_TYPE, "messages",
                       "messages[%zu].content[%zu] must be an object with a 'type'", i, j);
        if (strcmp(json_string_value(type), "text"))
            return bad(err, UNSUPPORTED, "messages",
                       "messages[%zu].content[%zu]: only text parts are supported", i, j);
        if (!json_is_string(text))
            return bad(err, BAD_TYPE, "messages",
                       "messages[%zu].content[%zu].text must be a string", i, j);
        total += json_string_length(text);
    }
    char *buf = malloc(total + 1);
    if (!buf) {
        pkv_openai_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
        return PKV_ERR_NOMEM;
    }
    size_t at = 0;
    json_array_foreach(c, j, part)
    {
        json_t *text = json_object_get(part, "text");
        memcpy(buf + at, json_string_value(text), json_string_length(text));
        at += json_string_length(text);
    }
    buf[at] = 0;
    r->parts[i] = buf;
    m->content = buf;
    m->content_len = at;
    return PKV_OK;
}

static int f_messages(const field_t *f, json_t *v, pkv_openai_request_t *r,
                      const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_array(v)) return bad(err, BAD_TYPE, "messages", "'messages' must be an array");
    size_t n = json_array_size(v);
    if (n == 0) return bad(err, BAD_VALUE, "messages", "'messages' is empty");
    if (n > PKV_OPENAI_MAX_MESSAGES)
        return bad(err, BAD_VALUE, "messages", "%zu messages (at most %u)", n,
                   PKV_OPENAI_MAX_MESSAGES);
    r->msgs = calloc(n, sizeof(*r->msgs));
    r->parts = calloc(n, sizeof(*r->parts));
    if (!r->msgs || !r->parts) {
        pkv_openai_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
        return PKV_ERR_NOMEM; /* the caller frees what was allocated */
    }
    r->n_msgs = n;
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(v, i);
        if (!json_is_object(m))
            return bad(err, BAD_TYPE, "messages", "messages[%zu] must be an object", i);
        const char *key;
        json_t *x;
        json_object_foreach(m, key, x)
        {
            if (strcmp(key, "role") && strcmp(key, "content") && strcmp(key, "name"))
                return bad(err, "unknown_parameter", "messages",
                           "unrecognized field 'messages[%zu].%.64s'", i, key);
        }
        json_t *role = json_object_get(m, "role"), *name = json_object_get(m, "name");
        if (!role) return bad(err, "missing_field", "messages", "messages[%zu] has no 'role'", i);
        if (!json_is_string(role))
            return bad(err, BAD_TYPE, "messages", "messages[%zu].role must be a string", i);
        if (name && !json_is_string(name) && !json_is_null(name))
            return bad(err, BAD_TYPE, "messages", "messages[%zu].name must be a string", i);
        const char *rs = json_string_value(role);
        pkv_chat_role_t cr;
        if (!strcmp(rs, "developer"))
            cr = PKV_CHAT_SYSTEM;
        else if (pkv_chat_role_parse(rs, &cr) != PKV_OK) {
            if (!strcmp(rs, "tool") || !strcmp(rs, "function"))
                return bad(err, UNSUPPORTED, "messages",
                           "messages[%zu]: role '%s' is not supported", i, rs);
            return bad(err, BAD_VALUE, "messages",
                       "messages[%zu].role must be system, developer, user or assistant", i);
        }
        r->msgs[i].role = cr;
        int rc = message_content(i, json_object_get(m, "content"), cr, r, err);
        if (rc) return rc;
    }
    return PKV_OK;
}

/* kv_transfer_params: the field's keys are type-checked (null = absent); other keys are
 * ignored (proxies add their own) except pagekv's, which only a decode leg may carry. A
 * prefill leg (do_remote_decode) must not name a producer. */
static int kvt_key(const char *key, json_t *x, pkv_openai_request_t *r, pkv_openai_error_t *err)
{
    static const struct {
        const char *key, *param;
        json_type type;
    } keys[] = {
        {"do_remote_decode", "kv_transfer_params.do_remote_decode", JSON_TRUE},
        {"do_remote_prefill", "kv_transfer_params.do_remote_prefill", JSON_TRUE},
        {"remote_engine_id", "kv_transfer_params.remote_engine_id", JSON_STRING},
        {"remote_block_ids", "kv_transfer_params.remote_block_ids", JSON_ARRAY},
        {"remote_host", "kv_transfer_params.remote_host", JSON_STRING},
        {"remote_port", "kv_transfer_params.remote_port", JSON_INTEGER},
    };
    for (size_t i = 0; i < PKV_ARRAY_LEN(keys); i++) {
        if (strcmp(key, keys[i].key)) continue;
        if (json_is_null(x)) return PKV_OK;
        bool ok = keys[i].type == JSON_TRUE ? json_is_boolean(x) : json_typeof(x) == keys[i].type;
        if (!ok)
            return bad(err, BAD_TYPE, keys[i].param, "'%s' must be %s", keys[i].param,
                       keys[i].type == JSON_TRUE     ? "a boolean"
                       : keys[i].type == JSON_STRING ? "a string"
                       : keys[i].type == JSON_ARRAY  ? "an array of block ids"
                                                     : "an integer");
        if (i == 0 && json_is_true(x)) r->kvt |= PKV_OPENAI_KVT_PREFILL;
        if (i == 1 && json_is_true(x)) r->kvt |= PKV_OPENAI_KVT_DECODE;
        return PKV_OK;
    }
    return PKV_OK;
}

static int f_kv_transfer_params(const field_t *f, json_t *v, pkv_openai_request_t *r,
                                const pkv_openai_limits_t *lim, pkv_openai_error_t *err)
{
    if (!json_is_object(v))
        return bad(err, BAD_TYPE, f->name, "'kv_transfer_params' must be an object");
    const char *key;
    json_t *x;
    r->kvt = PKV_OPENAI_KVT_NONE;
    json_object_foreach(v, key, x)
    {
        if (kvt_key(key, x, r, err)) return PKV_ERR_INVALID;
    }
    unsigned mode = r->kvt;
    if (mode == (PKV_OPENAI_KVT_PREFILL | PKV_OPENAI_KVT_DECODE))
        return bad(err, BAD_VALUE, f->name,
                   "'kv_transfer_params' sets both do_remote_decode and do_remote_prefill");
    if (mode == PKV_OPENAI_KVT_PREFILL) {
        json_object_foreach(v, key, x)
        {
            bool names_producer = !strncmp(key, "remote_", 7) || !strncmp(key, "pagekv_", 7);
            if (names_producer && !json_is_null(x))
                return bad(err, BAD_VALUE, f->name,
                           "a prefill leg (do_remote_decode) must not set "
                           "kv_transfer_params.%.64s",
                           key);
        }
    }
    r->kvt_params = mode == PKV_OPENAI_KVT_NONE ? NULL : v;
    return PKV_OK;
}

/* ---- the tables ---------------------------------------------------------------------- */

static const field_t common_fields[] = {
    {"model", f_model},
    {"max_tokens", f_max_tokens},
    {"temperature", f_temperature},
    {"top_p", f_top_p},
    {"seed", f_seed},
    {"stop", f_stop},
    {"stream", f_stream},
    {"stream_options", f_stream_options},
    {"n", f_n},
    {"logprobs", f_logprobs},
    {"frequency_penalty", f_penalty},
    {"presence_penalty", f_penalty},
    {"logit_bias", f_empty_object},
    {"user", f_string_ignored},
    {"metadata", f_object_ignored},
    {"store", f_bool_ignored},
    {"service_tier", f_string_ignored},
    {"ignore_eos", f_ignore_eos},
    {"priority", f_priority},
    {"cache_salt", f_cache_salt},
    {"kv_transfer_params", f_kv_transfer_params},
};

static const field_t completion_fields[] = {
    {"prompt", f_prompt},
    {"best_of", f_n},
    {"echo", f_false_only},
    {"suffix", f_suffix},
};

static const field_t chat_fields[] = {
    {"messages", f_messages},
    {"max_completion_tokens", f_max_tokens},
    {"top_logprobs", f_top_logprobs},
    {"response_format", f_response_format},
    {"tools", f_empty_array},
    {"functions", f_empty_array},
    {"tool_choice", f_choice_none},
    {"function_call", f_choice_none},
    {"parallel_tool_calls", f_bool_ignored},
    {"add_generation_prompt", f_add_generation_prompt},
};

static const field_t *find_field(const field_t *t, size_t n, const char *name)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(t[i].name, name)) return &t[i];
    return NULL;
}

void pkv_openai_request_free(pkv_openai_request_t *r)
{
    if (!r) return;
    if (r->parts)
        for (size_t i = 0; i < r->n_msgs; i++) free(r->parts[i]);
    free(r->parts);
    free(r->msgs);
    free(r->prompt_ids);
    json_decref((json_t *)r->doc);
    memset(r, 0, sizeof(*r));
}

int pkv_openai_request_parse(pkv_openai_kind_t kind, const char *body, size_t len,
                             const char *model_name, const pkv_openai_limits_t *lim,
                             pkv_openai_request_t *out, pkv_openai_error_t *err)
{
    if ((!body && len) || !lim || !out ||
        (kind != PKV_OPENAI_COMPLETIONS && kind != PKV_OPENAI_CHAT)) {
        pkv_openai_error_set(err, 500, "server_error", "internal_error", NULL, "bad parser call");
        return PKV_ERR_INVALID;
    }
    if (len == 0)
        return bad(err, "invalid_json", NULL, "the request body is empty (expected a JSON object)");
    json_error_t je;
    json_t *doc = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &je);
    if (!doc)
        return bad(err, "invalid_json", NULL, "malformed JSON at line %d column %d: %.120s",
                   je.line, je.column, je.text);
    pkv_openai_request_t r;
    memset(&r, 0, sizeof(r));
    r.kind = kind;
    r.doc = doc;
    r.temperature = 1.0f;
    r.top_p = 1.0f;
    r.add_generation_prompt = true;
    int rc = PKV_OK;
    if (!json_is_object(doc)) {
        rc = bad(err, "invalid_json", NULL, "the request body must be a JSON object");
        goto fail;
    }
    const field_t *kt = kind == PKV_OPENAI_CHAT ? chat_fields : completion_fields;
    size_t kn =
        kind == PKV_OPENAI_CHAT ? PKV_ARRAY_LEN(chat_fields) : PKV_ARRAY_LEN(completion_fields);
    const char *key;
    json_t *v;
    /* max_completion_tokens wins over max_tokens: check it last. */
    json_t *mct = kind == PKV_OPENAI_CHAT ? json_object_get(doc, "max_completion_tokens") : NULL;
    json_object_foreach(doc, key, v)
    {
        const field_t *f = find_field(common_fields, PKV_ARRAY_LEN(common_fields), key);
        if (!f) f = find_field(kt, kn, key);
        if (!f) {
            rc = bad(err, "unknown_parameter", NULL, "unrecognized request argument '%.64s'", key);
            goto fail;
        }
        if (json_is_null(v)) continue; /* null: as if absent */
        if (v == mct) continue;
        if ((rc = f->check(f, v, &r, lim, err))) goto fail;
    }
    if (mct && !json_is_null(mct)) {
        static const field_t f = {"max_completion_tokens", f_max_tokens};
        if ((rc = f.check(&f, mct, &r, lim, err))) goto fail;
    }
    if (!r.model) {
        rc = bad(err, "missing_field", "model", "'model' is required");
        goto fail;
    }
    if (kind == PKV_OPENAI_COMPLETIONS && !r.prompt_text && !r.prompt_ids) {
        rc = bad(err, "missing_field", "prompt", "'prompt' is required");
        goto fail;
    }
    if (kind == PKV_OPENAI_CHAT && !r.msgs) {
        rc = bad(err, "missing_field", "messages", "'messages' is required");
        goto fail;
    }
    if (!r.stream && r.include_usage) {
        rc = bad(err, BAD_VALUE, "stream_options",
                 "'stream_options' is only allowed with 'stream': true");
        goto fail;
    }
    if (model_name && strcmp(r.model, model_name)) {
        pkv_openai_error_set(err, 404, REQ_ERR, "model_not_found", "model",
                             "the model '%.100s' does not exist (this server serves '%.100s')",
                             r.model, model_name);
        rc = PKV_ERR_INVALID;
        goto fail;
    }
    *out = r;
    return PKV_OK;

fail:
    pkv_openai_request_free(&r);
    return rc ? rc : PKV_ERR_INVALID;
}

int pkv_openai_lookup_parse(const char *body, size_t len, const char *model_name,
                            const pkv_openai_limits_t *lim, pkv_openai_request_t *out,
                            pkv_openai_error_t *err)
{
    json_t *doc = body && len ? json_loadb(body, len, JSON_ALLOW_NUL, NULL) : NULL;
    bool chat = json_is_object(doc) && json_object_get(doc, "messages");
    json_decref(doc);
    return pkv_openai_request_parse(chat ? PKV_OPENAI_CHAT : PKV_OPENAI_COMPLETIONS, body, len,
                                    model_name, lim, out, err);
}

int pkv_openai_request_prompt(const pkv_openai_request_t *r, const pkv_tok_t *tok,
                              const pkv_openai_limits_t *lim, uint32_t default_max_tokens,
                              int32_t **ids_out, uint32_t *n_out, uint32_t *max_tokens_out,
                              pkv_openai_error_t *err)
{
    int32_t *ids = NULL;
    size_t n = 0;
    int rc;
    if (r->kind == PKV_OPENAI_CHAT) {
        rc = pkv_tok_chat_template(tok, r->msgs, r->n_msgs, r->add_generation_prompt, &ids, &n);
        if (rc == PKV_ERR_INVALID)
            return bad(
                err, BAD_VALUE, "messages",
                "the chat template refused the messages (a system message may only come first)");
    } else if (r->prompt_ids) {
        int32_t vocab = pkv_tok_vocab_size(tok);
        for (uint32_t i = 0; i < r->n_prompt_ids; i++)
            if (r->prompt_ids[i] >= vocab)
                return bad(err, BAD_VALUE, "prompt",
                           "prompt token %u (%d) is outside the vocabulary (%d ids)", i,
                           r->prompt_ids[i], vocab);
        n = r->n_prompt_ids;
        ids = malloc(n * sizeof(*ids));
        rc = ids ? PKV_OK : PKV_ERR_NOMEM;
        if (ids) memcpy(ids, r->prompt_ids, n * sizeof(*ids));
    } else {
        rc = pkv_tok_encode_alloc(tok, r->prompt_text, r->prompt_len, true, &ids, &n);
    }
    if (rc) {
        pkv_openai_error_set(err, 500, "server_error", "internal_error", NULL,
                             "tokenizing the prompt failed: %s", pkv_status_str(rc));
        return rc;
    }
    const char *param = r->kind == PKV_OPENAI_CHAT ? "messages" : "prompt";
    uint32_t ctx = lim->max_context, mt;
    if (n == 0) {
        free(ids);
        return bad(err, BAD_VALUE, param, "the prompt is empty");
    }
    if (r->has_max_tokens) {
        mt = r->max_tokens;
        if ((uint64_t)n + mt > ctx) {
            free(ids);
            return bad(err, "context_length_exceeded", param,
                       "this model's maximum context length is %u tokens; the request needs %llu "
                       "(%zu in the prompt, %u for the completion)",
                       ctx, (unsigned long long)n + mt, n, mt);
        }
    } else {
        if (n >= ctx) {
            free(ids);
            return bad(err, "context_length_exceeded", param,
                       "this model's maximum context length is %u tokens; the prompt has %zu, "
                       "leaving no room for a completion",
                       ctx, n);
        }
        uint32_t room = ctx - (uint32_t)n;
        mt = r->kind == PKV_OPENAI_CHAT ? room : PKV_MIN(PKV_MAX(default_max_tokens, 1u), room);
    }
    *ids_out = ids;
    *n_out = (uint32_t)n;
    *max_tokens_out = mt;
    return PKV_OK;
}
