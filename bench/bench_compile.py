"""torch.compile of the K3 text model's decode step on CPU: graph breaks, compile time, step time, agreement.

    python bench/bench_compile.py                          # tiny config, inductor, batch 1, 32-token prompt
    python bench/bench_compile.py --backend aot_eager --steps 16 --batch 4
    python bench/bench_compile.py --explain-only           # just the graph-break listing

What it prints:

1. ``torch._dynamo.explain`` of one decode step (one new token per row, `KimiK3HybridCache` holding the prompt):
   the number of graphs and graph breaks, and every break with its reason and user-code location. The decode path
   has none (measured with torch 2.13 / transformers 5.23): the KDA layers choose their kernels by the tensors'
   device, which a graph fixes at trace time.
2. A table: the decode step eager and compiled (``fullgraph=True``), each with the fused CPU kernels on (inside
   the graph, as operators) and off, milliseconds per step (best of ``--reps``), the one-off compile time and the
   largest relative logit difference against eager with the kernels over all steps.

3. A second table: whole ``generate()`` calls (``--steps`` new tokens, greedy), eager with the growing cache, eager
   with the static cache (``cache_implementation="static"``) and with transformers' compile path on top of the static
   cache (``compile_config=CompileConfig(fullgraph=True, backend=...)``, which compiles the decode steps once: the
   static cache's shapes and addresses do not change), milliseconds per new token (best of ``--reps``, after a
   first call that compiles), and whether the tokens equal eager's.

Notes. The prompt is prefilled eagerly and only the step is compiled, the way generate() uses a compiled forward.
``dynamic=True`` (default here) avoids the recompile that the growing cache length would otherwise trigger after
the first step. On the tiny config the step is dominated by Python and kernel-launch overhead, which is what
compilation removes; the ratio says nothing about the full-size model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from transformers_k3 import KimiK3ForCausalLM, KimiK3HybridCache, KimiK3TextConfig  # noqa: E402


def build(seed: int) -> KimiK3ForCausalLM:
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval()
    with torch.no_grad():  # random weights everywhere (the paper's init zeroes the AttnRes queries)
        for name, param in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                param.normal_(0.0, 0.08) if param.dim() > 1 else param.uniform_(0.9, 1.1)
    return model


def prefilled_cache(model, ids: torch.Tensor, prompt: int) -> KimiK3HybridCache:
    cache = KimiK3HybridCache(model.config)
    model(ids[:, :prompt], past_key_values=cache, use_cache=True)
    return cache


def decode(model, step_fn, ids: torch.Tensor, prompt: int) -> tuple[torch.Tensor, list[float]]:
    cache = prefilled_cache(model, ids, prompt)
    logits, times = [], []
    for t in range(prompt, ids.shape[1]):
        start = time.perf_counter()
        logits.append(step_fn(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        times.append(time.perf_counter() - start)
    return torch.cat(logits, dim=1), times


def explain(model, ids: torch.Tensor, prompt: int) -> None:
    cache = prefilled_cache(model, ids, prompt)
    torch._dynamo.reset()
    result = torch._dynamo.explain(model)(ids[:, prompt:prompt + 1], past_key_values=cache, use_cache=True)
    print(f"explain(): {result.graph_count} graph(s), {result.graph_break_count} graph break(s)")
    for reason in result.break_reasons:
        frame = reason.user_stack[-1] if reason.user_stack else None
        where = f"{os.path.relpath(frame.filename)}:{frame.lineno} ({frame.name})" if frame else "?"
        print(f"  - {reason.reason.splitlines()[0]} at {where}")
    torch._dynamo.reset()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--static", action="store_true", help="compile with dynamic=False")
    parser.add_argument("--explain-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers_k3 import kernelize

    model = kernelize(build(0))  # (the fused CPU kernels, as the README says; kernelize switches them below)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt + args.steps),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        explain(model, ids, args.prompt)
        if args.explain_only:
            return 0
        want, _ = decode(model, model, ids, args.prompt)
        rows, compile_s, errors = {}, {}, {}
        for kernels in (True, False):
            kernelize(model, kernels)
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=args.backend, fullgraph=True, dynamic=not args.static)
            start = time.perf_counter()
            got, _ = decode(model, compiled, ids, args.prompt)  # includes compilation
            compile_s[kernels] = time.perf_counter() - start
            errors[kernels] = ((got - want).abs().max() / want.abs().max()).item()
            for name, fn in ((f"eager, kernels {'on' if kernels else 'off'}", model),
                             (f"compiled, kernels {'on' if kernels else 'off'}", compiled)):
                rows[name] = min(sum(decode(model, fn, ids, args.prompt)[1])
                                 for _ in range(args.reps)) / args.steps * 1e3
    base = rows["eager, kernels on"]
    print(f"\ntiny config, batch {args.batch}, prompt {args.prompt}, {args.steps} decode steps, "
          f"{torch.get_num_threads()} thread(s), backend {args.backend}, dynamic={not args.static}, fullgraph")
    print(f"{'':26}{'ms/step':>10}{'eager-with-kernels / this':>28}")
    for name, ms in rows.items():
        print(f"{name:26}{ms:10.2f}{base / ms:28.2f}")
    for kernels in (True, False):
        print(f"kernels {'on' if kernels else 'off'}: compile + first pass {compile_s[kernels]:.1f} s; max relative "
              f"logit difference vs eager with kernels {errors[kernels]:.1e}")
    generate_table(model, ids[:, :args.prompt], args)
    return 0


def generate_table(model, prompt: torch.Tensor, args) -> None:
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, backend=args.backend)
    config._compile_all_devices = True  # (transformers compiles on accelerators only unless asked)
    modes = {"eager, growing cache": {}, "eager, static cache": {"cache_implementation": "static"},
             "compiled, static cache": {"cache_implementation": "static", "compile_config": config}}
    rows, first_s, same = {}, {}, {}
    torch._dynamo.reset()
    with torch.no_grad():
        want = None
        for name, options in modes.items():
            def run():
                return model.generate(prompt, max_new_tokens=args.steps, min_new_tokens=args.steps, do_sample=False,
                                      **options)
            start = time.perf_counter()
            out = run()  # (the compiled mode compiles here)
            first_s[name] = time.perf_counter() - start
            want = out if want is None else want
            same[name] = torch.equal(out, want)
            best = float("inf")
            for _ in range(args.reps):
                start = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - start)
            rows[name] = best / args.steps * 1e3
    base = rows["eager, growing cache"]
    print(f"\ngenerate(): {args.steps} new tokens after a {prompt.shape[1]}-token prompt, batch {prompt.shape[0]}, "
          f"backend {args.backend} (prefill included)")
    print(f"{'':26}{'ms/token':>10}{'eager-growing / this':>23}{'first call s':>14}{'same tokens':>13}")
    for name, ms in rows.items():
        print(f"{name:26}{ms:10.2f}{base / ms:23.2f}{first_s[name]:14.1f}{str(same[name]):>13}")


if __name__ == "__main__":
    sys.exit(main())
