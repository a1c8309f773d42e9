"""The release's MXFP4 routed experts kept packed (issue 46, docs/mxfp4.md "Loading and saving packed"): a
transformers quantizer, registered through transformers' public sockets (``register_quantization_config`` /
``register_quantizer``), that loads the release's compressed-tensors ``mxfp4-pack-quantized`` experts as they ship
and saves them back bit for bit.

* `KimiK3Mxfp4Config` (``quant_method="k3_mxfp4"``): ``from_pretrained(..., quantization_config=KimiK3Mxfp4Config())``
  keeps the experts packed, ``KimiK3Mxfp4Config(dequantize=True)`` dequantizes them (the model without the
  quantizer: what loading without a ``quantization_config`` gives).
* `KimiK3PackedExperts`: a MoE layer's experts as four frozen uint8 parameters (``gate_up_packed``,
  ``gate_up_scale``, ``down_packed``, ``down_scale``: the release tensors stacked, bytes unchanged; parameters, as
  gpt-oss's ``Mxfp4GptOssExperts`` holds its blocks, so accelerate offloads them as weights), computed by the
  experts function ``"k3_mxfp4"`` (`mxfp4_experts_forward`), registered in transformers' ``ALL_EXPERTS_FUNCTIONS``.
* `KimiK3Mxfp4HfQuantizer`: before the weights load, every `KimiK3Experts` becomes a `KimiK3PackedExperts` (on the
  meta device) and the experts' conversions (`FuseExperts`, which dequantizes) become `StackPackedExperts`, which
  stack each checkpoint tensor's bytes into its slice, shard by shard (no floating-point copy of a layer); after
  loading, `check_packed_experts` once per layer. Saving reverses the conversions (`SplitPackedExperts`: the release's
  per-expert names and bytes); ``config.json`` carries this ``quantization_config``, so the save reloads packed.
  With ``stream_experts=True`` every `KimiK3Experts` becomes a `KimiK3StreamedExperts` over one `ExpertStream` of
  the shards instead, and no conversion loads the experts (docs/mxfp4.md "Streaming the experts from disk").
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.integrations import use_experts_implementation
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .conversion.hf_mapping import FuseExperts, _expert_pattern, _recorded
from .conversion.quant import QuantFormatError, check_mxfp4_values, mxfp4_scale_2d
from .conversion.expert_stream import ExpertStream
from .conversion.streaming import mapped_page_releaser
from .modeling_kimi_k3 import GLU, KimiK3Experts, experts_widths
from .ops.kernel_layers import kernel_layer
from .ops.mxfp4 import MXFP4_EXPERTS, check_packed_experts, mxfp4_experts_forward
from .ops.mxfp4_stream import streamed_mxfp4_experts

K3_MXFP4 = "k3_mxfp4"  # the quant_method, and the experts-interface name (ops.mxfp4.MXFP4_EXPERTS)
_STACKS = {  # parameter -> (release projections stacked along the rows, release tensor kind)
    "gate_up_packed": (("w1", "w3"), "weight_packed"),
    "gate_up_scale": (("w1", "w3"), "weight_scale"),
    "down_packed": (("w2",), "weight_packed"),
    "down_scale": (("w2",), "weight_scale"),
}


@register_quantization_config(K3_MXFP4)
class KimiK3Mxfp4Config(QuantizationConfigMixin):
    """How ``from_pretrained`` takes the release's MXFP4 routed experts: packed (``dequantize=False``, the uint8
    bytes as they ship, computed by ``"k3_mxfp4"``) or dequantized to the model's dtype (``dequantize=True``).
    ``stream_experts=True`` leaves the packed experts in the checkpoint's files and reads each step's routed ones
    (`KimiK3StreamedExperts`), ``stream_experts_per_read`` experts at most in memory at a time."""

    def __init__(self, dequantize: bool = False, stream_experts: bool = False, stream_experts_per_read: int = 32,
                 **kwargs):  # fmt: skip
        self.quant_method = K3_MXFP4
        for name, value in (("dequantize", dequantize), ("stream_experts", stream_experts)):
            if not isinstance(value, bool):
                raise TypeError(f"KimiK3Mxfp4Config: {name} must be True or False, got {value!r}")
        if not isinstance(stream_experts_per_read, int) or isinstance(stream_experts_per_read, bool) \
                or stream_experts_per_read < 1:
            raise ValueError("KimiK3Mxfp4Config: stream_experts_per_read must be a positive integer (the most experts "
                             f"held in memory at once), got {stream_experts_per_read!r}")  # fmt: skip
        if dequantize and stream_experts:
            raise ValueError("KimiK3Mxfp4Config: stream_experts reads the packed bytes from disk; it cannot be "
                             "combined with dequantize=True")
        self.keep_packed = not dequantize
        self.stream_experts = stream_experts
        self.stream_experts_per_read = stream_experts_per_read

    def to_dict(self) -> dict:
        out = {"quant_method": self.quant_method, "dequantize": not self.keep_packed}
        if self.stream_experts:
            out.update(stream_experts=True, stream_experts_per_read=self.stream_experts_per_read)
        return out


@kernel_layer("k3_mxfp4_experts")  # (named for its MoE layer's decode kernel, `ops.moe.attach_sparse_moe`)
@use_experts_implementation
class KimiK3PackedExperts(nn.Module):
    """`KimiK3Experts` with the release's MXFP4 bytes as four uint8 parameters (docs/mxfp4.md "The layout per
    layer"): ``gate_up_packed [E, 2I, D/2]`` / ``gate_up_scale [E, 2I, D/32]`` (``w1`` rows then ``w3`` rows, as
    ``gate_up_proj``), ``down_packed [E, D, I/2]`` / ``down_scale [E, D, I/32]`` (``w2``). Frozen
    (``requires_grad=False``: optimizers over ``model.parameters()`` never step them); parameters rather than buffers
    so that accelerate's device maps and offload move them as weights. Gradients reach the activations and the
    routing weights. Its own forward is ``"k3_mxfp4"``'s."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = experts_widths(config)
        e, d, i = self.num_experts, self.hidden_dim, self.intermediate_dim
        if d % 32 or i % 32:
            raise QuantFormatError(f"MXFP4 experts need widths that are multiples of 32, got hidden {d}, "
                                   f"intermediate {i}: load with KimiK3Mxfp4Config(dequantize=True)")  # fmt: skip
        for name, shape in (("gate_up_packed", (e, 2 * i, d // 2)), ("gate_up_scale", (e, 2 * i, d // 32)),
                            ("down_packed", (e, d, i // 2)), ("down_scale", (e, d, i // 32))):  # fmt: skip
            setattr(self, name, nn.Parameter(torch.zeros(shape, dtype=torch.uint8), requires_grad=False))
        self.glu = GLU.from_config(config)

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        return self.glu.packed(gate_up_out)

    @property
    def qweight(self) -> torch.Tensor:
        """PEFT's name for a quantized layer's packed weight (GPTQ, AQLM): PEFT places adapters on its device."""
        return self.gate_up_packed

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return mxfp4_experts_forward(self, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, mxfp4 packed")  # fmt: skip


class KimiK3StreamedExperts(nn.Module):
    """A MoE layer's routed experts left in the checkpoint's files (``KimiK3Mxfp4Config(stream_experts=True)``,
    docs/mxfp4.md "Streaming the experts from disk"): each forward reads the packed bytes of the experts its tokens
    route to (`ExpertStream.read`, at most ``per_read`` at a time) and computes them as ``"k3_mxfp4"`` does
    (`streamed_mxfp4_experts`). No tensors: nothing of the experts is resident between forwards."""

    def __init__(self, config, stream: ExpertStream, key: str) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = experts_widths(config)
        self.glu = GLU.from_config(config)
        self.stream, self.key = stream, key

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        return self.glu.packed(gate_up_out)

    @property
    def qweight(self) -> torch.Tensor:
        """PEFT's name for a quantized layer's packed weight, where PEFT places adapters: the stream reads into host
        memory, so an empty uint8 tensor on the CPU (``model.to(device)`` moves the adapters with the model)."""
        return torch.empty(0, dtype=torch.uint8)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_delta=None, down_delta=None) -> torch.Tensor:  # fmt: skip
        """``gate_up_delta`` / ``down_delta``: low-rank terms beside the packed products (`peft_mxfp4`), as
        `streamed_mxfp4_experts` takes them."""
        stream, dtype = self.stream, hidden_states.dtype
        # autograd keeps the stacks a product ran on, so a later read must not overwrite them
        fresh = torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad
                                             or gate_up_delta is not None or down_delta is not None)
        stream.count_tokens(self.key, hidden_states.shape[0])
        return streamed_mxfp4_experts(hidden_states, top_k_index, top_k_weights, self.num_experts,
                                      lambda experts: stream.read(self.key, experts, dtype, fresh), stream.per_read,
                                      self._apply_gate, gate_up_delta=gate_up_delta,
                                      down_delta=down_delta)  # fmt: skip

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, mxfp4 streamed from disk")  # fmt: skip


class StreamedExpertsError(ValueError):
    """What a model streaming its experts from disk cannot do (save them: it holds none)."""


def expert_stream(model) -> ExpertStream | None:
    """The `ExpertStream` of a model loaded with ``KimiK3Mxfp4Config(stream_experts=True)`` (its counters say
    how many expert bytes it read per token: ``bytes_read``, ``tokens``, ``bytes_per_token``, ``reset()``), or
    None for any other model."""
    quantizer = getattr(model, "hf_quantizer", None)
    return getattr(quantizer, "stream", None) if isinstance(quantizer, KimiK3Mxfp4HfQuantizer) else None


# The release's per-expert tensors (after the loader's renaming) that a streaming load leaves in the files
_STREAMED_KEYS = r"(?:^|\.)layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\.w[123]\.weight_(?:packed|scale|shape)$"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class StackPackedExperts(ConversionOps):
    """Per-expert release tensors of one kind (``weight_packed`` or ``weight_scale``; lists in expert order) -> one
    stack of `KimiK3PackedExperts`: ``[E, rows, cols]`` uint8, ``w1`` rows then ``w3`` rows for ``gate_up``. The
    bytes are copied unchanged into a preallocated stack, expert by expert. Plain (bf16) experts are refused by name:
    packing them would quantize, which loading never does."""

    def __init__(self, projections: tuple[str, ...], kind: str):
        self.projections, self.kind = tuple(projections), kind

    @_recorded
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **kwargs):
        target = model.get_parameter(full_layer_name) if model is not None else None
        per_proj = []
        for proj in self.projections:
            if input_dict.pop(_expert_pattern(proj, "weight"), None):
                raise ValueError(f"`{full_layer_name}`: the checkpoint's experts are not MXFP4 (plain `{proj}.weight`):"
                                 " load it without quantization_config or with KimiK3Mxfp4Config(dequantize=True)")
            input_dict.pop(_expert_pattern(proj, "weight_shape"), None)  # (the packed shapes are checked instead)
            blocks = input_dict.pop(_expert_pattern(proj, self.kind), None) or []
            if self.kind == "weight_scale":
                blocks = [mxfp4_scale_2d(b) for b in blocks]
            per_proj.append(blocks)
        experts = len(per_proj[0])
        if any(len(b) != experts for b in per_proj) or (target is not None and experts != target.shape[0]):
            raise ValueError(f"`{full_layer_name}`: found {[len(b) for b in per_proj]} experts' "
                             f"{'/'.join(self.projections)}.{self.kind}, the model has "
                             f"{target.shape[0] if target is not None else '?'}")  # fmt: skip
        rows = per_proj[0][0].shape[0]
        stack = torch.empty(experts, rows * len(per_proj), per_proj[0][0].shape[1], dtype=torch.uint8)
        if target is not None and tuple(stack.shape) != tuple(target.shape):
            raise ValueError(f"`{full_layer_name}`: the experts' {self.kind} give {list(stack.shape)}, the model "
                             f"expects {list(target.shape)}")
        release = mapped_page_releaser()
        for p, blocks in enumerate(per_proj):
            for e, block in enumerate(blocks):
                if block.dtype != torch.uint8 or tuple(block.shape) != (rows, stack.shape[2]):
                    raise QuantFormatError(f"`{full_layer_name}`: expert {e} {self.projections[p]}: MXFP4 {self.kind} "
                                           f"has shape {list(block.shape)} ({block.dtype}), the model expects uint8 "
                                           f"{[rows, stack.shape[2]]}")  # fmt: skip
                stack[e, p * rows:(p + 1) * rows].copy_(block)
                release(block)  # (the file's pages of this expert leave the resident set once copied)
        return {target_patterns[0]: stack}

    @property
    def reverse_op(self) -> ConversionOps:
        return SplitPackedExperts(self.projections, self.kind)


class SplitPackedExperts(ConversionOps):
    """Saving: a stack of `KimiK3PackedExperts` -> the release's per-expert ``….experts.{e}.{w}.{kind}`` tensors
    (slices of the stack, the loaded bytes)."""

    def __init__(self, projections: tuple[str, ...], kind: str):
        self.projections, self.kind = tuple(projections), kind

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        stack = next(iter(input_dict.values()))
        stack = stack[0] if isinstance(stack, list) else stack
        out = {}
        for proj, part in zip(self.projections, torch.chunk(stack, len(self.projections), dim=1)):
            for e in range(part.shape[0]):
                out[f".experts.{e}.{proj}.{self.kind}"] = part[e].contiguous()
        return out

    @property
    def reverse_op(self) -> ConversionOps:
        return StackPackedExperts(self.projections, self.kind)


def packed_conversions(converter: WeightConverter) -> list[WeightConverter]:
    """The four `StackPackedExperts` converters replacing one of the registered experts converters (scope kept):
    ``gate_up_proj``'s gives ``gate_up_packed`` / ``gate_up_scale``, ``down_proj``'s ``down_packed`` / ``down_scale``."""
    side = "gate_up" if converter.operations[0].projections == ("w1", "w3") else "down"
    out = []
    for stack in (f"{side}_packed", f"{side}_scale"):
        projections, kind = _STACKS[stack]
        # the `kind` pattern first: saving names its outputs after the first source pattern
        sources = [_expert_pattern(p, kind) for p in projections]
        sources += [_expert_pattern(p, k) for p in projections for k in ("weight", "weight_shape")]
        out.append(converter.copy(sources, f".mlp.experts.{stack}", operations=[StackPackedExperts(projections, kind)]))
    return out


def _is_experts_converter(converter) -> bool:
    return isinstance(converter, WeightConverter) and any(isinstance(op, FuseExperts) for op in converter.operations)


@register_quantizer(K3_MXFP4)
class KimiK3Mxfp4HfQuantizer(HfQuantizer):
    """Keeps the release's MXFP4 routed experts packed (or, with ``dequantize=True``, leaves loading as it is without
    a quantizer). Decisions taken once, at load: the experts modules swapped, the conversions replaced."""

    requires_calibration = False
    stream: ExpertStream | None = None

    @property
    def packed(self) -> bool:
        return self.quantization_config.keep_packed

    @property
    def streaming(self) -> bool:
        return self.packed and self.quantization_config.stream_experts

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if not self.packed:
            return model
        if self.streaming:
            return self._stream_experts(model, checkpoint_files)
        swapped = 0
        for name, module in list(model.named_modules()):
            if isinstance(module, KimiK3Experts):
                parent, _, child = name.rpartition(".")
                with torch.device("meta"):
                    packed = KimiK3PackedExperts(module.config)
                setattr(model.get_submodule(parent), child, packed)
                swapped += 1
        if swapped:
            model.set_experts_implementation(MXFP4_EXPERTS)
        return model

    def _stream_experts(self, model, checkpoint_files):
        """Every `KimiK3Experts` becomes a `KimiK3StreamedExperts` over one `ExpertStream` of the checkpoint's
        shards (built from their headers; the experts' bytes are never loaded), and the checkpoint's expert tensors
        are expected to stay unread."""
        if not checkpoint_files:
            raise StreamedExpertsError("stream_experts reads the routed experts from the checkpoint's safetensors "
                                       "files: from_pretrained needs a checkpoint directory, not a state_dict")
        layers = {}
        for name, module in model.named_modules():
            if isinstance(module, KimiK3Experts):
                match = _LAYER.search(name + ".")
                if match is None or int(match.group(1)) in layers:
                    raise StreamedExpertsError(f"stream_experts: cannot tell which checkpoint layer `{name}` is")
                layers[int(match.group(1))] = (name, *experts_widths(module.config))
        self.stream = ExpertStream.from_checkpoint(checkpoint_files, layers,
                                                   self.quantization_config.stream_experts_per_read)
        for name, *_ in layers.values():
            parent, _, child = name.rpartition(".")
            streamed = KimiK3StreamedExperts(model.get_submodule(name).config, self.stream, name)
            setattr(model.get_submodule(parent), child, streamed)
        model._keys_to_ignore_on_load_unexpected = {*(model._keys_to_ignore_on_load_unexpected or ()), _STREAMED_KEYS}
        return model

    def update_weight_conversions(self, weight_conversions, model):
        if not self.packed:
            return weight_conversions
        if self.streaming:  # (the experts stay in the files: no conversion loads them)
            return [c for c in weight_conversions if not _is_experts_converter(c)]
        out = []
        for converter in weight_conversions:
            out.extend(packed_conversions(converter) if _is_experts_converter(converter) else [converter])
        return out

    def _process_model_after_weight_loading(self, model, **kwargs):
        if not self.packed:
            _remove_quantizer(model)  # (the model loading without a quantizer gives, its conversions kept for saving)
            return model
        dtype = model.dtype  # (the activations' dtype: a weight must be finite there, as when dequantized)
        for name, module in model.named_modules():
            if isinstance(module, KimiK3PackedExperts):
                with _onloaded(module):
                    _check_layer(name, module, dtype)
        return model

    def is_serializable(self, safe_serialization=None) -> bool:
        if self.streaming:
            raise StreamedExpertsError(
                "this model streams its routed experts from the checkpoint it was loaded from and holds none of them, "
                "so save_pretrained would write a checkpoint without experts: copy that checkpoint instead, or load "
                "it with KimiK3Mxfp4Config() (experts in memory) to save")
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # the packed experts are frozen (requires_grad=False); adapters and the other weights train

    @property
    def is_compileable(self) -> bool:
        return not self.streaming  # (a streamed layer reads files per step)


def _check_layer(name: str, experts: KimiK3PackedExperts, dtype: torch.dtype) -> None:
    """`check_packed_experts` on a loaded layer, a bad value named by expert and release tensor (`CheckpointError`,
    as a dequantizing load reports it)."""
    from .safetensors_header import CheckpointError

    stacks = (experts.gate_up_packed, experts.gate_up_scale, experts.down_packed, experts.down_scale)
    try:
        check_packed_experts(*stacks, dtype)
    except QuantFormatError as error:
        inter = experts.intermediate_dim
        for e in range(experts.num_experts):
            for proj, rows, packed, scale in (("w1", slice(0, inter), *stacks[:2]),
                                              ("w3", slice(inter, 2 * inter), *stacks[:2]),
                                              ("w2", slice(None), *stacks[2:])):  # fmt: skip
                try:
                    check_mxfp4_values(packed[e, rows], scale[e, rows], dtype)
                except QuantFormatError as found:
                    raise CheckpointError(f"`{name}`: expert {e} {proj}: {found}") from None
        raise CheckpointError(f"`{name}`: {error}") from None


def _onloaded(experts: KimiK3PackedExperts):
    """A disk- or cpu-offloaded layer's stacks loaded for the duration (accelerate's `align_module_device`: its hook
    holds the bytes, the module holds meta tensors until a forward)."""
    if experts.gate_up_packed.device.type != "meta":
        return contextlib.nullcontext()
    from accelerate.utils import align_module_device

    return align_module_device(experts)


def _remove_quantizer(model) -> None:
    """transformers' `HfQuantizer.remove_quantization_config` without dropping the load's conversions (which
    ``save_pretrained`` reverses)."""
    for name in ("hf_quantizer", "quantization_method"):
        if hasattr(model, name):
            delattr(model, name)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_is_quantized", False):
            config._is_quantized = False


ALL_EXPERTS_FUNCTIONS.register(K3_MXFP4, mxfp4_experts_forward)

__all__ = ["K3_MXFP4", "KimiK3Mxfp4Config", "KimiK3Mxfp4HfQuantizer", "KimiK3PackedExperts", "KimiK3StreamedExperts",
           "SplitPackedExperts", "StackPackedExperts", "StreamedExpertsError",
           "expert_stream", "packed_conversions"]  # fmt: skip
