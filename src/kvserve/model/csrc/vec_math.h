/* Vector math shared by kvserve's CPU kernels (AVX-512, float32 arithmetic; bfloat16 arrays are
 * widened on load and rounded on store). */
#ifndef KVSERVE_VEC_MATH_H
#define KVSERVE_VEC_MATH_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kv_dtype.h"

/* 2^x for x <= 0 (x - row max); exactly 0 below -126, where -inf (a masked key) lands too.
 * Degree-7 Taylor polynomial of 2^f on |f| <= 1/2: relative error about 5e-9. */
static inline __m512 exp2_ps(__m512 x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}

/* One block of a row's online softmax, in base 2. row[0, n_pad) holds scores (-inf where
 * masked; n_pad a multiple of 16), which become 2^(score - new max). Updates the running max *m
 * and sum *l, and returns the factor the row's earlier partial output must be scaled by. Some
 * score of this block or an earlier one must be finite, so that *m ends finite. */
static inline float online_softmax_block(float *row, int n_pad, float *m, float *l) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < n_pad; c += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + c));
    const float m_new = fmaxf(*m, _mm512_reduce_max_ps(mx));
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < n_pad; c += 16) {
        const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(row + c), mv));
        _mm512_storeu_ps(row + c, p);
        sum = _mm512_add_ps(sum, p);
    }
    const float alpha = exp2f(*m - m_new);
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = m_new;
    return alpha;
}

/* v rounded to bfloat16's precision, to nearest even, kept as float32 (NaN stays NaN): the
 * rounding PyTorch applies when a float32 result becomes a bf16 tensor. */
static inline __m512 round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
        _mm512_set1_epi32((int)0xffff0000u));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), nan, _mm512_set1_ps(NAN));
}

/* 16 elements from element off on of an array of type dt (KV_F32, KV_BF16 or KV_F16), as
 * float32; widening either 16-bit type is exact. */
static inline __m512 load16(const void *p, long off, int dt) {
    if (dt == KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + off))), 16));
    if (dt == KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + off)));
    return _mm512_loadu_ps((const float *)p + off);
}

/* Element off of a float32 array, or (bf16) of a bfloat16 one, as float32. */
static inline float load1(const void *p, long off, int bf16) {
    if (!bf16) return ((const float *)p)[off];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[off] << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

/* Stores the lanes of v set in mask at element off of a float32 array, or (bf16) rounded into
 * a bfloat16 one. */
static inline void store16_masked(void *p, long off, __m512 v, int bf16, __mmask16 mask) {
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t *)p + off, mask, _mm512_cvtepi32_epi16(
            _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16)));
    else
        _mm512_mask_storeu_ps((float *)p + off, mask, v);
}

/* Stores 16 elements at element off of a float32 array, or (bf16) rounded into a bfloat16 one. */
static inline void store16(void *p, long off, __m512 v, int bf16) {
    store16_masked(p, off, v, bf16, (__mmask16)0xffff);
}

#endif
