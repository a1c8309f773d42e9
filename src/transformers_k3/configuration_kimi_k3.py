"""Kimi K3 configurations: the text decoder, the vision tower and the composite of both, as ``@strict`` dataclasses.

The official checkpoint's ``config.json`` is a composite ``kimi_k3`` config whose ``text_config`` says
``model_type: "kimi_linear"`` (a name transformers already owns) and whose ``vision_config`` says
``kimi_k3_vision``. Both load here unchanged: key names follow the official release (K3_SPEC.md section 1).
``KimiK3TextConfig`` is registered as ``kimi_k3_text`` so that a saved text-only model never collides with the
in-tree Kimi Linear; ``AutoConfig`` hands a flat ``kimi_linear`` config that carries any K3-only key to this class
(``KimiLinearAutoConfig``; transformers' own class is never changed).

Every field carries what it accepts (its type, a finite float32 value in its range, an enum value this
implementation builds); the ``validate_*`` methods, which ``@strict`` runs after construction and transformers runs
before saving, check the relations between fields. A bad value raises `KimiK3ConfigError` naming the field, the value
and what the field accepts, however it arrives (constructor, assignment, ``update``, ``from_pretrained`` keyword
arguments, ``save_pretrained``).
"""

# Annotations stay strings (PEP 563): `@strict` then leaves the type check to each field's own check, so a value of the
# wrong type is a `KimiK3ConfigError` naming the field like any other bad value.
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, ClassVar

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError
from transformers.configuration_utils import PreTrainedConfig
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)


class KimiK3ConfigError(StrictDataclassError):
    """A config field has a value the model cannot be built with. The message names the field, the value and what
    the field accepts. A `StrictDataclassError`, like the errors of transformers' own ``@strict`` configs (not a
    ``ValueError``, which ``@strict`` would wrap into its own error and so hide this class)."""


def _check(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise KimiK3ConfigError(f"Invalid Kimi K3 config field `{field}`: {message}")


def _shown(value: Any) -> str:
    """The value as an error message shows it (a nested config by its class, a long list cut short)."""
    if isinstance(value, PreTrainedConfig):
        return f"a {type(value).__name__}"
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


# --------------------------------------------------------------------------------------------------
# What a field accepts
# The model computes in float32 at most: a Python float beyond its range is inf there, and a norm eps below its
# smallest normal number rounds away.
_FP32_MAX = 3.4028234663852886e38
_FP32_TINY = 2.0**-126

# Sizes no K3 model comes near, refused before anything is built from them (a layer list is a Python list per layer,
# a weight a tensor per dimension product): the release has 93 layers, widths below 2^18 and about 2.8e12 parameters.
MAX_LAYERS = 4096
MAX_DIMENSION = 2**31 - 1
MAX_PARAMETERS = 10**14


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite float32-range number (``bool`` is not a number here; NaN fails the comparison)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= _FP32_MAX


class _Accepts:
    """What one field accepts on its own; calling it with the default gives the dataclass field, in the manner of
    transformers' ``interval(min=...)(default=...)``. ``test`` only ever sees a non-null value and must not raise."""

    def __init__(self, allowed: str, test, nullable: bool = False, why: str | None = None):
        self.allowed = allowed + (" or null" if nullable else "") + (f" ({why})" if why else "")
        self.test, self.nullable = test, nullable

    def check(self, field: str, value: Any) -> None:
        _check(self.nullable if value is None else self.test(value), field,
               f"must be {self.allowed}, got {_shown(value)}")

    def __call__(self, default: Any = dataclasses.MISSING) -> Any:
        return dataclasses.field(default=default, metadata={"accepts": self})


def _integer(minimum: int = 1, maximum: int | None = MAX_DIMENSION, nullable: bool = False, multiple_of: int = 1,
             why: str | None = None) -> _Accepts:
    """An integer; bounded by default, since widths, counts and ids size weights and no product of them is built
    unchecked."""
    allowed = (f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
               + (f" and a multiple of {multiple_of}" if multiple_of > 1 else ""))
    return _Accepts(allowed, lambda v: _is_int(v) and v >= minimum and (maximum is None or v <= maximum)
                    and v % multiple_of == 0, nullable, why)


_LAYERS = _integer(1, MAX_LAYERS, why="the layer lists and modules are built from it")


def _real(low: float | None = None, high: float | None = None, low_open: bool = False, high_open: bool = False,
          nullable: bool = False, why: str | None = None) -> _Accepts:
    def test(v):
        return _is_real(v) and (low is None or (v > low if low_open else v >= low)) and (
            high is None or (v < high if high_open else v <= high))

    if low is not None and high is not None:
        where = f"in {'(' if low_open else '['}{low!r}, {high!r}{')' if high_open else ']'}"
    else:
        where = f"{'>' if low_open else '>='} {low!r}" if low is not None else f"{'<' if high_open else '<='} {high!r}"
    return _Accepts(f"a finite (float32) number {where}", test, nullable, why)


def _factor(negative: bool = False, zero_ok: bool = False, nullable: bool = False, why: str | None = None) -> _Accepts:
    """A float the network multiplies or divides by: positive (negative with ``negative``), and a normal float32
    number, since a subnormal one (1e-320) is 0 or loses its digits there."""
    allowed = (f"a finite number {'< 0' if negative else '> 0'} whose magnitude is a normal float32 (>= 2**-126 ~ "
               f"1.18e-38, <= ~3.4e38)" + (", or 0" if zero_ok else ""))
    return _Accepts(allowed, lambda v: _is_real(v) and ((zero_ok and v == 0) or (
        abs(v) >= _FP32_TINY and (v < 0 if negative else v > 0))), nullable, why)


def _eps(nullable: bool = False, why: str | None = None) -> _Accepts:
    # positive, not rounding away in float32, and small against unit-scale activations (an eps of 1 or more swamps
    # the mean square it is added to and scales every output toward zero)
    return _real(_FP32_TINY, 1.0, high_open=True, nullable=nullable, why=why)


def _flag() -> _Accepts:
    return _Accepts("true or false", lambda v: isinstance(v, bool))


def _choice(*choices: Any, why: str | None = None) -> _Accepts:
    allowed = repr(choices[0]) if len(choices) == 1 else f"one of {choices!r}"
    # the type must match too: 0 == False and 1.0 == 1, but they are not the same setting
    return _Accepts(allowed, lambda v: any(type(v) is type(c) and v == c for c in choices), why=why)


def _list_of(allowed: str, item_ok, nullable: bool = False) -> _Accepts:
    return _Accepts(allowed, lambda v: isinstance(v, (list, tuple)) and all(item_ok(i) for i in v), nullable)


_LAYER_IDS = _list_of("a list of 1-based integer layer ids", _is_int)


class _KimiK3ConfigFields:
    """What the three configs share: a field assigned in any way (constructor, ``config.x = ...``, ``update``, the
    keyword arguments of ``from_pretrained``) is checked under its own name (an ``attribute_map`` alias included);
    ``update`` and ``from_dict(..., **kwargs)`` re-derive what the updated fields determine and re-validate."""

    def __setattr__(self, key, value):
        name = type(self).attribute_map.get(key, key)
        field = type(self).__dataclass_fields__.get(name)
        if field is not None and "accepts" in field.metadata:
            field.metadata["accepts"].check(name, value)
        super().__setattr__(key, value)

    def _check_fields(self) -> None:
        """Every field again: a list or dict field may have been changed in place."""
        for field in dataclasses.fields(self):
            if "accepts" in field.metadata:
                field.metadata["accepts"].check(field.name, getattr(self, field.name))

    def _check_parameter_count(self, field: str | None = None) -> None:
        count = self.parameter_count()
        if field is None:  # the size field furthest above its default (the release's): the likeliest culprit
            ratios = {f.name: getattr(self, f.name) / f.default for f in dataclasses.fields(self)
                      if "<=" in getattr(f.metadata.get("accepts"), "allowed", "")
                      and _is_int(getattr(self, f.name)) and _is_int(f.default) and f.default > 0}
            field = max(ratios, key=ratios.get) if ratios else "sizes"
        _check(count <= MAX_PARAMETERS, field,
               f"the config describes a model of about {count:.3g} parameters, more than the limit of "
               f"{MAX_PARAMETERS:.0e} (the K3 release has about 2.8e12); fix the size fields")

    def update(self, config_dict: dict[str, Any]):
        super().update(config_dict)
        self._refresh_derived({self.attribute_map.get(key, key) for key in config_dict})
        self.validate()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        # transformers sets the keyword arguments on the built config one by one: re-derive and check the whole
        result = super().from_dict(config_dict, **kwargs)
        config = result[0] if kwargs.get("return_unused_kwargs") else result
        updated = {config.attribute_map.get(key, key) for key in kwargs if key != "return_unused_kwargs"}
        if updated:
            config._refresh_derived(updated)
            config.validate()
        return result


# Fields the network multiplies its activations by in the model's own dtype (the others, the SiTU betas, the router's
# routed_scaling_factor and the norms' eps, are applied in float32, which the field checks cover): each must stay a
# normal, finite number in that dtype.
_FACTORS_IN_MODEL_DTYPE = ("logit_scale",)


def check_config_for_dtype(config, dtype) -> None:
    """Raises `KimiK3ConfigError` naming the field when a factor the network applies in ``dtype`` (the dtype the model
    is built in) becomes 0, subnormal or infinite there (``logit_scale=1e-6`` in float16 rounds every logit away)."""
    import torch

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return
    info = torch.finfo(dtype)
    for name in _FACTORS_IN_MODEL_DTYPE:
        value = getattr(text, name, None)
        if value is None:
            continue
        rounded = float(torch.tensor(float(value), dtype=dtype, device="cpu"))  # from_pretrained builds on meta
        _check(math.isfinite(rounded) and abs(rounded) >= info.tiny, name,
               f"{value!r} becomes {rounded!r} in {str(dtype).replace('torch.', '')}, the dtype the model is built in "
               f"(normal numbers there have magnitudes in [{info.tiny:.3g}, {info.max:.3g}]); choose a value in that "
               f"range or load the model in float32")


# --------------------------------------------------------------------------------------------------
# Text
# Keys of `linear_attn_config`, with the defaults of the K3 release (K3_SPEC.md section 1.3), and what each accepts
# (reported as `linear_attn_config.<key>`).
_LINEAR_ATTN_DEFAULTS: dict[str, Any] = {
    "num_heads": 96,
    "head_dim": 128,
    "short_conv_kernel_size": 4,
    "use_full_rank_gate": True,
    "gate_lower_bound": -5.0,
}
_LINEAR_ATTN_ACCEPTS: dict[str, _Accepts] = {
    "num_heads": _integer(),
    "head_dim": _integer(),
    "short_conv_kernel_size": _integer(),
    "use_full_rank_gate": _flag(),
    "gate_lower_bound": _factor(negative=True, nullable=True, why="K3: -5.0; null: the softplus forget gate"),
    "kda_layers": _LAYER_IDS,
    "full_attn_layers": _LAYER_IDS,
}


def _default_layer_lists(num_hidden_layers: int) -> dict[str, list[int]]:
    """The release's placement (K3_SPEC.md section 13): every 4th layer (1-based) is MLA, and so is the last
    one (93 layers: 4, 8, ..., 92 and 93, i.e. 24 MLA and 69 KDA layers); the rest are KDA."""
    n = num_hidden_layers
    full = [i for i in range(1, n + 1) if i % 4 == 0 or i == n]
    kda = [i for i in range(1, n + 1) if i not in full]
    return {"kda_layers": kda, "full_attn_layers": full}


class _ReleaseTokenId(int):
    """The default of a special-token id: the release's id (K3_SPEC.md section 13). A config that does not set
    the id and has a vocabulary too small for it gets ``None`` instead (the release's ids mean nothing
    there); an id a config sets is a plain ``int`` and is validated against ``vocab_size`` as usual."""


# Keys a config of the release's own remote code gains when transformers 5 re-saves it (K3_SPEC.md section 13):
# `head_dim` (hidden_size // num_attention_heads = 74, meaningless for K3; ours is derived, see `head_dim`) and
# the RoPE standardisation's `rope_parameters` (the text model has no RoPE). They are dropped with a debug log;
# a `rope_parameters` that would scale a RoPE is refused like `rope_scaling`.
_RESAVED_KEYS_DROPPED = ("head_dim", "rope_parameters")

# Quantities our text config derives (read-only properties), by the keys a config may carry them under: the
# in-tree Kimi Linear saves `qk_head_dim` and its `linear_*` copies of `linear_attn_config`. A given one is checked
# against the derived value instead of being set.
_DERIVED_KEYS = {
    "qk_head_dim": "qk_head_dim",
    "linear_num_heads": "linear_num_heads",
    "linear_head_dim": "linear_head_dim",
    "linear_conv_kernel_dim": "linear_conv_kernel_size",
    "linear_conv_kernel_size": "linear_conv_kernel_size",
    "use_full_rank_gate": "use_full_rank_gate",
    "gate_lower_bound": "gate_lower_bound",
    "use_attn_res": "use_attn_res",
    "num_attn_res_blocks": "num_attn_res_blocks",
}


def _is_no_rope_scaling(value: Any) -> bool:
    """``None`` or the default (no-op) RoPE type, also in transformers 5's per-layer-type nesting."""
    if value is None:
        return True
    if not isinstance(value, dict):
        return False
    if value and all(isinstance(v, dict) for v in value.values()):
        return all(_is_no_rope_scaling(v) for v in value.values())
    return value.get("rope_type", value.get("type", "default")) == "default"


def _token_ids(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


@strict
class KimiK3TextConfig(_KimiK3ConfigFields, PreTrainedConfig):
    r"""Configuration of the Kimi K3 text decoder (KDA + gated NoPE MLA, Block Attention Residuals, Stable Latent MoE
    with SiTU-GLU). Defaults are the values of the official release where K3_SPEC.md reads them from code ([R]/[C]);
    values the spec marks unknown use its inference ([I]) and are overridden by any real ``config.json``. Fields not
    listed below mean what they mean in `KimiLinearConfig` / `DeepseekV3Config`.

    The K3-only features can each be switched off, which turns the model into transformers' Kimi Linear.

    Args:
        hidden_act (`str`, defaults to `"situ"`): the experts' and dense MLPs' GLU activation, `"situ"` or `"silu"`.
        activation_situ_beta (`float`, *optional*, defaults to 4.0): SiTU's cap of the gate half (null: the default).
        activation_situ_linear_beta (`float`, *optional*, defaults to 25.0): cap of the up half (null: uncapped).
        pad_token_id / bos_token_id / eos_token_id (`int`, *optional*): the release's ids (163839 / 163584 / 163586)
            where they fit `vocab_size`, null otherwise.
        rope_theta / rope_scaling: not read (the text model has no RoPE); a scaling other than the default is refused.
        mla_use_nope (`bool`, defaults to `True`): K3's MLA applies no RoPE; only `True` is built.
        mla_use_output_gate (`bool`, defaults to `True`): the sigmoid output gate of MLA.
        routed_expert_hidden_size (`int`, *optional*, defaults to 3584): the latent width the routed experts run at
            (null: the full hidden size).
        latent_moe_use_norm (`bool`, defaults to `True`): the RMSNorm before the latent down-projection.
        router_fp32 (`bool`, defaults to `False`): computes the router's logits in float32.
        router_aux_loss_coef (`float`, defaults to 0.0): DeepSeek-V3's sequence-wise balance loss added to the LM
            loss (0: off; K3 balances with the selection bias, see `transformers_k3.balancing`).
        attn_res_block_size (`int`, *optional*, defaults to 12): layers per Block Attention Residuals block (null:
            the classic residual stream).
        linear_attn_config (`dict`, *optional*): the KDA settings `num_heads`, `head_dim`, `short_conv_kernel_size`,
            `use_full_rank_gate` (`False`: the low-rank output gate), `gate_lower_bound` (-5.0; null: the softplus
            forget gate) and the 1-based layer lists `kda_layers` / `full_attn_layers`; null: the release's.
        kda_o_norm_eps (`float`, defaults to 1e-5): eps of the KDA gated output norm (SGLang and vLLM hard-code it).
        mla_latent_norm_eps (`float`, *optional*, defaults to 1e-6): eps of the MLA `q_a` / `kv_a` norms, as the
            release's remote code builds them (SGLang, vLLM and llama.cpp use `rms_norm_eps`; null: that).
        logit_scale (`float`, defaults to 1.0): multiplies the LM head's logits.
        layer_types / mlp_layer_types (`list[str]`, *optional*): derived from `linear_attn_config` and from
            `num_experts` / `first_k_dense_replace` / `moe_layer_freq`; saved for transformers' masking utilities.

    A config re-saved by transformers 5 from the release's remote code loads: its ``head_dim`` and ``rope_parameters``
    are dropped (debug log), other keys the model does not read are kept as attributes (debug log).
    """

    model_type: ClassVar[str] = "kimi_k3_text"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values", "cache"]
    attribute_map: ClassVar[dict[str, str]] = {
        "num_experts_per_tok": "num_experts_per_token",
        "n_routed_experts": "num_experts",
        "num_local_experts": "num_experts",
        "n_shared_experts": "num_shared_experts",
        "norm_topk_prob": "moe_renormalize",
        "n_group": "num_expert_group",
    }
    # Tensor / expert / pipeline parallel plans, keyed by our module names (checked against the model in tests).
    # TP splits the experts (~98% of the weights: their partial outputs are summed by "moe_tp_experts"), the shared
    # experts and dense MLP (colwise, then rowwise with an all-reduce); the attention projections' weights are split
    # with their outputs gathered (the KDA recurrence, the MLA latent, the routers and the AttnRes reads run on
    # the full hidden state on every rank, as in transformers' Qwen3.5 / Kimi Linear plans). MLA's kv_b_proj stays
    # whole: the absorbed decode reads its weight per head.
    base_model_tp_plan: ClassVar[dict[str, str]] = {
        **{f"layers.*.self_attn.{name}": "colwise_gather_output"
           for name in ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "o_proj", "q_b_proj")},
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.routed_expert_down_proj": "colwise_gather_output",
        "layers.*.mlp.routed_expert_up_proj": "colwise_gather_output",
        "layers.*.mlp.shared_experts.gate_proj": "colwise",
        "layers.*.mlp.shared_experts.up_proj": "colwise",
        "layers.*.mlp.shared_experts.down_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_ep_plan: ClassVar[dict[str, str]] = {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }
    base_model_pp_plan: ClassVar[dict[str, Any]] = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    # Null is allowed where it has a meaning or where the field is not read in some configurations (the MoE sizes of
    # a dense model, `intermediate_size` of an all-MoE one); `validate_architecture` requires them where they are read.
    vocab_size: int = _integer()(163840)
    hidden_size: int = _integer()(7168)
    intermediate_size: int | None = _integer(nullable=True)(33792)
    num_hidden_layers: int = _LAYERS(93)
    num_attention_heads: int = _integer()(96)
    num_key_value_heads: int | None = _integer(maximum=None, nullable=True)(None)
    hidden_act: str = _choice("situ", "silu")("situ")
    activation_situ_beta: float | None = _factor(nullable=True, why="null: the SiTU default cap")(4.0)
    activation_situ_linear_beta: float | None = _factor(nullable=True, why="null: the up half is not capped")(25.0)
    rms_norm_eps: float = _eps()(1e-5)
    initializer_range: float = _real(0, 1, why="the std of the normal initialisation; K3: 0.02")(0.02)
    tie_word_embeddings: bool = _flag()(False)
    max_position_embeddings: int = _integer(maximum=None)(1048576)
    use_cache: bool = _flag()(True)
    pad_token_id: int | None = _integer(0, maximum=None, nullable=True)(_ReleaseTokenId(163839))
    bos_token_id: int | None = _integer(0, maximum=None, nullable=True)(_ReleaseTokenId(163584))
    eos_token_id: int | list[int] | None = _Accepts("a token id >= 0 or a list of them", lambda v: (
        _is_int(v) and v >= 0) or (isinstance(v, (list, tuple)) and all(_is_int(i) and i >= 0 for i in v)),
        nullable=True)(_ReleaseTokenId(163586))
    rope_theta: float | None = _real(0, low_open=True, nullable=True, why="not read: the text model has no RoPE")(None)
    rope_scaling: dict | None = _Accepts("a dict", lambda v: isinstance(v, dict), nullable=True)(None)
    # MLA
    q_lora_rank: int | None = _integer(nullable=True, why="null: a full-rank q_proj")(1536)
    kv_lora_rank: int = _integer()(512)
    qk_nope_head_dim: int = _integer()(128)
    qk_rope_head_dim: int = _integer(0)(64)
    v_head_dim: int = _integer()(128)
    mla_use_nope: bool = _choice(True, why="K3's MLA has no positional encoding and this implementation applies no "
                                           "RoPE")(True)
    mla_use_output_gate: bool = _flag()(True)
    attention_dropout: float = _real(0, 1, high_open=True)(0.0)
    # MoE
    num_experts: int | None = _integer(nullable=True, why="null: every layer dense")(896)
    num_experts_per_token: int | None = _integer(nullable=True)(16)
    num_shared_experts: int = _integer(0)(2)
    moe_intermediate_size: int | None = _integer(nullable=True)(3072)
    routed_expert_hidden_size: int | None = _integer(nullable=True, why="null: experts at full width")(3584)
    latent_moe_use_norm: bool = _flag()(True)
    first_k_dense_replace: int = _integer(0, maximum=None)(1)
    moe_layer_freq: int = _integer()(1)
    moe_router_activation_func: str = _choice("sigmoid", "softmax")("sigmoid")
    moe_renormalize: bool = _flag()(True)
    routed_scaling_factor: float = _factor()(1.0)
    topk_method: str = _choice("noaux_tc", why="the router always selects with the e_score_correction_bias, "
                                               "DeepSeek-V3's aux-loss-free top-k")("noaux_tc")
    use_grouped_topk: bool = _flag()(True)
    num_expert_group: int = _integer()(1)
    topk_group: int = _integer()(1)
    router_fp32: bool = _flag()(False)
    output_router_logits: bool = _flag()(False)
    router_aux_loss_coef: float = _factor(zero_ok=True, why="0: no balance loss")(0.0)
    num_nextn_predict_layers: int = _choice(0, why="K3 has no MTP head; this implementation builds none (SGLang "
                                                   "skips those tensors too)")(0)
    # Block Attention Residuals
    attn_res_block_size: int | None = _integer(nullable=True, why="null: classic residuals")(12)
    # KDA
    linear_attn_config: dict | None = _Accepts("a dict of the KDA settings", lambda v: isinstance(v, dict),
                                               nullable=True)(None)
    kda_o_norm_eps: float = _eps()(1e-5)
    mla_latent_norm_eps: float | None = _eps(nullable=True, why="null: rms_norm_eps")(1e-6)
    logit_scale: float = _factor()(1.0)
    # Derived (filled in __post_init__; saved so the in-tree masking utilities can read them)
    layer_types: list[str] | None = _list_of("a list of 'linear_attention' / 'full_attention'", lambda t: t in (
        "linear_attention", "full_attention"), nullable=True)(None)
    mlp_layer_types: list[str] | None = _list_of("a list of 'dense' / 'sparse'", lambda t: t in ("dense", "sparse"),
                                                 nullable=True)(None)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """transformers' reader, then the release's layouts made this class's: a composite (``kimi_k3``) file gives
        its ``text_config`` (with the composite's ``quantization_config`` and ``dtype`` where the text part has
        none), and the release's ``model_type: "kimi_linear"`` is this class's own, so no type-mismatch warning."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        text = config_dict.get("text_config")
        if config_dict.get("model_type") == KimiK3Config.model_type:
            KimiK3Config.__dataclass_fields__["text_config"].metadata["accepts"].check("text_config", text)
            text = dict(text or {})  # (null: the release's text config, as the composite reads it)
            for key in ("quantization_config", "dtype"):
                if key in config_dict and key not in text:
                    text[key] = config_dict[key]
            config_dict = text
        if config_dict.get("model_type") == "kimi_linear":
            config_dict = {**config_dict, "model_type": cls.model_type}
        return config_dict, kwargs

    def __post_init__(self, **kwargs):
        # The official text_config says "kimi_linear"; the class decides what it is, not the key.
        kwargs.pop("model_type", None)
        for key in _RESAVED_KEYS_DROPPED:
            if key in kwargs:
                value = kwargs.pop(key)
                if key == "rope_parameters":
                    _check(_is_no_rope_scaling(value), "rope_parameters",
                           f"must be null or the default RoPE type (no scaling): the K3 text model has no positional "
                           f"encoding (NoPE MLA), so a RoPE scaling cannot be honoured; got {value!r}")
                logger.debug(f"Kimi K3 text config: ignoring `{key}` = {value!r} (a key transformers 5 adds when it "
                             f"re-saves the release's config; the K3 text model does not read it)")
        derived_given = {key: kwargs.pop(key) for key in list(kwargs) if key in _DERIVED_KEYS}
        unread = sorted(k for k in kwargs if not k.startswith("_"))
        if unread:
            logger.debug(f"Kimi K3 text config: keys {unread} are not read by the K3 text model (kept as attributes)")
        super().__post_init__(**kwargs)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if type(value) is _ReleaseTokenId:  # the default, not set by the config
                setattr(self, name, int(value) if value < self.vocab_size else None)
        given = {name for name in ("layer_types", "mlp_layer_types") if getattr(self, name) is not None}
        self._refresh_derived({"linear_attn_config"} | given)
        _drop_dequantized_on_load_quantization(self)
        self.validate_architecture()  # (before the derived keys are compared with what it checks)
        for key, value in derived_given.items():
            name = _DERIVED_KEYS[key]
            derived = getattr(self, name)
            _check(value == derived and isinstance(value, bool) == isinstance(derived, bool), key,
                   f"is derived ({name} = {derived!r}, from the other fields) but the config says {_shown(value)}; "
                   f"drop the key or make the fields it follows agree")

    def _refresh_derived(self, updated: set[str]) -> None:
        """Complete `linear_attn_config` with the release's defaults (when null: also its layer placement), and
        recompute ``num_key_value_heads`` (MLA: one per query head) and the layer-type lists from the fields they
        follow; a layer-type list in ``updated`` (set by the caller) is kept and must agree."""
        if "linear_attn_config" in updated:
            lac = dict(_LINEAR_ATTN_DEFAULTS)
            if self.linear_attn_config is None:
                lac.update(_default_layer_lists(self.num_hidden_layers))
            else:
                lac.update(copy.deepcopy(self.linear_attn_config))
            self.linear_attn_config = lac
        if self.num_key_value_heads is None or (
            "num_attention_heads" in updated and "num_key_value_heads" not in updated
        ):
            self.num_key_value_heads = self.num_attention_heads
        for name, derived in self._derived_layer_types().items():
            if name in updated:
                self._check_agrees(name, derived)
            setattr(self, name, derived)

    def _derived_layer_types(self) -> dict[str, list[str]]:
        """``layer_types`` (from the 1-based lists of `linear_attn_config`) and ``mlp_layer_types`` (from
        num_experts / first_k_dense_replace / moe_layer_freq, which the layers read)."""
        lac = self.linear_attn_config
        _check(isinstance(lac, dict), "linear_attn_config",
               f"must be a dict of the KDA settings (null only when constructing: the release's), got {_shown(lac)}")
        for key in ("kda_layers", "full_attn_layers"):
            _check(key in lac, f"linear_attn_config.{key}", "is required (1-based layer ids)")
            _LINEAR_ATTN_ACCEPTS[key].check(f"linear_attn_config.{key}", lac[key])
        kda, full, n = list(lac["kda_layers"]), list(lac["full_attn_layers"]), self.num_hidden_layers
        bad = [i for i in kda + full if not 1 <= i <= n]
        _check(not bad, "linear_attn_config", f"layer ids {bad} are outside 1..num_hidden_layers={n} (ids are 1-based)")
        both = sorted(set(kda) & set(full))
        _check(not both, "linear_attn_config", f"layers {both} are listed as both KDA and full attention")
        missing = sorted(set(range(1, n + 1)) - set(kda) - set(full))
        _check(not missing, "linear_attn_config",
               f"layers {missing} are in neither `kda_layers` nor `full_attn_layers`; every layer 1..{n} needs a type")
        kda = set(kda)
        return {
            "layer_types": ["linear_attention" if i + 1 in kda else "full_attention" for i in range(n)],
            "mlp_layer_types": ["sparse" if self.is_moe_layer(i) else "dense" for i in range(n)],
        }

    def _check_agrees(self, name: str, derived: list[str]) -> None:
        value = getattr(self, name)
        sources = ("linear_attn_config's kda_layers / full_attn_layers" if name == "layer_types"
                   else "num_experts / first_k_dense_replace / moe_layer_freq")
        _check(value is not None and list(value) == derived, name,
               f"{_shown(value)} disagrees with {sources}, which make the layers {derived}; set those fields (or drop "
               f"{name})")

    # ----------------------------------------------------------------------------------------------
    # Derived quantities, read by the layers
    @property
    def linear_num_heads(self) -> int:
        return self.linear_attn_config["num_heads"]

    @property
    def linear_head_dim(self) -> int:
        return self.linear_attn_config["head_dim"]

    @property
    def linear_conv_kernel_size(self) -> int:
        return self.linear_attn_config["short_conv_kernel_size"]

    @property
    def use_full_rank_gate(self) -> bool:
        return bool(self.linear_attn_config["use_full_rank_gate"])

    @property
    def gate_lower_bound(self) -> float | None:
        return self.linear_attn_config["gate_lower_bound"]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        # transformers' generic utilities read `head_dim`; for MLA the query/key width is the natural one.
        return self.qk_head_dim

    @property
    def use_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def num_attn_res_blocks(self) -> int:
        """Rows of the AttnRes bank after the whole stack: ceil(L / S)."""
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size) if self.use_attn_res else 0

    def is_moe_layer(self, idx: int) -> bool:
        return self.num_experts is not None and idx >= self.first_k_dense_replace and idx % self.moe_layer_freq == 0

    def parameter_count(self) -> int:
        """The parameters of the model this config builds, computed from the fields alone (nothing is built): every
        weight matrix and expert tensor, without the per-channel vectors (norms, biases, decays), so a slight
        underestimate. Used to refuse absurd configs before anything is allocated."""
        hidden, lac = self.hidden_size, self.linear_attn_config or {}
        total = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        proj, head_dim = lac.get("num_heads", 1) * lac.get("head_dim", 1), lac.get("head_dim", 1)
        gate = hidden * proj if lac.get("use_full_rank_gate", True) else (hidden + proj) * head_dim
        kda = 4 * hidden * proj + proj * lac.get("short_conv_kernel_size", 1) * 3 + (hidden + proj) * head_dim + gate
        heads, qk = self.num_attention_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        q = hidden * heads * qk if self.q_lora_rank is None else (hidden + heads * qk) * self.q_lora_rank
        mla = (q + hidden * (self.kv_lora_rank + self.qk_rope_head_dim)
               + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
               + heads * self.v_head_dim * hidden * (2 if self.mla_use_output_gate else 1))
        width = self.routed_expert_hidden_size or hidden
        moe = ((self.num_experts or 0) * (hidden + 3 * width * (self.moe_intermediate_size or 0))
               + 3 * hidden * self.num_shared_experts * (self.moe_intermediate_size or 0)
               + (2 * hidden * width if self.routed_expert_hidden_size else 0))
        dense = 3 * hidden * (self.intermediate_size or 0)
        full = set(lac.get("full_attn_layers") or ())
        for i in range(self.num_hidden_layers):
            total += (mla if i + 1 in full else kda) + (moe if self.is_moe_layer(i) else dense)
        return total

    # ----------------------------------------------------------------------------------------------
    # Validation (run by `@strict` after construction and by transformers before saving)
    def validate_architecture(self):
        """Every field (a list or dict may have been changed in place) and the relations between them."""
        self._check_fields()
        _check(self.num_key_value_heads in (None, self.num_attention_heads), "num_key_value_heads",
               f"must equal num_attention_heads ({self.num_attention_heads}) or be null: MLA has one key/value head "
               f"per query head (no grouped-query attention); got {self.num_key_value_heads!r}")
        # {"rope_type": "default"} is no scaling at all (SGLang reads it as a no-op too); any other type would
        # scale a RoPE the model does not have, and its yarn mscale would change the attention scale
        scaling = self.rope_scaling
        _check(scaling is None or scaling.get("rope_type", scaling.get("type")) == "default", "rope_scaling",
               f"must be null (or {{'rope_type': 'default'}}, no scaling): the K3 text model has no positional "
               f"encoding (NoPE MLA), so a RoPE scaling (and its yarn mscale) cannot be honoured; got {scaling!r}")
        # KDA
        lac = self.linear_attn_config
        derived = self._derived_layer_types()  # also checks the layer lists
        unknown = sorted(set(lac) - set(_LINEAR_ATTN_ACCEPTS))
        _check(not unknown, "linear_attn_config", f"unknown keys {unknown}; the keys are {sorted(_LINEAR_ATTN_ACCEPTS)}")
        for key, accepts in _LINEAR_ATTN_ACCEPTS.items():
            _check(key in lac, f"linear_attn_config.{key}", f"is required ({accepts.allowed})")
            accepts.check(f"linear_attn_config.{key}", lac[key])
        for name, value in derived.items():
            self._check_agrees(name, value)
        # MoE
        if self.num_experts is not None:
            for name in ("num_experts_per_token", "moe_intermediate_size"):
                _check(getattr(self, name) is not None, name, "is required when num_experts is set (null: a dense "
                       "model, num_experts=null)")
            _check(self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
                   f"top-k ({self.num_experts_per_token}) must be <= num_experts ({self.num_experts})")
            _check(self.num_experts % self.num_expert_group == 0, "num_expert_group",
                   f"num_experts ({self.num_experts}) must be divisible by num_expert_group ({self.num_expert_group})")
            _check(self.topk_group <= self.num_expert_group, "topk_group",
                   f"({self.topk_group}) must be <= num_expert_group ({self.num_expert_group})")
            if self.num_expert_group > 1:
                per_group = self.num_experts // self.num_expert_group
                _check(per_group >= 2, "num_expert_group", "each expert group needs at least 2 experts")
                _check(self.topk_group * per_group >= self.num_experts_per_token, "topk_group",
                       f"the kept groups hold {self.topk_group * per_group} experts, fewer than top-k "
                       f"{self.num_experts_per_token}")
            # the router limits the choice to topk_group groups whenever there are groups
            _check(self.use_grouped_topk or self.num_expert_group == 1, "use_grouped_topk",
                   f"false asks for ungrouped routing, but with num_expert_group={self.num_expert_group} the router "
                   f"keeps only the topk_group best groups; set num_expert_group=1 (or use_grouped_topk=true)")
        # (first_k_dense_replace >= num_hidden_layers is allowed: every layer dense, as DeepSeek-style configs spell a
        # dense model)
        if "dense" in derived["mlp_layer_types"]:
            _check(self.intermediate_size is not None, "intermediate_size",
                   "is required: the dense layers' MLP width (an integer >= 1)")
        self._check_parameter_count()

    def validate_token_ids(self):
        """Every special-token id inside the vocabulary (transformers' own check only warns)."""
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            _check(all(i is None or i < self.vocab_size for i in _token_ids(value)), name,
                   f"must be a token id in [0, vocab_size={self.vocab_size}) (or null), got {_shown(value)}")

    @classmethod
    def tiny(cls, **overrides) -> "KimiK3TextConfig":
        """A few-hundred-kilobyte config with every K3 feature on, for tests and demos (K3_SPEC.md
        section 11): 6 layers (KDA 0,1,3,4; MLA 2,5), dense layer 0, latent MoE with norm on layers 1-5
        (8 experts, top-2, 1 shared), AttnRes blocks of 2 layers (3 bank rows), SiTU-GLU, the
        lower-bounded KDA gate, the MLA output gate. Keyword arguments override any field."""
        values: dict[str, Any] = dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, mla_use_nope=True, mla_use_output_gate=True, hidden_act="situ",
            activation_situ_beta=4.0, activation_situ_linear_beta=25.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
            moe_intermediate_size=32, routed_expert_hidden_size=32, latent_moe_use_norm=True,
            first_k_dense_replace=1, moe_layer_freq=1, moe_router_activation_func="sigmoid",
            moe_renormalize=True, routed_scaling_factor=2.5, topk_method="noaux_tc", num_expert_group=1,
            topk_group=1, attn_res_block_size=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            linear_attn_config={
                "kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6], "num_heads": 4, "head_dim": 16,
                "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0,
            },
        )
        lac_override = overrides.pop("linear_attn_config", None)
        if isinstance(lac_override, dict):
            values["linear_attn_config"] = {**values["linear_attn_config"], **lac_override}
        elif lac_override is not None:  # not a dict: the constructor says so
            values["linear_attn_config"] = lac_override
        values.update(overrides)
        return cls(**values)




# --------------------------------------------------------------------------------------------------
# Vision
@strict
class KimiK3VisionConfig(_KimiK3ConfigFields, PreTrainedConfig):
    r"""Configuration of the MoonViT3d vision tower and PatchMergerV2 projector (K3_SPEC.md 1.4). Official keys load
    unchanged; the ``vt_*`` names are the checkpoint's, the generic names (``hidden_size``...) are aliases. An enum
    with a single value names the one architecture this implementation builds: the tower and projector do not read it,
    so any other value would be silently ignored.

    Args:
        patch_size (`int`, defaults to 14): side of a square patch, in pixels.
        init_pos_emb_height / init_pos_emb_width (`int`, defaults to 64): the grid of learned position embeddings,
            interpolated (`pos_emb_interpolation_mode`, `"bilinear"` or `"bicubic"`) to each image's grid.
        init_pos_emb_time (`int`, defaults to 4): the most frames one video chunk can have.
        vt_num_attention_heads / vt_num_hidden_layers / vt_hidden_size / vt_intermediate_size: the tower's sizes
            (`vt_hidden_size` even: the video time embedding is sin/cos pairs).
        qkv_hidden_size (`int`, defaults to 1536): the attention width; its head dim is a multiple of 4 (2-D RoPE).
        attn_bias / linear_bias / patch_embed_proj_bias (`bool`, defaults to `False`): biases of those projections.
        activation_func (`str`, defaults to `"gelu_pytorch_tanh"`): the tower MLP's activation (or `"gelu"`).
        merge_kernel_size (`list[int]`, defaults to `[2, 2]`): `[height, width]` of the patches merged per token.
        mm_hidden_size (`int`, *optional*): the projector's input width per patch, `vt_hidden_size` (null: that).
        projector_hidden_act (`str`, defaults to `"gelu"`): the projector's exact (erf) GELU.
        projector_ln_eps (`float`, defaults to 1e-5): eps of the projector's norm.
        text_hidden_size (`int`): the text model's width the projector writes; the composite sets it.
    """

    model_type: ClassVar[str] = "kimi_k3_vision"
    attribute_map: ClassVar[dict[str, str]] = {
        "num_attention_heads": "vt_num_attention_heads",
        "num_hidden_layers": "vt_num_hidden_layers",
        "hidden_size": "vt_hidden_size",
        "intermediate_size": "vt_intermediate_size",
    }

    patch_size: int = _integer()(14)
    init_pos_emb_height: int = _integer()(64)
    init_pos_emb_width: int = _integer()(64)
    init_pos_emb_time: int = _integer(why="the most frames one video chunk can have")(4)
    pos_emb_type: str = _choice("divided_fixed")("divided_fixed")
    # (F.interpolate with align_corners=False: only the interpolating modes)
    pos_emb_interpolation_mode: str = _choice("bilinear", "bicubic")("bilinear")
    vt_num_attention_heads: int = _integer()(12)
    vt_num_hidden_layers: int = _LAYERS(27)
    vt_hidden_size: int = _integer(2, multiple_of=2, why="the video time embedding is sin/cos pairs")(1024)
    vt_intermediate_size: int = _integer()(4096)
    qkv_hidden_size: int = _integer()(1536)
    norm_type: str = _choice("rmsnorm")("rmsnorm")
    attn_bias: bool = _flag()(False)
    linear_bias: bool = _flag()(False)
    patch_embed_proj_bias: bool = _flag()(False)
    mlp_type: str = _choice("mlp2")("mlp2")
    activation_func: str = _choice("gelu_pytorch_tanh", "gelu")("gelu_pytorch_tanh")
    merge_kernel_size: list[int] | tuple[int, int] = _Accepts(
        "two integers >= 1 ([height, width] of a merged window)",
        lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_int(k) and k >= 1 for k in v))((2, 2))
    merge_type: str = _choice("sd2_tpool")("sd2_tpool")
    video_attn_type: str = _choice("spatial_temporal")("spatial_temporal")
    mm_projector_type: str = _choice("patchmergerv2")("patchmergerv2")
    mm_hidden_size: int | None = _integer(nullable=True, why="null: vt_hidden_size")(None)
    projector_hidden_act: str = _choice("gelu", why="the projector's GELU is the exact (erf) one")("gelu")
    projector_ln_eps: float = _eps()(1e-5)
    text_hidden_size: int = _integer()(2304)
    initializer_range: float = _real(0, 1, why="the std of the normal initialisation; K3: 0.02")(0.02)

    def __post_init__(self, **kwargs):
        kwargs.pop("model_type", None)
        super().__post_init__(**kwargs)
        self._refresh_derived(set())

    def _refresh_derived(self, updated: set[str]) -> None:
        self.merge_kernel_size = list(self.merge_kernel_size)
        if self.mm_hidden_size is None or ("vt_hidden_size" in updated and "mm_hidden_size" not in updated):
            self.mm_hidden_size = self.vt_hidden_size

    def parameter_count(self) -> int:
        """The tower's and projector's weight matrices (and position embeddings), from the fields alone; a slight
        underestimate (no norms or biases)."""
        hidden, merged = self.vt_hidden_size, self.vt_hidden_size * math.prod(self.merge_kernel_size)
        per_layer = 4 * hidden * self.qkv_hidden_size + 2 * hidden * self.vt_intermediate_size
        return (3 * self.patch_size**2 * hidden + self.init_pos_emb_height * self.init_pos_emb_width * hidden
                + self.vt_num_hidden_layers * per_layer + merged * merged + merged * self.text_hidden_size)

    def validate_architecture(self):
        """Every field and the relations between them."""
        self._check_fields()
        self._check_parameter_count()
        heads, qkv = self.vt_num_attention_heads, self.qkv_hidden_size
        _check(qkv % heads == 0, "qkv_hidden_size",
               f"({qkv}) must be divisible by vt_num_attention_heads ({heads})")
        _check((qkv // heads) % 4 == 0, "qkv_hidden_size",
               f"the head dim qkv_hidden_size / vt_num_attention_heads = {qkv // heads} must be a multiple of 4 for "
               f"the 2-D RoPE")
        # the projector takes the tower's merged windows, vt_hidden_size wide per patch
        _check(self.mm_hidden_size in (None, self.vt_hidden_size), "mm_hidden_size",
               f"must equal vt_hidden_size ({self.vt_hidden_size}) or be null, got {self.mm_hidden_size!r}")


# --------------------------------------------------------------------------------------------------
# Composite
MXFP4_GROUP_SIZE = 32  # the release's MXFP4 scheme: one E8M0 scale per 32 weights
_RELEASE_MEDIA_PLACEHOLDER_ID = 163605  # the release's <|media_pad|>


@strict
class KimiK3Config(_KimiK3ConfigFields, PreTrainedConfig):
    r"""The composite K3 config (``model_type: "kimi_k3"``): a text decoder and an optional vision tower.

    Args:
        text_config (`dict` or `KimiK3TextConfig`, *optional*): built as `KimiK3TextConfig` whatever its
            ``model_type`` key says; null: the release's.
        vision_config (`dict` or `KimiK3VisionConfig`, *optional*): null: a text-only composite.
        media_placeholder_token_id (`int`, *optional*): the token every image slot of a prompt holds; defaults to
            the release's ``<|media_pad|>`` (163605) where it fits the text vocabulary and to null otherwise (set it
            to your tokenizer's ``<|media_pad|>`` id to pass images).
        pad_token_id (`int`, *optional*): null: the text config's.
        ignore_index (`int`, defaults to -100): the label the loss ignores, transformers' default (not read).
        image_placeholder (`str`, defaults to `"<|kimi_image_placeholder|>"`): the prompt text of an image.
        tie_word_embeddings (`bool`, defaults to `False`).
    """

    model_type: ClassVar[str] = "kimi_k3"
    sub_configs_defaults: ClassVar[dict] = {"text_config": KimiK3TextConfig, "vision_config": KimiK3VisionConfig}

    text_config: dict | PreTrainedConfig | None = _Accepts(
        "a dict or a KimiK3TextConfig", lambda v: isinstance(v, (dict, KimiK3TextConfig)), nullable=True,
        why="null: the release's")(None)
    vision_config: dict | PreTrainedConfig | None = _Accepts(
        "a dict or a KimiK3VisionConfig", lambda v: isinstance(v, (dict, KimiK3VisionConfig)), nullable=True,
        why="null: a text-only composite")(None)
    media_placeholder_token_id: int | None = _integer(0, maximum=None, nullable=True)(
        _ReleaseTokenId(_RELEASE_MEDIA_PLACEHOLDER_ID))
    pad_token_id: int | None = _integer(0, maximum=None, nullable=True, why="null: the text config's")(None)
    ignore_index: int = _choice(-100, why="the loss ignores the label -100, transformers' default; it does not read "
                                          "this field")(-100)
    image_placeholder: str = _Accepts("a non-empty string", lambda v: isinstance(v, str) and v != "")(
        "<|kimi_image_placeholder|>")
    tie_word_embeddings: bool = _flag()(False)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """transformers' reader; a flat text config (the release's text-only ``kimi_linear`` layout, or ours) becomes
        a text-only composite holding it, instead of a composite of default-sized sub-configs."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") in ("kimi_linear", KimiK3TextConfig.model_type) \
                and "text_config" not in config_dict:
            outer = {key: config_dict[key] for key in ("quantization_config", "dtype") if key in config_dict}
            config_dict = {**outer, "model_type": cls.model_type, "text_config": config_dict}
        return config_dict, kwargs

    def __post_init__(self, **kwargs):
        kwargs.pop("model_type", None)
        has_vision = self.vision_config is not None
        super().__post_init__(**kwargs)
        _drop_dequantized_on_load_quantization(self)
        if not has_vision:
            # A text-only composite: the sub-config machinery filled in defaults; drop them again.
            self.vision_config = None
        text = self.text_config
        media = self.media_placeholder_token_id
        if type(media) is _ReleaseTokenId:  # the default, not set by the config
            self.media_placeholder_token_id = int(media) if media < text.vocab_size else None
            if self.media_placeholder_token_id is None and has_vision:
                logger.warning(f"Kimi K3 config: the release's <|media_pad|> id {int(media)} is outside this "
                               f"vocabulary (vocab_size={text.vocab_size}), so media_placeholder_token_id is null: "
                               f"set it to your tokenizer's <|media_pad|> id to pass images")
        if getattr(text, "quantization_config", None) is not None and not hasattr(self, "quantization_config"):
            self.quantization_config = text.quantization_config
        self._refresh_derived(set())

    def _refresh_derived(self, updated: set[str]) -> None:
        text = self.text_config
        if self.pad_token_id is None:
            self.pad_token_id = text.pad_token_id
        if self.vision_config is not None:
            self.vision_config.text_hidden_size = text.hidden_size

    def validate_architecture(self):
        """The composite's own fields, both sub-configs (all their validators) and the relations between them."""
        self._check_fields()
        text, vision = self.text_config, self.vision_config
        _check(isinstance(text, KimiK3TextConfig), "text_config", f"must be a KimiK3TextConfig, got {_shown(text)}")
        _check(vision is None or isinstance(vision, KimiK3VisionConfig), "vision_config",
               f"must be a KimiK3VisionConfig or null, got {_shown(vision)}")
        text.validate()
        if vision is not None:
            vision.validate()
            _check(vision.text_hidden_size == text.hidden_size, "vision_config.text_hidden_size",
                   f"({vision.text_hidden_size}) must equal text_config.hidden_size ({text.hidden_size}): the "
                   f"projector writes into the text model's embeddings")
        self._check_parameter_count(field="text_config")

    def validate_token_ids(self):
        """The media placeholder and pad ids inside the text vocabulary, and the placeholder no other special token."""
        text = self.text_config
        for name in ("media_placeholder_token_id", "pad_token_id"):
            value = getattr(self, name)
            _check(value is None or value < text.vocab_size, name,
                   f"must be a token id in [0, text_config.vocab_size={text.vocab_size}) (or null), got {value!r}")
        media = self.media_placeholder_token_id
        if media is not None:
            special = {self.pad_token_id, text.pad_token_id, text.bos_token_id, *_token_ids(text.eos_token_id)} - {None}
            # every occurrence of the id is an image slot: a pad, bos or eos token there would take an image's place
            _check(media not in special, "media_placeholder_token_id",
                   f"({media}) must differ from the pad / bos / eos token ids {sorted(special)}")

    def parameter_count(self) -> int:
        """`KimiK3TextConfig.parameter_count` plus the vision tower's, from the fields alone."""
        vision = self.vision_config.parameter_count() if self.vision_config is not None else 0
        return self.text_config.parameter_count() + vision

    def get_text_config(self, decoder=None, encoder=None) -> KimiK3TextConfig:
        return self.text_config

    @classmethod
    def tiny(cls, with_vision: bool = True, **text_overrides) -> "KimiK3Config":
        """The spec's section 11 tiny composite config (text as in `KimiK3TextConfig.tiny`)."""
        text = KimiK3TextConfig.tiny(**text_overrides)
        vision = None
        if with_vision:
            vision = KimiK3VisionConfig(
                patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4,
                vt_num_attention_heads=2, vt_num_hidden_layers=2, vt_hidden_size=32, vt_intermediate_size=64,
                qkv_hidden_size=32, merge_kernel_size=[2, 2], projector_ln_eps=1e-5, text_hidden_size=text.hidden_size,
            )
        return cls(text_config=text, vision_config=vision, media_placeholder_token_id=500, pad_token_id=0)


def is_mxfp4_scheme(quantization_config) -> bool:
    """True for a compressed-tensors config whose weight scheme is MXFP4 (the official K3 release): the
    format names mxfp4, or every config group quantises weights to 4-bit floats in symmetric groups of 32.
    Anything else (FP8, int4, ...) is not dequantised by this package at load time."""
    if quantization_config is None:
        return False
    qc = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    if str(qc.get("quant_method", "")).replace("_", "-") != "compressed-tensors":
        return False
    groups = qc.get("config_groups") or {}
    if "mxfp4" in str(qc.get("format", "")).lower():
        return True
    if not groups:
        return False
    for group in groups.values():
        weights = (group or {}).get("weights") or {}
        if "mxfp4" in str((group or {}).get("format", "")).lower():
            continue
        if not (weights.get("num_bits") == 4 and weights.get("type") == "float" and weights.get("strategy") == "group"
                and weights.get("group_size") == MXFP4_GROUP_SIZE and weights.get("symmetric", True)):
            return False
        if (group or {}).get("input_activations"):
            return False
    return True


def _drop_dequantized_on_load_quantization(config: PreTrainedConfig) -> None:
    """The official release's ``quantization_config`` (compressed-tensors MXFP4 on the routed experts)
    describes how the *checkpoint* stores experts. This package dequantises them while loading (the
    conversion mapping registered in `transformers_k3.conversion.hf_mapping`), so the model in memory is
    never quantized: drop the entry so that transformers does not build a compressed-tensors quantizer.
    Any other quantization scheme is left for transformers to handle."""
    if is_mxfp4_scheme(getattr(config, "quantization_config", None)):
        del config.quantization_config


# --------------------------------------------------------------------------------------------------
# Routing flat "kimi_linear" configs that are really K3
# Keys of `KimiK3TextConfig` that no Kimi Linear config has (neither transformers' in-tree one nor Moonshot's
# config.json): the in-tree class would drop them, so a flat config carrying any one of them, with any value, was
# written for K3 (test_config_validation checks that every other field of ours is a Kimi Linear key).
_K3_ONLY_KEYS = (
    "attn_res_block_size",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "mla_use_output_gate",
    "mla_latent_norm_eps",
    "kda_o_norm_eps",
    "logit_scale",
    "router_fp32",
)
# ... and the K3-only keys of its `linear_attn_config`
_K3_ONLY_LINEAR_ATTN_KEYS = ("use_full_rank_gate", "gate_lower_bound")
_K3_ARCHITECTURES = ("KimiK3LinearForCausalLM", "KimiK3ForCausalLM")


def is_k3_text_config_dict(config_dict: dict) -> bool:
    """True when a ``kimi_linear`` dict names a K3 architecture (as the release's text-only config and our
    ``save_pretrained`` do), uses SiTU, or carries any K3-only key, which the in-tree Kimi Linear would
    silently drop."""
    architectures = config_dict.get("architectures") or ()
    if isinstance(architectures, (list, tuple)) and any(a in _K3_ARCHITECTURES for a in architectures):
        return True
    if any(key in config_dict for key in _K3_ONLY_KEYS) or config_dict.get("hidden_act") == "situ":
        return True
    lac = config_dict.get("linear_attn_config")
    return isinstance(lac, dict) and any(key in lac for key in _K3_ONLY_LINEAR_ATTN_KEYS)


class KimiLinearAutoConfig(KimiLinearConfig):
    """What ``AutoConfig`` builds for ``model_type: "kimi_linear"`` once `transformers_k3.register` has run
    (``AutoConfig.register("kimi_linear", KimiLinearAutoConfig, exist_ok=True)``): a genuine Kimi Linear config
    becomes transformers' own `KimiLinearConfig`, unchanged; a flat K3 one (`is_k3_text_config_dict`) becomes
    `KimiK3TextConfig`, so ``AutoConfig`` / ``AutoModelForCausalLM`` reach our classes instead of the in-tree Kimi
    Linear, which would drop AttnRes, the latent MoE, the gates, the logit scale and the norm epsilons.
    No instance of this class exists; transformers' `KimiLinearConfig` itself is untouched, so building that class
    directly (``KimiLinearConfig(...)``, ``KimiLinearConfig.from_dict``) gives the in-tree config, as asked."""

    def __new__(cls, *args, **kwargs):
        # (an instance of another class is returned as is: Python then skips this class's __init__)
        if not args and is_k3_text_config_dict(kwargs):
            return KimiK3TextConfig(**kwargs)
        return KimiLinearConfig(*args, **kwargs)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        if is_k3_text_config_dict(config_dict):
            return KimiK3TextConfig.from_dict(config_dict, **kwargs)
        return KimiLinearConfig.from_dict(config_dict, **kwargs)


def is_composite_config_dict(config_dict: dict) -> bool:
    return config_dict.get("model_type") == KimiK3Config.model_type or "text_config" in config_dict


def load_k3_config(config_dict: dict) -> tuple[KimiK3Config | KimiK3TextConfig, bool]:
    """The K3 config for an official (or our) ``config.json`` dict, and whether it is the composite one.
    Raises `KimiK3ConfigError` naming the bad field."""
    config_dict = copy.deepcopy(config_dict)
    config_dict.pop("auto_map", None)  # remote code of the release; this package is the implementation
    if is_composite_config_dict(config_dict):
        return KimiK3Config.from_dict(config_dict), True
    return KimiK3TextConfig.from_dict(config_dict), False


__all__ = [
    "KimiK3Config", "KimiK3TextConfig", "KimiK3VisionConfig", "KimiK3ConfigError", "KimiLinearAutoConfig",
    "is_k3_text_config_dict",
]
