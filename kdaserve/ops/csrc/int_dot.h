/* Integer dot products over packed INT8/INT4 rows (int_rows.h's qmat) for decode rows, as
 * llama.cpp's Q4_0 / Q8_0 take them: each input row is quantized once per product to int8 in
 * blocks of 32 columns (one fp32 scale a block), the weights stay integers, and a block's
 * products sum exactly in int32; only the blocks' sums meet floats. The decoded fp32 weights
 * of int_rows.h cost about twice the instructions per weight, which kept the INT4 lone row
 * compute-bound; here a 32-column block is ~10 instructions for a row (AVX2).
 *
 * The math, exactly (kdaserve/ops/int_quant.py `int_dot_oracle` is its torch form):
 * - activation block b of a row: d = amax|x| / 127, id = d > 0 ? 1 / d : 0, qa = rint(x * id)
 *   (fp32, ties to even);
 * - the 32 columns of a block fall in 8 lanes of 4: INT8 lane l holds columns 4l..4l+3; INT4
 *   lanes 0-3 hold the even columns (the low nibbles, 0,2,..,30 in fours), lanes 4-7 the odd
 *   ones: how the bytes unpack, so nothing is shuffled per weight (the activations are stored
 *   in that order once);
 * - I[l] = sum over the lane's columns of (q - zero) * qa, exact (int32);
 * - per group g of the weight (its blocks in order): t = 0; t = fma(I, d_b, t) per block;
 *   acc = fma(t, scale_g, acc); lanes independent, then y = ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7)).
 * Every fma is a fused one on every build (AVX2 / NEON intrinsics, fmaf otherwise), and the
 * build is ISO C (no other contraction), so every ISA gives the same bits, and a row's result
 * depends on nothing but its own inputs (not the batch, not the thread count).
 * Needs K and the group to be multiples of 32 (int_rows.h falls back to its fp32 decode). */
#ifndef KDASERVE_INT_DOT_H
#define KDASERVE_INT_DOT_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define IDOT_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define IDOT_NEON 1
#endif

#define IDOT_BLOCK 32
#ifndef IDOT_AHEAD
#define IDOT_AHEAD 4096
#endif

/* B input rows quantized: row r's codes q + r*K (INT4: each block in lane order), block
 * scales d + r*nb, lane sums of the codes A + r*nb*8 (for the zero offsets) */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *A;
    int64_t K, nb;
} qacts;

static void qacts_free(qacts *a) { free(a->q); }

/* one allocation for all of it (qacts_free) */
static qacts qacts_make(const float *X, int64_t ldx, int64_t B, int64_t K, int64_t bits) {
    qacts a = {NULL, NULL, NULL, K, K / IDOT_BLOCK};
    const size_t nq = (size_t)(B * K), nd = (size_t)(B * a.nb);
    char *p = malloc(nq + sizeof(float) * nd + sizeof(int32_t) * 8 * nd + 64);
    if (!p) abort();
    a.q = (int8_t *)p;
    a.d = (float *)(void *)(p + ((nq + 31) & ~(size_t)31));
    a.A = (int32_t *)(void *)(a.d + nd);
    for (int64_t r = 0; r < B; ++r) {
        const float *x = X + r * ldx;
        for (int64_t b = 0; b < a.nb; ++b) {
            const float *xb = x + b * IDOT_BLOCK;
            float amax = 0.0f;
            for (int j = 0; j < IDOT_BLOCK; ++j) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int8_t *q = a.q + r * K + b * IDOT_BLOCK;
            for (int j = 0; j < IDOT_BLOCK; ++j) {
                /* INT4: column j goes to position j/2 (even) or 16 + j/2 (odd) */
                const int at = bits == 4 ? (j & 1) * 16 + j / 2 : j;
                q[at] = (int8_t)lrintf(xb[j] * id);
            }
            a.d[r * a.nb + b] = d;
            int32_t *A = a.A + (r * a.nb + b) * 8;
            for (int l = 0; l < 8; ++l) A[l] = q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3];
        }
    }
    return a;
}

#if defined(IDOT_AVX2)
typedef __m256 idot_f;
typedef __m256i idot_i;
static inline idot_f idot_zero(void) { return _mm256_setzero_ps(); }
static inline idot_f idot_fma(idot_i i, float d, idot_f t) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(d), t);
}
static inline idot_f idot_fmaf(idot_f t, float s, idot_f acc) {
    return _mm256_fmadd_ps(t, _mm256_set1_ps(s), acc);
}
static inline float idot_sum(idot_f v) {
    float f[8];
    _mm256_storeu_ps(f, v);
    return ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7]));
}
/* the lanes I of one block: weights w (as idot_wb makes them) against codes qa */
typedef __m256i idot_w;
static inline idot_w idot_wb(const uint8_t *p, int bits) {
    if (bits == 4) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)p);
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b),
                                _mm256_set1_epi8(15));
    }
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)p),
                            _mm256_set1_epi8((char)0x80));
}
static inline idot_i idot_lanes(idot_w w, const int8_t *qa, int bits) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)qa);
    __m256i p16;
    if (bits == 4) {
        p16 = _mm256_maddubs_epi16(w, a);       /* nibbles 0..15 unsigned: no saturation */
    } else {                                     /* |w| <= 128 unsigned, sign moved to qa */
        p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
    }
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}
static inline idot_i idot_correct(idot_i I, const int32_t *A, int32_t off) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)A);
    if (off == 8) return _mm256_sub_epi32(I, _mm256_slli_epi32(a, 3));
    return _mm256_sub_epi32(I, _mm256_mullo_epi32(a, _mm256_set1_epi32(off)));
}
#else
/* NEON and portable C: eight lanes as two halves (NEON registers) or an array */
#if defined(IDOT_NEON)
typedef struct { float32x4_t v[2]; } idot_f;
typedef struct { int32x4_t v[2]; } idot_i;
typedef struct { int8x16_t v[2]; } idot_w;
static inline idot_f idot_zero(void) { return (idot_f){{vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}}; }
static inline idot_f idot_fma(idot_i i, float d, idot_f t) {
    for (int h = 0; h < 2; ++h) t.v[h] = vfmaq_n_f32(t.v[h], vcvtq_f32_s32(i.v[h]), d);
    return t;
}
static inline idot_f idot_fmaf(idot_f t, float s, idot_f acc) {
    for (int h = 0; h < 2; ++h) acc.v[h] = vfmaq_n_f32(acc.v[h], t.v[h], s);
    return acc;
}
static inline float idot_sum(idot_f v) {
    float f[8];
    vst1q_f32(f, v.v[0]);
    vst1q_f32(f + 4, v.v[1]);
    return ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7]));
}
static inline idot_w idot_wb(const uint8_t *p, int bits) {
    idot_w w;
    if (bits == 4) {
        const uint8x16_t b = vld1q_u8(p);
        w.v[0] = vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(15)));
        w.v[1] = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
    } else {
        for (int h = 0; h < 2; ++h)
            w.v[h] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p + 16 * h), vdupq_n_u8(0x80)));
    }
    return w;
}
/* sums of 4 consecutive byte products: lanes of 16 bytes */
static inline int32x4_t idot_4s(int8x16_t w, int8x16_t a) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdupq_n_s32(0), w, a);
#else
    const int32x4_t p0 = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(a)));
    const int32x4_t p1 = vpaddlq_s16(vmull_high_s8(w, a));
    return vpaddq_s32(p0, p1);
#endif
}
static inline idot_i idot_lanes(idot_w w, const int8_t *qa, int bits) {
    (void)bits;
    return (idot_i){{idot_4s(w.v[0], vld1q_s8(qa)), idot_4s(w.v[1], vld1q_s8(qa + 16))}};
}
static inline idot_i idot_correct(idot_i I, const int32_t *A, int32_t off) {
    for (int h = 0; h < 2; ++h) I.v[h] = vmlsq_n_s32(I.v[h], vld1q_s32(A + 4 * h), off);
    return I;
}
#else
typedef struct { float v[8]; } idot_f;
typedef struct { int32_t v[8]; } idot_i;
typedef struct { int8_t v[32]; } idot_w;
static inline idot_f idot_zero(void) { return (idot_f){{0}}; }
static inline idot_f idot_fma(idot_i i, float d, idot_f t) {
    for (int l = 0; l < 8; ++l) t.v[l] = fmaf((float)i.v[l], d, t.v[l]);
    return t;
}
static inline idot_f idot_fmaf(idot_f t, float s, idot_f acc) {
    for (int l = 0; l < 8; ++l) acc.v[l] = fmaf(t.v[l], s, acc.v[l]);
    return acc;
}
static inline float idot_sum(idot_f v) {
    const float *f = v.v;
    return ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7]));
}
static inline idot_w idot_wb(const uint8_t *p, int bits) {
    idot_w w;
    for (int j = 0; j < 16 && bits == 4; ++j) {
        w.v[j] = (int8_t)(p[j] & 15);
        w.v[16 + j] = (int8_t)(p[j] >> 4);
    }
    for (int j = 0; j < 32 && bits == 8; ++j) w.v[j] = (int8_t)(p[j] - 128);
    return w;
}
static inline idot_i idot_lanes(idot_w w, const int8_t *qa, int bits) {
    (void)bits;
    idot_i I;
    for (int l = 0; l < 8; ++l) {
        int32_t s = 0;
        for (int j = 4 * l; j < 4 * l + 4; ++j) s += (int32_t)w.v[j] * qa[j];
        I.v[l] = s;
    }
    return I;
}
static inline idot_i idot_correct(idot_i I, const int32_t *A, int32_t off) {
    for (int l = 0; l < 8; ++l) I.v[l] -= off * A[l];
    return I;
}
#endif
#endif

/* Y[r * ldy + n + o] for NO outputs from n and R rows (NO * R <= 4: the sums stay in
 * registers), each (row, output) computed as the header says whatever its tile mates. */
static inline __attribute__((always_inline)) void
idot_tile(const qmat *m, int64_t n, int NO, const qacts *a, int64_t r0, int R, float *Y,
          int64_t ldy, int bits) {
    const int64_t nb = a->nb, gb = m->group / IDOT_BLOCK, bb = bits * IDOT_BLOCK / 8;
    const int32_t base = bits == 4 ? 8 : 0;
    idot_f acc[4];
    for (int i = 0; i < NO * R; ++i) acc[i] = idot_zero();
    for (int64_t g = 0; g < m->groups; ++g) {
        const int64_t b1 = (g + 1) * gb < nb ? (g + 1) * gb : nb;
        idot_f t[4];
        for (int i = 0; i < NO * R; ++i) t[i] = idot_zero();
        int32_t off[4];
        for (int o = 0; o < NO; ++o)
            off[o] = base + (m->zero ? m->zero[(n + o) * m->groups + g] : 0);
        for (int64_t b = g * gb; b < b1; ++b) {
            /* the tile's rows are read side by side (NO streams a row apart), which the
             * hardware prefetcher followed worse than one row after another: ask for the
             * bytes IDOT_AHEAD past where the tile reads, as fast as it consumes them */
            const uint8_t *pf = m->packed + n * m->row_bytes + IDOT_AHEAD + b * NO * bb;
            for (int64_t c = 0; IDOT_AHEAD && c < NO * bb; c += 64) __builtin_prefetch(pf + c);
            for (int o = 0; o < NO; ++o) {
                const idot_w w = idot_wb(m->packed + (n + o) * m->row_bytes + b * bb, bits);
                for (int r = 0; r < R; ++r) {
                    const int64_t rb = (r0 + r) * nb + b;
                    idot_i I = idot_lanes(w, a->q + rb * IDOT_BLOCK, bits);
                    if (off[o]) I = idot_correct(I, a->A + rb * 8, off[o]);
                    t[o * R + r] = idot_fma(I, a->d[rb], t[o * R + r]);
                }
            }
        }
        for (int o = 0; o < NO; ++o) {
            const float s = m->scale[(n + o) * m->groups + g];
            for (int r = 0; r < R; ++r) acc[o * R + r] = idot_fmaf(t[o * R + r], s, acc[o * R + r]);
        }
    }
    for (int o = 0; o < NO; ++o)
        for (int r = 0; r < R; ++r) Y[(r0 + r) * ldy + n + o] = idot_sum(acc[o * R + r]);
}

/* Y[b, n] for all rows of `a`, outputs [n0, n1): two outputs by two rows at a time */
static inline __attribute__((always_inline)) void
idot_rows_b(const qmat *m, const qacts *a, int64_t B, float *Y, int64_t ldy, int64_t n0,
            int64_t n1, int bits) {
    int64_t n = n0;
    if (B == 1)         /* a lone row: four outputs, four independent sums */
        for (; n + 4 <= n1; n += 4) idot_tile(m, n, 4, a, 0, 1, Y, ldy, bits);
    for (; n + 2 <= n1; n += 2) {
        int64_t r = 0;
        for (; r + 2 <= B; r += 2) idot_tile(m, n, 2, a, r, 2, Y, ldy, bits);
        if (r < B) idot_tile(m, n, 2, a, r, 1, Y, ldy, bits);
    }
    if (n < n1) {
        int64_t r = 0;
        for (; r + 2 <= B; r += 2) idot_tile(m, n, 1, a, r, 2, Y, ldy, bits);
        if (r < B) idot_tile(m, n, 1, a, r, 1, Y, ldy, bits);
    }
}

static void idot_rows(const qmat *m, const qacts *a, int64_t B, float *Y, int64_t ldy,
                      int64_t n0, int64_t n1) {
    if (m->bits == 4) idot_rows_b(m, a, B, Y, ldy, n0, n1, 4);
    else idot_rows_b(m, a, B, Y, ldy, n0, n1, 8);
}

/* whether a product over m with K columns takes the integer dots */
static inline int idot_applies(const qmat *m, int64_t K) {
    return m->act8 && (m->bits == 4 || m->bits == 8) && K % IDOT_BLOCK == 0
           && m->group % IDOT_BLOCK == 0 && m->group > 0;
}

#endif
