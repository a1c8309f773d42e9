// 16 fp32 lanes as one type for the experts kernel's vector code (small_gemm.h, glu_simd.h): an AVX-512 register,
// or two AVX2 registers on CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2 / 3, Intel client cores since Alder
// Lake). On AVX-512 each function is the one intrinsic its name says, so the code compiles to what it did when it
// was written with the intrinsics; on AVX2 the same operation on both halves, with these differences:
// * masked loads and stores (a row's last, partial vector) use vmaskmov, which also suppresses faults on the
//   masked-off lanes; bf16 ones go through a 16-element buffer;
// * reciprocal() divides (AVX2's 12-bit estimate and one Newton step would leave ~2^-22 of error);
// * scalef() builds 2^n from its exponent bits, 0 below 2^-126 (where vscalef gives a subnormal, which the kernels'
//   flush-to-zero mode flushes anyway).
// Without either, K3_HAVE_SIMD is 0 and the callers take their scalar forms and sgemm.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define K3_HAVE_SIMD 1
#define K3_HAVE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define K3_HAVE_SIMD 1
#define K3_HAVE_AVX512 0
#else
#define K3_HAVE_SIMD 0
#define K3_HAVE_AVX512 0
#endif

#if K3_HAVE_SIMD
namespace k3 {
namespace simd {

constexpr int kLanes = 16;

#if K3_HAVE_AVX512
using vf = __m512;
using vi = __m512i;
using vmask = __mmask16;  // the lanes where a comparison holds

inline vf zero() { return _mm512_setzero_ps(); }
inline vf splat(float x) { return _mm512_set1_ps(x); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const float* p, uint16_t m) { return _mm512_maskz_loadu_ps(m, p); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void store(float* p, uint16_t m, vf v) { _mm512_mask_storeu_ps(p, m, v); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a b + c
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline vf abs(vf a) { return _mm512_abs_ps(a); }
inline float reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
inline vmask less(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }  // (false where either is NaN)
inline bool all(vmask m) { return m == 0xFFFF; }
inline vf blend(vmask m, vf a, vf b) { return _mm512_mask_blend_ps(m, a, b); }  // b where m, else a
inline vf round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf scalef(vf a, vf n) { return _mm512_scalef_ps(a, n); }  // a 2^n, n integral
// 1 / d for d in [1, 8] (a 14-bit estimate and one Newton step: ~2 ulp)
inline vf reciprocal(vf d) {
  const vf r = _mm512_rcp14_ps(d);
  return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, splat(1.0f)), r);
}
// |m| with the sign of x
inline vf with_sign(vf m, vf x) {
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(m), _mm512_castps_si512(x),
                                                       _mm512_set1_epi32((int)0x80000000u), 0xD8));
}

// bf16 (raw bits) read as fp32, exactly: the 16 bits are the top half of the float
inline vf load(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline vf load(const uint16_t* p, uint16_t m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// v rounded to bf16 as torch rounds (c10::BFloat16: to nearest, ties to even; any NaN -> 0x7FC0), the 16 bits in
// the low half of each 32-bit lane
inline vi bf16_bits(vf v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
// v rounded to bf16 values (bf16_bits), as fp32
inline vf bf16_round(vf v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
// the lanes of m of v, rounded to bf16 (bf16_bits), at p
inline void store_bf16(uint16_t* p, uint16_t m, vf v) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

#else  // AVX2 + FMA: two 8-lane halves
struct vf {
  __m256 lo, hi;
};
struct vi {
  __m256i lo, hi;
};
struct vmask {
  __m256 lo, hi;  // all ones where the comparison holds
};

// the lanes of bits 0-7 of `bits` as all-ones 32-bit lanes (vmaskmov's mask)
inline __m256i lanes8(unsigned bits) {
  const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), select), select);
}
inline vf zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline vf load(const float* p, uint16_t m) {
  if (m == 0xFFFF) return load(p);
  return {_mm256_maskload_ps(p, lanes8(m & 0xFFu)), _mm256_maskload_ps(p + 8, lanes8(m >> 8))};
}
inline void store(float* p, vf v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void store(float* p, uint16_t m, vf v) {
  if (m == 0xFFFF) return store(p, v);
  _mm256_maskstore_ps(p, lanes8(m & 0xFFu), v.lo);
  _mm256_maskstore_ps(p + 8, lanes8(m >> 8), v.hi);
}
inline vf add(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf sub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf mul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf min(vf a, vf b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline vf fmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf fnmadd(vf a, vf b, vf c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline __m256 sign_bit() { return _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u)); }
inline vf abs(vf a) { return {_mm256_andnot_ps(sign_bit(), a.lo), _mm256_andnot_ps(sign_bit(), a.hi)}; }
inline float reduce_add(__m256 s) {  // (one 8-lane half)
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline float reduce_add(vf a) { return reduce_add(_mm256_add_ps(a.lo, a.hi)); }
inline vmask less(vf a, vf b) {
  return {_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ)};
}
inline bool all(vmask m) { return (_mm256_movemask_ps(m.lo) & _mm256_movemask_ps(m.hi)) == 0xFF; }
inline vf blend(vmask m, vf a, vf b) {
  return {_mm256_blendv_ps(a.lo, b.lo, m.lo), _mm256_blendv_ps(a.hi, b.hi, m.hi)};
}
inline vf round(vf a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
// a 2^n for integral n <= 127: 2^n from its exponent bits, 0 for n < -126 (NaN n: 0, so a NaN a stays NaN)
inline __m256 scalef(__m256 a, __m256 n) {
  const __m256i e = _mm256_max_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(-127));
  return _mm256_mul_ps(a, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)));
}
inline vf scalef(vf a, vf n) { return {scalef(a.lo, n.lo), scalef(a.hi, n.hi)}; }
inline vf reciprocal(vf d) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return {_mm256_div_ps(one, d.lo), _mm256_div_ps(one, d.hi)};
}
inline vf with_sign(vf m, vf x) {
  const __m256 s = sign_bit();
  return {_mm256_or_ps(_mm256_andnot_ps(s, m.lo), _mm256_and_ps(s, x.lo)),
          _mm256_or_ps(_mm256_andnot_ps(s, m.hi), _mm256_and_ps(s, x.hi))};
}

inline __m256 widen_bf16(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
// 8 lanes (one half): fp32, or bf16 read as fp32
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf load(const uint16_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {widen_bf16(_mm256_castsi256_si128(b)), widen_bf16(_mm256_extracti128_si256(b, 1))};
}
inline vf load(const uint16_t* p, uint16_t m) {
  if (m == 0xFFFF) return load(p);
  alignas(32) uint16_t buffer[kLanes] = {};
  for (int i = 0; i < kLanes; ++i)
    if (m >> i & 1u) buffer[i] = p[i];
  return load(buffer);
}

inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline vi bf16_bits(vf v) { return {bf16_bits(v.lo), bf16_bits(v.hi)}; }
inline vf bf16_round(vf v) {
  const vi b = bf16_bits(v);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(b.lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b.hi, 16))};
}
inline void store_bf16(uint16_t* p, uint16_t m, vf v) {
  const vi b = bf16_bits(v);
  // (packus keeps the 16-bit values, < 0x10000, in 128-bit lanes: permute them into order)
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b.lo, b.hi), 0xD8);
  if (m == 0xFFFF) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  alignas(32) uint16_t buffer[kLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buffer), packed);
  for (int i = 0; i < kLanes; ++i)
    if (m >> i & 1u) p[i] = buffer[i];
}
#endif

}  // namespace simd
}  // namespace k3
#endif
