/* The KDA token mixer of the fused decode blocks (decode_blocks.h includes this file once per
 * weight and cache type: NAME, WT, CT, LDC and STC come from it). */

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
    NAME(proj_t)(w_in, h, Hd, pre, P, P, Hd, B);
    PAR_FOR(distinct && B > 1 && team_threads() > 1, schedule(static),
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
        });
    /* the decay's and the gate's low-rank up-projections are independent: one on each thread
     * (at one row each is too small to split, and they ran one after the other) */
    if (g_b && team_threads() > 1) {
#pragma omp parallel sections
        {
#pragma omp section
            NAME(proj_t)(f_b, pre + C, P, gdec, HD, HD, D, B);     /* f_a rows */
#pragma omp section
            NAME(proj_t)(g_b, pre + C + D, P, gate, HD, HD, D, B);
        }
    } else {
        NAME(proj_t)(f_b, pre + C, P, gdec, HD, HD, D, B);
        if (g_b) NAME(proj_t)(g_b, pre + C + D, P, gate, HD, HD, D, B);
        else
            for (int64_t b = 0; b < B; ++b)
                memcpy(gate + b * HD, pre + b * P + C + D, sizeof(float) * HD);
    }
    const struct NAME(kda_heads) st = {H, D, G, P, C, HD, pre, conv, gdec, gate, o, state_store,
                                       slots, dt_bias, a, lower_bound, use_bound, o_norm_w,
                                       o_eps, q_scale};
    const size_t state_bytes = sizeof(float) * (size_t)(H * D * D);
    if (distinct) {
        PAR_FOR(B * H > 1 && team_threads() > 1, collapse(2) schedule(static),
                for (int64_t b = 0; b < B; ++b)
                    for (int64_t hh = 0; hh < H; ++hh) NAME(kda_head)(&st, b, hh););
        if (kept_states)            /* one row per slot: its state after the step */
            for (int64_t b = 0; b < B; ++b)
                memcpy(kept_states + b * H * D * D, state_store + slots[b] * H * D * D,
                       state_bytes);
    } else {
        for (int64_t b = 0; b < B; ++b) {     /* in row order: each continues the last */
            PAR_FOR(H > 1 && team_threads() > 1, schedule(static),
                    for (int64_t hh = 0; hh < H; ++hh) NAME(kda_head)(&st, b, hh););
            if (kept_states)
                memcpy(kept_states + b * H * D * D, state_store + slots[b] * H * D * D,
                       state_bytes);
        }
    }
    NAME(proj_t)(o_proj, o, HD, y, Hd, Hd, HD, B);
    for (int64_t i = 0; i < B * Hd; ++i) x[i] += y[i];
}
