/*
 * gpu: a build without the GPU part (plain `make`; see gpu.h). pkv_gpu_open says so and
 * returns PKV_ERR_UNSUPPORTED, so no pkv_gpu_t exists and the calls below, which take one,
 * are never reached with a device; they answer PKV_ERR_UNSUPPORTED all the same.
 */
#include "gpu/gpu.h"

#include <stdio.h>

bool pkv_gpu_built(void)
{
    return false;
}

int pkv_gpu_open(const char *driver, int ordinal, pkv_gpu_t **out, char *why, size_t cap)
{
    (void)driver;
    (void)ordinal;
    (void)out;
    if (why && cap) snprintf(why, cap, "no CUDA device: this build has no GPU part (make GPU=1)");
    return PKV_ERR_UNSUPPORTED;
}

void pkv_gpu_close(pkv_gpu_t *g)
{
    (void)g;
}

void pkv_gpu_info(const pkv_gpu_t *g, pkv_gpu_info_t *out)
{
    (void)g;
    *out = (pkv_gpu_info_t){0};
}

int pkv_gpu_mem_info(pkv_gpu_t *g, uint64_t *free_bytes, uint64_t *total_bytes)
{
    *free_bytes = *total_bytes = 0;
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_sync(pkv_gpu_t *g)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_memset(pkv_gpu_t *g, uint64_t va, uint8_t value, uint64_t bytes)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_copy_to_host(pkv_gpu_t *g, void *dst, uint64_t va, uint64_t bytes)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_copy_from_host(pkv_gpu_t *g, uint64_t va, const void *src, uint64_t bytes)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_phys_create(pkv_gpu_t *g, uint64_t bytes, uint64_t *handle)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_phys_release(pkv_gpu_t *g, uint64_t handle)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_va_reserve(pkv_gpu_t *g, uint64_t bytes, uint64_t *va)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_va_free(pkv_gpu_t *g, uint64_t va, uint64_t bytes)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_map(pkv_gpu_t *g, uint64_t va, uint64_t bytes, uint64_t handle)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_set_access(pkv_gpu_t *g, uint64_t va, uint64_t bytes)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_unmap(pkv_gpu_t *g, uint64_t va, uint64_t bytes)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_copy_device(pkv_gpu_t *g, uint64_t dst, uint64_t src, uint64_t bytes)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_module_load(pkv_gpu_t *g, const char *path, void **module)
{
    return PKV_ERR_UNSUPPORTED;
}

void pkv_gpu_module_unload(pkv_gpu_t *g, void *module) {}

int pkv_gpu_function(pkv_gpu_t *g, void *module, const char *name, void **fn)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_launch(pkv_gpu_t *g, void *fn, const uint32_t grid[3], const uint32_t block[3],
                   void **args)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_host_register(pkv_gpu_t *g, void *p, uint64_t bytes, uint64_t *va)
{
    return PKV_ERR_UNSUPPORTED;
}

int pkv_gpu_host_unregister(pkv_gpu_t *g, void *p)
{
    return PKV_ERR_UNSUPPORTED;
}
