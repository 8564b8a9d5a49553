/* The paged decode kernel's arguments (attention.c), shared with the fused decode step
 * (decode_step.c), which calls it once a layer. */
#ifndef KVSERVE_PAGED_DECODE_H
#define KVSERVE_PAGED_DECODE_H

#include <stdint.h>

#include "kv_dtype.h"

/* Contract (kvserve_paged_decode): one query token per decode i < num_decodes, q [D, H, HD]
 * (token and head strides in elements), attending to the keys at positions [starts[i], ends[i])
 * (starts NULL: from 0; ends[i] > starts[i]) of its sequence, read in place from the paged
 * caches k_cache/v_cache [num_blocks, block_size, num_kv_heads, HD] (contiguous; of type
 * kv_dtype, KV_F32, KV_BF16 or KV_F16: the arithmetic is float32 either way) through row i
 * of tables (int64, table_stride apart; position p sits in block tables[p / block_size] at
 * offset p % block_size). With prior_out [D, H, HD] and prior_lse [D, H] (contiguous), that
 * softmax part over other keys (a shared head) is merged in exactly. Writes out [D, H, HD]
 * (contiguous). num_heads / num_kv_heads must be <= MAX_GROUP. Returns 0; -1 for a head_dim
 * or group this build does not serve. */
struct decode_args {
    const float *q;
    const void *k_cache, *v_cache;
    const int64_t *tables, *starts, *ends;
    const float *prior_out, *prior_lse;
    float *out;
    long num_decodes, table_stride, block_size, q_stride_t, q_stride_h;
    int num_heads, num_kv_heads, head_dim, num_threads;
    float scale;
    int kv_dtype;
};

int kvserve_paged_decode(const struct decode_args *args);

#endif
