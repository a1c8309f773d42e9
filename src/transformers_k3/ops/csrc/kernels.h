// The kernels' entry points, for the operator bindings (torch_ops.cpp). Each kernel file includes this too, so the
// compiler checks every definition against its declaration here. No torch headers: the kernel files build fast.
// Each returns 0 on success, 1 on invalid arguments, 2 if scratch memory could not be allocated and 3 where the
// kernel is unavailable in this build; see each definition for the layouts.
#pragma once

#include <cstdint>

extern "C" {

int k3_kda_chunk_forward(const float* q, const float* k, const float* v, const float* g, const float* beta,
                         float* out, float* state, const int64_t* starts, const int64_t* lengths, int64_t n_seq,
                         int heads, int key_dim, int value_dim, int chunk, float scale, int n_threads);

int k3_moe_small_gemm_available();
int k3_moe_set_vector_glu(int enable);
int k3_glu(const float* gate, const float* up, int64_t rows, int inter, int act_kind, float act_beta,
           float act_linear_beta, const float* grad_out, float* out, float* grad_gate, float* grad_up, int n_threads);
int k3_moe_experts_forward(const float* x, int64_t n_tokens, int hidden, const int64_t* top_k_index,
                           const float* top_k_weights, int top_k, const void* gate_up_weights,
                           int gate_up_transposed, const void* down_weights, int down_transposed, int64_t n_experts,
                           int inter, int act_kind, float act_beta, float act_linear_beta, float* sorted, float* out,
                           int n_threads, int small, float* saved_h, int weights_bf16);
int k3_moe_experts_backward(const float* x, int64_t n_tokens, int hidden, const int64_t* top_k_index,
                            const float* top_k_weights, int top_k, const void* gate_up_weights,
                            int gate_up_transposed, const void* down_weights, int down_transposed,
                            int64_t n_experts, int inter, int act_kind, float act_beta, float act_linear_beta,
                            const float* grad_out, float* grad_x, float* grad_weights, void* grad_gate_up_out,
                            void* grad_down_out, float* dx_rows, int n_threads, int small, const float* saved_h,
                            int weights_bf16);

int k3_router_sigmoid_available();
int k3_sigmoid(const float* x, float* y, int64_t n);
int k3_router_sigmoid_topk(const float* logits, const float* bias, int64_t n_tokens, int64_t n_experts, int top_k,
                           int64_t* out_index, float* out_scores, int n_threads);
int k3_router_topk(const float* scores, const float* bias, int64_t n_tokens, int64_t n_experts, int top_k,
                   int64_t* out_index, int n_threads);
int k3_router_backward(const float* h, int64_t n_tokens, int hidden, const float* weight, int64_t n_experts,
                       const int64_t* index, int top_k, const float* selected, const float* grad_sel, float* grad_h,
                       float* grad_weight, int n_threads);
int k3_router_screened_topk(const float* x, int64_t n_tokens, int hidden, const float* w, int64_t n_experts,
                            const float* bias, int top_k, int screen, int64_t* out_index, float* out_scores,
                            int n_threads);

int k3_amx_available();
int k3_gemm_bf16_f32(const uint16_t* a, const uint16_t* b, int64_t m, int64_t n, int k, float* out, int n_threads);

int k3_latent_attention(const void* latent, int latent_bf16, int64_t batch_stride, const float* queries,
                        int64_t batch, int64_t seq, int64_t m_rows, int dim, int value_dim, int new_tokens,
                        const uint8_t* mask, const int64_t* mask_strides, float scale, float* out, int n_threads);

int k3_linear_bf16_available();
int k3_linear_bf16_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t m, int64_t n, int k,
                        uint16_t* out, int n_threads);

int k3_rms_norm_backward(const float* x, const float* w, const float* grad, int64_t rows, int hidden, float eps,
                         float* grad_x, float* grad_w, int n_threads);

int k3_mxfp4_grouped_mm(const void* x, int x_bf16, int64_t rows, int k, const uint8_t* codes, const uint8_t* scales,
                        int64_t n_experts, int n, const int64_t* offsets, void* out, int n_threads);
int k3_mxfp4_grouped_mm_backward(const void* grad, int grad_bf16, int64_t rows, int n, const uint8_t* codes,
                                 const uint8_t* scales, int64_t n_experts, int k, const int64_t* offsets,
                                 void* grad_x, int n_threads);

// out [n] = x [k] times n packed MXFP4 weight rows (codes [n, k/2], scales [n, k/32]; k a multiple of 32), each
// sum in fp32 as k3_mxfp4_grouped_mm sums a decode step's rows (the same operations, on AVX2).
void k3_mxfp4_dots(const float* x, const uint8_t* codes, const uint8_t* scales, int64_t n, int k, float* out);

int k3_moe_decode_max_tokens();
int k3_moe_decode(const int64_t* desc, const float* params, const void* y, int64_t n_tokens, void* out);

}  // extern "C"
