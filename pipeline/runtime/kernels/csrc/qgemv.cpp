// Weight-only quantized GEMV/skinny-GEMM for AVX2 + FMA CPUs: y[M, N] = x[M, K] @ dequant(W[N, K]).T + bias.
//
// Plain C entry points on raw pointers (torch_ops.cpp wraps them as torch ops; build.py compiles them with
// `-O3 -mavx2 -mfma -fopenmp`, plus AVX-512 F/BW/VL/DQ where the CPU has them: the blocks in gemm_blocks.h
// then use larger register tiles). The layouts are the on-disk ones documented in
// pipeline/runtime/quant/primitives.py:
//   int8: w[N, K] int8, scales[N] fp32, W = w * scales[:, None]
//   int4: w[N, K/2] uint8, byte j of a row = q[2j] | q[2j+1] << 4; scales/zeros[N, G] fp32 with
//         G = ceil(K / group_size); W = (q - zeros) * scales, group by group along K.
//
// NOTE: fp32 dots accumulate in fp32 along K like the dequantize + matmul fallback; only the summation order
// differs, so both paths agree to ~1e-6 relative; tests hold them to 1e-4. int4 steps multiply what
// primitives.int4_operands says (int16 activation levels for few rows, bf16-rounded weights and activations for
// many), and so does the fallback. int8 dots take the activations rounded per row to
// int16 (quantize_rows_int16) and sum exactly; the fallback multiplies the same rounded values in fp32.
// Threads: OpenMP over blocks of output rows. libgomp is the one torch already loaded (same soname), so
// these regions reuse torch's thread team instead of adding a second set of spinning threads.
#include "amx_tiles.h"
#include "gemm_blocks.h"

namespace {

using namespace llmp;

// Tiny layers (unit-test models) are faster without waking the second thread.
inline bool worth_threads(const Problem& p, int num_threads) {
  return num_threads > 1 && p.N * p.K * p.M >= (int64_t{1} << 16);
}

template <int NB, typename Fmt>
void run(const Fmt& f, const Problem& p, int num_threads) {
  const int64_t num_blocks = (p.N + NB - 1) / NB;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (worth_threads(p, num_threads))
  for (int64_t b = 0; b < num_blocks; ++b) row_block<NB>(f, p, b);
}

#if defined(__AVX512VNNI__)
// As run(), for W8A8 bytes: each thread keeps its own blocks' weight row sums.
void run_bytes(Int8Bytes f, const Problem& p, int num_threads) {
  const int64_t num_blocks = (p.N + 3) / 4;
#pragma omp parallel num_threads(num_threads) if (worth_threads(p, num_threads)) firstprivate(f)
  {
    int64_t sums[Int8Bytes::kMaxBlockRows];
    f.bias_sums = sums;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < num_blocks; ++b) row_block<4>(f, p, b);
  }
}
#endif

#if defined(LLMP_TILES)
// As run(), on AMX tiles: every thread configures its tiles first.
template <typename Fmt>
void run_tiles(const Fmt& f, const Problem& p, int num_threads) {
  const int64_t num_blocks = p.N / Fmt::kBlockRows;
#pragma omp parallel num_threads(num_threads) if (worth_threads(p, num_threads))
  {
    if constexpr (requires { Fmt::columns(p.M); })
      start_tiles(Fmt::columns(p.M));
    else
      start_tiles(tile_width(p.M));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < num_blocks; ++b) row_block<Fmt::kBlockRows>(f, p, b);
    stop_tiles();
  }
}
#endif

}  // namespace

extern "C" {

// w: fp32, or bf16 with `widened_bf16` (read widened exactly: the result is the fp32 copy's, bit for bit).
void llmp_gemm_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const void* w, bool widened_bf16,
                   const float* bias, float* y, int64_t N, int num_threads) {
  const Problem p{x, M, K, ldx, N, bias, y, N, false};
#if defined(LLMP_TILES)
  if (widened_bf16 && M >= kWidenedTileMinRows && tiles_fit(N, K, kBf16TileK, false) && tiles_on()) {
    float* tile_scratch = static_cast<float*>(malloc(sizeof(float) * TilesWidened::scratch_floats(M, K)));
    if (tile_scratch) {
      run_tiles(TilesWidened::prepare(static_cast<const bf16*>(w), p, tile_scratch), p, num_threads);
      free(tile_scratch);
      return;
    }
  }
#endif
  if (widened_bf16)
    run<4>(DenseF32{static_cast<const bf16*>(w)}, p, num_threads);
  else
    run<4>(DenseF32{static_cast<const float*>(w)}, p, num_threads);
}

// Returns 0; -1 when the activation scratch cannot be allocated.
int llmp_gemm_int8(const float* x, int64_t M, int64_t K, int64_t ldx, const int8_t* w, const float* scales,
                   const int64_t* byte_bias, const float* bias, float* y, int64_t N, bool int8_activations,
                   int num_threads) {
  const Problem p{x, M, K, ldx, N, bias, y, N, false};
#if defined(LLMP_TILES)
  if (M >= kInt8GemmTileMinRows && tiles_fit(N, K, kInt8TileK, false) && tiles_on()) {
    float* tile_scratch = static_cast<float*>(malloc(sizeof(float) * TilesInt8::scratch_floats(M, K)));
    if (!tile_scratch) return -1;
    run_tiles(TilesInt8::prepare(w, scales, p, tile_scratch, int8_activations), p, num_threads);
    free(tile_scratch);
    return 0;
  }
#endif
#if defined(__AVX512VNNI__)
  if (int8_activations && w8a8_on_bytes(M, byte_bias)) {
    float* byte_scratch = static_cast<float*>(malloc(sizeof(float) * int8_bytes_floats(M, K)));
    if (!byte_scratch) return -1;
    run_bytes(prepare_int8_bytes(w, scales, x, M, K, ldx, byte_scratch, byte_bias), p, num_threads);
    free(byte_scratch);
    return 0;
  }
#endif
  void* scratch = malloc(sizeof(int16_t) * M * K + sizeof(float) * M);
  if (!scratch) return -1;
  auto* xs = static_cast<float*>(scratch);
  auto* xq = reinterpret_cast<int16_t*>(xs + M);
  quantize_rows_int16(x, M, K, ldx, xq, xs, act_qmax(int8_activations));
  run<4>(Int8{w, scales, xq, xs}, p, num_threads);
  free(scratch);
  return 0;
}

// Returns 0; -1 when the activation scratch cannot be allocated; -2 for a group size the chunked loop cannot
// fold (it needs 32 or a multiple of 64) or an odd K (int4_shape_ok).
int llmp_gemm_int4(const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* w, const float* scales,
                   const float* zeros, int64_t group_size, const float* bias, float* y, int64_t N,
                   int num_threads) {
  if (!int4_shape_ok(group_size, K)) return -2;
  const int64_t G = int4_groups(K, group_size);
  const Problem p{x, M, K, ldx, N, bias, y, N, false};
  const bool direct = M <= kInt4DirectMaxRows;
#if defined(LLMP_TILES)
  if (!direct && tiles_fit(N, K, kBf16TileK, false) && tiles_on()) {
    const int64_t tile_floats = TilesInt4::tile_floats(K);
    float* tile_scratch =
        static_cast<float*>(malloc(sizeof(float) * (num_threads * tile_floats + TilesBF16::scratch_floats(M, K))));
    if (!tile_scratch) return -1;
    run_tiles(TilesInt4::prepare(w, scales, zeros, group_size, p, tile_scratch, kTileRows * K,
                                 tile_scratch + num_threads * tile_floats),
              p, num_threads);
    free(tile_scratch);
    return 0;
  }
#endif
  const int64_t scratch_floats = direct ? int4_dot_activation_floats(M, K, G)
                                        : int4_tile_activation_floats(M, K) + int64_t{num_threads} * int4_tile_floats(K);
  float* scratch = static_cast<float*>(malloc(sizeof(float) * scratch_floats));
  if (!scratch) return -1;
  if (direct) {
    run<4>(prepare_int4_dot_activations(p, w, scales, zeros, group_size, G, scratch), p, num_threads);
  } else {
    auto* xr = reinterpret_cast<Bf16Activation*>(scratch);
    round_rows_bf16(p.x, p.M, p.K, p.ldx, xr);
    auto* tiles = reinterpret_cast<Int4TileValue*>(scratch + int4_tile_activation_floats(M, K));
    run<4>(Int4Tile{w, scales, zeros, group_size, G, tiles, Int4Tile::kTileRows * K, xr}, p, num_threads);
  }
  free(scratch);
  return 0;
}

// Whole-matrix dequantization to fp32 [N, K] for the many-row path (then torch matmul); bit-identical to
// dequantize_int8 / dequantize_int4 in primitives.py.
void llmp_dequant_int8(const int8_t* w, const float* scales, int64_t N, int64_t K, float* out,
                       int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && N * K >= (1 << 16))
  for (int64_t n = 0; n < N; ++n) {
    const __m256 sv = _mm256_set1_ps(scales[n]);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(out + n * K + k, _mm256_mul_ps(load8(w + n * K + k), sv));
    for (; k < K; ++k) out[n * K + k] = static_cast<float>(w[n * K + k]) * scales[n];
  }
}

int llmp_dequant_int4(const uint8_t* w, const float* scales, const float* zeros, int64_t group_size, int64_t N,
                      int64_t K, float* out, int num_threads) {
  if (!int4_shape_ok(group_size, K)) return -2;
  const int64_t G = int4_groups(K, group_size);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && N * K >= (1 << 16))
  for (int64_t n = 0; n < N; ++n)
    dequant_int4_row(w + n * (K / 2), scales + n * G, zeros + n * G, K, group_size, w + (n + 1) * (K / 2),
                     out + n * K);
  return 0;
}

}  // extern "C"
