"""Softmax attention over MLA latents in blocks, merged by log-sum-exp, and under autograd inside compiled graphs as
one opaque operator.

The per-block pieces (`attention_with_lse`, `LSE_KERNELS`, `LSE_BACKWARDS`, `merge_attention_blocks`): a block of
keys attended by a fused kernel that returns its log-sum-exp where the device has one (`plain_attention_with_lse`
elsewhere), and the blocks merged as they come. `KimiK3MLA` (modeling_kimi_k3.py) attends a chunk after a cache with
them.

``transformers_k3::mla_context_attention`` is the softmax attention of a step's queries over the step's own latents
(causally) and the context's latents, each block of latents expanded to keys and values through ``kv_b_proj``'s
weight inside the call; ``transformers_k3::mla_context_attention_backward`` is its gradient. Both go through the
latents one block at a time: the forward attends each block (a fused kernel where the device has one) and merges
them; the backward expands each block again and runs its kernel backward with the merged output and log-sum-exp (as
ring attention does; flash attention's backward in plain PyTorch on a device without one), then adds the expansion's
part of every gradient before the next block. Only the latents, the queries, the weight, the output and its
log-sum-exp are kept between the two.

Why an operator: traced plainly (`checkpointed_block_attention` in the modeling file), inductor's generated backward
computes every block's recomputed logits before it consumes any, so a compiled step's memory grows with the context
(bench/RESULTS.md). A graph holds this call as one node and its backward as another, so a block's buffers are freed
before the next block starts, whatever the backend. The expansion is a plain linear map of the weight (an adapter or a
quantized layer on ``kv_b_proj`` computes something else: those take the traced path).

Shapes: ``query [B, n, T, dn + dr]``; ``step [B, T, r + dr]`` and ``context [B, S, r + dr]`` (``[c_kv | k_pe]`` per
token, the cache's layout); ``weight [n (dn + dv), r]``; output ``[B, n, T, dv]`` in the query's dtype and its
log-sum-exp ``[B, n, T]`` (fp32; not differentiable: the layer reads only the output).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .linear import PLAIN_LINEARS, blocks, end_aligned_causal


def _cuda_efficient_attention(query, key, value, causal: bool, scale: float,
                              kernel=torch.ops.aten._scaled_dot_product_efficient_attention):
    out, lse = kernel(query, key, value, None, True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., : query.shape[-2]].float()  # (its log-sum-exp rows come padded to a multiple of 32)


def _cpu_flash_attention(query, key, value, causal: bool, scale: float):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, causal, scale=scale)[:2]
    return out, lse.float()


def fp32_products(device: torch.device):
    """A context in which products of fp32 operands stay fp32 under autocast too (a bf16 product of attention's
    logits would round them before the softmax)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()  # (a device without autocast: none to turn off)


def attention_logits(query: torch.Tensor, key: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """fp32 logits ``[B, n, T, S]`` of ``query [B, n, T, d]`` over ``key [B, n, S, d]`` (under `fp32_products`);
    ``causal``: the queries over their own keys (``S == T``), -inf above the diagonal."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~end_aligned_causal(*scores.shape[-2:], scores.device), float("-inf"))
    return scores


def plain_attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_with_lse` on a device without a fused kernel: from `attention_logits`, one ``[T, S]`` block."""
    with fp32_products(query.device):
        scores = attention_logits(query, key, causal, scale)
        lse = scores.logsumexp(-1)
        return torch.matmul((scores - lse.unsqueeze(-1)).exp(), value.float()).to(query.dtype), lse


# the fused kernels that return their log-sum-exp, by device type (CUDA's memory-efficient one takes fp32 too)
LSE_KERNELS = {"cuda": _cuda_efficient_attention, "cpu": _cpu_flash_attention}


def attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``[B, n, T, d]`` and its log-sum-exp ``[B, n, T]`` (fp32) from a fused kernel
    (`LSE_KERNELS`), elsewhere `plain_attention_with_lse`. ``causal`` aligns the diagonal top-left (used for ``T``
    queries over their own keys)."""
    return LSE_KERNELS.get(query.device.type, plain_attention_with_lse)(query, key, value, causal, scale)


def _cpu_flash_attention_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, lse.to(query.dtype) if query.dtype == torch.float64 else lse, 0.0, causal,
        scale=scale)


# the fused kernels' backwards, by device type: given the merged output and log-sum-exp, each block's part
LSE_BACKWARDS = {"cpu": _cpu_flash_attention_backward}


def merge_attention_blocks(parts: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax attention ``[B, n, T, d]`` (fp32) and its log-sum-exp from those over disjoint key blocks, merged
    as they come (an iterator of blocks keeps one block's result alive at a time, whatever the context's length)."""
    parts = iter(parts)
    out, lse = next(parts)
    out = out.float()
    for block_out, block_lse in parts:
        merged = torch.logaddexp(lse, block_lse)
        out = out * (lse - merged).exp().unsqueeze(-1) + block_out.float() * (block_lse - merged).exp().unsqueeze(-1)
        lse = merged
    return out, lse


def operator_expands(kv_b_proj: nn.Module) -> bool:
    """Whether `mla_context_attention` computes what calling ``kv_b_proj`` computes from its weight: a plain linear
    layer (not an adapter or a quantized layer) whose weight is a plain tensor (a sharded DTensor has no rule here)."""
    return type(kv_b_proj) in PLAIN_LINEARS and type(kv_b_proj.weight) in (torch.Tensor, nn.Parameter)


def expand_latent(latent: torch.Tensor, rank: int, heads: int, nope: int, project: Callable):
    """Per-head keys ``[B, n, S, dn + dr]`` and values ``[B, n, S, dv]`` of MLA latents ``[B, S, r + dr]`` (``[c_kv |
    k_pe]``): ``project`` (``kv_b_proj``) maps ``c_kv`` to each head's key part and value, ``k_pe`` is every head's."""
    batch, seq, _ = latent.shape
    c_kv, k_pe = latent.split([rank, latent.shape[-1] - rank], dim=-1)
    kv = project(c_kv).view(batch, seq, heads, -1)
    k_nope, value = kv.transpose(1, 2).split([nope, kv.shape[-1] - nope], dim=-1)
    k_pe = k_pe[:, None].expand(batch, heads, seq, k_pe.shape[-1])
    return torch.cat([k_nope, k_pe], dim=-1), value


def _expand(latent: torch.Tensor, weight: torch.Tensor, heads: int, nope: int, dtype: torch.dtype):
    """`expand_latent` through ``weight`` (in its dtype as given: the caller passes it in the dtype autocast would
    cast it to), the keys and values in ``dtype``."""
    def project(c_kv: torch.Tensor) -> torch.Tensor:
        return F.linear(c_kv.to(weight.dtype), weight)

    key, value = expand_latent(latent, weight.shape[1], heads, nope, project)
    return key.to(dtype), value.to(dtype)


def latent_blocks(step: torch.Tensor, context: torch.Tensor, block: int):
    """``(latents, causal)``: the step's own, then the context's blocks of ``block`` tokens."""
    yield step, True
    for start, end in blocks(context.shape[1], block):
        yield context[:, start:end], False


def attend_blocks(query: torch.Tensor, expand: Callable, scale: float, pad: int, step: torch.Tensor,
                  context: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``[B, n, T, dv + pad]`` (fp32, the last ``pad`` columns zero) and its log-sum-exp of
    ``query`` over `latent_blocks`, each expanded to keys and values by ``expand`` and attended by
    `attention_with_lse` (values padded by ``pad`` columns for the fused kernels), merged as they come."""

    def attend(latent: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        key, value = expand(latent)
        return attention_with_lse(query, key, F.pad(value, (0, pad)) if pad else value, causal, scale)

    return merge_attention_blocks(itertools.starmap(attend, latent_blocks(step, context, block)))


def plain_attention_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float):
    """``(dq, dk, dv)`` of one block of keys given the merged output and log-sum-exp: flash attention's backward in
    plain PyTorch (fp32 logits), for a device with no fused one."""
    wide = torch.promote_types(query.dtype, torch.float32)
    query, key, value, grad_out = (x.to(wide) for x in (query, key, value, grad_out))
    probs = (attention_logits(query, key, causal, scale) - lse.to(wide).unsqueeze(-1)).exp()
    delta = (grad_out * out.to(wide)).sum(-1, keepdim=True)  # (rowsum(dO * O): the softmax's Jacobian term)
    d_scores = probs * (torch.matmul(grad_out, value.transpose(-1, -2)) - delta) * scale
    return (torch.matmul(d_scores, key), torch.matmul(d_scores.transpose(-1, -2), query),
            torch.matmul(probs.transpose(-1, -2), grad_out))  # fmt: skip


@torch.library.custom_op("transformers_k3::mla_context_attention", mutates_args=())
def mla_context_attention(query: torch.Tensor, step: torch.Tensor, context: torch.Tensor, weight: torch.Tensor,
                          scale: float, block: int, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, n, T, dv], lse [B, n, T])``: see the module's docstring."""
    heads, value_dim = query.shape[1], weight.shape[0] // query.shape[1] - nope
    pad = max(query.shape[-1] - value_dim, 0)  # (the fused kernels want v's head dim == q/k's)

    def expand(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _expand(latent, weight, heads, nope, query.dtype)

    with fp32_products(query.device):
        out, lse = attend_blocks(query, expand, scale, pad, step, context, block)
    return out[..., :value_dim].to(query.dtype).contiguous(), lse.contiguous()


@mla_context_attention.register_fake
def _(query, step, context, weight, scale, block, nope):
    value_dim = weight.shape[0] // query.shape[1] - nope
    return query.new_empty(*query.shape[:3], value_dim), query.new_empty(query.shape[:3], dtype=torch.float32)


@torch.library.custom_op("transformers_k3::mla_context_attention_backward", mutates_args=())
def mla_context_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, step: torch.Tensor,
                                   context: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                   scale: float, block: int, nope: int,
                                   mask: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `mla_context_attention`'s output with respect to ``query, step, context, weight`` for the
    cotangent ``grad_out``; ``mask`` says which are wanted (the others come back empty)."""
    heads, value_dim = query.shape[1], out.shape[-1]
    pad = max(query.shape[-1] - value_dim, 0)
    backward = LSE_BACKWARDS.get(query.device.type, plain_attention_backward)
    grad_out, out = (F.pad(x, (0, pad)) if pad else x for x in (grad_out.to(query.dtype), out))
    wide = torch.promote_types(weight.dtype, torch.float32)
    d_query = torch.zeros(query.shape, dtype=wide, device=query.device)
    d_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device)
    d_step = None
    d_context = torch.zeros(context.shape, dtype=wide, device=context.device) if mask[2] else None
    with fp32_products(query.device):
        for index, (latent, causal) in enumerate(latent_blocks(step, context, block)):
            key, value = _expand(latent, weight, heads, nope, query.dtype)
            c_kv = latent[..., : weight.shape[1]].to(weight.dtype)  # (as the expansion took it)
            value = F.pad(value, (0, pad)) if pad else value
            dq, d_key, d_value = backward(grad_out.contiguous(), query, key, value, out, lse, causal, scale)
            d_query += dq
            # the expansion's part: kv = c_kv W^T per token, k_pe shared by every head
            d_kv = torch.cat([d_key[..., :nope], d_value[..., :value_dim]], dim=-1).transpose(1, 2).flatten(2).to(wide)
            if mask[3]:
                d_weight += torch.matmul(d_kv.flatten(0, 1).transpose(0, 1), c_kv.flatten(0, 1).to(wide))
            if mask[1 if causal else 2]:
                d_latent = torch.cat([torch.matmul(d_kv, weight.to(wide)), d_key[..., nope:].to(wide).sum(1)], dim=-1)
                if causal:
                    d_step = d_latent
                else:  # (written block by block: no list of the context's gradients to join)
                    start = (index - 1) * block
                    d_context[:, start: start + latent.shape[1]] = d_latent
    empty = query.new_empty(0)
    return (d_query.to(query.dtype) if mask[0] else empty, d_step.to(step.dtype).contiguous() if mask[1] else empty,
            d_context.to(context.dtype) if mask[2] else empty, d_weight.to(weight.dtype) if mask[3] else empty)


@mla_context_attention_backward.register_fake
def _(grad_out, query, step, context, weight, out, lse, scale, block, nope, mask):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) if m else query.new_empty(0)
                 for x, m in zip((query, step, context, weight), mask))  # fmt: skip


def _setup(ctx, inputs, output):
    query, step, context, weight, ctx.scale, ctx.block, ctx.nope = inputs
    ctx.save_for_backward(query, step, context, weight, *output)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse):
    mask = list(ctx.needs_input_grad[:4])
    if grad_out is None or not any(mask):
        return None, None, None, None, None, None, None
    grads = torch.ops.transformers_k3.mla_context_attention_backward.default(
        grad_out.contiguous(), *ctx.saved_tensors, ctx.scale, ctx.block, ctx.nope, mask)
    return (*(g if m else None for g, m in zip(grads, mask)), None, None, None)


mla_context_attention.register_autograd(_backward, setup_context=_setup)
