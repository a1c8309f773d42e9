"""Worker for test_ecosystem.py::test_ddp_and_fsdp2_on_two_cpu_processes (run under torchrun, 2 processes, gloo).

Trains the tiny K3 for a few AdamW steps twice, each rank on its half of a fixed global batch:

1. DDP through accelerate (``Accelerator(cpu=True)``, distributed type MULTI_CPU, gloo);
2. FSDP2 through PyTorch's ``fully_shard`` (every decoder layer, then the root), the engine accelerate's FSDP2 path
   uses. accelerate itself cannot run FSDP on CPU: ``AcceleratorState`` switches to ``DistributedType.FSDP`` only
   for GPU-like devices, so an ``fsdp_plugin`` with ``cpu=True`` is ignored and the model is wrapped in DDP;
3. FSDP2 again with bf16 compute (``MixedPrecisionPolicy``), counting the calls the fused CPU kernels computed.

Rank 0 prints ``RESULT {json}`` with the global-batch loss of every step for every run (the mean of the ranks'
losses, which equals the single-process loss on the full batch since the halves hold equal token counts), and saves
the first step's gradients of the two fp32 runs, whole (``{out_dir}/{run}_grads.pt``).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from references import ADAMW_LR, global_batch
from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig, kernelize

STEPS = 3


def make_model() -> KimiK3ForCausalLM:
    torch.manual_seed(0)
    return KimiK3ForCausalLM(KimiK3TextConfig.tiny()).train()


def train(model, optimizer, ids, backward, world: int, first_grads=None) -> list[float]:
    """``first_grads(model)``: called after the first backward, before the first step."""
    losses = []
    for step in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        backward(loss)
        if step == 0 and first_grads is not None:
            first_grads(model)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean / world).item())
    return losses


def main() -> None:
    torch.set_num_threads(1)
    start = time.time()
    from accelerate import Accelerator, DistributedDataParallelKwargs

    # Layer 0's attention-side AttnRes read has a single candidate (spec 3.3), so its pseudo-query and key norm
    # get no gradient: DDP has to be told to expect unused parameters.
    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    rank, world = accelerator.process_index, accelerator.num_processes
    assert dist.get_backend() == "gloo" and world == 2, (dist.get_backend(), world)
    ids = global_batch().chunk(world)[rank]
    result = {"distributed_type": str(accelerator.distributed_type)}

    def save_grads(run: str, whole):
        def save(model):
            grads = {name: whole(p.grad) for name, p in model.named_parameters() if p.grad is not None}
            if rank == 0:
                torch.save(grads, os.path.join(sys.argv[1], f"{run}_grads.pt"))
        return save

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    result["ddp_wrapper"] = type(model).__name__
    # DDP's gradients are already the ranks' mean; its parameter names gain the wrapper's "module." prefix
    result["ddp"] = train(model, optimizer, ids, accelerator.backward, world,
                          lambda ddp: save_grads("ddp", torch.Tensor.clone)(ddp.module))

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule)
    # each rank holds half of every sharded parameter
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    result["fsdp_local_fraction"] = local / total
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    result["fsdp2"] = train(model, optimizer, ids, lambda loss: loss.backward(), world,
                            save_grads("fsdp2", lambda grad: grad.full_tensor()))  # (gathers each rank's shard)

    # 3. FSDP2 with bf16 compute (MixedPrecisionPolicy: the unsharded parameters cast to bf16, gradients reduced in
    #    fp32), with the fused CPU kernels attached
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = kernelize(make_model())  # (the fused CPU kernels attached, as the README says)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    result["fsdp2_bf16"] = train(model, optimizer, ids, lambda loss: loss.backward(), world)
    result["seconds"] = time.time() - start
    accelerator.wait_for_everyone()
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
