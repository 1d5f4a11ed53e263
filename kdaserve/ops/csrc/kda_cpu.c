/* KDA recurrence over decode rows, in place on the engine's state slots (CPU, fp32).
 *
 * Per head, with state S [K, V]:
 *   S' = Diag(exp g_t) S;  S = S' + beta_t k_t (v_t - S'^T k_t)^T;  o_t = S^T q_t
 *
 * Each (row, head) state is read from its slot once, kept in cache while the row's L positions
 * run (two sweeps of 16 KiB per position for K = V = 64), and written back once: the torch form
 * needs a gather, a scatter and several passes over every state per step. The inner loops run
 * over V with independent lanes, so they vectorise without reassociating any sum; the result
 * does not depend on how rows are split between threads.
 *
 * Layouts (contiguous): store [S, H, K, V]; slots [B]; q, k, g [B, L, H, K]; v [B, L, H, V];
 * beta [B, L, H]; o [B, L, H, V]; kept [B, L / keep_every, H, K, V] or NULL: the state after
 * every keep_every-th position (1: each position, for speculative rollback; the chunk size:
 * chunk ends, for prefix-cache snapshots).
 *
 * The same kernel runs prefill rows (store = their initial states, slots = 0..B-1): on a CPU the
 * recurrence with the state held in L1 beats the chunked form, whose pairwise-decay temporaries
 * are memory-bound, and decode and prefill then share one arithmetic.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fastmath.h"
#include "threads.h"
#include "kda_step.h"

void kda_recurrent_slots(int64_t row_begin, int64_t row_end, int64_t nthreads, float *store,
                         const int64_t *slots, int64_t L, int64_t H, int64_t K, int64_t V,
                         const float *q, const float *k, const float *v, const float *g,
                         const float *beta, float *o, float *kept, int64_t keep_every) {
    /* each (row, head) state runs on its own, so they split over the threads */
    (void)nthreads;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t b = row_begin; b < row_end; ++b) {
        for (int64_t h = 0; h < H; ++h) {
            float kv[V], delta[V], out[V], decay[K];
            float *S = store + (slots[b] * H + h) * K * V;
            for (int64_t t = 0; t < L; ++t) {
                const int64_t bth = (b * L + t) * H + h;
                const float *qt = q + bth * K, *kt = k + bth * K, *gt = g + bth * K;
                const float *vt = v + bth * V;
                const float bt = beta[bth];
                kda_step(S, qt, kt, vt, gt, bt, out, K, V, kv, delta, decay);
                memcpy(o + bth * V, out, sizeof(float) * V);
                if (kept && (t + 1) % keep_every == 0) {
                    const int64_t at = (b * (L / keep_every) + (t + 1) / keep_every - 1) * H + h;
                    memcpy(kept + at * K * V, S, sizeof(float) * K * V);
                }
            }
        }
    }
}

/* The per-token inputs of the recurrence from a KDA layer's projections (CPU, fp32): the causal
 * depthwise conv over the packed sequences with their carried windows, SiLU, per-head L2 norm of
 * q (then scaled) and k, the log-space decay g and beta = sigmoid(b). One pass per token row
 * replaces a dozen torch ops, each a sweep over every token and a small allocation.
 *
 * Layouts: pre [T, 3HD] rows `pre_stride` apart (q | k | v channels before the conv);
 * window [B, W, 3HD] the W = taps - 1 inputs before each sequence's first token; cu [B + 1]
 * token offsets; conv_wt [taps, 3HD] (the conv weight transposed); fraw [T, HD] rows
 * `f_stride` apart (f_b_proj output); dt_bias [HD]; a [H] = exp(A_log); braw [T, H] rows
 * `b_stride` apart. Outputs: q, k, v, g [T, H, D]; beta [T, H]; new_window [B, W, 3HD], the
 * inputs after each sequence's last token.
 * use_bound selects g = lower_bound * sigmoid(a * raw) over g = -a * softplus(raw).
 */
/* log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)); log1p(u) as log(1 + u) * u / ((1 + u) - 1)
 * keeps small u exact (Goldberg). Above 20 torch returns x itself; so does this, in fp32. */
static inline float softplus(float x) {
    const float u = exp_approx(-fabsf(x)), w = 1.0f + u;
    const float l1p = w == 1.0f ? u : log_approx(w) * u / (w - 1.0f);
    return (x > 0.0f ? x : 0.0f) + l1p;
}

/* Sixteen independent partial sums (they vectorise), then their total. */
static inline float sum_squares(const float *x, int64_t n) {
    float lanes[16] = {0.0f};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int64_t l = 0; l < 16; ++l) lanes[l] += x[i + l] * x[i + l];
    float total = 0.0f;
    for (; i < n; ++i) total += x[i] * x[i];
    for (int64_t l = 0; l < 16; ++l) total += lanes[l];
    return total;
}

/* Token rows [t0, t1) of sequences [seq_begin, seq_end): each row reads only inputs. */
static void prepare_rows(int64_t seq_begin, int64_t seq_end, int64_t t0, int64_t t1,
                         const int64_t *cu, int64_t taps, int64_t H, int64_t D,
                         const float *pre, int64_t pre_stride, const float *window,
                         const float *conv_wt, const float *fraw, int64_t f_stride,
                         const float *dt_bias, const float *a, float lower_bound,
                         int64_t use_bound, const float *braw, int64_t b_stride, float q_scale,
                         float *q, float *k, float *v, float *g, float *beta) {
    const int64_t HD = H * D, C = 3 * HD, W = taps - 1;
    float row_buf[C];
    float *restrict row = row_buf;
    int64_t b = seq_begin;
    for (int64_t t = t0; t < t1; ++t) {
        while (b < seq_end - 1 && t >= cu[b + 1]) ++b;
        const int64_t start = cu[b], p = t - start;
        const float *win = window + b * W * C;
        for (int64_t c = 0; c < C; ++c) row[c] = 0.0f;
        for (int64_t j = 0; j < taps; ++j) {
            const int64_t src = p - W + j;   /* < 0: an input before this step */
            const float *in = src >= 0 ? pre + (start + src) * pre_stride
                                       : win + (W + src) * C;
            const float *wj = conv_wt + j * C;
            for (int64_t c = 0; c < C; ++c) row[c] += in[c] * wj[c];
        }
        for (int64_t c = 0; c < C; ++c) row[c] = silu(row[c]);
        for (int64_t h = 0; h < H; ++h) {
            const float *rq = row + h * D, *rk = row + HD + h * D, *rv = row + 2 * HD + h * D;
            const float nq = q_scale / sqrtf(sum_squares(rq, D) + 1e-6f);
            const float nk = 1.0f / sqrtf(sum_squares(rk, D) + 1e-6f);
            float *restrict oq = q + (t * H + h) * D, *restrict ok = k + (t * H + h) * D;
            float *restrict ov = v + (t * H + h) * D, *restrict og = g + (t * H + h) * D;
            const float *fr = fraw + t * f_stride + h * D, *bias = dt_bias + h * D;
            const float ah = a[h];
            for (int64_t d = 0; d < D; ++d) {
                oq[d] = rq[d] * nq;
                ok[d] = rk[d] * nk;
                ov[d] = rv[d];
            }
            if (use_bound)
                for (int64_t d = 0; d < D; ++d)
                    og[d] = lower_bound * sigmoid(ah * (fr[d] + bias[d]));
            else
                for (int64_t d = 0; d < D; ++d) og[d] = -ah * softplus(fr[d] + bias[d]);
            beta[t * H + h] = sigmoid(braw[t * b_stride + h]);
        }
    }
}

void kda_prepare(int64_t seq_begin, int64_t seq_end, int64_t nthreads, const int64_t *cu,
                 int64_t taps, int64_t H, int64_t D, const float *pre, int64_t pre_stride,
                 const float *window, const float *conv_wt, const float *fraw, int64_t f_stride,
                 const float *dt_bias, const float *a, float lower_bound, int64_t use_bound,
                 const float *braw, int64_t b_stride, float q_scale, float *q, float *k,
                 float *v, float *g, float *beta, float *new_window) {
    const int64_t C = 3 * H * D, W = taps - 1;
    const int64_t first = cu[seq_begin], last = cu[seq_end];
    /* token rows split evenly over the threads, whatever the sequences' lengths */
    (void)nthreads;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int64_t lo, hi;
        thread_share(first, last, &lo, &hi);
        prepare_rows(seq_begin, seq_end, lo, hi, cu, taps, H, D, pre, pre_stride, window,
                     conv_wt, fraw, f_stride, dt_bias, a, lower_bound, use_bound, braw,
                     b_stride, q_scale, q, k, v, g, beta);
    }
    for (int64_t b = seq_begin; b < seq_end; ++b) {
        const int64_t start = cu[b], len = cu[b + 1] - start;
        const float *win = window + b * W * C;
        float *nw = new_window + b * W * C;
        for (int64_t i = 0; i < W; ++i) {
            const int64_t src = len - W + i;
            memcpy(nw + i * C, src >= 0 ? pre + (start + src) * pre_stride : win + (len + i) * C,
                   sizeof(float) * C);
        }
    }
}
