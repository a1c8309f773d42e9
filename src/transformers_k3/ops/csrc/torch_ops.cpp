// The fused CPU kernels as PyTorch operators, torch.ops.transformers_k3.*: each checks its tensors (device, dtype,
// shape, layout: the kernels read raw memory), allocates its outputs and calls the kernel's entry point
// (kernels.h). Fake (meta) implementations and autograd formulas are registered from Python (ops/cpu_kernel.py).
// The only file that includes torch headers, and only the per-operator ones, to keep the build short.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/rms_norm.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>

#include "kernels.h"

namespace {

using at::Tensor;

int threads() { return std::max(1, at::get_num_threads()); }

void check_tensor(const Tensor& t, const char* op, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(dim < 0 || t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions, got shape ", t.sizes());
}

void check_shape(const Tensor& t, const char* op, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
}

int as_int(int64_t value, const char* op, const char* name) {
  TORCH_CHECK(value >= 0 && value <= INT32_MAX, op, ": ", name, " = ", value, " is out of the kernel's range");
  return (int)value;
}

// A kernel's status as an error: 2 (scratch) -> torch.OutOfMemoryError, 3 (unavailable here) ->
// NotImplementedError, so the Python wrappers can fall back to the PyTorch path for exactly those.
void check_status(int status, const char* op) {
  if (status == 0) return;
  TORCH_CHECK_WITH(OutOfMemoryError, status != 2, op, ": the kernel's scratch memory could not be allocated");
  TORCH_CHECK_NOT_IMPLEMENTED(status != 3, op, ": the kernel is unavailable in this build or for these sizes");
  TORCH_CHECK(false, op, ": the kernel refused its arguments (status ", status, ")");
}

const float* f32(const Tensor& t) { return t.const_data_ptr<float>(); }
float* f32_out(Tensor& t) { return t.mutable_data_ptr<float>(); }
float* f32_or_null(Tensor& t, bool used) { return used ? t.mutable_data_ptr<float>() : nullptr; }
const uint16_t* bf16(const Tensor& t) { return static_cast<const uint16_t*>(t.const_data_ptr()); }
Tensor none_tensor(const Tensor& like) { return at::empty({0}, like.options().dtype(at::kFloat)); }

Tensor kda_chunk_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                         Tensor& state, const Tensor& starts, const Tensor& lengths, int64_t chunk, double scale) {
  const char* op = "kda_chunk_forward";
  check_tensor(q, op, "q", at::kFloat, 4);
  const int64_t batch = q.size(0), length = q.size(1), heads = q.size(2), key_dim = q.size(3);
  check_tensor(k, op, "k", at::kFloat, 4);
  check_tensor(g, op, "g", at::kFloat, 4);
  check_tensor(v, op, "v", at::kFloat, 4);
  check_shape(k, op, "k", q.sizes());
  check_shape(g, op, "g", q.sizes());
  const int64_t value_dim = v.size(3);
  check_shape(v, op, "v", {batch, length, heads, value_dim});
  check_tensor(beta, op, "beta", at::kFloat, 3);
  check_shape(beta, op, "beta", {batch, length, heads});
  check_tensor(starts, op, "starts", at::kLong, 1);
  check_tensor(lengths, op, "lengths", at::kLong, 1);
  const int64_t n_seq = starts.size(0);
  check_shape(lengths, op, "lengths", {n_seq});
  check_tensor(state, op, "state", at::kFloat, 4);
  check_shape(state, op, "state", {n_seq, heads, key_dim, value_dim});
  TORCH_CHECK(state.is_contiguous(), op, ": state must be contiguous (it is updated in place)");
  TORCH_CHECK(chunk > 0, op, ": chunk must be positive, got ", chunk);
  const Tensor s = starts.contiguous(), n = lengths.contiguous();
  const int64_t* s_ptr = s.const_data_ptr<int64_t>();
  const int64_t* n_ptr = n.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n_seq; ++i)
    TORCH_CHECK(s_ptr[i] >= 0 && n_ptr[i] >= 0 && s_ptr[i] + n_ptr[i] <= batch * length, op, ": sequence ", i,
                " (start ", s_ptr[i], ", length ", n_ptr[i], ") lies outside the ", batch * length, " tokens");
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous();
  const Tensor bc = beta.contiguous();
  Tensor out = at::empty({batch, length, heads, value_dim}, q.options());
  check_status(k3_kda_chunk_forward(f32(qc), f32(kc), f32(vc), f32(gc), f32(bc), f32_out(out), f32_out(state), s_ptr,
                                    n_ptr, n_seq, as_int(heads, op, "heads"), as_int(key_dim, op, "K"),
                                    as_int(value_dim, op, "V"), as_int(chunk, op, "chunk"), (float)scale, threads()),
               op);
  return out;
}

void check_router(const Tensor& scores, const Tensor& bias, int64_t top_k, const char* op) {
  check_tensor(scores, op, "scores", at::kFloat, 2);
  check_tensor(bias, op, "bias", at::kFloat, 1);
  check_shape(bias, op, "bias", {scores.size(1)});
  TORCH_CHECK(top_k >= 1 && top_k <= scores.size(1), op, ": top_k = ", top_k, " must lie in [1, ", scores.size(1),
              "]");
}

Tensor router_topk(const Tensor& scores, const Tensor& bias, int64_t top_k) {
  const char* op = "router_topk";
  check_router(scores, bias, top_k, op);
  const Tensor s = scores.contiguous(), b = bias.contiguous();
  Tensor index = at::empty({s.size(0), top_k}, s.options().dtype(at::kLong));
  check_status(k3_router_topk(f32(s), f32(b), s.size(0), s.size(1), (int)top_k, index.mutable_data_ptr<int64_t>(),
                              threads()),
               op);
  return index;
}

std::tuple<Tensor, Tensor> router_sigmoid_topk(const Tensor& logits, const Tensor& bias, int64_t top_k) {
  const char* op = "router_sigmoid_topk";
  check_router(logits, bias, top_k, op);
  const Tensor l = logits.contiguous(), b = bias.contiguous();
  Tensor index = at::empty({l.size(0), top_k}, l.options().dtype(at::kLong));
  Tensor selected = at::empty({l.size(0), top_k}, l.options());
  check_status(k3_router_sigmoid_topk(f32(l), f32(b), l.size(0), l.size(1), (int)top_k,
                                      index.mutable_data_ptr<int64_t>(), f32_out(selected), threads()),
               op);
  return {index, selected};
}

Tensor sigmoid(const Tensor& x) {
  check_tensor(x, "sigmoid", "x", at::kFloat, -1);
  const Tensor c = x.contiguous();
  Tensor y = at::empty(c.sizes(), c.options());
  check_status(k3_sigmoid(f32(c), f32_out(y), c.numel()), "sigmoid");
  return y;
}

void check_selected(const Tensor& h, const Tensor& w, const Tensor& index, const Tensor& selected, const char* op) {
  check_tensor(h, op, "hidden_states", at::kFloat, 2);
  check_tensor(w, op, "weight", at::kFloat, 2);
  check_shape(w, op, "weight", {w.size(0), h.size(1)});
  check_tensor(index, op, "top_k_index", at::kLong, 2);
  check_shape(index, op, "top_k_index", {h.size(0), index.size(1)});
  check_tensor(selected, op, "selected", at::kFloat, 2);
  check_shape(selected, op, "selected", index.sizes());
}

Tensor selected_scores(const Tensor& h, const Tensor& w, const Tensor& index, const Tensor& selected) {
  check_selected(h, w, index, selected, "selected_scores");
  return selected.clone();
}

std::tuple<Tensor, Tensor> router_backward(const Tensor& grad, const Tensor& h, const Tensor& w, const Tensor& index,
                                           const Tensor& selected, bool need_hidden, bool need_weight) {
  const char* op = "router_backward";
  check_selected(h, w, index, selected, op);
  check_tensor(grad, op, "grad", at::kFloat, 2);
  check_shape(grad, op, "grad", selected.sizes());
  const Tensor hc = h.contiguous(), wc = w.contiguous(), ic = index.contiguous(), sc = selected.contiguous();
  const Tensor gc = grad.contiguous();
  Tensor grad_h = need_hidden ? at::empty(h.sizes(), h.options()) : none_tensor(h);
  Tensor grad_w = need_weight ? at::empty(w.sizes(), w.options()) : none_tensor(w);
  check_status(k3_router_backward(f32(hc), h.size(0), as_int(h.size(1), op, "H"), f32(wc), w.size(0),
                                  ic.const_data_ptr<int64_t>(), as_int(index.size(1), op, "top_k"), f32(sc), f32(gc),
                                  f32_or_null(grad_h, need_hidden), f32_or_null(grad_w, need_weight), threads()),
               op);
  return {grad_h, grad_w};
}

std::tuple<Tensor, Tensor> router_screened_topk(const Tensor& x, const Tensor& w, const Tensor& bias, int64_t top_k,
                                                bool screen) {
  const char* op = "router_screened_topk";
  check_tensor(x, op, "hidden_states", at::kFloat, 2);
  check_tensor(w, op, "weight", at::kFloat, 2);
  check_shape(w, op, "weight", {w.size(0), x.size(1)});
  check_tensor(bias, op, "bias", at::kFloat, 1);
  check_shape(bias, op, "bias", {w.size(0)});
  TORCH_CHECK(top_k >= 1 && top_k <= w.size(0), op, ": top_k = ", top_k, " must lie in [1, ", w.size(0), "]");
  const Tensor xc = x.contiguous(), wc = w.contiguous(), bc = bias.contiguous();
  Tensor index = at::empty({x.size(0), top_k}, x.options().dtype(at::kLong));
  Tensor selected = at::empty({x.size(0), top_k}, x.options());
  const int status = k3_router_screened_topk(f32(xc), x.size(0), as_int(x.size(1), op, "H"), f32(wc), w.size(0),
                                             f32(bc), (int)top_k, screen ? 1 : 0, index.mutable_data_ptr<int64_t>(),
                                             f32_out(selected), threads());
  TORCH_CHECK_NOT_IMPLEMENTED(status != 4, op, ": the weight or the bias has a value that is not finite");
  check_status(status, op);
  return {index, selected};
}

constexpr int64_t kGemmFallbackRows = 16384;

Tensor gemm_bf16_f32(const Tensor& x, const Tensor& weight) {
  const char* op = "gemm_bf16_f32";
  check_tensor(x, op, "x", at::kBFloat16, 2);
  check_tensor(weight, op, "weight", at::kBFloat16, 2);
  check_shape(weight, op, "weight", {weight.size(0), x.size(1)});
  const Tensor a = x.contiguous(), b = weight.contiguous();
  Tensor out = at::empty({a.size(0), b.size(0)}, a.options().dtype(at::kFloat));
  if (!k3_amx_available()) {
    // No tile unit: fp32 GEMMs on fp32 copies (bf16 -> fp32 is exact), kGemmFallbackRows rows of x at a time so
    // that a long x (an MLA latent) is never copied whole.
    const Tensor bt = b.to(at::kFloat).t();
    for (int64_t start = 0; start < a.size(0); start += kGemmFallbackRows) {
      const int64_t rows = std::min(kGemmFallbackRows, a.size(0) - start);
      Tensor block = out.narrow(0, start, rows);
      at::mm_out(block, a.narrow(0, start, rows).to(at::kFloat), bt);
    }
    return out;
  }
  check_status(k3_gemm_bf16_f32(bf16(a), bf16(b), a.size(0), b.size(0), as_int(a.size(1), op, "K"), f32_out(out),
                                threads()),
               op);
  return out;
}

Tensor latent_scores(const Tensor& latent, const Tensor& queries) {
  const char* op = "latent_scores";
  TORCH_CHECK(latent.scalar_type() == at::kFloat || latent.scalar_type() == at::kBFloat16, op,
              ": latent must be fp32 or bf16, got ", latent.scalar_type());
  check_tensor(latent, op, "latent", latent.scalar_type(), 3);
  check_tensor(queries, op, "queries", latent.scalar_type(), 3);
  check_shape(queries, op, "queries", {latent.size(0), queries.size(1), latent.size(2)});
  // [B, S, M] as the long latent's row-major product (no copy of it), then laid out [B, M, S]: the softmax over
  // S reads contiguous rows (a compiled graph fuses a transposed view into a strided, several times slower loop)
  if (latent.scalar_type() == at::kFloat) return at::bmm(latent, queries.transpose(1, 2)).transpose(1, 2).contiguous();
  Tensor scores = at::empty({latent.size(0), queries.size(1), latent.size(1)}, latent.options().dtype(at::kFloat));
  for (int64_t b = 0; b < latent.size(0); ++b) scores[b].copy_(gemm_bf16_f32(latent[b], queries[b]).t());
  return scores;
}

Tensor latent_attention(const Tensor& latent, const Tensor& queries, double scale, int64_t value_dim,
                        int64_t new_tokens, const std::optional<Tensor>& mask) {
  const char* op = "latent_attention";
  TORCH_CHECK(latent.scalar_type() == at::kFloat || latent.scalar_type() == at::kBFloat16, op,
              ": latent must be fp32 or bf16, got ", latent.scalar_type());
  check_tensor(latent, op, "latent", latent.scalar_type(), 3);
  check_tensor(queries, op, "queries", latent.scalar_type(), 3);
  const int64_t batch = latent.size(0), seq = latent.size(1), dim = latent.size(2), rows = queries.size(1);
  check_shape(queries, op, "queries", {batch, rows, dim});
  TORCH_CHECK(value_dim >= 1 && value_dim <= dim, op, ": value_dim must be in [1, ", dim, "], got ", value_dim);
  TORCH_CHECK(new_tokens >= 1 && new_tokens <= seq && rows % new_tokens == 0, op,
              ": new_tokens must divide the query rows and be at most the latent's length, got ", new_tokens,
              " for ", rows, " rows and ", seq, " latent rows");
  // the mask broadcast to [B, heads, T, S] (strides of 0, no copy), its rows contiguous
  Tensor m;
  std::array<int64_t, 3> mask_strides{0, 0, 0};
  if (mask.has_value()) {
    check_tensor(*mask, op, "mask", at::kBool, 4);
    const int64_t heads = rows / new_tokens;
    const auto& size = mask->sizes();
    TORCH_CHECK((size[0] == 1 || size[0] == batch) && (size[1] == 1 || size[1] == heads) &&
                    size[2] == new_tokens && size[3] == seq,
                op, ": mask must be [1 or ", batch, ", 1 or ", heads, ", ", new_tokens, ", ", seq, "], got ", size);
    m = mask->stride(3) == 1 || seq == 1 ? *mask : mask->contiguous();
    m = m.expand({batch, heads, new_tokens, seq});
    mask_strides = {m.stride(0), m.stride(1), m.stride(2)};
  }
  // the rows of each batch contiguous (a cache's latent: a prefix of its reserved buffer, no copy)
  const bool rows_apart = latent.stride(2) == 1 && (latent.stride(1) == dim || seq <= 1) &&
                         (batch <= 1 || latent.stride(0) >= seq * dim);
  const Tensor lat = rows_apart ? latent : latent.contiguous();
  const int64_t batch_stride = batch <= 1 ? seq * dim : lat.stride(0);
  const Tensor q = queries.to(at::kFloat).contiguous();
  Tensor out = at::empty({batch, rows, value_dim}, latent.options().dtype(at::kFloat));
  if (batch == 0 || rows == 0) return out;
  check_status(k3_latent_attention(lat.const_data_ptr(), lat.scalar_type() == at::kBFloat16 ? 1 : 0, batch_stride,
                                   f32(q), batch, seq, rows, as_int(dim, op, "dim"), as_int(value_dim, op, "value_dim"),
                                   as_int(new_tokens, op, "new_tokens"),
                                   m.defined() ? static_cast<const uint8_t*>(m.const_data_ptr()) : nullptr,
                                   mask_strides.data(), (float)scale, f32_out(out), threads()),
               op);
  return out;
}

Tensor linear_bf16(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  const char* op = "linear_bf16";
  check_tensor(x, op, "x", at::kBFloat16, -1);
  check_tensor(weight, op, "weight", at::kBFloat16, 2);
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k && k > 0, op, ": x's last dimension must be weight's ", k, ", got ",
              x.sizes());
  Tensor b;
  if (bias.has_value()) {
    check_tensor(*bias, op, "bias", at::kBFloat16, 1);
    check_shape(*bias, op, "bias", {n});
    b = bias->contiguous();
  }
  const Tensor a = x.contiguous(), w = weight.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  Tensor out = at::empty(shape, x.options());
  const int64_t rows = k == 0 ? 0 : a.numel() / k;
  const uint16_t* bias_ptr = b.defined() ? bf16(b) : nullptr;
  auto* out_ptr = static_cast<uint16_t*>(out.mutable_data_ptr());
  constexpr int64_t kRows = 15;  // (k3::bf16_rows::kMaxRows: the kernel takes this many rows a call)
  for (int64_t i = 0; i < rows; i += kRows)
    check_status(k3_linear_bf16_rows(bf16(a) + i * k, bf16(w), bias_ptr, std::min(kRows, rows - i), n,
                                     as_int(k, op, "K"), out_ptr + i * n, threads()),
                 op);
  return out;
}

void check_glu(const Tensor& gate, const Tensor& up, const char* op) {
  TORCH_CHECK(gate.device().is_cpu() && up.device().is_cpu(), op, ": gate and up must be on the CPU");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type() &&
                  (gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16),
              op, ": gate and up must both be float32 or both bfloat16, got ", gate.scalar_type(), " and ",
              up.scalar_type());
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.dim() >= 1 && gate.size(-1) > 0, op,
              ": gate and up must have one non-empty shape, got ", gate.sizes(), " and ", up.sizes());
}

Tensor glu(const Tensor& gate, const Tensor& up, int64_t kind, double beta, double linear_beta) {
  const char* op = "glu";
  check_glu(gate, up, op);
  const Tensor a = gate.to(at::kFloat).contiguous(), u = up.to(at::kFloat).contiguous();
  Tensor out = at::empty(a.sizes(), a.options());
  const int64_t inter = a.size(-1);
  check_status(k3_glu(f32(a), f32(u), a.numel() / inter, as_int(inter, op, "I"), (int)kind, (float)beta,
                      (float)linear_beta, nullptr, f32_out(out), nullptr, nullptr, threads()),
               op);
  return out.to(gate.scalar_type());
}

std::tuple<Tensor, Tensor> glu_backward(const Tensor& grad, const Tensor& gate, const Tensor& up, int64_t kind,
                                        double beta, double linear_beta) {
  const char* op = "glu_backward";
  check_glu(gate, up, op);
  TORCH_CHECK(grad.sizes() == gate.sizes() && grad.device().is_cpu(), op, ": grad must be a CPU tensor of shape ",
              gate.sizes(), ", got ", grad.sizes());
  const Tensor a = gate.to(at::kFloat).contiguous(), u = up.to(at::kFloat).contiguous();
  const Tensor d = grad.to(at::kFloat).contiguous();
  Tensor out = at::empty(a.sizes(), a.options()), grad_a = at::empty(a.sizes(), a.options());
  Tensor grad_u = at::empty(a.sizes(), a.options());
  const int64_t inter = a.size(-1);
  check_status(k3_glu(f32(a), f32(u), a.numel() / inter, as_int(inter, op, "I"), (int)kind, (float)beta,
                      (float)linear_beta, f32(d), f32_out(out), f32_out(grad_a), f32_out(grad_u), threads()),
               op);
  return {grad_a.to(gate.scalar_type()), grad_u.to(gate.scalar_type())};
}

void check_norm(const Tensor& x, const Tensor& weight, const char* op) {
  check_tensor(x, op, "hidden_states", at::kFloat, -1);
  check_tensor(weight, op, "weight", at::kFloat, 1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(0) && weight.size(0) > 0, op,
              ": hidden_states [..., H] and weight [H] do not fit: ", x.sizes(), " and ", weight.sizes());
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_norm(x, weight, "rms_norm");
  // (F.rms_norm(x, (H,), eps=eps) * weight: torch's own two ops, so the forward has their bits)
  return at::rms_norm(x.contiguous(), {x.size(-1)}, std::nullopt, eps).mul(weight);
}

std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight, double eps) {
  const char* op = "rms_norm_backward";
  check_norm(x, weight, op);
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.device().is_cpu(), op, ": grad must be a CPU tensor of shape ",
              x.sizes(), ", got ", grad.sizes());
  const int64_t hidden = x.size(-1);
  const Tensor xc = x.contiguous(), g = grad.to(at::kFloat).contiguous(), w = weight.contiguous();
  Tensor grad_x = at::empty(x.sizes(), xc.options()), grad_w = at::empty({hidden}, w.options());
  check_status(k3_rms_norm_backward(f32(xc), f32(w), f32(g), xc.numel() / hidden, as_int(hidden, op, "H"),
                                    (float)eps, f32_out(grad_x), f32_out(grad_w), threads()),
               op);
  return {grad_x, grad_w};
}

struct Experts {
  int64_t tokens, top_k, hidden, inter, n_experts;
  bool bf16;
};

// The experts' sizes from their operands (the layouts of k3_moe_experts_forward), checked.
Experts check_experts(const Tensor& x, const Tensor& index, const Tensor& weights, const Tensor& gate_up,
                      const Tensor& down, bool transposed, bool small, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": hidden_states must be a float32 or bfloat16 [N, D] CPU tensor, got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(index.device().is_cpu() && index.dim() == 2 && index.size(0) == tokens && index.size(1) > 0 &&
                  (index.scalar_type() == at::kLong || index.scalar_type() == at::kInt),
              op, ": top_k_index must be an integer [N, k] CPU tensor with N = ", tokens, ", got ", index.sizes());
  TORCH_CHECK(weights.device().is_cpu() && weights.sizes() == index.sizes() &&
                  (weights.scalar_type() == at::kFloat || weights.scalar_type() == at::kBFloat16),
              op, ": top_k_weights must be a float32 or bfloat16 CPU tensor of shape ", index.sizes(), ", got ",
              weights.sizes());
  TORCH_CHECK(gate_up.device().is_cpu() && down.device().is_cpu() && gate_up.dim() == 3 && down.dim() == 3, op,
              ": gate_up_proj and down_proj must be 3-dimensional CPU tensors");
  TORCH_CHECK(gate_up.scalar_type() == down.scalar_type() &&
                  (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
              op, ": gate_up_proj and down_proj must both be float32 or both bfloat16");
  TORCH_CHECK(gate_up.is_contiguous() && down.is_contiguous(), op, ": the expert weights must be contiguous");
  const int64_t n_experts = gate_up.size(0);
  const int64_t inter = (transposed ? gate_up.size(2) : gate_up.size(1)) / 2;
  if (transposed) {
    check_shape(gate_up, op, "gate_up_proj", {n_experts, hidden, 2 * inter});
    check_shape(down, op, "down_proj", {n_experts, inter, hidden});
  } else {
    check_shape(gate_up, op, "gate_up_proj", {n_experts, 2 * inter, hidden});
    check_shape(down, op, "down_proj", {n_experts, hidden, inter});
  }
  const bool bf16 = gate_up.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!bf16 || small, op, ": bfloat16 expert weights take the small-GEMM path only");
  TORCH_CHECK(!small || k3_moe_small_gemm_available(), op, ": this build has no small-GEMM path");
  return {tokens, index.size(1), hidden, inter, n_experts, bf16};
}

Tensor experts_scratch(const Experts& e, bool small, int n_threads, const Tensor& like) {
  return at::empty({small ? (n_threads - 1) * e.tokens : e.tokens * e.top_k, e.hidden},
                   like.options().dtype(at::kFloat));
}

std::tuple<Tensor, Tensor> moe_experts(const Tensor& x, const Tensor& index, const Tensor& weights,
                                       const Tensor& gate_up, const Tensor& down, bool transposed, int64_t kind,
                                       double beta, double linear_beta, bool small, bool save_products) {
  const char* op = "moe_experts";
  const Experts e = check_experts(x, index, weights, gate_up, down, transposed, small, op);
  const int n_threads = threads();
  const Tensor xc = x.to(at::kFloat).contiguous(), wc = weights.to(at::kFloat).contiguous();
  const Tensor ic = index.to(at::kLong).contiguous();
  Tensor scratch = experts_scratch(e, small, n_threads, x);
  Tensor out = at::empty({e.tokens, e.hidden}, xc.options());
  const bool save = save_products && small;
  Tensor products = save ? at::empty({e.tokens * e.top_k, 2 * e.inter}, xc.options()) : none_tensor(x);
  check_status(k3_moe_experts_forward(f32(xc), e.tokens, as_int(e.hidden, op, "D"), ic.const_data_ptr<int64_t>(),
                                      f32(wc), as_int(e.top_k, op, "k"), gate_up.const_data_ptr(), transposed,
                                      down.const_data_ptr(), transposed, e.n_experts, as_int(e.inter, op, "I"),
                                      (int)kind, (float)beta, (float)linear_beta, f32_out(scratch), f32_out(out),
                                      n_threads, small, f32_or_null(products, save), e.bf16),
               op);
  return {out.to(x.scalar_type()), products};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> moe_experts_backward(
    const Tensor& grad_out, const Tensor& x, const Tensor& index, const Tensor& weights, const Tensor& gate_up,
    const Tensor& down, const Tensor& products, bool transposed, int64_t kind, double beta, double linear_beta,
    bool small, std::array<bool, 4> mask) {
  const char* op = "moe_experts_backward";
  const Experts e = check_experts(x, index, weights, gate_up, down, transposed, small, op);
  TORCH_CHECK(grad_out.device().is_cpu() && grad_out.sizes() == x.sizes(), op,
              ": grad_out must be a CPU tensor of shape ", x.sizes(), ", got ", grad_out.sizes());
  const bool saved = small && products.numel() > 0;
  if (saved) {
    check_tensor(products, op, "products", at::kFloat, 2);
    check_shape(products, op, "products", {e.tokens * e.top_k, 2 * e.inter});
  }
  const int n_threads = threads();
  const Tensor xc = x.to(at::kFloat).contiguous(), wc = weights.to(at::kFloat).contiguous();
  const Tensor ic = index.to(at::kLong).contiguous(), g = grad_out.to(at::kFloat).contiguous();
  const Tensor pc = saved ? products.contiguous() : products;
  Tensor grad_x = mask[0] ? at::empty({e.tokens, e.hidden}, xc.options()) : none_tensor(x);
  Tensor grad_w = mask[1] ? at::empty({e.tokens, e.top_k}, xc.options()) : none_tensor(x);
  Tensor grad_gate_up = mask[2] ? at::empty(gate_up.sizes(), gate_up.options()) : none_tensor(x);
  Tensor grad_down = mask[3] ? at::empty(down.sizes(), down.options()) : none_tensor(x);
  Tensor scratch = mask[0] ? experts_scratch(e, small, n_threads, x) : none_tensor(x);
  check_status(k3_moe_experts_backward(
                   f32(xc), e.tokens, as_int(e.hidden, op, "D"), ic.const_data_ptr<int64_t>(), f32(wc),
                   as_int(e.top_k, op, "k"), gate_up.const_data_ptr(), transposed, down.const_data_ptr(), transposed,
                   e.n_experts, as_int(e.inter, op, "I"), (int)kind, (float)beta, (float)linear_beta, f32(g),
                   f32_or_null(grad_x, mask[0]), f32_or_null(grad_w, mask[1]),
                   mask[2] ? grad_gate_up.mutable_data_ptr() : nullptr,
                   mask[3] ? grad_down.mutable_data_ptr() : nullptr, f32_or_null(scratch, mask[0]), n_threads, small,
                   saved ? f32(pc) : nullptr, e.bf16),
               op);
  if (mask[0]) grad_x = grad_x.to(x.scalar_type());
  if (mask[1]) grad_w = grad_w.to(weights.scalar_type());
  return {grad_x, grad_w, grad_gate_up, grad_down};
}

const void* weight_ptr(const std::optional<Tensor>& t, const char* op, const char* name, at::ScalarType dtype,
                       at::IntArrayRef shape) {
  if (!t.has_value()) return nullptr;
  check_tensor(*t, op, name, dtype, (int64_t)shape.size());
  check_shape(*t, op, name, shape);
  TORCH_CHECK(t->is_contiguous(), op, ": ", name, " must be contiguous");
  return t->const_data_ptr();
}

// The whole-layer decode step (moe_decode_cpu.cpp); `gate_up_scale` / `down_scale` given: the experts are packed
// MXFP4 (`gate_up` [E, 2I, D/2] and `down` [E, D, I/2] uint8 codes, scales [E, 2I, D/32] / [E, D, I/32]).
Tensor moe_decode_call(const char* op, const Tensor& y, const Tensor& router, const Tensor& bias, int64_t top_k,
                       bool renormalize, double scale, const std::optional<Tensor>& down_latent,
                       const std::optional<Tensor>& norm, double eps, const std::optional<Tensor>& up_latent,
                       const Tensor& gate_up, const Tensor& down, int64_t kind, double beta, double linear_beta,
                       const std::optional<Tensor>& shared_gate, const std::optional<Tensor>& shared_up,
                       const std::optional<Tensor>& shared_down, const std::optional<Tensor>& gate_up_scale,
                       const std::optional<Tensor>& down_scale) {
  const at::ScalarType dtype = y.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": y must be float32 or bfloat16, got ", dtype);
  check_tensor(y, op, "y", dtype, 2);
  const int64_t hidden = y.size(1);
  TORCH_CHECK(router.scalar_type() == dtype || router.scalar_type() == at::kFloat, op,
              ": router must be in y's dtype or float32, got ", router.scalar_type());
  TORCH_CHECK(router.dim() == 2, op, ": router must be [E, H], got ", router.sizes());
  const int64_t n_experts = router.size(0);
  weight_ptr(router, op, "router", router.scalar_type(), {n_experts, hidden});
  weight_ptr(bias, op, "bias", at::kFloat, {n_experts});
  TORCH_CHECK(down_latent.has_value() == up_latent.has_value() && (down_latent.has_value() || !norm.has_value()),
              op, ": down_latent and up_latent come together (norm only with them)");
  const int64_t latent = down_latent.has_value() ? down_latent->size(0) : 0, width = latent ? latent : hidden;
  const bool packed = gate_up_scale.has_value();
  TORCH_CHECK(gate_up.dim() == 3, op, ": gate_up must be [E, 2I, ", packed ? "D/2" : "D", "], got ", gate_up.sizes());
  const int64_t inter = gate_up.size(1) / 2;
  TORCH_CHECK(!packed || (width % 32 == 0 && inter % 32 == 0), op, ": packed MXFP4 experts need widths that are "
              "multiples of 32, got ", width, " and ", inter);
  const at::ScalarType experts_dtype = packed ? at::kByte : dtype;
  const int64_t pack = packed ? 2 : 1;
  const int64_t shared_inter = shared_gate.has_value() ? shared_gate->size(0) : 0;
  TORCH_CHECK(shared_gate.has_value() == shared_up.has_value() && shared_up.has_value() == shared_down.has_value(),
              op, ": the shared expert's three weights come together");
  const std::array<int64_t, 22> desc{
      hidden,
      dtype == at::kBFloat16,
      reinterpret_cast<intptr_t>(router.const_data_ptr()),
      router.scalar_type() != dtype,
      reinterpret_cast<intptr_t>(bias.const_data_ptr()),
      n_experts,
      top_k,
      renormalize,
      reinterpret_cast<intptr_t>(weight_ptr(down_latent, op, "down_latent", dtype, {latent, hidden})),
      latent,
      reinterpret_cast<intptr_t>(weight_ptr(norm, op, "norm", dtype, {latent})),
      reinterpret_cast<intptr_t>(weight_ptr(up_latent, op, "up_latent", dtype, {hidden, latent})),
      reinterpret_cast<intptr_t>(
          weight_ptr(gate_up, op, "gate_up", experts_dtype, {n_experts, 2 * inter, width / pack})),
      reinterpret_cast<intptr_t>(weight_ptr(down, op, "down", experts_dtype, {n_experts, width, inter / pack})),
      inter,
      kind,
      reinterpret_cast<intptr_t>(weight_ptr(shared_gate, op, "shared_gate", dtype, {shared_inter, hidden})),
      reinterpret_cast<intptr_t>(weight_ptr(shared_up, op, "shared_up", dtype, {shared_inter, hidden})),
      reinterpret_cast<intptr_t>(weight_ptr(shared_down, op, "shared_down", dtype, {hidden, shared_inter})),
      shared_inter,
      reinterpret_cast<intptr_t>(
          weight_ptr(gate_up_scale, op, "gate_up_scale", at::kByte, {n_experts, 2 * inter, width / 32})),
      reinterpret_cast<intptr_t>(
          weight_ptr(down_scale, op, "down_scale", at::kByte, {n_experts, width, inter / 32})),
  };
  const std::array<float, 4> params{(float)scale, (float)eps, (float)beta, (float)linear_beta};
  const Tensor x = y.contiguous();
  Tensor out = at::empty(x.sizes(), x.options());
  check_status(k3_moe_decode(desc.data(), params.data(), x.const_data_ptr(), x.size(0), out.mutable_data_ptr()), op);
  return out;
}

Tensor moe_decode(const Tensor& y, const Tensor& router, const Tensor& bias, int64_t top_k, bool renormalize,
                  double scale, const std::optional<Tensor>& down_latent, const std::optional<Tensor>& norm,
                  double eps, const std::optional<Tensor>& up_latent, const Tensor& gate_up, const Tensor& down,
                  int64_t kind, double beta, double linear_beta, const std::optional<Tensor>& shared_gate,
                  const std::optional<Tensor>& shared_up, const std::optional<Tensor>& shared_down) {
  return moe_decode_call("moe_decode", y, router, bias, top_k, renormalize, scale, down_latent, norm, eps, up_latent,
                         gate_up, down, kind, beta, linear_beta, shared_gate, shared_up, shared_down, std::nullopt,
                         std::nullopt);
}

Tensor moe_decode_mxfp4(const Tensor& y, const Tensor& router, const Tensor& bias, int64_t top_k, bool renormalize,
                        double scale, const std::optional<Tensor>& down_latent, const std::optional<Tensor>& norm,
                        double eps, const std::optional<Tensor>& up_latent, const Tensor& gate_up_packed,
                        const Tensor& gate_up_scale, const Tensor& down_packed, const Tensor& down_scale, int64_t kind,
                        double beta, double linear_beta, const std::optional<Tensor>& shared_gate,
                        const std::optional<Tensor>& shared_up, const std::optional<Tensor>& shared_down) {
  return moe_decode_call("moe_decode_mxfp4", y, router, bias, top_k, renormalize, scale, down_latent, norm, eps,
                         up_latent, gate_up_packed, down_packed, kind, beta, linear_beta, shared_gate, shared_up,
                         shared_down, gate_up_scale, down_scale);
}

int64_t small_gemm_available() { return k3_moe_small_gemm_available(); }
int64_t set_vector_glu(int64_t enable) { return k3_moe_set_vector_glu(enable != 0); }
int64_t sigmoid_available() { return k3_router_sigmoid_available(); }
int64_t amx_available() { return k3_amx_available(); }
int64_t linear_bf16_available() { return k3_linear_bf16_available(); }
int64_t moe_decode_max_tokens() { return k3_moe_decode_max_tokens(); }

// Packed MXFP4 experts (mxfp4_cpu.cpp): rows [M, K] sorted by expert, offsets [E] each expert's end row,
// packed [E, N, K/2] and scale [E, N, K/32] uint8. The forward gives [M, N], the backward [M, K] (grad [M, N]).
Tensor mxfp4_call(const Tensor& rows, const Tensor& packed, const Tensor& scale, const Tensor& offsets, bool forward) {
  const char* op = forward ? "mxfp4_grouped_mm" : "mxfp4_grouped_mm_backward";
  TORCH_CHECK(rows.device().is_cpu(), op, ": ", forward ? "x" : "grad", " must be on the CPU, got ", rows.device());
  TORCH_CHECK(rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16, op, ": ",
              forward ? "x" : "grad", " must be float32 or bfloat16, got ", rows.scalar_type());
  TORCH_CHECK(rows.dim() == 2, op, ": ", forward ? "x" : "grad", " must be 2-D, got shape ", rows.sizes());
  check_tensor(packed, op, "packed", at::kByte, 3);
  check_tensor(scale, op, "scale", at::kByte, 3);
  const int64_t experts = packed.size(0), out_rows = packed.size(1), k = packed.size(2) * 2;
  TORCH_CHECK(k % 32 == 0, op, ": packed [E, N, K/2] needs K a multiple of 32, got K = ", k);
  check_shape(scale, op, "scale", {experts, out_rows, k / 32});
  TORCH_CHECK(offsets.device().is_cpu() && offsets.dim() == 1 && offsets.size(0) == experts &&
                  (offsets.scalar_type() == at::kInt || offsets.scalar_type() == at::kLong),
              op, ": offsets must be a 1-D int32 or int64 CPU tensor of ", experts, " end rows, got ",
              offsets.scalar_type(), " ", offsets.sizes());
  const int64_t width = forward ? k : out_rows;
  TORCH_CHECK(rows.size(1) == width, op, ": ", forward ? "x" : "grad", " has ", rows.size(1), " columns, the "
              "weight needs ", width);
  const Tensor ends = offsets.to(at::kLong).contiguous();
  const int64_t* e = ends.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < experts; ++i)
    TORCH_CHECK(e[i] >= (i ? e[i - 1] : 0) && e[i] <= rows.size(0), op, ": offsets must be non-decreasing end rows "
                "within the ", rows.size(0), " rows, got offsets[", i, "] = ", e[i]);
  const Tensor r = rows.contiguous(), p = packed.contiguous(), s = scale.contiguous();
  const bool bf16 = rows.scalar_type() == at::kBFloat16;
  Tensor out = at::empty({rows.size(0), forward ? out_rows : k}, rows.options());
  const auto* codes = static_cast<const uint8_t*>(p.const_data_ptr());
  const auto* scales = static_cast<const uint8_t*>(s.const_data_ptr());
  const int status =
      forward ? k3_mxfp4_grouped_mm(r.const_data_ptr(), bf16, rows.size(0), as_int(k, op, "K"), codes, scales, experts,
                                    as_int(out_rows, op, "N"), e, out.mutable_data_ptr(), threads())
              : k3_mxfp4_grouped_mm_backward(r.const_data_ptr(), bf16, rows.size(0), as_int(out_rows, op, "N"), codes,
                                             scales, experts, as_int(k, op, "K"), e, out.mutable_data_ptr(), threads());
  check_status(status, op);
  return out;
}

Tensor mxfp4_grouped_mm(const Tensor& x, const Tensor& packed, const Tensor& scale, const Tensor& offsets) {
  return mxfp4_call(x, packed, scale, offsets, true);
}

Tensor mxfp4_grouped_mm_backward(const Tensor& grad, const Tensor& packed, const Tensor& scale, const Tensor& offsets) {
  return mxfp4_call(grad, packed, scale, offsets, false);
}

}  // namespace

TORCH_LIBRARY(transformers_k3, m) {
  // what this build has (no tensors: one kernel for every backend)
  m.def("small_gemm_available() -> int", &small_gemm_available);
  m.def("set_vector_glu(int enable) -> int", &set_vector_glu);
  m.def("sigmoid_available() -> int", &sigmoid_available);
  m.def("amx_available() -> int", &amx_available);
  m.def("linear_bf16_available() -> int", &linear_bf16_available);
  m.def("moe_decode_max_tokens() -> int", &moe_decode_max_tokens);

  m.def("kda_chunk_forward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor starts, "
        "Tensor lengths, int chunk, float scale) -> Tensor");
  m.def("router_topk(Tensor scores, Tensor bias, int top_k) -> Tensor");
  m.def("router_sigmoid_topk(Tensor logits, Tensor bias, int top_k) -> (Tensor, Tensor)");
  m.def("sigmoid(Tensor x) -> Tensor");
  m.def("selected_scores(Tensor hidden_states, Tensor weight, Tensor top_k_index, Tensor selected) -> Tensor");
  m.def("router_backward(Tensor grad, Tensor hidden_states, Tensor weight, Tensor top_k_index, Tensor selected, "
        "bool need_hidden, bool need_weight) -> (Tensor, Tensor)");
  m.def("router_screened_topk(Tensor hidden_states, Tensor weight, Tensor bias, int top_k, bool screen) -> "
        "(Tensor, Tensor)");
  m.def("gemm_bf16_f32(Tensor x, Tensor weight) -> Tensor");
  m.def("latent_scores(Tensor latent, Tensor queries) -> Tensor");
  m.def("latent_attention(Tensor latent, Tensor queries, float scale, int value_dim, int new_tokens, "
        "Tensor? mask=None) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("glu(Tensor gate, Tensor up, int kind, float beta, float linear_beta) -> Tensor");
  m.def("glu_backward(Tensor grad, Tensor gate, Tensor up, int kind, float beta, float linear_beta) -> "
        "(Tensor, Tensor)");
  m.def("rms_norm(Tensor hidden_states, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_backward(Tensor grad, Tensor hidden_states, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("moe_experts(Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up_proj, "
        "Tensor down_proj, bool transposed, int kind, float beta, float linear_beta, bool small, "
        "bool save_products) -> (Tensor, Tensor)");
  m.def("moe_experts_backward(Tensor grad_out, Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, "
        "Tensor gate_up_proj, Tensor down_proj, Tensor products, bool transposed, int kind, float beta, "
        "float linear_beta, bool small, bool[4] output_mask) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_decode(Tensor y, Tensor router, Tensor bias, int top_k, bool renormalize, float scale, "
        "Tensor? down_latent, Tensor? norm, float eps, Tensor? up_latent, Tensor gate_up, Tensor down, int kind, "
        "float beta, float linear_beta, Tensor? shared_gate, Tensor? shared_up, Tensor? shared_down) -> Tensor");
  m.def("moe_decode_mxfp4(Tensor y, Tensor router, Tensor bias, int top_k, bool renormalize, float scale, "
        "Tensor? down_latent, Tensor? norm, float eps, Tensor? up_latent, Tensor gate_up_packed, Tensor gate_up_scale, "
        "Tensor down_packed, Tensor down_scale, int kind, float beta, float linear_beta, Tensor? shared_gate, "
        "Tensor? shared_up, Tensor? shared_down) -> Tensor");
  m.def("mxfp4_grouped_mm(Tensor x, Tensor packed, Tensor scale, Tensor offsets) -> Tensor");
  m.def("mxfp4_grouped_mm_backward(Tensor grad, Tensor packed, Tensor scale, Tensor offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(transformers_k3, CPU, m) {
  m.impl("kda_chunk_forward", &kda_chunk_forward);
  m.impl("router_topk", &router_topk);
  m.impl("router_sigmoid_topk", &router_sigmoid_topk);
  m.impl("sigmoid", &sigmoid);
  m.impl("selected_scores", &selected_scores);
  m.impl("router_backward", &router_backward);
  m.impl("router_screened_topk", &router_screened_topk);
  m.impl("gemm_bf16_f32", &gemm_bf16_f32);
  m.impl("latent_scores", &latent_scores);
  m.impl("latent_attention", &latent_attention);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("glu", &glu);
  m.impl("glu_backward", &glu_backward);
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_backward", &rms_norm_backward);
  m.impl("moe_experts", &moe_experts);
  m.impl("moe_experts_backward", &moe_experts_backward);
  m.impl("moe_decode", &moe_decode);
  m.impl("moe_decode_mxfp4", &moe_decode_mxfp4);
  m.impl("mxfp4_grouped_mm", &mxfp4_grouped_mm);
  m.impl("mxfp4_grouped_mm_backward", &mxfp4_grouped_mm_backward);
}
