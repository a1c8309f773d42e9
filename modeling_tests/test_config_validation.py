"""Strict config validation (issue 27, "no silent wrong answer"): every field of the text, vision and composite
configs is checked for type, range and (for enums) value, with a `KimiK3ConfigError` that names the field and the
value; the checks hold however a value arrives (constructor, assignment, ``update``, ``from_pretrained`` keyword
arguments, ``save_pretrained``); and a flat ``kimi_linear`` config carrying any K3-only key reaches our classes.

The fuzz test at the end states what each field accepts from the field's meaning (written out here, not read from
the implementation) and checks every seeded case: a value outside that must raise, a value inside it must build a
tiny model whose logits on a few tokens are finite."""

import copy
import dataclasses
import json
import math
import random
import re
import zlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

import transformers_k3
from transformers_k3 import (
    KimiK3Config,
    KimiK3ConfigError,
    KimiK3ForCausalLM,
    KimiK3ForConditionalGeneration,
    KimiK3TextConfig,
    KimiK3VisionConfig,
)
from transformers_k3.configuration_kimi_k3 import _K3_ONLY_KEYS, _K3_ONLY_LINEAR_ATTN_KEYS

NAN, INF = float("nan"), float("inf")
FP32_MAX = 3.4028234663852886e38
FP32_TINY = 2.0**-126

# The tiny composite's vision config (`KimiK3Config.tiny`), spelled out so that a single field can be changed
# (`mm_hidden_size` is left to follow `vt_hidden_size`).
TINY_VISION = dict(
    patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4, vt_num_attention_heads=2,
    vt_num_hidden_layers=2, vt_hidden_size=32, vt_intermediate_size=64, qkv_hidden_size=32, merge_kernel_size=[2, 2],
    projector_ln_eps=1e-5, text_hidden_size=64,
)
MEDIA_ID = 500  # the tiny composite's <|media_pad|> (vocab 512; pad 0, bos 1, eos 2)


def raises(field, value):
    """pytest.raises for a `KimiK3ConfigError` whose message names `field` and shows `value`."""
    return pytest.raises(KimiK3ConfigError, match=rf"`{re.escape(field)}`.*{re.escape(repr(value))}")


def composite(vision_overrides=None, **composite_fields):
    fields = dict(media_placeholder_token_id=MEDIA_ID, pad_token_id=0)
    fields.update(composite_fields)
    vision = KimiK3VisionConfig(**{**TINY_VISION, **(vision_overrides or {})})
    return KimiK3Config(text_config=KimiK3TextConfig.tiny(), vision_config=vision, **fields)


# --------------------------------------------------------------------------------------------------
# The cases of the issue, one test each
@pytest.mark.parametrize(
    "field, value, build",
    [
        ("logit_scale", NAN, lambda v: KimiK3TextConfig.tiny(logit_scale=v)),
        ("routed_scaling_factor", INF, lambda v: KimiK3TextConfig.tiny(routed_scaling_factor=v)),
        ("linear_attn_config.gate_lower_bound", -INF,
         lambda v: KimiK3TextConfig.tiny(linear_attn_config={"gate_lower_bound": v})),
        ("activation_situ_beta", INF, lambda v: KimiK3TextConfig.tiny(activation_situ_beta=v)),
        ("rms_norm_eps", INF, lambda v: KimiK3TextConfig.tiny(rms_norm_eps=v)),
        ("topk_method", "bogus", lambda v: KimiK3TextConfig.tiny(topk_method=v)),
        ("vt_num_attention_heads", 0, lambda v: KimiK3VisionConfig(vt_num_attention_heads=v)),
        ("patch_size", 0, lambda v: KimiK3VisionConfig(patch_size=v)),
        ("merge_kernel_size", [0, 0], lambda v: KimiK3VisionConfig(merge_kernel_size=v)),
        ("vt_num_hidden_layers", -1, lambda v: KimiK3VisionConfig(vt_num_hidden_layers=v)),
        ("media_placeholder_token_id", 512, lambda v: composite(media_placeholder_token_id=v)),
        ("logit_scale", "a", lambda v: KimiK3TextConfig.tiny(logit_scale=v)),
        ("linear_attn_config", [1, 2], lambda v: KimiK3TextConfig.tiny(linear_attn_config=v)),
        ("linear_attn_config", [1, 2], lambda v: KimiK3TextConfig(linear_attn_config=v)),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_issue_case_raises_a_config_error_naming_field_and_value(field, value, build):
    with raises(field, value):
        build(value)


@pytest.mark.parametrize(
    "field, value",
    [("vocab_size", "512"), ("hidden_size", 64.0), ("num_hidden_layers", "a"), ("mla_use_output_gate", "yes"),
     ("eos_token_id", [2, "3"]), ("rope_scaling", "none"), ("attn_res_block_size", True), ("logit_scale", 1e300),
     ("kda_o_norm_eps", 0.0), ("initializer_range", -0.02), ("mla_use_nope", False), ("num_key_value_heads", 2)],
)
def test_wrong_types_and_values_are_config_errors_not_type_errors(field, value):
    with raises(field, value):
        KimiK3TextConfig.tiny(**{field: value})


def test_media_placeholder_must_not_be_a_special_token():
    for special in (0, 1, 2):  # the tiny ids: pad, bos, eos
        with raises("media_placeholder_token_id", special):
            composite(media_placeholder_token_id=special)


# --------------------------------------------------------------------------------------------------
# However a value arrives
def test_assignment_update_and_from_pretrained_kwargs_are_checked(tmp_path):
    config = KimiK3TextConfig.tiny()
    with raises("logit_scale", NAN):
        config.logit_scale = NAN
    with raises("num_experts_per_token", "2"):
        config.num_experts_per_tok = "2"  # an alias (attribute_map) is checked under its field's name
    with raises("rms_norm_eps", INF):
        config.update({"rms_norm_eps": INF})
    with pytest.raises(KimiK3ConfigError, match="`num_experts_per_token`"):  # a relation, checked after update
        config.update({"num_experts": 4, "num_experts_per_token": 6})
    config = KimiK3TextConfig.tiny()
    config.save_pretrained(tmp_path)
    for loader in (AutoConfig.from_pretrained, KimiK3TextConfig.from_pretrained):
        with raises("logit_scale", NAN):
            loader(tmp_path, logit_scale=NAN)
        with pytest.raises(KimiK3ConfigError, match="`intermediate_size`"):
            loader(tmp_path, intermediate_size=None)  # layer 0 is dense: its width is required
    KimiK3ForCausalLM(config).save_pretrained(tmp_path / "model")
    with raises("routed_scaling_factor", -1.0):
        KimiK3ForCausalLM.from_pretrained(tmp_path / "model", routed_scaling_factor=-1.0)
    vision = KimiK3VisionConfig(**TINY_VISION)
    with raises("vt_hidden_size", 33):
        vision.hidden_size = 33  # odd: the video time embedding is sin/cos pairs


def test_update_and_kwargs_re_derive_what_the_fields_determine(tmp_path):
    config = KimiK3TextConfig.tiny()
    config.update({"first_k_dense_replace": 3})
    assert config.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 3
    config.update({"num_attention_heads": 8})
    assert config.num_key_value_heads == 8
    config.update({"num_hidden_layers": 3, "linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [3]}})
    assert config.layer_types == ["linear_attention", "linear_attention", "full_attention"]
    assert config.linear_attn_config["gate_lower_bound"] == -5.0  # completed with the defaults, as at construction
    KimiK3TextConfig.tiny().save_pretrained(tmp_path)
    loaded = KimiK3TextConfig.from_pretrained(tmp_path, num_experts=None)
    assert loaded.mlp_layer_types == ["dense"] * 6
    with torch.no_grad():
        assert torch.isfinite(KimiK3ForCausalLM(loaded)(torch.tensor([[3, 4, 5]])).logits).all()


def test_save_pretrained_refuses_an_inconsistent_config(tmp_path):
    config = KimiK3TextConfig.tiny()
    config.num_experts = 1  # top-k 2 of 1 expert; only the whole-config check sees it
    with pytest.raises(KimiK3ConfigError, match="`num_experts_per_token`"):
        config.save_pretrained(tmp_path)
    config = KimiK3TextConfig.tiny()
    config.num_hidden_layers = 5  # the layer lists still name 6 layers
    with pytest.raises(KimiK3ConfigError, match="`linear_attn_config`"):
        config.save_pretrained(tmp_path)
    config = composite()
    config.media_placeholder_token_id = 511
    config.text_config.vocab_size = 300
    with pytest.raises(KimiK3ConfigError, match="`media_placeholder_token_id`.*511"):
        config.save_pretrained(tmp_path)


def test_validate_runs_the_relation_checks_and_errors_are_strict_dataclass_errors():
    """The configs are ``@strict``: ``validate()`` (which transformers runs before saving, and the composite runs on its
    sub-configs) checks the relations between fields, and `KimiK3ConfigError` reaches the caller as itself, a
    `StrictDataclassError` like the errors of transformers' own configs."""
    from huggingface_hub.errors import StrictDataclassError

    config = KimiK3TextConfig.tiny()
    config.num_experts = 1  # top-k 2 of 1 expert
    with pytest.raises(StrictDataclassError, match="`num_experts_per_token`") as error:
        config.validate()
    assert type(error.value) is KimiK3ConfigError
    config = composite()
    config.vision_config.vt_num_attention_heads = 3
    with pytest.raises(KimiK3ConfigError, match="`qkv_hidden_size`"):
        config.validate()
    with pytest.raises(KimiK3ConfigError, match="`vocab_size`.*'512'"):  # a wrong type too
        KimiK3TextConfig.tiny(vocab_size="512")


def test_round_trips_and_internal_constructions_still_work(tmp_path):
    small = AutoConfig.from_pretrained(transformers_k3.__path__[0] + "/assets/small")  # the shipped model's
    configs = [KimiK3TextConfig(), KimiK3TextConfig.tiny(), KimiK3VisionConfig(), KimiK3Config(), KimiK3Config.tiny(),
               KimiK3Config.tiny(with_vision=False), small]
    def fields(config):
        return {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}

    for i, config in enumerate(configs):
        assert fields(type(config).from_dict(config.to_dict())) == fields(config)
        assert fields(copy.deepcopy(config)) == fields(config)
        config.save_pretrained(tmp_path / str(i))  # (to_diff_dict builds a default instance of the class)
        assert fields(type(config).from_pretrained(tmp_path / str(i))) == fields(config)
    # a sub-config given as a dict, as from_dict builds the composite's
    text = KimiK3TextConfig.tiny().to_dict()
    built = KimiK3Config(text_config=text, vision_config=KimiK3VisionConfig(**TINY_VISION).to_dict(),
                         media_placeholder_token_id=MEDIA_ID)
    assert built.text_config.to_dict() == KimiK3TextConfig.tiny().to_dict()
    with raises("text_config", [1]):
        KimiK3Config(text_config=[1])
    with pytest.raises(KimiK3ConfigError, match="`text_config`.*KimiLinearConfig"):
        KimiK3Config(text_config=KimiLinearConfig())


def test_release_media_placeholder_is_the_default_only_where_it_fits(caplog):
    """The release's <|media_pad|> (163605) is the default; a composite whose vocabulary is too small for it gets
    null instead (as the text ids do), with a warning when it has a vision tower; the null survives a round trip."""
    assert KimiK3Config().media_placeholder_token_id == 163605
    text_only = KimiK3Config(text_config=KimiK3TextConfig.tiny(), vision_config=None)
    assert text_only.media_placeholder_token_id is None
    with caplog.at_level("WARNING", logger="transformers_k3.configuration_kimi_k3"):
        with_vision = KimiK3Config(text_config=KimiK3TextConfig.tiny(), vision_config={})
    assert with_vision.media_placeholder_token_id is None and "<|media_pad|>" in caplog.text
    assert KimiK3Config.from_dict(with_vision.to_dict()).media_placeholder_token_id is None
    with raises("media_placeholder_token_id", 163605):  # set explicitly, it is checked
        KimiK3Config(text_config=KimiK3TextConfig.tiny(), media_placeholder_token_id=163605)


def test_derived_keys_a_config_carries_must_agree():
    """The in-tree Kimi Linear saves `qk_head_dim` and `linear_*` copies of `linear_attn_config`: they load (they
    are our read-only properties) when they agree and are refused when they do not."""
    tiny = KimiK3TextConfig.tiny().to_dict()
    assert KimiK3TextConfig.from_dict({**tiny, "qk_head_dim": 24, "linear_head_dim": 16,
                                       "linear_conv_kernel_dim": 4}).qk_head_dim == 24
    with raises("linear_head_dim", 9):
        KimiK3TextConfig.from_dict({**tiny, "linear_head_dim": 9})


# --------------------------------------------------------------------------------------------------
# Flat kimi_linear configs with a K3-only key
def kimi_linear_dict() -> dict:
    """A genuine Kimi Linear config.json, as transformers' in-tree class writes it."""
    config = KimiLinearConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"num_heads": 2, "head_dim": 8, "kda_layers": [1], "full_attn_layers": [2]})
    return config.to_dict()


K3_ONLY_SAMPLES = {  # a value of each K3-only key that is valid for `kimi_linear_dict`
    "attn_res_block_size": 1, "routed_expert_hidden_size": 8, "latent_moe_use_norm": False,
    "activation_situ_beta": 3.0, "activation_situ_linear_beta": 20.0, "mla_use_output_gate": False,
    "mla_latent_norm_eps": None, "kda_o_norm_eps": 3e-6, "logit_scale": 2.0, "router_fp32": True,
}


@pytest.mark.parametrize("key", [*K3_ONLY_SAMPLES, "linear_attn_config.use_full_rank_gate",
                                 "linear_attn_config.gate_lower_bound"])
def test_flat_kimi_linear_config_with_any_k3_only_key_is_ours(tmp_path, key):
    plain = kimi_linear_dict()
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps(plain))
    assert type(AutoConfig.from_pretrained(tmp_path / "plain")) is KimiLinearConfig  # a genuine one stays in-tree
    flat = copy.deepcopy(plain)
    if key.startswith("linear_attn_config."):
        sub = key.split(".")[1]
        value = {"use_full_rank_gate": False, "gate_lower_bound": -3.0}[sub]
        flat["linear_attn_config"][sub] = value
        read = lambda config: config.linear_attn_config[sub]  # noqa: E731
    else:
        value = K3_ONLY_SAMPLES[key]
        flat[key] = value
        read = lambda config: getattr(config, key)  # noqa: E731
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "config.json").write_text(json.dumps(flat))
    kwargs = {k: v for k, v in flat.items() if k != "model_type"}
    for config in (AutoConfig.from_pretrained(tmp_path / "flat"), AutoConfig.for_model("kimi_linear", **kwargs)):
        assert type(config) is KimiK3TextConfig, key
        assert read(config) == value
    assert isinstance(AutoModelForCausalLM.from_config(config), KimiK3ForCausalLM)
    # transformers' own class, asked for by name, stays transformers' (the package never changes it)
    assert type(KimiLinearConfig.from_dict(flat)) is KimiLinearConfig


def test_every_field_we_add_to_kimi_linear_is_a_k3_only_key_or_means_the_same_there():
    """A new K3 field must be added to `_K3_ONLY_KEYS` (or be shown to mean the same in Kimi Linear configs)."""
    in_tree = {f.name for f in dataclasses.fields(KimiLinearConfig)}
    in_tree |= set(KimiLinearConfig.attribute_map) | set(KimiLinearConfig.attribute_map.values())
    generic = {f.name for f in dataclasses.fields(transformers_k3.configuration_kimi_k3.PreTrainedConfig)}
    # keys of Moonshot's Kimi Linear config.json the in-tree class reads or ignores alike, plus generic MoE keys
    # that configs of the DeepSeek family carry with the meaning they have here
    kimi_linear_release = {"linear_attn_config", "first_k_dense_replace", "moe_layer_freq", "mla_use_nope",
                           "moe_router_activation_func", "num_nextn_predict_layers", "use_grouped_topk", "rope_theta",
                           "rope_scaling", "topk_method", "router_aux_loss_coef"}
    ours = {f.name for f in dataclasses.fields(KimiK3TextConfig)}
    assert ours - in_tree - generic - kimi_linear_release == set(_K3_ONLY_KEYS) == set(K3_ONLY_SAMPLES)
    assert set(_K3_ONLY_LINEAR_ATTN_KEYS) == {"use_full_rank_gate", "gate_lower_bound"}


# --------------------------------------------------------------------------------------------------
# Fuzz: what each field accepts, from its meaning
def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v):  # a number the float32 model can hold
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) <= FP32_MAX


def pos_int(v):
    return is_int(v) and v >= 1


def nonneg_int(v):
    return is_int(v) and v >= 0


def positive(v):
    return is_real(v) and v > 0


def eps(v):  # a norm's stabiliser: positive, not zero in float32, small against unit-scale activations
    return is_real(v) and FP32_TINY <= v < 1


def std(v):  # the std of the normal initialisation
    return is_real(v) and 0 <= v <= 1


def flag(v):
    return isinstance(v, bool)


def one_of(*choices):
    return lambda v: any(type(v) is type(c) and v == c for c in choices)


def nullable(accepts):
    return lambda v: v is None or accepts(v)


def token_id(v):  # the tiny vocabulary has 512 tokens
    return is_int(v) and 0 <= v < 512


TINY_LISTS = {"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6]}
TINY_LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention"] * 2
TINY_MLP_TYPES = ["dense"] + ["sparse"] * 5

# field -> (what it accepts in the tiny config, values worth trying besides the shared ones, fields an error may
# name instead when the value breaks a relation). The tiny text config: 6 layers listed in linear_attn_config,
# dense layer 0, 8 experts top-2 in 1 group, vocab 512 with pad 0 / bos 1 / eos 2, 4 attention heads.
TEXT_FIELDS = {
    "vocab_size": (lambda v: is_int(v) and v >= 3, [3, 2, 700], ("pad_token_id", "bos_token_id", "eos_token_id")),
    "hidden_size": (pos_int, [1, 24], ()),
    "intermediate_size": (pos_int, [1, None], ()),
    "num_hidden_layers": (one_of(6), [6, 5, 7], ("linear_attn_config",)),
    "num_attention_heads": (pos_int, [1, 3], ()),
    "num_key_value_heads": (nullable(one_of(4)), [4, 2], ()),
    "hidden_act": (one_of("situ", "silu"), ["silu", "gelu", "SiTU"], ()),
    "activation_situ_beta": (nullable(positive), [1e-3, 1e6], ()),
    "activation_situ_linear_beta": (nullable(positive), [0.5, 1e6], ()),
    "rms_norm_eps": (eps, [1e-6, 0.5, 1.0, 1e-40], ()),
    "initializer_range": (std, [0.0, 0.02, 1.0, 2.0], ()),
    "tie_word_embeddings": (flag, [True, False, 1], ()),
    "max_position_embeddings": (pos_int, [1, 10**7], ()),
    "use_cache": (flag, [False, 0], ()),
    "pad_token_id": (nullable(token_id), [511, 512, None], ()),
    "bos_token_id": (nullable(token_id), [3, 512], ()),
    "eos_token_id": (nullable(lambda v: token_id(v) or (isinstance(v, list) and all(token_id(i) for i in v))),
                     [[2, 3], [2, 512], [], [2.0]], ()),
    "rope_theta": (nullable(positive), [10000.0, None], ()),
    "rope_scaling": (lambda v: v is None or (isinstance(v, dict) and v.get("rope_type", v.get("type")) == "default"),
                     [{"rope_type": "default"}, {"type": "default"}, {"rope_type": "yarn", "factor": 2.0}], ()),
    "q_lora_rank": (nullable(pos_int), [None, 1, 16], ()),
    "kv_lora_rank": (pos_int, [1, 8], ()),
    "qk_nope_head_dim": (pos_int, [1, 8], ()),
    "qk_rope_head_dim": (nonneg_int, [0, 3], ()),
    "v_head_dim": (pos_int, [1, 8], ()),
    "mla_use_nope": (one_of(True), [True, False], ()),
    "mla_use_output_gate": (flag, [False], ()),
    "attention_dropout": (lambda v: is_real(v) and 0 <= v < 1, [0.0, 0.5, 1.0], ()),
    "num_experts": (nullable(lambda v: is_int(v) and v >= 2), [None, 2, 16, 1], ("num_experts_per_token",)),
    "num_experts_per_token": (lambda v: is_int(v) and 1 <= v <= 8, [1, 8, 9], ()),
    "num_shared_experts": (nonneg_int, [0, 2], ()),
    "moe_intermediate_size": (pos_int, [1, None], ()),
    "routed_expert_hidden_size": (nullable(pos_int), [None, 1, 128], ()),
    "latent_moe_use_norm": (flag, [False], ()),
    "first_k_dense_replace": (nonneg_int, [0, 6, 100], ()),
    "moe_layer_freq": (pos_int, [1, 2, 7], ()),
    "moe_router_activation_func": (one_of("sigmoid", "softmax"), ["softmax", "relu"], ()),
    "moe_renormalize": (flag, [False], ()),
    "routed_scaling_factor": (positive, [1e-3, 1e3], ()),
    "topk_method": (one_of("noaux_tc"), ["noaux_tc", "greedy", "group_limited_greedy"], ()),
    "use_grouped_topk": (flag, [False], ()),
    # 8 experts, top-2, topk_group 1: groups must divide 8, hold >= 2 experts, and the kept group >= 2 experts
    "num_expert_group": (one_of(1, 2, 4), [2, 4, 3, 8], ()),
    "topk_group": (one_of(1), [1, 2], ()),
    "router_fp32": (flag, [True], ()),
    "output_router_logits": (flag, [True], ()),
    "router_aux_loss_coef": (lambda v: is_real(v) and v >= 0, [0.0, 0.01, 10.0], ()),
    "num_nextn_predict_layers": (one_of(0), [0, 1], ()),
    "attn_res_block_size": (nullable(pos_int), [None, 1, 6, 100], ()),
    "kda_o_norm_eps": (eps, [1e-6, 0.9], ()),
    "mla_latent_norm_eps": (nullable(eps), [None, 1e-6], ()),
    "logit_scale": (positive, [1e-4, 30.0, 1e4], ()),
    "layer_types": (nullable(lambda v: v == TINY_LAYER_TYPES), [TINY_LAYER_TYPES, ["full_attention"] * 6], ()),
    "mlp_layer_types": (nullable(lambda v: v == TINY_MLP_TYPES), [TINY_MLP_TYPES, ["dense"] * 6], ()),
    "linear_attn_config.num_heads": (pos_int, [1, 3], ()),
    "linear_attn_config.head_dim": (pos_int, [1, 7], ()),
    "linear_attn_config.short_conv_kernel_size": (pos_int, [1, 3, 8], ()),
    "linear_attn_config.use_full_rank_gate": (flag, [False], ()),
    "linear_attn_config.gate_lower_bound": (nullable(lambda v: is_real(v) and v < 0), [None, -1e-6, -1e4, 5.0], ()),
    # the other list stays the tiny's: together they must cover layers 1..6 once each
    "linear_attn_config.kda_layers": (lambda v: isinstance(v, list) and all(is_int(i) for i in v) and sorted(
        v) == TINY_LISTS["kda_layers"], [[5, 4, 2, 1], [1, 2, 4], [1, 2, 3, 4, 5]], ("linear_attn_config",)),
    "linear_attn_config.full_attn_layers": (lambda v: isinstance(v, list) and all(is_int(i) for i in v) and sorted(
        v) == TINY_LISTS["full_attn_layers"], [[6, 3], [3], [True, 6]], ("linear_attn_config",)),
}

VISION_FIELDS = {
    "patch_size": (pos_int, [1, 5], ()),
    "init_pos_emb_height": (pos_int, [1, 3], ()),
    "init_pos_emb_width": (pos_int, [1, 17], ()),
    "init_pos_emb_time": (pos_int, [1, 2], ()),
    "pos_emb_type": (one_of("divided_fixed"), ["divided_fixed", "learned"], ()),
    "pos_emb_interpolation_mode": (one_of("bilinear", "bicubic"), ["bicubic", "nearest", "area"], ()),
    # qkv_hidden_size 32: the head dim 32 / heads must be a whole multiple of 4 (the 2-D RoPE's quarter split)
    "vt_num_attention_heads": (one_of(1, 2, 4, 8), [1, 8, 3, 16], ("qkv_hidden_size",)),
    "vt_num_hidden_layers": (pos_int, [1, 3], ()),
    "vt_hidden_size": (lambda v: is_int(v) and v >= 2 and v % 2 == 0, [2, 16, 33], ()),  # sin/cos time pairs
    "vt_intermediate_size": (pos_int, [1, 16], ()),
    "qkv_hidden_size": (lambda v: is_int(v) and v >= 8 and v % 8 == 0, [8, 48, 12, 4], ()),  # 2 heads
    "norm_type": (one_of("rmsnorm"), ["layernorm"], ()),
    "attn_bias": (flag, [True], ()),
    "linear_bias": (flag, [True], ()),
    "patch_embed_proj_bias": (flag, [True], ()),
    "mlp_type": (one_of("mlp2"), ["swiglu"], ()),
    "activation_func": (one_of("gelu_pytorch_tanh", "gelu"), ["gelu", "relu"], ()),
    "merge_kernel_size": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(pos_int(k) for k in v),
                          [[1, 1], (1, 3), [2], [2, 2, 2], [2.0, 2], [-1, 2]], ()),
    "merge_type": (one_of("sd2_tpool"), ["avgpool"], ()),
    "video_attn_type": (one_of("spatial_temporal"), ["spatial"], ()),
    "mm_projector_type": (one_of("patchmergerv2"), ["mlp"], ()),
    "mm_hidden_size": (nullable(one_of(32)), [None, 32, 16], ()),  # the tower's width per patch
    "projector_hidden_act": (one_of("gelu"), ["gelu", "gelu_pytorch_tanh"], ()),
    "projector_ln_eps": (eps, [1e-6, 0.5], ()),
    "text_hidden_size": (pos_int, [1, 7168], ()),
    "initializer_range": (std, [0.0, 0.5], ()),
}

COMPOSITE_FIELDS = {
    # an image slot id: a token of the vocabulary that is not pad / bos / eos (0 / 1 / 2)
    "media_placeholder_token_id": (lambda v: is_int(v) and 3 <= v < 512, [3, 511, 512, 0, 2], ()),
    "pad_token_id": (nullable(lambda v: token_id(v) and v != MEDIA_ID), [None, 499, MEDIA_ID, 512],
                     ("media_placeholder_token_id",)),
    "ignore_index": (one_of(-100), [-100, -1, 0], ()),
    "image_placeholder": (lambda v: isinstance(v, str) and v != "", ["<|media_pad|>", ""], ()),
    "tie_word_embeddings": (flag, [True], ()),
}

def cases(field, specific, null=True):
    """A bounded, seeded sample: the field's own values, then one of each kind: null, NaN, +-inf, a Python float
    beyond float32, a wrong type, a negative number, zero, and random finite numbers (a float in (-10, 10), an int
    in [-3, 40], a positive float log-uniform in [1e-6, 1e6])."""
    rng = random.Random(zlib.crc32(field.encode()))
    return [*specific, *([None] if null else []), NAN, rng.choice([INF, -INF]), rng.choice([1e300, -1e300]),
            rng.choice(["a", "", [1, 2], {"a": 1}, True, 1.5]), rng.choice([-1, -2.5]), rng.choice([0, 0.0]),
            rng.uniform(-10, 10), rng.randint(-3, 40), math.exp(rng.uniform(-14, 14))]


def text_config(field, value):
    if field.startswith("linear_attn_config."):
        return KimiK3TextConfig.tiny(linear_attn_config={field.split(".", 1)[1]: value})
    return KimiK3TextConfig.tiny(**{field: value})


def stored(config, field):
    if isinstance(config, KimiK3Config):
        config = config.vision_config if field in VISION_FIELDS else config
    if field.startswith("linear_attn_config."):
        return config.linear_attn_config[field.split(".", 1)[1]]
    return getattr(config, field)


def check_case(field, value, accepts, related, build, run):
    if not accepts(value):
        names = "|".join(re.escape(f"`{name}`") for name in (field, *related))
        with pytest.raises(KimiK3ConfigError, match=names):
            build(field, value)
        return
    config = build(field, value)
    if value is not None and field != "text_hidden_size":  # (the composite sets the text width there)
        kept = stored(config, field)
        as_list = lambda v: list(v) if isinstance(v, (list, tuple)) else v  # noqa: E731
        assert as_list(kept) == as_list(value), (field, value, kept)
    torch.manual_seed(0)
    logits = run(config)
    assert torch.isfinite(logits).all(), (field, value)


def run_text(config):
    ids = torch.arange(3, 9).unsqueeze(0) % config.vocab_size
    with torch.no_grad():
        return KimiK3ForCausalLM(config).eval()(ids).logits


@pytest.mark.parametrize("field", sorted(TEXT_FIELDS))
def test_fuzz_text_field(field, one_thread):
    accepts, specific, related = TEXT_FIELDS[field]
    for value in cases(field, specific):
        check_case(field, value, accepts, related, text_config, run_text)


def vision_composite(field, value):
    return composite({field: value})


def composite_field(field, value):
    return composite(**{field: value})


def run_composite(config):
    """An image (a 2x2 grid of merged windows) and, where the tower takes more than one frame, a 2-frame video
    chunk (the sin/cos time embedding), placed in a short prompt."""
    vision, media = config.vision_config, config.media_placeholder_token_id
    (kh, kw), p = vision.merge_kernel_size, vision.patch_size
    grids = [(1, 2 * kh, 2 * kw)] + ([(2, kh, kw)] if vision.init_pos_emb_time >= 2 else [])
    slots = sum((h // kh) * (w // kw) for _, h, w in grids)
    text = [i for i in (3, 4, 5) if i != media][:2]
    ids = torch.tensor([[text[0], *[media] * slots, text[1]]])
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3, p, p)
    with torch.no_grad():
        model = KimiK3ForConditionalGeneration(config).eval()
        return model(ids, pixel_values=pixels, image_grid_thw=torch.tensor(grids)).logits


@pytest.mark.parametrize("field", sorted(VISION_FIELDS))
def test_fuzz_vision_field(field, one_thread):
    accepts, specific, related = VISION_FIELDS[field]
    for value in cases(field, specific):
        check_case(field, value, accepts, related, vision_composite, run_composite)


@pytest.mark.parametrize("field", sorted(COMPOSITE_FIELDS))
def test_fuzz_composite_field(field, one_thread):
    accepts, specific, related = COMPOSITE_FIELDS[field]
    # (a null media placeholder is a valid config, but the VL model cannot run a prompt with it yet, a fix for
    # modeling_kimi_k3_vl; test_release_media_placeholder_is_the_default_only_where_it_fits covers the null)
    for value in cases(field, specific, null=field != "media_placeholder_token_id"):
        check_case(field, value, accepts, related, composite_field, run_composite)


def test_fuzz_covers_every_field():
    """A field added to a config must be given what it accepts here."""
    def own_fields(cls):
        return {f.name for f in dataclasses.fields(cls)} - {
            f.name for f in dataclasses.fields(transformers_k3.configuration_kimi_k3.PreTrainedConfig)}

    lac_keys = {f"linear_attn_config.{k}" for k in KimiK3TextConfig().linear_attn_config}
    assert (own_fields(KimiK3TextConfig) - {"linear_attn_config"}) | lac_keys == set(TEXT_FIELDS)
    assert own_fields(KimiK3VisionConfig) == set(VISION_FIELDS)
    assert own_fields(KimiK3Config) == set(COMPOSITE_FIELDS) | {"text_config", "vision_config"}


def _grouped_kv(config):
    config.num_key_value_heads = config.num_attention_heads // 2


def _vocab_below_media_id(config):
    config.text_config.vocab_size = 100


def _vision_heads_not_dividing(config):
    config.vision_config.vt_num_attention_heads = 3


@pytest.mark.parametrize("mutate, field", [
    (_grouped_kv, "num_key_value_heads"),
    (_vocab_below_media_id, "media_placeholder_token_id"),
    (_vision_heads_not_dividing, "qkv_hidden_size"),
])
def test_a_model_checks_the_relations_between_fields_mutated_after_construction(mutate, field):
    """Each assignment above is valid for its own field; only together with another field is it wrong (grouped KV
    heads MLA does not have, a media id outside the vocabulary, a head dim that does not divide). Building a model
    from such a config raises instead of building a model that runs (all three did)."""
    from transformers_k3 import KimiK3ForCausalLM, KimiK3ForConditionalGeneration

    composite = mutate is not _grouped_kv
    config = KimiK3Config.tiny() if composite else KimiK3TextConfig.tiny()
    mutate(config)
    with pytest.raises(KimiK3ConfigError, match=f"`{field}`"):
        (KimiK3ForConditionalGeneration if composite else KimiK3ForCausalLM)(config)
