"""Checks a local checkpoint directory before transformers' ``from_pretrained`` reads it.

transformers 5 reads the shard index and the shards itself, and trusts them: a tensor stored in a shard but not
listed in the index (or stored in two shards) is loaded from whichever shard comes last, an integer or bool tensor
where a float weight belongs is cast silently, and an index entry ``../../x.safetensors`` or ``/abs/x.safetensors``
is read from outside the directory. `check_pretrained_directory` runs the converters' checks
(`transformers_k3.conversion.streaming.scan_shards`) on the files ``from_pretrained`` is about to read, and raises
`CheckpointError` naming the file, the tensor and what to do. It reads the safetensors headers only (a few KB per
shard), never tensor data, and does nothing for hub ids, single files or GGUF.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from pathlib import Path

from .conversion.streaming import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    CheckpointError,
    read_index,
    read_json_file,
    resolve_inside,
    scan_shards,
)


def _add_variant(name: str, variant: str | None) -> str:
    if variant is None:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


def _quantizer_owns_integers(quantization) -> bool:
    """Whether a transformers quantizer will take this checkpoint's integer tensors (bitsandbytes with 4 or 8 bits,
    GPTQ, AWQ, torchao, ...): transformers ignores an unknown ``quant_method``, so the dtype check must not."""
    if not isinstance(quantization, dict):
        return False
    method = quantization.get("quant_method")
    if method in (None, "compressed-tensors"):
        return False
    if method == "bitsandbytes":
        return bool(quantization.get("load_in_4bit") or quantization.get("load_in_8bit"))
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    return method in AUTO_QUANTIZER_MAPPING


def check_pretrained_directory(pretrained_model_name_or_path, kwargs: dict) -> None:
    """Raises `CheckpointError` if the local checkpoint ``from_pretrained(pretrained_model_name_or_path,
    **kwargs)`` would read is inconsistent (see the module docstring); returns quietly otherwise, and for
    anything that is not a local directory of safetensors (transformers then reports what it finds)."""
    if pretrained_model_name_or_path is None or kwargs.get("gguf_file") or kwargs.get("state_dict") is not None:
        return
    if kwargs.get("use_safetensors") is False:
        return
    base = Path(os.fspath(pretrained_model_name_or_path))
    if not base.is_dir():
        return
    directory = base / kwargs.get("subfolder", "") if kwargs.get("subfolder") else base
    if not directory.is_dir():
        return
    variant = kwargs.get("variant")
    # transformers' order (modeling_utils._get_resolved_checkpoint_files): an explicit file named by the
    # config's `transformers_weights`, then model.safetensors, then the index
    config: dict = {}
    config_path = directory / "config.json" if (directory / "config.json").is_file() else base / "config.json"
    if config_path.is_file():
        try:
            config = read_json_file(config_path, "the model's config")
        except CheckpointError:
            config = {}  # transformers reports an unreadable config itself
    explicit = config.get("transformers_weights")
    # A checkpoint pre-quantized by a transformers quantizer (bitsandbytes, GPTQ, AWQ, torchao, ...) stores integer
    # tensors by design, and that quantizer checks them; the release's compressed-tensors MXFP4 follows our rule.
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    quantization = config.get("quantization_config") or text.get("quantization_config") or {}
    check_dtypes = not _quantizer_owns_integers(quantization)
    if isinstance(explicit, str) and explicit:
        target = resolve_inside(directory, explicit, f"{config_path} (`transformers_weights`)")
        if explicit.endswith(".safetensors.index.json"):
            _check_index(directory, target, check_dtypes)
        elif explicit.endswith(".safetensors") and target.is_file():
            scan_shards(directory, [explicit], None, check_dtypes=check_dtypes)
        return
    single = directory / _add_variant(SAFE_WEIGHTS_NAME, variant)
    index = directory / _add_variant(SAFE_WEIGHTS_INDEX_NAME, variant)
    if (single.is_file() or single.is_symlink()) and index.is_file():
        raise CheckpointError(f"{directory} holds both {single.name} and {index.name}: transformers would load "
                              f"{single.name} and ignore the shards the index lists. Remove the one that is stale.")
    if single.is_file() or single.is_symlink():
        scan_shards(directory, [single.name], None, check_dtypes=check_dtypes)
    elif index.is_file():
        _check_index(directory, index, check_dtypes)


def _check_index(directory: Path, index_path: Path, check_dtypes: bool) -> None:
    weight_map = read_index(index_path)
    scan_shards(directory, list(dict.fromkeys(weight_map.values())), weight_map, index_path, check_dtypes)

_RESOLVED_CHECK: "contextvars.ContextVar[dict | None]" = contextvars.ContextVar("k3_resolved_check", default=None)


@contextlib.contextmanager
def checking_resolved_files(pretrained_model_name_or_path, kwargs: dict):
    """For a ``from_pretrained`` by hub id (or anything that is not a local directory): run the same checks on the
    directory transformers resolves the weights to (the hub cache's snapshot), after the download and before the
    weights are read. Thread-safe: the hook on transformers' resolver acts only inside this context."""
    local = pretrained_model_name_or_path is not None and Path(os.fspath(pretrained_model_name_or_path)).is_dir()
    if local or pretrained_model_name_or_path is None:
        yield
        return
    _install_resolver_hook()
    token = _RESOLVED_CHECK.set({k: v for k, v in kwargs.items() if k != "subfolder"})
    try:
        yield
    finally:
        _RESOLVED_CHECK.reset(token)


def _install_resolver_hook() -> None:
    import transformers.modeling_utils as modeling_utils

    original = modeling_utils._get_resolved_checkpoint_files
    if getattr(original, "_k3_checked", False):
        return

    def resolved(*args, **kwargs):
        files, metadata = original(*args, **kwargs)
        check_kwargs = _RESOLVED_CHECK.get()
        if check_kwargs is not None and files:
            check_pretrained_directory(Path(files[0]).parent, check_kwargs)
        return files, metadata

    resolved._k3_checked = True
    modeling_utils._get_resolved_checkpoint_files = resolved


__all__ = ["CheckpointError", "check_pretrained_directory", "checking_resolved_files"]
