/* Products of a weight matrix with the B rows of a step, for decode_blocks.h (included once
 * per weight type: WT, LDW, LDW8, LDW8P, LDW16, LDWV, WIDEN and NAME() come from the
 * includer). Each output sums its products in one fixed order whatever B, so a row's result
 * does not depend on its batch. Weights as the model keeps them ([N, K]) take the
 * dot-product form (row_dots.h); K-major ones ([K, N]) the outer products below, built from
 * outer_tiles.h's register tiles, or streamed for a few rows. */
#include "ksplit.h"

#include "row_dots.h"

#include "outer_tiles.h"

#include "pair_tiles.h"

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
                    STROW(acc[0] + j, vfmas(LDACC(acc[0] + j), wv, x0));
                    STROW(acc[1] + j, vfmas(LDACC(acc[1] + j), wv, x1));
                    STROW(acc[2] + j, vfmas(LDACC(acc[2] + j), wv, x2));
                    STROW(acc[3] + j, vfmas(LDACC(acc[3] + j), wv, x3));
                }
            } else if (R > 1)
                for (int64_t j = 0; j < len; j += ROW_LANES) {
                    if (!(j & (PF_EVERY - 1))) __builtin_prefetch(w + N + j, 0, 3);
                    const ROW_T wv = LDROW(w + j);
                    STROW(acc[0] + j, vfmas(LDACC(acc[0] + j), wv, x0));
                    STROW(acc[1] + j, vfmas(LDACC(acc[1] + j), wv, x1));
                }
            else
                for (int64_t j = 0; j < len; j += ROW_LANES) {
                    if (!(j & (PF_EVERY - 1))) __builtin_prefetch(w + N + j, 0, 3);
                    STROW(acc[0] + j, vfmas(LDACC(acc[0] + j), LDROW(w + j), x0));
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

/* Tile column t (outputs 16t.., TILE_COLS 16-lane sums wide where they fit) of B rows; a
 * whole tile's width in pair tiles where XP holds the rows as pairs (pair_tiles.h). */
static inline void NAME(tile_column)(const WT *restrict W, int64_t ldw, const float *restrict X,
                                     int64_t ldx, const uint32_t *XP, int64_t ldp,
                                     float *restrict Y, int64_t ldy, int64_t K, int64_t KH,
                                     int64_t NT, int64_t tiles, int64_t B, int64_t t) {
    const int64_t n = 16 * t;
    const int C = n + TILE_OUT <= NT ? TILE_COLS : 1;
    /* the next tile's weights (this thread's, under the static split) are on their way
     * while this one runs: several rows make a tile long enough to hide them. Non-temporal:
     * a step of many rows reads every expert, more weights than the L3 holds, so kept lines
     * can only push out what is read again soon (the guess: the KDA states, 2 MB a layer at
     * 32 rows); the demo's 32-row fused step, this build's table against the kept-line one in
     * one engine, 12 alternating runs: faster in 11, -4 to -5% (8 rows: even) */
    if (B > 2 && t + TILE_COLS < tiles)
        for (int64_t i = 0; i < K; ++i)
            for (int c = 0; c < TILE_COLS; ++c)
                __builtin_prefetch(W + i * ldw + n + TILE_OUT + 16 * c, 0, 0);
    int64_t b = 0;
#if PAIR_TILES
    if (XP && C == TILE_COLS && !((K | KH) & 1)) {
        NAME(pair_tiles_rows)(W, XP, ldp, Y, ldy, ldw, 0, KH, n, 0, B, 0, NULL, 0);
        if (KH < K) NAME(pair_tiles_rows)(W, XP, ldp, Y, ldy, ldw, KH, K, n, 0, B, 1, NULL, 0);
        return;
    }
#else
    (void)XP, (void)ldp;
#endif
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

#include "tiles_blocked.h"

/* matmat_t over weights whose rows are ldw >= N elements apart (a padded K-major store:
 * rows a multiple of 4 KiB apart put a tile's column of weights in one set of each cache,
 * kdaserve/ops/cpu_linear.py). */
static void NAME(matmat_twp)(const WT *restrict W, int64_t ldw, const float *restrict X,
                             int64_t ldx, const uint32_t *XP, int64_t ldp, float *restrict Y,
                             int64_t ldy, int64_t N, int64_t K, int64_t B) {
    const int64_t NT = N - N % TILE_OUT, N16 = N - N % 16;
    const int64_t KH = k_split_at(N, K, (int64_t)sizeof(WT));
    int64_t first = 0;                 /* outputs before it are done */
    /* a matrix from memory (tiles_blocked.h) streams only a lone row: 2-4 rows, and a bf16
     * row on one thread (an expert of the blocks' item loop), ran 1.4-4x faster through the
     * blocked tiles (a [1024 x 1024] out of cache, AVX-512 EPYC: bf16 3 rows on one thread
     * 646 -> 132 us, a bf16 row 132-176 -> 91-97); an fp32 row on one thread ran even
     * (217-255 against 210-271 us), and in cache (the demo's padded LM head, a server's
     * --torch-threads 1) keeps the stream it was tuned on */
    const int big = (int64_t)sizeof(WT) * N * K >= TILE_BLOCKED_BYTES && K > tile_kblock(B);
    const int64_t stream_rows =
        !big ? STREAM_ROWS : team_threads() > 1 || sizeof(WT) == sizeof(float) ? 1 : 0;
    if (B <= stream_rows && KH < K) {
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
    } else if (B <= stream_rows) {
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
    if (first / 16 < tiles && big) {
        /* weights from memory: K in blocks (tiles_blocked.h), each thread a contiguous range
         * of the tile columns */
        const int64_t units = (tiles - first / 16 + TILE_COLS - 1) / TILE_COLS;
        int64_t parts = N * K * B >= PAR_MIN_MACS ? team_threads() : 1;
        if (parts > units) parts = units;
        float *T = KH < K ? malloc(sizeof(float) * (size_t)(B * N16)) : NULL;
        PAR_FOR(parts > 1, schedule(static) num_threads((int)parts),
                for (int64_t p = 0; p < parts; ++p) {
                    const int64_t t0 = first / 16 + TILE_COLS * (units * p / parts);
                    int64_t t1 = first / 16 + TILE_COLS * (units * (p + 1) / parts);
                    t1 = t1 < tiles ? t1 : tiles;
                    NAME(tiles_blocked)(W, ldw, X, ldx, XP, ldp, Y, ldy, T, N16, K, KH, NT, B, t0,
                                        t1);
                });
        free(T);
    } else if (first / 16 < tiles)   /* streamed rows left no tiles: no region for nothing */
        PAR_FOR(N * K * B >= PAR_MIN_MACS && team_threads() > 1, schedule(static),
                for (int64_t t = first / 16; t < tiles; t += TILE_COLS)
                    NAME(tile_column)(W, ldw, X, ldx, XP, ldp, Y, ldy, K, KH, NT, tiles, B,
                                          t););
    if (N16 < N) NAME(tail_outputs)(W, ldw, X, ldx, Y, ldy, K, KH, B, N16, N);
}

static void NAME(matmat_tw)(const WT *restrict W, int64_t ldw, const float *restrict X,
                            int64_t ldx, float *restrict Y, int64_t ldy, int64_t N, int64_t K,
                            int64_t B) {
    NAME(matmat_twp)(W, ldw, X, ldx, NULL, 0, Y, ldy, N, K, B);
}

static void NAME(matmat_t)(const WT *restrict W, const float *restrict X, int64_t ldx,
                           float *restrict Y, int64_t ldy, int64_t N, int64_t K, int64_t B) {
    NAME(matmat_tw)(W, N, X, ldx, Y, ldy, N, K, B);
}

/* Y [B, N] = X [B, K] W for the torch forms' linear layers over K-major weights
 * (kdaserve/ops/cpu_linear.py), typically a prefill's thousands of rows. matmat_t splits the
 * outputs over the threads, which leaves one thread idle on a narrow matrix; many rows are
 * split by rows instead, in blocks of whole 6-row tiles. Either way each output sums in K
 * order, so the split changes nothing in the result. XP: the rows as pairs too, or NULL. */
static void NAME(linear_rows_p)(int64_t B, int64_t N, int64_t K, const float *X, int64_t ldx,
                                const uint32_t *XP, int64_t ldp, const WT *W, int64_t ldw,
                                float *Y, int64_t ldy, int64_t nthreads) {
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
                NAME(matmat_twp)(W, ldw, X + b0 * ldx, ldx, XP ? XP + b0 * ldp : NULL, ldp,
                                 Y + b0 * ldy, ldy, N, K, b1 - b0);
        }
        return;
    }
#endif
    NAME(matmat_twp)(W, ldw, X, ldx, XP, ldp, Y, ldy, N, K, B);
}

void NAME(linear_rows)(int64_t B, int64_t N, int64_t K, const float *X, int64_t ldx,
                       const WT *W, int64_t ldw, float *Y, int64_t ldy, int64_t nthreads) {
    NAME(linear_rows_p)(B, N, K, X, ldx, NULL, 0, W, ldw, Y, ldy, nthreads);
}

#if WIDEN
/* linear_rows over bf16 rows X (the torch forms of a bf16 model): the same sums, widened
 * exactly, and as pairs for pair_tiles.h's dot products where the build has them. Returns 0,
 * or -1 when the scratch could not be had. */
int64_t NAME(linear_rows_x16)(int64_t B, int64_t N, int64_t K, const uint16_t *X, int64_t ldx,
                              const WT *W, int64_t ldw, float *Y, int64_t ldy,
                              int64_t nthreads) {
    float *XF = malloc(sizeof(float) * (size_t)(B * K > 0 ? B * K : 1));
    const int64_t ldp = (K + 1) / 2;
    uint32_t *XP = PAIR_TILES ? malloc(sizeof(uint32_t) * (size_t)(B * ldp > 0 ? B * ldp : 1))
                              : NULL;
    if (!XF || (PAIR_TILES && !XP)) {
        free(XF);
        free(XP);
        return -1;
    }
    for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < K; ++i) XF[b * K + i] = LDW(X[b * ldx + i]);
    if (XP) pairs_of(X, ldx, B, K, XP);
    NAME(linear_rows_p)(B, N, K, XF, K, XP, ldp, W, ldw, Y, ldy, nthreads);
    free(XF);
    free(XP);
    return 0;
}

/* 1 when linear_rows_x16 runs pair_tiles.h's dot products (tests: not silently off) */
int64_t NAME(pair_tiles_built)(void) { return PAIR_TILES; }
#endif
