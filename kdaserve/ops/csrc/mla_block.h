/* The MLA token mixer of the fused decode blocks (decode_blocks.h includes this file once per
 * weight and cache type: NAME, WT, CT and STC come from it); its attention is mla_attend.h. */

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
