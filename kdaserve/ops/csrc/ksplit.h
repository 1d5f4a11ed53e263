/* Where the sums of a K-major product split in two (row_products.h, moe_cpu.c).
 *
 * One row of a large product is read from memory, and how its threads share it decides the
 * rate: split by outputs, each thread reads a run of every weight row, runs a row apart, which
 * this AVX2 EPYC served at 9-11 GB/s on two threads; split by K, each reads one contiguous
 * half of the matrix, at 15-18 GB/s (docs/benchmarks.md, "K-split"). So a matrix of at least
 * KSPLIT_MIN_BYTES sums each output in two halves, y = (sum over i < K/2) + (sum over the
 * rest), each half in K order, on every path (one row or many, any thread count): the bits do
 * not depend on the batch. Smaller matrices (the demo's) keep one running sum, as before. */
#ifndef KDASERVE_KSPLIT_H
#define KDASERVE_KSPLIT_H
#include <stdint.h>

#ifndef KSPLIT_MIN_BYTES
#define KSPLIT_MIN_BYTES ((int64_t)1 << 21)
#endif

/* the first index of the second half, or K when the sums do not split */
static inline int64_t k_split_at(int64_t N, int64_t K, int64_t elem_bytes) {
    return elem_bytes * N * K >= KSPLIT_MIN_BYTES && K >= 32 ? K / 2 : K;
}
#endif
