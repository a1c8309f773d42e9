"""Our layout -> the official K3 layout (bf16), streamed shard by shard, for serving engines.

Accepts every layout this package writes: fused experts (the converters, ``save_pretrained(...,
save_original_format=False)``), per-expert official names (``save_pretrained``), and per-expert MXFP4
experts kept by ``--keep-quantized`` (dequantised here). The fused experts are read one expert slice at a
time (``get_slice``), so no fused tensor is ever held in memory.

Output: per-expert ``mlp.experts.{e}.w1/w3/w2.weight``, every other name unchanged (official names are
ours), bf16 except tensors the official release stores in fp32 (``A_log``, ``dt_bias``, short-conv
weights, ``e_score_correction_bias``), which stay fp32 when they are fp32 here. The ``config.json`` is the
official one (``text_config.model_type: "kimi_linear"``, no keys that are derived from others). Converting
an official bf16 checkpoint in and out again reproduces its tensors bit for bit (names, dtypes, bytes);
the only normalisation is ``A_log``, which is always written as ``[nh]``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .expected import expected_tensors, load_k3_config
from .keymap import (
    FP32_TENSOR_RE,
    TEXT_PREFIX,
    canonical_text_name,
    expert_block,
    is_rotary_cache,
    is_vision_name,
    parse_expert_name,
    per_expert_name,
)
from .official import ConversionPlan, _raise_errors, resolve_dtype, writing_checkpoint
from .quant import QuantFormatError, check_mxfp4_shapes, dequantize_mxfp4
from .streaming import Checkpoint, OutputTensor, Piece

# Keys of our config that official configs do not carry: derived from others, or ours with the official
# behaviour as default (written only when they differ from it).
_DERIVED_KEYS = ("layer_types", "mlp_layer_types", "transformers_version", "dtype", "torch_dtype")
_OURS_WITH_DEFAULT = {"kda_o_norm_eps": 1e-5, "mla_latent_norm_eps": None, "logit_scale": 1.0}


def _out_dtype(name: str, source_dtype: torch.dtype, target: torch.dtype) -> torch.dtype:
    if not source_dtype.is_floating_point:
        return source_dtype
    if source_dtype == torch.float32 and FP32_TENSOR_RE.search(name):
        return torch.float32
    return target


def plan_export(source: Checkpoint, dtype: str | torch.dtype = "bf16") -> ConversionPlan:
    target = resolve_dtype(dtype)
    config, composite = load_k3_config(source.config)
    expected, _ = expected_tensors(config, composite)
    prefix = TEXT_PREFIX if composite else ""
    plan = ConversionPlan(source, config, composite, [])
    errors: list[str] = []
    outputs: dict[str, OutputTensor] = {}
    sources_of: dict[str, str] = {}
    quantized: dict[tuple[str, int, str], dict[str, object]] = {}
    covered: set[str] = set()

    def add(name, tensor: OutputTensor, note: str):
        if name in outputs:
            errors.append(f"{note}: `{name}` is provided twice")
            return
        outputs[name] = tensor
        sources_of[name] = note

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
                add(text, OutputTensor(text, _out_dtype(text, info.dtype, target), block, [Piece((info,), block)]),
                    info.where())
            elif parsed.kind in ("weight_packed", "weight_scale"):
                quantized.setdefault((parsed.base, parsed.expert, parsed.proj), {"block": block})[parsed.kind] = info
            elif parsed.kind != "weight_shape":
                errors.append(f"{info.where()}: unsupported expert tensor kind `{parsed.kind}`")
            continue
        exp = expected.get(text)
        if exp is None:
            errors.append(f"{info.where()}: unknown tensor (the model for this config has no `{text}`)")
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
                    out = per_expert_name(base, e, proj)
                    piece = Piece((info,), block, 0, select=(e, slice(offset, offset + block[0])))
                    add(out, OutputTensor(out, _out_dtype(out, info.dtype, target), block, [piece]),
                        f"{info.where()}[{e}, {offset}:{offset + block[0]}]")
            continue
        add(text, OutputTensor(text, _out_dtype(text, info.dtype, target), exp.shape, [Piece((info,), exp.shape)]),
            info.where())

    for (base, e, proj), parts in quantized.items():
        packed, scale, block = parts.get("weight_packed"), parts.get("weight_scale"), parts["block"]
        if packed is None or scale is None:
            errors.append(f"{(packed or scale).where()}: MXFP4 expert needs both weight_packed and weight_scale")
            continue
        try:
            if check_mxfp4_shapes(packed.shape, scale.shape) != block:
                raise QuantFormatError(f"dequantises to the wrong shape; the config needs {list(block)}")
        except QuantFormatError as error:
            errors.append(f"{packed.where()}: {error}")
            continue
        out = per_expert_name(base, e, proj)
        piece = Piece((packed, scale), block, 0, lambda x: dequantize_mxfp4(x[0], x[1], torch.float32))
        add(out, OutputTensor(out, target, block, [piece]), f"{packed.where()} (MXFP4 -> {target})")

    # every expected tensor must be there (experts: every expert of every projection)
    for name, exp in expected.items():
        if exp.optional:
            continue
        if name.endswith((".gate_up_proj", ".down_proj")) and ".mlp.experts" in name:
            base = name.rsplit(".", 1)[0]
            projs = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
            for e in range(exp.shape[0]):
                for proj in projs:
                    if per_expert_name(base, e, proj) not in outputs:
                        errors.append(f"{source.directory}: missing tensor for expert {e} {proj} of `{name}`")
            continue
        if name not in covered:
            errors.append(f"{source.directory}: missing tensor `{name}` (shape {list(exp.shape)}), required by the config")
    _raise_errors(errors, f"cannot export {source.directory}")
    names = list(outputs)
    plan.outputs = [outputs[n] for n in names]
    plan.mapping = [(n, sources_of[n]) for n in names]
    return plan


def official_config_dict(config, composite: bool) -> dict:
    """Our config as the official release writes it."""
    data = config.to_dict()
    text = data["text_config"] if composite else data
    text["model_type"] = "kimi_linear"
    for key in _DERIVED_KEYS:
        text.pop(key, None)
    for key, default in _OURS_WITH_DEFAULT.items():
        if key in text and text[key] == default:
            text.pop(key)
    if composite:
        data.pop("transformers_version", None)
        data.pop("dtype", None)
        data["architectures"] = ["KimiK3ForConditionalGeneration"]
        if data.get("vision_config") is not None:
            data["vision_config"].pop("transformers_version", None)
            data["vision_config"].pop("dtype", None)
    else:
        data["architectures"] = ["KimiK3LinearForCausalLM"]
    data["torch_dtype"] = "bfloat16"
    return data


def _restore_release_tokenizer(output_dir: Path) -> None:
    original = output_dir / "tokenizer_config.tiktoken.json"
    if original.is_file():  # the release's own tokenizer files, as the official converter kept them
        shutil.move(original, output_dir / "tokenizer_config.json")
        (output_dir / "tokenizer.json").unlink(missing_ok=True)


def export_to_official(input_dir, output_dir=None, dtype: str = "bf16", dry_run: bool = False,
                       max_shard_size: int | str = "5GB", overwrite: bool = False, progress: bool = True) -> ConversionPlan:
    """Writes our checkpoint at ``input_dir`` in the official layout to ``output_dir`` (see the module
    docstring); with ``dry_run`` only validates and returns the plan."""
    source = Checkpoint(input_dir)
    plan = plan_export(source, dtype)
    if dry_run:
        return plan
    with writing_checkpoint(source, plan, output_dir, overwrite, max_shard_size, progress) as tmp:
        _restore_release_tokenizer(tmp)
        with open(tmp / "config.json", "w", encoding="utf-8") as f:
            json.dump(official_config_dict(plan.config, plan.composite), f, indent=2, sort_keys=True)
            f.write("\n")
    return plan


__all__ = ["export_to_official", "official_config_dict", "plan_export"]
