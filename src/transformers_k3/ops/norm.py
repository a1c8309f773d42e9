"""RMSNorm as one call (`rms_norm`, PyTorch), and its fused CPU kernel `attach_rms_norm` attaches: the same bits
forward, one kernel pass per row backward (`cpu_kernel.rms_norm`)."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernel


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * w`` in fp32, rounded to the input dtype once."""
    # (F.rms_norm without a weight: bitwise the three-op form transformers' norms write, tested; one call)
    normed = F.rms_norm(hidden_states.to(torch.float32), (hidden_states.shape[-1],), eps=eps)
    return (normed * weight.to(torch.float32)).to(hidden_states.dtype)


def attach_rms_norm(norm: nn.Module) -> Callable | None:
    """The norm's kernel: ``(hidden_states, weight, eps) -> out`` under autograd on fp32 CPU tensors, else None."""
    return cpu_kernel.rms_norm
