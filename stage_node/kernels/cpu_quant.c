/* Quantized matrix products on the CPU (stage_node.kernels.cpu_native builds and loads this file).

   y[m, n] = sum_k x[m, k] * W[n, k] for float32 x [M, K] and a quantized W [N, K]:
     int4: 4-bit q in groups of 32 along k, each group with a bf16 scale and zero point,
           W = (q - 8) * scale + zero (llama.cpp's Q4_1 grid). Packed by tiles of TILE = 4 rows of W:
           bytes [Np / 4, K / 32, 4, 16], byte j of a group holding q[j] (low nibble) and q[j + 16] (high);
           scales and zeros [Np / 4, K / 32, 2, 4] bf16 (the tile's 4 scales, then its 4 zeros).
     int8: int8 weights [Np / 4, Kp / 32, 4, 32] (k padded with zeros to Kp, a multiple of 32), one float
           scale per row of W [Np].
   Np is N rounded up to a multiple of 4 (padded rows are zero; their outputs are never written).

   As llama.cpp does, each row of x is first quantized in blocks of 32 (one float scale dx per block, round
   to nearest, plus the block's dx * sum(xq) for the zero-point term), then every group is an integer dot
   product scaled and accumulated in float per group:
       block = (scale * dx) * sum(q * xq) + (zero - 8 * scale) * dx * sum(xq).
   Unlike llama.cpp's int8 blocks (Q8_1), the activations are int16 (dx = max|x| / 32767): on the default
   model int8 blocks lost 3% of the int4 stage's greedy agreement with float32 (0.9375 against torch's
   kernel's 0.971, bf16 activations), and int16 costs about the same here: the weights are widened to
   16-bit lanes and multiplied by _mm256_madd_epi16 (AVX2) or vmlal_s16 (NEON) instead of maddubs.

   Batch invariance: every output y[m, n] is computed by the same instructions in the same order whatever
   M is and wherever row m sits (the rows of a tile share loads, never sums); threads split the output
   features n only, never the sum over k. Built with -ffp-contract=off so the compiler fuses no scalar
   multiply-add on its own. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LP_AVX2 1
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define LP_NEON 1
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 32     /* activation block = int4 group */
#define TILE 4    /* output features per tile */
#define XMAX 32767 /* activations: int16 in blocks of 32, x = dx * xq with dx = max|x| / XMAX */

int lp_abi_version(void) { return 1; }

int lp_isa(void) {  /* 2: AVX2, 1: NEON, 0: portable C */
#if defined(LP_AVX2)
    return 2;
#elif defined(LP_NEON)
    return 1;
#else
    return 0;
#endif
}

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* One row x [K] -> xq [Kb * 32] int16, xd [Kb] (block scale), xs [Kb] (xd * sum of the block's xq). */
static void quantize_row(const float *x, int64_t K, int16_t *xq, float *xd, float *xs) {
    int64_t Kb = (K + QK - 1) / QK;
    for (int64_t b = 0; b < Kb; b++) {
        float v[QK];
        int64_t n = K - b * QK < QK ? K - b * QK : QK;
        memcpy(v, x + b * QK, (size_t)n * sizeof(float));
        for (int64_t i = n; i < QK; i++) v[i] = 0.0f;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) { float a = fabsf(v[i]); amax = a > amax ? a : amax; }
        float d = amax / XMAX, id = amax > 0.0f ? XMAX / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            int q = (int)nearbyintf(v[i] * id);
            q = q > XMAX ? XMAX : (q < -XMAX ? -XMAX : q);
            xq[b * QK + i] = (int16_t)q;
            sum += q;
        }
        xd[b] = d;
        xs[b] = d * (float)sum;
    }
}

#if defined(LP_AVX2)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* A tile: TILE output features for R rows of x (R = 1 or 2, a constant once inlined). Each (row, feature)
   gets the same instructions in the same order for either R: rows share the weights' loads, never sums.
   int4 tile t: bytes [G, TILE, 16] at w, scales and zeros [G, 2, TILE] (bf16 bits) at sz.
   int8 tile t: [G, TILE, 32] at w, scales [TILE] at scale. o: [R][TILE]. */
#define INLINE static inline __attribute__((always_inline))

#if defined(LP_AVX2)
INLINE __m128 bf16x4(__m128i h) { return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16)); }

INLINE void int4_tile(const int R, const int16_t *xq, const float *xd, const float *xs, int64_t G,
                      const uint8_t *w, const uint16_t *sz, float *o) {
    const __m256i low = _mm256_set1_epi16(0x0F);
    __m256 acc[2][TILE];
    __m128 mins[2];
    for (int r = 0; r < R; r++) {
        mins[r] = _mm_setzero_ps();
        for (int c = 0; c < TILE; c++) acc[r][c] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < G; g++) {
        __m128i s = _mm_loadu_si128((const __m128i *)(sz + g * 2 * TILE));
        __m128 d = bf16x4(s), z = bf16x4(_mm_srli_si128(s, 8));
        __m128 zm = _mm_sub_ps(z, _mm_mul_ps(_mm_set1_ps(8.0f), d));
        float dd[2][TILE] __attribute__((aligned(16)));
        __m256i xa[2], xb[2];
        for (int r = 0; r < R; r++) {
            _mm_store_ps(dd[r], _mm_mul_ps(d, _mm_set1_ps(xd[r * G + g])));
            mins[r] = _mm_add_ps(mins[r], _mm_mul_ps(zm, _mm_set1_ps(xs[r * G + g])));
            xa[r] = _mm256_loadu_si256((const __m256i *)(xq + (r * G + g) * QK));
            xb[r] = _mm256_loadu_si256((const __m256i *)(xq + (r * G + g) * QK + 16));
        }
        for (int c = 0; c < TILE; c++) {
            /* 16 bytes widened to 16-bit lanes: the low nibbles are q[0..15], the high ones q[16..31] */
            __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + (g * TILE + c) * 16)));
            __m256i qa = _mm256_and_si256(v, low), qb = _mm256_srli_epi16(v, 4);
            for (int r = 0; r < R; r++) {
                __m256i p = _mm256_add_epi32(_mm256_madd_epi16(qa, xa[r]), _mm256_madd_epi16(qb, xb[r]));
                acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(&dd[r][c]), _mm256_cvtepi32_ps(p), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float m[TILE];
        _mm_storeu_ps(m, mins[r]);
        for (int c = 0; c < TILE; c++) o[r * TILE + c] = hsum8(acc[r][c]) + m[c];
    }
}

INLINE void int8_tile(const int R, const int16_t *xq, const float *xd, int64_t G, const int8_t *w,
                      const float *scale, float *o) {
    __m256 acc[2][TILE];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i xa[2], xb[2];
        __m256 dx[2];
        for (int r = 0; r < R; r++) {
            xa[r] = _mm256_loadu_si256((const __m256i *)(xq + (r * G + g) * QK));
            xb[r] = _mm256_loadu_si256((const __m256i *)(xq + (r * G + g) * QK + 16));
            dx[r] = _mm256_set1_ps(xd[r * G + g]);
        }
        for (int c = 0; c < TILE; c++) {
            const int8_t *wb = w + (g * TILE + c) * QK;
            __m256i wa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wb));
            __m256i wc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 16)));
            for (int r = 0; r < R; r++) {
                __m256i p = _mm256_add_epi32(_mm256_madd_epi16(wa, xa[r]), _mm256_madd_epi16(wc, xb[r]));
                acc[r][c] = _mm256_fmadd_ps(dx[r], _mm256_cvtepi32_ps(p), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < TILE; c++) o[r * TILE + c] = hsum8(acc[r][c]) * scale[c];
}

#else  /* NEON or portable C: one row at a time (the same code for every R) */

#if defined(LP_NEON)
/* sum of a[i] * x[i] over 32 lanes: a as two int8x16 (values small enough for int16), x int16 */
INLINE int32x4_t dot32(int8x16_t a0, int8x16_t a1, const int16_t *x) {
    int16x8_t w0 = vmovl_s8(vget_low_s8(a0)), w1 = vmovl_s8(vget_high_s8(a0));
    int16x8_t w2 = vmovl_s8(vget_low_s8(a1)), w3 = vmovl_s8(vget_high_s8(a1));
    int32x4_t s = vmull_s16(vget_low_s16(w0), vld1_s16(x));
    s = vmlal_s16(s, vget_high_s16(w0), vld1_s16(x + 4));
    s = vmlal_s16(s, vget_low_s16(w1), vld1_s16(x + 8));
    s = vmlal_s16(s, vget_high_s16(w1), vld1_s16(x + 12));
    s = vmlal_s16(s, vget_low_s16(w2), vld1_s16(x + 16));
    s = vmlal_s16(s, vget_high_s16(w2), vld1_s16(x + 20));
    s = vmlal_s16(s, vget_low_s16(w3), vld1_s16(x + 24));
    return vmlal_s16(s, vget_high_s16(w3), vld1_s16(x + 28));
}
#endif

static void int4_row(const int16_t *xq, const float *xd, const float *xs, int64_t G, const uint8_t *w,
                     const uint16_t *sz, float *o) {
    float mins[TILE] = {0.0f, 0.0f, 0.0f, 0.0f};
#if defined(LP_NEON)
    float32x4_t acc[TILE];
    for (int c = 0; c < TILE; c++) acc[c] = vdupq_n_f32(0.0f);
#else
    float acc[TILE] = {0.0f, 0.0f, 0.0f, 0.0f};
#endif
    for (int64_t g = 0; g < G; g++) {
        const int16_t *xb = xq + g * QK;
        for (int c = 0; c < TILE; c++) {
            const uint8_t *b = w + (g * TILE + c) * 16;
            float d = bf16_to_f32(sz[g * 2 * TILE + c]), z = bf16_to_f32(sz[g * 2 * TILE + TILE + c]);
#if defined(LP_NEON)
            uint8x16_t bv = vld1q_u8(b);
            int32x4_t p = dot32(vreinterpretq_s8_u8(vandq_u8(bv, vdupq_n_u8(0x0F))), vreinterpretq_s8_u8(vshrq_n_u8(bv, 4)), xb);
            acc[c] = vmlaq_n_f32(acc[c], vcvtq_f32_s32(p), d * xd[g]);
#else
            int32_t s = 0;
            for (int j = 0; j < 16; j++) s += (b[j] & 0x0F) * xb[j] + (b[j] >> 4) * xb[j + 16];
            acc[c] += (d * xd[g]) * (float)s;
#endif
            mins[c] += (z - 8.0f * d) * xs[g];
        }
    }
#if defined(LP_NEON)
    for (int c = 0; c < TILE; c++) o[c] = vaddvq_f32(acc[c]) + mins[c];
#else
    for (int c = 0; c < TILE; c++) o[c] = acc[c] + mins[c];
#endif
}

static void int8_row(const int16_t *xq, const float *xd, int64_t G, const int8_t *w, const float *scale, float *o) {
#if defined(LP_NEON)
    float32x4_t acc[TILE];
    for (int c = 0; c < TILE; c++) acc[c] = vdupq_n_f32(0.0f);
#else
    float acc[TILE] = {0.0f, 0.0f, 0.0f, 0.0f};
#endif
    for (int64_t g = 0; g < G; g++) {
        const int16_t *xb = xq + g * QK;
        for (int c = 0; c < TILE; c++) {
            const int8_t *wb = w + (g * TILE + c) * QK;
#if defined(LP_NEON)
            int32x4_t p = dot32(vld1q_s8(wb), vld1q_s8(wb + 16), xb);
            acc[c] = vmlaq_n_f32(acc[c], vcvtq_f32_s32(p), xd[g]);
#else
            int32_t s = 0;
            for (int j = 0; j < QK; j++) s += wb[j] * xb[j];
            acc[c] += xd[g] * (float)s;
#endif
        }
    }
#if defined(LP_NEON)
    for (int c = 0; c < TILE; c++) o[c] = vaddvq_f32(acc[c]) * scale[c];
#else
    for (int c = 0; c < TILE; c++) o[c] = acc[c] * scale[c];
#endif
}

INLINE void int4_tile(const int R, const int16_t *xq, const float *xd, const float *xs, int64_t G,
                      const uint8_t *w, const uint16_t *sz, float *o) {
    for (int r = 0; r < R; r++) int4_row(xq + r * G * QK, xd + r * G, xs + r * G, G, w, sz, o + r * TILE);
}

INLINE void int8_tile(const int R, const int16_t *xq, const float *xd, int64_t G, const int8_t *w,
                      const float *scale, float *o) {
    for (int r = 0; r < R; r++) int8_row(xq + r * G * QK, xd + r * G, G, w, scale, o + r * TILE);
}
#endif

typedef struct { int16_t *xq; float *xd, *xs; int64_t G; } qrows;

static int quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K, qrows *r) {
    r->G = (K + QK - 1) / QK;
    r->xq = (int16_t *)malloc((size_t)(M * r->G * QK) * sizeof(int16_t));
    r->xd = (float *)malloc((size_t)(2 * M * r->G) * sizeof(float));
    if (!r->xq || !r->xd) { free(r->xq); free(r->xd); return -1; }
    r->xs = r->xd + M * r->G;
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * ldx, K, r->xq + m * r->G * QK, r->xd + m * r->G, r->xs + m * r->G);
    return 0;
}

static inline void store(float *out, int64_t ldo, int64_t m, int64_t n0, int64_t N, const float *o) {
    for (int c = 0; c < TILE && n0 + c < N; c++) out[m * ldo + n0 + c] = o[c];
}

/* Tiles [t0, t1) of a product: every row of x against the tile's TILE output features. */
typedef struct {
    const qrows *r;
    int64_t M, N, ldo;
    const void *w, *s;  /* int4: bytes and bf16 scales / zeros; int8: int8 weights and float scales */
    float *out;
} job;

static void int4_tiles(const job *j, int64_t t0, int64_t t1) {
    const qrows *r = j->r;
    int64_t G = r->G;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *wt = (const uint8_t *)j->w + t * TILE * G * 16;
        const uint16_t *st = (const uint16_t *)j->s + t * TILE * G * 2;
        float o[2 * TILE];
        int64_t m = 0;
        for (; m + 2 <= j->M; m += 2) {
            int4_tile(2, r->xq + m * G * QK, r->xd + m * G, r->xs + m * G, G, wt, st, o);
            store(j->out, j->ldo, m, t * TILE, j->N, o);
            store(j->out, j->ldo, m + 1, t * TILE, j->N, o + TILE);
        }
        if (m < j->M) {
            int4_tile(1, r->xq + m * G * QK, r->xd + m * G, r->xs + m * G, G, wt, st, o);
            store(j->out, j->ldo, m, t * TILE, j->N, o);
        }
    }
}

static void int8_tiles(const job *j, int64_t t0, int64_t t1) {
    const qrows *r = j->r;
    int64_t G = r->G;
    for (int64_t t = t0; t < t1; t++) {
        const int8_t *wt = (const int8_t *)j->w + t * TILE * G * QK;
        const float *st = (const float *)j->s + t * TILE;
        float o[2 * TILE];
        int64_t m = 0;
        for (; m + 2 <= j->M; m += 2) {
            int8_tile(2, r->xq + m * G * QK, r->xd + m * G, G, wt, st, o);
            store(j->out, j->ldo, m, t * TILE, j->N, o);
            store(j->out, j->ldo, m + 1, t * TILE, j->N, o + TILE);
        }
        if (m < j->M) {
            int8_tile(1, r->xq + m * G * QK, r->xd + m * G, G, wt, st, o);
            store(j->out, j->ldo, m, t * TILE, j->N, o);
        }
    }
}

/* Quantize x's rows, then the tiles on `nthreads` threads, each a contiguous share of the output features
   (one thread: no parallel region at all). 0, or -1: no memory. */
static int run(void (*tiles_fn)(const job *, int64_t, int64_t), const float *x, int64_t ldx, int64_t M, int64_t K,
               const void *w, const void *s, int64_t N, float *out, int64_t ldo, int nthreads) {
    qrows r;
    if (quantize_rows(x, ldx, M, K, &r)) return -1;
    job j = {&r, M, N, ldo, w, s, out};
    int64_t tiles = (N + TILE - 1) / TILE;
#ifdef _OPENMP
    if (nthreads > 1 && tiles >= 2 * nthreads) {
        #pragma omp parallel num_threads(nthreads)
        {
            int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
            tiles_fn(&j, tiles * i / n, tiles * (i + 1) / n);
        }
    } else
#endif
        tiles_fn(&j, 0, tiles);
    free(r.xq);
    free(r.xd);
    return 0;
}

/* x [M, K] (rows ldx floats apart) @ int4 W [N, K].T -> out [M, N] (rows ldo apart). 0, or -1: no memory. */
int lp_int4_mm(const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *w, const uint16_t *sz,
               int64_t N, float *out, int64_t ldo, int nthreads) {
    return run(int4_tiles, x, ldx, M, K, w, sz, N, out, ldo, nthreads);
}

/* x [M, K] @ int8 W [N, Kp].T (one scale per row of W) -> out [M, N]. 0, or -1: no memory. */
int lp_int8_mm(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w, const float *scale,
               int64_t N, float *out, int64_t ldo, int nthreads) {
    return run(int8_tiles, x, ldx, M, K, w, scale, N, out, ldo, nthreads);
}

/* ------------------------------------------------------------------------------------------------------------
   Whole decoder layers (stage_node.model.shard's native path): a CPU stage whose layers are all quantized
   by these kernels, with float32 activations and KV and Llama-style layers (RMSNorm, fused q/k/v and
   gate/up, rotate-half RoPE over whole heads, grouped-query attention, SwiGLU or GeGLU; optional biases,
   per-head q/k norms, layers without RoPE, sliding windows), runs every layer of a step in one call
   instead of some twenty torch operations a layer (on a small model most of a decode step's time).

   Every row is computed on its own: its norms, products (the tiles above), RoPE, attention over its
   sequence's positions [lo, pos] and activations never read another row's numbers but through the
   KV pool, so a row's result is the same alone or among others, in a prompt chunk of any size or as a
   decode row, and in a replay. Threads split the output features of the products and the (row, head)
   pairs of attention, never a sum.

   The KV pool is [layers, 2 (k, v), kv_heads, slots, head_dim] float32; row r of the step writes its keys
   and values at slot write_slots[r] of every layer, then attends over the slots table[row_seq[r]][j] of
   positions j in [lo, pos[r]] (lo = pos[r] - window + 1 with a window). lp_layers_pools takes a pool
   per layer (lp_pool: its tensor, slot tables and write slots): sliding-window layers that hold only
   their window keep it in a pool of their own, whose tables are real from the window's first position. cos and sin_signed are the RoPE
   tables [positions, head_dim] (stage_node.model.rope: x * cos + roll(x, half) * sin_signed). */

typedef struct { const void *w, *s; int64_t n, fmt; } lp_mat;  /* fmt 4: int4, 8: int8 */

typedef struct {
    lp_mat qkv, o, gate_up, down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;  /* NULL: none */
    const float *input_norm, *post_norm;                        /* [hidden] */
    const float *qk_norm;                                       /* [heads + kv_heads, head_dim] or NULL */
    int64_t rope, window;                                       /* rope 0: a layer without; window 0: none */
} lp_layer;

/* A KV pool a step reads and writes (lp_layers_pools): kv [layers, 2, kv_heads, slots, head_dim]; table
   [seqs, table_len]: each sequence's slot of each position (only the positions a row reads need be
   real: a sliding-window pool's given-back positions before the window are never read); write_slots
   [T]: the slot each row writes. A stage whose sliding-window layers hold only their window keeps them
   in a second pool beside the full layers' (stage_node.engine.window). */
typedef struct {
    float *kv;
    int64_t slots;
    const int64_t *table;
    int64_t table_len;
    const int64_t *write_slots;
} lp_pool;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, slots;   /* slots: lp_layers' pool's third axis */
    double eps, scale;
    int64_t act;                                                /* 0: SiLU, 1: GELU (tanh) */
} lp_dims;

static int mat_mm(const lp_mat *m, const float *x, int64_t ldx, int64_t M, int64_t K, float *out, int64_t ldo,
                  int nt) {
    return run(m->fmt == 4 ? int4_tiles : int8_tiles, x, ldx, M, K, m->w, m->s, m->n, out, ldo, nt);
}

static void add_bias(float *y, int64_t ld, int64_t M, int64_t N, const float *b) {
    if (!b) return;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) y[m * ld + n] += b[n];
}

/* y = x / sqrt(mean(x^2) + eps) * w (w NULL: 1) */
static void rms_norm_row(const float *x, const float *w, float *y, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w ? (x[i] * r) * w[i] : x[i] * r;
}

static void rope_head(float *x, const float *cos, const float *sin_signed, int64_t hd) {
    float t[512];
    int64_t half = hd / 2;
    memcpy(t, x, (size_t)hd * sizeof(float));
    for (int64_t j = 0; j < hd; j++) x[j] = t[j] * cos[j] + t[(j + half) % hd] * sin_signed[j];
}

static inline float dot(const float *a, const float *b, int64_t n) {
#if defined(LP_AVX2)
    if (n % 8 == 0) {
        __m256 s = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
        return hsum8(s);
    }
#elif defined(LP_NEON)
    if (n % 4 == 0) {
        float32x4_t s = vdupq_n_f32(0.0f);
        for (int64_t i = 0; i < n; i += 4) s = vfmaq_f32(s, vld1q_f32(a + i), vld1q_f32(b + i));
        return vaddvq_f32(s);
    }
#endif
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {  /* y += a * x */
#if defined(LP_AVX2)
    if (n % 8 == 0) {
        __m256 av = _mm256_set1_ps(a);
        for (int64_t i = 0; i < n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        return;
    }
#elif defined(LP_NEON)
    if (n % 4 == 0) {
        for (int64_t i = 0; i < n; i += 4) vst1q_f32(y + i, vfmaq_n_f32(vld1q_f32(y + i), vld1q_f32(x + i), a));
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* ---------------------------------------------------------------------------------------------------
   Attention over a paged KV pool, read in place (lp_attend: stage_node.model.shard's torch forward on a
   CPU; and lp_layers_pools' attention). Float32 KV, or 8-bit (--kv-dtype int8: each (token, KV head)
   vector int8 values with a scale and a mid, two bfloat16 in one 32-bit word (mid high, scale low),
   x = mid + q * scale, engine.kv_quant; read a byte an element, never dequantized into a copy):
       score_j = ((q . k_j) [* ks_j + km_j * sum(q)]) * scale,
       out = sum_j p_j [* vs_j] * v_j [+ sum_j p_j * vm_j]   (p = softmax)
   k, v [kv_heads, slots, hd] (one layer's pool; ks, vs [kv_heads, slots] with int8); row r of q (rows
   ldq floats apart, heads hd apart) attends over the slots table[row_seq[r]][j] of the positions j in
   [lo, pos[r]] (lo = pos[r] - window + 1 with a window, else 0): causal within a prompt chunk, whose
   rows' keys are in the pool before any row reads -> out (rows ldo apart, heads hd apart). No gather:
   each key is read from its slot where it lies.

   Softmax online, over blocks of ATT_BLOCK positions at multiples of ATT_BLOCK: per (row, head) a
   running max, sum and output, rescaled when the max grows. A block is read once for a tile of
   consecutive rows of one sequence times the `group` query heads of one KV head (grouped-query heads
   share each key; none is copied). Batch invariance: a (row, head) takes its blocks, and the positions
   within a block, in the same order by the same instructions whatever rows are beside it (a block it
   does not see is skipped for it, not masked), so a row's result does not depend on its step; threads
   split the (tile, KV head) pairs, never a sum. */

#define ATT_BLOCK 64
#define ATT_PAIRS 64  /* (row, query head) pairs of a tile at most: ATT_PAIRS / group rows (at least 1) */

static inline float dot_i8(const float *a, const int8_t *b, int64_t n) {
#if defined(LP_AVX2)
    if (n % 8 == 0) {
        __m256 s = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) {
            __m256 bf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + i))));
            s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), bf, s);
        }
        return hsum8(s);
    }
#elif defined(LP_NEON)
    if (n % 8 == 0) {
        float32x4_t s = vdupq_n_f32(0.0f);
        for (int64_t i = 0; i < n; i += 8) {
            int16x8_t w = vmovl_s8(vld1_s8(b + i));
            s = vfmaq_f32(s, vld1q_f32(a + i), vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))));
            s = vfmaq_f32(s, vld1q_f32(a + i + 4), vcvtq_f32_s32(vmovl_s16(vget_high_s16(w))));
        }
        return vaddvq_f32(s);
    }
#endif
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * (float)b[i];
    return s;
}

static inline void axpy_i8(float *y, float a, const int8_t *x, int64_t n) {  /* y += a * x */
#if defined(LP_AVX2)
    if (n % 8 == 0) {
        __m256 av = _mm256_set1_ps(a);
        for (int64_t i = 0; i < n; i += 8) {
            __m256 xf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(x + i))));
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, xf, _mm256_loadu_ps(y + i)));
        }
        return;
    }
#elif defined(LP_NEON)
    if (n % 8 == 0) {
        for (int64_t i = 0; i < n; i += 8) {
            int16x8_t w = vmovl_s8(vld1_s8(x + i));
            vst1q_f32(y + i, vfmaq_n_f32(vld1q_f32(y + i), vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), a));
            vst1q_f32(y + i + 4, vfmaq_n_f32(vld1q_f32(y + i + 4), vcvtq_f32_s32(vmovl_s16(vget_high_s16(w))), a));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) y[i] += a * (float)x[i];
}

/* four keys' dot products with q, each summed as dot() / dot_i8() sums it (four chains side by side) */
INLINE void dot4(const int I8, const float *q, const void *k, const int64_t *at, int64_t hd, float *o) {
#if defined(LP_AVX2)
    if (hd % 8 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = 0; i < hd; i += 8) {
            __m256 a = _mm256_loadu_ps(q + i), k0, k1, k2, k3;
            if (I8) {
                const int8_t *b = (const int8_t *)k + i;
#define LP_I8(x) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(x))))
                k0 = LP_I8(b + at[0] * hd); k1 = LP_I8(b + at[1] * hd);
                k2 = LP_I8(b + at[2] * hd); k3 = LP_I8(b + at[3] * hd);
#undef LP_I8
            } else {
                const float *b = (const float *)k + i;
                k0 = _mm256_loadu_ps(b + at[0] * hd); k1 = _mm256_loadu_ps(b + at[1] * hd);
                k2 = _mm256_loadu_ps(b + at[2] * hd); k3 = _mm256_loadu_ps(b + at[3] * hd);
            }
            s0 = _mm256_fmadd_ps(a, k0, s0); s1 = _mm256_fmadd_ps(a, k1, s1);
            s2 = _mm256_fmadd_ps(a, k2, s2); s3 = _mm256_fmadd_ps(a, k3, s3);
        }
        o[0] = hsum8(s0); o[1] = hsum8(s1); o[2] = hsum8(s2); o[3] = hsum8(s3);
        return;
    }
#endif
    for (int c = 0; c < 4; c++)
        o[c] = I8 ? dot_i8(q, (const int8_t *)k + at[c] * hd, hd) : dot(q, (const float *)k + at[c] * hd, hd);
}

INLINE float bf16_hi(uint32_t w) { union { uint32_t u; float f; } c = {w & 0xFFFF0000u}; return c.f; }  /* mid */
INLINE float bf16_lo(uint32_t w) { union { uint32_t u; float f; } c = {w << 16}; return c.f; }  /* scale */

typedef struct {
    const void *k, *v;        /* one layer's [kv_heads, slots, hd]: float32, or int8 with ks, vs */
    const uint32_t *ks, *vs;  /* int8: [kv_heads, slots] (scale, mid) words; NULL with float32 */
    int64_t slots;
    const int64_t *table;  /* [seqs, table_len]: each sequence's slot of each position */
    int64_t table_len;
} lp_kv;

INLINE int64_t first_seen(int64_t pos, int64_t window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* rows [r0, r1) (consecutive rows of one sequence) x the query heads of KV head g */
INLINE void attend_tile(const int I8, const lp_kv *kv, const float *q, int64_t ldq, int64_t r0, int64_t r1,
                        int64_t g, int64_t group, int64_t hd, const int64_t *row_seq, const int64_t *pos,
                        int64_t window, float scale, float *out, int64_t ldo) {
    float m[ATT_PAIRS], l[ATT_PAIRS], off[ATT_PAIRS], s[ATT_BLOCK];  /* off: sum_j p_j vm_j (int8) */
    const int64_t *sl = kv->table + row_seq[r0] * kv->table_len;
    const int64_t esz = I8 ? 1 : (int64_t)sizeof(float);
    const char *kb = (const char *)kv->k + g * kv->slots * hd * esz, *vb = (const char *)kv->v + g * kv->slots * hd * esz;
    const uint32_t *ksb = I8 ? kv->ks + g * kv->slots : NULL, *vsb = I8 ? kv->vs + g * kv->slots : NULL;
    int64_t lo_t = INT64_MAX, hi_t = -1;
    for (int64_t r = r0; r < r1; r++) {
        int64_t lo = first_seen(pos[r], window);
        lo_t = lo < lo_t ? lo : lo_t;
        hi_t = pos[r] > hi_t ? pos[r] : hi_t;
        for (int64_t c = 0; c < group; c++) {
            m[(r - r0) * group + c] = -INFINITY;
            l[(r - r0) * group + c] = 0.0f;
            off[(r - r0) * group + c] = 0.0f;
            memset(out + r * ldo + (g * group + c) * hd, 0, (size_t)hd * sizeof(float));
        }
    }
    for (int64_t b = lo_t / ATT_BLOCK * ATT_BLOCK; b <= hi_t; b += ATT_BLOCK) {
        for (int64_t r = r0; r < r1; r++) {
            int64_t lo = first_seen(pos[r], window), a = b > lo ? b : lo;
            int64_t e = b + ATT_BLOCK - 1 < pos[r] ? b + ATT_BLOCK - 1 : pos[r];
            if (a > e) continue;
            for (int64_t c = 0; c < group; c++) {
                int64_t i = (r - r0) * group + c, hh = g * group + c, j = a;
                const float *qr = q + r * ldq + hh * hd;
                float *o = out + r * ldo + hh * hd, top = -INFINITY, qsum = 0.0f;
                if (I8)
                    for (int64_t d = 0; d < hd; d++) qsum += qr[d];
                for (; j + 4 <= e + 1; j += 4) dot4(I8, qr, kb, sl + j, hd, s + (j - a));
                for (; j <= e; j++) {  /* the last few: one key in all four chains */
                    float one[4];
                    dot4(I8, qr, kb, (const int64_t[4]){sl[j], sl[j], sl[j], sl[j]}, hd, one);
                    s[j - a] = one[0];
                }
                for (j = a; j <= e; j++) {
                    float x = I8 ? (s[j - a] * bf16_lo(ksb[sl[j]]) + bf16_hi(ksb[sl[j]]) * qsum) * scale
                                 : s[j - a] * scale;
                    s[j - a] = x;
                    top = x > top ? x : top;
                }
                if (top > m[i]) {  /* the running max grows: what is summed so far is rescaled */
                    float alpha = expf(m[i] - top);
                    l[i] *= alpha;
                    off[i] *= alpha;
                    for (int64_t d = 0; d < hd; d++) o[d] *= alpha;
                    m[i] = top;
                }
                for (j = a; j <= e; j++) {
                    float p = expf(s[j - a] - m[i]);
                    l[i] += p;
                    if (I8) {
                        axpy_i8(o, p * bf16_lo(vsb[sl[j]]), (const int8_t *)vb + sl[j] * hd, hd);
                        off[i] += p * bf16_hi(vsb[sl[j]]);
                    } else axpy(o, p, (const float *)vb + sl[j] * hd, hd);
                }
            }
        }
    }
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c = 0; c < group; c++) {
            float inv = 1.0f / l[(r - r0) * group + c], *o = out + r * ldo + (g * group + c) * hd;
            if (I8)
                for (int64_t d = 0; d < hd; d++) o[d] = (o[d] + off[(r - r0) * group + c]) * inv;
            else
                for (int64_t d = 0; d < hd; d++) o[d] *= inv;
        }
}

/* Every row of a step (q rows ldq apart) over its sequence's positions, into out (rows ldo apart).
   0, or -1: no memory. */
static int attend_rows(const int I8, const lp_kv *kv, const float *q, int64_t ldq, int64_t T, int64_t nh,
                       int64_t kvh, int64_t hd, const int64_t *row_seq, const int64_t *pos, int64_t window,
                       float scale, float *out, int64_t ldo, int nt) {
    const int64_t group = nh / kvh, per = ATT_PAIRS / group > 0 ? ATT_PAIRS / group : 1;
    if (group > ATT_PAIRS) return -2;
    int64_t *tiles = (int64_t *)malloc((size_t)(T + 1) * sizeof(int64_t)), n = 0;
    if (!tiles) return -1;
    for (int64_t r = 0; r < T; r++)  /* a tile: up to `per` consecutive rows of one sequence */
        if (!n || row_seq[r] != row_seq[tiles[n - 1]] || r - tiles[n - 1] >= per) tiles[n++] = r;
    tiles[n] = T;
    int64_t items = n * kvh;
    int threads = nt > 1 ? nt : 1;
#ifdef _OPENMP
    #pragma omp parallel for num_threads(threads) schedule(dynamic) if (threads > 1 && items >= 2)
#endif
    for (int64_t i = 0; i < items; i++) {
        int64_t t = i / kvh, g = i % kvh;
        if (I8) attend_tile(1, kv, q, ldq, tiles[t], tiles[t + 1], g, group, hd, row_seq, pos, window, scale, out, ldo);
        else attend_tile(0, kv, q, ldq, tiles[t], tiles[t + 1], g, group, hd, row_seq, pos, window, scale, out, ldo);
    }
    (void)threads;
    free(tiles);
    return 0;
}

/* One layer's attention (see above): q [T, heads, hd] float32; k, v [kv_heads, slots, hd] float32, or int8
   with ks, vs [kv_heads, slots] (scale, mid) words (ks NULL: float32) -> out [T, heads * hd]. 0, -1: no memory, -2: more
   query heads a KV head than ATT_PAIRS. */
int lp_attend(const float *q, int64_t T, int64_t nh, int64_t kvh, int64_t hd, const void *k, const void *v,
              const uint32_t *ks, const uint32_t *vs, int64_t slots, const int64_t *table, int64_t table_len,
              const int64_t *row_seq, const int64_t *pos, int64_t window, double scale, float *out, int nt) {
    lp_kv kv = {k, v, ks, vs, slots, table, table_len};
    return attend_rows(ks != NULL, &kv, q, nh * hd, T, nh, kvh, hd, row_seq, pos, window, (float)scale, out,
                       nh * hd, nt);
}

static inline float act_fn(float g, int64_t act) {
    if (act == 1) return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    return g / (1.0f + expf(-g));
}

/* Layers [0, nl) of `L` over x [T, hidden] in place (the residual stream), layer l's KV the layer
   where[2 l + 1] of pools[where[2 l]] (npools of them). 0, or -1: no memory, -2: a head larger than 512 or more than
   ATT_PAIRS query heads a KV head. */
int lp_layers_pools(const lp_dims *d, const lp_layer *L, int64_t nl, float *x, int64_t T, const int64_t *pos,
                    const int64_t *row_seq, const lp_pool *pools, int64_t npools, const int64_t *where,
                    const float *cos, const float *sin_signed, int nt) {
    const int64_t H = d->hidden, nh = d->heads, kvh = d->kv_heads, hd = d->head_dim, I = d->inter;
    const int64_t qn = nh * hd, kvn = kvh * hd, QKV = qn + 2 * kvn;
    const float eps = (float)d->eps, scale = (float)d->scale;
    (void)npools;
    if (hd > 512) return -2;
    float *h = (float *)malloc((size_t)(T * H) * sizeof(float));
    float *qkv = (float *)malloc((size_t)(T * QKV) * sizeof(float));
    float *att = (float *)malloc((size_t)(T * qn) * sizeof(float));
    float *gu = (float *)malloc((size_t)(T * 2 * I) * sizeof(float));
    float *tmp = (float *)malloc((size_t)(T * H) * sizeof(float));
    int rc = (h && qkv && att && gu && tmp) ? 0 : -1;
    for (int64_t l = 0; l < nl && !rc; l++) {
        const lp_layer *w = L + l;
        const lp_pool *P = pools + where[2 * l];
        const int64_t slots = P->slots, part = kvh * slots * hd;  /* floats of one (layer, k or v) */
        const int64_t *table = P->table, table_len = P->table_len, *write_slots = P->write_slots;
        float *kl = P->kv + 2 * where[2 * l + 1] * part, *vl = kl + part;
        for (int64_t r = 0; r < T; r++) rms_norm_row(x + r * H, w->input_norm, h + r * H, H, eps);
        if ((rc = mat_mm(&w->qkv, h, H, T, H, qkv, QKV, nt))) break;
        add_bias(qkv, QKV, T, QKV, w->qkv_bias);
        for (int64_t r = 0; r < T; r++) {
            float *q = qkv + r * QKV, *k = q + qn, *v = k + kvn;
            if (w->qk_norm)
                for (int64_t i = 0; i < nh + kvh; i++) rms_norm_row(q + i * hd, NULL, q + i * hd, hd, eps);
            if (w->qk_norm)
                for (int64_t i = 0; i < (nh + kvh) * hd; i++) q[i] *= w->qk_norm[i];
            if (w->rope)
                for (int64_t i = 0; i < nh + kvh; i++) rope_head(q + i * hd, cos + pos[r] * hd, sin_signed + pos[r] * hd, hd);
            for (int64_t g = 0; g < kvh; g++) {
                memcpy(kl + (g * slots + write_slots[r]) * hd, k + g * hd, (size_t)hd * sizeof(float));
                memcpy(vl + (g * slots + write_slots[r]) * hd, v + g * hd, (size_t)hd * sizeof(float));
            }
        }
        lp_kv kv = {kl, vl, NULL, NULL, slots, table, table_len};
        if ((rc = attend_rows(0, &kv, qkv, QKV, T, nh, kvh, hd, row_seq, pos, w->window, scale, att, qn, nt))) break;
        if ((rc = mat_mm(&w->o, att, qn, T, qn, tmp, H, nt))) break;
        add_bias(tmp, H, T, H, w->o_bias);
        for (int64_t i = 0; i < T * H; i++) x[i] += tmp[i];
        for (int64_t r = 0; r < T; r++) rms_norm_row(x + r * H, w->post_norm, h + r * H, H, eps);
        if ((rc = mat_mm(&w->gate_up, h, H, T, H, gu, 2 * I, nt))) break;
        add_bias(gu, 2 * I, T, 2 * I, w->gate_up_bias);
        for (int64_t r = 0; r < T; r++) {
            float *g = gu + r * 2 * I;
            for (int64_t i = 0; i < I; i++) g[i] = act_fn(g[i], d->act) * g[I + i];
        }
        if ((rc = mat_mm(&w->down, gu, 2 * I, T, I, tmp, H, nt))) break;
        add_bias(tmp, H, T, H, w->down_bias);
        for (int64_t i = 0; i < T * H; i++) x[i] += tmp[i];
    }
    free(h); free(qkv); free(att); free(gu); free(tmp);
    return rc;
}

/* lp_layers_pools over one pool kv (d->slots slots), layer l its layer l. */
int lp_layers(const lp_dims *d, const lp_layer *L, int64_t nl, float *x, int64_t T, const int64_t *pos,
              const int64_t *row_seq, const int64_t *table, int64_t table_len, const int64_t *write_slots,
              float *kv, const float *cos, const float *sin_signed, int nt) {
    lp_pool one = {kv, d->slots, table, table_len, write_slots};
    int64_t *where = (int64_t *)malloc((size_t)(2 * (nl > 0 ? nl : 1)) * sizeof(int64_t));
    if (!where) return -1;
    for (int64_t l = 0; l < nl; l++) { where[2 * l] = 0; where[2 * l + 1] = l; }
    int rc = lp_layers_pools(d, L, nl, x, T, pos, row_seq, &one, 1, where, cos, sin_signed, nt);
    free(where);
    return rc;
}

/* ---- 8-bit KV on a CPU (stage_node.engine.kv_quant): the rotation and int8's quantization, row by row ----

   The same float32 operations in the same order as kv_quant's torch code (so the same bits): the rotation
   x R = hadamard(x * signs) and its inverse y R^T = hadamard(y) * signs, where hadamard is the
   Walsh-Hadamard butterflies (a + b, a - b) in blocks of b (the largest power of two dividing d), then a
   multiply by (float)(1 / sqrt(b)); int8's [min, max] grid centred on mid = bf16(round to nearest even of
   (max + min) * 0.5), scale = bf16 rounded up of max(max - mid, mid - min) / 127, q = round half to even of
   (x - mid) / max(scale, 1e-30), clamped to [-127, 127]; (scale, mid) packed in one 32-bit word (mid's
   bits high). Rows are independent: threads split rows only. What torch did in 20-odd small operations a
   call (the butterflies: a stack per stage) cost an 8-row decode step of the default model ~45 ms. */
#define KVQ_MAX_D 4096

static void fwht_row(float *x, int64_t d, int64_t b, float s) {
    for (int64_t h = 1; h < b; h *= 2)
        for (int64_t i = 0; i < d; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                float a = x[j], c = x[j + h];
                x[j] = a + c;
                x[j + h] = a - c;
            }
    for (int64_t j = 0; j < d; j++) x[j] *= s;
}

static inline float rotation_scale(int64_t b) { return (float)(1.0 / sqrt((double)b)); }

/* x [rows, d] float32 in place: inverse 0: x R (signs, butterflies); 1: x R^T (butterflies, signs). */
int lp_rotate(float *x, int64_t rows, int64_t d, const float *signs, int inverse, int nt) {
    const int64_t b = d & -d;
    const float s = rotation_scale(b);
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (rows * d >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + r * d;
        if (!inverse)
            for (int64_t j = 0; j < d; j++) row[j] *= signs[j];
        fwht_row(row, d, b, s);
        if (inverse)
            for (int64_t j = 0; j < d; j++) row[j] *= signs[j];
    }
    return 0;
}

static inline float bf16_near(float f) {  /* torch's float -> bfloat16 (round to nearest even; NaN stays NaN) */
    if (f != f) return f;
    uint32_t u = f32_bits(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return bits_f32(u & 0xFFFF0000u);
}

static inline float bf16_up(float f) { return bits_f32((uint32_t)((int32_t)f32_bits(f) + 0xFFFF) & 0xFFFF0000u); }

/* One vector v [d] -> q [d] int8 and its packed (scale, mid) word; signs non-NULL: of v R (buf: d floats). */
static void kv_int8_row(const float *v, int64_t d, const float *signs, int8_t *q, int32_t *packed, float *buf) {
    if (signs) {
        const int64_t b = d & -d;
        for (int64_t j = 0; j < d; j++) buf[j] = v[j] * signs[j];
        fwht_row(buf, d, b, rotation_scale(b));
        v = buf;
    }
    float lo = v[0], hi = v[0];
    for (int64_t j = 1; j < d; j++) {
        lo = v[j] < lo ? v[j] : lo;
        hi = v[j] > hi ? v[j] : hi;
    }
    const float mid = bf16_near((hi + lo) * 0.5f);
    const float a = hi - mid, c = mid - lo;
    const float scale = bf16_up((a > c ? a : c) / 127.0f);
    const float div = scale > 1e-30f ? scale : 1e-30f;
    for (int64_t j = 0; j < d; j++) {
        float t = nearbyintf((v[j] - mid) / div);
        t = t < -127.0f ? -127.0f : (t > 127.0f ? 127.0f : t);
        q[j] = (int8_t)t;
    }
    *packed = (int32_t)((f32_bits(mid) & 0xFFFF0000u) | ((f32_bits(scale) >> 16) & 0xFFFFu));
}

/* x [rows, d] float32 -> q [rows, d] int8 and packed [rows] (scale, mid) words. */
int lp_kv_int8(const float *x, int64_t rows, int64_t d, int8_t *q, int32_t *packed, int nt) {
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (rows * d >= 32768)
    for (int64_t r = 0; r < rows; r++)
        kv_int8_row(x + r * d, d, NULL, q + r * d, packed + r, NULL);
    return 0;
}

/* A step's new keys or values x [T, kvh, d] float32 quantized (rotated with signs non-NULL) straight into
   one layer's part of an int8 pool: dst [kvh, n_slots, d] int8 and scales [kvh, n_slots] at slots [T] (what
   lp_kv_int8 and two index copies do, without the copies). 0, or -1: d above KVQ_MAX_D. */
int lp_kv_store_int8(const float *x, int64_t T, int64_t kvh, int64_t d, const int64_t *slots, const float *signs,
                     int8_t *dst, int32_t *scales, int64_t n_slots, int nt) {
    if (d > KVQ_MAX_D) return -1;
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (T * kvh * d >= 32768)
    for (int64_t r = 0; r < T * kvh; r++) {
        float buf[KVQ_MAX_D];
        const int64_t t = r / kvh, h = r % kvh, at = h * n_slots + slots[t];
        kv_int8_row(x + r * d, d, signs, dst + at * d, scales + at, buf);
    }
    return 0;
}
