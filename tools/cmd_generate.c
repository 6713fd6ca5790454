/*
 * pagekv generate: run one prompt through the engine and print the completion text.
 *
 *   pagekv generate --prompt TEXT [--preset NAME | --model CKPT --tokenizer FILE]
 *                   [--kv-backend paged|dense] [--dtype f32|f16|bf16] [--max-tokens N]
 *                   [--temperature T] [--top-p P] [--seed S] [--stop STR]... [--chat]
 *                   [--threads N] [--weights-seed S] [--stats]
 *
 * Only the completion text goes to stdout (streamed as the engine publishes it; a final
 * newline only when stdout is a terminal); errors and --stats go to stderr.
 */
#include "support/cli.h"

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
    fprintf(stderr,
            "usage: pagekv generate --prompt TEXT [--preset NAME | --model CKPT --tokenizer FILE]\n"
            "         [--kv-backend paged|dense] [--dtype f32|f16|bf16] [--max-tokens N]\n"
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

int pkv_cmd_generate(int argc, char **argv)
{
    const char *prompt = NULL, *preset = NULL, *ckpt = NULL, *tokfile = NULL;
    const char *stops[PKV_ENGINE_MAX_STOP];
    uint32_t n_stop = 0;
    pkv_backend_t backend = PKV_BACKEND_PAGED;
    pkv_dtype_t dtype = PKV_DTYPE_BF16;
    bool dtype_set = false, chat = false, stats = false;
    uint64_t max_tokens = 64, seed = 0, wseed = 1, threads = 0;
    float temperature = 0.0f, top_p = 1.0f;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool takes = true;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        } else if (!strcmp(a, "--chat")) {
            chat = true, takes = false;
        } else if (!strcmp(a, "--stats")) {
            stats = true, takes = false;
        } else if (!v) {
            return pkv_cli_usage_error("generate", "%s needs a value", a);
        } else if (!strcmp(a, "--prompt")) {
            prompt = v;
        } else if (!strcmp(a, "--preset")) {
            preset = v;
        } else if (!strcmp(a, "--model")) {
            ckpt = v;
        } else if (!strcmp(a, "--tokenizer")) {
            tokfile = v;
        } else if (!strcmp(a, "--kv-backend")) {
            if (pkv_backend_parse(v, &backend))
                return pkv_cli_usage_error("generate", "--kv-backend: paged or dense, not '%s'", v);
        } else if (!strcmp(a, "--dtype")) {
            if (pkv_dtype_parse(v, &dtype))
                return pkv_cli_usage_error("generate", "--dtype: f32, f16 or bf16, not '%s'", v);
            dtype_set = true;
        } else if (!strcmp(a, "--max-tokens")) {
            if (pkv_cli_parse_u64(v, 1, 1u << 20, &max_tokens))
                return pkv_cli_usage_error("generate", "--max-tokens: a count >= 1, not '%s'", v);
        } else if (!strcmp(a, "--temperature")) {
            if (parse_float(v, 0.0f, 100.0f, &temperature))
                return pkv_cli_usage_error("generate", "--temperature: 0..100, not '%s'", v);
        } else if (!strcmp(a, "--top-p")) {
            if (parse_float(v, 0.0f, 1.0f, &top_p))
                return pkv_cli_usage_error("generate", "--top-p: 0..1, not '%s'", v);
        } else if (!strcmp(a, "--seed")) {
            if (pkv_cli_parse_u64(v, 0, UINT64_MAX, &seed))
                return pkv_cli_usage_error("generate", "--seed: an integer, not '%s'", v);
        } else if (!strcmp(a, "--weights-seed")) {
            if (pkv_cli_parse_u64(v, 0, UINT64_MAX, &wseed))
                return pkv_cli_usage_error("generate", "--weights-seed: an integer, not '%s'", v);
        } else if (!strcmp(a, "--threads")) {
            if (pkv_cli_parse_u64(v, 1, 64, &threads))
                return pkv_cli_usage_error("generate", "--threads: 1..64, not '%s'", v);
        } else if (!strcmp(a, "--stop")) {
            if (n_stop == PKV_ENGINE_MAX_STOP)
                return pkv_cli_usage_error("generate", "at most %d --stop strings",
                                           PKV_ENGINE_MAX_STOP);
            stops[n_stop++] = v;
        } else {
            usage();
            return pkv_cli_usage_error("generate", "unknown option '%s'", a);
        }
        if (takes) i++;
    }
    if (!prompt) {
        usage();
        return pkv_cli_usage_error("generate", "--prompt is required");
    }
    if (ckpt && preset)
        return pkv_cli_usage_error("generate", "--model and --preset exclude each other");
    if (!!ckpt != !!tokfile)
        return pkv_cli_usage_error("generate", "--model and --tokenizer go together");
    if (ckpt && !dtype_set) dtype = PKV_DTYPE_F32;

    int rc = 1, st;
    pkv_tok_t *tok = NULL;
    pkv_model_t *model = NULL;
    pkv_kv_t *kv = NULL;
    pkv_engine_t *eng = NULL;
    pkv_request_t *req = NULL;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    pkv_model_runtime_t rt = {.threads = (uint32_t)threads};
    if (ckpt) {
        if ((st = pkv_model_load_llama2c(ckpt, &rt, &model))) {
            fprintf(stderr, "pagekv generate: cannot load %s: %s\n", ckpt, pkv_status_str(st));
            goto out;
        }
        if ((st = pkv_tok_load_llama2c(tokfile, (int32_t)pkv_model_config(model)->vocab_size,
                                       &tok))) {
            fprintf(stderr, "pagekv generate: cannot load tokenizer %s: %s\n", tokfile,
                    pkv_status_str(st));
            goto out;
        }
    } else {
        pkv_model_config_t mc;
        if (pkv_model_preset(preset ? preset : "llama-3.2-1b", &mc)) {
            usage();
            rc = pkv_cli_usage_error("generate", "unknown preset '%s'", preset);
            goto out;
        }
        if ((st = pkv_tok_create_builtin(&tok))) {
            fprintf(stderr, "pagekv generate: tokenizer: %s\n", pkv_status_str(st));
            goto out;
        }
        mc.vocab_size = (uint32_t)pkv_tok_vocab_size(tok);
        if ((st = pkv_model_create_builtin(&mc, wseed, &rt, &model))) {
            fprintf(stderr, "pagekv generate: model: %s\n", pkv_status_str(st));
            goto out;
        }
    }
    if (chat) {
        pkv_chat_msg_t msg = {
            .role = PKV_CHAT_USER, .content = prompt, .content_len = strlen(prompt)};
        st = pkv_tok_chat_template(tok, &msg, 1, true, &ids, &n_ids);
    } else {
        st = pkv_tok_encode_alloc(tok, prompt, strlen(prompt), true, &ids, &n_ids);
    }
    if (st || !n_ids) {
        fprintf(stderr, "pagekv generate: cannot encode the prompt: %s\n", pkv_status_str(st));
        goto out;
    }
    const pkv_model_config_t *mc = pkv_model_config(model);
    if (n_ids + max_tokens > mc->max_seq_len) {
        fprintf(stderr, "pagekv generate: %zu prompt tokens + %llu new exceed the context (%u)\n",
                n_ids, (unsigned long long)max_tokens, mc->max_seq_len);
        goto out;
    }
    pkv_kv_config_t kc = {.backend = backend, .hugepages = true};
    pkv_model_geometry(model, dtype, 16, &kc.geo);
    if ((st = pkv_kv_create(&kc, &kv))) {
        fprintf(stderr, "pagekv generate: KV cache: %s\n", pkv_status_str(st));
        goto out;
    }
    int32_t eos[PKV_ENGINE_MAX_EOS];
    uint32_t n_eos = 0;
    for (int32_t id = 0; id < pkv_tok_vocab_size(tok) && n_eos < PKV_ENGINE_MAX_EOS; id++)
        if (pkv_tok_is_stop(tok, id)) eos[n_eos++] = id;
    pkv_engine_config_t ec = {.model = model,
                              .kv = kv,
                              .eos_ids = eos,
                              .n_eos_ids = n_eos,
                              .detok = detok,
                              .detok_arg = tok};
    if ((st = pkv_engine_create(&ec, &eng))) {
        fprintf(stderr, "pagekv generate: engine: %s\n", pkv_status_str(st));
        goto out;
    }
    pkv_request_params_t rp = {.prompt = ids,
                               .n_prompt = (uint32_t)n_ids,
                               .max_tokens = (uint32_t)max_tokens,
                               .temperature = temperature,
                               .top_p = top_p,
                               .seed = seed,
                               .stop = stops,
                               .n_stop = n_stop};
    uint64_t t0 = pkv_now_ns();
    if ((st = pkv_engine_submit(eng, &rp, &req))) {
        fprintf(stderr, "pagekv generate: request refused: %s\n", pkv_status_str(st));
        goto out;
    }
    pkv_request_output_t o;
    uint64_t t_first = 0;
    do {
        if ((st = pkv_request_read(req, PKV_DEADLINE_NEVER, &o))) break;
        if (o.n_tokens && !t_first) t_first = pkv_now_ns();
        fwrite(o.text, 1, o.text_len, stdout);
        fflush(stdout);
    } while (!o.finished);
    if (st == PKV_OK && o.finish == PKV_FINISH_ERROR) {
        fprintf(stderr, "pagekv generate: generation failed: %s\n", pkv_status_str(o.status));
        goto out;
    }
    if (st == PKV_OK) {
        if (isatty(STDOUT_FILENO)) fputc('\n', stdout); /* piped: exactly the completion */
        rc = 0;
    }
    if (stats) {
        uint64_t t1 = pkv_now_ns();
        double ttft = t_first ? (double)(t_first - t0) / 1e9 : 0;
        double dec = t_first && o.completion_tokens > 1 ? (double)(t1 - t_first) / 1e9 : 0;
        fprintf(stderr,
                "model %s kernels %s threads %u, kv %s %s; prompt %u tokens (%u cached), "
                "completion %u tokens, finish %s; first token %.3f s, decode %.1f tokens/s\n",
                ckpt ? ckpt : (preset ? preset : "llama-3.2-1b"), pkv_model_kernels(model),
                pkv_model_threads(model), pkv_backend_name(backend), pkv_dtype_name(dtype),
                o.prompt_tokens, o.cached_tokens, o.completion_tokens, pkv_finish_name(o.finish),
                ttft, dec > 0 ? (o.completion_tokens - 1) / dec : 0.0);
    }
out:
    pkv_request_release(req);
    pkv_engine_destroy(eng);
    pkv_kv_destroy(kv);
    free(ids);
    pkv_model_destroy(model);
    pkv_tok_destroy(tok);
    return rc;
}
