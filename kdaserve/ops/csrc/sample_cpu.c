/* Sampling rows of logits on CPU in one call: repetition, frequency and presence penalties
 * from each row's history, temperature, top-k, top-p, min-p and an inverse-CDF draw with the
 * row's own uniform (kdaserve/engine/sampler.py, whose torch form stays the oracle:
 * tests/ops/test_sample_kernel.py). The torch form costs ~0.4 ms for one row and ~5 ms for
 * 32 at vocab 4,096 (a few dozen small ops, a top-k, the penalties rebuilt from Python lists);
 * here a row is a few passes over its vocabulary.
 *
 * Same arithmetic as the torch form where it decides a token: penalties apply the same float
 * operations in the same order (bit-identical logits), greedy rows take the first maximum.
 * The nucleus boundary and the draw sum probabilities in another order (here in double), so a
 * sampled row can differ from the torch form's when its uniform falls within rounding of a
 * token boundary; the distribution is the same. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"
#include "threads.h"

typedef struct {
    float v;
    int32_t i;
} Cand;

/* a ranks below b: lower value, or the same value at a later index (the order the torch
 * form's top-k and sort give, ties aside) */
static inline int worse(const Cand *a, const Cand *b) {
    return a->v < b->v || (a->v == b->v && a->i > b->i);
}

static inline int later(const Cand *a, const Cand *b) { return a->i > b->i; }
static inline int better(const Cand *a, const Cand *b) { return worse(b, a); }

/* heaps with the comparison inlined (qsort's call per comparison cost more than the rest of
 * a row): by_index keeps the latest at the root, best_first the best */
#define SIFT_DOWN(name, before)                                                       \
    static void name(Cand *h, int64_t n, int64_t i) {                                 \
        for (;;) {                                                                    \
            int64_t w = i, l = 2 * i + 1, r = l + 1;                                  \
            if (l < n && before(&h[l], &h[w])) w = l;                                 \
            if (r < n && before(&h[r], &h[w])) w = r;                                 \
            if (w == i) return;                                                       \
            const Cand t = h[i];                                                      \
            h[i] = h[w];                                                              \
            h[w] = t;                                                                 \
            i = w;                                                                    \
        }                                                                             \
    }
SIFT_DOWN(sift_by_index, later)
SIFT_DOWN(sift_best_first, better)

/* c[0:n) by ascending index, in place (heap sort: the latest goes last each time) */
static void sort_by_index(Cand *c, int64_t n) {
    for (int64_t i = n / 2 - 1; i >= 0; --i) sift_by_index(c, n, i);
    for (int64_t end = n - 1; end > 0; --end) {
        const Cand t = c[0];
        c[0] = c[end];
        c[end] = t;
        sift_by_index(c, end, 0);
    }
}

/* the first index of the largest value (torch's argmax): the maximum in eight lanes
 * (vectorised), then its first place */
static int64_t argmax(const float *x, int64_t V) {
    float lanes[8];
    int64_t i = 0;
    for (int j = 0; j < 8; ++j) lanes[j] = -INFINITY;
    for (; i + 8 <= V; i += 8)
        for (int j = 0; j < 8; ++j) lanes[j] = x[i + j] > lanes[j] ? x[i + j] : lanes[j];
    float m = -INFINITY;
    for (int j = 0; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
    for (; i < V; ++i) m = x[i] > m ? x[i] : m;
    for (i = 0; i < V; ++i)
        if (x[i] == m) return i;
    return 0;                   /* all NaN */
}

/* sum of exp(x - mx) in eight lanes (vectorised) */
static double exp_sum(const float *x, int64_t V, float mx) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= V; i += 8)
        for (int j = 0; j < 8; ++j) lanes[j] += exp_approx(x[i + j] - mx);
    double z = 0.0;
    for (int j = 0; j < 8; ++j) z += lanes[j];
    for (; i < V; ++i) z += exp_approx(x[i] - mx);
    return z;
}

/* x[t] of each token in the history penalised as sampler.Penalties.apply does: repetition on
 * tokens of the prompt (when rep != 1) and of the output, frequency and presence on the
 * output's counts. counts and mark [V] come in zeroed and are left zeroed. */
static void penalise(float *x, int64_t V, const int32_t *hist, int64_t n_prompt, int64_t n,
                     float rep, float freq, float pres, float *counts, uint8_t *mark) {
    for (int64_t j = n_prompt; j < n; ++j) {
        int32_t t = hist[j] < V ? hist[j] : (int32_t)(V - 1);
        if (t >= 0) counts[t] += 1.0f;
    }
    for (int64_t j = rep != 1.0f ? 0 : n_prompt; j < n; ++j) {
        int32_t t = hist[j] < V ? hist[j] : (int32_t)(V - 1);
        if (t < 0 || mark[t]) continue;
        mark[t] = 1;
        float v = x[t];
        v = v > 0.0f ? v / rep : v * rep;
        const float c = counts[t];
        x[t] = v - (freq * c + pres * (c > 0.0f ? 1.0f : 0.0f));
    }
    for (int64_t j = 0; j < n; ++j) {
        int32_t t = hist[j] < V ? hist[j] : (int32_t)(V - 1);
        if (t >= 0) counts[t] = 0.0f, mark[t] = 0;
    }
}

#include "sample_nucleus.h"

/* the draw over the whole vocabulary (no top-k or top-p): x becomes the weights */
static int64_t draw_all(float *x, int64_t V, float mx, float min_p, float u) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= V; i += 8)
        for (int j = 0; j < 8; ++j) {
            float w = exp_approx(x[i + j] - mx);
            w = w < min_p ? 0.0f : w;             /* min_p 0: never */
            x[i + j] = w;
            lanes[j] += w;
        }
    double total = 0.0;
    for (int j = 0; j < 8; ++j) total += lanes[j];
    for (; i < V; ++i) {
        float w = exp_approx(x[i] - mx);
        x[i] = w < min_p ? 0.0f : w;
        total += x[i];
    }
    const double target = (1.0 - (double)u) * total;
    double cum = 0.0;
    for (i = 0; i < V; ++i) {
        cum += (double)x[i];
        if (cum >= target && x[i] > 0.0f) return i;
    }
    return -1;
}

/* the token at (1 - u) of the cumulative weight exp(x - mx) over c[0:n) in vocabulary order
 * (the order of the torch form's cumsum), tokens under min_p of the best one's weight out.
 * Many tokens: scattered into w [V] (zeroed, left zeroed) and scanned; few: sorted. */
static int64_t draw(Cand *c, int64_t n, int64_t V, float mx, float min_p, float u,
                    float *w) {
    double total = 0.0;
    for (int64_t j = 0; j < n; ++j) {
        const float x = exp_approx(c[j].v - mx);
        c[j].v = (min_p > 0.0f && x < min_p) ? 0.0f : x;
        total += (double)c[j].v;
    }
    const double target = (1.0 - (double)u) * total;    /* in (0, total] */
    double cum = 0.0;
    int64_t pick = -1;
    if (n > 64) {
        for (int64_t j = 0; j < n; ++j) w[c[j].i] = c[j].v;
        for (int64_t i = 0; i < V; ++i) {
            cum += (double)w[i];
            if (cum >= target && w[i] > 0.0f) {
                pick = i;
                break;
            }
        }
        for (int64_t j = 0; j < n; ++j) w[c[j].i] = 0.0f;
        return pick;
    }
    sort_by_index(c, n);
    for (int64_t j = 0; j < n; ++j) {
        cum += (double)c[j].v;
        if (cum >= target && c[j].v > 0.0f) return c[j].i;
    }
    return -1;
}

/* Rows [r0, r1). logits [S,V]; temps, top_p, min_p, u, rep, freq, pres [S] float; top_k [S]
 * int64 (V: off); hist int32 with hist_off [S+1] int64 and n_prompt [S] (a row's prompt ids
 * first, then its output ids; empty where not penalised); out [S] int64. scratch: V floats
 * (the row), V Cand, V floats and V bytes (the penalties' counts and marks, zeroed). */
void sample_rows(int64_t r0, int64_t r1, int64_t V, const float *logits, const float *temps,
                 const int64_t *top_k, const float *top_p, const float *min_p, const float *u,
                 const float *rep, const float *freq, const float *pres, const int32_t *hist,
                 const int64_t *hist_off, const int64_t *n_prompt, int64_t *out, float *x,
                 Cand *cand, float *counts, uint8_t *mark) {
    for (int64_t r = r0; r < r1; ++r) {
        memcpy(x, logits + r * V, (size_t)V * sizeof(float));
        const int64_t h0 = hist_off[r], hn = hist_off[r + 1] - h0;
        if (rep[r] != 1.0f || freq[r] != 0.0f || pres[r] != 0.0f)
            penalise(x, V, hist + h0, n_prompt[r], hn, rep[r], freq[r], pres[r], counts, mark);
        int64_t best = argmax(x, V);
        const float t = temps[r];
        if (!(t > 0.0f)) {
            out[r] = best;
            continue;
        }
        for (int64_t i = 0; i < V; ++i) x[i] = x[i] / t;
        const float mx = x[best];
        int64_t pick;
        if (top_k[r] < V || top_p[r] < 1.0f) {
            const int64_t n = nucleus(x, V, mx, top_k[r], top_p[r], cand, counts);
            pick = draw(cand, n, V, mx, min_p[r], u[r], counts);
        } else {
            pick = draw_all(x, V, mx, min_p[r], u[r]);
        }
        out[r] = pick >= 0 ? pick : best;
    }
}

/* All S rows, split over `threads` threads when built with OpenMP (torch's pool, shared like
 * the decode blocks': a Python pool beside it met torch's workers still spinning from the
 * step's kernels). Each thread takes a contiguous run of rows with its own scratch, `stride`
 * bytes apart (sample_rows' four regions each); a row's token depends only on its own inputs,
 * so the split changes nothing in the result. */
void sample_rows_threads(int64_t S, int64_t threads, int64_t V, const float *logits,
                         const float *temps, const int64_t *top_k, const float *top_p,
                         const float *min_p, const float *u, const float *rep,
                         const float *freq, const float *pres, const int32_t *hist,
                         const int64_t *hist_off, const int64_t *n_prompt, int64_t *out,
                         uint8_t *scratch, int64_t stride) {
#ifdef _OPENMP
#pragma omp parallel num_threads((int)(threads > 0 ? threads : 1)) if (threads > 1 && S > 1)
#endif
    {
        int64_t r0, r1;
        thread_share(0, S, &r0, &r1);
        uint8_t *base = scratch + thread_index() * stride;
        const size_t cand_bytes = sizeof(Cand) * (size_t)V;
        if (r0 < r1)
            sample_rows(r0, r1, V, logits, temps, top_k, top_p, min_p, u, rep, freq, pres,
                        hist, hist_off, n_prompt, out, (float *)(void *)base,
                        (Cand *)(void *)(base + 4 * V),
                        (float *)(void *)(base + 4 * V + cand_bytes),
                        base + 8 * V + cand_bytes);
    }
}

#include "sample_probs.h"
