"""Kimi K3 video processor.

The K3 tower reads video as chunks of at most ``init_pos_emb_time = 4`` frames: the frames of a chunk share one
grid, get a fixed sin/cos time embedding, attend to each other, and are averaged over time after the 2x2 merge,
so a chunk costs as many tokens as one of its frames (``gh * gw / 4``). SGLang's K3 processor rejects video and
the checkpoint's own video pipeline is unknown (K3_SPEC.md 7.6, [U]). This processor makes the K2.5 choices:

* frames are sampled at ``fps`` (default 2) frames per second of video time, at most ``max_frames`` per video;
* consecutive groups of ``temporal_patch_size = 4`` sampled frames form a chunk (the last one may be shorter);
* each frame is resized like an image (with the per-frame patch budget ``in_patch_limit``, default 4096, i.e. at
  most 1024 tokens per chunk), padded, normalised and patchified; a chunk's patches are frame-major;
* in the prompt each chunk is ``HH:MM:SS.mmm<|media_begin|>video<|media_content|>`` + its ``<|media_pad|>``
  tokens + ``<|media_end|>``, the timestamp being that of the chunk's first frame (done by `KimiK3Processor`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers.image_processing_utils import BatchFeature
from transformers.video_processing_utils import VideoProcessorMixin

from .image_processing_kimi_k3 import (
    KimiK3ImageInputError,
    bicubic_resize,
    fill_transparent_background,
    normalize_and_patchify,
    resize_plan,
    to_uint8_hwc,
)


class KimiK3VideoInputError(ValueError):
    """A video cannot be processed (empty, too long without sampling, unreadable...)."""


def format_timestamp(seconds: float) -> str:
    """``HH:MM:SS.mmm`` (milliseconds truncated)."""
    millis = int(math.floor(seconds * 1000 + 1e-6))
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, millis = divmod(rest, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}.{millis:03d}"


def _positive_fps(value: Any, name: str) -> float:
    """``value`` as a frame rate: a finite number above 0 (a rate of 0 or below has no frame spacing)."""
    try:
        fps = float(value)
    except (TypeError, ValueError):
        raise KimiK3VideoInputError(f"{name} must be a number of frames per second, got {value!r}") from None
    if not math.isfinite(fps) or fps <= 0:
        raise KimiK3VideoInputError(f"{name} must be a finite number of frames per second above 0, got {value!r}; "
                                    "pass e.g. fps=2 (the default), or num_frames=N to take N evenly spread frames")
    return fps


def _metadata_fps(metadata: Any) -> float | None:
    """The source video's frame rate from its metadata; None when it is not given (0 / None: unknown)."""
    if metadata is None:
        return None
    fps = metadata.get("fps") if isinstance(metadata, dict) else getattr(metadata, "fps", None)
    if fps is None or (isinstance(fps, (int, float)) and fps == 0):
        return None
    return _positive_fps(fps, "video_metadata fps (the source video's frame rate)")


class KimiK3VideoProcessor(VideoProcessorMixin):
    r"""Kimi K3 video processor (frame sampling, chunking, resizing; see the module docstring).

    Args:
        fps (`float`, defaults to 2.0): sampled frames per second of video (needs the source fps from
            ``video_metadata``; without it the given frames are taken as already sampled at ``fps``).
        max_frames (`int`, defaults to 128): most frames kept per video; longer samplings are thinned uniformly.
        temporal_patch_size (`int`, defaults to 4): frames per chunk (at most the tower's ``init_pos_emb_time``).
        in_patch_limit (`int`, defaults to 4096): patch budget of one frame.
        patch_limit_on_one_side, patch_size, merge_kernel_size, image_mean, image_std: as for images.
        do_sample_frames (`bool`, defaults to True): with False every given frame is used (an error if more
            than ``max_frames``).
    """

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, patch_size: int = 14, merge_kernel_size: int = 2, in_patch_limit: int = 4096,
                 patch_limit_on_one_side: int = 512, image_mean: Sequence[float] = (0.5, 0.5, 0.5),
                 image_std: Sequence[float] = (0.5, 0.5, 0.5), temporal_patch_size: int = 4, fps: float = 2.0,
                 max_frames: int = 128, do_sample_frames: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = int(patch_size)
        self.merge_kernel_size = int(merge_kernel_size)
        self.in_patch_limit = int(in_patch_limit)
        self.patch_limit_on_one_side = int(patch_limit_on_one_side)
        self.image_mean = [float(v) for v in image_mean]
        self.image_std = [float(v) for v in image_std]
        self.temporal_patch_size = int(temporal_patch_size)
        self.fps = _positive_fps(fps, "fps")
        if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
            raise KimiK3VideoInputError(f"max_frames must be an integer >= 1, got {max_frames!r}")
        self.max_frames = int(max_frames)
        self.do_sample_frames = bool(do_sample_frames)

    # ---------------------------------------------------------------------------------------------- frames
    @staticmethod
    def to_frames(video: Any) -> list[np.ndarray]:
        """A video as a list of ``uint8 [H, W, 3]`` frames. Accepts ``[T, H, W, C]`` / ``[T, C, H, W]`` arrays or
        tensors, lists of PIL images or arrays, and data URLs (decoded with transformers' ``load_video``)."""
        if isinstance(video, str):  # data URLs only: paths and URLs go through KimiK3Processor's media policy
            from .media_kimi_k3 import MediaPolicy

            video = MediaPolicy().load_video(video)
        if isinstance(video, torch.Tensor):
            video = video.detach().cpu().numpy()
        if isinstance(video, np.ndarray):
            if video.ndim != 4:
                raise KimiK3VideoInputError(f"video arrays must be [T, H, W, C] or [T, C, H, W], got {video.shape}")
            video = list(video)
        if not isinstance(video, (list, tuple)):
            raise KimiK3VideoInputError(f"unsupported video type {type(video).__name__}")
        frames = []
        for frame in video:
            try:
                pixels = to_uint8_hwc(frame)
            except KimiK3ImageInputError as err:
                raise KimiK3VideoInputError(f"bad video frame: {err}") from err
            frames.append(fill_transparent_background(pixels, None))
        if not frames:
            raise KimiK3VideoInputError("empty video: it has 0 frames")
        sizes = {frame.shape for frame in frames}
        if len(sizes) != 1:
            raise KimiK3VideoInputError(f"all frames of a video must have one size, got {sorted(sizes)}")
        return frames

    def sample_indices(self, num_total: int, source_fps: float | None, fps: float | None = None,
                       num_frames: int | None = None, do_sample_frames: bool | None = None) -> list[int]:
        """Indices of the frames kept. ``num_frames`` takes that many, evenly spread; otherwise frames are taken
        every ``source_fps / fps`` frames (all of them when the source fps is unknown), at most ``max_frames``."""
        if num_total == 0:
            raise KimiK3VideoInputError("empty video: it has 0 frames")
        do_sample = self.do_sample_frames if do_sample_frames is None else do_sample_frames
        if num_frames is not None:
            if isinstance(num_frames, bool) or not isinstance(num_frames, (int, np.integer)) or num_frames < 1:
                raise KimiK3VideoInputError(f"num_frames must be an integer >= 1, got {num_frames!r}")
            return np.linspace(0, num_total - 1, min(num_frames, num_total)).round().astype(int).tolist()
        if not do_sample:
            if num_total > self.max_frames:
                raise KimiK3VideoInputError(
                    f"video has {num_total} frames, more than max_frames={self.max_frames}; enable do_sample_frames "
                    "or raise max_frames")
            return list(range(num_total))
        fps = self.fps if fps is None else _positive_fps(fps, "fps")
        step = source_fps / fps if source_fps else 1.0
        indices = np.arange(0, num_total, max(step, 1.0)).astype(int)
        if len(indices) > self.max_frames:
            pick = np.linspace(0, len(indices) - 1, self.max_frames).round().astype(int)
            indices = indices[pick]
        return indices.tolist()

    # ---------------------------------------------------------------------------------------------- chunks
    def process_video(self, video: Any, metadata: Any = None, fps: float | None = None, num_frames: int | None = None,
                      do_sample_frames: bool | None = None) -> dict[str, Any]:
        """One video -> its chunks: ``patches`` (frame-major, per chunk), ``grids [(t, gh, gw)]``,
        ``num_tokens`` per chunk, ``timestamps`` (seconds, first frame of each chunk) and ``size (W, H)``."""
        frames = self.to_frames(video)
        source_fps = _metadata_fps(metadata)
        indices = self.sample_indices(len(frames), source_fps, fps, num_frames, do_sample_frames)
        clock = source_fps or (self.fps if fps is None else _positive_fps(fps, "fps"))
        height, width = frames[0].shape[:2]
        plan = resize_plan(width, height, self.patch_size, self.merge_kernel_size, self.in_patch_limit,
                           self.patch_limit_on_one_side)
        patches, grids, tokens, stamps = [], [], [], []
        for start in range(0, len(indices), self.temporal_patch_size):
            chunk = indices[start:start + self.temporal_patch_size]
            for index in chunk:
                pixels = bicubic_resize(frames[index], plan["new_width"], plan["new_height"])
                patches.append(normalize_and_patchify(pixels, plan["pad_width"], plan["pad_height"], self.image_mean,
                                                      self.image_std, self.patch_size))
            grids.append((len(chunk), plan["grid_h"], plan["grid_w"]))
            tokens.append(plan["grid_h"] * plan["grid_w"] // self.merge_kernel_size**2)
            stamps.append(chunk[0] / clock)
        return {"patches": np.concatenate(patches), "grids": grids, "num_tokens": tokens, "timestamps": stamps,
                "size": (width, height)}

    def preprocess(self, videos: Any, video_metadata: Any = None, fps: float | None = None,
                   num_frames: int | None = None, do_sample_frames: bool | None = None,
                   return_tensors: str | None = "pt", **kwargs) -> BatchFeature:
        """Videos (one or a list) -> ``pixel_values_videos [sum(t*gh*gw), 3, p, p]`` and ``video_grid_thw`` with one
        row per chunk, videos in order."""
        videos = self.as_video_list(videos)
        metadata = video_metadata if isinstance(video_metadata, (list, tuple)) else [video_metadata] * len(videos)
        items = [self.process_video(v, m, fps, num_frames, do_sample_frames) for v, m in zip(videos, metadata)]
        data = {
            "pixel_values_videos": torch.from_numpy(np.concatenate([item["patches"] for item in items])),
            "video_grid_thw": torch.tensor([g for item in items for g in item["grids"]], dtype=torch.long),
        }
        return BatchFeature(data=data, tensor_type=return_tensors)

    def __call__(self, videos: Any, **kwargs) -> BatchFeature:
        return self.preprocess(videos, **kwargs)

    @staticmethod
    def as_video_list(videos: Any) -> list:
        """One video or a (possibly per-sample nested) list of videos -> flat list of videos."""
        if videos is None:
            return []
        if isinstance(videos, str) or (isinstance(videos, (np.ndarray, torch.Tensor)) and videos.ndim == 4):
            return [videos]
        if isinstance(videos, (np.ndarray, torch.Tensor)) and videos.ndim == 5:
            return list(videos)
        if isinstance(videos, (list, tuple)):
            if not videos:
                return []
            first = videos[0]
            # A list of frames (PIL images or 3-D arrays) is one video.
            if not isinstance(first, (list, tuple, str)) and not (
                    isinstance(first, (np.ndarray, torch.Tensor)) and first.ndim >= 4):
                return [videos]
            out = []
            for item in videos:
                if isinstance(item, (list, tuple)) and not item:
                    continue  # a sample without videos in a per-sample batch
                if isinstance(item, (list, tuple)) and isinstance(item[0], (list, tuple, str)):
                    out.extend(KimiK3VideoProcessor.as_video_list(item))
                elif isinstance(item, (list, tuple)) and isinstance(item[0], (np.ndarray, torch.Tensor)) \
                        and item[0].ndim >= 4:
                    out.extend(item)
                else:
                    out.append(item)
            return out
        raise KimiK3VideoInputError(f"unsupported video input type {type(videos).__name__}")


__all__ = ["KimiK3VideoInputError", "KimiK3VideoProcessor", "format_timestamp"]
