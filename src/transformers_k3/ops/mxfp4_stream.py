"""Routed experts whose packed MXFP4 bytes are read per step, only for the experts the tokens chose (issue 46,
docs/mxfp4.md "Streaming the experts from disk"): `streamed_mxfp4_experts` computes what `mxfp4.mxfp4_experts`
computes, with the layer's stacks replaced by a ``read(experts) -> stacks`` callable that returns at most
``per_read`` experts' stacks at a time.

The (token, slot) pairs are sorted by expert once, as `mxfp4.mxfp4_experts` sorts them; the routed experts, in
ascending order, are read ``per_read`` at a time, and since the sorted rows of consecutive routed experts are one
contiguous range, each read's experts are computed by the same two grouped products over that range and summed
into the same fp32 output in the same order. So the result is the fully loaded layer's, bit for bit, when one read
holds every routed expert, and to fp32 rounding of the products' sums otherwise (docs/mxfp4.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .mxfp4 import packed_grouped_mm

__all__ = ["streamed_mxfp4_experts"]


# file reads planned from host-read offsets: a compiled model breaks its graph here and calls this eagerly
@torch.compiler.disable
def streamed_mxfp4_experts(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
    read: Callable[[list[int]], tuple[torch.Tensor, ...]], per_read: int,
    glu: Callable[[torch.Tensor], torch.Tensor], kernel: bool = True,
    gate_up_delta: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    down_delta: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``out [N, D]`` in ``hidden_states``' dtype, as `mxfp4.mxfp4_experts` with the layer's ``num_experts``
    experts; ``read(experts)`` (ascending ids, at most ``per_read``) returns their ``(gate_up_packed,
    gate_up_scale, down_packed, down_scale)`` stacks, on any device (moved to the activations'). Ids outside
    ``[0, num_experts)`` contribute nothing and are never read. Gradients reach ``hidden_states`` and
    ``top_k_weights`` (``read`` must then return stacks no later read overwrites). ``gate_up_delta`` /
    ``down_delta``: as for `mxfp4.mxfp4_experts`, called per read on that read's rows with offsets over all
    ``num_experts`` (the experts of other reads given no rows)."""
    num_tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    ids = torch.where((ids < 0) | (ids >= num_experts), num_experts, ids)  # (out-of-range ids sort last, unread)
    perm = torch.sort(ids, stable=True).indices
    counts = ids.new_zeros(num_experts + 1).scatter_add_(0, ids, torch.ones_like(ids))[:num_experts]
    offsets = counts.cumsum(0)
    token_ids = perm // top_k
    weights = top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    out = torch.zeros(num_tokens, hidden_states.shape[-1], dtype=torch.float32, device=hidden_states.device)
    routed = counts.nonzero().flatten()
    ends, sizes = offsets.tolist(), counts.tolist()  # (one host read: the read plan)
    for chunk in routed.split(per_read):
        experts = chunk.tolist()
        first, last = ends[experts[0]] - sizes[experts[0]], ends[experts[-1]]
        stacks = [s.to(hidden_states.device) for s in read(experts)]
        local = offsets.index_select(0, chunk) - first
        tokens = token_ids[first:last]
        rows = hidden_states.index_select(0, tokens)
        every = (offsets - first).clamp(0, last - first)  # (each expert's end row within this read's rows)
        gate_up = packed_grouped_mm(rows, stacks[0], stacks[1], local, kernel)
        if gate_up_delta is not None:
            gate_up = gate_up + gate_up_delta(rows, every)
        routed_rows = glu(gate_up) * weights[first:last]
        expert_out = packed_grouped_mm(routed_rows, stacks[2], stacks[3], local, kernel)
        if down_delta is not None:
            expert_out = expert_out + down_delta(routed_rows, every)
        out.index_add_(0, tokens, expert_out.float())
    return out.to(hidden_states.dtype)
