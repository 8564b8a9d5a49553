/* Weight-only quantized matmuls for x86-64 CPUs with AVX2 and FMA (no AVX-512): the kernels,
 * names, layouts and contracts of ../quant_matmul.c at 8 lanes. out = x @ w.T, float32
 * activations and accumulation, w kept in GGUF-style blocks of 32 weights, each block decoded
 * to float32 once per tile of up to TILE_T tokens. in_features must be a multiple of 32 (the
 * caller checks). Output rows are split over num_threads OpenMP threads. Returns 0.
 *
 * Each call keeps several independent accumulator chains (four for one token, two a token up
 * to SMALL_T tokens, one a token in tiles of TILE_T): a single chain would wait on every FMA's
 * latency, which bounds a decode step's matmuls rather than the decoding or the memory. */
#include <immintrin.h>
#include <stdint.h>

#include "vec_math.h"

#define TILE_T 8  /* tokens a decoded block serves at once (more than SMALL_T) */
#define SMALL_T 4  /* up to this many tokens: two accumulators a token */

/* The 32 weights of one block as four vectors of 8, decoded to float32. */
typedef struct { __m256 v[4]; } block32;

static inline __m256 u8_to_ps(__m128i bytes) {  /* the low 8 bytes, unsigned, as 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

static inline __m256 i8_to_ps(__m128i bytes) {  /* the low 8 bytes, signed, as 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

/* Q4_0/Q4_1: weight j in the low nibble of byte j, weight j + 16 in its high nibble;
 * w = q * d + m. */
static inline block32 decode_q4(const uint8_t *codes, float d, float m) {
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i *)codes);
    const __m128i lo = _mm_and_si128(q, low_mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low_mask);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    block32 w = {{_mm256_fmadd_ps(u8_to_ps(lo), vd, vm),
                  _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(lo, 8)), vd, vm),
                  _mm256_fmadd_ps(u8_to_ps(hi), vd, vm),
                  _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(hi, 8)), vd, vm)}};
    return w;
}

/* Q8_0: 32 signed bytes; w = q * d. */
static inline block32 decode_q8(const int8_t *codes, float d) {
    const __m256 vd = _mm256_set1_ps(d);
    const __m128i q0 = _mm_loadu_si128((const __m128i *)codes);
    const __m128i q1 = _mm_loadu_si128((const __m128i *)(codes + 16));
    block32 w = {{_mm256_mul_ps(i8_to_ps(q0), vd),
                  _mm256_mul_ps(i8_to_ps(_mm_srli_si128(q0, 8)), vd),
                  _mm256_mul_ps(i8_to_ps(q1), vd),
                  _mm256_mul_ps(i8_to_ps(_mm_srli_si128(q1, 8)), vd)}};
    return w;
}

/* One output row for one token: four accumulators, one per vector of the block. */
#define ROW_ONE_TOKEN(DECODE)                                                               \
    do {                                                                                    \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                         \
        for (long b = 0; b < blocks; b++) {                                                 \
            const block32 w = DECODE;                                                       \
            const float *xb = x + b * 32;                                                   \
            a0 = _mm256_fmadd_ps(w.v[0], _mm256_loadu_ps(xb), a0);                          \
            a1 = _mm256_fmadd_ps(w.v[1], _mm256_loadu_ps(xb + 8), a1);                      \
            a2 = _mm256_fmadd_ps(w.v[2], _mm256_loadu_ps(xb + 16), a2);                     \
            a3 = _mm256_fmadd_ps(w.v[3], _mm256_loadu_ps(xb + 24), a3);                     \
        }                                                                                   \
        out[n] = reduce_add(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));   \
    } while (0)

/* One output row for up to SMALL_T tokens: two accumulators a token. */
#define ROW_FEW_TOKENS(DECODE)                                                              \
    do {                                                                                    \
        __m256 acc[SMALL_T][2];                                                             \
        for (long t = 0; t < tokens; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();     \
        for (long b = 0; b < blocks; b++) {                                                 \
            const block32 w = DECODE;                                                       \
            for (long t = 0; t < tokens; t++) {                                             \
                const float *xt = x + t * x_stride + b * 32;                                \
                acc[t][0] = _mm256_fmadd_ps(w.v[0], _mm256_loadu_ps(xt), acc[t][0]);        \
                acc[t][1] = _mm256_fmadd_ps(w.v[1], _mm256_loadu_ps(xt + 8), acc[t][1]);    \
                acc[t][0] = _mm256_fmadd_ps(w.v[2], _mm256_loadu_ps(xt + 16), acc[t][0]);   \
                acc[t][1] = _mm256_fmadd_ps(w.v[3], _mm256_loadu_ps(xt + 24), acc[t][1]);   \
            }                                                                               \
        }                                                                                   \
        for (long t = 0; t < tokens; t++)                                                   \
            out[t * out_stride + n] = reduce_add(_mm256_add_ps(acc[t][0], acc[t][1]));      \
    } while (0)

/* One output row for tiles of up to TILE_T tokens: one accumulator a token, so TILE_T chains
 * and each decoded block serves TILE_T tokens. */
#define ROW_TILE(DECODE)                                                                    \
    do {                                                                                    \
        for (long t0 = 0; t0 < tokens; t0 += TILE_T) {                                      \
            const long nt = tokens - t0 < TILE_T ? tokens - t0 : TILE_T;                    \
            __m256 acc[TILE_T];                                                             \
            for (long t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();                     \
            for (long b = 0; b < blocks; b++) {                                             \
                const block32 w = DECODE;                                                   \
                for (long t = 0; t < nt; t++) {                                             \
                    const float *xt = x + (t0 + t) * x_stride + b * 32;                     \
                    __m256 a = _mm256_fmadd_ps(w.v[0], _mm256_loadu_ps(xt), acc[t]);        \
                    a = _mm256_fmadd_ps(w.v[1], _mm256_loadu_ps(xt + 8), a);                \
                    a = _mm256_fmadd_ps(w.v[2], _mm256_loadu_ps(xt + 16), a);               \
                    acc[t] = _mm256_fmadd_ps(w.v[3], _mm256_loadu_ps(xt + 24), a);          \
                }                                                                           \
            }                                                                               \
            for (long t = 0; t < nt; t++)                                                   \
                out[(t0 + t) * out_stride + n] = reduce_add(acc[t]);                        \
        }                                                                                   \
    } while (0)

int kvserve_q4_matmul(const float *x, long x_stride, const uint8_t *codes, const float *scale,
                      const float *min, float *out, long out_stride, long tokens,
                      long out_features, long in_features, int num_threads) {
    const long blocks = in_features / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (out_features >= 64)
    for (long n = 0; n < out_features; n++) {
        const uint8_t *row = codes + n * (in_features / 2);
        const float *d = scale + n * blocks, *m = min + n * blocks;
        if (tokens == 1)
            ROW_ONE_TOKEN(decode_q4(row + b * 16, d[b], m[b]));
        else if (tokens <= SMALL_T)
            ROW_FEW_TOKENS(decode_q4(row + b * 16, d[b], m[b]));
        else
            ROW_TILE(decode_q4(row + b * 16, d[b], m[b]));
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
        if (tokens == 1)
            ROW_ONE_TOKEN(decode_q8(row + b * 32, d[b]));
        else if (tokens <= SMALL_T)
            ROW_FEW_TOKENS(decode_q8(row + b * 32, d[b]));
        else
            ROW_TILE(decode_q8(row + b * 32, d[b]));
    }
    return 0;
}
