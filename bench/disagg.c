#include "disagg.h"
#include "xfer_harness.h"

#include "core/core.h"
#include "engine/sample.h"
#include "pagekv/model.h"
#include "pagekv/stage.h"
#include "pagekv/tokenizer.h"
#include "pagekv/xfer.h"
#include "prim/prim.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define DG_REQUEST_ID 1
#define DG_LEASE_NS   30000000000ull  /* the registration's expiry after prefill */
#define DG_PREFILL_NS 120000000000ull /* how long decode waits for prefill's handle */
#define DG_REPORT_NS  10000000000ull  /* ... and for its report after the read */
#define DG_HANDLE_MAX (1u << 20)
#define DG_TEXT_SHOWN 240

static const char dg_default_prompt[] =
    "A paged KV cache keeps each request's keys and values in fixed-size blocks, so a "
    "server can move them between a prefill node and a decode node without copying the "
    "whole pool. The decode node pulls the blocks, verifies every layer, and goes on "
    "generating as if it had computed the prompt itself.";

/* Pipes: xh_write_all / xh_read_all (every read has a deadline: nothing waits forever). */

/* What prefill sends: this header, then handle_len bytes of the encoded handle. */
typedef struct {
    int32_t status; /* PKV_OK, or why prefill could not register */
    int32_t first;  /* the first generated token (from the prompt's last logits) */
    uint64_t prefill_ns;
    uint32_t handle_len;
    uint32_t pid;
} dg_hello_t;

/* What prefill reports after decode's read. */
typedef struct {
    int32_t end; /* how the registration ended; 1 = still registered */
    uint64_t sent, bytes_sent, pinned, staging_held, rss;
} dg_report_t;

/* ---- the two processes' common setup ------------------------------------------------ */
typedef struct {
    pkv_model_t *model;
    pkv_kv_t *kv;
    pkv_stage_t *stage;
    pkv_xfer_agent_t *agent;
} dg_node_t;

static void dg_node_free(dg_node_t *n)
{
    pkv_xfer_agent_destroy(n->agent);
    size_t leaked = 0;
    if (n->stage) pkv_stage_destroy(n->stage, pkv_deadline_after_ns(2000000000ull), &leaked);
    n->agent = NULL;
    n->stage = NULL;
}

static int dg_model(const pkv_disagg_opts_t *o, int32_t vocab, pkv_model_t **out)
{
    pkv_model_config_t mc;
    int rc = pkv_model_preset(o->preset ? o->preset : "llama-3.2-1b", &mc);
    if (rc) return rc;
    mc.vocab_size = (uint32_t)vocab;
    return pkv_model_create_builtin(&mc, o->weights_seed ? o->weights_seed : 1, NULL, out);
}

static int dg_kv(const pkv_disagg_opts_t *o, pkv_model_t *m, pkv_kv_t **out)
{
    pkv_kv_config_t kc = {.backend = PKV_BACKEND_PAGED, .hugepages = true};
    pkv_model_geometry(m, o->dtype, 16, &kc.geo);
    return pkv_kv_create(&kc, out);
}

/* Staging for one transfer of `bytes` (plus slack for a run's rounding). */
static int dg_stage(uint64_t bytes, bool shared, pkv_stage_t **out)
{
    pkv_stage_config_t sc;
    pkv_stage_config_default(&sc);
    sc.pool_pages = (uint32_t)PKV_DIV_UP(bytes, sc.page_bytes) + 2;
    sc.shared = shared;
    sc.name = shared ? "pkv-demo-prefill" : "pkv-demo-decode";
    return pkv_stage_create(&sc, out);
}

static int dg_agent(dg_node_t *n, bool no_shared)
{
    pkv_xfer_config_t xc = {.kv = n->kv, .stage = n->stage, .no_shared = no_shared};
    return pkv_xfer_agent_create(&xc, &n->agent);
}

/* A sequence holding the prompt's capacity plus `extra` positions. */
static int dg_seq(pkv_kv_t *kv, const int32_t *ids, uint32_t n, uint32_t extra, pkv_seq_t **out)
{
    pkv_seq_params_t sp = {.tokens = ids, .n_tokens = n, .reserve_tokens = n + extra};
    uint32_t cached;
    return pkv_seq_create(kv, &sp, out, &cached);
}

/* Forward `n` tokens of seq; *next = argmax of the last logits. */
static int dg_forward(pkv_model_t *m, pkv_kv_t *kv, pkv_seq_t *seq, const int32_t *ids, uint32_t n,
                      float *logits, int32_t *next)
{
    pkv_model_item_t it = {.seq = seq, .tokens = ids, .n_tokens = n, .logits = logits};
    int rc = pkv_model_forward(m, kv, &it, 1);
    if (rc == PKV_OK) *next = pkv_sample_argmax(logits, pkv_model_config(m)->vocab_size);
    return rc;
}

/* Greedy generation from `first`: out[0] = first, each next token from the last one's
 * logits, at most max tokens, ending after a stop token. Returns the count or < 0. */
static int dg_generate(pkv_model_t *m, pkv_kv_t *kv, pkv_seq_t *seq, const pkv_tok_t *tok,
                       int32_t first, uint32_t max, float *logits, int32_t *out)
{
    uint32_t k = 0;
    out[k++] = first;
    while (k < max && !pkv_tok_is_stop(tok, out[k - 1])) {
        int rc = dg_forward(m, kv, seq, &out[k - 1], 1, logits, &out[k]);
        if (rc) return rc;
        k++;
    }
    return (int)k;
}

/* ---- prefill ------------------------------------------------------------------------ */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int end; /* 1 until the registration ends */
} dg_reg_t;

static void dg_sent(void *arg, uint64_t request_id, int outcome)
{
    dg_reg_t *s = arg;
    (void)request_id;
    pthread_mutex_lock(&s->mu);
    s->end = outcome;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static int dg_reg_wait(dg_reg_t *s, uint64_t deadline_ns)
{
    pthread_mutex_lock(&s->mu);
    while (s->end == 1 && pkv_now_ns() < deadline_ns) {
        struct timespec ts = pkv__deadline_to_monotonic(deadline_ns);
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
    int end = s->end;
    pthread_mutex_unlock(&s->mu);
    return end;
}

/* The prefill process: never returns. */
static void dg_prefill(const pkv_disagg_opts_t *o, const int32_t *ids, uint32_t n, int32_t vocab,
                       int wfd, int rfd)
{
    dg_hello_t hello = {.status = PKV_OK, .pid = (uint32_t)getpid()};
    dg_node_t node = {0};
    pkv_seq_t *seq = NULL;
    pkv_xfer_handle_t *h = NULL;
    uint8_t *hb = NULL;
    float *logits = NULL;
    dg_reg_t reg = {.mu = PTHREAD_MUTEX_INITIALIZER, .end = 1};
    int rc = pkv__cond_init_monotonic(&reg.cv) ? PKV_ERR_NOMEM : PKV_OK;
    if (!rc) rc = dg_model(o, vocab, &node.model);
    if (!rc) rc = dg_kv(o, node.model, &node.kv);
    if (!rc) rc = dg_seq(node.kv, ids, n, 0, &seq);
    if (!rc) {
        logits = malloc(sizeof(float) * (size_t)vocab);
        rc = logits ? PKV_OK : PKV_ERR_NOMEM;
    }
    if (!rc) {
        uint64_t t0 = pkv_now_ns();
        rc = dg_forward(node.model, node.kv, seq, ids, n, logits, &hello.first);
        hello.prefill_ns = pkv_now_ns() - t0;
    }
    const uint32_t *blocks = NULL;
    uint32_t nb = 0;
    if (!rc) rc = pkv_seq_blocks(seq, &blocks, &nb);
    if (!rc) rc = dg_stage((uint64_t)nb * pkv_kv_block_bytes(node.kv), true, &node.stage);
    if (!rc) rc = dg_agent(&node, false);
    if (!rc)
        rc = pkv_xfer_register(node.agent, DG_REQUEST_ID, blocks, nb, pkv_now_ns() + DG_LEASE_NS,
                               dg_sent, &reg, &h);
    size_t len = 0;
    if (!rc) {
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
    if (!rc && xh_read_all(rfd, &go, 1, pkv_now_ns() + DG_PREFILL_NS + DG_REPORT_NS) == PKV_OK) {
        dg_report_t rep;
        memset(&rep, 0, sizeof(rep)); /* padding too: it goes through the pipe */
        /* An acknowledged read's ACK may still be on its way; a failed one never comes.
         * Unregistering one that ended meanwhile is NOTFOUND: either way its callback
         * says how it ended. */
        int end = dg_reg_wait(&reg, pkv_now_ns() + (go ? 2000000000ull : 0));
        if (end == 1) {
            pkv_xfer_unregister(node.agent, DG_REQUEST_ID);
            end = dg_reg_wait(&reg, pkv_now_ns() + 1000000000ull);
        }
        pkv_xfer_wait_idle(node.agent, pkv_now_ns() + 2000000000ull);
        pkv_xfer_stats_t xs;
        pkv_xfer_stats(node.agent, &xs);
        pkv_prim_mem_t mem = {0};
        pkv_prim_mem_read(0, &mem);
        rep.end = end;
        rep.sent = xs.sent;
        rep.bytes_sent = xs.bytes_sent;
        rep.pinned = xs.pinned_blocks;
        rep.staging_held = xs.staging_pages_held;
        rep.rss = mem.rss_bytes;
        (void)xh_write_all(wfd, &rep, sizeof(rep));
    }
    pkv_xfer_handle_free(h);
    free(hb);
    free(logits);
    dg_node_free(&node);
    if (seq) pkv_seq_free(seq);
    if (node.kv) pkv_kv_destroy(node.kv);
    pkv_model_destroy(node.model);
    _exit(rc ? 3 : 0);
}

/* ---- decode (the calling process) --------------------------------------------------- */
/* Every position [0, n) of every layer, K and V, every head: src (transferred) == ref. */
static bool dg_kv_equal(pkv_kv_t *a, const uint32_t *ia, pkv_kv_t *b, const uint32_t *ib,
                        uint32_t nb, uint32_t n)
{
    const pkv_geometry_t *g = pkv_kv_geometry(a);
    size_t tok_bytes = (size_t)g->head_dim * pkv_dtype_size(g->dtype);
    for (uint32_t k = 0; k < nb; k++) {
        uint32_t toks = PKV_MIN(g->block_tokens, n - k * g->block_tokens);
        for (uint32_t l = 0; l < g->layers; l++)
            for (uint32_t w = 0; w < 2; w++)
                for (uint32_t hd = 0; hd < g->kv_heads; hd++) {
                    const void *x = pkv_kv_block_head(a, ia[k], l, w, hd);
                    const void *y = pkv_kv_block_head(b, ib[k], l, w, hd);
                    if (!x || !y || memcmp(x, y, toks * tok_bytes)) return false;
                }
    }
    return true;
}

static void dg_text(FILE *f, const pkv_tok_t *tok, int32_t prev, const int32_t *ids, uint32_t n)
{
    size_t shown = 0;
    fputc('"', f);
    for (uint32_t i = 0; i < n && shown < DG_TEXT_SHOWN; i++) {
        const char *b;
        size_t len;
        if (pkv_tok_decode_token(tok, prev, ids[i], &b, &len)) len = 0;
        for (size_t j = 0; j < len && shown < DG_TEXT_SHOWN; j++, shown++)
            fputc(b[j] >= 0x20 && b[j] < 0x7f && b[j] != '"' ? b[j] : '.', f);
        prev = ids[i];
    }
    fputs(shown >= DG_TEXT_SHOWN ? "\"..." : "\"", f);
}

static const char *dg_yes(bool b)
{
    return b ? "yes" : "NO";
}

static void dg_report(const pkv_disagg_opts_t *o, const pkv_disagg_result_t *r,
                      const pkv_model_t *m, const pkv_geometry_t *g, const pkv_tok_t *tok,
                      int32_t last_prompt, int32_t first, const int32_t *gen, uint32_t prefill_pid,
                      bool ok)
{
    FILE *f = o->out;
    const pkv_model_config_t *mc = pkv_model_config(m);
    double mib = 1.0 / 1048576.0;
    fprintf(f, "pagekv demo: disaggregated prefill -> decode on the built-in model\n");
    fprintf(f,
            "  model      %s geometry: %u layers, %u KV heads x %u, KV in %s; weights from seed "
            "%llu (random: the text is noise, the bytes are what counts)\n",
            o->preset ? o->preset : "llama-3.2-1b", mc->n_layers, mc->n_kv_heads, mc->head_dim,
            pkv_dtype_name(g->dtype), (unsigned long long)(o->weights_seed ? o->weights_seed : 1));
    fprintf(f, "  prompt     %u tokens -> KV of %u positions in %u blocks of %u tokens, %.2f MiB\n",
            r->prompt_tokens, r->prompt_tokens, r->blocks, g->block_tokens, r->kv_bytes * mib);
    fprintf(f,
            "  prefill    pid %u: prompt computed in %.1f ms, first token %d, blocks registered "
            "(lease %llu s)\n",
            prefill_pid, r->prefill_ns / 1e6, first,
            (unsigned long long)(DG_LEASE_NS / 1000000000ull));
    if (r->outcome == PKV_OK)
        fprintf(f, "  transfer   %s: ok in %.2f ms (%.2f GB/s, connecting to prefill included)\n",
                r->path, r->transfer_ns / 1e6,
                r->transfer_ns ? (double)r->kv_bytes / (double)r->transfer_ns : 0.0);
    else
        fprintf(f, "  transfer   %s: %s after %.2f ms\n", r->path, pkv_status_str(r->outcome),
                r->transfer_ns / 1e6);
    if (r->outcome == PKV_OK) {
        fprintf(f,
                "  decode     pid %u: transferred KV identical to its own run of the prompt "
                "(bitwise, %u positions x %u layers x K,V x %u heads): %s\n",
                (unsigned)getpid(), r->prompt_tokens, g->layers, g->kv_heads,
                dg_yes(r->kv_identical));
        fprintf(f,
                "             first token identical: %s; %u tokens generated from the "
                "transferred KV, identical to the unified run: %s\n",
                dg_yes(r->first_identical), r->generated, dg_yes(r->tokens_identical));
        fprintf(f, "  text       ");
        dg_text(f, tok, last_prompt, gen, r->generated);
        fputc('\n', f);
    }
    if (r->producer_reported)
        fprintf(f,
                "  prefill    registration ended %s; %llu sent (%.2f MiB), %llu blocks pinned, "
                "%llu staging pages held; VmRSS %.1f MiB; %s\n",
                r->producer_end == PKV_OK ? "sent (acknowledged)"
                : r->producer_end == 1    ? "not (still registered)"
                                          : pkv_status_str(r->producer_end),
                (unsigned long long)r->producer_sent, r->producer_bytes_sent * mib,
                (unsigned long long)r->producer_pinned,
                (unsigned long long)r->producer_staging_held, r->producer_rss * mib,
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

int pkv_disagg_run(const pkv_disagg_opts_t *o, pkv_disagg_result_t *r)
{
    memset(r, 0, sizeof(*r));
    r->outcome = PKV_ERR_INVALID;
    pkv_model_config_t probe;
    if (pkv_model_preset(o->preset ? o->preset : "llama-3.2-1b", &probe)) {
        fprintf(stderr, "pagekv demo: unknown preset '%s'\n", o->preset);
        return 2;
    }
    uint32_t max = o->max_tokens ? o->max_tokens : 32;
    pkv_tok_t *tok = NULL;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    int rc = pkv_tok_create_builtin(&tok);
    const char *prompt = o->prompt ? o->prompt : dg_default_prompt;
    if (!rc) rc = pkv_tok_encode_alloc(tok, prompt, strlen(prompt), true, &ids, &n_ids);
    if (rc || n_ids == 0 || n_ids + max > probe.max_seq_len) {
        fprintf(stderr,
                "pagekv demo: prompt of %zu tokens + %u generated: %s (the model takes %u)\n",
                n_ids, max, rc ? pkv_status_str(rc) : "does not fit", probe.max_seq_len);
        free(ids);
        pkv_tok_destroy(tok);
        return 2;
    }
    uint32_t n = (uint32_t)n_ids;
    int32_t vocab = pkv_tok_vocab_size(tok);
    int c2p[2] = {-1, -1}, p2c[2] = {-1, -1};
    if (pipe2(c2p, O_CLOEXEC) || pipe2(p2c, O_CLOEXEC)) {
        fprintf(stderr, "pagekv demo: pipe: %s\n", strerror(errno));
        for (int i = 0; i < 2; i++) {
            if (c2p[i] >= 0) close(c2p[i]);
            if (p2c[i] >= 0) close(p2c[i]);
        }
        free(ids);
        pkv_tok_destroy(tok);
        return 2;
    }
    /* A prefill process that died must be a failed write here, not our death. */
    struct sigaction ign = {.sa_handler = SIG_IGN}, old_pipe;
    sigaction(SIGPIPE, &ign, &old_pipe);
    const char *old_tls = getenv("UCX_TLS");
    char *saved_tls = old_tls ? strdup(old_tls) : NULL;
    if (o->tcp) setenv("UCX_TLS", "tcp", 1); /* both processes: set before the fork */
    pid_t parent = getpid();
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        xh_child_detach(parent);
        close(c2p[0]);
        close(p2c[1]);
        dg_prefill(o, ids, n, vocab, c2p[1], p2c[0]);
    }
    close(c2p[1]);
    close(p2c[0]);
    int ret = 2;
    dg_node_t node = {0};
    pkv_kv_t *ref_kv = NULL;
    pkv_seq_t *seq = NULL, *ref = NULL;
    pkv_xfer_handle_t *h = NULL;
    pkv_xfer_read_t *rd = NULL;
    uint8_t *hb = NULL;
    float *logits = NULL;
    int32_t *gen = NULL, *ref_gen = NULL;
    dg_hello_t hello = {0};
    bool go_sent = false, reaped = false;
    if (pid < 0) {
        fprintf(stderr, "pagekv demo: fork: %s\n", strerror(errno));
        goto out;
    }
    if (xh_read_all(c2p[0], &hello, sizeof(hello), pkv_now_ns() + DG_PREFILL_NS) ||
        hello.handle_len > DG_HANDLE_MAX) {
        fprintf(stderr, "pagekv demo: no handle from the prefill process\n");
        goto out;
    }
    if (hello.status) {
        fprintf(stderr, "pagekv demo: prefill failed: %s\n", pkv_status_str(hello.status));
        goto out;
    }
    r->prefill_ns = hello.prefill_ns;
    hb = malloc(hello.handle_len ? hello.handle_len : 1);
    if (!hb || xh_read_all(c2p[0], hb, hello.handle_len, pkv_now_ns() + DG_REPORT_NS) ||
        pkv_xfer_handle_decode(hb, hello.handle_len, &h)) {
        fprintf(stderr, "pagekv demo: the prefill process sent no valid handle\n");
        goto out;
    }
    bool no_shared = o->no_shared || o->tcp;
    r->prompt_tokens = n;
    r->blocks = h->n_blocks;
    logits = malloc(sizeof(float) * (size_t)vocab);
    gen = malloc(sizeof(int32_t) * max);
    ref_gen = malloc(sizeof(int32_t) * max);
    rc = logits && gen && ref_gen ? PKV_OK : PKV_ERR_NOMEM;
    if (!rc) rc = dg_model(o, vocab, &node.model);
    if (!rc) rc = dg_kv(o, node.model, &node.kv);
    if (!rc) rc = dg_kv(o, node.model, &ref_kv);
    if (!rc) rc = dg_seq(node.kv, ids, n, max, &seq);
    const uint32_t *dst = NULL, *ref_blocks = NULL;
    uint32_t nd = 0, nr = 0;
    if (!rc) rc = pkv_seq_blocks(seq, &dst, &nd);
    /* The handle must cover exactly the prompt's positions, which decode compares. */
    if (!rc &&
        (nd < h->n_blocks || h->n_blocks != PKV_DIV_UP(n, pkv_kv_geometry(node.kv)->block_tokens)))
        rc = PKV_ERR_INVALID;
    if (!rc) r->kv_bytes = (uint64_t)h->n_blocks * pkv_kv_block_bytes(node.kv);
    if (!rc) rc = dg_stage(r->kv_bytes, false, &node.stage);
    if (!rc) rc = dg_agent(&node, no_shared);
    if (rc) {
        fprintf(stderr, "pagekv demo: decode setup: %s\n", pkv_status_str(rc));
        goto out;
    }
    /* The pull. */
    uint64_t t0 = pkv_now_ns();
    uint64_t deadline = t0 + (o->deadline_ms ? o->deadline_ms : 10000) * 1000000ull;
    rc = pkv_xfer_read(node.agent, h, dst, h->n_blocks, deadline, NULL, NULL, &rd);
    if (rc == PKV_OK && pkv_xfer_read_wait(rd, deadline + 1000000000ull, &r->outcome) != PKV_OK)
        r->outcome = PKV_ERR_TIMEOUT; /* cannot happen: every read ends by its deadline */
    if (rc != PKV_OK) r->outcome = rc;
    r->transfer_ns = pkv_now_ns() - t0;
    /* Which way the payload went: through our own staging (UCX), or not at all (the
     * producer's arena, mapped; the agent falls back to UCX where it cannot map it). */
    pkv_stage_stats_t ss;
    pkv_stage_stats(node.stage, &ss);
    r->shared_arena = r->outcome == PKV_OK && ss.acquires == 0;
    r->path = r->shared_arena ? "same host, shared memfd staging arena"
              : o->tcp        ? "tcp (UCX_TLS=tcp), staging copied on both sides"
              : r->outcome == PKV_OK || no_shared
                  ? "same host through UCX, staging copied on both sides"
                  : "same host (shared arena offered)";
    char go = r->outcome == PKV_OK;
    go_sent = xh_write_all(p2c[1], &go, 1) == PKV_OK;
    pkv_xfer_read_free(rd);
    rd = NULL;

    /* The unified run, in a pool of its own: the prompt computed here. */
    int32_t ref_first = -1;
    rc = dg_seq(ref_kv, ids, n, max, &ref);
    if (!rc) rc = dg_forward(node.model, ref_kv, ref, ids, n, logits, &ref_first);
    if (!rc) rc = pkv_seq_blocks(ref, &ref_blocks, &nr);
    if (rc) {
        fprintf(stderr, "pagekv demo: unified run: %s\n", pkv_status_str(rc));
        goto out;
    }
    int ng = 0, nrg = 0;
    if (r->outcome == PKV_OK) {
        r->kv_identical = dg_kv_equal(node.kv, dst, ref_kv, ref_blocks, h->n_blocks, n);
        r->first_identical = hello.first == ref_first;
        /* Decode goes on from the transferred KV: positions [0, n) are written. */
        rc = pkv_seq_append(seq, ids, n);
        if (!rc) ng = dg_generate(node.model, node.kv, seq, tok, hello.first, max, logits, gen);
        if (!rc && ng >= 0)
            nrg = dg_generate(node.model, ref_kv, ref, tok, ref_first, max, logits, ref_gen);
        if (rc || ng < 0 || nrg < 0) {
            fprintf(stderr, "pagekv demo: generation: %s\n",
                    pkv_status_str(rc       ? rc
                                   : ng < 0 ? ng
                                            : nrg));
            goto out;
        }
        r->generated = (uint32_t)ng;
        r->tokens_identical = ng == nrg && !memcmp(gen, ref_gen, sizeof(int32_t) * (size_t)ng);
    }
    /* Prefill's accounting, then ours. */
    dg_report_t rep;
    if (go_sent && xh_read_all(c2p[0], &rep, sizeof(rep), pkv_now_ns() + DG_REPORT_NS) == PKV_OK) {
        r->producer_reported = true;
        r->producer_end = rep.end;
        r->producer_sent = rep.sent;
        r->producer_bytes_sent = rep.bytes_sent;
        r->producer_pinned = rep.pinned;
        r->producer_staging_held = rep.staging_held;
        r->producer_rss = rep.rss;
    }
    int wst = -1;
    xh_reap(pid, &wst, pkv_now_ns() + 5000000000ull); /* it exits once it has reported */
    reaped = true;
    r->producer_exit_ok = WIFEXITED(wst) && WEXITSTATUS(wst) == 0;
    pkv_xfer_wait_idle(node.agent, pkv_now_ns() + 2000000000ull);
    pkv_xfer_stats_t xs;
    pkv_xfer_stats(node.agent, &xs);
    r->consumer_pinned = xs.pinned_blocks;
    r->consumer_staging_held = xs.staging_pages_held;
    r->consumer_bytes_received = xs.bytes_received;
    pkv_kv_stats_t ks;
    pkv_kv_stats(node.kv, &ks);
    r->consumer_pool_committed = ks.committed_bytes;
    pkv_kv_stats(ref_kv, &ks);
    r->consumer_pool_committed += ks.committed_bytes;
    pkv_prim_mem_t mem = {0};
    pkv_prim_mem_read(0, &mem);
    r->consumer_rss = mem.rss_bytes;
    bool ok = r->outcome == PKV_OK && r->kv_identical && r->first_identical &&
              r->tokens_identical && r->producer_reported && r->producer_end == PKV_OK &&
              r->producer_sent == 1 && r->producer_bytes_sent == r->kv_bytes &&
              r->producer_pinned == 0 && r->producer_staging_held == 0 &&
              r->consumer_bytes_received == r->kv_bytes && r->consumer_pinned == 0 &&
              r->consumer_staging_held == 0 && r->producer_exit_ok;
    if (o->out)
        dg_report(o, r, node.model, pkv_kv_geometry(node.kv), tok, ids[n - 1], hello.first,
                  r->outcome == PKV_OK ? gen : NULL, hello.pid, ok);
    ret = ok ? 0 : 1;
out:
    if (pid > 0 && !go_sent) {
        char no = 0;
        (void)xh_write_all(p2c[1], &no, 1);
    }
    close(p2c[1]);
    close(c2p[0]);
    int ignored;
    if (pid > 0 && !reaped) xh_reap(pid, &ignored, pkv_now_ns() + 5000000000ull);
    pkv_xfer_read_free(rd);
    dg_node_free(&node);
    if (seq) pkv_seq_free(seq);
    if (ref) pkv_seq_free(ref);
    if (node.kv) pkv_kv_destroy(node.kv);
    if (ref_kv) pkv_kv_destroy(ref_kv);
    pkv_model_destroy(node.model);
    pkv_xfer_handle_free(h);
    free(hb);
    free(logits);
    free(gen);
    free(ref_gen);
    free(ids);
    pkv_tok_destroy(tok);
    if (o->tcp) {
        if (saved_tls)
            setenv("UCX_TLS", saved_tls, 1);
        else
            unsetenv("UCX_TLS");
    }
    free(saved_tls);
    sigaction(SIGPIPE, &old_pipe, NULL);
    return ret;
}
