// Torch custom ops (namespace llmpipe_quant) over the AVX2 kernels in qgemv.cpp, greedy_head.cpp,
// paged_attention.cpp and rms_norm.cpp; this file defines the library, decoder_plan.cpp adds its DecoderPlan class.
//
// Why ops and not ctypes: a dispatcher call that allocates its output in C++ costs ~4 us, a ctypes call plus a
// Python-side torch.empty ~13 us, and a decode step makes ~120 of these calls on small matrices.
// Arguments are validated here (torch_checks.h), so a wrong dtype, device or shape raises instead of reading out
// of bounds.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>

#include "amx_tiles.h"
#include "gemm_blocks.h"
#include "greedy_head.h"
#include "paged_attention.h"
#include "paged_attention_op.h"
#include "rms_norm.h"
#include "torch_checks.h"

extern "C" {
void llmp_gemm_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const void* w, bool widened_bf16,
                   const float* bias, float* y, int64_t N, int num_threads);
int llmp_gemm_int8(const float* x, int64_t M, int64_t K, int64_t ldx, const int8_t* w, const float* scales,
                   const int64_t* byte_bias, const float* bias, float* y, int64_t N, bool int8_activations,
                   int num_threads);
int llmp_gemm_int4(const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* w, const float* scales,
                   const float* zeros, int64_t group_size, const float* bias, float* y, int64_t N,
                   int num_threads);
void llmp_dequant_int8(const int8_t* w, const float* scales, int64_t N, int64_t K, float* out,
                       int num_threads);
int llmp_dequant_int4(const uint8_t* w, const float* scales, const float* zeros, int64_t group_size, int64_t N,
                      int64_t K, float* out, int num_threads);
}

namespace {

using namespace llmp::torch_checks;

// x: [M, K] fp32 on CPU; rows may be strided (e.g. a slice of a fused projection), columns must be dense.
at::Tensor activations(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K,
              "x: expected a CPU float32 tensor of shape [M, ", K, "], got ", x.scalar_type(), " ", x.sizes(),
              " on ", x.device());
  return x.stride(1) == 1 ? x : x.contiguous();
}

void check_int4_status(int rc, int64_t K, int64_t group_size) {
  TORCH_CHECK(rc != -1, "int4 kernel: out of memory for its scratch");
  TORCH_CHECK(rc == 0, "int4 kernel: group_size must be 32 or a multiple of 64 (got ", group_size,
              ") and in_features even (got ", K, ")");
}

// Checks an fp32 weight, or a bf16 one taken as the fp32 values it widens to (fp32 arithmetic, not bf16's);
// true for bf16.
bool is_widened_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight: expected [N, K]");
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  expect(weight, bf16 ? at::kBFloat16 : at::kFloat, {weight.size(0), weight.size(1)}, "weight");
  return bf16;
}

at::Tensor gemm_f32(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const bool widened_bf16 = is_widened_bf16(weight);
  const int64_t N = weight.size(0), K = weight.size(1);
  const at::Tensor x = activations(x_in, K);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  llmp_gemm_f32(x.const_data_ptr<float>(), x.size(0), K, x.stride(0), weight.const_data_ptr(), widened_bf16,
                bias_ptr(bias, N), y.mutable_data_ptr<float>(), N, at::get_num_threads());
  return y;
}

at::Tensor gemm_int8(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias, bool int8_activations,
                     const std::optional<at::Tensor>& byte_bias) {
  TORCH_CHECK(qweight.dim() == 2, "qweight: expected [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  expect(qweight, at::kChar, {N, K}, "qweight");
  expect(scales, at::kFloat, {N}, "scales");
  if (byte_bias) expect(*byte_bias, at::kLong, {N}, "byte_bias");
  const at::Tensor x = activations(x_in, K);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  const int rc = llmp_gemm_int8(x.const_data_ptr<float>(), x.size(0), K, x.stride(0),
                                qweight.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                                byte_bias ? byte_bias->const_data_ptr<int64_t>() : nullptr, bias_ptr(bias, N),
                                y.mutable_data_ptr<float>(), N, int8_activations, at::get_num_threads());
  TORCH_CHECK(rc == 0, "int8 kernel: out of memory for its activation scratch");
  return y;
}

// 128 x each row's sum of qweight [N, K] int8: what gemm_int8 takes as byte_bias, computed once per weight.
at::Tensor int8_byte_bias(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.dim() == 2, "qweight: expected [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  expect(qweight, at::kChar, {N, K}, "qweight");
  at::Tensor out = at::empty({N}, qweight.options().dtype(at::kLong));
  llmp::int8_byte_bias(qweight.const_data_ptr<int8_t>(), N, K, out.mutable_data_ptr<int64_t>());
  return out;
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

at::Tensor greedy_argmax(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                         const at::Tensor& weight, const at::Tensor& error_per_l1,
                         const at::Tensor& error_per_level) {
  const bool widened_bf16 = is_widened_bf16(weight);
  const int64_t V = weight.size(0), K = weight.size(1);
  expect(qweight, at::kChar, {V, K}, "qweight");
  expect(scales, at::kFloat, {V}, "scales");
  expect(error_per_l1, at::kFloat, {V}, "error_per_l1");
  expect(error_per_level, at::kFloat, {V}, "error_per_level");
  TORCH_CHECK(V > 0, "weight: empty vocabulary");
  const at::Tensor x = activations(x_in, K).contiguous();
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const int rc = llmp::greedy_argmax_int8(
      x.const_data_ptr<float>(), x.size(0), K, qweight.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
      weight.const_data_ptr(), widened_bf16, V, error_per_l1.const_data_ptr<float>(),
      error_per_level.const_data_ptr<float>(), at::get_num_threads(), out.mutable_data_ptr<int64_t>());
  TORCH_CHECK(rc == 0, "greedy_argmax: out of memory for the screen's activation scratch");
  return out;
}

// hidden [T, H] += delta (when given), then a new RMSNorm(hidden) * weight (rms_norm.h).
at::Tensor add_rms_norm(const at::Tensor& hidden, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(hidden.dim() == 2, "hidden: expected [T, H], got ", hidden.sizes());
  const int64_t T = hidden.size(0), H = hidden.size(1);
  expect(hidden, at::kFloat, {T, H}, "hidden");
  if (delta) expect(*delta, at::kFloat, {T, H}, "delta");
  expect(weight, at::kFloat, {H}, "weight");
  at::Tensor out = at::empty({T, H}, hidden.options());
  llmp::add_rms_norm(hidden.data_ptr<float>(), delta ? delta->const_data_ptr<float>() : nullptr,
                     weight.const_data_ptr<float>(), out.mutable_data_ptr<float>(), T, H, static_cast<float>(eps));
  return out;
}

// One-row steps in 512-bit vectors (on) or 256-bit ones (off); returns the previous setting. Builds without
// AVX-512 have only the latter: there it stays off.
bool set_wide_single_row(bool on) {
#if defined(__AVX512F__)
  return llmp::wide_single_row.exchange(on);
#else
  (void)on;
  return false;
#endif
}

// Every weight stream of the register tiles prefetched far ahead into L2 (on), or only fp32 steps of several rows
// (off); returns the previous setting.
bool set_far_prefetch(bool on) { return llmp::far_prefetch.exchange(on); }

// bf16, int8 and int4 linears of whole-tile shapes on AMX tiles (on) or on the register tiles (off); returns the
// previous setting. Builds without AMX, or a kernel that refuses the tile state, have only the latter: there it
// stays off.
bool set_tiles(bool on) {
#if defined(LLMP_TILES)
  if (!llmp::tiles_permitted()) return false;
  return llmp::tiles_enabled.exchange(on);
#else
  (void)on;
  return false;
#endif
}

// Whether this build has AMX tiles and Linux granted this process their state.
bool tiles_available() {
#if defined(LLMP_TILES)
  return llmp::tiles_permitted();
#else
  return false;
#endif
}

}  // namespace

namespace llmp {

using torch_checks::expect;

// One layer's RoPE, K/V cache write and paged attention (layouts: paged_attention.cpp). The cache's dtype picks
// its format; an int8 cache comes with its scales. The position, slot and block-table values are the caller's
// to keep in range (checked once per step, not per layer).
at::Tensor paged_attention_op(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales,
                           const at::Tensor& cos_sin, const at::Tensor& positions, const at::Tensor& slots,
                           const at::Tensor& block_tables, const at::Tensor& token_seq, int64_t H,
                           int64_t block_size, int64_t window, int64_t max_context, double scale, double softcap) {
  TORCH_CHECK(k_cache.dim() == 3, "k_cache: expected [slots, KV, D], got ", k_cache.sizes());
  const int64_t rows = k_cache.size(0), KV = k_cache.size(1), D = k_cache.size(2);
  const at::ScalarType cache_dtype = k_cache.scalar_type();
  llmp::CacheKind kind = llmp::kCacheF32;
  if (cache_dtype == at::kChar) {
    kind = llmp::kCacheInt8;
  } else if (cache_dtype == at::kBFloat16) {
    kind = llmp::kCacheBF16;
  } else {
    TORCH_CHECK(cache_dtype == at::kFloat, "k_cache: expected float32, bfloat16 or int8, got ", cache_dtype);
  }
  expect(k_cache, cache_dtype, {rows, KV, D}, "k_cache");
  expect(v_cache, cache_dtype, {rows, KV, D}, "v_cache");
  TORCH_CHECK(D % 8 == 0 && D <= 256, "paged_attention: head_dim must be a multiple of 8 up to 256, got ", D);
  TORCH_CHECK(KV > 0 && H > 0 && H % KV == 0, "paged_attention: ", H, " query heads do not share ", KV,
              " kv heads evenly");
  TORCH_CHECK(block_size > 0 && rows % block_size == 0, "paged_attention: ", rows,
              " cache rows are not whole blocks of ", block_size);
  TORCH_CHECK(softcap >= 0, "paged_attention: softcap must be >= 0 (0 = none), got ", softcap);
  float* scale_ptrs[2] = {nullptr, nullptr};
  if (kind == llmp::kCacheInt8) {
    TORCH_CHECK(k_scales && v_scales, "paged_attention: an int8 cache needs k_scales and v_scales");
    expect(*k_scales, at::kFloat, {rows, KV}, "k_scales");
    expect(*v_scales, at::kFloat, {rows, KV}, "v_scales");
    scale_ptrs[0] = k_scales->data_ptr<float>();
    scale_ptrs[1] = v_scales->data_ptr<float>();
  } else {
    TORCH_CHECK(!k_scales && !v_scales, "paged_attention: k_scales and v_scales are for an int8 cache only");
  }
  const int64_t width = (H + 2 * KV) * D;
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.size(1) == width &&
                  qkv.stride(1) == 1 && qkv.stride(0) >= width,
              "qkv: expected a CPU float32 tensor of shape [T, ", width, "] with dense rows, got ", qkv.scalar_type(),
              " ", qkv.sizes(), " strides ", qkv.strides(), " on ", qkv.device());
  const int64_t T = qkv.size(0);
  expect(positions, at::kLong, {T}, "positions");
  expect(slots, at::kLong, {T}, "slots");
  expect(token_seq, at::kInt, {T}, "token_seq");
  TORCH_CHECK(block_tables.dim() == 2, "block_tables: expected [S, max_blocks], got ", block_tables.sizes());
  expect(block_tables, at::kInt, {block_tables.size(0), block_tables.size(1)}, "block_tables");
  TORCH_CHECK(cos_sin.dim() == 2, "cos_sin: expected [max_positions, D], got ", cos_sin.sizes());
  expect(cos_sin, at::kFloat, {cos_sin.size(0), D}, "cos_sin");
  TORCH_CHECK(T == 0 || (max_context > 0 && max_context <= cos_sin.size(0) &&
                         max_context <= block_tables.size(1) * block_size),
              "paged_attention: max_context ", max_context, " is beyond the RoPE table (", cos_sin.size(0),
              " positions) or the block tables (", block_tables.size(1), " blocks of ", block_size, ")");
  at::Tensor out = at::empty({T, H * D}, qkv.options());
  const int rc = llmp::paged_attention(
      qkv.data_ptr<float>(), qkv.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), scale_ptrs[0], scale_ptrs[1], kind,
      out.mutable_data_ptr<float>(), cos_sin.const_data_ptr<float>(), positions.const_data_ptr<int64_t>(),
      slots.const_data_ptr<int64_t>(), block_tables.const_data_ptr<int32_t>(), block_tables.size(1),
      token_seq.const_data_ptr<int32_t>(), T, H, KV, D, block_size, window, max_context, static_cast<float>(scale),
      static_cast<float>(softcap));
  TORCH_CHECK(rc == 0, "paged_attention: out of memory for its score scratch");
  return out;
}

}  // namespace llmp

TORCH_LIBRARY(llmpipe_quant, m) {
  m.def("gemm_f32(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "gemm_int8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, bool int8_activations=False, "
      "Tensor? byte_bias=None) -> Tensor");
  m.def("int8_byte_bias(Tensor qweight) -> Tensor");
  m.def("gemm_int4(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group_size, Tensor? bias) -> Tensor");
  m.def("dequant_int8(Tensor qweight, Tensor scales) -> Tensor");
  m.def("dequant_int4(Tensor packed, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("greedy_argmax(Tensor x, Tensor qweight, Tensor scales, Tensor weight, Tensor error_per_l1, "
        "Tensor error_per_level) -> Tensor");
  m.def(
      "paged_attention(Tensor(a!) qkv, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor(d!)? k_scales, "
      "Tensor(e!)? v_scales, Tensor cos_sin, Tensor positions, Tensor slots, Tensor block_tables, Tensor token_seq, "
      "int num_heads, int block_size, int window, int max_context, float scale, float softcap=0.) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("set_wide_single_row(bool on) -> bool", set_wide_single_row);
  m.def("set_far_prefetch(bool on) -> bool", set_far_prefetch);
  m.def("set_tiles(bool on) -> bool", set_tiles);
  m.def("tiles_available() -> bool", tiles_available);
}

TORCH_LIBRARY_IMPL(llmpipe_quant, CPU, m) {
  m.impl("gemm_f32", gemm_f32);
  m.impl("gemm_int8", gemm_int8);
  m.impl("int8_byte_bias", int8_byte_bias);
  m.impl("gemm_int4", gemm_int4);
  m.impl("dequant_int8", dequant_int8);
  m.impl("dequant_int4", dequant_int4);
  m.impl("greedy_argmax", greedy_argmax);
  m.impl("paged_attention", llmp::paged_attention_op);
  m.impl("add_rms_norm", add_rms_norm);
}
