// Backward of the weighted RMSNorm y = w * x r, r = (mean(x^2) + eps)^(-1/2), over rows of width H (fp32):
//   dx = r (g w - x r c),  c = r mean(g w x),      dw = sum over rows of g x r,
// one pass over each row for the two sums, one for dx and dw. Autograd through the forward's ops (F.rms_norm,
// then the weight) runs ~12 element-wise passes over [rows, H], each a fresh tensor; this one makes two.
//
// dw: each block of kBlockRows rows sums its rows in order into its own partial row, then the partials are summed
// in block order, so the result does not depend on the thread count. r is recomputed here from x (the same
// formula as the forward's, its sum in another order: a few ulp apart at most).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "simd.h"  // K3_HAVE_SIMD

namespace {

constexpr int64_t kBlockRows = 64;

#if K3_HAVE_SIMD
// One row: dx, and its g x r added into `partial` (the block's dw).
inline void row_backward(const float* x, const float* w, const float* g, int hidden, float eps, float* dx,
                         float* partial) {
  using namespace k3::simd;
  vf ss = zero(), gwx = ss;
  for (int i = 0; i < hidden; i += kLanes) {
    const uint16_t m = k3::lane_mask(hidden - i);
    const vf xv = load(x + i, m);
    ss = fmadd(xv, xv, ss);
    gwx = fmadd(mul(load(g + i, m), load(w + i, m)), xv, gwx);
  }
  const float r = 1.0f / std::sqrt(reduce_add(ss) / (float)hidden + eps);
  const float c = r * reduce_add(gwx) / (float)hidden;
  const vf rv = splat(r), rc = splat(r * c);
  for (int i = 0; i < hidden; i += kLanes) {
    const uint16_t m = k3::lane_mask(hidden - i);
    const vf xv = load(x + i, m), gv = load(g + i, m);
    const vf gw = mul(gv, load(w + i, m));
    store(dx + i, m, mul(rv, fnmadd(xv, rc, gw)));
    store(partial + i, m, fmadd(mul(gv, xv), rv, load(partial + i, m)));
  }
}
#else
inline void row_backward(const float* x, const float* w, const float* g, int hidden, float eps, float* dx,
                         float* partial) {
  float ss = 0.0f, gwx = 0.0f;
  for (int i = 0; i < hidden; ++i) {
    ss += x[i] * x[i];
    gwx += g[i] * w[i] * x[i];
  }
  const float r = 1.0f / std::sqrt(ss / (float)hidden + eps), c = r * gwx / (float)hidden;
  for (int i = 0; i < hidden; ++i) {
    dx[i] = r * (g[i] * w[i] - x[i] * (r * c));
    partial[i] += g[i] * x[i] * r;
  }
}
#endif

}  // namespace

extern "C" {

// x, grad [rows, H] (row-major fp32), w [H] -> grad_x [rows, H], grad_w [H] (as above). Returns 0, 1 on invalid
// arguments, 2 if scratch could not be allocated.
int k3_rms_norm_backward(const float* x, const float* w, const float* grad, int64_t rows, int hidden, float eps,
                         float* grad_x, float* grad_w, int n_threads) {
  if (rows < 0 || hidden <= 0 || n_threads <= 0 || !(eps >= 0.0f)) return 1;
  const int64_t n_blocks = (rows + kBlockRows - 1) / kBlockRows;
  std::vector<float> partials;
  try {
    partials.assign((size_t)(n_blocks * hidden), 0.0f);
  } catch (...) {
    return 2;
  }
  const int threads = rows * hidden >= 16384 ? n_threads : 1;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < n_blocks; ++b) {
      float* partial = partials.data() + b * hidden;
      for (int64_t r = b * kBlockRows; r < std::min(rows, (b + 1) * kBlockRows); ++r)
        row_backward(x + r * hidden, w, grad + r * hidden, hidden, eps, grad_x + r * hidden, partial);
    }
#pragma omp for schedule(static)
    for (int i = 0; i < hidden; ++i) {
      float sum = 0.0f;
      for (int64_t b = 0; b < n_blocks; ++b) sum += partials[b * hidden + i];
      grad_w[i] = sum;
    }
  }
  return 0;
}

}  // extern "C"
