"""Kimi K3 with vision: the MoonViT3d tower and projector in front of the text model.

Submodules carry the official names, so a full K3 checkpoint maps 1:1: ``vision_tower.*``, ``mm_projector.*``,
``language_model.model.*`` and ``language_model.lm_head.*``. The path of a prompt:

1. token ids -> text embeddings (``language_model.model.embed_tokens``);
2. images and video chunks -> tower -> 2x2 merge (+ temporal mean) -> projector: one embedding per merged window;
3. those embeddings replace the ``<|media_pad|>`` embeddings (``config.media_placeholder_token_id``) in order;
4. the text model runs on the merged embeddings.

Media are only needed on the prefill step: afterwards the text model's cache holds everything. Continuing a
conversation from its cache, pass either the media of the whole conversation (those the cache holds are checked
against the pixels it was built from, by digest, and not encoded again) or only the new ones. A cache written by
`KimiK3HybridCache.save` does not carry those digests: after `load` the held media are not checked.
"""

from __future__ import annotations

import copy
import hashlib

import torch
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.modeling_utils import PreTrainedModel

from ._compat import either_cache
from .cache import KimiK3CacheError, KimiK3HybridCache
from .configuration_kimi_k3 import KimiK3Config, KimiK3ConfigError, KimiK3TextConfig
from .layers.vision import (
    KimiK3MultiModalProjector,
    KimiK3VisionPositionEmbedding,
    KimiK3VisionTower,
    sincos_time_table,
)
from .generation_kimi_k3 import KimiK3GenerationMixin, check_input_ids
from .conversion.release_format import config_for_from_pretrained
from .modeling_kimi_k3 import KimiK3CausalLMOutputWithPast, KimiK3ForCausalLM, KimiK3ModelMixin

IMAGE_TYPE_ID, VIDEO_TYPE_ID = 1, 2


class KimiK3PlaceholderMismatchError(ValueError):
    """The number of ``<|media_pad|>`` slots in the input differs from the number of media embeddings."""


class KimiK3VLPreTrainedModel(KimiK3ModelMixin, PreTrainedModel):
    config: KimiK3Config
    config_class = KimiK3Config
    base_model_prefix = "language_model"
    input_modalities = ("image", "video", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiK3DecoderLayer", "KimiK3VisionBlock"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = False
    # the hybrid cache rolls back (crop), so assisted decoding works: transformers 5.23 reads this flag only to refuse it
    _is_stateful = False
    _can_compile_fullgraph = False

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, KimiK3VisionPositionEmbedding):
            std = self.config.vision_config.initializer_range
            init.normal_(module.weight, mean=0.0, std=std)
            # Non-persistent buffer (not in the checkpoint): recompute it, it may have been built on the meta device.
            init.copy_(module.time_weight, sincos_time_table(module.weight.shape[-1], module.num_frames))


class KimiK3ForConditionalGeneration(KimiK3VLPreTrainedModel, KimiK3GenerationMixin, GenerationMixin):
    """K3 with the vision tower: images and video chunks in, text out.

    Inputs beyond the text model's: ``pixel_values [patches, 3, 14, 14]`` with ``image_grid_thw [images, 3]``,
    ``pixel_values_videos`` with ``video_grid_thw [chunks, 3]``, and ``mm_token_type_ids`` (1 image slot, 2 video
    slot) which `KimiK3Processor` returns; it is required only when one batch mixes images and videos."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' ``from_pretrained``; keyword arguments that set text-model fields the composite config does
        not have (``output_router_logits=True``, ``router_aux_loss_coef=...``, ``rms_norm_eps``...) go to
        ``config.text_config``, as they would for `KimiK3ForCausalLM`, instead of reaching ``__init__``."""
        text_only = set(KimiK3TextConfig().to_dict()) - set(KimiK3Config.tiny().to_dict())
        text_fields = {key: kwargs.pop(key) for key in list(kwargs) if key in text_only}
        if text_fields:
            config = copy.deepcopy(config_for_from_pretrained(cls, pretrained_model_name_or_path, kwargs))
            for key, value in text_fields.items():
                setattr(config.text_config, key, value)
            config.text_config.validate()
            kwargs["config"] = config
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        if config.vision_config is None:
            raise ValueError("KimiK3ForConditionalGeneration needs a `vision_config`; for text only use "
                             "KimiK3ForCausalLM (AutoModelForCausalLM)")
        self.vision_tower = KimiK3VisionTower(config.vision_config)
        self.mm_projector = KimiK3MultiModalProjector(config.vision_config)
        self.language_model = KimiK3ForCausalLM(config.text_config)
        self.post_init()

    # ---------------------------------------------------------------------------------------------- plumbing
    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def set_output_embeddings(self, value):
        self.language_model.set_output_embeddings(value)

    def get_decoder(self):
        return self.language_model.model

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        """generate() builds the text model's hybrid cache (KDA states + MLA latents)."""
        return self.language_model._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)

    # ---------------------------------------------------------------------------------------------- media
    def get_image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One ``[tokens_i, text_hidden]`` tensor per image (or per video chunk), in input order."""
        merged = self.vision_tower(pixel_values, image_grid_thw)
        embeds = self.mm_projector(merged)
        return torch.split(embeds, self.vision_tower.tokens_per_item(image_grid_thw))

    def get_video_features(self, pixel_values_videos: torch.Tensor,
                           video_grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One tensor per video chunk; a chunk of ``t`` frames gives as many tokens as one frame (temporal mean)."""
        return self.get_image_features(pixel_values_videos, video_grid_thw)

    def merge_media(self, input_ids: torch.LongTensor, inputs_embeds: torch.Tensor,
                    image_embeds: torch.Tensor | None, video_embeds: torch.Tensor | None,
                    mm_token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """Write media embeddings into the ``<|media_pad|>`` slots, row-major (sample by sample, left to right)."""
        masks = self._slot_masks(input_ids, None, mm_token_type_ids, image_embeds is not None and video_embeds is not None)
        for name, embeds in (("image", image_embeds), ("video", video_embeds)):
            inputs_embeds = self._scatter(name, masks[name], embeds, inputs_embeds, mm_token_type_ids is not None)
        return inputs_embeds

    def _slot_masks(self, input_ids: torch.Tensor, held_ids: torch.Tensor | None,
                    mm_token_type_ids: torch.Tensor | None, both_kinds: bool, known: list | None = None,
                    kind: int | None = None) -> dict[str, torch.Tensor]:
        """``{"image": mask, "video": mask}`` over the whole sequence (the ``held_ids`` a cache holds, then
        ``input_ids``): where each kind's features go."""
        ids = input_ids if held_ids is None else torch.cat([held_ids.to(input_ids.device), input_ids], dim=1)
        slots = ids == self.config.media_placeholder_token_id
        types = mm_token_type_ids
        if types is not None and types.shape[-1] != ids.shape[-1]:
            if held_ids is not None and types.shape[-1] == input_ids.shape[-1]:
                # given for the new part only (generate() slices them like input_ids): the held part's from the cache
                types = torch.cat([self._held_types(held_ids, known, both_kinds, kind), types.to(ids.device)], dim=1)
            elif types.shape[-1] > ids.shape[-1]:
                raise ValueError(f"`mm_token_type_ids` has {types.shape[-1]} positions for {ids.shape[-1]} tokens: "
                                 "pass the ones the processor returned with them")
            else:
                # tokens appended after the prompt it was made for (assisted decoding's first call adds the draft's
                # candidates to the prompt) are text
                types = torch.nn.functional.pad(types, (0, ids.shape[-1] - types.shape[-1]))
        if both_kinds and types is None:
            raise ValueError(
                "images and videos in one batch share the `<|media_pad|>` slots: pass `mm_token_type_ids` (returned "
                "by KimiK3Processor) so that each feature goes to its own slot")
        if types is None:
            return {"image": slots, "video": slots}
        types = types.to(slots.device)
        return {"image": slots & (types == IMAGE_TYPE_ID), "video": slots & (types == VIDEO_TYPE_ID)}

    def _held_types(self, held_ids: torch.Tensor, known: list | None, both_kinds: bool, kind: int | None):
        """``mm_token_type_ids`` of the tokens a cache holds: from the media it recorded (item by item), else, with
        one kind of media in the call, that kind wherever the held ids have a slot."""
        if known is not None:
            types = torch.zeros_like(held_ids)
            for name, row, column, count, _ in known:
                types[row, column:column + count] = IMAGE_TYPE_ID if name == "image" else VIDEO_TYPE_ID
            return types
        if both_kinds or kind is None:
            raise KimiK3CacheError("this KimiK3HybridCache does not record which of its `<|media_pad|>` slots are "
                                   "images and which videos: pass `mm_token_type_ids` for the whole sequence")
        slots = held_ids == self.config.media_placeholder_token_id
        return torch.where(slots, kind, 0)

    def _scatter(self, name: str, mask: torch.Tensor, embeds: torch.Tensor | None, inputs_embeds: torch.Tensor,
                 typed: bool) -> torch.Tensor:
        pad_id = self.config.media_placeholder_token_id
        if embeds is None:
            if typed and bool(mask.any()):
                raise KimiK3PlaceholderMismatchError(
                    f"the input has {int(mask.sum())} {name} slots (`<|media_pad|>`, id {pad_id}) but no {name} "
                    "inputs were given (0 features)")
            return inputs_embeds
        n_slots = int(mask.sum())
        if n_slots != embeds.shape[0]:
            raise KimiK3PlaceholderMismatchError(
                f"{name} placeholder tokens and {name} features do not match: the input has {n_slots} {name} "
                f"slots (`<|media_pad|>`, id {pad_id}) but the {name} inputs produce {embeds.shape[0]} "
                "features. Build prompts with KimiK3Processor (it expands one placeholder per item to the right "
                "count) and do not truncate them.")
        return inputs_embeds.masked_scatter(
            mask.unsqueeze(-1).to(inputs_embeds.device), embeds.to(inputs_embeds.device, inputs_embeds.dtype))

    def _new_media(self, name: str, pixels: torch.Tensor, grid: torch.Tensor, mask: torch.Tensor, held: int,
                   records: list) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The pixels and grid of the items whose slots are in the new part of the sequence (``mask`` covers the
        ``held`` tokens a cache holds, then the input). Given every item of the sequence (the processor's output
        for the whole conversation), the held ones are checked against what the cache was built from and
        skipped; given only the new ones, all are new. Each item is appended to ``records`` as
        ``(kind, row, first column, slots, digest)``."""
        counts = self.vision_tower.tokens_per_item(grid)
        rows_per_item = [int(t) * int(h) * int(w) for t, h, w in grid.tolist()]
        n_all, n_new = int(mask.sum()), int(mask[:, held:].sum())
        if sum(counts) not in (n_all, n_new):
            raise KimiK3PlaceholderMismatchError(
                f"{name} placeholder tokens and {name} features do not match: the sequence has {n_all} {name} slots "
                f"(`<|media_pad|>`, id {self.config.media_placeholder_token_id}; {n_new} after the {held} tokens the "
                f"cache holds) but the {name} inputs produce {sum(counts)} features. Build prompts with "
                "KimiK3Processor (it expands one placeholder per item to the right count) and do not truncate them; "
                "continuing from a cache, pass the media of the whole conversation or only the new ones.")
        places = mask.nonzero().tolist()  # row-major, one [row, column] per slot
        if sum(counts) == n_new:
            places = [place for place in places if place[1] >= held]
        keep, kept, first, offset = [], [], 0, 0
        for index, (count, rows) in enumerate(zip(counts, rows_per_item)):
            row, column = places[first]
            last_column = places[first + count - 1][1] if count else column
            if column < held <= last_column:
                raise KimiK3PlaceholderMismatchError(
                    f"{name} {index} spans the end of the {held} tokens the cache holds: a cache can only end "
                    "between media items")
            item = pixels[offset:offset + rows]
            digest = hashlib.sha256(item.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
                                    + repr(grid[index].tolist()).encode()).hexdigest()
            records.append((name, row, column, count, digest))
            if column >= held:
                keep.append(index)
                kept.append(item)
            first, offset = first + count, offset + rows
        if not keep:
            return None, None
        if len(keep) == len(counts):
            return pixels, grid
        return torch.cat(kept), grid[keep]

    # ---------------------------------------------------------------------------------------------- forward
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values=None,
                inputs_embeds: torch.FloatTensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.LongTensor | None = None, pixel_values_videos: torch.Tensor | None = None,
                video_grid_thw: torch.LongTensor | None = None, mm_token_type_ids: torch.Tensor | None = None,
                logits_to_keep: int | torch.Tensor = 0, cache=None, **kwargs) -> KimiK3CausalLMOutputWithPast:
        past_key_values = either_cache(cache, past_key_values)
        has_media = pixel_values is not None or pixel_values_videos is not None
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("Pass `input_ids` (or `inputs_embeds`).")
            embedding = self.get_input_embeddings()
            if not (isinstance(past_key_values, KimiK3HybridCache) and past_key_values.generated_step_marked()):
                check_input_ids(input_ids, embedding.num_embeddings)  # (generate()'s own decode steps: no host read)
            inputs_embeds = embedding(input_ids)
        held = past_key_values.get_seq_length() if past_key_values is not None else 0
        if has_media:
            held_ids = past_key_values.token_ids if held else None
            if self.config.media_placeholder_token_id is None:
                raise KimiK3ConfigError(
                    "Invalid Kimi K3 config field `media_placeholder_token_id`: it is null, so no token marks where "
                    "images and videos go; set it to your tokenizer's `<|media_pad|>` id "
                    "(`model.config.media_placeholder_token_id = tokenizer.convert_tokens_to_ids(\"<|media_pad|>\")`)")
            if input_ids is None:
                raise ValueError("With `pixel_values`/`pixel_values_videos`, pass `input_ids`: the `<|media_pad|>` "
                                 "ids mark where the media embeddings go.")
            for name, pixels, grid in (("pixel_values", pixel_values, image_grid_thw),
                                       ("pixel_values_videos", pixel_values_videos, video_grid_thw)):
                if pixels is not None and grid is None:
                    raise ValueError(f"`{name}` needs its grid (`{'image' if name == 'pixel_values' else 'video'}"
                                     "_grid_thw`)")
            if held and held_ids is None:
                raise KimiK3CacheError("this KimiK3HybridCache does not know which tokens it holds, so the media "
                                       "slots in it cannot be told from the new ones: pass a fresh cache")
            both = pixel_values is not None and pixel_values_videos is not None
            masks = self._slot_masks(input_ids, held_ids, mm_token_type_ids, both,
                                     getattr(past_key_values, "media_items", None) if held else None,
                                     IMAGE_TYPE_ID if pixel_values is not None else VIDEO_TYPE_ID)
            records = []
            image_embeds = video_embeds = None
            if pixel_values is not None:
                pixels, grid = self._new_media("image", pixel_values, image_grid_thw, masks["image"], held, records)
                if pixels is not None:
                    image_embeds = torch.cat(self.get_image_features(pixels, grid))
            if pixel_values_videos is not None:
                pixels, grid = self._new_media("video", pixel_values_videos, video_grid_thw, masks["video"], held,
                                               records)
                if pixels is not None:
                    video_embeds = torch.cat(self.get_video_features(pixels, grid))
            self._check_held_media(past_key_values, held, records)
            typed = mm_token_type_ids is not None
            for name, embeds in (("image", image_embeds), ("video", video_embeds)):
                inputs_embeds = self._scatter(name, masks[name][:, held:], embeds, inputs_embeds, typed)
        elif input_ids is not None and self.config.media_placeholder_token_id is not None and not held:
            n_slots = int((input_ids == self.config.media_placeholder_token_id).sum())
            if n_slots:
                raise KimiK3PlaceholderMismatchError(
                    f"the input has {n_slots} media placeholder tokens (`<|media_pad|>`, id "
                    f"{self.config.media_placeholder_token_id}) but no pixel_values / pixel_values_videos were given "
                    "(0 features)")
        if isinstance(past_key_values, KimiK3HybridCache) and not held and not has_media:
            past_key_values.record_media([], new_sequence=True)  # what the check of a later continuation compares with
        # The text model gets embeddings; its cache records the ids behind them (`<|media_pad|>` for media slots),
        # so that generate() can check a later prompt against them (None: inputs_embeds given, ids unknown).
        return self.language_model(
            input_ids=None, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
            inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep,
            cache_token_ids=input_ids, **kwargs,
        )

    @staticmethod
    def _check_held_media(past_key_values, held: int, records: list) -> None:
        """Media of the held part given again must be the ones the cache was built from (a recurrent state cannot be
        matched by the ``<|media_pad|>`` ids alone); the cache then records every item it holds."""
        if not isinstance(past_key_values, KimiK3HybridCache):
            return
        known = past_key_values.media_items
        seen = sorted(record for record in records if record[2] < held)
        if held and known is not None and seen:
            if seen != sorted(known):
                raise KimiK3CacheError(
                    "this KimiK3HybridCache was built from other images or videos than the ones given for the tokens "
                    "it holds (the same `<|media_pad|>` slots, different pixels): generation would continue from "
                    "another conversation's state. Pass the same media as before, or no past_key_values.")
        past_key_values.record_media(records, new_sequence=not held)


__all__ = [
    "KimiK3ForConditionalGeneration",
    "KimiK3PlaceholderMismatchError",
    "KimiK3VLPreTrainedModel",
]
