// Helpers shared by the fused CPU kernels (kda_cpu.cpp, moe_cpu.cpp): row-major sgemm through the BLAS that
// torch links, and element-wise functions written branch-free so that loops over them vectorise.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define K3_HAVE_MXCSR 1
#define K3_FTZ_DAZ 0x8040u  // MXCSR flush-to-zero and denormals-are-zero
#endif

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace k3 {

// C[M x N] = alpha op(A)[M x K] op(B)[K x N] + beta C, all row-major with leading dimensions.
// A row-major matrix is its transpose in column-major order, so this is sgemm on C^T = op(B)^T op(A)^T.
inline void gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) c[(int64_t)i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[(int64_t)i * ldc + j];
    return;
  }
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  sgemm_(&tb, &ta, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

// bf16 values (stored as their raw 16 bits) read as fp32, exactly: the 16 bits are the top half of the float.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// The first min(left, 16) of a 16-lane vector's lanes (none for left <= 0): the mask of a row's last, partial
// vector in the AVX-512 loops.
inline uint16_t lane_mask(int64_t left) {
  return left >= 16 ? (uint16_t)0xFFFF : left > 0 ? (uint16_t)((1u << left) - 1) : (uint16_t)0;
}

// Cephes' single-precision constants, shared by the scalar functions here and their AVX-512 forms
// (glu_avx512.h): expf's range reduction (n = round(x log2 e), r = x - n ln2_hi + n ln2_lo) and polynomial
// (highest degree first), tanhf's odd polynomial for |x| < 0.625 (in x^2, highest degree first).
namespace cephes {
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;
constexpr float kExp[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
constexpr float kTanh[5] = {-5.70498872745e-3f, 2.06390887954e-2f, -5.37397155531e-2f, 1.33314422036e-1f,
                            -3.33332819422e-1f};
}  // namespace cephes

// exp(x) to ~1 ulp (Cephes' expf: range reduction by ln 2, degree-7 polynomial, exponent bits); written
// branch-free so that loops over it vectorise. 0 below -87 (the result would be subnormal), +inf above
// 88.5, NaN stays NaN.
inline float fast_exp(float x) {
  float xc = x < -87.0f ? -87.0f : (x > 88.5f ? 88.5f : x);
  float n = std::floor(xc * cephes::kLog2e + 0.5f);
  float r = xc - n * cephes::kLn2Hi;
  r = r + n * cephes::kLn2Lo;
  float p = cephes::kExp[0];
  for (int i = 1; i < 6; ++i) p = p * r + cephes::kExp[i];
  float y = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  float result = y * scale;
  result = x < -87.0f ? 0.0f : result;
  return x > 88.5f ? INFINITY : result;
}

// Flush-to-zero / denormals-are-zero on this thread while in scope (x86): long decay chains and products of
// small weights produce values ~1e-40, far slower as subnormal floats and far below fp32's resolution of
// the results. The thread's previous mode is restored on exit.
class FlushDenormals {
 public:
#ifdef K3_HAVE_MXCSR
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | K3_FTZ_DAZ); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned int saved_;
#endif
};

// Allocator for scratch vectors aligned to cache lines: a 64-byte vector load or store on a misaligned
// address touches two lines (the in-cache transposes of the experts kernel run much slower that way).
template <class T>
struct CacheAligned {
  using value_type = T;
  CacheAligned() = default;
  template <class U>
  CacheAligned(const CacheAligned<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const CacheAligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const CacheAligned<U>&) const { return false; }
};
template <class T>
using aligned_vector = std::vector<T, CacheAligned<T>>;

// A thread's scratch, allocated inside a parallel region. Every thread must still reach the work-sharing
// loops (their barriers wait for all of them), so a failed allocation returns null and sets `status` to 2;
// the thread then skips its work and the caller falls back to the PyTorch path.
template <class T, class... Args>
std::unique_ptr<T> new_scratch(int& status, Args&&... args) {
  try {
    return std::make_unique<T>(std::forward<Args>(args)...);
  } catch (...) {
#pragma omp atomic write
    status = 2;
    return nullptr;
  }
}

// The routing's counting sort (experts kernel forward and backward, router backward): assignments
// (token * k + slot) by expert, stable (token order within an expert); with `with_position`, position[a] = the
// assignment's row in that order (-1 for ids outside [0, E)). Only the sgemm path's slot sums read position:
// the small-GEMM path skips it (filling and scattering it is most of the sort, which runs on one thread
// before the parallel part).
struct Sorted {
  std::vector<int64_t> offsets, order, position;
  Sorted(const int64_t* top_k_index, int64_t n_assign, int64_t n_experts, bool with_position = true) {
    offsets.assign(n_experts + 1, 0);
    for (int64_t a = 0; a < n_assign; ++a) {
      const int64_t e = top_k_index[a];
      if (e >= 0 && e < n_experts) ++offsets[e + 1];
    }
    for (int64_t e = 0; e < n_experts; ++e) offsets[e + 1] += offsets[e];
    order.resize(offsets[n_experts]);
    std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
    if (!with_position) {
      for (int64_t a = 0; a < n_assign; ++a) {
        const int64_t e = top_k_index[a];
        if (e >= 0 && e < n_experts) order[fill[e]++] = a;
      }
      return;
    }
    position.assign(n_assign, -1);
    for (int64_t a = 0; a < n_assign; ++a) {
      const int64_t e = top_k_index[a];
      if (e >= 0 && e < n_experts) {
        position[a] = fill[e];
        order[fill[e]++] = a;
      }
    }
  }
};

}  // namespace k3
