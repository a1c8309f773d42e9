// Register-blocked fp32 GEMM and transpose for the small per-expert products of the experts kernel
// (moe_cpu.cpp), on AVX-512 or AVX2 + FMA (simd.h; K3_HAVE_SMALL_GEMM is 0 without either, and the callers use
// sgemm).
//
// A routed expert at K3's routing scale sees a few dozen rows per call (2,048 tokens x top-16 over 896 experts:
// ~37), and at the scaled-down widths the products are [37, 128] x [128, 64]. There sgemm spends much of its
// time packing operands and dispatching; these kernels keep an MR x (16 NR) block of C in registers and stream
// A (one broadcast per row and step) and B (NR vector loads per step) straight from where they lie.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "simd.h"

#define K3_HAVE_SMALL_GEMM K3_HAVE_SIMD

#if K3_HAVE_SMALL_GEMM
namespace k3 {

// Memory to pull into cache while a product computes (e.g. the next expert's weights, or the rows the product
// will write next): one cache line per step of the product's inner loop, so that the requests spread over its
// arithmetic instead of stalling in a burst. A stream is a contiguous range or a list of rows (row i at base +
// rows[i] stride, its first row_floats floats), walked as one contiguous segment after another; then() appends
// a second stream. Lines to be written are prefetched for ownership (prefetchw), so the stores find them owned.
struct Prefetch {
  Prefetch() = default;
  Prefetch(const float* p, int64_t n, bool for_write = false)
      : next_(reinterpret_cast<const char*>(p)), end_(next_ + n * sizeof(float)), write_(for_write) {}
  Prefetch(const float* base, const int64_t* rows, int n_rows, int64_t stride, int row_floats, bool for_write)
      : base_(base), rows_(rows), rows_left_(n_rows), stride_(stride), row_bytes_(row_floats * sizeof(float)),
        write_(for_write) {
    advance();
  }
  // after this stream, `after` (which must outlive the product this goes to)
  void then(const Prefetch* after) {
    then_ = after;
    if (next_ >= end_) advance();
  }
  void step() {  // (the inner loop's one extra branch)
    if (next_ < end_) {
      if (write_)
        _mm_prefetch(next_, _MM_HINT_ET0);
      else
        _mm_prefetch(next_, _MM_HINT_T1);
      next_ += 64;
      if (next_ >= end_) advance();
    }
  }

 private:
  void advance() {  // the next nonempty segment, if any
    while (next_ >= end_) {
      if (rows_left_ > 0) {
        next_ = reinterpret_cast<const char*>(base_ + *rows_++ * stride_);
        end_ = next_ + row_bytes_;
        --rows_left_;
      } else if (then_ != nullptr) {
        *this = *then_;  // (a copy: the chained stream itself is left as it was)
      } else {
        return;
      }
    }
  }

  const char* next_ = nullptr;  // the current segment [next_, end_)
  const char* end_ = nullptr;
  const float* base_ = nullptr;  // rows left to walk
  const int64_t* rows_ = nullptr;
  int rows_left_ = 0;
  int64_t stride_ = 0, row_bytes_ = 0;
  bool write_ = false;
  const Prefetch* then_ = nullptr;
};

// C[m, 0 : 16 NR] (+)= sum_p A(m, p) B[p, 0 : 16 NR] for MR rows: A(m, p) = a[m][p * sap], B rows ldb apart,
// C row m at c[m]; `mask` selects the columns present in each of the NR vectors.
// `Full`: every lane of every vector present (mask ignored: AVX2's masked loads are slower than plain ones).
template <int MR, int NR, bool GatherB, bool Full = false>
inline void small_gemm_block(int k, const float* const* a, int64_t sap, const float* b, int64_t ldb,
                             const int64_t* b_rows, float* const* c, const uint16_t* mask, bool accumulate,
                             Prefetch& prefetch) {
  using namespace simd;
  // (every loop over i and j is unrolled, so that acc lives in registers: unrolled only partly, gcc keeps
  // the array on the stack and stores it back on every step)
  vf acc[MR][NR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = zero();
  for (int p = 0; p < k; ++p) {
    prefetch.step();
    vf bv[NR];
    const float* bp = b + (GatherB ? b_rows[p] : p) * ldb;
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) bv[j] = Full ? load(bp + kLanes * j) : load(bp + kLanes * j, mask[j]);
    const int64_t ap = p * sap;
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const vf av = splat(a[i][ap]);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = fmadd(av, bv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      float* dst = c[i] + kLanes * j;
      vf v = acc[i][j];
      if (Full) {
        if (accumulate) v = add(v, load(dst));
        store(dst, v);
      } else {
        if (accumulate) v = add(v, load(dst, mask[j]));
        store(dst, mask[j], v);
      }
    }
}

#if K3_HAVE_AVX512
// Rows per block for NR vectors: MR x NR accumulators plus NR B vectors and a broadcast fit the 32 registers.
constexpr int block_rows(int nr) { return nr >= 4 ? 6 : nr == 3 ? 8 : 12; }
constexpr int kBlockVectors = 4;  // columns per block: up to 64
#else
// AVX2's 16 registers: 6 rows of one 16-lane vector (12 halves) plus its two halves and a broadcast.
constexpr int block_rows(int) { return 6; }
constexpr int kBlockVectors = 1;  // columns per block: up to 16
#endif

// Blocks of mr in {block_rows(NR), 8, 4, 2, 1} rows (the row loop splits a remainder into these: fewer
// instantiations keep the build short).
template <int NR, bool GatherB, bool Full = false>
inline void small_gemm_rows(int mr, int k, const float* const* a, int64_t sap, const float* b, int64_t ldb,
                            const int64_t* b_rows, float* const* c, const uint16_t* mask, bool accumulate,
                            Prefetch& prefetch) {
  constexpr int full = block_rows(NR);
  if (mr == full)
    small_gemm_block<full, NR, GatherB, Full>(k, a, sap, b, ldb, b_rows, c, mask, accumulate, prefetch);
  else if (mr == 8)
    // (rows_for gives 8 only where full > 8; the 1 keeps the other NR from instantiating an 8-row block)
    small_gemm_block<(full > 8 ? 8 : 1), NR, GatherB, Full>(k, a, sap, b, ldb, b_rows, c, mask, accumulate,
                                                            prefetch);
  else if (mr == 4)
    small_gemm_block<4, NR, GatherB, Full>(k, a, sap, b, ldb, b_rows, c, mask, accumulate, prefetch);
  else if (mr == 2)
    small_gemm_block<2, NR, GatherB, Full>(k, a, sap, b, ldb, b_rows, c, mask, accumulate, prefetch);
  else
    small_gemm_block<1, NR, GatherB, Full>(k, a, sap, b, ldb, b_rows, c, mask, accumulate, prefetch);
}

// The largest block size small_gemm_rows<NR> has that fits `left` rows.
inline int rows_for(int left, int full) {
  return left >= full ? full : left >= 8 && full > 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

template <bool GatherB>
inline void small_gemm_blocks(int m, int n, int k, const float* a, int64_t sam, int64_t sap, const float* b,
                              int64_t ldb, float* c, int64_t ldc, const int64_t* rows, bool accumulate,
                              Prefetch& prefetch, const int64_t* a_rows, const int64_t* b_rows) {
  constexpr int width = simd::kLanes * kBlockVectors;
  for (int n0 = 0; n0 < n; n0 += width) {
    const int nb = std::min(width, n - n0), nr = (nb + 15) / 16;
    uint16_t mask[kBlockVectors];
    for (int j = 0; j < kBlockVectors; ++j) mask[j] = lane_mask(nb - 16 * j);
    const int full = block_rows(nr);
    for (int m0 = 0, mr; m0 < m; m0 += mr) {
      mr = rows_for(m - m0, full);
      float* crow[12];
      const float* arow[12];
      for (int i = 0; i < mr; ++i) {
        crow[i] = c + (rows ? rows[m0 + i] : (int64_t)(m0 + i)) * ldc + n0;
        arow[i] = a + (a_rows ? a_rows[m0 + i] : (int64_t)(m0 + i)) * sam;
      }
      const float* bn = b + n0;
#if K3_HAVE_AVX512
      switch (nr) {
        case 1: small_gemm_rows<1, GatherB>(mr, k, arow, sap, bn, ldb, b_rows, crow, mask, accumulate, prefetch); break;
        case 2: small_gemm_rows<2, GatherB>(mr, k, arow, sap, bn, ldb, b_rows, crow, mask, accumulate, prefetch); break;
        case 3: small_gemm_rows<3, GatherB>(mr, k, arow, sap, bn, ldb, b_rows, crow, mask, accumulate, prefetch); break;
        default: small_gemm_rows<4, GatherB>(mr, k, arow, sap, bn, ldb, b_rows, crow, mask, accumulate, prefetch); break;
      }
#else
      (void)nr;
      if (nb == width)
        small_gemm_rows<1, GatherB, true>(mr, k, arow, sap, bn, ldb, b_rows, crow, mask, accumulate, prefetch);
      else
        small_gemm_rows<1, GatherB>(mr, k, arow, sap, bn, ldb, b_rows, crow, mask, accumulate, prefetch);
#endif
    }
  }
}

// C[m, n] (+)= sum_p A(m, p) B(p, n), A(m, p) = a[a_row(m) * sam + p * sap] (any strides, so A may be a
// transposed view) with a_row(m) = a_rows[m] (a gather, e.g. of token rows) or m when `a_rows` is null; B(p, n) =
// b[b_row(p) * ldb + n] with b_row(p) = b_rows[p] (a gather of B's rows) or p; C row m is c + row(m) * ldc with
// row(m) = rows[m] (a scatter) or m when `rows` is null. Issues `prefetch`'s requests along the way.
inline void small_gemm(int m, int n, int k, const float* a, int64_t sam, int64_t sap, const float* b, int64_t ldb,
                       float* c, int64_t ldc, const int64_t* rows, bool accumulate, Prefetch prefetch = {},
                       const int64_t* a_rows = nullptr, const int64_t* b_rows = nullptr) {
  if (m <= 0 || n <= 0) return;
  if (b_rows != nullptr)
    small_gemm_blocks<true>(m, n, k, a, sam, sap, b, ldb, c, ldc, rows, accumulate, prefetch, a_rows, b_rows);
  else
    small_gemm_blocks<false>(m, n, k, a, sam, sap, b, ldb, c, ldc, rows, accumulate, prefetch, a_rows, nullptr);
}

// out[o] = sum_p x[p] w[o, p] for o < n: w [n, k] as stored (fp32, or bf16 bits read exactly as fp32), x fp32
// (a matrix-vector product with no transposed copy, for a few rows: a decode step); four rows of w per pass over
// x, each summed in 16 lanes, the lanes added by simd::reduce_add.
template <class T>
inline void dots(const float* x, const T* w, int64_t n, int k, float* out) {
  using namespace simd;
  int64_t o = 0;
  for (; o + 4 <= n; o += 4) {
    const T* w0 = w + o * k;
    vf a0 = zero(), a1 = a0, a2 = a0, a3 = a0;
    for (int p = 0; p < k; p += kLanes) {
      const uint16_t m = lane_mask(k - p);
      const vf xv = load(x + p, m);
      a0 = fmadd(xv, load(w0 + p, m), a0);
      a1 = fmadd(xv, load(w0 + k + p, m), a1);
      a2 = fmadd(xv, load(w0 + 2 * k + p, m), a2);
      a3 = fmadd(xv, load(w0 + 3 * k + p, m), a3);
    }
    out[o] = reduce_add(a0);
    out[o + 1] = reduce_add(a1);
    out[o + 2] = reduce_add(a2);
    out[o + 3] = reduce_add(a3);
  }
  for (; o < n; ++o) {
    vf a = zero();
    for (int p = 0; p < k; p += kLanes) {
      const uint16_t m = lane_mask(k - p);
      a = fmadd(load(x + p, m), load(w + o * k + p, m), a);
    }
    out[o] = reduce_add(a);
  }
}

// dst[0 .. n) = src as fp32 (bf16 -> fp32 is exact).
inline void bf16_to_float(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) simd::store(dst + i, simd::load(src + i));
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// dst[0 .. n) = src rounded to bf16 as torch rounds (simd::bf16_bits).
inline void float_to_bf16(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; i += 16) {
    const uint16_t m = lane_mask(n - i);
    simd::store_bf16(dst + i, m, simd::load(src + i, m));
  }
}

// transpose()'s block at (r0, c0), in registers
#if K3_HAVE_AVX512
constexpr int kTransposeBlock = 16;
template <class T>
inline void transpose_block(const T* src, int rows, int r0, int c0, int64_t lds, float* dst) {
  __m512 v[16], t[16];
  for (int i = 0; i < 16; ++i) v[i] = simd::load(src + (r0 + i) * lds + c0);
  // 32-bit, then 64-bit interleaves within 128-bit lanes, then two rounds of 128-bit lane shuffles
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int j = 0; j < 2; ++j) {
      const __m512d lo = _mm512_castps_pd(t[i + j]), hi = _mm512_castps_pd(t[i + j + 2]);
      v[i + j] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi));
      v[i + j + 2] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi));
    }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(v[i + j], v[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(v[i + j], v[i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    v[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    v[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
  // v[q] now holds column c0 + perm(q) of the block's 16 rows
  static constexpr int column[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
  for (int q = 0; q < 16; ++q) _mm512_storeu_ps(dst + (int64_t)(c0 + column[q]) * rows + r0, v[q]);
}
#else
constexpr int kTransposeBlock = 8;
// (AVX2: 8 x 8 blocks, the classic three rounds of unpacks, shuffles and 128-bit permutes)
template <class T>
inline void transpose_block(const T* src, int rows, int r0, int c0, int64_t lds, float* dst) {
  __m256 v[8], t[8];
  for (int i = 0; i < 8; ++i) v[i] = simd::load8(src + (r0 + i) * lds + c0);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    v[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    v[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    v[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    v[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  // v[q] (q < 4) holds column c0 + q of rows r0 .. r0 + 3 in its low half and of c0 + 4 + q in its high half;
  // v[4 + q] the same for rows r0 + 4 .. r0 + 7
  for (int q = 0; q < 4; ++q) {
    _mm256_storeu_ps(dst + (int64_t)(c0 + q) * rows + r0, _mm256_permute2f128_ps(v[q], v[q + 4], 0x20));
    _mm256_storeu_ps(dst + (int64_t)(c0 + 4 + q) * rows + r0, _mm256_permute2f128_ps(v[q], v[q + 4], 0x31));
  }
}
#endif

// dst[c, r] = src[r, c] (as fp32) for src [rows, cols] (fp32, or bf16 bits) with rows lds apart, dst [cols, rows]
// contiguous: blocks (16 x 16 on AVX-512, 8 x 8 on AVX2) transposed in registers, the edges element by element.
template <class T>
inline void transpose(const T* src, int rows, int cols, int64_t lds, float* dst) {
  constexpr int block = kTransposeBlock;
  const int rb = rows / block * block, cb = cols / block * block;
  for (int r0 = 0; r0 < rb; r0 += block)
    for (int c0 = 0; c0 < cb; c0 += block) transpose_block(src, rows, r0, c0, lds, dst);
  for (int r = 0; r < rows; ++r) {
    const int c_start = r < rb ? cb : 0;
    for (int c = c_start; c < cols; ++c) dst[(int64_t)c * rows + r] = to_float(src[r * lds + c]);
  }
}

}  // namespace k3
#endif
