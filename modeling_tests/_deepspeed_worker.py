"""Worker for test_parallel.py::test_deepspeed_zero3 (run under torchrun, gloo, DeepSpeed's CPU accelerator).

The user's path: ``HfDeepSpeedConfig`` alive while ``from_pretrained`` loads the checkpoint (ZeRO-3 partitions the
parameters as they load), then ``deepspeed.initialize`` and 3 AdamW steps, each rank on its half of a fixed
global batch (gradient clipping off, as in the single-process reference). Rank 0 prints ``RESULT {json}`` with the
global-batch loss of every step and the fraction of the parameters this rank holds, and saves the first step's
gradients, whole (``{out_dir}/grads.pt``).
"""

import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad
from transformers.integrations import HfDeepSpeedConfig

from references import ADAMW_LR, global_batch
from transformers_k3 import KimiK3ForCausalLM

STEPS = 3
CONFIG = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": ADAMW_LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                               "torch_adam": True}},
    "fp16": {"enabled": False}, "bf16": {"enabled": False},
}


def main() -> None:
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    keep = HfDeepSpeedConfig(CONFIG)  # noqa: F841  (from_pretrained reads it while it is alive)
    model = KimiK3ForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    held = sum(p.ds_tensor.numel() for p in model.parameters()) / sum(p.ds_numel for p in model.parameters())
    ids = global_batch().chunk(world)[rank]
    losses = []
    for step in range(STEPS):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if step == 0:
            # ZeRO-3 keeps each rank's partition of the ranks' mean gradient: gathered here, before the step
            grads = {name: safe_get_full_grad(p) for name, p in model.named_parameters()}
            if rank == 0:
                torch.save({n: g.clone() for n, g in grads.items() if g is not None},
                           os.path.join(sys.argv[2], "grads.pt"))
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean / world).item())
    if rank == 0:
        print("RESULT " + json.dumps({"losses": losses, "held_fraction": held}), flush=True)
    # an interpreter exit with the engine and the gloo group alive can abort in their threads' destructors
    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
