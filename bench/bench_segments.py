"""Memory of a segment training step as the trajectory grows (issue 47).

For each trajectory length and mode, in a fresh process: a small K3 model (every K3 feature on, tiny widths by
default) runs one `segment_backward` step over a random trajectory in fixed segments, and the script prints the
peak resident memory during the step minus the resident memory before it, the model built (Linux: the peak is reset
through ``/proc/self/clear_refs`` just before the step and read from ``VmHWM``; the first step also loads the
kernels, the same in every row), and the bytes of the state the step keeps
across segments (MLA latents; in exact mode also the saved boundary KDA states and the latents' gradient buffer).
Memory, not time: other processes on the machine do not change it.

    python bench/bench_segments.py                                   # 4K to 64K at 2K segments, both modes
    python bench/bench_segments.py --contexts 4096 8192 --segment 1024
    python bench/bench_segments.py --compile inductor --contexts 4096 16384 32768   # one compiled truncated step

With ``--compile BACKEND`` each row is one truncated-mode step instead: the model compiled (fullgraph) runs a segment
from a cache a no-grad context of ``LENGTH - segment`` tokens filled; the row is the second such step's peak (the
first compiles).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def _state_bytes(model, length: int, segment: int, mode: str) -> int:
    """What the step holds across segments: the MLA latents, plus in exact mode their gradient buffer and the KDA
    state and conv window at each segment boundary."""
    config = model.config
    mla = sum(t == "full_attention" for t in config.layer_types)
    kda = len(config.layer_types) - mla
    latents = mla * length * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    if mode == "truncated":
        return latents
    heads, dim = config.linear_num_heads, config.linear_head_dim
    per_boundary = kda * (heads * dim * dim + 3 * heads * dim * (config.linear_conv_kernel_size - 1)) * 4
    return 2 * latents + per_boundary * (-(-length // segment))


def _model_and_ids(length: int, hidden: int, threads: int):
    """The bench model (kernelized, in training mode) and a random trajectory ``[1, length]``."""
    import torch

    from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig, kernelize

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = KimiK3TextConfig.tiny(hidden_size=hidden)
    model = kernelize(KimiK3ForCausalLM(config).train())
    return model, torch.randint(3, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))


def _resident_now() -> int:
    """Resident bytes after returning freed memory to the OS, with the peak (VmHWM) reset to them."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # (freed memory back to the OS, so the start is what is in use)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    return _status("VmRSS")


def measure(length: int, segment: int, mode: str, hidden: int, threads: int) -> dict:
    from transformers_k3.segments import segment_backward

    model, ids = _model_and_ids(length, hidden, threads)
    before = _resident_now()
    result = segment_backward(model, ids, segment_len=segment, mode=mode)
    peak = _status("VmHWM")
    return {"length": length, "segment": segment, "mode": mode, "step_peak_mib": (peak - before) / 2**20,
            "state_mib": _state_bytes(model, length, segment, mode) / 2**20, "loss": float(result.loss)}


def measure_compiled(length: int, segment: int, backend: str, hidden: int, threads: int) -> dict:
    import torch

    from transformers_k3 import KimiK3HybridCache

    model, ids = _model_and_ids(length, hidden, threads)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    context, step = ids[:, : length - segment], ids[:, length - segment:]

    def run() -> tuple[float, float, float]:
        cache = KimiK3HybridCache(model.config)
        with torch.no_grad():
            model(context, past_key_values=cache, use_cache=True)
        before, start = _resident_now(), time.perf_counter()
        loss = compiled(input_ids=step, past_key_values=cache, labels=step).loss
        loss.backward()
        seconds = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return (_status("VmHWM") - before) / 2**20, float(loss.detach()), seconds

    run()
    peak, loss, seconds = run()
    return {"length": length, "segment": segment, "mode": f"truncated, {backend}", "step_peak_mib": peak,
            "step_s": seconds, "state_mib": _state_bytes(model, length, segment, "truncated") / 2**20, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--segment", type=int, default=2048)
    parser.add_argument("--modes", nargs="+", default=["truncated", "exact"], choices=["truncated", "exact"])
    parser.add_argument("--hidden", type=int, default=64, help="the model's hidden size (KimiK3TextConfig.tiny)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", metavar="BACKEND", help="one compiled truncated step per row (e.g. inductor)")
    parser.add_argument("--one", nargs=2, metavar=("LENGTH", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one and args.compile:
        print(json.dumps(measure_compiled(int(args.one[0]), args.segment, args.compile, args.hidden, args.threads)))
        return
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.segment, args.one[1], args.hidden, args.threads)))
        return
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    timed = " step (s) |" if args.compile else ""
    print("| trajectory tokens | segment | mode | step peak over its start (MiB) | state kept across segments (MiB) |"
          + timed)
    print("|---:|---:|---|---:|---:|" + ("---:|" if args.compile else ""))
    for mode in ["truncated"] if args.compile else args.modes:
        for length in args.contexts:
            extra = ["--compile", args.compile] if args.compile else []
            out = subprocess.run([sys.executable, __file__, "--one", str(length), mode, "--segment", str(args.segment),
                                  "--hidden", str(args.hidden), "--threads", str(args.threads), *extra],
                                 env=env, capture_output=True, text=True, check=True)  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            seconds = f" | {row['step_s']:.2f}" if "step_s" in row else ""
            print(f"| {length} | {args.segment} | {row['mode']} | {row['step_peak_mib']:.1f} | {row['state_mib']:.1f}"
                  f"{seconds} |", flush=True)


if __name__ == "__main__":
    main()
