/* The whole distribution a sampled row draws from, written out (included by sample_cpu.c:
 * Cand, argmax and nucleus come from it). Speculative decoding needs it where a plain step
 * needs one token: the draft samples its drafts from q and keeps q, and verification compares
 * the target's p with it at every position (kdaserve/engine/spec/rejection.py target_probs,
 * whose torch form, sampler._filter then softmax, stays the oracle). The torch form sorts the
 * vocabulary for a nucleus wider than 256 tokens, ~0.6 ms a row at vocab 4,096; a block of 7
 * drafts and its verification ask for 15 rows a step.
 *
 * x [V]: logits already penalised, masked (-inf) and divided by the temperature. top-k and
 * top-p keep the nucleus as sample_rows does, min-p then drops the tokens under min_p of the
 * best one's weight, and the kept weights exp(x - max) are normalised (their total summed in
 * double). Tokens outside, masked ones and those more than TINY nats under the best get
 * exactly 0 (where exp_approx clamps; softmax gives the last of them subnormal weights). */
#define TINY 87.0f
static void row_probs(const float *x, int64_t V, int64_t top_k, float top_p, float min_p,
                      float *out, Cand *cand, float *w) {
    const float mx = x[argmax(x, V)];
    double total = 0.0;
    if (top_k < V || top_p < 1.0f) {
        const int64_t n = nucleus(x, V, mx, top_k, top_p, cand, w);
        memset(out, 0, (size_t)V * sizeof(float));
        for (int64_t j = 0; j < n; ++j) {
            float e = exp_approx(cand[j].v - mx);
            e = (min_p > 0.0f && e < min_p) || cand[j].v - mx < -TINY ? 0.0f : e;
            out[cand[j].i] = e;
            total += (double)e;
        }
        const float inv = (float)(1.0 / total);
        for (int64_t j = 0; j < n; ++j) out[cand[j].i] *= inv;
        return;
    }
    for (int64_t i = 0; i < V; ++i) {             /* vectorised */
        const float e = exp_approx(x[i] - mx);
        out[i] = (e < min_p) | (x[i] - mx < -TINY) ? 0.0f : e;
    }
    for (int64_t i = 0; i < V; ++i) total += (double)out[i];
    const float inv = (float)(1.0 / total);
    for (int64_t i = 0; i < V; ++i) out[i] *= inv;
}

/* Rows [0, S) of x [S, V] into out [S, V]; top_k [S] int64 (V: off), top_p and min_p [S]
 * float. Split over `threads` threads when built with OpenMP, each with its own scratch
 * (`stride` bytes apart: V Cand, then V floats zeroed and left zeroed); a row depends only on
 * its own inputs. */
void row_probs_threads(int64_t S, int64_t threads, int64_t V, const float *x,
                       const int64_t *top_k, const float *top_p, const float *min_p, float *out,
                       uint8_t *scratch, int64_t stride) {
#ifdef _OPENMP
#pragma omp parallel num_threads((int)(threads > 0 ? threads : 1)) if (threads > 1 && S > 1)
#endif
    {
        int64_t r0, r1;
        thread_share(0, S, &r0, &r1);
        uint8_t *base = scratch + thread_index() * stride;
        Cand *cand = (Cand *)(void *)base;
        float *w = (float *)(void *)(base + sizeof(Cand) * (size_t)V);
        for (int64_t r = r0; r < r1; ++r)
            row_probs(x + r * V, V, top_k[r], top_p[r], min_p[r], out + r * V, cand, w);
    }
}
