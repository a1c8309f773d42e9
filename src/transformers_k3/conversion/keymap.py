"""Tensor names: the official K3 / Moonshot Kimi Linear layouts, transformers' in-tree Kimi Linear layout,
and ours (K3_SPEC.md section 2).

Ours follows the official names one for one, except that the routed experts and the short-convolution filters are
stacked:

=================================================  ======================================================
official (per expert ``e``)                        ours
=================================================  ======================================================
``mlp.experts.{e}.w1.weight``  ``[I, D]`` (gate)   ``mlp.experts.gate_up_proj [E, 2I, D]``, rows ``[0, I)``
``mlp.experts.{e}.w3.weight``  ``[I, D]`` (up)     ``mlp.experts.gate_up_proj``, rows ``[I, 2I)``
``mlp.experts.{e}.w2.weight``  ``[D, I]`` (down)   ``mlp.experts.down_proj [E, D, I]``
``…w{1,2,3}.weight_packed`` / ``weight_scale``     dequantised into the same fused tensors (MXFP4)
``block_sparse_moe.`` (MoE layers, or ``mlp.``)    ``mlp.``
``language_model.layers.`` (alias)                 ``language_model.model.layers.``
``self_attn.{q,k,v}_conv1d.weight`` ``[P, 1, K]``  ``self_attn.conv1d.weight [3P, 1, K]``, rows q | k | v
``self_attn.A_log`` fp32 ``[head_dim]`` (zeros     ``self_attn.A_log [nh]`` (the first ``nh`` entries; the
after the heads), ``[nh]``, ``[1,1,nh,1]``         padding must be exactly zero: `ALogPaddingError`)
``rotary_emb.{inv_freq,cos_cached,sin_cached}``    dropped (K3 has no RoPE)
=================================================  ======================================================

A Block AttnRes read (``self_attention_res``, ``mlp_res`` of each layer, the model's ``output_attn_res``) holds
its weights on its own module: ``{read}.pseudo_query`` / ``{read}.key_norm`` in the model are the checkpoint's
``{read}_proj.weight`` / ``{read}_norm.weight`` (`attn_res_checkpoint_name`, `attn_res_module_name`). Every
layout on disk (the release, the converters' output, ``save_pretrained``'s default) keeps the checkpoint's names;
``save_pretrained(save_original_format=False)`` writes the model's, and both load.

A multimodal checkpoint keeps the text model under ``language_model.`` (``language_model.model.layers…``,
``language_model.lm_head.weight``); ``vision_tower.*`` and ``mm_projector.*`` are the same in both layouts.
A text-only checkpoint has no prefix. Writing the release's layout (`release_text_name`, `pad_a_log`,
`RELEASE_FP32_TENSOR_RE`, `quant.quantize_mxfp4_release`) is the exact inverse for everything the release holds.

The converters' output keeps the release's three filter names too (`short_conv_checkpoint_names`).

transformers' in-tree Kimi Linear (``KimiLinearForCausalLM`` state dict) stacks the short convolutions as we do
(``self_attn.conv1d.weight``) and keeps the forget-gate weights under ``self_attn.forget_gate.`` (with ``A_log`` as
``[1, 1, nh, 1]``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..configuration_kimi_k3 import MXFP4_GROUP_SIZE
from ..safetensors_header import CheckpointError
from .quant import dequantize_mxfp4, quantize_mxfp4, quantize_mxfp4_release

TEXT_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
GATE_UP_PROJS = ("w1", "w3")  # gate rows, then up rows (not interleaved)
DOWN_PROJS = ("w2",)
EXPERT_KINDS = ("weight", "weight_packed", "weight_scale", "weight_shape", "weight_scale_inv")

_EXPERT_RE = re.compile(
    r"^(?P<base>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<expert>\d+)\."
    r"(?P<proj>w[123])\.(?P<kind>weight(?:_packed|_scale_inv|_scale|_shape)?)$"
)
_ROTARY_RE = re.compile(r"(?:^|\.)rotary_emb\.(?:inv_freq|cos_cached|sin_cached)$")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Tensors the official checkpoint stores in fp32 (spec 2.2); converters never round them down.
FP32_TENSOR_RE = re.compile(r"\.(?:A_log|dt_bias|(?:[qkv]_)?conv1d\.weight|o_norm\.weight|e_score_correction_bias)$")


# What the release stores in fp32 (K3_SPEC.md section 13: ``A_log``, ``dt_bias``, the three short-conv weights,
# ``o_norm.weight``, the router's correction bias); everything else floating is bf16 there, vision included.
# The exporters write exactly this, whatever the model keeps in fp32.
RELEASE_FP32_TENSOR_RE = re.compile(
    r"\.(?:A_log|dt_bias|[qkv]_conv1d\.weight|o_norm\.weight|e_score_correction_bias)$")
# Our ``mlp.`` of a MoE layer (router, routed/shared experts, latent projections and norm) is the release's
# ``block_sparse_moe.``; the dense layer's ``mlp.{gate,up,down}_proj`` keeps ``mlp.``.
_MOE_MLP_RE = re.compile(r"(\.layers\.\d+)\.mlp\.(?=(?:gate|experts|shared_experts)\.|routed_expert_)")
MOE_ALIAS = "block_sparse_moe"
# The stacked short-convolution filter's row blocks, in order; the release stores each as ``{part}_conv1d.weight``.
SHORT_CONV_PARTS = ("q", "k", "v")
_SHORT_CONV_SUFFIX = ".self_attn.conv1d.weight"


def short_conv_checkpoint_names(name: str) -> list[str] | None:
    """The model's stacked ``….self_attn.conv1d.weight`` -> the release's names of its row blocks (``q_conv1d``,
    ``k_conv1d``, ``v_conv1d``, in order); None for any other name."""
    if not name.endswith(_SHORT_CONV_SUFFIX):
        return None
    stem = name[: -len("conv1d.weight")]
    return [f"{stem}{part}_conv1d.weight" for part in SHORT_CONV_PARTS]


def split_short_conv(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``[(name, tensor)]``, or for the stacked filter its three row blocks under the release's names."""
    parts = short_conv_checkpoint_names(name)
    if parts is None:
        return [(name, tensor)]
    return [(part, block.contiguous()) for part, block in zip(parts, tensor.chunk(len(parts), dim=0))]


def stack_short_convs(state_dict: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Replaces, in ``state_dict`` (under ``prefix``), every layer's three release filters by the stacked
    ``conv1d.weight`` (a layer holding only some of them keeps them as they are); returns ``state_dict``."""
    first = f"{SHORT_CONV_PARTS[0]}_conv1d.weight"
    for name in [n for n in state_dict if n.startswith(prefix) and n.endswith("." + first)]:
        stem = name[: -len(first)]
        parts = [f"{stem}{part}_conv1d.weight" for part in SHORT_CONV_PARTS]
        if all(part in state_dict for part in parts):
            state_dict[f"{stem}conv1d.weight"] = torch.cat([state_dict.pop(part) for part in parts])
    return state_dict


# Block AttnRes: each read's weights, in the model (``{read}.pseudo_query``) and in checkpoints (``{read}_proj.weight``)
ATTN_RES_READS = ("self_attention_res", "mlp_res", "output_attn_res")
ATTN_RES_TENSORS = {"pseudo_query": "_proj.weight", "key_norm": "_norm.weight"}
_READ = rf"(?:^|(?<=\.))({'|'.join(ATTN_RES_READS)})"
_ATTN_RES_MODEL_RE = re.compile(rf"{_READ}\.({'|'.join(ATTN_RES_TENSORS)})$")
_ATTN_RES_CHECKPOINT_RE = re.compile(rf"{_READ}({'|'.join(map(re.escape, ATTN_RES_TENSORS.values()))})$")
_ATTN_RES_MODEL_TENSOR = {saved: tensor for tensor, saved in ATTN_RES_TENSORS.items()}


def attn_res_checkpoint_name(name: str) -> str:
    """A model tensor name -> the checkpoint's (``….self_attention_res.pseudo_query`` ->
    ``….self_attention_res_proj.weight``); every other name, a checkpoint name included, is unchanged."""
    return _ATTN_RES_MODEL_RE.sub(lambda m: m[1] + ATTN_RES_TENSORS[m[2]], name)


def attn_res_module_name(name: str) -> str:
    """The inverse of `attn_res_checkpoint_name`: a checkpoint name -> the model's; other names unchanged."""
    return _ATTN_RES_CHECKPOINT_RE.sub(lambda m: f"{m[1]}.{_ATTN_RES_MODEL_TENSOR[m[2]]}", name)


class ALogPaddingError(CheckpointError):
    """``A_log`` stored padded (the release's ``[head_dim]`` form) with a non-zero padding entry."""


def release_text_name(name: str) -> str:
    """Our text tensor name -> the release's: ``layers.{i}.mlp.`` of a MoE layer -> ``layers.{i}.block_sparse_moe.``
    (the dense layer's ``mlp.{gate,up,down}_proj`` and every other name are unchanged), an AttnRes read's weights
    under the checkpoint's names (`attn_res_checkpoint_name`)."""
    return _MOE_MLP_RE.sub(rf"\1.{MOE_ALIAS}.", attn_res_checkpoint_name(name))


def release_a_log_length(num_heads: int, head_dim: int) -> int:
    """Entries of ``A_log`` as the release stores it: ``[head_dim]`` holding the ``num_heads`` values then zeros
    (96 heads in ``[128]`` at full size; SGLang: K3 stores A_log "as [head_dim]"), never shorter than ``num_heads``."""
    return max(int(num_heads), int(head_dim))


def pad_a_log(a_log: torch.Tensor, length: int) -> torch.Tensor:
    """``[nh]`` (or any stored form) -> fp32 ``[length]``: the heads' values, then exact zeros."""
    flat = a_log.detach().reshape(-1).to(torch.float32)
    if flat.numel() > length:
        raise ValueError(f"A_log has {flat.numel()} entries, more than the padded length {length}")
    out = torch.zeros(length, dtype=torch.float32, device=flat.device)
    out[: flat.numel()] = flat
    return out


def is_vision_name(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def is_rotary_cache(name: str) -> bool:
    return _ROTARY_RE.search(name) is not None


def canonical_text_name(name: str) -> str:
    """An official / Moonshot text tensor name (with or without ``language_model.``, with either alias), or one of
    the model's -> our checkpoint name (``model.layers.…``, ``lm_head.weight``; AttnRes weights under the
    checkpoint's names, `attn_res_checkpoint_name`)."""
    if name.startswith(TEXT_PREFIX):
        name = name[len(TEXT_PREFIX):]
    if name.startswith("layers."):
        name = "model." + name
    return attn_res_checkpoint_name(name.replace(".block_sparse_moe.", ".mlp."))


def layer_index(name: str) -> int | None:
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class ExpertName:
    """``{base}.{expert}.{proj}.{kind}`` with ``base`` ending in ``mlp.experts``."""

    base: str
    layer: int
    expert: int
    proj: str
    kind: str

    @property
    def fused(self) -> str:
        return fused_expert_name(self.base, self.proj)


def parse_expert_name(name: str) -> ExpertName | None:
    match = _EXPERT_RE.match(name)
    if match is None:
        return None
    return ExpertName(match["base"], int(match["layer"]), int(match["expert"]), match["proj"], match["kind"])


def fused_expert_name(base: str, proj: str) -> str:
    return f"{base}.gate_up_proj" if proj in GATE_UP_PROJS else f"{base}.down_proj"


def per_expert_name(base: str, expert: int, proj: str, kind: str = "weight") -> str:
    return f"{base}.{expert}.{proj}.{kind}"


def expert_block(proj: str, fused_shape: tuple[int, ...]) -> tuple[int, tuple[int, int]]:
    """Row offset of ``proj`` inside one expert of the fused tensor, and that block's ``[rows, cols]``."""
    _, rows, cols = fused_shape
    if proj in GATE_UP_PROJS:
        half = rows // 2
        return (0 if proj == "w1" else half), (half, cols)
    return 0, (rows, cols)


def normalize_a_log(a_log: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``A_log`` stored as ``[nh]``, ``[1, 1, nh, 1]`` or a longer 1-D vector -> ``[nh]`` (spec section 12)."""
    if a_log.dim() == 4 and tuple(a_log.shape) != (1, 1, num_heads, 1):
        raise ValueError(f"A_log of shape {list(a_log.shape)}: a 4-D A_log must be [1, 1, {num_heads}, 1]")
    if a_log.dim() not in (1, 4):
        raise ValueError(f"A_log of shape {list(a_log.shape)}: expected [{num_heads}], [1, 1, {num_heads}, 1] or 1-D")
    flat = a_log.reshape(-1)
    if flat.numel() < num_heads:
        raise ValueError(f"A_log has {flat.numel()} entries, fewer than the {num_heads} KDA heads")
    padding = flat[num_heads:]
    if padding.numel() and padding.device.type != "meta" and bool((padding != 0).any()):  # (meta: shapes only)
        bad = int((padding != 0).nonzero()[0, 0]) + num_heads
        raise ALogPaddingError(
            f"A_log of shape {list(a_log.shape)}: entries {num_heads}.. pad the {num_heads} KDA heads and must be "
            f"exactly zero, but entry {bad} is {float(flat[bad])!r} (a checkpoint for more heads, or corrupted)")
    return flat[:num_heads].clone()


def a_log_shape_ok(shape: tuple[int, ...], num_heads: int) -> bool:
    return (len(shape) == 1 and shape[0] >= num_heads) or tuple(shape) == (1, 1, num_heads, 1)


# --------------------------------------------------------------------------------------------------
# In-memory state-dict maps (tests, fixtures, small models). The converters stream instead.
def official_to_k3_state_dict(state_dict: dict[str, torch.Tensor], num_kda_heads: int, composite: bool = False,
                              num_hidden_layers: int | None = None,
                              dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Official-layout tensors -> our names: experts fused (MXFP4 dequantised), short-convolution filters stacked,
    aliases resolved, A_log normalised, rotary caches and layers >= ``num_hidden_layers`` dropped."""
    prefix = TEXT_PREFIX if composite else ""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], dict[str, torch.Tensor]]] = {}
    for name, tensor in state_dict.items():
        if is_vision_name(name):
            out[name] = tensor
            continue
        if is_rotary_cache(name):
            continue
        text = canonical_text_name(name)
        layer = layer_index(text)
        if num_hidden_layers is not None and layer is not None and layer >= num_hidden_layers:
            continue
        parsed = parse_expert_name(text)
        if parsed is not None:
            experts.setdefault(parsed.base, {}).setdefault((parsed.expert, parsed.proj), {})[parsed.kind] = tensor
            continue
        if text.endswith(".A_log"):
            tensor = normalize_a_log(tensor, num_kda_heads)
        out[prefix + text] = tensor
    for base, parts in experts.items():
        num_experts = 1 + max(e for e, _ in parts)
        for projs in (GATE_UP_PROJS, DOWN_PROJS):
            blocks = []
            for e in range(num_experts):
                halves = []
                for proj in projs:
                    kinds = parts.get((e, proj))
                    if kinds is None:
                        raise KeyError(f"missing tensor {per_expert_name(base, e, proj)}")
                    if "weight" in kinds:
                        halves.append(kinds["weight"])
                    else:
                        halves.append(dequantize_mxfp4(kinds["weight_packed"], kinds["weight_scale"],
                                                       dtype or torch.bfloat16))
                blocks.append(torch.cat(halves, dim=0))
            out[prefix + fused_expert_name(base, projs[0])] = torch.stack(blocks)
    out = stack_short_convs(out)
    if dtype is not None:
        out = {k: (v.to(dtype) if v.is_floating_point() and not FP32_TENSOR_RE.search(k) else v) for k, v in out.items()}
    return out


def release_quantization_config() -> dict:
    """The release's ``quantization_config`` (K3_SPEC.md sections 10.1 and 13): compressed-tensors
    ``mxfp4-pack-quantized``, E2M1 weights in symmetric groups of 32 with uint8 E8M0 scales, routed experts only."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": MXFP4_GROUP_SIZE,
                        "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"},
            "input_activations": None,
            "output_activations": None,
            "format": "mxfp4-pack-quantized",
        }},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    }


def _release_head_dim(state_dict: dict[str, torch.Tensor], a_log_name: str, a_log: torch.Tensor) -> int | None:
    """``head_dim`` of a KDA layer from its own tensors: ``dt_bias`` is ``[nh * head_dim]``."""
    dt_bias = state_dict.get(a_log_name[: -len("A_log")] + "dt_bias")
    if dt_bias is None or a_log.numel() == 0:
        return None
    return dt_bias.numel() // a_log.numel()


def k3_to_official_state_dict(state_dict: dict[str, torch.Tensor], quantize_experts: bool = False,
                              exact: bool = True, release: bool = True,
                              dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Our names -> the official layout: the stacked short-convolution filter split into the release's three
    (`split_short_conv`), fused experts split per expert (``w1``/``w3``/``w2``), optionally
    MXFP4-quantised (``weight_packed`` + ``weight_scale``: `quantize_mxfp4_release`, or with ``exact`` the
    exact quantiser, which refuses a value MXFP4 cannot hold).

    ``release`` (default): exactly the release's layout: ``block_sparse_moe.`` for the MoE layers, ``A_log``
    as fp32 ``[max(nh, head_dim)]`` zero-padded, the release's fp32 tensors (`RELEASE_FP32_TENSOR_RE`) in fp32
    and, with ``dtype``, every other floating tensor in ``dtype``. ``release=False``: only the experts split."""

    out: dict[str, torch.Tensor] = {}
    for name, tensor in (item for stored in state_dict.items() for item in split_short_conv(*stored)):
        if release:
            if name.endswith(".A_log"):
                nh = tensor.numel() if tensor.dim() == 1 else tensor.reshape(-1).numel()
                head_dim = _release_head_dim(state_dict, name, tensor.reshape(-1))
                tensor = pad_a_log(tensor, release_a_log_length(nh, head_dim or nh))
            elif RELEASE_FP32_TENSOR_RE.search(name) and tensor.is_floating_point():
                tensor = tensor.to(torch.float32)
            elif dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            name = release_text_name(name)
        match = re.match(r"^(?P<base>.*\.(?:mlp|block_sparse_moe)\.experts)\.(?P<which>gate_up_proj|down_proj)$", name)
        if match is None:
            out[name] = tensor
            continue
        base = match["base"]
        projs = GATE_UP_PROJS if match["which"] == "gate_up_proj" else DOWN_PROJS
        for e in range(tensor.shape[0]):
            for proj in projs:
                offset, (rows, _) = expert_block(proj, tuple(tensor.shape))
                block = tensor[e, offset:offset + rows].contiguous()
                if quantize_experts:
                    packed, scale = quantize_mxfp4(block, exact=True) if exact else quantize_mxfp4_release(block)
                    out[per_expert_name(base, e, proj, "weight_packed")] = packed
                    out[per_expert_name(base, e, proj, "weight_scale")] = scale
                else:
                    out[per_expert_name(base, e, proj)] = block
    return out


def kimi_linear_to_k3_state_dict(state_dict: dict[str, torch.Tensor], num_heads: int) -> dict[str, torch.Tensor]:
    """transformers' in-tree ``KimiLinearForCausalLM`` state dict -> our names: ``forget_gate.`` weights moved onto
    the attention module, ``A_log`` ``[1, 1, nh, 1]`` -> ``[nh]``. The stacked ``conv1d`` (q|k|v) and the experts
    are already stacked and fused the same way as ours."""
    out = {}
    for name, tensor in state_dict.items():
        name = name.replace("self_attn.forget_gate.", "self_attn.")
        if name.endswith("self_attn.A_log"):
            tensor = normalize_a_log(tensor, num_heads)
        out[name] = tensor.clone()
    return out


__all__ = [
    "ALogPaddingError",
    "ATTN_RES_READS",
    "ATTN_RES_TENSORS",
    "attn_res_checkpoint_name",
    "attn_res_module_name",
    "EXPERT_KINDS",
    "FP32_TENSOR_RE",
    "MOE_ALIAS",
    "RELEASE_FP32_TENSOR_RE",
    "SHORT_CONV_PARTS",
    "pad_a_log",
    "release_a_log_length",
    "release_quantization_config",
    "release_text_name",
    "short_conv_checkpoint_names",
    "split_short_conv",
    "stack_short_convs",
    "TEXT_PREFIX",
    "ExpertName",
    "canonical_text_name",
    "expert_block",
    "fused_expert_name",
    "is_rotary_cache",
    "is_vision_name",
    "k3_to_official_state_dict",
    "kimi_linear_to_k3_state_dict",
    "layer_index",
    "normalize_a_log",
    "official_to_k3_state_dict",
    "parse_expert_name",
    "per_expert_name",
]
