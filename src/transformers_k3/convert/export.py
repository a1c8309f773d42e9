"""Our layout -> the release's layout (K3_SPEC.md section 13), streamed shard by shard, for serving engines.

Accepts every layout this package writes: fused experts (the converters, ``save_pretrained(...,
save_original_format=False)``), the stacked short-convolution filter (``save_original_format=False``) or the release's
three, per-expert official names (``save_pretrained``, either FFN alias), per-expert MXFP4 experts kept by
``--keep-quantized``, and packed MXFP4 experts (`KimiK3PackedExperts`) saved fused (``gate_up_packed`` /
``gate_up_scale`` / ``down_packed`` / ``down_scale`` stacks). The fused experts are read one expert slice at a time
(``get_slice``), so no fused tensor is ever held in memory.

What is written is the release's layout exactly:

* names: the MoE layers' FFN under ``block_sparse_moe.`` (``gate.weight``, ``gate.e_score_correction_bias``,
  ``experts.{e}.w1/w2/w3``, ``shared_experts.*``, ``routed_expert_{down_proj,norm,up_proj}``), the dense
  layer's ``mlp.{gate,up,down}_proj``, the text model under ``language_model.model.`` /
  ``language_model.lm_head.weight`` in a multimodal checkpoint, vision names unchanged;
* dtypes: fp32 for ``A_log``, ``dt_bias``, ``q/k/v_conv1d.weight``, ``o_norm.weight`` and
  ``e_score_correction_bias`` (`RELEASE_FP32_TENSOR_RE`; a bf16 source is widened exactly), ``dtype``
  (bf16 by default) for every other floating tensor;
* ``A_log`` as fp32 ``[max(nh, head_dim)]``: the heads, then zeros (``[128]`` for 96 heads of 128);
* with ``mxfp4`` the routed experts as compressed-tensors ``mxfp4-pack-quantized`` (``weight_packed`` uint8
  ``[N, K/2]`` + E8M0 ``weight_scale`` uint8 ``[N, K/32]``): kept-quantized and packed sources copied bit for
  bit, others quantised by `quantize_mxfp4_release` (compressed-tensors' rule; the original bytes for weights
  that are unchanged since they were dequantised); without ``mxfp4``, MXFP4 sources (kept or packed) dequantised;
* ``model.safetensors.index.json`` (``metadata.total_size`` + ``weight_map``) and a ``config.json`` with the
  release's keys (``dtype`` naming what was written, ``text_config.model_type: "kimi_linear"``, 1-based layer
  lists, the release's ``quantization_config`` with ``mxfp4``).

Converting an official checkpoint in and out again reproduces its tensors bit for bit (names, dtypes,
shapes, bytes).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from .expected import expected_tensors
from ..conversion.keymap import (
    RELEASE_FP32_TENSOR_RE,
    TEXT_PREFIX,
    a_log_shape_ok,
    canonical_text_name,
    expert_block,
    is_rotary_cache,
    is_vision_name,
    normalize_a_log,
    pad_a_log,
    parse_expert_name,
    per_expert_name,
    release_a_log_length,
    release_quantization_config,
    release_text_name,
    short_conv_checkpoint_names,
)
from .official import ConversionPlan, _checked_mxfp4_packed, _raise_errors, resolve_dtype, writing_checkpoint
from ..conversion.quant import (
    QuantFormatError,
    check_mxfp4_shapes,
    dequantize_mxfp4,
    mxfp4_release_scale,
    mxfp4_scale_2d,
    quantize_mxfp4_release,
)
from ..conversion.streaming import PACKED_EXPERT_STACKS, Checkpoint, OutputTensor, Piece

# Keys of our config that official configs do not carry: derived from others, or ours with the official
# behaviour as default (written only when they differ from it).
_DERIVED_KEYS = ("layer_types", "mlp_layer_types", "transformers_version", "dtype", "torch_dtype")
# Keys of ours the release's config has not, written only where they differ from our (release-matching) defaults
_OURS_TEXT_KEYS = ("kda_o_norm_eps", "mla_latent_norm_eps", "logit_scale", "router_aux_loss_coef", "router_fp32",
                   "output_router_logits", "initializer_range", "rope_theta", "attention_dropout")
_OURS_VISION_KEYS = ("initializer_range",)
_OURS_TOP_KEYS = ("image_placeholder",)
# Keys the release's config.json writes (K3_SPEC.md section 13), kept even at transformers' generic defaults
_RELEASE_KEYS = {"architectures", "model_type", "dtype", "pad_token_id", "bos_token_id", "eos_token_id",
                 "tie_word_embeddings", "use_cache", "quantization_config", "text_config", "vision_config"}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _out_dtype(name: str, source_dtype: torch.dtype, target: torch.dtype) -> torch.dtype:
    if not source_dtype.is_floating_point:
        return source_dtype
    if RELEASE_FP32_TENSOR_RE.search(name):
        return torch.float32
    return target


def _linear_dims(config) -> tuple[int, int]:
    text = config.get_text_config()
    linear = text.linear_attn_config or {}
    num_heads = text.linear_num_heads
    return num_heads, int(linear.get("head_dim") or num_heads)


def plan_export(source: Checkpoint, dtype: str | torch.dtype = "bf16", mxfp4: bool = False) -> ConversionPlan:
    target = resolve_dtype(dtype)
    from .official import load_config_of

    config, composite = load_config_of(source)
    expected, _ = expected_tensors(config, composite)
    num_heads, head_dim = _linear_dims(config)
    a_log_length = release_a_log_length(num_heads, head_dim)
    prefix = TEXT_PREFIX if composite else ""
    plan = ConversionPlan(source, config, composite, [])
    errors: list[str] = []
    outputs: dict[str, OutputTensor] = {}
    sources_of: dict[str, str] = {}
    quantized: dict[tuple[str, int, str], dict[str, object]] = {}
    packed_stacks: dict[tuple[str, str], dict[str, object]] = {}  # (experts base, gate_up/down) -> packed/scale
    covered: set[str] = set()

    def add(name, tensor: OutputTensor, note: str):
        if name in outputs:
            errors.append(f"{note}: `{name}` is provided twice")
            return
        outputs[name] = tensor
        sources_of[name] = note

    def add_expert(base: str, e: int, proj: str, block: tuple[int, int], piece_of, source_dtype, note: str):
        """One expert's projection, plain (``dtype``) or, with ``mxfp4``, as weight_packed + weight_scale.
        ``piece_of(fn)`` builds the piece reading this block (``fn`` maps the block read to the output)."""
        name = release_text_name(per_expert_name(base, e, proj))
        if not mxfp4:
            add(name, OutputTensor(name, _out_dtype(name, source_dtype, target), block, [piece_of(None)]), note)
            return
        rows, cols = block
        stem = name[: -len("weight")]
        # the two outputs are written apart (each its own piece); the scale needs only the groups' exponents
        for kind, fn, shape in (("weight_packed", lambda x: quantize_mxfp4_release(x[0])[0], (rows, cols // 2)),
                                ("weight_scale", lambda x: mxfp4_release_scale(x[0]), (rows, cols // 32))):
            add(stem + kind, OutputTensor(stem + kind, torch.uint8, shape, [piece_of(fn, shape)]),
                f"{note} (-> MXFP4)")

    for name, info in source.tensors.items():
        if is_rotary_cache(name):
            plan.skipped.append(name)
            continue
        if is_vision_name(name):
            exp = expected.get(name)
            if exp is not None and tuple(info.shape) != exp.shape:
                errors.append(f"{info.where()}: wrong shape {list(info.shape)}, the config needs {list(exp.shape)}")
                continue
            covered.add(name)
            add(name, OutputTensor(name, _out_dtype(name, info.dtype, target), info.shape, [Piece((info,), info.shape)]),
                info.where())
            continue
        text = prefix + canonical_text_name(name)
        if text.endswith(PACKED_EXPERT_STACKS):  # (read below, once both stacks of a side are known)
            base, _, stack = text.rpartition(".")
            side, _, kind = stack.rpartition("_")
            packed_stacks.setdefault((base, side), {})[kind] = info
            continue
        parsed = parse_expert_name(text)
        if parsed is not None:
            fused = parsed.fused
            exp = expected.get(fused)
            if exp is None or parsed.expert >= exp.shape[0]:
                errors.append(f"{info.where()}: unknown tensor (no expert {parsed.expert} at `{fused}` for this config)")
                continue
            covered.add(fused)
            _, block = expert_block(parsed.proj, exp.shape)
            if parsed.kind == "weight":
                if tuple(info.shape) != block:
                    errors.append(f"{info.where()}: wrong shape {list(info.shape)}, the config needs {list(block)}")
                    continue
                add_expert(parsed.base, parsed.expert, parsed.proj, block,
                           lambda fn, shape=block, info=info: Piece((info,), shape, 0, fn), info.dtype, info.where())
            elif parsed.kind in ("weight_packed", "weight_scale"):
                quantized.setdefault((parsed.base, parsed.expert, parsed.proj), {"block": block})[parsed.kind] = info
            elif parsed.kind != "weight_shape":
                errors.append(f"{info.where()}: unsupported expert tensor kind `{parsed.kind}`")
            continue
        parts = short_conv_checkpoint_names(text)
        if parts is not None:  # our stacked filter (q|k|v rows): the release's three, each read as its rows' slice
            blocks = [expected.get(part) for part in parts]
            if any(block is None for block in blocks):
                errors.append(f"{info.where()}: unknown tensor (the model for this config has no `{text}`)")
                continue
            rows, shape = blocks[0].shape[0], blocks[0].shape
            if tuple(info.shape) != (len(parts) * rows, *shape[1:]):
                errors.append(f"{info.where()}: wrong shape {list(info.shape)}, the config needs "
                              f"{[len(parts) * rows, *shape[1:]]}")
                continue
            for i, part in enumerate(parts):
                covered.add(part)
                out_name = release_text_name(part)
                select = (slice(i * rows, (i + 1) * rows),)
                add(out_name, OutputTensor(out_name, _out_dtype(out_name, info.dtype, target), shape,
                                           [Piece((info,), shape, select=select)]),
                    f"{info.where()}[{i * rows}:{(i + 1) * rows}]")
            continue
        exp = expected.get(text)
        if exp is None:
            errors.append(f"{info.where()}: unknown tensor (the model for this config has no `{text}`)")
            continue
        out_name = release_text_name(text)
        if text.endswith(".A_log"):
            if not a_log_shape_ok(tuple(info.shape), num_heads) or math.prod(info.shape) > a_log_length:
                errors.append(f"{info.where()}: wrong shape {list(info.shape)}; A_log must be [{num_heads}], "
                              f"[1, 1, {num_heads}, 1] or the zero-padded [{a_log_length}]")
                continue
            covered.add(text)
            fn = (lambda x: pad_a_log(normalize_a_log(x[0], num_heads), a_log_length))
            add(out_name, OutputTensor(out_name, torch.float32, (a_log_length,),
                                       [Piece((info,), (a_log_length,), 0, fn)]),
                f"{info.where()} (padded to [{a_log_length}])")
            continue
        if tuple(info.shape) != exp.shape:
            errors.append(f"{info.where()}: wrong shape {list(info.shape)}, the config needs {list(exp.shape)}")
            continue
        covered.add(text)
        if text.endswith((".gate_up_proj", ".down_proj")) and ".mlp.experts" in text:
            base = text.rsplit(".", 1)[0]
            projs = ("w1", "w3") if text.endswith("gate_up_proj") else ("w2",)
            for e in range(exp.shape[0]):
                for proj in projs:
                    offset, block = expert_block(proj, exp.shape)
                    select = (e, slice(offset, offset + block[0]))

                    def piece_of(fn, shape=block, info=info, select=select):
                        return Piece((info,), shape, 0, fn, select=select)

                    add_expert(base, e, proj, block, piece_of, info.dtype,
                               f"{info.where()}[{e}, {offset}:{offset + block[0]}]")
            continue
        add(out_name, OutputTensor(out_name, _out_dtype(out_name, info.dtype, target), exp.shape,
                                   [Piece((info,), exp.shape)]), info.where())

    for (base, e, proj), parts in quantized.items():
        packed, scale, block = parts.get("weight_packed"), parts.get("weight_scale"), parts["block"]
        if packed is None or scale is None:
            errors.append(f"{(packed or scale).where()}: MXFP4 expert needs both weight_packed and weight_scale")
            continue
        try:
            if check_mxfp4_shapes(packed.shape, scale.shape) != block:
                raise QuantFormatError(f"dequantises to the wrong shape; the config needs {list(block)}")
            if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
                raise QuantFormatError(f"weight_packed and weight_scale must be uint8, got {packed.dtype} and {scale.dtype}")
        except QuantFormatError as error:
            errors.append(f"{packed.where()}: {error}")
            continue
        name = release_text_name(per_expert_name(base, e, proj))
        if mxfp4:  # copied bit for bit (a 4-D scale is written as the release's [N, K/32])
            stem = name[: -len("weight")]
            rows, cols = block
            add(stem + "weight_packed", OutputTensor(stem + "weight_packed", torch.uint8, tuple(packed.shape),
                                                     [Piece((packed, scale), tuple(packed.shape), 0, _checked_mxfp4_packed)]),
                f"{packed.where()} (copied; scales checked)")
            add(stem + "weight_scale", OutputTensor(stem + "weight_scale", torch.uint8, (rows, cols // 32),
                                                    [Piece((scale,), (rows, cols // 32), 0, lambda x: mxfp4_scale_2d(x[0]))]),
                f"{scale.where()} (copied)")
            continue
        piece = Piece((packed, scale), block, 0, lambda x: dequantize_mxfp4(x[0], x[1], torch.float32))
        add(name, OutputTensor(name, target, block, [piece]), f"{packed.where()} (MXFP4 -> {target})")

    for (base, side), parts in packed_stacks.items():
        fused = f"{base}.{side}_proj"
        exp = expected.get(fused)
        packed, scale = parts.get("packed"), parts.get("scale")
        if exp is None:
            errors.append(f"{(packed or scale).where()}: unknown tensor (the model for this config has no `{fused}`)")
            continue
        if packed is None or scale is None:
            errors.append(f"{(packed or scale).where()}: packed MXFP4 experts need both `{base}.{side}_packed` and "
                          f"`{base}.{side}_scale`; save the model again with save_pretrained")
            continue
        experts, rows, cols = exp.shape
        if tuple(packed.shape) != (experts, rows, cols // 2) or tuple(scale.shape) != (experts, rows, cols // 32) \
                or packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
            errors.append(f"{packed.where()}: packed MXFP4 experts stored as {packed.dtype} {list(packed.shape)} / "
                          f"{scale.dtype} {list(scale.shape)}, the config needs uint8 {[experts, rows, cols // 2]} / "
                          f"uint8 {[experts, rows, cols // 32]}")
            continue
        covered.add(fused)
        for e in range(experts):
            for proj in ("w1", "w3") if side == "gate_up" else ("w2",):
                offset, block = expert_block(proj, exp.shape)
                select = (e, slice(offset, offset + block[0]))  # one expert's rows of each stack, read by get_slice
                rows_of = f"[{e}, {offset}:{offset + block[0]}]"
                where = f"{packed.where()}{rows_of}"
                name = release_text_name(per_expert_name(base, e, proj))
                if not mxfp4:
                    piece = Piece((packed, scale), block, 0, lambda x: dequantize_mxfp4(x[0], x[1], torch.float32),
                                  select=select, selects_rest=(select,))
                    add(name, OutputTensor(name, target, block, [piece]), f"{where} (MXFP4 -> {target})")
                    continue
                stem = name[: -len("weight")]
                shape = (block[0], block[1] // 2)
                add(stem + "weight_packed", OutputTensor(stem + "weight_packed", torch.uint8, shape, [
                    Piece((packed, scale), shape, 0, _checked_mxfp4_packed, select=select, selects_rest=(select,))]),
                    f"{where} (copied; scales checked)")
                shape = (block[0], block[1] // 32)
                add(stem + "weight_scale", OutputTensor(stem + "weight_scale", torch.uint8, shape, [
                    Piece((scale,), shape, select=select)]), f"{scale.where()}{rows_of} (copied)")

    # every expected tensor must be there (experts: every expert of every projection)
    for name, exp in expected.items():
        if exp.optional:
            continue
        if name.endswith((".gate_up_proj", ".down_proj")) and ".mlp.experts" in name:
            base = name.rsplit(".", 1)[0]
            projs = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
            kind = "weight_packed" if mxfp4 else "weight"
            for e in range(exp.shape[0]):
                for proj in projs:
                    if release_text_name(per_expert_name(base, e, proj, kind)) not in outputs:
                        errors.append(f"{source.directory}: missing tensor for expert {e} {proj} of `{name}`")
            continue
        if name not in covered:
            errors.append(f"{source.directory}: missing tensor `{name}` (shape {list(exp.shape)}), required by the config")
    _raise_errors(errors, f"cannot export {source.directory}")
    names = list(outputs)
    plan.outputs = [outputs[n] for n in names]
    plan.mapping = [(n, sources_of[n]) for n in names]
    return plan


def _drop_defaults(section: dict, ours: tuple[str, ...], our_defaults) -> None:
    """Drop from one config section the keys every transformers config writes (``return_dict``, ``id2label``...)
    and the given keys of ours, where they hold their defaults: the release's config has none of them."""
    from transformers import PretrainedConfig

    generic = PretrainedConfig().to_dict()
    for key in list(section):
        if key == "architectures" and section[key] is None:
            section.pop(key)
        if key in _RELEASE_KEYS or key not in section:
            continue
        if key in generic and section[key] == generic[key]:
            section.pop(key)
        elif key in ours:
            default = getattr(our_defaults, key, None) if our_defaults is not None else None
            if section[key] == default or section[key] is None:
                section.pop(key)


def official_config_dict(config, composite: bool, dtype: str | torch.dtype = "bf16",
                         quantization_config: dict | None = None) -> dict:
    """Our config as the release writes it: its keys (``dtype``, not ``torch_dtype``, naming the dtype the
    weights are written in; composite ``model_type: "kimi_k3"`` with ``text_config.model_type: "kimi_linear"``;
    the 1-based ``linear_attn_config`` layer lists), no key derived from others, and ``quantization_config``
    (the release's, at the top level) when the experts are written as MXFP4."""
    dtype_name = _DTYPE_NAMES[resolve_dtype(dtype)]
    data = config.to_dict()
    text = data["text_config"] if composite else data
    text["model_type"] = "kimi_linear"
    for key in _DERIVED_KEYS:
        text.pop(key, None)
    text.pop("quantization_config", None)
    _drop_defaults(text, _OURS_TEXT_KEYS, type(config.get_text_config())())
    if composite:
        data["model_type"] = "kimi_k3"
        for key in _DERIVED_KEYS:
            data.pop(key, None)
        data["architectures"] = ["KimiK3ForConditionalGeneration"]
        _drop_defaults(data, _OURS_TOP_KEYS, type(config)())
        if data.get("vision_config") is not None:
            for key in _DERIVED_KEYS:
                data["vision_config"].pop(key, None)
            _drop_defaults(data["vision_config"], _OURS_VISION_KEYS, type(config.vision_config)())
    else:
        data["architectures"] = ["KimiK3LinearForCausalLM"]
    data.pop("quantization_config", None)
    data["dtype"] = dtype_name
    if quantization_config is not None:
        data["quantization_config"] = quantization_config
    return data


def _restore_release_tokenizer(output_dir: Path) -> None:
    original = output_dir / "tokenizer_config.tiktoken.json"
    if original.is_file():  # the release's own tokenizer files, as the official converter kept them
        shutil.move(original, output_dir / "tokenizer_config.json")
        (output_dir / "tokenizer.json").unlink(missing_ok=True)


def export_to_official(input_dir, output_dir=None, dtype: str = "bf16", dry_run: bool = False,
                       max_shard_size: int | str = "5GB", overwrite: bool = False, progress: bool = True,
                       mxfp4: bool = False) -> ConversionPlan:
    """Writes our checkpoint at ``input_dir`` in the release's layout to ``output_dir`` (see the module
    docstring; ``mxfp4``: routed experts as the release's MXFP4); with ``dry_run`` only validates and returns
    the plan."""
    source = Checkpoint(input_dir)
    plan = plan_export(source, dtype, mxfp4)
    if dry_run:
        return plan
    with writing_checkpoint(source, plan, output_dir, overwrite, max_shard_size, progress) as tmp:
        _restore_release_tokenizer(tmp)
        with open(tmp / "config.json", "w", encoding="utf-8") as f:
            json.dump(official_config_dict(plan.config, plan.composite, dtype,
                                           release_quantization_config() if mxfp4 else None), f, indent=2, sort_keys=True)
            f.write("\n")
    return plan


def export_release(model, output_dir, dtype: str | torch.dtype | None = None, max_shard_size: int | str = "5GB",
                   overwrite: bool = False, progress: bool = False, mxfp4: bool | None = None) -> ConversionPlan:
    """Writes a model in memory in the release's layout (tensor names, dtypes and ``config.json``) to ``output_dir``:
    ``save_pretrained`` into a temporary sibling directory, then `export_to_official`. ``dtype`` defaults to the
    model's (bf16 or fp32). ``mxfp4`` defaults to how the model holds its routed experts: packed
    (`KimiK3PackedExperts`, loaded with the release's MXFP4 kept) are written as they were loaded, byte for byte,
    with the release's ``quantization_config``; others in ``dtype``. ``mxfp4=True`` on unpacked experts quantizes
    them by the release's rule, ``mxfp4=False`` on packed ones dequantizes them."""
    import tempfile

    from ..quantization_kimi_k3 import KimiK3PackedExperts

    packed = any(isinstance(module, KimiK3PackedExperts) for module in model.modules())
    if mxfp4 is None:
        mxfp4 = packed
    if dtype is None:
        dtype = "bf16" if model.dtype == torch.bfloat16 else "fp32"
    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{output_dir.name}.k3save-", dir=output_dir.parent) as saved:
        # packed experts save under the release's per-expert names (the exporter reads MXFP4 per expert); the fused
        # layout would hold each layer's stacks
        model.save_pretrained(saved, save_original_format=packed)
        return export_to_official(saved, output_dir, dtype=dtype, max_shard_size=max_shard_size,
                                  overwrite=overwrite, progress=progress, mxfp4=mxfp4)


__all__ = ["export_release", "export_to_official", "official_config_dict", "plan_export"]
