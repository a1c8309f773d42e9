"""Command line: ``python -m transformers_k3 generate "def fibonacci(n):"`` streams tokens from the small K3 shipped in
the package (``--image PATH``, ``--thinking``, ``--max-new-tokens``, ``--model DIR``; see `generate_cli`), and
``python -m transformers_k3 demo [--model DIR]``.

``demo`` runs the whole text stack end to end on CPU in a few seconds: it builds the tiny K3 (every feature
on: KDA, gated NoPE MLA, Block AttnRes, latent MoE with SiTU-GLU) or loads ``--model DIR``, saves and reloads
it through the Auto classes, generates greedily with the hybrid cache and without it, checks that both agree
token for token, and prints what the cache holds and where the AttnRes reads look.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch


def _demo(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from . import KimiK3ForCausalLM, KimiK3HybridCache, KimiK3TextConfig

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transformers_k3", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the K3 text stack end to end on CPU")
    demo.add_argument("--model", help="a saved K3 directory (default: the tiny config, random weights)")
    demo.add_argument("--prompt-len", type=int, default=24)
    demo.add_argument("--max-new-tokens", type=int, default=20)
    demo.add_argument("--seed", type=int, default=0)
    from . import generate_cli

    generate_cli.add_parser(sub)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    if args.command == "generate":
        return generate_cli.run(args)
    return _demo(args)


if __name__ == "__main__":
    sys.exit(main())
