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

from typing import NamedTuple

import torch
import torch.nn.functional as F

SUPPORTED_HIDDEN_ACTS = ("situ", "silu")

# SGLang is inconsistent when `activation_situ_beta` is None: its dense MLP uses 1.0, its Triton MoE
# path 4.0 (spec 6.1). K3 always sets 4.0, so the choice never matters for the real model; we pick one
# value, 1.0, for every FFN so that the dense, shared and routed experts share a single activation.
SITU_BETA_WHEN_NONE = 1.0


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 for the half-precision model dtypes; float64 stays float64 (gradcheck).
    return torch.promote_types(dtype, torch.float32)


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


def _check_hidden_act(config) -> str:
    hidden_act = getattr(config, "hidden_act", None)
    if hidden_act not in SUPPORTED_HIDDEN_ACTS:
        raise ValueError(
            f"hidden_act={hidden_act!r} is not supported by Kimi K3 FFNs; expected one of {SUPPORTED_HIDDEN_ACTS}."
        )
    return hidden_act


class GLU(NamedTuple):
    """The FFNs' gated linear unit: ``kind`` "situ" (`situ_glu` with caps ``beta`` / ``linear_beta``; None: the up
    half uncapped) or "silu" (``silu(a) * u`` in the input dtype, bit for bit transformers' Kimi Linear). Plain
    values, so the fused CPU kernels take it as is."""

    kind: str
    beta: float = 4.0
    linear_beta: float | None = 25.0

    @classmethod
    def from_config(cls, config) -> GLU:
        """``config.hidden_act`` with ``activation_situ_beta`` (None -> `SITU_BETA_WHEN_NONE`) and
        ``activation_situ_linear_beta``."""
        if _check_hidden_act(config) == "silu":
            return cls("silu", 1.0, None)
        beta = getattr(config, "activation_situ_beta", None)
        linear_beta = getattr(config, "activation_situ_linear_beta", None)
        return cls("situ", SITU_BETA_WHEN_NONE if beta is None else float(beta),
                   None if linear_beta is None else float(linear_beta))  # fmt: skip

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        return situ_glu(gate, up, self.beta, self.linear_beta)

    def packed(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The GLU of a packed ``gate_up [..., 2I]`` (gate half first), as the fused experts' GEMM produces it. SiTU
        in six element-wise ops instead of nine: both halves' ``tanh`` as one op over the packed tensor scaled by
        ``(1 / beta, 1 / linear_beta)``, the two caps one factor at the end; the same values up to fp32 rounding."""
        if gate_up.shape[-1] % 2:
            raise ValueError(f"gate_up's last dimension must be even (gate half, then up half), got {gate_up.shape[-1]}")
        if self.kind == "silu" or self.linear_beta is None:
            return self(*gate_up.chunk(2, dim=-1))
        beta, linear_beta = self.beta, self.linear_beta
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
