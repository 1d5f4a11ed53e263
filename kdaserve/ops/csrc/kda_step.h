/* One position of KDA's gated delta rule on one head's state S [K, V] (row-major), shared by
 * the recurrence kernel (kda_cpu.c) and the fused decode blocks (decode_blocks.h):
 *   S <- diag(exp(g)) S;  kv = k^T S;  S <- S + k (beta (v - kv))^T;  out = q^T S.
 * kv, delta [V] and decay [K] are the caller's scratch. */
#ifndef KDASERVE_KDA_STEP_H
#define KDASERVE_KDA_STEP_H

#include <stdint.h>

#include "fastmath.h"
#include "vec16.h"

/* 16 NV columns of S (rows ld apart), NV <= 8: their sums kv and out stay in registers while
 * i runs (the loops below kept them in memory, so each i waited on a store and a reload),
 * summed in the same order, so the result is bit-identical. The columns of S are independent
 * (the decay scales rows, every other operation is per column), so V splits into blocks that
 * fit the registers: the whole 64 or 128 with AVX-512 (32 registers), 32 columns with AVX2,
 * where NV 8 takes 32 of its 16 registers (kv, delta and out of 128 columns) and spills. */
#define KDA_STEP_REGS(NV)                                                                       \
    static inline void kda_step_##NV(float *restrict S, const float *q, const float *k,         \
                                     const float *v, const float *decay, float beta,            \
                                     float *out, int64_t K, int64_t ld) {                       \
        v16f acc[NV], dl[NV];                                                                   \
        for (int c = 0; c < NV; ++c) acc[c] = (v16f){0};                                        \
        for (int64_t i = 0; i < K; ++i) {                                                       \
            float *row = S + i * ld;                                                            \
            const float e = decay[i], ki = k[i];                                                \
            for (int c = 0; c < NV; ++c) {                                                      \
                const v16f r = ld16f(row + 16 * c) * e;                                         \
                st16f(row + 16 * c, r);                                                         \
                acc[c] += ki * r;                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int c = 0; c < NV; ++c) {                                                          \
            dl[c] = (ld16f(v + 16 * c) - acc[c]) * beta;                                        \
            acc[c] = (v16f){0};                                                                 \
        }                                                                                       \
        for (int64_t i = 0; i < K; ++i) {                                                       \
            float *row = S + i * ld;                                                            \
            const float ki = k[i], qi = q[i];                                                   \
            for (int c = 0; c < NV; ++c) {                                                      \
                const v16f r = ld16f(row + 16 * c) + ki * dl[c];                                \
                st16f(row + 16 * c, r);                                                         \
                acc[c] += qi * r;                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int c = 0; c < NV; ++c) st16f(out + 16 * c, acc[c]);                               \
    }
KDA_STEP_REGS(2)
KDA_STEP_REGS(4)
KDA_STEP_REGS(8)
#undef KDA_STEP_REGS

static inline void kda_step(float *S, const float *q, const float *k, const float *v,
                            const float *g, float beta, float *out, int64_t K, int64_t V,
                            float *kv, float *delta, float *decay) {
    for (int64_t i = 0; i < K; ++i) decay[i] = exp_approx(g[i]);
    if (V == 64 || V == 128) {
#if defined(__AVX512F__)
        if (V == 64) kda_step_4(S, q, k, v, decay, beta, out, K, V);
        else kda_step_8(S, q, k, v, decay, beta, out, K, V);
#else
        for (int64_t c = 0; c < V; c += 32)
            kda_step_2(S + c, q, k, v + c, decay, beta, out + c, K, V);
#endif
        return;
    }
    for (int64_t j = 0; j < V; ++j) kv[j] = 0.0f;
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
