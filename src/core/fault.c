/*
 * core: fault simulation for tests (see core.h). Each site has an atomic budget of hits
 * that pass before failures start and of failures left; a hit with neither left is a
 * relaxed load and nothing else.
 */
#include "core/core.h"

#include <stdatomic.h>

typedef struct {
    _Atomic uint32_t skip;  /* hits that still pass before failing */
    _Atomic uint32_t fail;  /* failures left */
    _Atomic uint64_t fired; /* failures since the last arm */
} fault_site_t;

static fault_site_t fault_sites[PKV_FAULT_SITES];

void pkv_fault_arm(pkv_fault_site_t site, uint32_t skip, uint32_t count)
{
    if ((unsigned)site >= PKV_FAULT_SITES) return;
    fault_site_t *f = &fault_sites[site];
    atomic_store(&f->fail, 0);
    atomic_store(&f->fired, 0);
    atomic_store(&f->skip, skip);
    atomic_store(&f->fail, count);
}

void pkv_fault_disarm_all(void)
{
    for (int i = 0; i < PKV_FAULT_SITES; i++) pkv_fault_arm((pkv_fault_site_t)i, 0, 0);
}

bool pkv_fault_hit(pkv_fault_site_t site)
{
    if ((unsigned)site >= PKV_FAULT_SITES) return false;
    fault_site_t *f = &fault_sites[site];
    if (atomic_load_explicit(&f->fail, memory_order_relaxed) == 0) return false;
    uint32_t s = atomic_load(&f->skip);
    while (s > 0)
        if (atomic_compare_exchange_weak(&f->skip, &s, s - 1)) return false;
    uint32_t n = atomic_load(&f->fail);
    while (n > 0)
        if (atomic_compare_exchange_weak(&f->fail, &n, n - 1)) {
            atomic_fetch_add(&f->fired, 1);
            return true;
        }
    return false;
}

uint64_t pkv_fault_fired(pkv_fault_site_t site)
{
    return (unsigned)site < PKV_FAULT_SITES ? atomic_load(&fault_sites[site].fired) : 0;
}
