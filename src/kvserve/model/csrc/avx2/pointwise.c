/* Fused position-wise ops of a Llama-family layer for x86-64 CPUs with AVX2 and FMA (no
 * AVX-512), float32: the same three kernels, names and contracts as ../pointwise.c, at 8 lanes.
 * Rows are split over num_threads OpenMP threads when there are at least PARALLEL_MIN_ELEMS
 * elements. Every tensor has a contiguous last dim; row strides are in elements. Each returns 0,
 * or -1 for a dim that is not a multiple of 8 (the caller then takes its PyTorch path). */
#include <immintrin.h>
#include <math.h>

#include "vec_math.h"

#define PARALLEL_MIN_ELEMS 32768

/* RMSNorm, as ../pointwise.c: out[t] = weight * x[t] / sqrt(mean(x[t]^2) + eps); with residual
 * not NULL, x[t] is residual[t] + delta[t] first, written back into residual. */
int kvserve_rms_norm(const float *delta, long delta_stride, float *residual, long res_stride,
                     const float *weight, float *out, long out_stride, long tokens, long dim,
                     float eps, int num_threads) {
    if (dim % 8) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * dim >= PARALLEL_MIN_ELEMS)
    for (long t = 0; t < tokens; t++) {
        const float *x = delta + t * delta_stride;
        float *res = residual ? residual + t * res_stride : 0;
        float *dst = out + t * out_stride;
        __m256 ss = _mm256_setzero_ps();
        for (long d = 0; d < dim; d += 8) {
            __m256 v = _mm256_loadu_ps(x + d);
            if (res) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(res + d));
                _mm256_storeu_ps(res + d, v);
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(reduce_add(ss) / dim + eps));
        const float *src = res ? res : x;
        for (long d = 0; d < dim; d += 8)
            _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(weight + d),
                                                    _mm256_mul_ps(_mm256_loadu_ps(src + d), inv)));
    }
    return 0;
}

/* SwiGLU's gate, as ../pointwise.c: out[t] = silu(g[t]) * u[t], gate_up [T, 2 * dim]. */
int kvserve_silu_mul(const float *gate_up, long gu_stride, float *out, long out_stride,
                     long tokens, long dim, int num_threads) {
    if (dim % 8) return -1;
    const __m256 log2e = _mm256_set1_ps((float)M_LOG2E), one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * dim >= PARALLEL_MIN_ELEMS)
    for (long t = 0; t < tokens; t++) {
        const float *g = gate_up + t * gu_stride, *u = g + dim;
        float *dst = out + t * out_stride;
        for (long d = 0; d < dim; d += 8) {
            const __m256 x = _mm256_loadu_ps(g + d);
            /* e = exp(-|x|) <= 1: sigmoid(x) = 1/(1+e) for x >= 0, e/(1+e) else */
            const __m256 e = exp2_ps(_mm256_mul_ps(_mm256_or_ps(x, sign), log2e));
            const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
            const __m256 num = _mm256_blendv_ps(one, e, neg);
            const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
            _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_mul_ps(x, sig),
                                                    _mm256_loadu_ps(u + d)));
        }
    }
    return 0;
}

/* Rotary positions in place, as ../pointwise.c: x [T, heads, head_dim]; each head's halves
 * (a, b) become (a cos - b sin, b cos + a sin), cos/sin [T, head_dim]. */
int kvserve_rotary(float *x, long x_stride_t, long x_stride_h, long tokens, long heads,
                   long head_dim, const float *cos_t, const float *sin_t, int num_threads) {
    const long half = head_dim / 2;
    if (half % 8) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMS)
    for (long t = 0; t < tokens; t++) {
        const float *c = cos_t + t * head_dim, *s = sin_t + t * head_dim;
        for (long h = 0; h < heads; h++) {
            float *a = x + t * x_stride_t + h * x_stride_h, *b = a + half;
            for (long d = 0; d < half; d += 8) {
                const __m256 va = _mm256_loadu_ps(a + d), vb = _mm256_loadu_ps(b + d);
                const __m256 ca = _mm256_loadu_ps(c + d), sa = _mm256_loadu_ps(s + d);
                const __m256 cb = _mm256_loadu_ps(c + half + d);
                const __m256 sb = _mm256_loadu_ps(s + half + d);
                _mm256_storeu_ps(a + d, _mm256_fmsub_ps(va, ca, _mm256_mul_ps(vb, sa)));
                _mm256_storeu_ps(b + d, _mm256_fmadd_ps(vb, cb, _mm256_mul_ps(va, sb)));
            }
        }
    }
    return 0;
}
