"""Other engines load what we save (issue 46, "Save as it came"; docs/mxfp4.md "Other engines").

A tiny release with every K3 feature on and MXFP4 routed experts (official layout, references.py) is loaded packed,
written back with ``export_release`` and handed to ``conversion/check_engines.py``, which runs mlx-lm in its own
interpreter: mlx-lm must load the experts as they are (its mxfp4 mode, no re-quantization) and agree with our fp32
logits within 1e-4 of the largest logit, greedy decoding identical over 16 tokens. mlx-lm on a copy with every expert
scale one power of two up, against us on the intact export, must fail the same check: the tolerance tells a layout
error from summation order.

mlx-lm is not a dependency: the test runs where ``K3_MLX_PYTHON`` names an interpreter with mlx and mlx-lm (on Linux
``pip install mlx mlx-cpu mlx-lm``), or where this interpreter imports mlx_lm, and skips otherwise.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from transformers_k3 import (KimiK3Config, KimiK3ForCausalLM, KimiK3ForConditionalGeneration, KimiK3TextConfig,
                             export_release)

from references import FP32, load, release_state, release_vision_state, shard_tensors, write_release

MLX_PYTHON = os.environ.get("K3_MLX_PYTHON") or (sys.executable if importlib.util.find_spec("mlx_lm") else None)
needs_mlx = pytest.mark.skipif(MLX_PYTHON is None, reason="mlx-lm not importable (set K3_MLX_PYTHON)")
SCRIPT = Path(__file__).resolve().parents[1] / "conversion" / "check_engines.py"
RTOL = 1e-4


@pytest.fixture(scope="module", params=["composite", "text"])
def exported(request, tmp_path_factory):
    """(release, export) directories: the release as written, and our packed model's ``export_release`` of it."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "composite":  # the release's own form: kimi_k3 with a kimi_linear text_config
        config = KimiK3Config.tiny()
        state, cls = release_state(config, True, True, 2, release_vision_state(config)), KimiK3ForConditionalGeneration
    else:
        config = KimiK3TextConfig.tiny()
        state, cls = release_state(config, False, True, 1), KimiK3ForCausalLM
    release = write_release(root / "release", state, config, request.param == "composite", True)
    model = load(cls, release, dtype=FP32)
    export_release(model, root / "export", dtype="bf16")
    return release, root / "export"


def check(directory: Path, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    rows = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(directory), "--mlx-python", MLX_PYTHON,
                           "--json", str(rows), *extra], capture_output=True, text=True, timeout=600)
    assert rows.is_file(), done.stderr[-3000:]
    return done.returncode, next(r for r in json.loads(rows.read_text()) if r["engine"] == "mlx-lm")


def test_the_export_is_the_release(exported):
    release, export = exported
    original, ours = shard_tensors(release), shard_tensors(export)
    assert sorted(original) == sorted(ours)
    for name, tensor in original.items():
        assert torch.equal(ours[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


@needs_mlx
def test_mlx_lm_loads_the_export_packed_and_agrees(exported, tmp_path):
    status, row = check(exported[1], tmp_path)
    assert row["loaded"], row
    assert row["packed"], row  # codes as uint32 words, E8M0 scales as uint8, mode mxfp4: nothing re-quantized
    assert row["max_rel"] <= RTOL, row
    assert row["greedy_match"] == row["steps"] == 16, row
    assert status == 0


@needs_mlx
def test_a_scale_one_power_of_two_off_fails_the_check(exported, tmp_path):
    export = exported[1]
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in export.iterdir():
        if path.suffix == ".safetensors":
            state = {n: (t + 1 if n.endswith(".weight_scale") else t) for n, t in load_file(path).items()}
            save_file(state, broken / path.name, metadata={"format": "pt"})
        else:
            (broken / path.name).write_bytes(path.read_bytes())
    status, row = check(broken, tmp_path, "--reference", str(export))  # ours on the intact export
    assert row["loaded"] and row["max_rel"] > RTOL and status == 1, row
