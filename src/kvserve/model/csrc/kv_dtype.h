/* The element types a K/V cache (and load16 / load8) takes, as one int code: the kernels pass
 * it as a constant to always-inlined loops, so each type gets a loop of its own. Codes 0 and 1
 * are also the plain bf16 flags other callers pass. */
#ifndef KVSERVE_KV_DTYPE_H
#define KVSERVE_KV_DTYPE_H

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

#endif
