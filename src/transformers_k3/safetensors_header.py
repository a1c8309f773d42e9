"""Reading a safetensors file's header safely: the dtype names, `TensorInfo`, `read_safetensors_header` and the
`CheckpointError` it raises.

It sits below the cache, the model and the converters, which all read safetensors headers; nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    _DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """The checkpoint cannot be converted; the message names the file and tensor concerned."""


def dtype_from_safetensors(name: str, file: str | os.PathLike = "?", tensor: str = "?") -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointError(f"{file}: tensor `{tensor}` has dtype {name!r}, which this converter does not handle") from None


def dtype_to_safetensors(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize  # (no tensor made: this runs for every tensor of every header checked)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of an input checkpoint, known from its file header only."""

    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0  # byte offset of the data in the file (reads in this order are sequential)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(self.dtype)

    def where(self) -> str:
        return f"{self.file.name}: tensor `{self.name}`"


def _looks_like_pickle(head: bytes) -> bool:
    # torch.save zip archives start with a local-file header; legacy pickles with the PROTO opcode + version.
    return head.startswith(b"PK\x03\x04") or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parses and validates a safetensors header without reading tensor data or unpickling anything:
    the file must be safetensors (a pickle is reported as such), its header valid JSON, and every tensor's
    byte range must lie inside the file (a truncated download names the first tensor it cuts)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: shard file is missing")
    accepted, refusal = _header_as_safetensors_reads_it(path)
    if accepted is not None:
        return accepted
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(9)
        header_len = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else None
        if header_len is not None and header_len > _MAX_HEADER_BYTES and head[8:9] == b"{":
            raise CheckpointError(f"{path}: safetensors header of {header_len} bytes is over safetensors' own limit "
                                  f"({_MAX_HEADER_BYTES} bytes); not a file safetensors would read")
        plausible = header_len is not None and header_len <= size - 8 and head[8:9] == b"{"
        if not plausible:
            if _looks_like_pickle(head):
                raise CheckpointError(
                    f"{path}: this is a pickle-format (torch.save) file, not safetensors; it is never unpickled "
                    "here. Convert it to safetensors with a tool you trust first."
                )
            if header_len is not None and header_len > size - 8:
                raise CheckpointError(
                    f"{path}: file is truncated or not safetensors (header claims {header_len} bytes, file has {size})"
                )
            raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, no JSON header)")
        f.seek(8)
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{path}: corrupt safetensors header ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_size = size - 8 - header_len
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and
                                     all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise CheckpointError(f"{path}: the header's __metadata__ must map strings to strings (safetensors' rule)")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, raw_shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not (isinstance(dtype_name, str) and isinstance(raw_shape, list) and isinstance(offsets, list)
                    and len(offsets) == 2 and all(_is_count(x) for x in raw_shape + offsets)):
                raise TypeError
            shape, (begin, end) = tuple(raw_shape), offsets
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor `{name}` has a malformed header entry {entry!r:.200} (dtype a "
                                  "string, shape and data_offsets lists of non-negative integers)") from None
        dtype = dtype_from_safetensors(dtype_name, path, name)
        info = TensorInfo(path, name, dtype, shape, int(begin))
        if end - begin != info.nbytes:
            raise CheckpointError(f"{path}: tensor `{name}` header is inconsistent ({end - begin} bytes for {dtype_name}{list(shape)})")
        if end > data_size:
            raise CheckpointError(
                f"{path}: file is truncated: tensor `{name}` needs bytes up to {8 + header_len + end}, "
                f"the file has {size}"
            )
        tensors[name] = info
    _check_data_layout(path, header, data_size)
    raise CheckpointError(f"{path}: safetensors refuses this file ({refusal}); the file is corrupt or not "
                          "safetensors: re-download or re-export it")


def _header_as_safetensors_reads_it(path: Path) -> tuple[dict[str, TensorInfo] | None, str]:
    """The header through safetensors' own parser (Rust: the JSON, the dtypes, and byte ranges that tile the data
    section exactly, much faster than parsing it here), or None and why when it refuses the file or a dtype is not
    one we map: the checks in `read_safetensors_header` then name what is wrong."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            tensors: dict[str, TensorInfo] = {}
            offset = 0
            for name in f.offset_keys():
                view = f.get_slice(name)
                dtype = _DTYPES.get(view.get_dtype())
                if dtype is None:
                    return None, "a dtype this reader does not map"
                shape = tuple(view.get_shape())
                tensors[name] = TensorInfo(path, name, dtype, shape, offset)
                offset += math.prod(shape) * dtype.itemsize
            return tensors, ""
    except Exception as error:  # (safetensors' errors have no common base class)
        return None, f"{type(error).__name__}: {error}"


def _check_data_layout(path: Path, header: dict, data_size: int) -> None:
    """safetensors' own rule, checked here so that it is reported by name before anything is read: the
    tensors' byte ranges tile the data section exactly, each byte belonging to one tensor (two tensors
    sharing bytes would alias each other; ``safe_open`` refuses such files too)."""
    spans = sorted((int(entry["data_offsets"][0]), int(entry["data_offsets"][1]), name)
                   for name, entry in header.items() if name != "__metadata__")
    position, previous = 0, None
    for begin, end, name in spans:
        if begin < 0 or end < begin:
            raise CheckpointError(f"{path}: tensor `{name}` has invalid data offsets [{begin}, {end}]; the file is "
                                  "corrupt: re-download or re-export it")
        if begin < position:
            raise CheckpointError(
                f"{path}: tensor `{name}` (bytes [{begin}, {end})) overlaps tensor `{previous}` (bytes up to "
                f"{position}): aliased data offsets in the safetensors header; the file is corrupt or crafted: "
                "re-download or re-export it")
        if begin > position:
            raise CheckpointError(
                f"{path}: bytes [{position}, {begin}) before tensor `{name}` belong to no tensor (a gap in the "
                "safetensors header's data offsets); the file is corrupt: re-download or re-export it")
        position, previous = end, name
    if position != data_size:
        raise CheckpointError(
            f"{path}: {data_size - position} bytes after the last tensor belong to no tensor; the file is corrupt: "
            "re-download or re-export it")


__all__ = [
    "CheckpointError",
    "TensorInfo",
    "dtype_from_safetensors",
    "dtype_to_safetensors",
    "element_size",
    "read_safetensors_header",
]
