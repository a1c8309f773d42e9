"""The KDA forget gate (spec section 4.4): the one place its formula is written."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["kda_gate"]


def kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """KDA forget gate (log-decay) from the raw gate projection ``g [..., H, K]``.

    With ``lower_bound`` (K3's "safe gate", ``lower_bound = -5``)::

        g = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h, i]))     # in (lower_bound, 0)

    (``exp(A_log)`` is dropped when ``A_log`` is None, as in fla). Without ``lower_bound`` (Kimi Linear)::

        g = -exp(A_log[h]) * softplus(g + dt_bias[h, i])                   # softplus threshold 20

    ``A_log`` has ``H`` elements (any shape) and ``dt_bias`` ``H * K``. fla 0.6.0's in-kernel gate
    (``fla/ops/kda/gate.py``) uses exactly these formulas. Computed in fp32 (float64 if ``g`` is float64); returns
    that dtype.
    """
    heads, key_dim = g.shape[-2:]
    dtype = torch.promote_types(g.dtype, torch.float32)
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(heads, key_dim)
    rate = A_log.to(dtype).reshape(heads, 1).exp() if A_log is not None else None
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(x if rate is None else rate * x)
    if rate is None:
        raise ValueError("kda_gate needs A_log when lower_bound is None (the gate is -exp(A_log) * softplus(...))")
    return -rate * F.softplus(x)
