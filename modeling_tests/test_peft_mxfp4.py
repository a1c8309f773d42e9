"""LoRA over the packed MXFP4 routed experts (`transformers_k3.peft_mxfp4`, issue 46) and accelerate's sizing and
offload of packed experts, on the official-layout MXFP4 fixture (references.py):

* the packed model with per-expert adapters computes what PEFT's own ``target_parameters`` LoRA (`ParamWrapper`)
  computes on the dequantized model with the same adapter values (logits and gradients, fp32);
* gradients reach the adapters and the inputs, the packed bytes stay frozen, Quantile Balancing still moves the
  router biases, a short LoRA run lowers the loss;
* ``save_pretrained`` -> ``PeftModel.from_pretrained`` into a fresh packed model gives the same logits;
* merging re-quantizes by the release's rule (the bytes `quantize_mxfp4_release` gives for PEFT's merged dequantized
  weights) and warns; unmerging restores the loaded bytes;
* over experts streamed from disk (``stream_experts=True``) the same adapters compute the packed model's logits and
  gradients, a run lowers the loss and its adapter reloads into a packed model; merging there is refused by name;
* ``infer_auto_device_map`` sizes packed experts by their bytes (the packed model fits where the bf16 one does
  not); cpu and disk offload move the uint8 stacks and the experts compute on them.
"""

import shutil

import pytest
import torch

import transformers_k3  # noqa: F401  (registers the classes, mappings and the quantizer)
from transformers_k3 import KimiK3ForCausalLM, KimiK3Mxfp4Config, KimiK3TextConfig
from transformers_k3.conversion.quant import dequantize_mxfp4, quantize_mxfp4_release

from references import BF16, FP32, load, release_state, train_losses, write_release

peft = pytest.importorskip("peft")
accelerate = pytest.importorskip("accelerate")
from transformers_k3.peft_mxfp4 import PackedExpertsLoraLayer, PackedMergeWarning, packed_experts_lora  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(3, 500, (2, 14), generator=torch.Generator().manual_seed(0))
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
SHARED_AND_LATENT = ["gate_proj", "up_proj", "down_proj", "routed_expert_down_proj", "routed_expert_up_proj"]
MOE_LAYERS = range(1, 6)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    config = KimiK3TextConfig.tiny()
    return write_release(tmp_path_factory.mktemp("release") / "text_mxfp4", release_state(config, False, True, 1),
                         config, False, True)  # fmt: skip


def packed(release, dtype=FP32):
    return load(KimiK3ForCausalLM, release, dtype=dtype)


def lora(model, **kwargs):
    torch.manual_seed(0)
    config = dict(r=4, lora_alpha=8, target_modules=["experts"], init_lora_weights=False)
    return peft.get_peft_model(model, packed_experts_lora(peft.LoraConfig(**{**config, **kwargs})))


def expert_layers(model):
    return [m for m in model.modules() if isinstance(m, PackedExpertsLoraLayer)]


def packed_stacks(model) -> dict[str, torch.Tensor]:
    """Every MoE layer's four packed stacks (frozen uint8 parameters) by name."""
    stacks = {n: p for n, p in model.named_parameters()
              if n.rsplit(".", 1)[-1] in ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale")}  # fmt: skip
    assert len(stacks) == 4 * len(MOE_LAYERS), sorted(stacks)
    return stacks


def test_matches_peft_target_parameters_on_the_dequantized_experts(release):
    """Same adapter values, two routes: ours beside the packed matmul, PEFT's `ParamWrapper` adding ``B @ A`` to the
    dequantized bf16-layout weights. Logits within 1e-5, every adapter gradient and the input gradient within 1e-4."""
    ours = lora(packed(release))
    reference = load(KimiK3ForCausalLM, release, dtype=FP32, quantization_config=KimiK3Mxfp4Config(dequantize=True))
    reference = peft.get_peft_model(reference, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=[], init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))  # fmt: skip
    pairs = []
    for layer in MOE_LAYERS:
        mine = ours.base_model.model.model.layers[layer].mlp.experts
        wrappers = {m.parameter_name: m for m in reference.base_model.model.model.layers[layer].mlp.modules()
                    if isinstance(m, peft.tuners.lora.ParamWrapper)}  # fmt: skip
        pairs += [(mine.lora_A, wrappers["gate_up_proj"].lora_A), (mine.lora_B, wrappers["gate_up_proj"].lora_B),
                  (mine.lora_down_A, wrappers["down_proj"].lora_A), (mine.lora_down_B, wrappers["down_proj"].lora_B)]
    with torch.no_grad():
        for a, b in pairs:
            assert a["default"].weight.shape == b["default"].weight.shape
            b["default"].weight.copy_(a["default"].weight)
    grads = []
    for model in (ours, reference):
        embeds = model.get_input_embeddings()(IDS).detach().requires_grad_()
        out = model(inputs_embeds=embeds).logits
        out.pow(2).mean().backward()
        grads.append((out.detach(), embeds.grad))
    assert rel(grads[0][0], grads[1][0]) < 1e-5
    assert rel(grads[0][1], grads[1][1]) < 1e-4
    for a, b in pairs:
        assert a["default"].weight.grad.abs().max() > 0
        assert rel(a["default"].weight.grad, b["default"].weight.grad) < 1e-4


def test_gradients_reach_adapters_and_inputs_and_the_packed_bytes_stay(release):
    """LoRA on attention, shared experts, latent projections and the packed routed experts together."""
    model = lora(packed(release), target_modules=["experts", *ATTENTION, *SHARED_AND_LATENT])
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_modules() if n.endswith("lora_A")}
    for name in ("mlp.experts", "mlp.shared_experts.gate_proj", "mlp.shared_experts.down_proj",
                 "mlp.routed_expert_down_proj", "mlp.routed_expert_up_proj", "self_attn.o_proj"):  # fmt: skip
        assert any(w.endswith(f"layers.1.{name}") for w in wrapped), name
    before = {n: b.clone() for n, b in packed_stacks(model).items()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".experts.")[1].split(".")[0] for n in trainable if ".experts." in n} == {
        "lora_A", "lora_B", "lora_down_A", "lora_down_B"}
    embeds = model.get_input_embeddings()(IDS).detach().requires_grad_()
    model(inputs_embeds=embeds, labels=IDS).loss.backward()
    assert embeds.grad.abs().max() > 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().max() > 0, name
    for name, b in packed_stacks(model).items():
        assert b.dtype == torch.uint8 and not b.requires_grad and b.grad is None and torch.equal(b, before[name]), name
    with torch.no_grad(), model.disable_adapter():  # (B starts at zero only with init_lora_weights=True)
        assert torch.equal(model(IDS).logits, packed(release)(IDS).logits)


def test_default_init_leaves_the_logits(release):
    model = lora(packed(release), init_lora_weights=True)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, packed(release)(IDS).logits)


def test_save_and_reload_into_a_fresh_packed_model(release, tmp_path):
    model = lora(packed(release), target_modules=["experts", *ATTENTION]).eval()
    with torch.no_grad():
        want = model(IDS).logits
    model.save_pretrained(tmp_path / "adapter")
    saved = peft.utils.load_peft_weights(str(tmp_path / "adapter"))
    assert {k for k in saved if ".layers.1.mlp.experts." in k} == {
        f"base_model.model.model.layers.1.mlp.experts.{n}.weight" for n in ("lora_A", "lora_B", "lora_down_A",
                                                                             "lora_down_B")}  # fmt: skip
    for low_cpu_mem_usage in (False, True):
        config = packed_experts_lora(peft.LoraConfig.from_pretrained(tmp_path / "adapter"))
        fresh = peft.PeftModel.from_pretrained(packed(release), tmp_path / "adapter", config=config,
                                               low_cpu_mem_usage=low_cpu_mem_usage).eval()  # fmt: skip
        with torch.no_grad():
            assert torch.equal(fresh(IDS).logits, want)
    base = packed(release)  # transformers' own adapter API takes the same config
    base.load_adapter(tmp_path / "adapter", peft_config=packed_experts_lora(peft.LoraConfig.from_pretrained(
        tmp_path / "adapter")))  # fmt: skip
    with torch.no_grad():
        assert torch.equal(base(IDS).logits, want)


def test_short_lora_run_lowers_the_loss_and_quantile_balancing_trains(release):
    from transformers_k3 import RouterBalancer

    model = lora(packed(release), target_modules=["experts", *ATTENTION], init_lora_weights=True).train()
    balancer = RouterBalancer(model)
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rows = torch.arange(3, 43).repeat(2, 1)  # (a learnable progression)
    losses = train_losses(model, rows, optimizer, 8, after_step=balancer.step)
    print("LoRA over packed experts, losses:", [round(x, 3) for x in losses])
    assert losses[-1] < losses[0] - 0.5
    for name, bias in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            assert not torch.equal(bias, biases[name]), name


def test_merge_requantizes_by_the_release_rule_and_warns(release):
    """The merged bytes are the release's rounding of PEFT's own merge of the same adapter into the dequantized
    experts (`ParamWrapper`); unmerging gives the loaded bytes back."""
    model = lora(packed(release))
    original = {n: b.clone() for n, b in packed_stacks(model).items()}
    reference = load(KimiK3ForCausalLM, release, dtype=FP32, quantization_config=KimiK3Mxfp4Config(dequantize=True))
    reference = peft.get_peft_model(reference, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=[], init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))  # fmt: skip
    with torch.no_grad():
        for layer in MOE_LAYERS:
            mine = model.base_model.model.model.layers[layer].mlp.experts
            for m in reference.base_model.model.model.layers[layer].mlp.modules():
                if isinstance(m, peft.tuners.lora.ParamWrapper):
                    a, b = (mine.lora_A, mine.lora_B) if m.parameter_name == "gate_up_proj" else (mine.lora_down_A,
                                                                                                  mine.lora_down_B)
                    m.lora_A["default"].weight.copy_(a["default"].weight)
                    m.lora_B["default"].weight.copy_(b["default"].weight)
    merged_reference = reference.merge_and_unload()

    with pytest.warns(PackedMergeWarning, match=r"layers\.1\.mlp\.experts.*\['default'\].*rounded to MXFP4.*bytes changed"):
        model.merge_adapter()
    layer = expert_layers(model)[0]
    assert layer.merged
    changed = 0
    for i in MOE_LAYERS:
        experts = model.base_model.model.model.layers[i].mlp.experts.base_layer
        weights = merged_reference.model.layers[i].mlp.experts
        for e in range(experts.num_experts):
            for packed_name, scale_name, weight in (("gate_up_packed", "gate_up_scale", weights.gate_up_proj),
                                                    ("down_packed", "down_scale", weights.down_proj)):  # fmt: skip
                want_packed, want_scale = quantize_mxfp4_release(weight[e])
                got_packed, got_scale = getattr(experts, packed_name)[e], getattr(experts, scale_name)[e]
                assert torch.equal(got_packed, want_packed) and torch.equal(got_scale, want_scale), (i, e)
                old = original[f"base_model.model.model.layers.{i}.mlp.experts.base_layer.{packed_name}"][e]
                changed += int((got_packed != old).sum())
    assert changed > 0
    with torch.no_grad():  # merged: the base computes the rounded sum (what the warning says differs)
        merged_logits = model(IDS).logits
    model.unmerge_adapter()
    for name, b in packed_stacks(model).items():
        assert torch.equal(b, original[name]), name
    with torch.no_grad():
        unmerged_logits = model(IDS).logits
    assert not torch.equal(merged_logits, unmerged_logits)

    with pytest.warns(PackedMergeWarning):
        unloaded = model.merge_and_unload()
    assert not any("lora_" in n for n, _ in unloaded.named_parameters())
    experts = unloaded.model.layers[1].mlp.experts
    assert type(experts).__name__ == "KimiK3PackedExperts"
    w = dequantize_mxfp4(experts.gate_up_packed[0], experts.gate_up_scale[0], FP32)
    assert torch.equal(quantize_mxfp4_release(w)[0], experts.gate_up_packed[0])


def test_unsupported_lora_settings_are_refused_by_name(release):
    with pytest.raises(ValueError, match="plain LoRA.*use_dora"):
        lora(packed(release), use_dora=True)


def test_without_the_registration_peft_names_the_module(release):
    with pytest.raises(ValueError, match="KimiK3PackedExperts"):
        peft.get_peft_model(packed(release), peft.LoraConfig(r=4, target_modules=["experts"]))


# ---------------------------------------------------------------- streamed experts (stream_experts=True)
def streamed(release, per_read=2):
    return load(KimiK3ForCausalLM, release, dtype=FP32,
                quantization_config=KimiK3Mxfp4Config(stream_experts=True, stream_experts_per_read=per_read))


def test_lora_over_streamed_experts_computes_what_the_packed_models_does(release):
    """The same adapters over experts read from the files (2 per read: several reads a layer) and over the packed
    stacks in memory: equal logits, and the adapters' and inputs' gradients within fp32 rounding (a read's terms
    reach an adapter's gradient as separate sums)."""
    from transformers_k3.peft_mxfp4 import StreamedExpertsLoraLayer

    results = []
    for model in (lora(streamed(release), target_modules=["experts", *ATTENTION]),
                  lora(packed(release), target_modules=["experts", *ATTENTION])):  # fmt: skip
        embeds = model.get_input_embeddings()(IDS).detach().requires_grad_()
        out = model(inputs_embeds=embeds).logits
        out.pow(2).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((model, out.detach(), embeds.grad, grads))
    (model, logits, embeds_grad, grads), (_, want, want_embeds_grad, want_grads) = results
    assert len(expert_layers(model)) == len(MOE_LAYERS)
    assert all(isinstance(m, StreamedExpertsLoraLayer) for m in expert_layers(model))
    assert torch.equal(logits, want)
    assert embeds_grad.abs().max() > 0 and rel(embeds_grad, want_embeds_grad) < 1e-5
    assert grads.keys() == want_grads.keys() and any(".experts.lora_down_B" in n for n in grads)
    for name, grad in grads.items():
        assert grad.abs().max() > 0 and rel(grad, want_grads[name]) < 1e-5, name


def test_a_lora_run_over_streamed_experts_reloads_into_a_packed_model(release, tmp_path):
    """The loss falls over a short run on experts read per step (only the adapters on the experts train, so the
    gradients reach them through the streamed products), and the adapter reloads into a fresh packed model with the
    streamed model's logits."""
    model = lora(streamed(release), init_lora_weights=True).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    rows = torch.arange(3, 43).repeat(2, 1)
    losses = train_losses(model, rows, optimizer, 8)
    print("LoRA over streamed experts, losses:", [round(x, 3) for x in losses])
    assert losses[-1] < losses[0] - 0.2
    model.eval()
    with torch.no_grad():
        want = model(IDS).logits
    model.save_pretrained(tmp_path / "adapter")
    config = packed_experts_lora(peft.LoraConfig.from_pretrained(tmp_path / "adapter"))
    fresh = peft.PeftModel.from_pretrained(packed(release), tmp_path / "adapter", config=config).eval()
    with torch.no_grad():
        assert torch.equal(fresh(IDS).logits, want)
    config = packed_experts_lora(peft.LoraConfig.from_pretrained(tmp_path / "adapter"))  # (and into a streamed one)
    again = peft.PeftModel.from_pretrained(streamed(release, per_read=5), tmp_path / "adapter", config=config).eval()
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, want)


def test_merging_into_streamed_experts_is_refused_by_name(release):
    from transformers_k3.quantization_kimi_k3 import StreamedExpertsError

    model = lora(streamed(release))
    with pytest.raises(StreamedExpertsError, match=r"layers\.1\.mlp\.experts.*KimiK3Mxfp4Config\(\)"):
        model.merge_adapter()
    with pytest.raises(StreamedExpertsError, match="streams its experts"):
        model.merge_and_unload()
    with torch.no_grad():  # (nothing changed: the unmerged adapters still compute)
        assert torch.equal(model(IDS).logits, lora(packed(release))(IDS).logits)


# ---------------------------------------------------------------- accelerate
def module_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_auto_device_map_sizes_packed_experts_by_their_bytes(release):
    """accelerate's ``infer_auto_device_map`` and ``from_pretrained(device_map="auto")`` under a CPU budget between
    the packed and the bf16 model's size: the packed model stays whole in memory, the bf16 one spills to disk."""
    from transformers.integrations.accelerate import compute_module_sizes

    packed_model = packed(release, BF16)
    bf16_model = load(KimiK3ForCausalLM, release, dtype=BF16, quantization_config=KimiK3Mxfp4Config(dequantize=True))
    sizes = compute_module_sizes(packed_model, packed_model.hf_quantizer)[0]
    experts = sizes["model.layers.1.mlp.experts"]
    assert experts == sum(p.numel() for p in packed_model.model.layers[1].mlp.experts.parameters())  # uint8 bytes
    assert experts * 3 < compute_module_sizes(bf16_model)[0]["model.layers.1.mlp.experts"]
    budget = {"cpu": (module_bytes(packed_model) + module_bytes(bf16_model)) // 2}
    assert module_bytes(packed_model) < budget["cpu"] < module_bytes(bf16_model)
    for model, spills in ((packed_model, False), (bf16_model, True)):
        device_map = accelerate.infer_auto_device_map(model, max_memory=budget,
                                                      no_split_module_classes=model._no_split_modules)
        assert ("disk" in device_map.values()) == spills, device_map


def test_from_pretrained_auto_device_map_keeps_packed_in_budget(release, tmp_path):
    budget = {"cpu": module_bytes(packed(release, BF16)) * 6 // 5}
    kept = KimiK3ForCausalLM.from_pretrained(release, dtype=BF16, device_map="auto", max_memory=budget,
                                             offload_folder=tmp_path / "a")  # fmt: skip
    assert set(getattr(kept, "hf_device_map", {"": "cpu"}).values()) == {"cpu"}
    spilled = KimiK3ForCausalLM.from_pretrained(release, dtype=BF16, device_map="auto", max_memory=budget,
                                                offload_folder=tmp_path / "b",
                                                quantization_config=KimiK3Mxfp4Config(dequantize=True))  # fmt: skip
    assert "disk" in spilled.hf_device_map.values()


def _map_with(model, targets: set[str], device: str) -> dict[str, str]:
    """A device map with ``targets`` on ``device`` and every other module on the CPU (disjoint entries)."""
    out = {}

    def walk(module, prefix):
        for name, child in module.named_children():
            full = prefix + name
            if full in targets:
                out[full] = device
            elif any(t.startswith(full + ".") for t in targets):
                walk(child, full + ".")
            else:
                out[full] = "cpu"
        for name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            out[prefix + name] = "cpu"

    walk(model, "")
    return out


def test_disk_offload_from_pretrained_moves_the_packed_stacks(release, tmp_path):
    """Experts of two layers on "disk", the rest on the CPU (no ``offload_buffers``: the packed stacks are
    parameters): they are not resident (meta), their bytes are in the offload folder, the CPU layers' stacks stay
    resident, and the logits equal the resident model's."""
    want = packed(release)(IDS).logits.detach()
    targets = {"model.layers.1.mlp.experts", "model.layers.3.mlp.experts"}
    model = KimiK3ForCausalLM.from_pretrained(release, dtype=FP32, device_map=_map_with(packed(release), targets, "disk"),
                                              offload_folder=tmp_path / "offload").eval()
    for name in targets:
        stacks = dict(model.get_submodule(name).named_parameters())
        assert sorted(stacks) == ["down_packed", "down_scale", "gate_up_packed", "gate_up_scale"]
        assert {p.device.type for p in stacks.values()} == {"meta"}
    assert {p.device.type for p in model.model.layers[2].mlp.experts.parameters()} == {"cpu"}
    assert any(p.name.startswith("model.layers.1.mlp.experts.gate_up_packed") for p in (tmp_path / "offload").iterdir())
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)


def test_an_offloaded_layer_is_still_checked_at_load(release, tmp_path):
    """The after-load value check reads a disk-offloaded layer's bytes: a NaN scale there is refused by name."""
    from transformers_k3.conversion import CheckpointError
    from transformers_k3.conversion.streaming import write_state_dict

    from references import shard_tensors

    state = shard_tensors(release)
    name = "model.layers.2.block_sparse_moe.experts.3.w2.weight_scale"
    state[name] = state[name].clone()
    state[name][0, 0] = 255  # (E8M0's NaN)
    write_state_dict(state, tmp_path / "bad", max_shard_size=40_000)
    (tmp_path / "bad" / "config.json").write_text((release / "config.json").read_text())
    device_map = _map_with(packed(release), {"model.layers.2.mlp.experts"}, "disk")
    with pytest.raises(CheckpointError, match=r"layers.2.mlp.experts`: expert 3 w2: .*E8M0"):
        KimiK3ForCausalLM.from_pretrained(tmp_path / "bad", device_map=device_map, offload_folder=tmp_path / "offload")


@pytest.mark.parametrize("how", ["cpu", "disk"])
def test_accelerate_offload_runs_the_experts_on_offloaded_stacks(release, tmp_path, how):
    model = packed(release)
    with torch.no_grad():
        want = model(IDS).logits
    if how == "cpu":
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        accelerate.disk_offload(model, tmp_path / "offload", execution_device=torch.device("cpu"))
    assert {p.device.type for p in model.model.layers[2].mlp.experts.parameters()} == {"meta"}
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)
    shutil.rmtree(tmp_path / "offload", ignore_errors=True)

