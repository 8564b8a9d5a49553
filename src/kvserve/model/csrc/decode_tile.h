/* One instance of the paged decode kernel for a head dim HD (a multiple of 16), included once
 * per supported HD by attention.c. Not a standalone header. See attention.c for the contract. */

#define NV (HD / 16)
#define FN(name) CAT(name, HD)

/* One (decode, kv head): its group's query heads over the decode's keys, read in place from the
 * paged cache (kv_dt: its dtype code, as load16 takes it), starting from the prior softmax part
 * when there is one. Always inlined, so each caller's constant kv_dt yields a loop of its own. */
static inline __attribute__((always_inline)) void FN(decode_item)(const struct decode_args *a,
                                                                  long i, int kvh, int kv_dt) {
    const int group = a->num_heads / a->num_kv_heads;
    float qv[MAX_GROUP * HD] __attribute__((aligned(64)));
    float o[MAX_GROUP * HD] __attribute__((aligned(64)));
    float sc[MAX_GROUP * DCH] __attribute__((aligned(64)));
    float m[MAX_GROUP], l[MAX_GROUP];
    const float qscale = a->scale * (float)M_LOG2E;
    for (int r = 0; r < group; r++) {
        const int head = kvh * group + r;
        const float *src = a->q + i * a->q_stride_t + head * a->q_stride_h;
        for (int d = 0; d < HD; d++) qv[r * HD + d] = src[d] * qscale;
        if (a->prior_out) {  /* the prior part enters as one key: score lse, value its output */
            memcpy(o + r * HD, a->prior_out + (i * a->num_heads + head) * HD, sizeof(float) * HD);
            m[r] = a->prior_lse[i * a->num_heads + head] * (float)M_LOG2E;
            l[r] = 1.0f;
        } else {
            memset(o + r * HD, 0, sizeof(float) * HD);
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
    }
    const int64_t *table = a->tables + i * a->table_stride;
    const long start = a->starts ? a->starts[i] : 0, end = a->ends[i];
    const long row_stride = (long)a->num_kv_heads * HD;  /* between positions in a block */
    for (long p0 = start; p0 < end; p0 += DCH) {
        const int n = (int)(end - p0 < DCH ? end - p0 : DCH);
        const int n_pad = (n + 15) & ~15;
        for (int j = 0; j < n; j++) {
            const long pos = p0 + j;
            const long kp = paged_offset(table, pos, a->block_size, row_stride) + kvh * HD;
            __m512 kx[NV];
#pragma GCC unroll 8
            for (int x = 0; x < NV; x++) kx[x] = load16(a->k_cache, kp + 16 * x, kv_dt);
            for (int r = 0; r < group; r++) {
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qv + r * HD), kx[0]);
#pragma GCC unroll 8
                for (int x = 1; x < NV; x++)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qv + r * HD + 16 * x), kx[x], acc);
                sc[r * DCH + j] = _mm512_reduce_add_ps(acc);
            }
        }
        for (int r = 0; r < group; r++) {
            float *row = sc + r * DCH;
            for (int j = n; j < n_pad; j++) row[j] = -INFINITY;
            const float alpha = online_softmax_block(row, n_pad, m + r, l + r);  /* n >= 1 */
            const __m512 av = _mm512_set1_ps(alpha);
            for (int x = 0; x < NV; x++)
                _mm512_storeu_ps(o + r * HD + 16 * x,
                                 _mm512_mul_ps(_mm512_loadu_ps(o + r * HD + 16 * x), av));
        }
        for (int j = 0; j < n; j++) {
            const long pos = p0 + j;
            const long vp = paged_offset(table, pos, a->block_size, row_stride) + kvh * HD;
            __m512 vx[NV];
#pragma GCC unroll 8
            for (int x = 0; x < NV; x++) vx[x] = load16(a->v_cache, vp + 16 * x, kv_dt);
            for (int r = 0; r < group; r++) {
                const __m512 pr = _mm512_set1_ps(sc[r * DCH + j]);
#pragma GCC unroll 8
                for (int x = 0; x < NV; x++) {
                    float *op = o + r * HD + 16 * x;
                    _mm512_storeu_ps(op, _mm512_fmadd_ps(pr, vx[x], _mm512_loadu_ps(op)));
                }
            }
        }
    }
    for (int r = 0; r < group; r++) {
        const int head = kvh * group + r;
        float *dst = a->out + (i * a->num_heads + head) * HD;
        const float inv = 1.0f / l[r];
        for (int d = 0; d < HD; d++) dst[d] = o[r * HD + d] * inv;
    }
}

static int FN(decode)(const struct decode_args *a) {
    const long items = a->num_decodes * a->num_kv_heads;
    long keys = 0;
    for (long i = 0; i < a->num_decodes; i++) keys += a->ends[i] - (a->starts ? a->starts[i] : 0);
    /* Small calls run on the calling thread: waking the pool costs more. */
    const int threads = keys * a->num_heads * HD >= PARALLEL_MIN_WORK ? a->num_threads : 1;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
    for (long item = 0; item < items; item++) {
        const long i = item / a->num_kv_heads;
        const int kvh = (int)(item % a->num_kv_heads);
        if (a->kv_dtype == KV_BF16)
            FN(decode_item)(a, i, kvh, KV_BF16);
        else if (a->kv_dtype == KV_F16)
            FN(decode_item)(a, i, kvh, KV_F16);
        else
            FN(decode_item)(a, i, kvh, KV_F32);
    }
    return 0;
}

#undef NV
#undef FN
