"""The release's MXFP4 routed experts loaded as they ship and saved as they came (issue 46, docs/mxfp4.md "Loading
and saving packed"), on official-layout fixtures written from the release's inventory rules (references.py), with
several shards and a layer's experts spread over more than one:

* ``from_pretrained`` keeps the experts packed by default (uint8 bytes, ``quantization_config`` picks
  ``KimiK3Mxfp4Config()`` / ``KimiK3Mxfp4Config(dequantize=True)``); packed and dequantized logits agree in fp32
  within 1e-5 relative and greedy decoding is identical over 32 tokens;
* save -> reload -> save writes every tensor of the release back bit for bit (the release's names and dtypes; our
  ``config.json``, whose ``quantization_config`` reloads them packed);
* the expert tensors' resident bytes and the peak RSS while loading, measured;
* ``KimiK3Mxfp4Config(dequantize=True)`` gives the model loading gave before (experts dequantized exactly, no
  quantizer left on the model, the save the release's bf16 layout).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import transformers_k3  # noqa: F401  (registers the classes, mappings and the quantizer)
from transformers_k3 import KimiK3ForCausalLM, KimiK3Mxfp4Config, KimiK3TextConfig
from transformers_k3.conversion import CheckpointError, dequantize_mxfp4
from transformers_k3.conversion.keymap import release_quantization_config

from references import BF16, FP32, load, release_state, shard_tensors, write_release

IDS = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(0))


def _is_expert(name: str) -> bool:
    return ".block_sparse_moe.experts." in name


def write_small_shards(path: Path, state: dict, config) -> Path:
    """`write_release` with shards small enough that one layer's experts span several."""
    from transformers_k3.convert.export import official_config_dict
    from transformers_k3.conversion.streaming import write_state_dict

    write_state_dict(state, path, max_shard_size=6_000)
    data = official_config_dict(config, False, "bf16", release_quantization_config())
    (path / "config.json").write_text(json.dumps(data, indent=1))
    return path


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    config = KimiK3TextConfig.tiny()
    path = tmp_path_factory.mktemp("release") / "text_mxfp4"
    return write_small_shards(path, release_state(config, False, True, 1), config)


@pytest.fixture(scope="module")
def release_bf16_experts(tmp_path_factory):
    config = KimiK3TextConfig.tiny()
    path = tmp_path_factory.mktemp("release") / "text_bf16"
    return write_release(path, release_state(config, False, False, 1), config, False, False)


def _expert_bytes(model) -> int:
    """Bytes of the storages behind the routed experts' tensors (each storage once)."""
    seen, total = set(), 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        storage = tensor.untyped_storage()
        if ".mlp.experts." in name and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def test_fixture_has_several_shards_with_a_layer_across_them(release):
    index = json.loads((release / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 3
    layer = {shard for name, shard in index.items() if ".layers.1.block_sparse_moe.experts." in name}
    assert len(layer) >= 2


def test_packed_by_default_and_logits_match_dequantized(release):
    packed = load(KimiK3ForCausalLM, release, dtype=FP32)
    auto = load(AutoModelForCausalLM, release, dtype=FP32)
    dequantized = load(KimiK3ForCausalLM, release, dtype=FP32, quantization_config=KimiK3Mxfp4Config(dequantize=True))
    experts = packed.model.layers[1].mlp.experts
    stacks = dict(experts.named_parameters())  # (frozen uint8 parameters, no buffers)
    assert sorted(stacks) == ["down_packed", "down_scale", "gate_up_packed", "gate_up_scale"]
    assert {t.dtype for t in stacks.values()} == {torch.uint8} and not any(t.requires_grad for t in stacks.values())
    assert not list(experts.buffers())
    with torch.no_grad():
        a, b, c = packed(IDS).logits, dequantized(IDS).logits, auto(IDS).logits
    assert torch.equal(a, c)
    assert (a - b).abs().max() <= 1e-5 * b.abs().max(), float((a - b).abs().max() / b.abs().max())
    prompt = IDS[:1, :8]
    greedy = {"max_new_tokens": 32, "min_new_tokens": 32, "do_sample": False}
    assert torch.equal(packed.generate(prompt, **greedy), dequantized.generate(prompt, **greedy))


def test_packed_experts_backward_reaches_the_inputs(release):
    packed = load(KimiK3ForCausalLM, release, dtype=FP32)
    dequantized = load(KimiK3ForCausalLM, release, dtype=FP32, quantization_config=KimiK3Mxfp4Config(dequantize=True))
    grads = []
    for model in (packed, dequantized):
        embeds = model.get_input_embeddings()(IDS).detach().requires_grad_()
        model(inputs_embeds=embeds).logits.float().pow(2).mean().backward()
        grads.append(embeds.grad)
    assert (grads[0] - grads[1]).abs().max() <= 1e-4 * grads[1].abs().max()


def test_save_reload_save_is_bit_identical(release, tmp_path):
    model = load(KimiK3ForCausalLM, release, dtype=BF16)  # (the release's dtype)
    model.save_pretrained(tmp_path / "first", max_shard_size="40KB")
    again = load(KimiK3ForCausalLM, tmp_path / "first", dtype=BF16)
    again.save_pretrained(tmp_path / "second", max_shard_size="40KB")
    original, first, second = (shard_tensors(p) for p in (release, tmp_path / "first", tmp_path / "second"))
    assert sorted(original) == sorted(first) == sorted(second)
    assert sum(map(_is_expert, original)) == 5 * 8 * 3 * 2
    for name, tensor in original.items():  # every tensor: the release's name, dtype, shape and bytes
        for saved in (first[name], second[name]):
            assert saved.dtype == tensor.dtype and saved.shape == tensor.shape, name
            assert torch.equal(saved.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    for directory in (tmp_path / "first", tmp_path / "second"):  # our config, which reloads the experts packed
        config = json.loads((directory / "config.json").read_text())
        assert config["quantization_config"] == {"quant_method": "k3_mxfp4", "dequantize": False}
    assert torch.equal(again(IDS).logits, model(IDS).logits)


def _assert_same_tensors(want: dict, got: dict, what: str) -> None:
    """Same names, and per tensor the same dtype, shape and bytes."""
    assert sorted(want) == sorted(got), what
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, (what, name)
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), (what, name)


def test_4d_scales_load_packed_and_save_in_the_releases_shape(release, tmp_path):
    """Scales stored ``[N, 1, K/32, 1]`` (some exporters) load packed to the model the release's ``[N, K/32]`` give
    (same stacks, same logits); saving writes the release's layout: the same bytes as ``[N, K/32]``, and save ->
    reload -> save stays bit-identical."""
    from transformers_k3.conversion.streaming import write_state_dict

    original = shard_tensors(release)
    state = {name: t.reshape(t.shape[0], 1, t.shape[1], 1) if name.endswith("weight_scale") else t
             for name, t in original.items()}
    write_state_dict(state, tmp_path / "scales_4d", max_shard_size=40_000)
    (tmp_path / "scales_4d" / "config.json").write_text((release / "config.json").read_text())
    four_d = load(KimiK3ForCausalLM, tmp_path / "scales_4d", dtype=BF16)
    two_d = load(KimiK3ForCausalLM, release, dtype=BF16)
    for (name, a), (_, b) in zip(four_d.state_dict().items(), two_d.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(four_d(IDS).logits, two_d(IDS).logits)
    four_d.save_pretrained(tmp_path / "first", max_shard_size="40KB")
    load(KimiK3ForCausalLM, tmp_path / "first", dtype=BF16).save_pretrained(tmp_path / "second", max_shard_size="40KB")
    for directory in ("first", "second"):
        _assert_same_tensors(original, shard_tensors(tmp_path / directory), directory)


def test_export_release_of_a_packed_model_writes_the_release_as_it_came(release, tmp_path):
    """``export_release`` on a model loaded packed writes the release back: every tensor (experts included) with the
    release's name, dtype, shape and bytes (the packed bytes copied, never dequantized and quantized again), and
    the release's ``config.json`` with its compressed-tensors ``quantization_config``. The export loads packed and
    gives the same logits; exporting it again gives the same files. ``mxfp4=False`` writes the experts
    dequantized."""
    from transformers_k3 import export_release

    model = load(KimiK3ForCausalLM, release, dtype=BF16)
    export_release(model, tmp_path / "exported", max_shard_size="40KB")
    original = shard_tensors(release)
    _assert_same_tensors(original, shard_tensors(tmp_path / "exported"), "exported")
    assert sum(map(_is_expert, original)) == 5 * 8 * 3 * 2
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["quantization_config"] == release_quantization_config()
    assert config == json.loads((release / "config.json").read_text())
    again = load(KimiK3ForCausalLM, tmp_path / "exported", dtype=BF16)
    assert {t.dtype for _, t in again.model.layers[1].mlp.experts.named_parameters()} == {torch.uint8}
    assert torch.equal(again(IDS).logits, model(IDS).logits)
    export_release(again, tmp_path / "exported_again", max_shard_size="40KB")
    _assert_same_tensors(original, shard_tensors(tmp_path / "exported_again"), "exported again")

    export_release(model, tmp_path / "dequantized", max_shard_size="40KB", mxfp4=False)
    dequantized = shard_tensors(tmp_path / "dequantized")
    stem = "model.layers.2.block_sparse_moe.experts.5.w2."
    assert torch.equal(dequantized[stem + "weight"],
                       dequantize_mxfp4(original[stem + "weight_packed"], original[stem + "weight_scale"], BF16))
    assert not any(n.endswith(("weight_packed", "weight_scale")) for n in dequantized)
    assert "quantization_config" not in json.loads((tmp_path / "dequantized" / "config.json").read_text())


def test_export_of_a_fused_save_of_a_packed_model_writes_the_release_as_it_came(release, tmp_path):
    """A packed model saved in our fused layout (``save_original_format=False``: each layer's four stacks) exports
    with ``mxfp4=True`` to the release as it came: every tensor's name, dtype, shape and bytes (the experts' bytes
    sliced from the stacks, not re-quantized) and the release's ``config.json``; the export loads packed with the
    same logits. ``mxfp4=False`` writes every expert dequantized by the release's rule."""
    from transformers_k3.convert.export import export_to_official

    model = load(KimiK3ForCausalLM, release, dtype=BF16)
    model.save_pretrained(tmp_path / "fused", save_original_format=False, max_shard_size="40KB")
    fused = shard_tensors(tmp_path / "fused")
    assert "model.layers.1.mlp.experts.gate_up_packed" in fused and not any(map(_is_expert, fused))
    export_to_official(tmp_path / "fused", tmp_path / "exported", max_shard_size="40KB", progress=False, mxfp4=True)
    original = shard_tensors(release)
    _assert_same_tensors(original, shard_tensors(tmp_path / "exported"), "exported")
    assert sum(map(_is_expert, original)) == 5 * 8 * 3 * 2
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["quantization_config"] == release_quantization_config()
    assert config == json.loads((release / "config.json").read_text())
    again = load(KimiK3ForCausalLM, tmp_path / "exported", dtype=BF16)
    assert {t.dtype for _, t in again.model.layers[1].mlp.experts.named_parameters()} == {torch.uint8}
    assert torch.equal(again(IDS).logits, model(IDS).logits)

    export_to_official(tmp_path / "fused", tmp_path / "dequantized", max_shard_size="40KB", progress=False)
    dequantized = shard_tensors(tmp_path / "dequantized")
    assert not any(n.endswith(("weight_packed", "weight_scale")) for n in dequantized)
    assert "quantization_config" not in json.loads((tmp_path / "dequantized" / "config.json").read_text())
    for name, packed in original.items():
        if name.endswith(".weight_packed"):
            stem = name[: -len("_packed")]
            want = dequantize_mxfp4(packed, original[stem + "_scale"], BF16)
            assert dequantized[stem].dtype == BF16 and torch.equal(dequantized[stem], want), stem

    # a layer's stacks that are not the packed layout's (one missing, or not uint8) are refused by name
    from transformers_k3.conversion.streaming import write_state_dict

    for broken, change in (("no_scale", lambda t: t.pop("model.layers.2.mlp.experts.down_scale")),
                           ("float", lambda t: t.update({"model.layers.2.mlp.experts.down_scale":
                                                         t["model.layers.2.mlp.experts.down_scale"].float()}))):
        state = dict(fused)
        change(state)
        write_state_dict(state, tmp_path / broken, max_shard_size=40_000)
        (tmp_path / broken / "config.json").write_text((tmp_path / "fused" / "config.json").read_text())
        with pytest.raises(CheckpointError, match="model.layers.2.mlp.experts.down_(packed|scale)"):
            export_to_official(tmp_path / broken, tmp_path / "refused", dry_run=True, mxfp4=True)


def test_expert_resident_bytes_against_the_bf16_model(release):
    packed = load(KimiK3ForCausalLM, release, dtype=BF16)
    bf16 = load(KimiK3ForCausalLM, release, dtype=BF16, quantization_config=KimiK3Mxfp4Config(dequantize=True))
    ratio = _expert_bytes(packed) / _expert_bytes(bf16)
    assert ratio <= 0.3, ratio


_STATUS = textwrap.dedent("""
    def status():
        fields = {}
        for line in open("/proc/self/status"):
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024 if value.strip().endswith("kB") else 0
        return fields
""")  # (a fresh process's /proc/self/status in bytes, for both RSS scripts)

_PEAK_RSS = textwrap.dedent("""
    import json, sys, torch
    import transformers_k3
    from transformers_k3 import KimiK3ForCausalLM

    KimiK3ForCausalLM.from_pretrained(sys.argv[2], dtype=torch.bfloat16)  # (code paths warm, caches filled)
    before = status()
    model = KimiK3ForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
    after = status()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    experts = sum(p.untyped_storage().nbytes() for n, p in model.named_parameters() if ".mlp.experts." in n)
    print(json.dumps({"peak": after["VmHWM"] - before["VmRSS"], "model": sum(storages.values()), "experts": experts,
                      "anon": after["RssAnon"] - before["RssAnon"], "file": after["RssFile"] - before["RssFile"]}))
    if len(sys.argv) > 3:
        model.save_pretrained(sys.argv[3])
""")


def _measure_load(path: Path, warm: Path, save_to: Path | None = None) -> dict:
    args = [sys.executable, "-c", _STATUS + _PEAK_RSS, str(path), str(warm)] + ([str(save_to)] if save_to else [])
    result = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))


@pytest.fixture(scope="module")
def wide_release(tmp_path_factory):
    """Experts wide enough that one expert's tensors span many memory pages (the release's are megabytes) and
    shards of megabytes, so the page granularity of memory-mapped reads and the per-tensor bookkeeping do not
    dominate the measurement."""
    config = KimiK3TextConfig.tiny(num_experts=64, num_experts_per_token=8, routed_expert_hidden_size=512,
                                   moe_intermediate_size=512)
    path = tmp_path_factory.mktemp("release") / "wide"
    from transformers_k3.convert.export import official_config_dict
    from transformers_k3.conversion.streaming import write_state_dict

    write_state_dict(release_state(config, False, True, 4), path, max_shard_size="8MB")
    data = official_config_dict(config, False, "bf16", release_quantization_config())
    (path / "config.json").write_text(json.dumps(data, indent=1))
    return path, config


def test_peak_rss_while_loading_packed(wide_release, release, tmp_path):
    """Measured in a fresh process (``VmHWM`` from ``/proc/self/status`` minus the resident set before loading,
    after a first load warmed the code paths): the peak resident set while loading the release, and while
    loading its save, is at most 1.2x the packed model's bytes. ``VmHWM`` counts the checkpoint's memory-mapped
    pages too (``RssFile``): once an expert's bytes are copied into its layer's stack, its file pages leave the
    resident set (`mapped_page_releaser`); no floating-point copy of the experts exists at any time."""
    path, config = wide_release
    bf16_expert_bytes = 5 * config.num_experts * 3 * 512 * 512 * 2  # (5 MoE layers)
    for source, save_to in ((path, tmp_path / "saved"), (tmp_path / "saved", None)):
        measured = _measure_load(source, release, save_to)
        assert measured["experts"] * 4 < bf16_expert_bytes * 1.1  # (0.53 bytes a weight)
        print(f"{source.name}: peak RSS while loading {measured['peak'] / 2**20:.1f} MiB "
              f"({measured['peak'] / measured['model']:.3f}x the packed model's {measured['model'] / 2**20:.1f} MiB; "
              f"after loading anonymous {measured['anon'] / 2**20:.1f} MiB, file-backed {measured['file'] / 2**20:.1f}"
              f" MiB), bf16 experts {bf16_expert_bytes / 2**20:.1f} MiB")
        assert measured["peak"] <= 1.2 * measured["model"], measured
        assert measured["peak"] < 0.75 * bf16_expert_bytes, measured


def test_dequantize_config_gives_the_model_loading_gave_before(release, tmp_path):
    model = load(KimiK3ForCausalLM, release, dtype=BF16, quantization_config=KimiK3Mxfp4Config(dequantize=True))
    assert getattr(model, "hf_quantizer", None) is None and getattr(model.config, "quantization_config", None) is None
    original = shard_tensors(release)
    for layer in range(1, 6):
        experts = model.model.layers[layer].mlp.experts
        stem = f"model.layers.{layer}.block_sparse_moe.experts."
        for e in range(8):
            w = {p: dequantize_mxfp4(original[f"{stem}{e}.{p}.weight_packed"], original[f"{stem}{e}.{p}.weight_scale"],
                                     BF16) for p in ("w1", "w2", "w3")}  # fmt: skip
            assert torch.equal(experts.gate_up_proj[e], torch.cat([w["w1"], w["w3"]]))
            assert torch.equal(experts.down_proj[e], w["w2"])
    model.save_pretrained(tmp_path / "saved", max_shard_size="40KB")
    saved = shard_tensors(tmp_path / "saved")
    assert not any(n.endswith(("weight_packed", "weight_scale")) for n in saved)
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())


def test_packed_experts_refuse_the_bf16_experts_function(release):
    model = load(KimiK3ForCausalLM, release, dtype=FP32)
    model.set_experts_implementation("k3_grouped_mm")
    with pytest.raises(NotImplementedError, match="k3_mxfp4"):
        model(IDS)


def test_keep_packed_refuses_plain_experts(release_bf16_experts):
    with pytest.raises(CheckpointError, match="dequantize=True"):
        KimiK3ForCausalLM.from_pretrained(release_bf16_experts, quantization_config=KimiK3Mxfp4Config())


def test_a_nan_scale_is_refused_at_load(release, tmp_path):
    from transformers_k3.conversion.streaming import write_state_dict

    state = shard_tensors(release)
    name = "model.layers.2.block_sparse_moe.experts.3.w2.weight_scale"
    state[name] = state[name].clone()
    state[name][0, 0] = 255  # (E8M0's NaN)
    config = json.loads((release / "config.json").read_text())
    write_state_dict(state, tmp_path / "bad", max_shard_size=40_000)
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"layers.2.mlp.experts`: expert 3 w2: .*E8M0"):
        KimiK3ForCausalLM.from_pretrained(tmp_path / "bad")


# ----- The packed stacks as frozen uint8 parameters: optimizers, counts, accelerate offload -----

_STACKS = ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale")


def _stacks(model) -> dict[str, torch.Tensor]:
    """Every MoE layer's four packed stacks by name (the fixture has five MoE layers)."""
    stacks = {n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in _STACKS}
    assert len(stacks) == 4 * 5, sorted(stacks)
    return stacks


def test_an_optimizer_over_all_parameters_leaves_the_packed_experts(release):
    """AdamW over ``model.parameters()``, gradient checkpointing on: the packed stacks (``requires_grad=False``) get
    no gradient and keep their bytes, every weight that got a gradient moved."""
    model = load(KimiK3ForCausalLM, release, dtype=FP32).train()
    model.activation_checkpointing_enable()
    stacks = _stacks(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(input_ids=IDS, labels=IDS).loss.backward()
        stepped = {n for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
    assert not stepped & set(stacks)
    for name, p in stacks.items():
        assert p.dtype == torch.uint8 and not p.requires_grad and torch.equal(p, before[name]), name
    assert any(".mlp.routed_expert_up_proj." in n for n in stepped) and any(".self_attn." in n for n in stepped)
    for name in stepped:
        assert not torch.equal(model.get_parameter(name), before[name]), name


def test_parameter_count_and_footprint_count_the_packed_bytes(release):
    """``num_parameters()`` counts a packed stack's stored elements (a byte of two codes, or a scale, is one:
    ~0.53 per expert weight, as transformers counts gpt-oss's MXFP4 blocks); ``only_trainable=True`` leaves the
    frozen stacks out; ``get_memory_footprint()`` holds the stacks' uint8 bytes in place of the dequantized weights."""
    packed = load(KimiK3ForCausalLM, release, dtype=FP32)
    dequantized = load(KimiK3ForCausalLM, release, dtype=FP32, quantization_config=KimiK3Mxfp4Config(dequantize=True))
    expert_weights = sum(p.numel() for n, p in dequantized.named_parameters() if ".mlp.experts." in n)
    stored = sum(p.numel() for p in _stacks(packed).values())
    assert stored == expert_weights // 2 + expert_weights // 32
    assert packed.num_parameters() == dequantized.num_parameters() - expert_weights + stored
    assert packed.num_parameters(only_trainable=True) == dequantized.num_parameters() - expert_weights
    assert packed.get_memory_footprint() == dequantized.get_memory_footprint() - 4 * expert_weights + stored


@pytest.mark.parametrize("share", [0.5, 0.0])
def test_disk_offload_keeps_the_experts_packed_without_offload_buffers(release, tmp_path, share):
    """``device_map="auto"`` under a CPU budget below the model's bytes (half of them: a CPU / disk split; none:
    all on disk), no ``offload_buffers``: the offloaded packed stacks leave memory (meta), the offload folder holds
    them as the uint8 bytes (each file about the stack's size, not a bf16 copy) and the logits equal the in-memory
    packed model's."""
    from safetensors import safe_open

    pytest.importorskip("accelerate")
    resident = load(KimiK3ForCausalLM, release, dtype=BF16)
    with torch.no_grad():
        want = resident(IDS).logits
    size = sum(t.numel() * t.element_size() for t in [*resident.parameters(), *resident.buffers()])
    model = KimiK3ForCausalLM.from_pretrained(release, dtype=BF16, device_map="auto", offload_folder=tmp_path / "off",
                                              max_memory={"cpu": int(size * share)}).eval()  # fmt: skip
    assert set(model.hf_device_map.values()) == ({"cpu", "disk"} if share else {"disk"}), model.hf_device_map
    offloaded = {n: p for n, p in _stacks(model).items() if p.device.type == "meta"}
    assert offloaded and (share or len(offloaded) == 20)
    for name, p in _stacks(resident).items():
        path = tmp_path / "off" / f"{name}.safetensors"
        assert path.exists() == (name in offloaded), name
        if name in offloaded:
            with safe_open(path, "pt") as f:
                saved = f.get_tensor(name)
            assert saved.dtype == torch.uint8 and torch.equal(saved, p), name
            assert path.stat().st_size < p.numel() + 1024, name  # (bf16 would be twice as many bytes per value)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)


# ----- Streaming the experts from disk (KimiK3Mxfp4Config(stream_experts=True), docs/mxfp4.md) -----

def _streamed(path, dtype=FP32, per_read=32):
    return load(KimiK3ForCausalLM, path, dtype=dtype,
                quantization_config=KimiK3Mxfp4Config(stream_experts=True, stream_experts_per_read=per_read))


def _release_expert_bytes(config) -> int:
    """One expert's bytes in the release: ``w1``, ``w3`` ``[I, D]`` and ``w2`` ``[D, I]``, half a byte a weight
    plus one scale byte per 32 weights."""
    d, i = config.routed_expert_hidden_size or config.hidden_size, config.moe_intermediate_size
    return 3 * (d * i // 2 + d * i // 32)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_streamed_experts_give_the_packed_models_logits(release, dtype):
    """Equal to the fully loaded packed model, bit for bit: each read's experts are computed by the same grouped
    products over the same rows and summed in the same order, however few experts one read holds."""
    from transformers_k3 import expert_stream
    from transformers_k3.quantization_kimi_k3 import KimiK3StreamedExperts

    packed = load(KimiK3ForCausalLM, release, dtype=dtype)
    with torch.no_grad():
        want = packed(IDS).logits
    for per_read in (32, 3, 1):
        streamed = _streamed(release, dtype, per_read)
        assert isinstance(streamed.model.layers[1].mlp.experts, KimiK3StreamedExperts)
        assert not [n for n, _ in [*streamed.named_parameters(), *streamed.named_buffers()] if ".mlp.experts." in n]
        with torch.no_grad():
            assert torch.equal(streamed(IDS).logits, want), per_read
        stream = expert_stream(streamed)
        assert stream.staging_bytes == min(per_read, 8) * _release_expert_bytes(streamed.config)
    assert expert_stream(packed) is None
    prompt = IDS[:1, :8]
    greedy = {"max_new_tokens": 32, "min_new_tokens": 32, "do_sample": False}
    assert torch.equal(streamed.generate(prompt, **greedy), packed.generate(prompt, **greedy))


def test_streamed_decode_reads_the_routed_experts_once_per_token(release):
    """A decode step of one token reads top-k experts of every MoE layer, and the counters say so."""
    from transformers_k3 import expert_stream

    model = _streamed(release, FP32, per_read=2)
    stream = expert_stream(model)
    config = model.config
    moe_layers = sum(1 for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    assert stream.checkpoint_expert_bytes == moe_layers * config.num_experts * _release_expert_bytes(config)
    with torch.no_grad():
        out = model(IDS[:1, :6], use_cache=True)
        prefill = stream.bytes_read
        assert stream.tokens == 6 and 0 < prefill <= moe_layers * config.num_experts * _release_expert_bytes(config)
        stream.reset()
        model(IDS[:1, 6:7], past_key_values=out.past_key_values, use_cache=True)
    per_token = moe_layers * config.num_experts_per_token * _release_expert_bytes(config)
    assert (stream.bytes_read, stream.tokens, stream.bytes_per_token) == (per_token, 1, per_token)


def test_streamed_experts_backward_equals_the_packed_models(release):
    """Gradients reach the inputs through streamed experts as through packed ones (each read's stacks stay the
    ones its products ran on: a read under autograd does not reuse the staging stacks)."""
    grads = []
    for model in (load(KimiK3ForCausalLM, release, dtype=FP32), _streamed(release, FP32, per_read=1)):
        embeds = model.get_input_embeddings()(IDS).detach().requires_grad_()
        model(inputs_embeds=embeds).logits.float().pow(2).mean().backward()
        grads.append(embeds.grad)
    assert torch.equal(grads[0], grads[1])


def test_streaming_refuses_what_it_cannot_do(release, release_bf16_experts, tmp_path):
    from transformers_k3.quantization_kimi_k3 import StreamedExpertsError

    model = _streamed(release)
    with pytest.raises(StreamedExpertsError, match="copy that checkpoint"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / "model.safetensors").exists()
    with pytest.raises(CheckpointError, match="not MXFP4"):
        KimiK3ForCausalLM.from_pretrained(release_bf16_experts, quantization_config=KimiK3Mxfp4Config(stream_experts=True))
    from transformers_k3.conversion.expert_stream import ExpertStream
    from transformers_k3.safetensors_header import read_safetensors_header

    files = sorted(release.glob("*.safetensors"))
    gone = next(f for f in files if any(".experts." in n for n in read_safetensors_header(f)))  # (holds experts)
    widths = {i: (f"model.layers.{i}.mlp.experts", model.config.num_experts, model.config.routed_expert_hidden_size
                  or model.config.hidden_size, model.config.moe_intermediate_size)
              for i in range(model.config.first_k_dense_replace, model.config.num_hidden_layers)}  # fmt: skip
    with pytest.raises(CheckpointError, match=r"has no `layers.\d+` expert \d+ w[123].weight_(packed|scale)"):
        ExpertStream.from_checkpoint([f for f in files if f != gone], widths, 2)
    with pytest.raises(ValueError, match="dequantize=True"):
        KimiK3Mxfp4Config(dequantize=True, stream_experts=True)
    with pytest.raises(ValueError, match="positive integer"):
        KimiK3Mxfp4Config(stream_experts=True, stream_experts_per_read=0)
    with pytest.raises(TypeError, match="stream_experts"):
        KimiK3Mxfp4Config(stream_experts="yes")


def test_a_streamed_nan_scale_is_refused_when_read(release, tmp_path):
    """Streaming reads no expert at load, so a bad scale is reported by the read that meets it, by expert."""
    from transformers_k3.conversion.streaming import write_state_dict

    state = shard_tensors(release)
    for expert in range(8):
        name = f"model.layers.2.block_sparse_moe.experts.{expert}.w2.weight_scale"
        state[name] = state[name].clone()
        state[name][0, 0] = 255  # (E8M0's NaN)
    write_state_dict(state, tmp_path / "bad", max_shard_size=40_000)
    (tmp_path / "bad" / "config.json").write_text((release / "config.json").read_text())
    model = _streamed(tmp_path / "bad")
    with pytest.raises(CheckpointError, match=r"layers.2.mlp.experts`: expert \d w2: .*E8M0"), torch.no_grad():
        model(IDS)


_LIMITED = textwrap.dedent("""
    import gc, json, logging, os, resource, sys, torch
    import transformers_k3
    from transformers_k3 import KimiK3ForCausalLM, KimiK3Mxfp4Config, expert_stream

    path, warm_path, ids, headroom = sys.argv[1], sys.argv[2], torch.tensor(json.loads(sys.argv[3])), int(sys.argv[4])
    stream = KimiK3Mxfp4Config(stream_experts=True, stream_experts_per_read=8)
    greedy = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    for quantization in (stream, None):  # (both loads' code paths and kernels warm before the baseline)
        KimiK3ForCausalLM.from_pretrained(warm_path, quantization_config=quantization).generate(ids, **greedy)
    gc.collect()
    page = os.sysconf("SC_PAGE_SIZE")
    shards = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    mapped = sum(-(-os.path.getsize(f) // page) * page for f in shards)

    def limit(nbytes):
        resource.setrlimit(resource.RLIMIT_DATA, (nbytes, resource.getrlimit(resource.RLIMIT_DATA)[1]))

    class Report(logging.Handler):  # (transformers logs a failed conversion in its load report, then raises)
        messages = []
        def emit(self, record):
            self.messages.append(record.getMessage())

    logging.getLogger("transformers").addHandler(Report())
    before = status()
    limit(before["VmData"] + mapped + headroom)  # (from_pretrained maps the shards copy-on-write: counted)
    model = KimiK3ForCausalLM.from_pretrained(path, quantization_config=stream)
    limit(before["VmData"] + headroom)
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, **greedy)
    after = status()
    s = expert_stream(model)
    measured = {"base": before["VmData"], "data": after["VmData"], "peak": after["VmHWM"] - before["VmRSS"],
                "checkpoint": s.checkpoint_expert_bytes, "staging": s.staging_bytes, "per_token": s.bytes_per_token,
                "file": after["RssFile"] - before["RssFile"]}
    del model, s
    gc.collect()
    limit(before["VmData"] + mapped + headroom)
    try:
        KimiK3ForCausalLM.from_pretrained(path)
        measured["control"] = None
    except (MemoryError, RuntimeError) as error:  # (torch's allocator raises a RuntimeError with errno 12)
        failed = [text for text in (str(error), *Report.messages) if "Cannot allocate memory" in text]
        if not isinstance(error, MemoryError) and not failed:
            raise
        measured["control"] = (failed or [repr(error)])[-1][-2000:]
    limit(resource.RLIM_INFINITY)
    torch.save({"logits": logits, "tokens": tokens}, sys.argv[5])
    print(json.dumps(measured))
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmData from /proc/self/status (Linux)")
def test_streamed_decode_runs_under_a_memory_limit_smaller_than_the_checkpoint(wide_release, release, tmp_path):
    """A model larger than the memory it is given, under a limit the kernel enforces: a fresh process warms the
    code paths (a streamed and a packed load and decode of a small checkpoint), reads its own ``VmData`` (the
    private writable memory ``RLIMIT_DATA`` counts: heap, anonymous mappings) and limits itself to that plus half
    the checkpoint's expert bytes. Loading with streamed experts, a forward and a greedy decode run under the limit
    and give the fully loaded packed model's logits and tokens (computed here, without a limit), and the peak
    resident set they add (``VmHWM`` minus ``VmRSS`` before loading) stays at most half the expert bytes; the same
    limit makes a fully loaded packed load fail to allocate the experts' stacks, so it binds. While
    ``from_pretrained`` runs, the limit also admits the shards' sizes: transformers' loader maps every shard
    copy-on-write, which ``RLIMIT_DATA`` counts though no page of it is copied (docs/mxfp4.md)."""
    path, config = wide_release
    ids = IDS[:1, :12]
    experts = 5 * config.num_experts * _release_expert_bytes(config)
    out = tmp_path / "limited.pt"
    args = [sys.executable, "-c", _STATUS + _LIMITED, str(path), str(release), json.dumps(ids.tolist()),
            str(experts // 2), str(out)]  # fmt: skip
    env = {**os.environ, "MALLOC_ARENA_MAX": "1"}  # (one glibc arena: threads do not reserve heaps of their own)
    result = subprocess.run(args, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    print(f"streamed decode under RLIMIT_DATA = VmData before loading ({measured['base'] / 2**20:.1f} MiB) + "
          f"{experts / 2 / 2**20:.1f} MiB (half the checkpoint's {experts / 2**20:.1f} MiB of experts): VmData "
          f"{(measured['data'] - measured['base']) / 2**20:.1f} MiB above it after the decode, peak RSS added "
          f"{measured['peak'] / 2**20:.1f} MiB ({measured['peak'] / experts:.3f}x the experts; staging "
          f"{measured['staging'] / 2**20:.1f} MiB, file-backed {measured['file'] / 2**20:.1f} MiB), "
          f"{measured['per_token'] / 2**20:.2f} MiB of experts read per token")
    assert measured["checkpoint"] == experts
    assert measured["data"] - measured["base"] <= experts // 2
    assert measured["peak"] <= 0.5 * experts, measured
    assert measured["control"] is not None, "a fully loaded packed model fit under the limit: it does not bind"
    assert "experts" in measured["control"], measured["control"]  # (what failed is an allocation of expert stacks)
    got = torch.load(out)
    packed = load(KimiK3ForCausalLM, path)
    with torch.no_grad():
        assert torch.equal(got["logits"], packed(ids).logits)
    greedy = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    assert torch.equal(got["tokens"], packed.generate(ids, **greedy))
