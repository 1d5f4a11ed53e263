/* The scores of mla_attend.h's spans: each latent row's dot products with the heads' latent
 * queries, read once for all heads (included by mla_attend.h, once per weight and cache type:
 * NAME, CT, LDW8 and LDC come from its includer). */

/* The 8-lane sums below are V8_PARTS registers each (decode_cpu.c's v8p): one v8f on x86,
 * two NEON registers on aarch64, where GCC 12 keeps a v8f in memory. A part's lanes are the
 * v8f's lanes in order, and hsum8p reduces them in hsum8's tree: the same bits either way. */

/* A span's scores for a few heads (fewer than 8), each a dot product on its own:
 * s[h * stride] = scale * (q[h] . lat) for H query rows q [H, LD] and one latent row lat
 * [LD]: the latent is read once for all heads (it is shared by them: MLA is MQA in the latent
 * space). On NEON: 8 registers of sums, 2 of latent, 8 of queries, 8 of products: 26 of 32. */
static inline void NAME(mla_dots)(const float *restrict q, const CT *restrict lat,
                                    int64_t H, int64_t LD, float scale, float *restrict s,
                                    int64_t stride) {
    const int64_t L8 = LD - LD % 8;
    int64_t h = 0;
    for (; h + 4 <= H; h += 4) {
        const float *q0 = q + h * LD, *q1 = q0 + LD, *q2 = q1 + LD, *q3 = q2 + LD;
        v8p a0[V8_PARTS] = {0}, a1[V8_PARTS] = {0}, a2[V8_PARTS] = {0}, a3[V8_PARTS] = {0};
        for (int64_t i = 0; i < L8; i += 8)
            for (int p = 0; p < V8_PARTS; ++p) {
                const int64_t at = i + V8_LANES * p;
                const v8p v = LDW8P(lat + at);
                a0[p] += ld8p(q0 + at) * v; a1[p] += ld8p(q1 + at) * v;
                a2[p] += ld8p(q2 + at) * v; a3[p] += ld8p(q3 + at) * v;
            }
        float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
        for (int64_t i = L8; i < LD; ++i) {
            const float v = LDC(lat[i]);
            t0 += q0[i] * v; t1 += q1[i] * v; t2 += q2[i] * v; t3 += q3[i] * v;
        }
        s[h * stride] = scale * (hsum8p(a0) + t0);
        s[(h + 1) * stride] = scale * (hsum8p(a1) + t1);
        s[(h + 2) * stride] = scale * (hsum8p(a2) + t2);
        s[(h + 3) * stride] = scale * (hsum8p(a3) + t3);
    }
    for (; h < H; ++h) {
        const float *q0 = q + h * LD;
        v8p a0[V8_PARTS] = {0};
        for (int64_t i = 0; i < L8; i += 8)
            for (int p = 0; p < V8_PARTS; ++p)
                a0[p] += ld8p(q0 + i + V8_LANES * p) * LDW8P(lat + i + V8_LANES * p);
        float t0 = 0.0f;
        for (int64_t i = L8; i < LD; ++i) t0 += q0[i] * LDC(lat[i]);
        s[h * stride] = scale * (hsum8p(a0) + t0);
    }
}

/* mla_dots for two consecutive latent rows (lat, lat + LD), the second's scores `next` on:
 * each query vector is loaded once for both (eight independent sums per group of four
 * heads). On NEON that would be 16 registers of sums, 16 of unfused products, 4 of latents
 * and 8 of queries, 44 of 32: there it is mla_dots twice (the same sums). */
static inline void NAME(mla_dots2)(const float *restrict q, const CT *restrict lat,
                                   int64_t H, int64_t LD, float scale, float *restrict s,
                                   int64_t stride, int64_t next) {
    const int64_t L8 = LD - LD % 8;
    if (L8 != LD || H % 4 || V8_PARTS > 1) {
        NAME(mla_dots)(q, lat, H, LD, scale, s, stride);
        NAME(mla_dots)(q, lat + LD, H, LD, scale, s + next, stride);
        return;
    }
    const CT *lb = lat + LD;
    for (int64_t h = 0; h < H; h += 4) {
        const float *q0 = q + h * LD, *q1 = q0 + LD, *q2 = q1 + LD, *q3 = q2 + LD;
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        for (int64_t i = 0; i < LD; i += 8) {
            const v8f v = LDW8(lat + i), w = LDW8(lb + i);
            const v8f x0 = ld8f(q0 + i), x1 = ld8f(q1 + i), x2 = ld8f(q2 + i),
                      x3 = ld8f(q3 + i);
            a0 += x0 * v; a1 += x1 * v; a2 += x2 * v; a3 += x3 * v;
            b0 += x0 * w; b1 += x1 * w; b2 += x2 * w; b3 += x3 * w;
        }
        float *sh = s + h * stride;
        sh[0] = scale * hsum8(a0); sh[stride] = scale * hsum8(a1);
        sh[2 * stride] = scale * hsum8(a2); sh[3 * stride] = scale * hsum8(a3);
        sh[next] = scale * hsum8(b0); sh[stride + next] = scale * hsum8(b1);
        sh[2 * stride + next] = scale * hsum8(b2); sh[3 * stride + next] = scale * hsum8(b3);
    }
}

/* A span's scores with the heads as the lanes: s[j * HP + h] = scale * (q[h] . lat_j) for
 * latent rows lat_j = lat + j * LD, j < n, from the queries transposed, qt [LD, HP] (HP = H
 * rounded up to 16, the padding zero). Each head's sum runs over the latent's columns in
 * order, one fused multiply-add a column (vfmas; no horizontal sums, whose shuffles cost as
 * much as the products did); four positions a pass share each column's query load, and each
 * latent value multiplies 16 heads at once (VREGS16 registers of VREG_LANES lanes). Lane for
 * lane the same operations on every ISA. With fewer than 8 heads most lanes would be
 * padding, and each head's own dot product (mla_dots: eight partial sums and a tree) ran
 * 1.5x faster for the demos' 4 heads. */
static inline void NAME(mla_scores16)(const float *restrict qt, const CT *restrict lat,
                                      int64_t n, int64_t HP, int64_t LD, float scale,
                                      float *restrict s) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const CT *l0 = lat + j * LD, *l1 = l0 + LD, *l2 = l1 + LD, *l3 = l2 + LD;
        for (int64_t h = 0; h < HP; h += 16) {
            vregf a0[VREGS16] = {0}, a1[VREGS16] = {0}, a2[VREGS16] = {0}, a3[VREGS16] = {0};
            for (int64_t i = 0; i < LD; ++i) {
                const float *qi = qt + i * HP + h;
                const float b0 = LDC(l0[i]), b1 = LDC(l1[i]), b2 = LDC(l2[i]), b3 = LDC(l3[i]);
                for (int r = 0; r < VREGS16; ++r) {
                    const vregf qv = ldvf(qi + VREG_LANES * r);
                    a0[r] = vfmas(a0[r], qv, b0); a1[r] = vfmas(a1[r], qv, b1);
                    a2[r] = vfmas(a2[r], qv, b2); a3[r] = vfmas(a3[r], qv, b3);
                }
            }
            for (int r = 0; r < VREGS16; ++r) {
                float *sj = s + j * HP + h + VREG_LANES * r;
                stvf(sj, a0[r] * scale); stvf(sj + HP, a1[r] * scale);
                stvf(sj + 2 * HP, a2[r] * scale); stvf(sj + 3 * HP, a3[r] * scale);
            }
        }
    }
    for (; j < n; ++j) {
        const CT *l0 = lat + j * LD;
        for (int64_t h = 0; h < HP; h += 16) {
            vregf a0[VREGS16] = {0};
            for (int64_t i = 0; i < LD; ++i)
                for (int r = 0; r < VREGS16; ++r)
                    a0[r] = vfmas(a0[r], ldvf(qt + i * HP + h + VREG_LANES * r), LDC(l0[i]));
            for (int r = 0; r < VREGS16; ++r)
                stvf(s + j * HP + h + VREG_LANES * r, a0[r] * scale);
        }
    }
}
