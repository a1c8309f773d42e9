"""The data side of segment training (issue 47) for transformers' `Trainer`: every (trajectory, segment) pair is a
dataset item, and a state store gives each segment the state it starts from, so the Trainer trains on sampled
segments in truncated mode (the incoming state a constant, the loss on the segment's tokens only).

The store's states are computed once without gradients (`SegmentStateStore.compute`) or replayed from
`KimiK3HybridCache.save` files (`SegmentStateStore.add_files`), which `KimiK3HybridCache.load` checks as it checks
any cache file, and which must hold exactly the trajectory's tokens before the segment. Either way they are the
weights' of when they were made: as training moves the weights, they go stale (recompute them to refresh).

Use with ``TrainingArguments(remove_unused_columns=False, per_device_train_batch_size=1)``: an item's keys are not
the model's arguments. Segments at the same place in their trajectories (the same start and length) can share a
batch, their states stacked in one cache: ``SegmentDataset(..., group_size=B)`` makes each item a group of up to B of
them (a batch of one item is then B rows).

`SegmentTrainer` is the other route: a `Trainer` whose training step backpropagates each batch of whole trajectories
segment by segment (`segment_backward`), in exact mode (full-context backpropagation's gradient) or truncated mode.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset
from transformers import Trainer

from .cache import KimiK3CacheState, KimiK3HybridCache
from .segments import (CACHE_GIVEN, IGNORE_INDEX, MODES, PACKING_KEYS, KimiK3SegmentError, SegmentBoundary,
                       boundary_states, cache_from_boundary, segment_backward, segment_bounds)

__all__ = ["SegmentCollator", "SegmentDataset", "SegmentStateStore", "SegmentTrainer"]


def _row(trajectory: torch.Tensor) -> torch.Tensor:
    """A trajectory as ``[1, T]`` int64 ids (it may be given as ``[T]`` or ``[1, T]``)."""
    if not isinstance(trajectory, torch.Tensor) or trajectory.dim() not in (1, 2) or trajectory.is_floating_point() \
            or (trajectory.dim() == 2 and trajectory.shape[0] != 1) or trajectory.shape[-1] == 0:
        raise KimiK3SegmentError("a trajectory is a non-empty 1-D tensor of token ids (or [1, T])")
    return trajectory.reshape(1, -1).long()


class SegmentDataset(Dataset):
    """One item per (trajectory, segment): ``{"trajectory": i, "segment": j}``; `SegmentCollator` makes the inputs.
    ``group_size`` B > 1: one item per group of up to B segments with the same bounds (in the order of their first
    segment), ``{"segments": [(i, j), ...]}``, trained as one batch of rows."""

    def __init__(self, trajectories: list[torch.Tensor], segment_len: int, segments: list[tuple[int, int]] | None = None,
                 group_size: int = 1):
        self.trajectories = [_row(t) for t in trajectories]
        self.segment_len = segment_len
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise KimiK3SegmentError(f"group_size is a positive int (segments per batch), got {group_size!r}")
        every = [(i, j) for i, t in enumerate(self.trajectories)
                 for j in range(len(segment_bounds(t.shape[1], segment_len)))]  # fmt: skip
        self.all_segments = frozenset(every)  # (every trajectory's segments, sampled or not)
        pairs = every if segments is None else [tuple(pair) for pair in segments]
        unknown = set(pairs) - self.all_segments
        if unknown:
            raise KimiK3SegmentError(f"no such (trajectory, segment): {sorted(unknown)[:5]}")
        self.group_size = group_size
        if group_size == 1:
            self.items = pairs
            return
        by_bounds: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for pair in pairs:
            by_bounds.setdefault(self.bounds(*pair), []).append(pair)
        self.items = [group[k: k + group_size] for group in by_bounds.values() for k in range(0, len(group), group_size)]

    def bounds(self, trajectory: int, segment: int) -> tuple[int, int]:
        """``(start, end)`` of segment ``segment`` of trajectory ``trajectory``."""
        return segment_bounds(self.trajectories[trajectory].shape[1], self.segment_len)[segment]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        if self.group_size > 1:
            return {"segments": list(self.items[index])}
        trajectory, segment = self.items[index]
        return {"trajectory": trajectory, "segment": segment}


class SegmentStateStore:
    """The state each segment of each trajectory starts from."""

    def __init__(self, config, segment_len: int):
        self.config = config
        self.segment_len = segment_len
        self._computed: dict[int, tuple[list[SegmentBoundary], dict]] = {}
        self._files: dict[tuple[int, int], str | os.PathLike] = {}

    @classmethod
    def compute(cls, model, trajectories: list[torch.Tensor], segment_len: int) -> "SegmentStateStore":
        """Every segment's incoming state, from one pass per trajectory without gradients (`boundary_states`)."""
        store = cls(model.config, segment_len)
        for i, trajectory in enumerate(trajectories):
            store._computed[i] = boundary_states(model, _row(trajectory).to(model.device), segment_len)
        return store

    def add_files(self, trajectory: int, files: dict[int, str | os.PathLike]) -> None:
        """Replay: ``files[j]`` is a `KimiK3HybridCache.save` file of the cache after the tokens before segment j
        of trajectory ``trajectory`` (checked when a segment needs it)."""
        for segment, path in files.items():
            self._files[trajectory, segment] = path

    def cache(self, trajectory: int, segment: int, ids: torch.Tensor) -> KimiK3HybridCache:
        """A fresh cache holding the state segment ``segment`` of ``ids`` (``[1, T]``) starts from (empty for the
        first segment)."""
        start = segment_bounds(ids.shape[1], self.segment_len)[segment][0]
        if (trajectory, segment) in self._files:
            # (the weights change while training: a replayed state is taken as made, no fingerprint check)
            cache = KimiK3HybridCache.load(self._files[trajectory, segment], self.config, device=ids.device,
                                           max_cache_len=ids.shape[1])  # fmt: skip
            held = cache.token_ids
            if cache.get_seq_length() != start or held is None or not torch.equal(held.to(ids.device), ids[:, :start]):
                raise KimiK3SegmentError(
                    f"the cache file for trajectory {trajectory}, segment {segment} does not hold that trajectory's "
                    f"first {start} tokens (it holds {cache.get_seq_length()}): save the cache after exactly the "
                    "tokens before the segment")
            return cache
        if segment == 0:
            return KimiK3HybridCache(self.config, max_cache_len=ids.shape[1])
        if trajectory not in self._computed:
            raise KimiK3SegmentError(f"no state for trajectory {trajectory}, segment {segment}: compute the store "
                                     "with SegmentStateStore.compute or add its cache files with add_files")
        boundaries, latents = self._computed[trajectory]
        cache, _ = cache_from_boundary(self.config, boundaries[segment], latents, ids.shape[1], leaves=False)
        return cache


class SegmentCollator:
    """Makes a batch's model inputs: each segment's ids, its labels shifted over the whole trajectory
    (``shift_labels``: its last token predicts the next segment's first) and a cache holding its incoming state, one
    row per segment. The segments of a batch share their bounds (`SegmentDataset`'s ``group_size``): one cache holds
    their states stacked."""

    def __init__(self, dataset: SegmentDataset, store: SegmentStateStore, labels: list[torch.Tensor] | None = None):
        if dataset.segment_len != store.segment_len:
            raise KimiK3SegmentError(f"the dataset's segments are {dataset.segment_len} tokens and the store's states "
                                     f"are at every {store.segment_len}: build both with one segment_len")
        self.dataset, self.store = dataset, store
        self.labels = None if labels is None else [_row(t) for t in labels]

    def __call__(self, features: list[dict]) -> dict:
        pairs = [tuple(pair) for feature in features
                 for pair in feature.get("segments", [(feature.get("trajectory"), feature.get("segment"))])]  # fmt: skip
        if not pairs or any(pair not in self.dataset.all_segments for pair in pairs):
            raise KimiK3SegmentError("a batch holds SegmentDataset items ({'trajectory': i, 'segment': j}, or "
                                     "{'segments': [(i, j), ...]}) of the collator's dataset's trajectories")
        bounds = {self.dataset.bounds(*pair) for pair in pairs}
        if len(bounds) != 1:
            raise KimiK3SegmentError(
                f"a batch holds segments with the same bounds (their states share one cache), got {sorted(bounds)}: "
                "use SegmentDataset(..., group_size=B) with per_device_train_batch_size=1")
        (start, end), = bounds
        rows = {"input_ids": [], "labels": [], "shift_labels": []}
        caches = []
        for trajectory, segment in pairs:
            ids = self.dataset.trajectories[trajectory]
            labels = ids if self.labels is None else self.labels[trajectory]
            shift = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
            for key, row in (("input_ids", ids), ("labels", labels), ("shift_labels", shift)):
                rows[key].append(row[:, start:end])
            caches.append(self.store.cache(trajectory, segment, ids))
        batch = {key: torch.cat(parts).contiguous() for key, parts in rows.items()}
        return {**batch, "past_key_values": caches[0] if len(caches) == 1 else self._stacked(caches, end),
                **CACHE_GIVEN}  # fmt: skip

    def _stacked(self, caches: list[KimiK3HybridCache], capacity: int) -> KimiK3HybridCache:
        """One cache holding the given caches' states as rows, in order."""
        states = [cache.state() for cache in caches]
        kda = {i: tuple(torch.cat([state.kda[i][k] for state in states]) for k in range(2)) for i in states[0].kda}
        latents = {i: torch.cat([state.latents[i] for state in states]) for i in states[0].latents}
        cache = KimiK3HybridCache(self.store.config, max_cache_len=capacity)
        cache.start_from(KimiK3CacheState(kda, latents))
        return cache


class SegmentTrainer(Trainer):
    """`Trainer` whose training step is `segment_backward` over the batch's whole trajectories: ``segment_len`` tokens
    at a time, ``segment_mode="exact"`` (the gradient of full-context backpropagation, without holding earlier
    segments' activations) or ``"truncated"``. A batch is ``input_ids`` ``[B, T]`` and optionally ``labels`` (default
    the ids; ``-100`` ignores a token) and an all-ones ``attention_mask``, or packed rows as DataCollatorWithFlattening
    makes them (each sequence trained as its own trajectory, `segment_backward`). Gradient accumulation divides by the
    accumulated label count, as `Trainer` does for a full-context loss. Evaluation is the model's full-context loss.

    One process, without fp16's gradient scaler: the step runs several backward passes of its own, which a
    distributed wrapper would synchronise one by one and a loss scaler never sees."""

    def __init__(self, *args, segment_len: int, segment_mode: str = "exact", **kwargs):
        if segment_mode not in MODES:
            raise KimiK3SegmentError(f"segment_mode must be one of {MODES}, got {segment_mode!r}")
        segment_bounds(1, segment_len)  # (checks it)
        super().__init__(*args, **kwargs)
        if self.args.fp16 or self.accelerator.num_processes > 1:
            raise KimiK3SegmentError("SegmentTrainer runs in one process without fp16's loss scaler: train with "
                                     "bf16 or fp32 on one device")  # fmt: skip
        self.segment_len, self.segment_mode = segment_len, segment_mode

    def training_step(self, model, inputs: dict, num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
        unknown = set(inputs) - {"input_ids", "labels", "attention_mask", *PACKING_KEYS}
        if unknown:
            raise KimiK3SegmentError(f"a SegmentTrainer batch holds input_ids, labels, attention_mask and packing "
                                     f"keys {PACKING_KEYS}, got {sorted(unknown)}: drop the other columns")  # fmt: skip
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise KimiK3SegmentError("SegmentTrainer trains unpadded trajectories (the state runs through every "
                                     "token): batch trajectories of one length, or use per_device_train_batch_size=1")
        if num_items_in_batch is None and self.current_gradient_accumulation_steps > 1:
            raise KimiK3SegmentError("gradient accumulation divides by the accumulated label count: put labels in "
                                     "the batch (e.g. a copy of input_ids)")  # fmt: skip
        model.train()
        ids = inputs["input_ids"].to(self.args.device)
        labels = inputs.get("labels")
        with self.compute_loss_context_manager():
            result = segment_backward(model, ids, None if labels is None else labels.to(ids.device),
                                      segment_len=self.segment_len, mode=self.segment_mode,
                                      num_items_in_batch=num_items_in_batch,
                                      **{key: inputs[key].to(ids.device) for key in PACKING_KEYS
                                         if isinstance(inputs.get(key), torch.Tensor)})  # fmt: skip
        return result.loss.to(self.args.device)
