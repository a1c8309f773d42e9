"""RMSNorm as one call: the fused CPU kernel where it applies (`cpu_kernel.rms_norm`: fp32 under autograd, one
kernel pass per row backward), the PyTorch formula everywhere else; the two give the same bits forward."""

import torch
import torch.nn.functional as F

from . import cpu_kernel


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * w`` in fp32, rounded to the input dtype once."""
    fused = cpu_kernel.rms_norm(hidden_states, weight, eps)
    if fused is not None:
        return fused
    # ``x * rsqrt(mean(x^2) + eps)`` in fp32 as one op (F.rms_norm without a weight: bitwise the three-op form
    # ``x.pow(2).mean(-1)``, ``+ eps``, ``x * rsqrt(.)`` that transformers' norms write, tested; one call where
    # those take five, whose call overhead is most of a decode step's norm)
    normed = F.rms_norm(hidden_states.to(torch.float32), (hidden_states.shape[-1],), eps=eps)
    return (normed * weight.to(torch.float32)).to(hidden_states.dtype)
