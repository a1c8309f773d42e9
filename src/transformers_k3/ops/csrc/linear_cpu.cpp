// A bf16 linear layer on a few rows (a decode step): out = bf16(x w^T + bias) for bf16 x [M, K], w [N, K],
// bias [N] (or none), M <= 15, AVX-512 or AVX2 (bf16_rows.h).
//
// torch's CPU matmul in bf16 (oneDNN) has a fixed cost per call far above the fp32 one's whatever the size: a bf16
// model's decode step, dozens of one-row products, ran slower than the same model in fp32. Here each output is a
// dot product over K of exact products of bf16 values summed in fp32, rounded to bf16 once as torch rounds (to
// nearest, ties to even): the quantity torch's bf16 matmul computes, with the sums in another order.
//
// Layout: row-major bf16 bits; out [M, N].

#include <cstdint>

#include "bf16_rows.h"
#include "kernels.h"

extern "C" {

// 1 if k3_linear_bf16_rows can run in this build (AVX-512 or AVX2), else 0.
int k3_linear_bf16_available() { return K3_HAVE_SIMD; }

// out [M, N] bf16 = round(x [M, K] w [N, K]^T + bias [N]) (bias may be null), all bf16 bits, M <= 15. Returns 0,
// 1 on invalid arguments (or without AVX-512 / AVX2).
int k3_linear_bf16_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t m, int64_t n, int k,
                        uint16_t* out, int n_threads) {
#if K3_HAVE_SIMD
  if (m < 0 || m > k3::bf16_rows::kMaxRows || n < 0 || k <= 0 || n_threads <= 0) return 1;
  k3::bf16_rows::product(x, m, w, n, k, bias, nullptr, out, n_threads);
  return 0;
#else
  (void)x, (void)w, (void)bias, (void)m, (void)n, (void)k, (void)out, (void)n_threads;
  return 1;
#endif
}

}  // extern "C"
