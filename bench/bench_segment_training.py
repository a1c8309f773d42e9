"""Train on one long toy trajectory through `Trainer` in segments; the loss on held-out segments of it (issue 47).

A small K3 model (`KimiK3TextConfig.tiny`, every K3 feature on, three KDA layers and one MLA layer with one head
by default: the MLA attention over the trajectory is most of the time) and one trajectory drawn from a sparse Markov chain
(each of 64 tokens has 4 equally likely successors, so the best loss is ln 4). Some segments are held out: their
tokens carry no label in training. Each run starts from the same initial weights:

* ``exact`` and ``truncated``: `SegmentTrainer`, every step one `segment_backward` over the whole trajectory;
* ``replay``: a plain `Trainer` over the training segments as `SegmentDataset` items, each segment's incoming state
  from a `SegmentStateStore` computed once before training (`SegmentCollator`), as sampled replay.

The held-out loss is the mean token loss of the held-out segments, each from the state the trajectory before it
leaves under the weights being measured (a fresh `SegmentStateStore`, the same collator). Prints one table row per
run: the held-out loss before and after training, and the training loss of the last step.

    python bench/bench_segment_training.py                      # 64K tokens in 4K segments, the three runs
    python bench/bench_segment_training.py --length 512 --segment 128 --steps 4
"""

from __future__ import annotations

import argparse
import copy
import math
import tempfile
import time

import torch
from transformers import Trainer, TrainingArguments

from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig
from transformers_k3.segment_data import SegmentCollator, SegmentDataset, SegmentStateStore, SegmentTrainer
from transformers_k3.segments import IGNORE_INDEX, segment_bounds

ALPHABET, SUCCESSORS = 64, 4


def markov_trajectory(length: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """``[length]`` ids: a walk on ``ALPHABET`` token ids, each with ``SUCCESSORS`` equally likely next tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(vocab_size - 3, generator=gen)[:ALPHABET] + 3
    table = torch.randint(ALPHABET, (ALPHABET, SUCCESSORS), generator=gen)
    choices = torch.randint(SUCCESSORS, (length,), generator=gen)
    walk = [0]
    for t in range(1, length):
        walk.append(int(table[walk[-1], choices[t]]))
    return tokens[torch.tensor(walk)]


def held_out_loss(model, trajectory: torch.Tensor, segment_len: int, held_out: list[int]) -> float:
    """Mean token loss over the held-out segments, each from the state its prefix leaves under the current weights
    (the loss of a segment's last token predicting the next segment's first included, as in training)."""
    model.eval()
    dataset = SegmentDataset([trajectory], segment_len, segments=[(0, j) for j in held_out])
    collator = SegmentCollator(dataset, SegmentStateStore.compute(model, [trajectory], segment_len))
    total, count = 0.0, 0
    with torch.no_grad():
        for item in dataset:
            batch = collator([item])
            tokens = int((batch["shift_labels"] != IGNORE_INDEX).sum())
            total += float(model(**batch).loss) * tokens
            count += tokens
    return total / count


def _args(out: str, steps: int, lr: float) -> TrainingArguments:
    return TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=steps, learning_rate=lr,
                             warmup_steps=0, lr_scheduler_type="constant", remove_unused_columns=False, report_to=[],
                             save_strategy="no", logging_steps=1, use_cpu=True, seed=0,
                             disable_tqdm=True)  # fmt: skip


def train(run: str, model, trajectory: torch.Tensor, segment_len: int, held_out: list[int], steps: int,
          lr: float) -> float:
    """Train ``model`` in place by ``run`` (exact / truncated / replay); returns the last logged training loss."""
    with tempfile.TemporaryDirectory() as out:
        args = _args(out, steps, lr)
        if run == "replay":
            count = len(segment_bounds(trajectory.shape[0], segment_len))
            dataset = SegmentDataset([trajectory], segment_len,
                                     segments=[(0, j) for j in range(count) if j not in held_out])  # fmt: skip
            store = SegmentStateStore.compute(model.eval(), [trajectory], segment_len)
            trainer = Trainer(model=model.train(), args=args, train_dataset=dataset,
                              data_collator=SegmentCollator(dataset, store))  # fmt: skip
        else:
            labels = trajectory.clone()
            for j in held_out:
                start, end = segment_bounds(trajectory.shape[0], segment_len)[j]
                # (a held-out segment's tokens are not predicted, nor is its first token from the one before)
                labels[max(start, 1) : end] = IGNORE_INDEX
            trainer = SegmentTrainer(model=model.train(), args=args, segment_len=segment_len, segment_mode=run,
                                     train_dataset=[{"input_ids": trajectory, "labels": labels}])  # fmt: skip
        trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--segment", type=int, default=4096)
    parser.add_argument("--held-out", type=int, nargs="+", default=None,
                        help="held-out segment indices (default: the third-last and the last)")
    parser.add_argument("--runs", nargs="+", default=["truncated", "exact", "replay"],
                        choices=["truncated", "exact", "replay"])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps of the whole-trajectory runs")
    parser.add_argument("--replay-steps", type=int, default=None,
                        help="optimizer steps (one segment each) of the replay run (default: one per training segment)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=1, help="MLA heads")
    parser.add_argument("--skip-before", action="store_true",
                        help="do not measure the untrained model (its row shows 'n/a'; runs split over processes)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = KimiK3TextConfig.tiny(hidden_size=args.hidden, num_attention_heads=args.heads, num_hidden_layers=4,
                                   linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4]})
    initial = KimiK3ForCausalLM(config)
    trajectory = markov_trajectory(args.length, config.vocab_size)
    count = len(segment_bounds(args.length, args.segment))
    held_out = args.held_out if args.held_out is not None else sorted({count - 3, count - 1} - {0})
    start = time.perf_counter()
    before = "n/a" if args.skip_before else f"{held_out_loss(initial, trajectory, args.segment, held_out):.4f}"
    print(f"trajectory {args.length} tokens in {count} segments of {args.segment}; held out: segments {held_out}; "
          f"best possible loss ln {SUCCESSORS} = {math.log(SUCCESSORS):.3f}; untrained held-out loss {before} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    print("| run | optimizer steps | held-out loss before | held-out loss after | last training loss | seconds |")
    print("|---|---:|---:|---:|---:|---:|")
    for run in args.runs:
        start = time.perf_counter()
        model = copy.deepcopy(initial)
        steps = args.steps if run != "replay" else (args.replay_steps or count - len(held_out))
        last = train(run, model, trajectory, args.segment, held_out, steps, args.lr)
        after = held_out_loss(model, trajectory, args.segment, held_out)
        print(f"| {run} | {steps} | {before} | {after:.4f} | {last:.4f} | {time.perf_counter() - start:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
