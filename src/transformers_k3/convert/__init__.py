"""Offline checkpoint converters for Kimi K3, above the model: the engines of the repository's ``conversion/*.py``
command-line converters.

* `official`     official K3 -> ours; `export` ours -> official (`export_release`: a model in memory -> official);
* `kimi_linear`  Kimi Linear -> K3; `tokenizer` tiktoken BPE model + special tokens -> a fast tokenizer;
* `expected`     the tensors a converted checkpoint must hold (the model built on the meta device).

Nothing below the model imports this package (`modeling_tests/test_import_layers.py`).
"""

from .export import export_release, export_to_official, official_config_dict
from .kimi_linear import convert_kimi_linear_checkpoint, kimi_linear_config_to_k3
from .official import convert_official_checkpoint, plan_official_conversion
from .tokenizer import convert_tiktoken_tokenizer

__all__ = [
    "convert_kimi_linear_checkpoint",
    "convert_official_checkpoint",
    "convert_tiktoken_tokenizer",
    "export_release",
    "export_to_official",
    "kimi_linear_config_to_k3",
    "official_config_dict",
    "plan_official_conversion",
]
