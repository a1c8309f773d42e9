"""The CPU kernels' build cache: a library that was truncated, zeroed or replaced is detected before it is loaded
(loading a truncated shared object can kill the process with SIGBUS) and rebuilt, so a fresh process neither crashes
nor silently runs without the kernels. The first build announces itself in one line. A cache directory that someone
else can write is never loaded from (a planted library's constructor would run in this process); a killed build
leaves no compiler running, and what it left in the cache is removed by the next run.

The real kernels are built once for the session (`built`); tests copy that library where they need a built one."""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transformers_k3.ops import cpu_kernel

LOAD = ("from transformers_k3.ops import cpu_kernel as c; lib = c.library(); "
        "print('LOADED' if lib is not None else 'MISSING', c.load_error())")
COMPILER = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler: the kernels are never built here")


def fresh_process(cache, **env):
    env = dict(os.environ, TRANSFORMERS_K3_CACHE=str(cache), **env)
    return subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def built(built_kernels):
    """A cache holding the real kernels, built once (conftest's `built_kernels`); and what that first build printed."""
    assert built_kernels.loaded, built_kernels.error
    return built_kernels.cache, built_kernels.stderr


def copy_library(built_cache: Path, target: Path) -> Path:
    target.mkdir(mode=0o700, parents=True, exist_ok=True)
    [library] = built_cache.glob("cpu_kernels_*.so")
    for path in (library, library.with_name(library.name + ".sha256")):
        shutil.copy2(path, target / path.name)
    return target / library.name


def test_a_corrupt_cached_library_is_rebuilt_not_loaded(built, tmp_path):
    built_cache, first_stderr = built
    assert "building the fused CPU kernels" in first_stderr  # one line before the build starts
    library = copy_library(built_cache, tmp_path / "cache")
    assert (library.parent / (library.name + ".sha256")).is_file()
    good = library.read_bytes()
    assert cpu_kernel._verified(library)
    # (every corruption takes the same rebuild below: the checksum refuses each, one is rebuilt end to end)
    for corrupt in (b"", b"not an ELF file at all", good[:-1] + bytes([good[-1] ^ 1])):  # zero-byte, foreign, a bit
        library.write_bytes(corrupt)
        assert not cpu_kernel._verified(library)
    library.write_bytes(good[: len(good) // 3])  # truncated
    again = fresh_process(library.parent)
    assert again.returncode == 0 and "LOADED" in again.stdout, again.stderr[-3000:]
    assert "does not match its checksum" in again.stderr and "rebuilding it" in again.stderr
    assert cpu_kernel._verified(library)
    quiet = fresh_process(library.parent)  # a verified library loads without a word
    assert "LOADED" in quiet.stdout and "building" not in quiet.stderr and "rebuilding" not in quiet.stderr


PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("the planted library ran\n", f); fclose(f); }
}
"""


@pytest.mark.parametrize("layout", ["world-writable", "group-writable", "sticky world-writable",
                                    "inside a world-writable directory"])
def test_a_library_planted_in_a_shared_cache_is_never_loaded(built, tmp_path, layout):
    """A library with a matching checksum, planted under the expected name in a cache directory that others can
    write: its constructor never runs, the refusal is one line, and the kernels load from the private directory."""
    built_cache, _ = built
    [real] = built_cache.glob("cpu_kernels_*.so")
    marker = tmp_path / "constructor-ran"
    if layout == "inside a world-writable directory":
        (tmp_path / "open").mkdir()
        (tmp_path / "open").chmod(0o777)
        shared = tmp_path / "open" / "cache"
        shared.mkdir(mode=0o700)
    else:
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod({"world-writable": 0o777, "group-writable": 0o775, "sticky world-writable": 0o1777}[layout])
    source = tmp_path / "planted.c"
    source.write_text(PLANTED)
    planted = shared / real.name
    subprocess.run([COMPILER, "-x", "c", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(planted), str(source)],
                   check=True, capture_output=True)  # fmt: skip
    planted.chmod(0o755)
    data = planted.read_bytes()
    (shared / (real.name + ".sha256")).write_text(f"{len(data)} {hashlib.sha256(data).hexdigest()}\n")
    private_tmp = tmp_path / "tmp"  # the private fallback is <TMPDIR>/transformers_k3-<uid>: already built there
    private_tmp.mkdir(mode=0o700)
    copy_library(built_cache, private_tmp / f"transformers_k3-{os.getuid()}")

    result = fresh_process(shared, TMPDIR=str(private_tmp))
    assert not marker.exists(), "the planted library's constructor ran"
    assert result.returncode == 0 and "LOADED" in result.stdout, result.stderr[-3000:]
    [refusal] = [line for line in result.stderr.splitlines() if "not using the kernel cache" in line]
    assert str(shared) in refusal and "writable by" in refusal and f"transformers_k3-{os.getuid()}" in refusal
    assert "building" not in result.stderr.replace(refusal, "")  # loaded from the private directory, not rebuilt
    assert planted.read_bytes() == data  # refused without touching another user's files


def build_processes(cache: Path) -> list[int]:
    """Processes working in ``cache`` (ninja and the compilers run there; the build script names it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if "zombie" not in state and (cwd.startswith(str(cache)) or str(cache) in cmdline):
            found.append(int(entry.name))
    return found


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="needs /proc to find the build's processes")
def test_a_killed_build_leaves_no_compiler_and_the_next_run_removes_its_directory(built, tmp_path):
    built_cache, _ = built
    cache = tmp_path / "cache"
    env = dict(os.environ, TRANSFORMERS_K3_CACHE=str(cache))
    process = subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not any(comm(pid) not in ("ninja", "python", "") for pid in build_processes(cache)):
            assert process.poll() is None and time.monotonic() < deadline, "the build never started compiling"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)  # mid-build: the compilers are running
        process.wait()
        deadline = time.monotonic() + 60
        while build_processes(cache) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: comm(pid) for pid in build_processes(cache)}
        assert not left, f"the killed build left these running: {left}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in build_processes(cache):  # (before the fix: do not leave them running past the test)
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    leftovers = [p.name for p in cache.iterdir() if p.name.startswith(".cpu_kernels_")]
    assert leftovers  # what SIGKILL leaves: the build directory
    copy_library(built_cache, cache)
    again = fresh_process(cache)
    assert "LOADED" in again.stdout and "building" not in again.stderr, again.stderr[-3000:]
    assert sorted(p.name for p in cache.iterdir()) == sorted(p.name for p in built_cache.iterdir())
