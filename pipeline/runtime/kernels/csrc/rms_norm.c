// Residual add + RMSNorm for the CPU runtime, one call instead of an add and the several ops torch's
// rms_norm dispatches to (per-op overhead dominates these small tensors in decode).
//   hidden [T, H] += delta [T, H] (skipped when delta is NULL), then
//   out [T, H] = (hidden * 1 / sqrt(mean(hidden^2) + eps)) * weight, in HF's order of operations.
// Contiguous fp32 rows. Built and loaded by pipeline/runtime/kernels/cpu_ops.py.
#include <math.h>
#include <stdint.h>

typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));

static inline v8f load8(const float* p) { return *(const v8f_u*)p; }
static inline float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

void llmpipe_add_rms_norm(float* hidden, const float* delta, const float* weight, float* out, int64_t T,
                          int64_t H, float eps) {
#pragma omp parallel for if (T >= 64)
  for (int64_t t = 0; t < T; ++t) {
    float* h = hidden + t * H;
    if (delta != 0) {
      const float* d = delta + t * H;
      for (int64_t i = 0; i < H; ++i) h[i] += d[i];
    }
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
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
