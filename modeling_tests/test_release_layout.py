"""What we write is the release's layout exactly (K3_SPEC.md sections 2.2 and 13), checked against the release's
published inventory rules (written out in references.py, independently of the package's key maps):

* a fixture built from those rules at reduced sizes (every name pattern, dtype, the zero-padded ``A_log``,
  MXFP4 or bf16 experts): official -> ours -> official is bit-identical in names, dtypes, shapes and bytes, by
  the converter + `export_to_official` and by ``from_pretrained`` + ``save_pretrained``;
* direct and converted loading give identical logits in fp32 and bf16;
* an export of a model of ours matches the rules (names, dtypes, padded shapes, config keys, shard index);
* ``A_log`` padding that is not zero is refused (converter: `CheckpointError`; direct loading: reported).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import transformers_k3  # noqa: F401  (registers the classes and mappings)
from transformers_k3 import KimiK3Config, KimiK3ForCausalLM, KimiK3TextConfig
from transformers_k3.conversion import CheckpointError, dequantize_mxfp4
from transformers_k3.convert import convert_official_checkpoint, export_to_official
from transformers_k3.conversion.keymap import release_quantization_config
from transformers_k3.conversion.quant import quantize_mxfp4_release
from transformers_k3.conversion.streaming import write_state_dict

from references import (
    BF16,
    FP32,
    RELEASE_SHARD,
    check_against_rules,
    load,
    logits,
    random_mxfp4,
    randomize_,
    release_state,
    release_vision_state,
    shard_tensors,
    write_release,
)

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# Fixtures
def check_index(directory: Path):
    """The release's ``model.safetensors.index.json``: ``metadata.total_size`` and a complete ``weight_map``."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"} and "total_size" in index["metadata"]
    where = {}
    for path in sorted(directory.glob("*.safetensors")):
        assert re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", path.name)
        with safe_open(str(path), "pt") as f:
            where.update({name: path.name for name in f.keys()})
    assert index["weight_map"] == where
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in shard_tensors(directory).values())


@pytest.fixture(scope="module")
def text_config():
    return KimiK3TextConfig.tiny()


@pytest.fixture(scope="module")
def release_text_bf16(tmp_path_factory, text_config):
    path = tmp_path_factory.mktemp("release") / "text_bf16"
    return write_release(path, release_state(text_config, False, False, 0), text_config, False, False)


@pytest.fixture(scope="module")
def release_text_mxfp4(tmp_path_factory, text_config):
    path = tmp_path_factory.mktemp("release") / "text_mxfp4"
    return write_release(path, release_state(text_config, False, True, 1), text_config, False, True)


@pytest.fixture(scope="module")
def release_vl_mxfp4(tmp_path_factory):
    config = KimiK3Config.tiny()
    path = tmp_path_factory.mktemp("release") / "vl_mxfp4"
    return write_release(path, release_state(config, True, True, 2, release_vision_state(config)), config, True,
                         True), config


def assert_bit_identical(original: dict, again: dict):
    assert sorted(original) == sorted(again), (sorted(set(original) ^ set(again)))[:6]
    for name, tensor in original.items():
        other = again[name]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, (name, other.dtype, other.shape)
        assert torch.equal(other.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


IDS = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(0))


# --------------------------------------------------------------------------------------------------
def test_fixture_follows_the_release_rules(release_text_bf16, release_text_mxfp4, release_vl_mxfp4, text_config):
    check_against_rules(shard_tensors(release_text_bf16), text_config, False, False)
    check_against_rules(shard_tensors(release_text_mxfp4), text_config, False, True)
    path, config = release_vl_mxfp4
    check_against_rules(shard_tensors(path), config, True, True)


@pytest.mark.parametrize("which", ["text_bf16", "text_mxfp4", "text_mxfp4_kept", "vl_mxfp4"])
def test_release_round_trip_through_the_converter_is_bit_identical(which, release_text_bf16, release_text_mxfp4,
                                                                  release_vl_mxfp4, tmp_path):
    source = {"text_bf16": release_text_bf16, "vl_mxfp4": release_vl_mxfp4[0]}.get(which, release_text_mxfp4)
    mxfp4 = "mxfp4" in which
    ours = tmp_path / "ours"
    # bf16, experts dequantised (re-quantised by the export), or kept as MXFP4 (copied by the export)
    convert_official_checkpoint(source, ours, progress=False, keep_quantized=which.endswith("kept"))
    back = tmp_path / "back"
    export_to_official(ours, back, max_shard_size=RELEASE_SHARD, progress=False, mxfp4=mxfp4)
    assert_bit_identical(shard_tensors(source), shard_tensors(back))
    check_index(back)
    config = json.loads((back / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "torch_dtype" not in config
    assert ("quantization_config" in config) == mxfp4
    if mxfp4:
        assert config["quantization_config"] == release_quantization_config()
    if which == "vl_mxfp4":
        assert config["model_type"] == "kimi_k3" and config["text_config"]["model_type"] == "kimi_linear"
        assert "torch_dtype" not in config["text_config"] and "dtype" not in config["text_config"]


@pytest.mark.parametrize("which", ["text_bf16", "vl_mxfp4", "vl_mxfp4_dequantized"])
def test_release_round_trip_through_save_pretrained_is_bit_identical(which, release_text_bf16, release_vl_mxfp4,
                                                                    tmp_path):
    """``from_pretrained`` on the release + ``save_pretrained`` (``save_original_format=True``, transformers'
    default) writes the release's names, padded ``A_log``, fp32 tensors and bytes: MXFP4 experts as they came
    (loaded packed, the default; our config says so with ``KimiK3Mxfp4Config``'s ``quantization_config``, so they
    reload packed), or, loaded with ``KimiK3Mxfp4Config(dequantize=True)``, dequantised to bf16 (``save_pretrained``
    never quantises)."""
    from transformers_k3 import KimiK3ForConditionalGeneration, KimiK3Mxfp4Config

    source = release_text_bf16 if which == "text_bf16" else release_vl_mxfp4[0]
    cls = KimiK3ForCausalLM if which == "text_bf16" else KimiK3ForConditionalGeneration
    extra = {"quantization_config": KimiK3Mxfp4Config(dequantize=True)} if which == "vl_mxfp4_dequantized" else {}
    model = load(cls, source, dtype=BF16, **extra)
    model.save_pretrained(tmp_path / "saved", max_shard_size="40KB")
    saved = shard_tensors(tmp_path / "saved")
    original = shard_tensors(source)
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    packed = {"quant_method": "k3_mxfp4", "dequantize": False}
    assert config.get("quantization_config") == (packed if which == "vl_mxfp4" else None)
    if which == "vl_mxfp4_dequantized":  # the release's MXFP4 experts, dequantised (exactly) to bf16 plain weights
        for name in [n for n in original if n.endswith("weight_packed")]:
            stem = name[: -len("_packed")]
            original[stem] = dequantize_mxfp4(original.pop(name), original.pop(stem + "_scale"), BF16)
    assert_bit_identical(original, saved)
    check_index(tmp_path / "saved")
    again = load(cls, tmp_path / "saved", dtype=BF16)
    if which == "text_bf16":
        assert torch.equal(logits(again, IDS), logits(model, IDS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("which", ["text_bf16", "text_mxfp4"])
def test_direct_and_converted_loading_give_identical_logits(which, dtype, release_text_bf16, release_text_mxfp4,
                                                           tmp_path):
    from transformers_k3 import KimiK3Mxfp4Config

    source = release_text_bf16 if which == "text_bf16" else release_text_mxfp4
    # the load-time dequantisation against the converter's (packed experts: test_mxfp4_loading.py)
    extra = {"quantization_config": KimiK3Mxfp4Config(dequantize=True)} if which == "text_mxfp4" else {}
    direct = load(KimiK3ForCausalLM, source, dtype=dtype, **extra)
    ours = tmp_path / "ours"
    convert_official_checkpoint(source, ours, dtype="fp32" if dtype == torch.float32 else "bf16", progress=False)
    converted = load(KimiK3ForCausalLM, ours, dtype=dtype)
    for name, tensor in direct.state_dict().items():
        assert torch.equal(tensor, converted.state_dict()[name]), name
    assert torch.equal(logits(direct, IDS), logits(converted, IDS))
    if which == "text_mxfp4" and dtype == torch.bfloat16:
        auto = load(AutoModelForCausalLM, source, dtype=dtype, **extra)
        assert torch.equal(logits(auto, IDS), logits(direct, IDS))


@pytest.fixture(scope="module")
def our_checkpoint(tmp_path_factory):
    """A model of ours saved in our fused layout (what the converter writes)."""
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval())
    path = tmp_path_factory.mktemp("ours") / "fused"
    model.save_pretrained(path, save_original_format=False)
    assert any("gate_up_proj" in n for n in shard_tensors(path))
    return path, model


@pytest.mark.parametrize("mode", ["bf16", "fp32", "mxfp4"])
def test_export_matches_the_release_rules(mode, our_checkpoint, tmp_path):
    path, model = our_checkpoint
    out = tmp_path / "export"
    if mode == "mxfp4":  # the script
        code = subprocess.run([sys.executable, str(REPO / "conversion" / "export_to_official.py"), "--input", str(path),
                               "--output", str(out), "--quiet", "--max-shard-size", "50KB", "--mxfp4"],
                              capture_output=True, text=True)
        assert code.returncode == 0, code.stderr
    else:
        export_to_official(path, out, dtype=mode, max_shard_size="50KB", progress=False)
    tensors = shard_tensors(out)
    check_against_rules(tensors, model.config, False, mode == "mxfp4", dense_dtype=FP32 if mode == "fp32" else BF16)
    check_index(out)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == ("float32" if mode == "fp32" else "bfloat16") and "torch_dtype" not in config
    assert config["model_type"] == "kimi_linear"
    assert config["linear_attn_config"]["kda_layers"] == [1, 2, 4, 5]  # 1-based, as the release
    assert config["linear_attn_config"]["full_attn_layers"] == [3, 6]
    assert ("quantization_config" in config) == (mode == "mxfp4")
    # the values: fp32 tensors exact, A_log the model's heads then zeros
    state = model.state_dict()
    nh = model.config.linear_attn_config["num_heads"]
    assert torch.equal(tensors["model.layers.0.self_attn.A_log"][:nh], state["model.layers.0.self_attn.A_log"].float())
    assert torch.equal(tensors["model.layers.0.self_attn.o_norm.weight"], state["model.layers.0.self_attn.o_norm.weight"].float())
    fused = state["model.layers.1.mlp.experts.gate_up_proj"]
    half = fused.shape[1] // 2
    w3 = fused[5, half:]
    if mode == "mxfp4":
        packed = tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight_packed"]
        scale = tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight_scale"]
        assert torch.equal(packed, quantize_mxfp4_release(w3)[0])
        assert torch.equal(scale, quantize_mxfp4_release(w3)[1])
        from transformers_k3 import KimiK3Mxfp4Config

        again = load(KimiK3ForCausalLM, out, dtype=BF16, quantization_config=KimiK3Mxfp4Config(dequantize=True))
        assert torch.equal(again.state_dict()["model.layers.1.mlp.experts.gate_up_proj"][5, half:],
                           dequantize_mxfp4(packed, scale, BF16))  # the export loads back dequantised
        kept = load(KimiK3ForCausalLM, out, dtype=BF16).state_dict()  # and packed (the default), bytes as written
        assert torch.equal(kept["model.layers.1.mlp.experts.gate_up_packed"][5, half:], packed)
        assert torch.equal(kept["model.layers.1.mlp.experts.gate_up_scale"][5, half:], scale)
    else:
        got = tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
        assert torch.equal(got, w3.to(got.dtype))


def test_save_pretrained_of_a_new_model_follows_the_release_rules(tmp_path):
    torch.manual_seed(0)
    # built in bf16 as from_pretrained / from_config build it (the release's fp32 tensors in fp32; a later
    # .to(bf16) casts them too, as transformers does)
    from transformers import AutoModelForCausalLM

    model = randomize_(AutoModelForCausalLM.from_config(KimiK3TextConfig.tiny(), dtype=BF16).eval())
    model.save_pretrained(tmp_path / "saved")
    check_against_rules(shard_tensors(tmp_path / "saved"), model.config, False, False)
    model.save_pretrained(tmp_path / "fused", save_original_format=False)  # our layout, unchanged
    fused = shard_tensors(tmp_path / "fused")
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused and fused["model.layers.0.self_attn.A_log"].shape == (4,)


def test_mxfp4_requantisation_rule():
    """Unchanged weights give back the release's bytes; other weights follow compressed-tensors' rule: scale
    from the group maximum rounded to a power of two (up from a mantissa of 1.75), values to nearest, ties to
    even, saturating at 6."""
    gen = torch.Generator().manual_seed(0)
    packed, scale = random_mxfp4(16, 128, gen)
    weight = dequantize_mxfp4(packed, scale, BF16)
    assert all(torch.equal(a, b) for a, b in zip(quantize_mxfp4_release(weight), (packed, scale)))
    assert all(torch.equal(a, b) for a, b in zip(quantize_mxfp4_release(weight.float()), (packed, scale)))
    row = torch.zeros(1, 32)
    row[0, :10] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.0, -5.5])
    p, s = quantize_mxfp4_release(row)  # amax 6: mantissa 1.5 -> scale 2^(2-2) = 1
    assert s.item() == 127
    assert dequantize_mxfp4(p, s, FP32)[0, :10].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -6.0]
    assert torch.signbit(dequantize_mxfp4(p, s, FP32)[0, 8])
    row[0, 7] = 7.5  # mantissa 1.875 >= 1.75: rounded up to 8 -> scale 2^(3-2) = 2
    p, s = quantize_mxfp4_release(row)
    assert s.item() == 128 and dequantize_mxfp4(p, s, FP32)[0, 7].item() == 8.0


def test_a_log_padding_must_be_zero(release_text_bf16, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(release_text_bf16, bad)
    state = shard_tensors(bad)
    name = "model.layers.1.self_attn.A_log"
    state[name][-1] = 0.5
    for f in bad.glob("*.safetensors"):
        f.unlink()
    (bad / "model.safetensors.index.json").unlink()
    write_state_dict(state, bad, max_shard_size=RELEASE_SHARD)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"A_log.*must be exactly zero"):
        convert_official_checkpoint(bad, out, progress=False)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad"]
    code = subprocess.run([sys.executable, str(REPO / "conversion" / "convert_k3_official_to_hf.py"), "--input", str(bad),
                           "--output", str(out), "--quiet"], capture_output=True, text=True)
    assert code.returncode == 2 and "must be exactly zero" in code.stderr and not out.exists()
    # direct loading: the same named error, naming the tensor (transformers' load report lists it too)
    with pytest.raises(CheckpointError, match=rf"(?s)1 tensor\(s\) cannot be loaded.*ALogPaddingError: `{re.escape(name)}`"
                                              r".*must be exactly zero"):
        KimiK3ForCausalLM.from_pretrained(bad)


def test_plain_load_state_dict_reads_the_release_layout(tmp_path):
    """transformers' Trainer restores a checkpoint that ``save_pretrained`` wrote (the release's layout) with a plain
    ``load_state_dict``: `release_layout_pre_hook` (with the experts' own pre-hook) brings it to the model's names."""
    from safetensors.torch import load_file

    from transformers_k3.conversion.hf_mapping import release_layout_pre_hook

    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval())
    model.save_pretrained(tmp_path / "saved")
    state = {}
    for f in (tmp_path / "saved").glob("*.safetensors"):
        state.update(load_file(str(f)))
    assert any(".block_sparse_moe." in n for n in state) and state["model.layers.0.self_attn.A_log"].shape == (16,)
    fresh = KimiK3ForCausalLM(KimiK3TextConfig.tiny())
    fresh.model.register_load_state_dict_pre_hook(release_layout_pre_hook)
    result = fresh.load_state_dict(state, strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    state["model.layers.0.self_attn.A_log"][-1] = 1.0
    with pytest.raises(CheckpointError, match="must be exactly zero"):
        fresh.load_state_dict(state, strict=False)


@pytest.mark.parametrize("composite", [False, True])
def test_save_pretrained_writes_our_config_and_export_release_the_releases(tmp_path, composite):
    """save_pretrained's config.json is ours (model_type kimi_k3 / kimi_k3_text, either save_original_format);
    export_release's has the release's keys (the text config as kimi_linear, the composite as kimi_k3, dtype the
    weights' dtype, no derived keys). Each loads back to the same model."""
    import json

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from transformers_k3 import (
        KimiK3Config,
        KimiK3ForCausalLM,
        KimiK3ForConditionalGeneration,
        KimiK3TextConfig,
        export_release,
    )

    torch.manual_seed(0)
    model = (KimiK3ForConditionalGeneration(KimiK3Config.tiny()) if composite
             else KimiK3ForCausalLM(KimiK3TextConfig.tiny())).eval()
    auto = AutoModelForImageTextToText if composite else AutoModelForCausalLM
    ids = torch.randint(3, 400, (1, 7))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    export_release(model, tmp_path / "release")
    data = json.loads((tmp_path / "release" / "config.json").read_text())
    text = data["text_config"] if composite else data
    assert data["model_type"] == ("kimi_k3" if composite else "kimi_linear") and text["model_type"] == "kimi_linear"
    assert data["dtype"] == "float32" and "torch_dtype" not in data
    assert data["architectures"] == (["KimiK3ForConditionalGeneration"] if composite else ["KimiK3LinearForCausalLM"])
    assert not {"layer_types", "mlp_layer_types"} & set(text)
    reloaded = auto.from_pretrained(tmp_path / "release").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, want)
    for name, kwargs in (("ours", {}), ("ours_fused", {"save_original_format": False})):
        model.save_pretrained(tmp_path / name, **kwargs)
        ours = json.loads((tmp_path / name / "config.json").read_text())
        assert ours["model_type"] == ("kimi_k3" if composite else "kimi_k3_text"), name
        if composite:
            assert ours["text_config"]["model_type"] == "kimi_k3_text", name
        reloaded = auto.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():  # (a fused-layout reload matches a model built from a config to fp32 rounding only)
            torch.testing.assert_close(reloaded(input_ids=ids).logits, want, rtol=0,
                                       atol=1e-5 if kwargs else 0, msg=name)


@pytest.mark.parametrize("packed", [False, True])
def test_direct_load_of_an_expert_with_the_wrong_shape_is_a_checkpoint_error(packed, release_text_mxfp4, tmp_path):
    """An MXFP4 expert block whose scales do not fit its packed weights: the fusing (dequantized) or stacking
    (packed) conversion refuses it, and from_pretrained says which tensor, as a CheckpointError (transformers alone
    raises a RuntimeError that points at its log)."""
    import shutil

    from transformers_k3 import KimiK3Mxfp4Config

    bad = tmp_path / "bad"
    shutil.copytree(release_text_mxfp4, bad)
    state = shard_tensors(bad)
    name = next(n for n in state if n.endswith("experts.3.w2.weight_scale"))
    state[name] = state[name][:, :-1].contiguous()
    for f in bad.glob("*.safetensors"):
        f.unlink()
    (bad / "model.safetensors.index.json").unlink()
    write_state_dict(state, bad, max_shard_size=RELEASE_SHARD)
    target = "down_scale" if packed else "down_proj"
    with pytest.raises(CheckpointError, match=rf"(?s)cannot be loaded as K3 weights:.*QuantFormatError: `model.layers.\d+.mlp.experts.{target}`: expert 3 w2: MXFP4 weight_scale has shape"):
        KimiK3ForCausalLM.from_pretrained(bad, quantization_config=KimiK3Mxfp4Config(dequantize=not packed))


@pytest.mark.parametrize("which", ["text", "vl"])
def test_our_classes_read_a_release_directory_without_a_type_warning(which, release_text_bf16, release_vl_mxfp4):
    """``KimiK3TextConfig`` / ``KimiK3ForCausalLM.from_pretrained`` of a release directory (flat ``kimi_linear`` or
    composite ``kimi_k3``) read its text part, with no "model of type ... to instantiate" warning; on a composite
    the text model equals what AutoModelForCausalLM builds (it was a default-sized config, then a crash)."""
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    path, config = (release_text_bf16, KimiK3TextConfig.tiny()) if which == "text" else release_vl_mxfp4
    expected = config.get_text_config()
    with CaptureLogger(hf_logging.get_logger("transformers.configuration_utils")) as captured:
        text = KimiK3TextConfig.from_pretrained(path)
        model = KimiK3ForCausalLM.from_pretrained(path)
    assert "to instantiate a model of type" not in captured.out
    assert type(text) is KimiK3TextConfig and not hasattr(text, "text_config")
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_experts", "linear_attn_config"):
        assert getattr(text, key) == getattr(expected, key), key
    assert getattr(text, "quantization_config", None) is None  # MXFP4 experts are dequantised while loading
    ids = torch.tensor([[3, 17, 42, 8, 99]])
    reference = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_composite_config_of_a_text_only_release_is_text_only(release_text_bf16):
    """``KimiK3Config.from_pretrained`` of a flat text release wraps that text config (it gave a composite of
    default-sized sub-configs: 7168 wide, 93 layers); the multimodal class then says to use the text one."""
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    from transformers_k3 import KimiK3ForConditionalGeneration

    expected = KimiK3TextConfig.tiny()
    with CaptureLogger(hf_logging.get_logger("transformers.configuration_utils")) as captured:
        config = KimiK3Config.from_pretrained(release_text_bf16)
    assert "to instantiate a model of type" not in captured.out
    assert config.vision_config is None
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_experts", "linear_attn_config"):
        assert getattr(config.text_config, key) == getattr(expected, key), key
    with pytest.raises(ValueError, match="for text only use KimiK3ForCausalLM"):
        KimiK3ForConditionalGeneration.from_pretrained(release_text_bf16)


@pytest.mark.parametrize("which", ["vl_mxfp4", "text_mxfp4_kept"])
def test_streamed_experts_of_a_composite_release_and_a_converted_checkpoint(which, release_vl_mxfp4,
                                                                            release_text_mxfp4, tmp_path):
    """``KimiK3Mxfp4Config(stream_experts=True)`` finds the experts under the composite release's names
    (``language_model.…block_sparse_moe.experts…``) and under our converter's (MXFP4 kept, ``mlp.experts…``), and
    gives the packed model's logits bit for bit."""
    from transformers_k3 import KimiK3ForConditionalGeneration, KimiK3Mxfp4Config

    if which == "vl_mxfp4":
        path, cls = release_vl_mxfp4[0], KimiK3ForConditionalGeneration
    else:
        path, cls = tmp_path / "ours", KimiK3ForCausalLM
        convert_official_checkpoint(release_text_mxfp4, path, progress=False, keep_quantized=True)
    packed = load(cls, path, dtype=torch.float32)
    streamed = load(cls, path, dtype=torch.float32, quantization_config=KimiK3Mxfp4Config(stream_experts=True))
    assert torch.equal(logits(streamed, IDS), logits(packed, IDS))
