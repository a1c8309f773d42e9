"""The packed MXFP4 grouped product (``transformers_k3::mxfp4_grouped_mm`` and its backward) in PyTorch: the
implementation for every device without the C++ kernel (``csrc/mxfp4_cpu.cpp``), and for the CPU where that
kernel is not built. Also the operators' fake implementations and autograd formula, registered when the kernels'
library loads (`register`). No import of the kernels' loader, so the loader can call this.

Both products dequantize one expert's weight at a time (``[N, K]`` in fp32, or fp64 for fp64 rows), never a whole
layer, and compute in that dtype: the dequantize-then-compute contract of :mod:`transformers_k3.ops.mxfp4`.
"""

from __future__ import annotations

import torch

from ..conversion.quant import E2M1_VALUES, E8M0_BIAS, E8M0_NAN, QuantFormatError

GROUP = 32  # input values per E8M0 scale


def _codes_table(device, dtype) -> torch.Tensor:
    magnitudes = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([magnitudes, -magnitudes])  # code bit 3 is the sign


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``packed [..., N, K/2]`` + ``scale [..., N, K/32]`` (uint8) -> ``[..., N, K]`` in ``dtype`` (fp32 or fp64:
    exact), the low nibble of each byte the even input index, ``E2M1(code) * 2^(scale - 127)``; a scale of 255
    (E8M0's NaN) gives NaN."""
    k = packed.shape[-1] * 2
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], k)
    values = _codes_table(packed.device, dtype)[codes.long()]
    exponents = scale.to(torch.int32) - E8M0_BIAS
    factors = torch.ldexp(torch.ones((), dtype=dtype, device=scale.device), exponents.to(dtype))
    factors = factors.masked_fill(scale == E8M0_NAN, float("nan"))
    return (values.view(*scale.shape, GROUP) * factors.unsqueeze(-1)).view(*packed.shape[:-1], k)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_operands(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   forward: bool = True) -> tuple[int, int, int]:  # fmt: skip
    """``(E, N, K)`` of a grouped product's operands, or `QuantFormatError` saying what does not fit: ``rows``
    ``[M, K]`` (forward) or ``[M, N]`` (backward) floating point, ``packed [E, N, K/2]`` and ``scale
    [E, N, K/32]`` uint8 with ``K`` a multiple of 32, ``offsets [E]`` integer (each expert's end row)."""
    name = "x" if forward else "grad"
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise QuantFormatError(f"MXFP4 packed weights and scales must be uint8, got {packed.dtype} and {scale.dtype}")
    if packed.dim() != 3 or scale.dim() != 3:
        raise QuantFormatError(f"MXFP4 expert stacks are packed [E, N, K/2] and scale [E, N, K/32], got "
                               f"{list(packed.shape)} and {list(scale.shape)}")  # fmt: skip
    experts, n, k = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    if k % GROUP or list(scale.shape) != [experts, n, k // GROUP]:
        raise QuantFormatError(f"MXFP4 scale {list(scale.shape)} does not fit packed {list(packed.shape)}: expected "
                               f"[{experts}, {n}, {k // GROUP}] with K = {k} a multiple of {GROUP}")  # fmt: skip
    if rows.dim() != 2 or not rows.is_floating_point() or rows.shape[1] != (k if forward else n):
        raise QuantFormatError(f"MXFP4 grouped product: {name} must be a floating-point [M, {k if forward else n}], "
                               f"got {rows.dtype} {list(rows.shape)}")  # fmt: skip
    if offsets.dim() != 1 or offsets.shape[0] != experts or offsets.is_floating_point() or offsets.is_complex():
        raise QuantFormatError(f"MXFP4 grouped product: offsets must be [{experts}] integer end rows, got "
                               f"{offsets.dtype} {list(offsets.shape)}")  # fmt: skip
    return experts, n, k


def _segments(offsets: torch.Tensor, rows: int):
    """``(expert, start, end)`` of each expert with rows (one host read of the offsets)."""
    ends = offsets.tolist()
    start = 0
    for expert, end in enumerate(ends):
        if not start <= end <= rows:
            raise QuantFormatError(f"MXFP4 grouped product: offsets must be non-decreasing end rows within the {rows} "
                                   f"rows, got offsets[{expert}] = {end}")  # fmt: skip
        if end > start:
            yield expert, start, end
        start = end


def mxfp4_grouped_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out [M, N]`` in ``x``'s dtype: rows ``offsets[e-1]:offsets[e]`` of ``x [M, K]`` times ``W_e^T`` (``W_e``
    expert ``e``'s dequantized ``[N, K]``), rows after ``offsets[-1]`` zero; computed in fp32 (fp64 rows: fp64)."""
    check_operands(x, packed, scale, offsets)
    compute = _compute_dtype(x.dtype)
    out = x.new_zeros((x.shape[0], packed.shape[1]), dtype=compute)
    for expert, start, end in _segments(offsets, x.shape[0]):
        weight = dequantize(packed[expert], scale[expert], compute)
        out[start:end] = x[start:end].to(compute) @ weight.t()
    return out.to(x.dtype)


def mxfp4_grouped_mm_backward(grad: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                              offsets: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The forward's gradient with respect to ``x``: ``grad [M, N]`` rows of expert ``e`` times ``W_e``, ``[M, K]``
    in ``grad``'s dtype (rows after ``offsets[-1]`` zero)."""
    check_operands(grad, packed, scale, offsets, forward=False)
    compute = _compute_dtype(grad.dtype)
    out = grad.new_zeros((grad.shape[0], packed.shape[2] * 2), dtype=compute)
    for expert, start, end in _segments(offsets, grad.shape[0]):
        weight = dequantize(packed[expert], scale[expert], compute)
        out[start:end] = grad[start:end].to(compute) @ weight
    return out.to(grad.dtype)


def _setup(ctx, inputs, output):
    _, packed, scale, offsets = inputs
    ctx.x_dtype = inputs[0].dtype
    ctx.save_for_backward(packed, scale, offsets)


def _backward(ctx, grad):
    packed, scale, offsets = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.transformers_k3.mxfp4_grouped_mm_backward.default(grad.contiguous(), packed, scale, offsets)
        grad_x = grad_x.to(ctx.x_dtype)
    return grad_x, None, None, None


def register() -> None:
    """The operators' fake implementations and the forward's autograd formula (gradient with respect to the rows;
    the packed weights are frozen). Their PyTorch implementations for other devices are registered with the
    others' (`reference.OPERATORS`)."""
    ns = "transformers_k3::"

    @torch.library.register_fake(ns + "mxfp4_grouped_mm")
    def _(x, packed, scale, offsets):
        return x.new_empty((x.shape[0], packed.shape[1]))

    @torch.library.register_fake(ns + "mxfp4_grouped_mm_backward")
    def _(grad, packed, scale, offsets):
        return grad.new_empty((grad.shape[0], packed.shape[2] * 2))

    torch.library.register_autograd(ns + "mxfp4_grouped_mm", _backward, setup_context=_setup)
