/* One instance of the attention kernel for a head dim HD (a multiple of 16), included once per
 * supported HD by attention.c. Not a standalone header. See attention.c for the contract. */

#define NV (HD / 16)       /* zmm vectors per row of Q, K, V or O */
#define RP (24 / NV)       /* rows per P.V micro-tile: RP * NV <= 24 accumulators; BQ % RP == 0 */
#define FN(name) CAT(name, HD)
_Static_assert(BQ % RP == 0 && BQ % R_S == 0 && HD % 16 == 0, "block sizes must tile BQ");

/* S[r][c0..c0+32) = Qs[r] . Kt[:, c0..c0+32) for R_S rows (12 accumulators). */
static inline void FN(tile_scores)(const float *restrict qs, const float *restrict kt, long ldk,
                                   float *restrict s) {
    __m512 acc[R_S][2];
#pragma GCC unroll 8
    for (int r = 0; r < R_S; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int d = 0; d < HD; d++) {
        const __m512 k0 = _mm512_loadu_ps(kt + d * ldk);
        const __m512 k1 = _mm512_loadu_ps(kt + d * ldk + 16);
#pragma GCC unroll 8
        for (int r = 0; r < R_S; r++) {
            const __m512 q = _mm512_set1_ps(qs[r * HD + d]);
            acc[r][0] = _mm512_fmadd_ps(q, k0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(q, k1, acc[r][1]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R_S; r++) {
        _mm512_storeu_ps(s + r * BK, acc[r][0]);
        _mm512_storeu_ps(s + r * BK + 16, acc[r][1]);
    }
}

/* O[r] = O[r] * alpha[r] + sum_j P[r][j] V[j] for RP rows, j < kn; V's row j at element
 * v_off + j * v_stride of v (its dtype code kv_dt, as load16 takes it). */
static inline __attribute__((always_inline)) void FN(tile_pv)(
        float *restrict o, const float *restrict p, const void *v, long v_off, long v_stride,
        int kn, const float *restrict alpha, int kv_dt) {
    __m512 acc[RP][NV];
#pragma GCC unroll 24
    for (int r = 0; r < RP; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 8
        for (int x = 0; x < NV; x++)
            acc[r][x] = _mm512_mul_ps(_mm512_loadu_ps(o + r * HD + 16 * x), a);
    }
    for (int j = 0; j < kn; j++) {
        __m512 vj[NV];
#pragma GCC unroll 8
        for (int x = 0; x < NV; x++) vj[x] = load16(v, v_off + j * v_stride + 16 * x, kv_dt);
#pragma GCC unroll 24
        for (int r = 0; r < RP; r++) {
            const __m512 pr = _mm512_set1_ps(p[r * BK + j]);
#pragma GCC unroll 8
            for (int x = 0; x < NV; x++) acc[r][x] = _mm512_fmadd_ps(pr, vj[x], acc[r][x]);
        }
    }
#pragma GCC unroll 24
    for (int r = 0; r < RP; r++) {
#pragma GCC unroll 8
        for (int x = 0; x < NV; x++) _mm512_storeu_ps(o + r * HD + 16 * x, acc[r][x]);
    }
}

/* One block of up to BQ rows of a kv head's row list: row r is query r / G of query head
 * kv_head * G + r % G (G query heads per kv head), so the heads that share K/V share a tile.
 * Always inlined, so each caller's constant kv_dtype (V's dtype) yields a loop of its own. */
static inline __attribute__((always_inline)) void FN(attend_block)(
        const struct attention_args *a, const float *restrict kt_head, long ldk, int kv_head,
        long r0, int kv_dtype) {
    float qs[BQ * HD] __attribute__((aligned(64)));
    float s[BQ * BK] __attribute__((aligned(64)));
    float o[BQ * HD] __attribute__((aligned(64)));
    float m[BQ], l[BQ], alpha[BQ];
    const int group = a->num_heads / a->num_kv_heads;
    const long num_rows = a->q_len * group;
    const int rows = (int)(num_rows - r0 < BQ ? num_rows - r0 : BQ);
    const float qscale = a->scale * (float)M_LOG2E;  /* scores in base 2: exp2 below */
    for (int r = 0; r < BQ; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        if (r >= rows) {
            memset(qs + r * HD, 0, sizeof(float) * HD);
            continue;
        }
        const long i = (r0 + r) / group;
        const int head = kv_head * group + (int)((r0 + r) % group);
        const long src = i * a->q_stride_t + head * a->q_stride_h;
        for (int d = 0; d < HD; d++) qs[r * HD + d] = load1(a->q, src + d, a->q_bf16) * qscale;
    }
    memset(o, 0, sizeof(o));
    /* Keys visible to the block's last row; rows beyond `rows` are padding and never stored. */
    long k_end = a->kv_len;
    const long last_query = (r0 + rows - 1) / group;
    if (a->causal_offset >= 0 && last_query + 1 + a->causal_offset < k_end)
        k_end = last_query + 1 + a->causal_offset;
    const long v_head = kv_head * a->v_stride_h;
    for (long k0 = 0; k0 < k_end; k0 += BK) {
        const int kn = (int)(k_end - k0 < BK ? k_end - k0 : BK);
        const int kn_pad = (kn + 31) & ~31;
        for (int r = 0; r < BQ; r += R_S)
            for (int c = 0; c < kn_pad; c += 32)
                FN(tile_scores)(qs + r * HD, kt_head + k0 + c, ldk, s + r * BK + c);
        for (int r = 0; r < BQ; r++) {
            float *row = s + r * BK;
            int visible = kn;  /* keys of this block row r may see */
            if (r < rows && a->causal_offset >= 0) {
                long lim = (r0 + r) / group + a->causal_offset + 1 - k0;
                visible = lim < kn ? (lim > 0 ? (int)lim : 0) : kn;
            }
            for (int c = visible; c < kn_pad; c++) row[c] = -INFINITY;
            /* Finite max: every row sees key 0 in the first block (causal_offset >= 0). */
            alpha[r] = online_softmax_block(row, kn_pad, m + r, l + r);
        }
        for (int r = 0; r < BQ; r += RP)
            FN(tile_pv)(o + r * HD, s + r * BK, a->v, v_head + k0 * a->v_stride_t,
                        a->v_stride_t, kn, alpha + r, kv_dtype);
    }
    for (int r = 0; r < rows; r++) {
        const long i = (r0 + r) / group;
        const int head = kv_head * group + (int)((r0 + r) % group);
        float *dst = a->out + (i * a->num_heads + head) * HD;
        const float inv = 1.0f / l[r];
        for (int d = 0; d < HD; d++) dst[d] = o[r * HD + d] * inv;
        if (a->lse) a->lse[i * a->num_heads + head] = (m[r] + log2f(l[r])) * (float)M_LN2;
    }
}

/* K of one kv head transposed into kt [HD][ldk], zero past kv_len: 16 keys at a time through
 * a small contiguous buffer, so every store writes one whole cache line. */
static void FN(transpose_keys)(const struct attention_args *a, int kvh, float *restrict kt,
                               long ldk) {
    float buf[16 * HD] __attribute__((aligned(64)));
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                             11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(HD));
    for (long j0 = 0; j0 < ldk; j0 += 16) {
        for (int j = 0; j < 16; j++) {
            if (j0 + j < a->kv_len) {
                const long row = (j0 + j) * a->k_stride_t + kvh * a->k_stride_h;
                for (int x = 0; x < NV; x++)
                    _mm512_storeu_ps(buf + j * HD + 16 * x, load16(a->k, row + 16 * x,
                                                                   a->kv_dtype));
            } else
                memset(buf + j * HD, 0, sizeof(float) * HD);
        }
        for (int d = 0; d < HD; d++)
            _mm512_storeu_ps(kt + d * ldk + j0, _mm512_i32gather_ps(idx, buf + d, 4));
    }
}

static int FN(attend)(const struct attention_args *a) {
    /* Rows of kt are padded by 16 floats past a multiple of 32 keys: a power-of-two row
     * stride would map all HD rows of a tile onto one set of the L1 cache. */
    const long ldk = ((a->kv_len + 31) & ~31L) + 16;
    float *kt = aligned_alloc(64, sizeof(float) * a->num_kv_heads * HD * ldk);
    if (!kt) return -2;
    /* Small calls (a short tail) run on the calling thread: waking the pool costs more. */
    const int threads = num_rows_work(a) * HD >= PARALLEL_MIN_WORK ? a->num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int kvh = 0; kvh < a->num_kv_heads; kvh++)
        FN(transpose_keys)(a, kvh, kt + (long)kvh * HD * ldk, ldk);
    const long num_rows = a->q_len * (a->num_heads / a->num_kv_heads);
    const long num_blocks = (num_rows + BQ - 1) / BQ;
    const long items = num_blocks * a->num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long item = 0; item < items; item++) {
        /* Last blocks first: under a causal mask they see the most keys. */
        const long block = num_blocks - 1 - item / a->num_kv_heads;
        const int kvh = (int)(item % a->num_kv_heads);
        if (a->kv_dtype == KV_BF16)
            FN(attend_block)(a, kt + (long)kvh * HD * ldk, ldk, kvh, block * BQ, KV_BF16);
        else if (a->kv_dtype == KV_F16)
            FN(attend_block)(a, kt + (long)kvh * HD * ldk, ldk, kvh, block * BQ, KV_F16);
        else
            FN(attend_block)(a, kt + (long)kvh * HD * ldk, ldk, kvh, block * BQ, KV_F32);
    }
    free(kt);
    return 0;
}

#undef NV
#undef RP
#undef FN
