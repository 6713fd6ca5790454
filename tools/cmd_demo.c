/*
 * pagekv demo: the system as it runs. A prefill node, a decode node and the router, each a
 * real process (`pagekv serve --role prefill|decode`, `pagekv route`, exec'd from this
 * binary on free loopback ports), and a unified node beside them as the reference. A
 * handful of requests go through the router (chat with a shared long system prompt,
 * streamed and not, seeded sampling, a completion); every answer is compared bitwise with
 * the unified node's. Then each node's VmRSS, staging and transfer accounting is printed,
 * the unified node (which keeps its cached prefixes on disk, --kv-disk-dir) is restarted and
 * the first request asked again: a returning user served from disk, answer unchanged;
 * every process is stopped with SIGTERM and must exit 0.
 *
 * Exit: 0 every answer identical, every lease sent, no pins or staging pages held, every
 * process exited 0; 1 a check failed; 2 it could not run (bad options, a process that did
 * not start); 130 interrupted (SIGINT/SIGTERM: every child is stopped first). The logs of
 * the processes stay in their directory when anything failed (its path is printed).
 */
#include "support/cli.h"
#include "support/cluster.h"
#include "support/http.h"
#include "support/launch.h"
#include "tools/commands.h"

#include "core/core.h"

#include <curl/curl.h>
#include <errno.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DEMO_START_NS   60000000000ull /* a node builds its model and listens */
#define DEMO_STOP_NS    10000000000ull /* SIGTERM -> exit */
#define DEMO_HTTP_MS    60000u
#define DEMO_TEXT_SHOWN 72

enum { N_UNIFIED, N_PREFILL, N_DECODE, N_ROUTER, N_PROCS };

typedef struct {
    const char *preset;
    uint32_t max_tokens;
    const char *staging; /* per_transfer | fixed */
    const char *policy;  /* router policy, NULL: its default */
    bool tcp, shared, keep_logs;
} demo_opts_t;

static volatile sig_atomic_t g_stop;
static void on_signal(int sig)
{
    g_stop = sig;
}

static const char demo_system[] =
    "You are the operator's guide to a disaggregated LLM serving system. A prefill node "
    "computes the prompt's keys and values and keeps them pinned in its paged pool under a "
    "lease; a decode node pulls exactly those blocks through host staging sized for the "
    "transfer, verifies every layer, and goes on generating as if it had computed the "
    "prompt itself. The router in front sends the prefill leg first, then the decode leg "
    "with the transfer parameters the prefill node returned, and streams the answer back. "
    "Every transfer ends in a typed outcome before its deadline, nothing is reported sent "
    "that was not acknowledged, and no answer is ever computed on wrong keys and values. "
    "Answer briefly and precisely.";

typedef struct {
    const char *what;
    const char *path;
    bool chat, stream;
    double temperature;
    int seed; /* < 0: none */
    const char *text;
} demo_req_t;

static const demo_req_t demo_reqs[] = {
    {"chat", "/v1/chat/completions", true, false, 0.0, -1,
     "What does the prefill node keep for the decode node?"},
    {"chat, streamed", "/v1/chat/completions", true, true, 0.0, -1,
     "How does a decode node know that the KV it pulled is the right one?"},
    {"chat, streamed, seeded", "/v1/chat/completions", true, true, 0.8, 7,
     "Say what happens when a transfer misses its deadline."},
    {"completion", "/v1/completions", false, false, 0.0, -1,
     "A paged KV cache keeps each request's keys and values in fixed-size blocks, so"},
    {"completion, streamed", "/v1/completions", false, true, 0.0, -1,
     "Host staging allocated per transfer holds exactly the pages in flight, which"},
};
#define N_REQS (sizeof(demo_reqs) / sizeof(demo_reqs[0]))

static void usage(FILE *f)
{
    fprintf(f,
            "usage: pagekv demo [--preset NAME] [--max-tokens N] [--staging per_transfer|fixed]\n"
            "                   [--staging-shared] [--tcp] [--policy P] [--keep-logs]\n"
            "Starts a prefill node, a decode node and the router (pagekv serve --role ...,\n"
            "pagekv route) as processes on loopback, with a unified node beside them; sends\n"
            "chat and completion requests through the router and checks every answer\n"
            "bitwise against the unified node's; prints each node's memory and transfer\n"
            "accounting; stops every process. Exit 0 only if everything held.\n"
            "  --preset NAME        built-in model (default llama-3.2-1b)\n"
            "  --max-tokens N       tokens per answer, 1..256 (default 24)\n"
            "  --staging MODE       the nodes' host staging (default per_transfer)\n"
            "  --staging-shared     a memfd staging arena the same-host decode node maps\n"
            "  --tcp                UCX_TLS=tcp in the nodes: the payload crosses TCP\n"
            "  --policy P           the router's policy (default: its own)\n"
            "  --keep-logs          keep the processes' logs (printed path) also on success\n");
}

static int parse(int argc, char **argv, demo_opts_t *o)
{
    *o = (demo_opts_t){.preset = "llama-3.2-1b", .max_tokens = 24, .staging = "per_transfer"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t n;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--tcp")) {
            o->tcp = true;
        } else if (!strcmp(a, "--staging-shared")) {
            o->shared = true;
        } else if (!strcmp(a, "--keep-logs")) {
            o->keep_logs = true;
        } else if (!v) {
            return pkv_cli_usage_error("demo", "unknown option or missing value: %s", a);
        } else if (!strcmp(a, "--preset")) {
            o->preset = argv[++i];
        } else if (!strcmp(a, "--max-tokens")) {
            if (pkv_cli_parse_u64(v, 1, 256, &n))
                return pkv_cli_usage_error("demo", "--max-tokens: 1..256, got '%s'", v);
            o->max_tokens = (uint32_t)n;
            i++;
        } else if (!strcmp(a, "--staging")) {
            if (strcmp(v, "per_transfer") && strcmp(v, "fixed"))
                return pkv_cli_usage_error("demo", "--staging: per_transfer or fixed, got '%s'", v);
            o->staging = argv[++i];
        } else if (!strcmp(a, "--policy")) {
            o->policy = argv[++i];
        } else {
            return pkv_cli_usage_error("demo", "unknown option: %s", a);
        }
    }
    return -1; /* proceed */
}

/* ---- the processes --------------------------------------------------------------------- */
typedef struct {
    demo_opts_t o;
    char bin[4096];
    char logdir[64];
    launch_proc_t p[N_PROCS];
    bool started[N_PROCS];
    char diskdir[96 + 16];
    double first_secs; /* the unified node's answer to the first request */
} demo_t;

static const char *const demo_names[N_PROCS] = {"unified", "prefill", "decode", "router"};

/* Start node i (a `pagekv serve`) or the router; 0, or -1 with the reason on stderr. */
static int demo_start(demo_t *d, int i)
{
    char *argv[32];
    int n = 0;
    argv[n++] = d->bin;
    if (i == N_ROUTER) {
        argv[n++] = "route";
        argv[n++] = "--port";
        argv[n++] = "0";
        argv[n++] = "--prefill";
        argv[n++] = d->p[N_PREFILL].url;
        argv[n++] = "--decode";
        argv[n++] = d->p[N_DECODE].url;
        if (d->o.policy) {
            argv[n++] = "--policy";
            argv[n++] = (char *)d->o.policy;
        }
    } else {
        argv[n++] = "serve";
        argv[n++] = "--port";
        argv[n++] = "0";
        argv[n++] = "--preset";
        argv[n++] = (char *)d->o.preset;
        if (i != N_UNIFIED) {
            argv[n++] = "--role";
            argv[n++] = i == N_PREFILL ? "prefill" : "decode";
            argv[n++] = "--staging";
            argv[n++] = (char *)d->o.staging;
            if (d->o.shared) argv[n++] = "--staging-shared";
        } else { /* the reference node keeps its cached prefixes on disk too */
            snprintf(d->diskdir, sizeof(d->diskdir), "%s/kv-disk", d->logdir);
            argv[n++] = "--kv-disk-dir";
            argv[n++] = d->diskdir;
            argv[n++] = "--kv-disk-bytes";
            argv[n++] = "256M";
        }
    }
    argv[n] = NULL;
    char *env[] = {d->o.tcp ? "UCX_TLS=tcp" : NULL, NULL};
    char err[768];
    if (launch_start(&d->p[i], demo_names[i], argv, env, d->logdir, pkv_now_ns() + DEMO_START_NS,
                     err, sizeof(err)) != 0) {
        fprintf(stderr, "pagekv demo: %s\n", err);
        return -1;
    }
    d->started[i] = true;
    printf("  %-8s pid %-7d %s%s%s\n", demo_names[i], (int)d->p[i].pid, d->p[i].url,
           d->p[i].kv_address[0] ? "  transfer agent " : "", d->p[i].kv_address);
    fflush(stdout);
    return 0;
}

/* SIGTERM to everything still running (router first, then the nodes); the exit codes. */
static bool demo_stop_all(demo_t *d, bool report)
{
    bool ok = true;
    static const int order[N_PROCS] = {N_ROUTER, N_DECODE, N_PREFILL, N_UNIFIED};
    for (int k = 0; k < N_PROCS; k++) {
        int i = order[k];
        if (!d->started[i]) continue;
        int code = launch_stop(&d->p[i], SIGTERM, pkv_now_ns() + DEMO_STOP_NS);
        d->started[i] = false;
        if (code != 0) ok = false;
        if (report) printf("  %-8s exited %d%s\n", demo_names[i], code, code ? "  FAILED" : "");
    }
    return ok;
}

/* ---- requests -------------------------------------------------------------------------- */
static json_t *demo_body(const demo_opts_t *o, const demo_req_t *r)
{
    json_t *b = json_pack("{s:s, s:i, s:f, s:b}", "model", o->preset, "max_tokens",
                          (int)o->max_tokens, "temperature", r->temperature, "stream", r->stream);
    if (r->seed >= 0) json_object_set_new(b, "seed", json_integer(r->seed));
    if (r->stream) json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
    if (r->chat)
        json_object_set_new(b, "messages",
                            json_pack("[{s:s, s:s}, {s:s, s:s}]", "role", "system", "content",
                                      demo_system, "role", "user", "content", r->text));
    else
        json_object_set_new(b, "prompt", json_string(r->text));
    return b;
}

/* One request to base_url: 0 with the answer, -1 with the reason on stderr. */
static int demo_ask(const char *base_url, const char *who, const demo_req_t *r, const json_t *body,
                    const char *rid, cluster_answer_t *a, double *secs)
{
    char hdr[96];
    snprintf(hdr, sizeof(hdr), "X-Request-Id: %s", rid);
    const char *headers[] = {hdr, NULL};
    http_reply_t rep;
    if (http_call(base_url, r->path, body, headers, DEMO_HTTP_MS, &g_stop, &rep) != 0) {
        if (!g_stop) fprintf(stderr, "pagekv demo: %s: %s: %s\n", who, r->what, rep.error);
        return -1;
    }
    int rc = -1;
    if (rep.status != 200)
        fprintf(stderr, "pagekv demo: %s: %s: HTTP %ld: %.300s\n", who, r->what, rep.status,
                rep.body);
    else if (cluster_answer_parse(rep.body, r->stream, a) != 0)
        fprintf(stderr, "pagekv demo: %s: %s: unreadable answer: %.300s\n", who, r->what, rep.body);
    else if (a->error_code[0] || !a->done)
        fprintf(stderr, "pagekv demo: %s: %s: the answer ended with %s\n", who, r->what,
                a->error_code[0] ? a->error_code : "no [DONE]");
    else
        rc = 0;
    if (rc && a->text) cluster_answer_free(a);
    *secs = rep.seconds;
    http_reply_free(&rep);
    return rc;
}

static void print_text(const char *t)
{
    putchar('"');
    size_t n = 0;
    for (const char *c = t; *c && n < DEMO_TEXT_SHOWN; c++, n++)
        putchar(*c == '\n' || *c == '\r' || *c == '\t' ? ' ' : *c);
    printf("%s\"\n", strlen(t) > DEMO_TEXT_SHOWN ? "..." : "");
}

/* Every request through the router and to the unified node; the number identical. */
static uint32_t demo_requests(demo_t *d, int *err)
{
    uint32_t same = 0;
    for (size_t i = 0; i < N_REQS && !g_stop; i++) {
        const demo_req_t *r = &demo_reqs[i];
        json_t *body = demo_body(&d->o, r);
        char rid[48];
        snprintf(rid, sizeof(rid), "pagekv-demo-%zu", i + 1);
        cluster_answer_t via = {0}, ref = {0};
        double tv = 0, tu = 0;
        int rc = demo_ask(d->p[N_ROUTER].url, "router", r, body, rid, &via, &tv);
        if (!rc) rc = demo_ask(d->p[N_UNIFIED].url, "unified", r, body, rid, &ref, &tu);
        json_decref(body);
        if (rc) {
            *err = 1;
            cluster_answer_free(&via);
            continue;
        }
        if (i == 0) d->first_secs = tu;
        bool eq = cluster_answer_equal(&via, &ref);
        same += eq;
        printf("  [%zu] %-24s router %6.3f s  unified %6.3f s  %ld+%ld tokens  %s\n      ", i + 1,
               r->what, tv, tu, via.prompt_tokens, via.completion_tokens,
               eq ? "identical" : "DIFFERENT");
        print_text(via.text);
        if (!eq) {
            printf("      unified: ");
            print_text(ref.text);
        }
        cluster_answer_free(&via);
        cluster_answer_free(&ref);
    }
    return same;
}

/* A returning user: the unified node is restarted (SIGTERM, then a new process on the same
 * disk tier) and the first request asked again: its shared prefix comes back from disk, and
 * the answer must be the router's. True when it held. */
static bool demo_returning(demo_t *d)
{
    int code = launch_stop(&d->p[N_UNIFIED], SIGTERM, pkv_now_ns() + DEMO_STOP_NS);
    d->started[N_UNIFIED] = false;
    if (code != 0 || demo_start(d, N_UNIFIED) != 0) {
        printf("  returning user: the unified node did not restart (exit %d)  FAILED\n", code);
        return false;
    }
    const demo_req_t *r = &demo_reqs[0];
    json_t *body = demo_body(&d->o, r);
    cluster_answer_t via = {0}, ref = {0};
    double tv = 0, tu = 0;
    int rc = demo_ask(d->p[N_UNIFIED].url, "unified", r, body, "pagekv-demo-return", &ref, &tu);
    if (!rc) rc = demo_ask(d->p[N_ROUTER].url, "router", r, body, "pagekv-demo-return", &via, &tv);
    json_decref(body);
    bool ok = !rc && cluster_answer_equal(&via, &ref) && ref.cached_tokens_disk > 0;
    if (!rc)
        printf("  returning user after a restart: %ld of %ld prompt tokens served from disk, "
               "%.3f s (%.3f s the first time), %s\n",
               ref.cached_tokens_disk, ref.prompt_tokens, tu, d->first_secs,
               ok ? "identical to the router's answer" : "FAILED");
    cluster_answer_free(&via);
    cluster_answer_free(&ref);
    return ok;
}

/* ---- the accounting -------------------------------------------------------------------- */
static double mib(long long b)
{
    return b < 0 ? -1.0 : (double)b / (1024.0 * 1024.0);
}

/* The transfer phases a node reports in /metrics: the means of its
 * pagekv_kv_transfer_phase_seconds{phase="..."} histograms that counted something. */
static void demo_print_phases(const launch_proc_t *p)
{
    http_reply_t rep;
    if (http_call(p->url, "/metrics", NULL, NULL, 5000, NULL, &rep) != 0) return;
    static const char pre[] = "pagekv_kv_transfer_phase_seconds_sum{phase=\"";
    bool any = false;
    for (const char *l = strstr(rep.body, pre); l; l = strstr(l + 1, pre)) {
        const char *name = l + sizeof(pre) - 1, *q = strchr(name, '"');
        const char *brace = q ? strchr(q, '}') : NULL;
        if (!q || !brace) break;
        char key[128];
        snprintf(key, sizeof(key), "pagekv_kv_transfer_phase_seconds_count{phase=\"%.*s\"",
                 (int)(q - name), name);
        const char *c = strstr(rep.body, key);
        const char *cv = c ? strchr(c, ' ') : NULL;
        double total = strtod(brace + 1, NULL), cnt = cv ? strtod(cv, NULL) : 0;
        if (cnt > 0) {
            printf("%s %.*s %.2f", any ? "," : "           phases (mean ms):", (int)(q - name),
                   name, 1e3 * total / cnt);
            any = true;
        }
    }
    if (any) printf("\n");
    http_reply_free(&rep);
}

/* Print each node's figures and check that nothing is held; true if all hold. */
static bool demo_accounting(demo_t *d, uint32_t legs)
{
    bool ok = true;
    /* The last ACK may still be on its way: give the leases a moment to settle. */
    json_t *st[N_PROCS] = {0};
    for (uint64_t end = pkv_now_ns() + 3000000000ull;;) {
        for (int i = N_PREFILL; i <= N_DECODE; i++) {
            json_decref(st[i]);
            st[i] = http_get_json(d->p[i].url, "/v1/cache/stats", 5000);
        }
        long long live = cluster_json_int(st[N_PREFILL], "kv_transfer.leases.live");
        long long held =
            cluster_json_int(st[N_DECODE], "kv_transfer.staging.pages_held_by_transfers");
        if ((live == 0 && held == 0) || pkv_now_ns() > end || g_stop) break;
        struct timespec ts = {0, 50000000};
        nanosleep(&ts, NULL);
    }
    for (int i = 0; i < N_PROCS; i++) {
        const launch_proc_t *p = &d->p[i];
        printf("  %-8s VmRSS %7.1f MiB", demo_names[i], mib((long long)launch_rss(p)));
        if (i != N_PREFILL && i != N_DECODE) {
            printf("\n");
            continue;
        }
        const json_t *s = st[i];
        long long pinned = cluster_json_int(s, "kv_transfer.leases.pinned_blocks");
        long long held = cluster_json_int(s, "kv_transfer.staging.pages_held_by_transfers");
        printf("  staging %s resident %.2f MiB (peak %lld pages), held now %lld pages; pinned "
               "blocks %lld\n",
               d->o.staging, mib(cluster_json_int(s, "kv_transfer.staging.resident_bytes")),
               cluster_json_int(s, "kv_transfer.staging.pages_peak_used"), held, pinned);
        if (pinned != 0 || held != 0) ok = false;
        if (i == N_PREFILL) {
            long long sent = cluster_json_int(s, "kv_transfer.leases.sent");
            printf("           leases offered %lld, sent %lld, expired %lld; %.2f MiB sent\n",
                   cluster_json_int(s, "kv_transfer.leases.offered"), sent,
                   cluster_json_int(s, "kv_transfer.leases.expired"),
                   mib(cluster_json_int(s, "kv_transfer.transfers.bytes_sent")));
            if (sent != (long long)legs) ok = false;
        } else {
            long long failed = cluster_json_int(s, "kv_transfer.pulls.failed");
            long long recomputed = cluster_json_int(s, "kv_transfer.pulls.recomputed");
            long long local = cluster_json_int(s, "kv_transfer.pulls.local");
            long long pulled = cluster_json_int(s, "kv_transfer.pulls.ok"),
                      released = cluster_json_int(s, "kv_transfer.pulls.released");
            printf(
                "           pulls ok %lld, token-only releases %lld, failed %lld, recomputed %lld, "
                "without params %lld; blocks pulled %lld, adopted from its own cache %lld; "
                "%.2f MiB received\n",
                pulled, released, failed, recomputed, local,
                cluster_json_int(s, "kv_transfer.pulls.blocks_pulled"),
                cluster_json_int(s, "kv_transfer.pulls.blocks_adopted"),
                mib(cluster_json_int(s, "kv_transfer.transfers.bytes_received")));
            if (pulled + released != (long long)legs) ok = false;
            /* every request came with its params and was served from what it pulled */
            if (failed != 0 || recomputed != 0 || local != 0) ok = false;
        }
        demo_print_phases(p);
    }
    json_decref(st[N_PREFILL]);
    json_decref(st[N_DECODE]);
    return ok;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    return remove(path);
}

int pkv_cmd_demo(int argc, char **argv)
{
    demo_t d;
    memset(&d, 0, sizeof(d));
    int rc = parse(argc, argv, &d.o);
    if (rc >= 0) return rc;
    ssize_t bl = readlink("/proc/self/exe", d.bin, sizeof(d.bin) - 1);
    if (bl <= 0) {
        fprintf(stderr, "pagekv demo: cannot find this binary: %s\n", strerror(errno));
        return 2;
    }
    d.bin[bl] = '\0';
    snprintf(d.logdir, sizeof(d.logdir), "/tmp/pagekv-demo-XXXXXX");
    if (!mkdtemp(d.logdir)) {
        fprintf(stderr, "pagekv demo: cannot create a log directory: %s\n", strerror(errno));
        return 2;
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    struct sigaction old_int, old_term, old_pipe;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    sa.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &sa, &old_pipe);
    curl_global_init(CURL_GLOBAL_DEFAULT);

    printf("pagekv demo: prefill node, decode node and router as processes; model %s, %s "
           "staging%s%s\n",
           d.o.preset, d.o.staging, d.o.shared ? " (shared arena)" : "",
           d.o.tcp ? ", UCX over TCP" : "");
    uint64_t t0 = pkv_now_ns();
    rc = 0;
    for (int i = 0; i < N_PROCS && !rc && !g_stop; i++)
        if (demo_start(&d, i) != 0) rc = 2;
    uint32_t same = 0;
    bool held = false, stopped = false, returned = false;
    int req_err = 0;
    if (!rc && !g_stop) {
        printf("requests through the router (%zu), each compared with the unified node's answer:\n",
               N_REQS);
        same = demo_requests(&d, &req_err);
        if (!g_stop) {
            printf("accounting:\n");
            held = demo_accounting(&d, (uint32_t)N_REQS);
        }
        if (!g_stop) {
            printf("the disk tier (the unified node's --kv-disk-dir):\n");
            returned = demo_returning(&d);
        }
    }
    if (!rc || g_stop) printf("stopping:\n");
    stopped = demo_stop_all(&d, !rc);
    if (g_stop) {
        fprintf(stderr, "pagekv demo: interrupted; every process stopped\n");
        rc = 130;
    } else if (!rc) {
        bool all = same == N_REQS && !req_err && held && stopped && returned;
        printf("  result   %s: %u/%zu answers identical to the unified node's, %s, %s, %s "
               "(%.1f s)\n",
               all ? "ok" : "FAILED", same, N_REQS,
               held ? "every lease sent and nothing held" : "ACCOUNTING FAILED",
               returned ? "a returning prompt served from disk" : "DISK TIER FAILED",
               stopped ? "every process exited 0" : "A PROCESS FAILED",
               (double)(pkv_now_ns() - t0) / 1e9);
        rc = all ? 0 : 1;
    }
    if (rc == 0 && !d.o.keep_logs)
        nftw(d.logdir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
    else
        printf("logs: %s\n", d.logdir);
    curl_global_cleanup();
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    sigaction(SIGPIPE, &old_pipe, NULL);
    return rc;
}
