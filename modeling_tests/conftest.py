"""Shared fixtures. fla's reference implementations are loaded by file path so that fla's package
`__init__` (which imports Triton) never runs on these CPU machines."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import transformers_k3  # noqa: F401  (registers the Auto classes)

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: starts several processes (torchrun); deselect with -m 'not distributed'")
    config.addinivalue_line("markers", "slow: takes more than ~20 s on 2 CPU cores; deselect with -m 'not slow'")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests: their ops are microseconds long, and with 2 threads on
    shared, loaded cores they spend most of their time waiting for each other (a decode step measured 16x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load_fla_reference(relative_path: str):
    """Import `fla/<relative_path>` as a standalone module; skip the test if fla is not installed."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-linear-attention is not installed (pip install -e '.[dev]')")
    path = os.path.join(list(spec.submodule_search_locations)[0], relative_path)
    module_spec = importlib.util.spec_from_file_location("fla_ref_" + relative_path.replace("/", "_")[:-3], path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture
def tiny_config():
    return transformers_k3.KimiK3TextConfig.tiny()


def load(cls, path, **kwargs):
    """``cls.from_pretrained(path)`` in eval mode, asserting that nothing was missing, unexpected or mismatched."""
    model, info = cls.from_pretrained(path, output_loading_info=True, **kwargs)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, problems
    return model.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def randomize_(model: torch.nn.Module, std: float = 0.08, seed: int = 0) -> torch.nn.Module:
    """Give every weight a random value (the paper's init zeroes the AttnRes pseudo-queries and the router
    bias, which would hide bugs in the score path)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if "norm" in name and param.dim() == 1:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(std * torch.randn(param.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))
    return model


@pytest.fixture
def tiny_model(tiny_config):
    torch.manual_seed(0)
    model = transformers_k3.KimiK3ForCausalLM(tiny_config).eval()
    return randomize_(model)


def run_torchrun(worker: str, *args: str, processes: int = 2, timeout: int = 600, env: dict | None = None) -> dict:
    """``modeling_tests/<worker>`` under torchrun on ``processes`` CPU processes (one thread each, this directory on
    the path): the ``RESULT {json}`` its rank 0 prints."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
           **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
                           "--standalone", os.path.join(here, worker), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


def adamw_losses(model: torch.nn.Module, steps: int = 3) -> list[float]:
    """The losses of ``steps`` AdamW steps (lr 1e-2) on the whole fixed batch the distributed workers split between
    their ranks: the single-process reference of their global-batch losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(3, 512, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
