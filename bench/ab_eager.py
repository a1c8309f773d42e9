"""Interleaved A/B of two source trees on the eager kernel rows of bench_kda.py and bench_moe.py (and the shipped
small model's greedy decode, and the K3-featured bench model's decode step), in thread CPU time: ``python bench/ab_eager.py --base OLD_TREE --head NEW_TREE``.

Each (row, tree) is measured in a fresh process (``PYTHONPATH=TREE/src``, one thread, its own kernel build cache),
the trees alternating, ``--alternations`` times; a row reports the best time per tree and head / base. Thread CPU
time (``time.thread_time``) is what the row's thread computed, so another process on the other core moves it far
less than wall time. Every worker uses only the public entry points both trees have.

``--same-process`` loads both trees into one process instead (the base's package copied under another name) and
times one call of each in turn, ``--rounds`` times per row: the pair sees the same machine from one moment to the
next, so the median of the rounds' ratios is far steadier than bests taken minutes apart on a noisy machine.
Only a base from before the kernels became operators can share a process with the head: two builds cannot both
register the ``transformers_k3`` operator namespace (the process aborts).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import subprocess
import sys
import time

from bench_kda import _make_inputs  # (the K3-like KDA inputs of bench_kda's rows; bench/ is this script's path)
from bench_long_context import k3_config_dict  # (the K3-featured bench model, every K3 feature on)

K3_PREFILL, K3_STEPS = 1024, 16

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
    "k3_decode": f"K3-featured bench model (bench_long_context --model-kind k3), decode step after a "
                 f"{K3_PREFILL:,}-token prefill, fp32 (ms/token)",
}


def _moe_layer(pkg, dtype):
    import torch
    from torch import nn

    KimiK3TextConfig = importlib.import_module(pkg).KimiK3TextConfig
    moe = importlib.import_module(pkg + ".modeling_kimi_k3")  # (the baseline tree imports these names there too)
    config = KimiK3TextConfig.tiny(hidden_size=256, num_experts=896, num_experts_per_token=16, moe_intermediate_size=32,
                                   routed_expert_hidden_size=128, num_shared_experts=1)  # fmt: skip
    layer = moe.KimiK3SparseMoE(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.fill_(1.0) if "norm" in name else p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    for sub in layer.modules():
        if getattr(sub, "config", None) is not None and hasattr(sub, "gate_up_proj"):
            sub.config._experts_implementation = moe.K3_GROUPED_MM
    assert isinstance(layer, nn.Module)
    return _kernelized(pkg, layer.to(dtype))


def _kernelized(pkg, model):
    """``model`` with the fused CPU kernels attached the way the README says (trees from before `kernelize` had
    them on by default)."""
    kernelize = getattr(importlib.import_module(pkg), "kernelize", None)
    return model if kernelize is None else kernelize(model)


def make_row(row: str, pkg: str = "transformers_k3"):
    """``(unit, setup, per)`` for ``row`` on the package ``pkg``: ``unit(*setup())`` is one timed call, standing for
    ``per`` of the row's operations (its time is divided by ``per``); ``setup`` is None or runs untimed before it.
    Runs without autograd where the row has none (``unit`` enters no_grad itself)."""
    import torch

    cpu_kernel = importlib.import_module(pkg + ".ops.cpu_kernel")
    if cpu_kernel.library() is None:
        raise RuntimeError(f"the fused CPU kernels are unavailable: {cpu_kernel.load_error()}")

    def no_grad(fn):
        def run(*args):
            with torch.no_grad():
                return fn(*args)
        return run

    kda = importlib.import_module(pkg + ".ops.kda")
    # (trees since kernels became opt-in take the CPU operator by `kernel=True`, as a kernelized layer passes it)
    on = {"kernel": True} if "kernel" in inspect.signature(kda.chunk_kda).parameters else {}
    if row.startswith("kda_prefill"):
        inputs = _make_inputs(1024, 4 if row.endswith("h4") else 32, 128)
        return no_grad(lambda: kda.chunk_kda(*inputs, output_final_state=True, **on)), None, 1
    if row == "kda_decode_h4":
        q, k, v, g, beta = _make_inputs(1, 4, 128)
        state = 0.1 * torch.randn(1, 4, 128, 128, generator=torch.Generator().manual_seed(1))
        calls = 200

        def steps():
            for _ in range(calls):
                kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                        inplace_final_state=True, **on)  # fmt: skip
        return no_grad(steps), None, calls
    if row.startswith(("experts", "layer")):
        dtype = torch.bfloat16 if row.endswith("bf16") else torch.float32
        layer = _moe_layer(pkg, dtype)
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
            return no_grad(steps), None, calls
        if row.endswith("fwd"):
            return no_grad(lambda: module(*make(False))), None, 1
        with torch.no_grad():
            probe = torch.randn(module(*make(False)).shape, generator=gen).to(dtype)

        def setup():
            module.zero_grad(set_to_none=True)
            return make(True)
        return (lambda *a: (module(*a) * probe).sum().backward()), setup, 1
    if row.startswith("small_decode"):
        small = importlib.import_module(pkg + ".small")
        dtype = torch.bfloat16 if row.endswith("bf16") else torch.float32
        model, processor = small.load_small(dtype=dtype)
        model = _kernelized(pkg, model)
        ids = processor.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
        new = 17

        def run(n):
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        # (the first token is the prefill's: its time is taken off with a one-token call's, timed right after)
        def unit():
            start = time.thread_time()
            run(1)
            one = time.thread_time() - start
            start = time.thread_time()
            run(new)
            return time.thread_time() - start - one
        return no_grad(unit), None, new - 1
    if row == "k3_decode":
        pkg_module = importlib.import_module(pkg)
        torch.manual_seed(0)
        model = _kernelized(pkg, pkg_module.KimiK3ForCausalLM(pkg_module.KimiK3TextConfig(**k3_config_dict())).eval())
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(3, model.config.vocab_size, (1, K3_PREFILL), generator=gen)
        token = torch.tensor([[7]])

        def setup():  # (a fresh cache holding the prefill, untimed)
            cache = pkg_module.KimiK3HybridCache(model.config)
            with torch.no_grad():
                model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            return (cache,)

        def steps(cache):
            for _ in range(K3_STEPS):
                model(token, past_key_values=cache, use_cache=True)
        return no_grad(steps), setup, K3_STEPS
    raise ValueError(row)


def _time(unit, setup) -> float:
    """Thread CPU seconds of one ``unit`` call (what the unit returns when it times itself: a float)."""
    args = setup() if setup else ()
    start = time.thread_time()
    result = unit(*args)
    elapsed = time.thread_time() - start
    return result if isinstance(result, float) else elapsed


def worker(row: str, reps: int) -> float:
    """Seconds (thread CPU) of one of ``row``'s operations, best of ``reps`` calls after a warm-up."""
    import torch

    torch.set_num_threads(1)
    unit, setup, per = make_row(row)
    _time(unit, setup)
    return min(_time(unit, setup) for _ in range(reps)) / per


def same_process(base: str, head: str, rows: list[str], rounds: int) -> None:
    """Both trees in this process: ``base``'s package copied under another name (``k3_ab_base``), ``head``'s
    imported as itself; per row, ``rounds`` rounds of one call of each (the order alternating), so the two see the
    same machine from one moment to the next. Reports each tree's best and the median of the rounds' ratios."""
    import shutil
    import statistics
    import tempfile

    import torch

    torch.set_num_threads(1)
    copy = os.path.join(tempfile.gettempdir(), "k3_ab_base_package")  # (one place: its kernel build stays cached)
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(os.path.join(base, "src", "transformers_k3"), os.path.join(copy, "k3_ab_base"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))  # fmt: skip
    sys.path[:0] = [copy, os.path.join(head, "src")]
    packages = {"base": "k3_ab_base", "head": "transformers_k3"}
    for tree, pkg in packages.items():  # (each tree's kernels from its own cache, read at the first build)
        os.environ["TRANSFORMERS_K3_CACHE"] = f"/tmp/k3cache_ab_{tree}"
        importlib.import_module(pkg + ".ops.cpu_kernel").library()
    assert importlib.import_module("transformers_k3").__file__.startswith(os.path.join(head, "src"))
    print("| row | base | head | head / base (bests) | median of the rounds' head / base | rounds |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        units = {tree: make_row(row, pkg) for tree, pkg in packages.items()}
        for tree, (unit, setup, _) in units.items():
            _time(unit, setup)  # (warm-up)
        times = {tree: [] for tree in units}
        for r in range(rounds):
            for tree in (("base", "head") if r % 2 == 0 else ("head", "base")):
                unit, setup, per = units[tree]
                times[tree].append(_time(unit, setup) / per)
        scale = 1e6 if "(us)" in ROWS[row] else 1e3
        best = {tree: min(t) for tree, t in times.items()}
        paired = statistics.median(h / b for b, h in zip(times["base"], times["head"]))
        print(f"| {ROWS[row]} | {best['base'] * scale:,.1f} | {best['head'] * scale:,.1f} | "
              f"{best['head'] / best['base']:.3f} | {paired:.3f} | {rounds} |", flush=True)
        del units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="the older source tree (its src/ is imported)")
    parser.add_argument("--head", help="the newer source tree")
    parser.add_argument("--alternations", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5, help="calls per worker (best of)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--same-process", action="store_true",
                        help="both trees in one process, one call of each in turn (--rounds rounds per row)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--worker", choices=list(ROWS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.same_process:
        same_process(os.path.abspath(args.base), os.path.abspath(args.head), args.rows, args.rounds)
        return
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
