/*
 * pagekv bench tiers: the disk tier on the field's multi-round QA workload
 * (docs/design/bench_tiers.md). Options and the main loop; bench_tiers.h lists the files.
 *
 * For each workload (multiround, then tile) a reference pass on a server with ample KV and no
 * tier gives every answer, then the arms run on fresh servers with one small
 * --kv-cache-budget: recompute, disk, restart. The report prints each round, the targets
 * (met or not, with the cause), and writes --json and --svg.
 */
#include "bench_tiers.h"
#include "support/cli.h"
#include "support/footprint.h"
#include "support/launch.h"
#include "tools/commands.h"

#include "core/core.h"
#include "pagekv/model.h"

#include <curl/curl.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *const bt_cmd = "bench tiers";
static volatile sig_atomic_t bt_stop;

static void bt_on_signal(int sig)
{
    (void)sig;
    bt_stop = 1;
}

static void bt_usage(FILE *f)
{
    fprintf(f, "usage: pagekv bench tiers [options]\n"
               "The disk tier on the field's multi-round QA workload: a reference pass (ample KV,\n"
               "no tier), then arms on one small KV budget: recompute (no tier), disk (the tier),\n"
               "restart (the tier; SIGKILL after round R/2, a new server on the same directory);\n"
               "then the long-document tile order (D documents, each asked twice, 1..D 1..D).\n"
               "  --preset NAME          the servers' model preset (default llama-3.2-1b)\n"
               "  --users U              conversations, taking turns (default 8, at most 64)\n"
               "  --rounds R             rounds of each (default 6, 2..32)\n"
               "  --system-tokens N      the shared system prompt (default 1000)\n"
               "  --history-tokens N     each user's history to start (default 1500)\n"
               "  --question-tokens N    each question (default 32)\n"
               "  --out-tokens MIN-MAX   tokens out per answer (default 16-32)\n"
               "  --docs D               tile: documents (default 4; 0: no tile)\n"
               "  --doc-tokens N         tile: each document (default 4000)\n"
               "  --kv-budget BYTES      the arms' --kv-cache-budget (default 1.25 x the longest\n"
               "                         request's KV, whole 2 MiB\n"
               "                         granules)\n"
               "  --kv-disk-bytes BYTES  the disk arms' --kv-disk-bytes (default 1G)\n"
               "  --json FILE            every round of every arm, the targets\n"
               "  --svg FILE             TTFT per round, the arms side by side\n"
               "  --request-timeout S    per request (default 600)\n"
               "  --server-bin PATH      the pagekv binary to serve (default this one)\n"
               "  --keep-logs            keep the servers' logs (failed runs' too)\n"
               "pagekv bench tiers --startup [--records N] [--record-bytes B] [--runs R]\n"
               "                   [--dir DIR] [--drop-caches] [--json FILE]\n"
               "  what N records on disk (default 100000 of 4 KiB) add to the tier's open\n");
}

/* --out-tokens MIN-MAX. */
static int bt_parse_out(const char *v, bt_opts_t *o)
{
    unsigned lo, hi;
    char tail;
    if (sscanf(v, "%u-%u%c", &lo, &hi, &tail) != 2 || lo < 1 || lo > hi || hi > 4096)
        return pkv_cli_usage_error(bt_cmd,
                                   "--out-tokens: '%s' is not MIN-MAX, 1 <= MIN <= MAX "
                                   "<= 4096",
                                   v);
    o->out_min = lo;
    o->out_max = hi;
    return 0;
}

/* The options with a size or a count. 0, 1 when `a` is none of them, else the usage error's
 * exit code. */
static int bt_parse_number(const char *a, const char *v, bt_opts_t *o)
{
    if (!strcmp(a, "--users")) return pkv_cli_flag_u32(bt_cmd, a, v, 1, BT_MAX_USERS, &o->users);
    if (!strcmp(a, "--rounds")) return pkv_cli_flag_u32(bt_cmd, a, v, 2, BT_MAX_ROUNDS, &o->rounds);
    if (!strcmp(a, "--system-tokens"))
        return pkv_cli_flag_u32(bt_cmd, a, v, 0, 30000, &o->system_tokens);
    if (!strcmp(a, "--history-tokens"))
        return pkv_cli_flag_u32(bt_cmd, a, v, 1, 30000, &o->history_tokens);
    if (!strcmp(a, "--question-tokens"))
        return pkv_cli_flag_u32(bt_cmd, a, v, 1, 4096, &o->question_tokens);
    if (!strcmp(a, "--docs")) return pkv_cli_flag_u32(bt_cmd, a, v, 0, BT_MAX_USERS, &o->docs);
    if (!strcmp(a, "--doc-tokens")) return pkv_cli_flag_u32(bt_cmd, a, v, 1, 30000, &o->doc_tokens);
    if (!strcmp(a, "--out-tokens")) return bt_parse_out(v, o);
    if (!strcmp(a, "--kv-budget")) {
        if (pkv_cli_parse_bytes(v, &o->kv_budget) || o->kv_budget == 0)
            return pkv_cli_usage_error(bt_cmd, "--kv-budget: bad size '%s'", v);
        return 0;
    }
    if (!strcmp(a, "--kv-disk-bytes")) {
        if (pkv_cli_parse_bytes(v, &o->disk_bytes) || o->disk_bytes < (1ull << 20))
            return pkv_cli_usage_error(bt_cmd, "--kv-disk-bytes: '%s' is not a size >= 1M", v);
        return 0;
    }
    return 1;
}

static int bt_parse_valued(const char *a, const char *v, bt_opts_t *o)
{
    int rc = bt_parse_number(a, v, o);
    if (rc != 1) return rc;
    pkv_model_config_t mc;
    char *end;
    if (!strcmp(a, "--preset")) {
        if (pkv_model_preset(v, &mc))
            return pkv_cli_usage_error(bt_cmd, "--preset: unknown preset '%s'", v);
        o->preset = v;
    } else if (!strcmp(a, "--json")) {
        o->json_path = v;
    } else if (!strcmp(a, "--svg")) {
        o->svg_path = v;
    } else if (!strcmp(a, "--server-bin")) {
        o->server_bin = v;
    } else if (!strcmp(a, "--request-timeout")) {
        o->request_timeout_s = strtod(v, &end);
        if (*end || end == v || !isfinite(o->request_timeout_s) || o->request_timeout_s <= 0 ||
            o->request_timeout_s > 86400)
            return pkv_cli_usage_error(bt_cmd, "--request-timeout: bad seconds '%s'", v);
    } else {
        return pkv_cli_usage_error(bt_cmd, "unknown option '%s' (try --help)", a);
    }
    return 0;
}

/* Options that depend on each other. 0, or the usage error's exit code. */
static int bt_check_opts(bt_opts_t *o)
{
    pkv_model_config_t mc;
    pkv_model_preset(o->preset, &mc);
    uint32_t longest = bt_longest_tokens(o);
    if (longest + 256 > mc.max_seq_len)
        return pkv_cli_usage_error(bt_cmd,
                                   "the longest request (~%u tokens) does not fit the %s "
                                   "preset's %u-token context",
                                   longest, o->preset, mc.max_seq_len);
    uint64_t need = bt_token_bytes(o->preset) * longest;
    if (!o->kv_budget) o->kv_budget = bt_budget_default(o);
    if (o->kv_budget < need || o->kv_budget < BT_GRANULE)
        return pkv_cli_usage_error(bt_cmd,
                                   "--kv-budget %llu holds less than the longest request (~%u "
                                   "tokens, %llu bytes) or one 2 MiB granule",
                                   (unsigned long long)o->kv_budget, longest,
                                   (unsigned long long)need);
    if (o->server_bin && access(o->server_bin, X_OK))
        return pkv_cli_usage_error(bt_cmd, "--server-bin: '%s' is not executable", o->server_bin);
    return 0;
}

/* 0: run; 1: --help printed; otherwise the usage error's exit code. */
static int bt_parse_opts(int argc, char **argv, bt_opts_t *o)
{
    *o = (bt_opts_t){.preset = "llama-3.2-1b",
                     .users = 8,
                     .rounds = 6,
                     .system_tokens = 1000,
                     .history_tokens = 1500,
                     .question_tokens = 32,
                     .out_min = 16,
                     .out_max = 32,
                     .docs = 4,
                     .doc_tokens = 4000,
                     .disk_bytes = 1ull << 30,
                     .request_timeout_s = 600};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bt_usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--keep-logs")) {
            o->keep_logs = true;
            continue;
        }
        if (strncmp(a, "--", 2))
            return pkv_cli_usage_error(bt_cmd, "unexpected argument '%s' (try --help)", a);
        if (!v) return pkv_cli_usage_error(bt_cmd, "unknown option or missing value: '%s'", a);
        i++;
        int rc = bt_parse_valued(a, v, o);
        if (rc) return rc;
    }
    return bt_check_opts(o);
}

/* One workload: the reference, then the arms (none when the reference failed). */
static int bt_part_run(const bt_env_t *e, bt_part_t *p)
{
    int failed = 0;
    for (int k = 0; k < BT_ARMS; k++) {
        if (bt_stop || (k > BT_REF && !p->arm[BT_REF].ok)) break;
        bt_arm_t *a = &p->arm[k];
        fprintf(stderr, "%s %s: starting\n", p->w.name, bt_arm_names[k]);
        bt_arm_run(e, &p->w, k, a);
        if (a->ok)
            fprintf(stderr, "%s %s: %u/%u answers identical, %.1f s\n", p->w.name, bt_arm_names[k],
                    a->identical, a->requests, a->wall_s);
        else
            fprintf(stderr, "%s %s: FAILED: %s\n", p->w.name, bt_arm_names[k], a->error), failed++;
    }
    return failed;
}

/* Set up the environment: the binary, the temporary directory, signals. 0 or -1. */
static int bt_env_init(bt_env_t *e, const bt_opts_t *o)
{
    memset(e, 0, sizeof(*e));
    e->o = o;
    e->stop = &bt_stop;
    snprintf(e->dir, sizeof(e->dir), "/tmp/pagekv-bench-tiers-XXXXXX");
    if (launch_env_init(e->bin, sizeof(e->bin), e->dir, bt_on_signal)) return -1;
    if (o->server_bin) snprintf(e->bin, sizeof(e->bin), "%s", o->server_bin);
    e->cpt = pkv_fp_chars_per_token();
    e->budget = o->kv_budget;
    e->max_context = (bt_longest_tokens(o) + 256 + 255) / 256 * 256;
    return 0;
}

int pkv_bench_tiers(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--startup")) return pkv_bench_tier_startup(argc, argv);
    bt_opts_t o;
    int prc = bt_parse_opts(argc, argv, &o);
    if (prc) return prc == 1 ? 0 : prc;
    bt_env_t e;
    if (curl_global_init(CURL_GLOBAL_DEFAULT) || bt_env_init(&e, &o)) return 1;
    double ws = (double)bt_working_set_bytes(&o) / (double)e.budget;
    fprintf(stderr,
            "bench tiers: %s, %u users x %u rounds, KV budget %.0f MiB (the multi-round working "
            "set ~%.1f x it), disk cap %.0f MiB, temporary directory %s\n",
            o.preset, o.users, o.rounds, (double)e.budget / 1048576.0, ws,
            (double)o.disk_bytes / 1048576.0, e.dir);
    if (ws < 2)
        fprintf(stderr, "bench tiers: the working set is under 2 x the budget: most returning "
                        "users stay in memory and the disk arm has little to load (more --users "
                        "or a smaller --kv-budget)\n");
    static bt_part_t mr, tile;
    uint64_t t0 = pkv_now_ns();
    int failed = 0;
    if (bt_work_multiround(&e, &mr.w) || (o.docs && bt_work_tile(&e, &tile.w))) {
        fprintf(stderr, "pagekv bench tiers: out of memory\n");
        failed++;
    }
    if (!failed) failed += bt_part_run(&e, &mr);
    if (!failed && o.docs) failed += bt_part_run(&e, &tile);
    double wall = (double)(pkv_now_ns() - t0) / 1e9;
    bt_target_t t[BT_N_TARGETS];
    bt_targets(&e, &mr, o.docs ? &tile : NULL, t);
    bt_print_report(&e, &mr, o.docs ? &tile : NULL, t);
    int rc = bt_stop ? 130 : failed ? 1 : 0; /* 130: interrupted, as a shell reports it */
    if (o.json_path && bt_write_json(&e, &mr, o.docs ? &tile : NULL, t, wall)) rc = 1;
    if (o.svg_path && bt_write_svg(&e, &mr)) rc = 1;
    bt_env_cleanup(&e, o.keep_logs || failed);
    for (int k = 0; k < BT_ARMS; k++) bt_arm_free(&mr.arm[k]), bt_arm_free(&tile.arm[k]);
    bt_work_free(&mr.w);
    bt_work_free(&tile.w);
    curl_global_cleanup();
    return rc;
}
