"""Interleaved A/B of two source trees on the eager kernel rows of bench_kda.py and bench_moe.py (and the shipped
small model's greedy decode), in thread CPU time: ``python bench/ab_eager.py --base OLD_TREE --head NEW_TREE``.

Each (row, tree) is measured in a fresh process (``PYTHONPATH=TREE/src``, one thread, its own kernel build cache),
the trees alternating, ``--alternations`` times; a row reports the best time per tree and head / base. Thread CPU
time (``time.thread_time``) is what the row's thread computed, so another process on the other core moves it far
less than wall time. Every worker uses only the public entry points both trees have.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROWS = {
    "kda_prefill_h4": "KDA prefill, chunk_kda, H=4, K=V=128, T=1024 (ms)",
    "kda_prefill_h32": "KDA prefill, chunk_kda, H=32, K=V=128, T=1024 (ms)",
    "kda_decode_h4": "KDA decode step, T=1 from a state, H=4, K=V=128 (us)",
    "experts_fwd": "routed experts, 896 top-16, latent 128 / inter 32, 2,048 tokens, forward (ms)",
    "experts_fwd_bwd": "same, forward + backward (ms)",
    "experts_decode": "same, one decode token (us)",
    "layer_fwd": "whole K3 MoE layer, 512 tokens, forward (ms)",
    "layer_fwd_bwd": "same, forward + backward (ms)",
    "layer_decode": "same, one decode token (us)",
    "layer_decode_bf16": "same in bf16, one decode token (us)",
    "small_decode_fp32": "shipped small model, greedy decode, fp32 (ms/token)",
    "small_decode_bf16": "same in bf16 (ms/token)",
}


def _best(fn, reps: int, setup=None) -> float:
    """Best thread CPU seconds of ``fn()`` over ``reps`` calls after one warm-up (``setup()`` untimed before each)."""
    best = math.inf
    for rep in range(reps + 1):
        args = setup() if setup else ()
        start = time.thread_time()
        fn(*args)
        elapsed = time.thread_time() - start
        if rep:
            best = min(best, elapsed)
    return best


def _kda_inputs(length, heads, dim):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(1, length, heads, dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, length, heads, dim, generator=gen), dim=-1)
    v = torch.randn(1, length, heads, dim, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(1, length, heads, dim, generator=gen))
    beta = torch.rand(1, length, heads, generator=gen)
    return q, k, v, g, beta


def _moe_layer(dtype):
    import torch
    from torch import nn

    from transformers_k3 import KimiK3TextConfig
    from transformers_k3.layers.moe import K3_GROUPED_MM, KimiK3SparseMoE

    config = KimiK3TextConfig.tiny(hidden_size=256, num_experts=896, num_experts_per_token=16, moe_intermediate_size=32,
                                   routed_expert_hidden_size=128, num_shared_experts=1)  # fmt: skip
    layer = KimiK3SparseMoE(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.fill_(1.0) if "norm" in name else p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    for sub in layer.modules():
        if getattr(sub, "config", None) is not None and hasattr(sub, "gate_up_proj"):
            sub.config._experts_implementation = K3_GROUPED_MM
    assert isinstance(layer, nn.Module)
    return layer.to(dtype)


def worker(row: str, reps: int) -> float:
    """Seconds (thread CPU) of one call of ``row``, best of ``reps``."""
    import torch

    torch.set_num_threads(1)
    from transformers_k3.ops import cpu_kernel

    if cpu_kernel.library() is None:
        raise RuntimeError(f"the fused CPU kernels are unavailable: {cpu_kernel.load_error()}")
    if row.startswith("kda_prefill"):
        from transformers_k3.ops.kda import chunk_kda

        heads = 4 if row.endswith("h4") else 32
        inputs = _kda_inputs(1024, heads, 128)
        with torch.no_grad():
            return _best(lambda: chunk_kda(*inputs, output_final_state=True, backend="torch"), reps)
    if row == "kda_decode_h4":
        from transformers_k3.ops.kda import fused_recurrent_kda

        q, k, v, g, beta = _kda_inputs(1, 4, 128)
        state = 0.1 * torch.randn(1, 4, 128, 128, generator=torch.Generator().manual_seed(1))
        calls = 200

        def steps():
            for _ in range(calls):
                fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True, backend="torch",
                                    inplace_final_state=True)  # fmt: skip
        with torch.no_grad():
            return _best(steps, reps) / calls
    if row.startswith(("experts", "layer")):
        dtype = torch.bfloat16 if row.endswith("bf16") else torch.float32
        layer = _moe_layer(dtype)
        gen = torch.Generator().manual_seed(1)
        if row.startswith("experts"):
            module = layer.experts
            tokens = 1 if row == "experts_decode" else 2048
            x = torch.randn(tokens, 128, generator=gen).to(dtype)
            idx = torch.argsort(torch.rand(tokens, 896, generator=gen), dim=-1)[:, :16]
            w = torch.rand(tokens, 16, generator=gen)
            make = (lambda grad: (x.clone().requires_grad_(grad), idx, w.clone().requires_grad_(grad)))
        else:
            module = layer
            tokens = 1 if "decode" in row else 512
            x = torch.randn(1, tokens, 256, generator=gen).to(dtype)
            make = (lambda grad: (x.clone().requires_grad_(grad),))
        if "decode" in row:
            calls = 100

            def steps():
                for _ in range(calls):
                    module(*make(False))
            with torch.no_grad():
                return _best(steps, reps) / calls
        if row.endswith("fwd"):
            with torch.no_grad():
                return _best(lambda: module(*make(False)), reps)
        probe = torch.randn(module(*make(False)).shape, generator=gen).to(dtype)

        def setup():
            module.zero_grad(set_to_none=True)
            return make(True)
        return _best(lambda *a: (module(*a) * probe).sum().backward(), reps, setup)
    if row.startswith("small_decode"):
        from transformers_k3.small import load_small

        dtype = torch.bfloat16 if row.endswith("bf16") else torch.float32
        model, processor = load_small(dtype=dtype)
        ids = processor.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
        new = 17

        def run(n):
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        with torch.no_grad():
            # (the first token is the prefill's: its cost is taken off)
            return (_best(lambda: run(new), reps) - _best(lambda: run(1), reps)) / (new - 1)
    raise ValueError(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="the older source tree (its src/ is imported)")
    parser.add_argument("--head", help="the newer source tree")
    parser.add_argument("--alternations", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5, help="calls per worker (best of)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--worker", choices=list(ROWS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps({"seconds": worker(args.worker, args.reps)}))
        return
    trees = {"base": os.path.abspath(args.base), "head": os.path.abspath(args.head)}
    times = {(row, tree): [] for row in args.rows for tree in trees}
    for alternation in range(args.alternations):
        for row in args.rows:
            order = list(trees) if alternation % 2 == 0 else list(trees)[::-1]
            for tree in order:
                env = dict(os.environ, PYTHONPATH=os.path.join(trees[tree], "src"), OMP_NUM_THREADS="1",
                           TRANSFORMERS_K3_CACHE=f"/tmp/k3cache_ab_{tree}")  # fmt: skip
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", row,
                                      "--reps", str(args.reps)], env=env, capture_output=True, text=True)  # fmt: skip
                if out.returncode:
                    raise RuntimeError(f"{row} on {tree} failed:\n{out.stderr[-3000:]}")
                times[(row, tree)].append(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
            print(f"alternation {alternation + 1}, {row}: base {times[(row, 'base')][-1]:.6f} s, "
                  f"head {times[(row, 'head')][-1]:.6f} s", flush=True)
    print("\n| row | base | head | head / base | spread (max/min) base, head |")
    print("|---|---:|---:|---:|---|")
    for row in args.rows:
        scale = 1e6 if "(us)" in ROWS[row] else 1e3
        base, head = min(times[(row, "base")]), min(times[(row, "head")])
        spread = [max(times[(row, t)]) / min(times[(row, t)]) for t in trees]
        print(f"| {ROWS[row]} | {base * scale:,.1f} | {head * scale:,.1f} | {head / base:.3f} | "
              f"{spread[0]:.2f}, {spread[1]:.2f} |")


if __name__ == "__main__":
    main()
