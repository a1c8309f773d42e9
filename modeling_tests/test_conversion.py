"""Checkpoint conversion: official K3 (bf16 and MXFP4 experts, text-only and multimodal) -> ours, direct
loading of official directories, export back to the official layout, Kimi Linear -> K3, the tokenizer,
bad inputs, and the streaming converter's peak memory.

The fixtures are tiny official-format checkpoints written from `KimiK3TextConfig.tiny()` /
`KimiK3Config.tiny()` models: random weights, routed experts drawn from values MXFP4 represents exactly
(E2M1 codes times a power of two per 32-group) and quantised by our own quantiser, split into several
shards (experts of one layer spanning shards) with an index.
"""

import base64
import collections
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import transformers_k3
from transformers_k3 import KimiK3Config, KimiK3ForCausalLM, KimiK3TextConfig, export_release
from transformers_k3.conversion import CheckpointError, dequantize_mxfp4, quantize_mxfp4
from transformers_k3.convert import convert_official_checkpoint, export_to_official
from transformers_k3.convert.export import official_config_dict
from transformers_k3.conversion.keymap import FP32_TENSOR_RE, k3_to_official_state_dict, split_short_conv
from transformers_k3.conversion.quant import QuantFormatError, dequantize_fp8_block
from transformers_k3.conversion.streaming import write_state_dict

from references import (
    OFFICIAL_SHARD,
    SCRIPTS,
    _index,
    _script,
    load,
    logits,
    official_state,
    representable_tiny,
    representable,
    shard_tensors,
    shard_tensors_file,
    write_official,
    write_official_text,
)


# --------------------------------------------------------------------------------------------------
# Fixtures
@pytest.fixture(scope="module")
def text_model():
    return representable_tiny()


@pytest.fixture(scope="module")
def official_bf16(tmp_path_factory, text_model):
    path = tmp_path_factory.mktemp("ckpt") / "official_bf16"
    return write_official_text(path, text_model, quantized=False)


@pytest.fixture(scope="module")
def official_mxfp4(tmp_path_factory, text_model):
    """MXFP4 experts plus the spec's aliases: `mlp.` for `block_sparse_moe.`, A_log as [1, 1, nh, 1] and as a longer
    1-D vector, a 4-D weight_scale, a rotary cache to drop."""
    state = official_state(text_model, quantize=True)
    aliased = {}
    for name, tensor in state.items():
        if ".layers.3." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")
        if name == "model.layers.0.self_attn.A_log":  # (the release's form is zero-padded [head_dim])
            tensor = tensor[: text_model.config.linear_num_heads].reshape(1, 1, -1, 1)
        if name == "model.layers.1.self_attn.A_log":  # longer than the release's padding, still zeros
            tensor = torch.cat([tensor, torch.zeros(12)])
        if name == "model.layers.4.block_sparse_moe.experts.5.w2.weight_scale":
            tensor = tensor[:, None, :, None]
        aliased[name] = tensor
    aliased["model.layers.2.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    path = tmp_path_factory.mktemp("ckpt") / "official_mxfp4"
    return write_official(path, aliased, text_model.config, False, True)


@pytest.fixture(scope="module")
def vl_model():
    from transformers_k3 import KimiK3ForConditionalGeneration

    return representable_tiny(KimiK3ForConditionalGeneration, KimiK3Config.tiny())


@pytest.fixture(scope="module")
def official_vl(tmp_path_factory, vl_model):
    """A multimodal official checkpoint: MXFP4 experts, vision weights, `language_model.layers.` alias."""
    state = {k.replace("language_model.model.layers.", "language_model.layers."): v
             for k, v in official_state(vl_model, quantize=True).items()}
    path = tmp_path_factory.mktemp("ckpt") / "official_vl"
    return write_official(path, state, vl_model.config, True, True, shard=60_000)


# --------------------------------------------------------------------------------------------------
# Quantised formats (spec 10.1, invariant 12)
def test_mxfp4_nibble_order_and_hand_computed_example():
    packed = torch.tensor([[0x21] + [0] * 15], dtype=torch.uint8)
    scale = torch.tensor([[127]], dtype=torch.uint8)
    values = dequantize_mxfp4(packed, scale)
    assert values[0, 0].item() == 0.5 and values[0, 1].item() == 1.0  # low nibble = element 0
    # 0xF9: low nibble 9 = -0.5, high nibble 15 = -6; scale 129 multiplies by 4; scale 125 by 1/4
    packed = torch.tensor([[0xF9] * 16, [0x7A] * 16], dtype=torch.uint8)
    scale = torch.tensor([[129], [125]], dtype=torch.uint8)
    out = dequantize_mxfp4(packed, scale, torch.float32)
    assert out[0, :2].tolist() == [-2.0, -24.0] and out[1, :2].tolist() == [-0.25, 1.5]
    # 4-D scales ([N, 1, K/32, 1], some exporters) and float8_e8m0 scales read the same
    assert torch.equal(dequantize_mxfp4(packed, scale[:, None, :, None]), dequantize_mxfp4(packed, scale))
    assert torch.equal(dequantize_mxfp4(packed, scale.view(torch.float8_e8m0fnu)), dequantize_mxfp4(packed, scale))
    with pytest.raises(QuantFormatError, match="255"):
        dequantize_mxfp4(packed, torch.full((2, 1), 255, dtype=torch.uint8))


def test_mxfp4_round_trip_is_bit_exact():
    weight = representable((48, 128), torch.Generator().manual_seed(0)).to(torch.bfloat16)
    weight[0, :5] = -0.0
    packed, scale = quantize_mxfp4(weight)
    assert packed.dtype == torch.uint8 and packed.shape == (48, 64) and scale.shape == (48, 4)
    back = dequantize_mxfp4(packed, scale, torch.bfloat16)
    assert torch.equal(back.view(torch.int16), weight.view(torch.int16))  # bit for bit, signed zeros included
    with pytest.raises(QuantFormatError, match="not exactly representable"):
        quantize_mxfp4(weight.float() + 1e-3)


def test_fp8_block_dequantisation_hand_computed():
    weight = torch.full((130, 3), 1.5).to(torch.float8_e4m3fn)  # 130 rows: a partial second block row
    scale = torch.tensor([[2.0], [0.5]])
    out = dequantize_fp8_block(weight, scale, dtype=torch.float32)
    assert out[127, 0].item() == 3.0 and out[128, 0].item() == 0.75 and out[129, 2].item() == 0.75


# --------------------------------------------------------------------------------------------------
# official -> ours -> official
def test_official_bf16_round_trip_is_bit_exact(official_bf16, text_model, tmp_path):
    ours = tmp_path / "ours"
    convert_official_checkpoint(official_bf16, ours, max_shard_size=OFFICIAL_SHARD * 2, progress=False)
    assert len(list(ours.glob("*.safetensors"))) > 1 and (ours / "model.safetensors.index.json").is_file()
    model = load(KimiK3ForCausalLM, ours)
    reference = text_model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name].to(tensor.dtype)), name

    back = tmp_path / "official_again"
    for bad in ("banana", "0MB"):  # refused before anything is written
        with pytest.raises(CheckpointError, match="max_shard_size"):
            export_to_official(ours, back, max_shard_size=bad, progress=False)
        assert not back.exists()
    export_to_official(ours, back, max_shard_size=OFFICIAL_SHARD, progress=False)
    original, again = shard_tensors(official_bf16), shard_tensors(back)
    assert sorted(original) == sorted(again)
    for name, tensor in original.items():
        assert again[name].dtype == tensor.dtype and again[name].shape == tensor.shape, name
        assert torch.equal(again[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert KimiK3TextConfig.from_pretrained(back).to_dict() == KimiK3TextConfig.from_pretrained(official_bf16).to_dict()


def dequantized() -> dict:
    """``from_pretrained`` arguments that dequantise the release's MXFP4 experts at load."""
    from transformers_k3 import KimiK3Mxfp4Config

    return {"quantization_config": KimiK3Mxfp4Config(dequantize=True)}


def test_official_mxfp4_direct_load_equals_converted(official_mxfp4, official_bf16, text_model, tmp_path):
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    # dequantised at load (kept packed by default: test_mxfp4_loading.py)
    direct = load(KimiK3ForCausalLM, official_mxfp4, dtype=torch.bfloat16, **dequantized())  # 0 missing, 0 unexpected
    assert getattr(direct.config, "quantization_config", None) is None
    auto = load(AutoModelForCausalLM, official_mxfp4, dtype=torch.bfloat16, **dequantized())  # the flat K3 config
    assert isinstance(auto, KimiK3ForCausalLM) and torch.equal(logits(auto, ids), logits(direct, ids))
    ours = tmp_path / "ours"
    convert_official_checkpoint(official_mxfp4, ours, progress=False)
    converted = load(KimiK3ForCausalLM, ours, dtype=torch.bfloat16)
    reference = text_model.state_dict()
    for name, tensor in converted.state_dict().items():
        assert torch.equal(tensor, reference[name].to(tensor.dtype)), name  # dequantisation is exact
        assert torch.equal(tensor, direct.state_dict()[name]), name
    assert torch.equal(logits(direct, ids), logits(converted, ids))
    # the bf16 release loads to the same model
    assert torch.equal(logits(load(KimiK3ForCausalLM, official_bf16, dtype=torch.bfloat16), ids), logits(direct, ids))


def test_keep_quantized_copies_mxfp4_experts_and_loads(official_mxfp4, tmp_path):
    kept = tmp_path / "kept"
    convert_official_checkpoint(official_mxfp4, kept, keep_quantized=True, progress=False)
    source, out = shard_tensors(official_mxfp4), shard_tensors(kept)
    packed = [n for n in out if n.endswith(("weight_packed", "weight_scale"))]
    assert packed and not any(n.endswith("gate_up_proj") for n in out)
    for name in packed:
        original = source.get(name, source.get(name.replace(".mlp.", ".block_sparse_moe.")))
        assert torch.equal(out[name], original), name  # bit for bit
    assert json.loads((kept / "config.json").read_text())["quantization_config"]["format"] == "mxfp4-pack-quantized"
    ids = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(1))
    model = load(KimiK3ForCausalLM, kept, dtype=torch.bfloat16)
    assert torch.equal(logits(model, ids), logits(load(KimiK3ForCausalLM, official_mxfp4, dtype=torch.bfloat16), ids))


def test_multimodal_official_checkpoint(official_vl, vl_model, tmp_path):
    from transformers_k3 import KimiK3ForConditionalGeneration

    reference = vl_model.state_dict()
    direct = load(KimiK3ForConditionalGeneration, official_vl, dtype=torch.bfloat16, **dequantized())
    for name, tensor in direct.state_dict().items():
        assert torch.equal(tensor, reference[name].to(tensor.dtype)), name
    # AutoModelForCausalLM on the composite config: the text model, `language_model.` dropped, vision left out
    text = load(AutoModelForCausalLM, official_vl, dtype=torch.bfloat16, **dequantized())
    assert isinstance(text, KimiK3ForCausalLM)
    for name, tensor in text.state_dict().items():
        assert torch.equal(tensor, direct.state_dict()["language_model." + name]), name
    ours = tmp_path / "ours"
    plan = convert_official_checkpoint(official_vl, ours, progress=False)
    assert not plan.notes  # vision shapes were checked against KimiK3ForConditionalGeneration
    converted = load(KimiK3ForConditionalGeneration, ours, dtype=torch.bfloat16)
    for name, tensor in converted.state_dict().items():
        assert torch.equal(tensor, direct.state_dict()[name]), name
    back = tmp_path / "back"
    export_to_official(ours, back, progress=False)
    exported = shard_tensors(back)
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w3.weight" in exported
    assert not any(n.startswith("language_model.layers.") for n in exported)
    # save_pretrained of the multimodal model: official names under language_model.model., loads back identically
    direct.save_pretrained(tmp_path / "saved")
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w3.weight" in shard_tensors(tmp_path / "saved")
    saved = load(KimiK3ForConditionalGeneration, tmp_path / "saved")
    for name, tensor in saved.state_dict().items():
        assert torch.equal(tensor, direct.state_dict()[name]), name


def test_save_pretrained_layouts_round_trip(text_model, official_mxfp4, tmp_path):
    """save_pretrained reverses the registered conversions: a model built from a config or loaded from an
    official directory saves the official per-expert names; one loaded from our fused layout saves it as loaded, and
    export_release writes it in the release's; `save_original_format=False` always saves fused. Each loads back to identical logits."""
    ids = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(2))
    want = logits(text_model, ids)

    def saved_names(model, path, **kwargs):
        model.save_pretrained(path, **kwargs)
        return set(shard_tensors(path))

    names = saved_names(text_model, tmp_path / "fresh")
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names and not any("gate_up_proj" in n for n in names)
    assert not any(".mlp.experts" in n for n in names) and "model.layers.0.mlp.gate_proj.weight" in names
    reloaded = load(KimiK3ForCausalLM, tmp_path / "fresh")
    assert torch.equal(logits(reloaded, ids), want)

    names = saved_names(reloaded, tmp_path / "fused", save_original_format=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    fused = load(KimiK3ForCausalLM, tmp_path / "fused")
    assert torch.equal(logits(fused, ids), want)
    # saved from our fused layout with save_original_format=True: transformers saves it as loaded (fused, our config)
    names = saved_names(fused, tmp_path / "fused_again")
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    assert json.loads((tmp_path / "fused_again" / "config.json").read_text())["model_type"] == "kimi_k3_text"
    assert torch.equal(logits(load(KimiK3ForCausalLM, tmp_path / "fused_again"), ids), want)
    # the release's layout of the same model comes from the exporter
    export_release(fused, tmp_path / "fused_exported")
    names = set(shard_tensors(tmp_path / "fused_exported"))
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names and not any("gate_up_proj" in n for n in names)
    assert torch.equal(logits(load(KimiK3ForCausalLM, tmp_path / "fused_exported"), ids), want)

    from_official = load(KimiK3ForCausalLM, official_mxfp4, dtype=torch.bfloat16, **dequantized())
    names = saved_names(from_official, tmp_path / "from_official")
    assert "model.layers.3.block_sparse_moe.experts.0.w1.weight" in names  # dequantised, never re-quantised
    assert "quantization_config" not in (tmp_path / "from_official" / "config.json").read_text()
    assert torch.equal(logits(load(KimiK3ForCausalLM, tmp_path / "from_official"), ids), logits(from_official, ids))


# --------------------------------------------------------------------------------------------------
# Command line and bad input
def test_scripts_have_help():
    for name in ("convert_k3_official_to_hf", "convert_kimi_linear_to_k3", "export_to_official"):
        result = subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), "--help"], capture_output=True, text=True)
        assert result.returncode == 0 and "--input" in result.stdout and "--dry-run" in result.stdout, name


def test_dry_run_lists_mapping_and_writes_nothing(official_mxfp4, tmp_path, capsys):
    out = tmp_path / "never"
    assert _script("convert_k3_official_to_hf").main(["--input", str(official_mxfp4), "--output", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "model.layers.3.mlp.experts.gate_up_proj [8, 64, 32] bfloat16 <- model.layers.3.mlp.experts.{0..7}.{w1,w3} (MXFP4)" in printed
    assert "model.layers.0.self_attn.A_log [4] float32" in printed and "rotary cache" in printed
    assert not out.exists()


def _broken_copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "broken"
    shutil.copytree(source, target)
    return target


def _rewrite_shard(path: Path, name: str, edit):
    """Rewrites the shard holding tensor ``name`` with ``edit(dict_of_tensors)`` applied."""
    shard = path / _index(path)[name]
    tensors = shard_tensors_file(shard)
    edit(tensors)
    save_file(tensors, str(shard))
    return shard


@pytest.mark.parametrize("problem", ["missing_shard", "wrong_shape", "unknown_key", "truncated", "pickle_index",
                                     "pickle_only", "pickle_named_safetensors", "missing_expert"])
def test_bad_input_is_reported_with_file_and_tensor(official_bf16, tmp_path, problem):
    path = _broken_copy(official_bf16, tmp_path)
    index = _index(path)
    name = "model.layers.1.self_attn.q_proj.weight"
    shard = path / index[name]
    expect = [shard.name]
    if problem == "missing_shard":
        shard.unlink()
        expect += ["shard file is missing", "the index puts tensors `model.layers.1."]
    elif problem == "wrong_shape":
        _rewrite_shard(path, name, lambda t: t.__setitem__(name, torch.zeros(63, 64, dtype=torch.bfloat16)))
        expect += [name, "wrong shape [63, 64]", "[64, 64]"]
    elif problem == "unknown_key":
        bogus = "model.layers.1.self_attn.bogus_proj.weight"
        _rewrite_shard(path, name, lambda t: t.__setitem__(bogus, torch.zeros(2)))
        data = json.loads((path / "model.safetensors.index.json").read_text())
        data["weight_map"][bogus] = shard.name
        (path / "model.safetensors.index.json").write_text(json.dumps(data))
        expect += [bogus, "unknown tensor"]
    elif problem == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 100)
        expect += ["truncated"]
    elif problem == "pickle_index":
        data = json.loads((path / "model.safetensors.index.json").read_text())
        data["weight_map"][name] = "pytorch_model-00001.bin"
        (path / "model.safetensors.index.json").write_text(json.dumps(data))
        expect = ["pytorch_model-00001.bin", name, "pickle"]
    elif problem == "pickle_only":
        for file in list(path.glob("*.safetensors")) + [path / "model.safetensors.index.json"]:
            file.unlink()
        torch.save({"x": torch.zeros(1)}, path / "pytorch_model.bin")
        expect = ["pytorch_model.bin", "pickle"]
    elif problem == "pickle_named_safetensors":
        torch.save({"x": torch.zeros(1)}, shard)
        expect += ["pickle"]
    elif problem == "missing_expert":
        gone = "model.layers.2.block_sparse_moe.experts.5.w3.weight"
        expert_shard = path / index[gone]
        tensors = shard_tensors_file(expert_shard)
        del tensors[gone]
        save_file(tensors, str(expert_shard))
        data = json.loads((path / "model.safetensors.index.json").read_text())
        del data["weight_map"][gone]
        (path / "model.safetensors.index.json").write_text(json.dumps(data))
        expect = ["model.layers.2.", "experts.5.w3.weight", "missing"]  # (named under either FFN alias)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as error:
        convert_official_checkpoint(path, out, progress=False)
    for fragment in expect:
        assert fragment in str(error.value), (fragment, str(error.value))
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_failure_while_writing_leaves_nothing(official_mxfp4, tmp_path):
    """An error discovered only while converting (an E8M0 NaN scale) removes the half-written output."""
    path = _broken_copy(official_mxfp4, tmp_path)
    name = "model.layers.5.block_sparse_moe.experts.6.w1.weight_scale"
    _rewrite_shard(path, name, lambda t: t[name].fill_(255))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"experts\.6\.w1\.weight_packed.*255"):
        convert_official_checkpoint(path, out, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_fp8_block_weights_and_extra_layers(official_bf16, text_model, tmp_path):
    """Third-party FP8 variants (spec 10.2): an e4m3 weight with a 128x128-block `weight_scale_inv` is
    dequantised; tensors of layers beyond num_hidden_layers (MTP) are skipped, as SGLang does."""
    path = _broken_copy(official_bf16, tmp_path)
    name = "model.layers.2.self_attn.q_b_proj.weight"  # [96, 32]: one partial block
    codes = torch.randint(-8, 9, (96, 32), generator=torch.Generator().manual_seed(5)).float()

    def edit(tensors):
        tensors[name] = codes.to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.tensor([[0.25]])
        tensors["model.layers.6.self_attn.q_proj.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)  # an MTP layer

    shard = _rewrite_shard(path, name, edit)
    data = json.loads((path / "model.safetensors.index.json").read_text())
    data["weight_map"].update({name + "_scale_inv": shard.name, "model.layers.6.self_attn.q_proj.weight": shard.name})
    (path / "model.safetensors.index.json").write_text(json.dumps(data))
    plan = convert_official_checkpoint(path, tmp_path / "out", progress=False)
    assert any("layers [6]" in line for line in plan.skipped)
    out = shard_tensors(tmp_path / "out")
    assert torch.equal(out[name], (codes * 0.25).to(torch.bfloat16))
    assert name + "_scale_inv" not in out


# --------------------------------------------------------------------------------------------------
# Kimi Linear
@pytest.mark.parametrize("layout", ["moonshot", "in_tree"])
def test_kimi_linear_checkpoint_matches_transformers(layout, tmp_path):
    from references import VOCAB, build_pair

    reference, _ = build_pair(seed=3)
    source = tmp_path / layout
    # save_pretrained writes Moonshot's original layout (transformers reverses its Kimi Linear mapping);
    # save_original_format=False writes the in-tree state dict (fused q|k|v conv, forget_gate.*)
    reference.save_pretrained(source, save_original_format=(layout == "moonshot"))
    names = set(shard_tensors(source))
    assert ("model.layers.0.self_attn.conv1d.weight" in names) == (layout == "in_tree")
    out = tmp_path / "k3"
    assert _script("convert_kimi_linear_to_k3").main(
        ["--input", str(source), "--output", str(out), "--dtype", "fp32", "--quiet"]) == 0
    model = load(KimiK3ForCausalLM, out, dtype=torch.float32)
    assert model.config.attn_res_block_size is None and model.config.routed_expert_hidden_size is None
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(4))
    assert (logits(reference, ids) - logits(model, ids)).abs().max().item() <= 1e-4


# --------------------------------------------------------------------------------------------------
# Tokenizer
def _train_ranks(text: str, merges: int, pattern: str) -> dict[bytes, int]:
    """A small byte-level BPE trained on ``text`` (our own fixture generator, tiktoken-format ranks)."""
    import regex

    ranks = {bytes([b]): b for b in range(256)}
    words = collections.Counter(piece.encode() for piece in regex.findall(pattern, text))
    split = {w: [bytes([b]) for b in w] for w in words}
    for _ in range(merges):
        pairs = collections.Counter()
        for word, count in words.items():
            parts = split[word]
            for pair in zip(parts, parts[1:]):
                pairs[pair] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        for word, parts in split.items():
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            split[word] = merged
    return ranks


def test_tokenizer_conversion_matches_tiktoken(tmp_path, official_bf16):
    tiktoken = pytest.importorskip("tiktoken")
    from transformers import AutoTokenizer

    from transformers_k3.convert.tokenizer import KIMI_PATTERN, special_tokens_from_config

    # a corpus that is always there: this package's own source (English prose, code, numbers, whitespace)
    package = Path(transformers_k3.__file__).parent
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(package.rglob("*.py")))
    ranks = _train_ranks(text[:40000], 300, KIMI_PATTERN)
    source = _broken_copy(official_bf16, tmp_path)
    with open(source / "tiktoken.model", "w") as f:
        for token, rank in ranks.items():
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    n = len(ranks)
    named = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|open|>", n + 3: "<|close|>", n + 4: "<|sep|>",
             n + 9: "<|media_begin|>", n + 10: "<|media_content|>", n + 11: "<|media_end|>", n + 21: "<|media_pad|>",
             n + 30: "<|end_of_msg|>", n + 31: "[EOT]", n + 255: "[PAD]"}
    tokenizer_config = {"added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in named.items()},
                        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
                        "tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.X", None]}}
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    # the release's tokenizer code states the pattern; it is read with `ast`, never run
    (source / "tokenization_kimi.py").write_text(f"import sys\nsys.exit(1)\npat_str = '|'.join({KIMI_PATTERN.split('|')!r})\n")
    out = tmp_path / "ours"
    convert_official_checkpoint(source, out, progress=False)
    hf = AutoTokenizer.from_pretrained(out)
    specials = special_tokens_from_config(tokenizer_config, n)
    assert len(specials) == 256 and specials["<|reserved_token_%d|>" % (n + 5)] == n + 5
    reference = tiktoken.Encoding("fixture", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    corpus = [
        text[40000:52000],
        "Hello 世界!! don't  stop\n\n\t x 1234567 😀 café ÉCOLE's <|open|>think<|sep|>reasoning<|close|>think<|sep|>",
        "".join(specials) + " trailing   spaces   \r\n\r\n",
        "<|media_begin|>image 640x480<|media_content|><|media_pad|><|media_pad|><|media_end|>[EOS][EOT]",
    ]
    for sample in corpus:
        ids = reference.encode(sample, allowed_special="all")
        assert hf.encode(sample, add_special_tokens=False) == ids
        assert hf.decode(ids) == sample
    assert hf.convert_tokens_to_ids("<|media_pad|>") == n + 21 and hf.eos_token == "[EOS]"
    from transformers import AutoTokenizer

    from transformers_k3 import KIMI_K3_RESPONSE_TEMPLATE

    # the converted directory's tokenizer parses chat answers (the text-generation pipeline's reasoning / content)
    assert AutoTokenizer.from_pretrained(out).response_template == KIMI_K3_RESPONSE_TEMPLATE
    assert (out / "tokenizer_config.tiktoken.json").is_file() and (out / "tiktoken.model").is_file()
    back = tmp_path / "back"
    export_to_official(out, back, progress=False)  # the release's own tokenizer files come back
    assert json.loads((back / "tokenizer_config.json").read_text()) == tokenizer_config
    assert not (back / "tokenizer.json").exists()


# --------------------------------------------------------------------------------------------------
# Streaming: peak memory of a many-shard conversion
MEMORY_PROBE = textwrap.dedent("""
    import json, sys
    from transformers_k3.convert import convert_official_checkpoint

    def status(key):  # kB -> bytes, from the kernel's accounting of this process
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    source, output = sys.argv[1], sys.argv[2]
    convert_official_checkpoint(source, dry_run=True)  # imports, config, meta model: not part of the streaming
    try:  # reset the peak (VmHWM) to the current RSS; ru_maxrss would include the parent's RSS at fork
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the peak may include the dry run: still an upper bound
    start = status("VmRSS")
    convert_official_checkpoint(source, output, max_shard_size="6MB", progress=False)
    print(json.dumps({"start_rss": start, "peak_rss": status("VmHWM")}))
""")


def test_streaming_peak_memory_is_about_one_shard(tmp_path):
    """Converts a ~100 MB, 17-shard official checkpoint whose experts span shards; the resident-set growth
    over the process's state before converting stays far below the checkpoint size (it is bounded by about
    one input shard; the note in the report quotes the numbers)."""
    config = KimiK3TextConfig.tiny(hidden_size=128, num_experts=64, moe_intermediate_size=256,
                                   routed_expert_hidden_size=256, vocab_size=1024)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = KimiK3ForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, tensor in meta.state_dict().items():
        dtype = torch.float32 if FP32_TENSOR_RE.search(name) else torch.bfloat16
        state[name] = (0.02 * torch.randn(tensor.shape, generator=gen)).to(dtype)
    source = tmp_path / "many_shards"
    shards = write_state_dict(k3_to_official_state_dict(state), source, max_shard_size="6MB")
    (source / "config.json").write_text(json.dumps(official_config_dict(config, False)))
    del state
    total = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    largest = max(p.stat().st_size for p in source.glob("*.safetensors"))
    result = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(source), str(tmp_path / "out")],
                            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    growth = numbers["peak_rss"] - numbers["start_rss"]
    print(f"\n{len(shards)} input shards, {total / 1e6:.1f} MB in all, largest {largest / 1e6:.1f} MB; "
          f"peak RSS growth while converting {growth / 1e6:.1f} MB (RSS before {numbers['start_rss'] / 1e6:.0f} MB)")
    assert len(shards) >= 10 and total > 80e6
    assert growth < max(4 * largest, 0.25 * total), (growth, largest, total)
    out = shard_tensors_header(tmp_path / "out")
    # every tensor of the model, the stacked short-convolution filter as the release's three
    assert out["model.layers.1.mlp.experts.gate_up_proj"] == [64, 512, 256] and len(out) == sum(
        len(split_short_conv(name, tensor)) for name, tensor in meta.state_dict().items())


def shard_tensors_header(directory: Path) -> dict:
    from transformers_k3.safetensors_header import read_safetensors_header

    return {name: list(info.shape) for path in directory.glob("*.safetensors")
            for name, info in read_safetensors_header(path).items()}
