// The experts kernel's GLUs (SiTU at K3's beta = 4, SiTU at any beta, SiLU) written with AVX-512 intrinsics:
// moe_cpu.cpp's scalar forms, which the compiler vectorises, stay for builds without AVX-512. Per 16 channels:
// * exponentials only of non-positive arguments, e^{-y} (y >= 0): Cephes' polynomial on the reduced argument
//   and 2^n by vscalef, which gives 0 below the range with no clamps or selects (~10 ops instead of ~18);
// * every quotient has a denominator in [1, 8], so a reciprocal estimate and one Newton step (~2 ulp) replace
//   the division (measured: a division cost about two thirds of an exponential);
// * tanh of the up half at K3's cap (25) is its polynomial for |u| < 15.6, where almost every activation lies:
//   the exponential runs only for a vector with a lane beyond that.
// Same values as the scalar forms to a few ulp (tested against float64 in test_cpu_kernels.py).
#pragma once

#include <type_traits>

#include "common.h"
#include "small_gemm.h"  // K3_HAVE_SMALL_GEMM: AVX-512

#if K3_HAVE_SMALL_GEMM
#include <immintrin.h>

namespace k3 {
namespace glu {

inline __m512 splat(float x) { return _mm512_set1_ps(x); }

// e^{-y} for y >= 0 (NaN stays NaN): 0 where it would be subnormal
inline __m512 exp_neg(__m512 y) {
  const __m512 x = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_min_ps(splat(104.0f), y));  // (min keeps a NaN y)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, splat(cephes::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, splat(cephes::kLn2Hi), x);
  r = _mm512_fmadd_ps(n, splat(cephes::kLn2Lo), r);
  __m512 p = splat(cephes::kExp[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, splat(cephes::kExp[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, splat(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// 1 / d for d in [1, 8]
inline __m512 reciprocal(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, splat(1.0f)), r);
}

// tanh(x) for |x| < 0.625 (the odd polynomial of fast_tanh)
inline __m512 tanh_polynomial(__m512 x) {
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 p = splat(cephes::kTanh[0]);
  for (int i = 1; i < 5; ++i) p = _mm512_fmadd_ps(p, z, splat(cephes::kTanh[i]));
  return _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
}

// |m| with the sign of x
inline __m512 with_sign(__m512 m, __m512 x) {
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(m), _mm512_castps_si512(x),
                                                       _mm512_set1_epi32((int)0x80000000u), 0xD8));
}

inline __mmask16 below(__m512 x, float bound) { return _mm512_cmp_ps_mask(x, splat(bound), _CMP_LT_OQ); }

// tanh(x) and 1 - tanh(x)^2: the polynomial below 0.625, else (1 - q) / (1 + q) and 4 q / (1 + q)^2 with
// q = e^{-2|x|} (no cancellation); the exponential only where some lane needs it. NaN stays NaN.
struct Tanh {
  __m512 value, sech2;
  explicit Tanh(__m512 x) {
    const __m512 ax = _mm512_abs_ps(x), one = splat(1.0f);
    const __mmask16 small = below(ax, 0.625f);
    value = tanh_polynomial(x);
    sech2 = _mm512_fnmadd_ps(value, value, one);
    if (small != 0xFFFF) {  // (NaN lanes are not small: they take this branch and stay NaN)
      const __m512 q = exp_neg(_mm512_add_ps(ax, ax));
      const __m512 inv = reciprocal(_mm512_add_ps(one, q));
      value = _mm512_mask_blend_ps(small, with_sign(_mm512_mul_ps(_mm512_sub_ps(one, q), inv), x), value);
      sech2 = _mm512_mask_blend_ps(small, _mm512_mul_ps(_mm512_mul_ps(splat(4.0f), q), _mm512_mul_ps(inv, inv)),
                                   sech2);
    }
  }
};

// sigmoid(a) and 1 - sigmoid(a) from t = e^{-|a|}: 1 / (1 + t) and t / (1 + t), as a's sign assigns them
struct Sigmoid {
  __m512 value, complement;
  explicit Sigmoid(__m512 a) {
    const __m512 t = exp_neg(_mm512_abs_ps(a)), inv = reciprocal(_mm512_add_ps(splat(1.0f), t));
    const __mmask16 negative = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 large = inv, small = _mm512_mul_ps(t, inv);
    value = _mm512_mask_blend_ps(negative, large, small);
    complement = _mm512_mask_blend_ps(negative, small, large);
  }
};

// SiTU's gate f(a) = beta tanh(a / beta) sigmoid(a) and f'(a). At beta = 4 (`Beta4`) one exponential serves
// both factors (Gate4 in moe_cpu.cpp: t = e^{-|a| / 2}, tanh(|a| / 4) = (1 - t) / (1 + t), sigmoid(|a|) = 1 /
// (1 + t^2)); otherwise the tanh and the sigmoid take one each.
template <bool Beta4>
struct SituGate {
  __m512 f, df;
  SituGate(__m512 a, float beta) {
    const __m512 one = splat(1.0f);
    __m512 th, sech2, sig, sig_c;
    if (Beta4) {
      const __m512 y = _mm512_abs_ps(a);
      const __m512 t = exp_neg(_mm512_mul_ps(y, splat(0.5f))), t2 = _mm512_mul_ps(t, t);
      const __m512 opt = _mm512_add_ps(one, t), opt2 = _mm512_add_ps(one, t2);
      const __m512 r = reciprocal(_mm512_mul_ps(opt, opt2));  // 1 / (1 + t) = (1 + t^2) r
      const __m512 inv_opt = _mm512_mul_ps(opt2, r);
      const __mmask16 small = below(y, 2.5f);
      const __m512 poly = tanh_polynomial(_mm512_mul_ps(a, splat(0.25f)));
      th = _mm512_mask_blend_ps(small, with_sign(_mm512_mul_ps(_mm512_sub_ps(one, t), inv_opt), a), poly);
      sech2 = _mm512_mask_blend_ps(small, _mm512_mul_ps(_mm512_mul_ps(splat(4.0f), t), _mm512_mul_ps(inv_opt, inv_opt)),
                                   _mm512_fnmadd_ps(poly, poly, one));
      const __mmask16 negative = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ);
      const __m512 large = _mm512_mul_ps(opt, r), small_s = _mm512_mul_ps(t2, large);  // 1 / (1 + t^2), t^2 / ..
      sig = _mm512_mask_blend_ps(negative, large, small_s);
      sig_c = _mm512_mask_blend_ps(negative, small_s, large);
    } else {
      const Tanh t(_mm512_mul_ps(a, splat(1.0f / beta)));
      const Sigmoid s(a);
      th = t.value, sech2 = t.sech2, sig = s.value, sig_c = s.complement;
    }
    f = _mm512_mul_ps(_mm512_mul_ps(splat(beta), th), sig);
    df = _mm512_fmadd_ps(sech2, sig, _mm512_mul_ps(f, sig_c));  // sech^2 s + beta tanh s (1 - s)
  }
};

// glu[i] = weight * act(a[i], u[i]) over one row (inter channels); with `Backward`, also dglu -> da, du and
// glu = act without the weight (as glu_backward): kind 0 SiLU, 1 SiTU (`Beta4`: at beta = 4).
template <int Kind, bool Beta4, bool Backward>
inline void row(const float* a_row, const float* u_row, const float* d_row, float* g_row, float* da_row,
                float* du_row, int inter, float w, float beta, float linear_beta) {
  const bool capped = linear_beta > 0.0f;
  for (int i = 0; i < inter; i += 16) {
    const __mmask16 m = lane_mask(inter - i);
    const __m512 a = _mm512_maskz_loadu_ps(m, a_row + i), u = _mm512_maskz_loadu_ps(m, u_row + i);
    __m512 f, df, h = u, dh = splat(1.0f);  // gate factor, its derivative; up factor, its derivative
    if (Kind == 0) {
      const Sigmoid s(a);
      f = _mm512_mul_ps(a, s.value);
      df = _mm512_mul_ps(s.value, _mm512_fmadd_ps(a, s.complement, splat(1.0f)));  // s (1 + a (1 - s))
    } else {
      const SituGate<Beta4> gate(a, beta);
      f = gate.f, df = gate.df;
      if (capped) {
        const Tanh t(_mm512_mul_ps(u, splat(1.0f / linear_beta)));
        h = _mm512_mul_ps(splat(linear_beta), t.value);
        dh = t.sech2;
      }
    }
    if (!Backward) {
      _mm512_mask_storeu_ps(g_row + i, m, _mm512_mul_ps(_mm512_mul_ps(f, h), splat(w)));
      continue;
    }
    const __m512 wd = _mm512_mul_ps(splat(w), _mm512_maskz_loadu_ps(m, d_row + i));
    _mm512_mask_storeu_ps(g_row + i, m, _mm512_mul_ps(f, h));
    _mm512_mask_storeu_ps(da_row + i, m, _mm512_mul_ps(_mm512_mul_ps(wd, df), h));
    _mm512_mask_storeu_ps(du_row + i, m, _mm512_mul_ps(_mm512_mul_ps(wd, f), dh));
  }
}

template <int Kind, bool Beta4, bool Backward>
inline void all_rows(const float* h, const float* dglu, const float* weight, float* glu, float* dh, int n_rows,
                     int inter, float beta, float linear_beta) {
  for (int r = 0; r < n_rows; ++r) {
    const float* a = h + (size_t)r * 2 * inter;
    float* da = Backward ? dh + (size_t)r * 2 * inter : nullptr;
    row<Kind, Beta4, Backward>(a, a + inter, Backward ? dglu + (size_t)r * inter : nullptr, glu + (size_t)r * inter,
                               da, Backward ? da + inter : nullptr, inter, weight[r], beta, linear_beta);
  }
}

// Calls f(kind, beta4) with the activation as compile-time constants (std::integral_constant<int, Kind> and
// std::bool_constant<Beta4>, for row<Kind, Beta4, ...>): SiLU, SiTU at beta = 4, SiTU at any other beta.
template <class F>
inline void with_activation(int kind, float beta, F&& f) {
  if (kind == 0)
    f(std::integral_constant<int, 0>{}, std::false_type{});
  else if (beta == 4.0f)
    f(std::integral_constant<int, 1>{}, std::true_type{});
  else
    f(std::integral_constant<int, 1>{}, std::false_type{});
}

// Every row of a tile (h [rows, 2I]: gate half, then up half), forward or backward, with the kind and beta
// dispatched once per tile.
template <bool Backward>
inline void rows(const float* h, const float* dglu, const float* weight, float* glu, float* dh, int n_rows,
                 int inter, int kind, float beta, float linear_beta) {
  with_activation(kind, beta, [&](auto kind_c, auto beta4_c) {
    all_rows<decltype(kind_c)::value, decltype(beta4_c)::value, Backward>(h, dglu, weight, glu, dh, n_rows, inter,
                                                                          beta, linear_beta);
  });
}

}  // namespace glu
}  // namespace k3
#endif
