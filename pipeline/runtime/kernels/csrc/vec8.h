// 8-float GCC vectors shared by paged_attention.cpp and rms_norm.cpp.
// NOTE: hsum8 pairs the lanes in another order than gemm_blocks.h's hsum; swapping one for the other would move
// these kernels' results by an ulp.
#pragma once

#include <stdint.h>

namespace llmp::vec8 {

typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f load8(const float* p) { return *reinterpret_cast<const v8f_u*>(p); }
inline void store8(float* p, v8f v) { *reinterpret_cast<v8f_u*>(p) = v; }
inline v8f splat8(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline v8i splat8i(int32_t x) { return v8i{x, x, x, x, x, x, x, x}; }
inline float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

}  // namespace llmp::vec8
