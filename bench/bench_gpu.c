/*
 * pagekv bench gpu: the device granule arena on an NVIDIA GPU (docs/design/gpu.md,
 * docs/design/bench_gpu.md). Depends on src/gpu and src/core alone, so that
 * scripts/gpu-check.sh can build it on a GPU machine with nothing but cc and the driver
 * (tools/standalone/pagekv_gpu.c is its main there). Without a device it prints why and
 * exits 1.
 */
#include "bench/bench_gpu.h"
#include "gpu/gpu.h"
#include "tools/commands.h"

#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct {
    double p50, p99, max;
} bg_q_t;

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Quantiles of n samples in ns, as us. */
static bg_q_t quant(uint64_t *ns, uint32_t n)
{
    bg_q_t q = {0};
    if (!n) return q;
    qsort(ns, n, sizeof(*ns), cmp_u64);
    q.p50 = ns[n / 2] / 1e3;
    q.p99 = ns[(uint32_t)((n - 1) * 0.99)] / 1e3;
    q.max = ns[n - 1] / 1e3;
    return q;
}

typedef struct {
    FILE *json;
    bool first;
} bg_out_t;

static void out_q(bg_out_t *o, const char *name, bg_q_t q, const char *what)
{
    printf("| %-34s | %9.1f | %9.1f | %9.1f | %s |\n", name, q.p50, q.p99, q.max, what);
    if (o->json)
        fprintf(o->json,
                "%s\n    {\"name\": \"%s\", \"p50_us\": %.2f, \"p99_us\": %.2f, \"max_us\": %.2f}",
                o->first ? "" : ",", name, q.p50, q.p99, q.max);
    o->first = false;
}

#define BG_CHECK(expr)                                                                             \
    do {                                                                                           \
        int bg_rc_ = (expr);                                                                       \
        if (bg_rc_) {                                                                              \
            fprintf(stderr, "bench gpu: %s: %s\n", #expr, pkv_status_str(bg_rc_));                 \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

/* Each VMM call on its own, n granules: create, map, set access (per granule and once over
 * all of them), unmap, release. */
static int raw_ops(pkv_gpu_t *g, uint64_t gb, uint32_t n, bg_out_t *o)
{
    uint64_t *h = calloc(n, sizeof(*h)), *t[5];
    for (int k = 0; k < 5; k++) t[k] = calloc(n, sizeof(uint64_t));
    uint64_t va = 0, all_ns = 0, t0;
    uint32_t made = 0, mapped = 0, unmapped = 0, released = 0;
    int rc = PKV_ERR_NOMEM;
    if (!h || !t[0] || !t[1] || !t[2] || !t[3] || !t[4]) goto fail;
    BG_CHECK(pkv_gpu_va_reserve(g, gb * n, &va));
    for (; made < n; made++) {
        t0 = pkv_now_ns();
        BG_CHECK(pkv_gpu_phys_create(g, gb, &h[made]));
        t[0][made] = pkv_now_ns() - t0;
    }
    for (; mapped < n; mapped++) {
        t0 = pkv_now_ns();
        BG_CHECK(pkv_gpu_map(g, va + mapped * gb, gb, h[mapped]));
        uint64_t t1 = pkv_now_ns();
        if ((rc = pkv_gpu_set_access(g, va + mapped * gb, gb)) != PKV_OK) {
            pkv_gpu_unmap(g, va + mapped * gb, gb);
            goto fail;
        }
        t[1][mapped] = t1 - t0;
        t[2][mapped] = pkv_now_ns() - t1;
    }
    t0 = pkv_now_ns();
    BG_CHECK(pkv_gpu_set_access(g, va, gb * n)); /* one call over every mapping */
    all_ns = pkv_now_ns() - t0;
    BG_CHECK(pkv_gpu_memset(g, va, 0x5a, gb * n)); /* the range is usable */
    BG_CHECK(pkv_gpu_sync(g));
    for (; unmapped < n; unmapped++) {
        t0 = pkv_now_ns();
        BG_CHECK(pkv_gpu_unmap(g, va + unmapped * gb, gb));
        t[3][unmapped] = pkv_now_ns() - t0;
    }
    for (; released < n; released++) {
        t0 = pkv_now_ns();
        BG_CHECK(pkv_gpu_phys_release(g, h[released]));
        t[4][released] = pkv_now_ns() - t0;
    }
    out_q(o, "create (cuMemCreate)", quant(t[0], n), "per granule");
    out_q(o, "map (cuMemMap)", quant(t[1], n), "per granule");
    out_q(o, "set access (cuMemSetAccess)", quant(t[2], n), "per granule");
    double one = all_ns / 1e3 / n;
    out_q(o, "set access, one call over all", (bg_q_t){one, one, one}, "per granule, one call");
    out_q(o, "unmap (cuMemUnmap)", quant(t[3], n), "per granule");
    out_q(o, "release (cuMemRelease)", quant(t[4], n), "per granule");
    rc = PKV_OK;
fail:
    for (uint32_t i = unmapped; i < mapped; i++) pkv_gpu_unmap(g, va + i * gb, gb);
    for (uint32_t i = released; i < made; i++) pkv_gpu_phys_release(g, h[i]);
    if (va) pkv_gpu_va_free(g, va, gb * n);
    for (int k = 0; k < 5; k++) free(t[k]);
    free(h);
    return rc;
}

/* Growing by one granule through the arena: with a spare ready (refilled between
 * commits, as the refill thread does off the hot path) and with none. */
static int grow_by_one(pkv_gpu_t *g, uint32_t n, bool spare, bg_out_t *o, double *p99)
{
    pkv_gpu_arena_config_t c = {
        .n_granules = n, .spare_min = spare ? 4 : 0, .spare_max = spare ? 8 : 0};
    pkv_gpu_arena_t *a = NULL;
    uint64_t *t = calloc(n, sizeof(*t));
    int rc = PKV_ERR_NOMEM;
    if (!t) return rc;
    BG_CHECK(pkv_gpu_arena_create(g, &c, &a));
    for (uint32_t i = 0; i < n; i++) {
        if (spare) BG_CHECK(pkv_gpu_arena_fill_spares(a));
        uint64_t t0 = pkv_now_ns();
        BG_CHECK(pkv_gpu_arena_commit(a, i));
        t[i] = pkv_now_ns() - t0;
    }
    bg_q_t q = quant(t, n);
    *p99 = q.p99;
    out_q(o, spare ? "grow by one, a spare ready" : "grow by one, no spare", q,
          spare ? "arena commit: map + set access" : "arena commit: create + map + set access");
    rc = PKV_OK;
fail:
    pkv_gpu_arena_destroy(a);
    free(t);
    return rc;
}

/* The arena's counters against cuMemGetInfo's free bytes: after committing n granules,
 * after decommitting them (spares kept), and after a trim. */
static int counters(pkv_gpu_t *g, uint32_t n, bg_out_t *o, double *worst)
{
    pkv_gpu_arena_config_t c = {.n_granules = n, .spare_min = 0, .spare_max = n};
    pkv_gpu_arena_t *a = NULL;
    uint64_t free0, free1, total;
    pkv_gpu_arena_stats_t st;
    int rc = PKV_ERR_IO;
    *worst = 0;
    BG_CHECK(pkv_gpu_mem_info(g, &free0, &total));
    BG_CHECK(pkv_gpu_arena_create(g, &c, &a));
    const char *phase[3] = {"committed", "decommitted (spares kept)", "trimmed"};
    for (int p = 0; p < 3; p++) {
        for (uint32_t i = 0; i < n; i++) {
            if (p == 0) BG_CHECK(pkv_gpu_arena_commit(a, i));
            if (p == 1) BG_CHECK(pkv_gpu_arena_decommit(a, i));
        }
        if (p == 2) pkv_gpu_arena_trim(a);
        BG_CHECK(pkv_gpu_mem_info(g, &free1, &total));
        pkv_gpu_arena_stats(a, &st);
        double used = (double)free0 - (double)free1;
        double diff = used - (double)st.created_bytes;
        double rel = st.created_bytes ? diff / (double)st.created_bytes : diff / (double)(2u << 20);
        if (rel < 0) rel = -rel;
        if (rel > *worst) *worst = rel;
        printf("  %-26s arena created %8.1f MiB (mapped %8.1f, spare %8.1f); cuMemGetInfo used "
               "%8.1f MiB\n",
               phase[p], st.created_bytes / 1048576.0, st.mapped_bytes / 1048576.0,
               st.spare_bytes / 1048576.0, used / 1048576.0);
        if (o->json)
            fprintf(o->json,
                    "%s\n    {\"phase\": \"%s\", \"created_bytes\": %llu, \"mapped_bytes\": %llu, "
                    "\"spare_bytes\": %llu, \"driver_used_bytes\": %.0f}",
                    p ? "," : "", phase[p], (unsigned long long)st.created_bytes,
                    (unsigned long long)st.mapped_bytes, (unsigned long long)st.spare_bytes, used);
    }
    rc = PKV_OK;
fail:
    pkv_gpu_arena_destroy(a);
    return rc;
}

/* A child forked before this process touched the driver: it waits for a byte count, then
 * creates that much device memory in its own context and reports what it got. */
typedef struct {
    pid_t pid;
    int to, from;
} bg_child_t;

static void child_main(int in, int out)
{
    uint64_t want = 0, got[2] = {0, 0}; /* what it created; the device's free bytes at its open */
    if (read(in, &want, sizeof(want)) != sizeof(want)) _exit(1);
    pkv_gpu_t *g = NULL;
    char why[256];
    if (want && pkv_gpu_open(NULL, 0, &g, why, sizeof(why)) == PKV_OK) {
        pkv_gpu_info_t in_;
        pkv_gpu_info(g, &in_);
        uint64_t gb = PKV_MAX(in_.granule_rec, (uint64_t)2 << 20), h, total;
        pkv_gpu_mem_info(g, &got[1], &total);
        while (got[0] + gb <= want && pkv_gpu_phys_create(g, gb, &h) == PKV_OK) got[0] += gb;
        pkv_gpu_close(g); /* the process exits: its context goes, and its memory with it */
    }
    if (write(out, got, sizeof(got)) != sizeof(got)) _exit(1);
    _exit(0);
}

static int child_start(bg_child_t *c)
{
    int a[2], b[2];
    if (pipe(a) || pipe(b)) return PKV_ERR_IO;
    c->pid = fork();
    if (c->pid < 0) return PKV_ERR_IO;
    if (c->pid == 0) {
        close(a[1]);
        close(b[0]);
        child_main(a[0], b[1]);
    }
    close(a[0]);
    close(b[1]);
    c->to = a[1];
    c->from = b[0];
    return PKV_OK;
}

/* Ask the child for `bytes`: what it created and the free bytes it saw at its open (0s on
 * any failure); the child is reaped. */
static uint64_t child_alloc(bg_child_t *c, uint64_t bytes, uint64_t *free_at_open)
{
    uint64_t got[2] = {0, 0};
    if (write(c->to, &bytes, sizeof(bytes)) != sizeof(bytes) ||
        read(c->from, got, sizeof(got)) != sizeof(got))
        got[0] = got[1] = 0;
    close(c->to);
    close(c->from);
    waitpid(c->pid, NULL, 0);
    if (free_at_open) *free_at_open = got[1];
    return got[0];
}

/* Fill the device through the arena until cuMemCreate refuses (a typed PKV_ERR_NOMEM,
 * no crash), give everything back, and have another process take that memory. */
static int full_device(pkv_gpu_t *g, bg_child_t *child, bg_out_t *o, bool *back_ok)
{
    pkv_gpu_info_t in;
    pkv_gpu_info(g, &in);
    uint64_t gb = PKV_MAX(in.granule_rec, (uint64_t)2 << 20);
    uint32_t n = (uint32_t)(in.total_bytes / gb) + 1, committed = 0;
    pkv_gpu_arena_config_t c = {.n_granules = n};
    pkv_gpu_arena_t *a = NULL;
    int rc = PKV_ERR_IO, last = PKV_OK;
    *back_ok = false;
    BG_CHECK(pkv_gpu_arena_create(g, &c, &a));
    uint64_t t0 = pkv_now_ns();
    while (committed < n && (last = pkv_gpu_arena_commit(a, committed)) == PKV_OK) committed++;
    double fill_s = (pkv_now_ns() - t0) / 1e9;
    uint64_t base_before = pkv_gpu_arena_base(a);
    for (uint32_t i = 0; i < committed; i++) BG_CHECK(pkv_gpu_arena_decommit(a, i));
    pkv_gpu_arena_destroy(a);
    a = NULL;
    uint64_t want = (uint64_t)committed * gb, child_free = 0;
    uint64_t got = child_alloc(child, want, &child_free);
    child->pid = 0;
    /* the child's own context takes some of it: it must get all it saw free, less 2 granules */
    uint64_t need = PKV_MIN(want, child_free > 2 * gb ? child_free - 2 * gb : 0);
    *back_ok = last == PKV_ERR_NOMEM && need > want / 2 && got >= need;
    printf(
        "  filled the device: %u granules (%.1f GiB) in %.1f s, then the commit answered %s; "
        "given back, another process created %.1f of %.1f GiB: %s (the range stayed at 0x%llx)\n",
        committed, committed * (double)gb / 1073741824.0, fill_s, pkv_status_str(last),
        got / 1073741824.0, want / 1073741824.0, *back_ok ? "ok" : "NOT ok",
        (unsigned long long)base_before);
    if (o->json)
        fprintf(o->json,
                "\n  \"full_device\": {\"granules\": %u, \"commit_when_full\": \"%s\", "
                "\"given_back_bytes\": %llu, \"other_process_got_bytes\": %llu, \"ok\": %s},",
                committed, pkv_status_str(last), (unsigned long long)want, (unsigned long long)got,
                *back_ok ? "true" : "false");
    rc = PKV_OK;
fail:
    pkv_gpu_arena_destroy(a);
    return rc;
}

/* Device copy bandwidth: cuMemcpyDtoD of half of `bytes` into the other half, counting the
 * bytes read and written (median of 5). */
static double copy_gbps(pkv_gpu_t *g, uint64_t va, uint64_t bytes)
{
    uint64_t half = bytes / 2, ns[5];
    pkv_gpu_copy_device(g, va + half, va, half); /* warm-up */
    pkv_gpu_sync(g);
    for (int r = 0; r < 5; r++) {
        uint64_t t0 = pkv_now_ns();
        pkv_gpu_copy_device(g, va + half, va, half);
        pkv_gpu_sync(g);
        ns[r] = pkv_now_ns() - t0;
    }
    return 2.0 * half / (quant(ns, 5).p50 * 1e3);
}

typedef struct {
    const char *name;
    uint32_t kvh, hd, G, n_seq, len;
} bg_dec_t;

/* Decode attention, one layer: K/V bytes read per second, paged (each sequence's blocks
 * scattered over the pool) and contiguous (in order), against the device's copy bandwidth;
 * the median of 5 timings of 20 back-to-back launches. */
static int decode_bench(pkv_gpu_t *g, const char *fatbin, bg_out_t *o, double *worst_ratio,
                        double *worst_of_copy)
{
    static const bg_dec_t cases[] = {
        {"llama-3.2-1b 4096x8", 8, 64, 4, 8, 4096},
        {"llama-3.2-1b 16384x1", 8, 64, 4, 1, 16384},
        {"qwen3-0.6b 4096x8", 8, 128, 2, 8, 4096},
        {"qwen3-0.6b 16384x1", 8, 128, 2, 1, 16384},
    };
    const uint32_t bt = 16;
    pkv_gpu_attn_t *at = NULL;
    pkv_gpu_arena_t *a = NULL;
    uint32_t *tp = NULL, *tc = NULL;
    int rc = PKV_ERR_NOMEM;
    *worst_ratio = *worst_of_copy = 1e9;
    BG_CHECK(pkv_gpu_attn_load(g, fatbin, &at));
    /* Each case's K + V is laid out in copies (at least 512 MiB in all, past the L2) that
     * consecutive launches rotate through, so every launch reads from memory. */
    const uint64_t span = 512ull << 20, most = 2ull * 8 * 4096 * 8 * 128 * 2; /* qwen3 4096x8 */
    pkv_gpu_arena_config_t c = {.n_granules = (uint32_t)((span + 2 * most) / (2u << 20)) + 64};
    BG_CHECK(pkv_gpu_arena_create(g, &c, &a));
    for (uint32_t i = 0; i < c.n_granules; i++) BG_CHECK(pkv_gpu_arena_commit(a, i));
    uint64_t base = pkv_gpu_arena_base(a);
    pkv_gpu_arena_stats_t st;
    pkv_gpu_arena_stats(a, &st);
    double copy = copy_gbps(g, base, span);
    printf("\ndecode attention, one layer, bf16 K/V (device copy %.0f GB/s, read + written):\n"
           "| case | paged GB/s | contiguous GB/s | paged / contiguous | paged / copy | paged us a "
           "launch |\n|---|---:|---:|---:|---:|---:|\n",
           copy);
    for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
        const bg_dec_t *k = &cases[ci];
        uint32_t nbs = k->len / bt, nb = nbs * k->n_seq, nq = k->kvh * k->G;
        uint64_t piece = (uint64_t)bt * k->hd * 2, bstride = piece * k->kvh, pool = bstride * nb;
        uint32_t copies = (uint32_t)PKV_MAX(1, PKV_DIV_UP(span, 2 * pool));
        uint64_t kb = base, vb = base + pool * copies, tb = vb + pool * copies,
                 tcb = tb + nb * 4ull, lb = tcb + nb * 4ull, qb = lb + 256,
                 ob = qb + (uint64_t)k->n_seq * nq * k->hd * 4,
                 pb = ob + (uint64_t)k->n_seq * nq * k->hd * 4;
        uint32_t splits = pkv_gpu_decode_splits(at, k->n_seq, k->kvh, k->len);
        uint64_t end = pb + (uint64_t)k->n_seq * nq * splits * (k->hd + 2) * 4;
        if (end > base + st.reserved_bytes) goto fail;
        free(tp), free(tc);
        tp = malloc(nb * 4ull), tc = malloc(nb * 4ull);
        uint32_t lens[8] = {0};
        if (!tp || !tc) goto fail;
        uint64_t seed = 7;
        for (uint32_t i = 0; i < nb; i++) tc[i] = tp[i] = i;
        pkv_shuffle_u32(tp, nb, &seed);
        for (uint32_t s2 = 0; s2 < k->n_seq; s2++) lens[s2] = k->len;
        BG_CHECK(pkv_gpu_memset(g, kb, 0x3c, 2 * pool * copies)); /* ~0.0115 in bf16 */
        BG_CHECK(pkv_gpu_memset(g, qb, 0, (uint64_t)k->n_seq * nq * k->hd * 4));
        BG_CHECK(pkv_gpu_copy_from_host(g, tb, tp, nb * 4ull));
        BG_CHECK(pkv_gpu_copy_from_host(g, tcb, tc, nb * 4ull));
        BG_CHECK(pkv_gpu_copy_from_host(g, lb, lens, sizeof(lens)));
        double gbps[2], launch_us = 0;
        for (int paged = 1; paged >= 0; paged--) {
            pkv_gpu_decode_t p = {.q = qb,
                                  .out = ob,
                                  .part = pb,
                                  .k_base = kb,
                                  .v_base = vb,
                                  .block_stride = bstride,
                                  .head_stride = piece,
                                  .table = paged ? tb : tcb,
                                  .lens = lb,
                                  .max_blocks = nbs,
                                  .n_seq = k->n_seq,
                                  .block_tokens = bt,
                                  .kv_heads = k->kvh,
                                  .group = k->G,
                                  .head_dim = k->hd,
                                  .scale = 0.125f,
                                  .n_split = splits};
            uint64_t ns[5];
            BG_CHECK(pkv_gpu_decode_attn(at, &p));
            BG_CHECK(pkv_gpu_sync(g));
            for (int r = 0; r < 5; r++) {
                uint64_t t0 = pkv_now_ns();
                for (int it = 0; it < 20; it++) {
                    p.k_base = kb + (it % copies) * pool;
                    p.v_base = vb + (it % copies) * pool;
                    BG_CHECK(pkv_gpu_decode_attn(at, &p));
                }
                BG_CHECK(pkv_gpu_sync(g));
                ns[r] = pkv_now_ns() - t0;
            }
            double us = quant(ns, 5).p50 / 20.0;
            gbps[paged] = 2.0 * pool / (us * 1e3);
            if (paged) launch_us = us;
        }
        double ratio = gbps[1] / gbps[0], of_copy = gbps[1] / copy;
        *worst_ratio = ratio < *worst_ratio ? ratio : *worst_ratio;
        *worst_of_copy = of_copy < *worst_of_copy ? of_copy : *worst_of_copy;
        printf("| %s (%u splits) | %.0f | %.0f | %.3f | %.2f | %.1f |\n", k->name, splits, gbps[1],
               gbps[0], ratio, of_copy, launch_us);
        if (o->json)
            fprintf(o->json,
                    "%s\n    {\"case\": \"%s\", \"paged_gbps\": %.1f, \"contiguous_gbps\": %.1f, "
                    "\"copy_gbps\": %.1f}",
                    ci ? "," : "", k->name, gbps[1], gbps[0], copy);
    }
    rc = PKV_OK;
fail:
    free(tp);
    free(tc);
    pkv_gpu_arena_destroy(a);
    pkv_gpu_attn_unload(at);
    return rc;
}

/* Staging, llama-3.2-1b's geometry (16 layers, 8 KV heads, head dim 64, 16-token blocks:
 * a (block, layer, K or V) piece is 16 KiB): a request's pieces, scattered over the pool,
 * gathered by the kernel into a registered host arena and scattered back, against one bulk
 * copy of the same bytes between a contiguous device range and the arena (median of 5). */
static int stage_bench(pkv_gpu_t *g, const char *fatbin, bg_out_t *o, double *worst)
{
    const uint32_t piece = 16384, layers = 16, sizes[2] = {512, 2048};
    const uint32_t most = 2048 / 16 * layers * 2, slots = 2 * most;
    pkv_gpu_attn_t *at = NULL;
    pkv_gpu_arena_t *a = NULL;
    uint8_t *host = NULL;
    uint64_t *off = NULL, hva = 0;
    bool registered = false;
    int rc = PKV_ERR_NOMEM;
    *worst = 1e9;
    uint64_t pool_bytes = (uint64_t)slots * piece, host_bytes = (uint64_t)most * piece;
    if (posix_memalign((void **)&host, 4096, host_bytes) || !(off = malloc(most * 8ull))) goto fail;
    memset(host, 0, host_bytes); /* committed before it is registered */
    BG_CHECK(pkv_gpu_attn_load(g, fatbin, &at));
    pkv_gpu_arena_config_t c = {.n_granules = (uint32_t)(2 * pool_bytes / (2u << 20)) + 2};
    BG_CHECK(pkv_gpu_arena_create(g, &c, &a));
    for (uint32_t i = 0; i < c.n_granules; i++) BG_CHECK(pkv_gpu_arena_commit(a, i));
    uint64_t dpool = pkv_gpu_arena_base(a), dbulk = dpool + pool_bytes, doff = dbulk + host_bytes;
    uint64_t t0 = pkv_now_ns();
    BG_CHECK(pkv_gpu_host_register(g, host, host_bytes, &hva));
    registered = true;
    double reg_ms = (pkv_now_ns() - t0) / 1e6;
    uint64_t seed = 11;
    uint32_t *perm = malloc(slots * 4ull);
    if (!perm) goto fail;
    for (uint32_t i = 0; i < slots; i++) perm[i] = i;
    pkv_shuffle_u32(perm, slots, &seed);
    for (uint32_t i = 0; i < most; i++) off[i] = (uint64_t)perm[i] * piece;
    free(perm);
    BG_CHECK(pkv_gpu_copy_from_host(g, doff, off, most * 8ull));
    printf("\nstaging, llama-3.2-1b (16 KiB pieces), a registered host arena (registering %.1f MiB "
           "took %.1f ms, once):\n| tokens | MiB | gather to host GB/s | bulk DtoH GB/s | ratio | "
           "scatter from host GB/s | bulk HtoD GB/s | ratio "
           "|\n|---:|---:|---:|---:|---:|---:|---:|---:|\n",
           host_bytes / 1048576.0, reg_ms);
    for (int si = 0; si < 2; si++) {
        uint32_t n = sizes[si] / 16 * layers * 2;
        uint64_t bytes = (uint64_t)n * piece, ns[4][5];
        for (int r = 0; r < 5; r++) {
            uint64_t t1 = pkv_now_ns();
            BG_CHECK(pkv_gpu_stage_gather(at, dpool, hva, doff, n, piece));
            BG_CHECK(pkv_gpu_sync(g));
            uint64_t t2 = pkv_now_ns();
            BG_CHECK(pkv_gpu_copy_to_host(g, host, dbulk, bytes));
            uint64_t t3 = pkv_now_ns();
            BG_CHECK(pkv_gpu_stage_scatter(at, dpool, hva, doff, n, piece));
            BG_CHECK(pkv_gpu_sync(g));
            uint64_t t4 = pkv_now_ns();
            BG_CHECK(pkv_gpu_copy_from_host(g, dbulk, host, bytes));
            uint64_t t5 = pkv_now_ns();
            ns[0][r] = t2 - t1, ns[1][r] = t3 - t2, ns[2][r] = t4 - t3, ns[3][r] = t5 - t4;
        }
        double gbs[4];
        for (int k = 0; k < 4; k++) gbs[k] = bytes / (quant(ns[k], 5).p50 * 1e3);
        double r_out = gbs[0] / gbs[1], r_in = gbs[2] / gbs[3];
        *worst = PKV_MIN(*worst, PKV_MIN(r_out, r_in));
        printf("| %u | %.0f | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f |\n", sizes[si],
               bytes / 1048576.0, gbs[0], gbs[1], r_out, gbs[2], gbs[3], r_in);
        if (o->json)
            fprintf(o->json,
                    "%s\n    {\"tokens\": %u, \"bytes\": %llu, \"gather_gbps\": %.2f, "
                    "\"bulk_dtoh_gbps\": %.2f, \"scatter_gbps\": %.2f, \"bulk_htod_gbps\": %.2f}",
                    si ? "," : "", sizes[si], (unsigned long long)bytes, gbs[0], gbs[1], gbs[2],
                    gbs[3]);
    }
    rc = PKV_OK;
fail:
    if (registered) pkv_gpu_host_unregister(g, host);
    pkv_gpu_arena_destroy(a);
    pkv_gpu_attn_unload(at);
    free(host);
    free(off);
    return rc;
}

static int usage(void)
{
    fprintf(stderr,
            "usage: pagekv bench gpu [--json FILE] [--granules N] [--no-fill] [--kernels FATBIN]\n"
            "The device granule arena on an NVIDIA GPU: each VMM call's cost per granule,\n"
            "growing by one granule with and without a spare, the arena's counters against\n"
            "cuMemGetInfo, and the device filled, given back and taken by another process.\n"
            "  --granules N  granules per timing (default 256: 512 MiB of 2 MiB)\n"
            "  --no-fill     skip filling the whole device\n"
            "  --host-replay only the footprint replay, on a host pool (no device needed)\n"
            "  --kernels F   the kernels' fatbin (default build/gpu/pagekv-kernels.fatbin)\n"
            "Exit 0 when every part ran, 1 without a device or on an error, 2 for bad options.\n");
    return 2;
}

typedef struct {
    const char *json_path, *fatbin;
    uint32_t n;
    bool fill, host_replay;
} bg_opts_t;

typedef struct {
    double p99_spare, p99_none, worst, dec_ratio, dec_copy, stage_ratio;
    bool back_ok, have_kernels, replayed;
    bg_replay_t rp;
} bg_res_t;

static int parse_opts(int argc, char **argv, bg_opts_t *op)
{
    *op = (bg_opts_t){.n = 256, .fill = true, .fatbin = "build/gpu/pagekv-kernels.fatbin"};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json") && i + 1 < argc) {
            op->json_path = argv[++i];
        } else if (!strcmp(argv[i], "--granules") && i + 1 < argc) {
            char *end;
            unsigned long v = strtoul(argv[++i], &end, 10);
            if (*end || v < 16 || v > 65536) return usage();
            op->n = (uint32_t)v;
        } else if (!strcmp(argv[i], "--no-fill")) {
            op->fill = false;
        } else if (!strcmp(argv[i], "--host-replay")) {
            op->host_replay = true;
        } else if (!strcmp(argv[i], "--kernels") && i + 1 < argc) {
            op->fatbin = argv[++i];
        } else {
            return usage();
        }
    }
    return 0;
}

/* The device line; the granule the bench commits (the recommended one, at least 2 MiB). */
static uint64_t print_device(pkv_gpu_t *g, uint64_t *total)
{
    pkv_gpu_info_t in;
    pkv_gpu_info(g, &in);
    uint64_t freeb;
    pkv_gpu_mem_info(g, &freeb, total);
    uint64_t gb = PKV_MAX(in.granule_rec, (uint64_t)2 << 20);
    printf("pagekv bench gpu: %s (device %d, sm_%d%d, %d SMs), driver %d.%d (%s), %.1f GiB, %.1f "
           "free; VMM granularity min %llu KiB, recommended %llu KiB; granule %llu KiB\n",
           in.name, in.ordinal, in.cc_major, in.cc_minor, in.sm_count, in.driver_version / 1000,
           in.driver_version % 1000 / 10, in.driver_path, *total / 1073741824.0,
           freeb / 1073741824.0, (unsigned long long)in.granule_min >> 10,
           (unsigned long long)in.granule_rec >> 10, (unsigned long long)gb >> 10);
    return gb;
}

static void json_begin(pkv_gpu_t *g, FILE *f, uint64_t total, uint64_t gb)
{
    pkv_gpu_info_t in;
    pkv_gpu_info(g, &in);
    fprintf(f,
            "{\n  \"device\": \"%s\", \"cc\": \"%d.%d\", \"driver_version\": %d, "
            "\"total_bytes\": %llu, \"granule_bytes\": %llu,\n  \"ops\": [",
            in.name, in.cc_major, in.cc_minor, in.driver_version, (unsigned long long)total,
            (unsigned long long)gb);
}

/* Every part in order; each JSON list is opened and closed whether its part ran or not. */
static int run_parts(pkv_gpu_t *g, const bg_opts_t *op, uint64_t gb, bg_child_t *child, bg_out_t *o,
                     bg_res_t *r)
{
    printf("\n| op | p50 us | p99 us | max us | |\n|---|---:|---:|---:|---|\n");
    int rc = raw_ops(g, gb, op->n, o);
    if (!rc) rc = grow_by_one(g, op->n, true, o, &r->p99_spare);
    if (!rc) rc = grow_by_one(g, op->n, false, o, &r->p99_none);
    if (o->json) fprintf(o->json, "\n  ],\n  \"counters\": [");
    if (!rc) printf("\ncounters against the driver (cuMemGetInfo deltas):\n");
    if (!rc) rc = counters(g, 64, o, &r->worst);
    if (o->json) fprintf(o->json, "\n  ],");
    r->have_kernels = access(op->fatbin, R_OK) == 0;
    if (o->json) fprintf(o->json, "\n  \"decode\": [");
    if (!rc && r->have_kernels) rc = decode_bench(g, op->fatbin, o, &r->dec_ratio, &r->dec_copy);
    if (o->json) fprintf(o->json, "\n  ],\n  \"staging\": [");
    if (!rc && r->have_kernels) rc = stage_bench(g, op->fatbin, o, &r->stage_ratio);
    if (o->json) fprintf(o->json, "\n  ],");
    pkv_gpu_kv_storage_t *ks = NULL;
    pkv_gpu_arena_config_t sp = {.spare_min = 2, .spare_max = 8};
    if (!rc) rc = pkv_gpu_kv_storage_create(g, &sp, &ks);
    if (!rc) rc = bg_replay(g, ks, o->json, &r->rp);
    r->replayed = !rc;
    pkv_gpu_kv_storage_destroy(ks);
    if (!rc && op->fill) rc = full_device(g, child, o, &r->back_ok);
    return rc;
}

static const char *met(bool m, bool json)
{
    return json ? (m ? "true" : "false") : (m ? "met" : "NOT met");
}

static void print_targets(const bg_opts_t *op, const bg_res_t *r, FILE *json)
{
    bool spare = r->p99_spare <= 50.0, count = r->worst <= 0.02, dec = r->dec_ratio >= 0.95,
         copy = r->dec_copy >= 0.6, stage = r->stage_ratio >= 0.8;
    printf("\ntargets:\n- grow by one granule with a spare ready, p99 <= 50 us: %.1f us: %s "
           "(without one: %.1f us)\n- arena counters within 2 %% of cuMemGetInfo: worst %.2f %%: "
           "%s\n",
           r->p99_spare, met(spare, false), r->p99_none, r->worst * 100, met(count, false));
    if (op->fill)
        printf("- memory given back is usable by another process: %s\n", r->back_ok ? "yes" : "NO");
    if (r->have_kernels)
        printf("- decode attention, paged >= 0.95x contiguous: worst %.3f: %s; paged >= 60 %% of "
               "the copy bandwidth: worst %.0f %%: %s\n- staging through a registered host arena "
               ">= 0.8x a bulk copy: worst %.2f: %s\n",
               r->dec_ratio, met(dec, false), r->dec_copy * 100, met(copy, false), r->stage_ratio,
               met(stage, false));
    else
        printf("- decode attention: no kernels at %s (make GPU=1)\n", op->fatbin);
    if (r->replayed)
        printf("- footprint replay on the device pool: burst committed peak <= 1.05 x live + a "
               "granule: %s; idle back to a granule: %s; counters within 2 %% (or a granule) of "
               "the driver: worst %.2f x that: %s\n",
               met(r->rp.burst_met, false), met(r->rp.idle_met, false), r->rp.worst_driver,
               met(r->rp.worst_driver <= 1.0, false));
    if (!json) return;
    fprintf(json,
            "\n  \"targets\": [{\"name\": \"grow_by_one_p99_us_with_spare\", \"value\": %.2f, "
            "\"target\": 50, \"met\": %s}, {\"name\": \"counters_vs_driver\", \"value\": %.4f, "
            "\"target\": 0.02, \"met\": %s}",
            r->p99_spare, met(spare, true), r->worst, met(count, true));
    if (r->have_kernels)
        fprintf(json,
                ", {\"name\": \"decode_paged_over_contiguous\", \"value\": %.4f, \"target\": "
                "0.95, \"met\": %s}, {\"name\": \"decode_paged_of_copy\", \"value\": %.4f, "
                "\"target\": 0.6, \"met\": %s}, {\"name\": \"staging_over_bulk\", \"value\": "
                "%.4f, \"target\": 0.8, \"met\": %s}",
                r->dec_ratio, met(dec, true), r->dec_copy, met(copy, true), r->stage_ratio,
                met(stage, true));
    if (r->replayed)
        fprintf(json,
                ", {\"name\": \"replay_burst_committed_peak_mib\", \"value\": %.2f, \"target\": "
                "%.2f, \"met\": %s}, {\"name\": \"replay_idle_mib\", \"value\": %.2f, "
                "\"target\": %.2f, \"met\": %s}, {\"name\": \"replay_counters_vs_driver\", "
                "\"value\": %.4f, \"target\": 1.0, \"met\": %s}",
                r->rp.committed_peak_mib, r->rp.bound_mib, met(r->rp.burst_met, true),
                r->rp.idle_mib, r->rp.granule_mib, met(r->rp.idle_met, true), r->rp.worst_driver,
                met(r->rp.worst_driver <= 1.0, true));
    fprintf(json, "]\n}\n");
}

int pkv_bench_gpu(int argc, char **argv)
{
    bg_opts_t op;
    if (parse_opts(argc, argv, &op)) return 2;
    if (op.host_replay) { /* the replay itself, checked without a device */
        bg_replay_t rp;
        return bg_replay(NULL, NULL, NULL, &rp) ? 1 : 0;
    }
    bg_child_t child = {0};
    if (op.fill && pkv_gpu_built() && child_start(&child)) return 1; /* before the driver */
    pkv_gpu_t *g = NULL;
    char why[320];
    if (pkv_gpu_open(NULL, 0, &g, why, sizeof(why))) {
        printf("pagekv bench gpu: %s\n", why);
        if (child.pid > 0) child_alloc(&child, 0, NULL);
        return 1;
    }
    uint64_t total, gb = print_device(g, &total);
    bg_out_t o = {.first = true};
    bg_res_t r = {0};
    int rc = 0;
    if (op.json_path && !(o.json = fopen(op.json_path, "w"))) {
        fprintf(stderr, "bench gpu: cannot write %s\n", op.json_path);
        rc = 1;
    }
    if (!rc) {
        if (o.json) json_begin(g, o.json, total, gb);
        rc = run_parts(g, &op, gb, &child, &o, &r);
        print_targets(&op, &r, o.json);
        if (o.json) fclose(o.json);
    }
    if (child.pid > 0) child_alloc(&child, 0, NULL);
    pkv_gpu_close(g);
    return rc ? 1 : 0;
}
