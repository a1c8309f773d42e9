"""Kimi K3 for Hugging Face transformers.

``import transformers_k3`` registers the K3 configs and models with the Auto classes (this is the only
place that does), so a saved directory loads with ``AutoModelForCausalLM.from_pretrained`` and no
``trust_remote_code``.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import KimiK3HybridCache
from .configuration_kimi_k3 import (
    KimiK3Config,
    KimiK3ConfigError,
    KimiK3TextConfig,
    KimiK3VisionConfig,
    _route_kimi_linear_configs,
)
from .modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3Model, KimiK3PreTrainedModel

__version__ = "0.1.0"

AutoConfig.register(KimiK3TextConfig.model_type, KimiK3TextConfig, exist_ok=True)
AutoConfig.register(KimiK3VisionConfig.model_type, KimiK3VisionConfig, exist_ok=True)
AutoConfig.register(KimiK3Config.model_type, KimiK3Config, exist_ok=True)
AutoModel.register(KimiK3TextConfig, KimiK3Model, exist_ok=True)
AutoModelForCausalLM.register(KimiK3TextConfig, KimiK3ForCausalLM, exist_ok=True)
# Text-only use of a full (multimodal) K3 checkpoint: `KimiK3ForCausalLM` accepts the composite config and
# uses its `text_config`. `register()` insists on `model.config_class is config`, so go to the mapping itself.
AutoModelForCausalLM._model_mapping.register(KimiK3Config, KimiK3ForCausalLM, exist_ok=True)
_route_kimi_linear_configs()

__all__ = [
    "KimiK3Config",
    "KimiK3ConfigError",
    "KimiK3ForCausalLM",
    "KimiK3HybridCache",
    "KimiK3Model",
    "KimiK3PreTrainedModel",
    "KimiK3TextConfig",
    "KimiK3VisionConfig",
]
