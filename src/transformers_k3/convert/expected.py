"""What a checkpoint must contain for a given config: every tensor name, shape and the dtype the model keeps
it in, read from the model itself built on the meta device (no weights are allocated), so the converters
check shapes against exactly what ``from_pretrained`` will expect."""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass

import torch

from ..conversion.keymap import TEXT_PREFIX, attn_res_checkpoint_name, split_short_conv


@dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]
    # fp32 when the model keeps the tensor in fp32 whatever its dtype (A_log, dt_bias, router bias, ...),
    # else None ("follows the model dtype")
    fixed_dtype: torch.dtype | None
    optional: bool = False  # e.g. a tied lm_head the checkpoint may omit


def vision_model_class():
    """`KimiK3ForConditionalGeneration` when the multimodal model is available, else None."""
    try:
        module = importlib.import_module("transformers_k3.modeling_kimi_k3_vl")
    except ImportError:
        return None
    return getattr(module, "KimiK3ForConditionalGeneration", None)


def _meta_state(model_cls, config) -> dict[str, Expected]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # anything still fp32 afterwards is fp32 on purpose
    try:
        with torch.device("meta"):
            model = model_cls(copy.deepcopy(config))
    finally:
        torch.set_default_dtype(previous)
    state = model.state_dict()
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    # (under the checkpoint's names: the AttnRes reads' weights are saved as `{read}_proj.weight` / `_norm.weight`,
    # the stacked short-convolution filter as the release's three)
    return {
        attn_res_checkpoint_name(part): Expected(tuple(t.shape), torch.float32 if t.dtype == torch.float32 else None,
                                                 name in tied)
        for name, stacked in state.items() for part, t in split_short_conv(name, stacked)
    }


def expected_tensors(config, composite: bool) -> tuple[dict[str, Expected], bool]:
    """``({name: Expected}, vision_checked)`` in our checkpoint layout for ``config``. For a composite config the
    vision tensors are only known when `KimiK3ForConditionalGeneration` exists; otherwise the caller
    copies them through unchecked (``vision_checked`` False)."""
    from ..modeling_kimi_k3 import KimiK3ForCausalLM

    if composite:
        vl_cls = vision_model_class()
        if vl_cls is not None and config.vision_config is not None:
            return _meta_state(vl_cls, config), True
        text = _meta_state(KimiK3ForCausalLM, config.get_text_config())
        return {TEXT_PREFIX + name: value for name, value in text.items()}, config.vision_config is None
    return _meta_state(KimiK3ForCausalLM, config), True


__all__ = ["Expected", "expected_tensors", "vision_model_class"]
