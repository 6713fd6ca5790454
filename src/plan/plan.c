/*
 * plan: the memory planner's arithmetic (see plan.h and docs/design/plan.md).
 *
 * Every product and sum goes through ck_mul / ck_add, which record the first overflow
 * (naming the figure) in the plan context; compute then fails with that reason.
 */
#include "plan/plan.h"

#include "core/core.h"
#include "pagekv/model.h"
#include "prim/prim.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PLAN_DEFAULT_PAGE_TOKENS 64
/* The exact tail distribution is computed when it stays small; otherwise the normal
 * approximation (the in-flight count is then large, where it is accurate). */
#define PLAN_TAIL_MAX_BINS (1u << 22)
#define PLAN_TAIL_MAX_WORK (1ull << 31)
/* z of the standard normal exceeded with probability PKV_PLAN_TAIL_EXCEED (1e-5). */
#define PLAN_TAIL_Z 4.264891

typedef struct {
    char *err;
    size_t err_len;
    bool failed;
} plan_ctx_t;

static int plan_fail(plan_ctx_t *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int plan_fail(plan_ctx_t *c, const char *fmt, ...)
{
    if (!c->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err, c->err_len, fmt, ap);
        va_end(ap);
        c->failed = true;
    }
    return PKV_ERR_INVALID;
}

/* a x b (op '*') or a + b (op '+'); on overflow 0, and the plan fails naming `what`. */
static uint64_t ck_op(plan_ctx_t *c, uint64_t a, char op, uint64_t b, const char *what)
{
    uint64_t r;
    bool over = op == '*' ? __builtin_mul_overflow(a, b, &r) : __builtin_add_overflow(a, b, &r);
    if (!over) return r;
    plan_fail(c, "%s does not fit in 64 bits (%llu %c %llu)", what, (unsigned long long)a,
              op == '*' ? 'x' : '+', (unsigned long long)b);
    return 0;
}

static uint64_t ck_mul(plan_ctx_t *c, uint64_t a, uint64_t b, const char *what)
{
    return ck_op(c, a, '*', b, what);
}

static uint64_t ck_add(plan_ctx_t *c, uint64_t a, uint64_t b, const char *what)
{
    return ck_op(c, a, '+', b, what);
}

/* calloc through the PKV_FAULT_ALLOC fault-simulation site. */
static void *plan_calloc(size_t n, size_t size)
{
    return pkv_fault_hit(PKV_FAULT_ALLOC) ? NULL : calloc(n, size);
}

static uint64_t div_up(uint64_t a, uint64_t b)
{
    return a / b + (a % b != 0);
}

/* ---- presets ------------------------------------------------------------------------ */

int pkv_plan_preset(const char *name, pkv_plan_input_t *in)
{
    if (!name || !in) return PKV_ERR_INVALID;
    if (!strcmp(name, "gpt-oss-120b")) {
        in->layers = 36;
        in->kv_heads = 8;
        in->head_dim = 64;
    } else {
        pkv_model_config_t cfg;
        int rc = pkv_model_preset(name, &cfg);
        if (rc != PKV_OK) return rc;
        in->layers = cfg.n_layers;
        in->kv_heads = cfg.n_kv_heads;
        in->head_dim = cfg.head_dim;
    }
    in->dtype = PKV_DTYPE_BF16;
    return PKV_OK;
}

/* ---- input -------------------------------------------------------------------------- */

static int check_tp(plan_ctx_t *c, const char *side, uint32_t tp, uint32_t kv_heads)
{
    if (tp == 0) return plan_fail(c, "%s TP must be at least 1", side);
    if (kv_heads % tp && tp % kv_heads)
        return plan_fail(c,
                         "%s TP %u neither divides the %u KV heads nor replicates them (a "
                         "multiple of %u)",
                         side, tp, kv_heads, kv_heads);
    return PKV_OK;
}

static int check_tokens(plan_ctx_t *c, const char *what, uint64_t tokens, uint64_t context)
{
    if (tokens == 0) return plan_fail(c, "%s must be at least 1 token", what);
    if (tokens > context)
        return plan_fail(c, "%s of %llu tokens is longer than the context (%llu tokens)", what,
                         (unsigned long long)tokens, (unsigned long long)context);
    return PKV_OK;
}

/* Fill the defaults into `in` and check it. */
static int plan_input(plan_ctx_t *c, pkv_plan_input_t *in)
{
    if (!in->layers || !in->kv_heads || !in->head_dim)
        return plan_fail(c, "layers, KV heads and head dim must all be at least 1 (got %u, %u, %u)",
                         in->layers, in->kv_heads, in->head_dim);
    if ((unsigned)in->dtype >= PKV_DTYPE_COUNT)
        return plan_fail(c, "unknown dtype %d", (int)in->dtype);
    if (check_tp(c, "prefill", in->prefill_tp, in->kv_heads) ||
        check_tp(c, "decode", in->decode_tp, in->kv_heads))
        return PKV_ERR_INVALID;
    if (!in->page_tokens) in->page_tokens = PLAN_DEFAULT_PAGE_TOKENS;
    if (in->granule_bytes % PKV_PRIM_PAGE)
        return plan_fail(c, "granule of %llu bytes is not a multiple of 4 KiB",
                         (unsigned long long)in->granule_bytes);
    if (!in->context) return plan_fail(c, "the context must be at least 1 token");
    if (in->pull_block_tokens > in->context)
        return plan_fail(c, "a block of %llu tokens is larger than the context (%llu tokens)",
                         (unsigned long long)in->pull_block_tokens,
                         (unsigned long long)in->context);
    if (in->page_tokens > in->context)
        return plan_fail(c, "a page of %llu tokens is larger than the context (%llu tokens)",
                         (unsigned long long)in->page_tokens, (unsigned long long)in->context);
    if (!in->concurrency) return plan_fail(c, "concurrency must be at least 1");
    if (!in->in_flight_set) in->in_flight = in->concurrency;
    in->in_flight_set = true;
    if (in->n_mix > PKV_PLAN_MAX_MIX || in->n_long > PKV_PLAN_MAX_LONG)
        return plan_fail(c, "at most %d mix entries and %d long transfers", PKV_PLAN_MAX_MIX,
                         PKV_PLAN_MAX_LONG);
    if (!in->n_mix) in->mix[in->n_mix++] = (pkv_plan_mix_t){in->context, 1};
    for (uint32_t i = 0; i < in->n_mix; i++) {
        if (check_tokens(c, "a mix entry", in->mix[i].tokens, in->context)) return PKV_ERR_INVALID;
        if (!in->mix[i].weight) return plan_fail(c, "a mix weight must be at least 1");
    }
    for (uint32_t i = 0; i < in->n_long; i++) {
        if (check_tokens(c, "a long transfer", in->longs[i].tokens, in->context))
            return PKV_ERR_INVALID;
        if (!in->longs[i].count) return plan_fail(c, "a long transfer's count must be at least 1");
    }
    return PKV_OK;
}

/* ---- the per-transfer load (pages, per side) ------------------------------------------ */

static uint64_t heads_per_rank(const pkv_plan_input_t *in, uint32_t tp)
{
    return tp <= in->kv_heads ? in->kv_heads / tp : 1;
}

/* How one rank of a side holds a transfer in staging: staging is per read, so a rank holds
 * `reads` slices (one per peer rank it reads from or serves), each of `slice_heads` of its
 * `rank_heads` heads and rounded up to whole pages apart. A decode rank reads its heads
 * from every prefill rank holding part of them (P / D when P > D); a prefill rank serves
 * every decode rank reading its heads (D / P when D > P, replicas included). Exact when
 * one TP divides the other. */
typedef struct {
    uint64_t reads, slice_heads, rank_heads;
} plan_slices_t;

static plan_slices_t side_slices(const pkv_plan_input_t *in, bool decode)
{
    uint64_t hp = heads_per_rank(in, in->prefill_tp), hd = heads_per_rank(in, in->decode_tp);
    uint64_t p = in->prefill_tp, d = in->decode_tp;
    if (decode) return hp < hd ? (plan_slices_t){hd / hp, hp, hd} : (plan_slices_t){1, hd, hd};
    return d > p ? (plan_slices_t){d / p, hd, hp} : (plan_slices_t){1, hp, hp};
}

/* Staging pages on one rank of a side for a transfer of an n-token context (see
 * pull_block_tokens). */
static uint64_t transfer_pages(plan_ctx_t *c, const pkv_plan_input_t *in, const plan_slices_t *sl,
                               uint64_t n)
{
    uint64_t b = in->pull_block_tokens;
    uint64_t moved = b ? (n - 1) / b * b : n;
    uint64_t one = div_up(ck_mul(c, moved, sl->slice_heads, "a slice's tokens"),
                          ck_mul(c, in->page_tokens, sl->rank_heads, "a page's head tokens"));
    return ck_mul(c, sl->reads, one, "a transfer's pages");
}

typedef struct {
    uint64_t pages[PKV_PLAN_MAX_MIX];  /* per mix entry */
    uint64_t weight[PKV_PLAN_MAX_MIX]; /* per mix entry: its weight among transfers in flight */
    uint64_t max_pages;
    uint64_t long_pages; /* sum over the long transfers */
    uint64_t mean_pages; /* in_flight x mix mean, rounded up, + long_pages */
    double mean_exact;   /* in_flight x mix mean + long_pages */
    uint64_t tail_pages;
    bool tail_exact;
} plan_load_t;

/* Pages in flight exceeded with probability <= PKV_PLAN_TAIL_EXCEED: the exact
 * distribution of n independent draws from the mix (dynamic programming over the pages
 * in flight). 1 when it was computed, 0 when too large, PKV_ERR_NOMEM. */
static int tail_exact(const pkv_plan_input_t *in, const plan_load_t *l, uint64_t wsum,
                      uint64_t *out)
{
    uint64_t n = in->in_flight;
    if (l->max_pages == 0) return *out = 0, 1; /* no transfer moves a page */
    if (n >= PLAN_TAIL_MAX_BINS / l->max_pages) return 0;
    uint64_t bins = n * l->max_pages + 1; /* < 2^22 */
    if (n * bins * in->n_mix > PLAN_TAIL_MAX_WORK) return 0;
    double *cur = plan_calloc(bins, sizeof(double)), *nxt = plan_calloc(bins, sizeof(double));
    int rc = PKV_ERR_NOMEM;
    if (!cur || !nxt) goto out;
    cur[0] = 1.0;
    uint64_t top = 0; /* highest reachable sum so far */
    for (uint64_t t = 0; t < n; t++) {
        memset(nxt, 0, (top + l->max_pages + 1) * sizeof(double));
        for (uint64_t s = 0; s <= top; s++) {
            if (cur[s] == 0.0) continue;
            for (uint32_t i = 0; i < in->n_mix; i++)
                nxt[s + l->pages[i]] += cur[s] * ((double)l->weight[i] / (double)wsum);
        }
        top += l->max_pages;
        double *tmp = cur;
        cur = nxt;
        nxt = tmp;
    }
    double above = 0.0; /* P(pages > s) */
    uint64_t s = top;
    while (s > 0 && above + cur[s] <= PKV_PLAN_TAIL_EXCEED) above += cur[s--];
    *out = s;
    rc = 1;
out:
    free(cur);
    free(nxt);
    return rc;
}

static int plan_load(plan_ctx_t *c, const pkv_plan_input_t *in, bool decode, plan_load_t *l)
{
    memset(l, 0, sizeof(*l));
    plan_slices_t sl = side_slices(in, decode);
    uint64_t wsum = 0, wpages = 0;
    double m2 = 0.0;
    bool moves = false; /* some entry moves a page */
    for (uint32_t i = 0; i < in->n_mix; i++) {
        l->pages[i] = transfer_pages(c, in, &sl, in->mix[i].tokens);
        moves |= l->pages[i] > 0;
    }
    for (uint32_t i = 0; i < in->n_mix; i++) {
        l->weight[i] = in->mix_of_requests && moves
                           ? ck_mul(c, in->mix[i].weight, l->pages[i], "a mix entry's weight")
                           : in->mix[i].weight;
        if (l->weight[i]) l->max_pages = PKV_MAX(l->max_pages, l->pages[i]);
        wsum = ck_add(c, wsum, l->weight[i], "the mix's weights");
        wpages = ck_add(c, wpages, ck_mul(c, l->weight[i], l->pages[i], "a mix entry's pages"),
                        "the mix's pages");
        m2 += (double)l->weight[i] * (double)l->pages[i] * (double)l->pages[i];
    }
    for (uint32_t i = 0; i < in->n_long; i++)
        l->long_pages =
            ck_add(c, l->long_pages,
                   ck_mul(c, in->longs[i].count, transfer_pages(c, in, &sl, in->longs[i].tokens),
                          "the long transfers' pages"),
                   "the long transfers' pages");
    uint64_t worst = ck_mul(c, in->in_flight, l->max_pages, "the pages in flight");
    uint64_t num = ck_mul(c, in->in_flight, wpages, "the pages in flight");
    ck_add(c, worst, l->long_pages, "the pages in flight");
    if (c->failed) return PKV_ERR_INVALID;
    l->mean_pages = ck_add(c, div_up(num, wsum), l->long_pages, "the pages in flight");
    double mean1 = (double)wpages / (double)wsum;
    l->mean_exact = (double)in->in_flight * mean1 + (double)l->long_pages;
    uint64_t tail = 0;
    int rc = tail_exact(in, l, wsum, &tail);
    if (rc < 0) return plan_fail(c, "out of memory for the tail distribution"), PKV_ERR_NOMEM;
    l->tail_exact = rc == 1;
    if (!l->tail_exact) {
        double var = m2 / (double)wsum - mean1 * mean1;
        double t = (double)in->in_flight * mean1 +
                   PLAN_TAIL_Z * sqrt((double)in->in_flight * (var > 0 ? var : 0));
        tail = (double)worst < t ? worst : (uint64_t)ceil(t);
    }
    l->tail_pages = PKV_MAX(tail + l->long_pages, l->mean_pages);
    return PKV_OK;
}

/* ---- one side ----------------------------------------------------------------------- */

/* Per-rank figures of one side. */
static void plan_rank(plan_ctx_t *c, const pkv_plan_input_t *in, const plan_load_t *l,
                      pkv_plan_side_t *s)
{
    pkv_plan_bytes_t *r = &s->rank;
    uint64_t row = pkv_dtype_row_bytes(in->dtype, in->head_dim); /* head_dim <= 2^16: no wrap */
    r->token_bytes =
        ck_mul(c, ck_mul(c, (uint64_t)in->layers * 2, s->heads_per_rank, "token bytes"), row,
               "token bytes");
    r->page_bytes = ck_mul(c, in->page_tokens, r->token_bytes, "page bytes");
    uint64_t ctx_bytes = ck_mul(c, in->context, r->token_bytes, "the context's bytes");
    if (c->failed) return;
    s->slot_pages = div_up(ctx_bytes, r->page_bytes); /* the staging's arithmetic */
    s->fixed_pages = ck_mul(c, in->concurrency, s->slot_pages, "fixed-slot pages");
    r->fixed_bytes = ck_mul(c, s->fixed_pages, r->page_bytes, "fixed-slot staging");
    s->mean_pages = l->mean_pages;
    s->tail_pages = l->tail_pages;
    s->tail_exact = l->tail_exact;
    r->per_transfer_mean_bytes = ck_mul(c, l->mean_pages, r->page_bytes, "per-transfer staging");
    r->per_transfer_tail_bytes = ck_mul(c, l->tail_pages, r->page_bytes, "per-transfer staging");
    r->per_plan_bytes = r->per_transfer_mean_bytes;
    r->device_pool_bytes = in->device_pool_bytes ? in->device_pool_bytes : r->fixed_bytes;
    r->mirror_bytes = r->device_pool_bytes;
    /* The pool: a block is one page of this rank; granules as kv_pool_create cuts them. */
    s->block_bytes = r->page_bytes;
    if (c->failed) return;
    uint64_t gran = in->granule_bytes ? in->granule_bytes : pkv_prim_granule_for(s->block_bytes);
    s->blocks_per_granule = PKV_MAX(1, gran / s->block_bytes);
    s->granule_bytes = ck_mul(c, s->blocks_per_granule, s->block_bytes, "the granule");
    if (!c->failed) s->granule_bytes = pkv_prim_granule_stride(s->granule_bytes);
    s->pool_blocks = div_up(r->device_pool_bytes, s->block_bytes);
    r->paged_peak_bytes = ck_mul(c, div_up(s->pool_blocks, s->blocks_per_granule), s->granule_bytes,
                                 "the paged pool's peak");
    r->copy_grow_bytes = ck_mul(c, r->device_pool_bytes, 2, "the copy-on-grow peak");
}

static int plan_side(plan_ctx_t *c, const pkv_plan_input_t *in, const plan_load_t *l, uint32_t tp,
                     pkv_plan_side_t *s)
{
    memset(s, 0, sizeof(*s));
    s->tp = tp;
    s->heads_per_rank = heads_per_rank(in, tp);
    s->replicas = tp <= in->kv_heads ? 1 : tp / in->kv_heads;
    s->ranks_per_host = in->ranks_per_host ? in->ranks_per_host : tp;
    plan_rank(c, in, l, s);
    const pkv_plan_bytes_t *r = &s->rank;
    uint64_t n = s->ranks_per_host;
    const char *w = "a per-host figure";
    s->host = (pkv_plan_bytes_t){
        .token_bytes = ck_mul(c, r->token_bytes, n, w),
        .page_bytes = ck_mul(c, r->page_bytes, n, w),
        .device_pool_bytes = ck_mul(c, r->device_pool_bytes, n, w),
        .fixed_bytes = ck_mul(c, r->fixed_bytes, n, w),
        .per_transfer_mean_bytes = ck_mul(c, r->per_transfer_mean_bytes, n, w),
        .per_transfer_tail_bytes = ck_mul(c, r->per_transfer_tail_bytes, n, w),
        .mirror_bytes = ck_mul(c, r->mirror_bytes, n, w),
        .per_plan_bytes = ck_mul(c, r->per_plan_bytes, n, w),
        .paged_peak_bytes = ck_mul(c, r->paged_peak_bytes, n, w),
        .copy_grow_bytes = ck_mul(c, r->copy_grow_bytes, n, w),
    };
    return c->failed ? PKV_ERR_INVALID : PKV_OK;
}

/* a / b, or 0 when b is 0 (nothing in flight). */
static double ratio(uint64_t a, uint64_t b)
{
    return b ? (double)a / (double)b : 0.0;
}

int pkv_plan_compute(const pkv_plan_input_t *in, pkv_plan_t *out)
{
    if (!in || !out) return PKV_ERR_INVALID;
    pkv_plan_t p;
    memset(&p, 0, sizeof(p));
    p.in = *in;
    plan_ctx_t c = {out->err, sizeof(out->err), false};
    plan_load_t lp, ld;
    int rc = plan_input(&c, &p.in);
    if (!rc) rc = plan_load(&c, &p.in, false, &lp);
    if (!rc) rc = plan_load(&c, &p.in, true, &ld);
    if (!rc) rc = plan_side(&c, &p.in, &lp, p.in.prefill_tp, &p.prefill);
    if (!rc) rc = plan_side(&c, &p.in, &ld, p.in.decode_tp, &p.decode);
    if (rc) return rc;
    const pkv_plan_bytes_t *d = &p.decode.rank;
    p.mean_pages_exact = ld.mean_exact;
    p.fixed_over_per_transfer = ratio(d->fixed_bytes, d->per_transfer_mean_bytes);
    p.mirror_over_per_plan = ratio(d->mirror_bytes, d->per_plan_bytes);
    p.copy_grow_over_paged = ratio(d->copy_grow_bytes, d->paged_peak_bytes);
    *out = p; /* err empty */
    return PKV_OK;
}

/* ---- the field report's table ---------------------------------------------------------- */

static const pkv_plan_mix_t field_mix[] = {{128, 55}, {512, 30}, {4096, 10}, {8192, 5}};

int pkv_plan_field(const pkv_plan_input_t *geo, pkv_plan_field_row_t rows[PKV_PLAN_FIELD_ROWS],
                   char *err, size_t err_len)
{
    static const char *const assume[PKV_PLAN_FIELD_ROWS] = {
        "64 slots of 8k; 64-way concurrency; 64 transfers of the mix 128:55,512:30,4096:10,"
        "8192:5 in flight; mirror of a 56.5 GiB device pool per rank",
        "64 slots of 128k; 64-way concurrency; 64 transfers of the mix + 1 of 128k in flight; "
        "mirror of a 56.5 GiB device pool per rank",
        "64 slots of 1M; 64-way concurrency; 64 transfers of 8k + 1 of 1M in flight; mirror "
        "of a 56.5 GiB device pool per rank"};
    static const uint64_t ctx[PKV_PLAN_FIELD_ROWS] = {8192, 131072, 1048576};
    pkv_plan_t *p = plan_calloc(1, sizeof(*p));
    if (!p) {
        snprintf(err, err_len, "out of memory");
        return PKV_ERR_NOMEM;
    }
    int rc = PKV_OK;
    for (int i = 0; i < PKV_PLAN_FIELD_ROWS && rc == PKV_OK; i++) {
        pkv_plan_input_t in = *geo;
        in.context = ctx[i];
        in.concurrency = 64;
        in.in_flight = 64;
        in.in_flight_set = true;
        in.device_pool_bytes = 113ull << 29; /* 56.5 GiB */
        in.pull_block_tokens = 0;            /* the field's connectors move every token */
        in.n_mix = i == 2 ? 1 : (uint32_t)PKV_ARRAY_LEN(field_mix);
        memcpy(in.mix, i == 2 ? &field_mix[3] : field_mix, in.n_mix * sizeof(in.mix[0]));
        in.n_long = i == 0 ? 0 : 1;
        in.longs[0] = (pkv_plan_long_t){ctx[i], 1};
        rc = pkv_plan_compute(&in, p);
        if (rc) {
            snprintf(err, err_len, "%s", p->err);
            break;
        }
        rows[i] = (pkv_plan_field_row_t){.context_tokens = ctx[i],
                                         .token_bytes_per_rank = p->decode.rank.token_bytes,
                                         .page_bytes_per_rank = p->decode.rank.page_bytes,
                                         .fixed_host_bytes = p->decode.host.fixed_bytes,
                                         .per_transfer_host_bytes =
                                             p->decode.host.per_transfer_mean_bytes,
                                         .mirror_host_bytes = p->decode.host.mirror_bytes,
                                         .per_plan_host_bytes = p->decode.host.per_plan_bytes,
                                         .assumptions = assume[i]};
    }
    free(p);
    return rc;
}
