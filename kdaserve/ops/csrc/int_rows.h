/* Products over packed INT8/INT4 weights with group-wise scales, read in place
 * (kdaserve/ops/int_quant.py has the layout and the torch oracle):
 * packed uint8 [N, row_bytes], an integer q offset to unsigned (q + 128 for INT8 one a byte;
 * q + 8 for INT4 two a byte, the even column in the low nibble); scale fp32 [N, G], one per
 * `group` consecutive columns (the last group may be shorter); zero int8 [N, G] or NULL.
 *
 * With qmat.act8 (the default, kdaserve/ops/cpu_int_linear.py `int_dot`) and a shape it
 * takes, a product is int_dot.h's integer dots over int8-quantized input rows. Otherwise (the
 * fp32 decode below) each pass decodes QB weight rows once into a small fp32 buffer,
 * w = (q - zero) * scale (one rounding: the oracle's dequantized weight, bit for bit), and
 * every input row takes its dot products with them, so the packed bytes are read once per
 * call for all rows. A dot product always runs the same way (two 8-lane sums over alternate
 * 8-column chunks, the tail in column order, a fixed reduction), so a row's result does not
 * depend on how many rows share the call, nor on the thread that computed it. */
#ifndef KDASERVE_INT_ROWS_H
#define KDASERVE_INT_ROWS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "threads.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QB 4

typedef float qv8f __attribute__((vector_size(8 * sizeof(float))));

typedef struct {
    const uint8_t *packed;
    const float *scale;
    const int8_t *zero;       /* NULL: symmetric */
    int64_t row_bytes, groups, group, bits;
    int64_t act8;             /* 1: decode rows take int_dot.h's integer dots where they apply */
} qmat;

#include "int_dot.h"

static inline qv8f q_ld8(const float *p) {
    qv8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* w[0:K) = weight row n decoded. */
static inline void q_decode_row(const qmat *m, int64_t n, int64_t K, float *restrict w) {
    const uint8_t *q = m->packed + n * m->row_bytes;
    if (m->bits == 32) {          /* a plain fp32 row (a layer left unquantized) */
        memcpy(w, q, sizeof(float) * (size_t)K);
        return;
    }
    const float *s = m->scale + n * m->groups;
    const int8_t *z = m->zero ? m->zero + n * m->groups : NULL;
    for (int64_t g = 0; g < m->groups; ++g) {
        const int64_t k0 = g * m->group, k1 = k0 + m->group < K ? k0 + m->group : K;
        const float sg = s[g];
        const int32_t off = (m->bits == 8 ? 128 : 8) + (z ? z[g] : 0);
        if (m->bits == 8) {
            for (int64_t k = k0; k < k1; ++k) w[k] = (float)((int32_t)q[k] - off) * sg;
        } else if (!(k0 & 1) && !(k1 & 1)) {
            for (int64_t j = k0 / 2; j < k1 / 2; ++j) {
                const int32_t b = q[j];
                w[2 * j] = (float)((b & 15) - off) * sg;
                w[2 * j + 1] = (float)((b >> 4) - off) * sg;
            }
        } else {
            for (int64_t k = k0; k < k1; ++k) {
                const int32_t b = q[k >> 1];
                w[k] = (float)(((k & 1) ? b >> 4 : b & 15) - off) * sg;
            }
        }
    }
}

static inline float q_dot(const float *restrict a, const float *restrict w, int64_t K) {
    const int64_t K16 = K - K % 16;
    qv8f s0 = {0}, s1 = {0};
    for (int64_t k = 0; k < K16; k += 16) {
        s0 += q_ld8(a + k) * q_ld8(w + k);
        s1 += q_ld8(a + k + 8) * q_ld8(w + k + 8);
    }
    float t = 0.0f;
    for (int64_t k = K16; k < K; ++k) t += a[k] * w[k];
    const qv8f v = s0 + s1;
    return (((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))) + t;
}

typedef uint8_t qv8b __attribute__((vector_size(8), aligned(1), may_alias));
typedef int32_t qv8i __attribute__((vector_size(8 * sizeof(int32_t))));

/* eight bytes widened to int32 lanes (AVX2: one vpmovzxbd; GCC 12 widens the generic form a
 * byte at a time) */
static inline qv8i q_u8x8(const uint8_t *p) {
#if defined(__AVX2__)
    return (qv8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p));
#else
    return __builtin_convertvector(*(const qv8b *)(const void *)p, qv8i);
#endif
}

/* INT4's lane order inside each whole 16-column chunk: its 8 even columns, then its 8 odd
 * ones, as the nibbles unpack (low, then high), for the decoded weights and the activations
 * alike, so a chunk's weights need no shuffle; the tail keeps column order. */
static inline void q_lanes4(const float *restrict a, int64_t K, float *restrict out) {
    const int64_t K16 = K - K % 16;
    for (int64_t k = 0; k < K16; k += 16)
        for (int l = 0; l < 8; ++l) {
            out[k + l] = a[k + 2 * l];
            out[k + 8 + l] = a[k + 2 * l + 1];
        }
    for (int64_t k = K16; k < K; ++k) out[k] = a[k];
}

/* q_dot(a, row n decoded) for a lone input row (INT4: in q_lanes4 order), decoding in
 * registers as the sums go: the same weights ((q - zero) * scale, one rounding) in the same
 * order as the buffered form, so the same bits, without the decoded row's trip through
 * memory. Groups a multiple of 16 columns. */
static inline float q_dot_packed(const qmat *m, int64_t n, const float *restrict a, int64_t K) {
    const uint8_t *q = m->packed + n * m->row_bytes;
    const float *s = m->scale + n * m->groups;
    const int8_t *z = m->zero ? m->zero + n * m->groups : NULL;
    const int64_t K16 = K - K % 16, base = m->bits == 8 ? 128 : 8;
    qv8f s0 = {0}, s1 = {0};
    int64_t k = 0;
    for (int64_t g = 0; k < K16; ++g) {
        const int64_t k1 = (g + 1) * m->group < K16 ? (g + 1) * m->group : K16;
        const float sg = s[g];
        const qv8i off = (qv8i){0} + (int32_t)(base + (z ? z[g] : 0));
        for (; k < k1; k += 16) {
            qv8i i0, i1;
            if (m->bits == 8) {
                i0 = q_u8x8(q + k);
                i1 = q_u8x8(q + k + 8);
            } else {                 /* 16 nibbles: the even columns low, the odd high */
                const qv8i b = q_u8x8(q + k / 2);
                i0 = b & 15;
                i1 = b >> 4;
            }
            const qv8f w0 = __builtin_convertvector(i0 - off, qv8f) * sg;
            const qv8f w1 = __builtin_convertvector(i1 - off, qv8f) * sg;
            s0 += q_ld8(a + k) * w0;
            s1 += q_ld8(a + k + 8) * w1;
        }
    }
    float t = 0.0f;
    if (K16 < K) {
        float w[16];
        const int64_t g = K16 / m->group;
        const int32_t off = (int32_t)(base + (z ? z[g] : 0));
        for (int64_t j = K16; j < K; ++j) {
            const int32_t v = m->bits == 8 ? q[j] : (j & 1) ? q[j >> 1] >> 4 : q[j >> 1] & 15;
            w[j - K16] = (float)(v - off) * s[g];
        }
        for (int64_t j = K16; j < K; ++j) t += a[j] * w[j - K16];
    }
    const qv8f v = s0 + s1;
    return (((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))) + t;
}

/* Y[b, n] = W[n, :] . X[b, :] for rows b < B, outputs [n0, n1): X rows ldx apart, Y rows ldy
 * apart; wb holds QB * K floats. */
static void q_rows(const qmat *m, const float *X, int64_t ldx, float *Y, int64_t ldy,
                   int64_t n0, int64_t n1, int64_t K, int64_t B, float *wb) {
    if (idot_applies(m, K)) {
        qacts a = qacts_make(X, ldx, B, K, m->bits);
        idot_product(m, &a, B, Y, ldy, n0, n1);
        qacts_free(&a);
        return;
    }
    float *xl = NULL;                /* INT4: the rows in q_lanes4 order */
    if (m->bits == 4) {
        xl = malloc(sizeof(float) * (size_t)(B * K));
        if (!xl) abort();
        for (int64_t b = 0; b < B; ++b) q_lanes4(X + b * ldx, K, xl + b * K);
        X = xl;
        ldx = K;
    }
    if (B == 1 && m->bits != 32 && m->group % 16 == 0) {
        for (int64_t n = n0; n < n1; ++n) Y[n] = q_dot_packed(m, n, X, K);
        free(xl);
        return;
    }
    float chunk[16];
    for (int64_t n = n0; n < n1; n += QB) {
        const int nb = (int)(n1 - n < QB ? n1 - n : QB);
        for (int r = 0; r < nb; ++r) {
            float *w = wb + r * K;
            q_decode_row(m, n + r, K, w);
            if (xl)
                for (int64_t k = 0; k + 16 <= K; k += 16) {
                    q_lanes4(w + k, 16, chunk);
                    memcpy(w + k, chunk, sizeof chunk);
                }
        }
        for (int64_t b = 0; b < B; ++b)
            for (int r = 0; r < nb; ++r) Y[b * ldy + n + r] = q_dot(X + b * ldx, wb + r * K, K);
    }
    free(xl);
}

/* Output blocks [lo, hi) of q_matmat. */
static void q_blocks(const qmat *m, const qacts *a, int idot, const float *X, int64_t ldx,
                     float *Y, int64_t ldy, int64_t N, int64_t K, int64_t B, int64_t lo,
                     int64_t hi) {
    if (lo >= hi) return;
    const int64_t n1 = hi * QB < N ? hi * QB : N;
    if (idot) {
        idot_product(m, a, B, Y, ldy, lo * QB, n1);
        return;
    }
    float *wb = malloc(sizeof(float) * QB * K);
    if (wb) {
        q_rows(m, X, ldx, Y, ldy, lo * QB, n1, K, B, wb);
        free(wb);
    }
}

/* q_rows over all N outputs, blocks of them split over `nthreads` (OpenMP; each output is
 * computed whole by one thread, so the split changes nothing). */
static void q_matmat(const qmat *m, const float *X, int64_t ldx, float *Y, int64_t ldy,
                     int64_t N, int64_t K, int64_t B, int64_t nthreads) {
    (void)nthreads;
    const int64_t blocks = (N + QB - 1) / QB;
    const int idot = idot_applies(m, K);
    qacts a = {0};
    if (idot) a = qacts_make(X, ldx, B, K, m->bits);       /* once for both threads */
    if (nthreads > 1 && N * K * B >= 32768 && team_threads() > 1) {
#pragma omp parallel num_threads((int)nthreads)
        {
            int64_t lo, hi;
            thread_share(0, blocks, &lo, &hi);
            q_blocks(m, &a, idot, X, ldx, Y, ldy, N, K, B, lo, hi);
        }
    } else {
        q_blocks(m, &a, idot, X, ldx, Y, ldy, N, K, B, 0, blocks);   /* (threads.h) */
    }
    if (idot) qacts_free(&a);
}

#endif
