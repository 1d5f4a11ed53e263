/* The fused decode blocks of decode_cpu.c, written once for a weight type WT and a cache
 * element type CT (LDW / LDC read one as a float, STC rounds a float into CT); decode_cpu.c
 * includes this file once per type pair, NAME() giving each copy its suffix. Activations and
 * accumulation are fp32 whatever the weights are. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define NAME(f) CAT(f, SFX)

/* Y[b, n] = W[n, :] . X[b, :] for b < B: W [N, K] row-major, X rows ldx apart, Y rows ldy
 * apart. Tiles of four weight rows by four input rows (then two, then one), eight lanes per
 * vector (GCC/Clang vector extensions: the compiler's own vectorisation of the scalar form ran
 * at a fifth of this), so each weight row is read from memory once per step for all B rows. Every (b, n) sums lane l
 * over i = l, l+8, ..., then the tail, then the lanes in order: the same order for any B and
 * for one row, so a row's result does not depend on its batch. */
static void NAME(matmat)(const WT *restrict W, const float *restrict X, int64_t ldx,
                         float *restrict Y, int64_t ldy, int64_t N, int64_t K, int64_t B) {
    const int64_t K8 = K - K % 8, N4 = N - N % 4;
#pragma omp parallel for schedule(static) if (N4 * K * B >= PAR_MIN_MACS)
    for (int64_t n = 0; n < N4; n += 4) {
        const WT *w0 = W + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        int64_t b = 0;
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
        for (; b < B; ++b) {
            const float *x0 = X + b * ldx;
            v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t i = 0; i < K8; i += 8) {
                const v8f xa = ld8f(x0 + i);
                a0 += LDW8(w0 + i) * xa; a1 += LDW8(w1 + i) * xa;
                a2 += LDW8(w2 + i) * xa; a3 += LDW8(w3 + i) * xa;
            }
            float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
            for (int64_t i = K8; i < K; ++i) {
                t0 += LDW(w0[i]) * x0[i]; t1 += LDW(w1[i]) * x0[i];
                t2 += LDW(w2[i]) * x0[i]; t3 += LDW(w3[i]) * x0[i];
            }
            float *y0 = Y + b * ldy + n;
            y0[0] = lanes_sum(a0, t0); y0[1] = lanes_sum(a1, t1);
            y0[2] = lanes_sum(a2, t2); y0[3] = lanes_sum(a3, t3);
        }
    }
    for (int64_t n = N4; n < N; ++n) {
        const WT *w = W + n * K;
        for (int64_t b = 0; b < B; ++b) {
            const float *x0 = X + b * ldx;
            v8f a = {0};
            for (int64_t i = 0; i < K8; i += 8) a += LDW8(w + i) * ld8f(x0 + i);
            float t = 0.0f;
            for (int64_t i = K8; i < K; ++i) t += LDW(w[i]) * x0[i];
            Y[b * ldy + n] = lanes_sum(a, t);
        }
    }
}

/* y[n] = W[n, :] . x for W [N, K] row-major (one row of matmat). */
static void NAME(matvec)(const WT *restrict W, const float *restrict x, float *restrict y,
                         int64_t N, int64_t K) {
    NAME(matmat)(W, x, K, y, N, N, K, 1);
}

/* y[0:N) = x . W for W [K, N] row-major (the transposed expert layouts). */
static void NAME(vecmat)(const float *restrict x, const WT *restrict W, float *restrict y,
                         int64_t K, int64_t N) {
    for (int64_t n = 0; n < N; ++n) y[n] = 0.0f;
    for (int64_t i = 0; i < K; ++i) {
        const float xi = x[i];
        const WT *w = W + i * N;
        for (int64_t n = 0; n < N; ++n) y[n] += xi * LDW(w[n]);
    }
}

/* vecmat for B rows (X [B, K] rows ldx apart, Y [B, N] contiguous): weight row i is read once
 * for all rows (widened into wbuf [N]); each row sums over i in vecmat's order. */
static void NAME(vecmat_rows)(const float *restrict X, int64_t ldx, const WT *restrict W,
                              float *restrict Y, int64_t K, int64_t N, int64_t B,
                              float *restrict wbuf) {
    if (B == 1) {
        NAME(vecmat)(X, W, Y, K, N);
        return;
    }
    for (int64_t j = 0; j < B * N; ++j) Y[j] = 0.0f;
    for (int64_t i = 0; i < K; ++i) {
#if WIDEN
        for (int64_t n = 0; n < N; ++n) wbuf[n] = LDW(W[i * N + n]);
        const float *w = wbuf;
#else
        const float *w = W + i * N;
#endif
        for (int64_t b = 0; b < B; ++b) {
            const float xi = X[b * ldx + i];
            float *y = Y + b * N;
            for (int64_t n = 0; n < N; ++n) y[n] += xi * w[n];
        }
    }
}

/* Row norms of B rows of x [B, Hd] into h [B, Hd]. */
static void NAME(norm_rows)(const float *x, const float *w, float eps, int64_t Hd, int64_t B,
                            float *h) {
    for (int64_t b = 0; b < B; ++b) rms_norm(x + b * Hd, w, eps, Hd, h + b * Hd);
}

/* What one (row, head) of a KDA block reads and writes (kda_decode_block). */
struct NAME(kda_heads) {
    int64_t H, D, G, P, C, HD;
    const float *pre;
    float *conv, *gdec, *gate, *o, *state_store;
    const int64_t *slots;
    const float *dt_bias, *a;
    float lower_bound;
    int64_t use_bound;
    const float *o_norm_w;
    float o_eps, q_scale;
};

/* One head of one row: q/k norms, decay, the delta-rule step on the slot's state, the gated
 * output norm. Heads are independent; rows too unless they share a slot. */
static void NAME(kda_head)(const struct NAME(kda_heads) *st, int64_t b, int64_t hh) {
    const int64_t D = st->D, HD = st->HD;
    float kv[D], delta[D], decay[D];
    float *cb = st->conv + b * st->C;
    const float *braw = st->pre + b * st->P + st->C + D + st->G;
    float *qh = cb + hh * D, *kh = cb + HD + hh * D;
    const float *vh = cb + 2 * HD + hh * D;
    const float nq = st->q_scale / sqrtf(sumsq(qh, D) + 1e-6f);
    const float nk = 1.0f / sqrtf(sumsq(kh, D) + 1e-6f);
    for (int64_t d = 0; d < D; ++d) {
        qh[d] *= nq;
        kh[d] *= nk;
    }
    const float ah = st->a[hh];
    float *gh = st->gdec + b * HD + hh * D;
    const float *bias = st->dt_bias + hh * D;
    if (st->use_bound)
        for (int64_t d = 0; d < D; ++d) gh[d] = st->lower_bound * sigmoid(ah * (gh[d] + bias[d]));
    else
        for (int64_t d = 0; d < D; ++d) gh[d] = -ah * softplus_f(gh[d] + bias[d]);
    const float bt = sigmoid(braw[hh]);
    float *S = st->state_store + (st->slots[b] * st->H + hh) * D * D;
    float *out = st->o + b * HD + hh * D;
    kda_step(S, qh, kh, vh, gh, bt, out, D, D, kv, delta, decay);
    /* gated RMSNorm per head */
    const float r = 1.0f / sqrtf(sumsq(out, D) / (float)D + st->o_eps);
    const float *gt = st->gate + b * HD + hh * D;
    for (int64_t d = 0; d < D; ++d)
        out[d] = st->o_norm_w[d] * (out[d] * r) * sigmoid(gt[d]);
}

/* One KDA token mixer for B decode rows. w_in [P, Hd] stacks q | k | v (3HD rows), f_a (D),
 * the gate input (G = D low-rank or HD full-rank) and b (H). conv_store [S, W, 3HD] and
 * state_store [S, H, D, D] are the engine's slots (updated in place at slots[b]); conv_wt
 * [W+1, 3HD]; f_b [HD, D]; g_b [HD, D] or NULL (full-rank gate: the gate input is the gate);
 * o_norm_w [D]; o_proj [Hd, HD]. The projections run for all rows at once (weights read once
 * per step), the conv and recurrence row by row, in row order: rows may share a slot (a token
 * and its drafts, at consecutive positions), each continuing the state the row before left.
 * kept_states [B, H, D, D] and kept_conv [B, W, 3HD], or NULL: the slot's state and window
 * after each row (what a rejected draft rolls back to). scratch: at least
 * B (2Hd + P + 3HD + 3HD) + 3D + 4 max(Hd, HD, D) floats. */
void NAME(kda_decode_block)(int64_t B, int64_t Hd, int64_t H, int64_t D, int64_t G, int64_t taps,
                      float *x, const float *xin, const float *norm_w, float eps,
                      const WT *w_in, CT *conv_store, float *state_store, const int64_t *slots,
                      const float *conv_wt, const WT *f_b, const float *dt_bias,
                      const float *a, float lower_bound, int64_t use_bound, const WT *g_b,
                      const float *o_norm_w, float o_eps, const WT *o_proj, float q_scale,
                      float *scratch, float *kept_states, CT *kept_conv) {
    const int64_t HD = H * D, C = 3 * HD, W = taps - 1, P = C + D + G + H;
    float *h = scratch;             /* [B, Hd] */
    float *pre = h + B * Hd;        /* [B, P] */
    float *conv = pre + B * P;      /* [B, C] */
    float *gdec = conv + B * C;     /* [B, HD] */
    float *gate = gdec + B * HD;    /* [B, HD] */
    float *o = gate + B * HD;       /* [B, HD] */
    float *y = o + B * HD;          /* [B, Hd] */
    /* rows may run in parallel unless two share a slot (a token and its drafts) */
    int distinct = 1;
    for (int64_t b = 1; b < B && distinct; ++b)
        for (int64_t c = 0; c < b; ++c)
            if (slots[b] == slots[c]) { distinct = 0; break; }
    NAME(norm_rows)(xin, norm_w, eps, Hd, B, h);
    NAME(matmat)(w_in, h, Hd, pre, P, P, Hd, B);
#pragma omp parallel for schedule(static) if (distinct && B > 1)
    for (int64_t b = 0; b < B; ++b) {
        /* causal depthwise conv over the slot's window, then the window moves on */
        const float *pb = pre + b * P;
        float *cb = conv + b * C;
        CT *win = conv_store + slots[b] * W * C;
        const float *wl = conv_wt + W * C;
        for (int64_t c = 0; c < C; ++c) cb[c] = 0.0f;
        for (int64_t j = 0; j < W; ++j) {
            const CT *in = win + j * C;
            const float *wj = conv_wt + j * C;
            for (int64_t c = 0; c < C; ++c) cb[c] += LDC(in[c]) * wj[c];
        }
        for (int64_t c = 0; c < C; ++c) cb[c] = silu(cb[c] + pb[c] * wl[c]);
        if (W > 0) {
            memmove(win, win + C, sizeof(CT) * (W - 1) * C);
            CT *last = win + (W - 1) * C;
            for (int64_t c = 0; c < C; ++c) last[c] = STC(pb[c]);
        }
        if (kept_conv) memcpy(kept_conv + b * W * C, win, sizeof(CT) * W * C);
    }
    NAME(matmat)(f_b, pre + C, P, gdec, HD, HD, D, B);           /* f_a rows */
    if (g_b) NAME(matmat)(g_b, pre + C + D, P, gate, HD, HD, D, B);
    else
        for (int64_t b = 0; b < B; ++b) memcpy(gate + b * HD, pre + b * P + C + D, sizeof(float) * HD);
    const struct NAME(kda_heads) st = {H, D, G, P, C, HD, pre, conv, gdec, gate, o, state_store,
                                       slots, dt_bias, a, lower_bound, use_bound, o_norm_w,
                                       o_eps, q_scale};
    const size_t state_bytes = sizeof(float) * (size_t)(H * D * D);
    if (distinct) {
#pragma omp parallel for collapse(2) schedule(static) if (B * H > 1)
        for (int64_t b = 0; b < B; ++b)
            for (int64_t hh = 0; hh < H; ++hh) NAME(kda_head)(&st, b, hh);
        if (kept_states)            /* one row per slot: its state after the step */
            for (int64_t b = 0; b < B; ++b)
                memcpy(kept_states + b * H * D * D, state_store + slots[b] * H * D * D,
                       state_bytes);
    } else {
        for (int64_t b = 0; b < B; ++b) {     /* in row order: each continues the last */
#pragma omp parallel for schedule(static) if (H > 1)
            for (int64_t hh = 0; hh < H; ++hh) NAME(kda_head)(&st, b, hh);
            if (kept_states)
                memcpy(kept_states + b * H * D * D, state_store + slots[b] * H * D * D,
                       state_bytes);
        }
    }
    NAME(matmat)(o_proj, o, HD, y, Hd, Hd, HD, B);
    for (int64_t i = 0; i < B * Hd; ++i) x[i] += y[i];
}

#include "mla_attend.h"

/* One MLA token mixer (no rope) for B decode rows, absorbed: the queries move into the latent
 * space and attend over the cached latents of their pages. Queries: w_q [H(N+R), Hd], or with
 * a query LoRA (w_qa [Qr, Hd] not NULL, qa_norm_w [Qr]) w_q = q_b [H(N+R), Qr] applied to
 * norm(w_qa h). w_kva [Dc+R, Hd]; kv_norm_w [Dc]; kv_b [H(N+Vd), Dc]; pages [NB*bs, Dc+R]
 * (the new latent is written at its slot first); block_table [B, width]; positions [B];
 * g_proj [H*Vd, Hd] or NULL (K3's output gate: o *= sigmoid(g_proj h)); o_proj [Hd, H*Vd].
 * scratch: at least B (2Hd + H(N+R) + Dc+R + 2 H*Vd + Qr) + H*Dc + Dc+R + 4 max(Hd, H*Vd)
 * floats. */
void NAME(mla_decode_block)(int64_t B, int64_t Hd, int64_t H, int64_t N, int64_t R, int64_t Dc,
                      int64_t Vd, float *x, const float *xin, const float *norm_w, float eps,
                      const WT *w_qa, const float *qa_norm_w, float qa_eps, int64_t Qr,
                      const WT *w_q, const WT *w_kva, const float *kv_norm_w, float kv_eps,
                      const WT *kv_b, CT *pages, int64_t bs, const int64_t *block_table,
                      int64_t width, const int64_t *positions, const WT *g_proj,
                      const WT *o_proj, float scale, float *scratch) {
    const int64_t QD = N + R, LD = Dc + R;
    float *h = scratch, *q = h + B * Hd, *ckv = q + B * H * QD, *o = ckv + B * LD;
    float *y = o + B * H * Vd, *qa = y + B * Hd, *gate = qa + B * Qr;
    NAME(norm_rows)(xin, norm_w, eps, Hd, B, h);
    if (w_qa) {
        NAME(matmat)(w_qa, h, Hd, qa, Qr, Qr, Hd, B);
        for (int64_t b = 0; b < B; ++b) rms_norm(qa + b * Qr, qa_norm_w, qa_eps, Qr, qa + b * Qr);
        NAME(matmat)(w_q, qa, Qr, q, H * QD, H * QD, Qr, B);
    } else {
        NAME(matmat)(w_q, h, Hd, q, H * QD, H * QD, Hd, B);
    }
    NAME(matmat)(w_kva, h, Hd, ckv, LD, LD, Hd, B);
    /* every row's latent first: then each row attends (a row sharing its pages with later
     * rows, a token before its drafts, reads only positions up to its own) */
    for (int64_t b = 0; b < B; ++b) {
        const int64_t pos = positions[b];
        const int64_t *bt = block_table + b * width;
        float *cb = ckv + b * LD;
        CT *dst = pages + (bt[pos / bs] * bs + pos % bs) * LD;
        rms_norm(cb, kv_norm_w, kv_eps, Dc, cb);
        for (int64_t i = 0; i < LD; ++i) dst[i] = STC(cb[i]);
    }
    NAME(mla_attend_rows)(B, H, N, R, Dc, Vd, q, kv_b, pages, bs, block_table, width,
                          positions, scale, o);
    if (g_proj) {
        NAME(matmat)(g_proj, h, Hd, gate, H * Vd, H * Vd, Hd, B);
        for (int64_t i = 0; i < B * H * Vd; ++i) o[i] *= sigmoid(gate[i]);
    }
    NAME(matmat)(o_proj, o, H * Vd, y, Hd, Hd, H * Vd, B);
    for (int64_t i = 0; i < B * Hd; ++i) x[i] += y[i];
}

/* A gated MLP on B rows of h [B, Hd] (gate [I, Hd], up [I, Hd], down [Hd, I]; activation
 * `act` as glu_span) added into y [B, Hd]. tmp: at least B (2I + Hd) + 4 max(Hd, I) floats. */
static void NAME(glu_add)(const float *h, const WT *gate, const WT *up, const WT *down,
                       int64_t Hd, int64_t I, int64_t B, float *y, float *tmp, int64_t act,
                       float beta, float lbeta) {
    float *g = tmp, *u = g + B * I, *d = u + B * I;
    NAME(matmat)(gate, h, Hd, g, I, I, Hd, B);
    NAME(matmat)(up, h, Hd, u, I, I, Hd, B);
    glu_span(act, beta, lbeta, g, u, g, B * I);
    NAME(matmat)(down, g, I, d, Hd, Hd, I, B);
    for (int64_t i = 0; i < B * Hd; ++i) y[i] += d[i];
}

/* A dense gated feed-forward for B rows: x += down(glu(gate h, up h)), h = norm(xin) (xin is
 * x itself, or K3's attention-residual mix of the sources). scratch: at least
 * B (3Hd + 2I) + 4 max(Hd, I) floats. */
void NAME(mlp_decode_block)(int64_t B, int64_t Hd, int64_t I, float *x, const float *xin,
                      const float *norm_w, float eps, const WT *gate, const WT *up,
                      const WT *down, int64_t act, float beta, float lbeta, float *scratch) {
    float *h = scratch, *y = h + B * Hd, *tmp = y + B * Hd;
    NAME(norm_rows)(xin, norm_w, eps, Hd, B, h);
    for (int64_t i = 0; i < B * Hd; ++i) y[i] = 0.0f;
    NAME(glu_add)(h, gate, up, down, Hd, I, B, y, tmp, act, beta, lbeta);
    for (int64_t i = 0; i < B * Hd; ++i) x[i] += y[i];
}

/* A sparse MoE feed-forward for B rows: sigmoid router over E experts with a selection-only
 * bias, top-k (ties to the lower id), optional renormalisation, routed scaling; gated experts
 * (activation `act` as glu_span) w13 [E, 2I, Wd] (gate | up), w2 [E, Wd, I], or with
 * `transposed` stored as [E, Wd, 2I] and [E, I, Wd] (the CPU layout,
 * SparseMoE.transpose_expert_storage); shared (sh_gate/sh_up [Is, Hd], sh_down [Hd, Is]) or
 * NULL. Latent experts (K3; lat_down [Wd, Hd] not NULL): the router and the shared experts
 * read h = norm(xin), the routed experts z = lat_down h, and their weighted sum goes through
 * norm(lat_norm_w, or none when NULL) and lat_up [Hd, Wd]; otherwise Wd = Hd and z = h.
 * Each expert runs once for every (row, top-k slot) that chose it, its weights read once per
 * step; then each row adds its experts' outputs in its top-k order, as the one-row form does
 * (the sums round the same whatever B). scratch: at least
 * B (2Hd + E + 2K + 2Wd + K (Wd + 3I) + 2Is + Hd) + E + 4 max(Hd, 2I, Is) floats. */
void NAME(moe_decode_block)(int64_t B, int64_t Hd, int64_t E, int64_t I, int64_t K, float *x,
                      const float *xin, const float *norm_w, float eps, const float *router,
                      const float *bias, int64_t renormalize, float scaling, const WT *w13,
                      const WT *w2, int64_t transposed,
                      const WT *sh_gate, const WT *sh_up, const WT *sh_down,
                      int64_t Is, int64_t act, float beta, float lbeta, int64_t Wd,
                      const WT *lat_down, const float *lat_norm_w, float lat_eps,
                      const WT *lat_up, float *scratch) {
    const int64_t S = B * K;                          /* (row, slot) pairs */
    float *h = scratch, *y = h + B * Hd, *score = y + B * Hd, *choice = score + B * E;
    float *wts = choice + E;                          /* [S] */
    float *idf = wts + S;                             /* [S] expert ids (floats: exact) */
    float *z = idf + S;                               /* [B, Wd] the experts' input */
    float *sum = z + B * Wd;                          /* [B, Wd] each row's weighted sum */
    float *de = sum + B * Wd;                         /* [S, Wd] each slot's expert output */
    float *tmp = de + S * Wd;                         /* glu_add's scratch */
    NAME(norm_rows)(xin, norm_w, eps, Hd, B, h);
    matmat_f32(router, h, Hd, score, E, E, Hd, B);   /* the router stays fp32 */
    for (int64_t b = 0; b < B; ++b) {
        float *sb = score + b * E;
        for (int64_t e = 0; e < E; ++e) {
            sb[e] = 1.0f / (1.0f + expf(-sb[e]));
            choice[e] = sb[e] + bias[e];
        }
        float total = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e)
                if (choice[e] != -INFINITY && (best < 0 || choice[e] > choice[best])) best = e;
            idf[b * K + k] = (float)best;
            wts[b * K + k] = sb[best];
            choice[best] = -INFINITY;
            total += wts[b * K + k];
        }
        for (int64_t k = 0; k < K; ++k)
            wts[b * K + k] = (renormalize ? wts[b * K + k] / (total + 1e-20f) : wts[b * K + k])
                             * scaling;
    }
    if (lat_down) NAME(matmat)(lat_down, h, Hd, z, Wd, Wd, Hd, B);
    else memcpy(z, h, sizeof(float) * (size_t)(B * Hd));
    /* experts in parallel, each with buffers of its own for the rows that chose it */
#pragma omp parallel for schedule(dynamic) if (S > 1)
    for (int64_t e = 0; e < E; ++e) {
        int64_t slot[S];
        int64_t n = 0;
        for (int64_t s = 0; s < S; ++s)
            if ((int64_t)idf[s] == e) slot[n++] = s;
        if (!n) continue;
        float *xe = malloc(sizeof(float) * (size_t)(n * (Wd + 3 * I) + 2 * I + Wd));
        float *gu = xe + n * Wd, *a = gu + n * 2 * I, *wbuf = a + n * I;
        for (int64_t r = 0; r < n; ++r)
            memcpy(xe + r * Wd, z + (slot[r] / K) * Wd, sizeof(float) * Wd);
        if (transposed) NAME(vecmat_rows)(xe, Wd, w13 + e * Wd * 2 * I, gu, Wd, 2 * I, n, wbuf);
        else NAME(matmat)(w13 + e * 2 * I * Wd, xe, Wd, gu, 2 * I, 2 * I, Wd, n);
        for (int64_t r = 0; r < n; ++r)
            glu_span(act, beta, lbeta, gu + r * 2 * I, gu + r * 2 * I + I, a + r * I, I);
        /* outputs land at their (row, slot) place in de [S, Wd] */
        float *out = xe;                             /* xe is free again: [n, Wd] */
        if (transposed) NAME(vecmat_rows)(a, I, w2 + e * I * Wd, out, I, Wd, n, wbuf);
        else NAME(matmat)(w2 + e * Wd * I, a, I, out, Wd, Wd, I, n);
        for (int64_t r = 0; r < n; ++r) memcpy(de + slot[r] * Wd, out + r * Wd, sizeof(float) * Wd);
        free(xe);
    }
    for (int64_t b = 0; b < B; ++b) {
        float *sb = sum + b * Wd;
        for (int64_t i = 0; i < Wd; ++i) sb[i] = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
            const float wk = wts[b * K + k];
            const float *d = de + (b * K + k) * Wd;
            for (int64_t i = 0; i < Wd; ++i) sb[i] += wk * d[i];
        }
    }
    if (lat_down) {
        if (lat_norm_w)
            for (int64_t b = 0; b < B; ++b)
                rms_norm(sum + b * Wd, lat_norm_w, lat_eps, Wd, sum + b * Wd);
        NAME(matmat)(lat_up, sum, Wd, y, Hd, Hd, Wd, B);
    } else {
        memcpy(y, sum, sizeof(float) * (size_t)(B * Hd));
    }
    if (sh_gate) NAME(glu_add)(h, sh_gate, sh_up, sh_down, Hd, Is, B, y, tmp, act, beta, lbeta);
    for (int64_t i = 0; i < B * Hd; ++i) x[i] += y[i];
}

/* The final norm and the LM head for B rows: logits [B, V] = W [V, Hd] . norm(x).
 * scratch: at least B Hd + 4 Hd floats. */
void NAME(head_block)(int64_t B, int64_t Hd, int64_t V, const float *x, const float *norm_w,
                      float eps, const WT *W, float *logits, float *scratch) {
    NAME(norm_rows)(x, norm_w, eps, Hd, B, scratch);
    NAME(matmat)(W, scratch, Hd, logits, V, V, Hd, B);
}

#undef CAT_
#undef CAT
#undef NAME
/* the includer's type parameters end with this copy */
#undef WT
#undef CT
#undef LDW
#undef LDC
#undef STC
#undef SFX
#undef WIDEN
#undef LDW8
