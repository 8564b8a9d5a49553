/* Fused position-wise ops of a Llama-family layer for x86-64 CPUs with AVX2 and FMA (no
 * AVX-512): the same three kernels, names, contracts and bf16 roundings as ../pointwise.c, at
 * 8 lanes. Rows are split over num_threads OpenMP threads when there are at least
 * PARALLEL_MIN_ELEMS elements. Every tensor has a contiguous last dim; row strides are in
 * elements. Each returns 0, or -1 for a dim that is not a multiple of 8 (the caller then takes
 * its PyTorch path). */
#include <immintrin.h>
#include <math.h>

#include "vec_math.h"

#define PARALLEL_MIN_ELEMS 32768
#define INLINE static inline __attribute__((always_inline))

INLINE void rms_norm_row(const void *x, void *res, const void *weight, void *dst, long dim,
                         float eps, int bf16) {
    __m256 ss = _mm256_setzero_ps();
    for (long d = 0; d < dim; d += 8) {
        __m256 v = load8(x, d, bf16);
        if (res) {
            v = _mm256_add_ps(v, load8(res, d, bf16));
            if (bf16) v = round_bf16(v);
            store8(res, d, v, bf16);
        }
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(reduce_add(ss) / dim + eps));
    const void *src = res ? res : x;
    for (long d = 0; d < dim; d += 8) {
        __m256 n = _mm256_mul_ps(load8(src, d, bf16), inv);
        if (bf16) n = round_bf16(n);
        store8(dst, d, _mm256_mul_ps(load8(weight, d, bf16), n), bf16);
    }
}

/* RMSNorm, as ../pointwise.c: out[t] = weight * x[t] / sqrt(mean(x[t]^2) + eps); with residual
 * not NULL, x[t] is residual[t] + delta[t] first, written back into residual. */
int kvserve_rms_norm(const void *delta, long delta_stride, void *residual, long res_stride,
                     const void *weight, void *out, long out_stride, long tokens, long dim,
                     float eps, int num_threads, int bf16) {
    if (dim % 8) return -1;
    const long size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * dim >= PARALLEL_MIN_ELEMS)
    for (long t = 0; t < tokens; t++) {
        const char *x = (const char *)delta + t * delta_stride * size;
        char *res = residual ? (char *)residual + t * res_stride * size : 0;
        char *dst = (char *)out + t * out_stride * size;
        if (bf16)
            rms_norm_row(x, res, weight, dst, dim, eps, 1);
        else
            rms_norm_row(x, res, weight, dst, dim, eps, 0);
    }
    return 0;
}

INLINE void silu_mul_row(const void *g, const void *u, void *dst, long dim, int bf16) {
    const __m256 log2e = _mm256_set1_ps((float)M_LOG2E), one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (long d = 0; d < dim; d += 8) {
        const __m256 x = load8(g, d, bf16);
        /* e = exp(-|x|) <= 1: sigmoid(x) = 1/(1+e) for x >= 0, e/(1+e) else */
        const __m256 e = exp2_ps(_mm256_mul_ps(_mm256_or_ps(x, sign), log2e));
        const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 num = _mm256_blendv_ps(one, e, neg);
        __m256 s = _mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(one, e)));
        if (bf16) s = round_bf16(s);
        store8(dst, d, _mm256_mul_ps(s, load8(u, d, bf16)), bf16);
    }
}

/* SwiGLU's gate, as ../pointwise.c: out[t] = silu(g[t]) * u[t], gate_up [T, 2 * dim]. */
int kvserve_silu_mul(const void *gate_up, long gu_stride, void *out, long out_stride,
                     long tokens, long dim, int num_threads, int bf16) {
    if (dim % 8) return -1;
    const long size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * dim >= PARALLEL_MIN_ELEMS)
    for (long t = 0; t < tokens; t++) {
        const char *g = (const char *)gate_up + t * gu_stride * size, *u = g + dim * size;
        char *dst = (char *)out + t * out_stride * size;
        if (bf16)
            silu_mul_row(g, u, dst, dim, 1);
        else
            silu_mul_row(g, u, dst, dim, 0);
    }
    return 0;
}

INLINE void rotary_head(void *a, void *b, const float *c, const float *s, long half, int bf16) {
    for (long d = 0; d < half; d += 8) {
        const __m256 va = load8(a, d, bf16), vb = load8(b, d, bf16);
        const __m256 ca = _mm256_loadu_ps(c + d), sa = _mm256_loadu_ps(s + d);
        const __m256 cb = _mm256_loadu_ps(c + half + d);
        const __m256 sb = _mm256_loadu_ps(s + half + d);
        store8(a, d, _mm256_fmsub_ps(va, ca, _mm256_mul_ps(vb, sa)), bf16);
        store8(b, d, _mm256_fmadd_ps(vb, cb, _mm256_mul_ps(va, sb)), bf16);
    }
}

/* Rotary positions in place, as ../pointwise.c: x [T, heads, head_dim]; each head's halves
 * (a, b) become (a cos - b sin, b cos + a sin), cos/sin [T, head_dim] float32. */
int kvserve_rotary(void *x, long x_stride_t, long x_stride_h, long tokens, long heads,
                   long head_dim, const float *cos_t, const float *sin_t, int num_threads,
                   int bf16) {
    const long half = head_dim / 2;
    if (half % 8) return -1;
    const long size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMS)
    for (long t = 0; t < tokens; t++) {
        const float *c = cos_t + t * head_dim, *s = sin_t + t * head_dim;
        for (long h = 0; h < heads; h++) {
            char *a = (char *)x + (t * x_stride_t + h * x_stride_h) * size, *b = a + half * size;
            if (bf16)
                rotary_head(a, b, c, s, half, 1);
            else
                rotary_head(a, b, c, s, half, 0);
        }
    }
    return 0;
}
