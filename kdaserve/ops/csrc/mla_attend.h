/* The fused MLA decode attention of mla_block.h (included there, once per weight and
 * cache type: NAME, CT, LDW8 and LDC come from it): the absorbed form, queries moved into the
 * latent space attend over each row's cached latents [Dc + R] in its pages. Each latent is
 * read once for all heads (MLA is MQA in the latent space); the softmax is online over spans
 * within a page; a row's positions split into work items over the threads (split-K), merged
 * per row. The torch split-K form (kdaserve/ops/mla.py) is the oracle. */

#include "mla_scores.h"

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
