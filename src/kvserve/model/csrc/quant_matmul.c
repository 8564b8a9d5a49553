/* Weight-only quantized matmuls for x86-64 CPUs with AVX-512 (F and BW): out = x @ w.T with
 * w [out_features, in_features] kept in GGUF-style blocks of 32 weights and each block's dot
 * product taken in integers: the 32 weight codes widened to int16 (one register), each token's
 * activations quantized to int16 per block of 32 (symmetric, scale dx = max|x| / 32767),
 * vpmaddwd, then one float32 FMA a block. The numerics equal avx2/quant_matmul.c's; why int16
 * (and not float32 weights or ggml's int8 activations) is said there.
 *
 * q4: codes [out, in/2] uint8, per block 16 bytes: weight j in the low nibble of byte j, weight
 *     j + 16 in its high nibble (ggml's order); w = scale * q + min per block (Q4_0: min = -8d,
 *     Q4_1: scale d, min m), so sum_j w_j x_j = d * dx * sum_j q_j xq_j + m * S with S = sum_j
 *     x_j exact in float32. q8: codes [out, in] int8; w = scale * q (Q8_0).
 * scale, min: [out, in/32] fp16, GGUF's own, read as they are (4 bytes a block fewer than
 * float32: one token's matmul is bound by reading the weights). x rows and out rows have
 * strides in elements; in_features must be a multiple of 32 (the caller checks); 1 <= tokens
 * <= MAX_TOKENS. Output rows are split over num_threads OpenMP threads; from QGEMM_MIN_TOKENS
 * rows, where built, the call runs quant_gemm.c (the same numerics, another summation order).
 * Returns 0, or -1 when tokens is out of range or the activation or panel scratch could not be
 * allocated. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "layer_ops.h"
#include "quant_rows.h"

#define TILE_T 4        /* tokens a loaded weight block serves at once */
#define MAX_TOKENS 4096 /* a sanity bound on one call's rows */
#define QGEMM_MIN_TOKENS 16 /* rows from which quant_gemm.c's panels pay (docs/benchmarks.md) */

/* sum_j w_j xq_j over one block (xq: the token's 32 int16 codes), as 16 float partial sums. */
static inline __m512 block_dot(__m512i w, const int16_t *xq) {
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(xq)));
}

/* One row for one token (its codes, scales and sums at xq, xd, xs): two accumulators (even and
 * odd blocks), so no block's sum waits on the previous one's. W_CODES(b) loads block b's
 * codes; OFFSET(s, b) is the float term of block b for a token whose block sum is s. */
#define ONE_TOKEN_ROW(W_CODES, OFFSET, xq, xd, xs, dst)                                     \
    do {                                                                                    \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;                                           \
        float off = 0.0f;                                                                   \
        long b = 0;                                                                         \
        for (; b + 1 < blocks; b += 2) {                                                    \
            a0 = _mm512_fmadd_ps(block_dot(W_CODES(b), (xq) + b * 32),                      \
                                 _mm512_set1_ps(h2f(d[b]) * (xd)[b]), a0);                  \
            a1 = _mm512_fmadd_ps(block_dot(W_CODES(b + 1), (xq) + b * 32 + 32),             \
                                 _mm512_set1_ps(h2f(d[b + 1]) * (xd)[b + 1]), a1);          \
            off += OFFSET((xs)[b], b) + OFFSET((xs)[b + 1], b + 1);                         \
        }                                                                                   \
        if (b < blocks) {                                                                   \
            a0 = _mm512_fmadd_ps(block_dot(W_CODES(b), (xq) + b * 32),                      \
                                 _mm512_set1_ps(h2f(d[b]) * (xd)[b]), a0);                  \
            off += OFFSET((xs)[b], b);                                                      \
        }                                                                                   \
        (dst) = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + off;                          \
    } while (0)

/* One row for all tokens: whole tiles of TILE_T tokens share each loaded block, one
 * accumulator a token (unrolled, so they stay in registers); the tokens after the last whole
 * tile go one by one. Arguments as ONE_TOKEN_ROW's. */
#define ROW(W_CODES, OFFSET)                                                                \
    do {                                                                                    \
        long t0 = 0;                                                                        \
        for (; t0 + TILE_T <= tokens; t0 += TILE_T) {                                       \
            __m512 acc[TILE_T];                                                             \
            float off[TILE_T];                                                              \
            _Pragma("GCC unroll 8") for (int t = 0; t < TILE_T; t++) {                      \
                acc[t] = _mm512_setzero_ps();                                               \
                off[t] = 0.0f;                                                              \
            }                                                                               \
            for (long b = 0; b < blocks; b++) {                                             \
                const __m512i w = W_CODES(b);                                               \
                const float db = h2f(d[b]);                                                 \
                _Pragma("GCC unroll 8") for (int t = 0; t < TILE_T; t++) {                  \
                    const long tb = (t0 + t) * blocks + b;                                  \
                    acc[t] = _mm512_fmadd_ps(                                               \
                        block_dot(w, xr.q + (t0 + t) * in_features + b * 32),               \
                        _mm512_set1_ps(db * xr.d[tb]), acc[t]);                             \
                    off[t] += OFFSET(xr.sum[tb], b);                                        \
                }                                                                           \
            }                                                                               \
            _Pragma("GCC unroll 8") for (int t = 0; t < TILE_T; t++)                        \
                out[(t0 + t) * out_stride + n] = _mm512_reduce_add_ps(acc[t]) + off[t];     \
        }                                                                                   \
        for (; t0 < tokens; t0++)                                                           \
            ONE_TOKEN_ROW(W_CODES, OFFSET, xr.q + t0 * in_features, xr.d + t0 * blocks,     \
                          xr.sum + t0 * blocks, out[t0 * out_stride + n]);                  \
    } while (0)

/* One token (decoding at one sequence, where the matmul reads every weight once and must keep up
 * with memory): two blocks a step. A 32-byte load holds blocks b and b + 1's codes; widened to
 * int16 lanes, its low nibbles are weights 0-15 of each block and its high nibbles weights
 * 16-31, so the token's codes are laid out to match once per call (`pair_order`): then per
 * block pair one widening, two vpmaddwd and one float FMA, whose 16 lanes carry block b's
 * scale in the low 8 and block b + 1's in the high 8. Each block's d * dx is taken in a
 * vector pass per row, and the min term sum_b m_b * S_b is a dot product over blocks. */
static void pair_order(const int16_t *q, long blocks, int16_t *xp) {
    for (long b = 0; b + 1 < blocks; b += 2) {
        const int16_t *a = q + b * 32, *c = a + 32;
        int16_t *lo = xp + b * 32, *hi = lo + 32;
        __builtin_memcpy(lo, a, 32), __builtin_memcpy(lo + 16, c, 32);
        __builtin_memcpy(hi, a + 16, 32), __builtin_memcpy(hi + 16, c + 16, 32);
    }
}

/* Blocks b and b + 1 of a row against the token's pair-ordered codes: 16 float partial sums,
 * block b's in lanes 0-7 and block b + 1's in lanes 8-15. */
static inline __m512 q4_pair_dot(const uint8_t *row, const int16_t *xp, long b) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + b * 16)));
    const __m512i low4 = _mm512_set1_epi16(0x0F);
    return _mm512_cvtepi32_ps(_mm512_add_epi32(
        _mm512_madd_epi16(_mm512_and_si512(w, low4), _mm512_loadu_si512(xp + b * 32)),
        _mm512_madd_epi16(_mm512_srli_epi16(w, 4), _mm512_loadu_si512(xp + b * 32 + 32))));
}

/* ds[b] in lanes 0-7, ds[b + 1] in lanes 8-15 (both broadcast from memory). */
static inline __m512 pair_scale(const float *ds, long b) {
    return _mm512_mask_broadcastss_ps(_mm512_set1_ps(ds[b]), 0xFF00, _mm_load_ss(ds + b + 1));
}

static float q4_one_token_row(const uint8_t *row, const uint16_t *d, const uint16_t *m,
                              const act_rows *xr, const int16_t *xp, long blocks, float *ds) {
    __m512 msum = _mm512_setzero_ps();
    long b = 0;
    for (; b + 16 <= blocks; b += 16) {
        _mm512_storeu_ps(ds + b, _mm512_mul_ps(load_h16(d + b), _mm512_loadu_ps(xr->d + b)));
        msum = _mm512_fmadd_ps(load_h16(m + b), _mm512_loadu_ps(xr->sum + b), msum);
    }
    if (b < blocks) {
        const __mmask16 k = (__mmask16)((1u << (blocks - b)) - 1);
        _mm512_mask_storeu_ps(ds + b, k, _mm512_mul_ps(load_h16_masked(k, d + b),
                                                       _mm512_maskz_loadu_ps(k, xr->d + b)));
        msum = _mm512_fmadd_ps(load_h16_masked(k, m + b),
                               _mm512_maskz_loadu_ps(k, xr->sum + b), msum);
    }
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    for (b = 0; b + 3 < blocks; b += 4) {  /* two pairs an iteration: two accumulators */
        a0 = _mm512_fmadd_ps(q4_pair_dot(row, xp, b), pair_scale(ds, b), a0);
        a1 = _mm512_fmadd_ps(q4_pair_dot(row, xp, b + 2), pair_scale(ds, b + 2), a1);
    }
    for (; b + 1 < blocks; b += 2)
        a0 = _mm512_fmadd_ps(q4_pair_dot(row, xp, b), pair_scale(ds, b), a0);
    if (b < blocks)  /* an odd last block: its codes in natural order, as block_dot takes them */
        a1 = _mm512_fmadd_ps(block_dot(q4_codes(row + b * 16), xr->q + b * 32),
                             _mm512_set1_ps(ds[b]), a1);
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + _mm512_reduce_add_ps(msum);
}

static int q4_matmul_one_token(const uint8_t *codes, const uint16_t *scale,
                               const uint16_t *min, const act_rows *xr, float *out,
                               long out_features, long in_features, int num_threads) {
    const long blocks = in_features / 32;
    int16_t *xp = aligned_alloc(64, (size_t)(in_features * 2 + 64) / 64 * 64);
    if (xp == NULL) return -1;
    pair_order(xr->q, blocks, xp);
#pragma omp parallel num_threads(num_threads) if (out_features >= 64)
    {
        float ds[blocks + 16];  /* this thread's d * dx of a row's blocks */
#pragma omp for schedule(static)
        for (long n = 0; n < out_features; n++)
            out[n] = q4_one_token_row(codes + n * (in_features / 2), scale + n * blocks,
                                      min + n * blocks, xr, xp, blocks, ds);
    }
    free(xp);
    return 0;
}

int kvserve_q4_matmul(const float *x, long x_stride, const uint8_t *codes,
                      const uint16_t *scale, const uint16_t *min, float *out, long out_stride,
                      long tokens, long out_features, long in_features, int num_threads) {
    const long blocks = in_features / 32;
    act_rows xr;
    if (tokens < 1 || tokens > MAX_TOKENS ||
        quantize_rows(x, x_stride, tokens, in_features, &xr) != 0)
        return -1;
    int status = 0;
    if (QGEMM_BUILT && tokens >= QGEMM_MIN_TOKENS) {
        status = qgemm(&xr, codes, scale, min, out, out_stride, tokens, out_features,
                       in_features, num_threads);
    } else if (tokens == 1) {
        status = q4_matmul_one_token(codes, scale, min, &xr, out, out_features, in_features,
                                     num_threads);
    } else {
#define Q4_CODES(b) q4_codes(row + (b) * 16)
#define MIN_TERM(sum, b) (h2f(m[b]) * (sum))
#pragma omp parallel for schedule(static) num_threads(num_threads) if (out_features >= 64)
        for (long n = 0; n < out_features; n++) {
            const uint8_t *row = codes + n * (in_features / 2);
            const uint16_t *d = scale + n * blocks, *m = min + n * blocks;
            ROW(Q4_CODES, MIN_TERM);
        }
    }
    free(xr.q);
    free(xr.d);
    return status;
}

int kvserve_q8_matmul(const float *x, long x_stride, const int8_t *codes,
                      const uint16_t *scale, float *out, long out_stride, long tokens,
                      long out_features, long in_features, int num_threads) {
    const long blocks = in_features / 32;
    act_rows xr;
    if (tokens < 1 || tokens > MAX_TOKENS ||
        quantize_rows(x, x_stride, tokens, in_features, &xr) != 0)
        return -1;
    int status = 0;
    if (QGEMM_BUILT && tokens >= QGEMM_MIN_TOKENS) {
        status = qgemm(&xr, codes, scale, NULL, out, out_stride, tokens, out_features,
                       in_features, num_threads);
    } else {
#define Q8_CODES(b) q8_codes(row + (b) * 32)
#define NO_TERM(sum, b) 0.0f
#pragma omp parallel for schedule(static) num_threads(num_threads) if (out_features >= 64)
        for (long n = 0; n < out_features; n++) {
            const int8_t *row = codes + n * in_features;
            const uint16_t *d = scale + n * blocks;
            ROW(Q8_CODES, NO_TERM);
        }
    }
    free(xr.q);
    free(xr.d);
    return status;
}

/* The weights in float32, out [rows, in_features] = scale * q + min (q4) or scale * q (q8),
 * for matmuls of more rows than the integer kernels pay for (prefill): a multiply and an add,
 * not fused, so each weight equals quant_linear's torch decoding. Returns 0. */
int kvserve_q4_dequantize(const uint8_t *codes, const uint16_t *scale, const uint16_t *min,
                          float *out, long rows, long in_features, int num_threads) {
    const long blocks = in_features / 32;
    const __m128i mask = _mm_set1_epi8(0x0F);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 64)
    for (long n = 0; n < rows; n++) {
        for (long b = 0; b < blocks; b++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(codes + (n * blocks + b) * 16));
            const __m512 d = _mm512_set1_ps(h2f(scale[n * blocks + b]));
            const __m512 m = _mm512_set1_ps(h2f(min[n * blocks + b]));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask)));
            const __m512 hi = _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)));
            float *o = out + n * in_features + b * 32;
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_mul_ps(lo, d), m));
            _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_mul_ps(hi, d), m));
        }
    }
    return 0;
}

int kvserve_q8_dequantize(const int8_t *codes, const uint16_t *scale, float *out, long rows,
                          long in_features, int num_threads) {
    const long blocks = in_features / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 64)
    for (long n = 0; n < rows; n++) {
        for (long b = 0; b < blocks; b++) {
            const int8_t *q = codes + n * in_features + b * 32;
            const __m512 d = _mm512_set1_ps(h2f(scale[n * blocks + b]));
            float *o = out + n * in_features + b * 32;
            for (int j = 0; j < 32; j += 16)
                _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(q + j)))), d));
        }
    }
    return 0;
}

/* 1 where calls of QGEMM_MIN_TOKENS rows or more run quant_gemm.c's panels (a build for
 * AVX512-VNNI), so a prefill of up to MAX_TOKENS rows stays in the blocks; 0 where the caller
 * should decode the weight whole for prefill. */
int kvserve_quant_gemm_built(void) { return QGEMM_BUILT; }
