// out = a b^T for bf16 a [M, K] and b [N, K] with fp32 output, on the AMX tile unit (Sapphire Rapids and later):
// the router's logits of a bf16 model (spec 6.3: logits in fp32 from the bf16 hidden state and router weight).
// torch has no CPU matmul from bf16 operands to an fp32 result (a bf16 matmul rounds its output to bf16), so
// the PyTorch path upcasts both and runs an fp32 GEMM, at a fifth of the bf16 tile rate on this machine.
//
// The result is the same quantity: every product of two bf16 values is exact in fp32 and the products are
// summed in fp32 (TDPBF16PS: pairs of products added into fp32 accumulators, round to nearest even); only the
// order of the sums differs from an fp32 GEMM's (any two fp32 GEMMs differ that way). The tile unit treats bf16
// subnormal inputs (|x| < 1.2e-38) as zero and flushes subnormal results.
//
// Layout: a [M, K], b [N, K] (row-major bf16 bits), out [M, N] fp32. b is packed once per call into the tile
// unit's pair-interleaved order, a per block of 32 rows (zero-padded to whole tiles, so any M, N, K work).

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "common.h"
#include "bf16_rows.h"
#include "small_gemm.h"
#include "amx_tiles.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define K3_HAVE_AMX 1
#else
#define K3_HAVE_AMX 0
#endif

#if K3_HAVE_AMX
namespace {

constexpr int kRows = 16;      // rows of a tile
constexpr int kPairs = 16;     // rows of a B tile: pairs of k
constexpr int kKBlock = 32;    // bf16 values of k per A tile row (64 bytes)
constexpr int kTileElems = 512;  // bf16 values in a 16 x 64-byte tile

// Linux hands the tile registers' state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); once per process, for every thread.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// Palette 1, eight 16-row x 64-byte tiles: 0-3 the fp32 accumulators (16 x 16) of a 32 x 32 block of out, 4-5
// two A tiles (16 rows x 32 k), 6-7 two B tiles (16 k pairs x 16 columns x 2).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = kRows;
    }
  }
};

// b [N, K] as tiles: for each block of 16 columns (rows of b) and each block of 32 k, a 16 x 32 tile whose row p
// holds (b[n][k0 + 2p], b[n][k0 + 2p + 1]) for n = 0..15, zero past N or K. Column blocks in pairs (n_blocks
// rounded up to even), each block's k tiles contiguous. A whole tile is the transpose of a 16 x 16 block of
// 32-bit words (pairs of bf16), done in registers; edge tiles element by element.
void pack_b(const uint16_t* b, int64_t n, int k, int64_t n_blocks, int k_blocks, uint16_t* packed) {
#pragma omp for schedule(static)
  for (int64_t nb = 0; nb < n_blocks; ++nb)
    for (int kb = 0; kb < k_blocks; ++kb) {
      uint16_t* tile = packed + (nb * k_blocks + kb) * kTileElems;
      if (k % 2 == 0 && (nb + 1) * 16 <= n && (kb + 1) * kKBlock <= k) {
        k3::transpose(reinterpret_cast<const float*>(b + nb * 16 * k + kb * kKBlock), 16, 16, k / 2,
                      reinterpret_cast<float*>(tile));  // (bit patterns moved, never read as floats)
        continue;
      }
      for (int p = 0; p < kPairs; ++p)
        for (int c = 0; c < 16; ++c)
          for (int j = 0; j < 2; ++j) {
            const int64_t row = nb * 16 + c;
            const int kk = kb * kKBlock + 2 * p + j;
            tile[p * 32 + 2 * c + j] = row < n && kk < k ? b[row * k + kk] : 0;
          }
    }
}

// Tiles 0-3 = the 32 x 32 block of a_block [32, lda] (bf16, zero-padded rows) times the pair np of packed b's
// 16-column blocks: (rows 0-15, 16-31) x (columns 0-15, 16-31).
inline void pair_product(const uint16_t* a_block, int64_t lda, const uint16_t* packed, int64_t np, int k_blocks) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint16_t* b0 = packed + (2 * np) * k_blocks * kTileElems;
  const uint16_t* b1 = b0 + (int64_t)k_blocks * kTileElems;
  for (int kb = 0; kb < k_blocks; ++kb) {
    const uint16_t* ak = a_block + kb * kKBlock;
    _tile_loadd(4, ak, lda * 2);
    _tile_loadd(5, ak + 16 * lda, lda * 2);
    _tile_loadd(6, b0 + kb * kTileElems, 64);
    _tile_loadd(7, b1 + kb * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// Fewer than kAmxMinRows rows of a (a decode step): packing b for the tile unit would cost more than the
// products, so each output is an AVX-512 dot product over k (bf16_rows.h: b's rows read once per group of 4 rows of
// a, the threads splitting b's rows). At the router's weight the tile unit's cost is mostly packing b, which a few
// rows do not repay (timings: bench/RESULTS.md).
constexpr int64_t kAmxMinRows = 12;
static_assert(kAmxMinRows - 1 <= k3::bf16_rows::kMaxRows, "the few-row products take up to 15 rows");

}  // namespace
#endif

// The tile unit's pieces for other kernels (amx_tiles.h): the router's screened selection (router_cpu.cpp).
namespace k3 {
namespace amx {

bool available() {
#if K3_HAVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

int64_t packed_elements(int64_t n, int k) {
  const int64_t k_blocks = (k + 31) / 32, n_pairs = (n + 31) / 32;
  return 2 * n_pairs * k_blocks * 512;  // (kTileElems bf16 values per tile)
}

void pack(const uint16_t* b, int64_t n, int k, uint16_t* packed) {
#if K3_HAVE_AMX
  const int k_blocks = (k + kKBlock - 1) / kKBlock;
  // (called by a whole team of threads, its work-sharing loop splits the tiles; outside a parallel region, serial)
  pack_b(b, n, k, 2 * ((n + 31) / 32), k_blocks, packed);
#else
  (void)b, (void)n, (void)k, (void)packed;
#endif
}

void begin() {
#if K3_HAVE_AMX
  static const TileConfig config;
  _tile_loadconfig(&config);
#endif
}

void end() {
#if K3_HAVE_AMX
  _tile_release();
#endif
}

void block(const uint16_t* a_block, int64_t lda, const uint16_t* packed, int64_t n, int k, float* out, int64_t ldo) {
#if K3_HAVE_AMX
  const int k_blocks = (k + kKBlock - 1) / kKBlock;
  const int64_t n_pairs = (n + 31) / 32;
  for (int64_t np = 0; np < n_pairs; ++np) {
    pair_product(a_block, lda, packed, np, k_blocks);
    float* o = out + np * 32;
    _tile_stored(0, o, ldo * 4);
    _tile_stored(1, o + 16, ldo * 4);
    _tile_stored(2, o + 16 * ldo, ldo * 4);
    _tile_stored(3, o + 16 * ldo + 16, ldo * 4);
  }
#else
  (void)a_block, (void)lda, (void)packed, (void)n, (void)k, (void)out, (void)ldo;
#endif
}

}  // namespace amx
}  // namespace k3

extern "C" {

// 1 if this build and this process can use the AMX tile unit for k3_gemm_bf16_f32, else 0.
int k3_amx_available() {
#if K3_HAVE_AMX
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// out [M, N] fp32 = a [M, K] b [N, K]^T, a and b bf16 (see the top of this file; fewer than 12 rows: bf16_rows.h).
// Returns 0 on success, 1 on invalid arguments or without AMX, 2 if scratch memory could not be allocated.
int k3_gemm_bf16_f32(const uint16_t* a, const uint16_t* b, int64_t m, int64_t n, int k, float* out, int n_threads) {
#if K3_HAVE_AMX
  if (m < 0 || n < 0 || k <= 0 || n_threads <= 0 || !amx_permitted()) return 1;
  if (m == 0 || n == 0) return 0;
  if (m < kAmxMinRows) {
    k3::bf16_rows::product(a, m, b, n, k, nullptr, out, nullptr, n_threads);
    return 0;
  }
  const int k_blocks = (k + kKBlock - 1) / kKBlock;
  const int64_t n_pairs = (n + 31) / 32, m_blocks = (m + 31) / 32;
  k3::aligned_vector<uint16_t> packed;
  try {
    packed.resize((size_t)k3::amx::packed_elements(n, k));
  } catch (...) {
    return 2;
  }
  const int64_t lda = (int64_t)k_blocks * kKBlock;  // a block's padded row length
  int status = 0;
#pragma omp parallel num_threads(n_threads)
  {
    pack_b(b, n, k, 2 * n_pairs, k_blocks, packed.data());  // (ends with the work-sharing loop's barrier)
    k3::aligned_vector<uint16_t> a_block;  // (empty if the allocation failed: the thread skips its blocks)
    k3::aligned_vector<float> edge;
    try {
      a_block.resize(32 * lda);
      edge.resize(32 * 32);
    } catch (...) {
      a_block.clear();
#pragma omp atomic write
      status = 2;
    }
    const bool ready = !a_block.empty();
    const TileConfig config;
    if (ready) _tile_loadconfig(&config);
#pragma omp for schedule(static)
    for (int64_t mb = 0; mb < m_blocks; ++mb) {
      if (!ready) continue;
      const int64_t m0 = mb * 32;
      const int rows = (int)std::min<int64_t>(32, m - m0);
      for (int r = 0; r < 32; ++r) {  // the block's rows of a, zero-padded to whole tiles
        uint16_t* dst = a_block.data() + r * lda;
        if (r < rows) {
          std::memcpy(dst, a + (m0 + r) * k, sizeof(uint16_t) * k);
          std::memset(dst + k, 0, sizeof(uint16_t) * (lda - k));
        } else {
          std::memset(dst, 0, sizeof(uint16_t) * lda);
        }
      }
      for (int64_t np = 0; np < n_pairs; ++np) {
        pair_product(a_block.data(), lda, packed.data(), np, k_blocks);
        const int64_t n0 = np * 32;
        const int cols = (int)std::min<int64_t>(32, n - n0);
        if (rows == 32 && cols == 32) {
          float* o = out + m0 * n + n0;
          _tile_stored(0, o, n * 4);
          _tile_stored(1, o + 16, n * 4);
          _tile_stored(2, o + 16 * n, n * 4);
          _tile_stored(3, o + 16 * n + 16, n * 4);
        } else {  // an edge block: through a 32 x 32 buffer, its valid part copied out
          _tile_stored(0, edge.data(), 32 * 4);
          _tile_stored(1, edge.data() + 16, 32 * 4);
          _tile_stored(2, edge.data() + 16 * 32, 32 * 4);
          _tile_stored(3, edge.data() + 16 * 32 + 16, 32 * 4);
          for (int r = 0; r < rows; ++r)
            std::memcpy(out + (m0 + r) * n + n0, edge.data() + r * 32, sizeof(float) * cols);
        }
      }
    }
    if (ready) _tile_release();
  }
  return status;
#else
  (void)a;
  (void)b;
  (void)m;
  (void)n;
  (void)k;
  (void)out;
  (void)n_threads;
  return 1;
#endif
}

}  // extern "C"
