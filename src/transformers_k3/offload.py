"""Big-model inference with accelerate's offloading (``from_pretrained(..., device_map="auto", max_memory=...,
offload_folder=...)`` with ``"cpu"`` / ``"disk"`` entries in the device map).

accelerate keeps an offloaded module's weights on the meta device and materialises them only while that module's
own ``forward`` runs: its ``AlignDevicesHook`` loads them in ``pre_forward`` and drops them in ``post_forward``. A
few K3 modules use a child's weight directly instead of calling the child:

* the decoder layer and the model read the AttnRes pseudo-queries and key norms (``*_res_proj``, ``*_res_norm``);
* the KDA layer hands its short-convolution kernels (``q/k/v_conv1d``) to the conv ops;
* the MLA layer multiplies by ``kv_b_proj.weight`` for absorbed decode.

`onloaded` runs those children's offload hooks around the parent's call, so the weights are there when they are
read and are dropped again afterwards. Without accelerate hooks (the usual case) it costs a few attribute lookups.
"""

from __future__ import annotations

import contextlib

from torch import nn

# For each module class, the children whose weights it reads without calling them.
DIRECT_READS: dict[str, tuple[str, ...]] = {
    "KimiK3DecoderLayer": ("self_attention_res_proj", "self_attention_res_norm", "mlp_res_proj", "mlp_res_norm"),
    "KimiK3DeltaAttention": ("q_conv1d", "k_conv1d", "v_conv1d"),
    "KimiK3MLA": ("kv_b_proj",),
    "KimiK3Model": ("output_attn_res_proj", "output_attn_res_norm"),
}


def _offload_hooks(module: nn.Module) -> list:
    # accelerate's add_hook_to_module sets a plain instance attribute; getattr() would go through
    # nn.Module.__getattr__ and raise inside for every module without one (on every decode step)
    hook = module.__dict__.get("_hf_hook")
    if hook is None:
        return []
    hooks = getattr(hook, "hooks", None) or [hook]  # accelerate chains several hooks in a SequentialHook
    return [h for h in hooks if getattr(h, "offload", False)]


_OWNERS_ATTR = "_k3_direct_read_owners"


def _owners(module: nn.Module, recurse: bool) -> tuple[nn.Module, ...]:
    """``module`` and (with ``recurse``) the modules inside it whose class reads a child's weight directly. The
    walk over every submodule is done once per module and kept on it: these owners (layers, attention blocks, the model) are never swapped out, while the children
    they read (which PEFT may wrap) are looked up afresh on every call."""
    if not recurse:
        return (module,)
    owners = module.__dict__.get(_OWNERS_ATTR)
    if owners is None:
        owners = tuple(m for m in module.modules() if type(m).__name__ in DIRECT_READS)
        module.__dict__[_OWNERS_ATTR] = owners  # a plain attribute: not registered as submodules
    return owners


# The cached owners and the dict lookups below keep `onloaded` cheap (timings in bench/RESULTS.md): it runs once
# per decoder layer and step.
def _direct_read_children(module: nn.Module, recurse: bool) -> list[nn.Module]:
    owners = _owners(module, recurse)
    children = []
    for owner in owners:
        for name in DIRECT_READS.get(type(owner).__name__, ()):
            child = owner._modules.get(name)
            if isinstance(child, nn.Module):
                children.append(child)
    return children


class _Onloaded(contextlib.AbstractContextManager):
    def __init__(self, hooked: list[tuple[object, nn.Module]]):
        self.hooked = hooked

    def __enter__(self):
        for hook, child in self.hooked:
            hook.pre_forward(child)
        return self

    def __exit__(self, *exc):
        for hook, child in self.hooked:
            hook.post_forward(child, None)
        return False


def onloaded(module: nn.Module, recurse: bool = True) -> contextlib.AbstractContextManager:
    """A context in which every offloaded child whose weight ``module`` (or, with ``recurse``, any module inside
    it) reads directly holds its real weights. A no-op context when nothing is offloaded."""
    hooked = [(hook, child) for child in _direct_read_children(module, recurse) for hook in _offload_hooks(child)]
    return _Onloaded(hooked) if hooked else contextlib.nullcontext()


__all__ = ["DIRECT_READS", "onloaded"]
