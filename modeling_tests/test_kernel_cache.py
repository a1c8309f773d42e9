"""The CPU kernels' build cache: a library that was truncated, zeroed or replaced is detected before it is loaded
(loading a truncated shared object can kill the process with SIGBUS) and rebuilt, so a fresh process neither crashes
nor silently runs without the kernels. The first build announces itself in one line."""

import os
import shutil
import subprocess
import sys

import pytest

LOAD = ("from transformers_k3.ops import cpu_kernel as c; lib = c.library(); "
        "print('LOADED' if lib is not None else 'MISSING', c.load_error())")


def fresh_process(cache):
    env = dict(os.environ, TRANSFORMERS_K3_CACHE=str(cache), TRANSFORMERS_K3_CPU_KERNEL="1")
    return subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None,
                    reason="no C++ compiler: the kernels are never built here")
def test_a_corrupt_cached_library_is_rebuilt_not_loaded(tmp_path):
    first = fresh_process(tmp_path)
    assert "LOADED" in first.stdout, first.stderr[-3000:]
    assert "building the fused CPU kernels" in first.stderr  # one line before the build starts
    [library] = [p for p in tmp_path.glob("cpu_kernels_*.so")]
    assert (tmp_path / (library.name + ".sha256")).is_file()
    good = library.read_bytes()
    for corrupt in (good[: len(good) // 3], b"", b"not an ELF file at all"):  # truncated, zero-byte, foreign
        library.write_bytes(corrupt)
        again = fresh_process(tmp_path)
        assert again.returncode == 0 and "LOADED" in again.stdout, again.stderr[-3000:]
        assert "does not match its checksum; rebuilding it" in again.stderr
        assert library.read_bytes() != corrupt
    quiet = fresh_process(tmp_path)  # a verified library loads without a word
    assert "LOADED" in quiet.stdout and "building" not in quiet.stderr and "rebuilding" not in quiet.stderr
