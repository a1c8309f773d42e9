"""`KimiK3Processor`: image processor + video processor + tokenizer, and the K3 prompt format.

``processor.apply_chat_template`` renders with K3's Python renderer (`render_kimi_k3_chat`): one image slot per
image part and one video slot per video part, as control segments of a `KimiK3Prompt`. Only those slots take media:
a ``<|media_pad|>`` or ``<|kimi_image_placeholder|>`` typed in message text stays text. A plain ``str`` prompt is
the caller's own prompt text: there ``<|media_pad|>`` / ``<|kimi_image_placeholder|>`` mark images and
``<|kimi_video_placeholder|>`` videos. The processor expands each slot in text order (K3_SPEC.md 7.7):

* image ``i`` -> ``<|media_begin|>image {W}x{H}<|media_content|>`` + ``N_i`` x ``<|media_pad|>`` + ``<|media_end|>``,
  where ``W x H`` is the image's original (uploaded) size and ``N_i = gh * gw / 4``;
* video ``j`` -> for each chunk of at most 4 frames, ``HH:MM:SS.mmm<|media_begin|>video<|media_content|>`` + the
  chunk's ``<|media_pad|>`` tokens + ``<|media_end|>`` (K2.5-style; the release's video prompt is unknown).

Images and videos share the one placeholder id, so the processor also returns ``mm_token_type_ids`` (1 for image
slots, 2 for video slots) when a batch has media; the model uses it to put each feature in its slot.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin
from transformers.utils import logging

from .image_processing_kimi_k3 import KimiK3ImageProcessor, flatten_images
from .encoding_kimi_k3 import IMAGE_PLACEHOLDER, KimiK3Prompt, Segment
from .media_kimi_k3 import MEDIA_OPTIONS, KimiK3MediaError, MediaPolicy
from .tokenization_kimi_k3 import (
    KIMI_K3_CHAT_TEMPLATE,
    MEDIA_PAD,
    VIDEO_PLACEHOLDER,
    apply_kimi_k3_chat_template,
    guard_jinja_template,
    is_kimi_k3_template,
    tokenize_prompts,
)
from .video_processing_kimi_k3 import KimiK3VideoProcessor, format_timestamp

logger = logging.get_logger(__name__)

IMAGE_TYPE_ID, VIDEO_TYPE_ID = 1, 2

_TEXT_KWARGS = ("padding", "padding_side", "truncation", "max_length", "add_special_tokens", "pad_to_multiple_of",
                "return_attention_mask", "return_token_type_ids", "return_length", "verbose", "return_generated_mask")
_VIDEO_KWARGS = ("fps", "num_frames", "do_sample_frames", "video_metadata")
_IMAGE_KWARGS = ("do_resize",)


class KimiK3ProcessorError(ValueError):
    """The text and the media handed to the processor do not fit together."""


class KimiK3Processor(ProcessorMixin):
    r"""Kimi K3 processor.

    Args:
        image_processor ([`KimiK3ImageProcessor`]): resizes and patchifies images.
        video_processor ([`KimiK3VideoProcessor`]): samples, chunks and patchifies videos.
        tokenizer: the K3 tokenizer (any transformers tokenizer with the K3 special tokens).
        chat_template (`str`, *optional*): defaults to the K3 template (`KIMI_K3_CHAT_TEMPLATE`).
        allowed_local_media_path (`str | list[str]`, *optional*): directories whose files a message (or a string
            image / video) may name; none by default. ``..`` and symbolic links are resolved before the check.
        allow_remote_media (`bool`, defaults to False): fetch ``http(s)`` URLs that messages name.
        allow_private_network_media (`bool | list[str]`, defaults to False): with remote media on, also hosts that
            resolve to loopback / link-local / private / reserved addresses (True), or those in the given networks.
        max_media_bytes (`int`, defaults to 64 MiB): most bytes read for one medium (download, file or base64).
        media_timeout (`float`, defaults to 10): seconds for a whole download (connect, redirects and body).

    The media options are the caller's, never a checkpoint's: ``save_pretrained`` does not write them and a
    ``processor_config.json`` that holds them is ignored with a warning; pass them to ``from_pretrained`` or here.
    Data URLs and in-memory images are always accepted. Images above the image processor's ``max_image_pixels``
    are refused from their header, before decoding.
    """

    image_token = MEDIA_PAD
    video_token = VIDEO_PLACEHOLDER

    def __init__(self, image_processor=None, video_processor=None, tokenizer=None, chat_template=None,
                 allowed_local_media_path=None, allow_remote_media=False, allow_private_network_media=False,
                 max_media_bytes=None, media_timeout=None, **kwargs):
        if chat_template is None:
            chat_template = getattr(tokenizer, "chat_template", None) or KIMI_K3_CHAT_TEMPLATE
        super().__init__(image_processor, video_processor, tokenizer, chat_template=chat_template, **kwargs)
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.media_policy = MediaPolicy.create(allowed_local_media_path, allow_remote_media,
                                               allow_private_network_media, max_media_bytes, media_timeout)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """As transformers' ``from_pretrained``; the media options (see the class docstring) and the image
        processor's ``max_image_pixels`` are taken here, so they do not leak into the tokenizer's saved config."""
        media = {key: kwargs.pop(key) for key in MEDIA_OPTIONS if key in kwargs}
        pixels = kwargs.pop("max_image_pixels", False)
        processor = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        # always the caller's options (or the defaults), whatever path the checkpoint's config took into __init__
        processor.media_policy = MediaPolicy.create(**media)
        if pixels is not False:
            processor.image_processor.max_image_pixels = pixels
        return processor

    @staticmethod
    def _without_media_options(processor_dict: dict) -> dict:
        """A ``processor_config.json`` cannot widen what messages may load: a checkpoint is someone else's file."""
        processor_dict = dict(processor_dict)
        found = sorted(key for key in MEDIA_OPTIONS if processor_dict.pop(key, None) is not None)
        if found:
            logger.warning(f"processor_config.json sets {found}, which are ignored: media options are the caller's; "
                           "pass them to KimiK3Processor.from_pretrained(...) instead")
        return processor_dict

    @classmethod
    def from_dict(cls, processor_dict, **kwargs):
        return super().from_dict(cls._without_media_options(processor_dict), **kwargs)

    @classmethod
    def from_args_and_dict(cls, args, processor_dict, **kwargs):
        """(transformers 5.23 builds a loaded processor here rather than in ``from_dict``)"""
        return super().from_args_and_dict(args, cls._without_media_options(processor_dict), **kwargs)

    def to_dict(self):
        out = super().to_dict()
        for key in MEDIA_OPTIONS + ("media_policy",):
            out.pop(key, None)
        return out

    def load_image(self, source):
        """One image a message or the caller names: a string is read as the media policy allows and refused above
        the image processor's ``max_image_pixels`` before decoding; anything else is returned as given."""
        if isinstance(source, str):
            return self.media_policy.open_image(source, self.image_processor.max_image_pixels)
        return source

    def load_video(self, source):
        """One video a message or the caller names: a string is read and decoded as the media policy allows."""
        return self.media_policy.load_video(source) if isinstance(source, str) else source

    def check_argument_for_proper_class(self, argument_name, argument):
        """transformers 5.23 resolves the expected base class by name, which fails for video processors
        (``VideoProcessorMixin`` is not exported, and the lookup trips over backend-keyed registrations)."""
        from transformers.image_processing_base import ImageProcessingMixin
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.video_processing_utils import VideoProcessorMixin

        expected = {"image_processor": ImageProcessingMixin, "video_processor": VideoProcessorMixin,
                    "tokenizer": PreTrainedTokenizerBase}[argument_name]
        if not isinstance(argument, expected):
            raise TypeError(f"Received a {type(argument).__name__} for argument {argument_name}, but a "
                            f"{expected.__name__} was expected.")
        return expected

    @classmethod
    def _get_arguments_from_pretrained(cls, pretrained_model_name_or_path, processor_dict=None, **kwargs):
        """Our image and video processors are loaded by class (AutoVideoProcessor needs torchvision, which the K3
        video processor does not); the tokenizer through AutoTokenizer."""
        from transformers import AutoTokenizer

        kwargs.pop("subfolder", None)
        processor_dict = processor_dict or {}
        image_processor = (KimiK3ImageProcessor(**_strip(processor_dict["image_processor"]))
                           if "image_processor" in processor_dict
                           else KimiK3ImageProcessor.from_pretrained(pretrained_model_name_or_path, **kwargs))
        video_processor = (KimiK3VideoProcessor(**_strip(processor_dict["video_processor"]))
                           if "video_processor" in processor_dict else KimiK3VideoProcessor())
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs)
        return [image_processor, video_processor, tokenizer]

    # ---------------------------------------------------------------------------------------------- call
    def __call__(self, images: Any = None, text: str | list[str] | None = None, videos: Any = None,
                 return_tensors: str | None = None, **kwargs) -> BatchFeature:
        """Tokenise ``text`` with its media placeholders expanded, and preprocess the media.

        Returns ``input_ids``, ``attention_mask``, and when there are media ``pixel_values`` / ``image_grid_thw``,
        ``pixel_values_videos`` / ``video_grid_thw`` (one grid row per chunk) and ``mm_token_type_ids``."""
        if text is None:
            raise KimiK3ProcessorError("KimiK3Processor needs `text` (with one placeholder per image and per video)")
        for key in ("text_kwargs", "images_kwargs", "videos_kwargs"):
            kwargs.update(kwargs.pop(key, None) or {})
        kwargs.pop("return_mm_token_type_ids", None)
        text_kwargs = {k: kwargs.pop(k) for k in _TEXT_KWARGS if k in kwargs}
        video_kwargs = {k: kwargs.pop(k) for k in _VIDEO_KWARGS if k in kwargs}
        image_kwargs = {k: kwargs.pop(k) for k in _IMAGE_KWARGS if k in kwargs}
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k not in ("audio", "return_dict")}
        if kwargs:
            logger.warning_once(f"KimiK3Processor ignores the arguments {sorted(kwargs)}")
        texts = [text] if isinstance(text, str) else list(text)

        images = [self.load_image(image) for image in flatten_images(images)]
        videos = [self.load_video(video) for video in self.video_processor.as_video_list(videos)]
        n_image_slots = sum(_count_slots(t, _IMAGE_SLOTS) for t in texts)
        n_video_slots = sum(_count_slots(t, (self.video_token,)) for t in texts)
        if n_image_slots != len(images):
            raise KimiK3ProcessorError(
                f"the text has {n_image_slots} image placeholders ({self.image_token} or {IMAGE_PLACEHOLDER}) but "
                f"{len(images)} images were given; put exactly one placeholder per image, in order (a chat "
                "rendered by apply_chat_template has one per image part)")
        if n_video_slots != len(videos):
            raise KimiK3ProcessorError(
                f"the text has {n_video_slots} video placeholders ({self.video_token}) but {len(videos)} videos were "
                "given; put exactly one placeholder per video, in order")

        processed_images = [self.image_processor.process_one(image, **image_kwargs) for image in images]
        metadata = video_kwargs.pop("video_metadata", None)
        metadata = metadata if isinstance(metadata, (list, tuple)) else [metadata] * len(videos)
        processed_videos = [self.video_processor.process_video(video, meta, **video_kwargs)
                            for video, meta in zip(videos, metadata)]

        expanded, media_order = self._expand(texts, processed_images, processed_videos)
        if any(isinstance(t, KimiK3Prompt) for t in expanded):
            encoding = tokenize_prompts(self.tokenizer, expanded, **text_kwargs)
        else:
            text_kwargs.pop("return_generated_mask", None)
            encoding = self.tokenizer(expanded, **text_kwargs)
        data: dict[str, Any] = dict(encoding)
        if processed_images:
            data["pixel_values"] = torch.from_numpy(np.concatenate([item["patches"] for item in processed_images]))
            data["image_grid_thw"] = torch.tensor([item["grid"] for item in processed_images], dtype=torch.long)
        if processed_videos:
            patches = np.concatenate([item["patches"] for item in processed_videos])
            data["pixel_values_videos"] = torch.from_numpy(patches)
            data["video_grid_thw"] = torch.tensor([g for item in processed_videos for g in item["grids"]],
                                                  dtype=torch.long)
        if processed_images or processed_videos:
            data["mm_token_type_ids"] = self._token_types(encoding["input_ids"], media_order)
        return BatchFeature(data=data, tensor_type=return_tensors)

    def _expand(self, texts: list[str], images: list[dict], videos: list[dict]) -> tuple[list[str], list[list[int]]]:
        """Replace the slots in text order; also return, per sample, the modality of each pad token."""
        image_iter, video_iter = iter(images), iter(videos)
        expanded, order = [], []

        def span(slot: str, types: list[int]) -> str:
            if slot == self.video_token:
                item, pieces = next(video_iter), []
                for stamp, count in zip(item["timestamps"], item["num_tokens"]):
                    pieces.append(f"{format_timestamp(stamp)}<|media_begin|>video<|media_content|>"
                                  f"{self.image_token * count}<|media_end|>")
                    types.extend([VIDEO_TYPE_ID] * count)
                return "".join(pieces)
            item = next(image_iter)
            width, height = item["original_size"]
            types.extend([IMAGE_TYPE_ID] * item["num_tokens"])
            return (f"<|media_begin|>image {width}x{height}<|media_content|>{self.image_token * item['num_tokens']}"
                    "<|media_end|>")

        for sample in texts:
            types: list[int] = []
            if isinstance(sample, KimiK3Prompt):
                segments, generated = [], []
                for index, segment in enumerate(sample.segments):
                    if segment.control and segment.text in _IMAGE_SLOTS + (self.video_token,):
                        segment = Segment(span(segment.text, types), True)
                    if index in sample.generated:
                        generated.append(len(segments))
                    segments.append(segment)
                expanded.append(KimiK3Prompt(segments, generated))
            else:
                pattern = "|".join(re.escape(t) for t in _IMAGE_SLOTS + (self.video_token,))
                expanded.append("".join(span(piece, types) if i % 2 else piece
                                        for i, piece in enumerate(re.split(f"({pattern})", sample))))
            order.append(types)
        return expanded, order

    def _token_types(self, input_ids: list[list[int]], media_order: list[list[int]]) -> list[list[int]]:
        """``mm_token_type_ids``: 0 for text, the modality for each ``<|media_pad|>`` in order (padding-safe)."""
        out = []
        for ids, types in zip(input_ids, media_order):
            slots = iter(types)
            row = [next(slots, 0) if token == self.image_token_id else 0 for token in ids]
            out.append(row)
        return out

    # ---------------------------------------------------------------------------------------------- chat
    def apply_chat_template(self, conversation, chat_template=None, tools=None, documents=None,
                            add_generation_prompt=False, continue_final_message=False,
                            return_assistant_tokens_mask=False, tokenize=False, return_tensors=None,
                            return_dict=False, processor_kwargs=None, **kwargs):
        """K3's chat format for a conversation with images and videos (`render_kimi_k3_chat`; thinking is on by
        default: pass ``thinking=False`` or ``thinking_effort=...``). ``tokenize=False`` returns the `KimiK3Prompt`;
        ``tokenize=True`` also loads the conversation's media (``{"type": "image", "image" | "url" | "path": ...}``,
        ``{"type": "video", "video" | "path": ...}``) and returns the processor's output (``return_dict=True``) or
        the ids. Only the slots the renderer placed take media, and media that are strings load as the media policy
        allows (see the class docstring). An explicit ``chat_template`` that is K3's own renders with the encoder
        too; another goes to transformers' own path, which refuses to tokenize message text that spells an added
        token (it would become the token) and takes no audio."""
        if not is_kimi_k3_template(self, chat_template):
            guard_jinja_template(self.tokenizer, conversation, tools, tokenize=tokenize)
            if any(isinstance(part, dict) and part.get("type") in ("audio", "input_audio", "audio_url")
                   for text in _conversations(conversation) for message in text if isinstance(message, dict)
                   for part in (message.get("content") if isinstance(message.get("content"), list) else [])):
                raise KimiK3ProcessorError("K3 takes no audio: remove the audio parts from the messages")
            return super().apply_chat_template(
                conversation, chat_template=chat_template, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                return_assistant_tokens_mask=return_assistant_tokens_mask, tokenize=tokenize,
                return_tensors=return_tensors, return_dict=return_dict, processor_kwargs=processor_kwargs, **kwargs)
        processor_kwargs = dict(processor_kwargs or {})
        kwargs.pop("load_audio_from_video", None)
        for key in list(kwargs):
            if key in _TEXT_KWARGS + _VIDEO_KWARGS + _IMAGE_KWARGS:
                processor_kwargs[key] = kwargs.pop(key)
        prompts = apply_kimi_k3_chat_template(self.tokenizer, conversation, tools=tools, documents=documents,
                                              add_generation_prompt=add_generation_prompt,
                                              continue_final_message=continue_final_message, tokenize=False,
                                              **kwargs)
        if not tokenize:
            return prompts
        if return_assistant_tokens_mask and not return_dict:
            raise KimiK3ProcessorError("return_assistant_tokens_mask=True needs return_dict=True")
        images, videos = [], []
        for prompt in prompts if isinstance(prompts, list) else [prompts]:
            for part in prompt.media:  # the renderer's slots, in order (tool results re-ordered included)
                if part.get("type") in ("image", "image_url"):
                    image = _media_of(part, ("image", "url", "path", "base64", "image_url"))
                    images.append(self.media_policy.open_image(image, self.image_processor.max_image_pixels,
                                                               base64_only=_only_base64(part))
                                  if isinstance(image, str) else image)
                else:
                    videos.append(self.load_video(_media_of(part, ("video", "url", "path", "video_url"))))
        if return_assistant_tokens_mask:
            processor_kwargs["return_generated_mask"] = True
        out = self(text=prompts, images=images or None, videos=videos or None,
                   return_tensors=None if return_tensors == "auto" else return_tensors, **processor_kwargs)
        return out if return_dict else out["input_ids"]

    def parse_response(self, response, schema=None, **kwargs):
        """The assistant message of a K3 answer (see `KimiK3Tokenizer.parse_response`)."""
        from .chat import parse_kimi_k3_response
        from .tokenization_kimi_k3 import KimiK3Tokenizer

        if schema is not None or isinstance(self.tokenizer, KimiK3Tokenizer):
            return self.tokenizer.parse_response(response, schema, **kwargs)
        if not isinstance(response, str):
            response = self.tokenizer.decode(response, skip_special_tokens=False)
        return parse_kimi_k3_response(response, prompt=kwargs.get("prefix")).to_message()

    # ---------------------------------------------------------------------------------------------- helpers
    def get_number_of_image_tokens(self, width: int, height: int) -> int:
        """``<|media_pad|>`` tokens of one ``width x height`` image."""
        return self.image_processor.get_number_of_image_tokens(width, height)

    def post_process_image_text_to_text(self, generated_outputs, skip_special_tokens=True, **kwargs):
        return self.tokenizer.batch_decode(generated_outputs, skip_special_tokens=skip_special_tokens, **kwargs)

    @property
    def model_input_names(self) -> list[str]:
        return ["input_ids", "attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
                "video_grid_thw", "mm_token_type_ids"]


_IMAGE_SLOTS = (IMAGE_PLACEHOLDER, MEDIA_PAD)


def _count_slots(text: str, slots: tuple[str, ...]) -> int:
    """Media slots of a prompt: a `KimiK3Prompt`'s control segments only; in a plain string, every occurrence."""
    if isinstance(text, KimiK3Prompt):
        return sum(text.count_control(slot) for slot in slots)
    return sum(text.count(slot) for slot in slots)


def _media_of(part: dict, keys: tuple[str, ...]):
    for key in keys:
        value = part.get(key)
        if isinstance(value, dict):  # OpenAI's {"image_url": {"url": ...}}
            value = value.get("url")
        if value is not None:
            return value
    raise KimiK3ProcessorError(f"the content part {part!r:.120} has no media: give it one of the keys {keys}")


def _conversations(conversation) -> list:
    """One conversation or a batch of them, as a list of message lists."""
    if isinstance(conversation, (list, tuple)) and conversation and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")):
        return [getattr(chat, "messages", chat) for chat in conversation]
    return [getattr(conversation, "messages", conversation)]


def _only_base64(part: dict) -> bool:
    return "base64" in part and not any(key in part for key in ("image", "url", "path"))


def _strip(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in ("image_processor_type", "video_processor_type",
                                                          "processor_class", "_processor_class")}


__all__ = ["KimiK3MediaError", "KimiK3Processor", "KimiK3ProcessorError", "MediaPolicy"]
