"""The routed experts, one function per backend: `eager_experts` (eager PyTorch: `KimiK3Experts`' own forward and
the experts operators' implementation on other devices) and transformers' experts interface functions
(`ALL_EXPERTS_FUNCTIONS`):
``"k3_grouped_mm"`` (`k3_grouped_mm_experts_forward`): the PyTorch grouped GEMMs (`torch_grouped_experts`) on any
device, or the experts' attached kernel (`kernelize`); ``"k3_cpu_kernel"`` (`cpu_kernel_experts_forward`): the fused
CPU experts kernel (`cpu_kernel.moe_experts`) on the tensors it takes, else `torch_grouped_experts`. Each takes the
experts module as transformers' experts functions do (``self``: its weights, ``glu`` and settings)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from . import cpu_kernel
from .torch_internals import grouped_mm

K3_GROUPED_MM = "k3_grouped_mm"
K3_CPU_KERNEL = "k3_cpu_kernel"
# `k3_grouped_mm` gathers each (token, expert) assignment's weights instead of running the grouped GEMM while
# assignments x weights per expert <= this many elements x the number of experts (see `_gathered_experts`).
# A CPU cost model from bench measurements (bench/RESULTS.md): the grouped GEMM pays a fixed cost per expert, hit
# or not, the gather one per copied weight element; the rule keeps a safety factor of about 2.
GATHER_MAX_ELEMENTS_PER_EXPERT = 6144


def _grouped_gemm(inputs: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """transformers' grouped GEMM; off the CPU its kernel takes bf16 only (an fp32 model on a GPU raised
    "Expected inputs of BF16 type"), so other dtypes there take transformers' per-expert fallback."""
    if weight.device.type != "cpu" and weight.dtype != torch.bfloat16:
        return torch.ops.transformers.grouped_mm_fallback(inputs.to(weight.dtype), weight, offs=offsets)
    return grouped_mm(inputs, weight, offsets)


def k3_grouped_mm_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The ``"k3_grouped_mm"`` experts implementation: transformers' ``"grouped_mm"`` (the same grouped-GEMM
    kernel dispatch) with less data movement around the two GEMMs, registered in transformers'
    `ALL_EXPERTS_FUNCTIONS` so that ``experts_implementation="k3_grouped_mm"`` selects it.

    The (token, slot) pairs are sorted by expert, the token rows gathered once (``index_select``) and the two
    grouped GEMMs run over the contiguous per-expert segments. The routing weight multiplies the ``I``-wide GLU
    output instead of the ``D``-wide expert output, and the expert outputs are summed straight into their tokens
    with ``index_add_`` (in fp32), so no ``[N * k, D]`` tensor is reordered, weighted or kept for backward:
    faster than "grouped_mm" and about half its forward memory at K3's routing scale (bench/bench_moe.py), where
    the two GEMMs themselves take most of the time. Plain autograd: gradients reach the inputs, the routing
    weights and both expert tensors. Under expert parallelism, sentinel ids (``>= num_experts``, zero weight) are
    dropped after the sort, which costs one host sync; otherwise the function is free of data-dependent shapes.
    With the experts' kernel attached (`kernelize`: `cpu_kernel_experts_forward`), that kernel computes the call.
    """
    if self.has_bias or not self.has_gate or self.has_post_expert_norm:
        raise NotImplementedError(f"{K3_GROUPED_MM!r} supports gated experts without biases or post-expert norms")
    _weights(self, K3_GROUPED_MM)
    kernel = getattr(self, "kernel", None)  # (another experts class may call this function)
    if kernel is not None:
        return kernel(self, hidden_states, top_k_index, top_k_weights)
    return torch_grouped_experts(self, hidden_states, top_k_index, top_k_weights, getattr(self, "_is_expert_parallel", False))


def _weights(self: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up_proj, down_proj)``, or a named error for experts that hold none (packed MXFP4)."""
    try:
        return self.gate_up_proj, self.down_proj
    except AttributeError:  # (packed MXFP4 experts hold uint8 stacks instead)
        raise NotImplementedError(f"{name!r} computes on gate_up_proj / down_proj weights, which "
                                  f"{type(self).__name__} does not hold: packed MXFP4 experts run with "
                                  "experts_implementation='k3_mxfp4'") from None


def cpu_kernel_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
    small_gemm: bool | None = None,
) -> torch.Tensor:
    """The ``"k3_cpu_kernel"`` experts implementation, and the experts' kernel `kernelize` attaches: the fused CPU
    experts kernel (`cpu_kernel.moe_experts`, forward and backward; ``small_gemm`` as there) on the tensors it
    takes, else `torch_grouped_experts` (the same function)."""
    if self.has_bias or not self.has_gate or self.has_post_expert_norm:
        raise NotImplementedError(f"{K3_CPU_KERNEL!r} supports gated experts without biases or post-expert norms")
    gate_up_proj, down_proj = _weights(self, K3_CPU_KERNEL)
    expert_parallel = getattr(self, "_is_expert_parallel", False)
    if not expert_parallel and cpu_kernel.experts_applies(hidden_states, top_k_weights, gate_up_proj, down_proj):
        out = cpu_kernel.moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                     self.is_transposed, self.glu, small_gemm=small_gemm)  # fmt: skip
        if out is not None:
            return out
    return torch_grouped_experts(self, hidden_states, top_k_index, top_k_weights, expert_parallel)


def eager_experts(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor, apply_gate: Callable[[torch.Tensor], torch.Tensor], products: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts in eager PyTorch: `KimiK3Experts`' own forward, and the experts operators' PyTorch
    implementation on devices without a kernel (`reference`). ``hidden_states [N, D]``, ``top_k_index [N, k]``,
    ``top_k_weights [N, k]``, ``gate_up_proj [E, 2I, D]``, ``down_proj [E, D, I]`` (views are fine) -> ``[N, D]``:
    ``out[t] = sum_j top_k_weights[t, j] * down_e(apply_gate(gate_up_e(hidden_states[t])))``, ``e = top_k_index[t,
    j]``; ids outside ``[0, E)`` (expert-parallel sentinels, zero weight) contribute nothing. ``products [N k, 2I]``
    receives each (token, slot)'s ``gate_up_e`` row, token-major."""
    num_tokens, top_k = top_k_index.shape
    num_experts, hidden_dim = gate_up_proj.shape[0], down_proj.shape[1]
    expert_ids = top_k_index.reshape(-1)
    expert_ids = expert_ids.masked_fill(expert_ids < 0, num_experts)  # (every id outside [0, E) sorts last)

    # Sort the (token, slot) pairs by expert so that each hit expert reads one contiguous slice.
    sorted_ids, perm = torch.sort(expert_ids, stable=True)
    routed_states = hidden_states[perm // top_k]
    counts = torch.bincount(sorted_ids, minlength=num_experts)[:num_experts].tolist()  # one sync
    num_valid = sum(counts)
    counts.append(expert_ids.numel() - num_valid)

    # `split` / `unbind` rather than slicing and indexing: their backward assembles one gradient for the
    # whole tensor, where a slice or `weight[e]` per expert would each materialise a full-size gradient.
    chunks = routed_states.split(counts)
    gate_up, down = gate_up_proj.unbind(0), down_proj.unbind(0)
    outputs, projected = [], []
    for expert, count in enumerate(counts[:-1]):
        if count > 0:
            projected.append(F.linear(chunks[expert], gate_up[expert]))
            outputs.append(F.linear(apply_gate(projected[-1]), down[expert]))
    if products is not None and projected:
        products[perm[:num_valid]] = torch.cat(projected).detach().to(products.dtype)
    if counts[-1] > 0 or not outputs:
        outputs.append(routed_states.new_zeros(counts[-1], hidden_dim))
    expert_out = torch.cat(outputs)

    # Weights are fp32, so the weighted sum over the k slots accumulates in fp32 (as the grouped_mm / batched_mm
    # paths do).
    weighted = expert_out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    unsorted = torch.empty_like(weighted).index_copy_(0, perm, weighted)
    return unsorted.view(num_tokens, top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def attach_experts(experts: nn.Module):
    """The routed experts' kernel (`kernelize`): `cpu_kernel_experts_forward`, read by ``"k3_grouped_mm"``."""
    return cpu_kernel_experts_forward


def torch_grouped_experts(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    expert_parallel: bool, gather_max_elements: float = GATHER_MAX_ELEMENTS_PER_EXPERT,
) -> torch.Tensor:
    """`k3_grouped_mm` in PyTorch: gathered weights for few assignments (assignments x weights per expert at most
    ``gather_max_elements`` x the number of experts), else the sorted grouped GEMMs."""
    num_tokens, top_k = top_k_index.shape
    per_expert = self.gate_up_proj[0].numel() + self.down_proj[0].numel()
    if num_tokens * top_k * per_expert <= gather_max_elements * self.num_experts and not expert_parallel:
        return _gathered_experts(self, hidden_states, top_k_index, top_k_weights)
    sorted_ids, perm = torch.sort(top_k_index.reshape(-1))
    # histc, not bincount: a static output shape, so torch.compile traces the step without a graph break. CPU's
    # histc wants floats (exact for expert ids < 2**24). Ids >= num_experts fall outside the bins.
    histc_input = sorted_ids.float() if sorted_ids.device.type in ("cpu", "mps") else sorted_ids.int()
    counts = torch.histc(histc_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = counts.cumsum(0, dtype=torch.int32)
    if expert_parallel:
        perm = perm[: int(offsets[-1])]  # sentinel ids (other ranks' experts) sort last: drop them (a host sync)
    token_ids = perm // top_k

    gate_up_proj, down_proj = _in_out(self, self.gate_up_proj, self.down_proj)  # the kernel takes [E, in, out]
    gate_up = _grouped_gemm(hidden_states.index_select(0, token_ids), gate_up_proj, offsets)
    routing_weights = top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    expert_out = _grouped_gemm(self._apply_gate(gate_up) * routing_weights, down_proj, offsets)

    out = torch.zeros(num_tokens, expert_out.shape[-1], dtype=torch.float32, device=expert_out.device)
    return out.index_add_(0, token_ids, expert_out.float()).to(hidden_states.dtype)


def _gathered_experts(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """`k3_grouped_mm`'s path for few (token, expert) assignments, e.g. a decode step: each assignment's expert
    weights are gathered and the two products run as batched ``[1, D] x [D, 2I]`` / ``[1, I] x [I, D]``
    GEMMs. Its cost follows the assignments, while the grouped GEMM visits every expert, hit or not (on CPU
    most of a one-token layer's time at 896 experts). Assignments stay in token order, so the
    ``k`` outputs of a token are summed without a scatter. Static shapes (compile-friendly); plain autograd."""
    num_tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    gate_up_proj, down_proj = _in_out(self, self.gate_up_proj.index_select(0, ids), self.down_proj.index_select(0, ids))
    rows = hidden_states.unsqueeze(1).expand(num_tokens, top_k, hidden_states.shape[-1]).reshape(-1, 1, hidden_states.shape[-1])
    glu = self._apply_gate(torch.bmm(rows, gate_up_proj)) * top_k_weights.reshape(-1, 1, 1).to(rows.dtype)
    expert_out = torch.bmm(glu, down_proj).view(num_tokens, top_k, -1)
    return expert_out.float().sum(1).to(hidden_states.dtype)


def _in_out(self: nn.Module, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weight stacks (all experts or gathered ones) as ``[*, in, out]``: transposed views, no copy, unless
    the module already stores them that way (``is_transposed``)."""
    if self.is_transposed:
        return gate_up_proj, down_proj
    return gate_up_proj.transpose(1, 2), down_proj.transpose(1, 2)


ALL_EXPERTS_FUNCTIONS.register(K3_GROUPED_MM, k3_grouped_mm_experts_forward)
ALL_EXPERTS_FUNCTIONS.register(K3_CPU_KERNEL, cpu_kernel_experts_forward)
