/* Lanes for the fused decode blocks (decode_cpu.c): bf16 weights widened to fp32 in
 * registers (a shift into each lane's top half) at 8, 16 and VREG_LANES lanes, and the
 * horizontal sums whose order the blocks' bits depend on (lanes in order, or a fixed tree).
 * Included once, by decode_cpu.c, after vec16.h.
 */
#ifndef KDASERVE_DECODE_LANES_H
#define KDASERVE_DECODE_LANES_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec16.h"

/* Eight fp32 lanes (one AVX2 register; the compiler pairs them on AVX-512). The typedef's
 * alignment of 4 lets a vector load from any float address. */
typedef float v8f __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));

static inline v8f ld8f(const float *p) {
    return *(const v8f *)(const void *)p;
}

/* eight bf16 values widened to fp32 (a shift into the top half of each lane); AVX2 widens
 * in one vpmovzxwd (GCC 12 takes the generic form four lanes at a time, with shuffles) */
static inline v8f ld8bf16(const uint16_t *p) {
#if defined(__AVX2__)
    return (v8f)_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)p)), 16);
#else
    const v8h h = *(const v8h *)(const void *)p;
    const v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* Sixteen lanes (vec16.h) for the outer-product tiles of outer_tiles.h, whose sums stay in
 * lanes and are never reduced; their bf16 weights widened. */
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));

static inline v16f ld16bf16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (v16f)_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)p)), 16);
#else
    const v16h h = *(const v16h *)(const void *)p;
    const v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* VREG_LANES bf16 weights widened (vec16.h's register of the outer products) */
typedef uint16_t vregh __attribute__((vector_size(2 * VREG_LANES), aligned(2), may_alias));
typedef uint32_t vregu __attribute__((vector_size(4 * VREG_LANES), aligned(4)));

static inline vregf ldvbf16(const uint16_t *p) {
#if VREG_LANES == 8
    return (vregf)ld8bf16(p);
#elif VREG_LANES == 16
    return (vregf)ld16bf16(p);
#else
    const vregh h = *(const vregh *)(const void *)p;
    const vregu u = __builtin_convertvector(h, vregu) << 16;
    vregf f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* Two registers of bf16 weights widened from one load, 2 VREG_LANES consecutive weights: lane
 * l of *e holds weight 2l, of *o weight 2l + 1. A bf16 pair in a 32-bit lane widens with a
 * shift (the even member) and a mask (the odd one), where widening in order takes a lane-
 * crossing vpmovzxwd as well, per register. Lanes are independent sums in the outer products,
 * so only where the outputs live changes (bwide_store puts them back in order), not a bit:
 * a 6-row tile of bf16 weights, one thread, in cache, Zen 4: 87-95 -> 102-109 GFLOPS. NEON
 * keeps the in-order widening (not measured there). */
#if VREG_LANES == 16 && defined(__AVX512F__)
#define BWIDE_PAIRS 1
static inline void bwide_load(const uint16_t *p, vregf *e, vregf *o) {
    const __m512i v = _mm512_loadu_si512((const void *)p);
    *e = (vregf)_mm512_slli_epi32(v, 16);
    *o = (vregf)_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u));
}
/* outputs y[0 .. 2 VREG_LANES) from their even (e) and odd (o) lanes, and back */
static inline void bwide_store(float *y, vregf e, vregf o) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                         15, 31);
    _mm512_storeu_ps(y, _mm512_permutex2var_ps((__m512)e, lo, (__m512)o));
    _mm512_storeu_ps(y + 16, _mm512_permutex2var_ps((__m512)e, hi, (__m512)o));
}
static inline void bwide_sums(const float *y, vregf *e, vregf *o) {
    const __m512 y0 = _mm512_loadu_ps(y), y1 = _mm512_loadu_ps(y + 16);
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                         30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                         31);
    *e = (vregf)_mm512_permutex2var_ps(y0, ev, y1);
    *o = (vregf)_mm512_permutex2var_ps(y0, od, y1);
}
#elif VREG_LANES == 8 && defined(__AVX2__)
#define BWIDE_PAIRS 1
static inline void bwide_load(const uint16_t *p, vregf *e, vregf *o) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)p);
    *e = (vregf)_mm256_slli_epi32(v, 16);
    *o = (vregf)_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u));
}
static inline void bwide_store(float *y, vregf e, vregf o) {
    const __m256 lo = _mm256_unpacklo_ps((__m256)e, (__m256)o);   /* 0-3 | 8-11 */
    const __m256 hi = _mm256_unpackhi_ps((__m256)e, (__m256)o);   /* 4-7 | 12-15 */
    _mm256_storeu_ps(y, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(y + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}
static inline void bwide_sums(const float *y, vregf *e, vregf *o) {
    const __m256 y0 = _mm256_loadu_ps(y), y1 = _mm256_loadu_ps(y + 8);
    *e = (vregf)_mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(y0, y1, 0x88)), 0xD8));
    *o = (vregf)_mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(y0, y1, 0xDD)), 0xD8));
}
#else
/* the same three in generic lanes, for a build's dead branches (NEON widens in order) */
#define BWIDE_PAIRS 0
static inline void bwide_load(const uint16_t *p, vregf *e, vregf *o) {
    for (int l = 0; l < VREG_LANES; ++l) {
        const uint32_t ue = (uint32_t)p[2 * l] << 16, uo = (uint32_t)p[2 * l + 1] << 16;
        memcpy((float *)e + l, &ue, 4);
        memcpy((float *)o + l, &uo, 4);
    }
}
static inline void bwide_store(float *y, vregf e, vregf o) {
    for (int l = 0; l < VREG_LANES; ++l) y[2 * l] = e[l], y[2 * l + 1] = o[l];
}
static inline void bwide_sums(const float *y, vregf *e, vregf *o) {
    for (int l = 0; l < VREG_LANES; ++l) (*e)[l] = y[2 * l], (*o)[l] = y[2 * l + 1];
}
#endif

/* s + lane 0 + lane 1 + ... + lane 7, in that order */
static inline float lanes_sum(v8f a, float s) {
    for (int l = 0; l < 8; ++l) s += a[l];
    return s;
}

/* The eight lanes of a summed as a tree (three adds): the attention's dot products are
 * per (position, head), so their horizontal sums are a cost of their own. */
static inline float hsum8(v8f a) {
    typedef float v4f __attribute__((vector_size(16)));
    const v4f lo = __builtin_shufflevector(a, a, 0, 1, 2, 3);
    const v4f hi = __builtin_shufflevector(a, a, 4, 5, 6, 7);
    const v4f t = lo + hi;
    return (t[0] + t[2]) + (t[1] + t[3]);
}

/* An 8-lane sum as registers hold it, for mla_attend.h: one v8f on x86; two 4-lane NEON
 * registers on aarch64, where GCC 12 keeps a 32-byte generic vector in memory (a store and a
 * reload around every add). Part p holds lanes 4p..4p+3. */
#if defined(__aarch64__)
#define V8_PARTS 2
#else
#define V8_PARTS 1
#endif
#define V8_LANES (8 / V8_PARTS)
typedef float v8p __attribute__((vector_size(4 * V8_LANES), aligned(4), may_alias));
typedef uint16_t v8ph __attribute__((vector_size(2 * V8_LANES), aligned(2), may_alias));
typedef uint32_t v8pu __attribute__((vector_size(4 * V8_LANES), aligned(4)));

static inline v8p ld8p(const float *p) {
    return *(const v8p *)(const void *)p;
}

static inline void st8p(float *p, v8p v) { *(v8p *)(void *)p = v; }

static inline v8p ld8pbf16(const uint16_t *p) {
    const v8ph h = *(const v8ph *)(const void *)p;
    const v8pu u = __builtin_convertvector(h, v8pu) << 16;
    v8p f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* lanes_sum of the sum held in parts a[0..V8_PARTS): s + its lanes in order */
static inline float lanes_sum8p(const v8p *a, float s) {
    for (int p = 0; p < V8_PARTS; ++p)
        for (int l = 0; l < V8_LANES; ++l) s += a[p][l];
    return s;
}

/* hsum8 of the sum held in parts a[0..V8_PARTS): the same tree */
static inline float hsum8p(const v8p *a) {
#if V8_PARTS == 1
    return hsum8(a[0]);
#else
    const v8p t = a[0] + a[1];        /* lanes l + (l + 4) */
    return (t[0] + t[2]) + (t[1] + t[3]);
#endif
}

#endif
