/* Routed experts of a MoE layer over ragged groups (CPU, fp32): out[t] += w * MLP_e(x[t]) for
 * every (token, expert) slot, slots grouped by expert.
 *
 * The torch form pads every expert's group to the largest one and runs two batched matmuls;
 * with decode batches (a few rows per expert, the busiest one ~3x the mean) most of that work
 * is padding. Here each group runs at its own size, up to MAX_ROWS rows per pass over the
 * expert's weights, so every weight vector read serves all of them and their accumulators
 * stay in registers (the row count is a compile-time constant in each specialisation). The
 * weights are read transposed (w13t [E, H, 2I] = w1 | w3 per expert, w2t [E, I, H]), so the
 * vectors run along contiguous outputs and no sum is reassociated: a token's result does not
 * depend on its group mates.
 *
 * Layouts: x [T, H]; token [S] the token of each slot, grouped by expert; offsets [E + 1] the
 * groups' bounds in token; slot_w [S] routing weights; out [T, H] accumulated in slot order.
 */
#include <stdint.h>
#include <string.h>

#include "fastmath.h"

#define MAX_ROWS 8
#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif

typedef float vec __attribute__((vector_size(VW * sizeof(float))));

static inline vec vload(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* y[r][0:N) = sum_i a[r][i] * w[i][0:N) for R rows; w rows N apart. `next` (the same matrix
 * of the next expert, or NULL) is prefetched a cache line per step: a decode step reads every
 * expert's weights once, from memory, and would otherwise wait on each line. */
static inline __attribute__((always_inline)) void rows_times_matrix(
        const int R, const float *const *a, int64_t K, const float *w, int64_t N, float **y,
        const float *next) {
    int64_t n0 = 0, step = 0;
    const int64_t lines = K * N / 16;
    for (; n0 + VW <= N; n0 += VW) {
        vec acc[MAX_ROWS];
        for (int r = 0; r < R; ++r) acc[r] = (vec){0};
        for (int64_t i = 0; i < K; ++i, ++step) {
            if (next && step < lines) __builtin_prefetch(next + step * 16, 0, 1);
            const vec wv = vload(w + i * N + n0);
            for (int r = 0; r < R; ++r) acc[r] += a[r][i] * wv;
        }
        for (int r = 0; r < R; ++r) memcpy(y[r] + n0, &acc[r], sizeof acc[r]);
    }
    for (; n0 < N; ++n0)
        for (int r = 0; r < R; ++r) {
            float s = 0.0f;
            for (int64_t i = 0; i < K; ++i) s += a[r][i] * w[i * N + n0];
            y[r][n0] = s;
        }
}

/* R rows of one expert: x rows -> w13 -> silu(gate) * up -> w2 -> out += slot weight * y. */
static inline __attribute__((always_inline)) void expert_rows(
        const int R, const float *x, const int64_t *token, const float *slot_w,
        const float *w13, const float *w2, int64_t H, int64_t I, float *out, float *acc,
        float *act, float *y, const float *next13, const float *next2) {
    const float *xr[MAX_ROWS], *actp[MAX_ROWS];
    float *accp[MAX_ROWS], *yp[MAX_ROWS];
    for (int r = 0; r < R; ++r) {
        xr[r] = x + token[r] * H;
        accp[r] = acc + r * 2 * I;
        actp[r] = act + r * I;
        yp[r] = y + r * H;
    }
    rows_times_matrix(R, xr, H, w13, 2 * I, accp, next13);
    for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < I; ++j) act[r * I + j] = silu(accp[r][j]) * accp[r][I + j];
    rows_times_matrix(R, actp, I, w2, H, yp, next2);
    for (int r = 0; r < R; ++r) {
        float *o = out + token[r] * H;
        const float sw = slot_w[r];
        for (int64_t h = 0; h < H; ++h) o[h] += sw * yp[r][h];
    }
}

void moe_experts(int64_t e_begin, int64_t e_end, int64_t H, int64_t I, const float *x,
                 const int64_t *token, const int64_t *offsets, const float *slot_w,
                 const float *w13t, const float *w2t, float *out) {
    float acc[MAX_ROWS * 2 * I], act[MAX_ROWS * I], y[MAX_ROWS * H];
    for (int64_t e = e_begin; e < e_end; ++e) {
        const float *w13 = w13t + e * H * 2 * I, *w2 = w2t + e * I * H;
        const int64_t end = offsets[e + 1];
        int64_t after = e + 1;   /* the next expert with rows, its weights to prefetch */
        while (after < e_end && offsets[after + 1] == offsets[after]) ++after;
        for (int64_t s = offsets[e]; s < end; s += MAX_ROWS) {
            const int64_t n = end - s < MAX_ROWS ? end - s : MAX_ROWS;
            /* the first pass over this expert's weights prefetches the next one's */
            const float *n13 = after < e_end && s == offsets[e] ? w13t + after * H * 2 * I : 0;
            const float *n2 = after < e_end && s == offsets[e] ? w2t + after * I * H : 0;
#define ROWS_CASE(R) \
    case R: expert_rows(R, x, token + s, slot_w + s, w13, w2, H, I, out, acc, act, y, n13, n2); \
        break;
            switch (n) {
                ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
                ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
            }
#undef ROWS_CASE
        }
    }
}
