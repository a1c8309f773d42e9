"""Worker for test_parallel.py::test_deepspeed_zero3 (run under torchrun, gloo, DeepSpeed's CPU accelerator).

The user's path: ``HfDeepSpeedConfig`` alive while ``from_pretrained`` loads the checkpoint (ZeRO-3 partitions the
parameters as they load), then ``deepspeed.initialize`` and 3 AdamW steps, each rank on its half of a fixed
global batch (gradient clipping off, as in the single-process reference). Rank 0 prints ``RESULT {json}`` with the
global-batch loss of every step and the fraction of the parameters this rank holds.
"""

import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers.integrations import HfDeepSpeedConfig

from transformers_k3 import KimiK3ForCausalLM

STEPS = 3
CONFIG = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
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
    ids = torch.randint(3, 512, (4, 16), generator=torch.Generator().manual_seed(0)).chunk(world)[rank]
    losses = []
    for _ in range(STEPS):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
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
