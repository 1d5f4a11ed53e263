/* The MXFP4 experts of moe_cpu.c, moe_experts_mxfp4 (included there: MAX_ROWS,
 * gated_activation and first_at_or_after come from it): the same MLPs on MXFP4 weights as
 * the checkpoint stores them, read in place (no fp32 copy): w13_packed [E, 2I, H/2] (rows
 * 0..I-1 w1 = gate, I..2I-1 w3 = up; a row is one output neuron, packed along the input dim,
 * two E2M1 codes a byte, the even element in the low nibble), w13_scale [E, 2I, H/32] E8M0
 * (2^(s-127); s = 0 the subnormal 2^-127), w2_packed [E, H, I/2], w2_scale [E, H, I/32]. H
 * and I are multiples of 32.
 *
 * Each pass over an expert's weights serves up to MAX_ROWS rows: MX_NB neurons' weight rows
 * are decoded once (the group's 8 magnitudes times its scale, exact as the scale is a power of
 * two, picked by code, sign flipped by bit 3) into a small buffer and every row takes its
 * dot products with them. A dot product always runs the same way (two 8-lane accumulators,
 * alternate 8-element chunks, a fixed reduction tree), so a token's result does not depend on
 * its group mates or on how many rows a pass holds. */

#define MX_NB 4

typedef float v8f __attribute__((vector_size(8 * sizeof(float))));

static inline v8f v8load(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* fused wherever the target has it (x86-64-v3 and up; aarch64 in mx_dots below), so the dot
 * products round the same on each: the ISO C build contracts nothing by itself */
static inline v8f v8fma(v8f a, v8f b, v8f c) {
#if defined(__AVX2__) && defined(__FMA__)
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline float v8sum(v8f v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float e8m0(uint8_t s) {
    const uint32_t bits = s ? (uint32_t)s << 23 : 0x400000u;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* w[0:K) = the decoded weight row (packed K/2 bytes, K/32 scales). */
static inline void mx_decode_row(const uint8_t *q, const uint8_t *sc, int64_t K, float *w) {
#ifdef __AVX2__
    const __m256 mags = _mm256_loadu_ps(E2M1);
    const __m256i right = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i sign = _mm256_set1_epi32((int32_t)0x80000000u);
    for (int64_t g = 0; g < K / 32; ++g) {
        const __m256 lut = _mm256_mul_ps(mags, _mm256_set1_ps(e8m0(sc[g])));
        for (int c = 0; c < 4; ++c) {
            int32_t word;   /* 8 codes; code i in bits 4i..4i+3 */
            memcpy(&word, q + g * 16 + c * 4, sizeof word);
            const __m256i codes = _mm256_srlv_epi32(_mm256_set1_epi32(word), right);
            const __m256 mag = _mm256_permutevar8x32_ps(lut, codes);   /* low 3 bits */
            const __m256i neg = _mm256_and_si256(_mm256_slli_epi32(codes, 28), sign);
            _mm256_storeu_ps(w + g * 32 + c * 8, _mm256_xor_ps(mag, _mm256_castsi256_ps(neg)));
        }
    }
#else
    for (int64_t g = 0; g < K / 32; ++g) {
        const float s = e8m0(sc[g]);
        for (int i = 0; i < 16; ++i) {
            const uint8_t b = q[g * 16 + i];
            w[g * 32 + 2 * i] = E2M1[b & 15] * s;
            w[g * 32 + 2 * i + 1] = E2M1[b >> 4] * s;
        }
    }
#endif
}

/* y[b] = a . wb[b K : (b+1) K) for b < MX_NB: two 8-lane sums over alternate 8-element
 * chunks, fused steps, then (a + b) reduced as v8sum does. On aarch64 each 8-lane sum is two
 * NEON registers (GCC keeps a v8f in memory there: every step a store and a reload): the same
 * operations lane for lane, so the same bits. */
static inline void mx_dots(const float *ar, const float *wb, int64_t K, float *y) {
#if defined(__aarch64__)
    float32x4_t acc[MX_NB][4];       /* lanes 0-3, 4-7 of the first sum, then the second's */
    for (int b = 0; b < MX_NB; ++b)
        for (int h = 0; h < 4; ++h) acc[b][h] = vdupq_n_f32(0.0f);
    for (int64_t k = 0; k < K; k += 16) {
        const float32x4_t a0 = vld1q_f32(ar + k), a1 = vld1q_f32(ar + k + 4);
        const float32x4_t a2 = vld1q_f32(ar + k + 8), a3 = vld1q_f32(ar + k + 12);
        for (int b = 0; b < MX_NB; ++b) {
            const float *w = wb + b * K + k;
            acc[b][0] = vfmaq_f32(acc[b][0], a0, vld1q_f32(w));
            acc[b][1] = vfmaq_f32(acc[b][1], a1, vld1q_f32(w + 4));
            acc[b][2] = vfmaq_f32(acc[b][2], a2, vld1q_f32(w + 8));
            acc[b][3] = vfmaq_f32(acc[b][3], a3, vld1q_f32(w + 12));
        }
    }
    for (int b = 0; b < MX_NB; ++b) {
        /* t[j] = v[j] + v[j + 4] of v = first + second */
        const float32x4_t t = vaddq_f32(vaddq_f32(acc[b][0], acc[b][2]),
                                        vaddq_f32(acc[b][1], acc[b][3]));
        y[b] = (vgetq_lane_f32(t, 0) + vgetq_lane_f32(t, 2))
               + (vgetq_lane_f32(t, 1) + vgetq_lane_f32(t, 3));
    }
#else
    v8f acc[MX_NB][2];
    for (int b = 0; b < MX_NB; ++b) acc[b][0] = acc[b][1] = (v8f){0};
    for (int64_t k = 0; k < K; k += 16) {
        const v8f a0 = v8load(ar + k), a1 = v8load(ar + k + 8);
        for (int b = 0; b < MX_NB; ++b) {
            acc[b][0] = v8fma(a0, v8load(wb + b * K + k), acc[b][0]);
            acc[b][1] = v8fma(a1, v8load(wb + b * K + k + 8), acc[b][1]);
        }
    }
    for (int b = 0; b < MX_NB; ++b) y[b] = v8sum(acc[b][0] + acc[b][1]);
#endif
}

/* y[r][0:N) = W a[r] for R rows, W [N, K] MXFP4 (N % MX_NB == 0, K % 32 == 0); wb holds
 * MX_NB * K floats. */
static void mx_rows_times_matrix(int R, const float *const *a, int64_t K, const uint8_t *wq,
                                 const uint8_t *ws, int64_t N, float *const *y, float *wb) {
    for (int64_t n0 = 0; n0 < N; n0 += MX_NB) {
        for (int b = 0; b < MX_NB; ++b)
            mx_decode_row(wq + (n0 + b) * (K / 2), ws + (n0 + b) * (K / 32), K, wb + b * K);
        for (int r = 0; r < R; ++r) mx_dots(a[r], wb, K, y[r] + n0);
    }
}

void moe_experts_mxfp4(int64_t t_begin, int64_t t_end, int64_t E, int64_t H, int64_t I,
                       const float *x, const int64_t *token, const int64_t *offsets,
                       const float *slot_w, const uint8_t *w13_packed, const uint8_t *w13_scale,
                       const uint8_t *w2_packed, const uint8_t *w2_scale, float *out,
                       int64_t act_kind, float beta, float linear_beta) {
    const int64_t K = H > I ? H : I;
    float h13[MAX_ROWS * 2 * I], act[MAX_ROWS * I], y[MAX_ROWS * H], wb[MX_NB * K];
    for (int64_t e = 0; e < E; ++e) {
        const uint8_t *q13 = w13_packed + e * 2 * I * (H / 2);
        const uint8_t *s13 = w13_scale + e * 2 * I * (H / 32);
        const uint8_t *q2 = w2_packed + e * H * (I / 2), *s2 = w2_scale + e * H * (I / 32);
        const int64_t begin = first_at_or_after(token, offsets[e], offsets[e + 1], t_begin);
        const int64_t end = first_at_or_after(token, begin, offsets[e + 1], t_end);
        for (int64_t s = begin; s < end; s += MAX_ROWS) {
            const int R = (int)(end - s < MAX_ROWS ? end - s : MAX_ROWS);
            const float *xr[MAX_ROWS], *actp[MAX_ROWS];
            float *hp[MAX_ROWS], *yp[MAX_ROWS];
            for (int r = 0; r < R; ++r) {
                xr[r] = x + token[s + r] * H;
                hp[r] = h13 + r * 2 * I;
                actp[r] = act + r * I;
                yp[r] = y + r * H;
            }
            mx_rows_times_matrix(R, xr, H, q13, s13, 2 * I, hp, wb);
            gated_activation(R, hp, I, act, act_kind, beta, linear_beta);
            mx_rows_times_matrix(R, actp, I, q2, s2, H, yp, wb);
            for (int r = 0; r < R; ++r) {
                float *o = out + token[s + r] * H;
                const float sw = slot_w[s + r];
                for (int64_t h = 0; h < H; ++h) o[h] += sw * y[r * H + h];
            }
        }
    }
}
