/* The products of decode_blocks.h's packed copy (decode_cpu.c's _q, QMATS), under the names
 * row_products.h and rows_split.h give the other copies. Every matrix argument is a
 * `const qmat *` (int_rows.h) passed as a WT pointer, its rows [out, in] decoded inside the
 * product; W_AT picks expert e's. */
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
