/* The gated MLP of the fused decode blocks (decode_blocks.h includes this file once per
 * weight type: NAME and WT come from it): the dense feed-forward block, and the gated MLP
 * that the MoE block's shared experts run too. */

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
