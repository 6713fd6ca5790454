/*
 * The pagekv CLI's entry points: the commands (tools/) and the benchmarks (bench/) that
 * tools/pagekv.c dispatches to. Each is `int cmd(int argc, char **argv)` (argv[0] is the
 * command's own name) returning the process exit code; tools/pagekv.c holds the tables.
 */
#ifndef PKV_TOOLS_COMMANDS_H
#define PKV_TOOLS_COMMANDS_H

/* One row of a dispatch table. */
typedef struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} pkv_cmd_entry_t;

/* Commands (tools/). */
int pkv_cmd_bench(int argc, char **argv);
int pkv_cmd_demo(int argc, char **argv);
int pkv_cmd_tokenizer(int argc, char **argv);
int pkv_cmd_serve(int argc, char **argv);
int pkv_cmd_route(int argc, char **argv);
int pkv_cmd_generate(int argc, char **argv);
int pkv_cmd_plan(int argc, char **argv);

/* Benchmarks (bench/), run by `pagekv bench NAME`. */
int pkv_bench_pool(int argc, char **argv);
int pkv_bench_footprint(int argc, char **argv);
int pkv_bench_staging(int argc, char **argv);
int pkv_bench_tokenizer(int argc, char **argv);
int pkv_bench_model(int argc, char **argv);
int pkv_bench_xfer(int argc, char **argv);
int pkv_bench_disagg(int argc, char **argv);
int pkv_bench_reshard(int argc, char **argv);
int pkv_bench_tiers(int argc, char **argv);
int pkv_bench_kvquant(int argc, char **argv);
int pkv_bench_gpu(int argc, char **argv);
int pkv_bench_tier_startup(int argc, char **argv); /* `bench tiers --startup` */

#endif
