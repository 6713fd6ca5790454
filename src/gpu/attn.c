/*
 * gpu: the attention kernels' host side (gpu.h, docs/design/gpu.md "Kernels"): the module
 * (a fatbin nvcc built from kernels.cu), the launch geometry, the arguments. Built on the
 * gpu.h calls only, so it compiles in every build.
 */
#include "gpu/gpu.h"

#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>

struct pkv_gpu_attn {
    pkv_gpu_t *g;
    void *module, *merge, *write, *gather, *scatter;
    void *decode[2][4]; /* [head dim 64, 128][group 1, 2, 4, 8] */
    uint32_t sm_count;
};

int pkv_gpu_attn_load(pkv_gpu_t *g, const char *fatbin, pkv_gpu_attn_t **out)
{
    pkv_gpu_attn_t *a = calloc(1, sizeof(*a));
    if (!a) return PKV_ERR_NOMEM;
    a->g = g;
    pkv_gpu_info_t in;
    pkv_gpu_info(g, &in);
    a->sm_count = in.sm_count > 0 ? (uint32_t)in.sm_count : 1;
    int rc = pkv_gpu_module_load(g, fatbin, &a->module);
    for (int d = 0; d < 2 && !rc; d++)
        for (int k = 0; k < 4 && !rc; k++) {
            char name[64];
            snprintf(name, sizeof(name), "pkv_decode_attn_bf16_d%d_g%d", 64 << d, 1 << k);
            rc = pkv_gpu_function(g, a->module, name, &a->decode[d][k]);
        }
    if (!rc) rc = pkv_gpu_function(g, a->module, "pkv_decode_attn_merge", &a->merge);
    if (!rc) rc = pkv_gpu_function(g, a->module, "pkv_kv_write_bf16", &a->write);
    if (!rc) rc = pkv_gpu_function(g, a->module, "pkv_stage_gather", &a->gather);
    if (!rc) rc = pkv_gpu_function(g, a->module, "pkv_stage_scatter", &a->scatter);
    if (rc) {
        pkv_gpu_attn_unload(a);
        return rc;
    }
    *out = a;
    return PKV_OK;
}

void pkv_gpu_attn_unload(pkv_gpu_attn_t *a)
{
    if (!a) return;
    pkv_gpu_module_unload(a->g, a->module);
    free(a);
}

uint32_t pkv_gpu_decode_splits(const pkv_gpu_attn_t *a, uint32_t n_seq, uint32_t kv_heads,
                               uint32_t max_len)
{
    /* ~8 CTAs (32 warps) an SM: a warp has one K and one V row in flight per step, and the
     * memory system wants ~15 KB in flight per SM to run at its rate */
    uint64_t ctas = (uint64_t)n_seq * kv_heads, want = 8ull * a->sm_count;
    uint64_t s = ctas >= want ? 1 : PKV_DIV_UP(want, ctas);
    uint64_t cap = PKV_MAX(1u, max_len / 128);
    return (uint32_t)PKV_MIN(s, cap);
}

int pkv_gpu_decode_attn(pkv_gpu_attn_t *a, const pkv_gpu_decode_t *p)
{
    uint32_t G = p->group, hd = p->head_dim;
    if ((hd != 64 && hd != 128) || (G != 1 && G != 2 && G != 4 && G != 8) || !p->n_split ||
        !p->n_seq || !p->kv_heads || !p->block_tokens)
        return PKV_ERR_INVALID;
    void *args[] = {(void *)&p->q,
                    (void *)&p->part,
                    (void *)&p->k_base,
                    (void *)&p->v_base,
                    (void *)&p->block_stride,
                    (void *)&p->head_stride,
                    (void *)&p->table,
                    (void *)&p->max_blocks,
                    (void *)&p->lens,
                    (void *)&p->block_tokens,
                    (void *)&p->kv_heads,
                    (void *)&p->scale,
                    (void *)&p->n_split};
    uint32_t grid[3] = {p->n_seq * p->kv_heads, p->n_split, 1}, block[3] = {128, 1, 1};
    int gk = G == 1 ? 0 : G == 2 ? 1 : G == 4 ? 2 : 3;
    int rc = pkv_gpu_launch(a->g, a->decode[hd == 128][gk], grid, block, args);
    if (rc) return rc;
    void *margs[] = {(void *)&p->part, (void *)&p->out, (void *)&p->head_dim, (void *)&p->n_split};
    uint32_t mgrid[3] = {p->n_seq * p->kv_heads * G, 1, 1}, mblock[3] = {hd, 1, 1};
    return pkv_gpu_launch(a->g, a->merge, mgrid, mblock, margs);
}

int pkv_gpu_kv_write(pkv_gpu_attn_t *a, const pkv_gpu_kv_write_t *p)
{
    if (!p->n_tokens || !p->kv_heads || !p->head_dim || !p->block_tokens) return PKV_ERR_INVALID;
    uint64_t n = (uint64_t)p->n_tokens * p->kv_heads * p->head_dim;
    if (n > 256ull * 0x7fffffff) return PKV_ERR_INVALID;
    void *args[] = {(void *)&p->k,
                    (void *)&p->v,
                    (void *)&p->k_base,
                    (void *)&p->v_base,
                    (void *)&p->block_stride,
                    (void *)&p->head_stride,
                    (void *)&p->table,
                    (void *)&p->p0,
                    (void *)&p->n_tokens,
                    (void *)&p->block_tokens,
                    (void *)&p->kv_heads,
                    (void *)&p->head_dim};
    uint32_t grid[3] = {(uint32_t)PKV_DIV_UP(n, 256), 1, 1}, block[3] = {256, 1, 1};
    return pkv_gpu_launch(a->g, a->write, grid, block, args);
}

static int stage(pkv_gpu_attn_t *a, void *fn, uint64_t pool, uint64_t buf, uint64_t off, uint32_t n,
                 uint32_t piece_bytes)
{
    if (!n || !piece_bytes || piece_bytes % 16) return PKV_ERR_INVALID;
    void *args[] = {(void *)&pool, (void *)&buf, (void *)&off, (void *)&piece_bytes};
    uint32_t grid[3] = {n, 1, 1}, block[3] = {piece_bytes >= 4096 ? 256u : 128u, 1, 1};
    return pkv_gpu_launch(a->g, fn, grid, block, args);
}

int pkv_gpu_stage_gather(pkv_gpu_attn_t *a, uint64_t pool, uint64_t buf, uint64_t off, uint32_t n,
                         uint32_t piece_bytes)
{
    return stage(a, a->gather, pool, buf, off, n, piece_bytes);
}

int pkv_gpu_stage_scatter(pkv_gpu_attn_t *a, uint64_t pool, uint64_t buf, uint64_t off, uint32_t n,
                          uint32_t piece_bytes)
{
    return stage(a, a->scatter, pool, buf, off, n, piece_bytes);
}

int pkv_gpu_prefill_attn(pkv_gpu_attn_t *a, const pkv_gpu_decode_t *p)
{
    pkv_gpu_decode_t d = *p;
    d.max_blocks = 0; /* row s reads table[t / block_tokens]: the chunk's one sequence */
    return pkv_gpu_decode_attn(a, &d);
}
