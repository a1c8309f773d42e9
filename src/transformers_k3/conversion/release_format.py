"""What K3's pretrained-model classes (text and multimodal) add to transformers' ``save_pretrained`` /
``from_pretrained``: staged (atomic) saves, the checkpoint checks before a load, and bitsandbytes 4-bit skips. Kept
out of the modeling file, which holds the network only. The release's layout is the exporter's (``convert/export``)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

def config_for_from_pretrained(cls, path, kwargs) -> PretrainedConfig:
    """The config a ``cls.from_pretrained(path, **kwargs)`` call will use: ``kwargs["config"]`` if it is one, else
    ``cls.config_class`` read from ``path`` (with the call's hub arguments), for the overrides that must see it
    before transformers builds the model."""
    config = kwargs.get("config")
    if isinstance(config, PretrainedConfig):
        return config
    hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only", "subfolder") if k in kwargs}
    return cls.config_class.from_pretrained(path, **hub)


def _ships_mxfp4_experts(cls, path, kwargs) -> bool:
    """Whether the checkpoint's ``config.json`` carries the release's compressed-tensors MXFP4 ``quantization_config``
    (which the config classes drop: transformers' compressed-tensors quantizer would decompress the experts), so that
    ``from_pretrained`` keeps them packed by default (`KimiK3Mxfp4Config`)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    from ..configuration_kimi_k3 import is_mxfp4_scheme

    if any(kwargs.get(k) is not None for k in ("tp_plan", "distributed_config", "device_mesh")) \
            or is_deepspeed_zero3_enabled():
        return False  # (tensor / expert parallel and ZeRO-3 shard float weights: packed experts are not split yet)
    hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only", "subfolder") if k in kwargs}
    try:
        data, _ = PretrainedConfig.get_config_dict(path, **hub)
    except (OSError, ValueError):
        return False  # (no config.json to read: transformers reports it as usual)
    text = data.get("text_config") or {}
    return is_mxfp4_scheme(data.get("quantization_config")) or is_mxfp4_scheme(text.get("quantization_config"))


def _narrow_for_bnb_4bit(cls, path, quantization_config, kwargs):
    """A copy of a bitsandbytes 4-bit ``quantization_config`` whose ``llm_int8_skip_modules`` also holds the linear
    layers its CPU kernel cannot pack (blocks of 32 output rows x 64 input columns): none at full size, in small
    configs narrow KDA / MLA / latent projections. Quantized, they fail at the first forward with a reshape error
    from inside bitsandbytes; kept in the model dtype they cost a few KB. transformers' default skips (the LM head)
    are kept and a user's list is extended, not replaced; the caller's object is left as it was."""
    import copy

    from transformers.quantizers.base import get_keys_to_not_convert

    config = config_for_from_pretrained(cls, path, kwargs)
    with torch.device("meta"):
        skeleton = cls(copy.deepcopy(config))  # (meta tensors: no memory, only the module tree)
    narrow = [name for name, module in skeleton.named_modules()
              if type(module) is nn.Linear and (module.in_features % 64 or module.out_features % 32)]
    if not narrow:
        return quantization_config
    quantization_config = copy.deepcopy(quantization_config)
    skip = quantization_config.llm_int8_skip_modules
    if skip is None:  # (a list replaces transformers' defaults: keep them)
        skip = get_keys_to_not_convert(skeleton)
    quantization_config.llm_int8_skip_modules = sorted(set(skip) | set(narrow))
    return quantization_config


def _saved_names(directory: Path) -> list[str] | None:
    import json

    from ..safetensors_header import read_safetensors_header

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}))
    single = directory / "model.safetensors"
    return list(read_safetensors_header(single)) if single.is_file() else None


def _remove_stale_weights(directory: Path, started: float) -> None:
    """A save into a directory that held the other form (one file vs an index and shards) leaves the old one,
    which transformers' loader would prefer (model.safetensors) or which the index no longer describes: remove
    the form this save did not write."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if not (single.is_file() and index.is_file()):
        return
    if index.stat().st_mtime >= started > single.stat().st_mtime:
        single.unlink()
    elif single.stat().st_mtime >= started > index.stat().st_mtime:
        import json

        stale = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        index.unlink()
        for name in stale:
            shard = directory / name
            if shard.parent == directory and shard.is_file() and shard.stat().st_mtime < started:
                shard.unlink()


def _upload_saved_directory(model, directory: Path, started: float, repo_id: str | None = None,
                            commit_message: str | None = None, create_pr: bool = False, private: bool | None = None,
                            token=None) -> None:
    """What transformers' ``save_pretrained(push_to_hub=True)`` does, once the staged save is in place: create the
    repo, add the model card, upload the files this save wrote (huggingface_hub's public ``HfApi``)."""
    from huggingface_hub import HfApi
    from transformers.utils.hub import create_and_tag_model_card

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id or directory.name, private=private, exist_ok=True).repo_id
    create_and_tag_model_card(repo_id, model.model_tags, token=token).save(str(directory / "README.md"))
    written = sorted(p.name for p in directory.iterdir() if p.is_file() and p.stat().st_mtime >= started)
    api.upload_folder(repo_id=repo_id, folder_path=directory, allow_patterns=written,
                      commit_message=commit_message or "Upload model", create_pr=create_pr)


class KimiK3ReleaseFormatMixin:
    """Mixed into K3's pretrained-model classes before transformers' PreTrainedModel."""

    # override: transformers has no hook to stage the directory around its save (atomic saves)
    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained``, written into a sibling directory and moved into place, so a failed save
        (full disk) leaves the directory as it was. The config is ours (``model_type`` ``kimi_k3`` / ``kimi_k3_text``);
        the release's layout and config come from the exporter (`transformers_k3.export_release`)."""
        import time

        started = time.time()
        if kwargs.get("push_to_hub") and kwargs.get("is_main_process", True):
            # transformers would upload from the staging directory: save, then upload what this save wrote
            hub = {key: kwargs.pop(key) for key in ("repo_id", "commit_message", "create_pr", "private")
                   if key in kwargs}
            kwargs.pop("push_to_hub")
            out = self.save_pretrained(save_directory, *args, **kwargs)
            _upload_saved_directory(self, Path(save_directory), started, token=kwargs.get("token"), **hub)
            return out
        if not kwargs.get("is_main_process", True):
            return super().save_pretrained(save_directory, *args, **kwargs)
        from .streaming import staged_save

        with staged_save(save_directory) as staging:
            out = super().save_pretrained(staging, *args, **kwargs)
        _remove_stale_weights(Path(save_directory), started)
        return out

    # override: no public hook runs before transformers reads the files (checks, bnb skips) or wraps load errors
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' ``from_pretrained``; when quantizing to bitsandbytes 4-bit (QLoRA), the linear layers its CPU
        kernel cannot pack are added to ``llm_int8_skip_modules`` first (`_narrow_for_bnb_4bit`). A local directory's
        index and shard headers are checked first (`checkpoint_checks`: duplicate or unindexed tensors, integer
        weights, files outside the directory raise `CheckpointError`)."""
        from .checkpoint_checks import check_pretrained_directory

        check_pretrained_directory(pretrained_model_name_or_path, kwargs)
        if kwargs.get("quantization_config") is None and _ships_mxfp4_experts(cls, pretrained_model_name_or_path, kwargs):
            # the release's MXFP4 experts stay packed: KimiK3Mxfp4Config (quantization_kimi_k3), by its registered name
            kwargs["quantization_config"] = {"quant_method": "k3_mxfp4", "dequantize": False}
        quantization_config = kwargs.get("quantization_config")
        if isinstance(quantization_config, dict) and quantization_config.get("load_in_4bit"):
            from transformers import BitsAndBytesConfig

            quantization_config = BitsAndBytesConfig.from_dict(quantization_config)
        if getattr(quantization_config, "load_in_4bit", False):
            kwargs["quantization_config"] = _narrow_for_bnb_4bit(cls, pretrained_model_name_or_path,
                                                                 quantization_config, kwargs)
        from .checkpoint_checks import check_hub_checkpoint

        from .hf_mapping import recording_conversion_failures
        from ..safetensors_header import CheckpointError

        kwargs = check_hub_checkpoint(pretrained_model_name_or_path, kwargs)  # a hub id: fetched, checked, pinned
        with recording_conversion_failures() as failures:
            try:
                return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
            except RuntimeError as error:
                if not failures:
                    raise
                shown = "\n  ".join(failures[:10]) + (f"\n  ... and {len(failures) - 10} more" if len(failures) > 10
                                                     else "")
                raise CheckpointError(f"{pretrained_model_name_or_path}: {len(failures)} tensor(s) cannot be loaded "
                                      f"as K3 weights:\n  {shown}") from error


__all__ = ["KimiK3ReleaseFormatMixin", "config_for_from_pretrained"]
