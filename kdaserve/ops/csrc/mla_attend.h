/* The fused MLA decode attention of mla_block.h (included there, once per weight and
 * cache type: NAME, CT, LDW8 and LDC come from it): the absorbed form, queries moved into the
 * latent space attend over each row's cached latents [Dc + R] in its pages. Each latent is
 * read once for all heads (MLA is MQA in the latent space); the softmax is online over spans
 * within a page; a row's positions split into work items over the threads (split-K), merged
 * per row. Rows one position apart on the same pages (a token and the drafts verified after
 * it) take each span together, so a verify step reads its context once, not once a row. The
 * torch split-K form (kdaserve/ops/mla.py) is the oracle. */

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
/* Most rows whose spans one work item reads together (a token and its drafts) */
#ifndef MLA_GROUP
#define MLA_GROUP 16
#endif

/* the larger of a score and a running max, as every max here takes it (a NaN score is
 * passed over) */
static inline float NAME(mla_max)(float x, float m) { return x > m ? x : m; }

/* One span of n positions (latents lat0 [n, LD]) into one row's online-softmax state: running
 * max m [H], sum l [H] and unnormalised context acc [H, Dc]. q [H, LD] (lanes: qt [LD, HP],
 * its transpose); s, mx, c, tot: scratch. */
static inline __attribute__((always_inline)) void
NAME(mla_step)(const float *q, const float *qt, int lanes, int64_t H, int64_t HP, int64_t Dc,
               int64_t LD, const CT *lat0, int64_t n, float scale, float *s, float *mx,
               float *c, float *tot, float *m, float *l, float *acc) {
    const int64_t hs = lanes ? 1 : MLA_SPAN, js = lanes ? HP : 1;    /* a head's, a position's */
    const int64_t D16 = Dc - Dc % 16;
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
}

/* The H heads' online-softmax partials of RN rows over positions [t0, t1[r]) of their pages
 * (block tables bt[r]): running max m [H], sum l [H] and unnormalised context acc [H, Dc] of
 * row r from state[r] on (initialised here). q[r] [H, LD]: each head's latent
 * query (q_nope absorbed through W_uk) then its rope part. The rows take the spans in the same
 * order, so rows that share pages (a token and its drafts: the same sequence) read each span
 * once while it is in the L1 cache. A row's spans end at its own t1 and are otherwise those
 * it takes alone (a page's end, MLA_SPAN, t1), so its sums are the same bits alone or not. */
static void NAME(mla_span)(const float *const *q, int RN, int64_t H, int64_t Dc, int64_t LD,
                           const CT *pages, int64_t bs, const int64_t *const *bt, int64_t t0,
                           const int64_t *t1, float scale, float *const *state) {
    /* heads as lanes (mla_scores16), s [n, HP]; or each head's dots (mla_dots), s [H, span] */
    const int lanes = H >= 8;
    const int64_t HP = lanes ? (H + 15) / 16 * 16 : H;
    float s[MLA_SPAN * HP];    /* scores, then weights */
    float mx[H], c[H], tot[H];
    float *qt = lanes ? malloc(sizeof(float) * (size_t)(RN * LD * HP)) : NULL;  /* q^T [LD, HP] */
    if (lanes && !qt) abort();
    int64_t end = t0;          /* the longest row's end, and whose pages to ask for ahead */
    const int64_t *ahead = bt[0];
    for (int r = 0; r < RN; ++r) {
        float *qr = qt + (size_t)r * LD * HP;
        for (int64_t i = 0; lanes && i < LD; ++i)
            for (int64_t h = 0; h < HP; ++h) qr[i * HP + h] = h < H ? q[r][h * LD + i] : 0.0f;
        float *m = state[r], *l = m + H, *acc = l + H;
        for (int64_t h = 0; h < H; ++h) { m[h] = -INFINITY; l[h] = 0.0f; }
        for (int64_t i = 0; i < H * Dc; ++i) acc[i] = 0.0f;
        if (t1[r] > end) { end = t1[r]; ahead = bt[r]; }
    }
    /* the first pages, which the prefetch in the loop below never asks for */
    for (int64_t pg = t0 / bs; pg <= (end - 1) / bs && pg < t0 / bs + MLA_AHEAD; ++pg) {
        const char *nx = (const char *)(pages + ahead[pg] * bs * LD);
        for (int64_t off = 0; off < (int64_t)sizeof(CT) * bs * LD; off += 64)
            __builtin_prefetch(nx + off, 0, 0);
    }
    for (int64_t t = t0; t < end;) {
        int64_t n = bs - t % bs;
        n = n < end - t ? n : end - t;
        n = n < MLA_SPAN ? n : MLA_SPAN;
        /* the page MLA_AHEAD pages on: its latents arrive while this span computes (the
         * hardware prefetcher does not follow the page table; 128k positions on 2 threads
         * measured 1.9-2.4 ms without, 1.65-1.70 ms with) */
        if ((t + n) % bs == 0 && t + MLA_AHEAD * bs < end) {
            const char *nx = (const char *)(pages + ahead[t / bs + MLA_AHEAD] * bs * LD);
            for (int64_t off = 0; off < (int64_t)sizeof(CT) * bs * LD; off += 64)
                __builtin_prefetch(nx + off, 0, 0);
        }
        for (int r = 0; r < RN; ++r) {
            if (t >= t1[r]) continue;
            const int64_t nr = n < t1[r] - t ? n : t1[r] - t;
            float *m = state[r], *l = m + H, *acc = l + H;
            NAME(mla_step)(q[r], qt ? qt + (size_t)r * LD * HP : NULL, lanes, H, HP, Dc, LD,
                           pages + (bt[r][t / bs] * bs + t % bs) * LD, nr, scale, s, mx, c,
                           tot, m, l, acc);
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
    const int64_t *grow, *gfirst;   /* group g: rows [grow[g], grow[g+1]), items from gfirst[g] */
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

/* work item it: range i of a group's rows (those long enough to have one), each into its
 * partial softmax state first[b] + i */
static void NAME(mla_item)(const struct NAME(mla_work) *w, int64_t it) {
    int64_t g = 0;
    while (w->gfirst[g + 1] <= it) ++g;
    const int64_t H = w->H, Dc = w->Dc, i = it - w->gfirst[g];
    const int64_t b0 = w->grow[g], b1 = w->grow[g + 1], span = w->per[b0], t0 = i * span;
    const float *q[MLA_GROUP];
    const int64_t *bt[MLA_GROUP];
    int64_t t1[MLA_GROUP];
    float *state[MLA_GROUP];
    int rn = 0;
    for (int64_t b = b0; b < b1; ++b) {
        const int64_t L = w->positions[b] + 1;
        if (t0 >= L) continue;
        q[rn] = w->qf + b * H * w->LD;
        bt[rn] = w->block_table + b * w->width;
        t1[rn] = t0 + span < L ? t0 + span : L;
        state[rn++] = w->part + (w->first[b] + i) * H * (Dc + 2);
    }
    NAME(mla_span)(q, rn, H, Dc, w->LD, w->pages, w->bs, bt, t0, t1, w->scale, state);
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
    /* each row's position ranges follow from its length alone, so its sums do not depend on
     * the thread count (the served engine moves it with the free cores, docs/design.md) nor
     * on its batch mates; partials: row b's range i at first[b] + i */
    int64_t first[B + 1], per[B], grow[B + 1], gfirst[B + 1];
    first[0] = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t L = positions[b] + 1;
        int64_t span = (L + MLA_ROW_SPANS - 1) / MLA_ROW_SPANS;
        span = span < MLA_MIN_SPAN ? MLA_MIN_SPAN : span;
        per[b] = span;
        first[b + 1] = first[b] + (L + span - 1) / span;
    }
    /* work items: (group, range). A group is a run of rows one position apart with the same
     * first page and ranges of one size: a token and the drafts verified after it, which
     * read the same pages (mla_span reads each span once for all of them). The last row of
     * a group is its longest, and has the most ranges. */
    int64_t G = 0;
    gfirst[0] = 0;
    for (int64_t b = 0; b < B; ++b) {
        if (!(b > 0 && b - grow[G - 1] < MLA_GROUP && positions[b] == positions[b - 1] + 1
              && per[b] == per[b - 1] && block_table[b * width] == block_table[(b - 1) * width])) {
            if (G) gfirst[G] = gfirst[G - 1] + first[b] - first[b - 1];
            grow[G++] = b;
        }
    }
    grow[G] = B;
    if (G) gfirst[G] = gfirst[G - 1] + first[B] - first[B - 1];
    const int64_t items = gfirst[G];
    float *qf = malloc(sizeof(float) * (size_t)(B * H * LD));
    float *part = malloc(sizeof(float) * (size_t)(first[B] * H * (Dc + 2)));
    if (!qf || !part) abort();
    const struct NAME(mla_work) w = {H, N, R, Dc, Vd, QD, LD, q, kv_b, pages, bs, block_table,
                                     width, positions, scale, o, qf, part, first, per, grow,
                                     gfirst};
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
