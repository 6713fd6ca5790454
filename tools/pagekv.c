/*
 * pagekv: the command-line entry point. `pagekv help` lists the commands.
 */
#include "tools/commands.h"

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

static const pkv_cmd_entry_t commands[] = {
    {"version", cmd_version, "print the version"},
    {"serve", pkv_cmd_serve, "OpenAI-compatible HTTP server: pagekv serve [--port N] ..."},
    {"route", pkv_cmd_route,
     "router for prefill and decode nodes: pagekv route --prefill URL --decode URL ..."},
    {"bench", pkv_cmd_bench,
     "run a benchmark: pagekv bench <name> [--json FILE] (see `pagekv bench`)"},
    {"demo", pkv_cmd_demo, "the main job: prefill node, decode node and router as processes"},
    {"plan", pkv_cmd_plan, "memory each KV design needs per rank and per host: pagekv plan --help"},
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

static const pkv_cmd_entry_t benches[] = {
    {"pool", pkv_bench_pool, "KV pool: alloc/free, prefix hashing, commit, growth, reset"},
    {"footprint", pkv_bench_footprint,
     "server memory over HTTP workloads, paged vs dense (starts `pagekv serve`)"},
    {"staging", pkv_bench_staging, "host staging: fixed slots vs per-transfer on one load"},
    {"model", pkv_bench_model, "model: prefill / decode tokens/s, paged vs dense, batch 1 and 8"},
    {"tokenizer", pkv_bench_tokenizer,
     "tokenizer: encode speed and chars/token on filler and prose"},
    {"xfer", pkv_bench_xfer, "KV transfer: GB/s same host and tcp, kill detection, fault matrix"},
    {"disagg", pkv_bench_disagg,
     "the field's load through pagekv route and prefill/decode servers, per staging design"},
    {"reshard", pkv_bench_reshard,
     "prefill and decode of different TP: per-plan staging vs a host mirror, through route"},
    {"tiers", pkv_bench_tiers,
     "the disk tier on multi-round QA: recompute, disk and restart arms against a reference"},
    {"kvquant", pkv_bench_kvquant,
     "int8 / fp8 KV: error against bf16 (flat, outliers, sharp) and decode speed over bf16"},
    {"gpu", pkv_bench_gpu,
     "the device granule arena on an NVIDIA GPU (make GPU=1): VMM costs, counters, memory back"},
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
