"""Routed experts on packed MXFP4 weights (issue 46, `transformers_k3.ops.mxfp4`): the grouped product
``transformers_k3::mxfp4_grouped_mm`` (C++ kernel on CPU, PyTorch elsewhere and without the kernels) and the experts'
weighted sum over it, forward and backward with respect to the activations, against float64 references of the
dequantized math (each expert's weight from `conversion.quant.dequantize_mxfp4`), for fp32 and bf16 activations."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch._C import DispatchKey

from transformers_k3.conversion.quant import QuantFormatError, dequantize_mxfp4, quantize_mxfp4_release
from transformers_k3.modeling_kimi_k3 import situ_glu
from transformers_k3.modeling_kimi_k3 import K3_GROUPED_MM, KimiK3Experts
from transformers_k3.ops import cpu_kernel, mxfp4, mxfp4_torch
from transformers_k3.ops.kernel_layers import kernelize
from transformers_k3.quantization_kimi_k3 import KimiK3PackedExperts

from references import make_config, make_moe, modules_path, ref_moe

FP32_EPS, BF16_ULP = 2.0**-24, 2.0**-8


def gen(seed):
    return torch.Generator().manual_seed(seed)


def packed_weights(experts, n, k, seed=0, low=118, high=131):
    """Random codes (every nibble, -0 included) and E8M0 scales in [low, high)."""
    packed = torch.randint(0, 256, (experts, n, k // 2), generator=gen(seed), dtype=torch.uint8)
    scale = torch.randint(low, high, (experts, n, k // 32), generator=gen(seed + 1), dtype=torch.uint8)
    return packed, scale


def weights64(packed, scale):
    return torch.stack([dequantize_mxfp4(packed[e], scale[e], torch.float64) for e in range(packed.shape[0])])


def grouped64(rows, w64, counts, transpose=True):
    """float64 rows of expert e times W_e^T (forward) or W_e (backward); rows after the groups zero."""
    out = torch.zeros(rows.shape[0], w64.shape[1] if transpose else w64.shape[2], dtype=torch.float64)
    start = 0
    for e, count in enumerate(counts):
        w = w64[e].t() if transpose else w64[e]
        out[start : start + count] = rows[start : start + count].double() @ w
        start += count
    return out, start


def assert_sum_close(got, want, bound, dtype):
    """``got`` equals the float64 ``want`` up to fp32 rounding of sums (``bound``: the sums of |products|, times
    the row length as a worst-case error factor) and, for bf16, one rounding of the result."""
    err = (got.double() - want).abs()
    tol = bound * FP32_EPS + (want.abs() * BF16_ULP if dtype == torch.bfloat16 else 0.0) + 1e-30
    assert bool((err <= tol).all()), f"max excess {float((err - tol).max())}"


CASES = [  # (experts, N, K, rows per expert, extra rows after the groups)
    (3, 40, 64, [5, 0, 7], 2),
    (4, 8, 32, [1, 1, 0, 1], 0),  # a decode step: one row per hit expert
    (2, 37, 96, [131, 3], 1),  # odd counts, more rows than a row block, N not a multiple of 4
    (5, 20, 1024, [0, 9, 2, 0, 70], 0),  # a wide K: tiles of few rows
    (1, 5, 32, [0], 3),  # nothing routed
    (6, 64, 128, [1, 4, 5, 0, 3, 2], 0),  # both kernel paths in one call
]


@pytest.fixture(scope="module")
def kernels():
    if cpu_kernel.library() is None:
        pytest.skip(f"fused CPU kernels unavailable: {cpu_kernel.load_error()}")


def grouped(path, rows, packed, scale, offsets, forward=True):
    if path == "pytorch":
        fn = mxfp4_torch.mxfp4_grouped_mm if forward else mxfp4_torch.mxfp4_grouped_mm_backward
        return fn(rows, packed, scale, offsets)
    op = torch.ops.transformers_k3.mxfp4_grouped_mm if forward else torch.ops.transformers_k3.mxfp4_grouped_mm_backward
    if path == "kernel":
        return op.default(rows, packed, scale, offsets)
    # the implementation every non-CPU device runs (CompositeExplicitAutograd), on these CPU tensors
    return op.default.redispatch(torch._C.DispatchKeySet(DispatchKey.CUDA), rows, packed, scale, offsets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", ["pytorch", "kernel", "other_device"])
def test_grouped_product_and_its_backward_match_float64(path, case, dtype, request):
    if path != "pytorch":
        request.getfixturevalue("kernels")
    experts, n, k, counts, extra = case
    packed, scale = packed_weights(experts, n, k, seed=len(counts))
    w64 = weights64(packed, scale)
    rows = sum(counts) + extra
    for offsets_dtype in (torch.int64, torch.int32):
        offsets = torch.tensor(counts).cumsum(0).to(offsets_dtype)
        x = (torch.randn(rows, k, generator=gen(3)) * 4).to(dtype)
        want, _ = grouped64(x, w64, counts)
        bound, _ = grouped64(x.abs(), w64.abs(), counts)
        got = grouped(path, x, packed, scale, offsets)
        assert got.dtype == dtype and got.shape == (rows, n)
        assert_sum_close(got, want, bound * k, dtype)

        grad = torch.randn(rows, n, generator=gen(4)).to(dtype)
        want_b, _ = grouped64(grad, w64, counts, transpose=False)
        bound_b, _ = grouped64(grad.abs(), w64.abs(), counts, transpose=False)
        got_b = grouped(path, grad, packed, scale, offsets, forward=False)
        assert got_b.dtype == dtype and got_b.shape == (rows, k)
        assert_sum_close(got_b, want_b, bound_b * n, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel_on", [True, False])
def test_autograd_reaches_the_activations(dtype, kernel_on):
    experts, n, k, counts = 4, 48, 64, [3, 0, 1, 6]
    packed, scale = packed_weights(experts, n, k, seed=7)
    w64 = weights64(packed, scale)
    offsets = torch.tensor(counts).cumsum(0)
    x = torch.randn(sum(counts), k, generator=gen(8)).to(dtype).requires_grad_()
    grad = torch.randn(sum(counts), n, generator=gen(9)).to(dtype)
    out = mxfp4.packed_grouped_mm(x, packed, scale, offsets, kernel=kernel_on)
    out.backward(grad)
    assert not packed.requires_grad and x.grad.dtype == dtype
    want, _ = grouped64(grad, w64, counts, transpose=False)
    bound, _ = grouped64(grad.abs(), w64.abs(), counts, transpose=False)
    assert_sum_close(x.grad, want, bound * n, dtype)


def test_float64_rows_take_the_pytorch_path_exactly():
    packed, scale = packed_weights(2, 6, 32, seed=11)
    x = torch.randn(5, 32, dtype=torch.float64, generator=gen(12), requires_grad=True)
    offsets = torch.tensor([2, 5])
    torch.autograd.gradcheck(lambda t: mxfp4.packed_grouped_mm(t, packed, scale, offsets), (x,))
    want, _ = grouped64(x.detach(), weights64(packed, scale), [2, 3])
    torch.testing.assert_close(mxfp4.packed_grouped_mm(x, packed, scale, offsets), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(kernels, dtype):
    packed, scale = packed_weights(3, 24, 64, seed=13)
    offsets = torch.tensor([2, 2, 7])
    x = torch.randn(8, 64, generator=gen(14)).to(dtype).requires_grad_()
    grad = torch.randn(8, 24, generator=gen(15)).to(dtype)
    torch.library.opcheck(torch.ops.transformers_k3.mxfp4_grouped_mm.default, (x, packed, scale, offsets))
    torch.library.opcheck(torch.ops.transformers_k3.mxfp4_grouped_mm_backward.default, (grad, packed, scale, offsets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pytorch_path_equals_the_kernel(kernels, dtype):
    packed, scale = packed_weights(6, 64, 128, seed=16)
    w64 = weights64(packed, scale)
    counts = [1, 4, 5, 0, 3, 70]
    offsets = torch.tensor(counts).cumsum(0)
    x = torch.randn(sum(counts) + 1, 128, generator=gen(17)).to(dtype)
    grad = torch.randn(sum(counts) + 1, 64, generator=gen(18)).to(dtype)
    for forward, rows in ((True, x), (False, grad)):
        kernel = grouped("kernel", rows, packed, scale, offsets, forward).double()
        torch_path = grouped("pytorch", rows, packed, scale, offsets, forward).double()
        # the same fp32 sums in another order (each within its bound of the exact sum), for bf16 rounded once
        bound, _ = grouped64(rows.abs(), w64.abs(), counts, transpose=forward)
        tol = 2 * bound * rows.shape[1] * FP32_EPS + 1e-30
        if dtype == torch.bfloat16:
            tol = tol + torch_path.abs() * BF16_ULP
        assert bool(((kernel - torch_path).abs() <= tol).all())


def test_subnormal_weights_are_not_flushed(kernels):
    """Scale 0 (2^-127) makes every nonzero weight subnormal in fp32: the kernel must not flush them to zero."""
    packed = torch.full((1, 2, 16), 0x21, dtype=torch.uint8)  # codes 1 (0.5) and 2 (1.0)
    scale = torch.zeros((1, 2, 1), dtype=torch.uint8)
    x = torch.full((1, 32), 2.0**100)
    out = torch.ops.transformers_k3.mxfp4_grouped_mm.default(x, packed, scale, torch.tensor([1]))
    assert torch.equal(out, torch.full((1, 2), 16 * 1.5 * 2.0**100 * 2.0**-127))


def situ64(gate_up, beta=4.0, linear_beta=25.0):
    return situ_glu(*gate_up.chunk(2, dim=-1), beta=beta, linear_beta=linear_beta)


def experts64(x, index, weights, stacks):
    """The experts' weighted sum in float64 from each routed expert's dequantized weights."""
    gu_p, gu_s, dn_p, dn_s = stacks
    out = torch.zeros(x.shape[0], dn_p.shape[1], dtype=torch.float64)
    used = {}
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            if 0 <= e < gu_p.shape[0]:
                if e not in used:
                    used[e] = (dequantize_mxfp4(gu_p[e], gu_s[e], torch.float64),
                               dequantize_mxfp4(dn_p[e], dn_s[e], torch.float64))  # fmt: skip
                gate_up, down = used[e]
                out[t] += weights[t, j] * (down @ situ64(gate_up @ x[t]))
    return out


def moe_weights(experts, hidden, inter, seed):
    """Packed experts quantized from random weights with the release's rule (realistic codes and scales)."""
    w = torch.randn(experts * 2 * inter, hidden, generator=gen(seed)) / hidden**0.5
    d = torch.randn(experts * hidden, inter, generator=gen(seed + 1)) / inter**0.5
    gu_p, gu_s = quantize_mxfp4_release(w)
    dn_p, dn_s = quantize_mxfp4_release(d)
    return (gu_p.view(experts, 2 * inter, -1), gu_s.view(experts, 2 * inter, -1),
            dn_p.view(experts, hidden, -1), dn_s.view(experts, hidden, -1))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,tokens,top_k", [(8, 7, 2), (16, 1, 4), (896, 3, 16), (5, 33, 5)])
@pytest.mark.parametrize("kernel_on", [True, False])
def test_experts_forward_and_backward_match_float64(dtype, experts, tokens, top_k, kernel_on):
    hidden, inter = 64, 32
    stacks = moe_weights(experts, hidden, inter, seed=experts)
    x = torch.randn(tokens, hidden, generator=gen(20)).to(dtype).requires_grad_()
    index = torch.stack([torch.randperm(experts, generator=gen(21 + t))[:top_k] for t in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen(22)).requires_grad_()
    out = mxfp4.mxfp4_experts(x, index, weights, *stacks, lambda gu: situ64(gu), kernel=kernel_on)
    x64, w64 = x.detach().double().requires_grad_(), weights.detach().double().requires_grad_()
    want = experts64(x64, index, w64, stacks)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    rtol = 1e-5 if dtype == torch.float32 else 2e-2  # (bf16: the GLU's input, output and the result rounded)
    scale = float(want.detach().abs().max())
    torch.testing.assert_close(out.detach().double(), want.detach(), rtol=rtol, atol=rtol * scale)
    grad = torch.randn(tokens, hidden, generator=gen(23))
    out.backward(grad.to(dtype))
    want.backward(grad.double())
    gx_scale, gw_scale = float(x64.grad.abs().max()), float(w64.grad.abs().max())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=rtol, atol=rtol * gx_scale)
    torch.testing.assert_close(weights.grad.double(), w64.grad, rtol=rtol, atol=rtol * gw_scale)


def test_the_experts_compile_into_one_graph(kernels):
    """Under torch.compile(fullgraph=True) the operator is traced through its fake implementation and the graph
    calls the same kernel: the same output as eager."""
    stacks = moe_weights(4, 64, 32, seed=90)
    x = torch.randn(5, 64, generator=gen(91))
    index = torch.randint(0, 4, (5, 2), generator=gen(92))
    weights = torch.rand(5, 2, generator=gen(93))

    def experts(x, index, weights):
        return mxfp4.mxfp4_experts(x, index, weights, *stacks, situ64)

    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True, dynamic=False)(x, index, weights)
    torch.testing.assert_close(compiled, experts(x, index, weights), rtol=1e-6, atol=1e-6)


def test_out_of_range_ids_contribute_nothing():
    stacks = moe_weights(4, 32, 32, seed=30)
    x = torch.randn(3, 32, generator=gen(31))
    index = torch.tensor([[0, 4], [-1, 2], [3, 7]])
    weights = torch.rand(3, 2, generator=gen(32))
    got = mxfp4.mxfp4_experts(x, index, weights, *stacks, lambda gu: situ64(gu))
    want = experts64(x.double(), index, weights.double(), stacks)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_as_an_experts_implementation_it_computes_what_k3_grouped_mm_computes():
    """`mxfp4_experts_forward` on a `KimiK3Experts` that also holds the packed stacks gives the output of the
    module's dequantized weights under ``"k3_grouped_mm"``."""
    config = make_config(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    config._experts_implementation = K3_GROUPED_MM
    module = KimiK3Experts(config)
    stacks = moe_weights(8, module.hidden_dim, 32, seed=40)
    with torch.no_grad():
        module.gate_up_proj.copy_(weights64(*stacks[:2]).float())
        module.down_proj.copy_(weights64(*stacks[2:]).float())
    for name, t in zip(("gate_up_packed", "gate_up_scale", "down_packed", "down_scale"), stacks):
        module.register_buffer(name, t)
    x = torch.randn(6, module.hidden_dim, generator=gen(41))
    index = torch.stack([torch.randperm(8, generator=gen(42 + t))[:2] for t in range(6)])
    weights = torch.rand(6, 2, generator=gen(48))
    with torch.no_grad():
        want = module(x, index, weights)
        got = mxfp4.mxfp4_experts_forward(module, x, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_bad_shapes_and_values_are_refused():
    packed, scale = packed_weights(2, 8, 64)
    x, offsets = torch.randn(3, 64), torch.tensor([1, 3])
    with pytest.raises(QuantFormatError, match="uint8"):
        mxfp4.packed_grouped_mm(x, packed.to(torch.int16), scale, offsets)
    with pytest.raises(QuantFormatError, match="multiple of 32"):
        mxfp4.packed_grouped_mm(torch.randn(3, 48), packed[..., :24], scale[..., :1], offsets)
    with pytest.raises(QuantFormatError, match="does not fit"):
        mxfp4.packed_grouped_mm(x, packed, scale[:, :, :1], offsets)
    with pytest.raises(QuantFormatError, match=r"\[M, 64\]"):
        mxfp4.packed_grouped_mm(torch.randn(3, 32), packed, scale, offsets)
    with pytest.raises(QuantFormatError, match="offsets"):
        mxfp4.packed_grouped_mm(x, packed, scale, torch.tensor([3]))
    with pytest.raises(QuantFormatError, match="non-decreasing"):
        mxfp4_torch.mxfp4_grouped_mm(x, packed, scale, torch.tensor([2, 1]))
    with pytest.raises(QuantFormatError, match="within the 3 rows"):
        mxfp4_torch.mxfp4_grouped_mm(x, packed, scale, torch.tensor([1, 4]))

    stacks = list(moe_weights(2, 64, 32, seed=50))
    assert mxfp4.check_packed_experts(*stacks) == (2, 32, 64)
    bad = stacks[1].clone()
    bad[1, 3, 0] = 255
    with pytest.raises(QuantFormatError, match="255"):
        mxfp4.check_packed_experts(stacks[0], bad, *stacks[2:])
    bad = stacks[3].clone()
    bad[0, 0, 0] = 254  # 2^127 times a code of 2 or more is infinite
    nonzero = stacks[2].clone()
    nonzero[0, 0, :16] = 0x77
    with pytest.raises(QuantFormatError, match="infinite"):
        mxfp4.check_packed_experts(*stacks[:2], nonzero, bad)
    with pytest.raises(QuantFormatError, match="down_scale"):
        mxfp4.check_packed_experts(*stacks[:3], stacks[3][:, :, :0])


def test_the_kernel_refuses_bad_offsets(kernels):
    packed, scale = packed_weights(2, 8, 64)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        torch.ops.transformers_k3.mxfp4_grouped_mm.default(x, packed, scale, torch.tensor([2, 1]))
    with pytest.raises(RuntimeError, match="non-decreasing"):
        torch.ops.transformers_k3.mxfp4_grouped_mm.default(x, packed, scale, torch.tensor([1, 4]))


def test_stacking_keeps_the_release_bytes():
    experts = []
    for e in range(3):
        w1, w3 = torch.randn(32, 64, generator=gen(60 + e)), torch.randn(32, 64, generator=gen(70 + e))
        w2 = torch.randn(64, 32, generator=gen(80 + e))
        experts.append({name: quantize_mxfp4_release(w) for name, w in (("w1", w1), ("w2", w2), ("w3", w3))})
    gu_p, gu_s, dn_p, dn_s = mxfp4.stack_release_experts(experts)
    for e, ex in enumerate(experts):
        assert torch.equal(gu_p[e, :32], ex["w1"][0]) and torch.equal(gu_p[e, 32:], ex["w3"][0])
        assert torch.equal(gu_s[e, :32], ex["w1"][1]) and torch.equal(gu_s[e, 32:], ex["w3"][1])
        assert torch.equal(dn_p[e], ex["w2"][0]) and torch.equal(dn_s[e], ex["w2"][1])


def test_bench_runs_at_a_tiny_size():
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "bench/bench_mxfp4.py", "--threads", "1", "--experts", "16", "--top-k", "4", "--latent", "64",
         "--intermediate", "32", "--prefill-tokens", "8", "--decode-calls", "2", "--reps", "1"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| decode |") or line.startswith("| prefill |")]
    assert len(rows) == 12, result.stdout  # two tables, two steps, three rows each


# ----------------------------------------------------------------------------------------------------
# Decode step: a MoE layer with packed experts in one kernel call (kernelize: `moe_decode_mxfp4`)
# ----------------------------------------------------------------------------------------------------


def packed_layer(dtype=torch.float32, seed=0, **overrides):
    """A `KimiK3SparseMoE` (references.make_moe) whose experts are packed with the release's rule, in ``dtype`` (the
    selection bias fp32, as a bf16 load keeps it), kernelized; and its four stacks."""
    cfg, moe = make_moe(seed=seed, **overrides)
    plain = moe.experts
    packed = KimiK3PackedExperts(cfg)
    e, i, d = plain.num_experts, plain.intermediate_dim, plain.hidden_dim
    for name, weight, n, k in (("gate_up", plain.gate_up_proj, 2 * i, d), ("down", plain.down_proj, d, i)):
        codes, scales = quantize_mxfp4_release(weight.detach().reshape(-1, k))
        getattr(packed, f"{name}_packed").copy_(codes.view(e, n, k // 2))
        getattr(packed, f"{name}_scale").copy_(scales.view(e, n, k // 32))
    moe.experts = packed
    moe = moe.to(dtype)
    moe.gate.e_score_correction_bias = moe.gate.e_score_correction_bias.float()
    stacks = (packed.gate_up_packed, packed.gate_up_scale, packed.down_packed, packed.down_scale)
    return cfg, kernelize(moe), stacks


def packed_layer64(moe, stacks, x, cfg):
    """The layer in float64 from the spec's formulas (references.ref_moe), the experts' weights dequantized."""
    return ref_moe(moe, x, cfg, (weights64(*stacks[:2]), weights64(*stacks[2:])))


def decode_kernel():
    if cpu_kernel.library() is None or cpu_kernel.moe_decode_max_tokens() == 0:
        pytest.skip("the fused decode step needs the CPU kernels with AVX-512 or AVX2")


def layer_kernel(moe, x):
    """The layer's attached decode kernel on ``x`` (None: none attached, or it steps aside for the modules)."""
    with torch.no_grad():
        return None if moe.kernel is None else moe.kernel(x.reshape(-1, x.shape[-1]))


PACKED_DECODE_CASES = {
    "latent": {},
    "latent_no_norm": {"latent_moe_use_norm": False},
    "non_latent": {"routed_expert_hidden_size": None},
    "no_shared": {"num_shared_experts": 0},
    "silu": {"hidden_act": "silu"},
    "silu_no_shared": {"hidden_act": "silu", "num_shared_experts": 0},
    "no_linear_cap": {"activation_situ_linear_beta": None},
    "top16_of_896": {"num_experts": 896, "num_experts_per_tok": 16},
    "router_fp32": {"router_fp32": True},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(PACKED_DECODE_CASES))
def test_packed_decode_step_matches_float64_and_the_packed_modules(case, dtype):
    """A decode step (1-4 tokens, no autograd) of a layer with packed experts is one kernel call, the layer's value:
    in fp32 within 1e-5 of the float64 reference of the dequantized math and of the packed modules (the sums in
    another order); in bf16 the modules' values (rounded where they round) within a bf16 rounding, and within
    2e-2 of the float64 reference, as the modules are."""
    decode_kernel()
    cfg, moe, stacks = packed_layer(dtype, **PACKED_DECODE_CASES[case])
    for n in (1, 2, 4):
        x = torch.randn(1, n, cfg.hidden_size, generator=gen(100 + n)).to(dtype)
        with torch.no_grad():
            out = moe(x)
        kernel = layer_kernel(moe, x)
        assert kernel is not None and out.dtype == dtype and torch.equal(out.reshape(kernel.shape), kernel)
        modules = modules_path(moe, x)
        reference = packed_layer64(moe, stacks, x, cfg)
        if dtype == torch.float32:
            torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out, modules, atol=1e-6, rtol=1e-5)
        else:
            torch.testing.assert_close(out.float(), modules.float(), atol=1e-2 * float(modules.abs().max()), rtol=2**-7)
            assert ((out.double() - reference).norm() / reference.norm()) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_decode_operator(dtype):
    """``moe_decode_mxfp4`` passes opcheck; its PyTorch implementation (every other device) computes what the CPU
    kernel computes; a scale stack of the wrong shape is a named error."""
    decode_kernel()
    cfg, moe, stacks = packed_layer(dtype, num_experts=16, num_experts_per_tok=4)
    gate, shared = moe.gate, moe.shared_experts
    linears = [m.weight.detach() for m in (moe.routed_expert_down_proj, moe.routed_expert_up_proj, shared.gate_proj,
                                           shared.up_proj, shared.down_proj)]  # fmt: skip
    decode = cpu_kernel.MoeDecode(dtype, gate.weight.detach(), gate.e_score_correction_bias, gate.top_k,
                                  gate.renormalize, gate.routed_scaling_factor, linears[0],
                                  moe.routed_expert_norm.weight.detach(), moe.routed_expert_norm.variance_epsilon,
                                  linears[1], stacks[0], stacks[2], moe.experts.glu, tuple(linears[2:]),
                                  gate_up_scale=stacks[1], down_scale=stacks[3])  # fmt: skip
    assert decode.usable
    op = torch.ops.transformers_k3.moe_decode_mxfp4.default
    y = torch.randn(3, cfg.hidden_size, generator=gen(7)).to(dtype)
    torch.library.opcheck(op, (y, *decode.args))
    with torch.no_grad():
        got = op(y, *decode.args)
        other = op.redispatch(torch._C.DispatchKeySet(DispatchKey.CUDA), y, *decode.args)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), other.float(), **tol)
    torch.testing.assert_close(got.float(), modules_path(moe, y).float(), **tol)
    args = list(decode.args)
    args[10] = args[10][:, :, :-1]  # (gate_up_scale)
    with pytest.raises(RuntimeError, match="gate_up_scale must have shape"):
        op(y, *args)


def test_packed_decode_step_reads_the_stacks_at_each_call():
    """Stacks written in place or replaced (a frozen parameter set anew) reach the next decode step."""
    decode_kernel()
    cfg, moe, stacks = packed_layer()
    x = torch.randn(1, 1, cfg.hidden_size, generator=gen(5))
    outs = []
    for change in (None, "in_place", "replaced"):
        if change == "in_place":
            moe.experts.down_scale.add_(1)  # every down weight doubled
        elif change == "replaced":
            flipped = moe.experts.gate_up_packed ^ 0x08  # every gate/up code's sign flipped
            moe.experts.gate_up_packed = torch.nn.Parameter(flipped, requires_grad=False)
        with torch.no_grad():
            outs.append(moe(x))
        current = (moe.experts.gate_up_packed, moe.experts.gate_up_scale, moe.experts.down_packed,
                   moe.experts.down_scale)  # fmt: skip
        torch.testing.assert_close(outs[-1].double(), packed_layer64(moe, current, x, cfg), atol=1e-5, rtol=1e-5)
        assert layer_kernel(moe, x) is not None
    assert all(not torch.allclose(a, b) for a, b in zip(outs, outs[1:]))


def test_packed_decode_step_steps_aside_where_the_modules_must_run():
    """Autograd, a hook on the packed experts, LoRA over them (PEFT's custom module: another class), stacks on the
    meta device or a layer beyond the one-thread kernel's size run the modules, with their result."""
    decode_kernel()
    cfg, moe, stacks = packed_layer()
    x = torch.randn(1, 2, cfg.hidden_size, generator=gen(6))
    expected = modules_path(moe, x)
    with torch.enable_grad():
        assert moe.kernel(x.reshape(-1, cfg.hidden_size).requires_grad_()) is None
    handle = moe.experts.register_forward_hook(lambda *args: None)
    kernelize(moe)
    assert layer_kernel(moe, x) is None
    with torch.no_grad():
        assert torch.equal(moe(x), expected)
    handle.remove()
    kernelize(moe)
    assert layer_kernel(moe, x) is not None

    class Wrapped(KimiK3PackedExperts):  # (a LoRA or offloading wrapper is another class)
        pass

    wrapped = Wrapped(cfg)
    wrapped.load_state_dict(moe.experts.state_dict())
    moe.experts = wrapped
    assert layer_kernel(moe, x) is None
    with torch.no_grad():
        assert torch.equal(moe(x), expected)
    big_cfg, big, _ = packed_layer(hidden_size=512, routed_expert_hidden_size=256, num_experts=64,
                                   num_experts_per_tok=16, moe_intermediate_size=768)  # fmt: skip
    assert 16 * 3 * 256 * 768 > cpu_kernel.MOE_DECODE_MAX_MACS_MXFP4[torch.float32]
    big_x = torch.randn(1, 1, 512, generator=gen(8))
    assert layer_kernel(big, big_x) is None
    with torch.no_grad():
        torch.testing.assert_close(big(big_x), modules_path(big, big_x), atol=0, rtol=0)


def test_kernelized_packed_model_decodes_as_the_plain_packed_model():
    """A tiny K3 with packed experts, kernelized (every MoE layer's decode step one kernel call): its cached greedy
    decode gives the tokens of the same model without kernels and of the model holding the dequantized experts,
    its decode-step logits within 1e-5 (relative) of theirs, in fp32."""
    import copy

    from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig
    from transformers_k3.modeling_kimi_k3 import KimiK3SparseMoE

    decode_kernel()
    torch.manual_seed(0)
    dequantized = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval()
    plain = copy.deepcopy(dequantized)
    for name, experts in list(dequantized.named_modules()):
        if not isinstance(experts, KimiK3Experts):
            continue
        packed = KimiK3PackedExperts(plain.get_submodule(name).config)
        e, i, d = experts.num_experts, experts.intermediate_dim, experts.hidden_dim
        for stack, weight, n, k in (("gate_up", experts.gate_up_proj, 2 * i, d), ("down", experts.down_proj, d, i)):
            codes, scales = quantize_mxfp4_release(weight.detach().reshape(-1, k))
            getattr(packed, f"{stack}_packed").copy_(codes.view(e, n, k // 2))
            getattr(packed, f"{stack}_scale").copy_(scales.view(e, n, k // 32))
            with torch.no_grad():
                weight.copy_(weights64(getattr(packed, f"{stack}_packed"), getattr(packed, f"{stack}_scale")).float())
        parent, _, child = name.rpartition(".")
        setattr(plain.get_submodule(parent), child, packed)
    plain.set_experts_implementation(mxfp4.MXFP4_EXPERTS)  # (as the quantizer's load sets it)
    fused = kernelize(copy.deepcopy(plain))
    kernelize(dequantized)
    assert all(m.kernel is not None for m in fused.modules() if isinstance(m, KimiK3SparseMoE))
    prompt = torch.randint(3, 200, (1, 8), generator=gen(9))
    greedy = {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False}
    with torch.no_grad():
        tokens = [model.generate(prompt, **greedy) for model in (fused, plain, dequantized)]
        assert torch.equal(tokens[0], tokens[1]) and torch.equal(tokens[0], tokens[2])
        steps = []
        for model in (fused, plain, dequantized):
            out = model(tokens[0][:, :-1], use_cache=True)
            steps.append(model(tokens[0][:, -1:], past_key_values=out.past_key_values, use_cache=True).logits)
    for other in steps[1:]:
        assert (steps[0] - other).abs().max() <= 1e-5 * other.abs().max()
