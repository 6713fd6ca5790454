/*
 * pagekv bench xfer: the transfer engine between two processes (bench/xfer_harness.c).
 *
 *   throughput   GB/s (1e9 bytes/s) of 64 KiB, 1 MiB and 16 MiB transfers, same host
 *                (UCX picks shared memory) and over tcp (UCX_TLS=tcp on loopback), every
 *                byte verified by the consumer. Two figures per size: 8 reads in flight
 *                (a new read as soon as the oldest ended, 384 MiB of timed reads: aggregate
 *                bytes over their wall time; the figure compared with ucx_perftest, which
 *                keeps 8 sends outstanding) and one read at a time (median of the reads' own
 *                times: latency-bound for small sizes). The first 128 MiB of reads in each
 *                run, through the same window, are a warm-up: excluded, and ended before
 *                the timed reads start.
 *   references   single-thread memcpy of 16 MiB buffers, measured by the consumer right
 *                before its first read and after its last (this VM's speed drifts by tens of
 *                percent within a minute: each run's ratio uses its own memcpy), and
 *                `ucx_perftest -t tag_bw -O 8 -e` over tcp at each size with the same UCX
 *                tcp settings, run right before each of our tcp runs of that size (it
 *                varies by 2x between minutes here: each run's ratio uses its own), and
 *                beside same_host runs the lean pull (support/lean_pull.c: the same two
 *                copies with no engine), unkeyed (Fletcher sums) and keyed (the engine's
 *                per-layer MACs: the integrity bound), run right before each of them
 *   kill detect  kill -9 of a producer mid-transfer to the consumer's peer_lost, both paths
 *   fault matrix (--fault-matrix N) every fault case N times; see the table's columns
 *
 * Output: Markdown on stdout; --json FILE adds results [{path, size, gbps, ...}],
 * integrity [{size_bytes, gbps, bound_gbps, vs_bound, fletcher_gbps, target, met}]
 * (same_host: the engine against the keyed lean pull), memcpy_gbps (median of the runs'
 * references), ucx_perftest_tcp_gbps (1 MiB), kill_detect_ms (slowest path's median) and
 * the details.
 */
#include "support/cli.h"
#include "support/bench.h"
#include "support/launch.h"
#include "support/lean_pull.h"
#include "support/xfer_harness.h"
#include "tools/commands.h"

#include "core/core.h"
#include "pagekv/xfer.h"

#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void progress(const char *fmt, ...)
{
    if (!pkv_cli_progress_enabled()) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "\r\033[K");
    vfprintf(stderr, fmt, ap);
    va_end(ap);
}

static void progress_done(void)
{
    if (pkv_cli_progress_enabled()) fprintf(stderr, "\r\033[K");
}

/* ---- references ------------------------------------------------------------------------ */
/* ucx_perftest tag_bw over tcp on loopback at `size`: GB/s, or -1 when it cannot run. */
static double perftest_gbps(size_t size, int port)
{
    size_t iters = PKV_MIN((size_t)20000, PKV_MAX((size_t)128, ((size_t)2 << 30) / size));
    char cmd[512];
    snprintf(cmd, sizeof(cmd), XH_TCP_REF_ENV "exec ucx_perftest -p %d >/dev/null 2>&1", port);
    char *argv[] = {"/bin/sh", "-c", cmd, NULL};
    launch_spec_t spec = {.name = "ucx_perftest", .argv = argv, .log_path = "/dev/null"};
    launch_proc_t srv;
    char err[256];
    fflush(NULL);
    if (launch_spawn(&srv, &spec, err, sizeof(err)) != 0) return -1;
    double gbps = -1;
    for (int attempt = 0; attempt < 10 && gbps < 0; attempt++) {
        usleep(300000);
        snprintf(cmd, sizeof(cmd),
                 XH_TCP_REF_ENV "ucx_perftest 127.0.0.1 -p %d -t tag_bw -s %zu -n %zu -w %zu -O 8 "
                                "-e -f 2>/dev/null",
                 port, size, iters, iters / 10);
        FILE *f = popen(cmd, "r");
        if (!f) break;
        char line[512];
        while (fgets(line, sizeof(line), f)) {
            double v[8];
            if (sscanf(line, "%lf %lf %lf %lf %lf %lf %lf %lf", &v[0], &v[1], &v[2], &v[3], &v[4],
                       &v[5], &v[6], &v[7]) == 8)
                gbps = v[5] * 1048576.0 / 1e9; /* overall bandwidth, MB/s of 2^20 bytes */
        }
        pclose(f);
    }
    launch_stop(&srv, SIGKILL, pkv_now_ns());
    return gbps;
}

/* ---- our transfers ---------------------------------------------------------------------- */
/* Paths: same host through the shared staging arena (what a same-host pair uses), tcp on
 * loopback (UCX_TLS=tcp), and same host with the payload through UCX shared memory. */
enum { PATH_SAME_HOST, PATH_TCP, PATH_SAME_HOST_UCX, NPATHS };
static const char *const path_names[NPATHS] = {"same_host", "tcp", "same_host_ucx"};

/* Geometry with 64 KiB blocks: 4 layers x 4 heads x 64 dim x 16 tokens, f16. */
static void size_case(xh_case_t *c, size_t bytes, int path)
{
    xh_case_default(c);
    c->geo = (pkv_geometry_t){
        .layers = 4, .kv_heads = 4, .head_dim = 64, .block_tokens = 16, .dtype = PKV_DTYPE_F16};
    c->n_tokens = (uint32_t)(bytes / (64 << 10)) * 16;
    c->chunk_bytes = 0; /* the agent's default */
    c->page_bytes = 64 << 10;
    c->deadline_ms = 30000;
    c->tcp = path == PATH_TCP;
    c->shared = path == PATH_SAME_HOST;
    c->prewarm = true;
}

/* Reads per windowed run, all through the same window (the pools hold every request): a
 * warm-up of 128 MiB and at least three windows of reads, untimed and ended, then 384 MiB
 * timed. The first ~30 ms after the agents sat idle (here: while the consumer measured
 * memcpy) ran at a run's lowest rate; the warm-up takes them, and the timed reads last long
 * enough (~0.1 s at 64 KiB, was ~25 ms) to average what is left. Three windows, because the
 * producer's staging reaches its steady set of pages only once reads follow each other (a
 * new read is staged while the oldest one's pages wait for its ACK, and a transfer that
 * finds the free warm pages in pieces takes some cold ones): with one window of 16 MiB
 * reads every timed phase touched 16 MiB of staging for the first time, with two, one run
 * in three did. A first touch of a 4 KiB page costs ~4-5 us on each side on a
 * shadow-paging VM (docs/design/xfer.md, Known limits): ~20 % of a 16 MiB run's time,
 * where the lean pull's reference reuses the slots its warm-up touched. Where a run's
 * level comes from on this VM (the host's placement of the two vCPUs) is measured by
 * pkv_rtt_probe_ns. */
enum { WINDOW = 8, WARM_WINDOWS = 3 };
#define WARM_BYTES  (128u << 20)
#define TIMED_BYTES (384u << 20)
static bool g_quick; /* --quick: 16 MiB of warm-up and 32 MiB timed (the suite's smoke run) */
static uint32_t warmup_reads(size_t bytes)
{
    uint32_t n = (uint32_t)((g_quick ? 16u << 20 : WARM_BYTES) / bytes);
    return g_quick ? n : PKV_MAX(n, WARM_WINDOWS * WINDOW);
}
static uint32_t timed_reads(size_t bytes)
{
    return (uint32_t)((g_quick ? 32u << 20 : TIMED_BYTES) / bytes);
}
_Static_assert((WARM_BYTES + TIMED_BYTES) / (64u << 10) <= XH_MAX_REQ &&
                   WARM_WINDOWS * WINDOW + TIMED_BYTES / (16u << 20) <= XH_MAX_REQ,
               "the pools hold every request of a 64 KiB and of a 16 MiB run");

typedef struct {
    double batch_gbps;  /* median over runs of (bytes of the timed reads) / (their wall time) */
    double memcpy_gbps; /* median over runs of the memcpy measured around the reads */
    double vs_memcpy;   /* median over runs of batch GB/s / that run's memcpy GB/s */
    double memcpy_cold_gbps, vs_memcpy_cold; /* the same against the out-of-cache memcpy */
    double single_gbps;          /* median over reads of bytes / read time, one at a time */
    double ref_gbps, vs_ref;     /* ucx_perftest (tcp) run right before each run: median of it
                                    and of the runs' own ratios (-1: not run) */
    double lean_gbps, vs_lean;   /* the lean pull (same_host: bench/lean_pull.c through shared
                                    memory; tcp: its UCX tcp twin), the same way */
    double bound_gbps, vs_bound; /* same_host: the keyed lean pull (the same flow MACed and
                                    verified as the engine does), the same way */
    double rtt_ns; /* median over runs of pkv_rtt_probe_ns (each run: the mean of those
                      before its first read and after its last that measured; 0: none) */
    double run_gbps[100], run_rtt_ns[100]; /* each run's batch GB/s and round trip */
    int runs, reads;
    bool ok;
    char why[160];
} tput_t;

static bool run_ok(const xh_result_t *r, uint32_t n, char *why, size_t wl)
{
    if (!r->ok) {
        snprintf(why, wl, "harness: %.120s", r->error[0] ? r->error : "report missing");
        return false;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (r->outcome[i] != PKV_OK || r->mismatched_positions[i]) {
            snprintf(why, wl, "read %u: %s, %u positions differ", i, pkv_status_str(r->outcome[i]),
                     r->mismatched_positions[i]);
            return false;
        }
    }
    return true;
}

static uint32_t g_idle_regs;    /* --idle-registrations */
static bool g_lean_pull = true; /* --no-lean-pull */
/* A throughput run takes seconds; the harness's default bound (deadline x reads + 20 s)
 * would let a hung child stall the bench for hours. */
#define RUN_TIMEOUT_MS 300000

/* The per-run figures measure() takes medians of. */
typedef struct {
    double batch[100], mc[100], ratio[100], mcc[100], ratio_c[100], pt[100], ratio_pt[100], ln[100],
        ratio_ln[100], bd[100], ratio_bd[100];
    int nb, npt, nln, nbd;
} tput_acc_t;

/* The lean pull beside a run of `path` (-1: not run). */
static double lean_pull_ref(const xh_case_t *c, size_t bytes, int path)
{
    size_t piece = (size_t)c->geo.block_tokens * pkv_dtype_row_bytes(c->geo.dtype, c->geo.head_dim);
    if (path == PATH_SAME_HOST && g_lean_pull)
        return xh_lean_pull_gbps(bytes, c->geo.layers, piece, warmup_reads(bytes),
                                 timed_reads(bytes));
    if (path == PATH_TCP && g_lean_pull)
        return xh_lean_pull_tcp_gbps(bytes, c->geo.layers, piece, warmup_reads(bytes),
                                     timed_reads(bytes));
    return -1;
}

/* The keyed lean pull beside a same_host run: the bound of the flow with its MACs (-1: not
 * run). */
static double mac_bound_ref(const xh_case_t *c, size_t bytes, int path)
{
    size_t piece = (size_t)c->geo.block_tokens * pkv_dtype_row_bytes(c->geo.dtype, c->geo.head_dim);
    if (path != PATH_SAME_HOST || !g_lean_pull) return -1;
    return xh_lean_pull_mac_gbps(bytes, c->geo.layers, piece, warmup_reads(bytes),
                                 timed_reads(bytes));
}

/* One 8-in-flight run (its references right before it) into a and t's per-run arrays;
 * false (t->why set) when it failed. */
static bool window_run(size_t bytes, int path, int run, int perftest_port, tput_t *t, tput_acc_t *a)
{
    xh_case_t c;
    xh_result_t r;
    size_case(&c, bytes, path);
    double ref = perftest_port ? perftest_gbps(bytes, perftest_port + run) : -1;
    double lean = lean_pull_ref(&c, bytes, path), bound = mac_bound_ref(&c, bytes, path);
    c.idle_regs = g_idle_regs;
    c.seed = 7 + (uint64_t)run;
    c.timeout_ms = RUN_TIMEOUT_MS;
    c.warmup = warmup_reads(bytes);
    c.window = WINDOW;
    c.memcpy_ref = true;
    c.n_requests = c.warmup + timed_reads(bytes);
    xh_run(&c, &r);
    if (!run_ok(&r, c.n_requests, t->why, sizeof(t->why))) return false;
    uint64_t first = UINT64_MAX, last = 0, total = 0;
    for (uint32_t i = c.warmup; i < c.n_requests; i++) {
        first = PKV_MIN(first, r.done_at_ns[i] - r.elapsed_ns[i]);
        last = PKV_MAX(last, r.done_at_ns[i]);
        total += r.bytes[i];
    }
    int nb = a->nb;
    a->batch[nb] = (double)total / (double)(last - first);
    t->run_gbps[nb] = a->batch[nb];
    int nr = (r.cpu_rtt_ns[0] > 0) + (r.cpu_rtt_ns[1] > 0);
    t->run_rtt_ns[nb] = nr ? (r.cpu_rtt_ns[0] + r.cpu_rtt_ns[1]) / nr : 0; /* 0: not measured */
    a->mc[nb] = (r.memcpy_gbps[0] + r.memcpy_gbps[1]) / 2;
    a->ratio[nb] = a->mc[nb] > 0 ? a->batch[nb] / a->mc[nb] : 0;
    a->mcc[nb] = (r.memcpy_cold_gbps[0] + r.memcpy_cold_gbps[1]) / 2;
    a->ratio_c[nb] = a->mcc[nb] > 0 ? a->batch[nb] / a->mcc[nb] : 0;
    if (ref > 0) {
        a->pt[a->npt] = ref;
        a->ratio_pt[a->npt++] = a->batch[nb] / ref;
    }
    if (lean > 0) {
        a->ln[a->nln] = lean;
        a->ratio_ln[a->nln++] = a->batch[nb] / lean;
    }
    if (bound > 0) {
        a->bd[a->nbd] = bound;
        a->ratio_bd[a->nbd++] = a->batch[nb] / bound;
    }
    a->nb++;
    return true;
}

/* `n` reads one at a time after one warm-up read: each read's GB/s into single[]; the
 * count, or -1 (why set) when the run failed. */
static int single_reads_run(size_t bytes, int path, int n, double *single, char *why, size_t wl)
{
    xh_case_t c;
    xh_result_t r;
    size_case(&c, bytes, path);
    c.seed = 99;
    c.idle_regs = g_idle_regs;
    c.timeout_ms = RUN_TIMEOUT_MS;
    c.warmup = 1;
    c.sequential = true;
    c.n_requests = 1 + (uint32_t)n;
    xh_run(&c, &r);
    if (!run_ok(&r, c.n_requests, why, wl)) return -1;
    int ns = 0;
    for (uint32_t i = c.warmup; i < c.n_requests; i++)
        single[ns++] = (double)r.bytes[i] / (double)r.elapsed_ns[i];
    return ns;
}

static tput_t measure(size_t bytes, int path, int runs, int single_reads, int perftest_port)
{
    tput_t t = {.ok = true,
                .ref_gbps = -1,
                .vs_ref = -1,
                .lean_gbps = -1,
                .vs_lean = -1,
                .bound_gbps = -1,
                .vs_bound = -1};
    tput_acc_t a = {0};
    double single[64];
    int ns = 0;
    for (int run = 0; run < runs && t.ok; run++)
        t.ok = window_run(bytes, path, run, perftest_port, &t, &a);
    if (t.ok) {
        ns = single_reads_run(bytes, path, single_reads, single, t.why, sizeof(t.why));
        t.ok = ns >= 0;
        if (ns < 0) ns = 0;
    }
    size_t nb = (size_t)a.nb;
    t.batch_gbps = pkv_bench_median(a.batch, nb);
    t.rtt_ns = pkv_bench_median(t.run_rtt_ns, nb);
    t.memcpy_gbps = pkv_bench_median(a.mc, nb);
    t.vs_memcpy = pkv_bench_median(a.ratio, nb);
    t.memcpy_cold_gbps = pkv_bench_median(a.mcc, nb);
    t.vs_memcpy_cold = pkv_bench_median(a.ratio_c, nb);
    t.single_gbps = pkv_bench_median(single, (size_t)ns);
    if (a.npt) {
        t.ref_gbps = pkv_bench_median(a.pt, (size_t)a.npt);
        t.vs_ref = pkv_bench_median(a.ratio_pt, (size_t)a.npt);
    }
    if (a.nln) {
        t.lean_gbps = pkv_bench_median(a.ln, (size_t)a.nln);
        t.vs_lean = pkv_bench_median(a.ratio_ln, (size_t)a.nln);
    }
    if (a.nbd) {
        t.bound_gbps = pkv_bench_median(a.bd, (size_t)a.nbd);
        t.vs_bound = pkv_bench_median(a.ratio_bd, (size_t)a.nbd);
    }
    t.runs = a.nb;
    t.reads = ns;
    return t;
}

typedef struct {
    double median_ms, max_ms;
    int runs;
    char outcomes[96];
} kill_t;

static kill_t kill_detect(int path, int runs)
{
    kill_t k = {0};
    double v[64];
    int n = 0, other = 0;
    for (int i = 0; i < runs && i < 64; i++) {
        xh_case_t c;
        xh_result_t r;
        xh_case_default(&c);
        c.fault = XH_PRODUCER_KILLED_DURING;
        c.tcp = path == PATH_TCP;
        c.shared = path == PATH_SAME_HOST;
        c.seed = 300 + (uint64_t)i;
        c.deadline_ms = 10000;
        xh_run(&c, &r);
        if (r.ok && r.outcome[0] == PKV_ERR_PEER_LOST && r.kill_at_ns && r.done_at_ns[0])
            v[n++] = (double)(r.done_at_ns[0] - r.kill_at_ns) / 1e6;
        else
            other++;
    }
    k.runs = n;
    snprintf(k.outcomes, sizeof(k.outcomes), "%d peer_lost%s", n,
             other ? ", some runs did not end peer_lost" : "");
    if (n) {
        k.median_ms = pkv_bench_median(v, (size_t)n);
        for (int i = 0; i < n; i++) k.max_ms = PKV_MAX(k.max_ms, v[i]);
    }
    return k;
}

/* ---- the fault matrix --------------------------------------------------------------------- */
typedef struct {
    int runs;
    int outcomes[9]; /* by pkv_xfer_outcome_index, [8] = none (consumer killed) */
    double worst_ms;
    int violations;
    char first_violation[200];
} fm_row_t;

static void violation(fm_row_t *row, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void violation(fm_row_t *row, const char *fmt, ...)
{
    if (!row->violations++) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(row->first_violation, sizeof(row->first_violation), fmt, ap);
        va_end(ap);
    }
}

static void fault_check(const xh_case_t *c, const xh_result_t *r, fm_row_t *row)
{
    if (!r->ok) return violation(row, "harness: %s", r->error[0] ? r->error : "report missing");
    uint64_t n_ok = 0;
    if (xh_consumer_reports(c->fault)) {
        if (!WIFEXITED(r->cons_wstatus) || WEXITSTATUS(r->cons_wstatus))
            violation(row, "consumer exit status %d", r->cons_wstatus);
        int oc = r->outcome[0], idx = pkv_xfer_outcome_index(oc);
        row->outcomes[idx < 0 ? 8 : idx]++;
        double ms = (double)r->elapsed_ns[0] / 1e6;
        if (ms > row->worst_ms) row->worst_ms = ms;
        if (!xh_outcome_expected(c, oc)) violation(row, "outcome %s", pkv_status_str(oc));
        if (ms > (double)c->deadline_ms + 1000) violation(row, "outcome after %.0f ms", ms);
        if (oc == PKV_OK) {
            n_ok++;
            if (r->mismatched_positions[0])
                violation(row, "%u positions differ", r->mismatched_positions[0]);
        }
        if (r->cons_active_left || r->cons_pins_left || r->cons_staging_left ||
            r->cons_blocks_live || r->cons_stage_rc || r->cons_stage_leaked)
            violation(row, "consumer kept resources (transfers %llu pins %llu pages %llu)",
                      (unsigned long long)r->cons_active_left,
                      (unsigned long long)r->cons_pins_left,
                      (unsigned long long)r->cons_staging_left);
    } else {
        row->outcomes[8]++;
        if (!WIFSIGNALED(r->cons_wstatus)) violation(row, "consumer was not killed");
    }
    if (xh_producer_reports(c->fault)) {
        if (!WIFEXITED(r->prod_wstatus) || WEXITSTATUS(r->prod_wstatus))
            violation(row, "producer exit status %d", r->prod_wstatus);
        if (r->sent != n_ok)
            violation(row, "producer counted %llu sent, consumer stored %llu",
                      (unsigned long long)r->sent, (unsigned long long)n_ok);
        if (r->prod_active_left || r->prod_staging_left || r->prod_blocks_live ||
            r->prod_stage_rc || r->prod_stage_leaked)
            violation(row, "producer kept resources (transfers %llu pages %llu blocks %llu)",
                      (unsigned long long)r->prod_active_left,
                      (unsigned long long)r->prod_staging_left,
                      (unsigned long long)r->prod_blocks_live);
        if (r->written_off)
            violation(row, "%llu UCX operations written off", (unsigned long long)r->written_off);
        if (!xh_consumer_reports(c->fault) && r->serves_failed != r->serves_started)
            violation(row, "a serve to the dead consumer did not end");
        uint64_t per_reg = PKV_DIV_UP(c->n_tokens, c->geo.block_tokens); /* blocks pinned */
        if (r->registrations_left != UINT64_MAX &&
            r->prod_pins_left != r->registrations_left * per_reg)
            violation(row, "producer pins %llu for %llu registrations",
                      (unsigned long long)r->prod_pins_left,
                      (unsigned long long)r->registrations_left);
    } else if (!WIFSIGNALED(r->prod_wstatus)) {
        violation(row, "producer was not killed");
    }
}

static const char *const outcome_names[9] = {"ok",      "timeout",  "peer_lost",
                                             "nofit",   "rejected", "cancelled",
                                             "corrupt", "shutdown", "(killed)"};

static void outcomes_str(const fm_row_t *row, char *buf, size_t len)
{
    buf[0] = '\0';
    for (int i = 0; i < 9; i++) {
        if (!row->outcomes[i]) continue;
        size_t l = strlen(buf);
        snprintf(buf + l, len - l, "%s%s x%d", l ? ", " : "", outcome_names[i], row->outcomes[i]);
    }
}

/* The JSON's ucx_perftest figure: -1 where it did not run. */
static double perftest_or(const tput_t *t)
{
    return t->ref_gbps > 0 ? t->ref_gbps : -1;
}

/* ---- main ------------------------------------------------------------------------------------ */
static int usage(void)
{
    fprintf(stderr,
            "usage: pagekv bench xfer [--runs N] [--kill-runs N] [--fault-matrix N]\n"
            "                         [--no-perftest] [--no-lean-pull] [--no-throughput]\n"
            "                         [--path P] [--size S]\n"
            "                         [--idle-registrations N] [--quick] [--json FILE]\n"
            "  --runs N          8-in-flight runs per size and path (default 3)\n"
            "  --kill-runs N     kill -9 runs per path for the detection time (default 5)\n"
            "  --fault-matrix N  run every fault case N times (default 0: skip)\n"
            "  --path P          only same_host, tcp or same_host_ucx (default: all three)\n"
            "  --size S          only 64k, 1m or 16m transfers (default: all three)\n"
            "  --no-perftest     skip the ucx_perftest reference beside tcp runs\n"
            "  --no-lean-pull    skip the lean-pull references beside same_host and tcp runs\n"
            "  --no-throughput   skip the transfers (and the references paired with them)\n"
            "  --idle-registrations N  the producer also holds N registered requests that\n"
            "                    nobody reads, during the throughput runs (default 0)\n"
            "  --quick           16 MiB of warm-up and 32 MiB timed per run (a smoke run:\n"
            "                    its figures are not for the results page)\n");
    return 2;
}

typedef struct {
    uint64_t runs, kill_runs, fm_runs;
    const char *json_path;
    bool perftest, throughput;
    int only;      /* --path; -1: all */
    int only_size; /* --size; -1: all */
} opts_t;

static const size_t sizes[] = {64 << 10, 1 << 20, 16 << 20};
static const char *const size_names[] = {"64 KiB", "1 MiB", "16 MiB"};
enum { NS = 3 };

/* An option with a value (argv[*i], value argv[*i + 1]); 0, -1 when `a` is not one of
 * them, or the usage error's exit code. */
static int parse_valued(int argc, char **argv, int *i, opts_t *o)
{
    const char *a = argv[*i];
    if (*i + 1 >= argc) return -1;
    const char *v = argv[++*i];
    if (!strcmp(a, "--runs")) {
        if (pkv_cli_parse_u64(v, 1, 100, &o->runs))
            return pkv_cli_usage_error("bench xfer", "--runs: 1..100, got '%s'", v);
    } else if (!strcmp(a, "--kill-runs")) {
        if (pkv_cli_parse_u64(v, 0, 64, &o->kill_runs))
            return pkv_cli_usage_error("bench xfer", "--kill-runs: 0..64, got '%s'", v);
    } else if (!strcmp(a, "--fault-matrix")) {
        if (pkv_cli_parse_u64(v, 0, 10000, &o->fm_runs))
            return pkv_cli_usage_error("bench xfer", "--fault-matrix: 0..10000, got '%s'", v);
    } else if (!strcmp(a, "--idle-registrations")) {
        uint64_t n;
        if (pkv_cli_parse_u64(v, 0, 1000000, &n))
            return pkv_cli_usage_error("bench xfer", "--idle-registrations: 0..1000000, got '%s'",
                                       v);
        g_idle_regs = (uint32_t)n;
    } else if (!strcmp(a, "--json")) {
        o->json_path = v;
    } else if (!strcmp(a, "--size")) {
        static const char *const names[] = {"64k", "1m", "16m"};
        for (int k = 0; k < 3; k++)
            if (!strcmp(v, names[k])) o->only_size = k;
        if (o->only_size < 0)
            return pkv_cli_usage_error("bench xfer", "--size: 64k, 1m or 16m, got '%s'", v);
    } else if (!strcmp(a, "--path")) {
        for (int p = 0; p < NPATHS; p++)
            if (!strcmp(v, path_names[p])) o->only = p;
        if (o->only < 0)
            return pkv_cli_usage_error("bench xfer",
                                       "--path: same_host, tcp or same_host_ucx, got '%s'", v);
    } else {
        --*i;
        return -1;
    }
    return 0;
}

/* -1: parsed, run; otherwise the exit code. */
static int parse_opts(int argc, char **argv, opts_t *o)
{
    *o = (opts_t){.runs = 3,
                  .kill_runs = 5,
                  .perftest = true,
                  .throughput = true,
                  .only = -1,
                  .only_size = -1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return usage(), 0;
        if (!strcmp(a, "--no-perftest")) {
            o->perftest = false;
        } else if (!strcmp(a, "--no-lean-pull")) {
            g_lean_pull = false;
        } else if (!strcmp(a, "--no-throughput")) {
            o->throughput = false;
        } else if (!strcmp(a, "--quick")) {
            g_quick = true;
        } else {
            int rc = parse_valued(argc, argv, &i, o);
            if (rc > 0) return rc;
            if (rc < 0) return pkv_cli_usage_error("bench xfer", "unknown option '%s'", a);
        }
    }
    return -1;
}

/* The transfers of every selected (path, size), with the memcpy figures into root. */
static void run_throughput(opts_t *o, tput_t tp[NPATHS][NS], double mc, json_t *root)
{
    /* ucx_perftest runs right before each of our tcp runs, at the same size. */
    if (o->only >= 0 && o->only != PATH_TCP) o->perftest = false;
    double run_mc[3 * NS];
    int n_run_mc = 0;
    for (int path = 0; path < NPATHS; path++)
        for (int s = 0; s < NS && (o->only < 0 || path == o->only); s++) {
            if (o->only_size >= 0 && s != o->only_size) continue;
            if (!o->throughput) continue;
            progress("transfers %s %s ...", path_names[path], size_names[s]);
            int port =
                path == PATH_TCP && o->perftest ? 10000 + (int)(getpid() % 70) * 300 + s * 100 : 0;
            tp[path][s] = measure(sizes[s], path, (int)o->runs, 8, port);
            if (tp[path][s].ok) run_mc[n_run_mc++] = tp[path][s].memcpy_gbps;
        }
    /* The reference beside the transfers: median of the memcpy figures taken around them. */
    json_object_set_new(root, "memcpy_gbps",
                        json_real(n_run_mc ? pkv_bench_median(run_mc, (size_t)n_run_mc) : mc));
    json_object_set_new(root, "memcpy_gbps_at_start", json_real(mc));
}

/* One throughput row's JSON. */
static json_t *tput_json(int path, int s, const tput_t *t)
{
    json_t *o = json_object();
    json_object_set_new(o, "path", json_string(path_names[path]));
    json_object_set_new(o, "size", json_integer((json_int_t)sizes[s]));
    json_object_set_new(o, "gbps", json_real(t->batch_gbps));
    json_object_set_new(o, "gbps_one_at_a_time", json_real(t->single_gbps));
    json_object_set_new(o, "memcpy_gbps", json_real(t->memcpy_gbps));
    json_object_set_new(o, "vs_memcpy", json_real(t->vs_memcpy));
    json_object_set_new(o, "memcpy_cold_gbps", json_real(t->memcpy_cold_gbps));
    json_object_set_new(o, "vs_memcpy_cold", json_real(t->vs_memcpy_cold));
    if (t->ref_gbps > 0) {
        json_object_set_new(o, "ucx_perftest_gbps", json_real(t->ref_gbps));
        json_object_set_new(o, "vs_ucx_perftest", json_real(t->vs_ref));
    }
    if (t->lean_gbps > 0) {
        json_object_set_new(o, "lean_pull_gbps", json_real(t->lean_gbps));
        json_object_set_new(o, "vs_lean_pull", json_real(t->vs_lean));
    }
    json_object_set_new(o, "cpu_round_trip_ns", json_real(t->rtt_ns));
    json_t *per_run = json_array();
    for (int k = 0; k < t->runs; k++) {
        json_t *pr = json_object();
        json_object_set_new(pr, "gbps", json_real(t->run_gbps[k]));
        json_object_set_new(pr, "cpu_round_trip_ns", json_real(t->run_rtt_ns[k]));
        json_array_append_new(per_run, pr);
    }
    json_object_set_new(o, "per_run", per_run);
    json_object_set_new(o, "batches", json_integer(t->runs));
    json_object_set_new(o, "single_reads", json_integer(t->reads));
    return o;
}

static void print_tput_row(int path, int s, const tput_t *t)
{
    if (!t->ok) {
        printf("| %s | %s | failed: %s | | | | | | | | |\n", path_names[path], size_names[s],
               t->why);
        return;
    }
    char ref[32] = "", vs[32] = "", lean[32] = "", vsl[32] = "";
    if (t->ref_gbps > 0) {
        snprintf(ref, sizeof(ref), "%.2f", t->ref_gbps);
        snprintf(vs, sizeof(vs), "%.2fx", t->vs_ref);
    }
    if (t->lean_gbps > 0) {
        snprintf(lean, sizeof(lean), "%.2f", t->lean_gbps);
        snprintf(vsl, sizeof(vsl), "%.2fx", t->vs_lean);
    }
    printf("| %s | %s | %.2f | %.2f | %.2f / %.2f | %.2fx / %.2fx | %s | %s | %s | %s "
           "| %.0f |\n",
           path_names[path], size_names[s], t->batch_gbps, t->single_gbps, t->memcpy_gbps,
           t->memcpy_cold_gbps, t->vs_memcpy, t->vs_memcpy_cold, ref, vs, lean, vsl, t->rtt_ns);
}

static void print_tput_notes(const opts_t *o)
{
    printf("\nsame_host: payload through the producer's shared staging arena (memfd mapped "
           "by the consumer); same_host_ucx: payload through UCX (shared memory + tcp lanes, "
           "zero-copy off: UCX 1.13's tcp zero-copy can abort on a failed send); tcp: UCX_TLS=tcp "
           "on loopback. 8 in flight: "
           "median over %llu runs of bytes / wall time of %u (64 KiB), %u (1 MiB) or %u "
           "(16 MiB) reads, a new read as soon as the oldest ended, after a warm-up of "
           "%u, %u or %u reads through the same window; one at a time: "
           "median of 8 reads. References, run right before each run (the median of those "
           "runs and the median of the runs' own ratios): for tcp ucx_perftest (tag_bw, 8 "
           "outstanding, the same UCX tcp settings); the lean pull, what this flow can "
           "reach on this machine with no engine around it: for same_host the two copies "
           "of a shared-arena read, 8 in flight, handed over through rings in shared memory "
           "with busy polling; for tcp the same over UCX with ucx_perftest's settings (READ "
           "active message, the two copies, the stream and its checksum trailer in 60 KiB "
           "tag messages, ACK; busy polling). CPU round trip: one cache line between the "
           "first two CPUs, measured in the consumer before its first read and after its "
           "last (the mean of the two, median over runs; 0: not measured): on a VM it shows "
           "how far apart the host placed the vCPUs during the run. Targets: same host "
           ">= 0.6 x memcpy, tcp >= 0.8 x ucx_perftest.\n\n",
           (unsigned long long)o->runs, timed_reads(sizes[0]), timed_reads(sizes[1]),
           timed_reads(sizes[2]), warmup_reads(sizes[0]), warmup_reads(sizes[1]),
           warmup_reads(sizes[2]));
    if (g_idle_regs)
        printf("The producer also held %u registered requests that nobody read.\n\n", g_idle_regs);
}

/* The throughput table and its JSON (results, same_host_ucx, perftest figures). */
static void report_throughput(const opts_t *o, tput_t tp[NPATHS][NS], json_t *root)
{
    json_t *results = json_array();
    if (o->throughput) {
        json_t *ucx_shm = json_array();
        printf(
            "| path | size | 8 in flight GB/s | one at a time GB/s | memcpy hot / cold GB/s | "
            "vs memcpy hot / cold | ucx_perftest GB/s | vs ucx_perftest | lean pull GB/s | "
            "vs lean pull | CPU round trip ns |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
        for (int path = 0; path < NPATHS; path++)
            for (int s = 0; s < NS && (o->only < 0 || path == o->only); s++) {
                if (o->only_size >= 0 && s != o->only_size) continue;
                print_tput_row(path, s, &tp[path][s]);
                if (!tp[path][s].ok) continue;
                json_array_append_new(path == PATH_SAME_HOST_UCX ? ucx_shm : results,
                                      tput_json(path, s, &tp[path][s]));
            }
        json_object_set_new(root, "same_host_ucx", ucx_shm);
        print_tput_notes(o);
    }
    json_object_set_new(root, "idle_registrations", json_integer(g_idle_regs));
    json_object_set_new(root, "results", results);
    json_object_set_new(root, "ucx_perftest_tcp_gbps", json_real(perftest_or(&tp[PATH_TCP][1])));
    json_t *ptj = json_object();
    for (int s = 0; s < NS; s++)
        json_object_set_new(ptj, size_names[s], json_real(perftest_or(&tp[PATH_TCP][s])));
    json_object_set_new(root, "ucx_perftest_tcp_gbps_by_size", ptj);
}

/* The integrity table: the same_host engine (every layer MACed) against the keyed lean
 * pull, with the unkeyed lean pull (v3's Fletcher sums) beside it; JSON `integrity`. */
static void report_integrity(const opts_t *o, tput_t tp[NPATHS][NS], json_t *root)
{
    json_t *list = json_array();
    bool any = false;
    for (int s = 0; s < NS && o->throughput; s++) {
        const tput_t *t = &tp[PATH_SAME_HOST][s];
        if ((o->only >= 0 && o->only != PATH_SAME_HOST) || (o->only_size >= 0 && s != o->only_size))
            continue;
        if (!t->ok || t->bound_gbps <= 0) continue;
        if (!any)
            printf("Integrity, same_host: the engine (wire v5: every layer's Poly1305 MAC made in "
                   "the producer's copy, verified in the consumer's) against the bound of that "
                   "flow, the keyed lean pull (the same two copies with the engine's keys, MAC "
                   "and copy loops, nothing else), and the unkeyed lean pull (Fletcher sums, as "
                   "wire v3 checked the payload) beside them.\n\n"
                   "| size | engine GB/s | bound (keyed lean pull) GB/s | engine vs bound | "
                   "lean pull, Fletcher GB/s | bound vs Fletcher | target | met |\n"
                   "|---|---|---|---|---|---|---|---|\n");
        any = true;
        char fl[32] = "", vf[32] = "";
        if (t->lean_gbps > 0) {
            snprintf(fl, sizeof(fl), "%.2f", t->lean_gbps);
            snprintf(vf, sizeof(vf), "%.2fx", t->bound_gbps / t->lean_gbps);
        }
        bool met = t->vs_bound >= 0.85;
        printf("| %s | %.2f | %.2f | %.2fx | %s | %s | >= 0.85x bound | %s |\n", size_names[s],
               t->batch_gbps, t->bound_gbps, t->vs_bound, fl, vf, met ? "yes" : "no");
        json_t *j = json_object();
        json_object_set_new(j, "size_bytes", json_integer((json_int_t)sizes[s]));
        json_object_set_new(j, "gbps", json_real(t->batch_gbps));
        json_object_set_new(j, "bound_gbps", json_real(t->bound_gbps));
        json_object_set_new(j, "vs_bound", json_real(t->vs_bound));
        if (t->lean_gbps > 0) json_object_set_new(j, "fletcher_gbps", json_real(t->lean_gbps));
        json_object_set_new(j, "target", json_real(0.85));
        json_object_set_new(j, "met", json_boolean(met));
        json_array_append_new(list, j);
    }
    if (any)
        printf("\nMedians over the runs; engine vs bound is the median of each run's own ratio "
               "(the keyed lean pull runs right before each run). Target: engine >= 0.85x "
               "bound.\n\n");
    json_object_set_new(root, "integrity", list);
}

static void report_kill(const opts_t *o, const kill_t kd[NPATHS], json_t *root)
{
    printf("| kill -9 of the producer mid-transfer | runs | median ms | max ms |\n"
           "|---|---|---|---|\n");
    double worst_median = 0, worst = 0;
    for (int path = 0; path < NPATHS; path++) {
        if (o->only >= 0 && path != o->only) continue;
        printf("| %s | %s | %.0f | %.0f |\n", path_names[path], kd[path].outcomes,
               kd[path].median_ms, kd[path].max_ms);
        worst_median = PKV_MAX(worst_median, kd[path].median_ms);
        worst = PKV_MAX(worst, kd[path].max_ms);
    }
    printf("\nTarget: detected <= 1500 ms.\n\n");
    /* the slowest path's median: the figure the target is about */
    json_object_set_new(root, "kill_detect_ms", json_real(worst_median));
    json_object_set_new(root, "kill_detect_ms_max", json_real(worst));
    if (o->only < 0 || o->only == PATH_TCP)
        json_object_set_new(root, "kill_detect_ms_tcp", json_real(kd[PATH_TCP].median_ms));
}

/* One fault-matrix row: fm_runs runs of case fi, printed; returns its JSON. */
static json_t *fault_row(const opts_t *o, int fi, int *violations)
{
    int f = XH_PRODUCER_KILLED_BEFORE + fi / 2;
    fm_row_t row;
    memset(&row, 0, sizeof(row));
    xh_case_t c;
    xh_case_default(&c);
    c.fault = (xh_fault_t)f;
    c.shared = fi % 2;
    for (uint64_t k = 0; k < o->fm_runs; k++) {
        progress("fault matrix: %s %llu/%llu", xh_fault_name(c.fault), (unsigned long long)k + 1,
                 (unsigned long long)o->fm_runs);
        xh_result_t r;
        c.seed = 1000 + k;
        c.n_tokens = k % 2 ? 64 : 512; /* 256 KiB: copied on the progress threads */
        xh_run(&c, &r);
        row.runs++;
        fault_check(&c, &r, &row);
    }
    progress_done();
    char oc[256];
    outcomes_str(&row, oc, sizeof(oc));
    printf("| %s | %s | %d | %s | %.0f | %llu | %d%s%s |\n", xh_fault_name(c.fault),
           c.shared ? "shared arena" : "UCX", row.runs, oc, row.worst_ms,
           (unsigned long long)c.deadline_ms, row.violations, row.violations ? ": " : "",
           row.first_violation);
    fflush(stdout);
    *violations = row.violations;
    json_t *j = json_object();
    json_object_set_new(j, "case", json_string(xh_fault_name(c.fault)));
    json_object_set_new(j, "payload", json_string(c.shared ? "shared_arena" : "ucx"));
    json_object_set_new(j, "runs", json_integer(row.runs));
    json_object_set_new(j, "outcomes", json_string(oc));
    json_object_set_new(j, "worst_ms", json_real(row.worst_ms));
    json_object_set_new(j, "deadline_ms", json_integer((json_int_t)c.deadline_ms));
    json_object_set_new(j, "violations", json_integer(row.violations));
    return j;
}

/* --fault-matrix N: every case N times; returns the violations. */
static int run_fault_matrix(const opts_t *o, json_t *root)
{
    int failures = 0;
    json_t *fm = json_array();
    printf("## Fault matrix (%llu runs per case, same host)\n\n"
           "| case | payload | runs | outcomes seen | worst ms | deadline ms | violations "
           "|\n|---|---|---|---|---|---|---|\n",
           (unsigned long long)o->fm_runs);
    for (int fi = 0; fi < 2 * (XH_NFAULTS - 1); fi++) {
        int v = 0;
        json_array_append_new(fm, fault_row(o, fi, &v));
        failures += v;
    }
    printf("\nRuns alternate 2 MiB transfers (copied by the copy workers) and 256 KiB ones "
           "(copied on the progress threads). "
           "worst ms: read() call to the consumer's outcome (consumer-killed rows: none). "
           "A violation is an outcome outside the expected set, later than deadline + 1 s, "
           "a request counted sent without a stored copy, a staging page, pin or transfer "
           "not returned, or a process that crashed.\n");
    json_object_set_new(root, "fault_matrix", fm);
    return failures;
}

int pkv_bench_xfer(int argc, char **argv)
{
    opts_t o;
    int prc = parse_opts(argc, argv, &o);
    if (prc >= 0) return prc;
    if (!getenv("PKV_LOG")) pkv_log_set_level(PKV_LOG_ERROR); /* PKV_LOG=debug: per-read phases */
    json_t *root = json_object();

    progress("memcpy reference ...");
    double mc = xh_memcpy_gbps(9, false);
    static tput_t tp[NPATHS][NS];
    memset(tp, 0, sizeof(tp));
    run_throughput(&o, tp, mc, root);
    kill_t kd[NPATHS];
    memset(kd, 0, sizeof(kd));
    for (int path = 0; path < NPATHS && o.kill_runs; path++) {
        if (o.only >= 0 && path != o.only) continue;
        progress("kill -9 detection %s ...", path_names[path]);
        kd[path] = kill_detect(path, (int)o.kill_runs);
    }
    progress_done();

    printf("# pagekv bench xfer\n\n");
    printf("Two processes on this host, every byte verified by the consumer. GB/s = 1e9 "
           "bytes/s.\n\n");
    printf("memcpy (single thread, 16 MiB copies) at the start: %.2f GB/s. Each run measures "
           "it again in the consumer right before its first read and after its last, hot (the "
           "same two 16 MiB buffers) and cold (through two 128 MiB regions, as between pools); the "
           "columns give the median over runs and the median of the runs' own ratios.\n\n",
           mc);
    report_throughput(&o, tp, root);
    report_integrity(&o, tp, root);
    if (o.kill_runs) report_kill(&o, kd, root);
    int failures = o.fm_runs ? run_fault_matrix(&o, root) : 0;
    if (o.json_path && json_dump_file(root, o.json_path, JSON_INDENT(2))) {
        fprintf(stderr, "pagekv bench xfer: cannot write %s\n", o.json_path);
        json_decref(root);
        return 1;
    }
    json_decref(root);
    return failures ? 1 : 0;
}
