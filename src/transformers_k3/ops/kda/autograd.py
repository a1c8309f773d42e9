"""Chunked KDA on CPU under autograd: the fused forward kernel with the PyTorch chunked path's gradient.

``transformers_k3::kda_chunk`` is a functional operator (no input is written) whose CPU implementation is the fused
kernel (:func:`transformers_k3.ops.cpu_kernel.chunk_forward`, ``inplace=False``). Its autograd formula recomputes
the PyTorch chunked path (:func:`transformers_k3.ops.kda.chunk.chunked`, the code CPU training ran before) on the saved
inputs and returns that computation's vector-Jacobian product, so CPU training and CPU inference evaluate the same
function (the kernel's forward) and the gradient is exactly the PyTorch path's for the same cotangents (the
forward values differ from the PyTorch path's by fp32 rounding only).

The backward is itself an operator, ``transformers_k3::kda_chunk_backward`` (fake implementation included): the
PyTorch path reads host values (the gate's largest magnitude, the sequence layout) that a traced graph
(AOTAutograd, torch.compile) cannot hold, so the recomputation stays inside an opaque call.

Both take the tensors as :func:`transformers_k3.ops.kda.interface._torch_kda` hands them to the kernel: ``q, k, g``
``[B, T, H, K]`` (``q`` not yet scaled), ``v`` ``[B, T, H, V]``, ``beta`` ``[B, T, H]``, ``state`` ``[N, H, K, V]`` in
sequence order, ``cu_seqlens`` the packed bounds as a tensor (then ``B == 1``; read and checked when the operator
runs, so a compiled graph holds it without a host read) or None, ``scale`` the query scale and ``chunk`` the chunk
size. L2 normalisation and grouped-value repetition happen before, in ordinary differentiable PyTorch.

Both run on any device: the fused kernel where it applies (fp32 CPU tensors, the kernels built, asked for), the PyTorch
chunked path (the same function) everywhere else, so a graph holding them also runs where the kernels do not.
"""

from __future__ import annotations

import torch

from .. import cpu_kernel
from ..torch_internals import autograd_inside_operator
from .chunk import chunked_reference
from .layout import host_bounds


def _bounds(cu_seqlens: torch.Tensor | None, length: int) -> list[int] | None:
    return None if cu_seqlens is None else host_bounds(cu_seqlens, length)


@torch.library.custom_op("transformers_k3::kda_chunk", mutates_args=())
def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float,
              chunk: int, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(o, final_state)`` of chunked KDA, computed by the fused kernel where it applies; differentiable in every
    tensor argument but ``cu_seqlens``. ``fused=False``: the PyTorch path (the plain model's traced packed call)."""
    bounds = _bounds(cu_seqlens, q.shape[1])
    out = None
    if fused and cpu_kernel.applies(q, k, v, g, beta, state, differentiable=True):
        out = cpu_kernel.chunk_forward(q, k, v, g, beta, state, bounds, scale, chunk, inplace=False)
    if out is None:  # (kernels unavailable or out of memory: the PyTorch path, same function)
        o, final = chunked_reference(q, k, v, g, beta, state, bounds, scale, chunk)
        return o.contiguous(), final.contiguous()
    return out


@kda_chunk.register_fake
def _(q, k, v, g, beta, state, cu_seqlens, scale, chunk, fused=True):
    return q.new_empty((*q.shape[:3], v.shape[-1])), torch.empty_like(state, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    q, k, v, g, beta, state, cu_seqlens, ctx.scale, ctx.chunk, _ = inputs
    ctx.save_for_backward(q, k, v, g, beta, state, cu_seqlens)
    ctx.set_materialize_grads(False)  # (an unused output, e.g. the final state, gets None: no vjp through it)


def _backward(ctx, grad_o, grad_state):
    mask = list(ctx.needs_input_grad[:6])
    grads = torch.ops.transformers_k3.kda_chunk_backward.default(
        grad_o, grad_state, *ctx.saved_tensors, ctx.scale, ctx.chunk, mask
    )
    return (*(x if m else None for x, m in zip(grads, mask)), None, None, None, None)


kda_chunk.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("transformers_k3::kda_chunk_backward", mutates_args=())
def kda_chunk_backward(grad_o: torch.Tensor | None, grad_state: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                       cu_seqlens: torch.Tensor | None, scale: float, chunk: int,
                       mask: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients of ``(o, final_state)`` with respect to ``q, k, v, g, beta, state`` for the cotangents ``grad_o``,
    ``grad_state`` (None: that output was not used): the vjp of the PyTorch chunked path, recomputed on these
    inputs. ``mask`` says which of the six are wanted; the others come back as empty tensors."""
    inputs = (q, k, v, g, beta, state)
    bounds = _bounds(cu_seqlens, q.shape[1])
    with autograd_inside_operator(), torch.enable_grad():
        leaves = [x.detach().requires_grad_(m) for x, m in zip(inputs, mask)]
        o, final = chunked_reference(*leaves, bounds, scale, chunk)
        wanted = [x for x, m in zip(leaves, mask) if m]
        # (an output that depends on no input, as o of an empty input, does not take part)
        outputs = [(y, bar) for y, bar in ((o, grad_o), (final, grad_state)) if bar is not None and y.requires_grad]
        found = [None] * len(wanted)
        if wanted and outputs:
            ys, bars = zip(*outputs)
            found = torch.autograd.grad(ys, wanted, bars, allow_unused=True)
    found = iter(found)
    results = []
    for x, m in zip(inputs, mask):
        grad = next(found) if m else None
        if grad is None:
            grad = torch.zeros_like(x) if m else x.new_empty(0)
        elif any(t is not None and _shares_storage(grad, t) for t in (grad_o, grad_state)):
            grad = grad.clone()  # (an operator's outputs may not alias its inputs: an identity passes a cotangent)
        results.append(grad.contiguous())  # (as the fake implementation says)
    return tuple(results)


@kda_chunk_backward.register_fake
def _(grad_o, grad_state, q, k, v, g, beta, state, cu_seqlens, scale, chunk, mask):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) if m else x.new_empty(0)
                 for x, m in zip((q, k, v, g, beta, state), mask))  # fmt: skip


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def applies(q, k, v, g, beta, state) -> bool:
    """Whether :func:`kda_chunk` should compute this call: a gradient is wanted, every tensor is a plain fp32 CPU
    tensor (a tensor subclass such as DTensor keeps the PyTorch path, which it can decompose) and the fused
    kernels are built (without autograd the in-place inference route runs instead)."""
    tensors = (q, k, v, g, beta, state)
    return (
        torch.is_grad_enabled()
        and any(x.requires_grad for x in tensors)
        and all(type(x) in cpu_kernel._PLAIN_TENSORS for x in tensors)
        and cpu_kernel.applies(*tensors, differentiable=True)
        and cpu_kernel.library() is not None
    )
