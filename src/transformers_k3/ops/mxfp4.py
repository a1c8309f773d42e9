"""Routed experts that compute on packed MXFP4 weights (issue 46), the release's compressed-tensors
``mxfp4-pack-quantized`` bytes stacked per layer, never dequantized as a whole (docs/mxfp4.md).

Layout per MoE layer (each expert's release tensors, stacked; the bytes unchanged):

* ``gate_up_packed [E, 2I, D/2]`` uint8: expert ``e``'s ``w1.weight_packed`` (gate rows) then ``w3`` (up rows);
  ``gate_up_scale [E, 2I, D/32]`` uint8 their ``weight_scale``;
* ``down_packed [E, D, I/2]`` and ``down_scale [E, D, I/32]``: ``w2``.

Two E2M1 codes a byte, the low nibble the even input index; ``W[n, k] = E2M1(code) * 2^(scale[n, k // 32] - 127)``
(as compressed-tensors' ``unpack_fp4_from_uint8`` and ``decompress_mx_scale`` read them).

`packed_grouped_mm` is the product (``transformers_k3::mxfp4_grouped_mm``, differentiable with respect to its rows):
on CPU the C++ kernel, which dequantizes in registers; elsewhere, and where the kernels are not built, PyTorch
one expert at a time (`mxfp4_torch`). `mxfp4_experts` is the experts' weighted sum on top of it, as
``"k3_grouped_mm"`` computes it; `mxfp4_experts_forward` is that as an experts-interface function.

Numerical contract: every dequantized weight is exact in fp32, the products are summed in fp32 (fp64 rows: fp64)
and rounded once to the rows' dtype, so the result equals the dequantize-then-compute path up to the fp32
rounding of the sums (their order differs); activations are never quantized. The weights are frozen: gradients
reach the activations and the routing weights, not the packed bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ..conversion.quant import QuantFormatError, check_mxfp4_values
from . import cpu_kernel, mxfp4_torch

__all__ = [
    "MXFP4_EXPERTS", "QuantFormatError", "check_packed_experts", "mxfp4_experts", "mxfp4_experts_forward",
    "packed_grouped_mm", "stack_release_experts",
]  # fmt: skip

MXFP4_EXPERTS = "k3_mxfp4"  # the experts-interface name this implementation is meant to be registered under
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def packed_grouped_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                      kernel: bool = True) -> torch.Tensor:
    """``out [M, N]`` in ``x``'s dtype: for each expert ``e`` its rows ``offsets[e-1]:offsets[e]`` of ``x [M, K]``
    (sorted by expert; ``offsets [E]`` int32 or int64, as for ``torch._grouped_mm``) times ``W_e^T``, ``W_e`` the
    dequantized ``[N, K]`` of ``packed [E, N, K/2]`` / ``scale [E, N, K/32]``; rows after ``offsets[-1]`` give
    zeros. Differentiable with respect to ``x``. Shapes that do not fit raise `QuantFormatError`. ``kernel=False``:
    the PyTorch operations (`mxfp4_torch`) instead of the operator."""
    mxfp4_torch.check_operands(x, packed, scale, offsets)
    if kernel and x.dtype in _KERNEL_DTYPES and cpu_kernel.library() is not None:
        grad = torch.is_grad_enabled() and x.requires_grad
        with contextlib.nullcontext() if grad else cpu_kernel._below_autograd():
            return torch.ops.transformers_k3.mxfp4_grouped_mm.default(x, packed, scale, offsets)
    return mxfp4_torch.mxfp4_grouped_mm(x, packed, scale, offsets)  # (plain autograd through the products)


def mxfp4_experts(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    gate_up_packed: torch.Tensor, gate_up_scale: torch.Tensor, down_packed: torch.Tensor, down_scale: torch.Tensor,
    glu: Callable[[torch.Tensor], torch.Tensor], kernel: bool = True,
    gate_up_delta: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    down_delta: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``out [N, D]`` in ``hidden_states``' dtype: ``out[t] = sum_j w[t, j] * down_e(glu(gate_up_e(x[t])))``,
    ``e = top_k_index[t, j]``, ``w = top_k_weights``, with the packed experts of the layout above; ``glu`` maps
    ``[*, 2I]`` (gate half first) to ``[*, I]``. As ``"k3_grouped_mm"``: (token, slot) pairs sorted by expert,
    both products grouped over the sorted rows, the routing weight applied to the ``I``-wide GLU output, the
    expert outputs summed into their tokens in fp32. Ids outside ``[0, E)`` contribute nothing. Gradients reach
    ``hidden_states`` and ``top_k_weights``. ``kernel``: as for `packed_grouped_mm`. ``gate_up_delta`` /
    ``down_delta``: ``f(rows [M, in], offsets [E]) -> [M, out]`` added to that product's sorted rows (a low-rank
    adapter beside the frozen packed weights, `peft_mxfp4`); rows after ``offsets[-1]`` must come back zero."""
    num_tokens, top_k = top_k_index.shape
    experts = gate_up_packed.shape[0]
    ids = top_k_index.reshape(-1)
    ids = torch.where((ids < 0) | (ids >= experts), experts, ids)  # (out-of-range ids sort last, in no group)
    perm = torch.sort(ids, stable=True).indices
    counts = ids.new_zeros(experts + 1).scatter_add_(0, ids, torch.ones_like(ids))  # (a static shape)
    offsets = counts[:experts].cumsum(0)
    token_ids = perm // top_k
    rows = hidden_states.index_select(0, token_ids)
    gate_up = packed_grouped_mm(rows, gate_up_packed, gate_up_scale, offsets, kernel)
    if gate_up_delta is not None:
        gate_up = gate_up + gate_up_delta(rows, offsets)
    routed = glu(gate_up) * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    expert_out = packed_grouped_mm(routed, down_packed, down_scale, offsets, kernel)
    if down_delta is not None:
        expert_out = expert_out + down_delta(routed, offsets)
    out = torch.zeros(num_tokens, expert_out.shape[-1], dtype=torch.float32, device=expert_out.device)
    return out.index_add_(0, token_ids, expert_out.float()).to(hidden_states.dtype)


def mxfp4_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """An experts-interface function (transformers' ``ALL_EXPERTS_FUNCTIONS``: ``fn(experts_module, hidden_states
    [N, D], top_k_index [N, k], top_k_weights [N, k]) -> [N, D]``) over packed experts: the module holds the four
    stacks above as ``gate_up_packed``, ``gate_up_scale``, ``down_packed``, ``down_scale`` (uint8) and applies
    its GLU through ``_apply_gate``, as `KimiK3Experts` does."""
    if getattr(self, "has_bias", False) or not getattr(self, "has_gate", True):
        raise NotImplementedError(f"{MXFP4_EXPERTS!r} supports gated experts without biases")
    return mxfp4_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_packed, self.gate_up_scale,
                         self.down_packed, self.down_scale, self._apply_gate)  # fmt: skip


def check_packed_experts(gate_up_packed: torch.Tensor, gate_up_scale: torch.Tensor, down_packed: torch.Tensor,
                         down_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int]:  # fmt: skip
    """``(E, I, D)`` of a layer's packed experts, or `QuantFormatError` naming what is wrong: shapes that do not fit
    the layout, a scale of 255 (E8M0's NaN) or one that makes a weight infinite in ``dtype``
    (`check_mxfp4_values`, per expert). For the loader, once per layer (the products do not re-read the values)."""
    for name, t in (("gate_up_packed", gate_up_packed), ("gate_up_scale", gate_up_scale),
                    ("down_packed", down_packed), ("down_scale", down_scale)):  # fmt: skip
        if t.dtype != torch.uint8 or t.dim() != 3:
            raise QuantFormatError(f"MXFP4 experts: {name} must be a 3-D uint8 stack, got {t.dtype} {list(t.shape)}")
    experts, two_inter, half_hidden = gate_up_packed.shape
    hidden, inter = half_hidden * 2, two_inter // 2
    expected = {
        "gate_up_scale": (gate_up_scale, [experts, 2 * inter, hidden // 32]),
        "down_packed": (down_packed, [experts, hidden, inter // 2]),
        "down_scale": (down_scale, [experts, hidden, inter // 32]),
    }
    if two_inter % 2 or hidden % 32 or inter % 32:
        raise QuantFormatError(f"MXFP4 experts: gate_up_packed {list(gate_up_packed.shape)} needs an even row count and "
                               "hidden and intermediate widths that are multiples of 32")  # fmt: skip
    for name, (t, shape) in expected.items():
        if list(t.shape) != shape:
            raise QuantFormatError(f"MXFP4 experts: {name} is {list(t.shape)}, gate_up_packed "
                                   f"{list(gate_up_packed.shape)} needs {shape}")  # fmt: skip
    for e in range(experts):
        check_mxfp4_values(gate_up_packed[e], gate_up_scale[e], dtype)
        check_mxfp4_values(down_packed[e], down_scale[e], dtype)
    return experts, inter, hidden


def stack_release_experts(experts: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """The layer's four stacks ``(gate_up_packed, gate_up_scale, down_packed, down_scale)`` from its experts'
    release tensors, one dict per expert with ``w1``, ``w2``, ``w3`` each mapping to ``(weight_packed,
    weight_scale)`` (scale ``[N, K/32]`` or ``[N, 1, K/32, 1]``); the bytes are copied unchanged, so slicing the
    stacks gives the release tensors back bit for bit. Values checked by `check_packed_experts`."""
    from ..conversion.quant import mxfp4_scale_2d

    if not experts:
        raise QuantFormatError("MXFP4 experts: no experts to stack")

    def part(expert, name, i):
        return expert[name][i] if i == 0 else mxfp4_scale_2d(expert[name][1])

    stacks = (
        torch.stack([torch.cat([part(x, "w1", 0), part(x, "w3", 0)]) for x in experts]),
        torch.stack([torch.cat([part(x, "w1", 1), part(x, "w3", 1)]) for x in experts]),
        torch.stack([part(x, "w2", 0) for x in experts]),
        torch.stack([part(x, "w2", 1) for x in experts]),
    )
    check_packed_experts(*stacks)
    return stacks
