"""Checkpoint files that lie: every reader (the converters, direct `from_pretrained`, `load_small`, the hybrid
cache's `load`) refuses them with a named `CheckpointError` that says what is wrong and what to do, and nothing is
written or left behind. Also: a converter killed mid-write (SIGKILL) leaves a temporary directory that the next run
into the same output removes; SIGTERM removes it at once.

The fixture is a tiny official-layout bf16 checkpoint (several shards with an index), built with the helpers of
`references.py`.
"""

import json
import os
import shutil
import signal
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig
from transformers_k3.conversion import CheckpointError
from transformers_k3.convert import convert_official_checkpoint
from transformers_k3.conversion.streaming import clean_stale_outputs, write_state_dict

from references import (
    _index,
    _script,
    _start_conversion,
    _wait_for_shards,
    assert_converter_refuses,
    listing,
    shard_tensors,
    shard_tensors_file,
    write_tiny_official,
)

Q = "model.layers.1.self_attn.q_proj.weight"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    path = write_tiny_official(tmp_path_factory.mktemp("ckpt") / "official")
    (path / "notes.txt").write_text("release notes\n")
    return path


@pytest.fixture(scope="module")
def official_in_two_shards(official, tmp_path_factory):
    """`official`'s tensors and config in two input shards (the converter's test sleep follows every input shard)."""
    path = tmp_path_factory.mktemp("ckpt") / "official"
    write_state_dict(shard_tensors(official), path, max_shard_size=500_000)
    shutil.copy(official / "config.json", path / "config.json")
    assert len(list(path.glob("*.safetensors"))) == 2
    return path


@pytest.fixture
def ckpt(official, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(official, target)
    return target


def assert_from_pretrained_refuses(path: Path, *fragments):
    before = listing(path)
    for loader in (KimiK3ForCausalLM, AutoModelForCausalLM):
        with pytest.raises(CheckpointError) as error:
            loader.from_pretrained(path)
        for fragment in fragments:
            assert fragment in str(error.value), (fragment, str(error.value))
    assert listing(path) == before


def rewrite_index(path: Path, edit):
    data = json.loads((path / INDEX).read_text())
    edit(data["weight_map"])
    (path / INDEX).write_text(json.dumps(data))


def other_shard(path: Path, name: str) -> Path:
    mine = _index(path)[name]
    return next(path / f for f in sorted(set(_index(path).values())) if f != mine)


def rewrite_header(shard: Path, edit):
    """Rewrites a safetensors header in place (``edit(header_dict)``), keeping the data bytes."""
    raw = shard.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length:])


# --------------------------------------------------------------------------------------------------
# Tensors stored twice, or stored but not indexed
def test_unindexed_duplicate_in_a_later_shard_is_refused(ckpt):
    """The issue's case: a second copy of a tensor (values 354) in another shard, not in the index; transformers
    alone loads that copy."""
    target = other_shard(ckpt, Q)
    tensors = shard_tensors_file(target)
    tensors[Q] = torch.full((64, 64), 354.0, dtype=torch.bfloat16)
    save_file(tensors, str(target))
    stored = _index(ckpt)[Q]
    names = sorted([stored, target.name], key=lambda n: (len(n), n))
    fragments = (Q, f"stored in both {names[0]} and {names[1]}", f"the index lists it under {stored}", "stored once")
    assert_converter_refuses(ckpt, *fragments, script_too="subprocess")
    assert_from_pretrained_refuses(ckpt, *fragments)


def test_tensor_in_a_shard_but_not_in_the_index_is_refused(ckpt):
    target = ckpt / _index(ckpt)[Q]
    extra = "model.layers.1.self_attn.smuggled.weight"
    tensors = shard_tensors_file(target)
    tensors[extra] = torch.zeros(4, dtype=torch.bfloat16)
    save_file(tensors, str(target))
    fragments = (target.name, extra, "not listed in the index", "regenerate the index")
    assert_converter_refuses(ckpt, *fragments)
    assert_from_pretrained_refuses(ckpt, *fragments)


# --------------------------------------------------------------------------------------------------
# Integer / bool tensors where a float weight belongs
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_integer_tensor_for_a_float_weight_is_refused(ckpt, dtype):
    target = ckpt / _index(ckpt)[Q]
    tensors = shard_tensors_file(target)
    tensors[Q] = torch.ones(64, 64, dtype=dtype)
    save_file(tensors, str(target))
    name = str(dtype).replace("torch.", "")
    fragments = (target.name, Q, f"stored as {name}", "cannot be a K3 weight", "re-download")
    assert_converter_refuses(ckpt, *fragments, script_too=True)
    assert_from_pretrained_refuses(ckpt, *fragments)


def test_uint8_is_accepted_only_for_mxfp4_packed_and_scale():
    from transformers_k3.conversion.streaming import non_float_problem

    assert non_float_problem("model.layers.3.mlp.experts.0.w1.weight_packed", torch.uint8) is None
    assert non_float_problem("model.layers.3.mlp.experts.0.w1.weight_scale", torch.uint8) is None
    assert non_float_problem("model.layers.3.mlp.experts.0.w1.weight_scale", torch.float8_e8m0fnu) is None
    assert non_float_problem("model.layers.3.mlp.experts.0.w1.weight_packed", torch.int32) is not None
    assert non_float_problem("model.layers.3.mlp.experts.0.w1.weight", torch.uint8) is not None


# --------------------------------------------------------------------------------------------------
# Files outside the checkpoint directory
@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink"])
def test_index_entry_outside_the_directory_is_refused(ckpt, tmp_path, where):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shard = _index(ckpt)[Q]
    shutil.move(str(ckpt / shard), str(outside / "x.safetensors"))
    if where == "dotdot":
        entry = "../elsewhere/x.safetensors"
        fragments = (entry, "outside the checkpoint directory", "fix the index")
    elif where == "absolute":
        entry = str(outside / "x.safetensors")
        fragments = (entry, "outside the checkpoint directory", "fix the index")
    else:
        entry = shard
        os.symlink(outside / "x.safetensors", ckpt / shard)
        fragments = (shard, "resolves (through a symbolic link)", str(outside / "x.safetensors"), "copy the file")
    if where != "symlink":
        rewrite_index(ckpt, lambda m: m.update({k: entry for k, v in m.items() if v == shard}))
    assert_converter_refuses(ckpt, *fragments, script_too=True)
    assert_from_pretrained_refuses(ckpt, *fragments)


def test_hub_cache_snapshot_links_into_blobs_are_accepted(official, tmp_path):
    """A hub-cache snapshot keeps every file as a symlink into the repository's `blobs/`: that is inside the
    checkpoint, and both the converter and `from_pretrained` read it."""
    repo = tmp_path / "models--moonshotai--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, file in enumerate(sorted(official.iterdir())):
        shutil.copy(file, blobs / f"blob{i}")
        os.symlink(os.path.relpath(blobs / f"blob{i}", snapshot), snapshot / file.name)
    out = tmp_path / "out"
    convert_official_checkpoint(snapshot, out, progress=False)
    assert (out / "notes.txt").read_text() == "release notes\n" and not (out / "notes.txt").is_symlink()
    KimiK3ForCausalLM.from_pretrained(snapshot)


# --------------------------------------------------------------------------------------------------
# Side files: regular files only
def test_symlinked_side_file_is_refused_never_copied(ckpt, tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text("root:SECRET\n")
    (ckpt / "notes.txt").unlink()
    os.symlink(secret, ckpt / "notes.txt")
    message = assert_converter_refuses(ckpt, "notes.txt", "resolves (through a symbolic link)", str(secret),
                                       "copy the file into the directory")
    assert "SECRET" not in message


def test_special_side_file_is_refused(ckpt):
    os.mkfifo(ckpt / "notes.fifo")  # opening it for reading would block forever
    assert_converter_refuses(ckpt, "notes.fifo", "not a regular file", "remove it")


def test_dry_run_checks_side_files_too(ckpt, tmp_path):
    os.symlink(tmp_path, ckpt / "a_link_to_a_directory_outside")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        convert_official_checkpoint(ckpt, None, dry_run=True, progress=False)


# --------------------------------------------------------------------------------------------------
# Malformed files: CheckpointError and exit status 2, never a traceback
def _alias(header):
    names = [n for n in header if n != "__metadata__"]
    first, second = names[0], names[1]
    header[second]["data_offsets"] = list(header[first]["data_offsets"])


@pytest.mark.parametrize("problem", ["aliased_offsets", "gap_offsets", "index_not_json", "index_a_list",
                                     "index_entry_not_a_string", "config_not_json", "config_a_list",
                                     "config_bad_field"])
def test_malformed_inputs_exit_2(ckpt, problem):
    shard = ckpt / _index(ckpt)[Q]
    if problem == "aliased_offsets":
        # two tensors of one shard pointing at the same bytes (sizes kept consistent)
        def edit(header):
            names = [n for n in header if n != "__metadata__"]
            a, b = next((x, y) for x in names for y in names if x != y and
                        header[x]["data_offsets"][1] - header[x]["data_offsets"][0] ==
                        header[y]["data_offsets"][1] - header[y]["data_offsets"][0])
            header[b]["data_offsets"] = list(header[a]["data_offsets"])
        rewrite_header(shard, edit)
        fragments = (shard.name, "aliased data offsets", "re-download")
    elif problem == "gap_offsets":
        def edit(header):
            names = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])
            del header[names[0]]
        rewrite_header(shard, edit)
        rewrite_index(ckpt, lambda m: None)
        fragments = (shard.name, "belong to no tensor")
    elif problem == "index_not_json":
        (ckpt / INDEX).write_text('{"weight_map": {"a": ')
        fragments = (INDEX, "not valid JSON", "re-download")
    elif problem == "index_a_list":
        (ckpt / INDEX).write_text("[1, 2]")
        fragments = (INDEX, "must be a JSON object")
    elif problem == "index_entry_not_a_string":
        rewrite_index(ckpt, lambda m: m.update({Q: 7}))
        fragments = (INDEX, Q, "not a file name")
    elif problem == "config_not_json":
        (ckpt / "config.json").write_text("{'model_type': 'kimi_k3'")
        fragments = ("config.json", "not valid JSON")
    elif problem == "config_a_list":
        (ckpt / "config.json").write_text("[]")
        fragments = ("config.json", "must be a JSON object")
    else:
        config = json.loads((ckpt / "config.json").read_text())
        config["hidden_size"] = "wide"
        (ckpt / "config.json").write_text(json.dumps(config))
        fragments = ("config.json",)
    assert_converter_refuses(ckpt, *fragments, script_too="subprocess" if problem == "config_not_json" else True)
    if problem in ("aliased_offsets", "gap_offsets", "index_not_json", "index_a_list", "index_entry_not_a_string"):
        assert_from_pretrained_refuses(ckpt, *fragments)


def test_kimi_linear_converter_exits_2_on_invalid_config(ckpt, capsys):
    (ckpt / "config.json").write_text('{"hidden_size": "wide", "num_hidden_layers": []}')
    out = ckpt.parent / "out"
    assert _script("convert_kimi_linear_to_k3").main(["--input", str(ckpt), "--output", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "config.json" in err
    assert not out.exists() and not list(ckpt.parent.glob(".out*"))


# --------------------------------------------------------------------------------------------------
# Other readers: the hybrid cache, load_small
def test_cache_load_refuses_corrupt_files(tmp_path):
    from transformers_k3.cache import KimiK3HybridCache

    config = KimiK3TextConfig.tiny()
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="garbage.safetensors"):
        KimiK3HybridCache.load(garbage, config)
    aliased = tmp_path / "aliased.safetensors"
    save_file({"layers.0.conv_state": torch.zeros(4), "layers.0.recurrent_state": torch.ones(4)}, str(aliased),
              metadata={"format": "kimi_k3_hybrid_cache", "config": "{}"})
    rewrite_header(aliased, _alias)
    with pytest.raises(CheckpointError, match="aliased data offsets"):
        KimiK3HybridCache.load(aliased, config)
    no_config = tmp_path / "no_config.safetensors"
    save_file({"x": torch.zeros(1)}, str(no_config), metadata={"format": "kimi_k3_hybrid_cache"})
    with pytest.raises(CheckpointError, match="`config` metadata"):
        KimiK3HybridCache.load(no_config, config)


def test_load_small_refuses_an_integer_weight(tmp_path):
    from transformers_k3.small import SMALL_DIR, load_small
    from safetensors import safe_open

    target = tmp_path / "small"
    shutil.copytree(SMALL_DIR, target)
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    name = next(k for k in tensors if k.endswith("q_proj.weight") or k.endswith("q_a_proj.weight"))
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(target / "model.safetensors"), metadata=metadata)
    with pytest.raises(CheckpointError, match=f"`{name}` is stored as int32"):
        load_small(target)


# --------------------------------------------------------------------------------------------------
# A converter killed mid-write
def test_sigkill_leftovers_are_removed_by_the_next_run(official, tmp_path):
    out = tmp_path / "out"
    process = _start_conversion(official, out, sleep=60)
    try:
        temporary = _wait_for_shards(out, process)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lock = tmp_path / f".out.k3lock-{process.pid}"
    assert temporary.is_dir() and lock.exists() and not out.exists()  # what SIGKILL leaves
    convert_official_checkpoint(official, out, progress=False)  # the next run cleans up, then converts
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    KimiK3ForCausalLM.from_pretrained(out)


def test_a_second_conversion_into_the_same_output_is_refused_at_once(official_in_two_shards, tmp_path):
    """Two converters writing one output: the second stops before converting anything, naming the first, and the
    first finishes normally (without the lock each would convert, and the second would replace the first's result
    even without --overwrite)."""
    out = tmp_path / "out"
    process = _start_conversion(official_in_two_shards, out, sleep=3)
    try:
        _wait_for_shards(out, process)
        for overwrite in (False, True):
            with pytest.raises(CheckpointError, match="another conversion is writing this output right now"):
                convert_official_checkpoint(official_in_two_shards, out, progress=False, overwrite=overwrite)
        assert process.wait(timeout=120) == 0, process.stderr.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    KimiK3ForCausalLM.from_pretrained(out)
    convert_official_checkpoint(official_in_two_shards, out, progress=False, overwrite=True)  # the lock is free again


def test_an_output_that_appears_while_converting_is_not_replaced(tmp_path):
    from transformers_k3.conversion.streaming import atomic_output_dir

    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="appeared while this conversion ran"):
        with atomic_output_dir(out) as temporary:
            (temporary / "model.safetensors").write_bytes(b"new")
            out.mkdir()
            (out / "theirs.txt").write_text("kept")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and os.listdir(out) == ["theirs.txt"]


def test_sigterm_removes_the_temporary_directory_at_once(official, tmp_path):
    out = tmp_path / "out"
    process = _start_conversion(official, out, sleep=60)
    try:
        _wait_for_shards(out, process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) != 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert list(tmp_path.iterdir()) == []


def test_a_running_conversion_is_not_cleaned_and_a_half_swap_is_undone(tmp_path):
    """A temporary directory whose converter still holds its lock is left alone; a previous output that a killed
    `--overwrite` run had moved aside is put back."""
    import fcntl

    out = tmp_path / "out"
    live = tmp_path / ".out.tmp-k3-999999"
    live.mkdir()
    with open(tmp_path / ".out.k3lock-999999", "a+b") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        # flock locks belong to the open file, so a second open in this process contends like another process
        assert clean_stale_outputs(out) == [] and live.is_dir()
    previous = tmp_path / ".out.old-k3-999998"
    previous.mkdir()
    (previous / "config.json").write_text("{}")
    (tmp_path / ".out.tmp-k3-999998").mkdir()
    (tmp_path / ".out.k3lock-999998").touch()
    legacy = tmp_path / ".out.tmp-999997"  # an earlier version's temporary directory, its process gone
    legacy.mkdir()
    cleaned = clean_stale_outputs(out)
    assert set(cleaned) == {live, previous, tmp_path / ".out.tmp-k3-999998", legacy}
    assert (out / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_pre_quantized_checkpoints_keep_their_integer_tensors(tmp_path):
    """A checkpoint saved by a transformers quantizer (bitsandbytes, GPTQ, ...) stores integer tensors by design and
    that quantizer checks them; the duplicate/index/path checks still apply to it."""
    from transformers_k3.conversion.checkpoint_checks import check_pretrained_directory

    save_file({"model.layers.0.mlp.gate_proj.weight": torch.zeros(8, 1, dtype=torch.uint8),
               "model.layers.0.mlp.gate_proj.weight.absmax": torch.zeros(2)},
              str(tmp_path / "model.safetensors"))
    config = {**KimiK3TextConfig.tiny().to_dict(),  # (a config of this size: the release's would be refused by size)
              "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_pretrained_directory(tmp_path, {})
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="stored as uint8"):
        check_pretrained_directory(tmp_path, {})
    # GPTQ packs into int32 (bitsandbytes never does: test_hostile_checkpoints)
    save_file({"model.layers.0.mlp.gate_proj.qweight": torch.zeros(8, 1, dtype=torch.int32),
               "model.layers.0.mlp.gate_proj.qzeros": torch.zeros(2, dtype=torch.int32)},
              str(tmp_path / "model.safetensors"))
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_pretrained_directory(tmp_path, {})
