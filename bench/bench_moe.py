"""MoE throughput at K3's routing scale (896 experts, top-16) on a scaled-down width, against transformers'
in-tree MoE layers at the same shape, in one process.

    python bench/bench_moe.py                       # 2,048 tokens, latent 128, intermediate 32
    python bench/bench_moe.py --tokens 4096 --reps 5
    python bench/bench_moe.py --dtype bfloat16      # every module's weights and activations in bf16

Two tables. Our modules run under every experts implementation: transformers' eager / grouped_mm / batched_mm
and our ``k3_grouped_mm`` (`transformers_k3.ops.experts.k3_grouped_mm_experts_forward`; on CPU in fp32 it runs
the fused experts kernel, ``csrc/moe_cpu.cpp``, forward and backward, and in the whole layer the router's top-k
and sparse backward run ``csrc/router_cpu.cpp``; there an fp32 router on a CPU with the AMX tile unit selects through
its screen, approximate logits with an error bound and exact fp32 logits only for the experts the bound cannot rule
out, instead of the full fp32 router GEMM), plus ``k3_gmm_torch``, the same with the kernels turned off
(the PyTorch path); the in-tree modules under transformers' three.

* experts only: `KimiK3Experts` vs transformers' `KimiLinearExperts` and `Qwen3_5MoeExperts` (DeepSeek-V3's
  experts are the same code as Kimi Linear's) with the same weight shapes ``[E, 2I, D]`` / ``[E, D, I]`` and the
  same routing (uniformly random distinct top-16 per token);
* whole layer: our latent `KimiK3SparseMoE` (hidden ``2 x latent``, experts at the latent width, one shared
  expert at full width, so it does strictly more work) vs `DeepseekV3MoE` whose hidden size equals our latent
  size (same expert count, top-k, intermediate size, one shared expert).

Throughput is tokens/s of the forward (no grad) and of forward+backward (of a fixed random projection of the output,
each step starting without parameter gradients, as after ``zero_grad()``), on fresh inputs drawn before the clock
starts, the best of ``--reps`` runs. Peak memory is the largest total size of the tensors allocated during one call
that are alive at once (saved activations, gradients and temporaries; not the inputs), replayed from the profiler's
allocation record (exact, where sampling the process RSS missed short-lived peaks). "roofline" is the measured fp32
GEMM rate of this machine divided by the layer's matmul FLOPs per token (x3 for forward+backward): the speed of a
perfect grouped GEMM (for the whole K3 layer it counts the full router GEMM, which the screened selection skips,
so a share near or above 100 % is possible; also under ``--dtype bfloat16``: our experts kernel computes in fp32
from the bf16 values, and the bf16 GEMM rate is printed beside it). The in-tree eager paths are slow enough that
they run on ``--slow-tokens`` tokens. Under each ratio, what ``--target`` (5x) times the fastest in-tree row asks of
ours, as a share of our roofline: the whole K3 layer does ~1.6x the in-tree layer's matmul FLOPs (a router over
twice the width, a full-width shared expert, the latent projections), so there a 5x target can ask for most of this
machine's GEMM rate."""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from torch import nn

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")  # transformers' own; ours also run K3_GROUPED_MM
# `k3_grouped_mm` without the fused CPU kernels attached: its PyTorch path.
K3_PYTORCH = "k3_gmm_torch"
COMPILED = "K3 latent MoE (ours, compiled)"


def implementations_for(name: str) -> tuple[str, ...]:
    """The experts implementations a row's module runs under: ours (names with "ours") also `k3_grouped_mm`
    (with the fused CPU kernels) and its PyTorch path alone (no kernels attached)."""
    from transformers_k3.modeling_kimi_k3 import K3_GROUPED_MM

    if "compiled" in name:  # (torch.compile of our layer: the kernels traced into its graph)
        return (K3_GROUPED_MM,)
    return IMPLEMENTATIONS + ((K3_GROUPED_MM, K3_PYTORCH) if "ours" in name else ())


# --------------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------------


def gemm_rate(size: int = 1024, reps: int = 12, dtype: torch.dtype = torch.float32) -> float:
    """Measured GEMM FLOP/s at ``size`` cubed (fp32 unless ``dtype``), the best of ``reps`` calls (this machine's
    speed drifts: with 3 calls the probe once read 205 GFLOP/s where torch reaches ~310-320, which overstated every
    "roofline" share by 1.5x)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    return 2 * size**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_step(run, inputs_fn, backward: bool):
    """One call of ``run`` on fresh inputs (+ backward of a fixed random projection of its output).
    ``step.prepare()``, called before each measured call (untimed), makes the call's inputs (drawing them costs
    more than some whole calls: 4 ms for [2048, 256]) and drops the parameters' gradients, so that a backward step
    starts as after ``optimizer.zero_grad()`` (``set_to_none``, the default) instead of adding ~44 MiB of
    expert-weight gradients into the last step's."""
    probe, prepared = {}, []

    def step():
        args = prepared.pop() if prepared else inputs_fn(backward)
        if not backward:
            with torch.no_grad():
                return run(*args)
        out = run(*args)
        if "r" not in probe:
            probe["r"] = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        (out.float() * probe["r"]).sum().backward()

    def prepare():
        for parameter in run.parameters():
            parameter.grad = None
        prepared[:] = [inputs_fn(backward)]

    step.prepare = prepare
    return step


def _measured(step) -> float:
    step.prepare()
    return _timed(step)


def peak_memory(step) -> float:
    """Peak bytes of tensors allocated by one call of ``step`` and alive at the same time: each op's own
    allocations counted at its start, each free when it happens, in the profiler's order."""
    stderr = os.dup(2)  # the profiler logs every start and stop straight to fd 2: keep the tables readable
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            step.prepare()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                step()
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


# --------------------------------------------------------------------------------------------------
# Modules under test
# --------------------------------------------------------------------------------------------------


def set_impl(module: nn.Module, impl: str) -> None:
    from transformers_k3 import kernelize
    from transformers_k3.modeling_kimi_k3 import K3_GROUPED_MM

    if any(type(sub).__dict__.get("k3_kernel_name") for sub in module.modules()):  # (ours)
        kernelize(module, impl != K3_PYTORCH)  # (K3_PYTORCH: no kernel attached, k3_grouped_mm's PyTorch path)
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(sub, "gate_up_proj"):
            config._experts_implementation = K3_GROUPED_MM if impl == K3_PYTORCH else impl


@torch.no_grad()
def init_(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return module


def build(args):
    from transformers import DeepseekV3Config, KimiLinearConfig, Qwen3_5MoeTextConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    from transformers_k3 import KimiK3TextConfig, kernelize
    from transformers_k3.modeling_kimi_k3 import KimiK3SparseMoE

    E, k, D, I = args.experts, args.top_k, args.latent, args.intermediate
    ours_cfg = KimiK3TextConfig.tiny(
        hidden_size=2 * D, num_experts=E, num_experts_per_token=k, moe_intermediate_size=I,
        routed_expert_hidden_size=D, num_shared_experts=1,
    )
    layers = {
        "K3 latent MoE (ours)": KimiK3SparseMoE(ours_cfg),
        "DeepseekV3MoE": DeepseekV3MoE(DeepseekV3Config(
            hidden_size=D, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=k, n_shared_experts=1,
            n_group=1, topk_group=1, norm_topk_prob=True)),
        "KimiLinearMoE": KimiLinearMoE(KimiLinearConfig(
            hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_token=k, num_shared_experts=1,
            moe_renormalize=True, num_expert_group=1, topk_group=1)),
        "Qwen3_5MoeSparseMoeBlock": Qwen3_5MoeSparseMoeBlock(Qwen3_5MoeTextConfig(
            hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
            shared_expert_intermediate_size=I)),
    }
    for seed, layer in enumerate(layers.values()):
        init_(layer, seed).to(args.dtype)
    kernelize(layers["K3 latent MoE (ours)"])  # (the fused CPU kernels, as the README says)
    return layers


def layer_flops(name: str, args) -> float:
    """Matmul FLOPs per token of the forward."""
    E, k, D, I = args.experts, args.top_k, args.latent, args.intermediate
    experts = 2 * k * 3 * D * I
    if name == "experts":
        return experts
    if "ours" in name:
        H = 2 * D
        return experts + 2 * H * E + 2 * 3 * H * I + 2 * 2 * H * D  # router, shared, latent down+up
    return experts + 2 * D * E + 2 * 3 * D * I + (2 * D if "Qwen" in name else 0)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--slow-tokens", type=int, default=32, help="tokens for the in-tree eager paths")
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--latent", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the modules' weights and activations (routing weights stay fp32)")
    parser.add_argument("--skip-layers", action="store_true")
    parser.add_argument("--target", type=float, default=5.0, help="the ratio to the fastest in-tree row aimed at")
    parser.add_argument("--decode-tokens", type=int, default=1, help="tokens per call in the decode-step table")
    parser.add_argument("--decode-calls", type=int, default=100, help="calls timed per row (median) there; 0: skip")
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    import transformers

    rate = gemm_rate()
    low = f", bf16 GEMM {gemm_rate(dtype=args.dtype) / 1e9:.1f}" if args.dtype != torch.float32 else ""
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads; "
          f"fp32 GEMM {rate / 1e9:.1f} GFLOP/s (1024^3){low}; modules in {str(args.dtype)[6:]}")
    print(f"{args.experts} experts, top-{args.top_k}, latent {args.latent}, intermediate {args.intermediate}, "
          f"{args.tokens} tokens ({args.slow_tokens} for in-tree eager)\n")

    layers = build(args)
    # one graph per input shape (dynamic=False): each row's warm-up call compiles it, outside the timing
    layers[COMPILED] = torch.compile(layers["K3 latent MoE (ours)"], fullgraph=True, dynamic=False)
    E, k, D = args.experts, args.top_k, args.latent
    gen = torch.Generator().manual_seed(1)
    x_latent = torch.randn(args.tokens, D, generator=gen).to(args.dtype)
    idx = torch.argsort(torch.rand(args.tokens, E, generator=gen), dim=-1)[:, :k]
    w = torch.rand(args.tokens, k, generator=gen)

    def experts_inputs(n):
        def make(backward):
            x = x_latent[:n].clone().requires_grad_(backward)
            return x, idx[:n], w[:n].clone().requires_grad_(backward)
        return make

    def layer_inputs(n, width):
        def make(backward):
            x = torch.randn(1, n, width, generator=torch.Generator().manual_seed(2)).to(args.dtype)
            return (x.requires_grad_(backward),)
        return make

    results = {}  # (table, name, impl) -> (fwd tok/s, fwd+bwd tok/s, fwd MiB, fwd+bwd MiB)

    def run_table(table, modules, inputs_for, flops_name):
        """Every (module, implementation) pair, forward and forward+backward, timed round-robin over
        ``--reps`` rounds (best of), so that load from other processes hits every row alike."""
        rows = []
        for name, module in modules.items():
            for impl in implementations_for(name):
                slow = impl == "eager" and "ours" not in name
                n = args.slow_tokens if slow else args.tokens
                make = inputs_for(name, n)
                rows.append((name, impl, n, slow, [make_step(module, make, b) for b in (False, True)], module))
        best = {}
        for rep in range(args.reps):
            for name, impl, n, slow, steps, module in rows:
                if slow and rep > 0:
                    continue
                set_impl(module, impl)
                for b, step in enumerate(steps):
                    if rep == 0:
                        step()  # warm-up
                    best[(name, impl, b)] = min(best.get((name, impl, b), math.inf), _measured(step))
        print(f"== {table} ==")
        print(f"{'module':26s} {'impl':13s} {'tokens':>6s} {'fwd tok/s':>10s} {'f+b tok/s':>10s} "
              f"{'fwd MiB':>8s} {'f+b MiB':>8s} {'fwd roof':>8s} {'f+b roof':>8s}")
        for name, impl, n, slow, steps, module in rows:
            set_impl(module, impl)
            flops = layer_flops(flops_name(name), args)
            row = (n / best[(name, impl, 0)], n / best[(name, impl, 1)],
                   peak_memory(steps[0]) / 2**20, peak_memory(steps[1]) / 2**20)
            results[(table, name, impl)] = row
            print(f"{name:26s} {impl:13s} {n:6d} {row[0]:10.0f} {row[1]:10.0f} {row[2]:8.1f} {row[3]:8.1f} "
                  f"{100 * row[0] * flops / rate:7.1f}% {100 * row[1] * 3 * flops / rate:7.1f}%", flush=True)
        print()

    experts = {"K3 experts (ours)": layers["K3 latent MoE (ours)"].experts,
               "KimiLinearExperts": layers["KimiLinearMoE"].experts,
               "Qwen3_5MoeExperts": layers["Qwen3_5MoeSparseMoeBlock"].experts}
    run_table("experts only", experts, lambda name, n: experts_inputs(n), lambda name: "experts")
    if not args.skip_layers:
        whole = ("K3 latent MoE (ours)", COMPILED, "DeepseekV3MoE")
        run_table("whole MoE layer", {name: layers[name] for name in whole},
                  lambda name, n: layer_inputs(n, 2 * D if "ours" in name else D), lambda name: name)

    if args.decode_calls:
        decode_table(args, experts, layers, experts_inputs, layer_inputs)

    def best(table, ours: bool, column: int):
        rows = [(v[column], impl, name) for (t, name, impl), v in results.items()
                if t == table and (("ours" in name) == ours)]
        return max(rows)

    print("== ratios: our best implementation / the fastest in-tree (module, implementation) ==")
    for table in sorted({t for t, _, _ in results}):
        for column, label in ((0, "forward"), (1, "forward+backward")):
            ours, theirs = best(table, True, column), best(table, False, column)
            mem_col = 2 + column
            ours_mem = results[(table, ours[2], ours[1])][mem_col]
            theirs_mem = results[(table, theirs[2], theirs[1])][mem_col]
            print(f"{table:28s} {label:17s} ours {ours[0]:8.0f} tok/s ({ours[1]}) vs {theirs[0]:8.0f} "
                  f"({theirs[2]}, {theirs[1]}): x{ours[0] / theirs[0]:.2f}; "
                  f"peak {ours_mem:.0f} vs {theirs_mem:.0f} MiB")
            # how far the target is from what this machine allows: our roofline at the measured GEMM rate
            flops = layer_flops("experts" if table == "experts only" else ours[2], args) * (3 if column else 1)
            roof, need = rate / flops, args.target * theirs[0]
            print(f"{'':28s} {'':17s} target x{args.target:g} = {need:8.0f} tok/s: {100 * need / roof:.0f}% of our "
                  f"roofline ({roof:.0f} tok/s); ours runs at {100 * ours[0] / roof:.0f}%")
    print("\n== ratios at equal implementation: ours / the fastest in-tree module under it ==")
    for table in sorted({t for t, _, _ in results}):
        for impl in IMPLEMENTATIONS:
            rows = [(name, v) for (t, name, i), v in results.items() if t == table and i == impl]
            ours = next(v for name, v in rows if "ours" in name)
            theirs = [max(v[c] for name, v in rows if "ours" not in name) for c in (0, 1)]
            print(f"{table:16s} {impl:10s} forward x{ours[0] / theirs[0]:8.2f}   "
                  f"forward+backward x{ours[1] / theirs[1]:8.2f}"
                  + ("   (in-tree eager measured on --slow-tokens)" if impl == "eager" else ""))


def decode_table(args, experts, layers, experts_inputs, layer_inputs):
    """Latency of one forward call on ``--decode-tokens`` tokens (a decode step), per (module, implementation):
    the median of ``--decode-calls`` calls, taken round-robin over the rows in 10 rounds. Our whole layer under
    ``k3_grouped_mm`` takes up to 4 tokens in its one-call decode kernel (``csrc/moe_decode_cpu.cpp``); our
    experts alone, and the layer under the other implementations, call the experts kernel or torch as usual."""
    n = args.decode_tokens
    tables = [("experts only", experts, lambda name: experts_inputs(n))]
    if not args.skip_layers:
        modules = {name: layers[name] for name in ("K3 latent MoE (ours)", COMPILED, "DeepseekV3MoE")}
        tables.append(("whole MoE layer", modules, lambda name: layer_inputs(n, 2 * args.latent if "ours" in name else args.latent)))
    print(f"== decode step: one forward call on {n} token(s), median of {args.decode_calls} calls ==")
    for table, modules, inputs_for in tables:
        rows = [(name, impl, module, make_step(module, inputs_for(name), False))
                for name, module in modules.items()
                for impl in implementations_for(name)]
        times = {(name, impl): [] for name, impl, _, _ in rows}
        for name, impl, module, step in rows:
            set_impl(module, impl)
            step()  # warm-up
        per_round = max(1, args.decode_calls // 10)
        for _ in range(10):
            for name, impl, module, step in rows:
                set_impl(module, impl)
                times[(name, impl)] += [_measured(step) for _ in range(per_round)]
        medians = {key: sorted(v)[len(v) // 2] * 1e6 for key, v in times.items()}
        for (name, impl), us in medians.items():
            print(f"{table:16s} {name:26s} {impl:13s} {us:10.0f} us")
        ours = min((us, key) for key, us in medians.items() if "ours" in key[0])
        theirs = min((us, key) for key, us in medians.items() if "ours" not in key[0])
        print(f"{table:16s} ours {ours[0]:.0f} us ({ours[1][1]}) vs in-tree {theirs[0]:.0f} us ({theirs[1][0]}, "
              f"{theirs[1][1]}): in-tree time / ours x{theirs[0] / ours[0]:.2f}\n")


if __name__ == "__main__":
    main()
