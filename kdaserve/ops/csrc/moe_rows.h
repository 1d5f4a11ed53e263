/* The experts of a few rows' MoE block (moe_block.h moe_decode_block, included there once
 * per weight type), every product shared by all the threads (rows_split.h).
 *
 * Many rows run one expert per thread (the block's item loop): each expert's bytes are read
 * once for all its rows, and the items fill the threads. For a few rows every product is
 * split over the threads instead, all in one parallel region: the first products of every
 * expert (gate and up), a barrier, the activations, a barrier, the down products, a barrier,
 * the outputs. Each thread streams its part of every expert, as the dense products do, and
 * no thread waits alone on a last expert. A row's result is the one the item loop gives it
 * (the same sums), whatever the batch and the thread count. */

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
 * (K-major) expert stacks only. */
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
    {
        struct NAME(mprod) *list[2 * (E + 1)];
        int64_t n = 0;
        for (int64_t i = 0; i < ni; ++i)
            for (int64_t j = 0; j < items[i].nup; ++j) list[n++] = &items[i].up[j];
        NAME(massign)(list, n, nt);
        n = 0;
        for (int64_t i = 0; i < ni; ++i) list[n++] = &items[i].down;
        NAME(massign)(list, n, nt);
    }
#pragma omp parallel num_threads((int)nt) if (nt > 1)
    {
        int64_t t = 0, tn = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        tn = omp_get_num_threads();
#endif
        for (int64_t i = 0; i < ni; ++i)
            for (int64_t j = 0; j < items[i].nup; ++j) {
                /* the next part on its way (the first down product after the last) */
                if (j + 1 < items[i].nup) NAME(mprod_warm)(&items[i].up[j + 1], t, tn);
                else if (i + 1 < ni) NAME(mprod_warm)(&items[i + 1].up[0], t, tn);
                else NAME(mprod_warm)(&items[0].down, t, tn);
                NAME(mprod_part)(&items[i].up[j], t, tn);
            }
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
        for (int64_t i = 0; i < ni; ++i) {
            if (i + 1 < ni) NAME(mprod_warm)(&items[i + 1].down, t, tn);
            NAME(mprod_part)(&items[i].down, t, tn);
        }
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
    }
    free(items);
}
