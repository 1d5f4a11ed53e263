/* Calls the compiled kernels' entry points on behalf of a Python process that cannot load
 * them: the aarch64 builds under qemu-user on an x86 host (tests/ops/remote_kernels.py), and
 * the host's own build through the same path, to compare the two bit for bit.
 *
 * A loop over requests on stdin, one answer each on stdout (little-endian):
 *   request: u32 magic 'KDAC' (0 ends the loop); u32 n + n bytes: the library's path;
 *            u32 n + n bytes: the symbol; u32 buffers, each u64 n + n bytes; u32 args, each
 *            u8 kind (0 int64, 1 float32, 2 pointer into a buffer: u32 buffer + u64 byte
 *            offset, 3 NULL) and its value.
 *   answer:  u32 status (0: called; else u32 n + n bytes of message); after a call, every
 *            buffer's bytes as the function left them.
 *
 * Every entry point takes int64s, pointers and at most eight floats, so one prototype calls
 * them all: eight floats, then the integer-class arguments in order. On AArch64 (AAPCS64) and
 * x86-64 (System V) floats go in the vector registers v0-v7 / xmm0-7 and integers in the
 * general ones, then on the stack in 8-byte slots in order, so the callee finds its arguments
 * where this call puts them; arguments it does not declare are ignored (the caller owns the
 * stack area). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_INTS 40
#define MAX_FLOATS 8
#define MAX_LIBS 16

typedef void (*entry_fixed)(float, float, float, float, float, float, float, float,
                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int64_t);

static void read_exact(void *p, size_t n) {
    if (n && fread(p, 1, n, stdin) != n) exit(0);     /* the caller went away */
}

static uint32_t read_u32(void) {
    uint32_t v;
    read_exact(&v, sizeof v);
    return v;
}

static uint64_t read_u64(void) {
    uint64_t v;
    read_exact(&v, sizeof v);
    return v;
}

static char *read_str(void) {
    const uint32_t n = read_u32();
    char *s = malloc(n + 1);
    read_exact(s, n);
    s[n] = 0;
    return s;
}

static void fail(const char *msg) {
    const uint32_t status = 1, n = (uint32_t)strlen(msg);
    fwrite(&status, 4, 1, stdout);
    fwrite(&n, 4, 1, stdout);
    fwrite(msg, 1, n, stdout);
    fflush(stdout);
}

static void *library(const char *path) {
    static char *paths[MAX_LIBS];
    static void *handles[MAX_LIBS];
    static int count;
    for (int i = 0; i < count; ++i)
        if (!strcmp(paths[i], path)) return handles[i];
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h && count < MAX_LIBS) {
        paths[count] = strdup(path);
        handles[count++] = h;
    }
    return h;
}

int main(void) {
    for (;;) {
        if (read_u32() != 0x4341444bu) return 0;       /* 'KDAC' */
        char *path = read_str(), *symbol = read_str();
        const uint32_t nbuf = read_u32();
        void **buf = calloc(nbuf ? nbuf : 1, sizeof *buf);
        uint64_t *size = calloc(nbuf ? nbuf : 1, sizeof *size);
        for (uint32_t b = 0; b < nbuf; ++b) {
            size[b] = read_u64();
            if (posix_memalign(&buf[b], 64, size[b] ? size[b] : 64)) exit(2);
            read_exact(buf[b], size[b]);
        }
        int64_t ints[MAX_INTS] = {0};
        float floats[MAX_FLOATS] = {0};
        int ni = 0, nf = 0, bad = 0;
        const uint32_t nargs = read_u32();
        for (uint32_t a = 0; a < nargs; ++a) {
            const uint8_t kind = (uint8_t)getchar();
            int64_t iv = 0;
            if (kind == 0) {
                iv = (int64_t)read_u64();
            } else if (kind == 1) {
                float f;
                read_exact(&f, sizeof f);
                if (nf < MAX_FLOATS) floats[nf] = f;
                ++nf;
                continue;
            } else if (kind == 2) {
                const uint32_t b = read_u32();
                const uint64_t off = read_u64();
                bad |= b >= nbuf;
                iv = b < nbuf ? (int64_t)(intptr_t)((char *)buf[b] + off) : 0;
            } else if (kind != 3) {
                bad = 1;
            }
            if (ni < MAX_INTS) ints[ni] = iv;
            ++ni;
        }
        void *lib = library(path);
        entry_fixed fn = lib ? (entry_fixed)dlsym(lib, symbol) : NULL;
        if (bad || ni > MAX_INTS || nf > MAX_FLOATS) {
            fail("bad request: a buffer index out of range, or too many arguments");
        } else if (!fn) {
            fail(lib ? "no such symbol" : dlerror());
        } else {
            const float *f = floats;
            const int64_t *i = ints;
            fn(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], i[0], i[1], i[2], i[3], i[4],
               i[5], i[6], i[7], i[8], i[9], i[10], i[11], i[12], i[13], i[14], i[15], i[16],
               i[17], i[18], i[19], i[20], i[21], i[22], i[23], i[24], i[25], i[26], i[27],
               i[28], i[29], i[30], i[31], i[32], i[33], i[34], i[35], i[36], i[37], i[38],
               i[39]);
            const uint32_t ok = 0;
            fwrite(&ok, 4, 1, stdout);
            for (uint32_t b = 0; b < nbuf; ++b) fwrite(buf[b], 1, size[b], stdout);
            fflush(stdout);
        }
        for (uint32_t b = 0; b < nbuf; ++b) free(buf[b]);
        free(buf);
        free(size);
        free(path);
        free(symbol);
    }
}
