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
 * where NV 8 takes 32 of its 16 registers (kv, delta and out of 128 columns) and spills.
 * NEON (32 registers of 4 lanes, vec16.h's VREGS16 = 4 per 16 columns): KDA_STEP_COLS 16 on
 * aarch64. 32 columns hold 8 registers of delta and 8 of out in the second sweep, and each
 * unfused product took a register until its add (16 more), so GCC 12 spilled them every i;
 * 16 columns hold 4 + 4 + 8 (the sums are vec16.h's fused vfmas now, which needs fewer;
 * 16 kept). Not measured: no ARM machine here. */
#define KDA_STEP_REGS(NV)                                                                       \
    static inline void kda_step_##NV(float *restrict S, const float *q, const float *k,         \
                                     const float *v, const float *decay, float beta,            \
                                     float *out, int64_t K, int64_t ld) {                       \
        enum { P = NV * VREGS16 };                                                              \
        vregf acc[P], dl[P];                                                                    \
        for (int c = 0; c < P; ++c) acc[c] = (vregf){0};                                        \
        for (int64_t i = 0; i < K; ++i) {                                                       \
            float *row = S + i * ld;                                                            \
            const float e = decay[i], ki = k[i];                                                \
            for (int c = 0; c < P; ++c) {                                                       \
                const vregf r = ldvf(row + VREG_LANES * c) * e;                                 \
                stvf(row + VREG_LANES * c, r);                                                  \
                acc[c] = vfmas(acc[c], r, ki);                                                  \
            }                                                                                   \
        }                                                                                       \
        for (int c = 0; c < P; ++c) {                                                           \
            dl[c] = (ldvf(v + VREG_LANES * c) - acc[c]) * beta;                                 \
            acc[c] = (vregf){0};                                                                \
        }                                                                                       \
        for (int64_t i = 0; i < K; ++i) {                                                       \
            float *row = S + i * ld;                                                            \
            const float ki = k[i], qi = q[i];                                                   \
            for (int c = 0; c < P; ++c) {                                                       \
                const vregf r = vfmas(ldvf(row + VREG_LANES * c), dl[c], ki);                   \
                stvf(row + VREG_LANES * c, r);                                                  \
                acc[c] = vfmas(acc[c], r, qi);                                                  \
            }                                                                                   \
        }                                                                                       \
        for (int c = 0; c < P; ++c) stvf(out + VREG_LANES * c, acc[c]);                         \
    }
KDA_STEP_REGS(1)
KDA_STEP_REGS(2)
KDA_STEP_REGS(4)
KDA_STEP_REGS(8)
#undef KDA_STEP_REGS

/* columns per register block where V is not one block (64 or 128) with AVX-512 */
#if defined(__aarch64__)
#define KDA_STEP_COLS 16
#else
#define KDA_STEP_COLS 32
#endif

static inline void kda_step(float *S, const float *q, const float *k, const float *v,
                            const float *g, float beta, float *out, int64_t K, int64_t V,
                            float *kv, float *delta, float *decay) {
    for (int64_t i = 0; i < K; ++i) decay[i] = exp_approx(g[i]);
    if (V == 64 || V == 128) {
#if defined(__AVX512F__)
        if (V == 64) kda_step_4(S, q, k, v, decay, beta, out, K, V);
        else kda_step_8(S, q, k, v, decay, beta, out, K, V);
#elif KDA_STEP_COLS == 16
        for (int64_t c = 0; c < V; c += 16)
            kda_step_1(S + c, q, k, v + c, decay, beta, out + c, K, V);
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
