/* Sixteen fp32 lanes (one AVX-512 register, two AVX2 ones), loaded and stored from any float
 * address (the typedef's alignment of 4), for the kernels whose sums stay in lanes: the
 * outer-product tiles of outer_tiles.h and the recurrence of kda_step.h. */
#ifndef KDASERVE_VEC16_H
#define KDASERVE_VEC16_H

#include <math.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64), aligned(4), may_alias));

static inline v16f ld16f(const float *p) { return *(const v16f *)(const void *)p; }

static inline void st16f(float *p, v16f v) { *(v16f *)(void *)p = v; }

/* What those kernels compute in: a vector of VREG_LANES lanes, VREGS16 of them per 16-lane
 * sum. On aarch64 one NEON register (4 lanes; 32 of them): GCC 12 keeps a generic vector
 * wider than the target's registers in memory there (BLKmode), so a v16f sum was stored and
 * reloaded around every add, and a scalar times a v16f went through 16 scalar stores; four
 * 4-lane vectors stay in registers. AVX2 computes in 8 lanes (one ymm register): GCC 12 kept
 * v16f sums there in memory too, and the 6-row tiles run batch-32 decode 1.24-1.30x faster
 * in ymm registers (docs/benchmarks.md); row_products.h's lone row keeps v16f on x86. AVX-512
 * computes in v16f (one zmm). Lanes are independent, so the pieces change no bit, only where
 * the sums live. */
#ifndef VREG_LANES               /* -DVREG_LANES=N: an A/B build (docs/benchmarks.md) */
#if defined(__aarch64__)
#define VREG_LANES 4
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define VREG_LANES 8
#else
#define VREG_LANES 16
#endif
#endif
#define VREGS16 (16 / VREG_LANES)

typedef float vregf __attribute__((vector_size(4 * VREG_LANES), aligned(4), may_alias));

static inline vregf ldvf(const float *p) { return *(const vregf *)(const void *)p; }

static inline void stvf(float *p, vregf v) { *(vregf *)(void *)p = v; }

/* acc + a * s, every lane by the scalar s: one fused multiply-add, rounded once, where the
 * target has one (x86-64-v3 and v4, aarch64); else a product and a sum. The build is ISO C,
 * so the compiler contracts nothing on its own: each kernel that sums with vfmas does so in
 * all its forms (the products' tiles, streamed rows and tails; KDA's recurrence), which keeps
 * a row's result the same bits whatever its batch. Why: on the AVX2 EPYC (Zen 3) the outer
 * products' tiles ran the demo's 32-row fused decode step 10.5% faster fused than as a product
 * and an add (docs/benchmarks.md). */
#if VREG_LANES == 8 && defined(__FMA__)
#define VFMAS_FUSED 1
#include <immintrin.h>
static inline vregf vfmas(vregf acc, vregf a, float s) {
    return (vregf)_mm256_fmadd_ps((__m256)a, _mm256_set1_ps(s), (__m256)acc);
}
#elif VREG_LANES == 16 && defined(__AVX512F__)
#define VFMAS_FUSED 1
#include <immintrin.h>
static inline vregf vfmas(vregf acc, vregf a, float s) {
    return (vregf)_mm512_fmadd_ps((__m512)a, _mm512_set1_ps(s), (__m512)acc);
}
#elif VREG_LANES == 4 && defined(__aarch64__)
#define VFMAS_FUSED 1
#include <arm_neon.h>
static inline vregf vfmas(vregf acc, vregf a, float s) {
    return (vregf)vfmaq_n_f32((float32x4_t)acc, (float32x4_t)a, s);
}
#else
#define VFMAS_FUSED 0
static inline vregf vfmas(vregf acc, vregf a, float s) { return acc + a * s; }
#endif

/* vfmas of one lane, for a sum's tail: fused exactly where vfmas is */
static inline float vfmas1(float acc, float a, float s) {
    return VFMAS_FUSED ? fmaf(a, s, acc) : acc + a * s;
}

#endif
