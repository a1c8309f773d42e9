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
from transformers.integrations import use_experts_implementation

from ..ops import moe as moe_ops
from ..ops.experts import K3_GROUPED_MM  # noqa: F401  (the name configs select; registered there)
from ..ops.kernel_layers import kernel_layer
from ..ops.torch_internals import recording
from .activations import GLU
from .norm import KimiK3RMSNorm


@kernel_layer("k3_mlp")
class KimiK3MLP(nn.Module):
    """``down(glu(gate(x), up(x)))`` with the configured GLU (SiTU for K3).

    The dense layer-0 FFN (width ``intermediate_size``) and the fused shared experts (width
    ``num_shared_experts * moe_intermediate_size``). Its kernel (`kernelize`): SiTU in one CPU kernel call.
    """

    def __init__(self, config, intermediate_size: int | None = None, hidden_size: int | None = None) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.glu = GLU.from_config(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(hidden_states), self.up_proj(hidden_states)
        act = None if self.kernel is None else self.kernel(gate, up)
        return self.down_proj(self.glu(gate, up) if act is None else act)


@kernel_layer("k3_router")
class KimiK3Router(nn.Module):
    """Sigmoid (or softmax) top-k router with a selection-only correction bias (spec 6.3, step 1).

    ``e_score_correction_bias`` is the aux-loss-free balancing bias: it shifts which experts are chosen
    but never the weight a chosen expert receives. Everything is computed in fp32. Its kernel (`kernelize`): the
    ungrouped top-k selection on CPU in the fused kernels (`moe_ops.router_select`). ``logits_observers``: how many
    readers of its logits (Quantile Balancing's hooks) are attached; while any is, no kernel skips the logits.
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
        # `router_fp32`: the checkpoint stores the router in fp32 (a bf16 load keeps it: the parameter is built
        # fp32). The logits are fp32 either way.
        self.weight_fp32 = bool(getattr(config, "router_fp32", False))
        weight_dtype = torch.float32 if self.weight_fp32 else None
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, dtype=weight_dtype))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        self.logits_observers = 0

    def forward(
        self, hidden_states: torch.Tensor, need_logits: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """``hidden_states [..., H]`` -> ``(router_logits [N, E] fp32, topk_weights [N, k] fp32,
        topk_indices [N, k] int64)`` with ``N`` the number of tokens.

        ``need_logits=False`` (the MoE layer's call): the caller uses only the selection, so with the kernel
        attached and nothing else reading the logits (``logits_observers``, transformers' ``output_router_logits``
        recording), an fp32 router on a CPU with the AMX tile unit, given at least `moe_ops.SCREEN_MIN_TOKENS`
        tokens, selects without the ``[N, E]`` fp32 GEMM (the same selection and scores as from fp32 logits) and
        returns None in place of the logits."""
        hidden_states = hidden_states.reshape(-1, self.hidden_size)
        kernel = self.kernel
        screen = (
            kernel is not None and not need_logits and hidden_states.shape[0] >= moe_ops.SCREEN_MIN_TOKENS
            and not self.logits_observers and not recording("router_logits")
        )  # fmt: skip
        router_logits, selected, topk_indices = (kernel or moe_ops.router_select)(
            hidden_states, self.weight, self.e_score_correction_bias, self.top_k, self.use_softmax,
            self.num_expert_group, self._keep_best_groups, screen=screen,
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


@kernel_layer("k3_experts")
@use_experts_implementation
class KimiK3Experts(nn.Module):
    """The routed experts as fused 3-D weights (transformers' experts interface layout).

    ``gate_up_proj [E, 2I, D]`` holds each expert's gate rows (checkpoint ``w1``) then its up rows
    (``w3``), not interleaved; ``down_proj [E, D, I]`` is ``w2``. ``D`` is the latent width
    ``routed_expert_hidden_size`` for the latent MoE, else ``hidden_size``.
    ``config._experts_implementation`` selects this eager forward, transformers' "grouped_mm" / "batched_mm" or
    our "k3_grouped_mm" (`ops.experts`); all of them apply the GLU through `_apply_gate`.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        latent = config.routed_expert_hidden_size
        self.hidden_dim = config.hidden_size if latent is None else latent
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.glu = GLU.from_config(config)
        self.register_load_state_dict_pre_hook(_fuse_per_expert_weights)

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        return self.glu.packed(gate_up_out)

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


@kernel_layer("k3_sparse_moe")
class KimiK3SparseMoE(nn.Module):
    """The FFN of every MoE layer: router + routed experts (in the latent space when
    ``routed_expert_hidden_size`` is set) + full-width shared experts (spec 6.3).

    Returns only the FFN output; the router logits are recorded by the model from ``self.gate``. Its kernel
    (`kernelize`): a decode step on CPU, the whole layer in one call (`moe_ops.moe_decode`).
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
        out = None if self.kernel is None else self.kernel(y)
        if out is None:
            out = self._modules_forward(y)
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
