"""torch.compile(fullgraph=True) on packed rows: several sequences concatenated in one row (batch 1), as transformers'
`DataCollatorWithFlattening` makes them (position_ids restarting at 0, optionally cu_seq_lens_q/k and max_length_q/k).
The graph must compute what eager does, forward and backward, and the sequences must not see each other.

The backend records the graphs AOTAutograd hands over and runs them as they are (what ``backend="aot_eager"`` does):
dynamo capture and functionalization without inductor's code generation, which takes minutes on these CPUs.
fullgraph=True makes a graph break raise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from transformers import DataCollatorWithFlattening

from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig, kernelize
from transformers_k3.ops import cpu_kernel
from transformers_k3.ops.conv import causal_conv1d
from transformers_k3.ops.kda import chunk_kda, fused_recurrent_kda

from references import make_inputs, randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

# Three sequences; the 45-token one crosses the 32-token KDA chunk, the 5-token one is shorter than a chunk.
LENGTHS = (23, 45, 5)


def _needs_kernels():
    if cpu_kernel.library() is None:
        pytest.skip("the CPU kernels are not built here")


class Recorder:
    """An aot_eager backend that also notes the ``transformers_k3`` operators of the forward and backward graphs."""

    def __init__(self):
        self.ops = {"forward": set(), "backward": set()}
        self.backend = aot_autograd(fw_compiler=self._note("forward"), bw_compiler=self._note("backward"))

    def _note(self, which):
        def compiler(gm, example_inputs):
            for node in gm.graph.nodes:
                if node.op == "call_function" and str(node.target).startswith("transformers_k3."):
                    self.ops[which].add(str(node.target).split(".")[1])
            return make_boxed_func(gm.forward)
        return compiler


def compile_fullgraph(fn, backend="aot_eager"):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, fullgraph=True, backend=backend)


def packed_batch(flash_kwargs: bool, seed: int = 0) -> tuple[dict, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 512, (n,), generator=gen) for n in LENGTHS]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": r.tolist()} for r in rows])
    assert batch["input_ids"].shape == (1, sum(LENGTHS)) and "attention_mask" not in batch
    return batch, rows


def tiny_model(seed: int = 0) -> KimiK3ForCausalLM:
    torch.manual_seed(seed)
    return randomize_(KimiK3ForCausalLM(KimiK3TextConfig.tiny()).train(), std=0.05)


def training_step(model, fn, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and every parameter's gradient of one step of ``fn`` (the model or its compiled form)."""
    model.zero_grad(set_to_none=True)
    loss = fn(**batch).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_compiled_packed_training_step_equals_eager_bitwise(flash_kwargs):
    """The compiled forward and backward of the kernelized model run the eager step's operators (the fused KDA
    kernel and its recomputed gradient inside ``kda_chunk``, which reads the bounds when it runs; the conv's packed
    layout built from the same bounds as tensors), so the loss and every gradient are bitwise eager's."""
    _needs_kernels()
    batch, _ = packed_batch(flash_kwargs)
    model = kernelize(tiny_model())
    want_loss, want_grads = training_step(model, model, batch)
    recorder = Recorder()
    compiled = compile_fullgraph(model, recorder.backend)
    got_loss, got_grads = training_step(model, compiled, batch)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert "kda_chunk" in recorder.ops["forward"], recorder.ops
    assert "kda_chunk_backward" in recorder.ops["backward"], recorder.ops
    assert torch.equal(got_loss, want_loss), (got_loss, want_loss)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) == len(list(model.parameters()))
    unequal = [name for name in want_grads if not torch.equal(got_grads[name], want_grads[name])]
    assert not unequal, unequal
    torch._dynamo.reset()


def test_compiled_packed_row_equals_separate_sequences():
    """The independent reference for packing: the compiled packed row's logits, and the gradients of a summed
    per-token loss, equal those of each sequence run on its own (eager, unpacked), to 5e-5 of each tensor's largest
    entry (measured 1.9e-6 on the logits, 4.5e-6 on the gradients): the same tokens go through differently shaped
    products (MLA over the whole row under a block-diagonal mask, GEMMs over 73 rows instead of 23), whose fp32
    sums round differently."""
    _needs_kernels()
    batch, rows = packed_batch(False)
    model = tiny_model(1)
    compiled = compile_fullgraph(model)
    model.zero_grad(set_to_none=True)
    logits = compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    assert not counters["graph_break"], dict(counters["graph_break"])
    targets = torch.cat([torch.cat([r[1:], r.new_full((1,), -100)]) for r in rows])
    F.cross_entropy(logits, targets, reduction="sum").backward()
    got_grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    separate = [model(input_ids=r[None]).logits[0] for r in rows]
    want = torch.cat(separate)
    sum(F.cross_entropy(out, torch.cat([r[1:], r.new_full((1,), -100)]), reduction="sum")
        for out, r in zip(separate, rows)).backward()
    torch.testing.assert_close(logits.detach(), want.detach(), rtol=0, atol=5e-5 * want.abs().max().item())
    for name, p in model.named_parameters():
        torch.testing.assert_close(got_grads[name], p.grad, rtol=0, atol=5e-5 * p.grad.abs().max().item(), msg=name)
    torch._dynamo.reset()


def test_compiled_single_sequence_with_position_ids_equals_eager():
    """position_ids 0 .. T - 1 in a graph: it cannot tell that the row is not packed, so it takes one packed sequence,
    cu_seqlens [0, T]; that is bitwise eager's unpacked computation. The same tokens packed differ (the boundaries are
    really applied)."""
    _needs_kernels()
    batch, _ = packed_batch(False)
    ids = batch["input_ids"]
    model = kernelize(tiny_model(1).eval())  # (the fused KDA operator: one sequence packed or not, bit for bit)
    compiled = compile_fullgraph(model)
    with torch.no_grad():
        got = compiled(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert torch.equal(got, model(input_ids=ids).logits)
        assert (got - model(input_ids=ids, position_ids=batch["position_ids"]).logits).abs().max() > 1e-3
    torch._dynamo.reset()


def test_compiled_packed_training_step_on_the_pytorch_path():
    """With the fused kernels off, KDA runs the PyTorch chunked code: in a graph the packed row becomes one sequence
    whose decay is reset to 0 at every sequence start (eager splits the row into sequences), and the decays inside
    each 16-token sub-chunk are taken whole (eager factors them after checking their span). The same function: loss
    and gradients equal eager's to 5e-5 of each gradient's largest entry (fp32 rounding of differently ordered sums;
    measured 0 on the loss, 4e-6 on the gradients, 1.2e-5 with 6 layers; eager's kernel and PyTorch paths differ by
    3e-6). Three layers (two KDA, one MLA), to keep the trace short.
    position_ids only: the sequence count is an unbacked size here (cu_seq_lens: the operator tests' case)."""
    batch, _ = packed_batch(False)
    torch.manual_seed(2)
    config = KimiK3TextConfig.tiny(num_hidden_layers=3, linear_attn_config={"kda_layers": [1, 2], "full_attn_layers": [3]})
    model = randomize_(KimiK3ForCausalLM(config).train(), std=0.05)
    want_loss, want_grads = training_step(model, model, batch)
    recorder = Recorder()
    compiled = compile_fullgraph(model, recorder.backend)
    got_loss, got_grads = training_step(model, compiled, batch)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not any("kda" in op for ops in recorder.ops.values() for op in ops), recorder.ops
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=5e-5 * grad.abs().max().item(), msg=name)
    torch._dynamo.reset()


# ---------------------------------------------------------------- the operators alone
def _conv_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, sum(LENGTHS), 6, generator=gen, requires_grad=True)
    weight = torch.randn(6, 4, generator=gen, requires_grad=True)
    initial = torch.randn(len(LENGTHS) + 1, 6, 3, generator=gen, requires_grad=True)
    return x, weight, initial


def test_compiled_packed_conv_equals_eager_bitwise():
    """causal_conv1d on packed sequences (an empty one included, with initial and final states) in a graph: the
    same packed layout from the same bounds, so outputs, final states and gradients are bitwise eager's."""
    cu = torch.tensor([0, 23, 23, 68, 73])  # (sequence 1 is empty)

    def run(fn):
        x, weight, initial = _conv_inputs()
        y, final = fn(x, weight, initial, cu)
        (y.square().sum() + final.square().sum()).backward()
        return y.detach(), final.detach(), x.grad, weight.grad, initial.grad

    def conv(x, weight, initial, cu):
        return causal_conv1d(x, weight, activation="silu", initial_state=initial, output_final_state=True,
                             cu_seqlens=cu)  # fmt: skip

    want = run(conv)
    compiled = compile_fullgraph(conv)
    got = run(compiled)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for bad in ([0, 50, 23, 73], [1, 23, 68, 73], [0, 23, 68, 72]):  # (decreasing, not from 0, not to T)
        with pytest.raises(RuntimeError, match="cu_seqlens must start at 0, be non-decreasing and end at T"):
            x, weight, initial = _conv_inputs()
            compiled(x, weight, initial[:3], torch.tensor(bad))
    torch._dynamo.reset()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch"])
def test_compiled_packed_chunk_kda_equals_eager_bitwise(kernel):
    """chunk_kda on packed sequences with initial and final states in a graph calls ``kda_chunk`` with the bounds as
    a tensor, which makes eager's calls (the kernel's forward, or with the kernels off the PyTorch path on the host
    bounds): outputs, final states and all gradients bitwise eager's; a bad cu_seqlens raises eager's error when the
    graph runs."""
    if kernel:
        _needs_kernels()
    cu = torch.tensor([0, 23, 68, 73])

    def run(fn, bounds=cu):
        q, k, v, g, beta, _ = make_inputs(1, 73, 2, 16, 16, "k3", seed=5)
        h0 = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(6))
        leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, final = fn(*leaves, bounds)
        (o.square().sum() + final.square().sum()).backward()
        return (o.detach(), final.detach(), *(x.grad for x in leaves))

    def kda(q, k, v, g, beta, h0, cu):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, kernel=kernel)

    want = run(kda)
    recorder = Recorder()
    compiled = compile_fullgraph(kda, recorder.backend)
    got = run(compiled)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert recorder.ops == {"forward": {"kda_chunk"}, "backward": {"kda_chunk_backward"}}, recorder.ops
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, be non-decreasing and end at T = 73"):
        run(compiled, torch.tensor([0, 50, 23, 73]))
    torch._dynamo.reset()


@pytest.mark.parametrize("decay", ["k3", "weak"])
@pytest.mark.parametrize("entry", ["chunk_kda", "fused_recurrent_kda"])
def test_compiled_packed_kda_pytorch_path_equals_separate_sequences(entry, decay):
    """The PyTorch path's packed form in a graph (kernels off): decay reset at every sequence start, one sequence
    from a zero state; the graph checks cu_seqlens itself. Its outputs and gradients equal each sequence run on its
    own in eager, at K3's strongest gates (cumulative decays to -160 per chunk) and at near-zero ones (where a decay
    computed as a difference of sums holding the reset would be off by ~1e-3), to 5e-5 of each tensor's largest
    entry (fp32 rounding; measured 3e-7 on the outputs, 6e-6 on the gate's gradient, whose chunked sums are
    reordered most)."""
    fn = {"chunk_kda": chunk_kda, "fused_recurrent_kda": fused_recurrent_kda}[entry]
    q, k, v, g, beta, _ = make_inputs(1, sum(LENGTHS), 2, 16, 16, decay, seed=7)
    cu = torch.tensor([0, 23, 68, 73])

    def packed(q, k, v, g, beta, cu):
        return fn(q, k, v, g, beta, cu_seqlens=cu)[0]

    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    compiled = compile_fullgraph(packed)
    out = compiled(*leaves, cu)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for bad in ([0, 50, 23, 73], [1, 23, 68, 73], [0, 23, 68, 72]):  # (decreasing, not from 0, not to T)
        with pytest.raises(RuntimeError, match="cu_seqlens must start at 0, be non-decreasing and end at T"):
            compiled(q, k, v, g, beta, torch.tensor(bad))
    out.square().sum().backward()
    got = (out.detach(), *(x.grad for x in leaves))

    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    out = torch.cat([fn(*(x[:, a:b] for x in leaves))[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    out.square().sum().backward()
    want = (out.detach(), *(x.grad for x in leaves))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-5 * b.abs().max().item())
    torch._dynamo.reset()


@pytest.mark.parametrize("safe_gate", [True, False], ids=["safe_gate", "any_gate"])
def test_compiled_chunk_kda_pytorch_path_equals_fla_naive(fla_naive, safe_gate):
    """chunk_kda in a graph with the kernels off, at K3's strongest gates (cumulative decays to -160 per chunk): with
    safe_gate=True (the K3 layer's call; gates promised in [-5, 0)) the graph factors each sub-chunk's decays as eager
    does, without it each is taken whole (also past what factoring survives: spans of ~1,600 in a sub-chunk); both
    give fla's recurrence. A gate below the promise fails when the graph runs, instead of overflowing."""
    q, k, v, g, beta, h0 = make_inputs(2, 100, 2, 16, 16, "k3", seed=3)
    if not safe_gate:
        g[:, 30:70] *= 20.0
    want = fla_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    def kda(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, safe_gate=safe_gate)

    compiled = compile_fullgraph(kda)
    got = compiled(q, k, v, g, beta, h0)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    if safe_gate:
        with pytest.raises(RuntimeError, match=r"safe_gate=True\) was given gates below -5"):
            compiled(q, k, v, g * 3, beta, h0)
    torch._dynamo.reset()
