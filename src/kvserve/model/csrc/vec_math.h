/* Vector math shared by kvserve's CPU kernels (AVX-512, float32). */
#ifndef KVSERVE_VEC_MATH_H
#define KVSERVE_VEC_MATH_H

#include <immintrin.h>
#include <math.h>

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

#endif
