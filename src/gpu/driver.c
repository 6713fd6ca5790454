/*
 * gpu: CUDA's driver API, found at run time (make GPU=1 builds this file; see gpu.h). The
 * binary does not link libcuda: dlopen("libcuda.so.1") and dlsym each entry point by its
 * versioned name (the names cuda.h's macros expand to), so it starts where no driver is
 * installed and says why there is no device. CUDA's stub library (the toolkit's
 * lib64/stubs/libcuda.so) loads but answers CUDA_ERROR_STUB_LIBRARY: no device either.
 */
#include "gpu/gpu.h"

#include "core/core.h"

#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The entry points used, with the exported names cuda.h maps them to. */
#define GPU_FNS(X)                                                                                 \
    X(cuInit, "cuInit", (unsigned int))                                                            \
    X(cuDriverGetVersion, "cuDriverGetVersion", (int *))                                           \
    X(cuGetErrorName, "cuGetErrorName", (CUresult, const char **))                                 \
    X(cuDeviceGetCount, "cuDeviceGetCount", (int *))                                               \
    X(cuDeviceGet, "cuDeviceGet", (CUdevice *, int))                                               \
    X(cuDeviceGetName, "cuDeviceGetName", (char *, int, CUdevice))                                 \
    X(cuDeviceGetAttribute, "cuDeviceGetAttribute", (int *, CUdevice_attribute, CUdevice))         \
    X(cuDeviceTotalMem, "cuDeviceTotalMem_v2", (size_t *, CUdevice))                               \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", (CUcontext *, CUdevice))               \
    X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", (CUdevice))                       \
    X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext))                                             \
    X(cuCtxSynchronize, "cuCtxSynchronize", (void))                                                \
    X(cuMemGetInfo, "cuMemGetInfo_v2", (size_t *, size_t *))                                       \
    X(cuMemsetD8, "cuMemsetD8_v2", (CUdeviceptr, unsigned char, size_t))                           \
    X(cuMemcpyDtoH, "cuMemcpyDtoH_v2", (void *, CUdeviceptr, size_t))                              \
    X(cuMemcpyHtoD, "cuMemcpyHtoD_v2", (CUdeviceptr, const void *, size_t))                        \
    X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity",                              \
      (size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags))                   \
    X(cuMemCreate, "cuMemCreate",                                                                  \
      (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long))   \
    X(cuMemRelease, "cuMemRelease", (CUmemGenericAllocationHandle))                                \
    X(cuMemAddressReserve, "cuMemAddressReserve",                                                  \
      (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))                            \
    X(cuMemAddressFree, "cuMemAddressFree", (CUdeviceptr, size_t))                                 \
    X(cuMemMap, "cuMemMap",                                                                        \
      (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))             \
    X(cuMemUnmap, "cuMemUnmap", (CUdeviceptr, size_t))                                             \
    X(cuMemSetAccess, "cuMemSetAccess", (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))    \
    X(cuMemcpyDtoD, "cuMemcpyDtoD_v2", (CUdeviceptr, CUdeviceptr, size_t))                         \
    X(cuMemHostRegister, "cuMemHostRegister_v2", (void *, size_t, unsigned int))                   \
    X(cuMemHostUnregister, "cuMemHostUnregister", (void *))                                        \
    X(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2",                                   \
      (CUdeviceptr *, void *, unsigned int))                                                       \
    X(cuModuleLoad, "cuModuleLoad", (CUmodule *, const char *))                                    \
    X(cuModuleUnload, "cuModuleUnload", (CUmodule))                                                \
    X(cuModuleGetFunction, "cuModuleGetFunction", (CUfunction *, CUmodule, const char *))          \
    X(cuLaunchKernel, "cuLaunchKernel",                                                            \
      (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, \
       void **, void **))

struct pkv_gpu {
    void *lib;
#define GPU_FIELD(name, sym, params) CUresult(*name) params;
    GPU_FNS(GPU_FIELD)
#undef GPU_FIELD
    CUdevice dev;
    CUcontext ctx;
    bool ctx_retained;
    bool initialized; /* cuInit succeeded: the library stays loaded (its threads may run on) */
    CUmemAllocationProp prop; /* pinned device memory on dev */
    pkv_gpu_info_t info;
};

bool pkv_gpu_built(void)
{
    return true;
}

static const char *err_name(const pkv_gpu_t *g, CUresult r)
{
    const char *s = NULL;
    if (g->cuGetErrorName && g->cuGetErrorName(r, &s) == CUDA_SUCCESS && s) return s;
    return r == CUDA_ERROR_STUB_LIBRARY ? "CUDA_ERROR_STUB_LIBRARY" : "CUDA_ERROR_?";
}

/* A driver result as a pkv status (logged unless CUDA_SUCCESS). */
static int gpu_rc(const pkv_gpu_t *g, CUresult r, const char *what)
{
    if (r == CUDA_SUCCESS) return PKV_OK;
    PKV_LOGW("gpu", "%s: %s (%d)", what, err_name(g, r), (int)r);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return PKV_ERR_NOMEM;
    if (r == CUDA_ERROR_INVALID_VALUE) return PKV_ERR_INVALID;
    return PKV_ERR_IO;
}

/* Every call may come from another thread: make the context current there first. */
static int cur(const pkv_gpu_t *g)
{
    return gpu_rc(g, g->cuCtxSetCurrent(g->ctx), "cuCtxSetCurrent");
}

static int load(pkv_gpu_t *g, const char *path, char *why, size_t cap)
{
    g->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!g->lib) {
        snprintf(why, cap, "no CUDA device: no driver (%s cannot be loaded: %s)", path, dlerror());
        return PKV_ERR_UNSUPPORTED;
    }
    snprintf(g->info.driver_path, sizeof(g->info.driver_path), "%s", path);
#define GPU_LOAD(name, sym, params)                                                                \
    if (!(*(void **)&g->name = dlsym(g->lib, sym))) {                                              \
        snprintf(why, cap, "no CUDA device: the driver %s has no %s (too old)", path, sym);        \
        return PKV_ERR_UNSUPPORTED;                                                                \
    }
    GPU_FNS(GPU_LOAD)
#undef GPU_LOAD
    return PKV_OK;
}

static int attr(pkv_gpu_t *g, CUdevice_attribute a)
{
    int v = 0;
    g->cuDeviceGetAttribute(&v, a, g->dev);
    return v;
}

/* The device, its context and what it is. */
static int open_device(pkv_gpu_t *g, int ordinal, char *why, size_t cap)
{
    CUresult r = g->cuInit(0);
    g->initialized = r == CUDA_SUCCESS;
    if (r != CUDA_SUCCESS) {
        snprintf(why, cap, "no CUDA device: cuInit failed with %s (%d)%s", err_name(g, r), (int)r,
                 r == CUDA_ERROR_STUB_LIBRARY ? ", the toolkit's stub library, not a driver" : "");
        return PKV_ERR_UNSUPPORTED;
    }
    int n = 0;
    if (g->cuDeviceGetCount(&n) != CUDA_SUCCESS || ordinal < 0 || ordinal >= n) {
        snprintf(why, cap, "no CUDA device: %d device(s), asked for device %d", n, ordinal);
        return PKV_ERR_UNSUPPORTED;
    }
    if ((r = g->cuDeviceGet(&g->dev, ordinal)) != CUDA_SUCCESS ||
        (r = g->cuDevicePrimaryCtxRetain(&g->ctx, g->dev)) != CUDA_SUCCESS) {
        snprintf(why, cap, "no CUDA device: device %d: %s (%d)", ordinal, err_name(g, r), (int)r);
        return PKV_ERR_UNSUPPORTED;
    }
    g->ctx_retained = true;
    if (cur(g)) {
        snprintf(why, cap, "no CUDA device: its context cannot be made current");
        return PKV_ERR_UNSUPPORTED;
    }
    pkv_gpu_info_t *in = &g->info;
    in->ordinal = ordinal;
    g->cuDriverGetVersion(&in->driver_version);
    g->cuDeviceGetName(in->name, (int)sizeof(in->name), g->dev);
    in->cc_major = attr(g, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    in->cc_minor = attr(g, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    in->sm_count = attr(g, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
    size_t total = 0, gmin = 0, grec = 0;
    g->cuDeviceTotalMem(&total, g->dev);
    in->total_bytes = total;
    g->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    g->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    g->prop.location.id = g->dev;
    if (g->cuMemGetAllocationGranularity(&gmin, &g->prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) ||
        g->cuMemGetAllocationGranularity(&grec, &g->prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) ||
        !gmin) {
        snprintf(why, cap, "no CUDA device: device %d (%s) has no virtual memory management",
                 ordinal, in->name);
        return PKV_ERR_UNSUPPORTED;
    }
    in->granule_min = gmin;
    in->granule_rec = grec ? grec : gmin;
    return PKV_OK;
}

int pkv_gpu_open(const char *driver, int ordinal, pkv_gpu_t **out, char *why, size_t cap)
{
    char dummy[8];
    if (!why || !cap) why = dummy, cap = sizeof(dummy);
    why[0] = '\0';
    if (!out) return PKV_ERR_INVALID;
    pkv_gpu_t *g = calloc(1, sizeof(*g));
    if (!g) return PKV_ERR_NOMEM;
    int rc = load(g, driver ? driver : "libcuda.so.1", why, cap);
    if (!rc) rc = open_device(g, ordinal, why, cap);
    if (rc) {
        pkv_gpu_close(g);
        return rc;
    }
    *out = g;
    return PKV_OK;
}

void pkv_gpu_close(pkv_gpu_t *g)
{
    if (!g) return;
    if (g->ctx_retained) g->cuDevicePrimaryCtxRelease(g->dev);
    /* A driver that initialized is never unloaded (the process keeps its reference); one
     * that did not (CUDA's stub: its soname is libcuda.so.1 too) is, so that a later open
     * finds the real driver rather than the stub still resident. */
    if (g->lib && !g->initialized) dlclose(g->lib);
    free(g);
}

void pkv_gpu_info(const pkv_gpu_t *g, pkv_gpu_info_t *out)
{
    *out = g->info;
}

int pkv_gpu_mem_info(pkv_gpu_t *g, uint64_t *free_bytes, uint64_t *total_bytes)
{
    size_t f = 0, t = 0;
    int rc = cur(g);
    if (!rc) rc = gpu_rc(g, g->cuMemGetInfo(&f, &t), "cuMemGetInfo");
    *free_bytes = f;
    *total_bytes = t;
    return rc;
}

int pkv_gpu_sync(pkv_gpu_t *g)
{
    int rc = cur(g);
    return rc ? rc : gpu_rc(g, g->cuCtxSynchronize(), "cuCtxSynchronize");
}

int pkv_gpu_memset(pkv_gpu_t *g, uint64_t va, uint8_t value, uint64_t bytes)
{
    int rc = cur(g);
    return rc ? rc : gpu_rc(g, g->cuMemsetD8((CUdeviceptr)va, value, bytes), "cuMemsetD8");
}

int pkv_gpu_copy_to_host(pkv_gpu_t *g, void *dst, uint64_t va, uint64_t bytes)
{
    int rc = cur(g);
    return rc ? rc : gpu_rc(g, g->cuMemcpyDtoH(dst, (CUdeviceptr)va, bytes), "cuMemcpyDtoH");
}

int pkv_gpu_copy_from_host(pkv_gpu_t *g, uint64_t va, const void *src, uint64_t bytes)
{
    int rc = cur(g);
    return rc ? rc : gpu_rc(g, g->cuMemcpyHtoD((CUdeviceptr)va, src, bytes), "cuMemcpyHtoD");
}

int pkv_gpu_phys_create(pkv_gpu_t *g, uint64_t bytes, uint64_t *handle)
{
    CUmemGenericAllocationHandle h = 0;
    int rc = cur(g);
    if (rc) return rc;
    CUresult r = g->cuMemCreate(&h, bytes, &g->prop, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return PKV_ERR_NOMEM; /* the device is full: typed */
    rc = gpu_rc(g, r, "cuMemCreate");
    if (!rc) *handle = (uint64_t)h;
    return rc;
}

int pkv_gpu_phys_release(pkv_gpu_t *g, uint64_t handle)
{
    int rc = cur(g);
    return rc ? rc
              : gpu_rc(g, g->cuMemRelease((CUmemGenericAllocationHandle)handle), "cuMemRelease");
}

int pkv_gpu_va_reserve(pkv_gpu_t *g, uint64_t bytes, uint64_t *va)
{
    CUdeviceptr p = 0;
    int rc = cur(g);
    if (!rc)
        rc = gpu_rc(g, g->cuMemAddressReserve(&p, bytes, g->info.granule_rec, 0, 0),
                    "cuMemAddressReserve");
    if (!rc) *va = (uint64_t)p;
    return rc;
}

int pkv_gpu_va_free(pkv_gpu_t *g, uint64_t va, uint64_t bytes)
{
    int rc = cur(g);
    return rc ? rc : gpu_rc(g, g->cuMemAddressFree((CUdeviceptr)va, bytes), "cuMemAddressFree");
}

int pkv_gpu_map(pkv_gpu_t *g, uint64_t va, uint64_t bytes, uint64_t handle)
{
    int rc = cur(g);
    return rc ? rc
              : gpu_rc(
                    g,
                    g->cuMemMap((CUdeviceptr)va, bytes, 0, (CUmemGenericAllocationHandle)handle, 0),
                    "cuMemMap");
}

int pkv_gpu_set_access(pkv_gpu_t *g, uint64_t va, uint64_t bytes)
{
    CUmemAccessDesc d = {.location = g->prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    int rc = cur(g);
    return rc ? rc : gpu_rc(g, g->cuMemSetAccess((CUdeviceptr)va, bytes, &d, 1), "cuMemSetAccess");
}

int pkv_gpu_unmap(pkv_gpu_t *g, uint64_t va, uint64_t bytes)
{
    int rc = cur(g);
    return rc ? rc : gpu_rc(g, g->cuMemUnmap((CUdeviceptr)va, bytes), "cuMemUnmap");
}

int pkv_gpu_copy_device(pkv_gpu_t *g, uint64_t dst, uint64_t src, uint64_t bytes)
{
    int rc = cur(g);
    return rc ? rc
              : gpu_rc(g, g->cuMemcpyDtoD((CUdeviceptr)dst, (CUdeviceptr)src, bytes),
                       "cuMemcpyDtoD");
}

int pkv_gpu_module_load(pkv_gpu_t *g, const char *path, void **module)
{
    CUmodule m = NULL;
    int rc = cur(g);
    if (!rc) rc = gpu_rc(g, g->cuModuleLoad(&m, path), path);
    if (!rc) *module = m;
    return rc;
}

void pkv_gpu_module_unload(pkv_gpu_t *g, void *module)
{
    if (module && !cur(g)) g->cuModuleUnload((CUmodule)module);
}

int pkv_gpu_function(pkv_gpu_t *g, void *module, const char *name, void **fn)
{
    CUfunction f = NULL;
    int rc = cur(g);
    if (!rc) rc = gpu_rc(g, g->cuModuleGetFunction(&f, (CUmodule)module, name), name);
    if (!rc) *fn = f;
    return rc;
}

int pkv_gpu_launch(pkv_gpu_t *g, void *fn, const uint32_t grid[3], const uint32_t block[3],
                   void **args)
{
    int rc = cur(g);
    return rc ? rc
              : gpu_rc(g,
                       g->cuLaunchKernel((CUfunction)fn, grid[0], grid[1], grid[2], block[0],
                                         block[1], block[2], 0, NULL, args, NULL),
                       "cuLaunchKernel");
}

int pkv_gpu_host_register(pkv_gpu_t *g, void *p, uint64_t bytes, uint64_t *va)
{
    CUdeviceptr d = 0;
    int rc = cur(g);
    if (!rc)
        rc = gpu_rc(g, g->cuMemHostRegister(p, bytes, CU_MEMHOSTREGISTER_DEVICEMAP),
                    "cuMemHostRegister");
    if (!rc &&
        (rc = gpu_rc(g, g->cuMemHostGetDevicePointer(&d, p, 0), "cuMemHostGetDevicePointer")))
        g->cuMemHostUnregister(p);
    if (!rc) *va = (uint64_t)d;
    return rc;
}

int pkv_gpu_host_unregister(pkv_gpu_t *g, void *p)
{
    int rc = cur(g);
    return rc ? rc : gpu_rc(g, g->cuMemHostUnregister(p), "cuMemHostUnregister");
}
