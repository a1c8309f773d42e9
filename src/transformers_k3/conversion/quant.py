"""Quantised weight formats of K3 checkpoints (K3_SPEC.md section 10), dequantised exactly.

MXFP4 (the official release, routed experts only; compressed-tensors "mxfp4-pack-quantized"):
  * ``weight_packed`` uint8 ``[N, K/2]``: two E2M1 codes per byte, the **low nibble is the even index**;
  * ``weight_scale``  uint8 ``[N, K/32]`` (or ``[N, 1, K/32, 1]``): E8M0 exponents, one per group of 32
    consecutive input channels;
  * ``W[n, k] = E2M1(code) * 2^(scale[n, k // 32] - 127)``.
Every such value is exactly representable in bf16 (and fp32), so dequantisation is exact.

FP8 block (third-party "FP8_PB_WO" variants): ``W[i, j] = Wq[i, j] * S[i // 128, j // 128]`` with e4m3
``Wq`` and an fp32 scale per 128x128 block (multiplicative despite the ``weight_scale_inv`` name).

Nothing here imports the model; the functions are plain tensor maps.
"""

from __future__ import annotations

import torch

from ..configuration_kimi_k3 import MXFP4_GROUP_SIZE

# E2M1 magnitudes for codes 0..7; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
E8M0_NAN = 255
FP8_BLOCK = 128


class QuantFormatError(ValueError):
    """A quantised tensor does not have the layout its format requires."""


def _e2m1_table(device=None) -> torch.Tensor:
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])  # codes 8..15 are the negatives (-0.0 for code 8)


def mxfp4_scale_2d(scale: torch.Tensor) -> torch.Tensor:
    """``[N, G]`` view of an E8M0 scale stored as ``[N, G]`` or ``[N, 1, G, 1]`` (some exporters)."""
    if scale.dim() == 4 and scale.shape[1] == 1 and scale.shape[3] == 1:
        return scale[:, 0, :, 0]
    if scale.dim() != 2:
        raise QuantFormatError(f"MXFP4 weight_scale must be [N, K/32] or [N, 1, K/32, 1], got {list(scale.shape)}")
    return scale


def check_mxfp4_shapes(packed_shape, scale_shape, weight_shape=None) -> tuple[int, int]:
    """Validates a (packed, scale) pair and returns the dequantised ``(N, K)``; raises `QuantFormatError`."""
    packed_shape, scale_shape = list(packed_shape), list(scale_shape)
    if len(scale_shape) == 4 and scale_shape[1] == 1 and scale_shape[3] == 1:
        scale_shape = [scale_shape[0], scale_shape[2]]
    if len(packed_shape) != 2 or len(scale_shape) != 2:
        raise QuantFormatError(f"MXFP4 expects a 2-D weight_packed and weight_scale, got {packed_shape} and {scale_shape}")
    rows, k = packed_shape[0], packed_shape[1] * 2
    if k % MXFP4_GROUP_SIZE:
        raise QuantFormatError(f"MXFP4 input width {k} (weight_packed {packed_shape}) is not a multiple of 32")
    if scale_shape != [rows, k // MXFP4_GROUP_SIZE]:
        raise QuantFormatError(
            f"MXFP4 weight_scale has shape {scale_shape}; weight_packed {packed_shape} needs [{rows}, {k // 32}]"
        )
    if weight_shape is not None and [int(x) for x in weight_shape] != [rows, k]:
        raise QuantFormatError(f"MXFP4 weight_shape says {list(weight_shape)}, the packed data holds [{rows}, {k}]")
    return rows, k


def _as_uint8(t: torch.Tensor, what: str) -> torch.Tensor:
    """The codes as uint8. transformers' loader may already have cast the uint8 checkpoint tensor to the
    parameter's float dtype (exact: every integer 0..255 is representable in bf16/fp16/fp32); undo that."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype == getattr(torch, "float8_e8m0fnu", None):
        return t.view(torch.uint8)  # E8M0 stored with its own dtype: the bits are the exponent code
    if t.is_floating_point() or t.dtype in (torch.int16, torch.int32, torch.int64):
        as_int = t.to(torch.int64)
        if t.is_floating_point() and not torch.equal(as_int.to(t.dtype), t):
            raise QuantFormatError(f"MXFP4 {what} holds non-integer values; it is not a uint8 code tensor")
        if as_int.numel() and (int(as_int.min()) < 0 or int(as_int.max()) > 255):
            raise QuantFormatError(f"MXFP4 {what} holds values outside 0..255")
        return as_int.to(torch.uint8)
    raise QuantFormatError(f"MXFP4 {what} must be uint8, got {t.dtype}")


def check_mxfp4_values(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    """Raises `QuantFormatError` unless every weight the pair dequantises to is finite in ``dtype``: no scale is 255
    (E8M0's NaN), and no group's largest code times its scale reaches ``dtype``'s overflow (scale 254 is 2^127:
    a code of 2 or more gives 2^128 = inf in fp32 and bf16; fp16 overflows from 2^16). Reads the codes'
    magnitudes per group only; every reader of MXFP4 data (load, convert, copy, export) calls it."""
    packed = _as_uint8(packed, "weight_packed")
    scale = _as_uint8(mxfp4_scale_2d(scale), "weight_scale")
    rows, k = check_mxfp4_shapes(packed.shape, scale.shape)
    if not scale.numel():
        return
    nan = scale == E8M0_NAN
    if bool(nan.any()):
        row, group = nan.nonzero()[0].tolist()
        raise QuantFormatError(f"MXFP4 weight_scale[{row}, {group}] is 255, E8M0's NaN encoding: the file is corrupt; "
                               "re-download or re-export it")
    magnitude = torch.maximum(packed & 0x07, (packed >> 4) & 0x07)  # sign bit dropped
    largest = magnitude.reshape(rows, k // MXFP4_GROUP_SIZE, MXFP4_GROUP_SIZE // 2).amax(dim=-1)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=packed.device)
    values = torch.ldexp(table[largest.long()], (scale.to(torch.int32) - E8M0_BIAS).to(torch.float64))
    over = values > torch.finfo(dtype).max
    if bool(over.any()):
        row, group = over.nonzero()[0].tolist()
        code = int(scale[row, group])
        raise QuantFormatError(
            f"MXFP4 weight_scale[{row}, {group}] = {code} (2^{code - E8M0_BIAS}) scales a code of "
            f"{E2M1_VALUES[int(largest[row, group])]} to {float(values[row, group]):.3g}, beyond "
            f"{str(dtype).replace('torch.', '')} (max {torch.finfo(dtype).max:.3g}): the weights would be infinite and "
            "every output NaN; the file is corrupt: re-download or re-export it")


def check_finite_weight(weight: torch.Tensor, what: str) -> torch.Tensor:
    """``weight`` itself, or `QuantFormatError` when a dequantised value is NaN or infinite (a scale out of range)."""
    bad = ~torch.isfinite(weight)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise QuantFormatError(f"{what} gives {float(weight[tuple(where)])!r} at {where}: a scale is out of range; the "
                               "file is corrupt: re-download or re-export it")
    return weight


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     finite_in: torch.dtype | None = None) -> torch.Tensor:
    """``weight_packed [N, K/2]`` + ``weight_scale [N, K/32]`` -> ``[N, K]`` in ``dtype``, computed in fp32
    (exact for bf16/fp32 outputs). Refuses (`check_mxfp4_values`) scales that make a weight non-finite in
    ``finite_in`` (default ``dtype``: the dtype the weights end up in)."""
    packed = _as_uint8(packed, "weight_packed")
    scale = _as_uint8(mxfp4_scale_2d(scale), "weight_scale")
    rows, k = check_mxfp4_shapes(packed.shape, scale.shape)
    check_mxfp4_values(packed, scale, finite_in or dtype)
    low = packed & 0x0F
    high = packed >> 4
    codes = torch.stack((low, high), dim=-1).reshape(rows, k)  # low nibble = even index
    values = _e2m1_table(packed.device)[codes.long()]
    exponents = (scale.to(torch.int32) - E8M0_BIAS).repeat_interleave(MXFP4_GROUP_SIZE, dim=1)
    return torch.ldexp(values, exponents.to(torch.float32)).to(dtype)


def _mxfp4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 ``[N, K]``, its 32-groups ``[N, K/32, 32]``, each group's largest magnitude) of an MXFP4 input."""
    if weight.dim() != 2 or weight.shape[1] % MXFP4_GROUP_SIZE:
        raise QuantFormatError(f"MXFP4 quantisation needs [N, K] with K a multiple of 32, got {list(weight.shape)}")
    w = weight.detach().to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise QuantFormatError("cannot quantise non-finite values to MXFP4")
    groups = w.reshape(w.shape[0], w.shape[1] // MXFP4_GROUP_SIZE, MXFP4_GROUP_SIZE)
    return w, groups, groups.abs().amax(dim=-1)


def _pack_nibbles(codes: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    codes = codes.reshape(rows, k)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def _e8m0(exp: torch.Tensor) -> torch.Tensor:
    return (exp + E8M0_BIAS).to(torch.uint8).contiguous()


def _release_exponents(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' scale exponents (``generate_mx_scales``): ``amax`` rounded to a power of two on its bit
    pattern (adding half of the mantissa bit below E2M1's one mantissa bit, fp32 ``1 << 21``), ``log2`` of that
    minus 2, clamped at the smallest E8M0 exponent. A subnormal ``amax`` masks to 0 there (``log2`` = -inf), so
    its group gets the smallest scale like an all-zero group. A group whose ``amax`` rounds up past the largest
    fp32 power of two (>= 1.75 * 2^127) has no finite scale by that rule (compressed-tensors writes an invalid one
    for it), so it is refused."""
    bits = amax.view(torch.int32)
    rounded = ((bits + (1 << 21)) & ~((1 << 23) - 1)).view(torch.float32)
    if bool(torch.isinf(rounded).any()):
        raise QuantFormatError(
            f"a 32-group's largest magnitude {float(amax.max())!r} is >= 1.75 * 2^127: compressed-tensors' MXFP4 "
            "scale rule overflows for it (no finite E8M0 scale), so it cannot be quantised to the release format")
    _, f = torch.frexp(rounded)  # rounded = 0.5 * 2^f, so log2(rounded) = f - 1
    exp = (f.to(torch.int32) - 1) - 2
    return torch.where(rounded > 0, exp, torch.full_like(exp, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)


def quantize_mxfp4(weight: torch.Tensor, exact: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> ``(weight_packed uint8 [N, K/2], weight_scale uint8 [N, K/32])``.

    Each 32-group gets the smallest power-of-two scale that brings its largest magnitude to <= 6; values
    are then rounded to the nearest E2M1 code (ties to the smaller magnitude). With ``exact=True`` (the default)
    a value that is not exactly representable raises instead of being rounded: this is the quantiser
    the tests use to build official-format fixtures, and for such inputs ``dequantize_mxfp4`` returns
    the input bit for bit.
    """
    w, groups, amax = _mxfp4_groups(weight)
    rows, k = w.shape
    # smallest e with amax / 2^e <= 6: amax/6 = m * 2^f with m in [0.5, 1), so e = f, or f - 1 when m = 0.5
    mant, exp = torch.frexp(amax / 6.0)
    exp = torch.where(mant == 0.5, exp - 1, exp).to(torch.int32)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -E8M0_BIAS))  # all-zero groups: smallest scale
    exp = exp.clamp(-E8M0_BIAS, E8M0_NAN - 1 - E8M0_BIAS)
    scaled = torch.ldexp(groups, (-exp).to(torch.float32).unsqueeze(-1))
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    magnitude = scaled.abs()
    best = (magnitude.unsqueeze(-1) - table).abs().argmin(dim=-1)  # nearest; ties go to the smaller magnitude
    codes = best.to(torch.uint8)
    if exact and not torch.equal(table[best], magnitude):
        bad = (table[best] != magnitude).nonzero()[0].tolist()
        row, group, lane = bad
        raise QuantFormatError(
            f"value {float(w[row, group * 32 + lane])!r} at [{row}, {group * 32 + lane}] is not exactly representable "
            "in MXFP4 with its group's scale (pass exact=False to round)"
        )
    codes = codes | ((scaled < 0) | ((scaled == 0) & torch.signbit(scaled))).to(torch.uint8) << 3
    return _pack_nibbles(codes, rows, k), _e8m0(exp)


def quantize_mxfp4_release(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> ``(weight_packed uint8 [N, K/2], weight_scale uint8 [N, K/32])`` by compressed-tensors'
    ``mxfp4-pack-quantized`` rule (``generate_mx_scales`` + its FP4 cast and pack; checked byte for byte against
    compressed-tensors 0.20.1 in modeling_tests/test_mxfp4_reference.py), for any finite weights:

    * per 32-group, ``amax`` is rounded to a power of two on its bit pattern (up when its mantissa is >= 1.75,
      else down), and the E8M0 exponent is ``127 + log2(that) - 2``, clamped at 0 (a subnormal ``amax`` counts
      as 0, as there); an ``amax`` >= 1.75 * 2^127 has no finite scale by this rule and raises `QuantFormatError`;
    * each value divided by ``2^(code - 127)`` is rounded to the nearest E2M1 value, **ties to even**
      (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating at +-6; low nibble = even column;
    * the sign bit is the input's, ``-0.0`` included. (compressed-tensors writes +0 for an exact ``-0.0`` input,
      though -0 for a negative that rounds to zero; keeping it makes a release's -0 codes round-trip.)

    For weights dequantised from MXFP4 (unchanged since loading) this returns the original bytes: such a
    group's largest magnitude is 4 or 6 times its scale (the only outcomes of this rule), which gives back
    the same exponent, and every value is then exact. (An all-zero group gets code 0.)"""
    w, groups, amax = _mxfp4_groups(weight)
    rows, k = w.shape
    exp = _release_exponents(amax)
    scaled = torch.ldexp(groups, (-exp).to(torch.float32).unsqueeze(-1))
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    magnitude = scaled.abs().clamp(max=table[-1])
    hi = torch.searchsorted(table, magnitude.contiguous()).clamp(max=len(E2M1_VALUES) - 1)
    lo = (hi - 1).clamp(min=0)
    d_hi, d_lo = table[hi] - magnitude, magnitude - table[lo]
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    codes = torch.where(take_hi, hi, lo).to(torch.uint8)
    codes = codes | (torch.signbit(scaled).to(torch.uint8) << 3)
    return _pack_nibbles(codes, rows, k), _e8m0(exp)



def mxfp4_release_scale(weight: torch.Tensor) -> torch.Tensor:
    """The ``weight_scale`` `quantize_mxfp4_release` returns, without computing the packed values."""
    return _e8m0(_release_exponents(_mxfp4_groups(weight)[2]))


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK),
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Block-scaled FP8 ``[N, K]`` (e4m3 or e5m2) with fp32 scales ``[ceil(N/bn), ceil(K/bk)]`` -> ``dtype``.
    The last block row/column may be partial (e.g. KDA ``b_proj`` with 96 < 128 rows)."""
    if weight.dim() != 2:
        raise QuantFormatError(f"FP8 block dequantisation needs a 2-D weight, got {list(weight.shape)}")
    rows, cols = weight.shape
    bn, bk = block
    want = [-(-rows // bn), -(-cols // bk)]
    if scale.dim() == 0 or scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(*want)
    if list(scale.shape) != want:
        raise QuantFormatError(f"FP8 block scale has shape {list(scale.shape)}; weight {[rows, cols]} needs {want}")
    full = scale.to(torch.float32).repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]
    return check_finite_weight((weight.to(torch.float32) * full).to(dtype), "FP8 weight times its block scale")


FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                     "float8_e5m2fnuz") if hasattr(torch, name))
FP8_SCALE_MISSING = "FP8 weight without a `weight_scale_inv`/`weight_scale` next to it"


def fp8_scale_name(name: str, names) -> str | None:
    """The scale stored next to the FP8 weight ``name`` (``….weight_scale_inv`` or ``….weight_scale``) if ``names``
    holds one."""
    stem = name[: -len("weight")]
    return next((stem + kind for kind in ("weight_scale_inv", "weight_scale") if stem + kind in names), None)


def fp8_weights_without_scale(dtypes) -> list[str]:
    """The FP8 ``….weight`` tensors of ``{name: dtype}`` with no scale next to them: read unscaled they are off by
    their scale (448 where 0.299 belongs), so every reader refuses them."""
    return [name for name, dtype in dtypes.items()
            if dtype in FP8_DTYPES and name.endswith(".weight") and fp8_scale_name(name, dtypes) is None]


__all__ = [
    "E2M1_VALUES",
    "FP8_DTYPES",
    "FP8_SCALE_MISSING",
    "QuantFormatError",
    "check_finite_weight",
    "check_mxfp4_shapes",
    "check_mxfp4_values",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "fp8_scale_name",
    "fp8_weights_without_scale",
    "mxfp4_release_scale",
    "mxfp4_scale_2d",
    "quantize_mxfp4",
    "quantize_mxfp4_release",
]
