// Torch custom ops (namespace llmpipe_quant) over the AVX2 kernels in qgemv.cpp.
//
// Why ops and not ctypes: a dispatcher call that allocates its output in C++ costs ~4 us, a ctypes call plus a
// Python-side torch.empty ~13 us, and a decode step makes ~120 of these calls on small matrices.
// Arguments are validated here, so a wrong dtype, device or shape raises instead of reading out of bounds.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>

extern "C" {
void llmp_gemm_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const float* w, const float* bias,
                   float* y, int64_t N, int num_threads);
void llmp_gemm_int8(const float* x, int64_t M, int64_t K, int64_t ldx, const int8_t* w, const float* scales,
                    const float* bias, float* y, int64_t N, int num_threads);
int llmp_gemm_int4(const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* w, const float* scales,
                   const float* zeros, int64_t group_size, const float* bias, float* y, int64_t N,
                   int num_threads);
void llmp_dequant_int8(const int8_t* w, const float* scales, int64_t N, int64_t K, float* out,
                       int num_threads);
int llmp_dequant_int4(const uint8_t* w, const float* scales, const float* zeros, int64_t group_size, int64_t N,
                      int64_t K, float* out, int num_threads);
}

namespace {

void expect(const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.sizes() == shape && t.is_contiguous(), name,
              ": expected a contiguous CPU ", dtype, " tensor of shape ", shape, ", got ", t.scalar_type(), " ",
              t.sizes(), " on ", t.device(), t.is_contiguous() ? "" : " (non-contiguous)");
}

// x: [M, K] fp32 on CPU; rows may be strided (e.g. a slice of a fused projection), columns must be dense.
at::Tensor activations(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K,
              "x: expected a CPU float32 tensor of shape [M, ", K, "], got ", x.scalar_type(), " ", x.sizes(),
              " on ", x.device());
  return x.stride(1) == 1 ? x : x.contiguous();
}

const float* bias_ptr(const std::optional<at::Tensor>& bias, int64_t N) {
  if (!bias) return nullptr;
  expect(*bias, at::kFloat, {N}, "bias");
  return bias->const_data_ptr<float>();
}

int64_t num_groups(int64_t K, int64_t group_size) {
  TORCH_CHECK(group_size > 0 && K % 2 == 0, "int4: need an even in_features and group_size > 0");
  return (K + group_size - 1) / group_size;
}

void check_int4_status(int rc, int64_t K, int64_t group_size) {
  TORCH_CHECK(rc != -1, "int4 kernel: out of memory for its scratch");
  TORCH_CHECK(rc == 0, "int4 kernel: group_size must be 32 or a multiple of 64 (got ", group_size,
              ") and in_features even (got ", K, ")");
}

at::Tensor gemm_f32(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2, "weight: expected [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  expect(weight, at::kFloat, {N, K}, "weight");
  const at::Tensor x = activations(x_in, K);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  llmp_gemm_f32(x.const_data_ptr<float>(), x.size(0), K, x.stride(0), weight.const_data_ptr<float>(),
                bias_ptr(bias, N), y.mutable_data_ptr<float>(), N, at::get_num_threads());
  return y;
}

at::Tensor gemm_int8(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(qweight.dim() == 2, "qweight: expected [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  expect(qweight, at::kChar, {N, K}, "qweight");
  expect(scales, at::kFloat, {N}, "scales");
  const at::Tensor x = activations(x_in, K);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  llmp_gemm_int8(x.const_data_ptr<float>(), x.size(0), K, x.stride(0), qweight.const_data_ptr<int8_t>(),
                 scales.const_data_ptr<float>(), bias_ptr(bias, N), y.mutable_data_ptr<float>(), N,
                 at::get_num_threads());
  return y;
}

at::Tensor gemm_int4(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& zeros, int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 2, "packed: expected [N, K / 2]");
  const int64_t N = packed.size(0), K = packed.size(1) * 2, G = num_groups(K, group_size);
  expect(packed, at::kByte, {N, K / 2}, "packed");
  expect(scales, at::kFloat, {N, G}, "scales");
  expect(zeros, at::kFloat, {N, G}, "zeros");
  const at::Tensor x = activations(x_in, K);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  const int rc = llmp_gemm_int4(x.const_data_ptr<float>(), x.size(0), K, x.stride(0),
                                packed.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
                                zeros.const_data_ptr<float>(), group_size, bias_ptr(bias, N),
                                y.mutable_data_ptr<float>(), N, at::get_num_threads());
  check_int4_status(rc, K, group_size);
  return y;
}

at::Tensor dequant_int8(const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.dim() == 2, "qweight: expected [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  expect(qweight, at::kChar, {N, K}, "qweight");
  expect(scales, at::kFloat, {N}, "scales");
  at::Tensor out = at::empty({N, K}, scales.options());
  llmp_dequant_int8(qweight.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), N, K,
                    out.mutable_data_ptr<float>(), at::get_num_threads());
  return out;
}

at::Tensor dequant_int4(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                        int64_t group_size) {
  TORCH_CHECK(packed.dim() == 2, "packed: expected [N, K / 2]");
  const int64_t N = packed.size(0), K = packed.size(1) * 2, G = num_groups(K, group_size);
  expect(packed, at::kByte, {N, K / 2}, "packed");
  expect(scales, at::kFloat, {N, G}, "scales");
  expect(zeros, at::kFloat, {N, G}, "zeros");
  at::Tensor out = at::empty({N, K}, scales.options());
  const int rc = llmp_dequant_int4(packed.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
                                   zeros.const_data_ptr<float>(), group_size, N, K, out.mutable_data_ptr<float>(),
                                   at::get_num_threads());
  check_int4_status(rc, K, group_size);
  return out;
}

}  // namespace

TORCH_LIBRARY(llmpipe_quant, m) {
  m.def("gemm_f32(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gemm_int8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
  m.def("gemm_int4(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group_size, Tensor? bias) -> Tensor");
  m.def("dequant_int8(Tensor qweight, Tensor scales) -> Tensor");
  m.def("dequant_int4(Tensor packed, Tensor scales, Tensor zeros, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmpipe_quant, CPU, m) {
  m.impl("gemm_f32", gemm_f32);
  m.impl("gemm_int8", gemm_int8);
  m.impl("gemm_int4", gemm_int4);
  m.impl("dequant_int8", dequant_int8);
  m.impl("dequant_int4", dequant_int4);
}
