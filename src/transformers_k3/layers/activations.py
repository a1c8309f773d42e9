"""GLU activations of the K3 FFNs (spec section 6.1).

Every K3 FFN (the dense layer-0 MLP, the shared experts and the routed experts) computes
``down(act(gate(x), up(x)))`` where ``act`` is a gated linear unit of the gate half ``a`` and the up half
``u``. K3 uses SiTU ("SoftCap-GLU"), a SiLU-GLU whose two halves are soft-capped with ``tanh``:

    SiTU(a, u) = [beta * tanh(a / beta) * sigmoid(a)] * [linear_beta * tanh(u / linear_beta)]

The caps keep every FFN activation inside ``(-beta * linear_beta, beta * linear_beta)`` (100 for K3),
which is what lets the routed experts ship in MXFP4. ``hidden_act="silu"`` selects the plain SiLU-GLU
``silu(a) * u`` of the Kimi-Linear lineage.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

GLUFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

SUPPORTED_HIDDEN_ACTS = ("situ", "silu")

# SGLang is inconsistent when `activation_situ_beta` is None: its dense MLP uses 1.0, its Triton MoE
# path 4.0 (spec 6.1). K3 always sets 4.0, so the choice never matters for the real model; we pick one
# value, 1.0, for every FFN so that the dense, shared and routed experts share a single activation.
SITU_BETA_WHEN_NONE = 1.0


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 for the half-precision model dtypes; float64 stays float64 (gradcheck).
    return torch.promote_types(dtype, torch.float32)


def situ_gate(gate: torch.Tensor, beta: float = 4.0) -> torch.Tensor:
    """The gate half of SiTU alone, ``beta * tanh(a / beta) * sigmoid(a)``, in fp32, cast back.

    A soft-capped SiLU: it equals ``silu(a)`` to first order for small ``|a|`` and is bounded by ``beta``.
    """
    a = gate.to(_compute_dtype(gate.dtype))
    return (beta * torch.tanh(a / beta) * torch.sigmoid(a)).to(gate.dtype)


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0
) -> torch.Tensor:
    """SiTU-GLU of the gate pre-activation ``gate`` and the up pre-activation ``up``.

    Computed in fp32 (as SGLang does; float64 inputs stay float64) and cast back to the inputs' dtype.
    ``linear_beta=None`` leaves the up half uncapped. Both factors are products of bounded functions (tanh, sigmoid) of finite or
    infinite inputs, so huge or infinite activations give finite outputs and finite gradients; the only
    NaN source is ``linear_beta=None`` with an infinite ``up`` times a gate factor of exactly 0.
    """
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    a = gate.to(_compute_dtype(out_dtype))
    u = up.to(_compute_dtype(out_dtype))
    gate_factor = beta * torch.tanh(a / beta) * torch.sigmoid(a)
    up_factor = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (gate_factor * up_factor).to(out_dtype)


def situ_glu_packed(gate_up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """`situ_glu` of a packed ``gate_up [..., 2I]`` (gate half first), as an expert's fused ``gate_up_proj``
    produces it: ``situ_glu(*gate_up.chunk(2, -1), beta, linear_beta)`` in six element-wise ops instead of nine.
    Both halves' ``tanh`` run as one op over the packed tensor scaled by ``(1 / beta, 1 / linear_beta)`` and
    the two caps are applied as one factor ``beta * linear_beta`` at the end; without autograd the last
    products run in place. The same values up to fp32 rounding (a reciprocal multiply instead of a division), in
    fewer passes over the routed experts' activations. ``linear_beta=None`` falls back to `situ_glu`."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate half, then up half), got {gate_up.shape[-1]}")
    if linear_beta is None:
        return situ_glu(*gate_up.chunk(2, dim=-1), beta=beta, linear_beta=None)
    out_dtype = gate_up.dtype
    x = gate_up.to(_compute_dtype(out_dtype))
    half = x.shape[-1] // 2
    scale = x.new_empty(2, half)
    scale[0], scale[1] = 1.0 / beta, 1.0 / linear_beta
    tanhs = torch.tanh(x * scale.view(-1))
    gate_t, up_t = tanhs[..., :half], tanhs[..., half:]
    if torch.is_grad_enabled() and gate_up.requires_grad:
        out = torch.sigmoid(x[..., :half]) * gate_t * up_t * (beta * linear_beta)
    else:
        out = torch.sigmoid(x[..., :half]).mul_(gate_t).mul_(up_t).mul_(beta * linear_beta)
    return out.to(out_dtype)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU-GLU ``silu(a) * u`` in the input dtype (no fp32 round trip), exactly as transformers' Kimi
    Linear computes it, so that `hidden_act="silu"` checkpoints match it bit for bit."""
    return F.silu(gate) * up


def _situ_betas(config) -> tuple[float, float | None]:
    beta = getattr(config, "activation_situ_beta", None)
    linear_beta = getattr(config, "activation_situ_linear_beta", None)
    return (SITU_BETA_WHEN_NONE if beta is None else float(beta)), (
        None if linear_beta is None else float(linear_beta)
    )


def _check_hidden_act(config) -> str:
    hidden_act = getattr(config, "hidden_act", None)
    if hidden_act not in SUPPORTED_HIDDEN_ACTS:
        raise ValueError(
            f"hidden_act={hidden_act!r} is not supported by Kimi K3 FFNs; expected one of {SUPPORTED_HIDDEN_ACTS}."
        )
    return hidden_act


def get_glu_fn(config) -> GLUFn:
    """The GLU ``(gate, up) -> out`` selected by ``config.hidden_act`` ("situ" or "silu").

    For "situ" the caps come from ``config.activation_situ_beta`` (None -> ``SITU_BETA_WHEN_NONE``) and
    ``config.activation_situ_linear_beta`` (None -> the up half is not capped).
    """
    if _check_hidden_act(config) == "silu":
        return silu_glu
    beta, linear_beta = _situ_betas(config)
    return functools.partial(situ_glu, beta=beta, linear_beta=linear_beta)


def get_packed_glu_fn(config) -> Callable[[torch.Tensor], torch.Tensor]:
    """The GLU of a packed ``[..., 2I]`` gate/up tensor (gate half first), as the fused experts produce it:
    `situ_glu_packed` for "situ", ``silu(gate) * up`` of the two halves for "silu" (bitwise transformers')."""
    if _check_hidden_act(config) == "silu":
        return _silu_glu_packed
    beta, linear_beta = _situ_betas(config)
    return functools.partial(situ_glu_packed, beta=beta, linear_beta=linear_beta)


def glu_spec(config) -> tuple:
    """The configured GLU as plain values for the fused CPU experts kernel: ``("silu",)`` or
    ``("situ", beta, linear_beta)`` (``linear_beta`` None: the up half is not capped)."""
    if _check_hidden_act(config) == "silu":
        return ("silu",)
    return ("situ", *_situ_betas(config))


def _silu_glu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_glu(*gate_up.chunk(2, dim=-1))


def get_gate_act_fn(config) -> Callable[[torch.Tensor], torch.Tensor]:
    """The element-wise activation of the gate half alone (``silu`` or the SiTU gate factor).

    Only for code that insists on an ``act_fn`` (transformers' experts interface keeps one). Note that
    ``act_fn(a) * u`` is *not* SiTU when ``activation_situ_linear_beta`` is set, because the up half is
    capped too: use `get_glu_fn` for the FFN itself.
    """
    if _check_hidden_act(config) == "silu":
        return F.silu
    beta, _ = _situ_betas(config)
    return functools.partial(situ_gate, beta=beta)
