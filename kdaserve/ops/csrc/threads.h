/* How the kernels that split work share torch's threads: built with -fopenmp they run on
 * torch's own OpenMP pool (libgomp, shared: the library is loaded after torch), the count
 * passed in by the caller (kdaserve/ops/cpu_kernels.py parallel_rows). A Python pool beside
 * torch's workers, which spin for a while after each op, ran these kernels at half speed on
 * two cores. */
#ifndef KDASERVE_THREADS_H
#define KDASERVE_THREADS_H

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* 1 when built with OpenMP (the kernels split their work themselves); else the caller does. */
int64_t kernels_parallel(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Threads a region started here would get: 1 inside another region (nested regions get one)
 * or with one thread to share. libgomp builds a team for every `parallel`, a serial one too (an
 * `if` clause that fails, a nested region), and ends it with a futex call: ~0.65 us a region
 * on the AVX2 EPYC, and the demo's one-row decode step met 207 serial regions of its 260. So
 * the kernels run a serial case's loop here (PAR_FOR), with no region at all. */
static inline int64_t team_threads(void) {
#ifdef _OPENMP
    return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
    return 1;
#endif
}

/* The `for` statement (the variadic arguments) as OpenMP's `parallel for CLAUSES` when PAR
 * holds, else run here; its body must hold no preprocessor directive. */
#define OMP_PRAGMA_(x) _Pragma(#x)
#define PAR_FOR(par, clauses, ...)                                                         \
    do {                                                                                  \
        if (par) { OMP_PRAGMA_(omp parallel for clauses) __VA_ARGS__ }                    \
        else { __VA_ARGS__ }                                                              \
    } while (0)

/* The calling thread's number in its team (0 outside a region, or without OpenMP): which
 * of the caller's per-thread scratch areas it takes. */
static inline int64_t thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* The calling thread's even share [*lo, *hi) of [begin, end) inside a parallel region (all of
 * it outside one, or without OpenMP). */
static inline void thread_share(int64_t begin, int64_t end, int64_t *lo, int64_t *hi) {
    int64_t parts = 1, part = 0;
#ifdef _OPENMP
    parts = omp_get_num_threads();
    part = omp_get_thread_num();
#endif
    *lo = begin + (end - begin) * part / parts;
    *hi = begin + (end - begin) * (part + 1) / parts;
}

#endif
