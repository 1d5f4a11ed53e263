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

#endif
