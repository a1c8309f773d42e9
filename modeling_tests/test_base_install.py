"""The base install (no extras): Pillow hidden from the import system, as on a machine that installed only
``pip install transformers-k3``. Text use imports and generates; images say which extra to install."""

import subprocess
import sys

SCRIPT = r'''
import importlib.abc, sys


class HidePillow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "PIL" or name.startswith("PIL."):
            raise ImportError(f"No module named {name!r}")


sys.meta_path.insert(0, HidePillow())
import numpy as np
import torch

import transformers_k3 as k3

model = k3.KimiK3ForCausalLM(k3.KimiK3TextConfig.tiny()).eval()
out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
assert out.shape == (1, 6), out.shape
tokenizer = k3.build_test_tokenizer()
ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)["input_ids"]
assert ids and "PIL" not in sys.modules
try:
    k3.KimiK3ImageProcessor().process_one(np.zeros((100, 90, 3), dtype=np.uint8))
except ImportError as error:
    assert "transformers-k3[vision]" in str(error), error
    print("OK")
'''


def test_text_use_without_pillow_and_a_clear_error_for_images():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]
