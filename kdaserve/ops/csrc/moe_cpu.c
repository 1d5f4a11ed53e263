/* Routed experts of a MoE layer over ragged groups (CPU, fp32): out[t] += w * MLP_e(x[t]) for
 * every (token, expert) slot, slots grouped by expert.
 *
 * The torch form pads every expert's group to the largest one and runs two batched matmuls;
 * with decode batches (a few rows per expert, the busiest one ~3x the mean) most of that work
 * is padding. Here each group runs at its own size, four rows at a time so every weight row
 * read serves four tokens. The weights are read transposed (w13t [E, H, 2I] = w1 | w3 per
 * expert, w2t [E, I, H]): the inner loops then run along contiguous outputs and vectorise
 * without reassociating any sum, so a token's result does not depend on its group mates.
 *
 * Layouts: x [T, H]; token [S] the token of each slot, grouped by expert; offsets [E + 1] the
 * groups' bounds in token; slot_w [S] routing weights; out [T, H] accumulated in slot order.
 */
#include <stdint.h>

#include "fastmath.h"

#define ROWS 4

void moe_experts(int64_t e_begin, int64_t e_end, int64_t H, int64_t I, const float *x,
                 const int64_t *token, const int64_t *offsets, const float *slot_w,
                 const float *w13t, const float *w2t, float *out) {
    const int64_t I2 = 2 * I;
    float acc[ROWS][I2], act[ROWS][I], y[ROWS][H];
    for (int64_t e = e_begin; e < e_end; ++e) {
        const float *w13 = w13t + e * H * I2, *w2 = w2t + e * I * H;
        for (int64_t s0 = offsets[e]; s0 < offsets[e + 1]; s0 += ROWS) {
            const int64_t nr = offsets[e + 1] - s0 < ROWS ? offsets[e + 1] - s0 : ROWS;
            const float *xr[ROWS];
            for (int64_t r = 0; r < ROWS; ++r) xr[r] = x + token[s0 + (r < nr ? r : 0)] * H;
            for (int64_t r = 0; r < ROWS; ++r)
                for (int64_t o = 0; o < I2; ++o) acc[r][o] = 0.0f;
            for (int64_t i = 0; i < H; ++i) {
                const float *wr = w13 + i * I2;
                for (int64_t r = 0; r < ROWS; ++r) {
                    const float xv = xr[r][i];
                    for (int64_t o = 0; o < I2; ++o) acc[r][o] += xv * wr[o];
                }
            }
            for (int64_t r = 0; r < ROWS; ++r)
                for (int64_t j = 0; j < I; ++j) act[r][j] = silu(acc[r][j]) * acc[r][I + j];
            for (int64_t r = 0; r < ROWS; ++r)
                for (int64_t h = 0; h < H; ++h) y[r][h] = 0.0f;
            for (int64_t j = 0; j < I; ++j) {
                const float *wr = w2 + j * H;
                for (int64_t r = 0; r < ROWS; ++r) {
                    const float av = act[r][j];
                    for (int64_t h = 0; h < H; ++h) y[r][h] += av * wr[h];
                }
            }
            for (int64_t r = 0; r < nr; ++r) {
                float *o = out + token[s0 + r] * H;
                const float w = slot_w[s0 + r];
                for (int64_t h = 0; h < H; ++h) o[h] += w * y[r][h];
            }
        }
    }
}
