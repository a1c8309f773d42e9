"""The notebooks in notebooks/ execute top to bottom on CPU against the shipped small checkpoint, and the main
command (``python -m transformers_k3 generate``) streams from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

from transformers_k3.small import SMALL_DIR  # noqa: E402

needs_small = pytest.mark.skipif(not (SMALL_DIR / "model.safetensors").exists(), reason="small checkpoint not shipped")


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "lora_finetuning.ipynb", "long_context.ipynb", "vision.ipynb",
            "segment_training.ipynb"} <= names


@needs_small
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    pytest.importorskip("ipykernel")
    if "lora" in path.name:
        pytest.importorskip("peft")
    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, f"{path.name} rendered no plot"


def _run_main(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "transformers_k3", "generate", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@needs_small
def test_main_command_generates_python():
    result = _run_main("def fibonacci(n):", "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("def fibonacci(n):")
    assert len(result.stdout.strip()) > len("def fibonacci(n):")
    assert "tokens/s" in result.stderr


def test_main_command_refuses_bad_arguments_clearly(tmp_path):
    """Bad arguments end with one line saying what to pass (exit status 1), not a traceback from deep inside."""
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not an image")
    for args, message in ((("--model", str(tmp_path / "missing")), "does not exist"),
                          (("--max-new-tokens", "0"), "--max-new-tokens must be at least 1"),
                          (("--image", str(not_an_image)), "is not an image Pillow can read")):
        result = _run_main("x", *args)
        assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


@needs_small
def test_main_command_image_and_long_prompt(tmp_path):
    from transformers_k3.small import data

    image = tmp_path / "shape.png"
    data.draw_shape("circle", "red", 56).save(image)
    result = _run_main("--image", str(image), "--no-thinking", "--max-new-tokens", "40")
    assert result.returncode == 0, result.stderr[-2000:]
    # the answer alone on stdout, no template markers, and it ended at the end of the message (the shipped
    # generation config must not forbid that: a no-repeat n-gram rule banned <|end_of_msg|>)
    assert result.stdout == "a red circle\n", result.stdout
    assert "chat, thinking off" in result.stderr and "cut at --max-new-tokens" not in result.stderr
    result = _run_main("--image", str(image), "--max-new-tokens", "40")  # thinking on, the chat default
    assert result.returncode == 0 and "chat, thinking on" in result.stderr, result.stderr[-2000:]
    # (an image question with thinking on is not what the small model was trained on: its words may vary)
    assert "<|" not in result.stdout + result.stderr and result.stdout.strip()
    long_prompt = "import os\n" + "x = os.path.join('a', 'b')\n" * 60
    result = _run_main(long_prompt, "--max-new-tokens", "4", "--prefill-chunk", "64")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "prefill" in result.stderr


@needs_small
def test_pipeline_on_the_small_model_is_deterministic_and_parses_chat_answers():
    """transformers' text-generation pipeline on the shipped directory: greedy by the shipped generation config (the
    pipeline would otherwise sample), and a chat answer that stops at its end and comes back split into reasoning and
    content (the shipped tokenizer carries K3's response template)."""
    from transformers import pipeline

    from transformers_k3 import KIMI_K3_RESPONSE_TEMPLATE

    generator = pipeline("text-generation", model=str(SMALL_DIR))
    assert generator.tokenizer.response_template == KIMI_K3_RESPONSE_TEMPLATE
    first, second = (generator("def fibonacci(n):", max_new_tokens=12)[0]["generated_text"] for _ in range(2))
    assert first == second and first.startswith("def fibonacci(n):")
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    answer = generator(messages, max_new_tokens=120)[0]["generated_text"][-1]
    assert answer["role"] == "assistant" and answer["content"] and answer["reasoning_content"]
    assert "<|" not in answer["content"] + answer["reasoning_content"]


@needs_small
def test_chunked_prefill_matches_single_pass():
    import torch

    from transformers_k3 import load_small
    from transformers_k3.generate_cli import chunked_prefill

    model, processor = load_small()
    ids = processor.tokenizer("def f(a, b):\n    return a + b\n" * 8, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        whole = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        cache = chunked_prefill(model, ids, 16)
        chunked = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(whole, chunked)


@needs_small
def test_load_small_from_pretrained_and_metrics():
    import json

    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(SMALL_DIR)
    processor = AutoProcessor.from_pretrained(SMALL_DIR)
    assert type(model).__name__ == "KimiK3ForConditionalGeneration"
    assert processor.tokenizer.chat_template
    text = model.config.text_config
    assert text.attn_res_block_size and text.num_experts and text.hidden_act == "situ"
    assert {"linear_attention", "full_attention"} == set(text.layer_types)
    metrics_path = SMALL_DIR / "metrics.json"
    if metrics_path.exists():
        metrics = json.loads(metrics_path.read_text())
        assert metrics["heldout_loss"] < metrics["unigram_baseline"]
