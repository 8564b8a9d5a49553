/* A whole decode step's decoder layers in one call: kvserve's fused path for bf16 models on
 * CPUs with AVX512-BF16 (the kernel set with bf16_matmul.c).
 *
 * Contract (kvserve_decode_step): D decodes (one new token each, row t of every activation is
 * decode t's), a Llama-family layer stack without q/k norms, sliding windows or LoRA. hidden
 * [D, hidden_size] bfloat16 holds the token embeddings on entry and is scratch after; out
 * [D, hidden_size] bfloat16 receives the final norm of the last layer's residual stream. Per
 * layer, in order: input RMSNorm; the fused q/k/v projection; rotary on q and k (cos/sin
 * [D, head_dim] float32); K and V stored at slots[t] of the layer's bf16 caches; paged decode
 * attention over positions [0, ends[t]) through row t of tables; o_proj; the residual add and
 * post-attention RMSNorm; gate/up, SwiGLU, down_proj; the residual add (fused with the next
 * norm). Each op is the very kernel the per-op path calls, on the same bf16 tensors, so the
 * result is bit for bit the per-op path's. Returns 0; -2 when scratch memory runs out; else
 * the failing kernel's status (nothing of a layer is skipped silently).
 *
 * Why: at one to a few tokens a step the per-op path pays Python and ATen dispatch (about ten
 * calls a layer) comparable to the matmuls' own time; here it is one call a step. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layer_ops.h"
#include "vec_math.h"

/* One decoder layer: weights packed for kvserve_bf16_matmul (biases float32 or NULL), RMSNorm
 * weights bf16 [hidden_size], K/V caches bf16 [num_blocks, block_size, num_kv_heads, head_dim]. */
struct decode_layer {
    const void *input_norm, *post_norm;
    const uint16_t *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    void *k_cache, *v_cache;
};

struct decode_step_args {
    const struct decode_layer *layers;
    const void *final_norm;
    void *hidden, *out;
    const float *cos, *sin;
    const int64_t *slots, *tables, *ends;
    long num_layers, num_decodes, table_stride, block_size, hidden_size, intermediate_size;
    int num_heads, num_kv_heads, head_dim, num_threads;
    float eps, scale;
};

/* bf16 [n] -> float32 [n] (exact), and float32 -> bf16 rounded to nearest even; n % 16 == 0. */
static void widen(const uint16_t *src, float *dst, long n) {
    for (long i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, load16(src, i, 1));
}
static void narrow(const float *src, uint16_t *dst, long n) {
    for (long i = 0; i < n; i += 16) store16(dst, i, _mm512_loadu_ps(src + i), 1);
}

#define CHECK(call)              \
    do {                         \
        status = (call);         \
        if (status != 0) goto done; \
    } while (0)

int kvserve_decode_step(const struct decode_step_args *a) {
    const long d_n = a->num_decodes, hid = a->hidden_size, inter = a->intermediate_size;
    const long q_size = (long)a->num_heads * a->head_dim;
    const long kv_size = (long)a->num_kv_heads * a->head_dim;
    const long qkv_n = q_size + 2 * kv_size;
    const int th = a->num_threads;
    if (q_size % 16) return -1;
    /* Scratch, bf16 unless named: residual partner [D, hid], normed [D, hid], qkv [D, qkv_n],
     * attention in and out in float32 [D, q_size] each and rounded [D, q_size], gate_up
     * [D, 2 * inter], act [D, inter]. */
    const long elems16 = d_n * (2 * hid + qkv_n + q_size + 2 * inter + inter);
    char *mem = aligned_alloc(64, (size_t)(elems16 * 2 + d_n * q_size * 8 + 64) / 64 * 64);
    if (!mem) return -2;
    uint16_t *other = (uint16_t *)mem, *normed = other + d_n * hid, *qkv = normed + d_n * hid;
    uint16_t *att = qkv + d_n * qkv_n, *gate_up = att + d_n * q_size;
    uint16_t *act = gate_up + d_n * 2 * inter;
    float *q32 = (float *)(act + d_n * inter), *att32 = q32 + d_n * q_size;
    uint16_t *res = a->hidden;  /* the residual stream; `other` takes each sublayer's output */
    int status = 0;
    CHECK(kvserve_rms_norm(res, hid, NULL, 0, a->layers[0].input_norm, normed, hid, d_n, hid,
                           a->eps, th, 1));
    for (long l = 0; l < a->num_layers; l++) {
        const struct decode_layer *w = &a->layers[l];
        CHECK(kvserve_bf16_matmul(normed, hid, d_n, w->qkv, qkv_n, hid, w->qkv_bias, qkv, qkv_n,
                                  1, th));
        CHECK(kvserve_rotary(qkv, qkv_n, a->head_dim, d_n, a->num_heads, a->head_dim, a->cos,
                             a->sin, th, 1));
        CHECK(kvserve_rotary(qkv + q_size, qkv_n, a->head_dim, d_n, a->num_kv_heads,
                             a->head_dim, a->cos, a->sin, th, 1));
        for (long t = 0; t < d_n; t++) {
            const uint16_t *row = qkv + t * qkv_n;
            memcpy((uint16_t *)w->k_cache + a->slots[t] * kv_size, row + q_size, kv_size * 2);
            memcpy((uint16_t *)w->v_cache + a->slots[t] * kv_size, row + q_size + kv_size,
                   kv_size * 2);
            widen(row, q32 + t * q_size, q_size);
        }
        const struct decode_args dec = {
            .q = q32, .k_cache = w->k_cache, .v_cache = w->v_cache, .tables = a->tables,
            .starts = NULL, .ends = a->ends, .prior_out = NULL, .prior_lse = NULL,
            .out = att32, .num_decodes = d_n, .table_stride = a->table_stride,
            .block_size = a->block_size, .q_stride_t = q_size, .q_stride_h = a->head_dim,
            .num_heads = a->num_heads, .num_kv_heads = a->num_kv_heads,
            .head_dim = a->head_dim, .num_threads = th, .scale = a->scale, .kv_bf16 = 1};
        CHECK(kvserve_paged_decode(&dec));
        narrow(att32, att, d_n * q_size);
        CHECK(kvserve_bf16_matmul(att, q_size, d_n, w->o, hid, q_size, w->o_bias, other, hid,
                                  1, th));
        /* other = res + attention output: the new residual; res is free for the MLP's output */
        CHECK(kvserve_rms_norm(res, hid, other, hid, w->post_norm, normed, hid, d_n, hid,
                               a->eps, th, 1));
        uint16_t *swap = res;
        res = other, other = swap;
        CHECK(kvserve_bf16_matmul(normed, hid, d_n, w->gate_up, 2 * inter, hid,
                                  w->gate_up_bias, gate_up, 2 * inter, 1, th));
        CHECK(kvserve_silu_mul(gate_up, 2 * inter, act, inter, d_n, inter, th, 1));
        CHECK(kvserve_bf16_matmul(act, inter, d_n, w->down, hid, inter, w->down_bias, other,
                                  hid, 1, th));
        const void *next = l + 1 < a->num_layers ? a->layers[l + 1].input_norm : a->final_norm;
        CHECK(kvserve_rms_norm(res, hid, other, hid, next, l + 1 < a->num_layers ? normed : a->out,
                               hid, d_n, hid, a->eps, th, 1));
        swap = res;
        res = other, other = swap;
    }
done:
    free(mem);
    return status;
}
