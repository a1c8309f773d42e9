// Top-k expert selection of the sigmoid router on CPU (spec 6.3, step 1): for each token, the k experts with the
// largest biased scores s[e] + bias[e] (s = sigmoid(logits); the sum is the same fp32 add as `scores + bias`, so
// the ranking is the PyTorch path's). torch.topk over [N, E] with E = 896 runs a general partial
// sort. Here, with AVX-512 and k <= 16, a first pass finds a floor that the k best must reach and a
// second keeps the k best in two registers, checking 16 experts per compare (see row_topk16); with AVX2 (or k > 16)
// the same two passes in 8-lane registers keep the k best in a small sorted array (row_topk_floor); without AVX2
// one pass over the experts keeps that array (a new candidate rarely beats the current k-th). k3_router_topk takes
// torch's scores; k3_router_sigmoid_topk computes them from the logits itself, as torch.sigmoid does, row by row
// in cache. k3_router_backward is the chosen scores' sparse backward.
//
// Order: descending by biased score; equal scores rank the lower expert id first; NaN ranks above every
// number (as in torch.topk). Layouts: scores [N, E] fp32 row-major, bias [E] fp32, out [N, k] int64.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "amx_tiles.h"
#include "bf16_rows.h"
#include "common.h"
#include "glu_simd.h"
#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
// torch's own vectorised exp on AVX-512 (Sleef, linked into libtorch_cpu): torch.sigmoid computes
// 1 / (1 + exp(-x)) with it, so the same three steps here give bitwise torch's scores. Weak: a torch build
// without the symbol leaves it null, and the fused sigmoid reports itself unavailable.
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
#elif K3_HAVE_SIMD
// the same on AVX2, where torch's vectorised loop runs 8 lanes at a time with Sleef's 8-lane exp
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));
#endif

namespace {

// a ranks above b (NaN above numbers; equal values: neither, so the earlier id keeps its place)
inline bool ranks_above(float a, float b) { return a > b || (std::isnan(a) && !std::isnan(b)); }

// A thread's working set for row_topk (k values and ids).
struct TopK {
  std::vector<float> val;
  std::vector<int64_t> idx;
  explicit TopK(int top_k) : val(top_k), idx(top_k) {}
};

// v (expert e) into the sorted working set val / idx of `filled` values: a set not full (filled < k) grows by
// one, a full one drops its last (the caller has checked that v ranks above it).
inline void insert_sorted(float v, int64_t e, int top_k, float* val, int64_t* idx, int& filled) {
  int pos = filled < top_k ? filled++ : top_k - 1;
  while (pos > 0 && ranks_above(v, val[pos - 1])) {
    val[pos] = val[pos - 1];
    idx[pos] = idx[pos - 1];
    --pos;
  }
  val[pos] = v;
  idx[pos] = e;
}

// The k best of one row into index[0 .. k), using val / idx (k each) as the sorted working set (builds without
// AVX2; the others take row_topk_floor or row_topk16, which give the same).
[[maybe_unused]] void row_topk(const float* scores, const float* bias, int64_t n_experts, int top_k, float* val,
                               int64_t* idx, int64_t* index) {
  int filled = 0;
  auto insert = [&](float v, int64_t e) { insert_sorted(v, e, top_k, val, idx, filled); };
  int64_t e = 0;
  for (; e < n_experts && filled < top_k; ++e) insert(scores[e] + bias[e], e);
  for (; e < n_experts; ++e) {
    const float v = scores[e] + bias[e];
    if (ranks_above(v, val[top_k - 1])) insert(v, e);
  }
  for (int j = 0; j < top_k; ++j) index[j] = idx[j];
}

#if K3_HAVE_SIMD
// The biased scores of experts [e, e + 16) as two 8-lane halves (past the row's end: -inf), and which are present.
inline unsigned chunk16(const float* scores, const float* bias, int64_t n_experts, int64_t e, __m256& lo, __m256& hi) {
  if (e + 16 <= n_experts) {
    lo = _mm256_add_ps(_mm256_loadu_ps(scores + e), _mm256_loadu_ps(bias + e));
    hi = _mm256_add_ps(_mm256_loadu_ps(scores + e + 8), _mm256_loadu_ps(bias + e + 8));
    return 0xFFFFu;
  }
  alignas(32) float v[16];
  for (int i = 0; i < 16; ++i) v[i] = e + i < n_experts ? scores[e + i] + bias[e + i] : -INFINITY;
  lo = _mm256_load_ps(v);
  hi = _mm256_load_ps(v + 8);
  return k3::lane_mask(n_experts - e);
}

// row_topk with row_topk16's two passes in 8-lane registers (AVX2; on AVX-512 builds for k > 16): a first pass
// keeps each of 16 lanes' two largest values (up to 32 distinct experts: for k <= 32 the k best of the row score at
// least the k-th largest of them, the floor; NaN lanes are skipped, as max / min return their second operand);
// the second compares 16 experts at a time with the floor (the set not yet full) or the current k-th and inserts
// only those that pass into the sorted array, in expert order. So the same k experts in the same order as
// row_topk, which looks at every expert one by one and branches on each, and is the slower for it.
void row_topk_floor(const float* scores, const float* bias, int64_t n_experts, int top_k, float* val, int64_t* idx,
                    int64_t* index) {
  __m256 lo, hi;
  float floor = -INFINITY;
  if (top_k <= 32) {
    const __m256 none = _mm256_set1_ps(-INFINITY);
    __m256 first_lo = none, first_hi = none, second_lo = none, second_hi = none;
    for (int64_t e = 0; e < n_experts; e += 16) {
      chunk16(scores, bias, n_experts, e, lo, hi);
      second_lo = _mm256_max_ps(_mm256_min_ps(first_lo, lo), second_lo);
      first_lo = _mm256_max_ps(lo, first_lo);
      second_hi = _mm256_max_ps(_mm256_min_ps(first_hi, hi), second_hi);
      first_hi = _mm256_max_ps(hi, first_hi);
    }
    alignas(32) float two[32];
    _mm256_store_ps(two, first_lo);
    _mm256_store_ps(two + 8, first_hi);
    _mm256_store_ps(two + 16, second_lo);
    _mm256_store_ps(two + 24, second_hi);
    std::nth_element(two, two + top_k - 1, two + 32, [](float a, float b) { return a > b; });  // (no NaN here)
    floor = two[top_k - 1];
  }
  int filled = 0;
  // lanes that may enter: until the set is full, at least the floor (or NaN); then above the k-th (or NaN)
  auto candidates = [&]() -> unsigned {
    if (filled < top_k) {
      const __m256 f = _mm256_set1_ps(floor);
      return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(lo, f, _CMP_NLT_UQ)) |
             (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(hi, f, _CMP_NLT_UQ)) << 8;
    }
    const __m256 kth = _mm256_set1_ps(val[top_k - 1]);
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(lo, kth, _CMP_NLE_UQ)) |
           (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(hi, kth, _CMP_NLE_UQ)) << 8;
  };
  for (int64_t e = 0; e < n_experts; e += 16) {
    const unsigned present = chunk16(scores, bias, n_experts, e, lo, hi);
    for (unsigned m = candidates() & present; m != 0; m &= candidates()) {
      const int lane = __builtin_ctz(m);
      const float v = scores[e + lane] + bias[e + lane];  // (the lane's value: the same fp32 sum)
      if (filled < top_k || ranks_above(v, val[top_k - 1])) insert_sorted(v, e + lane, top_k, val, idx, filled);
      m &= m - 1;  // (the lanes left are checked again against the new k-th)
    }
  }
  for (int j = 0; j < top_k; ++j) index[j] = idx[j];
}
#endif

#if defined(__AVX512F__)
// The same for top_k <= 16 with the working set in two registers (values, ids), so that an insertion is a few
// masked moves instead of a loop with an unpredictable exit, and 16 experts at a time are checked against the
// current k-th with one compare.
class Best16 {
 public:
  explicit Best16(int top_k) : top_k_(top_k), used_(k3::lane_mask(top_k)) {}

  // v (broadcast in vb) of expert e enters if the set is not full or it ranks above one of the k
  void insert(__m512 vb, int e) {
    __mmask16 above = ranks_above(vb, vals_) & (full() ? used_ : k3::lane_mask(filled_));
    if (!full()) above |= (__mmask16)(1u << filled_++);
    if (above == 0) return;
    // `above` is a run of lanes [p, end): lane p takes v, the lanes after it move one down
    const __mmask16 after = above & (__mmask16)(above - 1), at = above & (__mmask16)~after;
    const __m512i down = _mm512_set_epi32(14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0);
    vals_ = _mm512_mask_permutexvar_ps(vals_, after, down, vals_);
    ids_ = _mm512_mask_permutexvar_epi32(ids_, after, down, ids_);
    vals_ = _mm512_mask_mov_ps(vals_, at, vb);
    ids_ = _mm512_mask_mov_epi32(ids_, at, _mm512_set1_epi32(e));
  }

  bool full() const { return filled_ >= top_k_; }
  // the current k-th value (the set full)
  float kth_value() const { return _mm512_cvtss_f32(kth()); }
  // the current k-th value in every lane
  __m512 kth() const { return _mm512_permutexvar_ps(_mm512_set1_epi32(top_k_ - 1), vals_); }

  void store(int64_t* index) const {
    alignas(64) int32_t ids[16];
    _mm512_store_si512(ids, ids_);
    for (int j = 0; j < top_k_; ++j) index[j] = ids[j];
  }

  // lanes of `x` that a (broadcast) v ranks above: greater, or v NaN and the lane not
  static __mmask16 ranks_above(__m512 vb, __m512 x) {
    const __mmask16 greater = _mm512_cmp_ps_mask(vb, x, _CMP_GT_OQ);
    const __mmask16 v_nan = _mm512_cmp_ps_mask(vb, vb, _CMP_UNORD_Q);
    return greater | (v_nan & (__mmask16)~_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q));
  }

 private:
  int top_k_, filled_ = 0;
  __mmask16 used_;
  __m512 vals_ = _mm512_setzero_ps();
  __m512i ids_ = _mm512_setzero_si512();
};

// Biased scores of experts [e, e + 16) (lanes past the row's end: -inf, never candidates), and which are present.
inline __m512 chunk(const float* scores, const float* bias, int64_t n_experts, int64_t e, __mmask16& present) {
  present = k3::lane_mask(n_experts - e);
  const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(present, scores + e), _mm512_maskz_loadu_ps(present, bias + e));
  return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), present, v);
}

// Bitonic sorting network on the 16 lanes of a register (descending): stage (k, j) compares lanes i and i ^ j,
// and lane i keeps the larger value where ((i & k) == 0) == ((i & j) == 0), the smaller elsewhere (ascending
// runs for (i & k) != 0, so that each merge sees a bitonic sequence). Lanes hold no NaN here.
struct Stage {
  alignas(64) int32_t partner[16];
  uint16_t keep_max;
};

constexpr Stage stage(int k, int j) {
  Stage s{};
  for (int i = 0; i < 16; ++i) {
    s.partner[i] = i ^ j;
    if (((i & k) == 0) == ((i & j) == 0)) s.keep_max = (uint16_t)(s.keep_max | (1u << i));
  }
  return s;
}

template <int K, int J>
inline __m512 compare_exchange(__m512 v) {
  static constexpr Stage s = stage(K, J);
  const __m512 p = _mm512_permutexvar_ps(_mm512_load_si512(s.partner), v);
  return _mm512_mask_blend_ps((__mmask16)s.keep_max, _mm512_min_ps(v, p), _mm512_max_ps(v, p));
}

// the last merge (k = 16): a bitonic sequence sorted descending
inline __m512 merge_descending(__m512 v) {
  v = compare_exchange<16, 8>(v);
  v = compare_exchange<16, 4>(v);
  v = compare_exchange<16, 2>(v);
  return compare_exchange<16, 1>(v);
}

inline __m512 sort_descending(__m512 v) {
  v = compare_exchange<2, 1>(v);
  v = compare_exchange<4, 2>(v);
  v = compare_exchange<4, 1>(v);
  v = compare_exchange<8, 4>(v);
  v = compare_exchange<8, 2>(v);
  v = compare_exchange<8, 1>(v);
  return merge_descending(v);
}

// Each lane's two largest values so far (first >= second), after one more vector v (NaN lanes of v are skipped: max
// and min return their second operand when either is NaN); kth_largest_of_32 then takes a floor from them.
inline void keep_two_largest(__m512 v, __m512& first, __m512& second) {
  second = _mm512_max_ps(_mm512_min_ps(first, v), second);
  first = _mm512_max_ps(v, first);
}

// The k-th largest (k <= 16) of the 32 values in a and b: sorted descending and ascending, their lane-wise maximum
// holds the 16 largest as a bitonic sequence, which the last merge (k = 16) sorts.
inline float kth_largest_of_32(__m512 a, __m512 b, int k) {
  const __m512 reverse = _mm512_permutexvar_ps(_mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               sort_descending(b));
  const __m512 top = merge_descending(_mm512_max_ps(sort_descending(a), reverse));
  return _mm512_cvtss_f32(_mm512_permutexvar_ps(_mm512_set1_epi32(k - 1), top));
}

void row_topk16(const float* scores, const float* bias, int64_t n_experts, int top_k, int64_t* index) {
  // A first pass keeps each lane's two largest values over the row: these are up to 32 distinct experts, so the
  // k best of the row score at least the k-th largest of them (-inf where a lane has fewer than two experts:
  // then the floor is -inf and every expert is a candidate), and nothing below it needs looking at. On random
  // scores at 896 experts / k = 16 this leaves ~18 candidates for the second pass (~53 with the lanes' maxima
  // alone), which then inserts little beyond the k best themselves.
  __mmask16 present;
  __m512 first = _mm512_set1_ps(-INFINITY), second = first;
  for (int64_t e = 0; e < n_experts; e += 16) {
    keep_two_largest(chunk(scores, bias, n_experts, e, present), first, second);
  }
  const __m512 floor = _mm512_set1_ps(kth_largest_of_32(first, second, top_k));
  Best16 best(top_k);
  __m512 kth = floor;
  for (int64_t e = 0; e < n_experts; e += 16) {
    const __m512 v = chunk(scores, bias, n_experts, e, present);
    // candidates: until the set is full, at least the floor (or NaN); then above the k-th (or NaN): equal
    // values never displace an earlier expert
    auto candidates = [&]() {
      return best.full() ? _mm512_mask_cmp_ps_mask(present, v, kth, _CMP_NLE_UQ)
                         : _mm512_mask_cmp_ps_mask(present, v, floor, _CMP_NLT_UQ);
    };
    for (__mmask16 m = candidates(); m != 0; m &= candidates()) {
      const int lane = __builtin_ctz(m);
      best.insert(_mm512_permutexvar_ps(_mm512_set1_epi32(lane), v), (int)(e + lane));
      if (best.full()) kth = best.kth();
      m &= (__mmask16)(m - 1);  // (then the lanes left are checked again against the new k-th)
    }
  }
  best.store(index);
}
#endif

#if defined(__AVX512F__)
// scores[i] = sigmoid(logits[i]) for i < n, as torch.sigmoid's vectorised loop computes it (a partial last
// vector is loaded masked and stored masked).
void sigmoid_row(const float* logits, int64_t n, float* scores) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = k3::lane_mask(n - i);
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_maskz_loadu_ps(m, logits + i)));
    _mm512_mask_storeu_ps(scores + i, m, _mm512_div_ps(one, _mm512_add_ps(e, one)));
  }
}
#elif K3_HAVE_SIMD
// (whole vectors with plain loads and stores: on AMD's Zen cores a vmaskmov store is microcoded and several times
// slower)
void sigmoid_row(const float* logits, int64_t n, float* scores) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(logits + i)));
    _mm256_storeu_ps(scores + i, _mm256_div_ps(one, _mm256_add_ps(e, one)));
  }
  if (i < n) {
    const __m256i m = k3::simd::lanes8(k3::lane_mask(n - i) & 0xFFu);
    const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_maskload_ps(logits + i, m)));
    _mm256_maskstore_ps(scores + i, m, _mm256_div_ps(one, _mm256_add_ps(e, one)));
  }
}
#endif

// out = sum_j g[j] W[index[j]] over the k rows (fp32, j in order, from zero)
void weighted_sum(const float* weight, int hidden, const int64_t* index, const float* g, int top_k, float* out) {
#if defined(__AVX512F__)
  for (int i0 = 0; i0 < hidden; i0 += 64) {  // 64 columns at a time, their sums in four registers
    __mmask16 mask[4];
    __m512 acc[4];
    for (int q = 0; q < 4; ++q) {
      mask[q] = k3::lane_mask(hidden - i0 - 16 * q);
      acc[q] = _mm512_setzero_ps();
    }
    for (int j = 0; j < top_k; ++j) {
      const __m512 c = _mm512_set1_ps(g[j]);
      const float* w = weight + index[j] * hidden + i0;
      for (int q = 0; q < 4; ++q) acc[q] = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(mask[q], w + 16 * q), acc[q]);
    }
    for (int q = 0; q < 4; ++q) _mm512_mask_storeu_ps(out + i0 + 16 * q, mask[q], acc[q]);
  }
#else
  for (int i = 0; i < hidden; ++i) out[i] = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    const float c = g[j];
    const float* w = weight + index[j] * hidden;
#pragma omp simd
    for (int i = 0; i < hidden; ++i) out[i] += c * w[i];
  }
#endif
}

// out += c x over one row
inline void add_scaled(float* out, float c, const float* x, int hidden) {
#if defined(__AVX512F__)
  const __m512 cv = _mm512_set1_ps(c);
  for (int i = 0; i < hidden; i += 16) {
    const __mmask16 m = k3::lane_mask(hidden - i);
    _mm512_mask_storeu_ps(out + i, m,
                          _mm512_fmadd_ps(cv, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, out + i)));
  }
#else
#pragma omp simd
  for (int i = 0; i < hidden; ++i) out[i] += c * x[i];
#endif
}

bool fused_sigmoid_available() {
#if defined(__AVX512F__)
  return Sleef_expf16_u10 != nullptr;
#elif K3_HAVE_SIMD
  return Sleef_expf8_u10 != nullptr;
#else
  return false;
#endif
}


#if K3_HAVE_AVX512
// ---- The screened selection (k3_router_screened_topk) ----

// sigmoid(x) to within 1e-4 (absolute) for the screen's intervals, whose margin covers it: t = 2^(-|x| log2 e) from
// a degree-5 polynomial of the fractional power (relative error < 4e-6) and vscalef, 1 / (1 + t) from the reciprocal
// estimate alone (relative error < 2^-14); 1 / (1 + t) for x >= 0, t / (1 + t) below. (Finite x only.)
inline __m512 screen_sigmoid(__m512 x) {
  const __m512 y =
      _mm512_max_ps(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-1.44269504f)), _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.3333558e-3f);  // 2^f: Taylor coefficients of e^(f ln 2) to degree 5
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512 t = _mm512_scalef_ps(p, n);
  const __m512 inv = _mm512_rcp14_ps(_mm512_add_ps(t, _mm512_set1_ps(1.0f)));
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_mul_ps(inv, negative, t, inv);
}

// A row of fp32 values as bf16 bits (k3::simd::bf16_bits: as torch's .to(torch.bfloat16)) into dst, and the norms the
// screen's bound takes: |bf16(row)|, |row - bf16(row)| and |row|, from sums of squares in double (no underflow or
// overflow for any fp32 row; their rounding, < H 2^-53, and the result's rounding to fp32 are inside the 2^-20 it
// is scaled up by). A norm that is not finite (inf / NaN in the row) comes out as such.
inline void bf16_row_norms(const float* row, int hidden, uint16_t* dst, float& hat, float& res, float& full) {
  __m512d sh = _mm512_setzero_pd(), sr = sh, sx = sh;
  auto add_squares = [](__m256 v, __m512d acc) {
    const __m512d d = _mm512_cvtps_pd(v);
    return _mm512_fmadd_pd(d, d, acc);
  };
  for (int i = 0; i < hidden; i += 16) {
    const __mmask16 m = k3::lane_mask(hidden - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, row + i);
    const __m512i h = k3::simd::bf16_bits(v);
    _mm256_mask_storeu_epi16(dst + i, m, _mm512_cvtepi32_epi16(h));
    const __m512 vh = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)), d = _mm512_sub_ps(v, vh);  // (d exact)
    for (int half = 0; half < 2; ++half) {
      const auto part = [half](__m512 a) {
        return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), half));
      };
      sh = add_squares(part(vh), sh);
      sr = add_squares(part(d), sr);
      sx = add_squares(part(v), sx);
    }
  }
  const double scale = 1.0 + std::ldexp(1.0, -20);
  hat = (float)(std::sqrt(_mm512_reduce_add_pd(sh)) * scale);
  res = (float)(std::sqrt(_mm512_reduce_add_pd(sr)) * scale);
  full = (float)(std::sqrt(_mm512_reduce_add_pd(sx)) * scale);
}

// The exact logits of the experts ids[0 .. cnt) (cnt <= G <= 16): the dot products of x with G of w's rows (lanes
// past cnt repeat the last row, not stored), one accumulator each over the row's 16-lane chunks, in order, then
// bf16_rows::sum_lanes16's fixed tree (the accumulators past G zero: its lane q reads only accumulator q). So a
// logit's bits depend neither on G nor on which other experts are computed with it.
template <int G>
inline void exact_group(const float* x, const float* w, int hidden, const int32_t* ids, int cnt, float* out) {
  __m512 acc[16];
  const float* rows[G];
  for (int q = 0; q < 16; ++q) acc[q] = _mm512_setzero_ps();
  for (int q = 0; q < G; ++q) rows[q] = w + (int64_t)ids[std::min(q, cnt - 1)] * hidden;
  for (int i = 0; i < hidden; i += 16) {
    const __mmask16 m = k3::lane_mask(hidden - i);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
    for (int q = 0; q < G; ++q) acc[q] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, rows[q] + i), acc[q]);
  }
  _mm512_mask_storeu_ps(out, k3::lane_mask(cnt), k3::bf16_rows::sum_lanes16(acc));
}

// One row's exact logits for the experts ids[0 .. n): 16 at a time, a last group of up to 12 as 8 and 4 (a row's
// candidates are ~k + 6: a 16-wide tail would read mostly repeated rows).
void exact_logits(const float* x, const float* w, int hidden, const int32_t* ids, int n, float* out) {
  for (int j0 = 0; j0 < n;) {
    const int left = n - j0, width = left > 12 ? 16 : left > 4 ? 8 : 4, cnt = std::min(width, left);
    if (width == 16)
      exact_group<16>(x, w, hidden, ids + j0, cnt, out + j0);
    else if (width == 8)
      exact_group<8>(x, w, hidden, ids + j0, cnt, out + j0);
    else
      exact_group<4>(x, w, hidden, ids + j0, cnt, out + j0);
    j0 += cnt;
  }
}

// The experts' side of the screen, per call: bound factors, bias, margin and ceiling = bias + margin rounded up.
struct ScreenExperts {
  int64_t n;
  const float *w_res, *w_hat, *bias, *margin, *ceiling;
};

// A row's scratch: up / down (n each), near / ids (n + 16 each: whole vectors are stored past the count).
struct ScreenScratch {
  float *up, *down;
  int32_t *near, *ids;
};

// The lower end of the biased score of experts id (present lanes; -inf elsewhere): s~(down) + bias - margin.
inline __m512 lower_end(const ScreenExperts& ex, const float* down, __mmask16 present, __m512i id) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512 d = _mm512_mask_i32gather_ps(zero, present, id, down, 4);
  const __m512 b = _mm512_mask_i32gather_ps(zero, present, id, ex.bias, 4);
  const __m512 m = _mm512_mask_i32gather_ps(zero, present, id, ex.margin, 4);
  const __m512 v = _mm512_sub_ps(_mm512_add_ps(screen_sigmoid(d), b), m);
  return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), present, v);
}

// x rounded down to fp32
inline float float_below(double x) {
  const float f = (float)x;
  return (double)f > x ? std::nextafter(f, -INFINITY) : f;
}

// One row's candidates (see "The screened selection" below: passes A and B) into sc.ids, in expert order; returns
// their count.
// approx: the row's approximate logits; the bound of expert e is p w_res[e] + q w_hat[e] + c.
int screen_row(const float* approx, float p_row, float q_row, float c_row, const ScreenExperts& ex, int top_k,
               const ScreenScratch& sc) {
  const int64_t n_experts = ex.n;
  const __m512 p = _mm512_set1_ps(p_row), q = _mm512_set1_ps(q_row), c = _mm512_set1_ps(c_row);
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 none = _mm512_set1_ps(-INFINITY), kw = _mm512_set1_ps(4.0f);
  // pass A: each expert's logit interval [down, up] (rounded outwards), and each lane's two best experts by the
  // key down + 4 bias
  __m512 key1 = none, key2 = none;
  __m512i id1 = _mm512_setzero_si512(), id2 = id1;
  for (int64_t e = 0; e < n_experts; e += 16) {
    const __mmask16 m = k3::lane_mask(n_experts - e);
    const __m512 l = _mm512_maskz_loadu_ps(m, approx + e);
    const __m512 bound = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(m, ex.w_res + e),
                                         _mm512_fmadd_ps(q, _mm512_maskz_loadu_ps(m, ex.w_hat + e), c));
    const __m512 u = _mm512_add_round_ps(l, bound, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
    const __m512 d = _mm512_sub_round_ps(l, bound, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    _mm512_mask_storeu_ps(sc.up + e, m, u);
    _mm512_mask_storeu_ps(sc.down + e, m, d);
    const __m512 key = _mm512_mask_mov_ps(none, m, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, ex.bias + e), kw, d));
    const __m512i id = _mm512_add_epi32(_mm512_set1_epi32((int)e), lanes);
    const __mmask16 above2 = _mm512_cmp_ps_mask(key, key2, _CMP_GT_OQ);
    const __mmask16 above1 = _mm512_cmp_ps_mask(key, key1, _CMP_GT_OQ);  // (within above2)
    key2 = _mm512_mask_mov_ps(_mm512_mask_mov_ps(key2, above2, key), above1, key1);
    id2 = _mm512_mask_mov_epi32(_mm512_mask_mov_epi32(id2, above2, id), above1, id1);
    key1 = _mm512_mask_mov_ps(key1, above1, key);
    id1 = _mm512_mask_mov_epi32(id1, above1, id);
  }
  // a first floor: the k-th largest lower end of those (up to 32 distinct) experts
  const __mmask16 present1 = _mm512_cmp_ps_mask(key1, none, _CMP_GT_OQ);
  const __mmask16 present2 = _mm512_cmp_ps_mask(key2, none, _CMP_GT_OQ);
  const float floor1 = kth_largest_of_32(lower_end(ex, sc.down, present1, id1), lower_end(ex, sc.down, present2, id2),
                                         top_k);
  // pass B: the near experts' ids into sc.near, in order (no branch: each vector's compressed, stored whole). An
  // expert is out if y = floor1 - ceiling and t' <= e^-up have y (1 + t') > 1 (see "The screened selection").
  const __m512 fv1 = _mm512_set1_ps(floor1);
  int n_near = 0;
  for (int64_t e = 0; e < n_experts; e += 16) {
    const __mmask16 m = k3::lane_mask(n_experts - e);
    const __m512 u = _mm512_maskz_loadu_ps(m, sc.up + e);
    // 2^x, x = -up log2 e (up clamped to [-69, 69]), as the bits (x + 127) 2^23: the linear interpolation of 2^x
    // between integers, within [1, 1.0615] of it
    const __m512 z = _mm512_fmadd_ps(_mm512_min_ps(_mm512_max_ps(u, _mm512_set1_ps(-69.0f)), _mm512_set1_ps(69.0f)),
                                     _mm512_set1_ps(-1.44269504f * 8388608.0f), _mm512_set1_ps(127.0f * 8388608.0f));
    const __m512 t = _mm512_castsi512_ps(_mm512_cvtps_epi32(z));
    const __m512 y = _mm512_sub_ps(fv1, _mm512_maskz_loadu_ps(m, ex.ceiling + e));
    const __m512 w = _mm512_mul_ps(y, _mm512_fmadd_ps(t, _mm512_set1_ps(1.0f / 1.0625f), _mm512_set1_ps(1.0f)));
    const __mmask16 near = _mm512_mask_cmp_ps_mask(m, w, _mm512_set1_ps(1.0f + 0x1p-20f), _CMP_NGT_UQ);
    _mm512_storeu_si512(sc.near + n_near,
                        _mm512_maskz_compress_epi32(near, _mm512_add_epi32(_mm512_set1_epi32((int)e), lanes)));
    n_near += __builtin_popcount(near);
  }
  // the floor: also the k-th largest lower end of the near experts (distinct); then the candidates: the near
  // experts whose upper end s~(up) + ceiling reaches it (in order)
  __m512 first = none, second = none;
  for (int j = 0; j < n_near; j += 16) {
    const __mmask16 m = k3::lane_mask(n_near - j);
    keep_two_largest(lower_end(ex, sc.down, m, _mm512_maskz_loadu_epi32(m, sc.near + j)), first, second);
  }
  const __m512 fv = _mm512_set1_ps(std::max(floor1, kth_largest_of_32(first, second, top_k)));
  int n_cand = 0;
  for (int j = 0; j < n_near; j += 16) {
    const __mmask16 m = k3::lane_mask(n_near - j);
    const __m512i id = _mm512_maskz_loadu_epi32(m, sc.near + j);
    const __m512 u = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, id, sc.up, 4);
    const __m512 ceiling = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, id, ex.ceiling, 4);
    const __m512 hi = _mm512_add_ps(screen_sigmoid(u), ceiling);
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(m, hi, fv, _CMP_GE_OQ);
    _mm512_storeu_si512(sc.ids + n_cand, _mm512_maskz_compress_epi32(keep, id));
    n_cand += __builtin_popcount(keep);
  }
  return n_cand;
}

// One row the direct way (a row whose bound is not finite: inf / NaN inputs, or products near fp32's range):
// every exact logit, then k3_router_sigmoid_topk's selection on them.
void exact_row(const float* x, const float* w, int hidden, int64_t n_experts, const float* bias, int top_k,
               int32_t* ids, float* logits, float* scores, int64_t* index, float* selected) {
  for (int64_t e = 0; e < n_experts; ++e) ids[e] = (int32_t)e;
  exact_logits(x, w, hidden, ids, (int)n_experts, logits);
  sigmoid_row(logits, n_experts, scores);
  row_topk16(scores, bias, n_experts, top_k, index);
  for (int j = 0; j < top_k; ++j) selected[j] = scores[index[j]];
}
#endif

}  // namespace

extern "C" {

// 1 if k3_router_sigmoid_topk and k3_sigmoid can run in this build (AVX-512 or AVX2, and torch's Sleef exp), else 0.
int k3_router_sigmoid_available() { return fused_sigmoid_available() ? 1 : 0; }

// y = sigmoid(x) over n floats, computed as k3_router_sigmoid_topk does (for checking it against torch.sigmoid).
// Returns 0, or 3 where unavailable.
int k3_sigmoid(const float* x, float* y, int64_t n) {
#if K3_HAVE_SIMD
  if (!fused_sigmoid_available()) return 3;
  sigmoid_row(x, n, y);
  return 0;
#else
  (void)x, (void)y, (void)n;
  return 3;
#endif
}

// The router's selection from its logits in one pass per row: scores = sigmoid(logits) (bitwise torch.sigmoid's
// vectorised values), the k experts with the largest scores + bias as k3_router_topk ranks them, and their
// (unbiased) scores: out_index [N, k] int64 and out_scores [N, k] fp32. The [N, E] scores are never written out:
// each row's stay in cache between the sigmoid and the selection. Returns 0, 1 on invalid arguments, 2 if scratch
// could not be allocated, 3 where unavailable (no AVX-512 or AVX2, no Sleef exp in this torch, or k > 16). The
// selection is row_topk16's on AVX-512, row_topk's (the same ranking) on AVX2.
int k3_router_sigmoid_topk(const float* logits, const float* bias, int64_t n_tokens, int64_t n_experts, int top_k,
                           int64_t* out_index, float* out_scores, int n_threads) {
  if (n_tokens < 0 || top_k < 1 || top_k > n_experts || n_threads < 1) return 1;
#if K3_HAVE_SIMD
  if (!fused_sigmoid_available() || top_k > 16 || n_experts >= ((int64_t)1 << 31)) return 3;
  int status = 0;
#pragma omp parallel num_threads(n_threads)
  {
    const std::unique_ptr<k3::aligned_vector<float>> row =
        k3::new_scratch<k3::aligned_vector<float>>(status, n_experts);
#if !defined(__AVX512F__)
    const std::unique_ptr<TopK> best = k3::new_scratch<TopK>(status, top_k);
#endif
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_tokens; ++t) {
      if (row == nullptr) continue;
      float* scores = row->data();
      sigmoid_row(logits + t * n_experts, n_experts, scores);
      int64_t* index = out_index + t * top_k;
#if defined(__AVX512F__)
      row_topk16(scores, bias, n_experts, top_k, index);
#else
      if (best == nullptr) continue;
      row_topk_floor(scores, bias, n_experts, top_k, best->val.data(), best->idx.data(), index);
#endif
      for (int j = 0; j < top_k; ++j) out_scores[t * top_k + j] = scores[index[j]];
    }
  }
  return status;
#else
  (void)logits, (void)bias, (void)out_index, (void)out_scores;
  return 3;
#endif
}

// Returns 0 on success, 1 on invalid arguments (top_k outside [1, E]), 2 if scratch could not be allocated.
int k3_router_topk(const float* scores, const float* bias, int64_t n_tokens, int64_t n_experts, int top_k,
                   int64_t* out_index, int n_threads) {
  if (n_tokens < 0 || top_k < 1 || top_k > n_experts || n_threads < 1) return 1;
  int status = 0;
#pragma omp parallel num_threads(n_threads)
  {
    const std::unique_ptr<TopK> scratch = k3::new_scratch<TopK>(status, top_k);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_tokens; ++t) {
      if (scratch == nullptr) continue;
#if defined(__AVX512F__)
      if (top_k <= 16 && n_experts < ((int64_t)1 << 31)) {
        row_topk16(scores + t * n_experts, bias, n_experts, top_k, out_index + t * top_k);
        continue;
      }
#endif
#if K3_HAVE_SIMD
      row_topk_floor(scores + t * n_experts, bias, n_experts, top_k, scratch->val.data(), scratch->idx.data(),
                     out_index + t * top_k);
#else
      row_topk(scores + t * n_experts, bias, n_experts, top_k, scratch->val.data(), scratch->idx.data(),
               out_index + t * top_k);
#endif
    }
  }
  return status;
}

// Backward of the selected routing scores s[n, j] = sigmoid(h[n] . W[index[n, j]]) (the router's top-k weights
// before normalisation), given grad_sel = d loss / d s [N, k] and the scores [N, k] themselves. Only N k logits
// have a gradient, so instead of the dense [N, E] x [E, H] and [E, N] x [N, H] products of autograd:
//   g[n, j] = grad_sel[n, j] s (1 - s);  grad_h[n] = sum_j g[n, j] W[index[n, j]];  grad_W[e] = sum of g h[n]
// over the (n, j) that chose e. grad_h: token by token, the k rows summed in registers. grad_W: each thread owns
// a range of experts, zeroes their rows (experts no token chose keep zeros) and walks all tokens in order,
// adding g h[n] into the rows it owns: each h row is read once per thread, in order, and the gradient rows stay
// in cache (reading h rows expert by expert was bound by fetching them); every expert's sum is in token order,
// so the result does not depend on the thread count. Either output may be null (not needed).
// Returns 0, 1 on invalid arguments (an index outside [0, E)), 2 if scratch could not be allocated.
int k3_router_backward(const float* h, int64_t n_tokens, int hidden, const float* weight, int64_t n_experts,
                       const int64_t* index, int top_k, const float* selected, const float* grad_sel, float* grad_h,
                       float* grad_weight, int n_threads) {
  if (n_tokens < 0 || hidden < 1 || top_k < 1 || n_experts < 1 || n_threads < 1) return 1;
  const int64_t n_assign = n_tokens * top_k;
  for (int64_t a = 0; a < n_assign; ++a)
    if (index[a] < 0 || index[a] >= n_experts) return 1;
  std::vector<float> g;
  try {
    g.resize(n_assign);
  } catch (...) {
    return 2;
  }
  for (int64_t a = 0; a < n_assign; ++a) g[a] = grad_sel[a] * selected[a] * (1.0f - selected[a]);
#pragma omp parallel num_threads(n_threads)
  {
    if (grad_h != nullptr) {
#pragma omp for schedule(static)
      for (int64_t n = 0; n < n_tokens; ++n)
        weighted_sum(weight, hidden, index + n * top_k, g.data() + n * top_k, top_k, grad_h + n * hidden);
    }
    if (grad_weight != nullptr) {
      const int team = omp_get_num_threads(), me = omp_get_thread_num();
      const int64_t lo = n_experts * me / team, hi = n_experts * (me + 1) / team;
      std::fill(grad_weight + lo * hidden, grad_weight + hi * hidden, 0.0f);
      for (int64_t a = 0; a < n_assign; ++a) {
        const int64_t e = index[a];
        if (e >= lo && e < hi) add_scaled(grad_weight + e * hidden, g[a], h + (a / top_k) * hidden, hidden);
      }
    }
  }
  return 0;
}


// ---- The screened selection: the router's fp32 logits without the full fp32 GEMM ----
//
// An fp32 model's router multiplies [N, H] by [H, E] in fp32 only to keep, per token, k of E experts and their k
// scores. Here the tile unit computes every logit approximately from bf16-rounded operands, several times faster
// than the fp32 GEMM, with a rigorous per-(token, expert) bound B on its distance from the fp32 logit. Per token,
// an expert can be among the k best only if the upper end of its biased-score interval reaches a floor under the
// k-th largest lower end (of distinct experts), which leaves a few more than k candidates; only their logits are
// computed in fp32 (dot products in a fixed order) and the k best of those exact scores are chosen, ranked as
// k3_router_sigmoid_topk ranks them. So the result is the selection and the scores of fp32 logits, by
// construction, not by tolerance.
//
// The bound, for x^ = bf16(x), w^ = bf16(w) (rounded to nearest), r_x = x - x^, r_w = w - w^:
//   |x^.w^ - x.w| <= |x^.r_w| + |r_x.w| <= |x^| |r_w| + |r_x| (|w^| + |r_w|)         (Cauchy-Schwarz)
// plus each fp32 sum's rounding (the tile unit's of the exact bf16 products, ours of the fp32 products), at most
// g = (H + 2) 2^-24 times the sum of the absolute products, itself <= |x^| |w^| and |x| |w| respectively:
//   B = rw (|x^| + |r_x| + g |x|) + |w^| (|r_x| + g (|x^| + |x|)),  rw = |r_w|, scaled by 1 + 2^-16,
// plus 2^-126 per product for the tile unit's subnormals (read as zero, results flushed). The norms (x's and w's
// rows) are summed in double and rounded up (bf16_row_norms). So the fp32 logit l is in [l~ - B, l~ + B], and in
// [down, up], their ends rounded outwards (AVX-512's per-instruction rounding; were flush-to-zero on, a flushed end
// would move by < 2^-126, inside the margin below).
//
// Scores. The key that ranks expert e is K = fl(S + b), S the fp32 sigmoid of l (Sleef's exp within 1 ulp, then
// two roundings): |K - (s(l) + b)| <= eps = 2^-21 + 2^-24 (1 + |b|). screen_sigmoid (s~) is within 1e-4 of s. The
// margin m = 4e-4 (1 + |b|) exceeds 1e-4 + eps + the fp32 roundings of the ends below (each < 2^-23 (2 + |b| + m)),
// so with s monotone and d <= l <= u:
//   lower end  s~(down) + b - m  <=  s(l) + b - eps  <=  K  <=  s(l) + b + eps  <=  s~(up) + c,  upper end,
// c = b + m rounded up (the ceiling). A floor F: the k-th largest lower end over a set of distinct experts (-inf
// where it has fewer than k): k experts have K >= F, so one with K < F has k experts strictly above it and is not
// among the k best, and each of the k best has K >= F. The candidates are the experts whose upper end is >= F
// (ties kept), in expert order: a superset of the k best, which Best16 then picks as k3_router_sigmoid_topk would
// (equal keys: the lower id first).
//
// Per row (screen_row), so that most experts cost a few instructions:
//   pass A: B, up and down of every expert (stored), and each lane's two best experts (ids) by the key
//     down + 4 b (any key is correct: it only picks the experts of the first floor; the slope of s is <= 1/4);
//     F1 = the k-th largest lower end of those <= 32 distinct experts (their down, b and m gathered).
//   pass B: an expert is near unless a cheap test proves s(up) < y = F1 - c, hence K < F1. t: the bits of
//     (x + 127) 2^23 as an integer, x = -up log2 e (up clamped to [-69, 69]), are 2^floor(x) (1 + frac(x)): within
//     [1, 2 / (e ln 2) = 1.0615] of 2^x (the fma's and the constants' roundings move x by < 2e-5); t' = t / 1.0625
//     <= 0.99907 e^-up (up <= 69; above it t' < 2^-99 vanishes in 1 + t'). Out if fl(fl(y) fl(1 + t')) > 1 + 2^-20:
//     then y (1 + e^-up) > 1 (three roundings of 2^-24 each), i.e. s(up) < y (for up > 69: y > 1 > s(up)). NaN or
//     F1 = -inf: near. The near ids are compressed into a list (no branch).
//   F = max(F1, F2), F2 the k-th largest lower end of the near experts (distinct; every expert with K >= F1 is
//     near, so F2 >= F1 where it counts); the candidates: the near experts with s~(up) + c >= F.
// Rows whose bound is not finite (inf / NaN in x, products near fp32's range) take every logit exactly.

// x [N, H] fp32, w [E, H] fp32, bias [E] fp32 -> out_index [N, k] int64 and out_scores [N, k] fp32: as
// k3_router_sigmoid_topk on the fp32 logits x w^T (see above). The weight's bf16 tiles and norms are made here, on
// every call (a few percent of the call: a cache keyed on the tensor would miss in-place changes through .data,
// which bump no version counter). `screen` 0 computes every row the direct way (for tests). Returns 0, 1 on invalid
// arguments, 2 if scratch could not be allocated, 3 where unavailable (no AMX / AVX-512 / Sleef exp, k > 16, or H
// odd), 4 if w or the bias has a value that is not finite (then the caller's GEMM path ranks it as torch does).
int k3_router_screened_topk(const float* x, int64_t n_tokens, int hidden, const float* w, int64_t n_experts,
                            const float* bias, int top_k, int screen, int64_t* out_index, float* out_scores,
                            int n_threads) {
  if (n_tokens < 0 || hidden < 1 || top_k < 1 || top_k > n_experts || n_threads < 1) return 1;
#if K3_HAVE_AVX512
  if (!k3::amx::available() || !fused_sigmoid_available() || top_k > 16 || hidden % 2 != 0 ||
      n_experts >= ((int64_t)1 << 30))
    return 3;
  const int64_t lda = (hidden + 31) / 32 * 32, ldo = (n_experts + 31) / 32 * 32;
  const int64_t n_blocks = (n_tokens + 31) / 32;
  const double g = (hidden + 2) * std::ldexp(1.0, -24);
  std::vector<float> margin, ceiling, w_hat, w_res;
  k3::aligned_vector<uint16_t> wb, packed;
  try {
    margin.resize(n_experts);
    ceiling.resize(n_experts);
    w_hat.resize(n_experts);
    w_res.resize(n_experts);
    if (screen) {
      wb.resize((size_t)(n_experts * hidden));
      packed.resize((size_t)k3::amx::packed_elements(n_experts, hidden));
    }
  } catch (...) {
    return 2;
  }
  ScreenExperts ex{n_experts, w_res.data(), w_hat.data(), bias, margin.data(), ceiling.data()};
  for (int64_t e = 0; e < n_experts; ++e) {
    if (!std::isfinite(bias[e])) return 4;
    margin[e] = 4e-4f * (1.0f + std::fabs(bias[e]));
    ceiling[e] = -float_below(-((double)bias[e] + (double)margin[e]));  // (rounded up)
  }
  bool w_finite = true;
  if (screen) {  // w in bf16 and its norms, then its tiles
#pragma omp parallel for num_threads(n_threads) schedule(static) reduction(&& : w_finite)
    for (int64_t e = 0; e < n_experts; ++e) {
      float full;
      bf16_row_norms(w + e * hidden, hidden, wb.data() + e * hidden, w_hat[e], w_res[e], full);
      w_finite = w_finite && std::isfinite(full);
    }
    if (!w_finite) return 4;
#pragma omp parallel num_threads(n_threads)
    k3::amx::pack(wb.data(), n_experts, hidden, packed.data());  // (its work-sharing loop splits the tiles)
  }
  float max_w = 0.0f;
  for (int64_t e = 0; e < n_experts; ++e) max_w = std::max(max_w, w_hat[e] + w_res[e]);
  struct Scratch {
    k3::aligned_vector<uint16_t> a;
    k3::aligned_vector<float> approx, up, down, logits, scores;
    std::vector<int32_t> near, ids;
    Scratch(int64_t lda, int64_t ldo, int64_t n_experts)
        : a(32 * lda), approx(32 * ldo), up(n_experts), down(n_experts), logits(n_experts), scores(n_experts),
          near(n_experts + 16), ids(n_experts + 16) {}
  };
  int status = 0;
#pragma omp parallel num_threads(n_threads)
  {
    const std::unique_ptr<Scratch> s = k3::new_scratch<Scratch>(status, lda, ldo, n_experts);
    if (s != nullptr && screen) k3::amx::begin();
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < n_blocks; ++blk) {
      if (s == nullptr) continue;
      const int64_t t0 = blk * 32;
      const int rows = (int)std::min<int64_t>(32, n_tokens - t0);
      float p_row[32], q_row[32], c_row[32];
      bool direct[32];
      for (int r = 0; r < 32; ++r) {  // the block's rows in bf16 (zero-padded), and each row's bound factors
        uint16_t* dst = s->a.data() + r * lda;
        std::memset(dst, 0, sizeof(uint16_t) * lda);
        direct[r] = !screen;
        if (r >= rows || !screen) continue;
        float hat, res, full;
        bf16_row_norms(x + (t0 + r) * hidden, hidden, dst, hat, res, full);
        const double nh = hat, nr = res, nx = full;
        const double scale = 1.0 + std::ldexp(1.0, -16);
        p_row[r] = (float)((nh + nr + g * nx) * scale * (1.0 + 1e-6));
        q_row[r] = (float)((nr + g * (nh + nx)) * scale * (1.0 + 1e-6));
        // the tile unit's subnormal inputs (read as zero) and results (flushed): a flushed x^_i (|x^_i| < 2^-126)
        // moves its product by < 2^-126 |w^_i|, a flushed w^_i by < 2^-126 |x^_i|, so the inputs move the sum by
        // < 2^-126 sum_i (|x^_i| + |w^_i|) <= 2^-126 sqrt(H) (|x^| + |w^|) (Cauchy-Schwarz; 2e-38 > 2^-126); each
        // flushed partial sum by < 2^-126, at most H of them, inside the 1e-30
        c_row[r] = (float)(1e-30 + 2e-38 * std::sqrt((double)hidden) * (nh + max_w));
        // (NaN norms fail the test too)
        direct[r] = !(nx * max_w < 1e30 && std::isfinite(p_row[r]) && std::isfinite(q_row[r]));
      }
      if (screen) k3::amx::block(s->a.data(), lda, packed.data(), n_experts, hidden, s->approx.data(), ldo);
      for (int r = 0; r < rows; ++r) {
        const int64_t t = t0 + r;
        const float* xr = x + t * hidden;
        int64_t* index = out_index + t * top_k;
        float* selected = out_scores + t * top_k;
        if (direct[r]) {
          exact_row(xr, w, hidden, n_experts, bias, top_k, s->ids.data(), s->logits.data(), s->scores.data(), index,
                    selected);
          continue;
        }
        const float* approx = s->approx.data() + r * ldo;
        const int n_cand = screen_row(approx, p_row[r], q_row[r], c_row[r], ex, top_k,
                                      {s->up.data(), s->down.data(), s->near.data(), s->ids.data()});
        if (n_cand < top_k) {  // (cannot happen: the k experts that set the floor are candidates)
          exact_row(xr, w, hidden, n_experts, bias, top_k, s->ids.data(), s->logits.data(), s->scores.data(), index,
                    selected);
          continue;
        }
        exact_logits(xr, w, hidden, s->ids.data(), n_cand, s->logits.data());
        sigmoid_row(s->logits.data(), n_cand, s->scores.data());
        Best16 best(top_k);  // the k best exact biased scores, in expert order (ties keep the lower id)
        for (int c = 0; c < n_cand; ++c) {
          const float key = s->scores[c] + bias[s->ids[c]];
          if (!best.full() || key > best.kth_value()) best.insert(_mm512_set1_ps(key), c);
        }
        best.store(index);  // positions among the candidates
        for (int j = 0; j < top_k; ++j) {
          selected[j] = s->scores[index[j]];
          index[j] = s->ids[index[j]];
        }
      }
    }
    if (s != nullptr && screen) k3::amx::end();
  }
  return status;
#else
  (void)x, (void)w, (void)bias, (void)screen, (void)out_index, (void)out_scores;
  return 3;
#endif
}

}  // extern "C"
