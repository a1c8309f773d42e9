"""The MoE block's operations, each deciding here whether its fused CPU kernel (`cpu_kernel`) runs.

`transformers_k3.layers.moe` calls one function per operation: the SiTU GLU, the router's logits and top-k
selection, the routed experts and the whole layer's decode step. Each takes the tensors (the router: also itself,
for who observes its logits; the decode step: the layer, whose modules are checked here to be the plain ones),
runs the kernel where it applies and otherwise computes the same thing with PyTorch, or with the torch path the
layer hands in where that path is the layer's own code (the grouped-GEMM experts, the modules' forward).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernel
from .linear import _any_global_hooks, plain_linears, unhooked

try:  # transformers' output recording (`output_router_logits`): which outputs the running forward collects
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # (then any hook on a router counts as reading its logits)
    _active_collector = None

# The fp32 router screens its selection (`cpu_kernel.router_screened_topk`) from this many tokens: below, the fp32
# GEMM of a few rows is cheaper than the screen's fixed costs, mostly rounding and packing the weight for the tile
# unit on each call (timings: bench/RESULTS.md).
SCREEN_MIN_TOKENS = 256


def glu(gate: torch.Tensor, up: torch.Tensor, spec: tuple, glu_fn: Callable) -> torch.Tensor:
    """``glu_fn(gate, up)``; SiTU on CPU in one kernel call where torch runs ~9 element-wise ops (~15 in the
    backward). SiLU stays torch's own, bit for bit Kimi Linear's."""
    act = cpu_kernel.glu(gate, up, spec) if spec[0] == "situ" else None
    return glu_fn(gate, up) if act is None else act


def router_select(
    hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, use_softmax: bool,
    num_expert_group: int, keep_best_groups: Callable, need_logits: bool, router: nn.Module,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``hidden_states [N, H]`` -> ``(router_logits [N, E] fp32 or None, selected [N, k] fp32 unbiased scores,
    topk_indices [N, k] int64)``, the top-k of the biased scores (``keep_best_groups`` hides the other groups'
    experts when ``num_expert_group > 1``).

    Where the logits are not needed (``need_logits=False`` and nothing else reads the logits of ``router``, the
    calling module: `logits_observed`), an ungrouped sigmoid router on at least `SCREEN_MIN_TOKENS` tokens tries
    the screened selection (`cpu_kernel.router_screened_topk`: the same selection and scores as from fp32 logits,
    without the ``[N, E]`` GEMM) and returns None in place of the logits. Otherwise the fp32 logits
    (`router_logits`), then for ungrouped routing the kernels' top-k: sigmoid scores computed, selected and
    returned by `cpu_kernel.router_sigmoid_topk` (no ``[N, E]`` scores), other scores selected by
    `cpu_kernel.router_topk`; with sigmoid scores under autograd the chosen scores' backward touches only the
    chosen logits (`cpu_kernel.selected_scores`). With the kernels off, ``torch.topk`` and dense autograd."""
    if (
        not need_logits and hidden_states.shape[0] >= SCREEN_MIN_TOKENS and not use_softmax
        and num_expert_group == 1 and not logits_observed(router)
    ):  # fmt: skip
        chosen = cpu_kernel.router_screened_topk(hidden_states, weight, bias, top_k)
        if chosen is not None:
            topk_indices, selected = chosen
            if torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad):
                selected = cpu_kernel.selected_scores(hidden_states, weight, topk_indices, selected)
            return None, selected, topk_indices
    router_logits = _router_logits(hidden_states, weight)
    bias = bias.float()
    # CPU kernels (ungrouped routing): the top-k selection, and for sigmoid scores under autograd a backward
    # through the N k chosen logits only (the dense logits keep their own graph for auxiliary losses)
    fused = num_expert_group == 1 and cpu_kernel.applies(router_logits, bias, differentiable=True)
    sparse_backward = fused and not use_softmax and router_logits.requires_grad
    # sigmoid scores: the kernel computes them, selects and returns the chosen ones (no [N, E] scores)
    chosen = None
    if fused and not use_softmax:
        chosen = cpu_kernel.router_sigmoid_topk(router_logits, bias, top_k)
    if chosen is not None:
        topk_indices, selected = chosen
    else:
        logits = router_logits.detach() if sparse_backward else router_logits
        scores = logits.softmax(dim=-1) if use_softmax else logits.sigmoid()
        topk_indices = cpu_kernel.router_topk(scores, bias, top_k) if fused else None  # (no gradient)
        if topk_indices is None:
            if sparse_backward:  # the kernel could not run after all: autograd through the dense scores
                scores, sparse_backward = router_logits.sigmoid(), False
            scores_for_choice = scores + bias
            if num_expert_group > 1:
                scores_for_choice = keep_best_groups(scores_for_choice)
            topk_indices = torch.topk(scores_for_choice, top_k, dim=-1, sorted=False).indices
        selected = scores.gather(1, topk_indices)  # unbiased scores

    if sparse_backward:
        h, w = hidden_states.float(), weight.float()
        selected = cpu_kernel.selected_scores(h, w, topk_indices, selected)
    return router_logits, selected, topk_indices


def _router_logits(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fp32 router logits ``hidden_states @ weight.T``."""
    # a bf16 model on CPU: the same fp32 logits from the bf16 operands in a kernel (exact products, fp32 sums;
    # the AMX tile unit for prefill), where torch would run an fp32 GEMM on upcast copies of both, the
    # weight's made anew each call
    router_logits = cpu_kernel.linear_bf16_f32(hidden_states, weight)
    if (
        router_logits is None and hidden_states.device.type in ("cuda", "meta")
        and hidden_states.dtype == weight.dtype and weight.dtype in (torch.bfloat16, torch.float16)
        and not (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))
    ):  # fmt: skip
        # the same fp32 logits from the half-precision operands (fp32 accumulation) without an fp32 copy of
        # the [E, H] weight at every call (meta: its shapes)
        router_logits = torch.mm(hidden_states, weight.t(), out_dtype=torch.float32)
    if router_logits is None:
        router_logits = F.linear(hidden_states.float(), weight.float())
    return router_logits


def experts(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor, transposed: bool, activation: tuple | None, expert_parallel: bool,
    torch_path: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """The routed experts' weighted sum ``[N, D]``: `cpu_kernel.moe_experts` where it takes them (a known GLU
    ``activation``, no expert parallelism, `cpu_kernel.experts_applies`), otherwise ``torch_path()``."""
    if activation is not None and not expert_parallel and cpu_kernel.experts_applies(
        hidden_states, top_k_weights, gate_up_proj, down_proj
    ):
        out = cpu_kernel.moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                     transposed, activation)  # fmt: skip
        if out is not None:
            return out
    return torch_path()


def logits_observed(router: nn.Module) -> bool:
    """Whether something other than the MoE layer reads ``router``'s logits: a forward hook on it (Quantile
    Balancing's `RouterBalancer`, a user's), or transformers' output recording asked for ``router_logits`` (its
    hooks stay installed but are inactive otherwise)."""
    hooks = (*router._forward_hooks.values(), *getattr(nn.modules.module, "_global_forward_hooks", {}).values())
    recording = False
    for hook in hooks:
        if _active_collector is None or getattr(hook, "__name__", None) != "output_capturing_hook":
            return True
        recording = True
    if recording:
        collected = _active_collector.get()
        return collected is not None and "router_logits" in collected
    return False


def sparse_moe(
    layer: nn.Module, y: torch.Tensor, modules_forward: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The MoE layer ``layer`` (a `KimiK3SparseMoE`) on ``y [N, H]``: on CPU without autograd, for at most
    `cpu_kernel.moe_decode_max_tokens` tokens, in one kernel call (`cpu_kernel.MoeDecode`, `_decode_step`) where
    that is what its modules would compute (`plain_modules`); otherwise ``modules_forward(y)``."""
    if y.is_cpu and not torch.is_grad_enabled() and y.shape[0] <= cpu_kernel.moe_decode_max_tokens():
        out = _decode_step(y, layer)  # a decode step on CPU: the whole layer in one kernel call
        if out is not None:
            return out
    return modules_forward(y)


def plain_modules(layer: nn.Module) -> tuple | None:
    """``(gate, experts, down, norm, up, shared, linears)`` of the MoE layer ``layer`` (None for an optional one
    that is not there; ``linears``: the latent down / up and the shared expert's projections that are there) when
    nothing is around them, so that one kernel call computes what calling them would: each of its exact class with
    no hooks of its own (the router's forward hooks aside, when they do not read its logits: `logits_observed`)
    and no global ones, no replaced ``forward`` (accelerate's offload), the experts under ``"k3_grouped_mm"``,
    linear layers without bias; otherwise None (then the modules run: LoRA, quantized or offloaded layers, recorded
    router logits, another experts implementation). Read on every call, nothing kept."""
    if (
        _any_global_hooks()
        or layer._forward_pre_hooks or layer._forward_hooks or layer._backward_hooks or layer._backward_pre_hooks
    ):  # fmt: skip
        return None  # (hooks on the layer run around its forward, which calls this: a hook that replaces the
        # input or output still sees it; a backward hook asks for the modules' graph, which no_grad has not)
    router_type, experts_type, norm_type, mlp_type, grouped_mm = _layer_types()
    modules = layer._modules  # (an optional submodule set to None is not there)
    gate, experts, shared = modules["gate"], modules["experts"], modules.get("shared_experts")
    down, norm = modules.get("routed_expert_down_proj"), modules.get("routed_expert_norm")
    up = modules.get("routed_expert_up_proj")
    if (
        type(gate) is not router_type or type(experts) is not experts_type
        or (norm is not None and type(norm) is not norm_type)
        or (shared is not None and type(shared) is not mlp_type)
        or (down is None) != (up is None) or (norm is not None and down is None)
    ):  # fmt: skip
        return None
    linears = () if down is None else (down, up)
    if shared is not None:
        inner = shared._modules
        linears += (inner.get("gate_proj"), inner.get("up_proj"), inner.get("down_proj"))
    if not plain_linears(linears) or not unhooked((experts, norm, shared)):
        return None
    if (
        gate._forward_pre_hooks or gate._backward_hooks or gate._backward_pre_hooks or "forward" in gate.__dict__
        or logits_observed(gate) or _experts_implementation(experts) != grouped_mm
    ):  # fmt: skip
        return None  # (the experts and everything after the router: no hooks, no replaced forward)
    return gate, experts, down, norm, up, shared, linears


def register_plain_modules(router: type, experts: type, norm: type, mlp: type, experts_implementation: str) -> None:
    """The module classes the decode kernel computes (`KimiK3Router`, `KimiK3Experts`, `KimiK3RMSNorm`,
    `KimiK3MLP`) and the experts implementation it stands for, handed in by `transformers_k3.layers.moe` when it is
    imported (ops never import layers)."""
    _LAYER_TYPES[:] = (router, experts, norm, mlp, experts_implementation)


def _layer_types() -> tuple:
    return tuple(_LAYER_TYPES)


_LAYER_TYPES: list = []


def _experts_implementation(experts: nn.Module) -> str | None:
    """``experts.config._experts_implementation``, read from the instance (the property through transformers'
    config attribute machinery is slow, and runs on every decode step of every MoE layer)."""
    config = experts.config
    if torch.compiler.is_compiling():  # (a graph reads it once, as a guard; dynamo does not trace the read below)
        return getattr(config, "_experts_implementation", None)
    # (its __dict__ past the config class's own __getattribute__, which is slow on every read)
    value = object.__getattribute__(config, "__dict__").get("_experts_implementation_internal", _UNSET)
    return getattr(config, "_experts_implementation", None) if value is _UNSET else value


_UNSET = object()


def _decode_step(y: torch.Tensor, layer: nn.Module) -> torch.Tensor | None:
    """The layer in one kernel call (the modules' quantities, bf16 rounded where they round, the fp32 sums in
    another order; several times faster at decode, where the ~15 ops and calls of the modules cost nearly all of
    the time), or None where the kernel does not compute what the modules would: modules that are not the plain
    ones (`plain_modules`), autocast (the modules' linear layers compute in its dtype), settings the kernel does
    not take (transposed or biased experts, a softmax or grouped router, top-k above 16, expert parallelism,
    another GLU for the shared experts), weights that are not registered parameters or buffers (a parametrized
    weight, FSDP's views of its flat parameter). The modules' settings and weights are read on every call
    (nothing is kept between calls; under torch.compile these checks are the graph's guards)."""
    if torch.is_autocast_enabled("cpu"):
        return None
    modules = plain_modules(layer)
    if modules is None:
        return None
    gate, experts, down, norm, up, shared, linears = modules
    if (
        experts.is_transposed or (shared is not None and shared.glu != experts.glu_activation)
        or gate.use_softmax or gate.num_expert_group != 1 or gate.top_k > 16
        or getattr(experts, "_is_expert_parallel", False) or experts.has_bias or not experts.has_gate
        or experts.has_post_expert_norm
    ):  # fmt: skip
        return None
    # The weights as the modules hold them now (None for one that is not a registered parameter or buffer).
    weights = [m._parameters.get("weight") for m in linears]
    router, bias = gate._parameters.get("weight"), gate._buffers.get("e_score_correction_bias")
    gate_up, down_w = experts._parameters.get("gate_up_proj"), experts._parameters.get("down_proj")
    norm_w = None if norm is None else norm._parameters.get("weight")
    if router is None or bias is None or gate_up is None or down_w is None or (norm is not None and norm_w is None):
        return None
    for w in weights:  # (loops, not any(): this runs on every decode step of every MoE layer)
        if w is None:
            return None
    latent = down is not None
    kernel = cpu_kernel.MoeDecode(
        y.dtype, router, bias, gate.top_k, gate.renormalize, gate.routed_scaling_factor,
        weights[0] if latent else None, norm_w, 0.0 if norm is None else norm.variance_epsilon,
        weights[1] if latent else None, gate_up, down_w, experts.glu_activation,
        tuple(weights[-3:]) if shared is not None else None,
    )  # fmt: skip
    return kernel(y) if kernel.usable else None
