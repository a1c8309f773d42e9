"""`KimiK3HybridCache`: the only place that knows how K3's decoding state is stored.

* KDA layers keep a constant-size state: the last ``K-1`` pre-convolution inputs of q, k and v
  (``[B, 3P, K-1]``, model dtype, q|k|v concatenated along channels) and the fp32 recurrent state
  (``[B, H, K, V]``, fla's layout).
* MLA layers keep the compressed latent only: ``[B, S, kv_lora_rank + qk_rope_head_dim]`` (the normed
  ``c_kv`` followed by the shared ``k_pe``), never expanded K/V. The buffer grows by doubling, so a decode
  step appends in place instead of copying the whole cache as ``torch.cat`` would.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

from .configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig


def _state_signature(config: KimiK3TextConfig) -> dict:
    """The config fields that determine what a cache holds and what its numbers mean."""
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
            "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank", "layer_types",
            "attn_res_block_size", "num_experts", "routed_expert_hidden_size", "hidden_act")
    signature = {key: getattr(config, key) for key in keys}
    signature["linear_attn_config"] = {k: v for k, v in config.linear_attn_config.items()}
    return json.loads(json.dumps(signature))


class KimiK3KDACacheLayer(LinearAttentionCacheLayerMixin):
    """Conv window and recurrent state of one KDA layer."""

    is_compileable = False
    is_sliding = False

    def __init__(self, conv_width: int, max_rollback: int = 64):
        super().__init__(number_of_states=1)
        self.conv_width = conv_width  # K - 1 raw inputs per channel
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

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0) -> None:
        if conv_states is not None:
            self.device, self.dtype = conv_states.device, conv_states.dtype
            self.conv_states[0] = conv_states
            self.conv_kernel_size[0] = conv_states.shape[-1] + 1
            self.is_conv_states_initialized[0] = True
        if recurrent_states is not None:
            self.recurrent_states[0] = recurrent_states
            self.is_recurrent_states_initialized[0] = True

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Store a new conv window ``[B, 3P, K-1]`` (replaces; decode paths update it in place)."""
        if not self.is_conv_states_initialized[0]:
            self.lazy_initialization(conv_states=conv_states)
        else:
            self.conv_states[0] = conv_states
        self._mark()
        return self.conv_states[0]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Store a new fp32 recurrent state ``[B, H, K, V]``."""
        recurrent_states = recurrent_states.to(torch.float32)
        if not self.is_recurrent_states_initialized[0]:
            self.lazy_initialization(recurrent_states=recurrent_states)
        else:
            self.recurrent_states[0] = recurrent_states
        self._mark()
        return self.recurrent_states[0]

    def _mark(self) -> None:
        self.has_previous_state[0] = self.is_conv_states_initialized[0] and self.is_recurrent_states_initialized[0]

    def reset(self) -> None:
        recording = self.record_past  # (a reset cache keeps recording for assisted decoding if it was)
        self.__init__(self.conv_width, self.max_rollback)
        self.record_past = recording

    def rollback_window(self, seq_len: int) -> int:
        """How many trailing tokens of a forward of `seq_len` tokens must be run token by token and recorded."""
        return min(seq_len, self.max_rollback) if self.record_past else 0

    def record(self, raw_inputs: torch.Tensor, states: list[torch.Tensor],
               window_before: torch.Tensor | None) -> None:
        """Called by the KDA layer before it stores its new state. `raw_inputs` ``[B, 3P, T]`` are this forward's
        pre-conv q|k|v inputs; `states` holds the recurrent state before the last ``R = len(states) - 1``
        tokens of the forward and after each of them (a forward longer than R makes older history unreachable);
        `window_before` is the conv window before this forward (None at a sequence start)."""
        if self._past_inputs is None:
            window = window_before if window_before is not None else raw_inputs.new_zeros(
                *raw_inputs.shape[:2], self.conv_width)
            self._past_inputs, self._past_states = window, []
        if len(states) - 1 < raw_inputs.shape[-1] or not self._past_states:
            self._past_states = [s.clone() for s in states]
        else:
            self._past_states = self._past_states + [s.clone() for s in states[1:]]
        self._past_states = self._past_states[-(self.max_rollback + 1):]
        inputs = torch.cat([self._past_inputs, raw_inputs], dim=-1)
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

    @property
    def batch_size(self) -> int:
        return self.latent.shape[0]

    def allocate(self, batch: int, dim: int, device: torch.device | None, dtype: torch.dtype | None = None) -> None:
        """Reserve ``[batch, initial_capacity, dim]`` now (a preallocated cache fails at construction, not hours
        into a long prefill, when memory is short)."""
        dtype = self.storage_dtype or dtype or torch.get_default_dtype()
        self.latent = torch.empty(batch, self.initial_capacity, dim, dtype=dtype, device=self.storage_device or device)
        self.length = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        batch, _, dim = key_states.shape
        self.allocate(batch, dim, key_states.device, key_states.dtype)
        self.dtype, self.device = key_states.dtype, key_states.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args, **kwargs):
        """Append ``latent_states`` ``[B, T, D]``; return a view of the whole latent ``[B, S, D]``."""
        latent_states = key_states
        if not self.is_initialized:
            self.lazy_initialization(latent_states)
        elif self.device is None:  # preallocated: the first step tells where compute happens
            if tuple(latent_states.shape[::2]) != (self.latent.shape[0], self.latent.shape[2]):
                raise ValueError(
                    f"This cache was preallocated for batch {self.latent.shape[0]} and latent width "
                    f"{self.latent.shape[2]}, got [batch {latent_states.shape[0]}, width {latent_states.shape[2]}]. "
                    "Build it with the batch size you generate with (`batch_size=`) and the model's config."
                )
            self.dtype, self.device = latent_states.dtype, latent_states.device
            if self.storage_dtype is None and self.length == 0 and self.latent.dtype != latent_states.dtype:
                # reserved before the activations' dtype was known (the default dtype): store in theirs, as the
                # docstring says (a bf16 model kept fp32 latents: twice the memory), still empty so nothing is lost
                self.latent = torch.empty_like(self.latent, dtype=latent_states.dtype)
        new_len = self.length + latent_states.shape[1]
        if new_len > self.latent.shape[1]:
            capacity = max(new_len, 2 * self.latent.shape[1])
            grown = self.latent.new_empty(self.latent.shape[0], capacity, self.latent.shape[2])
            grown[:, : self.length] = self.latent[:, : self.length]
            self.latent = grown
        self.latent[:, self.length : new_len] = latent_states
        self.length = new_len
        return self.latent[:, :new_len].to(latent_states.device, latent_states.dtype, non_blocking=True), None

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.reserved:  # a buffer the user reserved (`batch_size=`) stays reserved, emptied
            self.length, self.device = 0, None
        else:
            self.latent, self.length, self.is_initialized = None, 0, False

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"`crop` takes a negative number of tokens to remove, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def _apply(self, fn) -> None:
        """The kept rows ``fn(latent)`` in a buffer of the same capacity (a reserved buffer stays reserved)."""
        if self.is_initialized:
            kept = fn(self.latent[:, : self.length])
            buffer = kept.new_empty(kept.shape[0], self.latent.shape[1], kept.shape[2])
            buffer[:, : self.length] = kept
            self.latent = buffer

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # (beam search, every step: in place, so the buffer keeps its capacity and is never regrown)
        if self.is_initialized:
            live = self.latent[:, : self.length]
            live.copy_(live.index_select(0, beam_idx.to(live.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices])

    def offload(self):
        if self.is_initialized:
            self.latent = self.latent.to("cpu", non_blocking=True)

    def prefetch(self):
        if self.is_initialized and self.latent.device != self.device:
            self.latent = self.latent.to(self.device, non_blocking=True)

    def nbytes(self) -> int:
        return 0 if not self.is_initialized else self.length * self.latent.shape[0] * self.latent.shape[2] * self.latent.element_size()


class KimiK3HybridCache(Cache):
    """Decoding state of a K3 text model: one `KimiK3KDACacheLayer` per KDA layer and one
    `KimiK3MLACacheLayer` per MLA layer, in layer order. Built by ``generate()`` by default; build it
    yourself with ``KimiK3HybridCache(model.config)`` to keep and continue a conversation."""

    def __init__(self, config: KimiK3TextConfig | KimiK3Config, max_cache_len: int | None = None,
                 batch_size: int | None = None, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, offload_latents_to: str | torch.device | None = None,
                 max_rollback: int = 64, **kwargs):
        """
        Args:
            config: the model's (text or composite) config.
            max_cache_len: tokens each MLA latent buffer holds before it grows (by doubling); set it to the
                context you will reach (prompt + new tokens) to reserve the memory once and never copy the cache.
            batch_size: with it, every MLA latent buffer is allocated now (``max_cache_len`` or 256 rows), so a
                cache that does not fit fails here; the first forward must then use this batch size.
            dtype: storage dtype of the MLA latents (default: the activations'). KDA recurrent states are fp32
                whatever this says (K3_SPEC), conv windows follow the activations.
            device: where the latents are allocated when ``batch_size`` is given (default: CPU, or the offload
                device); without ``batch_size`` everything lives with the activations.
            offload_latents_to: keep the MLA latents on this device between steps (e.g. ``"cpu"`` for a long
                context on a small GPU); each step copies them to the compute device.
            max_rollback: tokens of KDA history kept while past recording is on (assisted/prompt-lookup decoding).
        """
        text_config = config.get_text_config() if isinstance(config, KimiK3Config) else config
        self.config = text_config
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"`max_cache_len` must be a positive number of tokens, got {max_cache_len}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive number of sequences (or None: allocate on the first "
                             f"forward), got {batch_size}")
        layers = [
            KimiK3KDACacheLayer(text_config.linear_conv_kernel_size - 1, max_rollback)
            if kind == "linear_attention" else
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

    def kda_layer(self, layer_idx: int) -> KimiK3KDACacheLayer:
        return self.layers[layer_idx]

    def update_latent(self, latent_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Append an MLA layer's new latent ``[B, T, kv_lora_rank + rope]``; return the whole latent."""
        return self.layers[layer_idx].update(latent_states)[0]

    @property
    def is_croppable(self) -> bool:
        return all(layer.is_croppable for layer in self.layers)

    # ------------------------------------------------------------------------------------------ persistence
    _FORMAT = "kimi_k3_hybrid_cache"

    def save(self, path: str | os.PathLike) -> None:
        """Write the cache to one safetensors file (tensors + the text config as metadata), atomically: a long
        session (an agent trajectory, a document) can resume later without re-prefilling."""
        tensors = {}
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, KimiK3MLACacheLayer):
                if layer.is_initialized:
                    tensors[f"layers.{idx}.latent"] = layer.latent[:, : layer.length].contiguous()
            elif layer.has_state:
                tensors[f"layers.{idx}.conv_state"] = layer.conv_state.contiguous()
                tensors[f"layers.{idx}.recurrent_state"] = layer.recurrent_state.contiguous()
        metadata = {"format": self._FORMAT, "version": "1", "seq_length": str(self.get_seq_length()),
                    "config": json.dumps(_state_signature(self.config), sort_keys=True)}
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".tmp-cache-", suffix=".safetensors", dir=directory)
        os.close(fd)
        try:
            save_file({k: v.cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike, config: KimiK3TextConfig | KimiK3Config,
             device: str | torch.device = "cpu", **kwargs) -> "KimiK3HybridCache":
        """Read a cache written by `save` for a model with `config`; a cache from another architecture is
        refused with an error that names the differing fields."""
        from .conversion.streaming import CheckpointError, read_safetensors_header

        text_config = config.get_text_config() if isinstance(config, KimiK3Config) else config
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no saved KimiK3HybridCache there")
        read_safetensors_header(path)  # not safetensors, truncated, aliased offsets -> CheckpointError naming the file
        try:
            handle = safe_open(os.fspath(path), framework="pt", device=str(device))
        except Exception as error:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot be opened as a saved KimiK3HybridCache ({error})") from error
        with handle as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != cls._FORMAT:
                raise ValueError(f"{path} is not a saved KimiK3HybridCache (metadata format: {metadata.get('format')!r})")
            try:
                saved = json.loads(metadata["config"])
            except (KeyError, TypeError, json.JSONDecodeError) as error:
                raise CheckpointError(f"{path}: the cache's `config` metadata is missing or not JSON ({error}); "
                                      "the file is corrupt: save the cache again") from None
            expected = _state_signature(text_config)
            diff = sorted(k for k in set(saved) | set(expected) if saved.get(k) != expected.get(k))
            if diff:
                details = ", ".join(f"{k}: cache {saved.get(k)!r} vs model {expected.get(k)!r}" for k in diff)
                raise ValueError(f"The cache in {path} belongs to a different K3 architecture ({details}); "
                                 "it cannot be used with this model.")
            cache = cls(text_config, **kwargs)
            for idx, layer in enumerate(cache.layers):
                if isinstance(layer, KimiK3MLACacheLayer):
                    if f"layers.{idx}.latent" in f.keys():
                        layer.update(f.get_tensor(f"layers.{idx}.latent"))
                elif f"layers.{idx}.conv_state" in f.keys():
                    layer.update_conv_state(f.get_tensor(f"layers.{idx}.conv_state"))
                    layer.update_recurrent_state(f.get_tensor(f"layers.{idx}.recurrent_state"))
        return cache

    def nbytes(self) -> int:
        """Bytes actually held for the cached context (MLA latents up to their length, KDA states)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, KimiK3MLACacheLayer):
                total += layer.nbytes()
            elif layer.has_state:
                total += layer.conv_state.nbytes + layer.recurrent_state.nbytes
        return total


__all__ = ["KimiK3HybridCache", "KimiK3KDACacheLayer", "KimiK3MLACacheLayer"]
