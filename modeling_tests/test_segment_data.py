"""The data side of segment training (src/transformers_k3/segment_data.py): a collated segment's loss is the
full-context loss over its tokens (states computed once without gradients, or replayed from cache files, which are
checked against the trajectory), and transformers' Trainer, fed sampled segments, lowers a held-out segment's loss.
`SegmentTrainer`'s step over whole trajectories in exact mode takes full-context backpropagation's gradient (with
and without gradient accumulation) and Quantile Balancing's bias update, and lowers the loss."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

from transformers_k3 import KimiK3ForCausalLM, KimiK3HybridCache, KimiK3TextConfig
from transformers_k3.segment_data import SegmentCollator, SegmentDataset, SegmentStateStore, SegmentTrainer
from transformers_k3.segments import KimiK3SegmentError

from references import randomize_


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny())).eval()


@pytest.fixture(scope="module")
def trajectories():
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, 512, (70,), generator=gen), torch.randint(3, 512, (48,), generator=gen)]


def _token_losses(model, ids):
    """Full-context per-token losses ``[T - 1]`` (token t predicting t + 1)."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()
    return F.cross_entropy(logits[:-1], ids[1:], reduction="none")


def _segment_loss(model, batch):
    with torch.no_grad():
        return model(**batch).loss


@pytest.mark.parametrize("replay", [False, True], ids=["computed", "replayed"])
def test_a_collated_segment_is_the_full_context_loss_over_its_tokens(model, trajectories, tmp_path, replay):
    dataset = SegmentDataset(trajectories, 24)
    assert [dataset[i] for i in range(len(dataset))] == [{"trajectory": 0, "segment": j} for j in range(3)] + [
        {"trajectory": 1, "segment": j} for j in range(2)]
    if replay:
        store = SegmentStateStore(model.config, 24)
        for i, ids in enumerate(trajectories):
            files = {}
            for j, start in enumerate(range(24, ids.shape[0], 24), start=1):
                cache = KimiK3HybridCache(model.config)
                with torch.no_grad():
                    model(ids[None, :start], past_key_values=cache, use_cache=True)
                cache.save(tmp_path / f"{i}_{j}.safetensors")
                files[j] = tmp_path / f"{i}_{j}.safetensors"
            store.add_files(i, files)
    else:
        store = SegmentStateStore.compute(model, trajectories, 24)
    collate = SegmentCollator(dataset, store)
    for index in range(len(dataset)):
        item = dataset[index]
        ids = trajectories[item["trajectory"]]
        start = 24 * item["segment"]
        end = min(start + 24, ids.shape[0])
        want = _token_losses(model, ids)[start:end].mean()  # (the last segment's last token predicts nothing)
        torch.testing.assert_close(_segment_loss(model, collate([item])), want, atol=1e-5, rtol=1e-5)


def test_a_cache_file_of_another_prefix_is_refused(model, trajectories, tmp_path):
    cache = KimiK3HybridCache(model.config)
    with torch.no_grad():
        model(trajectories[1][None, :24], past_key_values=cache, use_cache=True)
    cache.save(tmp_path / "other.safetensors")
    store = SegmentStateStore(model.config, 24)
    store.add_files(0, {1: tmp_path / "other.safetensors"})
    collate = SegmentCollator(SegmentDataset(trajectories, 24), store)
    with pytest.raises(KimiK3SegmentError, match="does not hold that trajectory's"):
        collate([{"trajectory": 0, "segment": 1}])
    with pytest.raises(KimiK3SegmentError, match="same bounds"):
        collate([{"trajectory": 0, "segment": 0}, {"trajectory": 1, "segment": 1}])
    with pytest.raises(KimiK3SegmentError, match="one segment_len"):
        SegmentCollator(SegmentDataset(trajectories, 24), SegmentStateStore(model.config, 16))


def test_a_group_of_segments_is_their_full_context_losses_in_one_batch(model, trajectories):
    """``group_size=2``: the segments with the same bounds (both trajectories' first, both trajectories' second:
    the first's full 24 tokens, the second's last, whose final token predicts nothing) go in one item, collated into
    one batch of two rows from one cache holding both states: its loss is the full-context loss over all those tokens,
    and the first trajectory's third segment is a group of one."""
    dataset = SegmentDataset(trajectories, 24, group_size=2)
    assert [dataset[i] for i in range(len(dataset))] == [{"segments": [(0, 0), (1, 0)]},
                                                         {"segments": [(0, 1), (1, 1)]}, {"segments": [(0, 2)]}]
    collate = SegmentCollator(dataset, SegmentStateStore.compute(model, trajectories, 24))
    losses = [_token_losses(model, ids) for ids in trajectories]
    for index, (start, end) in enumerate([(0, 24), (24, 48)]):
        batch = collate([dataset[index]])
        assert batch["input_ids"].shape == (2, 24)
        want = torch.cat([losses[0][start:end], losses[1][start:end]]).mean()
        torch.testing.assert_close(_segment_loss(model, batch), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(KimiK3SegmentError, match="group_size"):
        SegmentDataset(trajectories, 24, group_size=0)
    with pytest.raises(KimiK3SegmentError, match="SegmentDataset items"):
        collate([{"input_ids": trajectories[0][:24]}])


@pytest.mark.parametrize("grouped", [False, True], ids=["one-segment", "grouped"])
def test_trainer_lowers_a_held_out_segments_loss(tmp_path, grouped):
    """A repeating 256-token trajectory in 64-token segments: the Trainer trains on segments 0-2 (sampled, truncated
    mode, states computed once), and the full-context loss over segment 3's tokens drops. Grouped: beside it the
    same pattern shifted, each batch the two trajectories' segments with the same bounds (``group_size=2``)."""
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()))
    pattern = torch.randint(3, 512, (16,), generator=torch.Generator().manual_seed(3))
    trajectory = pattern.repeat(16)
    before = _token_losses(model.eval(), trajectory)[192:].mean()
    trajectories = [trajectory, trajectory.roll(5)] if grouped else [trajectory]
    dataset = SegmentDataset(trajectories, 64, segments=[(i, j) for i in range(len(trajectories)) for j in range(3)],
                             group_size=len(trajectories))
    store = SegmentStateStore.compute(model, trajectories, 64)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=12, learning_rate=3e-3,
                             remove_unused_columns=False, report_to=[], save_strategy="no", logging_steps=100,
                             use_cpu=True)  # fmt: skip
    Trainer(model=model.train(), args=args, train_dataset=dataset,
            data_collator=SegmentCollator(dataset, store)).train()  # fmt: skip
    after = _token_losses(model.eval(), trajectory)[192:].mean()
    assert after < 0.7 * before, (before.item(), after.item())


class _GradientsBeforeTheStep(TrainerCallback):
    """Keeps each optimizer step's gradients (Trainer's callback before the step)."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def _trainer_gradients(trainer_cls, model, data, tmp_path, batch_size, accumulation, **kwargs):
    keep = _GradientsBeforeTheStep()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=batch_size, max_steps=1,
                             gradient_accumulation_steps=accumulation, learning_rate=1e-3, max_grad_norm=0.0,
                             report_to=[], save_strategy="no", use_cpu=True, dataloader_drop_last=True)  # fmt: skip
    trainer_cls(model=model.train(), args=args, train_dataset=data, callbacks=[keep], **kwargs).train()
    return keep.steps[0]


@pytest.mark.parametrize("batch_size, accumulation", [(2, 1), (1, 2)])
def test_segment_trainer_step_is_full_context_backprop(tmp_path, batch_size, accumulation):
    """One SegmentTrainer step in exact mode (64-token trajectories in 4 segments) has the gradient of a plain
    Trainer's full-context step on the same batches: the whole gradient and each parameter's within 1e-5 of its
    norm (fp32), with a batch of two and with two accumulated batches of one."""
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()))
    gen = torch.Generator().manual_seed(4)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(3, 512, (2, 64), generator=gen)]
    want = _trainer_gradients(Trainer, copy.deepcopy(model), data, tmp_path, batch_size, accumulation)
    got = _trainer_gradients(SegmentTrainer, model, data, tmp_path, batch_size, accumulation, segment_len=16,
                             segment_mode="exact")  # fmt: skip
    assert got.keys() == want.keys()
    total = torch.cat([g.flatten() for g in want.values()]).norm()
    diff = torch.cat([(got[n] - want[n]).flatten() for n in want]).norm()
    assert diff <= 1e-5 * total, f"relative gradient difference {diff / total:.2e}"
    for name in want:
        assert (got[name] - want[name]).norm() <= 1e-5 * total, name


@pytest.mark.parametrize("mode", ["exact", "truncated"])
def test_segment_trainer_lowers_the_loss(tmp_path, mode):
    """Eight SegmentTrainer steps on a repeating 128-token trajectory in 32-token segments lower its full-context
    loss below 0.7x, in both modes."""
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()))
    pattern = torch.randint(3, 512, (16,), generator=torch.Generator().manual_seed(3))
    trajectory = pattern.repeat(8)
    before = _token_losses(model.eval(), trajectory).mean()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=8, learning_rate=3e-3,
                             report_to=[], save_strategy="no", logging_steps=100, use_cpu=True)  # fmt: skip
    SegmentTrainer(model=model.train(), args=args, train_dataset=[{"input_ids": trajectory}], segment_len=32,
                   segment_mode=mode).train()  # fmt: skip
    after = _token_losses(model.eval(), trajectory).mean()
    assert after < 0.7 * before, (before.item(), after.item())


@pytest.mark.parametrize("mode", ["exact", "truncated"])
def test_segment_trainer_lowers_a_held_out_segments_loss(tmp_path, mode):
    """A repeating 256-token trajectory in 64-token segments whose last segment carries no label: eight SegmentTrainer
    steps over the whole trajectory lower the full-context loss over that segment's tokens below 0.7x, in both
    modes (bench/bench_segment_training.py does this at 64K tokens)."""
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()))
    trajectory = torch.randint(3, 512, (16,), generator=torch.Generator().manual_seed(3)).repeat(16)
    labels = trajectory.clone()
    labels[192:] = -100
    before = _token_losses(model.eval(), trajectory)[191:].mean()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=8, learning_rate=3e-3,
                             report_to=[], save_strategy="no", logging_steps=100, use_cpu=True)  # fmt: skip
    SegmentTrainer(model=model.train(), args=args, train_dataset=[{"input_ids": trajectory, "labels": labels}],
                   segment_len=64, segment_mode=mode).train()  # fmt: skip
    after = _token_losses(model.eval(), trajectory)[191:].mean()
    assert after < 0.7 * before, (before.item(), after.item())


def test_segment_trainer_refuses_what_it_cannot_train(tmp_path):
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny())
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(KimiK3SegmentError, match="segment_mode"):
        SegmentTrainer(model=model, args=args, segment_len=8, segment_mode="full")
    with pytest.raises(KimiK3SegmentError, match="segment_len"):
        SegmentTrainer(model=model, args=args, segment_len=0)
    trainer = SegmentTrainer(model=model, args=args, segment_len=8)
    ids = torch.randint(3, 512, (1, 16))
    with pytest.raises(KimiK3SegmentError, match="unpadded"):
        trainer.training_step(model, {"input_ids": ids, "attention_mask": torch.zeros_like(ids)})
    with pytest.raises(KimiK3SegmentError, match="drop the other columns"):
        trainer.training_step(model, {"input_ids": ids, "pixel_values": ids})


def test_segment_trainer_trains_packed_rows(tmp_path):
    """A batch of DataCollatorWithFlattening (two sequences in one row, one longer than a segment): the training
    step's loss and gradients are those of the model's forward of the packed row (exact mode)."""
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny())).train()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = SegmentTrainer(model=model, args=args, segment_len=8)
    generator = torch.Generator().manual_seed(2)
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": torch.randint(3, 512, (n,), generator=generator).tolist()} for n in (13, 7)])
    want_loss = model(**packed).loss
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    # (the label count Trainer passes: labels[..., 1:] that are not -100)
    loss = trainer.training_step(model, dict(packed), num_items_in_batch=int((packed["labels"][:, 1:] != -100).sum()))
    torch.testing.assert_close(loss, want_loss.detach(), atol=1e-5, rtol=1e-5)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    total = torch.cat([g.flatten() for g in want.values()]).norm()
    assert torch.cat([(got[n] - want[n]).flatten() for n in want]).norm() <= 1e-5 * total


def test_segment_trainer_with_quantile_balancing(tmp_path):
    """Quantile Balancing under SegmentTrainer (exact mode, 4 segments): one step moves every router's selection
    bias as a plain Trainer's full-context step does (the no-grad boundary pass shows the routers the same tokens
    again with the same scores, which leaves the quantiles and loads as they are)."""
    from transformers_k3 import QuantileBalancingCallback

    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()))
    gen = torch.Generator().manual_seed(4)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(3, 512, (2, 64), generator=gen)]
    biases = {}
    for name, trainer_cls, kwargs in (("full", Trainer, {}),
                                      ("exact", SegmentTrainer, dict(segment_len=16, segment_mode="exact"))):
        trained = copy.deepcopy(model)
        args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=2, max_steps=1,
                                 learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True)  # fmt: skip
        trainer_cls(model=trained.train(), args=args, train_dataset=data, callbacks=[QuantileBalancingCallback()],
                    **kwargs).train()  # fmt: skip
        biases[name] = {n: b.clone() for n, b in trained.named_buffers() if n.endswith("e_score_correction_bias")}
    assert biases["full"] and biases["full"].keys() == biases["exact"].keys()
    start = {n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    assert any(not torch.equal(biases["full"][n], start[n]) for n in start)  # the step moved them
    for name in start:
        torch.testing.assert_close(biases["exact"][name], biases["full"][name], atol=1e-6, rtol=0)
