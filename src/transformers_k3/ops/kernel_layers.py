"""Kernels plugged in by name, decided once: `kernelize(model)` attaches the fused CPU kernels to a built model.

A layer class declares its name with `kernel_layer` (``KimiK3SparseMoE`` -> ``"k3_sparse_moe"``, ...) and a
``kernel`` slot (None: its PyTorch forward). `kernelize` walks the module tree once: each named layer gets the
kernel forward its attach function returns (`KERNEL_LAYERS`; None where the kernel would not compute what the
modules do: hooks, LoRA, quantized or offloaded modules, settings it does not take), and each plain `nn.Linear`
without hooks becomes a `KernelLinear` holding the same parameters. A later change of the module tree under a
kernelized layer (PEFT wrapping, a parametrization, a quantizer replacing a child) detaches that layer's kernel,
through torch's module-registration hook; `kernelize` again attaches what fits then. ``kernelize(model, False)``
detaches every kernel and puts plain `nn.Linear` layers back.

transformers' own `kernelize` (the ``kernels`` package) is not used: it replaces instances' ``forward``, and no
``kernels`` release satisfies both transformers 5.23 (<0.19) and 5.25 (>=0.19.1) (docs/kernels.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from .experts import attach_experts
from .kda.interface import attach_kda
from .linear import KernelLinear, attach_mla, swap_linear
from .moe import attach_mlp, attach_router, attach_sparse_moe, forget
from .norm import attach_rms_norm
from .torch_internals import bare

# name -> attach function (module -> kernel forward or None); None: a named kind with no kernel of its own
KERNEL_LAYERS: dict[str, Callable[[nn.Module], Callable | None] | None] = {
    "k3_sparse_moe": attach_sparse_moe,
    "k3_router": attach_router,
    "k3_mlp": attach_mlp,
    "k3_rms_norm": attach_rms_norm,
    "k3_experts": attach_experts,
    "k3_mxfp4_experts": None,
    "k3_kda": attach_kda,
    "k3_mla": attach_mla,
}


def kernel_layer(name: str):
    """Class decorator: the class is the kernel layer ``name`` (a key of `KERNEL_LAYERS`), with a ``kernel`` slot."""
    if name not in KERNEL_LAYERS:
        raise ValueError(f"no kernel layer {name!r}; known: {sorted(KERNEL_LAYERS)}")

    def decorate(cls: type) -> type:
        # (a decorator line left above a function would tag the function and leave the class without a kernel)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"kernel_layer({name!r}) decorates an nn.Module class, got {cls!r}")
        cls.k3_kernel_name = name
        cls.kernel = None
        cls.__delattr__ = _delattr_then_forget
        return cls

    return decorate


# every module inside a kernelized layer -> the layers whose kernel reads it
_READERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ATTACHING = [False]


def kernelize(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Attach (``enabled``) or detach the fused CPU kernels of ``model``'s layers; returns ``model``."""
    _ATTACHING[0] = True
    try:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if enabled and type(child) is nn.Linear and bare(child):
                    setattr(parent, name, swap_linear(child, KernelLinear))
                elif not enabled and type(child) is KernelLinear:
                    setattr(parent, name, swap_linear(child, nn.Linear))
        for module in model.modules():
            name = type(module).__dict__.get("k3_kernel_name")
            if name is None:
                continue
            attach = KERNEL_LAYERS[name]
            kernel = attach(module) if enabled and attach is not None and bare(module) else None
            module.kernel = kernel
            if kernel is not None:
                for inner in module.modules():
                    _READERS.setdefault(inner, weakref.WeakSet()).add(module)
    finally:
        _ATTACHING[0] = False
    return model


def _detach_on_change(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """torch's module-registration hook: a child set under a kernelized layer detaches that layer's kernel."""
    if _ATTACHING[0]:
        return None
    readers = _READERS.get(parent)
    if readers:
        for layer in list(readers):
            layer.kernel = None
    return None


def _delattr_then_forget(self: nn.Module, name: str) -> None:
    # (a plain tensor set in a deleted parameter's place reaches no registration hook: FSDP's views)
    nn.Module.__delattr__(self, name)
    forget(self)


_HOOK = register_module_module_registration_hook(_detach_on_change)
