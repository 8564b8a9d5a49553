/* Paged decode attention for x86-64 CPUs with AVX2 and FMA (no AVX-512), float32 arithmetic
 * over a float32, bfloat16 or float16 cache: the kvserve_paged_decode kernel of ../attention.c (the
 * struct and contract of ../paged_decode.h, the same results up to float rounding) at 8 lanes,
 * one loop over the head dim instead of an instance per head dim.
 *
 * Each (decode, kv head) item: its group's query heads over the decode's keys, read in place from
 * the paged cache in chunks of DCH keys, an online softmax in base 2 (scale folded with log2 e
 * into q), starting from the prior softmax part when there is one. Per chunk and query head,
 * the scores go eight keys at a time (one accumulator a key, summed by one transpose) and the
 * output row stays in registers across the chunk's values, so no per-key horizontal sum or
 * store bounds the loop. With fewer items than two a thread (one sequence: its few kv heads),
 * each decode's keys are split in one range a thread instead (`decode_split`), so both cores
 * read the cache. Returns 0; -1 for a head dim that is not a multiple of 16 up to MAX_HD, or a
 * group over MAX_GROUP; -2 when the split's scratch cannot be allocated. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../paged_decode.h"
#include "vec_math.h"

#define MAX_GROUP 16 /* query heads per kv head */
#define MAX_HD 128
#define DCH 64 /* keys per chunk of a decode's online softmax */
#define PARALLEL_MIN_WORK (1L << 20) /* multiply-adds below which a call runs on one thread */
#define SPLIT_MIN_WORK (1L << 16) /* ... below which few items are not split by keys */

/* One chunk of a row's online softmax, in base 2: row[0, n_pad) holds scores (-inf past the
 * chunk's keys; n_pad a multiple of 8), which become 2^(score - new max). Updates the running
 * max *m and sum *l; returns the factor the row's earlier output must be scaled by. */
static inline float online_softmax_block(float *row, int n_pad, float *m, float *l) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int c = 0; c < n_pad; c += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + c));
    const float m_new = fmaxf(*m, reduce_max(mx));
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int c = 0; c < n_pad; c += 8) {
        const __m256 p = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(row + c), mv));
        _mm256_storeu_ps(row + c, p);
        sum = _mm256_add_ps(sum, p);
    }
    const float alpha = exp2f(*m - m_new);
    *l = *l * alpha + reduce_add(sum);
    *m = m_new;
    return alpha;
}

static inline long paged_offset(const int64_t *table, long pos, long block_size,
                                long row_stride) {
    return (table[pos / block_size] * block_size + pos % block_size) * row_stride;
}

/* The 8 horizontal sums of a[0..7], in order, as one vector. */
static inline __m256 hsum8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Scores of one query head (qr, hd floats) against the chunk's keys at element offsets
 * kp[0, n): eight keys at a time, one accumulator a key, their sums transposed together. */
static inline __attribute__((always_inline)) void chunk_scores(
    const float *qr, const void *k_cache, const long *kp, int n, int nv, int kv_dt, float *sc) {
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 acc[8];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
        for (int x = 0; x < nv; x++) {
            const __m256 qx = _mm256_load_ps(qr + 8 * x);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
                acc[k] = _mm256_fmadd_ps(qx, load8(k_cache, kp[j + k] + 8 * x, kv_dt), acc[k]);
        }
        _mm256_store_ps(sc + j, hsum8(acc));
    }
    for (; j < n; j++) {
        __m256 acc = _mm256_setzero_ps();
        for (int x = 0; x < nv; x++)
            acc = _mm256_fmadd_ps(_mm256_load_ps(qr + 8 * x), load8(k_cache, kp[j] + 8 * x, kv_dt),
                                  acc);
        sc[j] = reduce_add(acc);
    }
}

/* orow[0, 8W) += sum_j p[j] * V row j (at element offsets vp[j] + 8 * x0), the W vectors held
 * in registers across the chunk's keys. */
static inline __attribute__((always_inline)) void chunk_values(
    float *orow, const float *p, const void *v_cache, const long *vp, int n, int x0, int w,
    int kv_dt) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int x = 0; x < w; x++) acc[x] = _mm256_load_ps(orow + 8 * x);
    for (int j = 0; j < n; j++) {
        const __m256 pj = _mm256_broadcast_ss(p + j);
#pragma GCC unroll 8
        for (int x = 0; x < w; x++)
            acc[x] = _mm256_fmadd_ps(pj, load8(v_cache, vp[j] + 8 * (x0 + x), kv_dt), acc[x]);
    }
#pragma GCC unroll 8
    for (int x = 0; x < w; x++) _mm256_store_ps(orow + 8 * x, acc[x]);
}

/* One head's output row over the chunk, in register-held slices of up to 8 vectors (a head dim
 * is a multiple of 16, so a slice is 2, 4, 6 or 8 vectors: constants, one loop each). */
static inline __attribute__((always_inline)) void chunk_head_values(
    float *orow, const float *p, const void *v_cache, const long *vp, int n, int nv, int kv_dt) {
    for (int x0 = 0; x0 < nv; x0 += 8) {
        float *o = orow + 8 * x0;
        switch (nv - x0 < 8 ? nv - x0 : 8) {
        case 8: chunk_values(o, p, v_cache, vp, n, x0, 8, kv_dt); break;
        case 6: chunk_values(o, p, v_cache, vp, n, x0, 6, kv_dt); break;
        case 4: chunk_values(o, p, v_cache, vp, n, x0, 4, kv_dt); break;
        default: chunk_values(o, p, v_cache, vp, n, x0, 2, kv_dt); break;
        }
    }
}

/* Decode i's kv head kvh over positions [start, end) (with the prior part when `prior`): its
 * group's normalized outputs at out (head-major, hd each) and, when lse is not NULL, each
 * head's log-sum-exp (natural log) there. Always inlined, so each caller's constant kv_dt
 * yields a loop of its own. */
static inline __attribute__((always_inline)) void decode_item(const struct decode_args *a,
                                                              long i, int kvh, long start,
                                                              long end, int prior, float *out,
                                                              float *lse, int kv_dt) {
    const int hd = a->head_dim, nv = hd / 8, group = a->num_heads / a->num_kv_heads;
    float qv[MAX_GROUP * MAX_HD] __attribute__((aligned(32)));
    float o[MAX_GROUP * MAX_HD] __attribute__((aligned(32)));
    float sc[DCH] __attribute__((aligned(32)));  /* one head's chunk of scores at a time */
    long rows[DCH];  /* the chunk's keys: element offsets of this kv head's row in a cache */
    float m[MAX_GROUP], l[MAX_GROUP];
    const float qscale = a->scale * (float)M_LOG2E;
    for (int r = 0; r < group; r++) {
        const int head = kvh * group + r;
        const float *src = a->q + i * a->q_stride_t + head * a->q_stride_h;
        for (int d = 0; d < hd; d++) qv[r * hd + d] = src[d] * qscale;
        if (prior) {  /* the prior part enters as one key: score lse, value its output */
            memcpy(o + r * hd, a->prior_out + (i * a->num_heads + head) * hd, sizeof(float) * hd);
            m[r] = a->prior_lse[i * a->num_heads + head] * (float)M_LOG2E;
            l[r] = 1.0f;
        } else {
            memset(o + r * hd, 0, sizeof(float) * hd);
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
    }
    const int64_t *table = a->tables + i * a->table_stride;
    const long row_stride = (long)a->num_kv_heads * hd;  /* between positions in a block */
    for (long p0 = start; p0 < end; p0 += DCH) {
        const int n = (int)(end - p0 < DCH ? end - p0 : DCH);
        const int n_pad = (n + 7) & ~7;
        for (int j = 0; j < n; j++)
            rows[j] = paged_offset(table, p0 + j, a->block_size, row_stride) + kvh * hd;
        for (int r = 0; r < group; r++) {
            chunk_scores(qv + r * hd, a->k_cache, rows, n, nv, kv_dt, sc);
            for (int j = n; j < n_pad; j++) sc[j] = -INFINITY;
            const __m256 av = _mm256_set1_ps(online_softmax_block(sc, n_pad, m + r, l + r));
            for (int x = 0; x < nv; x++)
                _mm256_store_ps(o + r * hd + 8 * x,
                                _mm256_mul_ps(_mm256_load_ps(o + r * hd + 8 * x), av));
            chunk_head_values(o + r * hd, sc, a->v_cache, rows, n, nv, kv_dt);
        }
    }
    for (int r = 0; r < group; r++) {
        float *dst = out + (long)r * hd;
        const float inv = 1.0f / l[r];
        for (int d = 0; d < hd; d++) dst[d] = o[r * hd + d] * inv;
        if (lse) lse[r] = (m[r] + log2f(l[r])) * (float)M_LN2;
    }
}

/* Few (decode, kv head) items, as at one sequence: each decode's keys are split in `parts`
 * contiguous ranges, one item each, so every thread reads its share of the cache; the parts'
 * outputs are then merged by their log-sum-exps (the prior part rides with the first). */
static int decode_split(const struct decode_args *a, int parts) {
    const int hd = a->head_dim, group = a->num_heads / a->num_kv_heads;
    const long per_part = (long)a->num_heads * hd;
    float *part_out = malloc(sizeof(float) * (size_t)(a->num_decodes * parts * per_part));
    float *part_lse = malloc(sizeof(float) * (size_t)(a->num_decodes * parts * a->num_heads));
    if (!part_out || !part_lse) {
        free(part_out);
        free(part_lse);
        return -2;
    }
    const long items = a->num_decodes * a->num_kv_heads * parts;
#pragma omp parallel for schedule(dynamic, 1) num_threads(parts)
    for (long item = 0; item < items; item++) {
        const long i = item / (a->num_kv_heads * parts);
        const int kvh = (int)(item / parts % a->num_kv_heads), p = (int)(item % parts);
        const long s0 = a->starts ? a->starts[i] : 0, len = a->ends[i] - s0;
        const long lo = s0 + len * p / parts, hi = s0 + len * (p + 1) / parts;
        const long at = (i * parts + p) * a->num_heads + (long)kvh * group;
        if (hi <= lo && !(p == 0 && a->prior_out)) {  /* an empty part: weight 0 */
            for (int r = 0; r < group; r++) part_lse[at + r] = -INFINITY;
            continue;
        }
        const int prior = p == 0 && a->prior_out;
        if (a->kv_dtype == KV_BF16)
            decode_item(a, i, kvh, lo, hi, prior, part_out + at * hd, part_lse + at, KV_BF16);
        else if (a->kv_dtype == KV_F16)
            decode_item(a, i, kvh, lo, hi, prior, part_out + at * hd, part_lse + at, KV_F16);
        else
            decode_item(a, i, kvh, lo, hi, prior, part_out + at * hd, part_lse + at, KV_F32);
    }
    for (long i = 0; i < a->num_decodes; i++)
        for (int h = 0; h < a->num_heads; h++) {
            float top = -INFINITY, total = 0.0f, w[64];
            for (int p = 0; p < parts; p++)
                top = fmaxf(top, part_lse[(i * parts + p) * a->num_heads + h]);
            for (int p = 0; p < parts; p++)
                total += w[p] = expf(part_lse[(i * parts + p) * a->num_heads + h] - top);
            float *dst = a->out + (i * a->num_heads + h) * hd;
            for (int d = 0; d < hd; d++) {
                float acc = 0.0f;
                for (int p = 0; p < parts; p++)
                    if (w[p] > 0.0f)
                        acc += w[p] * part_out[((i * parts + p) * a->num_heads + h) * hd + d];
                dst[d] = acc / total;
            }
        }
    free(part_out);
    free(part_lse);
    return 0;
}

int kvserve_paged_decode(const struct decode_args *a) {
    const int hd = a->head_dim;
    if (hd % 16 || hd > MAX_HD || a->num_heads % a->num_kv_heads ||
        a->num_heads / a->num_kv_heads > MAX_GROUP)
        return -1;
    const long items = a->num_decodes * a->num_kv_heads;
    long keys = 0;
    for (long i = 0; i < a->num_decodes; i++) keys += a->ends[i] - (a->starts ? a->starts[i] : 0);
    if (a->num_threads > 1 && items < 2L * a->num_threads && a->num_threads <= 64 &&
        keys * a->num_heads * hd >= SPLIT_MIN_WORK)
        return decode_split(a, a->num_threads);  /* one key range a thread */
    /* Small calls run on the calling thread: waking the pool costs more. */
    const int threads = keys * a->num_heads * hd >= PARALLEL_MIN_WORK ? a->num_threads : 1;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
    for (long item = 0; item < items; item++) {
        const long i = item / a->num_kv_heads;
        const int kvh = (int)(item % a->num_kv_heads);
        const long start = a->starts ? a->starts[i] : 0;
        float *out = a->out + (i * a->num_heads + (long)kvh * (a->num_heads / a->num_kv_heads))
                                  * hd;
        const long end = a->ends[i];
        const int prior = a->prior_out != NULL;
        if (a->kv_dtype == KV_BF16)
            decode_item(a, i, kvh, start, end, prior, out, NULL, KV_BF16);
        else if (a->kv_dtype == KV_F16)
            decode_item(a, i, kvh, start, end, prior, out, NULL, KV_F16);
        else
            decode_item(a, i, kvh, start, end, prior, out, NULL, KV_F32);
    }
    return 0;
}
