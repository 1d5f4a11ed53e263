/* The fused decode blocks of decode_cpu.c, written once for a weight type WT and a cache
 * element type CT (LDW / LDC read one as a float, STC rounds a float into CT); decode_cpu.c
 * includes this file once per type pair, NAME() giving each copy its suffix. Activations and
 * accumulation are fp32 whatever the weights are. Shapes below are the model's, [out, in];
 * every dense projection arrives stored transposed ([in, out], K-major: fused_args.py `_wt`)
 * for row_products.h's matmat_t. The router and the MLA kv_b stay as the model keeps them. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define NAME(f) CAT(f, SFX)

#ifdef QMATS
/* Packed weights (the _q copy): every matrix argument is a `const qmat *` (int_rows.h) passed
 * as a WT pointer, its rows [out, in] decoded inside the product; W_AT picks expert e's. */
static void NAME(matmat_t)(const WT *W, const float *X, int64_t ldx, float *Y, int64_t ldy,
                           int64_t N, int64_t K, int64_t B) {
    int64_t threads = 1;
#ifdef _OPENMP
    threads = omp_in_parallel() ? 1 : omp_get_max_threads();
#endif
    q_matmat((const qmat *)(const void *)W, X, ldx, Y, ldy, N, K, B, threads);
}
static void NAME(matmat)(const WT *W, const float *X, int64_t ldx, float *Y, int64_t ldy,
                         int64_t N, int64_t K, int64_t B) {
    NAME(matmat_t)(W, X, ldx, Y, ldy, N, K, B);     /* a descriptor says its own layout */
}
static void NAME(matmat_tw)(const WT *W, int64_t ldw, const float *X, int64_t ldx, float *Y,
                            int64_t ldy, int64_t N, int64_t K, int64_t B) {
    (void)ldw;
    NAME(matmat_t)(W, X, ldx, Y, ldy, N, K, B);
}
/* MLA's absorbed kv_b stays a plain fp32 array: the fp32 copy's products */
static void NAME(vecmat)(const float *x, const WT *W, float *y, int64_t K, int64_t N) {
    vecmat_f32(x, W, y, K, N);
}
static void NAME(matvec)(const WT *W, const float *x, float *y, int64_t N, int64_t K) {
    matvec_f32(W, x, y, N, K);
}
/* the blocks' dense projections (rows_split.h's proj_t in the K-major copies) */
static void NAME(proj_t)(const WT *W, const float *X, int64_t ldx, float *Y, int64_t ldy,
                         int64_t N, int64_t K, int64_t B) {
    NAME(matmat_t)(W, X, ldx, Y, ldy, N, K, B);
}
#define W_AT(w, e, rows, cols) ((const WT *)(const void *)((const qmat *)(const void *)(w) + (e)))
#else
#include "row_products.h"
#define W_AT(w, e, rows, cols) ((w) + (e) * (rows) * (cols))
#include "rows_split.h"
#endif

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
        NAME(proj_t)(w_qa, h, Hd, qa, Qr, Qr, Hd, B);
        for (int64_t b = 0; b < B; ++b) rms_norm(qa + b * Qr, qa_norm_w, qa_eps, Qr, qa + b * Qr);
        NAME(proj_t)(w_q, qa, Qr, q, H * QD, H * QD, Qr, B);
    } else {
        NAME(proj_t)(w_q, h, Hd, q, H * QD, H * QD, Hd, B);
    }
    NAME(proj_t)(w_kva, h, Hd, ckv, LD, LD, Hd, B);
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
        NAME(proj_t)(g_proj, h, Hd, gate, H * Vd, H * Vd, Hd, B);
        for (int64_t i = 0; i < B * H * Vd; ++i) o[i] *= sigmoid(gate[i]);
    }
    NAME(proj_t)(o_proj, o, H * Vd, y, Hd, Hd, H * Vd, B);
    for (int64_t i = 0; i < B * Hd; ++i) x[i] += y[i];
}

/* A gated MLP on B rows of h [B, Hd] (gate [I, Hd], up [I, Hd], down [Hd, I]; activation
 * `act` as glu_span) added into y [B, Hd]. tmp: at least B (2I + Hd) + 4 max(Hd, I) floats. */
static float *NAME(glu)(const float *h, const WT *gate, const WT *up, const WT *down,
                        int64_t Hd, int64_t I, int64_t B, float *tmp, int64_t act, float beta,
                        float lbeta) {
    float *g = tmp, *u = g + B * I, *d = u + B * I;
    NAME(proj_t)(gate, h, Hd, g, I, I, Hd, B);
    NAME(proj_t)(up, h, Hd, u, I, I, Hd, B);
    glu_span(act, beta, lbeta, g, u, g, B * I);
    NAME(proj_t)(down, g, I, d, Hd, Hd, I, B);
    return d;                                        /* [B, Hd] in tmp */
}

static void NAME(glu_add)(const float *h, const WT *gate, const WT *up, const WT *down,
                       int64_t Hd, int64_t I, int64_t B, float *y, float *tmp, int64_t act,
                       float beta, float lbeta) {
    const float *d = NAME(glu)(h, gate, up, down, Hd, I, B, tmp, act, beta, lbeta);
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

#ifndef QMATS
#include "moe_rows.h"
#endif

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
    if (lat_down) NAME(proj_t)(lat_down, h, Hd, z, Wd, Wd, Hd, B);
    else memcpy(z, h, sizeof(float) * (size_t)(B * Hd));
    /* experts in parallel, each with buffers of its own for the rows that chose it; the
     * shared experts are the first item (the largest: every row), into tmp, so that a lone
     * row's shared and routed experts share the threads (in a serial tail they left all but
     * one idle). Their output is added after the routed sum, as before: the same sums. */
    const float *shared = NULL;
    float *split_buf = NULL;
    int64_t nt = 1;
#ifdef _OPENMP
    nt = omp_in_parallel() ? 1 : omp_get_max_threads();
#endif
#ifdef QMATS
    const int split = 0;             /* packed rows: q_matmat's, one expert a thread */
    (void)nt;
#else
    /* few bf16 rows: every product over all threads (moe_rows.h; fp32 is row_products.h's) */
    const int split = WIDEN && B <= MOE_SPLIT_ROWS && nt > 1 && transposed;
    if (split)
        NAME(moe_rows_split)(B, Hd, E, I, K, idf, z, Wd, h, w13, w2, sh_gate, sh_up, sh_down,
                             Is, act, beta, lbeta, de, &shared, nt, &split_buf);
#endif
    if (!split) {                   /* (a split step ran its experts above) */
#pragma omp parallel for schedule(dynamic) if (S > 1 && team_threads() > 1)
        for (int64_t it = 0; it <= E; ++it) {
            const int64_t e = it - 1;
            if (e < 0) {
                if (sh_gate)
                    shared = NAME(glu)(h, sh_gate, sh_up, sh_down, Hd, Is, B, tmp, act, beta, lbeta);
                continue;
            }
            int64_t slot[S];
            int64_t n = 0;
            for (int64_t s = 0; s < S; ++s)
                if ((int64_t)idf[s] == e) slot[n++] = s;
            if (!n) continue;
            /* ask for all of this expert's weights at once: the products read them in several
             * strided passes, each waiting on its misses one stream at a time */
#ifndef QMATS
            {
                const char *p13 = (const char *)(w13 + e * Wd * 2 * I);
                const char *p2 = (const char *)(w2 + e * I * Wd);
                const int64_t bytes = (int64_t)sizeof(WT) * Wd * 2 * I;
                for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p13 + off, 0, 2);
                for (int64_t off = 0; off < bytes / 2; off += 64) __builtin_prefetch(p2 + off, 0, 2);
            }
#endif
            float *xe = malloc(sizeof(float) * (size_t)(n * (Wd + 3 * I)));
            float *gu = xe + n * Wd, *a = gu + n * 2 * I;
            for (int64_t r = 0; r < n; ++r)
                memcpy(xe + r * Wd, z + (slot[r] / K) * Wd, sizeof(float) * Wd);
            if (transposed) NAME(matmat_t)(W_AT(w13, e, Wd, 2 * I), xe, Wd, gu, 2 * I, 2 * I, Wd, n);
            else NAME(matmat)(w13 + e * 2 * I * Wd, xe, Wd, gu, 2 * I, 2 * I, Wd, n);
            for (int64_t r = 0; r < n; ++r)
                glu_span(act, beta, lbeta, gu + r * 2 * I, gu + r * 2 * I + I, a + r * I, I);
            /* outputs land at their (row, slot) place in de [S, Wd] */
            float *out = xe;                             /* xe is free again: [n, Wd] */
            if (transposed) NAME(matmat_t)(W_AT(w2, e, I, Wd), a, I, out, Wd, Wd, I, n);
            else NAME(matmat)(w2 + e * Wd * I, a, I, out, Wd, Wd, I, n);
            for (int64_t r = 0; r < n; ++r) memcpy(de + slot[r] * Wd, out + r * Wd, sizeof(float) * Wd);
            free(xe);
        }
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
        NAME(proj_t)(lat_up, sum, Wd, y, Hd, Hd, Wd, B);
    } else {
        memcpy(y, sum, sizeof(float) * (size_t)(B * Hd));
    }
    if (shared)
        for (int64_t i = 0; i < B * Hd; ++i) y[i] += shared[i];
    for (int64_t i = 0; i < B * Hd; ++i) x[i] += y[i];
    free(split_buf);
}

/* The final norm and the LM head for B rows: logits [B, V] = W [V, Hd] . norm(x), W stored
 * K-major with its rows ldw >= V apart (cpu_linear.py pads a vocabulary of 4 KiB multiples).
 * scratch: at least B Hd + 4 Hd floats. */
void NAME(head_block)(int64_t B, int64_t Hd, int64_t V, const float *x, const float *norm_w,
                      float eps, const WT *W, int64_t ldw, float *logits, float *scratch) {
    NAME(norm_rows)(x, norm_w, eps, Hd, B, scratch);
    if (ldw != V) NAME(matmat_tw)(W, ldw, scratch, Hd, logits, V, V, Hd, B);
    else NAME(proj_t)(W, scratch, Hd, logits, V, V, Hd, B);
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
#undef LDW8P
#undef LDW16
#undef W_AT
#undef LDWV
