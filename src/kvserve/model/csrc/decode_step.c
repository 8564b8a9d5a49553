/* A whole decode step's decoder layers in one call: kvserve's fused path on AVX-512 CPUs, for
 * bf16 models whose projections run on kvserve's bf16 matmul (AVX512-BF16), for float32
 * models whose projections are GGUF blocks kept packed (Q4_1 / Q8_0 through quant_matmul.c),
 * and for either whose projections are int8 x int8 (int8_matmul.c, AVX512-VNNI).
 *
 * Contract (kvserve_decode_step): D decodes (one new token each, row t of every activation is
 * decode t's), a Llama-family layer stack without q/k norms, sliding windows or LoRA, its
 * activations all bf16 (`bf16` = 1, every projection PROJ_BF16 or PROJ_I8) or all float32
 * (`bf16` = 0, every projection PROJ_Q4, PROJ_Q8 or PROJ_I8), its K/V caches of type
 * `kv_dtype` (kv_dtype.h): KV_BF16 under bf16 activations; KV_F32, KV_BF16 or KV_F16 under
 * float32 ones, each new K/V row then rounded to nearest even as it is stored, as torch
 * rounds). hidden [D, hidden_size]
 * holds the token embeddings on entry and is scratch after; out [D, hidden_size] receives the
 * final norm of the
 * last layer's residual stream. Per layer, in order: input RMSNorm; the fused q/k/v
 * projection; rotary on q and k (cos/sin [D, head_dim] float32); K and V stored at slots[t] of
 * the layer's caches; paged decode attention over positions [0, ends[t]) through row t of
 * tables; o_proj; the residual add and post-attention RMSNorm; gate/up, SwiGLU, down_proj; the
 * residual add (fused with the next norm). Each op is the very kernel the per-op path calls, on
 * the same tensors (a packed projection's bias added after its matmul, as quant_linear does),
 * so the result is bit for bit the per-op path's. Returns 0; -2 when scratch memory runs out;
 * else the failing kernel's status (nothing of a layer is skipped silently).
 *
 * Why: at one to a few tokens a step the per-op path pays Python and ATen dispatch (about ten
 * calls a layer) comparable to the matmuls' own time; here it is one call a step.
 *
 * The AVX2 set (avx2/decode_step.c) compiles this file with DECODE_STEP_BLOCKS_ONLY defined:
 * float32 activations over GGUF blocks only, since that set has no bf16 or int8 matmul; a bf16
 * step or a PROJ_BF16 / PROJ_I8 projection then returns -1. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_dtype.h"
#include "layer_ops.h"
#ifndef DECODE_STEP_BLOCKS_ONLY
#include "vec_math.h"
#else
#include "avx2/vec_math.h"
#endif

enum { PROJ_BF16 = 0, PROJ_Q4 = 1, PROJ_Q8 = 2, PROJ_I8 = 3 };

/* One projection's weights: `codes` packed for kvserve_bf16_matmul (PROJ_BF16), or for
 * kvserve_i8_matmul with its per-channel float32 scales (PROJ_I8), or a GGUF block matrix's
 * codes with its fp16 scales (and mins, PROJ_Q4) as quant_matmul.c reads them; bias float32
 * [n] or NULL. */
struct decode_proj {
    const void *codes, *scale, *min;
    const float *bias;
    long kind;
};

/* One decoder layer: RMSNorm weights [hidden_size] and K/V caches [num_blocks, block_size,
 * num_kv_heads, head_dim], both in the activations' dtype. */
struct decode_layer {
    const void *input_norm, *post_norm;
    struct decode_proj qkv, o, gate_up, down;
    void *k_cache, *v_cache;
};

struct decode_step_args {
    const struct decode_layer *layers;
    const void *final_norm;
    void *hidden, *out;
    const float *cos, *sin;
    const int64_t *slots, *tables, *ends;
    long num_layers, num_decodes, table_stride, block_size, hidden_size, intermediate_size;
    int num_heads, num_kv_heads, head_dim, num_threads, bf16;
    float eps, scale;
    int kv_dtype;
};

/* bf16 [n] -> float32 [n] (exact), and float32 -> bf16 rounded to nearest even as torch rounds
 * (each set's store with round_bf16); n % 16 == 0. */
#ifndef DECODE_STEP_BLOCKS_ONLY
static void widen(const uint16_t *src, float *dst, long n) {
    for (long i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, load16(src, i, 1));
}
static void narrow(const float *src, uint16_t *dst, long n) {
    for (long i = 0; i < n; i += 16) store16(dst, i, _mm512_loadu_ps(src + i), 1);
}
#define HAS_BF16_INT8 1
#else
static void widen(const uint16_t *src, float *dst, long n) {  /* never called: bf16 refused */
    (void)src, (void)dst, (void)n;
}
static void narrow(const float *src, uint16_t *dst, long n) {
    for (long i = 0; i < n; i += 8) store8(dst, i, _mm256_loadu_ps(src + i), 1);
}
#define HAS_BF16_INT8 0
#endif

/* Stores a K or V row of n activations (float32 unless bf; n % 16 == 0) at dst in the cache's
 * type: a copy where the two agree, else float32 rounded to nearest even into bf16 (`narrow`)
 * or, by F16C, into fp16. */
static void store_kv(const char *row, void *dst, long n, int bf, int kv_dtype) {
    if (bf || kv_dtype == KV_F32) {
        memcpy(dst, row, (size_t)n * (bf ? 2 : 4));
    } else if (kv_dtype == KV_BF16) {
        narrow((const float *)row, dst, n);
    } else {
        for (long i = 0; i < n; i += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps((const float *)row + i),
                                             _MM_FROUND_TO_NEAREST_INT));
    }
}

#define CHECK(call)              \
    do {                         \
        status = (call);         \
        if (status != 0) goto done; \
    } while (0)

/* y [m, n] = x [m, k] @ w.T (+ bias), in the activations' dtype (bf16 when bf, float32 for
 * packed blocks). */
static int project(const struct decode_proj *w, const void *x, long x_stride, long m, long n,
                   long k, void *y, long y_stride, int th, int bf) {
    int status;
    switch (w->kind) {
#if HAS_BF16_INT8
    case PROJ_BF16:
        return kvserve_bf16_matmul(x, x_stride, m, w->codes, n, k, w->bias, y, y_stride, 1, th);
    case PROJ_I8:
        return kvserve_i8_matmul(x, x_stride, bf, m, w->codes, w->scale, n, k, w->bias, y,
                                 y_stride, bf, th);
#endif
    case PROJ_Q4:
        status = kvserve_q4_matmul(x, x_stride, w->codes, w->scale, w->min, y, y_stride, m, n,
                                   k, th);
        break;
    case PROJ_Q8:
        status = kvserve_q8_matmul(x, x_stride, w->codes, w->scale, y, y_stride, m, n, k, th);
        break;
    default:
        return -1;
    }
    if (status == 0 && w->bias)
        for (long t = 0; t < m; t++)
            for (long j = 0; j < n; j++) ((float *)y)[t * y_stride + j] += w->bias[j];
    return status;
}

int kvserve_decode_step(const struct decode_step_args *a) {
    const long d_n = a->num_decodes, hid = a->hidden_size, inter = a->intermediate_size;
    const long q_size = (long)a->num_heads * a->head_dim;
    const long kv_size = (long)a->num_kv_heads * a->head_dim;
    const long qkv_n = q_size + 2 * kv_size;
    const int th = a->num_threads, bf = a->bf16;
    const long es = bf ? 2 : 4;  /* bytes an activation element */
    const long ks = a->kv_dtype == KV_F32 ? 4 : 2;  /* bytes a cache element */
    if (q_size % 16 || kv_size % 16 || (bf && !HAS_BF16_INT8) ||
        (bf && a->kv_dtype != KV_BF16) || (unsigned)a->kv_dtype > KV_F16)
        return -1;
    /* Scratch in the activations' dtype: residual partner [D, hid], normed [D, hid], qkv
     * [D, qkv_n], attention out [D, q_size], gate_up [D, 2 * inter], act [D, inter]; for bf16
     * also q and the attention out in float32 [D, q_size] each (paged decode's dtype). */
    const long elems = d_n * (2 * hid + qkv_n + q_size + 2 * inter + inter);
    const long f32 = bf ? 2 * d_n * q_size : 0;
    char *mem = aligned_alloc(64, (size_t)(elems * es + f32 * 4 + 64) / 64 * 64);
    if (!mem) return -2;
    char *other = mem, *normed = other + d_n * hid * es, *qkv = normed + d_n * hid * es;
    char *att = qkv + d_n * qkv_n * es, *gate_up = att + d_n * q_size * es;
    char *act = gate_up + d_n * 2 * inter * es;
    float *q32 = (float *)(act + d_n * inter * es), *att32 = q32 + d_n * q_size;
    char *res = a->hidden;  /* the residual stream; `other` takes each sublayer's output */
    int status = 0;
    CHECK(kvserve_rms_norm(res, hid, NULL, 0, a->layers[0].input_norm, normed, hid, d_n, hid,
                           a->eps, th, bf));
    for (long l = 0; l < a->num_layers; l++) {
        const struct decode_layer *w = &a->layers[l];
        CHECK(project(&w->qkv, normed, hid, d_n, qkv_n, hid, qkv, qkv_n, th, bf));
        CHECK(kvserve_rotary(qkv, qkv_n, a->head_dim, d_n, a->num_heads, a->head_dim, a->cos,
                             a->sin, th, bf));
        CHECK(kvserve_rotary(qkv + q_size * es, qkv_n, a->head_dim, d_n, a->num_kv_heads,
                             a->head_dim, a->cos, a->sin, th, bf));
        for (long t = 0; t < d_n; t++) {
            const char *row = qkv + t * qkv_n * es;
            store_kv(row + q_size * es, (char *)w->k_cache + a->slots[t] * kv_size * ks, kv_size,
                     bf, a->kv_dtype);
            store_kv(row + (q_size + kv_size) * es,
                     (char *)w->v_cache + a->slots[t] * kv_size * ks, kv_size, bf, a->kv_dtype);
            if (bf) widen((const uint16_t *)row, q32 + t * q_size, q_size);
        }
        const struct decode_args dec = {
            .q = bf ? q32 : (const float *)qkv, .k_cache = w->k_cache, .v_cache = w->v_cache,
            .tables = a->tables, .starts = NULL, .ends = a->ends, .prior_out = NULL,
            .prior_lse = NULL, .out = bf ? att32 : (float *)att, .num_decodes = d_n,
            .table_stride = a->table_stride, .block_size = a->block_size,
            .q_stride_t = bf ? q_size : qkv_n, .q_stride_h = a->head_dim,
            .num_heads = a->num_heads, .num_kv_heads = a->num_kv_heads,
            .head_dim = a->head_dim, .num_threads = th, .scale = a->scale, .kv_dtype = a->kv_dtype};
        CHECK(kvserve_paged_decode(&dec));
        if (bf) narrow(att32, (uint16_t *)att, d_n * q_size);
        CHECK(project(&w->o, att, q_size, d_n, hid, q_size, other, hid, th, bf));
        /* other = res + attention output: the new residual; res is free for the MLP's output */
        CHECK(kvserve_rms_norm(res, hid, other, hid, w->post_norm, normed, hid, d_n, hid,
                               a->eps, th, bf));
        char *swap = res;
        res = other, other = swap;
        CHECK(project(&w->gate_up, normed, hid, d_n, 2 * inter, hid, gate_up, 2 * inter, th,
                      bf));
        CHECK(kvserve_silu_mul(gate_up, 2 * inter, act, inter, d_n, inter, th, bf));
        CHECK(project(&w->down, act, inter, d_n, hid, inter, other, hid, th, bf));
        const void *next = l + 1 < a->num_layers ? a->layers[l + 1].input_norm : a->final_norm;
        CHECK(kvserve_rms_norm(res, hid, other, hid, next, l + 1 < a->num_layers ? normed : a->out,
                               hid, d_n, hid, a->eps, th, bf));
        swap = res;
        res = other, other = swap;
    }
done:
    free(mem);
    return status;
}
