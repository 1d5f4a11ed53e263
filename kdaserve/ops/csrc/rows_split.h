/* Products of a few rows (up to MOE_SPLIT_ROWS) shared by all the threads, for the fused
 * decode blocks (decode_blocks.h includes this file once per weight type): a product is a
 * struct mprod, each thread runs its part (mprod_part) and, after a barrier, makes its share of
 * the outputs whole (mprod_finish), so that several products can share one parallel region
 * (moe_rows.h) or one runs alone (proj_t).
 * Used by the bf16 copy (the fp32 copy keeps row_products.h's matmat_t; the packed INT copy
 * its q_matmat and the MoE's item loop, where a split measured no faster: docs/benchmarks.md,
 * tenth session). K-major weights: the halves of K where
 * ksplit.h splits the sums (each thread one contiguous half of the matrix; the second half's
 * sums land in T, added after the barrier), else ranges of the outputs, or the whole product
 * on one thread (massign); the sums are matmat_t's (row_products.h), so the same bits.
 * A row's result is therefore the same whatever the batch and the thread count. */

#ifndef MOE_SPLIT_ROWS
#define MOE_SPLIT_ROWS 4            /* rows up to which the products split (outer_rows_stream's) */
#endif

/* One product Y [B, N] = X [B, K] . W, as matmat_t takes W; T [B, N16]: the sums over the
 * second half of K (ksplit.h) when KH < K. */
struct NAME(mprod) {
    const WT *W;
    const float *X;
    int64_t ldx;
    float *Y;
    int64_t ldy;
    float *T;
    int64_t N, K, B, KH;
    int64_t owner;                   /* the thread that runs it whole, or -1: split */
};

static struct NAME(mprod) NAME(mprod_make)(const WT *W, const float *X, int64_t ldx, float *Y,
                                           int64_t ldy, int64_t N, int64_t K, int64_t B,
                                           float **pool) {
    const int64_t KH = k_split_at(N, K, (int64_t)sizeof(WT));
    struct NAME(mprod) p = {W, X, ldx, Y, ldy, NULL, N, K, B, KH, -1};
    if (KH < K) {
        p.T = *pool;
        *pool += B * (N - N % 16);
    }
    return p;
}

/* [*lo, *hi): part t of nt of [0, n), in whole units of `unit` */
static inline void NAME(mshare)(int64_t n, int64_t unit, int64_t t, int64_t nt, int64_t *lo,
                                int64_t *hi) {
    const int64_t units = (n + unit - 1) / unit;
    *lo = unit * (units * t / nt);
    *hi = unit * (units * (t + 1) / nt);
    *lo = *lo < n ? *lo : n;
    *hi = *hi < n ? *hi : n;
}

#define MOE_STREAM_SUMS 8192
/* The weights of a later pass asked for while a pass runs, in address order: a pass reads
 * four rows at once, four streams a row apart, and this machine served them at ~22 GB/s
 * however far ahead each stream was prefetched, against ~28-30 GB/s when the same lines were
 * asked for one after another, a line a step per row (the passes' rows are consecutive, so a
 * whole-width product is one run: docs/benchmarks.md, thirteenth session). The cursor walks
 * the rows [a, a + len) of the pass MSTREAM_AHEAD_BYTES on, row by row, four lines a step: a
 * pass has four rows of steps, so it covers that pass exactly. */
#ifndef MSTREAM_AHEAD_BYTES
#define MSTREAM_AHEAD_BYTES 8192
#endif
/* where the pass ahead goes: L2 (2). Into L1 (3), a wide pass (KDA's 3,216-output input
 * projection: 26 KB of weights a pass, the LM head's 32 KB) pushed out the pass being read and
 * its sums, and the 8 KB passes of the experts ran no faster either: the memory-bound model's
 * lone-row decode step, 6 alternating pairs on Zen 4, 1.11x tok/s (median; 5 of 6 faster),
 * the input projection 3.9-4.0x the 2 MiB output projection's time before, 2.6-3.3x after
 * (3.1x its bytes) */
#ifndef MSTREAM_HINT
#define MSTREAM_HINT 2
#endif
#define MSTREAM_LINE ((int64_t)(64 / sizeof(WT)))
/* the cursor (outer_tiles.h's tcursor, into L2: MSTREAM_HINT) over the pass `ahead` rows on,
 * for a pass of len outputs: four lines a step, so that a pass's steps cover the pass ahead
 * exactly */
static inline struct NAME(tcursor) NAME(mcursor_pass)(const WT *w, int64_t N, int64_t len,
                                                      int64_t ahead) {
    struct NAME(tcursor) c = {(const char *)(w + ahead * N), 0, (int64_t)sizeof(WT) * len,
                              (int64_t)sizeof(WT) * N, INT64_MAX};
    return c;
}
/* outer_rows_stream's sums over rows [k0, k1) of W for outputs [n0, n1) (16-multiples) of R
 * <= MOE_SPLIT_ROWS rows: each output adds x[i] w[i, n] in i order, y = y + x w, the same
 * bits; four weight rows go through the running sums per pass instead of one, so that the
 * sums' loads and stores (L1) do not cap the weights' rate (a bf16 [1024 x 2048] half, hot:
 * 22 GB/s one row a pass, 32 four). */
static void NAME(mstream)(const WT *restrict W, const float *restrict X, int64_t ldx,
                          float *restrict Y, int64_t ldy, int64_t N, int64_t k0, int64_t k1,
                          int64_t n0, int64_t n1, int64_t R) {
    /* the sums of up to MOE_STREAM_SUMS / R outputs at a time (a 16-multiple): one pass for
     * a lone row's wide products (KDA's 3216 inputs, the LM head), whose runs of every row
     * split into chunks read at a third of the rate of one pass (bf16, cold) */
    float buf[MOE_STREAM_SUMS];
    const int64_t CH = MOE_STREAM_SUMS / R / 16 * 16;
    float *acc[MOE_SPLIT_ROWS];
    for (int64_t r = 0; r < R; ++r) acc[r] = buf + r * CH;
    for (int64_t a = n0; a < n1; a += CH) {
        const int64_t len = n1 - a < CH ? n1 - a : CH;
        for (int64_t r = 0; r < R; ++r) memset(acc[r], 0, sizeof(float) * (size_t)len);
        int64_t i = k0;
        /* rows from the pass read to the pass asked for */
        const int64_t pass = 4 * len * (int64_t)sizeof(WT);
        const int64_t ahead = 4 * ((MSTREAM_AHEAD_BYTES + pass - 1) / pass);
        for (; i + 4 <= k1; i += 4) {
            const WT *w = W + i * N + a;
            struct NAME(tcursor) pf = NAME(mcursor_pass)(w, N, len, ahead);
            if (R == 1) {
                const float x0 = X[i], x1 = X[i + 1], x2 = X[i + 2], x3 = X[i + 3];
                for (int64_t j0 = 0; j0 < len; j0 += MSTREAM_LINE) {
                    NAME(tcursor_step)(&pf, 4, MSTREAM_HINT);
                    const int64_t j1 = j0 + MSTREAM_LINE < len ? j0 + MSTREAM_LINE : len;
                    for (int64_t j = j0; j < j1; j += ROW_LANES) {
                        ROW_T s = LDACC(acc[0] + j);
                        s = vfmas(s, LDROW(w + j), x0);
                        s = vfmas(s, LDROW(w + N + j), x1);
                        s = vfmas(s, LDROW(w + 2 * N + j), x2);
                        s = vfmas(s, LDROW(w + 3 * N + j), x3);
                        STROW(acc[0] + j, s);
                    }
                }
                continue;
            }
            for (int64_t j = 0; j < len; j += ROW_LANES) {
                if (j % MSTREAM_LINE == 0) NAME(tcursor_step)(&pf, 4, MSTREAM_HINT);
                const ROW_T w0 = LDROW(w + j), w1 = LDROW(w + N + j), w2 = LDROW(w + 2 * N + j),
                            w3 = LDROW(w + 3 * N + j);
                for (int64_t r = 0; r < R; ++r) {
                    const float *x = X + r * ldx + i;
                    ROW_T s = LDACC(acc[r] + j);
                    s = vfmas(s, w0, x[0]);
                    s = vfmas(s, w1, x[1]);
                    s = vfmas(s, w2, x[2]);
                    s = vfmas(s, w3, x[3]);
                    STROW(acc[r] + j, s);
                }
            }
        }
        for (; i < k1; ++i) {
            const WT *w = W + i * N + a;
            for (int64_t j = 0; j < len; j += ROW_LANES) {
                const ROW_T wv = LDROW(w + j);
                for (int64_t r = 0; r < R; ++r)
                    STROW(acc[r] + j, vfmas(LDACC(acc[r] + j), wv, X[r * ldx + i]));
            }
        }
        for (int64_t r = 0; r < R; ++r)
            memcpy(Y + r * ldy + a, acc[r], sizeof(float) * (size_t)len);
    }
}

/* thread t of nt's part of the product's sums */
static void NAME(mprod_part)(const struct NAME(mprod) *p, int64_t t, int64_t nt) {
    const int64_t N16 = p->N - p->N % 16, units = N16 / 16;
    if (!units) return;                          /* all in the tail: mprod_finish */
    if (p->owner >= 0) {
        if (p->owner % nt == t)
            NAME(mstream)(p->W, p->X, p->ldx, p->Y, p->ldy, p->N, 0, p->K, 0, N16, p->B);
        return;
    }
    /* split sums: (half, output range) parts, halves on alternate threads (matmat_t's) */
    const int64_t halves = p->KH < p->K ? 2 : 1;
    int64_t ranges = nt / halves > 0 ? nt / halves : 1;
    if (ranges > units) ranges = units;
    for (int64_t part = t; part < halves * ranges; part += nt) {
        const int64_t h = part % halves, q = part / halves;
        const int64_t n0 = 16 * (units * q / ranges), n1 = 16 * (units * (q + 1) / ranges);
        if (h == 0)
            NAME(mstream)(p->W, p->X, p->ldx, p->Y, p->ldy, p->N, 0, p->KH, n0, n1, p->B);
        else
            NAME(mstream)(p->W, p->X, p->ldx, p->T, N16, p->N, p->KH, p->K, n0, n1, p->B);
    }
}

/* Who runs the products of a phase: split where ksplit.h splits the sums (each thread one
 * contiguous half) and for packed rows (contiguous ranges of rows); an unsplit K-major product
 * split by outputs would have each thread read runs of every row, a row apart, which this
 * machine served at half the rate (ksplit.h), so it runs whole on the thread with the fewest
 * bytes so far (8 routed w2 of a bf16 lone row: 4 a thread). */
static void NAME(massign)(struct NAME(mprod) **list, int64_t n, int64_t nt) {
    int64_t load[nt];
    for (int64_t t = 0; t < nt; ++t) load[t] = 0;
    for (int64_t i = 0; i < n; ++i) {
        struct NAME(mprod) *p = list[i];
        const int64_t bytes = p->N * p->K * (int64_t)sizeof(WT);
        const int whole = p->KH == p->K && nt > 1;
        if (!whole) {
            for (int64_t t = 0; t < nt; ++t) load[t] += bytes / nt;
            continue;
        }
        int64_t best = 0;
        for (int64_t t = 1; t < nt; ++t)
            if (load[t] < load[best]) best = t;
        p->owner = best;
        load[best] += bytes;
    }
}

/* The first bytes of thread t's part asked for ahead of it, while the part before runs: a
 * part starts cold (the hardware prefetcher needs a few misses to find the stream), and an
 * expert's parts are short, tens of them per token. */
#ifndef MOE_WARM_BYTES
#define MOE_WARM_BYTES 4096
#endif
static void NAME(mprod_warm)(const struct NAME(mprod) *p, int64_t t, int64_t nt) {
    const char *at;
    int64_t len = MOE_WARM_BYTES;
    const int64_t halves = p->KH < p->K ? 2 : 1;
    if (p->owner >= 0 && p->owner % nt != t) return;
    if (p->owner >= 0)
        at = (const char *)p->W;
    else if (nt / halves > 1 || t >= halves)
        return;                      /* parts of rows: short runs, a row apart */
    else
        at = (const char *)(p->W + (t ? p->KH : 0) * p->N);  /* the thread's whole half */
    const int64_t rows = p->owner >= 0 ? p->K : t ? p->K - p->KH : p->KH;
    const int64_t part = (int64_t)sizeof(WT) * p->N * rows;
    len = len < part ? len : part;
    for (int64_t off = 0; off < len; off += 64) __builtin_prefetch(at + off, 0, 2);
}

/* outputs [lo, hi) of the product made whole, after every part: Y += T, and the N % 16 tail
 * (matmat_t's sums, through its tail_outputs) */
static void NAME(mprod_finish)(const struct NAME(mprod) *p, int64_t lo, int64_t hi) {
    const int64_t N16 = p->N - p->N % 16;
    if (p->T)
        for (int64_t b = 0; b < p->B; ++b) {
            float *y = p->Y + b * p->ldy;
            const float *tb = p->T + b * N16;
            for (int64_t n = lo; n < (hi < N16 ? hi : N16); ++n) y[n] += tb[n];
        }
    const int64_t t0 = lo > N16 ? lo : N16;
    if (t0 < hi)
        NAME(tail_outputs)(p->W, p->N, p->X, p->ldx, p->Y, p->ldy, p->K, p->KH, p->B, t0, hi);
}


/* A dense projection of the blocks, Y [B, N] = X W (W as matmat_t takes it). bf16 weights
 * and a few rows: mprod's parts in one parallel region, whose stream (mstream) reads a lone
 * row's bf16 weights at up to twice matmat_t's rate out of cache (docs/benchmarks.md, tenth
 * session); otherwise matmat_t (the fp32 products are row_products.h's alone). */
static void NAME(proj_t)(const WT *W, const float *X, int64_t ldx, float *Y, int64_t ldy,
                         int64_t N, int64_t K, int64_t B) {
#if !WIDEN
    NAME(matmat_t)(W, X, ldx, Y, ldy, N, K, B);
#else
    if (B > MOE_SPLIT_ROWS) {
        NAME(matmat_t)(W, X, ldx, Y, ldy, N, K, B);
        return;
    }
    int64_t nt = 1;
#ifdef _OPENMP
    nt = omp_in_parallel() ? 1 : omp_get_max_threads();
#endif
    float *pool = malloc(sizeof(float) * (size_t)(B * N + 1)), *at = pool;
    if (!pool) abort();
    const struct NAME(mprod) p = NAME(mprod_make)(W, X, ldx, Y, ldy, N, K, B, &at);
    if (nt > 1 && N * K * B >= PAR_MIN_MACS) {
#pragma omp parallel num_threads((int)nt)
        {
            int64_t t = 0, tn = 1, lo, hi;
#ifdef _OPENMP
            t = omp_get_thread_num();
            tn = omp_get_num_threads();
#endif
            NAME(mprod_part)(&p, t, tn);
#pragma omp barrier
            NAME(mshare)(N, 16, t, tn, &lo, &hi);
            NAME(mprod_finish)(&p, lo, hi);
        }
    } else {                         /* one thread: no region (threads.h) */
        int64_t lo, hi;
        NAME(mprod_part)(&p, 0, 1);
        NAME(mshare)(N, 16, 0, 1, &lo, &hi);
        NAME(mprod_finish)(&p, lo, hi);
    }
    free(pool);
#endif
}
