/*
 * engine: generation against a direct model loop, stop conditions (max_tokens, EOS,
 * stop strings with held-back text, UTF-8 boundaries), bad input, the bounded queue,
 * cancellation, priorities, the preemption victim order, seeded sampling, prefix hits,
 * notify callbacks, drain and destroy with live requests, the sampler itself, and
 * create and submit under simulated allocation and thread-creation failures.
 */
#include "tests/support/testutil.h"

#include "engine/engine.h"
#include "pagekv/engine.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define VOCAB 64u

typedef struct {
    pkv_model_t *m;
    pkv_kv_t *kv;
    pkv_engine_t *e;
} rig_t;

static pkv_model_t *tiny_model(void)
{
    pkv_model_config_t c;
    ck_assert_int_eq(pkv_model_preset("tiny", &c), PKV_OK);
    c.vocab_size = VOCAB;
    c.max_seq_len = 512;
    pkv_model_t *m = NULL;
    ck_assert_int_eq(pkv_model_create_builtin(&c, 11, NULL, &m), PKV_OK);
    return m;
}

static pkv_kv_t *make_kv(pkv_model_t *m, pkv_backend_t be, uint64_t budget, bool no_cache)
{
    pkv_kv_config_t kc = {
        .backend = be, .budget_bytes = budget, .no_prefix_cache = no_cache, .granule_bytes = 4096};
    pkv_model_geometry(m, PKV_DTYPE_F32, 4, &kc.geo);
    pkv_kv_t *kv = NULL;
    ck_assert_int_eq(pkv_kv_create(&kc, &kv), PKV_OK);
    return kv;
}

/* The paged cache's sizes for the tiny model (token_bytes, block_bytes), to size budgets. */
static pkv_kv_stats_t tiny_paged_stats(void)
{
    pkv_model_t *m = tiny_model();
    pkv_kv_t *kv = make_kv(m, PKV_BACKEND_PAGED, 0, false);
    pkv_kv_stats_t ks;
    pkv_kv_stats(kv, &ks);
    pkv_kv_destroy(kv);
    pkv_model_destroy(m);
    return ks;
}

/* Token i decodes to a letter, except: 60 -> "STOP", 61/62 -> the two halves of "é"
 * (0xC3 0xA9), 63 -> "\n". */
static int test_detok(void *arg, int32_t prev, int32_t id, const char **bytes, size_t *len)
{
    (void)arg;
    (void)prev;
    static const char letters[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    static const char e1[] = "\xc3", e2[] = "\xa9";
    if (id < 0 || id >= (int32_t)VOCAB) return PKV_ERR_INVALID;
    if (id == 60)
        *bytes = "STOP", *len = 4;
    else if (id == 61)
        *bytes = e1, *len = 1;
    else if (id == 62)
        *bytes = e2, *len = 1;
    else if (id == 63)
        *bytes = "\n", *len = 1;
    else
        *bytes = &letters[id], *len = 1;
    return PKV_OK;
}

static void rig_init(rig_t *r, pkv_backend_t be, uint64_t budget, pkv_engine_config_t ec)
{
    r->m = tiny_model();
    r->kv = make_kv(r->m, be, budget, false);
    ec.model = r->m;
    ec.kv = r->kv;
    if (!ec.detok) {
        ec.detok = test_detok;
    }
    ck_assert_int_eq(pkv_engine_create(&ec, &r->e), PKV_OK);
}

static void rig_fini(rig_t *r)
{
    pkv_engine_destroy(r->e);
    pkv_kv_stats_t st;
    pkv_kv_stats(r->kv, &st);
    ck_assert_uint_eq(st.sequences, 0);
    ck_assert_int_eq(pkv_kv_validate(r->kv), PKV_OK);
    pkv_kv_destroy(r->kv);
    pkv_model_destroy(r->m);
}

/* Read everything until finished. */
typedef struct {
    int32_t toks[512];
    uint32_t n;
    char text[4096];
    size_t text_len;
    pkv_request_output_t last;
    uint32_t reads;
} collected_t;

static void collect(pkv_request_t *q, collected_t *c)
{
    memset(c, 0, sizeof(*c));
    for (;;) {
        pkv_request_output_t o;
        ck_assert_int_eq(pkv_request_read(q, pkv_deadline_after_ns(60ull * 1000000000), &o),
                         PKV_OK);
        c->reads++;
        ck_assert_uint_le(c->n + o.n_tokens, 512);
        memcpy(c->toks + c->n, o.tokens, o.n_tokens * sizeof(int32_t));
        c->n += o.n_tokens;
        ck_assert_uint_le(c->text_len + o.text_len, sizeof(c->text));
        memcpy(c->text + c->text_len, o.text, o.text_len);
        c->text_len += o.text_len;
        c->last = o;
        if (o.finished) return;
    }
}

/* Greedy tokens by calling the model directly. */
static void direct_greedy(pkv_model_t *m, const int32_t *prompt, uint32_t n, uint32_t gen,
                          int32_t *out)
{
    pkv_kv_t *kv = make_kv(m, PKV_BACKEND_DENSE, 0, true);
    pkv_seq_params_t sp = {.tokens = prompt, .n_tokens = n, .reserve_tokens = n + gen};
    pkv_seq_t *s;
    uint32_t cached;
    ck_assert_int_eq(pkv_seq_create(kv, &sp, &s, &cached), PKV_OK);
    float logits[VOCAB];
    pkv_model_item_t it = {.seq = s, .tokens = prompt, .n_tokens = n, .logits = logits};
    ck_assert_int_eq(pkv_model_forward(m, kv, &it, 1), PKV_OK);
    for (uint32_t i = 0; i < gen; i++) {
        out[i] = pkv_engine_sample_argmax(logits, VOCAB);
        it = (pkv_model_item_t){.seq = s, .tokens = &out[i], .n_tokens = 1, .logits = logits};
        if (i + 1 < gen) ck_assert_int_eq(pkv_model_forward(m, kv, &it, 1), PKV_OK);
    }
    pkv_seq_free(s);
    pkv_kv_destroy(kv);
}

static void make_prompt(int32_t *p, uint32_t n, uint64_t seed)
{
    uint64_t s = seed;
    for (uint32_t i = 0; i < n; i++) p[i] = (int32_t)pkv_test_below(&s, 60);
}

START_TEST(greedy_matches_direct_model)
{
    for (int be = 0; be < 2; be++) {
        rig_t r;
        rig_init(&r, be, 0, (pkv_engine_config_t){.prefill_chunk = 7});
        int32_t prompt[30], want[20];
        make_prompt(prompt, 30, 1);
        direct_greedy(r.m, prompt, 30, 20, want);
        pkv_request_params_t p = {.prompt = prompt, .n_prompt = 30, .max_tokens = 20};
        pkv_request_t *q;
        ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_OK);
        collected_t c;
        collect(q, &c);
        ck_assert_uint_eq(c.n, 20);
        ck_assert_mem_eq(c.toks, want, sizeof(want));
        ck_assert_int_eq(c.last.finish, PKV_FINISH_LENGTH);
        ck_assert_str_eq(pkv_finish_name(c.last.finish), "length");
        ck_assert_uint_eq(c.last.prompt_tokens, 30);
        ck_assert_uint_eq(c.last.completion_tokens, 20);
        char text[128];
        size_t tl = 0;
        for (int i = 0; i < 20; i++) {
            const char *b;
            size_t l;
            ck_assert_int_eq(test_detok(NULL, -1, want[i], &b, &l), PKV_OK);
            memcpy(text + tl, b, l);
            tl += l;
        }
        ck_assert_uint_eq(c.text_len, tl);
        ck_assert_mem_eq(c.text, text, tl);
        pkv_request_release(q);
        pkv_engine_stats_t st;
        pkv_engine_stats(r.e, &st);
        ck_assert_uint_eq(st.generated_tokens, 20);
        ck_assert_uint_eq(st.finished_length, 1);
        rig_fini(&r);
    }
}
END_TEST

START_TEST(eos_stops)
{
    rig_t r;
    int32_t prompt[10], want[12];
    pkv_model_t *m = tiny_model();
    make_prompt(prompt, 10, 2);
    direct_greedy(m, prompt, 10, 12, want);
    pkv_model_destroy(m);
    /* The 6th greedy token is EOS: generation stops there, with it. */
    rig_init(&r, PKV_BACKEND_PAGED, 0, (pkv_engine_config_t){.eos_ids = &want[5], .n_eos_ids = 1});
    uint32_t first = 0;
    while (want[first] != want[5]) first++;
    pkv_request_params_t p = {.prompt = prompt, .n_prompt = 10, .max_tokens = 12};
    pkv_request_t *q;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_OK);
    collected_t c;
    collect(q, &c);
    ck_assert_int_eq(c.last.finish, PKV_FINISH_STOP);
    ck_assert_uint_eq(c.n, first + 1);
    pkv_request_release(q);
    /* ignore_eos runs to max_tokens. */
    p.ignore_eos = true;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_OK);
    collect(q, &c);
    ck_assert_int_eq(c.last.finish, PKV_FINISH_LENGTH);
    ck_assert_uint_eq(c.n, 12);
    ck_assert_mem_eq(c.toks, want, sizeof(want));
    pkv_request_release(q);
    rig_fini(&r);
}
END_TEST

/* A detok that spells fixed text per generated position, so stop strings can be placed. */
typedef struct {
    const char *pieces[16];
} script_t;
static _Atomic int script_pos;
static int script_detok(void *arg, int32_t prev, int32_t id, const char **bytes, size_t *len)
{
    (void)prev;
    (void)id;
    const script_t *s = arg;
    int i = atomic_fetch_add(&script_pos, 1);
    *bytes = s->pieces[i < 16 && s->pieces[i] ? i : 15] ? s->pieces[i] : "";
    *len = strlen(*bytes);
    return PKV_OK;
}

START_TEST(stop_strings_hold_back_and_cut)
{
    script_t sc = {{"he", "ll", "o <", "|e", "n", "d|> tail", "x", "x", "x", "x", "x", "x", "x",
                    "x", "x", "x"}};
    atomic_store(&script_pos, 0);
    pkv_engine_config_t ec = {.detok = script_detok, .detok_arg = &sc, .manual = true};
    rig_t r;
    rig_init(&r, PKV_BACKEND_PAGED, 0, ec);
    int32_t prompt[5] = {1, 2, 3, 4, 5};
    const char *stops[2] = {"<|end|>", "zzz"};
    pkv_request_params_t p = {
        .prompt = prompt, .n_prompt = 5, .max_tokens = 16, .stop = stops, .n_stop = 2};
    pkv_request_t *q;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_OK);
    /* Step by step: text that could begin "<|end|>" is never published early. */
    char seen[256] = "";
    size_t seen_len = 0;
    bool busy = true, finished = false;
    while (busy) {
        ck_assert_int_eq(pkv_engine_step(r.e, &busy), PKV_OK);
        pkv_request_output_t o;
        if (pkv_request_read(q, 0, &o) == PKV_OK) {
            memcpy(seen + seen_len, o.text, o.text_len);
            seen_len += o.text_len;
            seen[seen_len] = 0;
            ck_assert_ptr_null(strchr(seen, '<'));
            if (o.finished) {
                finished = true;
                ck_assert_int_eq(o.finish, PKV_FINISH_STOP);
                ck_assert_uint_eq(o.completion_tokens, 6);
            }
        }
    }
    ck_assert(finished);
    ck_assert_str_eq(seen, "hello ");
    pkv_request_release(q);
    rig_fini(&r);
}
END_TEST

START_TEST(utf8_never_split)
{
    /* Force the model's output through a detok where tokens 61, 62 are halves of one
     * character: check every read ends on a boundary by generating with a script. */
    script_t sc = {{"a", "\xc3", "\xa9", "b", "\xe2\x82", "\xac", "c", "\xf0\x9f", "\x98", "\x80",
                    "d", "d", "d", "d", "d", "d"}};
    atomic_store(&script_pos, 0);
    pkv_engine_config_t ec = {.detok = script_detok, .detok_arg = &sc, .manual = true};
    rig_t r;
    rig_init(&r, PKV_BACKEND_DENSE, 0, ec);
    int32_t prompt[3] = {7, 8, 9};
    pkv_request_params_t p = {.prompt = prompt, .n_prompt = 3, .max_tokens = 11};
    pkv_request_t *q;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_OK);
    char all[64];
    size_t n = 0;
    bool busy = true;
    while (busy) {
        ck_assert_int_eq(pkv_engine_step(r.e, &busy), PKV_OK);
        pkv_request_output_t o;
        if (pkv_request_read(q, 0, &o) == PKV_OK && o.text_len) {
            memcpy(all + n, o.text, o.text_len);
            n += o.text_len;
            /* What was published so far ends on a character boundary. */
            size_t i = 0;
            while (i < n) {
                unsigned char c = (unsigned char)all[i];
                size_t need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
                ck_assert_msg(i + need <= n, "read ended inside a UTF-8 sequence at byte %zu", i);
                i += need;
            }
        }
    }
    all[n] = 0;
    ck_assert_str_eq(all, "a\xc3\xa9"
                          "b\xe2\x82\xac"
                          "c\xf0\x9f\x98\x80"
                          "d");
    pkv_request_release(q);
    rig_fini(&r);
}
END_TEST

START_TEST(bad_requests_rejected)
{
    pkv_log_set_level(PKV_LOG_ERROR);
    rig_t r;
    rig_init(&r, PKV_BACKEND_PAGED, 0, (pkv_engine_config_t){.manual = true, .max_queue = 2});
    int32_t prompt[4] = {1, 2, 3, 4}, bad[2] = {1, (int32_t)VOCAB};
    pkv_request_t *q = NULL;
    pkv_request_params_t ok = {.prompt = prompt, .n_prompt = 4, .max_tokens = 4};
    pkv_request_params_t p = ok;
    p.n_prompt = 0;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    p = ok, p.max_tokens = 0;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    p = ok, p.max_tokens = 600; /* beyond max_seq_len 512 */
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    p = ok, p.prompt = bad, p.n_prompt = 2;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    p = ok, p.temperature = -1;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    p = ok, p.temperature = NAN;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    p = ok, p.top_p = 1.5f;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    const char *stops[5] = {"a", "b", "c", "d", "e"}, *empty[1] = {""};
    p = ok, p.stop = stops, p.n_stop = 5;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    p = ok, p.stop = empty, p.n_stop = 1;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    ck_assert_ptr_null(q);
    /* The queue holds 2; the third is BUSY. */
    pkv_request_t *a, *b;
    ck_assert_int_eq(pkv_engine_submit(r.e, &ok, &a), PKV_OK);
    ck_assert_int_eq(pkv_engine_submit(r.e, &ok, &b), PKV_OK);
    ck_assert_int_eq(pkv_engine_submit(r.e, &ok, &q), PKV_ERR_BUSY);
    pkv_engine_stats_t st;
    pkv_engine_stats(r.e, &st);
    ck_assert_uint_eq(st.queued, 2);
    ck_assert_uint_eq(st.rejected_busy, 1);
    /* Drain finishes both, then submit is refused. */
    ck_assert_int_eq(pkv_engine_drain(r.e, pkv_deadline_after_ns(60ull * 1000000000)), PKV_OK);
    ck_assert_int_eq(pkv_engine_submit(r.e, &ok, &q), PKV_ERR_SHUTDOWN);
    collected_t c;
    collect(a, &c);
    ck_assert_int_eq(c.last.finish, PKV_FINISH_LENGTH);
    pkv_request_release(a);
    pkv_request_release(b);
    rig_fini(&r);
}
END_TEST

START_TEST(nofit_prompt)
{
    pkv_log_set_level(PKV_LOG_ERROR);
    uint64_t token_bytes = tiny_paged_stats().token_bytes;
    rig_t r;
    /* Room for ~100 tokens: a 300-token prompt can never fit. */
    rig_init(&r, PKV_BACKEND_PAGED, 100 * token_bytes, (pkv_engine_config_t){.manual = true});
    int32_t prompt[300];
    make_prompt(prompt, 300, 3);
    pkv_request_params_t p = {.prompt = prompt, .n_prompt = 300, .max_tokens = 4};
    pkv_request_t *q = NULL;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_NOFIT);
    ck_assert_ptr_null(q);
    rig_fini(&r);
}
END_TEST

START_TEST(cancel_queued_and_running)
{
    rig_t r;
    rig_init(&r, PKV_BACKEND_PAGED, 0, (pkv_engine_config_t){.manual = true, .max_batch_size = 1});
    int32_t prompt[8];
    make_prompt(prompt, 8, 4);
    pkv_request_params_t p = {.prompt = prompt, .n_prompt = 8, .max_tokens = 100};
    pkv_request_t *a, *b;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &a), PKV_OK);
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &b), PKV_OK);
    bool busy;
    ck_assert_int_eq(pkv_engine_step(r.e, &busy), PKV_OK);
    pkv_engine_stats_t st;
    pkv_engine_stats(r.e, &st);
    ck_assert_uint_eq(st.running, 1);
    ck_assert_uint_eq(st.queued, 1);
    /* b is queued: finished at once. */
    pkv_request_cancel(b);
    pkv_request_output_t o;
    ck_assert_int_eq(pkv_request_read(b, 0, &o), PKV_OK);
    ck_assert(o.finished);
    ck_assert_int_eq(o.finish, PKV_FINISH_CANCELLED);
    /* a is running: its sequence is freed at the next step. */
    pkv_kv_stats_t ks;
    pkv_kv_stats(r.kv, &ks);
    ck_assert_uint_eq(ks.sequences, 1);
    pkv_request_release(a); /* release implies cancel */
    ck_assert_int_eq(pkv_engine_step(r.e, &busy), PKV_OK);
    ck_assert(!busy);
    pkv_kv_stats(r.kv, &ks);
    ck_assert_uint_eq(ks.sequences, 0);
    pkv_engine_stats(r.e, &st);
    ck_assert_uint_eq(st.finished_cancelled, 2);
    ck_assert_uint_eq(st.running, 0);
    pkv_request_release(b);
    rig_fini(&r);
}
END_TEST

START_TEST(priority_admits_first)
{
    rig_t r;
    rig_init(&r, PKV_BACKEND_PAGED, 0, (pkv_engine_config_t){.manual = true, .max_batch_size = 1});
    int32_t prompt[6];
    make_prompt(prompt, 6, 5);
    pkv_request_params_t p = {.prompt = prompt, .n_prompt = 6, .max_tokens = 3};
    pkv_request_t *lo, *hi;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &lo), PKV_OK);
    p.priority = 5;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &hi), PKV_OK);
    bool busy = true;
    pkv_request_output_t o;
    while (busy) {
        ck_assert_int_eq(pkv_engine_step(r.e, &busy), PKV_OK);
        if (pkv_request_read(hi, 0, &o) == PKV_OK && o.finished) break;
        ck_assert_int_eq(pkv_request_read(lo, 0, &o), PKV_ERR_TIMEOUT); /* not started */
    }
    ck_assert_int_eq(pkv_engine_drain(r.e, pkv_deadline_after_ns(60ull * 1000000000)), PKV_OK);
    pkv_request_release(lo);
    pkv_request_release(hi);
    rig_fini(&r);
}
END_TEST

/* Three requests share a budget that holds two grown sequences: the victim is the lowest
 * priority, then the one with fewer generated tokens, then the newest; the last running
 * request is never preempted; outputs equal the unpressured run. */
START_TEST(preemption_victim_order)
{
    uint64_t block = tiny_paged_stats().block_bytes;
    pkv_model_t *m0 = tiny_model();
    int32_t prompts[3][8], want[3][40];
    for (int i = 0; i < 3; i++) {
        make_prompt(prompts[i], 8, 10 + i);
        direct_greedy(m0, prompts[i], 8, 40, want[i]);
    }
    pkv_model_destroy(m0);
    /* Blocks hold 4 tokens: each request grows to 48 positions = 12 blocks. 26 blocks fit
     * two whole requests, not three. */
    rig_t r;
    rig_init(&r, PKV_BACKEND_PAGED, 26 * block,
             (pkv_engine_config_t){.manual = true, .max_batch_size = 3});
    int32_t prio[3] = {1, 0, 1};
    pkv_request_t *q[3];
    for (int i = 0; i < 3; i++) {
        pkv_request_params_t p = {
            .prompt = prompts[i], .n_prompt = 8, .max_tokens = 40, .priority = prio[i]};
        ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q[i]), PKV_OK);
    }
    bool busy = true;
    uint32_t first_victim_preempts[3] = {0};
    while (busy) {
        ck_assert_int_eq(pkv_engine_step(r.e, &busy), PKV_OK);
        pkv_engine_stats_t st;
        pkv_engine_stats(r.e, &st);
        ck_assert_uint_le(st.running, 3);
        if (st.preemptions == 1 && !first_victim_preempts[0] && !first_victim_preempts[1] &&
            !first_victim_preempts[2]) {
            for (int i = 0; i < 3; i++) {
                pkv_request_output_t o;
                if (pkv_request_read(q[i], 0, &o) == PKV_OK)
                    first_victim_preempts[i] = o.preemptions;
            }
        }
    }
    /* The priority-0 request went first. */
    ck_assert_uint_eq(first_victim_preempts[1], 1);
    pkv_engine_stats_t st;
    pkv_engine_stats(r.e, &st);
    ck_assert_uint_ge(st.preemptions, 1);
    ck_assert_uint_gt(st.recompute_tokens, 0);
    for (int i = 0; i < 3; i++) {
        collected_t c;
        collect(q[i], &c);
        ck_assert_int_eq(c.last.finish, PKV_FINISH_LENGTH);
        pkv_request_output_t o = c.last;
        (void)o;
        pkv_request_release(q[i]);
    }
    rig_fini(&r);
}
END_TEST

/* Alone and out of room: the last running request is not preempted (it would only be
 * recomputed into the same wall); it finishes with an error and keeps its tokens. */
START_TEST(last_running_not_preempted)
{
    pkv_log_set_level(PKV_LOG_ERROR);
    uint64_t block = tiny_paged_stats().block_bytes;
    rig_t r;
    rig_init(&r, PKV_BACKEND_PAGED, 8 * block, (pkv_engine_config_t){.manual = true});
    int32_t prompt[10];
    make_prompt(prompt, 10, 9);
    pkv_request_params_t p = {.prompt = prompt, .n_prompt = 10, .max_tokens = 100};
    pkv_request_t *q;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_OK);
    ck_assert_int_eq(pkv_engine_drain(r.e, pkv_deadline_after_ns(60ull * 1000000000)), PKV_OK);
    collected_t c;
    collect(q, &c);
    ck_assert_int_eq(c.last.finish, PKV_FINISH_ERROR);
    ck_assert_int_eq(c.last.status, PKV_ERR_NOFIT); /* the pool knows it can never fit */
    ck_assert_uint_eq(c.n, 8 * 4 - 10 + 1); /* 32 positions computed, plus the last sample */
    ck_assert_uint_eq(c.last.preemptions, 0);
    pkv_engine_stats_t st;
    pkv_engine_stats(r.e, &st);
    ck_assert_uint_eq(st.preemptions, 0);
    pkv_request_release(q);
    rig_fini(&r);
}
END_TEST

/* Run two equal-priority requests under a budget that forces one preemption; return
 * the index of the first victim. */
static int first_victim(const uint32_t n_prompt[2], uint64_t budget_blocks)
{
    pkv_kv_stats_t ks = tiny_paged_stats();
    rig_t r;
    rig_init(&r, PKV_BACKEND_PAGED, budget_blocks * ks.block_bytes,
             (pkv_engine_config_t){.manual = true, .prefill_chunk = 4, .step_tokens = 8});
    pkv_request_t *q[2];
    int32_t prompt[2][32];
    for (int i = 0; i < 2; i++) {
        make_prompt(prompt[i], n_prompt[i], 30 + (uint64_t)i);
        pkv_request_params_t p = {.prompt = prompt[i], .n_prompt = n_prompt[i], .max_tokens = 40};
        ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q[i]), PKV_OK);
    }
    int victim = -1;
    bool busy = true;
    while (busy && victim < 0) {
        ck_assert_int_eq(pkv_engine_step(r.e, &busy), PKV_OK);
        for (int i = 0; i < 2; i++) {
            pkv_request_output_t o;
            if (pkv_request_read(q[i], 0, &o) == PKV_OK && o.preemptions) victim = i;
        }
    }
    for (int i = 0; i < 2; i++) pkv_request_release(q[i]);
    rig_fini(&r);
    return victim;
}

START_TEST(preemption_fewest_generated_then_newest)
{
    /* The older request has a long prompt (prefilled 4 tokens a step) and so fewer
     * generated tokens when memory runs out: it is the victim, not the newer one. */
    uint32_t skewed[2] = {24, 4};
    ck_assert_int_eq(first_victim(skewed, 20), 0);
    /* Same prompt lengths: both generated the same count; the newest goes. */
    uint32_t even[2] = {8, 8};
    ck_assert_int_eq(first_victim(even, 20), 1);
}
END_TEST

START_TEST(seeded_sampling_is_reproducible)
{
    rig_t r;
    rig_init(&r, PKV_BACKEND_PAGED, 0, (pkv_engine_config_t){0});
    int32_t prompt[12];
    make_prompt(prompt, 12, 6);
    collected_t c[3];
    uint64_t seeds[3] = {99, 99, 100};
    for (int i = 0; i < 3; i++) {
        pkv_request_params_t p = {.prompt = prompt,
                                  .n_prompt = 12,
                                  .max_tokens = 30,
                                  .temperature = 1.5f,
                                  .top_p = 0.95f,
                                  .seed = seeds[i]};
        pkv_request_t *q;
        ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_OK);
        collect(q, &c[i]);
        pkv_request_release(q);
    }
    ck_assert_uint_eq(c[0].n, 30);
    ck_assert_mem_eq(c[0].toks, c[1].toks, 30 * sizeof(int32_t));
    ck_assert(memcmp(c[0].toks, c[2].toks, 30 * sizeof(int32_t)) != 0);
    rig_fini(&r);
}
END_TEST

START_TEST(prefix_hits_reported)
{
    rig_t r;
    rig_init(&r, PKV_BACKEND_PAGED, 0, (pkv_engine_config_t){0});
    int32_t prompt[41];
    make_prompt(prompt, 41, 7);
    collected_t c[2];
    for (int i = 0; i < 2; i++) {
        pkv_request_params_t p = {.prompt = prompt, .n_prompt = 41, .max_tokens = 5};
        pkv_request_t *q;
        ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_OK);
        collect(q, &c[i]);
        pkv_request_release(q);
    }
    ck_assert_uint_eq(c[0].last.cached_tokens, 0);
    ck_assert_uint_eq(c[1].last.cached_tokens, 40); /* 10 full blocks of 4 */
    ck_assert_mem_eq(c[0].toks, c[1].toks, 5 * sizeof(int32_t));
    pkv_engine_stats_t st;
    pkv_engine_stats(r.e, &st);
    ck_assert_uint_eq(st.cached_tokens, 40);
    ck_assert_uint_eq(st.prompt_tokens, 82);
    rig_fini(&r);
}
END_TEST

/* params.seq: a sequence holding the prompt's first 39 of 41 positions (9 whole blocks of
 * 4 and a partial one, written by the model, as a decode leg's pull leaves it) is taken at
 * admission: the engine computes only the rest, and the tokens are the ones computed from
 * scratch. A given sequence that leaves nothing to compute is refused (the caller keeps
 * it); one whose request is cancelled before admission is freed with it. */
START_TEST(given_sequence_continues_the_prompt)
{
    rig_t r;
    rig_init(&r, PKV_BACKEND_PAGED, 0, (pkv_engine_config_t){0});
    int32_t prompt[41], want[6];
    make_prompt(prompt, 41, 11);
    direct_greedy(r.m, prompt, 41, 6, want);
    pkv_seq_params_t sp = {.tokens = prompt, .n_tokens = 41};
    pkv_seq_t *seq;
    uint32_t cached;
    ck_assert_int_eq(pkv_seq_create(r.kv, &sp, &seq, &cached), PKV_OK);
    ck_assert_uint_eq(cached, 0);
    pkv_model_item_t it = {.seq = seq, .tokens = prompt, .n_tokens = 39};
    ck_assert_int_eq(pkv_model_forward(r.m, r.kv, &it, 1), PKV_OK);
    ck_assert_uint_eq(pkv_seq_length(seq), 39);
    pkv_request_params_t p = {.prompt = prompt, .n_prompt = 39, .max_tokens = 6, .seq = seq};
    pkv_request_t *q;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID); /* nothing left */
    p.n_prompt = 41;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_OK);
    collected_t c;
    collect(q, &c);
    pkv_request_release(q);
    ck_assert_uint_eq(c.n, 6);
    ck_assert_mem_eq(c.toks, want, sizeof(want));
    ck_assert_uint_eq(c.last.cached_tokens, 39);
    pkv_engine_stats_t st;
    pkv_engine_stats(r.e, &st);
    ck_assert_uint_eq(st.cached_tokens, 39);
    rig_fini(&r);

    rig_init(&r, PKV_BACKEND_PAGED, 0, (pkv_engine_config_t){.manual = true});
    ck_assert_int_eq(pkv_seq_create(r.kv, &sp, &seq, &cached), PKV_OK);
    p.seq = seq;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_OK);
    pkv_request_release(q); /* queued, never admitted: the sequence goes with it */
    pkv_kv_stats_t ks;
    pkv_kv_stats(r.kv, &ks);
    ck_assert_uint_eq(ks.sequences, 0);
    rig_fini(&r);
}
END_TEST

/* A sequence of the whole prompt with its first token sampled elsewhere (a disaggregated
 * prefill node's): the output is the one the engine gives computing the prompt itself,
 * greedy and seeded (the RNG advanced past the first draw); EOS and max_tokens 1 finish at
 * admission; bad combinations are refused. */
/* One request, collected: first < 0 computes the prompt; otherwise a sequence of the whole
 * prompt is given with first as its first token. */
static void run_given_first(rig_t *r, const int32_t *prompt, uint32_t n, float temp, uint64_t seed,
                            int32_t first, uint32_t max_tokens, bool ignore_eos, collected_t *c)
{
    pkv_seq_t *seq = NULL;
    if (first >= 0) {
        pkv_seq_params_t sp = {.tokens = prompt, .n_tokens = n};
        uint32_t cached;
        ck_assert_int_eq(pkv_seq_create(r->kv, &sp, &seq, &cached), PKV_OK);
        pkv_model_item_t it = {.seq = seq, .tokens = prompt + cached, .n_tokens = n - cached};
        ck_assert_int_eq(pkv_model_forward(r->m, r->kv, &it, 1), PKV_OK);
    }
    pkv_request_params_t p = {.prompt = prompt,
                              .n_prompt = n,
                              .max_tokens = max_tokens,
                              .temperature = temp,
                              .seed = seed,
                              .ignore_eos = ignore_eos,
                              .seq = seq,
                              .first_given = first >= 0,
                              .first_token = first};
    pkv_request_t *q;
    ck_assert_int_eq(pkv_engine_submit(r->e, &p, &q), PKV_OK);
    collect(q, c);
    pkv_request_release(q);
}

START_TEST(given_first_token_continues_as_sampled)
{
    rig_t r;
    int32_t eos = 2;
    rig_init(&r, PKV_BACKEND_PAGED, 0, (pkv_engine_config_t){.eos_ids = &eos, .n_eos_ids = 1});
    int32_t prompt[41];
    make_prompt(prompt, 41, 13);
    collected_t a, b;
    for (int k = 0; k < 2; k++) {
        float temp = k ? 0.9f : 0.0f;
        run_given_first(&r, prompt, 41, temp, 77, -1, 6, true, &a);
        ck_assert_uint_eq(a.n, 6);
        run_given_first(&r, prompt, 41, temp, 77, a.toks[0], 6, true, &b);
        ck_assert_uint_eq(b.n, 6);
        ck_assert_mem_eq(b.toks, a.toks, sizeof(int32_t) * 6);
        ck_assert_int_eq(b.last.finish, PKV_FINISH_LENGTH);
        ck_assert_uint_eq(b.last.cached_tokens, 41);
        ck_assert_uint_eq(b.last.completion_tokens, 6);
    }
    /* A first token that is not what the prompt gives still starts the output (the engine
     * trusts its caller, whose check binds the token to the prompt). */
    run_given_first(&r, prompt, 41, 0.0f, 0, 5, 6, true, &b);
    ck_assert_int_eq(b.toks[0], 5);
    run_given_first(&r, prompt, 41, 0.0f, 0, eos, 6, false, &b);
    ck_assert_uint_eq(b.n, 1);
    ck_assert_int_eq(b.last.finish, PKV_FINISH_STOP);
    run_given_first(&r, prompt, 41, 0.0f, 0, a.toks[0], 1, true, &b);
    ck_assert_uint_eq(b.n, 1);
    ck_assert_int_eq(b.last.finish, PKV_FINISH_LENGTH);
    pkv_kv_stats_t ks;
    pkv_kv_stats(r.kv, &ks);
    ck_assert_uint_eq(ks.sequences, 0);

    /* Refused: no sequence, a sequence short of the prompt, a token outside the vocabulary,
     * want_logits. */
    pkv_seq_params_t sp = {.tokens = prompt, .n_tokens = 40};
    pkv_seq_t *seq;
    uint32_t cached;
    ck_assert_int_eq(pkv_seq_create(r.kv, &sp, &seq, &cached), PKV_OK);
    pkv_model_item_t it = {.seq = seq, .tokens = prompt + cached, .n_tokens = 40 - cached};
    ck_assert_int_eq(pkv_model_forward(r.m, r.kv, &it, 1), PKV_OK);
    pkv_request_params_t p = {
        .prompt = prompt, .n_prompt = 41, .max_tokens = 4, .first_given = true, .first_token = 1};
    pkv_request_t *q;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    p.seq = seq; /* 40 of 41 positions */
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    p.n_prompt = 40, p.first_token = (int32_t)VOCAB;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    p.first_token = -1;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    p.first_token = 1, p.want_logits = true;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    pkv_seq_free(seq);
    rig_fini(&r);
}
END_TEST

/* keep_blocks: a finished request's prompt blocks stay pinned until its release, then
 * the full ones are ordinary prefix-cache blocks; cancelled requests and the dense
 * backend keep nothing. */
START_TEST(keep_blocks_pins_until_release)
{
    rig_t r;
    rig_init(&r, PKV_BACKEND_PAGED, 0, (pkv_engine_config_t){.manual = true});
    int32_t prompt[41];
    make_prompt(prompt, 41, 9);
    pkv_request_params_t p = {
        .prompt = prompt, .n_prompt = 41, .max_tokens = 3, .keep_blocks = true};
    pkv_request_t *q;
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_OK);
    const uint32_t *ids;
    uint32_t n = 0;
    ck_assert_int_eq(pkv_request_kept_blocks(q, &ids, &n), PKV_ERR_NOTFOUND); /* not finished */
    bool busy = true;
    while (busy) ck_assert_int_eq(pkv_engine_step(r.e, &busy), PKV_OK);
    collected_t c;
    collect(q, &c);
    ck_assert_int_eq(c.last.finish, PKV_FINISH_LENGTH);
    ck_assert_int_eq(pkv_request_kept_blocks(q, &ids, &n), PKV_OK);
    ck_assert_uint_eq(n, 11); /* 41 positions in blocks of 4 */
    pkv_kv_stats_t st;
    pkv_kv_stats(r.kv, &st);
    ck_assert_uint_eq(st.sequences, 0);
    ck_assert_uint_eq(st.blocks_live, 11);
    ck_assert_int_eq(pkv_kv_validate(r.kv), PKV_OK);
    pkv_request_release(q);
    pkv_kv_stats(r.kv, &st);
    ck_assert_uint_eq(st.blocks_live, 0);
    ck_assert_uint_ge(st.blocks_cached, 10);

    /* A cancelled request keeps nothing. */
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_OK);
    pkv_request_cancel(q);
    collect(q, &c);
    ck_assert_int_eq(pkv_request_kept_blocks(q, &ids, &n), PKV_ERR_NOTFOUND);
    pkv_request_release(q);
    pkv_kv_stats(r.kv, &st);
    ck_assert_uint_eq(st.blocks_live, 0);
    rig_fini(&r);

    rig_init(&r, PKV_BACKEND_DENSE, 0, (pkv_engine_config_t){.manual = true});
    ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q), PKV_ERR_INVALID);
    rig_fini(&r);
}
END_TEST

static _Atomic int notified;
static void on_notify(void *arg)
{
    (void)arg;
    atomic_fetch_add(&notified, 1);
}

START_TEST(notify_and_destroy_with_live_requests)
{
    rig_t r;
    rig_init(&r, PKV_BACKEND_DENSE, 0, (pkv_engine_config_t){.max_batch_size = 2});
    int32_t prompt[8];
    make_prompt(prompt, 8, 8);
    atomic_store(&notified, 0);
    pkv_request_params_t p = {
        .prompt = prompt, .n_prompt = 8, .max_tokens = 400, .notify = on_notify};
    pkv_request_t *q[4];
    for (int i = 0; i < 4; i++) ck_assert_int_eq(pkv_engine_submit(r.e, &p, &q[i]), PKV_OK);
    pkv_request_output_t o;
    ck_assert_int_eq(pkv_request_read(q[0], pkv_deadline_after_ns(60ull * 1000000000), &o), PKV_OK);
    ck_assert_uint_ge(o.n_tokens, 1);
    /* notify runs right after the output is published: give it a moment. */
    uint64_t until = pkv_deadline_after_ns(10ull * 1000000000);
    while (atomic_load(&notified) == 0 && pkv_now_ns() < until) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    ck_assert_int_gt(atomic_load(&notified), 0);
    /* Destroy while two run and two wait: all finish cancelled (shutdown), handles stay
     * valid until released. */
    pkv_engine_destroy(r.e);
    r.e = NULL;
    for (int i = 0; i < 4; i++) {
        collected_t c;
        collect(q[i], &c);
        ck_assert_int_eq(c.last.finish, PKV_FINISH_CANCELLED);
        ck_assert_int_eq(c.last.status, PKV_ERR_SHUTDOWN);
        pkv_request_cancel(q[i]); /* no-op */
        pkv_request_release(q[i]);
    }
    rig_fini(&r);
}
END_TEST

/* Readers on other threads, releases racing the run loop: exercised under TSan. */
typedef struct {
    pkv_engine_t *e;
    int idx;
    int32_t prompt[10];
    uint32_t got;
} client_t;

static void *client_main(void *arg)
{
    client_t *c = arg;
    pkv_request_params_t p = {.prompt = c->prompt,
                              .n_prompt = 10,
                              .max_tokens = 12,
                              .temperature = c->idx % 2 ? 0.8f : 0.0f,
                              .seed = (uint64_t)c->idx};
    pkv_request_t *q;
    if (pkv_engine_submit(c->e, &p, &q) != PKV_OK) return NULL;
    for (;;) {
        pkv_request_output_t o;
        if (pkv_request_read(q, pkv_deadline_after_ns(60ull * 1000000000), &o) != PKV_OK) break;
        c->got += o.n_tokens;
        if (o.finished) break;
        if (c->idx % 3 == 0 && c->got >= 3) break; /* disconnect early */
    }
    pkv_request_release(q);
    return NULL;
}

START_TEST(concurrent_clients)
{
    rig_t r;
    rig_init(&r, PKV_BACKEND_PAGED, 0, (pkv_engine_config_t){.max_batch_size = 4});
    enum { N = 8 };
    client_t cl[N];
    pthread_t th[N];
    for (int i = 0; i < N; i++) {
        cl[i] = (client_t){.e = r.e, .idx = i};
        make_prompt(cl[i].prompt, 10, 20 + (uint64_t)(i % 3));
        ck_assert_int_eq(pthread_create(&th[i], NULL, client_main, &cl[i]), 0);
    }
    for (int i = 0; i < N; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < N; i++)
        if (i % 3) ck_assert_uint_eq(cl[i].got, 12);
    ck_assert_int_eq(pkv_engine_drain(r.e, pkv_deadline_after_ns(60ull * 1000000000)), PKV_OK);
    rig_fini(&r);
}
END_TEST

/* ---- fault simulation ---------------------------------------------------------------- */

typedef struct {
    const pkv_engine_config_t *cfg;
    pkv_engine_t *e;
} engine_make_t;

static int engine_make(void *arg)
{
    engine_make_t *m = arg;
    return pkv_engine_create(m->cfg, &m->e);
}

static void engine_none(void *arg)
{
    ck_assert_ptr_null(((engine_make_t *)arg)->e);
}

typedef struct {
    pkv_engine_t *e;
    const pkv_request_params_t *p;
    const pkv_engine_stats_t *before;
    pkv_request_t *q;
} submit_t;

static int submit_step(void *arg)
{
    submit_t *s = arg;
    return pkv_engine_submit(s->e, s->p, &s->q);
}

/* A failed submit hands out nothing and changes no counter. */
static void submit_none(void *arg)
{
    submit_t *s = arg;
    pkv_engine_stats_t now;
    ck_assert_ptr_null(s->q);
    pkv_engine_stats(s->e, &now);
    ck_assert_uint_eq(now.submitted, s->before->submitted);
    ck_assert_uint_eq(now.queued, s->before->queued);
    ck_assert_uint_eq(now.running, s->before->running);
}

/* Every bookkeeping allocation of create and the run thread, failed one at a time, make
 * create fail with its typed error and nothing made (ASan checks nothing leaks); with
 * the fault gone, create works. */
START_TEST(create_fails_cleanly_on_alloc_and_thread_faults)
{
    pkv_log_set_level(PKV_LOG_ERROR);
    pkv_model_t *m = tiny_model();
    pkv_kv_t *kv = make_kv(m, PKV_BACKEND_PAGED, 0, false);
    pkv_engine_config_t ec = {.model = m, .kv = kv, .detok = test_detok, .manual = true};
    engine_make_t mk = {.cfg = &ec};
    uint32_t failed =
        pkv_test_fault_sweep(PKV_FAULT_ALLOC, engine_make, &mk, PKV_ERR_NOMEM, engine_none);
    ck_assert_uint_ge(failed, 8); /* the engine and its seven tables */
    pkv_engine_destroy(mk.e);

    ec.manual = false;
    pkv_engine_t *e = NULL;
    pkv_fault_arm(PKV_FAULT_THREAD, 0, 1);
    ck_assert_int_eq(pkv_engine_create(&ec, &e), PKV_ERR_IO);
    ck_assert_uint_eq(pkv_fault_fired(PKV_FAULT_THREAD), 1);
    ck_assert_ptr_null(e);
    pkv_fault_disarm_all();
    ck_assert_int_eq(pkv_engine_create(&ec, &e), PKV_OK);
    int32_t prompt[5] = {1, 2, 3, 4, 5};
    pkv_request_params_t p = {.prompt = prompt, .n_prompt = 5, .max_tokens = 3};
    pkv_request_t *q;
    ck_assert_int_eq(pkv_engine_submit(e, &p, &q), PKV_OK);
    collected_t c;
    collect(q, &c);
    ck_assert_uint_eq(c.n, 3);
    pkv_request_release(q);
    pkv_engine_destroy(e);
    pkv_kv_destroy(kv);
    pkv_model_destroy(m);
}
END_TEST

/* A submit whose request bookkeeping cannot be allocated returns PKV_ERR_NOMEM, hands
 * out nothing and leaves the engine as it was (stats before == after); the retry runs. */
START_TEST(submit_fails_cleanly_on_alloc_fault)
{
    rig_t r;
    rig_init(&r, PKV_BACKEND_PAGED, 0, (pkv_engine_config_t){.manual = true});
    int32_t prompt[6] = {3, 1, 4, 1, 5, 9};
    pkv_request_params_t p = {
        .prompt = prompt, .n_prompt = 6, .max_tokens = 4, .want_logits = true};
    pkv_engine_stats_t before, after;
    pkv_engine_stats(r.e, &before);
    submit_t sb = {.e = r.e, .p = &p, .before = &before};
    uint32_t failed =
        pkv_test_fault_sweep(PKV_FAULT_ALLOC, submit_step, &sb, PKV_ERR_NOMEM, submit_none);
    pkv_request_t *q = sb.q;
    ck_assert_uint_ge(failed, 3); /* the request, its tokens, its logits */
    for (bool busy = true; busy;) ck_assert_int_eq(pkv_engine_step(r.e, &busy), PKV_OK);
    collected_t c;
    collect(q, &c);
    ck_assert_uint_eq(c.n, 4);
    pkv_engine_stats(r.e, &after);
    ck_assert_uint_eq(after.submitted, before.submitted + 1);
    pkv_request_release(q);
    rig_fini(&r);
}
END_TEST

START_TEST(sampler)
{
    float l[5] = {0.1f, 3.0f, 3.0f, -1.0f, 2.0f};
    ck_assert_int_eq(pkv_engine_sample_argmax(l, 5), 1);
    float probs[5];
    pkv_engine_sample_cand_t cand[5];
    uint64_t rng = 1;
    ck_assert_int_eq(pkv_engine_sample(l, 5, 0.0f, 1.0f, &rng, probs, cand), 1);
    ck_assert_uint_eq(rng, 1); /* greedy draws nothing */
    /* top_p small enough: only the two tied best can be drawn. */
    uint32_t counts[5] = {0};
    for (int i = 0; i < 2000; i++) counts[pkv_engine_sample(l, 5, 1.0f, 0.5f, &rng, probs, cand)]++;
    ck_assert_uint_eq(counts[0] + counts[3] + counts[4], 0);
    ck_assert_uint_gt(counts[1], 0);
    /* Full distribution: frequencies follow softmax within a loose bound. */
    memset(counts, 0, sizeof(counts));
    for (int i = 0; i < 20000; i++)
        counts[pkv_engine_sample(l, 5, 1.0f, 1.0f, &rng, probs, cand)]++;
    double z = 0, e[5];
    for (int i = 0; i < 5; i++) z += e[i] = exp(l[i]);
    for (int i = 0; i < 5; i++) {
        double f = counts[i] / 20000.0, want = e[i] / z;
        ck_assert_msg(fabs(f - want) < 0.02, "token %d freq %g want %g", i, f, want);
    }
}
END_TEST

static Suite *engine_suite(void)
{
    Suite *s = suite_create("engine");
    TCase *tc = tcase_create("engine");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, greedy_matches_direct_model);
    tcase_add_test(tc, eos_stops);
    tcase_add_test(tc, stop_strings_hold_back_and_cut);
    tcase_add_test(tc, utf8_never_split);
    tcase_add_test(tc, bad_requests_rejected);
    tcase_add_test(tc, nofit_prompt);
    tcase_add_test(tc, cancel_queued_and_running);
    tcase_add_test(tc, priority_admits_first);
    tcase_add_test(tc, preemption_victim_order);
    tcase_add_test(tc, last_running_not_preempted);
    tcase_add_test(tc, preemption_fewest_generated_then_newest);
    tcase_add_test(tc, seeded_sampling_is_reproducible);
    tcase_add_test(tc, prefix_hits_reported);
    tcase_add_test(tc, given_sequence_continues_the_prompt);
    tcase_add_test(tc, given_first_token_continues_as_sampled);
    tcase_add_test(tc, keep_blocks_pins_until_release);
    tcase_add_test(tc, notify_and_destroy_with_live_requests);
    tcase_add_test(tc, concurrent_clients);
    tcase_add_test(tc, sampler);
    tcase_add_test(tc, create_fails_cleanly_on_alloc_and_thread_faults);
    tcase_add_test(tc, submit_fails_cleanly_on_alloc_fault);
    suite_add_tcase(s, tc);
    return s;
}

PKV_TEST_MAIN(engine_suite)
