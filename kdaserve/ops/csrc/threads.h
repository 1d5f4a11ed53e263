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
