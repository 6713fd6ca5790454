/*
 * Private to src/xfer/ and its tests; internals prefixed xf_ / XF_; interface: xfer/xfer.h.
 *
 * xfer internals shared by the files of src/xfer (not for other modules).
 *
 * Threading invariant (the whole module rests on it):
 *   - The progress thread is the only thread that calls UCX, and the only one that
 *     changes a transfer's state, a peer, or the reads/serves lists. Fields marked
 *     [P] are touched by the progress thread only and need no lock.
 *   - Workers (copy) and seaters (staging) read a transfer's immutable fields [I]
 *     (set before the job is queued, unchanged until the transfer is freed, which
 *     happens only after every job has reported back), check its atomic `abort`, and
 *     report through the event queue: they never change a transfer's state.
 *   - API threads hand work to the progress thread through agent->lock-guarded queues
 *     ([L] fields) plus a wake-up eventfd; they never touch [P] fields.
 *   - A transfer is freed only once quiesced: no seat job, no copy job, no UCX request
 *     still referring to it. Staging is released and pins dropped at that point.
 * Lock order: agent->lock, then rd->mu (never the other way); no UCX call, callback,
 * allocation or kv/stage call is made while agent->lock is held.
 */
#ifndef PKV_XFER_INT_H
#define PKV_XFER_INT_H

#include "pagekv/xfer.h"

#include "core/core.h"
#include "stage/stage.h"
#include "xfer/mac.h"
#include "xfer/wire.h"
#include "xfer/xfer.h"

#include <pthread.h>
#include <stdatomic.h>
#include <ucp/api/ucp.h>

#define XF_MOD           "xfer"
#define XF_AM_CTRL       7               /* UCX active-message id of control messages */
#define XF_CLOSE_WAIT_NS (2000000000ull) /* bounded wait for requests after a forced close */
/* Staging of at most this many bytes is first tried on the progress thread
 * (pkv_stage_try_acquire never waits); a transfer that would wait, or a larger one, goes
 * to a seat thread, so a first-use commit never stalls the progress thread for long. */
#define XF_INLINE_SEAT_BYTES (4ull << 20)
/* Transfers of at most this many bytes are copied on the progress thread as their data is
 * ready: for them the two hand-offs to a copy worker and back cost more than the copies. */
#define XF_INLINE_COPY_BYTES (1ull << 20)
/* The payload chunk and staging-store thresholds are in xfer/xfer.h
 * (PKV_XFER_WHOLE_CHUNK_BYTES, PKV_XFER_STAGE_NT_BYTES): the lean-pull reference uses them. */
/* The progress thread keeps polling (yielding the CPU) this long after it last did
 * something before it sleeps: a wake-up costs more than the usual gap to the next message
 * of an exchange. */
#define XF_LINGER_NS 200000ull
/* pkv_xfer_read_wait polls the outcome this long (yielding the CPU) before it sleeps on
 * the read's condition variable, for the same reason. */
#define XF_WAIT_SPIN_NS 50000ull

typedef struct xf_peer xf_peer_t;
typedef struct xf_serve xf_serve_t;
typedef struct xf_reg xf_reg_t;
typedef struct xf_event xf_event_t;
typedef struct xf_chunk xf_chunk_t;
typedef struct xf_ctl_buf xf_ctl_buf_t;
typedef struct xf_probe xf_probe_t;

/* pkv_xfer_probe's request: the caller waits on cv until done; the loop sets done last
 * (under mu) and never touches it afterwards. */
struct xf_probe {
    xf_probe_t *next; /* [L] new_probes, then [P] the agent's probes */
    char addr[PKV_XFER_ADDR_MAX];
    uint64_t deadline_ns;
    xf_peer_t *peer; /* [P] */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done; /* [mu] */
    int rc;
    pkv_xfer_layout_t layout;
};

/* A copy worker's thread argument: its own MAC contexts (OpenSSL's are per thread). */
typedef struct xf_worker_arg {
    pkv_xfer_agent_t *a;
    xf_mac_t *mac;
} xf_worker_arg_t;

/* ---- events: workers -> progress thread (intrusive, preallocated per transfer) -------- */
typedef enum {
    XF_EV_SEATED,      /* seat job finished: status, grant */
    XF_EV_LAYER_READY, /* producer copied layer into staging: layer (its MAC in layer_mac) */
    XF_EV_VERIFIED,    /* consumer stored layer: layer, status (OK / CORRUPT) */
    XF_EV_JOB_DONE,    /* a copy job returned */
} xf_event_kind_t;

struct xf_event {
    xf_event_t *next; /* [L] */
    xf_event_kind_t kind;
    bool is_serve; /* owner is an xf_serve_t, else a pkv_xfer_read_t */
    void *owner;
    uint32_t layer;
    int status;
    pkv_stage_grant_t *grant;
};

/* ---- jobs: progress thread -> workers -------------------------------------------------- */
typedef enum { XF_JOB_PRODUCE, XF_JOB_VERIFY, XF_JOB_SEAT } xf_job_kind_t;
typedef struct xf_job {
    struct xf_job *next; /* [L] */
    xf_job_kind_t kind;
    bool is_serve;
    void *owner;
    uint32_t layer; /* VERIFY */
} xf_job_t;

/* ---- the staging and copy view shared by both directions [I] -------------------------- */
typedef struct {
    uint64_t stage_id;
    uint32_t n_blocks;
    uint32_t *blocks; /* (n_blocks) pool blocks in stream order (src or dst) */
    uint32_t layers;
    uint32_t head_lo, head_n; /* the KV heads the stream carries (global ids) */
    uint32_t rank;            /* the pool rank whose pieces are copied (the agent's) */
    uint64_t layer_bytes;     /* one block's slice of one layer: K and V of head_n heads */
    uint64_t layer_total;     /* n_blocks * layer_bytes */
    uint32_t chunk_bytes;
    bool whole;                /* chunks cut the stream across layers (small transfers) */
    uint32_t trailer_bytes;    /* whole: the MACs after the stream (16 x layers), else 0 */
    uint8_t *trailer;          /* whole: the owner's layer_mac, sent / received as the trailer */
    uint8_t *keys;             /* (32 x layers) each layer's one-time MAC key (xfer/mac.h) */
    bool stage_nt;             /* staging copies store around the cache (PKV_XFER_STAGE_NT_BYTES) */
    uint32_t chunks_per_layer; /* 1 when whole */
    uint32_t n_chunks;
    uint32_t pages;
    pkv_stage_grant_t *grant; /* set by the SEATED event, before any copy job */
    uint64_t *run_off;        /* (grant->nruns + 1) stream offset of each run */
    atomic_bool abort;        /* ask running jobs to stop early */
} xf_view_t;

/* ---- one payload chunk (a tag message) ------------------------------------------------- */
struct xf_chunk {
    void *owner; /* xf_serve_t or pkv_xfer_read_t */
    bool is_serve;
    uint32_t index;
    void *req;         /* [P] UCX request while in flight */
    bool done;         /* [P] the completion callback ran for the last post */
    ucp_dt_iov_t *iov; /* [P] when the chunk spans staging runs */
    uint32_t iovcnt;
};

/* ---- peers ----------------------------------------------------------------------------- */
typedef enum { XF_PEER_ACTIVE, XF_PEER_FAILED, XF_PEER_CLOSING, XF_PEER_CLOSED } xf_peer_state_t;

struct xf_peer { /* every field [P] */
    xf_peer_t *next;
    uint32_t id; /* staging peer id, unique within the agent */
    bool outgoing;
    char addr[PKV_XFER_ADDR_MAX]; /* outgoing: the address we connected to */
    ucp_ep_h ep;
    xf_peer_state_t state;
    ucs_status_t err;    /* set by the error callback, handled in the loop */
    uint64_t last_rx_ns; /* the tick after a message came (rx_seen) */
    bool rx_seen;        /* a message came since the last tick */
    uint64_t next_hb_ns;
    uint64_t hb_seq;
    uint64_t remote_agent_id;
    bool hello_sent; /* our HELLO went out (outgoing: queued at connect, it leaves once the
                        server has spoken; incoming: the answer to the client's HELLO) */
    bool hello_seen; /* the other side's HELLO came; `identity` and `layout` are its own */
    char identity[XF_WIRE_MAX_IDENTITY + 1];
    pkv_xfer_layout_t layout;
    bool layout_bad;         /* its layout is incompatible with ours (logged once) */
    char layout_why[192];    /* ... why, naming both values */
    uint8_t foreign_version; /* it speaks another wire version (no HELLO will come) */
    uint32_t ctl_inflight;   /* control sends not yet completed */
    uint32_t refs;           /* transfers using this peer */
    bool established;        /* the other side has spoken: control sends may go out */
    uint64_t established_ns; /* when it did (read timings) */
    int map_fd;              /* outgoing, same host: the producer's staging arena, mapped */
    uint8_t *map_base;
    uint64_t map_size, map_ino;
    uint32_t map_pid;
    xf_ctl_buf_t *queued; /* control messages waiting for establishment */
    xf_ctl_buf_t **queued_tail;
    void *close_req;
    bool close_sent;     /* shutdown: we sent CLOSE ... */
    bool close_acked;    /* ... and the peer answered it */
    bool remote_closing; /* the peer sent CLOSE: its disconnect is expected */
    bool foreign_logged; /* a message of another wire version came and was logged */
    uint64_t close_deadline_ns;
    bool close_done;
};

/* ---- producer registrations ------------------------------------------------------------ */
struct xf_reg {
    xf_reg_t *hnext;  /* [L] the agent's registration table chain; then the tick's ending list */
    xf_reg_t *unext;  /* [L] the agent's list of unregistered ones (while in_tab) */
    uint32_t heap_at; /* [L] 1 + its index in the agent's lease heap; 0: not there */
    bool in_tab;      /* [L] in the agent's table (not yet removed to be ended) */
    uint64_t request_id;
    uint8_t token[PKV_XFER_TOKEN_BYTES];
    uint8_t digest[XF_WIRE_DIGEST_BYTES]; /* of blocks[0..n): every READ must carry it */
    uint64_t expiry_ns;
    uint64_t registered_ns; /* serve timings */
    pkv_xfer_sent_fn fn;
    void *arg;
    uint32_t n;
    uint32_t *blocks;    /* (n) in sequence order */
    bool unregister_req; /* [L] */
    uint32_t n_serving;  /* [P] serves of it not yet quiesced */
    bool ended;          /* [P] removed from the list; pins drop when not serving */
    int end_outcome;     /* [P] */
    /* [P] its reads: reads_total is fixed by the first READ accepted (0 before); `busy`
     * and `done` are bitmaps of read indices (ceil(reads_total / 64) words each, one
     * allocation): being served now, acknowledged. It ends sent when n_done == reads_total. */
    uint32_t reads_total, n_done;
    uint64_t *busy, *done;
    uint64_t bytes_done; /* payload bytes its acknowledged reads moved */
    bool have_timings;   /* t: the last acknowledged serve that moved bytes */
    pkv_xfer_serve_timings_t t;
};

/* ---- producer transfer (one accepted READ) --------------------------------------------- */
typedef enum {
    XF_SERVE_SEATING,
    XF_SERVE_SENDING,
    XF_SERVE_WAIT_ACK,
    XF_SERVE_DONE
} xf_serve_state_t;

struct xf_serve {
    xf_serve_t *next; /* [P] */
    pkv_xfer_agent_t *agent;
    xf_peer_t *peer;  /* [I] */
    xf_reg_t *reg;    /* [I] */
    uint64_t xfer_id; /* the consumer's id */
    uint64_t request_id;
    uint32_t read_index;               /* which of the registration's reads this is */
    uint8_t nonce[XF_MAC_NONCE_BYTES]; /* the READ's: its MAC keys */
    uint64_t deadline_ns;
    xf_view_t v; /* [I] blocks are producer pool blocks */
    /* [P] */
    xf_serve_state_t state;
    bool state_done;  /* outcome decided */
    bool shared;      /* DATA carries arena offsets; the consumer copies from our arena */
    bool pump_needed; /* a send completed: post more from the loop */
    uint64_t t_start, t_seated, t_first_ready, t_last_ready, t_all_sent; /* timings */
    bool stage_cancelled; /* we cancelled a waiting acquire */
    int outcome;
    uint64_t done_ns;
    bool seat_pending;
    uint32_t jobs_pending;
    uint32_t layers_ready;
    uint8_t *layer_mac;  /* (16 x layers): written by the copy that staged the layer */
    uint32_t next_chunk; /* next chunk to post */
    uint32_t chunks_sent;
    uint32_t sends_inflight;
    uint32_t layers_sent; /* shared arena: layers whose DATA went out */
    bool posting;         /* inside pump(): serve_settle and all_sent wait */
    bool acked;
    bool zombie;
    bool end_settle;    /* reg_end finished it: settle it after the walk */
    xf_chunk_t *chunks; /* (n_chunks) */
    xf_event_t ev_seated, ev_job_done;
    xf_event_t *ev_layer; /* (layers) */
    xf_job_t job_seat, job_produce;
};

/* ---- consumer transfer ----------------------------------------------------------------- */
typedef enum {
    XF_READ_QUEUED,
    XF_READ_SEATING,
    XF_READ_READING,
    XF_READ_DONE,
} xf_read_state_t;

struct pkv_xfer_read {
    pkv_xfer_agent_t *agent; /* NULL once the agent has let go (destroy) */
    atomic_int refs;         /* caller + agent */
    atomic_bool cancel_req;
    pthread_mutex_t mu; /* guards done (set with release: a waiter may poll it), outcome, bytes */
    pthread_cond_t cv;
    atomic_bool done;
    int outcome;
    uint64_t bytes;
    pkv_xfer_done_fn fn;
    void *arg;
    struct pkv_xfer_read *next_new; /* [L] agent->new_reads */
    /* [I] */
    uint64_t xfer_id;
    uint64_t request_id;
    uint8_t token[PKV_XFER_TOKEN_BYTES];
    uint8_t nonce[XF_MAC_NONCE_BYTES];    /* this read's: its MAC keys (set at admission) */
    uint8_t digest[XF_WIRE_DIGEST_BYTES]; /* of the handle's whole block list, sent in READ */
    char addr[PKV_XFER_ADDR_MAX];
    char identity[XF_WIRE_MAX_IDENTITY + 1]; /* the producer we expect; "" none */
    bool check_identity;
    bool release;                     /* token-only release: no blocks, no staging */
    uint32_t reads_total, read_index; /* sent in READ */
    uint32_t *src_blocks;             /* (n) producer ids from the handle (the subset read) */
    uint64_t deadline_ns;
    xf_view_t v; /* blocks are local destination blocks */
    /* [P] */
    struct pkv_xfer_read *next;
    xf_read_state_t state;
    bool finished; /* outcome decided (delivery may follow) */
    xf_peer_t *peer;
    bool read_sent;
    bool read_deferred; /* READ waits for the producer's HELLO (identity check) */
    pkv_xfer_why_t why; /* set with a rejected outcome we decided */
    bool seat_pending;
    uint32_t jobs_pending;
    uint32_t recvs_inflight;
    uint32_t *layer_chunks; /* (layers) chunks received */
    uint32_t chunks_in;     /* chunks received (whole-stream views) */
    uint8_t *layer_flags;   /* (layers) bit0 header seen, bit1 verify queued, bit2 verified */
    uint8_t *layer_mac;     /* (16 x layers) the producer's tags (DATA or trailer) */
    bool want_shared;       /* [I] the handle offers a same-host arena we may map */
    uint32_t local_pid;     /* [I] ... its producer pid, memfd, inode, size */
    int32_t local_fd;
    uint64_t local_ino, local_bytes;
    bool shared;             /* copying straight from the producer's arena */
    const uint8_t *arena;    /* the mapping (the peer owns it) */
    uint64_t **layer_pieces; /* (layers) shared: {offset, length} pairs from DATA; a whole
                              * stream's one DATA (v.whole): all of them in [0] */
    uint32_t *layer_npieces;
    uint32_t layers_verified;
    bool zombie;
    bool quiesced;   /* staging and pins returned */
    bool released;   /* the agent dropped its reference */
    bool cancelling; /* inside cancel_recvs or start_reading: settle() must wait */
    bool slow_logged;
    bool stage_cancelled;                        /* we cancelled a waiting acquire */
    uint64_t t_start, t_seated, t_first, t_last; /* timings (pkv_xfer_read_timings) */
    uint64_t t_requested, t_connected;           /* ... READ sent; set at finish */
    uint64_t done_ns;
    bool cancel_recvs; /* recvs still posted must be cancelled from the loop */
    xf_chunk_t *chunks;
    xf_event_t ev_seated;
    xf_event_t *ev_layer; /* (layers) */
    xf_job_t job_seat;
    xf_job_t *job_layer; /* (layers) */
};

/* ---- the agent ------------------------------------------------------------------------- */
typedef struct {
    _Atomic uint64_t reads_started, reads_done[8], bytes_received;
    _Atomic uint64_t registered, registrations, pinned_blocks, serves_started, serves_failed, sent,
        bytes_sent, rejected, expired, released;
    _Atomic uint64_t active_transfers, staging_pages_held, peers, peers_lost, proto_errors,
        foreign_msgs, stale_dropped, written_off;
} xf_stats_t;

struct pkv_xfer_agent {
    /* [I] after create */
    pkv_xfer_config_t cfg;
    pkv_kv_t *kv;
    pkv_stage_t *stage;
    pkv_geometry_t geo;       /* the model's (kv_heads: every rank's) */
    uint64_t layer_bytes;     /* one block's slice of one layer, every head */
    uint32_t tp, rank;        /* the pool's ranks and this agent's */
    uint32_t head_lo, head_n; /* the heads the rank holds */
    pkv_xfer_layout_t layout; /* what our HELLO says */
    size_t page_bytes;        /* staging page */
    char addr[PKV_XFER_ADDR_MAX];
    uint64_t agent_id;
    bool have_boot_id;
    uint8_t boot_id[16]; /* this host's boot: same-host shared staging */
    int arena_fd;        /* our stage's memfd (-1: not shared) */
    uint64_t arena_bytes, arena_ino;
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_listener_h listener;
    ucp_datatype_t discard_dt;
    int ucx_efd, wake_fd, epfd;
    atomic_bool wake_posted; /* a wake is pending: xf_wake turns it on (and writes wake_fd
                                only if it was off); the loop takes the queues only when
                                it was on */
    pthread_t progress_thread;
    _Atomic uint64_t loop_ns; /* when a progress round last began (liveness; stored at most
                                 once a millisecond, so a polling loop does not keep
                                 writing a line other threads read) */
    pthread_t *workers;
    struct xf_worker_arg *wargs; /* (workers) each copy worker's agent and MAC contexts */
    pthread_t *seaters;
    uint32_t n_workers, n_seaters;
    pkv_xfer_faults_t faults;
    char identity[XF_WIRE_MAX_IDENTITY + 1]; /* presented in HELLO */
    uint64_t nonce_prefix;                   /* reads' nonces: this and a counter */
    _Atomic uint64_t nonce_ctr;
    xf_mac_t *mac; /* [P] the progress thread's MAC contexts */
    /* [P] events taken off `events`, not yet handled (a round's budget ran out) */
    xf_event_t *held, **held_tail;

    pthread_mutex_t lock;
    pthread_cond_t job_cond;  /* workers wait here */
    pthread_cond_t seat_cond; /* seaters wait here */
    pthread_cond_t idle_cond; /* wait_idle waits here */
    /* [L] */
    pkv_xfer_read_t *new_reads, **new_reads_tail;
    xf_probe_t *new_probes; /* pkv_xfer_probe: waiting for the loop */
    xf_event_t *events, **events_tail;
    xf_job_t *jobs, **jobs_tail;
    xf_job_t *seats, **seats_tail;
    /* Registrations by request id: reg_tab has 1 << reg_bits chains (NULL until the first
     * register), grown to keep reg_count <= buckets. reg_heap (as many slots as chains) is
     * a min-heap by lease expiry of those with a lease (one whose lease runs out while it
     * is being served leaves it and returns when the serve ends); reg_unreg lists those
     * unregistered. The tick ends what they hold: its cost follows what ends, not
     * how many are registered. */
    xf_reg_t **reg_tab;
    uint32_t reg_bits, reg_count;
    xf_reg_t **reg_heap;
    uint32_t reg_heap_n;
    xf_reg_t *reg_unreg;
    bool stopping;     /* destroy began */
    bool threads_stop; /* workers and seaters exit when their queue is empty */
    bool progress_exited;
    uint64_t busy; /* transfers not yet quiesced (mirror for wait_idle) */

    /* [P] */
    uint64_t now_ns; /* the loop's clock (libuv's uv_now): read at the top of every round,
                        so handlers stamp debug times without a clock call each; behind by
                        at most the round's work so far. Deadlines, lease checks, done
                        times and peer liveness (rx_seen, stamped by the tick) read the
                        clock afresh. */
    xf_peer_t *peers;
    pkv_xfer_read_t *reads;
    xf_serve_t *serves;
    xf_probe_t *probes; /* probes waiting for a HELLO */
    ucp_conn_request_h conn_reqs[64];
    uint32_t n_conn_reqs;
    uint32_t next_peer_id;
    uint64_t read_ctr;      /* consumer ids (tags): a keyed permutation of this counter */
    uint64_t read_key[4];   /* ... with these round keys (xf_next_read_id) */
    uint64_t next_serve_id; /* producer stage ids */
    uint32_t discards_inflight;
    uint64_t stop_ns; /* when shutdown began */
    bool stop_started;
    bool eps_closing;
    bool flushing;
    uint64_t flush_deadline_ns;
    uint64_t last_timer_ns;
    struct { /* the acknowledged serve whose sent callback runs (pkv_xfer_sent_timings) */
        bool valid;
        uint64_t request_id;
        pkv_xfer_serve_timings_t t;
    } acked;
    xf_stats_t st;
};

/* agent.c */
void xf_wake(pkv_xfer_agent_t *a);
void xf_event_post(pkv_xfer_agent_t *a, xf_event_t *ev);
void xf_job_post(pkv_xfer_agent_t *a, xf_job_t *job, bool seat);
void xf_busy_add(pkv_xfer_agent_t *a, int delta);
/* Is a transfer of `bytes` small (XF_INLINE_COPY_BYTES), so copied on the progress
 * thread and, payload through UCX, read as a whole stream? */
bool xf_small(const pkv_xfer_agent_t *a, uint64_t bytes);
/* Are two layouts compatible (model id when both set, layers, kv_heads, head_dim,
 * block_tokens, dtype)? false: why (cap bytes) names both values. */
bool xf_layout_compatible(const pkv_xfer_layout_t *ours, const pkv_xfer_layout_t *theirs, char *why,
                          size_t cap);
/* Probes (agent.c): take new ones, the HELLO came or the peer is gone, the tick, shutdown. */
void xf_probes_admit(pkv_xfer_agent_t *a, xf_probe_t *list);
void xf_probes_on_peer(pkv_xfer_agent_t *a, xf_peer_t *p, int rc);
void xf_probes_tick(pkv_xfer_agent_t *a, uint64_t now);
void xf_probes_shutdown(pkv_xfer_agent_t *a);
int xf_random(void *buf, size_t n);

/* peer.c */
xf_peer_t *xf_peer_connect(pkv_xfer_agent_t *a, const char *addr);
void xf_peer_accept(pkv_xfer_agent_t *a, ucp_conn_request_h req);
xf_peer_t *xf_peer_by_ep(pkv_xfer_agent_t *a, ucp_ep_h ep);
void xf_peer_fail(pkv_xfer_agent_t *a, xf_peer_t *p, const char *why);
const uint8_t *xf_peer_map_arena(xf_peer_t *p, uint32_t pid, int32_t fd, uint64_t ino,
                                 uint64_t bytes);
void xf_peers_tick(pkv_xfer_agent_t *a, uint64_t now);
void xf_peer_close_all(pkv_xfer_agent_t *a, bool force);
void xf_peers_say_close(pkv_xfer_agent_t *a);
bool xf_peers_close_answered(pkv_xfer_agent_t *a);
bool xf_peers_closed(pkv_xfer_agent_t *a);
void xf_peers_free(pkv_xfer_agent_t *a);
int xf_ctl_send(pkv_xfer_agent_t *a, xf_peer_t *p, void *buf, size_t len);
/* xf_send_fail with a why (XF_WIRE_WHY_*) the consumer can name (pkv_xfer_read_why). */
void xf_send_fail_why(pkv_xfer_agent_t *a, xf_peer_t *p, uint64_t xfer_id, uint64_t request_id,
                      int reason, uint16_t why, const char *text);
void xf_send_fail(pkv_xfer_agent_t *a, xf_peer_t *p, uint64_t xfer_id, uint64_t request_id,
                  int reason, const char *text);
ucs_status_t xf_am_ctrl(void *arg, const void *header, size_t header_length, void *data,
                        size_t length, const ucp_am_recv_param_t *param);
void xf_drain_stale(pkv_xfer_agent_t *a);
uint64_t xf_next_read_id(pkv_xfer_agent_t *a);
int xf_discard_dt_create(pkv_xfer_agent_t *a);

/* view.c: staging views, copy plans, workers */
/* A view of heads [head_lo, head_lo + head_n) of n_blocks blocks of the agent's rank. */
int xf_view_init(xf_view_t *v, pkv_xfer_agent_t *a, uint32_t n_blocks, const uint32_t *blocks,
                 uint32_t chunk_bytes, bool whole, uint32_t head_lo, uint32_t head_n);
void xf_view_fini(xf_view_t *v);
int xf_view_set_grant(xf_view_t *v, pkv_stage_grant_t *grant);
void xf_chunk_span(const xf_view_t *v, uint32_t c, uint64_t *off, uint64_t *len);
/* Describe stream bytes [off, off+len) as a buffer or an iov; PKV_ERR_NOMEM. */
int xf_chunk_buffer(const xf_view_t *v, xf_chunk_t *ch, uint64_t off, uint64_t len, void **buf,
                    size_t *count, ucp_datatype_t *dt);
void *xf_worker_main(void *arg);
void *xf_seater_main(void *arg);

/* view.c copies (streaming stores: the caller fences before announcing the bytes) */
/* Copy layer l pool <-> staging and compute its MAC (key v->keys + 32 l) with the calling
 * thread's contexts: false when the MAC could not be computed. */
bool xf_view_copy_layer(const xf_view_t *v, pkv_xfer_agent_t *a, xf_mac_t *m, uint32_t l,
                        bool to_stage, uint8_t tag[XF_MAC_TAG_BYTES]);
void xf_view_corrupt(const xf_view_t *v, uint32_t l);
/* Layer l's MAC over what is staged now, under `keys` (32 x layers) instead of the view's
 * (fault injection: a forged layer). */
void xf_view_mac_staged(const xf_view_t *v, xf_mac_t *m, const uint8_t *keys, uint32_t l,
                        uint8_t tag[XF_MAC_TAG_BYTES]);
/* Arena {offset, length} pieces of stream range [off, off+len); 0 when more than cap. */
uint32_t xf_view_arena_pieces(const xf_view_t *v, uint64_t off, uint64_t len, uint64_t *out,
                              uint32_t cap);
/* Consumer, shared: copy layer l from a mapped producer arena into the pool (no fence). The layer's
 * bytes start `skip` bytes into the pieces (0 for a layer's own pieces, l * layer_total
 * for the whole stream's). */
bool xf_view_copy_layer_from(const xf_view_t *v, pkv_xfer_agent_t *a, xf_mac_t *m, uint32_t l,
                             const uint8_t *arena, const uint64_t *pieces, uint32_t n,
                             uint64_t skip, uint8_t tag[XF_MAC_TAG_BYTES]);

/* consumer.c */
void xf_reads_admit(pkv_xfer_agent_t *a, pkv_xfer_read_t *list);
void xf_read_event(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd, xf_event_t *ev);
void xf_read_on_data(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_data_t *d);
void xf_read_on_fail(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_fail_t *f);
void xf_read_on_foreign(pkv_xfer_agent_t *a, xf_peer_t *p, uint64_t xfer_id, const char *why);
void xf_read_job(pkv_xfer_agent_t *a, xf_mac_t *m, pkv_xfer_read_t *rd, uint32_t layer);
void xf_read_on_ack(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_ack_t *k);
/* The producer's HELLO came on p: reads waiting for it send READ or end rejected (an
 * incompatible layout, another identity). */
void xf_reads_on_hello(pkv_xfer_agent_t *a, xf_peer_t *p);
/* p speaks another wire version (it will send no HELLO): reads waiting for one end
 * rejected with `why` now. */
void xf_reads_no_hello(pkv_xfer_agent_t *a, xf_peer_t *p, const char *why);
void xf_read_seat(pkv_xfer_agent_t *a, pkv_xfer_read_t *rd);
void xf_read_unref(pkv_xfer_read_t *rd);

/* producer.c */
void xf_serve_on_read(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_read_t *r);
void xf_serve_on_ack(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_ack_t *k);
void xf_serve_on_fail(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_fail_t *f);
void xf_serve_on_foreign(pkv_xfer_agent_t *a, xf_peer_t *p, uint64_t xfer_id, const char *why);
void xf_serve_event(pkv_xfer_agent_t *a, xf_serve_t *s, xf_event_t *ev);
void xf_serve_job(pkv_xfer_agent_t *a, xf_mac_t *m, xf_serve_t *s);
void xf_serve_seat(pkv_xfer_agent_t *a, xf_serve_t *s);
void xf_regs_tick(pkv_xfer_agent_t *a, uint64_t now);
void xf_regs_shutdown(pkv_xfer_agent_t *a);

/* The walks over the agent's transfers (agent.c), written once for both sides: the
 * consumer's reads (consumer.c, xf_side_reads) and the producer's serves (producer.c,
 * xf_side_serves). A side gives its list and what one transfer does in each walk;
 * the walks visit the reads first, then the serves. */
typedef struct xf_side {
    const char *name;         /* "read" / "serve", in log lines */
    const char *payload_ops;  /* "receives" / "sends" */
    const char *lost_why;     /* outcome text when the peer is lost */
    const char *shutdown_why; /* outcome text when the agent shuts down */
    const char *stuck_why;    /* why the peer is failed when payload operations hang */
    const char *kept;         /* tail of the written-off line */
    void *(*head)(pkv_xfer_agent_t *a);
    void *(*next)(void *t);
    xf_peer_t *(*peer)(void *t);
    bool (*ended)(void *t); /* outcome decided */
    /* Decide the outcome (tell: send the peer a FAIL), then settle: t may be freed. */
    void (*end)(pkv_xfer_agent_t *a, void *t, int outcome, bool tell, const char *why);
    bool (*moving)(void *t); /* payload bytes in flight now */
    /* One transfer's tick; false: stop this side's walk (the list changed under it). */
    bool (*tick)(pkv_xfer_agent_t *a, void *t, uint64_t now);
} xf_side_t;

extern const xf_side_t xf_side_reads, xf_side_serves;

void xf_xfers_tick(pkv_xfer_agent_t *a, uint64_t now);
void xf_xfers_peer_lost(pkv_xfer_agent_t *a, xf_peer_t *p);
void xf_xfers_shutdown(pkv_xfer_agent_t *a);
bool xf_xfers_active_data(pkv_xfer_agent_t *a);
/* The tick step both sides share: `inflight` payload operations of an ended transfer
 * neither completed nor failed. After 2 close waits its peer is failed (which ends and
 * may free every transfer on it: true, stop the walk); after 3, with the peer already
 * down, they are written off and the transfer marked *zombie (its staging kept). */
bool xf_xfer_stuck(pkv_xfer_agent_t *a, const xf_side_t *side, xf_peer_t *peer, uint64_t xfer_id,
                   uint32_t inflight, uint64_t done_ns, uint64_t now, bool *zombie);

/* Time from `then` to `now`, 0 when `then` is later: the loop reads the clock once per
 * iteration, and a transfer that ends during the iteration carries a later stamp. */
static inline uint64_t xf_since(uint64_t now, uint64_t then)
{
    return now > then ? now - then : 0;
}

/* Progress thread: seat `pages` at once if pkv_stage_try_acquire can (fills *ev as the
 * seat thread would); false: post the seat job instead. */
bool xf_seat_inline(pkv_xfer_agent_t *a, uint64_t stage_id, uint32_t peer, uint32_t pages,
                    xf_event_t *ev);

#define XF_STAT_ADD(a, f, n) atomic_fetch_add_explicit(&(a)->st.f, (n), memory_order_relaxed)
#define XF_STAT_SUB(a, f, n) atomic_fetch_sub_explicit(&(a)->st.f, (n), memory_order_relaxed)

#endif
