// Grouped products with packed MXFP4 expert weights (the release's compressed-tensors "mxfp4-pack-quantized"
// layout, stacked per layer): rows sorted by expert, each expert's rows times its weight, the weight dequantized
// 32 values (one E8M0 scale, 16 code bytes) at a time where it is used, never a whole expert in memory.
//
//   packed [E, N, K/2] uint8: two E2M1 codes a byte, the low nibble the even input index;
//   scale  [E, N, K/32] uint8: E8M0, W[e, n, k] = E2M1(code) * 2^(scale[e, n, k / 32] - 127).
//
// Codes are read as twice their E2M1 value, a small integer (0, 1, 2, 3, 4, 6, 8, 12 and negatives), and the
// scale as 2^(s - 128): both exact in fp32, so every dequantized weight is exact and the sums are fp32 sums of
// the exact products, as in the dequantize-then-compute path (only the order of the sums differs). A decode step
// (few rows per expert) multiplies in registers straight from the codes, the scale applied once per 32-block sum
// (a power of two: exact); more rows dequantize a tile of the weight's rows into a thread's scratch once and run a
// register-blocked fp32 product over the rows. No flush-to-zero: scale 0 (2^-127) gives subnormal weights.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define K3_MXFP4_AVX2 1
#endif

#include "common.h"
#include "kernels.h"

namespace {

// Twice the E2M1 value of each 4-bit code (bit 3 the sign; code 8, -0, reads as 0: an exact zero either way).
alignas(16) const int8_t kCodesTimesTwo[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(s - 128) for each E8M0 byte s (half the scale, for the doubled codes); 255, E8M0's NaN, reads as NaN.
struct HalfScales {
  float value[256];
  HalfScales() {
    for (int s = 0; s < 255; ++s) value[s] = std::ldexp(1.0f, s - 128);
    value[255] = NAN;
  }
};
const HalfScales kHalfScales;

constexpr int kBlock = 32;          // values per scale
constexpr int kRegisterRows = 4;    // an expert with up to this many rows multiplies in registers
constexpr int kRowBlock = 64;       // rows of x that share a dequantized tile
constexpr int kTileFloats = 16384;  // the dequantized tile (fp32), sized for a core's L1 / L2
constexpr int64_t kMacsPerThread = 1 << 18;  // less work than this a thread: fewer threads (a fork costs more)

// Threads for `macs` multiply-adds: one per kMacsPerThread, at most `threads`.
inline int threads_for(int64_t macs, int threads) {
  return (int)std::max<int64_t>(1, std::min<int64_t>(threads, macs / kMacsPerThread));
}

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                            // to nearest, ties to even
  return (uint16_t)(u >> 16);
}

inline void store(void* out, bool bf16, int64_t i, float v) {
  if (bf16)
    static_cast<uint16_t*>(out)[i] = to_bf16(v);
  else
    static_cast<float*>(out)[i] = v;
}

#ifdef K3_MXFP4_AVX2
// The table and nibble mask decode_block takes (loaded once per call of its callers, outside their loops).
inline __m128i code_table() { return _mm_load_si128(reinterpret_cast<const __m128i*>(kCodesTimesTwo)); }
inline __m128i nibble_mask() { return _mm_set1_epi8(0x0f); }

// One 16-byte block of codes as its 32 doubled E2M1 values (exact fp32), in order: w[0] values 0..7, ..., w[3] 24..31.
inline void decode_block(const uint8_t* codes, __m128i table, __m128i nibble, __m256 w[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, nibble));
  const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
  const __m128i v0 = _mm_unpacklo_epi8(lo, hi), v1 = _mm_unpackhi_epi8(lo, hi);  // values 0..15, 16..31
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v0, v0)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v1, v1)));
}
#endif

// One weight row's values [k0, k0 + 32 * blocks) dequantized (exact fp32) into dst.
inline void dequantize_row(const uint8_t* codes, const uint8_t* scales, int64_t block0, int64_t blocks, float* dst) {
#ifdef K3_MXFP4_AVX2
  const __m128i table = code_table(), nibble = nibble_mask();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 w[4];
    decode_block(codes + (block0 + b) * 16, table, nibble, w);
    const __m256 s = _mm256_set1_ps(kHalfScales.value[scales[block0 + b]]);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(dst + b * kBlock + 8 * j, _mm256_mul_ps(w[j], s));
  }
#else
  for (int64_t b = 0; b < blocks; ++b) {
    const float s = kHalfScales.value[scales[block0 + b]];
    const uint8_t* c = codes + (block0 + b) * 16;
    float* d = dst + b * kBlock;
    for (int i = 0; i < 16; ++i) {
      d[2 * i] = (float)kCodesTimesTwo[c[i] & 0x0f] * s;
      d[2 * i + 1] = (float)kCodesTimesTwo[c[i] >> 4] * s;
    }
  }
#endif
}

#ifdef K3_MXFP4_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// rows (<= kRegisterRows) of x times one weight row, decoded from its codes in registers 32 values at a time:
// each 32-block's products with the doubled codes are summed, then scaled (a power of two) into the total.
template <int R>
void register_dots(const float* const* x, int64_t blocks, const uint8_t* codes, const uint8_t* scales, float* sums) {
  const __m128i table = code_table(), nibble = nibble_mask();
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 w[4];
    decode_block(codes + b * 16, table, nibble, w);
    const __m256 s = _mm256_set1_ps(kHalfScales.value[scales[b]]);
    for (int r = 0; r < R; ++r) {
      const float* xr = x[r] + b * kBlock;
      __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xr), w[0]);
      __m256 q = _mm256_mul_ps(_mm256_loadu_ps(xr + 8), w[1]);
      p = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], p);
      q = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], q);
      acc[r] = _mm256_fmadd_ps(_mm256_add_ps(p, q), s, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = hsum(acc[r]);
}

// One row x [k] times 4 weight rows (each `row_bytes` codes and `blocks` scales after the last): each row's sums
// are register_dots<1>'s, operation for operation (the four rows interleaved for independent chains).
void register_rows4(const float* x, int64_t blocks, const uint8_t* codes, int64_t row_bytes, const uint8_t* scales,
                    float* sums) {
  const __m128i table = code_table(), nibble = nibble_mask();
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8), x2 = _mm256_loadu_ps(xb + 16),
                 x3 = _mm256_loadu_ps(xb + 24);
    for (int r = 0; r < 4; ++r) {
      __m256 w[4];
      decode_block(codes + r * row_bytes + b * 16, table, nibble, w);
      const __m256 s = _mm256_set1_ps(kHalfScales.value[scales[r * blocks + b]]);
      __m256 p = _mm256_mul_ps(x0, w[0]);
      __m256 q = _mm256_mul_ps(x1, w[1]);
      p = _mm256_fmadd_ps(x2, w[2], p);
      q = _mm256_fmadd_ps(x3, w[3], q);
      acc[r] = _mm256_fmadd_ps(_mm256_add_ps(p, q), s, acc[r]);
    }
  }
  for (int r = 0; r < 4; ++r) sums[r] = hsum(acc[r]);
}

// R rows of x (stride ldx) times 4 dequantized weight rows (stride ldw), k a multiple of 8: sums[r * 4 + j].
template <int R>
void tile_dots(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* sums) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * ldx + i);
    for (int j = 0; j < 4; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + j * ldw + i);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(xv[r], wv, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) sums[r * 4 + j] = hsum(acc[r][j]);
}

// grad_x's R rows over 32 columns: sum over n of g[r, n] * w[n, 0:32] (w: n rows of 32 dequantized values).
template <int R>
void tile_axpy(const float* g, int64_t ldg, const float* w, int64_t n, float* out, int64_t ldo) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const float* wi = w + i * kBlock;
    const __m256 w0 = _mm256_loadu_ps(wi), w1 = _mm256_loadu_ps(wi + 8), w2 = _mm256_loadu_ps(wi + 16),
                 w3 = _mm256_loadu_ps(wi + 24);
    for (int r = 0; r < R; ++r) {
      const __m256 gv = _mm256_broadcast_ss(g + r * ldg + i);
      acc[r][0] = _mm256_fmadd_ps(gv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(gv, w1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(gv, w2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(gv, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + r * ldo + j * 8, acc[r][j]);
}
#else
template <int R>
void tile_dots(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* sums) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) {
      float s = 0.0f;
      for (int64_t i = 0; i < k; ++i) s += x[r * ldx + i] * w[j * ldw + i];
      sums[r * 4 + j] = s;
    }
}

template <int R>
void tile_axpy(const float* g, int64_t ldg, const float* w, int64_t n, float* out, int64_t ldo) {
  for (int r = 0; r < R; ++r) {
    float acc[kBlock] = {};
    for (int64_t i = 0; i < n; ++i)
      for (int j = 0; j < kBlock; ++j) acc[j] += g[r * ldg + i] * w[i * kBlock + j];
    std::memcpy(out + r * ldo, acc, sizeof(acc));
  }
}
#endif

// The rows of x as fp32: x itself, or its bf16 values widened (exactly) into `copy`.
const float* as_f32(const void* x, bool bf16, int64_t count, std::vector<float>& copy, int threads) {
  if (!bf16) return static_cast<const float*>(x);
  copy.resize(count);
  const uint16_t* src = static_cast<const uint16_t*>(x);
  float* dst = copy.data();
#pragma omp parallel for schedule(static) num_threads(threads_for(count * 16, threads))
  for (int64_t i = 0; i < count; ++i) dst[i] = k3::to_float(src[i]);
  return dst;
}

struct Work {
  int64_t expert, row0, row1, col0, col1;
};

// An expert's rows: [offsets[e - 1], offsets[e]) (offsets[-1] = 0).
inline int64_t first_row(const int64_t* offsets, int64_t e) { return e == 0 ? 0 : offsets[e - 1]; }

// The prologue both entry points share: checks the sizes and the expert offsets (1 if they do not fit), zeroes the
// output rows in no expert, and reads the first `end` (grouped) input rows of width `in_width` as fp32 into `data`
// (nullptr: nothing left to compute; 2 if the copy failed). `k` is the weights' row width (a multiple of 32).
inline int grouped_rows(const void* in, bool bf16, int64_t rows, int64_t in_width, int64_t out_width, int64_t k,
                        int64_t n_experts, const int64_t* offsets, void* out, int n_threads, int64_t& end,
                        std::vector<float>& copy, const float*& data) {
  data = nullptr;
  end = 0;
  if (rows < 0 || in_width < 0 || out_width < 0 || k % kBlock || n_experts < 0 || n_threads < 1) return 1;
  for (int64_t e = 0; e < n_experts; ++e)
    if (offsets[e] < first_row(offsets, e) || offsets[e] > rows) return 1;
  end = n_experts ? offsets[n_experts - 1] : 0;
  for (int64_t i = end * out_width; i < rows * out_width; ++i) store(out, bf16, i, 0.0f);  // rows in no expert
  if (end == 0 || out_width == 0) return 0;
  try {
    data = as_f32(in, bf16, end * in_width, copy, n_threads);
  } catch (...) {
    return 2;
  }
  return 0;
}

}  // namespace

extern "C" {

void k3_mxfp4_dots(const float* x, const uint8_t* codes, const uint8_t* scales, int64_t n, int k, float* out) {
  const int64_t blocks = k / kBlock, row_bytes = k / 2;
#ifdef K3_MXFP4_AVX2
  int64_t c = 0;
  for (; c + 4 <= n; c += 4) register_rows4(x, blocks, codes + c * row_bytes, row_bytes, scales + c * blocks, out + c);
  for (; c < n; ++c) register_dots<1>(&x, blocks, codes + c * row_bytes, scales + c * blocks, out + c);
#else
  float w[kBlock];
  for (int64_t c = 0; c < n; ++c) {
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      dequantize_row(codes + c * row_bytes, scales + c * blocks, b, 1, w);
      float block = 0.0f;
      for (int i = 0; i < kBlock; ++i) block += x[b * kBlock + i] * w[i];
      total += block;
    }
    out[c] = total;
  }
#endif
}

int k3_mxfp4_grouped_mm(const void* x, int x_bf16, int64_t rows, int k, const uint8_t* codes, const uint8_t* scales,
                        int64_t n_experts, int n, const int64_t* offsets, void* out, int n_threads) {
  const bool bf16 = x_bf16 != 0;
  int64_t end;
  std::vector<float> copy;
  const float* xf;
  const int status0 = grouped_rows(x, bf16, rows, k, n, k, n_experts, offsets, out, n_threads, end, copy, xf);
  if (status0 != 0 || xf == nullptr) return status0;
  const int64_t blocks = k / kBlock, row_bytes = k / 2;
  // tiles of weight rows dequantized at a time (a multiple of 4 rows, the product's register block)
  const int64_t tile = std::max<int64_t>(4, std::min<int64_t>(64, (kTileFloats / std::max(k, 1)) / 4 * 4));
  std::vector<Work> work;
  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t r0 = first_row(offsets, e), r1 = offsets[e];
    if (r1 == r0) continue;
    if (r1 - r0 <= kRegisterRows) {
      for (int64_t c = 0; c < n; c += 64) work.push_back({e, r0, r1, c, std::min<int64_t>(n, c + 64)});
    } else {
      for (int64_t r = r0; r < r1; r += kRowBlock)
        for (int64_t c = 0; c < n; c += 4 * tile)
          work.push_back({e, r, std::min(r1, r + kRowBlock), c, std::min<int64_t>(n, c + 4 * tile)});
    }
  }
  int status = 0;
#pragma omp parallel num_threads(threads_for(end * n * (int64_t)k, n_threads))
  {
    auto scratch = k3::new_scratch<k3::aligned_vector<float>>(status, (size_t)(tile * k));
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < (int64_t)work.size(); ++i) {
      if (!scratch) continue;
      const Work& item = work[i];
      const uint8_t* we = codes + item.expert * (int64_t)n * row_bytes;
      const uint8_t* se = scales + item.expert * (int64_t)n * blocks;
#ifdef K3_MXFP4_AVX2
      if (offsets[item.expert] - first_row(offsets, item.expert) <= kRegisterRows) {  // (a decode step's experts)
        const int64_t m = item.row1 - item.row0;
        const float* xr[kRegisterRows];
        for (int64_t r = 0; r < m; ++r) xr[r] = xf + (item.row0 + r) * k;
        float sums[kRegisterRows];
        for (int64_t c = item.col0; c < item.col1; ++c) {
          const uint8_t* wc = we + c * row_bytes;
          const uint8_t* sc = se + c * blocks;
          switch (m) {
            case 1: register_dots<1>(xr, blocks, wc, sc, sums); break;
            case 2: register_dots<2>(xr, blocks, wc, sc, sums); break;
            case 3: register_dots<3>(xr, blocks, wc, sc, sums); break;
            default: register_dots<4>(xr, blocks, wc, sc, sums); break;
          }
          for (int64_t r = 0; r < m; ++r) store(out, bf16, (item.row0 + r) * n + c, sums[r]);
        }
        continue;
      }
#endif
      float* w = scratch->data();
      for (int64_t c0 = item.col0; c0 < item.col1; c0 += tile) {
        const int64_t cols = std::min<int64_t>(tile, item.col1 - c0);
        for (int64_t j = 0; j < cols; ++j)
          dequantize_row(we + (c0 + j) * row_bytes, se + (c0 + j) * blocks, 0, blocks, w + j * k);
        const int64_t padded = (cols + 3) / 4 * 4;
        std::fill(w + cols * k, w + padded * k, 0.0f);
        float sums[12];
        for (int64_t r = item.row0; r < item.row1; r += 3) {
          const int rr = (int)std::min<int64_t>(3, item.row1 - r);
          for (int64_t j = 0; j < padded; j += 4) {
            const float* xr = xf + r * k;
            if (rr == 3)
              tile_dots<3>(xr, k, w + j * k, k, k, sums);
            else if (rr == 2)
              tile_dots<2>(xr, k, w + j * k, k, k, sums);
            else
              tile_dots<1>(xr, k, w + j * k, k, k, sums);
            for (int a = 0; a < rr; ++a)
              for (int b = 0; b < 4 && j + b < cols; ++b) store(out, bf16, (r + a) * n + c0 + j + b, sums[a * 4 + b]);
          }
        }
      }
    }
  }
  return status;
}

int k3_mxfp4_grouped_mm_backward(const void* grad, int grad_bf16, int64_t rows, int n, const uint8_t* codes,
                                 const uint8_t* scales, int64_t n_experts, int k, const int64_t* offsets,
                                 void* grad_x, int n_threads) {
  const bool bf16 = grad_bf16 != 0;
  int64_t end;
  std::vector<float> copy;
  const float* gf;
  const int status0 = grouped_rows(grad, bf16, rows, n, k, k, n_experts, offsets, grad_x, n_threads, end, copy, gf);
  if (status0 != 0 || gf == nullptr) return status0;
  const int64_t blocks = k / kBlock, row_bytes = k / 2;
  std::vector<Work> work;  // (expert, rows, 32-blocks of grad_x's columns)
  const int64_t span = std::max<int64_t>(1, std::min<int64_t>(blocks, 8));
  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t r0 = first_row(offsets, e), r1 = offsets[e];
    for (int64_t r = r0; r < r1; r += kRowBlock)
      for (int64_t b = 0; b < blocks; b += span)
        work.push_back({e, r, std::min(r1, r + kRowBlock), b, std::min(blocks, b + span)});
  }
  int status = 0;
#pragma omp parallel num_threads(threads_for(end * n * (int64_t)k, n_threads))
  {
    auto scratch = k3::new_scratch<k3::aligned_vector<float>>(status, (size_t)n * kBlock);
    float sums[3 * kBlock];
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < (int64_t)work.size(); ++i) {
      if (!scratch) continue;
      const Work& item = work[i];
      const uint8_t* we = codes + item.expert * (int64_t)n * row_bytes;
      const uint8_t* se = scales + item.expert * (int64_t)n * blocks;
      float* w = scratch->data();
      for (int64_t b = item.col0; b < item.col1; ++b) {
        for (int64_t c = 0; c < n; ++c) dequantize_row(we + c * row_bytes, se + c * blocks, b, 1, w + c * kBlock);
        for (int64_t r = item.row0; r < item.row1; r += 3) {
          const int rr = (int)std::min<int64_t>(3, item.row1 - r);
          const float* g = gf + r * n;
          if (rr == 3)
            tile_axpy<3>(g, n, w, n, sums, kBlock);
          else if (rr == 2)
            tile_axpy<2>(g, n, w, n, sums, kBlock);
          else
            tile_axpy<1>(g, n, w, n, sums, kBlock);
          for (int a = 0; a < rr; ++a)
            for (int j = 0; j < kBlock; ++j) store(grad_x, bf16, (r + a) * k + b * kBlock + j, sums[a * kBlock + j]);
        }
      }
    }
  }
  return status;
}

}  // extern "C"
