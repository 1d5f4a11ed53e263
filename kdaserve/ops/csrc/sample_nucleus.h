/* The nucleus of a sampled row for sample_cpu.c (included there: Cand, sift_best_first and
 * exp_sum come from it): which of the best tokens top-k and top-p keep. */

/* Ranks rank, rank + 1, ... of the nucleus taken best first from e[0:h) (a heap built here)
 * while rank < top_k and the mass above, *above (unnormalised; p = top_p times the total), is
 * below p: rank 0 always. The taken ones end up at e[0:taken) (the others are overwritten);
 * returns the rank reached. Only the taken ones get ordered (usually a few of the h). */
static int64_t take_best(Cand *e, int64_t h, int64_t rank, int64_t top_k, double p, float mx,
                         double *above) {
    for (int64_t i = h / 2 - 1; i >= 0; --i) sift_best_first(e, h, i);
    int64_t m = h, keep = rank;
    while (m > 0) {
        if (keep > 0 && (keep >= top_k || *above >= p)) break;
        *above += (double)exp_approx(e[0].v - mx);
        const Cand t = e[0];
        e[0] = e[--m];
        e[m] = t;
        sift_best_first(e, m, 0);
        ++keep;
    }
    memmove(e, e + m, (size_t)(h - m) * sizeof(Cand));    /* popped to the end: to the front */
    return keep;
}

/* How many of the best tokens top-k and top-p keep; c[0:keep) are they (in no order). The
 * tokens go into buckets of 1/32 nat below the best by value (one pass): every bucket before
 * the one where the mass or the count reaches top_p or top_k is kept whole, the ones after it
 * dropped, and only that boundary bucket's tokens are ranked, best first from a heap (the
 * torch form sorts the vocabulary). A boundary past SPAN nats (top-k on a peaked row, or a
 * flat distribution over a huge vocabulary) is found the same way from all the tokens. The
 * weights are computed first in a vectorised pass (into w [V], zeroed and left zeroed), so
 * the scatter into the buckets does no exp (24 -> 13 us a row on the demo's own logits). */
#define NB 1024
#define SPAN 32.0f
static int64_t nucleus_buckets(const float *x, int64_t V, float mx, int64_t top_k,
                               float top_p, Cand *c, float *w) {
    double mass[NB + 1] = {0};
    int32_t cnt[NB + 1] = {0};
    double z = 0.0;
    for (int64_t i = 0; i < V; ++i) w[i] = exp_approx(x[i] - mx);    /* vectorised */
    for (int64_t i = 0; i < V; ++i) {               /* the scatter: no exp in its way */
        const float d = mx - x[i];
        const int32_t b = d < SPAN ? (int32_t)(d * (NB / SPAN)) : NB;
        mass[b] += w[i];
        cnt[b] += 1;
    }
    memset(w, 0, (size_t)V * sizeof(float));
    for (int64_t b = 0; b <= NB; ++b) z += mass[b];
    const double p = (double)top_p * z;
    double before = 0.0;
    int64_t rank = 0, edge = 0;
    for (; edge < NB; ++edge) {
        if (rank + cnt[edge] >= top_k || before + mass[edge] >= p) break;
        before += mass[edge];
        rank += cnt[edge];
    }
    if (edge == NB) {          /* the boundary is in the tail: rank from all the tokens */
        for (int64_t i = 0; i < V; ++i) c[i].v = x[i], c[i].i = (int32_t)i;
        double above = 0.0;
        return take_best(c, V, 0, top_k, p, mx, &above);
    }
    /* the kept buckets' tokens first, the boundary bucket's after them */
    int64_t n = 0, m = rank;
    for (int64_t i = 0; i < V; ++i) {
        const float d = mx - x[i];
        const int64_t b = d < SPAN ? (int64_t)(d * (NB / SPAN)) : NB;
        if (b < edge) c[n].v = x[i], c[n++].i = (int32_t)i;
        else if (b == edge) c[m].v = x[i], c[m++].i = (int32_t)i;
    }
    return take_best(c + rank, m - rank, rank, top_k, p, mx, &before);
}

/* The nucleus (see nucleus_buckets). A peaked distribution (the usual case) first: the
 * tokens within CLOSE nats of the best, if few, are taken best first from a heap until it
 * closes, which is exact (they head the whole ranking) when it closes inside them; that is
 * cheaper than the bucket pass, whose additions into the same few buckets serialise. */
#define CLOSE 16.0f
#define MAX_CLOSE 512
static int64_t nucleus(const float *x, int64_t V, float mx, int64_t top_k, float top_p,
                       Cand *c, float *w) {
    int64_t n = 0;
    const float floor_ = mx - CLOSE;
    for (int64_t i = 0; i < V; ++i) {
        if (x[i] >= floor_) {
            if (n == MAX_CLOSE) return nucleus_buckets(x, V, mx, top_k, top_p, c, w);
            c[n].v = x[i], c[n++].i = (int32_t)i;
        }
    }
    const double p = (double)top_p * exp_sum(x, V, mx);
    double above = 0.0;
    const int64_t keep = take_best(c, n, 0, top_k, p, mx, &above);
    if (keep == n && keep < top_k && above < p)       /* wider than the close ones */
        return nucleus_buckets(x, V, mx, top_k, top_p, c, w);
    return keep;
}
