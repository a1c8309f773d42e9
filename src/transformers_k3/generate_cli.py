"""``python -m transformers_k3 generate PROMPT``: stream tokens from the shipped small K3 (or ``--model DIR``).

* plain prompt: a raw continuation (the small model is a Python-code model: try ``"def fibonacci(n):"``);
* ``--thinking``: the prompt becomes a user message in the K3 chat template, the model thinks first
  (``<|open|>think<|sep|>`` pre-filled) and the answer is split into reasoning and response;
* ``--image PATH``: the prompt (default "What is in the image?") is asked about the image, chat format;
* long text prompts are pre-filled in chunks into the hybrid cache with a progress bar, then decoding
  continues from that cache.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

PREFILL_CHUNK = 256


def add_parser(sub) -> argparse.ArgumentParser:
    gen = sub.add_parser("generate", help="stream a continuation from the shipped small K3 (or --model DIR)",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("prompt", nargs="?", default=None, help='e.g. "def fibonacci(n):"; "-" reads stdin')
    gen.add_argument("--image", help="an image file to ask about (chat format)")
    gen.add_argument("--model", help="a K3 checkpoint directory (default: the small model shipped in the package)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--thinking", action="store_true", help="chat format with the think channel opened first")
    gen.add_argument("--sample", action="store_true", help="sample (temperature 0.8, top-p 0.95) instead of greedy")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                     help="prompt tokens per pre-fill step (a progress bar shows for prompts longer than this)")
    return gen


def load(model_dir: str | None):
    """(model, tokenizer, processor or None) for the shipped model or any K3 directory (text-only or with vision)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .small import SMALL_DIR, load_small

    if model_dir is None:
        if not (SMALL_DIR / "config.json").exists():
            raise SystemExit(f"the small checkpoint is missing from {SMALL_DIR}; train it with "
                             "`python -m transformers_k3.small.train --out DIR` and pass --model DIR")
        model, processor = load_small()
        return model, processor.tokenizer, processor
    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, "vision_config", None) is not None:
        from .small import load_small as load_vl

        model, processor = load_vl(model_dir)
        return model, processor.tokenizer, processor
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--model {model_dir} has no usable tokenizer ({type(error).__name__}): generation needs the "
                         "checkpoint's tokenizer files next to its weights (conversion/ writes them)") from None
    return model, tokenizer, None


def _text_model(model):
    return getattr(model, "language_model", model)


@torch.no_grad()
def chunked_prefill(model, input_ids: torch.Tensor, chunk: int):
    """Run all prompt tokens but the last through the text model in chunks of ``chunk`` (progress bar), returning
    the filled hybrid cache; generate() then only has the last prompt token left to process."""
    from tqdm.auto import tqdm

    from .cache import KimiK3HybridCache

    text = _text_model(model)
    cache = KimiK3HybridCache(text.config)
    n = input_ids.shape[1] - 1
    with tqdm(total=n, desc="prefill", unit="tok", file=sys.stderr, leave=False) as bar:
        for start in range(0, n, chunk):
            piece = input_ids[:, start:min(n, start + chunk)]
            text.model(input_ids=piece, past_key_values=cache, use_cache=True)
            bar.update(piece.shape[1])
    return cache


def _check_args(args: argparse.Namespace) -> None:
    """Arguments that would otherwise fail deep inside loading or generation, refused up front with what to pass."""
    from pathlib import Path

    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.prefill_chunk < 1:
        raise SystemExit(f"--prefill-chunk must be at least 1 token, got {args.prefill_chunk}")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        what = "does not exist" if not Path(args.model).exists() else "has no config.json"
        raise SystemExit(f"--model {args.model} {what}: pass a K3 checkpoint directory (one written by "
                         "save_pretrained or by conversion/), or leave --model out for the shipped small model")
    if args.image is not None:
        from PIL import Image, UnidentifiedImageError

        if not Path(args.image).is_file():
            raise SystemExit(f"--image {args.image}: no such file")
        try:
            with Image.open(args.image) as image:
                image.verify()
        except (UnidentifiedImageError, OSError, SyntaxError) as error:
            raise SystemExit(f"--image {args.image} is not an image Pillow can read ({error})") from None


def run(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    _check_args(args)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    model, tokenizer, processor = load(args.model)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    special = tokenizer.convert_tokens_to_ids
    stop_ids = [i for i in {tokenizer.eos_token_id, special("<|end_of_msg|>")} if i is not None and i >= 0]
    inputs: dict = {}
    chat = bool(args.image or args.thinking)
    if args.image:
        if processor is None:
            raise SystemExit("--image needs a checkpoint with a vision tower and a processor")
        from PIL import Image

        image = Image.open(args.image).convert("RGB")
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": prompt or "What is in the image?"}]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             thinking=args.thinking)
        inputs = dict(processor(images=[image], text=[text], return_tensors="pt"))
        inputs.pop("attention_mask", None)
    else:
        if not prompt:
            raise SystemExit("give a prompt, e.g. python -m transformers_k3 generate \"def fibonacci(n):\"")
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True, thinking=True)
        else:
            text = prompt
        inputs = {"input_ids": tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]}
    input_ids = inputs["input_ids"]
    loaded_s = time.perf_counter() - start
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{type(model).__name__}, {n_params / 1e6:.1f}M parameters, loaded in {loaded_s:.1f}s; "
          f"prompt {input_ids.shape[1]} tokens]", file=sys.stderr)

    if "pixel_values" not in inputs and input_ids.shape[1] > args.prefill_chunk + 1:
        inputs["past_key_values"] = chunked_prefill(model, input_ids, args.prefill_chunk)

    if chat:
        print(tokenizer.decode(input_ids[0][-3:], skip_special_tokens=False), end="", flush=True)
    else:
        print(prompt, end="", flush=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=not chat)
    gen = dict(max_new_tokens=args.max_new_tokens, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id,
               streamer=streamer)
    if args.sample:
        gen.update(do_sample=True, temperature=0.8, top_p=0.95)
    else:
        gen.update(do_sample=False)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, **gen)
    elapsed = time.perf_counter() - start
    new = out[0, input_ids.shape[1]:]
    print(file=sys.stdout)
    if chat:
        from .chat import parse_kimi_k3_response

        prefix = tokenizer.decode(input_ids[0], skip_special_tokens=False)
        parsed = parse_kimi_k3_response(tokenizer.decode(new, skip_special_tokens=False), prompt=prefix)
        if parsed.reasoning:
            print(f"[reasoning] {parsed.reasoning}", file=sys.stderr)
        print(f"[response] {parsed.content}", file=sys.stderr)
    print(f"[{len(new)} tokens in {elapsed:.2f}s, {len(new) / max(elapsed, 1e-9):.1f} tokens/s]", file=sys.stderr)
    return 0


__all__ = ["add_parser", "chunked_prefill", "load", "run"]
