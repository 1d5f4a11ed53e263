/* A lone decode row's integer dot products (int_dot.h's math, exactly: the same integers and
 * fused multiply-adds in the same order as idot_tile), four outputs a tile with the tile's
 * addresses set once: idot_row4 where groups hold whole units, idot_row4_g32 for INT4 in
 * groups of 32, and idot_streams, INT8's tiles of four outputs a quarter of the range apart.
 * Included by int_dot.h after idot_tile. */
#ifndef KDASERVE_INT_ROW4_H
#define KDASERVE_INT_ROW4_H

#include <stdint.h>

#include "int_acts.h"
#include "int_dot_lanes.h"

/* A lone row's tile of four outputs n + o os (o < 4) where groups hold whole units (gu > 0):
 * idot_tile's integers and fused multiply-adds in the same order, with the tile's pointers set
 * once and the unit loop unrolled by two. idot_tile's general form (any NO and R, both group
 * forms) kept the loop busy with its addresses. One thread, [1024 x 1024] in groups of 128, hot:
 * INT4 1.26-1.28x, INT8 1.23-1.25x on AVX-512, where a control running the same code read
 * 1.09 (INT4 1.26x, INT8 1.12x on AVX2); cold, a pool of 256 such matrices in shuffled order:
 * INT4 1.15-1.18x, INT8 even (docs/benchmarks.md, twenty-fourth session). Its INT4 sums start
 * at -8 A, once for the four outputs (the same integers as correcting each after, which
 * idot_tile's lone row still does): hot 1.07-1.09x on AVX-512, even on AVX2 and cold
 * (twenty-seventh session). IDOT_ROW4=0 keeps idot_tile (for A/B runs).
 * os > 1 (idot_streams): the four rows lie os rows apart, four runs that each go on
 * where their last unit ended, and each is asked for idot_stream_ahead bytes ahead; os == 1
 * asks for the tile's consecutive rows in address order (IDOT_AHEAD). */
#ifndef IDOT_ROW4
#define IDOT_ROW4 1
#endif
/* The streams' prefetch distance in bytes, set at run time (kdaserve_set_stream_ahead) since
 * the best one is the machine's: in the engine (bench blocks, a lone row), on Zen 4 INT8 at 512
 * ran 0.93-0.98x 256's speed and at 1,024 0.90x; on a Xeon with AMX at 1,024 INT8 ran 1.08x
 * and INT4 1.29-1.36x (docs/benchmarks.md, thirty-second and thirty-third sessions).
 * kdaserve/ops/stream_ahead.py measures it once a machine. IDOT_STREAM_AHEAD: the value until
 * then. */
#ifndef IDOT_STREAM_AHEAD
#define IDOT_STREAM_AHEAD 256
#endif
static int64_t idot_stream_ahead = IDOT_STREAM_AHEAD;

/* exported by every kernel library that takes the streams (ctypes) */
__attribute__((visibility("default"))) int64_t kdaserve_set_stream_ahead(int64_t bytes) {
    if (bytes > 0) idot_stream_ahead = bytes;
    return idot_stream_ahead;
}
static inline __attribute__((always_inline)) void
idot_row4(const qmat *m, int64_t n, const qacts *a, int64_t r, float *Y, int bits, int64_t gu,
          int zp, int64_t os) {
    const int64_t U = a->U, G = m->groups, rb = m->row_bytes, unit = idot_unit(bits);
    const int8_t *q = a->q + r * a->K;
    const int32_t *A = a->A + r * U * 8;
    const int32_t base = idot_base(bits);
    const float *d = a->d + r * U * 8, *s = m->scale + n * G;
    const uint8_t *w = m->packed + n * rb;
    const int8_t *z = zp ? m->zero + n * G : NULL;
    const int64_t ro = os * rb, so = os * G;           /* a tile row's bytes and scales on */
    const int64_t ahead = idot_stream_ahead;
    idot_f acc[4];
    for (int o = 0; o < 4; ++o) acc[o] = idot_zero();
    for (int64_t g = 0; g < G; ++g) {
        const int64_t u1 = (g + 1) * gu < U ? (g + 1) * gu : U;
        idot_f t[4];
        idot_i off[4];
        for (int o = 0; o < 4; ++o) {
            t[o] = idot_zero();
            if (zp) off[o] = idot_offs(base + z[o * so + g], base + z[o * so + g]);
        }
        _Pragma("GCC unroll 2")
        for (int64_t u = g * gu; u < u1; ++u) {
            if (os == 1)
                for (int c = 0; IDOT_AHEAD && c < 128; c += 64)
                    __builtin_prefetch(w + IDOT_AHEAD + u * 128 + c);
            else if (!(u & 1))                    /* a line a stream every two units */
                for (int o = 0; o < 4; ++o)
                    __builtin_prefetch(w + o * ro + ahead + u * 32);
            const int8_t *qa = q + u * unit;
            const idot_f dv = idot_ldf(d + u * 8);
            const idot_i st = zp ? idot_izero() : idot_start_base(A + u * 8, bits);
            for (int o = 0; o < 4; ++o) {
                idot_i I = idot_lanes(st, idot_wb(w + o * ro + u * 32, bits), qa, bits);
                if (zp) I = idot_correct(I, A + u * 8, off[o]);
                t[o] = idot_fma(I, dv, t[o]);
            }
        }
        for (int o = 0; o < 4; ++o)
            acc[o] = idot_fmaf(t[o], idot_f2(s[o * so + g], s[o * so + g]), acc[o]);
    }
    for (int o = 0; o < 4; ++o) Y[n + o * os] = idot_sum(acc[o]);
}

/* A lone row's tile of four outputs from n, INT4 in groups of 32 (each unit's lanes 0-3 one
 * group, 4-7 the next): idot_tile's integers and fused multiply-adds in the same order, with
 * the tile's addresses set once, the -8 A start shared by the four outputs and each unit's
 * two scales one load. Cold, a pool of 200 [1024 x 2048] matrices in shuffled order: 1.12-1.23x
 * idot_tile on one thread, 1.08-1.16x on two; hot even (docs/benchmarks.md, thirtieth
 * session). */
static inline __attribute__((always_inline)) void
idot_row4_g32(const qmat *m, int64_t n, const qacts *a, int64_t r, float *Y, int zp) {
    const int64_t U = a->U, G = m->groups, rb = m->row_bytes;
    const int8_t *q = a->q + r * a->K;
    const int32_t *A = a->A + r * U * 8;
    const float *d = a->d + r * U * 8, *s = m->scale + n * G;
    const uint8_t *w = m->packed + n * rb;
    const int8_t *z = zp ? m->zero + n * G : NULL;
    idot_f acc[4];
    for (int o = 0; o < 4; ++o) acc[o] = idot_zero();
    _Pragma("GCC unroll 2")
    for (int64_t u = 0; u < U; ++u) {
        for (int c = 0; IDOT_AHEAD && c < 128; c += 64)
            __builtin_prefetch(w + IDOT_AHEAD + u * 128 + c);
        const int8_t *qa = q + u * 64;
        const idot_f dv = idot_ldf(d + u * 8);
        const idot_i st = zp ? idot_izero() : idot_start8(A + u * 8);
        for (int o = 0; o < 4; ++o) {
            idot_i I = idot_lanes(st, idot_wb(w + o * rb + u * 32, 4), qa, 4);
            if (zp)
                I = idot_correct(I, A + u * 8, idot_offs(8 + z[o * G + 2 * u],
                                                         8 + z[o * G + 2 * u + 1]));
            acc[o] = idot_fmaf(idot_fma(I, dv, idot_zero()), idot_f2p(s + o * G + 2 * u),
                               acc[o]);
        }
    }
    for (int o = 0; o < 4; ++o) Y[n + o] = idot_sum(acc[o]);
}

/* A lone INT8 row's tiles take their four outputs a quarter of the range apart, n, n + Q,
 * n + 2Q, n + 3Q: four runs of rows, each read straight on, rather than four neighbouring
 * rows. Each output is computed as before, so the same bits. Cold, 2 threads, pools of
 * 128 MB in shuffled order, [N x K]: [2048 x 1024] 1.24x (the host's fast window), [1024 x
 * 2048] 1.31x, [3216 x 1024] 1.17x, [4096 x 1024] 1.19x, [1024 x 512] 1.09x (slow ones);
 * INT4 went 0.95-1.06x and keeps its neighbouring rows (docs/benchmarks.md, thirty-second
 * session). */
#ifndef IDOT_STREAMS_INT8
#define IDOT_STREAMS_INT8 1
#endif
#ifndef IDOT_STREAMS_INT4
#define IDOT_STREAMS_INT4 1
#endif

/* the streams' tiles n0 + i, i < Q (int_dot.h idot_product), out of line */
static __attribute__((noinline)) void
idot_streams(const qmat *m, const qacts *a, int64_t r, float *Y, int64_t n0, int64_t Q, int bits,
             int64_t gu, int zp) {
    for (int64_t n = n0; n < n0 + Q; ++n) {
        if (bits == 8 && zp) idot_row4(m, n, a, r, Y, 8, gu, 1, Q);
        else if (bits == 8) idot_row4(m, n, a, r, Y, 8, gu, 0, Q);
        else if (zp) idot_row4(m, n, a, r, Y, 4, gu, 1, Q);
        else idot_row4(m, n, a, r, Y, 4, gu, 0, Q);
    }
}

#endif
