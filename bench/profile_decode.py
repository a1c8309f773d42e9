"""Where a decode step of the bench model goes: torch.profiler over a few eager steps at context N.

    python bench/profile_decode.py --model-kind k3 --context 16384 --steps 5

Prints the per-step time, the aten operators by self CPU time, every module class by inclusive time (from the
profiler's module events) and the package's own Python functions (``file:function``) by inclusive time (from its
Python stack events). The Python tracer makes Python-heavy code look dearer than it is; the ranking is what it is
for. The model and cache are bench_long_context's (kernels on, as by default).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_long_context as blc  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-kind", choices=blc.MODEL_KINDS, default="k3")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = blc.build("ours", args.model_kind)
    cache = blc.fill_cache("ours", model, args.context)
    token = torch.tensor([[7]])
    with torch.no_grad():
        for _ in range(3):  # warm-up
            model(token, past_key_values=cache, use_cache=True)
        plain = []
        for _ in range(args.steps):
            start = time.perf_counter()
            model(token, past_key_values=cache, use_cache=True)
            plain.append(time.perf_counter() - start)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True,
                                    with_modules=True) as prof:
            for _ in range(args.steps):
                model(token, past_key_values=cache, use_cache=True)
    steps = args.steps
    print(f"{args.model_kind} model, context {args.context:,}, {args.threads} threads: decode step "
          f"{1e3 * statistics.median(plain):.2f} ms (median of {steps}, unprofiled)")
    averages = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    python = [e for e in averages if ".py(" in e.key or e.key.startswith("<")]
    ops = [e for e in averages if e not in python and not e.key.startswith("nn.Module")]
    for title, events in (("aten / custom operators", ops), ("Python functions (profiled)", python)):
        print(f"\n== {title} by self CPU time, per step (top {args.top}) ==")
        for e in events[:args.top]:
            print(f"{e.self_cpu_time_total / steps / 1e3:8.3f} ms  {e.count // steps:5d} calls/step  {e.key}")
    modules: dict[str, float] = collections.defaultdict(float)
    functions: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    pattern = re.compile(r"(?:.*/)?(transformers_k3/[^()]+)\((\d+)\): (\S+)")
    for event in prof.events():
        duration = event.cpu_time_total
        if event.name.startswith("nn.Module: "):
            name = re.sub(r"_\d+$", "", event.name[len("nn.Module: "):])
            modules[name] += duration
            counts["module " + name] += 1
        else:
            match = pattern.match(event.name)
            if match:
                key = f"{match.group(1)}:{match.group(3)}"
                functions[key] += duration
                counts[key] += 1
    print(f"\n== module classes by inclusive time, per step (nested modules count in their parents too) ==")
    for name, us in sorted(modules.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{us / steps / 1e3:8.3f} ms  {counts['module ' + name] // steps:5d} calls/step  {name}")
    print(f"\n== transformers_k3 Python functions by inclusive time, per step (profiled; nested count twice) ==")
    for name, us in sorted(functions.items(), key=lambda kv: -kv[1])[:2 * args.top]:
        print(f"{us / steps / 1e3:8.3f} ms  {counts[name] // steps:5d} calls/step  {name}")


if __name__ == "__main__":
    main()
