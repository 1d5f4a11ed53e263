/* One position of KDA's gated delta rule on one head's state S [K, V] (row-major), shared by
 * the recurrence kernel (kda_cpu.c) and the fused decode blocks (decode_blocks.h):
 *   S <- diag(exp(g)) S;  kv = k^T S;  S <- S + k (beta (v - kv))^T;  out = q^T S.
 * kv, delta [V] and decay [K] are the caller's scratch. */
#ifndef KDASERVE_KDA_STEP_H
#define KDASERVE_KDA_STEP_H

#include <stdint.h>

#include "fastmath.h"

static inline void kda_step(float *S, const float *q, const float *k, const float *v,
                            const float *g, float beta, float *out, int64_t K, int64_t V,
                            float *kv, float *delta, float *decay) {
    for (int64_t j = 0; j < V; ++j) kv[j] = 0.0f;
    for (int64_t i = 0; i < K; ++i) decay[i] = exp_approx(g[i]);
    for (int64_t i = 0; i < K; ++i) {
        float *row = S + i * V;
        const float e = decay[i], ki = k[i];
        for (int64_t j = 0; j < V; ++j) {
            row[j] *= e;
            kv[j] += ki * row[j];
        }
    }
    for (int64_t j = 0; j < V; ++j) {
        delta[j] = (v[j] - kv[j]) * beta;
        out[j] = 0.0f;
    }
    for (int64_t i = 0; i < K; ++i) {
        float *row = S + i * V;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < V; ++j) {
            row[j] += ki * delta[j];
            out[j] += qi * row[j];
        }
    }
}

#endif
