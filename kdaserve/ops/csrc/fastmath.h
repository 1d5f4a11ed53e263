/* Shared by the CPU kernels: exp and log as branch-free polynomials, so loops that call them
 * vectorise (libm's expf is a scalar call per element). Cephes' single-precision
 * coefficients, ~1 ulp. */
#ifndef KDASERVE_FASTMATH_H
#define KDASERVE_FASTMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float exp_approx(float x) {
    /* 2^n must stay a normal float: n in [-125, 127] (fminf/fmaxf do not vectorise) */
    x = x < -87.3f ? -87.3f : (x > 88.37f ? 88.37f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float log_approx(float x) {   /* x > 0, normal */
    int32_t bits;
    memcpy(&bits, &x, sizeof bits);
    float e = (float)((bits >> 23) - 126);
    bits = (bits & 0x007fffff) | 0x3f000000;     /* mantissa in [0.5, 1) */
    float m;
    memcpy(&m, &bits, sizeof m);
    const int small = m < 0.707106781186547524f;
    e = small ? e - 1.0f : e;
    m = small ? m + m - 1.0f : m - 1.0f;
    const float z = m * m;
    float y = 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z - 2.12194440e-4f * e - 0.5f * z;
    return m + y + 0.693359375f * e;
}

static inline float silu(float x) { return x / (1.0f + exp_approx(-x)); }
static inline float sigmoid(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

/* tanh, branch-free (both forms computed, one selected): Cephes' tanhf polynomial for
 * |x| < 0.625 (no cancellation near 0), else 1 - 2 / (exp(2|x|) + 1) with the sign put back;
 * exp_approx clamps its argument, so large |x| gives exactly +-1 and nothing overflows. */
static inline float tanh_approx(float x) {
    const float ax = x < 0.0f ? -x : x;
    const float z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const float small = p * z * x + x;
    const float big = 1.0f - 2.0f / (exp_approx(ax + ax) + 1.0f);
    const float large = x < 0.0f ? -big : big;
    return ax < 0.625f ? small : large;
}

/* out[j] = glu(g[j], u[j]) for j < n, the feed-forwards' gated activation selected at run
 * time: kind 0 SiLU, silu(g) * u; 1 SiTU, beta*tanh(g/beta)*sigmoid(g) * clip(u), clip(u) =
 * linear_beta*tanh(u/linear_beta), or u when linear_beta <= 0 (kdaserve/ops/activation.py). */
static inline __attribute__((always_inline)) void glu_span(
        int64_t kind, float beta, float linear_beta, const float *g, const float *u,
        float *out, int64_t n) {
    if (kind == 1 && linear_beta > 0.0f) {
        for (int64_t j = 0; j < n; ++j)
            out[j] = beta * tanh_approx(g[j] / beta) * sigmoid(g[j])
                     * (linear_beta * tanh_approx(u[j] / linear_beta));
    } else if (kind == 1) {
        for (int64_t j = 0; j < n; ++j)
            out[j] = beta * tanh_approx(g[j] / beta) * sigmoid(g[j]) * u[j];
    } else {
        for (int64_t j = 0; j < n; ++j) out[j] = silu(g[j]) * u[j];
    }
}

#endif
