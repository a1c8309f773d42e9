"""Command line: ``python -m transformers_k3 generate "def fibonacci(n):"`` streams tokens from the small K3 shipped in
the package (``--image PATH``, ``--thinking``, ``--max-new-tokens``, ``--model DIR``; see `generate_cli`), and
``python -m transformers_k3 demo [--model DIR]``, and ``python -m transformers_k3 serve [MODEL]`` (transformers' OpenAI-compatible
server with K3 plugged in; see `serving`).

``demo`` runs the whole text stack end to end on CPU in a few seconds: it builds the tiny K3 (every feature
on: KDA, gated NoPE MLA, Block AttnRes, latent MoE with SiTU-GLU) or loads ``--model DIR``, saves and reloads
it through the Auto classes, generates greedily with the hybrid cache and without it, checks that both agree
token for token, and prints what the cache holds and where the AttnRes reads look.
"""

from __future__ import annotations

import argparse
import sys

# Nothing heavy at module level: --help and argument errors print before torch or transformers is imported.


SERVE_MIN_TRANSFORMERS = "5.25"  # the first release whose server runs each model through an EngineClient


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default after its help."""


def _register() -> None:
    """K3's Auto registrations (``import transformers_k3`` skips them when the package runs as ``-m``)."""
    import transformers_k3

    getattr(transformers_k3, "register", lambda: None)()


def _demo(args: argparse.Namespace) -> int:
    import tempfile
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from . import KimiK3ForCausalLM, KimiK3HybridCache, KimiK3TextConfig, kernelize

    _register()

    torch.manual_seed(args.seed)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        source = args.model
    else:
        print("No --model given: using the tiny K3 config with random weights (token ids only, no tokenizer).")
        model = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval()
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            model = AutoModelForCausalLM.from_pretrained(tmp).eval()
        source = "KimiK3TextConfig.tiny() (saved and reloaded with AutoModelForCausalLM)"
    kernelize(model)  # (the fused CPU kernels, docs/kernels.md)
    config = model.config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {type(model).__name__} from {source}: {n_params:,} parameters, "
          f"{config.num_hidden_layers} layers ({config.layer_types.count('linear_attention')} KDA, "
          f"{config.layer_types.count('full_attention')} MLA), AttnRes block {config.attn_res_block_size}")

    prompt = torch.randint(3, config.vocab_size, (1, args.prompt_len))
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None,
               pad_token_id=config.pad_token_id)
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(prompt, return_dict_in_generate=True, **gen)
        cached_s = time.perf_counter() - start
        start = time.perf_counter()
        uncached = model.generate(prompt, use_cache=False, **gen)
        uncached_s = time.perf_counter() - start
    new_tokens = out.sequences[0, args.prompt_len:].tolist()
    print(f"prompt: {args.prompt_len} random token ids; greedy continuation: {new_tokens}")
    same = torch.equal(out.sequences, uncached)
    print(f"with cache {cached_s:.2f} s, without cache {uncached_s:.2f} s; identical tokens: {same}")

    cache: KimiK3HybridCache = out.past_key_values
    print(f"hybrid cache after {cache.get_seq_length()} tokens: {cache.nbytes():,} bytes "
          f"(MLA latent {config.kv_lora_rank + config.qk_rope_head_dim} values/token/layer; KDA state constant)")
    with torch.no_grad():
        reads = model(out.sequences, output_attn_res_weights=True).attn_res_weights
    final = reads[-1][:, 0].mean(-1)
    print("final AttnRes read, mean weight per candidate (embedding block first): "
          + ", ".join(f"{w:.3f}" for w in final.tolist()))
    return 0 if same else 1


def _serve_parser(sub) -> argparse.ArgumentParser:
    from .small import SMALL_DIR

    serve = sub.add_parser("serve", formatter_class=HelpFormatter,
                           help="serve K3 through transformers' OpenAI-compatible server (chat completions, responses)",
                           description="transformers' own server (`transformers serve`) with K3 plugged in: chat "
                           "completions and the Responses API, streaming, reasoning_content, tool calls, images as "
                           "data URLs. Talk to it with the openai client or `transformers chat MODEL URL`.")
    serve.add_argument("model", nargs="?", default=str(SMALL_DIR),
                       help="a K3 checkpoint directory or Hub repo (the default is the small model shipped in the package)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 exposes it to the network)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--device", default="auto", help="device for the model (auto, cpu, cuda:0, ...)")
    serve.add_argument("--dtype", default="auto", help="model dtype (auto: the checkpoint's)")
    serve.add_argument("--reasoning", choices=("auto", "on", "off"), default="auto",
                       help="thinking for requests that do not set reasoning_effort (auto: K3's default, on)")
    serve.add_argument("--chat-template-kwargs", default=None,
                       help='JSON object of chat template arguments for every request, e.g. \'{"thinking_effort": '
                       '"low"}\'; a request\'s own chat_template_kwargs override them')
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="longest request, prompt and answer, in tokens (default: the model's context)")
    serve.add_argument("--default-seed", type=int, default=None, help="torch seed of the model's process")
    serve.add_argument("--continuous-batching", action="store_true",
                       help="refused for K3 with a message (its hybrid cache does not fit a paged KV cache); "
                       "requests are served one after another")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="server log level")
    serve.add_argument("--enable-cors", action="store_true", help="allow every origin (CORS)")
    return serve


def _check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Serve's arguments, refused before anything heavy is imported."""
    import importlib.util
    import json
    import os
    import re

    from importlib.metadata import version

    from packaging.version import Version

    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be 0-65535, got {args.port}")
    if os.path.exists(args.model):
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            parser.error(f"{args.model} has no config.json: pass a K3 checkpoint directory")
    elif not re.fullmatch(r"[\w.-]+/[\w.-]+(@[\w./-]+)?", args.model):
        parser.error(f"{args.model} does not exist: pass a K3 checkpoint directory or a Hub repo (org/name)")
    if args.chat_template_kwargs is not None:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except ValueError as error:
            parser.error(f"--chat-template-kwargs is not JSON ({error})")
        if not isinstance(kwargs, dict):
            parser.error("--chat-template-kwargs must be a JSON object")
    if args.max_model_len is not None and args.max_model_len < 2:
        parser.error(f"--max-model-len must be at least 2 tokens, got {args.max_model_len}")
    # (after the arguments: a mistyped option is named even where serving is not installed)
    missing = [name for name in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(name) is None]
    if missing:
        parser.error(f"serving needs {', '.join(missing)}: pip install \"transformers-k3[serve]\"")
    if Version(version("transformers")) < Version(SERVE_MIN_TRANSFORMERS):
        parser.error(f"serve plugs into the server of transformers >= {SERVE_MIN_TRANSFORMERS} (its model engines), "
                     f"this is {version('transformers')}: pip install \"transformers>={SERVE_MIN_TRANSFORMERS}\"")


def _serve(args: argparse.Namespace) -> int:
    import json

    _register()
    from .serving import CONTINUOUS_BATCHING_REFUSED, serve

    if args.continuous_batching:
        print(f"[transformers_k3 serve] {CONTINUOUS_BATCHING_REFUSED}", file=sys.stderr, flush=True)
    kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {}
    if args.reasoning != "auto":
        kwargs["thinking"] = args.reasoning == "on"
    try:
        serve(args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
              max_model_len=args.max_model_len, default_seed=args.default_seed, chat_template_kwargs=kwargs,
              log_level=args.log_level, enable_cors=args.enable_cors)
    except RuntimeError as error:  # the model's process failed to load it (its traceback is logged above)
        raise SystemExit(f"serve: {error}") from None
    return 0


def main(argv: list[str] | None = None) -> int:
    from . import generate_cli

    parser = argparse.ArgumentParser(prog="python -m transformers_k3", description=__doc__,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the K3 text stack end to end on CPU", formatter_class=HelpFormatter,
                          description="Build the tiny K3 (or load --model DIR), save and reload it through the Auto "
                          "classes, generate greedily with and without the hybrid cache, and check they agree.")
    demo.add_argument("--model", help="a saved K3 directory (None: the tiny config, random weights)")
    demo.add_argument("--prompt-len", type=int, default=24, help="random prompt token ids")
    demo.add_argument("--max-new-tokens", type=int, default=20, help="tokens to generate greedily")
    demo.add_argument("--seed", type=int, default=0, help="torch seed (random weights and prompt)")
    subparsers = {"demo": demo, "generate": generate_cli.add_parser(sub, HelpFormatter), "serve": _serve_parser(sub)}
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand's own usage, not the top-level one
        subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "generate":
        generate_cli.check_args(subparsers["generate"], args)
        return generate_cli.run(args)
    if args.command == "serve":
        _check_serve_args(subparsers["serve"], args)
        return _serve(args)
    _check_demo_args(demo, args)
    import torch

    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    return _demo(args)


def _check_demo_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    import os

    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        what = "does not exist" if not os.path.exists(args.model) else "has no config.json"
        parser.error(f"--model {args.model} {what}: pass a directory written by save_pretrained, or leave it out")
    for name in ("prompt_len", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


if __name__ == "__main__":
    sys.exit(main())
