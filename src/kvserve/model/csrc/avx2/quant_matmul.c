/* Weight-only quantized matmuls for x86-64 CPUs with AVX2 and FMA (no AVX-512): the kernels,
 * names, layouts and contracts of ../quant_matmul.c at 8 lanes. out = x @ w.T, float32
 * activations and accumulation, w kept in GGUF-style blocks of 32 weights, each block decoded
 * to float32 once per tile of up to TILE_T tokens. in_features must be a multiple of 32 (the
 * caller checks). Output rows are split over num_threads OpenMP threads. Returns 0. */
#include <immintrin.h>
#include <stdint.h>

#include "vec_math.h"

#define TILE_T 4

/* acc[t] += w[0..32) . x[t][k..k+32), the block's 32 weights in four vectors of 8. */
static inline void accumulate(const float *x, long x_stride, long nt, long k, const __m256 *w,
                              __m256 *acc) {
    for (long t = 0; t < nt; t++) {
        const float *xt = x + t * x_stride + k;
        acc[t] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xt), acc[t]);
        acc[t] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xt + 8), acc[t]);
        acc[t] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xt + 16), acc[t]);
        acc[t] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xt + 24), acc[t]);
    }
}

static inline __m256 u8_to_ps(__m128i bytes) {  /* the low 8 bytes, unsigned, as 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

static inline __m256 i8_to_ps(__m128i bytes) {  /* the low 8 bytes, signed, as 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

int kvserve_q4_matmul(const float *x, long x_stride, const uint8_t *codes, const float *scale,
                      const float *min, float *out, long out_stride, long tokens,
                      long out_features, long in_features, int num_threads) {
    const long blocks = in_features / 32;
    const __m128i low_mask = _mm_set1_epi8(0x0F);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (out_features >= 64)
    for (long n = 0; n < out_features; n++) {
        const uint8_t *row = codes + n * (in_features / 2);
        const float *d = scale + n * blocks, *m = min + n * blocks;
        for (long t0 = 0; t0 < tokens; t0 += TILE_T) {
            const long nt = tokens - t0 < TILE_T ? tokens - t0 : TILE_T;
            __m256 acc[TILE_T];
            for (long t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
            for (long b = 0; b < blocks; b++) {
                /* weight j in the low nibble of byte j, weight j + 16 in its high nibble */
                const __m128i q = _mm_loadu_si128((const __m128i *)(row + b * 16));
                const __m128i lo = _mm_and_si128(q, low_mask);
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low_mask);
                const __m256 vd = _mm256_set1_ps(d[b]), vm = _mm256_set1_ps(m[b]);
                const __m256 w[4] = {
                    _mm256_fmadd_ps(u8_to_ps(lo), vd, vm),
                    _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(lo, 8)), vd, vm),
                    _mm256_fmadd_ps(u8_to_ps(hi), vd, vm),
                    _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(hi, 8)), vd, vm)};
                accumulate(x + t0 * x_stride, x_stride, nt, b * 32, w, acc);
            }
            for (long t = 0; t < nt; t++)
                out[(t0 + t) * out_stride + n] = reduce_add(acc[t]);
        }
    }
    return 0;
}

int kvserve_q8_matmul(const float *x, long x_stride, const int8_t *codes, const float *scale,
                      float *out, long out_stride, long tokens, long out_features,
                      long in_features, int num_threads) {
    const long blocks = in_features / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (out_features >= 64)
    for (long n = 0; n < out_features; n++) {
        const int8_t *row = codes + n * in_features;
        const float *d = scale + n * blocks;
        for (long t0 = 0; t0 < tokens; t0 += TILE_T) {
            const long nt = tokens - t0 < TILE_T ? tokens - t0 : TILE_T;
            __m256 acc[TILE_T];
            for (long t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
            for (long b = 0; b < blocks; b++) {
                const __m256 vd = _mm256_set1_ps(d[b]);
                const __m128i q0 = _mm_loadu_si128((const __m128i *)(row + b * 32));
                const __m128i q1 = _mm_loadu_si128((const __m128i *)(row + b * 32 + 16));
                const __m256 w[4] = {
                    _mm256_mul_ps(i8_to_ps(q0), vd),
                    _mm256_mul_ps(i8_to_ps(_mm_srli_si128(q0, 8)), vd),
                    _mm256_mul_ps(i8_to_ps(q1), vd),
                    _mm256_mul_ps(i8_to_ps(_mm_srli_si128(q1, 8)), vd)};
                accumulate(x + t0 * x_stride, x_stride, nt, b * 32, w, acc);
            }
            for (long t = 0; t < nt; t++)
                out[(t0 + t) * out_stride + n] = reduce_add(acc[t]);
        }
    }
    return 0;
}
