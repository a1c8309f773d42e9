"""Adversarial review of issue 26 ("Exact round trip with the release"): one test per defect found (each docstring
says how it failed; all fixed), then tests for attacked behaviour that held up. Tiny configs only."""

import gc
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import transformers_k3  # noqa: F401  (registers the classes and mappings)
from transformers import AutoModelForCausalLM
from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig
from transformers_k3.conversion import CheckpointError
from transformers_k3.convert import convert_official_checkpoint, export_to_official
from transformers_k3.conversion.quant import quantize_mxfp4_release
from transformers_k3.conversion.quant import dequantize_mxfp4
from transformers_k3.safetensors_header import read_safetensors_header

from references import check_against_rules, randomize_, release_state, shard_tensors, write_release

REPO = Path(__file__).resolve().parents[1]
IDS = torch.randint(3, 400, (1, 9), generator=torch.Generator().manual_seed(0))


def logits(model):
    with torch.no_grad():
        return model.eval()(IDS).logits


def same_weights(a, b) -> bool:
    sb = b.state_dict()
    return all(torch.equal(t, sb[n]) for n, t in a.state_dict().items())


@pytest.fixture(scope="module")
def tiny():
    return randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval(), seed=1)


def raw_safetensors(path: Path, header: str, data: bytes) -> Path:
    encoded = header.encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


# ==================================================================================================
# Defects
def test_save_pretrained_of_a_bnb_quantized_model_keeps_its_quantization_config(tmp_path):
    """A release-flavoured config.json (official_config_dict) pops quantization_config: a QLoRA-style bitsandbytes model saved with save_pretrained can no longer be loaded (its int8 weights are then
    refused as 'not a K3 weight'). transformers' own config.json reloads this directory identically."""
    from transformers import BitsAndBytesConfig

    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval(), seed=5).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "a")
    quantized = KimiK3ForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.bfloat16,
                                                  quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    quantized.save_pretrained(tmp_path / "q")
    assert "quantization_config" in json.loads((tmp_path / "q" / "config.json").read_text())
    again = KimiK3ForCausalLM.from_pretrained(tmp_path / "q")
    assert torch.equal(logits(again), logits(quantized))


def test_trainer_resume_of_a_sharded_checkpoint_restores_the_experts(tiny, tmp_path):
    """Trainer._load_from_checkpoint restores a sharded checkpoint with load_sharded_checkpoint: one
    load_state_dict(strict=False) per shard. _fuse_per_expert_weights only fuses when every w1/w2/w3 of a layer is in
    the same call, so the routed experts of every layer silently keep their pre-resume values (a warning at most).
    At the release's size one layer's experts alone exceed a shard, so every K3 checkpoint is affected."""
    from transformers.trainer_utils import load_sharded_checkpoint

    tiny.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    weight_map = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())["weight_map"]
    for layer in range(tiny.config.first_k_dense_replace, tiny.config.num_hidden_layers):  # experts across shards
        assert len({f for n, f in weight_map.items() if f"layers.{layer}." in n and ".experts." in n}) > 1, layer
    fresh = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval(), seed=2)
    gc.freeze()  # (it runs gc.collect after every shard: frozen, the test session's objects are not walked each time)
    try:
        load_sharded_checkpoint(fresh, tmp_path / "ckpt", strict=False)
    finally:
        gc.unfreeze()
    reference = tiny.state_dict()
    stale = [n for n, t in fresh.state_dict().items() if not torch.equal(t, reference[n])]
    assert not stale, stale


def test_from_pretrained_by_hub_id_checks_the_files_too(tiny, tmp_path):
    """check_pretrained_directory does nothing for a hub id, so the issue's own case (an unindexed duplicate in a
    later shard, max |w| 354) loads through a repo id, which is where a stranger's checkpoint comes from. Here the
    repo is resolved from a local hub cache (local_files_only), exactly as after a download."""
    src = tmp_path / "src"
    tiny.save_pretrained(src, max_shard_size="20KB")
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.self_attn.q_proj.weight"
    last = sorted(set(weight_map.values()))[-1]
    assert weight_map[name] != last
    tensors = {}
    with safe_open(str(src / last), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = torch.full_like(tiny.state_dict()[name], 354.0)
    save_file(tensors, str(src / last), metadata={"format": "pt"})
    with pytest.raises(CheckpointError):  # the local directory is refused ...
        KimiK3ForCausalLM.from_pretrained(src)
    repo = tmp_path / "cache" / "models--stranger--k3"
    snapshot, blobs = repo / "snapshots" / ("a" * 40), repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for f in src.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blobs / digest)
        os.symlink(f"../../blobs/{digest}", snapshot / f.name)
    with pytest.raises(CheckpointError):  # ... and so must the same files reached by repo id
        KimiK3ForCausalLM.from_pretrained("stranger/k3", cache_dir=str(tmp_path / "cache"), local_files_only=True)


def test_save_pretrained_after_loading_our_converted_layout_is_consistent_and_exports_the_release(tmp_path):
    """The README's workflow: convert the release, load it, fine-tune, save. Once, save_pretrained kept our fused
    weights (mlp.experts.gate_up_proj, mlp.gate) under a config.json rewritten as the release's (kimi_linear): a
    directory that claims to be the release but that no engine keyed on block_sparse_moe can read. save_pretrained
    now writes our config with its weights (and loads back); export_release writes the release's layout."""
    from transformers_k3 import export_release

    config = KimiK3TextConfig.tiny()
    release = write_release(tmp_path / "release", release_state(config, False, False, 0), config, False, False)
    convert_official_checkpoint(release, tmp_path / "ours", progress=False)
    model = KimiK3ForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == "kimi_k3_text"
    assert torch.equal(logits(KimiK3ForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16)),
                       logits(model))
    export_release(model, tmp_path / "exported")
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["model_type"] == "kimi_linear"
    check_against_rules(shard_tensors(tmp_path / "exported"), config, False, False)


def test_push_to_hub_uploads_the_saved_config(tiny, tmp_path):
    """save_pretrained(push_to_hub=True) uploads what the (staged) save wrote: the hub repo gets the same config.json
    (ours, kimi_k3_text) and weights as the local directory, under the repo id asked for. The Hub's side (no network
    in tests) answers huggingface_hub's HTTP requests through its public client factory: create the repo, no model
    card yet, every file a regular blob, and the commit, whose files are kept."""
    import base64

    import huggingface_hub
    import huggingface_hub.utils._http as hub_http  # (no public getter for the factory to put back)

    httpx = sys.modules[type(huggingface_hub.get_session()).__module__.split(".")[0]]  # httpx2, or httpx before
    commits = {}

    def hub(request):
        path = request.url.path
        if path == "/api/repos/create":
            body = json.loads(request.content)
            return httpx.Response(200, json={"url": f"https://huggingface.co/{body['organization']}/{body['name']}"})
        if path == "/api/validate-yaml":
            return httpx.Response(200, json={})
        if path.startswith("/api/models/") and "/preupload/" in path:
            files = json.loads(request.content)["files"]
            return httpx.Response(200, json={"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                       for f in files]})  # fmt: skip
        if path.startswith("/api/models/") and "/commit/" in path:
            repo_id = path.removeprefix("/api/models/").split("/commit/")[0]
            for line in request.content.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    commits.setdefault(repo_id, {})[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            return httpx.Response(200, json={"commitUrl": f"https://huggingface.co/{repo_id}/commit/{'a' * 40}",
                                             "commitOid": "a" * 40, "pullRequestUrl": None})  # fmt: skip
        return httpx.Response(404, headers={"X-Error-Code": "EntryNotFound"}, json={"error": "not on this hub"})

    huggingface_hub.set_client_factory(lambda: httpx.Client(transport=httpx.MockTransport(hub), follow_redirects=True))
    try:
        tiny.save_pretrained(tmp_path / "hub", push_to_hub=True, repo_id="me/k3")
    finally:
        huggingface_hub.set_client_factory(hub_http.default_client_factory)
    on_disk = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert on_disk["model_type"] == "kimi_k3_text"
    uploaded = commits["me/k3"]
    assert uploaded["config.json"] == (tmp_path / "hub" / "config.json").read_bytes()
    assert uploaded["model.safetensors"] == (tmp_path / "hub" / "model.safetensors").read_bytes()


def test_an_unknown_quant_method_does_not_switch_the_dtype_check_off(tiny, tmp_path):
    """check_pretrained_directory skips the integer-dtype check for any quant_method but compressed-tensors.
    transformers ignores an unknown quant_method (a warning) and a bitsandbytes config with neither 4 nor 8 bit,
    so a config.json line is enough to have an int32 tensor cast silently into a float weight again."""
    tiny.save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.norm.weight"] = torch.full(tensors["model.norm.weight"].shape, 7, dtype=torch.int32)
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "not_a_method"}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="int32"):
        KimiK3ForCausalLM.from_pretrained(tmp_path / "ckpt")


def test_a_stale_single_file_next_to_a_new_sharded_save_is_not_loaded_silently(tiny, tmp_path):
    """save_pretrained into a directory holding an earlier single-file save leaves model.safetensors (transformers
    only deletes stale *shards*). from_pretrained prefers it and returns the OLD weights without a word, while the
    converters (index first) read the new ones: the two readers disagree on the same directory."""
    other = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval(), seed=2)
    other.save_pretrained(tmp_path / "ckpt")
    tiny.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    try:
        loaded = KimiK3ForCausalLM.from_pretrained(tmp_path / "ckpt")
    except CheckpointError:
        return  # refusing the ambiguous directory is fine too
    assert same_weights(loaded, tiny), "from_pretrained loaded the stale model.safetensors"


def test_export_reads_a_single_file_save_over_an_earlier_sharded_one(tiny, tmp_path):
    """The reverse: a single-file save over a sharded one leaves the old index (transformers removes the old shards,
    not the index). from_pretrained reads model.safetensors; Checkpoint (export, converter) prefers the index and
    refuses our own save ('shard file is missing')."""
    other = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval(), seed=2)
    other.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    tiny.save_pretrained(tmp_path / "ckpt")
    assert same_weights(KimiK3ForCausalLM.from_pretrained(tmp_path / "ckpt"), tiny)
    export_to_official(tmp_path / "ckpt", tmp_path / "export", progress=False)
    exported = shard_tensors(tmp_path / "export")
    assert torch.equal(exported["model.norm.weight"], tiny.model.norm.weight.to(torch.bfloat16))


@pytest.mark.parametrize("header", [
    '{"a":{"dtype":"F32","shape":[4],"data_offsets":["0","16"]}}',   # raw TypeError
    '{"a":{"dtype":"F32","shape":[4],"data_offsets":[NaN,16]}}',     # raw ValueError
    '{"a":{"dtype":"F32","shape":[-2,-2],"data_offsets":[0,16]}}',   # accepted; safetensors refuses
    '{"a":{"dtype":"F32","shape":[true,4],"data_offsets":[0,16]}}',  # accepted; safetensors refuses
    '{"a":{"dtype":"F32","shape":"4","data_offsets":[0,16]}}',       # accepted; safetensors refuses
    '{"a":{"dtype":"F32","shape":[4],"data_offsets":[0.0,16.0]}}',   # accepted; safetensors refuses
    '{"__metadata__":{"format":5},"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}',
], ids=["str_offsets", "nan_offset", "negative_dims", "bool_dim", "string_shape", "float_offsets", "int_metadata"])
def test_headers_safetensors_refuses_are_checkpoint_errors(header, tmp_path):
    """read_safetensors_header (the pre-check of every reader) accepts headers that safetensors itself refuses, so
    from_pretrained reports a raw SafetensorError instead of a CheckpointError, and two of them crash the pre-check
    (the converter CLI then exits 1 with a traceback)."""
    path = raw_safetensors(tmp_path / "x.safetensors", header, bytes(16))
    with pytest.raises(Exception):
        with safe_open(str(path), "pt"):
            pass  # safetensors refuses every one of them
    with pytest.raises(CheckpointError):
        read_safetensors_header(path)


def test_export_of_a_malformed_config_exits_2(tiny, tmp_path):
    """plan_export calls load_k3_config directly instead of official.load_config_of: a config value of the wrong
    type gives a raw TypeError traceback and exit 1 from export_to_official.py (convert_k3_official_to_hf.py exits 2
    with CheckpointError on the same file)."""
    tiny.save_pretrained(tmp_path / "ckpt", save_original_format=False)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["num_hidden_layers"] = "6"
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, str(REPO / "conversion" / "export_to_official.py"), "--input",
                             str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"), "--quiet", "--dry-run"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-400:]


# ==================================================================================================
# Attacked, held up
def test_duplicate_keys_in_a_header_are_read_as_safetensors_reads_them(tmp_path):
    """json.loads keeps the last of two equal keys; so does safetensors: the pre-check sees the tensor the
    loader loads (an int32 first entry cannot hide behind a float one, nor the reverse)."""
    for first, last in (("I32", "F32"), ("F32", "I32")):
        header = (f'{{"a":{{"dtype":"{first}","shape":[4],"data_offsets":[0,16]}},'
                  f'"a":{{"dtype":"{last}","shape":[4],"data_offsets":[0,16]}}}}')
        path = raw_safetensors(tmp_path / f"{first}.safetensors", header, bytes(16))
        with safe_open(str(path), "pt") as f:
            loaded = f.get_tensor("a").dtype
        assert read_safetensors_header(path)["a"].dtype == loaded


def test_hub_cache_snapshot_whose_blobs_folder_is_a_link_elsewhere_is_refused(tiny, tmp_path):
    """allowed_roots admits <repo>/blobs for a snapshot; a blobs folder that is itself a symlink to another place
    does not widen that (the file's real path must lie under the literal blobs folder)."""
    outside = tmp_path / "outside"
    tiny.save_pretrained(outside)
    repo = tmp_path / "models--x--y"
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    os.symlink(outside, repo / "blobs")
    for f in outside.iterdir():
        os.symlink(f"../../blobs/{f.name}", snapshot / f.name)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        KimiK3ForCausalLM.from_pretrained(snapshot)


def test_mxfp4_requantisation_keeps_negative_zero_and_zero_groups():
    codes = torch.tensor([[8] * 32, [6] + [8] * 31, [0] * 32], dtype=torch.uint8)  # -0s, max 4.0 with -0s, +0s
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    scale = torch.tensor([[0], [120], [0]], dtype=torch.uint8)
    again = quantize_mxfp4_release(dequantize_mxfp4(packed, scale, torch.bfloat16))
    assert torch.equal(again[0], packed) and torch.equal(again[1], scale)


def test_export_mxfp4_of_non_finite_weights_exits_2_and_leaves_nothing(tmp_path):
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval(), seed=3)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.gate_up_proj[3, 0, 5] = float("nan")
    model.save_pretrained(tmp_path / "nan", save_original_format=False)
    result = subprocess.run([sys.executable, str(REPO / "conversion" / "export_to_official.py"), "--input",
                             str(tmp_path / "nan"), "--output", str(tmp_path / "out"), "--quiet", "--mxfp4"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "non-finite" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan"]


def test_save_of_a_disk_offloaded_model_equals_the_save_of_the_loaded_one(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "a")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.layers.3": "cpu", "model.layers.4": "cpu", "model.layers.5": "disk",
                  "model.norm": "cpu", "model.output_attn_res": "cpu", "lm_head": "cpu"}
    offloaded = KimiK3ForCausalLM.from_pretrained(tmp_path / "a", device_map=device_map,
                                                  offload_folder=str(tmp_path / "offload"))
    offloaded.save_pretrained(tmp_path / "b")
    a, b = shard_tensors(tmp_path / "a"), shard_tensors(tmp_path / "b")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_tied_embeddings_save_load_and_export(tmp_path):
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny(tie_word_embeddings=True)).eval())
    model.tie_weights()
    model.save_pretrained(tmp_path / "tied")
    assert not any("lm_head" in k for k in shard_tensors(tmp_path / "tied"))
    assert torch.equal(logits(KimiK3ForCausalLM.from_pretrained(tmp_path / "tied")), logits(model))
    export_to_official(tmp_path / "tied", tmp_path / "export", progress=False)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["tie_word_embeddings"] is True


def test_bf16_save_keeps_the_release_fp32_tensors_and_reloads_in_fp32_exactly(tmp_path):
    # a bf16 model as loaded (a later .to(bf16) casts the fp32 tensors too, as transformers does)
    randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval(), seed=4).save_pretrained(tmp_path / "fp32")
    model = KimiK3ForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    tensors = shard_tensors(tmp_path / "bf16")
    check_against_rules(tensors, model.config, False, False)
    again = KimiK3ForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    for name in ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight"):
        assert torch.equal(again.get_parameter(f"model.layers.0.self_attn.{name}"),
                           model.get_parameter(f"model.layers.0.self_attn.{name}").float())


def test_save_of_a_model_with_the_k3_features_off_loads_back_with_auto(tmp_path):
    """Found broken at be4fc80 (saved as kimi_linear with no K3-only key, AutoConfig routed it to the in-tree Kimi
    Linear, which refused the padded A_log); fixed meanwhile by d7781f4 (architectures routes it). Kept as a guard."""
    config = KimiK3TextConfig.tiny(
        hidden_act="silu", activation_situ_beta=None, activation_situ_linear_beta=None, mla_use_output_gate=False,
        routed_expert_hidden_size=None, latent_moe_use_norm=False, attn_res_block_size=None,
        linear_attn_config={"use_full_rank_gate": False, "gate_lower_bound": None})
    model = randomize_(KimiK3ForCausalLM(config).eval())
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert isinstance(again, KimiK3ForCausalLM)
    assert torch.equal(logits(again), logits(model))
