/*
 * server: the prefix cache yields memory (docs/design/server.md, "Cache policy and memory
 * pressure"). The pool holds the policy (a byte cap, an idle time-to-live, a pressure
 * limit: docs/design/pool.md); this file chooses the server's defaults and runs the one
 * thread that applies the two that need time and the machine:
 *
 *   - the idle time-to-live: pkv_kv_trim on a timer (the pool owns no thread; the server
 *     needs this one anyway for the memory readings), so an idle server shrinks by itself;
 *   - memory pressure: every poll the memory left to the process is read through prim
 *     (cgroup v2 / v1 limit and usage of this cgroup and its ancestors, MemAvailable,
 *     PSI). Below 2 x reserve of room the cache is guarded: its committed bytes may grow
 *     only by what is left above the reserve (pkv_kv_cache_pressure(cache + room -
 *     reserve), enforced by the pool as blocks are released, between polls too), so
 *     cached blocks give way before the process pushes the machine into reclaim; with
 *     PSI some avg10 >= 10 % (the machine is already stalling) the limit is 0. The guard
 *     lifts at 3 x reserve of room and PSI below 5 %. Each guarded period is one episode:
 *     counted and logged once when it starts and once when it ends.
 *
 * With a warm floor (pkv_kv_config_t.warm_max_bytes) a second thread, "pkv-warm", commits
 * again what allocations took from it (pkv_kv_warm_refill), woken by the allocation's kick
 * (pkv_kv_on_warm_low). The refill is real CPU work (the kernel zeroes each granule it
 * commits, ~1 ms of CPU per MiB on a VM), and run beside a request it took a core from the
 * model threads while that request was still pulling and decoding; so it runs only while
 * the node is quiet (the server's busy probe: no generation request in flight, nothing
 * queued or running in the engine), MW_WARM_STEP granules at a time, looking again between steps
 * and every MW_WARM_WAIT_NS while busy. Under a load that never leaves the node quiet it waits, and
 * allocations commit on their own path as without a floor. It runs at normal priority: at
 * SCHED_IDLE a commit (mprotect, MADV_POPULATE_WRITE) holds the address space's lock, and
 * the pool's mutex around it, for as long as the thread waits for a core, and every thread
 * of the process that maps, unmaps or commits memory waits with it (4.6 s measured on two
 * saturated vCPUs; a decode node under bench disagg --interference lost its transfer peer
 * to the 1 s keepalive that way).
 *
 * Locking: w->lock guards stop, kicked and the figures in w->st; the threads call into the
 * pool and prim without it. Nothing else runs on these threads.
 */
#include "server/server_int.h"

#include "core/core.h"
#include "prim/prim.h"

#include <pthread.h>
#include <string.h>
#include <unistd.h>

#define MW_IDLE_DEFAULT_MS 300000u /* 5 min: what hosted APIs keep an unused prefix for */
#define MW_POLL_DEFAULT_MS 250u
#define MW_RESERVE_MIN     (32ull << 20)
#define MW_RESERVE_MAX     (1ull << 30)
#define MW_PSI_HIGH        10.0 /* % of the last 10 s some task stalled on memory */
#define MW_PSI_LOW         5.0
#define MW_MIN_WAIT_NS     (10ull * 1000 * 1000)
#define MW_WARM_DEFAULT    (256ull << 20)
#define MW_WARM_STEP       4u                    /* granules a refill step commits */
#define MW_WARM_WAIT_NS    (10ull * 1000 * 1000) /* between looks while the node is busy */
#define MW_WARM_LIFE_MS    30000u

struct srv_memwatch {
    pkv_kv_t *kv;
    char root[256];       /* prim's root for the readings ("" = the real files) */
    uint64_t reserve_cfg; /* 0: auto from each source's limit */
    uint64_t poll_ns;
    bool watch;
    pthread_t thread;
    pthread_t warm_thread; /* started when the pool has a warm floor */
    bool warm;
    bool (*busy)(void *arg); /* the node is not quiet: no refill now (NULL: always quiet) */
    void *busy_arg;
    pthread_mutex_t lock; /* guards stop, kicked, st */
    pthread_cond_t cv, warm_cv;
    bool stop;
    bool kicked; /* an allocation left the warm floor short: refill it */
    srv_memwatch_stats_t st;
    uint64_t ep_start_ns, ep_evictions0; /* this thread's own */
};

int srv_cache_policy(const pkv_server_config_t *cfg, uint64_t budget, pkv_kv_config_t *kc)
{
    switch (cfg->cache_max_mode) {
    case PKV_SERVER_BUDGET_NONE:
        kc->cache_max_bytes = 0;
        break;
    case PKV_SERVER_BUDGET_BYTES:
        if (!cfg->cache_max_bytes) {
            PKV_LOGE("server", "a prefix-cache cap of 0 bytes (use 'none' for no cap)");
            return PKV_ERR_INVALID;
        }
        kc->cache_max_bytes = cfg->cache_max_bytes;
        break;
    default: {
        long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        uint64_t mem = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : 8ull << 30;
        kc->cache_max_bytes = PKV_MAX(budget ? budget / 4 : mem / 8, 1);
        break;
    }
    }
    kc->cache_idle_ms = cfg->cache_idle_ms == PKV_SERVER_NEVER ? 0
                        : cfg->cache_idle_ms                   ? cfg->cache_idle_ms
                                                               : MW_IDLE_DEFAULT_MS;
    /* The warm floor lives on the watcher's trims: none without the thread (no TTL and no
     * watch), and it lapses no later than the cache's idle blocks do. auto: every role keeps
     * the empty granules of its largest recent admission (up to a quarter of the budget, at
     * most MW_WARM_DEFAULT): at a full cache each request's end evicts, and the next
     * admission would commit, a prompt's granules (docs/design/server.md, "The warm
     * floor"). Only a decode node (or one given --kv-warm-max) also refills it
     * (srv_warm_refills). */
    bool thread = kc->cache_idle_ms || !cfg->no_memory_watch;
    uint64_t want = cfg->kv_warm_max_bytes;
    if (!want) want = PKV_MIN(MW_WARM_DEFAULT, budget ? budget / 4 : UINT64_MAX);
    kc->warm_max_bytes = thread && want != UINT64_MAX ? want : 0;
    kc->warm_idle_ms =
        kc->cache_idle_ms ? PKV_MIN(kc->cache_idle_ms, MW_WARM_LIFE_MS) : MW_WARM_LIFE_MS;
    return PKV_OK;
}

bool srv_warm_refills(const pkv_server_config_t *cfg)
{
    return cfg->role == PKV_SERVER_ROLE_DECODE ||
           (cfg->kv_warm_max_bytes && cfg->kv_warm_max_bytes != UINT64_MAX);
}

/* ---- the watcher ------------------------------------------------------------------------ */

typedef struct {
    const char *source;
    const pkv_prim_room_src_t *src;
    uint64_t room, reserve;
} mw_reading_t;

static uint64_t mw_reserve(const srv_memwatch_t *w, uint64_t limit)
{
    return w->reserve_cfg ? w->reserve_cfg
                          : PKV_MIN(PKV_MAX(limit / 10, MW_RESERVE_MIN), MW_RESERVE_MAX);
}

/* Of the sources present, the one with the least room above its reserve. false: none. */
static bool mw_tightest(const srv_memwatch_t *w, const pkv_prim_room_t *r, mw_reading_t *out)
{
    const struct {
        const char *name;
        const pkv_prim_room_src_t *s;
    } srcs[] = {{r->cgroup_version == 2 ? "cgroup_v2" : "cgroup_v1", &r->cgroup},
                {"meminfo", &r->machine}};
    bool found = false;
    for (size_t i = 0; i < PKV_ARRAY_LEN(srcs); i++) {
        const pkv_prim_room_src_t *s = srcs[i].s;
        if (!s->present) continue;
        uint64_t room = s->limit_bytes - PKV_MIN(s->limit_bytes, s->usage_bytes);
        uint64_t reserve = mw_reserve(w, s->limit_bytes);
        /* room - reserve < out->room - out->reserve, without unsigned underflow */
        if (!found || room + out->reserve < out->room + reserve) {
            *out =
                (mw_reading_t){.source = srcs[i].name, .src = s, .room = room, .reserve = reserve};
            found = true;
        }
    }
    return found;
}

/* One reading and what it asks of the cache. Runs on the watcher thread. */
static void mw_check(srv_memwatch_t *w)
{
    pkv_prim_room_t r;
    mw_reading_t t = {.source = "none"};
    if (pkv_prim_room_read(w->root, &r) != PKV_OK) memset(&r, 0, sizeof(r));
    bool have = mw_tightest(w, &r, &t);
    bool psi_high = r.have_psi && r.psi_some_avg10 >= MW_PSI_HIGH;
    bool psi_low = !r.have_psi || r.psi_some_avg10 < MW_PSI_LOW;
    pkv_kv_stats_t ks;
    pkv_kv_stats(w->kv, &ks);
    pthread_mutex_lock(&w->lock);
    bool guarding = w->st.guarding;
    pthread_mutex_unlock(&w->lock);
    bool tight = psi_high || (have && t.room < 2 * t.reserve);
    bool eased = psi_low && (!have || t.room >= 3 * t.reserve);
    uint64_t limit = PKV_KV_NO_LIMIT;
    if (tight || (guarding && !eased)) {
        uint64_t above = have && t.room > t.reserve ? t.room - t.reserve : 0;
        uint64_t below = have && t.room < t.reserve ? t.reserve - t.room : 0;
        limit = psi_high ? 0 : ks.cache_bytes + above - PKV_MIN(ks.cache_bytes + above, below);
    }
    pkv_kv_cache_pressure(w->kv, limit);
    bool now_guarding = limit != PKV_KV_NO_LIMIT;
    if (now_guarding && !guarding) {
        w->ep_start_ns = pkv_now_ns();
        w->ep_evictions0 = ks.evictions_pressure;
        PKV_LOGW("server",
                 "memory pressure (%s: %llu MiB left of %llu MiB, reserve %llu MiB%s%.1f%%): "
                 "cached blocks held to %llu MiB (now %llu MiB)",
                 t.source, (unsigned long long)(t.room >> 20),
                 (unsigned long long)(have ? t.src->limit_bytes >> 20 : 0),
                 (unsigned long long)(t.reserve >> 20), r.have_psi ? ", PSI some avg10 " : "",
                 r.have_psi ? r.psi_some_avg10 : 0.0, (unsigned long long)(limit >> 20),
                 (unsigned long long)(ks.cache_bytes >> 20));
    } else if (!now_guarding && guarding) {
        PKV_LOGI(
            "server",
            "memory pressure over after %.1f s: %llu cached blocks dropped (%s: %llu MiB left)",
            (double)(pkv_now_ns() - w->ep_start_ns) / 1e9,
            (unsigned long long)(ks.evictions_pressure - w->ep_evictions0), t.source,
            (unsigned long long)(t.room >> 20));
    }
    pthread_mutex_lock(&w->lock);
    w->st.source = t.source;
    w->st.limit_bytes = have ? t.src->limit_bytes : 0;
    w->st.usage_bytes = have ? t.src->usage_bytes : 0;
    w->st.room_bytes = t.room;
    w->st.reserve_bytes = t.reserve;
    w->st.have_psi = r.have_psi;
    w->st.psi_some_avg10 = r.psi_some_avg10;
    w->st.guarding = now_guarding;
    w->st.episodes += now_guarding && !guarding;
    w->st.cache_limit = limit;
    w->st.readings++;
    pthread_mutex_unlock(&w->lock);
}

/* The time-to-live just evicted blocks: when nothing is live any more the server has gone
 * idle, and the C heap's free pages (connection threads' arenas) go back too. */
static void mw_went_idle(srv_memwatch_t *w)
{
    pkv_kv_stats_t ks;
    pkv_kv_stats(w->kv, &ks);
    if (!ks.blocks_live && !ks.sequences) pkv_prim_heap_trim();
}

static void *mw_main(void *arg)
{
    srv_memwatch_t *w = arg;
    pthread_setname_np(pthread_self(), "pkv-memwatch");
    pthread_mutex_lock(&w->lock);
    while (!w->stop) {
        pthread_mutex_unlock(&w->lock);
        uint64_t now = pkv_now_ns(), next_idle = UINT64_MAX;
        uint64_t n = pkv_kv_trim(w->kv, now, &next_idle);
        if (n) mw_went_idle(w);
        if (w->watch) mw_check(w);
        uint64_t deadline = PKV_MIN(now + w->poll_ns, PKV_MAX(next_idle, now + MW_MIN_WAIT_NS));
        pthread_mutex_lock(&w->lock);
        w->st.trim_evictions += n;
        if (w->stop) break;
        struct timespec ts = pkv_deadline_to_monotonic(deadline);
        pthread_cond_timedwait(&w->cv, &w->lock, &ts);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

static void *mw_warm_main(void *arg)
{
    srv_memwatch_t *w = arg;
    pthread_setname_np(pthread_self(), "pkv-warm");
    pthread_mutex_lock(&w->lock);
    while (!w->stop) {
        if (!w->kicked) {
            pthread_cond_wait(&w->warm_cv, &w->lock);
            continue;
        }
        w->kicked = false; /* a kick from now on asks again */
        pthread_mutex_unlock(&w->lock);
        bool busy = w->busy && w->busy(w->busy_arg);
        uint32_t got = busy ? 0 : pkv_kv_warm_refill(w->kv, MW_WARM_STEP);
        pthread_mutex_lock(&w->lock);
        if (!busy && got < MW_WARM_STEP) continue; /* the floor is full (or cannot grow) */
        w->kicked = true;                          /* more to do: at once, or once quiet */
        if (busy && !w->stop) {
            struct timespec ts = pkv_deadline_to_monotonic(pkv_now_ns() + MW_WARM_WAIT_NS);
            pthread_cond_timedwait(&w->warm_cv, &w->lock, &ts);
        }
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

/* Stop both threads and join the watcher's (the caller joins pkv-warm when it runs). */
static void mw_stop(srv_memwatch_t *w)
{
    pthread_mutex_lock(&w->lock);
    w->stop = true;
    pthread_cond_signal(&w->cv);
    pthread_cond_signal(&w->warm_cv);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
}

int srv_memwatch_create(const pkv_server_config_t *cfg, pkv_kv_t *kv, bool (*busy)(void *arg),
                        void *busy_arg, srv_memwatch_t **out)
{
    pkv_kv_stats_t ks;
    pkv_kv_stats(kv, &ks);
    *out = NULL;
    if (pkv_kv_backend(kv) != PKV_BACKEND_PAGED || (!ks.cache_idle_ms && cfg->no_memory_watch))
        return PKV_OK;
    srv_memwatch_t *w = calloc(1, sizeof(*w));
    if (!w) return PKV_ERR_NOMEM;
    w->kv = kv;
    w->busy = busy;
    w->busy_arg = busy_arg;
    if (cfg->memory_root && strcmp(cfg->memory_root, "/"))
        snprintf(w->root, sizeof(w->root), "%s", cfg->memory_root);
    w->reserve_cfg = cfg->memory_reserve_bytes;
    w->poll_ns =
        (uint64_t)(cfg->memory_poll_ms ? cfg->memory_poll_ms : MW_POLL_DEFAULT_MS) * 1000000;
    w->watch = !cfg->no_memory_watch;
    w->st = (srv_memwatch_stats_t){
        .running = true, .watching = w->watch, .source = "none", .cache_limit = PKV_KV_NO_LIMIT};
    if (pthread_mutex_init(&w->lock, NULL)) goto fail_lock;
    if (pkv_cond_init_monotonic(&w->cv)) goto fail_cv;
    if (pkv_cond_init_monotonic(&w->warm_cv)) goto fail_warm_cv;
    if (pthread_create(&w->thread, NULL, mw_main, w)) goto fail_thread;
    if (ks.warm_max_bytes && srv_warm_refills(cfg)) {
        w->st.warm_refill = true;
        if (pthread_create(&w->warm_thread, NULL, mw_warm_main, w)) {
            mw_stop(w);
            goto fail_thread;
        }
        w->warm = true;
    }
    *out = w;
    return PKV_OK;
fail_thread:
    pthread_cond_destroy(&w->warm_cv);
fail_warm_cv:
    pthread_cond_destroy(&w->cv);
fail_cv:
    pthread_mutex_destroy(&w->lock);
fail_lock:
    free(w);
    return PKV_ERR_NOMEM;
}

void srv_memwatch_destroy(srv_memwatch_t *w)
{
    if (!w) return;
    mw_stop(w);
    if (w->warm) pthread_join(w->warm_thread, NULL);
    pthread_cond_destroy(&w->warm_cv);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->lock);
    free(w);
}

void srv_memwatch_kick(void *arg)
{
    srv_memwatch_t *w = arg;
    pthread_mutex_lock(&w->lock);
    w->kicked = true;
    pthread_cond_signal(&w->warm_cv);
    pthread_mutex_unlock(&w->lock);
}

void srv_memwatch_stats(srv_memwatch_t *w, srv_memwatch_stats_t *out)
{
    if (!w) {
        *out = (srv_memwatch_stats_t){.source = "none", .cache_limit = PKV_KV_NO_LIMIT};
        return;
    }
    pthread_mutex_lock(&w->lock);
    *out = w->st;
    pthread_mutex_unlock(&w->lock);
}

/* ---- rendering ---------------------------------------------------------------------------- */

static json_t *mw_bytes_or_null(uint64_t v, bool present)
{
    return present ? json_integer((json_int_t)v) : json_null();
}

void srv_cache_policy_json(json_t *doc, const pkv_kv_stats_t *ks, const srv_memwatch_stats_t *m)
{
    json_t *pc = json_object_get(doc, "prefix_cache");
    if (pc) {
        json_object_set_new(pc, "bytes", json_integer((json_int_t)ks->cache_bytes));
        json_object_set_new(pc, "max_bytes",
                            mw_bytes_or_null(ks->cache_max_bytes, ks->cache_max_bytes));
        json_object_set_new(pc, "idle_s",
                            ks->cache_idle_ms ? json_real((double)ks->cache_idle_ms / 1e3)
                                              : json_null());
        json_object_set_new(pc, "pressure_limit_bytes",
                            mw_bytes_or_null(ks->cache_pressure_limit,
                                             ks->cache_pressure_limit != PKV_KV_NO_LIMIT));
        json_object_set_new(
            pc, "evictions",
            json_pack("{s:I, s:I, s:I, s:I, s:I}", "cap", (json_int_t)ks->evictions_cap, "idle",
                      (json_int_t)ks->evictions_idle, "pressure",
                      (json_int_t)ks->evictions_pressure, "budget",
                      (json_int_t)ks->evictions_budget, "reset", (json_int_t)ks->evictions_reset));
    }
    json_object_set_new(
        doc, "memory",
        json_pack(
            "{s:b, s:s, s:o, s:o, s:o, s:o, s:o, s:b, s:I, s:I}", "watch", m->watching, "source",
            m->source, "limit_bytes", mw_bytes_or_null(m->limit_bytes, m->limit_bytes),
            "usage_bytes", mw_bytes_or_null(m->usage_bytes, m->limit_bytes), "room_bytes",
            mw_bytes_or_null(m->room_bytes, m->limit_bytes), "reserve_bytes",
            mw_bytes_or_null(m->reserve_bytes, m->limit_bytes), "psi_some_avg10",
            m->have_psi ? json_real(m->psi_some_avg10) : json_null(), "pressure", m->guarding,
            "pressure_episodes", (json_int_t)m->episodes, "readings", (json_int_t)m->readings));
}

void srv_cache_policy_render(FILE *f, const pkv_kv_stats_t *ks, const srv_memwatch_stats_t *m)
{
    srv_metric_one(f, "pagekv_kv_cache_bytes", "gauge",
                   "Committed KV memory held only by cached prefix blocks.", ks->cache_bytes);
    srv_metric_one(f, "pagekv_kv_cache_max_bytes", "gauge",
                   "Cap on pagekv_kv_cache_bytes (0: none).", ks->cache_max_bytes);
    srv_metric_family(f, "pagekv_kv_cache_idle_seconds", "gauge",
                      "Idle time after which a cached block is evicted (0: never).");
    fprintf(f, "pagekv_kv_cache_idle_seconds %.3f\n", (double)ks->cache_idle_ms / 1e3);
    srv_metric_family(f, "pagekv_kv_cache_evictions_total", "counter",
                      "Cached prefix blocks evicted, by cause.");
    const struct {
        const char *cause;
        uint64_t v;
    } ev[] = {{"cap", ks->evictions_cap},
              {"idle", ks->evictions_idle},
              {"pressure", ks->evictions_pressure},
              {"budget", ks->evictions_budget},
              {"reset", ks->evictions_reset}};
    for (size_t i = 0; i < PKV_ARRAY_LEN(ev); i++)
        fprintf(f, "pagekv_kv_cache_evictions_total{cause=\"%s\"} %llu\n", ev[i].cause,
                (unsigned long long)ev[i].v);
    if (!m->watching) return;
    srv_metric_one(f, "pagekv_memory_room_bytes", "gauge",
                   "Memory left to the process (the tightest of its cgroup and the machine).",
                   m->room_bytes);
    srv_metric_one(f, "pagekv_memory_reserve_bytes", "gauge",
                   "Memory the prefix cache leaves to the machine.", m->reserve_bytes);
    srv_metric_one(f, "pagekv_memory_pressure", "gauge",
                   "1 while the prefix cache is held out of the reserve.", m->guarding);
    srv_metric_one(f, "pagekv_memory_pressure_episodes_total", "counter",
                   "Memory pressure episodes (each logged once).", m->episodes);
}
