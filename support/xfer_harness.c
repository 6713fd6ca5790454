/*
 * Two-process transfer harness (see xfer_harness.h). Used by `pagekv bench xfer` and
 * tests/test_xfer.c.
 *
 * Processes and pipes:
 *   parent --fork--> producer: builds pool + stage + agent, registers, sends HANDLES,
 *                              waits for FINISH, sends PREPORT, exits
 *   parent --fork--> consumer: receives HANDLES, reads, verifies, sends CREPORT, exits
 * A producer that kills or stops itself first sends KILLTIME (its clock at the signal);
 * CLOCK_MONOTONIC is system-wide, so the consumer's outcome times compare directly.
 * The parent bounds every wait and kills both children when a bound passes.
 */
#include "support/xfer_harness.h"

#include "support/bench.h"
#include "support/rtt_probe.h"

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
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

enum { M_HANDLES = 1, M_KILLTIME, M_PREPORT, M_CREPORT, M_SETUP_FAIL };

static const char *const fault_names[XH_NFAULTS] = {
    [XH_NONE] = "none",
    [XH_PRODUCER_KILLED_BEFORE] = "producer killed before data",
    [XH_PRODUCER_KILLED_DURING] = "producer killed during data",
    [XH_PRODUCER_KILLED_AFTER] = "producer killed after data",
    [XH_CONSUMER_KILLED_DURING] = "consumer killed during data",
    [XH_PRODUCER_STOPPED] = "producer SIGSTOPped",
    [XH_STAGING_FULL_CONSUMER] = "staging exhausted (consumer)",
    [XH_STAGING_FULL_PRODUCER] = "staging exhausted (producer)",
    [XH_NOFIT_CONSUMER] = "staging too small (consumer)",
    [XH_NOFIT_PRODUCER] = "staging too small (producer)",
    [XH_DEADLINE] = "deadline expiry",
    [XH_WRONG_TOKEN] = "wrong token",
    [XH_UNKNOWN_REQUEST] = "unknown request",
    [XH_CORRUPT] = "corrupted payload",
    [XH_SHUTDOWN_CONSUMER] = "shutdown mid-transfer (consumer)",
    [XH_SHUTDOWN_PRODUCER] = "shutdown mid-transfer (producer)",
    [XH_CANCEL] = "cancel mid-transfer",
    [XH_CONSUMER_STOPPED] = "consumer SIGSTOPped",
    [XH_PRODUCER_KILLED_STAGING] = "producer killed while staging",
    [XH_FORGED] = "forged payload (MAC without the token)",
};

const char *xh_fault_name(xh_fault_t f)
{
    return f < XH_NFAULTS ? fault_names[f] : "?";
}

bool xh_outcome_expected(const xh_case_t *c, int oc)
{
    switch (c->fault) {
    case XH_NONE:
        return oc == PKV_OK;
    case XH_PRODUCER_KILLED_BEFORE:
    case XH_PRODUCER_KILLED_DURING:
    case XH_PRODUCER_KILLED_STAGING:
    case XH_PRODUCER_STOPPED:
    case XH_SHUTDOWN_PRODUCER:
        return oc == PKV_ERR_PEER_LOST;
    /* The producer dies after its last chunk left (its DATAs may still be queued in its
     * UCX) and before the ACK: the consumer may store every byte first (ok, and
     * check_accounting / fault_check then compare every byte) or see the death first
     * (peer_lost). Both are right; what it must never do is end ok with wrong bytes. */
    case XH_PRODUCER_KILLED_AFTER:
        return oc == PKV_OK || oc == PKV_ERR_PEER_LOST;
    case XH_CONSUMER_KILLED_DURING:
    case XH_CONSUMER_STOPPED:
        return false; /* the consumer reports nothing */
    /* Shared arena: the consumer copies from the producer's staging and needs none. */
    case XH_STAGING_FULL_CONSUMER:
        return oc == (c->shared ? PKV_OK : PKV_ERR_TIMEOUT);
    case XH_NOFIT_CONSUMER:
        return oc == (c->shared ? PKV_OK : PKV_ERR_NOFIT);
    case XH_STAGING_FULL_PRODUCER:
    case XH_DEADLINE:
        return oc == PKV_ERR_TIMEOUT;
    case XH_NOFIT_PRODUCER:
        return oc == PKV_ERR_NOFIT;
    case XH_WRONG_TOKEN:
    case XH_UNKNOWN_REQUEST:
        return oc == PKV_ERR_REJECTED;
    case XH_CORRUPT:
    case XH_FORGED:
        return oc == PKV_ERR_CORRUPT;
    case XH_SHUTDOWN_CONSUMER:
        return oc == PKV_ERR_SHUTDOWN;
    case XH_CANCEL:
        return oc == PKV_ERR_CANCELLED;
    default:
        return false;
    }
}

bool xh_producer_reports(xh_fault_t f)
{
    return f != XH_PRODUCER_KILLED_BEFORE && f != XH_PRODUCER_KILLED_DURING &&
           f != XH_PRODUCER_KILLED_AFTER && f != XH_PRODUCER_STOPPED &&
           f != XH_PRODUCER_KILLED_STAGING;
}

bool xh_consumer_reports(xh_fault_t f)
{
    return f != XH_CONSUMER_KILLED_DURING && f != XH_CONSUMER_STOPPED;
}

void xh_case_default(xh_case_t *c)
{
    memset(c, 0, sizeof(*c));
    c->geo = (pkv_geometry_t){
        .layers = 8, .kv_heads = 2, .head_dim = 64, .block_tokens = 16, .dtype = PKV_DTYPE_F16};
    c->n_tokens = 512; /* 32 blocks of 64 KiB: 2 MiB, 256 KiB per layer */
    c->n_requests = 1;
    c->chunk_bytes = 0; /* the agent's default */
    c->page_bytes = 64 << 10;
    c->deadline_ms = 4000;
    c->seed = 1;
}

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

/* ---- pipes ---------------------------------------------------------------------------- */
int xh_write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

static int send_msg(int fd, uint32_t type, const void *p, uint32_t len)
{
    uint32_t hdr[2] = {type, len};
    if (xh_write_all(fd, hdr, sizeof(hdr))) return -1;
    return len ? xh_write_all(fd, p, len) : 0;
}

int xh_read_all(int fd, void *p, size_t n, uint64_t deadline_ns)
{
    uint8_t *b = p;
    while (n) {
        uint64_t now = pkv_now_ns();
        if (now >= deadline_ns) return -2;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int ms = (int)PKV_MIN((deadline_ns - now) / 1000000 + 1, 1000);
        int pr = poll(&pfd, 1, ms);
        if (pr < 0 && errno != EINTR) return -1;
        if (pr <= 0) continue;
        ssize_t r = read(fd, b, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        b += r;
        n -= (size_t)r;
    }
    return 0;
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

/* ---- the data pattern ----------------------------------------------------------------- */
/* Bytes of one head row (K or V) of position pos in layer l of request r. */
static void pattern_row(uint64_t seed, uint32_t r, uint32_t pos, uint32_t l, uint32_t kv,
                        uint32_t h, uint8_t *out, size_t n)
{
    uint64_t s = seed ^ ((uint64_t)r << 48) ^ ((uint64_t)pos << 20) ^ ((uint64_t)l << 8) ^
                 ((uint64_t)kv << 7) ^ h;
    pkv_splitmix64(&s);
    for (size_t i = 0; i < n; i += 8) {
        uint64_t w = pkv_splitmix64(&s);
        memcpy(out + i, &w, PKV_MIN((size_t)8, n - i));
    }
}

uint32_t xh_pattern_apply(pkv_seq_t *seq, const pkv_geometry_t *g, uint64_t seed, uint32_t r,
                          uint32_t n_tokens, bool fill)
{
    size_t es = pkv_dtype_size(g->dtype), row = (size_t)g->head_dim * es;
    uint8_t *buf = malloc(row);
    uint32_t bad = 0;
    for (uint32_t pos = 0; pos < n_tokens; pos++) {
        bool pos_bad = false;
        for (uint32_t l = 0; l < g->layers; l++) {
            void *k, *v;
            size_t hs;
            pkv_seq_slot(seq, pos, l, &k, &v, &hs);
            for (uint32_t kv = 0; kv < 2; kv++) {
                uint8_t *base = kv ? v : k;
                for (uint32_t h = 0; h < g->kv_heads; h++) {
                    uint8_t *dst = base + (size_t)h * hs * es;
                    pattern_row(seed, r, pos, l, kv, h, buf, row);
                    if (fill)
                        memcpy(dst, buf, row);
                    else if (memcmp(dst, buf, row))
                        pos_bad = true;
                }
            }
        }
        bad += pos_bad;
    }
    free(buf);
    return bad;
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

typedef struct {
    uint64_t sent, serves_started, serves_failed, rejected, registrations_left, written_off;
    uint64_t active_left, staging_left, pins_left, blocks_live;
    int32_t stage_rc;
    uint64_t stage_leaked;
} prod_report_t;

typedef struct {
    int32_t outcome[XH_MAX_REQ];
    uint64_t elapsed_ns[XH_MAX_REQ], done_at_ns[XH_MAX_REQ], bytes[XH_MAX_REQ];
    uint32_t mismatched[XH_MAX_REQ];
    uint64_t active_left, staging_left, pins_left, blocks_live;
    int32_t stage_rc;
    uint64_t stage_leaked;
    double memcpy_gbps[2], memcpy_cold_gbps[2];
    double cpu_rtt_ns[2];
} cons_report_t;

/* Globals of a child process (each child has its own copy after fork). */
static const xh_case_t *g_case;
static int g_report_fd = -1;
static atomic_int g_trigger; /* the hook saw its point: the main thread acts */

static void child_fail(const char *what, int rc)
{
    char msg[160];
    snprintf(msg, sizeof(msg), "%s: %s", what, pkv_status_str(rc));
    send_msg(g_report_fd, M_SETUP_FAIL, msg, (uint32_t)strlen(msg) + 1);
    exit(3);
}

/* A child's fault: tell the parent when (its clock, for the detection time), then take
 * the signal. */
static void signal_self(int sig)
{
    uint64_t now = pkv_now_ns();
    send_msg(g_report_fd, M_KILLTIME, &now, sizeof(now));
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

static void producer_main(const xh_case_t *c, int from_parent)
{
    xh_fault_t f = c->fault;
    if (enter_netns(c->netns_prod)) child_fail("setns (producer)", PKV_ERR_IO);
    if (c->tcp) setenv("UCX_TLS", "tcp", 1);
    pkv_kv_t *kv = make_kv(c);
    pkv_seq_t *seqs[XH_MAX_REQ];
    for (uint32_t r = 0; r < c->n_requests; r++) seqs[r] = make_seq(kv, r, c->n_tokens, true);
    pkv_stage_grant_t *hog;
    pkv_stage_t *st =
        side_stage(c, c->prod_pages, f == XH_NOFIT_PRODUCER, f == XH_STAGING_FULL_PRODUCER, &hog);
    pkv_xfer_agent_t *a = make_agent(c, kv, st, c->prod_host, true);

    /* Handles: u32 count, then per handle u32 length + bytes. */
    size_t off = 4;
    uint8_t *msg = malloc(4);
    memcpy(msg, &c->n_requests, 4);
    for (uint32_t r = 0; r < c->n_requests; r++) {
        const uint32_t *ids;
        uint32_t n;
        pkv_seq_blocks(seqs[r], &ids, &n);
        pkv_xfer_handle_t *h;
        int rc = pkv_xfer_register(a, 1000 + r, ids, n, pkv_deadline_after_ns(120000000000ull),
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
    pkv_seq_blocks(seqs[0], &idle_ids, &idle_n);
    for (uint32_t k = 0; k < c->idle_regs; k++) {
        pkv_xfer_handle_t *h;
        int rc = pkv_xfer_register(a, (1ull << 40) + k, idle_ids, idle_n, PKV_DEADLINE_NEVER, NULL,
                                   NULL, &h);
        if (rc) child_fail("register (idle)", rc);
        pkv_xfer_handle_free(h);
    }
    send_msg(g_report_fd, M_HANDLES, msg, (uint32_t)off);
    free(msg);

    /* Wait for the parent's FINISH (or, for SHUTDOWN_PRODUCER, the hook's trigger). */
    uint64_t until = pkv_now_ns() + (c->deadline_ms + 60000) * 1000000ull;
    bool destroyed = false;
    for (;;) {
        if (f == XH_SHUTDOWN_PRODUCER && !destroyed && atomic_load(&g_trigger)) {
            pkv_xfer_agent_destroy(a);
            destroyed = true;
        }
        struct pollfd pfd = {.fd = from_parent, .events = POLLIN};
        if (poll(&pfd, 1, 5) > 0 || pkv_now_ns() > until) break;
    }
    prod_report_t rep;
    memset(&rep, 0, sizeof(rep));
    if (!destroyed) {
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
        rep.sent = s.sent;
        rep.serves_started = s.serves_started;
        rep.serves_failed = s.serves_failed;
        rep.rejected = s.rejected;
        rep.registrations_left = s.registrations;
        rep.active_left = s.active_transfers;
        rep.pins_left = s.pinned_blocks;
        rep.written_off = s.written_off;
        pkv_xfer_agent_destroy(a);
    } else {
        rep.registrations_left = UINT64_MAX; /* unknown: the agent is gone */
    }
    hog_release(st, hog);
    rep.staging_left = stage_used(st);
    for (uint32_t r = 0; r < c->n_requests; r++) pkv_seq_free(seqs[r]);
    rep.blocks_live = blocks_live(kv);
    size_t leaked = 0;
    rep.stage_rc = pkv_stage_destroy(st, pkv_deadline_after_ns(2000000000ull), &leaked);
    rep.stage_leaked = leaked;
    pkv_kv_destroy(kv);
    send_msg(g_report_fd, M_PREPORT, &rep, sizeof(rep));
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

static void consumer_main(const xh_case_t *c, int from_parent)
{
    xh_fault_t f = c->fault;
    uint32_t type, len;
    void *p;
    if (recv_msg(from_parent, &type, &p, &len, pkv_deadline_after_ns(60000000000ull)) ||
        type != M_HANDLES)
        child_fail("handles from parent", PKV_ERR_IO);
    if (enter_netns(c->netns_cons)) child_fail("setns (consumer)", PKV_ERR_IO);
    if (c->tcp) setenv("UCX_TLS", "tcp", 1);
    uint32_t nreq;
    memcpy(&nreq, p, 4);
    pkv_xfer_handle_t *h[XH_MAX_REQ];
    size_t off = 4;
    for (uint32_t r = 0; r < nreq; r++) {
        uint32_t hl;
        memcpy(&hl, (uint8_t *)p + off, 4);
        int rc = pkv_xfer_handle_decode((uint8_t *)p + off + 4, hl, &h[r]);
        if (rc) child_fail("handle decode", rc);
        off += 4 + hl;
        if (f == XH_WRONG_TOKEN) h[r]->token[5] ^= 0x20;
        if (f == XH_UNKNOWN_REQUEST) h[r]->request_id += 1000000;
    }
    free(p);

    pkv_kv_t *kv = make_kv(c);
    pkv_seq_t *seqs[XH_MAX_REQ];
    for (uint32_t r = 0; r < nreq; r++) seqs[r] = make_seq(kv, r, c->n_tokens, false);
    pkv_stage_grant_t *hog;
    pkv_stage_t *st =
        side_stage(c, c->cons_pages, f == XH_NOFIT_CONSUMER, f == XH_STAGING_FULL_CONSUMER, &hog);
    pkv_xfer_agent_t *a = make_agent(c, kv, st, NULL, false);

    cons_report_t rep;
    memset(&rep, 0, sizeof(rep));
    static done_slot_t slot[XH_MAX_REQ];
    pkv_xfer_read_t *rd[XH_MAX_REQ];
    uint64_t start[XH_MAX_REQ];
    bool destroyed = false;
    if (c->memcpy_ref) {
        rep.memcpy_cold_gbps[0] = xh_memcpy_gbps(5, true);
        rep.memcpy_gbps[0] = xh_memcpy_gbps(5, false);
        rep.cpu_rtt_ns[0] = pkv_rtt_probe_ns();
    }
    for (uint32_t r = 0; r < nreq; r++) {
        const uint32_t *ids;
        uint32_t n;
        pkv_seq_blocks(seqs[r], &ids, &n);
        atomic_init(&slot[r].done, 0);
        start[r] = pkv_now_ns();
        int rc = pkv_xfer_read(a, h[r], ids, n, start[r] + c->deadline_ms * 1000000ull, on_done,
                               &slot[r], &rd[r]);
        if (rc) child_fail("read", rc);
        /* Batches [0, warmup) then [warmup, nreq): read one by one, all at once, or
         * keeping a window of reads outstanding (wait for the oldest; at a batch's end,
         * for all, so the timed reads start and end with nothing else in flight). */
        bool batch_end = r + 1 == nreq || r + 1 == c->warmup;
        uint32_t base = r < c->warmup ? 0 : c->warmup;
        if (!c->sequential && !batch_end && (!c->window || r + 1 - base < c->window)) continue;
        uint32_t first = c->sequential ? r : base;
        if (c->window && r + 1 - base >= c->window) first = r + 1 - c->window;
        uint32_t last = c->window && !batch_end ? first : r;
        /* Wait for this read or the whole batch, acting on the hook's trigger. */
        uint64_t give_up = pkv_now_ns() + (c->deadline_ms + 10000) * 1000000ull;
        for (uint32_t q = first; q <= last; q++) {
            while (!atomic_load(&slot[q].done) && pkv_now_ns() < give_up) {
                if (atomic_load(&g_trigger)) {
                    atomic_store(&g_trigger, 0);
                    if (f == XH_CANCEL)
                        for (uint32_t k = 0; k <= r; k++) pkv_xfer_cancel(rd[k]);
                    if (f == XH_SHUTDOWN_CONSUMER && !destroyed) {
                        pkv_xfer_agent_destroy(a);
                        destroyed = true;
                    }
                }
                int oc;
                pkv_xfer_read_wait(rd[q], pkv_deadline_after_ns(2000000ull), &oc);
            }
        }
    }
    if (c->memcpy_ref) {
        rep.cpu_rtt_ns[1] = pkv_rtt_probe_ns();
        rep.memcpy_gbps[1] = xh_memcpy_gbps(5, false);
        rep.memcpy_cold_gbps[1] = xh_memcpy_gbps(5, true);
    }
    for (uint32_t r = 0; r < nreq; r++) {
        int oc = -999;
        if (pkv_xfer_read_wait(rd[r], pkv_deadline_after_ns(1000000000ull), &oc)) oc = -999;
        rep.outcome[r] = oc;
        rep.done_at_ns[r] = slot[r].at_ns;
        rep.elapsed_ns[r] = slot[r].at_ns > start[r] ? slot[r].at_ns - start[r] : 0;
        rep.bytes[r] = pkv_xfer_read_bytes(rd[r]);
        if (oc == PKV_OK)
            rep.mismatched[r] = xh_pattern_apply(seqs[r], &c->geo, c->seed, r, c->n_tokens, false);
        pkv_xfer_read_free(rd[r]);
        pkv_xfer_handle_free(h[r]);
    }
    if (!destroyed) {
        pkv_xfer_wait_idle(a, pkv_deadline_after_ns(3000000000ull));
        pkv_xfer_stats_t s;
        pkv_xfer_stats(a, &s);
        rep.active_left = s.active_transfers;
        rep.pins_left = s.pinned_blocks;
        pkv_xfer_agent_destroy(a);
    }
    hog_release(st, hog);
    rep.staging_left = stage_used(st);
    for (uint32_t r = 0; r < nreq; r++) pkv_seq_free(seqs[r]);
    rep.blocks_live = blocks_live(kv);
    size_t leaked = 0;
    rep.stage_rc = pkv_stage_destroy(st, pkv_deadline_after_ns(2000000000ull), &leaked);
    rep.stage_leaked = leaked;
    pkv_kv_destroy(kv);
    send_msg(g_report_fd, M_CREPORT, &rep, sizeof(rep));
}

/* ---- the parent ------------------------------------------------------------------------ */
static pid_t spawn(const xh_case_t *c, bool producer, int *to_child, int *from_child)
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

void xh_child_detach(pid_t parent)
{
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(3);
}

void xh_reap(pid_t pid, int *wstatus, uint64_t deadline_ns)
{
    if (pid <= 0) return;
    for (;;) {
        int st;
        pid_t w = waitpid(pid, &st, WNOHANG | WUNTRACED);
        if (w == pid && !WIFSTOPPED(st)) {
            *wstatus = st;
            return;
        }
        if (w < 0 && errno == ECHILD) return; /* not ours, or already reaped: *wstatus stays */
        if (w == pid && WIFSTOPPED(st)) kill(pid, SIGKILL);
        if (pkv_now_ns() > deadline_ns) {
            kill(pid, SIGKILL);
            deadline_ns = UINT64_MAX;
        }
        usleep(2000);
    }
}

static void set_error(xh_result_t *r, const char *what)
{
    if (!r->error[0]) snprintf(r->error, sizeof(r->error), "%s", what);
}

int xh_run(const xh_case_t *c, xh_result_t *r)
{
    memset(r, 0, sizeof(*r));
    r->prod_wstatus = r->cons_wstatus = -1;
    if (c->n_requests < 1 || c->n_requests > XH_MAX_REQ) return -1;
    /* A child may be dead when we write to it: EPIPE, not a signal. */
    struct sigaction ign = {.sa_handler = SIG_IGN}, old_pipe;
    sigaction(SIGPIPE, &ign, &old_pipe);
    uint64_t t_end =
        pkv_now_ns() +
        (c->timeout_ms ? c->timeout_ms : c->deadline_ms * c->n_requests + 20000) * 1000000ull;
    int p_in = -1, p_out = -1, c_in = -1, c_out = -1;
    pid_t cpid = -1;
    pid_t ppid = spawn(c, true, &p_in, &p_out);
    if (ppid < 0) {
        set_error(r, "fork producer");
        return -1;
    }
    uint32_t type, len;
    void *handles = NULL;
    uint32_t handles_len = 0;
    if (recv_msg(p_out, &type, &handles, &handles_len, t_end) || type != M_HANDLES) {
        if (handles && type == M_SETUP_FAIL) set_error(r, handles);
        set_error(r, "producer sent no handles");
        goto out;
    }
    if (c->fault == XH_PRODUCER_KILLED_BEFORE) {
        kill(ppid, SIGKILL);
        r->kill_at_ns = pkv_now_ns();
        xh_reap(ppid, &r->prod_wstatus, t_end);
        ppid = -1;
    }
    cpid = spawn(c, false, &c_in, &c_out);
    if (cpid < 0) {
        set_error(r, "fork consumer");
        goto out;
    }
    send_msg(c_in, M_HANDLES, handles, handles_len);
    void *pl = NULL;
    if (c->fault == XH_CONSUMER_STOPPED) {
        /* The consumer stops itself mid-transfer: the producer must notice on its own
         * (heartbeats), fail the serve and get its sends back; then the consumer dies. */
        if (recv_msg(c_out, &type, &pl, &len, t_end) == 0 && type == M_KILLTIME && len == 8)
            memcpy(&r->kill_at_ns, pl, 8);
        free(pl);
        pl = NULL;
        usleep(3000000);
        kill(cpid, SIGKILL);
    }
    /* The consumer's report (or its death). */
    int rc = recv_msg(c_out, &type, &pl, &len, t_end);
    if (rc == 0 && type == M_CREPORT && len == sizeof(cons_report_t)) {
        cons_report_t cr;
        memcpy(&cr, pl, sizeof(cr));
        r->cons_report = true;
        memcpy(r->outcome, cr.outcome, sizeof(r->outcome));
        memcpy(r->elapsed_ns, cr.elapsed_ns, sizeof(r->elapsed_ns));
        memcpy(r->done_at_ns, cr.done_at_ns, sizeof(r->done_at_ns));
        memcpy(r->mismatched_positions, cr.mismatched, sizeof(r->mismatched_positions));
        memcpy(r->bytes, cr.bytes, sizeof(r->bytes));
        r->cons_active_left = cr.active_left;
        r->cons_staging_left = cr.staging_left;
        r->cons_pins_left = cr.pins_left;
        r->cons_blocks_live = cr.blocks_live;
        r->cons_stage_rc = cr.stage_rc;
        r->cons_stage_leaked = cr.stage_leaked;
        memcpy(r->memcpy_gbps, cr.memcpy_gbps, sizeof(r->memcpy_gbps));
        memcpy(r->memcpy_cold_gbps, cr.memcpy_cold_gbps, sizeof(r->memcpy_cold_gbps));
        memcpy(r->cpu_rtt_ns, cr.cpu_rtt_ns, sizeof(r->cpu_rtt_ns));
    } else if (rc == 0 && type == M_SETUP_FAIL) {
        set_error(r, pl);
    } else if (rc == -2) {
        set_error(r, "consumer report timed out");
    }
    free(pl);

    /* Producer: KILLTIME if it killed or stopped itself, then its report after FINISH. */
    if (ppid > 0) {
        uint8_t fin = 1;
        bool stopped = false;
        for (;;) {
            struct pollfd pfd = {.fd = p_out, .events = POLLIN};
            if (poll(&pfd, 1, 0) <= 0) break;
            if (recv_msg(p_out, &type, &pl, &len, t_end)) break;
            if (type == M_KILLTIME && len == 8) {
                memcpy(&r->kill_at_ns, pl, 8);
                stopped = c->fault == XH_PRODUCER_STOPPED;
            }
            free(pl);
            if (type == M_PREPORT) break;
        }
        if (stopped || c->fault == XH_PRODUCER_STOPPED) kill(ppid, SIGKILL);
        xh_write_all(p_in, &fin, 1);
        uint64_t fin_ns = pkv_now_ns();
        uint64_t p_end = PKV_MIN(t_end, fin_ns + 20000000000ull);
        while (xh_producer_reports(c->fault)) {
            if (recv_msg(p_out, &type, &pl, &len, p_end)) {
                /* Say whether it died (and how) or is still there after FINISH. */
                int st;
                char why[96];
                if (waitpid(ppid, &st, WNOHANG) == ppid) {
                    r->prod_wstatus = st;
                    ppid = -1; /* reaped */
                    if (WIFSIGNALED(st))
                        snprintf(why, sizeof(why), "producer report missing: killed by signal %d",
                                 WTERMSIG(st));
                    else
                        snprintf(why, sizeof(why), "producer report missing: exited with %d",
                                 WEXITSTATUS(st));
                } else {
                    snprintf(why, sizeof(why),
                             "producer report missing: still running %.0f s after FINISH",
                             (double)(pkv_now_ns() - fin_ns) / 1e9);
                }
                set_error(r, why);
                break;
            }
            if (type == M_PREPORT && len == sizeof(prod_report_t)) {
                prod_report_t pr;
                memcpy(&pr, pl, sizeof(pr));
                free(pl);
                r->prod_report = true;
                r->sent = pr.sent;
                r->serves_started = pr.serves_started;
                r->serves_failed = pr.serves_failed;
                r->rejected = pr.rejected;
                r->registrations_left = pr.registrations_left;
                r->written_off = pr.written_off;
                r->prod_active_left = pr.active_left;
                r->prod_staging_left = pr.staging_left;
                r->prod_pins_left = pr.pins_left;
                r->prod_blocks_live = pr.blocks_live;
                r->prod_stage_rc = pr.stage_rc;
                r->prod_stage_leaked = pr.stage_leaked;
                break;
            }
            if (type == M_KILLTIME && len == 8) memcpy(&r->kill_at_ns, pl, 8);
            free(pl);
        }
    }
out:
    free(handles);
    xh_reap(cpid, &r->cons_wstatus, pkv_now_ns() + 10000000000ull);
    xh_reap(ppid, &r->prod_wstatus, pkv_now_ns() + 10000000000ull);
    if (p_in >= 0) close(p_in);
    if (p_out >= 0) close(p_out);
    if (c_in >= 0) close(c_in);
    if (c_out >= 0) close(c_out);
    r->ok = !r->error[0] && (r->cons_report || !xh_consumer_reports(c->fault)) &&
            (r->prod_report || !xh_producer_reports(c->fault));
    sigaction(SIGPIPE, &old_pipe, NULL);
    return 0;
}

/* ---- network namespaces ------------------------------------------------------------------ */
static int sh(const char *cmd)
{
    int rc = system(cmd);
    return rc == 0 ? 0 : -1;
}

/* Namespaces named pkvx<pid>a/b whose process is gone were left by a run that failed
 * before cleaning up: remove them (never another live run's). */
static void netns_reap_stale(void)
{
    FILE *f = popen("ip netns list 2>/dev/null", "r");
    if (!f) return;
    char line[256];
    while (fgets(line, sizeof(line), f)) {
        unsigned pid;
        char side;
        if (sscanf(line, "pkvx%u%c", &pid, &side) != 2 || (side != 'a' && side != 'b')) continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue; /* its owner still runs */
        char cmd[96];
        snprintf(cmd, sizeof(cmd), "ip netns del pkvx%u%c 2>/dev/null", pid, side);
        if (system(cmd)) continue;
    }
    pclose(f);
}

int xh_netns_create(char a[16], char b[16], char *why, size_t why_len)
{
    netns_reap_stale();
    unsigned id = (unsigned)getpid(); /* "vx<pid>a" stays within IFNAMSIZ */
    snprintf(a, 16, "pkvx%ua", id);
    snprintf(b, 16, "pkvx%ub", id);
    char cmd[512];
    snprintf(
        cmd, sizeof(cmd),
        "ip netns add %s && ip netns add %s && "
        "ip link add vx%ua type veth peer name vx%ub && "
        "ip link set vx%ua netns %s && ip link set vx%ub netns %s && "
        "ip -n %s addr add 10.250.0.1/30 dev vx%ua && ip -n %s addr add 10.250.0.2/30 dev vx%ub && "
        "ip -n %s link set vx%ua up && ip -n %s link set vx%ub up && "
        "ip -n %s link set lo up && ip -n %s link set lo up",
        a, b, id, id, id, a, id, b, a, id, b, id, a, id, b, id, a, b);
    if (sh(cmd)) {
        snprintf(why, why_len, "cannot create network namespaces (need root and iproute2)");
        xh_netns_destroy(a, b);
        return -1;
    }
    return 0;
}

void xh_netns_destroy(const char *a, const char *b)
{
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "ip netns del %s 2>/dev/null; ip netns del %s 2>/dev/null; true", a,
             b);
    if (sh(cmd)) return;
}
