/* The experts of a few rows' MoE block (decode_blocks.h moe_decode_block, included there once
 * per weight type), every product shared by all the threads.
 *
 * Many rows run one expert per thread (the block's item loop): each expert's bytes are read
 * once for all its rows, and the items fill the threads. A lone row's experts are too few for
 * that: top-8 and a shared expert are 9 items on 2 threads, so one thread runs the last item
 * alone, and one thread reads memory at well under the machine's rate (docs/benchmarks.md,
 * tenth session). Here every product is split over the threads instead, all in one parallel
 * region: the first products of every expert (gate and up), a barrier, the activations, a
 * barrier, the down products, a barrier, the outputs. Each thread streams its own part of
 * every expert, as the dense products do:
 * - fp32/bf16 weights (K-major): the halves of K where ksplit.h splits the sums (each thread
 *   one contiguous half of the matrix; the second half's sums land in T, added after the
 *   barrier), else ranges of the outputs; the sums are matmat_t's, so the same bits;
 * - packed INT weights (row-major): ranges of the outputs, whole; q_rows' sums, the same bits.
 * A row's result is therefore the one the item loop gives it, whatever the batch and the
 * thread count. */

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
};

static struct NAME(mprod) NAME(mprod_make)(const WT *W, const float *X, int64_t ldx, float *Y,
                                           int64_t ldy, int64_t N, int64_t K, int64_t B,
                                           float **pool) {
#ifdef QMATS
    const int64_t KH = K;
#else
    const int64_t KH = k_split_at(N, K, (int64_t)sizeof(WT));
#endif
    struct NAME(mprod) p = {W, X, ldx, Y, ldy, NULL, N, K, B, KH};
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

/* thread t of nt's part of the product's sums (wb: QB * K floats, the packed decode's) */
static void NAME(mprod_part)(const struct NAME(mprod) *p, int64_t t, int64_t nt, float *wb) {
#ifdef QMATS
    int64_t lo, hi;
    NAME(mshare)(p->N, QB, t, nt, &lo, &hi);
    if (lo < hi)
        q_rows((const qmat *)(const void *)p->W, p->X, p->ldx, p->Y, p->ldy, lo, hi, p->K,
               p->B, wb);
#else
    (void)wb;
    const int64_t N16 = p->N - p->N % 16, units = N16 / 16;
    if (!units) return;                          /* all in the tail: mprod_finish */
    /* split sums: (half, output range) parts, halves on alternate threads (matmat_t's) */
    const int64_t halves = p->KH < p->K ? 2 : 1;
    int64_t ranges = nt / halves > 0 ? nt / halves : 1;
    if (ranges > units) ranges = units;
    for (int64_t part = t; part < halves * ranges; part += nt) {
        const int64_t h = part % halves, q = part / halves;
        const int64_t n0 = 16 * (units * q / ranges), n1 = 16 * (units * (q + 1) / ranges);
        if (h == 0)
            NAME(outer_rows_stream)(p->W, p->X, p->ldx, p->Y, p->ldy, p->N, 0, p->KH, n0, n1,
                                    p->B);
        else
            NAME(outer_rows_stream)(p->W, p->X, p->ldx, p->T, N16, p->N, p->KH, p->K, n0, n1,
                                    p->B);
    }
#endif
}

/* outputs [lo, hi) of the product made whole, after every part: Y += T, and the N % 16 tail
 * (matmat_t's sums) */
static void NAME(mprod_finish)(const struct NAME(mprod) *p, int64_t lo, int64_t hi) {
#ifdef QMATS
    (void)p, (void)lo, (void)hi;
#else
    const int64_t N16 = p->N - p->N % 16, N = p->N, K = p->K, KH = p->KH;
    const WT *W = p->W;
    if (p->T)
        for (int64_t b = 0; b < p->B; ++b) {
            float *y = p->Y + b * p->ldy;
            const float *tb = p->T + b * N16;
            for (int64_t n = lo; n < (hi < N16 ? hi : N16); ++n) y[n] += tb[n];
        }
    for (int64_t n = lo > N16 ? lo : N16; n < hi; ++n)
        for (int64_t b = 0; b < p->B; ++b) {
            const float *x = p->X + b * p->ldx;
            float s = 0.0f, s2 = 0.0f;
            for (int64_t i = 0; i < KH; ++i) s += LDW(W[i * N + n]) * x[i];
            for (int64_t i = KH; i < K; ++i) s2 += LDW(W[i * N + n]) * x[i];
            p->Y[b * p->ldy + n] = KH < K ? s + s2 : s;
        }
#endif
}

/* One expert (or the shared experts) of the step: its rows (slots of the block's [S] pairs,
 * or all B rows), gate and up products (one [.., 2I] product, gate | up, or two), the
 * activation a, the down product into out. */
struct NAME(mitem) {
    int64_t n, slot[MOE_SPLIT_ROWS];
    struct NAME(mprod) up[2], down;
    int64_t nup, width;               /* products before the activation; its width */
    float *g, *u, *a;                 /* g, u rows ldg apart; a [n, width] */
    int64_t ldg;
};

/* The experts' outputs for B <= MOE_SPLIT_ROWS rows (S = B K slots, idf their expert ids, z
 * [B, Wd] the experts' input, h [B, Hd] the shared experts'): each slot's into de [S, Wd]
 * (rows the block weights and sums), the shared experts' into *shared ([B, Hd], or NULL
 * without them), all in scratch from one allocation the caller frees (*buf). Transposed
 * (K-major) expert stacks only, or descriptors (QMATS). */
static void NAME(moe_rows_split)(int64_t B, int64_t Hd, int64_t E, int64_t I, int64_t K,
                                 const float *idf, const float *z, int64_t Wd, const float *h,
                                 const WT *w13, const WT *w2, const WT *sh_gate,
                                 const WT *sh_up, const WT *sh_down, int64_t Is, int64_t act,
                                 float beta, float lbeta, float *de, const float **shared,
                                 int64_t nt, float **buf) {
    const int64_t S = B * K;
    struct NAME(mitem) *items = malloc(sizeof(struct NAME(mitem)) * (size_t)(E + 1));
    float *pool = malloc(sizeof(float) *
                         (size_t)(S * (3 * Wd + 5 * I) + B * (5 * Is + 2 * Hd) + 16));
    if (!items || !pool) abort();
    *buf = pool;
    int64_t ni = 0;
    *shared = NULL;
    if (sh_gate) {                   /* glu()'s products: gate and up, each [B, Is] */
        struct NAME(mitem) *it = &items[ni++];
        it->n = B;
        it->g = pool; pool += B * Is;
        it->u = pool; pool += B * Is;
        it->a = pool; pool += B * Is;
        float *out = pool; pool += B * Hd;
        it->nup = 2, it->width = Is, it->ldg = Is;
        it->up[0] = NAME(mprod_make)(sh_gate, h, Hd, it->g, Is, Is, Hd, B, &pool);
        it->up[1] = NAME(mprod_make)(sh_up, h, Hd, it->u, Is, Is, Hd, B, &pool);
        it->down = NAME(mprod_make)(sh_down, it->a, Is, out, Hd, Hd, Is, B, &pool);
        *shared = out;
    }
    for (int64_t e = 0; e < E; ++e) {
        struct NAME(mitem) *it = &items[ni];
        it->n = 0;
        for (int64_t s = 0; s < S; ++s)
            if ((int64_t)idf[s] == e) it->slot[it->n++] = s;
        if (!it->n) continue;
        ++ni;
        const int64_t n = it->n;
        float *xe = pool; pool += n * Wd;
        for (int64_t r = 0; r < n; ++r)
            memcpy(xe + r * Wd, z + (it->slot[r] / K) * Wd, sizeof(float) * (size_t)Wd);
        float *gu = pool; pool += n * 2 * I;
        it->g = gu, it->u = gu + I, it->ldg = 2 * I;
        it->a = pool; pool += n * I;
        float *out = pool; pool += n * Wd;
        it->nup = 1, it->width = I;
        it->up[0] = NAME(mprod_make)(W_AT(w13, e, Wd, 2 * I), xe, Wd, gu, 2 * I, 2 * I, Wd, n,
                                     &pool);
        it->down = NAME(mprod_make)(W_AT(w2, e, I, Wd), it->a, I, out, Wd, Wd, I, n, &pool);
    }
    const int64_t Kmax = Wd > I ? (Wd > Hd ? Wd : Hd) : (I > Hd ? I : Hd);
    const int64_t Km = Kmax > Is ? Kmax : Is;
    (void)Km;
#pragma omp parallel num_threads((int)nt) if (nt > 1)
    {
        int64_t t = 0, tn = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        tn = omp_get_num_threads();
#endif
        float *wb = NULL;
#ifdef QMATS
        wb = malloc(sizeof(float) * QB * (size_t)Km);
        if (!wb) abort();
#endif
        for (int64_t i = 0; i < ni; ++i)
            for (int64_t j = 0; j < items[i].nup; ++j) NAME(mprod_part)(&items[i].up[j], t, tn, wb);
#pragma omp barrier
        for (int64_t i = 0; i < ni; ++i) {
            const struct NAME(mitem) *it = &items[i];
            int64_t lo, hi;
            NAME(mshare)(it->width, 16, t, tn, &lo, &hi);
            if (lo >= hi) continue;
            if (it->nup == 2) {
                NAME(mprod_finish)(&it->up[0], lo, hi);
                NAME(mprod_finish)(&it->up[1], lo, hi);
            } else {                 /* gate | up in one product */
                NAME(mprod_finish)(&it->up[0], lo, hi);
                NAME(mprod_finish)(&it->up[0], it->width + lo, it->width + hi);
            }
            for (int64_t r = 0; r < it->n; ++r)
                glu_span(act, beta, lbeta, it->g + r * it->ldg + lo, it->u + r * it->ldg + lo,
                         it->a + r * it->width + lo, hi - lo);
        }
#pragma omp barrier
        for (int64_t i = 0; i < ni; ++i) NAME(mprod_part)(&items[i].down, t, tn, wb);
#pragma omp barrier
        for (int64_t i = 0; i < ni; ++i) {
            const struct NAME(mitem) *it = &items[i];
            int64_t lo, hi;
            NAME(mshare)(it->down.N, 16, t, tn, &lo, &hi);
            if (lo >= hi) continue;
            NAME(mprod_finish)(&it->down, lo, hi);
            if (sh_gate && i == 0) continue;             /* the shared experts' stay put */
            for (int64_t r = 0; r < it->n; ++r)
                memcpy(de + it->slot[r] * Wd + lo, it->down.Y + r * Wd + lo,
                       sizeof(float) * (size_t)(hi - lo));
        }
        free(wb);
    }
    free(items);
}
