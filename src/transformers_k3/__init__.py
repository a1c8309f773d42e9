"""Kimi K3 for Hugging Face transformers.

``import transformers_k3`` registers the K3 configs, models, tokenizer and processors with the Auto classes
(`auto.register`), so a saved directory loads with ``AutoModelForCausalLM.from_pretrained`` and no
``trust_remote_code``. Public names are imported on first use, as transformers' own ``__init__`` does.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first access)
_EXPORTS = {
    "register": "auto",
    "kernelize": "ops.kernel_layers",
    "load_small": "small",
    "export_release": "convert.export",
    "KIMI_K3_RESPONSE_TEMPLATE": "chat",
    "KimiK3ParseError": "chat",
    "KimiK3Response": "chat",
    "KimiK3ToolCall": "chat",
    "ThinkingBudgetLogitsProcessor": "chat",
    "format_kimi_k3_tool_calls": "chat",
    "parse_kimi_k3_response": "chat",
    "QuantileBalancingCallback": "balancing",
    "load_router_biases": "balancing",
    "save_router_biases": "balancing",
    "RouterBalancer": "balancing",
    "KimiK3Config": "configuration_kimi_k3",
    "KimiK3ConfigError": "configuration_kimi_k3",
    "KimiK3TextConfig": "configuration_kimi_k3",
    "KimiK3VisionConfig": "configuration_kimi_k3",
    "KimiK3InputError": "generation_kimi_k3",
    "KimiK3ForCausalLM": "modeling_kimi_k3",
    "KimiK3Mxfp4Config": "quantization_kimi_k3",
    "expert_stream": "quantization_kimi_k3",
    "KimiK3Model": "modeling_kimi_k3",
    "KimiK3PreTrainedModel": "modeling_kimi_k3",
    "KimiK3ForConditionalGeneration": "modeling_kimi_k3_vl",
    "KimiK3VLPreTrainedModel": "modeling_kimi_k3_vl",
    "KimiK3ImageProcessor": "image_processing_kimi_k3",
    "KimiK3Processor": "processing_kimi_k3",
    "KimiK3VideoProcessor": "video_processing_kimi_k3",
    "KIMI_K3_CHAT_TEMPLATE": "tokenization_kimi_k3",
    "KimiK3Tokenizer": "tokenization_kimi_k3",
    "build_test_tokenizer": "tokenization_kimi_k3",
    "KimiK3ChatError": "encoding_kimi_k3",
    "KimiK3Prompt": "encoding_kimi_k3",
    "render_kimi_k3_chat": "encoding_kimi_k3",
    "KimiK3CacheError": "cache",
    "KimiK3HybridCache": "cache",
    "KimiK3MediaError": "media_kimi_k3",
    "KimiK3ImageInputError": "image_processing_kimi_k3",
    "KimiK3VideoInputError": "video_processing_kimi_k3",
    "KimiK3ProcessorError": "processing_kimi_k3",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .auto import register
    from .balancing import QuantileBalancingCallback, RouterBalancer, load_router_biases, save_router_biases
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
    from .configuration_kimi_k3 import KimiK3Config, KimiK3ConfigError, KimiK3TextConfig, KimiK3VisionConfig
    from .encoding_kimi_k3 import KimiK3ChatError, KimiK3Prompt, render_kimi_k3_chat
    from .image_processing_kimi_k3 import KimiK3ImageInputError, KimiK3ImageProcessor
    from .media_kimi_k3 import KimiK3MediaError
    from .generation_kimi_k3 import KimiK3InputError
    from .modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3Model, KimiK3PreTrainedModel
    from .ops.kernel_layers import kernelize
    from .quantization_kimi_k3 import KimiK3Mxfp4Config, expert_stream
    from .modeling_kimi_k3_vl import KimiK3ForConditionalGeneration, KimiK3VLPreTrainedModel
    from .processing_kimi_k3 import KimiK3Processor, KimiK3ProcessorError
    from .small import load_small
    from .convert.export import export_release
    from .tokenization_kimi_k3 import KIMI_K3_CHAT_TEMPLATE, KimiK3Tokenizer, build_test_tokenizer
    from .video_processing_kimi_k3 import KimiK3VideoInputError, KimiK3VideoProcessor


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


def _started_as_cli() -> bool:
    """True while Python imports this package to run ``python -m transformers_k3``: the CLI parses its arguments
    before torch loads and registers when a command needs a model."""
    argv = getattr(sys, "orig_argv", [])
    return sys.argv[:1] == ["-m"] and "-m" in argv[:-1] and argv[argv.index("-m") + 1] == __name__


if not _started_as_cli():
    from .auto import register as _register

    _register()
