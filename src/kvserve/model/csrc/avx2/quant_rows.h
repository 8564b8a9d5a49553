/* What avx2/quant_matmul.c and avx2/quant_gemm.c share (the AVX2 counterpart of
 * ../quant_rows.h): the int16 activation rows (each token's activations rounded to int16 per
 * block of 32, symmetric, scale dx = max|x| / 32767, with each block's exact float32 sum), the
 * reading of the blocks' fp16 scales, the widening of a block's weight codes to int16, and the
 * many-row kernel's entry point. */
#ifndef KVSERVE_AVX2_QUANT_ROWS_H
#define KVSERVE_AVX2_QUANT_ROWS_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec_math.h"

/* Each token's activations: int16 codes (32 a block), and per block the scale and exact sum. */
typedef struct { int16_t *q; float *d; float *sum; } act_rows;

/* A block's fp16 scale or min (GGUF's own, as kept) to float32: exact. */
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

static inline int quantize_rows(const float *x, long x_stride, long tokens, long in_features,
                         act_rows *r) {
    const long blocks = in_features / 32;
    r->q = malloc(sizeof(int16_t) * (size_t)(tokens * in_features));
    r->d = malloc(sizeof(float) * (size_t)(2 * tokens * blocks));
    if (r->q == NULL || r->d == NULL) {
        free(r->q);
        free(r->d);
        return -1;
    }
    r->sum = r->d + tokens * blocks;
    for (long t = 0; t < tokens; t++) {
        for (long b = 0; b < blocks; b++) {
            const float *xb = x + t * x_stride + b * 32;
            __m256 amax = _mm256_setzero_ps(), sum = amax;
            const __m256 sign = _mm256_set1_ps(-0.0f);
            for (int j = 0; j < 32; j += 8) {
                const __m256 v = _mm256_loadu_ps(xb + j);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
                sum = _mm256_add_ps(sum, v);
            }
            const float m = reduce_max(amax);
            const __m256 inv = _mm256_set1_ps(m > 0.0f ? 32767.0f / m : 0.0f);
            int16_t *q = r->q + t * in_features + b * 32;
            for (int j = 0; j < 32; j += 16) {  /* round to nearest even, pack to int16 */
                const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j), inv));
                const __m256i c = _mm256_cvtps_epi32(
                    _mm256_mul_ps(_mm256_loadu_ps(xb + j + 8), inv));
                const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8);
                _mm256_storeu_si256((__m256i *)(q + j), packed);
            }
            r->d[t * blocks + b] = m / 32767.0f;
            r->sum[t * blocks + b] = reduce_add(sum);
        }
    }
    return 0;
}

/* A block's 32 weight codes as int16: weights 0..15 and 16..31. */
typedef struct { __m256i lo, hi; } codes16;

/* Q4: weight j in the low nibble of byte j, weight j + 16 in its high nibble. */
static inline codes16 q4_codes(const uint8_t *codes) {
    const __m128i q = _mm_loadu_si128((const __m128i *)codes), mask = _mm_set1_epi8(0x0F);
    codes16 w = {_mm256_cvtepu8_epi16(_mm_and_si128(q, mask)),
                 _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), mask))};
    return w;
}

static inline codes16 q8_codes(const int8_t *codes) {
    codes16 w = {_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)codes)),
                 _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + 16)))};
    return w;
}

/* out[t, n] for t < tokens, n < out_features from the int16 rows xr, in the numerics of the
 * row kernels (quant_gemm.c); min NULL: Q8_0 (codes int8). 0, or -1 when the panels cannot be
 * allocated. */
int qgemm(const act_rows *xr, const void *codes, const uint16_t *scale, const uint16_t *min,
          float *out, long out_stride, long tokens, long out_features, long in_features,
          int num_threads);

#endif
