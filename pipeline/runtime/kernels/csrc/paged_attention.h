// RoPE + KV-cache write + paged causal attention of one layer (paged_attention.cpp); torch_ops.cpp validates
// the tensors and passes their pointers.
#pragma once

#include <stdint.h>

namespace llmp {

// What a cache element is.
enum CacheKind : int { kCacheF32 = 0, kCacheInt8 = 1, kCacheBF16 = 2 };

// Returns 0, or 2 when a thread's score scratch could not be allocated. Needs D % 8 == 0, D <= 256 and
// H % KV == 0 (checked by the caller). Layouts: paged_attention.cpp. softcap > 0 caps each score s = scale q . k
// to softcap * tanh(s / softcap) (Gemma 2); 0 = none.
int paged_attention(float* qkv, int64_t qkv_stride, void* k_cache, void* v_cache, float* k_scales, float* v_scales,
                    CacheKind kind, float* out, const float* cos_sin, const int64_t* positions, const int64_t* slots,
                    const int32_t* block_tables, int64_t bt_stride, const int32_t* token_seq, int64_t T, int64_t H,
                    int64_t KV, int64_t D, int64_t block_size, int64_t window, int64_t max_context, float scale,
                    float softcap);

}  // namespace llmp
