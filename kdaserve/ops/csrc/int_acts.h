/* The input rows of int_dot.h's integer dots, quantized once per product: int8 codes in
 * blocks of IDOT_BLOCK columns with one fp32 scale a block, in the order the lanes read them
 * (INT4: each unit's even columns, then its odd ones), and each lane's sum of codes (for the
 * weights' zero offsets). int_dot.h states the math; kdaserve/ops/int_quant.py
 * `quantize_activations` is its torch form. */
#ifndef KDASERVE_INT_ACTS_H
#define KDASERVE_INT_ACTS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "int_dot_lanes.h"

#define IDOT_BLOCK 32

/* columns of one 32-byte unit of packed weights: INT4 64, INT8 32 */
static inline int64_t idot_unit(int64_t bits) { return bits == 4 ? 64 : 32; }

/* B input rows quantized: row r's codes q + r*K (INT4: each unit's even columns, then its odd
 * ones), per unit and lane the block scale d + (r*U + u)*8 and the lane's sum of codes A
 * (for the zero offsets) */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *A;
    int64_t K, U;
} qacts;

static void qacts_free(qacts *a) { free(a->q); }

/* Block `half` of a unit (INT8: the unit itself; INT4: its first or second 32 columns): its
 * codes into the unit's q (INT4: even columns from 16*half, odd ones from 32 + 16*half), its
 * scale into its lanes' d, its lanes' code sums into A. */
static inline void qacts_block(const float *xb, int bits, int half, int8_t *q, float *d,
                               int32_t *A) {
    const int lanes = bits == 4 ? 4 : 8, cpl = IDOT_BLOCK / lanes;
#if defined(IDOT_AVX2)
    __m256 v[4], m = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
#else
    float amax = 0.0f;
    for (int j = 0; j < IDOT_BLOCK; ++j) amax = fmaxf(amax, fabsf(xb[j]));
#endif
    const float db = amax / 127.0f, id = db > 0.0f ? 1.0f / db : 0.0f;
    for (int l = 0; l < lanes; ++l) d[half * lanes + l] = db;
#if defined(IDOT_AVX2)
    /* rounding to nearest even (the default MXCSR mode), as lrintf */
    __m256i c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    const __m256i c8 = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));             /* 32 codes in column order */
    __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), c8),
                                  _mm256_set1_epi16(1));          /* sums of 4 columns */
    if (bits == 8) {
        _mm256_storeu_si256((__m256i *)(void *)q, c8);
        _mm256_storeu_si256((__m256i *)(void *)A, s);
        return;
    }
    const __m256i eo = _mm256_permute4x64_epi64(                 /* 16 even, then 16 odd */
        _mm256_shuffle_epi8(c8, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11,
                                                 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5,
                                                 7, 9, 11, 13, 15)), 0xD8);
    _mm_storeu_si128((__m128i *)(void *)(q + 16 * half), _mm256_castsi256_si128(eo));
    _mm_storeu_si128((__m128i *)(void *)(q + 32 + 16 * half), _mm256_extracti128_si256(eo, 1));
    s = _mm256_permute4x64_epi64(_mm256_hadd_epi32(s, s), 0xD8);  /* sums of 8 columns */
    _mm_storeu_si128((__m128i *)(void *)(A + 4 * half), _mm256_castsi256_si128(s));
#else
    int8_t c8[IDOT_BLOCK];
    for (int j = 0; j < IDOT_BLOCK; ++j) c8[j] = (int8_t)lrintf(xb[j] * id);
    for (int j = 0; j < IDOT_BLOCK; ++j)
        q[bits == 4 ? (j & 1) * 32 + 16 * half + j / 2 : j] = c8[j];
    for (int l = 0; l < lanes; ++l) {
        int32_t t = 0;
        for (int j = l * cpl; j < (l + 1) * cpl; ++j) t += c8[j];
        A[half * lanes + l] = t;
    }
#endif
    (void)cpl;
}

static qacts qacts_make(const float *X, int64_t ldx, int64_t B, int64_t K, int64_t bits) {
    const int64_t unit = idot_unit(bits);
    qacts a = {NULL, NULL, NULL, K, K / unit};
    const size_t nq = (size_t)(B * K), nl = (size_t)(B * a.U * 8);
    char *p = malloc(((nq + 31) & ~(size_t)31) + (sizeof(float) + sizeof(int32_t)) * nl);
    if (!p) abort();
    a.q = (int8_t *)p;
    a.d = (float *)(void *)(p + ((nq + 31) & ~(size_t)31));
    a.A = (int32_t *)(void *)(a.d + nl);
    for (int64_t r = 0; r < B; ++r)
        for (int64_t u = 0; u < a.U; ++u)
            for (int half = 0; half < unit / IDOT_BLOCK; ++half)
                qacts_block(X + r * ldx + u * unit + half * IDOT_BLOCK, (int)bits, half,
                            a.q + r * K + u * unit, a.d + (r * a.U + u) * 8,
                            a.A + (r * a.U + u) * 8);
    return a;
}

#endif
