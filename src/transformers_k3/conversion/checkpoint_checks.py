"""Checks a local checkpoint directory before transformers' ``from_pretrained`` reads it.

transformers 5 reads the shard index and the shards itself, and trusts them: a tensor stored in a shard but not
listed in the index (or stored in two shards) is loaded from whichever shard comes last, an integer or bool tensor
where a float weight belongs is cast silently, and an index entry ``../../x.safetensors`` or ``/abs/x.safetensors``
is read from outside the directory. `check_pretrained_directory` runs the converters' checks
(`transformers_k3.conversion.streaming.scan_shards`) on the files ``from_pretrained`` is about to read, and raises
`CheckpointError` naming the file, the tensor and what to do. It reads the safetensors headers only (a few KB per
shard), never tensor data, and does nothing for single files or GGUF; a hub id's files are fetched into the hub
cache first and checked there (`check_hub_checkpoint`).

Beyond the converters' checks, what only ``from_pretrained`` needs: an FP8 weight (transformers would read it
unscaled: with its scale it belongs to the converter, without one it is refused everywhere), integer tensors a
configured quantizer does not store (an int32 weight behind a bitsandbytes config), and a config whose parameter
count is absurd for the bytes on disk (`check_config_fits_files`, which the converters call too).
"""

from __future__ import annotations

import os
from pathlib import Path

from .streaming import (
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


def _quantizer_integer_dtypes(quantization) -> tuple | None:
    """The integer dtypes the configured quantizer stores, where it is known to store only those (bitsandbytes: uint8
    4-bit packs and states, int8 8-bit weights); None where any may belong to it (GPTQ's and AWQ's int32 packs...)."""
    import torch

    if isinstance(quantization, dict) and quantization.get("quant_method") == "bitsandbytes":
        return (torch.uint8,) if quantization.get("load_in_4bit") else (torch.int8, torch.uint8)
    return None


def _check_quantized_tensors(tensors: dict, quantization, owned: bool) -> None:
    """What transformers would load silently wrong: an FP8 weight where no quantizer takes it (read unscaled), and an
    integer tensor of a dtype the configured quantizer never stores (it loads, then fails inside the quantizer)."""
    from .quant import FP8_DTYPES, FP8_SCALE_MISSING, fp8_weights_without_scale

    if not _quantizer_takes_fp8(quantization):
        dtypes = {name: info.dtype for name, info in tensors.items()}
        unscaled = fp8_weights_without_scale(dtypes)
        if unscaled:
            info = tensors[unscaled[0]]
            raise CheckpointError(f"{info.where()}: {FP8_SCALE_MISSING}; read unscaled its values would be off by their "
                                  "scale: re-download the checkpoint or re-export it with its scales")
        fp8 = [name for name, dtype in dtypes.items() if dtype in FP8_DTYPES and name.endswith(".weight")]
        if fp8:
            raise CheckpointError(
                f"{tensors[fp8[0]].where()}: FP8 weight with a block scale ({len(fp8)} such weights); from_pretrained "
                "would read it unscaled: convert the checkpoint first (conversion/convert_k3_official_to_hf.py "
                "dequantises FP8 weights exactly)")
    allowed = _quantizer_integer_dtypes(quantization) if owned else None
    if allowed is not None:
        for name, info in tensors.items():
            if not info.dtype.is_floating_point and info.dtype not in allowed:
                shown = ", ".join(str(d).replace("torch.", "") for d in allowed)
                raise CheckpointError(
                    f"{info.where()}: stored as {str(info.dtype).replace('torch.', '')}, which the configured "
                    f"quantizer ({quantization.get('quant_method')}) never stores (its integer tensors are {shown}); "
                    "the file is corrupt or its quantization_config is wrong: re-download or re-quantize it")


# transformers quantizers whose checkpoints may hold FP8 weights with their scales (bitsandbytes, GPTQ, AWQ... never do)
_FP8_QUANTIZERS = ("fp8", "fbgemm_fp8", "compressed-tensors", "quark", "torchao", "quanto", "mxfp8", "fp_quant")


def _quantizer_takes_fp8(quantization) -> bool:
    """Whether transformers builds a quantizer that reads FP8 weights with their scales (fbgemm / finegrained FP8,
    compressed-tensors FP8 schemes...); the release's compressed-tensors MXFP4 is dequantised by this package instead."""
    from ..configuration_kimi_k3 import is_mxfp4_scheme

    if not isinstance(quantization, dict) or quantization.get("quant_method") not in _FP8_QUANTIZERS:
        return False
    return not is_mxfp4_scheme(quantization)


# The fewest bytes a weight takes on disk (4-bit: MXFP4, NF4...) and how far a config may outgrow its files (a
# checkpoint holding part of the weights, a model grown from it) before it is refused as absurd.
_MIN_BYTES_PER_PARAMETER = 0.5
_GROWTH_ALLOWED = 4
_SLACK_BYTES = 2**30


def check_config_fits_files(config, weight_bytes: int, where) -> None:
    """Raises `CheckpointError` when ``config`` implies a model whose weights need, even at 4 bits, more than
    ``_GROWTH_ALLOWED`` times the ``weight_bytes`` its safetensors files hold (plus 1 GiB): such a config (say
    ``hidden_size: 10**6``) does not belong to these files, and building its model would exhaust memory. Computed from
    the config's fields (`parameter_count`), before anything is allocated; every reader calls it."""
    count = config.parameter_count()
    needed = count * _MIN_BYTES_PER_PARAMETER
    if needed > _GROWTH_ALLOWED * weight_bytes + _SLACK_BYTES:
        raise CheckpointError(
            f"{where}: the config describes a model of about {count:.3g} parameters (at least {needed / 1e9:.3g} GB "
            f"even at 4 bits), but the checkpoint's safetensors files hold {weight_bytes / 1e9:.3g} GB of weights: the "
            "config does not belong to these files (a size field such as hidden_size, num_experts or vocab_size is "
            "wrong); fix config.json or re-download the checkpoint")


def _config_fits(config, config_dict: dict, tensors: dict, where) -> None:
    from ..configuration_kimi_k3 import KimiK3ConfigError, load_k3_config

    if config is None:
        if config_dict.get("model_type") not in ("kimi_k3", "kimi_k3_text", "kimi_linear"):
            return  # no config of ours: transformers reports what it finds

        try:
            config, _ = load_k3_config(config_dict)
        except KimiK3ConfigError:
            raise
        except Exception:
            return  # not a K3 config: transformers reports what it finds
    if hasattr(config, "parameter_count"):
        check_config_fits_files(config, sum(info.nbytes for info in tensors.values()), where)


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
    if not isinstance(quantization, dict):
        quantization = {}
    owned = _quantizer_owns_integers(quantization)
    check_dtypes = not owned
    tensors = None
    if isinstance(explicit, str) and explicit:
        target = resolve_inside(directory, explicit, f"{config_path} (`transformers_weights`)")
        if explicit.endswith(".safetensors.index.json"):
            tensors = _check_index(directory, target, check_dtypes)
        elif explicit.endswith(".safetensors") and target.is_file():
            tensors = scan_shards(directory, [explicit], None, check_dtypes=check_dtypes)[1]
    else:
        single = directory / _add_variant(SAFE_WEIGHTS_NAME, variant)
        index = directory / _add_variant(SAFE_WEIGHTS_INDEX_NAME, variant)
        if (single.is_file() or single.is_symlink()) and index.is_file():
            raise CheckpointError(f"{directory} holds both {single.name} and {index.name}: transformers would load "
                                  f"{single.name} and ignore the shards the index lists. Remove the one that is stale.")
        if single.is_file() or single.is_symlink():
            tensors = scan_shards(directory, [single.name], None, check_dtypes=check_dtypes)[1]
        elif index.is_file():
            tensors = _check_index(directory, index, check_dtypes)
    if tensors is None:
        return
    _check_quantized_tensors(tensors, quantization, owned)
    given = kwargs.get("config")
    _config_fits(given if given is not None and hasattr(given, "parameter_count") else None, config, tensors,
                 config_path)


def _check_index(directory: Path, index_path: Path, check_dtypes: bool) -> dict:
    weight_map = read_index(index_path)
    return scan_shards(directory, list(dict.fromkeys(weight_map.values())), weight_map, index_path, check_dtypes)[1]

def check_hub_checkpoint(pretrained_model_name_or_path, kwargs: dict) -> dict:
    """For a ``from_pretrained`` by hub id: fetch into the hub cache the files transformers reads (config.json,
    then the config's ``transformers_weights``, or ``model.safetensors``, or the index and its shards, in
    transformers' order) with huggingface_hub's public ``hf_hub_download``, run `check_pretrained_directory` on that
    snapshot, and return ``kwargs`` with ``revision`` pinned to the checked commit, so ``from_pretrained`` reads
    exactly the files checked (and finds them cached). A local directory, or a repo whose files cannot be fetched
    here, is returned unchanged: transformers reports that itself."""
    if pretrained_model_name_or_path is None or kwargs.get("gguf_file") or kwargs.get("state_dict") is not None \
            or kwargs.get("use_safetensors") is False or os.path.isdir(os.fspath(pretrained_model_name_or_path)):
        return kwargs
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    hub = {key: kwargs[key] for key in ("subfolder", "revision", "cache_dir", "token", "local_files_only",
                                        "force_download") if kwargs.get(key) not in (None, "")}

    def fetch(filename: str) -> Path | None:
        try:
            return Path(hf_hub_download(str(pretrained_model_name_or_path), filename, **hub))
        except (EntryNotFoundError, HfHubHTTPError, OSError, ValueError):
            return None  # missing here: transformers names what it cannot find

    config_path = fetch("config.json")
    if config_path is None:
        return kwargs
    try:
        config = read_json_file(config_path, "the model's config")
    except CheckpointError:
        return kwargs  # transformers reports an unreadable config itself
    explicit = config.get("transformers_weights")
    variant = kwargs.get("variant")
    names = [explicit] if isinstance(explicit, str) and explicit else \
        [_add_variant(SAFE_WEIGHTS_NAME, variant), _add_variant(SAFE_WEIGHTS_INDEX_NAME, variant)]
    for name in names:
        found = fetch(name)
        if found is None:
            continue
        if name.endswith(".safetensors.index.json"):
            for shard in dict.fromkeys(read_index(found).values()):
                fetch(shard)
        break
    snapshot = config_path.parent
    for _ in Path(kwargs.get("subfolder") or "").parts:
        snapshot = snapshot.parent
    check_pretrained_directory(snapshot, kwargs)
    # the snapshot directory is named by its commit: from_pretrained then reads these files, not a newer revision
    return {**kwargs, "revision": snapshot.name, "force_download": False}


__all__ = ["CheckpointError", "check_config_fits_files", "check_hub_checkpoint", "check_pretrained_directory"]
