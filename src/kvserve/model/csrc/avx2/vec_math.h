/* Vector math shared by kvserve's AVX2 kernels (float32, 8 lanes): the AVX2 counterparts of
 * ../vec_math.h's. */
#ifndef KVSERVE_AVX2_VEC_MATH_H
#define KVSERVE_AVX2_VEC_MATH_H

#include <immintrin.h>

static inline float reduce_add(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float reduce_max(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 2^x for x <= 0; exactly 0 below -126 (where -inf, a masked key, lands). The degree-7
 * polynomial of ../vec_math.h, with 2^n built in the exponent bits (AVX2 has no scalef). */
static inline __m256 exp2_ps(__m256 x) {
    const __m256 floor = _mm256_set1_ps(-126.0f);
    const __m256 tiny = _mm256_cmp_ps(x, floor, _CMP_LT_OQ);
    x = _mm256_max_ps(x, floor);
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5252733804059841e-05f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-02f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

#endif
