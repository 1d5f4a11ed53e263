/* The fused MLA decode attention of mla_block.h (included there, once per weight and
 * cache type: NAME, CT, LDW8 and LDC come from it): the absorbed form, queries moved into the
 * latent space attend over each row's cached latents [Dc + R] in its pages. Each latent is
 * read once for all heads (MLA is MQA in the latent space); the softmax is online over spans
 * within a page; a row's positions split into work items over the threads (split-K), merged
 * per row. The torch split-K form (kdaserve/ops/mla.py) is the oracle. */

/* The 8-lane sums below are V8_PARTS registers each (decode_cpu.c's v8p): one v8f on x86,
 * two NEON registers on aarch64, where GCC 12 keeps a v8f in memory. A part's lanes are the
 * v8f's lanes in order, and hsum8p reduces them in hsum8's tree: the same bits either way. */

/* s[h * stride] = scale * (q[h] . lat) for H query rows q [H, LD] and one latent row lat
 * [LD]: the latent is read once for all heads (it is shared by them: MLA is MQA in the latent
 * space). On NEON: 8 registers of sums, 2 of latent, 8 of queries, 8 of products: 26 of 32. */
static inline void NAME(mla_scores)(const float *restrict q, const CT *restrict lat,
                                    int64_t H, int64_t LD, float scale, float *restrict s,
                                    int64_t stride) {
    const int64_t L8 = LD - LD % 8;
    int64_t h = 0;
    for (; h + 4 <= H; h += 4) {
        const float *q0 = q + h * LD, *q1 = q0 + LD, *q2 = q1 + LD, *q3 = q2 + LD;
        v8p a0[V8_PARTS] = {0}, a1[V8_PARTS] = {0}, a2[V8_PARTS] = {0}, a3[V8_PARTS] = {0};
        for (int64_t i = 0; i < L8; i += 8)
            for (int p = 0; p < V8_PARTS; ++p) {
                const int64_t at = i + V8_LANES * p;
                const v8p v = LDW8P(lat + at);
                a0[p] += ld8p(q0 + at) * v; a1[p] += ld8p(q1 + at) * v;
                a2[p] += ld8p(q2 + at) * v; a3[p] += ld8p(q3 + at) * v;
            }
        float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
        for (int64_t i = L8; i < LD; ++i) {
            const float v = LDC(lat[i]);
            t0 += q0[i] * v; t1 += q1[i] * v; t2 += q2[i] * v; t3 += q3[i] * v;
        }
        s[h * stride] = scale * (hsum8p(a0) + t0);
        s[(h + 1) * stride] = scale * (hsum8p(a1) + t1);
        s[(h + 2) * stride] = scale * (hsum8p(a2) + t2);
        s[(h + 3) * stride] = scale * (hsum8p(a3) + t3);
    }
    for (; h < H; ++h) {
        const float *q0 = q + h * LD;
        v8p a0[V8_PARTS] = {0};
        for (int64_t i = 0; i < L8; i += 8)
            for (int p = 0; p < V8_PARTS; ++p)
                a0[p] += ld8p(q0 + i + V8_LANES * p) * LDW8P(lat + i + V8_LANES * p);
        float t0 = 0.0f;
        for (int64_t i = L8; i < LD; ++i) t0 += q0[i] * LDC(lat[i]);
        s[h * stride] = scale * (hsum8p(a0) + t0);
    }
}

/* mla_scores for two consecutive latent rows (lat, lat + LD): each query vector is loaded
 * once for both (eight independent sums per group of four heads). On NEON that would be 16
 * registers of sums, 16 of unfused products, 4 of latents and 8 of queries, 44 of 32: there
 * it is mla_scores twice (the same sums). */
static inline void NAME(mla_scores2)(const float *restrict q, const CT *restrict lat,
                                     int64_t H, int64_t LD, float scale, float *restrict s,
                                     int64_t stride) {
    const int64_t L8 = LD - LD % 8;
    if (L8 != LD || H % 4 || V8_PARTS > 1) {
        NAME(mla_scores)(q, lat, H, LD, scale, s, stride);
        NAME(mla_scores)(q, lat + LD, H, LD, scale, s + 1, stride);
        return;
    }
    const CT *lb = lat + LD;
    for (int64_t h = 0; h < H; h += 4) {
        const float *q0 = q + h * LD, *q1 = q0 + LD, *q2 = q1 + LD, *q3 = q2 + LD;
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        for (int64_t i = 0; i < LD; i += 8) {
            const v8f v = LDW8(lat + i), w = LDW8(lb + i);
            const v8f x0 = ld8f(q0 + i), x1 = ld8f(q1 + i), x2 = ld8f(q2 + i),
                      x3 = ld8f(q3 + i);
            a0 += x0 * v; a1 += x1 * v; a2 += x2 * v; a3 += x3 * v;
            b0 += x0 * w; b1 += x1 * w; b2 += x2 * w; b3 += x3 * w;
        }
        float *sh = s + h * stride;
        sh[0] = scale * hsum8(a0); sh[stride] = scale * hsum8(a1);
        sh[2 * stride] = scale * hsum8(a2); sh[3 * stride] = scale * hsum8(a3);
        sh[1] = scale * hsum8(b0); sh[stride + 1] = scale * hsum8(b1);
        sh[2 * stride + 1] = scale * hsum8(b2); sh[3 * stride + 1] = scale * hsum8(b3);
    }
}

/* Positions per online-softmax update (and never across a page: latents stay contiguous). */
#define MLA_SPAN 32
#define MLA_AHEAD 2
/* A row's positions split into at most MLA_ROW_SPANS ranges of at least MLA_MIN_SPAN, merged
 * after: a lone decode row of a few hundred positions runs on two threads (it ran on one in
 * ranges of 2,048 positions and more), and a long row on up to 16. */
#ifndef MLA_MIN_SPAN
#define MLA_MIN_SPAN 128
#endif
#ifndef MLA_ROW_SPANS
#define MLA_ROW_SPANS 16
#endif

/* The H heads' online-softmax partials of one row over positions [t0, t1) of its pages:
 * running max m [H], sum l [H] and unnormalised context acc [H, Dc] (initialised here).
 * q [H, LD]: each head's latent query (q_nope absorbed through W_uk) then its rope part. */
static void NAME(mla_span)(const float *q, int64_t H, int64_t Dc, int64_t LD, const CT *pages,
                           int64_t bs, const int64_t *bt, int64_t t0, int64_t t1, float scale,
                           float *m, float *l, float *acc) {
    float s[H * MLA_SPAN];     /* [H, n] scores, then weights */
    const int64_t D8 = Dc - Dc % 8;
    for (int64_t h = 0; h < H; ++h) { m[h] = -INFINITY; l[h] = 0.0f; }
    for (int64_t i = 0; i < H * Dc; ++i) acc[i] = 0.0f;
    /* the first pages, which the prefetch in the loop below never asks for */
    for (int64_t pg = t0 / bs; pg <= (t1 - 1) / bs && pg < t0 / bs + MLA_AHEAD; ++pg) {
        const char *nx = (const char *)(pages + bt[pg] * bs * LD);
        for (int64_t off = 0; off < (int64_t)sizeof(CT) * bs * LD; off += 64)
            __builtin_prefetch(nx + off, 0, 0);
    }
    for (int64_t t = t0; t < t1;) {
        int64_t n = bs - t % bs;
        n = n < t1 - t ? n : t1 - t;
        n = n < MLA_SPAN ? n : MLA_SPAN;
        const CT *lat0 = pages + (bt[t / bs] * bs + t % bs) * LD;
        /* the page MLA_AHEAD pages on: its latents arrive while this span computes (the
         * hardware prefetcher does not follow the page table; 128k positions on 2 threads
         * measured 1.9-2.4 ms without, 1.65-1.70 ms with) */
        if ((t + n) % bs == 0 && t + MLA_AHEAD * bs < t1) {
            const char *nx = (const char *)(pages + bt[t / bs + MLA_AHEAD] * bs * LD);
            for (int64_t off = 0; off < (int64_t)sizeof(CT) * bs * LD; off += 64)
                __builtin_prefetch(nx + off, 0, 0);
        }
        int64_t j = 0;
        for (; j + 2 <= n; j += 2)
            NAME(mla_scores2)(q, lat0 + j * LD, H, LD, scale, s + j, MLA_SPAN);
        for (; j < n; ++j)
            NAME(mla_scores)(q, lat0 + j * LD, H, LD, scale, s + j, MLA_SPAN);
        for (int64_t h = 0; h < H; ++h) {
            float *sh = s + h * MLA_SPAN;
            float mx = m[h];
            for (int64_t j = 0; j < n; ++j) mx = sh[j] > mx ? sh[j] : mx;
            const float c = exp_approx(m[h] - mx);     /* ~0 on the first span (m = -inf) */
            for (int64_t j = 0; j < n; ++j) sh[j] = exp_approx(sh[j] - mx);
            float tot = 0.0f;
            for (int64_t j = 0; j < n; ++j) tot += sh[j];
            l[h] = l[h] * c + tot;
            m[h] = mx;
            float *ah = acc + h * Dc;
            /* this head's context over the span in registers: 32 values at a time, four
             * independent sums (one chain would wait on each add's latency) */
            int64_t i = 0;
            for (; i + 32 <= D8; i += 32) {
                v8p a[4 * V8_PARTS];          /* 32 values: four v8f, or eight NEON registers */
                for (int k = 0; k < 4 * V8_PARTS; ++k) a[k] = ld8p(ah + i + V8_LANES * k) * c;
                for (int64_t j = 0; j < n; ++j) {
                    const CT *lj = lat0 + j * LD + i;
                    const float w = sh[j];
                    for (int k = 0; k < 4 * V8_PARTS; ++k) a[k] += w * LDW8P(lj + V8_LANES * k);
                }
                for (int k = 0; k < 4 * V8_PARTS; ++k) st8p(ah + i + V8_LANES * k, a[k]);
            }
            for (; i < D8; i += 8)
                for (int p = 0; p < V8_PARTS; ++p) {
                    v8p a = ld8p(ah + i + V8_LANES * p) * c;
                    for (int64_t j = 0; j < n; ++j)
                        a += sh[j] * LDW8P(lat0 + j * LD + i + V8_LANES * p);
                    st8p(ah + i + V8_LANES * p, a);
                }
            for (int64_t i = D8; i < Dc; ++i) {
                float a = ah[i] * c;
                for (int64_t j = 0; j < n; ++j) a += sh[j] * LDC(lat0[j * LD + i]);
                ah[i] = a;
            }
        }
        t += n;
    }
}

/* What the parts of mla_attend_rows share. */
struct NAME(mla_work) {
    int64_t H, N, R, Dc, Vd, QD, LD;
    const float *q;
    const WT *kv_b;
    const CT *pages;
    int64_t bs;
    const int64_t *block_table;
    int64_t width;
    const int64_t *positions;
    float scale;
    float *o, *qf, *part;
    const int64_t *first, *per;
};

/* (row, head) bh's latent query: q_nope . W_uk[h] (W_uk rows of kv_b: h*(N+Vd) + n), then
 * its rope part */
static void NAME(mla_absorb)(const struct NAME(mla_work) *w, int64_t bh) {
    const int64_t hh = bh % w->H;
    const float *qn = w->q + bh * w->QD;
    float *dst = w->qf + bh * w->LD;
    NAME(vecmat)(qn, w->kv_b + hh * (w->N + w->Vd) * w->Dc, dst, w->N, w->Dc);
    memcpy(dst + w->Dc, qn + w->N, sizeof(float) * (size_t)w->R);
}

/* work item it: its row's span of positions, into its partial softmax state */
static void NAME(mla_item)(const struct NAME(mla_work) *w, int64_t it) {
    int64_t b = 0;
    while (w->first[b + 1] <= it) ++b;
    const int64_t H = w->H, Dc = w->Dc;
    const int64_t L = w->positions[b] + 1, t0 = (it - w->first[b]) * w->per[b];
    const int64_t t1 = t0 + w->per[b] < L ? t0 + w->per[b] : L;
    float *pm = w->part + it * H * (Dc + 2), *pl = pm + H, *pa = pl + H;
    NAME(mla_span)(w->qf + b * H * w->LD, H, Dc, w->LD, w->pages, w->bs,
                   w->block_table + b * w->width, t0, t1, w->scale, pm, pl, pa);
}

/* (row, head) bh's partial states merged, then its values: ctx . W_uv[h] */
static void NAME(mla_merge)(const struct NAME(mla_work) *w, int64_t bh) {
    const int64_t H = w->H, Dc = w->Dc, b = bh / H, hh = bh % H;
    const float *part = w->part;
    float mx = -INFINITY;
    for (int64_t it = w->first[b]; it < w->first[b + 1]; ++it) {
        const float mi = part[it * H * (Dc + 2) + hh];
        mx = mi > mx ? mi : mx;
    }
    float ctx[Dc], tot = 0.0f;
    for (int64_t i = 0; i < Dc; ++i) ctx[i] = 0.0f;
    for (int64_t it = w->first[b]; it < w->first[b + 1]; ++it) {
        const float *pm = part + it * H * (Dc + 2), *pl = pm + H, *pa = pl + H;
        const float c = exp_approx(pm[hh] - mx);
        tot += c * pl[hh];
        for (int64_t i = 0; i < Dc; ++i) ctx[i] += c * pa[hh * Dc + i];
    }
    const float inv = 1.0f / tot;
    for (int64_t i = 0; i < Dc; ++i) ctx[i] *= inv;
    NAME(matvec)(w->kv_b + (hh * (w->N + w->Vd) + w->N) * Dc, ctx, w->o + bh * w->Vd, w->Vd, Dc);
}

/* Absorbed attention of B decode rows (q [B, H, N+R] as projected) over their cached latents,
 * into o [B, H, Vd]. Each latent is read once for all heads; a row's positions are split into
 * spans of work (split-K) that run in parallel with partial softmax states, merged per row. */
static void NAME(mla_attend_rows)(int64_t B, int64_t H, int64_t N, int64_t R, int64_t Dc,
                                  int64_t Vd, const float *q, const WT *kv_b, const CT *pages,
                                  int64_t bs, const int64_t *block_table, int64_t width,
                                  const int64_t *positions, float scale, float *o) {
    const int64_t QD = N + R, LD = Dc + R;
    /* work items: (row, position range); a row's ranges follow from its length alone, so its
     * sums do not depend on the thread count (the served engine moves it with the free cores,
     * docs/design.md) nor on its batch mates */
    int64_t first[B + 1], per[B];
    first[0] = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t L = positions[b] + 1;
        int64_t span = (L + MLA_ROW_SPANS - 1) / MLA_ROW_SPANS;
        span = span < MLA_MIN_SPAN ? MLA_MIN_SPAN : span;
        per[b] = span;
        first[b + 1] = first[b] + (L + span - 1) / span;
    }
    const int64_t items = first[B];
    float *qf = malloc(sizeof(float) * (size_t)(B * H * LD));
    float *part = malloc(sizeof(float) * (size_t)(items * H * (Dc + 2)));
    const struct NAME(mla_work) w = {H, N, R, Dc, Vd, QD, LD, q, kv_b, pages, bs, block_table,
                                     width, positions, scale, o, qf, part, first, per};
    /* the heads' absorbed queries, the spans, then each (row, head)'s merge: one region, so
     * that a lone row's heads read kv_b on every thread, not on the caller's alone */
    if (team_threads() > 1 && (B * H > 1 || items > 1)) {
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * H; ++bh) NAME(mla_absorb)(&w, bh);
#pragma omp for schedule(dynamic)
            for (int64_t it = 0; it < items; ++it) NAME(mla_item)(&w, it);
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * H; ++bh) NAME(mla_merge)(&w, bh);
        }
    } else {
        for (int64_t bh = 0; bh < B * H; ++bh) NAME(mla_absorb)(&w, bh);
        for (int64_t it = 0; it < items; ++it) NAME(mla_item)(&w, it);
        for (int64_t bh = 0; bh < B * H; ++bh) NAME(mla_merge)(&w, bh);
    }
    free(part);
    free(qf);
}
