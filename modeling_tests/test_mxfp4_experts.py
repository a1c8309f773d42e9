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

from references import make_config

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
