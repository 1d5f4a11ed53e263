/* The outer-product tile of outer_tiles.h for bf16 weights and bf16 activations, two rows of K
 * a step through AVX-512 BF16's dot products (vdpbf16ps); included by row_products.h once per
 * weight type, compiled only in the bf16 copy (WIDEN) of a build for a CPU that has them.
 *
 * Why: a bf16 model's prefill runs its products on activations the torch forms have already
 * rounded to bf16, and the fp32 tile spends one multiply-add a product: compute-bound at ~160
 * GFLOPS on two Zen 4 cores, 79% of a 128-token prefill of the memory-bound model, where
 * llama.cpp's bf16 dot products do two a lane per instruction (docs/benchmarks.md).
 *
 * The same bits as the fp32 tile: vdpbf16ps adds, in each fp32 lane, the product of its odd
 * bf16 pair members and then that of its even ones, rounding after each add (Intel's
 * definition; checked on Zen 4 over 3.2M random lanes, where the other order differed in
 * 11%). A product of two bf16 values is exact in fp32, so each add is fma(w, x, y) of the
 * fp32 tile. The pairs are laid out with row i in the odd member and row i + 1 in the even
 * one, so every output still sums x[i] w[i, n] in i order, and a row's result is the same
 * whether it runs here, in the fp32 tiles or in the streamed rows (the tests compare the
 * builds with and without these tiles). Unlike vfmas, the instruction treats subnormal inputs
 * and results as zero: products below ~1e-38, which these models do not make. */
#undef PAIR_TILES
#if WIDEN && defined(__AVX512BF16__)
#define PAIR_TILES 1
#ifndef KDASERVE_PAIR_TILES_IDX
#define KDASERVE_PAIR_TILES_IDX
#include <immintrin.h>
/* Interleaving rows i + 1 and i (vpunpck{l,h}wd, within 128-bit lanes) leaves a tile's 32
 * outputs in two sums as [0-3, 8-11, 16-19, 24-27] and [4-7, 12-15, 20-23, 28-31]; these
 * indices (vpermt2ps: 16 and up from the second source) put them back in order, and back. */
static const int32_t PAIR_OUT0[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
static const int32_t PAIR_OUT1[16] = {8, 9, 10, 11, 24, 25, 26, 27,
                                      12, 13, 14, 15, 28, 29, 30, 31};
static const int32_t PAIR_IN_LO[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
static const int32_t PAIR_IN_HI[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};

static inline __m512i pair_idx(const int32_t *p) { return _mm512_loadu_si512((const void *)p); }
#endif

/* Rows b.. (R <= 6) by outputs n..n+31 over rows [k0, k1) of W (both even), as outer_tile
 * with C = TILE_COLS and `add` as there. XP [rows, ldp]: the activations as pairs, pair j of a
 * row holding bf16 x[2j] in its high half and x[2j + 1] in its low (pairs_of). */
static inline __attribute__((always_inline)) void NAME(pair_tile)(
        const WT *restrict W, const uint32_t *restrict XP, int64_t ldp, float *restrict Y,
        int64_t ldy, int64_t N, int64_t k0, int64_t k1, int64_t n, int64_t b, const int R,
        const int add, struct NAME(tcursor) *pf, int64_t pf_lines) {
    __m512 acc[6][2];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
        if (add == 2) {
            const __m512 y0 = _mm512_loadu_ps(Y + (b + r) * ldy + n);
            const __m512 y1 = _mm512_loadu_ps(Y + (b + r) * ldy + n + 16);
            acc[r][0] = _mm512_permutex2var_ps(y0, pair_idx(PAIR_IN_LO), y1);
            acc[r][1] = _mm512_permutex2var_ps(y0, pair_idx(PAIR_IN_HI), y1);
        } else {
            acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        }
    }
    for (int64_t i = k0; i < k1; i += 2) {
        if (pf) NAME(tcursor_step)(pf, 2 * pf_lines, 2);
        const __m512i w0 = _mm512_loadu_si512((const void *)(W + i * N + n));
        const __m512i w1 = _mm512_loadu_si512((const void *)(W + (i + 1) * N + n));
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(w1, w0);
        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(w1, w0);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)XP[(b + r) * ldp + i / 2]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], lo, xv);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], hi, xv);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
        float *y = Y + (b + r) * ldy + n;
        __m512 y0 = _mm512_permutex2var_ps(acc[r][0], pair_idx(PAIR_OUT0), acc[r][1]);
        __m512 y1 = _mm512_permutex2var_ps(acc[r][0], pair_idx(PAIR_OUT1), acc[r][1]);
        if (add == 1) {
            y0 = _mm512_add_ps(_mm512_loadu_ps(y), y0);
            y1 = _mm512_add_ps(_mm512_loadu_ps(y + 16), y1);
        }
        _mm512_storeu_ps(y, y0);
        _mm512_storeu_ps(y + 16, y1);
    }
}

/* rows b.. of the 32 outputs at n over rows [k0, k1), R known at compile time in each case */
static inline void NAME(pair_tiles_rows)(const WT *restrict W, const uint32_t *restrict XP,
                                         int64_t ldp, float *restrict Y, int64_t ldy, int64_t N,
                                         int64_t k0, int64_t k1, int64_t n, int64_t b0,
                                         int64_t B, int add, struct NAME(tcursor) *pf,
                                         int64_t pf_lines) {
    int64_t b = b0;
#define PAIR_PART(R_) NAME(pair_tile)(W, XP, ldp, Y, ldy, N, k0, k1, n, b, R_, add, \
                                      b == b0 ? pf : NULL, pf_lines)
    for (; b + 6 <= B; b += 6) PAIR_PART(6);
    switch (B - b) {
    case 5: PAIR_PART(5); break;
    case 4: PAIR_PART(4); break;
    case 3: PAIR_PART(3); break;
    case 2: PAIR_PART(2); break;
    case 1: PAIR_PART(1); break;
    default: break;
    }
#undef PAIR_PART
}
#else
#define PAIR_TILES 0
#endif

#ifndef KDASERVE_PAIRS_OF
#define KDASERVE_PAIRS_OF
/* XP [B, (K + 1) / 2] for pair_tile from bf16 rows X [B, K] (ldx apart); a last odd row's
 * pair holds x[K - 1] and zero */
static inline void pairs_of(const uint16_t *X, int64_t ldx, int64_t B, int64_t K, uint32_t *XP) {
    const int64_t P = (K + 1) / 2;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < P; ++j) {
            const uint32_t hi = X[b * ldx + 2 * j];
            const uint32_t lo = 2 * j + 1 < K ? X[b * ldx + 2 * j + 1] : 0;
            XP[b * P + j] = hi << 16 | lo;
        }
}
#endif
