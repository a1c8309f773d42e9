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
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

from ._compat import either_cache
from .cache import KimiK3CacheError, KimiK3HybridCache
from .configuration_kimi_k3 import KimiK3Config, KimiK3ConfigError, KimiK3TextConfig
from .generation_kimi_k3 import KimiK3GenerationMixin, check_input_ids
from .conversion.release_format import config_for_from_pretrained
from .modeling_kimi_k3 import KimiK3CausalLMOutputWithPast, KimiK3ForCausalLM, KimiK3ModelMixin


# ----- Vision tower (MoonViT3d) and projector -----
# The K3 vision tower (MoonViT3d) and its projector (PatchMergerV2), K3_SPEC.md section 7.
#
# A media item (an image, or a chunk of at most ``init_pos_emb_time`` video frames) arrives as ``t*h*w`` patches of
# ``3 x 14 x 14`` pixels, row-major within a frame and frame by frame, with its grid ``(t, h, w)``. The tower
#
# 1. embeds each patch (a bias-free 14x14 stride-14 conv) and adds a learned 2-D position table resized
#    bilinearly to ``(h, w)``, plus a fixed sin/cos time embedding for video chunks only (``t > 1``);
# 2. runs pre-norm transformer blocks whose attention sees all patches of one item and nothing else
#    (block-diagonal across items), with 2-D RoPE on q and k;
# 3. groups every 2x2 window of patches and averages over frames (``sd2_tpool``).
#
# The projector maps each merged 2x2 window to one text embedding. Module and parameter names are the official
# checkpoint's (spec 7.5), so its ``vision_tower.*`` and ``mm_projector.*`` tensors load without renames.
GridTHW = tuple[int, int, int]

# The 2-D RoPE table of the reference implementation covers grids of up to 512 x 512 patches.
ROPE_MAX_GRID = 512


class KimiK3VisionInputError(ValueError):
    """The pixels or grids handed to the vision tower cannot be processed; the message says why."""


def grid_list(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[GridTHW]:
    """``[(t, h, w), ...]`` as Python ints (one host sync, done once per forward)."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def sincos_time_table(dim: int, num_frames: int) -> torch.Tensor:
    """Fixed time embedding ``[num_frames, dim]``: ``[sin(f*w_j), cos(f*w_j)]`` with ``w_j = 10000^(-j/(dim/2))``."""
    omega = torch.arange(dim // 2, dtype=torch.float32) / (dim / 2.0)
    omega = 1.0 / 10000**omega
    angles = torch.arange(num_frames, dtype=torch.float32)[:, None] * omega[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class KimiK3VisionPositionEmbedding(nn.Module):
    """Learned ``[H0, W0, dim]`` table, bilinearly resized to each item's grid, plus the fixed time table for
    ``t > 1``. A single frame gets no time embedding at all, not even frame 0's (spec 7.1)."""

    def __init__(self, height: int, width: int, num_frames: int, dim: int, interpolation_mode: str = "bilinear"):
        super().__init__()
        self.num_frames = num_frames
        self.interpolation_mode = interpolation_mode
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        self.register_buffer("time_weight", sincos_time_table(dim, num_frames), persistent=False)

    def spatial(self, height: int, width: int) -> torch.Tensor:
        """``[height * width, dim]``, row-major."""
        if (height, width) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        table = self.weight.permute(2, 0, 1).unsqueeze(0)
        resized = F.interpolate(table, size=(height, width), mode=self.interpolation_mode, align_corners=False)
        return resized.squeeze(0).permute(1, 2, 0).flatten(0, 1)

    def forward(self, grids: list[GridTHW]) -> torch.Tensor:
        """Position embeddings of all items, concatenated: ``[sum(t*h*w), dim]``."""
        out = []
        for t, h, w in grids:
            pos = self.spatial(h, w)
            if t > 1:
                time = self.time_weight[:t].to(pos.dtype)
                pos = (pos.unsqueeze(0) + time[:, None, :]).flatten(0, 1)
            out.append(pos)
        return torch.cat(out)


class KimiK3PatchEmbed(nn.Module):
    """``proj``: one vector per 14x14 patch; ``pos_emb``: the position embedding above."""

    def __init__(self, config):
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(3, config.vt_hidden_size, kernel_size=p, stride=p, bias=config.patch_embed_proj_bias)
        self.pos_emb = KimiK3VisionPositionEmbedding(
            config.init_pos_emb_height, config.init_pos_emb_width, config.init_pos_emb_time, config.vt_hidden_size,
            config.pos_emb_interpolation_mode,
        )

    def forward(self, pixel_values: torch.Tensor, grids: list[GridTHW]) -> torch.Tensor:
        x = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1)
        return x + self.pos_emb(grids).to(x.dtype)


def rope_2d_angles(height: int, width: int, head_dim: int, theta: float = 10000.0, device=None) -> torch.Tensor:
    """Rotation angles ``[height * width, head_dim / 2]`` of the 2-D RoPE (spec 7.2), row-major over the grid.

    Complex pair ``2i`` rotates by ``x * f_i`` and pair ``2i + 1`` by ``y * f_i``, with ``f_i = theta^(-4i/head_dim)``
    and ``(y, x)`` the patch's row and column."""
    exponents = torch.arange(0, head_dim, 4, dtype=torch.float32, device=device)[: head_dim // 4] / head_dim
    freqs = 1.0 / theta**exponents
    ys, xs = torch.meshgrid(torch.arange(height, dtype=torch.float32, device=device),
                            torch.arange(width, dtype=torch.float32, device=device), indexing="ij")
    x_angles = xs.reshape(-1, 1) * freqs
    y_angles = ys.reshape(-1, 1) * freqs
    return torch.stack([x_angles, y_angles], dim=-1).flatten(1)


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs ``(2m, 2m+1)`` of ``x [..., L, heads, head_dim]`` by the angles whose cos/sin are
    ``[L, head_dim / 2]``; computed in fp32 and cast back (spec 7.2)."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


def eager_vision_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """Bidirectional attention with an fp32 softmax. ``[B, heads, L, d]`` in, ``[B, L, heads, d]`` out."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


class KimiK3VisionMLP(nn.Module):
    """``fc0 -> GELU (tanh approximation in K3) -> fc1``."""

    def __init__(self, config):
        super().__init__()
        approximate = "tanh" if config.activation_func == "gelu_pytorch_tanh" else "none"
        self.fc0 = nn.Linear(config.vt_hidden_size, config.vt_intermediate_size, bias=config.linear_bias)
        self.act = nn.GELU(approximate=approximate)
        self.fc1 = nn.Linear(config.vt_intermediate_size, config.vt_hidden_size, bias=config.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.act(self.fc0(x)))


class KimiK3VisionBlock(GradientCheckpointingLayer):
    """Pre-norm block (spec 7.2)::

        x = x + wo(attention(rope_2d(wqkv(norm0(x)))))
        x = x + mlp(norm1(x))

    ``wqkv`` yields all q, then all k, then all v (head-major within each); the head dim is
    ``qkv_hidden_size / heads`` (128 in K3, not hidden / heads). Attention sees the patches of one item only.
    The norms are ``nn.RMSNorm(eps=None)``: PyTorch then uses fp32 machine epsilon. The attention projections
    sit on the block itself because that is where the checkpoint puts them (``blocks.{j}.wqkv``)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.vt_num_attention_heads
        self.head_dim = config.qkv_hidden_size // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False
        self.norm0 = nn.RMSNorm(config.vt_hidden_size)
        self.norm1 = nn.RMSNorm(config.vt_hidden_size)
        self.wqkv = nn.Linear(config.vt_hidden_size, 3 * config.qkv_hidden_size, bias=config.attn_bias)
        self.wo = nn.Linear(config.qkv_hidden_size, config.vt_hidden_size, bias=config.attn_bias)
        self.mlp = KimiK3VisionMLP(config)

    def attention(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                  bounds: list[tuple[int, int]]) -> torch.Tensor:
        qkv = self.wqkv(hidden_states).unflatten(-1, (3, self.num_heads, self.head_dim))
        q, k, v = qkv.unbind(dim=-3)
        q, k = apply_rope_2d(q, *rope), apply_rope_2d(k, *rope)
        interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            getattr(self.config, "_attn_implementation", None) or "sdpa", eager_vision_attention
        )
        # One call per item is exactly the block-diagonal attention of the reference (nothing leaks across items,
        # no padding), and it works with every attention kernel.
        outputs = []
        for start, end in bounds:
            qi, ki, vi = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out, _ = interface(self, qi, ki, vi, None, scaling=self.scaling, dropout=0.0, is_causal=False)
            outputs.append(out.squeeze(0))
        return self.wo(torch.cat(outputs).flatten(-2))

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                bounds: list[tuple[int, int]]) -> torch.Tensor:
        hidden_states = hidden_states + self.attention(self.norm0(hidden_states), rope, bounds)
        return hidden_states + self.mlp(self.norm1(hidden_states))


class KimiK3VisionEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.qkv_hidden_size // config.vt_num_attention_heads
        self.blocks = nn.ModuleList([KimiK3VisionBlock(config) for _ in range(config.vt_num_hidden_layers)])
        self.final_layernorm = nn.RMSNorm(config.vt_hidden_size)

    def rope(self, grids: list[GridTHW], device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[sum(t*h*w), head_dim/2]``; frames of a video share the spatial RoPE (no temporal RoPE)."""
        angles = torch.cat([rope_2d_angles(h, w, self.head_dim, device=device).repeat(t, 1) for t, h, w in grids])
        return angles.cos(), angles.sin()

    def forward(self, hidden_states: torch.Tensor, grids: list[GridTHW]) -> torch.Tensor:
        rope = self.rope(grids, hidden_states.device)
        bounds, start = [], 0
        for t, h, w in grids:
            bounds.append((start, start + t * h * w))
            start += t * h * w
        for block in self.blocks:
            hidden_states = block(hidden_states, rope, bounds)
        return self.final_layernorm(hidden_states)


def merge_sd2_tpool(hidden_states: torch.Tensor, grids: list[GridTHW], kernel: Sequence[int]) -> torch.Tensor:
    """``sd2_tpool`` (spec 7.3): each item ``[t, h, w, D]`` becomes ``[(h/kh)(w/kw), kh*kw, D]`` (window members in
    (row, column) order), averaged over frames when ``t > 1``. Items are concatenated along the first dim."""
    kh, kw = kernel
    dim = hidden_states.shape[-1]
    out, start = [], 0
    for t, h, w in grids:
        item = hidden_states[start:start + t * h * w].view(t, h // kh, kh, w // kw, kw, dim)
        item = item.permute(0, 1, 3, 2, 4, 5)
        item = item[0] if t == 1 else item.mean(dim=0)
        out.append(item.reshape((h // kh) * (w // kw), kh * kw, dim))
        start += t * h * w
    return torch.cat(out)


class KimiK3VisionTower(nn.Module):
    """``pixel_values [sum(t*h*w), 3, p, p]`` + ``grid_thw [items, 3]`` -> merged patch features
    ``[sum((h/kh)(w/kw)), kh*kw, vt_hidden_size]``, items in input order."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.merge_kernel_size = tuple(config.merge_kernel_size)
        self.patch_embed = KimiK3PatchEmbed(config)
        self.encoder = KimiK3VisionEncoder(config)

    def tokens_per_item(self, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[int]:
        kh, kw = self.merge_kernel_size
        return [(h // kh) * (w // kw) for _, h, w in grid_list(grid_thw)]

    def check_inputs(self, pixel_values: torch.Tensor, grids: list[GridTHW]) -> None:
        config, (kh, kw) = self.config, self.merge_kernel_size
        p = config.patch_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise KimiK3VisionInputError(
                f"pixel_values must be [num_patches, 3, {p}, {p}] (the processor's output), "
                f"got {tuple(pixel_values.shape)}")
        for index, (t, h, w) in enumerate(grids):
            if not 1 <= t <= config.init_pos_emb_time:
                raise KimiK3VisionInputError(
                    f"media item {index} has t={t} frames; the tower takes 1..{config.init_pos_emb_time} frames per "
                    "item (init_pos_emb_time): split longer videos into chunks")
            if h % kh or w % kw or h <= 0 or w <= 0:
                raise KimiK3VisionInputError(
                    f"media item {index} has grid {h}x{w} patches; both sides must be positive multiples of the "
                    f"merge kernel {kh}x{kw}")
            if h > ROPE_MAX_GRID or w > ROPE_MAX_GRID:
                raise KimiK3VisionInputError(
                    f"media item {index} has grid {h}x{w} patches; the 2-D RoPE supports at most "
                    f"{ROPE_MAX_GRID}x{ROPE_MAX_GRID} (resize the image, see patch_limit_on_one_side)")
        total = sum(t * h * w for t, h, w in grids)
        if total != pixel_values.shape[0]:
            raise KimiK3VisionInputError(
                f"grid_thw describes {total} patches but pixel_values has {pixel_values.shape[0]}")

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        grids = grid_list(grid_thw)
        self.check_inputs(pixel_values, grids)
        hidden_states = self.patch_embed(pixel_values, grids)
        hidden_states = self.encoder(hidden_states, grids)
        return merge_sd2_tpool(hidden_states, grids, self.merge_kernel_size)


class KimiK3MultiModalProjector(nn.Module):
    """PatchMergerV2: ``post_norm(proj.2(GELU(proj.0(window))))`` on each flattened 2x2 window. Exact-erf GELU,
    no biases, RMSNorm after (K3 has no pre-norm, unlike K2.5)."""

    def __init__(self, config):
        super().__init__()
        kh, kw = config.merge_kernel_size
        in_dim = (config.mm_hidden_size or config.vt_hidden_size) * kh * kw
        self.proj = nn.Sequential(
            nn.Linear(in_dim, in_dim, bias=False),
            nn.GELU(),
            nn.Linear(in_dim, config.text_hidden_size, bias=False),
        )
        self.post_norm = nn.RMSNorm(config.text_hidden_size, eps=config.projector_ln_eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(merged.flatten(-2)))


# ----- The multimodal model -----
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

    # override: no public hook routes from_pretrained's config keywords to a composite config's text_config
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

    # override: transformers builds its own cache classes here; no public hook names a model's cache class
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
        if inputs_embeds is None and input_ids is None:
            raise ValueError("Pass `input_ids` (or `inputs_embeds`).")
        held = past_key_values.get_seq_length() if past_key_values is not None else 0
        hybrid = isinstance(past_key_values, KimiK3HybridCache)
        held_ids = past_key_values.token_ids if has_media and held and hybrid else None  # (read before the step's)
        step = None
        if hybrid:  # the cache's one entry point for this forward, made here for the text model
            step = past_key_values.begin_step(self.config.text_config, input_ids, inputs_embeds, attention_mask,
                                              model=self.get_decoder())
        if inputs_embeds is None:
            embedding = self.get_input_embeddings()
            if step is None or not step.checked:
                check_input_ids(input_ids, embedding.num_embeddings)  # (generate()'s own decode steps: no host read)
            inputs_embeds = embedding(input_ids)
        if has_media:
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
            if hybrid:
                past_key_values.update_media(records, held)
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
        if hybrid and not held and not has_media:
            past_key_values.update_media([], held)  # what the check of a later continuation compares with
        # The text model gets embeddings; the step above recorded the ids behind them (`<|media_pad|>` for media
        # slots), so that generate() can check a later prompt against them (None: inputs_embeds given, ids unknown).
        return self.language_model(
            input_ids=None, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
            inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep,
            cache_step=step, **kwargs,
        )


__all__ = [
    "KimiK3ForConditionalGeneration",
    "KimiK3PlaceholderMismatchError",
    "KimiK3VLPreTrainedModel",
]
