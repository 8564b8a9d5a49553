/* Vector math shared by kvserve's AVX2 kernels (float32 arithmetic, 8 lanes; bfloat16 arrays
 * widened on load and rounded on store): the AVX2 counterparts of ../vec_math.h's. */
#ifndef KVSERVE_AVX2_VEC_MATH_H
#define KVSERVE_AVX2_VEC_MATH_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "../kv_dtype.h"

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

/* v rounded to bfloat16's precision, to nearest even, kept as float32 (NaN stays NaN). */
static inline __m256 round_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
        _mm256_set1_epi32((int)0xffff0000u));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_set1_ps(NAN),
                            _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/* 8 elements from element off on of an array of type dt (KV_F32, KV_BF16 or KV_F16), as
 * float32 (exact). */
static inline __m256 load8(const void *p, long off, int dt) {
    if (dt == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)p + off))), 16));
    if (dt == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + off)));
    return _mm256_loadu_ps((const float *)p + off);
}

/* Stores 8 elements at element off of a float32 array, or (bf16) rounded into a bfloat16 one. */
static inline void store8(void *p, long off, __m256 v, int bf16) {
    if (bf16) {
        const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi),
                                                _mm256_extracti128_si256(hi, 1));
        _mm_storeu_si128((__m128i *)((uint16_t *)p + off), packed);
    } else {
        _mm256_storeu_ps((float *)p + off, v);
    }
}

#endif
