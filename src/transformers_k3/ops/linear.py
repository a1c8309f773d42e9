"""`KernelLinear`: an `nn.Linear` whose bf16 few-row products on CPU run in a kernel, put in place of the plain
`nn.Linear` layers by `transformers_k3.ops.kernel_layers.kernelize`; `products_f32`: a bf16 batched product with
exact products and fp32 sums; `latent_attention`: the softmax-weighted sum over an MLA latent that those products'
logits feed (one pass on CPU); `blocks`: a length's blocks.

torch's CPU matmul in bf16 has a fixed cost per call far above fp32's, so a bf16 decode step (dozens of one-row
products) ran slower than the same model in fp32. `cpu_kernel.linear_bf16` computes the same quantity (exact
products of the bf16 values, fp32 sums, one rounding to bf16) for a few rows; on a CPU without bf16 dot-product
instructions `cpu_kernel.linear_bf16_upcast` takes more rows (docs/kernels.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from . import cpu_kernel


class KernelLinear(nn.Linear):
    """``F.linear(x, weight, bias)``; for bf16 ``x`` that `cpu_kernel.linear_bf16` takes (CPU, a few rows, no
    autograd) or `cpu_kernel.linear_bf16_upcast` (more rows, a CPU without bf16 instructions), their result: the
    same quantity. Its state dict is `nn.Linear`'s; PEFT wraps it as it wraps `nn.Linear`.

    ``tensors``: ``(weight, bias)`` as registered, read once after each change (`Module.__getattr__` costs more than
    a small product's kernel call): registering a parameter or child (torch's registration hooks, `_forget`) or
    deleting an attribute forgets them; a parametrized subclass or plain tensor attributes are read at every call."""

    tensors: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tensors = self.tensors
        if tensors is None:
            tensors = (self.weight, self.bias)
            _keep(self, tensors)
        weight, bias = tensors
        if x.dtype is torch.bfloat16:
            out = cpu_kernel.linear_bf16(x, weight, bias)
            if out is None:
                out = cpu_kernel.linear_bf16_upcast(x, weight, bias)
            if out is not None:
                return out
        return F.linear(x, weight, bias)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        self.tensors = None  # (a plain tensor set in a deleted parameter's place reaches no registration hook)


def held_tensors(linear: KernelLinear) -> tuple | None:
    """``linear.tensors``, read again where they were forgotten: ``(weight, bias)`` where `_keep` keeps them, else
    None."""
    tensors = linear.tensors
    if tensors is None:
        tensors = (linear.weight, linear.bias)
        if not _keep(linear, tensors):
            return None
    return tensors


def _keep(linear: nn.Module, tensors: tuple) -> bool:
    """Keep ``tensors`` as ``linear.tensors`` where both are registered parameters (or no bias) of a `KernelLinear`
    itself: a parametrized subclass computes them, a plain tensor attribute is reassigned without any hook."""
    if type(linear) is not KernelLinear or not all(t is None or isinstance(t, nn.Parameter) for t in tensors):
        return False
    linear.tensors = tensors
    return True


def _forget(module: nn.Module, name: str, value) -> None:
    """torch's parameter and module registration hook: a `KernelLinear` reads its tensors again at its next call."""
    if isinstance(module, KernelLinear):
        module.tensors = None


_HOOKS = (register_module_parameter_registration_hook(_forget), register_module_module_registration_hook(_forget))


# the linear layers whose product is ``F.linear(x, weight, bias)``: a layer may read their weight instead of calling them
PLAIN_LINEARS = (nn.Linear, KernelLinear)


def attach_mla(attention: nn.Module):
    """The MLA layer's kernel (`kernelize`): its absorbed attention through the kernels (`latent_attention` with
    ``kernel=True``)."""
    return functools.partial(latent_attention, kernel=True)


def swap_linear(linear: nn.Linear, cls: type[nn.Linear]) -> nn.Linear:
    """A ``cls`` module holding ``linear``'s own parameters (tied weights stay tied), in its training mode."""
    new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    new.weight = linear.weight
    if linear.bias is not None:
        new.bias = linear.bias
    if "_is_hf_initialized" in linear.__dict__:
        new._is_hf_initialized = linear._is_hf_initialized
    return new.train(linear.training)


def products_f32(a: torch.Tensor, b: torch.Tensor, block: int, kernel: bool = False) -> torch.Tensor:
    """``b [B, M, r] @ a [B, S, r]^T`` as fp32 ``[B, M, S]`` with every product exact and the sums in fp32 (products
    of two bf16 values are exact in fp32), ``a`` (long: an MLA latent) the row-major operand of the product: with
    ``kernel`` on CPU by the kernels' `cpu_kernel.latent_scores` (contiguous), on CUDA by a bmm with an fp32 output; otherwise
    on fp32 copies of ``a``, ``block`` rows at a time (a long ``a`` is never copied whole), a transposed view."""
    if kernel and a.device.type == "cpu":
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
                     block: int, mask: torch.Tensor | None = None, kernel: bool = False) -> torch.Tensor:
    """``softmax(scale queries latent^T) latent[..., :value_dim]`` ``[B, M, value_dim]`` in ``queries``' dtype, for
    ``queries [B, M, D]`` head-major over the ``new_tokens`` new tokens: MLA's absorbed attention. ``mask``: a 4-D
    boolean or additive mask over the latent's rows (``[B or 1, heads or 1, new_tokens or 1, S]``), else end-aligned
    causality (the new tokens the latent's last). With ``kernel`` (the MLA layer's kernel, `kernelize`) on CPU, with no
    mask or a boolean one, in one pass over the latent (the kernels' `cpu_kernel.latent_attention`: the logits, softmax and sums in fp32, rounded once); otherwise the
    logits by `products_f32` (``block`` latent rows at a time where it copies), masked (the lowest fp32 where a
    boolean mask is False, as transformers' eager attention), an fp32 softmax and the probabilities, in ``queries``'
    dtype, times the latent."""
    batch, rows, seq = queries.shape[0], queries.shape[1], latent.shape[1]
    heads = rows // new_tokens
    if kernel and latent.device.type == "cpu" and (mask is None or (
            mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, batch)
            and mask.shape[1] in (1, heads) and mask.shape[2] in (1, new_tokens) and mask.shape[3] == seq)):
        fused = None if mask is None else mask.expand(-1, -1, new_tokens, -1)
        out = cpu_kernel.latent_attention(latent, queries, scale, value_dim, new_tokens, fused)
        if out is not None:
            return out.to(queries.dtype)
    scores = products_f32(latent, queries, block, kernel) * scale  # [B, M, S], fp32
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
