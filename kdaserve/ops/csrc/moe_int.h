/* Routed experts on packed INT8/INT4 weights with group-wise scales, read in place (included
 * at the end of moe_cpu.c: its ragged groups, gated activation and token split; the products
 * of int_rows.h). The stacks as kdaserve/model/quantize.py keeps them: w13 packed
 * [E, 2I, rb13] (rows w1 = gate, then w3 = up) with scale/zero [E, 2I, g13]; w2 packed
 * [E, H, rb2] with scale/zero [E, H, g2]; `group` input columns per scale (capped at the row).
 * Up to MAX_ROWS slots of an expert share one pass over its bytes; a token's sums run in one
 * order whatever its group mates (int_rows.h), and its experts add in expert order. */
#include "int_rows.h"

void moe_experts_int(int64_t t_begin, int64_t t_end, int64_t E, int64_t H, int64_t I,
                     const float *x, const int64_t *token, const int64_t *offsets,
                     const float *slot_w, const uint8_t *p13, const float *s13,
                     const int8_t *z13, int64_t rb13, int64_t g13, const uint8_t *p2,
                     const float *s2, const int8_t *z2, int64_t rb2, int64_t g2,
                     int64_t group, int64_t bits, int64_t act8, float *out, int64_t act_kind,
                     float beta, float linear_beta) {
    const int64_t K = H > I ? H : I;
    float xb[MAX_ROWS * H], h13[MAX_ROWS * 2 * I], act[MAX_ROWS * I], y[MAX_ROWS * H],
        wb[QB * K];
    for (int64_t e = 0; e < E; ++e) {
        const qmat m13 = {p13 + e * 2 * I * rb13, s13 + e * 2 * I * g13,
                          z13 ? z13 + e * 2 * I * g13 : NULL, rb13, g13,
                          group < H ? group : H, bits, act8};
        const qmat m2 = {p2 + e * H * rb2, s2 + e * H * g2, z2 ? z2 + e * H * g2 : NULL, rb2,
                         g2, group < I ? group : I, bits, act8};
        const int64_t begin = first_at_or_after(token, offsets[e], offsets[e + 1], t_begin);
        const int64_t end = first_at_or_after(token, begin, offsets[e + 1], t_end);
        for (int64_t s = begin; s < end; s += MAX_ROWS) {
            const int R = (int)(end - s < MAX_ROWS ? end - s : MAX_ROWS);
            float *hp[MAX_ROWS];
            for (int r = 0; r < R; ++r) {
                memcpy(xb + r * H, x + token[s + r] * H, sizeof(float) * H);
                hp[r] = h13 + r * 2 * I;
            }
            q_rows(&m13, xb, H, h13, 2 * I, 0, 2 * I, H, R, wb);
            gated_activation(R, hp, I, act, act_kind, beta, linear_beta);
            q_rows(&m2, act, I, y, H, 0, H, I, R, wb);
            for (int r = 0; r < R; ++r) {
                float *o = out + token[s + r] * H;
                const float sw = slot_w[s + r];
                for (int64_t h = 0; h < H; ++h) o[h] += sw * y[r * H + h];
            }
        }
    }
}

void moe_experts_int_rows(int64_t t_begin, int64_t t_end, int64_t nthreads, int64_t E,
                          int64_t H, int64_t I, const float *x, const int64_t *token,
                          const int64_t *offsets, const float *slot_w, const uint8_t *p13,
                          const float *s13, const int8_t *z13, int64_t rb13, int64_t g13,
                          const uint8_t *p2, const float *s2, const int8_t *z2, int64_t rb2,
                          int64_t g2, int64_t group, int64_t bits, int64_t act8, float *out,
                          int64_t act_kind, float beta, float linear_beta) {
    TOKEN_PARTS(moe_experts_int(lo, hi, E, H, I, x, token, offsets, slot_w, p13, s13, z13,
                                rb13, g13, p2, s2, z2, rb2, g2, group, bits, act8, out,
                                act_kind, beta, linear_beta))
}
