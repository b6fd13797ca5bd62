// A decoder layer's dense part (attention output projection, residual adds, RMSNorms, gated MLP and the next
// layer's q/k/v projection) for few token rows, in one OpenMP parallel region (see decoder.h).
//
// Why: in decode each of these ops is a few tens of microseconds of work, and running them as ~10 separate
// torch ops per layer made per-op overhead (Python, dispatch, allocation, waking the second thread for every
// GEMV) cost as much as the GEMVs. Here the team is woken once per call and synchronizes at the barriers the
// data dependencies need (after each GEMV). Every GEMV splits its output rows across the team in chunks that
// idle threads take over (Team), so a thread the OS delays on a busy machine does less of the work instead of
// holding the rest.
//
// Numerics: each output is the same dot product as the per-layer kernels (qgemv.cpp) compute, RMSNorm and
// SiLU follow HF's order of operations (x * rsqrt(mean(x^2) + eps) * weight; x / (1 + exp(-x))). The tanh gelu
// 0.5 x (1 + tanh(y)) is computed as x / (1 + exp(-2 y)), the same function without tanh's cancellation near
// -1 (torch's own float result carries that cancellation, so the two agree to ~1e-7 of x).
#include "decoder.h"

#include <string.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "amx_tiles.h"
#include "gemm_blocks.h"

namespace llmp {
namespace {

constexpr int kRows = 4;             // weight rows per block (NB of rows<>)
constexpr int64_t kUnit = 8;         // MLP columns per work unit: two blocks of gate rows and two of up rows
constexpr int kChunksPerThread = 8;  // chunks per thread and GEMV: small enough to rebalance

// Scratch each thread reuses across calls (OpenMP keeps its threads): normed activations + int4 buffers.
thread_local std::vector<float> tls_scratch;

inline float* thread_scratch(size_t floats) {
  if (tls_scratch.size() < floats) tls_scratch.resize(floats);
  return tls_scratch.data();
}

int64_t chunk_for(int64_t units, int num_threads) {
  const int64_t c = units / (int64_t{kChunksPerThread} * num_threads);
  return c > 0 ? c : 1;
}

// e^x, |x| <= 88 after clamping: x = n ln2 + r (Cody-Waite), a degree-6 polynomial for e^r (Cephes expf
// coefficients, ~1 ulp), 2^n through the exponent bits.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Both activations are x / (1 + e^-z): silu has z = x, the tanh gelu z = 2 sqrt(2 / pi) (x + 0.044715 x^3),
// in torch's order of operations.
constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

template <Activation A>
inline __m256 minus_z8(__m256 x) {
  if constexpr (A == Activation::kSilu) return _mm256_sub_ps(_mm256_setzero_ps(), x);
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 inner = _mm256_fmadd_ps(_mm256_set1_ps(kGeluKappa), cube, x);
  return _mm256_mul_ps(inner, _mm256_set1_ps(-2.0f * kGeluBeta));
}

template <Activation A>
inline float minus_z(float x) {
  if constexpr (A == Activation::kSilu) return -x;
  return -2.0f * kGeluBeta * (x + kGeluKappa * (x * x * x));
}

// act[m, j] = act(gate[m, j]) * up[m, j] for columns j0 .. j1 - 1; gate_up rows hold I gate then I up values.
template <Activation A>
void act_mul(const float* gate_up, int64_t M, int64_t I, int64_t j0, int64_t j1, float* act) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gate_up + m * 2 * I;
    const float* u = g + I;
    float* a = act + m * I;
    int64_t j = j0;
    for (; j + 8 <= j1; j += 8) {
      const __m256 x = _mm256_loadu_ps(g + j);
      const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(minus_z8<A>(x))));
      _mm256_storeu_ps(a + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
    }
    for (; j < j1; ++j) a[j] = g[j] / (1.0f + expf(minus_z<A>(g[j]))) * u[j];
  }
}

// 1 / sqrt(mean(h^2) + eps) of one row, like HF's RMSNorms in fp32.
inline float inv_rms(const float* h, int64_t H, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(h + i), _mm256_loadu_ps(h + i), acc);
  float sum = hsum(acc);
  for (; i < H; ++i) sum += h[i] * h[i];
  return 1.0f / sqrtf(sum / static_cast<float>(H) + eps);
}

// out[m] = hidden[m] * inv_rms(hidden[m]) * weight.
void rms_norm_rows(const float* hidden, int64_t M, int64_t H, const float* weight, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* h = hidden + m * H;
    const float inv = inv_rms(h, H, eps);
    float* o = out + m * H;
    for (int64_t i = 0; i < H; ++i) o[i] = weight[i] * (h[i] * inv);
  }
}

// hidden[m] += delta[m] * inv_rms(delta[m]) * weight, rows shared out across the team (hidden is shared).
void team_add_rms_norm(const float* delta, int64_t M, int64_t H, const float* weight, float eps, float* hidden) {
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const float* d = delta + m * H;
    const float inv = inv_rms(d, H, eps);
    float* h = hidden + m * H;
    for (int64_t i = 0; i < H; ++i) h[i] += weight[i] * (d[i] * inv);
  }
}

// How the team shares out the units of each GEMV: every thread starts on its own contiguous share and takes
// chunks from its front; a thread done with its share takes chunks from the front of the others'. So a thread
// the OS delays holds back at most the chunk it is on (as with dynamic scheduling), while each thread's weight
// reads stay one sequential stream that its prefetches (the block after the current one) run ahead of. With
// `omp for schedule(dynamic)` the chunks went round-robin and a thread's next chunk was never where its stream
// left off: one-row decoder layers took 1.21x (bf16), 1.39x (int8) and 1.15x (fp32) the time they take now on a Zen 4
// (`scripts/bench_kernels.py ab`, 2 threads); 16-row steps, bound by arithmetic, ran alike.
// One Shares per parallel region (shared by the team); each thread makes its own Team over it.
class Shares {
 public:
  explicit Shares(int threads) : taken_(2 * static_cast<size_t>(threads)) {}

 private:
  friend class Team;
  struct alignas(64) Taken {
    std::atomic<int64_t> units{0};  // taken from the front of a thread's share
  };
  // Two sets, alternating between consecutive loops: a loop resets (for the loop after it) the set that the
  // loop before it used, which every thread has left behind at that loop's closing barrier.
  std::vector<Taken> taken_;
};

class Team {
 public:
  explicit Team(Shares& shares) : shares_(shares) {}

  // body(u) for every u in [0, units), shared out as above; every thread of the team makes the same calls in
  // the same order. The closing barrier makes every unit's output visible to the whole team.
  template <typename Body>
  void for_units(int64_t units, Body&& body) {
    const int threads = omp_get_num_threads(), me = omp_get_thread_num();
    Shares::Taken* current = shares_.taken_.data() + (loop_ % 2) * threads;
    Shares::Taken* next = shares_.taken_.data() + ((loop_ + 1) % 2) * threads;
    ++loop_;
    next[me].units.store(0, std::memory_order_relaxed);
    const int64_t chunk = chunk_for(units, threads);
    for (int k = 0; k < threads; ++k) {
      const int owner = (me + k) % threads;
      const int64_t lo = units * owner / threads, hi = units * (owner + 1) / threads;
      for (;;) {
        const int64_t start = lo + current[owner].units.fetch_add(chunk, std::memory_order_relaxed);
        if (start >= hi) break;
        const int64_t end = std::min(start + chunk, hi);
        for (int64_t u = start; u < end; ++u) body(u);
      }
    }
#pragma omp barrier
  }

 private:
  Shares& shares_;
  int64_t loop_ = 0;
};

// Called by every thread of the team (or alone, outside a parallel region): the blocks of kRows output rows,
// shared out by `team`.
template <typename Fmt>
void team_rows(Team& team, const Fmt& f, const Problem& p) {
  constexpr int NB = rows_per_block<Fmt, kRows>();
  const int64_t num_blocks = (p.N + NB - 1) / NB;
  team.for_units(num_blocks, [&](int64_t b) { row_block<NB>(f, p, b); });
}

// gate_up then act(gate) * up, one work unit = kUnit MLP columns (their gate and up rows), so the thread that
// computed a column's gate and up values applies the activation without waiting for the others.
template <Activation A, typename Fmt>
void team_gate_up(Team& team, const Fmt& f, const Problem& p, float* act) {
  constexpr int NB = rows_per_block<Fmt, kRows>();
  constexpr int64_t unit = NB > kUnit ? NB : kUnit;
  const int64_t I = p.N / 2, num_units = (I + unit - 1) / unit;
  team.for_units(num_units, [&](int64_t u) {
    const int64_t j0 = u * unit, j1 = j0 + unit < I ? j0 + unit : I;
    int64_t j = j0;
    for (; j + NB <= j1; j += NB) {
      rows<NB>(f, p, j);
      rows<NB>(f, p, I + j);
    }
    if constexpr (!WholeBlocks<Fmt>) {
      for (; j < j1; ++j) {
        rows<1>(f, p, j);
        rows<1>(f, p, I + j);
      }
    }
    act_mul<A>(p.y, p.M, I, j0, j1, act);
  });
}

int64_t num_groups(const LinearRef& l) { return int4_groups(l.K, l.group_size); }

#if defined(LLMP_TILES)
// Whether a linear runs on AMX tiles: bf16, int8 and int4 weights of whole-tile shapes, steps of enough rows, where
// the tiles are on.
bool on_tiles(const LinearRef& l, int64_t M, bool pair) {
  if (l.kind == WeightKind::kBF16)
    return M >= kBf16TileMinRows && tiles_fit(l.N, l.K, kBf16TileK, pair) && tiles_on();
  if (l.kind == WeightKind::kInt8)
    return M >= (l.int8_activations ? kW8A8TileMinRows : kInt8TileMinRows) && tiles_fit(l.N, l.K, kInt8TileK, pair) &&
           tiles_on();
  if (l.kind == WeightKind::kInt4)
    return M > kInt4DirectMaxRows && tiles_fit(l.N, l.K, kBf16TileK, pair) && tiles_on();
  return false;
}
#endif

// Floats of per-thread scratch the register tiles' path of a linear needs beyond the normed activations.
int64_t register_tile_scratch(const LinearRef& l, int64_t M) {
  switch (l.kind) {
    case WeightKind::kInt4:
      return M <= kInt4DirectMaxRows ? int4_dot_activation_floats(M, l.K, num_groups(l))
                                     : int4_tile_floats(l.K) + int4_tile_activation_floats(M, l.K);
    case WeightKind::kBF16:
      return M * l.K;  // the rounded activations (bf16 or fp32)
    case WeightKind::kInt8:
#if defined(__AVX512VNNI__)
      if (l.int8_activations && w8a8_on_bytes(M, l.byte_bias)) return int8_bytes_floats(M, l.K);
#endif
      return M + (M * l.K + 1) / 2;  // the row scales, then the int16 activations
    default:
      return 0;
  }
}

// Floats of per-thread scratch a linear needs beyond the normed activations (enough for either path where
// tiles may run: set_tiles can switch between the sizing and the call).
int64_t linear_scratch(const LinearRef& l, int64_t M) {
#if defined(LLMP_TILES)
  int64_t tiles = 0;
  if (l.kind == WeightKind::kBF16) tiles = TilesBF16::scratch_floats(M, l.K);
  if (l.kind == WeightKind::kInt8) tiles = TilesInt8::scratch_floats(M, l.K);
  if (l.kind == WeightKind::kInt4) tiles = TilesInt4::tile_floats(l.K) + TilesBF16::scratch_floats(M, l.K);
#else
  const int64_t tiles = 0;
#endif
  return std::max(tiles, register_tile_scratch(l, M));
}

// y = x @ W.T + bias (or y += ..., `accumulate`) with the team; `pair_act` selects the gate_up form with
// activation `a`.
void team_linear(Team& team, const LinearRef& l, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy,
                 bool accumulate, float* scratch, float* pair_act, Activation a = Activation::kSilu) {
  const Problem p{x, M, l.K, ldx, l.N, l.bias, y, ldy, accumulate};
  auto go = [&](const auto& fmt) {
    if (pair_act != nullptr && a == Activation::kGeluTanh) {
      team_gate_up<Activation::kGeluTanh>(team, fmt, p, pair_act);
    } else if (pair_act != nullptr) {
      team_gate_up<Activation::kSilu>(team, fmt, p, pair_act);
    } else {
      team_rows(team, fmt, p);
    }
  };
#if defined(LLMP_TILES)
  if (on_tiles(l, M, pair_act != nullptr)) {
    // Like the register tiles: each thread packs its own copy of the activation rows.
    const auto on = [&](const auto& fmt) {
      start_tiles(tile_width(M));
      go(fmt);
      stop_tiles();
    };
    if (l.kind == WeightKind::kBF16)
      on(TilesBF16::prepare(static_cast<const bf16*>(l.w), p, scratch));
    else if (l.kind == WeightKind::kInt8)
      on(TilesInt8::prepare(static_cast<const int8_t*>(l.w), l.scales, p, scratch, l.int8_activations));
    else
      on(TilesInt4::prepare(static_cast<const uint8_t*>(l.w), l.scales, l.zeros, l.group_size, p, scratch, 0,
                            scratch + TilesInt4::tile_floats(l.K)));
    return;
  }
#endif
  switch (l.kind) {
    case WeightKind::kF32:
      go(DenseF32{static_cast<const float*>(l.w)});
      break;
    case WeightKind::kInt8: {
      // Like int4: each thread quantizes its own copy of the activation rows.
#if defined(__AVX512VNNI__)
      if (l.int8_activations && w8a8_on_bytes(M, l.byte_bias)) {
        go(prepare_int8_bytes(static_cast<const int8_t*>(l.w), l.scales, x, M, l.K, ldx, scratch, l.byte_bias));
        break;
      }
#endif
      auto* xq = reinterpret_cast<int16_t*>(scratch + M);
      quantize_rows_int16(x, M, l.K, ldx, xq, scratch, act_qmax(l.int8_activations));
      go(Int8{static_cast<const int8_t*>(l.w), l.scales, xq, scratch});
      break;
    }
    case WeightKind::kInt4: {
      const int64_t G = num_groups(l);
      const auto* w = static_cast<const uint8_t*>(l.w);
      if (M <= kInt4DirectMaxRows) {
        // Each thread quantizes its own copy of the (few) activation rows: cheaper than a barrier.
        go(prepare_int4_dot_activations(p, w, l.scales, l.zeros, l.group_size, G, scratch));
      } else {
        // Each thread its own tile, and its own copy of the rows the tiles are dotted with.
        auto* xr = reinterpret_cast<Bf16Activation*>(scratch + int4_tile_floats(l.K));
        round_rows_bf16(x, M, l.K, ldx, xr);
        go(Int4Tile{w, l.scales, l.zeros, l.group_size, G, reinterpret_cast<Int4TileValue*>(scratch), 0, xr});
      }
      break;
    }
    case WeightKind::kBF16: {
      // Like int4: each thread rounds its own copy of the activation rows.
      auto* xr = reinterpret_cast<Bf16Activation*>(scratch);
      round_rows_bf16(x, M, l.K, ldx, xr);
      go(DenseBF16{static_cast<const bf16*>(l.w), xr});
      break;
    }
    case WeightKind::kAbsent:
      break;
  }
}

// Which experts each row takes (MoEBlock): filled by one thread, read by the team.
struct Routing {
  std::vector<float> probs;      // [E]: one row's router probabilities
  std::vector<char> taken;       // [E]: experts already in its top k (all 0 between rows)
  std::vector<int64_t> offset;   // [E + 1]: expert e's rows sit at positions offset[e] .. offset[e + 1] - 1
  std::vector<int64_t> row;      // [M k]: the token row at each position (ascending within an expert)
  std::vector<int64_t> pos;      // [M k]: row m's j-th expert (experts ascending) output position
  std::vector<float> weight;     // [M k]: and its weight
  std::vector<int64_t> expert;   // [M k]: and the expert
};

// Softmax of each row's router logits [M, E] in fp32 (torch's order: exp(l - max), times 1 / sum), its top k
// (descending, ties to the lower expert), optionally renormalized; then positions grouped by expert.
void route(const MoEBlock& moe, const float* logits, int64_t M, Routing& r) {
  const int64_t E = moe.num_experts, k = moe.top_k;
  float* p = r.probs.data();
  std::vector<int64_t> count(E, 0);
  for (int64_t m = 0; m < M; ++m) {
    const float* l = logits + m * E;
    float mx = l[0];
    for (int64_t e = 1; e < E; ++e) mx = l[e] > mx ? l[e] : mx;
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      p[e] = expf(l[e] - mx);
      sum += p[e];
    }
    const float inv = 1.0f / sum;
    for (int64_t e = 0; e < E; ++e) p[e] *= inv;
    int64_t* ex = r.expert.data() + m * k;
    float* w = r.weight.data() + m * k;
    float picked = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;  // the largest untaken probability, NaN above all (as torch.topk orders)
      for (int64_t e = 0; e < E; ++e)
        if (!r.taken[e] && (best < 0 || p[e] > p[best] || (isnan(p[e]) && !isnan(p[best])))) best = e;
      ex[j] = best;
      w[j] = p[best];
      picked += p[best];
      r.taken[best] = 1;
    }
    for (int64_t j = 0; j < k; ++j) r.taken[ex[j]] = 0;
    if (moe.normalize)
      for (int64_t j = 0; j < k; ++j) w[j] /= picked;
    for (int64_t j = 1; j < k; ++j)  // experts ascending: the order their outputs are summed in
      for (int64_t i = j; i > 0 && ex[i - 1] > ex[i]; --i) {
        const int64_t te = ex[i];
        ex[i] = ex[i - 1];
        ex[i - 1] = te;
        const float tw = w[i];
        w[i] = w[i - 1];
        w[i - 1] = tw;
      }
    for (int64_t j = 0; j < k; ++j) ++count[ex[j]];
  }
  r.offset[0] = 0;
  for (int64_t e = 0; e < E; ++e) r.offset[e + 1] = r.offset[e] + count[e];
  std::vector<int64_t> fill(r.offset.begin(), r.offset.end() - 1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t at = fill[r.expert[m * k + j]]++;
      r.row[at] = m;
      r.pos[m * k + j] = at;
    }
}

}  // namespace

bool walkable(const LinearRef& l) {
  return l.kind != WeightKind::kInt4 || int4_shape_ok(l.group_size, l.K);
}

bool takes_byte_bias(const LinearRef& l) {
#if defined(__AVX512VNNI__)
  return l.kind == WeightKind::kInt8 && l.int8_activations;
#else
  return false;
#endif
}

void fill_byte_bias(const LinearRef& l, int64_t* out) {
  int8_byte_bias(static_cast<const int8_t*>(l.w), l.N, l.K, out);
}

void decoder_step(const DecoderStep& s, int num_threads) {
  const int64_t M = s.M, H = s.H;
  int64_t extra = 0, work = 0;
  for (const LinearRef* l : {&s.dense, &s.gate_up, &s.down, &s.next_qkv}) {
    const int64_t need = linear_scratch(*l, M);
    extra = need > extra ? need : extra;
    work += l->N * l->K * M;
  }
  const MoEBlock* moe = s.attn != nullptr ? s.moe : nullptr;
  Routing routing;
  int64_t moe_floats = 0;  // per thread: the gathered rows of an expert [M, H] and a row's sum [H]
  if (moe != nullptr) {
    const int64_t E = moe->num_experts, k = moe->top_k;
    for (const LinearRef* l : {&moe->gate_up[0], &moe->down[0]}) {
      const int64_t need = linear_scratch(*l, M);
      extra = need > extra ? need : extra;
      work += l->N * l->K * M * k;
    }
    work += E * H * M;
    moe_floats = M * H + H;
    routing.probs.resize(E);
    routing.taken.assign(E, 0);
    routing.offset.resize(E + 1);
    for (auto* v : {&routing.row, &routing.pos, &routing.expert}) v->resize(M * k);
    routing.weight.resize(M * k);
  }
  const size_t scratch_floats = static_cast<size_t>(M * H + moe_floats + extra);
  // Tiny models (unit tests) are faster without waking the second thread.
  const bool threaded = num_threads > 1 && work >= (int64_t{1} << 18);
  Shares shares(num_threads);
#pragma omp parallel num_threads(num_threads) if (threaded)
  {
    Team team(shares);
    float* x = thread_scratch(scratch_floats);  // this thread's copy of the normed activations [M, H]
    float* lin = x + M * H + moe_floats;
    // hidden += l(in), or its RMSNorm when `norm` is given: that needs the whole output first, so it goes
    // through s.delta at the cost of a barrier.
    auto add_sublayer = [&](const LinearRef& l, const float* in, const float* norm) {
      if (norm == nullptr) {
        team_linear(team, l, in, M, l.K, s.hidden, H, true, lin, nullptr);
      } else {
        team_linear(team, l, in, M, l.K, s.delta, H, false, lin, nullptr);
        team_add_rms_norm(s.delta, M, H, norm, s.eps, s.hidden);
      }
    };
    // Each thread norms its own copy of the rows: cheaper than a barrier.
    auto normed = [&](const float* norm) -> const float* {
      if (norm == nullptr) return s.hidden;
      rms_norm_rows(s.hidden, M, H, norm, s.eps, x);
      return x;
    };
    if (s.attn != nullptr) {
      add_sublayer(s.dense, s.attn, s.attention_output_norm);
      if (moe == nullptr) {
        team_linear(team, s.gate_up, normed(s.post_norm), M, H, s.gate_up_out, s.gate_up.N, false, lin, s.act,
                    s.activation);
        add_sublayer(s.down, s.act, s.mlp_output_norm);
      } else {
        const int64_t E = moe->num_experts, k = moe->top_k, I = moe->down[0].K;
        const float* in = normed(s.post_norm);
        team_linear(team, moe->router, in, M, H, s.router_out, E, false, lin, nullptr);
#pragma omp single
        route(*moe, s.router_out, M, routing);
        // Expert by expert (ascending), with the team: its rows' SwiGLU MLP into expert_out at their positions.
        float* rows_in = x + M * H;
        for (int64_t e = 0; e < E; ++e) {
          const int64_t first = routing.offset[e], n = routing.offset[e + 1] - first;
          if (n == 0) continue;
          for (int64_t i = 0; i < n; ++i)  // each thread gathers its own copy: cheaper than a barrier
            memcpy(rows_in + i * H, in + routing.row[first + i] * H, sizeof(float) * H);
          team_linear(team, moe->gate_up[e], rows_in, n, H, s.gate_up_out, 2 * I, false, lin, s.act,
                      Activation::kSilu);
          team_linear(team, moe->down[e], s.act, n, I, s.expert_out + first * H, H, false, lin, nullptr);
        }
        // m = 0 + w_e y_e + ... over the row's experts ascending, then the residual add (or its norm's).
        float* sum = rows_in + M * H;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
          float* o = s.mlp_output_norm != nullptr ? s.delta + m * H : sum;
          for (int64_t i = 0; i < H; ++i) o[i] = 0.0f;
          for (int64_t j = 0; j < k; ++j) {
            const float* y = s.expert_out + routing.pos[m * k + j] * H;
            const float w = routing.weight[m * k + j];
            for (int64_t i = 0; i < H; ++i) o[i] += y[i] * w;
          }
          if (s.mlp_output_norm == nullptr) {
            float* h = s.hidden + m * H;
            for (int64_t i = 0; i < H; ++i) h[i] += o[i];
          }
        }
        if (s.mlp_output_norm != nullptr) team_add_rms_norm(s.delta, M, H, s.mlp_output_norm, s.eps, s.hidden);
      }
    }
    if (s.next_qkv.kind != WeightKind::kAbsent) {
      team_linear(team, s.next_qkv, normed(s.next_norm), M, H, s.out, s.next_qkv.N, false, lin, nullptr);
    } else if (s.next_norm != nullptr) {
      const float* y = normed(s.next_norm);
#pragma omp single
      for (int64_t i = 0; i < M * H; ++i) s.out[i] = y[i];
    }
  }
}

}  // namespace llmp
