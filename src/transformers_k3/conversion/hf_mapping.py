"""Load-time conversion of official checkpoints: the mappings registered with transformers'
conversion-mapping machinery (``transformers.conversion_mapping``), so that ``from_pretrained`` on an
official directory builds our model directly (routed experts fused, MXFP4 dequantised, aliases resolved).

Registered (by `register_conversion_mappings`, called once from ``transformers_k3/__init__.py``):

* ``kimi_k3_text`` (our text models, also inside the multimodal one, where transformers scopes it to
  ``language_model.``):

  - ``language_model.`` prefix dropped when a text model reads a multimodal checkpoint;
  - ``block_sparse_moe.`` -> ``mlp.`` (`MoEAliasRenaming`; saving writes ``block_sparse_moe.`` back for the
    MoE layers' tensors, never for the dense layer's ``mlp.{gate,up,down}_proj``);
  - ``{read}_proj.weight`` / ``{read}_norm.weight`` -> ``{read}.pseudo_query`` / ``{read}.key_norm`` for each
    Block AttnRes read (``self_attention_res``, ``mlp_res``, ``output_attn_res``: the read's module owns its
    weights); saving writes the checkpoint's names back;
  - ``self_attn.{q,k,v}_conv1d.weight`` (the release's three short-convolution filters, also what this package
    saved before it held them stacked) -> ``self_attn.conv1d.weight [3P, 1, K]`` (q|k|v) by transformers'
    ``Concatenate`` (`StackShortConvs`), as its Kimi Linear does; saving writes the three back (``Chunk``);
  - ``A_log`` ``[1, 1, nh, 1]`` / the release's zero-padded ``[head_dim]`` -> ``[nh]`` (`NormalizeALog`; a
    non-zero padding entry is an `ALogPaddingError`, which transformers reports by tensor name and then raises
    at the end of loading); saved as the release's fp32 ``[max(nh, head_dim)]`` (`PadALog`);
  - per-expert ``w1``/``w3`` -> ``experts.gate_up_proj``, ``w2`` -> ``experts.down_proj``, from plain
    ``weight`` tensors or MXFP4 ``weight_packed`` + ``weight_scale`` (dequantised exactly to the parameter
    dtype) by `FuseExperts`. (transformers' Kimi Linear does the plain case with ``MergeModulelist`` +
    ``Concatenate``; one op for both formats is needed because the reverse of a converter names its outputs
    after the converter's first source pattern, and ``Chunk`` would split into one piece per pattern.)

* ``kimi_k3`` (the multimodal model): ``language_model.layers.`` -> ``language_model.model.layers.``.

What ``save_pretrained`` writes (transformers reverses the conversions a model was loaded with, or, for a
model built from a config, every registered one; ``save_original_format=True`` is transformers' default and
stays ours; ``save_original_format=False`` reverses nothing):

* a model built from a config, or loaded from an official directory: **the release's layout**: the MoE
  layers under ``block_sparse_moe.`` with per-expert ``experts.{e}.w1/w2/w3.weight`` (MXFP4 experts come back
  dequantised: ``save_pretrained`` never quantises; ``conversion/export_to_official.py --mxfp4`` does),
  ``A_log`` zero-padded fp32, the text model under ``language_model.model.`` in the multimodal model, in the
  model's dtype with the tensors the model keeps in fp32 in fp32 (for a bf16 model: the release's dtypes);
* a model loaded from our converted layout (fused experts, ``mlp.``): fused experts under ``mlp.`` (the layout
  it was loaded from), ``A_log`` padded as above;
* ``save_original_format=False``: **our layout** (``experts.gate_up_proj`` / ``experts.down_proj``, ``A_log [nh]``,
  ``self_attn.conv1d.weight``).

Every layout above loads back with identical weights.
"""

from __future__ import annotations

import functools
import re
import threading
from contextlib import contextmanager

import torch
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, ConversionOps, WeightConverter, WeightRenaming

from .keymap import (
    ATTN_RES_READS,
    ATTN_RES_TENSORS,
    MOE_ALIAS,
    SHORT_CONV_PARTS,
    attn_res_module_name,
    normalize_a_log,
    pad_a_log,
    release_a_log_length,
    stack_short_convs,
)
from .quant import check_mxfp4_shapes, dequantize_mxfp4

_GATE_UP = ("w1", "w3")
_DOWN = ("w2",)

# What our conversion ops refused while a from_pretrained is recording: transformers turns each into a line of its
# load report and then raises one RuntimeError pointing at the report; from_pretrained raises CheckpointError with
# these instead. A list, not a context variable: transformers may run the ops in worker threads.
_failures_lock = threading.Lock()
_failures: list[list[str]] = []


@contextmanager
def recording_conversion_failures():
    """Collect, in the returned list, every refusal (`ValueError`) of our conversion ops inside the block."""
    record: list[str] = []
    with _failures_lock:
        _failures.append(record)
    try:
        yield record
    finally:
        with _failures_lock:
            _failures.remove(record)


def _recorded(convert):
    @functools.wraps(convert)
    def wrapper(self, *args, **kwargs):
        try:
            return convert(self, *args, **kwargs)
        except ValueError as error:
            with _failures_lock:
                for record in _failures:
                    record.append(f"{type(error).__name__}: {error}")
            raise

    return wrapper


def _expert_pattern(proj: str, kind: str) -> str:
    # `mlp.` is part of the pattern on purpose: saving turns the target (`.mlp.experts.down_proj`) into a regex
    # in which `.` matches any character, and `.experts.down_proj` would also match `shared_experts.down_proj`.
    return rf"\.mlp\.experts.*.{proj}.{kind}"


class OneWayRenaming(WeightRenaming):
    """A renaming applied when loading and never reversed when saving (aliases, a dropped prefix)."""

    __slots__ = ()

    def reverse_transform(self) -> WeightRenaming:
        return _NoRenaming(source_patterns=r"^\b$", target_patterns="")


class _NoRenaming(WeightRenaming):
    __slots__ = ()

    def rename_source_key(self, source_key: str):
        return source_key, None


class MoEAliasRenaming(WeightRenaming):
    """``block_sparse_moe.`` (the release's name for a MoE layer's FFN) -> ``mlp.`` when loading; saving
    writes ``block_sparse_moe.`` back for the MoE layers' tensors only (router, experts, shared experts,
    latent projections and norm), never for the dense layer's ``mlp.{gate,up,down}_proj``."""

    __slots__ = ()

    def reverse_transform(self) -> WeightRenaming:
        reverse = WeightRenaming(
            source_patterns=r"\.mlp\.(?=(?:gate|experts|shared_experts)\.|routed_expert_)",
            target_patterns=f".{MOE_ALIAS}.",
        )
        reverse.scope_prefix, reverse.base_model_prefix = self.scope_prefix, self.base_model_prefix
        return reverse


class _Identity(ConversionOps):
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {target_patterns[0]: next(iter(input_dict.values()))}

    @property
    def reverse_op(self) -> ConversionOps:
        return _Identity()


class NormalizeALog(ConversionOps):
    """``A_log`` as stored (``[nh]``, ``[1, 1, nh, 1]`` or the release's zero-padded ``[head_dim]``) -> ``[nh]``;
    a padding entry that is not exactly zero raises `ALogPaddingError` (a `CheckpointError`) naming the tensor.
    Saved back as the release stores it (`PadALog`)."""

    @_recorded
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **kwargs):
        value = next(iter(input_dict.values()))
        value = value[0] if isinstance(value, list) else value
        num_heads = _target_shape(model.get_parameter(full_layer_name))[0] if model is not None else value.numel()
        try:
            return {target_patterns[0]: normalize_a_log(value, num_heads)}
        except ValueError as error:
            raise type(error)(f"`{full_layer_name}`: {error}") from None

    @property
    def reverse_op(self) -> ConversionOps:
        return PadALog()


class StackShortConvs(Concatenate):
    """The release's ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` filters -> the stacked ``conv1d.weight`` (q|k|v rows),
    transformers' ``Concatenate`` once all three are there: a layer missing one raises a `ValueError` naming it (a
    stack of two would only show as a shape mismatch). Saved back as the three (``Chunk``)."""

    def __init__(self):
        super().__init__(dim=0)

    @_recorded
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, **kwargs):
        missing = [pattern.rsplit(".", 2)[-2] for pattern in source_patterns if pattern not in input_dict]
        if missing:
            raise ValueError(f"`{full_layer_name}`: the checkpoint has no {' / '.join(missing)} filter for this layer "
                             f"(q_conv1d, k_conv1d and v_conv1d are needed; re-download or re-convert the checkpoint)")
        return super().convert(input_dict, source_patterns, target_patterns, **kwargs)


def _linear_head_dim(config) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    linear = getattr(text, "linear_attn_config", None) or {}
    return linear.get("head_dim") if isinstance(linear, dict) else getattr(linear, "head_dim", None)


class PadALog(ConversionOps):
    """Saving: ``A_log [nh]`` -> fp32 ``[max(nh, head_dim)]``, the heads then zeros (the release's layout)."""

    def convert(self, input_dict, source_patterns, target_patterns, config=None, **kwargs):
        value = next(iter(input_dict.values()))
        value = value[0] if isinstance(value, list) else value
        head_dim = _linear_head_dim(config) if config is not None else None
        length = release_a_log_length(value.numel(), head_dim or value.numel())
        return {target_patterns[0]: pad_a_log(value, length)}

    @property
    def reverse_op(self) -> ConversionOps:
        return NormalizeALog()


def _target_shape(param: torch.Tensor) -> torch.Size:
    """The shape a conversion must produce for ``param``: this rank's part of a tensor-parallel parameter (a DTensor;
    transformers shards each checkpoint tensor as it reads it, so the experts arrive as this rank's shards), the
    whole shape of a DeepSpeed ZeRO-3 parameter (partitioned to an empty tensor; loaded whole, then partitioned),
    else the parameter's."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return param.to_local().shape
    return getattr(param, "ds_shape", None) or param.shape


class FuseExperts(ConversionOps):
    """Per-expert checkpoint tensors (lists in expert order) -> the fused expert parameter: ``[E, 2I, D]``
    from w1 (gate rows) then w3 (up rows), or ``[E, D, I]`` from w2, in the parameter's dtype.

    Each projection comes either as plain ``weight`` tensors (bf16 release, or our saved official layout)
    or as MXFP4 ``weight_packed`` + ``weight_scale`` (the official release), dequantised exactly
    (`dequantize_mxfp4`). Checks the number of experts, every block's shape and any ``weight_shape``."""

    def __init__(self, projections: tuple[str, ...]):
        self.projections = tuple(projections)

    @_recorded
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **kwargs):
        param = model.get_parameter(full_layer_name) if model is not None else None
        shape = _target_shape(param) if param is not None else None
        per_proj = []  # (proj, [callables giving one expert's block])
        for proj in self.projections:
            dense = input_dict.pop(_expert_pattern(proj, "weight"), None)
            packed = input_dict.pop(_expert_pattern(proj, "weight_packed"), None)
            scale = input_dict.pop(_expert_pattern(proj, "weight_scale"), None)
            shapes = input_dict.pop(_expert_pattern(proj, "weight_shape"), None)
            if dense and (packed or scale):
                raise ValueError(f"`{full_layer_name}`: the experts' {proj} mixes plain and MXFP4 tensors")
            if dense:
                blocks = [lambda t=t: t for t in dense]
            else:
                if not packed or not scale or len(packed) != len(scale):
                    raise ValueError(
                        f"`{full_layer_name}`: expected {proj} of every expert as `weight` or as MXFP4 "
                        f"`weight_packed` + `weight_scale`, got {len(packed or [])} weight_packed and "
                        f"{len(scale or [])} weight_scale tensors"
                    )
                for i, (p, s) in enumerate(zip(packed, scale)):
                    try:
                        check_mxfp4_shapes(p.shape, s.shape, shapes[i].reshape(-1).tolist() if shapes else None)
                    except ValueError as error:
                        raise type(error)(f"`{full_layer_name}`: expert {i} {proj}: {error}") from None
                # finite in the parameter's dtype too: an fp16 model overflows from 2^16
                finite_in = param.dtype if param is not None and param.dtype.is_floating_point else None
                blocks = [lambda p=p, s=s: dequantize_mxfp4(p, s, torch.float32, finite_in=finite_in)
                          for p, s in zip(packed, scale)]
            if shape is not None and len(blocks) != shape[0]:
                raise ValueError(
                    f"`{full_layer_name}`: found {proj} for {len(blocks)} experts, the model has {shape[0]}"
                )
            per_proj.append((proj, blocks))
        # fill one pre-allocated fused tensor expert by expert: peak memory = the result + one expert
        fused = None
        row = 0
        for proj, blocks in per_proj:
            for e, get in enumerate(blocks):
                try:
                    block = get()
                except ValueError as error:
                    raise type(error)(f"`{full_layer_name}`: expert {e} {proj}: {error}") from None
                if fused is None:
                    rows = block.shape[0] * len(per_proj)
                    dtype = param.dtype if param is not None else block.dtype
                    fused = torch.empty(len(blocks), rows, block.shape[1], dtype=dtype, device=block.device)
                    if shape is not None and tuple(fused.shape) != tuple(shape):
                        raise ValueError(f"`{full_layer_name}`: the experts give shape {list(fused.shape)}, "
                                         f"the model expects {list(shape)}")
                if tuple(block.shape) != (fused.shape[1] // len(per_proj), fused.shape[2]):
                    raise ValueError(f"`{full_layer_name}`: expert {e} {proj} has shape {list(block.shape)}, "
                                     f"expected {[fused.shape[1] // len(per_proj), fused.shape[2]]}")
                fused[e, row:row + block.shape[0]].copy_(block)
            row += fused.shape[1] // len(per_proj)
        return {target_patterns[0]: fused}

    @property
    def reverse_op(self) -> ConversionOps:
        return SplitFusedExperts(self.projections)


class SplitFusedExperts(ConversionOps):
    """Saving: the fused expert parameter -> plain per-expert ``….experts.{e}.{w}.weight`` tensors (the
    official bf16 layout). The reverse of `FuseExperts`: MXFP4 weights are never re-quantised."""

    def __init__(self, projections: tuple[str, ...]):
        self.projections = tuple(projections)

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        fused = next(iter(input_dict.values()))
        fused = fused[0] if isinstance(fused, list) else fused
        parts = torch.chunk(fused, len(self.projections), dim=1)
        out = {}
        for proj, part in zip(self.projections, parts):
            for e in range(part.shape[0]):
                out[f".experts.{e}.{proj}.weight"] = part[e].contiguous()
        return out

    @property
    def reverse_op(self) -> ConversionOps:
        return FuseExperts(self.projections)


def release_layout_pre_hook(module, state_dict, prefix, *args) -> None:
    """``load_state_dict`` pre-hook for a K3 model (text or multimodal root): a state dict in the release's
    layout (what ``save_pretrained`` writes; transformers' Trainer restores its checkpoints with a plain
    ``load_state_dict``) is brought to the model's names, as ``from_pretrained`` does: ``block_sparse_moe.`` ->
    ``mlp.``, the AttnRes reads' checkpoint names -> the model's (`attn_res_module_name`), the zero-padded
    ``A_log`` -> ``[nh]`` (a non-zero padding entry raises `ALogPaddingError`), the three short-convolution
    filters -> the stacked ``conv1d.weight`` (a layer missing one of them is left as it is, for ``load_state_dict``
    to report). The per-expert weights are then fused by the experts' own pre-hook. Edits ``state_dict`` in place."""
    config = getattr(module, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    num_heads = getattr(text, "linear_num_heads", None)
    for key in [k for k in state_dict if k.startswith(prefix)]:
        name = attn_res_module_name(key)
        if f".{MOE_ALIAS}." in name:
            name = name.replace(f".{MOE_ALIAS}.", ".mlp.")
        value = state_dict[key]
        if name.endswith(".A_log") and num_heads is not None and value.numel() != num_heads:
            try:
                value = normalize_a_log(value, num_heads)
            except ValueError as error:
                raise type(error)(f"`{key}`: {error}") from None
        if name != key or value is not state_dict[key]:
            del state_dict[key]
            state_dict[name] = value
    stack_short_convs(state_dict, prefix)


def text_model_mapping() -> list[WeightRenaming | WeightConverter]:
    """The conversions of a K3 text model (``KimiK3ForCausalLM`` / ``KimiK3Model``)."""
    mxfp4_kinds = ("weight_packed", "weight_scale", "weight_shape")
    return [
        # a text model reading a multimodal checkpoint (AutoModelForCausalLM on the composite config)
        OneWayRenaming(source_patterns=r"^language_model\.", target_patterns=""),
        MoEAliasRenaming(source_patterns=r"\.block_sparse_moe\.", target_patterns=".mlp."),
        # each Block AttnRes read owns its weights (`{read}.pseudo_query`, `{read}.key_norm`); checkpoints keep
        # `{read}_proj.weight` / `{read}_norm.weight`, and saving writes those back
        *[WeightRenaming(source_patterns=rf"{read}{re.escape(saved)}", target_patterns=f"{read}.{tensor}")
          for read in ATTN_RES_READS for tensor, saved in ATTN_RES_TENSORS.items()],
        WeightConverter(source_patterns=r"self_attn\.A_log", target_patterns="self_attn.A_log",
                        operations=[NormalizeALog()]),
        # the release's q, k and v filters stacked into the layer's one convolution (saving writes them back)
        WeightConverter(source_patterns=[f"self_attn.{part}_conv1d.weight" for part in SHORT_CONV_PARTS],
                        target_patterns="self_attn.conv1d.weight", operations=[StackShortConvs()]),
        # Routed experts, plain or MXFP4 per expert -> fused. The plain `weight` pattern comes first: saving
        # reverses this converter and names its outputs after the first pattern.
        WeightConverter(
            source_patterns=[_expert_pattern(p, k) for p in _GATE_UP for k in ("weight",)]
            + [_expert_pattern(p, k) for p in _GATE_UP for k in mxfp4_kinds],
            target_patterns=".mlp.experts.gate_up_proj",
            operations=[FuseExperts(_GATE_UP)],
        ),
        WeightConverter(
            source_patterns=[_expert_pattern("w2", "weight")] + [_expert_pattern("w2", k) for k in mxfp4_kinds],
            target_patterns=".mlp.experts.down_proj",
            operations=[FuseExperts(_DOWN)],
        ),
    ]


def multimodal_mapping() -> list[WeightRenaming | WeightConverter]:
    """The conversions of the multimodal model's root; its ``language_model`` gets `text_model_mapping`,
    scoped by transformers."""
    return [
        OneWayRenaming(source_patterns=r"^language_model\.layers\.", target_patterns="language_model.model.layers."),
    ]


def register_conversion_mappings() -> None:
    """Registers both mappings (idempotent: re-registering replaces them)."""
    from ..configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig

    register_checkpoint_conversion_mapping(KimiK3TextConfig.model_type, text_model_mapping(), overwrite=True)
    register_checkpoint_conversion_mapping(KimiK3Config.model_type, multimodal_mapping(), overwrite=True)


__all__ = [
    "FuseExperts",
    "MoEAliasRenaming",
    "NormalizeALog",
    "PadALog",
    "OneWayRenaming",
    "SplitFusedExperts",
    "StackShortConvs",
    "multimodal_mapping",
    "register_conversion_mappings",
    "release_layout_pre_hook",
    "text_model_mapping",
]
