/*
 * Two-process transfer harness (see xfer_harness.h). Used by `pagekv bench xfer` and
 * tests/test_xfer.c.
 *
 * Processes and pipes:
 *   parent --fork--> producer: builds pool + stage + agent, registers, sends HANDLES,
 *                              waits for FINISH, sends PREPORT, exits
 *   parent --fork--> consumer: receives HANDLES, reads, verifies, sends CREPORT, exits
 * The result is one xh_result_t in memory the three processes share (MAP_SHARED, mapped
 * before the forks): each child writes its own fields and then sends its report message,
 * which only says "done"; the parent writes the rest and copies the whole to the caller.
 * A child that kills or stops itself first writes its clock at the signal (kill_at_ns) and
 * sends KILLTIME; CLOCK_MONOTONIC is system-wide, so the consumer's outcome times compare
 * directly. A fault the parent acts on waits for its event: a stopped consumer is killed
 * once the producer says its serves failed (SERVES_FAILED). The parent bounds every wait
 * and kills both children when a bound passes.
 */
#include "support/xfer_harness.h"

#include "support/bench.h"
#include "support/rtt_probe.h"
#include "support/xfer_proc.h"

#include "core/core.h"
#include "pagekv/stage.h"
#include "pagekv/xfer.h"
#include "xfer/xfer.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

enum { M_HANDLES = 1, M_KILLTIME, M_PREPORT, M_CREPORT, M_SETUP_FAIL, M_SERVES_FAILED };

double xh_memcpy_gbps(int samples, bool cold)
{
    enum { BYTES = 16 << 20, REPS = 4, COLD_SLOTS = 8 };
    size_t region = cold ? (size_t)BYTES * COLD_SLOTS : BYTES;
    uint8_t *a = malloc(region), *b = malloc(region);
    double v[16];
    samples = PKV_MAX(1, PKV_MIN(samples, 16));
    if (!a || !b) {
        free(a);
        free(b);
        return 0;
    }
    memset(a, 1, region);
    memset(b, 2, region);
    size_t next = 0;
    for (int s = 0; s < samples; s++) {
        uint64_t t0 = pkv_now_ns();
        for (int r = 0; r < REPS; r++) {
            size_t off = cold ? (next++ % COLD_SLOTS) * (size_t)BYTES : 0;
            memcpy(b + off, a + off, BYTES);
            __asm__ volatile("" ::"r"(b) : "memory");
        }
        v[s] = (double)BYTES * REPS / (double)(pkv_now_ns() - t0);
    }
    free(a);
    free(b);
    return pkv_bench_median(v, (size_t)samples);
}

/* ---- messages between the processes --------------------------------------------------- */
static int send_msg(int fd, uint32_t type, const void *p, uint32_t len)
{
    uint32_t hdr[2] = {type, len};
    if (xh_write_all(fd, hdr, sizeof(hdr))) return -1;
    return len ? xh_write_all(fd, p, len) : 0;
}

/* One message; *payload is malloc'd (free it). */
static int recv_msg(int fd, uint32_t *type, void **payload, uint32_t *len, uint64_t deadline_ns)
{
    uint32_t hdr[2];
    int rc = xh_read_all(fd, hdr, sizeof(hdr), deadline_ns);
    if (rc) return rc;
    if (hdr[1] > (64u << 20)) return -1;
    void *p = malloc(hdr[1] ? hdr[1] : 1);
    if (!p) return -1;
    if (hdr[1] && (rc = xh_read_all(fd, p, hdr[1], deadline_ns))) {
        free(p);
        return rc;
    }
    *type = hdr[0];
    *payload = p;
    *len = hdr[1];
    return 0;
}

/* ---- child plumbing -------------------------------------------------------------------- */
static int enter_netns(const char *name)
{
    if (!name) return 0;
    char path[128];
    snprintf(path, sizeof(path), "/var/run/netns/%s", name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int rc = setns(fd, CLONE_NEWNET);
    close(fd);
    if (rc) return rc;
    /* Like `ip netns exec`: UCX finds network devices in /sys/class/net, which shows the
     * namespace of whoever mounted /sys. Remount it in a private mount namespace. */
    if (unshare(CLONE_NEWNS) || mount("", "/", NULL, MS_SLAVE | MS_REC, NULL)) return -1;
    umount2("/sys", MNT_DETACH);
    return mount("sysfs", "/sys", "sysfs", 0, NULL);
}

/* Globals of a child process (each child has its own copy after fork). */
static const xh_case_t *g_case;
static xh_result_t *g_res; /* the result, shared with the parent: each child fills its own
                              fields, then says so (M_PREPORT / M_CREPORT) */
static int g_report_fd = -1;
static atomic_int g_trigger; /* the hook saw its point: the main thread acts */

static void child_fail(const char *what, int rc)
{
    char msg[160];
    snprintf(msg, sizeof(msg), "%s: %s", what, pkv_status_str(rc));
    send_msg(g_report_fd, M_SETUP_FAIL, msg, (uint32_t)strlen(msg) + 1);
    exit(3);
}

/* A child's fault: note when (its clock, for the detection time), tell the parent, then
 * take the signal. */
static void signal_self(int sig)
{
    g_res->kill_at_ns = pkv_now_ns();
    send_msg(g_report_fd, M_KILLTIME, NULL, 0);
    raise(sig);
}

static void producer_hook(void *arg, pkv_xfer_fault_point_t pt, uint32_t layer)
{
    (void)arg;
    xh_fault_t f = g_case->fault;
    if (pt == PKV_XFER_FAULT_SERVE_LAYER_SENT && layer == 1) {
        if (f == XH_PRODUCER_KILLED_DURING || f == XH_PRODUCER_STOPPED)
            signal_self(f == XH_PRODUCER_STOPPED ? SIGSTOP : SIGKILL);
        if (f == XH_SHUTDOWN_PRODUCER) atomic_store(&g_trigger, 1);
    }
    if (pt == PKV_XFER_FAULT_SERVE_ALL_SENT && f == XH_PRODUCER_KILLED_AFTER) signal_self(SIGKILL);
    if (pt == PKV_XFER_FAULT_SERVE_COPIED) {
        if (layer == 1 && f == XH_PRODUCER_KILLED_STAGING) signal_self(SIGKILL);
        /* Slow staging: the deadline passes (DEADLINE), or the transfer is still going
         * when the other side acts (SHUTDOWN_*, CANCEL). */
        if (f == XH_DEADLINE) usleep((useconds_t)(g_case->deadline_ms * 1000 / 3));
        if (f == XH_SHUTDOWN_CONSUMER || f == XH_SHUTDOWN_PRODUCER || f == XH_CANCEL ||
            f == XH_CONSUMER_KILLED_DURING || f == XH_CONSUMER_STOPPED)
            usleep(100000);
    }
}

static void consumer_hook(void *arg, pkv_xfer_fault_point_t pt, uint32_t layer)
{
    (void)arg;
    xh_fault_t f = g_case->fault;
    if (pt == PKV_XFER_FAULT_READ_LAYER_RECEIVED && layer == 1) {
        if (f == XH_CONSUMER_KILLED_DURING) raise(SIGKILL);
        if (f == XH_CONSUMER_STOPPED) signal_self(SIGSTOP);
        if (f == XH_SHUTDOWN_CONSUMER || f == XH_CANCEL) atomic_store(&g_trigger, 1);
    }
}

static uint32_t pages_for(const xh_case_t *c, size_t page_bytes)
{
    uint64_t bytes = (uint64_t)pkv_geometry_token_bytes(&c->geo) *
                     PKV_ALIGN_UP(c->n_tokens, c->geo.block_tokens ? c->geo.block_tokens : 16);
    return (uint32_t)PKV_DIV_UP(bytes, page_bytes);
}

static pkv_stage_t *make_stage(const xh_case_t *c, uint32_t pages)
{
    pkv_stage_config_t sc;
    pkv_stage_config_default(&sc);
    sc.page_bytes = c->page_bytes ? c->page_bytes : 64 << 10;
    uint32_t per = pages_for(c, sc.page_bytes);
    /* transfers that may hold staging at once (+1: a read's successor may arrive before
     * its staging is back) */
    uint32_t batch = c->sequential ? 2
                     : c->window   ? c->window + 1
                                   : PKV_MAX(c->warmup, c->n_requests - c->warmup);
    sc.pool_pages = pages ? pages : per * PKV_MAX(batch, 1) + 4;
    if (c->fixed_slots) {
        sc.mode = PKV_STAGE_FIXED_SLOTS;
        sc.slot_pages = pages ? pages : per + 1;
        sc.slots = pages ? 1 : PKV_MAX(batch, 1);
        sc.pool_pages = 0;
    }
    sc.idle_release_ns = 5000000000ull; /* keep warm pages across the timed reads */
    sc.pin = false;
    sc.shared = c->shared;
    pkv_stage_t *st;
    int rc = pkv_stage_create(&sc, &st);
    if (rc) child_fail("stage create", rc);
    /* Take every page once (one grant per slot in fixed mode), then give them back warm. */
    uint32_t takes = c->prewarm ? (sc.slots ? sc.slots : 1) : 0;
    for (uint32_t i = 0; i < takes; i++) {
        pkv_stage_grant_t *g;
        uint32_t n = sc.slots ? sc.slot_pages : sc.pool_pages;
        rc = pkv_stage_acquire(st, (1ull << 60) + i, 0, n, PKV_DEADLINE_NEVER, &g);
        if (rc) child_fail("stage prewarm", rc);
        pkv_stage_grant_free(g);
    }
    for (uint32_t i = 0; i < takes; i++) pkv_stage_release(st, (1ull << 60) + i);
    return st;
}

/* One side's staging: `pages` (0: sized for the case), half a transfer's worth when the
 * case makes this side too small, and with every page taken by a hog grant (freed with
 * hog_release) when the case fills this side's staging. */
#define XH_HOG_TRANSFER (1ull << 61)
static pkv_stage_t *side_stage(const xh_case_t *c, uint32_t pages, bool too_small, bool full,
                               pkv_stage_grant_t **hog)
{
    if (too_small) pages = pages_for(c, c->page_bytes ? c->page_bytes : 65536) / 2;
    pkv_stage_t *st = make_stage(c, pages);
    *hog = NULL;
    if (full) {
        int rc = pkv_stage_acquire(st, XH_HOG_TRANSFER, 999, pkv_stage_pool_pages(st),
                                   PKV_DEADLINE_NEVER, hog);
        if (rc) child_fail("hog staging", rc);
    }
    return st;
}

static void hog_release(pkv_stage_t *st, pkv_stage_grant_t *hog)
{
    if (!hog) return;
    pkv_stage_release(st, XH_HOG_TRANSFER);
    pkv_stage_grant_free(hog);
}

static pkv_kv_t *make_kv(const xh_case_t *c)
{
    pkv_kv_config_t kc;
    memset(&kc, 0, sizeof(kc));
    kc.geo = c->geo;
    kc.backend = PKV_BACKEND_PAGED;
    kc.no_prefix_cache = true;
    /* As a server's pool (huge pages by default) and the lean pull's: on a VM whose host
     * shadows the guest's page tables (PVM) the first write to each freshly committed 4 KiB
     * page costs ~5-12 us, so a 4 KiB-page pool capped every read's copy into it near
     * 0.9 GB/s (the consumer's destinations are fresh blocks). */
    kc.hugepages = true;
    pkv_kv_t *kv;
    int rc = pkv_kv_create(&kc, &kv);
    if (rc) child_fail("kv create", rc);
    return kv;
}

static pkv_xfer_agent_t *make_agent(const xh_case_t *c, pkv_kv_t *kv, pkv_stage_t *st,
                                    const char *host, bool producer)
{
    pkv_xfer_config_t xc;
    memset(&xc, 0, sizeof(xc));
    xc.kv = kv;
    xc.stage = st;
    xc.listen_host = host;
    xc.chunk_bytes = c->chunk_bytes;
    xc.workers = c->workers;
    xc.no_shared = !c->shared;
    /* The producer hook sleeps inside the copy for these (slow staging): that copy must
     * run on a worker, not hold up the progress thread, and the consumer must read layer
     * by layer (a small transfer read as a whole stream has no "mid-transfer" for its
     * hook to act in). So must a producer killed or stopped after its first layers went
     * out: a small read's one DATA (shared arena) announces every layer, and through UCX
     * its MACs leave with its last chunk (wire v3 and later), so the consumer could complete
     * after the producer died. */
    xh_fault_t f = c->fault;
    xc.no_inline_copy = f == XH_DEADLINE || f == XH_SHUTDOWN_CONSUMER ||
                        f == XH_SHUTDOWN_PRODUCER || f == XH_CANCEL ||
                        f == XH_CONSUMER_KILLED_DURING || f == XH_CONSUMER_STOPPED ||
                        f == XH_PRODUCER_KILLED_DURING || f == XH_PRODUCER_STOPPED;
    pkv_xfer_agent_t *a;
    int rc = pkv_xfer_agent_create(&xc, &a);
    if (rc) child_fail("agent create", rc);
    pkv_xfer_faults_t hooks = {.fn = producer ? producer_hook : consumer_hook,
                               .corrupt_layer =
                                   (producer && (f == XH_CORRUPT || f == XH_FORGED)) ? 1 : -1,
                               .forge_mac = producer && f == XH_FORGED};
    pkv_xfer_set_faults(a, &hooks);
    return a;
}

static pkv_seq_t *make_seq(pkv_kv_t *kv, uint32_t r, uint32_t n_tokens, bool append)
{
    int32_t *tok = malloc(sizeof(int32_t) * n_tokens);
    for (uint32_t i = 0; i < n_tokens; i++) tok[i] = (int32_t)(r * 100003u + i);
    pkv_seq_params_t sp = {
        .tokens = tok, .n_tokens = append ? n_tokens : 1, .reserve_tokens = n_tokens};
    pkv_seq_t *s;
    uint32_t cached;
    int rc = pkv_seq_create(kv, &sp, &s, &cached);
    if (rc) child_fail("seq create", rc);
    if (append) {
        xh_pattern_apply(s, pkv_kv_geometry(kv), g_case->seed, r, n_tokens, true);
        rc = pkv_seq_append(s, tok, n_tokens);
        if (rc) child_fail("seq append", rc);
    }
    free(tok);
    return s;
}

static uint64_t blocks_live(pkv_kv_t *kv)
{
    pkv_kv_stats_t ks;
    pkv_kv_stats(kv, &ks);
    return ks.blocks_live;
}

static uint64_t stage_used(pkv_stage_t *st)
{
    pkv_stage_stats_t ss;
    pkv_stage_stats(st, &ss);
    return ss.pages_used;
}

/* One side's pool, staging and agent. */
typedef struct {
    pkv_kv_t *kv;
    pkv_seq_t **seqs; /* n of them */
    uint32_t n;
    pkv_stage_t *st;
    pkv_stage_grant_t *hog;
    pkv_xfer_agent_t *a; /* NULL once destroyed */
} side_t;

/* Tears down what side_setup built but the agent (the caller ends that first, reading its
 * counters); the side's leftovers go to the result. */
static void side_teardown(side_t *s, uint64_t *staging_left, uint64_t *blocks, int *stage_rc,
                          uint64_t *stage_leaked)
{
    hog_release(s->st, s->hog);
    *staging_left = stage_used(s->st);
    for (uint32_t r = 0; r < s->n; r++) pkv_seq_free(s->seqs[r]);
    free(s->seqs);
    *blocks = blocks_live(s->kv);
    size_t leaked = 0;
    *stage_rc = pkv_stage_destroy(s->st, pkv_deadline_after_ns(2000000000ull), &leaked);
    *stage_leaked = leaked;
    pkv_kv_destroy(s->kv);
}

/* Each side's pool holds n requests (the producer's filled with the pattern), its staging
 * sized (or starved) as the case says, and its agent. */
static void side_setup(const xh_case_t *c, side_t *s, uint32_t n, bool producer)
{
    xh_fault_t f = c->fault;
    s->kv = make_kv(c);
    s->n = n;
    s->seqs = calloc(n, sizeof(*s->seqs));
    if (!s->seqs) child_fail("seqs", PKV_ERR_NOMEM);
    for (uint32_t r = 0; r < n; r++) s->seqs[r] = make_seq(s->kv, r, c->n_tokens, producer);
    if (producer)
        s->st = side_stage(c, c->prod_pages, f == XH_NOFIT_PRODUCER, f == XH_STAGING_FULL_PRODUCER,
                           &s->hog);
    else
        s->st = side_stage(c, c->cons_pages, f == XH_NOFIT_CONSUMER, f == XH_STAGING_FULL_CONSUMER,
                           &s->hog);
    s->a = make_agent(c, s->kv, s->st, producer ? c->prod_host : NULL, producer);
}

/* Register every request (and the idle ones) and send the parent the handles: u32 count,
 * then per handle u32 length + bytes. */
static void producer_send_handles(const xh_case_t *c, side_t *s)
{
    size_t off = 4;
    uint8_t *msg = malloc(4);
    memcpy(msg, &c->n_requests, 4);
    for (uint32_t r = 0; r < c->n_requests; r++) {
        const uint32_t *ids;
        uint32_t n;
        pkv_seq_blocks(s->seqs[r], &ids, &n);
        pkv_xfer_handle_t *h;
        int rc = pkv_xfer_register(s->a, 1000 + r, ids, n, pkv_deadline_after_ns(120000000000ull),
                                   NULL, NULL, &h);
        if (rc) child_fail("register", rc);
        size_t hb = pkv_xfer_handle_bytes(h), len = 0;
        msg = realloc(msg, off + 4 + hb);
        uint32_t l32 = (uint32_t)hb;
        memcpy(msg + off, &l32, 4);
        pkv_xfer_handle_encode(h, msg + off + 4, hb, &len);
        off += 4 + len;
        pkv_xfer_handle_free(h);
    }
    const uint32_t *idle_ids;
    uint32_t idle_n;
    pkv_seq_blocks(s->seqs[0], &idle_ids, &idle_n);
    for (uint32_t k = 0; k < c->idle_regs; k++) {
        pkv_xfer_handle_t *h;
        int rc = pkv_xfer_register(s->a, (1ull << 40) + k, idle_ids, idle_n, PKV_DEADLINE_NEVER,
                                   NULL, NULL, &h);
        if (rc) child_fail("register (idle)", rc);
        pkv_xfer_handle_free(h);
    }
    send_msg(g_report_fd, M_HANDLES, msg, (uint32_t)off);
    free(msg);
}

/* Every serve the producer started has failed and given its sends back: what the parent
 * waits for before it kills a stopped consumer. */
static bool serves_all_failed(pkv_xfer_agent_t *a)
{
    pkv_xfer_stats_t s;
    pkv_xfer_stats(a, &s);
    return s.serves_started && s.serves_failed == s.serves_started && !s.active_transfers;
}

/* Wait for the parent's FINISH, acting on the case's events meanwhile: the hook's trigger
 * (SHUTDOWN_PRODUCER destroys the agent), the serves to a stopped consumer failing
 * (CONSUMER_STOPPED: M_SERVES_FAILED to the parent). */
static void producer_wait_finish(const xh_case_t *c, side_t *s, int from_parent)
{
    uint64_t until = pkv_now_ns() + (c->deadline_ms + 60000) * 1000000ull;
    bool told = false;
    for (;;) {
        if (c->fault == XH_SHUTDOWN_PRODUCER && s->a && atomic_load(&g_trigger)) {
            pkv_xfer_agent_destroy(s->a);
            s->a = NULL;
        }
        if (c->fault == XH_CONSUMER_STOPPED && !told && s->a && serves_all_failed(s->a)) {
            send_msg(g_report_fd, M_SERVES_FAILED, NULL, 0);
            told = true;
        }
        struct pollfd pfd = {.fd = from_parent, .events = POLLIN};
        if (poll(&pfd, 1, 5) > 0 || pkv_now_ns() > until) break;
    }
}

/* The agent's counters once it is idle and the idle registrations are gone, into the
 * result; then the agent ends. */
static void producer_count(const xh_case_t *c, pkv_xfer_agent_t *a, xh_result_t *res)
{
    pkv_xfer_wait_idle(a, pkv_deadline_after_ns(3000000000ull));
    pkv_xfer_stats_t s;
    pkv_xfer_stats(a, &s);
    uint64_t left = s.registrations - c->idle_regs; /* the real ones still held */
    for (uint32_t k = 0; k < c->idle_regs; k++) pkv_xfer_unregister(a, (1ull << 40) + k);
    uint64_t idle_until = pkv_deadline_after_ns(3000000000ull);
    while (c->idle_regs && s.registrations > left && pkv_now_ns() < idle_until) {
        usleep(1000);
        pkv_xfer_stats(a, &s); /* unregister ends them on the agent's next tick */
    }
    res->sent = s.sent;
    res->serves_started = s.serves_started;
    res->serves_failed = s.serves_failed;
    res->rejected = s.rejected;
    res->registrations_left = s.registrations;
    res->prod_active_left = s.active_transfers;
    res->prod_pins_left = s.pinned_blocks;
    res->written_off = s.written_off;
    pkv_xfer_agent_destroy(a);
}

static void producer_main(const xh_case_t *c, int from_parent)
{
    if (enter_netns(c->netns_prod)) child_fail("setns (producer)", PKV_ERR_IO);
    if (c->tcp) setenv("UCX_TLS", "tcp", 1);
    side_t s;
    side_setup(c, &s, c->n_requests, true);
    producer_send_handles(c, &s);
    producer_wait_finish(c, &s, from_parent);
    xh_result_t *res = g_res;
    if (s.a)
        producer_count(c, s.a, res);
    else
        res->registrations_left = UINT64_MAX; /* unknown: the agent is gone */
    side_teardown(&s, &res->prod_staging_left, &res->prod_blocks_live, &res->prod_stage_rc,
                  &res->prod_stage_leaked);
    send_msg(g_report_fd, M_PREPORT, NULL, 0);
}

typedef struct {
    atomic_int done;
    int32_t outcome;
    uint64_t at_ns;
} done_slot_t;

static void on_done(void *arg, pkv_xfer_read_t *rd, int outcome)
{
    (void)rd;
    done_slot_t *d = arg;
    d->at_ns = pkv_now_ns();
    d->outcome = outcome;
    atomic_store(&d->done, 1);
}

/* The consumer's reads: request r's handle, read, start time and completion. */
typedef struct {
    const xh_case_t *c;
    side_t s; /* s.n requests */
    pkv_xfer_handle_t *h[XH_MAX_REQ];
    pkv_xfer_read_t *rd[XH_MAX_REQ];
    uint64_t start[XH_MAX_REQ];
    done_slot_t slot[XH_MAX_REQ];
} reads_t;

/* The handles from the parent (the producer's message), decoded into x->h (tampered with
 * as the case says); returns their count. */
static uint32_t consumer_recv_handles(reads_t *x, int from_parent)
{
    xh_fault_t f = x->c->fault;
    uint32_t type, len, nreq;
    void *p;
    if (recv_msg(from_parent, &type, &p, &len, pkv_deadline_after_ns(60000000000ull)) ||
        type != M_HANDLES)
        child_fail("handles from parent", PKV_ERR_IO);
    memcpy(&nreq, p, 4);
    size_t off = 4;
    for (uint32_t r = 0; r < nreq; r++) {
        uint32_t hl;
        memcpy(&hl, (uint8_t *)p + off, 4);
        int rc = pkv_xfer_handle_decode((uint8_t *)p + off + 4, hl, &x->h[r]);
        if (rc) child_fail("handle decode", rc);
        off += 4 + hl;
        if (f == XH_WRONG_TOKEN) x->h[r]->token[5] ^= 0x20;
        if (f == XH_UNKNOWN_REQUEST) x->h[r]->request_id += 1000000;
    }
    free(p);
    return nreq;
}

/* Wait until reads [first, last] have ended (or give up), acting on the hook's trigger:
 * CANCEL cancels reads [0, r], SHUTDOWN_CONSUMER destroys the agent. */
static void consumer_wait(reads_t *x, uint32_t first, uint32_t last, uint32_t r)
{
    xh_fault_t f = x->c->fault;
    uint64_t give_up = pkv_now_ns() + (x->c->deadline_ms + 10000) * 1000000ull;
    for (uint32_t q = first; q <= last; q++) {
        while (!atomic_load(&x->slot[q].done) && pkv_now_ns() < give_up) {
            if (atomic_load(&g_trigger)) {
                atomic_store(&g_trigger, 0);
                if (f == XH_CANCEL)
                    for (uint32_t k = 0; k <= r; k++) pkv_xfer_cancel(x->rd[k]);
                if (f == XH_SHUTDOWN_CONSUMER && x->s.a) {
                    pkv_xfer_agent_destroy(x->s.a);
                    x->s.a = NULL;
                }
            }
            int oc;
            pkv_xfer_read_wait(x->rd[q], pkv_deadline_after_ns(2000000ull), &oc);
        }
    }
}

/* Start every read. Batches [0, warmup) then [warmup, nreq): read one by one, all at
 * once, or keeping a window of reads outstanding (wait for the oldest; at a batch's end,
 * for all, so the timed reads start and end with nothing else in flight). */
static void consumer_read_all(reads_t *x)
{
    const xh_case_t *c = x->c;
    uint32_t nreq = x->s.n;
    for (uint32_t r = 0; r < nreq; r++) {
        const uint32_t *ids;
        uint32_t n;
        pkv_seq_blocks(x->s.seqs[r], &ids, &n);
        atomic_init(&x->slot[r].done, 0);
        x->start[r] = pkv_now_ns();
        int rc = pkv_xfer_read(x->s.a, x->h[r], ids, n, x->start[r] + c->deadline_ms * 1000000ull,
                               on_done, &x->slot[r], &x->rd[r]);
        if (rc) child_fail("read", rc);
        bool batch_end = r + 1 == nreq || r + 1 == c->warmup;
        uint32_t base = r < c->warmup ? 0 : c->warmup;
        if (!c->sequential && !batch_end && (!c->window || r + 1 - base < c->window)) continue;
        uint32_t first = c->sequential ? r : base;
        if (c->window && r + 1 - base >= c->window) first = r + 1 - c->window;
        uint32_t last = c->window && !batch_end ? first : r;
        consumer_wait(x, first, last, r); /* this read, or the whole batch */
    }
}

/* Each read's outcome, timing and bytes (checked against the pattern) into the result;
 * then the agent's leftovers once it is idle, and the agent ends. */
static void consumer_count(reads_t *x, xh_result_t *res)
{
    const xh_case_t *c = x->c;
    for (uint32_t r = 0; r < x->s.n; r++) {
        int oc = -999;
        if (pkv_xfer_read_wait(x->rd[r], pkv_deadline_after_ns(1000000000ull), &oc)) oc = -999;
        uint64_t at = x->slot[r].at_ns;
        res->outcome[r] = oc;
        res->done_at_ns[r] = at;
        res->elapsed_ns[r] = at > x->start[r] ? at - x->start[r] : 0;
        res->bytes[r] = pkv_xfer_read_bytes(x->rd[r]);
        if (oc == PKV_OK)
            res->mismatched_positions[r] =
                xh_pattern_apply(x->s.seqs[r], &c->geo, c->seed, r, c->n_tokens, false);
        pkv_xfer_read_free(x->rd[r]);
        pkv_xfer_handle_free(x->h[r]);
    }
    if (!x->s.a) return;
    pkv_xfer_wait_idle(x->s.a, pkv_deadline_after_ns(3000000000ull));
    pkv_xfer_stats_t s;
    pkv_xfer_stats(x->s.a, &s);
    res->cons_active_left = s.active_transfers;
    res->cons_pins_left = s.pinned_blocks;
    pkv_xfer_agent_destroy(x->s.a);
}

/* memcpy_ref: the machine's references, right before the first read (at 0) or right
 * after the last (at 1; the same probes in the opposite order). */
static void consumer_refs(xh_result_t *res, int at)
{
    if (!at) {
        res->memcpy_cold_gbps[0] = xh_memcpy_gbps(5, true);
        res->memcpy_gbps[0] = xh_memcpy_gbps(5, false);
        res->cpu_rtt_ns[0] = pkv_rtt_probe_ns();
    } else {
        res->cpu_rtt_ns[1] = pkv_rtt_probe_ns();
        res->memcpy_gbps[1] = xh_memcpy_gbps(5, false);
        res->memcpy_cold_gbps[1] = xh_memcpy_gbps(5, true);
    }
}

static void consumer_main(const xh_case_t *c, int from_parent)
{
    reads_t *x = calloc(1, sizeof(*x));
    if (!x) child_fail("consumer state", PKV_ERR_NOMEM);
    x->c = c;
    uint32_t nreq = consumer_recv_handles(x, from_parent);
    if (enter_netns(c->netns_cons)) child_fail("setns (consumer)", PKV_ERR_IO);
    if (c->tcp) setenv("UCX_TLS", "tcp", 1);
    side_setup(c, &x->s, nreq, false);
    xh_result_t *res = g_res;
    if (c->memcpy_ref) consumer_refs(res, 0);
    consumer_read_all(x);
    if (c->memcpy_ref) consumer_refs(res, 1);
    consumer_count(x, res);
    side_teardown(&x->s, &res->cons_staging_left, &res->cons_blocks_live, &res->cons_stage_rc,
                  &res->cons_stage_leaked);
    free(x);
    send_msg(g_report_fd, M_CREPORT, NULL, 0);
}

/* ---- the parent ------------------------------------------------------------------------ */
static pid_t spawn(const xh_case_t *c, xh_result_t *res, bool producer, int *to_child,
                   int *from_child)
{
    int down[2], up[2];
    if (pipe2(down, O_CLOEXEC) || pipe2(up, O_CLOEXEC)) return -1;
    fflush(NULL);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        xh_child_detach(parent);
        close(down[1]);
        close(up[0]);
        signal(SIGPIPE, SIG_IGN);
        g_case = c;
        g_res = res;
        g_report_fd = up[1];
        atomic_init(&g_trigger, 0);
        if (producer)
            producer_main(c, down[0]);
        else
            consumer_main(c, down[0]);
        exit(0); /* exit(), not _exit(): sanitizers report at exit */
    }
    close(down[0]);
    close(up[1]);
    *to_child = down[1];
    *from_child = up[0];
    return pid;
}

static void set_error(xh_result_t *r, const char *what)
{
    if (!r->error[0]) snprintf(r->error, sizeof(r->error), "%s", what);
}

/* One run, as the parent sees it. r is the result the children fill too (shared memory). */
typedef struct {
    const xh_case_t *c;
    xh_result_t *r;
    uint64_t t_end; /* the parent gives up here */
    pid_t ppid, cpid;
    int p_in, p_out, c_in, c_out; /* pipes to and from the producer and the consumer */
} run_t;

/* Read messages from fd until one of type `want` (0, others dropped), or -1 at deadline,
 * EOF or error. */
static int wait_msg(int fd, uint32_t want, uint64_t deadline_ns)
{
    for (;;) {
        uint32_t type, len;
        void *pl;
        if (recv_msg(fd, &type, &pl, &len, deadline_ns)) return -1;
        free(pl);
        if (type == want) return 0;
    }
}

/* The producer up with its handles (killed right away for PRODUCER_KILLED_BEFORE), then
 * the consumer with them. 0; -1 when the producer was not forked, -2 when a later step
 * failed (the error set either way). */
static int run_start(run_t *x)
{
    const xh_case_t *c = x->c;
    x->ppid = spawn(c, x->r, true, &x->p_in, &x->p_out);
    if (x->ppid < 0) {
        set_error(x->r, "fork producer");
        return -1;
    }
    uint32_t type = 0, len = 0;
    void *handles = NULL;
    if (recv_msg(x->p_out, &type, &handles, &len, x->t_end) || type != M_HANDLES) {
        if (handles && type == M_SETUP_FAIL) set_error(x->r, handles);
        set_error(x->r, "producer sent no handles");
        free(handles);
        return -2;
    }
    if (c->fault == XH_PRODUCER_KILLED_BEFORE) {
        kill(x->ppid, SIGKILL);
        x->r->kill_at_ns = pkv_now_ns();
        xh_reap(x->ppid, &x->r->prod_wstatus, x->t_end);
        x->ppid = -1;
    }
    x->cpid = spawn(c, x->r, false, &x->c_in, &x->c_out);
    if (x->cpid < 0) {
        set_error(x->r, "fork consumer");
        free(handles);
        return -2;
    }
    send_msg(x->c_in, M_HANDLES, handles, len);
    free(handles);
    return 0;
}

/* CONSUMER_STOPPED: the consumer stops itself mid-transfer; the producer must notice on its
 * own (heartbeats), fail the serve and get its sends back; then the consumer dies. The
 * kill waits for the producer to say so (bounded: a producer that never notices leaves its
 * serve for the accounting check to find). */
static void run_stop_consumer(run_t *x)
{
    if (wait_msg(x->c_out, M_KILLTIME, x->t_end) == 0)
        wait_msg(x->p_out, M_SERVES_FAILED,
                 PKV_MIN(x->t_end, pkv_deadline_after_ns(10000000000ull)));
    kill(x->cpid, SIGKILL);
}

/* The consumer's report (or its death). */
static void run_consumer_report(run_t *x)
{
    uint32_t type, len;
    void *pl = NULL;
    int rc = recv_msg(x->c_out, &type, &pl, &len, x->t_end);
    if (rc == 0 && type == M_CREPORT)
        x->r->cons_report = true;
    else if (rc == 0 && type == M_SETUP_FAIL)
        set_error(x->r, pl);
    else if (rc == -2)
        set_error(x->r, "consumer report timed out");
    free(pl);
}

/* Why the producer's report did not come: it died (how), or is still there after FINISH. */
static void producer_missing(run_t *x, uint64_t fin_ns)
{
    int st;
    char why[96];
    if (waitpid(x->ppid, &st, WNOHANG) == x->ppid) {
        x->r->prod_wstatus = st;
        x->ppid = -1; /* reaped */
        if (WIFSIGNALED(st))
            snprintf(why, sizeof(why), "producer report missing: killed by signal %d",
                     WTERMSIG(st));
        else
            snprintf(why, sizeof(why), "producer report missing: exited with %d", WEXITSTATUS(st));
    } else {
        snprintf(why, sizeof(why), "producer report missing: still running %.0f s after FINISH",
                 (double)(pkv_now_ns() - fin_ns) / 1e9);
    }
    set_error(x->r, why);
}

/* Drain what the producer sent meanwhile (KILLTIME if it killed or stopped itself), kill a
 * stopped one, send FINISH, then wait for its report where the case leaves it one. */
static void run_producer_report(run_t *x)
{
    const xh_case_t *c = x->c;
    uint32_t type = 0, len;
    void *pl;
    for (;;) {
        struct pollfd pfd = {.fd = x->p_out, .events = POLLIN};
        if (poll(&pfd, 1, 0) <= 0) break;
        if (recv_msg(x->p_out, &type, &pl, &len, x->t_end)) break;
        free(pl);
        if (type == M_PREPORT) break;
    }
    if (c->fault == XH_PRODUCER_STOPPED) kill(x->ppid, SIGKILL);
    uint8_t fin = 1;
    xh_write_all(x->p_in, &fin, 1);
    uint64_t fin_ns = pkv_now_ns();
    if (!xh_producer_reports(c->fault)) return;
    if (type != M_PREPORT &&
        wait_msg(x->p_out, M_PREPORT, PKV_MIN(x->t_end, fin_ns + 20000000000ull))) {
        producer_missing(x, fin_ns);
        return;
    }
    x->r->prod_report = true;
}

/* Reap both children, close the pipes, and judge the run. */
static void run_end(run_t *x)
{
    xh_result_t *r = x->r;
    xh_reap(x->cpid, &r->cons_wstatus, pkv_now_ns() + 10000000000ull);
    xh_reap(x->ppid, &r->prod_wstatus, pkv_now_ns() + 10000000000ull);
    int fds[4] = {x->p_in, x->p_out, x->c_in, x->c_out};
    for (int i = 0; i < 4; i++)
        if (fds[i] >= 0) close(fds[i]);
    r->ok = !r->error[0] && (r->cons_report || !xh_consumer_reports(x->c->fault)) &&
            (r->prod_report || !xh_producer_reports(x->c->fault));
}

int xh_run(const xh_case_t *c, xh_result_t *r)
{
    memset(r, 0, sizeof(*r));
    r->prod_wstatus = r->cons_wstatus = -1;
    if (c->n_requests < 1 || c->n_requests > XH_MAX_REQ) return -1;
    /* The children fill their fields of the result in place. */
    xh_result_t *res =
        mmap(NULL, sizeof(*res), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (res == MAP_FAILED) {
        set_error(r, "mmap result");
        return -1;
    }
    memcpy(res, r, sizeof(*r));
    /* A child may be dead when we write to it: EPIPE, not a signal. */
    struct sigaction ign = {.sa_handler = SIG_IGN}, old_pipe;
    sigaction(SIGPIPE, &ign, &old_pipe);
    run_t x = {
        .c = c, .r = res, .ppid = -1, .cpid = -1, .p_in = -1, .p_out = -1, .c_in = -1, .c_out = -1};
    x.t_end = pkv_now_ns() +
              (c->timeout_ms ? c->timeout_ms : c->deadline_ms * c->n_requests + 20000) * 1000000ull;
    int rc = run_start(&x);
    if (rc == 0) {
        if (c->fault == XH_CONSUMER_STOPPED) run_stop_consumer(&x);
        run_consumer_report(&x);
        if (x.ppid > 0) run_producer_report(&x);
    }
    run_end(&x);
    memcpy(r, res, sizeof(*r));
    munmap(res, sizeof(*res));
    sigaction(SIGPIPE, &old_pipe, NULL);
    return rc == -1 ? -1 : 0; /* -1: no producer; a run that went wrong later says so in r */
}
