/*
 * Lean pull: the reference beside `bench xfer`'s same-host figures. It does exactly the
 * two copies a same-host read through the shared arena does (producer: pool -> staging,
 * consumer: staging -> pool, both fused with the checksum, streaming stores, pieces of
 * the head size) with the same 8 reads in flight, but nothing else: two processes hand
 * reads over through two single-producer rings in shared memory, each busy-polling. No
 * UCX, no progress or caller threads, no wake-ups, no allocation per read. Memory is of
 * the same kind as the engine's: pools committed with transparent huge pages (as the kv
 * pool does; with 4 KiB pages the consumer's copy ran at half the speed), staging in a
 * memfd. What it reaches is what this flow can reach on this machine.
 *
 * The keyed variant (xh_lean_pull_mac_gbps) is the same flow with the engine's integrity
 * instead of the checksum: both sides derive the read's per-layer Poly1305 keys as the
 * engine does, the producer MACs each layer in its copy and the consumer verifies each
 * as it copies it out of the arena, with the engine's own loops (xf_mac_copy,
 * xf_mac_copy_in): the bound of a flow that must MAC.
 */
#include "support/lean_pull.h"
#include "support/xfer_harness.h"
#include "support/xfer_proc.h"

#include "core/core.h"
#include "prim/prim.h"
#include "xfer/xfer.h"

#include <arpa/inet.h>
#include <endian.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

enum { LP_WINDOW = 8, LP_SLOTS = 2 * LP_WINDOW, LP_RING = 64, LP_MAX_LAYERS = 16 };
#define LP_QUIT       UINT32_MAX
#define LP_GIVE_UP_NS (120ull * 1000000000ull)

typedef struct {
    uint32_t slot, read;
    union {
        uint64_t sum[LP_MAX_LAYERS];                  /* Fletcher sums (the unkeyed flow) */
        uint8_t tag[LP_MAX_LAYERS][XF_MAC_TAG_BYTES]; /* per-layer MACs (the keyed flow) */
    };
} lp_entry_t;

typedef struct {
    _Alignas(64) atomic_ulong head;
    _Alignas(64) atomic_ulong tail;
    _Alignas(64) lp_entry_t e[LP_RING];
} lp_ring_t;

typedef struct {
    lp_ring_t req, done; /* consumer -> producer, producer -> consumer */
    atomic_bool ready;   /* the producer filled its pool */
} lp_shared_t;

typedef struct {
    size_t read_bytes, layer_bytes, piece;
    uint32_t layers;
    bool mac; /* the keyed flow: Poly1305 tags instead of Fletcher sums */
} lp_geo_t;

static int lp_geo_init(lp_geo_t *g, size_t read_bytes, uint32_t layers, size_t piece)
{
    *g = (lp_geo_t){.read_bytes = read_bytes, .layers = layers, .piece = piece};
    if (!layers || layers > LP_MAX_LAYERS || read_bytes % layers || !piece) return -1;
    g->layer_bytes = read_bytes / layers;
    return g->layer_bytes % piece || piece % 64 ? -1 : 0;
}

/* A pool as the kv module makes one: reserved 2 MiB-aligned, committed with huge pages. */
static uint8_t *lp_pool(size_t bytes)
{
    void *p;
    if (pkv_prim_reserve(bytes, 2u << 20, &p)) return NULL;
    if (pkv_prim_commit(p, bytes, true)) {
        pkv_prim_release(p, bytes);
        return NULL;
    }
    return p;
}

/* The producer's pool, every 4 KiB page filled with its own byte. */
static uint8_t *lp_source_pool(size_t bytes)
{
    uint8_t *pool = lp_pool(bytes);
    if (pool)
        for (size_t i = 0; i < bytes; i += 4096) memset(pool + i, (int)(i >> 12), 4096);
    return pool;
}

/* Single producer, single consumer: the pusher waits while the ring is full. */
static bool lp_push(lp_ring_t *r, const lp_entry_t *e, uint64_t give_up)
{
    unsigned long h = atomic_load_explicit(&r->head, memory_order_relaxed);
    while (h - atomic_load_explicit(&r->tail, memory_order_acquire) >= LP_RING)
        if (pkv_now_ns() > give_up) return false;
    r->e[h % LP_RING] = *e;
    atomic_store_explicit(&r->head, h + 1, memory_order_release);
    return true;
}

static bool lp_pop(lp_ring_t *r, lp_entry_t *e)
{
    unsigned long t = atomic_load_explicit(&r->tail, memory_order_relaxed);
    if (atomic_load_explicit(&r->head, memory_order_acquire) == t) return false;
    *e = r->e[t % LP_RING];
    atomic_store_explicit(&r->tail, t + 1, memory_order_release);
    return true;
}

/* One read's copy, layer by layer in head-sized pieces, each layer fenced and summed;
 * streaming stores unless `cached` (staging that UCX reads next on this core). */
static void lp_copy_as(const lp_geo_t *g, uint8_t *dst, const uint8_t *src, uint64_t *sums,
                       bool cached)
{
    for (uint32_t l = 0; l < g->layers; l++) {
        pkv_xfer_sum_t s;
        pkv_xfer_sum_init(&s);
        size_t base = l * g->layer_bytes;
        for (size_t o = 0; o < g->layer_bytes; o += g->piece)
            if (cached)
                pkv_xfer_sum_copy(&s, dst + base + o, src + base + o, g->piece);
            else
                pkv_xfer_sum_copy_nt(&s, dst + base + o, src + base + o, g->piece);
        pkv_xfer_sum_fence();
        sums[l] = pkv_xfer_sum_final(&s);
    }
}

static void lp_copy(const lp_geo_t *g, uint8_t *dst, const uint8_t *src, uint64_t *sums)
{
    lp_copy_as(g, dst, src, sums, false);
}

/* The keyed flow's per-layer keys of read `read`, derived as the engine derives a read's
 * (xf_mac_keys: a registration token, the read's nonce, its ids and geometry), on both
 * sides for every read. */
static int lp_keys(xf_mac_t *m, const lp_geo_t *g, uint32_t read, uint8_t *keys)
{
    uint8_t token[PKV_XFER_TOKEN_BYTES] = {0x5a}, nonce[XF_MAC_NONCE_BYTES] = {0};
    memcpy(nonce, &read, sizeof(read));
    return xf_mac_keys(m, token, nonce, read, (uint32_t)(g->layer_bytes / g->piece), g->layers, 0,
                       1, keys);
}

/* One read's copy in the keyed flow, layer by layer in head-sized pieces, each layer's
 * bytes MACed in the copy (xf_mac_copy: cache-hot steps; `in`: xf_mac_copy_in, through
 * an L1 bounce buffer, as a consumer copies out of a peer's shared arena) and fenced.
 * False when a key or tag computation failed. */
static bool lp_mac_copy(xf_mac_t *m, const lp_geo_t *g, uint32_t read, uint8_t *dst,
                        const uint8_t *src, uint8_t (*tags)[XF_MAC_TAG_BYTES], bool in)
{
    uint8_t keys[LP_MAX_LAYERS * XF_MAC_KEY_BYTES];
    if (lp_keys(m, g, read, keys)) return false;
    bool ok = true;
    for (uint32_t l = 0; l < g->layers; l++) {
        xf_mac_begin(m, keys + (size_t)XF_MAC_KEY_BYTES * l);
        size_t base = l * g->layer_bytes;
        for (size_t o = 0; o < g->layer_bytes; o += g->piece)
            if (in)
                xf_mac_copy_in(m, dst + base + o, src + base + o, g->piece);
            else
                xf_mac_copy(m, dst + base + o, src + base + o, g->piece, true);
        pkv_xfer_sum_fence();
        ok = xf_mac_end(m, tags[l]) && ok;
    }
    return ok;
}

static void lp_producer(lp_shared_t *sh, uint8_t *arena, const lp_geo_t *g, uint32_t reads,
                        pid_t parent)
{
    xh_child_detach(parent);
    uint8_t *pool = lp_source_pool(g->read_bytes * reads);
    xf_mac_t *m = g->mac ? xf_mac_create() : NULL;
    if (!pool || (g->mac && !m)) _exit(2);
    atomic_store(&sh->ready, true);
    uint64_t give_up = pkv_now_ns() + LP_GIVE_UP_NS, idle = 0;
    for (;;) {
        lp_entry_t e;
        if (!lp_pop(&sh->req, &e)) {
            if (++idle % 65536 == 0 && pkv_now_ns() > give_up) _exit(3);
            continue;
        }
        if (e.slot == LP_QUIT) _exit(0);
        uint8_t *dst = arena + (size_t)e.slot * g->read_bytes;
        const uint8_t *src = pool + (size_t)e.read * g->read_bytes;
        if (!m)
            lp_copy(g, dst, src, e.sum);
        else if (!lp_mac_copy(m, g, e.read, dst, src, e.tag, false))
            _exit(3);
        if (!lp_push(&sh->done, &e, give_up)) _exit(3);
    }
}

/* Is the producer still there? One that ended is reaped here (*pid becomes -1). */
static bool lp_alive(pid_t *pid)
{
    int st;
    if (waitpid(*pid, &st, WNOHANG) == 0) return true;
    *pid = -1;
    return false;
}

/* The consumer's side of one read the producer handed back: copy it arena -> pool and
 * check it (Fletcher sums, or MACs as the engine's consumer checks a shared-arena read). */
static bool lp_store(xf_mac_t *m, const lp_geo_t *g, const lp_entry_t *e, uint8_t *dst,
                     const uint8_t *src)
{
    if (!m) {
        uint64_t mine[LP_MAX_LAYERS];
        lp_copy(g, dst, src, mine);
        return memcmp(mine, e->sum, g->layers * sizeof(uint64_t)) == 0;
    }
    uint8_t tags[LP_MAX_LAYERS][XF_MAC_TAG_BYTES];
    if (!lp_mac_copy(m, g, e->read, dst, src, tags, true)) return false;
    for (uint32_t l = 0; l < g->layers; l++)
        if (!xf_mac_equal(tags[l], e->tag[l])) return false;
    return true;
}

/* The same-host lean pull of geometry g: GB/s or -1 (xh_lean_pull_gbps). */
static double lp_run(const lp_geo_t *g, uint32_t warm_reads, uint32_t timed_reads)
{
    uint32_t reads = warm_reads + timed_reads;
    size_t rb = g->read_bytes, head = PKV_ALIGN_UP(sizeof(lp_shared_t), 4096);
    size_t map_bytes = head + LP_SLOTS * rb;
    int fd;
    void *map;
    if (pkv_prim_shared_create("pkv-lean-pull", map_bytes, &fd, &map)) return -1;
    lp_shared_t *sh = map;
    memset(sh, 0, sizeof(*sh));
    uint8_t *arena = (uint8_t *)map + head, *pool = NULL;
    xf_mac_t *m = NULL;
    double gbps = -1;
    fflush(NULL);
    pid_t parent = getpid(), pid = fork();
    if (pid == 0) lp_producer(sh, arena, g, reads, parent);
    if (pid < 0) goto out;
    pool = lp_pool(rb * reads);
    if (!pool || (g->mac && !(m = xf_mac_create()))) goto out;
    uint64_t give_up = pkv_now_ns() + LP_GIVE_UP_NS;
    while (!atomic_load(&sh->ready))
        if (pkv_now_ns() > give_up || !lp_alive(&pid)) goto out;
    uint32_t free_slot[LP_SLOTS], n_free = LP_SLOTS, issued = 0, done = 0;
    for (uint32_t i = 0; i < LP_SLOTS; i++) free_slot[i] = i;
    uint64_t t0 = pkv_now_ns(), idle = 0;
    bool bad = false;
    while (done < reads && !bad) {
        while (issued < reads && issued - done < LP_WINDOW && n_free) {
            lp_entry_t e = {.slot = free_slot[--n_free], .read = issued++};
            if (!lp_push(&sh->req, &e, give_up)) goto out;
        }
        lp_entry_t e;
        if (!lp_pop(&sh->done, &e)) {
            if (++idle % 65536 == 0 && (pkv_now_ns() > give_up || !lp_alive(&pid))) goto out;
            continue;
        }
        bad = !lp_store(m, g, &e, pool + (size_t)e.read * rb, arena + (size_t)e.slot * rb);
        free_slot[n_free++] = e.slot;
        if (++done == warm_reads) t0 = pkv_now_ns();
    }
    if (!bad && done == reads)
        gbps = (double)timed_reads * (double)rb / (double)(pkv_now_ns() - t0);
    lp_entry_t quit = {.slot = LP_QUIT};
    lp_push(&sh->req, &quit, pkv_now_ns() + 1000000000ull);
out:;
    int st;
    xh_reap(pid, &st, pkv_now_ns() + 1000000000ull); /* it exits on QUIT; else killed */
    xf_mac_destroy(m);
    if (pool) pkv_prim_release(pool, rb * reads);
    pkv_prim_shared_close(fd, map, map_bytes);
    return gbps;
}

double xh_lean_pull_gbps(size_t read_bytes, uint32_t layers, size_t piece, uint32_t warm_reads,
                         uint32_t timed_reads)
{
    lp_geo_t g;
    if (lp_geo_init(&g, read_bytes, layers, piece) || !timed_reads) return -1;
    return lp_run(&g, warm_reads, timed_reads);
}

double xh_lean_pull_mac_gbps(size_t read_bytes, uint32_t layers, size_t piece, uint32_t warm_reads,
                             uint32_t timed_reads)
{
    lp_geo_t g;
    if (lp_geo_init(&g, read_bytes, layers, piece) || !timed_reads) return -1;
    g.mac = true;
    return lp_run(&g, warm_reads, timed_reads);
}

/* ---- the same flow over UCX tcp --------------------------------------------------------
 * Lean pull over tcp: the reference for what this flow can reach over loopback tcp. The
 * consumer (a forked child) posts a read's chunk receives into a staging slot and sends
 * READ {read, slot} as an eager active message; the producer (its child) copies pool ->
 * staging (checksummed; through the cache below PKV_XFER_STAGE_NT_BYTES-sized layers, as the
 * engine stages what UCX reads next on the same core) and tag-sends the stream with its
 * checksums as a trailer, in chunks of one tcp segment (PKV_XFER_WHOLE_CHUNK_BYTES, as the
 * engine cuts a small read); the consumer copies staging -> pool (streaming stores), compares the
 * checksums and sends ACK. 8 reads in flight, both sides busy-polling one worker, the
 * UCX settings of the perftest reference. No engine: no progress or caller threads, no
 * registrations, leases, seats, deadlines or liveness. */

enum { LT_READ = 1, LT_ACK = 2, LT_CHUNK = PKV_XFER_WHOLE_CHUNK_BYTES };
#define LT_QUIT UINT32_MAX

typedef struct {
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_ep_h ep;
    bool failed;
    /* producer: READs received, not yet served (at most LP_SLOTS outstanding) */
    uint32_t q[LP_RING][2];
    unsigned long qh, qt;
} lt_t;

typedef struct {
    uint32_t msg[2]; /* READ / ACK body {read, slot}: lives until the slot's next use */
    uint32_t chunks_in;
    bool busy;
    uint64_t sums[LP_MAX_LAYERS]; /* the trailer */
} lt_slot_t;

static void lt_ep_err(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    (void)status;
    ((lt_t *)arg)->failed = true;
}

static ucs_status_t lt_on_msg(void *arg, const void *header, size_t header_length, void *data,
                              size_t length, const ucp_am_recv_param_t *param)
{
    lt_t *t = arg;
    (void)header;
    (void)header_length;
    (void)param;
    if (length != 8 || t->qh - t->qt >= LP_RING) {
        t->failed = true;
        return UCS_OK;
    }
    memcpy(t->q[t->qh++ % LP_RING], data, 8);
    return UCS_OK;
}

static ucs_status_t lt_on_ack(void *arg, const void *header, size_t header_length, void *data,
                              size_t length, const ucp_am_recv_param_t *param)
{
    (void)arg, (void)header, (void)header_length, (void)data, (void)length, (void)param;
    return UCS_OK; /* the engine counts the request sent here; nothing else to do */
}

static void lt_on_conn(ucp_conn_request_h req, void *arg)
{
    lt_t *t = arg;
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .conn_request = req,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = lt_ep_err, .arg = t}};
    if (t->ep || ucp_ep_create(t->worker, &ep, &t->ep) != UCS_OK) t->failed = true;
}

static int lt_open(lt_t *t)
{
    memset(t, 0, sizeof(*t));
    char env[] = XH_TCP_REF_ENV; /* the same settings as the ucx_perftest reference */
    for (char *save, *kv = strtok_r(env, " ", &save); kv; kv = strtok_r(NULL, " ", &save)) {
        char *eq = strchr(kv, '=');
        *eq = '\0';
        setenv(kv, eq + 1, 1);
    }
    ucp_config_t *uc;
    if (ucp_config_read(NULL, NULL, &uc) != UCS_OK) return -1;
    ucp_params_t pp = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                       .features = UCP_FEATURE_TAG | UCP_FEATURE_AM};
    ucs_status_t s = ucp_init(&pp, uc, &t->ctx);
    ucp_config_release(uc);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if (s != UCS_OK || ucp_worker_create(t->ctx, &wp, &t->worker) != UCS_OK) return -1;
    for (unsigned id = LT_READ; id <= LT_ACK; id++) {
        ucp_am_handler_param_t hp = {
            .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                          UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
            .id = id,
            .flags = UCP_AM_FLAG_WHOLE_MSG,
            .cb = id == LT_READ ? lt_on_msg : lt_on_ack,
            .arg = t};
        if (ucp_worker_set_am_recv_handler(t->worker, &hp) != UCS_OK) return -1;
    }
    return 0;
}

/* Fire and forget: a request still pending is released by UCX when it completes. */
static bool lt_posted(void *req)
{
    if (UCS_PTR_IS_ERR(req)) return false;
    if (req) ucp_request_free(req);
    return true;
}

static bool lt_send_msg(lt_t *t, unsigned id, const uint32_t *msg)
{
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_AM_SEND_FLAG_EAGER};
    return lt_posted(ucp_am_send_nbx(t->ep, id, NULL, 0, msg, 8, &prm));
}

/* Chunk c of a read: stream bytes of staging `st`, then the trailer `sums`, as a UCX
 * buffer (an iov of at most two pieces in iov[]). */
static void lt_chunk(const lp_geo_t *g, uint8_t *st, uint64_t *sums, uint32_t c,
                     ucp_dt_iov_t iov[2], size_t *count, ucp_datatype_t *dt)
{
    size_t total = g->read_bytes + 8 * (size_t)g->layers, off = (size_t)c * LT_CHUNK;
    size_t len = PKV_MIN((size_t)LT_CHUNK, total - off), n = 0;
    if (off < g->read_bytes) {
        size_t k = PKV_MIN(len, g->read_bytes - off);
        iov[n++] = (ucp_dt_iov_t){.buffer = st + off, .length = k};
        off += k;
        len -= k;
    }
    if (len)
        iov[n++] = (ucp_dt_iov_t){.buffer = (uint8_t *)sums + (off - g->read_bytes), .length = len};
    *dt = n == 1 ? ucp_dt_make_contig(1) : ucp_dt_make_iov();
    *count = n == 1 ? iov[0].length : n;
}

static uint32_t lt_chunks(const lp_geo_t *g)
{
    return (uint32_t)PKV_DIV_UP(g->read_bytes + 8 * (size_t)g->layers, LT_CHUNK);
}

static void lt_producer(const lp_geo_t *g, uint32_t reads, int port_fd, pid_t parent)
{
    xh_child_detach(parent);
    lt_t t;
    uint8_t *pool = lp_source_pool(g->read_bytes * reads);
    uint8_t *stage = malloc(LP_SLOTS * g->read_bytes);
    uint64_t(*sums)[LP_MAX_LAYERS] = calloc(LP_SLOTS, sizeof(*sums));
    if (!pool || !stage || !sums || lt_open(&t)) _exit(2);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    ucp_listener_params_t lp = {.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                                              UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
                                .sockaddr = {.addr = (struct sockaddr *)&sa, .addrlen = sizeof(sa)},
                                .conn_handler = {.cb = lt_on_conn, .arg = &t}};
    ucp_listener_h ls;
    ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
    if (ucp_listener_create(t.worker, &lp, &ls) != UCS_OK || ucp_listener_query(ls, &la) != UCS_OK)
        _exit(2);
    uint16_t port = ntohs(((struct sockaddr_in *)&la.sockaddr)->sin_port);
    if (write(port_fd, &port, sizeof(port)) != sizeof(port)) _exit(2);
    uint64_t give_up = pkv_now_ns() + LP_GIVE_UP_NS;
    bool nt = g->layer_bytes >= PKV_XFER_STAGE_NT_BYTES;
    for (unsigned long idle = 0; !t.failed;) {
        ucp_worker_progress(t.worker);
        if (t.qt == t.qh) {
            if (++idle % 65536 == 0 && pkv_now_ns() > give_up) break;
            continue;
        }
        uint32_t read = t.q[t.qt % LP_RING][0], slot = t.q[t.qt % LP_RING][1];
        t.qt++;
        if (read == LT_QUIT) _exit(0);
        if (read >= reads || slot >= LP_SLOTS) break;
        uint8_t *st = stage + (size_t)slot * g->read_bytes;
        lp_copy_as(g, st, pool + (size_t)read * g->read_bytes, sums[slot], !nt);
        for (uint32_t l = 0; l < g->layers; l++) sums[slot][l] = htole64(sums[slot][l]);
        for (uint32_t c = 0; c < lt_chunks(g); c++) {
            ucp_dt_iov_t iov[2];
            size_t count;
            ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE};
            lt_chunk(g, st, sums[slot], c, iov, &count, &prm.datatype);
            /* an iov is read when the send goes out: keep it until then (pending sends
             * are rare with 8 reads in flight; wait for them here) */
            void *req = ucp_tag_send_nbx(
                t.ep, prm.datatype == ucp_dt_make_iov() ? (void *)iov : iov[0].buffer, count,
                (uint64_t)slot << 32 | c, &prm);
            if (UCS_PTR_IS_ERR(req)) _exit(3);
            while (req && ucp_request_check_status(req) == UCS_INPROGRESS && !t.failed)
                ucp_worker_progress(t.worker);
            if (req) ucp_request_free(req);
        }
    }
    _exit(3);
}

static void lt_recv_done(void *req, ucs_status_t status, const ucp_tag_recv_info_t *info,
                         void *user_data)
{
    (void)info;
    lt_slot_t *s = user_data;
    s->chunks_in += status == UCS_OK ? 1 : 1000000; /* an error: never "all in" */
    ucp_request_free(req);
}

/* The consumer's endpoint to the producer at loopback `port`, wired up: 0 or -1. */
static int lt_connect(lt_t *t, uint16_t port)
{
    struct sockaddr_in sa = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                          .sockaddr = {.addr = (struct sockaddr *)&sa, .addrlen = sizeof(sa)},
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = lt_ep_err, .arg = t}};
    if (ucp_ep_create(t->worker, &ep, &t->ep) != UCS_OK) return -1;
    /* wire-up done before the first message (UCX 1.13 refuses some during it) */
    ucp_request_param_t fp = {0};
    void *fr = ucp_ep_flush_nbx(t->ep, &fp);
    while (fr && !UCS_PTR_IS_ERR(fr) && ucp_request_check_status(fr) == UCS_INPROGRESS)
        ucp_worker_progress(t->worker);
    if (UCS_PTR_IS_ERR(fr)) return -1;
    if (fr) ucp_request_free(fr);
    return 0;
}

/* The consumer: 8 reads in flight through the producer at `port`; GB/s or -1. */
static double lt_consumer(const lp_geo_t *g, uint32_t warm_reads, uint32_t timed_reads,
                          uint16_t port)
{
    uint32_t reads = warm_reads + timed_reads, n_chunks = lt_chunks(g);
    lt_t t;
    uint8_t *pool = lp_pool(g->read_bytes * reads);
    uint8_t *stage = malloc(LP_SLOTS * g->read_bytes);
    lt_slot_t *slot = calloc(LP_SLOTS, sizeof(*slot));
    ucp_dt_iov_t(*iov)[2] = calloc((size_t)LP_SLOTS * n_chunks, sizeof(*iov));
    if (!pool || !stage || !slot || !iov || lt_open(&t) || lt_connect(&t, port)) return -1;
    uint64_t give_up = pkv_now_ns() + LP_GIVE_UP_NS, t0 = pkv_now_ns();
    uint32_t issued = 0, done = 0;
    double gbps = -1;
    while (done < reads && !t.failed && pkv_now_ns() < give_up) {
        for (uint32_t k = 0; k < LP_SLOTS && issued < reads && issued - done < LP_WINDOW; k++) {
            lt_slot_t *s = &slot[k];
            if (s->busy) continue;
            uint8_t *st = stage + (size_t)k * g->read_bytes;
            *s = (lt_slot_t){.msg = {issued, k}, .busy = true};
            for (uint32_t c = 0; c < n_chunks; c++) {
                ucp_dt_iov_t *v = iov[(size_t)k * n_chunks + c];
                size_t count;
                ucp_request_param_t prm = {
                    .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                    UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
                    .cb = {.recv = lt_recv_done},
                    .user_data = s};
                lt_chunk(g, st, s->sums, c, v, &count, &prm.datatype);
                void *buf = prm.datatype == ucp_dt_make_iov() ? (void *)v : v[0].buffer;
                void *rq =
                    ucp_tag_recv_nbx(t.worker, buf, count, (uint64_t)k << 32 | c, UINT64_MAX, &prm);
                if (UCS_PTR_IS_ERR(rq)) goto out;
            }
            if (!lt_send_msg(&t, LT_READ, s->msg)) goto out;
            issued++;
        }
        ucp_worker_progress(t.worker);
        for (uint32_t k = 0; k < LP_SLOTS; k++) {
            lt_slot_t *s = &slot[k];
            if (!s->busy || s->chunks_in < n_chunks) continue;
            if (s->chunks_in > n_chunks) goto out;
            uint64_t mine[LP_MAX_LAYERS];
            lp_copy(g, pool + (size_t)s->msg[0] * g->read_bytes, stage + (size_t)k * g->read_bytes,
                    mine);
            for (uint32_t l = 0; l < g->layers; l++)
                if (mine[l] != le64toh(s->sums[l])) goto out;
            if (!lt_send_msg(&t, LT_ACK, s->msg)) goto out;
            s->busy = false;
            if (++done == warm_reads) t0 = pkv_now_ns();
        }
    }
    if (done == reads)
        gbps = (double)timed_reads * (double)g->read_bytes / (double)(pkv_now_ns() - t0);
    static const uint32_t quit[2] = {LT_QUIT, 0};
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_AM_SEND_FLAG_EAGER};
    void *q = ucp_am_send_nbx(t.ep, LT_READ, NULL, 0, quit, 8, &prm);
    uint64_t stop = pkv_now_ns() + 1000000000ull;
    while (q && !UCS_PTR_IS_ERR(q) && ucp_request_check_status(q) == UCS_INPROGRESS &&
           pkv_now_ns() < stop)
        ucp_worker_progress(t.worker);
    return gbps;
out:
    return -1;
}

/* The consumer's process: forks the producer, reads its port, runs, reports the figure. */
static void lt_consumer_main(const lp_geo_t *g, uint32_t warm_reads, uint32_t timed_reads,
                             int report_fd, pid_t parent)
{
    xh_child_detach(parent);
    int port_pipe[2];
    double gbps = -1;
    if (pipe2(port_pipe, O_CLOEXEC) == 0) {
        pid_t me = getpid(), prod = fork();
        if (prod == 0) lt_producer(g, warm_reads + timed_reads, port_pipe[1], me);
        uint16_t port = 0;
        struct pollfd pfd = {.fd = port_pipe[0], .events = POLLIN};
        if (prod > 0 && poll(&pfd, 1, 60000) == 1 &&
            read(port_pipe[0], &port, sizeof(port)) == sizeof(port))
            gbps = lt_consumer(g, warm_reads, timed_reads, port);
        int st;
        xh_reap(prod, &st, pkv_now_ns() + 1000000000ull);
    }
    _exit(write(report_fd, &gbps, sizeof(gbps)) == sizeof(gbps) ? 0 : 4);
}

double xh_lean_pull_tcp_gbps(size_t read_bytes, uint32_t layers, size_t piece, uint32_t warm_reads,
                             uint32_t timed_reads)
{
    lp_geo_t g;
    int rep[2];
    if (lp_geo_init(&g, read_bytes, layers, piece) || !timed_reads || pipe2(rep, O_CLOEXEC))
        return -1;
    fflush(NULL);
    pid_t parent = getpid(), pid = fork();
    if (pid == 0) lt_consumer_main(&g, warm_reads, timed_reads, rep[1], parent);
    close(rep[1]);
    double gbps = -1;
    struct pollfd pfd = {.fd = rep[0], .events = POLLIN};
    if (pid > 0 && poll(&pfd, 1, (int)(LP_GIVE_UP_NS / 1000000) + 10000) == 1 &&
        read(rep[0], &gbps, sizeof(gbps)) != sizeof(gbps))
        gbps = -1;
    close(rep[0]);
    int st;
    xh_reap(pid, &st, pkv_now_ns() + 2000000000ull);
    return gbps;
}
