/*
 * pagekv bench footprint: the samplers (the server's VmRSS from prim every 100 ms, its
 * /v1/cache/stats every 250 ms, each on its own thread), a run's phases (VmHWM reset at
 * the start, VmHWM, status and smaps_rollup at the end, all through prim) and the
 * progress line.
 */
#include "footprint.h"

#include "core/core.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Sleep on the condvar until `deadline` or stop; true when stopping. */
static bool fp_sampler_wait(fp_sampler_t *sp, uint64_t deadline)
{
    struct timespec ts = pkv_deadline_to_monotonic(deadline);
    pthread_mutex_lock(&sp->lock);
    while (!sp->stop && pkv_now_ns() < deadline)
        if (pthread_cond_timedwait(&sp->cond, &sp->lock, &ts) == ETIMEDOUT) break;
    bool stop = sp->stop;
    pthread_mutex_unlock(&sp->lock);
    return stop;
}

static void *fp_rss_main(void *arg)
{
    fp_sampler_t *sp = arg;
    pthread_setname_np(pthread_self(), "fp-rss");
    uint64_t next = pkv_now_ns();
    do {
        pkv_prim_mem_t m;
        uint64_t t = pkv_now_ns();
        if (pkv_prim_mem_read(sp->pid, &m) == PKV_OK && m.rss_bytes) {
            if (sp->n == sp->cap) {
                size_t cap = sp->cap ? sp->cap * 2 : 1024;
                pkv_fp_sample_t *p = realloc(sp->s, cap * sizeof(*p));
                if (p) sp->s = p, sp->cap = cap;
            }
            if (sp->n < sp->cap) sp->s[sp->n++] = (pkv_fp_sample_t){t, m.rss_bytes};
            pthread_mutex_lock(&sp->lock);
            sp->last_rss = m.rss_bytes;
            pthread_mutex_unlock(&sp->lock);
        }
        next += FP_NS / 10;
        if (next < pkv_now_ns()) next = pkv_now_ns(); /* descheduled: no burst of catch-up */
    } while (!fp_sampler_wait(sp, next));
    return NULL;
}

static void *fp_stats_main(void *arg)
{
    fp_sampler_t *sp = arg;
    pthread_setname_np(pthread_self(), "fp-stats");
    uint64_t next = pkv_now_ns();
    do {
        json_t *j = NULL;
        char err[256];
        uint64_t t = pkv_now_ns();
        if (fp_http_json(sp->port, "GET", "/v1/cache/stats", 2.0, &j, err, sizeof(err)) == 0) {
            fp_kv_sample_t k = {.t_ns = t};
            bool have = fp_stat(j, K_COMMITTED, &k.committed);
            fp_stat(j, K_LIVE, &k.live_blocks);
            json_decref(j);
            if (have && sp->nk == sp->capk) {
                size_t cap = sp->capk ? sp->capk * 2 : 512;
                fp_kv_sample_t *p = realloc(sp->k, cap * sizeof(*p));
                if (p) sp->k = p, sp->capk = cap;
            }
            if (have && sp->nk < sp->capk) sp->k[sp->nk++] = k;
            if (have) {
                pthread_mutex_lock(&sp->lock);
                sp->last_committed = k.committed;
                pthread_mutex_unlock(&sp->lock);
            }
        }
        next += FP_NS / 4;
        if (next < pkv_now_ns()) next = pkv_now_ns();
    } while (!fp_sampler_wait(sp, next));
    return NULL;
}

int fp_sampler_init(fp_sampler_t *sp, pid_t pid)
{
    memset(sp, 0, sizeof(*sp));
    sp->pid = pid;
    if (pthread_mutex_init(&sp->lock, NULL)) return PKV_ERR_NOMEM;
    if (pkv_cond_init_monotonic(&sp->cond)) {
        pthread_mutex_destroy(&sp->lock);
        return PKV_ERR_NOMEM;
    }
    if (pthread_create(&sp->rss_thread, NULL, fp_rss_main, sp)) {
        pthread_cond_destroy(&sp->cond);
        pthread_mutex_destroy(&sp->lock);
        return PKV_ERR_NOMEM;
    }
    sp->rss_started = true;
    return PKV_OK;
}

int fp_sampler_start_stats(fp_sampler_t *sp, int port)
{
    sp->port = port;
    if (pthread_create(&sp->stats_thread, NULL, fp_stats_main, sp)) return PKV_ERR_NOMEM;
    sp->stats_started = true;
    return PKV_OK;
}

void fp_sampler_fini(fp_sampler_t *sp, fp_run_t *run)
{
    pthread_mutex_lock(&sp->lock);
    sp->stop = true;
    pthread_cond_broadcast(&sp->cond);
    pthread_mutex_unlock(&sp->lock);
    if (sp->rss_started) pthread_join(sp->rss_thread, NULL);
    if (sp->stats_started) pthread_join(sp->stats_thread, NULL);
    pthread_cond_destroy(&sp->cond);
    pthread_mutex_destroy(&sp->lock);
    run->samples = sp->s;
    run->n_samples = sp->n;
    run->kv = sp->k;
    run->n_kv = sp->nk;
}

static void fp_sampler_last(fp_sampler_t *sp, uint64_t *rss, uint64_t *committed)
{
    pthread_mutex_lock(&sp->lock);
    *rss = sp->last_rss;
    *committed = sp->last_committed;
    pthread_mutex_unlock(&sp->lock);
}

void fp_progress(fp_ctx_t *c, bool force)
{
    if (!c->progress) return;
    uint64_t now = pkv_now_ns();
    if (!force && now - c->last_progress_ns < FP_NS / 2) return;
    c->last_progress_ns = now;
    uint64_t rss, committed;
    fp_sampler_last(c->sp, &rss, &committed);
    char reqs[32] = "";
    if (c->total_reqs) snprintf(reqs, sizeof(reqs), " req %u/%u", c->done_reqs, c->total_reqs);
    fprintf(stderr, "\r\033[K[%u/%u] %s %s: %s %.0f s%s, rss %.0f MiB, kv %.0f MiB", c->index,
            c->total, fp_scenario_names[c->run->scenario], pkv_backend_name(c->run->backend),
            c->phase, (double)(now - c->phase_t0) / FP_NS, reqs, (double)rss / FP_MIB,
            (double)committed / FP_MIB);
    fflush(stderr);
}

void fp_idle(fp_ctx_t *c, double s)
{
    uint64_t deadline = pkv_now_ns() + (uint64_t)(s * (double)FP_NS);
    for (;;) {
        uint64_t now = pkv_now_ns();
        if (now >= deadline) break;
        uint64_t step = PKV_MIN(deadline - now, FP_NS / 4);
        struct timespec ts = {(time_t)(step / FP_NS), (long)(step % FP_NS)};
        nanosleep(&ts, NULL);
        fp_progress(c, false);
    }
}

void fp_phase_begin(fp_ctx_t *c, int ph, const char *label)
{
    fp_phase_t *p = &c->run->ph[ph];
    p->begin_ns = pkv_now_ns();
    p->hwm_reset = pkv_prim_hwm_reset_pid(c->srv->pid) == PKV_OK;
    c->phase = label;
    c->phase_t0 = p->begin_ns;
    fp_progress(c, true);
}

void fp_phase_end(fp_ctx_t *c, int ph)
{
    fp_phase_t *p = &c->run->ph[ph];
    p->end_ns = pkv_now_ns();
    pkv_prim_mem_t m;
    if (pkv_prim_mem_read(c->srv->pid, &m) == PKV_OK) {
        p->mem = m;
        p->hwm_bytes = p->hwm_reset ? m.hwm_bytes : 0;
    }
    p->have_smaps = pkv_prim_smaps_rollup(c->srv->pid, &p->smaps) == PKV_OK;
}
