/* Integer dot products over packed INT8/INT4 rows (int_rows.h's qmat) for decode rows, as
 * llama.cpp's Q4_0 / Q8_0 take them: each input row is quantized once per product to int8 in
 * blocks of 32 columns (one fp32 scale a block), the weights stay integers, and the products
 * sum exactly in int32; only those sums meet floats. int_rows.h's fp32 decode costs about
 * twice the instructions per weight, which kept the INT4 lone row compute-bound.
 *
 * The math, exactly (kdaserve/ops/int_quant.py `int_dot_oracle` is its torch form):
 * - activation block b of a row: d = amax|x| / 127, id = d > 0 ? 1 / d : 0, code = rint(x * id)
 *   (fp32, ties to even);
 * - a row's columns in units of 32 bytes of weights (INT8: 32 columns, INT4: 64, two blocks),
 *   each unit in 8 lanes of consecutive columns (4 or 8); a lane lies in one block, scale d;
 * - I = sum over a lane's columns of (q - zero) * code, exact (int32);
 * - per lane: t = 0 at each group's start, t = fma(I, d, t) unit after unit, and at the group's
 *   end acc = fma(t, scale_g, acc); then y = ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7)).
 * Every fma is fused on every build (AVX2 / NEON intrinsics, fmaf otherwise) and the build is
 * ISO C (no other contraction), so every ISA gives the same bits, and a row's result depends
 * on nothing but its own inputs (not the batch, not the thread count). An INT4 unit's bytes
 * unpack to its even columns (low nibbles) and its odd ones (high): the activations are
 * stored in that order once per row, so no weight is shuffled. Needs K a multiple of the unit
 * and the group a multiple of 64 (INT4; or 32 exactly) or 32 (INT8): int_rows.h falls back
 * to its fp32 decode otherwise. */
#ifndef KDASERVE_INT_DOT_H
#define KDASERVE_INT_DOT_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int_acts.h"
#include "int_dot_lanes.h"

/* bytes read ahead of a tile's rows (int_dot.h's tiles read NO rows side by side, which the
 * hardware prefetcher followed at half the rate of one row after another) */
#ifndef IDOT_AHEAD
#define IDOT_AHEAD 4096
#endif

/* the offset of the codes the lanes multiply: INT4's unsigned nibbles q + 8, INT8's stored
 * bytes q + 128 where they go in as stored (IDOT_U8), else INT8's q */
static inline int32_t idot_base(int bits) { return bits == 4 ? 8 : IDOT_U8 ? 128 : 0; }

/* I - base A for a row without zero points (I itself where the base is 0): its sums'
 * correction, after them (a lone row) or as their start (from zero) */
static inline idot_i idot_correct_base(idot_i I, const int32_t *A, int bits) {
    return bits == 4 ? idot_correct8(I, A) : IDOT_U8 ? idot_correct128(I, A) : I;
}
static inline idot_i idot_start_base(const int32_t *A, int bits) {
    return idot_correct_base(idot_izero(), A, bits);
}

/* Tiles of four outputs by two rows where 32 vector registers hold their 16 sums
 * (AVX-512VL's ymm0-31; AVX2 and NEON have 16 and would spill them): a unit's weights,
 * unpacked once, serve two rows and each row's codes four outputs. One thread, [1024 x 1024]
 * INT4 in L2, 2 to 32 rows: 1.32-1.35x the multiply-adds a second of 2 x 2 tiles; INT8,
 * whose units need no unpacking, even (docs/benchmarks.md, twenty-third session). */
#ifndef IDOT_WIDE_TILES
#if defined(IDOT_AVX2) && defined(__AVX512VL__)
#define IDOT_WIDE_TILES 1
#else
#define IDOT_WIDE_TILES 0
#endif
#endif

/* Y[r * ldy + n + o] for NO outputs from n and R rows (NO * R <= 4, or 8 with
 * IDOT_WIDE_TILES: the sums stay in registers), each (row, output) computed as the header
 * says whatever its tile mates. gu: units per group (0: INT4 in groups of 32, each unit's
 * lanes 0-3 and 4-7 in groups of their own). */
static inline __attribute__((always_inline)) void
idot_tile(const qmat *m, int64_t n, int NO, const qacts *a, int64_t r0, int R, float *Y,
          int64_t ldy, int bits, int64_t gu, int zp) {
    const int64_t U = a->U, G = m->groups;
    const int32_t base = idot_base(bits);
    const uint8_t *w0 = m->packed + n * m->row_bytes;
    idot_f acc[8];
    for (int i = 0; i < NO * R; ++i) acc[i] = idot_zero();
    const int64_t steps = gu ? G : U;                  /* groups, or units of two groups */
    for (int64_t g = 0; g < steps; ++g) {
        const int64_t u0 = gu ? g * gu : g, u1 = gu ? ((g + 1) * gu < U ? (g + 1) * gu : U) : g + 1;
        const int64_t g0 = gu ? g : 2 * g, g1 = gu ? g : 2 * g + 1;
        idot_f t[8];
        for (int i = 0; i < NO * R; ++i) t[i] = idot_zero();
        idot_i off[4];                     /* one an output (NO <= 4) */
        for (int o = 0; zp && o < NO; ++o) {
            const int8_t *z = m->zero + (n + o) * G;
            off[o] = idot_offs(base + z[g0], base + z[g1]);
        }
        for (int64_t u = u0; u < u1; ++u) {
            const uint8_t *pf = w0 + IDOT_AHEAD + u * NO * 32;
            for (int c = 0; IDOT_AHEAD && c < NO * 32; c += 64) __builtin_prefetch(pf + c);
            /* several rows: each row's sums start at its offset correction (-8 A for INT4's
             * nibbles, once for all the outputs: the same integers). Rows of 8 and 32, hot,
             * one thread: INT4 1.25-1.28x, INT8 1.10x the multiply-adds a second. A lone row
             * corrects after its sums, which measured 2-5% faster there (docs/benchmarks.md,
             * twenty-third session). */
            idot_i start[2];
            for (int r = 0; R > 1 && r < R; ++r)
                start[r] = zp ? idot_izero() : idot_start_base(a->A + ((r0 + r) * U + u) * 8,
                                                                bits);
            for (int o = 0; o < NO; ++o) {
                const idot_w w = idot_wb(w0 + o * m->row_bytes + u * 32, bits);
                for (int r = 0; r < R; ++r) {
                    const int64_t ru = (r0 + r) * U + u;
                    const int8_t *qa = a->q + (r0 + r) * a->K + u * idot_unit(bits);
                    idot_i I;
                    if (R > 1) {
                        I = idot_lanes(zp ? idot_start(a->A + ru * 8, off[o]) : start[r], w, qa,
                                       bits);
                    } else {
                        I = idot_lanes(idot_izero(), w, qa, bits);
                        I = zp ? idot_correct(I, a->A + ru * 8, off[o])
                               : idot_correct_base(I, a->A + ru * 8, bits);
                    }
                    t[o * R + r] = idot_fma(I, idot_ldf(a->d + ru * 8), t[o * R + r]);
                }
            }
        }
        for (int o = 0; o < NO; ++o) {
            const float *s = m->scale + (n + o) * G;
            const idot_f sv = gu ? idot_f2(s[g0], s[g1]) : idot_f2p(s + g0);   /* g1 = g0 + 1 */
            for (int r = 0; r < R; ++r)
                acc[o * R + r] = idot_fmaf(t[o * R + r], sv, acc[o * R + r]);
        }
    }
    for (int o = 0; o < NO; ++o)
        for (int r = 0; r < R; ++r) Y[(r0 + r) * ldy + n + o] = idot_sum(acc[o * R + r]);
}

#include "int_row4.h"

/* Y[b, n + o] for NO outputs from n and rows [r0, r1): two rows a tile, an odd last one alone */
static inline __attribute__((always_inline)) void
idot_col(const qmat *m, int64_t n, int NO, const qacts *a, int64_t r0, int64_t r1, float *Y,
         int64_t ldy, int bits, int64_t gu, int zp) {
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2) idot_tile(m, n, NO, a, r, 2, Y, ldy, bits, gu, zp);
    if (r < r1) idot_tile(m, n, NO, a, r, 1, Y, ldy, bits, gu, zp);
}

/* Y[b, n] for rows [r0, r1) of `a`, outputs [n0, n1): a lone row four outputs at a time
 * (four independent sums), more rows two outputs by two rows (four by two with
 * IDOT_WIDE_TILES) */
static inline __attribute__((always_inline)) void
idot_rows_b(const qmat *m, const qacts *a, int64_t r0, int64_t r1, float *Y, int64_t ldy,
            int64_t n0, int64_t n1, int bits, int64_t gu, int zp) {
    int64_t n = n0;
    if (r1 - r0 == 1 && gu && IDOT_ROW4)
        for (; n + 4 <= n1; n += 4) idot_row4(m, n, a, r0, Y + r0 * ldy, bits, gu, zp, 1);
    else if (r1 - r0 == 1 && bits == 4 && IDOT_ROW4)        /* INT4 in groups of 32 */
        for (; n + 4 <= n1; n += 4) idot_row4_g32(m, n, a, r0, Y + r0 * ldy, zp);
    else if (r1 - r0 == 1)
        for (; n + 4 <= n1; n += 4) idot_tile(m, n, 4, a, r0, 1, Y, ldy, bits, gu, zp);
    else if (IDOT_WIDE_TILES)
        for (; n + 4 <= n1; n += 4) idot_col(m, n, 4, a, r0, r1, Y, ldy, bits, gu, zp);
    for (; n + 2 <= n1; n += 2) idot_col(m, n, 2, a, r0, r1, Y, ldy, bits, gu, zp);
    if (n < n1) idot_col(m, n, 1, a, r0, r1, Y, ldy, bits, gu, zp);
}

/* rows a block at a time, so that their codes stay in the L1 cache while the outputs pass */
#define IDOT_ROWS 16

static void idot_rows(const qmat *m, const qacts *a, int64_t B, float *Y, int64_t ldy,
                      int64_t n0, int64_t n1) {
    /* one copy per case, so that the tiles' loops hold no branch */
    const int64_t gu = m->group / idot_unit(m->bits);
    for (int64_t r0 = 0; r0 < B; r0 += IDOT_ROWS) {
        const int64_t r1 = r0 + IDOT_ROWS < B ? r0 + IDOT_ROWS : B;
        if (m->bits == 8 && !m->zero) idot_rows_b(m, a, r0, r1, Y, ldy, n0, n1, 8, gu, 0);
        else if (m->bits == 8) idot_rows_b(m, a, r0, r1, Y, ldy, n0, n1, 8, gu, 1);
        else if (gu && !m->zero) idot_rows_b(m, a, r0, r1, Y, ldy, n0, n1, 4, gu, 0);
        else if (gu) idot_rows_b(m, a, r0, r1, Y, ldy, n0, n1, 4, gu, 1);
        else if (!m->zero) idot_rows_b(m, a, r0, r1, Y, ldy, n0, n1, 4, 0, 0);
        else idot_rows_b(m, a, r0, r1, Y, ldy, n0, n1, 4, 0, 1);
    }
}

/* idot_rows, where a lone INT8 row's first 4Q outputs go through int_row4.h's streams. Outside
 * idot_rows: the streams' branch inside it changed the code around the several-row tiles,
 * which then ran 2-3% slower (INT8 and INT4 at 8 rows), though their source was the same. */
static void idot_product(const qmat *m, const qacts *a, int64_t B, float *Y, int64_t ldy,
                         int64_t n0, int64_t n1) {
    const int64_t gu = m->group / idot_unit(m->bits);
    const int streams = m->bits == 8 ? IDOT_STREAMS_INT8 : IDOT_STREAMS_INT4;
    const int64_t Q = B == 1 && gu && IDOT_ROW4 && streams ? (n1 - n0) / 4 : 0;
    if (Q > 1) {
        idot_streams(m, a, 0, Y, n0, Q, m->bits, gu, m->zero != NULL);
        n0 += 4 * Q;                                 /* the last (n1 - n0) % 4: idot_rows */
    }
    if (n0 < n1) idot_rows(m, a, B, Y, ldy, n0, n1);
}

/* whether a product over m with K columns takes the integer dots */
static inline int idot_applies(const qmat *m, int64_t K) {
    if (!m->act8 || (m->bits != 4 && m->bits != 8) || m->group <= 0) return 0;
    const int64_t unit = idot_unit(m->bits);
    return K % unit == 0 && (m->group % unit == 0 || (m->bits == 4 && m->group == 32));
}

#endif
