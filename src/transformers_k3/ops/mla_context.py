"""MLA's attention over a cached context under autograd as one opaque operator, for compiled graphs.

``transformers_k3::mla_context_attention`` is the softmax attention of a step's queries over the step's own latents
(causally) and the context's latents, each block of latents expanded to keys and values through ``kv_b_proj``'s
weight inside the call; ``transformers_k3::mla_context_attention_backward`` is its gradient. Both go through the
latents one block at a time in plain PyTorch (fp32 logits, or the inputs' dtype where wider): the forward merges the
blocks by log-sum-exp, the backward recomputes each block's keys, values and weights from the merged log-sum-exp
(flash attention's backward) and adds its part of every gradient before the next block. Only the latents, the
queries, the weight, the output and its log-sum-exp are kept between the two.

Why an operator: traced plainly (`checkpointed_block_attention` in the modeling file), inductor's generated backward
computes every block's recomputed logits before it consumes any, so a compiled step's memory grows with the context
(bench/RESULTS.md). A graph holds this call as one node and its backward as another, so a block's buffers are freed
before the next block starts, whatever the backend. The expansion is a plain linear map of the weight (an adapter or a
quantized layer on ``kv_b_proj`` computes something else: those take the traced path).

Shapes: ``query [B, n, T, dn + dr]``; ``step [B, T, r + dr]`` and ``context [B, S, r + dr]`` (``[c_kv | k_pe]`` per
token, the cache's layout); ``weight [n (dn + dv), r]``; output ``[B, n, T, dv]`` in the query's dtype and its
log-sum-exp ``[B, n, T]`` (fp32, float64 for float64; not differentiable: the layer reads only the output).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .linear import blocks


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # (fp32 logits; a float64 check stays float64)


def _expand(latent: torch.Tensor, weight: torch.Tensor, heads: int, nope: int):
    """``(c_kv, keys [B, n, S, dn + dr], values [B, n, S, dv])`` of a latent block: the product in the weight's dtype
    as given (the caller passes it in the dtype autocast would cast it to), the rest wider."""
    rank = weight.shape[1]
    c_kv, k_pe = latent.split([rank, latent.shape[-1] - rank], dim=-1)
    c_kv = c_kv.to(weight.dtype)
    kv = F.linear(c_kv, weight).view(*latent.shape[:2], heads, -1).transpose(1, 2)
    wide = _compute_dtype(kv.dtype)
    k_nope, value = kv.to(wide).split([nope, kv.shape[-1] - nope], dim=-1)
    key = torch.cat([k_nope, k_pe.to(wide)[:, None].expand(-1, heads, -1, -1)], dim=-1)
    return c_kv, key, value


def _logits(query: torch.Tensor, key: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if causal:  # (the step over its own keys: square, top-left aligned)
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _parts(step: torch.Tensor, context: torch.Tensor, block: int):
    yield step, True
    for start, end in blocks(context.shape[1], block):
        yield context[:, start:end], False


def _no_autocast(device: torch.device):
    # (an operator's implementation sees the caller's autocast: its products must stay in the dtypes chosen here)
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


@torch.library.custom_op("transformers_k3::mla_context_attention", mutates_args=())
def mla_context_attention(query: torch.Tensor, step: torch.Tensor, context: torch.Tensor, weight: torch.Tensor,
                          scale: float, block: int, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, n, T, dv], lse [B, n, T])``: see the module's docstring."""
    heads = query.shape[1]
    with _no_autocast(query.device):
        q = query.to(_compute_dtype(query.dtype))
        total = norm = shift = None
        for latent, causal in _parts(step, context, block):
            _, key, value = _expand(latent, weight, heads, nope)
            scores = _logits(q, key, scale, causal)
            top = scores.amax(-1, keepdim=True)
            weights = (scores - top).exp()
            part, part_norm = torch.matmul(weights, value), weights.sum(-1, keepdim=True)
            if total is None:
                total, norm, shift = part, part_norm, top
                continue
            merged = torch.maximum(shift, top)
            old, new = (shift - merged).exp(), (top - merged).exp()
            total, norm, shift = total * old + part * new, norm * old + part_norm * new, merged
        out = total / norm
        lse = (shift + norm.log()).squeeze(-1)
    return out.to(query.dtype), lse


@mla_context_attention.register_fake
def _(query, step, context, weight, scale, block, nope):
    rows = weight.shape[0] // query.shape[1]
    return (query.new_empty(*query.shape[:3], rows - nope),
            query.new_empty(query.shape[:3], dtype=_compute_dtype(query.dtype)))


@torch.library.custom_op("transformers_k3::mla_context_attention_backward", mutates_args=())
def mla_context_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, step: torch.Tensor,
                                   context: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                   scale: float, block: int, nope: int,
                                   mask: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `mla_context_attention`'s output with respect to ``query, step, context, weight`` for the
    cotangent ``grad_out``; ``mask`` says which are wanted (the others come back empty)."""
    heads, rank = query.shape[1], weight.shape[1]
    with _no_autocast(query.device):
        wide = _compute_dtype(query.dtype)
        q, d_out = query.to(wide), grad_out.to(wide)
        lse = lse.to(wide).unsqueeze(-1)
        delta = (d_out * out.to(wide)).sum(-1, keepdim=True)  # (rowsum(dO * O): the softmax's Jacobian term)
        d_query = torch.zeros_like(q)
        d_weight = torch.zeros(weight.shape, dtype=_compute_dtype(weight.dtype), device=weight.device)
        d_step = None
        d_context = torch.zeros(context.shape, dtype=wide, device=context.device) if mask[2] else None
        for index, (latent, causal) in enumerate(_parts(step, context, block)):
            c_kv, key, value = _expand(latent, weight, heads, nope)
            probs = (_logits(q, key, scale, causal) - lse).exp()
            d_value = torch.matmul(probs.transpose(-1, -2), d_out)  # [B, n, S, dv]
            d_scores = probs * (torch.matmul(d_out, value.transpose(-1, -2)) - delta) * scale
            d_query += torch.matmul(d_scores, key)
            d_key = torch.matmul(d_scores.transpose(-1, -2), q)  # [B, n, S, dn + dr]
            d_kv = torch.cat([d_key[..., :nope], d_value], dim=-1).transpose(1, 2).flatten(2)  # [B, S, n (dn + dv)]
            if mask[3]:
                d_weight += torch.matmul(d_kv.flatten(0, 1).transpose(0, 1), c_kv.flatten(0, 1).to(d_kv.dtype))
            if mask[1 if causal else 2]:
                d_latent = torch.cat([torch.matmul(d_kv, weight.to(d_kv.dtype)), d_key[..., nope:].sum(1)], dim=-1)
                if causal:
                    d_step = d_latent
                else:  # (written block by block: no list of the context's gradients to join)
                    start = (index - 1) * block
                    d_context[:, start: start + latent.shape[1]] = d_latent
    empty = query.new_empty(0)
    return (d_query.to(query.dtype).contiguous() if mask[0] else empty,
            d_step.to(step.dtype).contiguous() if mask[1] else empty,
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
