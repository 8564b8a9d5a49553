/* Weight-only quantized matmuls for x86-64 CPUs with AVX-512: out = x @ w.T, float32
 * activations and accumulation, w [out_features, in_features] kept in GGUF-style blocks of 32
 * weights, each block decoded to float32 once per tile of up to TILE_T tokens.
 *
 * q4: codes [out, in/2] uint8, per block 16 bytes: weight j in the low nibble of byte j, weight
 *     j + 16 in its high nibble (ggml's order); w = scale * q + min per block (Q4_0: min = -8d,
 *     Q4_1: scale d, min m). q8: codes [out, in] int8; w = scale * q (Q8_0).
 * scale, min: [out, in/32] float32. x rows and out rows have strides in elements; in_features
 * must be a multiple of 32 (the caller checks). Output rows are split over num_threads OpenMP
 * threads. Summation order differs from a dense GEMM's (errors ~1e-6 relative). Returns 0. */
#include <immintrin.h>
#include <stdint.h>

#define TILE_T 8

static inline void accumulate(const float *x, long x_stride, long nt, long k, __m512 w0,
                              __m512 w1, __m512 *acc) {
    for (long t = 0; t < nt; t++) {
        const float *xt = x + t * x_stride + k;
        acc[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), acc[t]);
        acc[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), acc[t]);
    }
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
            __m512 acc[TILE_T];
            for (long t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
            for (long b = 0; b < blocks; b++) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(row + b * 16));
                const __m128i lo = _mm_and_si128(q, low_mask);
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low_mask);
                const __m512 vd = _mm512_set1_ps(d[b]), vm = _mm512_set1_ps(m[b]);
                const __m512 w0 = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vd, vm);
                const __m512 w1 = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vd, vm);
                accumulate(x + t0 * x_stride, x_stride, nt, b * 32, w0, w1, acc);
            }
            for (long t = 0; t < nt; t++)
                out[(t0 + t) * out_stride + n] = _mm512_reduce_add_ps(acc[t]);
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
            __m512 acc[TILE_T];
            for (long t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
            for (long b = 0; b < blocks; b++) {
                const __m512 vd = _mm512_set1_ps(d[b]);
                const __m128i q0 = _mm_loadu_si128((const __m128i *)(row + b * 32));
                const __m128i q1 = _mm_loadu_si128((const __m128i *)(row + b * 32 + 16));
                const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), vd);
                const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), vd);
                accumulate(x + t0 * x_stride, x_stride, nt, b * 32, w0, w1, acc);
            }
            for (long t = 0; t < nt; t++)
                out[(t0 + t) * out_stride + n] = _mm512_reduce_add_ps(acc[t]);
        }
    }
    return 0;
}
