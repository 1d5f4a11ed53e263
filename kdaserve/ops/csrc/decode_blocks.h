/* The fused decode blocks of decode_cpu.c, written once for a weight type WT and a cache
 * element type CT (LDW / LDC read one as a float, STC rounds a float into CT); decode_cpu.c
 * includes this file once per type pair, NAME() giving each copy its suffix. Activations and
 * accumulation are fp32 whatever the weights are. Shapes below are the model's, [out, in];
 * every dense projection arrives stored transposed ([in, out], K-major: fused_args.py `_wt`)
 * for row_products.h's matmat_t. The router and the MLA kv_b stay as the model keeps them.
 * Each block is a header of its own (kda_block.h, mla_block.h, mlp_block.h, moe_block.h);
 * this file names the copy, picks its products and ends it with the LM head. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define NAME(f) CAT(f, SFX)

#ifdef QMATS
#include "qmat_products.h"
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

#include "kda_block.h"

#include "mla_block.h"

#include "mlp_block.h"

#include "moe_block.h"

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
