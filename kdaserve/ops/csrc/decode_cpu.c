/* Fused decode blocks for small batches on CPU: one call per token mixer or
 * feed-forward of a layer, for rows that each carry one token. Each block reads its weights
 * once per row and keeps every intermediate in a few KiB of scratch, where the torch forms
 * spend a dozen ops (each a dispatch, an allocation and a pass over memory) per block.
 * Every block adds its output to the residual stream x [B, Hd] in place. The blocks are in
 * decode_blocks.h (and its *_block.h), compiled here for fp32 weights and cache (suffix
 * _f32) and for bf16 ones (_bf16: --dtype bfloat16). bf16 weights are widened to fp32 in
 * registers, so activations and sums stay fp32 (AVX-512 BF16 dot products, vdpbf16ps, would
 * round the activations to bf16 as well; only the torch forms' rows, bf16 already, take them:
 * pair_tiles.h); the widening is a shift, and the weights read per token halve.
 *
 * The arithmetic mirrors the torch reference of each block (kdaserve.model.kda / mla / moe,
 * kdaserve.ops.kda / mla), in fp32, with the same recurrence as kda_cpu.c: results agree with
 * it to rounding (tests/model/test_fused_decode.py compares logits and greedy tokens).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "fastmath.h"
#include "kda_step.h"
#include "threads.h"
#include "vec16.h"
#include "decode_lanes.h"

/* bf16 is the top half of an fp32: widening is a shift; narrowing rounds to nearest even
 * (as torch's .to(torch.bfloat16) does; NaN is not expected here). */
static inline float bf16_to_f32(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}


static float sumsq(const float *x, int64_t n) {
    float lanes[8] = {0.0f};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; ++l) lanes[l] += x[i + l] * x[i + l];
    float s = 0.0f;
    for (; i < n; ++i) s += x[i] * x[i];
    for (int l = 0; l < 8; ++l) s += lanes[l];
    return s;
}

/* out = w * x / sqrt(mean(x^2) + eps) */
static void rms_norm(const float *x, const float *w, float eps, int64_t n, float *out) {
    const float r = 1.0f / sqrtf(sumsq(x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

/* log(1 + exp(x)) as in kda_cpu.c */
static inline float softplus_f(float x) {
    const float u = exp_approx(-fabsf(x)), w = 1.0f + u;
    const float l1p = w == 1.0f ? u : log_approx(w) * u / (w - 1.0f);
    return (x > 0.0f ? x : 0.0f) + l1p;
}


/* With OpenMP (built with -fopenmp; it then shares torch's libgomp, loaded first under the
 * same soname, so the blocks run on torch's threads and obey torch.set_num_threads), matrix
 * products of at least this many multiply-adds split their output rows over the threads, and
 * rows (or heads) of the per-row parts run in parallel where independent. */
#define PAR_MIN_MACS 32768

/* The calling thread's team size for the blocks' parallel parts (OpenMP keeps it per thread:
 * the engine's thread takes torch's setting, e.g. --torch-threads 1, before each step). */
void decode_blocks_threads(int64_t n) {
#ifdef _OPENMP
    omp_set_num_threads((int)(n > 0 ? n : 1));
#else
    (void)n;
#endif
}

/* The rows' embeddings, the plain fused step's first call (kdaserve/model/fused_plain.py):
 * x [B, H] fp32 = rows ids[b] of emb [V, H] (fp32, or bf16 widened exactly when bf16 != 0), as
 * torch.embedding; its torch op cost ~25 us a step in the engine's loop, whose kernels leave
 * the caches cold. Returns how many ids were outside [0, V) (their rows are left as they were;
 * the engine checks prompts, so none should be). */
int64_t embed_rows(int64_t B, const int64_t *ids, const void *emb, int64_t bf16, int64_t V,
                   int64_t H, float *x) {
    int64_t bad = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t t = ids[b];
        if (t < 0 || t >= V) {
            ++bad;
            continue;
        }
        float *xb = x + b * H;
        if (bf16) {
            const uint16_t *row = (const uint16_t *)emb + t * H;
            for (int64_t i = 0; i < H; ++i) xb[i] = bf16_to_f32(row[i]);
        } else {
            memcpy(xb, (const float *)emb + t * H, sizeof(float) * (size_t)H);
        }
    }
    return bad;
}

/* Kimi K3's block attention-residuals before a sublayer, for B rows (kdaserve/model/
 * attn_res.py, attn_res_mix): out[b] = sum_s softmax_s(l_s) * s over the S banked sources
 * bank[b, s] ([Hd] each, the bank's rows `stride` floats apart) and the running in-block sum
 * P[b], l_s = (s . w) / rms(s), w the sublayer's folded norm * proj weight; S = 0: out = P.
 * The softmax and the weighted sum run in the torch form's order. */
void attn_res_mix_rows(int64_t B, int64_t Hd, int64_t S, const float *bank, int64_t stride,
                       const float *P, const float *w, float eps, float *out) {
    for (int64_t b = 0; b < B; ++b) {
        const float *pb = P + b * Hd;
        float *ob = out + b * Hd;
        if (S == 0) {
            memcpy(ob, pb, sizeof(float) * (size_t)Hd);
            continue;
        }
        float logit[S + 1];
        float m = -INFINITY;
        for (int64_t s = 0; s <= S; ++s) {
            const float *src = s < S ? bank + b * stride + s * Hd : pb;
            float dot = 0.0f;
            for (int64_t i = 0; i < Hd; ++i) dot += src[i] * w[i];
            logit[s] = dot / sqrtf(sumsq(src, Hd) / (float)Hd + eps);
            m = logit[s] > m ? logit[s] : m;
        }
        float total = 0.0f;
        for (int64_t s = 0; s <= S; ++s) {
            logit[s] = expf(logit[s] - m);
            total += logit[s];
        }
        for (int64_t s = 0; s <= S; ++s) {
            const float p = logit[s] / total;
            const float *src = s < S ? bank + b * stride + s * Hd : pb;
            if (s == 0)
                for (int64_t i = 0; i < Hd; ++i) ob[i] = p * src[i];
            else
                for (int64_t i = 0; i < Hd; ++i) ob[i] += p * src[i];
        }
    }
}

/* fp32 weights, fp32 cache */
#define WT float
#define CT float
#define LDW(v) (v)
#define LDW8(p) ld8f(p)
#define LDW8P(p) ld8p(p)
#define LDW16(p) ld16f(p)
#define LDWV(p) ldvf(p)
#define LDC(v) (v)
#define STC(v) (v)
#define SFX _f32
#define WIDEN 0
#include "decode_blocks.h"

/* bf16 weights and cache (--dtype bfloat16), fp32 activations and accumulation */
#define WT uint16_t
#define CT uint16_t
#define LDW(v) bf16_to_f32(v)
#define LDW8(p) ld8bf16(p)
#define LDW8P(p) ld8pbf16(p)
#define LDW16(p) ld16bf16(p)
#define LDWV(p) ldvbf16(p)
#define LDC(v) bf16_to_f32(v)
#define STC(v) f32_to_bf16(v)
#define SFX _bf16
#define WIDEN 1
#include "decode_blocks.h"

/* packed INT8/INT4 matrices (fp32 cache, activations and sums; the router and MLA's kv_b as
 * fp32 arrays): each matrix argument is a descriptor (int_rows.h; bits 32: a plain fp32 row-
 * major matrix, for layers a checkpoint left unquantized) */
#include "int_rows.h"
#define WT float
#define CT float
#define LDW(v) (v)
#define LDW8(p) ld8f(p)
#define LDW8P(p) ld8p(p)
#define LDW16(p) ld16f(p)
#define LDWV(p) ldvf(p)
#define LDC(v) (v)
#define STC(v) (v)
#define SFX _q
#define WIDEN 0
#define QMATS 1
#include "decode_blocks.h"
#undef QMATS
