"""The MoE block's operations and their fused CPU kernels (`cpu_kernel`), attached by name.

`router_select` is the router's logits and top-k selection (the kernels' selection where ``fused``);
`attach_router`, `attach_mlp` and `attach_sparse_moe` are the attach functions `kernel_layers.kernelize` runs once
per module of those kinds: each returns the kernel forward the module calls (None: the module keeps its PyTorch
forward). What they check (exact module kinds, no hooks, settings the kernel takes) is read there, not per step;
a later change of the module tree detaches the kernel, a parameter registered anew is read again
(`kernel_layers`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from . import cpu_kernel
from .linear import KernelLinear, held_tensors
from .torch_internals import bare

# The fp32 router screens its selection (`cpu_kernel.router_screened_topk`) from this many tokens: below, the fp32
# GEMM of a few rows is cheaper than the screen's fixed costs (bench/RESULTS.md).
SCREEN_MIN_TOKENS = 256


def router_select(
    hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, use_softmax: bool,
    num_expert_group: int, keep_best_groups: Callable, fused: bool = False, screen: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``hidden_states [N, H]`` -> ``(router_logits [N, E] fp32 or None, selected [N, k] fp32 unbiased scores,
    topk_indices [N, k] int64)``, the top-k of the biased scores (``keep_best_groups`` hides the other groups'
    experts when ``num_expert_group > 1``).

    ``fused`` (the router's kernel is attached): ungrouped routing selects in the kernels (`router_sigmoid_topk`
    for sigmoid scores, `router_topk` otherwise; a sigmoid backward through the chosen logits only), and with
    ``screen`` (nobody reads the logits) an ungrouped sigmoid router on at least `SCREEN_MIN_TOKENS` tokens tries
    the screened selection (`cpu_kernel.router_screened_topk`, no ``[N, E]`` GEMM) and returns None in place of
    the logits. Otherwise ``torch.topk`` and dense autograd."""
    if screen and hidden_states.shape[0] >= SCREEN_MIN_TOKENS and not use_softmax and num_expert_group == 1:
        chosen = cpu_kernel.router_screened_topk(hidden_states, weight, bias, top_k)
        if chosen is not None:
            topk_indices, selected = chosen
            if torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad):
                selected = cpu_kernel.selected_scores(hidden_states, weight, topk_indices, selected)
            return None, selected, topk_indices
    router_logits = _router_logits(hidden_states, weight, fused)
    bias = bias.float()
    fused = fused and num_expert_group == 1 and cpu_kernel.applies(router_logits, bias, differentiable=True)
    sparse_backward = fused and not use_softmax and router_logits.requires_grad
    chosen = cpu_kernel.router_sigmoid_topk(router_logits, bias, top_k) if fused and not use_softmax else None
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
        selected = cpu_kernel.selected_scores(hidden_states.float(), weight.float(), topk_indices, selected)
    return router_logits, selected, topk_indices


def _router_logits(hidden_states: torch.Tensor, weight: torch.Tensor, fused: bool) -> torch.Tensor:
    """The fp32 router logits ``hidden_states @ weight.T``."""
    # bf16 on CPU with the kernel: exact products, fp32 sums, without fp32 copies of both operands
    router_logits = cpu_kernel.linear_bf16_f32(hidden_states, weight) if fused else None
    if (
        router_logits is None and hidden_states.device.type in ("cuda", "meta")
        and hidden_states.dtype == weight.dtype and weight.dtype in (torch.bfloat16, torch.float16)
        and not (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))
    ):  # fmt: skip
        # the same fp32 logits from the half-precision operands without an fp32 copy of the weight per call
        router_logits = torch.mm(hidden_states, weight.t(), out_dtype=torch.float32)
    if router_logits is None:
        router_logits = F.linear(hidden_states.float(), weight.float())
    return router_logits


def _kind(module: nn.Module | None) -> str | None:
    """The kernel-layer name ``module``'s exact class declares (a subclass, e.g. a parametrized one, declares none)."""
    return None if module is None else type(module).__dict__.get("k3_kernel_name")


def attach_router(router: nn.Module) -> Callable | None:
    """The router's kernel: `router_select` with the kernels' selection."""
    return functools.partial(router_select, fused=True)


def attach_mlp(mlp: nn.Module) -> Callable | None:
    """The dense MLP's (and shared experts') kernel: SiTU in one kernel call (``(gate, up) -> out`` or None)."""
    if mlp.glu.kind != "situ":
        return None  # (SiLU stays torch's own, bit for bit Kimi Linear's)
    return functools.partial(cpu_kernel.glu, activation=mlp.glu)


def attach_sparse_moe(layer: nn.Module) -> Callable | None:
    """The MoE layer's decode kernel (`MoeDecodeKernel`: the whole layer in one call on a few tokens without
    autograd), where its modules are the plain ones it computes: the exact router, experts (plain, or packed MXFP4:
    ``"k3_mxfp4_experts"``), latent norm and shared-expert classes, `KernelLinear` layers without bias, no hooks or
    replaced forwards, settings the kernel takes. None otherwise (LoRA, other quantized or offloaded modules,
    grouped or softmax routing, ...)."""
    gate, experts, shared = layer.gate, layer.experts, layer.shared_experts
    down, norm, up = layer.routed_expert_down_proj, layer.routed_expert_norm, layer.routed_expert_up_proj
    packed = _kind(experts) == "k3_mxfp4_experts"
    if (
        _kind(gate) != "k3_router" or (_kind(experts) != "k3_experts" and not packed)
        or (norm is not None and _kind(norm) != "k3_rms_norm") or (shared is not None and _kind(shared) != "k3_mlp")
        or (down is None) != (up is None) or (norm is not None and down is None)
    ):  # fmt: skip
        return None
    linears = () if down is None else (down, up)
    if shared is not None:
        linears += (shared.gate_proj, shared.up_proj, shared.down_proj)
    for m in (gate, experts, norm, shared, *linears):
        if m is not None and not bare(m):
            return None
    for m in linears:  # (kernelize made every plain nn.Linear without hooks a KernelLinear)
        if type(m) is not KernelLinear or m.bias is not None:
            return None
    if (
        (shared is not None and shared.glu != experts.glu)
        or gate.use_softmax or gate.num_expert_group != 1 or gate.top_k > 16
        or getattr(experts, "_is_expert_parallel", False)
    ):  # fmt: skip
        return None
    if not packed and (
        experts.is_transposed or experts.has_bias or not experts.has_gate or experts.has_post_expert_norm
    ):
        return None  # (packed experts are always gated, untransposed, without biases or a post-expert norm)
    return MoeDecodeKernel(gate, experts, norm, linears, down is not None, shared is not None, packed)


class MoeDecodeKernel:
    """The attached MoE layer on ``y [N, H]`` in one kernel call (`cpu_kernel.MoeDecode`), or None where the kernel
    does not compute what the modules would now: autograd, not CPU, more tokens than it takes, autocast, router
    logits read (``output_router_logits``, `KimiK3Router.logits_observers`), weights that are not registered
    parameters on CPU (parametrized, offloaded, plain tensor attributes).

    The router's, experts' and norm's parameters are read once after attaching or a change (`forget`: torch's
    parameter-registration hook, or an attribute deleted from a kernel layer); the linear layers' through their own
    `KernelLinear.tensors`; the selection bias and packed experts' stacks at every call, the only correct choice:
    ``Module._apply`` (``.to()``, ``.float()``) rebinds a buffer without firing any hook, so one held since attaching
    could go stale, and a parameter in its place would change what DDP broadcasts and what ``parameters()`` holds."""

    def __init__(self, gate, experts, norm, linears, latent: bool, has_shared: bool, packed: bool = False) -> None:
        self.layer_modules = (gate, experts, norm, linears, latent, has_shared, packed)
        self.weights = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "weights": None}  # (a copy reads its own modules' parameters, and watches them)

    def _read(self) -> tuple | bool:
        gate, experts, norm = self.layer_modules[:3]
        for m in (gate, experts, norm):
            if m is not None:
                _WATCHERS.setdefault(m, weakref.WeakSet()).add(self)
        packed = self.layer_modules[-1]
        weights = (gate.weight, None if packed else experts.gate_up_proj, None if packed else experts.down_proj,
                   None if norm is None else norm.weight)  # fmt: skip
        if not all(w is None or isinstance(w, nn.Parameter) for w in weights):
            return False
        return weights

    def __call__(self, y: torch.Tensor, output_router_logits: bool = False) -> torch.Tensor | None:
        if not y.is_cpu or torch.is_grad_enabled() or y.shape[0] > cpu_kernel.moe_decode_max_tokens():
            return None
        gate, experts, norm, linears, latent, has_shared, packed = self.layer_modules
        if output_router_logits or torch.is_autocast_enabled("cpu") or gate.logits_observers:
            return None
        if gate.use_softmax or gate.num_expert_group != 1 or gate.top_k > 16:  # (settings changed on a built layer)
            return None
        weights = self.weights
        if weights is None:
            weights = self.weights = self._read()
        if weights is False:
            return None
        router, gate_up, down_w, norm_w = weights
        scales = ()
        if packed:  # (the packed stacks: frozen uint8 parameters)
            gate_up, down_w = experts.gate_up_packed, experts.down_packed
            scales = (experts.gate_up_scale, experts.down_scale)
        linear_weights = []
        for m in linears:  # (a loop, not a comprehension: every decode step)
            tensors = m.tensors
            if tensors is None:
                tensors = held_tensors(m)
                if tensors is None:  # (plain tensor attributes)
                    return None
            linear_weights.append(tensors[0])
        kernel = cpu_kernel.MoeDecode(
            y.dtype, router, gate.e_score_correction_bias, gate.top_k, gate.renormalize, gate.routed_scaling_factor,
            linear_weights[0] if latent else None, norm_w, 0.0 if norm is None else norm.variance_epsilon,
            linear_weights[1] if latent else None, gate_up, down_w, experts.glu,
            tuple(linear_weights[-3:]) if has_shared else None, *scales,
        )  # fmt: skip
        return kernel(y) if kernel.usable else None


# module -> the decode kernels holding its parameters (`MoeDecodeKernel._read`)
_WATCHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forget(module: nn.Module, name: str | None = None, value=None) -> None:
    """torch's parameter-registration hook (and a kernel layer's attribute deletion, `kernel_layers`): the decode
    kernels holding ``module``'s parameters read them again at their next call."""
    kernels = _WATCHERS.get(module)
    if kernels:
        for kernel in list(kernels):
            kernel.weights = None


_HOOK = register_module_parameter_registration_hook(forget)
