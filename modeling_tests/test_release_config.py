"""The release's config and precision (issue 26): the release's ``config.json`` as published (K3_SPEC.md
section 13, written out here at full size: config only, the model built on the meta device), the variant
transformers 5 writes when it re-saves the release's remote-code config, the defaults of a config that sets
nothing, the MLA latent-norm eps, and ``o_norm.weight`` kept in fp32 through conversion and loading."""

import copy
import json
import logging

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

import transformers_k3
from transformers_k3 import KimiK3Config, KimiK3ConfigError, KimiK3ForCausalLM, KimiK3TextConfig
from transformers_k3.convert import convert_official_checkpoint
from transformers_k3.convert.export import official_config_dict
from transformers_k3.conversion.keymap import FP32_TENSOR_RE, k3_to_official_state_dict
from transformers_k3.conversion.streaming import write_state_dict

from references import randomize_

# --------------------------------------------------------------------------------------------------
# The release's config.json (K3_SPEC.md section 13; keys and values the section does not list are the
# section 1 values it confirms: sections 1.2-1.4)
MLA_LAYERS = [*range(4, 93, 4), 93]  # 1-based: 4, 8, ..., 92 and 93
RELEASE_TEXT_CONFIG = {
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 33792,
    "num_hidden_layers": 93,
    "num_attention_heads": 96,
    "num_key_value_heads": 96,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1048576,
    "rope_scaling": None,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_shared_experts": 2,
    "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584,
    "latent_moe_use_norm": True,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "topk_method": "noaux_tc",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 0,
    "attn_res_block_size": 12,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "use_cache": True,
    "linear_attn_config": {
        "kda_layers": [i for i in range(1, 94) if i not in MLA_LAYERS],
        "full_attn_layers": MLA_LAYERS,
        "num_heads": 96,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
}
RELEASE_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "format": "mxfp4-pack-quantized", "input_activations": None,
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                    "dynamic": False, "scale_dtype": "torch.uint8"}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}
RELEASE_VISION_CONFIG = {
    "model_type": "kimi_k3_vision", "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64,
    "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 12,
    "vt_num_hidden_layers": 27, "vt_hidden_size": 1024, "vt_intermediate_size": 4096, "qkv_hidden_size": 1536,
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal",
    "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
    "text_hidden_size": 7168,
}
RELEASE_CONFIG = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "dtype": "bfloat16",
    "media_placeholder_token_id": 163605,
    "pad_token_id": 163839,
    "ignore_index": -100,
    "tie_word_embeddings": False,
    "quantization_config": RELEASE_QUANTIZATION_CONFIG,
    "text_config": RELEASE_TEXT_CONFIG,
    "vision_config": RELEASE_VISION_CONFIG,
}


def resaved(config: dict) -> dict:
    """The release's config as transformers 5 re-saves it from the release's remote code (section 13)."""
    config = copy.deepcopy(config)
    config["transformers_version"] = "5.0.0"
    text = config["text_config"]
    text.update(head_dim=74, rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                dtype="bfloat16", transformers_version="5.0.0")
    return config


def write(directory, config: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


# --------------------------------------------------------------------------------------------------
# Defaults
def test_text_config_defaults_are_the_release_values():
    """`KimiK3TextConfig()` is the release's text config: each value section 13 lists, written out."""
    config = KimiK3TextConfig()
    expected = {
        "rms_norm_eps": 1e-5, "attn_res_block_size": 12, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "num_shared_experts": 2,
        "intermediate_size": 33792, "num_nextn_predict_layers": 0, "max_position_embeddings": 1048576,
        "topk_method": "noaux_tc", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        # section 1 values section 13 confirms
        "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93, "num_attention_heads": 96,
        "num_experts": 896, "num_experts_per_token": 16, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "mla_use_output_gate": True, "latent_moe_use_norm": True,
    }
    assert {key: getattr(config, key) for key in expected} == expected
    lac = config.linear_attn_config
    assert {key: lac[key] for key in ("num_heads", "head_dim", "short_conv_kernel_size", "gate_lower_bound",
                                      "use_full_rank_gate")} == {
        "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
        "use_full_rank_gate": True}
    full = [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 93]
    assert lac["full_attn_layers"] == full and len(full) == 24
    assert lac["kda_layers"] == [i for i in range(1, 94) if i not in full] and len(lac["kda_layers"]) == 69
    assert config.layer_types[92] == "full_attention" and config.layer_types.count("full_attention") == 24
    assert config.mla_latent_norm_eps == 1e-6 and config.kda_o_norm_eps == 1e-5
    # ... and the composite: its pad id is the text config's, the media placeholder the release's
    composite = KimiK3Config()
    assert (composite.pad_token_id, composite.media_placeholder_token_id) == (163839, 163605)
    # nothing in the defaults differs from the release's config.json
    release = KimiK3TextConfig.from_dict(RELEASE_TEXT_CONFIG)
    assert release.to_dict() == config.to_dict()


@pytest.mark.parametrize("layers, full", [(93, MLA_LAYERS), (8, [4, 8]), (6, [4, 6]), (3, [3]), (1, [1])])
def test_default_layer_placement_is_every_fourth_plus_the_last(layers, full):
    config = KimiK3TextConfig(num_hidden_layers=layers)
    assert config.linear_attn_config["full_attn_layers"] == full
    assert sorted(config.linear_attn_config["kda_layers"] + full) == list(range(1, layers + 1))


def test_token_ids_default_to_the_release_only_where_they_fit():
    # a small config that sets no ids has none (the release's ids are outside its vocabulary)
    small = KimiK3TextConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    assert (small.pad_token_id, small.bos_token_id, small.eos_token_id) == (None, None, None)
    assert KimiK3ForCausalLM(KimiK3TextConfig.tiny(vocab_size=512, pad_token_id=None)).model.padding_idx is None
    # ids a config sets are kept, and validated
    tiny = KimiK3TextConfig.tiny()
    assert (tiny.pad_token_id, tiny.bos_token_id, tiny.eos_token_id) == (0, 1, 2)
    assert KimiK3Config.tiny().pad_token_id == 0
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        with pytest.raises(KimiK3ConfigError, match=f"`{name}`"):
            KimiK3TextConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             **{name: 163839})
    # saved and reloaded, the ids stay what they were
    for config in (small, tiny, KimiK3TextConfig()):
        again = KimiK3TextConfig.from_dict(config.to_dict())
        assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (
            config.pad_token_id, config.bos_token_id, config.eos_token_id)


# --------------------------------------------------------------------------------------------------
# The release's config.json, as published and as re-saved
@pytest.mark.parametrize("variant", ["published", "resaved"])
def test_release_config_json_loads(tmp_path, variant):
    data = RELEASE_CONFIG if variant == "published" else resaved(RELEASE_CONFIG)
    path = write(tmp_path / variant, data)
    config = AutoConfig.from_pretrained(path)
    assert isinstance(config, KimiK3Config) and isinstance(config.text_config, KimiK3TextConfig)
    text = config.text_config
    assert getattr(config, "quantization_config", None) is None  # MXFP4 experts are dequantised on load
    assert config.vision_config.text_hidden_size == 7168 and config.media_placeholder_token_id == 163605
    assert text.linear_attn_config["full_attn_layers"] == MLA_LAYERS and text.layer_types[92] == "full_attention"
    assert text.mla_latent_norm_eps == 1e-6  # the release's config does not carry our key
    assert text.to_dict() == {**KimiK3TextConfig().to_dict(),
                              **({"rope_theta": 10000.0, "dtype": "bfloat16"} if variant == "resaved" else {}),
                              "transformers_version": text.to_dict()["transformers_version"]}
    assert text.head_dim == 192 and not hasattr(text, "rope_parameters")
    # the text part alone: AutoModelForCausalLM's config
    assert isinstance(AutoConfig.from_pretrained(write(tmp_path / "text", data["text_config"])), KimiK3TextConfig)
    # saved by us and loaded again: the same config, without the ignored keys
    config.save_pretrained(tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert "head_dim" not in saved["text_config"] and "rope_parameters" not in saved["text_config"]
    assert KimiK3Config.from_pretrained(tmp_path / "ours").text_config.to_dict() == text.to_dict()


def test_release_model_shapes_on_the_meta_device():
    config = KimiK3Config.from_dict(copy.deepcopy(RELEASE_CONFIG))
    with torch.device("meta"):
        model = KimiK3ForCausalLM(config.text_config)
    layers = model.model.layers
    assert [i for i, layer in enumerate(layers) if hasattr(layer.self_attn, "kv_b_proj")] == [
        i - 1 for i in MLA_LAYERS]
    kda, mla, moe = layers[0].self_attn, layers[92].self_attn, layers[1].mlp
    shapes = {
        "A_log": kda.A_log.shape, "dt_bias": kda.dt_bias.shape, "conv1d": kda.conv1d.weight.shape,
        "f_a_proj": kda.f_a_proj.weight.shape, "f_b_proj": kda.f_b_proj.weight.shape,
        "b_proj": kda.b_proj.weight.shape, "g_proj": kda.g_proj.weight.shape, "o_norm": kda.o_norm.weight.shape,
        "q_a_proj": mla.q_a_proj.weight.shape, "q_b_proj": mla.q_b_proj.weight.shape,
        "kv_a_proj_with_mqa": mla.kv_a_proj_with_mqa.weight.shape, "kv_b_proj": mla.kv_b_proj.weight.shape,
        "mla_g_proj": mla.g_proj.weight.shape, "router": moe.gate.weight.shape,
        "routed_expert_down_proj": moe.routed_expert_down_proj.weight.shape,
        "shared_gate_proj": moe.shared_experts.gate_proj.weight.shape, "dense_gate_proj": layers[0].mlp.gate_proj.weight.shape,
        "embed_tokens": model.model.embed_tokens.weight.shape,
    }
    assert {k: list(v) for k, v in shapes.items()} == {
        "A_log": [96], "dt_bias": [12288], "conv1d": [3 * 12288, 1, 4], "f_a_proj": [128, 7168],
        "f_b_proj": [12288, 128], "b_proj": [96, 7168], "g_proj": [12288, 7168], "o_norm": [128],
        "q_a_proj": [1536, 7168], "q_b_proj": [96 * 192, 1536], "kv_a_proj_with_mqa": [576, 7168],
        "kv_b_proj": [96 * 256, 512], "mla_g_proj": [12288, 7168], "router": [896, 7168],
        "routed_expert_down_proj": [3584, 7168], "shared_gate_proj": [6144, 7168], "dense_gate_proj": [33792, 7168],
        "embed_tokens": [163840, 7168],
    }
    assert (mla.q_a_layernorm.variance_epsilon, mla.kv_a_layernorm.variance_epsilon) == (1e-6, 1e-6)
    assert kda.o_norm.variance_epsilon == 1e-5 and model.model.norm.variance_epsilon == 1e-5
    # the release's fp32 tensors are fp32 in a model built in bf16
    with torch.device("meta"):
        bf16 = AutoModelForCausalLM.from_config(config.text_config, dtype=torch.bfloat16)
    kda = bf16.model.layers[0].self_attn
    assert {p.dtype for p in (kda.A_log, kda.dt_bias, kda.conv1d.weight, kda.o_norm.weight)} == {torch.float32}
    assert kda.g_proj.weight.dtype == torch.bfloat16


def test_resaved_keys_are_ignored_with_a_debug_log(caplog):
    caplog.set_level(logging.DEBUG, logger="transformers_k3.configuration_kimi_k3")
    config = KimiK3TextConfig.from_dict(resaved(RELEASE_CONFIG)["text_config"])
    assert config.head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim
    logged = caplog.text
    assert "`head_dim` = 74" in logged and "`rope_parameters`" in logged
    # transformers 5's per-layer-type nesting of a no-op RoPE is accepted too
    KimiK3TextConfig(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}, head_dim=7)


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda t: t.update(rope_parameters={"rope_type": "yarn", "factor": 32.0, "rope_theta": 5e4}),
         "rope_parameters"),
        (lambda t: t.update(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0}}),
         "rope_parameters"),
        (lambda t: t.update(rope_scaling={"type": "yarn", "factor": 32.0}), "rope_scaling"),
        (lambda t: t["linear_attn_config"].update(full_attn_layers=MLA_LAYERS[:-1]), "linear_attn_config"),
        (lambda t: t["linear_attn_config"].update(gate_lower_bound=5.0), "linear_attn_config.gate_lower_bound"),
        (lambda t: t["linear_attn_config"].update(num_head=96), "linear_attn_config"),
        (lambda t: t.update(pad_token_id=163840), "pad_token_id"),
        (lambda t: t.update(num_experts_per_token=1000), "num_experts_per_token"),
        (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
        (lambda t: t.update(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
    ],
)
def test_wrong_values_of_known_keys_still_raise(tmp_path, edit, field):
    data = resaved(RELEASE_CONFIG)
    edit(data["text_config"])
    with pytest.raises(KimiK3ConfigError, match=f"`{field}`"):
        AutoConfig.from_pretrained(write(tmp_path, data))


# --------------------------------------------------------------------------------------------------
# MLA latent-norm eps
def test_mla_latent_norm_eps():
    def eps(config):
        mla = next(layer.self_attn for layer in KimiK3ForCausalLM(config).model.layers
                   if hasattr(layer.self_attn, "kv_a_layernorm"))
        return mla.q_a_layernorm.variance_epsilon, mla.kv_a_layernorm.variance_epsilon

    assert eps(KimiK3TextConfig.tiny()) == (1e-6, 1e-6)  # the release's value by default
    assert eps(KimiK3TextConfig.tiny(mla_latent_norm_eps=None)) == (1e-5, 1e-5)  # None: rms_norm_eps (SGLang)
    assert eps(KimiK3TextConfig.tiny(mla_latent_norm_eps=3e-6)) == (3e-6, 3e-6)
    # the shipped small model was trained with rms_norm_eps there; its config says so and keeps it
    from importlib.resources import files

    small = KimiK3Config.from_pretrained(str(files(transformers_k3) / "assets" / "small")).text_config
    assert small.mla_latent_norm_eps is None and eps(small) == (small.rms_norm_eps, small.rms_norm_eps)


# --------------------------------------------------------------------------------------------------
# o_norm.weight in fp32
def _release_checkpoint(directory, seed=0):
    """A tiny random-weight model written in the official layout with the release's dtypes: fp32 A_log,
    dt_bias, conv filters, o_norm and router bias, bf16 everything else; the o_norm values are ones bf16
    cannot represent. Returns the directory and the fp32 o_norm weights by name."""
    torch.manual_seed(seed)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval(), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    o_norms = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("o_norm.weight"):
                value = (1 + 0.1 * torch.randn(param.shape, generator=gen)).float()
                value = torch.where(value.bfloat16().float() == value, value + 2.0 ** -20, value)
                assert (value.bfloat16().float() != value).all()
                param.copy_(value)
                o_norms[name] = value.clone()
    state = {k: (v.float() if FP32_TENSOR_RE.search(k) else v.to(torch.bfloat16)) for k, v in model.state_dict().items()}
    assert all(state[name].dtype == torch.float32 for name in o_norms)
    write_state_dict(k3_to_official_state_dict(state), directory, max_shard_size=60_000)
    (directory / "config.json").write_text(json.dumps(official_config_dict(model.config, False), indent=1))
    return directory, o_norms


def _stored_dtypes(directory) -> dict:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                out[name] = f.get_slice(name).get_dtype()
    return out


def _load(path, dtype):
    model, info = KimiK3ForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    assert not {k: v for k, v in info.items() if v}, info
    return model.eval()


def test_o_norm_stays_fp32_through_conversion_and_loading(tmp_path):
    official, o_norms = _release_checkpoint(tmp_path / "official")
    stored = _stored_dtypes(official)
    assert {stored[name] for name in stored if name.endswith("o_norm.weight")} == {"F32"}
    ours = tmp_path / "ours"
    convert_official_checkpoint(official, ours, progress=False)
    converted_dtypes = _stored_dtypes(ours)
    assert {converted_dtypes[name] for name in o_norms} == {"F32"}  # the converter keeps them fp32

    ids = torch.randint(3, 500, (2, 17), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        direct, converted = _load(official, dtype), _load(ours, dtype)
        for model in (direct, converted):
            params = dict(model.named_parameters())
            for name, value in o_norms.items():
                assert params[name].dtype == torch.float32, (dtype, name)
                assert torch.equal(params[name], value), (dtype, name)
        with torch.no_grad():
            assert torch.equal(direct(ids).logits, converted(ids).logits), dtype
    # loading keeps them through transformers' `_keep_in_fp32_modules_strict`; a later cast casts them, as for every model
    cast = _load(ours, torch.float32).to(torch.bfloat16)
    assert all(dict(cast.named_parameters())[name].dtype == torch.bfloat16 for name in o_norms)
    assert "o_norm" in KimiK3ForCausalLM._keep_in_fp32_modules_strict


def test_a_saved_k3_with_its_features_off_still_loads_as_k3(tmp_path):
    """save_pretrained writes the release's kimi_linear config; its K3 architecture name routes it back to our classes
    even when no K3-only feature is on (where the in-tree Kimi Linear would otherwise take it)."""
    from transformers import AutoConfig

    from transformers_k3.configuration_kimi_k3 import is_k3_text_config_dict

    plain = {"model_type": "kimi_linear", "hidden_act": "silu"}
    assert not is_k3_text_config_dict(plain)
    assert is_k3_text_config_dict({**plain, "architectures": ["KimiK3LinearForCausalLM"]})
    (tmp_path / "config.json").write_text(json.dumps({**plain, "architectures": ["KimiK3LinearForCausalLM"]}))
    assert type(AutoConfig.from_pretrained(tmp_path)).__name__ == "KimiK3TextConfig"


# K3_SPEC.md section 1.4: SGLang's KimiK3VisionConfig keys, which the release's vision_config may carry too
SGLANG_VISION_KEYS = {
    "patch_size", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time", "pos_emb_type",
    "pos_emb_interpolation_mode", "vt_num_attention_heads", "vt_num_hidden_layers", "vt_hidden_size",
    "vt_intermediate_size", "qkv_hidden_size", "norm_type", "attn_bias", "linear_bias", "patch_embed_proj_bias",
    "mlp_type", "activation_func", "merge_kernel_size", "merge_type", "video_attn_type", "mm_projector_type",
    "mm_hidden_size", "projector_hidden_act", "projector_ln_eps", "text_hidden_size", "model_type",
}


@pytest.mark.parametrize("mxfp4", [False, True])
def test_exported_config_has_only_the_release_keys(mxfp4):
    """No key transformers writes into every config (return_dict, id2label, output_*...) and no key of ours at its
    default: the written config.json is the release's, key for key (text and top level), and the vision section
    holds only keys of the vision config's schema."""
    from transformers_k3.conversion.keymap import release_quantization_config

    config = KimiK3Config.from_dict(copy.deepcopy(RELEASE_CONFIG))
    data = official_config_dict(config, composite=True, dtype="bf16",
                                quantization_config=release_quantization_config() if mxfp4 else None)
    expected_top = set(RELEASE_CONFIG) - (set() if mxfp4 else {"quantization_config"})
    assert set(data) == expected_top
    assert set(data["text_config"]) == set(RELEASE_TEXT_CONFIG)
    assert set(data["vision_config"]) <= SGLANG_VISION_KEYS and set(RELEASE_VISION_CONFIG) <= set(data["vision_config"])
    for key, value in RELEASE_TEXT_CONFIG.items():
        assert data["text_config"][key] == value, key
    if mxfp4:  # the spec names these fields; compressed-tensors' own status keys may come with them
        def contains(big, small):
            if isinstance(small, dict):
                return isinstance(big, dict) and all(k in big and contains(big[k], v) for k, v in small.items())
            return big == small

        assert contains(data["quantization_config"], RELEASE_QUANTIZATION_CONFIG)
    text = official_config_dict(config.text_config, composite=False, dtype="fp32")
    assert set(text) == set(RELEASE_TEXT_CONFIG) | {"architectures", "dtype"} and text["dtype"] == "float32"


def test_exported_config_keeps_what_differs_from_the_defaults():
    """A key of ours (or a transformers key) that a user set is written: dropping it would change the model."""
    text = dict(copy.deepcopy(RELEASE_TEXT_CONFIG), logit_scale=2.0, router_aux_loss_coef=0.01,
                id2label={0: "a", 1: "b", 2: "c"})
    config = KimiK3TextConfig.from_dict(text)
    data = official_config_dict(config, composite=False)
    assert data["logit_scale"] == 2.0 and data["router_aux_loss_coef"] == 0.01
    assert KimiK3TextConfig.from_dict(data).id2label == {0: "a", 1: "b", 2: "c"}
    assert KimiK3TextConfig.from_dict(data).to_dict() == dict(config.to_dict(), architectures=data["architectures"],
                                                              dtype=data["dtype"])
