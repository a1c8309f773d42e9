"""Streaming safetensors checkpoints: read one input shard at a time, write sharded outputs in place.

A converter describes its output as a *plan*: a list of `OutputTensor`s, each assembled from `Piece`s. A
piece reads one or more input tensors (optionally a slice of the first), maps them through a function
(rename-only, cast, dequantise, split, ...) and lands in a contiguous element range of its output tensor.
`execute_plan` then

* lays out every output shard up front (safetensors headers are computed from the plan) and pre-sizes the
  files, so an output tensor never has to be assembled in memory: the pieces of a fused expert tensor
  are written straight to their byte ranges as they arrive, whichever input shard they come from;
* walks the input shards in order, opening one at a time with ``safe_open`` and reading tensor by tensor;
  a piece whose secondary inputs sit in another shard (e.g. an MXFP4 scale) reads just those tensors;
* checks that every byte of every output tensor was written exactly once.

Peak memory is therefore about one input shard (the pages ``safe_open`` maps while it reads) plus the
largest single piece, independent of model size and of the output shard size.

Nothing is ever unpickled: inputs must be safetensors, and a pickle-format file is reported as such.
Every error names the file and the tensor it is about.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import math
import mmap
import os
import re
import shutil
import struct
import sys
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .._locks import fcntl, pid_alive, try_flock
from ..safetensors_header import CheckpointError, TensorInfo, dtype_to_safetensors, element_size, read_safetensors_header

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Test hook: seconds to sleep after each input shard (the kill-during-conversion test); unset in normal use.
_TEST_SLEEP_AFTER_SHARD = os.environ.get("TRANSFORMERS_K3_TEST_SLEEP_AFTER_SHARD")


def parse_size(size: int | str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or an int -> bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if not match:
        raise ValueError(f"cannot parse size {size!r} (use e.g. 5GB, 500MB or a number of bytes)")
    number, unit = float(match.group(1)), match.group(2).rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("I")]
    if int(number * base**power) < 1:
        raise ValueError(f"size {size!r} is below one byte (use e.g. 5GB, 500MB or a number of bytes)")
    return int(number * base**power)


# --------------------------------------------------------------------------------------------------
# Reading
# The stacks of MXFP4 bytes a `KimiK3PackedExperts` layer saves under with ``save_original_format=False``
PACKED_EXPERT_STACKS = (".mlp.experts.gate_up_packed", ".mlp.experts.gate_up_scale", ".mlp.experts.down_packed",
                        ".mlp.experts.down_scale")


def non_float_problem(name: str, dtype: torch.dtype) -> str | None:
    """Why a tensor of ``dtype`` cannot be the K3 weight ``name``, or None. Every K3 weight is floating point
    (bf16/fp16/fp32, FP8, E8M0); the only integer tensors are MXFP4 ``weight_packed`` (uint8 nibbles) and
    ``weight_scale`` (E8M0 exponents, stored as uint8 by compressed-tensors). An int32/int64/bool tensor
    where a weight belongs would otherwise be cast silently to garbage weights."""
    if dtype.is_floating_point:
        return None
    if dtype == torch.uint8 and name.endswith((".weight_packed", ".weight_scale")):
        return None
    if dtype == torch.uint8 and name.endswith(PACKED_EXPERT_STACKS):  # (`KimiK3PackedExperts` saved fused)
        return None
    return (f"tensor `{name}` is stored as {str(dtype).replace('torch.', '')}, which cannot be a K3 weight (weights "
            "are floating point; only MXFP4 `weight_packed`/`weight_scale` are uint8); the file is corrupt or not "
            "a K3 checkpoint: re-download or re-export it")


# Hugging Face's hub cache keeps a snapshot's files as symlinks into the repository's `blobs/` folder.
def allowed_roots(directory: Path) -> list[Path]:
    """The folders a checkpoint's files may resolve into: the directory itself and, for a hub-cache
    snapshot (``…/snapshots/<revision>``), its repository's ``blobs`` folder."""
    real = Path(os.path.realpath(directory))
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent / "blobs")
    return roots


def resolve_inside(directory: Path, relative: str, what: str) -> Path:
    """``directory / relative``, refusing an absolute path, a ``..`` component or a path that resolves
    (after symlinks) outside the checkpoint directory."""
    if not isinstance(relative, str) or not relative:
        raise CheckpointError(f"{what}: the file name {relative!r} is not a file name")
    pure = Path(relative)
    if pure.is_absolute() or relative.startswith(("/", "\\")) or ".." in pure.parts or "\\" in relative \
            or re.match(r"^[A-Za-z]:", relative):
        raise CheckpointError(
            f"{what}: the file {relative!r} is outside the checkpoint directory {directory} (absolute or with `..`); "
            "a checkpoint may only refer to files inside its own directory: fix the index or move the file there")
    path = directory / relative
    real = Path(os.path.realpath(path))
    if not any(real == root or root in real.parents for root in allowed_roots(directory)):
        raise CheckpointError(
            f"{what}: {path} resolves (through a symbolic link) to {real}, outside the checkpoint directory "
            f"{directory}; copy the file into the directory instead of linking it")
    return path


def read_json_file(path: Path, what: str) -> dict:
    """A JSON object from ``path``, or a `CheckpointError` naming the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({error}); re-download or regenerate it") from None
    except OSError as error:
        raise CheckpointError(f"{path}: {what} cannot be read ({error})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object, got {type(data).__name__}; re-download or "
                              "regenerate it")
    return data


def read_index(index_path: Path) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index, checked: a non-empty object of tensor name -> file name."""
    weight_map = read_json_file(index_path, "the shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: has no `weight_map` (an object of tensor name -> shard file); "
                              "re-download or regenerate the index")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointError(f"{index_path}: tensor `{name}` maps to {file!r}, not a file name; re-download or "
                                  "regenerate the index")
    return weight_map


def _consistent(headers: list, index: dict[str, str] | None) -> bool:
    """No tensor stored twice and, with an index, each shard stores exactly the tensors the index puts in it."""
    if sum(len(header) for _, _, header in headers) != len(set().union(*(header.keys() for _, _, header in headers))):
        return False
    if index is None:
        return True
    listed: dict[str, set[str]] = {}
    posix = {file: Path(file).as_posix() for file in set(index.values())}
    for name, file in index.items():
        listed.setdefault(posix[file], set()).add(name)
    return all(header.keys() <= listed.get(relative, set()) for _, relative, header in headers)


def scan_shards(directory: Path, files: Sequence[str], index: dict[str, str] | None,
                index_path: Path | None = None, check_dtypes: bool = True) -> tuple[list[Path], dict[str, TensorInfo]]:
    """Reads and cross-checks the headers of ``files`` (relative to ``directory``): each resolves inside
    the directory, no tensor is stored twice, with an index every stored tensor is indexed under its own
    shard and every indexed one is stored, and (``check_dtypes``) no tensor has a dtype a K3 weight cannot have. Reads
    headers only. Returns the shard paths (in reading order) and the tensors."""
    where = index_path or directory
    paths = [resolve_inside(directory, file, f"{where}") for file in files]
    missing = [path for path in paths if not path.is_file()]
    if missing:
        who = [name for name, file in (index or {}).items() if directory / file == missing[0]]
        listed = ", ".join(f"`{name}`" for name in who[:3]) + (f" and {len(who) - 3} more" if len(who) > 3 else "")
        raise CheckpointError(
            f"{missing[0]}: shard file is missing"
            + (f" (the index puts tensors {listed} there)" if who else "")
            + (f"; {len(missing) - 1} more shard(s) missing" if len(missing) > 1 else "")
        )
    paths = sorted(paths, key=lambda p: (len(p.name), p.name))
    tensors: dict[str, TensorInfo] = {}
    problems: list[str] = []
    headers = [(path, path.relative_to(directory).as_posix(), read_safetensors_header(path)) for path in paths]
    if _consistent(headers, index):  # the usual case, by set operations; otherwise the loop below says what is wrong
        for path, _, header in headers:
            if check_dtypes:
                problems += [f"{path.name}: {problem}" for name, info in header.items()
                             if not info.dtype.is_floating_point and (problem := non_float_problem(name, info.dtype))]
            tensors.update(header)
        headers = []
    stored_in: dict[str, list[Path]] = {}
    for path, _, header in headers:
        for name in header:
            stored_in.setdefault(name, []).append(path)
    for path, relative, header in headers:
        for name, info in header.items():
            if len(stored_in[name]) > 1:
                first, second = stored_in[name][:2]
                listed = f" (the index lists it under {index[name]})" if index is not None and name in index else ""
                raise CheckpointError(
                    f"{second}: tensor `{name}` is stored in both {first.name} and {second.name}{listed}; a tensor must "
                    "be stored once (which copy a loader uses would depend on the shard order): remove the duplicate "
                    "or re-download the checkpoint")
            if index is not None and name not in index:
                raise CheckpointError(
                    f"{path}: tensor `{name}` is stored in this shard but not listed in the index {index_path.name}; "
                    "the checkpoint is inconsistent: re-download it or regenerate the index from the shards")
            if index is not None and Path(index[name]).as_posix() != relative:
                raise CheckpointError(f"{path}: tensor `{name}` is indexed under {index[name]}; the checkpoint is "
                                      "inconsistent: re-download it or regenerate the index from the shards")
            problem = non_float_problem(name, info.dtype) if check_dtypes else None
            if problem:
                problems.append(f"{path.name}: {problem}")
            tensors[name] = info
    if problems:
        more = len(problems) - 10
        raise CheckpointError("\n  ".join(problems[:10]) + (f"\n  ... and {more} more" if more > 0 else ""))
    if index is not None:
        absent = [name for name in index if name not in tensors]
        if absent:
            raise CheckpointError(
                f"{directory / index[absent[0]]}: tensor `{absent[0]}` is listed in the index but not in "
                f"the shard" + (f" ({len(absent) - 1} more such tensors)" if len(absent) > 1 else "")
            )
    return paths, tensors


class Checkpoint:
    """A directory of safetensors shards (``model.safetensors`` or an index with its shards) plus its
    ``config.json``. The constructor reads only headers and checks: no pickle files, no missing or
    truncated shard, the index agrees with the shards, no tensor stored twice."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: input directory does not exist")
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path}: missing (the checkpoint's config is needed to check shapes)")
        self.config: dict = read_json_file(config_path, "the checkpoint's config")

        index_path = self.directory / SAFE_WEIGHTS_INDEX_NAME
        single = self.directory / SAFE_WEIGHTS_NAME
        self.index: dict[str, str] | None = None
        if index_path.is_file() and single.is_file():
            raise CheckpointError(f"{self.directory} holds both {SAFE_WEIGHTS_NAME} and {SAFE_WEIGHTS_INDEX_NAME}: "
                                  f"transformers would load {SAFE_WEIGHTS_NAME} and ignore the shards the index lists. "
                                  "Remove the one that is stale.")
        if index_path.is_file():
            weight_map = read_index(index_path)
            for name, file in weight_map.items():
                if file.endswith(PICKLE_SUFFIXES):
                    raise CheckpointError(
                        f"{index_path}: tensor `{name}` is stored in the pickle-format file {file}; only safetensors "
                        "checkpoints are converted (nothing is ever unpickled)"
                    )
            self.index = weight_map
            files = list(dict.fromkeys(weight_map.values()))
        elif single.is_file():
            files = [SAFE_WEIGHTS_NAME]
        else:
            pickles = sorted(p.name for p in self.directory.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
            shards = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if pickles and not shards:
                raise CheckpointError(
                    f"{self.directory / pickles[0]}: pickle-format checkpoint ({', '.join(pickles)}); only safetensors "
                    "checkpoints are converted (nothing is ever unpickled)"
                )
            if len(shards) == 1:
                files = shards
            else:
                raise CheckpointError(
                    f"{self.directory}: no {SAFE_WEIGHTS_INDEX_NAME} and no {SAFE_WEIGHTS_NAME}"
                    + (f" ({len(shards)} .safetensors files without an index)" if shards else "")
                )
        self.files, self.tensors = scan_shards(self.directory, files, self.index,
                                               index_path if self.index is not None else None)

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())


class _Reader:
    """Reads tensors from the input checkpoint: one main shard open at a time, plus short reads of single
    tensors from other shards."""

    def __init__(self):
        self._main_path: Path | None = None
        self._main = None
        self._stack = contextlib.ExitStack()

    def open_main(self, path: Path) -> None:
        self.close()
        self._stack = contextlib.ExitStack()
        try:
            self._main = self._stack.enter_context(safe_open(str(path), framework="pt"))
        except Exception as error:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot be opened as safetensors ({error})") from error
        self._main_path = path

    def read(self, info: TensorInfo, select=None) -> torch.Tensor:
        try:
            if info.file == self._main_path:
                handle = self._main
                return handle.get_slice(info.name)[select] if select is not None else handle.get_tensor(info.name)
            with safe_open(str(info.file), framework="pt") as handle:
                return handle.get_slice(info.name)[select] if select is not None else handle.get_tensor(info.name)
        except CheckpointError:
            raise
        except Exception as error:  # safetensors raises its own error types
            raise CheckpointError(f"{info.where()}: cannot be read ({error})") from error

    def close(self) -> None:
        self._stack.close()
        self._main = None
        self._main_path = None


# --------------------------------------------------------------------------------------------------
# Plans
@dataclass
class Piece:
    """``fn([inputs...]) -> tensor`` written to elements ``[dst_offset, dst_offset + numel)`` of its output.
    ``select`` indexes the first source before it is read (``get_slice``), so slicing a fused tensor reads
    only the slice; ``selects_rest`` does so for the other sources, one entry (or None) each. ``expect_shape`` is
    the shape ``fn`` must return."""

    sources: tuple[TensorInfo, ...]
    expect_shape: tuple[int, ...]
    dst_offset: int = 0
    fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
    select: tuple | None = None
    note: str = ""
    selects_rest: tuple[tuple | None, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.expect_shape)


@dataclass
class OutputTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_size(self.dtype)


def check_coverage(tensor: OutputTensor) -> str | None:
    """None if the pieces tile the output exactly, else a description of the gap or overlap."""
    total = math.prod(tensor.shape)
    spans = sorted((p.dst_offset, p.dst_offset + p.numel) for p in tensor.pieces)
    position = 0
    for begin, end in spans:
        if begin > position:
            return f"elements [{position}, {begin}) have no source"
        if begin < position:
            return f"elements [{begin}, {min(position, end)}) are written twice"
        position = end
    if position != total:
        return f"elements [{position}, {total}) have no source"
    return None


# --------------------------------------------------------------------------------------------------
# Writing
@dataclass
class _ShardLayout:
    file_name: str
    tensors: list[OutputTensor]
    header: bytes
    data_offsets: dict[str, int]
    size: int


def _layout_shards(tensors: Sequence[OutputTensor], max_shard_bytes: int) -> list[list[OutputTensor]]:
    shards: list[list[OutputTensor]] = [[]]
    current = 0
    for tensor in tensors:
        if shards[-1] and current + tensor.nbytes > max_shard_bytes:
            shards.append([])
            current = 0
        shards[-1].append(tensor)
        current += tensor.nbytes
    return shards


def _build_header(tensors: Sequence[OutputTensor], metadata: dict[str, str]) -> tuple[bytes, dict[str, int], int]:
    entries: dict[str, dict] = {"__metadata__": dict(metadata)}
    offsets: dict[str, int] = {}
    position = 0
    for tensor in tensors:
        entries[tensor.name] = {
            "dtype": dtype_to_safetensors(tensor.dtype),
            "shape": list(tensor.shape),
            "data_offsets": [position, position + tensor.nbytes],
        }
        offsets[tensor.name] = position
        position += tensor.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    header += b" " * (-len(header) % 8)  # data starts 8-byte aligned, as the reference writer does
    return header, offsets, position


class _ShardedWriter:
    """Pre-sized output shards with their headers written; `write` puts a piece's bytes in place."""

    MAX_OPEN_FILES = 16

    def __init__(self, directory: Path, tensors: Sequence[OutputTensor], max_shard_bytes: int,
                 metadata: dict[str, str] | None = None):
        if sys.byteorder != "little":
            raise RuntimeError("safetensors is little-endian; this writer only runs on little-endian hosts")
        self.directory = directory
        groups = _layout_shards(tensors, max_shard_bytes)
        metadata = {"format": "pt", **(metadata or {})}
        self.shards: list[_ShardLayout] = []
        for i, group in enumerate(groups):
            name = SAFE_WEIGHTS_NAME if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            header, offsets, data_size = _build_header(group, metadata)
            self.shards.append(_ShardLayout(name, list(group), header, offsets, 8 + len(header) + data_size))
        self._location: dict[str, tuple[_ShardLayout, int]] = {}
        for shard in self.shards:
            for tensor in shard.tensors:
                self._location[tensor.name] = (shard, 8 + len(shard.header) + shard.data_offsets[tensor.name])
        self._files: OrderedDict[str, object] = OrderedDict()
        for shard in self.shards:
            with open(directory / shard.file_name, "wb") as f:
                f.write(struct.pack("<Q", len(shard.header)))
                f.write(shard.header)
                f.truncate(shard.size)

    def _file(self, shard: _ShardLayout):
        handle = self._files.pop(shard.file_name, None)
        if handle is None:
            if len(self._files) >= self.MAX_OPEN_FILES:
                _, oldest = self._files.popitem(last=False)
                oldest.close()
            handle = open(self.directory / shard.file_name, "r+b")
        self._files[shard.file_name] = handle
        return handle

    def write(self, tensor: OutputTensor, piece: Piece, value: torch.Tensor) -> None:
        shard, base = self._location[tensor.name]
        value = value.detach().to("cpu").contiguous()
        raw = value.reshape(-1).view(torch.uint8) if value.numel() else value.new_empty(0, dtype=torch.uint8)
        handle = self._file(shard)
        handle.seek(base + piece.dst_offset * value.element_size())
        handle.write(memoryview(raw.numpy()))

    def close(self) -> None:
        while self._files:
            _, handle = self._files.popitem()
            handle.close()

    def write_index(self, total_size: int) -> None:
        if len(self.shards) == 1:
            return
        weight_map = {t.name: shard.file_name for shard in self.shards for t in shard.tensors}
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        with open(self.directory / SAFE_WEIGHTS_INDEX_NAME, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.write("\n")


def _describe_sources(piece: Piece) -> str:
    return " + ".join(info.where() for info in piece.sources)


def execute_plan(plan: Sequence[OutputTensor], directory: str | os.PathLike, max_shard_size: int | str = "5GB",
                 progress: bool = True, metadata: dict[str, str] | None = None, desc: str = "Converting",
                 file_order: Sequence[Path] | None = None) -> list[str]:
    """Writes ``plan`` as sharded safetensors (plus an index when there are several shards) into the
    existing ``directory``; returns the shard file names. Input shards are visited one at a time, in
    ``file_order`` (default: by name)."""
    from tqdm.auto import tqdm

    directory = Path(directory)
    for tensor in plan:
        problem = check_coverage(tensor)
        if problem:
            raise CheckpointError(f"output tensor `{tensor.name}`: {problem}")
    writer = _ShardedWriter(directory, plan, parse_size(max_shard_size), metadata)

    # group pieces by the shard of their first source, keeping the input order inside a shard
    by_file: dict[Path, list[tuple[OutputTensor, Piece]]] = defaultdict(list)
    for tensor in plan:
        for piece in tensor.pieces:
            by_file[piece.sources[0].file].append((tensor, piece))
    order = [path for path in (file_order or sorted(by_file)) if path in by_file]
    order += [path for path in by_file if path not in order]
    total_bytes = sum(t.nbytes for t in plan)
    reader = _Reader()
    try:
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
            for path in order:
                reader.open_main(path)
                items = sorted(by_file[path], key=lambda item: item[1].sources[0].offset)
                for tensor, piece in items:
                    inputs = [reader.read(piece.sources[0], piece.select)]
                    rest = piece.selects_rest or (None,) * (len(piece.sources) - 1)
                    inputs += [reader.read(info, select) for info, select in zip(piece.sources[1:], rest, strict=True)]
                    try:
                        value = piece.fn(inputs) if piece.fn is not None else inputs[0]
                    except CheckpointError:
                        raise
                    except Exception as error:
                        raise CheckpointError(f"{_describe_sources(piece)}: {error}") from error
                    if tuple(value.shape) != tuple(piece.expect_shape):
                        raise CheckpointError(
                            f"{_describe_sources(piece)}: produced shape {list(value.shape)} for `{tensor.name}`, "
                            f"expected {list(piece.expect_shape)}"
                        )
                    writer.write(tensor, piece, value.to(tensor.dtype))
                    del inputs, value
                    bar.update(piece.numel * element_size(tensor.dtype))
                reader.close()
                if _TEST_SLEEP_AFTER_SHARD:  # tests only: a conversion slow enough to be killed mid-write
                    import time

                    time.sleep(float(_TEST_SLEEP_AFTER_SHARD))
    finally:
        reader.close()
        writer.close()
    writer.write_index(total_bytes)
    return [shard.file_name for shard in writer.shards]


# --------------------------------------------------------------------------------------------------
_TMP_TAG = ".tmp-k3-"    # .<output>.tmp-k3-<pid>: the directory being written
_OLD_TAG = ".old-k3-"    # .<output>.old-k3-<pid>: the previous output while --overwrite swaps it out
_LOCK_TAG = ".k3lock-"   # .<output>.k3lock-<pid>: locked (flock) by the converter for as long as it runs
_WRITER_TAG = ".k3writer"  # .<output>.k3writer: locked (flock) by the one converter writing <output>
_LEGACY_TMP = re.compile(r"\.tmp-(\d+)")  # .<output>.tmp-<pid> of earlier versions (no lock)


def _try_lock(path: Path):
    """An open file holding an exclusive ``flock`` on ``path``, or None if another process holds it. Without
    ``fcntl`` (Windows) the lock is the pid in the name: None while that process is alive."""
    if fcntl is None:  # pragma: no cover - non-POSIX
        pid = int(path.name.rsplit("-", 1)[-1])
        return None if pid != os.getpid() and pid_alive(pid) else open(path, "a+b")
    return try_flock(path)


def clean_stale_outputs(output: str | os.PathLike) -> list[Path]:
    """Removes what converters killed while writing ``output`` left next to it (SIGKILL, power loss: no
    ``finally`` runs): their temporary directories, and a previous output they had moved aside while
    swapping in the new one (put back if the new one never arrived). A directory belongs to a running
    converter as long as that converter holds the lock file named with its pid; those are left alone.
    Returns the paths removed or restored."""
    output = Path(output).absolute()
    parent, stem = output.parent, f".{output.name}"
    if not parent.is_dir():
        return []
    handled: list[Path] = []
    for entry in sorted(parent.iterdir()):
        name = entry.name
        if not name.startswith(stem):
            continue
        rest = name[len(stem):]
        legacy = _LEGACY_TMP.fullmatch(rest)
        if legacy:  # an earlier version's temporary directory: its pid is all there is to go by
            if entry.is_dir() and not entry.is_symlink() and not pid_alive(int(legacy.group(1))):
                shutil.rmtree(entry, ignore_errors=True)
                handled.append(entry)
            continue
        for tag in (_TMP_TAG, _OLD_TAG):
            if rest.startswith(tag) and rest[len(tag):].isdigit() and entry.is_dir() and not entry.is_symlink():
                lock = parent / f"{stem}{_LOCK_TAG}{rest[len(tag):]}"
                handle = _try_lock(lock)
                if handle is None:
                    break  # its converter is still running
                try:
                    if tag == _OLD_TAG and not output.exists():
                        os.rename(entry, output)  # killed mid-swap: the previous output comes back
                    else:
                        shutil.rmtree(entry, ignore_errors=True)
                    handled.append(entry)
                finally:
                    handle.close()
                break
    for entry in sorted(parent.glob(f"{stem}{_LOCK_TAG}*")):
        pid = entry.name.rsplit("-", 1)[-1]
        if any((parent / f"{stem}{tag}{pid}").exists() for tag in (_TMP_TAG, _OLD_TAG)):
            continue
        handle = _try_lock(entry)
        if handle is not None:
            with contextlib.suppress(OSError):
                entry.unlink()
            handle.close()
    return handled


class _TerminateToException:
    """While converting in the main thread, SIGTERM (``kill``, a job scheduler's timeout) and SIGHUP (the terminal
    or ssh session closed) raise `SystemExit` so that the temporary output is removed (SIGINT raises
    `KeyboardInterrupt` already); a signal someone set to be ignored (``nohup``) stays ignored. SIGKILL cannot be
    caught, and what it leaves is removed by the next run (`clean_stale_outputs`)."""

    SIGNALS = ("SIGTERM", "SIGHUP")

    def __enter__(self):
        import signal
        import threading

        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            def handler(signum, frame):
                raise SystemExit(128 + signum)

            for name in self.SIGNALS:
                signum = getattr(signal, name, None)  # (no SIGHUP on Windows)
                if signum is not None and signal.getsignal(signum) is signal.SIG_DFL:
                    self._previous[signum] = signal.signal(signum, handler)
        return self

    def __exit__(self, *exc):
        import signal

        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        return False


@contextlib.contextmanager
def atomic_output_dir(output: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yields a fresh temporary directory next to ``output`` (``.<output>.tmp-k3-<pid>``); renames it to
    ``output`` only when the body finishes, and removes it on any error or SIGTERM, so a failed conversion
    leaves nothing half-written. The converter holds a lock (``.<output>.k3lock-<pid>``) while it runs;
    what a killed one left (SIGKILL) is removed by the next run into the same output before it writes."""
    output = Path(output).absolute()
    output.parent.mkdir(parents=True, exist_ok=True)
    writer = _lock_output(output)
    try:
        clean_stale_outputs(output)
        if output.exists() and not overwrite:
            raise CheckpointError(f"{output}: output directory already exists (pass --overwrite to replace it)")
        yield from _write_output(output, overwrite)
    finally:
        _unlock_output(output, writer)


def _lock_output(output: Path):
    """The lock that makes one converter at a time write ``output`` (two would each convert for hours and the
    second would replace the first's result); None without ``fcntl``."""
    if fcntl is None:  # pragma: no cover - non-POSIX: the per-pid locks and the final checks remain
        return None
    path = output.parent / f".{output.name}{_WRITER_TAG}"
    while True:
        handle = try_flock(path)
        if handle is None:
            raise CheckpointError(f"{output}: another conversion is writing this output right now (it holds "
                                  f"{path.name}); wait for it to finish, or write to another output directory") from None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(handle.fileno()), current):
            return handle
        handle.close()  # the previous holder removed the file as it finished: lock the new one


def _unlock_output(output: Path, handle) -> None:
    if handle is None:  # pragma: no cover
        return
    with contextlib.suppress(OSError):
        (output.parent / f".{output.name}{_WRITER_TAG}").unlink()
    handle.close()


def _write_output(output: Path, overwrite: bool) -> Iterator[Path]:
    pid = os.getpid()
    stem = f".{output.name}"
    lock_path = output.parent / f"{stem}{_LOCK_TAG}{pid}"
    lock = _try_lock(lock_path)
    if lock is None:  # pragma: no cover - another live process with our pid cannot exist
        raise CheckpointError(f"{lock_path}: locked by another process")
    temporary = output.parent / f"{stem}{_TMP_TAG}{pid}"
    previous = output.parent / f"{stem}{_OLD_TAG}{pid}"
    try:
        with _TerminateToException():
            if temporary.exists():
                shutil.rmtree(temporary)
            temporary.mkdir()
            try:
                yield temporary
            except BaseException as error:
                shutil.rmtree(temporary, ignore_errors=True)
                if isinstance(error, OSError):  # a full disk (ENOSPC), a file-size limit (EFBIG), an I/O error
                    raise CheckpointError(
                        f"{output}: stopped by an operating-system error ({error}); nothing was written and the "
                        "temporary output was removed. If the disk is full, free space (or write to another "
                        "filesystem) and run again") from error
                raise
            if output.exists() and not overwrite:  # made meanwhile by something that is not a converter
                shutil.rmtree(temporary, ignore_errors=True)
                raise CheckpointError(f"{output}: appeared while this conversion ran; it is left as it is and "
                                      "nothing was written (pass --overwrite to replace it)")
            if output.exists():
                os.rename(output, previous)
                os.rename(temporary, output)
                shutil.rmtree(previous, ignore_errors=True)
            else:
                os.rename(temporary, output)
    finally:
        with contextlib.suppress(OSError):
            lock_path.unlink()
        lock.close()


_SAVE_TAG = ".k3-save-"  # <directory>/.k3-save-<pid>.<random>: a save_pretrained being written
_SHARD = re.compile(r"(.+?)(-\d{5}-of-\d{5})?\.(safetensors|bin)")


@contextlib.contextmanager
def staged_save(directory: str | os.PathLike) -> Iterator[Path]:
    """For ``save_pretrained``: yields a fresh staging directory inside ``directory`` (same filesystem) that the
    whole save is written into; only once it is complete are its files renamed over ``directory``'s, and a shard of
    an earlier save that this one did not rewrite is removed (what transformers does in place). On any error (a
    full disk, a file-size limit, SIGTERM or SIGHUP) nothing in ``directory`` has changed: the staging directory is
    removed, and so is ``directory`` if this call created it. What a killed save left is removed by the next one."""
    import tempfile

    directory = Path(directory)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    for entry in directory.glob(f"{_SAVE_TAG}*"):  # left by a killed save (its pid is gone)
        pid = entry.name[len(_SAVE_TAG):].split(".", 1)[0]
        if entry.is_dir() and not entry.is_symlink() and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{_SAVE_TAG}{os.getpid()}.", dir=directory))
    try:
        with _TerminateToException():
            yield staging
            written = {entry.name for entry in staging.iterdir()}
            prefixes = {match.group(1) for match in map(_SHARD.fullmatch, written) if match}
            replaced = [entry for entry in directory.iterdir() if entry.name not in written and entry.is_file()
                        and (match := _SHARD.fullmatch(entry.name)) and match.group(2) and match.group(1) in prefixes]
            for name in sorted(written):
                target = directory / name
                if (staging / name).is_dir() and target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                os.replace(staging / name, target)
            for entry in replaced:
                entry.unlink(missing_ok=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    shutil.rmtree(staging, ignore_errors=True)


def _file_mappings() -> list[tuple[int, int]]:
    """``(start, end)`` of this process's file-backed memory mappings (``/proc/self/maps``; empty elsewhere)."""
    ranges = []
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                start, end = fields[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def _file_pages_only(pagemap: int, first: int, last: int, page: int) -> bool:
    """Whether no page of ``[first, last)`` holds data of its own: each is absent or still the file's page
    (``/proc/self/pagemap``: bit 63 present, 62 swapped, 61 file page). A page written since mapping (private
    copy) or swapped would be lost by ``MADV_DONTNEED``."""
    entries = os.pread(pagemap, (last - first) // page * 8, first // page * 8)
    flags = torch.frombuffer(bytearray(entries), dtype=torch.int64)
    present, swapped, file_page = flags < 0, (flags >> 62) & 1 == 1, (flags >> 61) & 1 == 1
    return not bool((swapped | (present & ~file_page)).any())


def mapped_page_releaser() -> Callable[[torch.Tensor], None]:
    """``release(tensor)``: takes out of this process's resident set the pages of a memory-mapped checkpoint file
    that lie wholly inside ``tensor``'s bytes, once a loader has copied those bytes elsewhere
    (`StackPackedExperts`). A page a file mapping has touched counts in the resident set until the mapping
    closes, which for transformers' loader is the end of loading. ``madvise(MADV_DONTNEED)`` unmaps them; they
    stay in the page cache, and a later read maps them again from the file. Only pages that are still the file's
    are released (`_file_pages_only`); a tensor outside the file mappings seen when the releaser was made (a
    state dict in memory) is left alone; where the calls are not available (not Linux) nothing happens."""
    madvise = _madvise()
    mappings = _file_mappings() if madvise is not None else []
    page = mmap.PAGESIZE

    def release(tensor: torch.Tensor) -> None:
        if not mappings or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        first, last = -(-start // page) * page, end // page * page
        if last <= first or not any(low <= start and end <= high for low, high in mappings):
            return
        try:
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
        except OSError:
            return
        try:
            if _file_pages_only(pagemap, first, last, page):
                madvise(first, last - first, mmap.MADV_DONTNEED)
        finally:
            os.close(pagemap)

    return release


def write_state_dict(state_dict: dict[str, torch.Tensor], directory: str | os.PathLike,
                     max_shard_size: int | str = "5GB", metadata: dict[str, str] | None = None) -> list[str]:
    """Small helper for in-memory state dicts (fixtures, tests): sharded safetensors plus an index, in the
    same layout `execute_plan` writes. Tensors are written in insertion order."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = [OutputTensor(name, t.dtype, tuple(t.shape)) for name, t in state_dict.items()]
    writer = _ShardedWriter(directory, tensors, parse_size(max_shard_size), metadata)
    try:
        for tensor in tensors:
            value = state_dict[tensor.name]
            writer.write(tensor, Piece((), tuple(value.shape)), value)
    finally:
        writer.close()
    writer.write_index(sum(t.nbytes for t in tensors))
    return [shard.file_name for shard in writer.shards]


__all__ = [
    "Checkpoint",
    "OutputTensor",
    "Piece",
    "atomic_output_dir",
    "check_coverage",
    "clean_stale_outputs",
    "execute_plan",
    "parse_size",
    "non_float_problem",
    "mapped_page_releaser",
    "resolve_inside",
    "scan_shards",
    "staged_save",
    "write_state_dict",
]


def run_for_cli(convert):
    """``(convert(), 0)`` for a converter's command line, or ``(None, 2)`` after one ``error:`` line on stderr: a
    refused checkpoint or config, an OS error outside the output (reading the input, the output's parent, a full
    disk) or running out of memory."""
    import sys

    from ..configuration_kimi_k3 import KimiK3ConfigError

    try:
        return convert(), 0
    except (CheckpointError, KimiK3ConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
    except MemoryError:
        print("error: out of memory", file=sys.stderr)
    return None, 2
