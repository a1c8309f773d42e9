"""Shared pytest fixtures and markers. Helpers that tests import by name live in references.py."""

import os

import pytest
import torch

import transformers_k3  # noqa: F401  (registers the Auto classes)
from transformers_k3 import KimiK3ImageProcessor, KimiK3Processor, KimiK3VideoProcessor, build_test_tokenizer

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
