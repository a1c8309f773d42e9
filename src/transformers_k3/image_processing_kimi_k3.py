"""Kimi K3 image processor (K3_SPEC.md section 7.6).

An image of ``W x H`` pixels is scaled down (never up) by the reference's rule (spec 7.6: the scale that brings
``(W // 14) * (H // 14)`` to ``in_patch_limit`` and each side to ``patch_limit_on_one_side`` patches, never above
1), resized with PIL's bicubic filter, composited onto a background if it is transparent, padded with black at the
right and bottom to a multiple of 28 (``patch_size * merge_kernel_size``), normalised, and cut into patches. Its
grid is ``(1, gh, gw)`` patches and it occupies ``gh * gw / 4`` ``<|media_pad|>`` tokens in the prompt. The limit
is the reference's target, not a hard bound: the floor divisions and the padding to whole 2x2 merges can leave
somewhat more patches (a 4000x3000 image under a limit of 16 gets 24; a 1000x1 strip, padded to 28 rows, 68).

Everything runs on the CPU with PIL and NumPy, so the resize is PIL's own (the reference resizes with PIL too);
torchvision is not needed. The official ``preprocessor_config.json`` keeps its settings in a ``media_proc_cfg``
dict; passing that dict (or its keys directly) configures this class.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature

from .media_kimi_k3 import MediaPolicy, check_pixels, require_pillow

# PIL modes we know how to turn into RGB or RGB + alpha. Anything else (16-bit, float, HSV, LAB...) is rejected
# instead of being converted with a guess.
SUPPORTED_PIL_MODES = ("RGB", "RGBA", "RGBX", "RGBa", "L", "LA", "La", "1", "P", "PA", "CMYK", "YCbCr")

_MEDIA_PROC_KEYS = (
    "patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side", "image_mean", "image_std",
    "fixed_output_tokens", "transparent_bg_config", "transparent_bg_fill_stage",
)


# Far above what the tower takes (in_patch_limit patches of 14px, about 3.2 MP), below PIL's own bomb warning.
DEFAULT_MAX_IMAGE_PIXELS = 64_000_000


class KimiK3ImageInputError(ValueError):
    """An image cannot be processed (unsupported mode or dtype, empty, too large without resizing...)."""


def resize_plan(width: int, height: int, patch_size: int = 14, merge_kernel_size: int = 2,
                in_patch_limit: int = 16384, patch_limit_on_one_side: int = 512,
                fixed_output_tokens: int | None = None) -> dict[str, int]:
    """Target size, padding, grid and token count of a ``width x height`` image (spec 7.6 steps 2, 7, 8).
    Pure arithmetic, no pixels needed."""
    if width < 1 or height < 1:
        raise KimiK3ImageInputError(f"image has size {width}x{height}; both sides must be at least 1 pixel")
    p, limit = patch_size, patch_limit_on_one_side
    s_total = math.sqrt(in_patch_limit / (max(1, width // p) * max(1, height // p)))
    scale = min(1.0, s_total, limit * p / width, limit * p / height)
    new_w = min(max(1, int(width * scale)), limit * p)
    new_h = min(max(1, int(height * scale)), limit * p)
    factor = p * merge_kernel_size
    pad_w, pad_h = (factor - new_w % factor) % factor, (factor - new_h % factor) % factor
    grid_h, grid_w = (new_h + pad_h) // p, (new_w + pad_w) // p
    num_tokens = fixed_output_tokens if fixed_output_tokens is not None else grid_h * grid_w // merge_kernel_size**2
    return {"new_width": new_w, "new_height": new_h, "pad_width": pad_w, "pad_height": pad_h,
            "grid_h": grid_h, "grid_w": grid_w, "num_tokens": num_tokens}


def to_uint8_hwc(image: Any, max_pixels: int | None = None) -> np.ndarray:
    """Any supported image as ``uint8 [H, W, 3 or 4]``: grayscale is replicated to RGB, transparency is kept as a
    fourth (alpha) channel (spec 7.6 step 1). An image above ``max_pixels`` is refused before its pixels are decoded
    or copied. A string is read as a data URL / base64 only: paths and URLs go through `KimiK3Processor`, whose media
    policy says which of them may be loaded."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is a dependency of the [vision] extra
        Image = None
    if isinstance(image, str):
        image = MediaPolicy().open_image(image, max_pixels)
    if Image is not None and isinstance(image, Image.Image):
        check_pixels(image.size, max_pixels)  # a lazily opened file is still undecoded here
        mode = image.mode
        if mode not in SUPPORTED_PIL_MODES:
            raise KimiK3ImageInputError(
                f"unsupported image mode {mode!r}; supported PIL modes are {', '.join(SUPPORTED_PIL_MODES)} "
                "(convert the image first, e.g. image.convert('RGB'))")
        has_alpha = "A" in image.getbands() or "a" in image.getbands() or "transparency" in image.info
        try:
            return np.array(image.convert("RGBA" if has_alpha else "RGB"))
        except OSError as error:  # a lazily opened file that is truncated or corrupt fails only here
            raise KimiK3ImageInputError(f"the image could not be decoded ({error}); the file is truncated or "
                                        "corrupt") from None
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise KimiK3ImageInputError(
            f"unsupported image type {type(image).__name__}; pass PIL images, or uint8 NumPy arrays / torch tensors")
    if image.dtype != np.uint8:
        raise KimiK3ImageInputError(
            f"image arrays must hold raw uint8 pixels (0..255), got dtype {image.dtype}; the processor normalises "
            "itself")
    if image.ndim in (2, 3):
        sides = image.shape[:2] if image.ndim == 2 or image.shape[-1] in (1, 3, 4) else image.shape[1:]
        check_pixels((sides[1], sides[0]), max_pixels)
    if image.ndim == 2:
        image = image[:, :, None]
    if image.ndim != 3:
        raise KimiK3ImageInputError(f"image arrays must be [H, W], [H, W, C] or [C, H, W], got shape {image.shape}")
    if image.shape[-1] not in (1, 3, 4) and image.shape[0] in (1, 3, 4):
        image = np.moveaxis(image, 0, -1)
    channels = image.shape[-1]
    if channels not in (1, 3, 4):
        raise KimiK3ImageInputError(f"images need 1 (gray), 3 (RGB) or 4 (RGBA) channels, got shape {image.shape}")
    if channels == 1:
        image = np.repeat(image, 3, axis=-1)
    if 0 in image.shape:
        raise KimiK3ImageInputError(f"image is empty (shape {image.shape})")
    return np.ascontiguousarray(image)


def bicubic_resize(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    """PIL bicubic resize of ``uint8 [H, W, C]`` (antialiased when downscaling; rounded and clipped to uint8).
    Colour and alpha are resized as independent channels, so transparent pixels keep their colour until the
    background is composited (the reference keeps alpha through the resize, spec 7.6 step 1)."""
    Image = require_pillow()

    if pixels.shape[1] == width and pixels.shape[0] == height:
        return pixels
    rgb = np.array(Image.fromarray(np.ascontiguousarray(pixels[..., :3]), mode="RGB").resize(
        (width, height), Image.Resampling.BICUBIC))
    if pixels.shape[-1] == 3:
        return rgb
    alpha = np.array(Image.fromarray(np.ascontiguousarray(pixels[..., 3]), mode="L").resize(
        (width, height), Image.Resampling.BICUBIC))
    return np.concatenate([rgb, alpha[..., None]], axis=-1)


def fill_transparent_background(pixels: np.ndarray, config: dict | None) -> np.ndarray:
    """RGBA -> RGB (spec 7.6 step 4): ``floor(clip(rgb * a + bg * (1 - a)))`` with ``a = A / 255``; without a
    ``transparent_bg_config`` the alpha channel is dropped."""
    if pixels.shape[-1] == 3:
        return pixels
    rgb = pixels[..., :3]
    if config is None:
        return np.ascontiguousarray(rgb)
    height, width = pixels.shape[:2]
    pattern = config.get("pattern", "black")
    if pattern == "black":
        background = np.zeros((height, width), dtype=np.float32)
    elif pattern == "white":
        background = np.full((height, width), 255.0, dtype=np.float32)
    elif pattern == "gray":
        background = np.full((height, width), 128.0, dtype=np.float32)
    elif pattern == "chessboard":
        square = int(config.get("chessboard_square_size", 16))
        white = float(config.get("chessboard_white_value", 255))
        gray = float(config.get("chessboard_gray_value", 200))
        gray_parity = 1 if config.get("chessboard_square_on_top_left", True) else 0
        parity = (np.arange(height)[:, None] // square + np.arange(width)[None, :] // square) % 2
        background = np.where(parity == gray_parity, gray, white).astype(np.float32)
    else:
        raise KimiK3ImageInputError(
            f"transparent_bg_config.pattern must be black, white, gray or chessboard, got {pattern!r}")
    alpha = pixels[..., 3:4].astype(np.float32) / 255.0
    out = alpha * rgb.astype(np.float32) + (1.0 - alpha) * background[..., None]
    return np.floor(np.clip(out, 0.0, 255.0)).astype(np.uint8)


def normalize_and_patchify(pixels: np.ndarray, pad_width: int, pad_height: int, mean: Sequence[float],
                           std: Sequence[float], patch_size: int) -> np.ndarray:
    """Pad with raw 0 at the right and bottom, then ``(x / 255 - mean) / std`` (padding becomes ``-mean/std``),
    then ``[gh * gw, 3, p, p]`` patches in row-major order (spec 7.6 steps 5-7)."""
    height, width = pixels.shape[:2]
    canvas = np.zeros((height + pad_height, width + pad_width, 3), dtype=np.uint8)
    canvas[:height, :width] = pixels
    x = (canvas.astype(np.float32) / 255.0 - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    gh, gw = x.shape[0] // patch_size, x.shape[1] // patch_size
    x = x.reshape(gh, patch_size, gw, patch_size, 3).transpose(0, 2, 4, 1, 3)
    return np.ascontiguousarray(x.reshape(gh * gw, 3, patch_size, patch_size))


class KimiK3ImageProcessor(BaseImageProcessor):
    r"""Kimi K3 image processor.

    Args:
        patch_size (`int`, defaults to 14): side of a vision patch in pixels.
        merge_kernel_size (`int`, defaults to 2): side of the window of patches merged into one text token.
        in_patch_limit (`int`, defaults to 16384): patches per image that larger images are scaled down to (the
            reference's rule: padding to whole merges can leave a few more, see the module docstring).
        patch_limit_on_one_side (`int`, defaults to 512): most patches along either side.
        image_mean, image_std (`list[float]`, default 0.5 each): per-channel normalisation.
        fixed_output_tokens (`int`, *optional*): if set, the placeholder count of every image (spec 7.6 step 8).
        transparent_bg_config (`dict`, *optional*): background for transparent images, ``{"pattern": "black" |
            "white" | "gray" | "chessboard", ...}``; without it the alpha channel is dropped.
        do_resize (`bool`, defaults to True): with False an image larger than the limits is an error.
        max_image_pixels (`int`, defaults to 64,000,000): larger images are refused before they are decoded or
            copied (a file's header states its size); None removes the budget.
        media_proc_cfg (`dict`, *optional*): the official ``preprocessor_config.json`` block; its keys override
            the arguments above.

    The limits and mean/std of the release are not known from SGLang (spec: [U]); the defaults are K2.5's.
    """

    model_input_names = ["pixel_values", "image_grid_thw"]

    def __init__(self, patch_size: int = 14, merge_kernel_size: int = 2, in_patch_limit: int = 16384,
                 patch_limit_on_one_side: int = 512, image_mean: Sequence[float] = (0.5, 0.5, 0.5),
                 image_std: Sequence[float] = (0.5, 0.5, 0.5), fixed_output_tokens: int | None = None,
                 transparent_bg_config: dict | None = None, transparent_bg_fill_stage: str = "after_resize",
                 do_resize: bool = True, media_proc_cfg: dict | None = None,
                 max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS, **kwargs):
        settings = dict(patch_size=patch_size, merge_kernel_size=merge_kernel_size, in_patch_limit=in_patch_limit,
                        patch_limit_on_one_side=patch_limit_on_one_side, image_mean=image_mean, image_std=image_std,
                        fixed_output_tokens=fixed_output_tokens, transparent_bg_config=transparent_bg_config,
                        transparent_bg_fill_stage=transparent_bg_fill_stage)
        if media_proc_cfg:
            settings.update({k: v for k, v in media_proc_cfg.items() if k in _MEDIA_PROC_KEYS})
        super().__init__(**kwargs)
        mk = settings["merge_kernel_size"]
        if isinstance(mk, (list, tuple)):
            if len(set(mk)) != 1:
                raise ValueError(f"merge_kernel_size must be square, got {mk}")
            mk = mk[0]
        self.patch_size = int(settings["patch_size"])
        self.merge_kernel_size = int(mk)
        self.in_patch_limit = int(settings["in_patch_limit"])
        self.patch_limit_on_one_side = int(settings["patch_limit_on_one_side"])
        self.image_mean = [float(v) for v in settings["image_mean"]]
        self.image_std = [float(v) for v in settings["image_std"]]
        self.fixed_output_tokens = settings["fixed_output_tokens"]
        self.transparent_bg_config = settings["transparent_bg_config"]
        if settings["transparent_bg_fill_stage"] != "after_resize":
            raise ValueError("transparent_bg_fill_stage: only 'after_resize' (the K3 reference) is supported, got "
                             f"{settings['transparent_bg_fill_stage']!r}")
        self.transparent_bg_fill_stage = "after_resize"
        self.do_resize = do_resize
        if max_image_pixels is not None and (isinstance(max_image_pixels, bool) or not isinstance(max_image_pixels, int)
                                             or max_image_pixels < 1):
            raise ValueError(f"max_image_pixels must be a positive int or None, got {max_image_pixels!r}")
        self.max_image_pixels = max_image_pixels

    # ---------------------------------------------------------------------------------------------- sizes
    def resize_plan(self, width: int, height: int) -> dict[str, int]:
        return resize_plan(width, height, self.patch_size, self.merge_kernel_size, self.in_patch_limit,
                           self.patch_limit_on_one_side, self.fixed_output_tokens)

    def get_number_of_image_tokens(self, width: int, height: int) -> int:
        """``<|media_pad|>`` tokens of a ``width x height`` image."""
        return self.resize_plan(width, height)["num_tokens"]

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
        """Patches fed to the tower (transformers/vLLM convention: height first)."""
        plan = self.resize_plan(width, height)
        return plan["grid_h"] * plan["grid_w"]

    # ---------------------------------------------------------------------------------------------- pixels
    def process_one(self, image: Any, do_resize: bool | None = None) -> dict[str, Any]:
        """One image -> ``patches [gh*gw, 3, p, p]`` (float32 NumPy), ``grid (1, gh, gw)``, ``num_tokens`` and the
        ``original_size (W, H)`` the prompt states."""
        pixels = to_uint8_hwc(image, self.max_image_pixels)
        height, width = pixels.shape[:2]
        plan = self.resize_plan(width, height)
        do_resize = self.do_resize if do_resize is None else do_resize
        if not do_resize and (plan["new_width"], plan["new_height"]) != (width, height):
            raise KimiK3ImageInputError(
                f"image of {width}x{height} pixels exceeds the limits (at most {self.in_patch_limit} patches of "
                f"{self.patch_size}px in all and {self.patch_limit_on_one_side} per side, i.e. "
                f"{self.patch_limit_on_one_side * self.patch_size}px) and do_resize=False")
        pixels = bicubic_resize(pixels, plan["new_width"], plan["new_height"])
        pixels = fill_transparent_background(pixels, self.transparent_bg_config)
        patches = normalize_and_patchify(pixels, plan["pad_width"], plan["pad_height"], self.image_mean,
                                         self.image_std, self.patch_size)
        return {"patches": patches, "grid": (1, plan["grid_h"], plan["grid_w"]), "num_tokens": plan["num_tokens"],
                "original_size": (width, height)}

    def preprocess(self, images: Any, do_resize: bool | None = None, return_tensors: str | None = "pt",
                   **kwargs) -> BatchFeature:
        """Images (one, a list, or a list of lists per sample; flattened in order) -> ``pixel_values
        [sum(gh*gw), 3, p, p]`` and ``image_grid_thw [n, 3]``."""
        flat = flatten_images(images)
        if not flat:
            raise KimiK3ImageInputError("no images were given")
        items = [self.process_one(image, do_resize) for image in flat]
        data = {
            "pixel_values": torch.from_numpy(np.concatenate([item["patches"] for item in items])),
            "image_grid_thw": torch.tensor([item["grid"] for item in items], dtype=torch.long),
        }
        return BatchFeature(data=data, tensor_type=return_tensors)

    def __call__(self, images: Any, **kwargs) -> BatchFeature:
        return self.preprocess(images, **kwargs)


def flatten_images(images: Any) -> list:
    """A single image, a list of images, or a list of per-sample lists -> a flat list, order kept."""
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        out = []
        for item in images:
            out.extend(flatten_images(item) if isinstance(item, (list, tuple)) else [item])
        return out
    if isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 4:
        return list(images)
    return [images]


__all__ = ["KimiK3ImageInputError", "KimiK3ImageProcessor", "resize_plan"]
