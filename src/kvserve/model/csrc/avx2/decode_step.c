/* The fused decode step in the AVX2 set: ../decode_step.c (its contract there) for float32
 * activations over GGUF blocks (PROJ_Q4, PROJ_Q8), calling this set's kernels, which keep the
 * AVX-512 ones' names and contracts. This set has no bf16 or int8 matmul, so those kinds, and
 * bf16 steps, return -1. */
#define DECODE_STEP_BLOCKS_ONLY 1
#include "../decode_step.c"
