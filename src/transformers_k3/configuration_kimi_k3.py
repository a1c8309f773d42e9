"""Kimi K3 configurations.

The official checkpoint's ``config.json`` is a composite ``kimi_k3`` config whose ``text_config`` says
``model_type: "kimi_linear"`` (a name transformers already owns) and whose ``vision_config`` says
``kimi_k3_vision``. Both load here unchanged: key names follow the official release (K3_SPEC.md section 1),
and every field is checked with an error that names it.

``KimiK3TextConfig`` is registered as ``kimi_k3_text`` so that a saved text-only model never collides
with the in-tree Kimi Linear; a flat ``kimi_linear`` config that carries K3-only features is routed to
this class at load time (see ``_route_kimi_linear_configs``).
"""

from __future__ import annotations

import copy
import math
from typing import Any, ClassVar

from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Keys of `linear_attn_config`, with the defaults of the K3 release (K3_SPEC.md section 1.3).
_LINEAR_ATTN_DEFAULTS: dict[str, Any] = {
    "num_heads": 96,
    "head_dim": 128,
    "short_conv_kernel_size": 4,
    "use_full_rank_gate": True,
    "gate_lower_bound": -5.0,
}

_ALLOWED_ACTS = ("situ", "silu")


class KimiK3ConfigError(ValueError):
    """A config field has a value the model cannot be built with. The message names the field."""


def _check(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise KimiK3ConfigError(f"Invalid Kimi K3 config field `{field}`: {message}")


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


def _is_no_rope_scaling(value: Any) -> bool:
    """``None`` or the default (no-op) RoPE type, also in transformers 5's per-layer-type nesting."""
    if value is None:
        return True
    if not isinstance(value, dict):
        return False
    if value and all(isinstance(v, dict) for v in value.values()):
        return all(_is_no_rope_scaling(v) for v in value.values())
    return value.get("rope_type", value.get("type", "default")) == "default"


class KimiK3TextConfig(PreTrainedConfig):
    r"""Configuration of the Kimi K3 text decoder (KDA + gated NoPE MLA, Block Attention Residuals,
    Stable Latent MoE with SiTU-GLU).

    Defaults are the values of the official release where K3_SPEC.md reads them from code ([R]/[C]);
    values the spec marks unknown use its inference ([I]) and are overridden by any real ``config.json``.

    K3-only features can each be switched off, which turns the model into transformers' Kimi Linear:
    ``attn_res_block_size=None`` (classic pre-norm residuals), ``routed_expert_hidden_size=None`` (experts
    at full width), ``hidden_act="silu"`` (SiLU-GLU), ``linear_attn_config.gate_lower_bound=None``
    (softplus forget gate), ``linear_attn_config.use_full_rank_gate=False`` (low-rank ``g_a``/``g_b``
    output gate) and ``mla_use_output_gate=False``.

    Extra keys of ours (not in the official config, all defaulting to the official behaviour):
    ``kda_o_norm_eps`` (eps of the KDA gated output norm; 1e-5: SGLang and vLLM hard-code it, the release's
    modeling code passes ``rms_norm_eps``, 1e-5) and ``mla_latent_norm_eps`` (eps of the MLA ``q_a``/``kv_a``
    norms; default 1e-6, the release's own ``modeling_kimi_linear.py`` builds them without an eps argument, as
    do mlx-lm and transformers' Kimi Linear; SGLang, vLLM and llama.cpp use ``rms_norm_eps``, 1e-5;
    ``None`` = ``rms_norm_eps``).

    The special-token ids default to the release's (pad 163839, bos 163584, eos 163586) when they fit
    ``vocab_size`` and to ``None`` otherwise (a small config that sets no ids). A config re-saved by
    transformers 5 from the release's remote code loads: its ``head_dim`` and ``rope_parameters`` are dropped
    (debug log), other keys the model does not read are kept as attributes (debug log).
    """

    model_type: ClassVar[str] = "kimi_k3_text"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]
    attribute_map: ClassVar[dict[str, str]] = {
        "num_experts_per_tok": "num_experts_per_token",
        "n_routed_experts": "num_experts",
        "num_local_experts": "num_experts",
        "n_shared_experts": "num_shared_experts",
        "norm_topk_prob": "moe_renormalize",
        "n_group": "num_expert_group",
    }
    # Tensor / expert / pipeline parallel plans, keyed by our module names (checked against the model in tests).
    base_model_tp_plan: ClassVar[dict[str, str]] = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
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

    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 33792
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int | None = None
    hidden_act: str = "situ"
    activation_situ_beta: float | None = 4.0
    activation_situ_linear_beta: float | None = 25.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    use_cache: bool = True
    pad_token_id: int | None = _ReleaseTokenId(163839)
    bos_token_id: int | None = _ReleaseTokenId(163584)
    eos_token_id: int | list[int] | None = _ReleaseTokenId(163586)
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    # MLA
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    attention_dropout: float = 0.0
    # MoE
    num_experts: int | None = 896
    num_experts_per_token: int | None = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int | None = 3072
    routed_expert_hidden_size: int | None = 3584
    latent_moe_use_norm: bool = True
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    router_fp32: bool = False
    output_router_logits: bool = False
    # Optional DeepSeek-V3 sequence-wise balance loss added to the LM loss (0 = off; K3 balances with the
    # selection bias instead, see transformers_k3.balancing).
    router_aux_loss_coef: float = 0.0
    num_nextn_predict_layers: int = 0
    # Block Attention Residuals (None: classic residual stream, as in Kimi Linear)
    attn_res_block_size: int | None = 12
    # KDA
    linear_attn_config: dict | None = None
    kda_o_norm_eps: float = 1e-5
    mla_latent_norm_eps: float | None = 1e-6
    logit_scale: float = 1.0
    # Derived (filled in __post_init__; saved so the in-tree masking utilities can read them)
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None

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
        unread = sorted(k for k in kwargs if not k.startswith("_"))
        if unread:
            logger.debug(f"Kimi K3 text config: keys {unread} are not read by the K3 text model (kept as attributes)")
        super().__post_init__(**kwargs)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if type(value) is _ReleaseTokenId:  # the default, not set by the config
                setattr(self, name, int(value) if isinstance(self.vocab_size, int) and value < self.vocab_size else None)
        lac = dict(_LINEAR_ATTN_DEFAULTS)
        if self.linear_attn_config is None:
            lac.update(_default_layer_lists(self.num_hidden_layers))
        else:
            _check(isinstance(self.linear_attn_config, dict), "linear_attn_config", "must be a dict")
            lac.update(copy.deepcopy(self.linear_attn_config))
        self.linear_attn_config = lac
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.layer_types = self._layer_types_from_lists()
        derived = ["sparse" if self.is_moe_layer(i) else "dense" for i in range(self.num_hidden_layers)]
        # (informational: derived from num_experts / first_k_dense_replace / moe_layer_freq, which the layers read;
        # a saved config carries it, and a given one must say the same)
        _check(self.mlp_layer_types is None or list(self.mlp_layer_types) == derived, "mlp_layer_types",
               f"{self.mlp_layer_types!r} disagrees with num_experts / first_k_dense_replace / moe_layer_freq, which "
               f"make the layers {derived}; set those fields (or drop mlp_layer_types)")
        self.mlp_layer_types = derived
        _drop_dequantized_on_load_quantization(self)
        self.validate_k3()

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
        return (
            self.num_experts is not None
            and idx >= self.first_k_dense_replace
            and idx % self.moe_layer_freq == 0
        )

    def _layer_types_from_lists(self) -> list[str]:
        lac = self.linear_attn_config
        for key in ("kda_layers", "full_attn_layers"):
            _check(key in lac, f"linear_attn_config.{key}", "is required (1-based layer ids)")
            _check(
                isinstance(lac[key], (list, tuple)) and all(isinstance(i, int) for i in lac[key]),
                f"linear_attn_config.{key}",
                f"must be a list of 1-based integer layer ids, got {lac[key]!r}",
            )
        kda, full = list(lac["kda_layers"]), list(lac["full_attn_layers"])
        n = self.num_hidden_layers
        bad = [i for i in kda + full if not 1 <= i <= n]
        _check(not bad, "linear_attn_config", f"layer ids {bad} are outside 1..num_hidden_layers={n} (ids are 1-based)")
        both = sorted(set(kda) & set(full))
        _check(not both, "linear_attn_config", f"layers {both} are listed as both KDA and full attention")
        missing = sorted(set(range(1, n + 1)) - set(kda) - set(full))
        _check(
            not missing,
            "linear_attn_config",
            f"layers {missing} are in neither `kda_layers` nor `full_attn_layers`; every layer 1..{n} needs a type",
        )
        kda_set = set(kda)
        return ["linear_attention" if i + 1 in kda_set else "full_attention" for i in range(n)]

    # ----------------------------------------------------------------------------------------------
    def validate_k3(self) -> None:
        """Checks every field the model reads; raises `KimiK3ConfigError` naming the first bad one."""

        def positive(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            _check(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
                   f"must be a positive integer, got {value!r}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "v_head_dim"):
            positive(name)
        positive("q_lora_rank", allow_none=True)
        positive("max_position_embeddings")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name, None)
            ids = value if isinstance(value, (list, tuple)) else [value]
            _check(all(i is None or (isinstance(i, int) and 0 <= i < self.vocab_size) for i in ids), name,
                   f"must be a token id in [0, vocab_size={self.vocab_size}) (or null), got {value!r}")
        _check(isinstance(self.attention_dropout, (int, float)) and 0 <= self.attention_dropout < 1,
               "attention_dropout", f"must be a probability in [0, 1), got {self.attention_dropout!r}")
        _check(isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim >= 0, "qk_rope_head_dim",
               f"must be a non-negative integer, got {self.qk_rope_head_dim!r}")
        _check(self.hidden_act in _ALLOWED_ACTS, "hidden_act",
               f"must be one of {_ALLOWED_ACTS}, got {self.hidden_act!r}")
        if self.hidden_act == "situ":
            for name in ("activation_situ_beta", "activation_situ_linear_beta"):
                value = getattr(self, name)
                _check(value is None or (isinstance(value, (int, float)) and value > 0), name,
                       f"must be a positive number or null, got {value!r}")
        for name in ("rms_norm_eps", "kda_o_norm_eps"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and value > 0, name, f"must be a positive number, got {value!r}")
        _check(self.mla_latent_norm_eps is None or self.mla_latent_norm_eps > 0, "mla_latent_norm_eps",
               "must be a positive number or null")
        # {"rope_type": "default"} is no scaling at all (SGLang reads it as a no-op too); any other type would
        # scale a RoPE the model does not have, and its yarn mscale would change the attention scale
        scaling = self.rope_scaling
        _check(scaling is None or (isinstance(scaling, dict)
                                   and scaling.get("rope_type", scaling.get("type")) == "default"), "rope_scaling",
               f"must be null (or {{'rope_type': 'default'}}, no scaling): the K3 text model has no positional "
               f"encoding (NoPE MLA), so a RoPE scaling (and its yarn mscale) cannot be honoured; got {scaling!r}")

        # KDA
        lac = self.linear_attn_config
        for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
            value = lac[key]
            _check(isinstance(value, int) and value > 0, f"linear_attn_config.{key}",
                   f"must be a positive integer, got {value!r}")
        lb = lac["gate_lower_bound"]
        _check(lb is None or (isinstance(lb, (int, float)) and lb < 0), "linear_attn_config.gate_lower_bound",
               f"must be a negative number (K3: -5.0) or null for the softplus gate, got {lb!r}")
        unknown = sorted(set(lac) - set(_LINEAR_ATTN_DEFAULTS) - {"kda_layers", "full_attn_layers"})
        _check(not unknown, "linear_attn_config", f"unknown keys {unknown}")

        # MoE
        if self.num_experts is not None:
            positive("num_experts")
            positive("num_experts_per_token")
            positive("moe_intermediate_size")
            positive("routed_expert_hidden_size", allow_none=True)
            _check(self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
                   f"top-k ({self.num_experts_per_token}) must be <= num_experts ({self.num_experts})")
            _check(self.moe_router_activation_func in ("sigmoid", "softmax"), "moe_router_activation_func",
                   f"must be 'sigmoid' or 'softmax', got {self.moe_router_activation_func!r}")
            _check(isinstance(self.num_shared_experts, int) and self.num_shared_experts >= 0, "num_shared_experts",
                   f"must be a non-negative integer, got {self.num_shared_experts!r}")
            positive("num_expert_group")
            positive("topk_group")
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
            positive("moe_layer_freq")
            # (>= num_hidden_layers is allowed: every layer dense, as DeepSeek-style configs spell a dense model)
            _check(isinstance(self.first_k_dense_replace, int) and self.first_k_dense_replace >= 0,
                   "first_k_dense_replace", f"must be a non-negative integer, got {self.first_k_dense_replace!r}")
            _check(isinstance(self.routed_scaling_factor, (int, float)) and self.routed_scaling_factor > 0,
                   "routed_scaling_factor", f"must be a positive number, got {self.routed_scaling_factor!r}")
            _check(isinstance(self.router_aux_loss_coef, (int, float)) and self.router_aux_loss_coef >= 0,
                   "router_aux_loss_coef", f"must be a number >= 0, got {self.router_aux_loss_coef!r}")
        if any(t == "dense" for t in self.mlp_layer_types):
            positive("intermediate_size")
        _check(self.num_nextn_predict_layers == 0, "num_nextn_predict_layers",
               "K3 has no MTP head; this implementation builds none (SGLang skips those tensors too)")

        # AttnRes
        positive("attn_res_block_size", allow_none=True)

    # ----------------------------------------------------------------------------------------------
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
        if lac_override is not None:
            values["linear_attn_config"] = {**values["linear_attn_config"], **lac_override}
        values.update(overrides)
        return cls(**values)


class KimiK3VisionConfig(PreTrainedConfig):
    """Configuration of the MoonViT3d vision tower and PatchMergerV2 projector (K3_SPEC.md 1.4). Official
    keys load unchanged; the ``vt_*`` names are the checkpoint's, the generic names are aliases."""

    model_type: ClassVar[str] = "kimi_k3_vision"
    attribute_map: ClassVar[dict[str, str]] = {
        "num_attention_heads": "vt_num_attention_heads",
        "num_hidden_layers": "vt_num_hidden_layers",
        "hidden_size": "vt_hidden_size",
        "intermediate_size": "vt_intermediate_size",
    }

    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    vt_hidden_size: int = 1024
    vt_intermediate_size: int = 4096
    qkv_hidden_size: int = 1536
    norm_type: str = "rmsnorm"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    mlp_type: str = "mlp2"
    activation_func: str = "gelu_pytorch_tanh"
    merge_kernel_size: list[int] | tuple[int, int] = (2, 2)
    merge_type: str = "sd2_tpool"
    video_attn_type: str = "spatial_temporal"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int | None = None
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 2304
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        kwargs.pop("model_type", None)
        super().__post_init__(**kwargs)
        self.merge_kernel_size = list(self.merge_kernel_size)
        if self.mm_hidden_size is None:
            self.mm_hidden_size = self.vt_hidden_size
        checks = {
            "pos_emb_type": ("divided_fixed",),
            "merge_type": ("sd2_tpool",),
            "mm_projector_type": ("patchmergerv2",),
            "norm_type": ("rmsnorm",),
            "mlp_type": ("mlp2",),
            "activation_func": ("gelu_pytorch_tanh", "gelu"),
            "video_attn_type": ("spatial_temporal",),
        }
        for name, allowed in checks.items():
            _check(getattr(self, name) in allowed, name, f"must be one of {allowed}, got {getattr(self, name)!r}")
        _check(self.qkv_hidden_size % self.vt_num_attention_heads == 0, "qkv_hidden_size",
               f"({self.qkv_hidden_size}) must be divisible by vt_num_attention_heads ({self.vt_num_attention_heads})")
        _check((self.qkv_hidden_size // self.vt_num_attention_heads) % 4 == 0, "qkv_hidden_size",
               "the head dim must be divisible by 4 for the 2-D RoPE")
        _check(len(self.merge_kernel_size) == 2, "merge_kernel_size", "must be two integers")


class KimiK3Config(PreTrainedConfig):
    """The composite K3 config (``model_type: "kimi_k3"``): ``text_config`` (built as `KimiK3TextConfig`
    whatever its ``model_type`` key says) and an optional ``vision_config``."""

    model_type: ClassVar[str] = "kimi_k3"
    sub_configs_defaults: ClassVar[dict] = {"text_config": KimiK3TextConfig, "vision_config": KimiK3VisionConfig}

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    media_placeholder_token_id: int = 163605
    # None: the text config's (the release's 163839 by default)
    pad_token_id: int | None = None
    ignore_index: int = -100
    image_placeholder: str = "<|kimi_image_placeholder|>"
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        kwargs.pop("model_type", None)
        has_vision = self.vision_config is not None
        super().__post_init__(**kwargs)
        _drop_dequantized_on_load_quantization(self)
        if not has_vision:
            # A text-only composite: the sub-config machinery filled in defaults; drop them again.
            self.vision_config = None
        text = self.text_config
        if self.pad_token_id is None:
            self.pad_token_id = text.pad_token_id
        if getattr(text, "quantization_config", None) is not None and not hasattr(self, "quantization_config"):
            self.quantization_config = text.quantization_config
        if self.vision_config is not None:
            self.vision_config.text_hidden_size = text.hidden_size

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


def _drop_dequantized_on_load_quantization(config: PreTrainedConfig) -> None:
    """The official release's ``quantization_config`` (compressed-tensors MXFP4 on the routed experts)
    describes how the *checkpoint* stores experts. This package dequantises them while loading (the
    conversion mapping registered in `transformers_k3.conversion.hf_mapping`), so the model in memory is
    never quantized: drop the entry so that transformers does not build a compressed-tensors quantizer.
    Any other quantization scheme is left for transformers to handle."""
    from .conversion.quant import is_mxfp4_scheme

    if is_mxfp4_scheme(getattr(config, "quantization_config", None)):
        del config.quantization_config


# --------------------------------------------------------------------------------------------------
# Routing flat "kimi_linear" configs that are really K3
_K3_ONLY_KEYS = (
    "attn_res_block_size",
    "routed_expert_hidden_size",
    "activation_situ_beta",
    "activation_situ_linear_beta",
)


def is_k3_text_config_dict(config_dict: dict) -> bool:
    """True when a ``kimi_linear`` dict names a K3 architecture (as the release's text-only config and our
    ``save_pretrained`` do) or uses a feature the in-tree Kimi Linear would silently drop."""
    if set(config_dict.get("architectures") or ()) & {"KimiK3LinearForCausalLM", "KimiK3ForCausalLM"}:
        return True
    if any(config_dict.get(key) is not None for key in _K3_ONLY_KEYS):
        return True
    if config_dict.get("hidden_act") == "situ" or config_dict.get("mla_use_output_gate"):
        return True
    lac = config_dict.get("linear_attn_config") or {}
    return bool(lac.get("use_full_rank_gate")) or lac.get("gate_lower_bound") is not None


def _route_kimi_linear_configs() -> None:
    """Make ``AutoConfig`` (and ``KimiLinearConfig.from_pretrained``) hand a flat K3 ``kimi_linear``
    config to `KimiK3TextConfig`, so it reaches our model classes instead of loading silently into the
    in-tree Kimi Linear, which would drop AttnRes, the latent MoE and the gates. Idempotent."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    if getattr(KimiLinearConfig, "_k3_routed", False):
        return
    original = KimiLinearConfig.from_dict.__func__

    def from_dict(cls, config_dict, **kwargs):
        if issubclass(KimiLinearConfig, cls) and is_k3_text_config_dict(config_dict):
            return KimiK3TextConfig.from_dict(config_dict, **kwargs)
        return original(cls, config_dict, **kwargs)

    KimiLinearConfig.from_dict = classmethod(from_dict)
    KimiLinearConfig._k3_routed = True


__all__ = ["KimiK3Config", "KimiK3TextConfig", "KimiK3VisionConfig", "KimiK3ConfigError", "is_k3_text_config_dict"]
