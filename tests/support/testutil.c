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

uint32_t pkv_test_fault_sweep(pkv_fault_site_t site, int (*step)(void *arg), void *arg, int want_rc,
                              void (*after_fail)(void *arg))
{
    for (uint32_t skip = 0;; skip++) {
        pkv_fault_arm(site, skip, 1);
        int rc = step(arg);
        bool fired = pkv_fault_fired(site) > 0;
        pkv_fault_disarm_all();
        if (!fired) {
            ck_assert_int_eq(rc, PKV_OK);
            return skip;
        }
        ck_assert_int_eq(rc, want_rc);
        if (after_fail) after_fail(arg);
    }
}
