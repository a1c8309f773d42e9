// The AMX tile unit's bf16 x bf16 -> fp32 products as pieces (amx_cpu.cpp), for kernels that consume a block of
// products while it is in cache: the router's screened top-k (router_cpu.cpp) turns each 32-token block of
// approximate logits into candidates before the next block is computed.
#pragma once

#include <cstdint>

namespace k3 {
namespace amx {

// Whether this build and this process can use the tile unit (the registers granted by the OS).
bool available();
// uint16 elements of b [n, k] packed for `block`.
int64_t packed_elements(int64_t n, int k);
// b [n, k] (bf16 bits, row-major) into the tile unit's pair-interleaved order, zero-padded to whole tiles.
void pack(const uint16_t* b, int64_t n, int k, uint16_t* packed);
// Load / release this thread's tile configuration around calls of `block`.
void begin();
void end();
// out [32, ceil(n / 32) * 32] (row stride ldo floats) = a_block [32, lda] b^T: a_block holds 32 rows of bf16 bits,
// zero-padded to lda = ceil(k / 32) * 32 columns; the columns of out past n are zero.
void block(const uint16_t* a_block, int64_t lda, const uint16_t* packed, int64_t n, int k, float* out, int64_t ldo);

}  // namespace amx
}  // namespace k3
