#include "testutil.h"

#include "prim/prim.h"

#include <stdio.h>

uint64_t pkv_test_seed(uint64_t fallback)
{
    const char *e = getenv("PKV_TEST_SEED");
    return e ? strtoull(e, NULL, 0) : fallback;
}

uint64_t pkv_test_rss(void)
{
    pkv_prim_mem_t m;
    if (pkv_prim_mem_read(0, &m) != 0) return 0;
    return m.rss_bytes;
}
