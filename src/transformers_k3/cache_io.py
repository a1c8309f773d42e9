"""Saving and loading a `KimiK3HybridCache` (one safetensors file, checked when read) and the weights fingerprint
that ties a saved cache to the model that made it. `KimiK3HybridCache` inherits `save` / `load` from
`KimiK3CacheIO`; the cache's errors and token-record markers live here, below the cache, so that persistence needs
nothing from cache.py."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import os
import re
import tempfile
import warnings

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig
from .safetensors_header import CheckpointError, read_safetensors_header

# Token record values that are not token ids: a position masked by the attention mask (left padding: it left the
# state untouched, so any pad id matches it) and a position fed as ``inputs_embeds`` without ids (not checkable).
PAD_POSITION, UNKNOWN_TOKEN = -1, -2


class KimiK3CacheError(ValueError):
    """A `KimiK3HybridCache` used for something it does not hold: a prompt that does not extend the tokens it was
    built from, another batch, or a saved file that is corrupt, inconsistent, or from another model."""


class KimiK3CacheFileError(KimiK3CacheError, CheckpointError):
    """A saved cache file that cannot be read as one (not safetensors, truncated, missing or malformed entries)."""


def _state_signature(config: KimiK3TextConfig) -> dict:
    """The config fields that determine what a cache holds and what its numbers mean."""
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
            "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank", "layer_types",
            "attn_res_block_size", "num_experts", "routed_expert_hidden_size", "hidden_act")
    signature = {key: getattr(config, key) for key in keys}
    signature["linear_attn_config"] = {k: v for k, v in config.linear_attn_config.items()}
    return json.loads(json.dumps(signature))


def _text_decoder(model: nn.Module) -> nn.Module:
    """The K3 text decoder (the module holding ``embed_tokens`` and ``layers``) inside a K3 model of any head."""
    for module in model.modules():
        if hasattr(module, "embed_tokens") and isinstance(getattr(module, "layers", None), nn.ModuleList):
            return module
    raise KimiK3CacheError(f"{type(model).__name__} holds no K3 text decoder (no `embed_tokens` and `layers`): pass "
                           "the K3 model whose weights built the cache")


def _module_device(module: nn.Module) -> torch.device | None:
    """Where `module` computes: accelerate's execution device when a hook places it (its weights may be offloaded
    to the CPU or meta), else its first parameter's or buffer's device."""
    hook = getattr(module, "_hf_hook", None)
    for part in (hook, *getattr(hook, "hooks", ())):  # (a SequentialHook holds several)
        execution = getattr(part, "execution_device", None)
        if execution is not None:
            return torch.device(execution)
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
    return None if tensor is None else tensor.device


def _strided_sample(tensor: torch.Tensor, values: int = 4096) -> torch.Tensor:
    """At most about `values` elements of `tensor`, evenly strided along every dimension (a view: nothing else is
    read or copied)."""
    per_dim = max(2, round(values ** (1 / max(tensor.dim(), 1))))
    return tensor[tuple(slice(None, None, max(1, -(-size // per_dim))) for size in tensor.shape)]


# An AttnRes read's key norm is hashed under its checkpoint name, as before the read's module owned it: caches saved
# then keep their fingerprint (conversion/keymap.py's attn_res_checkpoint_name; the cache does not import conversion)
_ATTN_RES_KEY_NORM = re.compile(r"(?<=_res)\.key_norm$")


def _fingerprint_samples(decoder: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The (name, strided view) pairs `weights_fingerprint` hashes: the embedding, and for every decoder layer each
    1-D parameter (norm weights, KDA decay parameters, biases), the first matrix of its attention and of its MLP /
    MoE block, and any adapter (``lora``) weight, which changes the layer without touching the base weights."""
    samples = [("embed_tokens.weight", _strided_sample(decoder.embed_tokens.weight))]
    for index, layer in enumerate(decoder.layers):
        firsts = {}
        for name, param in layer.named_parameters():
            block = name.split(".", 1)[0]
            if param.dim() <= 1 or "lora" in name:
                name = _ATTN_RES_KEY_NORM.sub("_norm.weight", name)
                samples.append((f"layers.{index}.{name}", _strided_sample(param, 1024 if param.dim() <= 1 else 4096)))
            elif block in ("self_attn", "mlp") and block not in firsts:
                firsts[block] = name
                samples.append((f"layers.{index}.{name}", _strided_sample(param)))
    return samples


def weights_fingerprint(model: nn.Module) -> str | None:
    """A SHA-256 (hex) of what determines a cache's numbers: the config's state signature (`_state_signature`) and a
    deterministic sample of the text decoder's weights (`_fingerprint_samples`: strided views of the embedding, of
    every layer's 1-D parameters and of its first attention and MLP matrices; about 4k values per matrix, 1k per
    vector). Two models with the same weights, in any device or dtype that holds them exactly (a bf16 checkpoint
    loaded in fp32), agree; another seed or fine-tune differs. At full size (93 layers, 905 tensors) about 1.3M of the
    2.8T values are read and hashed, moved in one transfer per device: a small fraction of a second, never a pass
    over the weights. Computed on each call (`save`, and `load` with ``model=``), never during generation.

    The LM head and final norm are left out (a cache's states do not depend on them), and so is the vision tower of
    the multimodal model: a cache holding image tokens is checked against the text weights only.

    Returns None when the weights cannot be read cheaply: on the meta device (``from_pretrained`` with accelerate
    offloading keeps offloaded weights there between forwards), tensor-parallel shards (DTensor), or tensor
    subclasses that do not support strided views. The check is then skipped with a warning, never failed."""
    decoder = _text_decoder(model)
    try:
        samples = _fingerprint_samples(decoder)
        if any(t.device.type == "meta" or type(t).__name__ == "DTensor" for _, t in samples):
            return None
        digest = hashlib.sha256(json.dumps(_state_signature(decoder.config), sort_keys=True).encode())
        flat = []
        for name, tensor in samples:
            digest.update(f"{name}:{tuple(tensor.shape)};".encode())
            values = tensor.detach()
            flat.append((values.float() if values.is_floating_point() else values.long()).reshape(-1).double())
        # one copy to the CPU per device, then hashed in sample order (the same bytes however the model is placed)
        on_cpu: list[torch.Tensor | None] = [None] * len(flat)
        for device in {t.device for t in flat}:
            positions = [i for i, t in enumerate(flat) if t.device == device]
            moved = torch.cat([flat[i] for i in positions]).cpu().split([flat[i].numel() for i in positions])
            for i, part in zip(positions, moved):
                on_cpu[i] = part
        digest.update(torch.cat(on_cpu).numpy().tobytes())
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return None  # a quantized or wrapped tensor type without strided views or casts
    return digest.hexdigest()


def _content_digest(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """SHA-256 (hex) over a saved cache's metadata (all but the digest itself) and every tensor's name, dtype, shape
    and bytes (CPU tensors), in name order: what `save` writes as ``content_digest`` and `load` recomputes. It ties
    the token record, the states and the metadata of one save together, so that a file edited or assembled from
    parts (latents of another conversation, a rewritten token record, a stripped fingerprint) is detected. It holds
    no secret: whoever writes the file can recompute it, so it proves integrity, not who wrote the file (that is
    what `_content_hmac` with a key kept from the file's writers adds)."""
    digest = hashlib.sha256(b"kimi_k3_hybrid_cache content v3\n")
    signed = {k: v for k, v in metadata.items() if k not in ("content_digest", "content_hmac")}
    digest.update(json.dumps(signed, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"\n{name}:{tensor.dtype}:{list(tensor.shape)}:".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _content_hmac(key: bytes, digest: str) -> str:
    """HMAC-SHA256 (hex) of a content digest under `key`: only a holder of the key can make one that matches."""
    if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
        raise KimiK3CacheError("a cache signing key must be bytes, at least 16 of them (e.g. secrets.token_bytes(32)), "
                               f"got {type(key).__name__}" + (f" of {len(key)} bytes" if isinstance(key, (bytes, bytearray)) else ""))
    return hmac.new(bytes(key), digest.encode(), hashlib.sha256).hexdigest()


class KimiK3CacheIO:
    """`save` and `load` of `KimiK3HybridCache` (which inherits them)."""

    _FORMAT = "kimi_k3_hybrid_cache"
    # 3: a content digest; 2: token ids, batch size, per-layer lengths and the weights fingerprint; 1 had none of them
    _VERSION = "3"

    def save(self, path: str | os.PathLike, model: nn.Module | None = None, key: bytes | None = None) -> None:
        """Write the cache to one safetensors file, atomically (a temporary file in the same directory, flushed to
        disk, then renamed over `path`), so that a long session (an agent trajectory, a document) can resume later
        without re-prefilling. It holds the MLA latents, the KDA states and the token ids, and as metadata the
        config's state signature, the length, the batch size, every layer's length and the `weights_fingerprint` of
        `model` (default: the model that last ran a forward on this cache, if it is still alive) for
        ``load(..., model=...)`` to check, and a content digest over all of it. With `key` (secret bytes, at least
        16) the digest is also signed (HMAC-SHA256), so that ``load(..., key=key)`` accepts only files written with the
        key: the digest alone can be recomputed by whoever rewrites the file. Nothing is pickled."""
        held = self._synced_token_count()
        tensors, lengths = {}, []
        for idx, layer in enumerate(self.layers):
            if self.config.layer_types[idx] != "linear_attention":  # an MLA layer
                length = layer.length if layer.is_initialized else 0
                if held and length:
                    tensors[f"layers.{idx}.latent"] = layer.held_latents().contiguous()
            else:
                length = held if layer.has_state else 0
                if held and layer.has_state:
                    tensors[f"layers.{idx}.conv_state"] = layer.conv_state.contiguous()
                    tensors[f"layers.{idx}.recurrent_state"] = layer.recurrent_state.contiguous()
            lengths.append(length if held else 0)
        if held:
            tensors["tokens"] = self._tokens[:, :held].contiguous()
            uneven = {idx: n for idx, n in enumerate(lengths) if n != held}
            if uneven:
                raise KimiK3CacheError(f"cannot save this cache: it holds {held} tokens but layers {uneven} (layer: "
                                       "tokens) hold other counts, so it is not one model's state; rebuild it")
        source = model if model is not None else (self._writer() if self._writer is not None else None)
        # (a cache loaded and saved again with no model run on it keeps the fingerprint it was loaded with)
        fingerprint = weights_fingerprint(source) if source is not None else self._loaded_fingerprint
        metadata = {"format": self._FORMAT, "version": self._VERSION, "seq_length": str(held),
                    "batch_size": str(self._tokens.shape[0] if held else 0), "lengths": json.dumps(lengths),
                    "weights_fingerprint": fingerprint or "",
                    "config": json.dumps(_state_signature(self.config), sort_keys=True)}
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".tmp-cache-", suffix=".safetensors", dir=directory)
        os.close(fd)
        try:
            tensors = {k: v.cpu() for k, v in tensors.items()}
            metadata["content_digest"] = _content_digest(tensors, metadata)
            if key is not None:  # (signed: `load(key=...)` then refuses any file not written with the key)
                metadata["content_hmac"] = _content_hmac(key, metadata["content_digest"])
            save_file(tensors, tmp, metadata=metadata)
            with open(tmp, "rb") as written:  # on disk before the rename: a crash leaves the old file or the new one
                os.fsync(written.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike, config: KimiK3TextConfig | KimiK3Config,
             device: str | torch.device | None = None, model: nn.Module | None = None, fingerprint: str | None = None,
             trust_unverified: bool = False, key: bytes | None = None, **kwargs) -> KimiK3CacheIO:
        """Read a cache written by `save` for a model with `config` (``kwargs`` go to the constructor, e.g.
        ``max_cache_len``). Each layer's tensors go to `device` if given, else to the device of `model`'s layer of
        that index (under a ``device_map``, each layer's own; accelerate's execution device for an offloaded one),
        else to the CPU, from where the first forward moves each layer's tensors to its activations once.
        Checked before anything is used, each failure a `KimiK3CacheError` that names it:

        * the file: safetensors with the cache's metadata, not truncated (`KimiK3CacheFileError`, also a
          `CheckpointError`, for a file that cannot be read as a cache; nothing is unpickled);
        * the architecture: the config's state signature (a cache from another architecture names the fields);
        * every tensor: present exactly for the layers that hold tokens, its dtype, and its shape against the
          metadata's length, batch and per-layer lengths and the config's widths; token ids inside the vocabulary;
        * every value: the states finite (no NaN or infinity), the token ids inside the vocabulary;
        * the content digest (`_content_digest`, written by `save`): the metadata, the token record and every state
          are those of one save, so a file edited or assembled from parts (the latents or token record of another
          conversation of the same length, a stripped fingerprint) is refused. The digest holds no secret: someone
          who rewrites the file on purpose can recompute it; keep cache files where only you can write them;
        * with `model` (or its `weights_fingerprint` as `fingerprint`): the weights fingerprint the file was saved
          with, so that a cache made by a model with other weights is refused. Without them this check is skipped;
          it is also skipped, with a warning, when the model's weights cannot be read cheaply (meta device,
          offloaded, tensor-parallel).

        Files that cannot be verified are refused unless ``trust_unverified=True`` (then loaded with a warning): an
        older format (version 1 has no token ids, so a reuse for another prompt cannot be detected; version 2 has
        no content digest), a file holding tokens but no weights fingerprint (saved with no model known), and a token
        record with unknown positions (fed as ``inputs_embeds``: they match any prompt).

        With `key` (the bytes given to ``save(key=...)``) only a file signed with that key loads, whatever
        `trust_unverified` says: the way to reuse cache files that others (a client, a shared volume) could rewrite."""
        path = os.fspath(path)
        text_config = config.get_text_config() if isinstance(config, KimiK3Config) else config
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no saved KimiK3HybridCache there")

        def corrupt(problem: str) -> KimiK3CacheFileError:
            return KimiK3CacheFileError(f"{path}: {problem}; the file is not a usable saved KimiK3HybridCache (save "
                                        "the cache again, or re-run the prompt without past_key_values)")

        try:  # not safetensors, truncated, aliased offsets: named by the header reader
            header = read_safetensors_header(path)
        except CheckpointError as error:
            raise KimiK3CacheFileError(f"{error}; it cannot be loaded as a KimiK3HybridCache") from None
        placement = cls._placement(text_config, device, model)
        try:
            handle = safe_open(path, framework="pt", device="cpu")  # (checked on the CPU, then placed)
        except Exception as error:  # safetensors raises its own error types
            raise corrupt(f"cannot be opened ({error})") from None
        with handle as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != cls._FORMAT:
                raise corrupt(f"its metadata format is {metadata.get('format')!r}, not {cls._FORMAT!r}")
            try:
                saved = json.loads(metadata["config"])
                if not isinstance(saved, dict):
                    raise TypeError("not an object")
            except (KeyError, TypeError, json.JSONDecodeError) as error:
                raise corrupt(f"the cache's `config` metadata is missing or not a JSON object ({error})") from None
            expected = _state_signature(text_config)
            diff = sorted(k for k in set(saved) | set(expected) if saved.get(k) != expected.get(k))
            if diff:
                details = ", ".join(f"{k}: cache {saved.get(k)!r} vs model {expected.get(k)!r}" for k in diff)
                raise KimiK3CacheError(f"The cache in {path} belongs to a different K3 architecture ({details}); it "
                                       "cannot be used with this model: re-run the prompt without past_key_values.")
            version = metadata.get("version")
            if version not in ("1", "2", cls._VERSION):
                raise corrupt(f"format version {version!r} is not one this transformers_k3 reads (1, 2, 3)")
            held, rows, lengths = cls._read_layout(metadata, header, text_config, version, corrupt)
            unverified = []  # what cannot be verified in this file: refused unless the caller trusts it
            if version != cls._VERSION and held:
                unverified.append(f"it is of format version {version}, written by an earlier transformers_k3 "
                                  + ("without the token ids it holds (a reuse for another prompt cannot be detected)"
                                     if version == "1" else "without a content digest (an edit cannot be detected)"))
            saved_fingerprint = metadata.get("weights_fingerprint") or None
            if saved_fingerprint is None and held and version != "1":
                unverified.append("it was saved without a weights fingerprint (no model known to save(); pass model= "
                                  "to save() next time), so the weights that made it cannot be checked")
            cls._check_fingerprint(path, saved_fingerprint, model, fingerprint, corrupt)

            wanted = cls._expected_tensors(text_config, held, rows)
            if version == "1":
                wanted.pop("tokens", None)
                header = {k: v for k, v in header.items() if held or not k.endswith(".latent")}
            missing = [name for name in wanted if name not in header]
            if missing:
                raise corrupt(f"tensors {missing} are missing (the cache holds {held} tokens, so every layer has state)")
            unexpected = sorted(set(header) - set(wanted))
            if unexpected:
                raise corrupt(f"it holds tensors no K3 cache of this config has: {unexpected}")
            for name, (shape, check_dtype, dtype_rule) in wanted.items():
                info = header[name]
                if not check_dtype(info.dtype):
                    raise corrupt(f"tensor `{name}` is {info.dtype}, a saved cache stores it as {dtype_rule}")
                if tuple(info.shape) != shape:
                    raise corrupt(f"tensor `{name}` has shape {list(info.shape)}, the metadata and config say "
                                  f"{list(shape)} ({rows} rows, {held} tokens)")
            try:
                loaded = {name: f.get_tensor(name) for name in wanted}
            except Exception as error:  # safetensors' own error types
                raise corrupt(f"its tensor data cannot be read ({error})") from None
        for name, tensor in loaded.items():
            if tensor.is_floating_point():
                bad = int((~torch.isfinite(tensor)).sum())
                if bad:
                    raise corrupt(f"tensor `{name}` holds {bad} non-finite value(s) (NaN or infinity): a model never "
                                  "writes them into its state, and they would turn every later logit into NaN")
        tokens = loaded.get("tokens")
        if tokens is not None and tokens.numel():
            low, high = int(tokens.min()), int(tokens.max())
            if low < UNKNOWN_TOKEN or high >= text_config.vocab_size:
                raise corrupt(f"its token ids span [{low}, {high}], outside this model's vocabulary "
                              f"[0, {text_config.vocab_size}) and the markers -1 (padding), -2 (unknown)")
            unknown = int((tokens == UNKNOWN_TOKEN).sum())
            if unknown:
                unverified.append(f"its token record has {unknown} unknown position(s) (fed as inputs_embeds without "
                                  "ids), which match any prompt, so a reuse for another prompt cannot be detected")
        if version == cls._VERSION:
            written = metadata.get("content_digest")
            if not written:
                raise corrupt(f"a version-{version} file carries a content digest; this one has none")
            if not hmac.compare_digest(written, _content_digest(loaded, metadata)):
                raise KimiK3CacheError(
                    f"{path}: its content digest does not match its contents: the file was changed after save() wrote "
                    "it (its states, token record or metadata edited, or parts of another saved cache spliced in). "
                    "It is refused whatever trust_unverified says; re-run the prompt without past_key_values.")
        if key is not None:  # (checked whatever trust_unverified says: the caller asked for a signed file)
            signature = metadata.get("content_hmac")
            if version != cls._VERSION or not signature or not hmac.compare_digest(
                    signature, _content_hmac(key, metadata.get("content_digest", ""))):
                raise KimiK3CacheError(
                    f"{path} is not signed with this key (" + ("no signature" if not signature else "wrong signature")
                    + "): it was not written by save(key=...) with the same key, or was changed since. Re-run the "
                    "prompt without past_key_values.")
        if unverified:
            if not trust_unverified:
                raise KimiK3CacheError(
                    f"{path} cannot be verified: {'; '.join(unverified)}. Load it with trust_unverified=True only if "
                    "you wrote it yourself and nobody else could change it; otherwise re-run the prompt without "
                    "past_key_values (and save() the new cache, which writes what is checked).")
            warnings.warn(f"{path} is loaded unverified (trust_unverified=True): {'; '.join(unverified)}",
                          stacklevel=2)
        if version == "1" and held:
            tokens = torch.full((rows, held), UNKNOWN_TOKEN, dtype=torch.long)
        if tokens is not None:
            loaded["tokens"] = tokens
        for name, tensor in list(loaded.items()):
            where = placement.get(name.split(".")[1] if name.startswith("layers.") else name)
            if where is not None and tensor.device != where:
                loaded[name] = tensor.to(where)
        tokens = loaded.get("tokens")

        cache = cls(text_config, **kwargs)
        latent = next((t for name, t in loaded.items() if name.endswith(".latent")), None)
        if cache.static and latent is not None:  # (buffers of max_cache_len positions: sized before allocation)
            cache.check_reserved_fits(rows, latent.dtype, latent.device)
        cache._loaded_fingerprint = saved_fingerprint
        if held:  # (before the latents: a static cache writes the ids at its layers' position)
            cache._append_tokens(tokens)
        for idx, layer in enumerate(cache.layers):
            if text_config.layer_types[idx] != "linear_attention":
                if f"layers.{idx}.latent" in loaded:
                    layer.update(loaded[f"layers.{idx}.latent"])
            elif f"layers.{idx}.conv_state" in loaded:
                layer.update_conv_state(loaded[f"layers.{idx}.conv_state"])
                layer.update_recurrent_state(loaded[f"layers.{idx}.recurrent_state"])
        return cache

    @staticmethod
    def _placement(config: KimiK3TextConfig, device: str | torch.device | None,
                   model: nn.Module | None) -> dict[str, torch.device]:
        """Where `load` puts each layer's tensors (keyed by layer index as a string) and the token ids
        (``"tokens"``); an absent key stays where it was read (the CPU)."""
        if device is not None:
            device = torch.device(device)
            return {"tokens": device, **{str(idx): device for idx in range(config.num_hidden_layers)}}
        if model is None:
            return {}
        decoder = _text_decoder(model)
        placement = {str(idx): _module_device(layer) for idx, layer in enumerate(decoder.layers)}
        placement["tokens"] = _module_device(decoder.embed_tokens)
        return {key: where for key, where in placement.items() if where is not None}

    @staticmethod
    def _read_layout(metadata: dict, header: dict, config: KimiK3TextConfig, version: str,
                     corrupt) -> tuple[int, int, list[int]]:
        """(tokens held, rows, per-layer lengths) from a saved cache's metadata, each checked for form and against
        the others."""

        def count(key: str) -> int:
            value = metadata.get(key)
            if not (isinstance(value, str) and value.isdigit()):
                raise corrupt(f"its `{key}` metadata is {value!r}, not a whole number")
            return int(value)

        held = count("seq_length")
        layers = config.num_hidden_layers
        if version == "1":  # (no batch or lengths recorded: the batch is the tensors')
            rows = next((info.shape[0] for info in header.values() if info.shape), 0)
            return held, rows, [held] * layers
        rows = count("batch_size")
        try:
            lengths = json.loads(metadata["lengths"])
        except (KeyError, TypeError, json.JSONDecodeError) as error:
            raise corrupt(f"its `lengths` metadata is missing or not JSON ({error})") from None
        if not (isinstance(lengths, list) and len(lengths) == layers
                and all(isinstance(n, int) and not isinstance(n, bool) for n in lengths)):
            raise corrupt(f"its `lengths` metadata must list one token count per layer ({layers}), got {lengths!r:.200}")
        if held and not rows:
            raise corrupt(f"it holds {held} tokens in a batch of 0 sequences")
        uneven = {idx: n for idx, n in enumerate(lengths) if n != held}
        if uneven:
            raise corrupt(f"its metadata says it holds {held} tokens but layers {uneven} (layer: tokens) other counts")
        return held, rows, lengths

    @staticmethod
    def _expected_tensors(config: KimiK3TextConfig, held: int, rows: int) -> dict[str, tuple]:
        """name -> (shape, dtype test, the dtype rule in words) of every tensor a cache holding `held` tokens in
        `rows` sequences has (none when it holds none)."""
        if not held:
            return {}
        floating = (lambda dtype: dtype.is_floating_point, "a floating-point dtype")
        heads, head_dim = config.linear_num_heads, config.linear_head_dim
        wanted = {"tokens": ((rows, held), lambda dtype: dtype == torch.int64, "int64")}
        for idx, kind in enumerate(config.layer_types):
            if kind == "linear_attention":
                wanted[f"layers.{idx}.conv_state"] = (
                    (rows, 3 * heads * head_dim, config.linear_conv_kernel_size - 1), *floating)
                wanted[f"layers.{idx}.recurrent_state"] = (
                    (rows, heads, head_dim, head_dim), lambda dtype: dtype == torch.float32, "float32 (K3_SPEC)")
            else:
                wanted[f"layers.{idx}.latent"] = ((rows, held, config.kv_lora_rank + config.qk_rope_head_dim), *floating)
        return wanted

    @staticmethod
    def _check_fingerprint(path: str, saved: str | None, model: nn.Module | None, fingerprint: str | None,
                           corrupt) -> None:
        if model is None and fingerprint is None:
            return
        if saved is not None and not (len(saved) == 64 and all(c in "0123456789abcdef" for c in saved)):
            raise corrupt(f"its `weights_fingerprint` metadata {saved!r:.80} is not a SHA-256 hex digest")
        current = fingerprint if fingerprint is not None else weights_fingerprint(model)
        if current is None:
            warnings.warn(f"{path}: the model's weights cannot be read cheaply (meta device, offloaded or "
                          "tensor-parallel), so the cache's weights fingerprint is not checked", stacklevel=3)
        elif saved is None:  # (refused by `load` unless the caller trusts the file)
            pass
        elif saved != current:
            raise KimiK3CacheError(
                f"The cache in {path} was made by a model with other weights (fingerprint {saved[:12]}..., this "
                f"model's {current[:12]}...): its states mean nothing to this model. Load it with the model that "
                "saved it, or re-run the prompt with this model without past_key_values.")


__all__ = ["KimiK3CacheError", "KimiK3CacheFileError", "KimiK3CacheIO", "weights_fingerprint"]
