"""Shared pytest fixtures and markers. Helpers that tests import by name live in references.py."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import transformers_k3  # noqa: F401  (registers the Auto classes)
from transformers_k3 import KimiK3ImageProcessor, KimiK3Processor, KimiK3VideoProcessor, build_test_tokenizer
from transformers_k3.ops import cpu_kernel

from references import _load_fla_naive, randomize_

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


@pytest.fixture
def tiny_config():
    return transformers_k3.KimiK3TextConfig.tiny()


@pytest.fixture
def tiny_model(tiny_config):
    torch.manual_seed(0)
    model = transformers_k3.KimiK3ForCausalLM(tiny_config).eval()
    return randomize_(model)


@pytest.fixture(scope="module")
def model():
    """A randomized tiny model in eval mode, one per test module, with ``logit_scale`` 0.5 (so that a path which drops
    the scale shows). A module that defines its own ``model`` fixture uses that one instead."""
    torch.manual_seed(0)
    config = transformers_k3.KimiK3TextConfig.tiny()
    config.logit_scale = 0.5
    return randomize_(transformers_k3.KimiK3ForCausalLM(config)).eval()


@pytest.fixture(scope="module")
def tokenizer():
    """The test tokenizer (`build_test_tokenizer`), one per test module."""
    return build_test_tokenizer()


@pytest.fixture(scope="module")
def processor(tokenizer):
    """A processor with the default image and video processors over the module's `tokenizer`."""
    return KimiK3Processor(KimiK3ImageProcessor(), KimiK3VideoProcessor(), tokenizer)


@pytest.fixture(scope="module")
def fla_naive():
    """fla's naive recurrent KDA (fla/ops/kda/naive.py); skips where fla or einops is missing."""
    module, reason = _load_fla_naive()
    if module is None:
        pytest.skip(reason)
    return module.naive_recurrent_kda


_KERNEL_LOAD = ("import json; from transformers_k3.ops import cpu_kernel as c; "
                "print(json.dumps({'loaded': c.library() is not None, 'error': c.load_error()}))")


@pytest.fixture(scope="session")
def built_kernels(tmp_path_factory):
    """The real CPU kernels built once for the session by a fresh process, into an empty cache of its own (a build
    takes tens of seconds; test_cpu_kernels and test_kernel_cache both need one). ``cache``; ``loaded`` and ``error``
    (the loader's, or the process's stderr if it failed); ``stderr``, what the build printed; ``files`` and
    ``mtime_ns``, the cache's listing and its library's mtime right after the build. Tests copy the library out of
    this cache and never change it."""
    cache = tmp_path_factory.mktemp("kernels") / "cache"
    result = subprocess.run([sys.executable, "-c", _KERNEL_LOAD], capture_output=True, text=True, timeout=900,
                            env={**os.environ, cpu_kernel.CACHE_ENV_VAR: str(cache)})  # fmt: skip
    lines = result.stdout.strip().splitlines()
    outcome = json.loads(lines[-1]) if result.returncode == 0 and lines else {"loaded": False,
                                                                                "error": result.stderr[-3000:]}
    files = sorted(os.listdir(cache)) if cache.is_dir() else []
    libraries = [cache / name for name in files if name.endswith(".so")]
    return SimpleNamespace(cache=cache, loaded=outcome["loaded"], error=outcome["error"], stderr=result.stderr,
                           files=files, mtime_ns=libraries[0].stat().st_mtime_ns if len(libraries) == 1 else None)
