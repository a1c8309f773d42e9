"""Every private torch / transformers API the kernels and their attachment use, one per name, each with the public
API to move to once it exists. Nothing else in the package reads these."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
from torch import nn

# move to: transformers.integrations.moe's public grouped-GEMM entry point (only `grouped_mm_experts_forward` is public)
from transformers.integrations.moe import _grouped_mm as grouped_mm  # noqa: E402


def bare(module: nn.Module) -> bool:
    """Whether ``module`` has no hooks (its own or global ones) and no forward set on the instance (accelerate's offload sets one),
    so a kernel computes what calling it computes; read when kernels are attached, never per step.
    move to: a public ``Module.has_hooks()`` (torch has none)."""
    return not (
        _global_hooks() or module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
        or "forward" in module.__dict__ or "_hf_hook" in module.__dict__
    )  # fmt: skip


def _global_hooks() -> bool:
    m = nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)  # fmt: skip


# move to: a public query of whether any device type's autocast is on that parses no device-type string
# (`torch.is_autocast_enabled(device_type)` parses one on every call). It asks CPU, CUDA, XPU, IPU, HPU, XLA, MTIA
# and the private-use backend, not MPS or MAIA; torch.compile folds it to a constant, as it folds is_autocast_enabled.
any_autocast_enabled = torch._C._is_any_autocast_enabled


def below_autograd():
    """A guard that skips autograd's dispatch for an operator call that wants no gradient.
    move to: a public ``torch.autograd`` no-dispatch context (``torch.no_grad`` still dispatches)."""
    return torch._C._AutoDispatchBelowAutograd()


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. gradient checkpointing re-running a forward).
    move to: a public ``torch.autograd`` query for the running graph task (none today)."""
    return torch._C._current_graph_task_id() != -1


def dispatch_keys_guard(include, exclude):
    """A guard that runs its block with these thread-local dispatch key sets (the reference operators record
    autograd inside an operator's implementation).
    move to: a public torch.library way to differentiate inside an implementation (none today)."""
    return torch._C._ForceDispatchKeyGuard(include, exclude)


def dispatch_keys() -> tuple:
    """This thread's local dispatch key sets ``(included, excluded)`` (see `dispatch_keys_guard`).
    move to: the same public API as `dispatch_keys_guard`."""
    return torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()


@contextlib.contextmanager
def autograd_inside_operator() -> Iterator[None]:
    """Record autograd inside an operator's implementation. The dispatcher runs an operator's CPU kernel with the
    autograd keys excluded (the operator's own autograd formula has already run), and a compiled graph calls it
    with ADInplaceOrView and other keys excluded as well (then in-place writes into views, which the PyTorch path
    makes, would be differentiated wrongly): the block runs with a fresh thread's dispatch keys instead (autocast
    off, so the recomputation is in the inputs' dtype, as the kernel's forward was).
    move to: the same public API as `dispatch_keys_guard`."""
    include, exclude = _default_dispatch_keys()
    with dispatch_keys_guard(include, exclude):
        yield


@functools.cache
def _default_dispatch_keys():
    """The thread-local dispatch key sets a new thread starts with (included, excluded)."""
    found = []
    reader = threading.Thread(target=lambda: found.append(dispatch_keys()))
    reader.start()
    reader.join()
    return found[0]
