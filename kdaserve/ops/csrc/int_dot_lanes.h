/* The eight lanes of int_dot.h's integer dots, per instruction set: idot_i (int32 lane sums),
 * idot_f (fp32 lanes), idot_w (one unit of 32 weight bytes as the lanes read it) and their
 * operations. AVX2 (one ymm register), NEON (two registers; `sdot` with the dot-product
 * extension, widening multiplies without it), portable C (the definition, lane by lane).
 * All three compute the same integers and the same fused multiply-adds, so the same bits. */
#ifndef KDASERVE_INT_DOT_LANES_H
#define KDASERVE_INT_DOT_LANES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define IDOT_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define IDOT_NEON 1
#endif

#if defined(IDOT_AVX2)
typedef __m256 idot_f;
typedef __m256i idot_i;
typedef struct { __m256i lo, hi; } idot_w;
static inline idot_f idot_zero(void) { return _mm256_setzero_ps(); }
static inline idot_f idot_ldf(const float *p) { return _mm256_loadu_ps(p); }
static inline idot_f idot_f2(float s0, float s1) {    /* s0 in lanes 0-3, s1 in 4-7 */
    return _mm256_setr_m128(_mm_set1_ps(s0), _mm_set1_ps(s1));
}
/* idot_f2(p[0], p[1]): one 8-byte load and a permute, where two broadcasts took an insert */
static inline idot_f idot_f2p(const float *p) {
    const __m128 v = _mm_castpd_ps(_mm_load_sd((const double *)(const void *)p));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}
static inline idot_f idot_fma(idot_i i, idot_f d, idot_f t) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), d, t);
}
static inline idot_f idot_fmaf(idot_f t, idot_f s, idot_f acc) {
    return _mm256_fmadd_ps(t, s, acc);
}
static inline float idot_sum(idot_f v) {
    float f[8];
    _mm256_storeu_ps(f, v);
    return ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7]));
}
/* AVX-512 VNNI (with VL) or AVX-VNNI: vpdpbusd sums the four byte products of each lane
 * straight into int32, where maddubs + madd took two steps through int16 and a third to add
 * the nibbles' halves; no int16 sum here saturates (|sum| < 2^15, below), so the lanes hold
 * the same integers */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define IDOT_DPBUSD(s, w, a) _mm256_dpbusd_epi32(s, w, a)
#elif defined(__AVXVNNI__)
#define IDOT_DPBUSD(s, w, a) _mm256_dpbusd_avx_epi32(s, w, a)
#endif
/* INT8 under vpdpbusd: the stored bytes (q + 128, unsigned) go in as they are and the sums
 * start at -128 A, as INT4's nibbles (q + 8) start at -8 A: one instruction a unit where the
 * signs took three (|q| and the activations' signs moved to q's). The same integers: the
 * four products of a lane sum to less than 2^17 and vpdpbusd does not saturate. maddubs
 * (AVX2 without VNNI) saturates pairs of such products, so it keeps the signs. */
#ifdef IDOT_DPBUSD
#define IDOT_U8 1
#else
#define IDOT_U8 0
#endif
/* one unit's weights: INT4 the low and the high nibbles; INT8 the bytes as stored (IDOT_U8),
 * or |q| and q (for the signs) */
static inline idot_w idot_wb(const uint8_t *p, int bits) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)p);
    if (bits == 4) {
        const __m256i m = _mm256_set1_epi8(15);
        return (idot_w){_mm256_and_si256(v, m), _mm256_and_si256(_mm256_srli_epi16(v, 4), m)};
    }
    if (IDOT_U8) return (idot_w){v, v};
    const __m256i w = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
    return (idot_w){_mm256_sign_epi8(w, w), w};
}
/* start + the unit's lane sums (start: zero, or a row's offset correction, idot_start) */
static inline idot_i idot_lanes(idot_i start, idot_w w, const int8_t *qa, int bits) {
    const __m256i a0 = _mm256_loadu_si256((const __m256i *)(const void *)qa);
#ifdef IDOT_DPBUSD
    if (bits == 4) {
        const __m256i a1 = _mm256_loadu_si256((const __m256i *)(const void *)(qa + 32));
        return IDOT_DPBUSD(IDOT_DPBUSD(start, w.lo, a0), w.hi, a1);
    }
    return IDOT_DPBUSD(start, w.lo, a0);            /* stored bytes, sums from -128 A */
#endif
    __m256i p16;
    if (bits == 4) {          /* nibbles 0..15 unsigned; two byte pairs of each: |sum| < 2^13 */
        const __m256i a1 = _mm256_loadu_si256((const __m256i *)(const void *)(qa + 32));
        p16 = _mm256_add_epi16(_mm256_maddubs_epi16(w.lo, a0), _mm256_maddubs_epi16(w.hi, a1));
    } else {                  /* |q| <= 128 unsigned, its sign moved to the code */
        p16 = _mm256_maddubs_epi16(w.lo, _mm256_sign_epi8(a0, w.hi));
    }
    return _mm256_add_epi32(start, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}
/* I - off * A: off0 in lanes 0-3, off1 in 4-7 (zero points), or 8 everywhere (INT4) */
static inline idot_i idot_offs(int32_t off0, int32_t off1) {
    return _mm256_setr_m128i(_mm_set1_epi32(off0), _mm_set1_epi32(off1));
}
static inline idot_i idot_correct(idot_i I, const int32_t *A, idot_i off) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)A);
    return _mm256_sub_epi32(I, _mm256_mullo_epi32(a, off));
}
static inline idot_i idot_correct8(idot_i I, const int32_t *A) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)A);
    return _mm256_sub_epi32(I, _mm256_slli_epi32(a, 3));
}
static inline idot_i idot_izero(void) { return _mm256_setzero_si256(); }
/* the correction as a start for the lanes' sums: -off * A, or -8 A (INT4's nibbles) */
static inline idot_i idot_start(const int32_t *A, idot_i off) {
    return idot_correct(_mm256_setzero_si256(), A, off);
}
static inline idot_i idot_start8(const int32_t *A) {
    return idot_correct8(_mm256_setzero_si256(), A);
}
/* INT8's stored bytes under IDOT_U8: -128 A */
static inline idot_i idot_correct128(idot_i I, const int32_t *A) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)A);
    return _mm256_sub_epi32(I, _mm256_slli_epi32(a, 7));
}
static inline idot_i idot_start128(const int32_t *A) {
    return idot_correct128(_mm256_setzero_si256(), A);
}
#elif defined(IDOT_NEON)
/* eight lanes as two NEON registers; a unit's bytes 0-15 give lanes 0-3, 16-31 lanes 4-7 */
typedef struct { float32x4_t v[2]; } idot_f;
typedef struct { int32x4_t v[2]; } idot_i;
typedef struct { int8x16_t lo[2], hi[2]; } idot_w;
static inline idot_f idot_zero(void) { return (idot_f){{vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}}; }
static inline idot_f idot_ldf(const float *p) { return (idot_f){{vld1q_f32(p), vld1q_f32(p + 4)}}; }
static inline idot_f idot_f2(float s0, float s1) {
    return (idot_f){{vdupq_n_f32(s0), vdupq_n_f32(s1)}};
}
static inline idot_f idot_f2p(const float *p) { return idot_f2(p[0], p[1]); }
static inline idot_f idot_fma(idot_i i, idot_f d, idot_f t) {
    for (int h = 0; h < 2; ++h) t.v[h] = vfmaq_f32(t.v[h], vcvtq_f32_s32(i.v[h]), d.v[h]);
    return t;
}
static inline idot_f idot_fmaf(idot_f t, idot_f s, idot_f acc) {
    for (int h = 0; h < 2; ++h) acc.v[h] = vfmaq_f32(acc.v[h], t.v[h], s.v[h]);
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
    for (int h = 0; h < 2; ++h) {
        const uint8x16_t b = vld1q_u8(p + 16 * h);
        if (bits == 4) {
            w.lo[h] = vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(15)));
            w.hi[h] = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
        } else {
            w.lo[h] = vreinterpretq_s8_u8(veorq_u8(b, vdupq_n_u8(0x80)));
            w.hi[h] = vdupq_n_s8(0);
        }
    }
    return w;
}
/* sums of 4 consecutive byte products, added to s */
static inline int32x4_t idot_4s(int32x4_t s, int8x16_t w, int8x16_t a) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(s, w, a);
#else
    const int32x4_t p0 = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(a)));
    const int32x4_t p1 = vpaddlq_s16(vmull_high_s8(w, a));
    return vaddq_s32(s, vpaddq_s32(p0, p1));
#endif
}
static inline idot_i idot_lanes(idot_i start, idot_w w, const int8_t *qa, int bits) {
    idot_i I;
    for (int h = 0; h < 2; ++h) {
        I.v[h] = idot_4s(start.v[h], w.lo[h], vld1q_s8(qa + 16 * h));
        if (bits == 4) I.v[h] = idot_4s(I.v[h], w.hi[h], vld1q_s8(qa + 32 + 16 * h));
    }
    return I;
}
static inline idot_i idot_offs(int32_t off0, int32_t off1) {
    return (idot_i){{vdupq_n_s32(off0), vdupq_n_s32(off1)}};
}
static inline idot_i idot_correct(idot_i I, const int32_t *A, idot_i off) {
    for (int h = 0; h < 2; ++h) I.v[h] = vmlsq_s32(I.v[h], vld1q_s32(A + 4 * h), off.v[h]);
    return I;
}
static inline idot_i idot_correct8(idot_i I, const int32_t *A) {
    for (int h = 0; h < 2; ++h) I.v[h] = vsubq_s32(I.v[h], vshlq_n_s32(vld1q_s32(A + 4 * h), 3));
    return I;
}
static inline idot_i idot_izero(void) { return (idot_i){{vdupq_n_s32(0), vdupq_n_s32(0)}}; }
static inline idot_i idot_start(const int32_t *A, idot_i off) {
    return idot_correct(idot_izero(), A, off);
}
static inline idot_i idot_start8(const int32_t *A) { return idot_correct8(idot_izero(), A); }
#define IDOT_U8 0   /* sdot multiplies signed bytes: INT8 keeps q (these two go unused) */
static inline idot_i idot_correct128(idot_i I, const int32_t *A) {
    for (int h = 0; h < 2; ++h) I.v[h] = vsubq_s32(I.v[h], vshlq_n_s32(vld1q_s32(A + 4 * h), 7));
    return I;
}
static inline idot_i idot_start128(const int32_t *A) { return idot_correct128(idot_izero(), A); }
#else
/* portable C: the definition, lane by lane */
typedef struct { float v[8]; } idot_f;
typedef struct { int32_t v[8]; } idot_i;
typedef struct { const uint8_t *p; } idot_w;
static inline idot_f idot_zero(void) { return (idot_f){{0}}; }
static inline idot_f idot_ldf(const float *p) {
    idot_f f;
    memcpy(f.v, p, sizeof f.v);
    return f;
}
static inline idot_f idot_f2(float s0, float s1) {
    return (idot_f){{s0, s0, s0, s0, s1, s1, s1, s1}};
}
static inline idot_f idot_f2p(const float *p) { return idot_f2(p[0], p[1]); }
static inline idot_f idot_fma(idot_i i, idot_f d, idot_f t) {
    for (int l = 0; l < 8; ++l) t.v[l] = fmaf((float)i.v[l], d.v[l], t.v[l]);
    return t;
}
static inline idot_f idot_fmaf(idot_f t, idot_f s, idot_f acc) {
    for (int l = 0; l < 8; ++l) acc.v[l] = fmaf(t.v[l], s.v[l], acc.v[l]);
    return acc;
}
static inline float idot_sum(idot_f v) {
    const float *f = v.v;
    return ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7]));
}
static inline idot_w idot_wb(const uint8_t *p, int bits) {
    (void)bits;
    return (idot_w){p};
}
static inline idot_i idot_lanes(idot_i start, idot_w w, const int8_t *qa, int bits) {
    const int cpl = bits == 4 ? 8 : 4;
    idot_i I;
    for (int l = 0; l < 8; ++l) {
        int32_t s = start.v[l];
        for (int c = l * cpl; c < (l + 1) * cpl; ++c) {
            const int32_t q = bits == 4 ? (w.p[c / 2] >> (4 * (c & 1))) & 15 : w.p[c] - 128;
            s += q * qa[bits == 4 ? (c & 1) * 32 + c / 2 : c];
        }
        I.v[l] = s;
    }
    return I;
}
static inline idot_i idot_offs(int32_t off0, int32_t off1) {
    return (idot_i){{off0, off0, off0, off0, off1, off1, off1, off1}};
}
static inline idot_i idot_correct(idot_i I, const int32_t *A, idot_i off) {
    for (int l = 0; l < 8; ++l) I.v[l] -= off.v[l] * A[l];
    return I;
}
static inline idot_i idot_correct8(idot_i I, const int32_t *A) {
    for (int l = 0; l < 8; ++l) I.v[l] -= 8 * A[l];
    return I;
}
static inline idot_i idot_izero(void) { return (idot_i){{0}}; }
static inline idot_i idot_start(const int32_t *A, idot_i off) {
    return idot_correct(idot_izero(), A, off);
}
static inline idot_i idot_start8(const int32_t *A) { return idot_correct8(idot_izero(), A); }
#define IDOT_U8 0   /* the definition: INT8 takes q (these two go unused) */
static inline idot_i idot_correct128(idot_i I, const int32_t *A) {
    for (int l = 0; l < 8; ++l) I.v[l] -= 128 * A[l];
    return I;
}
static inline idot_i idot_start128(const int32_t *A) { return idot_correct128(idot_izero(), A); }
#endif

#endif
