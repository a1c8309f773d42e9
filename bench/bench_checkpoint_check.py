"""What the checkpoint pre-check costs before from_pretrained: `check_pretrained_directory` on a directory with
the release's shard and tensor counts (96 shards, 497,220 tensors; each tensor 2 bytes, so only the headers are
real size), against what transformers' loader does with those files anyway (safetensors' `safe_open` on every
shard, listing its tensors) and against reading the index alone.

    python bench/bench_checkpoint_check.py                      # the release's counts
    python bench/bench_checkpoint_check.py --tensors 50000 --shards 10

Reports the median of --repeat runs of each and the ratios to `safe_open`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from transformers_k3.conversion.checkpoint_checks import check_pretrained_directory
from transformers_k3.conversion.streaming import read_index


def release_like_names(count: int) -> list[str]:
    """Names shaped like the release's inventory (the long per-expert MXFP4 names dominate it)."""
    names = []
    layer, expert = 1, 0
    while len(names) < count:
        for proj in ("w1", "w2", "w3"):
            for kind in ("weight_packed", "weight_scale"):
                names.append(f"language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.{kind}")
        expert += 1
        if expert == 896:
            layer, expert = layer + 1, 0
    return names[:count]


def build(directory: Path, tensors: int, shards: int) -> None:
    names = release_like_names(tensors)
    per = -(-tensors // shards)
    weight_map = {}
    for s in range(shards):
        chunk = names[s * per:(s + 1) * per]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: torch.zeros(2, dtype=torch.uint8) for n in chunk}, str(directory / file))
        weight_map.update(dict.fromkeys(chunk, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))


def timed(fn, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=497_220)
    parser.add_argument("--shards", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        build(directory, args.tensors, args.shards)
        files = sorted(directory.glob("*.safetensors"))

        def open_all():
            for file in files:
                with safe_open(str(file), "pt") as f:
                    list(f.keys())

        rows = [
            ("safe_open + keys, every shard (transformers reads these anyway)", timed(open_all, args.repeat)),
            ("read_index (the index JSON alone)", timed(lambda: read_index(directory / "model.safetensors.index.json"),
                                                        args.repeat)),
            ("check_pretrained_directory (our pre-check)", timed(lambda: check_pretrained_directory(directory, {}),
                                                                 args.repeat)),
        ]
    base = rows[0][1]
    print(f"{args.tensors} tensors in {args.shards} shards, median of {args.repeat}")
    print("| what | seconds | / safe_open |")
    print("|---|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.2f} | {seconds / base:.2f} |")


if __name__ == "__main__":
    main()
