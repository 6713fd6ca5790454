/*
 * The pagekv CLI: one binary, subcommands. Each command is a function
 * `int cmd(int argc, char **argv)` (argv[0] is the command's own name) returning the
 * process exit code; tools/pagekv.c holds the table.
 */
#ifndef PKV_SUPPORT_CLI_H
#define PKV_SUPPORT_CLI_H

#include <stdbool.h>
#include <stdint.h>

typedef struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} pkv_cli_cmd_t;

/* Parse "123", "64K", "2M", "1.5G" (powers of 1024) into bytes. -1 on bad input. */
int pkv_cli_parse_bytes(const char *s, uint64_t *out);
/* Parse an unsigned integer within [lo, hi]. -1 on bad input. */
int pkv_cli_parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out);
/* Print "pagekv NAME: message" to stderr and return 2 (usage error exit code). */
int pkv_cli_usage_error(const char *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* True when stderr is a terminal (progress lines go there). */
bool pkv_cli_progress_enabled(void);

/* Commands. */
int pkv_cmd_bench(int argc, char **argv);
int pkv_cmd_demo(int argc, char **argv);
int pkv_cmd_tokenizer(int argc, char **argv);
int pkv_cmd_serve(int argc, char **argv);
int pkv_cmd_route(int argc, char **argv);
int pkv_cmd_generate(int argc, char **argv);
int pkv_cmd_plan(int argc, char **argv);

/* Benchmarks (bench/). */
int pkv_bench_pool(int argc, char **argv);
int pkv_bench_footprint(int argc, char **argv);
int pkv_bench_staging(int argc, char **argv);
int pkv_bench_tokenizer(int argc, char **argv);
int pkv_bench_model(int argc, char **argv);
int pkv_bench_xfer(int argc, char **argv);
int pkv_bench_disagg(int argc, char **argv);
int pkv_bench_reshard(int argc, char **argv);

#endif
