/* Many rows against GGUF blocks (prefill, batched decode) for AVX2 CPUs, in the numerics of
 * quant_matmul.c: each block's dot product of int16 weight codes and int16 activation codes
 * exact in int32, scaled by d * dx and summed in float32, plus min * sum(x) for Q4.
 *
 * How (../quant_gemm.c's panels at 8 lanes, without VNNI): the codes of a group of GROUP output
 * columns are widened once per call into a per-thread panel [K / 2][GROUP][2] of int16 (columns
 * across the lanes, each lane a pair of k), then every row runs against the panel: a broadcast
 * pair of the row's codes, vpmaddwd (16 products) and vpaddd into the block's int32 sums. A
 * tile of MR rows x GROUP columns keeps those sums and its float32 sums in the 16 registers.
 * vpmaddwd issues twice a cycle where an FMA takes 8 products, so the inner loop does up to
 * twice the products of a float32 GEMM a cycle, and no weight is decoded to float32.
 *
 * Contract: quant_rows.h's qgemm. in_features a multiple of 32. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_rows.h"

#define GROUP 16 /* columns a panel holds: two registers of 8 */
#define MR 3     /* rows a tile: 6 int32 and 6 float32 sums, 2 weights, 1 broadcast */
#define CHUNK 192 /* rows whose int16 activations (<= 576 KB at K = 1536) a core keeps cached */
#define WHOLE_PANEL_BYTES ((size_t)64 << 20) /* above it (a 49k-row lm_head), panels per thread */

#define INLINE static inline __attribute__((always_inline))

/* The 8x8 int32 transpose: row i of the result is lane i of v[0..7]. */
INLINE void transpose8(__m256i v[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

/* Group g's codes as int16 pairs [K/2][GROUP][2], its scales and mins [blocks][GROUP]
 * (columns past out_features zero). Eight columns at a time: each column's block is 16 int32
 * pairs in two registers, and two transposes lay pair p of the eight columns side by side. */
static void widen_group(const void *codes, const uint16_t *scale, const uint16_t *min, long g,
                        long out_features, long in_features, int16_t *panel, float *ds,
                        float *ms) {
    const long blocks = in_features / 32;
    int32_t *pairs = (int32_t *)panel;
    for (long c0 = 0; c0 < GROUP; c0 += 8) {
        for (long b = 0; b < blocks; b++) {
            __m256i lo[8], hi[8];
            for (int c = 0; c < 8; c++) {
                const long n = g * GROUP + c0 + c;
                codes16 w = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                float d = 0.0f, m = 0.0f;
                if (n < out_features) {
                    if (min) {
                        w = q4_codes((const uint8_t *)codes + (n * blocks + b) * 16);
                        m = h2f(min[n * blocks + b]);
                    } else {
                        w = q8_codes((const int8_t *)codes + (n * blocks + b) * 32);
                    }
                    d = h2f(scale[n * blocks + b]);
                }
                lo[c] = w.lo;  /* pairs 0..7 (k = 0..15) */
                hi[c] = w.hi;  /* pairs 8..15 */
                ds[b * GROUP + c0 + c] = d;
                ms[b * GROUP + c0 + c] = m;
            }
            transpose8(lo);
            transpose8(hi);
            for (int p = 0; p < 8; p++) {
                _mm256_storeu_si256((__m256i *)(pairs + (b * 16 + p) * GROUP + c0), lo[p]);
                _mm256_storeu_si256((__m256i *)(pairs + (b * 16 + 8 + p) * GROUP + c0), hi[p]);
            }
        }
    }
}

/* Rows t0 .. t0 + mr - 1 against the group's panel, to columns col0 .. col0 + GROUP - 1 (those
 * below out_features). */
INLINE void tile(const act_rows *xr, long t0, const int16_t *panel, const float *ds,
                 const float *ms, long blocks, long in_features, float *out, long out_stride,
                 long col0, long out_features, int has_min, int mr) {
    __m256 acc[MR][2];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m256i blk[MR][2];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) blk[r][0] = blk[r][1] = _mm256_setzero_si256();
        const int16_t *w = panel + b * 16 * GROUP * 2;
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) {
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + p * GROUP * 2));
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + p * GROUP * 2 + 16));
            /* In registers: as memory operands of each row's vpmaddwd they cost three loads
             * each, and loads, not multiplies, then bound the loop. */
            __asm__("" : "+x"(w0), "+x"(w1));
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                int32_t pair;
                memcpy(&pair, xr->q + (t0 + r) * in_features + b * 32 + 2 * p, sizeof pair);
                const __m256i xv = _mm256_set1_epi32(pair);
                blk[r][0] = _mm256_add_epi32(blk[r][0], _mm256_madd_epi16(w0, xv));
                blk[r][1] = _mm256_add_epi32(blk[r][1], _mm256_madd_epi16(w1, xv));
                /* Keep each sum a running register: left free, GCC reassociates the adds
                 * into trees of all 16 products and spills them. */
                __asm__("" : "+x"(blk[r][0]), "+x"(blk[r][1]));
            }
        }
        const __m256 d0 = _mm256_loadu_ps(ds + b * GROUP), d1 = _mm256_loadu_ps(ds + b * GROUP + 8);
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            const long tb = (t0 + r) * blocks + b;
            const __m256 dx = _mm256_set1_ps(xr->d[tb]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(blk[r][0]), _mm256_mul_ps(d0, dx),
                                        acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(blk[r][1]), _mm256_mul_ps(d1, dx),
                                        acc[r][1]);
            if (has_min) {
                const __m256 s = _mm256_set1_ps(xr->sum[tb]);
                acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(ms + b * GROUP), s, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(ms + b * GROUP + 8), s, acc[r][1]);
            }
        }
    }
    const long cols = out_features - col0 < GROUP ? out_features - col0 : GROUP;
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
        float *o = out + (t0 + r) * out_stride + col0;
        if (cols == GROUP) {
            _mm256_storeu_ps(o, acc[r][0]);
            _mm256_storeu_ps(o + 8, acc[r][1]);
        } else {
            float full[GROUP];
            _mm256_storeu_ps(full, acc[r][0]);
            _mm256_storeu_ps(full + 8, acc[r][1]);
            memcpy(o, full, sizeof(float) * (size_t)cols);
        }
    }
}

/* Rows t_begin .. t_end - 1 against group g's panel, MR at a time. */
static void rows_against(const act_rows *xr, long t_begin, long t_end, const int16_t *panel,
                         const float *ds, const float *ms, long blocks, long in_features,
                         float *out, long out_stride, long g, long out_features, int hm) {
    for (long t0 = t_begin; t0 < t_end; t0 += MR) {
        const long rows = t_end - t0 < MR ? t_end - t0 : MR;
        switch (rows) {  /* constant row counts: one register-resident loop each */
#define T(n) tile(xr, t0, panel, ds, ms, blocks, in_features, out, out_stride, g * GROUP, \
                  out_features, hm, n)
        case 3: T(3); break;
        case 2: T(2); break;
        default: T(1); break;
#undef T
        }
    }
}

/* One group's widened panel and its scales and mins, laid out from `base`. */
typedef struct { int16_t *panel; float *ds, *ms; } group_slot;

static inline group_slot slot_at(char *base, size_t panel_size, long blocks) {
    float *ds = (float *)(base + panel_size);
    group_slot s = {(int16_t *)base, ds, ds + blocks * GROUP};
    return s;
}

int qgemm(const act_rows *xr, const void *codes, const uint16_t *scale, const uint16_t *min,
          float *out, long out_stride, long tokens, long out_features, long in_features,
          int num_threads) {
    const long blocks = in_features / 32, groups = (out_features + GROUP - 1) / GROUP;
    const size_t panel_size = (size_t)(in_features * GROUP) * sizeof(int16_t);
    const size_t scales_size = (size_t)(2 * blocks * GROUP) * sizeof(float);
    const size_t per_group = (panel_size + scales_size + 63) / 64 * 64;
    const int threads = groups > 1 ? num_threads : 1;
    const int hm = min != NULL;
    /* Past CHUNK rows every group is widened first, into one panel for the whole weight, and
     * the rows go CHUNK at a time against all of it: a chunk's activations stay in the core's
     * cache while every group passes over them, instead of all rows streaming from memory
     * once a group. */
    const int whole = tokens > CHUNK && per_group * (size_t)groups <= WHOLE_PANEL_BYTES;
    char *scratch = aligned_alloc(64, per_group * (size_t)(whole ? groups : threads));
    if (scratch == NULL) return -1;
#pragma omp parallel num_threads(threads)
    {
        if (whole) {
#pragma omp for schedule(static)
            for (long g = 0; g < groups; g++) {
                const group_slot s = slot_at(scratch + per_group * (size_t)g, panel_size, blocks);
                widen_group(codes, scale, min, g, out_features, in_features, s.panel, s.ds,
                            s.ms);
            }
            for (long c0 = 0; c0 < tokens; c0 += CHUNK) {
                const long c1 = tokens - c0 < CHUNK ? tokens : c0 + CHUNK;
#pragma omp for schedule(static) nowait
                for (long g = 0; g < groups; g++) {
                    const group_slot s = slot_at(scratch + per_group * (size_t)g, panel_size,
                                                 blocks);
                    rows_against(xr, c0, c1, s.panel, s.ds, s.ms, blocks, in_features, out,
                                 out_stride, g, out_features, hm);
                }
            }
        } else {
            const group_slot s = slot_at(scratch + per_group * (size_t)omp_get_thread_num(),
                                         panel_size, blocks);
#pragma omp for schedule(static)
            for (long g = 0; g < groups; g++) {
                widen_group(codes, scale, min, g, out_features, in_features, s.panel, s.ds, s.ms);
                rows_against(xr, 0, tokens, s.panel, s.ds, s.ms, blocks, in_features, out,
                             out_stride, g, out_features, hm);
            }
        }
    }
    free(scratch);
    return 0;
}
