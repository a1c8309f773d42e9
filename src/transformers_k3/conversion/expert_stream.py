"""The routed experts of an MXFP4 checkpoint read from its files when a token routes to them (issue 46, docs/mxfp4.md
"Streaming the experts from disk"): a model larger than RAM keeps everything else resident and reads, per MoE
layer and step, only the bytes of the experts its tokens chose.

`ExpertStream` holds a byte-range table built from the shards' safetensors headers (each expert's ``w1`` / ``w3``
/ ``w2`` ``weight_packed`` and ``weight_scale``, where they lie in which file) and one reusable set of staging
stacks sized for ``per_read`` experts. `ExpertStream.read` ``pread``s the chosen experts' bytes straight into the
staging stacks, in the packed layout `ops.mxfp4` computes on (``gate_up_packed`` rows ``w1`` then ``w3``, …), so
the stacks are the bytes as they ship and the resident set holds at most ``per_read`` experts of one layer
whatever the checkpoint's size. The files are read, not memory-mapped: the bytes pass through the page cache, which
the kernel reclaims under pressure, and never count as the process's own (mapped pages would, until unmapped).
The stream counts what it reads (`ExpertStream.bytes_read`, `ExpertStream.tokens`, `bytes_per_token`).
"""

from __future__ import annotations

import math
import os
import struct
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ..safetensors_header import CheckpointError, read_safetensors_header
from .keymap import canonical_text_name, parse_expert_name
from .quant import E2M1_VALUES, E8M0_BIAS, QuantFormatError, check_mxfp4_values

__all__ = ["ExpertStream", "StreamedLayer"]

# The staging slices one expert fills, in read order: (stack, projection, tensor kind, rows slice of the stack)
_PARTS = (("gate_up_packed", "w1", "weight_packed", 0), ("gate_up_packed", "w3", "weight_packed", 1),
          ("gate_up_scale", "w1", "weight_scale", 0), ("gate_up_scale", "w3", "weight_scale", 1),
          ("down_packed", "w2", "weight_packed", None), ("down_scale", "w2", "weight_scale", None))  # fmt: skip
_STACKS = ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale")


@dataclass(frozen=True, eq=False)
class StreamedLayer:
    """One MoE layer's routed experts in the checkpoint: ``spans[e, p]`` holds ``(file index, absolute byte offset,
    byte count)`` of expert ``e``'s `_PARTS` entry ``p`` (one int64 table, not a Python tuple per tensor: the
    release has half a million expert tensors)."""

    experts: int
    hidden: int
    intermediate: int
    spans: torch.Tensor  # int64 [experts, len(_PARTS), 3]

    def stack_shapes(self, count: int) -> dict[str, tuple[int, int, int]]:
        d, i = self.hidden, self.intermediate
        return {"gate_up_packed": (count, 2 * i, d // 2), "gate_up_scale": (count, 2 * i, d // 32),
                "down_packed": (count, d, i // 2), "down_scale": (count, d, i // 32)}  # fmt: skip

    @property
    def expert_bytes(self) -> int:
        return int(self.spans[0, :, 2].sum())


def _data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _expected_shape(proj: str, kind: str, hidden: int, inter: int) -> tuple[int, int]:
    rows, k = (inter, hidden) if proj in ("w1", "w3") else (hidden, inter)
    return (rows, k // 2) if kind == "weight_packed" else (rows, k // 32)


def _overflow_scale(dtype: torch.dtype) -> int:
    """The smallest E8M0 scale that can make a weight infinite in ``dtype`` (the largest E2M1 magnitude is 6), or
    255 (E8M0's NaN) where none can."""
    return min(255, E8M0_BIAS + math.floor(math.log2(torch.finfo(dtype).max / max(E2M1_VALUES))) + 1)


class ExpertStream:
    """Reads routed experts of an MXFP4 checkpoint on demand (module docstring). ``layers``: a key per MoE layer
    (the experts module's name) -> `StreamedLayer`; ``files``: the shards the spans index; ``per_read``: the most
    experts one `read` returns (the staging stacks' size)."""

    def __init__(self, layers: dict[str, StreamedLayer], files: list[Path], per_read: int):
        if not isinstance(per_read, int) or isinstance(per_read, bool) or per_read < 1:
            raise ValueError(f"ExpertStream: per_read must be a positive integer, got {per_read!r}")
        self.layers, self.files, self.per_read = layers, list(files), per_read
        self._fds = [os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0)) for path in self.files]
        self._closer = weakref.finalize(self, _close_all, list(self._fds))
        self._lock = threading.Lock()
        self._staging: dict[str, torch.Tensor] = {}
        self._first_layer = next(iter(layers), None)
        self.reset()

    # ----- what it read -----
    def reset(self) -> None:
        """Sets the counters to zero."""
        self.bytes_read = 0  # expert bytes read from the files since the last reset
        self.experts_read = 0  # (layer, expert) reads
        self.tokens = 0  # token rows through the first streamed layer

    @property
    def bytes_per_token(self) -> float:
        """Expert bytes read per token since the last reset (a decode step reads each layer's routed experts once;
        a prefill's tokens share the experts they route to)."""
        return self.bytes_read / self.tokens if self.tokens else 0.0

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging stacks (allocated at the first read, reused by every layer after)."""
        return sum(t.numel() for t in self._staging.values())

    @property
    def checkpoint_expert_bytes(self) -> int:
        """Bytes of every routed expert of every streamed layer in the checkpoint."""
        return sum(layer.experts * layer.expert_bytes for layer in self.layers.values())

    def count_tokens(self, layer: str, tokens: int) -> None:
        if layer == self._first_layer:
            self.tokens += tokens

    # ----- reading -----
    def read(self, layer: str, experts: list[int], dtype: torch.dtype, fresh: bool = False) -> tuple[torch.Tensor, ...]:
        """``(gate_up_packed, gate_up_scale, down_packed, down_scale)`` of ``experts`` (at most ``per_read``, in the
        given order) of ``layer``, stacked as `ops.mxfp4` lays them out, the bytes as the files hold them. The
        stacks are views of the reused staging buffers (overwritten by the next read) unless ``fresh``. Scales that
        make a weight NaN or infinite in ``dtype`` (the activations') raise `CheckpointError` naming the expert."""
        info = self.layers[layer]
        count = len(experts)
        if not 0 < count <= self.per_read:
            raise ValueError(f"ExpertStream.read: between 1 and {self.per_read} experts at a time, got {count}")
        shapes = info.stack_shapes(count)
        if fresh:
            stacks = {name: torch.empty(shape, dtype=torch.uint8) for name, shape in shapes.items()}
        else:
            stacks = {name: self._staging_view(name, shape, info) for name, shape in shapes.items()}
        with self._lock:
            for j, expert in enumerate(experts):
                if not 0 <= expert < info.experts:
                    raise IndexError(f"`{layer}`: expert {expert} outside [0, {info.experts})")
                for (stack, _, _, half), (file, offset, nbytes) in zip(_PARTS, info.spans[expert].tolist()):
                    target = stacks[stack][j]
                    if half is not None:
                        rows = target.shape[0] // 2
                        target = target[half * rows:(half + 1) * rows]
                    self._pread(file, offset, target, nbytes, layer, expert)
            self.bytes_read += count * info.expert_bytes
            self.experts_read += count
        self._check_values(layer, experts, stacks, dtype)
        return tuple(stacks[name] for name in _STACKS)

    def _staging_view(self, name: str, shape: tuple[int, ...], info: StreamedLayer) -> torch.Tensor:
        buffer = self._staging.get(name)
        needed = math.prod(shape)
        if buffer is None or buffer.numel() < needed:
            full = info.stack_shapes(min(self.per_read, max(x.experts for x in self.layers.values())))[name]
            buffer = self._staging[name] = torch.empty(max(math.prod(full), needed), dtype=torch.uint8)
        return buffer[:needed].view(shape)

    def _pread(self, file: int, offset: int, target: torch.Tensor, nbytes: int, layer: str, expert: int) -> None:
        view = memoryview(target.numpy()).cast("B")
        if len(view) != nbytes:
            raise CheckpointError(f"`{layer}`: expert {expert}: {nbytes} bytes in the file for a {len(view)}-byte slice")
        done = 0
        while done < nbytes:
            got = _preadv(self._fds[file], view[done:], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.files[file]}: ends before expert {expert} of `{layer}` (byte "
                                      f"{offset + done}): the file is truncated; re-download it")  # fmt: skip
            done += got

    def _check_values(self, layer, experts, stacks, dtype) -> None:
        limit = _overflow_scale(dtype if dtype.is_floating_point else torch.float32)
        for packed, scale, proj in (("gate_up_packed", "gate_up_scale", "w1/w3"), ("down_packed", "down_scale", "w2")):
            if int(stacks[scale].max()) < limit:
                continue  # (no scale that large: every weight is finite, none is NaN)
            for j, expert in enumerate(experts):
                try:
                    check_mxfp4_values(stacks[packed][j], stacks[scale][j], dtype)
                except QuantFormatError as error:
                    raise CheckpointError(f"`{layer}`: expert {expert} {proj}: {error}") from None

    def close(self) -> None:
        """Closes the files (a read after this fails)."""
        self._closer()

    # ----- building -----
    @classmethod
    def from_checkpoint(cls, files: list[str | os.PathLike], layers: dict[int, tuple[str, int, int, int]],
                        per_read: int) -> ExpertStream:  # fmt: skip
        """The stream of the MoE layers ``layers`` (layer index -> ``(key, experts, hidden, intermediate)``) over
        the checkpoint shards ``files``: every expert of every layer must be in them as the release stores it
        (``w1`` / ``w3`` / ``w2`` ``weight_packed`` uint8 ``[rows, cols / 2]`` and ``weight_scale`` ``[rows,
        cols / 32]`` or ``[rows, 1, cols / 32, 1]``), else `CheckpointError` names the first tensor missing or
        wrong. Only headers are read."""
        paths = [Path(f) for f in files]
        part_of = {(proj, kind): p for p, (_, proj, kind, _) in enumerate(_PARTS)}
        tables = {layer: torch.full((experts, len(_PARTS), 3), -1, dtype=torch.int64, device="cpu")
                  for layer, (_, experts, _, _) in layers.items()}  # (device: the loader builds under a meta default)
        filling = {layer: table.numpy() for layer, table in tables.items()}  # (element writes without a tensor each)
        for index, path in enumerate(paths):
            if path.suffix != ".safetensors":
                raise CheckpointError(f"{path}: streaming experts needs safetensors shards")
            start = _data_start(path)
            for name, tensor in read_safetensors_header(path).items():
                parsed = parse_expert_name(canonical_text_name(name))
                if parsed is None or parsed.layer not in layers:
                    continue
                key, experts, hidden, inter = layers[parsed.layer]
                if parsed.kind == "weight_shape":
                    continue  # (the packed shapes are checked instead)
                if parsed.kind not in ("weight_packed", "weight_scale"):
                    raise CheckpointError(f"{path}: `{name}`: the routed experts are not MXFP4 ({parsed.kind}); only "
                                          "MXFP4 experts stream: load without stream_experts")  # fmt: skip
                expected = _expected_shape(parsed.proj, parsed.kind, hidden, inter)
                shape = tensor.shape
                if parsed.kind == "weight_scale" and len(shape) == 4 and shape[1] == 1 and shape[3] == 1:
                    shape = (shape[0], shape[2])
                if tensor.dtype != torch.uint8 or tuple(shape) != expected or not 0 <= parsed.expert < experts:
                    raise CheckpointError(f"{path}: `{name}` is {str(tensor.dtype).replace('torch.', '')} "
                                          f"{list(tensor.shape)}; `{key}` ({experts} experts) needs uint8 "
                                          f"{list(expected)}")  # fmt: skip
                filling[parsed.layer][parsed.expert, part_of[parsed.proj, parsed.kind]] = (
                    index, start + tensor.offset, tensor.nbytes)
        streamed = {}
        for layer, (key, experts, hidden, inter) in sorted(layers.items()):
            missing = (tables[layer][:, :, 0] < 0).nonzero()
            if len(missing):
                expert, part = missing[0].tolist()
                _, proj, kind, _ = _PARTS[part]
                raise CheckpointError(f"the checkpoint has no `layers.{layer}` expert {expert} {proj}.{kind}, which "
                                      f"streaming `{key}` needs: it is incomplete or its experts are not MXFP4")
            streamed[key] = StreamedLayer(experts, hidden, inter, tables[layer])
        return cls(streamed, paths, per_read)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


if hasattr(os, "preadv"):
    def _preadv(fd: int, view: memoryview, offset: int) -> int:
        return os.preadv(fd, [view], offset)
else:  # (Windows: no positional reads; the stream's lock serialises the seek and the read)
    def _preadv(fd: int, view: memoryview, offset: int) -> int:
        os.lseek(fd, offset, os.SEEK_SET)
        data = os.read(fd, len(view))
        view[:len(data)] = data
        return len(data)
