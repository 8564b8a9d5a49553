/* Fused position-wise ops of a Llama-family layer for x86-64 CPUs with AVX-512, float32:
 * kvserve's CPU kernels, each one pass over its rows where PyTorch's eager ops take several.
 * Rows are split over num_threads OpenMP threads (torch's own libgomp pool) when there are at
 * least PARALLEL_MIN_ELEMS elements; fewer run on the calling thread, since waking the pool costs
 * more than they take (torch draws the same line). Every tensor has a
 * contiguous last dim; the row strides are in elements. Each returns 0, or -1 for a dim that is
 * not a multiple of 16 (the caller then takes its PyTorch path). */
#include <immintrin.h>
#include <math.h>

#include "vec_math.h"

#define PARALLEL_MIN_ELEMS 32768

/* RMSNorm: out[t] = weight * x[t] / sqrt(mean(x[t]^2) + eps), x [T, dim]. With residual not
 * NULL, x[t] is residual[t] + delta[t] first, and that sum is written back into residual
 * (the pre-norm block's "hidden + attention output", fused with the norm that follows). */
int kvserve_rms_norm(const float *delta, long delta_stride, float *residual, long res_stride,
                     const float *weight, float *out, long out_stride, long tokens, long dim,
                     float eps, int num_threads) {
    if (dim % 16) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * dim >= PARALLEL_MIN_ELEMS)
    for (long t = 0; t < tokens; t++) {
        const float *x = delta + t * delta_stride;
        float *res = residual ? residual + t * res_stride : 0;
        float *dst = out + t * out_stride;
        __m512 ss = _mm512_setzero_ps();
        for (long d = 0; d < dim; d += 16) {
            __m512 v = _mm512_loadu_ps(x + d);
            if (res) {
                v = _mm512_add_ps(v, _mm512_loadu_ps(res + d));
                _mm512_storeu_ps(res + d, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / dim + eps));
        const float *src = res ? res : x;
        for (long d = 0; d < dim; d += 16)
            _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(weight + d),
                                                    _mm512_mul_ps(_mm512_loadu_ps(src + d), inv)));
    }
    return 0;
}

/* SwiGLU's gate: out[t] = silu(g[t]) * u[t], g and u the two halves of gate_up [T, 2 * dim]. */
int kvserve_silu_mul(const float *gate_up, long gu_stride, float *out, long out_stride,
                     long tokens, long dim, int num_threads) {
    if (dim % 16) return -1;
    const __m512 log2e = _mm512_set1_ps((float)M_LOG2E), one = _mm512_set1_ps(1.0f);
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * dim >= PARALLEL_MIN_ELEMS)
    for (long t = 0; t < tokens; t++) {
        const float *g = gate_up + t * gu_stride, *u = g + dim;
        float *dst = out + t * out_stride;
        for (long d = 0; d < dim; d += 16) {
            const __m512 x = _mm512_loadu_ps(g + d);
            /* e = exp(-|x|) <= 1, so no overflow: sigmoid(x) = 1/(1+e) for x >= 0, e/(1+e) else */
            const __m512 e = exp2_ps(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_sub_ps(
                _mm512_setzero_ps(), log2e)));
            const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 num = _mm512_mask_mov_ps(one, neg, e);
            const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(one, e));
            _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_mul_ps(x, sig),
                                                    _mm512_loadu_ps(u + d)));
        }
    }
    return 0;
}

/* Rotary positions in place, x [T, heads, head_dim] (token and head strides): the two halves
 * (a, b) of each head become (a cos - b sin, b cos + a sin), with cos/sin [T, head_dim] the
 * per-token tables (halves equal, as RotaryEmbedding builds them). */
int kvserve_rotary(float *x, long x_stride_t, long x_stride_h, long tokens, long heads,
                   long head_dim, const float *cos_t, const float *sin_t, int num_threads) {
    const long half = head_dim / 2;
    if (half % 16) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMS)
    for (long t = 0; t < tokens; t++) {
        const float *c = cos_t + t * head_dim, *s = sin_t + t * head_dim;
        for (long h = 0; h < heads; h++) {
            float *a = x + t * x_stride_t + h * x_stride_h, *b = a + half;
            for (long d = 0; d < half; d += 16) {
                const __m512 va = _mm512_loadu_ps(a + d), vb = _mm512_loadu_ps(b + d);
                const __m512 ca = _mm512_loadu_ps(c + d), sa = _mm512_loadu_ps(s + d);
                const __m512 cb = _mm512_loadu_ps(c + half + d);
                const __m512 sb = _mm512_loadu_ps(s + half + d);
                _mm512_storeu_ps(a + d, _mm512_fmsub_ps(va, ca, _mm512_mul_ps(vb, sa)));
                _mm512_storeu_ps(b + d, _mm512_fmadd_ps(vb, cb, _mm512_mul_ps(va, sb)));
            }
        }
    }
    return 0;
}
