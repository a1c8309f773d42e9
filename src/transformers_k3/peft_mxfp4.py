"""LoRA over the packed MXFP4 routed experts (issue 46, docs/mxfp4.md "Fine-tuning packed experts"), registered
with PEFT through its custom-module socket (``LoraConfig._register_custom_module``): `packed_experts_lora` adds
the mapping `KimiK3PackedExperts` -> `PackedExpertsLoraLayer` to a `LoraConfig`, and PEFT's own dispatch,
``get_peft_model``, ``save_pretrained`` and ``PeftModel.from_pretrained(..., config=...)`` do the rest.

Why this socket and not ``target_parameters``: PEFT's `ParamWrapper` adapts an ``nn.Parameter`` by adding
``B @ A`` to the weight tensor itself, which for uint8 codes would mean dequantizing the whole layer on every
forward. Here the packed bytes stay frozen (uint8, no gradient) and each expert's low-rank term runs beside the
packed matmul.

The adapter is per expert, as PEFT's `ParamWrapper` makes it for the bf16 experts (``target_parameters``), in the
same layout: ``lora_A`` ``[E * r, D]`` / ``lora_B`` ``[2I, r * E]`` for ``gate_up``, ``lora_down_A`` ``[E * r, I]``
/ ``lora_down_B`` ``[D, r * E]`` for ``down``; expert ``e``'s delta is ``scaling * B[:, :, e] @ A[e]`` with ``A``
viewed ``[E, r, in]`` and ``B`` viewed ``[out, r, E]``. Per expert, not shared: each routed expert sees its own
tokens, so a shared term would adapt the average expert, and the bf16 experts' adapters are per expert too.

Merging re-quantizes: each merged expert's weight is dequantized, the delta added in fp32, and the sum rounded
back by the release's rule (`quantize_mxfp4_release`: compressed-tensors' E8M0 scale per 32 values and E2M1
round-to-nearest-even), with a `PackedMergeWarning` naming the layer, the adapters and how many bytes changed.
``unmerge`` puts the loaded bytes back exactly.
"""

from __future__ import annotations

import math
import warnings

import torch
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_adapters_to_merge
from torch import nn

from .conversion.quant import dequantize_mxfp4, quantize_mxfp4_release
from .ops.experts import _grouped_gemm
from .ops.mxfp4 import mxfp4_experts
from .quantization_kimi_k3 import KimiK3PackedExperts, KimiK3StreamedExperts, StreamedExpertsError

__all__ = ["PackedExpertsLoraLayer", "PackedMergeWarning", "StreamedExpertsLoraLayer", "packed_experts_lora"]

_STACKS = ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale")


class PackedMergeWarning(UserWarning):
    """An adapter merged into packed MXFP4 experts was rounded to MXFP4 (the merged model differs by that rounding)."""


def packed_experts_lora(config: LoraConfig) -> LoraConfig:
    """``config`` with `PackedExpertsLoraLayer` registered for `KimiK3PackedExperts` and `StreamedExpertsLoraLayer`
    for `KimiK3StreamedExperts` (PEFT's custom-module mapping,
    which ``adapter_config.json`` does not keep: pass a loaded config through here again, e.g.
    ``PeftModel.from_pretrained(model, path, config=packed_experts_lora(LoraConfig.from_pretrained(path)))``)."""
    if not isinstance(config, LoraConfig):
        raise TypeError(f"packed_experts_lora takes a peft.LoraConfig, got {type(config).__name__}")
    config._register_custom_module({KimiK3PackedExperts: PackedExpertsLoraLayer,
                                    KimiK3StreamedExperts: StreamedExpertsLoraLayer})
    return config


class PackedExpertsLoraLayer(nn.Module, LoraLayer):
    """A LoRA layer around `KimiK3PackedExperts`: the packed experts computed by ``"k3_mxfp4"``
    (`ops.mxfp4.mxfp4_experts`) with each active adapter's per-expert low-rank term added to both products. The
    packed stacks stay frozen; gradients reach the adapters, the activations and the routing weights."""

    adapter_layer_names = (*LoraLayer.adapter_layer_names, "lora_down_A", "lora_down_B")

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0,
                 lora_alpha: int = 1, **kwargs) -> None:  # fmt: skip
        super().__init__()
        LoraLayer.__init__(self, base_layer, **kwargs)
        self.lora_down_A = nn.ModuleDict({})
        self.lora_down_B = nn.ModuleDict({})
        self.layer_name = kwargs.get("target_name") or type(base_layer).__name__
        self._unmerged_bytes: tuple[torch.Tensor, ...] | None = None
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.hidden_dim, module.hidden_dim

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: LoraConfig, **kwargs) -> None:
        if r <= 0:
            raise ValueError(f"`r` should be a positive integer value but the value passed is {r}")
        unsupported = [name for name, on in (("use_dora", config.use_dora), ("lora_bias", config.lora_bias),
                                             ("fan_in_fan_out", config.fan_in_fan_out)) if on]  # fmt: skip
        if unsupported or self.resolve_lora_variant(config=config) is not None:
            raise ValueError(f"LoRA over packed MXFP4 experts (`{self.layer_name}`) is plain LoRA; unset "
                             f"{unsupported or 'the LoRA variant'} or leave the experts out of target_modules")
        base = self.get_base_layer()
        experts, hidden, inter = base.num_experts, base.hidden_dim, base.intermediate_dim
        self.r[adapter_name] = r
        self.lora_alpha[adapter_name] = lora_alpha
        self.scaling[adapter_name] = lora_alpha / (math.sqrt(r) if config.use_rslora else r)
        self.use_rslora[adapter_name] = config.use_rslora
        self.use_dora[adapter_name] = False
        self.lora_bias[adapter_name] = False
        dropout = nn.Dropout(p=config.lora_dropout) if config.lora_dropout > 0 else nn.Identity()
        self.lora_dropout[adapter_name] = dropout
        self.lora_A[adapter_name] = nn.Linear(hidden, r * experts, bias=False)
        self.lora_B[adapter_name] = nn.Linear(r * experts, 2 * inter, bias=False)
        self.lora_down_A[adapter_name] = nn.Linear(inter, r * experts, bias=False)
        self.lora_down_B[adapter_name] = nn.Linear(r * experts, hidden, bias=False)
        init = config.init_lora_weights
        if init not in (True, False, "gaussian"):
            raise ValueError(f"LoRA over packed MXFP4 experts takes init_lora_weights True, False or 'gaussian', "
                             f"got {init!r}")  # fmt: skip
        if init is not False:
            for a, b in ((self.lora_A, self.lora_B), (self.lora_down_A, self.lora_down_B)):
                if init is True:
                    nn.init.kaiming_uniform_(a[adapter_name].weight, a=math.sqrt(5))
                else:
                    nn.init.normal_(a[adapter_name].weight, std=1 / r)
                nn.init.zeros_(b[adapter_name].weight)
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def _get_base_layer_device_and_dtype(self, base_layer):
        return base_layer.gate_up_packed.device, None  # (uint8 codes: the adapters keep their own float dtype)

    def _deltas(self, a_dict: nn.ModuleDict, b_dict: nn.ModuleDict):
        """``f(rows, offsets)``: the active adapters' per-expert ``scaling * B_e A_e`` applied to sorted rows."""
        active = [name for name in self.active_adapters if name in a_dict]
        if not active:
            return None
        experts = self.get_base_layer().num_experts

        def delta(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            offsets = offsets.to(torch.int32)
            total = None
            for name in active:
                a, b = a_dict[name].weight, b_dict[name].weight
                r = self.r[name]
                x = self.lora_dropout[name](rows).to(a.dtype)
                down = _grouped_gemm(x, a.view(experts, r, -1).transpose(1, 2), offsets)  # [M, r]
                # B_e^T [r, out] for each e: one 2-D transpose, rows contiguous (a 3-D reversal copies element-wise)
                b_t = b.t().contiguous().view(r, experts, b.shape[0]).transpose(0, 1)
                up = _grouped_gemm(down, b_t, offsets)
                up = up * self.scaling[name]
                total = up if total is None else total + up
            valid = torch.arange(rows.shape[0], device=rows.device) < offsets[-1]  # (rows of no expert: none)
            return torch.where(valid.unsqueeze(-1), total, 0).to(rows.dtype)

        return delta

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args, **kwargs) -> torch.Tensor:  # fmt: skip
        base = self.get_base_layer()
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return base(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        if self.merged:
            return base(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        gate_up_delta = self._deltas(self.lora_A, self.lora_B)
        if gate_up_delta is None:
            return base(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        return self._with_deltas(hidden_states, top_k_index, top_k_weights, gate_up_delta,
                                 self._deltas(self.lora_down_A, self.lora_down_B))

    def _with_deltas(self, hidden_states, top_k_index, top_k_weights, gate_up_delta, down_delta) -> torch.Tensor:
        base = self.get_base_layer()
        return mxfp4_experts(hidden_states, top_k_index, top_k_weights, base.gate_up_packed, base.gate_up_scale,
                             base.down_packed, base.down_scale, base._apply_gate, gate_up_delta=gate_up_delta,
                             down_delta=down_delta)  # fmt: skip

    def get_delta_weight(self, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [E, 2I, D], down [E, D, I])`` fp32: the adapter's per-expert weight deltas."""
        experts = self.get_base_layer().num_experts
        r, scale = self.r[adapter], self.scaling[adapter]
        out = []
        for a, b in ((self.lora_A[adapter].weight, self.lora_B[adapter].weight),
                     (self.lora_down_A[adapter].weight, self.lora_down_B[adapter].weight)):  # fmt: skip
            a = a.float().view(experts, r, -1)
            b = b.float().view(b.shape[0], r, experts)
            out.append(torch.einsum("ore,eri->eoi", b, a) * scale)
        return out[0], out[1]

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Adds the adapters' deltas to the packed experts, re-quantized by the release's MXFP4 rule (the only way
        to keep them packed), and warns (`PackedMergeWarning`) with what was rounded. ``safe_merge`` is implied: a
        non-finite sum raises before any byte changes."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        base = self.get_base_layer()
        stacks = [getattr(base, name) for name in _STACKS]
        deltas = [self.get_delta_weight(name) for name in adapter_names]
        merged = []
        for side, (packed, scale) in enumerate((stacks[:2], stacks[2:])):
            new_packed, new_scale = torch.empty_like(packed), torch.empty_like(scale)
            for e in range(packed.shape[0]):
                w = dequantize_mxfp4(packed[e], scale[e], torch.float32)
                for delta in deltas:
                    w = w + delta[side][e].to(w.device)
                new_packed[e], new_scale[e] = quantize_mxfp4_release(w)  # (refuses non-finite sums)
            merged += [new_packed, new_scale]
        if self._unmerged_bytes is None:
            self._unmerged_bytes = tuple(t.clone() for t in stacks)
        changed = sum(int((new != old).sum()) for new, old in zip(merged, stacks))
        total = sum(t.numel() for t in stacks)
        with torch.no_grad():
            for target, new in zip(stacks, merged):
                target.copy_(new)
        self.merged_adapters.extend(adapter_names)
        warnings.warn(f"`{self.layer_name}`: adapters {adapter_names} merged into packed MXFP4 experts were rounded "
                      f"to MXFP4 by the release's rule (E8M0 scale per 32 values, E2M1 round-to-nearest-even): "
                      f"{changed} of {total} bytes changed; the merged model differs from the unmerged one by that "
                      "rounding (keep the adapter unmerged, or merge into a KimiK3Mxfp4Config(dequantize=True) model "
                      "for exact weights)", PackedMergeWarning, stacklevel=2)  # fmt: skip

    def unmerge(self) -> None:
        """Puts the packed bytes loaded before the first merge back (exactly)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        with torch.no_grad():
            for name, saved in zip(_STACKS, self._unmerged_bytes):
                getattr(self.get_base_layer(), name).copy_(saved)
        self._unmerged_bytes = None
        self.merged_adapters.clear()

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


class StreamedExpertsLoraLayer(PackedExpertsLoraLayer):
    """`PackedExpertsLoraLayer` around `KimiK3StreamedExperts` (``KimiK3Mxfp4Config(stream_experts=True)``): the
    same per-expert adapters, each read's low-rank terms added beside its packed products; the adapter it saves is
    the packed layer's, so it loads into a model with the experts in memory. Merging is refused: the experts are the
    checkpoint's files."""

    def _get_base_layer_device_and_dtype(self, base_layer):
        return None, None  # (no tensors: the adapters stay where they are made, and move with the model)

    def _with_deltas(self, hidden_states, top_k_index, top_k_weights, gate_up_delta, down_delta) -> torch.Tensor:
        device = self.lora_A[self.active_adapters[0]].weight.device if self.active_adapters[0] in self.lora_A else None
        if device is not None and device != hidden_states.device:
            raise RuntimeError(f"`{self.layer_name}`: the adapters are on {device}, the activations on "
                               f"{hidden_states.device}: move the PEFT model with .to({str(hidden_states.device)!r})")
        return self.get_base_layer()(hidden_states, top_k_index, top_k_weights, gate_up_delta=gate_up_delta,
                                     down_delta=down_delta)  # fmt: skip

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        if not check_adapters_to_merge(self, adapter_names):
            return
        raise StreamedExpertsError(
            f"`{self.layer_name}` streams its experts from the checkpoint's files, which merging would rewrite: save "
            "the adapter (save_pretrained) and merge it into a model loaded with KimiK3Mxfp4Config() (experts in "
            "memory), or keep it unmerged")
