/* The fused MLA decode attention of mla_block.h (included there, once per weight and
 * cache type: NAME, CT, LDW8 and LDC come from it): the absorbed form, queries moved into the
 * latent space attend over each row's cached latents [Dc + R] in its pages. Each latent is
 * read once for all heads (MLA is MQA in the latent space); the softmax is online over spans
 * within a page; a row's positions split into work items over the threads (split-K), merged
 * per row. The torch split-K form (kdaserve/ops/mla.py) is the oracle. */

/* The 8-lane sums below are V8_PARTS registers each (decode_cpu.c's v8p): one v8f on x86,
 * two NEON registers on aarch64, where GCC 12 keeps a v8f in memory. A part's lanes are the
 * v8f's lanes in order, and hsum8p reduces them in hsum8's tree: the same bits either way. */

/* A span's scores for a few heads (fewer than 8), each a dot product on its own:
 * s[h * stride] = scale * (q[h] . lat) for H query rows q [H, LD] and one latent row lat
 * [LD]: the latent is read once for all heads (it is shared by them: MLA is MQA in the latent
 * space). On NEON: 8 registers of sums, 2 of latent, 8 of queries, 8 of products: 26 of 32. */
static inline void NAME(mla_dots)(const float *restrict q, const CT *restrict lat,
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

/* mla_dots for two consecutive latent rows (lat, lat + LD), the second's scores `next` on:
 * each query vector is loaded once for both (eight independent sums per group of four
 * heads). On NEON that would be 16 registers of sums, 16 of unfused products, 4 of latents
 * and 8 of queries, 44 of 32: there it is mla_dots twice (the same sums). */
static inline void NAME(mla_dots2)(const float *restrict q, const CT *restrict lat,
                                   int64_t H, int64_t LD, float scale, float *restrict s,
                                   int64_t stride, int64_t next) {
    const int64_t L8 = LD - LD % 8;
    if (L8 != LD || H % 4 || V8_PARTS > 1) {
        NAME(mla_dots)(q, lat, H, LD, scale, s, stride);
        NAME(mla_dots)(q, lat + LD, H, LD, scale, s + next, stride);
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
        sh[next] = scale * hsum8(b0); sh[stride + next] = scale * hsum8(b1);
        sh[2 * stride + next] = scale * hsum8(b2); sh[3 * stride + next] = scale * hsum8(b3);
    }
}

/* A span's scores with the heads as the lanes: s[j * HP + h] = scale * (q[h] . lat_j) for
 * latent rows lat_j = lat + j * LD, j < n, from the queries transposed, qt [LD, HP] (HP = H
 * rounded up to 16, the padding zero). Each head's sum runs over the latent's columns in
 * order, one fused multiply-add a column (vfmas; no horizontal sums, whose shuffles cost as
 * much as the products did); four positions a pass share each column's query load, and each
 * latent value multiplies 16 heads at once (VREGS16 registers of VREG_LANES lanes). Lane for
 * lane the same operations on every ISA. With fewer than 8 heads most lanes would be
 * padding, and each head's own dot product (mla_dots: eight partial sums and a tree) ran
 * 1.5x faster for the demos' 4 heads. */
static inline void NAME(mla_scores16)(const float *restrict qt, const CT *restrict lat,
                                      int64_t n, int64_t HP, int64_t LD, float scale,
                                      float *restrict s) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const CT *l0 = lat + j * LD, *l1 = l0 + LD, *l2 = l1 + LD, *l3 = l2 + LD;
        for (int64_t h = 0; h < HP; h += 16) {
            vregf a0[VREGS16] = {0}, a1[VREGS16] = {0}, a2[VREGS16] = {0}, a3[VREGS16] = {0};
            for (int64_t i = 0; i < LD; ++i) {
                const float *qi = qt + i * HP + h;
                const float b0 = LDC(l0[i]), b1 = LDC(l1[i]), b2 = LDC(l2[i]), b3 = LDC(l3[i]);
                for (int r = 0; r < VREGS16; ++r) {
                    const vregf qv = ldvf(qi + VREG_LANES * r);
                    a0[r] = vfmas(a0[r], qv, b0); a1[r] = vfmas(a1[r], qv, b1);
                    a2[r] = vfmas(a2[r], qv, b2); a3[r] = vfmas(a3[r], qv, b3);
                }
            }
            for (int r = 0; r < VREGS16; ++r) {
                float *sj = s + j * HP + h + VREG_LANES * r;
                stvf(sj, a0[r] * scale); stvf(sj + HP, a1[r] * scale);
                stvf(sj + 2 * HP, a2[r] * scale); stvf(sj + 3 * HP, a3[r] * scale);
            }
        }
    }
    for (; j < n; ++j) {
        const CT *l0 = lat + j * LD;
        for (int64_t h = 0; h < HP; h += 16) {
            vregf a0[VREGS16] = {0};
            for (int64_t i = 0; i < LD; ++i)
                for (int r = 0; r < VREGS16; ++r)
                    a0[r] = vfmas(a0[r], ldvf(qt + i * HP + h + VREG_LANES * r), LDC(l0[i]));
            for (int r = 0; r < VREGS16; ++r)
                stvf(s + j * HP + h + VREG_LANES * r, a0[r] * scale);
        }
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

/* the larger of a score and a running max, as every max here takes it (a NaN score is
 * passed over) */
static inline float NAME(mla_max)(float x, float m) { return x > m ? x : m; }

/* The H heads' online-softmax partials of one row over positions [t0, t1) of its pages:
 * running max m [H], sum l [H] and unnormalised context acc [H, Dc] (initialised here).
 * q [H, LD]: each head's latent query (q_nope absorbed through W_uk) then its rope part. */
static void NAME(mla_span)(const float *q, int64_t H, int64_t Dc, int64_t LD, const CT *pages,
                           int64_t bs, const int64_t *bt, int64_t t0, int64_t t1, float scale,
                           float *m, float *l, float *acc) {
    /* heads as lanes (mla_scores16), s [n, HP]; or each head's dots (mla_dots), s [H, span] */
    const int lanes = H >= 8;
    const int64_t HP = lanes ? (H + 15) / 16 * 16 : H;
    const int64_t hs = lanes ? 1 : MLA_SPAN, js = lanes ? HP : 1;    /* a head's, a position's */
    float s[MLA_SPAN * HP];    /* scores, then weights */
    float mx[H], c[H], tot[H];
    float *qt = lanes ? malloc(sizeof(float) * (size_t)(LD * HP)) : NULL;  /* q^T [LD, HP] */
    if (lanes && !qt) abort();
    for (int64_t i = 0; lanes && i < LD; ++i)
        for (int64_t h = 0; h < HP; ++h) qt[i * HP + h] = h < H ? q[h * LD + i] : 0.0f;
    const int64_t D16 = Dc - Dc % 16;
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
        if (lanes) {
            NAME(mla_scores16)(qt, lat0, n, HP, LD, scale, s);
        } else {
            int64_t j = 0;
            for (; j + 2 <= n; j += 2)
                NAME(mla_dots2)(q, lat0 + j * LD, H, LD, scale, s + j, MLA_SPAN, 1);
            for (; j < n; ++j) NAME(mla_dots)(q, lat0 + j * LD, H, LD, scale, s + j, MLA_SPAN);
        }
        /* each head's softmax step over the span, position after position; the inner loops
         * run over the contiguous index (heads, or a head's positions): they vectorise */
        for (int64_t h = 0; h < H; ++h) { mx[h] = m[h]; tot[h] = 0.0f; }
        if (lanes) {
            for (int64_t j = 0; j < n; ++j)
                for (int64_t h = 0; h < H; ++h) mx[h] = NAME(mla_max)(s[j * js + h], mx[h]);
        } else {
            for (int64_t h = 0; h < H; ++h)
                for (int64_t j = 0; j < n; ++j) mx[h] = NAME(mla_max)(s[h * hs + j], mx[h]);
        }
        for (int64_t h = 0; h < H; ++h) c[h] = exp_approx(m[h] - mx[h]);  /* ~0 at first */
        if (lanes) {
            for (int64_t j = 0; j < n; ++j)
                for (int64_t h = 0; h < H; ++h) s[j * js + h] = exp_approx(s[j * js + h] - mx[h]);
            for (int64_t j = 0; j < n; ++j)
                for (int64_t h = 0; h < H; ++h) tot[h] += s[j * js + h];
        } else {
            for (int64_t h = 0; h < H; ++h) {
                for (int64_t j = 0; j < n; ++j) s[h * hs + j] = exp_approx(s[h * hs + j] - mx[h]);
                for (int64_t j = 0; j < n; ++j) tot[h] += s[h * hs + j];
            }
        }
        for (int64_t h = 0; h < H; ++h) {
            l[h] = l[h] * c[h] + tot[h];
            m[h] = mx[h];
            float *ah = acc + h * Dc;
            /* this head's context over the span in registers, 64 values at a time (four
             * independent sums: one chain would wait on each add's latency), then 16 */
            int64_t i = 0;
            for (; i + 64 <= D16; i += 64) {
                vregf a[4 * VREGS16];
                for (int k = 0; k < 4 * VREGS16; ++k) a[k] = ldvf(ah + i + VREG_LANES * k) * c[h];
                for (int64_t j = 0; j < n; ++j) {
                    const CT *lj = lat0 + j * LD + i;
                    const float w = s[j * js + h * hs];
                    for (int k = 0; k < 4 * VREGS16; ++k)
                        a[k] = vfmas(a[k], LDWV(lj + VREG_LANES * k), w);
                }
                for (int k = 0; k < 4 * VREGS16; ++k) stvf(ah + i + VREG_LANES * k, a[k]);
            }
            for (; i < D16; i += 16)
                for (int k = 0; k < VREGS16; ++k) {
                    vregf a = ldvf(ah + i + VREG_LANES * k) * c[h];
                    for (int64_t j = 0; j < n; ++j)
                        a = vfmas(a, LDWV(lat0 + j * LD + i + VREG_LANES * k), s[j * js + h * hs]);
                    stvf(ah + i + VREG_LANES * k, a);
                }
            for (; i < Dc; ++i) {
                float a = ah[i] * c[h];
                for (int64_t j = 0; j < n; ++j)
                    a = vfmas1(a, LDC(lat0[j * LD + i]), s[j * js + h * hs]);
                ah[i] = a;
            }
        }
        t += n;
    }
    free(qt);
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
    for (int64_t it = w->first[b]; it < w->first[b + 1]; ++it)
        mx = NAME(mla_max)(part[it * H * (Dc + 2) + hh], mx);
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
