/*
 * pagekv plan: the memory each KV design needs, from a model's KV geometry and a
 * deployment, per rank and per host (the arithmetic is src/plan/; docs/design/plan.md).
 *
 *   pagekv plan (--preset NAME | --layers N --kv-heads N --head-dim N) [--kv-dtype D]
 *               [--tp N | --prefill-tp N --decode-tp N] [--ranks-per-host N]
 *               [--page-tokens N] [--context T] [--concurrency N] [--mix T:W,...]
 *               [--in-flight N] [--long T[:COUNT]]... [--device-pool BYTES]
 *               [--table field] [--json FILE]
 *
 * A Markdown table on stdout; --json FILE writes the same figures. Bad input: a message
 * on stderr and exit 2. With a scaled KV dtype (int8, fp8: each row is head_dim one-byte
 * codes and a 4-byte f32 scale) the output also prints the bytes of a row, a token and a
 * page beside bf16's, and the field table a bf16 row before each of the dtype's.
 */
#include "support/cli.h"
#include "support/report.h"
#include "tools/commands.h"

#include "pagekv/model.h"
#include "plan/plan.h"

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CMD "plan"
/* pagekv serve's --block-tokens default: what its decode node pulls in */
#define PLAN_PULL_BLOCK_TOKENS 16

typedef struct {
    pkv_plan_input_t in;
    const char *preset, *json, *table;
    bool layers_set, heads_set, dim_set, tp_set, ptp_set, dtp_set, context_set, load_set, conc_set;
} plan_opts_t;

static void usage(void)
{
    fprintf(stderr,
            "usage: pagekv plan (--preset NAME | --layers N --kv-heads N --head-dim N)\n"
            "         [--kv-dtype f32|f16|bf16|int8|fp8] [--tp N | --prefill-tp N --decode-tp N]\n"
            "         [--ranks-per-host N] [--page-tokens N] [--context T] [--concurrency N]\n"
            "         [--mix T:W,...] [--mix-of in-flight|requests] [--in-flight N]\n"
            "         [--long T[:COUNT]]...\n"
            "         [--pull-block-tokens N] [--device-pool BYTES] [--table field]\n"
            "         [--json FILE]\n"
            "token counts take K / M suffixes (x 1024): 8k, 128k, 1M\n"
            "defaults: bf16, TP 1, ranks per host = TP, 64-token pages, context = the longest of\n"
            "  the mix and --long (else 8k), concurrency 64, in flight = concurrency, mix = the\n"
            "  context alone, device pool = concurrency x context\n"
            "--kv-dtype D (or --dtype D): the KV's format; int8 and fp8 (e4m3) rows are head_dim\n"
            "  one-byte codes + a 4-byte f32 scale, printed beside bf16 (bytes per token and per\n"
            "  page; with --table field a bf16 row before each of theirs, and the ratios)\n"
            "--pull-block-tokens N: a transfer moves the whole N-token blocks before the\n"
            "  prompt's last token, as pagekv's decode node pulls them (pagekv serve\n"
            "  --block-tokens; default 16); 0: every token, as the field's connectors do\n"
            "--mix-of requests: the mix counts requests sent; a transfer is caught in flight\n"
            "  in proportion to its pages (its time in flight), so the in-flight draw weighs\n"
            "  each entry by weight x pages; in-flight (default): the mix is of transfers in\n"
            "  flight, as the field's table counts\n"
            "--table field: the second field report's rows at 8k / 128k / 1M (geometry flags\n"
            "  only; default gpt-oss-120b at TP8)\n"
            "presets: gpt-oss-120b");
    for (const char *const *n = pkv_model_preset_names(); *n; n++) fprintf(stderr, " %s", *n);
    fprintf(stderr, "\n");
}

/* ---- parsing ------------------------------------------------------------------------ */

static int parse_tokens(const char *s, uint64_t *out)
{
    return pkv_cli_parse_bytes(s, out);
}

/* "T:W,T:W,..." (W defaults to 1). */
static int parse_mix(const char *v, pkv_plan_input_t *in)
{
    char buf[1024];
    if (strlen(v) >= sizeof(buf)) return pkv_cli_usage_error(CMD, "--mix: too long");
    snprintf(buf, sizeof(buf), "%s", v);
    in->n_mix = 0;
    for (char *save = NULL, *e = strtok_r(buf, ",", &save); e; e = strtok_r(NULL, ",", &save)) {
        if (in->n_mix == PKV_PLAN_MAX_MIX)
            return pkv_cli_usage_error(CMD, "--mix: at most %d entries", PKV_PLAN_MAX_MIX);
        pkv_plan_mix_t *m = &in->mix[in->n_mix++];
        char *colon = strchr(e, ':');
        if (colon) *colon = '\0';
        m->weight = 1;
        if (parse_tokens(e, &m->tokens) ||
            (colon && pkv_cli_parse_u64(colon + 1, 0, UINT64_MAX, &m->weight)))
            return pkv_cli_usage_error(CMD, "--mix: entries are TOKENS[:WEIGHT], got '%s'", v);
    }
    if (!in->n_mix) return pkv_cli_usage_error(CMD, "--mix: empty");
    return 0;
}

static int parse_long(const char *v, pkv_plan_input_t *in)
{
    if (in->n_long == PKV_PLAN_MAX_LONG)
        return pkv_cli_usage_error(CMD, "--long: at most %d", PKV_PLAN_MAX_LONG);
    char buf[128];
    snprintf(buf, sizeof(buf), "%s", v);
    pkv_plan_long_t *l = &in->longs[in->n_long++];
    char *colon = strchr(buf, ':');
    if (colon) *colon = '\0';
    l->count = 1;
    if (strlen(v) >= sizeof(buf) || parse_tokens(buf, &l->tokens) ||
        (colon && pkv_cli_parse_u64(colon + 1, 0, UINT64_MAX, &l->count)))
        return pkv_cli_usage_error(CMD, "--long: CONTEXT[:COUNT], got '%s'", v);
    return 0;
}

/* Geometry and deployment flags (allowed with --table field too). -1: not one of them. */
static int set_geometry(plan_opts_t *o, const char *a, const char *v)
{
    pkv_plan_input_t *in = &o->in;
    uint32_t tp = 0;
    if (!strcmp(a, "--preset")) {
        o->preset = v;
        return 0;
    } else if (!strcmp(a, "--layers")) {
        o->layers_set = true;
        return pkv_cli_flag_u32(CMD, a, v, 0, UINT32_MAX, &in->layers);
    } else if (!strcmp(a, "--kv-heads")) {
        o->heads_set = true;
        return pkv_cli_flag_u32(CMD, a, v, 0, UINT32_MAX, &in->kv_heads);
    } else if (!strcmp(a, "--head-dim")) {
        o->dim_set = true;
        return pkv_cli_flag_u32(CMD, a, v, 0, UINT32_MAX, &in->head_dim);
    } else if (!strcmp(a, "--kv-dtype") || !strcmp(a, "--dtype")) {
        if (pkv_dtype_parse(v, &in->dtype))
            return pkv_cli_usage_error(CMD,
                                       "%s: one of f32, f16, bf16, int8, fp8 (or fp8_e4m3), "
                                       "got '%s'",
                                       a, v);
        return 0;
    } else if (!strcmp(a, "--tp")) {
        o->tp_set = true;
        int rc = pkv_cli_flag_u32(CMD, a, v, 0, UINT32_MAX, &tp);
        in->prefill_tp = in->decode_tp = tp;
        return rc;
    } else if (!strcmp(a, "--prefill-tp")) {
        o->ptp_set = true;
        return pkv_cli_flag_u32(CMD, a, v, 0, UINT32_MAX, &in->prefill_tp);
    } else if (!strcmp(a, "--decode-tp")) {
        o->dtp_set = true;
        return pkv_cli_flag_u32(CMD, a, v, 0, UINT32_MAX, &in->decode_tp);
    } else if (!strcmp(a, "--ranks-per-host")) {
        int rc = pkv_cli_flag_u32(CMD, a, v, 0, UINT32_MAX, &in->ranks_per_host);
        if (!rc && !in->ranks_per_host)
            return pkv_cli_usage_error(CMD, "--ranks-per-host: at least 1");
        return rc;
    } else if (!strcmp(a, "--page-tokens")) {
        if (parse_tokens(v, &in->page_tokens) || !in->page_tokens)
            return pkv_cli_usage_error(CMD, "--page-tokens: at least 1, got '%s'", v);
        return 0;
    }
    return -1;
}

/* The load flags (not with --table field). -1: not one of them. */
static int set_load(plan_opts_t *o, const char *a, const char *v)
{
    pkv_plan_input_t *in = &o->in;
    int rc = -1;
    if (!strcmp(a, "--context")) {
        o->context_set = true;
        rc = parse_tokens(v, &in->context)
                 ? pkv_cli_usage_error(CMD, "--context: tokens, got '%s'", v)
                 : 0;
    } else if (!strcmp(a, "--concurrency")) {
        o->conc_set = true;
        rc = pkv_cli_parse_u64(v, 0, UINT64_MAX, &in->concurrency)
                 ? pkv_cli_usage_error(CMD, "--concurrency: an integer, got '%s'", v)
                 : 0;
    } else if (!strcmp(a, "--in-flight")) {
        in->in_flight_set = true;
        rc = pkv_cli_parse_u64(v, 0, UINT64_MAX, &in->in_flight)
                 ? pkv_cli_usage_error(CMD, "--in-flight: an integer, got '%s'", v)
                 : 0;
    } else if (!strcmp(a, "--mix")) {
        rc = parse_mix(v, in);
    } else if (!strcmp(a, "--mix-of")) {
        in->mix_of_requests = !strcmp(v, "requests");
        rc = in->mix_of_requests || !strcmp(v, "in-flight")
                 ? 0
                 : pkv_cli_usage_error(CMD, "--mix-of: requests or in-flight, got '%s'", v);
    } else if (!strcmp(a, "--long")) {
        rc = parse_long(v, in);
    } else if (!strcmp(a, "--pull-block-tokens")) {
        rc = pkv_cli_parse_u64(v, 0, UINT32_MAX, &in->pull_block_tokens)
                 ? pkv_cli_usage_error(CMD, "--pull-block-tokens: 0..%u, got '%s'", UINT32_MAX, v)
                 : 0;
    } else if (!strcmp(a, "--device-pool")) {
        rc = pkv_cli_parse_bytes(v, &in->device_pool_bytes) || !in->device_pool_bytes
                 ? pkv_cli_usage_error(CMD, "--device-pool: bytes (e.g. 56.5G), got '%s'", v)
                 : 0;
    }
    if (rc != -1) o->load_set = true;
    return rc;
}

/* Defaults that depend on several flags, and the geometry from the preset. */
static int finish_opts(plan_opts_t *o)
{
    pkv_plan_input_t *in = &o->in, g = *in;
    bool field = o->table != NULL;
    if (field && strcmp(o->table, "field"))
        return pkv_cli_usage_error(CMD, "--table: only 'field', got '%s'", o->table);
    if (field && o->load_set)
        return pkv_cli_usage_error(CMD, "--table field fixes the load; give geometry flags only");
    if (o->tp_set && (o->ptp_set || o->dtp_set))
        return pkv_cli_usage_error(CMD, "give --tp or --prefill-tp / --decode-tp, not both");
    if (o->ptp_set != o->dtp_set)
        return pkv_cli_usage_error(CMD, "--prefill-tp and --decode-tp go together");
    if (!o->preset && field && !o->layers_set && !o->heads_set && !o->dim_set)
        o->preset = "gpt-oss-120b";
    if (o->preset) {
        if (pkv_plan_preset(o->preset, in))
            return pkv_cli_usage_error(CMD, "--preset: unknown '%s' (see --help)", o->preset);
        in->dtype = g.dtype; /* flags override the preset */
        if (o->layers_set) in->layers = g.layers;
        if (o->heads_set) in->kv_heads = g.kv_heads;
        if (o->dim_set) in->head_dim = g.head_dim;
    } else if (!o->layers_set || !o->heads_set || !o->dim_set) {
        return pkv_cli_usage_error(CMD, "give --preset NAME or all of --layers, --kv-heads, "
                                        "--head-dim");
    }
    if (!o->tp_set && !o->ptp_set) in->prefill_tp = in->decode_tp = field ? 8 : 1;
    if (!o->context_set) {
        in->context = 0;
        for (uint32_t i = 0; i < in->n_mix; i++)
            if (in->mix[i].tokens > in->context) in->context = in->mix[i].tokens;
        for (uint32_t i = 0; i < in->n_long; i++)
            if (in->longs[i].tokens > in->context) in->context = in->longs[i].tokens;
        if (!in->context) in->context = 8192;
    }
    if (!o->conc_set) in->concurrency = 64;
    return 0;
}

#define PROCEED (-1)

static int parse_args(int argc, char **argv, plan_opts_t *o)
{
    memset(o, 0, sizeof(*o));
    o->in.dtype = PKV_DTYPE_BF16;
    o->in.pull_block_tokens = PLAN_PULL_BLOCK_TOKENS;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        }
        if (!v) return pkv_cli_usage_error(CMD, "%s: unknown option or missing value", a);
        int rc = set_geometry(o, a, v);
        if (rc == -1) rc = set_load(o, a, v);
        if (rc == -1 && !strcmp(a, "--json")) o->json = v, rc = 0;
        if (rc == -1 && !strcmp(a, "--table")) o->table = v, rc = 0;
        if (rc == -1) return pkv_cli_usage_error(CMD, "unknown option '%s' (see --help)", a);
        if (rc) return rc;
        i++;
    }
    int rc = finish_opts(o);
    return rc ? rc : PROCEED;
}

/* ---- output ------------------------------------------------------------------------- */

/* "0.5625 MiB", "4.588 GiB", "4608 GiB": KiB below 512 KiB, MiB below 1 GiB, else GiB. */
static const char *fmt_bytes(uint64_t b, char buf[32])
{
    static const char *const unit[] = {"KiB", "MiB", "GiB"};
    double v = (double)b;
    int u = b < 512 * 1024ull ? 0 : b < (1ull << 30) ? 1 : 2;
    if (b < 1024) {
        snprintf(buf, 32, "%llu B", (unsigned long long)b);
        return buf;
    }
    v /= (double)(1ull << (10 * (u + 1)));
    snprintf(buf, 32, v >= 10000 ? "%.0f %s" : "%.4g %s", v, unit[u]);
    return buf;
}

static const char *fmt_ratio(double r, char buf[32])
{
    snprintf(buf, 32, r > 0 ? "%.3gx" : "-", r);
    return buf;
}

static json_t *jbytes(uint64_t v)
{
    return v <= (uint64_t)INT64_MAX ? json_integer((json_int_t)v) : json_real((double)v);
}

static void geometry_line(const pkv_plan_input_t *in, const char *preset)
{
    printf("geometry: %s%s%u layers, %u KV heads x %u, %s\n", preset ? preset : "",
           preset ? ": " : "", in->layers, in->kv_heads, in->head_dim, pkv_dtype_name(in->dtype));
}

/* Bad input is a usage error (exit 2); anything else (out of memory) exits 1. */
static int plan_error(int rc, const char *err)
{
    if (rc == PKV_ERR_INVALID) return pkv_cli_usage_error(CMD, "%s", err);
    fprintf(stderr, "pagekv %s: %s\n", CMD, err);
    return 1;
}

/* A scaled dtype's row beside bf16's: "head_dim 64 x 1 B + 4-byte scale = 68 B". */
static void print_row_bytes(const pkv_plan_input_t *in)
{
    size_t row = pkv_dtype_row_bytes(in->dtype, in->head_dim);
    size_t bf = pkv_dtype_row_bytes(PKV_DTYPE_BF16, in->head_dim);
    char q[32];
    printf("KV bytes, %s: a row (one token's one KV head) = head_dim %u x %zu B + %zu-byte scale "
           "= %zu B; bf16: %u x 2 B = %zu B (%s / bf16 = %s)\n",
           pkv_dtype_name(in->dtype), in->head_dim, pkv_dtype_size(in->dtype),
           row - (size_t)in->head_dim * pkv_dtype_size(in->dtype), row, in->head_dim, bf,
           pkv_dtype_name(in->dtype), fmt_ratio((double)row / (double)bf, q));
}

/* One rank's bytes per token and per page at the scaled dtype and at bf16. */
static void print_rank_bytes(const char *rank, const pkv_plan_input_t *in, uint64_t heads,
                             uint64_t token, uint64_t page, uint64_t bf_token, uint64_t bf_page)
{
    char b[4][32];
    const char *h = heads == 1 ? "" : "s";
    printf("%s (%llu KV head%s): %llu B (%s) per token = %u layers x K,V x %llu head%s x %zu B, "
           "%llu B (%s) per %llu-token page; bf16: %llu B (%s), %llu B (%s)\n",
           rank, (unsigned long long)heads, h, (unsigned long long)token, fmt_bytes(token, b[0]),
           in->layers, (unsigned long long)heads, h, pkv_dtype_row_bytes(in->dtype, in->head_dim),
           (unsigned long long)page, fmt_bytes(page, b[1]), (unsigned long long)(page / token),
           (unsigned long long)bf_token, fmt_bytes(bf_token, b[2]), (unsigned long long)bf_page,
           fmt_bytes(bf_page, b[3]));
}

/* One row of the field table. Beside bf16 (`dt` set): the dtype column and the ratios to
 * `bf`, the bf16 row of the same context (NULL on that row itself). */
static void field_row_print(const pkv_plan_field_row_t *r, const char *dt,
                            const pkv_plan_field_row_t *bf)
{
    char b[6][32], q[4][32];
    printf("| %llu |", (unsigned long long)r->context_tokens);
    if (dt) printf(" %s |", dt);
    printf(" %s | %s | %s | %s | %s | %s | %s |", fmt_bytes(r->page_bytes_per_rank, b[0]),
           fmt_bytes(r->fixed_host_bytes, b[1]), fmt_bytes(r->per_transfer_host_bytes, b[2]),
           fmt_ratio((double)r->fixed_host_bytes / (double)r->per_transfer_host_bytes, q[0]),
           fmt_bytes(r->mirror_host_bytes, b[3]), fmt_bytes(r->per_plan_host_bytes, b[4]),
           fmt_ratio((double)r->mirror_host_bytes / (double)r->per_plan_host_bytes, q[1]));
    if (dt) {
        const pkv_plan_field_row_t *d = bf ? bf : r;
        printf(" %s | %s |",
               fmt_ratio((double)r->fixed_host_bytes / (double)d->fixed_host_bytes, q[2]),
               fmt_ratio((double)r->per_transfer_host_bytes / (double)d->per_transfer_host_bytes,
                         q[3]));
    }
    printf(" %s |\n", bf ? "the same load" : r->assumptions);
}

/* The row's JSON: the report's seven keys, and beside bf16 the dtype, the token's bytes
 * and (on the scaled dtype's rows) the ratios to the bf16 row `bf`. */
static json_t *field_row_json(const pkv_plan_field_row_t *r, const char *dt,
                              const pkv_plan_field_row_t *bf)
{
    json_t *j = json_pack(
        "{s:o, s:o, s:o, s:o, s:o, s:o, s:s}", "context_tokens", jbytes(r->context_tokens),
        "page_bytes_per_rank", jbytes(r->page_bytes_per_rank), "fixed_host_bytes",
        jbytes(r->fixed_host_bytes), "per_transfer_host_bytes", jbytes(r->per_transfer_host_bytes),
        "mirror_host_bytes", jbytes(r->mirror_host_bytes), "per_plan_host_bytes",
        jbytes(r->per_plan_host_bytes), "assumptions", r->assumptions);
    if (dt) {
        json_object_set_new(j, "dtype", json_string(dt));
        json_object_set_new(j, "token_bytes_per_rank", jbytes(r->token_bytes_per_rank));
    }
    if (bf) {
        json_object_set_new(j, "fixed_over_bf16",
                            json_real((double)r->fixed_host_bytes / (double)bf->fixed_host_bytes));
        json_object_set_new(
            j, "per_transfer_over_bf16",
            json_real((double)r->per_transfer_host_bytes / (double)bf->per_transfer_host_bytes));
        json_object_set_new(
            j, "per_plan_over_bf16",
            json_real((double)r->per_plan_host_bytes / (double)bf->per_plan_host_bytes));
    }
    return j;
}

/* The field rows at the chosen dtype, and at bf16 into `bf` when the dtype is scaled. */
static int field_rows(const pkv_plan_input_t *in, pkv_plan_field_row_t *rows,
                      pkv_plan_field_row_t *bf)
{
    char err[PKV_PLAN_ERR_LEN];
    pkv_plan_input_t g = *in;
    g.dtype = PKV_DTYPE_BF16;
    int prc = pkv_plan_field(in, rows, err, sizeof(err));
    if (prc) return plan_error(prc, err);
    if (pkv_dtype_scaled(in->dtype) && (prc = pkv_plan_field(&g, bf, err, sizeof(err)))) {
        char why[PKV_PLAN_ERR_LEN + 32];
        snprintf(why, sizeof(why), "at bf16 (printed beside): %s", err);
        return plan_error(prc, why);
    }
    return 0;
}

static int run_field(const plan_opts_t *o)
{
    pkv_plan_field_row_t rows[PKV_PLAN_FIELD_ROWS], bf[PKV_PLAN_FIELD_ROWS];
    const pkv_plan_input_t *in = &o->in;
    bool beside = pkv_dtype_scaled(in->dtype);
    const char *dt = beside ? pkv_dtype_name(in->dtype) : NULL;
    int rc = field_rows(in, rows, bf);
    if (rc) return rc;
    uint32_t rph = in->ranks_per_host ? in->ranks_per_host : in->decode_tp;
    uint64_t page_tokens = in->page_tokens ? in->page_tokens : 64;
    printf("## pagekv plan --table field\n\n");
    geometry_line(in, o->preset);
    if (beside) {
        uint64_t t = rows[0].token_bytes_per_rank;
        print_row_bytes(in);
        print_rank_bytes("per decode rank", in,
                         t / (2ull * in->layers * pkv_dtype_row_bytes(in->dtype, in->head_dim)), t,
                         rows[0].page_bytes_per_rank, bf[0].token_bytes_per_rank,
                         bf[0].page_bytes_per_rank);
    }
    printf("TP %u (prefill) / %u (decode), %u ranks per host, %llu-token pages; per host%s%s\n\n",
           in->prefill_tp, in->decode_tp, rph, (unsigned long long)page_tokens,
           beside ? "; each context at bf16, then at " : "", dt ? dt : "");
    printf("| context |%s page per rank | fixed slots | per-transfer | fixed / per-transfer | "
           "host mirror | per-plan | mirror / per-plan |%s assumptions |\n"
           "|---:|%s---:|---:|---:|---:|---:|---:|---:|%s---|\n",
           beside ? " KV dtype |" : "", beside ? " fixed vs bf16 | per-transfer vs bf16 |" : "",
           beside ? "---|" : "", beside ? "---:|---:|" : "");
    json_t *jr = json_array(), *jb = json_array();
    for (int i = 0; i < PKV_PLAN_FIELD_ROWS; i++) {
        if (beside) {
            field_row_print(&bf[i], "bf16", NULL);
            json_array_append_new(jb, field_row_json(&bf[i], "bf16", NULL));
        }
        field_row_print(&rows[i], dt, beside ? &bf[i] : NULL);
        json_array_append_new(jr, field_row_json(&rows[i], dt, beside ? &bf[i] : NULL));
    }
    json_t *root = json_pack("{s:o}", "rows", jr);
    if (beside) {
        json_object_set_new(root, "dtype", json_string(dt));
        json_object_set_new(root, "row_bytes",
                            jbytes(pkv_dtype_row_bytes(in->dtype, in->head_dim)));
        json_object_set_new(root, "bf16_row_bytes",
                            jbytes(pkv_dtype_row_bytes(PKV_DTYPE_BF16, in->head_dim)));
        json_object_set_new(root, "bf16_rows", jb);
    } else {
        json_decref(jb);
    }
    if (o->json && pkv_report_write_json(CMD, o->json, root)) rc = 1;
    json_decref(root);
    return rc;
}

/* Defined below: the plan's Markdown and JSON (`bf`: the same plan at bf16 beside a scaled
 * dtype's, or NULL). */
static void print_plan(const plan_opts_t *o, const pkv_plan_t *p, const pkv_plan_t *bf);
static json_t *plan_json(const pkv_plan_t *p, const pkv_plan_t *bf);

int pkv_cmd_plan(int argc, char **argv)
{
    plan_opts_t o;
    int rc = parse_args(argc, argv, &o);
    if (rc != PROCEED) return rc;
    if (o.table) return run_field(&o);
    bool beside = pkv_dtype_scaled(o.in.dtype);
    pkv_plan_t *p = malloc(sizeof(*p)), *bf = beside ? malloc(sizeof(*bf)) : NULL;
    if (!p || (beside && !bf)) {
        free(p);
        free(bf);
        return fprintf(stderr, "pagekv plan: out of memory\n"), 1;
    }
    int prc = pkv_plan_compute(&o.in, p);
    if (!prc && beside) {
        pkv_plan_input_t g = o.in;
        g.dtype = PKV_DTYPE_BF16;
        if ((prc = pkv_plan_compute(&g, bf)))
            snprintf(p->err, sizeof(p->err), "at bf16 (printed beside): %.150s", bf->err);
    }
    if (prc) {
        rc = plan_error(prc, p->err);
        goto out;
    }
    print_plan(&o, p, bf);
    if (o.json) {
        json_t *root = plan_json(p, bf);
        if (pkv_report_write_json(CMD, o.json, root)) rc = 1;
        json_decref(root);
    }
out:
    free(bf);
    free(p);
    return rc == PROCEED ? 0 : rc;
}

/* ---- the plan's table ------------------------------------------------------------------ */

typedef struct {
    const char *label;
    size_t off; /* offsetof(pkv_plan_bytes_t, field), or SIZE_MAX for a ratio row */
    size_t num, den;
} plan_row_t;

#define BYTES_ROW(label, f)                                                                        \
    {                                                                                              \
        label, offsetof(pkv_plan_bytes_t, f), 0, 0                                                 \
    }
#define RATIO_ROW(label, a, b)                                                                     \
    {                                                                                              \
        label, SIZE_MAX, offsetof(pkv_plan_bytes_t, a), offsetof(pkv_plan_bytes_t, b)              \
    }

static const plan_row_t plan_rows[] = {
    BYTES_ROW("KV per token", token_bytes),
    BYTES_ROW("KV per page", page_bytes),
    BYTES_ROW("device pool", device_pool_bytes),
    BYTES_ROW("fixed-slot staging (slots x longest context)", fixed_bytes),
    BYTES_ROW("per-transfer staging, mean", per_transfer_mean_bytes),
    BYTES_ROW("per-transfer staging, tail (exceeded 1e-5 of the time)", per_transfer_tail_bytes),
    RATIO_ROW("fixed / per-transfer (mean)", fixed_bytes, per_transfer_mean_bytes),
    BYTES_ROW("resharding: host mirror of the device pool", mirror_bytes),
    BYTES_ROW("resharding: per-plan staging of the head slices in flight", per_plan_bytes),
    RATIO_ROW("mirror / per-plan", mirror_bytes, per_plan_bytes),
    BYTES_ROW("paged pool growth peak (live + < 1 granule per range)", paged_peak_bytes),
    BYTES_ROW("copy-on-grow pool peak (pool x 2, + weights not counted)", copy_grow_bytes),
    RATIO_ROW("copy-on-grow / paged", copy_grow_bytes, paged_peak_bytes),
};

static uint64_t field_at(const pkv_plan_bytes_t *b, size_t off)
{
    uint64_t v;
    memcpy(&v, (const char *)b + off, sizeof(v));
    return v;
}

static void print_cell(const pkv_plan_bytes_t *b, const plan_row_t *r)
{
    char buf[32];
    if (r->off != SIZE_MAX) {
        printf(" %s |", fmt_bytes(field_at(b, r->off), buf));
    } else {
        uint64_t d = field_at(b, r->den);
        printf(" %s |", fmt_ratio(d ? (double)field_at(b, r->num) / (double)d : 0, buf));
    }
}

static void print_load(const pkv_plan_input_t *in, const pkv_plan_t *p)
{
    printf("load: context %llu, %llu-way concurrency (%llu fixed slots of %llu pages), %llu "
           "transfers in flight of the %s",
           (unsigned long long)in->context, (unsigned long long)in->concurrency,
           (unsigned long long)in->concurrency, (unsigned long long)p->decode.slot_pages,
           (unsigned long long)in->in_flight,
           in->mix_of_requests ? "requests' mix (each weighed by its pages in flight)" : "mix");
    for (uint32_t i = 0; i < in->n_mix; i++)
        printf("%s%llu:%llu", i ? "," : " ", (unsigned long long)in->mix[i].tokens,
               (unsigned long long)in->mix[i].weight);
    for (uint32_t i = 0; i < in->n_long; i++)
        printf(" + %llu x %llu", (unsigned long long)in->longs[i].count,
               (unsigned long long)in->longs[i].tokens);
    if (in->pull_block_tokens)
        printf("; a transfer moves the whole %llu-token blocks before its last token",
               (unsigned long long)in->pull_block_tokens);
    else
        printf("; a transfer moves every token");
    printf("; pages in flight per decode rank: mean %.1f -> %llu, tail %llu (%s)",
           p->mean_pages_exact, (unsigned long long)p->decode.mean_pages,
           (unsigned long long)p->decode.tail_pages,
           p->decode.tail_exact ? "exact distribution" : "normal approximation");
    if (p->prefill.mean_pages != p->decode.mean_pages ||
        p->prefill.tail_pages != p->decode.tail_pages)
        printf("; per prefill rank (its reads' slices, each rounded up to whole pages): mean "
               "%llu, tail %llu",
               (unsigned long long)p->prefill.mean_pages,
               (unsigned long long)p->prefill.tail_pages);
    printf("\n");
}

static void print_pool_line(const char *side, const pkv_plan_side_t *s, bool given)
{
    char b1[32], b2[32], b3[32];
    printf("%s pool: %s per rank (%s) = %llu blocks of %s, %llu per %s granule\n", side,
           fmt_bytes(s->rank.device_pool_bytes, b1),
           given ? "--device-pool" : "concurrency x context", (unsigned long long)s->pool_blocks,
           fmt_bytes(s->block_bytes, b2), (unsigned long long)s->blocks_per_granule,
           fmt_bytes(s->granule_bytes, b3));
}

/* Beside bf16: the bytes of a row, and a token and a page on each side's rank. */
static void print_kv_bytes(const pkv_plan_t *p, const pkv_plan_t *bf, bool two)
{
    const pkv_plan_input_t *in = &p->in;
    print_row_bytes(in);
    if (two)
        print_rank_bytes("per prefill rank", in, p->prefill.heads_per_rank,
                         p->prefill.rank.token_bytes, p->prefill.rank.page_bytes,
                         bf->prefill.rank.token_bytes, bf->prefill.rank.page_bytes);
    print_rank_bytes(two ? "per decode rank" : "per rank", in, p->decode.heads_per_rank,
                     p->decode.rank.token_bytes, p->decode.rank.page_bytes,
                     bf->decode.rank.token_bytes, bf->decode.rank.page_bytes);
}

/* The command that prints the field's table for this geometry beside bf16. */
static void print_field_hint(const plan_opts_t *o, const pkv_plan_input_t *in)
{
    printf("the field's table (8k / 128k / 1M) at %s beside bf16: pagekv plan --table field "
           "--kv-dtype %s",
           pkv_dtype_name(in->dtype), pkv_dtype_name(in->dtype));
    if (o->preset && !o->layers_set && !o->heads_set && !o->dim_set)
        printf(" --preset %s", o->preset);
    else
        printf(" --layers %u --kv-heads %u --head-dim %u", in->layers, in->kv_heads, in->head_dim);
    if (in->prefill_tp == in->decode_tp)
        printf(" --tp %u", in->decode_tp);
    else
        printf(" --prefill-tp %u --decode-tp %u", in->prefill_tp, in->decode_tp);
    if (o->in.ranks_per_host) printf(" --ranks-per-host %u", o->in.ranks_per_host);
    if (in->page_tokens != 64) printf(" --page-tokens %llu", (unsigned long long)in->page_tokens);
    printf("\n");
}

static void print_plan(const plan_opts_t *o, const pkv_plan_t *p, const pkv_plan_t *bf)
{
    const pkv_plan_input_t *in = &p->in;
    bool two = in->prefill_tp != in->decode_tp;
    printf("## pagekv plan\n\n");
    geometry_line(in, o->preset);
    if (bf) print_kv_bytes(p, bf, two);
    printf("deployment: prefill TP%u x %u heads per rank, decode TP%u x %u heads per rank; "
           "%u / %u ranks per host; %llu-token pages\n",
           p->prefill.tp, p->prefill.heads_per_rank, p->decode.tp, p->decode.heads_per_rank,
           p->prefill.ranks_per_host, p->decode.ranks_per_host,
           (unsigned long long)in->page_tokens);
    print_load(in, p);
    printf("\n| figure |%s\n|---|%s\n",
           two ? " prefill per rank | prefill per host | decode per rank | decode per host |"
               : " per rank | per host |",
           two ? "---:|---:|---:|---:|" : "---:|---:|");
    for (size_t i = 0; i < sizeof(plan_rows) / sizeof(plan_rows[0]); i++) {
        printf("| %s |", plan_rows[i].label);
        if (two) {
            print_cell(&p->prefill.rank, &plan_rows[i]);
            print_cell(&p->prefill.host, &plan_rows[i]);
        }
        print_cell(&p->decode.rank, &plan_rows[i]);
        print_cell(&p->decode.host, &plan_rows[i]);
        printf("\n");
    }
    printf("\n");
    if (two) print_pool_line("prefill", &p->prefill, in->device_pool_bytes != 0);
    print_pool_line(two ? "decode" : "device", &p->decode, in->device_pool_bytes != 0);
    if (bf) print_field_hint(o, in);
}

static json_t *bytes_json(const pkv_plan_bytes_t *b)
{
    json_t *o = json_object();
    static const struct {
        const char *name;
        size_t off;
    } f[] = {
#define F(x) {#x, offsetof(pkv_plan_bytes_t, x)}
        F(token_bytes),
        F(page_bytes),
        F(device_pool_bytes),
        F(fixed_bytes),
        F(per_transfer_mean_bytes),
        F(per_transfer_tail_bytes),
        F(mirror_bytes),
        F(per_plan_bytes),
        F(paged_peak_bytes),
        F(copy_grow_bytes),
#undef F
    };
    for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++)
        json_object_set_new(o, f[i].name, jbytes(field_at(b, f[i].off)));
    return o;
}

static json_t *side_json(const pkv_plan_side_t *s)
{
    return json_pack("{s:i, s:i, s:i, s:i, s:o, s:o, s:o, s:o, s:b, s:o, s:o, s:o, s:o, s:o, s:o}",
                     "tp", (int)s->tp, "heads_per_rank", (int)s->heads_per_rank, "replicas",
                     (int)s->replicas, "ranks_per_host", (int)s->ranks_per_host, "slot_pages",
                     jbytes(s->slot_pages), "fixed_pages", jbytes(s->fixed_pages), "mean_pages",
                     jbytes(s->mean_pages), "tail_pages", jbytes(s->tail_pages), "tail_exact",
                     s->tail_exact, "block_bytes", jbytes(s->block_bytes), "blocks_per_granule",
                     jbytes(s->blocks_per_granule), "granule_bytes", jbytes(s->granule_bytes),
                     "pool_blocks", jbytes(s->pool_blocks), "per_rank", bytes_json(&s->rank),
                     "per_host", bytes_json(&s->host));
}

static json_t *input_json(const pkv_plan_input_t *in)
{
    json_t *mix = json_array(), *lng = json_array();
    for (uint32_t i = 0; i < in->n_mix; i++)
        json_array_append_new(mix, json_pack("{s:o, s:o}", "tokens", jbytes(in->mix[i].tokens),
                                             "weight", jbytes(in->mix[i].weight)));
    for (uint32_t i = 0; i < in->n_long; i++)
        json_array_append_new(lng, json_pack("{s:o, s:o}", "tokens", jbytes(in->longs[i].tokens),
                                             "count", jbytes(in->longs[i].count)));
    json_t *j = json_pack(
        "{s:i, s:i, s:i, s:s, s:i, s:i, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o}", "layers",
        (int)in->layers, "kv_heads", (int)in->kv_heads, "head_dim", (int)in->head_dim, "dtype",
        pkv_dtype_name(in->dtype), "prefill_tp", (int)in->prefill_tp, "decode_tp",
        (int)in->decode_tp, "page_tokens", jbytes(in->page_tokens), "granule_bytes",
        jbytes(in->granule_bytes), "context_tokens", jbytes(in->context), "concurrency",
        jbytes(in->concurrency), "in_flight", jbytes(in->in_flight), "pull_block_tokens",
        jbytes(in->pull_block_tokens), "mix", mix, "long", lng, "device_pool_bytes_per_rank",
        jbytes(in->device_pool_bytes));
    json_object_set_new(j, "mix_of", json_string(in->mix_of_requests ? "requests" : "in_flight"));
    return j;
}

/* "kv_bytes": a row's bytes (values + scale); beside bf16 also bf16's row and the ratio. */
static json_t *kv_bytes_json(const pkv_plan_input_t *in, bool beside)
{
    size_t row = pkv_dtype_row_bytes(in->dtype, in->head_dim);
    size_t bf = pkv_dtype_row_bytes(PKV_DTYPE_BF16, in->head_dim);
    json_t *j = json_pack(
        "{s:s, s:o, s:o, s:o, s:o}", "dtype", pkv_dtype_name(in->dtype), "head_dim",
        jbytes(in->head_dim), "value_bytes", jbytes(pkv_dtype_size(in->dtype)), "scale_bytes",
        jbytes(row - (size_t)in->head_dim * pkv_dtype_size(in->dtype)), "row_bytes", jbytes(row));
    if (beside) {
        json_object_set_new(j, "bf16_row_bytes", jbytes(bf));
        json_object_set_new(j, "over_bf16", json_real((double)row / (double)bf));
    }
    return j;
}

static json_t *plan_json(const pkv_plan_t *p, const pkv_plan_t *bf)
{
    json_t *j =
        json_pack("{s:o, s:f, s:f, s:{s:f, s:f, s:f}, s:o, s:o, s:o}", "input", input_json(&p->in),
                  "mean_pages_exact", p->mean_pages_exact, "tail_exceed", PKV_PLAN_TAIL_EXCEED,
                  "ratios", "fixed_over_per_transfer", p->fixed_over_per_transfer,
                  "mirror_over_per_plan", p->mirror_over_per_plan, "copy_grow_over_paged",
                  p->copy_grow_over_paged, "prefill", side_json(&p->prefill), "decode",
                  side_json(&p->decode), "kv_bytes", kv_bytes_json(&p->in, bf != NULL));
    if (bf)
        json_object_set_new(j, "bf16",
                            json_pack("{s:o, s:o}", "prefill", side_json(&bf->prefill), "decode",
                                      side_json(&bf->decode)));
    return j;
}
