"""Tensor and expert parallelism through transformers' own machinery (``DistributedConfig``), on CPU with gloo:
each case starts ``_parallel_worker.py`` under torchrun and compares, on every rank, against the same checkpoint
loaded whole in one process (logits, greedy generation with the hybrid cache, a training step's loss and every
gradient, Quantile Balancing's bias update and metrics, the weight bytes a rank holds, a checkpoint saved from the
split model and reloaded whole, LoRA on the split model).

Checkpoints: one saved by ``save_pretrained`` (our layout) and one in the release's layout with MXFP4 experts
(built from the release's inventory rules, with references.release_state; ``moe_intermediate_size=64`` so that a
rank's half of ``w2``'s input is whole 32-wide MXFP4 groups, as it is at full size: 3072 / 8 = 12 groups).
"""

import pytest
import torch

from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig

from references import (adamw_losses, global_batch_gradients, gradients_rel_diff, randomize_, release_state,
                        run_torchrun, write_release)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                       reason="needs torch.distributed with gloo"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval())
    model.save_pretrained(root / "ours")
    release = KimiK3TextConfig.tiny(moe_intermediate_size=64)
    write_release(root / "release", release_state(release, False, True, 1), release, False, True)
    return {"ours": root / "ours", "release": root / "release"}


def run_worker(mode: str, processes: int, path, out_dir) -> dict:
    return run_torchrun("_parallel_worker.py", mode, path, out_dir, processes=processes)


@pytest.mark.parametrize("mode, processes, which", [
    ("tp", 2, "ours"), ("ep", 2, "ours"), ("tp", 4, "ours"), ("tp", 2, "release"), ("ep", 2, "release"),
])
def test_parallel_model_equals_the_single_process_model(checkpoints, mode, processes, which, tmp_path):
    r = run_worker(mode, processes, checkpoints[which], tmp_path)
    assert r["world"] == processes
    # the release fixture's weights (random MXFP4 experts) are larger: fp32 sums in another order differ more
    tol = 1e-5 if which == "ours" else 3e-5
    assert r["logits_max_diff"] <= tol * max(1.0, r["logits_scale"]), r
    assert r["generate_equal"], r
    assert r["loss_diff"] <= tol, r
    # gradients: one process's fp32 gradients of this model are themselves up to 3e-5 from fp64 ones (the routers'
    # 1e-5: their gradient sums over every token's top-k weights), so a split model's differ from them by as much
    assert not r["missing_grads"] and r["grad_rel_norm_diff"] <= 5e-5 and r["grad_max_abs_diff"] <= 1e-4, r
    assert r["bias_moved"] > 1e-3 and r["bias_max_diff"] <= 1e-6 and r["metrics_equal"], r
    # each rank holds its part of the experts: TP splits their widths, EP the experts themselves
    experts, width = (8, 128 if which == "release" else 64)
    assert r["experts_shape"] == ([experts, width // processes, 32] if mode == "tp" else
                                  [experts // processes, width, 32]), r
    assert r["split_parameters"] > 0
    assert r["weight_bytes_ratio"] < (0.6 if processes == 2 else 0.35), r
    assert r["reloaded_logits_diff"] == 0, r  # saved from the split model, reloaded whole: the same weights
    assert r["lora_parameters"] > 0 and not r["lora_missing_grads"], r
    assert r["lora_loss_diff"] <= tol and r["lora_grad_rel_norm_diff"] <= 5e-5, r
    print(f"{mode} x{processes} {which}: a rank holds {r['weight_bytes_ratio']:.0%} of the weight bytes")


def test_deepspeed_zero3_trains_like_one_process(tmp_path):
    """DeepSpeed ZeRO-3 on 2 CPU processes (gloo, DeepSpeed's CPU accelerator), loaded the user's way
    (``HfDeepSpeedConfig`` + ``from_pretrained``: the fused experts and the release's A_log are converted to the
    whole shapes, not the partitioned ones): with half the parameters on each rank and half of a global batch per
    rank, the first step's gradients, gathered whole, equal one process's on the whole batch (1e-5 of each
    parameter's largest entry), and 3 AdamW steps give the global losses of one process training on the whole batch
    (1e-5 relative)."""
    pytest.importorskip("deepspeed")
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).train()
    model.save_pretrained(tmp_path / "model")
    result = run_torchrun("_deepspeed_worker.py", tmp_path / "model", tmp_path, env={"DS_ACCELERATOR": "cpu"})
    grads = global_batch_gradients(model)
    single = adamw_losses(model)
    assert single[-1] < single[0] - 0.5
    worst, name = gradients_rel_diff(torch.load(tmp_path / "grads.pt"), grads)
    print("first-step gradients:", worst, name, "losses:", result["losses"], single)
    assert worst <= 1e-5, (worst, name)
    assert result["losses"] == pytest.approx(single, rel=1e-5), (result, single)
    assert abs(result["held_fraction"] - 0.5) < 0.01, result


def test_multimodal_model_under_tensor_parallelism(tmp_path):
    """``AutoModelForImageTextToText`` with ``tp_plan="auto"`` on 2 gloo processes: the text model split by the
    text plan, the vision tower whole; logits and greedy generation with an image equal the whole model's."""
    from transformers_k3 import KimiK3Config, KimiK3ForConditionalGeneration

    torch.manual_seed(0)
    randomize_(KimiK3ForConditionalGeneration(KimiK3Config.tiny()).eval()).save_pretrained(tmp_path / "vl")
    r = run_worker("vl", 2, tmp_path / "vl", tmp_path)
    assert r["split_parameters"] > 0, r
    assert r["logits_max_diff"] <= 1e-5 * max(1.0, r["logits_scale"]) and r["generate_equal"], r
