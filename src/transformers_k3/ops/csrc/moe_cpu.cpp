// Routed-experts forward on CPU (fp32, no autograd): the same computation as the "k3_grouped_mm" experts
// implementation (transformers_k3.ops.experts), fused per expert.
//
// torch's CPU grouped GEMM runs one at::mm per expert, with a tensor and a dispatch around each, and every
// step around it (gather, GLU, weighting, scatter) is a separate pass over [N * k, *] tensors. Here the
// (token, slot) assignments are counting-sorted by expert, then each task takes up to kTile rows of one
// expert: gathers them, runs [rows, D] x [D, 2I] through sgemm, applies the GLU and the routing weight in
// cache, and runs [rows, I] x [I, D] straight into the expert-sorted output rows. A last parallel pass sums
// each token's k rows (fp32, in slot order).
//
// Layouts (row-major, fp32, contiguous): x [N, D]; top_k_index (int64) / top_k_weights [N, k];
// gate_up [E, 2I, D] (gate rows, then up rows) or, transposed, [E, D, 2I]; down [E, D, I] or [E, I, D];
// out [N, D]; scratch: the expert-sorted rows [N * k, D] (sgemm path) or the per-thread accumulators
// [(threads - 1) N, D] (small-GEMM path, below). Ids outside [0, E) (expert-parallel sentinels) contribute nothing.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"
#include "glu_simd.h"
#include "kernels.h"
#include "small_gemm.h"

namespace {

using k3::fast_exp;
using k3::gemm;

constexpr int kTile = 128;  // rows per task: bounds the scratch; experts with more rows are split

// tanh(x) for |x| < 0.625: Cephes' tanhf odd polynomial
inline float tanh_polynomial(float x) {
  const float z = x * x;
  float p = k3::cephes::kTanh[0];
  for (int i = 1; i < 5; ++i) p = p * z + k3::cephes::kTanh[i];
  return p * z * x + x;
}

// tanh to a few ulp (Cephes' tanhf: the polynomial below 0.625, 1 - 2 / (e^{2|x|} + 1) above), branch-free.
// NaN stays NaN, +-inf gives +-1.
inline float fast_tanh(float x) {
  const float ax = std::fabs(x);
  const float e = fast_exp(2.0f * (ax > 44.0f ? 44.0f : ax));
  const float big = std::copysign(1.0f - 2.0f / (e + 1.0f), x);
  return ax < 0.625f ? tanh_polynomial(x) : big;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

// SiTU's gate at K3's beta = 4, f(a) = 4 tanh(a / 4) sigmoid(a), from one exponential and one division: with
// t = e^{-|a| / 2}, tanh(|a| / 4) = (1 - t) / (1 + t) and sigmoid(|a|) = 1 / (1 + t^2), sigmoid(-|a|) = t^2 /
// (1 + t^2); below |a| / 4 = 0.625 the tanh is fast_tanh's polynomial (1 - t would cancel). For the backward
// also 1 - tanh^2(a / 4) = 4 t / (1 + t)^2 and 1 - sigmoid(a), both without the cancellation of subtracting
// from 1 (which loses ~1e-5 relative at |a| ~ 11). A few ulp from fast_tanh and sigmoid, which take two
// exponentials and two divisions; NaN stays NaN.
struct Gate4 {
  float tanh_quarter, sig, sech2_quarter, one_minus_sig;
  explicit Gate4(float a) {
    const float y = std::fabs(a);
    const float t = fast_exp(-0.5f * y), t2 = t * t;
    const float r = 1.0f / ((1.0f + t) * (1.0f + t2));  // 1 / (1 + t) = (1 + t^2) r
    const bool small = y < 2.5f, positive = a >= 0.0f;
    tanh_quarter = small ? tanh_polynomial(0.25f * a) : std::copysign((1.0f - t) * (1.0f + t2) * r, a);
    sig = (positive ? 1.0f : t2) * (1.0f + t) * r;
    one_minus_sig = (positive ? t2 : 1.0f) * (1.0f + t) * r;
    const float inv_1pt = (1.0f + t2) * r;
    sech2_quarter = small ? 1.0f - tanh_quarter * tanh_quarter : 4.0f * t * inv_1pt * inv_1pt;
  }
};

struct Activation {
  int kind;           // 0: silu(gate) * up; 1: SiTU
  float beta;         // SiTU gate cap
  float linear_beta;  // SiTU up cap; <= 0: the up half is not capped
};

// A thread's rows of one task (up to kTile): inputs, gate/up products, GLU outputs, routing weights; the
// backward also the output gradients, the GLU input gradient and the gate/up gradients.
struct Rows {
  k3::aligned_vector<float> x, h, glu, weight, dy, dglu, dh;
  // small-GEMM path: the rows' token ids (where their outputs are added) and one expert's weights in cache as fp32
  // (transposed, or converted from bf16); with bf16 weights the backward's third weight operand (wc) and the
  // expert's fp32 weight gradients before they are rounded into the bf16 gradients (ga, gd)
  std::vector<int64_t> token;
  k3::aligned_vector<float> wa, wb, wc, ga, gd;
  Rows(int hidden, int inter, bool backward, bool small = false, bool bf16 = false)
      : h((size_t)kTile * 2 * inter), glu((size_t)kTile * inter), weight(kTile) {
    if (backward || !small) x.resize((size_t)kTile * hidden);  // (the small-GEMM forward reads x in place)
    if (backward) {
      dy.resize((size_t)kTile * hidden);
      dglu.resize((size_t)kTile * inter);
      dh.resize((size_t)kTile * 2 * inter);
    }
    if (small) {
      token.resize(kTile);
      wa.resize((size_t)2 * inter * hidden);
      wb.resize((size_t)2 * inter * hidden);
      if (backward && bf16) {
        wc.resize((size_t)2 * inter * hidden);
        ga.resize((size_t)2 * inter * hidden);
        gd.resize((size_t)inter * hidden);
      }
    }
  }
};

// The part of a task that forward and backward share: gathers the rows of assignments order[0 .. rows) (input
// rows, routing weights and, if `grad_out` is given, the output gradient rows) into `s`, and computes the
// gate/up product s.h = s.x W_gate_up^T (W_gate_up [2I, D], or [D, 2I] when `transposed`).
void gather_and_project(Rows& s, const int64_t* order, int rows, int top_k, int hidden, int inter, const float* x,
                        const float* top_k_weights, const float* grad_out, const float* wgu, bool transposed) {
  for (int r = 0; r < rows; ++r) {
    const int64_t a = order[r], token = a / top_k;
    std::memcpy(s.x.data() + (size_t)r * hidden, x + token * hidden, sizeof(float) * hidden);
    if (grad_out != nullptr)
      std::memcpy(s.dy.data() + (size_t)r * hidden, grad_out + token * hidden, sizeof(float) * hidden);
    s.weight[r] = top_k_weights[a];
  }
  const int two_i = 2 * inter;
  if (transposed)
    gemm(false, false, rows, two_i, hidden, 1.0f, s.x.data(), hidden, wgu, two_i, 0.0f, s.h.data(), two_i);
  else
    gemm(false, true, rows, two_i, hidden, 1.0f, s.x.data(), hidden, wgu, hidden, 0.0f, s.h.data(), two_i);
}

// The shape and activation arguments both entry points take are usable.
bool valid(int64_t n_tokens, int hidden, int top_k, int64_t n_experts, int inter, int n_threads, int act_kind,
           float act_beta) {
  return n_tokens >= 0 && hidden > 0 && top_k > 0 && n_experts > 0 && inter > 0 && n_threads > 0 &&
         (act_kind == 0 || (act_kind == 1 && act_beta > 0.0f));
}

// The AVX-512 GLUs (glu_avx512.h) on builds that have them, unless turned off (k3_moe_set_vector_glu: tests run
// the scalar forms below too, which builds without AVX-512 take).
bool g_vector_glu = K3_HAVE_SMALL_GEMM;

// glu[r, i] = weight[r] * act(h[r, i], h[r, I + i]) for `rows` rows of h [rows, 2I].
void apply_glu(const float* h, float* glu, const float* weight, int rows, int inter, const Activation& act) {
#if K3_HAVE_SMALL_GEMM
  if (g_vector_glu)
    return k3::glu::rows<false>(h, nullptr, weight, glu, nullptr, rows, inter, act.kind, act.beta, act.linear_beta);
#endif
  for (int r = 0; r < rows; ++r) {
    const float* gate = h + (size_t)r * 2 * inter;
    const float* up = gate + inter;
    float* o = glu + (size_t)r * inter;
    const float w = weight[r];
    if (act.kind == 0) {
#pragma omp simd
      for (int i = 0; i < inter; ++i) o[i] = gate[i] * sigmoid(gate[i]) * up[i] * w;
    } else if (act.linear_beta > 0.0f && act.beta == 4.0f) {
      const float inv_linear = 1.0f / act.linear_beta, cap = act.beta * act.linear_beta * w;
#pragma omp simd
      for (int i = 0; i < inter; ++i) {
        const Gate4 g(gate[i]);
        o[i] = g.tanh_quarter * g.sig * fast_tanh(up[i] * inv_linear) * cap;
      }
    } else if (act.linear_beta > 0.0f) {
      const float inv_beta = 1.0f / act.beta, inv_linear = 1.0f / act.linear_beta;
      const float cap = act.beta * act.linear_beta * w;
#pragma omp simd
      for (int i = 0; i < inter; ++i)
        o[i] = fast_tanh(gate[i] * inv_beta) * sigmoid(gate[i]) * fast_tanh(up[i] * inv_linear) * cap;
    } else {
      const float inv_beta = 1.0f / act.beta, cap = act.beta * w;
#pragma omp simd
      for (int i = 0; i < inter; ++i) o[i] = fast_tanh(gate[i] * inv_beta) * sigmoid(gate[i]) * up[i] * cap;
    }
  }
}

// One row of glu_backward for SiTU: f(a) = beta tanh(a / beta) sigmoid(a), h(u) = L tanh(u / L) (or u);
// `Beta4`: beta is 4 (Gate4: a separate instantiation, so the vectorised loop has no branch).
template <bool Beta4>
inline void situ_backward_row(const float* a, const float* u, const float* d, float* g, float* da, float* du,
                              int inter, float w, const Activation& act) {
  const float inv_beta = 1.0f / act.beta, beta = act.beta;
  const bool capped = act.linear_beta > 0.0f;
  const float linear = capped ? act.linear_beta : 1.0f, inv_linear = 1.0f / linear;
#pragma omp simd
  for (int i = 0; i < inter; ++i) {
    float f, df;
    if (Beta4) {
      const Gate4 gate(a[i]);
      f = beta * gate.tanh_quarter * gate.sig;
      df = gate.sech2_quarter * gate.sig + f * gate.one_minus_sig;
    } else {
      const float t1 = fast_tanh(a[i] * inv_beta), s = sigmoid(a[i]);
      f = beta * t1 * s;
      df = (1.0f - t1 * t1) * s + f * (1.0f - s);
    }
    const float t2 = fast_tanh(u[i] * inv_linear);
    const float hu = capped ? linear * t2 : u[i];
    const float dhu = capped ? 1.0f - t2 * t2 : 1.0f;
    g[i] = f * hu;
    da[i] = w * d[i] * df * hu;
    du[i] = w * d[i] * f * dhu;
  }
}

// For the backward of `apply_glu`, per row r and channel i: glu[r, i] = act(a, u) (without the routing weight)
// and, given dglu = d loss / d (weight * act), dh[r, i] = weight * dglu * d act / d a, dh[r, I + i] = the same
// for u. Returns nothing; `glu` and `dh` are [rows, I] and [rows, 2I].
void glu_backward(const float* h, const float* dglu, const float* weight, float* glu, float* dh, int rows, int inter,
                  const Activation& act) {
#if K3_HAVE_SMALL_GEMM
  if (g_vector_glu)
    return k3::glu::rows<true>(h, dglu, weight, glu, dh, rows, inter, act.kind, act.beta, act.linear_beta);
#endif
  for (int r = 0; r < rows; ++r) {
    const float* a = h + (size_t)r * 2 * inter;
    const float* u = a + inter;
    const float* d = dglu + (size_t)r * inter;
    float* g = glu + (size_t)r * inter;
    float* da = dh + (size_t)r * 2 * inter;
    float* du = da + inter;
    const float w = weight[r];
    if (act.kind == 0) {  // silu(a) u: d/da = s (1 + a (1 - s)) u, d/du = a s
#pragma omp simd
      for (int i = 0; i < inter; ++i) {
        const float s = sigmoid(a[i]);
        const float f = a[i] * s;
        g[i] = f * u[i];
        da[i] = w * d[i] * s * (1.0f + a[i] * (1.0f - s)) * u[i];
        du[i] = w * d[i] * f;
      }
    } else if (act.beta == 4.0f) {
      situ_backward_row<true>(a, u, d, g, da, du, inter, w, act);
    } else {
      situ_backward_row<false>(a, u, d, g, da, du, inter, w, act);
    }
  }
}

// grad_weights[order[r]] = dglu[r] . glu[r] (the routing weight's gradient) for the rows of a backward task.
void weight_gradients(const Rows& s, int rows, int inter, const int64_t* order, float* grad_weights) {
  for (int r = 0; r < rows; ++r) {
    const float* dg = s.dglu.data() + (size_t)r * inter;
    const float* g = s.glu.data() + (size_t)r * inter;
    float sum = 0.0f;
    for (int i = 0; i < inter; ++i) sum += dg[i] * g[i];
    grad_weights[order[r]] = sum;
  }
}

// glu[r] *= weight[r]: the down projection's input, for its weight gradient.
void scale_rows(Rows& s, int rows, int inter) {
  for (int r = 0; r < rows; ++r) {
    float* g = s.glu.data() + (size_t)r * inter;
    const float w = s.weight[r];
#pragma omp simd
    for (int i = 0; i < inter; ++i) g[i] *= w;
  }
}

// All experts' matrices of one kind, [E, size] in either layout: weights, or weight gradients (data null: not
// wanted); fp32, or bf16 as raw bits (the small-GEMM path only).
struct ExpertStack {
  void* data;
  int64_t size;  // elements per expert
  bool bf16;
  int64_t bytes() const { return size * (bf16 ? 2 : 4); }  // one expert's
  char* at(int64_t e) const { return static_cast<char*>(data) + e * bytes(); }
  float* f32(int64_t e) const { return reinterpret_cast<float*>(at(e)); }  // (fp32 stacks)
};

// Expert e's weight-gradient targets in the backward (null where not wanted): the fp32 gradients' own slices or,
// for bf16 gradients, the thread's fp32 scratch `ga` / `gd`, which finish() rounds into the slices. An expert no
// row chose gets zero weight gradients here (`chosen` false: nothing else to do for it).
struct ExpertSlices {
  float* grad_gate_up;
  float* grad_down;
  bool chosen;
  ExpertSlices(int64_t e, const k3::Sorted& routing, const ExpertStack& g_gate_up, const ExpertStack& g_down,
               float* ga = nullptr, float* gd = nullptr)
      : grad_gate_up(g_gate_up.data == nullptr ? nullptr : g_gate_up.bf16 ? ga : g_gate_up.f32(e)),
        grad_down(g_down.data == nullptr ? nullptr : g_down.bf16 ? gd : g_down.f32(e)),
        chosen(routing.offsets[e + 1] > routing.offsets[e]),
        e_(e),
        g_gate_up_(g_gate_up),
        g_down_(g_down) {
    if (chosen) return;
    for (const ExpertStack* g : {&g_gate_up, &g_down})  // (+0.0 is all zero bits in fp32 and bf16 alike)
      if (g->data != nullptr) std::memset(g->at(e), 0, g->bytes());
  }
  // bf16 gradients: the expert's fp32 sums rounded into its slices (after its last product)
  void finish() const {
#if K3_HAVE_SMALL_GEMM
    if (grad_gate_up != nullptr && g_gate_up_.bf16)
      k3::float_to_bf16(grad_gate_up, g_gate_up_.size, reinterpret_cast<uint16_t*>(g_gate_up_.at(e_)));
    if (grad_down != nullptr && g_down_.bf16)
      k3::float_to_bf16(grad_down, g_down_.size, reinterpret_cast<uint16_t*>(g_down_.at(e_)));
#endif
  }

 private:
  int64_t e_;
  const ExpertStack &g_gate_up_, &g_down_;
};

// out[t] = sum over the token's valid slots of rows[position[t * k + j]] (fp32, slot order); inside a
// parallel region.
void sum_slots(const float* rows, const std::vector<int64_t>& position, int64_t n_tokens, int top_k, int hidden,
               float* out) {
#pragma omp for schedule(static)
  for (int64_t t = 0; t < n_tokens; ++t) {
    float* o = out + t * hidden;
    for (int i = 0; i < hidden; ++i) o[i] = 0.0f;
    for (int j = 0; j < top_k; ++j) {
      const int64_t p = position[t * top_k + j];
      if (p < 0) continue;
      const float* y = rows + p * hidden;
#pragma omp simd
      for (int i = 0; i < hidden; ++i) o[i] += y[i];
    }
  }
}

#if K3_HAVE_SMALL_GEMM
// The small-GEMM path (AVX-512; experts small enough that a transposed copy of one expert's weights stays in
// cache): no expert-sorted [N k, D] rows. Each thread owns a contiguous range of experts, chosen so that the
// ranges cost about the same (rows plus a per-expert constant for transposing the weights: about 8 rows' worth
// of multiply-adds), and adds its experts' output rows straight into its own [N, D] accumulator (thread 0's is
// `out` itself); the accumulators are summed at the end. Every token's sum is thus taken in a fixed order for a
// given thread count: the results do not depend on scheduling.
constexpr int64_t kExpertCostRows = 8;

void expert_range(const std::vector<int64_t>& offsets, int64_t n_experts, int team, int me, int64_t& lo,
                  int64_t& hi) {
  auto cost = [&](int64_t e) { return offsets[e] + kExpertCostRows * e; };
  const int64_t total = cost(n_experts);
  auto first = [&](int part) {  // the first expert e with cost(e) >= total * part / team
    const int64_t target = (int64_t)((double)total * part / team);
    int64_t a = 0, b = n_experts;
    while (a < b) {
      const int64_t mid = (a + b) / 2;
      if (cost(mid) < target) a = mid + 1; else b = mid;
    }
    return a;
  };
  lo = me == 0 ? 0 : first(me);
  hi = me == team - 1 ? n_experts : first(me + 1);
}

// Prefetches of expert e + 1's weights and, in the backward, its weight-gradient slices (none past `hi`; null
// gradients: none), issued during expert e's products: the weights are read into L2 while this one computes, so
// they are in cache when its transposes start, and the gradient lines are taken for writing (prefetchw), so that
// its gradient products do not wait on them (a gain in the backward that varies with how busy the memory system
// is; bench/RESULTS.md).
struct NextExpert {
  k3::Prefetch gate_up, down, grad_gate_up, grad_down;
  NextExpert(const ExpertStack& w_gate_up, const ExpertStack& w_down, int64_t e, int64_t hi,
             const ExpertStack* g_gate_up = nullptr, const ExpertStack* g_down = nullptr) {
    if (e + 1 >= hi) return;
    gate_up = lines(w_gate_up, e + 1, false);
    down = lines(w_down, e + 1, false);
    if (g_gate_up != nullptr && g_gate_up->data != nullptr) grad_gate_up = lines(*g_gate_up, e + 1, true);
    if (g_down != nullptr && g_down->data != nullptr) grad_down = lines(*g_down, e + 1, true);
  }
  static k3::Prefetch lines(const ExpertStack& stack, int64_t e, bool for_write) {
    return k3::Prefetch(stack.f32(e), (stack.bytes() + 3) / 4, for_write);  // (a byte range, counted in floats)
  }
};

// `w` [rows, cols] as [cols, rows] in `buffer` if `need` (else `w` itself).
const float* maybe_transposed(const float* w, int rows, int cols, bool need, k3::aligned_vector<float>& buffer) {
  if (!need) return w;
  k3::transpose(w, rows, cols, cols, buffer.data());
  return buffer.data();
}

// Expert e's [rows, cols] matrix of `w` as an fp32 product operand: as stored, or transposed ([cols, rows]) into
// `buffer` if `transpose`; bf16 weights are converted into `buffer` either way (exactly).
const float* weight_operand(const ExpertStack& w, int64_t e, int rows, int cols, bool transpose,
                            k3::aligned_vector<float>& buffer) {
  if (!w.bf16) return maybe_transposed(w.f32(e), rows, cols, transpose, buffer);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.at(e));
  if (transpose)
    k3::transpose(src, rows, cols, cols, buffer.data());
  else
    k3::bf16_to_float(src, w.size, buffer.data());
  return buffer.data();
}

// Thread `me`'s [N, D] accumulator, zeroed: thread 0's is `first` itself (the output), the others' lie in
// `others` [(threads - 1) N, D]; null when `first` is (that output is not wanted).
float* own_accumulator(float* first, float* others, int me, int64_t n_tokens, int hidden) {
  if (first == nullptr) return nullptr;
  float* acc = me == 0 ? first : others + (me - 1) * n_tokens * hidden;
  std::fill(acc, acc + n_tokens * hidden, 0.0f);
  return acc;
}

// acc (thread 0's, i.e. `out`) += the other threads' accumulators, token by token; inside a parallel region,
// after a barrier.
void sum_accumulators(float* out, const float* others, int n_others, int64_t n_tokens, int hidden) {
  const int64_t size = n_tokens * hidden;
#pragma omp for schedule(static)
  for (int64_t t = 0; t < n_tokens; ++t) {
    float* o = out + t * hidden;
    for (int b = 0; b < n_others; ++b) {
      const float* y = others + b * size + t * hidden;
#pragma omp simd
      for (int i = 0; i < hidden; ++i) o[i] += y[i];
    }
  }
}

// The small-GEMM path's parallel region, shared by forward and backward: each thread takes its contiguous range
// of experts (expert_range) with its own scratch and its own [N, D] accumulator (own_accumulator: thread 0's is
// `first`, the output; null `first`: none), calls fn(rows scratch, e, end of its range, accumulator) for each
// expert in order, and after a barrier the accumulators are summed into `first`. Returns the scratch status.
template <class PerExpert>
int each_own_expert(const k3::Sorted& routing, int64_t n_experts, int64_t n_tokens, int hidden, int inter,
                    bool backward, bool bf16, float* first, float* accumulators, int n_threads, PerExpert fn) {
  int status = 0;
#pragma omp parallel num_threads(n_threads)
  {
    const k3::FlushDenormals flush;
    const std::unique_ptr<Rows> scratch = k3::new_scratch<Rows>(status, hidden, inter, backward, true, bf16);
    const int team = omp_get_num_threads(), me = omp_get_thread_num();
    float* acc = own_accumulator(first, accumulators, me, n_tokens, hidden);
    int64_t lo, hi;
    expert_range(routing.offsets, n_experts, team, me, lo, hi);
    for (int64_t e = lo; e < hi && scratch != nullptr; ++e) fn(*scratch, e, hi, acc);
#pragma omp barrier
    if (first != nullptr) sum_accumulators(first, accumulators, team - 1, n_tokens, hidden);
  }
  return status;
}

// Forward of the small-GEMM path (see above); `accumulators` [(n_threads - 1) N, D].
int small_forward(const float* x, int64_t n_tokens, int hidden, const k3::Sorted& routing,
                  const float* top_k_weights, int top_k, const ExpertStack& gate_up, bool gate_up_transposed,
                  const ExpertStack& down, bool down_transposed, int64_t n_experts, int inter, const Activation& act,
                  float* accumulators, float* out, float* saved_h, int n_threads) {
  const int two_i = 2 * inter;
  return each_own_expert(routing, n_experts, n_tokens, hidden, inter, false, false, out, accumulators, n_threads,
                         [&](Rows& s, int64_t e, int64_t hi, float* acc) {
    const int64_t begin = routing.offsets[e], end = routing.offsets[e + 1];
    if (begin == end) return;
    // B operands [k, n]: W_gate_up^T [D, 2I] and W_down^T [I, D] (stored that way when transposed)
    const float* wgu = weight_operand(gate_up, e, two_i, hidden, !gate_up_transposed, s.wa);
    const float* wd = weight_operand(down, e, hidden, inter, !down_transposed, s.wb);
    const NextExpert next(gate_up, down, e, hi);
    for (int64_t start = begin; start < end; start += kTile) {
      const int rows = (int)std::min<int64_t>(kTile, end - start);
      const int64_t* order = routing.order.data() + start;
      for (int r = 0; r < rows; ++r) {
        s.token[r] = order[r] / top_k;
        s.weight[r] = top_k_weights[order[r]];
      }
      // the input rows are read in place (token rows of x); the gate/up products go to `saved_h` (expert-sorted
      // rows, for the backward) when it is given
      float* h = saved_h != nullptr ? saved_h + start * two_i : s.h.data();
      k3::small_gemm(rows, two_i, hidden, x, hidden, 1, wgu, two_i, h, two_i, nullptr, false, next.gate_up,
                     s.token.data());
      apply_glu(h, s.glu.data(), s.weight.data(), rows, inter, act);
      k3::small_gemm(rows, hidden, inter, s.glu.data(), inter, 1, wd, hidden, acc, hidden, s.token.data(), true,
                     next.down);
    }
  });
}

// Backward of the small-GEMM path: as k3_moe_experts_backward, with the input gradient rows added into
// per-thread accumulators `accumulators` [(n_threads - 1) N, D] (thread 0's is grad_x).
int small_backward(const float* x, int64_t n_tokens, int hidden, const k3::Sorted& routing,
                   const float* top_k_weights, int top_k, const ExpertStack& gate_up, bool gate_up_transposed,
                   const ExpertStack& down, bool down_transposed, int64_t n_experts, int inter, const Activation& act,
                   const float* grad_out, float* grad_x, float* grad_weights, const ExpertStack& grad_gate_up,
                   const ExpertStack& grad_down, float* accumulators, const float* saved_h, int n_threads) {
  const int two_i = 2 * inter;
  return each_own_expert(routing, n_experts, n_tokens, hidden, inter, true, gate_up.bf16, grad_x, accumulators,
                         n_threads, [&](Rows& s, int64_t e, int64_t hi, float* dx_acc) {
    const ExpertSlices expert(e, routing, grad_gate_up, grad_down, s.ga.data(), s.gd.data());
    if (!expert.chosen) return;
    float *ggu = expert.grad_gate_up, *gd = expert.grad_down;
    const int64_t begin = routing.offsets[e], end = routing.offsets[e + 1];
    // B operands [k, n]: W_gate_up^T [D, 2I] (the recomputed product, unless the forward saved it), W_down
    // [D, I] (dY W_down) and W_gate_up [2I, D] (dH W_gate_up), each transposed in cache unless stored that way
    const float* wgu_t =
        saved_h != nullptr ? nullptr : weight_operand(gate_up, e, two_i, hidden, !gate_up_transposed, s.wa);
    const float* wd = weight_operand(down, e, inter, hidden, down_transposed, s.wb);
    const NextExpert next(gate_up, down, e, hi, &grad_gate_up, &grad_down);
    // (fp32 weights stored [2I, D] are read in place, where the recomputed product's transposed copy may lie in
    // s.wa; a converted bf16 copy goes to s.wc)
    const float* wgu =
        grad_x == nullptr ? nullptr
                          : weight_operand(gate_up, e, hidden, two_i, gate_up_transposed, gate_up.bf16 ? s.wc : s.wa);
    for (int64_t start = begin; start < end; start += kTile) {
      const int rows = (int)std::min<int64_t>(kTile, end - start);
      const bool accumulate = start != begin;
      const int64_t* order = routing.order.data() + start;
      // the input rows gathered: for the recomputed product and for X^T dH into weights stored [D, 2I] (dH^T X
      // into [2I, D] reads them in place)
      const bool need_x = saved_h == nullptr || (ggu != nullptr && gate_up_transposed);
      for (int r = 0; r < rows; ++r) {
        const int64_t token = s.token[r] = order[r] / top_k;
        if (need_x) std::memcpy(s.x.data() + (size_t)r * hidden, x + token * hidden, sizeof(float) * hidden);
        std::memcpy(s.dy.data() + (size_t)r * hidden, grad_out + token * hidden, sizeof(float) * hidden);
        s.weight[r] = top_k_weights[order[r]];
      }
      // prefetches: the next expert's weights and gradient slices, and the input-gradient rows that the last
      // product adds into (taken for writing during the down-gradient product, else during dY W_down)
      const k3::Prefetch dx_rows =
          dx_acc ? k3::Prefetch(dx_acc, s.token.data(), rows, hidden, hidden, true) : k3::Prefetch();
      k3::Prefetch on_dglu = next.down, grad_down_next = next.grad_down;
      if (!gd) grad_down_next.then(&dx_rows);
      const float* h = s.h.data();
      if (saved_h != nullptr) {  // the gate/up products as the forward computed them
        h = saved_h + start * two_i;
        on_dglu.then(&grad_down_next);
      } else {
        k3::small_gemm(rows, two_i, hidden, s.x.data(), hidden, 1, wgu_t, two_i, s.h.data(), two_i, nullptr,
                       false, grad_down_next);
      }
      k3::small_gemm(rows, inter, hidden, s.dy.data(), hidden, 1, wd, inter, s.dglu.data(), inter, nullptr, false,
                     on_dglu);
      glu_backward(h, s.dglu.data(), s.weight.data(), s.glu.data(), s.dh.data(), rows, inter, act);
      if (grad_weights != nullptr) weight_gradients(s, rows, inter, order, grad_weights);
      if (gd) {
        scale_rows(s, rows, inter);
        if (down_transposed)  // [I, D] (+)= (w glu)^T dY
          k3::small_gemm(inter, hidden, rows, s.glu.data(), 1, inter, s.dy.data(), hidden, gd, hidden, nullptr,
                         accumulate, dx_rows);
        else  // [D, I] (+)= dY^T (w glu)
          k3::small_gemm(hidden, inter, rows, s.dy.data(), 1, hidden, s.glu.data(), inter, gd, inter, nullptr,
                         accumulate, dx_rows);
      }
      if (ggu) {
        if (gate_up_transposed)  // [D, 2I] (+)= X^T dH
          k3::small_gemm(hidden, two_i, rows, s.x.data(), 1, hidden, s.dh.data(), two_i, ggu, two_i, nullptr,
                         accumulate);
        else  // [2I, D] (+)= dH^T X, X's rows read in place (token rows of x)
          k3::small_gemm(two_i, hidden, rows, s.dh.data(), 1, two_i, x, hidden, ggu, hidden, nullptr, accumulate,
                         next.gate_up, nullptr, s.token.data());
      }
      if (dx_acc != nullptr)  // dX[token] += dH W_gate_up
        k3::small_gemm(rows, hidden, two_i, s.dh.data(), two_i, 1, wgu, hidden, dx_acc, hidden, s.token.data(),
                       true, next.grad_gate_up);
    }
    expert.finish();
  });
}
#endif
#if K3_HAVE_SMALL_GEMM
// A forward of at most kFewTokens tokens without autograd (a decode step): each (token, slot) assignment's two
// products as dot products over the expert's stored rows (k3::dots: no transposed copy of its weights, which the
// small-GEMM path makes for every expert it visits, nor an sgemm call per expert), one assignment a task, into its
// own row of `rows` [N k, D]; then each token's rows summed in slot order, so that any thread count gives the same
// bits. (At one token this is faster than either the sgemm or the small-GEMM path.)
constexpr int64_t kFewTokens = 4;

template <class T>
int few_forward(const float* x, int64_t n_tokens, int hidden, const int64_t* top_k_index, const float* top_k_weights,
                int top_k, const T* gate_up, const T* down, int64_t n_experts, int inter, const Activation& act,
                float* out, int n_threads) {
  const int64_t n_assign = n_tokens * top_k, gate_up_size = (int64_t)2 * inter * hidden;
  const int64_t down_size = (int64_t)hidden * inter;
  std::vector<float> rows;
  try {
    rows.resize((size_t)n_assign * hidden);
  } catch (...) {
    return 2;
  }
  // a thread per 2M multiply-adds: a decode step at these sizes is short on one thread, and a parallel region's
  // second thread, if another process holds its core, waits for the scheduler
  const int64_t work = n_assign * 3 * hidden * inter;
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(n_threads, work >> 21));
  int status = 0;
#pragma omp parallel num_threads(threads)
  {
    const k3::FlushDenormals flush;
    std::vector<float> h, glu;
    try {
      h.resize(2 * inter), glu.resize(inter);
    } catch (...) {
#pragma omp atomic write
      status = 2;
    }
#pragma omp for schedule(static)
    for (int64_t a = 0; a < n_assign; ++a) {
      const int64_t e = top_k_index[a];
      float* o = rows.data() + a * hidden;
      if (e < 0 || e >= n_experts || glu.empty()) {  // (expert-parallel sentinels contribute nothing)
        std::fill(o, o + hidden, 0.0f);
        continue;
      }
      k3::dots(x + (a / top_k) * hidden, gate_up + e * gate_up_size, 2 * inter, hidden, h.data());
      apply_glu(h.data(), glu.data(), top_k_weights + a, 1, inter, act);
      k3::dots(glu.data(), down + e * down_size, hidden, inter, o);
    }
  }
  for (int64_t t = 0; t < n_tokens; ++t) {
    float* o = out + t * hidden;
    std::fill(o, o + hidden, 0.0f);
    for (int j = 0; j < top_k; ++j) {
      const float* r = rows.data() + (t * top_k + j) * hidden;
      for (int i = 0; i < hidden; ++i) o[i] += r[i];
    }
  }
  return status;
}

// k3_glu's rows, the kind and beta dispatched once (k3::glu::with_activation, as for the experts' tiles): row r of
// gate / up / grad_out (null in the forward) -> row r of out / grad_gate / grad_up.
template <bool Backward>
void dense_glu(const float* gate, const float* up, const float* grad_out, float* out, float* grad_gate,
               float* grad_up, int64_t rows, int inter, const Activation& act, int threads) {
  k3::glu::with_activation(act.kind, act.beta, [&](auto kind_c, auto beta4_c) {
#pragma omp parallel num_threads(threads)
    {
      const k3::FlushDenormals flush;  // (as in the experts kernel)
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        const size_t o = (size_t)r * inter;
        k3::glu::row<decltype(kind_c)::value, decltype(beta4_c)::value, Backward>(
            gate + o, up + o, Backward ? grad_out + o : nullptr, out + o, Backward ? grad_gate + o : nullptr,
            Backward ? grad_up + o : nullptr, inter, 1.0f, act.beta, act.linear_beta);
      }
    }
  });
}
#endif
}  // namespace

extern "C" {

// 1 if this build has the small-GEMM path (AVX-512), else 0.
int k3_moe_small_gemm_available() { return K3_HAVE_SMALL_GEMM; }

// Use the AVX-512 GLUs (1, the default where built) or the scalar forms (0); returns the previous setting (for
// tests: builds without AVX-512 always use the scalar forms).
int k3_moe_set_vector_glu(int enable) {
  const int previous = g_vector_glu;
  g_vector_glu = enable != 0 && K3_HAVE_SMALL_GEMM;
  return previous;
}

// The GLU of the dense MLP and the shared experts, act(gate, up) over [rows, I] (fp32, contiguous, separate gate
// and up tensors: their projections are separate layers), with the experts kernel's AVX-512 forms (the same
// values as the routed experts compute; a few ulp from torch's tanh and sigmoid). Forward (grad_out null): out =
// act. Backward: out = act as well, grad_gate = grad_out d act / d gate, grad_up = grad_out d act / d up.
// Rows split over the threads above 16K elements. Returns 0, 1 on invalid arguments or without AVX-512.
int k3_glu(const float* gate, const float* up, int64_t rows, int inter, int act_kind, float act_beta,
           float act_linear_beta, const float* grad_out, float* out, float* grad_gate, float* grad_up, int n_threads) {
#if K3_HAVE_SMALL_GEMM
  if (rows < 0 || inter <= 0 || n_threads <= 0 || (act_kind != 0 && !(act_kind == 1 && act_beta > 0.0f))) return 1;
  const Activation act{act_kind, act_beta, act_linear_beta};
  const int threads = rows * inter >= 16384 ? n_threads : 1;
  if (grad_out == nullptr)
    dense_glu<false>(gate, up, nullptr, out, nullptr, nullptr, rows, inter, act, threads);
  else
    dense_glu<true>(gate, up, grad_out, out, grad_gate, grad_up, rows, inter, act, threads);
  return 0;
#else
  (void)gate, (void)up, (void)rows, (void)inter, (void)act_kind, (void)act_beta, (void)act_linear_beta;
  (void)grad_out, (void)out, (void)grad_gate, (void)grad_up, (void)n_threads;
  return 1;
#endif
}

// `saved_h` (small-GEMM path; may be null): [N * k, 2I], receives the gate/up products in expert-sorted order
// for k3_moe_experts_backward. `weights_bf16`: gate_up and down hold bf16 (raw 16-bit) values, read exactly as
// fp32 (small-GEMM path only); x, the routing weights and the output are fp32 either way. Returns 0 on success, 1
// on invalid arguments, 2 if scratch memory could not be allocated.
int k3_moe_experts_forward(const float* x, int64_t n_tokens, int hidden, const int64_t* top_k_index,
                           const float* top_k_weights, int top_k, const void* gate_up_weights,
                           int gate_up_transposed, const void* down_weights, int down_transposed, int64_t n_experts,
                           int inter, int act_kind, float act_beta, float act_linear_beta, float* sorted, float* out,
                           int n_threads, int small, float* saved_h, int weights_bf16) {
  if (!valid(n_tokens, hidden, top_k, n_experts, inter, n_threads, act_kind, act_beta)) return 1;
  if (small && !K3_HAVE_SMALL_GEMM) return 1;
  if (weights_bf16 && !small) return 1;
  const int64_t gate_up_size = (int64_t)2 * inter * hidden, down_size = (int64_t)hidden * inter;
  const ExpertStack gate_up{const_cast<void*>(gate_up_weights), gate_up_size, weights_bf16 != 0};
  const ExpertStack down{const_cast<void*>(down_weights), down_size, weights_bf16 != 0};
  const Activation act{act_kind, act_beta, act_linear_beta};
  const int64_t n_assign = n_tokens * top_k;
#if K3_HAVE_SMALL_GEMM
  if (saved_h == nullptr && n_tokens <= kFewTokens && !gate_up_transposed && !down_transposed) {
    if (weights_bf16)
      return few_forward(x, n_tokens, hidden, top_k_index, top_k_weights, top_k,
                         static_cast<const uint16_t*>(gate_up_weights), static_cast<const uint16_t*>(down_weights),
                         n_experts, inter, act, out, n_threads);
    return few_forward(x, n_tokens, hidden, top_k_index, top_k_weights, top_k,
                       static_cast<const float*>(gate_up_weights), static_cast<const float*>(down_weights), n_experts,
                       inter, act, out, n_threads);
  }
#endif
  std::unique_ptr<k3::Sorted> sorted_ptr;
  std::vector<int64_t> tiles;  // start row (in sorted order) of each task; its expert in tile_expert
  std::vector<int64_t> tile_expert;
  try {
    sorted_ptr = std::make_unique<k3::Sorted>(top_k_index, n_assign, n_experts, !small);
#if K3_HAVE_SMALL_GEMM
    if (small)
      return small_forward(x, n_tokens, hidden, *sorted_ptr, top_k_weights, top_k, gate_up, gate_up_transposed,
                           down, down_transposed, n_experts, inter, act, sorted, out, saved_h, n_threads);
#endif
    for (int64_t e = 0; e < n_experts; ++e)
      for (int64_t start = sorted_ptr->offsets[e]; start < sorted_ptr->offsets[e + 1]; start += kTile) {
        tiles.push_back(start);
        tile_expert.push_back(e);
      }
  } catch (...) {
    return 2;
  }
  const k3::Sorted& routing = *sorted_ptr;
  const std::vector<int64_t>& offsets = routing.offsets;
  const std::vector<int64_t>& order = routing.order;
  const int64_t n_tiles = (int64_t)tiles.size();
  int status = 0;
#pragma omp parallel num_threads(n_threads)
  {
    const k3::FlushDenormals flush;
    const std::unique_ptr<Rows> scratch = k3::new_scratch<Rows>(status, hidden, inter, false);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_tiles; ++t) {
      if (scratch == nullptr) continue;
      Rows& s = *scratch;
      const int64_t e = tile_expert[t], start = tiles[t];
      const int rows = (int)std::min<int64_t>(kTile, offsets[e + 1] - start);
      gather_and_project(s, order.data() + start, rows, top_k, hidden, inter, x, top_k_weights, nullptr,
                         gate_up.f32(e), gate_up_transposed);
      apply_glu(s.h.data(), s.glu.data(), s.weight.data(), rows, inter, act);
      const float* wd = down.f32(e);
      float* y = sorted + start * hidden;
      if (down_transposed)
        gemm(false, false, rows, hidden, inter, 1.0f, s.glu.data(), inter, wd, hidden, 0.0f, y, hidden);
      else
        gemm(false, true, rows, hidden, inter, 1.0f, s.glu.data(), inter, wd, inter, 0.0f, y, hidden);
    }
    sum_slots(sorted, routing.position, n_tokens, top_k, hidden, out);
  }
  return status;
}

// Gradients of k3_moe_experts_forward's output, given grad_out [N, D]. Each output pointer may be null (that
// gradient is not needed). grad_gate_up / grad_down are written whole, in the weights' own layout (zero for
// experts no token chose); grad_x [N, D]; grad_weights [N, k] (0 for ids outside [0, E)); dx_rows [N * k, D]
// holds the per-assignment input gradients (expert-sorted) before each token's are summed. The gate/up products
// are read from `saved_h` where the forward saved them (small-GEMM path), else recomputed (one [rows, D] x
// [D, 2I] GEMM). One task per expert, so its weight gradients are accumulated by one thread, kTile rows at a
// time. `weights_bf16`: the weights and their gradients are bf16 (small-GEMM path only; see the forward), each
// expert's gradients summed in fp32 and rounded once.
int k3_moe_experts_backward(const float* x, int64_t n_tokens, int hidden, const int64_t* top_k_index,
                            const float* top_k_weights, int top_k, const void* gate_up_weights,
                            int gate_up_transposed, const void* down_weights, int down_transposed,
                            int64_t n_experts, int inter, int act_kind, float act_beta, float act_linear_beta,
                            const float* grad_out, float* grad_x, float* grad_weights, void* grad_gate_up_out,
                            void* grad_down_out, float* dx_rows, int n_threads, int small, const float* saved_h,
                            int weights_bf16) {
  if (!valid(n_tokens, hidden, top_k, n_experts, inter, n_threads, act_kind, act_beta)) return 1;
  if (small && !K3_HAVE_SMALL_GEMM) return 1;
  if (weights_bf16 && !small) return 1;
  const int64_t gate_up_size = (int64_t)2 * inter * hidden, down_size = (int64_t)hidden * inter;
  const bool bf16 = weights_bf16 != 0;
  const ExpertStack gate_up{const_cast<void*>(gate_up_weights), gate_up_size, bf16};
  const ExpertStack down{const_cast<void*>(down_weights), down_size, bf16};
  const ExpertStack grad_gate_up{grad_gate_up_out, gate_up_size, bf16}, grad_down{grad_down_out, down_size, bf16};
  const Activation act{act_kind, act_beta, act_linear_beta};
  const int64_t n_assign = n_tokens * top_k;
  std::unique_ptr<k3::Sorted> sorted_ptr;
  try {
    sorted_ptr = std::make_unique<k3::Sorted>(top_k_index, n_assign, n_experts, !small);
  } catch (...) {
    return 2;
  }
  const k3::Sorted& routing = *sorted_ptr;
  if (grad_weights != nullptr)
    for (int64_t a = 0; a < n_assign; ++a) grad_weights[a] = 0.0f;
#if K3_HAVE_SMALL_GEMM
  if (small)
    return small_backward(x, n_tokens, hidden, routing, top_k_weights, top_k, gate_up, gate_up_transposed, down,
                          down_transposed, n_experts, inter, act, grad_out, grad_x, grad_weights, grad_gate_up,
                          grad_down, dx_rows, saved_h, n_threads);
#endif
  const int two_i = 2 * inter;
  int status = 0;
#pragma omp parallel num_threads(n_threads)
  {
    const k3::FlushDenormals flush;
    const std::unique_ptr<Rows> scratch = k3::new_scratch<Rows>(status, hidden, inter, true);
#pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < n_experts; ++e) {
      if (scratch == nullptr) continue;
      Rows& s = *scratch;
      const ExpertSlices expert(e, routing, grad_gate_up, grad_down);
      if (!expert.chosen) continue;
      const float *wgu = gate_up.f32(e), *wd = down.f32(e);
      float *ggu = expert.grad_gate_up, *gd = expert.grad_down;
      const int64_t begin = routing.offsets[e], end = routing.offsets[e + 1];
      for (int64_t start = begin; start < end; start += kTile) {
        const int rows = (int)std::min<int64_t>(kTile, end - start);
        const float accumulate = start == begin ? 0.0f : 1.0f;
        gather_and_project(s, routing.order.data() + start, rows, top_k, hidden, inter, x, top_k_weights, grad_out,
                           wgu, gate_up_transposed);
        // d loss / d (weight * glu) = dY W_down (the down projection's input gradient)
        if (down_transposed)
          gemm(false, true, rows, inter, hidden, 1.0f, s.dy.data(), hidden, wd, hidden, 0.0f, s.dglu.data(), inter);
        else
          gemm(false, false, rows, inter, hidden, 1.0f, s.dy.data(), hidden, wd, inter, 0.0f, s.dglu.data(), inter);
        glu_backward(s.h.data(), s.dglu.data(), s.weight.data(), s.glu.data(), s.dh.data(), rows, inter, act);
        if (grad_weights != nullptr) weight_gradients(s, rows, inter, routing.order.data() + start, grad_weights);
        if (gd) {
          scale_rows(s, rows, inter);
          if (down_transposed)  // [I, D] += (w glu)^T dY
            gemm(true, false, inter, hidden, rows, 1.0f, s.glu.data(), inter, s.dy.data(), hidden, accumulate, gd,
                 hidden);
          else  // [D, I] += dY^T (w glu)
            gemm(true, false, hidden, inter, rows, 1.0f, s.dy.data(), hidden, s.glu.data(), inter, accumulate, gd,
                 inter);
        }
        if (ggu) {
          if (gate_up_transposed)  // [D, 2I] += X^T dH
            gemm(true, false, hidden, two_i, rows, 1.0f, s.x.data(), hidden, s.dh.data(), two_i, accumulate, ggu,
                 two_i);
          else  // [2I, D] += dH^T X
            gemm(true, false, two_i, hidden, rows, 1.0f, s.dh.data(), two_i, s.x.data(), hidden, accumulate, ggu,
                 hidden);
        }
        if (grad_x) {
          float* dx = dx_rows + start * hidden;
          if (gate_up_transposed)
            gemm(false, true, rows, hidden, two_i, 1.0f, s.dh.data(), two_i, wgu, two_i, 0.0f, dx, hidden);
          else
            gemm(false, false, rows, hidden, two_i, 1.0f, s.dh.data(), two_i, wgu, hidden, 0.0f, dx, hidden);
        }
      }
    }
    if (grad_x) sum_slots(dx_rows, routing.position, n_tokens, top_k, hidden, grad_x);
  }
  return status;
}

}  // extern "C"
