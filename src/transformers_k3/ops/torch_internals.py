"""Every private torch / transformers API the MoE kernels and kernel attachment read, one per function, each with
the public API to move to once it exists. Nothing else in ops/ or the modeling files reads these."""

from __future__ import annotations

import torch
from torch import nn

try:  # move to: a public "is transformers recording output X now" query (none in transformers 5.23-5.25)
    from transformers.utils.output_capturing import _active_collector
except ImportError:
    _active_collector = None

# move to: transformers.integrations.moe's public grouped-GEMM entry point (only `grouped_mm_experts_forward` is public)
from transformers.integrations.moe import _grouped_mm as grouped_mm  # noqa: E402


def recording(key: str) -> bool:
    """Whether transformers' output recording collects ``key`` (e.g. ``"router_logits"``) in the running forward."""
    if _active_collector is None:
        return False
    if torch.compiler.is_compiling() and not getattr(_active_collector, "compiling", False):
        return False  # (no capture_outputs inside this graph set it; dynamo cannot read the ContextVar itself)
    collected = _active_collector.get()
    return collected is not None and key in collected


def bare(module: nn.Module) -> bool:
    """Whether ``module`` has no hooks (its own or global ones) and no forward set on the instance (accelerate's offload sets one),
    so a kernel computes what calling it computes; read when kernels are attached, never per step.
    move to: a public ``Module.has_hooks()`` (torch has none)."""
    return not (
        _global_hooks() or module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
        or "forward" in module.__dict__ or "_hf_hook" in module.__dict__
    )  # fmt: skip


MISSING = object()


def _global_hooks() -> bool:
    m = nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)  # fmt: skip


def parameter(module: nn.Module, name: str):
    """``module``'s registered parameter ``name`` (None where registered as None, `MISSING` for a parametrized or
    absent one), without ``Module.__getattr__`` on the decode step.
    move to: ``getattr(module, name)`` if that lookup gets cheap."""
    return module._parameters.get(name, MISSING)


def parameters(module: nn.Module) -> dict:
    """``module``'s own registered parameters by name (see `parameter`), read once per call of a hot forward."""
    return module._parameters


def buffer(module: nn.Module, name: str) -> torch.Tensor | None:
    """``module``'s registered buffer ``name`` (see `parameter`)."""
    return module._buffers.get(name, MISSING)


def below_autograd():
    """A guard that skips autograd's dispatch for an operator call that wants no gradient.
    move to: a public ``torch.autograd`` no-dispatch context (``torch.no_grad`` still dispatches)."""
    return torch._C._AutoDispatchBelowAutograd()


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. gradient checkpointing re-running a forward).
    move to: a public ``torch.autograd`` query for the running graph task (none today)."""
    return torch._C._current_graph_task_id() != -1
