"""RMS norms used across the text stack."""

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.kernel_layers import kernel_layer
from ..ops.norm import rms_norm


@kernel_layer("k3_rms_norm")
class KimiK3RMSNorm(nn.Module):
    """Weighted RMSNorm ``x * rsqrt(mean(x^2) + eps) * w`` computed in fp32 and rounded to the input dtype once, as
    the reference K3 implementation (SGLang's RMSNorm, native and CUDA kernel alike) computes it. transformers'
    Llama / Kimi Linear norms round the normalised value to bf16 before multiplying by the weight, which rounds
    again (1 ulp apart on about a quarter of the values of a bf16 model); in fp32 the two are the same bits. Its
    kernel (`kernelize`): an fp32 backward in one pass per row on CPU, the same forward bits."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = None if self.kernel is None else self.kernel(hidden_states, self.weight, self.variance_epsilon)
        return rms_norm(hidden_states, self.weight, self.variance_epsilon) if out is None else out

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class KimiK3GatedRMSNorm(nn.Module):
    """Per-head RMSNorm followed by a sigmoid gate, all in fp32: ``rmsnorm(x) * w * sigmoid(gate)``.
    Used on the KDA core output (spec section 4.7)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        # (the normalisation as one F.rms_norm call, bitwise the three-op form: see KimiK3RMSNorm)
        hidden_states = F.rms_norm(hidden_states.to(torch.float32), (hidden_states.shape[-1],),
                                   eps=self.variance_epsilon)
        hidden_states = self.weight.to(torch.float32) * hidden_states * torch.sigmoid(gate.to(torch.float32))
        return hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
