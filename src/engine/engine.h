/*
 * engine's module interface: what other modules, tools and benchmarks may use beyond
 * include/pagekv/engine.h. Next-token choice from logits (sample.c): greedy (argmax,
 * lowest id on ties) or temperature + nucleus (top-p) sampling driven by a caller-owned
 * RNG state, so the same state and logits always give the same token.
 */
#ifndef PKV_ENGINE_ENGINE_H
#define PKV_ENGINE_ENGINE_H

#include <stdint.h>

typedef struct {
    float p;
    int32_t id;
} pkv_engine_sample_cand_t;

/* splitmix64 step; returns a float in [0, 1). */
float pkv_engine_sample_rand01(uint64_t *state);
int32_t pkv_engine_sample_argmax(const float *logits, uint32_t n);
/* temperature <= 0: argmax (rng untouched). Else one draw from the rng. probs and cand
 * are scratch of n entries. */
int32_t pkv_engine_sample(const float *logits, uint32_t n, float temperature, float top_p,
                          uint64_t *rng, float *probs, pkv_engine_sample_cand_t *cand);
/* Advance rng as pkv_engine_sample over n logits would (one draw when it samples): a token
 * sampled elsewhere from the same state then leaves the same state here. */
void pkv_engine_sample_skip(uint32_t n, float temperature, uint64_t *rng);

#endif
