"""Block Attention Residuals (K3_SPEC.md section 3).

K3 has no ``h = h + f(norm(h))`` residual. Each sublayer reads a softmax mixture over a bank of
block snapshots of the residual stream plus the running partial sum of the current block; the
mixing scores come from a per-sublayer pseudo-query ``w`` dotted with each RMS-normalised candidate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def attn_res_scores(candidates: Sequence[torch.Tensor], query: torch.Tensor, key_norm: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """Softmax mixing weights ``[m, *batch]`` (fp32) of ``m`` candidates ``[*batch, H]``.

    ``s_j = sum_d r_jd / sqrt(mean_d r_j^2 + eps) * n_d * w_d``, softmax over ``j``. Only ``n * w``
    matters, so it is formed once instead of normalising every candidate with ``n`` first.
    """
    nw = key_norm.float() * query.float().reshape(-1)
    scores = []
    for r in candidates:
        r = r.float()
        inv_rms = torch.rsqrt(r.pow(2).mean(-1) + eps)
        scores.append((r @ nw) * inv_rms)
    return torch.stack(scores, dim=0).softmax(dim=0)


def attn_res_mix(candidates: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """``sum_j alpha_j r_j`` accumulated in fp32 over the un-normalised candidates, cast to their dtype."""
    out = candidates[0].float() * weights[0].unsqueeze(-1)
    for r, a in zip(candidates[1:], weights[1:]):
        out = out + r.float() * a.unsqueeze(-1)
    return out.to(candidates[0].dtype)


# A read whose candidates hold at most this many elements in all (a decode step's: m x batch x H) is computed on
# them stacked into one [m, *batch, H] fp32 tensor: ~9 ops in all where the loops above take ~8 per candidate, each
# a few microseconds at this size (the shipped small model's bf16 decode step: 12 reads of 2-7 candidates).
# Larger reads loop over the candidates, so that no stacked copy of a long prefill's residual stream is made.
STACKED_MAX_ELEMENTS = 1 << 16


def attn_res_read_stacked(candidates: Sequence[torch.Tensor], query: torch.Tensor, key_norm: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attn_res_scores` and `attn_res_mix` of the same read, computed on the stacked candidates: the same fp32
    quantities (the sums over H and over the candidates in another order)."""
    nw = key_norm.float() * query.float().reshape(-1)
    stacked = torch.stack(list(candidates)).float()
    weights = ((stacked @ nw) * torch.rsqrt(stacked.pow(2).mean(-1) + eps)).softmax(dim=0)
    return (stacked * weights.unsqueeze(-1)).sum(0).to(candidates[0].dtype), weights


class KimiK3AttnResRead(nn.Module):
    """One AttnRes read point. It holds no weights (the checkpoint keeps ``*_res_proj``/``*_res_norm`` on
    the decoder layer under their official names); it exists so that transformers' output recorders can
    capture the pre-norm mixture (``output_hidden_states``) and the depth weights
    (``output_attn_res_weights``) at every read.

    Returns ``(mix, weights)`` with ``weights`` of shape ``[num_candidates, batch, seq]``.
    """

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, candidates: Sequence[torch.Tensor], query: torch.Tensor | None = None,
                key_norm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if len(candidates) == 1:
            # A single candidate has weight 1 (the first layer, or AttnRes switched off): no work.
            only = candidates[0]
            return only, only.new_ones(1, *only.shape[:-1], dtype=torch.float32)
        if sum(r.numel() for r in candidates) <= STACKED_MAX_ELEMENTS:
            return attn_res_read_stacked(candidates, query, key_norm, self.eps)
        weights = attn_res_scores(candidates, query, key_norm, self.eps)
        return attn_res_mix(candidates, weights), weights


__all__ = ["KimiK3AttnResRead", "attn_res_mix", "attn_res_read_stacked", "attn_res_scores"]
