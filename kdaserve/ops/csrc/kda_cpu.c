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

void kda_recurrent_slots(float *store, const int64_t *slots, int64_t row_begin, int64_t row_end,
                         int64_t L, int64_t H, int64_t K, int64_t V,
                         const float *q, const float *k, const float *v, const float *g,
                         const float *beta, float *o, float *kept, int64_t keep_every) {
    float kv[V], delta[V], out[V];
    for (int64_t b = row_begin; b < row_end; ++b) {
        for (int64_t h = 0; h < H; ++h) {
            float *S = store + (slots[b] * H + h) * K * V;
            for (int64_t t = 0; t < L; ++t) {
                const int64_t bth = (b * L + t) * H + h;
                const float *qt = q + bth * K, *kt = k + bth * K, *gt = g + bth * K;
                const float *vt = v + bth * V;
                const float bt = beta[bth];
                for (int64_t j = 0; j < V; ++j) kv[j] = 0.0f;
                for (int64_t i = 0; i < K; ++i) {
                    float *row = S + i * V;
                    const float e = expf(gt[i]), ki = kt[i];
                    for (int64_t j = 0; j < V; ++j) {
                        row[j] *= e;
                        kv[j] += ki * row[j];
                    }
                }
                for (int64_t j = 0; j < V; ++j) {
                    delta[j] = (vt[j] - kv[j]) * bt;
                    out[j] = 0.0f;
                }
                for (int64_t i = 0; i < K; ++i) {
                    float *row = S + i * V;
                    const float ki = kt[i], qi = qt[i];
                    for (int64_t j = 0; j < V; ++j) {
                        row[j] += ki * delta[j];
                        out[j] += qi * row[j];
                    }
                }
                memcpy(o + bth * V, out, sizeof(float) * V);
                if (kept && (t + 1) % keep_every == 0) {
                    const int64_t at = (b * (L / keep_every) + (t + 1) / keep_every - 1) * H + h;
                    memcpy(kept + at * K * V, S, sizeof(float) * K * V);
                }
            }
        }
    }
}
