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
 * Layouts: x [T, H]; token [S] the token of each slot, grouped by expert and ascending within a
 * group; offsets [E + 1] the groups' bounds in token; slot_w [S] routing weights; out [T, H]
 * accumulated expert by expert. A call handles the tokens in [t_begin, t_end): threads split
 * the tokens, so each token's sum runs in the same order on one thread whatever the split.
 *
 * The gated activation is selected at run time (`act`): 0 SiLU, silu(gate) * up; 1 SiTU,
 * beta*tanh(gate/beta)*sigmoid(gate) * (linear_beta*tanh(up/linear_beta), or up when
 * linear_beta <= 0), as kdaserve/ops/activation.py computes it.
 *
 * moe_experts_mxfp4 (moe_mxfp4.h) runs the same MLPs on MXFP4 weights in the checkpoint's
 * layout. The *_rows entry points split a token range over `nthreads` of torch's own threads
 * (OpenMP, sharing torch's libgomp; csrc/threads.h).
 */
#include <stdint.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef __aarch64__
#include <arm_neon.h>
#endif

#include "fastmath.h"
#include "ksplit.h"
#include "threads.h"

/* Up to MAX_ROWS sums of VW lanes, one register each: 16 lanes with AVX-512; 8 with AVX2;
 * 4 on aarch64, one NEON register (GCC 12 keeps a wider generic vector in memory there, every
 * add a store and a reload): 8 sums, 8 products in flight and the weights, 17 of 32. */
#define MAX_ROWS 8
#if defined(__AVX512F__)
#define VW 16
#elif defined(__aarch64__)
#define VW 4
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
    const int64_t KH = k_split_at(N, K, (int64_t)sizeof(float));   /* decode_blocks' order */
    for (; n0 + VW <= N; n0 += VW) {
        vec acc[MAX_ROWS];
        for (int r = 0; r < R; ++r) acc[r] = (vec){0};
        for (int64_t i = 0; i < KH; ++i, ++step) {
            if (next && step < lines) __builtin_prefetch(next + step * 16, 0, 1);
            const vec wv = vload(w + i * N + n0);
            for (int r = 0; r < R; ++r) acc[r] += a[r][i] * wv;
        }
        for (int r = 0; r < R; ++r) memcpy(y[r] + n0, &acc[r], sizeof acc[r]);
        if (KH == K) continue;
        for (int r = 0; r < R; ++r) acc[r] = (vec){0};     /* the second half, then y += */
        for (int64_t i = KH; i < K; ++i, ++step) {
            if (next && step < lines) __builtin_prefetch(next + step * 16, 0, 1);
            const vec wv = vload(w + i * N + n0);
            for (int r = 0; r < R; ++r) acc[r] += a[r][i] * wv;
        }
        for (int r = 0; r < R; ++r) {
            const vec first = vload(y[r] + n0) + acc[r];
            memcpy(y[r] + n0, &first, sizeof first);
        }
    }
    for (; n0 < N; ++n0)
        for (int r = 0; r < R; ++r) {
            float s = 0.0f, s2 = 0.0f;
            for (int64_t i = 0; i < KH; ++i) s += a[r][i] * w[i * N + n0];
            for (int64_t i = KH; i < K; ++i) s2 += a[r][i] * w[i * N + n0];
            y[r][n0] = KH < K ? s + s2 : s;
        }
}

/* act[r][0:I) = glu(h[r][0:I), h[r][I:2I)) for R rows (h rows 2I long, act rows I). */
static inline __attribute__((always_inline)) void gated_activation(
        const int R, float *const *h, int64_t I, float *act, int64_t kind, float beta,
        float linear_beta) {
    for (int r = 0; r < R; ++r)
        glu_span(kind, beta, linear_beta, h[r], h[r] + I, act + r * I, I);
}

/* R rows of one expert: x rows -> w13 -> glu(gate, up) -> w2 -> out += slot weight * y. */
static inline __attribute__((always_inline)) void expert_rows(
        const int R, const float *x, const int64_t *token, const float *slot_w,
        const float *w13, const float *w2, int64_t H, int64_t I, float *out, float *acc,
        float *act, float *y, const float *next13, const float *next2, int64_t kind,
        float beta, float linear_beta) {
    const float *xr[MAX_ROWS], *actp[MAX_ROWS];
    float *accp[MAX_ROWS], *yp[MAX_ROWS];
    for (int r = 0; r < R; ++r) {
        xr[r] = x + token[r] * H;
        accp[r] = acc + r * 2 * I;
        actp[r] = act + r * I;
        yp[r] = y + r * H;
    }
    rows_times_matrix(R, xr, H, w13, 2 * I, accp, next13);
    gated_activation(R, accp, I, act, kind, beta, linear_beta);
    rows_times_matrix(R, actp, I, w2, H, yp, next2);
    for (int r = 0; r < R; ++r) {
        float *o = out + token[r] * H;
        const float sw = slot_w[r];
        for (int64_t h = 0; h < H; ++h) o[h] += sw * yp[r][h];
    }
}

/* The first slot in token[lo, hi) (ascending) whose token is >= t. */
static int64_t first_at_or_after(const int64_t *token, int64_t lo, int64_t hi, int64_t t) {
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (token[mid] < t) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

void moe_experts_act(int64_t t_begin, int64_t t_end, int64_t E, int64_t H, int64_t I,
                     const float *x, const int64_t *token, const int64_t *offsets,
                     const float *slot_w, const float *w13t, const float *w2t, float *out,
                     int64_t act_kind, float beta, float linear_beta) {
    float acc[MAX_ROWS * 2 * I], act[MAX_ROWS * I], y[MAX_ROWS * H];
    for (int64_t e = 0; e < E; ++e) {
        const float *w13 = w13t + e * H * 2 * I, *w2 = w2t + e * I * H;
        const int64_t begin = first_at_or_after(token, offsets[e], offsets[e + 1], t_begin);
        const int64_t end = first_at_or_after(token, begin, offsets[e + 1], t_end);
        int64_t after = e + 1;   /* the next expert with rows, its weights to prefetch */
        while (after < E && offsets[after + 1] == offsets[after]) ++after;
        for (int64_t s = begin; s < end; s += MAX_ROWS) {
            const int64_t n = end - s < MAX_ROWS ? end - s : MAX_ROWS;
            /* the first pass over this expert's weights prefetches the next one's */
            const float *n13 = after < E && s == begin ? w13t + after * H * 2 * I : 0;
            const float *n2 = after < E && s == begin ? w2t + after * I * H : 0;
#define ROWS_CASE(R)                                                                            \
    case R: expert_rows(R, x, token + s, slot_w + s, w13, w2, H, I, out, acc, act, y, n13, n2,  \
                        act_kind, beta, linear_beta);                                           \
        break;
            switch (n) {
                ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
                ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
            }
#undef ROWS_CASE
        }
    }
}

/* The SiLU entry point of before the activation selector (same arguments, same results). */
void moe_experts(int64_t t_begin, int64_t t_end, int64_t E, int64_t H, int64_t I,
                 const float *x, const int64_t *token, const int64_t *offsets,
                 const float *slot_w, const float *w13t, const float *w2t, float *out) {
    moe_experts_act(t_begin, t_end, E, H, I, x, token, offsets, slot_w, w13t, w2t, out, 0,
                    1.0f, 0.0f);
}

#include "moe_mxfp4.h"

/* Tokens [t_begin, t_end) in even parts, one per thread. */
#define TOKEN_PARTS(CALL)                                                                       \
    (void)nthreads;                                                                             \
    _Pragma("omp parallel num_threads(nthreads) if (nthreads > 1)") {                           \
        int64_t lo, hi;                                                                         \
        thread_share(t_begin, t_end, &lo, &hi);                                                 \
        CALL;                                                                                   \
    }

void moe_experts_rows(int64_t t_begin, int64_t t_end, int64_t nthreads, int64_t E, int64_t H,
                      int64_t I, const float *x, const int64_t *token, const int64_t *offsets,
                      const float *slot_w, const float *w13t, const float *w2t, float *out,
                      int64_t act_kind, float beta, float linear_beta) {
    TOKEN_PARTS(moe_experts_act(lo, hi, E, H, I, x, token, offsets, slot_w, w13t, w2t, out,
                                act_kind, beta, linear_beta))
}

void moe_experts_mxfp4_rows(int64_t t_begin, int64_t t_end, int64_t nthreads, int64_t E,
                            int64_t H, int64_t I, const float *x, const int64_t *token,
                            const int64_t *offsets, const float *slot_w,
                            const uint8_t *w13_packed, const uint8_t *w13_scale,
                            const uint8_t *w2_packed, const uint8_t *w2_scale, float *out,
                            int64_t act_kind, float beta, float linear_beta) {
    TOKEN_PARTS(moe_experts_mxfp4(lo, hi, E, H, I, x, token, offsets, slot_w, w13_packed,
                                  w13_scale, w2_packed, w2_scale, out, act_kind, beta,
                                  linear_beta))
}

/* INT8/INT4 experts (the same groups and activation, packed weights) */
#include "moe_int.h"
