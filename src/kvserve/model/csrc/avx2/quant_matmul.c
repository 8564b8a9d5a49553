/* Weight-only quantized matmuls for x86-64 CPUs with AVX2 and FMA (no AVX-512): the names,
 * weight layouts and contracts of ../quant_matmul.c. out = x @ w.T with w kept in GGUF-style
 * blocks of 32 weights and each block's dot product taken in integers: the weight codes
 * widened to int16, each token's activations quantized to int16 per block of 32 (symmetric,
 * scale dx = max|x| / 32767), vpmaddwd (16 products an instruction), then one float32 FMA a
 * block. Decoding every weight to float32 instead costs two conversions a weight, which on
 * AVX2 (and more so on Zen 1, which splits each 256-bit operation in two) bounds the matmul
 * well below the integer one (docs/benchmarks.md). int16 rather than ggml's int8 activations:
 * the rounding error (|e_j| <= dx / 2) is 256 times smaller, so the result stays within float32
 * rounding noise of the dequantized matmul (int8 moved greedy tokens on real chats).
 *
 * Q4_0/Q4_1 (w = q * d + m, q in 0..15): sum_j w_j x_j = d * dx * sum_j q_j xq_j + m * S, with
 * S = sum_j x_j exact in float32 (once a token and block). Q8_0 (w = q * d): d * dx * sum_j
 * q_j xq_j. Products fit int32: |q| <= 127, |xq| <= 32767, 32 of them.
 *
 * in_features must be a multiple of 32 (the caller checks); 1 <= tokens <= MAX_TOKENS. Output
 * rows are split over num_threads OpenMP threads; from QGEMM_MIN_TOKENS rows the call runs
 * quant_gemm.c (the same numerics, another summation order). Returns 0, or -1 when tokens is
 * out of range or the activation or panel scratch could not be allocated. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "quant_rows.h"

#define TILE_T 4        /* tokens a loaded weight block serves at once */
#define MAX_TOKENS 4096 /* a sanity bound on one call's rows */
#define QGEMM_MIN_TOKENS 16 /* rows from which quant_gemm.c's panels pay (docs/benchmarks.md) */

/* sum_j w_j xq_j over one block (xq: the token's 32 int16 codes), as 8 float partial sums. */
static inline __m256 block_dot(codes16 w, const int16_t *xq) {
    const __m256i lo = _mm256_madd_epi16(w.lo, _mm256_loadu_si256((const __m256i *)xq));
    const __m256i hi = _mm256_madd_epi16(w.hi, _mm256_loadu_si256((const __m256i *)(xq + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
}

/* One row for one token (its codes, scales and sums at xq, xd, xs): two accumulators (even and
 * odd blocks), so no block's sum waits on the previous one's. W_CODES(b) loads block b's
 * codes; OFFSET(s, b) is the float term of block b for a token whose block sum is s. */
#define ONE_TOKEN_ROW(W_CODES, OFFSET, xq, xd, xs, dst)                                     \
    do {                                                                                    \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;                                           \
        float off = 0.0f;                                                                   \
        long b = 0;                                                                         \
        for (; b + 1 < blocks; b += 2) {                                                    \
            a0 = _mm256_fmadd_ps(block_dot(W_CODES(b), (xq) + b * 32),                      \
                                 _mm256_set1_ps(h2f(d[b]) * (xd)[b]), a0);                  \
            a1 = _mm256_fmadd_ps(block_dot(W_CODES(b + 1), (xq) + b * 32 + 32),             \
                                 _mm256_set1_ps(h2f(d[b + 1]) * (xd)[b + 1]), a1);          \
            off += OFFSET((xs)[b], b) + OFFSET((xs)[b + 1], b + 1);                         \
        }                                                                                   \
        if (b < blocks) {                                                                   \
            a0 = _mm256_fmadd_ps(block_dot(W_CODES(b), (xq) + b * 32),                      \
                                 _mm256_set1_ps(h2f(d[b]) * (xd)[b]), a0);                  \
            off += OFFSET((xs)[b], b);                                                      \
        }                                                                                   \
        (dst) = reduce_add(_mm256_add_ps(a0, a1)) + off;                                    \
    } while (0)

/* One row for all tokens: whole tiles of TILE_T tokens share each loaded block, one
 * accumulator a token (unrolled, so they stay in registers); the tokens after the last whole
 * tile go one by one. Arguments as ONE_TOKEN_ROW's. */
#define ROW(W_CODES, OFFSET)                                                                \
    do {                                                                                    \
        long t0 = 0;                                                                        \
        for (; t0 + TILE_T <= tokens; t0 += TILE_T) {                                       \
            __m256 acc[TILE_T];                                                             \
            float off[TILE_T];                                                              \
            _Pragma("GCC unroll 8") for (int t = 0; t < TILE_T; t++) {                      \
                acc[t] = _mm256_setzero_ps();                                               \
                off[t] = 0.0f;                                                              \
            }                                                                               \
            for (long b = 0; b < blocks; b++) {                                             \
                const codes16 w = W_CODES(b);                                               \
                const float db = h2f(d[b]);                                                 \
                _Pragma("GCC unroll 8") for (int t = 0; t < TILE_T; t++) {                  \
                    const long tb = (t0 + t) * blocks + b;                                  \
                    acc[t] = _mm256_fmadd_ps(                                               \
                        block_dot(w, xr.q + (t0 + t) * in_features + b * 32),               \
                        _mm256_set1_ps(db * xr.d[tb]), acc[t]);                             \
                    off[t] += OFFSET(xr.sum[tb], b);                                        \
                }                                                                           \
            }                                                                               \
            _Pragma("GCC unroll 8") for (int t = 0; t < TILE_T; t++)                        \
                out[(t0 + t) * out_stride + n] = reduce_add(acc[t]) + off[t];               \
        }                                                                                   \
        for (; t0 < tokens; t0++)                                                           \
            ONE_TOKEN_ROW(W_CODES, OFFSET, xr.q + t0 * in_features, xr.d + t0 * blocks,     \
                          xr.sum + t0 * blocks, out[t0 * out_stride + n]);                  \
    } while (0)

/* One token (decoding at one sequence, where the matmul reads every weight once and must keep up
 * with memory): ../quant_matmul.c's one-token loops at 8 lanes. Each block's d * dx, and the
 * min term sum_b m_b * S_b, are taken in a vector pass per row (no scalar fp16 conversion a
 * block). Q4 goes two blocks a step: a 32-byte load holds blocks b and b + 1's codes, and the
 * in-lane byte unpacks give each 128-bit lane one block's weights, so the token's codes are laid
 * out to match once per call (`pair_order`); then per pair four vpmaddwd and one float FMA,
 * whose low four lanes carry block b's scale and high four block b + 1's. */
static void pair_order(const int16_t *q, long blocks, int16_t *xp) {
    for (long b = 0; b + 1 < blocks; b += 2) {  /* per pair: weights 0-7, 8-15, 16-23, 24-31 */
        const int16_t *a = q + b * 32, *c = a + 32;
        for (int j = 0; j < 4; j++) {
            __builtin_memcpy(xp + b * 32 + j * 16, a + j * 8, 16);
            __builtin_memcpy(xp + b * 32 + j * 16 + 8, c + j * 8, 16);
        }
    }
}

/* Blocks b and b + 1 of a row against the token's pair-ordered codes: 8 float partial sums,
 * block b's in lanes 0-3 and block b + 1's in lanes 4-7. */
static inline __m256 q4_pair_dot(const uint8_t *row, const int16_t *xp, long b) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(row + b * 16));
    const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    const __m256i lo = _mm256_and_si256(v, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const __m256i *x = (const __m256i *)(xp + b * 32);
    const __m256i s0 = _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), _mm256_loadu_si256(x)),
        _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), _mm256_loadu_si256(x + 1)));
    const __m256i s1 = _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), _mm256_loadu_si256(x + 2)),
        _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), _mm256_loadu_si256(x + 3)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
}

/* ds[b] in lanes 0-3, ds[b + 1] in lanes 4-7. */
static inline __m256 pair_scale(const float *ds, long b) {
    return _mm256_set_m128(_mm_set1_ps(ds[b + 1]), _mm_set1_ps(ds[b]));
}

/* ds[b] = d_b * dx_b for a row's blocks; returns sum_b m_b * S_b (0 when m is NULL: Q8). */
static float row_scales(const uint16_t *d, const uint16_t *m, const act_rows *xr, long blocks,
                        float *ds) {
    __m256 msum = _mm256_setzero_ps();
    long b = 0;
    for (; b + 8 <= blocks; b += 8) {
        const __m256 db = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b)));
        _mm256_storeu_ps(ds + b, _mm256_mul_ps(db, _mm256_loadu_ps(xr->d + b)));
        if (m)
            msum = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b))),
                                   _mm256_loadu_ps(xr->sum + b), msum);
    }
    float off = reduce_add(msum);
    for (; b < blocks; b++) {
        ds[b] = h2f(d[b]) * xr->d[b];
        if (m) off += h2f(m[b]) * xr->sum[b];
    }
    return off;
}

static int q4_matmul_one_token(const uint8_t *codes, const uint16_t *scale,
                               const uint16_t *min, const act_rows *xr, float *out,
                               long out_features, long in_features, int num_threads) {
    const long blocks = in_features / 32;
    int16_t *xp = aligned_alloc(32, (size_t)(in_features * 2 + 32) / 32 * 32);
    if (xp == NULL) return -1;
    pair_order(xr->q, blocks, xp);
#pragma omp parallel num_threads(num_threads) if (out_features >= 64)
    {
        float ds[blocks + 8];  /* this thread's d * dx of a row's blocks */
#pragma omp for schedule(static)
        for (long n = 0; n < out_features; n++) {
            const uint8_t *row = codes + n * (in_features / 2);
            const float off = row_scales(scale + n * blocks, min + n * blocks, xr, blocks, ds);
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            long b = 0;
            for (; b + 3 < blocks; b += 4) {  /* two pairs an iteration: two accumulators */
                a0 = _mm256_fmadd_ps(q4_pair_dot(row, xp, b), pair_scale(ds, b), a0);
                a1 = _mm256_fmadd_ps(q4_pair_dot(row, xp, b + 2), pair_scale(ds, b + 2), a1);
            }
            for (; b + 1 < blocks; b += 2)
                a0 = _mm256_fmadd_ps(q4_pair_dot(row, xp, b), pair_scale(ds, b), a0);
            if (b < blocks)  /* an odd last block: its codes in natural order */
                a1 = _mm256_fmadd_ps(block_dot(q4_codes(row + b * 16), xr->q + b * 32),
                                     _mm256_set1_ps(ds[b]), a1);
            out[n] = reduce_add(_mm256_add_ps(a0, a1)) + off;
        }
    }
    free(xp);
    return 0;
}

/* Q8_0, one token: one block a step, its scale from the row's vector pass. */
static void q8_matmul_one_token(const int8_t *codes, const uint16_t *scale, const act_rows *xr,
                                float *out, long out_features, long in_features,
                                int num_threads) {
    const long blocks = in_features / 32;
#pragma omp parallel num_threads(num_threads) if (out_features >= 64)
    {
        float ds[blocks + 8];
#pragma omp for schedule(static)
        for (long n = 0; n < out_features; n++) {
            const int8_t *row = codes + n * in_features;
            row_scales(scale + n * blocks, NULL, xr, blocks, ds);
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            long b = 0;
            for (; b + 1 < blocks; b += 2) {
                a0 = _mm256_fmadd_ps(block_dot(q8_codes(row + b * 32), xr->q + b * 32),
                                     _mm256_broadcast_ss(ds + b), a0);
                a1 = _mm256_fmadd_ps(block_dot(q8_codes(row + b * 32 + 32), xr->q + b * 32 + 32),
                                     _mm256_broadcast_ss(ds + b + 1), a1);
            }
            if (b < blocks)
                a0 = _mm256_fmadd_ps(block_dot(q8_codes(row + b * 32), xr->q + b * 32),
                                     _mm256_broadcast_ss(ds + b), a0);
            out[n] = reduce_add(_mm256_add_ps(a0, a1));
        }
    }
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
    if (tokens >= QGEMM_MIN_TOKENS) {
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
    if (tokens >= QGEMM_MIN_TOKENS) {
        status = qgemm(&xr, codes, scale, NULL, out, out_stride, tokens, out_features,
                       in_features, num_threads);
    } else if (tokens == 1) {
        q8_matmul_one_token(codes, scale, &xr, out, out_features, in_features, num_threads);
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

/* The weights in float32: ../quant_matmul.c's kvserve_q4_dequantize / kvserve_q8_dequantize at
 * 8 lanes (a multiply and an add, not fused, as quant_linear's torch decoding). Returns 0. */
int kvserve_q4_dequantize(const uint8_t *codes, const uint16_t *scale, const uint16_t *min,
                          float *out, long rows, long in_features, int num_threads) {
    const long blocks = in_features / 32;
    const __m128i mask = _mm_set1_epi8(0x0F);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 64)
    for (long n = 0; n < rows; n++) {
        for (long b = 0; b < blocks; b++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(codes + (n * blocks + b) * 16));
            const __m128i lo = _mm_and_si128(q, mask);
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
            const __m256 d = _mm256_set1_ps(h2f(scale[n * blocks + b]));
            const __m256 m = _mm256_set1_ps(h2f(min[n * blocks + b]));
            const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            float *o = out + n * in_features + b * 32;
            for (int j = 0; j < 4; j++)
                _mm256_storeu_ps(o + 8 * j, _mm256_add_ps(_mm256_mul_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), d), m));
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
            const __m256 d = _mm256_set1_ps(h2f(scale[n * blocks + b]));
            float *o = out + n * in_features + b * 32;
            for (int j = 0; j < 32; j += 8)
                _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(q + j)))), d));
        }
    }
    return 0;
}

/* 1: calls of QGEMM_MIN_TOKENS rows or more run quant_gemm.c's panels. */
int kvserve_quant_gemm_built(void) { return 1; }
