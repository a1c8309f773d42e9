"""The ``transformers_k3::*`` operators on a device without a fused kernel: each has a PyTorch implementation
(`transformers_k3.ops.reference`) registered for every backend but the CPU (whose kernel is the fused one) and meta
(the fake). This machine has only a CPU, so the tests reach those implementations through the dispatcher as a CUDA
tensor would (``OpOverload.redispatch`` with the CUDA key) and compare them with independent formulas (torch's own
ops, fla's naive KDA, the layers' modules with the kernels off) and with the CPU kernels."""

import pytest
import torch
import torch.nn.functional as F

from transformers_k3.modeling_kimi_k3 import situ_glu
from transformers_k3.modeling_kimi_k3 import K3_GROUPED_MM, KimiK3Experts, KimiK3SparseMoE
from transformers_k3.ops import cpu_kernel, reference
from transformers_k3.ops.kda.naive import naive_recurrent_kda

from references import make_config, randomize

OPS = torch.ops.transformers_k3
CUDA = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


@pytest.fixture(scope="module", autouse=True)
def library():
    if cpu_kernel.library() is None:
        pytest.skip(f"the operators come with the CPU kernels' build: {cpu_kernel.load_error()}")


def on_gpu(op, *args):
    """``op(*args)`` dispatched as for CUDA tensors (the same CPU tensors: the registered implementation is
    device-agnostic PyTorch)."""
    return op.redispatch(CUDA, *args)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_every_operator_has_an_implementation_for_every_device():
    """Each tensor operator of the build has a kernel for CUDA, XPU, MPS and the generic PrivateUse1 backend, and
    the CPU still runs the fused kernel (registered from csrc/torch_ops.cpp). (The operators defined in Python, KDA's
    chunk and MLA's context attention, have one implementation for every device.)"""
    schemas = {op.name.split("::")[1] for op in torch._C._jit_get_all_schemas() if op.name.startswith("transformers_k3::")}
    tensor_ops = {name for name in schemas if "Tensor" in str(getattr(OPS, name).default._schema)}
    python_ops = {"kda_chunk", "kda_chunk_backward", "mla_context_attention", "mla_context_attention_backward"}
    assert tensor_ops - python_ops == set(reference.OPERATORS)
    for name in reference.OPERATORS:
        qualified = f"transformers_k3::{name}"
        for key in ("CUDA", "XPU", "MPS", "PrivateUse1", "Meta", "CPU"):
            assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(qualified, key), (name, key)
        table = torch._C._dispatch_dump_table(qualified)
        cpu_line = next(line for line in table.splitlines() if line.startswith("CPU:"))
        assert "torch_ops.cpp" in cpu_line, cpu_line


def test_glu_and_its_backward():
    gate, up = torch.randn(7, 40, generator=gen(0)) * 3, torch.randn(7, 40, generator=gen(1)) * 30
    grad = torch.randn(7, 40, generator=gen(2))
    for kind, beta, linear_beta, formula in (
        (1, 4.0, 25.0, lambda a, u: situ_glu(a, u, 4.0, 25.0)),
        (1, 2.5, 0.0, lambda a, u: situ_glu(a, u, 2.5, None)),
        (0, 0.0, 0.0, lambda a, u: F.silu(a) * u),
    ):
        a, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        want = formula(a, u)
        want_grads = torch.autograd.grad(want, [a, u], grad)
        got = on_gpu(OPS.glu.default, gate, up, kind, beta, linear_beta)
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
        got_grads = on_gpu(OPS.glu_backward.default, grad, gate, up, kind, beta, linear_beta)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        for g, k in zip(got_grads, OPS.glu_backward.default(grad, gate, up, kind, beta, linear_beta)):
            torch.testing.assert_close(g, k, atol=1e-5, rtol=1e-5)  # (the CPU kernel)
        torch.testing.assert_close(got, OPS.glu.default(gate, up, kind, beta, linear_beta), atol=1e-5, rtol=1e-5)
    bf = on_gpu(OPS.glu.default, gate.bfloat16(), up.bfloat16(), 1, 4.0, 25.0)
    assert bf.dtype is torch.bfloat16
    assert torch.equal(bf, situ_glu(gate.bfloat16(), up.bfloat16(), 4.0, 25.0))  # (fp32, rounded once)


def test_rms_norm_and_its_backward():
    x, w = torch.randn(3, 5, 48, generator=gen(3)), 1 + 0.2 * torch.randn(48, generator=gen(4))
    grad = torch.randn(3, 5, 48, generator=gen(5))
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6) * ws
    want_grads = torch.autograd.grad(want, [xs, ws], grad)
    torch.testing.assert_close(on_gpu(OPS.rms_norm.default, x, w, 1e-6), want.detach())
    for g, r, k in zip(on_gpu(OPS.rms_norm_backward.default, grad, x, w, 1e-6), want_grads,
                       OPS.rms_norm_backward.default(grad, x, w, 1e-6)):  # fmt: skip
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g, k, atol=1e-5, rtol=1e-5)


def test_router_selection_ranks_ties_and_nan_as_the_kernel_does():
    """Descending biased scores, equal scores to the lower expert id, NaN above every number; the sigmoid
    variants select from torch.sigmoid's scores and return the unbiased chosen ones."""
    scores = torch.tensor([[0.5, 0.7, 0.5, 0.1, 0.7], [0.2, float("nan"), 0.9, 0.9, 0.0]])
    bias = torch.zeros(5)
    want = torch.tensor([[1, 4, 0], [1, 2, 3]])
    assert torch.equal(on_gpu(OPS.router_topk.default, scores, bias, 3), want)
    assert torch.equal(OPS.router_topk.default(scores, bias, 3), want)
    logits = torch.randn(64, 96, generator=gen(6))
    bias = 0.05 * torch.randn(96, generator=gen(7))
    want_index = torch.topk(torch.sigmoid(logits) + bias, 6, dim=-1).indices  # (no ties in random values)
    index = on_gpu(OPS.router_topk.default, torch.sigmoid(logits), bias, 6)
    assert torch.equal(index, want_index)
    index, selected = on_gpu(OPS.router_sigmoid_topk.default, logits, bias, 6)
    assert torch.equal(index, want_index)
    assert torch.equal(selected, torch.sigmoid(logits).gather(1, want_index))
    kernel_index, kernel_selected = OPS.router_sigmoid_topk.default(logits, bias, 6)
    assert torch.equal(kernel_index, index) and torch.equal(kernel_selected, selected)
    assert torch.equal(on_gpu(OPS.sigmoid.default, logits), torch.sigmoid(logits))
    h, w = torch.randn(64, 32, generator=gen(8)), torch.randn(96, 32, generator=gen(9)) / 6
    index, selected = on_gpu(OPS.router_screened_topk.default, h, w, bias, 6, True)
    torch_logits = h @ w.t()
    assert torch.equal(index, torch.topk(torch.sigmoid(torch_logits) + bias, 6, dim=-1).indices)
    torch.testing.assert_close(selected, torch.sigmoid(torch_logits).gather(1, index))


def test_router_backward_is_the_dense_gradient_at_the_chosen_logits():
    h, w = torch.randn(10, 32, generator=gen(10)), torch.randn(24, 32, generator=gen(11)) / 6
    index = torch.topk(torch.randn(10, 24, generator=gen(12)), 4, dim=-1).indices
    grad = torch.randn(10, 4, generator=gen(13))
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    chosen = torch.sigmoid(hs @ ws.t()).gather(1, index)
    want = torch.autograd.grad(chosen, [hs, ws], grad)
    selected = chosen.detach()
    assert torch.equal(on_gpu(OPS.selected_scores.default, h, w, index, selected), selected)
    got = on_gpu(OPS.router_backward.default, grad, h, w, index, selected, True, True)
    kernel = OPS.router_backward.default(grad, h, w, index, selected, True, True)
    for g, r, k in zip(got, want, kernel):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(g, k, atol=1e-6, rtol=1e-5)
    only_w = on_gpu(OPS.router_backward.default, grad, h, w, index, selected, False, True)
    assert only_w[0].numel() == 0 and torch.equal(only_w[1], got[1])


def test_bf16_products():
    x, w = torch.randn(6, 64, generator=gen(14)).bfloat16(), torch.randn(40, 64, generator=gen(15)).bfloat16()
    b = torch.randn(40, generator=gen(16)).bfloat16()
    exact = F.linear(x.double(), w.double())  # (bf16 products are exact; fp32 sums)
    got = on_gpu(OPS.gemm_bf16_f32.default, x, w)
    assert got.dtype is torch.float32
    torch.testing.assert_close(got, exact.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, OPS.gemm_bf16_f32.default(x, w), atol=1e-5, rtol=1e-5)
    # the CPU kernel on every CPU (without the AMX tile unit: fp32 GEMMs 16,384 rows at a time), past a block edge
    long = torch.randn(16384 + 70, 64, generator=gen(17)).bfloat16()
    torch.testing.assert_close(OPS.gemm_bf16_f32.default(long, w), F.linear(long.double(), w.double()).float(),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    for latent, queries in ((long.view(2, -1, 64), x.view(2, 3, 64)),
                            (long.float().view(2, -1, 64), x.float().view(2, 3, 64))):  # (bf16, fp32)
        want = (queries.double() @ latent.double().transpose(1, 2)).float()
        for scores in (on_gpu(OPS.latent_scores.default, latent, queries), OPS.latent_scores.default(latent, queries)):
            assert scores.shape == want.shape and scores.is_contiguous()
            torch.testing.assert_close(scores, want, atol=1e-5, rtol=1e-5)
        # the absorbed attention: the reference through the CUDA key against the kernel (one pass, per-thread parts)
        attention = (on_gpu(OPS.latent_attention.default, latent, queries, 0.2, 48, 1),
                     OPS.latent_attention.default(latent, queries, 0.2, 48, 1))  # fmt: skip
        probs = torch.softmax(0.2 * (queries.double() @ latent.double().transpose(1, 2)), dim=-1)
        want = (probs @ latent[..., :48].double()).float()
        for out in attention:
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        # with a boolean mask (per batch; a query row of batch 1 sees nothing: the mean of the rows)
        mask = torch.rand(2, 1, 1, latent.shape[1], generator=gen(18)) < 0.5
        mask[1] = False
        masked = (on_gpu(OPS.latent_attention.default, latent, queries, 0.2, 48, 1, mask),
                  OPS.latent_attention.default(latent, queries, 0.2, 48, 1, mask))  # fmt: skip
        scores = (0.2 * (queries.double() @ latent.double().transpose(1, 2))).masked_fill(~mask[:, 0], float("-inf"))
        want = (torch.softmax(scores[:1], dim=-1) @ latent[:1, :, :48].double()).float()
        mean = latent[1, :, :48].double().mean(0).float().expand(3, 48)
        for out in masked:
            torch.testing.assert_close(out[:1], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out[1], mean, atol=1e-5, rtol=1e-5)
    for bias in (b, None):
        got = on_gpu(OPS.linear_bf16.default, x, w, bias)
        want = (exact + (0 if bias is None else bias.double())).bfloat16()
        assert got.dtype is torch.bfloat16
        assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
        if cpu_kernel._feature("linear_bf16_available"):
            kernel = OPS.linear_bf16.default(x, w, bias)
            assert (got.float() - kernel.float()).abs().max() <= 2**-7 * want.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_routed_experts_and_their_backward_against_the_module(dtype, transposed):
    """``moe_experts`` against KimiK3Experts' eager forward (the kernels off, fp32), with an expert-parallel
    sentinel id (contributes nothing); its backward against autograd through that forward; the products it saves
    are each pair's gate_up row."""
    cfg = make_config(num_experts=12, num_experts_per_tok=3)
    experts = randomize(KimiK3Experts(cfg), seed=17)
    x = torch.randn(9, experts.hidden_dim, generator=gen(18))
    index = torch.stack([torch.randperm(12, generator=gen(19 + t))[:3] for t in range(9)])
    index[4, 1] = 12  # (a sentinel)
    weights = torch.rand(9, 3, generator=gen(30))
    grad = torch.randn(9, experts.hidden_dim, generator=gen(31))
    leaves = [x.clone().requires_grad_(), weights.clone().requires_grad_()]
    want = experts(leaves[0], index, leaves[1])  # (k3_grouped_mm, no kernel attached: PyTorch)
    want_grads = torch.autograd.grad(want, [*leaves, experts.gate_up_proj, experts.down_proj], grad)
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    operands = [t.to(dtype) for t in (x, weights, gate_up, down)]
    args = (operands[0], index, operands[1], operands[2], operands[3], transposed, *cpu_kernel._activation_args(
        experts.glu))  # fmt: skip
    out, products = on_gpu(OPS.moe_experts.default, *args, True, True)
    assert out.dtype is dtype and products.shape == (27, 2 * cfg.moe_intermediate_size)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype is torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), want.detach(), **tol)
    pair = 4 * 3 + 0
    weight = experts.gate_up_proj[index[4, 0]].to(dtype).float()
    torch.testing.assert_close(products[pair], operands[0][4].float() @ weight.t(), atol=1e-5, rtol=1e-5)
    assert (products[4 * 3 + 1] == 0).all()  # (the sentinel's)
    grads = on_gpu(OPS.moe_experts_backward.default, grad.to(dtype), *args[:5], products, *args[5:], True,
                   [True, True, True, True])  # fmt: skip
    for g, w, operand in zip(grads, want_grads, operands):
        assert g.dtype is operand.dtype
        if transposed and w.dim() == 3:
            w = w.transpose(1, 2)
        torch.testing.assert_close(g.float(), w, **tol)
    masked = on_gpu(OPS.moe_experts_backward.default, grad.to(dtype), *args[:5], products, *args[5:], True,
                    [False, True, False, False])  # fmt: skip
    assert [t.numel() for t in masked] == [0, 27, 0, 0] and torch.equal(masked[1], grads[1])
    if dtype is torch.float32 and not transposed and cpu_kernel._feature("small_gemm_available"):
        kernel_out, _ = OPS.moe_experts.default(*args, True, True)
        torch.testing.assert_close(out, kernel_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", [{}, dict(num_shared_experts=0), dict(latent_moe_use_norm=False),
                                     dict(routed_expert_hidden_size=None), dict(hidden_act="silu")])
def test_moe_decode_is_the_layer_as_its_modules_compute_it(dtype, variant):
    """``moe_decode`` against KimiK3SparseMoE's modules with the kernels off, on the arguments the layer's decode
    step hands the CPU kernel (`MoeDecode`), and against that kernel."""
    cfg = make_config(num_experts=16, num_experts_per_tok=4, _experts_implementation=K3_GROUPED_MM, **variant)
    layer = randomize(KimiK3SparseMoE(cfg), seed=40).to(dtype)
    y = torch.randn(3, cfg.hidden_size, generator=gen(41)).to(dtype)
    gate, experts, shared = layer.gate, layer.experts, layer.shared_experts
    down, norm, up = layer.routed_expert_down_proj, layer.routed_expert_norm, layer.routed_expert_up_proj
    linears = (() if down is None else (down, up)) + (() if shared is None else (shared.gate_proj, shared.up_proj, shared.down_proj))
    weights = [m.weight for m in linears]
    decode = cpu_kernel.MoeDecode(
        dtype, gate.weight, gate.e_score_correction_bias, gate.top_k, gate.renormalize, gate.routed_scaling_factor,
        weights[0] if down is not None else None, None if norm is None else norm.weight,
        0.0 if norm is None else norm.variance_epsilon, weights[1] if down is not None else None,
        experts.gate_up_proj, experts.down_proj, experts.glu,
        tuple(weights[-3:]) if shared is not None else None,
    )  # fmt: skip
    if not decode.usable:
        pytest.skip("the decode kernel does not take this layer here (its arguments come from MoeDecode)")
    with torch.no_grad():
        got = on_gpu(OPS.moe_decode.default, y, *decode.args)
        want = layer._modules_forward(y)
        kernel = decode(y)
    assert got.dtype is dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype is torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    if kernel is not None:
        torch.testing.assert_close(got.float(), kernel.float(), **tol)


def test_kda_chunk_forward_against_fla_naive_on_packed_sequences():
    """Sequences at arbitrary token offsets, each from its own state (written back in place), against fla's naive
    recurrence per sequence; tokens outside every sequence are zeros. The CPU kernel computes the same."""
    heads, dim, total = 2, 16, 40
    q = F.normalize(torch.randn(1, total, heads, dim, generator=gen(50)), dim=-1)
    k = F.normalize(torch.randn(1, total, heads, dim, generator=gen(51)), dim=-1)
    v = torch.randn(1, total, heads, dim, generator=gen(52))
    g = -torch.rand(1, total, heads, dim, generator=gen(53))
    beta = torch.rand(1, total, heads, generator=gen(54))
    state = torch.randn(3, heads, dim, dim, generator=gen(55))
    starts, lengths = torch.tensor([0, 13, 30]), torch.tensor([13, 15, 7])
    scale = dim**-0.5
    got_state = state.clone()
    out = on_gpu(OPS.kda_chunk_forward.default, q, k, v, g, beta, got_state, starts, lengths, 8, scale)
    kernel_state = state.clone()
    kernel_out = OPS.kda_chunk_forward.default(q, k, v, g, beta, kernel_state, starts, lengths, 8, scale)
    for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        part = [t[:, s : s + n] for t in (q, k, v, g, beta)]
        o, final = naive_recurrent_kda(*part, scale=scale, initial_state=state[i : i + 1], output_final_state=True)
        torch.testing.assert_close(out[:, s : s + n], o, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got_state[i], final[0], atol=2e-5, rtol=1e-4)
    assert (out[:, 28:30] == 0).all()
    torch.testing.assert_close(out[:, :28], kernel_out[:, :28], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out[:, 30:37], kernel_out[:, 30:37], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_state, kernel_state, atol=2e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="lies outside"):
        on_gpu(OPS.kda_chunk_forward.default, q, k, v, g, beta, state.clone(), starts, lengths + 10, 8, scale)
