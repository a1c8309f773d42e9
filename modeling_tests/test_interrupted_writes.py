"""Interrupted and failed writes leave nothing half-written: SIGHUP during a conversion removes its temporary output
and lock like SIGTERM; a full disk (here a file-size limit, RLIMIT_FSIZE, with SIGXFSZ ignored so that the write
fails with EFBIG instead of killing the process) gives the conversion and export scripts exit status 2 and one
`error:` line, and leaves `save_pretrained`'s previous save as it was."""

import hashlib
import json
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig
from transformers_k3.convert import convert_official_checkpoint

from references import SCRIPTS, _start_conversion, _wait_for_shards, write_tiny_official

LIMIT = 24 * 1024  # bytes per file: above the configs, below every weight shard of the tiny checkpoints


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    path = write_tiny_official(tmp_path_factory.mktemp("ckpt") / "official")
    return path


def listing(directory: Path) -> dict:
    """Every entry under ``directory`` (hidden ones too) with its content's digest."""
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(directory.rglob("*"))}


def small_disk():
    """In the child: files cannot grow past LIMIT, and a write past it fails (EFBIG) instead of raising SIGXFSZ."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def test_sighup_removes_the_temporary_output_and_its_lock(official, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    process = _start_conversion(official, work / "out", sleep=60)
    try:
        temporary = _wait_for_shards(work / "out", process)
        assert temporary.is_dir()
        process.send_signal(signal.SIGHUP)  # the terminal or ssh session closed
        assert process.wait(timeout=30) != 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert list(work.iterdir()) == []  # no temporary directory, no lock files


def run_script(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *map(str, args), "--quiet"],
                          capture_output=True, text=True, timeout=300, preexec_fn=small_disk)  # fmt: skip


def assert_one_error_line(result: subprocess.CompletedProcess, *fragments):
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_a_full_disk_in_the_scripts_is_status_2_one_line_and_nothing_written(official, tmp_path):
    ours = tmp_path / "ours"
    convert_official_checkpoint(official, ours, progress=False)
    work = tmp_path / "work"
    work.mkdir()
    before = listing(ours)
    for name, source in (("convert_k3_official_to_hf", official), ("export_to_official", ours)):
        result = run_script(name, "--input", source, "--output", work / "out", "--max-shard-size", "40KB")
        assert_one_error_line(result, str(work / "out"), "File too large", "nothing was written")
        assert list(work.iterdir()) == [], name  # no output, no temporary directory, no lock
    assert listing(ours) == before


SAVE = textwrap.dedent("""
    import json, resource, signal, sys, torch
    from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig
    torch.manual_seed(1)
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny())  # other weights than the saved model's
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    for target, kwargs in json.loads(sys.argv[1]):
        try:
            model.save_pretrained(target, **kwargs)
            print("saved", target, kwargs)
        except Exception as error:  # (safetensors raises its own SafetensorError for the I/O error)
            print("refused:", error)
""").format(limit=LIMIT)


def test_a_save_on_a_full_disk_leaves_the_previous_save_intact(tmp_path):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval()
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    (saved / "tokenizer.json").write_text("{}")  # a file the save does not write stays
    before = listing(saved)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        want = model(ids).logits
    fresh = tmp_path / "fresh"
    attempts = [(str(target), kwargs) for kwargs in ({}, {"max_shard_size": "30KB"}, {"save_original_format": False})
                for target in (saved, fresh)]  # release layout, sharded, our layout; over a save and into nothing
    result = subprocess.run([sys.executable, "-c", SAVE, json.dumps(attempts)], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = [line for line in result.stdout.splitlines() if line.startswith(("saved", "refused:"))]
    assert len(outcomes) == len(attempts) and all("File too large" in line for line in outcomes), result.stdout
    assert listing(saved) == before  # nothing half-written, nothing left behind
    assert not fresh.exists()
    with torch.no_grad():
        assert torch.equal(KimiK3ForCausalLM.from_pretrained(saved).eval()(ids).logits, want)


def test_what_a_killed_save_left_is_removed_by_the_next_save(tmp_path):
    """SIGKILL runs no cleanup: the hidden staging directory stays until the next save into that directory."""
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval()
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid whose process has ended
    left = saved / f".k3-save-{gone.pid}.x1y2"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"half")
    before = set(listing(saved)) - {left.name, f"{left.name}/model.safetensors"}
    model.save_pretrained(saved)
    assert set(listing(saved)) == before
