"""Tests for the depthwise causal short convolution (spec section 4.2)."""

import pytest
import torch
import torch.nn.functional as F

from transformers_k3.ops.conv import causal_conv1d, causal_conv1d_update

WIDTH = 4


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny tensors: intra-op threads gain nothing and stall on an oversubscribed machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def reference_conv(x, weight, activation="silu", initial_state=None):
    """Explicit loop: y_t[c] = act(sum_j w[c, j] * z_{t - W + 1 + j}[c]), history from initial_state."""
    batch, length, channels = x.shape
    width = weight.shape[1]
    history = torch.zeros(batch, channels, width - 1, dtype=torch.float64)
    if initial_state is not None:
        history = initial_state.double()
    stream = torch.cat([history, x.double().transpose(1, 2)], dim=-1)  # [B, D, W - 1 + T]
    y = torch.zeros(batch, length, channels, dtype=torch.float64)
    for t in range(length):
        for j in range(width):
            y[:, t] += weight.double()[:, j] * stream[:, :, t + j]
    if activation is not None:
        y = F.silu(y)
    return y, stream[:, :, stream.shape[-1] - (width - 1) :]


def make(batch=2, length=9, channels=6, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, WIDTH, generator=gen)
    state = torch.randn(batch, channels, WIDTH - 1, generator=gen)
    return x, weight, state


@pytest.mark.parametrize("length", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_loop_reference(length, activation, with_state):
    x, weight, state = make(length=length)
    initial = state if with_state else None
    y, final = causal_conv1d(x, weight, activation, initial_state=initial, output_final_state=True)
    ref_y, ref_final = reference_conv(x, weight, activation, initial)
    torch.testing.assert_close(y.double(), ref_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final.double(), ref_final, atol=0, rtol=0)


def test_final_state_only_when_asked_and_conv_module_weight_layout():
    x, weight, _ = make()
    y, final = causal_conv1d(x, weight)
    assert final is None
    y3, _ = causal_conv1d(x, weight[:, None, :])  # nn.Conv1d's [D, 1, W]
    torch.testing.assert_close(y, y3, atol=0, rtol=0)


@pytest.mark.parametrize("split", [1, 2, 3, 5])
def test_prefill_continuation(split):
    x, weight, state = make(length=11)
    full, full_final = causal_conv1d(x, weight, initial_state=state, output_final_state=True)
    first, mid = causal_conv1d(x[:, :split], weight, initial_state=state, output_final_state=True)
    second, last = causal_conv1d(x[:, split:], weight, initial_state=mid, output_final_state=True)
    torch.testing.assert_close(torch.cat([first, second], 1), full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(last, full_final, atol=0, rtol=0)


@pytest.mark.parametrize("step", [1, 3])
def test_prefill_then_update(step):
    x, weight, state = make(length=12)
    full, full_final = causal_conv1d(x, weight, initial_state=state, output_final_state=True)
    prompt = 2  # shorter than W - 1: the cache must keep part of the initial state
    out, cache = causal_conv1d(x[:, :prompt], weight, initial_state=state, output_final_state=True)
    outputs = [out]
    for t in range(prompt, x.shape[1], step):
        outputs.append(causal_conv1d_update(x[:, t : t + step], cache, weight))
    torch.testing.assert_close(torch.cat(outputs, 1), full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache, full_final, atol=0, rtol=0)


def test_update_writes_cache_in_place_in_its_dtype():
    x, weight, state = make(length=1, dtype=torch.bfloat16)
    cache = state.to(torch.bfloat16)
    storage = cache.data_ptr()
    y = causal_conv1d_update(x, cache, weight)
    assert y.dtype == torch.bfloat16 and cache.dtype == torch.bfloat16 and cache.data_ptr() == storage
    torch.testing.assert_close(cache[..., -1], x[:, 0], atol=0, rtol=0)


@pytest.mark.parametrize("with_state", [False, True])
def test_varlen_equals_separate(with_state):
    lengths = [1, 2, 0, 7, 3, 5]
    channels = 5
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, WIDTH, generator=gen)
    states = torch.randn(len(lengths), channels, WIDTH - 1, generator=gen) if with_state else None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    y, final = causal_conv1d(x, weight, initial_state=states, output_final_state=True, cu_seqlens=cu)
    for i, (start, end) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
        init = states[i : i + 1] if with_state else None
        y_i, final_i = causal_conv1d(x[:, start:end], weight, initial_state=init, output_final_state=True)
        torch.testing.assert_close(y[:, start:end], y_i, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(final[i : i + 1], final_i, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_over_concatenated_channels_is_the_separate_updates_bitwise(dtype):
    """KDA's decode step updates q's, k's and v's convolutions in one call over their concatenated channels (the
    cache holds them as one [B, 3P, W - 1] window): bitwise the three calls on the window's channel blocks, the
    outputs and the updated window alike, for one and a few tokens."""
    gen = torch.Generator().manual_seed(0)
    for batch, steps, channels, width in [(1, 1, 512, 4), (2, 1, 64, 4), (3, 2, 96, 4), (4, 1, 48, 3)]:
        xs = [torch.randn(batch, steps, channels, generator=gen).to(dtype) for _ in range(3)]
        weights = [torch.randn(channels, width, generator=gen) for _ in range(3)]
        window = torch.randn(batch, 3 * channels, width - 1, generator=gen).to(dtype)
        separate, joint = window.clone(), window.clone()
        want = [causal_conv1d_update(x, separate[:, i * channels:(i + 1) * channels], w)
                for i, (x, w) in enumerate(zip(xs, weights))]
        got = causal_conv1d_update(torch.cat(xs, dim=-1), joint, torch.cat(weights)).split(channels, dim=-1)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(joint, separate)


def test_bf16_inputs_fp32_weights():
    x, weight, state = make(length=7, dtype=torch.bfloat16)
    y, final = causal_conv1d(x, weight, initial_state=state.bfloat16(), output_final_state=True)
    assert y.dtype == torch.bfloat16 and final.dtype == torch.bfloat16
    ref, _ = reference_conv(x.float(), weight, "silu", state.bfloat16().float())
    torch.testing.assert_close(y.double(), ref, atol=2e-2, rtol=2e-2)


def test_gradcheck_varlen_float64():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 6, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, WIDTH, generator=gen, dtype=torch.float64, requires_grad=True)
    state = torch.randn(2, 3, WIDTH - 1, generator=gen, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 2, 6])

    def fn(x, weight, state):
        y, final = causal_conv1d(x, weight, initial_state=state, output_final_state=True, cu_seqlens=cu)
        return y, final

    assert torch.autograd.gradcheck(fn, (x, weight, state))


def test_errors():
    x, weight, state = make()
    with pytest.raises(ValueError, match="batch size 1"):
        causal_conv1d(x, weight, cu_seqlens=torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="weight must have shape"):
        causal_conv1d(x, weight[:3])
    with pytest.raises(ValueError, match="initial_state must have shape"):
        causal_conv1d(x, weight, initial_state=state[..., :2])
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, weight, activation="gelu")
    with pytest.raises(ValueError, match="end at T"):
        causal_conv1d(x[:1], weight, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="conv_state must have shape"):
        causal_conv1d_update(x[:, :1], state[:1], weight)
