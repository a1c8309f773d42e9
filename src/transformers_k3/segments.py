"""Training on a trajectory one segment at a time, from the state the earlier segments left (issue 47).

A K3 text model's state across tokens is what `KimiK3HybridCache` holds: each KDA layer's recurrent state and conv
window, each MLA layer's latents (Block AttnRes mixes layers, never tokens). A segment's forward from that state,
``model(segment_ids, past_key_values=cache, ...)``, computes exactly what the full-context forward computes for those
tokens, so a trajectory's loss can be taken segment by segment:

* ``mode="truncated"``: the state entering a segment is a constant. Segments run in order, each forward and backward
  from the detached state the previous one left; only one segment's activations are alive at a time.
* ``mode="exact"``: the gradient of full-context backpropagation. A no-grad pass saves the state at every segment
  boundary (the KDA states and conv windows; the MLA latents of the whole trajectory, each boundary's being their
  prefix); then the segments are recomputed last to first, each from its saved state made a leaf, and backpropagated
  with its own loss plus the gradient the later segments sent to the state it left (the KDA states' and windows'
  gradients, the latents' gradients), which yields the gradient of the state it came from for the segment before.

Both take the labels of the whole trajectory and shift them once, as the full-context loss does (a segment's last
token predicts the next segment's first), and divide the summed token losses by the trajectory's label count, so
the loss and gradients are those of ``model(input_ids, labels=labels)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .cache import KimiK3CacheState, KimiK3HybridCache
from .generation_kimi_k3 import _position_problems, _raise_problems
from .modeling_kimi_k3 import packed_sequence_boundaries

__all__ = ["KimiK3SegmentError", "SegmentBoundary", "SegmentResult", "boundary_states", "cache_from_boundary",
           "detach_cache", "packed_sequences", "segment_backward", "segment_bounds"]

IGNORE_INDEX = -100
MODES = ("exact", "truncated")
# Each segment's forward is given its cache and passes use_cache=False: a given cache is filled either way, and True
# makes transformers warn under gradient checkpointing, a logging call torch.compile(fullgraph=True) cannot capture.
CACHE_GIVEN = {"use_cache": False}


class KimiK3SegmentError(ValueError):
    """Arguments a segment run cannot use (the message says what to pass instead)."""


@dataclass
class SegmentBoundary:
    """The state a segment starts from: ``start`` tokens consumed, each KDA layer's ``(recurrent state [B, H, K, V]
    fp32, conv window [B, 3P, K-1])`` by layer index (empty at the trajectory's start). The MLA latents are the
    trajectory's first ``start`` rows (`boundary_states` returns them once for all boundaries)."""

    start: int
    kda: dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SegmentResult:
    """``loss``: the trajectory's loss (the full-context ``model(input_ids, labels=labels).loss``), detached;
    ``segment_losses``: each segment's share of it (they sum to ``loss``); ``tokens``: the label count divided by."""

    loss: torch.Tensor
    segment_losses: list[torch.Tensor]
    tokens: int


def segment_bounds(length: int, segment_len: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the segments of a ``length``-token trajectory, ``segment_len`` tokens each, the last one
    possibly shorter."""
    if not isinstance(segment_len, int) or segment_len < 1:
        raise KimiK3SegmentError(f"segment_len must be a positive number of tokens, got {segment_len!r}")
    return [(start, min(start + segment_len, length)) for start in range(0, length, segment_len)]


# what transformers' DataCollatorWithFlattening adds to mark several sequences packed in one row
PACKING_KEYS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def packed_sequences(input_ids: torch.Tensor, kwargs: dict) -> list[list[tuple[int, int]]] | None:
    """Each row's sequences ``(start, end)`` when ``kwargs`` mark packed rows (``position_ids`` restarting at 0, or
    one row's ``cu_seq_lens_q`` / ``cu_seq_lens_k``, as DataCollatorWithFlattening makes them), else None. Takes the
    packing keys out of ``kwargs``; positions that do not say where sequences start raise `KimiK3InputError`."""
    given = {key: kwargs.pop(key) for key in PACKING_KEYS if kwargs.get(key) is not None}
    positions, cu = given.get("position_ids"), given.get("cu_seq_lens_q", given.get("cu_seq_lens_k"))
    if positions is None and cu is None:
        return None
    batch, length = input_ids.shape
    if cu is not None and batch != 1:
        raise KimiK3SegmentError(f"cu_seq_lens describe one packed row, got {batch} rows: pass position_ids per row")
    if positions is not None and (positions.dim() != 2 or positions.shape[0] not in (1, batch)):
        raise KimiK3SegmentError(f"position_ids must be [batch, tokens] for input_ids {tuple(input_ids.shape)}, got "
                                 f"{tuple(positions.shape)}")  # fmt: skip
    rows = []
    for row in range(batch):
        row_positions = None if positions is None else positions[min(row, positions.shape[0] - 1)][None]
        _raise_problems(_position_problems(row_positions, cu, length, packed=True))
        starts = packed_sequence_boundaries(row_positions, cu, None, None, 1)
        starts = [0, length] if starts is None else starts.tolist()
        rows.append(list(zip(starts[:-1], starts[1:])))
    return rows


def _check(model, input_ids: torch.Tensor, labels: torch.Tensor | None, mode: str, kwargs: dict) -> torch.Tensor:
    if mode not in MODES:
        raise KimiK3SegmentError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise KimiK3SegmentError("input_ids must be a [batch, tokens] tensor with at least one token")
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise KimiK3SegmentError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, got "
                                 f"{tuple(labels.shape)}")  # fmt: skip
    if getattr(model.config, "router_aux_loss_coef", 0):
        raise KimiK3SegmentError("the router's auxiliary loss is a mean over one call's tokens, not a sum over the "
                                 "trajectory: set config.router_aux_loss_coef = 0 (K3 balances with the selection "
                                 "bias, QuantileBalancingCallback)")  # fmt: skip
    return labels


def boundary_states(model, input_ids: torch.Tensor, segment_len: int):
    """Run the trajectory segment by segment without gradients; return ``(boundaries, latents)``: the state each
    segment starts from (`SegmentBoundary`) and each MLA layer's latents of the whole trajectory ``[B, T, D]``."""
    bounds = segment_bounds(input_ids.shape[1], segment_len)
    cache = KimiK3HybridCache(model.config, max_cache_len=input_ids.shape[1])
    boundaries = []
    with torch.no_grad():
        for start, end in bounds:
            boundaries.append(SegmentBoundary(start, cache.state(detached=True).kda))
            model(input_ids=input_ids[:, start:end], past_key_values=cache, logits_to_keep=1, **CACHE_GIVEN)
    return boundaries, cache.state(detached=True).latents


def cache_from_boundary(config, boundary: SegmentBoundary, latents: dict[int, torch.Tensor], capacity: int, leaves: bool):
    """A cache holding ``boundary`` and the latents' first ``boundary.start`` rows; with ``leaves`` each of those
    is a leaf requiring grad, returned as ``{("kda", i): (state, window), ("mla", i): prefix}``."""
    cache = KimiK3HybridCache(config, max_cache_len=capacity)
    state = KimiK3CacheState(dict(boundary.kda), {i: latent[:, : boundary.start] for i, latent in latents.items()}
                             if boundary.start else {})  # fmt: skip
    held = {}
    if leaves:
        state = KimiK3CacheState({i: tuple(x.detach().requires_grad_() for x in pair) for i, pair in state.kda.items()},
                                 {i: prefix.detach().requires_grad_() for i, prefix in state.latents.items()})
        held = {**{("kda", i): pair for i, pair in state.kda.items()},
                **{("mla", i): prefix for i, prefix in state.latents.items()}}  # fmt: skip
    cache.start_from(state)
    return cache, held


def _run(model, input_ids, shift_labels, tokens, start, end, cache, kwargs):
    output = model(input_ids=input_ids[:, start:end], past_key_values=cache, labels=input_ids[:, start:end],
                   shift_labels=shift_labels[:, start:end].contiguous(), num_items_in_batch=tokens,
                   **{**CACHE_GIVEN, **kwargs})  # fmt: skip
    return output.loss


def _packed_backward(model, input_ids, shift_labels, rows, tokens: int, segment_len: int, mode: str,
                     kwargs: dict) -> SegmentResult:
    """`segment_backward` of packed rows: every sequence is a trajectory of its own (its state starts empty), trained
    in segments of ``segment_len`` from its own start; consecutive sequences no longer than a segment in all run
    together as one packed row without a cache (one segment, no state: exact and truncated are the same)."""
    losses = []

    def group(row: int, pieces: list[tuple[int, int]]):
        start, end = pieces[0][0], pieces[-1][1]
        targets = shift_labels[row : row + 1, start:end]
        if bool((targets != IGNORE_INDEX).any()):
            positions = torch.cat([torch.arange(b - a) for a, b in pieces])[None].to(input_ids.device)
            loss = model(input_ids=input_ids[row : row + 1, start:end], position_ids=positions,
                         labels=input_ids[row : row + 1, start:end], shift_labels=targets.contiguous(),
                         num_items_in_batch=tokens, **{**CACHE_GIVEN, **kwargs}).loss  # fmt: skip
            loss.backward()
            losses.append(loss.detach())

    for row, sequences in enumerate(rows):
        short: list[tuple[int, int]] = []
        for start, end in sequences:
            if end - start > segment_len:
                if short:
                    group(row, short)
                    short = []
                if bool((shift_labels[row, start:end] != IGNORE_INDEX).any()):
                    losses += segment_backward(model, input_ids[row : row + 1, start:end], segment_len=segment_len,
                                               mode=mode, num_items_in_batch=tokens,
                                               shift_labels=shift_labels[row : row + 1, start:end], **kwargs
                                               ).segment_losses  # fmt: skip
                continue
            if short and end - short[0][0] > segment_len:
                group(row, short)
                short = []
            short.append((start, end))
        if short:
            group(row, short)
    return SegmentResult(sum(losses), losses, tokens)


def segment_backward(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, segment_len: int,
                     mode: str = "exact", num_items_in_batch: int | torch.Tensor | None = None,
                     shift_labels: torch.Tensor | None = None, **kwargs) -> SegmentResult:
    """Backpropagate a trajectory's causal-LM loss through ``model`` one segment of ``segment_len`` tokens at a time,
    accumulating the parameters' ``.grad`` as ``model(input_ids, labels=labels).loss.backward()`` would (``"exact"``)
    or with each segment's incoming state held constant (``"truncated"``). ``labels`` default to ``input_ids``
    (``-100`` ignores a token). ``num_items_in_batch``: the label count to divide by, as transformers' loss takes it
    (gradient accumulation over several calls); default, the trajectory's own. Extra keyword arguments go to every
    segment's forward. ``shift_labels``: the labels already shifted (a token's next token's label, as transformers'
    loss takes them), in place of ``labels``.

    Packed rows (several sequences in one row: ``position_ids`` restarting at 0, or ``cu_seq_lens_q``, as
    transformers' DataCollatorWithFlattening makes them) are trained sequence by sequence, each from an empty state,
    with the loss and gradients of ``model(input_ids, labels=labels, position_ids=...)`` (`packed_sequences`).
    Returns the loss."""
    labels = _check(model, input_ids, labels, mode, kwargs)
    rows = packed_sequences(input_ids, kwargs)
    length = input_ids.shape[1]
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    elif shift_labels.shape != input_ids.shape:
        raise KimiK3SegmentError(f"shift_labels must have input_ids' shape {tuple(input_ids.shape)}, got "
                                 f"{tuple(shift_labels.shape)}")  # fmt: skip
    tokens = int((shift_labels != IGNORE_INDEX).sum())
    if tokens == 0:
        raise KimiK3SegmentError("no token has a label to predict: pass labels other than -100 for at least one "
                                 "token after the first")  # fmt: skip
    if num_items_in_batch is not None:
        tokens = int(num_items_in_batch)
    if rows is not None:
        return _packed_backward(model, input_ids, shift_labels, rows, tokens, segment_len, mode, kwargs)
    bounds = segment_bounds(length, segment_len)
    losses = []
    if mode == "truncated":
        # one cache, its state made a constant after each segment (a cache per segment would hold two copies of the
        # latents while the next one is filled)
        cache = KimiK3HybridCache(model.config, max_cache_len=length)
        for start, end in bounds:
            loss = _run(model, input_ids, shift_labels, tokens, start, end, cache, kwargs)
            loss.backward()
            losses.append(loss.detach())
            cache.detach_()
        return SegmentResult(sum(losses), losses, tokens)

    boundaries, latents = boundary_states(model, input_ids, segment_len)
    state_grads: dict = {}  # ("kda", i) -> (grad of the state, of the window) the segment after sent back
    latent_grads = {i: torch.zeros_like(t) for i, t in latents.items()}
    for (start, end), boundary in zip(reversed(bounds), reversed(boundaries)):
        loss, state_grads = _exact_segment(model, input_ids, shift_labels, tokens, start, end, boundary, latents,
                                           latent_grads, state_grads, kwargs)  # fmt: skip
        losses.append(loss)
    losses.reverse()
    return SegmentResult(sum(losses), losses, tokens)


def _add_grad_into(into: torch.Tensor, leaf: torch.Tensor) -> None:
    into += leaf.grad
    leaf.grad = None  # (each MLA layer's prefix gradient is freed as soon as it is added)


def _exact_segment(model, input_ids, shift_labels, tokens, start, end, boundary, latents, latent_grads, state_grads,
                   kwargs):
    """Exact mode's step for one segment (a function, so that its cache and graph are freed before the next one's):
    recompute it from its boundary state made leaves, backpropagate its loss plus the gradients the later segments
    sent to the state it leaves (`state_grads`, and its rows of `latent_grads`), add the prefix latents' gradient to
    `latent_grads` and return ``(loss, the gradients of its incoming KDA states)``."""
    # (the segment's cache holds the prefix latents as the leaves they are, not a copy, and no more rows than it needs)
    cache, held = cache_from_boundary(model.config, boundary, latents, end, leaves=True)
    for (kind, i), leaf in held.items():
        if kind == "mla":
            leaf.register_post_accumulate_grad_hook(functools.partial(_add_grad_into, latent_grads[i][:, :start]))
    loss = _run(model, input_ids, shift_labels, tokens, start, end, cache, kwargs)
    outputs, cotangents = [loss], [torch.ones_like(loss)]
    if end < input_ids.shape[1]:
        left = cache.state(latents_from=start)  # (the segment's latent rows as computed)
        for (kind, i), grads in state_grads.items():
            for value, grad in zip(left.kda[i], grads):
                if grad is not None and value.requires_grad:
                    outputs.append(value)
                    cotangents.append(grad)
        for i, grad in latent_grads.items():
            if left.latents[i].requires_grad:
                outputs.append(left.latents[i])
                cotangents.append(grad[:, start:end])
        del left
    del cache
    torch.autograd.backward(outputs, cotangents)
    return loss.detach(), {key: tuple(x.grad for x in pair) for key, pair in held.items() if key[0] == "kda"}


def detach_cache(cache: KimiK3HybridCache) -> KimiK3HybridCache:
    """Make the state a training forward left in ``cache`` a constant, in place, and return the cache: its KDA states
    and conv windows and its MLA latents keep their values but no longer lead back into that forward's graph, so the
    next segment's ``model(ids, past_key_values=cache, labels=...)`` can backpropagate after the previous segment's
    graph was freed (truncated training with one cache)."""
    return cache.detach_()
