/* bfloat16 matmuls with AVX512-BF16 dot products (vdpbf16ps): kvserve's CPU kernel for
 * `--dtype bfloat16` linear layers on CPUs that have those instructions but no AMX.
 *
 * Contract (kvserve_bf16_matmul): y[M, N] = x[M, K] @ W^T (+ bias), x bfloat16 with row stride
 * x_stride (elements; K even, contiguous rows), W prepacked (see below), bias float32 [N] or
 * NULL, y float32 or (y_bf16) bfloat16 rounded to nearest even, row stride y_stride. Products of
 * bf16 pairs are exact in float32 and accumulate in float32. Returns 0; -1 where this build has
 * no AVX512-BF16 (the caller then takes oneDNN's path).
 *
 * Packed layout: W [N, K] zero-padded to [Np, K] (Np a multiple of GROUP = 64 columns), then
 * [Np / 64][K / 2][64 columns][2 k]: for each pair of k, the 64 columns' two weights side by
 * side, so one 64-byte load feeds 16 columns' dot products and a group streams in order.
 *
 * How: a tile of up to MR rows x 64 columns keeps 4 x MR float32 accumulators in registers over
 * all of K; for each k pair, 4 weight loads and MR broadcasts of an activation pair feed 4 x MR
 * vdpbf16ps. Threads (OpenMP) take (column group, block of rows) items, a group's weights
 * staying in their L2 across its row blocks. */
#include <immintrin.h>
#include <stdint.h>

#include "layer_ops.h"
#include "vec_math.h"

#define GROUP 64 /* columns a tile covers: four 16-lane vectors */
#define MR 6 /* rows a tile covers: 4 x 6 = 24 accumulators of 32 registers */
#define ROW_BLOCK 48 /* rows an item covers (8 tiles), so wide inputs spread over threads */
#define INLINE static inline __attribute__((always_inline))

#ifdef __AVX512BF16__

/* One tile: rows [0, mr) of x against group g's packed weights, written to y (columns past n
 * masked off). mr is a constant at each call site, so the accumulators live in registers. */
INLINE void tile(const uint16_t *x, long x_stride, const uint16_t *wg, long k2,
                 const float *bias, long col0, long n, void *y, long y_stride, int y_bf16,
                 int mr) {
    __m512 acc[MR][4];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (long kk = 0; kk < k2; kk++) {
        const uint16_t *w = wg + kk * 2 * GROUP;
        __m512bh wv[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + 32 * j);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            int32_t pair;  /* x[r][2kk], x[r][2kk + 1] */
            __builtin_memcpy(&pair, x + r * x_stride + 2 * kk, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const long c = col0 + 16 * j;
        if (c >= n) break;
        /* The last vector of the last group may be partial: lanes past n are neither read from
         * bias nor stored. */
        const __mmask16 mask =
            n - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - c)) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++)
            store16_masked((char *)y + r * y_stride * (y_bf16 ? 2 : 4), c,
                           _mm512_add_ps(acc[r][j], b), y_bf16, mask);
    }
}

int kvserve_bf16_matmul(const uint16_t *x, long x_stride, long m, const uint16_t *packed,
                        long n, long k, const float *bias, void *y, long y_stride, int y_bf16,
                        int num_threads) {
    if (k % 2) return -2;
    const long k2 = k / 2, groups = (n + GROUP - 1) / GROUP;
    const long blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK, items = groups * blocks;
    const long y_size = y_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (items > 1)
    for (long item = 0; item < items; item++) {
        const long g = item / blocks, row_end0 = (item % blocks + 1) * ROW_BLOCK;
        const long row_end = row_end0 < m ? row_end0 : m;
        const uint16_t *wg = packed + g * k2 * 2 * GROUP;
        for (long r0 = (item % blocks) * ROW_BLOCK; r0 < row_end; r0 += MR) {
            const uint16_t *xr = x + r0 * x_stride;
            char *yr = (char *)y + r0 * y_stride * y_size;
            const long rows = row_end - r0 < MR ? row_end - r0 : MR;
            const long col0 = g * GROUP;
            switch (rows) {  /* constant row counts: one register-resident loop each */
            case 6: tile(xr, x_stride, wg, k2, bias, col0, n, yr, y_stride, y_bf16, 6); break;
            case 5: tile(xr, x_stride, wg, k2, bias, col0, n, yr, y_stride, y_bf16, 5); break;
            case 4: tile(xr, x_stride, wg, k2, bias, col0, n, yr, y_stride, y_bf16, 4); break;
            case 3: tile(xr, x_stride, wg, k2, bias, col0, n, yr, y_stride, y_bf16, 3); break;
            case 2: tile(xr, x_stride, wg, k2, bias, col0, n, yr, y_stride, y_bf16, 2); break;
            default: tile(xr, x_stride, wg, k2, bias, col0, n, yr, y_stride, y_bf16, 1); break;
            }
        }
    }
    return 0;
}

#else

int kvserve_bf16_matmul(const uint16_t *x, long x_stride, long m, const uint16_t *packed,
                        long n, long k, const float *bias, void *y, long y_stride, int y_bf16,
                        int num_threads) {
    (void)x, (void)x_stride, (void)m, (void)packed, (void)n, (void)k, (void)bias, (void)y;
    (void)y_stride, (void)y_bf16, (void)num_threads;
    return -1;
}

#endif
