"""Packed-sequence layout for the PyTorch KDA paths: where each sequence's tokens sit, block by block, so the
sequential loops over chunks (or tokens) advance all sequences together without gathers."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

__all__ = ["Layout", "host_bounds", "needs_grad", "serial_if_small"]

# The sequential loops run on one thread while a step's state is smaller than this many elements
# (e.g. 4 heads of 64 x 64 = 16K). Such steps take microseconds and gain nothing from more threads,
# but every parallel region waits for all its threads, and on an oversubscribed machine a descheduled
# one costs a whole scheduler slice, far more than the step itself. At 32 heads of 128 x 128 (512K elements)
# two threads win.
_SERIAL_STEP_ELEMENTS = 1 << 18


def needs_grad(*values) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in values)


@contextlib.contextmanager
def serial_if_small(step_elements: int) -> Iterator[None]:
    """Run a sequential loop on one intra-op thread when its steps are small (see _SERIAL_STEP_ELEMENTS).
    Not under torch.compile: the thread switch is a Python side effect that would break the graph."""
    if torch.compiler.is_compiling():
        yield
        return
    threads = torch.get_num_threads()
    if threads == 1 or step_elements >= _SERIAL_STEP_ELEMENTS:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def host_bounds(cu_seqlens: torch.Tensor, length: int) -> list[int]:
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != length or any(b > e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T = {length}, got {bounds}")
    return bounds


class Layout:
    """Time-major, block-padded placement of the tokens of all sequences.

    Every sequence is cut into blocks of ``block`` tokens (the chunk size, or 1 for the token loop), its
    last block zero-padded. Sequences are ranked by block count, longest first, and block ``j`` of the
    sequence of rank ``r`` is stored at slot ``offsets[j] + r``. So at step ``j`` the sequences still
    running are exactly the first ``active[j]`` rows of the rank-ordered state batch and their blocks
    are one contiguous slice: the sequential loop needs no gathers, and no sequence is padded beyond a
    multiple of the block size (in particular not to the longest one). Zero padding is inert: a padded
    token has ``k = v = beta = 0`` and ``g = 0``, so it neither writes to nor decays the state.
    """

    def __init__(self, batch: int, length: int, bounds: list[int] | None, block: int, device: torch.device):
        self.batch, self.length, self.block = batch, length, block
        self.order = self.inverse = None
        # For packed sequences: row of each token in a [slots * block] buffer; None for a plain batch,
        # whose layout is a pad + permute.
        self.token_rows = None
        self._index_cache: dict[int, torch.Tensor] = {}
        if bounds is None:
            self.active = [batch] * (-(-length // block))
        else:
            lengths = torch.tensor([end - start for start, end in zip(bounds, bounds[1:])])
            n_seq = lengths.numel()
            blocks = (lengths + block - 1) // block
            order = torch.sort(blocks, descending=True, stable=True).indices
            steps = int(blocks.max())
            ended_by = torch.bincount(blocks, minlength=steps + 1).cumsum(0)  # sequences with <= j blocks
            self.active = (n_seq - ended_by[:steps]).tolist()
            if not torch.equal(order, torch.arange(n_seq)):
                self.order = order.to(device)
                self.inverse = torch.argsort(order).to(device)
            rank = torch.empty_like(order)
            rank[order] = torch.arange(n_seq)
            step_offsets = torch.tensor([0, *self.active]).cumsum(0)
            seq = torch.repeat_interleave(torch.arange(n_seq), lengths)
            pos = torch.arange(length) - torch.tensor(bounds[:-1], dtype=torch.long)[seq]
            slot = step_offsets[pos // block] + rank[seq]
            self.token_rows = (slot * block + pos % block).to(device)
        self.offsets = list(itertools.accumulate([0, *self.active[:-1]])) if self.active else []
        self.n_slots = sum(self.active)

    def _rows(self, heads: int) -> torch.Tensor:
        """Row of every (token, head) pair, token-major like the input, in a flat ``[slots, heads, block]``."""
        if heads not in self._index_cache:
            slot, pos = self.token_rows // self.block, self.token_rows % self.block
            head = torch.arange(heads, device=slot.device)
            self._index_cache[heads] = ((slot[:, None] * heads + head) * self.block + pos[:, None]).reshape(-1)
        return self._index_cache[heads]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H, D]`` -> ``[slots, H, block, D]``, zeros in the padding."""
        heads, dim = x.shape[2], x.shape[3]
        if self.token_rows is None:
            n_blocks = len(self.active)
            if n_blocks * self.block != self.length:
                x = F.pad(x, (0, 0, 0, 0, 0, n_blocks * self.block - self.length))
            x = x.reshape(self.batch, n_blocks, self.block, heads, dim).permute(1, 0, 3, 2, 4)
            return x.reshape(self.n_slots, heads, self.block, dim)
        flat = x.new_zeros(self.n_slots * heads * self.block, dim)
        flat = flat.index_copy(0, self._rows(heads), x.reshape(-1, dim))
        return flat.view(self.n_slots, heads, self.block, dim)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pack`, dropping the padding."""
        heads, dim = y.shape[1], y.shape[3]
        if self.token_rows is None:
            n_blocks = len(self.active)
            y = y.view(n_blocks, self.batch, heads, self.block, dim).permute(1, 0, 3, 2, 4)
            return y.reshape(self.batch, n_blocks * self.block, heads, dim)[:, : self.length].contiguous()
        rows = y.reshape(-1, dim).index_select(0, self._rows(heads))
        return rows.view(1, self.length, heads, dim)

    def chunk_source(self, x: torch.Tensor):
        """``[B, T, H, D]`` -> what :meth:`rows` reads blocks from. Packed sequences are packed whole (one
        gather); a plain batch is not copied at all: a permuted view of its whole blocks, plus the zero-padded
        last block when T is not a multiple of the block size."""
        if self.token_rows is not None:
            return self.pack(x)
        batch, block, heads, dim = self.batch, self.block, x.shape[2], x.shape[3]
        whole = self.length // block
        main = x[:, : whole * block].reshape(batch, whole, block, heads, dim).permute(1, 0, 3, 2, 4)
        if whole * block == self.length:
            return main, None
        tail = F.pad(x[:, whole * block :], (0, 0, 0, 0, 0, (whole + 1) * block - self.length))
        return main, tail.view(batch, 1, block, heads, dim).permute(1, 0, 3, 2, 4)

    def rows(self, source, start: int, stop: int) -> torch.Tensor:
        """Blocks of steps ``start .. stop - 1`` as ``[rows, block, D]``, in scan order (step, rank, head)."""
        if self.token_rows is not None:
            slots = source[self.offsets[start] : self.offsets[stop - 1] + self.active[stop - 1]]
            return slots.reshape(-1, self.block, source.shape[-1])
        main, tail = source
        parts = [main[start : min(stop, main.shape[0])]] if start < main.shape[0] else []
        if stop > main.shape[0]:
            parts.append(tail)
        blocks = parts[0] if len(parts) == 1 else torch.cat(parts)
        return blocks.reshape(-1, self.block, blocks.shape[-1])

    def new_output(self, like: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        """Buffer that :meth:`store` fills and :meth:`finish` turns into ``[B, T, H, dim]``."""
        if self.token_rows is not None:
            return like.new_empty(self.n_slots * heads * self.block, dim)
        return like.new_empty(self.batch, len(self.active) * self.block, heads, dim)

    def store(self, out: torch.Tensor, start: int, stop: int, y: torch.Tensor) -> None:
        """Write the ``[rows, block, dim]`` outputs of steps ``start .. stop - 1`` into ``out``."""
        dim = out.shape[-1]
        if self.token_rows is not None:
            heads = y.shape[0] // (self.offsets[stop - 1] + self.active[stop - 1] - self.offsets[start])
            first = self.offsets[start] * heads * self.block
            out[first : first + y.shape[0] * self.block].copy_(y.reshape(-1, dim))
            return
        heads = out.shape[2]
        steps = out.view(self.batch, len(self.active), self.block, heads, dim).permute(1, 0, 3, 2, 4)
        steps[start:stop].copy_(y.view(stop - start, self.batch, heads, self.block, dim))

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        if self.token_rows is not None:
            heads = out.shape[0] // (self.n_slots * self.block)
            return out.index_select(0, self._rows(heads)).view(1, self.length, heads, out.shape[-1])
        return out[:, : self.length].contiguous()

    def sort_states(self, state: torch.Tensor) -> torch.Tensor:
        return state if self.order is None else state.index_select(0, self.order)

    def unsort_states(self, state: torch.Tensor) -> torch.Tensor:
        return state if self.inverse is None else state.index_select(0, self.inverse)


