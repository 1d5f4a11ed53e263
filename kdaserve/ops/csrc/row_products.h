/* Products of a weight matrix with the B rows of a step, for decode_blocks.h (included once
 * per weight type: WT, LDW, LDW8, LDW8P, LDW16, LDWV, WIDEN and NAME() come from the
 * includer). Each output sums its products in one fixed order whatever B, so a row's result
 * does not depend on its batch. */
#include "ksplit.h"

/* Y[b, n] = W[n, :] . X[b, :] for b < B: W [N, K] row-major, X rows ldx apart, Y rows ldy
 * apart. Tiles of four weight rows by four input rows (then two, then one), eight lanes per
 * vector (GCC/Clang vector extensions: the compiler's own vectorisation of the scalar form ran
 * at a fifth of this), so each weight row is read from memory once per step for all B rows.
 * Every (b, n) sums lane l over i = l, l+8, ..., then the tail, then the lanes in order: the
 * same order for any B and for one row, so a row's result does not depend on its batch.
 * On aarch64 each 8-lane sum is two NEON registers (decode_cpu.c's v8p; GCC keeps a v8f in
 * memory there) and rows go one at a time: four weight rows' sums (8), weights (8), products
 * (8) and the input (2) fit the 32 registers, a second row's would not. */
static inline void NAME(matmat_quad)(const WT *restrict W, const float *restrict X,
                                     int64_t ldx, float *restrict Y, int64_t ldy, int64_t K,
                                     int64_t B, int64_t n) {
    const int64_t K8 = K - K % 8;
    {
        const WT *w0 = W + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        int64_t b = 0;
#if V8_PARTS == 1
        /* four input rows at a time: 16 accumulators, 8 loads a step for 16 multiply-adds
         * (the 4 x 2 tile below spends 6 loads on 8) */
        for (; b + 4 <= B; b += 4) {
            const float *xr[4] = {X + b * ldx, X + (b + 1) * ldx, X + (b + 2) * ldx,
                                  X + (b + 3) * ldx};
            v8f acc[4][4];
#pragma GCC unroll 4
            for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
                for (int c = 0; c < 4; ++c) acc[r][c] = (v8f){0};
            for (int64_t i = 0; i < K8; i += 8) {
                const v8f v0 = LDW8(w0 + i), v1 = LDW8(w1 + i), v2 = LDW8(w2 + i),
                          v3 = LDW8(w3 + i);
#pragma GCC unroll 4
                for (int r = 0; r < 4; ++r) {
                    const v8f xv = ld8f(xr[r] + i);
                    acc[r][0] += v0 * xv; acc[r][1] += v1 * xv;
                    acc[r][2] += v2 * xv; acc[r][3] += v3 * xv;
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < 4; ++r) {
                float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
                const float *x0 = xr[r];
                for (int64_t i = K8; i < K; ++i) {
                    t0 += LDW(w0[i]) * x0[i]; t1 += LDW(w1[i]) * x0[i];
                    t2 += LDW(w2[i]) * x0[i]; t3 += LDW(w3[i]) * x0[i];
                }
                float *y0 = Y + (b + r) * ldy + n;
                y0[0] = lanes_sum(acc[r][0], t0); y0[1] = lanes_sum(acc[r][1], t1);
                y0[2] = lanes_sum(acc[r][2], t2); y0[3] = lanes_sum(acc[r][3], t3);
            }
        }
        for (; b + 2 <= B; b += 2) {
            const float *x0 = X + b * ldx, *x1 = x0 + ldx;
            v8f a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0};
            v8f a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
            for (int64_t i = 0; i < K8; i += 8) {
                const v8f xa = ld8f(x0 + i), xb = ld8f(x1 + i);
                const v8f v0 = LDW8(w0 + i), v1 = LDW8(w1 + i), v2 = LDW8(w2 + i),
                          v3 = LDW8(w3 + i);
                a00 += v0 * xa; a01 += v1 * xa; a02 += v2 * xa; a03 += v3 * xa;
                a10 += v0 * xb; a11 += v1 * xb; a12 += v2 * xb; a13 += v3 * xb;
            }
            float t00 = 0.0f, t01 = 0.0f, t02 = 0.0f, t03 = 0.0f;
            float t10 = 0.0f, t11 = 0.0f, t12 = 0.0f, t13 = 0.0f;
            for (int64_t i = K8; i < K; ++i) {
                const float u0 = LDW(w0[i]), u1 = LDW(w1[i]), u2 = LDW(w2[i]), u3 = LDW(w3[i]);
                t00 += u0 * x0[i]; t01 += u1 * x0[i]; t02 += u2 * x0[i]; t03 += u3 * x0[i];
                t10 += u0 * x1[i]; t11 += u1 * x1[i]; t12 += u2 * x1[i]; t13 += u3 * x1[i];
            }
            float *y0 = Y + b * ldy + n, *y1 = y0 + ldy;
            y0[0] = lanes_sum(a00, t00); y0[1] = lanes_sum(a01, t01);
            y0[2] = lanes_sum(a02, t02); y0[3] = lanes_sum(a03, t03);
            y1[0] = lanes_sum(a10, t10); y1[1] = lanes_sum(a11, t11);
            y1[2] = lanes_sum(a12, t12); y1[3] = lanes_sum(a13, t13);
        }
#endif
        for (; b < B; ++b) {
            const float *x0 = X + b * ldx;
            v8p a0[V8_PARTS] = {0}, a1[V8_PARTS] = {0}, a2[V8_PARTS] = {0}, a3[V8_PARTS] = {0};
            for (int64_t i = 0; i < K8; i += 8)
                for (int p = 0; p < V8_PARTS; ++p) {
                    const int64_t at = i + V8_LANES * p;
                    const v8p xa = ld8p(x0 + at);
                    a0[p] += LDW8P(w0 + at) * xa; a1[p] += LDW8P(w1 + at) * xa;
                    a2[p] += LDW8P(w2 + at) * xa; a3[p] += LDW8P(w3 + at) * xa;
                }
            float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
            for (int64_t i = K8; i < K; ++i) {
                t0 += LDW(w0[i]) * x0[i]; t1 += LDW(w1[i]) * x0[i];
                t2 += LDW(w2[i]) * x0[i]; t3 += LDW(w3[i]) * x0[i];
            }
            float *y0 = Y + b * ldy + n;
            y0[0] = lanes_sum8p(a0, t0); y0[1] = lanes_sum8p(a1, t1);
            y0[2] = lanes_sum8p(a2, t2); y0[3] = lanes_sum8p(a3, t3);
        }
    }
}

/* Four weight rows (outputs n..n+3) at a time over the threads, then the rest. */
static void NAME(matmat)(const WT *restrict W, const float *restrict X, int64_t ldx,
                         float *restrict Y, int64_t ldy, int64_t N, int64_t K, int64_t B) {
    const int64_t K8 = K - K % 8, N4 = N - N % 4;
    PAR_FOR(N4 * K * B >= PAR_MIN_MACS && team_threads() > 1, schedule(static),
            for (int64_t n = 0; n < N4; n += 4) NAME(matmat_quad)(W, X, ldx, Y, ldy, K, B, n););
    for (int64_t n = N4; n < N; ++n) {
        const WT *w = W + n * K;
        for (int64_t b = 0; b < B; ++b) {
            const float *x0 = X + b * ldx;
            v8p a[V8_PARTS] = {0};
            for (int64_t i = 0; i < K8; i += 8)
                for (int p = 0; p < V8_PARTS; ++p)
                    a[p] += LDW8P(w + i + V8_LANES * p) * ld8p(x0 + i + V8_LANES * p);
            float t = 0.0f;
            for (int64_t i = K8; i < K; ++i) t += LDW(w[i]) * x0[i];
            Y[b * ldy + n] = lanes_sum8p(a, t);
        }
    }
}

/* y[n] = W[n, :] . x for W [N, K] row-major (one row of matmat). */
static void NAME(matvec)(const WT *restrict W, const float *restrict x, float *restrict y,
                         int64_t N, int64_t K) {
    NAME(matmat)(W, x, K, y, N, N, K, 1);
}

/* y[0:N) = x . W for W [K, N] row-major, one row (matmat_t's order, unvectorised). */
static void NAME(vecmat)(const float *restrict x, const WT *restrict W, float *restrict y,
                         int64_t K, int64_t N) {
    const int64_t KH = k_split_at(N, K, (int64_t)sizeof(WT));
    for (int64_t n = 0; n < N; ++n) y[n] = 0.0f;
    for (int64_t i = 0; i < KH; ++i) {
        const float xi = x[i];
        const WT *w = W + i * N;
        for (int64_t n = 0; n < N; ++n) y[n] += xi * LDW(w[n]);
    }
    for (int64_t n = 0; n < N && KH < K; ++n) {     /* the second half: ksplit.h */
        float s = 0.0f;
        for (int64_t i = KH; i < K; ++i) s += x[i] * LDW(W[i * N + n]);
        y[n] += s;
    }
}

/* The register budget of the target sets the tiles of the outer products below. A 16-lane
 * sum is one register with AVX-512 (32 of them) and two with AVX2 (16 of them): the AVX-512
 * tile (6 rows x 32 outputs = 24 sums) spills on AVX2, so there a tile is 6 rows x 16 outputs
 * (12 registers of sums, 2 of weights, 1 of input): 2.0 -> 7 GFLOPS a thread at 6-256 rows
 * of a [2304 x 2304] product on an AVX2 EPYC. Up to STREAM_ROWS rows stream instead
 * (outer_rows_stream).
 * NEON (aarch64): 32 registers of 4 lanes, a 16-lane sum is four (vec16.h's VREGS16), and
 * the ISO C build does not fuse a multiply-add, so each product takes a register until its
 * add: GCC 12 issues a step's products before its adds. The 6 x 16 tile (24 sums + 24
 * products + 4 weights) spills about 13 products a step to L1, which the FP pipes' 48
 * operations a step hide on paper; a 3-row tile would fit (31 registers) but read each
 * weight tile from L2 twice as often. Neither is measured: no ARM machine here
 * (docs/benchmarks.md).
 * Each output still sums in K order: the results are the same bits with any tiling. */
#ifndef KDASERVE_ROW_PRODUCTS_TILES
#define KDASERVE_ROW_PRODUCTS_TILES
#if defined(__AVX512F__)
#define TILE_COLS 2        /* 16-lane sums per tile row: 32 outputs */
#else
#define TILE_COLS 1        /* AVX2, NEON */
#endif
#define TILE_OUT (16 * TILE_COLS)
/* the streamed rows' vectors: the target's register (8 lanes on AVX2; a v16f there was kept
 * in memory by GCC 12 and ran at 0.68x, docs/benchmarks.md) */
#define ROW_LANES VREG_LANES
#define ROW_T vregf
#define LDROW(p) LDWV(p)
#define LDACC(p) ldvf(p)
#define STROW(p, v) stvf(p, v)
#endif

/* VREG_LANES weights as floats: the includer's LDWV, else the first lanes of LDW16 */
#ifndef LDWV
#if VREG_LANES == 16
#define LDWV(p) LDW16(p)
#else
#define LDWV(p) (__extension__({ const v16f w16_ = LDW16(p); vregf w_; \
                                 memcpy(&w_, &w16_, sizeof w_); w_; }))
#endif
#endif

/* Y[b, n] = X[b, :] . W[:, n] for b < B: W [K, N] row-major (a projection stored transposed,
 * K-major), X rows ldx apart, Y rows ldy apart. Outer products: a tile of up to 6 input rows
 * by 32 outputs keeps its sums in registers (16 lanes) while i runs, each weight row segment
 * read once per tile. Every (b, n) sums x[b, i] w[i, n] in i order, y = y + x w (the build
 * is ISO C, so nothing is contracted), whatever the tile: the same for any B. One running sum
 * over K rounds a little more than the dot-product form's eight lanes (K3 demo hidden states
 * within 1.5e-4 of the torch forward's, logits within its 5e-4); summing in blocks of 32-128
 * to tighten it halved the speed in a microbenchmark. At 32 rows a step runs ~1.1-1.2x faster
 * than with the dot-product form above, which must reduce its lanes. */
static inline __attribute__((always_inline)) void NAME(outer_tile)(
        const WT *restrict W, const float *restrict X, int64_t ldx, float *restrict Y,
        int64_t ldy, int64_t N, int64_t k0, int64_t k1, int64_t n, int64_t b, const int R,
        const int C, const int add) {
    const int CV = C * VREGS16;       /* registers per tile row */
    vregf acc[6][2 * VREGS16];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < CV; ++c) acc[r][c] = (vregf){0};
    for (int64_t i = k0; i < k1; ++i) {
        const WT *w = W + i * N + n;
        vregf wv[2 * VREGS16];
#pragma GCC unroll 8
        for (int c = 0; c < CV; ++c) wv[c] = LDWV(w + VREG_LANES * c);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            const float x = X[(b + r) * ldx + i];
#pragma GCC unroll 8
            for (int c = 0; c < CV; ++c) acc[r][c] += wv[c] * x;
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < CV; ++c) {
            float *y = Y + (b + r) * ldy + n + VREG_LANES * c;
            if (add) stvf(y, ldvf(y) + acc[r][c]);
            else stvf(y, acc[r][c]);
        }
}

/* A tile's sums over [0, K), in two halves where ksplit.h splits them. */
static inline __attribute__((always_inline)) void NAME(outer_tile_k)(
        const WT *restrict W, const float *restrict X, int64_t ldx, float *restrict Y,
        int64_t ldy, int64_t N, int64_t K, int64_t KH, int64_t n, int64_t b, const int R,
        const int C) {
    NAME(outer_tile)(W, X, ldx, Y, ldy, N, 0, KH, n, b, R, C, 0);
    if (KH < K) NAME(outer_tile)(W, X, ldx, Y, ldy, N, KH, K, n, b, R, C, 1);
}

/* Outputs [n0, n1) (a multiple of ROW_LANES) of R <= STREAM_ROWS rows, i outer: each weight
 * row's run of the range is read once, in order, for all R rows, and every output's running
 * sum lives in an L1/L2 buffer between its adds. Register-held sums of 128 outputs at a time
 * read the weights in 512-byte runs a row apart, which the memory serves at 0.6-0.8x the rate
 * of these longer runs (docs/benchmarks.md); the tiles below read 64-byte runs a row apart,
 * and with weights out of cache ran 3 and 4 rows at 0.5-0.6x this form's rate (a [900 x 256]
 * fp32 product: 160-180 against 70-100 us). Each output still sums x[i] w[i, n] in i order,
 * y = y + x w: the same bits as the tiles. While a weight row's run streams, the next row's
 * run is asked for, a line at a time (into L1): a thread's run ends every row and the next
 * starts a row further on, which the hardware's stream prefetch picks up only after a few
 * misses. The demo's single-stream fused step: 1,308 -> 1,152 us (four alternating rounds,
 * every round; a non-temporal hint: 1,267). */
#define STREAM_OUT 2048
#define STREAM_ROWS 4
#define PF_EVERY ((int64_t)(64 / sizeof(WT)))     /* elements per cache line */
static void NAME(outer_rows_stream)(const WT *restrict W, const float *restrict X, int64_t ldx,
                                    float *restrict Y, int64_t ldy, int64_t N, int64_t k0,
                                    int64_t k1, int64_t n0, int64_t n1, int64_t R) {
    float acc[STREAM_ROWS][STREAM_OUT];
    for (int64_t a = n0; a < n1; a += STREAM_OUT) {
        const int64_t len = n1 - a < STREAM_OUT ? n1 - a : STREAM_OUT;
        for (int64_t r = 0; r < (R > 2 ? STREAM_ROWS : R); ++r)
            memset(acc[r], 0, sizeof(float) * (size_t)len);
        for (int64_t i = k0; i < k1; ++i) {
            const WT *w = W + i * N + a;
            const float x0 = X[i], x1 = R > 1 ? X[ldx + i] : 0.0f;
            if (R > 2) {             /* a fourth row of zeros when R is 3: its sums unread */
                const float x2 = X[2 * ldx + i], x3 = R > 3 ? X[3 * ldx + i] : 0.0f;
                for (int64_t j = 0; j < len; j += ROW_LANES) {
                    if (!(j & (PF_EVERY - 1))) __builtin_prefetch(w + N + j, 0, 3);
                    const ROW_T wv = LDROW(w + j);
                    STROW(acc[0] + j, LDACC(acc[0] + j) + wv * x0);
                    STROW(acc[1] + j, LDACC(acc[1] + j) + wv * x1);
                    STROW(acc[2] + j, LDACC(acc[2] + j) + wv * x2);
                    STROW(acc[3] + j, LDACC(acc[3] + j) + wv * x3);
                }
            } else if (R > 1)
                for (int64_t j = 0; j < len; j += ROW_LANES) {
                    if (!(j & (PF_EVERY - 1))) __builtin_prefetch(w + N + j, 0, 3);
                    const ROW_T wv = LDROW(w + j);
                    STROW(acc[0] + j, LDACC(acc[0] + j) + wv * x0);
                    STROW(acc[1] + j, LDACC(acc[1] + j) + wv * x1);
                }
            else
                for (int64_t j = 0; j < len; j += ROW_LANES) {
                    if (!(j & (PF_EVERY - 1))) __builtin_prefetch(w + N + j, 0, 3);
                    STROW(acc[0] + j, LDACC(acc[0] + j) + LDROW(w + j) * x0);
                }
        }
        for (int64_t r = 0; r < R; ++r)
            memcpy(Y + r * ldy + a, acc[r], sizeof(float) * (size_t)len);
    }
}

/* Outputs [n0, n1) of B rows, fewer than 16 of them (the last N % 16, or part of them): their
 * weight columns are copied into a zero-padded [K, 16] strip, which runs through the tiles
 * (then the outputs kept). The same sums in the same order as every other output: a scalar
 * loop here ran each output's sum as one dependent chain, serially after the threads (a KDA
 * input projection of 900 outputs at 32 rows: 170 against 120 us for 896 or 912 outputs). */
static void NAME(tail_outputs)(const WT *restrict W, int64_t ldw, const float *restrict X,
                               int64_t ldx, float *restrict Y, int64_t ldy, int64_t K,
                               int64_t KH, int64_t B, int64_t n0, int64_t n1) {
    const int64_t m = n1 - n0;
    WT *strip = calloc((size_t)(K * 16), sizeof(WT));
    float out[6 * 16];
    for (int64_t i = 0; i < K; ++i) memcpy(strip + i * 16, W + i * ldw + n0, sizeof(WT) * m);
    for (int64_t b = 0; b < B; b += 6) {
        const int R = B - b < 6 ? (int)(B - b) : 6;
        /* rows b.. of X as rows 0.. of the tile; outputs into `out`, 16 apart */
        switch (R) {
        case 6: NAME(outer_tile_k)(strip, X + b * ldx, ldx, out, 16, 16, K, KH, 0, 0, 6, 1); break;
        case 5: NAME(outer_tile_k)(strip, X + b * ldx, ldx, out, 16, 16, K, KH, 0, 0, 5, 1); break;
        case 4: NAME(outer_tile_k)(strip, X + b * ldx, ldx, out, 16, 16, K, KH, 0, 0, 4, 1); break;
        case 3: NAME(outer_tile_k)(strip, X + b * ldx, ldx, out, 16, 16, K, KH, 0, 0, 3, 1); break;
        case 2: NAME(outer_tile_k)(strip, X + b * ldx, ldx, out, 16, 16, K, KH, 0, 0, 2, 1); break;
        default: NAME(outer_tile_k)(strip, X + b * ldx, ldx, out, 16, 16, K, KH, 0, 0, 1, 1); break;
        }
        for (int r = 0; r < R; ++r) memcpy(Y + (b + r) * ldy + n0, out + r * 16, sizeof(float) * m);
    }
    free(strip);
}

/* Tile column t (outputs 16t.., TILE_COLS 16-lane sums wide where they fit) of B rows. */
static inline void NAME(tile_column)(const WT *restrict W, int64_t ldw, const float *restrict X,
                                     int64_t ldx, float *restrict Y, int64_t ldy, int64_t K,
                                     int64_t KH, int64_t NT, int64_t tiles, int64_t B,
                                     int64_t t) {
    const int64_t n = 16 * t;
    const int C = n + TILE_OUT <= NT ? TILE_COLS : 1;
    /* the next tile's weights (this thread's, under the static split) are on their way
     * while this one runs: several rows make a tile long enough to hide them */
    if (B > 2 && t + TILE_COLS < tiles)
        for (int64_t i = 0; i < K; ++i)
            for (int c = 0; c < TILE_COLS; ++c)
                __builtin_prefetch(W + i * ldw + n + TILE_OUT + 16 * c, 0, 2);
    int64_t b = 0;
    if (C == TILE_COLS) {        /* a whole tile wide: rows 6 at a time, then the rest */
        for (; b + 6 <= B; b += 6)
            NAME(outer_tile_k)(W, X, ldx, Y, ldy, ldw, K, KH, n, b, 6, TILE_COLS);
        switch (B - b) {
        case 5: NAME(outer_tile_k)(W, X, ldx, Y, ldy, ldw, K, KH, n, b, 5, TILE_COLS); break;
        case 4: NAME(outer_tile_k)(W, X, ldx, Y, ldy, ldw, K, KH, n, b, 4, TILE_COLS); break;
        case 3: NAME(outer_tile_k)(W, X, ldx, Y, ldy, ldw, K, KH, n, b, 3, TILE_COLS); break;
        case 2: NAME(outer_tile_k)(W, X, ldx, Y, ldy, ldw, K, KH, n, b, 2, TILE_COLS); break;
        case 1: NAME(outer_tile_k)(W, X, ldx, Y, ldy, ldw, K, KH, n, b, 1, TILE_COLS); break;
        default: break;
        }
    } else {                      /* the last 16 outputs of a 32-wide tiling */
        for (; b < B; ++b) NAME(outer_tile_k)(W, X, ldx, Y, ldy, ldw, K, KH, n, b, 1, 1);
    }
}

/* matmat_t over weights whose rows are ldw >= N elements apart (a padded K-major store:
 * rows a multiple of 4 KiB apart put a tile's column of weights in one set of each cache,
 * kdaserve/ops/cpu_linear.py). */
static void NAME(matmat_tw)(const WT *restrict W, int64_t ldw, const float *restrict X,
                            int64_t ldx, float *restrict Y, int64_t ldy, int64_t N, int64_t K,
                            int64_t B) {
    const int64_t NT = N - N % TILE_OUT, N16 = N - N % 16;
    const int64_t KH = k_split_at(N, K, (int64_t)sizeof(WT));
    int64_t first = 0;                 /* outputs before it are done */
    if (B <= STREAM_ROWS && KH < K) {
        /* few rows of a split product: the threads take (half, output range) parts, so with
         * two threads each reads one contiguous half of the matrix (ksplit.h); the first half
         * sums into Y, the second into T, then Y += T */
        const int64_t units = N16 / 16;
        int64_t parts = 1;
#ifdef _OPENMP
        if (!omp_in_parallel()) parts = omp_get_max_threads();
#endif
        int64_t ranges = parts / 2 > 0 ? parts / 2 : 1;
        if (ranges > units) ranges = units > 0 ? units : 1;
        float *T = malloc(sizeof(float) * (size_t)(B * (N16 > 0 ? N16 : 1)));
        PAR_FOR(parts > 1, schedule(static) num_threads((int)(2 * ranges)),
                for (int64_t p = 0; p < 2 * ranges; ++p) {
                    const int64_t h = p % 2, q = p / 2;
                    const int64_t n0 = 16 * (units * q / ranges);
                    const int64_t n1 = 16 * (units * (q + 1) / ranges);
                    if (h == 0) NAME(outer_rows_stream)(W, X, ldx, Y, ldy, ldw, 0, KH, n0, n1, B);
                    else NAME(outer_rows_stream)(W, X, ldx, T, N16, ldw, KH, K, n0, n1, B);
                });
        for (int64_t b = 0; b < B; ++b)
            for (int64_t n = 0; n < N16; ++n) Y[b * ldy + n] += T[b * N16 + n];
        free(T);
        first = N16;
    } else if (B <= STREAM_ROWS) {
        /* few rows: each thread one contiguous range of the outputs (a 16-multiple), streamed;
         * whole 128-output chunks dealt out left threads uneven (900 outputs: 4 to 3) */
        const int64_t units = N16 / 16;
        int64_t parts = 1;
#ifdef _OPENMP
        if (N * K * B >= PAR_MIN_MACS && !omp_in_parallel()) parts = omp_get_max_threads();
#endif
        if (parts > units) parts = units > 0 ? units : 1;
        PAR_FOR(parts > 1, schedule(static) num_threads((int)parts),
                for (int64_t p = 0; p < parts; ++p) {
                    const int64_t n0 = 16 * (units * p / parts);
                    const int64_t n1 = 16 * (units * (p + 1) / parts);
                    NAME(outer_rows_stream)(W, X, ldx, Y, ldy, ldw, 0, K, n0, n1, B);
                });
        first = N16;
    }
    const int64_t tiles = N16 / 16;
    if (first / 16 < tiles)          /* streamed rows left no tiles: no region for nothing */
        PAR_FOR(N * K * B >= PAR_MIN_MACS && team_threads() > 1, schedule(static),
                for (int64_t t = first / 16; t < tiles; t += TILE_COLS)
                    NAME(tile_column)(W, ldw, X, ldx, Y, ldy, K, KH, NT, tiles, B, t););
    if (N16 < N) NAME(tail_outputs)(W, ldw, X, ldx, Y, ldy, K, KH, B, N16, N);
}

static void NAME(matmat_t)(const WT *restrict W, const float *restrict X, int64_t ldx,
                           float *restrict Y, int64_t ldy, int64_t N, int64_t K, int64_t B) {
    NAME(matmat_tw)(W, N, X, ldx, Y, ldy, N, K, B);
}

/* Y [B, N] = X [B, K] W for the torch forms' linear layers over K-major weights
 * (kdaserve/ops/cpu_linear.py), typically a prefill's thousands of rows. matmat_t splits the
 * outputs over the threads, which leaves one thread idle on a narrow matrix; many rows are
 * split by rows instead, in blocks of whole 6-row tiles. Either way each output sums in K
 * order, so the split changes nothing in the result. */
void NAME(linear_rows)(int64_t B, int64_t N, int64_t K, const float *X, int64_t ldx,
                       const WT *W, int64_t ldw, float *Y, int64_t ldy, int64_t nthreads) {
    (void)nthreads;
#ifdef _OPENMP
    /* torch's count (OpenMP keeps it per calling thread; an engine thread may not have set it) */
    omp_set_num_threads((int)(nthreads > 0 ? nthreads : 1));
    if (B >= 96 && nthreads > 1) {
#pragma omp parallel
        {
            const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
            const int64_t per = ((B + nt - 1) / nt + 5) / 6 * 6;
            const int64_t b0 = t * per, b1 = b0 + per < B ? b0 + per : B;
            if (b0 < b1)
                NAME(matmat_tw)(W, ldw, X + b0 * ldx, ldx, Y + b0 * ldy, ldy, N, K, b1 - b0);
        }
        return;
    }
#endif
    NAME(matmat_tw)(W, ldw, X, ldx, Y, ldy, N, K, B);
}
