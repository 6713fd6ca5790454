/*
 * gpu: attention kernels (docs/design/gpu.md, "Kernels"). Built by nvcc into a fatbin
 * (make GPU=1: build/gpu/pagekv-kernels.fatbin; scripts/gpu-check.sh on the GPU machine)
 * that pkv_gpu_module_load loads; launched through the driver API (no cudart).
 *
 * Paged decode attention, bf16 K/V, fp32 arithmetic, one query token per sequence:
 *   pkv_decode_attn_bf16_d<hd>_g<G>: grid (n_seq * kv_heads, n_split), 128 threads. A CTA
 *     serves the G query heads of one KV head from one read of K and V, over the tokens of
 *     its split [split * per, min(len, (split + 1) * per)); warp w takes the tokens
 *     t = first + w, first + w + 4, ...; lane i holds dims [i * D, i * D + D) (D = hd / 32:
 *     2 or 4) of q, of each K and V row and of the accumulators. Per token: G dot products
 *     (lane partials reduced by xor shuffles, the same fixed tree on every lane), then an
 *     online softmax step per query head. The 4 warps' (m, l, acc) are merged in shared
 *     memory in warp order and written as the split's partial.
 *   pkv_decode_attn_merge: grid (n_seq * n_q_heads), hd threads: the splits' partials
 *     merged in split order into the output, out = sum(e^(m_s - M) acc_s) / sum(e^(m_s - M) l_s).
 * Addressing: token t of sequence s, KV head h is at
 *   k_base + table[s * max_blocks + t / bt] * block_stride + h * head_stride + (t % bt) * hd * 2
 * (and v_base likewise), so the caller's layout decides where pieces lie; positions past a
 * sequence's length are never read (a block's tail may hold anything, NaN included).
 * Every sum runs in a fixed order that depends only on the sequence's length and n_split,
 * so paged and contiguous placements of the same K/V give the same bits.
 */
#include <cuda_bf16.h>
#include <stdint.h>

#define WARPS 4
#define MAX_G 8

template <int D, int G>
__device__ __forceinline__ void decode_split(const float *__restrict__ q, float *__restrict__ part,
                                             const char *__restrict__ k_base,
                                             const char *__restrict__ v_base,
                                             uint64_t block_stride, uint64_t head_stride,
                                             const uint32_t *__restrict__ table,
                                             uint32_t max_blocks, uint32_t len, uint32_t bt,
                                             uint32_t kv_heads, float scale, uint32_t n_split,
                                             float (*sm)[MAX_G], float (*sl)[MAX_G],
                                             float (*sacc)[MAX_G][128])
{
    const int hd = 32 * D, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t seq = blockIdx.x / kv_heads, h = blockIdx.x % kv_heads, split = blockIdx.y;
    const uint32_t per = (len + n_split - 1) / n_split, first = split * per;
    const uint32_t end = min(len, first + per);
    float qr[G][D], acc[G][D], m[G], l[G];
    for (int g = 0; g < G; g++) {
        const float *qg = q + ((size_t)seq * kv_heads * G + (size_t)h * G + g) * hd + lane * D;
        for (int d = 0; d < D; d++) qr[g][d] = qg[d] * scale, acc[g][d] = 0.f;
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    for (uint32_t t = first + warp; t < end; t += WARPS) {
        uint64_t off = (uint64_t)table[(size_t)seq * max_blocks + t / bt] * block_stride +
                       h * head_stride + (uint64_t)(t % bt) * hd * 2 + lane * D * 2;
        /* one 4- or 8-byte load per row and lane (the lane's dims are aligned to it) */
        float k[D], v[D];
        for (int d = 0; d < D; d += 2) {
            __nv_bfloat162 kk = *(const __nv_bfloat162 *)(k_base + off + d * 2);
            __nv_bfloat162 vv = *(const __nv_bfloat162 *)(v_base + off + d * 2);
            float2 kf = __bfloat1622float2(kk), vf = __bfloat1622float2(vv);
            k[d] = kf.x, k[d + 1] = kf.y, v[d] = vf.x, v[d + 1] = vf.y;
        }
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            for (int d = 0; d < D; d++) s = fmaf(qr[g][d], k[d], s);
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            float mn = fmaxf(m[g], s), c = __expf(m[g] - mn), p = __expf(s - mn);
            l[g] = l[g] * c + p;
            for (int d = 0; d < D; d++) acc[g][d] = fmaf(acc[g][d], c, p * v[d]);
            m[g] = mn;
        }
    }
    /* The warps' states, merged in warp order by every thread of warp 0. */
    for (int g = 0; g < G; g++) {
        if (lane == 0) sm[warp][g] = m[g], sl[warp][g] = l[g];
        for (int d = 0; d < D; d++) sacc[warp][g][lane * D + d] = acc[g][d];
    }
    __syncthreads();
    if (warp != 0) return;
    for (int g = 0; g < G; g++) {
        float M = sm[0][g];
        for (int w = 1; w < WARPS; w++) M = fmaxf(M, sm[w][g]);
        float L = 0.f, a[D];
        for (int d = 0; d < D; d++) a[d] = 0.f;
        for (int w = 0; w < WARPS; w++) {
            float c = sm[w][g] == -INFINITY ? 0.f : __expf(sm[w][g] - M);
            L = fmaf(sl[w][g], c, L);
            for (int d = 0; d < D; d++) a[d] = fmaf(sacc[w][g][lane * D + d], c, a[d]);
        }
        /* part: [seq][q head][split][hd + 2]: acc, then m and l */
        float *pp = part + (((size_t)seq * kv_heads * G + (size_t)h * G + g) * n_split + split) *
                               (hd + 2);
        for (int d = 0; d < D; d++) pp[lane * D + d] = a[d];
        if (lane == 0) pp[hd] = M, pp[hd + 1] = L;
    }
}

/* One entry point per (head dim, group), each with its own register budget:
 * pkv_decode_attn_bf16_d<hd>_g<G>. */
#define DECODE_KERNEL(HD, G)                                                                       \
    extern "C" __global__ void __launch_bounds__(128) pkv_decode_attn_bf16_d##HD##_g##G(           \
        const float *q, float *part, const char *k_base, const char *v_base,                      \
        uint64_t block_stride, uint64_t head_stride, const uint32_t *table, uint32_t max_blocks,  \
        const uint32_t *lens, uint32_t bt, uint32_t kv_heads, float scale, uint32_t n_split)      \
    {                                                                                              \
        __shared__ float sm[WARPS][MAX_G], sl[WARPS][MAX_G], sacc[WARPS][MAX_G][128];              \
        decode_split<HD / 32, G>(q, part, k_base, v_base, block_stride, head_stride, table,        \
                                 max_blocks, lens[blockIdx.x / kv_heads], bt, kv_heads, scale,     \
                                 n_split, sm, sl, sacc);                                           \
    }

DECODE_KERNEL(64, 1)
DECODE_KERNEL(64, 2)
DECODE_KERNEL(64, 4)
DECODE_KERNEL(64, 8)
DECODE_KERNEL(128, 1)
DECODE_KERNEL(128, 2)
DECODE_KERNEL(128, 4)
DECODE_KERNEL(128, 8)

extern "C" __global__ void pkv_decode_attn_merge(const float *part, float *out, uint32_t hd,
                                                 uint32_t n_split)
{
    const size_t row = blockIdx.x;
    const float *pp = part + row * n_split * (hd + 2);
    float M = -INFINITY;
    for (uint32_t s = 0; s < n_split; s++) M = fmaxf(M, pp[s * (hd + 2) + hd]);
    float L = 0.f, a = 0.f;
    for (uint32_t s = 0; s < n_split; s++) {
        const float *ps = pp + s * (hd + 2);
        float c = ps[hd] == -INFINITY ? 0.f : __expf(ps[hd] - M);
        L = fmaf(ps[hd + 1], c, L);
        a = fmaf(ps[threadIdx.x], c, a);
    }
    out[row * hd + threadIdx.x] = L > 0.f ? a / L : 0.f;
}

/* KV write: a chunk of n_tokens of one sequence, from position p0, into its blocks. k and
 * v are float [n_tokens][kv_heads][hd]; element e (token i, head h, dim d) goes to
 * base + table[(p0 + i) / bt] * block_stride + h * head_stride + ((p0 + i) % bt) * hd * 2 + d * 2
 * as bf16, rounded to nearest even. One thread per element, two arrays. */
extern "C" __global__ void pkv_kv_write_bf16(const float *k, const float *v, char *k_base,
                                             char *v_base, uint64_t block_stride,
                                             uint64_t head_stride, const uint32_t *table,
                                             uint32_t p0, uint32_t n_tokens, uint32_t bt,
                                             uint32_t kv_heads, uint32_t hd)
{
    uint64_t e = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint64_t per_token = (uint64_t)kv_heads * hd;
    if (e >= per_token * n_tokens) return;
    uint32_t i = (uint32_t)(e / per_token), h = (uint32_t)(e % per_token / hd),
             d = (uint32_t)(e % hd), p = p0 + i;
    uint64_t off = (uint64_t)table[p / bt] * block_stride + h * head_stride +
                   ((uint64_t)(p % bt) * hd + d) * 2;
    *(__nv_bfloat16 *)(k_base + off) = __float2bfloat16_rn(k[e]);
    *(__nv_bfloat16 *)(v_base + off) = __float2bfloat16_rn(v[e]);
}

/* Staging: the pieces of a transfer between the pool's blocks and a contiguous buffer (a
 * registered host staging arena, mapped for the device: its bytes cross PCIe as the kernel
 * stores or loads them). Piece i is piece_bytes at src + off[i] (gather) or to dst + off[i]
 * (scatter), laid out in order in the buffer; piece_bytes a multiple of 16. One CTA per
 * piece, 16-byte accesses. */
extern "C" __global__ void pkv_stage_gather(const char *pool, char *buf, const uint64_t *off,
                                            uint32_t piece_bytes)
{
    const uint4 *s = (const uint4 *)(pool + off[blockIdx.x]);
    uint4 *d = (uint4 *)(buf + (uint64_t)blockIdx.x * piece_bytes);
    for (uint32_t i = threadIdx.x; i < piece_bytes / 16; i += blockDim.x) d[i] = s[i];
}

extern "C" __global__ void pkv_stage_scatter(char *pool, const char *buf, const uint64_t *off,
                                             uint32_t piece_bytes)
{
    const uint4 *s = (const uint4 *)(buf + (uint64_t)blockIdx.x * piece_bytes);
    uint4 *d = (uint4 *)(pool + off[blockIdx.x]);
    for (uint32_t i = threadIdx.x; i < piece_bytes / 16; i += blockDim.x) d[i] = s[i];
}
