/* Absorbed MLA decode over a page table, fused: each (row, split) unit reads its keys once,
 * straight from the pages, a block at a time, and keeps a running max, sum and output per head
 * (online softmax), so nothing of the context is gathered or materialised. All heads share one
 * key per token (the latent): a block is read from memory once for every head. The splits'
 * partials (output and log-sum-exp per head) are merged by the caller. fp32. */
#include <stdint.h>

#include "fastmath.h"
#include "threads.h"

#define MAX_BS 1024

/* 8 independent partial sums: without -ffast-math the compiler keeps a single sum scalar */
static inline float dot(const float *a, const float *b, int64_t n) {
    float part[8] = {0};
    int64_t c = 0;
    for (; c + 8 <= n; c += 8)
        for (int i = 0; i < 8; ++i) part[i] += a[c + i] * b[c + i];
    float s = ((part[0] + part[1]) + (part[2] + part[3]))
              + ((part[4] + part[5]) + (part[6] + part[7]));
    for (; c < n; ++c) s += a[c] * b[c];
    return s;
}

/* units u in [unit_begin, unit_end): row t = u / num_splits gets keys
 * [s * split_keys, min((s+1) * split_keys, kv_lens[t])) of split s = u % num_splits.
 * pages [NB,bs,d], blocks [T,width], qa [T,h,d] (scaled), o [T*num_splits,h,d],
 * lse [T*num_splits,h]; a unit without keys gets o = 0, lse = -inf. */
void mla_decode_paged(int64_t unit_begin, int64_t unit_end, int64_t nthreads,
                      const float *restrict pages, int64_t bs,
                      int64_t d, const int64_t *blocks, int64_t width, const int64_t *kv_lens,
                      const float *qa, int64_t h, int64_t split_keys, int64_t num_splits,
                      float *o, float *lse) {
    (void)nthreads;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads) if (nthreads > 1)
    for (int64_t u = unit_begin; u < unit_end; ++u) {
        float s[MAX_BS];
        float m[h], l[h];
        const int64_t t = u / num_splits, sp = u % num_splits;
        const int64_t k0 = sp * split_keys;
        int64_t k1 = k0 + split_keys;
        if (k1 > kv_lens[t]) k1 = kv_lens[t];
        float *ou = o + u * h * d, *lu = lse + u * h;
        for (int64_t i = 0; i < h * d; ++i) ou[i] = 0.0f;
        for (int64_t hh = 0; hh < h; ++hh) { m[hh] = -INFINITY; l[hh] = 0.0f; }
        for (int64_t a = k0; a < k1; a += bs) {
            const int64_t n = (k1 - a) < bs ? (k1 - a) : bs;
            const float *keys = pages + blocks[t * width + a / bs] * bs * d;
            for (int64_t hh = 0; hh < h; ++hh) {
                const float *q = qa + (t * h + hh) * d;
                float *restrict acc = ou + hh * d;
                float mb = -INFINITY;
                for (int64_t j = 0; j < n; ++j) {
                    s[j] = dot(q, keys + j * d, d);
                    mb = s[j] > mb ? s[j] : mb;
                }
                if (mb > m[hh]) {     /* rescale what came before to the new max */
                    const float r = m[hh] == -INFINITY ? 0.0f : exp_approx(m[hh] - mb);
                    l[hh] *= r;
                    for (int64_t c = 0; c < d; ++c) acc[c] *= r;
                    m[hh] = mb;
                }
                const float mh = m[hh];
                for (int64_t j = 0; j < n; ++j) s[j] = exp_approx(s[j] - mh);  /* vectorises */
                float lb = 0.0f;
                int64_t j = 0;
                for (; j + 4 <= n; j += 4) {   /* four keys per pass over acc */
                    const float *restrict k = keys + j * d;
                    const float p0 = s[j], p1 = s[j + 1], p2 = s[j + 2], p3 = s[j + 3];
                    lb += (p0 + p1) + (p2 + p3);
                    for (int64_t c = 0; c < d; ++c)
                        acc[c] += (p0 * k[c] + p1 * k[d + c])
                                  + (p2 * k[2 * d + c] + p3 * k[3 * d + c]);
                }
                for (; j < n; ++j) {
                    const float *restrict k = keys + j * d;
                    lb += s[j];
                    for (int64_t c = 0; c < d; ++c) acc[c] += s[j] * k[c];
                }
                l[hh] += lb;
            }
        }
        for (int64_t hh = 0; hh < h; ++hh) {
            if (l[hh] > 0.0f) {
                const float inv = 1.0f / l[hh];
                for (int64_t c = 0; c < d; ++c) ou[hh * d + c] *= inv;
                lu[hh] = m[hh] + logf(l[hh]);
            } else {
                lu[hh] = -INFINITY;
            }
        }
    }
}
