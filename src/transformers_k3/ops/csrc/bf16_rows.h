// Products of a few bf16 rows with a bf16 matrix (a decode step's linear layers; linear_cpu.cpp, and amx_cpu.cpp
// below the tile unit's row count): out [M, N] = x [M, K] w [N, K]^T, M <= 15, each output a dot product over K
// of exact products of bf16 values summed in fp32, written as fp32 or rounded to bf16 once (to nearest, ties to
// even, as torch rounds). Within a block of 16 outputs x's rows go in groups of up to 4, so that w is read from
// memory once per call and from cache once per group. AVX-512 or AVX2 + FMA (K3_HAVE_SIMD); the sums' order
// differs between the two (each build's modules and decode kernel use the same one).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "small_gemm.h"

#if K3_HAVE_SIMD
#include <immintrin.h>

namespace k3 {
namespace bf16_rows {

constexpr int kMaxRows = 15;

#if K3_HAVE_AVX512
// Lane q of the result: the sum of v[q]'s 16 lanes, for q < 16 (a transposing reduction: each level adds pairs of
// vectors' halves, so 15 shuffle pairs and adds instead of 16 separate horizontal sums).
inline __m512 sum_lanes16(__m512 v[16]) {
  // level 1: vectors 2i, 2i + 1 -> 8 vectors whose 256-bit halves hold the 8-lane sums (low half: 2i, high: 2i + 1)
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 lo = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44);  // v0 lanes 0-7 | v1 lanes 0-7
    const __m512 hi = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE);  // v0 lanes 8-15 | v1 lanes 8-15
    a[i] = _mm512_add_ps(lo, hi);
  }
  // level 2: 128-bit quarters: a[2i] (v 4i, 4i + 1) and a[2i + 1] (v 4i + 2, 4i + 3) -> the four vectors' 4-lane sums
  for (int i = 0; i < 4; ++i) {
    const __m512 lo = _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88);  // quarters 0, 2 of each
    const __m512 hi = _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD);  // quarters 1, 3 of each
    b[i] = _mm512_add_ps(lo, hi);  // quarter j: vector 4i + j's 4 partial sums
  }
  // level 3: within 128-bit quarters, pairs of 64 bits: b[2i], b[2i + 1] -> 2 partial sums per vector
  for (int i = 0; i < 2; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    // quarter j: (vector 8i + j: 2 sums, vector 8i + 4 + j: 2 sums)
  }
  // level 4: adjacent 32-bit lanes: c[0], c[1] -> quarter j: vectors j, 4 + j, 8 + j, 12 + j
  const __m512 lo = _mm512_shuffle_ps(c[0], c[1], 0x88), hi = _mm512_shuffle_ps(c[0], c[1], 0xDD);
  const __m512 sums = _mm512_add_ps(lo, hi);
  // lane 4j + r holds vector 4r + j: put vector q in lane q
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, sums);
}

// sums[r * Q + q] (Q = 16 / R) = the dot product of row r of x (R rows, k apart) with the row wq[q] of w: R x Q
// sums in 16 registers, so that each vector of w read serves R rows (for R = 4, 8 loads per 16 multiply-add
// instructions; one row at a time would stream all of w once per row). With AVX512_BF16 (VDPBF16PS: 32 products
// of bf16 pairs, each exact, added into 16 fp32 sums, rounding to nearest even; bf16 subnormals, |v| < 1.2e-38,
// count as zero) x's bf16 rows as they are; otherwise fp32 FMAs on x's rows converted once (xf) and w's
// converted in registers (two more instructions per 16 products).
template <int R>
inline void dots(const uint16_t* x, const float* xf, int k, const uint16_t* const* wq, float* sums) {
  constexpr int Q = 16 / R;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int a = 0; a < 16; ++a) acc[a] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  (void)xf;
  for (int p = 0; p < k; p += 32) {  // (the last, partial block masked: zeros past k)
    const __mmask32 mk = k - p >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (k - p)) - 1);
    __m512bh xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mk, x + (int64_t)r * k + p);
#pragma GCC unroll 16
    for (int q = 0; q < Q; ++q) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mk, wq[q] + p);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r * Q + q] = _mm512_dpbf16_ps(acc[r * Q + q], xv[r], wv);
    }
  }
#else
  (void)x;
  for (int p = 0; p < k; p += 16) {
    const __mmask16 mk = lane_mask(k - p);
    __m512 xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_ps(mk, xf + (int64_t)r * k + p);
#pragma GCC unroll 16
    for (int q = 0; q < Q; ++q) {
      const __m512i raw = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, wq[q] + p));
      const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r * Q + q] = _mm512_fmadd_ps(xv[r], wv, acc[r * Q + q]);
    }
  }
#endif
  _mm512_storeu_ps(sums, sum_lanes16(acc));
}

// sums [m, 16]: the dot products of x's m rows with w's rows j0 .. j0 + cols - 1 (cols <= 16; columns past cols
// repeat the last row's, ignored): rows in groups of 4 (then 2, 1), each group against 16 / R rows of w at a time.
inline void block16(const uint16_t* x, const float* xf, int m, const uint16_t* w, int k, int64_t j0, int cols,
             float* sums) {
  alignas(64) float part[16];
  for (int i = 0, rows; i < m; i += rows) {
    rows = m - i >= 4 ? 4 : m - i >= 2 ? 2 : 1;
    const int per = 16 / rows;  // rows of w per call
    for (int q0 = 0; q0 < 16; q0 += per) {
      const uint16_t* wq[16];
      for (int q = 0; q < per; ++q) wq[q] = w + (j0 + std::min(q0 + q, cols - 1)) * k;
      const uint16_t* xi = x + (int64_t)i * k;
      const float* xfi = xf == nullptr ? nullptr : xf + (int64_t)i * k;
      if (rows == 4)
        dots<4>(xi, xfi, k, wq, part);
      else if (rows == 2)
        dots<2>(xi, xfi, k, wq, part);
      else
        dots<1>(xi, xfi, k, wq, part);
      for (int r = 0; r < rows; ++r)
        for (int q = 0; q < per; ++q) sums[(i + r) * 16 + q0 + q] = part[r * per + q];
    }
  }
}
#else
// AVX2: sums[r * Q + q] = the dot product of row r of xf (x as fp32; R rows, k apart) with w's row wq[q], R x Q
// sums in 8-lane registers (12 of the 16), each summed across its lanes at the end; k's last k % 8 columns by
// scalar multiply-adds.
template <int R, int Q>
inline void dots8(const float* xf, int k, const uint16_t* const* wq, float* sums) {
  __m256 acc[R][Q];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 12
    for (int q = 0; q < Q; ++q) acc[r][q] = _mm256_setzero_ps();
  const int kb = k / 8 * 8;
  for (int p = 0; p < kb; p += 8) {
    __m256 xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(xf + (int64_t)r * k + p);
#pragma GCC unroll 12
    for (int q = 0; q < Q; ++q) {
      const __m256 wv = simd::load8(wq[q] + p);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][q] = _mm256_fmadd_ps(xv[r], wv, acc[r][q]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < Q; ++q) {
      float sum = simd::reduce_add(acc[r][q]);
      for (int p = kb; p < k; ++p) sum += xf[(int64_t)r * k + p] * to_float(wq[q][p]);
      sums[r * Q + q] = sum;
    }
}

// sums [m, 16] as the AVX-512 block16 gives them: x's rows in groups of 4 (then 2, 1), each against 12 / R rows
// of w at a time.
inline void block16(const uint16_t* x, const float* xf, int m, const uint16_t* w, int k, int64_t j0, int cols,
                    float* sums) {
  (void)x;
  float part[12];
  for (int i = 0, rows; i < m; i += rows) {
    rows = m - i >= 4 ? 4 : m - i >= 2 ? 2 : 1;
    const int per = 12 / rows;  // rows of w per call
    for (int q0 = 0; q0 < cols; q0 += per) {
      const uint16_t* wq[12];
      for (int q = 0; q < per; ++q) wq[q] = w + (j0 + std::min(q0 + q, cols - 1)) * k;
      const float* xfi = xf + (int64_t)i * k;
      if (rows == 4)
        dots8<4, 3>(xfi, k, wq, part);
      else if (rows == 2)
        dots8<2, 6>(xfi, k, wq, part);
      else
        dots8<1, 12>(xfi, k, wq, part);
      for (int r = 0; r < rows; ++r)
        for (int q = 0; q < per && q0 + q < cols; ++q) sums[(i + r) * 16 + q0 + q] = part[r * per + q];
    }
  }
}
#endif

// out [m, n] = x [m, k] w [n, k]^T (+ bias [n]) for m <= kMaxRows rows of bf16 x and w (bias bf16 or null): into
// out32 (fp32) or, rounded to bf16 as torch rounds, into out16; the threads split w's rows in blocks of 16.
inline void product(const uint16_t* x, int64_t m, const uint16_t* w, int64_t n, int k, const uint16_t* bias,
                    float* out32, uint16_t* out16, int n_threads) {
  if (m <= 0 || n <= 0) return;
#if defined(__AVX512BF16__)
  const float* xf = nullptr;  // (not needed: the products read x's bf16 rows)
#else
  aligned_vector<float> rows((size_t)m * k);
  bf16_to_float(x, m * k, rows.data());
  const float* xf = rows.data();
#endif
  const int64_t blocks = (n + 15) / 16;
  // a thread per 64K multiply-adds at least: a product that small on one thread costs about what starting a
  // parallel region costs
  const int64_t work = blocks * 16 * m * k;
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(n_threads, work / 65536));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j0 = b * 16;
    const int cols = (int)std::min<int64_t>(16, n - j0);
    alignas(64) float sums[kMaxRows * 16];
    block16(x, xf, (int)m, w, k, j0, cols, sums);
    for (int i = 0; i < m; ++i) {
      float* s = sums + i * 16;
      if (bias != nullptr)
        for (int q = 0; q < cols; ++q) s[q] += to_float(bias[j0 + q]);
      if (out16 != nullptr)
        float_to_bf16(s, cols, out16 + i * n + j0);
      else
        std::memcpy(out32 + i * n + j0, s, sizeof(float) * cols);
    }
  }
}

}  // namespace bf16_rows
}  // namespace k3
#endif
