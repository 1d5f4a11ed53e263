/* The tiles of a product whose weights come from memory (row_products.h's matmat_tw, included
 * there once per weight type), in blocks of K.
 *
 * A tile column reads 64- or 128-byte runs of every weight row, a row apart: with the matrix
 * out of cache that walk ran at 4-6 GB/s of weights (a bf16 [1024 x 1024] product of 8 rows,
 * 96 matrices in turn: 356 us against 146 with the matrix in cache, AVX-512 EPYC; fp32 at 8
 * rows 33 against 102 GFLOPS). So a large product runs blocks of K rows (tile_kblock) at a
 * time: every tile column of the thread's range over the block, the sums carried from block to
 * block in Y (stored and reloaded, exact), while the next block's rows are asked for in
 * address order (into L2), a few lines at each step of the block's first tiles. Each output
 * still sums x[i] w[i, n] in i order from zero over each K half (ksplit.h; the second half's
 * in T, then y + t, as outer_tile_k's add): the same bits as the unblocked tiles and the
 * streamed rows. */

#ifndef KDASERVE_TILES_BLOCKED
#define KDASERVE_TILES_BLOCKED
/* rows of K a block: 64 up to 24 rows, 256 beyond, where the sums' trips through Y cost more
 * (bf16 at 32 and 64 rows: 64-row blocks 0.9x the unblocked tiles, 256-row blocks 1.1-1.3x) */
static inline int64_t tile_kblock(int64_t B) { return B <= 24 ? 64 : 256; }
/* matrices from this size on, of more than one block: the rest (the demo's, in cache) keep
 * the unblocked tiles and their prefetch of the next tile column */
#ifndef TILE_BLOCKED_BYTES
#define TILE_BLOCKED_BYTES ((int64_t)1 << 20)
#endif
#endif

/* rows b.. of tile column t (outputs 16t..) over rows [k0, k1) of W, into D (add as
 * outer_tile's: 0 from zero, 2 carried on from D), the first rows' tile asking for `lines`
 * of pf's on the way; a whole tile's width in pair tiles where XP has the rows as pairs */
static inline void NAME(tile_column_part)(const WT *restrict W, int64_t ldw,
                                          const float *restrict X, int64_t ldx,
                                          const uint32_t *XP, int64_t ldp, float *D,
                                          int64_t ldd, int64_t k0, int64_t k1, int64_t NT,
                                          int64_t B, int64_t t, int add,
                                          struct NAME(tcursor) *pf, int64_t lines) {
    const int64_t n = 16 * t, per = (lines + (k1 - k0) - 1) / (k1 - k0);
    int64_t b = 0;
#if PAIR_TILES
    if (XP && n + TILE_OUT <= NT && !((k0 | k1) & 1)) {
        NAME(pair_tiles_rows)(W, XP, ldp, D, ldd, ldw, k0, k1, n, 0, B, add, pf, per);
        return;
    }
#else
    (void)XP, (void)ldp;
#endif
#define TILE_PART(R_, C_) NAME(outer_tile)(W, X, ldx, D, ldd, ldw, k0, k1, n, b, R_, C_, add, \
                                           b ? NULL : pf, per)
    if (n + TILE_OUT <= NT) {
        for (; b + 6 <= B; b += 6) TILE_PART(6, TILE_COLS);
        switch (B - b) {
        case 5: TILE_PART(5, TILE_COLS); break;
        case 4: TILE_PART(4, TILE_COLS); break;
        case 3: TILE_PART(3, TILE_COLS); break;
        case 2: TILE_PART(2, TILE_COLS); break;
        case 1: TILE_PART(1, TILE_COLS); break;
        default: break;
        }
    } else {                          /* the last 16 outputs of a 32-wide tiling */
        for (; b < B; ++b) TILE_PART(1, 1);
    }
#undef TILE_PART
}

/* tile columns [t0, t1) (t0 a tile's start) of B rows, K blocked; T [B, ldt]: the second
 * half's sums (ksplit.h) when KH < K */
static void NAME(tiles_blocked)(const WT *restrict W, int64_t ldw, const float *restrict X,
                                int64_t ldx, const uint32_t *XP, int64_t ldp, float *Y, int64_t ldy, float *T, int64_t ldt,
                                int64_t K, int64_t KH, int64_t NT, int64_t B, int64_t t0,
                                int64_t t1) {
    const int64_t n0 = 16 * t0, n1 = 16 * t1;
    const int64_t cols = (t1 - t0 + TILE_COLS - 1) / TILE_COLS;
    /* a row's bytes of the range, from the line that holds its first (the cursor's rows) */
    const int64_t skew = (int64_t)((uintptr_t)(W + n0) & 63);
    const int64_t rowlen = (int64_t)sizeof(WT) * (n1 - n0) + skew;
    const int64_t lines_per_row = (rowlen + 63) / 64;
    const int64_t KB = tile_kblock(B);
    for (int h = 0; h < (KH < K ? 2 : 1); ++h) {
        const int64_t ks = h ? KH : 0, ke = h ? K : KH;
        float *D = h ? T : Y;
        const int64_t ldd = h ? ldt : ldy;
        for (int64_t kb = ks; kb < ke; kb += KB) {
            const int64_t kn = kb + KB < ke ? kb + KB : ke;
            const int64_t next = (kn + KB < K ? kn + KB : K) - kn;
            struct NAME(tcursor) c = {(const char *)(W + kn * ldw + n0) - skew, 0, rowlen,
                                      (int64_t)sizeof(WT) * ldw, next * lines_per_row};
            const int64_t share = (c.left + cols - 1) / cols;
            for (int64_t t = t0; t < t1; t += TILE_COLS)
                NAME(tile_column_part)(W, ldw, X, ldx, XP, ldp, D, ldd, kb, kn, NT, B, t,
                                       kb == ks ? 0 : 2, &c, share);
        }
    }
    if (KH < K)
        for (int64_t b = 0; b < B; ++b)
            for (int64_t n = n0; n < n1; ++n) Y[b * ldy + n] += T[b * ldt + n];
}
