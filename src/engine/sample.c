/* sample: greedy and temperature / top-p sampling (see engine/engine.h). */
#include "engine/engine.h"

#include "core/core.h"

#include <math.h>
#include <stdlib.h>

float pkv_engine_sample_rand01(uint64_t *s)
{
    return (float)(pkv_splitmix64(s) >> 40) * (1.0f / 16777216.0f);
}

int32_t pkv_engine_sample_argmax(const float *logits, uint32_t n)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return (int32_t)best;
}

static int cand_cmp(const void *a, const void *b)
{
    const pkv_engine_sample_cand_t *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static bool draws(uint32_t n, float temperature)
{
    return temperature > 0.0f && n > 1;
}

void pkv_engine_sample_skip(uint32_t n, float temperature, uint64_t *rng)
{
    if (draws(n, temperature)) (void)pkv_engine_sample_rand01(rng);
}

int32_t pkv_engine_sample(const float *logits, uint32_t n, float temperature, float top_p,
                          uint64_t *rng, float *probs, pkv_engine_sample_cand_t *cand)
{
    if (!draws(n, temperature)) return pkv_engine_sample_argmax(logits, n);
    float mx = logits[pkv_engine_sample_argmax(logits, n)];
    double sum = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        probs[i] = expf((logits[i] - mx) / temperature);
        sum += probs[i];
    }
    float inv = (float)(1.0 / sum);
    for (uint32_t i = 0; i < n; i++) probs[i] *= inv;
    float coin = pkv_engine_sample_rand01(rng);
    if (!(top_p > 0.0f) || top_p >= 1.0f) {
        float cdf = 0.0f;
        for (uint32_t i = 0; i < n; i++) {
            cdf += probs[i];
            if (coin < cdf) return (int32_t)i;
        }
        return (int32_t)(n - 1);
    }
    /* Nucleus: tokens below (1 - top_p) / (n - 1) can never be in the nucleus (as in
     * llama2.c), so only the rest are sorted. */
    float cutoff = (1.0f - top_p) / (float)(n - 1);
    uint32_t nc = 0;
    for (uint32_t i = 0; i < n; i++)
        if (probs[i] >= cutoff) cand[nc++] = (pkv_engine_sample_cand_t){probs[i], (int32_t)i};
    if (nc == 0) return pkv_engine_sample_argmax(logits, n);
    qsort(cand, nc, sizeof(*cand), cand_cmp);
    float cum = 0.0f;
    uint32_t last = nc - 1;
    for (uint32_t i = 0; i < nc; i++) {
        cum += cand[i].p;
        if (cum > top_p) {
            last = i;
            break;
        }
    }
    float r = coin * cum, cdf = 0.0f;
    for (uint32_t i = 0; i <= last; i++) {
        cdf += cand[i].p;
        if (r < cdf) return cand[i].id;
    }
    return cand[last].id;
}
