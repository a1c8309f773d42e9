"""Kimi K3 text model: the whole network in one file, top-down in the order of transformers' Kimi Linear: norms,
the FFN gate (GLU), Kimi Delta Attention, gated MLA, the router, the experts, the sparse MoE, the dense MLP, Block
Attention Residuals, the decoder layer, then the pretrained-model classes (K3_SPEC.md section 3.3). The ops it calls
(recurrences, convolutions, fused kernels) live in `ops/`, the cache in `cache.py`."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation
from transformers.integrations.accelerate import force_accelerate_hooks
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ._compat import MASK_CACHE_KWARG, OUTPUT_CACHE_FIELD, either_cache, output_cache
from .cache import NO_CACHE_STEP, KimiK3HybridCache, KimiK3KDACacheLayer, KimiK3LatentView
from .configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig, check_config_for_dtype
from .conversion.release_format import KimiK3ReleaseFormatMixin
from .generation_kimi_k3 import (KimiK3GenerationMixin, KimiK3InputError, _host_reads_are_free, _input_ids_problem,
                                  _mask_problems, _packed_from_cache_problems, _packed_rows_problems, _padding_problem,
                                  _position_problems, _raise_problems)
from .ops import moe as moe_ops
from .ops.conv import causal_conv1d, causal_conv1d_update
from .ops.experts import K3_GROUPED_MM, eager_experts  # (K3_GROUPED_MM: the name configs select; registered there)
from .ops.kda import RECURRENT_MAX_TOKENS, chunk_kda, fused_recurrent_kda, kda_gate
from .ops.kernel_layers import kernel_layer
from .ops.linear import PLAIN_LINEARS, blocks, end_aligned_causal, latent_attention
from .ops.mla_context import (LSE_BACKWARDS, attend_blocks, attention_logits, attention_with_lse, fp32_products,
                               expand_latent, merge_attention_blocks, mla_context_attention,
                               operator_expands)
from .ops.norm import rms_norm


# ----- Norms -----
# RMS norms used across the text stack.
@kernel_layer("k3_rms_norm")
class KimiK3RMSNorm(nn.Module):
    """Weighted RMSNorm ``x * rsqrt(mean(x^2) + eps) * w`` computed in fp32 and rounded to the input dtype once, as
    the reference K3 implementation (SGLang's RMSNorm, native and CUDA kernel alike) computes it. transformers'
    Llama / Kimi Linear norms round the normalised value to bf16 before multiplying by the weight, which rounds
    again (1 ulp apart on about a quarter of the values of a bf16 model); in fp32 the two are the same bits. Its
    kernel (`kernelize`): an fp32 backward in one pass per row on CPU, the same forward bits."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = None if self.kernel is None else self.kernel(hidden_states, self.weight, self.variance_epsilon)
        return rms_norm(hidden_states, self.weight, self.variance_epsilon) if out is None else out

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class KimiK3GatedRMSNorm(nn.Module):
    """Per-head RMSNorm followed by a sigmoid gate, all in fp32: ``rmsnorm(x) * w * sigmoid(gate)``.
    Used on the KDA core output (spec section 4.7)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        # (the normalisation as one F.rms_norm call, bitwise the three-op form: see KimiK3RMSNorm)
        hidden_states = F.rms_norm(hidden_states.to(torch.float32), (hidden_states.shape[-1],),
                                   eps=self.variance_epsilon)
        hidden_states = self.weight.to(torch.float32) * hidden_states * torch.sigmoid(gate.to(torch.float32))
        return hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


# ----- FFN gates -----
# GLU activations of the K3 FFNs (spec section 6.1).
#
# Every K3 FFN (the dense layer-0 MLP, the shared experts and the routed experts) computes
# ``down(act(gate(x), up(x)))`` where ``act`` is a gated linear unit of the gate half ``a`` and the up half
# ``u``. K3 uses SiTU ("SoftCap-GLU"), a SiLU-GLU whose two halves are soft-capped with ``tanh``:
#
#     SiTU(a, u) = [beta * tanh(a / beta) * sigmoid(a)] * [linear_beta * tanh(u / linear_beta)]
#
# The caps keep every FFN activation inside ``(-beta * linear_beta, beta * linear_beta)`` (100 for K3),
# which is what lets the routed experts ship in MXFP4. ``hidden_act="silu"`` selects the plain SiLU-GLU
# ``silu(a) * u`` of the Kimi-Linear lineage.


SUPPORTED_HIDDEN_ACTS = ("situ", "silu")

# SGLang is inconsistent when `activation_situ_beta` is None: its dense MLP uses 1.0, its Triton MoE
# path 4.0 (spec 6.1). K3 always sets 4.0, so the choice never matters for the real model; we pick one
# value, 1.0, for every FFN so that the dense, shared and routed experts share a single activation.
SITU_BETA_WHEN_NONE = 1.0


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 for the half-precision model dtypes; float64 stays float64 (gradcheck).
    return torch.promote_types(dtype, torch.float32)


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0
) -> torch.Tensor:
    """SiTU-GLU of the gate pre-activation ``gate`` and the up pre-activation ``up``.

    Computed in fp32 (as SGLang does; float64 inputs stay float64) and cast back to the inputs' dtype.
    ``linear_beta=None`` leaves the up half uncapped. Both factors are products of bounded functions (tanh, sigmoid) of finite or
    infinite inputs, so huge or infinite activations give finite outputs and finite gradients; the only
    NaN source is ``linear_beta=None`` with an infinite ``up`` times a gate factor of exactly 0.
    """
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    a = gate.to(_compute_dtype(out_dtype))
    u = up.to(_compute_dtype(out_dtype))
    gate_factor = beta * torch.tanh(a / beta) * torch.sigmoid(a)
    up_factor = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (gate_factor * up_factor).to(out_dtype)


def _check_hidden_act(config) -> str:
    hidden_act = getattr(config, "hidden_act", None)
    if hidden_act not in SUPPORTED_HIDDEN_ACTS:
        raise ValueError(
            f"hidden_act={hidden_act!r} is not supported by Kimi K3 FFNs; expected one of {SUPPORTED_HIDDEN_ACTS}."
        )
    return hidden_act


class GLU(NamedTuple):
    """The FFNs' gated linear unit: ``kind`` "situ" (`situ_glu` with caps ``beta`` / ``linear_beta``; None: the up
    half uncapped) or "silu" (``silu(a) * u`` in the input dtype, bit for bit transformers' Kimi Linear). Plain
    values, so the fused CPU kernels take it as is."""

    kind: str
    beta: float = 4.0
    linear_beta: float | None = 25.0

    @classmethod
    def from_config(cls, config) -> GLU:
        """``config.hidden_act`` with ``activation_situ_beta`` (None -> `SITU_BETA_WHEN_NONE`) and
        ``activation_situ_linear_beta``."""
        if _check_hidden_act(config) == "silu":
            return cls("silu", 1.0, None)
        beta = getattr(config, "activation_situ_beta", None)
        linear_beta = getattr(config, "activation_situ_linear_beta", None)
        return cls("situ", SITU_BETA_WHEN_NONE if beta is None else float(beta),
                   None if linear_beta is None else float(linear_beta))  # fmt: skip

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        return situ_glu(gate, up, self.beta, self.linear_beta)

    def packed(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The GLU of a packed ``gate_up [..., 2I]`` (gate half first), as the fused experts' GEMM produces it. SiTU
        in six element-wise ops instead of nine: both halves' ``tanh`` as one op over the packed tensor scaled by
        ``(1 / beta, 1 / linear_beta)``, the two caps one factor at the end; the same values up to fp32 rounding."""
        if gate_up.shape[-1] % 2:
            raise ValueError(f"gate_up's last dimension must be even (gate half, then up half), got {gate_up.shape[-1]}")
        if self.kind == "silu" or self.linear_beta is None:
            return self(*gate_up.chunk(2, dim=-1))
        beta, linear_beta = self.beta, self.linear_beta
        out_dtype = gate_up.dtype
        x = gate_up.to(_compute_dtype(out_dtype))
        half = x.shape[-1] // 2
        scale = x.new_empty(2, half)
        scale[0], scale[1] = 1.0 / beta, 1.0 / linear_beta
        tanhs = torch.tanh(x * scale.view(-1))
        gate_t, up_t = tanhs[..., :half], tanhs[..., half:]
        if torch.is_grad_enabled() and gate_up.requires_grad:
            out = torch.sigmoid(x[..., :half]) * gate_t * up_t * (beta * linear_beta)
        else:
            out = torch.sigmoid(x[..., :half]).mul_(gate_t).mul_(up_t).mul_(beta * linear_beta)
        return out.to(out_dtype)


# ----- Kimi Delta Attention -----
# The Kimi Delta Attention layer, K3 variant (K3_SPEC.md section 4).
#
# Projections, the depthwise causal short convolution of q|k|v (one filter per channel), the per-channel forget gate,
# beta, the delta-rule recurrence and the gated per-head output norm. The recurrence is `transformers_k3.ops.kda` on CPU
# tensors (the fused CPU operator or the PyTorch algorithm) and, on CUDA tensors, fla's Triton kernels through
# transformers' `use_kernel_func_from_hub_with_fallback` (our PyTorch path when fla is not installed). The state is the
# cache's: the layer gets its views (`KimiK3KDACacheLayer.prepare`) and hands it what it computed (`update`).


# New tokens at or below which a cached step runs the token-by-token recurrence (and the convolutions'
# step update) instead of the chunked form: the op's measured crossover.
RECURRENT_MAX_LEN = RECURRENT_MAX_TOKENS


def _hub_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, safe_gate=False, cu_seqlens=None):
    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, safe_gate=safe_gate)


def _hub_fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                             use_qk_l2norm_in_kernel=False, inplace_final_state=False, cu_seqlens=None):
    return fused_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                               cu_seqlens=cu_seqlens, inplace_final_state=inplace_final_state)


@functools.cache
def _cuda_kernels():
    """(chunked, recurrent) for CUDA tensors: fla's kernels when fla imports, else ours. Built on the first CUDA call
    (importing fla loads Triton, which CPU-only runs never need)."""
    return (use_kernel_func_from_hub_with_fallback("chunk_kda", "fla")(_hub_chunk_kda),
            use_kernel_func_from_hub_with_fallback("fused_recurrent_kda", "fla")(_hub_fused_recurrent_kda))


def _delta_rule_kernels(device: torch.device, kernel: tuple | None):
    """fla's Triton kernels run on CUDA only: other devices take the layer's kernel (`kernelize`) or ours."""
    if device.type == "cuda":
        return _cuda_kernels()
    return kernel or (chunk_kda, fused_recurrent_kda)


@kernel_layer("k3_kda")
class KimiK3DeltaAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        self.proj_dim = self.num_heads * self.head_dim
        self.conv_size = config.linear_conv_kernel_size
        self.lower_bound = config.gate_lower_bound
        self.use_full_rank_gate = config.use_full_rank_gate
        hidden, proj = self.hidden_size, self.proj_dim

        self.q_proj = nn.Linear(hidden, proj, bias=False)
        self.k_proj = nn.Linear(hidden, proj, bias=False)
        self.v_proj = nn.Linear(hidden, proj, bias=False)
        # q's, k's and v's filters stacked (q|k|v), as transformers' Kimi Linear holds them; the release's three
        # tensors are stacked when loading (conversion/hf_mapping.py) and written back when saving. fp32, as the
        # release stores them and the convolution applies them (K3_SPEC.md 2.2, 4.2), also in a model built in bf16
        # (`_keep_in_fp32_modules_strict` keeps them fp32 when loading)
        self.conv1d = nn.Conv1d(3 * proj, 3 * proj, self.conv_size, groups=3 * proj, bias=False, dtype=torch.float32)
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, proj, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(proj, dtype=torch.float32))
        if self.use_full_rank_gate:
            self.g_proj = nn.Linear(hidden, proj, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, proj, bias=False)
        self.o_norm = KimiK3GatedRMSNorm(self.head_dim, eps=config.kda_o_norm_eps)
        # fp32 weight, as the release stores it (K3_SPEC.md 13), also in a model built in bf16
        # (`_keep_in_fp32_modules_strict` keeps it fp32 when loading)
        self.o_norm.weight = nn.Parameter(torch.ones(self.head_dim, dtype=torch.float32))
        self.o_proj = nn.Linear(proj, hidden, bias=False)

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_full_rank_gate:
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def _short_convs(self, mixed, window, cached: bool, cu_seqlens):
        """q, k, v (from the projections q|k|v, `mixed` [B, T, 3P]) after their causal convolutions and SiLU, and the
        new conv window for the cache (None: no cache, or the held `window` [B, 3P, K-1] was updated in place)."""
        if window is not None and mixed.shape[1] <= RECURRENT_MAX_LEN:
            # decode: the step update, the held window advanced in place
            mixed = causal_conv1d_update(mixed, window, self.conv1d.weight, activation="silu")
            return mixed.split(self.proj_dim, dim=-1), None
        mixed, final = causal_conv1d(mixed, self.conv1d.weight, activation="silu", initial_state=window,
                                     output_final_state=cached, cu_seqlens=cu_seqlens)
        return mixed.split(self.proj_dim, dim=-1), final

    def _chunk_options(self) -> dict:
        # K3's gate lower_bound * sigmoid(.) lies in (lower_bound, 0): with a bound in [-5, 0) fla's chunked kernel
        # may take its bounded-gate path (M=16 tensor-core blocks; the same quantity). The PyTorch path ignores it.
        bound = self.lower_bound
        return {"safe_gate": True} if bound is not None and -5 <= bound < 0 else {}

    def _recorded_delta_rule(self, q, k, v, g, beta, state, recorded: int):
        """The delta rule with the recurrent state kept after each of the last `recorded` tokens, so that the
        cache can roll back to any of them (assisted / prompt-lookup decoding). Earlier tokens run chunked."""
        head = q.shape[1] - recorded
        common = dict(scale=self.head_dim ** -0.5, use_qk_l2norm_in_kernel=True)
        chunked, recurrent = self.kernel or (chunk_kda, fused_recurrent_kda)
        outputs = []
        if head > 0:
            out, state = chunked(q[:, :head], k[:, :head], v[:, :head], g[:, :head], beta[:, :head],
                                 initial_state=state, output_final_state=True, **common, **self._chunk_options())
            outputs.append(out)
        out, _, states = recurrent(q[:, head:], k[:, head:], v[:, head:], g[:, head:], beta[:, head:],
                                   initial_state=state, output_state_history=True, **common)
        outputs.append(out)
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else out, states

    # (the conv ops read the filters without calling their modules: accelerate's offload hooks are fired here)
    @force_accelerate_hooks("conv1d")
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, cu_seqlens: torch.LongTensor | None = None, **kwargs) -> torch.Tensor:
        batch, seq_len, _ = hidden_states.shape
        if attention_mask is not None and attention_mask.dim() == 2:
            # Left padding: zeroed inputs make q = k = v = 0 at padded positions, so they leave the state at 0
            # and the first real token sees the same zero history as at a sequence start (also when a padded
            # prompt is pre-filled one token at a time: then a one-token step can be a padded position).
            hidden_states = hidden_states * attention_mask[:, -seq_len:, None].to(hidden_states.dtype)
        cache_layer = past_key_values.kda_layer(self.layer_idx) if past_key_values is not None else None
        window = state = None
        recorded = 0
        if cache_layer is not None:
            window, state, recorded = cache_layer.prepare(seq_len, hidden_states.device)

        mixed = torch.cat([proj(hidden_states) for proj in (self.q_proj, self.k_proj, self.v_proj)], dim=-1)
        raw_inputs = mixed.transpose(1, 2) if recorded else None
        convolved, new_window = self._short_convs(mixed, window, cache_layer is not None, cu_seqlens)
        q, k, v = (t.view(batch, seq_len, self.num_heads, self.head_dim) for t in convolved)
        f = self.f_b_proj(self.f_a_proj(hidden_states))
        g = kda_gate(f.unflatten(-1, (self.num_heads, self.head_dim)), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(hidden_states).float())

        states = None
        if recorded:
            core, states = self._recorded_delta_rule(q, k, v, g, beta, state, recorded)
            final_state = states[-1]
        else:
            chunked, recurrent = _delta_rule_kernels(q.device, self.kernel)
            differentiable = torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (q, k, v, g, beta, state))
            # (fla's recurrent kernel has no backward: CUDA training takes the chunked form)
            use_recurrent = state is not None and seq_len <= RECURRENT_MAX_LEN and not (
                differentiable and q.device.type == "cuda")
            kda = recurrent if use_recurrent else chunked
            # A decode step without autograd updates the cached state in place (no new state per token).
            options = {"inplace_final_state": True} if use_recurrent and not differentiable else {}
            if not use_recurrent:
                options = self._chunk_options()
            core, final_state = kda(
                q, k, v, g, beta, scale=self.head_dim ** -0.5, initial_state=state,
                output_final_state=cache_layer is not None, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                **options,
            )
        if cache_layer is not None:
            new_window = None if new_window is None else new_window.to(mixed.dtype)
            cache_layer.update(final_state, new_window, raw_inputs, states)

        gate = self._output_gate(hidden_states).view(batch, seq_len, self.num_heads, self.head_dim)
        out = self.o_norm(core, gate).reshape(batch, seq_len, self.proj_dim)
        return self.o_proj(out.to(hidden_states.dtype))


# ----- Gated MLA -----
# Gated multi-head latent attention with no positional encoding (K3_SPEC.md section 5).
#
# Keys and values come from a shared latent ``c_kv`` (``kv_lora_rank`` wide, RMS-normed) plus one shared
# ``k_pe`` per token, which in K3 is never rotated. The cache keeps just these ``kv_lora_rank + rope``
# numbers per token. Prefill expands the latent through ``kv_b_proj`` and uses the configured attention
# kernel; decode steps with a cache attend in latent space instead ("weight absorption"), so a step costs
# O(context x latent) and never materialises per-head K/V for the whole context.


# Above this many new tokens (with a cache), expanding K/V for an SDPA kernel beats the absorbed loop.
ABSORB_MAX_QUERY_LEN = 16
# A multi-token step on top of a cache (chunked prefill) attends to the cached context this many tokens at a time;
# see `KimiK3MLA._blockwise_attention`.
CONTEXT_BLOCK = 16384
# Under autograd the context is attended in blocks the step's size (at least this many tokens: fewer keys a call and
# the per-call overhead shows), so the K/V expanded for a block, and again in the backward, are bounded by the step.
MIN_TRAINING_BLOCK = 1024


def eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """Reference attention: fp32 softmax, additive or boolean mask, heads already matched (MLA has no GQA)."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = _apply_mask(scores, attention_mask)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return out, probs


def _apply_mask(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``scores [B, n, T, S]`` masked by a 4-D mask (boolean or additive, causality included) or by the 2-D
    ``[B, S]`` padding mask (1 = a token) that transformers builds for the flash-attention implementations, which
    leave causality to the kernel: here it is added, aligned to the end (the new tokens are the last ``T``). A 4-D
    mask wider than the keys (a static cache's, ``max_cache_len`` wide) covers them from its first column, as
    transformers' SDPA reads it."""
    mask = _keys_mask(mask, *scores.shape[-2:], scores.device)
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores + mask


def _keys_mask(mask: torch.Tensor, q_len: int, seq: int, device) -> torch.Tensor:
    """`_apply_mask`'s mask as a 4-D one over exactly ``seq`` keys (a 2-D padding mask with end-aligned causality)."""
    mask = mask[..., -seq:] if mask.dim() == 2 else mask[..., :seq]
    if mask.dim() == 2:
        mask = mask.to(device=device, dtype=torch.bool)[:, None, None, :] & end_aligned_causal(q_len, seq, device)
    return mask


def static_slots_mask(position: torch.Tensor, q_len: int, capacity: int) -> torch.Tensor:
    """``[q_len, capacity]`` boolean: the slots of a static latent (`KimiK3StaticMLACacheLayer`) each of the last
    ``q_len`` written tokens may attend to, ``position`` (a tensor: no host read) being the count after them."""
    limit = position - q_len + 1 + torch.arange(q_len, device=position.device)
    return torch.arange(capacity, device=position.device)[None, :] < limit[:, None]


def static_attention_mask(slots: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """A 4-D mask over every slot of a static latent: ``slots`` (`static_slots_mask`, causality included) and the
    model's mask, either the 2-D ``[B, L]`` padding mask (``L`` <= the capacity) or a 4-D one (boolean or additive,
    at least the capacity wide)."""
    capacity = slots.shape[-1]
    if attention_mask is None:
        return slots[None, None]
    if attention_mask.dim() == 2:
        padding = F.pad(attention_mask.to(device=slots.device, dtype=torch.bool),
                        (0, capacity - attention_mask.shape[-1]))  # fmt: skip
        return slots[None, None] & padding[:, None, None, :]
    attention_mask = attention_mask[..., :capacity]
    if attention_mask.dtype == torch.bool:
        return attention_mask & slots
    return attention_mask.masked_fill(~slots, torch.finfo(attention_mask.dtype).min)


def uses_blockwise_attention(config) -> bool:
    """Whether a multi-token step after cached tokens takes `KimiK3MLA._blockwise_attention` (SDPA, on every device,
    under autograd or not); the model then builds no ``[T, context]`` mask."""
    return config._attn_implementation == "sdpa"


def uses_fused_backward(query: torch.Tensor) -> bool:
    """Whether MLA under autograd attends its context through the fused kernels (`BlockwiseAttention`): a kernel
    backward that takes a merged log-sum-exp exists for the device, and no graph is being compiled (dynamo does not
    trace its nested backward); otherwise through `checkpointed_block_attention`."""
    return query.device.type in LSE_BACKWARDS and not torch.compiler.is_compiling()


class BlockwiseAttention(torch.autograd.Function):
    """Softmax attention of ``query`` over the step's own latents ``step`` (causally, top-left aligned) and the
    context's ``context`` in blocks of ``block`` tokens, each expanded to K/V by ``expand`` (`KimiK3MLA._expand`),
    attended by the fused kernel and merged by log-sum-exp, under autograd. Only the latents, the query and the merged
    output are kept: the backward expands each block again and runs its kernel backward with the merged output and
    log-sum-exp (as ring attention does), which is the gradient of the softmax over all keys; the expansion's weights
    get theirs from a nested backward, as torch's reentrant checkpoint does (so, like it, this works with
    ``.backward()``, not ``torch.autograd.grad``). Neither a ``[T, context]`` matrix nor the context's K/V are kept,
    and a context that needs no gradient gets none computed."""

    @staticmethod
    def forward(ctx, query, expand, scale, pad, block, step, context):
        out, lse = attend_blocks(query, expand, scale, pad, step, context, block)
        out = out.to(query.dtype)
        ctx.save_for_backward(query, out, lse, step, context)
        ctx.expand, ctx.scale, ctx.pad, ctx.block = expand, scale, pad, block
        device = query.device.type
        ctx.autocast = device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, out, lse, step, context = ctx.saved_tensors
        backward = LSE_BACKWARDS[query.device.type]
        grad_out = grad_out.contiguous()

        def block_backward(latent: torch.Tensor, causal: bool, needs_grad: bool):
            # (expanded as in the forward: a backward outside the forward's autocast would not cast to its dtype)
            with torch.enable_grad(), torch.autocast(*ctx.autocast):
                leaf = latent.detach().requires_grad_(needs_grad)
                key, value = ctx.expand(leaf)
                if ctx.pad:
                    value = F.pad(value, (0, ctx.pad))
            dq, dk, dv = backward(grad_out, query.detach(), key.detach(), value.detach(), out, lse, causal, ctx.scale)
            if key.requires_grad:
                torch.autograd.backward((key, value), (dk, dv))
            return dq, leaf.grad

        grad_query, grad_step = block_backward(step, True, ctx.needs_input_grad[5])
        grad_context = torch.empty_like(context) if ctx.needs_input_grad[6] else None
        for start, end in blocks(context.shape[1], ctx.block):
            dq, grad = block_backward(context[:, start:end], False, grad_context is not None)
            grad_query += dq
            if grad_context is not None:
                grad_context[:, start:end] = grad
        return grad_query, None, None, None, None, grad_step, grad_context


def _block_terms(query: torch.Tensor, latent: torch.Tensor, expand: Callable, scale: float, causal: bool):
    """One key block's part of a softmax attention: ``sum exp(S - m) V`` ``[B, n, T, dv]``, ``sum exp(S - m)``
    ``[B, n, T, 1]`` (both fp32) and ``m`` (the logits' row maximum, detached: a constant shift, whatever it is)."""
    key, value = expand(latent)
    with fp32_products(query.device):
        scores = attention_logits(query, key, causal, scale)
        shift = scores.detach().amax(-1, keepdim=True)
        weights = (scores - shift).exp()
        return torch.matmul(weights, value.float()), weights.sum(-1, keepdim=True), shift


def checkpointed_block_attention(query: torch.Tensor, expand: Callable, scale: float, block: int, step: torch.Tensor,
                                 context: torch.Tensor) -> torch.Tensor:
    """Softmax attention ``[B, n, T, dv]`` of ``query`` over the step's own latents ``step`` (causally, top-left
    aligned) and the context's ``context`` in blocks of ``block`` tokens, each expanded to K/V by ``expand``
    (`KimiK3MLA._expand`), under autograd, in plain PyTorch: any device, and a graph dynamo captures whole.

    Each block gives ``sum exp(S - m) V`` and ``sum exp(S - m)`` for a detached shift ``m``, rescaled to a common
    shift as they come (as flash attention's online softmax) and divided at the end: softmax attention over all the
    keys, whose gradient autograd takes through both sums (a constant shift cancels in the quotient). Each block runs
    under non-reentrant activation checkpointing and a sum's backward keeps nothing, so autograd keeps each block's
    inputs (the query, views of the latents) and recomputes the block in the backward: neither a ``[T, context]``
    matrix nor the context's K/V are kept. A context that needs no gradient gets none; the expansion's weights
    (an adapter's too) get theirs from the recomputed block."""

    def terms(latent: torch.Tensor, causal: bool):
        return checkpoint(_block_terms, query, latent, expand, scale, causal, use_reentrant=False,
                          preserve_rng_state=False)

    total, norm, shift = terms(step, True)
    for start, end in blocks(context.shape[1], block):
        part, part_norm, part_shift = terms(context[:, start:end], False)
        merged = torch.maximum(shift, part_shift)
        old, new = (shift - merged).exp(), (part_shift - merged).exp()
        total, norm, shift = total * old + part * new, norm * old + part_norm * new, merged
    return (total / norm).to(query.dtype)


@kernel_layer("k3_mla")
class KimiK3MLA(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.scaling = self.qk_head_dim ** -0.5  # no yarn mscale: K3 has no RoPE at all
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.num_key_value_groups = 1
        self.context_block = CONTEXT_BLOCK  # (an attribute: smaller blocks bound a chunked prefill's memory lower)
        hidden = config.hidden_size
        # the latent norms' eps: 1e-6 by default, as the release's own modeling_kimi_linear.py builds them (no eps
        # argument; mlx-lm and transformers' Kimi Linear agree), where SGLang / vLLM / llama.cpp use rms_norm_eps
        # (KimiK3TextConfig.mla_latent_norm_eps; None = rms_norm_eps)
        latent_eps = config.mla_latent_norm_eps if config.mla_latent_norm_eps is not None else config.rms_norm_eps

        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=False)
            self.q_a_layernorm = KimiK3RMSNorm(self.q_lora_rank, eps=latent_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = KimiK3RMSNorm(self.kv_lora_rank, eps=latent_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                   bias=False)
        if config.mla_use_output_gate:
            self.g_proj = nn.Linear(hidden, self.num_heads * self.v_head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=False)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(*x.shape[:2], self.num_heads, self.qk_head_dim).transpose(1, 2)  # [B, n, T, dn+dr]

    def _latent(self, x: torch.Tensor) -> torch.Tensor:
        """``[ĉ (normed c_kv), k_pe]`` per token, ``[B, T, kv_lora_rank + rope]``: what the cache stores."""
        kv = self.kv_a_proj_with_mqa(x)
        c_kv, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys ``[B, n, S, dn+dr]`` and values ``[B, n, S, dv]`` from the latent."""
        return expand_latent(latent, self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim, self.kv_b_proj)

    def _absorbed_attention(self, query: torch.Tensor, latent: torch.Tensor,
                            attention_mask: torch.Tensor | None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Attention computed against the latent: ``q_nope . (W_kc c) = (W_kc^T q_nope) . c`` and the output
        ``W_vc (sum p c)``. Returns ``[B, T, n, dv]``. ``slots``: a static latent's `static_slots_mask` (its rows
        past the tokens are masked here; a padding mask still applies, causality is in ``slots``)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_kc, w_vc = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)  # [n, dn, r], [n, dv, r]
        q_nope, q_pe = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_latent = torch.matmul(q_nope, w_kc)  # [B, n, T, r]
        batch, heads, q_len, _ = q_nope.shape
        seq = latent.shape[1]
        # One product covers [c_kv | k_pe] against [q_latent | q_pe]; the (long) latent stays its row-major
        # operand, so no step ever copies or transposes the cache.
        q_cat = torch.cat([q_latent, q_pe], dim=-1).reshape(batch, heads * q_len, -1)  # [B, n*T, r+dr]
        if slots is not None:
            attention_mask = static_attention_mask(slots, attention_mask)
        if attention_mask is not None:
            attention_mask = _keys_mask(attention_mask, q_len, seq, latent.device)
        # The logits, the mask (causality over the new tokens without one), the softmax and the weighted sum. The
        # logits stay fp32: a bf16 matmul would round each to 8 bits before the softmax, making a decode step less
        # accurate than the prefill's attention (SGLang's K3 decode kernels keep them in fp32 too).
        o_latent = (self.kernel or latent_attention)(latent, q_cat, self.scaling, self.kv_lora_rank, q_len,
                                                     self.context_block, attention_mask)  # [B, n*T, r]
        out = torch.matmul(o_latent.reshape(batch, heads, q_len, -1), w_vc.transpose(1, 2))  # [B, n, T, dv]
        return out.transpose(1, 2)

    def _blockwise_attention(self, query: torch.Tensor, latent: torch.Tensor | None, past_len: int,
                             step: torch.Tensor | None = None, context_grad: bool = True,
                             context: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of ``T`` new queries to ``past_len`` cached tokens plus themselves, with memory bounded
        by the step, not the context. Returns ``[B, T, n, dv]``.

        The new tokens attend to each other causally; the cached context is expanded through ``kv_b_proj``
        ``context_block`` tokens at a time and attended without a mask; the partial results are merged by their
        log-sum-exp (as flash-decoding does). Neither a ``[T, context]`` mask nor K/V for the whole context ever
        exists, which is what makes a million-token chunked prefill fit in a few GB. Each block goes through
        `attention_with_lse` (a fused kernel where the device has one). Under autograd (a segment trained after its
        context) only the latents are kept and each block is expanded again in the backward: `BlockwiseAttention`
        where the fused kernels' backward serves (`uses_fused_backward`); inside a compiled graph, with a plain
        ``kv_b_proj`` (`operator_expands`), the ``transformers_k3::mla_context_attention`` operator;
        `checkpointed_block_attention` otherwise (other devices; an adapter in a graph); the context then goes in
        blocks the step's size (`MIN_TRAINING_BLOCK`) and gets a gradient only with ``context_grad``. The step's own latents are ``step``
        (the cache's `KimiK3LatentView.step`, whose gradient then skips the cache's buffer); ``latent`` None: the
        context is ``context`` (the cache's `KimiK3LatentView.context`, latents it holds as given, whose gradient then
        goes straight to them)."""
        step = latent[:, past_len:] if step is None else step
        context = latent[:, :past_len] if context is None else context
        pad = max(self.qk_head_dim - self.v_head_dim, 0)
        if torch.is_grad_enabled() and (query.requires_grad or step.requires_grad or context.requires_grad
                                        or any(p.requires_grad for p in self.kv_b_proj.parameters())):
            # (the backward expands each block again: the context's K/V are never kept)
            block = min(self.context_block, max(query.shape[-2], MIN_TRAINING_BLOCK))
            context = context if context_grad else context.detach()
            if uses_fused_backward(query):
                out = BlockwiseAttention.apply(query, self._expand, self.scaling, pad, block, step, context)
                return out[..., : self.v_head_dim].transpose(1, 2)
            if torch.compiler.is_compiling() and operator_expands(self.kv_b_proj):
                # (one opaque call each way: inductor's code would hold every block's recomputed logits at once)
                weight, device = self.kv_b_proj.weight, query.device.type
                if torch.is_autocast_enabled(device):  # (in the dtype autocast gives the expansion elsewhere)
                    weight = weight.to(torch.get_autocast_dtype(device))
                out = mla_context_attention(query, step, context, weight, self.scaling, block, self.qk_nope_head_dim)
                return out[0].transpose(1, 2)
            out = checkpointed_block_attention(query, self._expand, self.scaling, block, step, context)
            return out.transpose(1, 2)

        def attend(block: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
            key, value = self._expand(block)
            if pad:  # the fused kernel wants v's head dim == q/k's (as the prefill path above)
                value = F.pad(value, (0, pad))
            out, lse = attention_with_lse(query, key, value, causal, self.scaling)
            return out[..., : self.v_head_dim].float(), lse  # [B, n, T, dv], [B, n, T]

        # (a graph guards on the blocks' count, not the length)
        context_parts = (attend(context[:, start:end], causal=False)
                         for start, end in blocks(context.shape[1], self.context_block))  # fmt: skip
        out, _ = merge_attention_blocks(itertools.chain([attend(step, causal=True)], context_parts))
        return out.to(query.dtype).transpose(1, 2)

    # (absorbed decode reads `kv_b_proj.weight` without calling it: accelerate's offload hooks are fired here)
    @force_accelerate_hooks("kv_b_proj")
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, absorb: bool | None = None, **kwargs):
        batch, q_len, _ = hidden_states.shape
        query = self._queries(hidden_states)
        latent = self._latent(hidden_states)
        past_len, has_past, static, view = 0, False, None, None
        if past_key_values is not None:
            # (a compiled decode step of a static cache reads no length: the absorbed path masks by `position`)
            view = past_key_values.update_mla(latent, self.layer_idx)
            latent, past_len, has_past, static = view.latent, view.past_len, view.had_past, view.position

        if absorb is None:
            # Absorption reads `kv_b_proj.weight` itself, so only a plain nn.Linear qualifies: an adapter (PEFT LoRA)
            # or a quantized layer (bitsandbytes) computes something else, which the expanded path gets by calling it.
            absorb = (has_past and q_len <= ABSORB_MAX_QUERY_LEN and not kwargs.get("output_attentions")
                      and type(self.kv_b_proj) in PLAIN_LINEARS)
        attn_weights = None
        implementation = self.config._attn_implementation
        flash = str(implementation).startswith(("flash_attention", "kernels-community/flash"))
        if static is not None and not absorb and torch.compiler.is_compiling() and not flash:
            # a graph reads no length: every row of the static latent, those past its tokens masked
            attention_mask = static_attention_mask(static_slots_mask(static, q_len, latent.shape[1]), attention_mask)
        elif static is not None and not absorb:  # eager steps attend over the held rows of a static latent only
            latent, past_len = view.held(q_len)
            if attention_mask is not None and attention_mask.dim() == 4:
                attention_mask = attention_mask[..., : past_len + q_len]
        # The model passes no mask after cached tokens only when every row is unpadded: causal over past + step.
        blockwise = (not absorb and attention_mask is None and past_len > 0 and q_len > 1
                     and uses_blockwise_attention(self.config))
        if latent is None and not blockwise:
            latent = view.whole()  # (latents the cache holds as given: joined only where the whole is attended)
        if absorb:
            slots = None if static is None else static_slots_mask(static, q_len, latent.shape[1])
            attn_output = self._absorbed_attention(query, latent, attention_mask, slots)
        elif blockwise:
            attn_output = self._blockwise_attention(query, latent, past_len, view.step, view.context_grad,
                                                    view.context)
        else:
            key, value = self._expand(latent)
            interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
            if attention_mask is None and past_len > 0 and q_len > 1 and not flash:
                # No mask from a caller that leaves causality to the layer (as the model does for SDPA's blockwise
                # path): a kernel's own causality would align the diagonal top-left, not to the cached context's end.
                attention_mask = end_aligned_causal(q_len, past_len + q_len, query.device)[None, None]
            pad = self.qk_head_dim - self.v_head_dim
            if interface is not eager_attention_forward and pad > 0:
                # Fused kernels (SDPA's CPU flash path, flash-attn) need v's head dim == q/k's; zero columns
                # cost far less than SDPA's math fallback (timings in ANCHORS.md).
                value = F.pad(value, (0, pad))
            attn_output, attn_weights = interface(
                self, query, key, value, attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs,
            )
            attn_output = attn_output[..., : self.v_head_dim]

        attn_output = attn_output.reshape(batch, q_len, self.num_heads * self.v_head_dim)
        if self.config.mla_use_output_gate:
            attn_output = attn_output * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(attn_output), attn_weights


# ----- Router, experts, sparse MoE, dense MLP -----
# The K3 feed-forward blocks: dense SiTU MLP, sigmoid router, experts and the Stable Latent MoE.
#
# Spec sections 6.2 and 6.3. A MoE layer maps the FFN input ``y [T, H]`` to
#
#     routed = up( RMSNorm( sum_{i in topk} w_i * E_i( down(y) ) ) )      (latent MoE)
#     out    = routed + shared_experts(y)
#
# The router decides on the full-width ``y``; the routed experts live in a narrower latent space
# (``routed_expert_hidden_size``), and the latent RMSNorm is applied to the fully summed expert mixture,
# which makes ``routed_scaling_factor`` cancel except through the norm's eps.


@kernel_layer("k3_router")
class KimiK3Router(nn.Module):
    """Sigmoid (or softmax) top-k router with a selection-only correction bias (spec 6.3, step 1).

    ``e_score_correction_bias`` is the aux-loss-free balancing bias: it shifts which experts are chosen
    but never the weight a chosen expert receives. Everything is computed in fp32. Its kernel (`kernelize`): the
    ungrouped top-k selection on CPU in the fused kernels (`moe_ops.router_select`). ``logits_observers``: how many
    readers of its logits (Quantile Balancing's hooks) are attached; while any is, no kernel skips the logits.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.hidden_size = config.hidden_size
        self.use_softmax = config.moe_router_activation_func == "softmax"
        self.renormalize = config.moe_renormalize
        self.routed_scaling_factor = config.routed_scaling_factor
        self.num_expert_group = config.num_expert_group
        self.topk_group = config.topk_group
        # `router_fp32`: the checkpoint stores the router in fp32 (a bf16 load keeps it: the parameter is built
        # fp32). The logits are fp32 either way.
        self.weight_fp32 = bool(getattr(config, "router_fp32", False))
        weight_dtype = torch.float32 if self.weight_fp32 else None
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, dtype=weight_dtype))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        self.logits_observers = 0

    def forward(
        self, hidden_states: torch.Tensor, need_logits: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """``hidden_states [..., H]`` -> ``(router_logits [N, E] fp32, topk_weights [N, k] fp32,
        topk_indices [N, k] int64)`` with ``N`` the number of tokens.

        ``need_logits=False`` (the MoE layer's call without ``output_router_logits``): the caller uses only the
        selection, so with the kernel attached and no other reader of the logits (``logits_observers``), an fp32 router on a CPU with the AMX tile unit, given at least `moe_ops.SCREEN_MIN_TOKENS`
        tokens, selects without the ``[N, E]`` fp32 GEMM (the same selection and scores as from fp32 logits) and
        returns None in place of the logits."""
        hidden_states = hidden_states.reshape(-1, self.hidden_size)
        kernel = self.kernel
        screen = (
            kernel is not None and not need_logits and hidden_states.shape[0] >= moe_ops.SCREEN_MIN_TOKENS
            and not self.logits_observers
        )  # fmt: skip
        router_logits, selected, topk_indices = (kernel or moe_ops.router_select)(
            hidden_states, self.weight, self.e_score_correction_bias, self.top_k, self.use_softmax,
            self.num_expert_group, self._keep_best_groups, screen=screen,
        )  # fmt: skip
        return router_logits, self._final_weights(selected), topk_indices

    def _final_weights(self, selected: torch.Tensor) -> torch.Tensor:
        """The chosen (unbiased) scores renormalized over the k and scaled."""
        if self.renormalize:
            selected = selected / (selected.sum(dim=-1, keepdim=True) + 1e-20)
        return selected * self.routed_scaling_factor

    def _keep_best_groups(self, scores_for_choice: torch.Tensor) -> torch.Tensor:
        """Group-limited routing: rank groups by the sum of their two best (biased) scores, keep the
        ``topk_group`` best groups and hide every expert of the other groups from the top-k."""
        num_tokens = scores_for_choice.shape[0]
        grouped = scores_for_choice.view(num_tokens, self.num_expert_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        kept_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, -1)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, "
            f"scoring={'softmax' if self.use_softmax else 'sigmoid'}, groups={self.num_expert_group}/{self.topk_group}"
        )


def router_aux_loss(
    router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    routers: list[KimiK3Router],
    batch_size: int = 1,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise auxiliary balance loss, averaged over the MoE layers (off by default in
    K3, which balances with the selection bias instead; see `transformers_k3.balancing`).

    For one layer and one sequence of ``T`` (unpadded) tokens, with ``s`` the router scores, ``E`` experts
    and top-``k`` selection made exactly as the router does (biased scores, `e_score_correction_bias`)::

        f_e = E / (k T) * #{t : e selected at t}        (load relative to perfect balance; no gradient)
        P_e = 1/T * sum_t s_{t,e} / sum_j s_{t,j}         (mean normalised score; carries the gradient)
        L   = sum_e f_e P_e                               (= 1 when the load is perfectly even)

    ``router_logits``: one ``[batch_size * seq, E]`` tensor per MoE layer, in the order of ``routers`` (as
    recorded with ``output_router_logits=True``). ``attention_mask [batch, seq]``: padding is left out.
    Returns the mean over layers and sequences (a scalar with gradient to the router weights).
    """
    if len(router_logits) != len(routers):
        raise ValueError(f"got router logits for {len(router_logits)} MoE layers but {len(routers)} routers")
    losses = []
    for logits, router in zip(router_logits, routers):
        logits = logits.float().reshape(batch_size, -1, router.num_experts)
        scores = logits.softmax(dim=-1) if router.use_softmax else logits.sigmoid()
        chosen = torch.topk(scores.detach() + router.e_score_correction_bias.float(), router.top_k, dim=-1).indices
        mask = (
            torch.ones(scores.shape[:2], device=scores.device)
            if attention_mask is None
            else attention_mask[:, -scores.shape[1] :].to(scores.device, torch.float32)
        )
        tokens = mask.sum(dim=1)  # [B]
        picks = torch.zeros_like(scores).scatter_(-1, chosen, 1.0)  # [B, T, E]
        f = (picks * mask[..., None]).sum(dim=1) * router.num_experts / (router.top_k * tokens.clamp_min(1))[:, None]
        p = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        P = (p * mask[..., None]).sum(dim=1) / tokens.clamp_min(1)[:, None]
        per_sequence = (f * P).sum(dim=-1)  # [B]
        has_tokens = tokens > 0
        losses.append(per_sequence[has_tokens].mean() if has_tokens.any() else per_sequence.sum() * 0)
    return torch.stack(losses).mean()


def _fuse_per_expert_weights(module, state_dict, prefix, *args) -> None:
    """``load_state_dict`` pre-hook of `KimiK3Experts`: per-expert ``{e}.w1/w2/w3.weight`` (the official layout, which
    ``save_pretrained`` writes for a model built from a config) become ``gate_up_proj`` / ``down_proj``, as
    ``from_pretrained`` fuses them. transformers' Trainer restores checkpoints (``resume_from_checkpoint``,
    ``load_best_model_at_end``) with a plain ``load_state_dict``, which otherwise left the experts as they were
    (only a missing / unexpected keys warning)."""
    if f"{prefix}gate_up_proj" in state_dict or f"{prefix}down_proj" in state_dict:
        return
    n = module.num_experts
    if not any(f"{prefix}{e}.{w}.weight" in state_dict for e in range(n) for w in ("w1", "w2", "w3")):
        return
    names = [f"{prefix}{e}.{w}.weight" for e in range(n) for w in ("w1", "w2", "w3")]
    if not all(name in state_dict for name in names):
        # Part of the experts (a sharded checkpoint is loaded one shard per call, Trainer's resume): each block
        # goes into its slice of the fused weights now; load_state_dict then sees no unexpected keys for them.
        _copy_expert_blocks(module, state_dict, prefix)
        return
    w1, w2, w3 = ([state_dict.pop(f"{prefix}{e}.{w}.weight") for e in range(n)] for w in ("w1", "w2", "w3"))
    gate_up = torch.stack([torch.cat([g, u], dim=0) for g, u in zip(w1, w3)])  # [E, 2I, D]
    down = torch.stack(w2)  # [E, D, I]
    if getattr(module, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    state_dict[f"{prefix}gate_up_proj"], state_dict[f"{prefix}down_proj"] = gate_up, down


@torch.no_grad()
def _copy_expert_blocks(module, state_dict, prefix) -> None:
    inter = module.intermediate_dim
    transposed = getattr(module, "is_transposed", False)
    for e in range(module.num_experts):
        for proj in ("w1", "w2", "w3"):
            name = f"{prefix}{e}.{proj}.weight"
            if name not in state_dict:
                continue
            block = state_dict.pop(name)
            if proj == "w2":
                target = module.down_proj[e]
            else:
                rows = slice(0, inter) if proj == "w1" else slice(inter, 2 * inter)
                target = module.gate_up_proj[e][:, rows] if transposed else module.gate_up_proj[e][rows]
            block = block.t() if transposed else block
            if tuple(block.shape) != tuple(target.shape):
                raise RuntimeError(f"{name}: shape {tuple(block.shape)} does not fit the model's expert block "
                                   f"{tuple(target.shape)}")
            target.copy_(block)


def experts_widths(config) -> tuple[int, int, int]:
    """``(num_experts, hidden_dim, intermediate_dim)`` of a MoE layer's routed experts: ``hidden_dim`` is the latent
    width ``routed_expert_hidden_size`` for the latent MoE, else ``hidden_size``."""
    latent = config.routed_expert_hidden_size
    return config.num_experts, config.hidden_size if latent is None else latent, config.moe_intermediate_size


@kernel_layer("k3_experts")
@use_experts_implementation
class KimiK3Experts(nn.Module):
    """The routed experts as fused 3-D weights (transformers' experts interface layout).

    ``gate_up_proj [E, 2I, D]`` holds each expert's gate rows (checkpoint ``w1``) then its up rows
    (``w3``), not interleaved; ``down_proj [E, D, I]`` is ``w2``. ``D`` is the latent width
    ``routed_expert_hidden_size`` for the latent MoE, else ``hidden_size``.
    ``config._experts_implementation`` selects this eager forward, transformers' "grouped_mm" / "batched_mm" or
    our "k3_grouped_mm" (`ops.experts`); all of them apply the GLU through `_apply_gate`.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = experts_widths(config)
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.glu = GLU.from_config(config)
        self.register_load_state_dict_pre_hook(_fuse_per_expert_weights)

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        return self.glu.packed(gate_up_out)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``hidden_states [N, D]``, ``top_k_index [N, k]``, ``top_k_weights [N, k]`` -> ``[N, D]``:
        ``out[t] = sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t])`` (`eager_experts`)."""
        return eager_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                             self._apply_gate)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}"


@kernel_layer("k3_sparse_moe")
class KimiK3SparseMoE(nn.Module):
    """The FFN of every MoE layer: router + routed experts (in the latent space when
    ``routed_expert_hidden_size`` is set) + full-width shared experts (spec 6.3).

    Returns only the FFN output; the router logits are recorded by the model from ``self.gate``
    (``output_router_logits``: the model says so, so that the router computes them). Its kernel (`kernelize`): a
    decode step on CPU, the whole layer in one call (`moe_ops.MoeDecodeKernel`).
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.gate = KimiK3Router(config)
        self.experts = KimiK3Experts(config)

        latent_size = config.routed_expert_hidden_size
        self.is_latent = latent_size is not None
        self.routed_expert_down_proj = None
        self.routed_expert_norm = None
        self.routed_expert_up_proj = None
        if self.is_latent:
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, latent_size, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = KimiK3RMSNorm(latent_size, eps=config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(latent_size, config.hidden_size, bias=False)

        self.shared_experts = None
        if config.num_shared_experts > 0:
            self.shared_experts = KimiK3MLP(
                config, intermediate_size=config.num_shared_experts * config.moe_intermediate_size
            )

    def forward(self, hidden_states: torch.Tensor, output_router_logits: bool = False) -> torch.Tensor:
        """``hidden_states [B, T, H]`` or ``[N, H]`` -> same shape."""
        orig_shape = hidden_states.shape
        y = hidden_states.reshape(-1, self.hidden_size)
        out = None if self.kernel is None else self.kernel(y, output_router_logits)
        if out is None:
            out = self._modules_forward(y, output_router_logits)
        return out.view(*orig_shape)  # (unpacked: a torch.Size argument costs more to parse, every step)

    def _modules_forward(self, y: torch.Tensor, output_router_logits: bool = False) -> torch.Tensor:
        """The layer through its modules, ``y [N, H]`` -> ``[N, H]``."""
        _, topk_weights, topk_indices = self.gate(y, need_logits=output_router_logits)  # on the full-width input
        z = self.routed_expert_down_proj(y) if self.is_latent else y
        routed = self.experts(z, topk_indices, topk_weights)
        if self.routed_expert_norm is not None:
            routed = self.routed_expert_norm(routed)  # on the fully summed latent
        if self.is_latent:
            routed = self.routed_expert_up_proj(routed)

        if self.shared_experts is not None:
            routed = routed + self.shared_experts(y)
        return routed


@kernel_layer("k3_mlp")
class KimiK3MLP(nn.Module):
    """``down(glu(gate(x), up(x)))`` with the configured GLU (SiTU for K3).

    The dense layer-0 FFN (width ``intermediate_size``) and the fused shared experts (width
    ``num_shared_experts * moe_intermediate_size``). Its kernel (`kernelize`): SiTU in one CPU kernel call.
    """

    def __init__(self, config, intermediate_size: int | None = None, hidden_size: int | None = None) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.glu = GLU.from_config(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(hidden_states), self.up_proj(hidden_states)
        act = None if self.kernel is None else self.kernel(gate, up)
        return self.down_proj(self.glu(gate, up) if act is None else act)


# ----- Block Attention Residuals -----
# Block Attention Residuals (K3_SPEC.md section 3).
#
# K3 has no ``h = h + f(norm(h))`` residual. Each sublayer reads a softmax mixture over a bank of
# block snapshots of the residual stream plus the running partial sum of the current block; the
# mixing scores come from a per-sublayer pseudo-query ``w`` dotted with each RMS-normalised candidate.


def attn_res_scores(candidates: Sequence[torch.Tensor], query: torch.Tensor, key_norm: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """Softmax mixing weights ``[m, *batch]`` (fp32) of ``m`` candidates ``[*batch, H]``.

    ``s_j = sum_d r_jd / sqrt(mean_d r_j^2 + eps) * n_d * w_d``, softmax over ``j``. Only ``n * w``
    matters, so it is formed once instead of normalising every candidate with ``n`` first.
    """
    nw = key_norm.float() * query.float().reshape(-1)
    scores = []
    for r in candidates:
        r = r.float()
        inv_rms = torch.rsqrt(r.pow(2).mean(-1) + eps)
        scores.append((r @ nw) * inv_rms)
    return torch.stack(scores, dim=0).softmax(dim=0)


def attn_res_mix(candidates: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """``sum_j alpha_j r_j`` accumulated in fp32 over the un-normalised candidates, cast to their dtype."""
    out = candidates[0].float() * weights[0].unsqueeze(-1)
    for r, a in zip(candidates[1:], weights[1:]):
        out = out + r.float() * a.unsqueeze(-1)
    return out.to(candidates[0].dtype)


# A read whose candidates hold at most this many elements in all (a decode step's: m x batch x H) is computed on
# them stacked into one [m, *batch, H] fp32 tensor: ~9 ops in all where the loops above take ~8 per candidate, each
# a few microseconds at this size (the shipped small model's bf16 decode step: 12 reads of 2-7 candidates).
# Larger reads loop over the candidates, so that no stacked copy of a long prefill's residual stream is made.
STACKED_MAX_ELEMENTS = 1 << 16


def attn_res_read_stacked(candidates: Sequence[torch.Tensor], query: torch.Tensor, key_norm: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attn_res_scores` and `attn_res_mix` of the same read, computed on the stacked candidates: the same fp32
    quantities (the sums over H and over the candidates in another order)."""
    nw = key_norm.float() * query.float().reshape(-1)
    stacked = torch.stack(list(candidates)).float()
    weights = ((stacked @ nw) * torch.rsqrt(stacked.pow(2).mean(-1) + eps)).softmax(dim=0)
    return (stacked * weights.unsqueeze(-1)).sum(0).to(candidates[0].dtype), weights


class KimiK3BlockAttnRes(nn.Module):
    """One Block AttnRes read point (attention or FFN side of a layer, or the model's final read): it owns the read's
    pseudo-query ``w`` and key norm ``n`` (the checkpoint's ``{read}_proj.weight`` / ``{read}_norm.weight``, renamed
    at load and back at save) and the snapshot rule. Called with the candidates (the bank, then the running partial
    sum) it returns ``(mix, weights)``, ``weights`` of shape ``[num_candidates, batch, seq]``: transformers' output
    recorders capture the pre-norm mixture (``output_hidden_states``) and the depth weights
    (``output_attn_res_weights``), and accelerate's hooks place its weights, at every read.

    With AttnRes off it holds nothing and returns its single candidate (the classic residual stream)."""

    def __init__(self, config: KimiK3TextConfig, layer_idx: int | None = None, side: str = "output"):
        super().__init__()
        self.eps = config.rms_norm_eps
        # The bank takes a snapshot at the attention side of every S-th layer, after that layer's read.
        self.starts_block = (config.use_attn_res and side == "attention"
                             and layer_idx % config.attn_res_block_size == 0)
        if not config.use_attn_res:
            self.key_norm = self.pseudo_query = None
            return
        key_norm, pseudo_query = torch.ones(config.hidden_size), torch.zeros(1, config.hidden_size)
        # (draws what the nn.Linear that held the pseudo-query drew when built: a seeded model keeps its weights)
        nn.init.kaiming_uniform_(torch.empty(1, config.hidden_size), a=math.sqrt(5))
        if side == "attention" and layer_idx == 0:
            # Layer 0's attention side reads a single candidate (the embeddings), whose softmax weight is 1 whatever
            # these hold. The checkpoint has them, so they are kept, as buffers: a parameter that never gets a
            # gradient breaks DDP with `find_unused_parameters=False` (Trainer's choice under gradient checkpointing).
            self.register_buffer("key_norm", key_norm)
            self.register_buffer("pseudo_query", pseudo_query)
        else:
            self.key_norm = nn.Parameter(key_norm)
            self.pseudo_query = nn.Parameter(pseudo_query)

    def forward(self, *candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(candidates) == 1:
            # A single candidate has weight 1 (the first layer, or AttnRes switched off): no work.
            only = candidates[0]
            return only, only.new_ones(1, *only.shape[:-1], dtype=torch.float32)
        if sum(r.numel() for r in candidates) <= STACKED_MAX_ELEMENTS:
            return attn_res_read_stacked(candidates, self.pseudo_query, self.key_norm, self.eps)
        weights = attn_res_scores(candidates, self.pseudo_query, self.key_norm, self.eps)
        return attn_res_mix(candidates, weights), weights


# ----- Decoder layer and model -----
@dataclass
class KimiK3ModelOutputWithPast(MoeModelOutputWithPast):
    r"""attn_res_weights (`tuple[torch.FloatTensor]`, *optional*, returned with `output_attn_res_weights=True`):
        The depth-softmax weights of every AttnRes read in execution order (attention side and FFN side of each
        layer, then the final read), each `[num_candidates, batch, seq]`: which block snapshots a sublayer reads."""

    attn_res_weights: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class KimiK3CausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""attn_res_weights (`tuple[torch.FloatTensor]`, *optional*): see `KimiK3ModelOutputWithPast`."""

    attn_res_weights: tuple[torch.FloatTensor, ...] | None = None


def packed_sequence_boundaries(position_ids, cu_seq_lens_q, attention_mask, past_key_values,
                               batch_size: int) -> torch.LongTensor | None:
    """``cu_seqlens`` of a packed batch (several sequences concatenated in one row, as transformers'
    `DataCollatorWithFlattening` produces), or None. Taken from the collator's ``cu_seq_lens_q`` when given,
    else from ``position_ids`` restarting at 0. MLA gets the matching block-diagonal mask from
    `create_causal_mask`, which detects the same packing from ``position_ids``."""
    if batch_size != 1 or past_key_values is not None or attention_mask is not None:
        return None
    if cu_seq_lens_q is not None:
        return cu_seq_lens_q.to(torch.long)
    if position_ids is None:
        return None
    positions = position_ids.reshape(-1)
    if torch.compiler.is_compiling():
        # A graph cannot branch on whether the row is packed: it always takes the starts (position 0, and token 0),
        # their count an unbacked size; a single sequence gives [0, T], which computes what None does.
        first = torch.arange(positions.numel(), device=positions.device) == 0
        starts = ((positions == 0) | first).nonzero().flatten()
        torch._check(starts.numel() >= 1)  # (token 0 starts a sequence: the size's bound, for the checks downstream)
        return torch.cat([starts, starts.new_full((1,), positions.numel())])
    starts = (positions == 0).nonzero().flatten()
    if starts.numel() <= 1 and positions[0] == 0:
        return None
    if starts.numel() == 0 or starts[0] != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    return torch.cat([starts, starts.new_tensor([positions.numel()])])


class KimiK3CarriedState:
    """One layer's cached state carried through a gradient-checkpointed layer as tensors, and the cache interface its
    attention calls (`kda_layer`, `update_mla`) over them. transformers' checkpointed layer runs without the cache,
    since its recompute in the backward would write the cache a second time from the state the first run left; so the
    model reads the layer's incoming state (`KimiK3HybridCache.layer_state`) before the layer, passes it positionally
    (checkpointing then saves it, gives it a gradient and recomputes from it), gets the new state back among the
    layer's outputs (`new_state`) and stores it after the layer (`KimiK3HybridCache.hold_layer_state`). The layer's
    forward is then a function of its inputs alone."""

    def __init__(self, layer_type: str, held: Sequence[torch.Tensor], conv_width: int):
        self.kda = self.prefix = self.rows = None
        if layer_type == "linear_attention":
            self.kda = KimiK3KDACacheLayer(conv_width)
            if held:  # (copies: a short step's convolution updates the held window in place, a recompute must not see it)
                self.kda.update(held[0].clone(), held[1].clone())
        elif held:
            self.prefix = held[0]

    def new_state(self) -> tuple[torch.Tensor, ...]:
        """A KDA layer's final ``(recurrent state, conv window)``, an MLA layer's new latent rows ``[B, T, D]``."""
        if self.kda is not None:
            return self.kda.recurrent_state, self.kda.conv_state
        return (self.rows,)

    def kda_layer(self, layer_idx: int) -> KimiK3KDACacheLayer:
        return self.kda

    def update_mla(self, latent_states: torch.Tensor, layer_idx: int) -> KimiK3LatentView:
        self.rows = latent_states
        if self.prefix is None:
            return KimiK3LatentView(latent_states, 0, False, None)
        prefix = self.prefix.to(latent_states.device, latent_states.dtype)
        # (held and step latents apart: the attention joins them only where it attends over the whole)
        return KimiK3LatentView(None, prefix.shape[1], True, None, latent_states, prefix.requires_grad, prefix)


# the tensors `KimiK3CarriedState.new_state` returns, by layer type
CARRIED_OUTPUTS = {"linear_attention": 2, "full_attention": 1}


class KimiK3DecoderLayer(GradientCheckpointingLayer):
    """One K3 layer. Its input is the AttnRes state: the running partial sum ``p`` of the current block and
    the bank of earlier block snapshots. With AttnRes off the bank stays empty and each read returns ``p``,
    which is exactly the classic pre-norm residual stream."""

    def __init__(self, config: KimiK3TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        hidden, eps = config.hidden_size, config.rms_norm_eps
        if self.layer_type == "linear_attention":
            self.self_attn = KimiK3DeltaAttention(config, layer_idx)
        else:
            self.self_attn = KimiK3MLA(config, layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.mlp = KimiK3SparseMoE(config) if self.is_moe else KimiK3MLP(config)
        self.input_layernorm = KimiK3RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = KimiK3RMSNorm(hidden, eps=eps)
        self.self_attention_res = KimiK3BlockAttnRes(config, layer_idx, "attention")
        # (with AttnRes off the FFN side reads the stream as is; the attention side's read stays, for the recorders)
        self.mlp_res = KimiK3BlockAttnRes(config, layer_idx, "mlp") if config.use_attn_res else None

    def forward(self, partial: torch.Tensor, *bank: torch.Tensor, attention_mask=None, past_key_values=None,
                cu_seqlens: torch.LongTensor | None = None, carried: int | None = None,
                **kwargs) -> tuple[torch.Tensor, ...]:
        """``(partial, *bank) -> (partial, *bank)``; the bank is passed positionally so that gradient
        checkpointing sees every tensor. With ``carried`` (under gradient checkpointing with a cache), the last
        ``carried`` positional tensors are the layer's cached state (`KimiK3CarriedState`) and its new state follows
        the bank in the output."""
        if carried is not None:
            bank, held = bank[: len(bank) - carried], bank[len(bank) - carried:]
            past_key_values = KimiK3CarriedState(self.layer_type, held, self.self_attn.conv_size - 1
                                                 if self.layer_type == "linear_attention" else 0)
        x = self.input_layernorm(self.self_attention_res(*bank, partial)[0])
        if self.self_attention_res.starts_block:
            bank, partial = (*bank, partial), None
        if self.layer_type == "linear_attention":
            # packed sequences: KDA state and conv windows restart at every boundary
            kwargs["cu_seqlens"] = cu_seqlens
        attn_out = self.self_attn(x, attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
        if isinstance(attn_out, tuple):
            attn_out = attn_out[0]
        partial = attn_out if partial is None else partial + attn_out
        mix = partial if self.mlp_res is None else self.mlp_res(*bank, partial)[0]
        ffn_in = self.post_attention_layernorm(mix)
        if self.is_moe:  # (the router computes its logits where the model records them)
            partial = partial + self.mlp(ffn_in, kwargs.get("output_router_logits", False))
        else:
            partial = partial + self.mlp(ffn_in)
        if carried is not None:
            return (partial, *bank, *past_key_values.new_state())
        return (partial, *bank)


class KimiK3ModelMixin(KimiK3ReleaseFormatMixin):
    """Mixed into K3's pretrained-model classes (text and multimodal): how the experts implementation is chosen, and
    which generation modes the hybrid cache allows."""

    def __init__(self, config, *args, **kwargs):
        # an assignment checks its own field only: the relations between fields are checked here, before building
        validate = getattr(config, "validate", None)
        if validate is not None:
            validate()
            # the dtype being built in (from_pretrained / from_config set it): a factor must not vanish there
            check_config_for_dtype(config, torch.get_default_dtype())
        super().__init__(config, *args, **kwargs)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers looks for the decorator's text in the model's own file; the multimodal model's file has none.
        return True

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        # Unset -> "k3_grouped_mm", the fastest correct one here (bench/bench_moe.py); an explicit choice is kept.
        return super().get_correct_experts_implementation(
            K3_GROUPED_MM if requested_experts is None else requested_experts
        )

class KimiK3PreTrainedModel(KimiK3ModelMixin, PreTrainedModel):
    config: KimiK3TextConfig
    config_class = KimiK3TextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiK3DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = False
    # the hybrid cache rolls back (crop), so assisted decoding works: transformers 5.23 reads this flag only to refuse it
    _is_stateful = False
    _can_compile_fullgraph = True  # (prefill and decode through the hybrid cache, the CPU kernels in the graph)
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq", r"rotary_emb\.(cos|sin)_cached"]
    # The release keeps these in fp32 (K3_SPEC.md 2.2): the KDA decay parameters, the KDA short convolutions' filters
    # (which the convolution applies in fp32, section 4.2) and the router's selection bias, whose small
    # Quantile-Balancing updates a bf16 copy would round away.
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias", "conv1d", "o_norm", "e_score_correction_bias"]
    _can_record_outputs = {
        "router_logits": OutputRecorder(KimiK3Router, index=0),
        "hidden_states": [
            OutputRecorder(KimiK3BlockAttnRes, index=0, layer_name="self_attention_res",
                           capture_initial_hidden_state=False),
            OutputRecorder(KimiK3BlockAttnRes, index=0, layer_name="output_attn_res",
                           capture_initial_hidden_state=False),
        ],
        "attentions": OutputRecorder(KimiK3MLA, index=1),
        "attn_res_weights": OutputRecorder(KimiK3BlockAttnRes, index=1),
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.get_text_config().initializer_range
        if isinstance(module, KimiK3DeltaAttention):
            # FLA's initialisation: decay rates A in [1, 16], dt in [1e-3, 1e-1] stored as inverse softplus.
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
        elif isinstance(module, KimiK3Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, KimiK3Router):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, KimiK3GatedRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, KimiK3BlockAttnRes) and module.pseudo_query is not None:
            # The paper's init (K3_SPEC.md 3.2): zero pseudo-queries, so every read starts as the mean of its candidates.
            init.ones_(module.key_norm)
            if isinstance(module.pseudo_query, nn.Parameter):
                # (the earlier init's N(0, std) draw, overwritten next: a seeded model keeps its other weights)
                init.normal_(module.pseudo_query, mean=0.0, std=std)
            init.zeros_(module.pseudo_query)

class KimiK3Model(KimiK3PreTrainedModel):
    def __init__(self, config: KimiK3TextConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([KimiK3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.output_attn_res = KimiK3BlockAttnRes(config)
        self.norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        # A plain load_state_dict (Trainer's resume) reads the release layout save_pretrained writes.
        from .conversion.hf_mapping import release_layout_pre_hook

        self.register_load_state_dict_pre_hook(release_layout_pre_hook)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @merge_with_config_defaults
    @capture_outputs
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: KimiK3HybridCache | None = None,
                inputs_embeds: torch.FloatTensor | None = None, use_cache: bool | None = None,
                cache: KimiK3HybridCache | None = None, **kwargs) -> KimiK3ModelOutputWithPast:
        past_key_values = either_cache(cache, past_key_values)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
        prepared = None
        if isinstance(attention_mask, dict):
            # generate() with a static cache prepares the masks per layer kind (transformers'
            # create_masks_for_generate): MLA's 4-D mask over the cache, KDA's 2-D padding mask over this step
            prepared, attention_mask = attention_mask, attention_mask.get("linear_attention")
        if inputs_embeds is not None and (inputs_embeds.dim() != 3 or 0 in inputs_embeds.shape[:2]):
            raise KimiK3InputError(f"inputs_embeds must be [batch, tokens, hidden] with at least one row and token, "
                                   f"got shape {tuple(inputs_embeds.shape)}")
        # The cache's one entry point (the multimodal model makes it for its text model): it checks it fits this
        # model, records the step's ids (its ids behind the multimodal model's inputs_embeds) and says what it held.
        step = kwargs.pop("cache_step", None)
        if step is None:
            step = (past_key_values.begin_step(self.config, input_ids, inputs_embeds, attention_mask, model=self)
                    if isinstance(past_key_values, KimiK3HybridCache) else NO_CACHE_STEP)
        # generate() feeds its decode steps its own tokens under a checked mask; off the CPU a cached step's ids are
        # left to the embedding's device-side bounds check: the value checks left are read in one host sync
        if not step.checked:
            id_problem = (_input_ids_problem(input_ids, self.embed_tokens.num_embeddings,
                                             range_check=not step.continuing or _host_reads_are_free(input_ids))
                          if inputs_embeds is None else None)
            batch, tokens = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
            packed = batch == 1 and past_key_values is None and attention_mask is None
            _raise_problems([
                id_problem,
                *_mask_problems(attention_mask, batch, tokens),
                _padding_problem(attention_mask) if attention_mask is not None and attention_mask.dim() == 2 else None,
                *_position_problems(position_ids, kwargs.get("cu_seq_lens_q"), tokens, packed),
                *(_packed_from_cache_problems(position_ids, kwargs, tokens)
                  if past_key_values is not None and attention_mask is None else ()),
                *(_packed_rows_problems(position_ids, kwargs, batch, tokens)
                  if batch > 1 and past_key_values is None and attention_mask is None else ()),
            ])
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        cu_seqlens = packed_sequence_boundaries(position_ids, kwargs.get("cu_seq_lens_q"), attention_mask,
                                                past_key_values, inputs_embeds.shape[0])
        if use_cache and past_key_values is None and cu_seqlens is None:  # a packed row cannot be continued
            past_key_values = KimiK3HybridCache(self.config)
            step = past_key_values.begin_step(self.config, input_ids, inputs_embeds, attention_mask, model=self)
        if past_key_values is not None and not isinstance(past_key_values, KimiK3HybridCache):
            raise TypeError(
                f"Kimi K3 keeps KDA states and MLA latents in a `KimiK3HybridCache`, got {type(past_key_values).__name__}. "
                "Pass `past_key_values=KimiK3HybridCache(model.config)` or let the model create one (`use_cache=True`)."
            )
        if position_ids is None and prepared is None:
            # (a static cache gives its offset as a tensor: no length is read inside a compiled step)
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + step.offset
            position_ids = position_ids.unsqueeze(0)

        # The text model is position-free (NoPE MLA, no RoPE in KDA): positions only shape the MLA mask.
        if prepared is not None:
            mla_mask = prepared.get("full_attention")
        elif (cu_seqlens is None and inputs_embeds.shape[1] > 1 and step.continuing
                and not kwargs.get("output_attentions")
                and uses_blockwise_attention(self.config)
                and (attention_mask is None or (attention_mask.dim() == 2 and bool(attention_mask.all())))):
            mla_mask = None  # a chunk after cached tokens: MLA masks causally itself, no [T, context] mask
        else:
            mla_mask = create_causal_mask(
                config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                position_ids=position_ids, **{MASK_CACHE_KWARG: past_key_values},
            )
        # (a mask of ones is applied as is: multiplying by one is exact, and finding it all ones would take a sync)
        kda_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None

        # the MoE layers compute router logits where transformers records them (capture_outputs reads the same)
        kwargs["output_router_logits"] = kwargs.get("output_router_logits", self.config.output_router_logits)
        state = (inputs_embeds,)  # (partial sum, *bank)
        for layer in self.layers:
            mask = kda_mask if layer.layer_type == "linear_attention" else mla_mask
            if past_key_values is not None and layer.gradient_checkpointing and layer.training:
                # a checkpointed layer is recomputed in the backward: its cached state goes in and out as tensors
                held = past_key_values.layer_state(layer.layer_idx)
                out = layer(*state, *held, attention_mask=mask, cu_seqlens=cu_seqlens, carried=len(held), **kwargs)
                count = CARRIED_OUTPUTS[layer.layer_type]
                past_key_values.hold_layer_state(layer.layer_idx, out[-count:])
                state = out[:-count]
                continue
            state = layer(*state, attention_mask=mask, past_key_values=past_key_values, cu_seqlens=cu_seqlens, **kwargs)

        partial, *bank = state
        mix = self.output_attn_res(*bank, partial)[0]
        return KimiK3ModelOutputWithPast(last_hidden_state=self.norm(mix), **{OUTPUT_CACHE_FIELD: past_key_values})


class KimiK3ForCausalLM(KimiK3PreTrainedModel, KimiK3GenerationMixin, GenerationMixin):
    """K3 text decoder with the LM head. Accepts the text config or, for text-only use of a full K3
    checkpoint, the composite `KimiK3Config` (its ``text_config`` is used)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: KimiK3TextConfig | KimiK3Config):
        if isinstance(config, KimiK3Config):
            config = config.get_text_config()
        super().__init__(config)
        self.model = KimiK3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        # Text-only use of a multimodal checkpoint (e.g. AutoModelForCausalLM on the composite config): its vision
        # weights are not ours to load (the registered conversion mapping drops the text weights' `language_model.`
        # prefix). Only runs when this class is the root model, never inside the multimodal one.
        super()._adjust_missing_and_unexpected_keys(loading_info)
        loading_info.unexpected_keys = {
            key for key in loading_info.unexpected_keys if not key.startswith(("vision_tower.", "mm_projector."))
        }

    @staticmethod
    def _aux_share(labels: torch.Tensor, kwargs: dict) -> torch.Tensor | float:
        """This call's share of the auxiliary balance loss. With ``num_items_in_batch`` (transformers' Trainer under
        gradient accumulation, and across ranks when it averages tokens over devices) the LM loss is this
        micro-batch's summed token losses over the whole batch's count, and the Trainer no longer divides by the
        accumulation steps; the aux loss, a mean over this micro-batch, takes the same share (its target tokens over
        that count), so the accumulated total is the token-weighted mean of the micro-batches' aux losses instead
        of their sum (it was multiplied by the accumulation steps). Otherwise 1."""
        num_items = kwargs.get("num_items_in_batch")
        if num_items is None:
            return 1.0
        shifted = kwargs.get("shift_labels")
        if shifted is None:
            shifted = labels[..., 1:]
        return (shifted != -100).sum() / num_items

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: KimiK3HybridCache | None = None,
                inputs_embeds: torch.FloatTensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                cache: KimiK3HybridCache | None = None, **kwargs) -> KimiK3CausalLMOutputWithPast:
        aux_coef = self.config.router_aux_loss_coef  # optional balance loss (off by default; K3 uses the bias)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=either_cache(cache, past_key_values), inputs_embeds=inputs_embeds, use_cache=use_cache,
            **({"output_router_logits": True, **kwargs} if aux_coef else kwargs),
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        if self.config.logit_scale != 1.0:
            logits = logits * self.config.logit_scale
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        aux_loss = None
        if aux_coef and outputs.router_logits:
            aux_loss = router_aux_loss(
                outputs.router_logits, [m for m in self.model.modules() if isinstance(m, KimiK3Router)],
                batch_size=outputs.last_hidden_state.shape[0],
                attention_mask=attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None,
            )
            if loss is not None:
                loss = loss + aux_coef * self._aux_share(labels, kwargs) * aux_loss.to(loss.device)
        return KimiK3CausalLMOutputWithPast(
            loss=loss, aux_loss=aux_loss, logits=logits, **{OUTPUT_CACHE_FIELD: output_cache(outputs)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions, router_logits=outputs.router_logits,
            attn_res_weights=outputs.attn_res_weights,
        )


__all__ = ["KimiK3PreTrainedModel", "KimiK3Model", "KimiK3ForCausalLM", "KimiK3DecoderLayer"]
