/*
 * pagekv generate: run one prompt through the engine and print the completion text.
 *
 *   pagekv generate --prompt TEXT [--preset NAME | --model CKPT --tokenizer FILE]
 *                   [--kv-backend paged|dense] [--kv-dtype f32|f16|bf16|int8|fp8] [--max-tokens N]
 *                   [--temperature T] [--top-p P] [--seed S] [--stop STR]... [--chat]
 *                   [--threads N] [--weights-seed S] [--stats]
 *
 * Only the completion text goes to stdout (streamed as the engine publishes it; a final
 * newline only when stdout is a terminal); errors and --stats go to stderr.
 */
#include "support/cli.h"
#include "tools/commands.h"

#include "pagekv/engine.h"
#include "pagekv/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int detok(void *arg, int32_t prev, int32_t id, const char **bytes, size_t *len)
{
    return pkv_tok_decode_token(arg, prev, id, bytes, len);
}

static void usage(void)
{
    fprintf(
        stderr,
        "usage: pagekv generate --prompt TEXT [--preset NAME | --model CKPT --tokenizer FILE]\n"
        "         [--kv-backend paged|dense] [--kv-dtype f32|f16|bf16|int8|fp8] [--max-tokens N]\n"
        "         [--temperature T] [--top-p P] [--seed S] [--stop STR]... [--chat]\n"
        "         [--threads N] [--weights-seed S] [--stats]\n"
        "presets:");
    for (const char *const *n = pkv_model_preset_names(); *n; n++) fprintf(stderr, " %s", *n);
    fprintf(stderr, " (default llama-3.2-1b)\n");
}

static int parse_float(const char *s, float lo, float hi, float *out)
{
    char *end;
    if (!s || !*s) return -1;
    float v = strtof(s, &end);
    if (*end || !(v >= lo && v <= hi)) return -1;
    *out = v;
    return 0;
}

/* What the command line asks for. */
typedef struct {
    const char *prompt, *preset, *ckpt, *tokfile;
    const char *stops[PKV_ENGINE_MAX_STOP];
    uint32_t n_stop;
    pkv_backend_t backend;
    pkv_dtype_t dtype;
    bool dtype_set, chat, stats;
    uint64_t max_tokens, seed, wseed, threads;
    float temperature, top_p;
} gen_opts_t;

/* What the command builds (torn down in reverse by stack_free). */
typedef struct {
    pkv_tok_t *tok;
    pkv_model_t *model;
    pkv_kv_t *kv;
    pkv_engine_t *eng;
    pkv_request_t *req;
    int32_t *ids;
    size_t n_ids;
} gen_stack_t;

#define PROCEED (-1) /* parse_args: run the command (otherwise: the exit code) */

/* One option that takes a value. 0, or the exit code of a usage error. */
static int set_option(gen_opts_t *o, const char *a, const char *v)
{
    if (!strcmp(a, "--prompt")) {
        o->prompt = v;
    } else if (!strcmp(a, "--preset")) {
        o->preset = v;
    } else if (!strcmp(a, "--model")) {
        o->ckpt = v;
    } else if (!strcmp(a, "--tokenizer")) {
        o->tokfile = v;
    } else if (!strcmp(a, "--kv-backend")) {
        if (pkv_backend_parse(v, &o->backend))
            return pkv_cli_usage_error("generate", "--kv-backend: paged or dense, not '%s'", v);
    } else if (!strcmp(a, "--kv-dtype") || !strcmp(a, "--dtype")) { /* --dtype: the old name */
        if (pkv_dtype_parse(v, &o->dtype))
            return pkv_cli_usage_error("generate", "%s: f32, f16, bf16, int8 or fp8, not '%s'", a,
                                       v);
        o->dtype_set = true;
    } else if (!strcmp(a, "--max-tokens")) {
        if (pkv_cli_parse_u64(v, 1, 1u << 20, &o->max_tokens))
            return pkv_cli_usage_error("generate", "--max-tokens: a count >= 1, not '%s'", v);
    } else if (!strcmp(a, "--temperature")) {
        if (parse_float(v, 0.0f, 100.0f, &o->temperature))
            return pkv_cli_usage_error("generate", "--temperature: 0..100, not '%s'", v);
    } else if (!strcmp(a, "--top-p")) {
        if (parse_float(v, 0.0f, 1.0f, &o->top_p))
            return pkv_cli_usage_error("generate", "--top-p: 0..1, not '%s'", v);
    } else if (!strcmp(a, "--seed")) {
        if (pkv_cli_parse_u64(v, 0, UINT64_MAX, &o->seed))
            return pkv_cli_usage_error("generate", "--seed: an integer, not '%s'", v);
    } else if (!strcmp(a, "--weights-seed")) {
        if (pkv_cli_parse_u64(v, 0, UINT64_MAX, &o->wseed))
            return pkv_cli_usage_error("generate", "--weights-seed: an integer, not '%s'", v);
    } else if (!strcmp(a, "--threads")) {
        if (pkv_cli_parse_u64(v, 1, 64, &o->threads))
            return pkv_cli_usage_error("generate", "--threads: 1..64, not '%s'", v);
    } else if (!strcmp(a, "--stop")) {
        if (o->n_stop == PKV_ENGINE_MAX_STOP)
            return pkv_cli_usage_error("generate", "at most %d --stop strings",
                                       PKV_ENGINE_MAX_STOP);
        o->stops[o->n_stop++] = v;
    } else {
        usage();
        return pkv_cli_usage_error("generate", "unknown option '%s'", a);
    }
    return 0;
}

/* PROCEED with *o filled, or the exit code (0 after --help, 2 for a usage error). */
static int parse_args(int argc, char **argv, gen_opts_t *o)
{
    *o = (gen_opts_t){.backend = PKV_BACKEND_PAGED,
                      .dtype = PKV_DTYPE_BF16,
                      .max_tokens = 64,
                      .wseed = 1,
                      .top_p = 1.0f};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        } else if (!strcmp(a, "--chat")) {
            o->chat = true;
        } else if (!strcmp(a, "--stats")) {
            o->stats = true;
        } else if (!v) {
            return pkv_cli_usage_error("generate", "%s needs a value", a);
        } else {
            int rc = set_option(o, a, v);
            if (rc) return rc;
            i++;
        }
    }
    if (!o->prompt) {
        usage();
        return pkv_cli_usage_error("generate", "--prompt is required");
    }
    if (o->ckpt && o->preset)
        return pkv_cli_usage_error("generate", "--model and --preset exclude each other");
    if (!!o->ckpt != !!o->tokfile)
        return pkv_cli_usage_error("generate", "--model and --tokenizer go together");
    if (o->ckpt && !o->dtype_set) o->dtype = PKV_DTYPE_F32;
    return PROCEED;
}

/* The model and its tokenizer. 0, or the exit code. */
static int load_model(const gen_opts_t *o, gen_stack_t *g)
{
    pkv_model_runtime_t rt = {.threads = (uint32_t)o->threads};
    int st;
    if (o->ckpt) {
        if ((st = pkv_model_load_llama2c(o->ckpt, &rt, &g->model))) {
            fprintf(stderr, "pagekv generate: cannot load %s: %s\n", o->ckpt, pkv_status_str(st));
            return 1;
        }
        if ((st = pkv_tok_load_llama2c(o->tokfile, (int32_t)pkv_model_config(g->model)->vocab_size,
                                       &g->tok))) {
            fprintf(stderr, "pagekv generate: cannot load tokenizer %s: %s\n", o->tokfile,
                    pkv_status_str(st));
            return 1;
        }
        return 0;
    }
    pkv_model_config_t mc;
    if (pkv_model_preset(o->preset ? o->preset : "llama-3.2-1b", &mc)) {
        usage();
        return pkv_cli_usage_error("generate", "unknown preset '%s'", o->preset);
    }
    if ((st = pkv_tok_create_builtin(&g->tok))) {
        fprintf(stderr, "pagekv generate: tokenizer: %s\n", pkv_status_str(st));
        return 1;
    }
    mc.vocab_size = (uint32_t)pkv_tok_vocab_size(g->tok);
    if ((st = pkv_model_create_builtin(&mc, o->wseed, &rt, &g->model))) {
        fprintf(stderr, "pagekv generate: model: %s\n", pkv_status_str(st));
        return 1;
    }
    return 0;
}

/* The prompt's token ids (chat template or plain), within the model's context. 0 or 1. */
static int encode_prompt(const gen_opts_t *o, gen_stack_t *g)
{
    int st;
    if (o->chat) {
        pkv_chat_msg_t msg = {
            .role = PKV_CHAT_USER, .content = o->prompt, .content_len = strlen(o->prompt)};
        st = pkv_tok_chat_template(g->tok, &msg, 1, true, &g->ids, &g->n_ids);
    } else {
        st = pkv_tok_encode_alloc(g->tok, o->prompt, strlen(o->prompt), true, &g->ids, &g->n_ids);
    }
    if (st || !g->n_ids) {
        fprintf(stderr, "pagekv generate: cannot encode the prompt: %s\n", pkv_status_str(st));
        return 1;
    }
    const pkv_model_config_t *mc = pkv_model_config(g->model);
    if (g->n_ids + o->max_tokens > mc->max_seq_len) {
        fprintf(stderr, "pagekv generate: %zu prompt tokens + %llu new exceed the context (%u)\n",
                g->n_ids, (unsigned long long)o->max_tokens, mc->max_seq_len);
        return 1;
    }
    return 0;
}

/* The KV cache and the engine. 0 or 1. */
static int make_engine(const gen_opts_t *o, gen_stack_t *g)
{
    int st;
    pkv_kv_config_t kc = {.backend = o->backend, .hugepages = true};
    pkv_model_geometry(g->model, o->dtype, 16, &kc.geo);
    if ((st = pkv_kv_create(&kc, &g->kv))) {
        fprintf(stderr, "pagekv generate: KV cache: %s\n", pkv_status_str(st));
        return 1;
    }
    int32_t eos[PKV_ENGINE_MAX_EOS];
    uint32_t n_eos = 0;
    for (int32_t id = 0; id < pkv_tok_vocab_size(g->tok) && n_eos < PKV_ENGINE_MAX_EOS; id++)
        if (pkv_tok_is_stop(g->tok, id)) eos[n_eos++] = id;
    pkv_engine_config_t ec = {.model = g->model,
                              .kv = g->kv,
                              .eos_ids = eos,
                              .n_eos_ids = n_eos,
                              .detok = detok,
                              .detok_arg = g->tok};
    if ((st = pkv_engine_create(&ec, &g->eng))) {
        fprintf(stderr, "pagekv generate: engine: %s\n", pkv_status_str(st));
        return 1;
    }
    return 0;
}

/* The --stats line. */
static void report(const gen_opts_t *o, const pkv_model_t *model, const pkv_request_output_t *out,
                   uint64_t t0, uint64_t t_first)
{
    uint64_t t1 = pkv_now_ns();
    double ttft = t_first ? (double)(t_first - t0) / 1e9 : 0;
    double dec = t_first && out->completion_tokens > 1 ? (double)(t1 - t_first) / 1e9 : 0;
    fprintf(stderr,
            "model %s kernels %s threads %u, kv %s %s; prompt %u tokens (%u cached), "
            "completion %u tokens, finish %s; first token %.3f s, decode %.1f tokens/s\n",
            o->ckpt ? o->ckpt : (o->preset ? o->preset : "llama-3.2-1b"), pkv_model_kernels(model),
            pkv_model_threads(model), pkv_backend_name(o->backend), pkv_dtype_name(o->dtype),
            out->prompt_tokens, out->cached_tokens, out->completion_tokens,
            pkv_finish_name(out->finish), ttft, dec > 0 ? (out->completion_tokens - 1) / dec : 0.0);
}

/* Submit, stream the completion to stdout, report. 0, or 1 (refused, failed). */
static int run(const gen_opts_t *o, gen_stack_t *g)
{
    pkv_request_params_t rp = {.prompt = g->ids,
                               .n_prompt = (uint32_t)g->n_ids,
                               .max_tokens = (uint32_t)o->max_tokens,
                               .temperature = o->temperature,
                               .top_p = o->top_p,
                               .seed = o->seed,
                               .stop = o->stops,
                               .n_stop = o->n_stop};
    uint64_t t0 = pkv_now_ns();
    int st = pkv_engine_submit(g->eng, &rp, &g->req);
    if (st) {
        fprintf(stderr, "pagekv generate: request refused: %s\n", pkv_status_str(st));
        return 1;
    }
    pkv_request_output_t out = {0};
    uint64_t t_first = 0;
    do {
        if ((st = pkv_request_read(g->req, PKV_DEADLINE_NEVER, &out))) break;
        if (out.n_tokens && !t_first) t_first = pkv_now_ns();
        fwrite(out.text, 1, out.text_len, stdout);
        fflush(stdout);
    } while (!out.finished);
    if (st == PKV_OK && out.finish == PKV_FINISH_ERROR) {
        fprintf(stderr, "pagekv generate: generation failed: %s\n", pkv_status_str(out.status));
        return 1;
    }
    int rc = 1;
    if (st == PKV_OK) {
        if (isatty(STDOUT_FILENO)) fputc('\n', stdout); /* piped: exactly the completion */
        rc = 0;
    }
    if (o->stats) report(o, g->model, &out, t0, t_first);
    return rc;
}

int pkv_cmd_generate(int argc, char **argv)
{
    gen_opts_t o;
    int rc = parse_args(argc, argv, &o);
    if (rc != PROCEED) return rc;
    gen_stack_t g = {0};
    rc = load_model(&o, &g);
    if (!rc) rc = encode_prompt(&o, &g);
    if (!rc) rc = make_engine(&o, &g);
    if (!rc) rc = run(&o, &g);
    pkv_request_release(g.req);
    pkv_engine_destroy(g.eng);
    pkv_kv_destroy(g.kv);
    free(g.ids);
    pkv_model_destroy(g.model);
    pkv_tok_destroy(g.tok);
    return rc;
}
