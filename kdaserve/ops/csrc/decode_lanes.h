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
