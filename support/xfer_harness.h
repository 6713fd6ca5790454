/*
 * Two-process transfer harness shared by `pagekv bench xfer` and tests/test_xfer.c
 * (support/: compiled once into build/libpkvsupport.a). The fault matrix's oracle
 * (xh_outcome_expected, xh_*_reports) and the data pattern are declared here too; they
 * live in support/xfer_oracle.c, the processes and pipes in support/xfer_proc.c.
 *
 * xh_run() forks a producer and a consumer process. The calling process never touches
 * UCX (UCX and fork do not mix): each child builds its own pool, stage and agent after
 * the fork. The producer fills its pool with a seeded pattern, registers the requests
 * and hands the encoded handles to the consumer (through the parent); the consumer reads
 * them, checks every byte through its own pool's addressing, and both write their
 * accounting into the result (shared memory) and say so over pipes. Faults are injected at exact
 * points by the children's fault hooks (raise(SIGKILL) / raise(SIGSTOP) / sleeps) or by the parent
 * (kill -9 before the read, network namespaces).
 *
 * Each child runs in a process group of its own and is killed when the thread that forked
 * it exits (PR_SET_PDEATHSIG): call xh_run() from a thread that outlives the run.
 */
#ifndef PKV_SUPPORT_XFER_HARNESS_H
#define PKV_SUPPORT_XFER_HARNESS_H

#include "pagekv/kv.h"

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#define XH_MAX_REQ 8192

typedef enum {
    XH_NONE = 0,
    XH_PRODUCER_KILLED_BEFORE, /* kill -9 after registering, before the read */
    XH_PRODUCER_KILLED_DURING, /* producer raises SIGKILL once layer 1 is posted, before its DATA */
    XH_PRODUCER_KILLED_AFTER,  /* ... after every chunk left, before the ACK */
    XH_CONSUMER_KILLED_DURING, /* consumer raises SIGKILL when layer 1 arrived */
    XH_PRODUCER_STOPPED,       /* producer raises SIGSTOP at the same point */
    XH_STAGING_FULL_CONSUMER,  /* consumer staging held by someone else until the end */
    XH_STAGING_FULL_PRODUCER,  /* producer staging held by someone else */
    XH_NOFIT_CONSUMER,         /* consumer staging smaller than the transfer */
    XH_NOFIT_PRODUCER,         /* producer staging smaller than the transfer */
    XH_DEADLINE,               /* producer stages slowly (sleep per layer): deadline passes */
    XH_WRONG_TOKEN,
    XH_UNKNOWN_REQUEST,
    XH_CORRUPT,                 /* producer flips a staged byte after MACing it */
    XH_SHUTDOWN_CONSUMER,       /* consumer destroys its agent mid-transfer */
    XH_SHUTDOWN_PRODUCER,       /* producer destroys its agent mid-transfer */
    XH_CANCEL,                  /* consumer cancels mid-transfer */
    XH_CONSUMER_STOPPED,        /* consumer raises SIGSTOP when layer 1 arrived (killed later) */
    XH_PRODUCER_KILLED_STAGING, /* producer raises SIGKILL once it staged layer 1: a small
                                   read, staged whole before its one DATA, dies with nothing sent */
    XH_FORGED,                  /* producer changes a staged layer and MACs it again under
                                   keys from a wrong token: what a peer without the token
                                   could send with the right ids */
    XH_NFAULTS
} xh_fault_t;

typedef struct {
    pkv_geometry_t geo;
    uint32_t n_tokens;    /* per request */
    uint32_t n_requests;  /* <= XH_MAX_REQ */
    bool sequential;      /* read one request after another (timing) instead of all at once */
    uint32_t warmup;      /* the first `warmup` requests are read first, the same way (one by
                             one, as a batch or through the window), and have all ended
                             before the rest start */
    uint32_t window;      /* > 0: reads keep `window` outstanding (a new one as soon as the
                             oldest ended), warm-up and rest alike */
    bool memcpy_ref;      /* the consumer measures xh_memcpy_gbps() right before its first
                             read and right after its last one */
    bool prewarm;         /* commit every staging page once before any read (steady-state
                             timing: the reads then never pay the first-use commit) */
    uint32_t chunk_bytes; /* 0: agent default */
    uint32_t page_bytes;  /* staging page; 0: 64 KiB */
    bool fixed_slots;     /* stages in fixed-slot mode (a slot fits one request) */
    uint32_t prod_pages, cons_pages; /* staging arena pages; 0: enough for every request */
    uint64_t deadline_ms;
    uint64_t seed;
    xh_fault_t fault;
    bool tcp;               /* UCX_TLS=tcp in both children */
    bool shared;            /* producer staging is a memfd arena the consumer maps (same
                               host): payload bypasses UCX */
    const char *netns_prod; /* named network namespaces (ip netns) or NULL */
    const char *netns_cons;
    const char *prod_host; /* producer listen address; NULL: 127.0.0.1 */
    uint32_t workers;      /* copy workers per agent; 0: default */
    uint32_t idle_regs;    /* the producer also registers this many requests (over request
                              0's blocks) that nobody reads, as a server holding many does */
    uint64_t timeout_ms;   /* the parent gives up (kills both) after this; 0: deadline x
                              n_requests + 20 s */
} xh_case_t;

/* The result of a run, filled where it is written: the consumer process writes the
 * consumer's fields, the producer process the producer's (each valid once its report
 * arrived: cons_report, prod_report), the parent the rest. */
typedef struct {
    bool ok;         /* both sides ran the protocol (a child that crashed or hung: false) */
    char error[160]; /* what went wrong in the harness itself */
    int prod_wstatus, cons_wstatus; /* waitpid statuses (-1 not reaped) */
    bool prod_report, cons_report;  /* each side said its fields are written */
    /* consumer */
    int32_t outcome[XH_MAX_REQ];
    uint64_t elapsed_ns[XH_MAX_REQ]; /* read() call to outcome */
    uint64_t done_at_ns[XH_MAX_REQ]; /* CLOCK_MONOTONIC at the outcome */
    uint32_t mismatched_positions[XH_MAX_REQ];
    uint64_t bytes[XH_MAX_REQ];
    double memcpy_gbps[2];      /* memcpy_ref: before the first read, after the last */
    double memcpy_cold_gbps[2]; /* the same, out of cache (xh_memcpy_gbps cold) */
    double cpu_rtt_ns[2];       /* memcpy_ref: pkv_rtt_probe_ns() (support/rtt_probe.h) right
                                   before the first read and right after the last one (0:
                                   not measured) */
    uint64_t cons_active_left, cons_staging_left, cons_pins_left, cons_blocks_live;
    int cons_stage_rc;
    uint64_t cons_stage_leaked;
    /* producer */
    uint64_t kill_at_ns; /* when the producer was killed (self or parent) or a child stopped
                            itself, 0 if not */
    uint64_t sent, serves_started, serves_failed, rejected, registrations_left, written_off;
    uint64_t prod_active_left, prod_staging_left, prod_pins_left, prod_blocks_live;
    int prod_stage_rc;
    uint64_t prod_stage_leaked;
} xh_result_t;

/* Single-thread memcpy in 16 MiB copies: GB/s, median of `samples` timings of 4 copies.
 * Hot: the same two 16 MiB buffers every time (they and the 32 MiB L3 of this machine
 * keep much of it in cache). Cold: each copy to and from the next 16 MiB of two 128 MiB
 * regions, as a transfer between two pools much bigger than the cache does. */
double xh_memcpy_gbps(int samples, bool cold);

/* The UCX settings of the tcp references (ucx_perftest and the tcp lean pull), as
 * "NAME=value " pairs: the engine's own tcp settings (agent.c ucx_config). */
#define XH_TCP_REF_ENV                                                                             \
    "UCX_TLS=tcp UCX_ZCOPY_THRESH=inf UCX_TCP_TX_SEG_SIZE=64k UCX_TCP_RX_SEG_SIZE=64k "

/* The seeded data pattern of request r: write (fill) or compare (check) every K/V row of
 * positions [0, n_tokens) of seq. Returns the positions that mismatched. */
uint32_t xh_pattern_apply(pkv_seq_t *seq, const pkv_geometry_t *g, uint64_t seed, uint32_t r,
                          uint32_t n_tokens, bool fill);

const char *xh_fault_name(xh_fault_t f);
/* The outcomes a consumer may see in a case (ok where the data all arrived). */
bool xh_outcome_expected(const xh_case_t *c, int outcome);
/* Does the producer report survive this fault? */
bool xh_producer_reports(xh_fault_t f);
bool xh_consumer_reports(xh_fault_t f);

/* Fill defaults for a small fault-matrix case (8 layers, 2 MiB per request). */
void xh_case_default(xh_case_t *c);
/* Run one case. Returns 0 when the harness itself worked (see r->ok / r->error). */
int xh_run(const xh_case_t *c, xh_result_t *r);

#endif
