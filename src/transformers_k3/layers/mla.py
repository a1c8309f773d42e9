"""Gated multi-head latent attention with no positional encoding (K3_SPEC.md section 5).

Keys and values come from a shared latent ``c_kv`` (``kv_lora_rank`` wide, RMS-normed) plus one shared
``k_pe`` per token, which in K3 is never rotated. The cache keeps just these ``kv_lora_rank + rope``
numbers per token. Prefill expands the latent through ``kv_b_proj`` and uses the configured attention
kernel; decode steps with a cache attend in latent space instead ("weight absorption"), so a step costs
O(context x latent) and never materialises per-head K/V for the whole context.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.accelerate import force_accelerate_hooks
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..ops.linear import PLAIN_LINEARS, blocks, end_aligned_causal, latent_attention
from .norm import KimiK3RMSNorm

# Above this many new tokens (with a cache), expanding K/V for an SDPA kernel beats the absorbed loop.
ABSORB_MAX_QUERY_LEN = 16
# A multi-token step on top of a cache (chunked prefill) attends to the cached context this many tokens at a time;
# see `KimiK3MLA._blockwise_attention`.
CONTEXT_BLOCK = 16384


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


def uses_blockwise_attention(config, hidden_states: torch.Tensor) -> bool:
    """Whether a multi-token step after cached tokens takes `KimiK3MLA._blockwise_attention` (SDPA, on CPU or CUDA:
    the devices with a fused kernel that returns its log-sum-exp); the model then builds no ``[T, context]`` mask."""
    return config._attn_implementation == "sdpa" and hidden_states.device.type in LSE_KERNELS and not (
        hidden_states.requires_grad and torch.is_grad_enabled())


def _cuda_efficient_attention(query, key, value, causal: bool, scale: float):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., : query.shape[-2]].float()  # (its log-sum-exp rows come padded to a multiple of 32)


def _cpu_flash_attention(query, key, value, causal: bool, scale: float):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, causal, scale=scale)[:2]
    return out, lse.float()


# the fused kernels that return their log-sum-exp, by device type (CUDA's memory-efficient one takes fp32 too)
LSE_KERNELS = {"cuda": _cuda_efficient_attention, "cpu": _cpu_flash_attention}


def attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``[B, n, T, d]`` and its log-sum-exp ``[B, n, T]`` (fp32) from a fused kernel
    (`LSE_KERNELS`). ``causal`` aligns the diagonal top-left (used for ``T`` queries over their own keys)."""
    return LSE_KERNELS[query.device.type](query, key, value, causal, scale)


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
        batch, seq, _ = latent.shape
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c_kv)
        kv = kv.view(batch, seq, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, value = kv.transpose(1, 2).split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = k_pe[:, None].expand(batch, self.num_heads, seq, self.qk_rope_head_dim)
        return torch.cat([k_nope, k_pe], dim=-1), value

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
        # logits stay fp32: a bf16 matmul would round each to 8 bits (~0.03 at a logit of 10) before the softmax, a
        # decode step ~3x less accurate than the prefill's attention (SGLang's K3 decode kernels keep them in fp32).
        o_latent = latent_attention(latent, q_cat, self.scaling, self.kv_lora_rank, q_len, CONTEXT_BLOCK,
                                    attention_mask)  # [B, n*T, r]
        out = torch.matmul(o_latent.reshape(batch, heads, q_len, -1), w_vc.transpose(1, 2))  # [B, n, T, dv]
        return out.transpose(1, 2)

    def _blockwise_attention(self, query: torch.Tensor, latent: torch.Tensor, past_len: int) -> torch.Tensor:
        """Causal attention of ``T`` new queries to ``past_len`` cached tokens plus themselves, with memory bounded
        by the step, not the context. Returns ``[B, T, n, dv]``.

        The new tokens attend to each other with a causal kernel; the cached context is expanded through
        ``kv_b_proj`` `CONTEXT_BLOCK` tokens at a time and attended without a mask; the partial results are merged
        by their log-sum-exp (as flash-decoding does). Neither a ``[T, context]`` mask nor K/V for the whole context
        ever exists, which is what makes a million-token chunked prefill fit in a few GB. Needs a kernel's
        log-sum-exp output (`attention_with_lse`: CPU and CUDA tensors)."""
        pad = self.qk_head_dim - self.v_head_dim

        def attend(block: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
            key, value = self._expand(block)
            if pad > 0:  # the fused kernel wants v's head dim == q/k's (as the prefill path above)
                value = F.pad(value, (0, pad))
            out, lse = attention_with_lse(query, key, value, causal, self.scaling)
            return out[..., : self.v_head_dim].float(), lse  # [B, n, T, dv], [B, n, T]

        out, lse = attend(latent[:, past_len:], causal=True)
        for start, end in blocks(past_len, CONTEXT_BLOCK):  # (a graph guards on their count, not the length)
            block_out, block_lse = attend(latent[:, start:end], causal=False)
            merged = torch.logaddexp(lse, block_lse)
            out = out * (lse - merged).exp().unsqueeze(-1) + block_out * (block_lse - merged).exp().unsqueeze(-1)
            lse = merged
        return out.to(query.dtype).transpose(1, 2)

    # (absorbed decode reads `kv_b_proj.weight` without calling it: accelerate's offload hooks are fired here)
    @force_accelerate_hooks("kv_b_proj")
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, absorb: bool | None = None, **kwargs):
        batch, q_len, _ = hidden_states.shape
        query = self._queries(hidden_states)
        latent = self._latent(hidden_states)
        past_len, has_past, static = 0, False, None
        if past_key_values is not None:
            static = past_key_values.static_position(self.layer_idx)
            has_past = past_key_values.holds_tokens(self.layer_idx)
            # (a compiled decode step of a static cache reads no length: the absorbed path masks by `position`)
            past_len = past_key_values.get_seq_length(self.layer_idx) if static is None else 0
            latent = past_key_values.update_latent(latent, self.layer_idx)

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
        elif static is not None and not absorb:  # the rows past a static latent's tokens are cut (eager steps)
            past_len = past_key_values.get_seq_length(self.layer_idx) - q_len
            latent = latent[:, : past_len + q_len]
            if attention_mask is not None and attention_mask.dim() == 4:
                attention_mask = attention_mask[..., : past_len + q_len]
        if absorb:
            slots = None if static is None else static_slots_mask(static, q_len, latent.shape[1])
            attn_output = self._absorbed_attention(query, latent, attention_mask, slots)
        elif attention_mask is None and past_len > 0 and q_len > 1 and uses_blockwise_attention(self.config,
                                                                                              hidden_states):
            # The model passes no mask here only when every row is unpadded: causal over past + step.
            attn_output = self._blockwise_attention(query, latent, past_len)
        else:
            key, value = self._expand(latent)
            interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
            if attention_mask is None and past_len > 0 and q_len > 1 and not flash:
                # No mask because the model expected the blockwise path (decided on another device than this
                # layer's): SDPA's is_causal would align the diagonal top-left, not to the cached context's end.
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


__all__ = ["KimiK3MLA", "attention_with_lse", "eager_attention_forward", "uses_blockwise_attention"]
