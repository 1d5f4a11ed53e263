/* The sparse MoE feed-forward of the fused decode blocks (decode_blocks.h includes this file
 * once per weight type: NAME, WT, WIDEN and W_AT come from it; glu is mlp_block.h's). */

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
             * strided passes, each waiting on its misses one stream at a time. Not for an
             * expert of TILE_BLOCKED_BYTES and more: its products run the blocked tiles, which
             * ask for each block in turn (memory-bound model, bf16, 3 alternating pairs: the
             * MoE block at 8 rows 26.1 / 22.5 / 21.9 -> 20.8 / 20.2 / 20.0 ms, at 32 rows
             * 59.2 / 57.9 / 56.3 -> 54.2 / 51.8 / 55.0) */
#ifndef QMATS
            const int64_t bytes = (int64_t)sizeof(WT) * Wd * 2 * I;
            if (bytes < TILE_BLOCKED_BYTES) {
                const char *p13 = (const char *)(w13 + e * Wd * 2 * I);
                const char *p2 = (const char *)(w2 + e * I * Wd);
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
