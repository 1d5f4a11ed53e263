/* Sixteen fp32 lanes (one AVX-512 register, two AVX2 ones), loaded and stored from any float
 * address (the typedef's alignment of 4), for the kernels whose sums stay in lanes: the
 * outer-product tiles of row_products.h and the recurrence of kda_step.h. */
#ifndef KDASERVE_VEC16_H
#define KDASERVE_VEC16_H

#include <string.h>

typedef float v16f __attribute__((vector_size(64), aligned(4)));

static inline v16f ld16f(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void st16f(float *p, v16f v) { memcpy(p, &v, sizeof v); }

/* What those kernels compute in: a vector of VREG_LANES lanes, VREGS16 of them per 16-lane
 * sum. On aarch64 one NEON register (4 lanes; 32 of them): GCC 12 keeps a generic vector
 * wider than the target's registers in memory there (BLKmode), so a v16f sum was stored and
 * reloaded around every add, and a scalar times a v16f went through 16 scalar stores; four
 * 4-lane vectors stay in registers. x86 keeps computing in v16f: lanes are independent, so
 * the pieces change no bit, only where the sums live (GCC 12 does the same to v16f on AVX2,
 * whose registers hold 8; see docs/benchmarks.md before changing it there). */
#if defined(__aarch64__)
#define VREG_LANES 4
#else
#define VREG_LANES 16
#endif
#define VREGS16 (16 / VREG_LANES)

typedef float vregf __attribute__((vector_size(4 * VREG_LANES), aligned(4)));

static inline vregf ldvf(const float *p) {
    vregf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void stvf(float *p, vregf v) { memcpy(p, &v, sizeof v); }

#endif
