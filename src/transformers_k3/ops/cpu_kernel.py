"""The fused CPU kernels (``csrc/*.cpp``) as PyTorch operators, ``torch.ops.transformers_k3.*``: built on first
use, each with a fake implementation (FakeTensor, torch.compile, export) and, where differentiable, an autograd
formula whose backward is itself an operator.

* ``kda_cpu.cpp``: chunked KDA. The PyTorch path (:func:`transformers_k3.ops.kda.chunk.chunked`) spends most of
  its time in element-wise passes, one kernel launch each, over tensors that the C++ kernel keeps in cache
  per (sequence, head).
* ``router_cpu.cpp``: the sigmoid router's top-k selection (torch.topk's general partial sort cost more than
  the experts themselves at 896 experts) and, under autograd, the backward of the chosen scores through the
  ``N k`` chosen logits only (autograd's would run dense ``[N, E]`` products).
* ``moe_cpu.cpp``: the routed experts (the ``"k3_grouped_mm"`` implementation), forward and backward. torch's
  CPU grouped GEMM wraps one ``at::mm`` per expert, and gather, GLU, weighting and scatter are each a pass over
  ``[N k, *]``. Small experts (the scaled-down widths) use register-blocked products on AVX-512 or AVX2 + FMA
  (``small_gemm.h``, ``simd.h``) where sgemm would spend its time packing a few dozen rows; larger ones call
  sgemm.

* ``amx_cpu.cpp``: a bf16 x bf16 -> fp32 GEMM on the AMX tile unit, for a bf16 model's router logits (fp32 by
  the spec; torch's CPU matmul has no fp32 result from bf16 operands, so the PyTorch path upcasts both), and its
  pieces (``amx_tiles.h``) for an fp32 router's screened selection (``router_cpu.cpp``: approximate logits on the
  tile unit with an error bound, exact fp32 logits only for the experts the bound cannot rule out).
* ``attention_cpu.cpp``: MLA's absorbed decode attention in one pass over the cached latent (logits, online softmax
  and weighted sums per tile of rows, the threads' parts merged by their maxima), where the PyTorch path reads the
  latent twice in skinny products that run far below the memory bandwidth.

Each computes the same algorithm as the PyTorch code it replaces, in fp32 (under autograd the KDA kernel computes
the forward through ``transformers_k3::kda_chunk``, :mod:`transformers_k3.ops.kda.autograd`, whose backward is the
PyTorch chunked path's gradient). The experts kernel also takes bf16 weights and activations (small-GEMM path:
read exactly as fp32, computed in fp32, rounded once at the end). Other dtypes and machines where the kernels
cannot be built use the PyTorch path. Under torch.compile the operators are traced through their fake
implementations, so a compiled graph calls the same kernels as eager; the choices made from the machine (the
library, its build features, the thread count) are constants of the graph.

``csrc/torch_ops.cpp`` defines the operators (``TORCH_LIBRARY``): each checks its tensors and calls a kernel's
entry point (``csrc/kernels.h``); only that file includes torch headers. On every other device an operator computes
its result in PyTorch (:mod:`transformers_k3.ops.reference`), so a graph holding them runs there too. The sources
are compiled once per machine by ``torch.utils.cpp_extension`` (ninja, the system C++ compiler: ``$CXX``, else
``c++``), in a child process, into ``$TRANSFORMERS_K3_CACHE`` (default
``~/.cache/transformers_k3``), under a name that hashes the source, the compiler and flags, torch's version and
location and this CPU's model and feature flags (it is built with ``-march=native``, so a cache shared between different machines never hands one the
other's binary). The library and its checksum are fsynced and renamed into place, so a concurrent or interrupted
build never leaves a partial library behind, and a cached file that fails its checksum is rebuilt, not loaded.
A library is loaded only from a directory that this user alone can write (owned by the user, not group- or
world-writable, under directories only the user or root can write) and only if the library and its checksum are the
user's and writable by nobody else; any other cache directory is refused in one logged line and the kernels are built
in the private ``<tmp>/transformers_k3-<uid>`` (0700) instead. A build runs in its own process group that dies with
this process (a killed build leaves no compiler running), in a locked directory that the next run removes if its
owner was killed.
If no compiler is found or the build fails, the reason is logged once and the PyTorch path is used.

Nothing here decides whether a kernel runs in a model: `transformers_k3.kernelize` attaches them once, per layer
(`ops/kernel_layers.py`), and a wrapper below computes its call where the tensors allow (else None or the PyTorch path).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import platform
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading

import torch
import torch.nn.functional as F

from .._locks import pid_alive, try_flock
from .torch_internals import below_autograd

logger = logging.getLogger(__name__)

CACHE_ENV_VAR = "TRANSFORMERS_K3_CACHE"
SOURCE_DIR = pathlib.Path(__file__).with_name("csrc")
SOURCES = tuple(
    SOURCE_DIR / name
    for name in ("kda_cpu.cpp", "moe_cpu.cpp", "router_cpu.cpp", "amx_cpu.cpp", "linear_cpu.cpp", "norm_cpu.cpp",
                 "moe_decode_cpu.cpp", "attention_cpu.cpp", "mxfp4_cpu.cpp", "torch_ops.cpp")
)
HEADERS = tuple(
    SOURCE_DIR / name for name in ("common.h", "simd.h", "small_gemm.h", "glu_simd.h", "bf16_rows.h", "amx_tiles.h",
                                 "kernels.h")
)

# Run once the library's operators exist: `transformers_k3.ops` (the package, above both) adds `reference.register`,
# so that the loader does not import the reference operators, which compute with functions that use this module.
ON_LOAD: list = []

_lock = threading.Lock()
_state: dict = {"tried": False, "lib": None, "error": None}


def applies(*tensors: torch.Tensor, differentiable: bool = False) -> bool:
    """Whether a fused kernel may compute a call on these tensors: enabled, all fp32 on CPU and, unless the kernel
    has a backward (``differentiable``), no autograd. The same under torch.compile (the operators are traced
    through their fake implementations, so a compiled graph runs the same kernels as eager). The library is built
    on the first call that qualifies."""
    return (
        all(x.device.type == "cpu" and x.dtype == torch.float32 for x in tensors)
        and (differentiable or not (torch.is_grad_enabled() and any(x.requires_grad for x in tensors)))
    )


EXPERTS_DTYPES = (torch.float32, torch.bfloat16)


def experts_applies(hidden_states, top_k_weights, gate_up_proj, down_proj) -> bool:
    """Whether the experts kernel (:func:`moe_experts`, which has a backward) may compute this call: as
    :func:`applies`, except that the expert weights may also be bf16 (both alike: read exactly as fp32, on the
    small-GEMM path only, where :func:`moe_experts` returns None otherwise) and the activations and routing
    weights fp32 or bf16 (computed in fp32; the output comes back in the activations' dtype)."""
    return (
        all(x.device.type == "cpu" for x in (hidden_states, top_k_weights, gate_up_proj, down_proj))
        and hidden_states.dtype in EXPERTS_DTYPES
        and top_k_weights.dtype in EXPERTS_DTYPES
        and gate_up_proj.dtype in EXPERTS_DTYPES
        and down_proj.dtype == gate_up_proj.dtype
    )


def load_error() -> str | None:
    """Why the kernels could not be built or loaded (None if they loaded or were not tried yet)."""
    return _state["error"]


def library():
    """The kernels' operators, ``torch.ops.transformers_k3`` (each kernel entry point one operator), building and
    loading their library on first call; None if that is impossible here. Under torch.compile the build or load
    runs at trace time and the answer is a constant of the graph."""
    return torch.ops.transformers_k3 if _loaded_library() else None


@torch.compiler.assume_constant_result
def _loaded_library() -> bool:
    if _state["tried"]:
        return _state["lib"] is not None
    _build_and_load()
    return _state["lib"] is not None


def _build_and_load() -> None:
    with _lock:
        if not _state["tried"]:
            try:
                _load()
                _state["lib"] = torch.ops.transformers_k3
            except Exception as error:  # no compiler, failed build, unloadable library: use the PyTorch path
                _state["error"] = f"{type(error).__name__}: {error}"
                logger.warning("transformers_k3: fused CPU kernels (KDA, experts) unavailable, using the PyTorch "
                               "path (%s)", _state["error"])
            _state["tried"] = True


@torch.compiler.assume_constant_result
def _feature(name: str) -> int:
    """A build property (``small_gemm_available``, ``amx_available``, ...), asked once per process."""
    if name not in _features:
        _features[name] = int(getattr(torch.ops.transformers_k3, name)())
    return _features[name]


_features: dict[str, int] = {}


def _cache_dir() -> pathlib.Path:
    if os.environ.get(CACHE_ENV_VAR):
        return pathlib.Path(os.environ[CACHE_ENV_VAR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "transformers_k3"


def _untrusted(path: pathlib.Path, uid: int, leaf: bool) -> str | None:
    """Why someone other than this user (or root) could change what ``path`` names, else None. ``leaf``: the
    directory or file itself must be this user's and not writable by group or others; an ancestor may also be
    root's, and may be writable by others if sticky (like /tmp: nobody can rename another user's entries there)."""
    try:
        st = os.lstat(path)
    except OSError as error:
        return f"cannot stat {path}: {error.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    owners = (uid,) if leaf else (uid, 0)
    if st.st_uid not in owners:
        return f"{path} belongs to uid {st.st_uid}, not to uid {uid}"
    if st.st_mode & 0o022 and (leaf or not st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by {'group and others' if st.st_mode & 0o002 else 'its group'}"
    return None


def _untrusted_directory(directory: pathlib.Path) -> str | None:
    """Why a library in ``directory`` could have been written by someone else, else None: the directory and every
    ancestor (symbolic links resolved) pass `_untrusted`."""
    if not hasattr(os, "getuid"):  # pragma: no cover - Windows: no owners or mode bits to check
        return None
    uid = os.getuid()
    real = pathlib.Path(os.path.realpath(directory))
    for i, part in enumerate((real, *real.parents)):
        reason = _untrusted(part, uid, leaf=i == 0)
        if reason is not None:
            return reason
    return None


def _private_fallback() -> pathlib.Path:
    """A per-user directory under the system's temporary directory (0700, this user's), or an error saying why not."""
    uid = os.getuid() if hasattr(os, "getuid") else 0  # (no uids on Windows)
    fallback = pathlib.Path(os.path.realpath(tempfile.gettempdir())) / f"transformers_k3-{uid}"
    with contextlib.suppress(FileExistsError):
        fallback.mkdir(mode=0o700)
    reason = _untrusted_directory(fallback)
    if reason is not None:
        raise RuntimeError(f"no private directory for the CPU kernels ({reason}); set {CACHE_ENV_VAR} to a directory "
                           "only you can write (chmod 700)")
    return fallback


def _trusted_cache(cache: pathlib.Path) -> pathlib.Path:
    """``cache`` (created 0700 if missing) when only this user can write it and its ancestors, so a library found
    there was built by this user; else (another user's or a group/world-writable directory, a read-only home) the
    private per-user fallback, with one line saying why."""
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        reason = _untrusted_directory(cache)
        if reason is None and not os.access(cache, os.W_OK | os.X_OK):
            reason = f"{cache} is not writable"
    except OSError as error:
        reason = f"{cache} cannot be created: {error.strerror}"
    if reason is None:
        return pathlib.Path(os.path.realpath(cache))
    fallback = _private_fallback()
    logger.warning("transformers_k3: not using the kernel cache %s (%s); building the CPU kernels in the private %s "
                   "instead (%s must be a directory only you can write: yours, chmod 700, under directories only you "
                   "or root can write)", cache, reason, fallback, CACHE_ENV_VAR)
    return fallback


def _cpu_identity() -> str:
    """This CPU's model name and feature flags (what -march=native compiles for)."""
    parts = [platform.machine(), platform.system()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU implementer", "CPU part"):
                    parts.append(line.strip())
                if line.strip() == "":
                    break  # the first processor's block is enough
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def _flags(native: bool) -> tuple[list[str], list[str]]:
    """The compiler and linker flags the extension machinery adds to its own (torch's include paths and libraries)."""
    torch_lib = str(pathlib.Path(torch.__file__).parent / "lib")
    cflags = ["-O3", *(["-march=native"] if native else []), "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
    return cflags, ["-fopenmp", f"-Wl,-rpath,{torch_lib}"]


# Run in a child process: torch.utils.cpp_extension.load compiles the sources with ninja (in parallel) and loads the
# result, so a library that builds but cannot load fails there; this process only ever loads a verified file. The
# child leads its own process group and dies with its parent (PR_SET_PDEATHSIG: SIGTERM); on SIGTERM it passes the
# signal to its group, where ninja stops the compilers it started, so a killed build leaves no process running.
_BUILD_SCRIPT = r"""
import os, signal, sys
def stop(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)  # ninja forwards it to each compiler's process group
    os._exit(128 + signum)
for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(signum, stop)
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[2]):  # the parent died before the line above
    sys.exit(1)
import json
from torch.utils import cpp_extension
args = json.loads(sys.argv[1])
try:
    cpp_extension.load(is_python_module=False, verbose=False, **args)
except Exception as error:
    output = getattr(error, "output", None) or b""  # (a compiler that fails its version check says why here)
    output = output.decode(errors="replace") if isinstance(output, bytes) else str(output)
    sys.stderr.write((output + "\n" + str(error))[-4000:])
    sys.exit(1)
"""


def _checksum_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".sha256")


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(path: pathlib.Path) -> bool:
    """The library is the one this user's build wrote: it and its checksum are regular files of this user's that
    nobody else can write, and its size and SHA-256 match what the build recorded beside it."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    try:
        for file in (path, _checksum_path(path)):
            st = os.lstat(file)
            if not stat.S_ISREG(st.st_mode) or (uid is not None and (st.st_uid != uid or st.st_mode & 0o022)):
                return False
        size, digest = _checksum_path(path).read_text().split()
        return path.stat().st_size == int(size) and _sha256(path) == digest
    except (OSError, ValueError):
        return False


def _publish(built: pathlib.Path, path: pathlib.Path) -> None:
    """Move a finished build into place: the library and its checksum each written in full and fsynced before the
    rename, so another process sees either nothing or a complete, verifiable file (neither group- nor
    world-writable, whatever the umask: `_verified` refuses such files)."""
    os.chmod(built, 0o755)
    with open(built, "rb") as f:
        os.fsync(f.fileno())
    record = path.with_name(f".{path.name}.sha256.{os.getpid()}")
    with open(record, "w") as f:
        os.fchmod(f.fileno(), 0o644)
        f.write(f"{built.stat().st_size} {_sha256(built)}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(record, _checksum_path(path))
    os.replace(built, path)


_loaded: list[str] = []  # the library this process loaded (its operators cannot be registered twice)
_OWNER = ".owner"  # in a build directory: locked (flock) by the process building there for as long as it runs


def _owned_build_directory(cache: pathlib.Path, key: str):
    """A fresh build directory ``.cpu_kernels_<key>.<pid>.<random>`` in ``cache`` and the open file holding the lock
    on its ``.owner``; the lock is taken before the file gets its name, so `_sweep` never sees it unlocked."""
    build = pathlib.Path(tempfile.mkdtemp(prefix=f".cpu_kernels_{key}.{os.getpid()}.", dir=cache))
    owner = try_flock(build / f"{_OWNER}.new")
    if owner is not None:
        os.rename(build / f"{_OWNER}.new", build / _OWNER)
    return build, owner


def _sweep(cache: pathlib.Path) -> None:
    """Remove what killed builds left in ``cache`` (SIGKILL, power loss: no ``finally`` ran): build directories
    whose owner no longer holds their lock (or, without a lock file, whose pid is gone), checksum records whose
    writer is gone."""
    for entry in cache.iterdir():
        name = entry.name
        if not name.startswith(".cpu_kernels_"):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir() and not entry.is_symlink():
                lock = entry / _OWNER
                if lock.exists():
                    owner = try_flock(lock)
                    if owner is None:
                        continue  # its build is running
                    owner.close()
                else:
                    parts = name.split(".")  # ["", "cpu_kernels_<key>", "<pid>", "<random>"]
                    if len(parts) != 4 or not parts[2].isdigit() or pid_alive(int(parts[2])):
                        continue  # being created, or an earlier version's (no pid to go by)
                shutil.rmtree(entry, ignore_errors=True)
            elif ".sha256." in name:
                pid = name.rsplit(".", 1)[-1]
                if pid.isdigit() and not pid_alive(int(pid)):
                    entry.unlink()


def _stop(process: subprocess.Popen) -> None:
    """End a build and everything it started: SIGTERM to its process group (ninja passes it to the compilers), then
    SIGKILL if it has not ended."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _build(compiler: str, name: str, native: bool, build: pathlib.Path) -> pathlib.Path:
    """The library built in the directory ``build``, or an error carrying the compiler's message."""
    cflags, ldflags = _flags(native)
    args = {"name": name, "sources": [str(p) for p in SOURCES], "build_directory": str(build),
            "extra_cflags": cflags, "extra_ldflags": ldflags}  # fmt: skip
    posix = hasattr(os, "killpg")
    process = subprocess.Popen([sys.executable, "-c", _BUILD_SCRIPT, json.dumps(args), str(os.getpid())],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, CXX=compiler), start_new_session=posix)  # fmt: skip
    try:
        _, stderr = process.communicate()
    except BaseException:  # (KeyboardInterrupt, SystemExit from a signal handler): leave no compiler running
        if posix:
            _stop(process)
        else:  # pragma: no cover
            process.kill()
        raise
    built = build / f"{name}.so"
    if process.returncode != 0 or not built.is_file():
        raise RuntimeError(stderr.strip()[-3000:] or f"exit status {process.returncode}")
    return built


def _load():
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    source = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    cache = _trusted_cache(_cache_dir())
    _sweep(cache)
    errors = []
    for native in (True, False):
        key = hashlib.sha256(
            b"\0".join([source, compiler.encode(), repr(_flags(native)).encode(), _cpu_identity().encode(),
                        torch.__version__.encode(), torch.__file__.encode()])
        ).hexdigest()[:16]  # fmt: skip
        path = cache / f"cpu_kernels_{key}.so"
        if os.path.lexists(path) and not _verified(path):
            # truncated, zeroed or replaced (loading such a file can kill the process with SIGBUS): build anew
            logger.warning("transformers_k3: the cached CPU kernel library %s does not match its checksum; "
                           "rebuilding it", path)
            for stale in (path, _checksum_path(path)):
                stale.unlink(missing_ok=True)
        if not path.exists():
            logger.warning("transformers_k3: building the fused CPU kernels for this machine with %s (once; "
                           "usually 20-40 s), cached in %s", os.path.basename(compiler), cache)
            # one directory per attempt, named with its pid and locked while it runs: `_sweep` removes it if killed
            build, owner = _owned_build_directory(cache, key)
            try:
                _publish(_build(compiler, f"cpu_kernels_{key}", native, build), path)
            except Exception as error:  # (the next flags, else the error below)
                errors.append(str(error))
                continue
            finally:
                shutil.rmtree(build, ignore_errors=True)
                if owner is not None:
                    owner.close()
        if not _loaded:
            torch.ops.load_library(str(path))
            _loaded.append(str(path))
            _register_python_parts()
        return
    raise RuntimeError("building the CPU kernels failed:\n" + "\n---\n".join(errors))


def chunk_forward(q, k, v, g, beta, state, bounds, scale: float, chunk: int, inplace: bool = False):
    """Chunked KDA forward with the fused kernel (``transformers_k3::kda_chunk_forward``), or None when it cannot run
    here (then use the PyTorch path).

    ``q, k, g`` ``[B, T, H, K]``, ``v`` ``[B, T, H, V]``, ``beta`` ``[B, T, H]``, all fp32 on CPU, ``q`` not
    yet scaled; ``state`` ``[N, H, K, V]`` fp32 in sequence order; ``bounds`` the host
    ``cu_seqlens`` (then ``B == 1``) or None for ``N == B`` whole sequences. Returns ``(o [B, T, H, V],
    final state [N, H, K, V])``; with ``inplace`` the final state is written into ``state`` (which must then
    be contiguous) and returned, otherwise ``state`` is left untouched.
    """
    if library() is None:
        return None
    batch, length = q.shape[:2]
    if inplace and not state.is_contiguous():
        raise ValueError("chunk_forward(inplace=True) needs a contiguous state")
    final = state if inplace else state.clone(memory_format=torch.contiguous_format)
    if bounds is None:
        starts = torch.arange(batch, dtype=torch.int64) * length
        lengths = torch.full((batch,), length, dtype=torch.int64)
    else:
        edges = torch.tensor(bounds, dtype=torch.int64)
        starts, lengths = edges[:-1], edges[1:] - edges[:-1]
    try:
        out = torch.ops.transformers_k3.kda_chunk_forward.default(q, k, v, g, beta, final, starts, lengths, chunk,
                                                                  float(scale))  # fmt: skip
    except torch.OutOfMemoryError as error:  # nothing was written (the kernel checks its scratch first)
        logger.warning("transformers_k3: fused CPU KDA kernel failed (%s), using the PyTorch path", error)
        return None
    return out, final


def router_topk(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor | None:
    """Indices ``[N, k]`` (int64) of the ``k`` largest ``scores + bias`` per row, or None when the kernel cannot
    run here. ``scores [N, E]`` and ``bias [E]`` fp32 on CPU. Rows come out in descending order of the biased
    score; equal scores rank the lower expert id first; NaN ranks above every number (as in torch.topk)."""
    if library() is None:
        return None
    try:
        return torch.ops.transformers_k3.router_topk.default(scores.detach(), bias.detach(), top_k)
    except torch.OutOfMemoryError as error:
        logger.warning("transformers_k3: fused CPU router kernel failed (%s), using torch.topk", error)
        return None


def router_sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int):
    """``(index [N, k] int64, selected [N, k] fp32)``: per row of ``logits [N, E]`` the ``k`` largest
    ``sigmoid(logits) + bias``, ranked as `router_topk` ranks them, and their unbiased sigmoid scores, in one pass
    that never writes the ``[N, E]`` scores out; or None where it cannot run (neither AVX-512 nor AVX2, or no Sleef
    exp in this torch, k > 16, or the check below failed): then `router_topk` on ``torch.sigmoid``'s scores. The
    sigmoid is computed as torch.sigmoid computes it (its own vectorised exp, then 1 / (1 + e)), so the scores, and
    with them the ranking, are bitwise torch's; that is checked against torch.sigmoid once per loaded library."""
    lib = library()
    if lib is None or top_k > 16 or not _sigmoid_matches_torch(lib):
        return None
    try:
        return torch.ops.transformers_k3.router_sigmoid_topk.default(logits.detach(), bias.detach(), top_k)
    except NotImplementedError:  # (more than 2^31 experts)
        return None
    except torch.OutOfMemoryError as error:
        logger.warning("transformers_k3: fused CPU router kernel failed (%s), using torch", error)
        return None


def _sigmoid_matches_torch(lib) -> bool:
    """Whether the kernels' sigmoid gives bitwise torch.sigmoid on a probe spanning its range (a torch whose
    sigmoid is computed differently would change the ranking of near-ties: then the router keeps torch's)."""
    return _sigmoid_probe()


@torch.compiler.assume_constant_result
def _sigmoid_probe() -> bool:
    lib = torch.ops.transformers_k3
    if "sigmoid_matches" not in _features:
        probe = torch.cat([torch.linspace(-100, 100, 4000), torch.logspace(-30, 1, 90),
                           torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 88.5])])  # fmt: skip
        # (4,096 values: torch's vectorised loop covers all of them, with no scalar tail)
        _features["sigmoid_matches"] = bool(_feature("sigmoid_available")) and same_bits(
            lib.sigmoid(probe), torch.sigmoid(probe)
        )
    return bool(_features["sigmoid_matches"])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """fp32 ``a`` and ``b`` bitwise equal, except that a NaN matches any NaN (their payloads may differ)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def selected_scores(hidden_states, weight, top_k_index, selected):
    """The router's chosen sigmoid scores ``selected [N, k]`` (``sigmoid(hidden_states weight^T)`` at
    ``top_k_index``, passed in without autograd) as a differentiable function of ``hidden_states [N, H]`` and
    ``weight [E, H]`` (fp32, CPU) whose backward touches only the ``N k`` chosen logits (``router_backward``)
    instead of autograd's dense ``[N, E]`` products."""
    return torch.ops.transformers_k3.selected_scores.default(hidden_states, weight, top_k_index, selected.detach())


def _selected_setup(ctx, inputs, output):
    hidden_states, weight, top_k_index, _ = inputs
    ctx.save_for_backward(hidden_states, weight, top_k_index, output)


def _selected_backward(ctx, grad):
    hidden_states, weight, top_k_index, selected = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[:2]
    grad_h, grad_w = torch.ops.transformers_k3.router_backward.default(grad, hidden_states, weight, top_k_index,
                                                                       selected, need_h, need_w)  # fmt: skip
    return grad_h if need_h else None, grad_w if need_w else None, None, None


def router_screened_topk(
    hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, screen: bool = True
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sigmoid router's selection for an fp32 ``hidden_states [N, H]`` and ``weight [E, H]`` without the
    ``[N, E]`` fp32 GEMM: ``(index [N, k] int64, selected [N, k] fp32)``, the same as `router_sigmoid_topk` on
    fp32 logits ``hidden_states weight^T`` (their selection and their sigmoid scores, by construction; only the
    order of each logit's fp32 sum differs from torch's GEMM, as between any two GEMMs). The tile unit computes
    every logit from bf16-rounded operands with a rigorous bound on its error, which rules out all but a few more
    than ``k`` experts per token; only those logits are computed in fp32 (``csrc/router_cpu.cpp``). The weight is
    rounded and packed for the tile unit on every call (a few percent of it; no cache that an in-place change
    through ``.data``, which bumps no version counter, could leave stale). No gradient (the router attaches
    `selected_scores`). ``screen=False`` computes every logit in fp32 (for tests). None where it cannot run:
    kernels unbuilt, no AMX, not fp32 on CPU, ``k > 16``, an odd ``H``, a weight or bias with a value that
    is not finite."""
    if not (
        hidden_states.dtype == weight.dtype == bias.dtype == torch.float32 and hidden_states.dim() == 2
        and top_k <= 16 and hidden_states.shape[1] % 2 == 0
        and all(t.device.type == "cpu" for t in (hidden_states, weight, bias)) and amx_available()
    ):  # fmt: skip
        return None
    if weight.dim() != 2 or weight.shape[1] != hidden_states.shape[1] or bias.shape != (weight.shape[0],):
        raise ValueError(
            f"router_screened_topk: hidden_states {tuple(hidden_states.shape)}, weight {tuple(weight.shape)} and bias "
            f"{tuple(bias.shape)} do not fit: expected [N, H], [E, H] and [E]"
        )
    lib = library()
    if not _sigmoid_matches_torch(lib):
        return None
    try:
        return lib.router_screened_topk.default(hidden_states.detach(), weight.detach(), bias.detach(), top_k,
                                                screen)  # fmt: skip
    except NotImplementedError:  # (a weight or bias that is not finite: the GEMM path ranks it as torch does)
        return None
    except torch.OutOfMemoryError as error:
        logger.warning("transformers_k3: screened CPU router kernel failed (%s), using the GEMM", error)
        return None


def amx_available() -> bool:
    """Whether :func:`linear_bf16_f32` can run here: the kernels loaded, built for a CPU with the AMX tile unit
    (bf16), and the process granted its registers by the OS."""
    return library() is not None and bool(_feature("amx_available"))


def linear_bf16_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(x.float(), weight.float())`` for bf16 ``x [N, K]`` and ``weight [E, K]`` on CPU, computed on
    the AMX tile unit (``csrc/amx_cpu.cpp``): every product of two bf16 values is exact in fp32 and the
    products are summed in fp32, as in the fp32 GEMM (the order of the sums differs, as between any two GEMMs);
    torch has no CPU matmul with bf16 operands and an fp32 result. Differentiable: the backward is the PyTorch
    path's (fp32 products, gradients rounded to each input's dtype). Fewer than 12 rows (a decode step) take
    AVX-512 dot products instead (packing the weight for the tile unit would cost more than the products).
    Returns None where it cannot run (other dtypes or devices, kernels unbuilt or without AMX);
    then use the PyTorch path."""
    if not (
        x.dtype == weight.dtype == torch.bfloat16 and x.dim() == 2 and x.device.type == weight.device.type == "cpu" and amx_available()
    ):  # fmt: skip
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return torch.ops.transformers_k3.gemm_bf16_f32.default(x, weight)
    with _below_autograd():
        return torch.ops.transformers_k3.gemm_bf16_f32.default(x, weight)


def latent_scores(latent: torch.Tensor, queries: torch.Tensor) -> torch.Tensor | None:
    """``queries [B, M, r] @ latent [B, S, r]^T`` as contiguous fp32 ``[B, M, S]`` for fp32 or bf16 operands (both
    the same) on CPU without autograd: every product exact and the sums in fp32 (bf16: the bf16 -> fp32 GEMM of
    `linear_bf16_f32` where the CPU has the AMX tile unit, else fp32 GEMMs on fp32 copies of 16,384 latent rows at
    a time; fp32: torch's), the long latent the product's row-major operand. None where it cannot run (other
    dtypes or devices, autograd, kernels unbuilt)."""
    if not (
        latent.dtype == queries.dtype and latent.dtype in (torch.float32, torch.bfloat16) and latent.dim() == 3
        and queries.dim() == 3 and latent.device.type == queries.device.type == "cpu"
        and not (torch.is_grad_enabled() and (latent.requires_grad or queries.requires_grad))
        and library() is not None
    ):  # fmt: skip
        return None
    return torch.ops.transformers_k3.latent_scores.default(latent, queries)


def latent_attention(latent: torch.Tensor, queries: torch.Tensor, scale: float, value_dim: int, new_tokens: int,
                     mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """``softmax(scale queries latent^T) latent[..., :value_dim]`` as fp32 ``[B, M, value_dim]`` in one pass over
    the latent (``csrc/attention_cpu.cpp``): ``queries [B, M, D]`` head-major over the ``new_tokens`` new tokens,
    the rows each sees given by a boolean ``mask`` ``[B or 1, heads or 1, new_tokens, S]`` or, without one, by
    end-aligned causality (the new tokens the latent's last); fp32 or bf16 operands (both the same), the logits,
    softmax and sums in fp32. None where it cannot run (other dtypes or devices, autograd, kernels unbuilt)."""
    if not (
        latent.dtype == queries.dtype and latent.dtype in (torch.float32, torch.bfloat16) and latent.dim() == 3
        and queries.dim() == 3 and latent.device.type == queries.device.type == "cpu"
        and (mask is None or (mask.dtype == torch.bool and mask.device.type == "cpu"))
        and not (torch.is_grad_enabled() and (latent.requires_grad or queries.requires_grad))
        and library() is not None
    ):  # fmt: skip
        return None
    return torch.ops.transformers_k3.latent_attention.default(latent, queries, scale, value_dim, new_tokens, mask)


def _gemm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gemm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = (grad @ weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
    grad_w = (grad.t() @ x.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w


# Where linear_bf16 beats torch's bf16 matmul (timings: bench/RESULTS.md): with bf16 instructions, up
# to 4 rows at any size, beyond that only small products (torch's AMX kernel reads the weight once for all rows and
# ours once per 4 rows). On a CPU without bf16 instructions (`native_bf16_matmul` false) torch's bf16 matmul is slow
# at every size and ours takes any product up to 15 rows, and up to LINEAR_BF16_CHUNKED_ROWS in calls of 15 rows:
# there it also beats `linear_bf16_upcast`, whose fp32 copy of the weight costs more than its faster GEMM saves.
LINEAR_BF16_MAX_ROWS = 15
LINEAR_BF16_CHUNKED_ROWS = 47
LINEAR_BF16_ANY_SIZE_ROWS = 4
LINEAR_BF16_SMALL_MACS = 1 << 20  # rows x N x K


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                native_bf16: bool | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for bf16 tensors on CPU with few rows (a decode step: up to 4 rows, or up to
    15 for a product of at most 2^20 multiply-adds; on a CPU without bf16 instructions any product up to 47 rows,
    15 rows a call; see LINEAR_BF16_MAX_ROWS), computed by
    ``csrc/linear_cpu.cpp``: exact products of the bf16 values, summed in fp32, the bias added and the result
    rounded to bf16 once (ties to even), the quantity torch's bf16 matmul computes, with the sums in another
    order. torch's bf16 matmul has a fixed cost per call far above fp32's, which dominates one-row products.
    Returns None where it does not apply: other dtypes, devices or tensor types, more rows, autograd (a gradient
    is wanted), the kernels unbuilt or without AVX-512 / AVX2; then use F.linear. ``native_bf16`` sizes the rows
    taken as for a CPU with (True) or without (False) bf16 instructions; None: this CPU (`native_bf16_matmul`)."""
    rows = _bf16_linear_rows(x, weight, bias)
    if rows is None:
        return None
    n, k = weight.shape
    if rows > LINEAR_BF16_ANY_SIZE_ROWS and (rows > LINEAR_BF16_MAX_ROWS or rows * n * k > LINEAR_BF16_SMALL_MACS):
        if rows > LINEAR_BF16_CHUNKED_ROWS or (native_bf16_matmul() if native_bf16 is None else native_bf16):
            return None
    lib = library()
    if lib is None or not _linear_bf16_available(lib):
        return None
    return lib.linear_bf16.default(x, weight, bias)  # (more than 15 rows: in calls of 15)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _bf16_linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int | None:
    """The rows of ``F.linear(x, weight, bias)`` where `linear_bf16` and `linear_bf16_upcast` may compute it (bf16
    plain tensors on CPU, x's last dimension K = weight's, no gradient wanted, a bf16 bias of N or none, the
    kernels on), else None. (Ordered for speed: it runs on every linear layer of a decode
    step.)"""
    if x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or not (x.is_cpu and weight.is_cpu):
        return None
    if type(x) is not torch.Tensor or type(weight) not in _PLAIN_TENSORS or weight.dim() != 2:
        return None
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k or k == 0:
        return None
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return None
    if bias is not None and not (bias.dtype is torch.bfloat16 and bias.is_cpu and bias.shape == (n,)):
        return None
    return x.numel() // k


# `linear_bf16_upcast`: each fp32 operand block at most UPCAST_BLOCK floats.
UPCAST_BLOCK = 1 << 22
_native_bf16: list[bool] = []  # (cached: whether torch's bf16 matmul has the CPU's bf16 instructions)


def native_bf16_matmul() -> bool:
    """Whether this CPU has bf16 dot-product instructions for torch's bf16 matmul (AVX512_BF16, or the AMX tile
    unit); without them torch computes a bf16 matmul at a small fraction of its fp32 rate."""
    if not _native_bf16:
        try:
            native = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        except AttributeError:  # (private torch API: else the CPU's flags)
            flags = _cpu_identity().split()
            native = "avx512_bf16" in flags or "amx_bf16" in flags
        _native_bf16.append(native)
    return _native_bf16[0]


def linear_bf16_upcast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       native_bf16: bool | None = None, block: int = UPCAST_BLOCK) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for bf16 tensors on a CPU without bf16 dot-product instructions
    (`native_bf16_matmul` false: AVX2 machines, AVX-512 ones before Cooper Lake), many rows (a prefill: more than
    LINEAR_BF16_CHUNKED_ROWS, fewer being `linear_bf16`'s; more than 15 where its kernel is missing), no autograd:
    the fp32 GEMM on fp32 copies of the bf16 values, the bias added in fp32, rounded to bf16 once. That is the
    quantity torch's bf16 matmul computes (the products of bf16 values are exact in fp32, summed in fp32, rounded
    once), with the sums in another order; there torch's bf16 GEMM runs at a small fraction of its fp32 rate.
    The copies are made in blocks of at most ``block`` floats
    of the weight (output features) and of the input (rows), so the extra memory stays bounded whatever the sizes.
    Returns None where it does not apply (other dtypes, devices or tensor types, few rows, autograd, a CPU with
    bf16 instructions, the kernels unbuilt); then use F.linear. ``native_bf16`` as for `linear_bf16`."""
    rows = _bf16_linear_rows(x, weight, bias)
    if rows is None:
        return None
    if rows <= LINEAR_BF16_MAX_ROWS or (native_bf16_matmul() if native_bf16 is None else native_bf16):
        return None
    if rows <= LINEAR_BF16_CHUNKED_ROWS:
        lib = library()
        if lib is not None and _linear_bf16_available(lib):
            return None  # (linear_bf16's, in calls of 15 rows: the faster there)
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    x2, out2 = x.reshape(rows, k), out.view(rows, n)
    cols = max(1, min(n, block // k))
    block_rows = max(1, min(rows, block // max(k, cols)))
    for j in range(0, n, cols):
        w = weight[j : j + cols].float()
        b = None if bias is None else bias[j : j + cols].float()
        for i in range(0, rows, block_rows):
            out2[i : i + block_rows, j : j + cols] = F.linear(x2[i : i + block_rows].float(), w, b)  # (rounds once)
    return out


def _linear_bf16_available(lib) -> bool:
    return bool(_feature("linear_bf16_available"))


def glu(gate: torch.Tensor, up: torch.Tensor, activation: tuple) -> torch.Tensor | None:
    """``act(gate, up)`` for the dense MLP and the shared experts (``activation`` as for `moe_experts`), computed in
    fp32 by the experts kernel's GLU (``transformers_k3::glu``: the same values as the routed experts' GLU, a few
    ulp from torch's tanh and sigmoid) and returned in the inputs' dtype (fp32 or bf16: bf16 inputs are computed in
    fp32 and rounded once, as `situ_glu` does). One call where torch takes ~9 element-wise ops forward and ~15
    backward, each a pass over ``[N, I]``. Differentiable (the backward is the kernel's, one pass). None where it
    does not apply: other dtypes or devices, mismatched shapes, kernels unbuilt or without AVX-512 / AVX2."""
    if not (
        gate.dtype is up.dtype and gate.dtype in (torch.float32, torch.bfloat16) and gate.is_cpu and up.is_cpu
        and gate.shape == up.shape and gate.dim() >= 1 and gate.shape[-1] > 0
    ):  # fmt: skip
        return None
    if library() is None or not _feature("small_gemm_available"):
        return None
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return torch.ops.transformers_k3.glu.default(gate, up, *_activation_args(activation))
    with _below_autograd():
        return torch.ops.transformers_k3.glu.default(gate, up, *_activation_args(activation))


def _glu_setup(ctx, inputs, output):
    gate, up, *ctx.activation = inputs
    ctx.save_for_backward(gate, up)


def _glu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    grad_gate, grad_up = torch.ops.transformers_k3.glu_backward.default(grad, gate, up, *ctx.activation)
    return grad_gate, grad_up, None, None, None


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``F.rms_norm(hidden_states, (H,), eps=eps) * weight`` for fp32 ``hidden_states [..., H]`` and ``weight [H]`` on
    CPU (``transformers_k3::rms_norm``): the forward is those two ops (the same bits), the backward one kernel pass
    per row (``rms_norm_backward``) where autograd through them runs ~12 element-wise passes. For autograd only
    (None without it, and where it does not apply: other dtypes or devices, mismatched shapes, kernels unbuilt)."""
    if not (
        torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad)
        and applies(hidden_states, weight, differentiable=True)
        and weight.dim() == 1 and hidden_states.dim() >= 1 and hidden_states.shape[-1] == weight.shape[0] > 0
    ):  # fmt: skip
        return None
    if library() is None:
        return None
    return torch.ops.transformers_k3.rms_norm(hidden_states, weight, float(eps))


def _below_autograd():
    """For a differentiable operator's call that wants no gradient: its Python autograd kernel would only pass it
    on, at a fixed cost per call (the decode step makes dozens). A compiled graph has no such cost (and cannot hold the
    guard object): there it is a no-op."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return below_autograd()


def _rms_norm_setup(ctx, inputs, output):
    hidden_states, weight, ctx.eps = inputs
    ctx.save_for_backward(hidden_states, weight)


def _rms_norm_backward(ctx, grad):
    hidden_states, weight = ctx.saved_tensors
    grad_x, grad_w = torch.ops.transformers_k3.rms_norm_backward(grad, hidden_states, weight, ctx.eps)
    need_x, need_w = ctx.needs_input_grad[:2]
    return grad_x if need_x else None, grad_w if need_w else None, None


def _register_python_parts() -> None:
    """What the operators need besides their CPU kernels (csrc/torch_ops.cpp): fake implementations (shapes and
    dtypes, for FakeTensor, torch.compile and export), for the differentiable ones their autograd formulas, and
    for every other device their PyTorch implementations (`reference`)."""
    ns, fake, autograd = "transformers_k3::", torch.library.register_fake, torch.library.register_autograd
    contiguous = torch.contiguous_format
    f32, i64 = torch.float32, torch.int64

    def empty_as(x, dtype=None):
        return torch.empty_like(x, dtype=dtype, memory_format=contiguous)

    def none(x):  # (what an op returns for a gradient it was not asked for)
        return x.new_empty(0, dtype=f32)

    @fake(ns + "kda_chunk_forward")
    def _(q, k, v, g, beta, state, starts, lengths, chunk, scale):
        return q.new_empty((*q.shape[:3], v.shape[-1]))

    @fake(ns + "router_topk")
    def _(scores, bias, top_k):
        return scores.new_empty((scores.shape[0], top_k), dtype=i64)

    @fake(ns + "router_sigmoid_topk")
    def _(logits, bias, top_k):
        return logits.new_empty((logits.shape[0], top_k), dtype=i64), logits.new_empty((logits.shape[0], top_k))

    @fake(ns + "router_screened_topk")
    def _(x, weight, bias, top_k, screen):
        return x.new_empty((x.shape[0], top_k), dtype=i64), x.new_empty((x.shape[0], top_k))

    fake(ns + "sigmoid")(lambda x: empty_as(x))
    fake(ns + "selected_scores")(lambda h, w, index, selected: torch.empty_like(selected))

    @fake(ns + "router_backward")
    def _(grad, h, w, index, selected, need_hidden, need_weight):
        return empty_as(h) if need_hidden else none(h), empty_as(w) if need_weight else none(w)

    fake(ns + "gemm_bf16_f32")(lambda x, w: x.new_empty((x.shape[0], w.shape[0]), dtype=f32))
    fake(ns + "latent_scores")(lambda lat, q: lat.new_empty((lat.shape[0], q.shape[1], lat.shape[1]), dtype=f32))
    fake(ns + "latent_attention")(lambda lat, q, scale, value_dim, new_tokens, mask=None: lat.new_empty(
        (lat.shape[0], q.shape[1], value_dim), dtype=f32))
    fake(ns + "linear_bf16")(lambda x, w, bias: x.new_empty((*x.shape[:-1], w.shape[0])))
    fake(ns + "glu")(lambda gate, up, kind, beta, linear_beta: empty_as(gate))
    fake(ns + "glu_backward")(lambda grad, gate, up, kind, beta, linear_beta: (empty_as(gate), empty_as(gate)))
    fake(ns + "rms_norm")(lambda x, w, eps: empty_as(x))
    fake(ns + "rms_norm_backward")(lambda grad, x, w, eps: (empty_as(x), empty_as(w)))

    def experts_sizes(x, index, gate_up, transposed):
        return x.shape[0], index.shape[1], x.shape[1], gate_up.shape[2 if transposed else 1] // 2

    @fake(ns + "moe_experts")
    def _(x, index, weights, gate_up, down, transposed, kind, beta, linear_beta, small, save_products):
        tokens, top_k, hidden, inter = experts_sizes(x, index, gate_up, transposed)
        products = x.new_empty((tokens * top_k, 2 * inter), dtype=f32) if small and save_products else none(x)
        return x.new_empty((tokens, hidden)), products

    @fake(ns + "moe_experts_backward")
    def _(grad, x, index, weights, gate_up, down, products, transposed, kind, beta, linear_beta, small, mask):
        return (x.new_empty(x.shape) if mask[0] else none(x), weights.new_empty(weights.shape) if mask[1] else none(x),
                empty_as(gate_up) if mask[2] else none(x), empty_as(down) if mask[3] else none(x))  # fmt: skip

    fake(ns + "moe_decode")(lambda y, *weights_and_settings: empty_as(y))
    fake(ns + "moe_decode_mxfp4")(lambda y, *weights_and_settings: empty_as(y))

    autograd(ns + "rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)
    autograd(ns + "glu", _glu_backward, setup_context=_glu_setup)
    autograd(ns + "gemm_bf16_f32", _gemm_backward, setup_context=_gemm_setup)
    autograd(ns + "selected_scores", _selected_backward, setup_context=_selected_setup)
    autograd(ns + "moe_experts", _experts_backward, setup_context=_experts_setup)
    from . import mxfp4_torch

    mxfp4_torch.register()  # (the packed MXFP4 experts' operators)
    for register in ON_LOAD:  # (every other device: the operators in PyTorch, `reference.register`)
        register()


def _activation_args(activation: tuple) -> tuple[int, float, float]:
    if activation[0] == "silu":
        return 0, 0.0, 0.0
    return 1, float(activation[1]), float(activation[2] or 0.0)


def moe_decode_max_tokens() -> int:
    """The most tokens `MoeDecode` takes (0: it cannot run here: kernels unbuilt, neither AVX-512 nor AVX2, under
    or a sigmoid that is not bitwise torch's, where the modules' router selects from torch.sigmoid's
    scores)."""
    lib = library()
    if lib is None:
        return 0
    return _feature("moe_decode_max_tokens") if _sigmoid_matches_torch(lib) else 0


# The decode kernel runs on one thread, the modules' products on every thread: it is taken for layers up to this
# many multiply-adds per token (router, latent and shared projections, k experts), where the modules' ~15 ops and
# calls cost more than its products (timings: bench/RESULTS.md). With more threads the modules' products
# take less time, their calls do not: the limits keep the kernel's own time at about the calls' cost.
MOE_DECODE_MAX_MACS = {torch.float32: 1 << 20, torch.bfloat16: 1 << 21}
# Packed MXFP4 experts read a quarter of bf16's bytes per multiply-add and the modules' packed products pay more
# fixed costs per call (the sort and gathers of `mxfp4.mxfp4_experts`).
MOE_DECODE_MAX_MACS_MXFP4 = {torch.float32: 1 << 23, torch.bfloat16: 1 << 23}


class MoeDecode:
    """The whole MoE layer on a few tokens without autograd (``csrc/moe_decode_cpu.cpp``), for one set of weights
    in one dtype: ``MoeDecode(...)(y [N, H])`` -> ``[N, H]`` in that dtype (fp32 or bf16), N <=
    `moe_decode_max_tokens`. `KimiK3SparseMoE` makes one per set of its modules' weights, as stored: ``router
    [E, H]`` (the layer's dtype, or fp32), ``bias [E]`` fp32, the latent projections ``[L, H]`` / ``[H, L]`` and
    the norm's weight ``[L]`` (None: not a latent layer; ``norm`` None: no norm), the experts ``[E, 2I, L]`` /
    ``[E, L, I]``, ``activation`` as for `moe_experts`, ``shared`` the shared expert's gate, up ``[S, H]`` and down
    ``[H, S]`` weights or None. ``gate_up_scale`` / ``down_scale`` given: the experts are packed MXFP4
    (``gate_up`` / ``down`` their uint8 codes ``[E, 2I, L/2]`` / ``[E, L, I/2]``, the scales ``[E, 2I, L/32]`` /
    ``[E, L, I/32]``, `ops.mxfp4`'s layout; ``transformers_k3::moe_decode_mxfp4``). The same quantities as the
    modules compute (bf16: rounded where they round), the sums in another order. ``usable`` False where the
    weights do not fit (dtypes, layouts, devices, tensor types; the operator checks the shapes), the layer is too
    large for one thread (`MOE_DECODE_MAX_MACS`) or, in bf16, its experts in the layer's dtype for the experts
    kernel (`experts_small_gemm`: the modules then run torch's bf16 products); a call returns None where ``y`` does
    not (then run the modules). Made for each call from the tensors the modules hold then."""

    def __init__(self, dtype: torch.dtype, router: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                 scale: float, down_latent: torch.Tensor | None, norm: torch.Tensor | None, eps: float,
                 up_latent: torch.Tensor | None, gate_up: torch.Tensor, down: torch.Tensor, activation: tuple,
                 shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                 gate_up_scale: torch.Tensor | None = None,
                 down_scale: torch.Tensor | None = None) -> None:  # fmt: skip
        self.dtype, self.usable = dtype, False
        packed = gate_up_scale is not None
        f32 = torch.float32
        if (dtype is not f32 and dtype is not torch.bfloat16) or (router.dtype is not dtype and router.dtype is not f32):
            return
        if bias.dtype is not f32:  # (a model cast with .to(): the router's own path selects on bias.float() too)
            bias = bias.float()
        if packed and down_scale is None:
            return
        # (one pass over the tensors, no any() or comprehensions: this runs on every decode step of every MoE layer)
        experts = (gate_up, gate_up_scale, down, down_scale) if packed else (gate_up, down)
        groups = (((router, bias), None), (experts, torch.uint8 if packed else dtype),
                  ((down_latent, up_latent, norm, *(shared or ())), dtype))  # fmt: skip
        for tensors, wanted in groups:
            for t in tensors:
                if t is None:
                    continue
                if type(t) not in _PLAIN_TENSORS or not t.is_cpu or not t.is_contiguous():
                    return
                if wanted is not None and t.dtype is not wanted:
                    return
        # The sizes the dispatch decision needs; the operator checks every shape against them and names a misfit
        # (the modules' own products would fail on it too).
        if router.dim() != 2 or gate_up.dim() != 3:
            return
        num_experts, hidden = router.shape
        latent = 0 if down_latent is None else down_latent.shape[0]
        width = latent or hidden
        inter = gate_up.shape[1] // 2
        shared_inter = 0 if shared is None else shared[0].shape[0]
        if num_experts == 0 or not 1 <= top_k <= min(16, num_experts) or (packed and (width % 32 or inter % 32)):
            return
        macs = num_experts * hidden + 2 * latent * hidden + 3 * shared_inter * hidden + top_k * 3 * width * inter
        if macs > (MOE_DECODE_MAX_MACS_MXFP4 if packed else MOE_DECODE_MAX_MACS)[dtype]:
            return
        if dtype is torch.bfloat16 and not packed and not experts_small_gemm(width, inter, top_k, 1, 1, num_experts,
                                                                             bf16=True):  # fmt: skip
            return  # (bf16 experts the experts kernel does not take: the modules' bf16 products round at each step)
        kind, beta, linear_beta = _activation_args(activation)
        self.hidden = hidden
        shared = (None, None, None) if shared is None else shared
        self.args = (router, bias, top_k, bool(renormalize), float(scale), down_latent, norm, float(eps), up_latent,
                     *experts, kind, beta, linear_beta, *shared)  # fmt: skip
        ops = torch.ops.transformers_k3
        self.op = ops.moe_decode_mxfp4.default if packed else ops.moe_decode.default
        self.usable = True

    def __call__(self, y: torch.Tensor) -> torch.Tensor | None:
        if y.dtype is not self.dtype or type(y) is not torch.Tensor or y.dim() != 2 or y.shape[1] != self.hidden:
            return None
        if torch.is_grad_enabled() and y.requires_grad:
            return None
        try:
            return self.op(y, *self.args)
        except NotImplementedError:  # (the selection kernel unavailable)
            return None


def moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, transposed: bool,
                activation: tuple, *, small_gemm: bool | None = None, save_products: bool = True):  # fmt: skip
    """The routed experts through the fused kernel, differentiable (the kernel has a backward), or None when it
    cannot run here (then use the PyTorch path).

    ``hidden_states [N, D]``, ``top_k_weights [N, k]`` (fp32 or bf16) and ``top_k_index [N, k]`` on CPU;
    ``gate_up_proj [E, 2I, D]`` and ``down_proj [E, D, I]``, both fp32 or both bf16 (``transposed``: stored
    ``[E, D, 2I]`` / ``[E, I, D]``); ``activation`` ``("silu",)`` or ``("situ", beta, linear_beta or None)``.
    Returns ``out [N, D]`` in ``hidden_states``' dtype: ``out[t] = sum_j w[t, j] * down_e(glu(gate_up_e(x[t])))``,
    ``e = top_k_index[t, j]``; ids outside ``[0, E)`` contribute nothing. Gradients reach ``hidden_states``,
    ``top_k_weights`` and both weights, each in its own dtype.

    Everything is computed in fp32 from the values as given (bf16 -> fp32 is exact) and rounded once at the end:
    with bf16 operands the output is the fp32 computation on their fp32 copies, rounded to bf16, bitwise; the
    weight gradients are each expert's fp32 sums rounded to bf16. (The PyTorch path in bf16 rounds each product
    and activation to bf16 on the way.) bf16 weights take the small-GEMM path only (the experts' weights are
    converted in cache, as they are transposed there); elsewhere this returns None.

    Both paths compute the same function: ``small_gemm`` None picks by size (`experts_small_gemm`), True takes the
    small-GEMM path (where this build has it), False sgemm. Under autograd the small-GEMM path keeps its gate/up
    products for the backward; ``save_products=False`` has the backward recompute them.
    """
    if library() is None or not (gate_up_proj.is_contiguous() and down_proj.is_contiguous()):
        return None  # (copying all experts' weights per call would cost more than the kernel saves)
    if small_gemm is None:
        small = _experts_sizes(hidden_states, gate_up_proj, top_k_index, transposed)[-1]
    else:
        small = small_gemm and bool(_feature("small_gemm_available"))
    if gate_up_proj.dtype != torch.float32 and not small:
        return None  # (bf16 weights: the small-GEMM path only)
    tensors = (hidden_states, top_k_weights, gate_up_proj, down_proj)
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        out = _experts_forward(*tensors, top_k_index, transposed, activation, small, save_products=save_products)
        out = out[0] if save_products else out
        if out is None:
            raise RuntimeError("the fused CPU MoE kernel failed (see the warning above)")
        return out
    return _experts_forward(*tensors, top_k_index, transposed, activation, small)


def _experts_sizes(hidden_states, gate_up_proj, top_k_index, transposed):
    """``N, k, D, I``, the thread count and whether the small-GEMM path runs."""
    num_tokens, top_k = top_k_index.shape
    hidden, inter = hidden_states.shape[-1], (gate_up_proj.shape[1] if not transposed else gate_up_proj.shape[2]) // 2
    threads = _threads()
    small = experts_small_gemm(hidden, inter, top_k, threads, num_tokens, gate_up_proj.shape[0],
                               bf16=gate_up_proj.dtype == torch.bfloat16)  # fmt: skip
    return num_tokens, top_k, hidden, inter, threads, small


@torch.compiler.assume_constant_result
def _threads() -> int:
    """Intra-op threads, for the experts kernel's choice of path (either computes the same function); a compiled
    graph keeps the count it was traced with."""
    return max(1, torch.get_num_threads())


# The experts kernel's small-GEMM path (register-blocked AVX-512 / AVX2 products on in-cache transposed copies of
# each expert's weights, each thread adding its experts' rows into its own [N, D] accumulator) is taken when
# * an expert's three weight matrices hold at most SMALL_EXPERT_FLOATS (its transposed copy stays in a core's L2;
#   larger experts go through sgemm, where packing costs little next to the products),
# * the experts see at least SMALL_MIN_ROWS_PER_EXPERT rows on average (the transposes cost about as much as 8
#   rows' products; bench/RESULTS.md has where the two paths break even), and
# * the extra accumulators, (threads - 1) x [N, D], take no more memory than the other path's expert-sorted rows,
#   [N k, D].
SMALL_EXPERT_FLOATS = 3 * 64 * 1024
SMALL_MIN_ROWS_PER_EXPERT = 3


def experts_small_gemm(hidden: int, inter: int, top_k: int, threads: int, num_tokens: int, num_experts: int,
                       bf16: bool = False) -> bool:  # fmt: skip
    """Whether the experts kernel takes its small-GEMM path for these sizes on this machine (AVX-512 or AVX2
    build). With bf16 weights (``bf16``), which the sgemm path does not take, whenever the experts are small: the
    other choice is then the PyTorch path, which is slower and larger at any token count (a decode step
    included)."""
    if bf16:
        return bool(_feature("small_gemm_available")) and 3 * hidden * inter <= SMALL_EXPERT_FLOATS
    return (bool(_feature("small_gemm_available")) and 3 * hidden * inter <= SMALL_EXPERT_FLOATS
            and num_tokens * top_k >= SMALL_MIN_ROWS_PER_EXPERT * num_experts and threads - 1 <= top_k)  # fmt: skip


def _experts_forward(hidden_states, top_k_weights, gate_up_proj, down_proj, top_k_index, transposed, activation,
                     small: bool, save_products: bool = False):  # fmt: skip
    """``out [N, D]`` (None if the kernel failed) from ``transformers_k3::moe_experts``; with ``save_products``
    ``(out, saved)``: on the small-GEMM path ``saved [N k, 2I]`` holds the gate/up products (expert-sorted) for the
    backward, which then skips recomputing them (autograd keeps the same products in the PyTorch path), else
    None. ``small``: the small-GEMM path, else sgemm. The op is differentiable (its backward is
    ``moe_experts_backward``)."""
    tensors = (hidden_states, top_k_weights, gate_up_proj, down_proj)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
    try:
        with contextlib.nullcontext() if grad else _below_autograd():
            out, saved = torch.ops.transformers_k3.moe_experts.default(
                hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, transposed,
                *_activation_args(activation), small, save_products,
            )  # fmt: skip
    except torch.OutOfMemoryError as error:
        logger.warning("transformers_k3: fused CPU MoE kernel failed (%s), using the PyTorch path", error)
        out = saved = None
    return (out, saved if small else None) if save_products else out


def _experts_setup(ctx, inputs, output):
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *ctx.args, _ = inputs
    ctx.save_for_backward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, output[1])
    ctx.mark_non_differentiable(output[1])


def _experts_backward(ctx, grad_out, _):
    """On the small-GEMM path the forward kept the experts' gate/up products ([N k, 2I], as autograd would in the
    PyTorch path) and the backward reads them; otherwise (``products`` empty) it recomputes them."""
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, products = ctx.saved_tensors
    need = ctx.needs_input_grad
    mask = [need[0], need[2], need[3], need[4]]
    grads = torch.ops.transformers_k3.moe_experts_backward.default(
        grad_out, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, products, *ctx.args, mask
    )
    grad_x, grad_w, grad_gate_up, grad_down = (g if m else None for g, m in zip(grads, mask))
    return grad_x, None, grad_w, grad_gate_up, grad_down, None, None, None, None, None, None
