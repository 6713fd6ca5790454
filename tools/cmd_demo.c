/*
 * pagekv demo: disaggregated prefill -> decode on the built-in model, through the transfer
 * engine (docs/design/disagg.md), built from the disagg module's nodes.
 *
 * This process forks a prefill process and plays decode itself; neither has touched UCX
 * or started a thread before the fork. Prefill computes the prompt's KV and the first
 * token on its node, registers the prompt's blocks and sends the handle through a pipe.
 * Decode pulls the blocks into its own pool, continues the sequence from them and
 * generates greedily. To show that nothing was lost or bent on the way, decode also runs
 * the same prompt itself in a second pool (the unified run) and compares the transferred
 * KV byte for byte, the first token and every generated token. After the read, prefill
 * reports its accounting (registration ended sent, pins and staging returned) back
 * through the pipe. The process-wide parts (fork, pipes, SIGPIPE, UCX_TLS) and the report
 * are here; the flow is the library's.
 *
 * Exit: 0 the run completed and every check held; 1 a check failed (a prefill process
 * that died during the read shows as the read's outcome); 2 it could not run (bad options,
 * a setup failure, no handle from prefill), with a message on stderr.
 */
#include "support/cli.h"
#include "support/xfer_harness.h"

#include "core/core.h"
#include "disagg/disagg.h"
#include "prim/prim.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define DEMO_REQUEST_ID 1
#define DEMO_LEASE_NS   30000000000ull  /* the registration's expiry after prefill */
#define DEMO_PREFILL_NS 120000000000ull /* how long decode waits for prefill's handle */
#define DEMO_REPORT_NS  10000000000ull  /* ... and for its report after the read */
#define DEMO_HANDLE_MAX (1u << 20)
#define DEMO_TEXT_SHOWN 240

static const char demo_default_prompt[] =
    "A paged KV cache keeps each request's keys and values in fixed-size blocks, so a "
    "server can move them between a prefill node and a decode node without copying the "
    "whole pool. The decode node pulls the blocks, verifies every layer, and goes on "
    "generating as if it had computed the prompt itself.";

typedef struct {
    const char *preset;    /* NULL -> PKV_DISAGG_DEFAULT_PRESET */
    const char *prompt;    /* NULL -> demo_default_prompt */
    uint32_t max_tokens;   /* tokens generated after the prompt; 0 -> 32 */
    uint64_t weights_seed; /* 0 -> 1 */
    pkv_dtype_t dtype;     /* KV element type (both pools) */
    bool tcp;              /* UCX_TLS=tcp in both processes */
    bool no_shared;        /* payload through UCX even on one host */
    uint64_t deadline_ms;  /* the transfer's deadline; 0 -> 10000 */
} demo_opts_t;

/* What prefill reports after decode's read. */
typedef struct {
    int32_t end; /* how the registration ended; PKV_DISAGG_LEASE_OPEN = still registered */
    uint64_t sent, bytes_sent, pinned, staging_held, rss;
} demo_report_t;

typedef struct {
    int outcome;      /* the read's typed outcome */
    const char *path; /* how the payload moved */
    uint32_t prompt_tokens, blocks, generated;
    uint64_t kv_bytes, prefill_ns, transfer_ns;
    bool kv_identical, first_identical, tokens_identical, shared_arena;
    bool producer_reported, producer_exit_ok;
    demo_report_t producer; /* end: PKV_OK = sent (acknowledged) */
    uint64_t consumer_pinned, consumer_staging_held, consumer_bytes_received;
    uint64_t consumer_pool_committed, consumer_rss;
} demo_result_t;

/* What prefill sends: this header, then handle_len bytes of the encoded handle. */
typedef struct {
    int32_t status; /* PKV_OK, or why prefill could not register */
    int32_t first;  /* the first generated token (from the prompt's last logits) */
    uint64_t prefill_ns;
    uint32_t handle_len;
    uint32_t pid;
} demo_hello_t;

static pkv_disagg_node_config_t demo_node_config(const demo_opts_t *o, int32_t vocab, uint32_t n,
                                                 bool prefill)
{
    return (pkv_disagg_node_config_t){.preset = o->preset,
                                      .weights_seed = o->weights_seed,
                                      .vocab = vocab,
                                      .dtype = o->dtype,
                                      .stage_tokens = n,
                                      .shared_stage = prefill,
                                      .stage_name =
                                          prefill ? "pkv-demo-prefill" : "pkv-demo-decode",
                                      .no_shared = !prefill && (o->no_shared || o->tcp)};
}

static uint64_t demo_rss(void)
{
    pkv_prim_mem_t mem = {0};
    pkv_prim_mem_read(0, &mem);
    return mem.rss_bytes;
}

/* ---- prefill (the child) ------------------------------------------------------------- */
/* After decode's read: end the registration and report the accounting. */
static void demo_prefill_report(pkv_disagg_node_t *node, pkv_disagg_lease_t *l, char go, int wfd)
{
    demo_report_t rep;
    memset(&rep, 0, sizeof(rep)); /* padding too: it goes through the pipe */
    /* An acknowledged read's ACK may still be on its way; a failed one never comes. */
    rep.end = pkv_disagg_lease_end(l, pkv_now_ns() + (go ? 2000000000ull : 0));
    pkv_xfer_agent_t *agent = pkv_disagg_node_agent(node);
    pkv_xfer_wait_idle(agent, pkv_now_ns() + 2000000000ull);
    pkv_xfer_stats_t xs;
    pkv_xfer_stats(agent, &xs);
    rep.sent = xs.sent;
    rep.bytes_sent = xs.bytes_sent;
    rep.pinned = xs.pinned_blocks;
    rep.staging_held = xs.staging_pages_held;
    rep.rss = demo_rss();
    (void)xh_write_all(wfd, &rep, sizeof(rep));
}

/* The prefill process: never returns. */
static void demo_prefill(const demo_opts_t *o, const int32_t *ids, uint32_t n, int32_t vocab,
                         int wfd, int rfd)
{
    demo_hello_t hello = {.status = PKV_OK, .pid = (uint32_t)getpid()};
    pkv_disagg_node_t *node = NULL;
    pkv_disagg_lease_t *l = NULL;
    uint8_t *hb = NULL;
    size_t len = 0;
    pkv_disagg_node_config_t nc = demo_node_config(o, vocab, n, true);
    int rc = pkv_disagg_node_create(&nc, &node);
    if (!rc) rc = pkv_disagg_prefill(node, DEMO_REQUEST_ID, ids, n, DEMO_LEASE_NS, &l);
    if (!rc) {
        const pkv_xfer_handle_t *h = pkv_disagg_lease_handle(l);
        hello.first = pkv_disagg_lease_first(l);
        hello.prefill_ns = pkv_disagg_lease_prefill_ns(l);
        hello.handle_len = (uint32_t)pkv_xfer_handle_bytes(h);
        hb = malloc(hello.handle_len ? hello.handle_len : 1);
        rc = hb ? pkv_xfer_handle_encode(h, hb, hello.handle_len, &len) : PKV_ERR_NOMEM;
    }
    hello.status = rc;
    hello.handle_len = rc ? 0 : (uint32_t)len;
    if (xh_write_all(wfd, &hello, sizeof(hello)) || xh_write_all(wfd, hb, hello.handle_len))
        _exit(3);
    /* Decode says when its read has ended (or closes the pipe by dying). */
    char go;
    if (!rc && xh_read_all(rfd, &go, 1, pkv_now_ns() + DEMO_PREFILL_NS + DEMO_REPORT_NS) == PKV_OK)
        demo_prefill_report(node, l, go, wfd);
    free(hb);
    pkv_disagg_lease_free(l);
    pkv_disagg_node_destroy(node);
    _exit(rc ? 3 : 0);
}

/* ---- decode (this process) ----------------------------------------------------------- */
typedef struct {
    const demo_opts_t *o;
    const pkv_tok_t *tok;
    const int32_t *ids;
    uint32_t n, max;
    int32_t vocab;
    pid_t pid;
    int rfd, wfd; /* from / to prefill */
    demo_hello_t hello;
    pkv_xfer_handle_t *h;
    pkv_disagg_node_t *node;
    pkv_kv_t *ref_kv;
    pkv_seq_t *seq, *ref;
    float *logits;
    int32_t *gen, *ref_gen;
    bool go_sent, reaped;
} demo_decode_t;

static void demo_decode_free(demo_decode_t *d)
{
    if (d->seq) pkv_seq_free(d->seq);
    if (d->ref) pkv_seq_free(d->ref);
    if (d->ref_kv) pkv_kv_destroy(d->ref_kv);
    pkv_disagg_node_destroy(d->node);
    pkv_xfer_handle_free(d->h);
    free(d->logits);
    free(d->gen);
    free(d->ref_gen);
}

/* Prefill's hello and handle: 0, or -1 with a message. */
static int demo_handle(demo_decode_t *d)
{
    if (xh_read_all(d->rfd, &d->hello, sizeof(d->hello), pkv_now_ns() + DEMO_PREFILL_NS) ||
        d->hello.handle_len > DEMO_HANDLE_MAX) {
        fprintf(stderr, "pagekv demo: no handle from the prefill process\n");
        return -1;
    }
    if (d->hello.status) {
        fprintf(stderr, "pagekv demo: prefill failed: %s\n", pkv_status_str(d->hello.status));
        return -1;
    }
    uint8_t *hb = malloc(d->hello.handle_len ? d->hello.handle_len : 1);
    int rc = !hb || xh_read_all(d->rfd, hb, d->hello.handle_len, pkv_now_ns() + DEMO_REPORT_NS) ||
             pkv_xfer_handle_decode(hb, d->hello.handle_len, &d->h);
    free(hb);
    if (rc) {
        fprintf(stderr, "pagekv demo: the prefill process sent no valid handle\n");
        return -1;
    }
    return 0;
}

/* The decode node and its sequence, the unified run's pool, the scratch. */
static int demo_decode_setup(demo_decode_t *d)
{
    d->logits = malloc(sizeof(float) * (size_t)d->vocab);
    d->gen = malloc(sizeof(int32_t) * d->max);
    d->ref_gen = malloc(sizeof(int32_t) * d->max);
    int rc = d->logits && d->gen && d->ref_gen ? PKV_OK : PKV_ERR_NOMEM;
    pkv_disagg_node_config_t nc = demo_node_config(d->o, d->vocab, d->n, false);
    if (!rc) rc = pkv_disagg_node_create(&nc, &d->node);
    if (!rc) rc = pkv_disagg_pool_create(d->node, &d->ref_kv);
    if (!rc) rc = pkv_disagg_seq_create(pkv_disagg_node_kv(d->node), d->ids, d->n, d->max, &d->seq);
    return rc;
}

/* The pull, then tell prefill the read ended. 0, or -1 with a message. */
static int demo_pull(demo_decode_t *d, demo_result_t *r)
{
    const demo_opts_t *o = d->o;
    uint64_t deadline = pkv_now_ns() + (o->deadline_ms ? o->deadline_ms : 10000) * 1000000ull;
    pkv_disagg_pull_t p = {0};
    int rc = pkv_disagg_pull(d->node, d->h, d->seq, d->ids, d->n, deadline, &p);
    if (rc) {
        fprintf(stderr, "pagekv demo: %s: %s\n", p.bytes ? "generation" : "decode setup",
                pkv_status_str(rc));
        return -1;
    }
    r->outcome = p.outcome;
    r->transfer_ns = p.transfer_ns;
    r->kv_bytes = p.bytes;
    r->shared_arena = p.shared_arena;
    r->path = r->shared_arena ? "same host, shared memfd staging arena"
              : o->tcp        ? "tcp (UCX_TLS=tcp), staging copied on both sides"
              : r->outcome == PKV_OK || o->no_shared
                  ? "same host through UCX, staging copied on both sides"
                  : "same host (shared arena offered)";
    char go = r->outcome == PKV_OK;
    d->go_sent = xh_write_all(d->wfd, &go, 1) == PKV_OK;
    return 0;
}

/* The unified run in a pool of its own, and the comparisons. 0, or -1 with a message. */
static int demo_unified(demo_decode_t *d, demo_result_t *r)
{
    pkv_model_t *m = pkv_disagg_node_model(d->node);
    pkv_kv_t *kv = pkv_disagg_node_kv(d->node);
    int32_t ref_first = -1;
    int rc = pkv_disagg_seq_create(d->ref_kv, d->ids, d->n, d->max, &d->ref);
    if (!rc) rc = pkv_disagg_forward(m, d->ref_kv, d->ref, d->ids, d->n, d->logits, &ref_first);
    if (rc) {
        fprintf(stderr, "pagekv demo: unified run: %s\n", pkv_status_str(rc));
        return -1;
    }
    if (r->outcome != PKV_OK) return 0;
    r->kv_identical = pkv_disagg_kv_equal(kv, d->seq, d->ref_kv, d->ref, d->n);
    r->first_identical = d->hello.first == ref_first;
    /* Decode goes on from the transferred KV (the pull marked positions [0, n) written). */
    int ng = pkv_disagg_generate(m, kv, d->seq, d->tok, d->hello.first, d->max, d->logits, d->gen);
    int nrg = ng < 0 ? 0
                     : pkv_disagg_generate(m, d->ref_kv, d->ref, d->tok, ref_first, d->max,
                                           d->logits, d->ref_gen);
    if (ng < 0 || nrg < 0) {
        fprintf(stderr, "pagekv demo: generation: %s\n", pkv_status_str(ng < 0 ? ng : nrg));
        return -1;
    }
    r->generated = (uint32_t)ng;
    r->tokens_identical = ng == nrg && !memcmp(d->gen, d->ref_gen, sizeof(int32_t) * (size_t)ng);
    return 0;
}

/* Prefill's report and exit, then decode's own accounting. */
static void demo_accounting(demo_decode_t *d, demo_result_t *r)
{
    demo_report_t rep;
    if (d->go_sent && xh_read_all(d->rfd, &rep, sizeof(rep), pkv_now_ns() + DEMO_REPORT_NS) == 0) {
        r->producer_reported = true;
        r->producer = rep;
    }
    int wst = -1;
    xh_reap(d->pid, &wst, pkv_now_ns() + 5000000000ull); /* it exits once it has reported */
    d->reaped = true;
    r->producer_exit_ok = WIFEXITED(wst) && WEXITSTATUS(wst) == 0;
    pkv_xfer_agent_t *agent = pkv_disagg_node_agent(d->node);
    pkv_xfer_wait_idle(agent, pkv_now_ns() + 2000000000ull);
    pkv_xfer_stats_t xs;
    pkv_xfer_stats(agent, &xs);
    r->consumer_pinned = xs.pinned_blocks;
    r->consumer_staging_held = xs.staging_pages_held;
    r->consumer_bytes_received = xs.bytes_received;
    pkv_kv_stats_t ks;
    pkv_kv_stats(pkv_disagg_node_kv(d->node), &ks);
    r->consumer_pool_committed = ks.committed_bytes;
    pkv_kv_stats(d->ref_kv, &ks);
    r->consumer_pool_committed += ks.committed_bytes;
    r->consumer_rss = demo_rss();
}

static bool demo_ok(const demo_result_t *r)
{
    return r->outcome == PKV_OK && r->kv_identical && r->first_identical && r->tokens_identical &&
           r->producer_reported && r->producer.end == PKV_OK && r->producer.sent == 1 &&
           r->producer.bytes_sent == r->kv_bytes && r->producer.pinned == 0 &&
           r->producer.staging_held == 0 && r->consumer_bytes_received == r->kv_bytes &&
           r->consumer_pinned == 0 && r->consumer_staging_held == 0 && r->producer_exit_ok;
}

/* ---- the report ---------------------------------------------------------------------- */
static void demo_text(FILE *f, const pkv_tok_t *tok, int32_t prev, const int32_t *ids, uint32_t n)
{
    size_t shown = 0;
    fputc('"', f);
    for (uint32_t i = 0; i < n && shown < DEMO_TEXT_SHOWN; i++) {
        const char *b;
        size_t len;
        if (pkv_tok_decode_token(tok, prev, ids[i], &b, &len)) len = 0;
        for (size_t j = 0; j < len && shown < DEMO_TEXT_SHOWN; j++, shown++)
            fputc(b[j] >= 0x20 && b[j] < 0x7f && b[j] != '"' ? b[j] : '.', f);
        prev = ids[i];
    }
    fputs(shown >= DEMO_TEXT_SHOWN ? "\"..." : "\"", f);
}

static const char *demo_yes(bool b)
{
    return b ? "yes" : "NO";
}

static void demo_report_setup(FILE *f, const demo_decode_t *d, const demo_result_t *r)
{
    const pkv_model_config_t *mc = pkv_model_config(pkv_disagg_node_model(d->node));
    const pkv_geometry_t *g = pkv_kv_geometry(pkv_disagg_node_kv(d->node));
    fprintf(f, "pagekv demo: disaggregated prefill -> decode on the built-in model\n");
    fprintf(f,
            "  model      %s geometry: %u layers, %u KV heads x %u, KV in %s; weights from seed "
            "%llu (random: the text is noise, the bytes are what counts)\n",
            d->o->preset ? d->o->preset : PKV_DISAGG_DEFAULT_PRESET, mc->n_layers, mc->n_kv_heads,
            mc->head_dim, pkv_dtype_name(g->dtype),
            (unsigned long long)(d->o->weights_seed ? d->o->weights_seed : 1));
    fprintf(f, "  prompt     %u tokens -> KV of %u positions in %u blocks of %u tokens, %.2f MiB\n",
            r->prompt_tokens, r->prompt_tokens, r->blocks, g->block_tokens,
            r->kv_bytes / 1048576.0);
    fprintf(f,
            "  prefill    pid %u: prompt computed in %.1f ms, first token %d, blocks registered "
            "(lease %llu s)\n",
            d->hello.pid, r->prefill_ns / 1e6, d->hello.first,
            (unsigned long long)(DEMO_LEASE_NS / 1000000000ull));
}

static void demo_report_transfer(FILE *f, const demo_decode_t *d, const demo_result_t *r)
{
    const pkv_geometry_t *g = pkv_kv_geometry(pkv_disagg_node_kv(d->node));
    if (r->outcome != PKV_OK) {
        fprintf(f, "  transfer   %s: %s after %.2f ms\n", r->path, pkv_status_str(r->outcome),
                r->transfer_ns / 1e6);
        return;
    }
    fprintf(f, "  transfer   %s: ok in %.2f ms (%.2f GB/s, connecting to prefill included)\n",
            r->path, r->transfer_ns / 1e6,
            r->transfer_ns ? (double)r->kv_bytes / (double)r->transfer_ns : 0.0);
    fprintf(f,
            "  decode     pid %u: transferred KV identical to its own run of the prompt "
            "(bitwise, %u positions x %u layers x K,V x %u heads): %s\n",
            (unsigned)getpid(), r->prompt_tokens, g->layers, g->kv_heads,
            demo_yes(r->kv_identical));
    fprintf(f,
            "             first token identical: %s; %u tokens generated from the "
            "transferred KV, identical to the unified run: %s\n",
            demo_yes(r->first_identical), r->generated, demo_yes(r->tokens_identical));
    fprintf(f, "  text       ");
    demo_text(f, d->tok, d->ids[d->n - 1], d->gen, r->generated);
    fputc('\n', f);
}

static void demo_report_accounting(FILE *f, const demo_result_t *r, bool ok)
{
    double mib = 1.0 / 1048576.0;
    if (r->producer_reported)
        fprintf(f,
                "  prefill    registration ended %s; %llu sent (%.2f MiB), %llu blocks pinned, "
                "%llu staging pages held; VmRSS %.1f MiB; %s\n",
                r->producer.end == PKV_OK                  ? "sent (acknowledged)"
                : r->producer.end == PKV_DISAGG_LEASE_OPEN ? "not (still registered)"
                                                           : pkv_status_str(r->producer.end),
                (unsigned long long)r->producer.sent, r->producer.bytes_sent * mib,
                (unsigned long long)r->producer.pinned,
                (unsigned long long)r->producer.staging_held, r->producer.rss * mib,
                r->producer_exit_ok ? "exited 0" : "did NOT exit cleanly");
    else
        fprintf(f, "  prefill    no report (the process died or did not answer)\n");
    fprintf(f,
            "  decode     %.2f MiB received, %llu blocks pinned, %llu staging pages held; KV "
            "pools %.1f MiB committed (transferred + unified); VmRSS %.1f MiB\n",
            r->consumer_bytes_received * mib, (unsigned long long)r->consumer_pinned,
            (unsigned long long)r->consumer_staging_held, r->consumer_pool_committed * mib,
            r->consumer_rss * mib);
    fprintf(f, "  result     %s\n", ok ? "ok" : "FAILED");
}

/* Decode's whole part once prefill is forked: the exit code. */
static int demo_decode(demo_decode_t *d, demo_result_t *r)
{
    if (demo_handle(d)) return 2;
    r->prefill_ns = d->hello.prefill_ns;
    r->prompt_tokens = d->n;
    r->blocks = d->h->n_blocks;
    int rc = demo_decode_setup(d);
    if (rc) {
        fprintf(stderr, "pagekv demo: decode setup: %s\n", pkv_status_str(rc));
        return 2;
    }
    if (demo_pull(d, r) || demo_unified(d, r)) return 2;
    demo_accounting(d, r);
    bool ok = demo_ok(r);
    demo_report_setup(stdout, d, r);
    demo_report_transfer(stdout, d, r);
    demo_report_accounting(stdout, r, ok);
    return ok ? 0 : 1;
}

/* ---- the two processes --------------------------------------------------------------- */
/* Fork prefill, play decode, reap: the exit code. The pipes are closed here. */
static int demo_fork(demo_decode_t *d, int c2p[2], int p2c[2])
{
    demo_result_t r;
    memset(&r, 0, sizeof(r));
    r.outcome = PKV_ERR_INVALID;
    pid_t parent = getpid();
    fflush(NULL);
    d->pid = fork();
    if (d->pid == 0) {
        xh_child_detach(parent);
        close(c2p[0]);
        close(p2c[1]);
        demo_prefill(d->o, d->ids, d->n, d->vocab, c2p[1], p2c[0]);
    }
    close(c2p[1]);
    close(p2c[0]);
    d->rfd = c2p[0];
    d->wfd = p2c[1];
    int ret = 2;
    if (d->pid < 0)
        fprintf(stderr, "pagekv demo: fork: %s\n", strerror(errno));
    else
        ret = demo_decode(d, &r);
    if (d->pid > 0 && !d->go_sent) {
        char no = 0;
        (void)xh_write_all(d->wfd, &no, 1);
    }
    close(d->wfd);
    close(d->rfd);
    int ignored;
    if (d->pid > 0 && !d->reaped) xh_reap(d->pid, &ignored, pkv_now_ns() + 5000000000ull);
    demo_decode_free(d);
    return ret;
}

/* Tokenize, check the fit, set up the process (pipes, SIGPIPE, UCX_TLS), run, restore. */
static int demo_run(const demo_opts_t *o)
{
    pkv_model_config_t probe;
    if (pkv_model_preset(o->preset ? o->preset : PKV_DISAGG_DEFAULT_PRESET, &probe)) {
        fprintf(stderr, "pagekv demo: unknown preset '%s'\n", o->preset);
        return 2;
    }
    demo_decode_t d = {.o = o, .max = o->max_tokens ? o->max_tokens : 32, .rfd = -1, .wfd = -1};
    pkv_tok_t *tok = NULL;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    int rc = pkv_tok_create_builtin(&tok);
    const char *prompt = o->prompt ? o->prompt : demo_default_prompt;
    if (!rc) rc = pkv_tok_encode_alloc(tok, prompt, strlen(prompt), true, &ids, &n_ids);
    int ret = 2;
    int c2p[2] = {-1, -1}, p2c[2] = {-1, -1};
    if (rc || n_ids == 0 || n_ids + d.max > probe.max_seq_len) {
        fprintf(stderr,
                "pagekv demo: prompt of %zu tokens + %u generated: %s (the model takes %u)\n",
                n_ids, d.max, rc ? pkv_status_str(rc) : "does not fit", probe.max_seq_len);
    } else if (pipe2(c2p, O_CLOEXEC) || pipe2(p2c, O_CLOEXEC)) {
        fprintf(stderr, "pagekv demo: pipe: %s\n", strerror(errno));
        for (int i = 0; i < 2; i++) {
            if (c2p[i] >= 0) close(c2p[i]);
            if (p2c[i] >= 0) close(p2c[i]);
        }
    } else {
        d.tok = tok;
        d.ids = ids;
        d.n = (uint32_t)n_ids;
        d.vocab = pkv_tok_vocab_size(tok);
        /* A prefill process that died must be a failed write here, not our death. */
        struct sigaction ign = {.sa_handler = SIG_IGN}, old_pipe;
        sigaction(SIGPIPE, &ign, &old_pipe);
        if (o->tcp) setenv("UCX_TLS", "tcp", 1); /* both processes: set before the fork */
        ret = demo_fork(&d, c2p, p2c);
        sigaction(SIGPIPE, &old_pipe, NULL);
    }
    free(ids);
    pkv_tok_destroy(tok);
    return ret;
}

static void demo_usage(void)
{
    fprintf(stderr,
            "usage: pagekv demo [--preset NAME] [--prompt TEXT] [--max-tokens N] "
            "[--dtype f32|f16|bf16]\n"
            "                   [--weights-seed S] [--deadline-ms MS] [--no-shared | --tcp]\n"
            "Prefill in one process, decode in another: the prompt's KV moves between their\n"
            "pools through the transfer engine, and decode checks it against its own run.\n");
}

/* One option with its value; 0, or the usage error's exit code. */
static int demo_option(demo_opts_t *o, const char *a, const char *val)
{
    uint64_t v;
    if (!strcmp(a, "--preset")) {
        o->preset = val;
    } else if (!strcmp(a, "--prompt")) {
        if (!*val) return pkv_cli_usage_error("demo", "--prompt: empty");
        o->prompt = val;
    } else if (!strcmp(a, "--max-tokens")) {
        if (pkv_cli_parse_u64(val, 1, 4096, &v))
            return pkv_cli_usage_error("demo", "--max-tokens: 1..4096, not '%s'", val);
        o->max_tokens = (uint32_t)v;
    } else if (!strcmp(a, "--dtype")) {
        if (pkv_dtype_parse(val, &o->dtype))
            return pkv_cli_usage_error("demo", "--dtype: f32, f16 or bf16, not '%s'", val);
    } else if (!strcmp(a, "--weights-seed")) {
        if (pkv_cli_parse_u64(val, 1, UINT64_MAX, &o->weights_seed))
            return pkv_cli_usage_error("demo", "--weights-seed: an integer >= 1, not '%s'", val);
    } else if (pkv_cli_parse_u64(val, 1, 3600000, &o->deadline_ms)) { /* --deadline-ms */
        return pkv_cli_usage_error("demo", "--deadline-ms: 1..3600000, not '%s'", val);
    }
    return 0;
}

int pkv_cmd_demo(int argc, char **argv)
{
    demo_opts_t o = {.dtype = PKV_DTYPE_BF16};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return demo_usage(), 0;
        if (!strcmp(a, "--no-shared")) {
            o.no_shared = true;
            continue;
        }
        if (!strcmp(a, "--tcp")) {
            o.tcp = true;
            continue;
        }
        static const char *const with_value[] = {"--preset", "--prompt",       "--max-tokens",
                                                 "--dtype",  "--weights-seed", "--deadline-ms"};
        bool known = false;
        for (size_t k = 0; k < sizeof(with_value) / sizeof(with_value[0]); k++)
            known |= !strcmp(a, with_value[k]);
        if (!known) return pkv_cli_usage_error("demo", "unknown option '%s' (try --help)", a);
        if (!val) return pkv_cli_usage_error("demo", "%s needs a value (try --help)", a);
        i++;
        int rc = demo_option(&o, a, val);
        if (rc) return rc;
    }
    if (o.tcp && o.no_shared)
        return pkv_cli_usage_error("demo", "--tcp already moves the payload through UCX");
    return demo_run(&o);
}
