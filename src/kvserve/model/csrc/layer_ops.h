/* The per-op kernels a decoder layer is made of (pointwise.c, bf16_matmul.c, quant_matmul.c,
 * attention.c), as the fused decode step (decode_step.c) calls them; their sources include
 * this header too, so the compiler checks each definition against it. Contracts are at the
 * definitions. */
#ifndef KVSERVE_LAYER_OPS_H
#define KVSERVE_LAYER_OPS_H

#include <stdint.h>

#include "paged_decode.h"

int kvserve_rms_norm(const void *delta, long delta_stride, void *residual, long res_stride,
                     const void *weight, void *out, long out_stride, long tokens, long dim,
                     float eps, int num_threads, int bf16);
int kvserve_silu_mul(const void *gate_up, long gu_stride, void *out, long out_stride,
                     long tokens, long dim, int num_threads, int bf16);
int kvserve_rotary(void *x, long x_stride_t, long x_stride_h, long tokens, long heads,
                   long head_dim, const float *cos_t, const float *sin_t, int num_threads,
                   int bf16);
int kvserve_bf16_matmul(const uint16_t *x, long x_stride, long m, const uint16_t *packed,
                        long n, long k, const float *bias, void *y, long y_stride, int y_bf16,
                        int num_threads);
int kvserve_i8_matmul(const void *x, long x_stride, int x_bf16, long m, const uint8_t *packed,
                      const float *sw, long n, long k, const float *bias, void *y,
                      long y_stride, int y_bf16, int num_threads);
int kvserve_q4_matmul(const float *x, long x_stride, const uint8_t *codes,
                      const uint16_t *scale, const uint16_t *min, float *out, long out_stride,
                      long tokens, long out_features, long in_features, int num_threads);
int kvserve_q8_matmul(const float *x, long x_stride, const int8_t *codes,
                      const uint16_t *scale, float *out, long out_stride, long tokens,
                      long out_features, long in_features, int num_threads);

#endif
