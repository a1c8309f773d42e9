"""Packed MXFP4 routed experts (issue 46, `transformers_k3.ops.mxfp4`) against bf16 and fp32 experts, at K3's
routing scale (896 experts, top-16) on a width where the experts dominate the bytes a token reads.

    python bench/bench_mxfp4.py                          # latent 512, intermediate 512, 256-token prefill
    python bench/bench_mxfp4.py --latent 1024 --prefill-tokens 512 --decode-calls 50

One latent K3 MoE layer (`KimiK3SparseMoE`: hidden 2 x latent, router, latent projections with norm, one shared
expert at full width) built in fp32 with random weights, its routed experts quantized with the release's rule
(`quantize_mxfp4_release`) and written back dequantized, so the three rows compute the same function:

* ``packed``: the experts kept as MXFP4 stacks (``gate_up_packed [E, 2I, D/2]`` ...) under the experts-interface
  function `mxfp4_experts_forward`, registered here as ``"k3_mxfp4"`` (the layer's other modules in bf16);
* ``bf16`` / ``fp32``: the layer cast to that dtype, its experts under ``"k3_grouped_mm"`` (the fused CPU kernel
  where it takes them, else the PyTorch grouped path).

Two tables: the routed experts alone (the same routing for every row) and the whole layer; each a decode step (one
token; median of ``--decode-calls`` calls) and a prefill (``--prefill-tokens`` tokens; best of ``--reps``), no
grad. "expert MB/token" is what the experts read per token (decode: the ``k`` routed experts' weights and scales;
prefill: every expert hit at least once, divided by the tokens); "GB/s" that over the time, the distance from
the memory roofline (the copy rate of this machine, measured first, is printed beside it)."""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time

import torch


def copy_rate(megabytes: int = 512) -> float:
    """This machine's memory copy rate (GB/s read + written), best of five."""
    src = torch.empty(megabytes << 18, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def quantize_experts(experts, chunk: int = 64):
    """The experts' packed stacks (release rule), and their weights replaced by the dequantized values."""
    from transformers_k3.conversion.quant import quantize_mxfp4_release
    from transformers_k3.ops.mxfp4_torch import dequantize

    stacks = []
    for param in (experts.gate_up_proj, experts.down_proj):
        e, n, k = param.shape
        packed = torch.empty(e, n, k // 2, dtype=torch.uint8)
        scale = torch.empty(e, n, k // 32, dtype=torch.uint8)
        with torch.no_grad():
            for i in range(0, e, chunk):
                block = param[i : i + chunk]
                p, s = quantize_mxfp4_release(block.reshape(-1, k))
                packed[i : i + chunk] = p.view(-1, n, k // 2)
                scale[i : i + chunk] = s.view(-1, n, k // 32)
                block.copy_(dequantize(packed[i : i + chunk], scale[i : i + chunk]))
        stacks += [packed, scale]
    return stacks


def build(args):
    from transformers_k3 import KimiK3TextConfig
    from transformers_k3.modeling_kimi_k3 import K3_GROUPED_MM, KimiK3SparseMoE
    from transformers_k3.ops.mxfp4 import MXFP4_EXPERTS

    E, k, D, I = args.experts, args.top_k, args.latent, args.intermediate
    config = KimiK3TextConfig.tiny(hidden_size=2 * D, num_experts=E, num_experts_per_token=k,
                                   moe_intermediate_size=I, routed_expert_hidden_size=D, num_shared_experts=1)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    fp32 = KimiK3SparseMoE(copy.deepcopy(config))
    with torch.no_grad():
        for name, p in fp32.named_parameters():
            p.copy_(torch.ones(()) if "norm" in name else torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    stacks = quantize_experts(fp32.experts)
    fp32.experts.config._experts_implementation = K3_GROUPED_MM

    shared = {name: t for name, t in fp32.state_dict().items() if not name.startswith("experts.")}
    with torch.device("meta"):
        bf16 = KimiK3SparseMoE(copy.deepcopy(config))
        packed = KimiK3SparseMoE(copy.deepcopy(config))
    bf16.load_state_dict(fp32.state_dict(), assign=True)
    bf16.to(torch.bfloat16)  # (copies: the fp32 layer keeps its tensors)
    bf16.experts.config._experts_implementation = K3_GROUPED_MM
    packed.load_state_dict(shared, strict=False, assign=True)
    del packed.experts.gate_up_proj, packed.experts.down_proj
    packed.to(torch.bfloat16)
    for name, t in zip(("gate_up_packed", "gate_up_scale", "down_packed", "down_scale"), stacks):
        packed.experts.register_buffer(name, t)
    packed.experts.config._experts_implementation = MXFP4_EXPERTS
    for layer in (fp32, bf16, packed):
        bad = [name for name, t in (*layer.named_parameters(), *layer.named_buffers()) if t.is_meta]
        assert not bad, bad
    return {"packed": packed, "bf16": bf16, "fp32": fp32}


def expert_bytes(layer) -> int:
    """Bytes of one expert's weights (and scales) as the layer stores them."""
    experts = layer.experts
    names = ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale") if hasattr(experts, "gate_up_packed") \
        else ("gate_up_proj", "down_proj")  # fmt: skip
    return sum(getattr(experts, n)[0].numel() * getattr(experts, n).element_size() for n in names)


def timed_median(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_best(fn, reps: int) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--latent", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--decode-calls", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="bf16,packed,fp32", help="which of bf16, packed, fp32 to run (bf16 first: the ratios)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from transformers_k3.ops import cpu_kernel
    from transformers_k3.ops.mxfp4 import MXFP4_EXPERTS, mxfp4_experts_forward

    ALL_EXPERTS_FUNCTIONS.register(MXFP4_EXPERTS, mxfp4_experts_forward)  # (the bench's own registration)
    cpu_kernel.library()
    rate = copy_rate()
    layers = build(args)
    rows = args.rows.split(",")
    E, k, D = args.experts, args.top_k, args.latent
    gen = torch.Generator().manual_seed(1)

    def routing(tokens):
        index = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
        return index, torch.rand(tokens, k, generator=gen)

    print(f"# torch {torch.__version__}, {args.threads} threads, copy rate {rate:.1f} GB/s, E={E} k={k} "
          f"latent={D} hidden={2 * D} I={args.intermediate}, prefill {args.prefill_tokens} tokens")  # fmt: skip
    for table in ("experts", "layer"):
        print(f"\n## {table}\n| step | row | time (ms) | tokens/s | expert MB/token | GB/s | vs bf16 |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for step, tokens in (("decode", 1), ("prefill", args.prefill_tokens)):
            index, weights = routing(tokens)
            hit = index.unique().numel()
            x = torch.randn(tokens, D if table == "experts" else 2 * D, generator=gen)
            results = {}
            for name in rows:
                layer = layers[name]
                dtype = torch.float32 if name == "fp32" else torch.bfloat16
                xs = x.to(dtype)
                if table == "experts":
                    fn = lambda: layer.experts(xs, index, weights)  # noqa: E731
                else:
                    fn = lambda: layer(xs)  # noqa: E731
                with torch.no_grad():
                    seconds = timed_median(fn, args.decode_calls) if step == "decode" else timed_best(fn, args.reps)
                per_token = expert_bytes(layer) * (k if tokens == 1 else hit) / tokens
                results[name] = seconds
                ratio = results["bf16"] / seconds if "bf16" in results else float("nan")
                print(f"| {step} | {name} | {seconds * 1e3:.2f} | {tokens / seconds:,.0f} | {per_token / 1e6:.2f} | "
                      f"{per_token * tokens / seconds / 1e9:.1f} | {ratio:.2f}x |", flush=True)  # fmt: skip
            if "bf16" in results and "packed" in results:
                print(f"|  | packed vs bf16 | | | | | {results['bf16'] / results['packed']:.2f}x |")
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
