/* Counts the OpenMP regions the decode kernels open (tests/ops/test_omp_regions.py): an
 * LD_PRELOAD shim around libgomp's GOMP_parallel, counting only regions whose body lives in a
 * library whose path contains `omp_regions_only` (set before counting). A region is serial when
 * it gets one thread by its own request or because it is nested in another; libgomp builds a
 * team and makes a futex call for those too, which csrc/threads.h's PAR_FOR avoids. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <omp.h>
#include <string.h>

typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);

static long regions, serial;
static int counting;
static char only[256];

void omp_regions_start(const char *library) {
    strncpy(only, library, sizeof only - 1);
    regions = serial = 0;
    counting = 1;
}

void omp_regions_stop(void) { counting = 0; }
long omp_regions_total(void) { return regions; }
long omp_regions_serial(void) { return serial; }

void GOMP_parallel(void (*fn)(void *), void *data, unsigned nthreads, unsigned flags) {
    static gomp_parallel_fn real;
    if (!real) real = (gomp_parallel_fn)dlsym(RTLD_NEXT, "GOMP_parallel");
    if (counting) {
        Dl_info info;
        if (dladdr((void *)fn, &info) && info.dli_fname && strstr(info.dli_fname, only)) {
            ++regions;
            if (nthreads == 1 || omp_in_parallel()) ++serial;
        }
    }
    real(fn, data, nthreads, flags);
}
