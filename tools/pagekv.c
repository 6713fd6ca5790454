/*
 * pagekv: the command-line entry point. `pagekv help` lists the commands.
 */
#include "support/cli.h"

#include "../bench/disagg.h"

#include "pagekv/pagekv.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int cmd_version(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    printf("pagekv %s\n", pkv_version());
    return 0;
}

static int cmd_help(int argc, char **argv);

static const pkv_cli_cmd_t commands[] = {
    {"version", cmd_version, "print the version"},
    {"serve", pkv_cmd_serve, "OpenAI-compatible HTTP server: pagekv serve [--port N] ..."},
    {"bench", pkv_cmd_bench,
     "run a benchmark: pagekv bench <name> [--json FILE] (see `pagekv bench`)"},
    {"demo", pkv_cmd_demo, "the main job: prefill -> KV transfer -> decode on the built-in model"},
    {"generate", pkv_cmd_generate,
     "complete a prompt: pagekv generate --prompt TEXT [--preset NAME]"},
    {"tokenizer", pkv_cmd_tokenizer,
     "train the builtin BPE / encode text: pagekv tokenizer <train|encode>"},
    {"help", cmd_help, "list the commands"},
};

static int cmd_help(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    printf("usage: pagekv <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        printf("  %-10s %s\n", commands[i].name, commands[i].summary);
    printf("\n`pagekv <command> --help` shows a command's options.\n");
    return 0;
}

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} benches[] = {
    {"pool", pkv_bench_pool, "KV pool: alloc/free, prefix hashing, commit, growth, reset"},
    {"footprint", pkv_bench_footprint,
     "server memory over HTTP workloads, paged vs dense (starts `pagekv serve`)"},
    {"staging", pkv_bench_staging, "host staging: fixed slots vs per-transfer on one load"},
    {"model", pkv_bench_model, "model: prefill / decode tokens/s, paged vs dense, batch 1 and 8"},
    {"tokenizer", pkv_bench_tokenizer,
     "tokenizer: encode speed and chars/token on filler and prose"},
    {"xfer", pkv_bench_xfer, "KV transfer: GB/s same host and tcp, kill detection, fault matrix"},
};

int pkv_cmd_bench(int argc, char **argv)
{
    if (argc >= 2) {
        for (size_t i = 0; i < sizeof(benches) / sizeof(benches[0]); i++)
            if (!strcmp(argv[1], benches[i].name)) return benches[i].run(argc - 1, argv + 1);
    }
    fprintf(stderr, "usage: pagekv bench <name> [options]\n\nbenchmarks:\n");
    for (size_t i = 0; i < sizeof(benches) / sizeof(benches[0]); i++)
        fprintf(stderr, "  %-10s %s\n", benches[i].name, benches[i].summary);
    return argc >= 2 && strcmp(argv[1], "--help") ? 2 : 0;
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

int pkv_cmd_demo(int argc, char **argv)
{
    pkv_disagg_opts_t o = {.dtype = PKV_DTYPE_BF16, .out = stdout};
    uint64_t v;
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
        if (!strcmp(a, "--preset")) {
            o.preset = val;
        } else if (!strcmp(a, "--prompt")) {
            if (!*val) return pkv_cli_usage_error("demo", "--prompt: empty");
            o.prompt = val;
        } else if (!strcmp(a, "--max-tokens")) {
            if (pkv_cli_parse_u64(val, 1, 4096, &v))
                return pkv_cli_usage_error("demo", "--max-tokens: 1..4096, not '%s'", val);
            o.max_tokens = (uint32_t)v;
        } else if (!strcmp(a, "--dtype")) {
            if (pkv_dtype_parse(val, &o.dtype))
                return pkv_cli_usage_error("demo", "--dtype: f32, f16 or bf16, not '%s'", val);
        } else if (!strcmp(a, "--weights-seed")) {
            if (pkv_cli_parse_u64(val, 1, UINT64_MAX, &o.weights_seed))
                return pkv_cli_usage_error("demo", "--weights-seed: an integer >= 1, not '%s'",
                                           val);
        } else if (pkv_cli_parse_u64(val, 1, 3600000, &o.deadline_ms)) { /* --deadline-ms */
            return pkv_cli_usage_error("demo", "--deadline-ms: 1..3600000, not '%s'", val);
        }
    }
    if (o.tcp && o.no_shared)
        return pkv_cli_usage_error("demo", "--tcp already moves the payload through UCX");
    pkv_disagg_result_t r;
    return pkv_disagg_run(&o, &r);
}

int main(int argc, char **argv)
{
    if (argc < 2) return cmd_help(0, NULL), 2;
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        if (!strcmp(argv[1], commands[i].name)) return commands[i].run(argc - 1, argv + 1);
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) return cmd_help(0, NULL);
    if (!strcmp(argv[1], "--version")) return cmd_version(0, NULL);
    fprintf(stderr, "pagekv: unknown command '%s' (try `pagekv help`)\n", argv[1]);
    return 2;
}
