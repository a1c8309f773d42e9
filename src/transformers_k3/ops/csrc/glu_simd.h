// The experts kernel's GLUs (SiTU at K3's beta = 4, SiTU at any beta, SiLU) written with 16-lane vectors (simd.h:
// AVX-512, or AVX2 + FMA): moe_cpu.cpp's scalar forms, which the compiler vectorises, stay for builds without
// either. Per 16 channels:
// * exponentials only of non-positive arguments, e^{-y} (y >= 0): Cephes' polynomial on the reduced argument
//   and 2^n by vscalef (AVX-512: 0 below the range with no clamps or selects, ~10 ops instead of ~18) or from its
//   exponent bits (AVX2);
// * every quotient has a denominator in [1, 8], so on AVX-512 a reciprocal estimate and one Newton step (~2 ulp)
//   replace the division (a division costs a large part of an exponential);
// * tanh of the up half at K3's cap (25) is its polynomial for |u| < 15.6, where almost every activation lies:
//   the exponential runs only for a vector with a lane beyond that.
// Same values as the scalar forms to a few ulp (tested against float64 in test_cpu_kernels.py).
#pragma once

#include <type_traits>

#include "common.h"
#include "simd.h"

#if K3_HAVE_SIMD
namespace k3 {
namespace glu {

using namespace simd;

// e^{-y} for y >= 0 (NaN stays NaN): 0 where it would be subnormal
inline vf exp_neg(vf y) {
  const vf x = sub(zero(), min(splat(104.0f), y));  // (min keeps a NaN y)
  const vf n = round(mul(x, splat(cephes::kLog2e)));
  vf r = fnmadd(n, splat(cephes::kLn2Hi), x);
  r = fmadd(n, splat(cephes::kLn2Lo), r);
  vf p = splat(cephes::kExp[0]);
  for (int i = 1; i < 6; ++i) p = fmadd(p, r, splat(cephes::kExp[i]));
  p = fmadd(mul(p, r), r, add(r, splat(1.0f)));
  return scalef(p, n);
}

// tanh(x) for |x| < 0.625 (the odd polynomial of fast_tanh)
inline vf tanh_polynomial(vf x) {
  const vf z = mul(x, x);
  vf p = splat(cephes::kTanh[0]);
  for (int i = 1; i < 5; ++i) p = fmadd(p, z, splat(cephes::kTanh[i]));
  return fmadd(mul(p, z), x, x);
}

inline vmask below(vf x, float bound) { return less(x, splat(bound)); }

// tanh(x) and 1 - tanh(x)^2: the polynomial below 0.625, else (1 - q) / (1 + q) and 4 q / (1 + q)^2 with
// q = e^{-2|x|} (no cancellation); the exponential only where some lane needs it. NaN stays NaN.
struct Tanh {
  vf value, sech2;
  explicit Tanh(vf x) {
    const vf ax = abs(x), one = splat(1.0f);
    const vmask small = below(ax, 0.625f);
    value = tanh_polynomial(x);
    sech2 = fnmadd(value, value, one);
    if (!all(small)) {  // (NaN lanes are not small: they take this branch and stay NaN)
      const vf q = exp_neg(add(ax, ax));
      const vf inv = reciprocal(add(one, q));
      value = blend(small, with_sign(mul(sub(one, q), inv), x), value);
      sech2 = blend(small, mul(mul(splat(4.0f), q), mul(inv, inv)), sech2);
    }
  }
};

// sigmoid(a) and 1 - sigmoid(a) from t = e^{-|a|}: 1 / (1 + t) and t / (1 + t), as a's sign assigns them
struct Sigmoid {
  vf value, complement;
  explicit Sigmoid(vf a) {
    const vf t = exp_neg(abs(a)), inv = reciprocal(add(splat(1.0f), t));
    const vmask negative = less(a, zero());
    const vf large = inv, small = mul(t, inv);
    value = blend(negative, large, small);
    complement = blend(negative, small, large);
  }
};

// SiTU's gate f(a) = beta tanh(a / beta) sigmoid(a) and f'(a). At beta = 4 (`Beta4`) one exponential serves
// both factors (Gate4 in moe_cpu.cpp: t = e^{-|a| / 2}, tanh(|a| / 4) = (1 - t) / (1 + t), sigmoid(|a|) = 1 /
// (1 + t^2)); otherwise the tanh and the sigmoid take one each.
template <bool Beta4>
struct SituGate {
  vf f, df;
  SituGate(vf a, float beta) {
    const vf one = splat(1.0f);
    vf th, sech2, sig, sig_c;
    if (Beta4) {
      const vf y = abs(a);
      const vf t = exp_neg(mul(y, splat(0.5f))), t2 = mul(t, t);
      const vf opt = add(one, t), opt2 = add(one, t2);
      const vf r = reciprocal(mul(opt, opt2));  // 1 / (1 + t) = (1 + t^2) r
      const vf inv_opt = mul(opt2, r);
      const vmask small = below(y, 2.5f);
      const vf poly = tanh_polynomial(mul(a, splat(0.25f)));
      th = blend(small, with_sign(mul(sub(one, t), inv_opt), a), poly);
      sech2 = blend(small, mul(mul(splat(4.0f), t), mul(inv_opt, inv_opt)), fnmadd(poly, poly, one));
      const vmask negative = less(a, zero());
      const vf large = mul(opt, r), small_s = mul(t2, large);  // 1 / (1 + t^2), t^2 / ..
      sig = blend(negative, large, small_s);
      sig_c = blend(negative, small_s, large);
    } else {
      const Tanh t(mul(a, splat(1.0f / beta)));
      const Sigmoid s(a);
      th = t.value, sech2 = t.sech2, sig = s.value, sig_c = s.complement;
    }
    f = mul(mul(splat(beta), th), sig);
    df = fmadd(sech2, sig, mul(f, sig_c));  // sech^2 s + beta tanh s (1 - s)
  }
};

// glu[i] = weight * act(a[i], u[i]) over one row (inter channels); with `Backward`, also dglu -> da, du and
// glu = act without the weight (as glu_backward): kind 0 SiLU, 1 SiTU (`Beta4`: at beta = 4).
template <int Kind, bool Beta4, bool Backward>
inline void row(const float* a_row, const float* u_row, const float* d_row, float* g_row, float* da_row,
                float* du_row, int inter, float w, float beta, float linear_beta) {
  const bool capped = linear_beta > 0.0f;
  for (int i = 0; i < inter; i += 16) {
    const uint16_t m = lane_mask(inter - i);
    const vf a = load(a_row + i, m), u = load(u_row + i, m);
    vf f, df, h = u, dh = splat(1.0f);  // gate factor, its derivative; up factor, its derivative
    if (Kind == 0) {
      const Sigmoid s(a);
      f = mul(a, s.value);
      df = mul(s.value, fmadd(a, s.complement, splat(1.0f)));  // s (1 + a (1 - s))
    } else {
      const SituGate<Beta4> gate(a, beta);
      f = gate.f, df = gate.df;
      if (capped) {
        const Tanh t(mul(u, splat(1.0f / linear_beta)));
        h = mul(splat(linear_beta), t.value);
        dh = t.sech2;
      }
    }
    if (!Backward) {
      store(g_row + i, m, mul(mul(f, h), splat(w)));
      continue;
    }
    const vf wd = mul(splat(w), load(d_row + i, m));
    store(g_row + i, m, mul(f, h));
    store(da_row + i, m, mul(mul(wd, df), h));
    store(du_row + i, m, mul(mul(wd, f), dh));
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
