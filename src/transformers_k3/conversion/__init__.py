"""Checkpoint conversion for Kimi K3: the reusable parts behind the command-line converters in the
repository's ``conversion/`` folder.

* `keymap`      tensor names of the official / Moonshot / in-tree Kimi Linear layouts and ours;
* `quant`       MXFP4 (E2M1 + E8M0, groups of 32) and FP8 block dequantisers, an exact MXFP4 quantiser;
* `streaming`   safetensors reading one input shard at a time, in-place sharded writing, atomic output;
* `official`    official K3 -> ours; `export` ours -> official; `kimi_linear` Kimi Linear -> K3;
* `tokenizer`   tiktoken BPE model + special tokens -> a transformers fast tokenizer;
* `hf_mapping`  the load-time conversion mappings registered with transformers (``from_pretrained`` on an
  official directory).
"""

from ..safetensors_header import CheckpointError
from .hf_mapping import register_conversion_mappings
from .keymap import k3_to_official_state_dict, kimi_linear_to_k3_state_dict, official_to_k3_state_dict
from .quant import dequantize_fp8_block, dequantize_mxfp4, quantize_mxfp4
from .streaming import Checkpoint


def __getattr__(name):
    # the converters import the model classes; load them on first use
    lazy = {
        "convert_official_checkpoint": ".official",
        "plan_official_conversion": ".official",
        "export_to_official": ".export",
        "convert_kimi_linear_checkpoint": ".kimi_linear",
        "kimi_linear_config_to_k3": ".kimi_linear",
        "convert_tiktoken_tokenizer": ".tokenizer",
    }
    if name in lazy:
        import importlib

        return getattr(importlib.import_module(lazy[name], __name__), name)
    raise AttributeError(name)


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "convert_kimi_linear_checkpoint",
    "convert_official_checkpoint",
    "convert_tiktoken_tokenizer",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "export_to_official",
    "k3_to_official_state_dict",
    "kimi_linear_config_to_k3",
    "kimi_linear_to_k3_state_dict",
    "official_to_k3_state_dict",
    "plan_official_conversion",
    "quantize_mxfp4",
    "register_conversion_mappings",
]
