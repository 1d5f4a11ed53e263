/* The register tiles of row_products.h's outer-product form (included there, once per weight
 * type: WT, LDW16, LDWV and NAME() come from the includer): the tile sizes of the target and
 * the tile that keeps its sums in registers while K runs. */

/* The register budget of the target sets the tiles of the outer products below. A 16-lane
 * sum is one register with AVX-512 (32 of them) and two with AVX2 (16 of them): the AVX-512
 * tile (6 rows x 32 outputs = 24 sums) spills on AVX2, so there a tile is 6 rows x 16 outputs
 * (12 registers of sums, 2 of weights, 1 of input): 2.0 -> 7 GFLOPS a thread at 6-256 rows
 * of a [2304 x 2304] product on an AVX2 EPYC. Up to STREAM_ROWS rows stream instead
 * (outer_rows_stream).
 * NEON (aarch64): 32 registers of 4 lanes, a 16-lane sum is four (vec16.h's VREGS16). Each
 * step is a fused multiply-add (vec16.h's vfmas), so the 6 x 16 tile holds 24 sums + 4
 * weights and fits; before vfmas each product took a register until its add and about 13 a
 * step spilled to L1. Not measured: no ARM machine here (docs/benchmarks.md).
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
 * read once per tile. Every (b, n) sums x[b, i] w[i, n] in i order, y = fma(x, w, y) where
 * the target fuses (vec16.h's vfmas; the build contracts nothing else), whatever the tile:
 * the same for any B. One running sum
 * over K rounds a little more than the dot-product form's eight lanes (K3 demo hidden states
 * within 1.5e-4 of the torch forward's, logits within its 5e-4); summing in blocks of 32-128
 * to tighten it halved the speed in a microbenchmark. At 32 rows a step runs ~1.1-1.2x faster
 * than with the dot-product form above, which must reduce its lanes. */
/* lines asked for in address order, a few a step: rows ld bytes apart, bytes [0, len) of each
 * from row, `left` lines in all (tiles_blocked.h's next block; rows_split.h's pass ahead).
 * hint: the prefetch's locality, a constant at each call (3: into L1, 2: into L2) */
struct NAME(tcursor) {
    const char *row;
    int64_t off, len, ld, left;
};
static inline __attribute__((always_inline)) void NAME(tcursor_step)(struct NAME(tcursor) *c,
                                                                     int64_t lines,
                                                                     const int hint) {
    for (; lines > 0 && c->left > 0; --lines, --c->left) {
        if (hint == 3) __builtin_prefetch(c->row + c->off, 0, 3);
        else __builtin_prefetch(c->row + c->off, 0, 2);
        c->off += 64;
        if (c->off >= c->len) c->off = 0, c->row += c->ld;
    }
}

static inline __attribute__((always_inline)) void NAME(outer_tile)(
        const WT *restrict W, const float *restrict X, int64_t ldx, float *restrict Y,
        int64_t ldy, int64_t N, int64_t k0, int64_t k1, int64_t n, int64_t b, const int R,
        const int C, const int add, struct NAME(tcursor) *pf, int64_t pf_lines) {
    const int CV = C * VREGS16;       /* registers per tile row */
    vregf acc[6][2 * VREGS16];
    /* add: 0 the sums stored, 1 y + the sums (ksplit.h's second half), 2 the running sums
     * carried on from y (tiles_blocked.h's later K blocks: stored and reloaded exactly) */
    /* bf16 weights two registers a load: acc[r][0] the tile's even outputs, [1] its odd ones
     * (decode_lanes.h's bwide_load) */
    const int pairs = BWIDE_PAIRS && WIDEN && CV == 2;
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
        if (pairs && add == 2) {
            bwide_sums(Y + (b + r) * ldy + n, &acc[r][0], &acc[r][1]);
            continue;
        }
#pragma GCC unroll 8
        for (int c = 0; c < CV; ++c)
            acc[r][c] = add == 2 ? ldvf(Y + (b + r) * ldy + n + VREG_LANES * c) : (vregf){0};
    }
    for (int64_t i = k0; i < k1; ++i) {
        if (pf) NAME(tcursor_step)(pf, pf_lines, 2);
        const WT *w = W + i * N + n;
        vregf wv[2 * VREGS16];
        if (pairs) bwide_load((const uint16_t *)(const void *)w, &wv[0], &wv[1]);
        else
#pragma GCC unroll 8
            for (int c = 0; c < CV; ++c) wv[c] = LDWV(w + VREG_LANES * c);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            const float x = X[(b + r) * ldx + i];
#pragma GCC unroll 8
            for (int c = 0; c < CV; ++c) acc[r][c] = vfmas(acc[r][c], wv[c], x);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
        if (pairs) {
            float *y = Y + (b + r) * ldy + n;
            vregf e = acc[r][0], o = acc[r][1];
            if (add == 1) {
                vregf ye, yo;
                bwide_sums(y, &ye, &yo);
                e = ye + e, o = yo + o;
            }
            bwide_store(y, e, o);
            continue;
        }
#pragma GCC unroll 8
        for (int c = 0; c < CV; ++c) {
            float *y = Y + (b + r) * ldy + n + VREG_LANES * c;
            if (add == 1) stvf(y, ldvf(y) + acc[r][c]);
            else stvf(y, acc[r][c]);
        }
    }
}

/* A tile's sums over [0, K), in two halves where ksplit.h splits them. */
static inline __attribute__((always_inline)) void NAME(outer_tile_k)(
        const WT *restrict W, const float *restrict X, int64_t ldx, float *restrict Y,
        int64_t ldy, int64_t N, int64_t K, int64_t KH, int64_t n, int64_t b, const int R,
        const int C) {
    NAME(outer_tile)(W, X, ldx, Y, ldy, N, 0, KH, n, b, R, C, 0, NULL, 0);
    if (KH < K) NAME(outer_tile)(W, X, ldx, Y, ldy, N, KH, K, n, b, R, C, 1, NULL, 0);
}
