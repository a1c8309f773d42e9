"""Throughput and memory of the CPU KDA implementations, on identical inputs.

Compares our ``chunk_kda`` (the fused CPU kernel it uses for inference, and with that kernel turned off
its pure PyTorch path, which training uses) and ``fused_recurrent_kda`` (on CPU without autograd it runs the
same chunked kernel, so its prefill rows are charged the chunked FLOPs) with transformers' in-tree
``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention`` (their PyTorch fallbacks) and fla's
``naive_chunk_kda`` / ``naive_recurrent_kda`` (loaded by file path: fla's package init needs Triton), at
H = 4 and 32 heads of K = V = 128, batch 1, fp32, for prefill (T in {1K, 4K, 16K}) and for the single-token
decode step. Each (method, shape) runs in its own child process, so the peak-RSS growth it reports belongs
to that method alone; inputs are generated from one seed, so every method sees the same tensors, and every
output is compared with our ``chunk_kda``'s (decode: with our ``fused_recurrent_kda``'s).

    python bench/bench_kda.py            # T in {1024, 4096, 16384}, 20 s cap per method and shape
    python bench/bench_kda.py --quick    # T in {256, 1024}, 5 s cap

Per row it prints tokens/s, the ratio to the in-tree chunked fallback (decode: to the in-tree recurrent
step), and the fraction of the machine's matmul roofline: the row's FLOPs (below) divided by the fp32
``torch.mm`` rate measured in a child process at the start of the run with the same thread count, over the
measured time.

FLOPs of chunked KDA with chunk size C (WY/UT form; 2 FLOPs per multiply-add; per head and chunk; T is
rounded up to whole chunks, as every implementation pads)::

    A_kk = (k e^G)(k e^-G)^T, A_qk = (q e^G)(k e^-G)^T     2 C^2 K  each   (counted dense, as computed)
    (I + A_kk)^-1, unit lower triangular                  2/3 C^3          (C^3 / 3 multiply-adds)
    w = T beta k e^G,  u = T beta v                       2 C^2 K + 2 C^2 V
    n = u - w S                                           2 C K V
    o = (q e^G) S + A_qk n                                2 C K V + 2 C^2 V
    S' = e^{G_C} S + (k e^{G_C - G})^T n                  2 C K V
    total per chunk: 6 C^2 K + 4 C^2 V + 2/3 C^3 + 6 C K V

and of the token loop (recurrent forms and the decode step), per token and head: ``k^T S``, ``q^T S`` and the
rank-1 update, ``6 K V``. Elementwise work (exponentials, decays, masks) is not counted, so 100% of the
roofline is out of reach; the number says how far an implementation is from its own matmul work done at
GEMM speed. Each method is charged for its own chunk size (ours 32, the in-tree fallback and fla's naive
64), so a method cannot look efficient by doing extra work. The decode step is memory-bound, not
FLOP-bound; its rows also show the state traffic (read + write of ``H K V`` fp32 values per step).

Time and memory caps: a method whose run over all T tokens would take longer than ``--max-seconds``
(estimated from a timed probe on 256 tokens), or whose working set would exceed ``--max-gib`` (the in-tree
fallback materialises a ``[H, T, C, C, K]`` decay mask plus two temporaries of that size: 3 GiB per 1K
tokens at H=32), is timed on a prefix of N tokens instead and the row says "N tok". Every method here
carries a fixed-size state from chunk to chunk (or token to token), so its work is linear in T and the
tokens/s of a prefix estimates its rate at T (measured on N tokens, not at T: cache and memory effects at
the full length are not captured); the output difference is then taken over that prefix (all methods are
causal, so a prefix's outputs are the full run's first N). No time at T is ever printed for such a row.

Training rows (forward + backward, ``chunk_kda`` under autograd from a zero state, a fixed random cotangent on
the output and the final state): with the kernels on the forward is the fused kernel
(``transformers_k3::kda_chunk``) and the backward recomputes the PyTorch chunked path and differentiates it; with
them off both are the PyTorch path. They print fwd+bwd tokens/s, its ratio to the PyTorch path, the forward and
backward times separately, the peak-RSS growth, what autograd keeps from the forward for the backward ("saved":
each storage once, the inputs included, counted on the probe's 256 tokens and scaled to the row's; the kernel's
operator keeps its inputs and recomputes the rest in the backward, whose peak is then the PyTorch path's) and the
largest gradient difference from the kernel row (all five inputs' gradients). No FLOP count, so no roofline.

Timings on a shared machine are noisy: the best of up to 3 runs is reported (fewer when the cap would be
exceeded), the load average is printed so a loaded run can be recognised, and tokens per CPU-second (all
threads' CPU time) is shown next to wall-clock tokens/s because it suffers less from other load.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

METHODS = {
    "ours_chunk": "ours chunk_kda (fused CPU kernel)",
    "ours_chunk_pytorch": "ours chunk_kda, PyTorch path",
    "ours_chunk_compiled": "ours chunk_kda, torch.compile (kernel in graph)",
    "ours_chunk_pytorch_compiled": "ours chunk_kda, PyTorch path, torch.compile, safe_gate (the K3 layer's call)",
    "ours_chunk_pytorch_compiled_any_gate": "ours chunk_kda, PyTorch path, torch.compile, no bound on the gate",
    "ours_recurrent": "ours fused_recurrent_kda (kernel, chunked)",
    "intree_chunk": "in-tree chunk_kimi_delta_attention",
    "intree_recurrent": "in-tree recurrent_kimi_delta_attention",
    "fla_naive_chunk": "fla naive_chunk_kda",
}
# Rows that run only when --methods names them (each compiles the PyTorch path's graph, ~30 s a shape).
NAMED_ONLY = {"ours_chunk_pytorch_compiled", "ours_chunk_pytorch_compiled_any_gate"}
DECODE_METHODS = {
    "ours_decode": "ours fused_recurrent_kda, T=1",
    "intree_decode": "in-tree recurrent_kimi_delta_attention, T=1",
    "fla_naive_decode": "fla naive_recurrent_kda, T=1",
}
TRAIN_METHODS = {
    "ours_train": "ours chunk_kda fwd+bwd (kernel forward)",
    "ours_train_pytorch": "ours chunk_kda fwd+bwd, PyTorch path",
}
BASELINE = "intree_chunk"
TRAIN_BASELINE = "ours_train_pytorch"
DECODE_BASELINE = "intree_decode"
CONFIGS = [(4, 128), (32, 128)]  # (heads, head dim K = V)
PROBE_TOKENS = 256  # a multiple of every chunk size here
PREFIX_MULTIPLE = 64  # prefixes are whole 64-token chunks (fla's naive_chunk_kda needs T % 64 == 0)
INTREE_CHUNK = 64  # chunk_kimi_delta_attention's default
FLA_NAIVE_CHUNK = 64  # naive_chunk_kda's default


def chunked_kda_flops(tokens: int, heads: int, key_dim: int, value_dim: int, chunk: int | None) -> float:
    """Matmul FLOPs of KDA over ``tokens`` tokens (module docstring): the chunked WY form with chunk size
    ``chunk``, or the token loop (``6 K V`` per token and head) when ``chunk`` is None."""
    if chunk is None:
        return 6.0 * key_dim * value_dim * heads * tokens
    n_chunks = -(-tokens // chunk)
    c, k, v = float(chunk), float(key_dim), float(value_dim)
    per_chunk = 6 * c * c * k + 4 * c * c * v + 2 / 3 * c**3 + 6 * c * k * v
    return per_chunk * n_chunks * heads


def method_chunk(method: str) -> int | None:
    """Chunk size the method computes with (None: a token loop), for its FLOP count."""
    if method.startswith("ours_chunk") or method == "ours_recurrent":  # (ours_recurrent runs the chunked kernel)
        from transformers_k3.ops.kda import TORCH_CHUNK_SIZE

        return TORCH_CHUNK_SIZE
    return {"intree_chunk": INTREE_CHUNK, "fla_naive_chunk": FLA_NAIVE_CHUNK}.get(method)


def bytes_per_token(method: str, heads: int, dim: int) -> int:
    """Working set per token where it dominates: the in-tree fallback's ``[B, H, NT, C, C, K]`` fp32 decay
    mask, alive together with the two products of that size that build ``A_kk``."""
    if method == "intree_chunk":
        return 3 * heads * INTREE_CHUNK * dim * 4
    return 0


def choose_tokens(length: int, probe_tokens: int, probe_seconds: float, max_seconds: float, max_bytes: float,
                  per_token_bytes: int, multiple: int = PREFIX_MULTIPLE) -> int:  # fmt: skip
    """Tokens to time: all ``length`` unless the probe's rate says one run would exceed ``max_seconds`` or
    the working set ``max_bytes``; then the largest whole multiple of ``multiple`` within both caps, and
    never fewer than the probe (which already ran)."""
    n = length
    if probe_seconds > 0 and probe_seconds * length / probe_tokens > max_seconds:
        n = int(max_seconds * probe_tokens / probe_seconds)
    if per_token_bytes and per_token_bytes * n > max_bytes:
        n = int(max_bytes // per_token_bytes)
    if n >= length:
        return length
    return min(length, max(probe_tokens, n // multiple * multiple))


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


def _load_fla_naive():
    spec = importlib.util.find_spec("fla")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _intree(name: str):
    from transformers.models.kimi_linear import modeling_kimi_linear as kl

    fn = getattr(kl, name)
    return getattr(fn, "__wrapped__", fn)  # the PyTorch fallback, never a hub/fla kernel


def _load_method(name: str):
    """``fn(q, k, v, g, beta, state) -> (o, final_state)``; ``state`` is None for prefill."""
    if name.startswith("ours_chunk") or name in ("ours_train", "ours_train_pytorch"):
        import torch

        from transformers_k3.ops import cpu_kernel
        from transformers_k3.ops.kda import chunk_kda

        fused = name in ("ours_chunk", "ours_chunk_compiled", "ours_train")
        if fused and cpu_kernel.library() is None:
            raise RuntimeError(f"the fused CPU kernel is unavailable: {cpu_kernel.load_error()}")

        safe_gate = name == "ours_chunk_pytorch_compiled"  # (the PyTorch path reads it only inside a graph)

        def core(q, k, v, g, b, s):
            return chunk_kda(q, k, v, g, b, initial_state=s, output_final_state=True,
                             safe_gate=safe_gate, kernel=fused)

        if "_compiled" in name:  # (one graph per shape: the timed shape is warmed up before timing)
            core = torch.compile(core, fullgraph=True, dynamic=False)

        return core
    if name in ("ours_recurrent", "ours_decode"):
        from transformers_k3.ops.kda import fused_recurrent_kda

        # Decode as the KDA layer runs it: the state is updated in place.
        inplace = name == "ours_decode"
        return lambda q, k, v, g, b, s: fused_recurrent_kda(q, k, v, g, b, initial_state=s, output_final_state=True,
                                                            inplace_final_state=inplace, kernel=True)  # fmt: skip
    if name in ("intree_chunk", "intree_recurrent", "intree_decode"):
        fn = _intree("chunk_kimi_delta_attention" if name == "intree_chunk" else "recurrent_kimi_delta_attention")
        return lambda q, k, v, g, b, s: fn(q, k, v, g, b, initial_state=s, output_final_state=True)
    if name in ("fla_naive_chunk", "fla_naive_decode"):
        module = _load_fla_naive()
        fn = module.naive_chunk_kda if name == "fla_naive_chunk" else module.naive_recurrent_kda
        return lambda q, k, v, g, b, s: fn(q, k, v, g, b, initial_state=s, output_final_state=True)
    raise ValueError(name)


def _child_prefill(args) -> dict:
    """Time one method on one shape (on a prefix if a cap applies)."""
    import psutil
    import torch

    fn = _load_method(args.method)
    q, k, v, g, beta = _make_inputs(args.length, args.heads, args.dim)
    inputs = lambda n: (q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], None)  # noqa: E731
    with torch.no_grad():
        probe = min(args.length, PROBE_TOKENS)
        fn(*inputs(probe))  # warm-up
        start = time.perf_counter()
        fn(*inputs(probe))
        probe_seconds = time.perf_counter() - start
        tokens = choose_tokens(args.length, probe, probe_seconds, args.max_seconds, args.max_gib * 2**30,
                               bytes_per_token(args.method, args.heads, args.dim))  # fmt: skip
        estimate = probe_seconds * tokens / probe
        repeats = max(1, min(3, int(args.max_seconds // max(estimate, 1e-9))))
        x = inputs(tokens)
        if args.method.endswith("_compiled") and tokens != probe:
            fn(*x)  # (compiles the graph for this shape outside the timing)
        rss_before = psutil.Process().memory_info().rss
        best, best_cpu = math.inf, math.inf
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            out, _ = fn(*x)
            best = min(best, time.perf_counter() - start)
            best_cpu = min(best_cpu, time.process_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    torch.save(out, args.save)
    return {"seconds": best, "cpu_seconds": best_cpu, "tokens": tokens, "repeats": repeats,
            "rss_growth": max(0, peak - rss_before)}  # fmt: skip


def _child_train(args) -> dict:
    """Forward + backward of one method on one shape (on a prefix if the time cap applies): best fwd+bwd time,
    with that run's forward and backward parts."""
    import psutil
    import torch

    fn = _load_method(args.method)
    q, k, v, g, beta = _make_inputs(args.length, args.heads, args.dim)
    gen = torch.Generator().manual_seed(2)
    o_bar = torch.randn(v.shape, generator=gen)
    s_bar = torch.randn(1, args.heads, args.dim, args.dim, generator=gen)

    saved = {}

    def pack(x):  # (what autograd keeps from the forward for the backward, each storage once)
        saved[x.untyped_storage()._cdata] = x.untyped_storage().nbytes()
        return x

    def step(n, count_saved=False):
        leaves = [x[:, :n].clone().requires_grad_() for x in (q, k, v, g, beta)]
        saved.clear()
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x) if count_saved else contextlib.nullcontext()
        start, start_cpu = time.perf_counter(), time.process_time()
        with hooks:
            o, s = fn(*leaves, None)
        middle = time.perf_counter()
        torch.autograd.backward((o, s), (o_bar[:, :n], s_bar))
        end = time.perf_counter()
        return middle - start, end - middle, time.process_time() - start_cpu, leaves

    probe = min(args.length, PROBE_TOKENS)
    step(probe)  # warm-up
    forward, backward, _, _ = step(probe)
    tokens = choose_tokens(args.length, probe, forward + backward, args.max_seconds, args.max_gib * 2**30, 0)
    estimate = (forward + backward) * tokens / probe
    repeats = max(1, min(3, int(args.max_seconds // max(estimate, 1e-9))))
    rss_before = psutil.Process().memory_info().rss
    best = (math.inf,)
    best_cpu = math.inf
    for _ in range(repeats):
        forward, backward, cpu, leaves = step(tokens)
        if forward + backward < best[0]:
            best = (forward + backward, forward, backward)
        best_cpu = min(best_cpu, cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.save(torch.cat([leaf.grad.flatten() for leaf in leaves]), args.save)
    step(probe, count_saved=True)  # (untimed: the hook costs a Python call per saved tensor)
    saved_per_token = sum(saved.values()) / probe
    return {"seconds": best[0], "forward": best[1], "backward": best[2], "cpu_seconds": best_cpu, "tokens": tokens,
            "repeats": repeats, "rss_growth": max(0, peak - rss_before), "saved": saved_per_token * tokens}  # fmt: skip


def _child_decode(args) -> dict:
    """Single-token steps from a non-zero state, each feeding its state to the next; median step time."""
    import torch

    fn = _load_method(args.method)
    q, k, v, g, beta = _make_inputs(args.length, args.heads, args.dim)
    gen = torch.Generator().manual_seed(1)
    state0 = 0.1 * torch.randn(1, args.heads, args.dim, args.dim, generator=gen)
    step = lambda t, s: fn(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],  # noqa: E731
                           beta[:, t : t + 1], s)  # fmt: skip
    with torch.no_grad():
        state = state0.clone()  # a method may update its state in place
        for t in range(3):  # warm-up
            _, state = step(t, state)
        state, outs, times, cpu = state0.clone(), [], [], 0.0
        begin = time.perf_counter()
        for t in range(args.length):
            start, start_cpu = time.perf_counter(), time.process_time()
            out, state = step(t, state)
            times.append(time.perf_counter() - start)
            cpu += time.process_time() - start_cpu
            outs.append(out)
            if time.perf_counter() - begin > args.max_seconds:
                break
    torch.save(torch.cat(outs, 1), args.save)
    return {"seconds": statistics.median(times), "cpu_seconds": cpu / len(times), "tokens": len(times)}


def _child_gemm(args) -> dict:
    """fp32 ``torch.mm`` rate, best over square sizes and 3 runs each: the matmul roofline."""
    import torch

    rates = {}
    for n in args.gemm_sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        rates[n] = 2 * n**3 / best
    return {"flops": max(rates.values()), "by_size": rates}


def _child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.child == "gemm":
        result = _child_gemm(args)
    elif args.child in DECODE_METHODS:
        args.method = args.child
        result = _child_decode(args)
    elif args.child in TRAIN_METHODS:
        args.method = args.child
        result = _child_train(args)
    else:
        args.method = args.child
        result = _child_prefill(args)
    print(json.dumps(result))


def _run(child: str, args, length: int = 0, heads: int = 0, dim: int = 0, save: str = "") -> dict:
    command = [
        sys.executable, __file__, "--child", child, "--length", str(length), "--heads", str(heads),
        "--dim", str(dim), "--threads", str(args.threads), "--save", save, "--max-seconds", str(args.max_seconds),
        "--max-gib", str(args.max_gib), "--gemm-sizes", ",".join(map(str, args.gemm_sizes)),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit status {result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _configs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in item.lower().split("x")) for item in text.split(",") if item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="T in {256, 1024}, 5 s cap, 32 decode steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", type=_sizes, help="comma list of T (default 1024,4096,16384)")
    parser.add_argument("--configs", type=_configs, help="comma list of HxD (default 4x128,32x128)")
    parser.add_argument("--max-seconds", type=float, help="per method and shape (default 20; --quick 5)")
    parser.add_argument("--max-gib", type=float, default=4.0, help="working-set cap per method and shape")
    parser.add_argument("--decode-steps", type=int, help="decode steps timed (default 200; --quick 32)")
    parser.add_argument("--gemm-sizes", type=_sizes, help="square matmul sizes for the roofline")
    parser.add_argument("--methods", help="comma list, a subset of "
                        f"{', '.join([*METHODS, *DECODE_METHODS, *TRAIN_METHODS])} (default all but "
                        f"{', '.join(sorted(NAMED_ONLY))}; rows compare with ours_chunk / ours_decode / ours_train, "
                        "so keep those)")
    parser.add_argument("--child", choices=[*METHODS, *DECODE_METHODS, *TRAIN_METHODS, "gemm"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.max_seconds is None:
        args.max_seconds = 5.0 if args.quick else 20.0
    if args.gemm_sizes is None:
        args.gemm_sizes = [512, 1024] if args.quick else [1024, 2048]
    if args.child:
        _child(args)
        return

    import torch

    lengths = args.lengths or ([256, 1024] if args.quick else [1024, 4096, 16384])
    configs = args.configs or CONFIGS
    decode_steps = args.decode_steps or (32 if args.quick else 200)
    every = set(METHODS) | set(DECODE_METHODS) | set(TRAIN_METHODS)
    chosen = set(args.methods.split(",")) if args.methods else every - NAMED_ONLY
    unknown = chosen - set(METHODS) - set(DECODE_METHODS) - set(TRAIN_METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}")
    prefill = {m: label for m, label in METHODS.items() if m in chosen}
    decode = {m: label for m, label in DECODE_METHODS.items() if m in chosen}
    train = {m: label for m, label in TRAIN_METHODS.items() if m in chosen}
    print(f"KDA core, fp32, batch 1, {args.threads} threads, torch {torch.__version__}; load average at start "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; caps {args.max_seconds:g} s and {args.max_gib:g} GiB "
          "per method and shape")
    gemm = _run("gemm", args)
    if "error" in gemm:
        sys.exit(f"matmul roofline measurement failed: {gemm['error']}")
    roofline = gemm["flops"]
    sizes = ", ".join(f"{n}: {rate / 1e9:.1f}" for n, rate in gemm["by_size"].items())
    print(f"matmul roofline: {roofline / 1e9:.1f} GFLOP/s (fp32 torch.mm, {args.threads} threads, best of 3; "
          f"GFLOP/s by size {sizes})")
    header = (
        f"{'H':>2} {'K=V':>4} {'T':>6}  {'method':<44} {'timed on':>9} {'tokens/s':>10} {'vs in-tree':>10} "
        f"{'roofline':>8} {'tokens/CPU-s':>12} {'peak RSS +':>10} {'max|o - ours|':>13}"
    )
    print(header)
    print("-" * len(header))
    prefixed = False
    with tempfile.TemporaryDirectory() as tmp:
        for heads, dim in configs:
            for length in lengths if prefill else []:
                results = {}
                for method in prefill:
                    save = os.path.join(tmp, f"{method}.pt")
                    results[method] = _run(method, args, length, heads, dim, save)
                prefixed |= _print_rows(prefill, results, BASELINE, "ours_chunk", tmp, heads, dim, length, roofline)
            if decode:
                results = {}
                for method in decode:
                    save = os.path.join(tmp, f"{method}.pt")
                    results[method] = _run(method, args, decode_steps, heads, dim, save)
                _print_rows(decode, results, DECODE_BASELINE, "ours_decode", tmp, heads, dim, 1, roofline, decode=True)
        if train:
            train_header = (
                f"{'H':>2} {'K=V':>4} {'T':>6}  {'method (forward + backward)':<44} {'timed on':>9} {'tokens/s':>10} "
                f"{'vs PyTorch':>10} {'fwd ms':>9} {'bwd ms':>9} {'tokens/CPU-s':>12} {'peak RSS +':>10} "
                f"{'saved':>9} {'max|grad - ours|':>16}"
            )  # fmt: skip
            print()
            print(train_header)
            print("-" * len(train_header))
            for heads, dim in configs:
                for length in lengths:
                    results = {}
                    for method in train:
                        save = os.path.join(tmp, f"{method}.pt")
                        results[method] = _run(method, args, length, heads, dim, save)
                    prefixed |= _print_train_rows(train, results, tmp, heads, dim, length)
    end = _run("gemm", args)
    if "flops" in end:
        print(f"matmul roofline at end: {end['flops'] / 1e9:.1f} GFLOP/s (the rows use the start's "
              f"{roofline / 1e9:.1f})")
    if prefixed:
        print("'timed on N tok': the run over all T tokens would have exceeded a cap, so the method was timed on its "
              "first N tokens; its work is linear in T (fixed-size state), so tokens/s measured on N tokens estimates "
              "its rate at T; max|o - ours| covers those N tokens.")
    if decode:
        print("decode rows: median time of one step (T=1 from a non-zero state); 'timed on' = steps; roofline counts "
              "6 K V FLOPs per head and step; state traffic = reading and writing H K V fp32 values per step.")
    print(f"load average at end {os.getloadavg()[0]:.2f}")


def _reference_and_base_rate(results, tmp, reference, baseline, decode=False):
    """The reference method's saved tensor (None if it failed) and the baseline's rate (tokens/s, or steps/s for
    decode rows; None if it failed)."""
    import torch

    ok = lambda name: name in results and "error" not in results[name]  # noqa: E731
    saved = torch.load(os.path.join(tmp, f"{reference}.pt")) if ok(reference) else None
    base = results.get(baseline, {})
    base_rate = (1 if decode else base["tokens"]) / base["seconds"] if ok(baseline) else None
    return saved, base_rate


def _print_train_rows(methods, results, tmp, heads, dim, length) -> bool:
    """Print one block of training rows; returns whether some method was timed on a prefix."""
    import torch

    reference, base_rate = _reference_and_base_rate(results, tmp, "ours_train", TRAIN_BASELINE)
    prefixed = False
    for method, label in methods.items():
        res = results[method]
        if "error" in res:
            print(f"{heads:>2} {dim:>4} {length:>6}  {label:<44} failed: {res['error']}")
            continue
        tokens = res["tokens"]
        rate = tokens / res["seconds"]
        timed = "all" if tokens == length else f"{tokens} tok"
        prefixed |= tokens != length
        ratio = f"{rate / base_rate:.2f}x" if base_rate else "n/a"
        diff = "n/a"
        if reference is not None:
            grads = torch.load(os.path.join(tmp, f"{method}.pt"))
            if grads.shape == reference.shape:  # (prefixes of different lengths are not compared)
                diff = f"{(grads - reference).abs().max().item():.1e}"
        print(
            f"{heads:>2} {dim:>4} {length:>6}  {label:<44} {timed:>9} {rate:>10,.0f} {ratio:>10} "
            f"{res['forward'] * 1e3:>9,.1f} {res['backward'] * 1e3:>9,.1f} {tokens / res['cpu_seconds']:>12,.0f} "
            f"{res['rss_growth'] / 2**20:>6,.0f} MiB {res['saved'] / 2**20:>5,.0f} MiB {diff:>16}"
        )
    return prefixed


def _print_rows(methods, results, baseline, reference, tmp, heads, dim, length, roofline, decode=False) -> bool:
    """Print one table block; returns whether some method was timed on a prefix."""
    import torch

    reference_out, base_rate = _reference_and_base_rate(results, tmp, reference, baseline, decode)
    prefixed = False
    shown = "1" if decode else f"{length}"
    for method, label in methods.items():
        res = results[method]
        if "error" in res:
            print(f"{heads:>2} {dim:>4} {shown:>6}  {label:<44} failed: {res['error']}")
            continue
        tokens = res["tokens"]
        if decode:
            rate = 1 / res["seconds"]
            flops = chunked_kda_flops(1, heads, dim, dim, None)
            timed = f"{tokens} st"
        else:
            rate = tokens / res["seconds"]
            flops = chunked_kda_flops(tokens, heads, dim, dim, method_chunk(method))
            timed = "all" if tokens == length else f"{tokens} tok"
            prefixed |= tokens != length
        fraction = flops / roofline / res["seconds"]
        ratio = f"{rate / base_rate:.2f}x" if base_rate else "n/a"
        if reference_out is not None:
            out = torch.load(os.path.join(tmp, f"{method}.pt"))
            n = min(out.shape[1], reference_out.shape[1])
            diff = f"{(out[:, :n] - reference_out[:, :n]).abs().max().item():.1e}"
        else:
            diff = "n/a"
        cpu_rate = (1 if decode else tokens) / res["cpu_seconds"]
        memory = f"{res['rss_growth'] / 2**20:>6,.0f} MiB" if "rss_growth" in res else ""
        print(
            f"{heads:>2} {dim:>4} {shown:>6}  {label:<44} {timed:>9} {rate:>10,.0f} {ratio:>10} {fraction:>8.1%} "
            f"{cpu_rate:>12,.0f} {memory:>10} {diff:>13}"
        )
        if decode:
            traffic = 2 * heads * dim * dim * 4 / res["seconds"]
            print(f"{'':>16}{'':<44} {'':>9} step {res['seconds'] * 1e6:,.0f} us, state traffic "
                  f"{traffic / 1e9:.2f} GB/s")
    return prefixed


if __name__ == "__main__":
    main()
