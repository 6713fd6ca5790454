/*
 * parity: the correctness bar. Random workloads (prompts sharing prefixes, random
 * arrival steps and orders, batch sizes 1-8, chunk sizes, priorities, greedy and seeded
 * sampling) run through the engine on the paged and on the dense backend must give
 * every request bitwise-identical tokens and logits, and both must equal the request
 * run alone on an empty cache: with and without prefix adoption, under budget pressure
 * with forced preemption and recompute, and with the threaded run loop and concurrent
 * submitters. Seeds come from PKV_TEST_SEED when set and are printed on failure.
 */
#include "tests/support/testutil.h"

#include "pagekv/engine.h"

/* Sanitizer builds run 5-20x slower: fewer random workloads there. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define WORKLOADS          2
#define PRESSURE_WORKLOADS 1
#else
#define WORKLOADS          4
#define PRESSURE_WORKLOADS 3
#endif

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define V          128u
#define MAX_REQ    12
#define MAX_PROMPT 300
#define MAX_GEN    56

typedef struct {
    int32_t prompt[MAX_PROMPT];
    uint32_t n_prompt, max_tokens, arrive;
    float temperature, top_p;
    uint64_t seed;
    int32_t priority;
} spec_t;

typedef struct {
    int32_t toks[MAX_GEN];
    float logits[MAX_GEN][V];
    uint32_t n;
    pkv_finish_t finish;
    uint32_t cached, preemptions;
} result_t;

typedef struct {
    uint32_t n;
    spec_t s[MAX_REQ];
    pkv_dtype_t dt;
    uint32_t block_tokens;
} scenario_t;

typedef struct {
    uint32_t max_batch, prefill_chunk, step_tokens;
    uint64_t budget; /* bytes; 0 = none */
    bool no_prefix_cache;
    bool threaded;
} run_cfg_t;

typedef struct {
    uint64_t preemptions, cached_tokens;
} run_stats_t;

static pkv_model_t *model;

static void model_setup(void)
{
    pkv_model_config_t c;
    ck_assert_int_eq(pkv_model_preset("tiny", &c), PKV_OK);
    c.vocab_size = V;
    c.max_seq_len = 1024;
    pkv_model_runtime_t rt = {.threads = 2, .chunk_tokens = 48};
    ck_assert_int_eq(pkv_model_create_builtin(&c, 2024, &rt, &model), PKV_OK);
}

static void model_teardown(void)
{
    pkv_model_destroy(model);
}

/* Requests drawn around a few shared prefixes. long_prompts (the pressure scenario):
 * every request arrives at step 0 with a 234-244-token prompt and 40-49 new tokens, so
 * two prompts fit a 530-token paged budget but cannot both finish in it, and every dense
 * buffer must grow from 256 to 512 positions mid-decode. */
static void make_scenario(uint64_t *rs, scenario_t *sc, uint32_t n, bool long_prompts)
{
    memset(sc, 0, sizeof(*sc));
    sc->n = n;
    sc->dt = (pkv_dtype_t)pkv_test_below(rs, PKV_DTYPE_COUNT); /* the callers may pick */
    static const uint32_t bts[3] = {4, 8, 16};
    sc->block_tokens = bts[pkv_test_below(rs, 3)];
    int32_t bases[3][MAX_PROMPT];
    uint32_t base_len[3];
    for (int b = 0; b < 3; b++) {
        base_len[b] = long_prompts ? 236 : 8 + pkv_test_below(rs, 60);
        for (uint32_t i = 0; i < base_len[b]; i++) bases[b][i] = (int32_t)pkv_test_below(rs, V);
    }
    for (uint32_t r = 0; r < n; r++) {
        spec_t *s = &sc->s[r];
        /* Base b (3 = none; the pressure scenario always shares one). */
        uint32_t b = pkv_test_below(rs, long_prompts ? 3 : 4), at = 0;
        if (b < 3) {
            uint32_t take = base_len[b] - pkv_test_below(rs, 4);
            memcpy(s->prompt, bases[b], take * sizeof(int32_t));
            at = take;
        }
        uint32_t tail = 1 + pkv_test_below(rs, long_prompts ? 8 : 24);
        for (uint32_t i = 0; i < tail; i++) s->prompt[at++] = (int32_t)pkv_test_below(rs, V);
        s->n_prompt = at;
        s->max_tokens = (long_prompts ? 40 : 4) + pkv_test_below(rs, long_prompts ? 10 : 20);
        s->arrive = long_prompts ? 0 : pkv_test_below(rs, 25);
        if (pkv_test_below(rs, 2)) {
            s->temperature = 0.6f + 0.1f * (float)pkv_test_below(rs, 8);
            s->top_p = pkv_test_below(rs, 2) ? 1.0f : 0.85f;
            s->seed = pkv_test_rand(rs);
        }
        s->priority = (int32_t)pkv_test_below(rs, 3);
    }
}

static pkv_kv_t *make_kv(const scenario_t *sc, pkv_backend_t be, const run_cfg_t *rc)
{
    pkv_kv_config_t kc = {.backend = be,
                          .budget_bytes = rc->budget,
                          .no_prefix_cache = rc->no_prefix_cache,
                          .granule_bytes = 4096};
    pkv_model_geometry(model, sc->dt, sc->block_tokens, &kc.geo);
    pkv_kv_t *kv = NULL;
    ck_assert_int_eq(pkv_kv_create(&kc, &kv), PKV_OK);
    return kv;
}

static void submit(pkv_engine_t *e, const spec_t *s, pkv_request_t **out)
{
    pkv_request_params_t p = {.prompt = s->prompt,
                              .n_prompt = s->n_prompt,
                              .max_tokens = s->max_tokens,
                              .temperature = s->temperature,
                              .top_p = s->top_p,
                              .seed = s->seed,
                              .priority = s->priority,
                              .ignore_eos = true,
                              .want_logits = true};
    ck_assert_int_eq(pkv_engine_submit(e, &p, out), PKV_OK);
}

static void drain_output(pkv_request_t *q, result_t *res, uint64_t deadline)
{
    pkv_request_output_t o;
    while (pkv_request_read(q, deadline, &o) == PKV_OK) {
        ck_assert_uint_le(res->n + o.n_tokens, MAX_GEN);
        memcpy(res->toks + res->n, o.tokens, o.n_tokens * sizeof(int32_t));
        memcpy(res->logits[res->n], o.logits, (size_t)o.n_tokens * V * sizeof(float));
        res->n += o.n_tokens;
        if (o.finished) {
            res->finish = o.finish;
            res->cached = o.cached_tokens;
            res->preemptions = o.preemptions;
            return;
        }
        if (deadline == 0) return;
    }
}

typedef struct {
    pkv_engine_t *e;
    const scenario_t *sc;
    result_t *res;
    uint32_t first, step;
} submitter_t;

/* Threaded mode: one client thread per request group submits at staggered times and
 * reads until finished. */
static void *client_main(void *arg)
{
    submitter_t *c = arg;
    for (uint32_t r = c->first; r < c->sc->n; r += c->step) {
        const spec_t *s = &c->sc->s[r];
        struct timespec ts = {0, (long)s->arrive * 200000L};
        nanosleep(&ts, NULL);
        pkv_request_t *q;
        submit(c->e, s, &q);
        drain_output(q, &c->res[r], pkv_deadline_after_ns(120ull * 1000000000));
        ck_assert(c->res[r].finish != PKV_FINISH_NONE);
        pkv_request_release(q);
    }
    return NULL;
}

static void run(const scenario_t *sc, pkv_backend_t be, const run_cfg_t *rc, uint64_t shuffle,
                result_t *res, run_stats_t *rst)
{
    memset(res, 0, sizeof(result_t) * sc->n);
    pkv_kv_t *kv = make_kv(sc, be, rc);
    pkv_engine_config_t ec = {.model = model,
                              .kv = kv,
                              .max_batch_size = rc->max_batch,
                              .prefill_chunk = rc->prefill_chunk,
                              .step_tokens = rc->step_tokens,
                              .manual = !rc->threaded};
    pkv_engine_t *e = NULL;
    ck_assert_int_eq(pkv_engine_create(&ec, &e), PKV_OK);
    if (rc->threaded) {
        enum { NC = 3 };
        pthread_t th[NC];
        submitter_t cl[NC];
        for (int i = 0; i < NC; i++) {
            cl[i] = (submitter_t){.e = e, .sc = sc, .res = res, .first = (uint32_t)i, .step = NC};
            ck_assert_int_eq(pthread_create(&th[i], NULL, client_main, &cl[i]), 0);
        }
        for (int i = 0; i < NC; i++) pthread_join(th[i], NULL);
    } else {
        /* Arrival order within a step is shuffled by `shuffle`. */
        pkv_request_t *q[MAX_REQ] = {0};
        uint32_t order[MAX_REQ];
        for (uint32_t i = 0; i < sc->n; i++) order[i] = i;
        uint64_t s = shuffle;
        for (uint32_t i = sc->n; i > 1; i--) {
            uint32_t j = pkv_test_below(&s, i), t = order[i - 1];
            order[i - 1] = order[j];
            order[j] = t;
        }
        uint32_t submitted = 0;
        bool busy = true;
        for (uint32_t step = 0; busy || submitted < sc->n; step++) {
            for (uint32_t k = 0; k < sc->n; k++) {
                uint32_t r = order[k];
                if (!q[r] && sc->s[r].arrive <= step) {
                    submit(e, &sc->s[r], &q[r]);
                    submitted++;
                }
            }
            ck_assert_int_eq(pkv_engine_step(e, &busy), PKV_OK);
            for (uint32_t r = 0; r < sc->n; r++)
                if (q[r] && res[r].finish == PKV_FINISH_NONE) drain_output(q[r], &res[r], 0);
            ck_assert_uint_lt(step, 100000);
        }
        for (uint32_t r = 0; r < sc->n; r++) {
            ck_assert_int_eq(res[r].finish, PKV_FINISH_LENGTH);
            pkv_request_release(q[r]);
        }
    }
    pkv_engine_stats_t st;
    pkv_engine_stats(e, &st);
    rst->preemptions = st.preemptions;
    rst->cached_tokens = st.cached_tokens;
    pkv_engine_destroy(e);
    pkv_kv_stats_t ks;
    pkv_kv_stats(kv, &ks);
    ck_assert_uint_eq(ks.sequences, 0);
    ck_assert_int_eq(pkv_kv_validate(kv), PKV_OK);
    pkv_kv_destroy(kv);
}

/* Each request alone, batch 1, empty cache, no prefix caching. */
static void run_alone(const scenario_t *sc, result_t *res)
{
    for (uint32_t r = 0; r < sc->n; r++) {
        scenario_t one = *sc;
        one.n = 1;
        one.s[0] = sc->s[r];
        one.s[0].arrive = 0;
        run_cfg_t rc = {
            .max_batch = 1, .prefill_chunk = 512, .step_tokens = 512, .no_prefix_cache = true};
        run_stats_t rst;
        run(&one, PKV_BACKEND_DENSE, &rc, 0, &res[r], &rst);
    }
}

static void expect_same(const scenario_t *sc, const result_t *a, const result_t *b,
                        const char *what, uint64_t seed)
{
    for (uint32_t r = 0; r < sc->n; r++) {
        ck_assert_msg(a[r].n == b[r].n && a[r].n == sc->s[r].max_tokens,
                      "seed %llu %s: request %u generated %u vs %u tokens",
                      (unsigned long long)seed, what, r, a[r].n, b[r].n);
        ck_assert_msg(!memcmp(a[r].toks, b[r].toks, a[r].n * sizeof(int32_t)),
                      "seed %llu %s: request %u tokens differ", (unsigned long long)seed, what, r);
        ck_assert_msg(!memcmp(a[r].logits, b[r].logits, (size_t)a[r].n * V * sizeof(float)),
                      "seed %llu %s: request %u logits differ", (unsigned long long)seed, what, r);
    }
}

static result_t ref_res[MAX_REQ], paged_res[MAX_REQ], dense_res[MAX_REQ];

static run_cfg_t random_cfg(uint64_t *rs)
{
    return (run_cfg_t){.max_batch = 1 + pkv_test_below(rs, 8),
                       .prefill_chunk = 1 + pkv_test_below(rs, 64),
                       .step_tokens = 8 + pkv_test_below(rs, 120)};
}

START_TEST(paged_equals_dense_random_workloads)
{
    uint64_t seed = pkv_test_seed(0x9a41) + (uint64_t)_i;
    uint64_t rs = seed;
    scenario_t sc;
    make_scenario(&rs, &sc, 10, false);
    if (_i < 2) sc.dt = _i ? PKV_DTYPE_FP8 : PKV_DTYPE_INT8; /* the scaled dtypes every run */
    run_alone(&sc, ref_res);
    uint64_t hits = 0;
    for (int cache = 0; cache < 2; cache++) {
        run_cfg_t rc = random_cfg(&rs);
        rc.no_prefix_cache = !cache;
        run_stats_t sp, sd;
        run(&sc, PKV_BACKEND_PAGED, &rc, pkv_test_rand(&rs), paged_res, &sp);
        run(&sc, PKV_BACKEND_DENSE, &rc, pkv_test_rand(&rs), dense_res, &sd);
        expect_same(&sc, paged_res, dense_res, cache ? "paged/dense cache" : "paged/dense", seed);
        expect_same(&sc, paged_res, ref_res, cache ? "paged/alone cache" : "paged/alone", seed);
        if (cache)
            hits = sp.cached_tokens;
        else
            ck_assert_uint_eq(sp.cached_tokens, 0);
    }
    /* Shared prefixes were actually adopted from the cache. */
    ck_assert_msg(hits > 0, "seed %llu: no prefix hits", (unsigned long long)seed);
}
END_TEST

START_TEST(paged_equals_dense_under_pressure)
{
    uint64_t seed = pkv_test_seed(0x7e55) + (uint64_t)_i;
    uint64_t rs = seed;
    scenario_t sc;
    make_scenario(&rs, &sc, 8, true);
    if (_i == 0) sc.dt = PKV_DTYPE_INT8;
    run_alone(&sc, ref_res);
    pkv_geometry_t g;
    pkv_model_geometry(model, sc.dt, sc.block_tokens, &g);
    size_t tb = pkv_geometry_token_bytes(&g);
    run_cfg_t rc = random_cfg(&rs);
    if (rc.max_batch < 3) rc.max_batch = 3 + _i % 6;
    /* Paged: 530 positions (rounded down to whole granules); dense: 1024 positions, four
     * 256-position buffers or two 512-position ones. */
    uint64_t paged_budget = 530ull * tb, dense_budget = 1024ull * tb;
    for (int cache = 0; cache < 2; cache++) {
        rc.no_prefix_cache = !cache;
        run_stats_t sp, sd;
        rc.budget = paged_budget;
        run(&sc, PKV_BACKEND_PAGED, &rc, pkv_test_rand(&rs), paged_res, &sp);
        rc.budget = dense_budget;
        run(&sc, PKV_BACKEND_DENSE, &rc, pkv_test_rand(&rs), dense_res, &sd);
        expect_same(&sc, paged_res, dense_res, "pressure paged/dense", seed);
        expect_same(&sc, paged_res, ref_res, "pressure paged/alone", seed);
        /* Without prefix sharing the sizes force preemption on both backends (with it,
         * shared prefix blocks may make room). */
        if (!cache) {
            ck_assert_msg(sp.preemptions > 0, "seed %llu: paged run never preempted",
                          (unsigned long long)seed);
            ck_assert_msg(sd.preemptions > 0, "seed %llu: dense run never preempted",
                          (unsigned long long)seed);
        }
    }
}
END_TEST

START_TEST(paged_equals_dense_threaded)
{
    uint64_t seed = pkv_test_seed(0x71d3);
    uint64_t rs = seed;
    scenario_t sc;
    make_scenario(&rs, &sc, 9, false);
    run_alone(&sc, ref_res);
    run_cfg_t rc = random_cfg(&rs);
    rc.threaded = true;
    run_stats_t sp, sd;
    run(&sc, PKV_BACKEND_PAGED, &rc, 0, paged_res, &sp);
    run(&sc, PKV_BACKEND_DENSE, &rc, 0, dense_res, &sd);
    expect_same(&sc, paged_res, dense_res, "threaded paged/dense", seed);
    expect_same(&sc, paged_res, ref_res, "threaded paged/alone", seed);
}
END_TEST

static Suite *parity_suite(void)
{
    Suite *s = suite_create("parity");
    TCase *tc = tcase_create("parity");
    tcase_set_timeout(tc, 180);
    tcase_add_checked_fixture(tc, model_setup, model_teardown);
    tcase_add_loop_test(tc, paged_equals_dense_random_workloads, 0, WORKLOADS);
    tcase_add_loop_test(tc, paged_equals_dense_under_pressure, 0, PRESSURE_WORKLOADS);
    tcase_add_test(tc, paged_equals_dense_threaded);
    suite_add_tcase(s, tc);
    return s;
}

PKV_TEST_MAIN(parity_suite)
