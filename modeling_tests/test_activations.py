"""SiTU-GLU and SiLU-GLU (spec 6.1 and 11.1 item 10)."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from transformers_k3.modeling_kimi_k3 import GLU, SITU_BETA_WHEN_NONE, situ_glu


def situ_glu_packed(gate_up, beta=4.0, linear_beta=25.0):
    return GLU("situ", beta, linear_beta).packed(gate_up)

BETA, LINEAR_BETA = 4.0, 25.0


def _cfg(hidden_act="situ", beta=BETA, linear_beta=LINEAR_BETA):
    return SimpleNamespace(hidden_act=hidden_act, activation_situ_beta=beta, activation_situ_linear_beta=linear_beta)


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def _situ_scalar(a, u, beta=BETA, linear_beta=LINEAR_BETA):
    up = u if linear_beta is None else linear_beta * math.tanh(u / linear_beta)
    return beta * math.tanh(a / beta) * _sigmoid(a) * up


def test_values_match_the_spec_formula():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(257, generator=gen) * 6
    u = torch.randn(257, generator=gen) * 40
    out = situ_glu(a, u)
    ref = torch.tensor([_situ_scalar(x, y) for x, y in zip(a.double().tolist(), u.double().tolist())], dtype=torch.float64)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-6)


def test_linear_beta_none_leaves_up_uncapped():
    a = torch.linspace(-8, 8, 33, dtype=torch.float64)
    u = torch.linspace(-300, 300, 33, dtype=torch.float64)
    ref = torch.tensor([_situ_scalar(x, y, linear_beta=None) for x, y in zip(a.tolist(), u.tolist())], dtype=torch.float64)
    torch.testing.assert_close(situ_glu(a, u, linear_beta=None), ref, atol=1e-12, rtol=1e-12)


def test_zero_gate_gives_zero():
    u = torch.randn(100) * 100
    assert torch.equal(situ_glu(torch.zeros(100), u), torch.zeros(100))


def test_bounded_by_beta_times_linear_beta():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(10000, generator=gen, dtype=torch.float64) * 10
    u = torch.randn(10000, generator=gen, dtype=torch.float64) * 100
    out = situ_glu(a, u)
    assert out.abs().max() < BETA * LINEAR_BETA
    assert out.abs().max() > 0.5 * BETA * LINEAR_BETA  # the bound is nearly reached, not vacuous
    # in fp32 the caps are reached exactly once tanh and sigmoid round to 1, never exceeded
    huge = torch.tensor([1e4, -1e4, 3e38])
    assert situ_glu(huge, huge).abs().max() <= BETA * LINEAR_BETA


def test_small_inputs_match_silu_glu():
    gen = torch.Generator().manual_seed(2)
    a = (torch.rand(1000, generator=gen, dtype=torch.float64) * 2 - 1) * 0.1
    u = (torch.rand(1000, generator=gen, dtype=torch.float64) * 2 - 1) * 0.1
    ref = F.silu(a) * u
    rel = ((situ_glu(a, u) - ref).abs() / ref.abs()).max()
    assert rel < 1e-3


def test_gate_and_up_are_not_interchangeable():
    a = torch.tensor([2.0, -3.0, 0.5])
    u = torch.tensor([-1.0, 4.0, 30.0])
    assert not torch.allclose(situ_glu(a, u), situ_glu(u, a))


def _analytic_grads(a, u, beta=BETA, linear_beta=LINEAR_BETA):
    t, s, tu = torch.tanh(a / beta), torch.sigmoid(a), torch.tanh(u / linear_beta)
    gate_factor, up_factor = beta * t * s, linear_beta * tu
    d_gate = (1 - t**2) * s + beta * t * s * (1 - s)
    d_up = 1 - tu**2
    return d_gate * up_factor, gate_factor * d_up


def test_gradients_match_the_analytic_derivative():
    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(500, generator=gen) * 5).requires_grad_()
    u = (torch.randn(500, generator=gen) * 30).requires_grad_()
    situ_glu(a, u).sum().backward()
    da, du = _analytic_grads(a.detach(), u.detach())
    torch.testing.assert_close(a.grad, da, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(u.grad, du, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("linear_beta", [LINEAR_BETA, None])
def test_gradcheck_float64(linear_beta):
    gen = torch.Generator().manual_seed(4)
    a = (torch.randn(24, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    u = (torch.randn(24, generator=gen, dtype=torch.float64) * 30).requires_grad_()
    assert situ_glu(a, u).dtype == torch.float64
    assert torch.autograd.gradcheck(lambda x, y: situ_glu(x, y, BETA, linear_beta), (a, u))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_no_nan_for_huge_or_infinite_inputs(dtype):
    big = torch.finfo(dtype).max
    vals = torch.tensor([1e4, -1e4, big, -big, math.inf, -math.inf, 0.0], dtype=torch.float32).to(dtype)
    a, u = torch.meshgrid(vals, vals, indexing="ij")
    a, u = a.reshape(-1).clone().requires_grad_(), u.reshape(-1).clone().requires_grad_()
    out = situ_glu(a, u)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    out.float().sum().backward()
    assert torch.isfinite(a.grad).all() and torch.isfinite(u.grad).all()


def test_half_precision_is_computed_in_fp32_and_cast_back():
    gen = torch.Generator().manual_seed(5)
    a = (torch.randn(1000, generator=gen) * 5).bfloat16()
    u = (torch.randn(1000, generator=gen) * 30).bfloat16()
    out = situ_glu(a, u)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, situ_glu(a.float(), u.float()).bfloat16())


def test_the_gate_factor_is_a_capped_silu():
    a = torch.linspace(-20, 20, 101, dtype=torch.float64)
    gate = situ_glu(a, torch.full_like(a, math.inf)) / LINEAR_BETA  # (the up half capped at linear_beta)
    torch.testing.assert_close(gate, BETA * torch.tanh(a / BETA) * torch.sigmoid(a))
    assert gate.abs().max() < BETA


def test_glu_from_config_reads_the_betas():
    gen = torch.Generator().manual_seed(6)
    a, u = torch.randn(64, generator=gen) * 8, torch.randn(64, generator=gen) * 80
    torch.testing.assert_close(GLU.from_config(_cfg(beta=2.0, linear_beta=10.0))(a, u), situ_glu(a, u, 2.0, 10.0))
    torch.testing.assert_close(GLU.from_config(_cfg(linear_beta=None))(a, u), situ_glu(a, u, BETA, None))
    # beta None -> SITU_BETA_WHEN_NONE (1.0) for every FFN
    assert SITU_BETA_WHEN_NONE == 1.0
    torch.testing.assert_close(GLU.from_config(_cfg(beta=None))(a, u), situ_glu(a, u, 1.0, LINEAR_BETA))
    assert GLU.from_config(_cfg(beta=None)) == GLU("situ", 1.0, LINEAR_BETA)


def test_glu_silu_matches_transformers_bitwise():
    from transformers.activations import ACT2FN

    gen = torch.Generator().manual_seed(7)
    a, u = torch.randn(4, 64, generator=gen).bfloat16(), torch.randn(4, 64, generator=gen).bfloat16()
    fn = GLU.from_config(_cfg("silu", beta=None, linear_beta=None))
    assert fn.kind == "silu"
    out = fn(a, u)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ACT2FN["silu"](a) * u)
    assert torch.equal(fn.packed(torch.cat([a, u], -1)), out)


@pytest.mark.parametrize("act", ["gelu", "swish", "SiTU", None])
def test_unknown_hidden_act_raises(act):
    with pytest.raises(ValueError, match="hidden_act") as err:
        GLU.from_config(_cfg(act))
    assert "situ" in str(err.value) and "silu" in str(err.value)


def _packed(a, u):
    """[N] gate and up values as one [N / 4, 8] gate/up tensor (gate half first)."""
    return torch.cat([a.reshape(-1, 4), u.reshape(-1, 4)], -1)


@pytest.mark.parametrize("grad", [False, True])
def test_packed_matches_the_formula_and_situ_glu(grad):
    gen = torch.Generator().manual_seed(6)
    a, u = torch.randn(400, generator=gen) * 5, torch.randn(400, generator=gen) * 30
    gate_up = _packed(a, u).requires_grad_(grad)
    out = situ_glu_packed(gate_up)
    assert out.shape == (100, 4)
    ref = torch.tensor([_situ_scalar(x, y) for x, y in zip(a.double().tolist(), u.double().tolist())], dtype=torch.float64)
    torch.testing.assert_close(out.detach().reshape(-1).double(), ref, atol=2e-5, rtol=1e-6)
    torch.testing.assert_close(out.detach().reshape(-1), situ_glu(a, u), atol=2e-5, rtol=1e-6)
    torch.testing.assert_close(situ_glu_packed(_packed(a, u), BETA, None).reshape(-1), situ_glu(a, u, BETA, None))


def test_packed_gradients_match_the_analytic_derivative_and_gradcheck():
    gen = torch.Generator().manual_seed(7)
    a, u = torch.randn(500, generator=gen) * 5, torch.randn(500, generator=gen) * 30
    gate_up = _packed(a, u).requires_grad_()
    probe = torch.randn(125, 4, generator=gen)
    (situ_glu_packed(gate_up) * probe).sum().backward()
    da, du = _analytic_grads(a, u)
    torch.testing.assert_close(gate_up.grad[:, :4].reshape(-1), da * probe.reshape(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gate_up.grad[:, 4:].reshape(-1), du * probe.reshape(-1), atol=1e-5, rtol=1e-5)
    x = torch.cat([torch.randn(6, 3, generator=gen, dtype=torch.float64) * 4,
                   torch.randn(6, 3, generator=gen, dtype=torch.float64) * 30], -1).requires_grad_()
    assert situ_glu_packed(x).dtype == torch.float64
    assert torch.autograd.gradcheck(lambda t: situ_glu_packed(t, BETA, LINEAR_BETA), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_no_nan_for_huge_or_infinite_inputs(dtype):
    big = torch.finfo(dtype).max
    vals = torch.tensor([1e4, -1e4, big, -big, math.inf, -math.inf, 0.0], dtype=torch.float32).to(dtype)
    a, u = torch.meshgrid(vals, vals, indexing="ij")
    gate_up = torch.stack([a.reshape(-1), u.reshape(-1)], -1).requires_grad_()  # I = 1
    out = situ_glu_packed(gate_up)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), situ_glu(a.reshape(-1, 1), u.reshape(-1, 1)).float())
    out.float().sum().backward()
    assert torch.isfinite(gate_up.grad).all()


def test_packed_odd_width_and_from_config():
    for linear_beta in (LINEAR_BETA, None):
        with pytest.raises(ValueError, match="even"):
            situ_glu_packed(torch.zeros(2, 5), BETA, linear_beta)
    gate_up = torch.randn(7, 8)
    torch.testing.assert_close(GLU.from_config(_cfg()).packed(gate_up), situ_glu(*gate_up.chunk(2, -1)))
    torch.testing.assert_close(GLU.from_config(_cfg(beta=2.0, linear_beta=10.0)).packed(gate_up),
                               situ_glu(*gate_up.chunk(2, -1), 2.0, 10.0))
    a, u = gate_up.chunk(2, -1)
    assert torch.equal(GLU.from_config(_cfg("silu")).packed(gate_up), F.silu(a) * u)
