"""``python -m transformers_k3 generate PROMPT``: stream tokens from the shipped small K3 (or ``--model DIR``).

* plain prompt: a raw continuation (the small model is a Python-code model: try ``"def fibonacci(n):"``);
* ``--chat``: the prompt becomes a user message in K3's chat format. Thinking is ON by default, as K3 is trained:
  the model writes its reasoning first (shown on stderr after ``[thinking]``), then its answer (stdout).
  ``--no-thinking`` asks for the answer directly, ``--thinking-effort low|high|max`` sets the effort;
* ``--image PATH``: the prompt (default "What is in the image?") is asked about the image, in the chat format
  (the same thinking default; the shipped small model learned its image task without thinking: add
  ``--no-thinking``);
* a chat answer prints as text, never as template markers; tool calls the model writes are listed on stderr;
* long text prompts are pre-filled in chunks into the hybrid cache with a progress bar, then decoding
  continues from that cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PREFILL_CHUNK = 256
VISION_INSTALL = 'pip install "transformers-k3[vision]"'


def add_parser(sub, formatter_class: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    """The ``generate`` subcommand, formatted like the CLI's others (``formatter_class``: the CLI's)."""
    gen = sub.add_parser("generate", help="stream a continuation from the shipped small K3 (or --model DIR)",
                         description=__doc__, formatter_class=formatter_class)
    gen.add_argument("prompt", nargs="?", default=None, help='e.g. "def fibonacci(n):"; "-" reads stdin')
    gen.add_argument("--image", help="an image file to ask about (chat format)")
    gen.add_argument("--model", help="a K3 checkpoint directory (None: the small model shipped in the package)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--chat", action="store_true",
                     help="K3 chat format (thinking on by default, as K3 is trained; see --no-thinking)")
    gen.add_argument("--thinking", action="store_true", help="chat format with thinking on (the chat default)")
    gen.add_argument("--no-thinking", action="store_true",
                     help="chat format with thinking off: the model answers in the response channel directly")
    gen.add_argument("--thinking-effort", choices=("low", "high", "max"), default=None,
                     help="chat format: how much to think (a K3 system note; None: no note)")
    gen.add_argument("--sample", action="store_true", help="sample (temperature 0.8, top-p 0.95) instead of greedy")
    gen.add_argument("--seed", type=int, default=0, help="torch seed (for --sample)")
    gen.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                     help="prompt tokens per pre-fill step (a progress bar shows for prompts longer than this)")
    return gen


def load(model_dir: str | None):
    """(model, tokenizer, processor or None) for the shipped model or any K3 directory (text-only or with vision)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .auto import register

    register()
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


def chunked_prefill(model, input_ids, chunk: int):
    """Run all prompt tokens but the last through the text model in chunks of ``chunk`` (progress bar), returning
    the filled hybrid cache; generate() then only has the last prompt token left to process."""
    import torch
    from tqdm.auto import tqdm

    from .cache import KimiK3HybridCache

    text = _text_model(model)
    cache = KimiK3HybridCache(text.config)
    n = input_ids.shape[1] - 1
    with torch.no_grad(), tqdm(total=n, desc="prefill", unit="tok", file=sys.stderr, leave=False) as bar:
        for start in range(0, n, chunk):
            piece = input_ids[:, start:min(n, start + chunk)]
            text.model(input_ids=piece, past_key_values=cache, use_cache=True)
            bar.update(piece.shape[1])
    return cache


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Arguments that would otherwise fail deep inside loading or generation, refused before anything heavy is
    imported, with what to pass (usage errors through ``parser``, rc 2; wrong values one line, rc 1)."""
    import importlib.util
    from pathlib import Path

    if args.thinking and args.no_thinking:
        parser.error("--thinking and --no-thinking exclude each other: pass one")
    if args.image is None and not args.prompt:
        parser.error('give a prompt, e.g. python -m transformers_k3 generate "def fibonacci(n):" ("-" reads stdin)')
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.prefill_chunk < 1:
        raise SystemExit(f"--prefill-chunk must be at least 1 token, got {args.prefill_chunk}")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        what = "does not exist" if not Path(args.model).exists() else "has no config.json"
        raise SystemExit(f"--model {args.model} {what}: pass a K3 checkpoint directory (one written by "
                         "save_pretrained or by conversion/), or leave --model out for the shipped small model")
    if args.image is not None:
        if importlib.util.find_spec("PIL") is None:
            raise SystemExit(f"--image needs Pillow, which the base install leaves out: {VISION_INSTALL}")
        from PIL import Image, UnidentifiedImageError

        if not Path(args.image).is_file():
            raise SystemExit(f"--image {args.image}: no such file")
        try:
            with Image.open(args.image) as image:
                image.verify()
        except (UnidentifiedImageError, OSError, SyntaxError) as error:
            raise SystemExit(f"--image {args.image} is not an image Pillow can read ({error})") from None


class ChannelStreamer:
    """A `generate(streamer=...)` streamer for K3 chat answers: reasoning to ``err`` after ``[thinking]``, the answer
    to ``out``, no template markers. It re-parses the ids generated so far at each step (`parse_kimi_k3_response`
    on token ids, so only real control tokens are markers) and prints what grew."""

    def __init__(self, tokenizer, prompt, out=None, err=None):
        self.tokenizer, self.prompt = tokenizer, prompt
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.ids: list[int] = []
        self.skip_prompt = True
        self.shown = {"reasoning": "", "content": ""}
        self.parsed = None

    def put(self, value) -> None:
        if value.dim() > 1 and value.shape[0] > 1:
            raise ValueError("ChannelStreamer streams one answer: generate with a batch of 1 and num_beams=1")
        if self.skip_prompt:  # generate() first sends the prompt
            self.skip_prompt = False
            return
        self.ids.extend(int(i) for i in value.reshape(-1).tolist())
        self._show()

    def end(self) -> None:
        self._show()
        if self.shown["reasoning"] and not self.shown["content"]:
            print(file=self.err)
        if self.shown["content"]:
            print(file=self.out)

    def _show(self) -> None:
        from .chat import parse_kimi_k3_response

        self.parsed = parse_kimi_k3_response(self.ids, prompt=self.prompt, tokenizer=self.tokenizer)
        if self.shown["reasoning"] and not self.parsed.reasoning and not self.shown["content"]:
            # a bare <|close|>response<|sep|>: what looked like thinking was the answer
            print("\n[no thinking: the text above was the answer]", file=self.err, flush=True)
            self.shown["reasoning"] = ""
            self.shown["skipped"] = "yes"
        for field, stream, label in (("reasoning", self.err, "[thinking] "), ("content", self.out, "")):
            text = getattr(self.parsed, field) or ""
            text = text.rstrip("\ufffd")  # a character still being decoded byte by byte
            shown = self.shown[field]
            if len(text) > len(shown) and text.startswith(shown):
                if field == "content" and self.shown["reasoning"] and not shown and "skipped" not in self.shown:
                    print(file=self.err, flush=True)  # end the reasoning line before the answer starts
                stream.write((label if not shown else "") + text[len(shown):])
                stream.flush()
                self.shown[field] = text


def run(args: argparse.Namespace) -> int:
    """Generate for arguments `check_args` accepted."""
    import torch
    from transformers import TextStreamer

    from .ops.kernel_layers import kernelize

    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt and not args.image:
        raise SystemExit("the prompt read from stdin is empty: give a prompt")
    model, tokenizer, processor = load(args.model)
    kernelize(model)  # (the fused CPU kernels, docs/kernels.md)
    special = tokenizer.convert_tokens_to_ids
    stop_ids = [i for i in {tokenizer.eos_token_id, special("<|end_of_msg|>")} if i is not None and i >= 0]
    chat = bool(args.image or args.chat or args.thinking or args.no_thinking or args.thinking_effort)
    template = dict(add_generation_prompt=True, thinking=not args.no_thinking, thinking_effort=args.thinking_effort)
    if args.image:
        if processor is None:
            raise SystemExit("--image needs a checkpoint with a vision tower and a processor")
        from PIL import Image

        image = Image.open(args.image).convert("RGB")
        messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": prompt or "What is in the image?"}]}]
        rendered = processor.apply_chat_template(messages, **template)
        inputs = dict(processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                                    **template))
        inputs.pop("attention_mask", None)
    else:
        if not prompt:
            raise SystemExit("give a prompt, e.g. python -m transformers_k3 generate \"def fibonacci(n):\"")
        if chat:
            messages = [{"role": "user", "content": prompt}]
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, **template)
            inputs = {"input_ids": tokenizer.apply_chat_template(messages, return_tensors="pt", **template)["input_ids"]}
        else:
            inputs = {"input_ids": tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]}
    input_ids = inputs["input_ids"]
    loaded_s = time.perf_counter() - start
    n_params = sum(p.numel() for p in model.parameters())
    mode = ""
    if chat:
        mode = f"; chat, thinking {'off' if args.no_thinking else 'on'}" + (
            f" ({args.thinking_effort})" if args.thinking_effort and not args.no_thinking else "")
    print(f"[{type(model).__name__}, {n_params / 1e6:.1f}M parameters, loaded in {loaded_s:.1f}s; "
          f"prompt {input_ids.shape[1]} tokens{mode}]", file=sys.stderr)

    if "pixel_values" not in inputs and input_ids.shape[1] > args.prefill_chunk + 1:
        inputs["past_key_values"] = chunked_prefill(model, input_ids, args.prefill_chunk)

    if chat:
        streamer = ChannelStreamer(tokenizer, rendered)
    else:
        print(prompt, end="", flush=True)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
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
    if not chat:
        print(file=sys.stdout)
    else:
        parsed = streamer.parsed
        for call in parsed.tool_calls if parsed is not None else []:
            print(f"[tool call] {call.name}({json.dumps(call.arguments, ensure_ascii=False)})", file=sys.stderr)
        if parsed is not None and not parsed.finished:
            print("[the answer was cut at --max-new-tokens]", file=sys.stderr)
    print(f"[{len(new)} tokens in {elapsed:.2f}s, {len(new) / max(elapsed, 1e-9):.1f} tokens/s]", file=sys.stderr)
    return 0


__all__ = ["ChannelStreamer", "add_parser", "check_args", "chunked_prefill", "load", "run"]
