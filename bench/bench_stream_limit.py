"""A decode with the routed experts streamed from disk (issue 46, ``KimiK3Mxfp4Config(stream_experts=True)``,
docs/mxfp4.md "Streaming the experts from disk") under a memory limit the kernel enforces, well below the
checkpoint's size.

    python bench/bench_stream_limit.py                       # ~4.5 GB checkpoint, 512 MiB headroom, under /tmp
    python bench/bench_stream_limit.py --moe-layers 3 --headroom-mb 256 --dir /scratch

The checkpoint: the K3-featured bench model (`bench_long_context.k3_config_dict`: KDA + gated NoPE MLA, Block
AttnRes, the latent MoE with its norm and a shared expert, hidden 256, routed experts at latent 128) with one dense
layer and ``--moe-layers`` MoE layers of ``--experts`` experts (top ``--top-k``) ``--intermediate`` wide, written
in the release's layout (MXFP4 ``weight_packed`` / ``weight_scale`` per expert and projection, the other tensors
bf16 / fp32 as the release stores them, ``config.json`` with the release's ``quantization_config``) straight to
disk, one layer's experts at a time (seeded random codes, scales in the range the release's rounding leaves), so writing
it never holds more than a shard in memory. It is deleted at the end.

The run, in a fresh process (``MALLOC_ARENA_MAX=1``: one glibc arena, so threads reserve no heaps of their own):
a streamed load and short decode warm the code paths; the process reads its own ``VmData`` (the private
writable memory ``RLIMIT_DATA`` counts) and limits itself with ``setrlimit(RLIMIT_DATA)`` to that plus
``--headroom-mb``. While ``from_pretrained`` runs, the limit also admits the shards' sizes (transformers' loader
maps every shard copy-on-write, which ``RLIMIT_DATA`` counts though no page of it is copied); from then on it
is the baseline plus the headroom. Under it: a ``--prompt-tokens`` prefill and ``--tokens`` greedy decode steps
with the shards in the page cache, then again with their pages dropped before every step
(``posix_fadvise(DONTNEED)``: each step reads its experts from the disk). Reported: the limit, the checkpoint's
size, the process's peak resident set (``VmHWM``, all of it: Python, torch, the model), the expert bytes read per
token (the stream's own counter) and tokens/s (the median step). Last, the control: a fully loaded packed
``from_pretrained`` of the same checkpoint under the same limit, which must fail to allocate."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy
import torch

_EXPERT_PROJ = (("w1", "gate"), ("w3", "up"), ("w2", "down"))


def bench_config(args):
    """The bench model's config: one dense layer, then ``--moe-layers`` MoE layers (every fourth MLA, at least one)."""
    from bench_long_context import k3_config_dict

    from transformers_k3 import KimiK3TextConfig

    layers = 1 + args.moe_layers
    full = [i for i in range(1, layers + 1) if i % 4 == 0] or [layers]  # (at least one MLA layer)
    values = k3_config_dict()
    values.update(num_hidden_layers=layers, num_experts=args.experts, num_experts_per_token=args.top_k,
                  moe_intermediate_size=args.intermediate)  # fmt: skip
    values["linear_attn_config"] = {**values["linear_attn_config"], "full_attn_layers": full,
                                    "kda_layers": [i for i in range(1, layers + 1) if i not in full]}  # fmt: skip
    return KimiK3TextConfig(**values)


def non_expert_state(config) -> dict[str, torch.Tensor]:
    """Every tensor but the routed experts, seeded, under the release's names and dtypes."""
    from transformers_k3 import KimiK3ForCausalLM
    from transformers_k3.conversion.keymap import k3_to_official_state_dict

    with torch.device("meta"):
        shapes = {n: t.shape for n, t in KimiK3ForCausalLM(config).state_dict().items() if ".mlp.experts." not in n}
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in shapes.items():
        if name.endswith("A_log"):
            t = torch.log(torch.rand(shape, generator=gen) * 15 + 1)
        elif name.endswith("dt_bias") or name.endswith("e_score_correction_bias"):
            t = 0.01 * torch.randn(shape, generator=gen)
        elif "norm" in name and len(shape) == 1:
            t = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        state[name] = t
    return k3_to_official_state_dict(state, dtype=torch.bfloat16)


def write_checkpoint(config, directory: str, shard_bytes: int) -> int:
    """The release-layout checkpoint (module docstring); returns its shards' total bytes."""
    from safetensors.torch import save_file

    from transformers_k3.conversion.keymap import release_quantization_config
    from transformers_k3.convert.export import official_config_dict

    os.makedirs(directory)
    gen = numpy.random.default_rng(1)  # (numpy's generator fills whole byte strings at once)
    d, inter, experts = config.routed_expert_hidden_size, config.moe_intermediate_size, config.num_experts
    shards: list[dict[str, torch.Tensor]] = [non_expert_state(config)]
    plan = []  # (layer, first expert, last expert) per expert shard
    per_expert = 3 * (d * inter // 2 + d * inter // 32)
    step = max(1, shard_bytes // per_expert)
    for layer in range(config.first_k_dense_replace, config.num_hidden_layers):
        plan += [(layer, e, min(e + step, experts)) for e in range(0, experts, step)]
    count = 1 + len(plan)
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    weight_map, total = {}, 0

    def write(index: int, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        path = os.path.join(directory, names[index])
        save_file(tensors, path, metadata={"format": "pt"})
        with open(path, "rb+") as f:
            os.fsync(f.fileno())  # (written pages must be clean for the page cache to drop them)
        weight_map.update(dict.fromkeys(tensors, names[index]))
        total += os.path.getsize(path)

    write(0, shards.pop())
    for index, (layer, first, last) in enumerate(plan, start=1):
        tensors = {}
        for e in range(first, last):
            for proj, _ in _EXPERT_PROJ:
                rows, cols = (inter, d) if proj != "w2" else (d, inter)
                base = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{proj}."
                codes = bytearray(gen.bytes(rows * cols // 2))  # (any byte is two E2M1 codes)
                tensors[base + "weight_packed"] = torch.frombuffer(codes, dtype=torch.uint8).view(rows, cols // 2)
                tensors[base + "weight_scale"] = torch.from_numpy(gen.integers(118, 124, (rows, cols // 32),
                                                                               dtype=numpy.uint8))  # fmt: skip
        write(index, tensors)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(official_config_dict(config, False, "bf16", release_quantization_config()), f, indent=1)
    return total


def status() -> dict[str, int]:
    """This process's ``/proc/self/status`` memory fields, in bytes."""
    fields = {}
    for line in open("/proc/self/status"):
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024 if value.strip().endswith("kB") else 0
    return fields


def child(args) -> None:
    """The limited run (module docstring); prints one JSON line."""
    import gc
    import logging
    import resource

    from bench_long_context import kernelized

    from transformers_k3 import KimiK3ForCausalLM, KimiK3Mxfp4Config, expert_stream

    torch.set_num_threads(args.threads)
    directory = args.child
    shards = [os.path.join(directory, f) for f in sorted(os.listdir(directory)) if f.endswith(".safetensors")]
    page = os.sysconf("SC_PAGE_SIZE")
    mapped = sum(-(-os.path.getsize(f) // page) * page for f in shards)
    quantization = KimiK3Mxfp4Config(stream_experts=True, stream_experts_per_read=args.top_k)
    prompt = torch.randint(3, 4096, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(2))

    def load_streamed():
        return kernelized(KimiK3ForCausalLM.from_pretrained(directory, dtype=torch.bfloat16,
                                                            quantization_config=quantization).eval())  # fmt: skip

    def limit(nbytes):
        resource.setrlimit(resource.RLIMIT_DATA, (nbytes, resource.getrlimit(resource.RLIMIT_DATA)[1]))

    def drop_pages():
        for path in shards:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    def decode(model, before):
        stream = expert_stream(model)
        with torch.no_grad():
            out = model(input_ids=prompt, use_cache=True)
            cache, token, times = out.past_key_values, out.logits[:, -1:].argmax(-1), []
            stream.reset()
            for _ in range(args.tokens):
                if before is not None:
                    before()
                start = time.perf_counter()
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - start)
        return statistics.median(times), stream.bytes_per_token

    warm = load_streamed()  # (code paths, kernels and thread pools in place before the baseline)
    decode(warm, None)
    del warm
    gc.collect()
    before = status()
    headroom = args.headroom_mb << 20
    limit(before["VmData"] + mapped + headroom)
    model = load_streamed()
    limit(before["VmData"] + headroom)
    loaded = status()["VmData"]
    rows = {}
    for row, hook in (("page cache", None), ("from disk", drop_pages)):
        rows[row] = decode(model, hook)
    after = status()
    result = {"base": before["VmData"], "limit": before["VmData"] + headroom, "mapped": mapped,
              "loaded": loaded, "data": after["VmData"], "hwm": after["VmHWM"], "rows": rows,
              "checkpoint_experts": expert_stream(model).checkpoint_expert_bytes,
              "staging": expert_stream(model).staging_bytes}  # fmt: skip
    del model
    gc.collect()

    class Report(logging.Handler):  # (transformers logs a failed conversion in its load report, then raises)
        messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    logging.getLogger("transformers").addHandler(Report())
    limit(before["VmData"] + mapped + headroom)
    try:
        KimiK3ForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        result["control"] = "loaded: the limit does not bind"
    except (MemoryError, RuntimeError) as error:  # (torch's allocator raises a RuntimeError with errno 12)
        failed = [line.strip() for text in (str(error), *Report.messages) for line in text.splitlines()
                  if "Cannot allocate memory" in line]  # fmt: skip
        result["control"] = f"refused, {type(error).__name__}" + (f" ({failed[0][-200:]})" if failed else f": {error}")
    limit(resource.RLIM_INFINITY)
    print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--moe-layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=4096, help="the routed experts' width")
    parser.add_argument("--headroom-mb", type=int, default=512, help="the limit above the measured baseline")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8, help="decode steps per row (their median is reported)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shard-mb", type=int, default=256)
    parser.add_argument("--dir", default=None, help="where the checkpoint is written (default: tmp; deleted after)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not os.path.exists("/proc/self/status"):
        parser.error("reads VmData / VmHWM from /proc/self/status: Linux only")
    if args.child:
        return child(args)
    config = bench_config(args)
    parent = tempfile.mkdtemp(prefix="k3-stream-limit-", dir=args.dir)
    try:
        directory = os.path.join(parent, "release")
        start = time.perf_counter()
        total = write_checkpoint(config, directory, args.shard_mb << 20)
        print(f"wrote {total / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s to {directory}", flush=True)
        command = [sys.executable, __file__, *sys.argv[1:], "--child", directory]
        env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": str(args.threads)}
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode:
            sys.exit(f"the limited run failed:\n{result.stderr[-4000:]}")
        r = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    mib = 2**20
    print(f"\n## stream under RLIMIT_DATA: the K3 bench model, {args.moe_layers} MoE layers of {args.experts} experts "
          f"(top {args.top_k}, intermediate {args.intermediate}, latent {config.routed_expert_hidden_size}), "
          f"{args.top_k} experts per read, {args.threads} thread(s), prompt {args.prompt_tokens}, median of "
          f"{args.tokens} decode steps")  # fmt: skip
    print(f"limit {r['limit'] / mib:,.0f} MiB (baseline VmData {r['base'] / mib:,.0f} MiB + headroom "
          f"{args.headroom_mb} MiB; {(r['base'] + r['mapped']) / mib + args.headroom_mb:,.0f} MiB while "
          f"from_pretrained maps the shards); checkpoint {total / mib:,.0f} MiB of shards "
          f"({r['checkpoint_experts'] / mib:,.0f} MiB of experts); VmData after loading {r['loaded'] / mib:,.0f} MiB, "
          f"after the run {r['data'] / mib:,.0f} MiB; staging {r['staging'] / mib:,.1f} MiB")  # fmt: skip
    print(f"fully loaded packed under the same limit: {r['control']}")
    print("| row | limit MiB | checkpoint MiB | peak RSS MiB | expert MB/token read | ms/token | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row, (seconds, per_token) in r["rows"].items():
        print(f"| streamed, {row} | {r['limit'] / mib:,.0f} | {total / mib:,.0f} | {r['hwm'] / mib:,.0f} | "
              f"{per_token / 1e6:.1f} | {seconds * 1e3:.1f} | {1 / seconds:.2f} |")


if __name__ == "__main__":
    main()
