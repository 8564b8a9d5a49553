/* int8 x int8 matmuls with AVX512-VNNI dot products (vpdpbusd): kvserve's kernel for
 * `--quantization w8a8`, where a CPU multiplies int8 about twice as fast as bf16.
 *
 * Numerics: W [N, K] is int8 per output channel (w = sw[n] * qw, |qw| <= 127); each row of x
 * is rounded to int8 per block of ABLK inputs (symmetric, dx = max|x| / 127, round to nearest
 * even), so an outlier only coarsens its own block. Each block's dot product is exact in int32,
 * is scaled by its dx in float32 and accumulated in float32; sw and the bias come last.
 *
 * Contract (kvserve_i8_matmul): y[M, N] = x[M, K] @ W^T (+ bias), x float32 or (x_bf16)
 * bfloat16 with row stride x_stride (elements), W prepacked (below) with its scales sw [Np]
 * (Np: N padded to GROUP, zeros past N), bias float32 [N] or NULL, y float32 or (y_bf16)
 * bfloat16 rounded to nearest even, row stride y_stride. K must be a multiple of ABLK. Returns
 * 0; -1 where the activations' scratch cannot be allocated; -2 when K is not a multiple of
 * ABLK; -3 where this build has no AVX512-VNNI (the caller then takes another path).
 *
 * Packed layout: [Np / 32][K / 4][32 columns][4 k] of uint8 qw + 128: one 64-byte load feeds
 * 16 columns' four-k dot products. vpdpbusd multiplies unsigned by signed bytes, so the weights
 * are the unsigned side (offset by 128) and the activations the signed side, broadcast from
 * memory; the offset adds 128 * sum(qx) to every column of a block, a per-row constant taken
 * off once at the end: sum_b dx_b (acc_b - 128 s_b) = sum_b dx_b acc_b - c, c = 128 sum_b
 * dx_b s_b.
 *
 * How: a tile of up to MR rows x 32 columns keeps 2 x MR int32 block accumulators and 2 x MR
 * float32 accumulators in registers over all of K. Threads (OpenMP) take (column group, block
 * of rows) items, as bf16_matmul.c does. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "layer_ops.h"
#include "vec_math.h"

#define GROUP 32 /* columns a tile covers: two 16-lane vectors */
#define MR 6 /* rows a tile covers: 2 x 6 int32 + 2 x 6 float32 accumulators */
#define ABLK 32 /* inputs an activation scale covers */
#define ROW_BLOCK 48 /* rows an item covers (8 tiles) */
#define INLINE static inline __attribute__((always_inline))

#ifdef __AVX512VNNI__

/* Row t of x as int8 codes (K of them), its block scales dx and its offset term c. */
typedef struct { int8_t *q; float *d; float *c; long k; } act_rows;

static void quantize_row(const void *x, int x_bf16, const act_rows *a, long t) {
    const long blocks = a->k / ABLK;
    int8_t *q = a->q + t * a->k;
    float c = 0.0f;
    for (long b = 0; b < blocks; b++) {
        __m512 v[ABLK / 16];
        __m512 m = _mm512_setzero_ps();
        for (int i = 0; i < ABLK / 16; i++) {
            v[i] = load16(x, b * ABLK + 16 * i, x_bf16);
            m = _mm512_max_ps(m, _mm512_abs_ps(v[i]));
        }
        const float mx = _mm512_reduce_max_ps(m);
        const __m512 inv = _mm512_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
        __m512i s = _mm512_setzero_si512();
        for (int i = 0; i < ABLK / 16; i++) {
            const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));  /* |qi| <= 127 */
            s = _mm512_add_epi32(s, qi);
            _mm_storeu_si128((__m128i *)(q + b * ABLK + 16 * i), _mm512_cvtsepi32_epi8(qi));
        }
        const float d = mx / 127.0f;
        a->d[t * blocks + b] = d;
        c += d * (float)_mm512_reduce_add_epi32(s);
    }
    a->c[t] = 128.0f * c;
}

/* One tile: rows [0, mr) against group g's packed weights (columns past n masked off). */
INLINE void tile(const act_rows *a, long r0, const uint8_t *wg, const float *sw,
                 const float *bias, long col0, long n, void *y, long y_stride, int y_bf16,
                 int mr) {
    const long blocks = a->k / ABLK;
    __m512 acc[MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m512i blk[MR][2];
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) blk[r][0] = blk[r][1] = _mm512_setzero_si512();
        const uint8_t *w = wg + b * ABLK * GROUP;
        const int8_t *xq = a->q + r0 * a->k + b * ABLK;
#pragma GCC unroll 16
        for (int kk = 0; kk < ABLK / 4; kk++) {
            const __m512i w0 = _mm512_loadu_si512(w + kk * 4 * GROUP);
            const __m512i w1 = _mm512_loadu_si512(w + kk * 4 * GROUP + 64);
#pragma GCC unroll 6
            for (int r = 0; r < mr; r++) {
                int32_t quad;
                __builtin_memcpy(&quad, xq + r * a->k + 4 * kk, sizeof quad);
                const __m512i xv = _mm512_set1_epi32(quad);
                blk[r][0] = _mm512_dpbusd_epi32(blk[r][0], w0, xv);
                blk[r][1] = _mm512_dpbusd_epi32(blk[r][1], w1, xv);
            }
        }
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            const __m512 d = _mm512_set1_ps(a->d[(r0 + r) * blocks + b]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(blk[r][0]), d, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(blk[r][1]), d, acc[r][1]);
        }
    }
#pragma GCC unroll 2
    for (int j = 0; j < 2; j++) {
        const long c = col0 + 16 * j;
        if (c >= n) break;
        const __mmask16 mask =
            n - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - c)) - 1);
        const __m512 s = _mm512_loadu_ps(sw + c);  /* sw is padded to the group */
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            const __m512 v = _mm512_sub_ps(acc[r][j], _mm512_set1_ps(a->c[r0 + r]));
            store16_masked((char *)y + r * y_stride * (y_bf16 ? 2 : 4), c,
                           _mm512_fmadd_ps(v, s, bv), y_bf16, mask);
        }
    }
}

int kvserve_i8_matmul(const void *x, long x_stride, int x_bf16, long m, const uint8_t *packed,
                      const float *sw, long n, long k, const float *bias, void *y,
                      long y_stride, int y_bf16, int num_threads) {
    if (k % ABLK) return -2;
    const long blocks_k = k / ABLK;
    act_rows a = {malloc((size_t)(m * k)), malloc(sizeof(float) * (size_t)(m * (blocks_k + 1))),
                  NULL, k};
    if (a.q == NULL || a.d == NULL) {
        free(a.q);
        free(a.d);
        return -1;
    }
    a.c = a.d + m * blocks_k;
    const long x_size = x_bf16 ? 2 : 4, y_size = y_bf16 ? 2 : 4;
    const long groups = (n + GROUP - 1) / GROUP;
    const long row_blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK, items = groups * row_blocks;
#pragma omp parallel num_threads(num_threads) if (m * n > 4096)
    {
#pragma omp for schedule(static)
        for (long t = 0; t < m; t++)
            quantize_row((const char *)x + t * x_stride * x_size, x_bf16, &a, t);
#pragma omp for schedule(static)
        for (long item = 0; item < items; item++) {
            const long g = item / row_blocks, row_end0 = (item % row_blocks + 1) * ROW_BLOCK;
            const long row_end = row_end0 < m ? row_end0 : m;
            const uint8_t *wg = packed + g * k * GROUP;
            for (long r0 = (item % row_blocks) * ROW_BLOCK; r0 < row_end; r0 += MR) {
                char *yr = (char *)y + r0 * y_stride * y_size;
                const long rows = row_end - r0 < MR ? row_end - r0 : MR, col0 = g * GROUP;
                switch (rows) {  /* constant row counts: one register-resident loop each */
                case 6: tile(&a, r0, wg, sw, bias, col0, n, yr, y_stride, y_bf16, 6); break;
                case 5: tile(&a, r0, wg, sw, bias, col0, n, yr, y_stride, y_bf16, 5); break;
                case 4: tile(&a, r0, wg, sw, bias, col0, n, yr, y_stride, y_bf16, 4); break;
                case 3: tile(&a, r0, wg, sw, bias, col0, n, yr, y_stride, y_bf16, 3); break;
                case 2: tile(&a, r0, wg, sw, bias, col0, n, yr, y_stride, y_bf16, 2); break;
                default: tile(&a, r0, wg, sw, bias, col0, n, yr, y_stride, y_bf16, 1); break;
                }
            }
        }
    }
    free(a.q);
    free(a.d);
    return 0;
}

#else

int kvserve_i8_matmul(const void *x, long x_stride, int x_bf16, long m, const uint8_t *packed,
                      const float *sw, long n, long k, const float *bias, void *y,
                      long y_stride, int y_bf16, int num_threads) {
    (void)x, (void)x_stride, (void)x_bf16, (void)m, (void)packed, (void)sw, (void)n, (void)k;
    (void)bias, (void)y, (void)y_stride, (void)y_bf16, (void)num_threads;
    return -3;
}

#endif
