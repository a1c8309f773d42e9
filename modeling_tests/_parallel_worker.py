"""Worker for test_parallel.py (run under torchrun, gloo on CPU): tensor or expert parallelism through transformers'
own machinery, against the same checkpoint in one process.

    python -m torch.distributed.run --nproc_per_node=N _parallel_worker.py MODE CHECKPOINT OUTPUT_DIR

MODE ``vl``: the multimodal model under ``tp_plan="auto"``, logits and generation with an image only; ``tp``:
``DistributedConfig(tp_plan="auto")``; ``ep``: ``DistributedConfig(tp_size=N, ep_size=N)`` (the experts
split over the ranks by expert, the other modules by the TP plan: transformers takes ``ep_size`` as a multiple of
``tp_size``, and ``enable_expert_parallel=True`` alone leaves ``ep_size`` at 1). Every rank also loads the checkpoint whole (no
parallelism) as the reference and checks, on a fixed batch:

* logits (fp32) and greedy generation with the hybrid cache, token for token;
* one training step: the loss and every parameter's gradient (a split parameter's shards are gathered back into
  the whole tensor first, by its plan: contiguous along the split dimension, or, for ``packed_colwise``, each
  rank's gate and up halves): the worst ``||error|| / ||gradient||`` and ``max|error| / max(1, max|gradient|)``;
* the weight bytes this rank holds against the whole model's;
* ``save_pretrained`` of the split model, reloaded whole in one process: the whole model's logits;
* LoRA (PEFT) on the split model: the loss and the adapters' gradients of the whole model with the same adapters.

Rank 0 prints ``RESULT {json}``.
"""

import json
import os
import pathlib
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


def compare_gradients(model, whole, world: int, only: str = ""):
    """(worst ||error|| / ||gradient||, worst max|error| / max(1, max|gradient|), its parameter, split parameters,
    parameters without a gradient) of ``model``'s gradients against ``whole``'s."""
    worst, worst_abs, name_worst, split, missing = 0.0, 0.0, None, 0, []
    params = dict(model.named_parameters())
    for name, reference in whole.named_parameters():
        if reference.grad is None or only not in name:
            continue
        param = params[name]
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
    return worst, worst_abs, name_worst, split, missing


def multimodal(path: str, device: torch.device, rank: int) -> None:
    """The multimodal model under ``tp_plan="auto"`` (its text model split by the text plan, the vision tower
    whole): logits and greedy generation with an image against the whole model."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"),
                                                        dtype=torch.float32).eval()
    whole = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).to(device).eval()
    pad = whole.config.media_placeholder_token_id
    grid = torch.tensor([[1, 4, 4]], device=device)  # 16 patches -> 4 merged tokens
    pixels = torch.randn(16, 3, 14, 14, generator=torch.Generator().manual_seed(0)).to(device)
    ids = torch.tensor([[5, 6, pad, pad, pad, pad, 7, 8]], device=device)
    inputs = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid)
    with torch.no_grad():
        want, got = whole(**inputs).logits, model(**inputs).logits
        kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        same = bool(torch.equal(whole.generate(**inputs, **kwargs), model.generate(**inputs, **kwargs)))
    split = sum(local(p).shape != q.shape for p, q in zip(model.parameters(), whole.parameters()))
    if rank == 0:
        print("RESULT " + json.dumps({"logits_max_diff": (want - got).abs().max().item(), "logits_scale":
                                      want.abs().max().item(), "generate_equal": same, "split_parameters": split}),
              flush=True)


def main() -> None:
    mode, path, out_dir = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    torch.set_num_threads(1)
    # one GPU per rank where there are enough (bench/gpu_check.py runs it so, over nccl), else the CPU and gloo
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.set_float32_matmul_precision("highest")  # exact fp32 GPU products, as the single-process reference's
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "vl":
        multimodal(path, device, rank)
        dist.barrier()
        dist.destroy_process_group()
        return
    if mode == "tp":
        distributed = DistributedConfig(tp_plan="auto")
    else:
        distributed = DistributedConfig(tp_size=world, ep_size=world)
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=distributed, dtype=torch.float32)
    # the split model dequantizes MXFP4 experts (packed ones are not split yet): the whole one the same way
    dequantized = {"quant_method": "k3_mxfp4", "dequantize": True}
    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=dequantized).to(device)
    ids = torch.randint(3, whole.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
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
    worst, worst_abs, name_worst, split, missing = compare_gradients(model, whole, world)
    result.update(grad_rel_norm_diff=worst, grad_max_abs_diff=worst_abs, grad_worst=name_worst,
                  split_parameters=split, missing_grads=missing)
    params = dict(model.named_parameters())
    held = sum(local(p).numel() * p.element_size() for p in model.parameters())
    result["experts_shape"] = list(local(params["model.layers.1.mlp.experts.gate_up_proj"]).shape)
    result["weight_bytes_ratio"] = held / sum(p.numel() * p.element_size() for p in whole.parameters())

    # a checkpoint saved from the split model is the whole model again (one process reloads it)
    model.save_pretrained(out_dir / "saved")
    dist.barrier()
    with torch.no_grad():
        again = AutoModelForCausalLM.from_pretrained(out_dir / "saved", dtype=torch.float32).to(device).eval()
        result["reloaded_logits_diff"] = (again(ids).logits - whole.eval()(ids).logits).abs().max().item()

    # LoRA on the split model, on the projections the TP plan leaves whole (PEFT sizes an adapter from its layer's
    # out_features, which TP sets to the rank's part, while a gathered output is whole): the same loss and adapter
    # gradients as on the whole model
    from peft import LoraConfig, get_peft_model

    targets = ["q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj", "f_a_proj", "b_proj"]
    adapted = []
    for base in (model, whole):
        base.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        adapted.append(get_peft_model(base.train(), LoraConfig(r=4, target_modules=targets, init_lora_weights=False)))
    losses = []
    for peft_model in adapted:
        loss = peft_model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
    result["lora_loss_diff"] = abs(losses[0] - losses[1])
    worst, _, _, _, missing = compare_gradients(adapted[0], adapted[1], world, only="lora_")
    result.update(lora_grad_rel_norm_diff=worst, lora_missing_grads=missing,
                  lora_parameters=sum(1 for n, _ in adapted[1].named_parameters() if "lora_" in n))
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
