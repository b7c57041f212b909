/* The driver that scripts/check_neon.py builds with stage_node/kernels/cpu_quant.c for aarch64 and runs
   under qemu-aarch64: it replays a list of calls to lp_int4_mm, lp_int8_mm and lp_layers on buffers read
   from a file and writes every buffer back, so the checker compares them with the host build's.

   neon_harness IN OUT. Both files: int64 count, then per buffer an int64 size in bytes and the bytes. IN
   then holds int64 ncalls and per call 19 int64: op, a[6], b[12] (b: buffer numbers).
     op 1 (lp_int4_mm), 2 (lp_int8_mm): a = M, K, N, ldx, ldo, threads; b = x, w, s, out.
     op 3 (lp_layers): a = layers, T, table_len, threads; b = dims, layers, x, pos, row_seq, table,
       write_slots, kv, cos, sin. The layers buffer holds cpu_quant.c's lp_layer structures (25 words
       each) whose pointer words are a buffer number + 1 (0: NULL); they are turned into addresses here.
   Calls change their buffers in place (a KV pool carries from one call to the next). Prints the build's lp_isa()
   (1: NEON) and exits 0, or 1 with a line on stderr. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int lp_isa(void);
int lp_int4_mm(const float *, int64_t, int64_t, int64_t, const void *, const void *, int64_t, float *, int64_t, int);
int lp_int8_mm(const float *, int64_t, int64_t, int64_t, const void *, const void *, int64_t, float *, int64_t, int);
int lp_layers(const void *d, const void *L, int64_t nl, float *x, int64_t T, const int64_t *pos,
              const int64_t *row_seq, const int64_t *table, int64_t table_len, const int64_t *write_slots,
              float *kv, const float *cos, const float *sin_signed, int nt);

#define LAYER_WORDS 25
static const int POINTER_WORDS[] = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 18, 19, 20, 21, 22};

static int fail(const char *what) { fprintf(stderr, "neon_harness: %s\n", what); return 1; }

static int64_t get(FILE *f) {
    int64_t v;
    if (fread(&v, 8, 1, f) != 1) { fprintf(stderr, "neon_harness: short input\n"); exit(1); }
    return v;
}

int main(int argc, char **argv) {
    if (argc != 3) return fail("usage: neon_harness IN OUT");
    FILE *f = fopen(argv[1], "rb");
    if (!f) return fail("cannot open IN");
    int64_t n = get(f);
    void **buf = calloc((size_t)n, sizeof(void *));
    int64_t *size = calloc((size_t)n, sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) {
        size[i] = get(f);
        buf[i] = malloc(size[i] ? (size_t)size[i] : 1);
        if (!buf[i] || fread(buf[i], 1, (size_t)size[i], f) != (size_t)size[i]) return fail("short buffer");
    }
    int64_t calls = get(f);
    for (int64_t c = 0; c < calls; c++) {
        int64_t op = get(f), a[6], b[12];
        for (int i = 0; i < 6; i++) a[i] = get(f);
        for (int i = 0; i < 12; i++) b[i] = get(f);
        int rc;
        if (op == 1 || op == 2) {
            rc = (op == 1 ? lp_int4_mm : lp_int8_mm)(buf[b[0]], a[3], a[0], a[1], buf[b[1]], buf[b[2]], a[2],
                                                     buf[b[3]], a[4], (int)a[5]);
        } else if (op == 3) {
            uint64_t *L = malloc((size_t)size[b[1]]);
            const uint64_t *src = buf[b[1]];
            for (int64_t w = 0; w < a[0] * LAYER_WORDS; w++) L[w] = src[w];
            for (int64_t l = 0; l < a[0]; l++)
                for (size_t k = 0; k < sizeof POINTER_WORDS / sizeof *POINTER_WORDS; k++) {
                    uint64_t *p = L + l * LAYER_WORDS + POINTER_WORDS[k];
                    *p = *p ? (uint64_t)(uintptr_t)buf[*p - 1] : 0;
                }
            rc = lp_layers(buf[b[0]], L, a[0], buf[b[2]], a[1], buf[b[3]], buf[b[4]], buf[b[5]], a[2], buf[b[6]],
                           buf[b[7]], buf[b[8]], buf[b[9]], (int)a[3]);
            free(L);
        } else {
            return fail("unknown op");
        }
        if (rc) {
            fprintf(stderr, "neon_harness: call %lld (op %lld) returned %d\n", (long long)c, (long long)op, rc);
            return 1;
        }
    }
    fclose(f);
    FILE *o = fopen(argv[2], "wb");
    if (!o) return fail("cannot open OUT");
    fwrite(&n, 8, 1, o);
    for (int64_t i = 0; i < n; i++) {
        fwrite(&size[i], 8, 1, o);
        fwrite(buf[i], 1, (size_t)size[i], o);
    }
    if (fclose(o)) return fail("cannot write OUT");
    printf("isa %d, %lld calls\n", lp_isa(), (long long)calls);
    return 0;
}
