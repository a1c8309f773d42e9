"""KDA training on CPU through the fused forward kernel (``transformers_k3::kda_chunk``, ops/kda/autograd.py): the
operator passes opcheck; its forward is the inference kernel's, bitwise; its gradient is the PyTorch chunked path's
(bitwise for the same cotangents, since the backward recomputes that path), agrees with fla's naive recurrence and
with the float64 PyTorch path within fp32 tolerance; a tiny model's training step runs it and gets the gradients
of the kernels-off run."""

import pytest
import torch

from transformers_k3 import kernelize
from transformers_k3.ops import cpu_kernel
from transformers_k3.ops.kda import chunk_kda, fused_recurrent_kda, kda_gate

from references import _load_fla_naive, make_inputs

ops = torch.ops.transformers_k3


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if cpu_kernel.library() is None:
        pytest.skip(f"fused CPU kernels unavailable: {cpu_kernel.load_error()}")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny tensors; see test_ops_kda.single_thread)
    yield
    torch.set_num_threads(previous)


def grads_of(fn, inputs, cotangents, kernel: bool, **kwargs):
    """``(o, final_state, grads of the inputs)`` of ``fn`` for the cotangents, with the fused kernel or PyTorch."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, s = fn(*leaves[:5], initial_state=leaves[5] if len(leaves) > 5 else None, output_final_state=True,
              kernel=kernel, **kwargs)  # fmt: skip
    ((o * cotangents[0]).sum() + (s * cotangents[1]).sum()).backward()
    return o.detach(), s.detach(), [x.grad for x in leaves]


def inference(fn, inputs, **kwargs):
    """``(o, final_state)`` of ``fn`` without autograd through the fused kernel: the training forward equals it
    bitwise where the operator computes it, and the PyTorch path's rounding shows otherwise."""
    with torch.no_grad():
        return fn(*[x.detach().clone() for x in inputs[:5]], initial_state=inputs[5].detach().clone()
                  if len(inputs) > 5 else None, output_final_state=True, kernel=True, **kwargs)


def cotangents_for(o_shape, s_shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(o_shape, generator=gen), torch.randn(s_shape, generator=gen)


def diff(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def test_opcheck():
    q, k, v, g, beta, h0 = make_inputs(2, 70, 2, 16, 16, "k3", seed=3)
    args = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    torch.library.opcheck(ops.kda_chunk.default, (*args, None, 0.25, 32))
    packed = [x[:1].detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
    states = torch.randn(4, 2, 16, 16, generator=torch.Generator().manual_seed(4))
    torch.library.opcheck(ops.kda_chunk.default, (*packed, states, torch.tensor([0, 30, 30, 64, 70]), 0.25,
                                                   16))  # (no state grad)
    o_bar, s_bar = cotangents_for((2, 70, 2, 16), (2, 2, 16, 16))
    mask = [True, False, True, True, True, True]
    torch.library.opcheck(ops.kda_chunk_backward.default, (o_bar, s_bar, q, k, v, g, beta, h0, None, 0.25, 32, mask))
    torch.library.opcheck(ops.kda_chunk_backward.default,  # (the final state unused)
                          (o_bar[:1], None, q[:1], k[:1], v[:1], g[:1], beta[:1], states[:3],
                           torch.tensor([0, 30, 30, 70]), 0.25, 16, [True] * 6))  # fmt: skip


def test_registered_with_fake_and_autograd_on_every_device():
    for op in (ops.kda_chunk.default, ops.kda_chunk_backward.default):
        for key in ("CPU", "Meta", "CUDA", "XPU", "MPS"):  # (elsewhere than on CPU the PyTorch path computes it)
            assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), key), (op, key)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(ops.kda_chunk.default.name(), "Autograd")


def test_training_forward_is_the_inference_kernel():
    """With autograd the same kernel computes the forward as without (bitwise; the PyTorch path rounds
    differently), and the inputs stay untouched."""
    inputs = make_inputs(2, 100, 2, 16, 16, "k3", seed=5)
    before = [x.clone() for x in inputs]
    with torch.no_grad():
        o_ref, s_ref = chunk_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True, kernel=True)
        o_torch, _ = chunk_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, s = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, kernel=True)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    assert not torch.equal(o_torch, o_ref)
    for x, y in zip(inputs, before):
        assert torch.equal(x, y)


CASES = {
    "plain": dict(),
    "state": dict(state=True),
    "l2norm": dict(state=True, kwargs=dict(use_qk_l2norm_in_kernel=True)),
    "varlen": dict(state=True, cu=[0, 37, 37, 100, 140]),
    "varlen_no_state": dict(cu=[0, 5, 70, 140]),
    "gva": dict(state=True, v_heads=4),
    "chunk_64": dict(state=True, kwargs=dict(chunk_size=64)),
}


def case_inputs(case, length=140):
    spec = CASES[case]
    cu = spec.get("cu")
    batch = 1 if cu else 2
    v_heads = spec.get("v_heads", 2)
    q, k, v, g, beta, _ = make_inputs(batch, length, 2, 16, 16, "k3", seed=9, v_heads=v_heads,
                                      normalise="use_qk_l2norm_in_kernel" not in spec.get("kwargs", {}))  # fmt: skip
    kwargs = dict(spec.get("kwargs", {}))
    n_seq = len(cu) - 1 if cu else batch
    inputs = [q, k, v, g, beta]
    if spec.get("state"):
        inputs.append(torch.randn(n_seq, v_heads, 16, 16, generator=torch.Generator().manual_seed(11)))
    if cu:
        kwargs["cu_seqlens"] = torch.tensor(cu)
    cotangents = cotangents_for((batch, length, v_heads, 16), (n_seq, v_heads, 16, 16))
    return inputs, cotangents, kwargs


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_is_the_pytorch_paths(case):
    """Same cotangents, same gradient: the backward is the PyTorch chunked path's vjp (recomputed on the same
    inputs), so it matches the kernels-off run bitwise; the forwards agree to fp32 rounding."""
    inputs, cotangents, kwargs = case_inputs(case)
    o, s, got = grads_of(chunk_kda, inputs, cotangents, kernel=True, **kwargs)
    o_kernel, s_kernel = inference(chunk_kda, inputs, **kwargs)
    assert torch.equal(o, o_kernel) and torch.equal(s, s_kernel)  # (the operator's forward)
    o_ref, s_ref, want = grads_of(chunk_kda, inputs, cotangents, kernel=False, **kwargs)
    assert diff(o, o_ref) <= 1e-5 and diff(s, s_ref) <= 1e-5
    for name, a, b in zip("q k v g beta h0".split(), got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"grad {name}")


def test_gate_gradient_reaches_gate_parameters():
    """The gate (A_log, dt_bias, lower_bound; ops/kda/gate.py) is computed before the operator in PyTorch, as the
    layer does, so its parameters get their gradient through ordinary autograd, equal to the kernels-off run."""
    q, k, v, _, beta, h0 = make_inputs(1, 80, 2, 8, 8, seed=2)
    gen = torch.Generator().manual_seed(3)
    raw, a_log, dt_bias = (torch.randn(*shape, generator=gen) for shape in ((1, 80, 2, 8), (2,), (16,)))
    cotangents = cotangents_for((1, 80, 2, 8), (1, 2, 8, 8))
    results = []
    for kernel in (True, False):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, raw, beta, h0, a_log, dt_bias)]
        g = kda_gate(leaves[3], leaves[6], leaves[7], lower_bound=-5.0)
        o, s = chunk_kda(*leaves[:3], g, leaves[4], initial_state=leaves[5], output_final_state=True,
                         safe_gate=True, kernel=kernel)
        ((o * cotangents[0]).sum() + (s * cotangents[1]).sum()).backward()
        results.append([x.grad for x in leaves])
        if kernel:  # (the operator's forward)
            assert torch.equal(o, inference(chunk_kda, (*leaves[:3], g, *leaves[4:6]), safe_gate=True)[0])
    for name, a, b in zip("q k v g beta h0 A_log dt_bias".split(), *results):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"grad {name}")


def test_only_some_inputs_need_grad():
    q, k, v, g, beta, h0 = make_inputs(2, 50, 2, 8, 8, seed=4)
    v = v.clone().requires_grad_()
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, kernel=True)
    assert torch.equal(o, inference(chunk_kda, (q, k, v, g, beta, h0))[0])  # (the operator's forward)
    (got,) = torch.autograd.grad(o.square().sum() + s.sum(), v)
    v_ref = v.detach().clone().requires_grad_()
    o_ref, s_ref = chunk_kda(q, k, v_ref, g, beta, initial_state=h0, output_final_state=True)
    (want,) = torch.autograd.grad(o_ref.square().sum() + s_ref.sum(), v_ref)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # (cotangent 2 o: the forwards' rounding)


def test_without_final_state_and_empty_input():
    q, k, v, g, beta, h0 = (x.requires_grad_() for x in make_inputs(1, 40, 2, 8, 8, seed=6))
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, kernel=True)
    assert s is None
    assert torch.equal(o, inference(chunk_kda, (q, k, v, g, beta, h0))[0])  # (the operator's forward)
    o.sum().backward()
    assert h0.grad is not None and q.grad is not None
    empty = [x.detach()[:, :0].requires_grad_() for x in (q, k, v, g, beta)]
    state = h0.detach().clone().requires_grad_()
    o, s = chunk_kda(*empty, initial_state=state, output_final_state=True, kernel=True)
    assert o.shape == (1, 0, 2, 8) and torch.equal(s, state)
    s_bar = torch.randn_like(s)
    (s * s_bar).sum().backward()
    assert torch.equal(state.grad, s_bar) and state.grad is not s_bar


def test_recurrent_entry_point_under_autograd():
    """fused_recurrent_kda runs the same kernel in inference, so with autograd it runs the operator too; its
    gradient then is the chunked form's, equal to the token loop's within fp32 tolerance."""
    q, k, v, g, beta, h0 = make_inputs(2, 12, 2, 8, 8, seed=8, normalise=False)
    cotangents = cotangents_for((2, 12, 2, 8), (2, 2, 8, 8))
    kwargs = dict(use_qk_l2norm_in_kernel=True)
    o, s, got = grads_of(fused_recurrent_kda, (q, k, v, g, beta, h0), cotangents, kernel=True, **kwargs)
    o_kernel, s_kernel = inference(fused_recurrent_kda, (q, k, v, g, beta, h0), **kwargs)
    assert torch.equal(o, o_kernel) and torch.equal(s, s_kernel)  # (the operator's forward)
    o_ref, s_ref, want = grads_of(fused_recurrent_kda, (q, k, v, g, beta, h0), cotangents, kernel=False, **kwargs)
    assert diff(o, o_ref) <= 1e-5 and diff(s, s_ref) <= 1e-5
    for name, a, b in zip("q k v g beta h0".split(), got, want):
        assert diff(a, b) <= 1e-4, f"grad {name}: {diff(a, b):.2e}"


@pytest.mark.parametrize("varlen", [False, True])
def test_gradient_matches_fla_naive(varlen):
    """Against fla's naive recurrence under autograd (as test_ops_kda.test_gradients_match_naive_autograd), for
    whole sequences and, with cu_seqlens, per packed sequence."""
    fla, reason = _load_fla_naive()
    if fla is None:
        pytest.skip(reason)
    q, k, v, g, beta, _ = make_inputs(1 if varlen else 2, 90, 2, 8, 8, "k3", seed=21)
    edges = [0, 33, 33, 90] if varlen else None
    n_seq = 3 if varlen else 2
    h0 = torch.randn(n_seq, 2, 8, 8, generator=torch.Generator().manual_seed(2))
    cotangents = cotangents_for(v.shape, h0.shape)
    kwargs = dict(cu_seqlens=torch.tensor(edges)) if varlen else {}
    o, _, got = grads_of(chunk_kda, (q, k, v, g, beta, h0), cotangents, kernel=True, **kwargs)
    assert torch.equal(o, inference(chunk_kda, (q, k, v, g, beta, h0), **kwargs)[0])  # (the operator's forward)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    pieces = [(0, 90, slice(None))] if not varlen else [(s, e, slice(i, i + 1)) for i, (s, e) in
                                                          enumerate(zip(edges, edges[1:]))]  # fmt: skip
    loss = 0
    for start, end, rows in pieces:
        o, s = fla.naive_recurrent_kda(*(x[:, start:end] for x in leaves[:5]), initial_state=leaves[5][rows],
                                       output_final_state=True)  # fmt: skip
        loss = loss + (o * cotangents[0][:, start:end]).sum() + (s * cotangents[1][rows]).sum()
    loss.backward()
    for name, a, leaf in zip("q k v g beta h0".split(), got, leaves):
        assert diff(a, leaf.grad) <= 1e-4, f"grad {name}: {diff(a, leaf.grad):.2e}"


def test_gradient_matches_float64_pytorch_path():
    """No float64 kernel, so no gradcheck of the operator itself: its fp32 gradient against the float64 PyTorch
    path's (itself gradchecked in test_ops_kda), within fp32 tolerance, varlen and from a state."""
    q, k, v, g, beta, _ = make_inputs(1, 150, 2, 16, 16, "k3", seed=13, normalise=False)
    h0 = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(3))
    cotangents = cotangents_for(v.shape, h0.shape)
    kwargs = dict(cu_seqlens=torch.tensor([0, 64, 100, 150]), use_qk_l2norm_in_kernel=True)
    o, _, got = grads_of(chunk_kda, (q, k, v, g, beta, h0), cotangents, kernel=True, **kwargs)
    assert torch.equal(o, inference(chunk_kda, (q, k, v, g, beta, h0), **kwargs)[0])  # (the operator's forward)
    inputs64, cotangents64 = [x.double() for x in (q, k, v, g, beta, h0)], [c.double() for c in cotangents]
    _, _, want = grads_of(chunk_kda, inputs64, cotangents64, kernel=True, **kwargs)
    _, _, torch64 = grads_of(chunk_kda, inputs64, cotangents64, kernel=False, **kwargs)
    for a, b in zip(want, torch64):  # (float64: the PyTorch path, asked for the kernel or not)
        assert torch.equal(a, b)
    for name, a, b in zip("q k v g beta h0".split(), got, want):
        scale = b.abs().max().item()
        assert diff(a, b) <= 2e-5 * max(1.0, scale), f"grad {name}: {diff(a, b):.2e} (scale {scale:.2e})"


def test_tiny_model_training_step_runs_the_operator(tiny_model):
    """loss.backward() of a tiny kernelized K3 on CPU: every KDA layer holds the kernel (the operator under
    autograd), and the parameters' gradients are those of the plain model within fp32 tolerance (the forwards
    differ by rounding)."""
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    model = tiny_model.train()
    n_kda = model.config.layer_types.count("linear_attention")

    def step():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_ref, grads_ref = step()
    kernelize(model)
    kda_layers = [m for m in model.modules() if getattr(m, "k3_kernel_name", None) == "k3_kda"]
    assert len(kda_layers) == n_kda > 0 and all(m.kernel is not None for m in kda_layers)
    loss, grads = step()
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
    assert grads.keys() == grads_ref.keys() and "model.layers.0.self_attn.A_log" in grads
    for name, grad in grads.items():
        ref = grads_ref[name]
        assert diff(grad, ref) <= 1e-4 * max(1.0, ref.abs().max().item()), name


def test_compiled_training_graph_holds_the_operator():
    """torch.compile(fullgraph=True) over chunk_kda under autograd: the operator and its backward are traced through
    their fake implementations (no graph break), and the compiled gradient equals eager's."""
    q, k, v, g, beta, h0 = make_inputs(2, 40, 2, 8, 8, seed=1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]

    def fn(q, k, v, g, beta, h0):
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, kernel=True)
        return o.square().sum() + s.sum()

    torch._dynamo.reset()
    counts = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    loss = torch.compile(fn, fullgraph=True, backend=counts)(*leaves)
    got = torch.autograd.grad(loss, leaves)
    graph = "\n".join(str(gm.graph) for gm in counts.graphs)
    assert counts.frame_count == 1 and "transformers_k3.kda_chunk" in graph
    want = torch.autograd.grad(fn(*leaves), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
