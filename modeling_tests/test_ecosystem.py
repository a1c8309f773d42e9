"""K3 in the transformers ecosystem, on the tiny config: the text-generation pipeline with the chat template,
Trainer (padding, labels, num_items_in_batch, gradient checkpointing, Quantile Balancing), packed-sequence
training, PEFT LoRA / QLoRA, accelerate big-model inference with offload, distributed training (DDP / FSDP on
gloo) and torch.compile of the decode step. The chat parsing helpers are tested in test_chat.py."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    LogitsProcessorList,
    Trainer,
    TrainingArguments,
    pipeline,
)

from transformers_k3 import KimiK3ForCausalLM, KimiK3HybridCache, KimiK3TextConfig, kernelize
from transformers_k3.ops import cpu_kernel
from transformers_k3.chat import (
    KIMI_K3_RESPONSE_TEMPLATE,
    THINK_OPEN,
    THINKING_END_SEQUENCE,
    ThinkingBudgetLogitsProcessor,
    parse_kimi_k3_response,
)

from references import adamw_losses, global_batch_gradients, gradients_rel_diff, randomize_, run_torchrun, train_losses

def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def three_layer_model() -> KimiK3ForCausalLM:
    """The tiny model with each kind of layer once (a dense KDA, a MoE KDA, a MoE MLA layer): a trace's time grows
    with the layer count, what it is tested for does not."""
    torch.manual_seed(0)
    config = KimiK3TextConfig.tiny(num_hidden_layers=3, linear_attn_config={"kda_layers": [1, 2], "full_attn_layers": [3]})
    return randomize_(KimiK3ForCausalLM(config).eval())


# The tiny model's ops are microseconds long: see the `one_thread` fixture in conftest.py.
pytestmark = pytest.mark.usefixtures("one_thread")


def learnable_sequences(count: int = 8, seed: int = 0, min_len: int = 9, max_len: int = 24) -> list[list[int]]:
    """Arithmetic progressions over a 40-token alphabet, of different lengths (so batches need padding): easy
    to learn, so a few steps move the loss a lot."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        start, step = (int(x) for x in torch.randint(0, 40, (2,), generator=gen))
        rows.append([3 + (start + (step % 5 + 1) * t) % 40 for t in range(length)])
    return rows


def training_args(tmp_path, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=3e-3, max_steps=10,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, seed=0, lr_scheduler_type="constant", weight_decay=0.0,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def per_token_losses(model, rows) -> tuple[torch.Tensor, int]:
    """Sum of next-token losses over ``rows`` run one by one (no padding) and the number of predictions."""
    total, count = 0.0, 0
    for row in rows:
        ids = torch.tensor([row])
        logits = model(ids).logits[0, :-1].float()
        total = total + torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
        count += len(row) - 1
    return total, count


# ================================================================ pipeline, chat template, thinking budget
@pytest.fixture(scope="module")
def train_tokenizer(tokenizer):
    """Right padding for training. (With the tokenizer's generation default, left padding,
    DataCollatorForLanguageModeling makes each row's first real token a target predicted from a pad token.)"""
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "right"
    return tok


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory, tokenizer):
    """The tiny model saved with the test tokenizer (K3 chat template + K3 response template) in one directory."""
    path = tmp_path_factory.mktemp("k3_chat")
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval(), seed=1)
    model.save_pretrained(path)
    tok = copy.deepcopy(tokenizer)
    tok.response_template = KIMI_K3_RESPONSE_TEMPLATE
    tok.save_pretrained(path)
    return path


def test_pipeline_chat_thinking_switch_and_budget(chat_model_dir):
    """pipeline("text-generation", model=dir) renders chat messages with the K3 template (the reasoning switch
    through `tokenizer_encode_kwargs`), generates exactly what `generate` does on that prompt, and returns the
    answer split into reasoning and content. The thinking budget closes the think channel after N tokens."""
    pipe = pipeline("text-generation", model=str(chat_model_dir))
    tok, model = pipe.tokenizer, pipe.model
    assert tok.response_template == KIMI_K3_RESPONSE_TEMPLATE
    messages = [{"role": "user", "content": "What is 2+2?"}]
    budget = 6
    end_ids = tok.encode(THINKING_END_SEQUENCE, add_special_tokens=False)
    assert len(end_ids) > 2  # multi-token markers: forced one token per step
    new_tokens = budget + len(end_ids) + 4

    def reference(template_kwargs, processors=None):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                      **template_kwargs)["input_ids"]
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, logits_processor=processors)
        prompt = tok.decode(ids[0], skip_special_tokens=False)
        return prompt, out[0, ids.shape[1]:], tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)

    cases = [
        ({}, True),                                # thinking on (the default)
        ({"thinking_effort": "high"}, True),       # effort level: a thinking-effort system message
        ({"thinking": False}, False),              # thinking off: the prompt pre-fills the response channel
    ]
    for template_kwargs, thinking in cases:
        processor = ThinkingBudgetLogitsProcessor(budget, tok)
        out = pipe(messages, max_new_tokens=new_tokens, do_sample=False,
                   logits_processor=LogitsProcessorList([processor]), tokenizer_encode_kwargs=template_kwargs)
        answer = out[0]["generated_text"][-1]
        prompt, new_ids, text = reference(template_kwargs, LogitsProcessorList([processor]))
        assert prompt.endswith(THINK_OPEN if thinking else "<|open|>response<|sep|>")
        assert ("thinking-effort" in prompt) == ("thinking_effort" in template_kwargs)
        assert answer == tok.parse_response(text, prefix=prompt), template_kwargs
        parsed = parse_kimi_k3_response(text, prompt=prompt)
        # (parse_kimi_k3_response also drops a marker cut off by max_new_tokens, which the flat template keeps)
        assert answer["content"].startswith(parsed.content) and parsed.content
        if thinking:
            # the random model never closes its thinking itself: the budget did, at exactly `budget` tokens
            assert new_ids[budget:budget + len(end_ids)].tolist() == end_ids
            assert answer["reasoning_content"] == parsed.reasoning == tok.decode(new_ids[:budget])
        else:
            assert "reasoning_content" not in answer and parsed.reasoning is None
            assert end_ids[0] not in new_ids.tolist()[:budget + 1]  # nothing forced without a think channel
    # without the processor the same model keeps thinking past the budget
    _, free_ids, _ = reference({})
    assert free_ids[budget:budget + len(end_ids)].tolist() != end_ids


# ================================================================ Trainer
def mean_loss(model, rows) -> float:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        total, count = per_token_losses(model, rows)
    model.train(was_training)
    return total.item() / count


def logged_losses(trainer) -> list[float]:
    return [round(entry["loss"], 3) for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_finetunes_with_padding_checkpointing_and_balancing(tmp_path, train_tokenizer):
    """Trainer on right-padded batches of different lengths (DataCollatorForLanguageModeling: labels = ids, -100
    on padding), with gradient checkpointing and the Quantile Balancing callback: the loss falls and the router
    biases move."""
    balancing = pytest.importorskip("transformers_k3.balancing")
    rows = learnable_sequences(16)
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny())
    before = mean_loss(model, rows)
    callback = balancing.QuantileBalancingCallback()
    trainer = Trainer(
        model=model, args=training_args(tmp_path, gradient_checkpointing=True, max_steps=12),
        train_dataset=[{"input_ids": r} for r in rows],
        data_collator=DataCollatorForLanguageModeling(train_tokenizer, mlm=False), callbacks=[callback],
    )
    trainer.train()
    after = mean_loss(model, rows)
    print(f"Trainer: mean loss {before:.3f} -> {after:.3f}; logged {logged_losses(trainer)}")
    assert model.model.gradient_checkpointing and model.model.layers[0].gradient_checkpointing
    logged = logged_losses(trainer)
    assert len(logged) == 12
    # measured: 6.26 -> 3.3 (held-in mean per-token loss) over 12 steps at lr 3e-3
    assert after < before - 2.0, (before, after, logged)
    assert any("moe/maxvio_max" in entry for entry in trainer.state.log_history)
    biases = [m.mlp.gate.e_score_correction_bias for m in model.model.layers[1:]]
    assert all(b.abs().sum() > 0 for b in biases)  # the callback updated every MoE layer's selection bias


def test_trainer_normalises_by_num_items_in_batch(tmp_path, train_tokenizer):
    """With gradient accumulation over micro-batches of very different token counts, the Trainer passes
    `num_items_in_batch` to the model, so one optimizer step follows the gradient of the mean loss over every
    target token of the whole batch (not the mean of per-micro-batch means). Checked with plain SGD, lr 1:
    the parameter change equals minus that gradient."""
    rows = [list(range(3, 5)), list(range(10, 14)), list(range(20, 44)), list(range(50, 72))]  # 1/3/23/21 targets
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()), std=0.05)
    reference = copy.deepcopy(model)
    total, count = per_token_losses(reference.train(), rows)
    (total / count).backward()
    # what a trainer that ignored num_items_in_batch would follow: the mean of the two micro-batch means
    naive = copy.deepcopy(model).train()
    (per_token_losses(naive, rows[:2])[0] / 4 / 2 + per_token_losses(naive, rows[2:])[0] / 44 / 2).backward()

    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = training_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
                         learning_rate=1.0, optim="sgd", max_grad_norm=0.0, train_sampling_strategy="sequential")
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r} for r in rows],
                      data_collator=DataCollatorForLanguageModeling(train_tokenizer, mlm=False))
    trainer.train()

    def flat_grad(m):
        return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in m.parameters()])

    want, wrong = flat_grad(reference), flat_grad(naive)
    got = torch.cat([(start[n] - p.detach()).flatten() for n, p in model.named_parameters()])
    print("num_items_in_batch: rel err", max_rel_err(got, want), "naive normalisation differs by", max_rel_err(wrong, want))
    assert max_rel_err(got, want) < 2e-5, max_rel_err(got, want)  # fp32, padded vs unpadded rows: ~1.4e-6
    assert max_rel_err(wrong, want) > 0.1  # the check can tell the two normalisations apart


def test_trainer_resume_from_checkpoint_restores_the_experts(tmp_path, train_tokenizer):
    """A checkpoint holds the experts per expert (the official layout save_pretrained writes for a model built from a
    config) and the Trainer restores it with a plain load_state_dict: the experts' pre-hook fuses them, so a run
    resumed on a freshly initialised model ends with the uninterrupted run's weights and selection biases (the
    experts kept their random init before, with only a missing / unexpected keys warning)."""
    from transformers_k3 import QuantileBalancingCallback

    rows = learnable_sequences(16, seed=5)
    collate = DataCollatorForLanguageModeling(train_tokenizer, mlm=False)

    def run(output, seed, resume=None):
        torch.manual_seed(seed)
        model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()), std=0.05, seed=seed)
        args = training_args(tmp_path, output_dir=str(tmp_path / output), per_device_train_batch_size=4,
                             max_steps=4, save_strategy="steps", save_steps=2, train_sampling_strategy="sequential")
        Trainer(model=model, args=args, train_dataset=[{"input_ids": r} for r in rows], data_collator=collate,
                callbacks=[QuantileBalancingCallback()]).train(resume_from_checkpoint=resume)
        return model

    whole = run("whole", seed=0)
    resumed = run("resumed", seed=1, resume=str(tmp_path / "whole" / "checkpoint-2"))
    want = whole.state_dict()
    for name, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_trainer_aux_loss_under_gradient_accumulation_is_a_token_weighted_mean(tmp_path, train_tokenizer):
    """With router_aux_loss_coef > 0 and gradient accumulation, one optimizer step follows the gradient of the mean
    token loss over the whole batch plus coef x the token-weighted mean of the micro-batches' aux losses (each aux
    loss a mean over its own micro-batch). It was their sum: the aux term grew with the accumulation steps. Checked
    with plain SGD, lr 1, against losses computed without the Trainer."""
    rows = [list(range(3, 5)), list(range(10, 14)), list(range(20, 44)), list(range(50, 72))]  # 1/3/23/21 targets
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny(router_aux_loss_coef=0.5)), std=0.05)
    collate = DataCollatorForLanguageModeling(train_tokenizer, mlm=False)
    reference = copy.deepcopy(model).train()
    count = sum(len(r) - 1 for r in rows)
    total = 0.0
    for micro in (rows[:2], rows[2:]):
        batch = collate([{"input_ids": r} for r in micro])
        out = reference(**batch)
        targets = sum(len(r) - 1 for r in micro)
        ce = out.loss - 0.5 * out.aux_loss  # (the model's plain-call loss: mean CE + coef x aux)
        total = total + ce * targets / count + 0.5 * out.aux_loss * targets / count
    total.backward()

    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = training_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
                         learning_rate=1.0, optim="sgd", max_grad_norm=0.0, train_sampling_strategy="sequential")
    Trainer(model=model, args=args, train_dataset=[{"input_ids": r} for r in rows], data_collator=collate).train()
    router = [n for n, _ in model.named_parameters() if n.endswith("gate.weight")]
    got = torch.cat([(start[n] - p.detach()).flatten() for n, p in model.named_parameters() if n in router])
    want = torch.cat([p.grad.flatten() for n, p in reference.named_parameters() if n in router])
    assert max_rel_err(got, want) < 2e-5, max_rel_err(got, want)


# ================================================================ packed sequences
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_batch_loss_and_gradients_equal_padded_batch(train_tokenizer, flash_kwargs):
    """DataCollatorWithFlattening packs a batch into one row (position_ids restart at 0, optionally cu_seq_lens);
    KDA state and conv windows restart and MLA stays inside each sequence, so the packed batch's loss and
    gradients equal those of the same sequences right-padded. Tolerance: 1e-5 relative on the loss, 1e-4 on the
    gradients (fp32; measured 0 and 8e-7). The packed row (~120 tokens) crosses the 64-token KDA chunk."""
    rows = learnable_sequences(5, seed=3, min_len=9, max_len=40)
    features = [{"input_ids": r} for r in rows]
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(features)
    padded = DataCollatorForLanguageModeling(train_tokenizer, mlm=False)(features)
    assert packed["input_ids"].shape == (1, sum(map(len, rows))) and "attention_mask" not in packed
    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).train(), std=0.05)
    twin = copy.deepcopy(model)
    loss_packed = model(**packed).loss
    loss_padded = twin(**padded).loss
    loss_packed.backward()
    loss_padded.backward()
    rel = abs(loss_packed.item() - loss_padded.item()) / loss_padded.item()
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()) if q.grad is not None]
    grad_err = max_rel_err(torch.cat([g.flatten() for g, _ in grads]), torch.cat([g.flatten() for _, g in grads]))
    print(f"packed vs padded: loss {loss_packed.item():.6f} vs {loss_padded.item():.6f} (rel {rel:.1e}), "
          f"gradients rel {grad_err:.1e}")
    assert rel < 1e-5
    assert grad_err < 1e-4
    # and a cross-contaminated packing (no boundaries) is measurably different
    with torch.no_grad():
        leaked = model(input_ids=packed["input_ids"], labels=packed["labels"]).loss
    assert abs(leaked.item() - loss_packed.item()) > 1e-3


def test_trainer_with_flattening_collator(tmp_path):
    """Padding-free training through the Trainer: the loss falls."""
    rows = learnable_sequences(16)
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny())
    before = mean_loss(model, rows)
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=8),
                      train_dataset=[{"input_ids": r} for r in rows], data_collator=DataCollatorWithFlattening())
    trainer.train()
    after = mean_loss(model, rows)
    print(f"Trainer + DataCollatorWithFlattening: mean loss {before:.3f} -> {after:.3f}; logged {logged_losses(trainer)}")
    assert after < before - 1.0


# ================================================================ PEFT
KDA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # o_proj also names the MLA output projection
MLA_PROJECTIONS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def incremental_logits(model, ids, prefill: int) -> torch.Tensor:
    """Logits of a prefill then one-token decode steps through the hybrid cache (absorbed MLA decode)."""
    cache = KimiK3HybridCache(model.config)
    outs = [model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
    for t in range(prefill, ids.shape[1]):
        outs.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(outs, dim=1)


def test_lora_on_attention_and_experts_save_load_merge(tmp_path):
    """LoRA on every KDA and MLA projection and, through `target_parameters`, on the fused 3-D expert weights:
    the adapters change the logits, a saved adapter reloads onto a fresh base bit for bit, cached decoding with
    the unmerged adapters equals the full forward, and merging keeps the logits (5e-5 relative, fp32)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval())
    pristine = copy.deepcopy(base)
    ids = torch.randint(3, 512, (2, 14))
    with torch.no_grad():
        base_logits = base(ids).logits
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=sorted(set(KDA_PROJECTIONS + MLA_PROJECTIONS)),
                             target_parameters=EXPERT_PARAMETERS, init_lora_weights=False)
    model = peft.get_peft_model(base, config).eval()
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_modules() if n.endswith("lora_A")}
    text = model.base_model.model.model
    for i, layer in enumerate(text.layers):
        names = KDA_PROJECTIONS if layer.layer_type == "linear_attention" else MLA_PROJECTIONS
        for name in names:
            assert any(w.endswith(f"layers.{i}.self_attn.{name}") for w in wrapped), (i, name)
        if i >= 1:  # MoE layers
            assert any(f"layers.{i}.mlp.experts" in w for w in wrapped), i
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    with torch.no_grad():
        lora_logits = model(ids).logits
        assert max_rel_err(lora_logits, base_logits) > 1e-2  # the adapters do something
        with model.disable_adapter():
            assert torch.equal(model(ids).logits, base_logits)
        # decode through the cache with unmerged adapters (MLA falls back from weight absorption)
        assert max_rel_err(incremental_logits(model, ids, prefill=9), lora_logits) < 1e-5

    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(pristine), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, lora_logits)

    merged = model.merge_and_unload().eval()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        merged_logits = merged(ids).logits
        err = max_rel_err(merged_logits, lora_logits)
        print(f"LoRA merged vs unmerged: rel {err:.1e}")
        assert err < 5e-5  # W + BA rounded once vs x(W) + (xA)B: ~1e-5 measured
        assert max_rel_err(incremental_logits(merged, ids, prefill=9), merged_logits) < 1e-5


def test_lora_with_quantile_balancing_keeps_the_selection_biases(tmp_path, train_tokenizer):
    """The selection biases Quantile Balancing trains are base-model buffers that a PEFT adapter does not carry: the
    callback writes them into every checkpoint and a resumed LoRA run reads them back (it ends with the
    uninterrupted run's biases and adapters), and save_router_biases / load_router_biases carry them next to a
    saved adapter (a fresh base with both gives the trained model's logits)."""
    peft = pytest.importorskip("peft")
    from transformers_k3 import QuantileBalancingCallback, load_router_biases, save_router_biases

    rows = learnable_sequences(16, seed=6)
    collate = DataCollatorForLanguageModeling(train_tokenizer, mlm=False)

    def lora_model():
        torch.manual_seed(0)
        base = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()), std=0.05)
        return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=KDA_PROJECTIONS))

    def run(output, resume=None):
        model = lora_model()
        args = training_args(tmp_path, output_dir=str(tmp_path / output), max_steps=4, save_strategy="steps",
                             save_steps=2, train_sampling_strategy="sequential")
        Trainer(model=model, args=args, train_dataset=[{"input_ids": r} for r in rows], data_collator=collate,
                callbacks=[QuantileBalancingCallback()]).train(resume_from_checkpoint=resume)
        return model

    whole = run("whole")
    biases = [m.e_score_correction_bias for m in whole.modules() if hasattr(m, "e_score_correction_bias")]
    assert all(b.abs().sum() > 0 for b in biases)
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = run("resumed", resume=True)  # (the last checkpoint of its output directory)
    want = whole.state_dict()
    for name, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, want[name]), name

    whole.save_pretrained(tmp_path / "adapter")
    save_router_biases(whole, tmp_path / "adapter" / "router_biases.safetensors")
    fresh = peft.PeftModel.from_pretrained(lora_model().base_model.model, tmp_path / "adapter")
    load_router_biases(fresh, tmp_path / "adapter" / "router_biases.safetensors")
    ids = torch.randint(3, 512, (2, 12))
    with torch.no_grad():
        assert torch.equal(fresh.eval()(ids).logits, whole.eval()(ids).logits)
    with pytest.raises(ValueError, match="not this model's"):
        load_router_biases(KimiK3ForCausalLM(KimiK3TextConfig.tiny(num_hidden_layers=3, linear_attn_config={
            "kda_layers": [1, 2], "full_attn_layers": [3]})), tmp_path / "adapter" / "router_biases.safetensors")


def test_lora_on_experts_alone_changes_the_output_and_trains():
    """`target_parameters` on the fused experts only: their adapter alone moves the logits, and a few AdamW steps
    on the adapters (everything else frozen) lower the loss."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()))
    ids = torch.randint(3, 512, (2, 16))
    with torch.no_grad():
        base_logits = base.eval()(ids).logits
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_parameters=EXPERT_PARAMETERS,
                                                      target_modules=[], init_lora_weights=False))
    with torch.no_grad():
        assert max_rel_err(model.eval()(ids).logits, base_logits) > 1e-3
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    losses = train_losses(model, ids, torch.optim.AdamW(params, lr=1e-2), steps=6)
    print("LoRA (experts only) losses:", [round(x, 3) for x in losses])
    assert losses[-1] < losses[0] - 0.05


def bnb_cpu_skip_list(model) -> list[str]:
    """Linear layers bitsandbytes' CPU 4-bit kernel cannot hold: it packs weights in blocks of 32 output rows and
    64 input columns (`_convert_weight_packed_for_cpu`). On the tiny config these are the narrow projections
    (b_proj, f_a/f_b_proj, kv_a_proj_with_mqa, the latent-MoE up projection, ...); at full size none (the AttnRes
    pseudo-queries are parameters of their read, not linear layers). The LM head stays unquantized too."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and (module.in_features % 64 or module.out_features % 32)]


def test_qlora_skip_list_extends_the_users_and_covers_full_size(tmp_path):
    """A user's own llm_int8_skip_modules is extended, not replaced; at full size (meta device: no memory) every
    linear layer packs, and the config is left as given."""
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    from transformers_k3.conversion.release_format import _narrow_for_bnb_4bit

    mine = BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["model.layers.0.self_attn.q_proj"])
    got = _narrow_for_bnb_4bit(KimiK3ForCausalLM, None, mine, {"config": KimiK3TextConfig.tiny()})
    assert "model.layers.0.self_attn.q_proj" in got.llm_int8_skip_modules and "lm_head" not in got.llm_int8_skip_modules
    assert any(name.endswith("b_proj") for name in got.llm_int8_skip_modules)
    given = BitsAndBytesConfig(load_in_4bit=True)
    full = _narrow_for_bnb_4bit(KimiK3ForCausalLM, None, given, {"config": KimiK3TextConfig()})
    with torch.device("meta"):
        skeleton = KimiK3ForCausalLM(KimiK3TextConfig())
    assert not bnb_cpu_skip_list(skeleton) and full is given


def test_qlora_4bit_on_cpu(tmp_path):
    """QLoRA: the model loads in bitsandbytes NF4 on CPU; its logits equal an fp32 model holding the dequantized
    weights (1e-5 relative), LoRA adapters on the attention projections of the 4-bit model train (loss falls),
    and cached decoding agrees with the full forward (2e-2 relative: the eval-mode CPU kernel computes in bf16)."""
    bnb = pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    from transformers import BitsAndBytesConfig

    torch.manual_seed(0)
    base = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval(), std=0.05)
    base.save_pretrained(tmp_path / "fp32")
    # no skip list: from_pretrained keeps the layers bitsandbytes' CPU kernel cannot pack out of 4-bit by itself
    quant_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", quantization_config=quant_config,
                                                 device_map="cpu").eval()
    assert quant_config.llm_int8_skip_modules is None  # (the caller's object is left alone)
    skipped = set(model.config.quantization_config.llm_int8_skip_modules)
    assert skipped == set(bnb_cpu_skip_list(base)) | {"lm_head"}
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert "model.layers.0.self_attn.q_proj" in quantized and "model.layers.2.self_attn.q_a_proj" in quantized
    assert len(quantized) >= 30
    # the fp32 twin with the dequantized NF4 weights (taken before the first forward repacks them for the CPU kernel)
    twin = copy.deepcopy(base)
    with torch.no_grad():
        for name, module in quantized.items():
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            twin.get_submodule(name).weight.copy_(weight.float())
    ids = torch.randint(3, 512, (2, 16))
    with torch.no_grad():
        # training mode: bitsandbytes dequantizes and multiplies in fp32 (its eval-mode CPU kernel works in bf16,
        # and on a random model bf16 rounding flips some top-k expert choices, which moves the logits a lot)
        err = max_rel_err(model.train()(ids).logits, twin(ids).logits)
    print(f"QLoRA: 4-bit logits vs dequantized fp32 twin: rel {err:.1e}")
    assert err < 1e-5

    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16,
                                                       target_modules=sorted(set(KDA_PROJECTIONS + MLA_PROJECTIONS))))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    model.train()
    losses = train_losses(model, ids, optimizer, steps=8)
    print("QLoRA losses:", [round(x, 3) for x in losses])
    assert losses[-1] < losses[0] - 0.3
    model.eval()
    with torch.no_grad():
        full = model(ids).logits
        assert max_rel_err(incremental_logits(model, ids, prefill=11), full) < 2e-2


# ================================================================ accelerate
def test_device_map_auto_with_cpu_and_disk_offload(tmp_path):
    """from_pretrained(device_map="auto") with max_memory below the model size: some decoder layers stay in CPU
    memory, the rest are offloaded to disk; no decoder layer is split (`_no_split_modules`), and the logits and
    greedy tokens equal the in-memory model's exactly. (K3 reads a few child weights without calling the child:
    transformers' `force_accelerate_hooks` on those modules makes accelerate load them; this test fails without it.)"""
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    base = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval())
    base.save_pretrained(tmp_path / "model")
    size = sum(p.numel() * p.element_size() for p in base.parameters())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map="auto",
                                                 max_memory={"cpu": size // 2},
                                                 offload_folder=str(tmp_path / "offload")).eval()
    device_map = model.hf_device_map
    assert {"cpu", "disk"} <= set(device_map.values()), device_map
    assert any(name.startswith("model.layers.") and device == "disk" for name, device in device_map.items())
    for name in device_map:  # decoder layers are placed whole
        assert name.count(".") <= 2 or not name.startswith("model.layers."), name
    assert any(p.device.type == "meta" for p in model.parameters())  # really offloaded
    ids = torch.randint(3, 512, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base(ids).logits)
    kwargs = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), base.generate(ids, **kwargs))  # absorbed MLA decode too


def test_no_split_modules_keep_decoder_layers_whole():
    """accelerate's planner with two small devices: every decoder layer lands on one device, the KDA / MLA / MoE
    parts of a layer never on different ones."""
    accelerate = pytest.importorskip("accelerate")
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny())
    assert set(model._no_split_modules) == {"KimiK3DecoderLayer"}
    layer_size = sum(p.numel() * p.element_size() for p in model.model.layers[1].parameters())
    budget = {0: int(layer_size * 1.6), 1: int(layer_size * 1.6), "cpu": 10 * layer_size}
    device_map = accelerate.infer_auto_device_map(model, max_memory=budget,
                                                  no_split_module_classes=list(model._no_split_modules))
    layer_devices = {name: device for name, device in device_map.items() if name.startswith("model.layers.")}
    assert set(layer_devices) == {f"model.layers.{i}" for i in range(6)}, device_map
    assert len(set(layer_devices.values())) >= 2  # the budget did force a split between layers


# ================================================================ distributed (2 processes)
def test_a_batch_split_in_two_trains_like_the_whole_batch():
    """The distributed tests' premise, in one process: at their lr, two halves of the global batch backpropagated
    one after the other (the same gradient, summed in another order) give the whole batch's AdamW losses to fp32
    rounding (1e-5 relative). A distributed test failing while this passes is the engine's, not the summation order's
    (docs/correctness.md, "Training trajectories")."""
    torch.manual_seed(0)
    whole = adamw_losses(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).train())
    torch.manual_seed(0)
    halves = adamw_losses(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).train(), parts=2)
    assert whole[-1] < whole[0] - 0.5
    assert halves == pytest.approx(whole, rel=1e-5)


@pytest.mark.distributed
def test_ddp_and_fsdp2_on_two_cpu_processes(tmp_path):
    """torchrun, 2 CPU processes, gloo: DDP through accelerate and FSDP2 (torch `fully_shard` per decoder layer, as
    accelerate's FSDP2 path does; accelerate does not run FSDP on CPU, see _distributed_worker.py) each train 3
    AdamW steps on half of a global batch per rank. The first step's gradients, gathered whole, equal single-process
    gradients on the whole batch (1e-5 of each parameter's largest entry), and the per-step global loss equals
    single-process training on the whole batch (1e-5 relative). FSDP2 with bf16 compute follows it to bf16 accuracy
    with the fused CPU kernels attached. ~25 s, mostly two Python start-ups."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")
    result = run_torchrun("_distributed_worker.py", tmp_path, timeout=240)
    assert result["distributed_type"].endswith("MULTI_CPU") and result["ddp_wrapper"] == "DistributedDataParallel"
    assert abs(result["fsdp_local_fraction"] - 0.5) < 0.01  # parameters really sharded over the 2 ranks

    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).train()
    grads = global_batch_gradients(model)
    single = adamw_losses(model)
    print("single", single, "ddp", result["ddp"], "fsdp2", result["fsdp2"])
    assert single[-1] < single[0] - 0.5
    for engine in ("ddp", "fsdp2"):
        worst, name = gradients_rel_diff(torch.load(tmp_path / f"{engine}_grads.pt"), grads)
        print(engine, "first-step gradients:", worst, name)
        assert worst <= 1e-5, (engine, worst, name)
        assert result[engine] == pytest.approx(single, rel=1e-5), engine
    # bf16 compute with the fused kernels attached (`kernelize`): the same training to bf16 accuracy
    print("fsdp2_bf16", result["fsdp2_bf16"])
    assert result["fsdp2_bf16"] == pytest.approx(single, rel=2e-2)


# ================================================================ torch.compile
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_model_runs_the_kernels_in_its_graph(dtype):
    """torch.compile(model, fullgraph=True) (a graph break would raise) over a prefill and decode steps through the
    hybrid cache runs the fused CPU kernels inside its graphs, as operators traced through their fake
    implementations: the graphs hold ``torch.ops.transformers_k3`` calls (chunked KDA, the MoE decode step, the
    experts, the router, the GLU; in bf16 the small products too), the logits equal eager's with the same kernels
    bitwise, and the cache's growth recompiles nothing (one graph for the prefill, one for the steps)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters
    from functorch.compile import make_boxed_func

    if cpu_kernel.library() is None:
        pytest.skip("the CPU kernels are not built here")
    torch.manual_seed(0)
    # built in its dtype as a load builds it (the selection bias fp32: what the fused MoE decode takes)
    model = kernelize(randomize_(AutoModelForCausalLM.from_config(KimiK3TextConfig.tiny(), dtype=dtype).eval()))
    ids = torch.randint(3, 512, (2, 15))
    in_graph: set[str] = set()

    def record(gm, example_inputs):  # (after AOTAutograd's functionalization: what actually runs)
        for node in gm.graph.nodes:
            if node.op == "call_function":
                # (an operator that writes an input, the KDA state, is wrapped in auto_functionalized)
                target = node.args[0] if "auto_functionalized" in str(node.target) else node.target
                if str(target).startswith("transformers_k3."):
                    in_graph.add(str(target))
        return make_boxed_func(gm.forward)

    def run(fn) -> torch.Tensor:
        cache = KimiK3HybridCache(model.config)
        outs = [fn(ids[:, :10], past_key_values=cache, use_cache=True).logits]
        for t in range(10, ids.shape[1]):
            outs.append(fn(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        return torch.cat(outs, dim=1)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=record), fullgraph=True, dynamic=True)
    with torch.no_grad():
        want = run(model)
        got = run(compiled)
    assert torch.equal(got, want)
    expected = {"kda_chunk_forward", "moe_decode", "moe_experts", "router_sigmoid_topk", "latent_attention"}
    if cpu_kernel._feature("small_gemm_available"):
        expected.add("glu")
    if dtype is torch.bfloat16 and cpu_kernel._feature("linear_bf16_available"):
        expected.add("linear_bf16")
    assert expected <= {name.split(".")[1] for name in in_graph}, in_graph
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_chunked_prefill_compiles_once_for_every_later_chunk():
    """A prefill in chunks of more than 16 tokens after cached ones (MLA's blockwise attention over the cached
    context) under torch.compile(fullgraph=True, dynamic=True): the same logits as eager, one graph for the first
    chunk and one for every chunk after it (the context blocks' loop is guarded on its count, not the length)."""
    from torch._dynamo.utils import counters

    model = three_layer_model()
    ids = torch.randint(3, 512, (1, 100))

    def run(fn) -> torch.Tensor:
        cache = KimiK3HybridCache(model.config)
        return torch.cat([fn(ids[:, s:s + 20].clone(), past_key_values=cache, use_cache=True).logits
                          for s in range(0, ids.shape[1], 20)], dim=1)  # fmt: skip

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        want = run(model)
        got = run(compiled)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_short_prefill_with_the_kernels_off():
    """A prefill shorter than one KDA chunk (10 tokens: the chunk is padded to a size the graph holds as a symbol)
    compiled with fullgraph=True, dynamic=True and the CPU kernels off: it traces (the sub-chunk rows of the PyTorch
    chunked KDA are re-laid out where a view cannot express them) and gives eager's logits and cached state up to
    fp32 rounding (the graph factors the sub-chunks' decays on the K3 layer's promise that its gates lie in [-5, 0),
    where eager checks their span)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval())
    ids = torch.randint(3, 512, (2, 10))

    def prefill(fn):
        cache = KimiK3HybridCache(model.config)
        return fn(ids, past_key_values=cache, use_cache=True).logits, cache

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        want, want_cache = prefill(model)
        got, got_cache = prefill(compiled)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    kda_layer = model.config.layer_types.index("linear_attention")
    torch.testing.assert_close(got_cache.layers[kda_layer].recurrent_state,
                               want_cache.layers[kda_layer].recurrent_state, rtol=0, atol=1e-5)  # fmt: skip
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_decode_step_equals_eager():
    """torch.compile (fullgraph=False, dynamic shapes, the aot_eager backend: dynamo capture plus AOTAutograd's
    functionalization of the in-place cache updates, without inductor's minutes of C++ codegen on a loaded CPU)
    of the decode step through the hybrid cache: identical logits to eager over 5 steps, one graph, no graph
    break, no recompilation as the cache grows. bench/bench_compile.py runs inductor and prints explain()."""
    from torch._dynamo.utils import counters

    model = three_layer_model()
    ids = torch.randint(3, 512, (2, 15))

    def decode(step_fn) -> torch.Tensor:
        cache = KimiK3HybridCache(model.config)
        outs = [model(ids[:, :10], past_key_values=cache, use_cache=True).logits]  # eager prefill
        for t in range(10, ids.shape[1]):
            outs.append(step_fn(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        return torch.cat(outs, dim=1)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=False, dynamic=True)
    with torch.no_grad():
        fused = decode(kernelize(model))  # eager prefill and steps run the fused CPU kernels
        # Without them, the graph and eager run the same PyTorch ops, the eager prefill included (the
        # kernels inside a graph: test_compiled_model_runs_the_kernels_in_its_graph).
        kernelize(model, False)
        want = decode(model)
        got = decode(compiled)
    print("torch.compile decode:", dict(counters["stats"]), "graph breaks:", dict(counters["graph_break"]))
    assert torch.equal(got, want)
    torch.testing.assert_close(fused, want, atol=1e-5, rtol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    # The prefill compiles too (fullgraph: a break raises), kernels off: the PyTorch chunked KDA in a graph cannot
    # check the gate's span, it takes the layer's bound on the gate instead; the same function up to fp32 rounding.
    torch._dynamo.reset()
    prompt = torch.randint(3, 512, (2, 80))  # (more than one 64-token chunk)
    prefill = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        want = model(prompt, past_key_values=KimiK3HybridCache(model.config), use_cache=True).logits
        got = prefill(prompt, past_key_values=KimiK3HybridCache(model.config), use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()
