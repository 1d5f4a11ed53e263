/* Sixteen fp32 lanes (one AVX-512 register, two AVX2 ones), loaded and stored from any float
 * address (the typedef's alignment of 4), for the kernels whose sums stay in lanes: the
 * outer-product tiles of outer_tiles.h and the recurrence of kda_step.h. */
#ifndef KDASERVE_VEC16_H
#define KDASERVE_VEC16_H

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

#endif
