"""The K3 feed-forward blocks: dense SiTU MLP, sigmoid router, experts and the Stable Latent MoE.

Spec sections 6.2 and 6.3. A MoE layer maps the FFN input ``y [T, H]`` to

    routed = up( RMSNorm( sum_{i in topk} w_i * E_i( down(y) ) ) )      (latent MoE)
    out    = routed + shared_experts(y)

The router decides on the full-width ``y``; the routed experts live in a narrower latent space
(``routed_expert_hidden_size``), and the latent RMSNorm is applied to the fully summed expert mixture,
which makes ``routed_scaling_factor`` cancel except through the norm's eps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.integrations import use_experts_implementation
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _grouped_mm

from ..ops import moe as moe_ops
from .activations import get_gate_act_fn, get_glu_fn, get_packed_glu_fn, glu_spec
from .casting import apply_keeping_fp32
from .norm import KimiK3RMSNorm


class KimiK3MLP(nn.Module):
    """``down(glu(gate(x), up(x)))`` with the configured GLU (SiTU for K3).

    The dense layer-0 FFN (width ``intermediate_size``) and the fused shared experts (width
    ``num_shared_experts * moe_intermediate_size``).
    """

    def __init__(self, config, intermediate_size: int | None = None, hidden_size: int | None = None) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.glu_fn = get_glu_fn(config)
        self.glu = glu_spec(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(hidden_states), self.up_proj(hidden_states)
        return self.down_proj(moe_ops.glu(gate, up, self.glu, self.glu_fn))  # (SiTU: one CPU kernel)


class KimiK3Router(nn.Module):
    """Sigmoid (or softmax) top-k router with a selection-only correction bias (spec 6.3, step 1).

    ``e_score_correction_bias`` is the aux-loss-free balancing bias: it shifts which experts are chosen
    but never the weight a chosen expert receives. Everything is computed in fp32. On CPU the ungrouped
    top-k selection runs in a fused kernel (the same ranking as ``torch.topk``, in descending order, ties to the
    lower expert id): for sigmoid scores `cpu_kernel.router_sigmoid_topk` computes them from the logits (bitwise
    ``torch.sigmoid``'s), selects and returns the chosen ones without writing ``[N, E]`` scores, otherwise
    `cpu_kernel.router_topk` selects from torch's scores; the chosen sigmoid scores' backward touches only the
    chosen logits (`cpu_kernel.selected_scores`). With the kernels off, ``torch.topk`` and dense autograd. Which
    path runs is decided in `moe_ops.router_select`.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.hidden_size = config.hidden_size
        self.use_softmax = config.moe_router_activation_func == "softmax"
        self.renormalize = config.moe_renormalize
        self.routed_scaling_factor = config.routed_scaling_factor
        self.num_expert_group = config.num_expert_group
        self.topk_group = config.topk_group
        # `router_fp32`: the checkpoint stores the router in fp32; the model must also keep it there when
        # it is cast to a lower dtype. The logits are fp32 either way.
        self.weight_fp32 = bool(getattr(config, "router_fp32", False))
        weight_dtype = torch.float32 if self.weight_fp32 else None
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, dtype=weight_dtype))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        """``model.to(torch.bfloat16)`` / ``.half()`` leave the selection bias (and, with ``router_fp32``, the
        weight) in fp32 with their values unchanged, as loading with ``dtype=`` does: Quantile Balancing's small
        updates would be rounded away in a bf16 bias. Device moves apply as usual."""
        names = ("e_score_correction_bias", "weight") if self.weight_fp32 else ("e_score_correction_bias",)
        return apply_keeping_fp32(self, lambda: super(KimiK3Router, self)._apply(fn, recurse), names.__contains__)

    def forward(
        self, hidden_states: torch.Tensor, need_logits: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """``hidden_states [..., H]`` -> ``(router_logits [N, E] fp32, topk_weights [N, k] fp32,
        topk_indices [N, k] int64)`` with ``N`` the number of tokens.

        ``need_logits=False`` (the MoE layer's call): the caller uses only the selection, so where nothing else
        observes this call's output (`moe_ops.logits_observed`: a forward hook, or transformers'
        ``output_router_logits`` recording), an fp32 router on a CPU with the AMX tile unit, given at least
        `moe_ops.SCREEN_MIN_TOKENS` tokens, selects without the ``[N, E]`` fp32 GEMM (`moe_ops.router_select`: the
        same selection and scores as from fp32 logits) and returns None in place of the logits."""
        hidden_states = hidden_states.reshape(-1, self.hidden_size)
        router_logits, selected, topk_indices = moe_ops.router_select(
            hidden_states, self.weight, self.e_score_correction_bias, self.top_k, self.use_softmax,
            self.num_expert_group, self._keep_best_groups, need_logits, self,
        )  # fmt: skip
        return router_logits, self._final_weights(selected), topk_indices

    def _final_weights(self, selected: torch.Tensor) -> torch.Tensor:
        """The chosen (unbiased) scores renormalized over the k and scaled."""
        if self.renormalize:
            selected = selected / (selected.sum(dim=-1, keepdim=True) + 1e-20)
        return selected * self.routed_scaling_factor

    def _keep_best_groups(self, scores_for_choice: torch.Tensor) -> torch.Tensor:
        """Group-limited routing: rank groups by the sum of their two best (biased) scores, keep the
        ``topk_group`` best groups and hide every expert of the other groups from the top-k."""
        num_tokens = scores_for_choice.shape[0]
        grouped = scores_for_choice.view(num_tokens, self.num_expert_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        kept_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, -1)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, "
            f"scoring={'softmax' if self.use_softmax else 'sigmoid'}, groups={self.num_expert_group}/{self.topk_group}"
        )


K3_GROUPED_MM = "k3_grouped_mm"
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
    return _grouped_mm(inputs, weight, offsets)


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
    """
    if self.has_bias or not self.has_gate or self.has_post_expert_norm:
        raise NotImplementedError(f"{K3_GROUPED_MM!r} supports gated experts without biases or post-expert norms")
    expert_parallel = getattr(self, "_is_expert_parallel", False)
    return moe_ops.experts(
        hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, self.is_transposed,
        getattr(self, "glu_activation", None), expert_parallel,
        lambda: _torch_grouped_experts(self, hidden_states, top_k_index, top_k_weights, expert_parallel),
    )  # fmt: skip


def _torch_grouped_experts(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    expert_parallel: bool,
) -> torch.Tensor:
    """`k3_grouped_mm` in PyTorch: gathered weights for few assignments, else the sorted grouped GEMMs."""
    num_tokens, top_k = top_k_index.shape
    per_expert = self.gate_up_proj[0].numel() + self.down_proj[0].numel()
    if num_tokens * top_k * per_expert <= GATHER_MAX_ELEMENTS_PER_EXPERT * self.num_experts and not expert_parallel:
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


def _fuse_per_expert_weights(module, state_dict, prefix, *args) -> None:
    """``load_state_dict`` pre-hook of `KimiK3Experts`: per-expert ``{e}.w1/w2/w3.weight`` (the official layout, which
    ``save_pretrained`` writes for a model built from a config) become ``gate_up_proj`` / ``down_proj``, as
    ``from_pretrained`` fuses them. transformers' Trainer restores checkpoints (``resume_from_checkpoint``,
    ``load_best_model_at_end``) with a plain ``load_state_dict``, which otherwise left the experts as they were
    (only a missing / unexpected keys warning)."""
    if f"{prefix}gate_up_proj" in state_dict or f"{prefix}down_proj" in state_dict:
        return
    n = module.num_experts
    if not any(f"{prefix}{e}.{w}.weight" in state_dict for e in range(n) for w in ("w1", "w2", "w3")):
        return
    names = [f"{prefix}{e}.{w}.weight" for e in range(n) for w in ("w1", "w2", "w3")]
    if not all(name in state_dict for name in names):
        # Part of the experts (a sharded checkpoint is loaded one shard per call, Trainer's resume): each block
        # goes into its slice of the fused weights now; load_state_dict then sees no unexpected keys for them.
        _copy_expert_blocks(module, state_dict, prefix)
        return
    w1, w2, w3 = ([state_dict.pop(f"{prefix}{e}.{w}.weight") for e in range(n)] for w in ("w1", "w2", "w3"))
    gate_up = torch.stack([torch.cat([g, u], dim=0) for g, u in zip(w1, w3)])  # [E, 2I, D]
    down = torch.stack(w2)  # [E, D, I]
    if getattr(module, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    state_dict[f"{prefix}gate_up_proj"], state_dict[f"{prefix}down_proj"] = gate_up, down


@torch.no_grad()
def _copy_expert_blocks(module, state_dict, prefix) -> None:
    inter = module.intermediate_dim
    transposed = getattr(module, "is_transposed", False)
    for e in range(module.num_experts):
        for proj in ("w1", "w2", "w3"):
            name = f"{prefix}{e}.{proj}.weight"
            if name not in state_dict:
                continue
            block = state_dict.pop(name)
            if proj == "w2":
                target = module.down_proj[e]
            else:
                rows = slice(0, inter) if proj == "w1" else slice(inter, 2 * inter)
                target = module.gate_up_proj[e][:, rows] if transposed else module.gate_up_proj[e][rows]
            block = block.t() if transposed else block
            if tuple(block.shape) != tuple(target.shape):
                raise RuntimeError(f"{name}: shape {tuple(block.shape)} does not fit the model's expert block "
                                   f"{tuple(target.shape)}")
            target.copy_(block)


@use_experts_implementation
class KimiK3Experts(nn.Module):
    """The routed experts as fused 3-D weights (transformers' experts interface layout).

    ``gate_up_proj [E, 2I, D]`` holds each expert's gate rows (checkpoint ``w1``) then its up rows
    (``w3``), not interleaved; ``down_proj [E, D, I]`` is ``w2``. ``D`` is the latent width
    ``routed_expert_hidden_size`` for the latent MoE, else ``hidden_size``.
    ``config._experts_implementation`` selects this eager forward, transformers' "grouped_mm" / "batched_mm" or
    our "k3_grouped_mm" (`k3_grouped_mm_experts_forward`); all of them apply the GLU through `_apply_gate`.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        latent = config.routed_expert_hidden_size
        self.hidden_dim = config.hidden_size if latent is None else latent
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.glu_fn = get_packed_glu_fn(config)  # of the packed gate/up GEMM output
        self.glu_activation = glu_spec(config)  # the same GLU for the fused CPU kernel (`cpu_kernel`)
        # Only the gate half's activation; kept because the experts interface expects an `act_fn`.
        # The gated paths never use it: they call `_apply_gate`, which also caps the up half.
        self.act_fn = get_gate_act_fn(config)
        self.register_load_state_dict_pre_hook(_fuse_per_expert_weights)

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        return self.glu_fn(gate_up_out)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``hidden_states [N, D]``, ``top_k_index [N, k]``, ``top_k_weights [N, k]`` -> ``[N, D]``:
        ``out[t] = sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t])``."""
        num_tokens, top_k = top_k_index.shape
        expert_ids = top_k_index.reshape(-1)

        # Sort the (token, slot) pairs by expert so that each hit expert reads one contiguous slice.
        sorted_ids, perm = torch.sort(expert_ids, stable=True)
        routed_states = hidden_states[perm // top_k]
        counts = torch.bincount(sorted_ids, minlength=self.num_experts)[: self.num_experts].tolist()  # one sync
        # Ids >= num_experts (expert-parallel sentinels, zero weight) sort last and contribute nothing.
        num_valid = sum(counts)
        counts.append(expert_ids.numel() - num_valid)

        # `split` / `unbind` rather than slicing and indexing: their backward assembles one gradient for the
        # whole tensor, where a slice or `weight[e]` per expert would each materialise a full-size gradient.
        chunks = routed_states.split(counts)
        gate_up_proj, down_proj = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        outputs = [
            F.linear(self._apply_gate(F.linear(chunks[expert], gate_up_proj[expert])), down_proj[expert])
            for expert, count in enumerate(counts[:-1])
            if count > 0
        ]
        if counts[-1] > 0 or not outputs:
            outputs.append(routed_states.new_zeros(counts[-1], self.hidden_dim))
        expert_out = torch.cat(outputs)

        # Weights are fp32, so the weighted sum over the k slots accumulates in fp32 (as the
        # grouped_mm / batched_mm paths do).
        weighted = expert_out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        unsorted = torch.empty_like(weighted).index_copy_(0, perm, weighted)
        return unsorted.view(num_tokens, top_k, self.hidden_dim).sum(dim=1).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}"


class KimiK3SparseMoE(nn.Module):
    """The FFN of every MoE layer: router + routed experts (in the latent space when
    ``routed_expert_hidden_size`` is set) + full-width shared experts (spec 6.3).

    Returns only the FFN output; the router logits are recorded by the model from ``self.gate``.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.gate = KimiK3Router(config)
        self.experts = KimiK3Experts(config)

        latent_size = config.routed_expert_hidden_size
        self.is_latent = latent_size is not None
        self.routed_expert_down_proj = None
        self.routed_expert_norm = None
        self.routed_expert_up_proj = None
        if self.is_latent:
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, latent_size, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = KimiK3RMSNorm(latent_size, eps=config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(latent_size, config.hidden_size, bias=False)

        self.shared_experts = None
        if config.num_shared_experts > 0:
            self.shared_experts = KimiK3MLP(
                config, intermediate_size=config.num_shared_experts * config.moe_intermediate_size
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states [B, T, H]`` or ``[N, H]`` -> same shape."""
        orig_shape = hidden_states.shape
        y = hidden_states.reshape(-1, self.hidden_size)
        # a decode step on CPU: the whole layer in one kernel call where it computes what the modules would
        out = moe_ops.sparse_moe(self, y, self._modules_forward)
        return out.view(*orig_shape)  # (unpacked: a torch.Size argument costs more to parse, every step)

    def _modules_forward(self, y: torch.Tensor) -> torch.Tensor:
        """The layer through its modules, ``y [N, H]`` -> ``[N, H]``."""
        _, topk_weights, topk_indices = self.gate(y, need_logits=False)  # decided on the full-width input
        z = self.routed_expert_down_proj(y) if self.is_latent else y
        routed = self.experts(z, topk_indices, topk_weights)
        if self.routed_expert_norm is not None:
            routed = self.routed_expert_norm(routed)  # on the fully summed latent
        if self.is_latent:
            routed = self.routed_expert_up_proj(routed)

        if self.shared_experts is not None:
            routed = routed + self.shared_experts(y)
        return routed


def router_aux_loss(
    router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    routers: list[KimiK3Router],
    batch_size: int = 1,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise auxiliary balance loss, averaged over the MoE layers (off by default in
    K3, which balances with the selection bias instead; see `transformers_k3.balancing`).

    For one layer and one sequence of ``T`` (unpadded) tokens, with ``s`` the router scores, ``E`` experts
    and top-``k`` selection made exactly as the router does (biased scores, `e_score_correction_bias`)::

        f_e = E / (k T) * #{t : e selected at t}        (load relative to perfect balance; no gradient)
        P_e = 1/T * sum_t s_{t,e} / sum_j s_{t,j}         (mean normalised score; carries the gradient)
        L   = sum_e f_e P_e                               (= 1 when the load is perfectly even)

    ``router_logits``: one ``[batch_size * seq, E]`` tensor per MoE layer, in the order of ``routers`` (as
    recorded with ``output_router_logits=True``). ``attention_mask [batch, seq]``: padding is left out.
    Returns the mean over layers and sequences (a scalar with gradient to the router weights).
    """
    if len(router_logits) != len(routers):
        raise ValueError(f"got router logits for {len(router_logits)} MoE layers but {len(routers)} routers")
    losses = []
    for logits, router in zip(router_logits, routers):
        logits = logits.float().reshape(batch_size, -1, router.num_experts)
        scores = logits.softmax(dim=-1) if router.use_softmax else logits.sigmoid()
        chosen = torch.topk(scores.detach() + router.e_score_correction_bias.float(), router.top_k, dim=-1).indices
        mask = (
            torch.ones(scores.shape[:2], device=scores.device)
            if attention_mask is None
            else attention_mask[:, -scores.shape[1] :].to(scores.device, torch.float32)
        )
        tokens = mask.sum(dim=1)  # [B]
        picks = torch.zeros_like(scores).scatter_(-1, chosen, 1.0)  # [B, T, E]
        f = (picks * mask[..., None]).sum(dim=1) * router.num_experts / (router.top_k * tokens.clamp_min(1))[:, None]
        p = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        P = (p * mask[..., None]).sum(dim=1) / tokens.clamp_min(1)[:, None]
        per_sequence = (f * P).sum(dim=-1)  # [B]
        has_tokens = tokens > 0
        losses.append(per_sequence[has_tokens].mean() if has_tokens.any() else per_sequence.sum() * 0)
    return torch.stack(losses).mean()


@torch.no_grad()
def init_moe_weights(module: nn.Module, std: float) -> bool:
    """Initialise the MoE parameters that are not plain `nn.Linear`s (router weight and bias, fused
    expert weights) the way transformers' Kimi Linear does: normal(0, std), zero bias. Returns whether
    ``module`` was one of them. Respects transformers' ``_is_hf_initialized`` flags (loaded weights)."""
    if isinstance(module, KimiK3Router):
        init.normal_(module.weight, mean=0.0, std=std)
        init.zeros_(module.e_score_correction_bias)
        return True
    if isinstance(module, KimiK3Experts):
        init.normal_(module.gate_up_proj, mean=0.0, std=std)
        init.normal_(module.down_proj, mean=0.0, std=std)
        return True
    return False


# The plain modules the fused decode step computes, handed to ops (which never import layers).
moe_ops.register_plain_modules(KimiK3Router, KimiK3Experts, KimiK3RMSNorm, KimiK3MLP, K3_GROUPED_MM)
