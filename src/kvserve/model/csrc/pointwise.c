/* Fused position-wise ops of a Llama-family layer for x86-64 CPUs with AVX-512: kvserve's CPU
 * kernels, each one pass over its rows where PyTorch's eager ops take several. Arithmetic is
 * float32; with bf16 set, the activations (and RMSNorm's weight) are bfloat16 arrays, widened on
 * load, and results are rounded to bf16 where PyTorch's bf16 ops round them (each op's comment
 * says where). Rows are split over num_threads OpenMP threads (torch's own libgomp pool) when
 * there are at least PARALLEL_MIN_ELEMS elements; fewer run on the calling thread, since waking
 * the pool costs more than they take (torch draws the same line). Every tensor has a contiguous
 * last dim; the row strides are in elements. Each returns 0, or -1 for a dim that is not a
 * multiple of 16 (the caller then takes its PyTorch path). */
#include <immintrin.h>
#include <math.h>

#include "layer_ops.h"
#include "vec_math.h"

#define PARALLEL_MIN_ELEMS 32768
#define INLINE static inline __attribute__((always_inline))

INLINE void rms_norm_row(const void *x, void *res, const void *weight, void *dst, long dim,
                         float eps, int bf16) {
    __m512 ss = _mm512_setzero_ps();
    for (long d = 0; d < dim; d += 16) {
        __m512 v = load16(x, d, bf16);
        if (res) {
            v = _mm512_add_ps(v, load16(res, d, bf16));
            if (bf16) v = round_bf16(v);
            store16(res, d, v, bf16);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / dim + eps));
    const void *src = res ? res : x;
    for (long d = 0; d < dim; d += 16) {
        __m512 n = _mm512_mul_ps(load16(src, d, bf16), inv);
        if (bf16) n = round_bf16(n);
        store16(dst, d, _mm512_mul_ps(load16(weight, d, bf16), n), bf16);
    }
}

/* RMSNorm: out[t] = weight * x[t] / sqrt(mean(x[t]^2) + eps), x [T, dim]. With residual not
 * NULL, x[t] is residual[t] + delta[t] first, and that sum is written back into residual
 * (the pre-norm block's "hidden + attention output", fused with the norm that follows).
 * bf16 rounds as Hugging Face's RMSNorm does: the sum, the normalized x, and its product with
 * the weight. */
int kvserve_rms_norm(const void *delta, long delta_stride, void *residual, long res_stride,
                     const void *weight, void *out, long out_stride, long tokens, long dim,
                     float eps, int num_threads, int bf16) {
    if (dim % 16) return -1;
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
    const __m512 log2e = _mm512_set1_ps((float)M_LOG2E), one = _mm512_set1_ps(1.0f);
    for (long d = 0; d < dim; d += 16) {
        const __m512 x = load16(g, d, bf16);
        /* e = exp(-|x|) <= 1, so no overflow: sigmoid(x) = 1/(1+e) for x >= 0, e/(1+e) else */
        const __m512 e = exp2_ps(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_sub_ps(
            _mm512_setzero_ps(), log2e)));
        const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 num = _mm512_mask_mov_ps(one, neg, e);
        __m512 s = _mm512_mul_ps(x, _mm512_div_ps(num, _mm512_add_ps(one, e)));
        if (bf16) s = round_bf16(s);
        store16(dst, d, _mm512_mul_ps(s, load16(u, d, bf16)), bf16);
    }
}

/* SwiGLU's gate: out[t] = silu(g[t]) * u[t], g and u the two halves of gate_up [T, 2 * dim].
 * bf16 rounds silu(g) and the product, as F.silu(g) * u on bf16 tensors does. */
int kvserve_silu_mul(const void *gate_up, long gu_stride, void *out, long out_stride,
                     long tokens, long dim, int num_threads, int bf16) {
    if (dim % 16) return -1;
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
    for (long d = 0; d < half; d += 16) {
        const __m512 va = load16(a, d, bf16), vb = load16(b, d, bf16);
        const __m512 ca = _mm512_loadu_ps(c + d), sa = _mm512_loadu_ps(s + d);
        const __m512 cb = _mm512_loadu_ps(c + half + d);
        const __m512 sb = _mm512_loadu_ps(s + half + d);
        store16(a, d, _mm512_fmsub_ps(va, ca, _mm512_mul_ps(vb, sa)), bf16);
        store16(b, d, _mm512_fmadd_ps(vb, cb, _mm512_mul_ps(va, sb)), bf16);
    }
}

/* Rotary positions in place, x [T, heads, head_dim] (token and head strides): the two halves
 * (a, b) of each head become (a cos - b sin, b cos + a sin), with cos/sin [T, head_dim] the
 * per-token float32 tables (halves equal, as RotaryEmbedding builds them). bf16 rounds each
 * result once (more exactly than PyTorch's bf16 ops, which round the tables and each step). */
int kvserve_rotary(void *x, long x_stride_t, long x_stride_h, long tokens, long heads,
                   long head_dim, const float *cos_t, const float *sin_t, int num_threads,
                   int bf16) {
    const long half = head_dim / 2;
    if (half % 16) return -1;
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
