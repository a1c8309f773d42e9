"""Tensors that stay fp32 when a module is cast to a lower dtype."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def apply_keeping_fp32(module: nn.Module, apply: Callable[[], nn.Module], keep: Callable[[str], bool]) -> nn.Module:
    """Run ``apply()`` (the module's ``nn.Module._apply``) with every fp32 parameter and buffer whose name (relative
    to ``module``) satisfies ``keep`` put back afterwards, values and all, on the device it moved to, if the call
    cast it to another floating dtype (``.to(torch.bfloat16)``, ``.half()``); device moves apply as usual."""
    kept = {name: tensor.data for name, tensor in [*module.named_parameters(), *module.named_buffers()]
            if tensor.dtype == torch.float32 and keep(name)}
    result = apply()
    for name, before in kept.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        after = getattr(owner, attr)
        if after.is_floating_point() and after.dtype != torch.float32:
            if isinstance(after, nn.Parameter):
                after.data = before.to(after.device)
            else:
                setattr(owner, attr, before.to(after.device))
    return result
