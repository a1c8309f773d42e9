"""`KimiK3HybridCache`: the only place that knows how K3's decoding state is stored.

* KDA layers keep a constant-size state: the last ``K-1`` pre-convolution inputs of q, k and v
  (``[B, 3P, K-1]``, model dtype, q|k|v concatenated along channels) and the fp32 recurrent state
  (``[B, H, K, V]``, fla's layout).
* MLA layers keep the compressed latent only: ``[B, S, kv_lora_rank + qk_rope_head_dim]`` (the normed
  ``c_kv`` followed by the shared ``k_pe``), never expanded K/V. The buffer grows by doubling, so a decode
  step appends in place instead of copying the whole cache as ``torch.cat`` would.

The cache also knows what it holds (`KimiK3CacheError` when that does not fit what it is used for):

* the token ids it consumed, ``[B, S]`` int64 (`KimiK3HybridCache.token_ids`), recorded by the text model's forward:
  a recurrent KDA state cannot be matched by prefix like a key/value cache, so generate() refuses a prompt that does
  not start with them instead of continuing from the wrong state. The ids themselves are kept, not a hash: 8 bytes
  per token and row against ``(kv_lora_rank + rope) x MLA layers`` latent values (about 26 KB per token at full
  size, 0.03 %), and unlike a hash they crop, reorder for beam search and name the first position that differs;
* in a saved file, per-layer lengths and a fingerprint of the weights that made it (`weights_fingerprint`; saving and
  loading are `cache_io.py`'s).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

from .cache_io import (
    PAD_POSITION,
    UNKNOWN_TOKEN,
    KimiK3CacheError,
    KimiK3CacheFileError,
    KimiK3CacheIO,
    _module_device,
    _text_decoder,
    weights_fingerprint,
)
from .configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig

class KimiK3CacheSizeError(KimiK3CacheError):
    """A cache whose buffers would not fit in the memory that is to hold them (refused before anything is allocated)."""


# guards the check-and-set of a cache's "in use by generate()" flag across threads
_IN_USE_LOCK = threading.Lock()


def cache_bytes(config: KimiK3TextConfig, tokens: int, batch_size: int, dtype: torch.dtype) -> int:
    """Bytes a cache reserving `tokens` positions for `batch_size` sequences allocates: every MLA latent
    (``tokens x (kv_lora_rank + rope)`` in `dtype`), the int64 token record, and every KDA layer's conv window (in
    `dtype`) and fp32 recurrent state."""
    return sum(_cache_bytes_by_part(config, tokens, batch_size, dtype).values())


def _cache_bytes_by_part(config: KimiK3TextConfig, tokens: int, batch_size: int, dtype: torch.dtype) -> dict:
    """`cache_bytes` per part: layer index -> its state's bytes, ``"tokens"`` -> the token record's."""
    element = torch.empty((), dtype=dtype).element_size()
    width = config.kv_lora_rank + config.qk_rope_head_dim
    heads, head_dim = config.linear_num_heads, config.linear_head_dim
    kda = batch_size * (3 * heads * head_dim * (config.linear_conv_kernel_size - 1) * element
                        + heads * head_dim * head_dim * 4)
    parts = {idx: kda if kind == "linear_attention" else batch_size * tokens * width * element
             for idx, kind in enumerate(config.layer_types)}
    parts["tokens"] = batch_size * tokens * 8
    return parts


def available_bytes(device: torch.device | str | None) -> int | None:
    """Memory that can still be allocated on `device`: the CUDA device's free memory, on the CPU the available RAM
    (psutil if installed, else the kernel's MemAvailable, else the free pages); None where it is not known."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_cache_fits(config: KimiK3TextConfig, tokens: int, batch_size: int, dtype: torch.dtype,
                     device: torch.device | str | None, static: bool = True, model: nn.Module | None = None) -> None:
    """`KimiK3CacheSizeError`, naming the bytes, when a cache reserving `tokens` positions would not fit in the
    memory available where it will live (checked before allocating: a huge reservation would otherwise take the
    memory, or be killed, before any step runs). With `model`, each layer's state is counted on the device its layer
    computes on (a model split over several GPUs by a device_map); else all of it on `device`."""
    parts = _cache_bytes_by_part(config, tokens, batch_size, dtype)
    fallback = torch.device(device if device is not None else "cpu")
    decoder = _text_decoder(model) if model is not None else None
    needed: dict[torch.device, int] = {}
    for key, size in parts.items():
        where = None
        if decoder is not None:
            where = _module_device(decoder.embed_tokens if key == "tokens" else decoder.layers[key])
        where = where or fallback
        needed[where] = needed.get(where, 0) + size
    for where, size in needed.items():
        available = available_bytes(where)
        if available is None or size <= available:
            continue
        total = sum(parts.values())
        per_token = cache_bytes(config, 1, 1, dtype) - cache_bytes(config, 0, 1, dtype)
        raise KimiK3CacheSizeError(
            f"a {'static cache' if static else 'cache'} (KimiK3HybridCache) of {tokens} tokens x {batch_size} "
            f"sequence(s) needs {total / 1e9:.2f} GB ({total} bytes, {dtype}); {size / 1e9:.2f} GB of it on {where}, "
            f"where {available / 1e9:.2f} GB are available. It holds prompt + new tokens: lower generate()'s "
            f"max_new_tokens / max_length, or build it with a smaller max_cache_len (one token of one sequence takes "
            f"{per_token} bytes), or use the growing cache (cache_implementation=None / static=False), which takes "
            "memory as tokens come")


def _layout(config: KimiK3TextConfig) -> str:
    kinds = "".join("K" if kind == "linear_attention" else "M" for kind in config.layer_types)
    return (f"kinds {kinds} (K: KDA, M: MLA), latent width {config.kv_lora_rank + config.qk_rope_head_dim}, "
            f"KDA {config.linear_num_heads} x {config.linear_head_dim}")


def _keep_address(*tensors: torch.Tensor) -> None:
    """Tell torch.compile these buffers keep their address (CUDA graphs read them in place); outside graphs only."""
    if not torch.compiler.is_compiling():
        for tensor in tensors:
            torch._dynamo.mark_static_address(tensor)


class KimiK3KDACacheLayer(LinearAttentionCacheLayerMixin):
    """Conv window and recurrent state of one KDA layer."""

    is_sliding = False

    def __init__(self, conv_width: int, max_rollback: int = 64, static: bool = False):
        super().__init__(number_of_states=1)
        self.conv_width = conv_width  # K - 1 raw inputs per channel
        # static: the states are written in place once allocated, so their addresses never change (CUDA graphs)
        self.static = static
        # Rollback support (assisted / prompt-lookup decoding): while `record_past` is on, the layer keeps the
        # recurrent state after each of the last `max_rollback` tokens and the raw conv inputs covering them.
        self.max_rollback = max_rollback
        self._past_states: list[torch.Tensor] | None = None  # [-1] is the current state
        self._past_inputs: torch.Tensor | None = None  # [B, 3P, K-1+n]; its last K-1 columns are the window

    # The mixin's dict-of-states layout is kept so transformers' generic helpers (offload, reorder) work.
    @property
    def conv_state(self) -> torch.Tensor | None:
        return self.conv_states[0]

    @property
    def recurrent_state(self) -> torch.Tensor | None:
        return self.recurrent_states[0]

    @property
    def has_state(self) -> bool:
        return self.has_previous_state[0]

    @property
    def batch_size(self) -> int:
        return self.conv_states[0].shape[0]

    @property
    def is_compileable(self) -> bool:
        # (past recording keeps a growing history: assisted decoding runs eager)
        return self.static and not self.record_past

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0) -> None:
        if conv_states is not None:
            self.device, self.dtype = conv_states.device, conv_states.dtype
            self.conv_states[0] = conv_states
            self.conv_kernel_size[0] = conv_states.shape[-1] + 1
            self.is_conv_states_initialized[0] = True
        if recurrent_states is not None:
            self.recurrent_states[0] = recurrent_states
            self.is_recurrent_states_initialized[0] = True

    def _store(self, states: dict, new: torch.Tensor) -> torch.Tensor:
        """Hold `new` in `states` (filled first by `lazy_initialization`); a static layer keeps its buffer's address."""
        held = states[0]
        if self.static and held is not new and held.shape == new.shape and held.dtype == new.dtype \
                and held.device == new.device:
            held.copy_(new)  # the same buffer: a captured graph keeps reading and writing it
        else:
            states[0] = new
            if self.static:
                _keep_address(new)
        self._mark()
        return states[0]

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Store a new conv window ``[B, 3P, K-1]`` (replaces; decode paths update it in place)."""
        if not self.is_conv_states_initialized[0]:
            self.lazy_initialization(conv_states=conv_states)
        return self._store(self.conv_states, conv_states)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Store a new fp32 recurrent state ``[B, H, K, V]``."""
        recurrent_states = recurrent_states.to(torch.float32)
        if not self.is_recurrent_states_initialized[0]:
            self.lazy_initialization(recurrent_states=recurrent_states)
        return self._store(self.recurrent_states, recurrent_states)

    def _mark(self) -> None:
        self.has_previous_state[0] = self.is_conv_states_initialized[0] and self.is_recurrent_states_initialized[0]

    def follow(self, device: torch.device) -> None:
        """Move the held states to `device` once if they are elsewhere (a cache loaded or built on the CPU for a
        model on a GPU), so that no step copies them."""
        if self.has_state and self.conv_states[0].device != device:
            self.conv_states[0] = self.conv_states[0].to(device)
            self.recurrent_states[0] = self.recurrent_states[0].to(device)
            self.device = device
            if self._past_states is not None:
                self._past_states = [s.to(device) for s in self._past_states]
                self._past_inputs = self._past_inputs.to(device)

    def reset(self) -> None:
        recording = self.record_past  # (a reset cache keeps recording for assisted decoding if it was)
        self.__init__(self.conv_width, self.max_rollback, self.static)
        self.record_past = recording

    def prepare(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """What a KDA forward of `seq_len` tokens on `device` starts from: ``(conv_window, recurrent_state,
        recorded)``, the held conv window ``[B, 3P, K-1]`` and recurrent state (None at a sequence start; a decode
        step may update both in place) and how many trailing tokens' states to hand back to `update` for the
        rollback window (0 unless past recording is on)."""
        self.follow(device)
        recorded = min(seq_len, self.max_rollback) if self.record_past else 0
        if not recorded:
            self._past_states = self._past_inputs = None  # (a forward not recorded makes older history unreachable)
        if not self.has_state:
            return None, None, recorded
        if recorded and self._past_inputs is None:
            # the window before the recorded tokens: the decode convolution updates the held one in place
            self._past_inputs, self._past_states = self.conv_states[0].clone(), []
        return self.conv_states[0], self.recurrent_states[0], recorded

    def update(self, recurrent_state: torch.Tensor, conv_state: torch.Tensor | None = None,
               conv_inputs: torch.Tensor | None = None, state_history: list[torch.Tensor] | None = None) -> None:
        """Store what a KDA forward computed: its final fp32 recurrent state (the held tensor itself when the step
        updated it in place) and its final conv window (None: the decode convolution updated the held window in
        place). While recording (`prepare` said so), also the forward's raw q|k|v conv inputs ``[B, 3P, T]`` and
        `state_history`: the recurrent state before the forward's last ``R = len(state_history) - 1`` tokens and
        after each of them (a forward longer than R makes older history unreachable)."""
        if conv_state is not None:
            self.update_conv_state(conv_state)
        if state_history is not None:
            self._record(conv_inputs, state_history)
        self.update_recurrent_state(recurrent_state)

    def _record(self, raw_inputs: torch.Tensor, states: list[torch.Tensor]) -> None:
        if self._past_inputs is None:  # (a sequence start: an empty window)
            self._past_inputs = raw_inputs.new_zeros(*raw_inputs.shape[:2], self.conv_width)
            self._past_states = []
        if self.static and states[0] is self.recurrent_states[0]:
            states = [states[0].clone(), *states[1:]]  # (the held buffer is written in place by the next update)
        if len(states) - 1 < raw_inputs.shape[-1] or not self._past_states:
            self._past_states = list(states)
        else:
            self._past_states = self._past_states + list(states[1:])
        self._past_states = self._past_states[-(self.max_rollback + 1):]
        inputs = torch.cat([self._past_inputs, raw_inputs.to(self._past_inputs.dtype)], dim=-1)
        start = inputs.shape[-1] - (self.conv_width + len(self._past_states) - 1)
        self._past_inputs = inputs[..., start:]

    def crop(self, tokens_to_remove: int) -> None:
        """Roll the state back by ``-tokens_to_remove`` tokens (transformers' negative convention). Needs past
        recording (`activate_past_recording`), which generate() turns on for assisted and prompt-lookup decoding.
        ``crop(0)`` keeps the current state and frees the recorded history."""
        if tokens_to_remove > 0:
            raise ValueError(f"`crop` takes a negative number of tokens to remove, got {tokens_to_remove}")
        n = -tokens_to_remove
        if n > 0:
            available = 0 if self._past_states is None else len(self._past_states) - 1
            if n > available:
                raise ValueError(
                    f"Cannot roll a KDA state back by {n} tokens: only {available} were recorded. Call "
                    "`cache.activate_past_recording()` before the tokens to undo are processed, and build the cache "
                    f"with `max_rollback` >= {n} (now {self.max_rollback})."
                )
            width = self._past_inputs.shape[-1] - n
            window = self._past_inputs[..., width - self.conv_width:width]
            self.conv_states[0] = window.contiguous()
            self.recurrent_states[0] = self._past_states[-1 - n]
        self._past_states, self._past_inputs = None, None

    @property
    def is_croppable(self) -> bool:
        return self.record_past

    def detach_(self) -> None:
        """Cut the held state from the graph that computed it (same storage: a static layer keeps its addresses)."""
        if self.has_state:
            self.conv_states[0] = self.conv_states[0].detach()
            self.recurrent_states[0] = self.recurrent_states[0].detach()
            if self.static:
                _keep_address(self.conv_states[0], self.recurrent_states[0])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.has_state:
            self.conv_states[0] = self.conv_states[0].repeat_interleave(repeats, dim=0)
            self.recurrent_states[0] = self.recurrent_states[0].repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.has_state:
            self.conv_states[0] = self.conv_states[0][indices]
            self.recurrent_states[0] = self.recurrent_states[0][indices]


class KimiK3MLACacheLayer(CacheLayerMixin):
    """The compressed MLA latent of one layer, ``[B, S, kv_lora_rank + qk_rope_head_dim]``."""

    is_compileable = False
    is_sliding = False
    is_croppable = True
    supports_early_init = False
    parts: list[torch.Tensor] | None = None  # (class default: a layer pickled by an earlier version has none)

    def __init__(self, initial_capacity: int = 256, storage_device: str | torch.device | None = None,
                 storage_dtype: torch.dtype | None = None):
        super().__init__()
        self.latent: torch.Tensor | None = None  # [B, capacity, D]; rows >= length are scratch
        self.length = 0
        self.initial_capacity = initial_capacity
        # Where the latent lives between steps (e.g. "cpu" to offload long contexts from a small GPU); None: with
        # the activations. Each step then copies the latent to the compute device.
        self.storage_device = None if storage_device is None else torch.device(storage_device)
        # The latent's dtype (None: the activations'); another dtype is cast back for each step, like offloading.
        self.storage_dtype = storage_dtype
        self.device = None
        self.dtype = None
        self.reserved = False  # allocated up front by KimiK3HybridCache(batch_size=...): kept through reset()
        # Held latents that lead into a graph (`hold_as_given`), kept as the tensors given instead of copied into
        # `latent` (then None): the held rows, then one appended step. Any other use joins them into a buffer.
        # Also a step a graph kept beside the buffer's rows (`keep_beside`; `latent` then stays the buffer).
        self.parts: list[torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return (self.latent if self.parts is None else self.parts[0]).shape[0]

    def hold_as_given(self, latent_states: torch.Tensor) -> None:
        """Hold ``latent_states`` ``[B, S, D]`` in this empty layer as the tensor it is, not a copy: for held latents
        that lead into a graph (exact segment training's leaves), whose gradient then reaches them directly and which
        the step after them appends beside them (`append_beside`), not through a buffer the context's size."""
        self.parts, self.latent, self.length = [latent_states], None, latent_states.shape[1]
        self.dtype, self.device, self.is_initialized = latent_states.dtype, latent_states.device, True

    def append_beside(self, latent_states: torch.Tensor) -> bool:
        """Append ``latent_states`` beside latents held as given, as the tensor it is; False (nothing done) when the
        layer holds them otherwise or already holds a step beside them."""
        if self.parts is None or len(self.parts) > 1 or latent_states.dtype != self.dtype \
                or latent_states.device != self.device:
            return False
        self.parts.append(latent_states)
        self.length += latent_states.shape[1]
        return True

    def keep_beside(self, latent_states: torch.Tensor) -> bool:
        """Inside a graph with autograd (a segment trained from the cache), hold ``latent_states`` ``[B, T, D]``
        beside the buffer's rows instead of writing them into the buffer: such a graph turns that write into a copy
        of the whole buffer (one without autograd keeps it, which inductor can reinplace). The next access outside a
        graph writes them in (`_join`; `detach_` does). False (nothing done) elsewhere, or where the layer holds no
        rows in a buffer of the step's dtype and device, or already holds parts."""
        if (not torch.compiler.is_compiling() or not latent_states.requires_grad or self.parts is not None
                or self.latent is None or not self.length or self.latent.dtype != latent_states.dtype
                or self.latent.device != latent_states.device):
            return False
        self.parts = [self.latent[:, : self.length], latent_states]
        self.length += latent_states.shape[1]
        return True

    def _join(self) -> None:
        """Latents held as given become the layer's own buffer (a copy: the tensors given are never written); steps
        kept beside the buffer (`keep_beside`) are appended into it (inside a graph, as a copy of the buffer)."""
        if self.parts is None:
            return
        if self.latent is None:
            self.latent, self.parts = torch.cat(self.parts, dim=1), None
            return
        held, self.parts = self.parts, None
        self.length = held[0].shape[1]
        for step in held[1:]:
            self._append(step)

    def _append(self, latent_states: torch.Tensor) -> None:
        """Write ``latent_states`` after the held rows of the buffer, grown by doubling when they do not fit."""
        new_len = self.length + latent_states.shape[1]
        if new_len > self.latent.shape[1]:
            capacity = max(new_len, 2 * self.latent.shape[1])
            grown = self.latent.new_empty(self.latent.shape[0], capacity, self.latent.shape[2])
            grown[:, : self.length] = self.latent[:, : self.length]
            self.latent = grown
        self.latent[:, self.length : new_len] = latent_states
        self.length = new_len

    def held_latents(self, start: int = 0) -> torch.Tensor:
        """The held tokens' latents from token ``start`` on, ``[B, length - start, D]``: a view of the buffer, or of
        latents held as given (the step appended beside them as the tensor it is)."""
        if self.parts is None:
            return self.latent[:, start : self.length]
        if len(self.parts) == 1:
            return self.parts[0][:, start:]
        if start == self.parts[0].shape[1]:
            return self.parts[1]
        return torch.cat(self.parts, dim=1)[:, start:]

    @property
    def holds(self) -> bool:
        """Whether any token is held."""
        return self.length > 0

    def allocate(self, batch: int, dim: int, device: torch.device | None, dtype: torch.dtype | None = None) -> None:
        """Reserve ``[batch, initial_capacity, dim]`` now (a preallocated cache fails at construction, not hours
        into a long prefill, when memory is short)."""
        dtype = self.storage_dtype or dtype or torch.get_default_dtype()
        self.latent = torch.empty(batch, self.initial_capacity, dim, dtype=dtype, device=self.storage_device or device)
        self.length = 0
        self.is_initialized = True

    def _check_reserved_shape(self, latent_states: torch.Tensor) -> None:
        if tuple(latent_states.shape[::2]) != (self.latent.shape[0], self.latent.shape[2]):
            raise ValueError(
                f"This cache was preallocated for batch {self.latent.shape[0]} and latent width "
                f"{self.latent.shape[2]}, got [batch {latent_states.shape[0]}, width {latent_states.shape[2]}]. "
                "Build it with the batch size you generate with (`batch_size=`) and the model's config."
            )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        batch, _, dim = key_states.shape
        self.allocate(batch, dim, key_states.device, key_states.dtype)
        self.dtype, self.device = key_states.dtype, key_states.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args, **kwargs):
        """Append ``latent_states`` ``[B, T, D]``; return a view of the whole latent ``[B, S, D]``."""
        latent_states = key_states
        if self.parts is not None:
            self._join()
        if not self.is_initialized:
            self.lazy_initialization(latent_states)
        elif self.device is None:  # preallocated: the first step tells where compute happens
            self._check_reserved_shape(latent_states)
            self.dtype, self.device = latent_states.dtype, latent_states.device
            if self.storage_dtype is None and self.length == 0 and self.latent.dtype != latent_states.dtype:
                # reserved before the activations' dtype was known (the default dtype): store in theirs, as the
                # docstring says (a bf16 model kept fp32 latents: twice the memory), still empty so nothing is lost
                self.latent = torch.empty_like(self.latent, dtype=latent_states.dtype)
        if self.storage_device is None and self.latent.device != latent_states.device:
            # reserved or loaded elsewhere (the CPU) than the activations: moved once, not copied back every step
            self.latent = (torch.empty_like(self.latent, device=latent_states.device) if self.length == 0
                           else self.latent.to(latent_states.device))
        self._append(latent_states)
        return self.latent[:, : self.length].to(latent_states.device, latent_states.dtype, non_blocking=True), None

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.parts = None
        if self.reserved:  # a buffer the user reserved (`batch_size=`) stays reserved, emptied
            self.length, self.device = 0, None
        else:
            self.latent, self.length, self.is_initialized = None, 0, False

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"`crop` takes a negative number of tokens to remove, got {tokens_to_remove}")
        self._join()
        self.length = max(0, self.length + tokens_to_remove)

    def _apply(self, fn) -> None:
        """The kept rows ``fn(latent)`` in a buffer of the same capacity (a reserved buffer stays reserved)."""
        self._join()
        if self.is_initialized:
            kept = fn(self.latent[:, : self.length])
            buffer = kept.new_empty(kept.shape[0], self.latent.shape[1], kept.shape[2])
            buffer[:, : self.length] = kept
            self.latent = buffer

    def detach_(self) -> None:
        """Cut the held latents from the graph that computed them (same storage). Outside a graph, a step a graph
        kept beside the buffer is written into it (the next graph then reads the buffer alone)."""
        if self.parts is not None:
            self.parts = [part.detach() for part in self.parts]
        if self.latent is not None:
            self.latent = self.latent.detach()
            if not torch.compiler.is_compiling():
                self._join()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # (beam search, every step: in place, so the buffer keeps its capacity and is never regrown)
        self._join()
        if self.is_initialized:
            live = self.latent[:, : self.length]
            live.copy_(live.index_select(0, beam_idx.to(live.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices])

    def offload(self):
        self._join()
        if self.is_initialized:
            self.latent = self.latent.to("cpu", non_blocking=True)

    def prefetch(self):
        self._join()
        if self.is_initialized and self.latent.device != self.device:
            self.latent = self.latent.to(self.device, non_blocking=True)

    def nbytes(self) -> int:
        latent = self.latent if self.parts is None else self.parts[0]
        return 0 if not self.is_initialized else self.length * latent.shape[0] * latent.shape[2] * latent.element_size()


class KimiK3StaticMLACacheLayer(KimiK3MLACacheLayer):
    """An MLA latent of fixed capacity, for compiled decode steps (``torch.compile``, CUDA graphs): allocated once
    (zeros), written in place at a position kept as a tensor (`position`), and returned whole, so that every decode
    step sees the same shapes and addresses. The attention masks the rows past the position (`holds` and the mask
    `KimiK3MLA` builds from `position`). Inside a compiled step the Python-side length is not touched: it is read back
    from `position` (one host read) the next time someone asks for it outside a graph."""

    is_compileable = True

    def __init__(self, max_cache_len: int, storage_dtype: torch.dtype | None = None):
        self.position = torch.zeros((), dtype=torch.long)
        self._length, self._length_stale = 0, False
        self._holds = False  # (a Python flag a graph may guard on, stable while decoding: no length read)
        super().__init__(max_cache_len, storage_device=None, storage_dtype=storage_dtype)
        self.max_cache_len = max_cache_len

    @property
    def length(self) -> int:
        if self._length_stale:
            self._length, self._length_stale = int(self.position), False
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        self._length, self._length_stale = value, False
        self._holds = value > 0
        self.position.fill_(value)

    def allocate(self, batch: int, dim: int, device: torch.device | None, dtype: torch.dtype | None = None) -> None:
        dtype = self.storage_dtype or dtype or torch.get_default_dtype()
        # zeros, not empty: a masked row still meets the probabilities (0 x NaN would be NaN)
        self.latent = torch.zeros(batch, self.initial_capacity, dim, dtype=dtype, device=device)
        self.position = self.position.to(self.latent.device)
        self.length = 0
        self.is_initialized = True
        _keep_address(self.latent, self.position)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args, **kwargs):
        """Write ``latent_states`` ``[B, T, D]`` at `position`; return the whole buffer ``[B, max_cache_len, D]``."""
        latent_states = key_states
        if self.storage_dtype is not None and self.storage_dtype != latent_states.dtype:
            # (the growing cache casts its whole latent back every step; a static buffer is returned as it is)
            raise KimiK3CacheError(
                f"this static KimiK3HybridCache stores its latents in {self.storage_dtype} but the model computes in "
                f"{latent_states.dtype}: build it with dtype=None (the model's) or dtype={latent_states.dtype}, or "
                "use the growing cache (static=False), which stores another dtype and casts it back per step")
        if not self.is_initialized:
            self.lazy_initialization(latent_states)
        elif self.device is None:  # reserved (`batch_size=`): the first step tells where compute happens
            self._check_reserved_shape(latent_states)
            self.dtype, self.device = latent_states.dtype, latent_states.device
            if (self.latent.device != latent_states.device
                    or (self.storage_dtype is None and self.latent.dtype != latent_states.dtype)):
                # reserved elsewhere or in the default dtype: reallocated with the activations, still empty
                dtype = self.storage_dtype or latent_states.dtype
                self.allocate(self.latent.shape[0], self.latent.shape[2], latent_states.device, dtype)
        count = latent_states.shape[1]
        self.check_room(count)
        positions = torch.arange(count, device=self.latent.device) + self.position
        self.latent.index_copy_(1, positions, latent_states.to(self.latent.dtype))
        self.position.add_(count)
        if torch.compiler.is_compiling():
            self._length_stale, self._holds = True, True
        else:
            self._length, self._holds = self._length + count, True
        return self.latent, None

    def check_room(self, count: int) -> None:
        """`KimiK3CacheError` if `count` more tokens do not fit (checked outside graphs: inside one, the length is
        on the device, and an index past the buffer fails in ``index_copy_``)."""
        if not torch.compiler.is_compiling() and self.length + count > self.max_cache_len:
            raise KimiK3CacheError(
                f"this static KimiK3HybridCache holds {self.max_cache_len} tokens per MLA layer: {self.length} are "
                f"used and {count} more do not fit. Build it with a larger max_cache_len (prompt + new tokens), or "
                "use the growing cache (static=False)")

    @property
    def holds(self) -> bool:
        return self._holds

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:  # the buffer stays (its address too), emptied
            self.latent.zero_()
        self.length = 0

    def _apply(self, fn) -> None:
        if self.is_initialized:
            kept = fn(self.latent)
            self.latent = kept.contiguous()
            _keep_address(self.latent)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.latent.copy_(self.latent.index_select(0, beam_idx.to(self.latent.device)))

    def detach_(self) -> None:
        super().detach_()
        if self.latent is not None:
            _keep_address(self.latent)

    def offload(self):  # (a static buffer stays where it is: moving it would change its address)
        pass

    def prefetch(self):
        pass

    def keep_beside(self, latent_states: torch.Tensor) -> bool:
        return False  # (written in place at its position: a step's shapes and the buffer's address stay fixed)


class KimiK3CacheStep(NamedTuple):
    """What a forward learns from `KimiK3HybridCache.begin_step` (`NO_CACHE_STEP` without a cache)."""

    checked: bool  # generate() feeds its own token under its own mask: the inputs need no value checks (host reads)
    continuing: bool  # the cache held tokens before the step (a Python flag: no length read)
    offset: int | torch.Tensor  # the step's first position (a static cache's device tensor: no host read)


NO_CACHE_STEP = KimiK3CacheStep(checked=False, continuing=False, offset=0)


class KimiK3LatentView(NamedTuple):
    """What an MLA layer gets back from `KimiK3HybridCache.update_mla`."""

    latent: torch.Tensor  # the held tokens' latents, then the step's ``[B, S, D]`` (static: the whole buffer)
    past_len: int  # tokens held before the step (0 inside a graph over a static cache: its count stays on the device)
    had_past: bool  # whether any token was held before the step (a Python flag: no length read)
    position: torch.Tensor | None  # a static layer's token count after the step, on its device; None when growing
    # the step's latents as attended: the tensor given when held unchanged (its gradient then reaches it directly,
    # not through a buffer the context's size); the buffer's rows read back otherwise
    step: torch.Tensor | None = None
    # whether the held tokens' latents lead back into a graph (exact segment training); else they need no gradient
    context_grad: bool = True
    # the held tokens' latents as the tensor the cache was given (`KimiK3MLACacheLayer.hold_as_given`), the step's
    # beside them: `latent` is then None, joined only where an attention needs the whole (`whole`)
    context: torch.Tensor | None = None

    def whole(self) -> torch.Tensor:
        """The held tokens' latents, then the step's, ``[B, S, D]``."""
        return self.latent if self.latent is not None else torch.cat([self.context, self.step], dim=1)

    def held(self, step_len: int) -> tuple[torch.Tensor, int]:
        """``(latents of the tokens held [B, S, D], tokens held before the step)`` for a step of `step_len` tokens
        that attends without masking a static buffer's empty rows: the buffer cut to them (inside a graph its count
        is read from the device), a growing view as it is."""
        if self.position is None:
            return self.latent, self.past_len
        length = int(self.position) if torch.compiler.is_compiling() else self.past_len + step_len
        return self.latent[:, :length], length - step_len


class KimiK3CacheState(NamedTuple):
    """The decoding state a cache holds, by layer index (`KimiK3HybridCache.state`, `KimiK3HybridCache.start_from`)."""

    kda: dict[int, tuple[torch.Tensor, torch.Tensor]]  # KDA layer -> (fp32 recurrent state, conv window)
    latents: dict[int, torch.Tensor]  # MLA layer -> its held tokens' latents ``[B, S, D]``


class KimiK3HybridCache(KimiK3CacheIO, Cache):
    """Decoding state of a K3 text model: one `KimiK3KDACacheLayer` per KDA layer and one
    `KimiK3MLACacheLayer` per MLA layer, in layer order. Built by ``generate()`` by default; build it
    yourself with ``KimiK3HybridCache(model.config)`` to keep and continue a conversation.

    It records the token ids it consumed (`token_ids`): to continue from it, pass generate() the whole sequence
    (those tokens, e.g. the ``sequences`` generate() returned with it, then the new ones); a prompt that does not
    start with them raises `KimiK3CacheError` instead of continuing from another conversation's state."""

    # (class defaults: a cache pickled by an earlier version has none of these attributes)
    _in_generate: int | None = None
    _loaded_fingerprint: str | None = None
    _layout_checked: KimiK3TextConfig | None = None
    _latent_layers: tuple | None = None
    media_items: list | None = None

    def __init__(self, config: KimiK3TextConfig | KimiK3Config, max_cache_len: int | None = None,
                 batch_size: int | None = None, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, offload_latents_to: str | torch.device | None = None,
                 max_rollback: int = 64, static: bool = False, **kwargs):
        """
        Args:
            config: the model's (text or composite) config.
            max_cache_len: tokens each MLA latent buffer holds before it grows (by doubling); set it to the
                context you will reach (prompt + new tokens) to reserve the memory once and never copy the cache.
            batch_size: with it, every MLA latent buffer is allocated now (``max_cache_len`` or 256 rows), so a
                cache that does not fit fails here; the first forward must then use this batch size.
            dtype: storage dtype of the MLA latents (default: the activations'). KDA recurrent states are fp32
                whatever this says (K3_SPEC), conv windows follow the activations.
            device: where the latents are allocated when ``batch_size`` is given (default: the default device, or
                the offload device; a reservation elsewhere than the activations moves to them, still empty, at the
                first step, so pass the model's device to fail here when it lacks the memory); without ``batch_size``
                everything lives with the activations.
            offload_latents_to: keep the MLA latents on this device between steps (e.g. ``"cpu"`` for a long
                context on a small GPU); each step copies them to the compute device.
            max_rollback: tokens of KDA history kept while past recording is on (assisted/prompt-lookup decoding).
            static: fixed shapes for compiled decoding (``torch.compile``, CUDA graphs; what
                ``generate(cache_implementation="static")`` builds): every MLA latent holds exactly ``max_cache_len``
                tokens (required), allocated at once and written in place, and every state keeps its address.
                A step past ``max_cache_len`` raises `KimiK3CacheError`. A prefill with a mask materialises it at
                ``[tokens, max_cache_len]``: size the cache to the generation, not to the longest context you might
                reach (for those, the default growing cache).
        """
        text_config = config.get_text_config() if isinstance(config, KimiK3Config) else config
        self.config = text_config
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"`max_cache_len` must be a positive number of tokens, got {max_cache_len}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive number of sequences (or None: allocate on the first "
                             f"forward), got {batch_size}")
        if static and max_cache_len is None:
            raise ValueError("a static KimiK3HybridCache needs `max_cache_len`: the tokens it holds (prompt + new "
                             "tokens), allocated at once")
        if static and offload_latents_to is not None:
            raise ValueError("a static KimiK3HybridCache keeps its latents where they are computed (their addresses "
                             "must not change); pass offload_latents_to=None or static=False")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise KimiK3CacheError(f"a KimiK3HybridCache stores its latents in a floating-point dtype the model can "
                                   f"compute with, got dtype={dtype!r}: pass None (the model's dtype), torch.bfloat16, "
                                   "torch.float16 or torch.float32")
        if batch_size is not None:  # (reserved now: refused here rather than taking memory the machine lacks)
            check_cache_fits(text_config, max_cache_len or 256, batch_size, dtype or torch.get_default_dtype(),
                             device, static=static)
        self.static = static
        layers = [
            KimiK3KDACacheLayer(text_config.linear_conv_kernel_size - 1, max_rollback, static=static)
            if kind == "linear_attention" else
            KimiK3StaticMLACacheLayer(max_cache_len, storage_dtype=dtype) if static else
            KimiK3MLACacheLayer(max_cache_len or 256, storage_device=offload_latents_to, storage_dtype=dtype)
            for kind in text_config.layer_types
        ]
        if batch_size is not None:
            width = text_config.kv_lora_rank + text_config.qk_rope_head_dim
            for layer in layers:
                if isinstance(layer, KimiK3MLACacheLayer):
                    layer.allocate(batch_size, width, torch.device(device) if device is not None else None)
                    layer.reserved = True
        super().__init__(layers=layers)
        self._tokens: torch.Tensor | None = None  # [B, capacity] int64; the first `_token_count` columns are held
        self._token_count = 0
        self._token_capacity = max_cache_len or 256
        self._writer = None  # weak reference to the text model that last wrote to the cache (for `save`)
        self._check_next_input = False  # armed by `begin_generate`: `plan_generate_step` checks the first input
        self._generated_step = False  # set by `plan_generate_step` for generate()'s own decode steps
        self._layout_checked: KimiK3TextConfig | None = None  # the model config `begin_step` last found fitting
        self._latent_layers = tuple(layer for layer in layers if isinstance(layer, KimiK3MLACacheLayer))
        self._in_generate: int | None = None  # the thread whose generate() uses the cache: others are refused
        self._loaded_fingerprint: str | None = None  # the weights fingerprint of the file it was loaded from
        # The images and videos behind the media slots it holds (the multimodal model's records, one per item:
        # kind, pixel digest, first slot), None when unknown: a continuation's media must be the same.
        self.media_items: list | None = None

    @contextmanager
    def generating(self, config: KimiK3TextConfig):
        """generate()'s one call on a cache it is given, held while it runs: refuses a second concurrent generate()
        given the same cache (another thread; both outputs would be wrong) and a cache built for another layout than
        `config`'s (`KimiK3CacheError`), and arms the check of the call's first input (`plan_generate_step`).
        Released when the call ends, also when it raises."""
        with _IN_USE_LOCK:
            if self._in_generate is not None:
                raise KimiK3CacheError(
                    "this KimiK3HybridCache is in use by another generate() call (another thread): a cache holds one "
                    "conversation's state, and two calls stepping it at once would both compute from the other's "
                    "tokens. Give each concurrent call its own cache (copy.deepcopy(cache) to branch a conversation), "
                    "or wait for the first call to finish")
            self._in_generate = threading.get_ident()
        try:
            self._check_layout(config)
            self._check_next_input = True
            yield self
        finally:
            # (a call that raised between planning a step and running it leaves no mark for the next forward)
            self._in_generate, self._check_next_input, self._generated_step = None, False, False

    # ------------------------------------------------------------------------------------------ entry points
    def begin_step(self, config: KimiK3TextConfig, input_ids: torch.Tensor | None,
                   inputs_embeds: torch.Tensor | None = None, attention_mask=None,
                   model: nn.Module | None = None) -> KimiK3CacheStep:
        """The one call a model's forward makes on its cache, before any layer updates it. Refuses a cache built for
        another layout than `config`'s or held by a generate() call in another thread (`KimiK3CacheError`, not
        while compiling: they were checked eagerly), records the ids of the step's tokens (`input_ids`, None:
        unknown; positions the 2-D `attention_mask` masks as padding; another batch than the held one is refused)
        and which `model` wrote them, and returns what the forward needs (`KimiK3CacheStep`). The step's shape, device
        and dtype are `inputs_embeds`' (else `input_ids`' and the model's embedding dtype)."""
        if not torch.compiler.is_compiling():
            if config is not self._layout_checked:  # (the same config object: checked once, not every step)
                self._check_layout(config)
                self._layout_checked = config
            self._check_not_in_use_elsewhere()
        checked, self._generated_step = self._generated_step, False
        continuing = self.holds_tokens()
        offset = self.get_query_offset()
        if isinstance(attention_mask, dict):  # (generate()'s per-kind masks: KDA's is the 2-D padding mask)
            attention_mask = attention_mask.get("linear_attention")
        self._record_tokens(input_ids, inputs_embeds, attention_mask, model)
        return KimiK3CacheStep(checked, continuing, offset)

    def plan_generate_step(self, input_ids: torch.Tensor, next_sequence_length: int | None,
                           attention_mask: torch.Tensor | None = None, first_iteration: bool = False,
                           embedded: bool = False) -> int | None:
        """Called by generate() before each step (`input_ids`: the whole sequence so far): how many trailing tokens
        the step computes (`next_sequence_length` as generate() asked, or the tokens past the cache where it asked
        for all of them), refusing by `KimiK3CacheError` a call's first input that does not extend the tokens the
        cache holds (`embedded`: fed as inputs_embeds, no ids to compare). Marks generate()'s own decode steps
        (one token of its own under its own mask) for `begin_step`: their inputs need no value checks."""
        holds = self.holds_tokens()  # (a Python flag: a static cache's length is on the device after compiled steps)
        first, self._check_next_input = self._check_next_input, False
        # (a decode step of generate()'s own loop needs no count)
        cached = self.get_seq_length() if holds and (first or next_sequence_length != 1) else 0
        self._generated_step = next_sequence_length == 1 and holds and not first and not first_iteration
        if first and cached and not embedded:
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 \
                    and attention_mask.shape[-1] != input_ids.shape[1]:
                raise KimiK3CacheError(
                    f"the cache passed as past_key_values holds {cached} tokens; pass the whole sequence (the "
                    "history the cache holds, then the new tokens) as input_ids with an attention_mask of the "
                    f"same length, got {input_ids.shape[1]} ids and a mask of {attention_mask.shape[-1]} positions")
            # (None: assisted / prompt-lookup decoding's first step, the whole sequence unsliced)
            next_sequence_length = input_ids.shape[1] - cached
            if next_sequence_length > 0:
                self._check_continuation(input_ids, attention_mask)
        elif next_sequence_length is None and 0 < cached < input_ids.shape[1]:
            next_sequence_length = input_ids.shape[1] - cached
        if next_sequence_length is not None and next_sequence_length <= 0:
            raise KimiK3CacheError(
                f"the cache passed as past_key_values already holds {cached} tokens but input_ids has "
                f"{input_ids.shape[1]}: pass the whole sequence (the history the cache holds, then the new "
                "tokens) as input_ids, as generate() returned it; only the tokens past the cache are computed")
        return next_sequence_length

    def update_media(self, items: list, held: int) -> None:
        """Called by the multimodal model with the media records (kind, pixel digest, first slot) of its input,
        whose first `held` positions this cache holds: those of the held part must be the ones it was built from
        (`KimiK3CacheError`: a recurrent state cannot be matched by the ``<|media_pad|>`` ids alone); it then
        records every item it holds (a new sequence exactly `items`; unknown stays unknown)."""
        seen = sorted(item for item in items if item[2] < held)
        if held and self.media_items is not None and seen and seen != sorted(self.media_items):
            raise KimiK3CacheError(
                "this KimiK3HybridCache was built from other images or videos than the ones given for the tokens "
                "it holds (the same `<|media_pad|>` slots, different pixels): generation would continue from "
                "another conversation's state. Pass the same media as before, or no past_key_values.")
        if not held:
            self.media_items = sorted(items)
        elif self.media_items is not None:
            self.media_items = sorted(set(self.media_items) | set(items))

    def _check_not_in_use_elsewhere(self) -> None:
        """`KimiK3CacheError` when a generate() call in another thread holds this cache (a forward stepping it
        meanwhile would corrupt both)."""
        owner = self._in_generate
        if owner is not None and owner != threading.get_ident():
            raise KimiK3CacheError(
                "this KimiK3HybridCache is in use by a generate() call in another thread: a forward on it now would "
                "interleave with that call's steps. Use a copy (copy.deepcopy(cache)) or wait for the call to finish")

    def _check_layout(self, config: KimiK3TextConfig) -> None:
        """`KimiK3CacheError` unless this cache was built for a model whose layers are those of `config` (the same
        layer kinds in the same order, the same latent and KDA widths)."""
        mine, theirs = self.config, config
        if list(mine.layer_types) == list(theirs.layer_types) and all(
                getattr(mine, key) == getattr(theirs, key) for key in
                ("kv_lora_rank", "qk_rope_head_dim", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_size")):
            return
        raise KimiK3CacheError(
            f"this KimiK3HybridCache was built for {len(mine.layer_types)} layers ({_layout(mine)}) but the model has "
            f"{len(theirs.layer_types)} ({_layout(theirs)}): build it from the model's own config, "
            "KimiK3HybridCache(model.config)")

    # ------------------------------------------------------------------------------------------ layers
    def kda_layer(self, layer_idx: int) -> KimiK3KDACacheLayer:
        return self.layers[layer_idx]

    def update_mla(self, latent_states: torch.Tensor, layer_idx: int) -> KimiK3LatentView:
        """An MLA layer's one call per forward: append its new latent ``[B, T, kv_lora_rank + rope]`` and get back
        the view it attends over with what it needs to mask it (`KimiK3LatentView`)."""
        layer = self.layers[layer_idx]
        had_past = layer.holds
        if layer.parts is not None:
            context = layer.parts[0]
            if layer.append_beside(latent_states):
                return KimiK3LatentView(None, context.shape[1], True, None, latent_states, context.requires_grad, context)
            layer._join()
        context_grad = had_past and layer.latent.requires_grad
        if not self.static:
            past_len = layer.length
            if layer.keep_beside(latent_states):  # (inside a graph: the buffer is not copied to append the step)
                return KimiK3LatentView(None, past_len, True, None, latent_states, context_grad, layer.parts[0])
            latent = layer.update(latent_states)[0]
            as_given = layer.latent.dtype == latent_states.dtype and layer.latent.device == latent_states.device
            step = latent_states if as_given else latent[:, past_len:]
            if as_given and not had_past:  # (a first step's latents are the tensor given: no gradient via the buffer)
                latent = latent_states
            return KimiK3LatentView(latent, past_len, had_past, None, step, context_grad)
        latent = layer.update(latent_states)[0]
        # (inside a graph a static layer's count stays on the device: the layer masks by `position`)
        past_len = 0 if torch.compiler.is_compiling() else layer.length - latent_states.shape[1]
        return KimiK3LatentView(latent, past_len, had_past, layer.position, None, context_grad)

    def layer_state(self, layer_idx: int) -> tuple[torch.Tensor, ...]:
        """One layer's held state as tensors, for a layer that runs without the cache (a gradient-checkpointed one,
        `KimiK3CarriedState`): a KDA layer's ``(recurrent state, conv window)``, an MLA layer's held latents
        ``[B, S, D]``; nothing at a sequence start. Copies where `hold_layer_state` writes in place (an MLA buffer, a
        static cache's states): checkpointing saves its inputs and refuses one changed before the backward."""
        layer = self.layers[layer_idx]
        if isinstance(layer, KimiK3MLACacheLayer):
            if not layer.holds:
                return ()
            # (latents held as given are never written: no copy)
            return (layer.held_latents(),) if layer.parts is not None else (layer.held_latents().clone(),)
        if not layer.has_state:
            return ()
        state = layer.recurrent_state, layer.conv_state
        return tuple(t.clone() for t in state) if layer.static else state

    def hold_layer_state(self, layer_idx: int, state: Sequence[torch.Tensor]) -> None:
        """Store what a layer that ran without the cache computed: a KDA layer's final ``(recurrent state, conv
        window)``, an MLA layer's new latent rows ``[B, T, D]`` (appended)."""
        if isinstance(self.layers[layer_idx], KimiK3MLACacheLayer):
            layer = self.layers[layer_idx]
            if not layer.append_beside(state[0]) and not layer.keep_beside(state[0]):
                layer.update(state[0])
        else:
            self.layers[layer_idx].update(*state)

    # ------------------------------------------------------------------------------------------ state as a whole
    def state(self, detached: bool = False, latents_from: int = 0) -> KimiK3CacheState:
        """The state held: each KDA layer's ``(recurrent state [B, H, K, V], conv window [B, 3P, K-1])`` where it
        holds one, each MLA layer's held latents (a view of its buffer) where it holds tokens. `detached`: cut from
        any graph, the KDA tensors copied (later steps update them in place), for a state that outlives the next
        forward. `latents_from`: only the latents of the tokens from there on (those a step appended: after a step
        from latents held as given, the step's latents as the tensor computed, no copy)."""
        kda, latents = {}, {}
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, KimiK3MLACacheLayer):
                if layer.holds and layer.length > latents_from:
                    latent = layer.held_latents(latents_from)
                    latents[idx] = latent.detach() if detached else latent
            elif layer.has_state:
                tensors = (layer.recurrent_state, layer.conv_state)
                kda[idx] = tuple(t.detach().clone() for t in tensors) if detached else tensors
        return KimiK3CacheState(kda, latents)

    def start_from(self, state: KimiK3CacheState) -> None:
        """Hold `state` (in an empty cache): copies of its KDA tensors (a decode step updates the held ones in place,
        which a leaf tensor refuses) and its latents appended; both stay in the graph of the tensors given. Latents
        that require grad (exact segment training) are held as the tensors given, not copied (a growing cache:
        `KimiK3MLACacheLayer.hold_as_given`); the next step's are kept beside them."""
        for idx, (recurrent, window) in state.kda.items():
            self.layers[idx].update(recurrent.clone(), window.clone())
        for idx, latent in state.latents.items():
            layer = self.layers[idx]
            if (latent.requires_grad and not self.static and not layer.holds and layer.storage_device is None
                    and layer.storage_dtype in (None, latent.dtype)):
                layer.hold_as_given(latent)
            else:
                layer.update(latent)

    def detach_(self) -> KimiK3HybridCache:
        """Cut the held state from the graph of the forward that computed it, in place (values and buffers kept);
        return the cache."""
        for layer in self.layers:
            layer.detach_()
        return self

    def holds_tokens(self, layer_idx: int | None = None) -> bool:
        """Whether the cache (or MLA layer `layer_idx`) holds any token, without reading a length from the device
        (a static cache's compiled steps leave their length there)."""
        if layer_idx is not None:
            return self.layers[layer_idx].holds
        return any(layer.holds for layer in self._latents())

    def _latents(self) -> tuple:
        """The MLA cache layers, in order (kept from construction: the layout never changes)."""
        if self._latent_layers is None:  # (a cache pickled before they were kept)
            self._latent_layers = tuple(layer for layer in self.layers if isinstance(layer, KimiK3MLACacheLayer))
        return self._latent_layers

    def _first_latent_layer(self) -> KimiK3MLACacheLayer | None:
        latents = self._latents()
        return latents[0] if latents else None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held: the MLA layer's length, the first MLA layer's for a KDA layer (its state has no length; what
        transformers before 5.25 answered for the default index, 0, a KDA layer in K3)."""
        if layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], KimiK3MLACacheLayer):
            return self.layers[layer_idx].get_seq_length()
        layer = self._first_latent_layer()
        return 0 if layer is None else layer.get_seq_length()

    def get_query_offset(self, layer_idx: int = 0):
        """The position of the next token; a static cache gives it as its device tensor (no host read, so that
        generate()'s masks for compiled steps are built without a sync, as transformers' StaticCache does)."""
        layer = self._first_latent_layer()
        if self.static and layer is not None:
            return layer.position
        return super().get_query_offset(layer_idx)

    @property
    def is_croppable(self) -> bool:
        return all(layer.is_croppable for layer in self.layers)

    # ------------------------------------------------------------------------------------------ token record
    @property
    def token_ids(self) -> torch.Tensor | None:
        """The ids this cache was built from, ``[B, S]`` int64 (S = `get_seq_length`), or None before any forward.
        ``-1`` marks a position masked by the attention mask (padding), ``-2`` one fed as ``inputs_embeds`` without
        ids (the multimodal model records the ids behind its embeddings, ``<|media_pad|>`` for media slots)."""
        held = self._synced_token_count()
        return None if self._tokens is None else self._tokens[:, :held]

    def _synced_token_count(self) -> int:
        """The record cut or extended (with unknown ids) to the layers' length: crops shorten both, and a layer
        driven directly (not through the model's forward) adds tokens the record never saw."""
        length = self.get_seq_length()
        if self.static:  # the record is written at the latents' position, unknown ids where none were given
            self._token_count = length
            return length
        if self._token_count != length:
            if length > self._token_count:
                rows = self._tokens.shape[0] if self._tokens is not None else self.batch_size
                device = self._tokens.device if self._tokens is not None else None
                self._append_tokens(torch.full((rows, length - self._token_count), UNKNOWN_TOKEN, dtype=torch.long,
                                               device=device))
            self._token_count = length
        return self._token_count

    def _append_tokens(self, ids: torch.Tensor) -> None:
        if self.static:
            layer = self._first_latent_layer()
            layer.check_room(ids.shape[1])
            if self._tokens is None:
                self._tokens = ids.new_full((ids.shape[0], layer.max_cache_len), UNKNOWN_TOKEN)
            elif self._tokens.device != ids.device:
                self._tokens = self._tokens.to(ids.device)
            # (before the layers' updates: their position is where these tokens go)
            self._tokens.index_copy_(1, torch.arange(ids.shape[1], device=ids.device) + layer.position, ids)
            return
        if self._tokens is None:
            self._tokens = ids.new_empty(ids.shape[0], max(self._token_capacity, ids.shape[1]))
        elif self._tokens.device != ids.device:
            self._tokens = self._tokens.to(ids.device)
        end = self._token_count + ids.shape[1]
        if end > self._tokens.shape[1]:  # grows by doubling, like the latents
            grown = self._tokens.new_empty(self._tokens.shape[0], max(end, 2 * self._tokens.shape[1]))
            grown[:, : self._token_count] = self._tokens[:, : self._token_count]
            self._tokens = grown
        self._tokens[:, self._token_count:end] = ids
        self._token_count = end

    def _record_tokens(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                       attention_mask: torch.Tensor | None = None, model: nn.Module | None = None) -> None:
        """`begin_step`'s record: the ids of the positions the step is about to consume (None: unknown), with
        masked positions as padding, and which model wrote them (`save` fingerprints its weights). It runs before
        the model's value checks: ids of a step refused after it lie past the layers' length, and the next sync
        (`_synced_token_count`) drops them."""
        step = inputs_embeds if inputs_embeds is not None else input_ids
        if step.dim() < 2 or 0 in step.shape[:2]:
            return  # (ids of no [batch, tokens] shape: the model's input checks name them before any layer runs)
        batch, length = step.shape[:2]
        if self._tokens is None and not torch.compiler.is_compiling() and not any(
                getattr(layer, "is_initialized", False) for layer in self.layers if isinstance(layer, KimiK3MLACacheLayer)):
            # the first forward allocates every buffer: refused here, before, when they cannot fit
            first = self._first_latent_layer()
            reserved = max(first.initial_capacity, length) if first is not None else length
            dtype = (inputs_embeds.dtype if inputs_embeds is not None else
                     _text_decoder(model).embed_tokens.weight.dtype if model is not None else torch.get_default_dtype())
            check_cache_fits(self.config, reserved, batch, first.storage_dtype or dtype if first is not None else dtype,
                             step.device, static=self.static, model=model)
        # (inside a compiled step of a static cache the length stays on the device: the batch was checked eagerly)
        held = 0 if self.static and torch.compiler.is_compiling() else self._synced_token_count()
        if held and self._tokens.shape[0] != batch:
            raise KimiK3CacheError(
                f"this KimiK3HybridCache holds {self._tokens.shape[0]} sequence(s) but the input has {batch} rows: a "
                "cache continues the batch it was built with. For beam search or several return sequences from a "
                "filled cache, call `cache.batch_repeat_interleave(n)` first; otherwise pass a fresh cache")
        if input_ids is None or tuple(input_ids.shape) != (batch, length):
            ids = torch.full((batch, length), UNKNOWN_TOKEN, dtype=torch.long, device=step.device)
        else:
            ids = input_ids.to(torch.long)
        if (attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[0] == batch
                and attention_mask.shape[-1] >= length):
            ids = ids.masked_fill(attention_mask[:, -length:].to(ids.device) == 0, PAD_POSITION)
        self._append_tokens(ids)
        if model is not None and not torch.compiler.is_compiling():
            if self._writer is None or self._writer() is not model:
                self._writer = weakref.ref(model)

    def _check_continuation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Raise `KimiK3CacheError` unless ``input_ids`` (``[B, >= S]``, the caller's whole sequence) starts with the
        S tokens this cache holds: the same rows, the same ids, padding where the cache has padding (any pad id).
        Positions the cache got as ``inputs_embeds`` without ids match any id."""
        held = self._synced_token_count()
        if not held:
            return
        rows = self._tokens.shape[0]
        what_to_do = (f"To continue from this cache, pass the whole sequence as input_ids: the {held} tokens it holds "
                      "(the sequences generate() returned with it), then the new ones, with an attention_mask of the "
                      "same length if there is padding. For another prompt, pass no past_key_values (or a fresh "
                      "KimiK3HybridCache(model.config), or call cache.reset()).")
        if input_ids.shape[0] != rows:
            raise KimiK3CacheError(
                f"this KimiK3HybridCache holds {rows} sequence(s) but input_ids has {input_ids.shape[0]} rows (beam "
                "search and num_return_sequences repeat each row: call `cache.batch_repeat_interleave(n)` first for "
                f"them). {what_to_do}")
        if input_ids.shape[1] < held:
            raise KimiK3CacheError(f"this KimiK3HybridCache holds {held} tokens but input_ids has only "
                                   f"{input_ids.shape[1]}: pass the whole sequence. {what_to_do}")
        if input_ids.device.type == "meta":
            return
        prefix = input_ids[:, :held].to(torch.long)
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[-1] >= held:
            prefix = prefix.masked_fill(attention_mask[:, :held].to(prefix.device) == 0, PAD_POSITION)
        recorded = self._tokens[:, :held].to(prefix.device)
        wrong = (recorded != prefix) & (recorded != UNKNOWN_TOKEN)
        if bool(wrong.any()):
            row, position = (int(i) for i in wrong.nonzero()[0])

            def describe(value: int) -> str:
                return "padding (attention_mask 0)" if value == PAD_POSITION else f"id {value}"

            raise KimiK3CacheError(
                f"this KimiK3HybridCache was built from other tokens than input_ids starts with: at position "
                f"{position} of row {row} the cache holds {describe(int(recorded[row, position]))}, input_ids "
                f"{describe(int(prefix[row, position]))}. A recurrent (KDA) state cannot be matched by prefix like a "
                f"key/value cache: generation would continue from another sequence's state. {what_to_do}")

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self._synced_token_count()

    def reset(self) -> None:
        super().reset()
        self._token_count = 0
        self._tokens = None
        self.media_items = None
        self._loaded_fingerprint = None  # (what it held came from the file; it holds nothing now)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self._tokens is not None:
            self._tokens = self._tokens.index_select(0, beam_idx.to(self._tokens.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self._tokens is not None:
            self._tokens = self._tokens.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self._tokens is not None:
            self._tokens = self._tokens[indices.to(self._tokens.device) if torch.is_tensor(indices) else indices]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_writer"] = None  # (a weak reference does not pickle)
        state["_in_generate"] = None  # (a copy is not the cache a running generate() holds)
        return state

    def check_reserved_fits(self, rows: int, dtype: torch.dtype, device: torch.device | None) -> None:
        """`KimiK3CacheSizeError` unless a static cache's latents of `rows` sequences fit (checked before `load` fills
        a static cache it built)."""
        check_cache_fits(self.config, self._first_latent_layer().max_cache_len, rows, dtype, device)

    def nbytes(self) -> int:
        """Bytes actually held for the cached context (MLA latents up to their length, KDA states, token ids)."""
        total = (self._synced_token_count() * self._tokens.shape[0] * self._tokens.element_size()
                 if self._tokens is not None else 0)
        for layer in self.layers:
            if isinstance(layer, KimiK3MLACacheLayer):
                total += layer.nbytes()
            elif layer.has_state:
                total += layer.conv_state.nbytes + layer.recurrent_state.nbytes
        return total


__all__ = ["NO_CACHE_STEP", "KimiK3CacheError", "KimiK3CacheFileError", "KimiK3CacheSizeError", "KimiK3CacheState",
           "KimiK3CacheStep",
           "KimiK3HybridCache", "KimiK3LatentView",
           "KimiK3KDACacheLayer", "KimiK3MLACacheLayer", "cache_bytes", "check_cache_fits", "weights_fingerprint"]
