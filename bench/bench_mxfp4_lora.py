"""A LoRA training step over the routed experts (issue 46, `transformers_k3.peft_mxfp4`): packed MXFP4 experts with
`packed_experts_lora` against bf16 experts with PEFT's own LoRA over expert parameters (``target_parameters``,
`ParamWrapper`), at K3's routing scale (896 experts, top-16) and bench_mxfp4's layer width.

    python bench/bench_mxfp4_lora.py                        # latent 512, intermediate 512, 256 tokens, r 16
    python bench/bench_mxfp4_lora.py --tokens 64 256 1024 --rank 8

One latent K3 MoE layer built as bench_mxfp4 builds it (`bench_mxfp4.build`: random fp32 weights, the experts
quantized by the release's rule and written back dequantized, so both rows compute the same function; the layer's
other modules in bf16). Rows, each a forward and backward of ``layer(x).float().square().mean()`` with ``x`` a
bf16 activation that needs its gradient (as inside a model), every weight but the adapters frozen:

* ``bf16 frozen`` / ``packed frozen``: no adapter on the experts (the gradient reaches ``x`` only): the base cost;
* ``bf16 + LoRA``: PEFT's ``target_parameters=["experts.gate_up_proj", "experts.down_proj"]`` (per-expert
  adapters in bf16 experts' layout, ``B @ A`` added to the weight stacks each forward);
* ``packed + LoRA``: ``packed_experts_lora(LoraConfig(target_modules=["experts"]))``, the same per-expert adapters
  beside the packed products.

The adapters are fp32 in both (PEFT's default). Best of ``--reps`` steps after one warm-up; "vs bf16 + LoRA" is the
bf16 LoRA step's time over the row's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_mxfp4  # noqa: E402


def with_lora(layer, packed: bool, rank: int):
    """``layer`` with LoRA on its routed experts (every other weight frozen), trainable adapter parameters."""
    import peft

    from transformers_k3.peft_mxfp4 import packed_experts_lora

    torch.manual_seed(0)
    for p in layer.parameters():
        p.requires_grad_(False)
    if packed:
        config = packed_experts_lora(peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["experts"],
                                                     init_lora_weights="gaussian"))  # fmt: skip
    else:
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[], init_lora_weights="gaussian",
                                 target_parameters=["experts.gate_up_proj", "experts.down_proj"])  # fmt: skip
    layer = peft.inject_adapter_in_model(config, layer)
    adapters = [p for n, p in layer.named_parameters() if "lora_" in n]
    for p in adapters:
        p.requires_grad_(True)
    with torch.no_grad():  # (B starts at zero: nonzero values make the step compute what training computes)
        for n, p in layer.named_parameters():
            if "lora_B" in n or "lora_down_B" in n:
                p.normal_(std=1e-3)
    return layer, adapters


def step(layer, x, adapters):
    def run():
        for p in adapters:
            p.grad = None
        x.grad = None
        layer(x).float().square().mean().backward()

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_mxfp4.add_layer_arguments(parser)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="bf16 frozen,bf16 + LoRA,packed frozen,packed + LoRA")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="time the steps by wall clock or by this thread's CPU time (with --threads 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "thread":
        if args.threads != 1:
            parser.error("--clock thread times one thread's work: use it with --threads 1")
        bench_mxfp4.CLOCK[0] = time.thread_time

    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from transformers_k3.ops import cpu_kernel
    from transformers_k3.ops.mxfp4 import MXFP4_EXPERTS, mxfp4_experts_forward
    from transformers_k3.quantization_kimi_k3 import KimiK3PackedExperts

    ALL_EXPERTS_FUNCTIONS.register(MXFP4_EXPERTS, mxfp4_experts_forward)
    cpu_kernel.library()
    layers = bench_mxfp4.build(args)
    del layers["fp32"]
    old = layers["packed"].experts  # (bench_mxfp4's layer holds the stacks on a `KimiK3Experts`)
    with torch.device("meta"):
        experts = KimiK3PackedExperts(old.config)  # (the class `packed_experts_lora` maps)
    for name in ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale"):  # (frozen uint8 parameters)
        setattr(experts, name, torch.nn.Parameter(getattr(old, name), requires_grad=False))
    layers["packed"].experts = experts
    print(f"# torch {torch.__version__}, {args.threads} threads, {args.clock} clock, E={args.experts} k={args.top_k} "
          f"latent={args.latent} I={args.intermediate} rank={args.rank}")
    print("\n| tokens | row | step (ms) | vs bf16 + LoRA |\n|---:|---|---:|---:|")
    gen = torch.Generator().manual_seed(1)
    for tokens in args.tokens:
        x = torch.randn(tokens, 2 * args.latent, generator=gen).to(torch.bfloat16).requires_grad_()
        results = {}
        for row in args.rows.split(","):
            kind, lora = row.split(" ")[0], row.endswith("LoRA")
            layer, adapters = layers[kind], []
            if lora:
                import copy

                layer, adapters = with_lora(copy.deepcopy(layer), kind == "packed", args.rank)
            else:
                for p in layer.parameters():
                    p.requires_grad_(False)
            seconds = bench_mxfp4.timed_best(step(layer, x, adapters), args.reps)
            results[row] = seconds
            base = results.get("bf16 + LoRA")
            print(f"| {tokens} | {row} | {seconds * 1e3:.1f} | {base / seconds if base else float('nan'):.2f}x |",
                  flush=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
