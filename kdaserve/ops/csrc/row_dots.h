/* The dot-product form of row_products.h (included there, once per weight type: WT, LDW,
 * LDW8, LDW8P and NAME() come from the includer): weights as the model keeps them, [N, K]
 * row-major, each output a weight row's dot product with an input row. The blocks' router
 * (matmat_f32, in every copy), their MoE experts not stored transposed, and MLA's absorbed
 * kv_b (mla_attend.h: matvec, vecmat) take it. */

/* Y[b, n] = W[n, :] . X[b, :] for b < B: W [N, K] row-major, X rows ldx apart, Y rows ldy
 * apart. Tiles of four weight rows by four input rows (then two, then one), eight lanes per
 * vector (GCC/Clang vector extensions: the compiler's own vectorisation of the scalar form ran
 * at a fifth of this), so each weight row is read from memory once per step for all B rows.
 * Every (b, n) sums lane l over i = l, l+8, ..., then the tail, then the lanes in order: the
 * same order for any B and for one row, so a row's result does not depend on its batch.
 * On aarch64 each 8-lane sum is two NEON registers (decode_cpu.c's v8p; GCC keeps a v8f in
 * memory there) and rows go one at a time: four weight rows' sums (8), weights (8), products
 * (8) and the input (2) fit the 32 registers, a second row's would not. */
static inline void NAME(matmat_quad)(const WT *restrict W, const float *restrict X,
                                     int64_t ldx, float *restrict Y, int64_t ldy, int64_t K,
                                     int64_t B, int64_t n) {
    const int64_t K8 = K - K % 8;
    {
        const WT *w0 = W + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        int64_t b = 0;
#if V8_PARTS == 1
        /* four input rows at a time: 16 accumulators, 8 loads a step for 16 multiply-adds
         * (the 4 x 2 tile below spends 6 loads on 8) */
        for (; b + 4 <= B; b += 4) {
            const float *xr[4] = {X + b * ldx, X + (b + 1) * ldx, X + (b + 2) * ldx,
                                  X + (b + 3) * ldx};
            v8f acc[4][4];
#pragma GCC unroll 4
            for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
                for (int c = 0; c < 4; ++c) acc[r][c] = (v8f){0};
            for (int64_t i = 0; i < K8; i += 8) {
                const v8f v0 = LDW8(w0 + i), v1 = LDW8(w1 + i), v2 = LDW8(w2 + i),
                          v3 = LDW8(w3 + i);
#pragma GCC unroll 4
                for (int r = 0; r < 4; ++r) {
                    const v8f xv = ld8f(xr[r] + i);
                    acc[r][0] += v0 * xv; acc[r][1] += v1 * xv;
                    acc[r][2] += v2 * xv; acc[r][3] += v3 * xv;
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < 4; ++r) {
                float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
                const float *x0 = xr[r];
                for (int64_t i = K8; i < K; ++i) {
                    t0 += LDW(w0[i]) * x0[i]; t1 += LDW(w1[i]) * x0[i];
                    t2 += LDW(w2[i]) * x0[i]; t3 += LDW(w3[i]) * x0[i];
                }
                float *y0 = Y + (b + r) * ldy + n;
                y0[0] = lanes_sum(acc[r][0], t0); y0[1] = lanes_sum(acc[r][1], t1);
                y0[2] = lanes_sum(acc[r][2], t2); y0[3] = lanes_sum(acc[r][3], t3);
            }
        }
        for (; b + 2 <= B; b += 2) {
            const float *x0 = X + b * ldx, *x1 = x0 + ldx;
            v8f a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0};
            v8f a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
            for (int64_t i = 0; i < K8; i += 8) {
                const v8f xa = ld8f(x0 + i), xb = ld8f(x1 + i);
                const v8f v0 = LDW8(w0 + i), v1 = LDW8(w1 + i), v2 = LDW8(w2 + i),
                          v3 = LDW8(w3 + i);
                a00 += v0 * xa; a01 += v1 * xa; a02 += v2 * xa; a03 += v3 * xa;
                a10 += v0 * xb; a11 += v1 * xb; a12 += v2 * xb; a13 += v3 * xb;
            }
            float t00 = 0.0f, t01 = 0.0f, t02 = 0.0f, t03 = 0.0f;
            float t10 = 0.0f, t11 = 0.0f, t12 = 0.0f, t13 = 0.0f;
            for (int64_t i = K8; i < K; ++i) {
                const float u0 = LDW(w0[i]), u1 = LDW(w1[i]), u2 = LDW(w2[i]), u3 = LDW(w3[i]);
                t00 += u0 * x0[i]; t01 += u1 * x0[i]; t02 += u2 * x0[i]; t03 += u3 * x0[i];
                t10 += u0 * x1[i]; t11 += u1 * x1[i]; t12 += u2 * x1[i]; t13 += u3 * x1[i];
            }
            float *y0 = Y + b * ldy + n, *y1 = y0 + ldy;
            y0[0] = lanes_sum(a00, t00); y0[1] = lanes_sum(a01, t01);
            y0[2] = lanes_sum(a02, t02); y0[3] = lanes_sum(a03, t03);
            y1[0] = lanes_sum(a10, t10); y1[1] = lanes_sum(a11, t11);
            y1[2] = lanes_sum(a12, t12); y1[3] = lanes_sum(a13, t13);
        }
#endif
        for (; b < B; ++b) {
            const float *x0 = X + b * ldx;
            v8p a0[V8_PARTS] = {0}, a1[V8_PARTS] = {0}, a2[V8_PARTS] = {0}, a3[V8_PARTS] = {0};
            for (int64_t i = 0; i < K8; i += 8)
                for (int p = 0; p < V8_PARTS; ++p) {
                    const int64_t at = i + V8_LANES * p;
                    const v8p xa = ld8p(x0 + at);
                    a0[p] += LDW8P(w0 + at) * xa; a1[p] += LDW8P(w1 + at) * xa;
                    a2[p] += LDW8P(w2 + at) * xa; a3[p] += LDW8P(w3 + at) * xa;
                }
            float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
            for (int64_t i = K8; i < K; ++i) {
                t0 += LDW(w0[i]) * x0[i]; t1 += LDW(w1[i]) * x0[i];
                t2 += LDW(w2[i]) * x0[i]; t3 += LDW(w3[i]) * x0[i];
            }
            float *y0 = Y + b * ldy + n;
            y0[0] = lanes_sum8p(a0, t0); y0[1] = lanes_sum8p(a1, t1);
            y0[2] = lanes_sum8p(a2, t2); y0[3] = lanes_sum8p(a3, t3);
        }
    }
}

/* Four weight rows (outputs n..n+3) at a time over the threads, then the rest. */
static void NAME(matmat)(const WT *restrict W, const float *restrict X, int64_t ldx,
                         float *restrict Y, int64_t ldy, int64_t N, int64_t K, int64_t B) {
    const int64_t K8 = K - K % 8, N4 = N - N % 4;
    PAR_FOR(N4 * K * B >= PAR_MIN_MACS && team_threads() > 1, schedule(static),
            for (int64_t n = 0; n < N4; n += 4) NAME(matmat_quad)(W, X, ldx, Y, ldy, K, B, n););
    for (int64_t n = N4; n < N; ++n) {
        const WT *w = W + n * K;
        for (int64_t b = 0; b < B; ++b) {
            const float *x0 = X + b * ldx;
            v8p a[V8_PARTS] = {0};
            for (int64_t i = 0; i < K8; i += 8)
                for (int p = 0; p < V8_PARTS; ++p)
                    a[p] += LDW8P(w + i + V8_LANES * p) * ld8p(x0 + i + V8_LANES * p);
            float t = 0.0f;
            for (int64_t i = K8; i < K; ++i) t += LDW(w[i]) * x0[i];
            Y[b * ldy + n] = lanes_sum8p(a, t);
        }
    }
}

/* y[n] = W[n, :] . x for W [N, K] row-major (one row of matmat). */
static void NAME(matvec)(const WT *restrict W, const float *restrict x, float *restrict y,
                         int64_t N, int64_t K) {
    NAME(matmat)(W, x, K, y, N, N, K, 1);
}

/* y[0:N) = x . W for W [K, N] row-major, one row (matmat_t's order, unvectorised). */
static void NAME(vecmat)(const float *restrict x, const WT *restrict W, float *restrict y,
                         int64_t K, int64_t N) {
    const int64_t KH = k_split_at(N, K, (int64_t)sizeof(WT));
    for (int64_t n = 0; n < N; ++n) y[n] = 0.0f;
    for (int64_t i = 0; i < KH; ++i) {
        const float xi = x[i];
        const WT *w = W + i * N;
        for (int64_t n = 0; n < N; ++n) y[n] += xi * LDW(w[n]);
    }
    for (int64_t n = 0; n < N && KH < K; ++n) {     /* the second half: ksplit.h */
        float s = 0.0f;
        for (int64_t i = KH; i < K; ++i) s += x[i] * LDW(W[i * N + n]);
        y[n] += s;
    }
}
