/* Linear layers over packed INT8/INT4 weights (kdaserve/ops/cpu_int_linear.py): the torch
 * forms' QuantLinear products on CPU, reading the packed bytes inside the product
 * (int_rows.h). */
#include <stdint.h>

#include "int_rows.h"

/* Y [B, N] = X [B, K] W^T, W packed [N, row_bytes] with scale/zero [N, G]. */
void int_linear_rows(int64_t B, int64_t N, int64_t K, const float *X, int64_t ldx,
                     const uint8_t *packed, int64_t row_bytes, const float *scale,
                     const int8_t *zero, int64_t groups, int64_t group, int64_t bits, float *Y,
                     int64_t ldy, int64_t nthreads, int64_t act8) {
    const qmat m = {packed, scale, zero, row_bytes, groups, group, bits, act8};
    q_matmat(&m, X, ldx, Y, ldy, N, K, B, nthreads);
}
