/* pagekv bench pool: placeholder until the pool lands in the next commit. */
#include "../tools/cli.h"

#include <stdio.h>

int pkv_bench_pool(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "pagekv bench pool: not built yet\n");
    return 1;
}
