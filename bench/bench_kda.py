"""Throughput and memory of the CPU KDA implementations, on identical inputs.

Compares our ``chunk_kda`` / ``fused_recurrent_kda`` (PyTorch path) with transformers' in-tree
``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention`` (their PyTorch fallbacks) and fla's
``naive_chunk_kda`` (loaded by file path: fla's package init needs Triton). Each (method, shape) runs in
its own child process, so the peak-RSS growth it reports belongs to that method alone; inputs are
generated from one seed, so every method sees the same tensors, and every output is compared with our
``chunk_kda``'s.

    python bench/bench_kda.py            # T in {1024, 4096, 16384}
    python bench/bench_kda.py --quick    # T in {256, 1024}

Timings on a shared machine are noisy: the best of a few runs is reported (one run at the longest
length), the load average is printed so a loaded run can be recognised, and tokens per CPU-second
(all threads' CPU time) is shown next to wall-clock tokens/s because it suffers less from other load.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

METHODS = {
    "ours_chunk": "ours chunk_kda",
    "ours_recurrent": "ours fused_recurrent_kda",
    "intree_chunk": "in-tree chunk_kimi_delta_attention",
    "intree_recurrent": "in-tree recurrent_kimi_delta_attention",
    "fla_naive_chunk": "fla naive_chunk_kda",
}
BASELINE = "intree_chunk"
CONFIGS = [(4, 64), (2, 128)]  # (heads, head dim K = V)


def _make_inputs(length: int, heads: int, dim: int):
    """K3-like inputs: unit q/k (as after the in-kernel L2 norm), gate g = -5 sigmoid(.)."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(1, length, heads, dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, length, heads, dim, generator=gen), dim=-1)
    v = torch.randn(1, length, heads, dim, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(1, length, heads, dim, generator=gen))
    beta = torch.rand(1, length, heads, generator=gen)
    return q, k, v, g, beta


def _load_method(name: str):
    if name == "ours_chunk":
        from transformers_k3.ops.kda import chunk_kda

        return lambda q, k, v, g, b: chunk_kda(q, k, v, g, b, output_final_state=True, backend="torch")
    if name == "ours_recurrent":
        from transformers_k3.ops.kda import fused_recurrent_kda

        return lambda q, k, v, g, b: fused_recurrent_kda(q, k, v, g, b, output_final_state=True, backend="torch")
    if name in ("intree_chunk", "intree_recurrent"):
        from transformers.models.kimi_linear import modeling_kimi_linear as kl

        fn = kl.chunk_kimi_delta_attention if name == "intree_chunk" else kl.recurrent_kimi_delta_attention
        fn = getattr(fn, "__wrapped__", fn)  # the PyTorch fallback, never a hub/fla kernel
        return lambda q, k, v, g, b: fn(q, k, v, g, b, initial_state=None, output_final_state=True)
    if name == "fla_naive_chunk":
        spec = importlib.util.find_spec("fla")
        path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
        module_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return lambda q, k, v, g, b: module.naive_chunk_kda(q, k, v, g, b, output_final_state=True)
    raise ValueError(name)


def _child(args) -> None:
    """Time one method on one shape; print a JSON line."""
    import psutil
    import torch

    torch.set_num_threads(args.threads)
    fn = _load_method(args.method)
    q, k, v, g, beta = _make_inputs(args.length, args.heads, args.dim)
    with torch.no_grad():
        warm = min(args.length, 256)
        fn(q[:, :warm], k[:, :warm], v[:, :warm], g[:, :warm], beta[:, :warm])
        rss_before = psutil.Process().memory_info().rss
        best, best_cpu = float("inf"), float("inf")
        for _ in range(args.repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            out, _ = fn(q, k, v, g, beta)
            best = min(best, time.perf_counter() - start)
            best_cpu = min(best_cpu, time.process_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    torch.save(out, args.save)
    print(json.dumps({"seconds": best, "cpu_seconds": best_cpu, "rss_growth": max(0, peak - rss_before)}))


def _run(method: str, length: int, heads: int, dim: int, threads: int, repeats: int, save: str) -> dict:
    command = [
        sys.executable, __file__, "--child", method, "--length", str(length), "--heads", str(heads),
        "--dim", str(dim), "--threads", str(threads), "--repeats", str(repeats), "--save", save,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="T in {256, 1024} instead of {1024, 4096, 16384}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=list(METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.method = args.child
        _child(args)
        return

    import torch

    lengths = [256, 1024] if args.quick else [1024, 4096, 16384]
    print(f"KDA core, fp32, batch 1, {args.threads} threads, torch {torch.__version__}; load average at start "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    header = (
        f"{'H':>2} {'K=V':>4} {'T':>6}  {'method':<40} {'tokens/s':>10} {'vs in-tree chunk':>17} "
        f"{'tokens/CPU-s':>13} {'peak RSS +':>11} {'max|o - ours chunk|':>20}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for heads, dim in CONFIGS:
            for length in lengths:
                results = {}
                for method in METHODS:
                    repeats = 3 if length <= 4096 else 1
                    save = os.path.join(tmp, f"{method}.pt")
                    results[method] = _run(method, length, heads, dim, args.threads, repeats, save)
                reference = torch.load(os.path.join(tmp, "ours_chunk.pt"))
                base = results[BASELINE].get("seconds")
                for method, label in METHODS.items():
                    res = results[method]
                    if "error" in res:
                        print(f"{heads:>2} {dim:>4} {length:>6}  {label:<40} failed: {res['error']}")
                        continue
                    diff = (torch.load(os.path.join(tmp, f"{method}.pt")) - reference).abs().max().item()
                    ratio = f"{base / res['seconds']:.2f}x" if base else "n/a"
                    print(
                        f"{heads:>2} {dim:>4} {length:>6}  {label:<40} {length / res['seconds']:>10,.0f} {ratio:>17} "
                        f"{length / res['cpu_seconds']:>13,.0f} {res['rss_growth'] / 2**20:>8,.0f} MiB {diff:>20.1e}"
                    )
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
