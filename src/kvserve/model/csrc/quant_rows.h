/* What quant_matmul.c and quant_gemm.c share: the int16 activation rows (each token's
 * activations rounded to int16 per block of 32, symmetric, scale dx = max|x| / 32767, with
 * each block's exact float32 sum), the reading of the blocks' fp16 scales, the widening of a
 * block's weight codes to int16, and the many-row kernel's entry point. */
#ifndef KVSERVE_QUANT_ROWS_H
#define KVSERVE_QUANT_ROWS_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

/* Each token's activations: int16 codes (32 a block), and per block the scale and exact sum. */
typedef struct { int16_t *q; float *d; float *sum; } act_rows;

static inline __m256i to_int16(__m512 v, __m512 inv) {  /* round to nearest even, saturate */
    return _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)));
}

/* r = the int16 rows of x [tokens, in_features] (row stride x_stride); 0, or -1 (nothing kept)
 * when the memory cannot be allocated. The caller frees r->q and r->d. */
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
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0),
                                                               _mm512_abs_ps(v1)));
            const __m512 inv = _mm512_set1_ps(m > 0.0f ? 32767.0f / m : 0.0f);
            const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(to_int16(v0, inv)),
                                                 to_int16(v1, inv), 1);
            _mm512_storeu_si512(r->q + t * in_features + b * 32, q);
            r->d[t * blocks + b] = m / 32767.0f;
            r->sum[t * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        }
    }
    return 0;
}

/* GGUF's fp16 block scales and mins, to float32 (exact): one, 16, or the first k of 16. */
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
static inline __m512 load_h16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline __m512 load_h16_masked(__mmask16 k, const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}

/* Q4: weight j in the low nibble of byte j, weight j + 16 in its high nibble: 32 int16. */
static inline __m512i q4_codes(const uint8_t *codes) {
    const __m128i q = _mm_loadu_si128((const __m128i *)codes), mask = _mm_set1_epi8(0x0F);
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask),
                                                 _mm_and_si128(q, mask)));
}

static inline __m512i q8_codes(const int8_t *codes) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)codes));
}

#ifdef __AVX512VNNI__
#define QGEMM_BUILT 1
int qgemm(const act_rows *xr, const void *codes, const uint16_t *scale, const uint16_t *min,
          float *out, long out_stride, long tokens, long out_features, long in_features,
          int num_threads);
#else
#define QGEMM_BUILT 0
static inline int qgemm(const act_rows *xr, const void *codes, const uint16_t *scale,
                        const uint16_t *min, float *out, long out_stride, long tokens,
                        long out_features, long in_features, int num_threads) {
    (void)xr, (void)codes, (void)scale, (void)min, (void)out, (void)out_stride, (void)tokens;
    (void)out_features, (void)in_features, (void)num_threads;
    return -1;  /* never called: QGEMM_BUILT is 0 */
}
#endif

#endif
