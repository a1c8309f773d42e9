"""Kimi K3 for Hugging Face transformers.

``import transformers_k3`` registers the K3 configs and models with the Auto classes (this is the only
place that does), so a saved directory loads with ``AutoModelForCausalLM.from_pretrained`` and no
``trust_remote_code``.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
)
from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING
from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING

from .balancing import RouterBalancer, load_router_biases, save_router_biases
from .cache import KimiK3CacheError, KimiK3HybridCache
from .chat import (
    KIMI_K3_RESPONSE_TEMPLATE,
    KimiK3ParseError,
    KimiK3Response,
    KimiK3ToolCall,
    ThinkingBudgetLogitsProcessor,
    format_kimi_k3_tool_calls,
    parse_kimi_k3_response,
)
from .configuration_kimi_k3 import (
    KimiK3Config,
    KimiK3ConfigError,
    KimiK3TextConfig,
    KimiK3VisionConfig,
    _route_kimi_linear_configs,
)
from .conversion import register_conversion_mappings
from .modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3InputError, KimiK3Model, KimiK3PreTrainedModel
from .image_processing_kimi_k3 import KimiK3ImageProcessor
from .modeling_kimi_k3_vl import KimiK3ForConditionalGeneration, KimiK3VLPreTrainedModel
from .processing_kimi_k3 import KimiK3Processor
from .small import load_small
from .encoding_kimi_k3 import KimiK3ChatError, KimiK3Prompt, render_kimi_k3_chat
from .tokenization_kimi_k3 import KIMI_K3_CHAT_TEMPLATE, KimiK3Tokenizer, build_test_tokenizer
from .video_processing_kimi_k3 import KimiK3VideoProcessor

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
# Official checkpoints load directly (fused experts, MXFP4 dequantised, name aliases): transformers' conversion
# mappings for our model types; see `conversion/hf_mapping.py` for what loading and saving then do.
register_conversion_mappings()
# Vision: image-text-to-text model, image/video processors, processor (pipeline("image-text-to-text") works).
AutoModelForImageTextToText.register(KimiK3Config, KimiK3ForConditionalGeneration, exist_ok=True)
# AutoImageProcessor requires Pillow and AutoVideoProcessor torchvision (the base install has neither: Pillow is
# needed only when an image is processed), and their `register` is guarded by that, so register through the mappings.
IMAGE_PROCESSOR_MAPPING.register(KimiK3Config, {"pil": KimiK3ImageProcessor}, exist_ok=True)
VIDEO_PROCESSOR_MAPPING.register(
    KimiK3Config, {"pil": KimiK3VideoProcessor, "torchvision": KimiK3VideoProcessor}, exist_ok=True
)
AutoProcessor.register(KimiK3Config, KimiK3Processor, exist_ok=True)
# K3's tokenizer (Python chat rendering): found by name from tokenizer_config.json's tokenizer_class.
for _config in (KimiK3Config, KimiK3TextConfig):
    AutoTokenizer.register(_config, tokenizer_class=KimiK3Tokenizer, exist_ok=True)

def __getattr__(name: str):
    if name == "QuantileBalancingCallback":  # (made on first use: see balancing.__getattr__)
        from . import balancing

        return balancing.QuantileBalancingCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "load_small",
    "KIMI_K3_RESPONSE_TEMPLATE",
    "KimiK3ParseError",
    "KimiK3Response",
    "KimiK3ToolCall",
    "ThinkingBudgetLogitsProcessor",
    "format_kimi_k3_tool_calls",
    "parse_kimi_k3_response",
    "QuantileBalancingCallback",
    "load_router_biases",
    "save_router_biases",
    "RouterBalancer",
    "KimiK3Config",
    "KimiK3ConfigError",
    "KimiK3InputError",
    "KimiK3ForCausalLM",
    "KimiK3ForConditionalGeneration",
    "KimiK3ImageProcessor",
    "KimiK3Processor",
    "KimiK3VideoProcessor",
    "KimiK3VLPreTrainedModel",
    "KIMI_K3_CHAT_TEMPLATE",
    "build_test_tokenizer",
    "KimiK3ChatError",
    "KimiK3Prompt",
    "KimiK3Tokenizer",
    "render_kimi_k3_chat",
    "KimiK3CacheError",
    "KimiK3HybridCache",
    "KimiK3Model",
    "KimiK3PreTrainedModel",
    "KimiK3TextConfig",
    "KimiK3VisionConfig",
]
