/* The fused decode blocks of decode_cpu.c, written once for a weight type WT and a cache
 * element type CT (LDW / LDC read one as a float, STC rounds a float into CT); decode_cpu.c
 * includes this file once per type pair, NAME() giving each copy its suffix. Activations and
 * accumulation are fp32 whatever the weights are. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define NAME(f) CAT(f, SFX)

/* y[n] = W[n, :] . x for W [N, K] row-major: four rows at a time, eight lanes each, so
 * independent sums overlap; weights are read once, converted to fp32 in registers. */
static void NAME(matvec)(const WT *restrict W, const float *restrict x, float *restrict y,
                         int64_t N, int64_t K) {
    int64_t n = 0;
    for (; n + 4 <= N; n += 4) {
        const WT *w0 = W + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        float a0[8] = {0.0f}, a1[8] = {0.0f}, a2[8] = {0.0f}, a3[8] = {0.0f};
        int64_t i = 0;
        for (; i + 8 <= K; i += 8)
            for (int l = 0; l < 8; ++l) {
                const float xv = x[i + l];
                a0[l] += LDW(w0[i + l]) * xv;
                a1[l] += LDW(w1[i + l]) * xv;
                a2[l] += LDW(w2[i + l]) * xv;
                a3[l] += LDW(w3[i + l]) * xv;
            }
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        for (; i < K; ++i) {
            s0 += LDW(w0[i]) * x[i];
            s1 += LDW(w1[i]) * x[i];
            s2 += LDW(w2[i]) * x[i];
            s3 += LDW(w3[i]) * x[i];
        }
        for (int l = 0; l < 8; ++l) {
            s0 += a0[l];
            s1 += a1[l];
            s2 += a2[l];
            s3 += a3[l];
        }
        y[n] = s0;
        y[n + 1] = s1;
        y[n + 2] = s2;
        y[n + 3] = s3;
    }
    for (; n < N; ++n) {
        const WT *w = W + n * K;
        float lanes[8] = {0.0f};
        int64_t i = 0;
        for (; i + 8 <= K; i += 8)
            for (int l = 0; l < 8; ++l) lanes[l] += LDW(w[i + l]) * x[i + l];
        float s = 0.0f;
        for (; i < K; ++i) s += LDW(w[i]) * x[i];
        for (int l = 0; l < 8; ++l) s += lanes[l];
        y[n] = s;
    }
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

/* One KDA token mixer for B decode rows. w_in [P, Hd] stacks q | k | v (3HD rows), f_a (D),
 * the gate input (G = D low-rank or HD full-rank) and b (H). conv_store [S, W, 3HD] and
 * state_store [S, H, D, D] are the engine's slots (updated in place at slots[b]); conv_wt
 * [W+1, 3HD]; f_b [HD, D]; g_b [HD, D] or NULL (full-rank gate: the gate input is the gate);
 * o_norm_w [D]; o_proj [Hd, HD]. scratch: at least P + 5*HD + 2*D floats. */
void NAME(kda_decode_block)(int64_t B, int64_t Hd, int64_t H, int64_t D, int64_t G, int64_t taps,
                      float *x, const float *norm_w, float eps, const WT *w_in,
                      CT *conv_store, float *state_store, const int64_t *slots,
                      const float *conv_wt, const WT *f_b, const float *dt_bias,
                      const float *a, float lower_bound, int64_t use_bound, const WT *g_b,
                      const float *o_norm_w, float o_eps, const WT *o_proj, float q_scale,
                      float *scratch) {
    const int64_t HD = H * D, C = 3 * HD, W = taps - 1, P = C + D + G + H;
    float *h = scratch;             /* [Hd] */
    float *pre = h + Hd;            /* [P] */
    float *conv = pre + P;          /* [C] */
    float *gdec = conv + C;         /* [HD] */
    float *gate = gdec + HD;        /* [HD] */
    float *o = gate + HD;           /* [HD] */
    float *kv = o + HD, *delta = kv + D, *decay = delta + D;
    for (int64_t b = 0; b < B; ++b) {
        float *xb = x + b * Hd;
        rms_norm(xb, norm_w, eps, Hd, h);
        NAME(matvec)(w_in, h, pre, P, Hd);
        const float *f_a = pre + C, *g_in = pre + C + D, *braw = pre + C + D + G;
        /* causal depthwise conv over the slot's window, then the window moves on */
        CT *win = conv_store + slots[b] * W * C;
        const float *wl = conv_wt + W * C;
        for (int64_t c = 0; c < C; ++c) conv[c] = 0.0f;
        for (int64_t j = 0; j < W; ++j) {
            const CT *in = win + j * C;
            const float *wj = conv_wt + j * C;
            for (int64_t c = 0; c < C; ++c) conv[c] += LDC(in[c]) * wj[c];
        }
        for (int64_t c = 0; c < C; ++c) conv[c] = silu(conv[c] + pre[c] * wl[c]);
        if (W > 0) {
            memmove(win, win + C, sizeof(CT) * (W - 1) * C);
            CT *last = win + (W - 1) * C;
            for (int64_t c = 0; c < C; ++c) last[c] = STC(pre[c]);
        }
        NAME(matvec)(f_b, f_a, gdec, HD, D);
        if (g_b) NAME(matvec)(g_b, g_in, gate, HD, D);
        else memcpy(gate, g_in, sizeof(float) * HD);
        for (int64_t hh = 0; hh < H; ++hh) {
            float *qh = conv + hh * D, *kh = conv + HD + hh * D;
            const float *vh = conv + 2 * HD + hh * D;
            const float nq = q_scale / sqrtf(sumsq(qh, D) + 1e-6f);
            const float nk = 1.0f / sqrtf(sumsq(kh, D) + 1e-6f);
            for (int64_t d = 0; d < D; ++d) {
                qh[d] *= nq;
                kh[d] *= nk;
            }
            const float ah = a[hh];
            float *gh = gdec + hh * D;
            const float *bias = dt_bias + hh * D;
            if (use_bound)
                for (int64_t d = 0; d < D; ++d) gh[d] = lower_bound * sigmoid(ah * (gh[d] + bias[d]));
            else
                for (int64_t d = 0; d < D; ++d) gh[d] = -ah * softplus_f(gh[d] + bias[d]);
            const float bt = sigmoid(braw[hh]);
            float *S = state_store + (slots[b] * H + hh) * D * D;
            float *out = o + hh * D;
            kda_step(S, qh, kh, vh, gh, bt, out, D, D, kv, delta, decay);
            /* gated RMSNorm per head */
            const float r = 1.0f / sqrtf(sumsq(out, D) / (float)D + o_eps);
            const float *gt = gate + hh * D;
            for (int64_t d = 0; d < D; ++d)
                out[d] = o_norm_w[d] * (out[d] * r) * sigmoid(gt[d]);
        }
        NAME(matvec)(o_proj, o, h, Hd, HD);
        for (int64_t i = 0; i < Hd; ++i) xb[i] += h[i];
    }
}

/* One MLA token mixer (q_proj, no rope, no output gate) for B decode rows, absorbed: the
 * queries move into the latent space and attend over the cached latents of their pages.
 * w_q [H(N+R), Hd]; w_kva [Dc+R, Hd]; kv_norm_w [Dc]; kv_b [H(N+Vd), Dc]; pages [NB*bs, Dc+R]
 * (the new latent is written at its slot first); block_table [B, width]; positions [B];
 * o_proj [Hd, H*Vd]. scratch: at least Hd + H(N+R) + 2(Dc+R) + H*Dc + H*Vd floats. */
void NAME(mla_decode_block)(int64_t B, int64_t Hd, int64_t H, int64_t N, int64_t R, int64_t Dc,
                      int64_t Vd, float *x, const float *norm_w, float eps, const WT *w_q,
                      const WT *w_kva, const float *kv_norm_w, float kv_eps,
                      const WT *kv_b, CT *pages, int64_t bs, const int64_t *block_table,
                      int64_t width, const int64_t *positions, const WT *o_proj,
                      float scale, float *scratch) {
    const int64_t QD = N + R, LD = Dc + R;
    float *h = scratch, *q = h + Hd, *ckv = q + H * QD, *qlat = ckv + LD;
    float *ctx = qlat + H * Dc, *o = ctx + LD;   /* ctx [Dc]; o [H*Vd] */
    for (int64_t b = 0; b < B; ++b) {
        float *xb = x + b * Hd;
        const int64_t pos = positions[b], L = pos + 1;
        const int64_t *bt = block_table + b * width;
        rms_norm(xb, norm_w, eps, Hd, h);
        NAME(matvec)(w_q, h, q, H * QD, Hd);
        NAME(matvec)(w_kva, h, ckv, LD, Hd);
        CT *dst = pages + (bt[pos / bs] * bs + pos % bs) * LD;
        rms_norm(ckv, kv_norm_w, kv_eps, Dc, ckv);
        for (int64_t i = 0; i < LD; ++i) dst[i] = STC(ckv[i]);
        float *scores = malloc(sizeof(float) * (size_t)L);
        for (int64_t hh = 0; hh < H; ++hh) {
            const float *qn = q + hh * QD, *qp = qn + N;
            float *ql = qlat + hh * Dc;
            /* q_lat = q_nope . W_uk[h]  (W_uk rows of kv_b: h*(N+Vd) + n) */
            NAME(vecmat)(qn, kv_b + hh * (N + Vd) * Dc, ql, N, Dc);
            float m = -INFINITY;
            for (int64_t t = 0; t < L; ++t) {
                const CT *lat = pages + (bt[t / bs] * bs + t % bs) * LD;
                float s = 0.0f;
                float lanes[8] = {0.0f};
                int64_t i = 0;
                for (; i + 8 <= Dc; i += 8)
                    for (int l = 0; l < 8; ++l) lanes[l] += ql[i + l] * LDC(lat[i + l]);
                for (; i < Dc; ++i) s += ql[i] * LDC(lat[i]);
                for (int l = 0; l < 8; ++l) s += lanes[l];
                for (int64_t r = 0; r < R; ++r) s += qp[r] * LDC(lat[Dc + r]);
                s *= scale;
                scores[t] = s;
                m = s > m ? s : m;
            }
            float total = 0.0f;
            for (int64_t t = 0; t < L; ++t) {
                scores[t] = expf(scores[t] - m);
                total += scores[t];
            }
            const float inv = 1.0f / total;
            for (int64_t i = 0; i < Dc; ++i) ctx[i] = 0.0f;
            for (int64_t t = 0; t < L; ++t) {
                const CT *lat = pages + (bt[t / bs] * bs + t % bs) * LD;
                const float p = scores[t] * inv;
                for (int64_t i = 0; i < Dc; ++i) ctx[i] += p * LDC(lat[i]);
            }
            NAME(matvec)(kv_b + (hh * (N + Vd) + N) * Dc, ctx, o + hh * Vd, Vd, Dc);
        }
        free(scores);
        NAME(matvec)(o_proj, o, h, Hd, H * Vd);
        for (int64_t i = 0; i < Hd; ++i) xb[i] += h[i];
    }
}

/* A SwiGLU MLP on h (gate [I, Hd], up [I, Hd], down [Hd, I]) added into y. */
static void NAME(swiglu_add)(const float *h, const WT *gate, const WT *up, const WT *down,
                       int64_t Hd, int64_t I, float *y, float *tmp) {
    float *g = tmp, *u = tmp + I, *d = tmp + 2 * I;
    NAME(matvec)(gate, h, g, I, Hd);
    NAME(matvec)(up, h, u, I, Hd);
    for (int64_t j = 0; j < I; ++j) g[j] = silu(g[j]) * u[j];
    NAME(matvec)(down, g, d, Hd, I);
    for (int64_t i = 0; i < Hd; ++i) y[i] += d[i];
}

/* A dense SwiGLU feed-forward for B rows: x += down(silu(gate h) * up h), h = norm(x).
 * scratch: at least 2*Hd + 3*I floats. */
void NAME(mlp_decode_block)(int64_t B, int64_t Hd, int64_t I, float *x, const float *norm_w,
                      float eps, const WT *gate, const WT *up, const WT *down,
                      float *scratch) {
    float *h = scratch, *y = h + Hd, *tmp = y + Hd;
    for (int64_t b = 0; b < B; ++b) {
        float *xb = x + b * Hd;
        rms_norm(xb, norm_w, eps, Hd, h);
        for (int64_t i = 0; i < Hd; ++i) y[i] = 0.0f;
        NAME(swiglu_add)(h, gate, up, down, Hd, I, y, tmp);
        for (int64_t i = 0; i < Hd; ++i) xb[i] += y[i];
    }
}

/* A sparse MoE feed-forward for B rows: sigmoid router over E experts with a selection-only
 * bias, top-k (ties to the lower id), optional renormalisation, routed scaling; SiLU-GLU
 * experts w13 [E, 2I, Hd] (gate | up), w2 [E, Hd, I], or with `transposed` stored as
 * [E, Hd, 2I] and [E, I, Hd] (the CPU layout, SparseMoE.transpose_expert_storage); shared
 * (sh_gate/sh_up [Is, Hd], sh_down [Hd, Is]) or NULL. scratch: at least
 * 3*Hd + 2*E + 3*I + 3*Is floats. */
void NAME(moe_decode_block)(int64_t B, int64_t Hd, int64_t E, int64_t I, int64_t K, float *x,
                      const float *norm_w, float eps, const float *router, const float *bias,
                      int64_t renormalize, float scaling, const WT *w13, const WT *w2,
                      int64_t transposed,
                      const WT *sh_gate, const WT *sh_up, const WT *sh_down,
                      int64_t Is, float *scratch) {
    float *h = scratch, *y = h + Hd, *d = y + Hd, *score = d + Hd, *choice = score + E;
    float *gu = choice + E, *act = gu + 2 * I, *tmp = act + I;
    int64_t ids[K];
    float wts[K];
    for (int64_t b = 0; b < B; ++b) {
        float *xb = x + b * Hd;
        rms_norm(xb, norm_w, eps, Hd, h);
        matvec_f32(router, h, score, E, Hd);   /* the router stays fp32 (as torch keeps it) */
        for (int64_t e = 0; e < E; ++e) {
            score[e] = 1.0f / (1.0f + expf(-score[e]));
            choice[e] = score[e] + bias[e];
        }
        float total = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e)
                if (choice[e] != -INFINITY && (best < 0 || choice[e] > choice[best])) best = e;
            ids[k] = best;
            wts[k] = score[best];
            choice[best] = -INFINITY;
            total += wts[k];
        }
        for (int64_t k = 0; k < K; ++k)
            wts[k] = (renormalize ? wts[k] / (total + 1e-20f) : wts[k]) * scaling;
        for (int64_t i = 0; i < Hd; ++i) y[i] = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
            const int64_t e = ids[k];
            if (transposed) NAME(vecmat)(h, w13 + e * Hd * 2 * I, gu, Hd, 2 * I);
            else NAME(matvec)(w13 + e * 2 * I * Hd, h, gu, 2 * I, Hd);
            for (int64_t j = 0; j < I; ++j) act[j] = silu(gu[j]) * gu[I + j];
            if (transposed) NAME(vecmat)(act, w2 + e * I * Hd, d, I, Hd);
            else NAME(matvec)(w2 + e * Hd * I, act, d, Hd, I);
            for (int64_t i = 0; i < Hd; ++i) y[i] += wts[k] * d[i];
        }
        if (sh_gate) NAME(swiglu_add)(h, sh_gate, sh_up, sh_down, Hd, Is, y, tmp);
        for (int64_t i = 0; i < Hd; ++i) xb[i] += y[i];
    }
}

/* The final norm and the LM head for B rows: logits [B, V] = W [V, Hd] . norm(x).
 * scratch: at least Hd floats. */
void NAME(head_block)(int64_t B, int64_t Hd, int64_t V, const float *x, const float *norm_w,
                      float eps, const WT *W, float *logits, float *scratch) {
    for (int64_t b = 0; b < B; ++b) {
        rms_norm(x + b * Hd, norm_w, eps, Hd, scratch);
        NAME(matvec)(W, scratch, logits + b * V, V, Hd);
    }
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
