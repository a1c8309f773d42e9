"""Load-time checkpoint conversion for Kimi K3, below the model (the offline converters are `transformers_k3.convert`).

* `keymap`          tensor names of the official / Moonshot / in-tree Kimi Linear layouts and ours;
* `quant`           MXFP4 (E2M1 + E8M0, groups of 32) and FP8 block dequantisers, an exact MXFP4 quantiser;
* `streaming`       safetensors reading one input shard at a time, in-place sharded writing, atomic output;
* `hf_mapping`      the load-time conversion mappings registered with transformers (``from_pretrained`` on an
  official directory);
* `release_format`  what K3's models add to ``save_pretrained`` / ``from_pretrained`` (staged saves, load checks).
"""

from ..safetensors_header import CheckpointError
from .hf_mapping import register_conversion_mappings
from .keymap import k3_to_official_state_dict, kimi_linear_to_k3_state_dict, official_to_k3_state_dict
from .quant import dequantize_fp8_block, dequantize_mxfp4, quantize_mxfp4
from .streaming import Checkpoint

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "k3_to_official_state_dict",
    "kimi_linear_to_k3_state_dict",
    "official_to_k3_state_dict",
    "quantize_mxfp4",
    "register_conversion_mappings",
]
