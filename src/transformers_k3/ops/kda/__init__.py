"""Kimi Delta Attention, split as fla splits ``fla/ops/kda``: :mod:`.interface` (the entry points), :mod:`.chunk` and
:mod:`.fused_recurrent` (the PyTorch algorithms), :mod:`.layout` (packed sequences), :mod:`.gate` (the forget gate),
:mod:`.naive` (the reference) and :mod:`.autograd` (the differentiable CPU operator)."""

from .gate import kda_gate
from .interface import RECURRENT_MAX_TOKENS, TORCH_CHUNK_SIZE, chunk_kda, fused_recurrent_kda

__all__ = ["RECURRENT_MAX_TOKENS", "TORCH_CHUNK_SIZE", "chunk_kda", "fused_recurrent_kda", "kda_gate"]
