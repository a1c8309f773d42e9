"""The small shipped K3: local training data (`data`), the training script (`train`), and the loader (`load_small`).

Everything here runs on a laptop CPU with no network: text from the Python standard library installed on the machine,
images drawn with Pillow.
"""

from __future__ import annotations

from pathlib import Path

SMALL_DIR = Path(__file__).resolve().parent.parent / "assets" / "small"


def load_small(path: str | Path | None = None, dtype=None):
    """Load the shipped small K3 (or a directory written by `transformers_k3.small.train`).

    Returns ``(model, processor)``: a `KimiK3ForConditionalGeneration` in eval mode (fp32 unless ``dtype`` is given)
    and its `KimiK3Processor` (``processor.tokenizer`` is the BPE tokenizer with the K3 specials and chat template).
    """
    import torch

    from ..modeling_kimi_k3_vl import KimiK3ForConditionalGeneration
    from ..processing_kimi_k3 import KimiK3Processor

    path = Path(path) if path is not None else SMALL_DIR
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no K3 checkpoint at {path} (expected config.json and model.safetensors)")
    model = KimiK3ForConditionalGeneration.from_pretrained(path, dtype=dtype or torch.float32).eval()
    processor = KimiK3Processor.from_pretrained(path)
    return model, processor


__all__ = ["SMALL_DIR", "load_small"]
