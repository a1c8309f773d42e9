"""Official K3 checkpoint (or a Moonshot-layout Kimi Linear one) -> our layout, streamed shard by shard.

The mapping is in `keymap` (module docstring); this module turns a checkpoint's inventory into a plan of
output tensors, checks every tensor against the config (unknown names, wrong shapes, missing experts or
tensors), and then hands the plan to `streaming.execute_plan`, which writes the output shards.

Dtypes of the output: ``dtype`` (bf16 or fp32) for every floating tensor, including the dequantised
experts, except tensors the model keeps in fp32 (``A_log``, ``dt_bias``, the router's correction bias)
and fp32 tensors the official release stores in fp32 (the short-conv weights), which stay fp32 so that
nothing is rounded; ``from_pretrained`` casts them to the model dtype where the model holds them lower.

``keep_quantized``: MXFP4 experts are not dequantised; each expert's ``weight_packed``/``weight_scale``
is copied bit for bit under its official per-expert name (``…mlp.experts.{e}.w1.weight_packed``), and
everything else is in our layout. ``from_pretrained`` dequantises those experts to the model dtype at
load time through the registered conversion mapping, so the directory loads like any other; the model in
memory is never MXFP4 (this package has no MXFP4 compute path). The gain is disk size.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..configuration_kimi_k3 import KimiK3TextConfig, load_k3_config
from ..safetensors_header import CheckpointError, TensorInfo
from .expected import Expected, expected_tensors
from ..conversion.keymap import (
    DOWN_PROJS,
    FP32_TENSOR_RE,
    GATE_UP_PROJS,
    TEXT_PREFIX,
    a_log_shape_ok,
    canonical_text_name,
    expert_block,
    is_rotary_cache,
    is_vision_name,
    layer_index,
    normalize_a_log,
    parse_expert_name,
    per_expert_name,
)
from ..conversion.quant import (
    FP8_DTYPES,
    FP8_SCALE_MISSING,
    QuantFormatError,
    check_finite_weight,
    check_mxfp4_shapes,
    check_mxfp4_values,
    dequantize_fp8_block,
    dequantize_mxfp4,
    fp8_scale_name,
    fp8_weights_without_scale,
)
from ..conversion.streaming import Checkpoint, OutputTensor, Piece, atomic_output_dir, execute_plan, parse_size

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
_FP8 = FP8_DTYPES
_MAX_LISTED_ERRORS = 20
# Files of a release that describe its weights or its remote code; everything else (tokenizer,
# generation and processor configs, chat templates, licence, README) is copied to the output.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".index.json")
_NOT_COPIED_NAMES = {"config.json"}
_NOT_COPIED_PREFIXES = ("modeling_", "configuration_")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of bf16, fp32, got {dtype!r}") from None


@dataclass
class ConversionPlan:
    """The validated plan, plus what a dry run prints."""

    source: Checkpoint
    config: object
    composite: bool
    outputs: list[OutputTensor]
    mapping: list[tuple[str, str]] = field(default_factory=list)  # (output, source description)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    side_files: list = field(default_factory=list)  # regular files copied to the output (`_side_files`)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)

    def describe(self) -> str:
        lines = [f"{len(self.outputs)} output tensors, {self.total_bytes / 1e6:.1f} MB"]
        for (name, source), tensor in zip(self.mapping, self.outputs):
            dtype = str(tensor.dtype).replace("torch.", "")
            lines.append(f"  {name} {list(tensor.shape)} {dtype} <- {source}")
        for name in self.skipped:
            lines.append(f"  (skipped) {name}")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


def _raise_errors(errors: list[str], what: str) -> None:
    if not errors:
        return
    listed = errors[:_MAX_LISTED_ERRORS]
    more = len(errors) - len(listed)
    raise CheckpointError(f"{what}:\n  " + "\n  ".join(listed) + (f"\n  ... and {more} more" if more else ""))


def _cast_dtype(out_name: str, source_dtype: torch.dtype, expected: Expected, target: torch.dtype) -> torch.dtype:
    if not source_dtype.is_floating_point and source_dtype not in _FP8:
        return source_dtype
    if expected.fixed_dtype is not None:
        return expected.fixed_dtype
    if source_dtype == torch.float32 and FP32_TENSOR_RE.search(out_name):
        return torch.float32
    return target


def load_config_of(source: Checkpoint):
    """`load_k3_config` for the checkpoint's ``config.json``; any way the file can be wrong is a
    `CheckpointError` naming it (`KimiK3ConfigError` names the bad field)."""
    from ..conversion.checkpoint_checks import check_config_fits_files
    from ..configuration_kimi_k3 import KimiK3ConfigError

    try:
        config, composite = load_k3_config(source.config)
    except KimiK3ConfigError as error:
        raise CheckpointError(f"{source.directory / 'config.json'}: {error}") from error
    except Exception as error:  # transformers' config classes raise TypeError/ValueError/AttributeError/...
        raise CheckpointError(f"{source.directory / 'config.json'}: not a valid K3 config ({type(error).__name__}: "
                              f"{error}); fix the file or re-download it") from error
    check_config_fits_files(config, source.total_bytes, source.directory / "config.json")
    return config, composite


def _fp8_scale_for(name: str, tensors: dict[str, TensorInfo]) -> TensorInfo | None:
    """The block/channel scale stored next to an FP8 ``….weight``, if any."""
    scale = fp8_scale_name(name, tensors)
    return tensors[scale] if scale is not None else None


def _dequant_fp8(inputs):
    """FP8 weight times its scale, in fp32: per-channel (``[N]`` or ``[N, 1]``, ROCm Quark) or per 128x128
    block (``[ceil(N/128), ceil(K/128)]``, ModelOpt FP8_PB_WO)."""
    weight, scale = inputs
    per_channel = weight.shape[0] > 1 and scale.numel() == weight.shape[0] and (
        scale.dim() == 1 or (scale.dim() == 2 and scale.shape[1] == 1))
    if per_channel:
        return check_finite_weight(weight.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1),
                                   "FP8 weight times its channel scale")
    return dequantize_fp8_block(weight, scale, dtype=torch.float32)


def _checked_mxfp4_packed(inputs):
    """A kept-quantized expert's ``weight_packed``, copied as it is once its scales (read alongside) are known to give
    finite weights: the loader would refuse the copy later."""
    check_mxfp4_values(inputs[0], inputs[1])
    return inputs[0]


def plan_official_conversion(source: Checkpoint, dtype: str | torch.dtype = "bf16", keep_quantized: bool = False,
                             config=None, view: dict[str, tuple[TensorInfo, tuple | None]] | None = None
                             ) -> ConversionPlan:
    """Builds and validates the plan; raises `CheckpointError` listing every problem found (each naming
    the file and tensor).

    ``config`` (default: from the checkpoint's ``config.json``) is the K3 config to convert to; ``view``
    (default: the checkpoint's tensors as they are) presents the source under official names, each as
    ``(tensor, select)`` with ``select`` an index into the stored tensor and ``tensor.shape`` the shape
    after it: how the Kimi Linear converter feeds its in-tree layout through the same checks."""
    target = resolve_dtype(dtype)
    if config is None:
        config, composite = load_config_of(source)
    else:
        composite = not isinstance(config, KimiK3TextConfig)
    if view is None:
        view = {name: (info, None) for name, info in source.tensors.items()}
    text_config = config.get_text_config()
    expected, vision_checked = expected_tensors(config, composite)
    num_heads = text_config.linear_num_heads
    num_layers = text_config.num_hidden_layers
    prefix = TEXT_PREFIX if composite else ""
    plan = ConversionPlan(source, config, composite, [])
    errors: list[str] = []
    produced: dict[str, OutputTensor] = {}
    sources_of: dict[str, str] = {}
    experts: dict[str, dict[tuple[int, str], dict[str, TensorInfo]]] = defaultdict(dict)
    consumed_scales: set[str] = set()
    skipped_layers: set[int] = set()

    def add(out_name: str, info_list: tuple[TensorInfo, ...], shape, fn=None, note=None, out_dtype=None, select=None):
        exp = expected.get(out_name)
        out_dtype = out_dtype or (_cast_dtype(out_name, info_list[0].dtype, exp, target) if exp else info_list[0].dtype)
        if out_name in produced:
            errors.append(f"{info_list[0].where()}: maps to `{out_name}`, which {sources_of[out_name]} already provides")
            return
        tensor = OutputTensor(out_name, out_dtype, tuple(shape), [Piece(info_list, tuple(shape), 0, fn, select)])
        produced[out_name] = tensor
        sources_of[out_name] = note or info_list[0].where()

    # FP8 weights carry their scale in a sibling tensor; MXFP4 experts are handled with the experts
    unscaled = set(fp8_weights_without_scale({name: info.dtype for name, info in source.tensors.items()}))
    for name, info in source.tensors.items():
        if info.dtype in _FP8 and name.endswith(".weight"):
            if name in unscaled:
                errors.append(f"{info.where()}: {FP8_SCALE_MISSING}")
            else:
                consumed_scales.add(_fp8_scale_for(name, source.tensors).name)

    for name, (info, select) in view.items():
        if info.name in consumed_scales:
            continue
        if is_vision_name(name):
            if not vision_checked:
                add(name, (info,), info.shape, out_dtype=target if info.dtype.is_floating_point else info.dtype)
                continue
            if name not in expected:
                errors.append(f"{info.where()}: unknown tensor (the vision model has no `{name}`)")
                continue
            if tuple(info.shape) != expected[name].shape:
                errors.append(f"{info.where()}: wrong shape {list(info.shape)}, the config needs {list(expected[name].shape)}")
                continue
            add(name, (info,), info.shape)
            continue
        if is_rotary_cache(name):
            plan.skipped.append(f"{name} (rotary cache; K3 has no RoPE)")
            continue
        text = canonical_text_name(name)
        layer = layer_index(text)
        if layer is not None and layer >= num_layers:
            skipped_layers.add(layer)
            continue
        parsed = parse_expert_name(text)
        if parsed is not None:
            slot = experts[prefix + parsed.base].setdefault((parsed.expert, parsed.proj), {})
            if parsed.kind in slot:
                errors.append(f"{info.where()}: expert tensor given twice (also as {slot[parsed.kind].where()})")
            slot[parsed.kind] = info
            continue
        out_name = prefix + text
        exp = expected.get(out_name)
        if exp is None:
            errors.append(f"{info.where()}: unknown tensor (maps to `{out_name}`, which the model for this config does not have)")
            continue
        if text.endswith(".A_log"):
            if not a_log_shape_ok(info.shape, num_heads):
                errors.append(f"{info.where()}: wrong shape {list(info.shape)}; A_log must be [{num_heads}], "
                              f"[1, 1, {num_heads}, 1] or a longer 1-D vector")
                continue
            add(out_name, (info,), exp.shape, fn=lambda x, nh=num_heads: normalize_a_log(x[0], nh), select=select)
            continue
        if info.dtype in _FP8:
            scale = _fp8_scale_for(info.name, source.tensors)
            if scale is None:
                continue  # reported above
            if tuple(info.shape) != exp.shape:
                errors.append(f"{info.where()}: wrong shape {list(info.shape)}, the config needs {list(exp.shape)}")
                continue
            add(out_name, (info, scale), exp.shape, fn=_dequant_fp8, out_dtype=_cast_dtype(out_name, torch.bfloat16, exp, target),
                note=f"{info.where()} + {scale.name} (FP8 -> {str(target).replace('torch.', '')})")
            continue
        if tuple(info.shape) != exp.shape:
            errors.append(f"{info.where()}: wrong shape {list(info.shape)}, the config needs {list(exp.shape)}")
            continue
        add(out_name, (info,), exp.shape, select=select,
            note=None if select is None else f"{info.where()}[{_format_select(select)}]")

    _plan_experts(experts, expected, target, keep_quantized, produced, sources_of, errors, add)
    if skipped_layers:
        plan.skipped.append(f"layers {sorted(skipped_layers)} (beyond num_hidden_layers={num_layers}, e.g. MTP; "
                            "SGLang skips them too)")
    for name, exp in expected.items():
        if name in produced or exp.optional or name in _kept_quantized_cover(produced, name):
            continue
        if name.endswith((".gate_up_proj", ".down_proj")) and ".mlp.experts." in name:
            base = name.rsplit(".", 1)[0]
            projs = "w1,w3" if name.endswith("gate_up_proj") else "w2"
            if any(p in projs for _, p in experts.get(base, {})):
                continue  # some experts are there: the problems with the others are reported above
            errors.append(f"{source.directory}: missing tensors `{base}.{{0..{exp.shape[0] - 1}}}.{{{projs}}}.weight` "
                          f"(or their MXFP4 weight_packed/weight_scale): no routed expert of this layer is in the checkpoint")
        else:
            errors.append(f"{source.directory}: missing tensor `{name}` (shape {list(exp.shape)}), required by the config")
    _raise_errors(errors, f"cannot convert {source.directory}")
    plan.side_files = _side_files(source.directory)
    if not vision_checked:
        plan.notes.append("vision weights copied without a shape check: KimiK3ForConditionalGeneration is not available")

    order = {name: i for i, name in enumerate(expected)}
    names = sorted(produced, key=lambda n: (order.get(n, len(order)), n))
    plan.outputs = [produced[n] for n in names]
    plan.mapping = [(n, sources_of[n]) for n in names]
    return plan


def _format_select(select: tuple) -> str:
    return ", ".join(f"{item.start or ''}:{item.stop or ''}" if isinstance(item, slice) else str(item) for item in select)


def _kept_quantized_cover(produced: dict[str, OutputTensor], fused_name: str) -> set[str]:
    """With --keep-quantized a fused expert tensor is provided by per-expert packed tensors instead."""
    if fused_name.endswith((".gate_up_proj", ".down_proj")):
        base = fused_name.rsplit(".", 1)[0]
        proj = "w1" if fused_name.endswith("gate_up_proj") else "w2"
        if per_expert_name(base, 0, proj, "weight_packed") in produced:
            return {fused_name}
    return set()


def _plan_experts(experts, expected: dict[str, Expected], target, keep_quantized, produced, sources_of, errors, add):
    for base, parts in experts.items():
        for projs in (GATE_UP_PROJS, DOWN_PROJS):
            fused = f"{base}.gate_up_proj" if projs is GATE_UP_PROJS else f"{base}.down_proj"
            exp = expected.get(fused)
            present = [(e, p) for (e, p) in parts if p in projs]
            if not present:
                continue
            some = parts[present[0]]
            where = next(iter(some.values())).where()
            if exp is None:
                errors.append(f"{where}: unknown tensor (this config has no routed experts at `{fused}`)")
                continue
            num_experts = exp.shape[0]
            extra = sorted({e for e, _ in present if e >= num_experts})
            if extra:
                info = next(iter(parts[next((e, p) for e, p in present if e >= num_experts)].values()))
                errors.append(f"{info.where()}: unknown tensor (expert {extra[0]} >= num_experts={num_experts})")
            quantized = {e_p: "weight_packed" in kinds for e_p, kinds in parts.items() if e_p[1] in projs}
            if keep_quantized and any(quantized.values()):
                if not all(quantized.values()):
                    errors.append(f"{where}: layer mixes MXFP4 and unquantized experts; --keep-quantized needs one format per layer")
                    continue
                _plan_kept_quantized(base, projs, parts, exp, num_experts, errors, add)
                continue
            pieces: list[Piece] = []
            notes = set()
            for e in range(num_experts):
                for proj in projs:
                    offset, block = expert_block(proj, exp.shape)
                    dst = (e * exp.shape[1] + offset) * exp.shape[2]
                    kinds = parts.get((e, proj))
                    if not kinds:
                        errors.append(f"missing tensor `{per_expert_name(base, e, proj)}` (or its MXFP4 weight_packed/"
                                      f"weight_scale): expert {e} of `{fused}`")
                        continue
                    piece = _expert_piece(kinds, block, dst, errors)
                    if piece is not None:
                        pieces.append(piece)
                        notes.add(piece.note)
            if not pieces:
                continue
            tensor = OutputTensor(fused, target, exp.shape, pieces)
            produced[fused] = tensor
            sources_of[fused] = (f"{base}.{{0..{num_experts - 1}}}.{{{','.join(projs)}}} "
                                 f"({', '.join(sorted(notes))}) in {len({p.sources[0].file for p in pieces})} shard(s)")


def _expert_piece(kinds: dict[str, TensorInfo], block: tuple[int, int], dst: int, errors: list[str]) -> Piece | None:
    if "weight" in kinds:
        info = kinds["weight"]
        if tuple(info.shape) != block:
            errors.append(f"{info.where()}: wrong shape {list(info.shape)}, the config needs {list(block)}")
            return None
        if info.dtype in _FP8:
            scale = kinds.get("weight_scale_inv") or kinds.get("weight_scale")
            if scale is None:
                errors.append(f"{info.where()}: FP8 expert weight without a weight_scale_inv")
                return None
            return Piece((info, scale), block, dst, _dequant_fp8, note="FP8")
        return Piece((info,), block, dst, note=str(info.dtype).replace("torch.", ""))
    packed, scale = kinds.get("weight_packed"), kinds.get("weight_scale")
    if packed is None or scale is None:
        some = next(iter(kinds.values()))
        errors.append(f"{some.where()}: MXFP4 expert needs both weight_packed and weight_scale")
        return None
    try:
        rows_cols = check_mxfp4_shapes(packed.shape, scale.shape)
    except QuantFormatError as error:
        errors.append(f"{packed.where()}: {error}")
        return None
    if rows_cols != block:
        errors.append(f"{packed.where()}: wrong shape {list(packed.shape)} (= {list(rows_cols)} dequantised), the config needs "
                      f"{list(block)} (packed [{block[0]}, {block[1] // 2}])")
        return None
    if packed.dtype != torch.uint8:
        errors.append(f"{packed.where()}: MXFP4 weight_packed must be uint8, got {packed.dtype}")
        return None

    def fn(inputs):
        return dequantize_mxfp4(inputs[0], inputs[1], torch.float32)

    return Piece((packed, scale), block, dst, fn, note="MXFP4")


def _plan_kept_quantized(base, projs, parts, exp: Expected, num_experts, errors, add):
    for e in range(num_experts):
        for proj in projs:
            _, block = expert_block(proj, exp.shape)
            kinds = parts.get((e, proj))
            if not kinds or "weight_packed" not in kinds or "weight_scale" not in kinds:
                errors.append(f"missing tensor `{per_expert_name(base, e, proj, 'weight_packed')}` (or its weight_scale)")
                continue
            packed, scale = kinds["weight_packed"], kinds["weight_scale"]
            try:
                rows_cols = check_mxfp4_shapes(packed.shape, scale.shape)
            except QuantFormatError as error:
                errors.append(f"{packed.where()}: {error}")
                continue
            if rows_cols != block:
                errors.append(f"{packed.where()}: wrong shape {list(packed.shape)}, the config needs packed "
                              f"[{block[0]}, {block[1] // 2}]")
                continue
            add(per_expert_name(base, e, proj, "weight_packed"), (packed, scale), packed.shape, fn=_checked_mxfp4_packed,
                out_dtype=packed.dtype, note=f"{packed.where()} (MXFP4, copied; scales checked)")
            add(per_expert_name(base, e, proj, "weight_scale"), (scale,), scale.shape, out_dtype=scale.dtype,
                note=f"{scale.where()} (MXFP4, copied)")


# --------------------------------------------------------------------------------------------------
def _side_files(source_dir: Path) -> list[Path]:
    """The release's files copied to the output: regular files only. A symbolic link is followed only when
    it resolves to a regular file inside the checkpoint (a hub-cache snapshot's links into its ``blobs``);
    a link leading outside it (``notes.txt -> /etc/shadow``) or a special file (FIFO, socket, device) is
    refused, never read. Checked before anything is written."""
    import stat

    from ..conversion.streaming import resolve_inside

    files = []
    for path in sorted(source_dir.iterdir()):
        name = path.name
        if (name.startswith(".") or name in _NOT_COPIED_NAMES or name.endswith(_NOT_COPIED_SUFFIXES)
                or name.startswith(_NOT_COPIED_PREFIXES)):
            continue
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode):
            continue
        if stat.S_ISLNK(mode):
            target = resolve_inside(source_dir, name, "side file (only regular files inside the checkpoint are copied)")
            if Path(os.path.realpath(target)).is_dir():
                continue
            mode = os.stat(target).st_mode if os.path.exists(target) else 0
            if not stat.S_ISREG(mode):
                raise CheckpointError(
                    f"{path}: side file is a symbolic link to {os.path.realpath(path)}, which is not a regular file; "
                    "only regular files are copied: replace the link with the file or remove it")
        elif not stat.S_ISREG(mode):
            raise CheckpointError(
                f"{path}: side file is not a regular file (a FIFO, socket or device); only regular files are copied: "
                "remove it from the checkpoint directory")
        files.append(path)
    return files


def _copy_side_files(files: list[Path], output_dir: Path) -> list[str]:
    copied = []
    for path in files:
        with open(path, "rb") as src, open(output_dir / path.name, "wb") as dst:
            shutil.copyfileobj(src, dst)
        shutil.copystat(path, output_dir / path.name)
        copied.append(path.name)
    return copied


@contextlib.contextmanager
def writing_checkpoint(source: Checkpoint, plan: "ConversionPlan", output_dir, overwrite: bool,
                       max_shard_size: int | str, progress: bool):
    """Streams the plan's tensors and the source's side files into a temporary directory, yields it for the
    caller's config and tokenizer files, and renames it to `output_dir` only once everything is written."""
    if output_dir is None:
        raise ValueError("output_dir is required unless dry_run=True")
    try:
        parse_size(max_shard_size)  # (a bad size is the caller's error, before anything is written)
    except ValueError as error:
        raise CheckpointError(f"max_shard_size: {error}") from None
    side_files = plan.side_files if plan.side_files else _side_files(source.directory)
    with atomic_output_dir(output_dir, overwrite) as tmp:
        execute_plan(plan.outputs, tmp, max_shard_size, progress, file_order=source.files,
                     desc=f"{source.directory.name} -> {Path(output_dir).name}")
        _copy_side_files(side_files, tmp)
        yield tmp


def write_k3_config(config, composite: bool, directory: Path, dtype: torch.dtype, quantization_config=None) -> None:
    """Our ``config.json``: the K3 config (official keys) without the release's ``auto_map`` and without
    a ``quantization_config`` unless experts were kept quantized (then it describes those tensors)."""
    config.architectures = ["KimiK3ForConditionalGeneration" if composite else "KimiK3ForCausalLM"]
    config.dtype = dtype
    if composite:
        config.get_text_config().dtype = dtype
    config.save_pretrained(directory)
    if quantization_config is not None:
        path = directory / "config.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        (data["text_config"] if composite else data)["quantization_config"] = quantization_config
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _source_quantization_config(config_dict: dict):
    return (config_dict.get("text_config") or {}).get("quantization_config") or config_dict.get("quantization_config")


def convert_official_checkpoint(input_dir, output_dir=None, dtype: str = "bf16", keep_quantized: bool = False,
                                dry_run: bool = False, max_shard_size: int | str = "5GB", overwrite: bool = False,
                                progress: bool = True, convert_tokenizer: bool = True) -> ConversionPlan:
    """Converts an official K3 directory (text-only or multimodal) to our layout; see the module docstring.
    With ``dry_run`` only the plan is built and validated (nothing is written). Returns the plan."""
    source = Checkpoint(input_dir)
    plan = plan_official_conversion(source, dtype, keep_quantized)
    if dry_run:
        return plan
    target = resolve_dtype(dtype)
    kept = any(t.name.endswith("weight_packed") for t in plan.outputs)
    with writing_checkpoint(source, plan, output_dir, overwrite, max_shard_size, progress) as tmp:
        write_k3_config(plan.config, plan.composite, tmp, target,
                        _source_quantization_config(source.config) if kept else None)
        if convert_tokenizer and (tmp / "tiktoken.model").is_file():
            from .tokenizer import convert_tiktoken_tokenizer

            convert_tiktoken_tokenizer(tmp, tmp)
    return plan


__all__ = ["ConversionPlan", "convert_official_checkpoint", "plan_official_conversion", "resolve_dtype", "write_k3_config"]
