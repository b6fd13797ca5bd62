// Residual add + RMSNorm in one call instead of an add and the several ops torch's rms_norm dispatches to
// (per-op overhead dominates these small tensors in decode). See rms_norm.h.
#include "rms_norm.h"

#include <math.h>

#include "vec8.h"

namespace llmp {

void add_rms_norm(float* hidden, const float* delta, const float* weight, float* out, int64_t T, int64_t H,
                  float eps) {
  using namespace vec8;
#pragma omp parallel for if (T >= 64)
  for (int64_t t = 0; t < T; ++t) {
    float* h = hidden + t * H;
    if (delta != nullptr) {
      const float* d = delta + t * H;
      for (int64_t i = 0; i < H; ++i) h[i] += d[i];
    }
    v8f acc = splat8(0.0f);
    int64_t i = 0;
    for (; i + 8 <= H; i += 8) {
      const v8f x = load8(h + i);
      acc += x * x;
    }
    float sum = hsum8(acc);
    for (; i < H; ++i) sum += h[i] * h[i];
    const float inv = 1.0f / sqrtf(sum / (float)H + eps);
    float* o = out + t * H;
    for (i = 0; i < H; ++i) o[i] = weight[i] * (h[i] * inv);
  }
}

}  // namespace llmp
