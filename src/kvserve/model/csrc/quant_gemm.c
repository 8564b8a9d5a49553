/* Many rows against GGUF blocks (prefill, batched decode) in the numerics of quant_matmul.c:
 * each block's dot product of int16 weight codes and int16 activation codes exact in int32,
 * scaled by d * dx and summed in float32, plus min * sum(x) for Q4 (w = d * q + min).
 *
 * How: the codes of a group of GROUP output columns are widened once per call into a per-thread
 * panel [K / 2][GROUP][2] of int16 (columns across the vector lanes, each lane a pair of k), then
 * every row runs against the panel with vpdpwssd (AVX512-VNNI: 32 int16 products a
 * instruction), a tile of MR rows x 32 columns keeping its int32 block sums and float32 sums in
 * registers. Widening costs about one pass over the group's codes, so it pays from a few rows
 * on (QGEMM_MIN_TOKENS); one row keeps quant_matmul.c's own paths.
 *
 * Contract (qgemm): out[t, n] for t < tokens, n < out_features, as kvserve_q4_matmul's (min
 * NULL: Q8_0, codes int8) from the int16 activations xr; in_features a multiple of 32.
 * Returns 0, or -1 when the panels cannot be allocated. Built where the compiler targets
 * AVX512-VNNI (QGEMM_BUILT in quant_rows.h); elsewhere quant_matmul.c keeps its own paths. */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>

#include "quant_rows.h"

#define GROUP 32
#define MR 6

#ifdef __AVX512VNNI__

/* Group g's codes as int16 pairs [K/2][GROUP][2], its scales and mins [blocks][GROUP]
 * (columns past out_features zero). */
static void widen_group(const void *codes, const uint16_t *scale, const uint16_t *min, long g,
                        long out_features, long in_features, int16_t *panel, float *ds,
                        float *ms) {
    const long blocks = in_features / 32;
    const __m512i lane = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                             5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(GROUP));
    for (long c = 0; c < GROUP; c++) {
        const long n = g * GROUP + c;
        for (long b = 0; b < blocks; b++) {
            __m512i w = _mm512_setzero_si512();
            float d = 0.0f, m = 0.0f;
            if (n < out_features) {
                if (min) {
                    w = q4_codes((const uint8_t *)codes + (n * blocks + b) * 16);
                    m = h2f(min[n * blocks + b]);
                } else {
                    w = q8_codes((const int8_t *)codes + (n * blocks + b) * 32);
                }
                d = h2f(scale[n * blocks + b]);
            }
            /* Lane p holds k = 2p, 2p + 1 of column c: to panel[(b * 16 + p) * GROUP + c]. */
            _mm512_i32scatter_epi32((int32_t *)panel + b * 16 * GROUP + c, lane, w, 4);
            ds[b * GROUP + c] = d;
            ms[b * GROUP + c] = m;
        }
    }
}

#define INLINE static inline __attribute__((always_inline))

INLINE void tile(const act_rows *xr, long t0, const int16_t *panel, const float *ds,
                 const float *ms, long blocks, long in_features, float *out, long out_stride,
                 long col0, long out_features, int has_min, int mr) {
    __m512 acc[MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m512i blk[MR][2];
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) blk[r][0] = blk[r][1] = _mm512_setzero_si512();
        const int16_t *w = panel + b * 16 * GROUP * 2;
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) {
            const __m512i w0 = _mm512_loadu_si512(w + p * GROUP * 2);
            const __m512i w1 = _mm512_loadu_si512(w + p * GROUP * 2 + 32);
#pragma GCC unroll 6
            for (int r = 0; r < mr; r++) {
                int32_t pair;
                __builtin_memcpy(&pair, xr->q + (t0 + r) * in_features + b * 32 + 2 * p,
                                 sizeof pair);
                const __m512i xv = _mm512_set1_epi32(pair);
                blk[r][0] = _mm512_dpwssd_epi32(blk[r][0], w0, xv);
                blk[r][1] = _mm512_dpwssd_epi32(blk[r][1], w1, xv);
            }
        }
        const __m512 d0 = _mm512_loadu_ps(ds + b * GROUP), d1 = _mm512_loadu_ps(ds + b * GROUP + 16);
        const __m512 m0 = _mm512_loadu_ps(ms + b * GROUP), m1 = _mm512_loadu_ps(ms + b * GROUP + 16);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            const long tb = (t0 + r) * blocks + b;
            const __m512 dx = _mm512_set1_ps(xr->d[tb]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(blk[r][0]), _mm512_mul_ps(d0, dx),
                                        acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(blk[r][1]), _mm512_mul_ps(d1, dx),
                                        acc[r][1]);
            if (has_min) {
                const __m512 s = _mm512_set1_ps(xr->sum[tb]);
                acc[r][0] = _mm512_fmadd_ps(m0, s, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(m1, s, acc[r][1]);
            }
        }
    }
#pragma GCC unroll 2
    for (int j = 0; j < 2; j++) {
        const long c = col0 + 16 * j;
        if (c >= out_features) break;
        const __mmask16 mask = out_features - c >= 16 ? (__mmask16)0xffff
                                                      : (__mmask16)((1u << (out_features - c)) - 1);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++)
            _mm512_mask_storeu_ps(out + (t0 + r) * out_stride + c, mask, acc[r][j]);
    }
}

int qgemm(const act_rows *xr, const void *codes, const uint16_t *scale, const uint16_t *min,
          float *out, long out_stride, long tokens, long out_features, long in_features,
          int num_threads) {
    const long blocks = in_features / 32, groups = (out_features + GROUP - 1) / GROUP;
    const size_t panel_size = (size_t)(in_features * GROUP) * sizeof(int16_t);
    const size_t scales_size = (size_t)(2 * blocks * GROUP) * sizeof(float);
    const size_t per_thread = (panel_size + scales_size + 63) / 64 * 64;
    const int threads = groups > 1 ? num_threads : 1;
    char *scratch = aligned_alloc(64, per_thread * (size_t)threads);
    if (scratch == NULL) return -1;
#pragma omp parallel num_threads(threads)
    {
        char *mine = scratch + per_thread * (size_t)omp_get_thread_num();
        int16_t *panel = (int16_t *)mine;
        float *ds = (float *)(mine + panel_size), *ms = ds + blocks * GROUP;
        const int hm = min != NULL;
#pragma omp for schedule(static)
        for (long g = 0; g < groups; g++) {
            widen_group(codes, scale, min, g, out_features, in_features, panel, ds, ms);
            for (long t0 = 0; t0 < tokens; t0 += MR) {
                const long rows = tokens - t0 < MR ? tokens - t0 : MR;
                switch (rows) {  /* constant row counts: one register-resident loop each */
#define T(n) tile(xr, t0, panel, ds, ms, blocks, in_features, out, out_stride, g * GROUP, \
                  out_features, hm, n)
                case 6: T(6); break;
                case 5: T(5); break;
                case 4: T(4); break;
                case 3: T(3); break;
                case 2: T(2); break;
                default: T(1); break;
#undef T
                }
            }
        }
    }
    free(scratch);
    return 0;
}

#endif
