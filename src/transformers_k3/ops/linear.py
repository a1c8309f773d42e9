"""`linear_forward`: the forward K3's linear layers run (``nn.Linear``'s, with a bf16 decode step on CPU computed in
a kernel); `products_f32`: a bf16 batched product with exact products and fp32 sums; `latent_attention`: the
softmax-weighted sum over an MLA latent that those products' logits feed (one pass on CPU); `blocks`: a length's
blocks.

torch's CPU matmul in bf16 has a fixed cost per call far above fp32's whatever the size, so a bf16 model's decode
step, dozens of one-row products, ran slower than the same model in fp32, and a bf16 MoE layer's decode step slower
than transformers' in-tree one (it has two more projections). For bf16 inputs of a few rows on CPU (up to 4, or up
to 15 for small products: where it is the faster) with no gradient wanted, `cpu_kernel.linear_bf16` computes the
same quantity (exact products of the bf16 values, fp32 sums, one rounding to bf16) at a fraction of that cost. On a
CPU without bf16 dot-product instructions (AVX2 machines; AVX-512 ones before Cooper Lake), where torch's bf16
matmul runs at a small fraction of its fp32 rate, more rows (a prefill) without autograd go through
`cpu_kernel.linear_bf16_upcast`: the fp32 GEMM on fp32 copies of the bf16 values, rounded once (the same quantity,
in a fraction of the time; timings in bench/RESULTS.md).

The layers stay plain `nn.Linear` modules, called as modules (``self.q_proj(x)``): `use_linear_forward` sets this
forward on the instance, so its type stays exactly `nn.Linear` (transformers' bitsandbytes, fp8 and GGUF
integrations replace only that type, and the replacement runs its own forward), and hooks (accelerate's offload,
tensor parallelism's) run around it as around any module. A PEFT LoRA layer calls it as its base layer.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from . import cpu_kernel


def linear_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, layer.weight, layer.bias)``; on bf16 ``x`` that `cpu_kernel.linear_bf16` takes (CPU, a few rows,
    no autograd, plain tensors, kernels on), or `cpu_kernel.linear_bf16_upcast` (more rows, a CPU without bf16
    instructions), their result: the same quantity."""
    # (from the parameters' dict: `layer.weight` goes through Module.__getattr__, slow on every step; a
    # weight or bias that is not a plain parameter there, e.g. a parametrization's, is read the usual way)
    params = layer._parameters
    weight, bias = params.get("weight"), params.get("bias", _MISSING)
    if weight is None:
        weight = layer.weight
    if bias is _MISSING:
        bias = layer.bias
    if x.dtype is torch.bfloat16:
        out = cpu_kernel.linear_bf16(x, weight, bias)
        if out is None:
            out = cpu_kernel.linear_bf16_upcast(x, weight, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


_MISSING = object()


def use_linear_forward(model: nn.Module) -> None:
    """Give every plain `nn.Linear` in ``model`` (exactly that type, its class's forward) `linear_forward`."""
    for module in model.modules():
        if type(module) is nn.Linear and "forward" not in module.__dict__:
            module.forward = functools.partial(linear_forward, module)


def plain_linears(modules) -> bool:
    """Whether each of ``modules`` is exactly an `nn.Linear` without bias and `unhooked`, so that `linear_forward`
    computes what calling it would. (Loops, not any(): this runs on every decode step of every MoE layer.)"""
    for m in modules:
        if type(m) is not nn.Linear or m._parameters.get("bias", m) is not None:
            return False
    return unhooked(modules)


def unhooked(modules) -> bool:
    """Whether none of ``modules`` (None entries skipped) has hooks of its own or a forward set on the instance
    other than `linear_forward` (accelerate's offload wraps it that way); global hooks are checked apart."""
    for m in modules:
        if m is None:
            continue
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return False
        forward = m.__dict__.get("forward")
        if forward is not None and (type(forward) is not functools.partial or forward.func is not linear_forward):
            return False
    return True


def _any_global_hooks() -> bool:
    return bool(
        _module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks
        or _module._global_backward_pre_hooks
    )  # fmt: skip


def products_f32(a: torch.Tensor, b: torch.Tensor, block: int) -> torch.Tensor:
    """``b [B, M, r] @ a [B, S, r]^T`` as fp32 ``[B, M, S]`` with every product exact and the sums in fp32 (products
    of two bf16 values are exact in fp32), ``a`` (long: an MLA latent) the row-major operand of the product: on
    CPU by the kernels' `cpu_kernel.latent_scores` (contiguous), on CUDA by a bmm with an fp32 output; otherwise
    on fp32 copies of ``a``, ``block`` rows at a time (a long ``a`` is never copied whole), a transposed view."""
    if a.device.type == "cpu":
        scores = cpu_kernel.latent_scores(a, b)
        if scores is not None:
            return scores
    keys = b.transpose(1, 2)
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.matmul(a, keys).transpose(1, 2)
    if a.device.type == "cuda" and a.dtype == b.dtype:
        try:
            return torch.bmm(a, keys, out_dtype=torch.float32).transpose(1, 2)
        except (RuntimeError, TypeError):  # (a torch or dtype without fp32-output bmm: the blocks below)
            pass
    keys = keys.float()
    return torch.cat([torch.matmul(a[:, start:end].float(), keys)
                      for start, end in blocks(a.shape[1], block)], dim=1).transpose(1, 2)


def end_aligned_causal(q_len: int, seq: int, device) -> torch.Tensor:
    """``[q_len, seq]`` boolean causal mask for the last ``q_len`` of ``seq`` tokens (new tokens after a cache)."""
    return torch.ones(q_len, seq, dtype=torch.bool, device=device).tril(seq - q_len)


def latent_attention(latent: torch.Tensor, queries: torch.Tensor, scale: float, value_dim: int, new_tokens: int,
                     block: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scale queries latent^T) latent[..., :value_dim]`` ``[B, M, value_dim]`` in ``queries``' dtype, for
    ``queries [B, M, D]`` head-major over the ``new_tokens`` new tokens: MLA's absorbed attention. ``mask``: a 4-D
    boolean or additive mask over the latent's rows (``[B or 1, heads or 1, new_tokens or 1, S]``), else end-aligned
    causality (the new tokens the latent's last). On CPU, with no mask or a boolean one, in one pass over the latent
    (the kernels' `cpu_kernel.latent_attention`: the logits, softmax and sums in fp32, rounded once); otherwise the
    logits by `products_f32` (``block`` latent rows at a time where it copies), masked (the lowest fp32 where a
    boolean mask is False, as transformers' eager attention), an fp32 softmax and the probabilities, in ``queries``'
    dtype, times the latent."""
    batch, rows, seq = queries.shape[0], queries.shape[1], latent.shape[1]
    heads = rows // new_tokens
    if latent.device.type == "cpu" and (mask is None or (
            mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, batch)
            and mask.shape[1] in (1, heads) and mask.shape[2] in (1, new_tokens) and mask.shape[3] == seq)):
        fused = None if mask is None else mask.expand(-1, -1, new_tokens, -1)
        out = cpu_kernel.latent_attention(latent, queries, scale, value_dim, new_tokens, fused)
        if out is not None:
            return out.to(queries.dtype)
    scores = products_f32(latent, queries, block) * scale  # [B, M, S], fp32
    if mask is None and new_tokens > 1:
        mask = end_aligned_causal(new_tokens, seq, scores.device)
    if mask is not None:
        scores = scores.view(batch, heads, new_tokens, seq)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
        scores = scores.view(batch, rows, seq)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    return torch.matmul(probs, latent)[..., :value_dim]


def blocks(length: int, size: int) -> list[tuple[int, int]]:
    """``(start, end)`` of ``length`` in blocks of ``size``, the last one possibly shorter. Under torch.compile with a
    dynamic ``length`` a graph guards on the block count only (``range(0, length, size)`` with a clamped end
    guarded on the exact length: a recompilation per step or chunk)."""
    count = (length + size - 1) // size
    return [(i * size, length if i == count - 1 else (i + 1) * size) for i in range(count)]
