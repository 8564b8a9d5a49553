/* Flash-style softmax attention for x86-64 CPUs with AVX-512, float32: kvserve's CPU kernel.
 *
 * Contract (kvserve_attention): q [q_len, num_heads, head_dim], k and v [kv_len, num_kv_heads,
 * head_dim], each with its own token and head strides (in elements) and a contiguous last dim;
 * q bfloat16 when q_bf16, k and v of type kv_dtype (kv_dtype.h; the arithmetic is float32);
 * num_heads a multiple of num_kv_heads (grouped-query attention: query head h reads kv head
 * h / (num_heads / num_kv_heads)). causal_offset < 0: every query sees every key; else query i
 * sees keys j <= i + causal_offset (0: a chunk over its own keys; kv_len - q_len: a chunk after
 * cached context). Writes out [q_len, num_heads, head_dim] (contiguous) and, when lse is not
 * NULL, the natural-log sum of exp of each row's scaled scores into lse [q_len, num_heads].
 * num_threads: OpenMP threads to use (torch.get_num_threads()). Returns 0; -1 for a head_dim
 * this build has no instance of (each multiple of 16 up to 128 has one); -2 when memory runs out.
 *
 * How: per (query head, block of BQ queries) an online softmax over blocks of BK keys; scores
 * come from register-tiled FMAs against K transposed once per call, probabilities are applied
 * to V rows in place, all in base 2 (scale folded with log2 e into Q). Threads: OpenMP, the
 * same runtime (libgomp) that torch's CPU build loads, so both share one pool. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layer_ops.h"
#include "vec_math.h"

#define BQ 48 /* rows per block: a multiple of R_S (6) and of every RP (24 / (HD / 16)) */
#define BK 128 /* keys per block */
#define R_S 6 /* rows per score micro-tile (x 32 columns: 12 accumulators) */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

struct attention_args {
    const void *q, *k, *v;
    float *out, *lse;
    long q_len, kv_len, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h;
    int num_heads, num_kv_heads, head_dim, num_threads;
    long causal_offset;
    float scale;
    int q_bf16, kv_dtype;
};

#define MAX_GROUP 16 /* query heads per kv head */
#define PARALLEL_MIN_WORK (1L << 20) /* multiply-adds below which a call runs on one thread */

/* The element offset of position pos of a sequence in a paged cache [blocks, block_size, rows
 * of row_stride elements], through its block table. */
static inline long paged_offset(const int64_t *table, long pos, long block_size,
                                long row_stride) {
    return (table[pos / block_size] * block_size + pos % block_size) * row_stride;
}

/* Query rows times keys of an attention call (its multiply-adds over HD). */
static inline long num_rows_work(const struct attention_args *a) {
    return a->q_len * a->num_heads * a->kv_len;
}
#define DCH 64 /* keys per chunk of a decode's online softmax */

#define HD 16
#include "attention_tile.h"
#include "decode_tile.h"
#undef HD
#define HD 32
#include "attention_tile.h"
#include "decode_tile.h"
#undef HD
#define HD 48
#include "attention_tile.h"
#include "decode_tile.h"
#undef HD
#define HD 64
#include "attention_tile.h"
#include "decode_tile.h"
#undef HD
#define HD 80
#include "attention_tile.h"
#include "decode_tile.h"
#undef HD
#define HD 96
#include "attention_tile.h"
#include "decode_tile.h"
#undef HD
#define HD 112
#include "attention_tile.h"
#include "decode_tile.h"
#undef HD
#define HD 128
#include "attention_tile.h"
#include "decode_tile.h"
#undef HD

int kvserve_attention(const struct attention_args *args) {
    switch (args->head_dim) {
    case 16: return attend_16(args);
    case 32: return attend_32(args);
    case 48: return attend_48(args);
    case 64: return attend_64(args);
    case 80: return attend_80(args);
    case 96: return attend_96(args);
    case 112: return attend_112(args);
    case 128: return attend_128(args);
    default: return -1;
    }
}

int kvserve_paged_decode(const struct decode_args *args) {
    if (args->num_heads / args->num_kv_heads > MAX_GROUP) return -1;
    switch (args->head_dim) {
    case 16: return decode_16(args);
    case 32: return decode_32(args);
    case 48: return decode_48(args);
    case 64: return decode_64(args);
    case 80: return decode_80(args);
    case 96: return decode_96(args);
    case 112: return decode_112(args);
    case 128: return decode_128(args);
    default: return -1;
    }
}
