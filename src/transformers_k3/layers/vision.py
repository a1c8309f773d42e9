"""The K3 vision tower (MoonViT3d) and its projector (PatchMergerV2), K3_SPEC.md section 7.

A media item (an image, or a chunk of at most ``init_pos_emb_time`` video frames) arrives as ``t*h*w`` patches of
``3 x 14 x 14`` pixels, row-major within a frame and frame by frame, with its grid ``(t, h, w)``. The tower

1. embeds each patch (a bias-free 14x14 stride-14 conv) and adds a learned 2-D position table resized
   bilinearly to ``(h, w)``, plus a fixed sin/cos time embedding for video chunks only (``t > 1``);
2. runs pre-norm transformer blocks whose attention sees all patches of one item and nothing else
   (block-diagonal across items), with 2-D RoPE on q and k;
3. groups every 2x2 window of patches and averages over frames (``sd2_tpool``).

The projector maps each merged 2x2 window to one text embedding. Module and parameter names are the official
checkpoint's (spec 7.5), so its ``vision_tower.*`` and ``mm_projector.*`` tensors load without renames.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

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


__all__ = [
    "KimiK3MultiModalProjector",
    "KimiK3VisionInputError",
    "KimiK3VisionTower",
    "apply_rope_2d",
    "grid_list",
    "merge_sd2_tpool",
    "rope_2d_angles",
    "sincos_time_table",
]
