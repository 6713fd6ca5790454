/*
 * pagekv bench staging: the four staging designs on one replayed load.
 *
 * The load: 64-token pages of 72 KiB (a 0.56 MiB production page per rank, scaled by 1/8); requests
 * whose contexts are 128, 512, 4096 and 8192 tokens (2, 8, 64, 128 pages) drawn from a seeded mix;
 * 64 transfers in flight: 64 streams, each acquiring staging for one transfer with an absolute
 * deadline, holding every page for a simulated copy time, releasing, and starting the
 * next transfer (a closed loop). The copy is simulated: each page gets one 8-byte stamp
 * per 4 KiB (so it is really committed and writable) and the stream sleeps for the copy
 * time (uniform in copy_us +-25%); no bytes are moved.
 *
 * Modes on the same load: fixed (64 slots x 128 pages), per_transfer (1024 pages),
 * per_transfer_eighth (128 pages), fixed_small (4 slots x 128 pages).
 *
 * Memory figures come from the OS: VmHWM is reset before a mode's streams start and read
 * after they stop; peak resident = VmHWM - VmRSS at the start (everything else, the
 * stage tables and the streams' stacks, already exists then). It is checked against the
 * stage's own resident_peak_bytes counter. Peak in-flight = the stage's peak of pages
 * asked by live transfers.
 *
 * acquire_release_ns_median_128: uncontended acquire + release (+ grant free) of 128
 * pages on a warm per_transfer stage, median over 21 batches of 2000.
 */
#include "support/cli.h"
#include "tools/commands.h"

#include "core/core.h"
#include "pagekv/stage.h"
#include "prim/prim.h"

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BS_STREAMS     64
#define BS_PAGE_TOKENS 64
#define BS_MAX_LINES   2000

static const uint32_t bs_ctx_tokens[] = {128, 512, 4096, 8192};
static const uint32_t bs_ctx_weight[] = {55, 30, 10, 5}; /* mean 16.3 pages: 1/8 of a slot */

typedef struct {
    const char *name;
    pkv_stage_mode_t mode;
    uint32_t pool_pages, slots, slot_pages;
} bs_mode_t;

static const bs_mode_t bs_modes[] = {
    {"fixed", PKV_STAGE_FIXED_SLOTS, 0, 64, 128},
    {"per_transfer", PKV_STAGE_PER_TRANSFER, 1024, 0, 0},
    {"per_transfer_eighth", PKV_STAGE_PER_TRANSFER, 128, 0, 0},
    {"fixed_small", PKV_STAGE_FIXED_SLOTS, 0, 4, 128},
};

typedef struct {
    size_t page_bytes;
    double seconds;
    uint64_t copy_us, deadline_ms, seed;
    bool shared, pin;
} bs_opts_t;

/* ---- failure lines from the stage's log ------------------------------------------ */

static pthread_mutex_t bs_log_lock = PTHREAD_MUTEX_INITIALIZER; /* guards bs_lines, bs_nlines */
static char *bs_lines[BS_MAX_LINES];
static size_t bs_nlines;

static void bs_sink(void *arg, pkv_log_level_t level, const char *module, const char *line)
{
    (void)arg;
    (void)level;
    if (strcmp(module, "stage")) return;
    char *copy = strdup(line); /* outside the lock */
    pthread_mutex_lock(&bs_log_lock);
    if (bs_nlines < BS_MAX_LINES && copy) {
        bs_lines[bs_nlines++] = copy;
        copy = NULL;
    } else {
        bs_nlines++;
    }
    pthread_mutex_unlock(&bs_log_lock);
    free(copy);
}

static void bs_lines_clear(void)
{
    pthread_mutex_lock(&bs_log_lock);
    for (size_t i = 0; i < PKV_MIN(bs_nlines, (size_t)BS_MAX_LINES); i++) free(bs_lines[i]);
    bs_nlines = 0;
    pthread_mutex_unlock(&bs_log_lock);
}

/* ---- streams ----------------------------------------------------------------------- */

typedef struct bs_run bs_run_t;

typedef struct {
    bs_run_t *run;
    int idx;
    uint64_t rng;
    uint64_t done, failed, by_rc[16];
    uint64_t *waits_ns; /* one per acquire, up to cap */
    size_t nwaits, cap;
    pthread_t th;
} bs_stream_t;

struct bs_run {
    const bs_opts_t *o;
    pkv_stage_t *st;
    pthread_mutex_t start_lock; /* guards go */
    pthread_cond_t start_cond;
    bool go;
    atomic_int stop;
    bs_stream_t s[BS_STREAMS];
};

static uint32_t bs_draw_pages(uint64_t *rng)
{
    uint32_t total = 0;
    for (size_t i = 0; i < PKV_ARRAY_LEN(bs_ctx_weight); i++) total += bs_ctx_weight[i];
    uint32_t r = (uint32_t)(pkv_splitmix64(rng) % total);
    for (size_t i = 0; i < PKV_ARRAY_LEN(bs_ctx_weight); i++) {
        if (r < bs_ctx_weight[i]) return bs_ctx_tokens[i] / BS_PAGE_TOKENS;
        r -= bs_ctx_weight[i];
    }
    return bs_ctx_tokens[0] / BS_PAGE_TOKENS;
}

static void bs_sleep_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static void *bs_stream_main(void *arg)
{
    bs_stream_t *s = arg;
    bs_run_t *run = s->run;
    const bs_opts_t *o = run->o;
    uint64_t seq = 0;
    pthread_mutex_lock(&run->start_lock);
    while (!run->go) pthread_cond_wait(&run->start_cond, &run->start_lock);
    pthread_mutex_unlock(&run->start_lock);
    while (!atomic_load_explicit(&run->stop, memory_order_relaxed)) {
        uint32_t pages = bs_draw_pages(&s->rng);
        uint64_t id = ((uint64_t)(s->idx + 1) << 40) | ++seq;
        uint64_t t0 = pkv_now_ns();
        pkv_stage_grant_t *g;
        int rc = pkv_stage_acquire(run->st, id, (uint32_t)s->idx % 8, pages,
                                   t0 + o->deadline_ms * 1000000ull, &g);
        uint64_t waited = rc == PKV_OK ? g->wait_ns : pkv_now_ns() - t0;
        if (s->nwaits < s->cap) s->waits_ns[s->nwaits++] = waited;
        if (rc != PKV_OK) {
            s->failed++;
            s->by_rc[-rc & 15]++;
            continue;
        }
        /* The simulated copy: stamp every 4 KiB of the pages the transfer stages (in
         * fixed mode only the first pages_asked of its slot), then hold them for the copy
         * time. */
        uint32_t left = pages;
        for (uint32_t r = 0; r < g->nruns && left; r++) {
            uint32_t cnt = PKV_MIN(left, g->runs[r].count);
            size_t bytes = (size_t)cnt * g->page_bytes;
            for (size_t off = 0; off < bytes; off += 4096)
                memcpy((char *)g->runs[r].addr + off, &id, sizeof(id));
            left -= cnt;
        }
        uint64_t j = o->copy_us * 1000ull / 2;
        bs_sleep_ns(o->copy_us * 1000ull - j / 2 + pkv_splitmix64(&s->rng) % (j + 1));
        if (pkv_stage_release(run->st, id) != PKV_OK) s->failed++;
        pkv_stage_grant_free(g);
        s->done++;
    }
    return NULL;
}

static int bs_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

typedef struct {
    const bs_mode_t *m;
    uint64_t transfers, failed, by_rc[16];
    double seconds, transfers_per_s;
    uint64_t peak_resident_os, peak_resident_counter, peak_inflight, peak_used_pages;
    uint64_t pool_bytes, pinned_bytes, pin_failed_pages;
    double wait_p50_us, wait_p99_us, wait_max_us;
    size_t nlines;
    char *lines[8];
    uint64_t stage_timeouts, stage_nofit;
} bs_result_t;

/* Start the BS_STREAMS streams (they wait for run->go); *started gets how many run. On a
 * failure the started ones are told to stop at once. */
static int bs_streams_start(bs_run_t *run, const bs_opts_t *o, int *started)
{
    size_t cap = (size_t)(o->seconds * 1e6 / (double)PKV_MAX(o->copy_us / 2, 1)) + 1024;
    int rc = PKV_OK;
    *started = 0;
    for (int i = 0; i < BS_STREAMS; i++) {
        bs_stream_t *s = &run->s[i];
        s->run = run;
        s->idx = i;
        s->rng = o->seed * 1000003ull + (uint64_t)i;
        s->cap = cap;
        s->waits_ns = malloc(cap * sizeof(uint64_t));
        if (!s->waits_ns || pthread_create(&s->th, NULL, bs_stream_main, s)) {
            rc = PKV_ERR_NOMEM;
            break;
        }
        pthread_setname_np(s->th, "bench-stream");
        (*started)++;
    }
    if (rc) atomic_store(&run->stop, 1); /* the started streams leave at once */
    return rc;
}

/* The streams' counts and waits (p50, p99, max) into res. */
static void bs_collect_streams(const bs_run_t *run, bs_result_t *res)
{
    size_t nw = 0;
    for (int i = 0; i < BS_STREAMS; i++) nw += run->s[i].nwaits;
    uint64_t *all = malloc((nw ? nw : 1) * sizeof(uint64_t));
    nw = 0;
    for (int i = 0; i < BS_STREAMS; i++) {
        const bs_stream_t *s = &run->s[i];
        res->transfers += s->done;
        res->failed += s->failed;
        for (int k = 0; k < 16; k++) res->by_rc[k] += s->by_rc[k];
        if (all) memcpy(all + nw, s->waits_ns, s->nwaits * sizeof(uint64_t));
        nw += s->nwaits;
    }
    if (all && nw) {
        qsort(all, nw, sizeof(uint64_t), bs_cmp_u64);
        res->wait_p50_us = (double)all[nw / 2] / 1e3;
        res->wait_p99_us = (double)all[(nw * 99) / 100] / 1e3;
        res->wait_max_us = (double)all[nw - 1] / 1e3;
    }
    free(all);
}

/* The memory figures: the OS's peak over the baseline m0 (m1 read after the streams
 * stopped) and the stage's own counters. */
static void bs_collect_memory(const bs_opts_t *o, const pkv_prim_mem_t *m0,
                              const pkv_prim_mem_t *m1, const pkv_stage_stats_t *ss,
                              bs_result_t *res)
{
    res->peak_resident_os = m1->hwm_bytes > m0->rss_bytes ? m1->hwm_bytes - m0->rss_bytes : 0;
    res->peak_resident_counter = ss->resident_peak_bytes;
    res->peak_inflight = (uint64_t)ss->pages_asked_peak * o->page_bytes;
    res->peak_used_pages = ss->pages_peak_used;
    res->pool_bytes = (uint64_t)ss->pages_total * o->page_bytes;
    res->pinned_bytes = ss->pinned_bytes;
    res->pin_failed_pages = ss->pin_failed_pages;
    res->stage_timeouts = ss->timeouts;
    res->stage_nofit = ss->nofit;
}

/* The stage's failure lines logged during the mode: the first few move into res. */
static void bs_take_lines(bs_result_t *res)
{
    pthread_mutex_lock(&bs_log_lock);
    res->nlines = bs_nlines;
    for (size_t i = 0; i < PKV_MIN(bs_nlines, PKV_ARRAY_LEN(res->lines)); i++) {
        res->lines[i] = bs_lines[i];
        bs_lines[i] = NULL;
    }
    pthread_mutex_unlock(&bs_log_lock);
    bs_lines_clear();
}

/* Let the started streams run for o->seconds (none when rc says the start failed), then
 * stop and join them; the memory baseline, the end and the stage's counters into res. */
static void bs_run_streams(bs_run_t *run, const bs_opts_t *o, int started, int rc, bs_result_t *res)
{
    bs_lines_clear();
    pkv_prim_mem_t m0;
    pkv_prim_mem_read(0, &m0);
    pkv_prim_hwm_reset();
    pkv_prim_mem_read(0, &m0); /* after the reset: baseline == hwm */
    uint64_t t0 = pkv_now_ns();
    pthread_mutex_lock(&run->start_lock);
    run->go = true;
    pthread_cond_broadcast(&run->start_cond);
    pthread_mutex_unlock(&run->start_lock);
    if (!rc) {
        bs_sleep_ns((uint64_t)(o->seconds * 1e9));
        atomic_store(&run->stop, 1);
    }
    for (int i = 0; i < started; i++) pthread_join(run->s[i].th, NULL);
    uint64_t t1 = pkv_now_ns();
    pkv_prim_mem_t m1;
    pkv_prim_mem_read(0, &m1);
    pkv_stage_stats_t ss;
    pkv_stage_stats(run->st, &ss);
    if (rc) return;
    bs_collect_streams(run, res);
    res->seconds = (double)(t1 - t0) / 1e9;
    res->transfers_per_s = (double)res->transfers / res->seconds;
    bs_collect_memory(o, &m0, &m1, &ss, res);
}

static int bs_run_mode(const bs_opts_t *o, const bs_mode_t *m, bs_result_t *res)
{
    pkv_stage_config_t c;
    pkv_stage_config_default(&c);
    c.page_bytes = o->page_bytes;
    c.mode = m->mode;
    c.pool_pages = m->pool_pages;
    c.slots = m->slots;
    c.slot_pages = m->slot_pages;
    c.pin = o->pin;
    c.shared = o->shared;
    c.idle_release_ns = 1000000000ull;
    c.name = m->name;
    memset(res, 0, sizeof(*res));
    res->m = m;
    bs_run_t *run = calloc(1, sizeof(*run));
    if (!run) return PKV_ERR_NOMEM;
    int rc = pkv_stage_create(&c, &run->st);
    if (rc) {
        free(run);
        return rc;
    }
    run->o = o;
    pthread_mutex_init(&run->start_lock, NULL);
    pthread_cond_init(&run->start_cond, NULL);
    int started;
    rc = bs_streams_start(run, o, &started);
    bs_run_streams(run, o, started, rc, res);
    for (int i = 0; i < BS_STREAMS; i++) free(run->s[i].waits_ns);
    size_t leaked = 0;
    int drc = pkv_stage_destroy(run->st, pkv_deadline_after_ns(2000000000ull), &leaked);
    pthread_cond_destroy(&run->start_cond);
    pthread_mutex_destroy(&run->start_lock);
    free(run);
    bs_take_lines(res);
    if (!rc && (drc || leaked)) rc = PKV_ERR_BUSY;
    return rc;
}

/* Uncontended acquire + release of 128 pages: median ns over 21 batches. */
static int bs_acquire_release_128(const bs_opts_t *o, double *median_ns, double *min_ns)
{
    pkv_stage_config_t c;
    pkv_stage_config_default(&c);
    c.page_bytes = o->page_bytes;
    c.pool_pages = 1024;
    c.pin = o->pin;
    c.shared = o->shared;
    pkv_stage_t *st;
    int rc = pkv_stage_create(&c, &st);
    if (rc) return rc;
    /* Warm: commit the pages the loop will reuse. */
    pkv_stage_grant_t *g;
    enum { BATCHES = 21, ITERS = 2000 };
    double per[BATCHES];
    uint64_t id = 1;
    for (int w = 0; w < 100 && !rc; w++) {
        rc = pkv_stage_acquire(st, id, 0, 128, PKV_DEADLINE_NEVER, &g);
        if (!rc) {
            pkv_stage_release(st, id++);
            pkv_stage_grant_free(g);
        }
    }
    for (int b = 0; b < BATCHES && !rc; b++) {
        uint64_t t0 = pkv_now_ns();
        for (int i = 0; i < ITERS; i++) {
            rc = pkv_stage_acquire(st, id, 0, 128, PKV_DEADLINE_NEVER, &g);
            if (rc) break;
            pkv_stage_release(st, id++);
            pkv_stage_grant_free(g);
        }
        per[b] = (double)(pkv_now_ns() - t0) / ITERS;
    }
    pkv_stage_destroy(st, pkv_deadline_after_ns(1000000000ull), NULL);
    if (rc) return rc;
    for (int i = 1; i < BATCHES; i++)
        for (int k = i; k > 0 && per[k - 1] > per[k]; k--) {
            double t = per[k];
            per[k] = per[k - 1];
            per[k - 1] = t;
        }
    *median_ns = per[BATCHES / 2];
    *min_ns = per[0];
    return PKV_OK;
}

static const char *bs_reason(int idx)
{
    return pkv_status_str(-idx);
}

static int bs_write_json(const char *path, const bs_opts_t *o, const bs_result_t *r, size_t n,
                         double ar_median, double ar_min)
{
    json_t *root = json_object();
    json_object_set_new(root, "bench", json_string("staging"));
    json_object_set_new(root, "page_bytes", json_integer((json_int_t)o->page_bytes));
    json_object_set_new(root, "page_tokens", json_integer(BS_PAGE_TOKENS));
    json_object_set_new(root, "streams", json_integer(BS_STREAMS));
    json_object_set_new(root, "copy_us", json_integer((json_int_t)o->copy_us));
    json_object_set_new(root, "deadline_ms", json_integer((json_int_t)o->deadline_ms));
    json_object_set_new(root, "seconds_per_mode", json_real(o->seconds));
    json_object_set_new(root, "seed", json_integer((json_int_t)o->seed));
    json_object_set_new(root, "pinned", json_boolean(o->pin));
    json_object_set_new(root, "memfd", json_boolean(o->shared));
    json_t *mix = json_array();
    for (size_t i = 0; i < PKV_ARRAY_LEN(bs_ctx_tokens); i++) {
        json_t *e = json_object();
        json_object_set_new(e, "context_tokens", json_integer(bs_ctx_tokens[i]));
        json_object_set_new(e, "pages", json_integer(bs_ctx_tokens[i] / BS_PAGE_TOKENS));
        json_object_set_new(e, "weight", json_integer(bs_ctx_weight[i]));
        json_array_append_new(mix, e);
    }
    json_object_set_new(root, "mix", mix);
    json_t *modes = json_array();
    for (size_t i = 0; i < n; i++) {
        const bs_result_t *x = &r[i];
        json_t *e = json_object();
        json_object_set_new(e, "name", json_string(x->m->name));
        json_object_set_new(e, "mode", json_string(pkv_stage_mode_name(x->m->mode)));
        uint32_t pool = x->m->pool_pages ? x->m->pool_pages : x->m->slots * x->m->slot_pages;
        json_object_set_new(e, "pool_pages", json_integer(pool));
        json_object_set_new(e, "pool_bytes", json_integer((json_int_t)x->pool_bytes));
        if (x->m->slots) {
            json_object_set_new(e, "slots", json_integer(x->m->slots));
            json_object_set_new(e, "slot_pages", json_integer(x->m->slot_pages));
        }
        json_object_set_new(e, "transfers", json_integer((json_int_t)x->transfers));
        json_object_set_new(e, "failed", json_integer((json_int_t)x->failed));
        json_t *why = json_object();
        for (int k = 1; k < 16; k++)
            if (x->by_rc[k])
                json_object_set_new(why, bs_reason(k), json_integer((json_int_t)x->by_rc[k]));
        json_object_set_new(e, "failures_by_reason", why);
        json_object_set_new(e, "failure_log_lines", json_integer((json_int_t)x->nlines));
        json_t *lines = json_array();
        for (size_t k = 0; k < PKV_ARRAY_LEN(x->lines); k++)
            if (x->lines[k]) json_array_append_new(lines, json_string(x->lines[k]));
        json_object_set_new(e, "failure_log_sample", lines);
        json_object_set_new(e, "peak_resident_bytes",
                            json_integer((json_int_t)x->peak_resident_os));
        json_object_set_new(e, "peak_resident_bytes_counter",
                            json_integer((json_int_t)x->peak_resident_counter));
        json_object_set_new(e, "peak_inflight_bytes", json_integer((json_int_t)x->peak_inflight));
        json_object_set_new(e, "peak_used_pages", json_integer((json_int_t)x->peak_used_pages));
        json_object_set_new(e, "resident_over_inflight",
                            json_real(x->peak_inflight
                                          ? (double)x->peak_resident_os / (double)x->peak_inflight
                                          : 0.0));
        json_object_set_new(e, "wait_p50_us", json_real(x->wait_p50_us));
        json_object_set_new(e, "wait_p99_us", json_real(x->wait_p99_us));
        json_object_set_new(e, "wait_max_us", json_real(x->wait_max_us));
        json_object_set_new(e, "transfers_per_s", json_real(x->transfers_per_s));
        json_object_set_new(e, "seconds", json_real(x->seconds));
        json_object_set_new(e, "pin_failed_pages", json_integer((json_int_t)x->pin_failed_pages));
        json_array_append_new(modes, e);
    }
    json_object_set_new(root, "modes", modes);
    json_object_set_new(root, "acquire_release_ns_median_128", json_real(ar_median));
    json_object_set_new(root, "acquire_release_ns_min_128", json_real(ar_min));
    json_object_set_new(root, "acquire_release_batches", json_integer(21));
    int rc = json_dump_file(root, path, JSON_INDENT(2));
    json_decref(root);
    return rc == 0 ? PKV_OK : PKV_ERR_IO;
}

static void bs_usage(void)
{
    fprintf(stderr, "usage: pagekv bench staging [--json FILE] [--seconds S] [--page-bytes B]\n"
                    "                            [--copy-us US] [--deadline-ms MS] [--seed N]\n"
                    "                            [--memfd] [--no-pin]\n"
                    "  64 streams (64 transfers in flight), contexts 128/512/4096/8192 tokens\n"
                    "  (weights 55/30/10/5), 64-token pages; modes fixed (64x128),\n"
                    "  per_transfer (1024), per_transfer_eighth (128), fixed_small (4x128).\n"
                    "  defaults: --seconds 2 --page-bytes 72K (a 0.56 MiB page per rank, / 8)\n"
                    "            --copy-us 2000 --deadline-ms 2000 --seed 1\n");
}

/* The options into o and *json_path: -1 to go on, else the exit code (0 after --help, 2 on
 * a usage error). */
static int bs_parse(int argc, char **argv, bs_opts_t *o, const char **json_path)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t x;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bs_usage();
            return 0;
        } else if (!strcmp(a, "--json") && v) {
            *json_path = v;
            i++;
        } else if (!strcmp(a, "--seconds") && v) {
            if (pkv_cli_parse_u64(v, 1, 600, &x))
                return pkv_cli_usage_error("bench staging", "--seconds: 1..600, got '%s'", v);
            o->seconds = (double)x;
            i++;
        } else if (!strcmp(a, "--page-bytes") && v) {
            if (pkv_cli_parse_bytes(v, &x) || x == 0 || x % 4096 || x > (64ull << 20))
                return pkv_cli_usage_error("bench staging",
                                           "--page-bytes: a multiple of 4K up to 64M, got '%s'", v);
            o->page_bytes = x;
            i++;
        } else if (!strcmp(a, "--copy-us") && v) {
            if (pkv_cli_parse_u64(v, 1, 10000000, &x))
                return pkv_cli_usage_error("bench staging", "--copy-us: 1..10000000, got '%s'", v);
            o->copy_us = x;
            i++;
        } else if (!strcmp(a, "--deadline-ms") && v) {
            if (pkv_cli_parse_u64(v, 1, 3600000, &x))
                return pkv_cli_usage_error("bench staging", "--deadline-ms: 1..3600000, got '%s'",
                                           v);
            o->deadline_ms = x;
            i++;
        } else if (!strcmp(a, "--seed") && v) {
            if (pkv_cli_parse_u64(v, 0, UINT64_MAX, &x))
                return pkv_cli_usage_error("bench staging", "--seed: an integer, got '%s'", v);
            o->seed = x;
            i++;
        } else if (!strcmp(a, "--memfd")) {
            o->shared = true;
        } else if (!strcmp(a, "--no-pin")) {
            o->pin = false;
        } else {
            bs_usage();
            return pkv_cli_usage_error("bench staging", "unknown or incomplete option '%s'", a);
        }
    }
    return -1;
}

static void bs_free_lines(bs_result_t *res, size_t nres)
{
    for (size_t i = 0; i < nres; i++)
        for (size_t k = 0; k < PKV_ARRAY_LEN(res[i].lines); k++) free(res[i].lines[k]);
}

/* The table: one row per mode, then the uncontended acquire + release. */
static void bs_print_table(const bs_opts_t *o, const bs_result_t *res, size_t nres,
                           double ar_median, double ar_min)
{
    printf("## pagekv bench staging\n\n");
    printf("64 streams (transfers in flight), contexts 128/512/4096/8192 tokens weighted "
           "55/30/10/5, 64-token pages of %zu bytes, copy %llu us +-25%%, deadline %llu ms, "
           "%.0f s per mode, seed %llu, %s, %s.\n\n",
           o->page_bytes, (unsigned long long)o->copy_us, (unsigned long long)o->deadline_ms,
           o->seconds, (unsigned long long)o->seed, o->pin ? "pinned" : "not pinned",
           o->shared ? "memfd" : "anonymous");
    printf("| mode | pool pages | pool MiB | transfers | failed | peak resident MiB (OS) | "
           "counter MiB | peak in-flight MiB | resident / in-flight | wait p50 us | wait p99 us "
           "| transfers/s |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (size_t i = 0; i < nres; i++) {
        const bs_result_t *x = &res[i];
        uint32_t pool = x->m->pool_pages ? x->m->pool_pages : x->m->slots * x->m->slot_pages;
        printf("| %s | %u | %.1f | %llu | %llu | %.1f | %.1f | %.1f | %.2f | %.0f | %.0f | %.0f "
               "|\n",
               x->m->name, pool, x->pool_bytes / 1048576.0, (unsigned long long)x->transfers,
               (unsigned long long)x->failed, x->peak_resident_os / 1048576.0,
               x->peak_resident_counter / 1048576.0, x->peak_inflight / 1048576.0,
               x->peak_inflight ? (double)x->peak_resident_os / (double)x->peak_inflight : 0.0,
               x->wait_p50_us, x->wait_p99_us, x->transfers_per_s);
    }
    printf("\nacquire + release of 128 pages, uncontended: median %.0f ns (min %.0f ns) over 21 "
           "batches of 2000\n",
           ar_median, ar_min);
}

/* Under the table: where the OS and the counter disagree, pages not pinned, and each
 * mode's failed acquisitions with the first lines the stage logged. */
static void bs_print_notes(const bs_result_t *res, size_t nres)
{
    for (size_t i = 0; i < nres; i++) {
        const bs_result_t *x = &res[i];
        double os = (double)x->peak_resident_os, ctr = (double)x->peak_resident_counter;
        if (ctr > 0 && (os > ctr * 1.05 + 2097152.0 || os < ctr * 0.95 - 2097152.0))
            printf("\nnote: %s: OS peak %.1f MiB and the stage's counter %.1f MiB disagree\n",
                   x->m->name, os / 1048576.0, ctr / 1048576.0);
        if (x->pin_failed_pages)
            printf("\nnote: %s: the OS refused to pin %llu pages\n", x->m->name,
                   (unsigned long long)x->pin_failed_pages);
        if (!x->failed) continue;
        printf("\n%s: %llu failed acquisitions (", x->m->name, (unsigned long long)x->failed);
        const char *sep = "";
        for (int k = 1; k < 16; k++)
            if (x->by_rc[k]) {
                printf("%s%s %llu", sep, bs_reason(k), (unsigned long long)x->by_rc[k]);
                sep = ", ";
            }
        printf("); %zu lines logged, the first:\n", x->nlines);
        for (size_t k = 0; k < PKV_ARRAY_LEN(x->lines); k++)
            if (x->lines[k]) printf("    %s\n", x->lines[k]);
    }
}

int pkv_bench_staging(int argc, char **argv)
{
    bs_opts_t o = {.page_bytes = 72 * 1024,
                   .seconds = 2.0,
                   .copy_us = 2000,
                   .deadline_ms = 2000,
                   .seed = 1,
                   .pin = true};
    const char *json_path = NULL;
    int exit_code = bs_parse(argc, argv, &o, &json_path);
    if (exit_code >= 0) return exit_code;

    pkv_log_set_level(PKV_LOG_WARN);
    pkv_log_set_sink(bs_sink, NULL);
    bs_result_t res[PKV_ARRAY_LEN(bs_modes)];
    size_t nres = 0;
    int rc = PKV_OK;
    for (size_t i = 0; i < PKV_ARRAY_LEN(bs_modes) && !rc; i++) {
        if (pkv_cli_progress_enabled())
            fprintf(stderr, "bench staging: %s (%.0f s)...\n", bs_modes[i].name, o.seconds);
        rc = bs_run_mode(&o, &bs_modes[i], &res[i]);
        if (!rc) nres++;
    }
    pkv_log_set_sink(NULL, NULL);
    double ar_median = 0, ar_min = 0;
    if (!rc) rc = bs_acquire_release_128(&o, &ar_median, &ar_min);
    if (rc) {
        fprintf(stderr, "pagekv bench staging: %s\n", pkv_status_str(rc));
        bs_free_lines(res, nres);
        return 1;
    }
    bs_print_table(&o, res, nres, ar_median, ar_min);
    bs_print_notes(res, nres);
    if (json_path && bs_write_json(json_path, &o, res, nres, ar_median, ar_min)) {
        fprintf(stderr, "pagekv bench staging: cannot write %s\n", json_path);
        rc = 1;
    }
    bs_free_lines(res, nres);
    return rc ? 1 : 0;
}
