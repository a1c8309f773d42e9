"""Worker for test_parallel.py (run under torchrun, gloo on CPU): tensor or expert parallelism through transformers'
own machinery, against the same checkpoint in one process.

    python -m torch.distributed.run --nproc_per_node=N _parallel_worker.py MODE CHECKPOINT

MODE ``tp``: ``DistributedConfig(tp_plan="auto")``; ``ep``: ``DistributedConfig(tp_size=N, ep_size=N)`` (the experts
split over the ranks by expert, the other modules by the TP plan: transformers takes ``ep_size`` as a multiple of
``tp_size``, and ``enable_expert_parallel=True`` alone leaves ``ep_size`` at 1). Every rank also loads the checkpoint whole (no
parallelism) as the reference and checks, on a fixed batch:

* logits (fp32) and greedy generation with the hybrid cache, token for token;
* one training step: the loss and every parameter's gradient (a split parameter's shards are gathered back into
  the whole tensor first, by its plan: contiguous along the split dimension, or, for ``packed_colwise``, each
  rank's gate and up halves): the worst ``||error|| / ||gradient||`` and ``max|error| / max(1, max|gradient|)``;
* the weight bytes this rank holds against the whole model's.

Rank 0 prints ``RESULT {json}``.
"""

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

import transformers_k3  # noqa: F401  (registers the K3 classes)
from transformers_k3 import RouterBalancer


def local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gathered(name: str, shard: torch.Tensor, whole_shape: torch.Size, world: int) -> torch.Tensor:
    """The whole tensor from every rank's ``shard`` of parameter ``name``."""
    shard = shard.contiguous()
    if shard.shape == whole_shape:
        return shard
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard)
    if name.endswith("experts.gate_up_proj") and shard.shape[1] * world == whole_shape[1]:
        gates = [p.chunk(2, dim=1)[0] for p in parts]
        ups = [p.chunk(2, dim=1)[1] for p in parts]
        return torch.cat(gates + ups, dim=1)
    for dim, (a, b) in enumerate(zip(shard.shape, whole_shape)):
        if a != b:
            assert a * world == b, (name, shard.shape, whole_shape)
            return torch.cat(parts, dim=dim)
    raise AssertionError(name)


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "tp":
        distributed = DistributedConfig(tp_plan="auto")
    else:
        distributed = DistributedConfig(tp_size=world, ep_size=world)
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=distributed, dtype=torch.float32)
    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(3, whole.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    result = {"world": world, "mode": mode}

    model.eval(), whole.eval()
    with torch.no_grad():
        want, got = whole(ids).logits, model(ids).logits
        result["logits_max_diff"] = (want - got).abs().max().item()
        result["logits_scale"] = want.abs().max().item()
        kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        result["generate_equal"] = bool(torch.equal(whole.generate(ids, **kwargs), model.generate(ids, **kwargs)))

    model.train(), whole.train()
    labels = ids.clone()
    with RouterBalancer(whole) as balance_whole, RouterBalancer(model) as balance:
        loss_whole = whole(input_ids=ids, labels=labels).loss
        loss_whole.backward()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        metrics_whole, metrics = balance_whole.step(), balance.step()
    result["loss_diff"] = abs(loss.item() - loss_whole.item())
    # Quantile Balancing: the same bias updates and metrics (the routers are replicated; the statistics are summed
    # over every rank, which holds the same tokens: the quantiles and ratios do not change with that scale)
    result["bias_max_diff"] = max(
        (local(b) - reference).abs().max().item() for (name, b), (_, reference) in
        zip(model.named_buffers(), whole.named_buffers()) if name.endswith("e_score_correction_bias"))
    result["bias_moved"] = max(b.abs().max().item() for name, b in whole.named_buffers()
                               if name.endswith("e_score_correction_bias"))
    result["metrics_equal"] = metrics.keys() == metrics_whole.keys() and all(
        abs(metrics[k] - metrics_whole[k]) <= 1e-6 for k in metrics)
    worst, worst_abs, name_worst, split, missing = 0.0, 0.0, None, 0, []
    params = dict(model.named_parameters())
    for name, reference in whole.named_parameters():
        param = params[name]
        if reference.grad is None:
            continue
        if param.grad is None:
            missing.append(name)
            continue
        shard = local(param.grad)
        split += shard.shape != reference.shape
        error = gathered(name, shard, reference.shape, world) - reference.grad
        worst_abs = max(worst_abs, (error.abs().max() / reference.grad.abs().max().clamp_min(1)).item())
        diff = (error.norm() / reference.grad.norm().clamp_min(1e-12)).item()
        if diff > worst:
            worst, name_worst = diff, name
    result.update(grad_rel_norm_diff=worst, grad_max_abs_diff=worst_abs, grad_worst=name_worst,
                  split_parameters=split, missing_grads=missing)
    held = sum(local(p).numel() * p.element_size() for p in model.parameters())
    result["experts_shape"] = list(local(params["model.layers.1.mlp.experts.gate_up_proj"]).shape)
    result["weight_bytes_ratio"] = held / sum(p.numel() * p.element_size() for p in whole.parameters())
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
