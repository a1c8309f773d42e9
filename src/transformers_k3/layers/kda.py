"""The Kimi Delta Attention layer, K3 variant (K3_SPEC.md section 4).

Projections, three depthwise causal short convolutions, the per-channel forget gate, beta, the delta-rule
recurrence and the gated per-head output norm. The recurrence is `transformers_k3.ops.kda` on CPU tensors (the fused
CPU operator or the PyTorch algorithm) and, on CUDA tensors, fla's Triton kernels through transformers'
`use_kernel_func_from_hub_with_fallback` (our PyTorch path when fla is not installed). The state is the cache's:
the layer gets its views (`KimiK3KDACacheLayer.prepare`) and hands it what it computed (`update`).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from transformers.integrations.accelerate import force_accelerate_hooks
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

from ..ops.conv import causal_conv1d, causal_conv1d_update
from ..ops.kda import RECURRENT_MAX_TOKENS, chunk_kda, fused_recurrent_kda, kda_gate
from .norm import KimiK3GatedRMSNorm

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


def _delta_rule_kernels(device: torch.device):
    """fla's Triton kernels run on CUDA only: other devices always take ours."""
    return _cuda_kernels() if device.type == "cuda" else (chunk_kda, fused_recurrent_kda)


# layer -> (its filters' versions, weak references to them, their concatenation) for decode steps; outside the
# modules so that pickling or copying a model never carries it
_KEPT_CONV_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
        # fp32 filters, as the release stores them and the convolution applies them (K3_SPEC.md 2.2, 4.2), also in
        # a model built in bf16 (`_keep_in_fp32_modules_strict` keeps them fp32 when loading)
        conv = dict(groups=proj, bias=False, dtype=torch.float32)
        self.q_conv1d = nn.Conv1d(proj, proj, self.conv_size, **conv)
        self.k_conv1d = nn.Conv1d(proj, proj, self.conv_size, **conv)
        self.v_conv1d = nn.Conv1d(proj, proj, self.conv_size, **conv)
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

    def _decode_conv_weight(self, convs) -> torch.Tensor:
        """The three filters as one ``[3P, K]`` weight. Without autograd it is kept between decode steps, remade when
        a filter is replaced, moved or cast (``.to``, ``.cuda``, ``.half``: new storage) or changed in place (its
        version counter: optimizer steps, ``load_state_dict``, ``copy_``; a write through ``.data`` bypasses it, so
        such code must replace the parameter instead)."""
        weights = [conv.weight for conv in convs]
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(w.requires_grad for w in weights)):
            return torch.cat([w.squeeze(1) for w in weights])
        try:
            # (the old storage is kept alive with the result, so a cast's new storage never reuses its address)
            key = tuple((w._version, w.dtype, w.device, w.data_ptr()) for w in weights)
        except RuntimeError:  # inference tensors keep no version counter: nothing tells a change, so no keeping
            return torch.cat([w.squeeze(1) for w in weights])
        kept = _KEPT_CONV_WEIGHTS.get(self)
        if kept is None or kept[0] != key or any(ref() is not w for ref, w in zip(kept[1], weights)):
            # (weak references: a new parameter at a freed one's address is still a new parameter)
            kept = (key, [weakref.ref(w) for w in weights], torch.cat([w.detach().squeeze(1) for w in weights]),
                    [w.detach() for w in weights])
            _KEPT_CONV_WEIGHTS[self] = kept
        return kept[2]

    def _short_convs(self, projections, window, cached: bool, cu_seqlens):
        """q, k, v after their causal convolutions and SiLU, and the new conv window for the cache (None: no cache,
        or the held `window` [B, 3P, K-1], q's channels then k's then v's, was updated in place)."""
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        if window is not None and projections[0].shape[1] <= RECURRENT_MAX_LEN:
            # decode: one step update over all three projections (each channel is its own convolution)
            mixed = causal_conv1d_update(torch.cat(projections, dim=-1), window, self._decode_conv_weight(convs),
                                         activation="silu")
            return mixed.split(self.proj_dim, dim=-1), None
        if window is not None:  # a longer continuation: the three convolutions as one, from the held window
            mixed, final = causal_conv1d(torch.cat(projections, dim=-1), self._decode_conv_weight(convs),
                                         activation="silu", initial_state=window, output_final_state=True,
                                         cu_seqlens=cu_seqlens)
            return mixed.split(self.proj_dim, dim=-1), final
        outputs, finals = [], []
        for z, conv in zip(projections, convs):
            y, final = causal_conv1d(z, conv.weight.squeeze(1), activation="silu", output_final_state=cached,
                                     cu_seqlens=cu_seqlens)
            outputs.append(y)
            finals.append(final)
        return outputs, torch.cat(finals, dim=1) if cached else None

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
        outputs = []
        if head > 0:
            out, state = chunk_kda(q[:, :head], k[:, :head], v[:, :head], g[:, :head], beta[:, :head],
                                   initial_state=state, output_final_state=True, **common, **self._chunk_options())
            outputs.append(out)
        out, _, states = fused_recurrent_kda(q[:, head:], k[:, head:], v[:, head:], g[:, head:], beta[:, head:],
                                             initial_state=state, output_state_history=True, **common)
        outputs.append(out)
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else out, states

    # (the conv ops read the filters without calling their modules: accelerate's offload hooks are fired here)
    @force_accelerate_hooks(["q_conv1d", "k_conv1d", "v_conv1d"])
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

        projections = tuple(proj(hidden_states) for proj in (self.q_proj, self.k_proj, self.v_proj))
        raw_inputs = torch.cat(projections, dim=-1).transpose(1, 2) if recorded else None
        convolved, new_window = self._short_convs(projections, window, cache_layer is not None, cu_seqlens)
        q, k, v = (t.view(batch, seq_len, self.num_heads, self.head_dim) for t in convolved)
        f = self.f_b_proj(self.f_a_proj(hidden_states))
        g = kda_gate(f.unflatten(-1, (self.num_heads, self.head_dim)), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(hidden_states).float())

        states = None
        if recorded:
            core, states = self._recorded_delta_rule(q, k, v, g, beta, state, recorded)
            final_state = states[-1]
        else:
            chunked, recurrent = _delta_rule_kernels(q.device)
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
            new_window = None if new_window is None else new_window.to(projections[0].dtype)
            cache_layer.update(final_state, new_window, raw_inputs, states)

        gate = self._output_gate(hidden_states).view(batch, seq_len, self.num_heads, self.head_dim)
        out = self.o_norm(core, gate).reshape(batch, seq_len, self.proj_dim)
        return self.o_proj(out.to(hidden_states.dtype))


__all__ = ["KimiK3DeltaAttention"]
