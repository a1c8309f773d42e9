"""K3's entries in transformers' Auto classes: the one place that registers them (`transformers_k3.register`)."""

from __future__ import annotations

_registered = False


def register() -> None:
    """Register K3's configs, models, tokenizer and processors with transformers' Auto classes (idempotent).

    ``import transformers_k3`` calls this, so a saved directory loads with ``AutoModelForCausalLM.from_pretrained``
    (and ``AutoModelForMultimodalLM``, ``AutoModelForImageTextToText``, ``pipeline()``, ``transformers serve``) with no
    ``trust_remote_code``.
    """
    global _registered
    if _registered:
        return
    import transformers
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

    from .configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig, KimiK3VisionConfig, KimiLinearAutoConfig
    from .conversion import register_conversion_mappings
    from .image_processing_kimi_k3 import KimiK3ImageProcessor
    from .modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3Model
    from .modeling_kimi_k3_vl import KimiK3ForConditionalGeneration
    from .processing_kimi_k3 import KimiK3Processor
    from .tokenization_kimi_k3 import KimiK3Tokenizer
    from .video_processing_kimi_k3 import KimiK3VideoProcessor

    AutoConfig.register(KimiK3TextConfig.model_type, KimiK3TextConfig, exist_ok=True)
    AutoConfig.register(KimiK3VisionConfig.model_type, KimiK3VisionConfig, exist_ok=True)
    AutoConfig.register(KimiK3Config.model_type, KimiK3Config, exist_ok=True)
    AutoModel.register(KimiK3TextConfig, KimiK3Model, exist_ok=True)
    AutoModelForCausalLM.register(KimiK3TextConfig, KimiK3ForCausalLM, exist_ok=True)
    # Text-only use of a full K3 checkpoint: `register()` insists on `model.config_class is config`, so the mapping.
    AutoModelForCausalLM._model_mapping.register(KimiK3Config, KimiK3ForCausalLM, exist_ok=True)
    # A flat K3 `kimi_linear` config reaches KimiK3TextConfig; a genuine one stays transformers' KimiLinearConfig.
    AutoConfig.register("kimi_linear", KimiLinearAutoConfig, exist_ok=True)
    # Official checkpoints load directly: conversion mappings for our model types (see conversion/hf_mapping.py).
    register_conversion_mappings()
    # quantization_config=KimiK3Mxfp4Config(): the release's MXFP4 experts kept packed (its import registers the
    # quantizer, its config and the "k3_mxfp4" experts function with transformers)
    from . import quantization_kimi_k3  # noqa: F401

    # Vision: every Auto class transformers 5 asks for a multimodal LM (pipeline, `transformers serve`).
    AutoModelForImageTextToText.register(KimiK3Config, KimiK3ForConditionalGeneration, exist_ok=True)
    multimodal = getattr(transformers, "AutoModelForMultimodalLM", None)
    if multimodal is not None:
        multimodal.register(KimiK3Config, KimiK3ForConditionalGeneration, exist_ok=True)
    # AutoImageProcessor / AutoVideoProcessor `register` need Pillow / torchvision, which the base install lacks.
    IMAGE_PROCESSOR_MAPPING.register(KimiK3Config, {"pil": KimiK3ImageProcessor}, exist_ok=True)
    VIDEO_PROCESSOR_MAPPING.register(
        KimiK3Config, {"pil": KimiK3VideoProcessor, "torchvision": KimiK3VideoProcessor}, exist_ok=True
    )
    AutoProcessor.register(KimiK3Config, KimiK3Processor, exist_ok=True)
    for config in (KimiK3Config, KimiK3TextConfig):
        AutoTokenizer.register(config, tokenizer_class=KimiK3Tokenizer, exist_ok=True)
    _registered = True
