"""torch.compile over packed MXFP4 routed experts (issue 46, docs/mxfp4.md "torch.compile"), on an official-layout
MXFP4 checkpoint of a two-layer tiny model (a dense KDA layer, then a MoE MLA layer with 8 packed experts):

* experts in memory (``KimiK3Mxfp4Config()``): ``fullgraph=True`` compiles the forward, and a training step with
  LoRA on the packed experts and on attention; they give eager's logits, loss and every adapter's and the inputs'
  gradients (the packed product is a ``torch.library`` operator with fake kernels and an autograd formula, the
  adapters' terms plain PyTorch around it);
* experts streamed from disk (``stream_experts=True``): the graph breaks at each streamed experts call (a read of
  files planned from host-read offsets, run eagerly), so ``fullgraph=True`` raises, and without it the compiled
  LoRA training step gives eager's loss and gradients, with one break per MoE layer call and no other.

The backend is ``aot_eager`` (dynamo capture and AOTAutograd's functionalization without inductor's code generation,
which takes minutes on these CPUs)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import transformers_k3  # noqa: F401  (registers the classes, mappings and the quantizer)
from transformers_k3 import KimiK3ForCausalLM, KimiK3Mxfp4Config, KimiK3TextConfig

from references import FP32, load, release_state, write_release

peft = pytest.importorskip("peft")
from transformers_k3.peft_mxfp4 import packed_experts_lora  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(3, 500, (2, 14), generator=torch.Generator().manual_seed(0))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    config = KimiK3TextConfig.tiny(num_hidden_layers=2, linear_attn_config={"kda_layers": [1], "full_attn_layers": [2]})
    return write_release(tmp_path_factory.mktemp("release") / "two_layers", release_state(config, False, True, 1),
                         config, False, True)  # fmt: skip


def compiled(fn, fullgraph: bool):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, fullgraph=fullgraph, backend="aot_eager")


def with_lora(model):
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["experts", "q_proj", "o_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, packed_experts_lora(config)).train()


def training_step(model, fn):
    """Logits, loss, the input embeddings' gradient and every adapter's gradient of one step of ``fn``."""
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(IDS).detach().requires_grad_()
    out = fn(inputs_embeds=embeds, labels=IDS)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), embeds.grad, grads


def assert_same_step(got, want):
    (logits, loss, embeds_grad, grads), (want_logits, want_loss, want_embeds_grad, want_grads) = got, want
    assert rel(logits, want_logits) < 1e-6
    assert abs(loss.item() - want_loss.item()) < 1e-6 * abs(want_loss.item())
    assert embeds_grad.abs().max() > 0 and rel(embeds_grad, want_embeds_grad) < 1e-5
    assert grads.keys() == want_grads.keys() and any(".experts.lora_down_B" in n for n in grads)
    for name, grad in grads.items():
        assert grad.abs().max() > 0 and rel(grad, want_grads[name]) < 1e-5, name


def test_compiled_packed_forward_is_one_graph_with_eagers_logits(release):
    model = load(KimiK3ForCausalLM, release, dtype=FP32)
    assert type(model.model.layers[1].mlp.experts).__name__ == "KimiK3PackedExperts"
    with torch.no_grad():
        want = model(IDS).logits
        got = compiled(model, fullgraph=True)(IDS).logits
    assert rel(got, want) < 1e-6


def test_compiled_lora_step_over_packed_experts_is_one_graph_with_eagers_gradients(release):
    model = with_lora(load(KimiK3ForCausalLM, release, dtype=FP32))
    want = training_step(model, model)
    assert_same_step(training_step(model, compiled(model, fullgraph=True)), want)


def test_compiled_lora_step_over_streamed_experts_breaks_only_at_the_reads(release):
    config = KimiK3Mxfp4Config(stream_experts=True, stream_experts_per_read=3)
    model = with_lora(load(KimiK3ForCausalLM, release, dtype=FP32, quantization_config=config))
    assert type(model.base_model.model.model.layers[1].mlp.experts.base_layer).__name__ == "KimiK3StreamedExperts"
    want = training_step(model, model)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="disable"):
        training_step(model, compiled(model, fullgraph=True))
    assert_same_step(training_step(model, compiled(model, fullgraph=False)), want)
    breaks = counters["graph_break"]
    assert breaks and all("disable" in reason for reason in breaks), dict(breaks)
