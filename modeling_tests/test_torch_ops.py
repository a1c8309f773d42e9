"""The fused CPU kernels as PyTorch operators (torch.ops.transformers_k3.*, csrc/torch_ops.cpp): each passes
torch.library.opcheck (its schema, its fake implementation against the real one, its autograd registration and,
through AOTAutograd with dynamic shapes, a traced forward and backward equal to eager) and computes what the
PyTorch reference computes; torch.compile(fullgraph=True) runs one inside its graph."""

import pytest
import torch
import torch.nn.functional as F

from transformers_k3.modeling_kimi_k3 import situ_glu
from transformers_k3.modeling_kimi_k3 import K3_GROUPED_MM, KimiK3Experts
from transformers_k3.ops import cpu_kernel
from transformers_k3.ops.kernel_layers import kernelize
from transformers_k3.ops.kda import chunk_kda

from references import make_config, make_inputs, make_moe, modules_path, randomize, ref_experts

ops = torch.ops.transformers_k3


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if cpu_kernel.library() is None:
        pytest.skip(f"fused CPU kernels unavailable: {cpu_kernel.load_error()}")


def need(feature: str):
    if not getattr(ops, feature)():
        pytest.skip(f"this build or CPU lacks {feature} (AVX-512 / AVX2 / AMX)")


def opcheck(op, args, **kwargs):
    torch.library.opcheck(op, args, kwargs)


def rand(*shape, seed=0, dtype=torch.float32, grad=False):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x.requires_grad_() if grad else x


def test_every_operator_is_registered_with_a_fake_implementation():
    expected = {"kda_chunk_forward", "router_topk", "router_sigmoid_topk", "router_screened_topk", "sigmoid",
                "selected_scores", "router_backward", "gemm_bf16_f32", "latent_scores", "latent_attention",
                "linear_bf16", "glu", "glu_backward", "rms_norm", "rms_norm_backward", "moe_experts",
                "moe_experts_backward", "moe_decode"}  # fmt: skip
    for name in expected:
        op = getattr(ops, name).default
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"), name  # (register_fake)
    for name in ("rms_norm", "glu", "gemm_bf16_f32", "selected_scores", "moe_experts"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(getattr(ops, name).default.name(), "Autograd"), name


def test_rms_norm():
    x, w = rand(3, 7, 48, grad=True), (1 + 0.1 * rand(48, seed=1)).requires_grad_()
    opcheck(ops.rms_norm.default, (x, w, 1e-6))
    out = ops.rms_norm(x, w, 1e-6)
    ref = F.rms_norm(x, (48,), eps=1e-6) * w
    assert torch.equal(out, ref)  # (the forward is those two ops)
    probe = rand(3, 7, 48, seed=2)
    got = torch.autograd.grad((out * probe).sum(), (x, w))
    want = torch.autograd.grad((ref * probe).sum(), (x, w))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    opcheck(ops.rms_norm_backward.default, (probe, x.detach(), w.detach(), 1e-6))


@pytest.mark.parametrize("activation", [("silu",), ("situ", 4.0, 25.0), ("situ", 2.0, None)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_glu(activation, dtype):
    need("small_gemm_available")
    gate, up = rand(5, 3, 40, dtype=dtype, grad=True), rand(5, 3, 40, seed=1, dtype=dtype, grad=True)
    kind, beta, linear_beta = cpu_kernel._activation_args(activation)
    opcheck(ops.glu.default, (gate, up, kind, beta, linear_beta))
    out = ops.glu(gate, up, kind, beta, linear_beta)
    assert out.dtype == dtype
    g32, u32 = (t.detach().float().requires_grad_() for t in (gate, up))
    ref = F.silu(g32) * u32 if kind == 0 else situ_glu(g32, u32, beta, activation[2])
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), ref, **tolerance)
    probe = rand(5, 3, 40, seed=2)
    got = torch.autograd.grad((out.float() * probe).sum(), (gate, up))
    want = torch.autograd.grad((ref * probe).sum(), (g32, u32))
    for g, r in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), r, **tolerance)
    opcheck(ops.glu_backward.default, (probe.to(dtype), gate.detach(), up.detach(), kind, beta, linear_beta))


def test_router_topk_and_sigmoid_topk():
    scores, bias = rand(33, 40).sigmoid(), 0.1 * rand(40, seed=1)
    opcheck(ops.router_topk.default, (scores, bias, 6))
    assert torch.equal(ops.router_topk(scores, bias, 6), torch.topk(scores + bias, 6).indices)
    need("sigmoid_available")
    logits = rand(33, 40, seed=2)
    opcheck(ops.router_sigmoid_topk.default, (logits, bias, 6))
    index, selected = ops.router_sigmoid_topk(logits, bias, 6)
    assert torch.equal(index, torch.topk(torch.sigmoid(logits) + bias, 6).indices)
    assert cpu_kernel.same_bits(selected, torch.sigmoid(logits).gather(1, index))
    probe = rand(64, 64, seed=3)  # (a multiple of torch's vector width: torch's loop has no scalar tail)
    opcheck(ops.sigmoid.default, (probe,))
    assert cpu_kernel.same_bits(ops.sigmoid(probe), torch.sigmoid(probe))


def test_selected_scores_backward_is_the_dense_gradient_at_the_chosen_experts():
    h, w = rand(17, 24, grad=True), rand(30, 24, seed=1, grad=True)
    index = torch.topk(h.detach() @ w.detach().t(), 4).indices
    dense = torch.sigmoid(h @ w.t()).gather(1, index)
    opcheck(ops.selected_scores.default, (h, w, index, dense.detach()))
    out = ops.selected_scores(h, w, index, dense.detach())
    assert torch.equal(out, dense.detach())
    probe = rand(17, 4, seed=2)
    got = torch.autograd.grad((out * probe).sum(), (h, w))
    want = torch.autograd.grad((dense * probe).sum(), (h, w))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    opcheck(ops.router_backward.default, (probe, h.detach(), w.detach(), index, dense.detach(), True, False))


def test_router_screened_topk():
    need("amx_available")
    x, w, bias = rand(40, 64), rand(50, 64, seed=1), 0.1 * rand(50, seed=2)
    opcheck(ops.router_screened_topk.default, (x, w, bias, 8, True))
    index, selected = ops.router_screened_topk(x, w, bias, 8, True)
    ref_index, ref_selected = ops.router_sigmoid_topk(x @ w.t(), bias, 8)
    assert torch.equal(index, ref_index)
    torch.testing.assert_close(selected, ref_selected, atol=1e-6, rtol=1e-5)


def test_gemm_bf16_f32():
    """On every CPU: the tile unit's GEMM where there is one, fp32 GEMMs on fp32 copies elsewhere."""
    x, w = rand(20, 64, dtype=torch.bfloat16, grad=True), rand(24, 64, seed=1, dtype=torch.bfloat16, grad=True)
    opcheck(ops.gemm_bf16_f32.default, (x, w))
    torch.testing.assert_close(ops.gemm_bf16_f32(x, w), F.linear(x.float(), w.float()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_scores(dtype):
    """``queries @ latent^T`` as contiguous fp32 ``[B, M, S]``: the sums of the exact products in fp32 (float64's
    within fp32 rounding), for fp32 and bf16 operands; a misfit named."""
    latent, queries = rand(2, 37, 48, dtype=dtype), rand(2, 5, 48, seed=1, dtype=dtype)
    opcheck(ops.latent_scores.default, (latent, queries))
    got = ops.latent_scores(latent, queries)
    want = queries.double() @ latent.double().transpose(1, 2)
    assert got.dtype is torch.float32 and got.shape == (2, 5, 37) and got.is_contiguous()
    assert (got.double() - want).abs().max() <= 2e-6 * want.abs().max()
    with pytest.raises(RuntimeError, match="queries"):
        ops.latent_scores(latent, queries[..., :-1])


def attention_float64(latent, queries, scale, value_dim, new_tokens):
    """The absorbed attention from its definition, in float64: softmax over the visible latent rows (query row
    ``m`` is new token ``m % new_tokens`` of the latent's last ``new_tokens``), weights times their value columns."""
    latent, queries = latent.double(), queries.double()
    seq = latent.shape[1]
    out = torch.empty(*queries.shape[:2], value_dim, dtype=torch.float64)
    for b in range(queries.shape[0]):
        for m in range(queries.shape[1]):
            last = seq - new_tokens + m % new_tokens
            weights = torch.softmax(scale * (latent[b, : last + 1] @ queries[b, m]), dim=0)
            out[b, m] = weights @ latent[b, : last + 1, :value_dim]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch, seq, rows, dim, value_dim, new_tokens",
    [(1, 1, 4, 48, 32, 1), (2, 37, 6, 48, 32, 2), (1, 1500, 5, 37, 20, 1), (3, 600, 12, 96, 64, 3)],
)  # fmt: skip
def test_latent_attention(dtype, batch, seq, rows, dim, value_dim, new_tokens):
    """softmax(scale q c^T) c[:, :value_dim] in one pass: float64's within fp32 rounding, for fp32 and bf16 latents,
    widths that are no multiple of the vector width, query rows no multiple of the kernel's block, end-aligned
    causality over several new tokens, a latent long enough to be split between threads (whose partial sums are
    merged), and a latent that is a prefix of a longer buffer (as a cache's is, read without a copy)."""
    buffer = rand(batch, seq + 9, dim, dtype=dtype)
    latent, queries = buffer[:, :seq], rand(batch, rows, dim, seed=1, dtype=dtype)
    opcheck(ops.latent_attention.default, (latent, queries, 0.3, value_dim, new_tokens))
    got = ops.latent_attention(latent, queries, 0.3, value_dim, new_tokens)
    want = attention_float64(latent, queries, 0.3, value_dim, new_tokens)
    assert got.dtype is torch.float32 and got.shape == want.shape
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    contiguous = ops.latent_attention(latent.contiguous(), queries, 0.3, value_dim, new_tokens)
    assert torch.equal(got, contiguous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["per batch", "per head", "broadcast", "static slots"])
def test_latent_attention_with_a_boolean_mask(dtype, layout):
    """With a boolean mask the mask alone says which rows each query sees (no end alignment): float64's from the
    definition within fp32 rounding, for a mask per batch, per head, or broadcast over both, and a static cache's
    slots (the rows past the tokens unseen by every query: tiles the kernel skips, with a latent long enough to be
    split between threads); a query the mask leaves no row gets the mean of all rows, as the masked softmax of the
    two passes gives (their masked logits all the lowest fp32), not a NaN."""
    batch, seq, heads, new_tokens, dim, value_dim = 2, 1300, 3, 2, 40, 24
    latent = rand(batch, seq, dim, dtype=dtype)
    queries = rand(batch, heads * new_tokens, dim, seed=1, dtype=dtype)
    gen = torch.Generator().manual_seed(2)
    shape = {"per batch": (batch, 1), "per head": (batch, heads), "broadcast": (1, 1), "static slots": (1, 1)}[layout]
    if layout == "static slots":  # 700 tokens held, the 2 new ones the last of them
        limit = 700 - new_tokens + 1 + torch.arange(new_tokens)
        mask = (torch.arange(seq)[None, :] < limit[:, None]).expand(*shape, new_tokens, seq)
    else:
        mask = torch.rand(*shape, new_tokens, seq, generator=gen) < 0.3
        mask[0, 0, 1] = False  # (query rows 1, 3, 5 of batch 0 (per head: row 1) see nothing)
    opcheck(ops.latent_attention.default, (latent, queries, 0.3, value_dim, new_tokens, mask))
    got = ops.latent_attention(latent, queries, 0.3, value_dim, new_tokens, mask)
    full = mask.expand(batch, heads, new_tokens, seq).reshape(batch, heads * new_tokens, seq)
    lat, q = latent.double(), queries.double()
    want = torch.empty(batch, heads * new_tokens, value_dim, dtype=torch.float64)
    for b in range(batch):
        for m in range(heads * new_tokens):
            seen = full[b, m]
            if not seen.any():
                want[b, m] = lat[b, :, :value_dim].mean(0)
                continue
            weights = torch.softmax(0.3 * (lat[b, seen] @ q[b, m]), dim=0)
            want[b, m] = weights @ lat[b, seen, :value_dim]
    assert not got.isnan().any()
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_latent_attention_propagates_a_nan():
    """A NaN in a query or in a seen latent row, or logits that are all -inf, give NaN as torch's softmax does,
    never a finite answer (the mean the mask's empty rows get), also when the row falls in one thread's part."""
    nan, inf = float("nan"), float("inf")
    latent, queries = rand(1, 10, 24), rand(1, 2, 24, seed=1)
    queries[0, 0, 0] = nan
    out = ops.latent_attention(latent, queries, 0.1, 20, 1)
    assert out[0, 0].isnan().all() and not out[0, 1].isnan().any()
    latent, queries = rand(1, 1024, 24), rand(1, 2, 24, seed=1)  # (two parts on two threads)
    latent[0, 3, 0] = nan
    mask = torch.zeros(1, 1, 1, 1024, dtype=torch.bool)
    mask[..., :10] = mask[..., 600:700] = True
    assert ops.latent_attention(latent, queries, 0.1, 20, 1, mask).isnan().all()
    latent, queries = rand(1, 10, 24).abs() + 0.1, rand(1, 2, 24, seed=1)
    queries[0, 0, 0] = -inf  # (every logit of query 0 is -inf)
    out = ops.latent_attention(latent, queries, 0.1, 20, 1)
    assert out[0, 0].isnan().all() and not out[0, 1].isnan().any()


def test_latent_attention_names_a_misfit():
    latent, queries = rand(2, 10, 48), rand(2, 6, 48, seed=1)
    with pytest.raises(RuntimeError, match="queries"):
        ops.latent_attention(latent, queries[..., :-1], 0.3, 32, 1)
    with pytest.raises(RuntimeError, match="value_dim"):
        ops.latent_attention(latent, queries, 0.3, 49, 1)
    with pytest.raises(RuntimeError, match="new_tokens"):
        ops.latent_attention(latent, queries, 0.3, 32, 4)  # (6 rows are not whole heads of 4 new tokens)
    with pytest.raises(RuntimeError, match="new_tokens"):
        ops.latent_attention(latent[:, :1], queries, 0.3, 32, 2)  # (more new tokens than latent rows)
    with pytest.raises(RuntimeError, match="mask"):
        ops.latent_attention(latent, queries, 0.3, 32, 1, torch.ones(2, 1, 1, 9, dtype=torch.bool))  # (9 rows, not 10)
    with pytest.raises(RuntimeError, match="mask"):
        ops.latent_attention(latent, queries, 0.3, 32, 1, torch.ones(2, 1, 1, 10))  # (an additive mask)


@pytest.mark.parametrize("rows", [1, 4, 15, 31])
def test_linear_bf16(rows):
    need("linear_bf16_available")
    x, w, b = rand(rows, 64, dtype=torch.bfloat16), rand(48, 64, seed=1, dtype=torch.bfloat16), rand(48, seed=2)
    b = b.bfloat16()
    for bias in (b, None):
        opcheck(ops.linear_bf16.default, (x, w, bias))
        out = ops.linear_bf16(x, w, bias)
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float()).bfloat16()
        torch.testing.assert_close(out, ref, atol=0, rtol=2**-7)  # (one rounding apart at most)


@pytest.mark.parametrize("case", ["whole", "packed"])
def test_kda_chunk_forward(case):
    q, k, v, g, beta, h0 = make_inputs(1 if case == "packed" else 2, 70, 2, 16, 16, "k3", seed=3)
    if case == "packed":
        edges = torch.tensor([0, 30, 30, 70])
        h0 = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(4))
        starts, lengths = edges[:-1], edges[1:] - edges[:-1]
    else:
        starts, lengths = torch.tensor([0, 70]), torch.tensor([70, 70])
    scale = 16**-0.5
    state = h0.clone()
    opcheck(ops.kda_chunk_forward.default, (q, k, v, g, beta, state.clone(), starts, lengths, 64, scale))
    out = ops.kda_chunk_forward(q, k, v, g, beta, state, starts, lengths, 64, scale)
    with torch.no_grad():
        cu = None if case == "whole" else edges
        ref_o, ref_s = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                 cu_seqlens=cu)  # fmt: skip
    torch.testing.assert_close(out, ref_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_s, atol=1e-4, rtol=1e-4)  # (updated in place: Tensor(a!))
    with pytest.raises(RuntimeError, match="lies outside"):
        ops.kda_chunk_forward(q, k, v, g, beta, state, starts, lengths + 1, 64, scale)


@pytest.mark.parametrize("small", [False, True], ids=["sgemm", "small_gemm"])
@pytest.mark.parametrize("transposed", [False, True], ids=["stored", "transposed"])
def test_moe_experts(small, transposed):
    if small:
        need("small_gemm_available")
    cfg = make_config(num_experts=16, _experts_implementation=K3_GROUPED_MM)
    experts = randomize(KimiK3Experts(cfg))
    gen = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(37)])
    x = rand(37, 32, seed=1, grad=True)
    w = torch.rand(37, 4, generator=gen).requires_grad_()
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if transposed:
        gate_up, down = (p.detach().transpose(1, 2).contiguous().requires_grad_() for p in (gate_up, down))
    kind, beta, linear_beta = cpu_kernel._activation_args(experts.glu)
    args = (x, idx, w, gate_up, down, transposed, kind, beta, linear_beta, small)
    for save in (False, True):
        opcheck(ops.moe_experts.default, (*args, save))
    out, products = ops.moe_experts(*args, True)
    assert products.shape == ((37 * 4, 2 * experts.intermediate_dim) if small else (0,))
    probe = rand(37, 32, seed=5)
    grads = torch.autograd.grad((out * probe).sum(), (x, w, gate_up, down))
    ref_out, ref_grads = ref_experts(experts, x, idx, w, probe)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        got = got.transpose(1, 2) if transposed and got.dim() == 3 else got
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    opcheck(ops.moe_experts_backward.default,
            (probe, *detached[:5], products.detach(), *detached[5:], [True, False, True, True]))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_decode(dtype):
    """The whole-layer decode operator on a layer's weights (`MoeDecode`, as the layer's kernel builds it) passes
    opcheck and computes what the layer's modules compute, as does the kernelized layer; a bias of the wrong shape
    is a named error."""
    if cpu_kernel.moe_decode_max_tokens() == 0:
        pytest.skip("the fused decode step needs AVX-512 or AVX2")
    cfg, moe = make_moe(_experts_implementation=K3_GROUPED_MM)
    kernelize(moe)
    moe = moe.to(dtype)
    moe.gate.e_score_correction_bias = moe.gate.e_score_correction_bias.float()  # (fp32, as a bf16 load keeps it)
    gate, experts, shared = moe.gate, moe.experts, moe.shared_experts
    down, norm, up = moe.routed_expert_down_proj, moe.routed_expert_norm, moe.routed_expert_up_proj
    shared_weights = tuple(m.weight.detach() for m in (shared.gate_proj, shared.up_proj, shared.down_proj))
    kernel = cpu_kernel.MoeDecode(dtype, gate.weight.detach(), gate.e_score_correction_bias, gate.top_k,
                                  gate.renormalize, gate.routed_scaling_factor, down.weight.detach(),
                                  norm.weight.detach(), norm.variance_epsilon, up.weight.detach(),
                                  experts.gate_up_proj.detach(), experts.down_proj.detach(), experts.glu,
                                  shared_weights)  # fmt: skip
    assert kernel.usable
    y = rand(3, cfg.hidden_size, seed=7, dtype=dtype)
    weights = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in kernel.args)  # (no derivative)
    opcheck(ops.moe_decode.default, (y, *weights))
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ops.moe_decode(y, *kernel.args), modules_path(moe, y), **tolerance)
    with torch.no_grad():
        torch.testing.assert_close(moe(y), modules_path(moe, y), **tolerance)
    with pytest.raises(RuntimeError, match="bias must have shape"):
        ops.moe_decode(y, kernel.args[0], kernel.args[1][:-1], *kernel.args[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_decode_declines_weights_it_does_not_take(dtype):
    """`MoeDecode` is usable on the layer's plain weights (an fp32 router in a bf16 layer included) and declines,
    so that the modules run, a weight in another dtype, a non-contiguous or meta weight and a tensor subclass (a
    bf16 selection bias, from a model cast with .to(), it upcasts)."""
    if cpu_kernel.moe_decode_max_tokens() == 0:
        pytest.skip("the fused decode step needs AVX-512 or AVX2")
    cfg, moe = make_moe(_experts_implementation=K3_GROUPED_MM)
    moe = moe.to(dtype)
    moe.gate.e_score_correction_bias = moe.gate.e_score_correction_bias.float()  # (fp32, as a bf16 load keeps it)
    gate, experts, shared = moe.gate, moe.experts, moe.shared_experts
    down, norm, up = moe.routed_expert_down_proj, moe.routed_expert_norm, moe.routed_expert_up_proj
    linears = (() if down is None else (down, up)) + (() if shared is None else (shared.gate_proj, shared.up_proj, shared.down_proj))
    weights = {"router": gate.weight, "bias": gate.e_score_correction_bias, "down_latent": down.weight,
               "norm": norm.weight, "up_latent": up.weight, "gate_up": experts.gate_up_proj, "down": experts.down_proj,
               "shared_gate": shared.gate_proj.weight}  # fmt: skip

    def usable(**replaced):
        w = {name: replaced.get(name, t).detach() for name, t in weights.items()}
        shared_weights = (w["shared_gate"], shared.up_proj.weight.detach(), shared.down_proj.weight.detach())
        return cpu_kernel.MoeDecode(dtype, w["router"], w["bias"], gate.top_k, gate.renormalize,
                                    gate.routed_scaling_factor, w["down_latent"], w["norm"], norm.variance_epsilon,
                                    w["up_latent"], w["gate_up"], w["down"], experts.glu,
                                    shared_weights).usable  # fmt: skip

    class Marked(torch.Tensor):
        pass

    assert usable()
    assert usable(router=gate.weight.float())
    other = torch.float16 if dtype is torch.bfloat16 else torch.bfloat16
    for name in ("down_latent", "norm", "up_latent", "gate_up", "down", "shared_gate"):
        assert not usable(**{name: weights[name].to(other)}), name
        assert not usable(**{name: weights[name].to("meta")}), name
        assert not usable(**{name: weights[name].detach().as_subclass(Marked)}), name
    assert usable(bias=weights["bias"].bfloat16())  # (upcast: the router selects on bias.float() as well)
    assert not usable(router=weights["router"].to(other))
    assert not usable(gate_up=weights["gate_up"].transpose(1, 2).contiguous().transpose(1, 2))


def test_moe_decode_of_a_layer_cast_to_bf16_equals_its_modules():
    """A layer cast with ``.to(bf16)`` (its selection bias cast too, unlike a bf16 load) decodes, kernelized, to
    what its plain modules compute."""
    cfg, moe = make_moe(_experts_implementation=K3_GROUPED_MM)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.randn(cfg.num_experts, generator=torch.Generator().manual_seed(3)))
    moe = moe.to(torch.bfloat16)
    assert moe.gate.e_score_correction_bias.dtype == torch.bfloat16
    y = rand(1, cfg.hidden_size, seed=7, dtype=torch.bfloat16)
    want = modules_path(moe, y)
    kernelize(moe)
    with torch.no_grad():
        got = moe(y)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", ["rms_norm", "glu"])
def test_compiled_graph_calls_the_kernel_without_a_graph_break(name):
    """torch.compile(fullgraph=True) over an operator: traced through its fake implementation, the kernel runs
    inside the compiled graph (a graph break would raise here), forward and backward."""
    if name == "glu":
        need("small_gemm_available")
        x, y = rand(6, 40, grad=True), rand(6, 40, seed=1, grad=True)

        def fn(a, b):
            return ops.glu(a, b, 1, 4.0, 25.0) * 2.0

    else:
        x, y = rand(6, 40, grad=True), (1 + 0.1 * rand(40, seed=1)).requires_grad_()

        def fn(a, b):
            return ops.rms_norm(a, b, 1e-6) * 2.0

    torch._dynamo.reset()
    counts = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counts)
    out = compiled(x, y)
    graph = "\n".join(str(g.graph) for g in counts.graphs)
    assert counts.frame_count == 1 and f"transformers_k3.{name}" in graph
    torch.testing.assert_close(out, fn(x, y), atol=0, rtol=0)
    got = torch.autograd.grad(out.sum(), (x, y))
    want = torch.autograd.grad(fn(x, y).sum(), (x, y))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, atol=0, rtol=0)
    inductor = torch.compile(fn, fullgraph=True)  # the default backend too, forward and backward
    torch.testing.assert_close(inductor(x, y), fn(x, y), atol=1e-6, rtol=1e-6)


def test_layers_do_not_reach_the_kernel_module():
    """Whether a fused kernel runs is decided in ops/: neither modeling file imports `ops.cpu_kernel` or names it
    in code (docstrings may), and none inspects modules' hooks (the checks before the fused whole-layer step live
    in `ops.moe.attach_sparse_moe`, run once by `kernelize`); transformers' `force_accelerate_hooks` fires hooks,
    it does not inspect them."""
    import ast
    import pathlib

    import transformers_k3

    found = []
    package = pathlib.Path(transformers_k3.__file__).parent
    for path in (package / "modeling_kimi_k3.py", package / "modeling_kimi_k3_vl.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            else:
                continue
            # (module hook tables are private, ``_forward_hooks``...; transformers' force_accelerate_hooks is a socket)
            if any("cpu_kernel" in n or n == "ctypes" or (n.startswith("_") and n.endswith("_hooks"))
                   or n in HOOK_CHECKS for n in names):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []


HOOK_CHECKS = {"plain_linears", "unhooked", "_any_global_hooks", "plain_modules", "logits_observed"}
