// The whole latent MoE layer (transformers_k3.modeling_kimi_k3.KimiK3SparseMoE) for a few tokens without autograd, a
// decode step: router, selection, latent down-projection, routed experts, the norm on their sum, up-projection
// and shared expert in one call, on one thread, on AVX-512 or AVX2 + FMA.
//
// Through the modules a decode step of this layer is ~15 torch ops and kernel calls, whose fixed costs at these
// sizes are nearly all of its time (the arithmetic is a small part). Here every product is a dot product over its
// input (the weights' rows, as stored), summed in fp32 in 16 lanes, then across them.
//
// The quantities are the modules' own, step by step, with the sums in another order (as between any two GEMMs):
// * bf16 layers round where the modules round: each projection's output, the experts' sum, the norm's output,
//   the shared expert's GLU and the final sum are rounded to bf16 (to nearest, ties to even); the router's
//   logits stay fp32. The projections the modules run in linear_cpu.cpp, and the router's logits the modules
//   take from amx_cpu.cpp on a CPU with the tile unit (its few-row case), are those kernels' own products
//   (bf16_rows.h), so those are the modules' bits (without the tile unit the modules' router logits are torch's
//   fp32 GEMM of the upcast operands: the same values, the sums in another order). The experts' products and the
//   norm's sum of squares are summed in another order than the experts kernel's and torch's, so where an fp32
//   value lies next to a bf16 rounding tie it can round the other way (about 1 token in 400 of a random sample
//   differs from the modules, by an ulp there and a few after it).
// * the selection is k3_router_sigmoid_topk's on those logits (sigmoid scores, the bias for the choice only,
//   ties to the lower id), the weights the chosen scores renormalized over the k and scaled.
// * the GLUs are the experts kernel's (glu_simd.h), the routing weight applied to the GLU output as there.
// * packed MXFP4 experts (the release's codes and E8M0 scales, mxfp4_cpu.cpp's layout): each product is
//   k3_mxfp4_dots's (k3_mxfp4_grouped_mm's sums for a decode row), rounded where the packed experts' modules
//   (transformers_k3.ops.mxfp4.mxfp4_experts) round in a bf16 layer: the gate/up product and the GLU output to
//   bf16, the GLU output then times the routing weight in fp32, the down product and the experts' sum in fp32.
//
// Layout: row-major; y [N, H] and out [N, H] in the layer's dtype (fp32, or bf16 as raw bits), N <= kMaxTokens;
// every weight as its module stores it ([out, in]; the experts [E, 2I, D] and [E, D, I]), in the layer's dtype,
// except the router's weight, fp32 where `router_fp32`, and packed experts (uint8 codes [E, 2I, D/2] / [E, D, I/2]
// with scales [E, 2I, D/32] / [E, D, I/32]); the selection bias fp32 [E].

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_rows.h"
#include "common.h"
#include "glu_simd.h"
#include "kernels.h"
#include "small_gemm.h"

#if K3_HAVE_SIMD
namespace {

constexpr int kMaxTokens = 4;

// v[0 .. n) rounded to bf16 values (as torch rounds), kept as fp32.
void round_bf16(float* v, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const uint16_t m = k3::lane_mask(n - i);
    k3::simd::store(v + i, m, k3::simd::bf16_round(k3::simd::load(v + i, m)));
  }
}

// The layer's weights and sizes (one decode call's arguments).
struct Layer {
  bool bf16;
  int hidden, latent, inter, shared_inter, top_k;
  int64_t n_experts;
  const void *router, *down_latent, *norm, *up_latent, *gate_up, *down, *shared_gate, *shared_up, *shared_down;
  const uint8_t *gate_up_scale, *down_scale;  // (null: the experts are not packed)
  // (null norm: none)
  bool router_fp32, renormalize;
  const float* bias;
  float scale, eps;
  int act_kind;
  float act_beta, act_linear_beta;
};

// out [n] = x [k] w [n, k]^T with w in the layer's dtype (fp32 x); in a bf16 layer the products are
// bf16_rows.h's (as linear_cpu.cpp runs the module's projection: `x16` holds x's bf16 bits) and the result is
// rounded to bf16, as the module's output is.
void project(const Layer& l, const float* x, const uint16_t* x16, const void* w, int64_t n, int k, float* out) {
  if (!l.bf16) return k3::dots(x, static_cast<const float*>(w), n, k, out);
  k3::bf16_rows::product(x16, 1, static_cast<const uint16_t*>(w), n, k, nullptr, out, nullptr, 1);
  round_bf16(out, n);
}

// One token: y (fp32 values of the layer's dtype) -> out (the same).
int token(const Layer& l, const float* y, const uint16_t* y16, float* out) {
  const int H = l.hidden, D = l.latent > 0 ? l.latent : l.hidden, I = l.inter;
  std::vector<float> logits(l.n_experts), scores(l.top_k), z(D), acc(D, 0.0f), h(2 * I), glu(I), o(D);
  std::vector<int64_t> index(l.top_k);
  std::vector<uint16_t> bits(std::max(D, l.shared_inter));  // a bf16 layer's projection inputs

  // router: fp32 logits; with a bf16 weight the products of the bf16 values (bf16_rows.h, as the module's)
  if (l.bf16 && !l.router_fp32)
    k3::bf16_rows::product(y16, 1, static_cast<const uint16_t*>(l.router), l.n_experts, H, nullptr, logits.data(),
                           nullptr, 1);
  else
    k3::dots(y, static_cast<const float*>(l.router), l.n_experts, H, logits.data());
  const int status = k3_router_sigmoid_topk(logits.data(), l.bias, 1, l.n_experts, l.top_k, index.data(),
                                            scores.data(), 1);
  if (status != 0) return status;
  float total = 0.0f;
  for (int j = 0; j < l.top_k; ++j) total += scores[j];
  for (int j = 0; j < l.top_k; ++j)
    scores[j] = (l.renormalize ? scores[j] / (total + 1e-20f) : scores[j]) * l.scale;

  // the routed experts on the latent (or the input itself)
  const float* x = y;
  if (l.latent > 0) {
    project(l, y, y16, l.down_latent, D, H, z.data());
    x = z.data();
  }
  const int64_t gate_up_size = (int64_t)2 * I * D, down_size = (int64_t)D * I;
  const int elem = l.bf16 ? 2 : 4;
  for (int j = 0; j < l.top_k && l.gate_up_scale != nullptr; ++j) {  // packed MXFP4 experts
    const int64_t e = index[j];
    const uint8_t* gu = static_cast<const uint8_t*>(l.gate_up) + e * gate_up_size / 2;
    const uint8_t* dn = static_cast<const uint8_t*>(l.down) + e * down_size / 2;
    k3_mxfp4_dots(x, gu, l.gate_up_scale + e * gate_up_size / 32, 2 * I, D, h.data());
    const float one = 1.0f;
    if (l.bf16) round_bf16(h.data(), 2 * I);
    if (l.bf16 && l.act_kind == 0) {  // (bf16 SiLU: torch's silu, then the product, each rounded)
      for (int i = 0; i < I; ++i) glu[i] = h[i] / (1.0f + std::exp(-h[i]));
      round_bf16(glu.data(), I);
      for (int i = 0; i < I; ++i) glu[i] *= h[I + i];
    } else {
      k3::glu::rows<false>(h.data(), nullptr, l.bf16 ? &one : &scores[j], glu.data(), nullptr, 1, I, l.act_kind,
                           l.act_beta, l.act_linear_beta);
    }
    if (l.bf16) {
      round_bf16(glu.data(), I);
      for (int i = 0; i < I; ++i) glu[i] *= scores[j];
    }
    k3_mxfp4_dots(glu.data(), dn, l.down_scale + e * down_size / 32, D, I, o.data());
    for (int i = 0; i < D; ++i) acc[i] += o[i];
  }
  for (int j = 0; j < l.top_k && l.gate_up_scale == nullptr; ++j) {
    const char* gu = static_cast<const char*>(l.gate_up) + index[j] * gate_up_size * elem;
    const char* dn = static_cast<const char*>(l.down) + index[j] * down_size * elem;
    if (l.bf16)  // (the experts kernel's products: fp32 from the bf16 values, exactly)
      k3::dots(x, reinterpret_cast<const uint16_t*>(gu), 2 * I, D, h.data());
    else
      k3::dots(x, reinterpret_cast<const float*>(gu), 2 * I, D, h.data());
    k3::glu::rows<false>(h.data(), nullptr, &scores[j], glu.data(), nullptr, 1, I, l.act_kind, l.act_beta,
                         l.act_linear_beta);
    if (l.bf16)
      k3::dots(glu.data(), reinterpret_cast<const uint16_t*>(dn), D, I, o.data());
    else
      k3::dots(glu.data(), reinterpret_cast<const float*>(dn), D, I, o.data());
    for (int i = 0; i < D; ++i) acc[i] += o[i];
  }
  if (l.bf16) round_bf16(acc.data(), D);  // (the experts' output, in the layer's dtype)

  float* routed = out;  // [H]
  if (l.latent > 0) {
    if (l.norm != nullptr) {  // F.rms_norm on the fp32 values, times the weight; rounded in a bf16 layer
      float sum = 0.0f;
      for (int i = 0; i < D; ++i) sum += acc[i] * acc[i];
      const float r = 1.0f / std::sqrt(sum / (float)D + l.eps);
      for (int i = 0; i < D; ++i) {
        const float w = l.bf16 ? k3::to_float(static_cast<const uint16_t*>(l.norm)[i])
                               : static_cast<const float*>(l.norm)[i];
        acc[i] = acc[i] * r * w;
      }
      if (l.bf16) round_bf16(acc.data(), D);
    }
    if (l.bf16) k3::float_to_bf16(acc.data(), D, bits.data());
    project(l, acc.data(), bits.data(), l.up_latent, H, D, routed);
  } else {
    std::memcpy(routed, acc.data(), sizeof(float) * H);
  }

  if (l.shared_inter > 0) {  // the shared expert at full width, added to the routed output
    const int S = l.shared_inter;
    std::vector<float> gate_up(2 * S), act(S), s(H);
    project(l, y, y16, l.shared_gate, S, H, gate_up.data());
    project(l, y, y16, l.shared_up, S, H, gate_up.data() + S);
    const float one = 1.0f;
    k3::glu::rows<false>(gate_up.data(), nullptr, &one, act.data(), nullptr, 1, S, l.act_kind, l.act_beta,
                         l.act_linear_beta);
    if (l.bf16) {
      round_bf16(act.data(), S);
      k3::float_to_bf16(act.data(), S, bits.data());
    }
    project(l, act.data(), bits.data(), l.shared_down, H, S, s.data());
    for (int i = 0; i < H; ++i) routed[i] += s[i];
    if (l.bf16) round_bf16(routed, H);
  }
  return 0;
}

}  // namespace
#endif

extern "C" {

// The most tokens k3_moe_decode takes (0 where it cannot run: neither AVX-512 nor AVX2).
int k3_moe_decode_max_tokens() {
#if K3_HAVE_SIMD
  return kMaxTokens;
#else
  return 0;
#endif
}

// out [N, H] = the MoE layer on y [N, H] (see the top of this file), the layer described once by
// desc (int64) = {hidden, bf16, router, router_fp32, bias, E, k, renormalize, down_latent, latent, norm, up_latent,
//                 gate_up, down, inter, act_kind, shared_gate, shared_up, shared_down, shared_inter,
//                 gate_up_scale, down_scale}
// params (fp32) = {scale, eps, act_beta, act_linear_beta}
// (pointers as integers; `bf16`: y, out and the weights are bf16 bits, the router's weight fp32 where
// `router_fp32`; `latent` 0: no latent projections, `norm` 0: no norm on the latent; `shared_inter` 0: no shared
// expert; `gate_up_scale` 0: the experts in the layer's dtype, else packed MXFP4 (`gate_up` and `down` their
// codes, both widths multiples of 32); the activation as k3_moe_experts_forward's: kind 0 SiLU, 1 SiTU with beta
// and the up half's cap, <= 0 none), so that a decode step's call passes five arguments. Returns 0, 1 on invalid
// arguments or where it cannot run (N > kMaxTokens, no AVX-512 or AVX2), 3 where the selection kernel is
// unavailable (k3_router_sigmoid_topk's status).
int k3_moe_decode(const int64_t* desc, const float* params, const void* y, int64_t n_tokens, void* out) {
#if K3_HAVE_SIMD
  auto ptr = [&](int i) { return reinterpret_cast<const void*>(static_cast<intptr_t>(desc[i])); };
  const int hidden = (int)desc[0], top_k = (int)desc[6], latent = (int)desc[9], inter = (int)desc[14];
  const int act_kind = (int)desc[15], shared_inter = (int)desc[19];
  const int64_t n_experts = desc[5];
  const float act_beta = params[2];
  if (n_tokens < 0 || n_tokens > kMaxTokens || hidden <= 0 || n_experts <= 0 || top_k < 1 || top_k > 16 ||
      top_k > n_experts || latent < 0 || inter <= 0 || shared_inter < 0 ||
      (act_kind != 0 && !(act_kind == 1 && act_beta > 0.0f)))
    return 1;
  const bool packed = desc[20] != 0;
  if (packed != (desc[21] != 0) || (packed && (((latent > 0 ? latent : hidden) % 32) != 0 || inter % 32 != 0)))
    return 1;
  const k3::FlushDenormals flush;  // (as the experts kernel and the GLU kernel run)
  const Layer l{desc[1] != 0, hidden, latent, inter, shared_inter, top_k, n_experts, ptr(2), ptr(8),
                ptr(10), ptr(11), ptr(12), ptr(13), ptr(16), ptr(17), ptr(18),
                static_cast<const uint8_t*>(ptr(20)), static_cast<const uint8_t*>(ptr(21)), desc[3] != 0,
                desc[7] != 0,
                static_cast<const float*>(ptr(4)), params[0], params[1], act_kind, act_beta, params[3]};
  std::vector<float> yf(hidden), of(hidden);
  for (int64_t t = 0; t < n_tokens; ++t) {
    const uint16_t* y16 = nullptr;
    if (l.bf16) {
      y16 = static_cast<const uint16_t*>(y) + t * hidden;
      k3::bf16_to_float(y16, hidden, yf.data());
    } else {
      std::memcpy(yf.data(), static_cast<const float*>(y) + t * hidden, sizeof(float) * hidden);
    }
    const int status = token(l, yf.data(), y16, of.data());
    if (status != 0) return status;
    if (l.bf16)
      k3::float_to_bf16(of.data(), hidden, static_cast<uint16_t*>(out) + t * hidden);
    else
      std::memcpy(static_cast<float*>(out) + t * hidden, of.data(), sizeof(float) * hidden);
  }
  return 0;
#else
  (void)desc, (void)params, (void)y, (void)n_tokens, (void)out;
  return 1;
#endif
}

}  // extern "C"
