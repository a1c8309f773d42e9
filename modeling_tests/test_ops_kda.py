"""Tests for the KDA core (spec section 4.6): our chunked and recurrent PyTorch paths against fla's
naive recurrent reference (loaded by file path so fla's Triton-importing package init never runs) and
against our own naive twin. Every test runs twice: with the fused CPU kernel (which computes fp32 calls, under
autograd through the differentiable operator of ops/kda/autograd.py, see test_kda_autograd.py) and with it turned
off (the pure PyTorch path)."""

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F

from transformers_k3.ops import cpu_kernel
from transformers_k3.ops.kda import chunk as kda_ops
from transformers_k3.ops import kda
from transformers_k3.ops.kda import kda_gate
from transformers_k3.ops.kda.naive import naive_recurrent_kda

from references import assert_close, make_inputs


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """These tensors are tiny: intra-op threads gain nothing, and on a shared, oversubscribed machine
    every parallel region can stall for a scheduler time slice (measured: 60x slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# Whether the entry points below ask for the fused CPU kernel (``kernel=True``): set by `cpu_path` per test.
KERNEL = [False]


@pytest.fixture(autouse=True, params=["fused", "pytorch"])
def cpu_path(request):
    """Run the test with the fused CPU kernel, then with PyTorch (where the kernel is not built, the first run
    skips and says why)."""
    if request.param == "fused" and cpu_kernel.library() is None:
        pytest.skip(f"fused CPU kernels unavailable: {cpu_kernel.load_error()}")
    KERNEL[0] = request.param == "fused"
    try:
        yield request.param
    finally:
        KERNEL[0] = False


def chunk_kda(*args, **kwargs):
    """`ops.kda.chunk_kda` on the path `cpu_path` chose."""
    return kda.chunk_kda(*args, kernel=KERNEL[0], **kwargs)


def fused_recurrent_kda(*args, **kwargs):
    """`ops.kda.fused_recurrent_kda` on the path `cpu_path` chose."""
    return kda.fused_recurrent_kda(*args, kernel=KERNEL[0], **kwargs)


def chunk_kda_64(*args, **kwargs):
    """fla's default chunk size (the PyTorch path defaults to 32)."""
    return chunk_kda(*args, chunk_size=64, **kwargs)


OURS = [chunk_kda, chunk_kda_64, fused_recurrent_kda]


@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 300, 1000])
@pytest.mark.parametrize("decay", ["k3", "weak"])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("l2norm", [False, True])
def test_matches_fla_naive_tiny(fla_naive, length, decay, with_state, l2norm):
    q, k, v, g, beta, h0 = make_inputs(2, length, 4, 16, 16, decay, seed=length, normalise=not l2norm)
    if l2norm:
        q_ref = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k_ref = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    else:
        q_ref, k_ref = q, k
    initial = h0 if with_state else None
    ref_o, ref_s = fla_naive(q_ref, k_ref, v, g, beta, initial_state=initial, output_final_state=True)
    for fn in OURS:
        o, s = fn(q, k, v, g, beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        assert o.dtype == v.dtype and s.dtype == torch.float32
        assert_close(o, ref_o)
        assert_close(s, ref_s)


@pytest.mark.parametrize("length", [65, 300])
@pytest.mark.parametrize("decay", ["k3", "weak"])
def test_matches_fla_naive_head_dim_128(fla_naive, length, decay):
    q, k, v, g, beta, h0 = make_inputs(1, length, 2, 128, 128, decay, seed=7)
    ref_o, ref_s = fla_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for fn in OURS:
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert_close(o, ref_o)
        assert_close(s, ref_s)


def test_long_sequence_chunked(fla_naive):
    q, k, v, g, beta, h0 = make_inputs(1, 4097, 2, 16, 16, "k3", seed=11)
    ref_o, ref_s = fla_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for fn in (chunk_kda, chunk_kda_64):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert_close(o, ref_o)
        assert_close(s, ref_s)


@pytest.mark.parametrize("decay", ["k3", "extreme"])
def test_decays_beyond_the_gate_bound(fla_naive, decay):
    """-40..-120 per step: sub-chunks shrink (down to single tokens) until no exponent can overflow."""
    q, k, v, g, beta, h0 = make_inputs(1, 150, 2, 16, 16, decay, seed=5)
    g[:, :40] *= 20.0  # also spans > 80 within 16-token sub-chunks for the k3 case
    ref_o, ref_s = fla_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for fn in OURS:
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert torch.isfinite(o).all()
        assert_close(o, ref_o)
        assert_close(s, ref_s)


@pytest.mark.parametrize("decay", ["k3", "weak"])
def test_whole_decays_inside_sub_chunks(fla_naive, decay):
    """Each decay inside a sub-chunk taken whole, the exponential of its own segment's sum (what a graph takes when
    the caller gives no bound on the gate, here compiled; eager where a sub-chunk's span is too wide to factor):
    fla's recurrence."""
    q, k, v, g, beta, h0 = make_inputs(2, 150, 2, 16, 16, decay, seed=9)
    ref_o, ref_s = fla_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch._dynamo.reset()
    for fn in (chunk_kda, chunk_kda_64):
        o, s = torch.compile(fn, backend="eager", fullgraph=True)(q, k, v, g, beta, initial_state=h0,
                                                                  output_final_state=True)  # fmt: skip
        assert_close(o, ref_o)
        assert_close(s, ref_s)


def test_grouped_values_and_options(fla_naive):
    """GVA (HV = 2H), a chunk of three 16-token sub-chunks."""
    q, k, v, g, beta, h0 = make_inputs(2, 90, 2, 16, 8, "k3", seed=3, v_heads=4)
    ref_o, ref_s = fla_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for fn in OURS:
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert_close(o, ref_o)
        assert_close(s, ref_s)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=48)
    assert_close(o, ref_o)
    assert_close(s, ref_s)


def test_our_naive_matches_fla_naive(fla_naive):
    q, k, v, g, beta, h0 = make_inputs(2, 70, 2, 8, 8, "k3", seed=2)
    ref = fla_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ours = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close(ours[0], ref[0], atol=1e-6)
    assert_close(ours[1], ref[1], atol=1e-6)


@pytest.mark.parametrize("with_state", [False, True])
def test_varlen_equals_separate_runs(fla_naive, with_state):
    lengths = [1, 63, 64, 130, 7]
    total = sum(lengths)
    q, k, v, g, beta, _ = make_inputs(1, total, 4, 16, 16, "k3", seed=9)
    states = torch.randn(len(lengths), 4, 16, 16, generator=torch.Generator().manual_seed(4))
    initial = states if with_state else None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    for fn in OURS:
        o, s = fn(q, k, v, g, beta, initial_state=initial, output_final_state=True, cu_seqlens=cu)
        for i, (start, end) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
            piece = [x[:, start:end] for x in (q, k, v, g, beta)]
            init_i = states[i : i + 1] if with_state else None
            ref_o, ref_s = fla_naive(*piece, initial_state=init_i, output_final_state=True)
            alone_o, alone_s = fn(*piece, initial_state=init_i, output_final_state=True)
            assert_close(o[:, start:end], ref_o)
            assert_close(s[i : i + 1], ref_s)
            assert_close(o[:, start:end], alone_o, atol=1e-6)
            assert_close(s[i : i + 1], alone_s, atol=1e-6)
        # same answer from our naive twin, which handles cu_seqlens by looping over sequences
        ref_o, ref_s = naive_recurrent_kda(
            q, k, v, g, beta, initial_state=initial, output_final_state=True, cu_seqlens=cu
        )
        assert_close(o, ref_o)
        assert_close(s, ref_s)


@pytest.mark.parametrize("group_elements", [1, 3 * 32 * 16])
@pytest.mark.parametrize("grad", [False, True])
def test_chunked_groups_of_steps(fla_naive, group_elements, grad):
    """The chunked path gathers, solves and scans the sequence a group of consecutive steps at a time;
    groups of one step and of a few steps (one that ends inside the padded last block, uneven counts
    of active packed sequences: sizes real shapes reach rarely, asked for by ``group_elements``) give fla's
    answer, with and without autograd (in-place state)."""
    q, k, v, g, beta, h0 = make_inputs(2, 150, 2, 16, 16, "k3", seed=21)

    def chunked(q, k, v, g, beta, state, bounds=None):
        with torch.set_grad_enabled(grad):
            inputs = [x.clone().requires_grad_(grad) for x in (q, k, v, g, beta)]
            return kda_ops.chunked_reference(*inputs, state, bounds, 16**-0.5, kda_ops.TORCH_CHUNK_SIZE,
                                             group_elements)  # fmt: skip

    ref_o, ref_s = fla_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunked(q, k, v, g, beta, h0)
    assert_close(o, ref_o)
    assert_close(s, ref_s)
    lengths = [70, 5, 33, 0, 42]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    flat = [x[:1, : sum(lengths)] for x in (q, k, v, g, beta)]
    states = torch.randn(len(lengths), 2, 16, 16, generator=torch.Generator().manual_seed(5))
    o, s = chunked(*flat, states, cu.tolist())
    for i, (start, end) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
        piece = [x[:, start:end] for x in flat]
        ref_o, ref_s = fla_naive(*piece, initial_state=states[i : i + 1], output_final_state=True)
        assert_close(o[:, start:end], ref_o)
        assert_close(s[i : i + 1], ref_s)


def test_chunked_leaves_inputs_and_initial_state_untouched():
    """Without gradients the chunked path updates its state in place and scales q as it gathers each
    group: neither may write into the caller's tensors (a single head and sequence makes the gathered
    blocks views of the inputs)."""
    for batch, heads in ((1, 1), (2, 3)):
        inputs = make_inputs(batch, 70, heads, 8, 8, "k3", seed=3)
        before = [x.clone() for x in inputs]
        with torch.no_grad():
            chunk_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
        for x, y in zip(inputs, before):
            torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_varlen_empty_sequences_and_empty_input():
    q, k, v, g, beta, _ = make_inputs(1, 5, 2, 8, 8, "k3")
    states = torch.randn(3, 2, 8, 8)
    cu = torch.tensor([0, 0, 5, 5])
    for fn in OURS:
        o, s = fn(q, k, v, g, beta, initial_state=states, output_final_state=True, cu_seqlens=cu)
        torch.testing.assert_close(s[0], states[0], atol=0, rtol=0)
        torch.testing.assert_close(s[2], states[2], atol=0, rtol=0)
        ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=states[1:2], output_final_state=True)
        assert_close(o, ref_o)
        assert_close(s[1:2], ref_s)
        empty = [x[:, :0] for x in (q, k, v, g, beta)]
        o, s = fn(*empty, initial_state=states[:1], output_final_state=True)
        assert o.shape == (1, 0, 2, 8)
        torch.testing.assert_close(s, states[:1], atol=0, rtol=0)


def test_strided_inputs():
    """Slices along T of a batch (as a caller splitting a prompt passes them) are not contiguous."""
    q, k, v, g, beta, h0 = make_inputs(3, 60, 2, 8, 8, "k3", seed=8)
    window = [x[:, 5:55] for x in (q, k, v, g, beta)]
    assert not window[0].is_contiguous()
    ref_o, ref_s = naive_recurrent_kda(*window, initial_state=h0, output_final_state=True)
    for fn in OURS:
        o, s = fn(*window, initial_state=h0, output_final_state=True)
        assert o.is_contiguous()
        assert_close(o, ref_o)
        assert_close(s, ref_s)


@pytest.mark.parametrize("fn", OURS)
def test_bf16_inputs(fla_naive, fn):
    q, k, v, g, beta, h0 = make_inputs(2, 130, 4, 16, 16, "k3", seed=12)
    q, k, v, g, beta = (x.bfloat16() for x in (q, k, v, g, beta))
    ref_o, ref_s = fla_naive(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0, output_final_state=True)
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_close(o, ref_o, atol=2e-2)
    assert_close(s, ref_s, atol=2e-2)


@pytest.mark.parametrize("fn", OURS)
def test_gradients_match_naive_autograd(fla_naive, fn):
    q, k, v, g, beta, h0 = make_inputs(2, 70, 2, 8, 8, "k3", seed=21, normalise=False)
    cotangent_o = torch.randn(2, 70, 2, 8, generator=torch.Generator().manual_seed(1))
    cotangent_s = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(2))

    def grads(run, l2norm_outside):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        qq, kk, vv, gg, bb, hh = leaves
        if l2norm_outside:
            qq = qq / torch.sqrt((qq * qq).sum(-1, keepdim=True) + 1e-6)
            kk = kk / torch.sqrt((kk * kk).sum(-1, keepdim=True) + 1e-6)
        o, s = run(qq, kk, vv, gg, bb, hh)
        ((o * cotangent_o).sum() + (s * cotangent_s).sum()).backward()
        return [leaf.grad for leaf in leaves]

    expected = grads(lambda *a: fla_naive(*a[:5], initial_state=a[5], output_final_state=True), True)
    actual = grads(
        lambda *a: fn(*a[:5], initial_state=a[5], output_final_state=True, use_qk_l2norm_in_kernel=True), False
    )
    for name, got, want in zip("q k v g beta h0".split(), actual, expected):
        diff = (got - want).abs().max().item()
        assert diff <= 1e-4, f"grad {name}: max abs diff {diff:.2e}"


@pytest.mark.parametrize("factored", [True, False], ids=["factored", "whole"])
def test_gradcheck_float64(monkeypatch, factored):
    """Tiny float64 case with four 2-token sub-chunks per chunk, so the sub-chunk links, the solve,
    padding, varlen and the state hand-off are all differentiated; the decays inside a sub-chunk factored around
    its middle (eager, small decays), or each taken whole (what a graph without a bound on the gate computes:
    compiled)."""
    monkeypatch.setattr(kda_ops, "_SUB_CHUNK", 2)  # why: gradcheck needs tiny shapes that still span sub-chunks
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    q, k, v = leaf(1, 9, 1, 3), leaf(1, 9, 1, 3), leaf(1, 9, 1, 2)
    g = (-torch.rand(1, 9, 1, 3, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    beta = torch.rand(1, 9, 1, generator=gen, dtype=torch.float64).requires_grad_()
    h0 = leaf(2, 1, 3, 2)
    cu = torch.tensor([0, 6, 9])

    torch._dynamo.reset()
    whole = torch.compile(chunk_kda, backend="eager", fullgraph=True)
    cases = ((chunk_kda, {"chunk_size": 8}), (fused_recurrent_kda, {})) if factored else ((whole, {"chunk_size": 8}),)
    for fn, extra in cases:

        def run(q, k, v, g, beta, h0, fn=fn, extra=extra):
            return fn(
                q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu, **extra,
            )  # fmt: skip

        assert torch.autograd.gradcheck(run, (q, k, v, g, beta, h0))


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_gate_formula(lower_bound):
    """The one KDA gate (ops/kda/gate.py) is spec 4.4's formula, in fp32 from a bf16 projection."""
    gen = torch.Generator().manual_seed(6)
    raw = torch.randn(1, 80, 2, 8, generator=gen).bfloat16()
    A_log = torch.randn(2, generator=gen)
    dt_bias = torch.randn(16, generator=gen)
    f, b = raw.float(), dt_bias.view(2, 8)
    if lower_bound is None:  # spec 4.4, alternative form
        explicit = -A_log.exp()[:, None] * F.softplus(f + b)
    else:  # spec 4.4, K3 safe gate
        explicit = lower_bound * torch.sigmoid(A_log.exp()[:, None] * (f + b))
    torch.testing.assert_close(kda_gate(raw, A_log, dt_bias, lower_bound), explicit, atol=1e-6, rtol=1e-6)
    assert kda_gate(raw, A_log, dt_bias, lower_bound).dtype == torch.float32
    gate64 = kda_gate(raw.double(), A_log.double(), dt_bias.double(), lower_bound)
    assert gate64.dtype == torch.float64
    torch.testing.assert_close(gate64, explicit.double(), atol=1e-6, rtol=1e-6)


def test_state_history_matches_fla_naive(fla_naive):
    """``output_state_history``: the state before the window and after each of its tokens, each fla's naive
    recurrence run to that token, and none aliasing another (a cache keeps them all to roll back)."""
    q, k, v, g, beta, h0 = make_inputs(2, 6, 2, 8, 8, "k3", seed=4)
    o, final, history = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            output_state_history=True)
    assert len(history) == 7 and history[0] is h0 and history[-1] is final
    assert len({x.data_ptr() for x in history}) == 7
    ref_o, _ = fla_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close(o, ref_o)
    for t in range(7):
        window = [x[:, :t] for x in (q, k, v, g, beta)]
        ref_s = h0 if t == 0 else fla_naive(*window, initial_state=h0, output_final_state=True)[1]
        assert_close(history[t], ref_s)
    _, _, from_zero = fused_recurrent_kda(q, k, v, g, beta, output_state_history=True)
    assert torch.equal(from_zero[0], torch.zeros_like(h0))
    with pytest.raises(ValueError, match="cu_seqlens"):
        fused_recurrent_kda(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 6]),
                            output_state_history=True)


def test_recurrent_leaves_initial_state_untouched():
    q, k, v, g, beta, h0 = make_inputs(2, 3, 2, 8, 8)
    before = h0.clone()
    with torch.no_grad():
        fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(h0, before, atol=0, rtol=0)


@pytest.mark.parametrize("heads", [(4, 4), (2, 4)])
def test_single_token_step_in_place_matches_fla_naive(fla_naive, heads):
    """A decode step (T = 1) takes the lean single-token path; with ``inplace_final_state`` it writes the new
    state into the caller's buffer (returning that very tensor), else it leaves it alone. Both equal fla's naive
    reference (<= 1e-5), with grouped values (HV > H) too."""
    h, hv = heads
    q, k, v, g, beta, h0 = make_inputs(3, 1, h, 16, 16, v_heads=hv, seed=3)
    q_ref, k_ref = (x.repeat_interleave(hv // h, dim=2) for x in (q, k))
    ref_o, ref_s = fla_naive(q_ref, k_ref, v, g, beta, initial_state=h0, output_final_state=True)
    given = h0.clone()
    before = given.clone()
    with torch.no_grad():
        o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=given, output_final_state=True)
        assert torch.equal(given, before)
        o2, s2 = fused_recurrent_kda(q, k, v, g, beta, initial_state=given, output_final_state=True,
                                     inplace_final_state=True)
    assert s2 is given and torch.equal(o2, o) and torch.equal(s2, s)
    assert_close(o, ref_o)
    assert_close(s, ref_s)
    with pytest.raises(ValueError, match="inplace_final_state"):
        fused_recurrent_kda(q, k, v, g, beta, output_final_state=True, inplace_final_state=True)
    with pytest.raises(ValueError, match="cannot be differentiated"):
        fused_recurrent_kda(q.requires_grad_(), k, v, g, beta, initial_state=h0, output_final_state=True,
                            inplace_final_state=True)


@pytest.mark.parametrize("length", [1, 40])
def test_fp32_math_under_cpu_autocast(fla_naive, length):
    """Under bf16 CPU autocast the operator keeps its fp32 math and state: a decode step updating its state in place
    and a chunked call return fp32 values as close to fla's naive reference (<= 1e-5) as without autocast."""
    q, k, v, g, beta, h0 = make_inputs(2, length, 2, 16, 16, seed=5)
    ref_o, ref_s = fla_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for fn, options in ((fused_recurrent_kda, {"inplace_final_state": True}), (chunk_kda, {})):
        given = h0.clone()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            o, s = fn(q, k, v, g, beta, initial_state=given, output_final_state=True, **options)
        assert o.dtype == s.dtype == torch.float32
        assert (s is given) == bool(options)
        assert_close(o, ref_o)
        assert_close(s, ref_s)


def test_loops_restore_thread_count():
    """Small sequential loops drop to one intra-op thread and must hand the caller's setting back."""
    q, k, v, g, beta, h0 = make_inputs(1, 40, 2, 8, 8)
    expected = [fn(q, k, v, g, beta, initial_state=h0[:1], output_final_state=True) for fn in OURS]
    torch.set_num_threads(2)
    try:
        for fn, (ref_o, ref_s) in zip(OURS, expected):
            o, s = fn(q, k, v, g, beta, initial_state=h0[:1], output_final_state=True)
            assert torch.get_num_threads() == 2
            assert_close(o, ref_o, atol=1e-6)
            assert_close(s, ref_s, atol=1e-6)
    finally:
        torch.set_num_threads(1)


def test_argument_errors():
    q, k, v, g, beta, h0 = make_inputs(2, 5, 2, 8, 8)
    cu = torch.tensor([0, 2, 5])
    cases = [
        (dict(cu_seqlens=cu), "batch size 1"),
        (dict(g=g[..., :4]), "g must be"),
        (dict(beta=beta[..., None]), "beta must be"),
        (dict(k=k[:, :, :1]), "k must have q's shape"),
        (dict(v=v[:, :3]), "v must be"),
        (dict(initial_state=h0[:1]), "initial_state must be"),
        (dict(q=q.long()), "floating-point"),
    ]
    for fn in OURS:
        for overrides, message in cases:
            args = dict(q=q, k=k, v=v, g=g, beta=beta)
            args.update(overrides)
            with pytest.raises(ValueError, match=message):
                fn(**args)
    with pytest.raises(ValueError, match="end at T"):
        chunk_kda(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q, k, v, g, beta, chunk_size=0)


def _fla_parameters(relative_path, function):
    """Parameter names of an fla function, read from its source (importing fla needs Triton)."""
    import ast

    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("flash-linear-attention (fla) is not installed")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / relative_path
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    return {a.arg for a in node.args.args + node.args.kwonlyargs}


def test_the_cuda_path_hands_fla_only_its_own_arguments():
    """No GPU here: on CUDA tensors the layer calls fla's kernels through transformers' hub fallback, which drops
    arguments fla does not name; every argument the layer's functions take must be one of fla's (but the in-place
    state update, which fla's public recurrent entry point does not take: the cache stores the state it returns)."""
    import inspect

    from transformers_k3.modeling_kimi_k3 import _hub_chunk_kda, _hub_fused_recurrent_kda

    chunk_args = _fla_parameters("ops/kda/chunk.py", "chunk_kda")
    recurrent_args = _fla_parameters("ops/kda/fused_recurrent.py", "fused_recurrent_kda")
    ours_chunk = set(inspect.signature(_hub_chunk_kda).parameters)
    ours_recurrent = set(inspect.signature(_hub_fused_recurrent_kda).parameters) - {"inplace_final_state"}
    assert ours_chunk <= chunk_args, ours_chunk - chunk_args
    assert ours_recurrent <= recurrent_args, ours_recurrent - recurrent_args
